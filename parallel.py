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
f sums the partial gradients w.r.t. X. The embedding is split by vocabulary,
and the loss is computed on vocab-sharded logits without gathering them.

Sequence parallelism (Korthikanti et al., 2022). Outside the f ... g pairs,
every rank runs the same LayerNorms, dropouts and residual adds on the same
(B, T, C) activations, and keeps them for backward. Sequence parallelism
splits THOSE along the sequence: rank r holds tokens [r T/tp, (r+1) T/tp).
g becomes a reduce-scatter (each rank keeps the sum for its tokens only),
and f an all-gather (the column-parallel layer needs every token):

    x_r --LN--> --all-gather--> [X A_r] --GeLU--> [. B_r] --reduce-scatter--> y_r

An all-reduce IS a reduce-scatter followed by an all-gather, so the bytes on
the wire are the same; what changes is that the activations outside the
f ... g regions are 1/tp as large. Two consequences: replicated parameters
(norms, row-parallel biases) see only their rank's tokens, so their
gradients are summed over the TP group (sum_sequence_parallel_grads); and
dropout in the split region must draw a different mask on each rank, from a
per-rank RNG stream (section 5).

Domino (DeepSpeed-Domino, Wang et al. 2024) hides these collectives behind
computation: the micro-batch is split into chunks, and one chunk's
collectives are in flight while another chunk computes (section 4).

Initialization: every parallel layer first builds its FULL master weight with
the given init_method (the same on every rank when all ranks seed the RNG
identically), then keeps only its own slice. So the model is the same for any
tp, at the cost of one full weight per layer held temporarily.

Sections:

    1. process groups, raw collectives (one form for eager mode and
       torch.compile), divisibility checks
    2. tensor parallelism: f and g, then ColumnParallelLinear (f, F.linear),
       RowParallelLinear (F.linear, g), VocabParallelEmbedding
    3. sequence parallelism: f and g along the sequence, its column GEMM, the
       replicated parameters' gradient sums (clipping: train.clip_grad_norm_)
    4. Domino: the same collectives left in flight, and its schedule
    5. the per-rank random stream for dropout, and checkpointing that replays it
    6. cross entropy on vocab-sharded logits
    7. slicing full tensors into shards and back; full state dicts; the
       attributes parameters carry from one module to another (mark)
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from launch import UsageError


# ============================================================================
# 1. Process groups and raw collectives
# ============================================================================
# The project's global state, with the RNG tracker of section 5.
#
# Megatron's order of ranks: TP varies fastest, then CP (context.py), then DP,
# then PP, so rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp
# + tp_rank. TP=2 x DP=2 x PP=2 (cp = 1):
#
#                   stage 0           stage 1
#     DP replica 0  [0 1]  --p2p-->  [4 5]      TP groups  [0,1] [2,3] [4,5] [6,7]
#     DP replica 1  [2 3]  --p2p-->  [6 7]      DP groups  [0,2] [1,3] [4,6] [5,7]
#                                               PP groups  [0,4] [1,5] [2,6] [3,7]
#                                               MP groups  [0,1,4,5] [2,3,6,7] (TP x PP)
#
# TP talks every layer (one node); a stage sends only its output activations
# to the next (point to point), which is why PP is the dimension that spans nodes.

@dataclasses.dataclass
class Layout:
    """This rank's place in the TP x CP x DP x PP layout: its process group in
    each dimension (None in a single process), the dimension's size and this
    rank's index in it. embedding_group: the first and last stage of this
    rank's pipeline, which hold the tied embedding (None on the others).
    mp_group: TP x PP, the ranks that together hold one replica (DeepSpeed's
    grad norm and overflow check: zero.DeepSpeedMPU). cp_group (context.py):
    the cp consecutive TP groups of one replica's stage, which split each
    sequence; they share weights and batches, so gradients are averaged over
    dp_cp_group (DP x CP; the DP group at cp = 1), the data split over dp_group."""
    tp_group: object = None
    tp_size: int = 1
    tp_rank: int = 0
    dp_group: object = None
    dp_size: int = 1
    dp_rank: int = 0
    pp_group: object = None
    pp_size: int = 1
    pp_rank: int = 0
    embedding_group: object = None
    mp_group: object = None
    cp_group: object = None
    cp_size: int = 1
    cp_rank: int = 0
    dp_cp_group: object = None
    dp_cp_size: int = 1  # dp_size x cp_size: the ranks gradients are averaged over
    # Expert parallelism (expert_parallel.py), folded out of DP x CP: ep_group,
    # ep consecutive ranks of a dp_cp_group, split the experts; expert_dp_group,
    # one rank of each, hold the same experts (their gradients are summed there).
    # etp_size: the TP ranks each expert is split over, tp (as the MLP) or 1: whole
    # experts, each TP rank routing its own tokens (under SP), EP folded out of the
    # stage's TP x CP x DP. routing_group: the ranks routing different tokens (DP x CP, or that stage).
    ep_group: object = None
    ep_size: int = 1
    ep_rank: int = 0
    expert_dp_group: object = None
    etp_size: int = 1
    routing_group: object = None
    initialized: bool = False

    @property
    def whole_experts(self) -> bool:
        """Expert TP 1 under TP > 1: each TP rank holds whole experts and routes its own tokens."""
        return self.etp_size < self.tp_size

    @property
    def routing_tp_size(self) -> int:
        """The TP ranks of a TP group that route different tokens: tp under expert TP 1, else 1."""
        return self.tp_size // self.etp_size

    @property
    def experts_apart(self) -> bool:
        """Whether the experts' gradients are averaged over other ranks than DP x CP (EP > 1, or
        whole experts): then DDP leaves them to expert_parallel.reduce_expert_grads (averaged_apart)."""
        return self.ep_size > 1 or self.whole_experts


layout = Layout()  # read it as parallel.layout.tp_size: initialize() replaces it


