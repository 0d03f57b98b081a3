"""The flags of train.py and eval_tasks.py, in Megatron's names. Sections:

  1. TrainConfig: one field a flag, with its default, help and tools
  2. The parser: fields -> argparse, Megatron's other spellings
  3. The DeepSpeed JSON: fills the flags the command line left unset
  4. Checks: a mistake is one line that names the fix (launch.UsageError)
  5. What the flags describe: the model's GPTConfig, autocast, torch.compile
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from gpt import GPTConfig, PRESETS, count_parameters, pad_vocab_size
from context import COMM_TYPES
from data import check_gpt2_bpe
from launch import UsageError, parse_json, say, text_file

TRAIN, EVALUATE = "train.py", "eval_tasks.py"
BOTH, EVAL = (TRAIN, EVALUATE), (EVALUATE,)


def flag(default, help: str, tools=(TRAIN,), **argparse_kwargs):
    """A TrainConfig field that is the flag --field-name: its default, --help
    text, the tools that take it, and argparse settings beyond its type."""
    value = dict(default_factory=lambda: list(default)) if isinstance(default, list) else dict(default=default)
    return field(**value, metadata={"help": help, "tools": tools, **argparse_kwargs})


def whole_number(value) -> int:
    """A count as text or a JSON number: 1000, "1e3" or 1000.0 (Megatron's
    --loss-scale-window is a float) is 1000; 1000.5, true or "many" an error."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or not number.is_integer():  # nor are nan and inf
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number")
    return int(number)


def layer_pattern(text: str) -> int | list:
    """--moe-layer-freq: an int, or Megatron's pattern, 0/1 lists with + and *
    ("([1]*3+[0])*2"), read from its syntax tree (never run)."""
    def value(node):  # an int, or a list of ints
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        items = [value(e) for e in node.elts] if isinstance(node, ast.List) else None
        if items is not None and all(type(item) is int for item in items):
            return items
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = value(node.left), value(node.right)
            times, pattern = (a, b) if isinstance(a, int) else (b, a)
            if isinstance(node.op, ast.Mult) and isinstance(pattern, list) and len(pattern) * times > 1 << 16:
                raise ValueError  # more layers than any model has
            return a + b if isinstance(node.op, ast.Add) else a * b
        raise ValueError
    try:
        return value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        raise argparse.ArgumentTypeError(f"{text!r} is neither an int nor 0/1 lists with + and *") from None


SWITCH_WORDS = {**dict.fromkeys(("true", "t", "yes", "y", "on", "1"), True),
                **dict.fromkeys(("false", "f", "no", "n", "off", "0"), False)}


