"""Context parallelism: each sequence split over the cp ranks of a replica.

Every other layout keeps a micro-batch's whole sequences on each rank
through attention, so the longest sequence is what one rank's attention
activations allow. Context parallelism (--context-parallel-size C, Megatron's
name) cuts every sequence into 2C chunks and gives CP rank r the two chunks
r and 2C-1-r. Embedding, MLP, norms, loss and optimizer run on those T/C
tokens alone (the weights are shared, their gradients averaged over DP x CP:
parallel.layout.dp_cp_group); only attention needs the other ranks' tokens.

Why two chunks, and why those two (the zigzag; Megatron's load balancing).
Causal attention's work is a triangle: chunk i's queries read chunks 0 .. i.
Cut into C contiguous pieces, the last rank would do C times the first's
work. Paired as i and 2C-1-i, every rank reads 2C + 1 chunk-pairs' worth:

    C = 2, T cut in 4 chunks      keys:  0  1  2  3
                          queries 0     [\\ .  .  . ]   rank 0 holds 0, 3
                                  1     [#  \\ .  . ]   rank 1 holds 1, 2
                                  2     [#  #  \\ . ]
                                  3     [#  #  #  \\]   \\ causal, # full, . nothing

Ring attention (--cp-comm-type p2p, the default; Liu et al. 2023). Each rank
keeps its queries; the keys and values go round the ring, rank r passing
to r+1, so at ring step s rank r holds the K/V of rank j = (r - s) mod C,
and the next step's K/V travel while this step's attention runs. What rank
r's two query chunks (a = r, b = 2C-1-r) owe to j's two K/V chunks (j,
2C-1-j) is decided by the chunk order alone:

    s = 0 (j = r)   a b over a b: causal attention over the local 2 chunks
    j < r           a and b read all of chunk j; nothing of 2C-1-j (> b)
    j > r           a reads nothing (a < j); b reads all of j and 2C-1-j

So only step 0 is causal, and every other step is two full (c x c) blocks:
every rank does the same work at every step. The partial outputs merge
through their log-sum-exps (the online softmax of FlashAttention, across
ranks); backward walks the same steps (step_blocks, written once), sending
dK and dV round the ring behind K and V, home after C steps.

All-to-all (--cp-comm-type a2a; DeepSpeed-Ulysses, Jacobs et al. 2023). One
all-to-all turns Q, K, V from (this rank's tokens, every head) into (every
token, 1/C of the heads); ordinary causal attention runs on full sequences,
and a second all-to-all turns the output back. It needs the heads (and K/V
groups) divisible by C x tp.

Documents (--reset-attention-mask): a token reads only its own document
(same_document, the rule gpt.py applies at cp = 1). In the ring the keys'
document ids travel with K and V and mask each block (a query may read no
key of a block: _merge; it reads itself at step 0, so its final lse is
finite); a2a gathers the full sequences' ids and masks ordinary attention.

Sections:
    1. the zigzag split of a batch, its loss weight, and the document mask
    2. ring attention
    3. all-to-all attention
    4. attention(): the one call gpt.py makes
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fused_kernels
import parallel

COMM_TYPES = ("p2p", "a2a")


# ============================================================================
# 1. The zigzag split
# ============================================================================

def local_positions(seq_length: int, cp: int, rank: int) -> torch.Tensor:
    """The indices into a sequence of the tokens CP rank `rank` holds: chunks
    rank and 2cp-1-rank of 2cp equal chunks, in that order. (T/cp,) long."""
    c = seq_length // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


def split_batch(batch: dict) -> dict:
    """This CP rank's share of a micro-batch of host tensors (every CP rank
    reads the same one): every tensor at its tokens (positions keep each
    token's place in the full sequence, for learned positions and RoPE alike),
    and `loss_weight`, which turns the model's masked mean over the local
    tokens into this rank's share of the full sequences' mean, times cp (the
    gradients are averaged over DP x CP, Megatron's way):

        loss_weight = cp x (tokens kept here) / (tokens kept in the full sequences)

    so that the mean over the CP ranks of loss x loss_weight is the loss
    cp = 1 computes, not a mean of per-rank means."""
    lay = parallel.layout
    T = batch["tokens"].shape[-1]
    mine = local_positions(T, lay.cp_size, lay.cp_rank)
    local = {name: t[..., mine] for name, t in batch.items()}
    kept, total = local["loss_mask"].sum(), batch["loss_mask"].sum()
    local["loss_weight"] = torch.where(total > 0, lay.cp_size * kept / total.clamp(min=1), 0.0)
    return local


def same_document(doc_q: torch.Tensor, doc_k: torch.Tensor, causal: bool) -> torch.Tensor:
    """The document mask (--reset-attention-mask), the one rule every attention
    path with documents applies (gpt.py's, the ring's blocks, a2a's): query i
    reads key j iff they share a document (equal ids, data._document_starts),
    and, when causal (query i and key i the same token), j <= i.
    doc_q (B, n), doc_k (B, m) -> (B, 1, n, m) bool, True where attended."""
    mask = doc_q[:, :, None] == doc_k[:, None, :]  # (B, n, m)
    if causal:
        mask = mask & torch.ones(mask.shape[1:], dtype=torch.bool, device=mask.device).tril()
    return mask[:, None]


# ============================================================================
# 2. Ring attention (--cp-comm-type p2p)
# ============================================================================
# q (B, H, 2c, D) is this rank's two chunks of queries, k and v (B, G, 2c, D)
# its two chunks of keys and values (G divides H: grouped-query attention;
# only the G K/V heads travel). Every block below is a piece of one causal
# softmax over the full sequence, computed with its own log-sum-exp
# (lse = log sum_j exp(s_j), natural log, fp32, (B, H, rows)), so that the
# pieces merge exactly (_merge), and backward needs only the final o and lse.

def step_blocks(step: int, rank: int, cp: int, c: int) -> list[tuple[slice, slice, bool]]:
    """What rank `rank` computes at ring step `step`, holding the K/V of rank
    j = (rank - step) mod cp: (query rows, key rows, causal) into its 2c
    queries and the 2c keys it holds (the table in the module's docstring).
    Every block is square (c x c or 2c x 2c), as the Triton kernels want."""
    a, b = slice(0, c), slice(c, 2 * c)  # chunks rank, 2cp-1-rank (queries); j, 2cp-1-j (keys)
    j = (rank - step) % cp
    if step == 0:
        return [(slice(0, 2 * c), slice(0, 2 * c), True)]  # the local zigzag pair, causal
    if j < rank:
        return [(a, a, False), (b, a, False)]  # both query chunks read all of chunk j
    return [(b, a, False), (b, b, False)]      # chunk 2cp-1-rank reads all of j and 2cp-1-j


def _torch_scores(q, k, causal, docs=None):
    """Scaled scores of q (B, H, n, D) against k (B, G, n, D), fp32, masked
    above the diagonal when causal, and across documents when docs = (the
    queries' document ids, the keys'); k's heads repeated to H: (B, H, n, n)."""
    k = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # query head h reads h // (H/G)
    s = q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if docs is not None:
        return s.masked_fill(~same_document(*docs, causal), float("-inf"))
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return s


def _block_forward(q, k, v, causal: bool, impl: str, docs=None):
    """(o, lse) of softmax(q k^T / sqrt(D)) v over one block: o (B, H, n, D)
    and lse (B, H, n), fp32. With documents (docs, torch only) a row may
    read no key of the block: lse -inf, o 0 (see _merge)."""
    if impl == "triton" and docs is None:  # the Triton kernels take no document masks
        o, lse = fused_kernels.flash_attention_op(q, k, v, causal, 1 / math.sqrt(q.shape[-1]))
        return o.float(), lse
    s = _torch_scores(q, k, causal, docs)
    lse = s.logsumexp(-1)
    p = torch.exp(s - lse.clamp(min=torch.finfo(s.dtype).min)[..., None])  # a row of -inf: exp(-inf) = 0, no NaN
    return p @ v.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1), lse


def _block_backward(do, q, k, v, o, lse, causal: bool, impl: str, docs=None):
    """(dq, dk, dv) of one block, fp32, given the FINAL (merged) o and lse of
    its query rows (FlashAttention-2's backward):
        P = exp(S - lse)  dV = P^T dO  dP = dO V^T  delta = rowsum(dO * O)
        dS = P (dP - delta)  dQ = dS K / sqrt(D)  dK = dS^T Q / sqrt(D),
    dK and dV summed over the query heads of each K/V head."""
    scale = 1 / math.sqrt(q.shape[-1])
    if impl == "triton" and docs is None:
        grads = fused_kernels.flash_attention_backward_op(do, q, k, v, o, lse, causal, scale)
        return tuple(g.float() for g in grads)
    G, repeat = k.shape[1], q.shape[1] // k.shape[1]
    do, o = do.float(), o.float()
    p = torch.exp(_torch_scores(q, k, causal, docs) - lse[..., None])  # (B, H, n, n)
    dv = p.transpose(-1, -2) @ do                                        # (B, H, n, D)
    dp = do @ v.float().repeat_interleave(repeat, dim=1).transpose(-1, -2)
    ds = p * (dp - (do * o).sum(-1, keepdim=True))                       # delta = rowsum(dO * O)
    dq = ds @ k.float().repeat_interleave(repeat, dim=1) * scale
    dk = ds.transpose(-1, -2) @ q.float() * scale
    return dq, dk.unflatten(1, (G, repeat)).sum(2), dv.unflatten(1, (G, repeat)).sum(2)  # (B, G, n, D)


def _merge(o, lse, rows, o_block, lse_block) -> None:
    """Fold a block's (o, lse) into the running (o, lse) of its query rows, in
    place: the online softmax, across blocks and ranks. lse starts at -inf; a
    row that has read no key yet, here or before (documents), stays o 0, lse
    -inf (its weights exp(-inf - finfo.min) are 0, not -inf - -inf = NaN)."""
    new = torch.logaddexp(lse[:, :, rows], lse_block)
    safe = new.clamp(min=torch.finfo(new.dtype).min)
    o[:, :, rows] = (o[:, :, rows] * torch.exp(lse[:, :, rows] - safe)[..., None]
                     + o_block * torch.exp(lse_block - safe)[..., None])
    lse[:, :, rows] = new


class Ring:
    """Point-to-point round the CP ring: start() sends tensors to the next
    rank and returns as many buffers of the same shapes, which wait() fills
    from the previous one (batch_isend_irecv, as the pipeline does)."""

    def __init__(self, group):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.next, self.prev = group, (rank + 1) % size, (rank - 1) % size
        self.pending = None

    def start(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=self.next) for t in sent]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=self.prev) for t in received]
        self.pending = (dist.batch_isend_irecv(ops), sent)  # the sent buffers live until wait()
        return received

    def wait(self) -> None:
        for work in self.pending[0]:
            work.wait()
        self.pending = None


