"""The communication operators (autograd.Functions) of tensor parallelism:
Megatron's f and g, gather/scatter along the hidden dim, sequence
parallelism's all-gather and reduce-scatter along the sequence, and Domino's
asynchronous variants. See parallel/__init__.py for the picture."""
from __future__ import annotations

import torch

from .groups import (PendingSequenceGather, _gather_last_dim, _split_last_dim, all_gather_sequence,
                     all_reduce, reduce_scatter_sequence, tp_size)

# --------------------------------------------------------------------------
# Communication operators (autograd.Functions)
# --------------------------------------------------------------------------

class _CopyToTensorParallelRegion(torch.autograd.Function):
    """f: forward y = x (every rank already has x); backward dx = sum_r dy_r,
    because x fed all tp shards and each contributes a partial gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad)


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: forward y = sum_r x_r (partial products -> full result); backward
    dx_r = dy, the sum passes the same gradient to every summand."""

    @staticmethod
    def forward(ctx, x):
        return all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """forward y = [x_0 | x_1 | ... | x_{tp-1}] along the last dim; backward
    dx_r = dy[..., r-th slice]."""

    @staticmethod
    def forward(ctx, x):
        return _gather_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad)


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """forward y_r = x[..., r-th slice] of the last dim; backward
    dx = [dy_0 | ... | dy_{tp-1}] (all-gather)."""

    @staticmethod
    def forward(ctx, x):
        return _split_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad)


