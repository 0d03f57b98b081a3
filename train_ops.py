"""What a run needs around train.py's training: the processes and the command
line (section 1), the run's length, batches and the schedule a resume follows (2),
logging, MFU, the loss checks and the closing sample (3), preemption (4). train.py
imports it, never the reverse (its main is handed train.train): the loop calls in
here to log and to vote on a stop; the step (forward, backward, optimizer) never does.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import types

import torch
import torch.distributed as dist

import checkpoint
import launch
import parallel
import pipeline
from config import TrainConfig, batch_from_deepspeed_json, model_config, parse_args
from gpt import GPT, GPTConfig, count_parameters, flops_per_token, generate
from launch import UsageError
from prepare import load_tokenizer


# ----------------------------------------------------------------------------
# 1. The processes and the command line

# Before the loop (reading the data, loading a checkpoint, building, waiting on a
# peer) a run has nothing to save: SIGTERM ends it at once (main). From the loop's
# start, Preemption.start, the one switch, has it save first.
SIGTERM_BEFORE_THE_LOOP = ("train.py: SIGTERM before training started (while loading, building, waiting "
                           "or exporting); nothing to save, exiting")


def init_processes(cfg: TrainConfig) -> launch.Dist:
    """The default process group (launch.py), then this layout's TP, CP, DP, PP and EP groups (parallel.py)."""
    env = launch.init_distributed(cfg.distributed_backend, cfg.distributed_timeout_minutes,
                                  one_queue=cfg.domino or cfg.sequence_parallel, deepspeed=cfg.deepspeed)
    parallel.initialize(cfg.tensor_model_parallel_size, env.timeout, cfg.pipeline_model_parallel_size,
                        cfg.context_parallel_size, cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size)
    return env


def main(argv: list[str] | None = None, *, train, usage: str) -> None:
    """train.py's command line (train.main: `train` is train.train, `usage` its
    --help text): a user's mistake is one line from rank 0 (launch.errors_reported)."""
    launch.sigterm_exits(SIGTERM_BEFORE_THE_LOOP)
    with launch.errors_reported("train.py"):
        cfg = parse_args(argv, usage=usage)
        if cfg.export_from:
            checkpoint.export_weights(cfg.export_from, cfg.export_to, cfg.export_format)
            launch.say(f"exported {cfg.export_from} -> {cfg.export_to} ({cfg.export_format})")
            return
        env = init_processes(cfg)
        with checkpoint.writing_alone(cfg.save):  # --save checked now, not a save interval of compute later
            train(cfg, env)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


# ----------------------------------------------------------------------------
# 2. The run's length, its batches and its schedule

def gradient_accumulation_steps(cfg: TrainConfig, dp_size: int, global_batch: int | None = None) -> int:
    """global batch = micro batch x data-parallel size x accumulation steps
    (global_batch: this step's, under --rampup-batch-size; default --global-batch-size)."""
    per_step = cfg.micro_batch_size * dp_size
    gbs = global_batch or cfg.global_batch_size or per_step
    if gbs % per_step != 0:
        flag = "--rampup-batch-size START and INCREMENT, and --global-batch-size," \
            if cfg.rampup_batch_size else "--global-batch-size"
        raise UsageError(f"{flag} {gbs} is not divisible by --micro-batch-size {cfg.micro_batch_size} x "
                         f"data-parallel size {dp_size} = {per_step}; use a multiple of {per_step}")
    return gbs // per_step


