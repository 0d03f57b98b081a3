"""Tensor parallelism on CPU: 2 gloo ranks must reproduce the 1-process maths,
eagerly and under torch.compile at every layout.

Every multi-rank test runs a top-level function on 2 processes through
run_on_ranks(); an assertion or exception on any rank fails the test with that
rank's traceback.
"""
import json
import os
import sys
import time
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import parallel
import pipeline
import train
from conftest import process_env, run_on_ranks, uneven_batch


def assert_close(actual, expected, tol=1e-6, what=""):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------
# Communication operators
# --------------------------------------------------------------------------


def _check_comm_ops():
    parallel.initialize(2)
    r = parallel.layout.tp_rank
    # Per-rank data built from .t() so every input is NON-contiguous.
    per_rank = [torch.arange(12.0).view(3, 4).t() * (k + 1) for k in range(2)]  # (4, 3)
    mine = per_rank[r]
    assert not mine.is_contiguous()

    # f: identity forward, all-reduce backward.
    x = mine.clone().t().contiguous().t().requires_grad_()  # non-contiguous leaf
    y = parallel.copy_to_tensor_parallel_region(x)
    assert_close(y, mine, what="f forward")
    grad_r = per_rank[r] + 100 * r
    y.backward(grad_r)
    assert_close(x.grad, per_rank[0] + per_rank[1] + 100, what="f backward")

    # g: all-reduce forward (input untouched), identity backward.
    x = mine.detach().clone().t().contiguous().t().requires_grad_()
    before = x.detach().clone()
    y = parallel.reduce_from_tensor_parallel_region(x)
    assert_close(y, per_rank[0] + per_rank[1], what="g forward")
    assert_close(x.detach(), before, what="g must not modify its input")
    y.backward(mine)
    assert_close(x.grad, mine, what="g backward")

    # all-reduce of a non-contiguous tensor returns the reduced values.
    assert_close(parallel.all_reduce(mine), per_rank[0] + per_rank[1], what="all_reduce")

    # gather along the last dim: forward concatenates, backward keeps my slice.
    x = mine.detach().clone().t().contiguous().t().requires_grad_()
    y = parallel.gather_from_tensor_parallel_region(x)
    assert_close(y, torch.cat(per_rank, dim=-1), what="gather forward")
    dy = torch.arange(24.0).view(6, 4).t()  # (4, 6), non-contiguous
    y.backward(dy)
    assert_close(x.grad, dy[:, 3 * r:3 * r + 3], what="gather backward")


@pytest.mark.quick
def test_communication_operators_forward_and_backward():
    run_on_ranks(_check_comm_ops)


@pytest.mark.quick
def test_operators_are_free_identities_with_one_rank():
    parallel.initialize(1)
    try:
        x = torch.randn(3, 4).t()
        for op in (parallel.copy_to_tensor_parallel_region,
                   parallel.reduce_from_tensor_parallel_region,
                   parallel.gather_from_tensor_parallel_region):
            assert op(x) is x, op.__name__  # no copy, no autograd node
    finally:
        parallel.destroy()


# --------------------------------------------------------------------------
# Sharding helpers (no processes needed)
# --------------------------------------------------------------------------


@pytest.mark.quick
def test_shard_tensor_in_blocks_keeps_whole_qkv_pieces():
    H = 4
    q, k, v = (torch.randn(H, 2) for _ in range(3))
    full = torch.cat([q, k, v], dim=0)                   # (3H, 2): [Q | K | V]
    shards = [parallel.shard_tensor(full, 0, r, 2, blocks=3) for r in range(2)]
    assert torch.equal(shards[1], torch.cat([q[2:], k[2:], v[2:]]))
    assert torch.equal(parallel.merge_shards(shards, 0, blocks=3), full)
    with pytest.raises(ValueError, match="cannot be split"):
        parallel.shard_tensor(torch.zeros(10, 2), 0, 0, 2, blocks=3)


@pytest.mark.quick
def test_shard_tensor_with_block_sizes_splits_gqa_qkv_and_swiglu_fc():
    # GQA: 4 query heads, 2 key/value heads, head dim 1 -> blocks of 4, 2, 2 rows.
    q, k, v = torch.randn(4, 3), torch.randn(2, 3), torch.randn(2, 3)
    full = torch.cat([q, k, v])
    shards = [parallel.shard_tensor(full, 0, r, 2, blocks=(4, 2, 2)) for r in range(2)]
    assert torch.equal(shards[1], torch.cat([q[2:], k[1:], v[1:]]))  # query heads 2,3 with kv head 1
    # checkpoints store the layout as JSON: a list works like the tuple
    assert torch.equal(parallel.merge_shards(shards, 0, [4, 2, 2]), full)
    # SwiGLU: [gate | up] in 2 blocks gives each rank matching gate and up rows.
    gate, up = torch.randn(6, 3), torch.randn(6, 3)
    shard = parallel.shard_tensor(torch.cat([gate, up]), 0, 2, 3, blocks=2)
    assert torch.equal(shard, torch.cat([gate[4:], up[4:]]))
    with pytest.raises(ValueError, match="cannot be split"):
        parallel.shard_tensor(full, 0, 0, 4, blocks=(4, 2, 2))  # 2 kv heads over 4 ranks


# --------------------------------------------------------------------------
# Parallel linear layers
# --------------------------------------------------------------------------


def _gathered_grad(p):
    return parallel.gather_like(p, p.grad)


def _check_linear_pair():
    parallel.initialize(2)
    torch.manual_seed(0)  # same on both ranks -> same full master weights
    col = parallel.ColumnParallelLinear(8, 16)
    row = parallel.RowParallelLinear(16, 8)
    with torch.no_grad():  # non-zero biases so bias handling is exercised
        col.bias.normal_()
        row.bias.normal_()
    # The same seed on one process gives the same full weights.
    torch.manual_seed(0)
    full_fc, full_proj = torch.empty(16, 8).normal_(0, 0.02), torch.empty(8, 16).normal_(0, 0.02)
    assert_close(parallel.gather_like(col.weight, col.weight), full_fc, what="col init")
    assert_close(parallel.gather_like(row.weight, row.weight), full_proj, what="row init")

    # Sharded params are tagged; the replicated row bias is not.
    assert col.weight.tensor_model_parallel and col.weight.partition_dim == 0
    assert col.bias.tensor_model_parallel and row.weight.partition_dim == 1
    assert not getattr(row.bias, "tensor_model_parallel", False)
    assert col.weight.shape == (8, 8) and row.weight.shape == (8, 8)

    fc, proj = nn.Linear(8, 16), nn.Linear(16, 8)
    with torch.no_grad():
        fc.weight.copy_(full_fc), proj.weight.copy_(full_proj)
        fc.bias.copy_(parallel.gather_like(col.bias, col.bias)), proj.bias.copy_(row.bias)

    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    x_tp, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_tp = row(F.gelu(col(x_tp)))
    y_ref = proj(F.gelu(fc(x_ref)))
    assert_close(y_tp, y_ref, what="output")
    # A rank-independent upstream gradient, as after a replicated loss.
    (y_tp.square().sum()).backward()
    (y_ref.square().sum()).backward()
    assert_close(x_tp.grad, x_ref.grad, what="input grad")
    assert_close(_gathered_grad(col.weight), fc.weight.grad, what="fc weight grad")
    assert_close(_gathered_grad(col.bias), fc.bias.grad, what="fc bias grad")
    assert_close(_gathered_grad(row.weight), proj.weight.grad, what="proj weight grad")
    assert_close(row.bias.grad, proj.bias.grad, what="proj bias grad")


@pytest.mark.quick
def test_column_row_pair_matches_plain_linears():
    run_on_ranks(_check_linear_pair)


