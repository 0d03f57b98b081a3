"""The run's configuration: Megatron-style flags -> TrainConfig, checked once,
and what it describes: the GPTConfig, the model, AdamW and the learning-rate
schedule. train.py, zero.py and checkpoint.py all read it; it imports none of them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

import torch

import parallel
from gpt import GPT, GPTConfig, PRESETS, pad_vocab_size

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
    init_method_std: float | None = None  # None: the model's 0.02
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    attention_impl: str | None = None   # None: triton on CUDA, torch on CPU
    layernorm_impl: str | None = None
    loss_impl: str = "fused"              # fused (gpt.fused_lm_loss, no full logits) | full
    recompute_activations: bool = False
    # architecture options (None / off: the preset's, GPT-2's by default)
    position_embedding_type: str | None = None  # learned_absolute | rope
    rotary_base: float | None = None
    rotary_percent: float | None = None
    normalization: str | None = None            # LayerNorm | RMSNorm
    swiglu: bool = False
    untie_embeddings_and_output_weights: bool = False
    disable_bias_linear: bool = False
    group_query_attention: bool = False
    num_query_groups: int | None = None
    # parallelism
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1  # accepted for Megatron recipes; only 1
    distributed_backend: str | None = None  # nccl | gloo; None: nccl on GPUs, gloo on CPU
    ddp_impl: str = "torch"                  # torch | local: both mean torch DDP here
    distributed_timeout_minutes: float = 10.0  # a collective waiting longer is an error (Megatron's default)
    domino: bool = False
    domino_chunks: int = 2
    sequence_parallel: bool = False
    # batch
    micro_batch_size: int = 4
    global_batch_size: int | None = None  # None: micro batch x data-parallel size
    rampup_batch_size: list[int] | None = None  # START INCREMENT SAMPLES (with --train-samples)
    # optimizer and schedule: counted in iterations, or with --train-samples in samples
    train_iters: int = 1000               # with --train-samples: computed from it
    train_samples: int | None = None
    optimizer: str = "adam"               # AdamW (Megatron's "adam" is AdamW too)
    lr: float = 6e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_warmup_fraction: float | None = None  # of the decay span; instead of the two above
    lr_decay_iters: int | None = None     # None: train_iters
    lr_decay_samples: int | None = None   # None: train_samples
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
    data_impl: str = "mmap"               # Megatron's only format in use; the only one here
    tokenizer_type: str = "GPT2BPETokenizer"
    vocab_file: str | None = None         # if given: checked to be GPT-2's BPE vocabulary
    merge_file: str | None = None         # if given: checked to be GPT-2's BPE merges
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
    tensorboard_queue_size: int = 1000
    peak_flops: float | None = None       # per device; None: look up the GPU name
    # checkpoints
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    exit_interval: int | None = None
    keep_last_checkpoints: int | None = None  # None: keep all
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False                 # weights only; iteration, samples, schedule from 0
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
    # zero-shot evaluation of a checkpoint (evaluate.py; Megatron's tasks/zeroshot_gpt)
    task: str | None = None                # WIKITEXT103 | LAMBADA
    valid_data: str | None = None          # the task's file: raw WikiText, or LAMBADA JSON lines
    overlapping_eval: int | None = None    # WikiText window stride in tokens; None: --seq-length
    strict_lambada: bool = False           # target: the whole last word, not its last BPE token
    hf: str | None = None                  # evaluate a Hugging Face GPT-2 directory instead of --load
    # sampling from a checkpoint (evaluate.py --task GENERATE; Megatron's generate_samples_gpt)
    sample_input_file: str | None = None   # one prompt a line; None: unconditional
    sample_output_file: str | None = None  # JSON lines; None: print
    num_samples: int = 0                   # unconditional samples (without --sample-input-file)
    out_seq_length: int = 256              # tokens to generate per sample (fewer at <|endoftext|>)
    temperature: float = 1.0               # 0: greedy
    top_k: int = 0                         # 0: off
    top_p: float = 0.0                     # 0: off
    # misc
    seed: int = 1234


# --help text for each flag (the dataclass above stays one line a field).
FLAG_HELP = {
    "preset": "model size: " + ", ".join(PRESETS) + "; the model flags below override it",
    "num_layers": "transformer layers", "hidden_size": "model width",
    "num_attention_heads": "attention heads", "ffn_hidden_size": "MLP width (default 4 x hidden)",
    "seq_length": "tokens per sample", "max_position_embeddings": "learned positions (default: preset's, at least --seq-length)",
    "init_method_std": "std of the normal weight init (default 0.02)",
    "make_vocab_size_divisible_by": "pad the embedding rows to a multiple of this (TP size must divide the result)",
    "pipeline_model_parallel_size": "accepted for Megatron recipes: only 1 (no pipeline parallelism)",
    "distributed_backend": "nccl | gloo (default: nccl on GPUs, gloo on CPU)",
    "ddp_impl": "torch | local: both are torch DDP here",
    "distributed_timeout_minutes": "process-group timeout: a collective (or the start-up) waiting longer fails",
    "rampup_batch_size": "grow the global batch from START by INCREMENT over SAMPLES samples (needs --train-samples)",
    "train_samples": "train on this many samples instead of --train-iters (schedule counted in samples)",
    "optimizer": "adam (AdamW)",
    "lr_warmup_samples": "linear warmup samples (with --train-samples)",
    "lr_decay_samples": "decay samples (default: --train-samples)",
    "lr_warmup_fraction": "warmup as a fraction of the decay span, instead of --lr-warmup-iters/-samples",
    "data_impl": "mmap (Megatron's .bin/.idx; alias --dataset-impl)",
    "tokenizer_type": "GPT2BPETokenizer (the only one)",
    "vocab_file": "GPT-2's gpt2-vocab.json, checked if given", "merge_file": "GPT-2's gpt2-merges.txt, checked if given",
    "tensorboard_queue_size": "TensorBoard events buffered before a write",
    "no_load_rng": "do not restore the RNG states from --load",
    "finetune": "start from --load's weights: iteration, samples, optimizer and schedule from zero",
    "hidden_dropout": "dropout on embeddings and residual branches",
    "attention_dropout": "dropout on attention probabilities",
    "attention_impl": "triton | torch (default: triton on CUDA, torch on CPU)",
    "layernorm_impl": "triton | torch (default: triton on CUDA, torch on CPU)",
    "loss_impl": "fused: LM head + cross-entropy in chunks, never the full fp32 logits (gpt.fused_lm_loss); "
                 "full: the logits, then the loss (for comparison)",
    "recompute_activations": "activation checkpointing: recompute each block in backward",
    "position_embedding_type": "learned_absolute | rope (default: the preset's, learned_absolute)",
    "rotary_base": "RoPE base theta (default 10000)",
    "rotary_percent": "fraction of each head's dims that RoPE rotates (default 1.0)",
    "normalization": "LayerNorm | RMSNorm (default: the preset's, LayerNorm)",
    "swiglu": "gated SiLU MLP (three matrices); --ffn-hidden-size keeps its meaning",
    "untie_embeddings_and_output_weights": "an LM head of its own instead of the token embedding",
    "disable_bias_linear": "no biases in the linear layers",
    "group_query_attention": "grouped-query attention: needs --num-query-groups",
    "num_query_groups": "key/value heads under --group-query-attention; divides the heads "
                        "(and is divisible by --tensor-model-parallel-size)",
    "tensor_model_parallel_size": "tp: ranks that split every layer (consecutive ranks, one node)",
    "domino": "overlap tensor-parallel all-reduces with compute (DeepSpeed-Domino)",
    "domino_chunks": "micro-batch chunks that --domino interleaves",
    "sequence_parallel": "split LayerNorms, dropouts and residual adds along the sequence over the "
                         "tensor-parallel ranks (activation memory / tp); needs "
                         "--tensor-model-parallel-size > 1",
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
    "keep_last_checkpoints": "after each save, delete all but the newest K checkpoints (default: keep all)",
    "sample_prompt": "prompt of the sample printed at the end", "sample_tokens": "its length; 0 disables",
    "deepspeed": "train through DeepSpeed ZeRO", "zero_stage": "ZeRO stage 0-3 (default 1)",
    "deepspeed_config": "DeepSpeed's JSON config; values must agree with these flags",
    "zero_offload_optimizer": "optimizer states and step on CPU",
    "partition_activations": "with --recompute-activations under DeepSpeed: split saved inputs over TP ranks",
    "export_from": "export the weights of this checkpoint (plain or DeepSpeed), then exit",
    "export_to": "where the export goes", "export_format": "plain (train.py checkpoint) | hf (Hugging Face GPT-2)",
    "seed": "random seed (the same on every rank)",
    "task": "evaluate.py: WIKITEXT103 (perplexity) | LAMBADA (cloze accuracy) | GENERATE (samples)",
    "valid_data": "evaluate.py: the task's file (raw wiki.test.tokens, or LAMBADA JSON lines with \"text\")",
    "overlapping_eval": "evaluate.py, WIKITEXT103: windows advance by this many tokens; only those are scored",
    "strict_lambada": "evaluate.py, LAMBADA: the target is the whole last word (split on whitespace)",
    "hf": "evaluate.py: a Hugging Face GPT-2 directory to evaluate instead of --load",
    "sample_input_file": "evaluate.py, GENERATE: prompts, one a line (without it: --num-samples unconditional)",
    "sample_output_file": "evaluate.py, GENERATE: JSON lines {prompt, text, tokens}, in prompt order (default: print)",
    "num_samples": "evaluate.py, GENERATE: unconditional samples, each from <|endoftext|>",
    "out_seq_length": "evaluate.py, GENERATE: tokens to generate per sample (fewer if <|endoftext|> comes)",
    "temperature": "evaluate.py, GENERATE: softmax temperature; 0 is greedy",
    "top_k": "evaluate.py, GENERATE: sample among the k likeliest tokens; 0 is off (Megatron: --top_k)",
    "top_p": "evaluate.py, GENERATE: nucleus sampling mass; 0 is off (Megatron: --top_p)",
}

ALIASES = [  # Megatron / Megatron-DeepSpeed spellings of our flags (README: "Coming from Megatron")
    (("--checkpoint-activations", "--deepspeed-activation-checkpointing"),
     dict(dest="recompute_activations", action="store_true")),
    (("--dataset-impl",), dict(dest="data_impl")),
    (("--use-flash-attn",), dict(dest="attention_impl", action="store_const", const="triton")),
    (("--DDP-impl",), dict(dest="ddp_impl")),
    (("--vocab",), dict(dest="vocab_file")),
    (("--deepspeed_config",), dict(dest="deepspeed_config")),  # DeepSpeed's own spelling
    (("--top_k",), dict(dest="top_k", type=int)),              # Megatron's sampling spellings
    (("--top_p",), dict(dest="top_p", type=float)),
]
# Megatron's TensorBoard switches: what they ask for is always logged here
# (batch size, validation loss and perplexity), or not measured (timers).
TENSORBOARD_SWITCHES = ("--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard",
                        "--log-validation-ppl-to-tensorboard", "--log-memory-to-tensorboard",
                        "--log-world-size-to-tensorboard", "--log-learning-rate-to-tensorboard",
                        "--log-loss-scale-to-tensorboard")


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors (an unknown flag, a value of the wrong type) are
    ValueErrors: train.main prints them once, from rank 0. argparse itself
    would print usage and exit on every rank of the launch."""

    def error(self, message: str):
        raise ValueError(f"{message} ({self.prog} --help lists the flags)")