def global_batch_at(consumed: int, cfg: TrainConfig, dp_size: int) -> int:
    """The global batch of the step after `consumed` samples: --rampup-batch-size START
    INCREMENT SAMPLES grows it from START by INCREMENT in equal sample intervals up to
    SAMPLES, then --global-batch-size (Megatron's ramp-up, used by GPT-3)."""
    final = cfg.global_batch_size or cfg.micro_batch_size * dp_size
    if not cfg.rampup_batch_size:
        return final
    start, increment, ramp_samples = cfg.rampup_batch_size
    if consumed > ramp_samples or final == start:
        return final
    samples_per_increment = ramp_samples / ((final - start) // increment)
    return start + int(consumed / samples_per_increment) * increment


def with_run_length(cfg: TrainConfig, dp_size: int) -> TrainConfig:
    """With --train-samples, --train-iters becomes the number of whole steps that fit,
    and with --train-tokens too, the steps that start below that many tokens (Megatron-DeepSpeed's)."""
    if cfg.train_samples is None:
        return cfg
    iterations, consumed = 0, 0
    while consumed + (batch := global_batch_at(consumed, cfg, dp_size)) <= cfg.train_samples and \
            (cfg.train_tokens is None or consumed * cfg.seq_length < cfg.train_tokens):
        consumed += batch
        iterations += 1
    if iterations == 0:
        raise UsageError(f"--train-samples {cfg.train_samples} is less than one global batch ({batch})")
    return dataclasses.replace(cfg, train_iters=iterations)


def plan_batches(cfg: TrainConfig) -> tuple[TrainConfig, int, int]:
    """(cfg with the run's length in iterations, accumulation steps, final global batch).
    Every batch of a --rampup-batch-size is checked here too."""
    dp = parallel.layout.dp_size
    cfg = with_run_length(batch_from_deepspeed_json(cfg, dp), dp)  # --train-samples -> iterations
    accum = gradient_accumulation_steps(cfg, dp)
    global_batch = cfg.micro_batch_size * dp * accum
    ramp = range(cfg.rampup_batch_size[0], global_batch, cfg.rampup_batch_size[1]) if cfg.rampup_batch_size else []
    pp = parallel.layout.pp_size
    if pp > 1:  # the layers must divide into stages: the model chunks a rank holds
        v = len(pipeline.pipeline_chunks(model_config(cfg).num_layers, pp, 0,
                                         cfg.num_layers_per_virtual_pipeline_stage))
    for batch in [*ramp, global_batch]:
        micro_batches = gradient_accumulation_steps(cfg, dp, batch)
        if pp > 1:
            pipeline.check_micro_batches(micro_batches, pp, v)
    return cfg, accum, global_batch


def lr_schedule(cfg: TrainConfig) -> tuple:
    """(peak, floor, decay style, warmup end, decay end) for train.learning_rate;
    the ends in iterations, or with --train-samples in samples."""
    if cfg.train_samples is None:
        warmup, decay = cfg.lr_warmup_iters, cfg.lr_decay_iters or cfg.train_iters
    else:  # Megatron-DeepSpeed's token counts are samples of --seq-length tokens (fractions of one too)
        warmup, decay = cfg.lr_warmup_samples, cfg.lr_decay_samples or cfg.train_samples
        warmup = warmup if cfg.lr_warmup_tokens is None else cfg.lr_warmup_tokens / cfg.seq_length
        decay = decay if cfg.lr_decay_tokens is None else cfg.lr_decay_tokens / cfg.seq_length
    if cfg.lr_warmup_fraction is not None:
        warmup = cfg.lr_warmup_fraction * decay
    return cfg.lr, cfg.min_lr, cfg.lr_decay_style, warmup, decay


def schedule_to_follow(cfg: TrainConfig, start: checkpoint.Start) -> tuple:
    """The learning-rate schedule (lr_schedule) a run from `start` follows: this
    run's, or resuming with --use-checkpoint-opt_param-scheduler, the checkpoint's
    (start.config: its run's TrainConfig). Megatron refuses schedules that
    differ unless one of those two flags says which to keep; here this run's
    goes on, with one line saying what changed (the lr may jump), silent under
    --override-opt_param-scheduler. A start past this run's end is refused."""
    mine, saved, path = lr_schedule(cfg), start.config, start.path
    if start.iteration > cfg.train_iters:
        raise UsageError(f"--load {cfg.load} is at iteration {start.iteration}, past this run's end "
                         f"(--train-iters/--train-samples: {cfg.train_iters} iterations): raise it to "
                         f"continue that run, or add --finetune to start a new run from its weights")
    if path is None:  # a fresh start, or --finetune
        return mine
    try:  # a flag newer than the checkpoint has its default there
        theirs = lr_schedule(types.SimpleNamespace(**{**dataclasses.asdict(TrainConfig()), **saved})) \
            if saved else None
    except (AttributeError, TypeError):  # a config of another version
        theirs = None
    names = ("--lr", "--min-lr", "decay style", "warmup end", "decay end")

    def differences(follow, other, whose):
        return ", ".join(f"{name} {a if isinstance(a, str) else f'{a:g}'} ({whose}: "
                         f"{b if isinstance(b, str) else f'{b:g}'})"
                         for name, a, b in zip(names, follow, other) if a != b)
    if cfg.use_checkpoint_opt_param_scheduler:
        if theirs is None:
            raise UsageError(f"--use-checkpoint-opt_param-scheduler: {path} records no learning-rate "
                             f"schedule; drop the flag and give the schedule's flags")
        theirs_in_samples = saved["train_samples"] is not None
        if theirs_in_samples != (cfg.train_samples is not None):
            their_unit, my_unit = ("samples", "iterations") if theirs_in_samples else ("iterations", "samples")
            flag = "--train-samples" if theirs_in_samples else "--train-iters"
            raise UsageError(f"--use-checkpoint-opt_param-scheduler: {path}'s schedule counts {their_unit}, "
                             f"this run's {my_unit}: give {flag}, as the checkpoint's run did")
        if changed := differences(theirs, mine, "this run"):
            launch.say(f"the checkpoint's learning-rate schedule goes on: {changed}")
        return theirs
    if (changed := differences(mine, theirs or mine, "checkpoint")) and not cfg.override_opt_param_scheduler:
        launch.say(f"the learning-rate schedule is not the checkpoint's, this run's goes on: {changed}")
    return mine


# ----------------------------------------------------------------------------
# 3. Logging, MFU, the loss checks, the closing sample

def describe_run(cfg: TrainConfig, env: launch.Dist, mcfg: GPTConfig, global_batch: int, accum: int) -> None:
    """The line that opens a run: the model's size, the layout, the batch, the device."""
    ramp = f" (ramped up from {cfg.rampup_batch_size[0]})" if cfg.rampup_batch_size else ""
    lay = parallel.layout
    pp_schedule = "" if lay.pp_size == 1 else " (ZB-H1)" if cfg.enable_zero_bubble else \
        " (interleaved 1F1B)" if cfg.num_layers_per_virtual_pipeline_stage else " (1F1B)"
    active = f" ({count_parameters(mcfg, active=True):,} active)" if mcfg.num_experts else ""
    launch.say(f"model: {count_parameters(mcfg):,} parameters{active} | world {env.world_size} = "
               f"TP {lay.tp_size}{' (expert TP 1)' if lay.whole_experts else ''} x "
               f"{f'CP {lay.cp_size} ({cfg.cp_comm_type}) x ' if lay.cp_size > 1 else ''}"
               f"DP {lay.dp_size}{f' (EP {lay.ep_size})' if lay.ep_size > 1 else ''} x PP {lay.pp_size}{pp_schedule}"
               f" | global batch {global_batch} "
               f"= {cfg.micro_batch_size} x {lay.dp_size} x {accum} accumulation{ramp} | "
               f"device {env.device}")


class Logger:
    """Rank 0 prints each log line (launch.say), and writes the same figures to
    --metrics-file (JSON lines) and TensorBoard."""
    MOE = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss", "moe_imbalance", "moe_dropped")  # moe_figures'

    def __init__(self, cfg: TrainConfig, resume: bool):
        self.file, self.tb = None, None
        if launch.global_rank() != 0:
            return
        if cfg.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.metrics_file)), exist_ok=True)
            self.file = open(cfg.metrics_file, "a" if resume else "w")
        if cfg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(cfg.tensorboard_dir, max_queue=cfg.tensorboard_queue_size)

    def log(self, metrics: dict) -> None:
        parts = [f"iter {metrics['iteration']:>6d}", f"loss {metrics['loss']:.4f}",
                 f"lr {metrics['lr']:.3e}", f"grad norm {metrics['grad_norm']:.3f}",
                 f"tokens/s {metrics['tokens_per_sec']:,.0f}"]
        if metrics.get("mfu") is not None:
            parts.append(f"MFU {100 * metrics['mfu']:.1f}%")
        if metrics.get("skipped_iterations"):
            parts.append(f"skipped {metrics['skipped_iterations']} (non-finite grads)")
        if "moe_imbalance" in metrics:  # the means over the MoE layers (each layer's: the file, TensorBoard)
            parts.append(", ".join(f"{name} {metrics[name]:.4g}" for name in self.MOE if name in metrics))
        parts.append(f"batch {metrics['batch_size']}")
        if "val_loss" in metrics:
            parts.append(f"val loss {metrics['val_loss']:.4f} (ppl {metrics['val_ppl']:.2f})")
        launch.say(" | ".join(parts))
        if self.file:
            self.file.write(json.dumps(metrics) + "\n")
            self.file.flush()
        if self.tb:
            for k, v in metrics.items():
                if k != "iteration" and v is not None:
                    name = {"val_loss": "valid/loss", "val_ppl": "valid/ppl"}.get(k, f"train/{k}")
                    self.tb.add_scalar(name, v, metrics["iteration"])

    def close(self) -> None:
        for sink in (self.file, self.tb):
            if sink:
                sink.close()


