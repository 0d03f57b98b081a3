r"""Pretrain a GPT on Megatron-format token data.

    torchrun --standalone --nproc_per_node 8 train.py --preset 124M \
        --data-path data/shakespeare_text_document --micro-batch-size 8 \
        --global-batch-size 256 --train-iters 5000 --bf16

One file, top to bottom:
  1. TrainConfig: every knob, filled from Megatron-style command-line flags.
  2. Distributed setup from torchrun's environment (nccl on GPU, gloo on CPU),
     tensor- and data-parallel groups (parallel.py).
  3. Model, AdamW (no weight decay on biases and norms), warmup + decay schedule.
  4. Data: datasets and a data-parallel sampler that resumes exactly.
  5. The step: gradient accumulation, mixed precision, clipping.
  6. Evaluation, logging (stdout, JSON lines, TensorBoard), MFU.
  7. Checkpoints that are written atomically and resume bit-exactly.
  8. DeepSpeed ZeRO (--deepspeed): config from these flags, the same AdamW and
     schedule, tensor-parallel mpu, its checkpoints, and weight export.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import data as data_lib
import parallel
from prepare import TokenizerUnavailableError, load_tokenizer
from gpt import GPT, GPTConfig, PRESETS, count_parameters, flops_per_token, init_weights

EOD_TOKEN = 50256  # GPT-2's <|endoftext|>


# ----------------------------------------------------------------------------
# 1. Configuration
# ----------------------------------------------------------------------------

@dataclass
class TrainConfig:
    # model (None means: take it from --preset)
    preset: str | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    ffn_hidden_size: int | None = None
    seq_length: int = 1024
    max_position_embeddings: int | None = None
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    attention_impl: str | None = None   # None: triton on CUDA, torch on CPU
    layernorm_impl: str | None = None
    recompute_activations: bool = False
    # parallelism
    tensor_model_parallel_size: int = 1
    domino: bool = False
    domino_chunks: int = 2
    # batch
    micro_batch_size: int = 4
    global_batch_size: int | None = None  # None: micro batch x data-parallel size
    # optimizer and schedule
    train_iters: int = 1000
    lr: float = 6e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None     # None: train_iters
    lr_decay_style: str = "cosine"        # cosine | linear | constant
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # precision
    bf16: bool = False
    fp16: bool = False
    initial_loss_scale: float = 2.0 ** 16
    compile: bool = False
    # data
    data_path: list[str] = field(default_factory=lambda: ["data/shakespeare_text_document"])
    split: str = "969,30,1"
    data_cache_path: str | None = None
    reset_position_ids: bool = False
    eod_mask_loss: bool = False
    num_workers: int = 0
    # evaluation, logging
    eval_interval: int = 100
    eval_iters: int = 10
    log_interval: int = 10
    metrics_file: str | None = None
    tensorboard_dir: str | None = None
    peak_flops: float | None = None       # per device; None: look up the GPU name
    # checkpoints
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    exit_interval: int | None = None
    no_load_optim: bool = False
    # end-of-run sample
    sample_prompt: str = "ROMEO:"
    sample_tokens: int = 64
    # DeepSpeed ZeRO (section 8); the config is built from the flags above
    deepspeed: bool = False
    zero_stage: int | None = None          # 0-3; None: the --deepspeed_config's, else 1
    deepspeed_config: str | None = None    # DeepSpeed JSON; must agree with the flags above
    zero_offload_optimizer: bool = False   # optimizer states (and the step) on CPU
    partition_activations: bool = False    # with --recompute-activations: split saved inputs over TP
    # weight export from a checkpoint, plain or DeepSpeed (then exit)
    export_from: str | None = None
    export_to: str | None = None
    export_format: str = "plain"           # plain | hf
    # misc
    seed: int = 1234


# --help text for each flag (the dataclass above stays one line a field).
FLAG_HELP = {
    "preset": "model size: " + ", ".join(PRESETS) + "; the model flags below override it",
    "num_layers": "transformer layers", "hidden_size": "model width",
    "num_attention_heads": "attention heads", "ffn_hidden_size": "MLP width (default 4 x hidden)",
    "seq_length": "tokens per sample", "max_position_embeddings": "learned positions (default: preset's, at least --seq-length)",
    "hidden_dropout": "dropout on embeddings and residual branches",
    "attention_dropout": "dropout on attention probabilities",
    "attention_impl": "triton | torch (default: triton on CUDA, torch on CPU)",
    "layernorm_impl": "triton | torch (default: triton on CUDA, torch on CPU)",
    "recompute_activations": "activation checkpointing: recompute each block in backward",
    "tensor_model_parallel_size": "T: ranks that split every layer (consecutive ranks, one node)",
    "domino": "overlap tensor-parallel all-reduces with compute (DeepSpeed-Domino)",
    "domino_chunks": "micro-batch chunks that --domino interleaves",
    "micro_batch_size": "samples per rank per forward/backward",
    "global_batch_size": "samples per optimizer step = micro batch x data-parallel size x accumulation",
    "train_iters": "optimizer steps", "lr": "peak learning rate", "min_lr": "final learning rate",
    "lr_warmup_iters": "linear warmup steps", "lr_decay_iters": "decay steps (default: --train-iters)",
    "adam_beta1": "AdamW beta1", "adam_beta2": "AdamW beta2", "adam_eps": "AdamW epsilon",
    "lr_decay_style": "cosine | linear | constant", "weight_decay": "AdamW decay of matrices (not biases or norms)",
    "clip_grad": "global gradient-norm clipping; 0 disables",
    "bf16": "bf16 autocast", "fp16": "fp16 autocast with dynamic loss scaling",
    "initial_loss_scale": "first loss scale under --fp16", "compile": "torch.compile the model",
    "data_path": "PREFIX, or a weighted blend: W1 PREFIX1 W2 PREFIX2 ...",
    "split": "train,valid,test weights, split by documents",
    "data_cache_path": "where sample-index arrays are cached (default: next to the data)",
    "reset_position_ids": "restart positions after each end-of-text",
    "eod_mask_loss": "no loss on end-of-text positions", "num_workers": "DataLoader workers",
    "eval_interval": "validate every N steps (and at the end); 0 disables",
    "eval_iters": "global batches per validation", "log_interval": "log every N steps",
    "metrics_file": "also write the logged figures as JSON lines here",
    "tensorboard_dir": "also log to TensorBoard here",
    "peak_flops": "peak FLOP/s of one device for MFU (default: by GPU name)",
    "save": "checkpoint directory to write", "load": "checkpoint directory to resume from",
    "save_interval": "save every N steps (and at the end, on SIGTERM and at --exit-interval)",
    "exit_interval": "save and stop after every N steps",
    "no_load_optim": "load weights only (fresh optimizer)",
    "sample_prompt": "prompt of the sample printed at the end", "sample_tokens": "its length; 0 disables",
    "deepspeed": "train through DeepSpeed ZeRO", "zero_stage": "ZeRO stage 0-3 (default 1)",
    "deepspeed_config": "DeepSpeed's JSON config; values must agree with these flags",
    "zero_offload_optimizer": "optimizer states and step on CPU",
    "partition_activations": "with --recompute-activations under DeepSpeed: split saved inputs over TP ranks",
    "export_from": "export the weights of this checkpoint (plain or DeepSpeed), then exit",
    "export_to": "where the export goes", "export_format": "plain (train.py checkpoint) | hf (Hugging Face GPT-2)",
    "seed": "random seed (the same on every rank)",
}

def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Megatron-style flags -> TrainConfig. Flag `--foo-bar` fills field `foo_bar`."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        help = FLAG_HELP.get(f.name, "")
        if f.type == "bool":
            p.add_argument(flag, action="store_true", default=default, help=help)
        elif f.name == "data_path":
            p.add_argument(flag, nargs="+", default=default, help=help + " (default: %(default)s)")
        else:
            kind = {"int": int, "float": float}.get(f.type.split(" ")[0], str)
            p.add_argument(flag, type=kind, default=default, help=help + " (default: %(default)s)")
    p.add_argument("--checkpoint-activations", dest="recompute_activations", action="store_true",
                   help="alias of --recompute-activations (older Megatron name)")
    p.add_argument("--deepspeed_config", dest="deepspeed_config", help=argparse.SUPPRESS)  # DeepSpeed's spelling
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    del args.local_rank  # the deepspeed launcher passes it; torchrun's LOCAL_RANK is what we read
    cfg = TrainConfig(**vars(args))
    validate(cfg)
    return cfg


def validate(cfg: TrainConfig) -> None:
    if cfg.bf16 and cfg.fp16:
        raise ValueError("--bf16 and --fp16 are mutually exclusive: pick one")
    if cfg.lr_decay_style not in ("cosine", "linear", "constant"):
        raise ValueError(f"--lr-decay-style {cfg.lr_decay_style!r}: use cosine, linear or constant")
    if cfg.min_lr > cfg.lr:
        raise ValueError(f"--min-lr {cfg.min_lr} is above --lr {cfg.lr}")
    validate_deepspeed(cfg)
    if cfg.export_from:
        return  # an export reads the model from the checkpoint
    if cfg.preset is None and cfg.num_layers is None:
        raise ValueError("give a model: --preset NAME (one of " + ", ".join(PRESETS) +
                         ") or --num-layers/--hidden-size/--num-attention-heads")


def model_config(cfg: TrainConfig, device: torch.device | None = None) -> GPTConfig:
    """The GPTConfig this run trains: the preset, overridden by explicit flags.

    Kernels default to Triton on CUDA and to torch elsewhere; asking for Triton
    where it cannot run is an error raised by the model.
    """
    overrides = {k: getattr(cfg, k) for k in (
        "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
        "max_position_embeddings") if getattr(cfg, k) is not None}
    overrides.update(hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout,
                     activation_checkpointing=cfg.recompute_activations)
    default_impl = "triton" if device is not None and device.type == "cuda" else "torch"
    overrides["attention_impl"] = cfg.attention_impl or default_impl
    overrides["layernorm_impl"] = cfg.layernorm_impl or default_impl
    if cfg.preset is not None:
        mcfg = GPTConfig.from_preset(cfg.preset, **overrides)
    else:
        mcfg = GPTConfig(**overrides)
    if "max_position_embeddings" not in overrides and mcfg.max_position_embeddings < cfg.seq_length:
        mcfg = dataclasses.replace(mcfg, max_position_embeddings=cfg.seq_length)
    if cfg.seq_length > mcfg.max_position_embeddings:
        raise ValueError(f"--seq-length {cfg.seq_length} exceeds --max-position-embeddings "
                         f"{mcfg.max_position_embeddings}")
    return mcfg


# ----------------------------------------------------------------------------
# 2. Distributed setup
# ----------------------------------------------------------------------------

@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(cfg: TrainConfig) -> Dist:
    """Read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) and build the groups.

    Without torchrun this is a single process. nccl drives GPUs; gloo runs the
    same code on CPU so that every distributed path can be tested anywhere.
    """
    if cfg.domino:
        # One hardware queue: kernels start in launch order, so an all-reduce
        # launched before a GEMM really runs beside it (see parallel.py). Read
        # when the CUDA context is created, so set it before touching the GPU.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend)
    elif cfg.deepspeed and not dist.is_initialized():
        # DeepSpeed always needs a process group, even for one process.
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    parallel.initialize(cfg.tensor_model_parallel_size)
    return Dist(rank, world, local_rank, device)


def all_reduce_mean(x: torch.Tensor, group=None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        x = x.clone()
        dist.all_reduce(x, group=group)
        x /= dist.get_world_size(group)
    return x


def gradient_accumulation_steps(cfg: TrainConfig, dp_size: int) -> int:
    """global batch = micro batch x data-parallel size x accumulation steps."""
    per_step = cfg.micro_batch_size * dp_size
    gbs = cfg.global_batch_size or per_step
    if gbs % per_step != 0:
        raise ValueError(
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
            f"{cfg.micro_batch_size} x data-parallel size {dp_size} = {per_step}; "
            f"use a multiple of {per_step}")
    return gbs // per_step


# ----------------------------------------------------------------------------
# 3. Model, optimizer, schedule
# ----------------------------------------------------------------------------

def build_model(cfg: TrainConfig, device: torch.device) -> GPT:
    mcfg = model_config(cfg, device)
    if cfg.domino:
        mcfg = dataclasses.replace(mcfg, domino_chunks=cfg.domino_chunks)
    # Same seed on every rank: every rank builds the same full model (tensor-
    # parallel ranks keep their slice), so data-parallel replicas start equal.
    torch.manual_seed(cfg.seed)
    return GPT(mcfg).to(device)


def param_ndim(p: torch.nn.Parameter) -> int:
    # ZeRO-3 swaps p.data for an empty 1-D tensor and keeps the real shape in ds_shape.
    return len(p.ds_shape) if hasattr(p, "ds_shape") else p.dim()


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; biases and LayerNorm weights (every tensor with < 2 dims) get no decay."""
    decay = [p for p in model.parameters() if p.requires_grad and param_ndim(p) >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and param_ndim(p) < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kwargs = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    if next(model.parameters()).is_cuda:
        kwargs["fused"] = True
    return torch.optim.AdamW(groups, **kwargs)


def learning_rate(it: int, cfg: TrainConfig) -> float:
    """Linear warmup to --lr, then cosine/linear decay to --min-lr, then constant."""
    if it < cfg.lr_warmup_iters:
        return cfg.lr * (it + 1) / cfg.lr_warmup_iters
    decay_iters = cfg.lr_decay_iters or cfg.train_iters
    if cfg.lr_decay_style == "constant" or it >= decay_iters:
        return cfg.lr if cfg.lr_decay_style == "constant" else cfg.min_lr
    progress = (it - cfg.lr_warmup_iters) / max(1, decay_iters - cfg.lr_warmup_iters)
    if cfg.lr_decay_style == "cosine":
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        coeff = 1.0 - progress
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


# ----------------------------------------------------------------------------
# 4. Data
# ----------------------------------------------------------------------------

def eval_runs(cfg: TrainConfig) -> int:
    """How many times validation runs: every --eval-interval and once at the end."""
    return cfg.train_iters // cfg.eval_interval + 1 if cfg.eval_interval > 0 else 0


def eval_consumed(iteration: int, cfg: TrainConfig, global_batch: int) -> int:
    """Where in the validation set the evaluation at `iteration` starts: each run
    sees fresh samples, as in Megatron (run k at iteration k x --eval-interval,
    the extra final run after the last multiple)."""
    index = iteration // cfg.eval_interval - 1 if iteration % cfg.eval_interval == 0 \
        else cfg.train_iters // cfg.eval_interval
    return index * cfg.eval_iters * global_batch


def build_datasets(cfg: TrainConfig, global_batch: int):
    # The test split is left for offline evaluation; training reads train and valid.
    num_samples = (cfg.train_iters * global_batch, eval_runs(cfg) * cfg.eval_iters * global_batch, 0)
    # Rank 0 builds the index arrays and caches them on disk; the others wait and
    # then load that cache instead of all computing the same arrays at once.
    first = not dist.is_initialized() or dist.get_rank() == 0
    if not first:
        dist.barrier()
    datasets = data_lib.build_train_valid_test_datasets(
        data_path=cfg.data_path, split=cfg.split, num_samples=num_samples,
        seq_length=cfg.seq_length, seed=cfg.seed, cache_dir=cfg.data_cache_path,
        eod_token=EOD_TOKEN, reset_position_ids=cfg.reset_position_ids,
        eod_mask_loss=cfg.eod_mask_loss)
    if first and dist.is_initialized():
        dist.barrier()
    return datasets


def data_iterator(dataset, cfg: TrainConfig, consumed_samples: int):
    """Yields this rank's micro-batches, starting after `consumed_samples` (all ranks)."""
    sampler = data_lib.PretrainingSampler(
        total_samples=len(dataset), consumed_samples=consumed_samples,
        micro_batch_size=cfg.micro_batch_size,
        data_parallel_rank=parallel.dp_rank(), data_parallel_size=parallel.dp_size())
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler,
                                         num_workers=cfg.num_workers, pin_memory=torch.cuda.is_available())
    return iter(loader)