def initialize(tensor_model_parallel_size: int = 1, timeout: datetime.timedelta | None = None,
               pipeline_model_parallel_size: int = 1, context_parallel_size: int = 1,
               expert_model_parallel_size: int = 1, expert_tensor_parallel_size: int | None = None) -> None:
    """Build the TP, CP, DP, PP and EP groups (in the order drawn above), on every
    rank (new_group is collective); without torch.distributed, a single-rank
    world. Pass init_process_group's `timeout`: new_group does not inherit
    it, and torch's 30-minute default would let a dead peer hang DDP that long."""
    global layout
    tp, cp, pp = tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size
    if not (dist.is_available() and dist.is_initialized()):
        if tp * cp * pp != 1:
            raise UsageError(
                f"tensor_model_parallel_size={tp} x context_parallel_size={cp} x "
                f"pipeline_model_parallel_size={pp} needs torch.distributed: launch with "
                f"`torchrun --nproc_per_node {tp * cp * pp} ...` and call "
                "torch.distributed.init_process_group() before parallel.initialize()")
        destroy()  # no groups: the sizes and ranks of one process
        check_expert_parallel_size(expert_model_parallel_size, 1)
        layout = Layout(initialized=True)
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % (tp * cp * pp) != 0:
        cp_flag = f" x --context-parallel-size {cp}" if cp > 1 else ""
        raise UsageError(
            f"--tensor-model-parallel-size {tp}{cp_flag} x --pipeline-model-parallel-size {pp} = "
            f"{tp * cp * pp} does not divide the world size {world}: launch a multiple of "
            f"{tp * cp * pp} processes or pick sizes whose product divides {world}")
    dp, ep, etp = world // (tp * cp * pp), expert_model_parallel_size, expert_tensor_parallel_size or tp
    check_expert_parallel_size(ep, dp * cp * tp // etp, etp < tp)
    stage_size = dp * cp * tp  # ranks per pipeline stage
    new = Layout(tp_size=tp, tp_rank=rank % tp, cp_size=cp, cp_rank=rank % (cp * tp) // tp,
                 dp_size=dp, dp_rank=rank % stage_size // (cp * tp), dp_cp_size=dp * cp,
                 pp_size=pp, pp_rank=rank // stage_size, etp_size=etp, initialized=True)

    def mine(rank_lists):  # every rank creates every group, in the same order; this rank's
        made = [(dist.new_group(ranks, timeout=timeout), ranks) for ranks in rank_lists]
        return next((group for group, ranks in made if rank in ranks), None)
    stages = [range(s * stage_size, (s + 1) * stage_size) for s in range(pp)]
    dp_cp_ranks = [list(range(st[0] + t, st[-1] + 1, tp)) for st in stages for t in range(tp)]  # same stage, TP rank
    # TP: consecutive ranks; DP: same stage, CP and TP rank
    new.tp_group = new.mp_group = mine([list(range(a, a + tp)) for a in range(0, world, tp)])
    new.dp_group = mine([list(range(st[0] + c * tp + t, st[-1] + 1, cp * tp))
                         for st in stages for c in range(cp) for t in range(tp)])
    new.dp_cp_group = new.dp_group
    if cp > 1:  # CP: same stage, DP and TP rank; DP x CP: same stage and TP rank
        new.cp_group = mine([list(range(st[0] + d * cp * tp + t, st[0] + (d + 1) * cp * tp, tp))
                             for st in stages for d in range(dp) for t in range(tp)])
        new.dp_cp_group = mine(dp_cp_ranks)
    pipelines = [list(range(first, world, stage_size)) for first in range(stage_size)]
    new.pp_group = mine(pipelines)                                    # PP: same DP, CP and TP rank
    folds = dp_cp_ranks if etp == tp else [list(st) for st in stages]  # what EP is folded out of
    new.routing_group = new.dp_cp_group if etp == tp else mine(folds)  # the ranks whose tokens differ
    _expert_groups(new, ep, folds, mine)
    if pp > 1:                                                        # TP x PP: same DP and CP rank
        new.embedding_group = mine([[ranks[0], ranks[-1]] for ranks in pipelines])
        new.mp_group = mine([[s * stage_size + r + t for s in range(pp) for t in range(tp)]
                             for r in range(0, stage_size, tp)])
    layout = new


def check_expert_parallel_size(ep: int, dp_cp: int, whole_experts: bool = False) -> None:
    if not isinstance(ep, int) or ep < 1 or dp_cp % ep:
        what = "tensor x data x context parallel size (--expert-tensor-parallel-size 1)" if whole_experts else \
            "data x context parallel size"
        raise UsageError(f"--expert-model-parallel-size {ep} must divide {what} {dp_cp}: "
                         f"launch a multiple of it as ranks or pick a size that divides {dp_cp}")


def _expert_groups(new: Layout, ep: int, folds: list, mine) -> None:
    """EP folded out of DP x CP (folds: the DP x CP groups), or under expert TP 1
    out of the stages' TP x CP x DP, as Megatron folds it: each fold's ranks, in
    order, split into blocks of ep (the EP groups), and the ranks at the same
    place in each block hold the same experts (expert_dp_group)."""
    rank = dist.get_rank()
    new.ep_size, new.ep_rank = ep, next(f.index(rank) for f in folds if rank in f) % ep
    new.expert_dp_group = new.routing_group  # the fold itself
    if ep > 1:
        new.ep_group = mine([r[i:i + ep] for r in folds for i in range(0, len(r), ep)])
        new.expert_dp_group = mine([r[i::ep] for r in folds for i in range(ep)])


def destroy() -> None:
    """Forget the groups (the world group itself belongs to the caller)."""
    global layout
    groups = {layout.tp_group, layout.dp_group, layout.pp_group, layout.embedding_group,
              layout.mp_group, layout.cp_group, layout.dp_cp_group, layout.ep_group, layout.expert_dp_group,
              layout.routing_group} - {None}
    for group in groups:
        if dist.is_initialized():
            dist.destroy_process_group(group)
    layout = Layout()


def check_layout(config, tp: int | None = None) -> None:
    """Raise UsageError unless tensor parallelism of size tp can split this
    model: tp divides every quantity that gets split (each rank keeps whole
    key/value heads; under a2a context parallelism cp x tp divides the heads),
    and Domino, which interleaves the chunks' sublayers, need not recompute them."""
    if tp is None:  # the model being built: at this process's layout
        # A multi-rank job that forgot initialize() would otherwise silently
        # train as if every rank were alone.
        if not layout.initialized and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size() > 1:
            raise RuntimeError("call parallel.initialize(tensor_model_parallel_size) first")
        tp = layout.tp_size
    if tp > 1 and config.domino_chunks > 1 and config.activation_checkpointing:
        raise UsageError("domino_chunks > 1 cannot be combined with activation_checkpointing; "
                         "turn one of them off")
    for name in ("num_attention_heads", "num_query_groups", "hidden_size", "ffn_hidden_size",
                 "padded_vocab_size"):
        value = getattr(config, name)
        if value % tp != 0:
            raise UsageError(
                f"tensor_model_parallel_size={tp} must divide {name}={value}: "
                f"pick a tensor_model_parallel_size that divides {value} or change {name}")
    cp = layout.cp_size
    for name in ("num_attention_heads", "num_query_groups") if cp > 1 and config.cp_comm_type == "a2a" else ():
        value = getattr(config, name)  # the all-to-all hands each CP rank whole heads of every TP rank's
        if value % (cp * tp):
            raise UsageError(f"--cp-comm-type a2a splits the heads over context x tensor parallelism: "
                             f"{name}={value} is not divisible by {cp} x {tp}; use --cp-comm-type p2p "
                             f"(ring attention, any heads) or change the sizes")


# --------------------------------------------------------------------------
# Raw collectives on the TP group, one form for eager mode and torch.compile:
# functional collectives, which Dynamo traces into the graph (a work handle
# would break it). A launch returns a new tensor, read only through wait();
# what runs between the two overlaps the collective, eager or compiled
# (Domino). They never modify their input: autograd may hand the same
# gradient to several branches (residual adds).
# --------------------------------------------------------------------------

def wait(t: torch.Tensor) -> torch.Tensor:
    """The launched collective's result, once it has landed."""
    return torch.ops._c10d_functional.wait_tensor(t)


def launch_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Start sum_r x_r over the TP group; wait() gives a new contiguous tensor."""
    return torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", layout.tp_group.group_name)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the TP group into a new contiguous tensor (launched and waited for)."""
    return torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", layout.tp_group.group_name))


def all_reduce_mean(x: torch.Tensor, group=None) -> torch.Tensor:
    """The mean of x over `group` (a copy; x itself if the group is one rank)."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        x = x.clone()
        dist.all_reduce(x, group=group)
        x /= dist.get_world_size(group)
    return x


# --------------------------------------------------------------------------
# Sequence-parallel collectives: along dim 1, the sequence, of (B, T, ...).
# The model keeps nanoGPT's batch-first layout rather than Megatron's
# (T, B, C), at the price of one rearranging copy per collective: rank r's
# tokens x[:, r*s:(r+1)*s] are not contiguous when B > 1.
# --------------------------------------------------------------------------

def launch_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Start the all-gather of every rank's x (B, ...) along dim 0: (tp * B, ...),
    rank r's rows at [r * B, (r + 1) * B), after wait()."""
    if x.device.type == "cpu":  # gloo: see the workarounds at the end of section 3
        return _launch_all_gather_as_sum(x)
    return torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), layout.tp_size,
                                                             layout.tp_group.group_name)