class _ReduceFromTensorParallelRegionAsync(torch.autograd.Function):
    """g with the all-reduce left running in the background (Domino): forward
    launches y = sum_r x_r and appends the work handle to `handles`; y may be
    read only after handle.wait(). Backward: identity, like g."""

    @staticmethod
    def forward(ctx, x, handles: list):
        out, handle = all_reduce(x, async_op=True)
        handles.append(handle)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def in_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    """x cast to the autocast dtype when autocast is on (else x): what a
    column-parallel GEMM would cast it to anyway. Under sequence parallelism
    its input is all-gathered and kept for backward, and a torch LayerNorm's
    output is fp32 under autocast: cast first, and both move and keep half
    the bytes (s*b*h*34/T assumes 16-bit activations)."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind) and x.is_floating_point():
        return x.to(torch.get_autocast_dtype(kind))
    return x


class DeferredCollectives:
    """A column-parallel layer's collectives that Domino runs in the
    background for one chunk: the reduction of dX in backward (f's
    all-reduce; under sequence parallelism the reduce-scatter to each rank's
    tokens) and, under sequence parallelism, the all-gather of its input in
    forward.

    dX: wait_in_backward(h) returns h through an identity autograd node whose
    BACKWARD waits for the reduction; pass the result and this object to the
    ColumnParallelLinear, whose backward launches the reduction and leaves
    the handle here. Nothing reads the gradient before that wait: it flows
    from the layer straight into the identity node.

    Why a separate node: autograd runs the ready node created LAST in forward
    first. The identity node is created early (before another chunk's GEMMs
    in forward), so in backward those GEMMs run between the launch and the
    wait. parallel/domino.py chooses that order.

    Input: gather_input(h) launches the all-gather of h's tokens at once,
    and the layer's forward waits for it only when it runs, so the GEMMs
    issued in between (another chunk's) hide it.
    """

    def __init__(self):
        self.handle = None
        self.gathered_input = None   # a PendingSequenceGather, or None

    def wait_in_backward(self, h: torch.Tensor) -> torch.Tensor:
        return _WaitForDeferredGrad.apply(h, self)

    def gather_input(self, h: torch.Tensor) -> None:
        """Launch the all-gather of h's tokens (B, T/tp, C) for the layer's forward."""
        self.gathered_input = PendingSequenceGather(in_autocast_dtype(h.detach()), async_op=True)

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None


class _WaitForDeferredGrad(torch.autograd.Function):
    """forward y = x; backward: wait for the deferred reduction that is
    filling grad (the all-reduce sums it in place; the reduce-scatter writes
    the tensor the layer returned), then dx = grad, now summed over the TP group."""

    @staticmethod
    def forward(ctx, x, deferred: DeferredCollectives):
        ctx.deferred = deferred
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.deferred.wait()
        return grad, None


class _AlreadyReduceScattered(torch.autograd.Function):
    """Domino under sequence parallelism: forward returns `reduced`, the
    reduce-scatter of `partial` that ran in the background; backward, like
    _ReduceScatterToSequenceParallelRegion, all-gathers the gradient.

    Unlike the all-reduce, the reduce-scatter is put into the graph only
    AFTER it has landed: gloo finishes it with a copy_ into the output on its
    own thread, and had that output already been this node's, autograd would
    record the copy and cut the gradient's way back to `partial` (NCCL writes
    in place, but the tests run gloo)."""

    @staticmethod
    def forward(ctx, partial, reduced):
        return reduced.view_as(reduced)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad), None


class PendingReduce:
    """A row-parallel layer's reduction in flight: g's all-reduce, or under
    sequence parallelism the reduce-scatter to this rank's tokens. wait()
    blocks until the sum has landed and returns it (plus the replicated bias,
    added once after the sum)."""

    def __init__(self, partial: torch.Tensor, bias: torch.Tensor | None,
                 sequence_parallel: bool = False):
        self._partial, self._bias, self._sequence_parallel = partial, bias, sequence_parallel
        if sequence_parallel:
            self._out, self._handle = reduce_scatter_sequence(partial.detach(), async_op=True)
        else:
            handles: list = []
            self._out = _ReduceFromTensorParallelRegionAsync.apply(partial, handles)
            self._handle = handles[0]

    def wait(self) -> torch.Tensor:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        if self._sequence_parallel and self._partial is not None:
            self._out = _AlreadyReduceScattered.apply(self._partial, self._out)
            self._partial = None
        return self._out if self._bias is None else self._out + self._bias


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Into the tensor-parallel region from the sequence-parallel one (before
    a column-parallel layer, and before the LM head):
        forward   y = [x_0; x_1; ...; x_{tp-1}]   all-gather along the sequence
        backward  dx_r = (sum_q dy_q)[r-th slice]  reduce-scatter
    y feeds this rank's shard of a tensor-parallel layer, so each rank's dy
    is only a partial gradient (as in f's backward); the reduce-scatter sums
    the partials and hands each rank the gradient of its own tokens."""

    @staticmethod
    def forward(ctx, x):
        return all_gather_sequence(x)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad)


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Out of the tensor-parallel region into the sequence-parallel one
    (after a row-parallel layer, and after the vocab-parallel embedding):
        forward   y_r = (sum_q x_q)[r-th slice]    reduce-scatter along the sequence
        backward  dx = [dy_0; ...; dy_{tp-1}]      all-gather
    g's all-reduce with each rank keeping only its tokens: the same bytes on
    the wire (an all-reduce is a reduce-scatter then an all-gather), and
    what follows (dropout, residual add, LayerNorm) runs on T/tp tokens.
    Every partial x_q fed every slice, so its gradient is all of dy."""

    @staticmethod
    def forward(ctx, x):
        return reduce_scatter_sequence(x)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad)


# With tp=1 every operator is the identity and adds no autograd node at all.

def copy_to_tensor_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return x if tp_size() == 1 else _CopyToTensorParallelRegion.apply(x)


def reduce_from_tensor_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return x if tp_size() == 1 else _ReduceFromTensorParallelRegion.apply(x)


def gather_from_tensor_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return x if tp_size() == 1 else _GatherFromTensorParallelRegion.apply(x)


def scatter_to_tensor_parallel_region(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1 and x.shape[-1] % tp_size() != 0:
        raise ValueError(f"cannot split last dim {x.shape[-1]} across "
                         f"tensor_model_parallel_size={tp_size()} ranks")
    return x if tp_size() == 1 else _ScatterToTensorParallelRegion.apply(x)


def gather_from_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """(B, T/tp, ...) -> (B, T, ...); see _GatherFromSequenceParallelRegion."""
    return x if tp_size() == 1 else _GatherFromSequenceParallelRegion.apply(x)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """(B, T, ...) partial sums -> (B, T/tp, ...); see _ReduceScatterToSequenceParallelRegion."""
    return x if tp_size() == 1 else _ReduceScatterToSequenceParallelRegion.apply(x)