def moe_figures(layers: dict) -> dict:
    """What the MoE layers (layer number -> gpt.MoE) recorded since the last call
    (MoE.stats, cleared), over the ranks whose tokens differ (layout.routing_group): each
    auxiliary loss's mean (without its coefficient), the imbalance of the tokens
    per expert (max over mean; 1 is even) and the share of token choices dropped
    over capacity (moe_dropped); each as NAME/layerI, and their mean over layers as NAME.
    Every rank calls it: under PP each stage adds its own layers' (a stage may hold none)."""
    rows = {}  # layer -> {name: figure}
    if layers:
        first = next(iter(layers.values()))
        names, E = list(first.stats)[:-3], first.config.num_experts  # the losses; then tokens (E), dropped, forwards
        sums = torch.stack([torch.cat([v.reshape(-1) for v in layer.stats.values()]) for layer in layers.values()])
        if parallel.layout.routing_group is not None:
            dist.all_reduce(sums, group=parallel.layout.routing_group)
        tokens = sums[:, -E - 2:-2]                                                     # (L, E)
        table = torch.cat([sums[:, :len(names)] / sums[:, -1:], (tokens.amax(1) / tokens.mean(1))[:, None],
                           (sums[:, -2] / tokens.sum(1))[:, None]], dim=1).tolist()    # (L, figures)
        rows = {i: dict(zip(names + ["moe_imbalance", "moe_dropped"], row)) for i, row in zip(layers, table)}
        for layer in layers.values():
            layer.stats.clear()
    if parallel.layout.pp_size > 1:  # the other stages' layers too, for rank 0's log line and file
        stages = [None] * parallel.layout.pp_size
        dist.all_gather_object(stages, rows, group=parallel.layout.pp_group)
        rows = dict(sorted(item for stage in stages for item in stage.items()))
    figures = {f"{name}/layer{i}": v for i, row in rows.items() for name, v in row.items()}
    names = list(next(iter(rows.values())))
    return {**{name: sum(row[name] for row in rows.values()) / len(rows) for name in names}, **figures}


