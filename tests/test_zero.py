"""zero.py: DeepSpeed ZeRO in train.py (--deepspeed): same numbers as plain DDP,
exact resume, tensor parallelism, weight export, and the ZeRO paper's memory split.

The multi-process parts run train.py's own `train(cfg, env)` several times
inside ONE launch of gloo ranks (`worker`, on conftest.run_on_ranks' ranks
with torchrun's environment), because starting torch + DeepSpeed per
configuration would dominate the runtime. Each launch writes JSON-lines
metrics and checkpoints under OUT_DIR; the tests read them back. CPU + gloo,
fp32, a tiny GPT.
"""
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import checkpoint  # noqa: E402
import config  # noqa: E402
import train  # noqa: E402
import train_ops  # noqa: E402
import zero  # noqa: E402
from launch import UsageError  # noqa: E402
from conftest import (IDS, VOCAB, as_torchrun_rank, deepspeed_launcher, free_port, run_on_ranks, torchrun,  # noqa: E402
                      write_zipf_corpus)

STEPS, RESUME_AT = 12, 6
CP_STEPS = 4  # context-parallel runs: ring attention on gloo is the slowest step here
# Global batch 8 = micro-batch 2 x D=2 x 2 accumulation steps; clipping at 0.05
# is active on every step (grad norms are ~1-3).
COMMON = ["--preset", "tiny", "--seq-length", "32", "--micro-batch-size", "2",
          "--global-batch-size", "8", "--train-iters", str(STEPS), "--lr", "3e-3",
          "--min-lr", "3e-4", "--lr-warmup-iters", "3", "--clip-grad", "0.05",
          "--eval-interval", str(STEPS), "--eval-iters", "2", "--log-interval", "1",
          "--sample-tokens", "0", "--seed", "11", "--split", "90,10,0"]


# The Llama-shaped preset: every architecture option on (GPTConfig.LLAMA_OPTIONS + GQA).
LLAMA = ["--preset", "llama-tiny"]


# ----------------------------------------------------------------------------
# The worker (runs on run_on_ranks' ranks)
# ----------------------------------------------------------------------------

def worker_run(out: str, name: str, extra: list[str]) -> None:
    """train.train() once in the existing world, metrics to OUT/NAME.jsonl."""
    import parallel
    cfg = config.parse_args(COMMON + IDS + ["--data-path", os.path.join(out, "corpus_text_document"),
                                           "--data-cache-path", os.path.join(out, "cache"),
                                           "--metrics-file", os.path.join(out, name + ".jsonl"), *extra])
    parallel.destroy()
    start = time.monotonic()
    env = train_ops.init_processes(cfg)
    train.train(cfg, env)
    if env.rank == 0:  # where the launch's time goes, in OUT/PLAN.log
        print(f"[{name}: {time.monotonic() - start:.1f} s]", flush=True)


def worker_eval_export(out: str, export: str, extra: list[str]) -> None:
    """Validation loss of an exported plain checkpoint, evaluated by train.py's
    plain path at the final iteration's evaluation position."""
    import dataclasses
    import parallel
    cfg = config.parse_args(COMMON + IDS + ["--data-path", os.path.join(out, "corpus_text_document"),
                                           "--data-cache-path", os.path.join(out, "cache"), *extra])
    parallel.destroy()
    env = train_ops.init_processes(cfg)
    cfg = dataclasses.replace(cfg, load=export, no_load_optim=True)
    model = train.build_model(cfg, env.device)
    checkpoint.load_checkpoint(cfg, model, None, None, lambda message: None)
    accum = train_ops.gradient_accumulation_steps(cfg, parallel.layout.dp_size)
    gb = cfg.micro_batch_size * parallel.layout.dp_size * accum
    _, valid = train.build_datasets(cfg, gb)
    loss = train.validation_loss(model, model.config, valid, cfg, env.device,
                                 train.eval_consumed(STEPS, cfg, gb), accum)
    if env.rank == 0:
        with open(export + ".val_loss", "w") as f:
            f.write(repr(loss))


