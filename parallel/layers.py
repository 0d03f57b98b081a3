"""Megatron's parallel layers: ColumnParallelLinear, RowParallelLinear,
VocabParallelEmbedding. Each builds its full master weight, keeps its slice."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import groups
from .cross_entropy import check_ids
from .groups import PendingSequenceGather, all_gather_sequence, reduce_scatter_sequence, tp_rank, tp_size
from .mappings import (DeferredCollectives, PendingReduce, copy_to_tensor_parallel_region,
                       gather_from_tensor_parallel_region, in_autocast_dtype,
                       reduce_from_tensor_parallel_region,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_tensor_parallel_region)
from .sharding import _mark_sharded, shard_tensor


def init_normal(std: float = 0.02) -> Callable[[torch.Tensor], None]:
    """Megatron's default init_method: N(0, std) on the full master weight."""
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)


def _sharded_master(shape: tuple[int, ...], init_method, dim: int,
                    stride=1) -> nn.Parameter:
    """Build the full master weight with init_method, keep this rank's slice."""
    master = torch.empty(shape)
    with torch.no_grad():
        init_method(master)
    shard = shard_tensor(master, dim, tp_rank(), tp_size(), stride)
    return _mark_sharded(nn.Parameter(shard), dim, stride)


# --------------------------------------------------------------------------
# Parallel layers
# --------------------------------------------------------------------------