# Dense bf16 tensor-core peak FLOP/s (fp32 accumulation), matched against
# torch.cuda.get_device_name() most specific first; an unlisted GPU (or None) gets no MFU,
# not a guess. Sources: NVIDIA data sheets (sparse / 2), GeForce whitepapers.
PEAK_FLOPS = {
    "H200 NVL": 835e12,     # H200 data sheet: 1,671 TFLOPS sparse (NVL)
    "H200": 989e12,         # H200 data sheet: 1,979 TFLOPS sparse (SXM)
    "GH200": 989e12,        # GH200 data sheet: 1,979 TFLOPS sparse
    "H100 NVL": 835e12,     # H100 data sheet: 1,671 TFLOPS sparse (NVL, per GPU)
    "H100 PCIe": 756e12,    # H100 data sheet: 1,513 TFLOPS sparse (PCIe)
    "H100": 989e12,         # H100 data sheet: 1,979 TFLOPS sparse (SXM; "H100 80GB HBM3")
    "A100": 312e12,         # A100 data sheet: 312 dense (SXM and PCIe)
    "L40S": 362e12,         # L40S data sheet: 733 TFLOPS sparse
    "L40": 181e12,          # L40 data sheet: 362 TFLOPS sparse
    "L4": 121e12,           # L4 data sheet: 242 TFLOPS sparse
    "A10G": None,           # AWS gives no bf16 rate ("A10" is in its name, not its tensor rate)
    "A10": 125e12,          # A10 data sheet: 250 TFLOPS sparse
    "RTX 4090": 82.6e12,    # Ada whitepaper: 165.2 with fp16 accumulate, 82.6 with fp32
    "RTX 3090": 35.6e12,    # GA102 whitepaper: 71 with fp16 accumulate, 35.6 with fp32
    "V100-SXM2": 125e12,    # V100 data sheet: fp16 (no bf16), SXM2
    "V100-PCIE": 112e12,    # V100 data sheet: fp16 (no bf16), PCIe
}


