"""The architecture options researchers fork for (issue 15): RoPE, RMSNorm,
SwiGLU, grouped-query attention, an untied LM head, no linear biases.

Each option is checked against its definition, on CPU with tiny shapes; the
defaults must stay GPT-2. Tensor parallelism, Domino and ZeRO with every
option on are in test_parallel.py and test_zero.py.
"""
import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

import config as config_lib
from checkpoint import from_hf, to_hf
from gpt import (GPT, GPTConfig, LLAMA_OPTIONS, apply_rope, count_parameters, flops_per_token,
                 rope_angles)

SMALL = dict(vocab_size=100, padded_vocab_size=128)
# Every option on, rotary_percent < 1 included: head dim 16, 8 dims rotate.
ALL_OPTIONS = dict(LLAMA_OPTIONS, num_query_groups=2, rotary_percent=0.5, rotary_base=500.0)


def model(seed=0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_preset("tiny", **{**SMALL, **overrides}))


def tokens(B=2, T=16, seed=1):
    return torch.randint(0, 100, (B, T), generator=torch.Generator().manual_seed(seed))


# -----------------------------------------------------------------------------
# Defaults and validation


def test_defaults_are_gpt2():
    c = GPTConfig()
    assert (c.position_embedding_type, c.normalization, c.rotary_base, c.rotary_percent) == \
        ("learned_absolute", "LayerNorm", 10000.0, 1.0)
    assert not (c.swiglu or c.untie_embeddings_and_output_weights or c.disable_bias_linear)
    assert c.num_query_groups == c.num_attention_heads and c.ffn_hidden_size == 4 * c.hidden_size
    m = model()
    assert hasattr(m, "wpe") and not hasattr(m, "output_layer")
    assert isinstance(m.ln_f, torch.nn.LayerNorm)
    assert m.blocks[0].attn.qkv.weight.shape == (3 * 64, 64) and m.blocks[0].attn.qkv.bias is not None


@pytest.mark.parametrize("bad,flag", [
    (dict(position_embedding_type="alibi"), "--position-embedding-type"),
    (dict(normalization="rmsnorm"), "--normalization"),
    (dict(num_query_groups=3), "--num-query-groups"),          # 3 does not divide 4 heads
    (dict(num_query_groups=0), "--num-query-groups"),
    (dict(rotary_percent=0.0), "--rotary-percent"),
    (dict(rotary_percent=1.5), "--rotary-percent"),
    # head dim 16: 0.3 * 16 = 4.8 -> 4 (even, fine); 0.2 * 16 = 3.2 -> 3 (odd)
    (dict(position_embedding_type="rope", rotary_percent=0.2), "--rotary-percent"),
    (dict(rotary_base=0.0), "--rotary-base"),
])
def test_bad_options_name_the_flag_to_change(bad, flag):
    with pytest.raises(ValueError, match=flag):
        GPTConfig.from_preset("tiny", **bad)


