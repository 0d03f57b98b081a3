"""Tests for context.py: context parallelism's attention is exactly the full
sequence's causal attention.

Each test rank builds the same random full-sequence q (B, nh, T, hd) and k, v
(B, G, T, hd), keeps its zigzag rows (context.local_positions), runs
context.attention on them, and compares the output and the gradients of q, k
and v with F.scaled_dot_product_attention on the full tensors (float64),
sliced the same way. Ring (p2p) and all-to-all (a2a), torch and Triton (the
interpreter, on CPU), GQA and MHA, eager and under torch.compile; and with
document masks (--reset-attention-mask), against SDPA with the same mask.
"""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import context
import fused_kernels
import parallel
from conftest import IDS, TINY, read_metrics, run_on_ranks, train_on_ranks

# (nh, G): grouped-query (two query heads per K/V head) and multi-head
HEADS = [(4, 2), (4, 4)]


def _full_inputs(nh, G, T, hd, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(B, nh, T, hd, generator=g) for _ in range(2))
    k, v = (torch.randn(B, G, T, hd, generator=g) for _ in range(2))
    return q, k, v, do


def _documents(T, B=2):
    """Document ids (B, T) of unequal documents (data._document_starts' form:
    each token's document's first index) that cross the chunk and rank
    boundaries at T = 32, C = 2 and 4 (chunks of 8 and 4 tokens): row 0 has a
    document inside one chunk (3..5) and one over 3+ chunks (6..28); row 1
    others. Some rows read no key of another rank's chunks (29..31 of row 0)."""
    starts = [[0, 3, 6, 29], [0, 10, 12, 21]][:B]
    ids = torch.zeros(B, T, dtype=torch.long)
    for row, firsts in enumerate(starts):
        for first in firsts:
            ids[row, first:] = first
    return ids


def _reference(q, k, v, do, documents=None):
    """Output and (dq, dk, dv) of full-sequence causal SDPA, in float64; with
    documents (B, T), causal within each document."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    mask = None
    if documents is not None:
        T = documents.shape[1]
        mask = ((documents[:, :, None] == documents[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril())[:, None]
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    y.backward(do.double())
    return y.detach(), q.grad, k.grad, v.grad


def _local_attention(q, k, v, do, comm_type, impl, attention=context.attention, documents=None):
    """This rank's rows of q, k, v, do (and documents) through `attention`: output and (dq, dk, dv)."""
    mine = context.local_positions(q.shape[2], parallel.layout.cp_size, parallel.layout.cp_rank)
    q, k, v = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
    y = attention(q, k, v, comm_type, impl, None if documents is None else documents[:, mine])
    y.backward(do[:, :, mine])
    return y.detach(), q.grad, k.grad, v.grad


def _check_equals_full_attention(cp, cases, T, hd, tol):
    """cases: (comm_type, impl, nh, G, with documents)."""
    parallel.initialize(1, context_parallel_size=cp)
    mine = context.local_positions(T, cp, parallel.layout.cp_rank)
    for comm_type, impl, nh, G, with_documents in cases:
        q, k, v, do = _full_inputs(nh, G, T, hd)
        documents = _documents(T) if with_documents else None
        got = _local_attention(q, k, v, do, comm_type, impl, documents=documents)
        for name, a, b in zip(("y", "dq", "dk", "dv"), got, _reference(q, k, v, do, documents)):
            assert a.dtype == torch.float32, f"{name}: {a.dtype}"
            err = (a.double() - b[:, :, mine]).abs().max().item()
            assert err <= tol, f"cp={cp} {comm_type} {impl} nh={nh} G={G} documents={with_documents}: " \
                               f"{name} off by {err:.3g}"


