"""checkpoint.py: train.py's checkpoints, DeepSpeed's published beside them, and
(huggingface.py) Hugging Face GPT-2 and Llama directories in and out.

A save is atomic (written under a temporary name, fsynced, renamed into place,
then the `latest` pointer replaced), so a crash or a power loss leaves the
previous checkpoint readable; a diverged model never reaches one; --load reads
the newest checkpoint of any kind. The DeepSpeed runs that write ZeRO
checkpoints (and their export) are in test_zero.py; resuming across layouts,
--ckpt-format torch_dist's (the default) included, in test_train.py and test_pipeline.py (here:
torch_dist in one process against the torch format, which checkpoints written before torch_dist
became the default are in). The Hugging Face tests build random transformers models and
check that ours computes the same logits, both ways.
"""
import dataclasses
import contextlib
import errno
import glob
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp  # checkpoint.py's torch_dist calls: patched below
from torch.distributed.checkpoint.staging import DefaultStager

import checkpoint
import config
import eval_tasks
import huggingface
import launch
import parallel
import train
import train_ops
from conftest import (IDS, ROOT, TINY, VOCAB, _train_main, read_metrics, run_bounded, run_on_ranks, run_together,
                      run_train, tiny, tiny_model, tokens, train_on_ranks)
from gpt import GPT, LLAMA_OPTIONS
from huggingface import HF_CONFIG, from_hf, hf_architecture, hf_to_ours, ours_to_hf, to_hf
from launch import UsageError, sha256_of
from prepare import load_tokenizer


# -----------------------------------------------------------------------------
# Saving safely: a crash, a power loss or a failed write leaves the previous
# checkpoint, and `latest` naming it


@pytest.mark.quick
def test_crash_during_save_keeps_previous_checkpoint(corpus, tmp_path, monkeypatch, capsys):
    ckpt = str(tmp_path / "ckpt")
    args = [*TINY, "--data-path", corpus, "--train-iters", "4", "--save", ckpt, "--save-interval", "2",
            "--ckpt-format", "torch"]
    real_save = torch.save
    saves = []

    def save_that_crashes(obj, path, *a, **k):
        saves.append(path)
        if len(saves) == 2:  # the second checkpoint dies half-written
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError("disk full")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", save_that_crashes)
    with pytest.raises(OSError, match="disk full"):
        train.main(args)
    monkeypatch.setattr(torch, "save", real_save)
    assert open(os.path.join(ckpt, checkpoint.LATEST)).read() == "2"
    state = torch.load(os.path.join(ckpt, "iter_0000002", "model_optim_rng.pt"), weights_only=False)
    assert state["iteration"] == 2 and state["consumed_samples"] == 8
    assert not glob.glob(os.path.join(ckpt, "*.tmp"))  # the half-written save is gone at once: its space freed
    # The run resumes from iteration 2, saves at 3 and stops. (A save killed outright
    # leaves its iter_N.tmp to the next publish: test_a_kill_during_an_async_write...)
    train.main([*args, "--load", ckpt, "--save-interval", "3", "--exit-interval", "3"])
    assert open(os.path.join(ckpt, checkpoint.LATEST)).read() == "3"


@pytest.mark.quick
def test_resaving_an_iteration_never_leaves_latest_dangling(tmp_path, monkeypatch):
    """Re-saving iteration 2 moves the old copy aside before the new one is
    renamed in; a crash between the two renames leaves `latest` naming a
    missing directory, and the loader then reads the copy set aside."""
    save = str(tmp_path / "ckpt")
    checkpoint.write_plain_checkpoint(save, {"iteration": 2, "weights": "first"})
    real_replace = os.replace

    def crash_on_rename_into_place(src, dst):
        if src.endswith(".tmp") and dst.endswith("iter_0000002"):
            raise OSError("power cut")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_rename_into_place)
    with pytest.raises(OSError, match="power cut"):
        checkpoint.write_plain_checkpoint(save, {"iteration": 2, "weights": "second"})
    monkeypatch.setattr(os, "replace", real_replace)
    assert not os.path.exists(os.path.join(save, "iter_0000002"))  # what `latest` names
    def saved_weights():
        path = os.path.join(checkpoint.latest_checkpoint(save).path, checkpoint.PLAIN_FILE)
        return torch.load(path, weights_only=False)["weights"]
    assert saved_weights() == "first"
    checkpoint.write_plain_checkpoint(save, {"iteration": 2, "weights": "third"})
    assert saved_weights() == "third"
    assert sorted(os.listdir(save)) == ["iter_0000002", checkpoint.LATEST]


@pytest.mark.quick
def test_checkpoint_reaches_the_disk_before_it_is_published(tmp_path, monkeypatch):
    """The atomic renames only survive a power loss if what they publish is on
    disk first: the file, its directory, then (after the rename) the parent,
    then the pointer and its directory."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def spy_fsync(fd):  # Linux: the descriptor's path, as it is when fsynced
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", os.path.basename(b))),
                                                      real_replace(a, b))[1])
    checkpoint.write_plain_checkpoint(str(tmp_path / "ckpt"), {"iteration": 5})
    order = [e for e in events if e[1] in ("model_optim_rng.pt", checkpoint.DIGESTS, "iter_0000005.tmp",
                                            "iter_0000005", "ckpt", checkpoint.LATEST)]
    assert order == [("rename", checkpoint.DIGESTS), ("fsync", "iter_0000005.tmp"),  # the digests, whole
                     ("fsync", checkpoint.DIGESTS), ("fsync", "model_optim_rng.pt"), ("fsync", "iter_0000005.tmp"),
                     ("rename", "iter_0000005"), ("fsync", "ckpt"),
                     ("rename", checkpoint.LATEST), ("fsync", "ckpt")]
    assert any(e[0] == "fsync" and e[1].startswith(checkpoint.LATEST + ".tmp") for e in events)


def test_a_failed_write_on_rank_0_stops_every_rank(corpus, tmp_path):
    """Only rank 0 writes a plain checkpoint. If that fails (here a file
    stands where its temporary directory goes), the other rank must not wait
    for it at a barrier forever: both exit, and the error names the cause."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "iter_0000001.tmp").write_text("")
    start = time.time()
    proc = run_train([*TINY, "--data-path", corpus, "--train-iters", "1", "--ckpt-format", "torch",
                      "--save", str(tmp_path / "ckpt")], nproc=2, check=False, timeout=240)
    assert proc.returncode != 0 and time.time() - start < 200
    assert "FileExistsError" in proc.stderr
    assert "rank 1: stopping, saving checkpoint 1" in proc.stderr and "failed on rank 0" in proc.stderr


@pytest.mark.parametrize("given", ["a file", "a path under a file"])
def test_a_save_directory_that_cannot_be_one_is_one_line_before_the_first_step(corpus, tmp_path, given, capsys):
    """--save that is a file, or lies under one, is refused when the run
    starts, as --load is, in one line: not at the first save, a save
    interval of compute later, with a traceback."""
    (tmp_path / "a-file").write_text("")
    save = tmp_path / "a-file" if given == "a file" else tmp_path / "a-file" / "ckpt"
    with pytest.raises(SystemExit) as stop:
        train.main([*TINY, "--data-path", corpus, "--train-iters", "2", "--save", str(save)])
    where = "is a file" if given == "a file" else f"lies under {tmp_path / 'a-file'}, a file"
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and err.strip().splitlines() == [
        f"train.py: error: --save {save} {where}: give a directory (one that is not there yet is made)"]
    assert "iter " not in out  # not a step was taken


def test_keep_last_checkpoints_removes_a_linked_checkpoint_but_not_what_it_links_to(corpus, tmp_path, capsys):
    """An old checkpoint in --save that is a symbolic link (to an archive,
    say): --keep-last-checkpoints removes the link, with a line that says
    so, and never follows it: the checkpoint it names stays whole."""
    archived, ckpt = tmp_path / "archive" / "iter_0000001", tmp_path / "ckpt"
    archived.mkdir(parents=True)
    (archived / checkpoint.PLAIN_FILE).write_bytes(b"the archived weights")
    ckpt.mkdir()
    (ckpt / "iter_0000001").symlink_to(archived)
    train.main([*TINY, "--data-path", corpus, "--train-iters", "2", "--eval-interval", "0", "--ckpt-format", "torch",
                "--save", str(ckpt), "--save-interval", "2", "--keep-last-checkpoints", "1"])
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", checkpoint.LATEST]
    assert (archived / checkpoint.PLAIN_FILE).read_bytes() == b"the archived weights"
    assert (f"removed the link iter_0000001 (--keep-last-checkpoints 1); the checkpoint it named, "
            f"{archived}, is left as it is") in capsys.readouterr().out


def test_keep_last_checkpoints_removes_older_ones_after_each_save(corpus, tmp_path):
    """--keep-last-checkpoints 2 with a save every step: the two newest remain
    and `latest` names the newest. A later iteration left by another run,
    and anything not named like a checkpoint, are not touched."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000009").mkdir(parents=True)
    (ckpt / "notes").mkdir()
    train.main([*TINY, "--data-path", corpus, "--train-iters", "5", "--eval-interval", "0",
                "--save", str(ckpt), "--save-interval", "1", "--keep-last-checkpoints", "2"])
    assert sorted(os.listdir(ckpt)) == sorted([checkpoint.LATEST, "iter_0000004", "iter_0000005", "iter_0000009", "notes"])
    assert open(ckpt / checkpoint.LATEST).read() == "5"


@pytest.mark.parametrize("flags", [["--ckpt-format", "torch"], ["--ckpt-format", "torch_dist"], ["--deepspeed"]],
                         ids=["torch", "torch_dist", "deepspeed"])
def test_a_link_planted_as_a_saves_temporary_name_is_removed_not_written_through(
        ids_corpus, tmp_path, capsys, flags):
    """SAVE/iter_0000002.tmp, the name the save at iteration 2 writes under,
    and iter_0000009.tmp (an unfinished save's, which the save removes),
    planted as links to a directory beside SAVE. The save writes nothing
    through them (DCP and DeepSpeed wrote into the directory, then published
    the link as iter_0000002; the torch format failed): each link is
    removed, what it named is as it was, and iter_0000002 is a directory of
    its own that loads."""
    save, beside = tmp_path / "ckpt", tmp_path / "beside"
    beside.mkdir()
    (beside / "theirs.txt").write_text("not the run's")
    save.mkdir()
    for name in ("iter_0000002.tmp", "iter_0000009.tmp"):
        os.symlink(beside, save / name)
    train.main([*TINY, *IDS, "--data-path", ids_corpus, "--train-iters", "2", "--eval-interval", "0",
                "--save", str(save), "--save-interval", "2", *flags])
    assert "removed iter_0000009.tmp, the leftover of a save that did not complete" in capsys.readouterr().out
    assert os.listdir(beside) == ["theirs.txt"] and (beside / "theirs.txt").read_text() == "not the run's"
    assert not glob.glob(str(save / "*.tmp")) and not os.path.islink(save / "iter_0000002")
    assert checkpoint.verified_checkpoint(str(save), print).path == str(save / "iter_0000002")


HOLDS_ITS_SAVE = """
import sys, time
sys.path.insert(0, {root!r})
import train
real_step = train.train_step

def slow_step(*args, **kwargs):  # a long first step: the run holds its --save meanwhile
    time.sleep(600)
    return real_step(*args, **kwargs)

train.train_step = slow_step
train.main(sys.argv[1:])
"""


def test_a_second_run_given_the_same_save_directory_stops_in_one_line(corpus, two_saves, tmp_path, capsys):
    """A run resumed from SAVE and writing it (held in its first step) and a
    second run started with the same --save, which would delete the first's
    unfinished save (iter_N.tmp) as a leftover and write over its
    checkpoints: the second stops in one line that names the first's pid,
    and SAVE is as it was. Once the first is killed (SIGKILL: its lock file
    stays) the same command resumes and saves: the kernel released the dead
    process's lock, as for a torchrun restart (test_launch.py's restarts)."""
    save, script = tmp_path / "ckpt", tmp_path / "holder.py"
    shutil.copytree(two_saves, save)
    script.write_text(HOLDS_ITS_SAVE.format(root=ROOT))
    args = [*TINY, "--data-path", corpus, "--eval-interval", "0", "--save", str(save), "--load", str(save)]
    lock = save / checkpoint.LOCK
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen([sys.executable, str(script), *args, "--train-iters", "8"], cwd=ROOT,
                                 stdout=log, stderr=log, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (lock.exists() and lock.read_text()) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert lock.exists() and first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        before = {k: v for k, v in tree_digests(save).items() if k != checkpoint.LOCK}
        with pytest.raises(SystemExit) as stop:
            train.main([*args, "--train-iters", "8"])
        assert stop.value.code == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"train.py: error: another run is writing {save} (pid {first.pid} on {socket.gethostname()}, which "
            f"holds {checkpoint.LOCK}): wait for it to end, or give this run another --save"]
        assert {k: v for k, v in tree_digests(save).items() if k != checkpoint.LOCK} == before
    finally:
        first.kill()
        first.wait()
    assert lock.exists()  # no handler ran
    train.main([*args, "--train-iters", "5"])
    assert f"loaded checkpoint {save}/iter_0000004 (iteration 4)" in capsys.readouterr().out
    assert (save / checkpoint.LATEST).read_text() == "5" and not lock.exists()


# -----------------------------------------------------------------------------
# A diverged model never reaches a checkpoint (in-process: a single rank)


def test_non_finite_loss_stops_and_keeps_last_checkpoint(corpus, tmp_path, monkeypatch, capsys):
    ckpt = str(tmp_path / "ckpt")
    args = [*TINY, "--data-path", corpus, "--train-iters", "6", "--save", ckpt, "--save-interval", "2"]
    real_step = train.train_step
    calls = []

    def step_that_diverges(*a, **k):
        loss, norm, stepped = real_step(*a, **k)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 3 else loss), norm, stepped

    monkeypatch.setattr(train, "train_step", step_that_diverges)
    with pytest.raises(SystemExit) as exc:
        train.main(args)
    assert exc.value.code == 1
    assert "loss is nan at iteration 3" in capsys.readouterr().out
    assert open(os.path.join(ckpt, checkpoint.LATEST)).read() == "2"
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", checkpoint.LATEST]


def test_non_finite_gradient_skips_the_step_and_never_reaches_a_checkpoint(corpus, tmp_path, monkeypatch):
    """fp32 (no loss scaler): an inf gradient at iteration 2, a save step, leaves
    the weights as iteration 1 left them; the run goes on and says it skipped."""
    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    real_build = train.build_model
    backwards = []

    def build_with_inf_at_iteration_2(cfg, device):
        model = real_build(cfg, device)

        def poison(p):
            backwards.append(1)
            if len(backwards) == 2:
                p.grad[0, 0] = float("inf")

        model.wte.weight.register_post_accumulate_grad_hook(poison)
        return model

    monkeypatch.setattr(train, "build_model", build_with_inf_at_iteration_2)
    train.main([*TINY, "--data-path", corpus, "--train-iters", "3", "--save", ckpt, "--ckpt-format", "torch",
                "--save-interval", "1", "--metrics-file", metrics])
    saved = [torch.load(os.path.join(ckpt, f"iter_{i:07d}", "model_optim_rng.pt"), weights_only=False)
             for i in (1, 2, 3)]
    for name, value in saved[1]["model"].items():
        assert torch.isfinite(value).all(), name
        assert torch.equal(value, saved[0]["model"][name]), name  # iteration 2 was skipped
    assert not torch.equal(saved[2]["model"]["wte.weight"], saved[1]["model"]["wte.weight"])
    assert [r["skipped_iterations"] for r in read_metrics(metrics)] == [0, 1, 0]


# -----------------------------------------------------------------------------
# Which checkpoint --load reads (the DeepSpeed runs that mix both kinds in
# one directory: test_zero.py)


class _RunsACommand:
    """Unpickled without weights_only, this is os.system(command)."""
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_no_entry_point_runs_code_from_a_checkpoint_file(corpus, tmp_path):
    """A model_optim_rng.pt whose unpickling would run a shell command, under
    its pointer as a real checkpoint: --load, --export-from and eval_tasks.py
    each stop with one line that names the file, and the command never runs."""
    ckpt, ran = tmp_path / "ckpt", tmp_path / "the-command-ran"
    bad = ckpt / "iter_0000002" / checkpoint.PLAIN_FILE
    bad.parent.mkdir(parents=True)
    torch.save({"model": {}, "iteration": 2, "consumed_samples": 8, "hook": _RunsACommand(f"touch {ran}")}, bad)
    (ckpt / checkpoint.LATEST).write_text("2")
    for args in (["train.py", *TINY, "--data-path", corpus, "--train-iters", "3", "--load", str(ckpt)],
                 ["train.py", "--export-from", str(ckpt), "--export-to", str(tmp_path / "exported")],
                 ["eval_tasks.py", "--task", "GENERATE", "--load", str(ckpt), "--num-samples", "1"]):
        proc = run_bounded([sys.executable, *args], 120, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode != 0 and not ran.exists(), proc.stderr[-2000:]
        message = [line for line in proc.stderr.splitlines() if "refusing to read" in line]
        assert len(message) == 1 and f"{bad} holds posix.system" in message[0], proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr


def stops_in_one_line(probes, ran=None, timeout=180):
    """Each probe, (train.py's or eval_tasks.py's command line, what its error
    says), run at once from the project's root: each stops with a non-zero
    exit and that one line on stderr, no traceback; and `ran` (the file a
    payload would create) is not there."""
    procs = run_together([[sys.executable, *args] for args, _ in probes], timeout, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    for (args, says), proc in zip(probes, procs):
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode != 0 and len(lines) == 1 and says in lines[0], (args, proc.stderr[-3000:])
        assert ran is None or not ran.exists(), args


def test_a_legacy_format_or_raw_pickle_checkpoint_file_is_refused_in_one_line(corpus, tmp_path):
    """The same payload in a model_optim_rng.pt written in torch's pre-zip
    format (torch.save(..., _use_new_zipfile_serialization=False)), or as a
    raw pickle (protocol 4): --load and --export-from stop in one line that
    names the file and the global, found without unpickling it."""
    ran, probes = tmp_path / "the-command-ran", []
    for fmt, args in (("legacy", [*TINY, "--data-path", corpus, "--train-iters", "3", "--load"]),
                      ("raw", ["--export-to", str(tmp_path / "exported"), "--export-from"])):
        ckpt = tmp_path / fmt
        bad = ckpt / "iter_0000002" / checkpoint.PLAIN_FILE
        bad.parent.mkdir(parents=True)
        state = {"model": {}, "iteration": 2, "consumed_samples": 8, "hook": _RunsACommand(f"touch {ran}")}
        if fmt == "legacy":
            torch.save(state, bad, _use_new_zipfile_serialization=False)
        else:
            bad.write_bytes(pickle.dumps(state, protocol=4))
        (ckpt / checkpoint.LATEST).write_text("2")
        probes.append((["train.py", *args, str(ckpt)], f"{bad} holds posix.system"))
    stops_in_one_line(probes, ran)


# -----------------------------------------------------------------------------
# Damaged checkpoints: found by their digests, and passed over for the newest
# intact one


@pytest.fixture(scope="module")
def two_saves(corpus, tmp_path_factory):
    """A tiny run's checkpoints at iterations 2 and 4 in the torch format (one
    file, model_optim_rng.pt: the default before torch_dist; don't modify: copy)."""
    ckpt = str(tmp_path_factory.mktemp("saves") / "ckpt")
    train.main([*TINY, "--data-path", corpus, "--train-iters", "4", "--save", ckpt, "--save-interval", "2",
                "--eval-interval", "0", "--ckpt-format", "torch"])
    return ckpt