def gathered_sequence(in_flight: torch.Tensor) -> torch.Tensor:
    """The landed launch_all_gather of every rank's (B, T/tp, ...): the
    slices joined in rank order, (B, T, ...)."""
    parts = wait(in_flight).unflatten(0, (layout.tp_size, -1))     # (tp, B, T/tp, ...): rank r's at [r]
    return parts.movedim(0, 1).flatten(1, 2)     # (B, tp, T/tp, ...) -> (B, T, ...): a copy unless B == 1


def all_gather_sequence(x: torch.Tensor) -> torch.Tensor:
    """(B, T/tp, ...) on every rank -> (B, T, ...), the slices in rank order."""
    return gathered_sequence(launch_all_gather(x))


def launch_reduce_scatter_sequence(x: torch.Tensor) -> torch.Tensor:
    """Start the sum of x (B, T, ...) over the TP group, of which this rank
    keeps its tokens: (B, T/tp, ...) after wait() (config.py checks that tp
    divides --seq-length)."""
    parts = x.unflatten(1, (layout.tp_size, -1)).movedim(1, 0)     # (tp, B, T/tp, ...): rank r's at [r]
    return torch.ops._c10d_functional.reduce_scatter_tensor(parts.flatten(0, 1).contiguous(), "sum",
                                                            layout.tp_size, layout.tp_group.group_name)


def reduce_scatter_sequence(x: torch.Tensor) -> torch.Tensor:
    """Sum x (B, T, ...) over the TP group and keep this rank's tokens (B, T/tp, ...)."""
    return wait(launch_reduce_scatter_sequence(x))


# ============================================================================
# 2. Tensor parallelism: f, g and the parallel layers
# ============================================================================
# Megatron's f and g (the module docstring draws them), and the layers built
# on them: a column-parallel linear is f, then F.linear; a row-parallel one is
# F.linear, then g. With tp=1 f and g are the identity and add no autograd node.

class _CopyToTensorParallelRegion(torch.autograd.Function):
    """f: forward y = x (every rank already holds x); backward
    dx = sum_r dy_r, an all-reduce: x fed all tp shards, and each shard's
    GEMM gives only its share of the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad)


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: forward y = sum_r x_r, an all-reduce (each rank's partial product
    -> the full result); backward dx_r = dy: a sum passes the same gradient
    to every summand."""

    @staticmethod
    def forward(ctx, x):
        return all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def copy_to_tensor_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """f (_CopyToTensorParallelRegion)."""
    return x if layout.tp_size == 1 else _CopyToTensorParallelRegion.apply(x)


def reduce_from_tensor_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """g (_ReduceFromTensorParallelRegion)."""
    return x if layout.tp_size == 1 else _ReduceFromTensorParallelRegion.apply(x)


def init_normal(std: float = 0.02) -> Callable[[torch.Tensor], None]:
    """Megatron's default init_method: N(0, std) on the full master weight."""
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)


def _sharded_master(shape: tuple[int, ...], init_method, dim: int,
                    blocks=1) -> nn.Parameter:
    """Build the full master weight with init_method, keep this rank's slice."""
    master = torch.empty(shape)
    with torch.no_grad():
        init_method(master)
    shard = shard_tensor(master, dim, layout.tp_rank, layout.tp_size, blocks)
    return _mark_sharded(nn.Parameter(shard), dim, blocks)


