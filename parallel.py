"""Megatron-style tensor parallelism, in small readable pieces.

Tensor parallelism (TP) splits every big matrix of a transformer layer across
the tp ranks of a tensor-parallel group (Shoeybi et al., "Megatron-LM", 2019):

    MLP:        Y = GeLU(X A) B       A split by COLUMNS, B split by ROWS
    attention:  heads split across ranks (QKV by columns, output proj by rows)

so each rank holds 1/tp of the weights and does 1/tp of the FLOPs. A
column-parallel layer followed by a row-parallel layer needs exactly two
communication operators, which Megatron calls f and g:

    f = copy_to_tensor_parallel_region       forward: identity   backward: all-reduce
    g = reduce_from_tensor_parallel_region   forward: all-reduce backward: identity

    X --f--> [X A_r] --GeLU--> [. B_r] --g--> Y      (r = this rank's shard)

Every rank sees the full X; rank r computes the partial product with its
column block A_r and row block B_r; g sums the partial products. In backward,
f sums the partial gradients w.r.t. X. That is one all-reduce per block
forward and one backward.

The embedding is split by vocabulary (VocabParallelEmbedding) and the loss is
computed on vocab-sharded logits without ever gathering them
(vocab_parallel_cross_entropy).

Layout of ranks (torchrun world of W = dp * tp ranks): tensor-parallel groups
are CONSECUTIVE ranks, so they live inside one node where the interconnect is
fastest (TP communicates every layer); data-parallel groups are the ranks with
the same TP rank. With W=8, tp=2: TP groups [0,1] [2,3] [4,5] [6,7], DP groups
[0,2,4,6] [1,3,5,7].

Domino (DeepSpeed-Domino, Wang et al. 2024) hides these all-reduces behind
computation: RowParallelLinear.forward_async launches g's all-reduce in the
background (PendingAllReduce.wait() collects it), so gpt.py can compute one
micro-batch chunk while another chunk's result is on the wire. In backward,
ColumnParallelLinear(async_grad_allreduce=True) launches f's all-reduce
before its weight-gradient GEMM; given a DeferredGradAllReduce it does not
even wait for it, and the wait happens in a later autograd node, so another
chunk's backward runs while the gradient is on the wire.

Initialization: every parallel layer first builds its FULL master weight with
the given init_method (the same on every rank when all ranks seed the RNG
identically), then keeps only its own slice. So the model is the same for any
tp; the cost is one full weight per layer held temporarily, fine for GPT-2
sizes.

The process-group handles below are the project's only global state (plus
the benchmarking-only skip_communication flag).
"""
from __future__ import annotations

import contextlib
import datetime
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# --------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------

_INITIALIZED = False
_TP_GROUP = None   # None when torch.distributed is not in use (single process)
_DP_GROUP = None
_TP_SIZE, _TP_RANK = 1, 0
_DP_SIZE, _DP_RANK = 1, 0
_SKIP_COMMUNICATION = False  # benchmarking switch, see skip_communication()


