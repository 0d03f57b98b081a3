"""checkpoint.py: train.py's checkpoints, DeepSpeed's published beside them, and
Hugging Face GPT-2 and Llama directories in and out.

A save is atomic (written under a temporary name, fsynced, renamed into place,
then the `latest` pointer replaced), so a crash or a power loss leaves the
previous checkpoint readable; a diverged model never reaches one; --load reads
the newest checkpoint of either kind. The DeepSpeed runs that write ZeRO
checkpoints (and their export) are in test_zero.py; resuming across layouts
in test_train.py. The Hugging Face tests build random transformers models and
check that ours computes the same logits, both ways.
"""
import dataclasses
import json

import pytest
import torch

from checkpoint import from_hf, hf_to_ours, ours_to_hf, to_hf
from conftest import tiny, tiny_model, tokens
from parallel import UsageError
from gpt import GPT, LLAMA_OPTIONS


# -----------------------------------------------------------------------------
# Hugging Face GPT-2 in and out (checkpoint.from_hf, to_hf and their state dict maps)


def random_hf_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # randomize everything, biases and LayerNorms included
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_from_hf_gives_same_logits_as_transformers(tmp_path, safe_serialization):
    theirs = random_hf_model()
    theirs.save_pretrained(tmp_path, safe_serialization=safe_serialization)
    ours = from_hf(str(tmp_path)).eval()
    assert ours.config.vocab_size == 100 and ours.config.padded_vocab_size == 128
    x = tokens(T=32)
    with torch.no_grad():
        want = theirs(x).logits
        got = ours(x)
    torch.testing.assert_close(got[..., :100], want, atol=1e-5, rtol=1e-5)
    assert torch.all(got[..., 100:] == 0)  # zero padding rows -> zero logits


def test_to_hf_is_loaded_by_transformers_with_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    ours = tiny_model(max_position_embeddings=32).eval()
    with torch.no_grad():  # non-trivial LayerNorms and biases
        for name, p in ours.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.normal_(0.0, 0.2)
    to_hf(ours, str(tmp_path))
    theirs = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    x = tokens(T=32)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, ours(x)[..., :100], atol=1e-5, rtol=1e-5)
    # And back again: export -> import is lossless, except that the padding
    # rows (dropped on export) come back as zeros.
    again = from_hf(str(tmp_path), padded_vocab_size=128).state_dict()
    for k, v in ours.state_dict().items():
        if k == "wte.weight":
            again[k], v = again[k][:100], v[:100]
        torch.testing.assert_close(again[k], v, atol=0, rtol=0)


def test_state_dict_conversion_transposes_conv1d_and_pads_vocab():
    config = tiny()
    ours = GPT(config).state_dict()
    hf = ours_to_hf(ours, config)
    assert hf["transformer.wte.weight"].shape == (100, 64)
    assert hf["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)  # Conv1D (in, out)
    assert torch.equal(hf["transformer.h.1.mlp.c_fc.weight"], ours["blocks.1.mlp.fc.weight"].t())
    back = hf_to_ours(hf, config)
    assert back.keys() == ours.keys()
    assert torch.equal(back["wte.weight"][100:], torch.zeros(28, 64))


def test_from_hf_rejects_untied_head_and_missing_dir(tmp_path):
    config = tiny()
    hf = ours_to_hf(GPT(config).state_dict(), config)
    hf["lm_head.weight"] = torch.randn(100, 64)
    with pytest.raises(ValueError, match="tied"):
        hf_to_ours(hf, config)
    with pytest.raises(UsageError, match="config.json"):
        from_hf(str(tmp_path / "nope"))



# -----------------------------------------------------------------------------
# Hugging Face Llama in and out (checkpoint.from_hf, checkpoint.to_hf)


# Llama's options; rotary_percent stays 1 (Llama rotates whole heads).
LLAMA = dict(LLAMA_OPTIONS, num_query_groups=2, rotary_base=500.0, layernorm_epsilon=1e-6)


def randomized(m: GPT, seed=3) -> GPT:
    """Every weight random (norm weights too), so no mapping hides behind ones."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return m.eval()


def unpadded(sd: dict, vocab: int) -> dict:
    """Our state dict without the vocabulary padding rows (HF has none)."""
    return {k: v[:vocab] if k in ("wte.weight", "output_layer.weight") else v for k, v in sd.items()}


@pytest.mark.parametrize("variant", [
    {},                                                      # untied, no biases, GQA
    dict(untie_embeddings_and_output_weights=False, disable_bias_linear=False, num_query_groups=None),
], ids=["untied-nobias-gqa", "tied-biases-mha"])
def test_llama_export_loads_in_transformers_with_the_same_logits(tmp_path, variant):
    transformers = pytest.importorskip("transformers")
    ours = randomized(tiny_model(**{**LLAMA, **variant}))
    to_hf(ours, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["model_type"] == "llama"
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert theirs.config.num_key_value_heads == ours.config.num_query_groups
    x = tokens(T=32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[..., :100], theirs(x).logits, atol=1e-5, rtol=1e-5)
    back = from_hf(str(tmp_path), padded_vocab_size=128)
    assert back.config == dataclasses.replace(ours.config, ffn_hidden_size=ours.config.ffn_hidden_size)
    want, got = unpadded(ours.state_dict(), 100), back.state_dict()
    for k in want:
        assert torch.equal(got[k][:want[k].shape[0]], want[k]), k


def test_from_hf_reads_a_llama_checkpoint_that_transformers_wrote(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, rope_theta=500.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.2)
    theirs.save_pretrained(str(tmp_path))
    ours = from_hf(str(tmp_path)).eval()
    c = ours.config
    assert (c.position_embedding_type, c.normalization, c.swiglu, c.num_query_groups, c.rotary_base,
            c.untie_embeddings_and_output_weights, c.disable_bias_linear, c.ffn_hidden_size) == \
        ("rope", "RMSNorm", True, 2, 500.0, True, True, 96)
    x = tokens(T=32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[..., :100], theirs(x).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options,flag", [
    (dict(position_embedding_type="rope"), "--position-embedding-type learned_absolute"),
    (dict(LLAMA_OPTIONS, normalization="LayerNorm"), "--normalization RMSNorm"),
    (dict(LLAMA_OPTIONS, rotary_percent=0.5), "--rotary-percent 1.0"),
    (dict(untie_embeddings_and_output_weights=True), "no --untie-embeddings-and-output-weights"),
    (dict(num_query_groups=2), "no --group-query-attention"),
])
def test_export_of_a_model_no_transformers_architecture_computes_names_the_flag(tmp_path, options, flag):
    import checkpoint
    m = tiny_model(**options)
    with pytest.raises(ValueError, match=flag):
        to_hf(m, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # refused before writing anything
    assert checkpoint.hf_architecture(tiny_model().config) == "gpt2"
    assert checkpoint.hf_architecture(tiny_model(**LLAMA).config) == "llama"