def build_parser(prog: str = "train.py", usage: str = USAGE) -> argparse.ArgumentParser:
    """One flag per TrainConfig field (`--foo-bar` fills `foo_bar`), plus the
    aliases above. Every default is SUPPRESS, so the parsed namespace holds
    exactly the flags on the command line: a --deepspeed_config JSON may fill
    the others, and only these may contradict it."""
    # allow_abbrev=False, as in Megatron: a prefix such as --recompute must not
    # silently mean --recompute-activations (nor --init mean --initial-loss-scale).
    p = ArgumentParser(prog=prog, description=usage, allow_abbrev=False,
                                argument_default=argparse.SUPPRESS,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        help = FLAG_HELP.get(f.name, "")
        if f.type == "bool":
            p.add_argument(flag, action="store_true", help=help)
        elif f.name == "data_path":
            p.add_argument(flag, nargs="+", help=f"{help} (default: {default})")
        elif f.name == "rampup_batch_size":
            p.add_argument(flag, nargs=3, type=int, metavar=("START", "INCREMENT", "SAMPLES"), help=help)
        else:
            kind = {"int": int, "float": float}.get(f.type.split(" ")[0], str)
            p.add_argument(flag, type=kind, help=f"{help} (default: {default})".replace("%", "%%"))
    for names, kwargs in ALIASES:
        p.add_argument(*names, **kwargs, help=argparse.SUPPRESS)
    for name in TENSORBOARD_SWITCHES:
        p.add_argument(name, action="store_true", dest="tensorboard_switch", help=argparse.SUPPRESS)
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None, prog: str = "train.py", usage: str = USAGE) -> TrainConfig:
    """Megatron-style flags (and a --deepspeed_config JSON) -> a checked TrainConfig."""
    given = vars(build_parser(prog, usage).parse_args(argv))
    # The deepspeed launcher passes --local_rank (torchrun's LOCAL_RANK is what
    # we read); the TensorBoard switches are accepted and need nothing.
    for launcher_only in ("local_rank", "tensorboard_switch"):
        given.pop(launcher_only, None)
    cfg = TrainConfig(**given)
    if cfg.deepspeed_config:
        cfg = fill_from_deepspeed_json(cfg, set(given))
    evaluating = prog == "evaluate.py"
    if evaluating:
        validate_evaluation(cfg)
    elif EVAL_FLAGS & set(given):
        flags = ", ".join("--" + f.replace("_", "-") for f in sorted(EVAL_FLAGS & set(given)))
        raise ValueError(f"{flags}: evaluate.py's flags; run evaluate.py to evaluate a checkpoint")
    validate(cfg, set(given), evaluating)
    return cfg