def initialize(tensor_model_parallel_size: int = 1, timeout: datetime.timedelta | None = None) -> None:
    """Build the tensor- and data-parallel groups from the torchrun world.

    Must be called on every rank (new_group is collective). Without an
    initialized torch.distributed and tp=1 this sets up a single-rank world.
    `timeout` bounds every collective on these groups: pass the one given to
    init_process_group, because new_group does not inherit it (it falls back
    to torch's 30-minute default, and a dead peer would hang DDP that long).
    """
    global _INITIALIZED, _TP_GROUP, _DP_GROUP, _TP_SIZE, _TP_RANK, _DP_SIZE, _DP_RANK
    tp = tensor_model_parallel_size
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_model_parallel_size must be a positive int, got {tp!r}")
    if not (dist.is_available() and dist.is_initialized()):
        if tp != 1:
            raise ValueError(
                f"tensor_model_parallel_size={tp} needs torch.distributed: launch with "
                f"`torchrun --nproc_per_node {tp} ...` and call "
                "torch.distributed.init_process_group() before parallel.initialize()")
        _TP_GROUP = _DP_GROUP = None
        _TP_SIZE, _TP_RANK, _DP_SIZE, _DP_RANK = 1, 0, 1, 0
        _INITIALIZED = True
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp != 0:
        raise ValueError(
            f"tensor_model_parallel_size={tp} does not divide the world size {world}: "
            f"launch a multiple of {tp} processes or pick a size that divides {world}")
    # Every rank must create every group, in the same order.
    for start in range(0, world, tp):                 # TP: consecutive ranks
        group = dist.new_group(list(range(start, start + tp)), timeout=timeout)
        if start <= rank < start + tp:
            _TP_GROUP = group
    for tp_r in range(tp):                            # DP: same TP rank
        group = dist.new_group(list(range(tp_r, world, tp)), timeout=timeout)
        if rank % tp == tp_r:
            _DP_GROUP = group
    _TP_SIZE, _TP_RANK = tp, rank % tp
    _DP_SIZE, _DP_RANK = world // tp, rank // tp
    _INITIALIZED = True


def destroy() -> None:
    """Forget the groups (the world group itself belongs to the caller)."""
    global _INITIALIZED, _TP_GROUP, _DP_GROUP, _TP_SIZE, _TP_RANK, _DP_SIZE, _DP_RANK
    for group in {_TP_GROUP, _DP_GROUP} - {None}:
        if dist.is_initialized():
            dist.destroy_process_group(group)
    _TP_GROUP = _DP_GROUP = None
    _TP_SIZE, _TP_RANK, _DP_SIZE, _DP_RANK = 1, 0, 1, 0
    _INITIALIZED = False


def _check_initialized() -> None:
    # A multi-rank job that forgot initialize() would otherwise silently train
    # as if every rank were alone.
    if not _INITIALIZED and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() > 1:
        raise RuntimeError("call parallel.initialize(tensor_model_parallel_size) first")


def tp_group():
    _check_initialized()
    return _TP_GROUP


def tp_rank() -> int:
    _check_initialized()
    return _TP_RANK


def tp_size() -> int:
    _check_initialized()
    return _TP_SIZE


def dp_group():
    _check_initialized()
    return _DP_GROUP


def dp_rank() -> int:
    _check_initialized()
    return _DP_RANK


def dp_size() -> int:
    _check_initialized()
    return _DP_SIZE


def check_divisible(config, tp: int | None = None) -> None:
    """Raise ValueError unless tp divides every quantity that gets split."""
    tp = tp_size() if tp is None else tp
    ffn = config.ffn_hidden_size or 4 * config.hidden_size
    quantities = {
        "num_attention_heads": config.num_attention_heads,
        # grouped-query attention: each rank keeps whole key/value heads
        "num_query_groups": getattr(config, "num_query_groups", None) or config.num_attention_heads,
        "hidden_size": config.hidden_size,
        "ffn_hidden_size": ffn,
        "padded_vocab_size": config.padded_vocab_size,
    }
    for name, value in quantities.items():
        if value % tp != 0:
            raise ValueError(
                f"tensor_model_parallel_size={tp} must divide {name}={value}: "
                f"pick a tensor_model_parallel_size that divides {value} or change {name}")


@contextlib.contextmanager
def skip_communication():
    """Make the f/g (and Domino) activation/gradient all-reduces no-ops
    (results become WRONG). Benchmarking only: measures the step time of the
    same compute without that communication. The small per-token all-reduces
    of vocab_parallel_cross_entropy, clip_grad_norm_'s norm all-reduce and
    the all-gathers still run."""
    global _SKIP_COMMUNICATION
    previous, _SKIP_COMMUNICATION = _SKIP_COMMUNICATION, True
    try:
        yield
    finally:
        _SKIP_COMMUNICATION = previous