@pytest.fixture(scope="module")
def dist_saves(corpus, tmp_path_factory):
    """two_saves' run, the same seed, saved with no --ckpt-format: the default,
    torch_dist (DCP: .metadata and one __0_0.distcp file; don't modify: copy)."""
    ckpt = str(tmp_path_factory.mktemp("dist_saves") / "ckpt")
    train.main([*TINY, "--data-path", corpus, "--train-iters", "4", "--save", ckpt, "--save-interval", "2",
                "--eval-interval", "0"])
    return ckpt


def dist_tensors(path: str) -> dict:
    """Every tensor of a torch_dist checkpoint (model, optimizer, RNG), read whole."""
    saved = checkpoint.read_dist_metadata(path).state_dict_metadata
    return {k: v for k, v in checkpoint.read_dist(path, {k: torch.empty(md.size, dtype=md.properties.dtype)
                                                         for k, md in saved.items() if hasattr(md, "properties")},
                                                  no_dist=True).items() if torch.is_tensor(v)}


@pytest.mark.quick
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_every_save_lists_its_files_digests_in_sha256sums_format(two_saves, dist_saves, fmt):
    saves, files = {"torch": (two_saves, [checkpoint.PLAIN_FILE]),
                    "torch_dist": (dist_saves, [checkpoint.DIST_METADATA, "__0_0.distcp"])}[fmt]
    for tag in ("iter_0000002", "iter_0000004"):
        proc = subprocess.run(["sha256sum", "-c", checkpoint.DIGESTS], cwd=os.path.join(saves, tag),
                              capture_output=True, text=True)
        assert proc.returncode == 0 and proc.stdout == "".join(f"{f}: OK\n" for f in files), proc.stdout + proc.stderr


def _damage(path: str, how: str) -> None:
    if how == "a flipped byte":
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif how.startswith(("truncated", "cut to", "not a zip")):
        if how.startswith("not a zip"):
            with open(path, "wb") as f:
                f.write(b"not the bytes of a checkpoint\n" * 100)
        else:
            os.truncate(path, int(how.split()[2]) if how.startswith("cut to") else os.path.getsize(path) // 2)
        if how.endswith("no digests"):  # a checkpoint from before them, or copied without them
            os.remove(os.path.join(os.path.dirname(path), checkpoint.DIGESTS))
    else:
        os.remove(path)


@pytest.mark.quick
@pytest.mark.parametrize("fmt, how", [("torch", "a flipped byte"), ("torch", "truncated"), ("torch", "missing"),
                                      ("torch", "truncated, no digests"), ("torch_dist", "a flipped byte"),
                                      ("torch_dist", "missing"), ("torch_dist", "truncated, no digests"),
                                      ("torch_dist", "truncated index, no digests")])
def test_a_damaged_newest_checkpoint_is_named_and_the_run_resumes_from_the_one_before(
        corpus, two_saves, dist_saves, tmp_path, capsys, fmt, how):
    ckpt, name = str(tmp_path / "ckpt"), {"torch": checkpoint.PLAIN_FILE, "torch_dist": "__0_0.distcp"}[fmt]
    name = checkpoint.DIST_METADATA if "index" in how else name
    shutil.copytree(two_saves if fmt == "torch" else dist_saves, ckpt)
    _damage(os.path.join(ckpt, "iter_0000004", name), how)
    metrics = tmp_path / "m.jsonl"
    train.main([*TINY, "--data-path", corpus, "--train-iters", "5", "--load", ckpt, "--eval-interval", "0",
                "--metrics-file", str(metrics)])
    out = capsys.readouterr().out
    problem = {("torch", "missing"): "it holds no checkpoint",
               ("torch_dist", "missing"): f"{name} is missing",
               ("torch", "truncated, no digests"): f"{name} is truncated (its zip directory is gone)",
               ("torch_dist", "truncated, no digests"): f"{name} is truncated",
               ("torch_dist", "truncated index, no digests"): f"{name} is truncated"}.get((fmt, how), f"{name} is damaged")
    assert f"checkpoint {ckpt}/iter_0000004 cannot be loaded: {problem}" in out
    assert f"falling back to {ckpt}/iter_0000002 (iteration 2), the newest intact checkpoint" in out
    assert [m["iteration"] for m in read_metrics(metrics)] == [3, 4, 5]


@pytest.mark.quick
@pytest.mark.parametrize("how", ["cut to 0 bytes, no digests", "cut to 3 bytes, no digests", "not a zip, no digests"])
def test_a_model_file_of_a_few_bytes_or_no_zip_is_cut_short(two_saves, tmp_path, capsys, how):
    """The newest checkpoint's model file, without digests, cut to 0-3 bytes
    or bytes that are no zip (not torch.save's, nor a pickle): an EOFError
    traceback, or the line for a file that would run code, before. One line
    says it is cut short, and --export-from exports the checkpoint before."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_saves, ckpt)
    _damage(str(ckpt / "iter_0000004" / checkpoint.PLAIN_FILE), how)
    log = _export_log(ckpt, tmp_path / "out", capsys)
    assert (f"checkpoint {ckpt}/iter_0000004 cannot be loaded: {checkpoint.PLAIN_FILE} is truncated, or not a "
            f"checkpoint's file: neither a zip (torch.save's) nor a pickle") in log, log
    assert sorted(os.listdir(tmp_path / "out")) == ["iter_0000002", checkpoint.LATEST]


@pytest.mark.quick
def test_with_no_intact_checkpoint_left_the_run_stops_naming_the_damage(corpus, two_saves, tmp_path, capsys):
    """Never a silent start from scratch; export says the same."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(two_saves, ckpt)
    for tag in ("iter_0000002", "iter_0000004"):
        _damage(os.path.join(ckpt, tag, checkpoint.PLAIN_FILE), "a flipped byte")
    with pytest.raises(SystemExit) as stop:
        train.main([*TINY, "--data-path", corpus, "--train-iters", "5", "--load", ckpt])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error == [f"train.py: error: no intact checkpoint in {ckpt}: {ckpt}/iter_0000004: model_optim_rng.pt "
                     f"is damaged (its sha256 is not the one checksums.sha256 records); {ckpt}/iter_0000002: "
                     f"model_optim_rng.pt is damaged (its sha256 is not the one checksums.sha256 records)"]
    with pytest.raises(UsageError, match="no intact checkpoint"):
        checkpoint.export_weights(ckpt, str(tmp_path / "out"))


def _rewrite_digests(tag: str, *extra_lines: str, binary: bool = False) -> None:
    """tag's checksums.sha256 made anew from its files, as anyone who changes
    them can, with extra_lines after (binary: in `sha256sum -b`'s form)."""
    names = sorted(n for n in os.listdir(tag) if n != checkpoint.DIGESTS and os.path.isfile(os.path.join(tag, n)))
    lines = [f"{sha256_of(os.path.join(tag, n))}{' *' if binary else '  '}{n}" for n in names]
    with open(os.path.join(tag, checkpoint.DIGESTS), "w") as f:
        f.write("".join(f"{line}\n" for line in [*lines, *extra_lines]))


def test_a_checkpoint_whose_files_lead_elsewhere_is_passed_over_and_nothing_is_read_forever(
        corpus, two_saves, tmp_path):
    """Checkpoints unpacked from a tar or zip whose checksums.sha256 names a
    file outside (/dev/zero, ../../../etc/passwd, /etc/passwd), that is a
    symbolic link, a FIFO or a directory, or that is not in sha256sum's
    format: `train.py --load` names each in one line and resumes from the
    newest intact one, whose checksums are in `sha256sum -b`'s form (which
    sha256sum -c reads too); an iter_NNNNNNN of digits that are not ASCII is
    no checkpoint. With none intact, --export-from and eval_tasks.py stop in
    one line. Each within a time bound: none reads /dev/zero or a FIFO."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_saves, ckpt)
    _rewrite_digests(str(ckpt / "iter_0000004"), binary=True)
    assert subprocess.run(["sha256sum", "-c", checkpoint.DIGESTS], cwd=ckpt / "iter_0000004").returncode == 0
    passwd = hashlib.sha256(open("/etc/passwd", "rb").read()).hexdigest()
    model = checkpoint.PLAIN_FILE
    hostile = {  # iteration: (what is done to a copy of iteration 4, the problem named); the newest first
        15: (lambda t: _rewrite_digests(t, "0000  /dev/zero"),
             "line 2 of checksums.sha256, '0000  /dev/zero', is not"),
        14: (lambda t: _rewrite_digests(t, f"{'0' * 64}  /dev/zero"), "'/dev/zero' is not a file name"),
        13: (lambda t: _rewrite_digests(t, f"{passwd}  ../../../etc/passwd"),
             "'../../../etc/passwd' is not a file name"),
        12: (lambda t: _rewrite_digests(t, f"{passwd}  /etc/passwd"), "'/etc/passwd' is not a file name"),
        11: (lambda t: (os.remove(os.path.join(t, model)), os.symlink("/dev/zero", os.path.join(t, model))),
             f"{model} is a symbolic link (to /dev/zero), not a file"),
        10: (lambda t: (os.remove(os.path.join(t, model)), os.mkfifo(os.path.join(t, model))),
             f"{model} is a FIFO, not a file"),
        9: (lambda t: (os.remove(os.path.join(t, checkpoint.DIGESTS)),
                       os.symlink("/dev/zero", os.path.join(t, checkpoint.DIGESTS))),
            "checksums.sha256 is a symbolic link (to /dev/zero), not a file"),
        8: (lambda t: _rewrite_digests(t, f"{passwd} {model}"), "line 2 of checksums.sha256"),
        7: (lambda t: (os.mkdir(os.path.join(t, "more")), _rewrite_digests(t, f"{passwd}  more")),
            "more is a directory, not a file"),
        6: (lambda t: shutil.copy(os.path.join(t, model), os.path.join(t, "other.pt")),
            "other.pt is not listed in checksums.sha256"),
    }
    for iteration, (change, _) in hostile.items():
        shutil.copytree(ckpt / "iter_0000004", ckpt / f"iter_{iteration:07d}")
        change(str(ckpt / f"iter_{iteration:07d}"))
    (ckpt / "iter_²²²²²²²").mkdir()
    (ckpt / checkpoint.LATEST).write_text("15")
    env, metrics = {**os.environ, "OMP_NUM_THREADS": "1"}, tmp_path / "m.jsonl"
    proc = run_bounded([sys.executable, "train.py", *TINY, "--data-path", corpus, "--train-iters", "5",
                        "--load", str(ckpt), "--eval-interval", "0", "--metrics-file", str(metrics)], 60,
                       cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for iteration, (_, problem) in hostile.items():
        assert f"checkpoint {ckpt}/iter_{iteration:07d} cannot be loaded: {problem}" in proc.stdout, proc.stdout
    assert f"falling back to {ckpt}/iter_0000004 (iteration 4), the newest intact checkpoint" in proc.stdout
    assert [m["iteration"] for m in read_metrics(metrics)] == [5]
    for iteration, like in ((4, 10), (2, 15)):  # now none is intact
        hostile[like][0](str(ckpt / f"iter_{iteration:07d}"))
    for args in (["train.py", "--export-from", str(ckpt), "--export-to", str(tmp_path / "exported")],
                 ["eval_tasks.py", "--task", "GENERATE", "--load", str(ckpt), "--num-samples", "1"]):
        proc = run_bounded([sys.executable, *args], 60, cwd=ROOT, env=env)
        errors = [line for line in proc.stderr.splitlines() if line.startswith(f"{args[0]}: error")]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
        assert errors[0].startswith(f"{args[0]}: error: no intact checkpoint in {ckpt}: {ckpt}/iter_0000015: "
                                    f"{hostile[15][1]} `SHA256  NAME` of a file listed once; "), errors[0]
        assert f"{ckpt}/iter_0000004: {hostile[10][1]}; " in errors[0], errors[0]
        assert errors[0].endswith(f"{ckpt}/iter_0000002: {hostile[15][1]} `SHA256  NAME` of a file listed once")
        assert "Traceback" not in proc.stderr


def _edited(tag: str, edit) -> None:
    """tag's model_optim_rng.pt rewritten with edit(its state) done, and its
    checksums made anew to match, as anyone who edits a checkpoint can."""
    path = os.path.join(tag, checkpoint.PLAIN_FILE)
    state = torch.load(path, weights_only=False)
    edit(state)
    torch.save(state, path)
    _rewrite_digests(tag)


def _export_log(ckpt, out, capsys) -> str:
    """train.py --export-from ckpt --export-to out -> what it printed."""
    train.main(["--export-from", str(ckpt), "--export-to", str(out)])
    return capsys.readouterr().out


@pytest.mark.quick
@pytest.mark.parametrize("how", ["a sparse file", "an oversized checksums.sha256"])
def test_a_checkpoint_that_would_cost_more_to_read_than_its_bytes_is_passed_over(two_saves, tmp_path, capsys, how):
    """A file of 256 MiB that is holes (a tar carries them in a few bytes, and
    a reader takes as long as the size says: 16 TB would take hours), listed
    in checksums.sha256 made anew; or a checksums.sha256 larger than a line
    for each file there can make it (a GB of it took GBs of memory). Neither
    is read: --export-from names it in one line and exports the checkpoint before."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    shutil.copytree(two_saves, ckpt)
    tag = ckpt / "iter_0000004"
    if how == "a sparse file":
        with open(tag / "holes.bin", "wb") as f:
            f.truncate(256 << 20)
        _rewrite_digests(str(tag))
        problem = "holes.bin is a sparse file: 268,435,456 bytes, of which "
    else:
        with open(tag / checkpoint.DIGESTS, "a") as f:
            f.write("#" * (1 << 20) + "\n")
        problem = (f"checksums.sha256 is {os.path.getsize(tag / checkpoint.DIGESTS):,} bytes, more than a line "
                   f"for each file there can take (644)")  # 2 files: (64 + 2 + 255 + 1) x 2
    log = _export_log(ckpt, out, capsys)
    assert f"checkpoint {tag} cannot be loaded: {problem}" in log, log
    assert f"falling back to {ckpt}/iter_0000002 (iteration 2), the newest intact checkpoint" in log
    assert sorted(os.listdir(out)) == ["iter_0000002", checkpoint.LATEST]


@pytest.mark.quick
@pytest.mark.parametrize("where", ["checksums.sha256", "DCP's .metadata", "a Hugging Face index"])
def test_a_file_name_longer_than_a_filesystem_takes_is_one_line(two_saves, dist_saves, tmp_path, capsys, where):
    """A name of 302 characters (a file name has at most 255 bytes: opening
    it would be `OSError: File name too long`) in checksums.sha256, as a
    tensor's file in DCP's .metadata, or in a Hugging Face
    model.safetensors.index.json: --export-from names it, shortened, in one
    line. No file of the checkpoint can bear it, so it is damage: from a save
    directory, the checkpoint before is exported."""
    long = "x" * 290 + ".safetensors"
    shown = f"'{'x' * 59}... (304 characters)"  # its repr, shortened
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    if where == "checksums.sha256":
        shutil.copytree(two_saves, ckpt)
        _rewrite_digests(str(ckpt / "iter_0000004"), f"{'0' * 64}  {long}")
        log = _export_log(ckpt, out, capsys)
        assert (f"checkpoint {ckpt}/iter_0000004 cannot be loaded: {shown} is not a file name in the checkpoint's "
                f"directory") in log, log
        assert sorted(os.listdir(out)) == ["iter_0000002", checkpoint.LATEST]
        return
    named = f"names {shown}, a file it does not hold ({shown} is not a file name in the checkpoint's directory)"
    if where == "DCP's .metadata":
        shutil.copytree(dist_saves, ckpt)
        tag, index = ckpt / "iter_0000004", checkpoint.DIST_METADATA
        metadata = checkpoint.read_dist_metadata(str(tag))
        for key, info in metadata.storage_data.items():
            if key.fqn == "model.wte.weight":
                info.relative_path = long
        with open(tag / index, "wb") as f:
            pickle.dump(metadata, f)
        _rewrite_digests(str(tag))
        log = _export_log(ckpt, out, capsys)
        assert f"checkpoint {tag} cannot be loaded: {tag / checkpoint.DIST_METADATA} {named}" in log, log
        assert sorted(os.listdir(out)) == ["iter_0000002", checkpoint.LATEST]
        return
    else:
        to_hf(tiny_model(), str(tmp_path / "good"))
        tag, index = ckpt, "model.safetensors.index.json"
        ckpt.mkdir()
        shutil.copy(tmp_path / "good" / HF_CONFIG, ckpt)
        (ckpt / index).write_text(json.dumps({"metadata": {}, "weight_map": {"wte.weight": long}}))
    with pytest.raises(SystemExit) as stop:
        train.main(["--export-from", str(ckpt), "--export-to", str(out)])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"train.py: error: checkpoint {tag} is damaged: {tag / index} {named}"]


@pytest.mark.parametrize("edit, problem", [
    (lambda s: s.update(consumed_samples="abc"), "its consumed_samples is str, not a count"),
    (lambda s: s["optimizer"]["state"].pop("wte.weight"), "it has no optimizer state for parameter 'wte.weight'"),
    (lambda s: s["rng"].update(torch=torch.zeros(10, dtype=torch.uint8)),
     "its rng['torch'] is not the state of a torch random generator"),
    (lambda s: s["rng"].update(python=(3, (1, 2, 3), None)),
     "its rng['python'] is not the state of a python random generator"),
    (lambda s: s["model"].pop("ln_f.weight"), "its model_config does not describe its tensors: ln_f.weight is "
                                              "absent there, of shape (64,) by the model_config"),
    (lambda s: s["model"].update({"extra.weight": torch.zeros(3)}),
     "its model_config does not describe its tensors: extra.weight is of shape (3,) there, absent by the"),
], ids=["consumed_samples 'abc'", "an optimizer state removed", "rng['torch'] of the wrong size",
        "rng['python'] of the wrong length", "a weight missing", "an extra weight"])