def json_switch(value) -> bool:
    """A DeepSpeed JSON switch as DeepSpeed (pydantic) reads it, where bool("false")
    would be True: true, 1, "true", "yes", "on" ... or false, 0, "false", "off" ... (any case)."""
    if isinstance(value, (bool, int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in SWITCH_WORDS:
        return SWITCH_WORDS[value.lower()]
    raise argparse.ArgumentTypeError(f"{value!r} is not true or false")


# ----------------------------------------------------------------------------
# 1. TrainConfig
# ----------------------------------------------------------------------------

@dataclass
class TrainConfig:
    # the model: None means the preset's (--preset), else GPT-2's
    preset: str | None = flag(None, "model size: " + ", ".join(PRESETS) + "; the model flags below override it", BOTH)
    num_layers: int | None = flag(None, "transformer layers", BOTH)
    hidden_size: int | None = flag(None, "model width", BOTH)
    num_attention_heads: int | None = flag(None, "attention heads", BOTH)
    ffn_hidden_size: int | None = flag(None, "MLP width (default 4 x hidden; with --swiglu Megatron's int(8h/3/64) x 64)", BOTH)
    seq_length: int = flag(1024, "tokens per sample", BOTH)
    max_position_embeddings: int | None = flag(None, "learned positions (default: the preset's, at least --seq-length)", BOTH)
    init_method_std: float | None = flag(None, "std of the normal weight init (default 0.02)")
    make_vocab_size_divisible_by: int = flag(128, "pad the embedding rows to a multiple of this (the TP size must divide the result)", BOTH)
    hidden_dropout: float = flag(0.0, "dropout on embeddings and residual branches")
    attention_dropout: float = flag(0.0, "dropout on attention probabilities")
    attention_impl: str | None = flag(None, "triton | torch (default: triton on CUDA in eager mode, torch on "
                                            "CPU and under --compile)", BOTH)
    layernorm_impl: str | None = flag(None, "triton | torch (default: triton on CUDA in eager mode, torch on "
                                            "CPU and under --compile)", BOTH)
    loss_impl: str = flag("fused", "fused: LM head + cross-entropy in chunks, never the full fp32 logits "
                                   "(fused_loss.FusedLinearCrossEntropy); full: the logits, then the loss (for comparison)")
    recompute_activations: bool = flag(False, "activation checkpointing: recompute each block in backward", BOTH)
    # architecture options (unset: the preset's, GPT-2's by default)
    position_embedding_type: str | None = flag(None, "learned_absolute | rope (default: the preset's, learned_absolute)")
    rotary_base: float | None = flag(None, "RoPE base theta (default 10000)")
    rotary_percent: float | None = flag(None, "fraction of each head's dims that RoPE rotates (default 1.0)")
    normalization: str | None = flag(None, "LayerNorm | RMSNorm (default: the preset's, LayerNorm)")
    swiglu: bool = flag(False, "gated SiLU MLP (three matrices); --ffn-hidden-size keeps its meaning")
    untie_embeddings_and_output_weights: bool = flag(False, "an LM head of its own instead of the token embedding")
    disable_bias_linear: bool = flag(False, "no biases in the linear layers")
    group_query_attention: bool = flag(False, "grouped-query attention: needs --num-query-groups")
    num_query_groups: int | None = flag(None, "key/value heads under --group-query-attention; divides the heads "
                                              "(and is divisible by --tensor-model-parallel-size)")
    kv_channels: int | None = flag(None, "Megatron's head dim; here always --hidden-size / --num-attention-heads")
    qk_layernorm: bool = flag(False, "each head's query and key normed before RoPE (Qwen3, OLMo 2)")
    # a mixture of experts in the MLP's place (gpt.MoE, expert_parallel.py; docs/model.md)
    num_experts: int | None = flag(None, "E experts on the MoE layers (default: a dense model)")
    moe_layer_freq: int | list = flag(1, "MoE layers: every Nth from layer 0, or a 0/1 a layer: "
                                         "Megatron's pattern, e.g. ([1]*3+[0])*2", type=layer_pattern)
    moe_ffn_hidden_size: int | None = flag(None, "each expert's MLP width (default: --ffn-hidden-size)")
    moe_router_topk: int = flag(2, "experts per token")
    moe_router_score_function: str = flag("softmax", "softmax | sigmoid (DeepSeek-V3)")
    moe_router_pre_softmax: bool = flag(False, "top-k of the softmax over all E (default: softmax of the top k)")
    moe_shared_expert_intermediate_size: int | None = flag(None, "an MLP this wide that every token also runs")
    moe_shared_expert_gate: bool = flag(False, "the shared expert's output times sigmoid(x w) (Qwen2-MoE)")
    moe_router_load_balancing_type: str = flag("aux_loss", "aux_loss | seq_aux_loss (per sequence) | none")
    moe_aux_loss_coeff: float = flag(0.0, "the load-balancing loss's coefficient")
    moe_z_loss_coeff: float | None = flag(None, "the router z-loss's coefficient (ST-MoE)")
    moe_router_enable_expert_bias: bool = flag(False, "DeepSeek-V3's aux-loss-free balancing, a bias per expert")
    moe_router_bias_update_rate: float = flag(1e-3, "how far each step moves that bias toward the mean load")
    moe_expert_capacity_factor: float | None = flag(None, "an expert's most tokens, x its even share (default: all)")
    moe_token_drop_policy: str = flag("probs", "over capacity, keep the highest probs | position")
    moe_pad_expert_input_to_capacity: bool = flag(False, "every expert takes exactly its capacity of tokens")
    moe_grouped_gemm: bool = flag(False, "a rank's experts as one grouped GEMM, not a loop")
    moe_token_dispatcher_type: str = flag("allgather", "how tokens reach other EP ranks' experts: allgather | alltoall")
    # parallelism
    tensor_model_parallel_size: int = flag(1, "tp: ranks that split every layer (consecutive ranks, one node)", BOTH)
    pipeline_model_parallel_size: int = flag(1, "pp: pipeline stages, each holding num_layers/pp consecutive layers "
                                                "(1F1B schedule; ranks: TP fastest, then CP, DP, PP)", BOTH)
    context_parallel_size: int = flag(1, "cp: ranks that split every sequence, each holding 2 of its 2 x cp "
                                         "chunks (ranks: TP fastest, then CP, DP, PP; context.py)")
    cp_comm_type: str = flag("p2p", "how attention reaches the other CP ranks' tokens: p2p (ring attention: "
                                    "K/V passed round the CP ranks) | a2a (DeepSpeed-Ulysses: all-to-all of heads)")
    num_layers_per_virtual_pipeline_stage: int | None = flag(
        None, "interleaved 1F1B: each pipeline rank holds num_layers/(pp x this) model chunks of this many layers")
    enable_zero_bubble: bool = flag(False, "zero-bubble pipeline schedule ZB-H1 (Qi et al. 2024): weight gradients "
                                           "deferred to fill 1F1B's idle ticks; 1F1B's saved activations, plus "
                                           "the linears' inputs the deferred gradients need")
    distributed_backend: str | None = flag(None, "nccl | gloo (default: nccl on GPUs, gloo on CPU)", BOTH)
    ddp_impl: str = flag("torch", "torch | local: both are torch DDP here", BOTH)
    distributed_timeout_minutes: float = flag(10.0, "process-group timeout: a collective (or the start-up) "
                                                    "waiting longer fails (Megatron's default)", BOTH)
    domino: bool = flag(False, "overlap tensor-parallel all-reduces with compute (DeepSpeed-Domino)", BOTH)
    domino_chunks: int = flag(2, "micro-batch chunks that --domino interleaves", BOTH)
    expert_model_parallel_size: int = flag(1, "ep: ranks that split the experts, folded out of DP x CP")
    expert_tensor_parallel_size: int | None = flag(None, "the TP ranks each expert is split over: "
                                                         "--tensor-model-parallel-size's (the default), or 1")
    sequence_parallel: bool = flag(False, "split LayerNorms, dropouts and residual adds along the sequence over "
                                          "the tensor-parallel ranks (activation memory / tp); needs "
                                          "--tensor-model-parallel-size > 1")
    # batch
    micro_batch_size: int = flag(4, "samples per rank per forward/backward", BOTH)
    global_batch_size: int | None = flag(None, "samples per optimizer step = micro batch x data-parallel size x "
                                               "accumulation (default: micro batch x data-parallel size)")
    rampup_batch_size: list[int] | None = flag(None, "grow the global batch from START by INCREMENT over SAMPLES "
                                                     "samples (needs --train-samples)", nargs=3, type=int,
                                               metavar=("START", "INCREMENT", "SAMPLES"))
    # optimizer and schedule: counted in iterations, or with --train-samples in samples
    train_iters: int = flag(1000, "optimizer steps (with --train-samples: computed from it)")
    train_samples: int | None = flag(None, "train on this many samples instead of --train-iters (schedule "
                                           "counted in samples)")
    optimizer: str = flag("adam", "adam (AdamW, as Megatron's adam)")
    lr: float = flag(6e-4, "peak learning rate")
    min_lr: float = flag(0.0, "final learning rate")
    lr_warmup_iters: int = flag(0, "linear warmup steps")
    lr_warmup_samples: int = flag(0, "linear warmup samples (with --train-samples)")
    lr_warmup_fraction: float | None = flag(None, "warmup as a fraction of the decay span, instead of "
                                                  "--lr-warmup-iters/-samples")
    lr_decay_iters: int | None = flag(None, "decay steps (default: --train-iters)")
    lr_decay_samples: int | None = flag(None, "decay samples (default: --train-samples)")
    # Megatron-DeepSpeed's token counts, with --train-samples: a sample is --seq-length tokens
    train_tokens: int | None = flag(None, "also stop once this many tokens are trained (with --train-samples)")
    lr_warmup_tokens: int | None = flag(None, "linear warmup over this many tokens (with --train-samples)")
    lr_decay_tokens: int | None = flag(None, "decay over this many tokens (with --train-samples)")
    lr_decay_style: str = flag("cosine", "cosine | linear | constant")
    weight_decay: float = flag(0.1, "AdamW decay of matrices (not biases or norms)")
    adam_beta1: float = flag(0.9, "AdamW beta1")
    adam_beta2: float = flag(0.95, "AdamW beta2")
    adam_eps: float = flag(1e-8, "AdamW epsilon")
    clip_grad: float = flag(1.0, "global gradient-norm clipping; 0 disables")
    # precision
    bf16: bool = flag(False, "bf16 autocast", BOTH)
    fp16: bool = flag(False, "fp16 autocast with dynamic loss scaling", BOTH)
    initial_loss_scale: float = flag(2.0 ** 16, "first loss scale under --fp16")
    hysteresis: int | None = flag(None, "--fp16: the non-finite steps since the scale last grew that halve it "
                                        "(default 1; under --deepspeed DeepSpeed's, 2)")
    loss_scale_window: int | None = flag(None, "--fp16: the finite steps in a row that double the loss scale (default "
                                               "2000; under --deepspeed DeepSpeed's, 1000)", type=whole_number)
    min_loss_scale: float | None = flag(None, "--fp16: the loss scale never halves below this (default: no "
                                              "floor; under --deepspeed DeepSpeed's, 1)")
    compile: bool = flag(False, "torch.compile the model (the whole step: no graph break at any layout)")
    compile_backend: str = flag("inductor", "torch.compile's backend: inductor, or aot_eager (the same graphs, "
                                            "run op by op: tells a compiler difference from a tracing one)")
    compile_mode: str = flag("default", "torch.compile's mode: default | reduce-overhead (the step replayed as CUDA "
                                        "graphs; fixed shapes, GPU only) | max-autotune | max-autotune-no-cudagraphs")
    # data
    data_path: list[str] = flag(["data/shakespeare_text_document"], "PREFIX, or a weighted blend: W1 PREFIX1 "
                                                                   "W2 PREFIX2 ...", nargs="+")
    data_impl: str = flag("mmap", "mmap (Megatron's .bin/.idx; alias --dataset-impl)", BOTH)
    tokenizer_type: str = flag("GPT2BPETokenizer", "GPT2BPETokenizer, or NullTokenizer: the data's ids as they "
                                                   "are, --vocab-size of them (Megatron's; no text)", BOTH)
    vocab_size: int | None = flag(None, "NullTokenizer's vocabulary: ids 0..N-1, and N ends a document", BOTH)
    vocab_file: str | None = flag(None, "GPT-2's gpt2-vocab.json, checked if given", BOTH)
    merge_file: str | None = flag(None, "GPT-2's gpt2-merges.txt, checked if given", BOTH)
    split: str = flag("969,30,1", "train,valid,test weights, split by documents")
    data_cache_path: str | None = flag(None, "where sample-index arrays are cached (default: next to the data)")
    reset_position_ids: bool = flag(False, "restart positions after each end-of-text")
    reset_attention_mask: bool = flag(False, "reset self attention mask after end-of-document token: each "
                                             "token attends only within its own document")
    eod_mask_loss: bool = flag(False, "no loss on end-of-text positions")
    num_workers: int = flag(0, "DataLoader workers")
    # evaluation and logging during training
    eval_interval: int = flag(100, "validate every N steps (and at the end); 0 disables")
    eval_iters: int = flag(10, "global batches per validation")
    log_interval: int = flag(10, "log every N steps", BOTH)
    metrics_file: str | None = flag(None, "also write the logged figures as JSON lines here "
                                          "(eval_tasks.py: its results, one JSON object)", BOTH)
    tensorboard_dir: str | None = flag(None, "also log to TensorBoard here")
    tensorboard_queue_size: int = flag(1000, "TensorBoard events buffered before a write")
    peak_flops: float | None = flag(None, "peak FLOP/s of one device for MFU (default: by GPU name)")
    # checkpoints
    save: str | None = flag(None, "checkpoint directory to write")
    load: str | None = flag(None, "checkpoint directory to resume from (eval_tasks.py: to evaluate)", BOTH)
    ckpt_format: str = flag("torch_dist", "torch_dist (as Megatron): every rank writes its own shards "
                                          "(torch.distributed.checkpoint) | torch: one file, gathered tensor by "
                                          "tensor on rank 0; --deepspeed writes DeepSpeed's own")
    async_save: bool = flag(False, "torch_dist: write each checkpoint in the background; the loop waits only "
                                   "while the state is copied to host memory")
    save_interval: int | None = flag(None, "save every N steps (and at the end, on SIGTERM and at --exit-interval)")
    exit_interval: int | None = flag(None, "save and stop after every N steps")
    exit_duration_in_mins: float | None = flag(None, "save and stop once the run has lasted this many minutes "
                                                     "(a job's time limit; every rank stops at the same step)")
    keep_last_checkpoints: int | None = flag(None, "after each save, delete all but the newest K checkpoints "
                                                   "(default: keep all)")
    no_load_optim: bool = flag(False, "load weights only (fresh optimizer)", BOTH)
    no_load_rng: bool = flag(False, "do not restore the RNG states from --load", BOTH)
    finetune: bool = flag(False, "start from --load's weights: iteration, samples, optimizer and schedule from zero")
    # Megatron refuses a resume whose schedule differs unless told which to keep; here this run's
    # is kept by default (in one line that says so), and the two flags make the choice explicit.
    override_opt_param_scheduler: bool = flag(False, "on resume, follow this run's --lr, --min-lr, warmup "
                                                     "and decay, not the checkpoint's (alias --override-lr-scheduler)")
    use_checkpoint_opt_param_scheduler: bool = flag(False, "on resume, follow the checkpoint's --lr, --min-lr, "
                                                           "warmup and decay, not this run's (alias "
                                                           "--use-checkpoint-lr-scheduler)")
    # the end-of-run sample
    sample_prompt: str = flag("ROMEO:", "prompt of the sample printed at the end")
    sample_tokens: int = flag(64, "its length; 0 disables")
    # DeepSpeed ZeRO (zero.py); its JSON config is built from the flags above
    deepspeed: bool = flag(False, "train through DeepSpeed ZeRO")
    zero_stage: int | None = flag(None, "ZeRO stage 0-3 (default: the --deepspeed_config's, else 1)")
    deepspeed_config: str | None = flag(None, "DeepSpeed's JSON config; values must agree with these flags")
    # Not a flag: that JSON as parse_args read and checked it, once (zero.deepspeed_config passes it on)
    deepspeed_json: dict | None = field(default=None, compare=False, repr=False)
    zero_offload_optimizer: bool = flag(False, "optimizer states and step on CPU")
    partition_activations: bool = flag(False, "with --recompute-activations under DeepSpeed: split saved "
                                              "inputs over TP ranks")
    # weight export from a checkpoint, plain or DeepSpeed (then exit)
    export_from: str | None = flag(None, "export the weights of this checkpoint (any kind) or Hugging Face directory, then exit")
    export_to: str | None = flag(None, "where the export goes")
    export_format: str = flag("plain", "plain (train.py checkpoint) | hf (Hugging Face GPT-2 or Llama)")
    # zero-shot evaluation of a checkpoint (Megatron's tasks/zeroshot_gpt)
    task: str | None = flag(None, "WIKITEXT103 (perplexity) | LAMBADA (cloze accuracy) | GENERATE (samples)", EVAL)
    valid_data: str | None = flag(None, "the task's file (raw wiki.test.tokens, or LAMBADA JSON lines with "
                                        "\"text\")", EVAL)
    overlapping_eval: int | None = flag(None, "WIKITEXT103: windows advance by this many tokens; only those "
                                              "are scored (default: --seq-length)", EVAL)
    strict_lambada: bool = flag(False, "LAMBADA: the target is the whole last word (split on whitespace)", EVAL)
    hf: str | None = flag(None, "a Hugging Face GPT-2 or Llama directory to evaluate instead of --load", EVAL)
    # samples from a checkpoint (Megatron's generate_samples_gpt)
    sample_input_file: str | None = flag(None, "GENERATE: prompts, one a line (without it: --num-samples "
                                               "unconditional)", EVAL)
    sample_output_file: str | None = flag(None, "GENERATE: JSON lines {prompt, text, tokens}, in prompt order "
                                                "(default: print)", EVAL)
    num_samples: int = flag(0, "GENERATE: unconditional samples, each from <|endoftext|>", EVAL)
    out_seq_length: int = flag(256, "GENERATE: tokens to generate per sample (fewer if <|endoftext|> comes)", EVAL)
    temperature: float = flag(1.0, "GENERATE: softmax temperature; 0 is greedy", EVAL)
    top_k: int = flag(0, "GENERATE: sample among the k likeliest tokens; 0 is off", EVAL)
    top_p: float = flag(0.0, "GENERATE: nucleus sampling mass; 0 is off", EVAL)
    seed: int = flag(1234, "random seed (the same on every rank)", BOTH)

    def flags(self) -> dict:
        """The run's flags, as a checkpoint records them (the DeepSpeed JSON stays in its own file)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "deepspeed_json"}


# ----------------------------------------------------------------------------
# 2. The parser
# ----------------------------------------------------------------------------

# Megatron-LM's names for our choices: its attention backends (flash and
# cuDNN's fused are our Triton kernel, unfused and local torch's), and its
# recomputation granularity (full or selective: here each whole block).
ATTENTION_BACKENDS = {"auto": None, "flash": "triton", "fused": "triton", "unfused": "torch", "local": "torch"}


def attention_backend(name: str) -> str | None:
    if name not in ATTENTION_BACKENDS:
        raise argparse.ArgumentTypeError(f"{name!r}: use one of {', '.join(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name]


def recompute_granularity(name: str) -> bool:
    if name not in ("full", "selective"):
        raise argparse.ArgumentTypeError(f"{name!r}: use full or selective (each recomputes whole blocks here)")
    if name == "selective":  # the run differs from Megatron's in speed and memory: say so
        say("--recompute-granularity selective: each whole block recomputes here, as with full (Megatron's "
            "selective recomputes core attention alone): less activation memory, more compute")
    return True


ALIASES = [  # Megatron / Megatron-DeepSpeed spellings of our flags (README: "Coming from Megatron")
    (("--checkpoint-activations", "--deepspeed-activation-checkpointing"),
     dict(dest="recompute_activations", action="store_true")),
    (("--dataset-impl",), dict(dest="data_impl")),
    (("--use-flash-attn", "--use-flash-attn-v1", "--use-flash-attn-v2", "--use-flash-attn-triton",
      "--use-flash-attn-builder"), dict(dest="attention_impl", action="store_const", const="triton")),
    (("--rotary-position-embeddings-theta",), dict(dest="rotary_base", type=float)),  # Megatron-DeepSpeed's
    (("--DDP-impl",), dict(dest="ddp_impl")),
    (("--vocab",), dict(dest="vocab_file")),
    (("--deepspeed_config",), dict(dest="deepspeed_config")),  # DeepSpeed's own spelling
    (("--top_k",), dict(dest="top_k", type=int)),              # Megatron's sampling spellings
    (("--top_p",), dict(dest="top_p", type=float)),
    (("--override-opt_param-scheduler", "--override-lr-scheduler"),  # Megatron-LM's, Megatron-DeepSpeed's
     dict(dest="override_opt_param_scheduler", action="store_true")),
    (("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-lr-scheduler"),
     dict(dest="use_checkpoint_opt_param_scheduler", action="store_true")),
    (("--attention-backend",), dict(dest="attention_impl", type=attention_backend)),
    (("--recompute-granularity",), dict(dest="recompute_activations", type=recompute_granularity)),
]

# Megatron-LM switches that choose among its own implementations of the same
# math (kernel fusions, Transformer Engine, how its DDP overlaps, its timers),
# or log to TensorBoard what is not logged here (timers, memory, world size,
# the loss scale, optimizer states): recipes pass them; here they change
# nothing, and one line names them.
NO_EFFECT_SWITCHES = ("--use-mcore-models", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
                      "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
                      "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
                      "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32",
                      "--overlap-grad-reduce", "--overlap-param-gather", "--no-async-tensor-model-parallel-allreduce",
                      "--log-throughput", "--exit-signal-handler", "--no-query-key-layer-scaling",
                      "--apply-query-key-layer-scaling", "--log-timers-to-tensorboard",
                      "--log-memory-to-tensorboard", "--log-world-size-to-tensorboard",
                      "--log-loss-scale-to-tensorboard", "--log-optimizer-states-to-tensorboard")
NO_EFFECT_VALUES = ("--transformer-impl", "--timing-log-level", "--recompute-method", "--recompute-num-layers")


class NoEffect(argparse.Action):
    """Collects the Megatron flags (and values) given that change nothing here."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = option_string if values in (None, []) else f"{option_string} {values}"
        setattr(namespace, self.dest, [*getattr(namespace, self.dest, []), given])


# Megatron's TensorBoard switches for what is always logged here (batch size, learning
# rate, validation loss and perplexity); those for what is not are NO_EFFECT_SWITCHES.
TENSORBOARD_SWITCHES = ("--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                        "--log-learning-rate-to-tensorboard")


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are UsageErrors, printed once from rank 0
    (launch.errors_reported), not usage and an exit on every rank."""

    def error(self, message: str):
        raise UsageError(f"{message} ({self.prog} --help lists the flags)")


def build_parser(tool: str, usage: str) -> argparse.ArgumentParser:
    """One flag per TrainConfig field (`--foo-bar` fills `foo_bar`), plus the
    aliases; the other tool's flags are hidden from --help. Every default is
    SUPPRESS: the namespace holds exactly the flags on the command line."""
    # allow_abbrev=False, as in Megatron: --recompute must not mean --recompute-activations.
    p = ArgumentParser(prog=tool, description=usage, allow_abbrev=False, argument_default=argparse.SUPPRESS,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in (f for f in dataclasses.fields(TrainConfig) if f.metadata):  # the flags
        meta = dict(f.metadata)
        help, tools = meta.pop("help"), meta.pop("tools")
        help = help if tool in tools else argparse.SUPPRESS
        if f.type == "bool":
            p.add_argument("--" + f.name.replace("_", "-"), action="store_true", help=help)
            continue
        if help is not argparse.SUPPRESS:
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            help = f"{help} (default: {default})".replace("%", "%%")
        kind = {"int": int, "float": float}.get(f.type.split(" ")[0], str)
        p.add_argument("--" + f.name.replace("_", "-"), **{"type": kind, **meta}, help=help)
    for names, kwargs in ALIASES:
        p.add_argument(*names, **kwargs, help=argparse.SUPPRESS)
    for name in TENSORBOARD_SWITCHES:
        p.add_argument(name, action="store_true", dest="tensorboard_switch", help=argparse.SUPPRESS)
    for name in NO_EFFECT_SWITCHES + NO_EFFECT_VALUES:
        p.add_argument(name, action=NoEffect, nargs=0 if name in NO_EFFECT_SWITCHES else None,
                       dest="no_effect", help=argparse.SUPPRESS)
    for checked in ("--use-distributed-optimizer", *LAYOUT_SWITCHES):  # take_field_less_flags
        p.add_argument(checked, action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--num-key-value-heads", type=int, help=argparse.SUPPRESS)  # Megatron-DeepSpeed's GQA
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None, tool: str = TRAIN, usage: str = "") -> TrainConfig:
    """Megatron-style flags (and a --deepspeed_config JSON) -> a checked
    TrainConfig, for train.py or eval_tasks.py (`tool`)."""
    given = vars(build_parser(tool, usage).parse_args(argv))
    take_field_less_flags(given, tool)
    tools = {f.name: f.metadata["tools"] for f in dataclasses.fields(TrainConfig) if f.metadata}
    others = sorted(name for name in given if tool not in tools[name])
    if others and tool == TRAIN:
        raise UsageError(f"{', '.join('--' + f.replace('_', '-') for f in others)}: eval_tasks.py's flags; "
                         f"run eval_tasks.py to evaluate a checkpoint")
    if others:  # a training script's arguments reused, as Megatron's tasks/main.py takes them
        say(f"{tool}: ignoring {', '.join('--' + f.replace('_', '-') for f in others)}: train.py's "
            f"flags, which do not apply to evaluation")
        given = {name: value for name, value in given.items() if name not in others}
    cfg = TrainConfig(**given)
    if cfg.deepspeed_config:
        cfg = fill_from_deepspeed_json(cfg, set(given))
    check_common(cfg)
    if tool == TRAIN:
        check_training(cfg, set(given))
    elif cfg.pipeline_model_parallel_size != 1:
        raise UsageError(f"--pipeline-model-parallel-size {cfg.pipeline_model_parallel_size}: eval_tasks.py "
                         f"runs whole models (split by --tensor-model-parallel-size alone); use 1: "
                         f"checkpoints saved at any pipeline size load there")
    return cfg


# Megatron(-DeepSpeed) switches that hold only in some models or layouts
LAYOUT_SWITCHES = ("--no-position-embedding", "--use-rotary-position-embeddings", "--no-pipeline-parallel")


def take_field_less_flags(given: dict, tool: str) -> None:
    """Take out of `given` the flags that fill no TrainConfig field: the
    deepspeed launcher's --local_rank (we read torchrun's LOCAL_RANK), the
    TensorBoard switches, the no-effect ones (named in one line), the refused
    --use-distributed-optimizer, and LAYOUT_SWITCHES (an error where they do
    not hold). Megatron-DeepSpeed's --num-key-value-heads N is grouped-query
    attention, and its rotary switch is rope."""
    for launcher_only in ("local_rank", "tensorboard_switch"):
        given.pop(launcher_only, None)
    if given.pop("use_distributed_optimizer", False):
        raise UsageError("--use-distributed-optimizer: optimizer states sharded over data-parallel ranks are "
                         "ZeRO-1 here, DeepSpeed's: --deepspeed --zero-stage 1 (or drop the flag)")
    if no_effect := given.pop("no_effect", None):
        say(f"{tool}: {', '.join(no_effect)}: no effect here (how Megatron computes the same model: its "
            f"fusions, Transformer Engine, overlap, timers, which blocks recompute; what it alone logs)")
    if "num_key_value_heads" in given:
        given.update(group_query_attention=True, num_query_groups=given.pop("num_key_value_heads"))
    switches = {name for name in LAYOUT_SWITCHES if given.pop(name[2:].replace("-", "_"), False)}
    if "--use-rotary-position-embeddings" in switches:
        if "--no-position-embedding" not in switches:  # Megatron-DeepSpeed keeps learned positions too
            raise UsageError("--use-rotary-position-embeddings: Megatron-DeepSpeed adds RoPE to learned "
                             "positions unless --no-position-embedding; here rope has no learned positions: "
                             "add --no-position-embedding (the same model) or drop the flag")
        given["position_embedding_type"] = "rope"
    if "--no-position-embedding" in switches and \
            position_embedding_type(given.get("preset"), given.get("position_embedding_type")) != "rope":
        raise UsageError("--no-position-embedding: a model without positions is not built here; with "
                         "--position-embedding-type rope it has no learned positions (and the flag no effect)")
    pp = given.get("pipeline_model_parallel_size", 1)
    if "--no-pipeline-parallel" in switches and pp != 1:
        raise UsageError(f"--no-pipeline-parallel with --pipeline-model-parallel-size {pp}: give one of them")


# ----------------------------------------------------------------------------
# 3. The DeepSpeed JSON
# ----------------------------------------------------------------------------

# The JSON values our flags also set: key path -> (TrainConfig field, JSON value -> field value)
DEEPSPEED_JSON_FLAGS = {
    ("train_micro_batch_size_per_gpu",): ("micro_batch_size", whole_number),
    ("train_batch_size",): ("global_batch_size", whole_number),
    ("gradient_clipping",): ("clip_grad", float),
    ("bf16", "enabled"): ("bf16", json_switch),
    ("fp16", "enabled"): ("fp16", json_switch),
    ("fp16", "initial_scale_power"): ("initial_loss_scale", lambda p: 2.0 ** whole_number(p)),  # "16" too
    ("fp16", "hysteresis"): ("hysteresis", whole_number),
    ("fp16", "loss_scale_window"): ("loss_scale_window", whole_number),
    ("fp16", "min_loss_scale"): ("min_loss_scale", float),
    ("zero_optimization", "stage"): ("zero_stage", whole_number),
}


def read_deepspeed_json(path: str) -> dict:
    """The --deepspeed_config JSON, its "bfloat16" section (DeepSpeed's other
    spelling) renamed "bf16": else the "bf16" section zero.deepspeed_config
    writes would silently override it, and the run would train in fp32."""
    text = text_file(path, 16 << 20, "--deepspeed_config ")  # bytes: a config is KBs; no FIFO is read forever
    user = parse_json(text, f"--deepspeed_config {path}")
    if not isinstance(user, dict):
        raise UsageError(f"--deepspeed_config {path}: not a JSON object ({{\"key\": value, ...}})")
    for section in ("zero_optimization", "bf16", "bfloat16", "fp16", "checkpoint", "data_types"):  # read here
        if not isinstance(user.get(section, {}), dict):
            old = user[section] in (True, False) and section == "zero_optimization"  # DeepSpeed's old switch
            raise UsageError(f"--deepspeed_config {path}: \"{section}\" is {json.dumps(user[section])}, not a "
                             f"section ({{\"key\": value, ...}}" + (f"; ZeRO's stage: {{\"stage\": "
                             f"{int(user[section])}}})" if old else ")"))
    if "bfloat16" in user:
        if "bf16" in user and user["bf16"] != user["bfloat16"]:
            raise UsageError(f"--deepspeed_config {path}: \"bf16\" and \"bfloat16\" (its older "
                             f"name) disagree; keep one of them")
        user["bf16"] = user.pop("bfloat16")
    return user


def fill_from_deepspeed_json(cfg: TrainConfig, given: set[str]) -> TrainConfig:
    """A JSON value fills its flag where the command line left it unset; a
    flag given must agree with it ("auto", Hugging Face's placeholder, is
    unset). The JSON is kept in cfg.deepspeed_json for zero.deepspeed_config.
    Sections train.py owns are refused."""
    user = read_deepspeed_json(cfg.deepspeed_config)
    for key in ("optimizer", "scheduler"):
        if key in user and cfg.deepspeed:  # (without --deepspeed: validate_deepspeed's line)
            raise UsageError(f"--deepspeed_config {cfg.deepspeed_config}: remove the {key!r} section; "
                             f"train.py passes its own AdamW and learning-rate schedule "
                             f"(--lr, --lr-warmup-iters, --lr-decay-style, ...)")
    writer = (user.get("checkpoint") or {}).get("writer") or {}
    # As DeepSpeed reads the two: a truthy "decoupled", any "datastates_ckpt" section but false
    if cfg.deepspeed and cfg.save and (writer.get("decoupled") or user.get("datastates_ckpt", False) is not False):
        raise UsageError(f"--deepspeed_config {cfg.deepspeed_config}: an asynchronous checkpoint writer "
                         f"(checkpoint.writer.decoupled, datastates_ckpt) returns before the files are on "
                         f"disk, and train.py would point `latest` at a checkpoint still being "
                         f"written; remove it (saves are written synchronously, then published)")
    precision_given = bool({"bf16", "fp16"} & given)  # then both bf16 and fp16 are decided
    updates = {}
    for path, (name, convert) in DEEPSPEED_JSON_FLAGS.items():
        raw = user
        for key in path:
            raw = raw.get(key) if isinstance(raw, dict) else None
        value = json_value(cfg, ".".join(path), convert, raw)
        if value is None:
            continue
        now = getattr(cfg, name)
        decided = name in given or (name in ("bf16", "fp16") and precision_given)
        if not decided:
            updates[name] = value
        elif now != value:
            flag_name = "--" + name.replace("_", "-")
            shown = (flag_name if now else f"{flag_name} being off") if isinstance(value, bool) \
                else f"{flag_name} {now:g}"
            raise UsageError(f"--deepspeed_config {cfg.deepspeed_config}: {'.'.join(path)}={raw} "
                             f"contradicts {shown}; make them agree or drop one of them")
    return dataclasses.replace(cfg, **updates, deepspeed_json=user)


def json_value(cfg: TrainConfig, key: str, convert, raw):
    """convert(raw), the JSON's value at `key` (a dotted path); None where it is unset,
    absent, null or "auto" (Hugging Face's placeholder, which DeepSpeed drops too); a bad
    one is one line naming both."""
    if raw is None or raw == "auto":
        return None
    try:
        value = convert(raw)
        if isinstance(value, float) and not math.isfinite(value):  # JSON's NaN and Infinity: Python reads them
            raise ValueError(f"{raw!r} is not a finite number")
        return value
    except (argparse.ArgumentTypeError, TypeError, ValueError, OverflowError) as e:
        why = f"{raw!r} is out of range" if isinstance(e, OverflowError) else e  # 2.0 ** 10000
        raise UsageError(f"--deepspeed_config {cfg.deepspeed_config}: {key}: {why}") from None


def batch_from_deepspeed_json(cfg: TrainConfig, dp_size: int) -> TrainConfig:
    """The global batch (micro batch x data-parallel size x accumulation steps)
    of a --deepspeed_config's gradient_accumulation_steps, if nothing set it;
    else the steps must agree with it."""
    if not cfg.deepspeed_config:
        return cfg
    raw = cfg.deepspeed_json.get("gradient_accumulation_steps")
    steps = json_value(cfg, "gradient_accumulation_steps", whole_number, raw)
    if steps is None:
        return cfg
    if steps < 1:
        raise UsageError(f"--deepspeed_config {cfg.deepspeed_config}: gradient_accumulation_steps: {steps} "
                         f"is less than 1")
    per_step = cfg.micro_batch_size * dp_size
    if cfg.global_batch_size is None:
        return dataclasses.replace(cfg, global_batch_size=per_step * steps)
    if cfg.global_batch_size % per_step == 0 and cfg.global_batch_size != per_step * steps:
        raise UsageError(f"--deepspeed_config {cfg.deepspeed_config}: gradient_accumulation_steps={raw} "
                         f"contradicts the batch flags (--micro-batch-size x data-parallel size x accumulation "
                         f"= --global-batch-size gives {cfg.global_batch_size // per_step}); make them agree "
                         f"or drop the key")
    return cfg


# ----------------------------------------------------------------------------
# 4. Checks
# ----------------------------------------------------------------------------

# The float flags: argparse takes nan and inf, which a range check lets through and which
# fail deep in torch (--lr nan) or silently turn a feature off (--clip-grad nan: no clipping).
# The loss scale's two are checked with --fp16 alone (validate_loss_scale), as in Megatron.
FINITE = [f.name for f in dataclasses.fields(TrainConfig)
          if f.type.startswith("float") and f.name not in ("initial_loss_scale", "min_loss_scale")]


# What a number's meaning allows, as [low, high) (None: no bound): outside it a run fails deep
# in torch (--adam-beta1 1.5) or silently does something else (a negative --clip-grad flips
# every gradient). A count's least is 0 where 0 means "never" (or "none").
RANGES = {**dict.fromkeys(("micro_batch_size", "seq_length", "log_interval", "train_iters", "train_samples",
                           "train_tokens", "global_batch_size", "lr_decay_iters", "lr_decay_samples",
                           "lr_decay_tokens", "hysteresis", "loss_scale_window", "context_parallel_size"),
                        (1, None)),
          **dict.fromkeys(("eval_interval", "eval_iters", "save_interval", "exit_interval", "lr_warmup_iters",
                           "lr_warmup_samples", "lr_warmup_tokens", "sample_tokens", "num_workers", "lr", "min_lr",
                           "clip_grad", "weight_decay", "adam_eps", "init_method_std"), (0, None)),
          "adam_beta1": (0, 1), "adam_beta2": (0, 1)}


def check_numbers(cfg: TrainConfig) -> None:
    """Every number flag finite and in its RANGES; --seed one that numpy's
    RandomState (the data's order) takes."""
    for name in FINITE:
        value = getattr(cfg, name)
        if value is not None and not math.isfinite(value):
            raise UsageError(f"--{name.replace('_', '-')} {value}: give a finite number")
    for name, (low, high) in RANGES.items():
        value = getattr(cfg, name)
        if value is not None and (value < low or high is not None and value >= high):
            raise UsageError(f"--{name.replace('_', '-')} {value}: it must be at least {low}"
                             + (f" and below {high}" if high is not None else ""))
    if not 0 <= cfg.seed < 2 ** 32:
        raise UsageError(f"--seed {cfg.seed}: use a whole number from 0 to 2**32 - 1 (numpy's seeds)")


def check_common(cfg: TrainConfig) -> None:
    """What cannot run under either tool, in one line that says what to do instead."""
    check_numbers(cfg)
    if cfg.bf16 and cfg.fp16:
        raise UsageError("--bf16 and --fp16 are mutually exclusive: pick one")
    validate_megatron_flags(cfg)
    # the architecture flags that go in pairs (GPTConfig checks the values themselves)
    if cfg.num_query_groups is not None and not cfg.group_query_attention:
        raise UsageError("--num-query-groups needs --group-query-attention")
    if cfg.group_query_attention and cfg.num_query_groups is None:
        raise UsageError("--group-query-attention needs --num-query-groups G (the key/value heads)")
    rope_flags = cfg.rotary_base is not None or cfg.rotary_percent is not None
    if rope_flags and position_embedding_type(cfg.preset, cfg.position_embedding_type) != "rope":
        raise UsageError("--rotary-base/--rotary-percent need --position-embedding-type rope")


def position_embedding_type(preset: str | None, flag: str | None) -> str:
    """The run's positions: the flag's, else the preset's (GPT-2's learned ones by default)."""
    if flag:
        return flag
    return (GPTConfig.from_preset(preset) if preset else GPTConfig()).position_embedding_type


def check_training(cfg: TrainConfig, given: set[str]) -> None:
    """train.py's own checks; `given`: the flags on the command line."""
    if cfg.lr_decay_style not in ("cosine", "linear", "constant"):
        raise UsageError(f"--lr-decay-style {cfg.lr_decay_style!r}: use cosine, linear or constant")
    if cfg.min_lr > cfg.lr:
        raise UsageError(f"--min-lr {cfg.min_lr} is above --lr {cfg.lr}")
    validate_loss_scale(cfg)
    validate_schedule(cfg, given)
    validate_deepspeed(cfg, given)
    validate_sequence_parallel(cfg)
    validate_context_parallel(cfg)
    validate_experts(cfg, given)
    validate_compile(cfg)
    validate_pipeline(cfg)
    if cfg.keep_last_checkpoints is not None and cfg.keep_last_checkpoints < 1:
        raise UsageError(f"--keep-last-checkpoints {cfg.keep_last_checkpoints}: keep at least 1")
    if cfg.finetune and not cfg.load:
        raise UsageError("--finetune needs --load CHECKPOINT (the weights to start from)")
    if cfg.override_opt_param_scheduler and cfg.use_checkpoint_opt_param_scheduler:
        raise UsageError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler: give one "
                         "(this run's learning-rate schedule, or the checkpoint's)")
    if cfg.preset is None and cfg.num_layers is None and not cfg.export_from:  # an export reads its model
        raise UsageError("give a model: --preset NAME (one of " + ", ".join(PRESETS) +
                         ") or --num-layers/--hidden-size/--num-attention-heads")


def validate_loss_scale(cfg: TrainConfig) -> None:
    """--fp16's loss scale: above 0, a floor at most the start, and what DeepSpeed's
    fp16 section can hold (initial_scale_power, a whole min_loss_scale). Without
    --fp16 there is no scale, and the flags change nothing (as in Megatron)."""
    if not cfg.fp16:
        return
    start, floor = cfg.initial_loss_scale, cfg.min_loss_scale
    if not 0 < start < math.inf:
        raise UsageError(f"--initial-loss-scale {start:g}: it must be above 0 and finite")
    if floor is not None and not 0 < floor <= start:
        raise UsageError(f"--min-loss-scale {floor:g}: it must be above 0 and at most --initial-loss-scale ({start:g})")
    power = math.log2(start)
    if cfg.deepspeed and not power.is_integer():
        raise UsageError(f"--initial-loss-scale {start:g}: DeepSpeed starts from a power of two (its "
                         f"initial_scale_power); give {2 ** math.floor(power):g} or {2 ** math.ceil(power):g}")
    if cfg.deepspeed and floor is not None and not float(floor).is_integer():
        raise UsageError(f"--min-loss-scale {floor:g}: DeepSpeed's fp16.min_loss_scale is a whole number")


def validate_megatron_flags(cfg: TrainConfig) -> None:
    """Megatron flags with one possible value here, or a few: say what to use."""
    if cfg.distributed_backend not in (None, "nccl", "gloo"):
        raise UsageError(f"--distributed-backend {cfg.distributed_backend}: use nccl (GPUs) or gloo (CPU)")
    if cfg.distributed_backend is not None and \
            (cfg.distributed_backend == "nccl") != torch.cuda.is_available():
        raise UsageError(f"--distributed-backend {cfg.distributed_backend} on a machine "
                         f"{'with' if torch.cuda.is_available() else 'without'} GPUs: use "
                         f"{'nccl' if torch.cuda.is_available() else 'gloo'}, or drop the flag")
    if cfg.ddp_impl not in ("torch", "local"):
        raise UsageError(f"--DDP-impl {cfg.ddp_impl}: use torch (local is accepted and means the same)")
    if cfg.optimizer not in ("adam", "adamw"):
        raise UsageError(f"--optimizer {cfg.optimizer}: only adam (AdamW, decoupled weight decay, "
                         f"as Megatron's adam) is supported")
    if cfg.data_impl != "mmap":
        raise UsageError(f"--data-impl {cfg.data_impl}: only mmap (Megatron's .bin/.idx) is "
                         f"supported; rebuild the data with prepare.py (or preprocess_data.py "
                         f"--dataset-impl mmap)")
    if cfg.make_vocab_size_divisible_by < 1:
        raise UsageError("--make-vocab-size-divisible-by must be >= 1")
    if cfg.tokenizer_type == "NullTokenizer":
        if cfg.vocab_size is None or cfg.vocab_size < 1:
            raise UsageError("--tokenizer-type NullTokenizer needs --vocab-size N (token ids 0..N-1; "
                             "N ends a document)")
    elif cfg.vocab_size is not None:
        raise UsageError(f"--vocab-size sets NullTokenizer's vocabulary; {cfg.tokenizer_type} has its own: "
                         f"drop --vocab-size, or add --tokenizer-type NullTokenizer")
    else:
        check_gpt2_bpe(cfg.tokenizer_type, cfg.vocab_file, cfg.merge_file)


def eod_token(cfg: TrainConfig) -> int:
    """The id that ends every document: GPT-2's <|endoftext|> (50256), or, as
    in Megatron, NullTokenizer's --vocab-size (the one id past the data's)."""
    return cfg.vocab_size if cfg.tokenizer_type == "NullTokenizer" else GPTConfig.vocab_size - 1


def validate_schedule(cfg: TrainConfig, given: set[str]) -> None:
    """Iteration-based or sample-based (--train-samples), never a mix (as in Megatron)."""
    counterpart = {"lr_warmup_samples": "lr_warmup_iters", "lr_decay_samples": "lr_decay_iters"}
    if cfg.train_samples is None:
        if cfg.rampup_batch_size:
            raise UsageError("--rampup-batch-size needs --train-samples (sample-based training, "
                             "as in Megatron) instead of --train-iters")
        mode, wrong = "--train-iters", {f: counterpart[f] for f in counterpart if f in given}
    else:
        if "train_iters" in given:
            raise UsageError("give --train-iters or --train-samples, not both")
        mode, wrong = "--train-samples", {i: s for s, i in counterpart.items() if i in given}
    for flag, instead in wrong.items():
        raise UsageError(f"--{flag.replace('_', '-')} does not go with {mode}: use "
                         f"--{instead.replace('_', '-')}")
    tokens = [f"--{f.replace('_', '-')}" for f in ("train_tokens", "lr_warmup_tokens", "lr_decay_tokens") if f in given]
    if tokens and cfg.train_samples is None:
        raise UsageError(f"{tokens[0]}: Megatron-DeepSpeed's token counts go with --train-samples (a sample is "
                         f"--seq-length tokens), as in its scripts: give --train-samples")
    for a, b in (("lr_warmup_tokens", "lr_warmup_samples"), ("lr_decay_tokens", "lr_decay_samples"),
                 ("lr_warmup_tokens", "lr_warmup_fraction")):
        if {a, b} <= given:
            raise UsageError(f"--{a.replace('_', '-')} and --{b.replace('_', '-')}: give one")
    if cfg.lr_warmup_fraction is not None and {"lr_warmup_iters", "lr_warmup_samples"} & given:
        raise UsageError("--lr-warmup-fraction replaces --lr-warmup-iters/--lr-warmup-samples: give one")
    if cfg.lr_warmup_fraction is not None and not 0 <= cfg.lr_warmup_fraction <= 1:
        raise UsageError(f"--lr-warmup-fraction {cfg.lr_warmup_fraction} must lie in [0, 1]")
    if cfg.rampup_batch_size:
        start, increment, samples = cfg.rampup_batch_size
        final = cfg.global_batch_size
        if final is None or not 0 < start <= final or increment <= 0 or (final - start) % increment:
            raise UsageError(f"--rampup-batch-size {start} {increment} ...: needs --global-batch-size "
                             f"G with 0 < START <= G and G - START a multiple of INCREMENT (got G={final})")
        if samples <= 0:
            raise UsageError(f"--rampup-batch-size {start} {increment} {samples}: the ramp's samples must be "
                             f"more than 0")


def validate_sequence_parallel(cfg: TrainConfig) -> None:
    if not cfg.sequence_parallel:
        return
    tp = cfg.tensor_model_parallel_size
    if tp == 1:
        raise UsageError("--sequence-parallel splits each sequence over the tensor-parallel ranks: "
                         "it needs --tensor-model-parallel-size > 1")
    if cfg.partition_activations:
        raise UsageError("--partition-activations splits each checkpointed block input over the "
                         "tensor-parallel ranks, which --sequence-parallel already does (and there "
                         "the inputs differ from rank to rank): drop --partition-activations")
    if cfg.seq_length % tp:
        raise UsageError(f"--sequence-parallel splits each sequence over the {tp} tensor-parallel "
                         f"ranks: --seq-length {cfg.seq_length} must be divisible by "
                         f"--tensor-model-parallel-size {tp}")


def validate_context_parallel(cfg: TrainConfig) -> None:
    """What context parallelism needs: 2 x cp equal chunks of every sequence
    (each again divisible by tp under --sequence-parallel), and attention
    without dropout (its probabilities are never whole on one rank)."""
    cp = cfg.context_parallel_size
    if cfg.cp_comm_type not in COMM_TYPES:
        raise UsageError(f"--cp-comm-type {cfg.cp_comm_type!r}: use p2p (ring attention) or a2a (all-to-all); "
                         f"Megatron's all_gather and a2a+p2p are not built here")
    if cp == 1:
        return
    sp = cfg.tensor_model_parallel_size if cfg.sequence_parallel else 1
    if cfg.seq_length % (2 * cp * sp):
        under_sp = f" x --tensor-model-parallel-size {sp} (--sequence-parallel)" if sp > 1 else ""
        raise UsageError(f"--context-parallel-size {cp} cuts each sequence into {2 * cp} chunks: --seq-length "
                         f"{cfg.seq_length} must be divisible by 2 x {cp}{under_sp} = {2 * cp * sp}")
    if cfg.attention_dropout > 0:
        raise UsageError(f"--attention-dropout {cfg.attention_dropout} with --context-parallel-size {cp}: "
                         f"no rank holds a row's attention probabilities whole to drop them; use "
                         f"--attention-dropout 0")


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # Inductor replays these as CUDA graphs


def validate_compile(cfg: TrainConfig) -> None:
    if not cfg.compile and (cfg.compile_backend != "inductor" or cfg.compile_mode != "default"):
        raise UsageError("--compile-backend / --compile-mode need --compile")
    if cfg.compile_mode not in COMPILE_MODES:
        raise UsageError(f"--compile-mode {cfg.compile_mode!r}: use one of {', '.join(COMPILE_MODES)}")
    if cfg.compile_mode != "default" and cfg.compile_backend != "inductor":
        raise UsageError(f"--compile-mode {cfg.compile_mode} is an Inductor mode: drop it or "
                         f"--compile-backend {cfg.compile_backend}")
    if cfg.compile_mode in CUDA_GRAPH_MODES and cfg.pipeline_model_parallel_size > 1:
        # a replay overwrites the last one's outputs, and a stage keeps several micro-batches' alive
        raise UsageError(f"--compile-mode {cfg.compile_mode} (CUDA graphs) does not run pipeline stages, "
                         f"which keep several micro-batches in flight: use --compile alone")
    if cfg.compile_mode in CUDA_GRAPH_MODES and not torch.cuda.is_available():
        raise UsageError(f"--compile-mode {cfg.compile_mode} replays the step as CUDA graphs, which "
                         f"needs a GPU: on CPU use --compile alone")
    if cfg.compile_mode in CUDA_GRAPH_MODES and cfg.deepspeed:
        raise UsageError(f"--compile-mode {cfg.compile_mode} (CUDA graphs) is not supported with "
                         f"--deepspeed, whose hooks run between the graphs: drop one of them")
    if cfg.compile and cfg.compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise UsageError(f"--compile-backend {cfg.compile_backend!r} is not a torch.compile backend: "
                         f"use inductor, or aot_eager or eager to debug")


def validate_pipeline(cfg: TrainConfig) -> None:
    """What pipeline stages do not run with (the layers' and batches' division is checked with the model)."""
    pp = cfg.pipeline_model_parallel_size
    if pp < 1:
        raise UsageError(f"--pipeline-model-parallel-size {pp}: use 1 or more")
    n = cfg.num_layers_per_virtual_pipeline_stage
    if n is not None and n < 1:
        raise UsageError(f"--num-layers-per-virtual-pipeline-stage {n}: use 1 or more")
    if n is not None and pp == 1:
        raise UsageError("--num-layers-per-virtual-pipeline-stage interleaves pipeline stages: it needs "
                         "--pipeline-model-parallel-size > 1")
    if cfg.enable_zero_bubble and pp == 1:
        raise UsageError("--enable-zero-bubble schedules pipeline stages: it needs --pipeline-model-parallel-size > 1")
    if cfg.enable_zero_bubble and n:  # ZB-V would be zero bubble's interleaving
        raise UsageError("--enable-zero-bubble runs ZB-H1, one model chunk a rank: drop "
                         "--num-layers-per-virtual-pipeline-stage")
    if pp > 1 and cfg.deepspeed and cfg.zero_stage not in (None, 0, 1):
        raise UsageError(f"ZeRO stage {cfg.zero_stage} (--zero-stage, --deepspeed_config) partitions "
                         f"gradients, which pipeline stages accumulate over the micro-batches of a step: "
                         f"use --zero-stage 0 or 1 with --pipeline-model-parallel-size {pp} (as "
                         f"DeepSpeed's own pipeline engine)")
    if pp > 1 and cfg.deepspeed and (cfg.fp16 or (cfg.bf16 and cfg.zero_stage == 0)):
        raise UsageError("--deepspeed over pipeline stages runs fp32 (ZeRO 0 or 1) or --bf16 with "
                         "--zero-stage 1: DeepSpeed's other 16-bit optimizers scale and copy the "
                         "gradients in their own backward, which the stages' schedule replaces")
    if pp > 1 and cfg.deepspeed and cfg.bf16 and cfg.deepspeed_config:
        accum = (cfg.deepspeed_json.get("data_types") or {}).get("grad_accum_dtype")
        if accum not in (None, "bf16", "bfloat16", "torch.bfloat16"):
            raise UsageError(f"--deepspeed_config {cfg.deepspeed_config}: data_types.grad_accum_dtype={accum} "
                             f"with --bf16 selects DeepSpeed's BF16 optimizer, which accumulates gradients in "
                             f"its own backward, and pipeline stages run their own; drop grad_accum_dtype "
                             f"(ZeRO-1 accumulates in bf16) or --pipeline-model-parallel-size {pp}")
    if cfg.enable_zero_bubble and cfg.compile:  # its store is Python state no graph sees
        raise UsageError("--enable-zero-bubble defers weight gradients outside autograd, which "
                         "--compile cannot capture: drop one of them")


def validate_experts(cfg: TrainConfig, given: set[str]) -> None:
    """What the mixture of experts' flags need besides each other (GPTConfig checks
    their values, expert_parallel.check_layout the layouts they run under)."""
    loose = sorted(name for name in given if name.startswith("moe_")) + \
        ["expert_model_parallel_size"] * (cfg.expert_model_parallel_size > 1) + \
        ["expert_tensor_parallel_size"] * (cfg.expert_tensor_parallel_size is not None)
    if cfg.num_experts is None and loose:
        raise UsageError(f"--{loose[0].replace('_', '-')} needs --num-experts (a mixture of experts): give it, "
                         f"or drop the MoE flags for a dense model")
    etp, tp = cfg.expert_tensor_parallel_size, cfg.tensor_model_parallel_size
    if etp not in (None, 1, tp):
        raise UsageError(f"--expert-tensor-parallel-size {etp}: each expert is split over the tensor-parallel ranks as "
                         f"the dense MLP, or whole on each, so it must be 1 or --tensor-model-parallel-size ({tp})")
    if etp == 1 < tp and not cfg.sequence_parallel:
        raise UsageError(f"--expert-tensor-parallel-size 1 at --tensor-model-parallel-size {tp} needs "
                         f"--sequence-parallel (each TP rank routes its own tokens, as Megatron's): add it")
    if etp == 1 < tp and cfg.deepspeed:
        raise UsageError("--expert-tensor-parallel-size 1 with --tensor-model-parallel-size > 1 does not run under "
                         "--deepspeed yet: drop one of them")
    if cfg.num_experts is not None and cfg.deepspeed and cfg.zero_stage == 3:
        raise UsageError("--num-experts with --deepspeed --zero-stage 3 (or its --deepspeed_config's): DeepSpeed's "
                         "ZeRO-3 takes no experts but its AutoEP layers; use --zero-stage 1 or 2")
    if cfg.expert_model_parallel_size > 1 and cfg.deepspeed and cfg.zero_stage == 0 and (cfg.bf16 or cfg.fp16):
        raise UsageError("--expert-model-parallel-size > 1 with --deepspeed --zero-stage 0 and --bf16/--fp16: "
                         "DeepSpeed's 16-bit stage-0 optimizer miscounts the experts in the clipping norm; "
                         "use --zero-stage 1 or 2")
    if cfg.compile and cfg.moe_grouped_gemm and not cfg.bf16:
        raise UsageError("--compile with --moe-grouped-gemm needs --bf16 (torch.compile traces grouped_mm in bf16 "
                         "only): add --bf16, or drop --moe-grouped-gemm (the loop compiles in any precision)")


def validate_deepspeed(cfg: TrainConfig, given: set[str]) -> None:
    ds_flags = cfg.zero_stage is not None or cfg.deepspeed_config or cfg.zero_offload_optimizer \
        or cfg.partition_activations
    if ds_flags and not cfg.deepspeed:
        raise UsageError("--zero-stage / --deepspeed_config / --zero-offload-optimizer / "
                         "--partition-activations need --deepspeed")
    if cfg.zero_stage is not None and cfg.zero_stage not in (0, 1, 2, 3):
        raise UsageError(f"--zero-stage {cfg.zero_stage}: use 0, 1, 2 or 3")
    if cfg.deepspeed and cfg.domino:
        raise UsageError("--domino is not supported with --deepspeed: drop one of them")
    if cfg.partition_activations and not cfg.recompute_activations:
        raise UsageError("--partition-activations needs --recompute-activations")
    if cfg.export_from and not cfg.export_to:
        raise UsageError("--export-from needs --export-to PATH")
    if cfg.export_format not in ("plain", "hf"):
        raise UsageError(f"--export-format {cfg.export_format!r}: use plain or hf")
    if cfg.ckpt_format not in ("torch", "torch_dist"):
        raise UsageError(f"--ckpt-format {cfg.ckpt_format!r}: use torch or torch_dist")
    # --deepspeed writes DeepSpeed's own checkpoints whatever --ckpt-format's default: only torch_dist by name conflicts
    if cfg.deepspeed and "ckpt_format" in given and cfg.ckpt_format == "torch_dist":
        raise UsageError("--ckpt-format torch_dist is for plain runs: --deepspeed writes DeepSpeed's own "
                         "checkpoints (each rank its own files already); drop one of them")
    if cfg.async_save and (cfg.deepspeed or cfg.ckpt_format != "torch_dist"):
        raise UsageError("--async-save writes torch_dist checkpoints in the background (as Megatron): "
                         + ("drop --deepspeed" if cfg.deepspeed else f"drop --ckpt-format {cfg.ckpt_format}")
                         + ", or drop --async-save")


# ----------------------------------------------------------------------------
# 5. What the flags describe
# ----------------------------------------------------------------------------

def model_config(cfg: TrainConfig, device: torch.device | None = None) -> GPTConfig:
    """The GPTConfig this run trains: the preset, overridden by explicit flags.
    Kernels default to Triton on CUDA in eager mode and to torch elsewhere."""
    overrides = {k: getattr(cfg, k) for k in (
        "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
        "max_position_embeddings", "init_method_std", "position_embedding_type", "rotary_base",
        "rotary_percent", "normalization", "num_query_groups") if getattr(cfg, k) is not None}
    # switches turn an option on; off means the preset's choice
    overrides.update({k: True for k in ("swiglu", "untie_embeddings_and_output_weights",
                                        "disable_bias_linear", "qk_layernorm") if getattr(cfg, k)})
    if cfg.num_experts is not None:  # the MoE flags are GPTConfig's fields by name
        overrides.update({k: getattr(cfg, k) for k in GPTConfig.__dataclass_fields__ if k.startswith("moe_")},
                         num_experts=cfg.num_experts)
    # Padded to a multiple of --make-vocab-size-divisible-by alone (Megatron multiplies it
    # by the TP size): the embedding's shape, and every checkpoint, fit any layout.
    overrides["vocab_size"] = eod_token(cfg) + 1
    overrides["padded_vocab_size"] = pad_vocab_size(overrides["vocab_size"], cfg.make_vocab_size_divisible_by)
    overrides.update(hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout,
                     activation_checkpointing=cfg.recompute_activations, loss_impl=cfg.loss_impl,
                     sequence_parallel=cfg.sequence_parallel, cp_comm_type=cfg.cp_comm_type)
    # Under --compile, torch's kernels: each call of our Triton kernels (custom ops) costs
    # 0.25-0.4 ms of host time that a compiled step cannot hide (bench/RESULTS.md, 2026-11-27).
    cuda = device is not None and device.type == "cuda"
    default_impl = "triton" if cuda and not cfg.compile else "torch"
    overrides["attention_impl"] = cfg.attention_impl or default_impl
    if cfg.reset_attention_mask and overrides["attention_impl"] == "triton":
        raise UsageError("--reset-attention-mask with --attention-impl triton (the default on CUDA in eager "
                         "mode): the Triton kernels take no document masks; add --attention-impl torch")
    overrides["layernorm_impl"] = cfg.layernorm_impl or default_impl
    mcfg = GPTConfig(**overrides) if cfg.preset is None else GPTConfig.from_preset(cfg.preset, **overrides)
    if "max_position_embeddings" not in overrides and mcfg.max_position_embeddings < cfg.seq_length:
        mcfg = dataclasses.replace(mcfg, max_position_embeddings=cfg.seq_length)
    if cfg.seq_length > mcfg.max_position_embeddings:
        raise UsageError(f"--seq-length {cfg.seq_length} exceeds --max-position-embeddings "
                         f"{mcfg.max_position_embeddings}")
    head_dim = mcfg.hidden_size // mcfg.num_attention_heads
    if cfg.kv_channels not in (None, head_dim):
        raise UsageError(f"--kv-channels {cfg.kv_channels}: each head here is --hidden-size / "
                         f"--num-attention-heads = {head_dim} wide; drop the flag or change those")
    check_fits(cfg, mcfg)
    return mcfg


def check_fits(cfg: TrainConfig, mcfg: GPTConfig) -> None:
    """One line naming the flag whose model cannot be built here at all (not the
    allocator's error or an OOM kill): its largest single allocation, in fp32,
    above this machine's memory. No layout makes it smaller: GPT builds each
    piece whole before a rank keeps its slice, and one micro-batch's widest
    activation lives on one device."""
    H, B, T = mcfg.hidden_size, cfg.micro_batch_size, cfg.seq_length
    width = max(3 * H, mcfg.ffn_hidden_size * (2 if mcfg.swiglu else 1))  # qkv's output, or the MLP's
    positions = mcfg.max_position_embeddings if mcfg.position_embedding_type == "learned_absolute" else 0
    asks = [(f"--hidden-size {H}: the token embedding ({mcfg.padded_vocab_size:,} x {H})",
             mcfg.padded_vocab_size * H),
            (f"--max-position-embeddings {positions} (--seq-length's by default): the learned positions "
             f"({positions:,} x {H})", positions * H),
            (f"--hidden-size {H} (--ffn-hidden-size {mcfg.ffn_hidden_size}): one layer",
             count_parameters(mcfg, exclude_embeddings=True) // mcfg.num_layers),
            (f"--micro-batch-size {B} x --seq-length {T}: one activation ({B} x {T:,} x {width:,})", B * T * width)]
    what, numbers = max(asks, key=lambda ask: ask[1])
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 4 * numbers > memory:
        raise UsageError(f"{what} asks for {4 * numbers / 2 ** 30:,.0f} GiB in fp32, more than this machine's "
                         f"{memory / 2 ** 30:,.0f} GiB of memory: lower it")


def autocast(cfg: TrainConfig, device: torch.device):
    """The autocast context of --bf16 / --fp16 (nothing for fp32)."""
    if cfg.bf16 or cfg.fp16:
        return torch.autocast(device.type, dtype=torch.bfloat16 if cfg.bf16 else torch.float16)
    return nullcontext()


# Inductor's peak-memory reordering moves each collective's wait up next to
# its launch (a buffer in flight holds memory), which undoes the overlap that
# Domino and sequence parallelism's backward put in the graph.
OVERLAP_INDUCTOR_OPTIONS = {"reorder_for_peak_memory": False}


def compile_options(cfg: TrainConfig) -> dict:
    """torch.compile's keyword arguments from --compile-backend / --compile-mode
    (Inductor takes a mode's options, and ours, as one dict)."""
    import torch._inductor
    if cfg.num_experts is not None:  # Dynamo's, process-wide: the tokens per expert (expert_parallel.py), and
        dynamo = torch._dynamo.config  # gpt.MoE.record's figures, once a forward under recomputation too
        dynamo.capture_dynamic_output_shape_ops = dynamo.capture_scalar_outputs = True
        dynamo.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    if cfg.compile_backend != "inductor":
        return {"backend": cfg.compile_backend}
    options = dict(torch._inductor.list_mode_options(cfg.compile_mode))
    if cfg.tensor_model_parallel_size > 1 and (cfg.domino or cfg.sequence_parallel):
        options.update(OVERLAP_INDUCTOR_OPTIONS)
    return {"backend": "inductor", "options": options}