def _check_qkv_blocks():
    parallel.initialize(2)
    r = parallel.layout.tp_rank
    H = 8
    qkv = nn.Linear(H, 3 * H)
    torch.manual_seed(0)
    with torch.no_grad():  # rank-identical full weights
        qkv.weight.normal_(), qkv.bias.normal_()
    col = parallel.ColumnParallelLinear.from_linear(qkv, blocks=3)
    x = torch.randn(2, 5, H)
    q, k, v = qkv(x).split(H, dim=-1)                # full Q, K, V
    half = slice(r * H // 2, (r + 1) * H // 2)       # this rank's heads
    assert_close(col(x), torch.cat([q[..., half], k[..., half], v[..., half]], -1),
                 what="shard in blocks = [Q_r | K_r | V_r]")
    assert_close(parallel.gather_like(col.weight, col.weight), qkv.weight, what="regather")
    assert col.weight.partition_blocks == 3


@pytest.mark.quick
def test_column_split_in_blocks_gives_each_rank_its_q_k_v_heads():
    run_on_ranks(_check_qkv_blocks)


# --------------------------------------------------------------------------
# Vocab-parallel embedding and cross entropy
# --------------------------------------------------------------------------


def _check_vocab_parallel():
    parallel.initialize(2)
    V, C = 10, 4
    torch.manual_seed(0)
    emb = parallel.VocabParallelEmbedding(V, C)
    assert emb.weight.shape == (V // 2, C) and emb.weight.tensor_model_parallel
    ref = nn.Embedding(V, C)
    with torch.no_grad():
        ref.weight.copy_(parallel.gather_like(emb.weight, emb.weight))
    ids = torch.tensor([[0, 4, 5, 9], [9, 9, 2, 6]])  # ids on both ranks, repeats
    out = emb(ids)
    assert_close(out, ref(ids), what="embedding forward")
    g = torch.randn(2, 4, C, generator=torch.Generator().manual_seed(3))
    out.backward(g)
    ref(ids).backward(g)
    assert_close(_gathered_grad(emb.weight), ref.weight.grad, what="embedding grad")


    # Cross entropy on vocab-sharded logits, including large logits (stability).
    full = torch.randn(2, 3, V, generator=torch.Generator().manual_seed(4)) * 30
    target = torch.tensor([[0, 4, 5], [9, 2, 7]])
    r = parallel.layout.tp_rank
    shard = full[..., r * 5:(r + 1) * 5].clone().requires_grad_()
    full_ref = full.clone().requires_grad_()
    loss = parallel.vocab_parallel_cross_entropy(shard, target)
    loss_ref = F.cross_entropy(full_ref.view(-1, V), target.view(-1), reduction="none").view(2, 3)
    assert loss.dtype == torch.float32 and loss.shape == (2, 3)
    assert_close(loss, loss_ref, tol=1e-5, what="cross entropy")
    w = torch.arange(6.0).view(2, 3)  # non-uniform upstream grad
    (loss * w).sum().backward()
    (loss_ref * w).sum().backward()
    assert_close(shard.grad, full_ref.grad[..., r * 5:(r + 1) * 5], tol=1e-5, what="CE grad")
    # (Out-of-range ids: train.check_batches refuses them on the host, the one check.)


@pytest.mark.quick
def test_vocab_parallel_embedding_and_cross_entropy_match_full_vocab():
    run_on_ranks(_check_vocab_parallel)


# --------------------------------------------------------------------------
# Gradient clipping
# --------------------------------------------------------------------------


def _tiny_mlp(parallel_layers: bool):
    """LayerNorm (replicated) -> column -> row: both kinds of grads."""
    torch.manual_seed(0)
    ln, fc, proj = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)
    if parallel_layers:
        fc = parallel.ColumnParallelLinear.from_linear(fc)
        proj = parallel.RowParallelLinear.from_linear(proj)
    return nn.Sequential(ln, fc, nn.GELU(), proj)


def _check_clip_grad_norm():
    parallel.initialize(2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    tp, ref = _tiny_mlp(True), _tiny_mlp(False)
    tp(x).square().sum().backward()
    ref(x).square().sum().backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.1)
    norm = train.clip_grad_norm_(tp.parameters(), max_norm=0.1)
    assert ref_norm > 0.1  # so clipping really happened
    assert_close(norm, ref_norm, tol=1e-5, what="global norm")
    for (name, p), p_ref in zip(tp.named_parameters(), ref.parameters()):
        g = _gathered_grad(p) if getattr(p, "tensor_model_parallel", False) else p.grad
        assert_close(g, p_ref.grad, tol=1e-5, what=f"clipped grad {name}")

    # Non-finite norm: returned as is, grads left alone for the caller.
    tp[0].weight.grad[0] = float("inf")
    before = [p.grad.clone() for p in tp.parameters()]
    assert not torch.isfinite(train.clip_grad_norm_(tp.parameters(), 0.1))
    for p, b in zip(tp.parameters(), before):
        assert torch.equal(p.grad, b)


@pytest.mark.quick
def test_clip_grad_norm_uses_the_full_model_norm():
    run_on_ranks(_check_clip_grad_norm)


@pytest.mark.quick
def test_clip_grad_norm_with_one_rank_equals_torch():
    parallel.initialize(1)
    try:
        a, b = _tiny_mlp(False), _tiny_mlp(False)
        x = torch.randn(4, 8)
        for m in (a, b):
            m(x).square().sum().backward()
        ref = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1)
        assert_close(train.clip_grad_norm_(b.parameters(), 0.1), ref)
        for p, q in zip(b.parameters(), a.parameters()):
            assert_close(p.grad, q.grad)
    finally:
        parallel.destroy()


class _CountOps(TorchDispatchMode):
    """Counts the aten ops called under it, not those they call in turn (the CPU runs
    a foreach op as one op per tensor; a GPU, as a few kernels for the whole list)."""
    def __init__(self):
        super().__init__()
        self.ops = self.depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += self.depth == 0
        self.depth += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.depth -= 1


def test_clip_grad_norm_launches_as_many_kernels_for_300_parameters_as_for_3():
    """The norm and the clip are foreach ops, a few launches for the whole model: a
    loop over a 350M model's 292 parameters kept an H200 waiting on the host
    (bench/RESULTS.md, 2026-11-28)."""
    parallel.initialize(1)
    try:
        counts = []
        for n in (3, 300):
            params = [nn.Parameter(torch.ones(4)) for _ in range(n)]
            for p in params:
                p.grad = torch.full((4,), 10.0)
            with _CountOps() as count:
                norm = train.clip_grad_norm_(params, 1.0)
            assert_close(norm, torch.tensor(20.0 * n ** 0.5))  # sqrt(4 n 10^2)
            assert_close(params[0].grad, torch.full((4,), 10.0 / norm.item()))
            counts.append(count.ops)
        assert counts[1] == counts[0] < 30, counts
    finally:
        parallel.destroy()


# --------------------------------------------------------------------------
# Process groups and bad layouts
# --------------------------------------------------------------------------


def _check_groups_and_bad_layout():
    from gpt import GPT, GPTConfig
    with pytest.raises(RuntimeError, match="initialize"):  # forgot it in a multi-rank job
        GPT(GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16))
    with pytest.raises(ValueError, match="does not divide the world size 2"):
        parallel.initialize(3)
    parallel.initialize(1)  # T=1 on 2 ranks: pure data parallelism
    assert (parallel.layout.tp_size, parallel.layout.dp_size, parallel.layout.dp_rank) == (1, 2, dist.get_rank())
    t = torch.ones(1)
    dist.all_reduce(t, group=parallel.layout.tp_group)  # really a 1-rank group
    assert t.item() == 1.0
    parallel.destroy()
    parallel.initialize(2)
    assert (parallel.layout.tp_size, parallel.layout.tp_rank, parallel.layout.dp_size) == (2, dist.get_rank(), 1)


def test_process_groups_and_world_size_check():
    run_on_ranks(_check_groups_and_bad_layout)


def test_tensor_parallel_needs_torch_distributed():
    with pytest.raises(ValueError, match="torchrun"):
        parallel.initialize(2)


@pytest.mark.parametrize("field,value,tp", [
    ("num_attention_heads", 12, 8), ("hidden_size", 772, 8), ("ffn_hidden_size", 3074, 4),
    ("padded_vocab_size", 50257, 2), ("num_query_groups", 2, 4),  # GQA: whole kv heads per rank
])
@pytest.mark.quick
def test_check_layout_names_the_quantity(field, value, tp):
    config = SimpleNamespace(num_attention_heads=16, hidden_size=768, ffn_hidden_size=3072,
                             padded_vocab_size=50304, num_query_groups=16, domino_chunks=1,
                             activation_checkpointing=False)
    parallel.check_layout(config, tp)  # the GPT-2 shape is fine
    setattr(config, field, value)
    with pytest.raises(ValueError, match=f"{field}={value}"):
        parallel.check_layout(config, tp)


@pytest.mark.quick
def test_all_to_all_context_parallelism_needs_heads_for_every_rank(monkeypatch):
    """--cp-comm-type a2a hands each of cp x tp ranks whole heads: one line
    naming the quantity and the fix (ring attention takes any heads)."""
    config = SimpleNamespace(num_attention_heads=4, hidden_size=64, ffn_hidden_size=256, padded_vocab_size=128,
                             num_query_groups=2, domino_chunks=1, activation_checkpointing=False, cp_comm_type="a2a")
    monkeypatch.setattr(parallel, "layout", parallel.Layout(cp_size=2, initialized=True))
    parallel.check_layout(config, 1)  # 4 heads and 2 key/value groups over cp 2 x tp 1; not over 2 x 2:
    with pytest.raises(ValueError, match=r"^--cp-comm-type a2a splits the heads over context x tensor parallelism: "
                                         r"num_query_groups=2 is not divisible by 2 x 2; use --cp-comm-type p2p"):
        parallel.check_layout(config, 2)
    config.cp_comm_type = "p2p"
    parallel.check_layout(config, 2)