def test_a_checkpoint_that_records_what_no_load_can_take_is_passed_over(
        corpus, two_saves, tmp_path, capsys, edit, problem):
    """The newest plain checkpoint edited, its checksums made anew: a count of
    samples that is no number, a parameter's AdamW state gone, a random
    generator's state of the wrong size, a weight its model_config does not
    have or lacks. Each was a traceback once the load read it (the strict
    load's, the optimizer's, the generator's); now one line names it and the
    run resumes from the checkpoint before."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    shutil.copytree(two_saves, ckpt)
    _edited(str(ckpt / "iter_0000004"), edit)
    train.main([*TINY, "--data-path", corpus, "--train-iters", "5", "--load", str(ckpt), "--eval-interval", "0",
                "--metrics-file", str(metrics)])
    out = capsys.readouterr().out
    assert f"checkpoint {ckpt}/iter_0000004 cannot be loaded: {problem}" in out, out
    assert f"falling back to {ckpt}/iter_0000002 (iteration 2), the newest intact checkpoint" in out
    assert [m["iteration"] for m in read_metrics(metrics)] == [3, 4, 5]


@pytest.mark.quick
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_load_reads_what_a_checkpoint_records_once_before_its_tensors(two_saves, dist_saves, monkeypatch, fmt):
    """--load's checks before a tensor is read (damage's verdict, then this
    run's model against the checkpoint's model_config) read its record once:
    a plain checkpoint's pickle is unpickled once, without a tensor's bytes,
    and a torch_dist checkpoint's non-tensors are read (DCP) once. Each was
    read three times, by each check on its own."""
    import torch._weights_only_unpickler as unpickler
    reads = []
    monkeypatch.setattr(unpickler.Unpickler, "load",
                        lambda self, load=unpickler.Unpickler.load: reads.append("pickle") or load(self))
    monkeypatch.setattr(checkpoint, "read_dist",
                        lambda *args, read=checkpoint.read_dist, **kwargs: reads.append("DCP") or read(*args, **kwargs))
    cfg = config.parse_args([*TINY, "--load", two_saves if fmt == "torch" else dist_saves])
    assert checkpoint.checkpoint_to_load(cfg, lambda line: None).iteration == 4
    assert reads.count("pickle" if fmt == "torch" else "DCP") == 1, reads


def _deepspeed_meta(two_saves: str, iteration: int, **changes) -> dict:
    """A trainer_state.json as a 1-rank ZeRO-1 save of two_saves' model writes
    it, `changes` made (a change to None: the key dropped)."""
    with checkpoint.data_only_loads(two_saves):
        record = torch.load(os.path.join(two_saves, "iter_0000004", checkpoint.PLAIN_FILE))["model_config"]
    meta = {"iteration": iteration, "consumed_samples": 8 * iteration, "zero_stage": 1, "data_parallel_size": 1,
            "context_parallel_size": 1, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
            "model_config": record, "tensor_parallel_layout": {}, **changes}
    return {key: value for key, value in meta.items() if value is not None}


def _deepspeed_checkpoint(tag: str, meta: dict) -> None:
    """A DeepSpeed checkpoint's files at tag (its shards stand-ins), with checksums."""
    os.makedirs(tag)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        torch.save({"iteration": meta["iteration"]}, os.path.join(tag, name))
    with open(os.path.join(tag, checkpoint.DS_META), "w") as f:
        json.dump(meta, f)
    _rewrite_digests(tag)


@pytest.mark.quick
def test_a_deepspeed_trainer_state_that_records_what_no_load_can_take_is_passed_over(two_saves, tmp_path, capsys):
    """DeepSpeed checkpoints whose trainer_state.json records a valid iteration
    but no tensor-parallel size or one that is "x", no model_config, a
    pipeline-parallel size of 1,000,000 (where one model-states file is), no
    data-parallel size, ZeRO stage "two", or an expert-parallel size "2" (a
    comparison with an int crashed), with DeepSpeed's `latest` naming
    the newest: --export-from names each in one line (each was a traceback
    in the export or the load) and exports the plain checkpoint before them."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    shutil.copytree(two_saves, ckpt)
    cases = {11: ({"expert_model_parallel_size": "2"}, "expert_model_parallel_size of type str"),
             10: ({"tensor_model_parallel_size": None}, "no tensor_model_parallel_size"),
             9: ({"tensor_model_parallel_size": "x"}, "tensor_model_parallel_size of type str"),
             8: ({"model_config": None}, "no model_config"),
             7: ({"pipeline_model_parallel_size": 1000000},
                 "tensor- x pipeline-parallel size 1 x 1000000 (1000000 model-parallel ranks), where model "
                 "states are there for 1"),
             6: ({"data_parallel_size": None}, "no data_parallel_size"),
             5: ({"zero_stage": "two"}, "zero_stage of type str")}
    for iteration, (changes, _) in cases.items():
        _deepspeed_checkpoint(str(ckpt / f"iter_{iteration:07d}"), _deepspeed_meta(two_saves, iteration, **changes))
    (ckpt / checkpoint.DS_LATEST).write_text("iter_0000011")
    log = _export_log(ckpt, out, capsys)
    for iteration, (_, problem) in cases.items():
        tag = ckpt / f"iter_{iteration:07d}"
        assert (f"checkpoint {tag} cannot be loaded: {tag}/{checkpoint.DS_META} records {problem}: not the "
                f"{checkpoint.DS_META} train.py writes, or damaged") in log, log
    assert f"falling back to {ckpt}/iter_0000004 (iteration 4), the newest intact checkpoint" in log
    assert sorted(os.listdir(out)) == ["iter_0000004", checkpoint.LATEST]


@pytest.mark.quick
def test_an_iteration_of_eight_digits_is_a_checkpoint_like_any_other(two_saves, tmp_path, capsys):
    """From iteration 10,000,000 a save's name has eight digits (iter_N of at
    least seven, as Megatron's): without a pointer it is the newest there
    (never the one before it), DeepSpeed's `latest` may name one, and
    --keep-last-checkpoints counts them (it kept them all, and deleted the
    newest seven-digit ones in their stead)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_saves, ckpt)
    os.remove(ckpt / checkpoint.LATEST)
    big = ckpt / "iter_10000004"
    shutil.copytree(ckpt / "iter_0000004", big)
    _edited(str(big), lambda state: state.update(iteration=10_000_004))
    _export_log(ckpt, tmp_path / "out", capsys)
    assert sorted(os.listdir(tmp_path / "out")) == ["iter_10000004", checkpoint.LATEST]
    (ckpt / checkpoint.DS_LATEST).write_text("iter_10000006")  # gone: the newest intact one loads
    log = _export_log(ckpt, tmp_path / "again", capsys)
    assert f"checkpoint {ckpt}/iter_10000006 cannot be loaded: it holds no checkpoint" in log, log
    assert f"falling back to {big} (iteration 10000004), the newest intact checkpoint" in log
    said = []
    checkpoint.remove_old_checkpoints(str(ckpt), 10_000_004, 2, said.append)
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("iter_")) == ["iter_0000004", "iter_10000004"]
    assert said == ["removed checkpoint iter_0000002 (--keep-last-checkpoints 2)"]


def test_pytorchs_converter_gives_a_torch_dist_checkpoint_as_the_torch_formats_states(
        two_saves, dist_saves, tmp_path):
    """`python -m torch.distributed.checkpoint.format_utils dcp_to_torch` reads
    a torch_dist checkpoint whole: the torch format's states under flat names
    (model.NAME, optimizer.NAME.exp_avg, ...), bit for bit those that the same
    run saved in the torch format, and the model's those of our own export
    (--export-to: one weights-only file); so does --export-from."""
    out = tmp_path / "converted.pt"
    proc = run_bounded([sys.executable, "-m", "torch.distributed.checkpoint.format_utils", "dcp_to_torch",
                        os.path.join(dist_saves, "iter_0000004"), str(out)], 120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    converted = torch.load(out, weights_only=True)
    with checkpoint.data_only_loads(two_saves):
        plain = torch.load(os.path.join(two_saves, "iter_0000004", checkpoint.PLAIN_FILE))
    assert {k[len("model."):] for k in converted if k.startswith("model.")} == plain["model"].keys()
    for name, t in plain["model"].items():
        assert torch.equal(converted[f"model.{name}"], t), name
    for name, state in plain["optimizer"]["state"].items():
        for k, v in state.items():
            assert torch.equal(converted[f"optimizer.{name}.{k}"], v), (name, k)
    assert (converted["iteration"], converted["consumed_samples"]) == (4, plain["consumed_samples"])
    assert_export_is_converted(dist_saves, converted, tmp_path / "export")
    from safetensors.torch import load_file
    for saves in (two_saves, dist_saves):  # --export-from reads either format: the same weights
        checkpoint.export_weights(saves, str(tmp_path / os.path.basename(os.path.dirname(saves))), "hf")
    exported = [load_file(str(tmp_path / os.path.basename(os.path.dirname(s)) / "model.safetensors"))
                for s in (two_saves, dist_saves)]
    assert exported[0].keys() == exported[1].keys()
    assert all(torch.equal(exported[0][k], exported[1][k]) for k in exported[0])
    # The other way: the converted states written by DCP alone (another program's torch_dist
    # checkpoint, the tensors without our iteration, configs and random streams): one line.
    import torch.distributed.checkpoint as dcp
    other = tmp_path / "other" / "iter_0000004"
    dcp.save({k: v for k, v in converted.items() if torch.is_tensor(v) and k.startswith("model.")},
             storage_writer=dcp.FileSystemWriter(str(other)), no_dist=True)
    with pytest.raises(UsageError, match="has no iteration, consumed_samples, config, model_config, rng.stage0: "
                                         "a torch_dist checkpoint, but not one train.py wrote"):
        checkpoint.export_weights(str(other.parent), str(tmp_path / "other-out"))


def assert_export_is_converted(saves: str, converted: dict, out) -> None:
    """--export-from SAVES --export-to OUT (a single weights-only torch file)
    holds the model tensors that PyTorch's converter gave (`converted`)."""
    checkpoint.export_weights(saves, str(out))
    with checkpoint.data_only_loads(str(out)):
        ours = torch.load(glob.glob(os.path.join(out, "iter_*", checkpoint.PLAIN_FILE))[0])
    assert ours["optimizer"] is None
    assert {f"model.{k}" for k in ours["model"]} == {k for k in converted if k.startswith("model.")}
    for name, t in ours["model"].items():
        assert torch.equal(converted[f"model.{name}"], t), name


def test_either_format_loads_with_no_flag(corpus, two_saves, dist_saves, tmp_path):
    """A checkpoint written before torch_dist became the default (the torch
    format, one model_optim_rng.pt) and one written with no --ckpt-format now
    (.metadata and .distcp files) are read with no flag: the same run saved
    both ways resumes to the same loss, eval_tasks.py generates the same text
    from either, and --export-from exports the same weights."""
    assert sorted(os.listdir(os.path.join(two_saves, "iter_0000004"))) == [checkpoint.DIGESTS, checkpoint.PLAIN_FILE]
    assert sorted(os.listdir(os.path.join(dist_saves, "iter_0000004"))) == [
        checkpoint.DIST_METADATA, "__0_0.distcp", checkpoint.DIGESTS]
    import eval_tasks
    results = []
    for name, saves in (("torch", two_saves), ("torch_dist", dist_saves)):
        out = tmp_path / name
        train.main([*TINY, "--data-path", corpus, "--train-iters", "5", "--load", saves, "--eval-interval", "0",
                    "--metrics-file", str(out) + ".jsonl"])
        eval_tasks.main(["--task", "GENERATE", "--load", saves, "--num-samples", "2", "--out-seq-length", "8",
                       "--temperature", "0", "--sample-output-file", str(out) + ".samples"])
        checkpoint.export_weights(saves, str(out))
        with checkpoint.data_only_loads(str(out)):
            exported = torch.load(out / "iter_0000004" / checkpoint.PLAIN_FILE)["model"]
        resumed = [(m["iteration"], m["loss"], m["grad_norm"], m["lr"]) for m in read_metrics(str(out) + ".jsonl")]
        results.append((resumed, open(str(out) + ".samples").read(), exported))
    (resumed, samples, exported), (dist_resumed, dist_samples, dist_exported) = results
    assert [m[0] for m in resumed] == [5] and resumed == dist_resumed
    assert samples and samples == dist_samples
    assert exported.keys() == dist_exported.keys()
    assert all(torch.equal(exported[k], dist_exported[k]) for k in exported)


def test_a_torch_dist_index_that_would_run_code_is_refused(dist_saves, tmp_path):
    """DCP's index (.metadata) is a pickle: read with DCP's metadata classes
    alone, so one naming os.system, even with its digest rewritten to match,
    is refused in one line and never runs."""
    ckpt, ran = tmp_path / "ckpt", tmp_path / "the-command-ran"
    shutil.copytree(dist_saves, ckpt)
    tag = ckpt / "iter_0000004"
    (tag / checkpoint.DIST_METADATA).write_bytes(pickle.dumps(_RunsACommand(f"touch {ran}")))
    checkpoint.write_digests(str(tag), checkpoint.digest_files(str(tag), [checkpoint.DIST_METADATA, "__0_0.distcp"]))
    with pytest.raises(UsageError, match="refusing to read the checkpoint .* the global posix.system in .metadata"):
        checkpoint.export_weights(str(ckpt), str(tmp_path / "out"))
    assert not ran.exists()


def test_a_torch_dist_checkpoint_that_would_import_run_or_read_what_it_chose_is_one_line(corpus, dist_saves, tmp_path):
    """A torch_dist checkpoint, its digests rewritten to match as an attacker
    would, whose .metadata names a module to import (torch's model_dump's
    __main__, which would parse train.py's own arguments), or names a file
    outside its directory for a tensor's bytes (or one in it that its digests
    do not list), or whose .distcp holds a payload: --load, --export-from and
    eval_tasks.py each stop in one line, and nothing is imported or run."""
    import torch.distributed.checkpoint as dcp
    ran, probes = tmp_path / "the-command-ran", []
    assert "torch.utils.model_dump" not in sys.modules

    def planted(name, plant, args, says):
        ckpt = tmp_path / name
        shutil.copytree(dist_saves, ckpt)
        tag = ckpt / "iter_0000004"
        plant(str(tag))
        checkpoint.write_digests(str(tag), checkpoint.digest_files(str(tag), [
            n for n in os.listdir(tag) if n != checkpoint.DIGESTS]))
        probes.append(([*args, str(ckpt)], says))
        return str(tag)

    def import_module(tag):
        with open(os.path.join(tag, checkpoint.DIST_METADATA), "wb") as f:
            f.write(b"\x80\x02ctorch.utils.model_dump.__main__\nmain\n.")  # GLOBAL module name, STOP

    def reads(name):
        def plant(tag):  # the embedding's bytes from the file `name`
            metadata = checkpoint.read_dist_metadata(tag)
            for index, info in metadata.storage_data.items():
                if index.fqn == "model.wte.weight":
                    info.relative_path = name
            with open(os.path.join(tag, checkpoint.DIST_METADATA), "wb") as f:
                pickle.dump(metadata, f)
        return plant

    def payload(tag):
        shutil.rmtree(tag)
        dcp.save({"iteration": 4, "consumed_samples": 32, "config": {}, "model_config": _RunsACommand(f"touch {ran}"),
                  "rng.stage0": torch.zeros(8, dtype=torch.uint8)},  # all that train.py writes, or refused for that
                 storage_writer=dcp.FileSystemWriter(tag), planner=dcp.DefaultSavePlanner(**checkpoint.AS_THEY_ARE),
                 no_dist=True)

    tag = planted("module", import_module, ["train.py", *TINY, "--data-path", corpus, "--train-iters", "5", "--load"],
                  "the global torch.utils.model_dump.__main__.main in .metadata")
    with pytest.raises(UsageError, match="model_dump"):
        checkpoint.read_dist_metadata(tag)
    assert "torch.utils.model_dump" not in sys.modules  # not imported to find out
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_bytes(os.urandom(1 << 16))
    tag = planted("reads-elsewhere", reads("../../outside/secret.txt"),
                  ["train.py", "--export-to", str(tmp_path / "exported"), "--export-from"],
                  "names '../../outside/secret.txt', not one of its own files")
    planted("payload", payload, ["eval_tasks.py", "--task", "GENERATE", "--num-samples", "1", "--load"],
            "__0_0.distcp (its model_config) holds posix.system")
    stops_in_one_line(probes, ran)
    os.remove(os.path.join(tag, checkpoint.DIGESTS))  # a checkpoint without digests: its files' extents are checked
    stops_in_one_line(probes[1:2], ran)
    tag = planted("reads-unverified", reads(checkpoint.DIGESTS), [], "")  # in the directory, but no digest checks it
    with pytest.raises(UsageError, match=f"names '{checkpoint.DIGESTS}', not one of its own files .*is not one of "
                                         f"the files its {checkpoint.DIGESTS} lists"):
        checkpoint.read_dist_metadata(tag)


# -----------------------------------------------------------------------------
# Files that lie about their sizes, strides, pieces or settings (issue 69), their
# digests recomputed as anyone can: each is damage, named in one line and passed
# over; nothing is allocated, read or written past what the files hold


def _resaved(tag: str, edit) -> None:
    """tag's checkpoint (either format) read whole, edit(state) applied, written
    back as its format's save writes it (DCP: torch.save of each piece as it is
    given), and its digests made anew."""
    if os.path.exists(os.path.join(tag, checkpoint.PLAIN_FILE)):
        state = torch.load(os.path.join(tag, checkpoint.PLAIN_FILE), weights_only=False)
        edit(state)
        torch.save(state, os.path.join(tag, checkpoint.PLAIN_FILE))
    else:
        saved = checkpoint.read_dist_metadata(tag).state_dict_metadata
        state = checkpoint.read_dist(tag, {k: torch.empty(md.size, dtype=md.properties.dtype)
                                           if hasattr(md, "size") else None for k, md in saved.items()}, no_dist=True)
        state = {k: state[k] for k in saved}  # (not read_dist's own pipeline_rng and rng)
        edit(state)
        shutil.rmtree(tag)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tag),
                 planner=dcp.DefaultSavePlanner(**checkpoint.AS_THEY_ARE), no_dist=True)
    _rewrite_digests(tag)


