"""Pipeline parallelism: the bubble and the activation memory of 1F1B,
interleaved 1F1B and zero bubble (ZB-H1), measured beside their formulas.

One training step (forwards and backwards of m micro-batches, no optimizer)
of a small GPT split into P stages, one per rank, through train.py's path:
pipeline.pipeline_timeline places the actions on a tick clock and
pipeline.run_pipeline runs them, recording each action's wall-clock start
and end. Three schedules:

    1F1B           v = 1 model chunk per rank
    interleaved    v = 2 chunks per rank (--num-layers-per-virtual-pipeline-stage
                   = num_layers / (2P)): a micro-batch goes round the ranks twice
    ZB-H1          v = 1, each backward split into I (input gradient) and W
                   (weight gradients), W deferred (--enable-zero-bubble)

Bubble (the fraction of the step a rank sits idle), four ways:

    measured   1 - (rank's busy time) / (step time), the step from the first
               action's start to the last action's end over all ranks
               (timelines gathered to rank 0; clocks aligned by a barrier)
    replayed   the same with messages free: the measured action times run
               through run_pipeline's tick-by-tick coupling (see replay)
    ticks      idle ticks / total ticks of pipeline_timeline: the schedule's own,
               a forward one tick long, a backward two (ZB-H1: I one, W one)
    formula    (P-1)/(m+P-1) for 1F1B, (P-1)/(v*m+P-1) interleaved (Narayanan
               et al., "Efficient Large-Scale Language Model Training on GPU
               Clusters Using Megatron-LM", 2021), (P-1)/(3m+P-1) ZB-H1 (Qi et
               al., "Zero Bubble Pipeline Parallelism", 2024, with F = I = W)

Activation memory per stage, in an extra untimed step: a saved-tensor hook
counts the bytes autograd keeps for backward (each storage once, parameters
excluded) and which micro-batches they belong to; each packed tensor rides in
a holder whose deletion (autograd frees it in the backward) takes its bytes
off again. Peaks per rank: bytes, and micro-batches in flight (interleaved:
(chunk, micro-batch) pairs / v). Formula: 1F1B stage s holds at most P-s
micro-batches (GPipe, all forwards first, would hold m); interleaved rank r
holds (2(P-r-1) + (v-1)P + 1)/v, i.e. P + (P-1)/v on stage 0. ZB-H1 holds
1F1B's saved activations, and beyond them the inputs its deferred W's need
(each linear's X and dY, kept from I to W: s micro-batches' on stage s);
"+ W inputs" is the peak of both together (the storages the micro-batches'
weight-gradient stores hold, counted at each action's end).

The schedules are timed round-robin (1F1B, interleaved, ZB-H1, 1F1B, ...) after
warm-up steps; each figure is the median over iterations. Rank 0 prints one
markdown table.

    CPU (gloo):  OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/bench_pipeline.py
                 OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 bench/bench_pipeline.py
                 ... --smoke            (a seconds-long check)
                 (P ranks on fewer cores share them: busy times then include waiting for a core)
    GPU (nccl):  torchrun --nproc_per_node 8 bench/bench_pipeline.py --num-layers 32 \\
                     --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \\
                     --micro-batch-size 2 --micro-batches 32 --padded-vocab-size 50304
                 (the host waits for the GPU around every action: see host_waits_for_device;
                 not yet run on a GPU)
"""
import argparse
import collections
import contextlib
import os
import statistics
import sys
import time
from fractions import Fraction
from typing import NamedTuple
from unittest import mock

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import launch  # noqa: E402
import parallel  # noqa: E402
import pipeline  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402


class Schedule(NamedTuple):
    v: int              # model chunks per rank
    zero_bubble: bool   # ZB-H1's split backward


SCHEDULES = {"1F1B": Schedule(1, False), "interleaved v=2": Schedule(2, False), "ZB-H1": Schedule(1, True)}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-layers", type=int, default=8, help="divisible by 2P (interleaved, v=2)")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--padded-vocab-size", type=int, default=512,
                   help="small keeps the last stage's LM head from outweighing the other stages")
    p.add_argument("--micro-batches", type=int, default=8, help="m; a multiple of P (interleaved)")
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="a tiny model, 1 warm-up, 2 iterations")
    args = p.parse_args()
    if args.smoke:
        args.hidden_size, args.seq_length, args.micro_batch_size = 64, 32, 1
        args.iters, args.warmup = 2, 1
    return args