def allow_deepspeed_fp16_on_any_cpu() -> None:
    """DeepSpeed's CPU accelerator reports fp16 only where oneDNN has
    AVX512-FP16, so it refuses --fp16 on many CI machines. torch computes fp16
    on any CPU (slowly) and these tests check numbers, not speed: let it through."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    CPU_Accelerator.is_fp16_supported = lambda self: True


@contextlib.contextmanager
def inf_gradient_on_rank_0_at_iteration(iteration: int):
    """Models built meanwhile get an inf in wte's gradient on rank 0 only, in
    the first micro-batch of `iteration` (2 micro-batches per iteration)."""
    import torch.distributed as dist
    real_build = train.build_model

    def build(cfg, device, **kwargs):
        model = real_build(cfg, device, **kwargs)
        micro_batches = []

        def poison(grad):
            micro_batches.append(1)
            if dist.get_rank() == 0 and len(micro_batches) == 2 * (iteration - 1) + 1:
                grad = grad.clone()
                grad[0, 0] = float("inf")
            return grad

        model.wte.weight.register_hook(poison)
        return model

    train.build_model = build
    try:
        yield
    finally:
        train.build_model = real_build


def worker(out: str, plan: str) -> None:
    import warnings
    import torch.distributed as dist
    rank = dist.get_rank()
    if rank == 0:  # what it prints (only rank 0 does), for the tests to read; before DeepSpeed's logger
        sys.stdout = open(os.path.join(out, plan + ".log"), "w", buffering=1)  # binds to sys.stdout
    warnings.simplefilter("ignore")  # DeepSpeed's, on every rank and run
    allow_deepspeed_fp16_on_any_cpu()
    as_torchrun_rank()
    ck = lambda name: os.path.join(out, "ckpt_" + name)
    if plan == "dp":  # 2 processes: T=1, D=2
        worker_run(out, "ddp", ["--save", ck("ddp"), "--save-interval", str(RESUME_AT)])
        for stage in (0, 1, 2, 3):
            save = ["--save", ck(f"z{stage}"), "--save-interval", str(RESUME_AT)] if stage else []
            worker_run(out, f"z{stage}", ["--deepspeed", "--zero-stage", str(stage), *save])
        for stage in (1, 2, 3):  # resume from the mid-run (RESUME_AT) checkpoint of a copy
            if rank == 0:
                shutil.copytree(os.path.join(ck(f"z{stage}"), f"iter_{RESUME_AT:07d}"),
                                os.path.join(ck(f"z{stage}_resume"), f"iter_{RESUME_AT:07d}"))
                with open(os.path.join(ck(f"z{stage}_resume"), "latest"), "w") as f:
                    f.write(f"iter_{RESUME_AT:07d}")
            dist.barrier()
            worker_run(out, f"z{stage}_resume", ["--deepspeed", "--zero-stage", str(stage),
                                                 "--load", ck(f"z{stage}_resume")])
        # ZeRO-1 over 2 pipeline stages (D=1): 6 steps saved at 3, and resumed from a copy of 3.
        pipe = ["--deepspeed", "--zero-stage", "1", "--pipeline-model-parallel-size", "2",
                "--train-iters", "6", "--lr-decay-iters", str(STEPS)]
        worker_run(out, "pp2_z1", [*pipe, "--save", ck("pp2_z1"), "--save-interval", "3"])
        if rank == 0:
            shutil.copytree(os.path.join(ck("pp2_z1"), "iter_0000003"), os.path.join(ck("pp2_z1_resume"), "iter_0000003"))
            with open(os.path.join(ck("pp2_z1_resume"), "latest"), "w") as f:
                f.write("iter_0000003")
        dist.barrier()
        worker_run(out, "pp2_z1_resume", [*pipe, "--load", ck("pp2_z1_resume")])
        # Weights only (--no-load-optim), from a checkpoint of the other kind:
        # iteration RESUME_AT of the DDP run and of the ZeRO-2 run, 3 more steps each.
        if rank == 0:
            shutil.copytree(os.path.join(ck("ddp"), f"iter_{RESUME_AT:07d}"),
                            os.path.join(ck("ddp_mid"), f"iter_{RESUME_AT:07d}"))
            with open(os.path.join(ck("ddp_mid"), checkpoint.LATEST), "w") as f:
                f.write(str(RESUME_AT))
        dist.barrier()
        weights = ["--no-load-optim", "--train-iters", str(RESUME_AT + 3), "--lr-decay-iters", str(STEPS)]
        worker_run(out, "ddp_weights", ["--load", ck("ddp_mid"), *weights])
        worker_run(out, "z3_from_plain", ["--deepspeed", "--zero-stage", "3", "--load", ck("ddp_mid"), *weights])
        worker_run(out, "ddp_from_z2", ["--load", ck("z2_resume"), *weights])
        worker_run(out, "z1_finetune", ["--deepspeed", "--zero-stage", "1", "--load", ck("ddp_mid"),
                                        "--finetune", "--train-iters", "3", "--lr-decay-iters", str(STEPS)])
        worker_run(out, "z1_keep", ["--deepspeed", "--zero-stage", "1", "--train-iters", "4",
                                    "--save", ck("z1_keep"), "--save-interval", "1",
                                    "--keep-last-checkpoints", "2"])
        worker_run(out, "z1_recompute", ["--deepspeed", "--zero-stage", "1", "--recompute-activations",
                                         "--train-iters", "6", "--lr-decay-iters", str(STEPS)])
        worker_run(out, "z2_offload", ["--deepspeed", "--zero-stage", "2", "--zero-offload-optimizer",
                                       "--train-iters", "6", "--lr-decay-iters", str(STEPS)])
        for name, precision in (("z2_bf16", ["--zero-stage", "2", "--bf16"]),
                                ("z1_fp16", ["--zero-stage", "1", "--fp16"]),
                                ("z0_bf16", ["--zero-stage", "0", "--bf16", "--save", ck("z0_bf16")])):
            worker_run(out, name, ["--deepspeed", *precision, "--train-iters", "6",
                                   "--lr-decay-iters", str(STEPS)])
        mixed_kinds_in_one_directory(out, ck("mixed"))
        with inf_gradient_on_rank_0_at_iteration(2):
            worker_run(out, "z1_fp16_overflow", ["--deepspeed", "--zero-stage", "1", "--fp16",
                                                 "--train-iters", "4", "--lr-decay-iters", str(STEPS)])
        export_and_eval(out, ck("z3"), "export_z3", [])
        # Every architecture option on (rope, RMSNorm, SwiGLU, GQA, untied, no bias).
        worker_run(out, "ddp_llama", LLAMA)
        worker_run(out, "z3_llama", ["--deepspeed", "--zero-stage", "3", *LLAMA])
    elif plan == "tp":  # 4 processes: T=2, D=2
        tp = ["--tensor-model-parallel-size", "2"]
        worker_run(out, "tp2_ddp_domino", [*tp, "--domino"])  # plain DDP over D, no DeepSpeed
        worker_run(out, "tp2_z1", ["--deepspeed", "--zero-stage", "1", *tp])
        worker_run(out, "tp2_z3", ["--deepspeed", "--zero-stage", "3", "--save", ck("tp2_z3"), *tp])
        worker_run(out, "tp2_z1_partitioned", ["--deepspeed", "--zero-stage", "1", "--recompute-activations",
                                               "--partition-activations", "--train-iters", "6",
                                               "--lr-decay-iters", str(STEPS), *tp])
        worker_run(out, "tp2_z3_llama", ["--deepspeed", "--zero-stage", "3", *tp, *LLAMA])
        worker_run(out, "tp2_z3_llama_partitioned", ["--deepspeed", "--zero-stage", "3", "--recompute-activations",
                                                     "--partition-activations", "--train-iters", "6",
                                                     "--lr-decay-iters", str(STEPS), *tp, *LLAMA])
        # Sequence parallelism with dropout (per-TP-rank masks): DDP, ZeRO-1, ZeRO-3,
        # and ZeRO-1 with DeepSpeed's activation checkpointing (which must replay the masks).
        sp = [*tp, "--sequence-parallel", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
        worker_run(out, "tp2_ddp_sp", sp)
        for stage in (1, 2, 3):
            worker_run(out, f"tp2_z{stage}_sp", ["--deepspeed", "--zero-stage", str(stage), *sp])
        worker_run(out, "tp2_z1_sp_recompute", ["--deepspeed", "--zero-stage", "1", "--recompute-activations",
                                                "--train-iters", "6", "--lr-decay-iters", str(STEPS), *sp])
        export_and_eval(out, ck("tp2_z3"), "export_tp2", tp)
        # ZeRO-1 over PP=2 x D=2, its JSON asking for overlap_comm (DeepSpeed's reduction hooks).
        overlap = os.path.join(out, "overlap_comm.json")
        if rank == 0:
            with open(overlap, "w") as f:
                json.dump({"zero_optimization": {"stage": 1, "overlap_comm": True}}, f)
        dist.barrier()
        worker_run(out, "pp2_dp2_z1_overlap", ["--deepspeed", "--deepspeed_config", overlap,
                                               "--pipeline-model-parallel-size", "2", "--train-iters", "4",
                                               "--lr-decay-iters", str(STEPS)])
        worker_run(out, "pp2_dp2_z1_zb", ["--deepspeed", "--zero-stage", "1", "--pipeline-model-parallel-size", "2",
                                          "--enable-zero-bubble", "--train-iters", "4", "--lr-decay-iters", str(STEPS)])
        # The interleaved schedule (4 layers: two model chunks a rank) against ZeRO-1 over D=4
        four = ["--deepspeed", "--zero-stage", "1", "--num-layers", "4", "--train-iters", "4",
                "--lr-decay-iters", str(STEPS)]
        worker_run(out, "dp4_z1_4layers", four)
        worker_run(out, "pp2_dp2_z1_interleaved", [*four, "--pipeline-model-parallel-size", "2",
                                                   "--num-layers-per-virtual-pipeline-stage", "1"])
        context_parallel_runs(out)
    dist.barrier()
    dist.destroy_process_group()


def context_parallel_runs(out: str) -> None:
    """4 processes, CP_STEPS steps each: CP=2 x D=2 under ZeRO-1 (saved halfway)
    and ZeRO-3; ZeRO-1 resumed from its halfway checkpoint at CP=4 x D=1;
    CP=2 with ZeRO-1 over 2 ZB-H1 stages. (CP with TP: tests/test_pipeline.py's
    layouts; a resume in its own layout is bit for bit for every ZeRO stage above.)"""
    import torch.distributed as dist
    ck = lambda name: os.path.join(out, "ckpt_" + name)
    short = ["--train-iters", str(CP_STEPS), "--lr-decay-iters", str(STEPS)]  # the first steps of STEPS'
    worker_run(out, "cp2_z1", ["--deepspeed", "--zero-stage", "1", "--context-parallel-size", "2", *short,
                               "--save", ck("cp2_z1"), "--save-interval", str(CP_STEPS // 2)])
    if dist.get_rank() == 0:
        halfway = f"iter_{CP_STEPS // 2:07d}"
        shutil.copytree(os.path.join(ck("cp2_z1"), halfway), os.path.join(ck("cp4_z1_resume"), halfway))
        with open(os.path.join(ck("cp4_z1_resume"), "latest"), "w") as f:
            f.write(halfway)
    dist.barrier()
    worker_run(out, "cp4_z1_resume", ["--deepspeed", "--zero-stage", "1", "--context-parallel-size", "4", *short,
                                      "--load", ck("cp4_z1_resume")])
    worker_run(out, "cp2_z3", ["--deepspeed", "--zero-stage", "3", "--context-parallel-size", "2", *short])
    worker_run(out, "pp2_cp2_z1_zb", ["--deepspeed", "--zero-stage", "1", "--context-parallel-size", "2", *short,
                                      "--pipeline-model-parallel-size", "2", "--enable-zero-bubble"])


def mixed_kinds_in_one_directory(out: str, ckpt: str) -> None:
    """Plain and DeepSpeed runs taking turns in one --save/--load directory,
    each with --keep-last-checkpoints 1; rank 0 notes what the directory
    holds after each save (OUT/mixed.json)."""
    import torch.distributed as dist
    seen = {}

    def note(when):
        if dist.get_rank() == 0:
            found = checkpoint.latest_checkpoint(ckpt)
            seen[when] = {"files": sorted(os.listdir(ckpt)), "kind": found.kind,
                          "iteration": found.iteration}
    same = ["--save", ckpt, "--load", ckpt, "--keep-last-checkpoints", "1"]
    worker_run(out, "mixed_plain", [*same, "--train-iters", "2"])
    note("plain 2")
    worker_run(out, "mixed_ds", ["--deepspeed", "--zero-stage", "1", "--no-load-optim", *same,
                                 "--train-iters", "4"])
    note("deepspeed 4")
    worker_run(out, "mixed_ds_resume", ["--deepspeed", "--zero-stage", "1", "--load", ckpt,
                                        "--train-iters", "5"])
    worker_run(out, "mixed_plain_again", ["--no-load-optim", *same, "--train-iters", "6"])
    note("plain 6")
    if dist.get_rank() == 0:
        with open(os.path.join(out, "mixed.json"), "w") as f:
            json.dump(seen, f)
    dist.barrier()


def export_and_eval(out, saved, name, extra):
    import torch.distributed as dist
    import parallel
    parallel.destroy()
    parallel.initialize(1)  # an export is a single-process, T=1 job; no TP collectives
    if dist.get_rank() == 0:
        checkpoint.export_weights(saved, os.path.join(out, name), "plain")
        checkpoint.export_weights(saved, os.path.join(out, name + "_hf"), "hf")
    dist.barrier()
    worker_eval_export(out, os.path.join(out, name), extra)


# ----------------------------------------------------------------------------
# The tests
# ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both launches' outputs (one directory), computed once for the module."""
    out = str(tmp_path_factory.mktemp("ds"))
    # the session's id corpus, written again beside the launches' cache and checkpoints (the
    # thresholds were set on it: clipping active on every step, the fine-tuned loss 0.5 below a fresh one)
    write_zipf_corpus(os.path.join(out, "corpus_text_document"))
    run_on_ranks(worker, out, "dp", world_size=2)  # what rank 0 printed: OUT/PLAN.log
    run_on_ranks(worker, out, "tp", world_size=4)
    return out


