"""Expert parallelism and the grouped GEMM: gpt.MoE's sum over experts, run
over the tokens sorted by expert, the experts spread over the ranks of an EP group.

gpt.MoE.forward is the textbook version: a loop over the experts, each taking
its tokens and adding its weighted output back. This module computes the same
sum in five steps (megatron-core's token dispatchers; GShard's all-to-all).
With E experts over EP ranks, rank r holds experts r E/EP .. (r+1) E/EP - 1,
the same rows of the stacked weights at any EP:

    x (N, C), routing_map (N, E)
      | permute: a row per (token, chosen expert), sorted by expert      (R, C)   R = N k dropless
      | all-to-all: rank r receives the rows of its experts              (R', C)  by source rank, then expert
      |   (regroup: by expert, then source rank)
      | local experts: a loop, or one grouped GEMM per matrix            (R', C)
      | all-to-all back: the inverse exchange (regrouped first)          (R, C)
      v unpermute: each row times its prob, added into its token         (N, C)

    EP = 2, E = 4: rank 0 holds experts 0 1, rank 1 experts 2 3

        rank 0's rows  e0 e0 e1 | e2 e3 e3   --->  rank 0: from 0 [e0 e0 e1], from 1 [e0 e1 e1]
        rank 1's rows  e0 e1 e1 | e2 e2 e3   --->  rank 1: from 0 [e2 e3 e3], from 1 [e2 e2 e3]

The split sizes depend on the routing, so the ranks first exchange their row
counts per expert (a small all-to-all, and a wait for the host).
The all-gather dispatcher (megatron-core's default) moves more bytes and
needs no counts: every rank gathers the N x EP tokens of its EP group with
their routing, computes its experts' share of each token's output, and a
reduce-scatter sums the shares and hands each rank its own tokens' sums.

The EP ranks are folded out of DP x CP (parallel.initialize), ranks that hold
different tokens: an expert's gradient covers its EP group's tokens, and
reduce_expert_grads sums it over the ranks holding the same expert
(layout.expert_dp_group) while DDP averages the other weights over DP x CP.

Under ZB-H1 (pipeline.py section 3b) the experts take their dW in I, not W:
each expert's GEMM takes a data-dependent share of the tokens (or all share
one grouped GEMM), so W would keep a ragged (X, dY) per expert.

torch.compile and the data-dependent token counts: the plain loop and
permute take each expert's tokens with nonzero, whose size Dynamo traces as
an unbacked symbol under capture_dynamic_output_shape_ops; the all-to-all's
split sizes are host ints (.tolist()), traced under capture_scalar_outputs.
With both, the layer compiles whole (no graph break) at EP = 1 and 2, both
dispatchers. The grouped GEMM reads the counts as a tensor (its offsets);
torch 2.13 traces grouped_mm in bf16 only (its fake kernel refuses fp32 and fp16).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

import parallel
from launch import UsageError


def check_layout(config) -> None:
    """The layouts the experts run under: refused in one line otherwise."""
    ep = parallel.layout.ep_size
    if config.num_experts % ep:
        raise UsageError(f"--num-experts {config.num_experts} must be divisible by --expert-model-parallel-size "
                         f"{ep}: each EP rank holds the same number of experts")
    if parallel.layout.whole_experts and not config.sequence_parallel:
        raise UsageError("--expert-tensor-parallel-size 1 needs --sequence-parallel: each TP rank routes its own "
                         "tokens")


def experts(mlps, x, probs, routing_map, config):
    """gpt.MoE's sum over its experts (mlps: its gpt.Experts), along the path
    drawn above: x (N, C), probs and routing_map (N, E) -> (N, C)."""
    ep, grouped = parallel.layout.ep_size, config.moe_grouped_gemm
    if ep > 1 and config.moe_token_dispatcher_type == "allgather":
        return all_gather_experts(mlps, x, probs, routing_map, grouped)
    rows, row_probs, tokens, counts = permute(x, probs, routing_map)
    out = all_to_all_experts(mlps, rows, counts, grouped) if ep > 1 else local_experts(mlps, rows, counts, grouped)
    return unpermute(out, row_probs, tokens, x)


def permute(x, probs, routing_map):
    """A row per (token, chosen expert), sorted by expert, each expert's tokens
    in order (megatron-core's permute): x (N, C), probs and routing_map (N, E)
    -> rows (R, C), their probs (R,), their tokens (R,), rows per expert (E,)."""
    expert, token = routing_map.T.nonzero(as_tuple=True)           # (R,) each
    return x[token], probs[token, expert], token, routing_map.sum(0)


def unpermute(out, row_probs, tokens, like):
    """permute's inverse: each row's output times its prob, added into its
    token's: out (R, C) -> like's shape (N, C) and dtype."""
    return torch.zeros_like(like).index_add(0, tokens, (out * row_probs[:, None]).to(like.dtype))


def local_experts(mlps, rows, counts, grouped: bool):
    """This rank's experts on their rows: rows (R, C), sorted by local expert,
    counts (E_local,) -> (R, C). A loop over the experts, or the grouped GEMM."""
    if grouped:
        return grouped_experts(mlps, rows, counts)
    return torch.cat([mlps(e, part) for e, part in enumerate(rows.split(counts.tolist()))])


def grouped_experts(mlps, rows, counts):
    """Every expert's MLP at once: each matrix one grouped GEMM, expert
    e's rows times its slice of the stacked weight (torch's grouped_mm; CUTLASS's
    on an H100). rows (R, C), counts (E_local,) -> (R, C)."""
    kind = rows.device.type  # grouped_mm takes one dtype: under autocast, autocast's
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else mlps.fc.dtype
    offsets = counts.cumsum(0).to(torch.int32)                     # (E_local,) where each expert's rows end
    h = F.grouped_mm(rows.to(dtype), mlps.fc.to(dtype).transpose(1, 2), offs=offsets)  # (R, fc_out)
    if mlps.fc_bias is not None:  # row i is expert which[i]'s
        which = torch.repeat_interleave(counts, output_size=rows.shape[0])            # (R,)
        h = h + mlps.fc_bias[which].to(dtype)
    out = F.grouped_mm(mlps.activation(h), mlps.proj.to(dtype).transpose(1, 2), offs=offsets)  # (R, C)
    return out if mlps.proj_bias is None else out + mlps.proj_bias[which].to(dtype) / parallel.layout.etp_size


# --------------------------------------------------------------------------
# The dispatchers: rows to the ranks of their experts and back


def all_to_all_experts(mlps, rows, counts, grouped: bool):
    """rows (R, C) sorted by expert, counts (E,) -> their experts' outputs (R, C),
    in the same order, each computed on the rank holding the expert."""
    ep, El = parallel.layout.ep_size, len(mlps.fc)
    received = all_to_all([El] * ep, [El] * ep, counts)           # (EP x E_local,) my experts' rows from each rank
    sizes = torch.cat([counts, received]).tolist()                # split sizes are host ints: a wait
    pairs = sizes[ep * El:]                                       # rows per (source rank, my expert)
    send = [sum(sizes[r * El:(r + 1) * El]) for r in range(ep)]
    recv = [sum(pairs[r * El:(r + 1) * El]) for r in range(ep)]
    mine = _Collective.apply(rows, functools.partial(all_to_all, recv, send),
                             functools.partial(all_to_all, send, recv))  # (R', C) by source, then expert
    out = local_experts(mlps, regroup(mine, pairs, ep, El), received.view(ep, El).sum(0), grouped)
    out = regroup(out, [pairs[r * El + e] for e in range(El) for r in range(ep)], El, ep)
    return _Collective.apply(out, functools.partial(all_to_all, send, recv),
                             functools.partial(all_to_all, recv, send))


def regroup(x, sizes, a: int, b: int):
    """x holds a x b chunks of the given sizes in order (i, j), i major ->
    the same chunks in order (j, i)."""
    chunks = x.split(sizes)
    return torch.cat([chunks[i * b + j] for j in range(b) for i in range(a)])


def all_gather_experts(mlps, x, probs, routing_map, grouped: bool):
    """The all-gather dispatcher: x (N, C), probs and routing_map (N, E) -> (N, C),
    the sum over the EP ranks of each one's experts' share."""
    mine = slice(mlps.first, mlps.first + len(mlps.fc))
    x_all = _Collective.apply(x, all_gather, reduce_scatter)                    # (EP N, C)
    probs_all = _Collective.apply(probs, all_gather, reduce_scatter)[:, mine]   # (EP N, E_local)
    map_all = all_gather(routing_map.to(torch.uint8)).bool()[:, mine]
    rows, row_probs, tokens, counts = permute(x_all, probs_all, map_all)
    share = unpermute(local_experts(mlps, rows, counts, grouped), row_probs, tokens, x_all)  # (EP N, C)
    return _Collective.apply(share, reduce_scatter, all_gather)                 # (N, C)


class _Collective(torch.autograd.Function):
    """forward: op(x), a linear exchange between the EP ranks; backward: its
    adjoint (the transposed exchange) on the gradient."""

    @staticmethod
    def forward(ctx, x, op, adjoint):
        ctx.adjoint = adjoint
        return op(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.adjoint(grad), None, None


def sum_over_sequence(x):
    """x summed over the ranks holding parts of the same sequences: the CP group,
    and under expert TP 1 (SP) the TP group; differentiable: an all-reduce's adjoint
    is itself (each rank's loss of the sum sends its gradient to every rank's summand)."""
    return _Collective.apply(x, _sequence_sum, _sequence_sum)


def _sequence_sum(x):
    lay = parallel.layout
    for size, group in ((lay.cp_size, lay.cp_group), (lay.routing_tp_size, lay.tp_group)):
        if size > 1:
            x = parallel.wait(torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", group.group_name))
    return x


# Raw collectives on the EP group (functional: torch.compile traces them, parallel.py's form)

def all_to_all(out_splits: list, in_splits: list, x):
    """in_splits[r] rows of x to rank r; out_splits[r] rows from rank r, in rank order."""
    return parallel.wait(torch.ops._c10d_functional.all_to_all_single(
        x.contiguous(), out_splits, in_splits, parallel.layout.ep_group.group_name))


def all_gather(x):
    """(N, ...) -> (EP N, ...): every EP rank's x, in rank order."""
    lay = parallel.layout
    return parallel.wait(torch.ops._c10d_functional.all_gather_into_tensor(
        x.contiguous(), lay.ep_size, lay.ep_group.group_name))


def reduce_scatter(x):
    """(EP N, ...) -> (N, ...): the sum over the EP ranks of this rank's N rows."""
    lay = parallel.layout
    return parallel.wait(torch.ops._c10d_functional.reduce_scatter_tensor(
        x.contiguous(), "sum", lay.ep_size, lay.ep_group.group_name))


def reduce_expert_grads(model) -> None:
    """After backward: each expert weight's gradient, which covers its EP
    group's tokens, summed over the ranks holding the same experts and divided
    by DP x CP: the mean DDP takes of every other gradient. (At EP 1 with the
    experts split as TP splits the MLP, DDP averages them: nothing to do.)"""
    lay = parallel.layout
    for p in model.parameters():
        if parallel.averaged_apart(p) and p.grad is not None:
            if lay.expert_dp_group is not None and dist.get_world_size(lay.expert_dp_group) > 1:
                dist.all_reduce(p.grad, group=lay.expert_dp_group)
            p.grad /= lay.dp_cp_size
