"""Tests for gpt.py: the GPT-2 model and its architecture options, sampling with
the KV cache, parameter and FLOP accounting, and the fused LM head + loss.

All on CPU with tiny shapes. Hugging Face GPT-2 and Llama in and out
(checkpoint.py) are in test_checkpoint.py.
"""
import dataclasses
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import gpt
import fused_loss
import pipeline
from gpt import (GPT, GPTConfig, LLAMA_OPTIONS, PRESETS, KVCache, apply_rope, count_parameters, filter_logits,
                 flops_per_token, generate, rope_angles)
from conftest import ALL_OPTIONS, tiny, tiny_model, tokens


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
@pytest.mark.quick
def test_config_validation_names_the_problem(bad, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**bad)


@pytest.mark.quick
def test_every_field_is_checked_by_its_annotated_type():
    """A config from a file may hold anything: each field is held to its annotation
    (gpt.ADMITS, one table for all), so a string, a bool for a size, None where
    no default fills in, NaN or inf (a model of them computes NaN) is one line
    naming the field, before any value is used."""
    for field in dataclasses.fields(GPTConfig):  # a new field's annotation is one ADMITS knows
        assert all(kind in gpt.ADMITS for kind in field.type.split(" | ")), field
    for name, value, wanted in (("layernorm_epsilon", "x", "a finite number"), ("rotary_base", math.nan,
                                "a finite number"), ("init_method_std", math.inf, "a finite number"),
                                ("hidden_size", 64.0, "an int"),
                                ("num_layers", True, "an int"), ("ffn_hidden_size", "x", "an int or none"),
                                ("swiglu", 1, "true or false"), ("normalization", None, "a string")):
        with pytest.raises(ValueError, match=f"^GPTConfig.{name} must be {wanted}, got {re.escape(repr(value))}$"):
            GPTConfig(**{name: value})


@pytest.mark.quick
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


@pytest.mark.quick
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


@pytest.mark.quick
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


@pytest.mark.quick
def test_out_of_range_inputs_raise_clear_errors():
    """A sequence longer than the positions is the model's to refuse (no
    tensor read). Token ids are checked once, on the host, as a step's
    batches arrive (train.check_batches, test_train.py); called directly on
    CPU, the embedding's lookup refuses a token id (a label is not looked up)."""
    model = tiny_model()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(IndexError):
        model(torch.tensor([[1, 2, 128]]))       # == padded_vocab_size


@pytest.mark.quick
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


@pytest.mark.quick
def test_dropout_only_in_training_mode():
    model = tiny_model(hidden_dropout=0.5, attention_dropout=0.5)
    x = tokens()
    model.train()
    assert not torch.equal(model(x), model(x))
    model.eval()
    assert torch.equal(model(x), model(x))


@pytest.mark.quick
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


@pytest.mark.quick
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


@pytest.mark.quick
@pytest.mark.parametrize("options", [{}, ALL_OPTIONS, dict(num_experts=4, moe_shared_expert_intermediate_size=32,
                                                             moe_shared_expert_gate=True, qk_layernorm=True)],
                         ids=["gpt2", "all-options", "moe"])
def test_modules_are_registered_in_init_order(options):
    """The weights depend on the seed and the order the pieces are initialized
    in. ZeRO-3 builds the model on emptied partitions and re-initializes it one
    module at a time in named_modules() order (zero.build_model_zero3), so that
    order must be the init order: redone so, the weights are the same."""
    model = tiny_model(seed=3, **options)
    torch.manual_seed(3)
    redone = tiny_model(seed=5, **options)
    torch.manual_seed(3)
    for module in redone.modules():
        if list(module.parameters(recurse=False)):
            gpt.init_weights(module, redone.config)
    for (name, want), got in zip(model.state_dict().items(), redone.state_dict().values()):
        assert torch.equal(want, got), name


def num_parameters(model: GPT, exclude_embeddings: bool = False) -> int:
    """The model's parameters (a tied head once); exclude_embeddings drops wte,
    wpe and output_layer (Kaplan's N): what count_parameters computes."""
    tables = ("wte.weight", "wpe.weight", "output_layer.weight") if exclude_embeddings else ()
    return sum(p.numel() for name, p in model.named_parameters() if name not in tables)