def metrics(out, name):
    with open(os.path.join(out, name + ".jsonl")) as f:
        return [json.loads(line) for line in f]


def assert_same_steps(ref, got):
    """The same training, step for step: loss to 1e-5, gradient norm to 1e-4 relative."""
    for a, b in zip(ref, got, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * a["grad_norm"], (a, b)


pytestmark = pytest.mark.slow


def quick_worker(out: str) -> None:
    """DDP, then ZeRO-3, for QUICK_STEPS steps in one launch of 2 ranks."""
    import warnings
    warnings.simplefilter("ignore")  # DeepSpeed's, on every rank
    as_torchrun_rank()
    quick = ["--train-iters", str(QUICK_STEPS), "--lr-warmup-iters", "1", "--eval-interval", str(QUICK_STEPS)]
    worker_run(out, "ddp", quick)
    worker_run(out, "z3", [*quick, "--deepspeed", "--zero-stage", "3"])


QUICK_STEPS = 3


@pytest.mark.quick
def test_zero3_takes_ddps_first_steps(tmp_path):
    """The quick tier's ZeRO check (the full one: every stage for 12 steps,
    below). ZeRO-3 over 2 ranks, its parameters, gradients and AdamW states
    each split between them, takes plain DDP's steps: the same losses, the
    same (clipped) gradient norms, the same validation loss."""
    out = str(tmp_path)
    write_zipf_corpus(os.path.join(out, "corpus_text_document"))
    run_on_ranks(quick_worker, out, world_size=2)
    ref, got = metrics(out, "ddp"), metrics(out, "z3")
    assert [m["iteration"] for m in got] == list(range(1, QUICK_STEPS + 1))
    for a, b in zip(ref, got):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * a["grad_norm"]
    assert abs(ref[-1]["val_loss"] - got[-1]["val_loss"]) < 1e-5


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_matches_ddp_step_for_step(runs, stage):
    ref, got = metrics(runs, "ddp"), metrics(runs, f"z{stage}")
    assert [m["iteration"] for m in got] == list(range(1, STEPS + 1))
    assert all(m["grad_norm"] > 0.05 for m in ref)  # clipping was active throughout
    # Stages 1-3 agree to ~1e-6; stage 0 (train.py clips for it) bit for bit.
    tol = 1e-5
    for a, b in zip(ref, got):
        assert abs(a["loss"] - b["loss"]) < tol, (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * a["grad_norm"], (a, b)
        assert a["lr"] == b["lr"]  # our schedule, not DeepSpeed's
    assert abs(ref[-1]["val_loss"] - got[-1]["val_loss"]) < tol


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_resume_is_bit_identical(runs, stage):
    """Each stage resumed from its mid-run checkpoint (RESUME_AT) continues bit for
    bit. The resumed runs come after the ZeRO-3 runs in the same process,
    so they also show that ZeRO-3's swap of torch.nn.functional.linear is
    undone when its run ends (zero.DeepSpeedTraining.close)."""
    full, resumed = metrics(runs, f"z{stage}"), metrics(runs, f"z{stage}_resume")
    assert [m["iteration"] for m in resumed] == list(range(RESUME_AT + 1, STEPS + 1))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in full[RESUME_AT:]]
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in full[RESUME_AT:]]


@pytest.mark.parametrize("run", ["z3_from_plain", "ddp_from_z2"])
def test_no_load_optim_loads_the_weights_of_a_checkpoint_of_the_other_kind(runs, run):
    """--load CKPT --no-load-optim takes the weights of a plain checkpoint into
    a DeepSpeed run (here ZeRO-3, loaded before DeepSpeed partitions them) and
    those of a DeepSpeed checkpoint into a plain run, and continues from its
    iteration: the same steps as a plain run from the plain checkpoint."""
    ref, got = metrics(runs, "ddp_weights"), metrics(runs, run)
    assert [m["iteration"] for m in got] == [m["iteration"] for m in ref] == [RESUME_AT + 1, RESUME_AT + 2, RESUME_AT + 3]
    assert [m["consumed_samples"] for m in got] == [8 * i for i in range(RESUME_AT + 1, RESUME_AT + 4)]
    for a, b in zip(ref, got, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a, b)
        assert a["lr"] == b["lr"]
    continued = metrics(runs, "ddp")[RESUME_AT:RESUME_AT + 3]  # the same run, AdamW state and all
    assert [m["lr"] for m in got] == [m["lr"] for m in continued]  # the schedule goes on
    assert ref[0]["loss"] == pytest.approx(continued[0]["loss"], abs=1e-6)  # the same weights ...
    assert ref[1]["loss"] != pytest.approx(continued[1]["loss"], abs=1e-5)  # ... fresh AdamW moments


def test_finetune_starts_a_new_run_from_the_weights(runs):
    """--finetune (Megatron's): the weights of iteration RESUME_AT, then iteration,
    samples and the schedule from zero; here a plain checkpoint into DeepSpeed."""
    got, fresh = metrics(runs, "z1_finetune"), metrics(runs, "z1")
    assert [m["iteration"] for m in got] == [1, 2, 3]
    assert [m["consumed_samples"] for m in got] == [8, 16, 24]
    assert [m["lr"] for m in got] == [m["lr"] for m in fresh[:3]]  # warmup from the start
    assert got[0]["loss"] < fresh[0]["loss"] - 0.5  # trained weights (0.77 lower), not a fresh init