def _from_linear(cls, linear: nn.Linear, **kwargs):
    """Layer.from_linear: shard an existing full nn.Linear (init_method copies
    its weight: no random number is drawn)."""
    layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                init_method=lambda w: w.copy_(linear.weight), **kwargs)
    if linear.bias is not None:
        with torch.no_grad():
            layer.bias.copy_(shard_like(layer.bias, linear.bias))
    return layer.to(device=linear.weight.device, dtype=linear.weight.dtype)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its OUTPUT dim: rank r holds the rows A_r
    (out/tp, in) and computes Y_r = f(X) A_r^T + b_r, sharded (..., out/tp). Under
    sequence parallelism X is this rank's tokens (B, T/tp, in), f their all-gather."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 blocks=1, init_method: Callable[[torch.Tensor], None] = init_normal(),
                 sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel and layout.tp_size > 1
        self.in_features, self.out_features, self.blocks = in_features, out_features, blocks
        self.weight = _sharded_master((out_features, in_features), init_method, 0, blocks)
        self.bias = None
        if bias:  # zeros, as in Megatron
            self.bias = _mark_sharded(nn.Parameter(torch.zeros(out_features // layout.tp_size)), 0, blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = gather_from_sequence_parallel_region if self.sequence_parallel else copy_to_tensor_parallel_region
        if not (self.sequence_parallel and torch.is_grad_enabled()):
            return F.linear(f(x), self.weight, self.bias)  # (..., out/tp)
        return _SequenceParallelLinear.apply(_WaitForGrad.apply(x), self.weight, self.bias)  # keeps T/tp tokens

    from_linear = classmethod(_from_linear)

    def extra_repr(self) -> str:
        local = getattr(self.weight, "ds_shape", self.weight.shape)[0]  # ZeRO-3 empties the weight
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {local}), blocks={self.blocks}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its INPUT dim: rank r holds the columns
    A_r (out, in/tp) and computes the partial product X_r A_r^T; g sums the
    partials; the replicated bias is added once, after the sum. The input is
    already split (..., in/tp): a column-parallel layer's output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 init_method: Callable[[torch.Tensor], None] = init_normal(),
                 sequence_parallel: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # True: reduce-scatter the sum to this rank's tokens (B, T/tp, out)
        self.sequence_parallel = sequence_parallel and layout.tp_size > 1
        self.weight = _sharded_master((out_features, in_features), init_method, 1)
        # Replicated (under sequence parallelism its grad is summed: sum_sequence_parallel_grads)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)                          # (B, T, out), this rank's share
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial)  # (B, T/tp, out)
        else:
            y = reduce_from_tensor_parallel_region(partial)         # (B, T, out)
        return y if self.bias is None else y + self.bias

    from_linear = classmethod(_from_linear)

    def extra_repr(self) -> str:
        local = getattr(self.weight, "ds_shape", self.weight.shape)[1]  # ZeRO-3 empties the weight
        return (f"in_features={self.in_features} (local {local}), "
                f"out_features={self.out_features}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split into tp contiguous ranges
    (check_layout: tp divides them). Rank r looks up the ids it owns, outputs
    zeros for the others, and g sums over ranks, so every id gets exactly its
    one row. sequence_parallel=True reduce-scatters the sum instead: each
    rank keeps its tokens (B, T/tp, C)."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 init_method: Callable[[torch.Tensor], None] = init_normal(),
                 sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel and layout.tp_size > 1
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per_rank = num_embeddings // layout.tp_size
        self.vocab_start, self.vocab_end = layout.tp_rank * per_rank, (layout.tp_rank + 1) * per_rank
        self.weight = _sharded_master((num_embeddings, embedding_dim), init_method, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # An out-of-range id would silently embed to zeros: train.check_batches
        # checks every batch's ids on the host, before the model.
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
    back on: a KV-cache step's one token cannot be split over the TP ranks."""
    switched = [m for m in module.modules() if getattr(m, "sequence_parallel", False)]
    for m in switched:
        m.sequence_parallel = False
    try:
        yield
    finally:
        for m in switched:
            m.sequence_parallel = True


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """forward y = [x_0 | x_1 | ... | x_{tp-1}] along the last dim; backward
    dx_r = dy[..., r-th slice]."""

    @staticmethod
    def forward(ctx, x):  # (tp * ..., n) -> (tp, ..., n) -> (..., tp * n)
        return torch.cat(wait(launch_all_gather(x)).chunk(layout.tp_size, dim=0), dim=-1)

    @staticmethod
    def backward(ctx, grad):
        width = grad.shape[-1] // layout.tp_size  # a copy of this rank's slice, which frees the rest
        return grad[..., layout.tp_rank * width:(layout.tp_rank + 1) * width].contiguous()


def gather_from_tensor_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Every rank's last-dim shard joined (the full logits of eval and generation)."""
    return x if layout.tp_size == 1 else _GatherFromTensorParallelRegion.apply(x)


# ============================================================================
# 3. Sequence parallelism: f and g along the sequence, and its column GEMM
# ============================================================================
# (The module docstring draws it.) The column GEMM's textbook form, f along the sequence then
# F.linear, keeps all T tokens for dW: in training _SequenceParallelLinear keeps T/tp instead.

class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Into the tensor-parallel region (before a column-parallel layer or the
    LM head); each rank's dy is a partial gradient, as in f's backward:
        forward   y = [x_0; x_1; ...; x_{tp-1}]   all-gather along the sequence
        backward  dx_r = (sum_q dy_q)[r-th slice]  reduce-scatter"""

    @staticmethod
    def forward(ctx, x):
        return all_gather_sequence(x)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad)


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Out of the tensor-parallel region (after a row-parallel layer or the
    vocab-parallel embedding), g with each rank keeping only its tokens:
        forward   y_r = (sum_q x_q)[r-th slice]    reduce-scatter along the sequence
        backward  dx = [dy_0; ...; dy_{tp-1}]      all-gather"""

    @staticmethod
    def forward(ctx, x):
        return reduce_scatter_sequence(x)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad)


def gather_from_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """(B, T/tp, ...) -> (B, T, ...); see _GatherFromSequenceParallelRegion."""
    return x if layout.tp_size == 1 else _GatherFromSequenceParallelRegion.apply(x)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """(B, T, ...) partial sums -> (B, T/tp, ...); see _ReduceScatterToSequenceParallelRegion."""
    return x if layout.tp_size == 1 else _ReduceScatterToSequenceParallelRegion.apply(x)


def in_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    """x in the autocast dtype (when on), as the column-parallel GEMM would
    cast it anyway. Under sequence parallelism its input (a LayerNorm's fp32
    output) is all-gathered and kept: cast first, and both move and keep half
    the bytes (s*b*h*34/T assumes 16-bit activations)."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind) and x.is_floating_point():
        return x.to(torch.get_autocast_dtype(kind))
    return x


class _WaitForGrad(torch.autograd.Function):
    """forward y = x; backward dx = wait(grad): grad is a column-parallel
    GEMM's dX reduction, still in flight (_SequenceParallelLinear, Domino's
    column), now landed. It reaches this node as a tensor, through autograd
    in eager mode as through the compiled graph."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return wait(grad)


class _SequenceParallelLinear(torch.autograd.Function):
    """The column-parallel GEMM on this rank's tokens x (B, T/tp, in), in training:
        forward   Y = [x_0; ...; x_{tp-1}] W_r^T + b_r    all-gather, then GEMM
        backward  dx = reduce-scatter(dY W_r), returned still IN FLIGHT (a
                  _WaitForGrad node before this one waits for it), and
                  dW = dY^T X, X gathered again
    Only this rank's tokens are kept: 1/tp the activations. Backward launches
    the re-gather before the dX GEMM and the reduce-scatter before the dW
    GEMM, each hidden behind a GEMM (Megatron; on GPU this needs
    CUDA_DEVICE_MAX_CONNECTIONS=1: with one hardware queue the NCCL kernel
    starts before the GEMM, not behind it). A weight that needs no gradient
    needs neither x nor the re-gather."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        x = _SequenceParallelLinear.keep(ctx, x, weight, bias)
        return F.linear(all_gather_sequence(x), weight, bias)   # (B, T, out/tp)

    @staticmethod
    def keep(ctx, x, weight, bias):  # x (B, T/tp, in) for dW, in 16 bits under autocast: moved and kept so
        ctx.input_dtype, ctx.has_bias, x = x.dtype, bias is not None, in_autocast_dtype(x)
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        return x

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        # Backward runs outside autocast: do the GEMMs in grad_out's dtype (e.g. bf16), as
        # autograd does for an autocast F.linear, and cast each gradient back to its input's.
        dtype = grad_out.dtype
        regather = launch_all_gather(_after(x, grad_out)) if x is not None else None
        partial = (grad_out @ weight.to(dtype)).to(ctx.input_dtype)   # (B, T, in), this rank's share
        grad_input = launch_reduce_scatter_sequence(partial)           # -> (B, T/tp, in), in flight
        g2d = grad_out.reshape(-1, grad_out.shape[-1])                 # (B*T, out/tp)
        grad_weight = grad_bias = None
        if regather is not None:
            total = gathered_sequence(regather)                        # (B, T, in)
            grad_weight = (g2d.t() @ total.reshape(-1, total.shape[-1]).to(dtype)).to(weight.dtype)
        if ctx.has_bias:
            grad_bias = g2d.sum(dim=0).to(weight.dtype)
        return grad_input, grad_weight, grad_bias, None  # None: Domino's gathered X, if given (section 4)


def averaged_apart(param: nn.Parameter) -> bool:
    """An expert weight whose gradient DDP (or a pipeline's average) leaves to
    expert_parallel.reduce_expert_grads; at EP 1 (expert TP = TP) the experts are averaged as the rest."""
    return getattr(param, "expert_parallel", False) and layout.experts_apart


def sum_sequence_parallel_grads(module: nn.Module) -> None:
    """Under sequence parallelism every replicated parameter (norms,
    row-parallel biases, learned positions) sees only this rank's tokens:
    its full gradient is the sum over the TP group. A hook sums it in
    backward, before it lands in .grad, so DDP's and ZeRO's hooks,
    accumulation and clipping all see it (Megatron sums once per step). Whole
    experts (expert TP 1) are summed with their expert_dp_group, which spans TP."""
    for p in module.parameters():
        if not getattr(p, "tensor_model_parallel", False) and p.requires_grad and \
                not (layout.whole_experts and getattr(p, "expert_parallel", False)):
            p.register_hook(all_reduce)   # returns the sum over the TP group, a new tensor


# -- Workarounds, to read past: gloo's all-gather; the re-gather's place under torch.compile --
def _launch_all_gather_as_sum(x: torch.Tensor) -> torch.Tensor:
    """launch_all_gather of CPU tensors (gloo): the sum of every rank's x at
    its own rows, zeros elsewhere. Gloo's all-gather beside another collective
    in flight (sequence parallelism, Domino) corrupts the heap: see
    bench/check_gloo_gather.py. The sum moves about twice an all-gather's bytes."""
    before, after = layout.tp_rank * x.shape[0], (layout.tp_size - 1 - layout.tp_rank) * x.shape[0]
    # zeros above and below x along dim 0 (a pad, not a cat: Inductor would keep x twice for backward)
    return launch_all_reduce(F.pad(x, (0, 0) * (x.dim() - 1) + (before, after)))   # (tp * B, ...)


@torch.library.custom_op("parallel::after", mutates_args=())
def _after(x: torch.Tensor, dependency: torch.Tensor) -> torch.Tensor:
    """A copy of x, made only once `dependency` (the gradient) exists.
    AOTAutograd would run a collective that needs no gradient (the re-gather
    of this rank's tokens) in FORWARD and keep its (B, T, in) output, tp
    times what sequence parallelism keeps; gathering this copy keeps it in
    backward. Opaque, so no compiler pass folds the dependency away."""
    return x.clone(memory_format=torch.contiguous_format)


@_after.register_fake
def _(x, dependency):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ============================================================================
# 4. Domino: the same collectives, left in flight while another chunk computes
# ============================================================================
# The micro-batch is split along the batch into chunks, independent until the
# loss. The layer stack is a list of sublayers (attention and MLP), and a
# chunk's pass through a sublayer is
#
#     enter:  wait for its previous row-parallel all-reduce, residual add,
#             LayerNorm, and the node where backward will wait (see below)
#     body:   column-parallel GEMM ... (heads or GeLU), row-parallel GEMM
#     launch: the row-parallel all-reduce, left in flight
#
# Forward: chunk i's all-reduce is in flight while the other chunks' bodies
# run, and is waited for only when chunk i enters its next sublayer.
#
# Backward runs the graph in reverse, always picking the ready node that was
# created LAST in forward. The column-parallel layer's f launches its dX
# all-reduce and returns without waiting; the wait is a _WaitForGrad node
# made when the chunk entered the sublayer, BEFORE the previous chunk
# launched its row-parallel GEMM: in backward, that GEMM's gradients are
# computed between this chunk's launch and its wait. With 2 chunks:
#
#     forward   body0 | enter1 | row0 | body1 | enter0' | row1 | body0' ...
#     backward  ... row1' | body1'[launch 1] | row0' | wait 1 | ...
#
# Under sequence parallelism each all-reduce is a reduce-scatter, in flight
# the same way, and entering a sublayer also launches the all-gather of the
# chunk's LayerNorm output for the column-parallel GEMM, while the previous
# chunk's row GEMM runs (a row-parallel layer's dY all-gathers are waited for
# at once: its GEMMs need them). Under a zero-bubble pipeline (pipeline.py)
# the dW GEMMs leave for the schedule's W: then the other chunk's dX GEMMs
# alone hide each dX reduction. tests/test_parallel.py checks this order on
# two ranks, eager and compiled.

class _CopyToTensorParallelRegionInFlight(torch.autograd.Function):
    """Domino's f: forward y = x; backward launches dx = sum_r dy_r and
    returns it still in flight, for the chunk's _WaitForGrad node."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return launch_all_reduce(grad)


class ChunkCollectives(NamedTuple):
    """What Domino launched for a chunk's column-parallel layer as the chunk
    entered its sublayer: under sequence parallelism the input's all-gather."""
    gathered_input: torch.Tensor | None


class DominoColumnParallelLinear(ColumnParallelLinear):
    """A ColumnParallelLinear whose dX reduction Domino leaves in flight, for
    the _WaitForGrad node made as the chunk entered the sublayer (without a
    chunk, as generation runs it: the plain layer)."""

    def forward(self, x: torch.Tensor, chunk: ChunkCollectives | None = None) -> torch.Tensor:
        if chunk is None:
            return super().forward(x)
        if not self.sequence_parallel:
            return F.linear(_CopyToTensorParallelRegionInFlight.apply(x), self.weight, self.bias)
        gathered = gathered_sequence(chunk.gathered_input)  # (B, T, in), waited for outside the Function (for Dynamo)
        return _GatheredSequenceParallelLinear.apply(x, self.weight, self.bias, gathered)


class _GatheredSequenceParallelLinear(_SequenceParallelLinear):
    """_SequenceParallelLinear given X gathered (Domino launched it as the chunk
    entered), and its backward: the gathered X takes no gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, gathered):
        _SequenceParallelLinear.keep(ctx, x, weight, bias)
        return F.linear(gathered, weight, bias)                  # (B, T, out/tp)


class _LandedReduce(torch.autograd.Function):
    """Domino's g, once landed: forward returns `reduced`, the collective of
    `partial` that PendingReduce launched; backward is g's (under sequence
    parallelism an all-gather). The sum enters the graph only AFTER landing:
    gloo finishes a reduce-scatter with a copy_ into the output on its own
    thread, which autograd would record, cutting the gradient's way back."""

    @staticmethod
    def forward(ctx, partial, reduced, sequence_parallel: bool):
        ctx.sequence_parallel = sequence_parallel
        return reduced.view_as(reduced)

    @staticmethod
    def backward(ctx, grad):
        return (all_gather_sequence(grad) if ctx.sequence_parallel else grad), None, None


class PendingReduce:
    """A sublayer's RowParallelLinear forward with g (under sequence
    parallelism its reduce-scatter) left in flight; wait(), as the chunk
    enters its next sublayer, returns dropout(the sum plus bias)."""

    def __init__(self, sublayer: Sublayer, x: torch.Tensor):
        self._row, self._dropout = sublayer.row, sublayer.dropout
        self._partial = F.linear(x, self._row.weight)              # (B, T, out), this rank's share
        launch = launch_reduce_scatter_sequence if self._row.sequence_parallel else launch_all_reduce
        self._in_flight = launch(self._partial.detach())          # -> (B, T/tp, out) or (B, T, out)

    def wait(self) -> torch.Tensor:
        out = _LandedReduce.apply(self._partial, wait(self._in_flight), self._row.sequence_parallel)
        return self._dropout(out if self._row.bias is None else out + self._row.bias)


class Sublayer(NamedTuple):
    norm: nn.Module   # the LayerNorm that enters it
    body: Callable    # body(h, chunk collectives, chunk index) -> the row-parallel layer's input
    row: nn.Module    # the RowParallelLinear that ends it
    dropout: nn.Module


def domino(sublayers: list[Sublayer], chunks: list[torch.Tensor], add_and_norm: Callable,
           sequence_parallel: bool = False) -> list[torch.Tensor]:
    """Every chunk (b, T, C) through every sublayer, interleaved as drawn
    above: the chunks' outputs. add_and_norm(norm, x, branch or None) ->
    (x + branch, norm(x + branch)) is the model's residual add and LayerNorm."""
    chunks = list(chunks)
    pending = [None] * len(chunks)   # per chunk: its last sublayer's PendingReduce

    def enter(i, s):  # -> (LayerNorm output (b, T, C), where its grad is awaited)
        branch = pending[i].wait() if pending[i] else None
        chunks[i], h = add_and_norm(sublayers[s].norm, chunks[i], branch)
        # under sequence parallelism h holds this rank's tokens: start gathering them all now
        gathered = launch_all_gather(in_autocast_dtype(h.detach())) if sequence_parallel else None
        return _WaitForGrad.apply(h), ChunkCollectives(gathered)

    entered = [enter(0, 0)] + [None] * (len(chunks) - 1)
    for s, sublayer in enumerate(sublayers):
        for i in range(len(chunks)):
            y = sublayer.body(*entered[i], i)         # (b, T, C/tp) or (b, T, F/tp)
            if i + 1 < len(chunks):                   # the next chunk enters...
                entered[i + 1] = enter(i + 1, s)
            elif s + 1 < len(sublayers):              # ...or the first, the next sublayer
                entered[0] = enter(0, s + 1)
            pending[i] = PendingReduce(sublayer, y)   # ...before this row GEMM
    return [c + p.wait() for c, p in zip(chunks, pending)]


# ============================================================================
# 5. A random stream per tensor-parallel rank (Megatron's CUDA RNG tracker idea)
# ============================================================================
# Every rank seeds the default generator identically (train.py), so the
# replicated residual stream gets the same dropout masks on every rank. Some
# dropouts act on values that differ from rank to rank: attention dropout
# (each rank holds other heads) and, under sequence parallelism, hidden
# dropout (other tokens). Their masks must differ too, so they draw from a
# second stream, seeded differently on each tensor-parallel rank:
#
#     with per_rank_rng():
#         y = F.dropout(x, p)        # this rank's own mask
#
# per_rank_rng() swaps the default generator's state for the tracked one and back.

MODEL_PARALLEL_RNG = "model-parallel-rng"   # the stream's name, in checkpoints too
MODEL_PARALLEL_SEED_OFFSET = 2718   # Megatron's: rank r's stream is seeded seed + 2718 + r
_TRACKER: dict[str, dict] = {}      # the tracked streams: name -> states, as default_rng_state's


def default_rng_state() -> dict:
    """The default generators' states: the CPU one, and the current GPU's."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():  # call after torch.cuda.set_device (train.py does)
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _replace_tracker(states: dict) -> None:
    _TRACKER.clear()
    _TRACKER.update(states)


def model_parallel_seed(seed: int) -> None:
    """Seed the tensor-parallel stream (TP ranks differ, DP replicas agree).
    Call on every rank, after parallel.initialize(), next to torch.manual_seed."""
    seed += MODEL_PARALLEL_SEED_OFFSET + layout.tp_rank
    state = {"cpu": torch.Generator().manual_seed(seed).get_state()}
    if torch.cuda.is_available():  # this process's GPU only; the default stream is untouched
        with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
            torch.cuda.manual_seed(seed)
            state["cuda"] = torch.cuda.get_rng_state()
    _replace_tracker({MODEL_PARALLEL_RNG: state})


@contextlib.contextmanager
def per_rank_rng():
    """Draw from this TP rank's own stream inside the block (dropout over
    values that differ from rank to rank); the default one is restored."""
    if MODEL_PARALLEL_RNG not in _TRACKER:
        raise RuntimeError(f"RNG stream {MODEL_PARALLEL_RNG!r} was never seeded: call "
                           f"parallel.model_parallel_seed(seed) after parallel.initialize()")
    outside = default_rng_state()
    _set_state(_TRACKER[MODEL_PARALLEL_RNG])
    try:
        yield
    finally:
        _TRACKER[MODEL_PARALLEL_RNG] = default_rng_state()
        _set_state(outside)


def rng_tracker_states_of_every_tp_rank() -> list[dict]:
    """Every TP rank's tracker states, in TP-rank order (collective)."""
    mine = dict(_TRACKER)
    if layout.tp_size == 1:
        return [mine]
    everyone = [None] * layout.tp_size
    dist.all_gather_object(everyone, mine, group=layout.tp_group)
    return everyone


