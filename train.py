r"""Pretrain a GPT on Megatron-format token data.

    torchrun --standalone --nproc_per_node 8 train.py --preset 124M \
        --data-path data/shakespeare_text_document --micro-batch-size 8 \
        --global-batch-size 256 --train-iters 5000 --bf16

Sections:
  1. The learning-rate schedule, AdamW.
  2. Data: datasets and a data-parallel sampler that resumes exactly.
  3. The step: one train_step for both engines and every layout (micro-batches
     in turn, or pipeline.py's schedules); PlainTraining, the engine without
     DeepSpeed (mixed precision, the fp16 loss scaler, clipping, the skip
     decision), whose twin is zero.DeepSpeedTraining.
  4. Evaluation.
  5. The loop: the run, its steps, evaluations and checkpoints.
Around it (train_ops.py): the command line, the batch plan, the schedule a
resume follows, logging and MFU, the loss checks, preemption, the closing sample.
Elsewhere: flags (config.py), launch (launch.py), process groups (parallel.py),
the model (gpt.py), pipeline stages and their schedules (pipeline.py),
checkpoints and weight export (checkpoint.py), DeepSpeed ZeRO (zero.py).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import context
import data as data_lib
import expert_parallel
import launch
import parallel
import pipeline
import train_ops
import zero
from config import CUDA_GRAPH_MODES, TrainConfig, autocast, compile_options, eod_token, model_config
from data import to_device
from gpt import GPT, GPTConfig, moe_layers, set_aux_loss_scale, update_expert_biases, weighted_loss
from launch import UsageError


# ----------------------------------------------------------------------------
# 1. What the flags describe: schedule, optimizer

def learning_rate(done: int, schedule: tuple) -> float:
    """Megatron's schedule: a linear warmup from 0 (its first step has lr 0) to
    --lr, then cosine or linear decay to --min-lr (or --lr kept: constant), then
    --min-lr. done: the iterations before this step, or with --train-samples the
    samples consumed before it."""
    peak, floor, style, warmup, decay = schedule
    if done < warmup:
        return peak * done / warmup
    if style == "constant" or done >= decay:
        return peak if style == "constant" else floor
    progress = (done - warmup) / max(1, decay - warmup)
    coeff = 0.5 * (1.0 + math.cos(math.pi * progress)) if style == "cosine" else 1.0 - progress
    return floor + coeff * (peak - floor)


def param_ndim(p: torch.nn.Parameter) -> int:
    # ZeRO-3 swaps p.data for an empty 1-D tensor and keeps the real shape in ds_shape.
    return len(p.ds_shape) if hasattr(p, "ds_shape") else p.dim()


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, fused: bool = True) -> torch.optim.AdamW:
    """AdamW; biases and LayerNorm weights (every tensor with < 2 dims) get no decay.
    Both engines build it (PlainTraining; DeepSpeedTraining is handed it)."""
    params = [p for p in model.parameters() if p.requires_grad]
    matrix = {p: param_ndim(p) - getattr(p, "expert_parallel", False) >= 2 for p in params}  # experts: (E, ...)
    groups = [{"params": [p for p in params if matrix[p]], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if not matrix[p]], "weight_decay": 0.0}]
    # fused: one kernel for all tensors, which can skip a step on the device (train.PlainTraining.finish).
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             eps=cfg.adam_eps, fused=fused)


# ----------------------------------------------------------------------------
# 2. Data

def eval_consumed(iteration: int, cfg: TrainConfig, global_batch: int) -> int:
    """Where in the validation set the evaluation at `iteration` starts: each run sees
    fresh samples, as in Megatron (the extra final run after the last multiple)."""
    index = iteration // cfg.eval_interval - 1 if iteration % cfg.eval_interval == 0 \
        else cfg.train_iters // cfg.eval_interval
    return index * cfg.eval_iters * global_batch


def build_datasets(cfg: TrainConfig, global_batch: int):
    """(train, valid) datasets for this run's samples; the test split is for offline evaluation."""
    train_samples = cfg.train_samples or cfg.train_iters * global_batch
    # Validation every --eval-interval and at the end; never where --split gives it no share
    evaluates = cfg.eval_interval > 0 and data_lib.parse_split(cfg.split)[1] > 0
    eval_runs = cfg.train_iters // cfg.eval_interval + 1 if evaluates else 0
    num_samples = (train_samples, eval_runs * cfg.eval_iters * global_batch, 0)
    build = lambda: data_lib.build_train_valid_test_datasets(  # noqa: E731
        data_path=cfg.data_path, split=cfg.split, num_samples=num_samples, seq_length=cfg.seq_length,
        seed=cfg.seed, cache_dir=cfg.data_cache_path, eod_token=eod_token(cfg),
        reset_position_ids=cfg.reset_position_ids, eod_mask_loss=cfg.eod_mask_loss,
        reset_attention_mask=cfg.reset_attention_mask)[:2]
    if not dist.is_initialized():
        return build()
    # Rank 0 builds and caches the index arrays, then the others load that cache; if it
    # fails (bad data), they raise its error rather than hang in a collective.
    mistake = [None]
    if dist.get_rank() == 0:
        try:
            datasets = build()
        except UsageError as e:
            mistake = [str(e)]
    dist.broadcast_object_list(mistake, src=0)
    if mistake[0] is not None:
        raise UsageError(mistake[0])
    return datasets if dist.get_rank() == 0 else build()