def _index_edited(tag: str, edit) -> None:
    """tag's DCP index (.metadata), edit(metadata) applied, and its digests made anew."""
    with open(os.path.join(tag, checkpoint.DIST_METADATA), "rb") as f:
        metadata = pickle.load(f)
    edit(metadata)
    with open(os.path.join(tag, checkpoint.DIST_METADATA), "wb") as f:
        pickle.dump(metadata, f)
    _rewrite_digests(tag)


def _piece_of(metadata, fqn: str):
    """The _StorageInfo (file, offset, length) of a tensor's first piece in a DCP index."""
    return next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)


def _rezipped(path: str, compression: int = zipfile.ZIP_STORED, shorten: str | None = None,
              zeros: int = 0) -> None:
    """The torch.save zip at `path` written anew record by record: compressed
    (ZIP_DEFLATED, which torch's reader inflates and torch.save never writes),
    the record named `shorten` cut to its first 4 bytes (a storage that claims
    more bytes than its record holds), and each record over 1 MiB `zeros`
    bytes of zeros instead (one saved under torch.serialization.skip_data)."""
    with zipfile.ZipFile(path) as old, zipfile.ZipFile(f"{path}.new", "w", compression, compresslevel=1) as new:
        for record in old.infolist():
            with new.open(record.filename, "w", force_zip64=True) as out:
                if record.file_size > 1 << 20 and zeros:
                    for _ in range(zeros >> 20):
                        out.write(bytes(1 << 20))
                else:
                    out.write(old.read(record)[:4 if record.filename == shorten else None])
    os.replace(f"{path}.new", path)
    _rewrite_digests(os.path.dirname(path))


def _plant(ckpt, hostile: dict) -> None:
    """Each of `hostile` (iteration: (what is done to a copy of iteration 4, what
    the problem says)), planted in ckpt as a checkpoint of its own iteration."""
    for iteration, (change, _) in sorted(hostile.items(), reverse=True):
        tag = str(ckpt / f"iter_{iteration:07d}")
        shutil.copytree(ckpt / "iter_0000004", tag)
        _resaved(tag, lambda state: state.__setitem__("iteration", iteration))
        change(tag)
    (ckpt / checkpoint.LATEST).write_text(str(max(hostile)))


def _moments(edit):
    """A change to a checkpoint of either format: edit(moments of wte.weight) -> the new ones."""
    def change(tag):
        def edited(state):
            if "optimizer" in state:
                state["optimizer"]["state"]["wte.weight"] = edit(state["optimizer"]["state"]["wte.weight"])
            else:
                keys = {k: f"optimizer.wte.weight.{k}" for k in ("exp_avg", "exp_avg_sq", "step")}
                state.update({keys[k]: v for k, v in edit({k: state[key] for k, key in keys.items()}).items()})
        _resaved(tag, edited)
    return change


def _settings(**settings):
    """A change to a checkpoint of either format: its optimizer's param groups updated with `settings`."""
    def change(tag):
        def edited(state):
            for group in (state["optimizer"]["param_groups"] if "optimizer" in state
                          else state["optimizer.param_groups"]):
                group.update(settings)
        _resaved(tag, edited)
    return change


def _passed_over(log: str, ckpt, hostile: dict) -> None:
    """The log names each of `hostile`'s checkpoints (_plant's) with its problem on its
    line, and falls back to iteration 4's."""
    for iteration, (_, problem) in hostile.items():
        line = f"checkpoint {ckpt}/iter_{iteration:07d} cannot be loaded: "
        assert line in log and problem in log.split(line)[1].splitlines()[0], (problem, log)
    assert f"falling back to {ckpt}/iter_0000004 (iteration 4), the newest intact checkpoint" in log


IMPLEMENTATION = dict(maximize=True, fused=False, foreach=True, capturable=True, differentiable=True)


def test_a_plain_checkpoint_whose_tensors_or_settings_lie_is_passed_over_and_no_step_writes_past_a_buffer(
        corpus, two_saves, tmp_path):
    """model_optim_rng.pt edited as anyone can, its digests recomputed: an
    optimizer state of the wrong shape (the fused AdamW would update 3.2 M
    elements of a 9-element buffer: SIGSEGV), or of the right shape with stride 0
    (one element of storage), two states on the same bytes, a record compressed
    (deflate) or shorter than its storage says, AdamW settings that the flags
    refuse. `train.py --load` names each in one line and resumes from the newest
    intact checkpoint, whose param groups ask for maximize, no fused kernel,
    foreach, capturable and differentiable: this run's own optimizer goes on, and
    the losses are an untouched copy's. With none intact, --load and
    --export-from stop in one line (status 2: never a signal)."""
    ckpt, untouched = tmp_path / "ckpt", tmp_path / "untouched"
    shutil.copytree(two_saves, ckpt)
    shutil.copytree(two_saves, untouched)
    file = checkpoint.PLAIN_FILE
    shape = torch.load(os.path.join(two_saves, "iter_0000004", file), mmap=True,
                       weights_only=False)["model"]["wte.weight"].shape
    hostile = {
        12: (_moments(lambda m: {**m, "exp_avg": torch.zeros(3, 3)}),
             f"the optimizer state of wte.weight has exp_avg [3, 3] float32 with strides [3, 1], not laid out as its "
             f"weight ({list(shape)} float32 with strides [{shape[1]}, 1])"),
        11: (_moments(lambda m: {**m, "exp_avg": torch.full((1,), .01).expand(*shape)}),
             f"{file}: optimizer.state.wte.weight.exp_avg of size {tuple(shape)} has strides (0, 0): its elements "
             f"overlap"),
        10: (_moments(lambda m: {**m, "exp_avg_sq": m["exp_avg"]}), "are views of the same bytes"),
        9: (_settings(betas=(5.0, -3.0)), "param_groups hold a setting no flag may take (--adam-beta1 5.0: it must "
                                          "be at least 0 and below 1)"),
        8: (_settings(eps=-1.0), "(--adam-eps -1.0: it must be at least 0)"),
        7: (lambda tag: _rezipped(os.path.join(tag, file), zipfile.ZIP_DEFLATED),
            f"{file} holds its record model_optim_rng/data.pkl compressed (deflate), where torch.save stores every "
            f"record as it is"),
        6: (lambda tag: _rezipped(os.path.join(tag, file), shorten="model_optim_rng/data/0"),
            "bytes, its record holds 4"),
    }
    _plant(ckpt, hostile)
    _settings(**IMPLEMENTATION)(str(ckpt / "iter_0000004"))
    probes = [["train.py", *TINY, "--data-path", corpus, "--train-iters", "14", "--load", str(path), "--eval-interval",
               "0", "--metrics-file", f"{path}.jsonl"] for path in (ckpt, untouched)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc, _ = run_together([[sys.executable, *args] for args in probes], 240, cwd=ROOT, env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    _passed_over(proc.stdout, ckpt, hostile)
    curves = [[(m["iteration"], m["loss"], m["grad_norm"]) for m in read_metrics(f"{path}.jsonl")]
              for path in (ckpt, untouched)]
    assert curves[0] == curves[1] and [i for i, *_ in curves[0]] == list(range(5, 15))  # no ascent, no other kernel
    hostile[12][0](str(ckpt / "iter_0000004"))  # now none is intact
    hostile[11][0](str(ckpt / "iter_0000002"))
    stops_in_one_line([(probes[0][:-2], f"no intact checkpoint in {ckpt}: "),
                       (["train.py", "--export-from", str(ckpt), "--export-to", str(tmp_path / "out")],
                        f"{ckpt}/iter_0000002: {hostile[11][1]}")], timeout=240)


def test_a_torch_dist_checkpoint_whose_index_or_states_lie_is_passed_over_and_exports_the_intact_ones_bytes(
        corpus, dist_saves, tmp_path):
    """.metadata (DCP's index) edited as anyone can, its digests recomputed: a
    tensor's size of [2**20, 2**20] (DCP would allocate it before reading), a
    piece larger than its tensor, bytes past the end of the .distcp (an offset
    after it, or a length of 2**40), a negative offset, a tensor's bytes read
    from .metadata itself, each tensor's pieces one element (DCP leaves the
    rest uninitialized: an export wrote heap bytes); or re-saved with a 1-D
    optimizer state for a 2-D weight (allocated as saved: the fused AdamW
    wrote past it), a state of one element expanded, AdamW settings the flags
    refuse, a piece compressed (deflate). `train.py --load` and --export-from
    name each in one line and read the newest intact checkpoint, whose saved
    betas go on, said in a line; the export holds its bytes. With none intact,
    --load stops in one line."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(dist_saves, ckpt)
    distcp = os.path.getsize(ckpt / "iter_0000004" / "__0_0.distcp")
    shape = checkpoint.read_dist_metadata(str(ckpt / "iter_0000004")).state_dict_metadata["model.wte.weight"].size

    wte = "model.wte.weight"
    hostile = {
        21: (_index_change(lambda md: setattr(md.state_dict_metadata[wte], "size", torch.Size([2**20, 2**20]))),
             f".metadata: {wte} of size [1048576, 1048576] is 1,099,511,627,776 elements, its pieces hold "
             f"{shape.numel():,}"),
        20: (_index_change(lambda md: setattr(md.state_dict_metadata[wte].chunks[0], "sizes",
                                              torch.Size([shape[0] + 1, shape[1]]))),
             f"{wte} of size {list(shape)} has a piece outside it (at [0, 0], of size [{shape[0] + 1}, {shape[1]}])"),
        19: (_piece_change(wte, offset=distcp),
             f"__0_0.distcp is truncated: .metadata places {wte}'s bytes up to byte"),
        18: (_piece_change(wte, length=2**40), f"__0_0.distcp is truncated: .metadata places {wte}'s bytes up to byte "
                                               f"{2**40 // 10**9:,}"),
        17: (_piece_change(wte, offset=-1), f".metadata places {wte} at byte -1"),
        16: (_piece_change(wte, relative_path=checkpoint.DIST_METADATA), f".metadata gives its own bytes as {wte}'s"),
        15: (_index_change(_one_element_pieces), ", its pieces hold 1"),
        14: (_moments(lambda m: {**m, "exp_avg": torch.zeros(9)}),
             f"the optimizer state of wte.weight has exp_avg [9] float32 with strides [1], not laid out as its weight "
             f"({list(shape)} float32"),
        13: (_appended("optimizer.wte.weight.exp_avg", torch.full((1,), .01).expand(*shape)),
             f"of __0_0.distcp, fewer than its piece's {shape.numel() * 4:,}"),
        12: (_settings(eps=-1.0), "(--adam-eps -1.0: it must be at least 0)"),
        11: (_appended("optimizer.param_groups", [], zipfile.ZIP_DEFLATED),
             "compressed (deflate), where torch.save stores every record as it is"),
    }
    _plant(ckpt, hostile)
    _settings(betas=(0.8, 0.99), **IMPLEMENTATION)(str(ckpt / "iter_0000004"))
    load = ["train.py", *TINY, "--data-path", corpus, "--train-iters", "5", "--load", str(ckpt), "--eval-interval", "0",
            "--metrics-file", str(tmp_path / "m.jsonl")]
    export = ["train.py", "--export-from", str(ckpt), "--export-to", str(tmp_path / "out")]
    procs = run_together([[sys.executable, *args] for args in (load, export)], 240, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    for proc in procs:
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        _passed_over(proc.stdout, ckpt, hostile)
    assert ("the checkpoint's AdamW settings go on: --adam-beta1 0.8 (this run: 0.9), --adam-beta2 0.99 (this run: "
            "0.95)") in procs[0].stdout
    assert [m["iteration"] for m in read_metrics(tmp_path / "m.jsonl")] == [5]
    exported = torch.load(tmp_path / "out" / "iter_0000004" / checkpoint.PLAIN_FILE, weights_only=False)["model"]
    saved = {k[len("model."):]: v for k, v in dist_tensors(os.path.join(dist_saves, "iter_0000004")).items()
             if k.startswith("model.")}
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    hostile[14][0](str(ckpt / "iter_0000004"))  # now none is intact
    hostile[13][0](str(ckpt / "iter_0000002"))
    stops_in_one_line([(load[:-2], f"{ckpt}/iter_0000004: {hostile[14][1]}")], timeout=240)


def _index_change(edit):
    """A change to a torch_dist checkpoint: its index edited by edit(metadata)."""
    return lambda tag: _index_edited(tag, edit)


def _piece_change(fqn: str, **fields):
    """A change to a torch_dist checkpoint: where its index says fqn's first piece lies (file, offset, length)."""
    return _index_change(lambda md: _piece_of(md, fqn).__dict__.update(fields))


def _one_element_pieces(metadata) -> None:
    """Each weight's pieces in a DCP index made one, of one element: the rest of it covered by none."""
    for fqn, tensor in metadata.state_dict_metadata.items():
        if fqn.startswith("model."):
            tensor.chunks = [dataclasses.replace(tensor.chunks[0], sizes=torch.Size([1] * len(tensor.size)))]


def _appended(fqn: str, obj, compression: int = zipfile.ZIP_STORED):
    """A change to a torch_dist checkpoint: fqn's piece torch.save(obj) as it is (an expanded tensor: one
    element), its records compressed with ZIP_DEFLATED (as torch.save never writes), appended to its
    .distcp and named by its index."""
    saved, piece = io.BytesIO(), io.BytesIO()
    torch.save(obj, saved)
    with zipfile.ZipFile(saved) as old, zipfile.ZipFile(piece, "w", compression) as new:
        for record in old.infolist():
            new.writestr(record.filename, old.read(record))

    def change(tag):
        offset = os.path.getsize(os.path.join(tag, "__0_0.distcp"))
        with open(os.path.join(tag, "__0_0.distcp"), "ab") as f:
            f.write(piece.getvalue())
        _index_edited(tag, lambda md: _piece_of(md, fqn).__dict__.update(offset=offset, length=len(piece.getvalue())))
    return change


# Peak RSS of a command and all it waits for (ru_maxrss, KiB), written to the file argv[1]
PEAK_RSS = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[2:]); "
            "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
            "sys.exit(rc if rc >= 0 else 128 - rc)")


