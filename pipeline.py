"""Pipeline parallelism, in sections: 1. the stages; 2. the schedules, 1F1B and
interleaved, on one clock and drawn (chart); 3. run_pipeline, and 3b. zero bubble
(ZB-H1); 4. the pipelined step; 5. the stages' gradient reductions; 6. the checks."""
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
from gpt import GPT, GPTConfig, moe_layers, rope_angles, set_aux_loss_scale, weighted_loss
from launch import UsageError

# The layers are split into pp stages, one per pipeline rank (GPipe, Huang et al. 2019;
# Megatron-LM, Narayanan et al. 2021): stage 0 holds the embedding, the last the final
# norm, the head and the loss. A stage sends its output (B, T[/tp], C) to the next and,
# in backward, the gradient w.r.t. its input to the previous; the batch is cut into m
# micro-batches to keep every stage busy. 1F1B (PipeDream-flush), pp=4, m=8, drawn by
# chart(pipeline_timeline(4, 8)): a forward (digit: micro-batch) takes a tick, a backward two:
#
#     stage 0  0123......aa4bb5cc6dd7ee.ff.gg.hh
#     stage 1  .012....aa3bb4cc5dd6ee7ff.gg.hh..
#     stage 2  ..01..aa2bb3cc4dd5ee6ff7gg.hh....
#     stage 3  ...0aa1bb2cc3dd4ee5ff6gg7hh......
#
# Stage s warms up with pp-1-s forwards, alternates a forward and a backward
# (the steady state), then cools down with the last backwards: it holds at most
# pp-s micro-batches' activations (GPipe, all forwards first: m). The idle
# ticks ('.', the bubble) are (pp-1)/(m+pp-1) of the step (here 9 of 33).
#
# Interleaved 1F1B (--num-layers-per-virtual-pipeline-stage): rank r holds v
# model chunks, chunk c being virtual stage c*pp + r, and a micro-batch goes
# round the ranks v times (pp=2, v=2, m=4: stages 0 and 2 are rank 0's):
#
#     stage 0  01..2...3...aa.bb......ccdd
#     stage 1  .01......2aa3bb......ccdd..
#     stage 2  ..01..aa.bb2..3...cc.dd....
#     stage 3  ...0aa1bb......2cc3dd......
#
# A tick is 1/v as long, the bubble (pp-1)/(v*m+pp-1) (here 3 of 27): about v
# times smaller, for v times the messages. ZB-H1 (3b) fills 1F1B's cool-down.


# ----------------------------------------------------------------------------
# 1. Stages