def test_domino_does_not_recompute_under_tensor_parallelism():
    config = SimpleNamespace(num_attention_heads=16, hidden_size=768, ffn_hidden_size=3072,
                             padded_vocab_size=50304, num_query_groups=16, domino_chunks=2,
                             activation_checkpointing=True)
    parallel.check_layout(config, 1)  # Domino is off at tp=1
    with pytest.raises(ValueError, match="domino_chunks > 1 cannot be combined with activation_checkpointing"):
        parallel.check_layout(config, 2)


# --------------------------------------------------------------------------
# GPT under tensor parallelism (gpt.py + parallel.py)
# --------------------------------------------------------------------------

import gpt  # noqa: E402
from gpt import GPT, GPTConfig, LLAMA_OPTIONS  # noqa: E402
from gpt import generate  # noqa: E402

# Every architecture option on, for the TP and Domino comparisons
# below: 2 key/value heads (one per rank at T=2), half of each head rotating.
ALL_OPTIONS = dict(LLAMA_OPTIONS, num_query_groups=2, rotary_percent=0.5)
MODEL_OPTIONS = pytest.mark.parametrize("options", [{}, ALL_OPTIONS], ids=["gpt2", "all-options"])


def _use_layout(tp: int):
    """Switch this rank's tensor-parallel size (models read it when built and run)."""
    parallel.destroy()
    parallel.initialize(tp)


def _build_gpt(tp: int, **overrides) -> GPT:
    _use_layout(tp)
    torch.manual_seed(0)  # same seed on every rank, as train.py does
    parallel.model_parallel_seed(0)  # and the per-TP-rank dropout stream
    shape = dict(num_layers=2, hidden_size=32, num_attention_heads=4,
                 max_position_embeddings=16, vocab_size=100, padded_vocab_size=128)
    return GPT(GPTConfig(**{**shape, **overrides}))


def _full_grads(model: GPT) -> dict:
    return {n: _gathered_grad(p) if getattr(p, "tensor_model_parallel", False) else p.grad
            for n, p in model.named_parameters()}


def _forward_backward(model: GPT):
    """Full logits, loss, gathered grads and clipped global grad norm on one batch."""
    x, y, mask = uneven_batch(0)
    logits = model(x).detach()
    loss = model(x, labels=y, loss_mask=mask)
    loss.backward()
    grads = {n: g.clone() for n, g in _full_grads(model).items()}
    norm = train.clip_grad_norm_(model.parameters(), max_norm=0.05)
    clipped = _full_grads(model)
    return logits, loss.detach(), grads, norm, clipped


def _train_losses(model: GPT, steps: int = 8) -> list:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x, y, mask = uneven_batch(step)
        loss = model(x, labels=y, loss_mask=mask)
        loss.backward()
        train.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _assert_same_run(got, want, what, tol=1e-5, grad_atol=1e-7):
    logits, loss, grads, norm, clipped = got
    logits_ref, loss_ref, grads_ref, norm_ref, clipped_ref = want
    assert_close(logits, logits_ref, tol=tol, what=f"{what}: logits")
    assert_close(loss, loss_ref, tol=tol, what=f"{what}: loss")
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=tol, atol=grad_atol,
                                   msg=lambda m: f"{what}: grad of {name}: {m}")
        torch.testing.assert_close(clipped[name], clipped_ref[name], rtol=tol, atol=grad_atol,
                                   msg=lambda m: f"{what}: clipped grad of {name}: {m}")
    assert_close(norm, norm_ref, tol=tol, what=f"{what}: grad norm")


def _check_gpt_tensor_parallel_matches_single_gpu(options):
    # The reference is T=1 with the full-logits loss; T=2 runs the default
    # fused head + loss (fused_loss.FusedLinearCrossEntropy), vocab-parallel.
    def build(tp, **overrides):
        return _build_gpt(tp, **options, **overrides)

    ref = build(1, loss_impl="full")
    want = _forward_backward(ref)
    ref_sd = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_losses = _train_losses(build(1, loss_impl="full"))

    tp = build(2)
    # Really sharded: half the heads, half the vocab rows on this rank.
    assert tp.blocks[0].attn.qkv.weight.shape == (ref.blocks[0].attn.qkv.weight.shape[0] // 2, 32)
    assert tp.wte.weight.shape == (64, 32)
    if options:  # an untied head, vocab-parallel too
        assert tp.output_layer.weight.shape == (64, 32)
    # Same full model from the same seed, same keys as T=1.
    full = tp.full_state_dict()
    assert full.keys() == ref_sd.keys()
    for k in ref_sd:
        assert torch.equal(full[k], ref_sd[k]), k
    _assert_same_run(_forward_backward(tp), want, "T=2 vs T=1")
    losses = _train_losses(build(2))
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)

    # Checkpoint written at T=2 loads at T=1 and back at T=2.
    trained = build(2)
    _train_losses(trained, steps=3)
    x, y, mask = uneven_batch(7)
    with torch.no_grad():
        loss_t2 = trained(x, labels=y, loss_mask=mask)
    saved = trained.full_state_dict()
    single = build(1)
    single.load_full_state_dict(saved)
    with torch.no_grad():
        assert_close(single(x, labels=y, loss_mask=mask), loss_t2, tol=1e-5, what="T=2 -> T=1")
    # greedy, re-running the prefix every step (past the 16 positions too)
    greedy_t1 = generate(single, x[:, :4], 14, temperature=0, use_cache=False)
    back = build(2)
    back.load_full_state_dict({k: v.clone() for k, v in single.state_dict().items()})
    with torch.no_grad():
        assert_close(back(x, labels=y, loss_mask=mask), loss_t2, tol=1e-5, what="T=1 -> T=2")
    # With a KV cache at T=2 (each rank caches its own key/value heads): the same tokens
    assert torch.equal(generate(back, x[:, :4], 14, temperature=0), greedy_t1)


@pytest.mark.quick
@pytest.mark.slow
@MODEL_OPTIONS
def test_gpt_tensor_parallel_matches_single_gpu(options):
    run_on_ranks(_check_gpt_tensor_parallel_matches_single_gpu, options)


def _check_domino_matches_plain_tensor_parallel(options):
    def build(tp, **overrides):
        return _build_gpt(tp, **options, **overrides)

    plain = build(2, loss_impl="full")  # Domino runs the default fused loss
    want = _forward_backward(plain)
    plain_losses = _train_losses(build(2, loss_impl="full"))
    for chunks in (2, 3):
        domino = build(2, domino_chunks=chunks)
        assert isinstance(domino.blocks[0].mlp.fc, parallel.DominoColumnParallelLinear)
        _assert_same_run(_forward_backward(domino), want, f"domino {chunks} chunks")
        losses = _train_losses(build(2, domino_chunks=chunks))
        torch.testing.assert_close(losses, plain_losses, rtol=1e-5, atol=0)
    if options:  # per-sample RoPE positions (--reset-position-ids) and documents split with the chunks
        x, y, mask = uneven_batch(0)
        positions = torch.stack([torch.arange(8), torch.arange(8) % 5, torch.arange(8) % 3])
        documents = torch.arange(8) - positions  # each token's document's first index (--reset-attention-mask)
        with torch.no_grad():
            assert_close(build(2, domino_chunks=3)(x, positions, y, mask), plain(x, positions, y, mask),
                         tol=1e-5, what="per-sample positions")
            assert_close(build(2, domino_chunks=3)(x, positions, y, mask, document_ids=documents),
                         plain(x, positions, y, mask, document_ids=documents), tol=1e-5, what="documents")
    # A micro-batch smaller than the chunk count falls back to the plain path.
    x, y, mask = uneven_batch(0, batch_size=1)
    with torch.no_grad():
        assert_close(build(2, domino_chunks=3)(x, labels=y), plain(x, labels=y),
                     tol=1e-5, what="batch 1 fallback")


@pytest.mark.quick
@pytest.mark.slow
@MODEL_OPTIONS
def test_domino_overlap_matches_plain_tensor_parallel(options):
    run_on_ranks(_check_domino_matches_plain_tensor_parallel, options)