@pytest.mark.quick
def test_step_blocks_cover_the_causal_triangle_exactly_once():
    """Over every rank and ring step, each (query chunk, key chunk) pair on or
    below the diagonal of the 2C x 2C chunk grid is computed exactly once,
    the diagonal ones causally (at step 0), and none above it."""
    for cp in (1, 2, 3, 4):
        c = 5
        seen = {}
        for rank in range(cp):
            chunks_of = lambda r: (r, 2 * cp - 1 - r)  # noqa: E731: rows [0, c) then [c, 2c)
            for step in range(cp):
                j = (rank - step) % cp
                for rows, cols, causal in context.step_blocks(step, rank, cp, c):
                    assert rows.stop - rows.start == cols.stop - cols.start, "blocks are square"
                    for qi in range(rows.start // c, rows.stop // c):
                        for ki in range(cols.start // c, cols.stop // c):
                            pair = (chunks_of(rank)[qi], chunks_of(j)[ki])
                            if causal:  # the block's own mask must be the sequence's
                                assert (ki > qi, ki == qi) == (pair[1] > pair[0], pair[1] == pair[0])
                                if ki > qi:
                                    continue  # masked out: above the diagonal
                            else:
                                assert pair[1] != pair[0], f"cp={cp}: diagonal {pair} computed unmasked"
                            assert pair not in seen, f"cp={cp}: {pair} computed twice"
                            seen[pair] = causal
        below = {(i, j) for i in range(2 * cp) for j in range(i + 1)}
        assert set(seen) == below, f"cp={cp}: missing {below - set(seen)}, extra {set(seen) - below}"
        assert all(seen[(i, i)] for i in range(2 * cp)), "the diagonal chunks are causal"


@pytest.mark.quick
@pytest.mark.slow
def test_ring_and_all_to_all_equal_full_attention_on_2_ranks():
    """Causal, and causal within unequal documents (_documents)."""
    cases = [(comm, "torch", nh, G, docs) for comm in context.COMM_TYPES for nh, G in HEADS for docs in (False, True)]
    run_on_ranks(_check_equals_full_attention, 2, cases, 32, 8, 1e-5, world_size=2)


@pytest.mark.slow
def test_ring_and_all_to_all_equal_full_attention_on_4_ranks():
    # a2a splits the K/V heads too: G = 4 at C = 4
    cases = [("p2p", "torch", nh, G, docs) for nh, G in HEADS for docs in (False, True)] + \
        [("a2a", "torch", 8, 4, False), ("a2a", "torch", 4, 4, True)]
    run_on_ranks(_check_equals_full_attention, 4, cases, 32, 8, 1e-5, world_size=4)


@pytest.mark.slow
@pytest.mark.skipif(not fused_kernels.triton_usable("cpu"),
                    reason="the gloo ranks hold CPU tensors: the kernels run on them under TRITON_INTERPRET=1")
def test_ring_with_the_triton_kernels_equals_full_attention():
    """The ring's blocks through fused_kernels.py's FlashAttention-2 forward and
    backward (interpreted), GQA: the kernels' base-2 lse converts exactly;
    and a2a's attention through fused_kernels.flash_attention."""
    cases = [("p2p", "triton", 4, 2, False), ("a2a", "triton", 4, 2, False)]
    run_on_ranks(_check_equals_full_attention, 2, cases, 64, 32, 1e-4, world_size=2)


def _check_compiles_whole():
    parallel.initialize(1, context_parallel_size=2)
    torch._dynamo.reset()
    q, k, v, do = _full_inputs(4, 2, 32, 8)
    for comm_type, documents in ((comm, docs) for comm in context.COMM_TYPES for docs in (None, _documents(32))):
        compiled = torch.compile(lambda q, k, v, c, i, d: context.attention(q * 1, k, v, c, i, d) * 2,
                                 fullgraph=True, backend="aot_eager")
        eager = lambda q, k, v, c, i, d: context.attention(q * 1, k, v, c, i, d) * 2  # noqa: E731
        got = _local_attention(q, k, v, do, comm_type, "torch", compiled, documents)
        ref = _local_attention(q, k, v, do, comm_type, "torch", eager, documents)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_attention_compiles_with_no_graph_break():
    """fullgraph=True: Dynamo captures the ring's custom op and the all-to-alls
    whole, forward and backward, with documents or without, and they compute
    what eager mode does."""
    run_on_ranks(_check_compiles_whole, world_size=2)


# ----------------------------------------------------------------------------
# The zigzag split of a batch


@pytest.mark.quick
@pytest.mark.parametrize("cp", [2, 4])
def test_the_split_batch_gives_every_token_once_and_cp_1s_loss(monkeypatch, cp):
    """Each CP rank holds chunks r and 2cp-1-r of every sequence, with their
    labels, mask and true positions; every token is held once; and the mean
    over the ranks of (masked mean over the local tokens) x loss_weight is the
    masked mean over the full sequences (a fully masked share weighs 0)."""
    g = torch.Generator().manual_seed(0)
    B, T = 3, 16
    mask = (torch.rand(B, T, generator=g) > 0.4).float()
    mask[:, : T // (2 * cp)] = 0  # rank 0's first chunk holds no loss at all
    batch = dict(tokens=torch.randint(0, 100, (B, T), generator=g), labels=torch.randint(0, 100, (B, T), generator=g),
                 loss_mask=mask, position_ids=torch.arange(T).expand(B, T).contiguous())
    token_loss = torch.rand(B, T, generator=g, dtype=torch.float64)
    held, weighted = [], []
    for rank in range(cp):
        monkeypatch.setattr(parallel, "layout", parallel.Layout(cp_size=cp, cp_rank=rank, initialized=True))
        local = context.split_batch(batch)
        mine = local["position_ids"][0]
        c = T // (2 * cp)
        assert mine.tolist() == [*range(rank * c, (rank + 1) * c), *range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]
        for name in ("tokens", "labels", "loss_mask"):
            assert torch.equal(local[name], batch[name][:, mine])
        m = local["loss_mask"].double()
        weighted.append((token_loss[:, mine] * m).sum() / m.sum().clamp(min=1) * local["loss_weight"])
        held += mine.tolist()
    assert sorted(held) == list(range(T))
    full = (token_loss * mask).sum() / mask.sum()
    assert torch.stack(weighted).mean().item() == pytest.approx(full.item(), rel=1e-6)


# ----------------------------------------------------------------------------
# What the ring saves, and what it overlaps


BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _layer_bytes_at_cp(cp, comm_type, out):
    sys.path.insert(0, BENCH)
    import activation_memory
    from gpt import GPTConfig
    parallel.initialize(1, context_parallel_size=cp)
    config = GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=4, max_position_embeddings=512,
                       vocab_size=100, padded_vocab_size=128, hidden_dropout=0.1, cp_comm_type=comm_type)
    measured = activation_memory.layer_activation_bytes(config, 512, 1)
    if parallel.layout.cp_rank == 0:
        out.write_text(str(measured))


@pytest.mark.slow
def test_a_layer_keeps_a_cp_th_of_the_activations(tmp_path):
    """The bytes autograd keeps for one layer (bench/activation_memory.py) on
    each of 2 CP ranks are at most 1/2 + 15% of one rank's at CP=1, ring and
    all-to-all: no rank keeps another's K/V (or whole-sequence heads) for backward."""
    figures = {}
    for cp, comm_type in ((1, "p2p"), (2, "p2p"), (2, "a2a")):
        out = tmp_path / f"{cp}{comm_type}"
        run_on_ranks(_layer_bytes_at_cp, cp, comm_type, out, world_size=cp)
        figures[cp, comm_type] = int(out.read_text())
    for comm_type in context.COMM_TYPES:
        assert figures[2, comm_type] <= (1 / 2 + 0.15) * figures[1, "p2p"], figures


def _ring_order(out):
    events = []
    parallel.initialize(1, context_parallel_size=2)
    q, k, v, do = _full_inputs(4, 2, 32, 8)
    start, wait, block, block_grads = context.Ring.start, context.Ring.wait, context._block_forward, \
        context._block_backward

    def log(name, fn):
        def logged(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)
        return logged
    context.Ring.start, context.Ring.wait = log("send", start), log("land", wait)
    context._block_forward, context._block_backward = log("block", block), log("block", block_grads)
    try:
        _local_attention(q, k, v, do, "p2p", "torch")
    finally:
        context.Ring.start, context.Ring.wait, context._block_forward, context._block_backward = \
            start, wait, block, block_grads
    if parallel.layout.cp_rank == 0:
        out.write_text(" ".join(events))


@pytest.mark.slow
def test_each_ring_exchange_is_in_flight_while_a_step_computes(tmp_path):
    """The order of operations on a rank of CP=2 (ring_attention's forward,
    then its backward): every exchange is posted before a step's blocks run
    and landed only after them, so each transfer (K/V ahead, dK/dV behind)
    is hidden behind that step's attention; only the last dK/dV, home to
    its owner, has no step left to hide behind."""
    run_on_ranks(_ring_order, tmp_path / "order", world_size=2)
    order = (tmp_path / "order").read_text().split()
    forward = ["send", "block", "land", "block"]  # step 0: causal, posted K/V; step 1: two blocks ...
    assert order[:5] == [*forward, "block"], order
    backward = order[5:]  # step 0: K/V out, one causal block; step 1: dK/dV out, two blocks; dK/dV home
    assert backward == ["send", "block", "land", "send", "block", "block", "land", "send", "land"], order


# ----------------------------------------------------------------------------
# Documents (--reset-attention-mask) from the command line


@pytest.mark.slow
def test_documents_at_cp_2_train_cp_1s_curve(ids_corpus, tmp_path):
    """--reset-attention-mask --reset-position-ids --eod-mask-loss on the ids
    corpus (documents of 20-119 ids, so that documents end inside the 4
    chunks of many 32-token sequences): CP=2's ring trains CP=1's curve, loss,
    grad norm and validation loss to 1e-5; and the masks change it."""
    common = [*TINY, *IDS, "--data-path", ids_corpus, "--train-iters", "4", "--reset-position-ids",
              "--eod-mask-loss"]

    def run(name, nproc, *flags):
        path = tmp_path / f"{name}.jsonl"
        train_on_ranks([*common, "--metrics-file", str(path), *flags], nproc=nproc)
        return {m["iteration"]: m for m in read_metrics(path)}
    want = run("cp1", 1, "--reset-attention-mask")
    got = run("cp2", 2, "--reset-attention-mask", "--context-parallel-size", "2")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4] and "val_loss" in want[4]
    for i, m in got.items():
        for key in ("loss", "grad_norm", "val_loss"):
            assert (key in m) == (key in want[i])
            if key in m:
                assert m[key] == pytest.approx(want[i][key], abs=1e-5), (i, key)
    unmasked = run("unmasked", 1)
    assert unmasked[1]["loss"] != pytest.approx(want[1]["loss"], abs=1e-4)