# --------------------------------------------------------------------------
# Raw collectives on the TP group. They never modify their input in place:
# autograd may hand the same gradient tensor to several branches (residual
# adds), so reducing it in place would corrupt the others. .contiguous()
# matters too: all_reduce on a non-contiguous tensor reduces a temporary copy.
# --------------------------------------------------------------------------

def _all_reduce_owned(out: torch.Tensor, async_op: bool = False):
    """In-place sum over the TP group of a contiguous tensor nobody else holds.
    Returns the work handle (None when synchronous or skipped)."""
    if tp_size() == 1 or _SKIP_COMMUNICATION:
        return None
    return dist.all_reduce(out, group=tp_group(), async_op=async_op)


def all_reduce(x: torch.Tensor, async_op: bool = False):
    """Sum x over the TP group into a new contiguous tensor.
    Returns the tensor, or (tensor, work handle or None) with async_op=True;
    with async_op the tensor holds the sum only after handle.wait()."""
    out = x.clone(memory_format=torch.contiguous_format)
    handle = _all_reduce_owned(out, async_op)
    return (out, handle) if async_op else out


def all_reduce_mean(x: torch.Tensor, group=None) -> torch.Tensor:
    """The mean of x over `group` (a copy; x itself if the group is one rank)."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        x = x.clone()
        dist.all_reduce(x, group=group)
        x /= dist.get_world_size(group)
    return x


def _split_last_dim(x: torch.Tensor) -> torch.Tensor:
    """This rank's 1/tp slice of the last dim (a copy, so it frees the rest)."""
    chunk = x.shape[-1] // tp_size()
    return x[..., tp_rank() * chunk:(tp_rank() + 1) * chunk].contiguous()


def _gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's x along the last dim, in rank order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x, group=tp_group())
    return torch.cat(parts, dim=-1)


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


# --------------------------------------------------------------------------
# Sharding full tensors and rebuilding them
# --------------------------------------------------------------------------

