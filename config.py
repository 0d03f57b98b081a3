"""The run's configuration: Megatron-style flags -> TrainConfig, checked once,
and what it describes: the GPTConfig, the model, AdamW and the learning-rate
schedule. train.py, zero.py and checkpoint.py all read it; it imports none of them.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field

import torch

from gpt import GPT, GPTConfig, PRESETS

USAGE = """Pretrain a GPT on Megatron-format token data.

    torchrun --standalone --nproc_per_node 8 train.py --preset 124M \\
        --data-path data/shakespeare_text_document --micro-batch-size 8 \\
        --global-batch-size 256 --train-iters 5000 --bf16
"""

# ----------------------------------------------------------------------------
# 1. Flags
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
    # DeepSpeed ZeRO (zero.py); its JSON config is built from the flags above
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
    "tensor_model_parallel_size": "tp: ranks that split every layer (consecutive ranks, one node)",
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
    # allow_abbrev=False, as in Megatron: a prefix such as --recompute must not
    # silently mean --recompute-activations (nor --init mean --initial-loss-scale).
    p = argparse.ArgumentParser(prog="train.py", description=USAGE, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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


# ----------------------------------------------------------------------------
# 2. What the flags describe: batch split, model, optimizer, schedule
# ----------------------------------------------------------------------------

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