def set_rng_tracker_states_of_every_tp_rank(states: list[dict]) -> bool:
    """Inverse: this rank takes its own. False (and nothing changes) when
    they were saved at another TP size or on other devices."""
    if len(states) != layout.tp_size or any(s.keys() != default_rng_state().keys()
                                       for s in states[layout.tp_rank].values()):
        return False
    _replace_tracker(states[layout.tp_rank])
    return True


recomputing = False  # while checkpoint_with_rng reruns a block whose first run took grad (gpt.MoE records once)


def checkpoint_with_rng(checkpoint_fn, fn, *args):
    """checkpoint_fn(fn, *args) (torch's or DeepSpeed's activation
    checkpointing), replaying the tracker's streams too: checkpointing
    restores only the DEFAULT generator for its recompute, so per_rank_rng's
    masks would differ and the gradients be silently wrong. The recompute
    runs from the first run's tracker states, then the current ones return."""
    start = dict(_TRACKER)
    runs = []

    def run(*inputs):
        if torch.compiler.is_compiling():
            # the recompute replays the traced graph; should fn break it (the
            # tracker's swap does), Dynamo runs this eagerly, through the branches below
            return fn(*inputs)
        if not runs:                     # the forward pass: with grad (torch's), or not (DeepSpeed's reentrant)
            runs.append(torch.is_grad_enabled())
            return fn(*inputs)
        global recomputing
        now, recomputing = dict(_TRACKER), runs[0]  # the recompute, in backward: a rerun if the first took grad
        _replace_tracker(start)
        try:
            return fn(*inputs)
        finally:
            _replace_tracker(now)
            recomputing = False
    return checkpoint_fn(run, *args)