def check_batch(batch: dict, config: GPTConfig) -> dict:
    """Token ids and positions must index the embeddings. Checked here, on the
    host, where it is cheap: on a GPU an out-of-range id fails as an opaque
    device-side assert, and checking there costs a host sync per step."""
    for name, limit in (("tokens", config.padded_vocab_size), ("labels", config.padded_vocab_size),
                        ("position_ids", config.max_position_embeddings)):
        ids = batch[name]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= limit):
            what = ("the data's tokenizer against the model's vocabulary" if name != "position_ids"
                    else "--seq-length against --max-position-embeddings")
            raise ValueError(f"batch {name} must lie in [0, {limit}), got values in "
                             f"[{int(ids.min())}, {int(ids.max())}]; check {what}")
    return batch


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queue (host clocks then time real work); no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------
# 5. The training step
# ----------------------------------------------------------------------------

def autocast(cfg: TrainConfig, device: torch.device):
    if cfg.bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if cfg.fp16:
        return torch.autocast(device.type, dtype=torch.float16)
    return nullcontext()


def train_step(model, optimizer, scaler, batches, cfg: TrainConfig, device, lr: float):
    """One optimizer step over `len(batches)` accumulated micro-batches.

    Returns (loss averaged over micro-batches and data-parallel ranks, grad norm).
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    for i, batch in enumerate(batches):
        batch = to_device(batch, device)
        # DDP all-reduces gradients on every backward; skip that until the last
        # micro-batch so accumulation costs one all-reduce per step.
        last = i == len(batches) - 1
        sync = nullcontext() if last or not isinstance(model, DDP) else model.no_sync()
        with sync:
            with autocast(cfg, device):
                loss = model(batch["tokens"], position_ids=batch["position_ids"],
                             labels=batch["labels"], loss_mask=batch["loss_mask"])
            loss = loss / len(batches)
            (scaler.scale(loss) if scaler else loss).backward()
        total += loss.detach()
    if scaler:
        scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = cfg.clip_grad if cfg.clip_grad > 0 else float("inf")
    grad_norm = parallel.clip_grad_norm_(params, max_norm)
    if scaler:
        scaler.step(optimizer)  # skipped (and the scale lowered) when grads overflowed
        scaler.update()
    else:
        optimizer.step()
    return all_reduce_mean(total, parallel.dp_group()), grad_norm


@torch.no_grad()
def evaluate(model, dataset, cfg: TrainConfig, device, consumed: int, accum: int) -> float:
    """Mean loss over --eval-iters global batches, averaged over data-parallel ranks."""
    model.eval()
    it = data_iterator(dataset, cfg, consumed)
    losses = []
    for _ in range(cfg.eval_iters * accum):
        batch = to_device(next(it), device)
        with autocast(cfg, device):
            losses.append(model(batch["tokens"], position_ids=batch["position_ids"],
                                labels=batch["labels"], loss_mask=batch["loss_mask"]).float())
    model.train()
    return all_reduce_mean(torch.stack(losses).mean(), parallel.dp_group()).item()


# ----------------------------------------------------------------------------
# 6. Logging and MFU
# ----------------------------------------------------------------------------

# Dense bf16 tensor-core peak FLOP/s per device, from the vendors' data sheets.
PEAK_FLOPS = {
    "H200": 989e12, "H100 SXM": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "H100": 989e12,
    "GH200": 989e12, "A100": 312e12, "A10G": 125e12, "A10": 125e12, "L40S": 362e12,
    "L4": 121e12, "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12,
}


def device_peak_flops(cfg: TrainConfig, device: torch.device) -> float | None:
    """Peak FLOP/s of one device: --peak-flops, else by GPU name; None on CPU."""
    if cfg.peak_flops:
        return cfg.peak_flops
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_FLOPS.items():  # first match wins: specific names come first
        if key in name:
            return flops
    return None


class Logger:
    """Prints, and writes the same figures to --metrics-file (JSON lines) and TensorBoard."""

    def __init__(self, cfg: TrainConfig, enabled: bool, resume: bool):
        self.enabled = enabled
        self.file = None
        self.tb = None
        if not enabled:
            return
        if cfg.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.metrics_file)), exist_ok=True)
            self.file = open(cfg.metrics_file, "a" if resume else "w")
        if cfg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(cfg.tensorboard_dir)

    def print(self, msg: str) -> None:
        if self.enabled:
            print(msg, flush=True)

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        parts = [f"iter {metrics['iteration']:>6d}", f"loss {metrics['loss']:.4f}",
                 f"lr {metrics['lr']:.3e}", f"grad norm {metrics['grad_norm']:.3f}",
                 f"tokens/s {metrics['tokens_per_sec']:,.0f}"]
        if metrics.get("mfu") is not None:
            parts.append(f"MFU {100 * metrics['mfu']:.1f}%")
        if "val_loss" in metrics:
            parts.append(f"val loss {metrics['val_loss']:.4f}")
        print(" | ".join(parts), flush=True)
        if self.file:
            self.file.write(json.dumps(metrics) + "\n")
            self.file.flush()
        if self.tb:
            for k, v in metrics.items():
                if k != "iteration" and v is not None:
                    self.tb.add_scalar(f"train/{k}" if k != "val_loss" else "valid/loss", v,
                                       metrics["iteration"])

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()


# ----------------------------------------------------------------------------
# 7. Checkpoints
# ----------------------------------------------------------------------------
# Layout (Megatron's): SAVE/iter_0000100/model_optim_rng.pt and
# SAVE/latest_checkpointed_iteration.txt. A checkpoint directory is written under
# a temporary name and renamed into place; the "latest" file is replaced
# atomically after that. A crash at any point leaves the previous checkpoint
# and the pointer to it intact.

LATEST = "latest_checkpointed_iteration.txt"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def full_optimizer_state(model: GPT, optimizer) -> dict:
    """AdamW state keyed by parameter name, with tensor-parallel shards gathered,
    so that the checkpoint does not depend on the parallel layout."""
    state = {}
    for name, p in model.named_parameters():
        s = optimizer.state.get(p, {})
        state[name] = {k: parallel.gather_like(p, v) if torch.is_tensor(v) and v.shape == p.shape else v
                       for k, v in s.items()}
    return {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}


def load_full_optimizer_state(model: GPT, optimizer, saved: dict) -> None:
    """Inverse of full_optimizer_state: slice this rank's shards, then hand torch
    its own format (parameters numbered in param-group order) so that it places
    every tensor on the right device."""
    names = {id(p): n for n, p in model.named_parameters()}
    state, index = {}, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            if name not in saved["state"]:
                raise KeyError(f"checkpoint has no optimizer state for parameter {name!r}")
            state[index] = {k: parallel.shard_like(p, v) if torch.is_tensor(v) and v.dim() > 0 else v
                            for k, v in saved["state"][name].items()}
            index += 1
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def publish(tmp_dir: str, final_dir: str, pointer: str, pointer_text: str) -> None:
    """Move a completely written checkpoint directory into place, then point
    the `latest` file at it. Both steps are renames, so a crash leaves either
    the old checkpoint and pointer or the new ones."""
    old = final_dir + ".old"
    if os.path.exists(final_dir):  # re-saving an iteration: keep it until the new one is in place
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    shutil.rmtree(old, ignore_errors=True)
    with open(pointer + ".tmp", "w") as f:
        f.write(pointer_text)
    os.replace(pointer + ".tmp", pointer)


def write_plain_checkpoint(save_dir: str, state: dict) -> str:
    """SAVE/iter_N/model_optim_rng.pt + SAVE/latest_checkpointed_iteration.txt."""
    final = os.path.join(save_dir, f"iter_{state['iteration']:07d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    torch.save(state, os.path.join(tmp, "model_optim_rng.pt"))
    publish(tmp, final, os.path.join(save_dir, LATEST), str(state["iteration"]))
    return final


def save_checkpoint(cfg: TrainConfig, model: GPT, optimizer, scaler, iteration: int,
                    consumed_samples: int, logger: Logger) -> None:
    # Every rank takes part: gathering tensor-parallel shards is a collective.
    state = {
        "model": model.full_state_dict(),
        "optimizer": full_optimizer_state(model, optimizer),
        "scaler": scaler.state_dict() if scaler else None,
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "rng": rng_state(),  # rank 0's; all ranks share the seed stream
        "config": dataclasses.asdict(cfg),
        "model_config": dataclasses.asdict(model.config),
    }
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.print(f"saved checkpoint {write_plain_checkpoint(cfg.save, state)}")
    if dist.is_initialized():
        dist.barrier()


def find_checkpoint(load_dir: str) -> str | None:
    latest = os.path.join(load_dir, LATEST)
    if not os.path.exists(latest):
        return None
    with open(latest) as f:
        iteration = int(f.read().strip())
    path = os.path.join(load_dir, f"iter_{iteration:07d}", "model_optim_rng.pt")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{latest} points at iteration {iteration} but {path} is missing")
    return path


def load_checkpoint(cfg: TrainConfig, model: GPT, optimizer, scaler, logger: Logger):
    """Restore everything; returns (iteration, consumed_samples). (0, 0) if none."""
    path = find_checkpoint(cfg.load) if cfg.load else None
    if path is None:
        if cfg.load:
            logger.print(f"no checkpoint in {cfg.load}; starting from scratch")
        return 0, 0
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["optimizer"] is None and not cfg.no_load_optim:
        raise ValueError(f"{path} holds weights only (an --export-to plain export): "
                         f"add --no-load-optim to start fresh optimizer states from it")
    model.load_full_state_dict(state["model"])
    if not cfg.no_load_optim:
        load_full_optimizer_state(model, optimizer, state["optimizer"])
        if scaler and state["scaler"]:
            scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"])
    logger.print(f"loaded checkpoint {path} (iteration {state['iteration']})")
    return state["iteration"], state["consumed_samples"]


# ----------------------------------------------------------------------------
# 8. DeepSpeed ZeRO (--deepspeed)
# ----------------------------------------------------------------------------
# ZeRO (Rajbhandari et al., 2020) removes the data-parallel redundancy of
# model states. With Psi parameters, fp32 AdamW (4 bytes each for weights,
# grads, and 2 x 4 bytes of moments = 16 Psi bytes) and D data-parallel ranks,
# each rank holds:
#     stage 0 (plain DDP)   16 Psi
#     stage 1 (optimizer)    8 Psi + 8 Psi / D      Adam moments sharded
#     stage 2 (+ grads)      4 Psi + 12 Psi / D     gradients reduce-scattered
#     stage 3 (+ params)     16 Psi / D             weights gathered per layer
# The model, AdamW, the learning-rate schedule, data, logging and MFU are the
# plain path's; DeepSpeed owns gradient averaging, accumulation, clipping,
# mixed precision and (sharded) checkpoints. With tensor parallelism ZeRO
# shards over the data-parallel group only (DeepSpeedMPU below).

DS_LATEST = "latest"  # DeepSpeed's own pointer file name, so its tools work on our checkpoints
DS_META = "trainer_state.json"


def validate_deepspeed(cfg: TrainConfig) -> None:
    ds_flags = cfg.zero_stage is not None or cfg.deepspeed_config or cfg.zero_offload_optimizer \
        or cfg.partition_activations
    if ds_flags and not cfg.deepspeed:
        raise ValueError("--zero-stage / --deepspeed_config / --zero-offload-optimizer / "
                         "--partition-activations need --deepspeed")
    if cfg.zero_stage is not None and cfg.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero-stage {cfg.zero_stage}: use 0, 1, 2 or 3")
    if cfg.deepspeed and cfg.domino:
        raise ValueError("--domino is not supported with --deepspeed: drop one of them")
    if cfg.deepspeed and cfg.compile:
        raise ValueError("--compile is not supported with --deepspeed: drop one of them")
    if cfg.partition_activations and not cfg.recompute_activations:
        raise ValueError("--partition-activations needs --recompute-activations")
    if cfg.export_from and not cfg.export_to:
        raise ValueError("--export-from needs --export-to PATH")
    if cfg.export_format not in ("plain", "hf"):
        raise ValueError(f"--export-format {cfg.export_format!r}: use plain or hf")


def import_deepspeed(device: torch.device):
    """Import DeepSpeed; on CPU-only machines, point it at the CPU accelerator
    (before import: it picks one at import time) and skip its shared-memory
    all-reduce op, which otherwise costs a one-off ~100 s C++ build in the
    first initialize; gloo does the same job."""
    if device.type != "cuda":
        os.environ["DS_ACCELERATOR"] = "cpu"
    import warnings
    # DeepSpeed calls torch collectives that torch now marks deprecated, on every step.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    import deepspeed
    import deepspeed.ops
    if device.type != "cuda":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def check_deepspeed_precision(cfg: TrainConfig, accelerator) -> None:
    """DeepSpeed refuses a precision its accelerator does not report; say so in
    our words, before any rank builds a model. (Its CPU accelerator reports fp16
    only on CPUs with AVX512-FP16, bf16 on most.)"""
    for flag, supported in (("fp16", accelerator.is_fp16_supported), ("bf16", accelerator.is_bf16_supported)):
        if getattr(cfg, flag) and not supported():
            raise ValueError(f"--{flag} --deepspeed: DeepSpeed does not support {flag} on this device "
                             f"({accelerator.device_name()}); drop --{flag} (fp32), or use the other "
                             f"16-bit format, or train without --deepspeed")


class DeepSpeedMPU:
    """The "model parallel unit" DeepSpeed asks for, backed by parallel.py's
    groups: ZeRO then shards over the data-parallel group only, and its
    gradient norm counts tensor-parallel shards (params marked
    `tensor_model_parallel`) once per TP rank and replicated params once."""

    def get_model_parallel_rank(self): return parallel.tp_rank()
    def get_model_parallel_world_size(self): return parallel.tp_size()
    def get_model_parallel_group(self): return parallel.tp_group()
    def get_data_parallel_rank(self): return parallel.dp_rank()
    def get_data_parallel_world_size(self): return parallel.dp_size()
    def get_data_parallel_group(self): return parallel.dp_group()
    # Newer DeepSpeed code asks with Megatron-core's names.
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self):
        return dist.get_rank() - parallel.tp_rank()  # TP groups are consecutive ranks


def deepspeed_config(cfg: TrainConfig, dp_size: int, accum: int) -> dict:
    """DeepSpeed's JSON config, from train.py's flags (or checked against them)."""
    ours = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": accum,
        "train_batch_size": cfg.micro_batch_size * dp_size * accum,
        "gradient_clipping": cfg.clip_grad,
        "bf16": {"enabled": cfg.bf16},
        "fp16": {"enabled": cfg.fp16, "initial_scale_power": int(math.log2(cfg.initial_loss_scale))},
    }
    user = {}
    if cfg.deepspeed_config:
        with open(cfg.deepspeed_config) as f:
            user = json.load(f)
        check_deepspeed_config(user, ours, cfg)
    config = {**user, **ours}
    zero = dict(user.get("zero_optimization", {}))
    if cfg.zero_stage is not None:
        zero["stage"] = cfg.zero_stage
    zero.setdefault("stage", 1)
    if cfg.zero_offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config["zero_optimization"] = zero
    for key in ("bf16", "fp16"):
        config[key] = {**user.get(key, {}), **ours[key]}
    if zero["stage"] == 0 and not (cfg.bf16 or cfg.fp16):
        # DeepSpeed's fp32 stage-0 clipping sums the squared norms in float64 on
        # the host, so its clip factor differs from the plain path's in the last
        # bit; Adam amplifies that on near-zero gradients into a visible drift.
        # It also reports no norm here. So we clip (and measure) ourselves.
        config["gradient_clipping"] = 0.0
    # Our torch AdamW runs inside ZeRO (incl. offload: no DeepSpeed CPU-Adam build).
    config.update(zero_allow_untested_optimizer=True, zero_force_ds_cpu_optimizer=False)
    config.setdefault("steps_per_print", 10 ** 9)  # we log ourselves
    return config


def check_deepspeed_config(user: dict, ours: dict, cfg: TrainConfig) -> None:
    """A value in the JSON that contradicts a flag is an error, never silently one of them."""
    for key in ("optimizer", "scheduler"):
        if key in user:
            raise ValueError(f"--deepspeed_config {cfg.deepspeed_config}: remove the {key!r} section; "
                             f"train.py passes its own AdamW and learning-rate schedule "
                             f"(--lr, --lr-warmup-iters, --lr-decay-style, ...)")
    flags = {"train_micro_batch_size_per_gpu": "--micro-batch-size",
             "gradient_accumulation_steps": "--global-batch-size",
             "train_batch_size": "--global-batch-size", "gradient_clipping": "--clip-grad"}
    for key, flag in flags.items():
        if key in user and user[key] != ours[key]:
            raise ValueError(f"--deepspeed_config {cfg.deepspeed_config}: {key}={user[key]} contradicts "
                             f"{flag} (which gives {ours[key]}); make them agree or drop the key")
    for key in ("bf16", "fp16"):
        enabled = user.get(key, {}).get("enabled", False)
        if enabled != ours[key]["enabled"]:
            raise ValueError(f"--deepspeed_config {cfg.deepspeed_config}: {key}.enabled={enabled} "
                             f"contradicts --{key} being {'on' if ours[key]['enabled'] else 'off'}")
    stage = user.get("zero_optimization", {}).get("stage")
    if cfg.zero_stage is not None and stage is not None and stage != cfg.zero_stage:
        raise ValueError(f"--deepspeed_config {cfg.deepspeed_config}: zero_optimization.stage={stage} "
                         f"contradicts --zero-stage {cfg.zero_stage}")


def build_model_zero3(cfg: TrainConfig, ds, ds_config: dict) -> GPT:
    """Build the model under deepspeed.zero.Init: each layer's parameters are
    partitioned over the data-parallel group as soon as the layer is built,
    so no rank ever holds the full model.

    GPT initializes each piece after it is built, when zero.Init has already
    partitioned (emptied) it, so that init does nothing here; we redo it one
    module at a time on gathered weights. Only init_weights draws random
    numbers (GPT._build), so the RNG stream, and the weights, are those of
    build_model.

    With tensor parallelism GPT slices each layer's full weight right after
    initializing it, which needs whole weights, so that case is built outside
    zero.Init: each rank then holds its 1/T slices plus one full layer at a
    time, never the full model, and deepspeed.initialize partitions the
    slices over the data-parallel group.
    """
    if parallel.tp_size() > 1:
        return build_model(cfg, torch.device("cpu"))
    mcfg = model_config(cfg, torch.device(ds.get_accelerator().device_name()))
    torch.manual_seed(cfg.seed)
    with ds.zero.Init(data_parallel_group=parallel.dp_group(), config_dict_or_path=ds_config):
        model = GPT(mcfg)
    for module in model.modules():
        params = list(module.parameters(recurse=False))
        if params:
            with ds.zero.GatheredParameters(params, modifier_rank=0):  # Linear/Embedding/LayerNorm
                init_weights(module, mcfg)
    return model


class Schedule(torch.optim.lr_scheduler.LRScheduler):
    """learning_rate(step) as a torch scheduler, for DeepSpeed to step and
    checkpoint. It sets the value itself (LambdaLR's lr * factor would be off
    by an ulp, enough to drift from the plain path over many steps)."""

    def __init__(self, optimizer, cfg: TrainConfig):
        self.cfg = cfg
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [learning_rate(self.last_epoch, self.cfg)] * len(self.optimizer.param_groups)


def init_deepspeed(cfg: TrainConfig, env: Dist, accum: int, logger: Logger):
    """Model + our AdamW + our schedule -> a DeepSpeed engine, resumed from
    --load if there is a checkpoint. Returns (engine, iteration, consumed)."""
    ds = import_deepspeed(env.device)
    check_deepspeed_precision(cfg, ds.accelerator.get_accelerator())
    ds.init_distributed(dist_backend="nccl" if env.device.type == "cuda" else "gloo")
    mpu = DeepSpeedMPU() if parallel.tp_size() > 1 else None
    config = deepspeed_config(cfg, parallel.dp_size(), accum)
    stage = config["zero_optimization"]["stage"]
    model = build_model_zero3(cfg, ds, config) if stage == 3 else build_model(cfg, env.device)
    if cfg.recompute_activations:
        # DeepSpeed's recomputation; optionally each TP rank keeps 1/T of the saved inputs.
        ds.checkpointing.configure(DeepSpeedMPU(), partition_activations=cfg.partition_activations)
        model.checkpoint_fn = ds.checkpointing.checkpoint
    optimizer = build_optimizer(model, cfg)
    # A callable: DeepSpeed builds the scheduler on its own (ZeRO-wrapped)
    # optimizer, whose param groups are the ones that reach the update.
    schedule = lambda opt: Schedule(opt, cfg)
    engine, _, _, _ = ds.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule,
                                    config=config, mpu=mpu)
    if engine.dp_world_size != parallel.dp_size():
        raise RuntimeError(f"DeepSpeed shards over {engine.dp_world_size} ranks but the data-parallel "
                           f"size is {parallel.dp_size()} (world / T): the mpu was not applied")
    iteration, consumed = load_deepspeed_checkpoint(cfg, engine, logger) if cfg.load else (0, 0)
    return engine, iteration, consumed


def clips_itself(engine, cfg: TrainConfig) -> bool:
    """Whether train.py, not DeepSpeed, clips gradients (see deepspeed_config)."""
    return engine.zero_optimization_stage() == 0 and not (cfg.bf16 or cfg.fp16)


def deepspeed_train_step(engine, batches, cfg: TrainConfig, device):
    """One optimizer step over the accumulated micro-batches, the DeepSpeed way:
    engine.backward scales each micro-batch's loss by 1/accumulation itself
    (our plain path divides explicitly), averages gradients over the
    data-parallel group, and engine.step only updates (with clipping) on the
    last micro-batch. Returns (loss averaged like train_step's, grad norm)."""
    total = torch.zeros((), device=device)
    grad_norm = None
    for i, batch in enumerate(batches):
        batch = to_device(batch, device)
        loss = engine(batch["tokens"], position_ids=batch["position_ids"],
                      labels=batch["labels"], loss_mask=batch["loss_mask"])
        engine.backward(loss)
        if i == len(batches) - 1 and clips_itself(engine, cfg):
            # Plain fp32 engine (stage 0): we clip the averaged grads ourselves;
            # see deepspeed_config.
            max_norm = cfg.clip_grad if cfg.clip_grad > 0 else float("inf")
            grad_norm = parallel.clip_grad_norm_([p for p in engine.module.parameters()
                                                  if p.grad is not None], max_norm)
        engine.step()
        total += loss.detach().float() / len(batches)
    if grad_norm is None:
        grad_norm = engine.get_global_grad_norm()
    return all_reduce_mean(total, parallel.dp_group()), float(grad_norm)


def tensor_parallel_layout(model: torch.nn.Module) -> dict:
    """{name: [partition_dim, partition_stride]} of every TP-sharded parameter:
    what an export needs to merge the shards of any T."""
    return {name: [p.partition_dim, p.partition_stride] for name, p in model.named_parameters()
            if getattr(p, "tensor_model_parallel", False)}


def save_deepspeed_checkpoint(cfg: TrainConfig, engine, iteration: int, consumed: int,
                              logger: Logger) -> None:
    """engine.save_checkpoint under a temporary tag, renamed into place by rank
    0 after every rank has written, then the `latest` file replaced atomically:
    a crash at any moment leaves the previous checkpoint and pointer intact."""
    tag = f"iter_{iteration:07d}"
    final, tmp = os.path.join(cfg.save, tag), os.path.join(cfg.save, tag + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    client_state = {"iteration": iteration, "consumed_samples": consumed, "rng": rng_state(),
                    "config": dataclasses.asdict(cfg)}
    engine.save_checkpoint(cfg.save, tag=tag + ".tmp", client_state=client_state, save_latest=False)
    dist.barrier()
    if dist.get_rank() == 0:
        meta = {"iteration": iteration, "consumed_samples": consumed,
                "zero_stage": engine.zero_optimization_stage(),
                "data_parallel_size": parallel.dp_size(),
                "tensor_model_parallel_size": parallel.tp_size(),
                "model_config": dataclasses.asdict(engine.module.config),
                "tensor_parallel_layout": tensor_parallel_layout(engine.module)}
        with open(os.path.join(tmp, DS_META), "w") as f:
            json.dump(meta, f, indent=1)
        publish(tmp, final, os.path.join(cfg.save, DS_LATEST), tag)
        logger.print(f"saved checkpoint {final}")
    dist.barrier()


def read_deepspeed_checkpoint(path: str) -> tuple[str, dict]:
    """(tag directory, trainer_state.json) of the checkpoint `latest` points at."""
    latest = os.path.join(path, DS_LATEST)
    if not os.path.exists(latest):
        hint = " (a plain checkpoint: load it without --deepspeed)" \
            if os.path.exists(os.path.join(path, LATEST)) else ""
        raise FileNotFoundError(f"no DeepSpeed checkpoint in {path}: {latest} is missing{hint}")
    with open(latest) as f:
        tag_dir = os.path.join(path, f.read().strip())
    with open(os.path.join(tag_dir, DS_META)) as f:
        return tag_dir, json.load(f)


def load_deepspeed_checkpoint(cfg: TrainConfig, engine, logger: Logger) -> tuple[int, int]:
    if not os.path.exists(os.path.join(cfg.load, DS_LATEST)):
        logger.print(f"no DeepSpeed checkpoint in {cfg.load}; starting from scratch")
        return 0, 0
    tag_dir, meta = read_deepspeed_checkpoint(cfg.load)
    layout = {"data-parallel": (meta["data_parallel_size"], parallel.dp_size()),
              "tensor-parallel": (meta["tensor_model_parallel_size"], parallel.tp_size())}
    for name, (saved, now) in layout.items():
        if saved != now and (name == "tensor-parallel" or meta["zero_stage"] > 0):
            raise ValueError(
                f"{tag_dir} was written with {name} size {saved}, this run has {now}: ZeRO and "
                f"tensor-parallel shards only fit the layout they were written with. Relaunch with "
                f"the old layout, or continue from the weights: `python train.py --export-from "
                f"{cfg.load} --export-to NEW --export-format plain`, then --load NEW "
                f"--no-load-optim (fresh optimizer states), or convert the optimizer states with "
                f"DeepSpeed's universal checkpoint (python -m deepspeed.checkpoint.ds_to_universal; "
                f"data-parallel changes only)")
    load_optim = not cfg.no_load_optim
    _, client = engine.load_checkpoint(cfg.load, tag=os.path.basename(tag_dir),
                                       load_optimizer_states=load_optim,
                                       load_lr_scheduler_states=load_optim)
    set_rng_state(client["rng"])
    logger.print(f"loaded checkpoint {tag_dir} (iteration {client['iteration']})")
    return client["iteration"], client["consumed_samples"]


def consolidated_weights(path: str) -> tuple[dict, dict]:
    """Full fp32 weights and trainer_state of the DeepSpeed checkpoint in
    `path`, for any ZeRO stage and any T, with no process group.

    Per TP rank r, DeepSpeed's zero_to_fp32 merges the data-parallel
    partitions (fp32 master weights) of that rank's files; it refuses several
    TP ranks at once, so each rank's files are shown to it alone. The TP
    shards are then concatenated along their split dimension."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    tag_dir, meta = read_deepspeed_checkpoint(path)
    shards = []
    for r in range(meta["tensor_model_parallel_size"]):
        files = sorted(glob.glob(os.path.join(tag_dir, f"*mp_rank_{r:02d}_*.pt")))
        if meta["zero_stage"] == 0:  # no ZeRO partitions: the module's own state dict
            module = torch.load(files[0], map_location="cpu", weights_only=False)["module"]
            shards.append({k: v.float() for k, v in module.items()})
            continue
        with tempfile.TemporaryDirectory() as tmp:
            os.makedirs(os.path.join(tmp, "rank"))
            for f in files:
                os.symlink(os.path.abspath(f), os.path.join(tmp, "rank", os.path.basename(f)))
            shards.append(get_fp32_state_dict_from_zero_checkpoint(tmp, tag="rank"))
    layout = meta["tensor_parallel_layout"]
    full = {name: parallel.merge_shards([s[name] for s in shards], *layout[name]) if name in layout
            else t for name, t in shards[0].items()}
    return full, meta


def export_weights(checkpoint: str, out: str, fmt: str = "plain") -> None:
    """Write the consolidated fp32 weights of a checkpoint (train.py's own, or
    DeepSpeed's from any ZeRO stage and T) as
    fmt="plain": the project's checkpoint layout (OUT/iter_N/model_optim_rng.pt
                 + latest_checkpointed_iteration.txt), weights only: resume
                 it with --load OUT --no-load-optim (any layout, with or
                 without --deepspeed);
    fmt="hf":    a Hugging Face GPT-2 directory (GPT.to_hf)."""
    if parallel.tp_size() > 1:
        raise RuntimeError("export_weights builds a T=1 model: call it outside a tensor-parallel job")
    plain = find_checkpoint(checkpoint)
    if plain:  # train.py's own checkpoint: already full weights
        state = torch.load(plain, map_location="cpu", weights_only=False)
        full, model_config = state["model"], state["model_config"]
    else:
        full, meta = consolidated_weights(checkpoint)
        tag_dir, _ = read_deepspeed_checkpoint(checkpoint)
        client = torch.load(glob.glob(os.path.join(tag_dir, "*mp_rank_00_model_states.pt"))[0],
                            map_location="cpu", weights_only=False)
        state = {"iteration": meta["iteration"], "consumed_samples": meta["consumed_samples"],
                 "rng": client["rng"], "config": client["config"]}
        model_config = meta["model_config"]
    model = GPT(GPTConfig(**model_config))  # T=1, on CPU
    model.load_full_state_dict(full)
    if fmt == "hf":
        model.to_hf(out)
        return
    state = {"model": model.full_state_dict(), "optimizer": None, "scaler": None,
             "iteration": state["iteration"], "consumed_samples": state["consumed_samples"],
             "rng": state["rng"], "config": state["config"], "model_config": model_config}
    write_plain_checkpoint(out, state)


# ----------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------

class Preemption:
    """Turns SIGTERM (a cluster's preemption notice) into a flag the loop checks.

    Every rank must stop (and save) at the same iteration, so the ranks vote
    with an all-reduce. Reading a vote right away would make the host wait
    for the GPU at every step, and the GPU would then idle while the host
    queues the next step. On CUDA each step's vote is therefore read one step
    later, once the next step is queued: the ranks still agree, one step
    after the signal."""

    def __init__(self, device: torch.device):
        self.device = device
        self.requested = False
        self.pending = None  # CUDA: (event, pinned host copy) of the last vote
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame):
        self.requested = True

    def agreed(self) -> bool:
        """True on every rank, at the same iteration, once any rank got SIGTERM."""
        vote = torch.tensor([float(self.requested)], device=self.device)
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


def check_losses(pending: list, logger: Logger, last_saved: int) -> float:
    """Read the (iteration, device loss) pairs queued since the last check in
    one host sync, stop the run at the first non-finite one, and return the
    latest value. Checked at log intervals and before every save, never per
    step: a per-step .item() would stall the GPU queue."""
    values = torch.stack([loss.float() for _, loss in pending]).tolist()
    for (iteration, _), value in zip(pending, values):
        if not math.isfinite(value):
            logger.print(f"error: loss is {value} at iteration {iteration}; stopping without "
                         f"saving (last good checkpoint: iteration {last_saved}). Lower --lr, "
                         f"raise --lr-warmup-iters, or use --bf16 instead of --fp16.")
            raise SystemExit(1)
    pending.clear()
    return values[-1]


def sample_text(model: GPT, cfg: TrainConfig, device) -> str:
    enc = load_tokenizer()  # TokenizerUnavailableError says how to seed TIKTOKEN_CACHE_DIR
    ids = torch.tensor([enc.encode_ordinary(cfg.sample_prompt)], device=device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)  # same on every tensor-parallel rank
    out = model.generate(ids, max_new_tokens=cfg.sample_tokens, temperature=0.8, top_k=200,
                         eos_token_id=EOD_TOKEN, generator=gen)
    return enc.decode([t for t in out[0].tolist() if t < EOD_TOKEN])


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    if cfg.export_from:
        export_weights(cfg.export_from, cfg.export_to, cfg.export_format)
        print(f"exported {cfg.export_from} -> {cfg.export_to} ({cfg.export_format})")
        return
    env = init_distributed(cfg)
    train(cfg, env)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def train(cfg: TrainConfig, env: Dist) -> None:
    """The whole run in an initialized world (tests call it repeatedly in one world)."""
    accum = gradient_accumulation_steps(cfg, parallel.dp_size())
    global_batch = cfg.micro_batch_size * parallel.dp_size() * accum
    logger = Logger(cfg, enabled=env.is_main, resume=bool(cfg.load))
    if env.device.type == "cuda" and not (cfg.bf16 or cfg.fp16):
        # Plain fp32 matmuls run on CUDA cores at a fraction of the tensor
        # cores' speed; TF32 keeps fp32 storage and range with a 10-bit
        # mantissa in the products (nanoGPT and Megatron train fp32 this way).
        torch.set_float32_matmul_precision("high")
        logger.print("fp32 on a GPU: matmuls and attention use TF32 tensor cores; "
                     "--bf16 is faster still")

    if cfg.deepspeed:  # section 8: DeepSpeed owns the optimizer step and checkpoints
        model, iteration, consumed = init_deepspeed(cfg, env, accum, logger)
        raw_model = model.module
        step = lambda batches, lr: deepspeed_train_step(model, batches, cfg, env.device)
        save = lambda it, consumed: save_deepspeed_checkpoint(cfg, model, it, consumed, logger)
    else:
        raw_model = build_model(cfg, env.device)
        optimizer = build_optimizer(raw_model, cfg)
        scaler = torch.amp.GradScaler(env.device.type, init_scale=cfg.initial_loss_scale) if cfg.fp16 else None
        iteration, consumed = load_checkpoint(cfg, raw_model, optimizer, scaler, logger)
        model = raw_model
        if cfg.compile:
            model = torch.compile(model)
        if parallel.dp_size() > 1:
            model = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None,
                        process_group=parallel.dp_group())
        step = lambda batches, lr: train_step(model, optimizer, scaler, batches, cfg, env.device, lr)
        save = lambda it, consumed: save_checkpoint(cfg, raw_model, optimizer, scaler, it, consumed, logger)
    train_ds, valid_ds, _ = build_datasets(cfg, global_batch)
    train_iter = data_iterator(train_ds, cfg, consumed)

    mcfg = raw_model.config
    flops_tok = flops_per_token(mcfg, cfg.seq_length)
    peak = device_peak_flops(cfg, env.device)
    logger.print(f"model: {count_parameters(raw_model.config):,} parameters | world {env.world_size} = "
                 f"TP {parallel.tp_size()} x DP {parallel.dp_size()} | global batch {global_batch} "
                 f"= {cfg.micro_batch_size} x {parallel.dp_size()} x {accum} accumulation | "
                 f"device {env.device}")

    # Nothing in an iteration waits for the GPU except at log intervals,
    # evaluations and saves: the host keeps queueing work and the GPU never
    # runs dry between steps (see Preemption and check_losses).
    preempt = Preemption(env.device)
    pending_losses = []  # (iteration, loss on device) since the last check
    first_iteration = iteration + 1
    t0, tokens_since = time.time(), 0
    last_saved = iteration
    while iteration < cfg.train_iters:
        lr = learning_rate(iteration, cfg)
        batches = [check_batch(next(train_iter), mcfg) for _ in range(accum)]
        loss, grad_norm = step(batches, lr)
        iteration += 1
        consumed += global_batch
        tokens_since += global_batch * cfg.seq_length
        pending_losses.append((iteration, loss))
        last = iteration == cfg.train_iters
        eval_now = valid_ds is not None and cfg.eval_interval > 0 and (
            iteration % cfg.eval_interval == 0 or last)
        log_now = iteration % cfg.log_interval == 0 or last or eval_now
        if iteration == first_iteration:
            # The first step compiles (and, with Triton kernels, autotunes):
            # report it alone, and keep it out of the next logged tokens/s.
            synchronize(env.device)
            logger.print(f"first step (iteration {iteration}) took {time.time() - t0:.1f} s, "
                         f"compilation and autotuning included")
            if not log_now:
                t0, tokens_since = time.time(), 0
        stop = preempt.agreed() or (cfg.exit_interval and iteration % cfg.exit_interval == 0)
        save_now = cfg.save and (stop or last or (cfg.save_interval and iteration % cfg.save_interval == 0))
        if log_now or save_now:
            loss_value = check_losses(pending_losses, logger, last_saved)
        if log_now:
            synchronize(env.device)
            tps = tokens_since / max(time.time() - t0, 1e-9)
            metrics = {"iteration": iteration, "loss": loss_value, "lr": lr,
                       "grad_norm": float(grad_norm), "tokens_per_sec": tps,
                       "mfu": flops_tok * tps / (peak * env.world_size) if peak else None}
            if eval_now:
                metrics["val_loss"] = evaluate(model, valid_ds, cfg, env.device,
                                               eval_consumed(iteration, cfg, global_batch), accum)
            logger.log(metrics)
            t0, tokens_since = time.time(), 0
        if save_now:
            save(iteration, consumed)
            last_saved = iteration
        if stop:
            logger.print(f"exiting at iteration {iteration}")
            break

    if iteration >= cfg.train_iters and cfg.sample_tokens > 0:
        try:
            text = sample_text(raw_model, cfg, env.device)
            logger.print("-" * 40 + " sample " + "-" * 40 + "\n" + text + "\n" + "-" * 88)
        except TokenizerUnavailableError as e:  # training is done and saved: just say why
            logger.print(f"no sample printed: {e}")
    logger.close()
    if cfg.deepspeed:
        model.destroy()  # without it ZeRO-3 under gloo sometimes aborts at exit


if __name__ == "__main__":
    main()
