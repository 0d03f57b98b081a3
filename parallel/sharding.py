"""Slicing full tensors into tensor-parallel shards and rebuilding them:
parameters, optimizer state, and layout-independent state dicts."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .groups import tp_group, tp_rank, tp_size

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
