"""Gradients of a tensor-parallel model: the true global norm and clipping."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from .groups import tp_group, tp_rank, tp_size

# --------------------------------------------------------------------------
# Gradient clipping with sharded parameters
# --------------------------------------------------------------------------

def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip to the TRUE global L2 norm of the full (unsharded) model's grads.

    Sharded grads: every rank's squares count. Replicated grads (LayerNorms,
    row-parallel biases) are identical on all TP ranks, so only TP rank 0
    counts them. Grads are assumed already averaged over data parallelism.
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
        if getattr(p, "tensor_model_parallel", False) or tp_rank() == 0:
            sq += p.grad.detach().float().pow(2).sum()
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