def test_a_checkpoint_that_claims_more_than_its_bytes_is_refused_within_a_memory_bound(tmp_path):
    """A plain checkpoint of 10 KB and a torch_dist one of 60 KB whose
    model_config claims hidden size 65536 (and whose shapes are its), each
    tensor one element of storage (plain: expanded, stride 0; torch_dist: a
    piece of one element that its index says is the whole tensor), and a plain
    one re-zipped with deflate, whose record of 1 GiB of zeros torch's reader
    would inflate: eval_tasks.py or train.py --export-from stops in one line
    naming each, with a peak RSS (the process and all it waits for) under
    1 GiB (the interpreter with torch: about 0.45) plus 4x the files' bytes.
    Nothing of the claimed model is built, no record inflated."""
    file, huge = checkpoint.PLAIN_FILE, tiny(hidden_size=65536, ffn_hidden_size=4 * 65536)
    with torch.device("meta"):
        shapes = {k: t.shape for k, t in GPT(huge).state_dict().items()}
    record = {"consumed_samples": 0, "rng": None, "config": {}, "model_config": dataclasses.asdict(huge)}
    checkpoint.write_plain_checkpoint(str(tmp_path / "plain"), {
        "model": {k: torch.full((1,), .01).expand(*s) for k, s in shapes.items()}, "optimizer": None,
        "scaler": None, "iteration": 2, **record})
    tag = str(tmp_path / "dist" / "iter_0000002")
    dcp.save({**{f"model.{k}": torch.full([1] * len(s), .01) for k, s in shapes.items()}, "iteration": 2, **record,
              "rng.stage0": torch.zeros(8, dtype=torch.uint8)}, storage_writer=dcp.FileSystemWriter(tag),
             planner=dcp.DefaultSavePlanner(**checkpoint.AS_THEY_ARE), no_dist=True)

    def claimed(metadata):
        for k, size in shapes.items():
            tensor = metadata.state_dict_metadata[f"model.{k}"]
            tensor.size = tensor.chunks[0].sizes = size
    _index_edited(tag, claimed)
    (tmp_path / "deflated" / "iter_0000002").mkdir(parents=True)
    with torch.serialization.skip_data():  # the record's bytes are left out: holes, never in memory
        torch.save({"model": {"wte.weight": torch.empty(1 << 28)}, "optimizer": None, "iteration": 2, **record},
                   tmp_path / "deflated" / "iter_0000002" / file)
    _rezipped(str(tmp_path / "deflated" / "iter_0000002" / file), zipfile.ZIP_DEFLATED, zeros=1 << 30)
    probes = {"plain": (["eval_tasks.py", "--task", "GENERATE", "--num-samples", "1", "--load"],
                        f"{file}: model.", "has strides (0,"),
              "dist": (["train.py", "--export-to", str(tmp_path / "out"), "--export-from"],
                       ".metadata gives model.", "fewer than its piece's"),
              "deflated": (["eval_tasks.py", "--task", "GENERATE", "--num-samples", "1", "--load"],
                           f"{file} holds its record ", "compressed (deflate)")}
    for name in probes:
        (tmp_path / name / checkpoint.LATEST).write_text("2")
    procs = run_together([[sys.executable, "-c", PEAK_RSS, str(tmp_path / f"{name}.peak"), sys.executable, *args,
                           str(tmp_path / name)] for name, (args, *_) in probes.items()], 240, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    for (name, (args, *says)), proc in zip(probes.items(), procs):
        held = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(tmp_path / name) for f in files)
        peak = int((tmp_path / f"{name}.peak").read_text()) << 10
        assert peak < (1 << 30) + 4 * held, (name, peak, held, proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (name, proc.stderr[-3000:])
        assert lines[0].startswith(f"{args[0]}: error: no intact checkpoint in {tmp_path / name}: "
                                   f"{tmp_path / name}/iter_0000002: ") and all(s in lines[0] for s in says), lines


@pytest.mark.quick
def test_a_resume_takes_the_adamw_state_and_settings_of_a_checkpoint_into_this_runs_own_optimizer():
    """load_full_optimizer_state: the checkpoint gives each parameter's AdamW
    state and step, and its betas, eps and weight decay, which go on (a line
    says where they are not this run's flags); this run's optimizer keeps its
    own kind (fused, never maximize, foreach, capturable or differentiable from a
    file). A state not laid out as its parameter here (shape, dtype, strides),
    or a step that counts nothing, is one line before the optimizer sees it."""
    model = tiny_model()
    optimizer = train.build_optimizer(model, config.parse_args(["--preset", "tiny"]))
    params = dict(model.named_parameters())
    square = next(n for n, p in params.items() if p.dim() == 2 and p.shape[0] == p.shape[1])

    def saved(**change):
        state = {n: {"step": torch.tensor(3.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.ones_like(p)}
                 for n, p in params.items()}
        state[square].update(change)
        return {"state": state, "param_groups": [{**g, "betas": (0.8, 0.99), **IMPLEMENTATION}
                                                 for g in optimizer.state_dict()["param_groups"]]}
    said = []
    checkpoint.load_full_optimizer_state(model, optimizer, saved(), parallel.shard_like, "ckpt/iter_0000002",
                                         said.append)
    assert said == ["the checkpoint's AdamW settings go on: --adam-beta1 0.8 (this run: 0.9), --adam-beta2 0.99 "
                    "(this run: 0.95)"]
    for group in optimizer.param_groups:
        assert group["betas"] == (0.8, 0.99) and group["fused"] and not group["foreach"]
        assert not any(group[k] for k in ("maximize", "capturable", "differentiable"))
    before = {n: p.detach().clone() for n, p in params.items()}
    for p in params.values():
        p.grad = torch.ones_like(p)
    optimizer.step()  # descent: each weight moves against its gradient
    assert all((params[n] < before[n]).all() for n in params if params[n].dim() > 1)
    p = params[square]
    for change, says in (({"exp_avg": torch.zeros(3, 3)}, r"has exp_avg \[3, 3\] float32"),
                         ({"exp_avg": torch.zeros(p.shape).t()}, r"with strides \[1, \d+\], not laid out"),
                         ({"exp_avg_sq": torch.zeros(1).expand(*p.shape)}, r"with strides \[0, 0\]"),
                         ({"exp_avg": torch.zeros(p.shape, dtype=torch.float64)}, "float64"),
                         ({"step": torch.tensor(float("nan"))}, "has step"), ({"step": torch.zeros(9)}, "has step"),
                         ({"max_exp_avg_sq": torch.zeros(p.shape)}, "not AdamW's")):
        with pytest.raises(launch.Damaged, match=rf"^checkpoint ckpt/iter_0000002 is damaged: the optimizer state "
                                                 rf"of {re.escape(square)} .*{says}"):
            checkpoint.load_full_optimizer_state(model, optimizer, saved(**change), parallel.shard_like,
                                                 "ckpt/iter_0000002", said.append)


@pytest.mark.quick
def test_a_torch_dist_index_whose_pieces_overlap_or_share_bytes_is_damage(dist_saves):
    """launch.dist_index_problem, beyond what the command-line tests above plant:
    pieces that hold as many elements as their tensor but overlap (and so leave
    a hole), two pieces on the same bytes of a file, bytes transformed (DCP's
    compression extensions, which no save here writes)."""
    tag = os.path.join(dist_saves, "iter_0000004")
    assert launch.dist_index_problem(tag, launch.read_dist_index(tag)) is None

    def overlapping(md):
        wte = md.state_dict_metadata["model.wte.weight"]
        (rows, cols), chunk = wte.size, wte.chunks[0]
        wte.chunks = [dataclasses.replace(chunk, sizes=torch.Size([rows // 2 + 1, cols])),
                      dataclasses.replace(chunk, offsets=torch.Size([rows // 2, 0]),
                                          sizes=torch.Size([rows // 2 - 1, cols]))]

    def shared(md):
        model = _piece_of(md, "model.wte.weight")
        _piece_of(md, "optimizer.wte.weight.exp_avg").__dict__.update(offset=model.offset, length=model.length)
    for edit, says in ((overlapping, "model.wte.weight of size .* has pieces that overlap"),
                       (shared, r"places model.wte.weight and optimizer.wte.weight.exp_avg on the same bytes of "
                                r"__0_0.distcp"),
                       (lambda md: _piece_of(md, "model.wte.weight").__dict__.update(transform_descriptors=["zstd"]),
                        r"gives model.wte.weight's bytes transformed \(\['zstd'\]\)")):
        metadata = launch.read_dist_index(tag)
        edit(metadata)
        assert re.search(says, launch.dist_index_problem(tag, metadata) or ""), says


@pytest.mark.parametrize("flags", [["--ckpt-format", "torch"], ["--ckpt-format", "torch_dist", "--async-save"]])
def test_a_full_disk_stops_the_save_in_one_line_and_keeps_the_previous_checkpoint(
        corpus, tmp_path, monkeypatch, capsys, flags):
    """With --async-save the write fails in the background; the end of the
    run, which waits for it, stops with the same line."""
    ckpt = str(tmp_path / "ckpt")
    real_save, real_dcp_save = torch.save, dcp.save

    def full(path):
        if "iter_0000004" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def save(obj, path, *a, **k):
        full(path)
        return real_save(obj, path, *a, **k)

    def dcp_save(state, storage_writer, **k):
        full(storage_writer.path)
        return real_dcp_save(state, storage_writer=storage_writer, **k)
    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(dcp, "save", dcp_save)
    with pytest.raises(SystemExit) as stop:
        train.main([*TINY, "--data-path", corpus, "--train-iters", "4", "--save", ckpt, "--save-interval", "2",
                    "--eval-interval", "0", *flags])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(f"train.py: error: saving checkpoint 4 to {ckpt} failed on "
                                                   f"rank 0, the disk is full (OSError: [Errno 28] No space left"), error
    assert "the previous checkpoint and its pointer are intact" in error[0]
    assert open(os.path.join(ckpt, checkpoint.LATEST)).read() == "2"
    assert checkpoint.verified_checkpoint(ckpt, print).iteration == 2


@pytest.fixture
def small_disk(tmp_path):
    """A real 8 MiB filesystem (a tmpfs: the kernel refuses a write past it
    with ENOSPC) -> a path to it. It is mounted in a mount namespace of its
    own, held by a child (unshare; as a user, in a user namespace too: no
    root needed), and reached through /proc/CHILD/root, by this process and
    by the train.py it starts. Nothing is ever left mounted: the namespace
    ends with the child, which ends when its stdin closes, at teardown or
    when this process dies. Skips where no namespace can mount one."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    script = f"mount -t tmpfs -o size=8m none {mount_point} && echo mounted && exec cat >/dev/null"
    try:
        holder = subprocess.Popen([*unshare, "sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
    except FileNotFoundError:
        pytest.skip("no unshare (util-linux) here: the full-disk test mounts a small tmpfs with it")
    with holder:  # at the end: closes its stdin and waits for it
        if holder.stdout.readline().strip() != "mounted":
            pytest.skip(f"this machine lets no process mount a small tmpfs ({' '.join(unshare)}: "
                        f"{holder.stderr.read().strip()}): the full-disk test needs one")
        yield f"/proc/{holder.pid}/root{mount_point}"


def fill(disk: str, leave: int) -> str:
    """Fill the filesystem at `disk` but for `leave` bytes. -> the filler's path"""
    filler = os.path.join(disk, "filler")
    stats = os.statvfs(disk)
    with open(filler, "wb") as f:
        f.write(bytes(stats.f_bavail * stats.f_frsize - leave))
    return filler


def files_and_hashes(directory: str) -> dict[str, str]:
    """Every file under directory but an unfinished save's (*.tmp): its sha256."""
    return {os.path.relpath(os.path.join(root, name), directory): sha256_of(os.path.join(root, name))
            for root, _, names in os.walk(directory) if not root.endswith(".tmp") for name in names}


def test_a_failed_save_is_judged_full_before_its_space_is_freed(small_disk, monkeypatch):
    """torch.save's zip writer says a full disk only as a RuntimeError, so the
    filesystem is asked; but the failed save frees its iter_N.tmp at once,
    after which the disk is no longer full. The verdict comes first: here a
    save that wrote the disk full (its last 256 KiB), judged against a
    threshold of 128 KiB, is reported as ENOSPC, though the disk has 256 KiB
    free again once the save's leftover is gone."""
    fill(small_disk, leave=256 << 10)
    monkeypatch.setattr(checkpoint, "FULL_BELOW", 128 << 10)
    tmp = os.path.join(small_disk, "iter_0000004.tmp")
    os.makedirs(tmp)
    with pytest.raises(OSError) as failed, checkpoint.freed_on_failure(tmp):
        with open(os.path.join(tmp, "model_optim_rng.pt"), "wb", buffering=0) as f:
            with contextlib.suppress(OSError):  # ENOSPC, which the zip writer says without its errno:
                while True:
                    f.write(bytes(1 << 16))
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")
    assert failed.value.errno == errno.ENOSPC and "unexpected pos" in str(failed.value)
    assert not os.path.exists(tmp) and shutil.disk_usage(small_disk).free >= 200 << 10


@pytest.mark.parametrize("flags", [["--ckpt-format", "torch"], ["--ckpt-format", "torch_dist"], ["--deepspeed"],
                                   ["--ckpt-format", "torch_dist", "--async-save"]],
                         ids=["torch", "torch_dist", "deepspeed", "async-save"])
def test_a_really_full_disk_stops_the_save_in_one_line_and_keeps_the_previous_checkpoint(
        ids_corpus, small_disk, flags):
    """The user saves to a disk that the first checkpoint leaves all but
    full (a real 8 MiB tmpfs, filled after it but for 256 KiB). The next
    save runs out of space inside torch.save's zip writer (DCP's and
    DeepSpeed's too), which says so only as a RuntimeError without an errno
    ("unexpected pos ...", "basic_ios::clear"). The run stops with the one
    line that says the disk is full, status 2, no traceback (with
    --async-save at the end of the run, which waits for the write); the
    previous checkpoint and its pointer are unchanged, byte for byte. Once
    space is freed, the same command resumes and saves: the failed save's
    leftover is in no one's way, and gone."""
    ckpt = os.path.join(small_disk, "ckpt")
    run = [*TINY, *IDS, "--data-path", ids_corpus, "--eval-interval", "0", "--save", ckpt, "--save-interval", "2",
           *flags]
    train_on_ranks([*run, "--train-iters", "2"], nproc=1)
    before = files_and_hashes(ckpt)
    filler = fill(small_disk, leave=256 << 10)
    proc = run_train([*run, "--train-iters", "4", "--load", ckpt], check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"train.py: error: saving checkpoint 4 to {ckpt} failed on rank 0, the disk is "
                                  f"full ("), proc.stderr
    assert proc.stderr.strip().endswith("the previous checkpoint and its pointer are intact: free space, then "
                                        "resume with --load"), proc.stderr
    assert not glob.glob(os.path.join(ckpt, "*.tmp"))  # the failed save freed its space at once
    assert shutil.disk_usage(ckpt).free >= 200 << 10
    assert files_and_hashes(ckpt) == before
    os.remove(filler)
    train_on_ranks([*run, "--train-iters", "4", "--load", ckpt], nproc=1)
    with open(os.path.join(ckpt, checkpoint.LATEST)) as pointer:
        assert pointer.read() == "4"
    assert not glob.glob(os.path.join(ckpt, "*.tmp"))
    assert checkpoint.verified_checkpoint(ckpt, print).iteration == 4


# --async-save: the loop waits while the state is copied to host memory; the
# write, digests and publish run in the background


def test_an_async_save_is_written_while_training_goes_on_and_waited_for_by_the_next_save_and_the_end(
        corpus, dist_saves, tmp_path, monkeypatch):
    """dist_saves' run with --async-save. The write of checkpoint 2 is held
    until the loop has finished step 3 (which never comes if the save blocks
    the loop), yet it holds iteration 2's tensors bit for bit: the staged
    copy is independent of the parameters and optimizer states that step 3
    updated in place. The save at 4 stages only once 2 is published (its
    write is slowed by a second, so a save that did not wait would see no
    pointer), and train.main returns with 4 published (slowed alike). The
    host copy is made once, in the background after step 1: both saves copy
    into its memory (none is allocated while the loop waits)."""
    ckpt, stepped, events, host, reused = str(tmp_path / "ckpt"), threading.Event(), [], set(), []
    real_step, real_save, real_stage = train.train_step, dcp.save, DefaultStager.stage
    pointer = os.path.join(ckpt, checkpoint.LATEST)
    latest = lambda: open(pointer).read() if os.path.exists(pointer) else None

    def step(*a):
        events.append("step")
        result = real_step(*a)
        if events.count("step") == 3:
            stepped.set()
        return result

    def stage(self, state):
        if "iteration" not in state:  # the host copy, of the parameters and AdamW's states
            events.append(f"host copy after step {events.count('step')}, on {threading.current_thread().name}")
            host.update(t.data_ptr() for t in real_stage(self, state).values())
            return None
        events.append(f"stage {state['iteration']}, latest {latest()}")
        staged = real_stage(self, state)
        reused.append(all(staged[k].data_ptr() in host for k, v in state.items()
                          if k.startswith(("model.", "optimizer.")) and torch.is_tensor(v)))
        return staged

    def save(state, **k):  # the background write
        if state["iteration"] == 2:
            assert stepped.wait(60), "the loop waited for the write"
        time.sleep(1)
        return real_save(state, **k)
    monkeypatch.setattr(train, "train_step", step)
    monkeypatch.setattr(DefaultStager, "stage", stage)
    monkeypatch.setattr(dcp, "save", save)
    train.main([*TINY, "--data-path", corpus, "--train-iters", "4", "--save", ckpt, "--save-interval", "2",
                "--eval-interval", "0", "--ckpt-format", "torch_dist", "--async-save"])
    assert latest() == "4"
    assert [e for e in events if not e.startswith("step")] == [
        "host copy after step 1, on async-save_0", "stage 2, latest None", "stage 4, latest 2"]
    assert reused == [True, True]
    for name in ("iter_0000002", "iter_0000004"):
        want, got = dist_tensors(os.path.join(dist_saves, name)), dist_tensors(os.path.join(ckpt, name))
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), name


def test_the_async_host_copy_is_made_only_for_a_run_that_saves_and_its_failure_loses_nothing(
        corpus, tmp_path, monkeypatch):
    """--async-save without --save makes no host copy (it would only hold
    memory). With --save, a head-start copy that fails (say, out of host
    memory) is only a lost head start: the save makes its own copy, and the
    checkpoint is written and published."""
    real_stage, staged = DefaultStager.stage, []

    def stage(self, state):
        staged.append(state.get("iteration", "head start"))
        if "iteration" not in state:
            raise MemoryError("no host memory for the head start")
        return real_stage(self, state)
    monkeypatch.setattr(DefaultStager, "stage", stage)
    run = [*TINY, "--data-path", corpus, "--train-iters", "2", "--eval-interval", "0",
           "--ckpt-format", "torch_dist", "--async-save"]
    train.main(run)
    assert staged == []
    ckpt = tmp_path / "ckpt"
    train.main([*run, "--save", str(ckpt)])
    assert staged == ["head start", 2]
    assert (ckpt / checkpoint.LATEST).read_text() == "2"


def test_a_run_resumed_from_an_async_save_repeats_the_uninterrupted_run_bit_for_bit(corpus, tmp_path):
    """2 ranks at TP=2 (TP shards staged, then described as ShardedTensors of
    the copy; the checkpoint group used by DCP and the publish), saving at 2,
    4 and 6 in the background (--async-save alone: torch_dist is the default);
    resumed from 2, the run repeats the uninterrupted one's losses and
    gradient norms exactly. PyTorch's dcp_to_torch converts the checkpoint to
    the weights our --export-from gives."""
    common = [*TINY, "--data-path", corpus, "--train-iters", "6", "--eval-interval", "0",
              "--tensor-model-parallel-size", "2"]  # the default format, torch_dist
    ckpt, full, resumed = tmp_path / "ckpt", str(tmp_path / "full.jsonl"), str(tmp_path / "resumed.jsonl")
    train_on_ranks([*common, "--save", str(ckpt), "--save-interval", "2", "--async-save", "--metrics-file", full],
                   nproc=2)
    assert (ckpt / checkpoint.LATEST).read_text() == "6"
    (ckpt / checkpoint.LATEST).write_text("2")
    train_on_ranks([*common, "--load", str(ckpt), "--metrics-file", resumed], nproc=2)
    curve = lambda path: [(m["iteration"], m["loss"], m["grad_norm"]) for m in read_metrics(path)]
    assert curve(resumed) == curve(full)[2:]  # exact, not close
    # PyTorch's converter reads the TP shards whole: the tensors of our export
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(ckpt / "iter_0000002"), str(tmp_path / "converted.pt"))
    assert_export_is_converted(str(ckpt), torch.load(tmp_path / "converted.pt"), tmp_path / "export")


def _train_killed_after_writing_checkpoint_4(args):
    """conftest's rank main, SIGKILLed (no handler runs) in its background
    write of checkpoint 4: its files are written, not yet hashed or published."""
    real_save = dcp.save

    def save(state, **k):
        real_save(state, **k)
        if state["iteration"] == 4:
            os.kill(os.getpid(), signal.SIGKILL)
    dcp.save = save
    _train_main(args)


def test_a_kill_during_an_async_write_leaves_the_previous_checkpoint_and_its_pointer(corpus, tmp_path, capsys):
    """iter_0000004.tmp holds every file DCP writes, .metadata included, but
    was never published: `latest` still names 2, which loads, and the resumed
    run removes the leftover when it publishes its own save."""
    ckpt = str(tmp_path / "ckpt")
    args = [*TINY, "--data-path", corpus, "--train-iters", "6", "--save", ckpt, "--save-interval", "2",
            "--eval-interval", "0", "--ckpt-format", "torch_dist", "--async-save"]
    with pytest.raises(AssertionError, match="failed on its ranks"):
        run_on_ranks(_train_killed_after_writing_checkpoint_4, args, world_size=1)
    assert open(os.path.join(ckpt, checkpoint.LATEST)).read() == "2"
    assert os.path.exists(os.path.join(ckpt, "iter_0000004.tmp", checkpoint.DIST_METADATA))
    train.main([*args, "--load", ckpt, "--train-iters", "3"])
    assert f"loaded checkpoint {os.path.join(ckpt, 'iter_0000002')} (iteration 2)" in capsys.readouterr().out
    assert open(os.path.join(ckpt, checkpoint.LATEST)).read() == "3"
    assert not glob.glob(os.path.join(ckpt, "*.tmp"))


def test_a_directory_where_both_pointers_disagree_reads_the_newer_checkpoint(tmp_path):
    """A directory written before both kinds wrote Megatron's pointer (or a
    crash between a DeepSpeed save's two pointer writes): Megatron's pointer
    names a plain iteration 2, DeepSpeed's names iteration 4. The newer
    one is read, for resume, export and evaluation alike (latest_checkpoint)."""
    save = str(tmp_path)
    checkpoint.write_plain_checkpoint(save, {"iteration": 2})
    tag = os.path.join(save, "iter_0000004")
    os.makedirs(tag)
    torch.save({}, os.path.join(tag, "mp_rank_00_model_states.pt"))
    with open(os.path.join(tag, checkpoint.DS_META), "w") as f:
        json.dump({"iteration": 4, "consumed_samples": 32, "zero_stage": 1, "data_parallel_size": 1,
                   "tensor_model_parallel_size": 1, "model_config": {}, "tensor_parallel_layout": {}}, f)
    with open(os.path.join(save, checkpoint.DS_LATEST), "w") as f:
        f.write("iter_0000004")
    found = checkpoint.latest_checkpoint(save)
    assert (found.kind, found.iteration) == ("deepspeed", 4)
    with open(os.path.join(save, checkpoint.LATEST), "w") as f:
        f.write("6")  # Megatron's pointer names a checkpoint that is gone: said, then the newest intact one
    said = []
    found = checkpoint.verified_checkpoint(save, said.append)
    assert (found.kind, found.iteration) == ("deepspeed", 4)
    assert said == [f"checkpoint {save}/iter_0000006 cannot be loaded: it holds no checkpoint "
                    f"(none of model_optim_rng.pt, .metadata, trainer_state.json)",
                    f"falling back to {save}/iter_0000004 (iteration 4), the newest intact checkpoint",
                    f"{save}/iter_0000004 has no checksums.sha256 (saved before checksums, or copied without "
                    f"them): its files are not verified, only checked for being cut short"]


def test_deepspeeds_pointer_and_trainer_state_are_held_to_what_megatrons_pointer_is(corpus, two_saves, tmp_path,
                                                                                    capsys):
    """A directory of plain checkpoints 2 and 4 (4 copied without its
    checksums.sha256), then DeepSpeed checkpoints, each with checksums made
    anew as anyone can: 5 whose trainer_state.json is cut short, 6 whose
    trainer_state.json says iteration 7, 7 with a ZeRO shard its checksums do
    not list (another save's, at another data-parallel size); DeepSpeed's
    `latest` names iteration 9, which is gone. --load and --export-from name
    each in one line, as Megatron's pointer naming a missing iteration is, and
    read iteration 4, saying that it has no checksums."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(two_saves, ckpt)
    os.remove(os.path.join(ckpt, "iter_0000004", checkpoint.DIGESTS))
    shard = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
    for iteration, recorded in ((5, 5), (6, 7), (7, 7)):
        tag = os.path.join(ckpt, f"iter_{iteration:07d}")
        _deepspeed_checkpoint(tag, _deepspeed_meta(two_saves, recorded))
    with open(os.path.join(ckpt, "iter_0000005", checkpoint.DS_META), "w") as f:
        f.write('{"iteration": 5, "consume')
    _rewrite_digests(os.path.join(ckpt, "iter_0000005"))
    torch.save({}, os.path.join(ckpt, "iter_0000007", shard.format(1)))
    with open(os.path.join(ckpt, checkpoint.DS_LATEST), "w") as f:
        f.write("iter_0000009")
    problems = [f"{ckpt}/iter_0000009 cannot be loaded: it holds no checkpoint",
                f"{ckpt}/iter_0000007 cannot be loaded: {shard.format(1)} is not listed in checksums.sha256",
                f"{ckpt}/iter_0000006 cannot be loaded: its trainer_state.json records iteration 7, not 6",
                f"{ckpt}/iter_0000005 cannot be loaded: {ckpt}/iter_0000005/trainer_state.json: not JSON"]
    said = [f"falling back to {ckpt}/iter_0000004 (iteration 4), the newest intact checkpoint",
            f"{ckpt}/iter_0000004 has no checksums.sha256 (saved before checksums, or copied without them)"]
    metrics = tmp_path / "m.jsonl"
    for args in ([*TINY, "--data-path", corpus, "--train-iters", "5", "--load", ckpt, "--eval-interval", "0",
                  "--metrics-file", str(metrics)],
                 ["--export-from", ckpt, "--export-to", str(tmp_path / "exported")]):
        train.main(args)
        out = capsys.readouterr().out
        for line in problems + said:
            assert line in out, out
    assert [m["iteration"] for m in read_metrics(metrics)] == [5]


def test_a_checkpoint_under_another_iterations_name_is_not_resumed_as_that_iteration(
        corpus, two_saves, tmp_path, capsys):
    """iter_0000004 copied to iter_0000006, its checksums still right (they
    hold no names of directories): --load chose it as iteration 6, and would
    resume iteration 4's state under that number. One line says so instead."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(two_saves, ckpt)
    shutil.copytree(os.path.join(ckpt, "iter_0000004"), os.path.join(ckpt, "iter_0000006"))
    with open(os.path.join(ckpt, checkpoint.LATEST), "w") as f:
        f.write("6")
    with pytest.raises(SystemExit) as stop:
        train.main([*TINY, "--data-path", corpus, "--train-iters", "8", "--load", ckpt, "--eval-interval", "0"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"train.py: error: checkpoint {ckpt}/iter_0000006 holds the state of iteration 4, not of 6: renamed or "
        f"damaged; give it its own name, or remove it to load the one before"]

def test_a_directory_without_a_pointer_loads_its_newest_checkpoint(corpus, two_saves, tmp_path, capsys):
    """Checkpoints copied without latest_checkpointed_iteration.txt (or a
    first save cut short before it): --load takes the newest iter_N there,
    never a start from scratch that would save over them."""
    ckpt, metrics = str(tmp_path / "ckpt"), tmp_path / "m.jsonl"
    shutil.copytree(two_saves, ckpt)
    os.remove(os.path.join(ckpt, checkpoint.LATEST))
    train.main([*TINY, "--data-path", corpus, "--train-iters", "5", "--load", ckpt, "--eval-interval", "0",
                "--metrics-file", str(metrics)])
    assert f"loaded checkpoint {ckpt}/iter_0000004 (iteration 4)" in capsys.readouterr().out
    assert [m["iteration"] for m in read_metrics(metrics)] == [5]


def test_a_resume_under_another_learning_rate_schedule_says_so(corpus, two_saves, tmp_path, capsys):
    """The lr would jump without a word: a resume with another --lr, or a
    longer --train-iters (which ends the decay later), says what changed; the
    same flags say nothing."""
    common = [*TINY, "--data-path", corpus, "--load", two_saves, "--eval-interval", "0"]
    train.main([*common, "--train-iters", "4"])
    assert "learning-rate schedule" not in capsys.readouterr().out
    train.main([*common, "--train-iters", "5", "--lr", "1e-2"])
    assert ("the learning-rate schedule is not the checkpoint's, this run's goes on: --lr 0.01 (checkpoint: "
            "0.003), decay end 5 (checkpoint: 4)") in capsys.readouterr().out


def test_megatron_flags_choose_the_checkpoints_schedule_or_this_runs(corpus, two_saves, tmp_path, capsys):
    """Megatron's --use-checkpoint-opt_param-scheduler (Megatron-DeepSpeed:
    --use-checkpoint-lr-scheduler) resumes on the checkpoint's schedule
    whatever this run's flags say: the same learning rates and losses as a
    resume with the checkpoint's own flags. --override-opt_param-scheduler
    follows this run's flags without the line that says so."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(two_saves, ckpt)
    with open(os.path.join(ckpt, checkpoint.LATEST), "w") as f:
        f.write("2")  # resume mid-schedule, at iteration 2 of 4
    common = [*TINY, "--data-path", corpus, "--train-iters", "4", "--load", ckpt, "--eval-interval", "0"]
    other = ["--lr", "1e-2", "--min-lr", "1e-3", "--lr-decay-style", "linear", "--lr-warmup-iters", "0"]
    runs = {}
    for name, flags in [("same flags", []), ("checkpoint's", [*other, "--use-checkpoint-lr-scheduler"]),
                        ("this run's", [*other, "--override-opt_param-scheduler"])]:
        train.main([*common, *flags, "--metrics-file", str(tmp_path / f"{name}.jsonl")])
        runs[name] = read_metrics(tmp_path / f"{name}.jsonl"), capsys.readouterr().out
    same, (checkpoints, said), (this_runs, quiet) = runs["same flags"][0], runs["checkpoint's"], runs["this run's"]
    assert [(m["lr"], m["loss"]) for m in checkpoints] == [(m["lr"], m["loss"]) for m in same]
    assert ("the checkpoint's learning-rate schedule goes on: --lr 0.003 (this run: 0.01), --min-lr 0.0003 "
            "(this run: 0.001), decay style cosine (this run: linear), warmup end 2 (this run: 0)") in said
    assert [m["lr"] for m in this_runs] == pytest.approx([1e-2 - (1e-2 - 1e-3) * done / 4 for done in (2, 3)])
    assert "learning-rate schedule" not in quiet
    warmup = TINY.index("--lr-warmup-iters")  # a flag of schedules in iterations
    with pytest.raises(SystemExit) as stop:  # a schedule in samples cannot follow one in iterations
        train.main([*TINY[:warmup], *TINY[warmup + 2:], "--data-path", corpus, "--train-samples", "32",
                    "--load", ckpt, "--use-checkpoint-opt_param-scheduler"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"train.py: error: --use-checkpoint-opt_param-scheduler: {ckpt}/iter_0000002's schedule counts "
        f"iterations, this run's samples: give --train-iters, as the checkpoint's run did"]


def test_a_checkpoint_older_than_a_schedule_flag_still_has_its_schedule_compared(capsys):
    """A checkpoint's recorded flags lack those added since (here the token
    counts of a sample-based run): they take their defaults, so its schedule
    is still read, compared and, when asked, followed."""
    import config
    cfg = config.parse_args(["--preset", "tiny", "--train-samples", "64", "--lr", "1e-3"])
    saved = {k: v for k, v in dataclasses.asdict(cfg).items() if not k.endswith("_tokens")}
    saved["lr"] = 2e-3
    start = checkpoint.Start(2, 16, "ckpt", saved)
    assert train_ops.schedule_to_follow(cfg, start) == train_ops.lr_schedule(cfg)
    assert capsys.readouterr().out.splitlines() == [
        "the learning-rate schedule is not the checkpoint's, this run's goes on: --lr 0.001 (checkpoint: 0.002)"]
    follow = dataclasses.replace(cfg, use_checkpoint_opt_param_scheduler=True)
    assert train_ops.schedule_to_follow(follow, start)[0] == 2e-3


@pytest.mark.quick
@pytest.mark.parametrize("given", ["a pointer to 'release'", "an empty pointer", "a pointer of binary bytes",
                                   "a pointer of a digit that is not ASCII", "DeepSpeed's pointer to ../outside",
                                   "DeepSpeed's pointer to an absolute path", "a pointer that is a link",
                                   "DeepSpeed's pointer that is a link", "an iteration's directory",
                                   "a Hugging Face directory", "a file"])
def test_a_load_directory_that_is_not_a_save_directory_is_one_line(corpus, two_saves, tmp_path, capsys, given):
    """Megatron's "release" pointer, a damaged one (empty, binary, a `²`,
    which str.isdigit() takes and int() does not), DeepSpeed's naming a
    directory outside the save directory, either pointer a link to a file
    outside it (never read: its bytes are not echoed), a checkpoint's own
    iter_N directory, a transformers model, a file: one line that says what to give."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(two_saves, ckpt)
    pointer, load = os.path.join(ckpt, checkpoint.LATEST), ckpt
    if given.endswith("a link"):
        secret = tmp_path / "secret.txt"
        secret.write_text("4 the start of a file outside the save directory")
        pointer = os.path.join(ckpt, checkpoint.DS_LATEST if given.startswith("DeepSpeed") else checkpoint.LATEST)
        with contextlib.suppress(FileNotFoundError):
            os.remove(pointer)
        os.symlink(secret, pointer)
        message = (f"{ckpt}: its pointer {os.path.basename(pointer)} is a symbolic link (to {secret}), not a "
                   f"file: replace it with a file that names the checkpoint to load, or delete it to load the "
                   f"newest iter_N there")
    elif given == "a file":
        load = pointer
        message = (f"{load} is a file, not a checkpoint directory: give the directory that holds "
                   f"{checkpoint.LATEST} (the one train.py's --save wrote)")
    elif given.startswith("DeepSpeed's"):
        tag = "../outside/iter_0000009" if "outside" in given else os.path.join(str(tmp_path), "iter_0000009")
        shutil.copytree(os.path.join(ckpt, "iter_0000004"), os.path.join(ckpt, tag))  # a checkpoint there
        pointer = os.path.join(ckpt, checkpoint.DS_LATEST)
        with open(pointer, "w") as f:
            f.write(tag)
        message = (f"{pointer} holds {tag[:40]!r}, not the name of a checkpoint in {ckpt} (iter_NNNNNNN): write "
                   f"the one to load into it, or delete it to load the newest iter_N there")
    elif "pointer" in given:
        written = {"a pointer to 'release'": b"release\n", "an empty pointer": b"",
                   "a pointer of binary bytes": b"\x80\xff",
                   "a pointer of a digit that is not ASCII": "²".encode()}
        with open(pointer, "wb") as f:
            f.write(written[given])
        shown = {"an empty pointer": "", "a pointer of binary bytes": "\ufffd\ufffd",  # as text: U+FFFD
                 "a pointer of a digit that is not ASCII": "²"}
        message = (f"{pointer} names Megatron's release/ directory, a layout train.py does not read (one file "
                   f"per model-parallel rank, its names)") if "release" in given else \
            (f"{pointer} holds {shown[given]!r}, not an iteration number: write the iteration to load into it, "
             f"or delete it to load the newest iter_N there")
    elif given == "an iteration's directory":
        load = os.path.join(ckpt, "iter_0000002")
        message = (f"{load} is one checkpoint's own directory: give the directory above it, {ckpt} "
                   f"(the one --save wrote; its {checkpoint.LATEST} names the iteration that loads)")
    else:
        load = str(tmp_path / "hf")
        random_hf_model().save_pretrained(load)
        capsys.readouterr()  # transformers' own warnings
        message = (f"{load} is a Hugging Face model directory, not a train.py checkpoint: eval_tasks.py reads it "
                   f"with --hf, and train.py --export-from {load} --export-to DIR makes one that --load DIR "
                   f"--finetune trains from")
    with pytest.raises(SystemExit) as stop:
        train.main([*TINY, "--data-path", corpus, "--train-iters", "5", "--load", load])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"train.py: error: {message}"]


@pytest.mark.quick
def test_a_load_directory_without_a_checkpoint_starts_from_scratch_and_says_so(corpus, tmp_path, capsys):
    """Megatron's way: --load of a directory with no checkpoint yet (the
    first run of a job that passes --save and --load the same) trains from
    scratch, and the log says so."""
    train.main([*TINY, "--data-path", corpus, "--train-iters", "1", "--eval-interval", "0",
                "--load", str(tmp_path)])
    assert f"no checkpoint in {tmp_path}; starting from scratch" in capsys.readouterr().out


# -----------------------------------------------------------------------------
# Export: --export-from a checkpoint --export-format hf


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_export_plain_checkpoint_to_hugging_face(corpus, tmp_path, preset):
    """--export-from a train.py checkpoint --export-format hf: a GPT-2 (or,
    for the Llama-shaped preset, a Llama) directory that loads back with the
    trained weights."""
    ckpt, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    train.main([*TINY, "--preset", preset, "--data-path", corpus, "--train-iters", "2", "--save", ckpt])
    subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--export-from", ckpt,
                    "--export-to", hf, "--export-format", "hf"], check=True, cwd=ROOT)
    weights, _ = checkpoint.read_weights(checkpoint.latest_checkpoint(ckpt))  # the default format's
    exported = from_hf(hf)
    with open(os.path.join(hf, "config.json")) as f:
        assert json.load(f)["model_type"] == {"tiny": "gpt2", "llama-tiny": "llama"}[preset]
    for name, value in exported.state_dict().items():
        torch.testing.assert_close(value[:50257], weights[name][:50257], rtol=0, atol=0)
    # The directory is whole for transformers' own tools: its tokenizer reads
    # text as prepare.py did, and a text-generation pipeline runs from it alone.
    import transformers
    prompt = "To be, or not to be: that is the question."
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    assert tokenizer(prompt)["input_ids"] == load_tokenizer().encode_ordinary(prompt)
    generated = transformers.pipeline("text-generation", model=hf)(prompt, max_new_tokens=4, do_sample=False)
    assert generated[0]["generated_text"].startswith(prompt)
    # Hugging Face in and out again: the tokenizer comes along, directly or through a plain export
    # (train.py's main in this process: the command line's own run is the one above)
    resaved, plain, again = str(tmp_path / "resaved"), str(tmp_path / "plain"), str(tmp_path / "again")
    transformers.AutoModelForCausalLM.from_pretrained(hf).save_pretrained(resaved)
    tokenizer.save_pretrained(resaved)  # its own files: tokenizer.json among them
    for source, out in ((resaved, again), (resaved, plain), (plain, again + "2")):
        train.main(["--export-from", source, "--export-to", out, "--export-format", "plain" if out == plain else "hf"])
    for out in (again, again + "2"):
        assert transformers.AutoTokenizer.from_pretrained(out)(prompt)["input_ids"] == tokenizer(prompt)["input_ids"]
    assert os.path.isfile(os.path.join(again, "tokenizer.json"))  # the source's own, copied


def tree_digests(directory) -> dict:
    """Every file under directory -> its sha256."""
    return {os.path.relpath(os.path.join(root, name), directory): sha256_of(os.path.join(root, name))
            for root, _, names in os.walk(directory) for name in names}


def test_an_export_never_writes_into_a_directory_that_holds_checkpoints(two_saves, tmp_path):
    """A typo that names a save directory as --export-to (its own, or
    another run's newer one), in either format, or a file: refused in one
    line that names what is there, and the checkpoints, pointer included,
    are the same bytes after. (Written over, the newest checkpoint would
    lose its optimizer states, or the pointer go back to an older iteration,
    or config.json beside them make --load refuse the directory.)"""
    run, old = str(tmp_path / "run"), str(tmp_path / "old")
    shutil.copytree(two_saves, run)
    shutil.copytree(two_saves, old)
    shutil.rmtree(os.path.join(old, "iter_0000004"))
    with open(os.path.join(old, checkpoint.LATEST), "w") as f:
        f.write("2")
    (tmp_path / "a-file").write_text("")
    before = tree_digests(run)
    refusal = "an export writes only into a new or empty directory, or over an earlier --export-format {} export"
    checkpoints = f"a training run's checkpoints (iter_0000002, iter_0000004, {checkpoint.LATEST})"
    for source, out, fmt, held in ((run, run, "plain", checkpoints), (run, run, "hf", checkpoints),
                                   (old, run, "plain", checkpoints), (run, str(tmp_path / "a-file"), "plain", None)):
        proc = run_bounded([sys.executable, "train.py", "--export-from", source, "--export-to", out,
                            "--export-format", fmt], 120, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        message = (f"--export-to {out} holds {held}: {refusal.format(fmt)}; give another directory" if held else
                   f"--export-to {out} is a file: give a directory (one that is not there yet is made)")
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"train.py: error: {message}"], \
            proc.stderr[-3000:]
        assert tree_digests(run) == before
    # What an export may write over: an earlier export of its own format, and only that
    plain, hf = str(tmp_path / "plain"), str(tmp_path / "hf")
    for out, fmt in ((plain, "plain"), (plain, "plain"), (hf, "hf"), (hf, "hf")):
        checkpoint.export_weights(run, out, fmt)
        os.makedirs(os.path.join(out, "iter_0000004.tmp"), exist_ok=True)  # as an export killed midway leaves
    assert sorted(os.listdir(plain)) == ["iter_0000004", "iter_0000004.tmp", checkpoint.LATEST]
    checkpoint.export_weights(run, plain, "plain")  # its rerun writes over it, and the leftover goes
    assert sorted(os.listdir(plain)) == ["iter_0000004", checkpoint.LATEST]
    for out, fmt, held in ((plain, "hf", f"a plain export (iter_0000004, {checkpoint.LATEST})"),
                           (hf, "plain", f"a Hugging Face model ({HF_CONFIG})")):
        with pytest.raises(UsageError, match=re.escape(f"--export-to {out} holds {held}: ")):
            checkpoint.export_weights(run, out, fmt)


# -----------------------------------------------------------------------------
# Hugging Face GPT-2 in and out (huggingface.from_hf, to_hf and their state dict maps)


def random_hf_model(tied: bool = True):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=tied,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # randomize everything, biases and LayerNorms included
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


@pytest.mark.quick
@pytest.mark.parametrize("safe_serialization, tied", [(True, True), (False, True), (True, False)])
def test_from_hf_gives_same_logits_as_transformers(tmp_path, safe_serialization, tied):
    theirs = random_hf_model(tied)
    theirs.save_pretrained(tmp_path, safe_serialization=safe_serialization)
    ours = from_hf(str(tmp_path)).eval()
    assert ours.config.vocab_size == 100 and ours.config.padded_vocab_size == 128
    x = tokens(T=32)
    with torch.no_grad():
        want = theirs(x).logits
        got = ours(x)
    torch.testing.assert_close(got[..., :100], want, atol=1e-5, rtol=1e-5)
    assert torch.all(got[..., 100:] == 0)  # zero padding rows -> zero logits


@pytest.mark.quick
@pytest.mark.parametrize("untie", [False, True])
def test_to_hf_is_loaded_by_transformers_with_same_logits(tmp_path, untie):
    """GPT-2's layout, its head tied to the embedding or (an option of
    transformers' GPT-2 too) a head of its own."""
    transformers = pytest.importorskip("transformers")
    ours = tiny_model(max_position_embeddings=32, untie_embeddings_and_output_weights=untie).eval()
    with torch.no_grad():  # non-trivial LayerNorms and biases
        for name, p in ours.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.normal_(0.0, 0.2)
    to_hf(ours, str(tmp_path))
    theirs = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    x = tokens(T=32)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, ours(x)[..., :100], atol=1e-5, rtol=1e-5)
    # And back again: export -> import is lossless, except that the padding
    # rows (dropped on export) come back as zeros.
    again = from_hf(str(tmp_path), padded_vocab_size=128).state_dict()
    assert again.keys() == ours.state_dict().keys()
    for k, v in ours.state_dict().items():
        if k in ("wte.weight", "output_layer.weight"):
            again[k], v = again[k][:100], v[:100]
        torch.testing.assert_close(again[k], v, atol=0, rtol=0)


@pytest.mark.quick
def test_state_dict_conversion_transposes_conv1d_and_pads_vocab():
    config = tiny()
    ours = GPT(config).state_dict()
    hf = ours_to_hf(ours, config)
    assert hf["transformer.wte.weight"].shape == (100, 64)
    assert hf["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)  # Conv1D (in, out)
    assert torch.equal(hf["transformer.h.1.mlp.c_fc.weight"], ours["blocks.1.mlp.fc.weight"].t())
    back = hf_to_ours(hf, config)
    assert back.keys() == ours.keys()
    assert torch.equal(back["wte.weight"][100:], torch.zeros(28, 64))


def test_a_hugging_face_model_exported_to_a_checkpoint_is_where_a_finetune_starts(ids_corpus, tmp_path, capsys):
    """Hugging Face in, from the command line: --export-from a transformers
    directory writes its weights (from_hf's, which give transformers'
    logits: above) as a weights-only checkpoint, and --load it --finetune
    trains from exactly them (at --lr 0 they stay as they are)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf, weights, tuned = str(tmp_path / "hf"), str(tmp_path / "weights"), str(tmp_path / "tuned")
    transformers.GPT2LMHeadModel(transformers.GPT2Config(  # --preset tiny's shape, the ids' vocabulary
        vocab_size=VOCAB + 1, n_positions=64, n_embd=64, n_layer=2, n_head=4)).save_pretrained(hf)
    train.main(["--export-from", hf, "--export-to", weights])
    want = from_hf(hf).full_state_dict()
    exported = torch.load(os.path.join(weights, "iter_0000000", checkpoint.PLAIN_FILE), weights_only=False)
    assert exported["model"].keys() == want.keys() and exported["optimizer"] is None
    assert all(torch.equal(exported["model"][k], want[k]) for k in want)
    train.main(["--preset", "tiny", *IDS, "--data-path", ids_corpus, "--seq-length", "32", "--micro-batch-size", "2",
                "--train-iters", "1", "--lr", "0", "--min-lr", "0", "--eval-interval", "0", "--sample-tokens", "0",
                "--load", weights, "--finetune", "--save", tuned])
    assert f"--finetune: loaded the weights of {weights}/iter_0000000" in capsys.readouterr().out
    after, _ = checkpoint.read_weights(checkpoint.latest_checkpoint(tuned))
    assert all(torch.equal(after[k], want[k]) for k in want)


def test_from_hf_rejects_a_head_its_config_ties_and_a_missing_dir(tmp_path):
    config = tiny()
    hf = ours_to_hf(GPT(config).state_dict(), config)
    hf["lm_head.weight"] = torch.randn(100, 64)
    with pytest.raises(ValueError, match="differs from wte.weight, but config.json ties them"):
        hf_to_ours(hf, config)
    with pytest.raises(UsageError, match="config.json"):
        from_hf(str(tmp_path / "nope"))


def test_a_hugging_face_directory_that_would_run_code_or_read_elsewhere_is_one_line(tmp_path):
    """Hugging Face directories have no digests of ours; what they name is
    checked as it is read. A pytorch_model.bin holding a payload (torch.save's
    zip, or its pre-zip format), and a sharded checkpoint's index mapping a
    weight to a file outside the directory, to a file not safetensors, or
    lacking its weight_map (or naming a link to a FIFO), or a config.json or
    safetensors file cut short: --export-from and eval_tasks.py --hf stop in
    one line that names the file, and nothing runs or is read."""
    from safetensors.torch import load_file
    ran, probes = tmp_path / "the-command-ran", []
    to_hf(tiny_model(), str(tmp_path / "good"))
    weights = load_file(str(tmp_path / "good" / "model.safetensors"))
    (tmp_path / "outside").mkdir()
    shutil.copy(tmp_path / "good" / "model.safetensors", tmp_path / "outside" / "x.safetensors")

    def planted(name, plant, says, evaluate=False):
        hf = tmp_path / name
        hf.mkdir()
        shutil.copy(tmp_path / "good" / "config.json", hf)
        plant(hf)
        probes.append((["train.py", "--export-from", str(hf), "--export-to", str(tmp_path / f"{name}-out")], says))
        if evaluate:
            probes.append((["eval_tasks.py", "--task", "GENERATE", "--num-samples", "1", "--hf", str(hf)], says))

    def indexed(files):
        return lambda hf: (hf / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, **({"weight_map": dict.fromkeys(weights, files)} if files else {})}))

    payload = {"wte.weight": torch.zeros(2), "hook": _RunsACommand(f"touch {ran}")}
    planted("bin", lambda hf: torch.save(payload, hf / "pytorch_model.bin"),
            "pytorch_model.bin holds posix.system", evaluate=True)
    planted("legacy-bin", lambda hf: torch.save(payload, hf / "pytorch_model.bin",
                                                _use_new_zipfile_serialization=False),
            "pytorch_model.bin holds posix.system")
    planted("reads-elsewhere", indexed("../outside/x.safetensors"),
            "model.safetensors.index.json names '../outside/x.safetensors', not one of its own files",
            evaluate=True)
    planted("bin-index", lambda hf: (shutil.copy(tmp_path / "good" / "model.safetensors", hf / "w.bin"),
                                     indexed("w.bin")(hf)), "maps weights to 'w.bin', not a .safetensors file")
    planted("no-map", indexed(None), 'model.safetensors.index.json has no "weight_map"')
    stops_in_one_line(probes, ran)
    assert not any(p.name.endswith("-out") for p in tmp_path.iterdir())  # nothing exported
    # A plain name that is a link into a Hugging Face cache's blobs/, as its snapshots' are, is read (the
    # model loads); one to a file elsewhere, or to a FIFO, which would block the read forever, is one line.
    snapshot = tmp_path / "hub" / "models--tiny" / "snapshots" / "abc123"
    shutil.copytree(tmp_path / "good", tmp_path / "hub" / "models--tiny" / "blobs")
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        os.symlink(f"../../blobs/{name}", snapshot / name)
    assert from_hf(str(snapshot)).wte.weight.shape == tiny_model().wte.weight.shape
    os.mkfifo(tmp_path / "outside" / "fifo.safetensors")
    for target in ("x.safetensors", "fifo.safetensors"):
        planted(target, lambda hf: (os.symlink(f"../outside/{target}", hf / "x.safetensors"),
                                    indexed("x.safetensors")(hf)), "")
        with pytest.raises(UsageError, match=f"names 'x.safetensors', not one of its own files .*is a symbolic "
                                             f"link .to ../outside/{target}"):
            from_hf(str(tmp_path / target))
    cut = tmp_path / "cut"  # files cut short (a copy that did not finish): UsageError, one line as above
    shutil.copytree(tmp_path / "good", cut)
    (cut / "model.safetensors").write_bytes((tmp_path / "good" / "model.safetensors").read_bytes()[:100])
    with pytest.raises(UsageError, match="model.safetensors is not a safetensors file"):
        from_hf(str(cut))
    (cut / "config.json").write_text((tmp_path / "good" / "config.json").read_text()[:30])
    with pytest.raises(UsageError, match="config.json: not JSON"):
        from_hf(str(cut))


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """A GPT-2, a Llama, a Mixtral and a Qwen2-MoE directory, as to_hf writes them (the
    tiny models, 100 tokens: ~100 KB of safetensors each). -> {"gpt2": dir, ...}"""
    out = tmp_path_factory.mktemp("hf")
    shapes = {"gpt2": {}, "llama": LLAMA, "mixtral": KIN["mixtral"][0], "qwen2_moe": KIN["qwen2_moe"][0]}
    for arch, options in shapes.items():
        to_hf(tiny_model(**options), str(out / arch))
    return {arch: str(out / arch) for arch in shapes}


DROP = object()  # hf_variant: remove the key


def hf_variant(source: str, out, config=None, weights=None, layout="safetensors") -> str:
    """A copy of the Hugging Face directory `source` whose config.json is updated
    with `config` (DROP removes a key), whose weights are updated with `weights`
    (HF name -> tensor), stored as `layout`: "safetensors", "sharded" (two files
    and an index) or "bin" (pytorch_model.bin). -> its path"""
    from safetensors.torch import load_file, save_file
    os.makedirs(out)
    hf = json.load(open(os.path.join(source, HF_CONFIG)))
    hf.update(config or {})
    json.dump({k: v for k, v in hf.items() if v is not DROP}, open(os.path.join(out, HF_CONFIG), "w"))
    sd = {**load_file(os.path.join(source, "model.safetensors")), **(weights or {})}
    if layout == "bin":
        torch.save(sd, os.path.join(out, "pytorch_model.bin"))
    elif layout == "sharded":
        names = sorted(sd)
        shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
        for shard, held in shards.items():
            save_file({n: sd[n] for n in held}, os.path.join(out, shard))
        json.dump({"metadata": {}, "weight_map": {n: shard for shard, held in shards.items() for n in held}},
                  open(os.path.join(out, "model.safetensors.index.json"), "w"))
    else:
        save_file(sd, os.path.join(out, "model.safetensors"))
    return str(out)


@pytest.mark.quick
@pytest.mark.parametrize("arch, config, weights, says", [
    ("gpt2", {"n_layer": DROP}, None, "config.json has no 'n_layer': not a complete gpt2 config"),
    ("gpt2", {"layer_norm_epsilon": "x"}, None, "config.json: layer_norm_epsilon is 'x', not a finite number"),
    ("gpt2", {"layer_norm_epsilon": float("nan")}, None, "config.json: layer_norm_epsilon is nan, not a finite number"),
    ("gpt2", {"tie_word_embeddings": "yes"}, None, "config.json: tie_word_embeddings is 'yes', not true or false"),
    ("llama", {"num_attention_heads": 0}, None,
     "config.json: GPTConfig.num_attention_heads must be a positive int, got 0"),
    ("llama", {"rope_parameters": DROP, "rope_theta": "abc"}, None, "config.json: rope_theta is 'abc', not a finite"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}}, None,
     "config.json: rope_theta is nan, not a finite number"),
    ("llama", {"rope_parameters": DROP, "rope_scaling": [1, 2]}, None,
     "config.json: rope_scaling is [1, 2], not an object"),
    ("gpt2", None, {"transformer.h.0.attn.c_attn.weight": torch.zeros(64, 100)},
     "config.json does not describe its weights: transformer.h.0.attn.c_attn.weight is of shape (64, 100) there, "
     "of shape (64, 192) by config.json"),
    ("llama", None, {"model.layers.1.mlp.down_proj.weight": torch.zeros(64, 100)},
     "config.json does not describe its weights: model.layers.1.mlp.down_proj.weight is of shape (64, 100) there, "
     "of shape (64, 128) by config.json"),
    ("mixtral", {"num_local_experts": "4"}, None, "config.json: num_local_experts is '4', not an int or none"),
    ("mixtral", {"sliding_window": 4096}, None, "config.json: sliding_window attention is not supported"),
    ("qwen2_moe", {"qkv_bias": True}, None, "config.json: qkv_bias and mlp_bias differ; --disable-bias-linear sets"),
    ("qwen2_moe", {"decoder_sparse_step": 0}, None,
     "config.json: decoder_sparse_step 0 and mlp_only_layers [0] are not a positive int and a list of layers"),
    ("qwen2_moe", None, {"model.layers.1.mlp.experts.2.down_proj.weight": torch.zeros(64, 16)},
     "config.json does not describe its weights: model.layers.1.mlp.experts.2.down_proj.weight is of shape (64, 16) "
     "there, of shape (64, 32) by config.json"),
], ids=["no-n_layer", "epsilon-x", "epsilon-nan", "tie-yes", "heads-0", "theta-abc", "theta-nan", "scaling-list",
        "gpt2-shape", "llama-shape", "experts-str", "sliding-window", "qkv-bias", "sparse-step-0", "expert-shape"])
def test_a_hugging_face_config_or_weights_not_of_one_model_is_one_line(hf_models, tmp_path, capsys, arch, config,
                                                                       weights, says):
    """config.json with a key missing, a value of the wrong type, NaN (a model
    of it computes NaN), a head count of 0, or rope_scaling not an object; or
    weights of the wrong shape under the right names (load_state_dict's
    traceback, once): --export-from and eval_tasks.py --hf say so in one line
    naming the directory's config.json, and nothing is exported."""
    hf = hf_variant(hf_models[arch], tmp_path / "hf", config, weights)
    for main, argv in ((train.main, ["--export-from", hf, "--export-to", str(tmp_path / "out")]),
                       (eval_tasks.main, ["--task", "GENERATE", "--num-samples", "1", "--hf", hf])):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and f"error: {hf}/{says}" in err, err
    assert not os.path.exists(tmp_path / "out")


# What config.json claims over the tiny models' weights (a few hundred KB), each asking for 256 GB to 281 TB,
# or (20000 layers) 4 GB: (the directory's architecture and layout, its claim, what the one line says)
CLAIMS = [
    ("gpt2", {"n_embd": 2 ** 20}, "transformer.wte.weight is of shape (100, 64) there, of shape (100, 1048576)"),
    ("gpt2", {"vocab_size": 10 ** 9}, "transformer.wte.weight is of shape (100, 64) there, of shape (1000000000, 64)"),
    ("gpt2", {"n_positions": 10 ** 12}, "transformer.wpe.weight is of shape (64, 64) there, of shape (1000000000000,"),
    ("gpt2", {"n_inner": 2 ** 40}, "transformer.h.0.mlp.c_fc.weight is of shape (64, 256) there, of shape (64, 10995"),
    ("gpt2", {"n_layer": 20000}, "config.json says 20000 layers, its weights hold 2"),
    ("llama", {"hidden_size": 2 ** 20, "head_dim": 2 ** 18}, "model.embed_tokens.weight is of shape (100, 64) there"),
    ("llama", {"vocab_size": 10 ** 9}, "model.embed_tokens.weight is of shape (100, 64) there, of shape (1000000000,"),
    ("llama", {"intermediate_size": 2 ** 40}, "model.layers.0.mlp.gate_proj.weight is of shape (128, 64) there"),
    ("llama", {"num_hidden_layers": 20000}, "config.json says 20000 layers, its weights hold 2"),
    ("gpt2 sharded", {"n_layer": 20000}, "config.json says 20000 layers, its weights hold 2"),
    ("gpt2 bin", {"n_embd": 2 ** 20}, "transformer.wte.weight is of shape (100, 64) there, of shape (100, 1048576)"),
    ("mixtral", {"num_local_experts": 10 ** 9}, "config.json says 1000000000 experts, its weights hold 4"),
    ("qwen2_moe", {"num_hidden_layers": 10 ** 12, "decoder_sparse_step": 2},  # (a list of its MoE layers)
     "config.json says 1000000000000 layers, its weights hold 2"),
    ("qwen2_moe", {"moe_intermediate_size": 2 ** 40}, "model.layers.1.mlp.experts.0.gate_proj.weight is of shape (32,"),
]


def _mains_under_a_memory_limit(argvs: list[list[str]]) -> None:
    """In a child process (tests/: importable): each argv (its program's name, then
    its flags) through train.main or eval_tasks.main, under an address-space limit
    1 GiB above what the imports take. Prints one JSON line: each run's exit status
    (or the exception that ended it) and stderr, and how far the peak RSS grew."""
    import contextlib
    import io
    import resource
    import eval_tasks
    from safetensors.torch import load_file  # noqa: F401  (imported before the peak is read)
    size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
    before, results = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, []
    for program, *flags in argvs:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                (eval_tasks.main if program == "eval_tasks.py" else train.main)(flags)
                status = 0
            except SystemExit as e:
                status = e.code
            except Exception as e:  # noqa: BLE001 -- the allocator's, say: reported, and the next one runs
                status = f"{type(e).__name__}: {str(e)[:300]}"
        results.append((status, err.getvalue()))
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    print(json.dumps({"results": results, "grew": grew}))


def test_a_hugging_face_config_that_claims_more_than_its_weights_is_one_line_in_bounded_memory(hf_models, tmp_path):
    """config.json's sizes against the weights' own shapes (the safetensors headers,
    read without a tensor; pytorch_model.bin's tensors) before a model is built:
    a width of 2**20, 10**9 tokens, 10**12 positions, an MLP 2**40 wide or 20000
    layers over weights of a few hundred KB, in GPT-2 and Llama directories, sharded
    or not, or 10**9 experts, 10**12 layers or experts 2**40 wide in Mixtral and
    Qwen2-MoE ones, is one line from --export-from and eval_tasks.py --hf, under a
    memory limit (the claims ask for 4 GB to 281 TB), and the peak memory grows by
    no more than a few times the weights' bytes."""
    argvs, says, biggest = [], [], 0
    for i, (arch, claim, message) in enumerate(CLAIMS):
        kind, _, layout = arch.partition(" ")
        hf = hf_variant(hf_models[kind], tmp_path / str(i), claim, layout=layout or "safetensors")
        biggest = max(biggest, sum(os.path.getsize(os.path.join(hf, n)) for n in os.listdir(hf)))
        argvs.append(["train.py", "--export-from", hf, "--export-to", str(tmp_path / f"{i}-out")])
        says.append(f"error: {hf}/{message}" if message.startswith("config.json") else
                    f"error: {hf}/config.json does not describe its weights: {message}")
    argvs.append(["eval_tasks.py", "--task", "GENERATE", "--num-samples", "1", "--hf", argvs[4][2]])
    says.append(says[4])
    child = [sys.executable, "-c", f"import sys; sys.path[:0] = [{ROOT!r}, {os.path.dirname(__file__)!r}]; "
                                   f"import test_checkpoint; test_checkpoint._mains_under_a_memory_limit({argvs!r})"]
    proc = run_bounded(child, 300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for argv, (status, err), want in zip(argvs, report["results"], says):
        assert status == 2 and err.count("\n") == 1 and want in err, (argv, status, err)
    assert report["grew"] < 4 * biggest + (32 << 20), report["grew"]
    assert not any(p.name.endswith("-out") for p in tmp_path.iterdir())


def test_a_hugging_face_export_copies_no_tokenizer_file_through_a_link_out_or_past_a_bound(hf_models, tmp_path,
                                                                                          capsys, monkeypatch):
    """The tokenizer's files, copied into an exported directory (the kind that
    gets uploaded), are held to the weights' rule: tokenizer.json a link to a
    file elsewhere (/etc/passwd, say) and merges.txt one to a dotfile, a FIFO,
    a sparse file (1 GiB of holes) or a file past the bound (here 1 MiB) are
    one line, and nothing is exported; links into a Hugging Face cache's
    blobs/, as its snapshots' are, are copied."""
    monkeypatch.setattr(huggingface, "TOKENIZER_MOST", 1 << 20)  # (256 MiB: a sparse file, were it larger)
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")
    (tmp_path / ".netrc").write_text("machine example.com password hunter2\n")

    def source(name, plant):
        hf = hf_variant(hf_models["gpt2"], tmp_path / name)
        plant(hf)
        return hf

    for hf, says in (
            (source("links", lambda hf: (os.symlink(secret, os.path.join(hf, "tokenizer.json")),
                                         os.symlink(tmp_path / ".netrc", os.path.join(hf, "merges.txt")))),
             f"tokenizer.json is a symbolic link (to {secret}), not a file"),
            (source("fifo", lambda hf: os.mkfifo(os.path.join(hf, "vocab.json"))), "vocab.json is a FIFO, not a file"),
            (source("holes", lambda hf: open(os.path.join(hf, "tokenizer.json"), "wb").truncate(1 << 30)),
             "tokenizer.json is a sparse file: 1,073,741,824 bytes, of which"),
            (source("huge", lambda hf: open(os.path.join(hf, "tokenizer.json"), "wb").write(bytes(2 << 20))),
             "tokenizer.json holds 2,097,152 bytes, more than a file of its kind")):
        with pytest.raises(SystemExit) as stop:
            train.main(["--export-from", hf, "--export-to", str(tmp_path / "out"), "--export-format", "hf"])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and os.path.join(hf, says.split()[0]) in err \
            and says in err, err
        assert not os.path.exists(tmp_path / "out")
    repo = tmp_path / "hub" / "models--tiny"  # a Hugging Face cache's layout
    shutil.copytree(hf_models["gpt2"], repo / "blobs")
    (repo / "blobs" / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        os.symlink(f"../../blobs/{name}", repo / "snapshots" / "abc123" / name)
    train.main(["--export-from", str(repo / "snapshots" / "abc123"), "--export-to", str(tmp_path / "out"),
                "--export-format", "hf"])
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"model": {"type": "BPE"}}'
    assert not (tmp_path / "out" / "tokenizer.json").is_symlink()


# -----------------------------------------------------------------------------
# Hugging Face Llama in and out (huggingface.from_hf, huggingface.to_hf)


# Llama's options; rotary_percent stays 1 (Llama rotates whole heads).
LLAMA = dict(LLAMA_OPTIONS, num_query_groups=2, rotary_base=500.0, layernorm_epsilon=1e-6)


def randomized(m: GPT, seed=3) -> GPT:
    """Every weight random (norm weights too), so no mapping hides behind ones."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return m.eval()


def unpadded(sd: dict, vocab: int) -> dict:
    """Our state dict without the vocabulary padding rows (HF has none)."""
    return {k: v[:vocab] if k in ("wte.weight", "output_layer.weight") else v for k, v in sd.items()}


@pytest.mark.parametrize("variant", [
    {},                                                      # untied, no biases, GQA
    dict(untie_embeddings_and_output_weights=False, disable_bias_linear=False, num_query_groups=None),
], ids=["untied-nobias-gqa", "tied-biases-mha"])
def test_llama_export_loads_in_transformers_with_the_same_logits(tmp_path, variant):
    transformers = pytest.importorskip("transformers")
    ours = randomized(tiny_model(**{**LLAMA, **variant}))
    to_hf(ours, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["model_type"] == "llama"
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert theirs.config.num_key_value_heads == ours.config.num_query_groups
    x = tokens(T=32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[..., :100], theirs(x).logits, atol=1e-5, rtol=1e-5)
    back = from_hf(str(tmp_path), padded_vocab_size=128)
    assert back.config == dataclasses.replace(ours.config, ffn_hidden_size=ours.config.ffn_hidden_size)
    want, got = unpadded(ours.state_dict(), 100), back.state_dict()
    for k in want:
        assert torch.equal(got[k][:want[k].shape[0]], want[k]), k


def test_from_hf_reads_a_llama_checkpoint_that_transformers_wrote(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, rope_theta=500.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.2)
    theirs.save_pretrained(str(tmp_path))
    ours = from_hf(str(tmp_path)).eval()
    c = ours.config
    assert (c.position_embedding_type, c.normalization, c.swiglu, c.num_query_groups, c.rotary_base,
            c.untie_embeddings_and_output_weights, c.disable_bias_linear, c.ffn_hidden_size) == \
        ("rope", "RMSNorm", True, 2, 500.0, True, True, 96)
    x = tokens(T=32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[..., :100], theirs(x).logits, atol=1e-5, rtol=1e-5)


# Llama's kin: a shape of ours -> (transformers' class, its model_type). Two layers: Qwen's with one MoE layer
# and one dense (--moe-layer-freq's pattern, their mlp_only_layers); Qwen2-MoE's top-k of the full softmax.
KIN = {"mixtral": (dict(LLAMA, num_experts=4), "MixtralForCausalLM"),
       "qwen2_moe": (dict(LLAMA, num_experts=4, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48,
                          moe_shared_expert_gate=True, moe_layer_freq=[0, 1], moe_router_pre_softmax=True),
                     "Qwen2MoeForCausalLM"),
       "qwen3_moe": (dict(LLAMA, num_experts=4, qk_layernorm=True, moe_layer_freq=[1, 0]), "Qwen3MoeForCausalLM"),
       "qwen3": (dict(LLAMA, qk_layernorm=True), "Qwen3ForCausalLM")}


@pytest.mark.quick
@pytest.mark.parametrize("arch", KIN)
def test_an_moe_or_qk_layernorm_export_loads_in_transformers_with_the_same_logits(tmp_path, arch):
    """--export-format hf of the experts and --qk-layernorm: Mixtral for Llama's options
    with experts, Qwen2-MoE with a gated shared expert, Qwen3-MoE with the experts and
    q and k normed, Qwen3 with them normed alone. transformers' class gives our logits
    to 1e-5, and from_hf reads the directory back to the same config and the same
    weights, bit for bit."""
    transformers = pytest.importorskip("transformers")
    options, cls = KIN[arch]
    ours = randomized(tiny_model(**options))
    to_hf(ours, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["model_type"] == arch
    theirs = getattr(transformers, cls).from_pretrained(str(tmp_path)).eval()
    x = tokens(T=32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[..., :100], theirs(x).logits, atol=1e-5, rtol=1e-5)
    back = from_hf(str(tmp_path), padded_vocab_size=128)
    assert back.config == ours.config
    want, got = unpadded(ours.state_dict(), 100), back.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k][:want[k].shape[0]], want[k]), k


def random_kin(arch: str):
    """A random tiny model of transformers' own (every weight ~ N(0, 0.2)), of Llama's kin."""
    transformers = pytest.importorskip("transformers")
    shape = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, rope_theta=500.0, tie_word_embeddings=False)
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    cfg = {"mixtral": lambda: transformers.MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2),
           "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**shape, **experts, shared_expert_intermediate_size=48,
                                                            decoder_sparse_step=2, qkv_bias=False),
           "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**shape, **experts, head_dim=16, mlp_only_layers=[1],
                                                            norm_topk_prob=True),
           "qwen3": lambda: transformers.Qwen3Config(**shape, head_dim=16)}[arch]()
    torch.manual_seed(0)
    model = getattr(transformers, KIN[arch][1])(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


@pytest.mark.quick
@pytest.mark.parametrize("layout", ["save_pretrained", "fused"])
@pytest.mark.parametrize("arch", KIN)
def test_from_hf_reads_an_moe_or_qk_layernorm_checkpoint_that_transformers_wrote(tmp_path, arch, layout):
    """A directory transformers wrote: save_pretrained's (one matrix per expert, as the Hub's
    Mixtral and Qwen-MoE checkpoints: Mixtral's block_sparse_moe.experts.{e}.w1/w3/w2, Qwen's
    mlp.experts.{e}.gate/up/down_proj), or transformers 5's own names (experts.gate_up_proj
    and experts.down_proj stacked, which transformers reads too). Ours gives its logits to
    1e-5, with its MoE layers (decoder_sparse_step, mlp_only_layers) and its routing
    (norm_topk_prob); and --export-from it, to a plain checkpoint and from that to Hugging
    Face (checkpoint.export_weights), writes save_pretrained's tensors, bit for bit."""
    from safetensors.torch import load_file, save_file
    transformers = pytest.importorskip("transformers")
    theirs = random_kin(arch)
    if layout == "fused":
        theirs.config.save_pretrained(str(tmp_path))
        save_file({k: t.contiguous() for k, t in theirs.state_dict().items()}, str(tmp_path / "model.safetensors"))
    else:
        theirs.save_pretrained(str(tmp_path))
    ours = from_hf(str(tmp_path)).eval()
    c = ours.config
    assert (c.num_experts, c.moe_layer_freq, c.moe_router_pre_softmax, c.qk_layernorm, c.moe_shared_expert_gate) == {
        "mixtral": (4, 1, False, False, False), "qwen2_moe": (4, [0, 1], True, False, True),
        "qwen3_moe": (4, [1, 0], False, True, False), "qwen3": (None, 1, False, True, False)}[arch]
    x = tokens(T=32)
    with torch.no_grad():
        want = theirs(x).logits
        torch.testing.assert_close(ours(x)[..., :100], want, atol=1e-5, rtol=1e-5)
        read = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
        torch.testing.assert_close(read(x).logits, want, atol=0, rtol=0)  # a layout transformers reads
    if layout == "save_pretrained":  # --export-from it to a plain checkpoint, and that --export-format hf
        checkpoint.export_weights(str(tmp_path), str(tmp_path / "plain"), "plain")
        checkpoint.export_weights(str(tmp_path / "plain"), str(tmp_path / "again"), "hf")
        saved, exported = (load_file(str(tmp_path / d / "model.safetensors")) for d in (".", "again"))
        assert saved.keys() == exported.keys()
        assert all(torch.equal(saved[k], exported[k]) for k in saved)


@pytest.mark.parametrize("options,flag", [
    (dict(position_embedding_type="rope"), "--position-embedding-type learned_absolute"),
    (dict(LLAMA_OPTIONS, normalization="LayerNorm"), "--normalization RMSNorm"),
    (dict(LLAMA_OPTIONS, rotary_percent=0.5), "--rotary-percent 1.0"),
    (dict(num_query_groups=2), "no --group-query-attention"),
    (dict(LLAMA_OPTIONS, qk_layernorm=True, disable_bias_linear=False), "Llama, needs no --qk-layernorm"),
    (dict(num_experts=4), "Mixtral, needs --position-embedding-type rope, --normalization RMSNorm, --swiglu"),
    (dict(LLAMA_OPTIONS, num_experts=4, disable_bias_linear=False), "Mixtral, needs --disable-bias-linear"),
    (dict(LLAMA_OPTIONS, num_experts=4, moe_router_score_function="sigmoid"),
     "Mixtral, needs --moe-router-score-function softmax"),
    (dict(LLAMA_OPTIONS, num_experts=4, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
     "Mixtral, needs --moe-router-score-function softmax, no --moe-router-enable-expert-bias"),
    (dict(LLAMA_OPTIONS, num_experts=4, moe_expert_capacity_factor=1.0), "no --moe-expert-capacity-factor (dropless)"),
    (dict(LLAMA_OPTIONS, num_experts=4, moe_router_pre_softmax=True), "Mixtral, needs no --moe-router-pre-softmax"),
    (dict(LLAMA_OPTIONS, num_experts=4, moe_layer_freq=2), "Mixtral, needs --moe-layer-freq 1"),
    (dict(LLAMA_OPTIONS, num_experts=4, moe_shared_expert_intermediate_size=32), "needs --moe-shared-expert-gate"),
    (dict(LLAMA_OPTIONS, num_experts=4, moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True,
          qk_layernorm=True), "Qwen2-MoE, needs no --qk-layernorm"),
])
def test_export_of_a_model_no_transformers_architecture_computes_names_the_flag(tmp_path, options, flag):
    """What no transformers class computes (a router's sigmoid scores or expert bias,
    capacity, biases on experts, a shared expert beside normed q and k, ...): one line
    naming the closest class and the flags it needs, and nothing written."""
    m = tiny_model(**options)
    with pytest.raises(ValueError, match=re.escape(flag)) as refused:
        to_hf(m, str(tmp_path / "out"))
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()  # refused before writing anything
    assert hf_architecture(tiny_model().config) == "gpt2"
    assert hf_architecture(tiny_model(**LLAMA).config) == "llama"



@pytest.mark.quick
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("how", ["resumed", "--no-load-optim"])
def test_a_checkpoint_of_other_shapes_is_one_line_before_any_tensor_is_read(
        corpus, two_saves, dist_saves, capsys, fmt, how):
    """--hidden-size 128 against a checkpoint of width 64: the one line of
    any other difference of architecture, not torch's size-mismatch error
    for every tensor (the model is checked before the loader reads one)."""
    ckpt = two_saves if fmt == "torch" else dist_saves
    with pytest.raises(SystemExit) as stop:
        train.main([*TINY, "--data-path", corpus, "--train-iters", "6", "--load", ckpt, "--hidden-size", "128",
                    *([how] if how.startswith("--") else [])])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"train.py: error: checkpoint {ckpt}/iter_0000004 is another model: hidden_size 64 (this run: 128), "
        f"ffn_hidden_size 256 (this run: 512); give this run the checkpoint's flags"]


@pytest.mark.quick
def test_a_checkpoint_of_another_model_is_refused_and_a_finetune_may_change_the_rope_base():
    """check_same_model: the run's architecture against the checkpoint's
    model_config. Any difference is one line naming both values, except the
    RoPE base under --finetune (long-context fine-tunes change it)."""
    import config
    flags = ["--preset", "tiny", "--position-embedding-type", "rope"]
    cfg = config.parse_args(flags)
    saved = dataclasses.asdict(config.model_config(cfg))
    checkpoint.check_same_model(cfg, saved, "ckpt/iter_0000002")  # its own model
    for key, value in (("layernorm_epsilon", 1e-6), ("rotary_base", 500000.0), ("num_query_groups", 2)):
        with pytest.raises(UsageError, match=rf"^checkpoint ckpt/iter_0000002 is another model: {key} {value} "
                                             rf"\(this run: {saved[key]}\); give this run the checkpoint's flags$"):
            checkpoint.check_same_model(cfg, {**saved, key: value}, "ckpt/iter_0000002")
    finetune = config.parse_args([*flags, "--finetune", "--load", "ckpt"])
    checkpoint.check_same_model(finetune, {**saved, "rotary_base": 500000.0}, "ckpt/iter_0000002")
    with pytest.raises(UsageError, match="vocab_size"):
        checkpoint.check_same_model(finetune, {**saved, "vocab_size": 1000}, "ckpt/iter_0000002")
    # Positions: learned ones are weights (wpe's rows), RoPE's are not (a longer context is a fine-tune's choice)
    longer = {**saved, "max_position_embeddings": 4 * saved["max_position_embeddings"]}
    checkpoint.check_same_model(cfg, longer, "ckpt/iter_0000002")
    learned = config.parse_args(["--preset", "tiny"])
    with pytest.raises(UsageError, match=r"is another model: max_position_embeddings \d+ \(this run: \d+\)"):
        checkpoint.check_same_model(learned, {**dataclasses.asdict(config.model_config(learned)),
                                              "max_position_embeddings": longer["max_position_embeddings"]}, "ckpt")