# ============================================================================
# 6. Cross entropy on vocab-sharded logits
# ============================================================================

class _VocabParallelCrossEntropy(torch.autograd.Function):
    """loss = log(sum_v exp(z_v - m)) - (z_target - m), m = max_v z_v, where
    the vocab v is spread over ranks. Only per-token scalars are all-reduced
    (the max, the exp-sum, the target logit), never the (..., V) logits.
    Backward on the local shard: dz = (softmax(z) - onehot(target)) * dloss."""

    @staticmethod
    def forward(ctx, logits, target):
        ctx.logits_dtype = logits.dtype
        logits = logits.float()                                   # (..., V/tp) fp32
        start = layout.tp_rank * logits.shape[-1]
        # The target logit: only the rank that owns the target id contributes.
        outside = (target < start) | (target >= start + logits.shape[-1])
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        row_max = logits.max(dim=-1).values                       # (...)
        exp = (logits - row_max.unsqueeze(-1)).exp()              # (..., V/tp)
        lse, target_logit = vocab_parallel_lse(row_max, exp.sum(dim=-1), target_logit)
        softmax = exp.mul_((row_max - lse).exp().unsqueeze(-1))   # exp(z - lse)
        ctx.save_for_backward(softmax, local_target, outside)
        return lse - target_logit

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
    and full target ids (...), tp > 1 (at tp = 1 it is F.cross_entropy). No
    rank owns an out-of-range target: train.check_batches refuses them."""
    return _VocabParallelCrossEntropy.apply(logits, target)


def vocab_parallel_lse(row_max, sum_exp, z_target):
    """(lse, target logit) per row from this rank's slice's max, sum of
    exp(z - max) and target logit (0 where another slice holds the target),
    combined over the TP group (tp > 1) with two all-reduces of per-row scalars."""
    global_max = row_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=layout.tp_group)
    both = torch.stack([sum_exp * (row_max - global_max).exp(), z_target])  # one all-reduce
    dist.all_reduce(both, group=layout.tp_group)
    return global_max + both[0].log(), both[1]


# ============================================================================
# 7. Shards and full tensors: parameters, optimizer state, state dicts
# ============================================================================

def _block_sizes(full_size: int, blocks) -> list[int]:
    """A tensor's `blocks` along the split dim, as sizes. `blocks` (Megatron's
    stride, generalized) is a count of equal blocks (an int), or their sizes
    ([Q | K | V] with fewer K/V heads under grouped-query attention)."""
    if isinstance(blocks, int):
        return [full_size // blocks] * blocks
    return [int(s) for s in blocks]


def shard_tensor(full: torch.Tensor, dim: int, rank: int, world: int,
                 blocks=1) -> torch.Tensor:
    """Rank's slice of `full` along `dim`. With several blocks, `full` is
    made of them along dim (e.g. [Q | K | V]) and rank r keeps the r-th
    piece of every block ([Q_r | K_r | V_r]): whole heads."""
    sizes = _block_sizes(full.shape[dim], blocks)
    if sum(sizes) != full.shape[dim] or any(s % world for s in sizes):
        raise UsageError(f"dim {dim} of size {full.shape[dim]} cannot be split into "
                         f"block(s) {sizes} x {world} rank(s)")
    return torch.cat([b.chunk(world, dim=dim)[rank] for b in full.split(sizes, dim=dim)],
                     dim=dim).contiguous()


def shard_pieces(full_size: int, blocks, rank: int, world: int) -> list[tuple[int, int, int]]:
    """Where rank's shard_tensor slice lies along the split dim, one piece a
    block: (offset in the full tensor, offset in the shard, length). A
    torch_dist checkpoint writes and reads each piece where it lies."""
    pieces, start, local = [], 0, 0
    for size in _block_sizes(full_size, blocks):
        pieces.append((start + rank * (size // world), local, size // world))
        start, local = start + size, local + size // world
    return pieces


def merge_shards(shards: list[torch.Tensor], dim: int, blocks=1) -> torch.Tensor:
    """Inverse of shard_tensor: rebuild the full tensor from every rank's shard."""
    world = len(shards)
    local = [s // world for s in _block_sizes(shards[0].shape[dim] * world, blocks)]
    per_rank = [s.split(local, dim=dim) for s in shards]  # [rank][block]
    return torch.cat([piece for block in zip(*per_rank) for piece in block], dim=dim)  # block by block


def mark(obj, **attributes) -> None:
    """Set attributes that other modules read on a parameter (or module).
    Every one the project sets goes through here; docs/tensor-parallel.md
    lists them and their readers."""
    for name, value in attributes.items():
        setattr(obj, name, value)


def _mark_sharded(param: nn.Parameter, dim: int, blocks=1) -> nn.Parameter:
    mark(param, tensor_model_parallel=True, partition_dim=dim, partition_blocks=blocks)
    return param


# --------------------------------------------------------------------------
# Layout-independent checkpoints
# --------------------------------------------------------------------------

def split_of(param: nn.Parameter) -> list[tuple]:
    """How `param` is split: a (group, size, this rank's place, dim, blocks) per split, over the TP ranks
    and, for a MoE's stacked experts, over the EP ranks along dim 0 (TP's first); [] where held whole."""
    splits = []
    if getattr(param, "tensor_model_parallel", False) and layout.tp_size > 1:
        splits.append((layout.tp_group, layout.tp_size, layout.tp_rank, param.partition_dim, param.partition_blocks))
    if getattr(param, "expert_parallel", False) and layout.ep_size > 1:
        splits.append((layout.ep_group, layout.ep_size, layout.ep_rank, 0, 1))
    return splits


def gather_like(param: nn.Parameter, t: torch.Tensor, to_first: bool = False) -> torch.Tensor | None:
    """The full tensor of `t`, split the way `param` is (the parameter itself,
    or a gradient or optimizer state shaped like it), on every rank of its splits
    (split_of, each in turn); collective for split parameters. to_first: on the splits' first rank
    alone (or TP rank 0; the others return None and never allocate it: checkpoint writes)."""
    splits = split_of(param)
    if to_first and not splits and layout.tp_rank != 0:
        return None
    for group, size, rank, dim, blocks in splits:
        first = not to_first or rank == 0
        t = t.contiguous()
        shards = [torch.empty_like(t) for _ in range(size)] if first else None
        if to_first:
            dist.gather(t, shards, dst=dist.get_global_rank(group, 0), group=group)
        else:
            dist.all_gather(shards, t, group=group)
        if not first:
            return None
        t = merge_shards(shards, dim, blocks)
    return t


def shard_like(param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """Inverse of gather_like: this rank's slice of `full`, split like `param`."""
    for _, size, rank, dim, blocks in split_of(param):
        full = shard_tensor(full, dim, rank, size, blocks)
    return full


def full_state_dict(module: nn.Module) -> dict:
    """module.state_dict() with every sharded parameter gathered to its full
    tensor: the same keys and shapes at any tp and ep. Collective over their groups."""
    params = dict(module.named_parameters())
    return {name: gather_like(params[name], t) if name in params else t
            for name, t in module.state_dict().items()}


def load_full_state_dict(module: nn.Module, sd: dict) -> None:
    """Inverse of full_state_dict: slice each full tensor the way this rank's
    parameter is split, then load strictly (any tp or ep can load any's save)."""
    params = dict(module.named_parameters())
    module.load_state_dict({name: shard_like(params[name], t) if name in params else t
                            for name, t in sd.items()}, strict=True)