def _check_sequence_parallel_matches_single_gpu(options, tp):
    def build(tp, **overrides):
        return _build_gpt(tp, **options, **overrides)

    single = build(1, loss_impl="full")
    want = _forward_backward(single)
    trained_single = build(1, loss_impl="full")
    ref_losses = _train_losses(trained_single)
    x = uneven_batch(0)[0]
    greedy = generate(single, x[:, :4], 6, temperature=0)
    for chunks in (1, 2, 3):  # plain sequence parallelism, then with Domino
        model = build(tp, sequence_parallel=True, domino_chunks=chunks)
        assert model.wte.sequence_parallel and model.blocks[0].mlp.proj.sequence_parallel
        what = f"T={tp} sequence parallel, {chunks} chunk(s) vs T=1"
        _assert_same_run(_forward_backward(model), want, what)
        # generation (one token at a time: no sequence to split) runs it whole,
        # with the KV cache and without (re-running the prefix of odd lengths)
        assert torch.equal(generate(model, x[:, :4], 6, temperature=0), greedy), what
        assert torch.equal(generate(model, x[:, :4], 6, temperature=0, use_cache=False), greedy), what
        assert model.blocks[0].attn.qkv.sequence_parallel  # and switches it back on
        losses = _train_losses(build(tp, sequence_parallel=True, domino_chunks=chunks))
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0, msg=lambda m: f"{what}: {m}")
    # Checkpoints hold full weights: T=1's trained weights load under sequence
    # parallelism, and back at T=1 from there, with the same loss.
    x, y, mask = uneven_batch(7)
    with torch.no_grad():
        _use_layout(1)  # the layout a model runs in is the one it was built in
        want_loss = trained_single(x, labels=y, loss_mask=mask)
        sp = build(tp, sequence_parallel=True)
        sp.load_full_state_dict({k: v.clone() for k, v in trained_single.state_dict().items()})
        assert_close(sp(x, labels=y, loss_mask=mask), want_loss, tol=1e-5, what="T=1 -> SP")
        saved = sp.full_state_dict()
        back = build(1)
        back.load_full_state_dict(saved)
        assert_close(back(x, labels=y, loss_mask=mask), want_loss, tol=1e-5, what="SP -> T=1")


@pytest.mark.slow
@pytest.mark.parametrize("tp,options", [pytest.param(2, {}, marks=pytest.mark.quick), (2, ALL_OPTIONS), (4, {})],
                         ids=["T=2-gpt2", "T=2-all-options", "T=4-gpt2"])
def test_sequence_parallel_matches_single_gpu(tp, options):
    """Sequence parallelism, alone and with Domino (2 and 3 chunks), equals
    the single-device model in fp32: logits, loss, every gradient (the
    norms' weights and the row-parallel biases, summed over the sequence
    slices, included), the clipped norm, and 8 AdamW steps. Every rank
    compares its own replicated gradients, so a rank that kept only its
    tokens' share fails."""
    run_on_ranks(_check_sequence_parallel_matches_single_gpu, options, tp, world_size=tp)


class _OverlapRecorder(TorchDispatchMode):
    """Logs, in order, every TP collective launch and wait and every GEMM of
    one Domino chunk. The chunk is told apart by its token count: the batch
    (3, 5) splits into chunks of 2 and 1 rows, 10 and 5 tokens, a size no
    weight of the model has. Under sequence parallelism the collectives move
    each rank's tokens and the GEMMs see all of them: comm_chunks maps those.
    The collectives are parallel.py's functional ones, seen as they are
    dispatched (as _fx_events reads them from a compiled graph); on CPU an
    all-gather is launched as a sum (parallel._launch_all_gather_as_sum), the
    only all-reduce of activations under sequence parallelism. serialize:
    wait for each all-reduce right after launching it."""

    def __init__(self, gemm_chunks=None, comm_chunks=None, serialize=False):
        super().__init__()
        self.gemm_chunks = gemm_chunks or {10: 0, 5: 1}
        self.comm_chunks = comm_chunks or self.gemm_chunks
        self.sequence_parallel = comm_chunks is not None
        self.serialize = serialize
        self.events = []
        self.in_flight = {}   # a launched chunk's output (its data pointer) -> (collective, identity)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            dims = {d for a in args if isinstance(a, torch.Tensor) for d in a.shape}
            for tokens, chunk in self.gemm_chunks.items():
                if tokens in dims:
                    self.events.append(("gemm", chunk, None))
        out = func(*args, **(kwargs or {}))
        namespace, name = func._schema.name.split("::")
        if namespace != "_c10d_functional":
            return out
        if name == "wait_tensor":
            launch = self.in_flight.pop(args[0].data_ptr(), None)
            if launch is not None:
                self.events.append(("wait", None, launch))
            return out
        name, tokens = _tp_collective(name, out, self.sequence_parallel)
        chunk = self.comm_chunks.get(tokens)
        if chunk is not None:
            launch = (name, object())  # this collective's identity
            self.events.append(("launch", chunk, launch))
            self.in_flight[out.data_ptr()] = launch
            if self.serialize and name == "all_reduce":
                torch.ops._c10d_functional.wait_tensor(out)  # not dispatched to this mode again
                self.events.append(("wait", None, self.in_flight.pop(out.data_ptr())))
        return out


def _tp_collective(name: str, out, sequence_parallel: bool) -> tuple:
    """A functional collective's op name and output -> (its name in these
    tests, the tokens of the per-rank piece it moves, (..., C) -> tokens; None
    without a C). On CPU an all-gather is launched as a sum
    (parallel._launch_all_gather_as_sum), under sequence parallelism the only
    all-reduce of activations: (tp * b, s, C), a tp-th of it each rank's."""
    # gloo's functional all-gather, beside another collective, can corrupt the heap
    assert name != "all_gather_into_tensor", "on CPU (gloo): see parallel._launch_all_gather_as_sum"
    name = {"reduce_scatter_tensor": "reduce_scatter"}.get(name, name)
    tokens = out.numel() // out.shape[-1] if out.dim() > 1 else None
    if name == "all_reduce" and sequence_parallel and out.dim() > 2:
        name, tokens = "all_gather", tokens // parallel.layout.tp_size
    return name, tokens


def _unhidden_all_reduces(events, name="all_reduce", other_chunk=True) -> list:
    """The launches of `name`, but the last, with no GEMM of ANOTHER chunk
    (other_chunk=False: of any chunk) before their first wait: a collective
    that nothing overlapped."""
    waits = {}
    for k, (kind, _, launch) in enumerate(events):
        if kind == "wait":
            waits.setdefault(launch, k)
    launches = [(k, chunk, launch) for k, (kind, chunk, launch) in enumerate(events)
                if kind == "launch" and launch[0] == name]
    assert launches and all(launch in waits for *_, launch in launches), "every launch is waited for"
    unhidden = []
    for k, chunk, launch in launches[:-1]:
        between = events[k + 1:waits[launch]]
        if not any(kind == "gemm" and (c != chunk or not other_chunk) for kind, c, _ in between):
            unhidden.append(k)
    return unhidden


def _synchronous(events) -> list:
    """The launches waited for at once: their wait is the very next event."""
    return [k for k, (kind, _, launch) in enumerate(events[:-1])
            if kind == "launch" and events[k + 1] == ("wait", None, launch)]


def _record_domino_order(serialize: bool, sequence_parallel: bool = False, zero_bubble: bool = False):
    """(forward events, backward events) of one Domino micro-batch on this rank;
    zero_bubble: the backward is a zero-bubble pipeline's I (its dW left in a
    store, pipeline.LaterWeightGrads), and W's events come third."""
    model = _build_gpt(2, domino_chunks=2, sequence_parallel=sequence_parallel)
    # sequence parallel: 12 tokens a row, so the chunks' GEMMs see 24 and 12
    # tokens and their collectives carry 12 and 6 (the weights: 16, 32, 48, 64)
    ids = torch.randint(0, 100, (3, 13 if sequence_parallel else 6), generator=torch.Generator().manual_seed(0))
    chunks = ({24: 0, 12: 1}, {12: 0, 6: 1}) if sequence_parallel else ()
    recorder, store = _OverlapRecorder(*chunks, serialize=serialize), []
    later = pipeline.LaterWeightGrads(model) if zero_bubble else None
    with recorder:
        with later.deferring(store) if later else nullcontext():
            loss = model(ids[:, :-1], labels=ids[:, 1:])
        forward = list(recorder.events)
        with later.deferring(store, backward=True) if later else nullcontext():
            loss.backward()
    backward = recorder.events[len(forward):]
    if not zero_bubble:
        return forward, backward
    with recorder:
        pipeline.weight_grads(store)
    return forward, backward, recorder.events[len(forward) + len(backward):]