def _travelling(k, v, documents) -> list[torch.Tensor]:
    """What goes round the ring: K and V, (2, B, G, 2c, D), and with documents
    their document ids, (B, 2c) long: a second, small tensor of the same exchange."""
    return [torch.stack([k, v])] + ([] if documents is None else [documents])


def _block_documents(documents, held, rows, cols):
    """(the queries' document ids, the held keys') of a block, or None."""
    return None if documents is None else (documents[:, rows], held[1][:, cols])


# Forward and backward are custom operators with their autograd, as
# fused_kernels.flash_attention_op: torch.compile sees one opaque op (no graph
# break, no tracing into the ring's communication). The ops read the CP group
# from parallel.layout (an op's arguments are tensors and scalars).

@torch.library.custom_op("context::ring_attention", mutates_args=())
def ring_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Optional[torch.Tensor],
                      impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(o in q's dtype, lse (B, H, 2c) fp32) of this rank's queries over every
    rank's K/V; documents: this rank's (B, 2c) document ids, or None. At step
    s the K/V of step s+1 (and their document ids) travel while step s's blocks run."""
    lay = parallel.layout
    cp, c = lay.cp_size, q.shape[2] // 2
    ring = Ring(lay.cp_group)
    o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)                 # (B, H, 2c, D)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)  # (B, H, 2c)
    held = _travelling(k, v, documents)                                            # [(2, B, G, 2c, D), ...]
    for step in range(cp):
        if step < cp - 1:
            incoming = ring.start(*held)
        kv = held[0]
        for rows, cols, causal in step_blocks(step, lay.cp_rank, cp, c):
            _merge(o, lse, rows, *_block_forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal,
                                                 impl, _block_documents(documents, held, rows, cols)))
        if step < cp - 1:
            ring.wait()
            held = incoming
    return o.to(q.dtype), lse


