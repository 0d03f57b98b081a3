"""Pipeline parallelism: the layers split into stages, one per pipeline rank,
and a step's micro-batches scheduled through them. Sections:

  1. Stages: which layers (model chunks) a rank holds (pipeline_chunks), a
     chunk's forward from the model's own pieces (Stage), the tied embedding
  2. The schedules: 1F1B, interleaved 1F1B and zero bubble (ZB-H1), drawn,
     and timed on one clock
  3. One rank's forwards, backwards and point-to-point exchanges
     (run_pipeline); 3b. zero bubble's W, the blocks' weight gradients left
     for later (LaterWeightGrads, weight_grads)
  4. The pipelined step: a step's micro-batches through this rank's stage
  5. The gradient reductions: over data parallelism (each started once its
     gradients are final), and the tied embedding's over its two stages
"""
from __future__ import annotations

import contextlib
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.overrides import TorchFunctionMode

import parallel
from config import TrainConfig
from data import to_device
from gpt import GPT, rope_angles, weighted_loss
from launch import UsageError

# The layers are split into pp stages, one per pipeline rank (Huang et al.,
# "GPipe", 2019; Narayanan et al., "Megatron-LM at scale", 2021): stage 0
# holds the embedding, the last stage the final norm, the head and the loss.
# A stage sends its output (B, T[/tp], C) to the next stage and, in backward,
# the gradient w.r.t. its input to the previous one, point to point. To keep
# every stage busy the global batch is cut into m micro-batches.
#
# 1F1B (PipeDream-flush, Narayanan et al. 2021), pp=4, m=8; a forward
# (digit: micro-batch) takes one tick, a backward (letter: a=0, b=1, ...) two:
#
#     stage 0  0123      aa4bb5cc6dd7ee ff gg hh
#     stage 1   012    aa3bb4cc5dd6ee7ff gg hh
#     stage 2    01  aa2bb3cc4dd5ee6ff7gg hh
#     stage 3     0aa1bb2cc3dd4ee5ff6gg7hh
#
# Stage s warms up with pp-1-s forwards, then alternates one forward with one
# backward, then drains the backwards: it never holds more than pp-s
# micro-batches' activations (GPipe, all forwards first, holds m). The idle
# ticks, the bubble, are (pp-1)/(m+pp-1) of the step (here 9 of 33 a stage):
# fewer with more micro-batches.
#
# Interleaved 1F1B (--num-layers-per-virtual-pipeline-stage): each rank holds
# v model chunks, chunk c of rank r being virtual stage c*pp + r, so a
# micro-batch goes round the ranks v times. A tick is then 1/v as long, and
# the bubble (pp-1)/(v*m+pp-1): about v times smaller, for v times more
# point-to-point messages.
#
# Zero bubble, ZB-H1 (--enable-zero-bubble; Qi et al., "Zero Bubble Pipeline
# Parallelism", ICLR 2024) splits each backward in two: I (the paper's B),
# the gradient w.r.t. the stage's input, which the previous stage waits for,
# and W, the weight gradients, which nothing waits for. Each takes one tick
# (digit F, lower-case letter I, upper-case W; pp=4, m=8):
#
#     stage 0  0123...aA4bB5cC6dD7eEfFgGhH
#     stage 1  .012..a3bA4cB5dC6eD7fEgFhGH
#     stage 2  ..01.a2b3cA4dB5eC6fD7gEhFGH
#     stage 3  ...0a1b2c3dA4eB5fC6gD7hEFGH
#
# The F's and I's keep 1F1B's order, so a stage holds as many micro-batches'
# activations as in 1F1B; stage s runs each W s micro-batches after its I,
# and those W's fill the drain where 1F1B idles. A stage idles pp-1 ticks
# of 3m+pp-1, (pp-1)/(3m+pp-1) (3 of 27 here; 1F1B: 3(pp-1) of 3m+3(pp-1),
# 9 of 33). The price: a W keeps the inputs and output gradients of the
# linears it needs (X, dY) from its I until it runs, s micro-batches' worth
# on stage s. W computes the dW of the blocks' linears (section 3b); the
# biases, norms, embeddings and LM head (small, or on one stage) get theirs in I.
#
# How it runs here: pipeline_timeline places every rank's actions (in
# Megatron's order) on one clock, each at the first tick its input exists.
# run_pipeline walks the ticks on every rank: at each tick a rank starts its
# action, if one starts then, then sends what its action ending at this tick
# produced and receives what its neighbours' produced, in one
# batch_isend_irecv: both sides of every message post it in the same batch,
# so nothing waits on a message posted later (NCCL would deadlock).