def data_iterator(dataset, cfg: TrainConfig, consumed_samples: int):
    """Yields this rank's micro-batches, starting after `consumed_samples` (all ranks)."""
    sampler = data_lib.PretrainingSampler(len(dataset), consumed_samples, cfg.micro_batch_size,
                                          parallel.layout.dp_rank, parallel.layout.dp_size)
    # A generator of its own: by default each new iterator draws its workers' seed from the
    # global stream, which dropout uses, and a resumed run would draw one more than the original.
    return iter(torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=cfg.num_workers,
                                            pin_memory=torch.cuda.is_available(),
                                            generator=torch.Generator().manual_seed(cfg.seed)))


def check_batches(batches: list[dict], config: GPTConfig) -> list[dict]:
    """Token ids and positions must index the embeddings: the one check of the
    ids, of a step's micro-batches, on the host, in one read (on a GPU a bad
    id is an opaque device-side assert, and checking there costs a sync)."""
    vocab, positions = "check the data's tokenizer against the model's vocabulary (--tokenizer-type, " \
        "--vocab-size)", "check --seq-length against --max-position-embeddings"
    named, extremes = [], []
    for b in batches:  # the true vocabulary: an id in the padding rows would train them silently
        for name, limit, fix in (("tokens", config.vocab_size, vocab), ("labels", config.vocab_size, vocab),
                                 ("position_ids", config.max_position_embeddings, positions)):
            named.append((f"batch {name}", limit, fix))
            extremes.append(torch.stack(b[name].aminmax()).long())  # (2,): min, max
    bounds = torch.cat(extremes).tolist()
    for (name, limit, fix), lo, hi in zip(named, bounds[::2], bounds[1::2]):
        if lo < 0 or hi >= limit:
            raise UsageError(f"{name} must lie in [0, {limit}), got values in [{lo}, {hi}]; {fix}")
    return batches


# ----------------------------------------------------------------------------
# 3. The step

def build_model(cfg: TrainConfig, device: torch.device, kernels_for: torch.device | None = None) -> GPT:
    """The run's model on `device` (this rank's stage: pipeline.stage_model),
    with the kernels chosen for `kernels_for` (default: device; ZeRO-3 under TP
    builds on the host what runs on a GPU). Both engines build it."""
    mcfg = model_config(cfg, kernels_for or device)
    if cfg.domino:
        mcfg = dataclasses.replace(mcfg, domino_chunks=cfg.domino_chunks)
    # Same seed everywhere: every rank builds the same full model (TP ranks keep their
    # slice, pipeline stages their layers). Dropout over TP-sharded values draws from a
    # per-TP-rank stream (parallel.py).
    torch.manual_seed(cfg.seed)
    parallel.model_parallel_seed(cfg.seed)
    lay = parallel.layout
    model = pipeline.stage_model(mcfg, pipeline.pipeline_chunks(mcfg.num_layers, lay.pp_size, lay.pp_rank,
                                                                cfg.num_layers_per_virtual_pipeline_stage)).to(device)
    if lay.pp_rank > 0:  # each stage its own dropout masks (Megatron's seed + 100 x stage)
        torch.manual_seed(cfg.seed + 100 * lay.pp_rank)
        parallel.model_parallel_seed(cfg.seed + 100 * lay.pp_rank)
    return model