def setup():
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. "
                         "torchrun --nproc_per_node 2 bench/bench_pipeline.py")
    if not torch.cuda.is_available():
        # Ranks share the CPU: one compute thread each (more would fight over the cores).
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ["LOCAL_WORLD_SIZE"])))
    d = launch.init_distributed()
    parallel.initialize(1, d.timeout, int(os.environ["WORLD_SIZE"]))  # every rank a stage
    return d.device


def build(args, device, v: int) -> GPT:
    """This rank's stage with v model chunks; the same weights for every v."""
    config = GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads,
                       max_position_embeddings=args.seq_length,
                       vocab_size=args.padded_vocab_size, padded_vocab_size=args.padded_vocab_size)
    pp = parallel.layout.pp_size
    torch.manual_seed(0)
    chunks = pipeline.pipeline_chunks(args.num_layers, pp, parallel.layout.pp_rank,
                                      args.num_layers // (pp * v))
    return pipeline.stage_model(config, chunks).to(device)


class SavedActivations:
    """What autograd keeps for backward on this rank, live: install with
    torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack). Each
    storage is counted once (q, k, v are views of one qkv output), parameters
    not at all. `current` names the (chunk, micro) whose forward runs."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages = {}                        # data_ptr -> [bytes, holders alive]
        self.owners = collections.Counter()       # (chunk, micro) -> holders alive
        self.first_bytes = collections.Counter()  # (chunk, micro) -> bytes it added
        self.live = self.peak_bytes = self.peak_in_flight = self.peak_with_w = 0
        self.current = None
        self.stores = []                          # ZB-H1: every micro-batch's weight-gradient store

    class Holder:
        """A packed tensor; autograd drops it once the backward has used it."""

        def __init__(self, tracker, tensor, ptr, owner):
            self.tracker, self.tensor, self.ptr, self.owner = tracker, tensor, ptr, owner

        def __del__(self):
            self.tracker.release(self.ptr, self.owner)

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.params:
            return t
        entry = self.storages.setdefault(ptr, [t.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.live += entry[0]
            self.first_bytes[self.current] += entry[0]
        entry[1] += 1
        self.owners[self.current] += 1
        self.peak_bytes = max(self.peak_bytes, self.live)
        self.peak_in_flight = max(self.peak_in_flight, len(self.owners))
        return self.Holder(self, t, ptr, self.current)

    @staticmethod
    def unpack(x):
        return x.tensor if isinstance(x, SavedActivations.Holder) else x

    def release(self, ptr, owner):
        entry = self.storages[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.storages[ptr]
        self.owners[owner] -= 1
        if self.owners[owner] == 0:
            del self.owners[owner]

    def action_ended(self) -> None:
        """Peak of the saved bytes and the deferred W's inputs (X, dY) together."""
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for store in self.stores for _, _, dy, x in store for t in (dy, x)}
        held = sum(n for ptr, n in held.items() if ptr not in self.storages)
        self.peak_with_w = max(self.peak_with_w, self.live + held)

    def bytes_per_micro_batch(self) -> int:
        """One micro-batch's bytes on this stage: all its chunks (the largest micro-batch)."""
        per_micro = collections.Counter()
        for (_, micro), n in self.first_bytes.items():
            per_micro[micro] += n
        return max(per_micro.values())


@contextlib.contextmanager
def watch(memory: SavedActivations | None):
    """memory's saved-tensor hooks, and every weight-gradient store that a
    ZB-H1 micro-batch opens (pipeline.LaterWeightGrads.deferring) kept in memory.stores."""
    if memory is None:
        yield
        return
    deferring = pipeline.LaterWeightGrads.deferring

    def keep(later, store, backward=False):
        if all(store is not s for s in memory.stores):
            memory.stores.append(store)
        return deferring(later, store, backward)
    with torch.autograd.graph.saved_tensors_hooks(memory.pack, memory.unpack), \
            mock.patch.object(pipeline.LaterWeightGrads, "deferring", keep):
        yield


@contextlib.contextmanager
def host_waits_for_device(device):
    """On a GPU the host runs ahead of the kernels, so run_pipeline's clock
    would time launches. Make it wait for the device after each backward and
    each tick's point-to-point messages (the forward waits itself), patched
    from outside so that parallel.py carries nothing for the benchmark. On the
    CPU the ops and gloo's waits block already: nothing to do."""
    if device.type != "cuda":
        yield
        return
    backward, batch_isend_irecv = torch.autograd.backward, dist.batch_isend_irecv

    def backward_then_wait(*args, **kwargs):
        backward(*args, **kwargs)
        torch.cuda.synchronize(device)

    def messages_then_wait(ops):
        works = batch_isend_irecv(ops)
        for work in works:
            work.wait()
        torch.cuda.synchronize(device)
        return works

    with mock.patch.object(torch.autograd, "backward", backward_then_wait), \
            mock.patch.object(parallel.dist, "batch_isend_irecv", messages_then_wait):
        yield