def _local_shape(param: nn.Parameter) -> tuple[int, ...]:
    """A parameter's shape on this rank, also under ZeRO-3, which empties the
    tensor and keeps its shape in `ds_shape`."""
    return tuple(getattr(param, "ds_shape", param.shape))


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its OUTPUT dim: rank r holds the rows
    A_r (out/tp, in) and computes Y_r = X A_r^T + b_r. The input goes through f
    (identity forward, all-reduce of dX backward). The output stays sharded
    (..., out/tp) unless gather_output=True.

    sequence_parallel=True: the input is this rank's slice of the sequence
    (B, T/tp, in), all-gathered to (B, T, in) before the GEMM, and dX is
    reduce-scattered back to (B, T/tp, in): the gather replaces f."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = False, stride=1,
                 init_method: Callable[[torch.Tensor], None] = init_normal(),
                 async_grad_allreduce: bool = False, sequence_parallel: bool = False):
        super().__init__()
        # True: f's backward all-reduce overlaps the weight-gradient GEMM
        # (see _ColumnParallelLinearFunction). Same maths either way.
        self.async_grad_allreduce = async_grad_allreduce
        self.sequence_parallel = sequence_parallel and tp_size() > 1
        if gather_output and stride != 1:
            raise ValueError("gather_output=True with stride>1 would interleave the "
                             "blocks; gather with gather_tensor(y, -1, stride) instead")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.stride = gather_output, stride
        self.weight = _sharded_master((out_features, in_features), init_method, 0, stride)
        if bias:
            # Megatron initializes biases to zero.
            self.bias = _mark_sharded(nn.Parameter(torch.zeros(out_features // tp_size())), 0, stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor,
                deferred: DeferredCollectives | None = None) -> torch.Tensor:
        """deferred (async_grad_allreduce only): x came from
        deferred.wait_in_backward, where backward waits for dX's all-reduce."""
        if deferred is not None and not self.async_grad_allreduce:
            raise ValueError("a DeferredCollectives needs async_grad_allreduce=True")
        if self.sequence_parallel or (self.async_grad_allreduce and tp_size() > 1):
            y = _ColumnParallelLinearFunction.apply(x, self.weight, self.bias, deferred,
                                                    self.sequence_parallel)
        else:
            x = copy_to_tensor_parallel_region(x)       # (..., in)
            y = F.linear(x, self.weight, self.bias)     # (..., out/tp)
        return gather_from_tensor_parallel_region(y) if self.gather_output else y

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "ColumnParallelLinear":
        """Shard an existing full nn.Linear (no random numbers drawn)."""
        return _from_linear(cls, linear, **kwargs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {_local_shape(self.weight)[0]}), stride={self.stride}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class _ColumnParallelLinearFunction(torch.autograd.Function):
    """f (or, under sequence parallelism, the all-gather of the sequence)
    followed by y = X W_r^T + b_r, with the backward communication overlapped.

    Backward needs dX = sum_r dY_r W_r and dW_r = dY_r^T X. The all-reduce of
    dX (under sequence parallelism: its reduce-scatter to each rank's tokens)
    is launched asynchronously BEFORE the dW GEMM, so the network moves dX
    while the GEMM runs; we wait before returning dX (Megatron), or, given a
    DeferredCollectives, not at all: its identity node waits later, after
    other chunks' GEMMs (DeepSpeed-Domino).
    On GPU this relies on CUDA_DEVICE_MAX_CONNECTIONS=1: with one hardware
    queue, kernels start in launch order, so the NCCL kernel (on its own
    stream) is already running when the GEMM is queued instead of waiting
    behind it. Megatron's async_tensor_model_parallel_allreduce does the same.

    Sequence parallelism saves only this rank's slice of X (B, T/tp, in) for
    backward and all-gathers it again there (launched before the dX GEMM, so
    that GEMM hides it): the gathered (B, T, in) is never kept, which is what
    makes the activation memory of the layer's input 1/tp (Korthikanti et al.).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, deferred, sequence_parallel):
        ctx.input_dtype = x.dtype
        if sequence_parallel:
            x = in_autocast_dtype(x)                            # keep and move 16 bits
        ctx.save_for_backward(x, weight)                        # under SP: (B, T/tp, in)
        ctx.has_bias, ctx.deferred, ctx.sequence_parallel = bias is not None, deferred, sequence_parallel
        total = x
        if sequence_parallel:                                   # -> (B, T, in)
            launched = deferred.gathered_input if deferred is not None else None
            total = launched.wait() if launched is not None else all_gather_sequence(x)
            if deferred is not None:
                deferred.gathered_input = None
        return F.linear(total, weight, bias)                    # (..., out/tp)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        # Under torch.autocast, forward's F.linear ran in the autocast dtype
        # (grad_out is e.g. bf16) but x and weight were saved in fp32, and
        # backward runs outside autocast. So do the GEMMs in grad_out's dtype,
        # as autograd does for an autocast F.linear, and cast each gradient
        # back to its input's dtype (dX before the all-reduce, exactly like
        # the plain f path, which all-reduces the fp32 gradient). Under
        # sequence parallelism x was saved in the autocast dtype already.
        dtype = grad_out.dtype
        gather = PendingSequenceGather(x, async_op=True) if ctx.sequence_parallel else None
        grad_input = handle = None
        if ctx.needs_input_grad[0]:
            grad_input = (grad_out @ weight.to(dtype)).to(ctx.input_dtype)  # (..., in) partial
            if ctx.sequence_parallel:                                    # -> (B, T/tp, in)
                grad_input, handle = reduce_scatter_sequence(grad_input, async_op=True)
            else:
                grad_input = grad_input.contiguous()
                handle = groups._all_reduce_owned(grad_input, async_op=True)
        total = gather.wait() if gather is not None else x               # (..., in)
        g2d = grad_out.reshape(-1, grad_out.shape[-1])                   # (N, out/tp)
        x2d = total.reshape(-1, total.shape[-1]).to(dtype)               # (N, in)
        grad_weight = (g2d.t() @ x2d).to(weight.dtype)                   # overlaps the reduction
        grad_bias = g2d.sum(dim=0).to(weight.dtype) if ctx.has_bias else None
        if ctx.deferred is not None:
            ctx.deferred.handle = handle   # waited for in _WaitForDeferredGrad
        elif handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its INPUT dim: rank r holds the columns
    A_r (out, in/tp) and computes the partial product X_r A_r^T; g sums the
    partials over ranks. The bias is replicated and added once, after the sum.
    input_is_parallel=False first scatters a full input (..., in)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = True,
                 init_method: Callable[[torch.Tensor], None] = init_normal(),
                 sequence_parallel: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        # True: reduce-scatter the sum to this rank's tokens (B, T/tp, out)
        # instead of all-reducing it (see reduce_scatter_to_sequence_parallel_region).
        self.sequence_parallel = sequence_parallel and tp_size() > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True needs input_is_parallel=True")
        self.weight = _sharded_master((out_features, in_features), init_method, 1)
        # Replicated: every rank holds the full bias and computes the same grad
        # (under sequence parallelism, a share of it: see sum_sequence_parallel_grads).
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x)    # (..., in) -> (..., in/tp)
        partial = F.linear(x, self.weight)                          # (B, T, out), this rank's share
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial)  # (B, T/tp, out)
        else:
            y = reduce_from_tensor_parallel_region(partial)         # (B, T, out)
        return y if self.bias is None else y + self.bias

    def forward_async(self, x: torch.Tensor) -> PendingReduce:
        """Like forward (input already parallel), but the all-reduce (or the
        reduce-scatter) runs in the background: call .wait() on the result."""
        return PendingReduce(F.linear(x, self.weight), self.bias, self.sequence_parallel)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "RowParallelLinear":
        """Shard an existing full nn.Linear (no random numbers drawn)."""
        return _from_linear(cls, linear, **kwargs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {_local_shape(self.weight)[1]}), "
                f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


def _from_linear(cls, linear: nn.Linear, **kwargs):
    # init_method copies the existing weight, so the RNG stream is untouched.
    layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                init_method=lambda w: w.copy_(linear.weight), **kwargs)
    if linear.bias is not None:
        with torch.no_grad():
            if getattr(layer.bias, "tensor_model_parallel", False):
                layer.bias.copy_(shard_tensor(linear.bias, 0, tp_rank(), tp_size(),
                                              layer.bias.partition_stride))
            else:
                layer.bias.copy_(linear.bias)
    return layer.to(device=linear.weight.device, dtype=linear.weight.dtype)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split into tp contiguous ranges.
    Rank r looks up the ids it owns, outputs zeros for the others, and g sums
    over ranks, so every id gets exactly its one row. sequence_parallel=True
    reduce-scatters the sum instead: each rank keeps its tokens (B, T/tp, C)."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 init_method: Callable[[torch.Tensor], None] = init_normal(),
                 sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel and tp_size() > 1
        if num_embeddings % tp_size() != 0:
            raise ValueError(f"tensor_model_parallel_size={tp_size()} must divide "
                             f"num_embeddings={num_embeddings} (pad the vocabulary)")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per_rank = num_embeddings // tp_size()
        self.vocab_start, self.vocab_end = tp_rank() * per_rank, (tp_rank() + 1) * per_rank
        self.weight = _sharded_master((num_embeddings, embedding_dim), init_method, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Each rank sees only its own rows, so an out-of-range id would
        # otherwise silently embed to zeros instead of failing. (Not on a GPU,
        # where it costs a sync per call: GPT and train.py check before.)
        if not ids.is_cuda:
            check_ids([("token ids", ids, self.num_embeddings,
                        "check the tokenizer vocab against padded_vocab_size")])
        if tp_size() == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)      # (B, T)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight)                        # (B, T, C)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out)       # (B, T/tp, C)
        return reduce_from_tensor_parallel_region(out)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, **kwargs) -> "VocabParallelEmbedding":
        """Shard an existing full nn.Embedding (no random numbers drawn)."""
        layer = cls(emb.num_embeddings, emb.embedding_dim,
                    init_method=lambda w: w.copy_(emb.weight), **kwargs)
        return layer.to(device=emb.weight.device, dtype=emb.weight.dtype)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"local rows [{self.vocab_start}, {self.vocab_end}), "
                f"sequence_parallel={self.sequence_parallel}")


@contextlib.contextmanager
def sequence_parallel_off(module: nn.Module):
    """Run `module` with its layers' sequence parallelism switched off, then
    back on. Generation needs it: a KV-cache step has one token, which
    cannot be split over the TP ranks (the weights are the same either way)."""
    switched = [m for m in module.modules() if getattr(m, "sequence_parallel", False)]
    for m in switched:
        m.sequence_parallel = False
    try:
        yield
    finally:
        for m in switched:
            m.sequence_parallel = True