def train_step(trainer, batches: list, lr: float):
    """One optimizer step over the micro-batches `batches` (host tensors), for
    either engine (PlainTraining, zero.DeepSpeedTraining): the engine says how
    the step begins, how a micro-batch's loss becomes gradients, and how it
    ends. Returns (the loss averaged over micro-batches and DP ranks, grad norm,
    skipped: 1.0 or 0.0); the plain engine's stay on the device: no host wait."""
    m = len(batches)
    trainer.begin(m, lr)
    if parallel.layout.cp_size > 1:  # this rank's share of every sequence, and its loss weight
        batches = [context.split_batch(b) for b in batches]
    if parallel.layout.pp_size == 1:  # forward and backward of each micro-batch in turn, summed in .grad
        total = torch.zeros((), device=trainer.device)
        for i, batch in enumerate(batches):
            b = to_device(batch, trainer.device)
            with trainer.micro_batch(last=i == m - 1):
                if trainer.moe_layers:  # their auxiliary losses' gradients: this loss's share
                    set_aux_loss_scale(trainer.moe_layers.values(), b, m, trainer.scale)
                with trainer.precision:  # the engine's autocast (--bf16 / --fp16)
                    loss = trainer.model(b["tokens"], b["position_ids"], b["labels"], b["loss_mask"],
                                         document_ids=b.get("document_ids"))
                loss = weighted_loss(loss, b)  # as it is, or CP's share of it (context.split_batch)
                trainer.backward(loss, m)
            total += loss.detach() / m
    else:  # the same forward, a model chunk at a time, in 1F1B order through this rank's stage
        total = pipeline.pipeline_step(trainer.model, batches, trainer.cfg, trainer.device, trainer.precision,
                                       trainer.scale, trainer.averager)
    grad_norm, skipped = trainer.finish()
    if trainer.moe_layers:  # DeepSeek-V3's expert bias, from the step's tokens on every rank routing its own
        update_expert_biases(trainer.moe_layers.values(), parallel.layout.routing_group)
    if parallel.layout.dp_cp_size > 1:  # the loss every rank reports: over the replicas
        total = parallel.all_reduce_mean(total, parallel.layout.dp_cp_group)
    return total, grad_norm, skipped


class LossScaler:
    """Dynamic loss scaling for --fp16 (Micikevicius et al., 2018), on the device. The
    scale halves at the `hysteresis`-th non-finite step since it last grew (Megatron's
    count: a finite step between two does not reset it; 1: at every one), never below
    `min_scale`; after `growth_interval` finite steps in a row it doubles. Unlike
    GradScaler, the caller decides what is non-finite (the whole model's grad norm, the
    same on every rank); the state dict has GradScaler's keys, and the hysteresis count."""

    def __init__(self, init_scale: float, device: torch.device, growth_interval: int = 2000,
                 hysteresis: int = 1, min_scale: float = 0.0):
        self.scale_ = torch.full((), init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.hysteresis_tracker = torch.full((), hysteresis, dtype=torch.int32, device=device)
        self.growth_interval, self.hysteresis, self.min_scale = growth_interval, hysteresis, min_scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_

    def unscale_(self, params) -> None:
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], self.scale_.reciprocal())

    def update(self, found_inf: torch.Tensor) -> None:
        inf = found_inf > 0
        grow = (self.growth_tracker + 1 >= self.growth_interval) & ~inf
        left = torch.where(inf, self.hysteresis_tracker - 1, torch.where(grow, self.hysteresis,
                                                                         self.hysteresis_tracker))
        back_off = inf & (left <= 0)
        self.scale_.copy_(torch.where(back_off, (self.scale_ * 0.5).clamp(min=self.min_scale),
                                      self.scale_ * torch.where(grow, 2.0, 1.0)))
        self.growth_tracker.copy_(torch.where(inf | grow, 0, self.growth_tracker + 1))
        self.hysteresis_tracker.copy_(left)

    def state_dict(self) -> dict:  # a host read: at checkpoints only
        return {"scale": self.scale_.item(), "_growth_tracker": int(self.growth_tracker.item()),
                "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": self.growth_interval,
                "hysteresis_tracker": int(self.hysteresis_tracker.item())}

    def load_state_dict(self, state: dict) -> None:
        self.scale_.fill_(state["scale"])
        self.growth_tracker.fill_(state["_growth_tracker"])
        self.hysteresis_tracker.fill_(state.get("hysteresis_tracker", self.hysteresis))


