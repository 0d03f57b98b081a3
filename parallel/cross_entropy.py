"""Cross entropy on vocab-sharded logits, and the one id-range check."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .groups import tp_group, tp_rank, tp_size

# --------------------------------------------------------------------------
# Cross entropy on vocab-sharded logits
# --------------------------------------------------------------------------

class _VocabParallelCrossEntropy(torch.autograd.Function):
    """loss = log(sum_v exp(z_v - m)) - (z_target - m), m = max_v z_v, where
    the vocab v is spread over ranks. Only per-token scalars are all-reduced
    (the max, the exp-sum, the target logit), never the (..., V) logits.
    Backward on the local shard: dz = (softmax(z) - onehot(target)) * dloss."""

    @staticmethod
    def forward(ctx, logits, target):
        logits_dtype = logits.dtype
        logits = logits.float()                                   # (..., V/tp) fp32
        local_vocab = logits.shape[-1]
        start = tp_rank() * local_vocab
        # Max over the full vocab for a stable softmax.
        max_logit = logits.max(dim=-1).values                     # (...)
        if tp_size() > 1:
            dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=tp_group())
        logits = logits - max_logit.unsqueeze(-1)
        # The target logit: only the rank that owns the target id contributes.
        outside = (target < start) | (target >= start + local_vocab)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        exp = logits.exp()                                        # (..., V/tp)
        sum_exp = exp.sum(dim=-1)                                 # (...)
        if tp_size() > 1:
            both = torch.stack([target_logit, sum_exp])           # one all-reduce
            dist.all_reduce(both, group=tp_group())
            target_logit, sum_exp = both[0], both[1]
        loss = sum_exp.log() - target_logit
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.logits_dtype = logits_dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        onehot_value = (~outside).to(grad.dtype)                  # 1 where we own target
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot_value.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token fp32 loss (...) from logits sharded over the vocab (..., V/tp)
    and full target ids (...). With tp=1 this is F.cross_entropy."""
    if tp_size() == 1:  # F.cross_entropy checks the range itself
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               target.reshape(-1), reduction="none")
        return loss.view(target.shape)
    # No rank sees the whole vocab, so an out-of-range target would silently
    # get a loss of log(sum exp) (no rank owns it) instead of an error.
    if not target.is_cuda:  # as in VocabParallelEmbedding.forward
        check_ids([("target ids", target, logits.shape[-1] * tp_size(),
                    "check the labels against padded_vocab_size")])
    return _VocabParallelCrossEntropy.apply(logits, target)


def check_ids(checks) -> None:
    """The one id-range check: checks = [(name, ids, limit, fix), ...]; raise a
    ValueError naming the first `ids` with a value outside [0, limit), and the
    fix. Empty or None ids pass. All bounds are read with ONE host read: free on
    CPU tensors, a sync on a GPU, so the training loop checks each batch on
    the host (train.check_batch) and the model only its first GPU call."""
    checks = [c for c in checks if c[1] is not None and c[1].numel() > 0]
    if not checks or torch.compiler.is_compiling():  # .tolist() would break the graph
        return
    bounds = torch.stack([m.long() for _, ids, _, _ in checks for m in ids.aminmax()]).tolist()
    for (name, _, limit, fix), lo, hi in zip(checks, bounds[::2], bounds[1::2]):
        if lo < 0 or hi >= limit:
            raise ValueError(f"{name} must lie in [0, {limit}), got values in [{lo}, {hi}]; {fix}")
