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

Sections:
    1. the zigzag split of a batch, and its loss weight
    2. ring attention
    3. all-to-all attention
    4. attention(): the one call gpt.py makes
"""
from __future__ import annotations

import torch

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
    reads the same micro-batch): its tokens of every sequence, their labels,
    loss mask and positions (each token keeps its place in the full sequence,
    for learned positions and RoPE alike), and `loss_weight`: the factor that
    turns the model's masked mean over the local tokens into this rank's
    share of the full sequences' mean, times cp (the gradients are averaged
    over DP x CP, Megatron's way):

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


def attention(q, k, v, comm_type, impl):  # TEMPORARY oracle: all-gather K/V (to be replaced)
    import torch.distributed.nn.functional as dnn
    import torch.nn.functional as F
    lay = parallel.layout
    Tl = q.shape[2]
    T = Tl * lay.cp_size
    class G(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            out = [torch.empty_like(x) for _ in range(lay.cp_size)]
            torch.distributed.all_gather(out, x.contiguous(), group=lay.cp_group)
            return tuple(out)
        @staticmethod
        def backward(ctx, *gs):
            g = torch.cat(gs, 0).contiguous()
            torch.distributed.all_reduce(g, group=lay.cp_group)
            return g.chunk(lay.cp_size, 0)[lay.cp_rank]
    B = k.shape[0]
    ks = [t for t in G.apply(k)]
    vs = [t for t in G.apply(v)]
    order = torch.cat([local_positions(T, lay.cp_size, r) for r in range(lay.cp_size)])
    inv = torch.empty_like(order); inv[order] = torch.arange(T)
    kf, vf = torch.cat(ks, 2)[:, :, inv], torch.cat(vs, 2)[:, :, inv]
    mine = local_positions(T, lay.cp_size, lay.cp_rank).to(q.device)
    mask = mine[:, None] >= torch.arange(T, device=q.device)[None]
    return F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