class PlainTraining:
    """The engine without DeepSpeed: the model (build_model), our AdamW and the
    --fp16 loss scaler, loaded from --load, wrapped for --compile and, at pp = 1
    over several data-parallel ranks, DDP. train_step drives it as it drives
    zero.DeepSpeedTraining: begin; per micro-batch, forward within micro_batch(),
    then backward (under stages, the schedule's, of the loss `scale` gives); finish."""

    def __init__(self, cfg: TrainConfig, env: launch.Dist):
        self.cfg, self.device = cfg, env.device
        self.raw = build_model(cfg, env.device)
        self.optimizer = build_optimizer(self.raw, cfg)
        self.scaler = LossScaler(cfg.initial_loss_scale, env.device, cfg.loss_scale_window or 2000,
                                 cfg.hysteresis or 1, cfg.min_loss_scale or 0.0) if cfg.fp16 else None
        self.start = checkpoint.load_checkpoint(cfg, self.raw, self.optimizer, self.scaler, launch.say)
        self.model = self.raw if parallel.layout.pp_size == 1 else pipeline.Stage(self.raw)
        if cfg.compile:
            self.model = torch.compile(self.model, **compile_options(cfg))
        self.moe_layers = moe_layers(self.raw)
        lay = parallel.layout  # gradients are averaged over DP x CP (pipelines: pipeline.GradientAverager)
        if lay.dp_cp_size > 1 and lay.pp_size == 1:  # but the experts' (finish), which EP ranks hold apart
            DDP._set_params_and_buffers_to_ignore_for_model(self.model, [
                n for n, p in self.model.named_parameters() if parallel.averaged_apart(p)])
            self.model = DDP(self.model, process_group=lay.dp_cp_group, forward_sync_buffers=False,  # MoE's counts
                             device_ids=[env.local_rank] if env.device.type == "cuda" else None)
        self.precision = autocast(cfg, env.device)               # the forward's (--bf16 / --fp16)
        self.scale = self.scaler.scale if self.scaler else None  # a loss's, before backward
        self.averager = pipeline.GradientAverager(self.raw, lay.dp_cp_group) \
            if lay.pp_size > 1 and lay.dp_cp_size > 1 else None
        self.cuda_graphs = cfg.compile and cfg.compile_mode in CUDA_GRAPH_MODES
        if self.cuda_graphs:  # .grad is our own buffer, zeroed in place (see begin)
            for p in self.raw.parameters():
                p.grad = torch.zeros_like(p)
        self.max_norm = cfg.clip_grad if cfg.clip_grad > 0 else float("inf")
        # --async-save: the host copy and the write in flight
        self.saver = checkpoint.AsyncSave(env.timeout, self.optimizer) if cfg.async_save and cfg.save else None

    def begin(self, micro_batches: int, lr: float) -> None:
        """This step's learning rate; gradients start from none (zero under CUDA graphs)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # Under CUDA graphs, autograd would make a replay's output buffer the .grad of
        # a parameter that has none, and the next micro-batch's replay overwrites it
        # (pytorch#169545): the gradients accumulate into buffers of our own instead.
        self.optimizer.zero_grad(set_to_none=not self.cuda_graphs)
        if self.averager:
            self.averager.begin(micro_batches)

    def micro_batch(self, last: bool):
        """The context of a micro-batch's forward and backward. DDP all-reduces
        on every backward: here only on the last micro-batch's, once per step."""
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the last replay's outputs are consumed
        return nullcontext() if last or not isinstance(self.model, DDP) else self.model.no_sync()

    def backward(self, loss: torch.Tensor, micro_batches: int) -> None:
        """A micro-batch's loss -> its share of the step's gradients, summed in
        .grad (under --fp16 scaled first, so that small gradients stay fp16 numbers)."""
        share = loss / micro_batches
        (self.scale(share) if self.scale else share).backward()

    def finish(self):
        """Clip, then update the weights unless the gradient norm is inf or NaN.
        Returns (grad norm, found_inf: 1.0 if the step was skipped), on the device.
        Every rank decides alike: the norm is the whole model's (clip_grad_norm_),
        so replicas cannot drift apart; the skip stays on the device: no host read."""
        if parallel.layout.pp_size > 1:  # the averages DDP makes at pp = 1, and the tied embedding's sum
            pipeline.reduce_pipeline_grads(self.raw, self.averager)
        if self.moe_layers:  # the experts' averages, which DDP (or the stages' reduction) left alone
            expert_parallel.reduce_expert_grads(self.raw)
        if self.scaler:
            self.scaler.unscale_(self.raw.parameters())
        grad_norm = clip_grad_norm_(self.raw.parameters(), self.max_norm)
        found_inf = (~torch.isfinite(grad_norm)).float()
        # torch's private protocol (GradScaler's with fused optimizers, no public API): step() reads
        # grad_scale (None: unscaled) and found_inf; where found_inf is 1 the fused kernel leaves weights,
        # moments and step count alone. Without it: `if not found_inf.item(): step()`, a host read.
        self.optimizer.grad_scale, self.optimizer.found_inf = None, found_inf
        self.optimizer.step()
        del self.optimizer.grad_scale, self.optimizer.found_inf
        if self.scaler:
            self.scaler.update(found_inf)
        return grad_norm, found_inf

    def save(self, iteration: int, consumed: int) -> None:
        checkpoint.save_checkpoint(self.cfg, self.raw, self.optimizer, self.scaler, iteration,
                                   consumed, launch.say, self.saver)

    def close(self) -> None:
        if self.saver:
            self.saver.close()


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Clip to the global L2 norm of the full (unsharded) model's grads, already
    averaged over DP; return the norm, like torch's. Replicated grads are the
    same on all TP ranks, so TP rank 0 counts them; the others add theirs times
    0 (0 * inf is NaN: an inf in any rank's copy makes the norm non-finite
    everywhere). A non-finite norm leaves the grads untouched: the caller
    decides. Each pipeline stage adds its own layers' squares (the last
    stage's copy of a tied embedding counts like a replica: times 0); each EP
    rank its own experts' (summed over the EP group; whole experts, expert TP 1, counted on TP rank 0)."""
    lay = parallel.layout
    counted, experts, copies = [], [], []  # copies: replicated grads that another rank counts
    for p in parameters:
        own = (getattr(p, "tensor_model_parallel", False) or lay.tp_rank == 0 or
               getattr(p, "expert_parallel", False) and lay.whole_experts) and not getattr(p, "pipeline_copy", 0)
        if p.grad is not None:
            (experts if own and getattr(p, "expert_parallel", False) else counted if own else copies).append(p.grad)
    grads = counted + experts + copies
    if not grads:
        return torch.tensor(0.0)
    # Every grad's norm in a few launches (foreach): a loop per parameter kept an H200
    # waiting on the host (bench/RESULTS.md). The CPU's norm kernel sums in order (off by
    # 2e-5 over a 3M-element embedding, enough to tell layouts apart): there it sums in fp64.
    fp = torch.float64 if grads[0].device.type == "cpu" else torch.float32
    squares = torch.stack(torch._foreach_norm(grads, 2.0, dtype=fp)).square()
    c, e = len(counted), len(counted) + len(experts)
    sq_experts = squares[c:e].sum().float()
    if lay.ep_size > 1:
        dist.all_reduce(sq_experts, group=lay.ep_group)
    if experts and lay.whole_experts and lay.tp_rank > 0:  # each TP rank holds the EP group's sum: TP rank 0 adds it
        sq_experts = sq_experts * 0.0
    sq = (squares[:c].sum() + squares[e:].sum() * 0.0).float() + sq_experts
    for size, group in ((lay.tp_size, lay.tp_group), (lay.pp_size, lay.pp_group)):
        if size > 1:
            dist.all_reduce(sq, group=group)
    total_norm = sq.sqrt()
    # Decided on device (no host sync): coef = 1 when the norm is small or non-finite.
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    coef = torch.where(torch.isfinite(total_norm), coef, torch.ones_like(coef))
    torch._foreach_mul_(grads, coef)
    return total_norm


