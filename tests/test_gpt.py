"""Tests for gpt.py: the GPT-2 model, its sampling, accounting and HF interop.

All on CPU with tiny shapes. The Hugging Face tests build a random
transformers GPT2LMHeadModel and check our model computes the same logits.
"""
import math

import pytest
import torch

from checkpoint import from_hf, hf_to_ours, ours_to_hf, to_hf
from gpt import (GPT, GPTConfig, PRESETS, KVCache, count_parameters, filter_logits, flops_per_token,
                 generate)
from parallel import UsageError
from conftest import tiny, tiny_model, tokens


# -----------------------------------------------------------------------------
# Hugging Face parity


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
# Config


@pytest.mark.parametrize("bad, message", [
    (dict(hidden_size=64, num_attention_heads=5), "divisible"),
    (dict(vocab_size=100, padded_vocab_size=64), "padded_vocab_size"),
    (dict(num_layers=0), "num_layers"),
    (dict(hidden_dropout=1.0), "hidden_dropout"),
    (dict(attention_impl="flash9"), "attention_impl"),
    (dict(layernorm_impl="apex"), "layernorm_impl"),
])
def test_config_validation_names_the_problem(bad, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**bad)


def test_presets_and_unknown_preset_lists_valid_names():
    c = GPTConfig.from_preset("1.5B")
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.max_position_embeddings) \
        == (48, 1600, 25, 1024)
    assert c.ffn_hidden_size == 6400
    assert GPTConfig.from_preset("tiny", num_layers=3).num_layers == 3
    with pytest.raises(ValueError, match="124M"):
        GPTConfig.from_preset("125M")
    assert {"124M", "350M", "774M", "1.5B", "tiny", "cpu"} <= set(PRESETS)


# -----------------------------------------------------------------------------
# Forward and loss


def test_loss_is_masked_mean_of_token_losses():
    model = tiny_model()
    x, y = tokens(seed=1), tokens(seed=2)
    mask = (torch.rand(2, 16, generator=torch.Generator().manual_seed(3)) > 0.5).float()
    logits = model(x)
    token_loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), y.flatten(), reduction="none").view(2, 16)
    torch.testing.assert_close(model(x, labels=y, loss_mask=mask),
                               (token_loss * mask).sum() / mask.sum())
    torch.testing.assert_close(model(x, labels=y), token_loss.mean())
    assert model(x, labels=y).dtype == torch.float32


def test_position_ids_are_honored():
    model = tiny_model().eval()
    x = tokens()
    with torch.no_grad():
        default = model(x)
        torch.testing.assert_close(model(x, position_ids=torch.arange(16).expand(2, 16)), default)
        # All tokens at position 0 == a model whose every position embedding is row 0.
        at_zero = model(x, position_ids=torch.zeros(2, 16, dtype=torch.long))
        model.wpe.weight.copy_(model.wpe.weight[0].expand_as(model.wpe.weight))
        torch.testing.assert_close(model(x), at_zero)
    assert not torch.allclose(at_zero, default)


def test_out_of_range_inputs_raise_clear_errors():
    model = tiny_model()
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.tensor([[1, 2, 128]]))       # == padded_vocab_size
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.tensor([[1, -1, 3]]))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="position_ids"):
        model(torch.zeros(1, 4, dtype=torch.long), position_ids=torch.tensor([[0, 1, 2, 64]]))
    with pytest.raises(ValueError, match="labels"):
        model(torch.zeros(1, 4, dtype=torch.long), labels=torch.tensor([[0, 1, 2, 500]]))


def test_activation_checkpointing_gives_identical_loss_and_grads():
    x, y = tokens(seed=1), tokens(seed=2)
    results = []
    for ckpt in (False, True):
        model = tiny_model(activation_checkpointing=ckpt).train()
        calls = []
        model.blocks[0].register_forward_pre_hook(lambda *args: calls.append(1))
        loss = model(x, labels=y)
        loss.backward()
        assert len(calls) == (2 if ckpt else 1)  # checkpointing re-runs the block in backward
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l0, l1, atol=0, rtol=0)
    for name in g0:
        torch.testing.assert_close(g0[name], g1[name], atol=1e-6, rtol=1e-5)


def test_dropout_only_in_training_mode():
    model = tiny_model(hidden_dropout=0.5, attention_dropout=0.5)
    x = tokens()
    model.train()
    assert not torch.equal(model(x), model(x))
    model.eval()
    assert torch.equal(model(x), model(x))


def test_full_state_dict_round_trip():
    a, b = tiny_model(seed=0).eval(), tiny_model(seed=1).eval()
    x = tokens()
    b.load_full_state_dict(a.full_state_dict())
    assert torch.equal(a(x), b(x))
    sd = a.full_state_dict()
    del sd["ln_f.bias"]
    with pytest.raises(RuntimeError, match="ln_f.bias"):
        b.load_full_state_dict(sd)


# -----------------------------------------------------------------------------
# Initialization and accounting