# ----------------------------------------------------------------------------
# 1. Stages

class Stage(nn.Module):
    """This rank's stage of `model` (a GPT of this rank's layers), a model chunk
    at a time from the model's own pieces: chunk `chunk` embeds `batch`'s tokens
    or runs on x (B, T[/tp], C), the previous stage's output, and returns its
    output or, ending with the last layer, the loss. A module, so that
    torch.compile(Stage(model)) compiles each chunk's forward whole."""

    def __init__(self, model: GPT):
        super().__init__()
        self.model = model

    def forward(self, chunk: int, batch: dict, x=None):
        model, layers = self.model, self.model.layers[chunk]
        if layers.start == 0:
            x, rope = model.embed(batch["tokens"], batch["position_ids"])  # (B, T[/tp], C)
        else:
            rope = rope_angles(model.config, batch["position_ids"]) \
                if model.config.position_embedding_type == "rope" else None
        # every chunk holds n layers (pipeline_chunks), in model.blocks in layer order; a slice of
        # the list, as a slice of the ModuleList would build a new module every forward (0.2 ms at 48)
        n = len(layers)
        x = model.run_blocks(x, rope, list(model.blocks)[chunk * n:(chunk + 1) * n], batch.get("document_ids"))
        if layers.stop < model.config.num_layers:
            return x
        return model.head(x, batch["labels"], batch["loss_mask"])