# ----------------------------------------------------------------------------
# 4. Evaluation

@torch.no_grad()
def validation_loss(model, mcfg: GPTConfig, dataset, cfg: TrainConfig, device, consumed: int,
                    accum: int) -> float:
    """Mean loss over --eval-iters global batches, averaged over data-parallel
    ranks, with either engine; mcfg: the config its batches are checked against."""
    model.eval()
    it = data_iterator(dataset, cfg, consumed)
    precision = autocast(cfg, device)
    batches = check_batches([next(it) for _ in range(cfg.eval_iters * accum)], mcfg)
    if parallel.layout.cp_size > 1:  # this rank's share of every sequence, and its loss weight
        batches = [context.split_batch(b) for b in batches]
    if parallel.layout.pp_size > 1:  # a global batch at a time through the stages
        losses = [pipeline.pipeline_step(model, batches[i * accum:(i + 1) * accum], cfg, device, precision)
                  for i in range(cfg.eval_iters)]
    else:
        with precision:
            losses = [weighted_loss(model(b["tokens"], b["position_ids"], b["labels"], b["loss_mask"],
                                          document_ids=b.get("document_ids")).float(), b)
                      for b in (to_device(b, device) for b in batches)]
    model.train()
    return parallel.all_reduce_mean(torch.stack(losses).mean(), parallel.layout.dp_cp_group).item()