def _blocks(full_size: int, stride) -> list[int]:
    """Block sizes along the split dim: `stride` equal blocks (an int, e.g. 3
    for [Q | K | V]), or the sizes themselves (a sequence, e.g. [Q | K | V]
    with fewer K/V heads under grouped-query attention)."""
    if isinstance(stride, int):
        return [full_size // stride] * stride
    return [int(s) for s in stride]


def shard_tensor(full: torch.Tensor, dim: int, rank: int, world: int,
                 stride=1) -> torch.Tensor:
    """Rank's slice of `full` along `dim`.

    stride > 1: `full` is made of `stride` blocks along dim (e.g. [Q | K | V]);
    each block is split across ranks, and rank r keeps the r-th piece of every
    block, concatenated ([Q_r | K_r | V_r]), so each rank has whole heads.
    stride may also list unequal block sizes (see _blocks).
    """
    sizes = _blocks(full.shape[dim], stride)
    if sum(sizes) != full.shape[dim] or any(s % world for s in sizes):
        raise ValueError(f"dim {dim} of size {full.shape[dim]} cannot be split into "
                         f"block(s) {sizes} x {world} rank(s)")
    blocks = full.split(sizes, dim=dim)
    return torch.cat([b.chunk(world, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def merge_shards(shards: list[torch.Tensor], dim: int, stride=1) -> torch.Tensor:
    """Inverse of shard_tensor: rebuild the full tensor from every rank's shard."""
    world = len(shards)
    local = [s // world for s in _blocks(shards[0].shape[dim] * world, stride)]
    per_rank_blocks = [s.split(local, dim=dim) for s in shards]  # [rank][block]
    blocks = [torch.cat([rb[b] for rb in per_rank_blocks], dim=dim) for b in range(len(local))]
    return torch.cat(blocks, dim=dim)


def gather_tensor(shard: torch.Tensor, dim: int, stride=1) -> torch.Tensor:
    """All-gather a sharded parameter (or grad) over the TP group into the full
    tensor on every rank (for checkpoints and tests). Collective."""
    if tp_size() == 1:
        return shard
    shard = shard.contiguous()
    shards = [torch.empty_like(shard) for _ in range(tp_size())]
    dist.all_gather(shards, shard, group=tp_group())
    return merge_shards(shards, dim, stride)


def gather_tensor_to_first(shard: torch.Tensor, dim: int, stride=1) -> torch.Tensor | None:
    """gather_tensor, but only TP rank 0 receives the full tensor (dist.gather):
    the others return None and never allocate it (checkpoint writes)."""
    if tp_size() == 1:
        return shard
    shard = shard.contiguous()
    first = tp_rank() == 0
    shards = [torch.empty_like(shard) for _ in range(tp_size())] if first else None
    dist.gather(shard, shards, dst=dist.get_global_rank(tp_group(), 0), group=tp_group())
    return merge_shards(shards, dim, stride) if first else None


def _mark_sharded(param: nn.Parameter, dim: int, stride=1) -> nn.Parameter:
    # DeepSpeed and our clip_grad_norm_ read `tensor_model_parallel`.
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = stride
    return param


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
    (..., out/tp) unless gather_output=True."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = False, stride=1,
                 init_method: Callable[[torch.Tensor], None] = init_normal(),
                 async_grad_allreduce: bool = False):
        super().__init__()
        # True: f's backward all-reduce overlaps the weight-gradient GEMM
        # (see _ColumnParallelLinearAsyncGrad). Same maths either way.
        self.async_grad_allreduce = async_grad_allreduce
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
                deferred: DeferredGradAllReduce | None = None) -> torch.Tensor:
        """deferred (async_grad_allreduce only): x came from
        deferred.wait_in_backward, where backward waits for dX's all-reduce."""
        if deferred is not None and not self.async_grad_allreduce:
            raise ValueError("a DeferredGradAllReduce needs async_grad_allreduce=True")
        if self.async_grad_allreduce and tp_size() > 1:
            y = _ColumnParallelLinearAsyncGrad.apply(x, self.weight, self.bias, deferred)
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
                f"gather_output={self.gather_output}")


class _ColumnParallelLinearAsyncGrad(torch.autograd.Function):
    """f followed by y = x W_r^T + b_r, with f's backward all-reduce overlapped.

    Backward needs dX = sum_r dY_r W_r (all-reduced) and dW_r = dY_r^T X.
    The all-reduce of dX is launched asynchronously BEFORE the dW GEMM, so the
    network moves dX while the GEMM runs; we wait before returning dX
    (Megatron), or, given a DeferredGradAllReduce, not at all: its identity
    node waits later, after other chunks' GEMMs (DeepSpeed-Domino).
    On GPU this relies on CUDA_DEVICE_MAX_CONNECTIONS=1: with one hardware
    queue, kernels start in launch order, so the NCCL kernel (on its own
    stream) is already running when the GEMM is queued instead of waiting
    behind it. Megatron's async_tensor_model_parallel_allreduce does the same.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, deferred):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.deferred = bias is not None, deferred
        return F.linear(x, weight, bias)                        # (..., out/tp)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        # Under torch.autocast, forward's F.linear ran in the autocast dtype
        # (grad_out is e.g. bf16) but x and weight were saved in fp32, and
        # backward runs outside autocast. So do the GEMMs in grad_out's dtype,
        # as autograd does for an autocast F.linear, and cast each gradient
        # back to its input's dtype (dX before the all-reduce, exactly like
        # the plain f path, which all-reduces the fp32 gradient).
        dtype = grad_out.dtype
        grad_input = handle = None
        if ctx.needs_input_grad[0]:
            grad_input = (grad_out @ weight.to(dtype)).to(x.dtype).contiguous()  # (..., in) partial
            handle = _all_reduce_owned(grad_input, async_op=True)
        g2d = grad_out.reshape(-1, grad_out.shape[-1])                   # (N, out/tp)
        x2d = x.reshape(-1, x.shape[-1]).to(dtype)                       # (N, in)
        grad_weight = (g2d.t() @ x2d).to(weight.dtype)                   # overlaps the all-reduce
        grad_bias = g2d.sum(dim=0).to(weight.dtype) if ctx.has_bias else None
        if ctx.deferred is not None:
            ctx.deferred.handle = handle   # waited for in _WaitForGradAllReduce
        elif handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its INPUT dim: rank r holds the columns
    A_r (out, in/tp) and computes the partial product X_r A_r^T; g sums the
    partials over ranks. The bias is replicated and added once, after the sum.
    input_is_parallel=False first scatters a full input (..., in)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = True,
                 init_method: Callable[[torch.Tensor], None] = init_normal()):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.weight = _sharded_master((out_features, in_features), init_method, 1)
        # Replicated: every rank holds the full bias and computes the same grad.
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x)    # (..., in) -> (..., in/tp)
        y = reduce_from_tensor_parallel_region(F.linear(x, self.weight))  # (..., out)
        return y if self.bias is None else y + self.bias

    def forward_async(self, x: torch.Tensor) -> PendingAllReduce:
        """Like forward (input already parallel), but the all-reduce runs in
        the background: call .wait() on the result to get (..., out)."""
        return PendingAllReduce(F.linear(x, self.weight), self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "RowParallelLinear":
        """Shard an existing full nn.Linear (no random numbers drawn)."""
        return _from_linear(cls, linear, **kwargs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {_local_shape(self.weight)[1]}), "
                f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}")


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
    over ranks, so every id gets exactly its one row."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 init_method: Callable[[torch.Tensor], None] = init_normal()):
        super().__init__()
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
        return reduce_from_tensor_parallel_region(out)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding) -> "VocabParallelEmbedding":
        """Shard an existing full nn.Embedding (no random numbers drawn)."""
        layer = cls(emb.num_embeddings, emb.embedding_dim,
                    init_method=lambda w: w.copy_(emb.weight))
        return layer.to(device=emb.weight.device, dtype=emb.weight.dtype)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"local rows [{self.vocab_start}, {self.vocab_end})")


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


# --------------------------------------------------------------------------
# Layout-independent checkpoints
# --------------------------------------------------------------------------

def gather_like(param: nn.Parameter, t: torch.Tensor) -> torch.Tensor:
    """The full tensor of `t`, a tensor split the way `param` is (the
    parameter itself, or optimizer state shaped like it). Collective over the
    TP group for sharded parameters; replicated ones are returned as they are."""
    if getattr(param, "tensor_model_parallel", False):
        return gather_tensor(t, param.partition_dim, param.partition_stride)
    return t


def shard_like(param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """Inverse of gather_like: this rank's slice of `full`, split like `param`."""
    if getattr(param, "tensor_model_parallel", False):
        return shard_tensor(full, param.partition_dim, tp_rank(), tp_size(), param.partition_stride)
    return full


def full_state_dict(module: nn.Module) -> dict:
    """module.state_dict() with every sharded parameter gathered to its full
    tensor: the same keys and shapes for any tp. Collective over the TP group."""
    params = dict(module.named_parameters())
    return {name: gather_like(params[name], t) if name in params else t
            for name, t in module.state_dict().items()}


def load_full_state_dict(module: nn.Module, sd: dict) -> None:
    """Inverse of full_state_dict: slice each full tensor the way this rank's
    parameter is split, then load strictly (any tp can load any tp's save)."""
    params = dict(module.named_parameters())
    module.load_state_dict({name: shard_like(params[name], t) if name in params else t
                            for name, t in sd.items()}, strict=True)


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