def pipeline_step(model, batches, s: Schedule, device, timeline=None, memory=None) -> None:
    """Forwards and backwards of the micro-batches through this rank's stage:
    pipeline.pipeline_step without autocast, loss scaling and the loss's
    all-reduce, and with run_pipeline's timeline."""
    m, (b, T) = len(batches), batches[0][0].shape
    ticks = pipeline.pipeline_timeline(parallel.layout.pp_size, m, s.v, zero_bubble=s.zero_bubble)
    positions, stage = torch.arange(T, device=device), pipeline.Stage(model)
    zero_bubble = pipeline.LaterWeightGrads(model) if s.zero_bubble else None

    def forward(chunk: int, micro: int, x):
        if memory is not None:
            memory.current = (chunk, micro)
        tokens, labels = batches[micro]
        out = stage(chunk, {"tokens": tokens, "position_ids": positions, "labels": labels, "loss_mask": None}, x)
        if stage.chunks[chunk].stop == model.config.num_layers:
            out = out / m                                  # the loss, averaged over the step
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out

    with watch(memory), host_waits_for_device(device):
        pipeline.run_pipeline(ticks, s.v, forward, (b, T, model.config.hidden_size), device,
                              timeline=timeline, after=memory and (lambda a: memory.action_ended()),
                              act=zero_bubble and zero_bubble.act)
    model.zero_grad(set_to_none=True)


def timed_step(model, batches, s: Schedule, device) -> list:
    """Every rank's actions, (tick, start, end) in seconds from a barrier all
    ranks leave together: their clocks then agree (to the barrier's skew)."""
    timeline = []
    dist.barrier()
    t0 = time.perf_counter()
    pipeline_step(model, batches, s, device, timeline=timeline)
    mine = [(t, start - t0, end - t0) for t, _, start, end in timeline]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def bubble(timelines: list, m: int, s: Schedule) -> tuple[float, list[float], list[float], list[float]]:
    """(step seconds, each rank's busy seconds, each rank's bubble fraction,
    each rank's bubble replayed): the step runs from the first action's start
    to the last one's end."""
    step = max(e for tl in timelines for _, _, e in tl) - min(s for tl in timelines for _, s, _ in tl)
    busy = [sum(e - s for _, s, e in tl) for tl in timelines]
    return step, busy, [1 - b / step for b in busy], replay(timelines, m, s.v, s.zero_bubble)


def replay(timelines: list, m: int, v: int, zero_bubble: bool = False) -> list[float]:
    """Each rank's bubble had messages cost nothing: the measured action times
    run through run_pipeline's coupling, where at every tick a rank waits
    until each neighbour it sends to or receives from has finished that
    tick's action (one batch_isend_irecv on both sides), except a receiver
    still inside a longer action (a backward spans two ticks): it posted its
    receive before that action began, so its sender does not wait for it.
    Its gap to the tick clock's figure is the schedule's, from actions of
    unequal length; the measured figure's gap to it is communication and noise.
    timelines[r]: rank r's (tick, start, end) of each action; zero_bubble: ZB-H1's."""
    pp = len(timelines)
    took = [{t: e - s for t, s, e in tl} for tl in timelines]
    free = [0.0] * pp  # when each rank is done with the ticks so far
    ticks = pipeline.pipeline_timeline(pp, m, v, zero_bubble=zero_bubble)
    ending = {(t + pipeline.DURATION[a.kind] - 1, r): a for t, row in enumerate(ticks) for r, a in enumerate(row) if a}
    for t in range(len(ticks)):
        done = [free[r] + took[r].get(t, 0.0) for r in range(pp)]
        to = [(pipeline._messages(ending.get((t, r)), r, pp, v) or (None,))[0] for r in range(pp)]  # whom r sends to
        for r in range(pp):
            partners = {n for n in range(pp) if to[n] == r}
            if to[r] is not None and not _inside_action(ticks, to[r], t):
                partners.add(to[r])
            free[r] = max([done[r]] + [done[n] for n in partners])
    return [1 - sum(tk.values()) / max(free) for tk in took]


def _inside_action(ticks: list, rank: int, t: int) -> bool:
    """Whether rank's action spans tick t without ending there."""
    started = [s for s in range(t + 1) if ticks[s][rank]]
    return bool(started) and started[-1] + pipeline.DURATION[ticks[started[-1]][rank].kind] - 1 > t