# ----------------------------------------------------------------------------
# 5. The loop

def train(cfg: TrainConfig, env: launch.Dist) -> None:
    """The whole run in an initialized world (tests call it repeatedly in one world)."""
    preempt = train_ops.Preemption(env.device, cfg.exit_duration_in_mins)  # the time limit counts the setup too
    cfg, accum, global_batch = train_ops.plan_batches(cfg)
    logger = train_ops.Logger(cfg, resume=bool(cfg.load))
    if cfg.domino and parallel.layout.tp_size == 1:
        launch.say("--domino has nothing to overlap at tensor-parallel size 1: it is off")
    if env.device.type == "cuda" and not (cfg.bf16 or cfg.fp16):
        # fp32 matmuls run on CUDA cores at a fraction of tensor-core speed; TF32 keeps fp32
        # storage and range with a 10-bit mantissa in products (as nanoGPT and Megatron).
        torch.set_float32_matmul_precision("high")
        launch.say("fp32 on a GPU: matmuls and attention use TF32 tensor cores; --bf16 is faster still")
    if cfg.deepspeed:  # DeepSpeed owns the optimizer step and the checkpoints
        trainer = zero.DeepSpeedTraining(cfg, env, accum, launch.say, build_model, build_optimizer, clip_grad_norm_)
    else:
        trainer = PlainTraining(cfg, env)
    schedule = train_ops.schedule_to_follow(cfg, trainer.start)
    datasets = build_datasets(cfg, global_batch)
    if datasets[1] is None and cfg.eval_interval > 0 and cfg.eval_iters > 0:
        launch.say(f"no evaluation: --split {cfg.split} gives the validation set no share")
    train_ops.describe_run(cfg, env, trainer.raw.config, global_batch, accum)
    try:
        iteration = loop(cfg, env, trainer, schedule, datasets, logger, preempt, global_batch, accum)
    finally:  # at the end, a stop (SIGTERM) or an error: a checkpoint still being written is published first
        if trainer.saver:  # (its own error, after the loop's, would hide that one: reported only alone)
            trainer.saver.wait(report=sys.exc_info()[0] is None)
    if iteration >= cfg.train_iters and cfg.sample_tokens > 0:
        train_ops.closing_sample(trainer.raw, cfg, env.device)
    logger.close()
    trainer.close()