@pytest.mark.quick
def test_param_count_of_124M_matches_hf_gpt2():
    # HF's GPT-2 small has 124,439,808 parameters (50257-row embedding, tied head).
    with torch.device("meta"):  # no memory, no init cost
        unpadded = GPT(GPTConfig.from_preset("124M", padded_vocab_size=50257))
        padded = GPT(GPTConfig.from_preset("124M"))
    assert num_parameters(unpadded) == 124_439_808
    # Our default pads the embedding to 50304 rows: 47 extra rows of 768.
    assert num_parameters(padded) == 124_439_808 + 47 * 768
    assert num_parameters(padded, exclude_embeddings=True) == 124_475_904 - (50304 + 1024) * 768


@pytest.mark.quick
def test_count_parameters_matches_built_model():
    config = tiny(ffn_hidden_size=96)
    model = GPT(config)
    assert count_parameters(config) == num_parameters(model)
    assert count_parameters(config, exclude_embeddings=True) \
        == num_parameters(model, exclude_embeddings=True)


@pytest.mark.quick
def test_flops_per_token_124M_by_hand():
    H, L, V, T = 768, 12, 50304, 1024
    per_layer = 12 * H * H + 13 * H       # weights + biases + 2 LayerNorms
    non_embedding = L * per_layer + 2 * H  # + final LayerNorm
    assert non_embedding == 85_056_000
    expected = 6 * (non_embedding + H * V) + 12 * L * H * T
    assert flops_per_token(GPTConfig.from_preset("124M"), T) == expected == 855_383_040


# -----------------------------------------------------------------------------
# Sampling


@pytest.mark.quick
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


@pytest.mark.quick
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


@pytest.mark.quick
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


@pytest.mark.quick
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


# -----------------------------------------------------------------------------
# The architecture options researchers fork for: RoPE, RMSNorm,
# SwiGLU, grouped-query attention, an untied LM head, no linear biases, each
# against its definition; the defaults stay GPT-2 (test_config.py). Tensor
# parallelism, Domino and ZeRO with every option on are in test_parallel.py
# and test_zero.py.


@pytest.mark.quick
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


@pytest.mark.quick
def test_rotary_percent_leaves_the_last_dims_alone():
    c = GPTConfig.from_preset("tiny", position_embedding_type="rope", rotary_percent=0.5)
    x = torch.randn(2, 4, 8, c.head_dim)
    y = apply_rope(x, rope_angles(c, torch.arange(8)))
    assert c.rotary_dim == c.head_dim // 2
    assert torch.equal(y[..., c.rotary_dim:], x[..., c.rotary_dim:])
    assert not torch.allclose(y[..., :c.rotary_dim], x[..., :c.rotary_dim])
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])  # position 0 does not turn


@pytest.mark.quick
def test_rope_model_has_no_position_table_and_honours_position_ids():
    m = tiny_model(position_embedding_type="rope").eval()
    assert not hasattr(m, "wpe")
    x = tokens()
    with torch.no_grad():
        base = m(x)
        per_row = m(x, position_ids=torch.arange(16).expand(2, 16))   # (B, T) ids, same positions
        shifted = m(x, position_ids=torch.arange(16) + 3)
    torch.testing.assert_close(per_row, base)
    # Rotations by a common offset cancel in q.k: RoPE sees relative positions only.
    torch.testing.assert_close(shifted, base, atol=1e-5, rtol=1e-5)