def test_a_checkpoint_of_the_other_kind_never_silently_starts_from_scratch(runs):
    """Resuming everything needs the same kind: otherwise one error says what to add."""
    cfg = config.parse_args(COMMON + ["--load", os.path.join(runs, "ckpt_z2")])
    with pytest.raises(ValueError, match="holds a DeepSpeed checkpoint: resume it with --deepspeed .*--no-load-optim"):
        checkpoint.load_checkpoint(cfg, None, None, None, print)
    cfg = config.parse_args(COMMON + ["--deepspeed", "--load", os.path.join(runs, "ckpt_ddp")])
    with pytest.raises(ValueError, match="holds a plain train.py checkpoint: resume it without --deepspeed"):
        zero.DeepSpeedTraining(cfg, train_ops.init_processes(cfg), 1, print, train.build_model, train.build_optimizer,
                               train.clip_grad_norm_)


@pytest.mark.parametrize("flags", [["--deepspeed"], ["--no-load-optim"]])
def test_a_deepspeed_checkpoint_of_another_width_is_one_line_before_deepspeed_reads_it(runs, flags):
    """A resume under DeepSpeed, or a plain run from its weights, of another
    --hidden-size: refused from the checkpoint's trainer_state.json, before
    DeepSpeed's engine (or the weights' reader) opens a tensor file."""
    cfg = config.parse_args(COMMON + [*IDS, *flags, "--hidden-size", "128", "--load", os.path.join(runs, "ckpt_z2")])
    with pytest.raises(UsageError, match=r"^checkpoint .*ckpt_z2/iter_0000012 is another model: hidden_size 64 "
                                         r"\(this run: 128\), ffn_hidden_size 256 \(this run: 512\); give this"):
        checkpoint.checkpoint_to_load(cfg, print)