def test_flags_reach_the_model_config():
    cfg = config_lib.parse_args([
        "--preset", "tiny", "--position-embedding-type", "rope", "--rotary-base", "500",
        "--rotary-percent", "0.5", "--normalization", "RMSNorm", "--swiglu",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--group-query-attention", "--num-query-groups", "2", "--seq-length", "64"])
    got = config_lib.model_config(cfg)
    for name, value in ALL_OPTIONS.items():
        assert getattr(got, name) == value, name
    # Without the flags: the preset's choices (GPT-2's for "tiny", Llama's for "llama-tiny").
    plain = config_lib.model_config(config_lib.parse_args(["--preset", "tiny", "--seq-length", "64"]))
    assert plain.position_embedding_type == "learned_absolute" and not plain.swiglu
    llama = config_lib.model_config(config_lib.parse_args(["--preset", "llama-tiny", "--seq-length", "64"]))
    assert {k: getattr(llama, k) for k in LLAMA_OPTIONS} == LLAMA_OPTIONS
    assert llama.num_query_groups == 2


@pytest.mark.parametrize("argv,message", [
    (["--num-query-groups", "2"], "needs --group-query-attention"),
    (["--group-query-attention"], "needs --num-query-groups"),
    (["--rotary-base", "500", "--position-embedding-type", "learned_absolute"],
     "need --position-embedding-type rope"),
])
def test_flags_that_go_in_pairs(argv, message):
    with pytest.raises(ValueError, match=message):
        config_lib.parse_args(["--preset", "tiny", *argv])


# -----------------------------------------------------------------------------
# Each option against its definition


def test_rope_rotates_pairs_so_scores_depend_on_relative_position():
    c = GPTConfig.from_preset("tiny", position_embedding_type="rope", rotary_base=100.0)
    hd, R = c.head_dim, c.rotary_dim
    angles = rope_angles(c, torch.arange(12))                        # (T, R/2)
    # By definition (float64): dim i and i + R/2 form the complex number
    # x_i + j x_{i+R/2}, multiplied by exp(j p theta_i), theta_i = base^(-2i/R).
    x = torch.randn(1, 1, 12, hd, dtype=torch.float64)
    theta = 100.0 ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    z = torch.complex(x[..., :R // 2], x[..., R // 2:R]) * torch.exp(1j * torch.arange(12.0)[:, None] * theta)
    want = torch.cat([z.real, z.imag, x[..., R:]], dim=-1)
    torch.testing.assert_close(apply_rope(x.float(), angles).double(), want, atol=1e-5, rtol=1e-5)
    # q.k of rotated vectors depends only on the distance between positions.
    q, k = torch.randn(hd), torch.randn(hd)
    score = lambda pq, pk: (apply_rope(q.expand(1, 1, 12, hd), angles)[0, 0, pq]  # noqa: E731
                            @ apply_rope(k.expand(1, 1, 12, hd), angles)[0, 0, pk])
    torch.testing.assert_close(score(5, 2), score(9, 6), atol=1e-5, rtol=1e-5)


def test_rotary_percent_leaves_the_last_dims_alone():
    c = GPTConfig.from_preset("tiny", position_embedding_type="rope", rotary_percent=0.5)
    x = torch.randn(2, 4, 8, c.head_dim)
    y = apply_rope(x, rope_angles(c, torch.arange(8)))
    assert c.rotary_dim == c.head_dim // 2
    assert torch.equal(y[..., c.rotary_dim:], x[..., c.rotary_dim:])
    assert not torch.allclose(y[..., :c.rotary_dim], x[..., :c.rotary_dim])
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])  # position 0 does not turn


def test_rope_model_has_no_position_table_and_honours_position_ids():
    m = model(position_embedding_type="rope").eval()
    assert not hasattr(m, "wpe")
    x = tokens()
    with torch.no_grad():
        base = m(x)
        per_row = m(x, position_ids=torch.arange(16).expand(2, 16))   # (B, T) ids, same positions
        shifted = m(x, position_ids=torch.arange(16) + 3)
    torch.testing.assert_close(per_row, base)
    # Rotations by a common offset cancel in q.k: RoPE sees relative positions only.
    torch.testing.assert_close(shifted, base, atol=1e-5, rtol=1e-5)


def test_rmsnorm_has_a_weight_and_no_bias():
    m = model(normalization="RMSNorm")
    norm = m.blocks[0].ln_1
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight is not None
    assert not any(n.endswith("ln_1.bias") for n, _ in m.named_parameters())
    x = torch.randn(3, 64, dtype=torch.float64)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + m.config.layernorm_epsilon)
    torch.testing.assert_close(norm.double()(x), want)


def test_swiglu_is_silu_gate_times_up_and_keeps_ffn_hidden_size():
    m = model(swiglu=True, ffn_hidden_size=96)
    mlp = m.blocks[0].mlp
    assert mlp.fc.weight.shape == (2 * 96, 64) and mlp.proj.weight.shape == (64, 96)
    x = torch.randn(2, 5, 64)
    gate = F.linear(x, mlp.fc.weight[:96], mlp.fc.bias[:96])
    up = F.linear(x, mlp.fc.weight[96:], mlp.fc.bias[96:])
    torch.testing.assert_close(mlp.hidden(x), gate * torch.sigmoid(gate) * up)


def test_disable_bias_linear_removes_every_linear_bias():
    m = model(disable_bias_linear=True, untie_embeddings_and_output_weights=True)
    biases = [n for n, _ in m.named_parameters() if n.endswith(".bias")]
    assert biases and all(".ln_" in n or n.startswith("ln_f") for n in biases)  # LayerNorms keep theirs


def test_untied_head_is_its_own_weight_and_the_fused_loss_uses_it():
    m = model(untie_embeddings_and_output_weights=True)
    assert m.output_layer.weight.shape == (128, 64)
    assert m.output_layer.weight.data_ptr() != m.wte.weight.data_ptr()
    x, y = tokens(), tokens(seed=2)
    fused = m(x, labels=y)
    fused.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    ref = model(untie_embeddings_and_output_weights=True, loss_impl="full")  # same weights
    want = ref(x, labels=y)
    want.backward()
    torch.testing.assert_close(fused, want)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=1e-5, msg=n)