def test_gpt2_init_scales_residual_projections():
    L = 8
    model = tiny_model(num_layers=L)
    residual_std = 0.02 / math.sqrt(2 * L)
    for block in model.blocks:
        assert block.attn.proj.weight.std().item() == pytest.approx(residual_std, rel=0.1)
        assert block.mlp.proj.weight.std().item() == pytest.approx(residual_std, rel=0.1)
        assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)
        assert torch.all(block.mlp.fc.bias == 0) and torch.all(block.ln_1.weight == 1)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_param_count_of_124M_matches_hf_gpt2():
    # HF's GPT-2 small has 124,439,808 parameters (50257-row embedding, tied head).
    with torch.device("meta"):  # no memory, no init cost
        unpadded = GPT(GPTConfig.from_preset("124M", padded_vocab_size=50257))
        padded = GPT(GPTConfig.from_preset("124M"))
    assert unpadded.num_parameters() == 124_439_808
    # Our default pads the embedding to 50304 rows: 47 extra rows of 768.
    assert padded.num_parameters() == 124_439_808 + 47 * 768
    assert padded.num_parameters(exclude_embeddings=True) == 124_475_904 - (50304 + 1024) * 768


def test_count_parameters_matches_built_model():
    config = tiny(ffn_hidden_size=96)
    model = GPT(config)
    assert count_parameters(config) == model.num_parameters()
    assert count_parameters(config, exclude_embeddings=True) \
        == model.num_parameters(exclude_embeddings=True)


def test_flops_per_token_124M_by_hand():
    H, L, V, T = 768, 12, 50304, 1024
    per_layer = 12 * H * H + 13 * H       # weights + biases + 2 LayerNorms
    non_embedding = L * per_layer + 2 * H  # + final LayerNorm
    assert non_embedding == 85_056_000
    expected = 6 * (non_embedding + H * V) + 12 * L * H * T
    assert flops_per_token(GPTConfig.from_preset("124M"), T) == expected == 855_383_040


# -----------------------------------------------------------------------------
# Sampling


def test_top_k_and_top_p_restrict_the_support():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    kept = lambda out: torch.isfinite(out[0]).nonzero().flatten().tolist()
    assert kept(filter_logits(logits, top_k=2)) == [1, 3]
    assert kept(filter_logits(logits, top_p=0.75)) == [1, 3]      # 0.5 + 0.3 >= 0.75
    assert kept(filter_logits(logits, top_p=0.85)) == [1, 2, 3]   # needs the 0.15 too
    assert kept(filter_logits(logits, top_p=0.1)) == [1]          # top token always kept
    assert kept(filter_logits(logits, top_p=1.0)) == [0, 1, 2, 3]
    assert kept(filter_logits(logits, top_k=3, top_p=0.6)) == [1, 3]
    # Surviving logits are unchanged, so renormalized probabilities are exact.
    out = filter_logits(logits, top_p=0.75)
    torch.testing.assert_close(out.softmax(-1)[0, [1, 3]], torch.tensor([0.625, 0.375]))
    with pytest.raises(ValueError, match="top_p"):
        filter_logits(logits, top_p=0.0)


def test_generate_never_samples_padding_and_greedy_is_deterministic():
    model = tiny_model()
    with torch.no_grad():  # make the padding rows' logits dominate
        model.ln_f.bias.fill_(1.0)
        model.wte.weight[100:] = 5.0
    prompt = tokens(T=4)
    assert model(prompt)[:, -1].argmax(-1).min() >= 100  # padding would win if allowed
    greedy = generate(model, prompt, 8, temperature=0)
    assert torch.equal(greedy, generate(model, prompt, 8, temperature=0))
    assert greedy.shape == (2, 12) and torch.equal(greedy[:, :4], prompt)
    rng = torch.Generator().manual_seed(0)
    sampled = generate(model, prompt, 20, temperature=2.0, generator=rng)
    assert sampled.max() < 100
    # Greedy's first token is the argmax over the real vocabulary.
    assert torch.equal(greedy[:, 4], model(prompt)[:, -1, :100].argmax(-1))


def test_generate_crops_long_context_and_restores_mode():
    model = tiny_model().train()
    out = generate(model, tokens(T=64), 3, temperature=0)  # grows past 64 positions
    assert out.shape == (2, 67) and model.training


@pytest.mark.parametrize("options", [{}, dict(position_embedding_type="rope", num_query_groups=2)],
                         ids=["gpt2", "rope-gqa"])
def test_kv_cache_generates_the_same_tokens_as_rerunning_the_prefix(options):
    """generate() runs the prompt once and then one position per new token
    against each layer's cached keys and values. Greedy decoding gives the
    same tokens as re-running the whole prefix every step, token for token,
    also past the model's 64 positions (where the window slides and
    generate falls back to re-running it); each cached step's logits equal
    the full forward's last row."""
    model = tiny_model(**options)
    prompt = tokens(T=5)
    cached = generate(model, prompt, 70, temperature=0)
    assert torch.equal(cached, generate(model, prompt, 70, temperature=0, use_cache=False))
    cache = KVCache(64)
    with torch.no_grad():
        model(cached[:, :5], kv_cache=cache)
        for t in range(5, 40):  # one token at a time, as generate does
            step = model(cached[:, t:t + 1], kv_cache=cache)[:, -1]
            torch.testing.assert_close(step, model(cached[:, :t + 1])[:, -1], rtol=1e-5, atol=1e-5)
    assert cache.length == 40


def test_generate_stops_when_every_row_emits_eos():
    model = tiny_model()
    eos = 7
    with torch.no_grad():  # make logits input-independent with eos far ahead
        model.ln_f.weight.zero_()
        model.ln_f.bias.fill_(1.0)
        model.wte.weight[eos] = 1.0
    out = generate(model, tokens(T=4), 10, temperature=1.0, eos_token_id=eos,
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 5) and torch.all(out[:, -1] == eos)