# A --deepspeed_config value that one of our flags also sets: JSON key path ->
# (TrainConfig field, flag, JSON value -> field value).
DEEPSPEED_JSON_FLAGS = {
    ("train_micro_batch_size_per_gpu",): ("micro_batch_size", "--micro-batch-size", int),
    ("train_batch_size",): ("global_batch_size", "--global-batch-size", int),
    ("gradient_clipping",): ("clip_grad", "--clip-grad", float),
    ("bf16", "enabled"): ("bf16", "--bf16", bool),
    ("fp16", "enabled"): ("fp16", "--fp16", bool),
    ("fp16", "initial_scale_power"): ("initial_loss_scale", "--initial-loss-scale", lambda p: 2.0 ** p),
    ("zero_optimization", "stage"): ("zero_stage", "--zero-stage", int),
}


def read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{what} {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path}: not valid JSON ({e})") from None


def read_deepspeed_json(path: str) -> dict:
    """The --deepspeed_config JSON, with DeepSpeed's older spelling of the bf16
    section ("bfloat16", which DeepSpeed still reads, after "bf16") renamed
    to "bf16": read as written, it would be silently overridden by the "bf16"
    section deepspeed_config writes, and the run would train in fp32."""
    user = read_json(path, "--deepspeed_config")
    if "bfloat16" in user:
        if "bf16" in user and user["bf16"] != user["bfloat16"]:
            raise ValueError(f"--deepspeed_config {path}: \"bf16\" and \"bfloat16\" (its older "
                             f"name) disagree; keep one of them")
        user["bf16"] = user.pop("bfloat16")
    return user