def loop(cfg: TrainConfig, env: launch.Dist, trainer, schedule: tuple, datasets, logger: train_ops.Logger,
         preempt: train_ops.Preemption, global_batch: int, accum: int) -> int:
    """Train from the trainer's start to --train-iters (or a stop), the learning rate
    following `schedule`; return the last iteration. The host never waits for the GPU
    within an iteration: device values are read only at log intervals, evaluations and
    saves, the preemption vote a step late."""
    preempt.start()  # first: DataLoader workers, forked below, must not inherit the exit at once
    train_ds, valid_ds = datasets
    iteration, consumed = trainer.start.iteration, trainer.start.consumed
    batches, mcfg = data_iterator(train_ds, cfg, consumed), trainer.raw.config
    meter = train_ops.Meter(cfg, env, mcfg, iteration + 1)
    pending, last_saved = [], iteration  # (iteration, loss on the device) since the last check
    since_log = []  # the losses read since the last log line
    dp = parallel.layout.dp_size
    while iteration < cfg.train_iters:
        batch_size = train_ops.global_batch_at(consumed, cfg, dp) if cfg.rampup_batch_size else global_batch
        lr = learning_rate(consumed if cfg.train_samples else iteration, schedule)
        count = batch_size // (cfg.micro_batch_size * dp)  # a whole number: plan_batches checked each batch
        micro_batches = check_batches(list(itertools.islice(batches, count)), mcfg)
        loss, grad_norm, skipped = train_step(trainer, micro_batches, lr)
        iteration, consumed = iteration + 1, consumed + batch_size
        pending.append((iteration, loss))
        last = iteration == cfg.train_iters
        eval_now = valid_ds is not None and cfg.eval_interval > 0 and (iteration % cfg.eval_interval == 0 or last)
        log_now = iteration % cfg.log_interval == 0 or last or eval_now
        meter.count(iteration, batch_size * cfg.seq_length, skipped, log_now)
        stop = preempt.agreed() or bool(cfg.exit_interval and iteration % cfg.exit_interval == 0)
        save_now = cfg.save and (stop or last or bool(cfg.save_interval and iteration % cfg.save_interval == 0))
        if log_now or save_now:
            since_log += train_ops.check_losses(pending, last_saved)
        if log_now:  # the loss logged is the mean since the last log line, as Megatron's
            mean_loss, since_log = sum(since_log) / len(since_log), []
            metrics = {"iteration": iteration, "loss": mean_loss, "lr": lr, "grad_norm": float(grad_norm),
                       **meter.figures(), "batch_size": batch_size, "consumed_samples": consumed}
            if mcfg.num_experts:  # their auxiliary losses, the tokens' spread over the experts, those dropped
                metrics.update(train_ops.moe_figures(trainer.moe_layers))
            if eval_now:
                metrics["val_loss"] = validation_loss(trainer.model, mcfg, valid_ds, cfg, env.device,
                                                      eval_consumed(iteration, cfg, global_batch), accum)
                metrics["val_ppl"] = math.exp(min(metrics["val_loss"], 20.0))
            logger.log(metrics)
        if save_now:
            trainer.save(iteration, consumed)
            last_saved = iteration
        if stop:
            launch.say(f"exiting at iteration {iteration}")
            break
    return iteration


# train.py's command line (train_ops.main): the flags, a user's mistake in one line, then train.
main = functools.partial(train_ops.main, train=train, usage=__doc__)

if __name__ == "__main__":
    main()