def pipeline_chunks(num_layers: int, pp: int, rank: int, layers_per_virtual_stage: int | None = None) -> list[range]:
    """The layers of each model chunk of pipeline rank `rank`: one chunk of
    num_layers/pp consecutive layers, or v = num_layers/(pp*n) chunks of
    n = layers_per_virtual_stage layers, chunk c being virtual stage c*pp + rank."""
    if num_layers % pp:
        raise UsageError(f"--pipeline-model-parallel-size {pp} must divide --num-layers {num_layers} "
                         f"(each stage holds as many layers)")
    n = layers_per_virtual_stage or num_layers // pp
    if num_layers % (pp * n):
        raise UsageError(f"--num-layers-per-virtual-pipeline-stage {n} x --pipeline-model-parallel-size "
                         f"{pp} must divide --num-layers {num_layers}")
    return [range((c * pp + rank) * n, (c * pp + rank + 1) * n) for c in range(num_layers // (pp * n))]


def tied_embedding_copy(model: GPT) -> nn.Parameter | None:
    """Where a tied embedding is split over two pipeline stages (the first's
    embedding, the last's head) and this stage holds one copy: its weight,
    whose gradient the two stages sum; else None."""
    tied = not model.config.untie_embeddings_and_output_weights
    one_end = model.holds_first_layer != model.holds_last_layer
    return model.wte.weight if tied and one_end and hasattr(model, "wte") else None


# ----------------------------------------------------------------------------
# 2. The schedules

class Action(NamedTuple):
    kind: str    # "F" forward, "B" backward; zero bubble: "I" input gradient, "W" weight gradients
    chunk: int   # which of this rank's model chunks (0 unless interleaved)
    micro: int   # which micro-batch


def rank_order(pp: int, rank: int, m: int, v: int = 1, forward_only: bool = False,
               zero_bubble: bool = False) -> list[Action]:
    """One rank's actions, in Megatron's order. The k-th of its m*v forwards
    runs chunk (k mod pp*v) // pp: micro-batches go through the chunks in
    groups of pp (the backwards through the chunks in reverse). zero_bubble:
    ZB-H1's order (zb_h1_order)."""
    def action(kind: str, k: int) -> Action:
        chunk = k % (pp * v) // pp
        return Action(kind, v - 1 - chunk if kind == "B" else chunk, k // (pp * v) * pp + k % pp)
    total = m * v
    if forward_only:
        return [action("F", k) for k in range(total)]
    if zero_bubble:
        return zb_h1_order(pp, rank, m)
    # Forwards before the first backward: enough to fill the pipe below this rank
    # (interleaved: twice that, plus one round of the other chunks).
    warmup = min(total, pp - rank - 1 if v == 1 else 2 * (pp - rank - 1) + (v - 1) * pp)
    order = [action("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [action("F", warmup + k), action("B", k)]
    return order + [action("B", k) for k in range(total - warmup, total)]


def zb_h1_order(pp: int, rank: int, m: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2024, drawn above): for x = 0, 1, ..., the triple
    F x, I x-(pp-1-rank), W x-(pp-1), each where its micro-batch exists. The
    I's lag 1F1B's backwards as much as 1F1B's; the W's lag the I's by
    `rank`, which fills the drain where 1F1B idles."""
    order = []
    for x in range(m + pp - 1):
        order += [Action(kind, 0, k) for kind, k in (("F", x), ("I", x - (pp - 1 - rank)), ("W", x - (pp - 1)))
                  if 0 <= k < m]
    return order


def check_micro_batches(m: int, pp: int, v: int) -> None:
    """A training step's m micro-batches must fill the pipeline (and, interleaved, go round in groups of pp)."""
    if m < pp:
        raise UsageError(f"{m} micro-batch(es) per step cannot fill {pp} pipeline stages: use "
                         f"--global-batch-size >= --micro-batch-size x data-parallel size x "
                         f"--pipeline-model-parallel-size")
    if v > 1 and m % pp:
        raise UsageError(f"the interleaved schedule sends micro-batches round in groups of "
                         f"--pipeline-model-parallel-size {pp}: {m} micro-batches per step is not "
                         f"a multiple; make --global-batch-size / (--micro-batch-size x "
                         f"data-parallel size) one")


# A backward costs about two forwards (the gradients w.r.t. inputs and weights
# are a matmul each), so the clock gives it two ticks (equal ticks would make
# neighbours wait on each other's backwards); zero bubble splits it in two.
DURATION = {"F": 1, "B": 2, "I": 1, "W": 1}


def pipeline_timeline(pp: int, m: int, v: int = 1, forward_only: bool = False,
                      zero_bubble: bool = False) -> list[list[Action | None]]:
    """Every rank's actions on a common clock: ticks[t][rank] is the action the
    rank starts at tick t, or None (busy with a backward, or idle: the
    bubble). An action starts at the first tick after the one that finished
    its input: the previous virtual stage's forward, or the next one's
    backward (the last's: its own forward). zero_bubble: ZB-H1's order, one
    model chunk a rank (config.validate_pipeline refuses interleaving it)."""
    if not forward_only:
        check_micro_batches(m, pp, v)
    orders = [rank_order(pp, r, m, v, forward_only, zero_bubble) for r in range(pp)]
    done: dict[tuple[str, int, int], int] = {}  # (kind, virtual stage, micro) -> tick it ends
    last = pp * v - 1
    ticks, position, free = [], [0] * pp, [0] * pp  # free: the first tick a rank is not busy
    while any(position[r] < len(orders[r]) for r in range(pp)):
        t, row = len(ticks), []
        for r in range(pp):
            a = orders[r][position[r]] if position[r] < len(orders[r]) and free[r] <= t else None
            needs = _input_of(a, a.chunk * pp + r, last) if a else None
            if a is None or (needs is not None and done.get(needs, t) >= t):
                row.append(None)
                continue
            done[(a.kind, a.chunk * pp + r, a.micro)] = t + DURATION[a.kind] - 1
            position[r], free[r] = position[r] + 1, t + DURATION[a.kind]
            row.append(a)
        if not any(row) and all(f <= t for f in free):
            raise RuntimeError(f"pipeline schedule stalls at tick {t}: {orders}")
        ticks.append(row)
    return ticks + [[None] * pp] * (max(free) - len(ticks))  # the last backwards' ends


def _input_of(a: Action, s: int, last: int) -> tuple[str, int, int] | None:
    """The (kind, virtual stage, micro-batch) of the action whose end gives
    action a, run by virtual stage s, its input (None: the first forward)."""
    if a.kind == "F":
        return ("F", s - 1, a.micro) if s > 0 else None
    if a.kind == "W":
        return ("I", s, a.micro)
    return (a.kind, s + 1, a.micro) if s < last else ("F", s, a.micro)


def _messages(a: Action | None, sender: int, pp: int, v: int):
    """(receiver, (kind, receiver's chunk, micro)) of what `sender`'s action a
    sends when it ends: F's output to the next virtual stage, B's (I's) input
    gradient to the previous one; W sends nothing."""
    if a is None or a.kind == "W":
        return None
    s = a.chunk * pp + sender + (1 if a.kind == "F" else -1)
    if not 0 <= s < pp * v:
        return None
    return s % pp, (a.kind, s // pp, a.micro)


# ----------------------------------------------------------------------------
# 3. Running a schedule

def run_pipeline(ticks: list[list[Action | None]], v: int, forward, shape: tuple, device,
                 dtype=torch.float32, timeline: list | None = None, after=None,
                 later: LaterWeightGrads | None = None) -> None:
    """This rank's part of `ticks`. forward(chunk, micro, x) runs a model chunk
    on x, the previous stage's output (None on the first virtual stage), and
    returns its output, on the last virtual stage the loss. A backward
    differentiates that output with the gradient the next stage sent back,
    and sends x's gradient on. timeline: gets (tick, action, start, end) of
    each action. after(action) runs as each action ends, before its tick's
    exchange. later: zero bubble's (section 3b), for the ticks' W."""
    rank, pp, group = parallel.layout.pp_rank, parallel.layout.pp_size, parallel.layout.pp_group
    ending = {(t + DURATION[a.kind] - 1, r): a for t, row in enumerate(ticks) for r, a in enumerate(row) if a}
    received: dict[tuple, torch.Tensor] = {}  # (kind, chunk, micro) -> from a neighbour
    in_flight: dict[tuple, tuple] = {}        # (chunk, micro) -> (input, output, dW store) until backward
    posted: dict[int, list] = {}              # tick -> receives posted before the action spanning it

    def receives(t: int) -> list:  # what the neighbours' actions ending at tick t send here
        ops = []
        for neighbour in {(rank - 1) % pp, (rank + 1) % pp} - {rank}:
            sent = _messages(ending.get((t, neighbour)), neighbour, pp, v)
            if sent is not None and sent[0] == rank:
                received[sent[1]] = buffer = torch.empty(shape, dtype=dtype, device=device)
                ops.append(dist.P2POp(dist.irecv, buffer, group=group, group_peer=neighbour))
        return ops

    for t, row in enumerate(ticks):
        a = row[rank]
        if a is not None:
            # A message due while this action runs (a backward spans two ticks) is received
            # into a buffer posted now, so its sender need not wait for the action to end.
            for due in range(t, t + DURATION[a.kind] - 1):
                posted[due] = (ops := receives(due)) and dist.batch_isend_irecv(ops)
            start = time.perf_counter()
            outgoing = _act(a, forward, received, in_flight, later)
            if timeline is not None:
                timeline.append((t, a, start, time.perf_counter()))
            if after is not None:
                after(a)
        ops = [] if t in posted else receives(t)
        sent = _messages(ending.get((t, rank)), rank, pp, v)
        if sent is not None:
            if outgoing.shape != shape or outgoing.dtype != dtype:
                raise RuntimeError(f"stage output {tuple(outgoing.shape)} {outgoing.dtype}, "
                                   f"expected {shape} {dtype}")
            ops.append(dist.P2POp(dist.isend, outgoing.contiguous(), group=group, group_peer=sent[0]))
        for work in (posted.pop(t, None) or []) + (dist.batch_isend_irecv(ops) if ops else []):
            work.wait()


def _act(a: Action, forward, received: dict, in_flight: dict,
         later: LaterWeightGrads | None = None) -> torch.Tensor | None:
    """Run action a; returns what it sends on (_messages). later (zero bubble):
    each micro-batch's linears leave their dW in a store of its own, which its
    I keeps and its W empties."""
    if a.kind == "W":
        weight_grads(in_flight.pop(("W", a.chunk, a.micro)))
        return None
    if a.kind == "F":
        x = received.pop(("F", a.chunk, a.micro), None)
        store = [] if later is not None and torch.is_grad_enabled() else None
        with later.deferring(store) if store is not None else contextlib.nullcontext():
            y = forward(a.chunk, a.micro, None if x is None else x.requires_grad_(torch.is_grad_enabled()))
        if torch.is_grad_enabled():
            in_flight[(a.chunk, a.micro)] = (x, y, store)
        return y.detach()
    x, y, store = in_flight.pop((a.chunk, a.micro))
    # (a recomputed forward leaves its dW as the first did)
    with later.deferring(store, backward=True) if store is not None else contextlib.nullcontext():
        torch.autograd.backward(y, received.pop((a.kind, a.chunk, a.micro), None))
    if store is not None:
        in_flight[("W", a.chunk, a.micro)] = store
    return x.grad if x is not None else None  # (the graph goes as x and y do, on return)


# ----------------------------------------------------------------------------
# 3b. Zero bubble's W: the blocks' weight gradients, computed later
# Inside a micro-batch's F and I the blocks' linear weights are frozen
# (requires_grad False): autograd computes every other gradient, but no dW
# and no AccumulateGrad node for them (one would run in I gradient-less, and
# GradientAverager's hooks count each). Each such GEMM y = X W^T + b leaves
# (W, dY, X) in the micro-batch's store; W computes dW = dY^T X from it. The
# GEMMs are found where they run, so the model and parallel.py carry nothing
# for it: a TorchFunctionMode sees each F.linear on a frozen weight; the
# sequence-parallel column GEMM, in its own autograd Function, skips a frozen
# weight's dW, and a forward hook keeps its tokens for I to gather again.
# Activation checkpointing recomputes them as it does any saved tensor.

class LaterWeightGrads(TorchFunctionMode):
    """A zero-bubble stage's block linears, whose dW waits for the schedule's W."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.blocks = list(model.blocks)
        linears = {name: m for name, m in model.blocks.named_modules()
                   if isinstance(m, (nn.Linear, parallel.ColumnParallelLinear, parallel.RowParallelLinear))}
        self.weights = {m.weight: f"blocks.{name}" for name, m in linears.items()}  # -> the layer's name
        # Only a column layer's SP GEMM runs inside its own Function; a row layer's F.linear
        # (its input whole, (B, T, in/tp)) is caught by the mode like any other.
        self.columns = [m for m in linears.values()
                        if isinstance(m, parallel.ColumnParallelLinear) and m.sequence_parallel]
        self.store = None   # the running micro-batch's, inside deferring()

    @contextlib.contextmanager
    def deferring(self, store: list, backward: bool = False):
        """A micro-batch's F, or (backward) its I: the blocks' dW go into
        `store`, their linear weights frozen for the whole action (undone on
        exit). In F the mode is on throughout. In I it cannot be: a mode is
        off while it handles a call, so it would take torch.autograd.backward
        itself and see nothing inside. But activation checkpointing re-runs
        each block's forward in I, whose F.linear calls must keep their
        operands as the first forward did: so in I each block's forward
        pre-hook turns the mode on and its forward hook off (early stop off:
        each recompute runs its whole block, for the hooks to pair)."""
        self.store = store
        hooks = [m.register_forward_hook(self._keep_tokens) for m in self.columns]
        if backward:
            for b in self.blocks:
                hooks += [b.register_forward_pre_hook(self._on), b.register_forward_hook(self._off)]
        for w in self.weights:
            w.requires_grad_(False)
        try:
            with contextlib.nullcontext() if backward else self, \
                    torch.utils.checkpoint.set_checkpoint_early_stop(False):
                yield
            if backward and {w for _, w, _, _ in store} != set(self.weights):  # a dW would be lost silently
                raise RuntimeError("zero bubble: a block linear's weight reached no F.linear in this "
                                   "micro-batch, so its gradient was never kept for W")
        finally:
            for w in self.weights:
                w.requires_grad_(True)
            for hook in hooks:
                hook.remove()
            self.store = None

    def _on(self, block, args) -> None:  # (a pre-hook's value would replace the block's input)
        self.__enter__()

    def _off(self, block, args, output) -> None:  # (a hook's value would replace its output)
        self.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and args[1] in self.weights and torch.is_grad_enabled():
            x, weight, bias = (*args, kwargs.get("bias"))[:3]
            x = parallel.in_autocast_dtype(x)    # keep the 16 bits autocast's F.linear keeps
            return _KeepOperands.apply(F.linear(x, weight, bias), x, weight, self.store, False, self.weights[weight])
        return func(*args, **kwargs)

    def _keep_tokens(self, column, args, y):
        """A sequence-parallel column layer's forward hook: its tokens kept."""
        if column.sequence_parallel and y.requires_grad:  # (not while generating, nor without grad)
            x = parallel.in_autocast_dtype(args[0])      # (B, T/tp, in), as the layer keeps them
            return _KeepOperands.apply(y, x, column.weight, self.store, True, self.weights[column.weight])


class _KeepOperands(torch.autograd.Function):
    """y = X W^T + b itself; backward passes dY on and leaves (name, W, dY, X)
    in `store` for W (gather: X is this rank's tokens, all-gathered now)."""

    @staticmethod
    def forward(ctx, y, x, weight, store: list, gather: bool, name: str):
        ctx.weight, ctx.store, ctx.gather, ctx.name = weight, store, gather, name
        ctx.save_for_backward(x)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad_out):
        x, = ctx.saved_tensors
        ctx.store.append((ctx.name, ctx.weight, grad_out, parallel.all_gather_sequence(x) if ctx.gather else x))
        return grad_out, None, None, None, None, None


def weight_grads(store: list) -> None:
    """W: every dW = dY^T X left in `store`, summed per weight (Domino's chunks
    use each twice), into .grad through autograd, so that the weights' hooks
    (data-parallel averaging) run as after a plain backward."""
    grads = {}
    with torch.no_grad():  # as in backward: X is an activation, and dW no node of any graph
        for name, weight, grad_out, x in store:
            if grad_out.shape[:-1] != x.shape[:-1] or (grad_out.shape[-1], x.shape[-1]) != weight.shape:
                raise RuntimeError(f"zero bubble: {name} kept dY {tuple(grad_out.shape)} and X {tuple(x.shape)}, "
                                   f"which do not make its weight's {tuple(weight.shape)} gradient dY^T X")
            g2d, x2d = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
            g = (g2d.t() @ x2d.to(grad_out.dtype)).to(weight.dtype)   # (out, in), in dY's dtype
            grads[weight] = grads[weight] + g if weight in grads else g
    store.clear()
    if grads:
        torch.autograd.backward(list(grads), list(grads.values()))


# ----------------------------------------------------------------------------
# 4. The pipelined step

def pipeline_step(stage: Stage, batches: list, cfg: TrainConfig, device, precision, scale=None,
                  averager: GradientAverager | None = None) -> torch.Tensor:
    """The micro-batches through this rank's `stage` (maybe compiled, under
    `precision`) in the schedule's order (1F1B, interleaved or ZB-H1), forwards
    and backwards; under torch.no_grad, forwards alone. The last stage
    differentiates each micro-batch's share of the loss, scaled by `scale`
    (--fp16's; None: as it is). Returns the mean loss, on every stage.
    averager: the GradientAverager that starts on gradients as they become
    final (None: the engine reduces after the step)."""
    model = stage.model
    m, v = len(batches), len(model.layers)
    ticks = pipeline_timeline(parallel.layout.pp_size, m, v, forward_only=not torch.is_grad_enabled(),
                              zero_bubble=cfg.enable_zero_bubble)
    batches = [to_device(b, device) for b in batches]
    total = torch.zeros((), device=device)

    def forward(chunk: int, micro: int, x):
        nonlocal total
        with precision:
            out = stage(chunk, batches[micro], x)
        if model.layers[chunk].stop < model.config.num_layers:  # not the last layer's chunk
            return out                                               # (B, T[/tp], C) to the next stage
        loss = weighted_loss(out, batches[micro]) / m
        total += loss.detach()
        return scale(loss) if scale and torch.is_grad_enabled() else loss

    tokens = cfg.seq_length // parallel.layout.cp_size  # this rank's share (context.py) ...
    tokens //= parallel.layout.tp_size if model.sequence_parallel else 1  # ... of which SP keeps 1/tp
    # The residual stream's dtype: the weights' (fp32 under autocast; DeepSpeed's 16-bit modules are 16-bit)
    dtype = next(model.parameters()).dtype

    def after(a: Action) -> None:  # a backward (I, W) ended: launch the final gradients a partial bucket holds
        if averager is not None and a.kind != "F":
            averager.flush()
    later = LaterWeightGrads(model) if cfg.enable_zero_bubble else None
    run_pipeline(ticks, v, forward, (cfg.micro_batch_size, tokens, model.config.hidden_size), device,
                 dtype, after=after, later=later)
    dist.all_reduce(total, group=parallel.layout.pp_group)  # zero but on the last stage
    return total


def reduce_pipeline_grads(model: GPT, averager: GradientAverager | None = None) -> None:
    """After the schedule: average the gradients over DP x CP (DDP's job at
    pp = 1; with an averager, land the all-reduces pipeline_step started), then
    sum the tied embedding's over its two stages, so both copies take the same
    step (Megatron's embedding all-reduce)."""
    if averager is not None:
        averager.wait()
    elif parallel.layout.dp_cp_size > 1:
        average([p.grad for p in model.parameters() if p.grad is not None], parallel.layout.dp_cp_group)()
    tied = tied_embedding_copy(model)
    if tied is not None:
        dist.all_reduce(tied.grad, group=parallel.layout.embedding_group)


# ----------------------------------------------------------------------------
# 5. The gradient reductions stages need

def average(grads: list[torch.Tensor], group):
    """Start averaging `grads` over `group` in one flat buffer (one all-reduce
    for many small tensors). Returns land(), which writes the averages back."""
    flat = torch.cat([g.flatten().float() for g in grads])
    work = dist.all_reduce(flat, group=group, async_op=True)

    def land() -> None:
        work.wait()
        flat.div_(dist.get_world_size(group))
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))
    return land


class GradientAverager:
    """Averages a stage's gradients over its data-parallel group while the
    schedule still runs (DDP's reducer cannot: it expects each forward's
    backward before the next forward, and 1F1B keeps several in flight).

    A parameter's gradient is final once the step's last micro-batch has been
    through its backward (a hook counts). Final gradients gather in a bucket
    (DDP's 25 MB), all-reduced when it fills, during the rest of that backward
    (Megatron's --overlap-grad-reduce); flush() launches a partial bucket as
    each backward ends. In 1F1B's drain the last stage ends first, and its
    all-reduces run while stage 0 drains. wait() lands them all."""

    def __init__(self, model: nn.Module, group, bucket_bytes: int = 25 * 2**20):
        self.group, self.bucket_bytes = group, bucket_bytes
        self.bucket, self.pending, self.accumulated, self.micro_batches = [], [], {}, 0
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._accumulated)

    def begin(self, micro_batches: int) -> None:
        """A step of `micro_batches` backwards starts (until then, and after wait(), the hooks do nothing)."""
        self.accumulated, self.micro_batches = {}, micro_batches

    def _accumulated(self, p: nn.Parameter) -> None:
        self.accumulated[p] = n = self.accumulated.get(p, 0) + 1
        if n == self.micro_batches:  # final: into the bucket
            self.bucket.append(p)
            if sum(q.grad.numel() * 4 for q in self.bucket) >= self.bucket_bytes:  # fp32 bytes
                self.flush()

    def flush(self) -> None:
        """Launch the bucket's all-reduce, if it holds any gradient."""
        if self.bucket:
            self.pending.append(average([p.grad for p in self.bucket], self.group))
            self.bucket = []

    def wait(self) -> None:
        # a parameter some micro-batches left out is averaged here
        self.bucket += [p for p, n in self.accumulated.items() if n < self.micro_batches]
        self.flush()
        self.micro_batches = 0
        for land in self.pending:
            land()
        self.pending = []