@pytest.mark.quick
@pytest.mark.parametrize("options", [{}, ALL_OPTIONS], ids=["gpt2", "llama"])
def test_documents_back_to_back_read_as_each_alone(options):
    """--reset-attention-mask: with document_ids (and positions restarting
    after each EOD), two documents packed in one sequence give the logits
    each gives alone, learned positions or RoPE (+ GQA); a row per packing."""
    import data
    m = tiny_model(**options).eval()
    x = tokens()
    splits = (5, 11)  # row r: document one is x[r, :splits[r]] (ending in an EOD), document two the rest
    is_eod = torch.zeros(2, 16, dtype=torch.bool)
    for r, n in enumerate(splits):
        is_eod[r, n - 1] = True
    starts = torch.stack([data._document_starts(e) for e in is_eod])  # (B, T)
    positions = torch.stack([data._reset_positions(e) for e in is_eod])
    with torch.no_grad():
        packed = m(x, positions, document_ids=starts)
        for r, n in enumerate(splits):
            torch.testing.assert_close(packed[r, :n], m(x[r:r + 1, :n])[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(packed[r, n:], m(x[r:r + 1, n:])[0], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(m(x, positions)[:, 11:], packed[:, 11:], atol=1e-3)  # the mask matters
    # activation checkpointing (GPT.run_blocks) carries the documents into the recomputed blocks
    recomputing = tiny_model(**options, activation_checkpointing=True, hidden_dropout=0.0, attention_dropout=0.0)
    torch.testing.assert_close(recomputing(x, positions, document_ids=starts), packed, atol=1e-5, rtol=1e-5)


@pytest.mark.quick
def test_rmsnorm_has_a_weight_and_no_bias():
    m = tiny_model(normalization="RMSNorm")
    norm = m.blocks[0].ln_1
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight is not None
    assert not any(n.endswith("ln_1.bias") for n, _ in m.named_parameters())
    x = torch.randn(3, 64, dtype=torch.float64)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + m.config.layernorm_epsilon)
    torch.testing.assert_close(norm.double()(x), want)


@pytest.mark.quick
def test_swiglu_is_silu_gate_times_up_and_keeps_ffn_hidden_size():
    m = tiny_model(swiglu=True, ffn_hidden_size=96)
    mlp = m.blocks[0].mlp
    assert mlp.fc.weight.shape == (2 * 96, 64) and mlp.proj.weight.shape == (64, 96)
    x = torch.randn(2, 5, 64)
    gate = F.linear(x, mlp.fc.weight[:96], mlp.fc.bias[:96])
    up = F.linear(x, mlp.fc.weight[96:], mlp.fc.bias[96:])
    torch.testing.assert_close(mlp.hidden(x), gate * torch.sigmoid(gate) * up)


@pytest.mark.quick
def test_disable_bias_linear_removes_every_linear_bias():
    m = tiny_model(disable_bias_linear=True, untie_embeddings_and_output_weights=True)
    biases = [n for n, _ in m.named_parameters() if n.endswith(".bias")]
    assert biases and all(".ln_" in n or n.startswith("ln_f") for n in biases)  # LayerNorms keep theirs


@pytest.mark.quick
def test_untied_head_is_its_own_weight_and_the_fused_loss_uses_it():
    m = tiny_model(untie_embeddings_and_output_weights=True)
    assert m.output_layer.weight.shape == (128, 64)
    assert m.output_layer.weight.data_ptr() != m.wte.weight.data_ptr()
    x, y = tokens(), tokens(seed=2)
    fused = m(x, labels=y)
    fused.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    ref = tiny_model(untie_embeddings_and_output_weights=True, loss_impl="full")  # same weights
    want = ref(x, labels=y)
    want.backward()
    torch.testing.assert_close(fused, want)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=1e-5, msg=n)


@pytest.mark.quick
def test_grouped_query_attention_equals_attention_with_repeated_kv_heads():
    """G=2 key/value heads for 4 query heads is multi-head attention whose
    heads 0,1 share K/V head 0 and heads 2,3 share K/V head 1."""
    gqa = tiny_model(num_query_groups=2).eval()
    assert gqa.blocks[0].attn.qkv.weight.shape == (64 + 2 * 2 * 16, 64)
    mha = tiny_model(seed=5).eval()
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


@pytest.mark.quick
def test_qk_layernorm_is_qwen3s_attention():
    """--qk-layernorm: each head's q and k go through an RMSNorm over its head
    dims before RoPE, as in transformers' Qwen3Attention, whose output ours is
    from the same weights (qkv = [q_proj | k_proj | v_proj], proj = o_proj)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding
    config = tiny(**LLAMA_OPTIONS, num_query_groups=2, qk_layernorm=True, rotary_base=500.0)
    ours = tiny_model(**LLAMA_OPTIONS, num_query_groups=2, qk_layernorm=True, rotary_base=500.0).blocks[0].attn
    hf = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "default", "rope_theta": 500.0}, attention_bias=False)
    theirs = Qwen3Attention(hf, layer_idx=0).eval()
    with torch.no_grad():
        for name, part in zip("qkv", ours.qkv.weight.split([64, 32, 32])):
            getattr(theirs, f"{name}_proj").weight.copy_(part)
        theirs.o_proj.weight.copy_(ours.proj.weight)
        for norm in ("q_norm", "k_norm"):  # not ones, so that a missing norm shows
            getattr(ours, norm).weight.uniform_(0.5, 1.5)
            getattr(theirs, norm).weight.copy_(getattr(ours, norm).weight)
    x, positions = torch.randn(2, 10, 64), torch.arange(10)
    cos_sin = Qwen3RotaryEmbedding(hf)(x, positions[None])
    causal = torch.full((10, 10), float("-inf")).triu(1)                 # HF's additive mask
    torch.testing.assert_close(ours(x, rope=gpt.rope_angles(config, positions)), theirs(x, cos_sin, causal)[0],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.quick
@pytest.mark.parametrize("options", [{}, dict(swiglu=True), dict(num_query_groups=1),
                                     dict(untie_embeddings_and_output_weights=True),
                                     dict(disable_bias_linear=True), dict(normalization="RMSNorm"),
                                     dict(position_embedding_type="rope"), ALL_OPTIONS, dict(qk_layernorm=True),
                                     dict(ALL_OPTIONS, qk_layernorm=True)],
                         ids=lambda o: ",".join(o) or "gpt2")
def test_parameter_count_matches_the_built_model(options):
    m = tiny_model(**options)
    assert count_parameters(m.config) == num_parameters(m)
    assert count_parameters(m.config, exclude_embeddings=True) == num_parameters(m, exclude_embeddings=True)


@pytest.mark.quick
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


@pytest.mark.quick
def test_every_option_trains_with_activation_checkpointing_and_generates():
    ref = tiny_model(**ALL_OPTIONS)
    ckpt = tiny_model(**ALL_OPTIONS, activation_checkpointing=True)
    x, y = tokens(), tokens(seed=2)
    ref(x, labels=y).backward()
    ckpt(x, labels=y).backward()
    for (n, a), b in zip(ref.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=n)
    from gpt import generate
    out = generate(ckpt, x[:, :4], max_new_tokens=5, temperature=0)
    assert out.shape == (2, 9) and int(out.max()) < 100
    assert math.isfinite(ckpt(x, labels=y).item())


@pytest.mark.quick
def test_llama_124m_preset_matches_gpt2_124m_in_width_and_parameters():
    llama, gpt2 = GPTConfig.from_preset("llama-124M"), GPTConfig.from_preset("124M")
    assert {k: getattr(llama, k) for k in LLAMA_OPTIONS} == LLAMA_OPTIONS and llama.num_query_groups == 4
    assert llama.hidden_size == gpt2.hidden_size
    assert abs(count_parameters(llama) / count_parameters(gpt2) - 1) < 0.01


# -----------------------------------------------------------------------------
# The fused LM head + cross-entropy (fused_loss.FusedLinearCrossEntropy) against the full-logits path
#
# The full path (F.linear to every logit, then F.cross_entropy)
# is the reference: the fused loss must give the same loss and the same
# gradients of the hidden states and of the (tied) weight, to 1e-5 in fp32,
# whatever the chunking and with loss masks. Tensor-parallel (T=2) and Domino
# runs are checked against the same reference in test_parallel.py, the Triton
# row kernels against their torch twins in test_fused_kernels.py.

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fused_lm_loss(h, weight, labels, loss_mask=None):
    """The fused head + loss as GPT.head calls it."""
    return fused_loss.FusedLinearCrossEntropy.apply(h, weight, labels, loss_mask, torch.is_grad_enabled())


def full_reference(h, weight, labels, loss_mask=None):
    """Today's path, written out: every logit, fp32 cross-entropy, masked mean."""
    token_loss = F.cross_entropy((h @ weight.t()).float().flatten(0, -2), labels.flatten(), reduction="none")
    if loss_mask is None:
        return token_loss.mean()
    mask = loss_mask.flatten().float()
    return (token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def loss_and_grads(fn, h, weight, labels, loss_mask=None):
    h, weight = h.detach().requires_grad_(), weight.detach().requires_grad_()
    value = fn(h, weight, labels, loss_mask)
    value.backward()
    return value.detach(), h.grad, weight.grad


def problem(N=37, C=24, V=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, C, generator=g).to(DEVICE)
    weight = (0.3 * torch.randn(V, C, generator=g)).to(DEVICE)
    labels = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    return h, weight, labels


@pytest.mark.quick
@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("span_tokens", [1, 5, 37, 1000])  # one token a span ... one span
@pytest.mark.parametrize("masked", [False, True])
def test_fused_loss_matches_full_logits_in_fp32(monkeypatch, span_tokens, masked):
    h, weight, labels = problem()
    monkeypatch.setitem(fused_loss.SPAN_LOGITS, "cpu", span_tokens * weight.shape[0])
    mask = None
    if masked:
        mask = (torch.rand(labels.shape, generator=torch.Generator().manual_seed(1)) > 0.3).float()
        mask = mask.to(DEVICE)
    got = loss_and_grads(fused_lm_loss, h, weight, labels, mask)
    want = loss_and_grads(full_reference, h, weight, labels, mask)
    for name, a, b in zip(("loss", "dh", "dW"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.quick
@pytest.mark.usefixtures("single_rank")
def test_fully_masked_batch_gives_zero_loss_and_zero_grads():
    h, weight, labels = problem()
    value, dh, dw = loss_and_grads(fused_lm_loss, h, weight, labels,
                                   torch.zeros(labels.shape, device=DEVICE))
    assert value.item() == 0.0 and not dh.any() and not dw.any()


@pytest.mark.quick
@pytest.mark.usefixtures("single_rank")
def test_fused_loss_scales_with_the_incoming_gradient():
    """Gradients are made in forward for d(loss) = 1 and scaled in backward:
    a loss scaler (fp16) or a 1/accumulation factor must reach them."""
    h, weight, labels = problem()
    _, dh1, dw1 = loss_and_grads(fused_lm_loss, h, weight, labels)
    _, dh3, dw3 = loss_and_grads(lambda *a: 3.0 * fused_lm_loss(*a), h, weight, labels)
    torch.testing.assert_close(dh3, 3 * dh1)
    torch.testing.assert_close(dw3, 3 * dw1)


@pytest.mark.quick
@pytest.mark.usefixtures("single_rank")
def test_no_grad_evaluation_computes_only_the_loss():
    h, weight, labels = problem()
    with torch.no_grad():
        value = fused_lm_loss(h, weight, labels)
    torch.testing.assert_close(value, full_reference(h, weight, labels), rtol=1e-5, atol=0)


class MatmulDtypes(TorchDispatchMode):
    """Records the dtypes of every matrix multiply that runs inside it."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.seen |= {a.dtype for a in args if torch.is_tensor(a)}
        return func(*args, **(kwargs or {}))


@pytest.mark.quick
@pytest.mark.usefixtures("single_rank")
def test_under_bf16_autocast_the_matmuls_are_bf16_and_the_loss_fp32():
    h, weight, labels = problem(C=64, V=512)
    with torch.autocast(h.device.type, dtype=torch.bfloat16):
        with MatmulDtypes() as matmuls:
            got = loss_and_grads(fused_lm_loss, h, weight, labels)
        want = loss_and_grads(full_reference, h, weight, labels)
    assert matmuls.seen == {torch.bfloat16}
    assert got[0].dtype == torch.float32 and got[1].dtype == h.dtype and got[2].dtype == weight.dtype
    for name, a, b in zip(("loss", "dh", "dW"), got, want):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 2e-2 * scale, name


@pytest.mark.usefixtures("single_rank")
def test_fp16_gradients_are_as_close_to_fp32_as_the_full_logits_path():
    """--fp16 at GPT-2's vocabulary with the default loss scale (2^16) and
    512 tokens: most softmax entries are far below fp16's smallest value
    once weighted by 1/512, and the scale itself does not fit fp16. The
    fused loss keeps its gradients in units of the largest token weight and
    scales in fp32, so it is as close to the fp32 gradients as the full
    logits are (which get the loss scale before anything is fp16), also on
    the embedding rows of tokens that are never a target."""
    V, scale = 50304, 2.0 ** 16
    h, weight, labels = problem(N=512, C=64, V=V)
    weight = weight * 0.25                                       # logits of a few units
    labels = labels.clamp(max=50256)

    def in_fp16(fn):
        def scaled_loss(*args):
            with torch.autocast(h.device.type, dtype=torch.float16):
                return fn(*args) * scale
        return scaled_loss

    want = loss_and_grads(full_reference, h, weight, labels)      # fp32
    fused = loss_and_grads(in_fp16(fused_lm_loss), h, weight, labels)
    full = loss_and_grads(in_fp16(full_reference), h, weight, labels)
    untargeted = torch.ones(V, dtype=torch.bool, device=h.device)
    untargeted[labels] = False

    def error(got, ref, rows=slice(None)):
        return ((got[rows] / scale - ref[rows]).norm() / ref[rows].norm()).item()
    for name, i in (("dh", 1), ("dW", 2)):
        assert torch.isfinite(fused[i]).all(), name
        assert error(fused[i], want[i]) <= 1.5 * error(full[i], want[i]), name
    assert error(fused[2], want[2], untargeted) <= 1.5 * error(full[2], want[2], untargeted)


# The model: loss_impl="fused" (the default) against loss_impl="full"


@pytest.mark.quick
@pytest.mark.usefixtures("single_rank")
def test_gpt_fused_loss_matches_full_logits_loss_and_every_gradient():
    results = []
    for impl in ("full", "fused"):
        torch.manual_seed(0)
        model = GPT(GPTConfig.from_preset("tiny", loss_impl=impl)).to(DEVICE)
        g = torch.Generator().manual_seed(3)
        x, y = (torch.randint(0, 50257, (2, 16), generator=g).to(DEVICE) for _ in range(2))
        mask = (torch.rand(2, 16, generator=g) > 0.25).float().to(DEVICE)
        value = model(x, labels=y, loss_mask=mask)
        value.backward()
        results.append((value.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_full, grads_full), (loss_fused, grads_fused) = results
    torch.testing.assert_close(loss_fused, loss_full, rtol=1e-5, atol=0)
    for name, g in grads_full.items():  # to 1e-5 of each gradient's scale
        torch.testing.assert_close(grads_fused[name], g, rtol=1e-5, atol=1e-5 * g.abs().max().item(),
                                   msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.quick
def test_unknown_loss_impl_is_a_clear_error():
    with pytest.raises(ValueError, match="loss_impl"):
        GPTConfig.from_preset("tiny", loss_impl="chunky")


@pytest.mark.usefixtures("single_rank")
@pytest.mark.gpu
def test_gpu_fused_loss_follows_full_logits_in_a_quarter_of_the_memory():
    """GPT-2 124M's head at micro-batch 8, seq 1024, under bf16 autocast (the
    Triton row kernels): the same loss and gradients to bf16 rounding, and at
    most a quarter of the full-logits path's peak memory for head + loss."""
    N, C, V = 8 * 1024, 768, 50304
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(N, C, device="cuda", generator=g)
    weight = 0.02 * torch.randn(V, C, device="cuda", generator=g)
    labels = torch.randint(0, V, (N,), device="cuda", generator=g)
    results, peaks = [], []
    for fn in (full_reference, fused_lm_loss):
        hh, ww = h.clone().requires_grad_(), weight.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            value = fn(hh, ww, labels)
        value.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        results.append((value.detach(), hh.grad, ww.grad))
    for name, a, b in zip(("loss", "dh", "dW"), results[1], results[0]):
        assert (a.float() - b.float()).abs().max().item() <= 1e-2 * b.float().abs().max().item(), name
    assert 4 * peaks[1] <= peaks[0], f"peak bytes: fused {peaks[1]:,} vs full {peaks[0]:,}"



@pytest.mark.quick
@pytest.mark.parametrize("extra,overrides", [("output_layer.weight", {}), ("wpe.weight", {"position_embedding_type": "rope"}),
                                             ("blocks.2.ln_1.weight", {})],
                         ids=["untied-head-into-tied", "positions-into-rope", "layer-too-many"])
def test_a_state_dict_with_a_piece_the_model_lacks_is_refused(single_rank, extra, overrides):
    """A pipeline stage loads its own pieces of the whole model's state dict,
    skipping the other stages'; a piece that no stage of this model holds is
    an error, not dropped."""
    model = tiny_model(**overrides)
    sd = model.full_state_dict()
    sd[extra] = torch.zeros(3)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        model.load_full_state_dict(sd)
    stage = pipeline.stage_model(tiny(**overrides), [range(1, 2)])  # the last of two stages
    with pytest.raises(RuntimeError, match="Unexpected key") as refused:
        stage.load_full_state_dict(sd)
    assert extra in str(refused.value) and "blocks.0." not in str(refused.value), refused.value
    del sd[extra]
    stage.load_full_state_dict({k: v + 1 for k, v in sd.items()})
    assert all(torch.equal(v, sd[k] + 1) for k, v in stage.state_dict().items())