def test_a_damaged_deepspeed_checkpoint_gives_way_to_the_one_before(runs, tmp_path):
    """DeepSpeed's checkpoints carry the same digests as plain ones (each rank
    hashes its share of the files): sha256sum -c reads them, and one flipped
    byte in a ZeRO shard of the newest sends --load to the previous one."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(runs, "ckpt_z1"), ckpt)
    for tag in (f"iter_{RESUME_AT:07d}", f"iter_{STEPS:07d}"):
        check = subprocess.run(["sha256sum", "-c", checkpoint.DIGESTS], cwd=os.path.join(ckpt, tag),
                               capture_output=True, text=True)
        assert check.returncode == 0 and "zero_pp_rank_1_mp_rank_00_optim_states.pt: OK" in check.stdout
    shard = os.path.join(ckpt, f"iter_{STEPS:07d}", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with open(shard, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    said = []
    found = checkpoint.verified_checkpoint(ckpt, said.append)
    assert (found.kind, found.iteration) == ("deepspeed", RESUME_AT)
    assert said[0] == (f"checkpoint {ckpt}/iter_{STEPS:07d} cannot be loaded: zero_pp_rank_1_mp_rank_00_optim_states.pt "
                       f"is damaged (its sha256 is not the one checksums.sha256 records)")


def test_keep_last_checkpoints_works_for_deepspeed_checkpoints(runs):
    saved = os.path.join(runs, "ckpt_z1_keep")
    assert sorted(n for n in os.listdir(saved) if n.startswith("iter_")) == ["iter_0000003", "iter_0000004"]
    assert open(os.path.join(saved, "latest")).read() == "iter_0000004"


def test_zero1_over_pipeline_stages_matches_zero1_and_resumes_bit_identically(runs):
    """ZeRO-1 with 2 pipeline stages (our 1F1B schedule, DeepSpeed's reduction
    and step, the tied embedding summed over its stages, DeepSpeed's grad norm
    over both stages) trains as ZeRO-1 without them, and its checkpoint, one
    file per stage, resumes bit for bit."""
    ref, got = metrics(runs, "z1")[:6], metrics(runs, "pp2_z1")
    assert_same_steps(ref, got)
    assert [a["lr"] for a in ref] == [b["lr"] for b in got]
    resumed = metrics(runs, "pp2_z1_resume")
    assert [m["iteration"] for m in resumed] == [4, 5, 6]
    assert [(m["loss"], m["grad_norm"]) for m in resumed] == [(m["loss"], m["grad_norm"]) for m in got[3:]]
    # Each stage resumed its own random streams, and the log says nothing else.
    log = open(os.path.join(runs, "dp.log")).read()
    assert "pp2_z1_resume/iter_0000003 (iteration 3)" in log
    assert "first stage's" not in log


def test_zero1_overlap_comm_over_pipeline_and_data_parallel_ranks_averages_the_gradients(runs):
    """A DeepSpeed JSON's "overlap_comm": true at PP=2 x D=2 trains ZeRO-1's
    curve: it is turned off, as DeepSpeed's pipeline engine does, and said so.
    (Left on, ZeRO-1's boundary-only reduction hooks never averaged over the
    data-parallel ranks, and the tied embedding's copies drifted apart.)"""
    assert_same_steps(metrics(runs, "z1")[:4], metrics(runs, "pp2_dp2_z1_overlap"))
    assert "overlap_comm: off over pipeline stages" in open(os.path.join(runs, "tp.log")).read()


def test_zero1_under_the_zero_bubble_schedule_trains_zero1s_curve(runs):
    """ZB-H1 at PP=2 x D=2 under DeepSpeed's ZeRO-1: the weight gradients its
    W accumulates after the step's last input-gradient backward still reach
    DeepSpeed's data-parallel reduction, and the tied embedding's two copies
    stay one: ZeRO-1's curve without stages."""
    assert_same_steps(metrics(runs, "z1")[:4], metrics(runs, "pp2_dp2_z1_zb"))
    assert "world 4 = TP 1 x DP 2 x PP 2 (ZB-H1)" in open(os.path.join(runs, "tp.log")).read()


def test_zero1_under_the_interleaved_schedule_trains_zero1s_curve(runs):
    """Interleaved 1F1B (two model chunks a rank) at PP=2 x D=2 under
    DeepSpeed's ZeRO-1: every chunk's gradients reach DeepSpeed's reduction
    and step, the tied embedding's copies stay one: ZeRO-1's curve over D=4."""
    assert_same_steps(metrics(runs, "dp4_z1_4layers"), metrics(runs, "pp2_dp2_z1_interleaved"))
    assert "world 4 = TP 1 x DP 2 x PP 2 (interleaved 1F1B)" in open(os.path.join(runs, "tp.log")).read()


@pytest.mark.parametrize("stage", [1, 3])
def test_tensor_parallel_zero_matches_ddp(runs, stage):
    """T=2 x D=2 with ZeRO sharding over D only == T=1 x D=2 DDP: the same
    losses, and DeepSpeed's gradient norm counts each TP shard once."""
    ref, got = metrics(runs, "ddp"), metrics(runs, f"tp2_z{stage}")
    assert_same_steps(ref, got)


def test_zero_with_context_parallel_trains_zeros_curve_and_resumes(runs):
    """CP=2 x D=2: ZeRO-1 and ZeRO-3 average gradients and shard their states
    over the 4 ranks of DP x CP (zero.DeepSpeedMPU), each CP rank's loss
    weighted by its share of the tokens, and take the first steps of ZeRO's
    curve at D=2 and CP=1 (loss, grad norm). ZeRO-1's checkpoint resumes on
    the curve at CP=4 x D=1 (4 partitions still), to the same validation loss."""
    for stage in (1, 3):
        ref, got = metrics(runs, f"z{stage}")[:CP_STEPS], metrics(runs, f"cp2_z{stage}")
        assert [m["iteration"] for m in got] == list(range(1, CP_STEPS + 1))
        assert_same_steps(ref, got)
        assert [m["consumed_samples"] for m in got] == [m["consumed_samples"] for m in ref]
    full, other = metrics(runs, "cp2_z1"), metrics(runs, "cp4_z1_resume")
    assert [m["iteration"] for m in other] == list(range(CP_STEPS // 2 + 1, CP_STEPS + 1))
    assert_same_steps(full[CP_STEPS // 2:], other)
    assert abs(full[-1]["val_loss"] - other[-1]["val_loss"]) < 1e-5  # the run's closing evaluation
    log = open(os.path.join(runs, "tp.log")).read()
    assert "world 4 = TP 1 x CP 2 (p2p) x DP 2 x PP 1" in log and "world 4 = TP 1 x CP 4 (p2p) x DP 1" in log


def test_zero_with_context_parallel_composes_with_pipeline_stages(runs):
    """CP=2 with ZeRO-1 over 2 ZB-H1 stages (DeepSpeed's reduction after our
    schedule, over DP x CP): the first steps of ZeRO's curve at D=2, CP=1."""
    got = metrics(runs, "pp2_cp2_z1_zb")
    assert [m["iteration"] for m in got] == list(range(1, CP_STEPS + 1))
    assert_same_steps(metrics(runs, "z1")[:CP_STEPS], got)


@pytest.mark.parametrize("run", ["z3_llama", "tp2_z3_llama"])
def test_zero3_matches_ddp_with_every_architecture_option(runs, run):
    """rope + RMSNorm + SwiGLU + GQA + untied head + no biases: ZeRO-3 (with
    T=1 and with T=2, whose GQA QKV and SwiGLU fc shard by blocks) == DDP."""
    ref, got = metrics(runs, "ddp_llama"), metrics(runs, run)
    assert [m["iteration"] for m in got] == list(range(1, STEPS + 1))
    assert_same_steps(ref, got)
    assert abs(ref[-1]["val_loss"] - got[-1]["val_loss"]) < 1e-5


def test_plain_ddp_with_tensor_parallel_domino_matches_ddp(runs):
    """Without DeepSpeed: T=2 (Domino, 2 chunks of 1) x D=2 under torch DDP
    == T=1 x D=2 DDP, step for step."""
    ref, got = metrics(runs, "ddp"), metrics(runs, "tp2_ddp_domino")
    assert_same_steps(ref, got)
    assert abs(ref[-1]["val_loss"] - got[-1]["val_loss"]) < 1e-5


@pytest.mark.parametrize("run", ["tp2_z1_sp", "tp2_z2_sp", "tp2_z3_sp"])
def test_zero_with_sequence_parallel_matches_ddp_with_sequence_parallel(runs, run):
    """T=2 x D=2 under --sequence-parallel, with dropout: ZeRO-1, 2 and 3 ==
    torch DDP, step for step (the norms' gradients summed over the sequence
    halves by hooks that every engine honours, the same per-rank masks)."""
    ref, got = metrics(runs, "tp2_ddp_sp"), metrics(runs, run)
    assert [m["iteration"] for m in got] == list(range(1, STEPS + 1))
    assert_same_steps(ref, got)
    assert abs(ref[-1]["val_loss"] - got[-1]["val_loss"]) < 1e-5


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere_under_deepspeed(runs):
    """An inf in one rank's fp16 gradient: DeepSpeed's loss scaler skips that
    step on every rank (and lowers the scale), train.py counts the skip, and
    training goes on with finite losses."""
    got = metrics(runs, "z1_fp16_overflow")
    assert [m["skipped_iterations"] for m in got] == [0, 1, 0, 0]
    assert all(np.isfinite(m["loss"]) for m in got)
    clean = metrics(runs, "z1_fp16")  # the same run without the inf
    assert got[0]["loss"] == clean[0]["loss"] and got[1]["loss"] == clean[1]["loss"]
    assert got[2]["loss"] != clean[2]["loss"]  # iteration 2's update did not happen


@pytest.mark.parametrize("run,ref", [("z1_recompute", "z1"), ("tp2_z1_partitioned", "tp2_z1"),
                                     ("z2_offload", "z2"),
                                     ("tp2_z3_llama_partitioned", "tp2_z3_llama"),  # RoPE angles too
                                     ("tp2_z1_sp_recompute", "tp2_z1_sp")])  # per-rank dropout replayed
def test_memory_saving_options_change_nothing_but_memory(runs, run, ref):
    """--recompute-activations through DeepSpeed's checkpointing (and, under
    TP, --partition-activations), and --zero-offload-optimizer (optimizer
    states and step on CPU, torch AdamW) train exactly like the plain stage."""
    got, want = metrics(runs, run), metrics(runs, ref)
    assert [m["iteration"] for m in got] == list(range(1, 7))
    for a, b in zip(want, got):  # same schedule: --lr-decay-iters pins it
        assert abs(a["loss"] - b["loss"]) < 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-6, (a, b)


@pytest.mark.parametrize("run", ["z2_bf16", "z1_fp16"])
def test_mixed_precision_under_deepspeed_follows_fp32(runs, run):
    """DeepSpeed's bf16 (and fp16 with loss scaling) with fp32 master weights:
    the same trajectory as fp32 up to half-precision rounding."""
    ref, got = metrics(runs, "ddp")[:6], metrics(runs, run)
    assert [m["iteration"] for m in got] == list(range(1, 7))
    for a, b in zip(ref, got):  # ~0.02 apart from step 1 on: the forward runs in half precision
        assert abs(a["loss"] - b["loss"]) < 5e-2, (a, b)
    assert got[-1]["loss"] < got[0]["loss"] - 0.1


@pytest.mark.parametrize("name,run", [("export_z3", "z3"), ("export_tp2", "tp2_z3")])
def test_export_loads_into_plain_model_with_same_eval_loss(runs, name, run):
    with open(os.path.join(runs, name + ".val_loss")) as f:
        exported = float(f.read())
    assert abs(exported - metrics(runs, run)[-1]["val_loss"]) < 1e-5


def test_hf_export_loads_in_transformers(runs):
    transformers = pytest.importorskip("transformers")
    from huggingface import from_hf
    hf = transformers.GPT2LMHeadModel.from_pretrained(os.path.join(runs, "export_tp2_hf")).eval()
    ours = from_hf(os.path.join(runs, "export_tp2_hf")).eval()
    state = torch.load(os.path.join(runs, "export_tp2", f"iter_{STEPS:07d}", "model_optim_rng.pt"),
                       weights_only=False)
    for k, v in ours.state_dict().items():
        n = VOCAB + 1 if k == "wte.weight" else None  # HF stores the true vocab; padding rows are dropped
        assert torch.equal(v[:n], state["model"][k][:n]), k
    ids = torch.randint(0, 2000, (2, 16))
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, ours(ids)[..., :VOCAB + 1], atol=1e-4)
    assert state["optimizer"] is None and state["iteration"] == STEPS  # weights only


def test_plain_and_deepspeed_saves_in_one_directory_always_read_the_latest(runs):
    """A plain run saves 2 (in the default format, torch_dist); a DeepSpeed run
    (--no-load-optim, no --ckpt-format: DeepSpeed writes its own) in the same
    --save/--load directory trains to 4; a DeepSpeed resume continues from 4;
    a plain run (--no-load-optim) trains to 6. Each load reads the latest
    save, whatever its kind, and --keep-last-checkpoints 1 never leaves a
    pointer naming a deleted checkpoint: Megatron's pointer always names the
    latest, DeepSpeed's exists while the latest is DeepSpeed's."""
    with open(os.path.join(runs, "mixed.json")) as f:
        seen = json.load(f)
    tools = ["zero_to_fp32.py", "zero_to_torch.py"]  # DeepSpeed's, written beside its checkpoints
    assert seen == {
        "plain 2": {"files": ["iter_0000002", checkpoint.LATEST], "kind": "torch_dist", "iteration": 2},
        "deepspeed 4": {"files": ["iter_0000004", "latest", checkpoint.LATEST, *tools],
                        "kind": "deepspeed", "iteration": 4},
        "plain 6": {"files": ["iter_0000006", checkpoint.LATEST, *tools], "kind": "torch_dist",
                    "iteration": 6}}
    for run, iterations in (("mixed_ds", [3, 4]), ("mixed_ds_resume", [5]), ("mixed_plain_again", [5, 6])):
        assert [m["iteration"] for m in metrics(runs, run)] == iterations, run
    # both continue from iteration 4's weights, whatever kind of run reads them
    ds = metrics(runs, "mixed_ds_resume")[0]
    assert ds["loss"] == pytest.approx(metrics(runs, "mixed_plain_again")[0]["loss"], abs=1e-6)


def test_export_of_a_16_bit_stage_0_checkpoint_is_its_fp32_master_weights(runs, tmp_path):
    """ZeRO stage 0 under --bf16 keeps fp32 master weights in its optimizer
    and 16-bit copies in the module. The export (and so eval_tasks.py,
    --finetune and --no-load-optim) reads the masters: each exported tensor
    is one of them, bit for bit, and rounds to the module's 16-bit copy."""
    checkpoint.export_weights(os.path.join(runs, "ckpt_z0_bf16"), str(tmp_path / "export"), "plain")
    exported = torch.load(tmp_path / "export" / "iter_0000006" / "model_optim_rng.pt",
                          weights_only=False)["model"]
    states = torch.load(os.path.join(runs, "ckpt_z0_bf16", "iter_0000006", "mp_rank_00_model_states.pt"),
                        weights_only=False)
    masters = [t for group in states["optimizer"]["fp32_groups"] for t in group]
    assert exported.keys() == states["module"].keys()
    for name, weight in exported.items():
        assert weight.dtype == torch.float32 and any(torch.equal(weight, m) for m in masters), name
        assert torch.equal(weight.to(torch.bfloat16), states["module"][name]), name
    assert any(not torch.equal(w, states["module"][n].float()) for n, w in exported.items())


def deepspeed_tool(args: list[str], cwd: str) -> None:
    """Run one of DeepSpeed's own tools as a user would: a fresh Python with
    only DeepSpeed importable (not this project), so every object in the
    checkpoint must unpickle without our code."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env={**env, "DS_ACCELERATOR": "cpu"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def exported_weights(runs, name):
    return torch.load(os.path.join(runs, name, f"iter_{STEPS:07d}", "model_optim_rng.pt"),
                      weights_only=False)["model"]


def test_deepspeeds_zero_to_fp32_reads_our_zero3_checkpoint(runs, tmp_path):
    """DeepSpeed's zero_to_fp32, run as docs/zero.md says, `python -m
    deepspeed.utils.zero_to_fp32 SAVE OUT` (the installed package's: the
    copy DeepSpeed writes into every save directory is code that came with
    the checkpoint, which no checksum covers), consolidates our ZeRO-3
    checkpoint into the weights our export gives."""
    page = open(os.path.join(ROOT, "docs", "zero.md")).read()
    assert "`python -m deepspeed.utils.zero_to_fp32 SAVE OUT`" in page
    for doc in ["README.md", *(os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs")))]:
        text = open(os.path.join(ROOT, doc)).read()
        assert not re.search(r"python \S*/zero_to_fp32\.py", text), doc  # never a script inside a checkpoint
    ckpt = os.path.join(runs, "ckpt_z3")
    deepspeed_tool(["-m", "deepspeed.utils.zero_to_fp32", ckpt, str(tmp_path / "fp32")], str(tmp_path))
    theirs = torch.load(tmp_path / "fp32" / "pytorch_model.bin", weights_only=True)
    ours = exported_weights(runs, "export_z3")
    assert theirs.keys() == ours.keys()
    for name, value in ours.items():
        assert torch.equal(theirs[name].float(), value), name


def test_deepspeeds_universal_checkpoint_converts_our_zero2_checkpoint(runs, tmp_path):
    """DeepSpeed's ds_to_universal converts our ZeRO-2 checkpoint; its fp32
    weights are the trained ones. (train.py does not load the result.)"""
    tag = os.path.join(runs, "ckpt_z2", f"iter_{STEPS:07d}")
    out = tmp_path / "universal"
    deepspeed_tool(["-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag,
                    "--output_folder", str(out), "--num_extract_workers", "1",
                    "--num_merge_workers", "1"], str(tmp_path))
    # The same run as z3 (stages agree to ~1e-6), so compare with its export.
    ours = exported_weights(runs, "export_z3")
    for name, value in ours.items():
        fp32 = torch.load(out / "zero" / name / "fp32.pt", weights_only=False)
        fp32 = fp32["param"] if isinstance(fp32, dict) else fp32
        torch.testing.assert_close(fp32, value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("saved, stage, last, sizes", [
    ("z2", "2", STEPS, "data-parallel size 2, this run has 1"),
    ("cp2_z1", "1", CP_STEPS, "data-parallel x context-parallel size 2 x 2 = 4, this run has 1 x 1 = 1")])
def test_a_zero_checkpoint_resumed_at_another_data_parallel_size_is_one_line(runs, saved, stage, last, sizes):
    """ZeRO-2's partitions fit the D=2 they were written at, ZeRO-1's at CP=2 x
    D=2 the 4 ranks of DP x CP: one process resuming them is told the sizes
    and what does load (--no-load-optim)."""
    data = ["--data-path", os.path.join(runs, "corpus_text_document"), "--data-cache-path", os.path.join(runs, "cache")]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *COMMON, *IDS, *data,
                           "--train-iters", str(STEPS + 2), "--deepspeed", "--zero-stage", stage,
                           "--load", os.path.join(runs, "ckpt_" + saved)],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("train.py: error")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert f"iter_{last:07d} was written with {sizes}" in errors[0]
    assert errors[0].endswith("(add --no-load-optim: any layout loads them)")
    assert "Traceback" not in proc.stderr


def test_checkpoint_layout_is_crash_safe(runs):
    """Tags are renamed into place and `latest` names the last complete one;
    no temporary directory is left behind."""
    ck = os.path.join(runs, "ckpt_z2")
    assert open(os.path.join(ck, "latest")).read() == f"iter_{STEPS:07d}"
    assert sorted(d for d in os.listdir(ck) if d.startswith("iter_")) == \
        [f"iter_{RESUME_AT:07d}", f"iter_{STEPS:07d}"]
    meta = json.load(open(os.path.join(ck, f"iter_{STEPS:07d}", "trainer_state.json")))
    assert (meta["zero_stage"], meta["data_parallel_size"], meta["iteration"]) == (2, 2, STEPS)


def test_memory_per_rank_follows_the_zero_paper(tmp_path):
    """Bytes each rank holds in the engine's tensors (bench/bench_zero.py), fp32,
    Psi params, D=2: stage 0 everything (16 Psi); stage 1 Adam moments / D;
    stage 2 + gradients / D; stage 3 + parameters / D. DeepSpeed also keeps an
    fp32 master copy of the partition it updates (4 Psi / D, stages 1-3)."""
    out = str(tmp_path / "bench.json")
    proc = torchrun(os.path.join(ROOT, "bench", "bench_zero.py"), "--steps", "2", "--json", out, nproc=2,
                    env={"PYTHONWARNINGS": "ignore"}, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = {r["stage"]: r for r in json.load(open(out))}
    psi, D = results[0]["num_params"], 2
    expected = {  # stage: (params, master, grads, adam) in bytes
        0: (4 * psi, 0, 4 * psi, 8 * psi),
        1: (4 * psi, 4 * psi / D, 4 * psi / D, 8 * psi / D),
        2: (4 * psi, 4 * psi / D, 4 * psi / D, 8 * psi / D),
        3: (4 * psi / D, 4 * psi / D, 4 * psi / D, 8 * psi / D),
    }
    for stage, want in expected.items():
        r = results[stage]
        got = (r["params"], r["master"], r["grads"], r["optimizer"])
        for g, w in zip(got, want):
            assert abs(g - w) <= 0.01 * w + 4096, (stage, got, want)  # partitions pad to alignment


# ----------------------------------------------------------------------------
# Single-process checks (no launch)
# ----------------------------------------------------------------------------

def test_deepspeed_runs_as_one_process_without_a_launcher(corpus, tmp_path):
    """`python train.py ... --deepspeed` with no torchrun or deepspeed launcher
    is one process; DeepSpeed still finds the variables it asserts on."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    metrics_file = tmp_path / "m.jsonl"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *COMMON,
                           "--data-path", corpus,
                           "--micro-batch-size", "4", "--train-iters", "2", "--eval-interval", "0",
                           "--deepspeed", "--zero-stage", "1", "--metrics-file", str(metrics_file)],
                          cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [json.loads(line)["iteration"] for line in open(metrics_file)] == [1, 2]


@pytest.mark.quick
def test_config_is_generated_from_flags():
    cfg = config.parse_args(["--preset", "tiny", "--deepspeed", "--zero-stage", "2",
                            "--micro-batch-size", "3", "--clip-grad", "0.5", "--bf16",
                            "--zero-offload-optimizer"])
    ds = zero.deepspeed_config(cfg, dp_size=4, accum=5)
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"],
            ds["train_batch_size"]) == (3, 5, 60)
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_force_ds_cpu_optimizer"] is False  # our torch AdamW, no C++ build
    # Under context parallelism DeepSpeed averages over DP x CP ranks, and counts each sample once a rank
    cfg = config.parse_args(["--preset", "tiny", "--deepspeed", "--micro-batch-size", "3", "--seq-length", "64",
                             "--context-parallel-size", "2"])
    assert zero.deepspeed_config(cfg, dp_size=4, accum=5)["train_batch_size"] == 3 * 4 * 5 * 2


@pytest.mark.quick
def test_contradicting_deepspeed_json_is_an_error(tmp_path):
    path = tmp_path / "ds.json"
    base = ["--preset", "tiny", "--deepspeed", "--deepspeed_config", str(path), "--micro-batch-size", "2"]
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4}))
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu=4 contradicts --micro-batch-size"):
        zero.deepspeed_config(config.parse_args(base), dp_size=1, accum=1)
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ValueError, match="stage=3 contradicts --zero-stage 1"):
        zero.deepspeed_config(config.parse_args(base + ["--zero-stage", "1"]), dp_size=1, accum=1)
    path.write_text(json.dumps({"optimizer": {"type": "Adam"}}))
    with pytest.raises(ValueError, match="remove the 'optimizer' section"):
        zero.deepspeed_config(config.parse_args(base), dp_size=1, accum=1)
    # Agreeing values (and DeepSpeed-only keys) pass through; the stage comes from the JSON.
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "wall_clock_breakdown": True,
                                "zero_optimization": {"stage": 3, "overlap_comm": True}}))
    ds = zero.deepspeed_config(config.parse_args(base), dp_size=1, accum=1)
    assert ds["zero_optimization"] == {"stage": 3, "overlap_comm": True} and ds["wall_clock_breakdown"]
    # A JSON's train_batch_size is the global batch (micro x DP x accumulation); DeepSpeed's counts CP in
    cp = base + ["--seq-length", "64", "--context-parallel-size", "2"]
    path.write_text(json.dumps({"train_batch_size": 8}))
    assert zero.deepspeed_config(config.parse_args(cp), dp_size=2, accum=2)["train_batch_size"] == 16


@pytest.mark.parametrize("value, on", [(True, True), ("on", True), ("false", False), (0, False)])
def test_overlap_comm_is_turned_off_over_pipeline_stages_as_deepspeed_reads_it(tmp_path, capsys, value, on):
    """Over stages a JSON's overlap_comm goes off, said in one line, where
    DeepSpeed would read it on ("false" is off there, not a non-empty string);
    a value DeepSpeed would refuse is named."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1, "overlap_comm": value}}))
    cfg = config.parse_args(["--preset", "tiny", "--deepspeed", "--deepspeed_config", str(path),
                             "--pipeline-model-parallel-size", "2"])
    ds = zero.deepspeed_config(cfg, dp_size=1, accum=1)
    assert ds["zero_optimization"]["overlap_comm"] == (False if on else value)
    assert ("overlap_comm: off over pipeline stages" in capsys.readouterr().out) == on
    path.write_text(json.dumps({"zero_optimization": {"stage": 1, "overlap_comm": "sometimes"}}))
    with pytest.raises(UsageError, match=r"zero_optimization.overlap_comm: 'sometimes' is not true or false"):
        cfg = config.parse_args(["--preset", "tiny", "--deepspeed", "--deepspeed_config", str(path),
                                 "--pipeline-model-parallel-size", "2"])  # the JSON is read once, here
        zero.deepspeed_config(cfg, dp_size=1, accum=1)


@pytest.mark.quick
def test_a_precision_deepspeed_refuses_is_named_before_any_model_is_built():
    """DeepSpeed's CPU accelerator reports fp16 only on CPUs with AVX512-FP16;
    the user hears which flag to change, not DeepSpeed's 'Type fp16 is not
    supported on your device' from inside initialize on every rank."""

    class CPUWithoutFP16:
        def device_name(self): return "cpu"
        def is_fp16_supported(self): return False
        def is_bf16_supported(self): return True

    base = ["--preset", "tiny", "--deepspeed"]
    with pytest.raises(ValueError, match="--fp16 --deepspeed: DeepSpeed does not support fp16 on this device"):
        zero.check_deepspeed_precision(config.parse_args(base + ["--fp16"]), CPUWithoutFP16())
    for ok in ([], ["--bf16"]):
        zero.check_deepspeed_precision(config.parse_args(base + ok), CPUWithoutFP16())


def test_deepspeed_launcher_runs_train_py(corpus):
    """`deepspeed --num_gpus 2 train.py ...` (it passes --local_rank) works like torchrun."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"  # the launcher picks its accelerator at import
    port = free_port()  # for the launcher's rendezvous
    proc = subprocess.run([*deepspeed_launcher(), "--num_gpus", "2", "--master_port", str(port),
                           os.path.join(ROOT, "train.py"), *COMMON, "--train-iters", "2",
                           "--data-path", corpus, "--deepspeed", "--zero-stage", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "world 2 = TP 1 x DP 2" in proc.stdout and "iter      2" in proc.stdout


# ----------------------------------------------------------------------------
# Mixtures of experts under ZeRO 1-2 (DeepSpeed's MoE parameter groups)
# ----------------------------------------------------------------------------

# 8 experts, top-2 of sigmoid scores, the load-balancing and z losses, DeepSeek's
# expert bias, the all-to-all dispatcher; dropless, fp32, 4 steps (clipped: COMMON's 0.05).
MOE = ["--num-experts", "8", "--moe-ffn-hidden-size", "32", "--moe-router-score-function", "sigmoid",
       "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--moe-router-enable-expert-bias",
       "--moe-router-bias-update-rate", "1e-2", "--moe-token-dispatcher-type", "alltoall",
       "--train-iters", "4", "--eval-interval", "2", "--lr-decay-iters", str(STEPS)]
MOE_STAGES = (0, 1, 2)
# The other layouts of the two ranks (D = 1), and recomputation (D = 2): each run plain and
# under ZeRO-1 (ZeRO-2 at TP 2 + SP)
LAYOUT_RUNS = {"tp2": ["--tensor-model-parallel-size", "2"],
               "tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
               "pp2": ["--pipeline-model-parallel-size", "2"],
               "cp2_ep2": ["--context-parallel-size", "2", "--expert-model-parallel-size", "2"],
               "recompute": ["--recompute-activations"]}  # DeepSpeed's checkpointing: its forward takes no grad


def moe_worker(out: str) -> None:
    """2 processes (D=2): the plain engine at EP 1 and EP 2 (the curves), then
    ZeRO stages 0-2 at EP 1 and EP 2 (ZeRO-1 and 2 at EP 2 saved halfway); at
    LAYOUT_RUNS' the plain engine and ZeRO; in bf16
    at EP 2 the plain engine, ZeRO-1 and 2; ZeRO-1 and 2 resumed from a copy of
    their halfway checkpoint, and ZeRO-1's at EP 1 (refused)."""
    import warnings
    import torch.distributed as dist
    warnings.simplefilter("ignore")
    as_torchrun_rank()
    ck = lambda name: os.path.join(out, "ckpt_" + name)  # noqa: E731
    for ep in (1, 2):
        worker_run(out, f"moe_ep{ep}", [*MOE, "--expert-model-parallel-size", str(ep)])
        for stage in MOE_STAGES:
            save = ["--save", ck(f"moe_z{stage}_ep{ep}"), "--save-interval", "2"] if ep == 2 and stage else []
            worker_run(out, f"moe_z{stage}_ep{ep}", [*MOE, "--expert-model-parallel-size", str(ep),
                                                     "--deepspeed", "--zero-stage", str(stage), *save])
    for name, layout in LAYOUT_RUNS.items():
        worker_run(out, f"moe_{name}", [*MOE, *layout])
        stage = 1 + name.endswith("sp")
        worker_run(out, f"moe_z{stage}_{name}", [*MOE, *layout, "--deepspeed", "--zero-stage", str(stage)])
    worker_run(out, "moe_ep2_bf16", [*MOE, "--expert-model-parallel-size", "2", "--bf16"])
    for stage in (1, 2):
        worker_run(out, f"moe_z{stage}_ep2_bf16", [*MOE, "--expert-model-parallel-size", "2", "--bf16",
                                                   "--deepspeed", "--zero-stage", str(stage)])
    for stage in (1, 2):
        name = f"moe_z{stage}_ep2"
        if dist.get_rank() == 0:
            shutil.copytree(os.path.join(ck(name), "iter_0000002"), os.path.join(ck(name + "_resume"), "iter_0000002"))
            with open(os.path.join(ck(name + "_resume"), "latest"), "w") as f:
                f.write("iter_0000002")
        dist.barrier()
        worker_run(out, name + "_resume", [*MOE, "--expert-model-parallel-size", "2", "--deepspeed",
                                           "--zero-stage", str(stage), "--load", ck(name + "_resume")])
    try:  # the EP 2 checkpoint at EP 1: refused (on every rank alike, before DeepSpeed reads it)
        worker_run(out, "moe_z1_ep1_from_ep2", [*MOE, "--deepspeed", "--zero-stage", "1", "--load", ck("moe_z1_ep2")])
    except UsageError as e:
        if dist.get_rank() == 0:
            with open(os.path.join(out, "moe_refused.txt"), "w") as f:
                f.write(str(e))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ds_moe"))
    write_zipf_corpus(os.path.join(out, "corpus_text_document"))
    run_on_ranks(moe_worker, out, world_size=2)
    return out


# What each step logs: the LM loss, the gradient norm, the validation loss, the MoE layers' figures
MOE_CURVE = ["loss", "grad_norm", "val_loss", "load_balancing_loss", "z_loss", "moe_imbalance"]


@pytest.mark.parametrize("stage", MOE_STAGES)
@pytest.mark.parametrize("ep", [1, 2])
def test_zero_with_experts_trains_the_plain_curve(moe_runs, stage, ep):
    """ZeRO stages 0-2 with 8 experts over 2 data-parallel ranks, at EP 1 (every
    rank holds every expert) and EP 2 (each rank 4, none held twice), train the
    plain engine's curve with the same flags, to 1e-5 in fp32, each step: the
    LM loss, the (clipping) gradient norm, the validation loss and the MoE
    layers' figures. Which proves that under DeepSpeed's MoE parameter groups
    ZeRO averages the experts over the ranks holding the same experts and the
    rest over DP, counts each expert once in the norm, that the auxiliary losses
    take each micro-batch's share and the expert bias moves on every rank's tokens."""
    ref, got = metrics(moe_runs, f"moe_ep{ep}"), metrics(moe_runs, f"moe_z{stage}_ep{ep}")
    assert [m["iteration"] for m in got] == [1, 2, 3, 4]
    assert all(m["grad_norm"] > 0.05 for m in ref)  # clipping was active throughout
    for a, b in zip(ref, got, strict=True):
        for key in (k for k in MOE_CURVE if k in a):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (stage, ep, a["iteration"], key)
    assert ref[-1]["loss"] < ref[0]["loss"]


@pytest.mark.parametrize("run", ["z1_tp2", "z2_tp2_sp", "z1_pp2", "z1_cp2_ep2", "z1_recompute"])
def test_zero_with_experts_at_tensor_pipeline_or_context_parallel_layouts_trains_the_plain_curve(moe_runs, run):
    """With experts, ZeRO-1 at TP 2 (each expert's weights split over the two
    ranks as the dense MLP's; the router's gradient summed over them), ZeRO-2
    at TP 2 + SP, ZeRO-1 over 2 pipeline stages (1F1B), and ZeRO-1 at CP 2 with
    EP 2 folded out of CP, and ZeRO-1 with --recompute-activations (DeepSpeed's
    reentrant checkpointing, whose forward runs without grad: the recompute
    records the layer's figures), each train the plain engine's curve at the
    same layout and at TP 1 x D 2, to 1e-5 in fp32, the MoE figures included."""
    layout = run.partition("_")[2]
    ref, got = metrics(moe_runs, f"moe_{layout}"), metrics(moe_runs, f"moe_{run}")
    assert [m["iteration"] for m in got] == [1, 2, 3, 4]
    for a, b, c in zip(ref, got, metrics(moe_runs, "moe_ep1"), strict=True):
        for key in (k for k in MOE_CURVE if k in a):
            assert b[key] == pytest.approx(c[key], rel=1e-5, abs=1e-7), (run, "TP 1", a["iteration"], key)
        for key in (k for k in MOE_CURVE if k in a):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (run, a["iteration"], key)
    assert ref[-1]["loss"] < ref[0]["loss"]


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_with_experts_in_bf16_follows_the_plain_bf16_run(moe_runs, stage):
    """In bf16 at EP 2, ZeRO-1 and 2 follow the plain engine's bf16 run (to bf16's
    rounding: the plain engine's gradients are bf16, ZeRO's reduced in fp32). The
    gradient norm's 1% would catch an expert counted twice or not at all, as
    DeepSpeed's 16-bit stage-0 optimizer does (6% off here; config.py refuses it)."""
    ref, got = metrics(moe_runs, "moe_ep2_bf16"), metrics(moe_runs, f"moe_z{stage}_ep2_bf16")
    for a, b in zip(ref, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=3e-3) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-2)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_zero_checkpoint_with_experts_resumes_bit_for_bit(moe_runs, stage):
    """ZeRO-1 and 2 at EP 2, resumed from their halfway checkpoint, take the
    uninterrupted run's steps bit for bit: each rank's own experts come back
    (DeepSpeed's model file holds rank 0's; each rank's are in its ZeRO partition)."""
    full, resumed = metrics(moe_runs, f"moe_z{stage}_ep2"), metrics(moe_runs, f"moe_z{stage}_ep2_resume")
    assert [m["iteration"] for m in resumed] == [3, 4] and "val_loss" in resumed[-1]
    assert resumed == [{**m, "tokens_per_sec": r["tokens_per_sec"]} for m, r in zip(full[2:], resumed)]


def test_zero3_with_experts_is_one_line_from_rank_0(corpus):
    """ZeRO-3 takes no experts of ours (DeepSpeed's own refuses all but its AutoEP
    layers): one line from rank 0, naming the flags and the stages that work."""
    proc = torchrun("train.py", *COMMON, "--data-path", corpus, "--num-experts", "4", "--deepspeed",
                    "--zero-stage", "3", nproc=2, check=False)
    assert proc.returncode != 0 and proc.stderr.count("train.py: error") == 1, proc.stderr[-3000:]
    assert "--num-experts with --deepspeed --zero-stage 3" in proc.stderr and "--zero-stage 1 or 2" in proc.stderr
    assert 'train.py", line' not in proc.stderr


def test_a_zero_checkpoint_with_experts_elsewhere_is_one_line(moe_runs, tmp_path):
    """A ZeRO checkpoint of experts over EP 2 resumed at EP 1 is refused in one
    line naming the sizes, as another data-parallel size is; its weights are
    not exported yet (zero_to_fp32 would merge each rank's experts as if they
    were one tensor's partitions): one line too."""
    with open(os.path.join(moe_runs, "moe_refused.txt")) as f:
        refused = f.read()
    assert "was written with expert-parallel size 2, this run has 1" in refused and "\n" not in refused
    with pytest.raises(UsageError, match="of experts over --expert-model-parallel-size 2 resumes in its own "
                                         "layout only") as error:
        checkpoint.export_weights(os.path.join(moe_runs, "ckpt_moe_z2_ep2"), str(tmp_path / "x"),
                                  "plain")
    assert "\n" not in str(error.value) and not os.path.exists(tmp_path / "x")