def fill_from_deepspeed_json(cfg: TrainConfig, given: set[str]) -> TrainConfig:
    """A JSON value fills the flag it corresponds to when the command line left
    that flag unset; a flag on the command line must agree with it (else an
    error names both: never silently one of them). "auto" (Hugging Face's
    placeholder) counts as unset. DeepSpeed-only keys go to DeepSpeed as they
    are (zero.deepspeed_config)."""
    user = read_deepspeed_json(cfg.deepspeed_config)
    precision_given = bool({"bf16", "fp16"} & given)  # then both bf16 and fp16 are decided
    updates = {}
    for path, (name, flag, convert) in DEEPSPEED_JSON_FLAGS.items():
        raw = user
        for key in path:
            raw = raw.get(key) if isinstance(raw, dict) else None
        if raw is None or raw == "auto":
            continue
        value = convert(raw)
        decided = name in given or (name in ("bf16", "fp16") and precision_given)
        if not decided:
            updates[name] = value
        elif getattr(cfg, name) != value:
            now = getattr(cfg, name)
            shown = (flag if now else f"{flag} being off") if isinstance(value, bool) else f"{flag} {now:g}"
            raise ValueError(f"--deepspeed_config {cfg.deepspeed_config}: {'.'.join(path)}={raw} "
                             f"contradicts {shown}; make them agree or drop one of them")
    gas = user.get("gradient_accumulation_steps")
    if gas not in (None, "auto") and "global_batch_size" not in given | set(updates):
        # global batch = micro batch x data-parallel size x accumulation steps
        dp = max(1, int(os.environ.get("WORLD_SIZE", 1)) // cfg.tensor_model_parallel_size)
        updates["global_batch_size"] = updates.get("micro_batch_size", cfg.micro_batch_size) * dp * gas
    return dataclasses.replace(cfg, **updates)


def validate(cfg: TrainConfig, given: set[str] = frozenset(), evaluating: bool = False) -> None:
    """Reject what cannot run, in one line that says what to do instead.
    `given`: the flags on the command line (some checks are about those);
    evaluating: for evaluate.py, whose model comes from the checkpoint."""
    if cfg.bf16 and cfg.fp16:
        raise ValueError("--bf16 and --fp16 are mutually exclusive: pick one")
    if cfg.lr_decay_style not in ("cosine", "linear", "constant"):
        raise ValueError(f"--lr-decay-style {cfg.lr_decay_style!r}: use cosine, linear or constant")
    if cfg.min_lr > cfg.lr:
        raise ValueError(f"--min-lr {cfg.min_lr} is above --lr {cfg.lr}")
    validate_megatron_flags(cfg)
    validate_architecture(cfg)
    validate_schedule(cfg, given)
    validate_deepspeed(cfg)
    validate_sequence_parallel(cfg)
    if cfg.keep_last_checkpoints is not None and cfg.keep_last_checkpoints < 1:
        raise ValueError(f"--keep-last-checkpoints {cfg.keep_last_checkpoints}: keep at least 1")
    if cfg.finetune and not cfg.load:
        raise ValueError("--finetune needs --load CHECKPOINT (the weights to start from)")
    if cfg.export_from:
        return  # an export reads the model from the checkpoint
    if evaluating:
        return  # evaluate.py reads the model from the checkpoint
    if cfg.preset is None and cfg.num_layers is None:
        raise ValueError("give a model: --preset NAME (one of " + ", ".join(PRESETS) +
                         ") or --num-layers/--hidden-size/--num-attention-heads")


EVAL_TASKS = ("WIKITEXT103", "LAMBADA", "GENERATE")
SAMPLE_FLAGS = {"sample_input_file", "sample_output_file", "num_samples", "out_seq_length",
                "temperature", "top_k", "top_p"}
EVAL_FLAGS = {"task", "valid_data", "overlapping_eval", "strict_lambada", "hf", *SAMPLE_FLAGS}  # evaluate.py's alone


def validate_evaluation(cfg: TrainConfig) -> None:
    """evaluate.py's flags: one task, one file, one model."""
    if cfg.task is None:
        raise ValueError(f"evaluate.py needs --task: {' or '.join(EVAL_TASKS)}")
    if cfg.task not in EVAL_TASKS:
        raise ValueError(f"--task {cfg.task}: use one of {', '.join(EVAL_TASKS)}")
    if cfg.task == "GENERATE":
        validate_sampling(cfg)
    elif not cfg.valid_data:
        raise ValueError(f"--task {cfg.task} needs --valid-data FILE (the task's data)")
    if bool(cfg.load) == bool(cfg.hf):
        raise ValueError("evaluate.py needs a model: --load CHECKPOINT (plain or DeepSpeed) "
                         "or --hf DIRECTORY (Hugging Face GPT-2), one of them")
    if cfg.overlapping_eval is not None and not 0 < cfg.overlapping_eval <= cfg.seq_length:
        raise ValueError(f"--overlapping-eval {cfg.overlapping_eval} must lie in [1, --seq-length "
                         f"{cfg.seq_length}]")
    if cfg.overlapping_eval is not None and cfg.task != "WIKITEXT103":
        raise ValueError("--overlapping-eval is for --task WIKITEXT103")
    if cfg.strict_lambada and cfg.task != "LAMBADA":
        raise ValueError("--strict-lambada is for --task LAMBADA")


def validate_sampling(cfg: TrainConfig) -> None:
    """--task GENERATE: prompts from a file, or unconditional samples; sane sampling knobs."""
    if bool(cfg.sample_input_file) == (cfg.num_samples > 0):
        raise ValueError("--task GENERATE needs --sample-input-file FILE (one prompt a line) or "
                         "--num-samples N > 0 (unconditional samples), one of them")
    if cfg.out_seq_length < 1:
        raise ValueError(f"--out-seq-length {cfg.out_seq_length}: generate at least 1 token")
    if cfg.temperature < 0 or cfg.top_k < 0 or not 0 <= cfg.top_p <= 1:
        raise ValueError(f"--temperature {cfg.temperature} (>= 0; 0 is greedy), --top-k {cfg.top_k} "
                         f"(>= 0; 0 is off), --top-p {cfg.top_p} (in [0, 1]; 0 is off)")


def validate_megatron_flags(cfg: TrainConfig) -> None:
    """Megatron flags with one possible value here, or a few: say what to use."""
    if cfg.pipeline_model_parallel_size != 1:
        raise ValueError(f"--pipeline-model-parallel-size {cfg.pipeline_model_parallel_size}: "
                         f"pipeline parallelism is not supported; use 1, and split the model with "
                         f"--tensor-model-parallel-size and/or --deepspeed --zero-stage 3")
    if cfg.distributed_backend not in (None, "nccl", "gloo"):
        raise ValueError(f"--distributed-backend {cfg.distributed_backend}: use nccl (GPUs) or gloo (CPU)")
    if cfg.distributed_backend is not None and \
            (cfg.distributed_backend == "nccl") != torch.cuda.is_available():
        raise ValueError(f"--distributed-backend {cfg.distributed_backend} on a machine "
                         f"{'with' if torch.cuda.is_available() else 'without'} GPUs: use "
                         f"{'nccl' if torch.cuda.is_available() else 'gloo'}, or drop the flag")
    if cfg.ddp_impl not in ("torch", "local"):
        raise ValueError(f"--DDP-impl {cfg.ddp_impl}: use torch (local is accepted and means the same)")
    if cfg.optimizer not in ("adam", "adamw"):
        raise ValueError(f"--optimizer {cfg.optimizer}: only adam (AdamW, decoupled weight decay, "
                         f"as Megatron's adam) is supported")
    if cfg.data_impl != "mmap":
        raise ValueError(f"--data-impl {cfg.data_impl}: only mmap (Megatron's .bin/.idx) is "
                         f"supported; rebuild the data with prepare.py (or preprocess_data.py "
                         f"--dataset-impl mmap)")
    if cfg.make_vocab_size_divisible_by < 1:
        raise ValueError("--make-vocab-size-divisible-by must be >= 1")
    from prepare import check_gpt2_bpe  # the tokenizer's home
    check_gpt2_bpe(cfg.tokenizer_type, cfg.vocab_file, cfg.merge_file)


def validate_architecture(cfg: TrainConfig) -> None:
    """The flags that go in pairs (GPTConfig checks the values themselves)."""
    if cfg.num_query_groups is not None and not cfg.group_query_attention:
        raise ValueError("--num-query-groups needs --group-query-attention")
    if cfg.group_query_attention and cfg.num_query_groups is None:
        raise ValueError("--group-query-attention needs --num-query-groups G (the key/value heads)")
    rope_flags = cfg.rotary_base is not None or cfg.rotary_percent is not None
    if rope_flags and cfg.position_embedding_type == "learned_absolute":
        raise ValueError("--rotary-base/--rotary-percent need --position-embedding-type rope")


def validate_schedule(cfg: TrainConfig, given: set[str]) -> None:
    """Iteration-based or sample-based (--train-samples), never a mix (as in Megatron)."""
    counterpart = {"lr_warmup_samples": "lr_warmup_iters", "lr_decay_samples": "lr_decay_iters"}
    if cfg.train_samples is None:
        if cfg.rampup_batch_size:
            raise ValueError("--rampup-batch-size needs --train-samples (sample-based training, "
                             "as in Megatron) instead of --train-iters")
        mode, wrong = "--train-iters", {f: counterpart[f] for f in counterpart if f in given}
    else:
        if "train_iters" in given:
            raise ValueError("give --train-iters or --train-samples, not both")
        mode, wrong = "--train-samples", {i: s for s, i in counterpart.items() if i in given}
    for flag, instead in wrong.items():
        raise ValueError(f"--{flag.replace('_', '-')} does not go with {mode}: use "
                         f"--{instead.replace('_', '-')}")
    if cfg.lr_warmup_fraction is not None and {"lr_warmup_iters", "lr_warmup_samples"} & given:
        raise ValueError("--lr-warmup-fraction replaces --lr-warmup-iters/--lr-warmup-samples: give one")
    if cfg.lr_warmup_fraction is not None and not 0 <= cfg.lr_warmup_fraction <= 1:
        raise ValueError(f"--lr-warmup-fraction {cfg.lr_warmup_fraction} must lie in [0, 1]")
    if cfg.rampup_batch_size:
        start, increment, _ = cfg.rampup_batch_size
        final = cfg.global_batch_size
        if final is None or not 0 < start <= final or increment <= 0 or (final - start) % increment:
            raise ValueError(f"--rampup-batch-size {start} {increment} ...: needs --global-batch-size "
                             f"G with 0 < START <= G and G - START a multiple of INCREMENT "
                             f"(got G={final})")


def model_config(cfg: TrainConfig, device: torch.device | None = None) -> GPTConfig:
    """The GPTConfig this run trains: the preset, overridden by explicit flags.

    Kernels default to Triton on CUDA and to torch elsewhere; asking for Triton
    where it cannot run is an error raised by the model.
    """
    overrides = {k: getattr(cfg, k) for k in (
        "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
        "max_position_embeddings", "init_method_std", "position_embedding_type", "rotary_base",
        "rotary_percent", "normalization", "num_query_groups") if getattr(cfg, k) is not None}
    # switches turn an option on; off means the preset's choice
    overrides.update({k: True for k in ("swiglu", "untie_embeddings_and_output_weights",
                                        "disable_bias_linear") if getattr(cfg, k)})
    # Padded to a multiple of --make-vocab-size-divisible-by alone (Megatron
    # multiplies it by the TP size): the embedding's shape, and so every
    # checkpoint, stays the same for any layout; a TP size must divide it.
    overrides["padded_vocab_size"] = pad_vocab_size(GPTConfig.vocab_size, cfg.make_vocab_size_divisible_by)
    overrides.update(hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout,
                     activation_checkpointing=cfg.recompute_activations, loss_impl=cfg.loss_impl,
                     sequence_parallel=cfg.sequence_parallel)
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


def validate_sequence_parallel(cfg: TrainConfig) -> None:
    if not cfg.sequence_parallel:
        return
    tp = cfg.tensor_model_parallel_size
    if tp == 1:
        raise ValueError("--sequence-parallel splits each sequence over the tensor-parallel ranks: "
                         "it needs --tensor-model-parallel-size > 1")
    if cfg.partition_activations:
        raise ValueError("--partition-activations splits each checkpointed block input over the "
                         "tensor-parallel ranks, which --sequence-parallel already does (and there "
                         "the inputs differ from rank to rank): drop --partition-activations")
    if cfg.seq_length % tp:
        raise ValueError(f"--sequence-parallel splits each sequence over the {tp} tensor-parallel "
                         f"ranks: --seq-length {cfg.seq_length} must be divisible by "
                         f"--tensor-model-parallel-size {tp}")


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

def gradient_accumulation_steps(cfg: TrainConfig, dp_size: int, global_batch: int | None = None) -> int:
    """global batch = micro batch x data-parallel size x accumulation steps.
    global_batch: this step's (it ramps with --rampup-batch-size); default
    --global-batch-size."""
    per_step = cfg.micro_batch_size * dp_size
    gbs = global_batch or cfg.global_batch_size or per_step
    if gbs % per_step != 0:
        flag = "--rampup-batch-size START and INCREMENT, and --global-batch-size," \
            if cfg.rampup_batch_size else "--global-batch-size"
        raise ValueError(
            f"{flag} {gbs} is not divisible by --micro-batch-size "
            f"{cfg.micro_batch_size} x data-parallel size {dp_size} = {per_step}; "
            f"use a multiple of {per_step}")
    return gbs // per_step


def build_model(cfg: TrainConfig, device: torch.device, kernels_for: torch.device | None = None) -> GPT:
    """The run's model on `device`, with the kernels chosen for `kernels_for`
    (default: device; ZeRO-3 under TP builds on the host what runs on a GPU)."""
    mcfg = model_config(cfg, kernels_for or device)
    if cfg.domino:
        mcfg = dataclasses.replace(mcfg, domino_chunks=cfg.domino_chunks)
    # Same seed on every rank: every rank builds the same full model (tensor-
    # parallel ranks keep their slice), so data-parallel replicas start equal.
    # Dropout over values that differ across TP ranks draws from a second
    # stream, seeded per TP rank (parallel.py, section 5).
    torch.manual_seed(cfg.seed)
    parallel.model_parallel_seed(cfg.seed)
    return GPT(mcfg).to(device)


def param_ndim(p: torch.nn.Parameter) -> int:
    # ZeRO-3 swaps p.data for an empty 1-D tensor and keeps the real shape in ds_shape.
    return len(p.ds_shape) if hasattr(p, "ds_shape") else p.dim()


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, fused: bool = True) -> torch.optim.AdamW:
    """AdamW; biases and LayerNorm weights (every tensor with < 2 dims) get no decay."""
    decay = [p for p in model.parameters() if p.requires_grad and param_ndim(p) >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and param_ndim(p) < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # fused: one kernel for all tensors, and it can skip a step on the device
    # (train.optimizer_step), on CUDA and CPU alike.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             eps=cfg.adam_eps, fused=fused)


def lr_span(cfg: TrainConfig) -> tuple[float, int]:
    """(warmup, decay end) of the schedule, in iterations or, with
    --train-samples, in samples (as Megatron counts them)."""
    if cfg.train_samples is None:
        warmup, decay = cfg.lr_warmup_iters, cfg.lr_decay_iters or cfg.train_iters
    else:
        warmup, decay = cfg.lr_warmup_samples, cfg.lr_decay_samples or cfg.train_samples
    if cfg.lr_warmup_fraction is not None:
        warmup = cfg.lr_warmup_fraction * decay
    return warmup, decay


def learning_rate(done: int, cfg: TrainConfig, step: int = 1) -> float:
    """Linear warmup to --lr, then cosine/linear decay to --min-lr, then constant.

    done: iterations before this step (step=1); with --train-samples, samples
    consumed before it (step = this step's global batch). The two agree when
    the batch is constant: --train-samples N x B is --train-iters N."""
    warmup, decay = lr_span(cfg)
    if done < warmup:
        return cfg.lr * min(1.0, (done + step) / warmup)
    if cfg.lr_decay_style == "constant" or done >= decay:
        return cfg.lr if cfg.lr_decay_style == "constant" else cfg.min_lr
    progress = (done - warmup) / max(1, decay - warmup)
    if cfg.lr_decay_style == "cosine":
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        coeff = 1.0 - progress
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


def global_batch_at(consumed: int, cfg: TrainConfig, dp_size: int) -> int:
    """The global batch of the step after `consumed` samples. With
    --rampup-batch-size START INCREMENT SAMPLES it grows from START by
    INCREMENT in equal sample intervals until SAMPLES have been consumed, then
    stays at --global-batch-size (Megatron's ramp-up, used by GPT-3)."""
    final = cfg.global_batch_size or cfg.micro_batch_size * dp_size
    if not cfg.rampup_batch_size:
        return final
    start, increment, ramp_samples = cfg.rampup_batch_size
    if consumed > ramp_samples or final == start:
        return final
    samples_per_increment = ramp_samples / ((final - start) // increment)
    return start + int(consumed / samples_per_increment) * increment


def with_run_length(cfg: TrainConfig, dp_size: int) -> TrainConfig:
    """With --train-samples, --train-iters becomes the number of whole steps
    that fit: the run stops before a step would pass --train-samples."""
    if cfg.train_samples is None:
        return cfg
    iterations, consumed = 0, 0
    while consumed + (batch := global_batch_at(consumed, cfg, dp_size)) <= cfg.train_samples:
        consumed += batch
        iterations += 1
    if iterations == 0:
        raise ValueError(f"--train-samples {cfg.train_samples} is less than one global batch ({batch})")
    return dataclasses.replace(cfg, train_iters=iterations)
