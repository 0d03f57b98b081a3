"""The communication operators (autograd.Functions) of tensor parallelism:
Megatron's f and g, gather/scatter along the hidden dim, and Domino's
asynchronous variants. See parallel/__init__.py for the picture."""
from __future__ import annotations

import torch

from .groups import _gather_last_dim, _split_last_dim, all_reduce, tp_size

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


class DeferredGradAllReduce:
    """Where a column-parallel layer's backward all-reduce (f's dX) is waited
    for, when that should happen later than the layer's own backward (Domino).

    wait_in_backward(h) returns h through an identity autograd node whose
    BACKWARD waits for the all-reduce; pass the result and this object to the
    ColumnParallelLinear, whose backward launches the all-reduce and leaves
    the handle here. Nothing reads the gradient before that wait: it flows
    from the layer straight into the identity node.

    Why a separate node: autograd runs the ready node created LAST in forward
    first. The identity node is created early (before another chunk's GEMMs
    in forward), so in backward those GEMMs run between the launch and the
    wait. gpt.domino_blocks chooses that order.
    """

    def __init__(self):
        self.handle = None

    def wait_in_backward(self, h: torch.Tensor) -> torch.Tensor:
        return _WaitForGradAllReduce.apply(h, self)

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None


class _WaitForGradAllReduce(torch.autograd.Function):
    """forward y = x; backward: wait for the deferred all-reduce that is
    summing grad in place, then dx = grad (now the sum over the TP group)."""

    @staticmethod
    def forward(ctx, x, deferred: DeferredGradAllReduce):
        ctx.deferred = deferred
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.deferred.wait()
        return grad, None


class PendingAllReduce:
    """An all-reduce in flight. wait() blocks until the sum has landed and
    returns it (plus the replicated bias, added once after the sum)."""

    def __init__(self, partial: torch.Tensor, bias: torch.Tensor | None):
        handles: list = []
        self._out = _ReduceFromTensorParallelRegionAsync.apply(partial, handles)
        self._handle, self._bias = handles[0], bias

    def wait(self) -> torch.Tensor:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        return self._out if self._bias is None else self._out + self._bias


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