def measure_memory(model, batches, s: Schedule, device) -> list:
    """Every rank's (peak saved bytes, bytes of one micro-batch, peak
    (chunk, micro) pairs in flight, peak saved + W inputs bytes), from one
    untimed step (the hooks cost time)."""
    memory = SavedActivations(model)
    pipeline_step(model, batches, s, device, memory=memory)
    if memory.live or memory.owners:
        raise RuntimeError(f"saved tensors outlived the backward: {memory.live} bytes of {dict(memory.owners)}")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (memory.peak_bytes, memory.bytes_per_micro_batch(), memory.peak_in_flight,
                                      max(memory.peak_bytes, memory.peak_with_w)))
    return everyone


def tick_bubble(pp: int, m: int, s: Schedule, rank: int) -> Fraction:
    """The rank's idle ticks / all ticks of the schedule (a backward is two ticks)."""
    ticks = pipeline.pipeline_timeline(pp, m, s.v, zero_bubble=s.zero_bubble)
    busy = sum(pipeline.DURATION[row[rank].kind] for row in ticks if row[rank])
    return Fraction(len(ticks) - busy, len(ticks))


def in_flight_formula(pp: int, m: int, v: int, rank: int) -> Fraction:
    """Micro-batches whose activations stage `rank` holds at most: its warm-up
    forwards plus one (rank_order's warm-up), in units of a whole stage's
    activations (interleaved: a chunk holds 1/v of them)."""
    warmup = pp - rank - 1 if v == 1 else 2 * (pp - rank - 1) + (v - 1) * pp
    return Fraction(min(warmup + 1, m * v), v)


def main():
    args = parse_args()
    device = setup()
    models = {name: build(args, device, SCHEDULES[name].v) for name in args.schedules}
    m, b, T = args.micro_batches, args.micro_batch_size, args.seq_length
    g = torch.Generator().manual_seed(1)  # the same batches on every rank
    ids = torch.randint(0, args.padded_vocab_size, (m, b, T + 1), generator=g).to(device)
    batches = [(ids[i, :, :-1], ids[i, :, 1:]) for i in range(m)]
    steps = {name: [] for name in models}
    for it in range(args.warmup + args.iters):
        for name, model in models.items():  # round-robin: drifts hit every schedule alike
            timelines = timed_step(model, batches, SCHEDULES[name], device)
            if it >= args.warmup:
                steps[name].append(bubble(timelines, args.micro_batches, SCHEDULES[name]))
    memory = {name: measure_memory(model, batches, SCHEDULES[name], device) for name, model in models.items()}
    if dist.get_rank() == 0:
        report(args, device, steps, memory)
    parallel.destroy()
    dist.destroy_process_group()


def report(args, device, steps, memory):
    pp, m = parallel.layout.pp_size, args.micro_batches
    print(f"GPT L={args.num_layers} H={args.hidden_size} heads={args.num_attention_heads} "
          f"seq={args.seq_length} vocab={args.padded_vocab_size} micro-batch={args.micro_batch_size} | "
          f"P={pp} m={m} | {device.type} fp32 {dist.get_backend()} | median of {args.iters} steps "
          f"after {args.warmup} warm-up\n")
    print("| schedule | stage | step ms | busy ms | bubble measured | bubble replayed | bubble ticks | bubble formula "
          "| peak saved MiB | + W inputs MiB | MiB / micro-batch | peak / one micro-batch | in flight measured "
          "| in flight formula |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, runs in steps.items():
        s, step = SCHEDULES[name], statistics.median(run[0] for run in runs)
        formula = Fraction(pp - 1, (3 if s.zero_bubble else s.v) * m + pp - 1)
        for r in range(pp):
            busy, measured, replayed = (statistics.median(run[i][r] for run in runs) for i in (1, 2, 3))
            ticks = tick_bubble(pp, m, s, r)
            peak, per_micro, pairs, with_w = memory[name][r]
            print(f"| {name} | {r} | {step * 1e3:.1f} | {busy * 1e3:.1f} | {measured:.3f} | {replayed:.3f} "
                  f"| {ticks} = {float(ticks):.3f}{'' if ticks == formula else ' (differs!)'} "
                  f"| {formula} = {float(formula):.3f} | {peak / 2**20:.2f} | {with_w / 2**20:.2f} "
                  f"| {per_micro / 2**20:.2f} | {peak / per_micro:.2f} | {fmt(Fraction(pairs, s.v))} "
                  f"| {fmt(in_flight_formula(pp, m, s.v, r))} |")
    print(f"\nreplayed: the measured action times through run_pipeline's tick-by-tick coupling, "
          f"messages free. GPipe would hold all m = {m} micro-batches on every stage.")


def fmt(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{float(x):g}"


if __name__ == "__main__":
    main()