def device_peak_flops(cfg: TrainConfig, device: torch.device) -> float | None:
    """Peak FLOP/s of one device: --peak-flops, else by GPU name; None on CPU."""
    if cfg.peak_flops:
        return cfg.peak_flops
    if device.type != "cuda":
        return None
    return peak_flops_by_name(torch.cuda.get_device_name(device))


def peak_flops_by_name(name: str) -> float | None:
    """PEAK_FLOPS of the first key the device name contains; None for an unknown device."""
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


class Meter:
    """Tokens/s, MFU and skipped steps between two log lines, read from the device only
    then. The first step (compilation, autotuning) is timed and reported on its own."""

    def __init__(self, cfg: TrainConfig, env: launch.Dist, mcfg: GPTConfig, first: int):
        self.device, self.world, self.first = env.device, env.world_size, first
        self.flops_per_token = flops_per_token(mcfg, cfg.seq_length)
        self.peak = device_peak_flops(cfg, env.device)
        if self.peak is None and env.device.type == "cuda":
            launch.say(f"MFU: unknown, {torch.cuda.get_device_name(env.device)!r} is not in "
                       f"train_ops.PEAK_FLOPS; pass --peak-flops (dense bf16 FLOP/s of one GPU)")
        self.t0, self.tokens, self.skipped = time.time(), 0, 0

    def count(self, iteration: int, tokens: int, skipped, log_now: bool) -> None:
        """One step done; skipped: its device flag (not read here)."""
        self.tokens, self.skipped = self.tokens + tokens, self.skipped + skipped
        if iteration == self.first:
            self.synchronize()
            launch.say(f"first step (iteration {iteration}) took {time.time() - self.t0:.1f} s, "
                       f"compilation and autotuning included")
            if not log_now:
                self.t0, self.tokens = time.time(), 0

    def synchronize(self) -> None:
        """Wait for the device's queued work, so that the host's clock times it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def figures(self) -> dict:
        """tokens_per_sec, mfu and skipped_iterations since the last call."""
        self.synchronize()
        tps = self.tokens / max(time.time() - self.t0, 1e-9)
        mfu = self.flops_per_token * tps / (self.peak * self.world) if self.peak else None
        figures = {"tokens_per_sec": tps, "mfu": mfu, "skipped_iterations": int(self.skipped)}
        self.t0, self.tokens, self.skipped = time.time(), 0, 0
        return figures


def check_losses(pending: list, last_saved: int) -> list[float]:
    """Read the (iteration, device loss) pairs queued since the last check in one host
    sync (at log intervals and saves), stop the run at the first non-finite one, and
    return their values."""
    values = torch.stack([loss.float() for _, loss in pending]).tolist()
    for (iteration, _), value in zip(pending, values):
        if not math.isfinite(value):
            launch.say(f"error: loss is {value} at iteration {iteration}; stopping without "
                       f"saving (last good checkpoint: iteration {last_saved}). Lower --lr, "
                       f"raise --lr-warmup-iters, or use --bf16 instead of --fp16.")
            raise SystemExit(1)
    pending.clear()
    return values


def closing_sample(model: GPT, cfg: TrainConfig, device) -> None:
    """The text the trained model writes after --sample-prompt (every rank
    generates, rank 0 prints), or one line saying why there is none."""
    if parallel.layout.pp_size > 1:
        launch.say("no sample printed: the model is split into pipeline stages; sample from the saved "
                   "checkpoint with eval_tasks.py --task GENERATE --load SAVE (any checkpoint loads there)")
        return
    try:
        enc = load_tokenizer(cfg.tokenizer_type, cfg.vocab_size)
    except UsageError as e:  # no BPE package: training is done and saved, just say why
        launch.say(f"no sample printed: {e}")
        return
    eod = enc.eot_token
    # NullTokenizer has no text: its sample starts where a document does
    prompt = [eod] if cfg.tokenizer_type == "NullTokenizer" else enc.encode_ordinary(cfg.sample_prompt)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)  # same on every tensor-parallel rank
    out = generate(model, torch.tensor([prompt], device=device), max_new_tokens=cfg.sample_tokens,
                   temperature=0.8, top_k=200, eos_token_id=eod, generator=gen)
    text = enc.decode([t for t in out[0].tolist() if t < eod])
    launch.say("-" * 40 + " sample " + "-" * 40 + "\n" + text + "\n" + "-" * 88)


# ----------------------------------------------------------------------------
# 4. Preemption

class Preemption:
    """Turns SIGTERM (a cluster's preemption notice) once the loop has started,
    or the end of --exit-duration-in-mins (counted from the start of the run),
    into a flag the loop checks. Every rank must stop (and save) at the same
    iteration, so the ranks vote with an all-reduce. On CUDA each vote is read
    one step late, once the next step is queued: the host never waits for the GPU."""

    def __init__(self, device: torch.device, minutes: float | None = None):
        self.device, self.requested = device, False
        self.deadline = None if minutes is None else time.monotonic() + 60 * minutes
        self.pending = None  # CUDA: (event, pinned host copy) of the last vote

    def start(self) -> None:
        """The loop starts: from now on SIGTERM stops it at the next vote, which saves."""
        launch.sigterm_calls(self._handler)

    def _handler(self, signum, frame):
        self.requested = True

    def agreed(self) -> bool:
        """True on every rank, at the same iteration, once any rank got SIGTERM or is out of time."""
        stop = self.requested or (self.deadline is not None and time.monotonic() > self.deadline)
        # torch.full fills on the device; torch.tensor would copy from pageable memory and wait.
        vote = torch.full((1,), float(stop), device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        if self.device.type != "cuda":
            return bool(vote.item())  # nothing queued on a CPU to keep busy
        host = torch.empty(1, pin_memory=True)
        host.copy_(vote, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        previous, self.pending = self.pending, (event, host)
        if previous is None:
            return False
        previous[0].synchronize()  # waits for the previous step only
        return bool(previous[1].item())