@ring_attention_op.register_fake
def _(q, k, v, documents, impl):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("context::ring_attention_backward", mutates_args=())
def ring_attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               documents: Optional[torch.Tensor], o: torch.Tensor, lse: torch.Tensor,
                               impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ring_attention_op. The K/V travel ahead as in forward;
    the dK/dV (fp32) of the K/V a rank holds at step s, summed by their
    earlier holders, arrive from rank - 1 one step behind, while step s runs;
    one more send after the last step brings each rank its own dK/dV home."""
    lay = parallel.layout
    cp, c = lay.cp_size, q.shape[2] // 2
    ring = Ring(lay.cp_group)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    held, dkv = _travelling(k, v, documents), None  # dkv: (2, B, G, 2c, D), of the K/V held
    for step in range(cp):
        sent = (held if step < cp - 1 else []) + ([dkv] if step > 0 else [])
        received = ring.start(*sent)
        kv = held[0]
        mine = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for rows, cols, causal in step_blocks(step, lay.cp_rank, cp, c):
            grads = _block_backward(do[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                    o[:, :, rows], lse[:, :, rows], causal, impl,
                                    _block_documents(documents, held, rows, cols))
            dq[:, :, rows] += grads[0]
            mine[0][:, :, cols] += grads[1]
            mine[1][:, :, cols] += grads[2]
        ring.wait()
        dkv = mine + received[-1] if step > 0 else mine  # the earlier holders' sum, and this rank's
        if step < cp - 1:
            held = received[:len(held)]
    (dkv,) = ring.start(dkv)  # to its owner, rank + 1 (whose K/V this rank held last)
    ring.wait()
    # copies: a custom op's outputs may not be views of one tensor
    return dq.to(q.dtype), dkv[0].to(k.dtype, copy=True), dkv[1].to(v.dtype, copy=True)


@ring_attention_backward_op.register_fake
def _(do, q, k, v, documents, o, lse, impl):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _ring_setup(ctx, inputs, output):
    q, k, v, documents, ctx.impl = inputs
    ctx.save_for_backward(q, k, v, documents, *output)


def _ring_grad(ctx, do, dlse):
    return (*ring_attention_backward_op(do, *ctx.saved_tensors, ctx.impl), None, None)


ring_attention_op.register_autograd(_ring_grad, setup_context=_ring_setup)


# ============================================================================
# 3. All-to-all attention (--cp-comm-type a2a, Ulysses)
# ============================================================================
# Heads split contiguously: CP rank i gets query heads [i H/C, (i+1) H/C) and
# K/V heads [i G/C, (i+1) G/C), so query head h still finds its K/V head
# h // (H/G) on the same rank. The all-to-all gathers the chunks in rank
# order (rank 0's chunks 0 and 2C-1, rank 1's 1 and 2C-2, ...); the first
# chunks of ranks 0 .. C-1 are chunks 0 .. C-1, their second chunks in the
# reverse rank order C .. 2C-1.

def _all_to_all(x: torch.Tensor) -> torch.Tensor:
    """x (C, ...): part i goes to CP rank i; returns (C, ...), part i from rank i.
    Functional collectives, so that torch.compile traces it (parallel.py's form)."""
    C = x.shape[0]
    out = torch.ops._c10d_functional.all_to_all_single(x.contiguous(), [1] * C, [1] * C,
                                                       parallel.layout.cp_group.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def _sequence_to_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, 2c, D) this rank's tokens, every head -> (B, H/C, T, D) every
    token in natural order, this rank's heads."""
    C = parallel.layout.cp_size
    B, H, Tl, D = x.shape
    parts = _all_to_all(x.reshape(B, C, H // C, Tl, D).transpose(0, 1))  # (C, B, H/C, 2c, D) rank i's tokens
    chunks = parts.unflatten(3, (2, Tl // 2))                            # (C, B, H/C, 2, c, D)
    natural = torch.cat([chunks[:, :, :, 0], chunks[:, :, :, 1].flip(0)])  # (2C, B, H/C, c, D)
    return natural.permute(1, 2, 0, 3, 4).reshape(B, H // C, C * Tl, D)


def _heads_to_sequence(y: torch.Tensor) -> torch.Tensor:
    """The inverse: (B, H/C, T, D) -> (B, H, 2c, D)."""
    C = parallel.layout.cp_size
    B, Hc, T, D = y.shape
    chunks = y.unflatten(2, (2 * C, T // (2 * C))).permute(2, 0, 1, 3, 4)  # (2C, B, H/C, c, D)
    pairs = torch.stack([chunks[:C], chunks[C:].flip(0)], dim=3)            # (C, B, H/C, 2, c, D) rank i's
    parts = _all_to_all(pairs.flatten(3, 4))                                # (C, B, H/C, 2c, D) rank i's heads
    return parts.transpose(0, 1).reshape(B, C * Hc, T // C, D)


class _SequenceToHeads(torch.autograd.Function):
    """Forward _sequence_to_heads, backward its inverse (a permutation's gradient)."""

    @staticmethod
    def forward(ctx, x):
        return _sequence_to_heads(x)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad)


class _HeadsToSequence(torch.autograd.Function):
    """Forward _heads_to_sequence, backward _sequence_to_heads."""

    @staticmethod
    def forward(ctx, y):
        return _heads_to_sequence(y)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad)


def a2a_attention(q, k, v, impl: str, documents=None) -> torch.Tensor:
    """Ulysses: all-to-all to head-sharded full sequences, ordinary causal
    attention, back. The heads and K/V groups divide by C (parallel.check_layout)."""
    q, k, v = (_SequenceToHeads.apply(t) for t in (q, k, v))  # (B, H/C or G/C, T, D)
    if impl == "triton" and documents is None:
        return _HeadsToSequence.apply(fused_kernels.flash_attention(q, k, v, causal=True))
    mask = None
    if documents is not None:  # the full sequences' ids (B, T): sent to every rank as if one head each
        C = parallel.layout.cp_size
        full = _sequence_to_heads(documents[:, None, :, None].expand(-1, C, -1, 1))[:, 0, :, 0]
        mask = same_document(full, full, causal=True)  # the torch path: the Triton kernels take no masks
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                       enable_gqa=k.shape[1] != q.shape[1])
    return _HeadsToSequence.apply(y)


# ============================================================================
# 4. attention(): the one call gpt.py makes
# ============================================================================

def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm_type: str, impl: str,
              documents: torch.Tensor | None = None) -> torch.Tensor:
    """Exact causal attention of this CP rank's queries over the full sequences.
    q (B, nh, T/C, hd), k, v (B, G, T/C, hd): this rank's zigzag chunks
    (section 1) -> y (B, nh, T/C, hd) in q's dtype. comm_type "p2p" (ring) or
    "a2a" (Ulysses); impl "torch" or "triton" (fused_kernels.py); documents: this
    rank's (B, T/C) document ids (split_batch's), or None."""
    if comm_type == "a2a":
        return a2a_attention(q, k, v, impl, documents)
    return ring_attention_op(q, k, v, documents, impl)[0]
