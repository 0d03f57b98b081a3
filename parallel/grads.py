"""Gradients of a tensor-parallel model: the true global norm and clipping."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from .groups import all_reduce, tp_group, tp_rank, tp_size


def sum_sequence_parallel_grads(module: nn.Module) -> None:
    """Under sequence parallelism every replicated parameter of `module` (the
    norms' weights and biases, row-parallel biases, learned positions) sees
    only this rank's T/tp tokens, so its gradient on this rank is a partial
    sum over tokens: the full gradient is the sum over the TP group. Forget
    it and each rank trains its own copy on its tokens alone, they drift
    apart, and nothing fails: the classic silent bug of sequence parallelism.

    A hook on each such parameter sums its gradient over the TP group in
    backward, before it lands in .grad, so DDP's and every ZeRO stage's own
    hooks, gradient accumulation and clipping all see the full gradient.
    (Megatron instead all-reduces them once per step after backward, in one
    coalesced call; the hooks cost one small all-reduce per parameter per
    micro-batch, and need no change in any engine.)"""
    for p in module.parameters():
        if not getattr(p, "tensor_model_parallel", False) and p.requires_grad:
            p.sequence_parallel = True
            p.register_hook(all_reduce)   # returns the sum over the TP group, a new tensor

# --------------------------------------------------------------------------
# Gradient clipping with sharded parameters
# --------------------------------------------------------------------------

def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip to the TRUE global L2 norm of the full (unsharded) model's grads.

    Sharded grads: every rank's squares count. Replicated grads (LayerNorms,
    row-parallel biases) are identical on all TP ranks (under sequence
    parallelism after sum_sequence_parallel_grads), so only TP rank 0
    counts them. The other ranks add theirs times 0: nothing if finite,
    but 0 * inf is NaN, so an inf or NaN in any rank's copy makes the norm
    non-finite everywhere and every rank skips the step (Megatron all-reduces
    a found_inf flag over the model-parallel group for the same reason).
    Grads are assumed already averaged over data parallelism.
    Like torch.nn.utils.clip_grad_norm_: scales by max_norm / (norm + 1e-6)
    when that is < 1, and returns the norm. A non-finite norm leaves the grads
    untouched and is returned as is: the caller decides (e.g. skip the step).
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    device = params[0].grad.device
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        counted = getattr(p, "tensor_model_parallel", False) or tp_rank() == 0
        sq += p.grad.detach().float().pow(2).sum() * (1.0 if counted else 0.0)
    if tp_size() > 1:
        dist.all_reduce(sq, group=tp_group())
    total_norm = sq.sqrt()
    # Decided on device (no host sync): coef = 1 keeps grads when norm is small
    # or non-finite.
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    coef = torch.where(torch.isfinite(total_norm), coef, torch.ones_like(coef))
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total_norm
