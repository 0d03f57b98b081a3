"""Process groups, the raw collectives on them, and divisibility checks.

The group handles below are the project's only global state (plus the
benchmarking-only skip_communication flag and rng.py's RNG tracker)."""
from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist

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
    """Make the f/g (and Domino) activation/gradient all-reduces, sequence
    parallelism's all-gathers and reduce-scatters and its gradient sums
    no-ops (results become WRONG). Benchmarking only: measures the step time
    of the same compute without that communication. The small per-token
    all-reduces of vocab_parallel_cross_entropy, clip_grad_norm_'s norm
    all-reduce and the hidden-dim all-gathers still run."""
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
# Sequence-parallel collectives: along dim 1, the sequence, of (B, T, ...).
#
# Why the model keeps (B, T, C) rather than Megatron's (T, B, C): the rest of
# the model, and its path without sequence parallelism, keep nanoGPT's
# batch-first layout untouched. The price is one rearranging copy per
# collective, because rank r's tokens x[:, r*s:(r+1)*s] are not contiguous
# when B > 1 and the collectives move contiguous buffers. Megatron puts the
# sequence first so that each rank's slice is one contiguous block.
# --------------------------------------------------------------------------

class PendingSequenceGather:
    """An all-gather along the sequence, maybe still in flight: every rank's
    (B, T/tp, ...) slice, joined in rank order by wait() into (B, T, ...)."""

    def __init__(self, x: torch.Tensor, async_op: bool = False):
        x = x.contiguous()
        self._buffer = x.new_empty((tp_size(), *x.shape))     # (tp, B, T/tp, ...): rank r's at [r]
        self._handle = None
        if _SKIP_COMMUNICATION:  # benchmarking only: the right shape, wrong values
            self._buffer.copy_(x.expand_as(self._buffer))
        else:  # the collective sees the ranks' pieces stacked along dim 0
            self._handle = dist.all_gather_single(self._buffer.flatten(0, 1), x, group=tp_group(),
                                                  async_op=async_op)

    def wait(self) -> torch.Tensor:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        tp, B, s = self._buffer.shape[:3]
        # (tp, B, s, ...) -> (B, tp, s, ...) -> (B, tp*s, ...): a copy unless B == 1
        return self._buffer.movedim(0, 1).reshape(B, tp * s, *self._buffer.shape[3:])


def all_gather_sequence(x: torch.Tensor) -> torch.Tensor:
    """(B, T/tp, ...) on every rank -> (B, T, ...), the slices in rank order."""
    return PendingSequenceGather(x).wait()


def reduce_scatter_sequence(x: torch.Tensor, async_op: bool = False):
    """Sum x (B, T, ...) over the TP group and keep this rank's slice of the
    sequence, (B, T/tp, ...), in a new tensor. With async_op=True returns
    (tensor, work handle or None); the tensor holds the sum after wait()."""
    B, T, tp = x.shape[0], x.shape[1], tp_size()
    if T % tp != 0:
        raise ValueError(f"sequence length {T} is not divisible by tensor_model_parallel_size={tp}")
    parts = x.reshape(B, tp, T // tp, *x.shape[2:]).movedim(1, 0).contiguous()  # (tp, B, T/tp, ...)
    out = parts.new_empty(parts.shape[1:])                                     # (B, T/tp, ...)
    handle = None
    if _SKIP_COMMUNICATION:
        out.copy_(parts[tp_rank()])
    else:
        handle = dist.reduce_scatter_single(out, parts.flatten(0, 1), group=tp_group(), async_op=async_op)
    return (out, handle) if async_op else out