def test_grouped_query_attention_equals_attention_with_repeated_kv_heads():
    """G=2 key/value heads for 4 query heads is multi-head attention whose
    heads 0,1 share K/V head 0 and heads 2,3 share K/V head 1."""
    gqa = model(num_query_groups=2).eval()
    assert gqa.blocks[0].attn.qkv.weight.shape == (64 + 2 * 2 * 16, 64)
    mha = model(seed=5).eval()
    sd = gqa.state_dict()
    for i in range(2):
        for kind in ("weight", "bias"):
            t = sd.pop(f"blocks.{i}.attn.qkv.{kind}")
            q, k, v = t.split([64, 32, 32])
            repeat = lambda kv: kv.unflatten(0, (2, 16)).repeat_interleave(2, dim=0).flatten(0, 1)  # noqa: E731
            sd[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat([q, repeat(k), repeat(v)])
    mha.load_state_dict(sd)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(gqa(x), mha(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", [{}, dict(swiglu=True), dict(num_query_groups=1),
                                     dict(untie_embeddings_and_output_weights=True),
                                     dict(disable_bias_linear=True), dict(normalization="RMSNorm"),
                                     dict(position_embedding_type="rope"), ALL_OPTIONS],
                         ids=lambda o: ",".join(o) or "gpt2")
def test_parameter_count_matches_the_built_model(options):
    m = model(**options)
    assert count_parameters(m.config) == m.num_parameters()
    assert count_parameters(m.config, exclude_embeddings=True) == m.num_parameters(exclude_embeddings=True)


def test_flops_count_swiglus_third_matrix_and_gqas_narrower_kv():
    base = GPTConfig.from_preset("124M", disable_bias_linear=True)
    L, H, Fh, T = 12, 768, 3072, 1024
    swiglu = dataclasses.replace(base, swiglu=True)
    assert flops_per_token(swiglu, T) - flops_per_token(base, T) == 6 * L * H * Fh
    gqa = dataclasses.replace(base, num_query_groups=4)  # K, V: 4 heads of 64 instead of 12
    assert flops_per_token(base, T) - flops_per_token(gqa, T) == 6 * L * H * 2 * (12 - 4) * 64
    # An untied head is one more table, not one more matmul.
    untied = dataclasses.replace(base, untie_embeddings_and_output_weights=True)
    assert flops_per_token(untied, T) == flops_per_token(base, T)
    assert count_parameters(untied) - count_parameters(base) == 50304 * H


def test_every_option_trains_with_activation_checkpointing_and_generates():
    ref = model(**ALL_OPTIONS)
    ckpt = model(**ALL_OPTIONS, activation_checkpointing=True)
    x, y = tokens(), tokens(seed=2)
    ref(x, labels=y).backward()
    ckpt(x, labels=y).backward()
    for (n, a), b in zip(ref.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=n)
    from gpt import generate
    out = generate(ckpt, x[:, :4], max_new_tokens=5, temperature=0)
    assert out.shape == (2, 9) and int(out.max()) < 100
    assert math.isfinite(ckpt(x, labels=y).item())


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
    ours = randomized(model(**{**LLAMA, **variant}))
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
    m = model(**options)
    with pytest.raises(ValueError, match=flag):
        to_hf(m, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # refused before writing anything
    assert checkpoint.hf_architecture(model().config) == "gpt2"
    assert checkpoint.hf_architecture(model(**LLAMA).config) == "llama"


def test_llama_124m_preset_matches_gpt2_124m_in_width_and_parameters():
    llama, gpt2 = GPTConfig.from_preset("llama-124M"), GPTConfig.from_preset("124M")
    assert {k: getattr(llama, k) for k in LLAMA_OPTIONS} == LLAMA_OPTIONS and llama.num_query_groups == 4
    assert llama.hidden_size == gpt2.hidden_size
    assert abs(count_parameters(llama) / count_parameters(gpt2) - 1) < 0.01