def _check_domino_overlaps_every_all_reduce():
    forward, backward = _record_domino_order(serialize=False)
    # 2 layers x 2 sublayers x 2 chunks all-reduces each way.
    assert sum(kind == "launch" for kind, *_ in forward) == 8
    assert sum(kind == "launch" for kind, *_ in backward) == 8
    assert _unhidden_all_reduces(forward) == [], forward
    assert _unhidden_all_reduces(backward) == [], backward
    # The check has teeth: waiting right after each launch fails it both ways.
    forward, backward = _record_domino_order(serialize=True)
    assert len(_unhidden_all_reduces(forward)) == 7
    assert len(_unhidden_all_reduces(backward)) == 7
    # Under sequence parallelism: forward, each reduce-scatter runs while the
    # other chunk computes, and so does each all-gather but the very first
    # (nothing precedes it); backward, each dX reduce-scatter likewise, and
    # each re-gather of a column layer's input tokens runs beside its dX GEMM.
    forward, backward = _record_domino_order(serialize=False, sequence_parallel=True)
    launched = [launch[0] for kind, _, launch in forward if kind == "launch"]
    assert launched.count("reduce_scatter") == 8 and launched.count("all_gather") == 8
    assert _unhidden_all_reduces(forward, "reduce_scatter") == [], forward
    first_gather = next(k for k, (kind, _, launch) in enumerate(forward) if kind == "launch")
    assert _unhidden_all_reduces(forward, "all_gather") == [first_gather], forward
    # none is waited for at once, but that first all-gather
    assert _synchronous(forward) == [first_gather], forward
    assert _unhidden_all_reduces(backward, "reduce_scatter") == [], backward
    # ...while the all-gather of a row-parallel layer's dY is waited for at
    # once (its GEMMs need it), 8 of them; the re-gathers run beside the dX GEMM
    synchronous = _synchronous(backward)
    assert len(synchronous) == 8 and all(backward[k][2][0] == "all_gather" for k in synchronous), backward
    regathers = [e for k, e in enumerate(backward) if k not in synchronous and k - 1 not in synchronous]
    assert _unhidden_all_reduces(regathers, "all_gather", other_chunk=False) == [], regathers
    # Zero bubble: the dW GEMMs (2 layers x 4 linears x 2 chunks) leave the
    # backward (I) for W, where no collective is in flight; every dX
    # all-reduce (SP: reduce-scatter) but the last still has the other
    # chunk's dX GEMMs beside it, now all that hides it.
    gemms = lambda events: sum(kind == "gemm" for kind, *_ in events)  # noqa: E731
    for sp, name in ((False, "all_reduce"), (True, "reduce_scatter")):
        plain = _record_domino_order(serialize=False, sequence_parallel=sp)[1]
        _, backward, w = _record_domino_order(serialize=False, sequence_parallel=sp, zero_bubble=True)
        assert gemms(w) == 16 and gemms(backward) == gemms(plain) - 16, (w, backward)
        assert all(kind == "gemm" for kind, *_ in w), w
        assert sum(kind == "launch" and launch[0] == name for kind, _, launch in backward) == 8
        assert _unhidden_all_reduces(backward, name) == [], backward


@pytest.mark.quick
@pytest.mark.slow
def test_domino_runs_another_chunks_gemms_while_each_all_reduce_is_in_flight():
    """Domino's point, checked from the order of operations on 2 ranks: in
    forward and in backward, between the launch of every chunk's all-reduce
    (but the last) and its wait, a GEMM of the other chunk runs; under
    sequence parallelism, the same for its reduce-scatters and all-gathers;
    under a zero-bubble pipeline's split backward, the same in I, the weight
    gradients' GEMMs in W."""
    run_on_ranks(_check_domino_overlaps_every_all_reduce)


def _check_saved_activations_follow_the_paper():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from activation_memory import formula, layer_activation_bytes
    _use_layout(2)
    s, b, h = 64, 2, 128
    measured = {}
    for sp in (False, True):
        config = GPTConfig(num_layers=1, hidden_size=h, num_attention_heads=2, max_position_embeddings=s,
                           vocab_size=100, padded_vocab_size=128, hidden_dropout=0.1, sequence_parallel=sp)
        measured[sp] = layer_activation_bytes(config, s, b)
        # the rest: LayerNorm statistics and attention's logsumexp, fp32 per token
        assert 1 <= measured[sp] / formula(s, b, h, 2, sp) < 1.03, (sp, measured[sp])
    assert measured[False] / measured[True] > 1.25  # 22 / 17 at T=2


def test_sequence_parallel_saves_what_the_paper_says():
    """The bytes autograd keeps for one layer (bench/activation_memory.py)
    follow Korthikanti et al.: s*b*h*(10 + 24/T) without sequence
    parallelism, s*b*h*34/T with it, at T=2. A column-parallel layer that
    kept its gathered input, or a dropout keeping a 16-bit mask, fails."""
    run_on_ranks(_check_saved_activations_follow_the_paper)


def _check_dropout_keeps_replicated_parameters_identical():
    """Dropout under TP: every TP rank draws the same masks for the replicated
    residual stream (same seed, same draws in the same order, Domino or not),
    so the parameters every rank holds in full stay bitwise equal. Under
    sequence parallelism the ranks draw different masks for their different
    tokens, and the summed gradients keep the replicas equal all the same."""
    for chunks, sp in ((1, False), (2, False), (1, True), (2, True)):
        model = _build_gpt(2, hidden_dropout=0.2, attention_dropout=0.2, domino_chunks=chunks,
                           sequence_parallel=sp)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        _train_losses(model, steps=4)
        for name, p in model.named_parameters():
            assert not torch.equal(p, before[name]), f"{name} never trained"
            if getattr(p, "tensor_model_parallel", False):
                continue  # a shard: it differs by design
            mine = p.detach().contiguous()
            theirs = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(theirs, mine)
            assert torch.equal(theirs[0], theirs[1]), \
                f"{name} differs across TP ranks ({chunks} chunks, sequence parallel {sp})"


def test_dropout_keeps_replicated_parameters_identical_across_tp_ranks():
    run_on_ranks(_check_dropout_keeps_replicated_parameters_identical)


def _dropout_masks(model, x):
    """{module name: where its output is zero} of every hidden dropout in one forward."""
    masks, hooks = {}, []

    def record(name):
        def hook(module, inputs, out):
            masks[name] = out == 0   # (returns None: the output stays as it is)
        return hook
    for name, m in model.named_modules():
        if isinstance(m, gpt.Dropout):
            hooks.append(m.register_forward_hook(record(name)))
    model(x)
    for h in hooks:
        h.remove()
    return masks


def _check_per_rank_dropout_streams():
    x, y, mask = uneven_batch(0)
    # Under SP each rank drops other elements of its own tokens (the shared
    # stream would give both ranks the same mask); without SP the replicated
    # stream needs the same mask on every rank.
    for sp in (True, False):
        model = _build_gpt(2, hidden_dropout=0.5, sequence_parallel=sp).train()
        masks = _dropout_masks(model, x)
        assert len(masks) == 5  # embedding + 2 per block
        for name, m in masks.items():
            both = [torch.empty_like(m) for _ in range(2)]
            dist.all_gather(both, m.contiguous())
            assert torch.equal(both[0], both[1]) != sp, f"{name}: sequence parallel {sp}"
    # Attention dropout (each rank: other heads) draws from the per-rank
    # stream under any TP: the shared stream does not move, the tracked one does.
    model = _build_gpt(2, attention_dropout=0.5).train()
    tracker = parallel.rng_tracker_states_of_every_tp_rank  # the checkpoint's reading (collective)
    shared, tracked = torch.get_rng_state(), tracker()[parallel.layout.tp_rank]
    model(x)
    assert torch.equal(torch.get_rng_state(), shared)
    after = tracker()[parallel.layout.tp_rank]
    assert not torch.equal(after["model-parallel-rng"]["cpu"], tracked["model-parallel-rng"]["cpu"])
    # Reproducible from the seed: the same seed, the same run; another seed, another.
    def losses(seed):
        model = _build_gpt(2, hidden_dropout=0.3, attention_dropout=0.3, sequence_parallel=True)
        parallel.model_parallel_seed(seed)
        return _train_losses(model.train(), steps=3)
    assert losses(0) == losses(0)
    assert losses(0) != losses(1)


def test_dropout_masks_differ_across_tp_ranks_under_sequence_parallel_and_replay_from_the_seed():
    run_on_ranks(_check_per_rank_dropout_streams)


def _check_checkpointing_replays_per_rank_dropout():
    """Activation checkpointing recomputes each block in backward; the per-rank
    dropout must draw the same masks again, or the gradients are those of
    another network. Same seed, with and without checkpointing: same grads."""
    x, y, mask = uneven_batch(0)
    grads = []
    for checkpointing in (False, True):
        model = _build_gpt(2, hidden_dropout=0.3, attention_dropout=0.3, sequence_parallel=True,
                           activation_checkpointing=checkpointing).train()
        model(x, labels=y, loss_mask=mask).backward()
        grads.append(_full_grads(model))
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-6, atol=1e-8,
                                   msg=lambda m: f"grad of {name}: {m}")


def test_activation_checkpointing_replays_the_per_rank_dropout_masks():
    run_on_ranks(_check_checkpointing_replays_per_rank_dropout)