def pipeline_chunks(num_layers: int, pp: int, rank: int, layers_per_virtual_stage: int | None = None) -> list[range]:
    """The layers of each model chunk of pipeline rank `rank`: one chunk of
    num_layers/pp layers, or num_layers/(pp*n) chunks of n = layers_per_virtual_stage."""
    n = layers_per_virtual_stage or num_layers // pp
    check_layers(num_layers, pp, n, layers_per_virtual_stage)
    return [range((c * pp + rank) * n, (c * pp + rank + 1) * n) for c in range(num_layers // (pp * n))]


def stage_model(config: GPTConfig, chunks: list[range]) -> GPT:
    """The stage of layers `chunks`: the whole model built and initialized as on one device (GPT),
    keeping their blocks and its `ends` (embeddings, final norm, head; tied: a wte copy, pipeline_copy)."""
    first, last = chunks[0].start == 0, chunks[-1].stop == config.num_layers
    tied = not config.untie_embeddings_and_output_weights
    ends = {"wte": first or (last and tied), "wpe": first, "ln_f": last, "output_layer": last}

    def keep(piece: str) -> bool:  # a piece of the whole model, as GPT._pieces names it
        kind, _, layer = piece.partition(".")
        return any(int(layer) in chunk for chunk in chunks) if kind == "blocks" else ends[kind]
    model = GPT(config, keep)
    parallel.mark(model, pipeline_chunks=chunks)  # the chunks Stage runs
    if hasattr(model, "wte") and not first:
        parallel.mark(model.wte.weight, pipeline_copy=True)
    return model


class Stage(nn.Module):
    """stage_model's `model` (or a whole GPT: one chunk) a chunk at a time, from the model's
    own pieces: chunk `chunk` embeds `batch`'s tokens or runs on x, the previous stage's output,
    and returns its output or, with the last layer, the loss (torch.compile compiles a chunk whole)."""

    def __init__(self, model: GPT):
        super().__init__()
        self.model = model
        self.chunks = getattr(model, "pipeline_chunks", None) or [range(model.config.num_layers)]

    def forward(self, chunk: int, batch: dict, x=None):
        model, layers = self.model, self.chunks[chunk]
        if layers.start == 0:
            x, rope = model.embed(batch["tokens"], batch["position_ids"])  # (B, T[/tp], C)
        else:  # RoPE's angles, as embed gives them
            rope = rope_angles(model.config, batch["position_ids"]) \
                if model.config.position_embedding_type == "rope" else None
        # every chunk holds n layers, in model.blocks in layer order; a slice of the list, as a
        # slice of the ModuleList would build a new module every forward (0.2 ms at 48)
        n = len(layers)
        x = model.run_blocks(x, rope, list(model.blocks)[chunk * n:(chunk + 1) * n], batch.get("document_ids"))
        return x if layers.stop < model.config.num_layers else model.head(x, batch["labels"], batch["loss_mask"])


# ----------------------------------------------------------------------------
# 2. The schedules

class Action(NamedTuple):
    kind: str    # "F" forward, "B" backward; zero bubble: "I" input gradient, "W" weight gradients
    chunk: int   # which of this rank's model chunks (0 unless interleaved)
    micro: int   # which micro-batch


def rank_order(pp: int, rank: int, m: int, v: int = 1, forward_only: bool = False) -> list[Action]:
    """One rank's actions, in Megatron's order. The k-th of its m*v forwards runs chunk
    (k mod pp*v) // pp: micro-batches go through the chunks in groups of pp (backwards in reverse)."""
    def action(kind: str, k: int) -> Action:
        chunk = k % (pp * v) // pp
        return Action(kind, v - 1 - chunk if kind == "B" else chunk, k // (pp * v) * pp + k % pp)
    total = m * v
    if forward_only:
        return [action("F", k) for k in range(total)]
    # Warm-up: forwards enough to fill the pipe below this rank (interleaved:
    # twice that, plus one round of the other chunks); steady state; cool-down.
    warmup = min(total, pp - rank - 1 if v == 1 else 2 * (pp - rank - 1) + (v - 1) * pp)
    order = [action("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [action("F", warmup + k), action("B", k)]
    return order + [action("B", k) for k in range(total - warmup, total)]


# A backward is two matmuls (dX, dW) to a forward's one, so it takes two ticks
# (with one, neighbours would wait on each other's backwards); ZB-H1's I and W one.
DURATION = {"F": 1, "B": 2, "I": 1, "W": 1}


def pipeline_timeline(pp: int, m: int, v: int = 1, forward_only: bool = False,
                      zero_bubble: bool = False) -> list[list[Action | None]]:
    """Every rank's actions (rank_order's; zero_bubble: zb_h1_order's) on one clock: ticks[t][rank]
    is the action the rank starts at tick t, or None (busy, or idle: the bubble). An action taking a
    message (_messages, as run_pipeline exchanges them) starts after the tick its sender ends."""
    if not forward_only:
        check_micro_batches(m, pp, v)
    orders = [zb_h1_order(pp, r, m) if zero_bubble and not forward_only else rank_order(pp, r, m, v, forward_only)
              for r in range(pp)]
    inputs = {_messages(a, r, pp, v) for r in range(pp) for a in orders[r]} - {None}  # (receiver, its action)
    sent: dict[tuple, int] = {}  # a message -> the tick its sender ends
    ticks, position, free = [], [0] * pp, [0] * pp  # free: the first tick a rank is not busy
    while any(position[r] < len(orders[r]) for r in range(pp)):
        t, row = len(ticks), []
        for r in range(pp):
            a = orders[r][position[r]] if position[r] < len(orders[r]) and free[r] <= t else None
            if a is not None and (r, a) in inputs and sent.get((r, a), t) >= t:
                a = None  # its input has not come
            if a is not None:
                sent[_messages(a, r, pp, v)] = t + DURATION[a.kind] - 1
                position[r], free[r] = position[r] + 1, t + DURATION[a.kind]
            row.append(a)
        if not any(row) and all(f <= t for f in free):
            raise RuntimeError(f"pipeline schedule stalls at tick {t}: {orders}")
        ticks.append(row)
    return ticks + [[None] * pp] * (max(free) - len(ticks))  # the last backwards' ends


def _messages(a: Action | None, sender: int, pp: int, v: int):
    """(receiver, (kind, receiver's chunk, micro)) of what `sender`'s action a sends as it
    ends: F's output to the next virtual stage, B's (I's) input gradient to the previous."""
    if a is None or a.kind == "W":
        return None
    s = a.chunk * pp + sender + (1 if a.kind == "F" else -1)  # the virtual stage it goes to
    return (s % pp, (a.kind, s // pp, a.micro)) if 0 <= s < pp * v else None


def chart(ticks: list[list[Action | None]]) -> str:
    """`ticks` drawn as above: a row per (virtual) stage, a column per tick; a forward its micro-batch's
    digit (m <= 10), a backward its letter (a = 0) over two ticks, ZB-H1's I and W lower- and upper-case."""
    pp, v = len(ticks[0]), 1 + max(a.chunk for row in ticks for a in row if a)
    rows = [["."] * len(ticks) for _ in range(pp * v)]
    for t, row in enumerate(ticks):
        for r, a in enumerate(row):
            if a is not None:
                glyph = str(a.micro) if a.kind == "F" else chr(ord("A" if a.kind == "W" else "a") + a.micro)
                rows[a.chunk * pp + r][t:t + DURATION[a.kind]] = glyph * DURATION[a.kind]
    return "\n".join(f"stage {s}  {''.join(row)}" for s, row in enumerate(rows))


# ----------------------------------------------------------------------------
# 3. Running a schedule

def run_pipeline(ticks: list[list[Action | None]], v: int, forward, shape: tuple, device,
                 dtype=torch.float32, timeline: list | None = None, after=None, act=None) -> None:
    """This rank's part of `ticks` (pipeline_timeline's), tick by tick:

        for each tick t:
            if this rank starts an action a at t:
                post the receives due while a runs    (unblock_senders_during)
                run a                                 (act: _act's F or B; 3b's F, I or W)
            send what this rank's action ending at t made, and receive
            what its neighbours' actions ending at t made    (exchange)

    forward(chunk, micro, x) runs a model chunk on x (None on the first virtual stage): its output,
    on the last the loss. timeline gets each action's (tick, action, start, end); after(action) as it ends."""
    rank, pp, group = parallel.layout.pp_rank, parallel.layout.pp_size, parallel.layout.pp_group
    ending = {(t + DURATION[a.kind] - 1, r): a for t, row in enumerate(ticks) for r, a in enumerate(row) if a}
    received: dict[tuple, torch.Tensor] = {}  # (kind, chunk, micro) -> from a neighbour
    in_flight: dict[tuple, tuple] = {}        # (chunk, micro) -> (input, output) until its backward
    posted: dict[int, list] = {}              # tick -> its receives, posted before an action spanning it

    def receives(t: int) -> list:  # what the neighbours' actions ending at tick t send here
        ops = []
        for neighbour in {(rank - 1) % pp, (rank + 1) % pp} - {rank}:
            sent = _messages(ending.get((t, neighbour)), neighbour, pp, v)
            if sent is not None and sent[0] == rank:
                received[sent[1]] = buffer = torch.empty(shape, dtype=dtype, device=device)
                ops.append(dist.P2POp(dist.irecv, buffer, group=group, group_peer=neighbour))
        return ops

    def unblock_senders_during(a: Action, t: int) -> None:
        """A message due while a runs (a backward spans two ticks) is received
        into a buffer posted now, so that its sender need not wait for a to end."""
        for due in range(t, t + DURATION[a.kind] - 1):
            posted[due] = (ops := receives(due)) and dist.batch_isend_irecv(ops)

    def exchange(t: int, output: torch.Tensor | None) -> None:
        """One batch_isend_irecv in which both sides post each message: nothing
        waits on one posted later (NCCL would deadlock)."""
        ops = [] if t in posted else receives(t)
        sent = _messages(ending.get((t, rank)), rank, pp, v)
        if sent is not None:
            ops.append(dist.P2POp(dist.isend, checked_output(output, shape, dtype), group=group, group_peer=sent[0]))
        for work in (posted.pop(t, None) or []) + (dist.batch_isend_irecv(ops) if ops else []):
            work.wait()

    output = None
    for t, row in enumerate(ticks):
        a = row[rank]
        if a is not None:
            unblock_senders_during(a, t)
            start = time.perf_counter()
            output = (act or _act)(a, forward, received, in_flight)
            if timeline is not None:
                timeline.append((t, a, start, time.perf_counter()))
            if after is not None:
                after(a)
        exchange(t, output)


def _act(a: Action, forward, received: dict, in_flight: dict) -> torch.Tensor | None:
    """Run action a, F or B; returns what it sends on (_messages)."""
    if a.kind == "F":
        x = received.pop(("F", a.chunk, a.micro), None)
        y = forward(a.chunk, a.micro, None if x is None else x.requires_grad_(torch.is_grad_enabled()))
        if torch.is_grad_enabled():
            in_flight[(a.chunk, a.micro)] = (x, y)
        return y.detach()
    x, y = in_flight.pop((a.chunk, a.micro))
    torch.autograd.backward(y, received.pop((a.kind, a.chunk, a.micro), None))
    return x.grad if x is not None else None  # (the graph goes as x and y do, on return)


# ----------------------------------------------------------------------------
# 3b. Zero bubble (ZB-H1): the weight gradients later
#
# Qi et al. ("Zero Bubble Pipeline Parallelism", ICLR 2024) split B in two:
#
#     I  (the input gradient)  a linear y = X W^T + b stores (X, dY), not dW
#     W  (any tick later)      dW = dY^T X
#
# The previous stage waits for I, nothing for W. ZB-H1 (--enable-zero-bubble) keeps 1F1B's F's
# and I's, and stage s runs each W s micro-batches after its I, in 1F1B's cool-down, holding s
# micro-batches' (X, dY); the model carries nothing for it (pp=4, m=8: 3 idle ticks of 27, not 9 of 33):
#
#     stage 0  0123...aA4bB5cC6dD7eEfFgGhH
#     stage 1  .012..a3bA4cB5dC6eD7fEgFhGH
#     stage 2  ..01.a2b3cA4dB5eC6fD7gEhFGH
#     stage 3  ...0a1b2c3dA4eB5fC6gD7hEFGH

def zb_h1_order(pp: int, rank: int, m: int) -> list[Action]:
    """ZB-H1's: for x = 0, 1, ..., F x, I x-(pp-1-rank) and W x-(pp-1), where they exist."""
    return [Action(kind, 0, k) for x in range(m + pp - 1)
            for kind, k in (("F", x), ("I", x - (pp - 1 - rank)), ("W", x - (pp - 1))) if 0 <= k < m]


class LaterWeightGrads(TorchFunctionMode):
    """A stage's block linears, whose dW waits for W: frozen in F and I, so that
    autograd computes all other gradients, while this mode (on in F) makes each
    F.linear on a frozen weight keep (X, dY) in the micro-batch's store."""

    def __init__(self, model: nn.Module):
        super().__init__()
        linears = {name: m for name, m in model.blocks.named_modules()
                   if isinstance(m, (nn.Linear, parallel.ColumnParallelLinear, parallel.RowParallelLinear))}
        self.weights = {m.weight: f"blocks.{name}" for name, m in linears.items()}  # -> the layer's name
        self.sp_columns = [m for m in linears.values()  # (a row layer's SP F.linear is the mode's)
                           if isinstance(m, parallel.ColumnParallelLinear) and m.sequence_parallel]
        self.recomputed = list(model.blocks) if model.config.activation_checkpointing else []
        self.stores, self.store = {}, None  # (chunk, micro) -> [(name, W, dY, X)]; the running one's

    def act(self, a: Action, *args) -> torch.Tensor | None:
        """run_pipeline's act: W, or _act's F and B (as I), deferring."""
        if a.kind == "W":
            return weight_grads(self.stores.pop((a.chunk, a.micro)))
        with self.deferring(self.stores.setdefault((a.chunk, a.micro), []), backward=a.kind == "I"):
            return _act(a, *args)

    @contextlib.contextmanager
    def deferring(self, store: list, backward: bool = False):
        """A micro-batch's F, or (backward) its I, keeping (X, dY) in `store`."""
        self.store = store
        with contextlib.ExitStack() as undo:
            for w in self.weights:  # every run: frozen (no dW, nor an AccumulateGrad node for hooks to count)
                w.requires_grad_(False)
                undo.callback(w.requires_grad_, True)
            for m in self.sp_columns:  # sequence parallelism's
                undo.callback(m.register_forward_hook(self._keep_tokens).remove)
            if self.recomputed:  # activation checkpointing's
                self._for_recomputation(undo, backward)
            undo.enter_context(contextlib.nullcontext() if backward else self)
            yield
        if backward:
            check_every_dw_kept(store, self.weights)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and args[1] in self.weights and torch.is_grad_enabled():
            x, weight, bias = (*args, kwargs.get("bias"))[:3]
            x = parallel.in_autocast_dtype(x)    # keep the 16 bits autocast's F.linear keeps
            return _KeepOperands.apply(F.linear(x, weight, bias), x, weight, self.store, False, self.weights[weight])
        return func(*args, **kwargs)

    def _keep_tokens(self, column, args, y):
        """SP's: a column layer's GEMM runs in its own Function, out of the mode's sight: keep its tokens here."""
        if column.sequence_parallel and y.requires_grad:  # (not while generating, nor without grad)
            x = parallel.in_autocast_dtype(args[0])      # (B, T/tp, in), as the layer keeps them
            return _KeepOperands.apply(y, x, column.weight, self.store, True, self.weights[column.weight])

    def _for_recomputation(self, undo: contextlib.ExitStack, backward: bool) -> None:
        """I re-runs each block's forward, whose F.linear calls must keep what
        F's kept, but the mode is off through I (a mode is off while it handles
        a call: torch.autograd.backward). So in I each block turns it on and
        off, and in F early stop is off: each recompute runs its whole block."""
        undo.enter_context(torch.utils.checkpoint.set_checkpoint_early_stop(False))
        for b in self.recomputed if backward else []:  # (a hook's value would replace the block's input, output)
            undo.callback(b.register_forward_pre_hook(lambda *_: self.__enter__() and None).remove)
            undo.callback(b.register_forward_hook(lambda *_: self.__exit__(None, None, None)).remove)


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
    """W: every dW = dY^T X in `store`, summed per weight (Domino's chunks use
    each twice), into .grad through autograd: the weights' hooks (data-parallel
    averaging) run as after a plain backward."""
    grads = {}
    with torch.no_grad():  # as in backward: X is an activation, and dW no node of any graph
        for name, weight, grad_out, x in store:
            check_operands(name, weight, grad_out, x)
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
    `precision`) in the schedule's order, forwards and backwards (under no_grad,
    forwards); the last stage differentiates each one's share of the loss, scaled
    by `scale` (--fp16's). Returns the mean loss, on every stage. averager: starts
    on gradients as they become final (None: the engine reduces after the step)."""
    model, m, v = stage.model, len(batches), len(stage.chunks)
    ticks = pipeline_timeline(parallel.layout.pp_size, m, v, forward_only=not torch.is_grad_enabled(),
                              zero_bubble=cfg.enable_zero_bubble)
    batches = [to_device(b, device) for b in batches]
    total = torch.zeros((), device=device)
    moe = list(moe_layers(model).values()) if torch.is_grad_enabled() else []

    def forward(chunk: int, micro: int, x):
        if moe:  # their auxiliary losses' gradients: this micro-batch's share of the loss
            set_aux_loss_scale(moe, batches[micro], m, scale)
        with precision:
            out = stage(chunk, batches[micro], x)
        if stage.chunks[chunk].stop < model.config.num_layers:  # not the last layer's chunk
            return out                                               # (B, T[/tp], C) to the next stage
        loss = weighted_loss(out, batches[micro]) / m
        total.add_(loss.detach())
        return scale(loss) if scale and torch.is_grad_enabled() else loss

    tokens = cfg.seq_length // parallel.layout.cp_size  # this rank's share (context.py) ...
    tokens //= parallel.layout.tp_size if model.sequence_parallel else 1  # ... of which SP keeps 1/tp
    dtype = next(model.parameters()).dtype  # the residual stream's: fp32 under autocast, DeepSpeed's bf16/fp16
    zero_bubble = LaterWeightGrads(model) if cfg.enable_zero_bubble and torch.is_grad_enabled() else None
    run_pipeline(ticks, v, forward, (cfg.micro_batch_size, tokens, model.config.hidden_size), device,
                 dtype, after=averager and averager.after, act=zero_bubble and zero_bubble.act)
    dist.all_reduce(total, group=parallel.layout.pp_group)  # zero but on the last stage
    return total


# ----------------------------------------------------------------------------
# 5. The gradient reductions stages need

def reduce_pipeline_grads(model: GPT, averager: GradientAverager | None = None) -> None:
    """After the schedule: average the gradients over DP x CP, but the experts' (DDP's job at
    pp = 1; with an averager, land the all-reduces pipeline_step started), then sum the tied
    embedding's over its two stages, so both copies take the same step (Megatron's embedding all-reduce)."""
    if averager is not None:
        averager.wait()
    elif parallel.layout.dp_cp_size > 1:
        average([p.grad for p in averaged(model) if p.grad is not None], parallel.layout.dp_cp_group)()
    tied = tied_embedding_copy(model)
    if tied is not None:
        dist.all_reduce(tied.grad, group=parallel.layout.embedding_group)


def averaged(model: nn.Module) -> list[nn.Parameter]:
    """The parameters whose gradients are averaged over DP x CP here: not the
    experts' where EP ranks hold different ones (expert_parallel.reduce_expert_grads)."""
    return [p for p in model.parameters() if p.requires_grad and not parallel.averaged_apart(p)]


def tied_embedding_copy(model: GPT) -> nn.Parameter | None:
    """Where a tied embedding is split over two pipeline stages (the first's embedding, the
    last's head) and this stage holds one copy: its weight, whose gradient they sum; else None."""
    tied = not model.config.untie_embeddings_and_output_weights
    return model.wte.weight if tied and parallel.layout.pp_size > 1 and hasattr(model, "wte") else None


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
    """Averages a stage's gradients over its data-parallel group while the schedule
    still runs (DDP's reducer cannot: it expects each forward's backward before the
    next forward, and 1F1B keeps several in flight). A gradient is final once the
    step's last micro-batch has been through its backward (a hook counts); final ones
    gather in a bucket (DDP's 25 MB), all-reduced when it fills, during the rest of that
    backward (Megatron's --overlap-grad-reduce; docs/pipeline.md); flush() launches a
    partial bucket as each backward ends, wait() lands them all."""

    def __init__(self, model: nn.Module, group, bucket_bytes: int = 25 * 2**20):
        self.group, self.bucket_bytes = group, bucket_bytes
        self.bucket, self.pending, self.accumulated, self.micro_batches = [], [], {}, 0
        for p in averaged(model):
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

    def after(self, a: Action) -> None:
        """run_pipeline's after: a backward (B, I, W) ended; launch the final gradients a partial bucket holds."""
        if a.kind != "F":
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


# ----------------------------------------------------------------------------
# 6. The checks

def check_layers(num_layers: int, pp: int, n: int, layers_per_virtual_stage: int | None) -> None:
    """The layers must divide into pp stages (of chunks of n layers)."""
    if num_layers % pp:
        raise UsageError(f"--pipeline-model-parallel-size {pp} must divide --num-layers {num_layers} "
                         f"(each stage holds as many layers)")
    if num_layers % (pp * n):
        raise UsageError(f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage} x "
                         f"--pipeline-model-parallel-size {pp} must divide --num-layers {num_layers}")


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


def checked_output(output: torch.Tensor, shape: tuple, dtype) -> torch.Tensor:
    """A stage's output, as the next stage's receive buffer expects it."""
    if output.shape != shape or output.dtype != dtype:
        raise RuntimeError(f"stage output {tuple(output.shape)} {output.dtype}, expected {shape} {dtype}")
    return output.contiguous()


def check_every_dw_kept(store: list, weights: dict) -> None:
    """After a zero-bubble I: every block linear's (X, dY) is in `store` (else a dW would be lost silently)."""
    if {w for _, w, _, _ in store} != set(weights):
        raise RuntimeError("zero bubble: a block linear's weight reached no F.linear in this "
                           "micro-batch, so its gradient was never kept for W")


def check_operands(name: str, weight: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor) -> None:
    """A zero-bubble W's kept dY and X must make `weight`'s gradient dY^T X."""
    if grad_out.shape[:-1] != x.shape[:-1] or (grad_out.shape[-1], x.shape[-1]) != weight.shape:
        raise RuntimeError(f"zero bubble: {name} kept dY {tuple(grad_out.shape)} and X {tuple(x.shape)}, "
                           f"which do not make its weight's {tuple(weight.shape)} gradient dY^T X")