def _check_triton_kernels_under_tensor_parallel(options):
    # head dim 32 (the kernels' smallest); at T=2 each rank runs its one head,
    # or with every option on its 2 query heads sharing 1 key/value head
    shape = dict(hidden_size=64, num_attention_heads=2) if not options else \
        dict(hidden_size=128, num_attention_heads=4, **options)
    want = _forward_backward(_build_gpt(1, **shape))
    # plain TP, then Domino (every residual add fused into a LayerNorm), then
    # Domino under sequence parallelism (the kernels see T/2 tokens or all T)
    for chunks, sp in ((1, False), (2, False), (2, True)):
        model = _build_gpt(2, attention_impl="triton", layernorm_impl="triton",
                           domino_chunks=chunks, sequence_parallel=sp, **shape)
        _assert_same_run(_forward_backward(model), want,
                         f"triton T=2, {chunks} chunk(s), sequence parallel {sp}",
                         tol=1e-4, grad_atol=1e-6)


@pytest.mark.slow
@MODEL_OPTIONS
def test_triton_kernels_under_tensor_parallel_and_domino(options):
    """The Triton kernels (interpreted on CPU here) at T=2, plain, with
    Domino chunks, and with Domino under sequence parallelism, reproduce the
    T=1 torch-kernel model."""
    import fused_kernels
    if not fused_kernels.triton_usable("cpu"):
        pytest.skip("needs triton with TRITON_INTERPRET=1 (set by conftest.py without a GPU)")
    run_on_ranks(_check_triton_kernels_under_tensor_parallel, options)


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||: 1.0 for a zeroed tensor, 0.5 for a halved one."""
    assert b.norm() > 0
    return ((a - b).norm() / b.norm()).item()


def _check_domino_under_bf16_autocast():
    """train.py --bf16 runs the model under torch.autocast: the async-grad
    column layer's backward then sees bf16 grads and fp32 saved tensors
    (under sequence parallelism, bf16 ones).
    Domino and plain TP round differently (the weight-gradient GEMMs sum
    over chunks), each about 0.5% from fp32; measured here, Domino is
    <= 0.35% from plain TP in every gradient."""
    x, y, mask = uneven_batch(0)
    fp32 = _build_gpt(2)
    fp32(x, labels=y, loss_mask=mask).backward()
    runs = []
    for chunks in (1, 2):
        model = _build_gpt(2, domino_chunks=chunks)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, labels=y, loss_mask=mask)
        loss.backward()
        runs.append((loss.detach(), _full_grads(model)))
    (loss_plain, grads_plain), (loss_domino, grads_domino) = runs
    assert_close(loss_domino, loss_plain, tol=1e-4, what="bf16 domino loss")
    for name, want in _full_grads(fp32).items():
        assert grads_domino[name].dtype == torch.float32, name  # fp32 master grads
        assert _relative_error(grads_domino[name], grads_plain[name]) < 1e-2, name
        assert _relative_error(grads_domino[name], want) < 2e-2, name
    # Sequence parallelism (alone, and with Domino) under autocast: the same
    # training signal, and every layer gathers (and keeps) 16-bit inputs,
    # though a torch LayerNorm hands it fp32.
    gathered, real_gather = [], parallel.launch_all_gather

    def recording_gather(x):
        gathered.append(x.dtype)
        return real_gather(x)
    for chunks in (1, 2):
        model = _build_gpt(2, domino_chunks=chunks, sequence_parallel=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, labels=y, loss_mask=mask)
            parallel.launch_all_gather = recording_gather
            try:
                model.blocks[0](torch.randn(3, 4, 32)) if chunks == 1 else \
                    gpt.domino_blocks(model.blocks, torch.randn(3, 4, 32), 2)
            finally:
                parallel.launch_all_gather = real_gather
        loss.backward()
        assert_close(loss.detach(), loss_plain, tol=1e-2, what=f"bf16 SP loss, {chunks} chunk(s)")
        for name, grad in _full_grads(model).items():
            assert grad.dtype == torch.float32, name
            assert _relative_error(grad, grads_plain[name]) < 2e-2, (chunks, name)
    assert len(gathered) == 2 + 2 * 2 * 2, gathered  # one block: 2 sublayers; Domino: 2 blocks x 2 x 2 chunks
    assert set(gathered) == {torch.bfloat16}, gathered


@pytest.mark.slow
def test_domino_works_under_bf16_autocast():
    run_on_ranks(_check_domino_under_bf16_autocast)


@pytest.mark.quick
def test_gpt_with_one_rank_is_the_plain_model():
    parallel.initialize(1)
    try:
        model = _build_gpt(1, domino_chunks=2)  # Domino is a no-op without TP
        assert type(model.blocks[0].attn.qkv) is nn.Linear
        assert type(model.wte) is nn.Embedding
        assert not any(hasattr(p, "tensor_model_parallel") for p in model.parameters())
    finally:
        parallel.destroy()


def _check_construction_never_holds_the_full_model():
    """Under T=2 each block is built, initialized and sliced before the next
    one exists, so at most one unsharded block is alive at any time (a rank
    never materializes the full model, which matters for large models)."""
    import gc
    from gpt import Block
    alive_full_blocks = []
    real_shard = gpt.shard_block

    def spy(block, config):
        gc.collect()
        full = [b for b in gc.get_objects()
                if isinstance(b, Block) and isinstance(b.attn.qkv, torch.nn.Linear)]
        alive_full_blocks.append(len(full))
        return real_shard(block, config)

    gpt.shard_block = spy
    try:
        model = _build_gpt(2)
    finally:
        gpt.shard_block = real_shard
    assert alive_full_blocks == [1] * len(model.blocks)
    assert all(isinstance(b.attn.qkv, parallel.ColumnParallelLinear) for b in model.blocks)


def test_construction_never_holds_the_full_model():
    run_on_ranks(_check_construction_never_holds_the_full_model)


def _check_zero3_builds_the_kernels_of_its_accelerator():
    """ZeRO-3 under TP builds the model on the host, one layer at a time;
    the kernels are still chosen for the device it will run on (here a
    GPU, as DeepSpeed's accelerator reports it): Triton, not torch's."""
    import config
    import train
    import zero
    _use_layout(2)
    cfg = config.parse_args(["--preset", "tiny", "--num-attention-heads", "2", "--deepspeed",
                             "--zero-stage", "3", "--tensor-model-parallel-size", "2"])

    class GPUAccelerator:
        device_name = staticmethod(lambda: "cuda")

    class DeepSpeed:
        get_accelerator = staticmethod(lambda: GPUAccelerator)

    model = zero.build_model_zero3(cfg, DeepSpeed, {}, train.build_model)
    assert (model.config.attention_impl, model.config.layernorm_impl) == ("triton", "triton")
    assert isinstance(model.blocks[0].attn.qkv, parallel.ColumnParallelLinear)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_zero3_under_tensor_parallelism_builds_the_kernels_of_its_accelerator():
    run_on_ranks(_check_zero3_builds_the_kernels_of_its_accelerator)


# --------------------------------------------------------------------------
# A non-finite gradient under tensor parallelism
# --------------------------------------------------------------------------

def _check_non_finite_grad_skips_the_step_on_every_rank(precision, poisoned):
    """An inf in ONE rank's gradient of a shard, or of its copy of a
    replicated parameter (which the norm counts on TP rank 0 only): every
    rank skips that step (and under fp16 halves its loss scale), so the
    ranks stay in lockstep: equal scales, and replicated weights bitwise
    equal across the TP group."""
    import config
    import train
    cfg = config.parse_args(["--preset", "tiny", "--clip-grad", "1.0", "--tensor-model-parallel-size", "2",
                             "--initial-loss-scale", "1024", *precision])
    _use_layout(2)
    trainer = train.PlainTraining(cfg, process_env())
    model, scaler = trainer.raw, trainer.scaler
    param = model.get_parameter(poisoned)
    assert getattr(param, "tensor_model_parallel", False) == (poisoned == "blocks.0.mlp.fc.weight")
    poison = []  # on rank 1 only, while it holds True

    def inject_inf(p):
        if poison and dist.get_rank() == 1:
            p.grad.view(-1)[0] = float("inf")

    param.register_post_accumulate_grad_hook(inject_inf)

    def step(i):
        x, y, mask = uneven_batch(i)
        batch = {"tokens": x, "labels": y, "loss_mask": mask,
                 "position_ids": torch.arange(x.shape[1]).expand_as(x)}
        return train.train_step(trainer, [batch], lr=1e-2)

    assert step(0)[2] == 0  # not skipped
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    poison.append(True)
    loss, norm, skipped = step(1)
    poison.clear()
    assert skipped == 1 and not torch.isfinite(norm) and torch.isfinite(loss)
    for n, p in model.named_parameters():  # nothing moved, on either rank
        assert torch.equal(p, before[n]), n
    if scaler:
        scales = [None, None]
        dist.all_gather_object(scales, scaler.state_dict()["scale"])
        assert scales == [2.0 ** 9] * 2
    assert step(2)[2] == 0
    for n, p in model.named_parameters():
        if not getattr(p, "tensor_model_parallel", False):  # replicated: the same on both ranks
            copies = [torch.empty_like(p) for _ in range(2)]
            dist.all_gather(copies, p.detach())
            assert torch.equal(copies[0], copies[1]), n


@pytest.mark.parametrize("precision, poisoned", [
    (["--fp16"], "blocks.0.mlp.fc.weight"), (["--bf16"], "blocks.0.mlp.fc.weight"),
    ([], "blocks.0.mlp.fc.weight"), ([], "blocks.0.ln_1.weight")],
    ids=["fp16", "bf16", "fp32", "fp32-replicated"])
def test_non_finite_grad_skips_the_step_on_every_rank(precision, poisoned):
    run_on_ranks(_check_non_finite_grad_skips_the_step_on_every_rank, precision, poisoned)


def _check_checkpoint_states_are_assembled_on_the_writer_only(tp):
    """A save gathers the full model and AdamW states tensor by tensor on
    global rank 0 only (dist.gather, to the host): other ranks get nothing,
    and what rank 0 gets is exactly the all-gathered full state."""
    import checkpoint
    model = _build_gpt(tp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y, mask = uneven_batch(0)
    model(x, labels=y, loss_mask=mask).backward()
    opt.step()
    reference = parallel.full_state_dict(model)
    full_moments = {n: parallel.gather_like(p, opt.state[p]["exp_avg"]) for n, p in model.named_parameters()}
    model_sd, optim_sd = checkpoint.states_for_writer(model, opt)
    if dist.get_rank() != 0:
        assert model_sd is None and optim_sd is None
        return
    assert model_sd.keys() == reference.keys()
    for name, t in reference.items():
        assert t.shape == model_sd[name].shape and torch.equal(model_sd[name], t), name
        assert model_sd[name].device.type == "cpu"
    for name, moment in full_moments.items():
        assert torch.equal(optim_sd["state"][name]["exp_avg"], moment), name


@pytest.mark.parametrize("tp", [2, 1], ids=["T=2", "T=1,D=2"])
def test_checkpoint_states_are_assembled_on_the_writer_only(tp):
    run_on_ranks(_check_checkpoint_states_are_assembled_on_the_writer_only, tp)


def _check_a_pipelined_save_sends_rank_0_every_stage_tensor_by_tensor():
    """At pp=2 the torch format's save assembles the whole model's states on
    rank 0 from both stages: stage 1's tensors come one at a time, point to
    point; what gather_object carries holds no tensor (names and shapes)."""
    import checkpoint
    import pipeline
    shape = dict(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
                 vocab_size=100, padded_vocab_size=128)
    models = {}
    for pp in (1, 2):  # the whole model, then this rank's stage: the same weights, the same gradients
        parallel.destroy()
        parallel.initialize(1, pipeline_model_parallel_size=pp)
        torch.manual_seed(0)
        model = pipeline.stage_model(GPTConfig(**shape), pipeline.pipeline_chunks(2, pp, parallel.layout.pp_rank))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
        opt.step()
        models[pp] = model, opt
    gathered, gather_object = [], dist.gather_object
    dist.gather_object = lambda obj, *a, **k: gathered.append(obj) or gather_object(obj, *a, **k)
    try:
        model_sd, optim_sd = checkpoint.states_for_writer(*models[2])
    finally:
        dist.gather_object = gather_object
    assert gathered and "Tensor(" not in repr(gathered) and "tensor(" not in repr(gathered)
    if dist.get_rank() != 0:
        assert model_sd is None and optim_sd is None
        return
    whole, whole_opt = models[1]
    assert model_sd.keys() == whole.state_dict().keys()
    for name, t in whole.state_dict().items():
        assert torch.equal(model_sd[name], t), name
    for name, p in whole.named_parameters():
        for k, v in whole_opt.state[p].items():
            assert torch.equal(optim_sd["state"][name][k], v), (name, k)


def test_a_pipelined_save_sends_rank_0_every_stage_tensor_by_tensor():
    run_on_ranks(_check_a_pipelined_save_sends_rank_0_every_stage_tensor_by_tensor)


def _check_torch_dist_saves_fused_shards_as_pieces_of_the_full_tensor(tmp: str):
    """--ckpt-format torch_dist writes a TP=2 shard of a fused block ([Q | K | V]
    with fewer K/V heads, [gate | up]) as its pieces of the full tensor
    (checkpoint.as_shards): read back at TP=1 every tensor is the whole one."""
    import checkpoint
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    model = _build_gpt(2, **ALL_OPTIONS)
    assert model.blocks[0].attn.qkv.weight.partition_blocks != 1  # the fused blocks are exercised
    dcp.save(checkpoint.dist_model_state(model), checkpoint_id=tmp,
             planner=DefaultSavePlanner(**checkpoint.AS_THEY_ARE))
    full = parallel.full_state_dict(model)
    whole = _build_gpt(1, **ALL_OPTIONS)
    for t in whole.state_dict().values():
        t.zero_()
    dcp.load(checkpoint.dist_model_state(whole), checkpoint_id=tmp, planner=DefaultLoadPlanner(**checkpoint.AS_THEY_ARE))
    assert whole.state_dict().keys() == full.keys()
    for name, t in whole.state_dict().items():
        assert torch.equal(t, full[name]), name


def test_torch_dist_saves_fused_shards_as_pieces_of_the_full_tensor(tmp_path):
    run_on_ranks(_check_torch_dist_saves_fused_shards_as_pieces_of_the_full_tensor, str(tmp_path))


# --------------------------------------------------------------------------
# torch.compile over the whole model at every layout
# --------------------------------------------------------------------------
#
# The layouts run inside ONE group of 2 gloo ranks (the module's fixture
# `compiled`), which writes what it measured to a JSON file that the tests
# read: compiled vs eager losses and gradients, Dynamo's graph breaks, and the
# order of collectives and GEMMs in the graphs AOTAutograd hands the compiler.
# The layouts compile with a graph-capturing backend that is aot_eager (the
# same ATen graphs, run op by op, without Inductor's C++ codegen, which costs
# ~25 s per layout on 2 cores); one layout (SP + Domino) compiles with Inductor,
# whose scheduler order is recorded too. train.py --compile is tested in
# test_train.py, the Triton kernels as custom ops under compile in test_fused_kernels.py.
# Recomputation at T=1 compiles through train.py in test_train.py (over
# pipeline stages, to the loss and gradient norm), and Domino's 3 chunks
# compile here under sequence parallelism only (eagerly, with and without).

# 3 rows of 12 tokens: Domino's 2 chunks are 2 rows (24 tokens) and 1 row
# (12); under sequence parallelism each rank's collectives carry half the
# tokens of each. No weight of the model (16, 32, 48, 64, 128 wide) has
# those sizes, so a node's token count names its chunk (as _OverlapRecorder's).
GEMM_CHUNKS, SP_COMM_CHUNKS = {24: 0, 12: 1}, {12: 0, 6: 1}
STEPS = 3

LAYOUTS = {  # name: (tensor-parallel size, GPTConfig options)
    "tp1": (1, {}),
    "tp2": (2, {}),
    "tp2-recompute": (2, dict(activation_checkpointing=True)),
    "sp": (2, dict(sequence_parallel=True)),
    "sp-recompute": (2, dict(sequence_parallel=True, activation_checkpointing=True)),
    "domino2": (2, dict(domino_chunks=2)),
    "sp-domino2": (2, dict(sequence_parallel=True, domino_chunks=2)),
    "sp-domino3": (2, dict(sequence_parallel=True, domino_chunks=3)),
    "sp-domino2-llama": (2, dict(sequence_parallel=True, domino_chunks=2, position_embedding_type="rope",
                                 normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
                                 untie_embeddings_and_output_weights=True, num_query_groups=2)),
}


def _compile_batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 100, (3, 13), generator=g)
    return ids[:, :-1], ids[:, 1:], (torch.rand(3, 12, generator=g) > 0.2).float()


def _train(model, forward) -> tuple[list, dict, int]:
    """STEPS AdamW steps through `forward`: the losses, the full (TP-
    gathered) gradients of the first step, and the bytes of activations the
    first step kept for backward."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, grads, saved = [], None, {}
    for step in range(STEPS):
        x, y, mask = _compile_batch(step)
        with _saved_for_backward(saved if step == 0 else {}, model):
            loss = forward(x, labels=y, loss_mask=mask)
        loss.backward()
        grads = grads or {n: g.clone() for n, g in _full_grads(model).items()}
        train.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads, sum(saved.values())


def _saved_for_backward(saved: dict, model):
    """Record the bytes of every activation autograd keeps for backward
    (each storage once; not the parameters): eager mode's, and the compiled
    graph's, which keeps what AOTAutograd's partitioner chose."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _fx_events(nodes, comm_chunks: dict, sequence_parallel: bool) -> list:
    """The collective launches and waits and the GEMMs among FX nodes, in
    their order, as _OverlapRecorder logs eager mode: (kind, chunk, [collective, node]).
    Under sequence parallelism on CPU, an all-reduce of activations is an
    all-gather (parallel._launch_all_gather_as_sum)."""
    events = []
    for node in nodes:
        target = str(node.target)
        if node.op != "call_function":
            continue
        if target.startswith("_c10d_functional.wait_tensor"):
            events.append(("wait", None, [None, node.args[0].name]))
        elif target.startswith("_c10d_functional."):  # all_reduce_: Inductor's in-place variant
            name = target.split(".")[1].rstrip("_")
            assert name in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor"), target
            name, tokens = _tp_collective(name, node.meta["val"], sequence_parallel)
            chunk = comm_chunks.get(tokens)
            if chunk is not None:
                events.append(("launch", chunk, [name, node.name]))
        elif target in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default"):
            dims = {d for a in node.args if isinstance(a, torch.fx.Node) for d in a.meta["val"].shape}
            events += [("gemm", chunk, None) for tokens, chunk in GEMM_CHUNKS.items() if tokens in dims]
    # a wait names its launch by node name; keep the waits of the chunks' launches
    launched = {e[2][1]: e[2] for e in events if e[0] == "launch"}
    return [e if e[0] != "wait" else ("wait", None, launched[e[2][1]])
            for e in events if e[0] != "wait" or e[2][1] in launched]


def _capturing_backend(graphs: list):
    """aot_eager (AOTAutograd, min-cut partitioner, graphs run op by op)
    that also keeps the forward and backward graphs it was given."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def keep(gm, example_inputs):
        graphs.append(gm.graph)
        return make_boxed_func(gm.forward)
    return aot_autograd(fw_compiler=keep, bw_compiler=keep,
                        partition_fn=min_cut_rematerialization_partition)


def _inductor_order(orders: list) -> dict:
    """torch.compile's arguments for Inductor with train.py's options for
    tensor parallelism (config.OVERLAP_INDUCTOR_OPTIONS), and a last
    scheduler pass that changes nothing but records the order in which the
    generated code will run the nodes: each scheduled node as the post-grad
    FX nodes it came from (a wait, a collective, a GEMM, fused kernels). A
    collective is lowered to a copy of its input and the collective itself:
    each FX node is placed at its last scheduled node (the launch proper)."""
    import config

    def record(snodes):
        origins = [origin for snode in snodes for sub in snode.get_nodes() if sub.node is not None
                   for origin in sorted(sub.node.origins, key=lambda n: n.name)]
        last = {node: k for k, node in enumerate(origins)}
        orders.append([node for k, node in enumerate(origins) if last[node] == k])
        return snodes
    options = {**config.OVERLAP_INDUCTOR_OPTIONS, "reorder_for_compute_comm_overlap": True,
               "reorder_for_compute_comm_overlap_passes": [record]}
    return {"backend": "inductor", "options": options}


def _compare(tp: int, options: dict, backend_of) -> dict:
    """One layout, eager then compiled from the same seed: what the tests check."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _build_gpt(tp, **options)
    eager_losses, eager_grads, eager_saved = _train(model, model)
    graphs = []
    start = time.time()
    model = _build_gpt(tp, **options)
    kwargs = backend_of(graphs)
    compiled = torch.compile(model, **(kwargs if isinstance(kwargs, dict) else {"backend": kwargs}))
    losses, grads, saved = _train(model, compiled)
    comm = SP_COMM_CHUNKS if options.get("sequence_parallel") else GEMM_CHUNKS
    return {"eager_losses": eager_losses, "losses": losses, "seconds": time.time() - start,
            "eager_saved": eager_saved, "saved": saved,
            "grad_errors": {n: [(grads[n] - g).abs().max().item(), g.abs().max().item()]
                            for n, g in eager_grads.items()},
            "graph_breaks": {k[:300]: v for k, v in torch._dynamo.utils.counters["graph_break"].items()},
            "graphs": len(graphs),
            "events": [_fx_events(getattr(g, "nodes", g), comm, options.get("sequence_parallel", False))
                       for g in graphs[:2]]}


def _compile_every_layout(out: str, names: list):
    results = {name: _compare(*LAYOUTS[name], _capturing_backend) for name in names}
    results["inductor:sp-domino2"] = _compare(*LAYOUTS["sp-domino2"], _inductor_order)
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("compile") / "layouts.json")
    run_on_ranks(_compile_every_layout, out, list(LAYOUTS))
    with open(out) as f:
        return json.load(f)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*LAYOUTS, "inductor:sp-domino2"])
def test_compiled_training_equals_eager(compiled, name):
    """Three AdamW steps (fp32): the compiled model's losses and first-step
    gradients equal eager mode's to 1e-5: in the Domino layouts, no gradient
    is read before its all-reduce has landed."""
    run = compiled[name]
    assert run["graphs"] >= 2, "nothing was compiled"
    torch.testing.assert_close(run["losses"], run["eager_losses"], rtol=1e-5, atol=0)
    for param, (error, scale) in run["grad_errors"].items():
        assert error <= 1e-5 * scale + 1e-7, f"{name}: grad of {param} off by {error} (max {scale})"


@pytest.mark.slow
@pytest.mark.parametrize("name", [*LAYOUTS, "inductor:sp-domino2"])
def test_no_graph_break_in_forward_and_backward(compiled, name):
    """Dynamo captures the model's forward (and with it backward) whole:
    torch._dynamo.utils.counters["graph_break"] stays empty, and there is
    one forward and one backward graph (plus none per step: no recompile)."""
    run = compiled[name]
    assert run["graph_breaks"] == {}, run["graph_breaks"]
    assert run["graphs"] == 2


# Domino's overlap survives compilation, and compilation keeps no more for backward


def _events(compiled, name):
    return [[(kind, chunk, tuple(launch) if launch else None) for kind, chunk, launch in graph]
            for graph in compiled[name]["events"]]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["domino2", "inductor:sp-domino2", "sp-domino2"])
def test_domino_overlap_survives_compilation(compiled, name):
    """In the graphs the compiler receives (aot_eager's), and in the order
    Inductor's generated code runs its kernels, every chunk's collective
    but the last has a GEMM of the other chunk between its launch and its
    wait, forward and backward: the order test_domino_runs_another_chunks_gemms_while_each_all_reduce_is_in_flight
    checks in eager mode. (Inductor keeps it with config.OVERLAP_INDUCTOR_OPTIONS: its
    peak-memory reordering would wait for each collective right after
    launching it.)"""
    forward, backward = _events(compiled, name)
    if "sp" not in name:  # 2 layers x 2 sublayers x 2 chunks all-reduces each way
        assert [k for k, *_ in forward].count("launch") == 8, forward
        assert [k for k, *_ in backward].count("launch") == 8, backward
        assert _unhidden_all_reduces(forward) == [], forward
        assert _unhidden_all_reduces(backward) == [], backward
        return
    launched = [launch[0] for kind, _, launch in forward if kind == "launch"]
    assert launched.count("reduce_scatter") == 8 and launched.count("all_gather") == 8, forward
    assert _unhidden_all_reduces(forward, "reduce_scatter") == [], forward
    first_gather = next(k for k, (kind, *_) in enumerate(forward) if kind == "launch")
    assert _unhidden_all_reduces(forward, "all_gather") == [first_gather], forward
    assert _unhidden_all_reduces(backward, "reduce_scatter") == [], backward
    # a row-parallel layer's dY is all-gathered and waited for at once (its
    # GEMMs need it): launch and wait side by side, 8 of them
    synchronous = _synchronous(backward)
    assert len(synchronous) == 8, backward
    regathers = [e for k, e in enumerate(backward) if k not in synchronous and k - 1 not in synchronous]
    assert _unhidden_all_reduces(regathers, "all_gather", other_chunk=False) == [], regathers


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in [*LAYOUTS, "inductor:sp-domino2"] if "recompute" not in n])
def test_compilation_keeps_no_more_for_backward_than_eager_mode(compiled, name):
    """The activations autograd keeps from forward for backward (bytes, each
    storage once): the compiled graph keeps no more than eager mode does.
    Sequence parallelism keeps each rank's slice of a column-parallel
    layer's input and re-gathers it in backward; AOTAutograd, which never
    recomputes a collective, would run that re-gather in forward and keep
    its output, tp times the slice, but for layers._after. (Not under
    --recompute-activations: there the compiled graph also keeps the RNG
    state of each checkpoint as a tensor, which eager mode keeps on ctx,
    out of the hooks' sight.)"""
    run = compiled[name]
    assert run["saved"] <= run["eager_saved"], (run["saved"], run["eager_saved"])
