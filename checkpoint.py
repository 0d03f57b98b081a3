"""Checkpoints: train.py's own (Megatron's layout), DeepSpeed's, Hugging
Face directories, and weight export. Sections:

  1. plain: SAVE/iter_0000100/model_optim_rng.pt + latest_checkpointed_iteration.txt,
     full (unsharded) states, so any TP and DP size loads them (--ckpt-format
     torch), or the same states, each rank writing its own shards, through
     torch.distributed.checkpoint (torch_dist); which checkpoint --load reads,
     and what it may take from it
  2. DeepSpeed: engine.save_checkpoint's own layout plus trainer_state.json,
     so its tools (zero_to_fp32) read it; export of either kind's weights
  3. Hugging Face GPT-2 and Llama directories in and out (from_hf, to_hf)
Every kind is written under a temporary name, renamed into place, then
pointed at (publish): a crash at any point leaves the previous checkpoint
and the pointer to it intact.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import functools
import glob
import hashlib
import importlib
import io
import json
import os
import pickle
import pickletools
import random
import re
import shutil
import stat
import tempfile
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist

import parallel
from config import TrainConfig, model_config
from data import VOCAB_SIZE
from gpt import GPT, GPTConfig, pad_vocab_size
from launch import UsageError, atomic_write, fsync_path, parse_json
from prepare import gpt2_bpe_files

# ----------------------------------------------------------------------------
# 1. train.py's own checkpoints
# ----------------------------------------------------------------------------

LATEST = "latest_checkpointed_iteration.txt"  # Megatron's pointer: both kinds write it
PLAIN_FILE = "model_optim_rng.pt"
DS_LATEST = "latest"  # DeepSpeed's own pointer file name, so its tools work on our checkpoints
DS_META = "trainer_state.json"
DIST_METADATA = ".metadata"  # torch.distributed.checkpoint's index, written last: a torch_dist checkpoint
MARKERS = (("plain", PLAIN_FILE), ("torch_dist", DIST_METADATA), ("deepspeed", DS_META))  # kind: its file
DIGESTS = "checksums.sha256"  # every file's sha256, in sha256sum's format (`sha256sum -c` reads it)
HF_CONFIG = "config.json"  # a Hugging Face model directory's (section 3)


def rng_state() -> dict:
    """The shared generators' states (the same on every rank) and every TP
    rank's own dropout stream (parallel.py, section 5). Collective over TP."""
    torch_state = parallel.default_rng_state()  # {"cpu": ..., and on a GPU "cuda": ...}
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch_state.pop("cpu"),
            **torch_state, "tracker": parallel.rng_tracker_states_of_every_tp_rank()}


def set_rng_state(state: dict, log) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = state.get("tracker")
    if tracker and not parallel.set_rng_tracker_states_of_every_tp_rank(tracker):
        log(f"the per-TP-rank dropout streams were saved at tensor-parallel size {len(tracker)} "
            f"or on another device; they start afresh from --seed")


def load_full_optimizer_state(model: GPT, optimizer, saved: dict, shard_like=parallel.shard_like) -> None:
    """Inverse of states_for_writer: slice this rank's shards, in torch's own
    format (parameters numbered in param-group order), so that torch places
    every tensor on the right device. (torch_dist reads the shards themselves:
    shard_like is then the identity.)"""
    names = {id(p): n for n, p in model.named_parameters()}
    state = {}
    for index, p in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        name = names[id(p)]
        if name not in saved["state"]:
            raise KeyError(f"checkpoint has no optimizer state for parameter {name!r}")
        state[index] = {k: shard_like(p, v) if torch.is_tensor(v) and v.dim() > 0 else v
                        for k, v in saved["state"][name].items()}
    # The saved hyperparameters, with this optimizer's own numbering of its parameters
    # (a pipeline stage holds some of the saved ones).
    groups = [{**g, "params": own["params"]}
              for g, own in zip(saved["param_groups"], optimizer.state_dict()["param_groups"])]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def gather_to_writer(param: torch.nn.Parameter, t: torch.Tensor) -> torch.Tensor | None:
    """The full tensor of `t` (a parameter, or optimizer state shaped like it)
    on TP rank 0's host, None on the other TP ranks. A gather straight to the
    CPU: no GPU holds more than one full tensor beyond its own shards."""
    t = parallel.gather_like(param, t, to_first=True)
    return None if t is None else t.detach().cpu()


def states_for_writer(model: GPT, optimizer) -> tuple[dict, dict] | tuple[None, None]:
    """(model state dict, optimizer state keyed by parameter name), full and
    unsharded, assembled tensor by tensor on global rank 0; (None, None)
    elsewhere. Only the first DP replica takes part. (Gathering on every rank
    would put 16 bytes a parameter on each GPU: 24 GB at 1.5B and tp=2.)"""
    if parallel.layout.dp_rank != 0:
        return None, None
    params = dict(model.named_parameters())
    model_sd = {name: gather_to_writer(params[name], t) if name in params
                else (t.detach().cpu() if parallel.layout.tp_rank == 0 else None)
                for name, t in model.state_dict().items()}
    optim = {name: {k: gather_to_writer(p, v) if torch.is_tensor(v) and v.shape == p.shape else v
                    for k, v in optimizer.state.get(p, {}).items()}
             for name, p in params.items()}
    if parallel.layout.tp_rank != 0:
        return None, None
    if parallel.layout.pp_size > 1:
        model_sd, optim = whole_pipeline(model_sd, optim)
        if model_sd is None:
            return None, None
    return model_sd, {"state": optim, "param_groups": optimizer.state_dict()["param_groups"]}


def gather_stages(obj) -> list | None:
    """Every pipeline stage's `obj`, in stage order, on this pipeline's first
    stage; None on the others. Collective over the pipeline group. For small
    things (names, shapes, random streams): gather_object pickles them whole."""
    first = parallel.layout.pp_rank == 0
    stages = [None] * parallel.layout.pp_size if first else None
    group = parallel.layout.pp_group
    dist.gather_object(obj, stages, dst=dist.get_global_rank(group, 0), group=group)
    return stages


def whole_pipeline(model_sd: dict, optim: dict) -> tuple[dict, dict] | tuple[None, None]:
    """Every pipeline stage's states, sent to the first stage (global rank 0)
    and merged into the whole model's, with the same keys as at pp=1; (None,
    None) on the other stages. First each stage's list of tensors (names,
    shapes), then the tensors one at a time, point to point: no device holds
    more than one of another stage's tensors. A tied embedding is on two
    stages: the first's copy is kept (the two are equal)."""
    items = {("model", k): v for k, v in model_sd.items()}
    items.update({("optimizer", name, k): v for name, state in optim.items() for k, v in state.items()})
    listed = {key: (v.shape, v.dtype) if torch.is_tensor(v) else v for key, v in items.items()}
    stages = gather_stages((listed, list(optim)))
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    if stages is None:
        for v in (v for v in items.values() if torch.is_tensor(v)):
            dist.send(v.to(device), dst=dist.get_global_rank(parallel.layout.pp_group, 0))
        return None, None
    merged = ({}, {})  # (model, optimizer)
    for stage, (stage_listed, names) in enumerate(stages):
        for name in names:
            merged[1].setdefault(name, {})
        for key, value in stage_listed.items():
            if stage == 0:
                value = items[key]
            elif isinstance(value, tuple):  # (shape, dtype): the tensor comes next
                shape, dtype = value
                value = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(value, src=dist.get_global_rank(parallel.layout.pp_group, stage))
                value = value.cpu()
            whole = merged[0] if key[0] == "model" else merged[1][key[1]]
            whole.setdefault(key[-1], value)
    return merged


def publish(tmp_dir: str, final_dir: str, kind: str, iteration: int) -> None:
    """Move a completely written checkpoint directory into place, then point
    at it. Everything is forced to disk before the rename that makes it
    visible, so a crash or power loss leaves the old checkpoint and pointer
    or the new ones. A re-saved iteration's old copy is final_dir.old until
    the new one is in place (checkpoint_dir reads it after a crash between)."""
    for root, _, files in os.walk(tmp_dir):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)
    old = final_dir + ".old"
    if os.path.exists(final_dir):
        shutil.rmtree(old, ignore_errors=True)  # a stale copy from an earlier crash
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    fsync_path(os.path.dirname(final_dir))
    point_at(os.path.dirname(final_dir), kind, iteration)
    shutil.rmtree(old, ignore_errors=True)


def point_at(save_dir: str, kind: str, iteration: int) -> None:
    """Make `iteration` save_dir's latest. Both kinds write Megatron's pointer
    (--load reads it first); a DeepSpeed save also writes DeepSpeed's `latest`
    for its tools. After a plain save that one would name an older (or
    deleted) checkpoint, so it goes first: a crash in between leaves
    Megatron's naming the previous complete checkpoint."""
    ds_pointer = os.path.join(save_dir, DS_LATEST)
    if kind != "deepspeed" and os.path.exists(ds_pointer):
        os.remove(ds_pointer)
        fsync_path(save_dir)
    atomic_write(os.path.join(save_dir, LATEST), lambda f: f.write(str(iteration).encode()))
    if kind == "deepspeed":
        atomic_write(ds_pointer, lambda f: f.write(f"iter_{iteration:07d}".encode()))


def checkpoint_dir(save_dir: str, tag: str) -> str:
    """SAVE/TAG, or SAVE/TAG.old after a crash mid re-save (see publish)."""
    path = os.path.join(save_dir, tag)
    if not os.path.isdir(path) and os.path.isdir(path + ".old"):
        return path + ".old"
    return path


def write_plain_checkpoint(save_dir: str, state: dict) -> str:
    """SAVE/iter_N/model_optim_rng.pt + SAVE/latest_checkpointed_iteration.txt."""
    final = os.path.join(save_dir, f"iter_{state['iteration']:07d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with freed_on_failure(tmp):
        torch.save(state, os.path.join(tmp, PLAIN_FILE))
        write_digests(tmp, digest_files(tmp, [PLAIN_FILE]))
        publish(tmp, final, "plain", state["iteration"])
    return final


@contextlib.contextmanager
def freed_on_failure(tmp: str, mine: bool = True):
    """A save that fails removes what it wrote (SAVE/iter_N.tmp) at once: on a
    full disk, its space is what the next save needs. (One killed outright
    leaves it to remove_old_checkpoints.) `mine`: this rank removes it.
    Whether the disk was full is judged first (disk_full asks the filesystem,
    which the removal would empty) and said as an ENOSPC, for on_every_rank."""
    try:
        yield
    except BaseException as e:
        # (a UsageError is on_every_rank's verdict, already said)
        full = disk_full(e, os.path.dirname(tmp)) if isinstance(e, Exception) and not isinstance(e, UsageError) \
            else None
        if mine:
            shutil.rmtree(tmp, ignore_errors=True)
        if full and os_error_in(e) is None:  # (an errno says it already)
            raise OSError(errno.ENOSPC, full) from e
        raise


def saved_iterations(save_dir: str) -> list[int]:
    """The iterations of save_dir's iter_NNNNNNN directories, in order."""
    return sorted(i for i in map(iteration_of, os.listdir(save_dir)) if i is not None)


def iteration_of(name: str) -> int | None:
    """N of a checkpoint's directory name iter_NNNNNNN, else None. ASCII
    digits only: str.isdigit() also takes ones int() refuses (²)."""
    digits = name[5:]
    return int(digits) if (len(name) == 12 and name.startswith("iter_") and digits.isascii()
                           and digits.isdigit()) else None


def remove_old_checkpoints(save_dir: str, current: int, keep: int | None, log) -> None:
    """Once `current` is published: delete unfinished saves (iter_N.tmp; one
    job saves at a time, so none is in progress) and, with `keep`, all but
    the `keep` newest checkpoints up to `current`. Later iterations (another
    run's) and anything not named iter_NNNNNNN are never touched."""
    for name in sorted(os.listdir(save_dir)):
        if name.startswith("iter_") and name.endswith(".tmp"):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
            log(f"removed {name}, the leftover of a save that did not complete")
    if not keep:
        return
    for iteration in [i for i in saved_iterations(save_dir) if i <= current][:-keep]:
        path = os.path.join(save_dir, f"iter_{iteration:07d}")
        if os.path.islink(path):
            # A link to a checkpoint kept elsewhere (an archive, another run's): the link is
            # all of it this directory holds, so it goes, and --keep-last-checkpoints still
            # holds here; what it points at is not this run's to delete, and stays.
            target = os.path.realpath(path)
            os.unlink(path)
            log(f"removed the link iter_{iteration:07d} (--keep-last-checkpoints {keep}); "
                f"the checkpoint it named, {target}, is left as it is")
            continue
        shutil.rmtree(path)
        log(f"removed checkpoint iter_{iteration:07d} (--keep-last-checkpoints {keep})")


def on_every_rank(fn, what: str, group=None, directory: str | None = None) -> None:
    """Run fn(), then agree with every rank (of `group`, default all) on
    whether all succeeded: a rank whose part failed raises its own error, the
    others stop with one line naming it. (At a bare barrier they would wait forever.)
    A failed write into `directory` on a full disk is the user's to fix: one line."""
    error = None
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- re-raised below, after the vote
        error = e
    full = disk_full(error, directory) if error else None  # then how, in one line
    mine = (full or f"{type(error).__name__}: {error}", full is not None) if error else None
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    for rank, (message, full) in ((r, m) for r, m in enumerate(everyone) if m):
        if full:  # the user's to fix: one line from rank 0 (launch.report_usage_error)
            raise UsageError(f"{what} failed on rank {rank}, the disk is full ({message}); the previous "
                             f"checkpoint and its pointer are intact: free space, then resume with --load")
    if error is not None:
        raise error
    for rank, message in enumerate(everyone):
        if message:
            raise SystemExit(f"rank {dist.get_rank()}: stopping, {what} failed on rank {rank}: {message[0]}")


FULL_BELOW = 16 << 20  # bytes: a filesystem with less free holds no checkpoint, whatever the error says


def os_error_in(error: BaseException) -> OSError | None:
    """The first OSError with an errno in error's chain (raised, or wrapped), or None."""
    cause, seen = error, set()
    while cause is not None and id(cause) not in seen and not (isinstance(cause, OSError) and cause.errno):
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return cause


def disk_full(error: BaseException, directory: str | None) -> str | None:
    """How a failed write ran out of space (one line), or None. An OSError
    says so (ENOSPC, or EDQUOT: a quota), raised or wrapped; torch.save's zip writer does not:
    it raises a RuntimeError without the errno ("unexpected pos ...",
    "basic_ios::clear"), which DCP and DeepSpeed pass on. Then the
    filesystem written to is asked: a write that ran out left it all but full."""
    cause = os_error_in(error)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}" if cause.errno in (errno.ENOSPC, errno.EDQUOT) else None
    try:
        stats = os.statvfs(directory) if directory else None
    except OSError:  # not there, or not ours to ask
        stats = None
    if stats is None or stats.f_bavail * stats.f_frsize >= FULL_BELOW:
        return None
    said = (str(error).strip().splitlines() or [""])[0]
    return f"{stats.f_bavail * stats.f_frsize:,} bytes free on {directory}; {type(error).__name__}: {said}"


# Digests: each save lists every file's sha256 beside them (DIGESTS), from the
# bytes on disk; a load checks them before it reads, and a damaged or
# incomplete checkpoint gives way to the newest intact one (verified_checkpoint).

def plain_file_problem(directory: str, name: str) -> str | None:
    """Why `name` is not a plain file of `directory`, or None. The names a
    checkpoint gives (checksums.sha256's, DCP's index's, a Hugging Face
    index's) may not lead elsewhere: a bare file name (no directory part, no
    `..`, nothing sha256sum would escape) of a regular file there, not a
    link, directory, FIFO or device, which a tar or zip can carry and whose
    reading would go outside the checkpoint or never end."""
    if name in ("", ".", "..") or any(c in name for c in "/\\\n\r\0"):
        return f"{name!r} is not a file name in the checkpoint's directory"
    path = os.path.join(directory, name)
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return f"{name} is missing"
    if stat.S_ISLNK(mode):
        return f"{name} is a symbolic link (to {os.readlink(path)}), not a file"
    return None if stat.S_ISREG(mode) else f"{name} is {_not_a_file(mode)}, not a file"


def _not_a_file(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    return next((what for test, what in kinds if test(mode)), "a device")


@contextlib.contextmanager
def regular_file(path: str, follow: bool = False):
    """(binary file, size) of `path`, opened only if it is a regular file
    (and, unless `follow`, not a link), checked before the open and again on
    the open file; a UsageError otherwise. A FIFO never blocks the open, and
    a reader takes no more than `size` bytes: /dev/zero has no end."""
    mode = (os.stat if follow else os.lstat)(path).st_mode
    if not stat.S_ISREG(mode):
        what = "a symbolic link" if stat.S_ISLNK(mode) else _not_a_file(mode)
        raise UsageError(f"{path} is {what}, not a file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW))
    except OSError as e:  # swapped for a link since the check
        if e.errno != errno.ELOOP:
            raise
        raise UsageError(f"{path} is a symbolic link, not a file") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # swapped since the check
            raise UsageError(f"{path} is {_not_a_file(info.st_mode)}, not a file")
        os.set_blocking(fd, True)  # O_NONBLOCK was for the open alone
        yield f, info.st_size


def sha256_of(path: str) -> str:
    """The sha256 of a regular file's bytes (regular_file), read in blocks."""
    digest = hashlib.sha256()
    with regular_file(path) as (f, left):
        while left > 0 and (block := f.read(min(left, 1 << 24))):
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


def listed_digests(directory: str) -> dict[str, str]:
    """name -> sha256 of every line of directory's DIGESTS, in sha256sum's
    format: `SHA256  NAME`, or `SHA256 *NAME` as `sha256sum -b` writes (its
    binary mode hashes the same bytes). A UsageError names a line of any
    other form; the names are checked where they are read (damage)."""
    path, listed = os.path.join(directory, DIGESTS), {}
    with regular_file(path) as (f, size):
        text = f.read(size).decode("utf-8", "replace")
    for number, line in enumerate(text.removesuffix("\n").split("\n") if text else [], 1):
        match = re.fullmatch(r"([0-9a-fA-F]{64}) [ *](.+)", line)
        if not match or match[2] in listed:
            raise UsageError(f"line {number} of {DIGESTS}, {line[:80]!r}, is not `SHA256  NAME` of a file "
                             f"listed once")
        listed[match[2]] = match[1].lower()
    return listed


def digest_files(directory: str, names: list[str]) -> dict[str, str]:
    return {name: sha256_of(os.path.join(directory, name)) for name in names}


def digests_of_every_rank(directory: str, what: str, group=None) -> dict[str, str]:
    """The sha256 of every file in directory, rank r hashing files r, r+W, ...
    of the sorted list (collective; every rank's writes must be done)."""
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    names, mine = sorted(os.listdir(directory)), {}
    on_every_rank(lambda: mine.update(digest_files(directory, names[rank::world])), what, group)
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
    return {name: d for share in everyone for name, d in share.items()}


def write_digests(directory: str, digests: dict[str, str]) -> None:
    text = "".join(f"{d}  {name}\n" for name, d in sorted(digests.items()))
    atomic_write(os.path.join(directory, DIGESTS), lambda f: f.write(text.encode()))


def damage(found: Found) -> str | None:
    """What is wrong with a checkpoint, or None: its directory holds plain
    files only (plain_file_problem), every one listed in its DIGESTS with its
    sha256 (without DIGESTS: none is cut short), and a DeepSpeed one's
    trainer_state.json records the iteration it was chosen for."""
    if found.kind is None:
        return f"it holds no checkpoint (none of {', '.join(marker for _, marker in MARKERS)})"
    names = sorted(os.listdir(found.path))
    try:
        problem = next(filter(None, (plain_file_problem(found.path, name) for name in names)), None) or (
            digests_problem(found.path, names) if DIGESTS in names else None)
        if problem is None and found.kind == "deepspeed":
            saved = read_deepspeed_meta(found.path)["iteration"]
            if saved != found.iteration:
                problem = f"its {DS_META} records iteration {saved}, not {found.iteration}"
    except UsageError as e:  # a file of the wrong form
        problem = str(e)
    # (outside: cut_short's refusal of an index that would run code stops the run, see data_only_loads)
    return problem or (None if DIGESTS in names else cut_short(found))


def digests_problem(directory: str, names: list[str]) -> str | None:
    """damage's verdict on the files `names` of a directory with DIGESTS
    (each of which damage found a plain file already)."""
    listed = listed_digests(directory)
    there = set(names)  # so only a listed name not among them is left to judge: missing, or no plain name
    problem = next(filter(None, (plain_file_problem(directory, name) for name in listed if name not in there)), None)
    if problem:  # before any file is read
        return problem
    unlisted = [name for name in names if name not in listed and name != DIGESTS]
    if unlisted:  # another run's, saved over this one (at another data-parallel size, say)
        return (f"{', '.join(unlisted)} {'is' if len(unlisted) == 1 else 'are'} not listed in {DIGESTS} "
                f"(another save's, written over this one?)")
    for name, digest in listed.items():
        if sha256_of(os.path.join(directory, name)) != digest:
            return f"{name} is damaged (its sha256 is not the one {DIGESTS} records)"
    return None


def cut_short(found: Found) -> str | None:
    """Without digests (a checkpoint from before them, or copied without
    them), a file cut short is still found, by its own index: a torch.save
    file is a zip whose directory is its last bytes, and DCP's .metadata
    gives the extent of every piece in its shard files."""
    if found.kind == "torch_dist":
        try:
            metadata = dist_reader(found.path).read_metadata()
        except (EOFError, pickle.UnpicklingError) as e:  # cut short, or a refused global (said by the read)
            if isinstance(e, EOFError) or "truncated" in str(e):
                return f"{DIST_METADATA} is truncated"
            metadata = read_dist_metadata(found.path)
        ends = {}
        for info in metadata.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        for name, end in sorted(ends.items()):
            path = os.path.join(found.path, name)
            if not os.path.exists(path) or os.path.getsize(path) < end:
                return f"{name} is {'missing' if not os.path.exists(path) else 'truncated'}"
        return None
    for name in sorted(n for n in os.listdir(found.path) if n.endswith(".pt")):
        with open(os.path.join(found.path, name), "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"  # not torch's pre-zip format, which has no index
        if zipped and not zipfile.is_zipfile(os.path.join(found.path, name)):
            return f"{name} is truncated (its zip directory is gone)"
    return None


def write_every_rank(cfg: TrainConfig, kind: str, iteration: int, write, log, extra=None, group=None) -> None:
    """A checkpoint every rank writes part of (torch_dist, DeepSpeed): each
    writes into SAVE/iter_N.tmp (write(tmp)), they hash the files, then rank 0
    adds its own (extra(tmp) -> their names), the digests, and publishes.
    Every collective on `group` (AsyncSave's, for a write in the background)."""
    final = os.path.join(cfg.save, f"iter_{iteration:07d}")
    tmp, what = final + ".tmp", f"saving checkpoint {iteration} to {cfg.save}"
    first = not dist.is_initialized() or dist.get_rank() == 0
    on_every_rank(lambda: first and shutil.rmtree(tmp, ignore_errors=True), what, group)

    def publish_on_first():
        if first:
            write_digests(tmp, {**digests, **digest_files(tmp, extra(tmp) if extra else [])})
            publish(tmp, final, kind, iteration)
            log(f"saved checkpoint {final}")
            remove_old_checkpoints(cfg.save, iteration, cfg.keep_last_checkpoints, log)

    with freed_on_failure(tmp, first):  # each step ends in a vote: no rank still writes into it
        on_every_rank(lambda: write(tmp), what, group, cfg.save)
        digests = digests_of_every_rank(tmp, what, group)
        on_every_rank(publish_on_first, what, group, cfg.save)


def save_checkpoint(cfg: TrainConfig, model: GPT, optimizer, scaler, iteration: int,
                    consumed_samples: int, log, saver: AsyncSave | None = None) -> None:
    """--ckpt-format torch_dist (the default): every rank writes its own
    shards (with a saver, in the background); torch: gather the full states
    on global rank 0 and write them there. Collective: every rank calls it."""
    if cfg.ckpt_format == "torch_dist":
        return save_dist_checkpoint(cfg, model, optimizer, scaler, iteration, consumed_samples, log, saver)
    model_sd, optim_sd = states_for_writer(model, optimizer)
    rng = rng_state()  # collective too
    # under pipeline parallelism every stage's own streams too (dropout differs by stage)
    stages_rng = gather_stages(rng) if parallel.layout.pp_size > 1 else None

    def write():
        if model_sd is None:
            return
        state = {"model": model_sd, "optimizer": optim_sd, "scaler": scaler.state_dict() if scaler else None,
                 "iteration": iteration, "consumed_samples": consumed_samples, "rng": rng,
                 "pipeline_rng": stages_rng,
                 "config": dataclasses.asdict(cfg), "model_config": dataclasses.asdict(model.config)}
        log(f"saved checkpoint {write_plain_checkpoint(cfg.save, state)}")
        remove_old_checkpoints(cfg.save, iteration, cfg.keep_last_checkpoints, log)

    on_every_rank(write, f"saving checkpoint {iteration} to {cfg.save}", directory=cfg.save)


@dataclasses.dataclass
class Found:
    """A checkpoint in a --load directory."""
    kind: str | None  # "plain" (train.py's own), "torch_dist", "deepspeed", or None: named, not there
    iteration: int
    path: str       # its directory, SAVE/iter_0000100


def latest_checkpoint(load_dir: str) -> Found | None:
    """The latest checkpoint in load_dir, of either kind, or None (nothing of
    a checkpoint there). Either pointer may name it (DeepSpeed's alone:
    copied by hand, say); if they differ (a crash between a DeepSpeed save's
    two pointer writes) the newer wins. With neither (checkpoints copied
    without one, a first save cut short before it) the newest iter_N is it.
    The kind is what the directory holds, not the pointer's, and the
    iteration the one its name says (damage holds a checkpoint to it).
    Either pointer naming a checkpoint that is gone gives way (damage, then
    older_checkpoint); one naming anything but a checkpoint of load_dir stops."""
    what_is_there(load_dir)
    named = []
    if os.path.exists(os.path.join(load_dir, LATEST)):
        text = pointer_text(os.path.join(load_dir, LATEST))
        if text == "release":
            raise UsageError(f"{os.path.join(load_dir, LATEST)} names Megatron's release/ directory, a "
                             f"layout train.py does not read (one file per model-parallel rank, its names)")
        if not (text.isascii() and text.isdigit()):  # a damaged file
            raise UsageError(f"{os.path.join(load_dir, LATEST)} holds {text[:40]!r}, not an iteration number: "
                             f"write the iteration to load into it, or delete it to load the newest iter_N there")
        named.append((int(text), checkpoint_dir(load_dir, f"iter_{int(text):07d}"), LATEST))
    if os.path.exists(os.path.join(load_dir, DS_LATEST)):  # the same rules: a checkpoint of load_dir
        tag = pointer_text(os.path.join(load_dir, DS_LATEST))
        if iteration_of(tag) is None:
            raise UsageError(f"{os.path.join(load_dir, DS_LATEST)} holds {tag[:40]!r}, not the name of a "
                             f"checkpoint in {load_dir} (iter_NNNNNNN): write the one to load into it, or "
                             f"delete it to load the newest iter_N there")
        named.append((iteration_of(tag), checkpoint_dir(load_dir, tag), DS_LATEST))
    if not named and os.path.isdir(load_dir):
        named = [(i, os.path.join(load_dir, f"iter_{i:07d}"), None) for i in saved_iterations(load_dir)[-1:]]
    if not named:
        return None
    iteration, path, pointer = max(named, key=lambda n: n[0])
    return Found(kind_of(path), iteration, path)  # kind None: named, but incomplete or gone (see damage)


def pointer_text(path: str) -> str:
    """What a pointer file says (its first bytes: an iteration, a tag); bytes
    that are not UTF-8 come out as U+FFFD, which no pointer holds."""
    with regular_file(path, follow=True) as (f, _):
        return f.read(200).decode("utf-8", "replace").strip()


def what_is_there(load_dir: str) -> None:
    """--load takes the directory --save wrote: one line for what else it was given."""
    if os.path.isfile(load_dir):
        raise UsageError(f"{load_dir} is a file, not a checkpoint directory: give the directory that "
                         f"holds {LATEST} (the one train.py's --save wrote)")
    if kind_of(load_dir):
        raise UsageError(f"{load_dir} is one checkpoint's own directory: give the directory above it, "
                         f"{os.path.dirname(os.path.abspath(load_dir))} (the one --save wrote; its {LATEST} "
                         f"names the iteration that loads)")
    if is_hf_directory(load_dir):
        raise UsageError(f"{load_dir} is a Hugging Face model directory, not a train.py checkpoint: "
                         f"evaluate.py reads it with --hf, and train.py --export-from {load_dir} --export-to "
                         f"DIR makes one that --load DIR --finetune trains from")


def check_writable_directory(path: str, flag: str) -> None:
    """--save (or --export-to) checked before any work, as --load is: a path
    that is a file, lies under one, or that this user cannot write would
    otherwise fail at the first write, for --save a save interval of compute
    later, with a traceback. Nothing is created here."""
    there = os.path.abspath(path)
    while not os.path.lexists(there):  # the deepest part of the path that is there
        there = os.path.dirname(there)
    if not os.path.isdir(there):
        what = "a file" if os.path.isfile(there) else "not a directory"
        where = f"is {what}" if there == os.path.abspath(path) else f"lies under {there}, {what}"
        raise UsageError(f"{flag} {path} {where}: give a directory (one that is not there yet is made)")
    if not os.access(there, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: this user cannot write {there}: give a directory it can write")


def kind_of(path: str) -> str | None:
    return next((kind for kind, marker in MARKERS if os.path.exists(os.path.join(path, marker))), None)


def verified_checkpoint(load_dir: str, log) -> Found | None:
    """The newest intact checkpoint in load_dir, or None where it holds none.
    A damaged or incomplete one is reported in one line, and the next older
    is tried; with checkpoints there but none intact, an error names the
    damage (a run never silently starts from scratch)."""
    found, problems = latest_checkpoint(load_dir), []
    while found is not None:
        problem = damage(found)
        if problem is None:
            if problems:
                log(f"falling back to {found.path} (iteration {found.iteration}), the newest intact checkpoint")
            if not os.path.exists(os.path.join(found.path, DIGESTS)):  # loads, as before checksums, but said
                log(f"{found.path} has no {DIGESTS} (saved before checksums, or copied without them): "
                    f"its files are not verified, only checked for being cut short")
            return found
        log(f"checkpoint {found.path} cannot be loaded: {problem}")
        problems.append(f"{found.path}: {problem}")
        found = older_checkpoint(load_dir, found.iteration)
    if problems:
        raise UsageError(f"no intact checkpoint in {load_dir}: {'; '.join(problems)}")
    return None


def older_checkpoint(load_dir: str, before: int) -> Found | None:
    """The newest complete checkpoint of any kind below iteration `before`."""
    for iteration in reversed([i for i in saved_iterations(load_dir) if i < before]):
        path = os.path.join(load_dir, f"iter_{iteration:07d}")
        if kind := kind_of(path):
            return Found(kind, iteration, path)
    return None


def read_deepspeed_meta(tag_dir: str) -> dict:
    """trainer_state.json of a DeepSpeed checkpoint written by train.py; a
    UsageError naming it where it is not one (missing, cut short, damaged)."""
    path = os.path.join(tag_dir, DS_META)
    if not os.path.lexists(path):
        raise UsageError(f"{path} is missing: not a complete checkpoint written by train.py")
    with regular_file(path) as (f, size):
        meta = parse_json(f.read(size), path, ": cut short or damaged")
    if not isinstance(meta, dict) or type(meta.get("iteration")) is not int:
        raise UsageError(f"{path} records no iteration: not the {DS_META} train.py writes")
    return meta


def checkpoint_to_load(cfg: TrainConfig, log) -> Found | None:
    """The one decision about --load, plain or DeepSpeed: its checkpoint (None:
    start from scratch), refused where this run cannot take it. A full resume
    needs the run's own kind; weights_only runs take either kind, any layout."""
    if cfg.load:  # verifying and reading a large checkpoint takes a while: say when it starts
        log(f"loading --load {cfg.load}")
    found = verified_checkpoint(cfg.load, log) if cfg.load else None
    if found is None:
        if cfg.load:
            log(f"no checkpoint in {cfg.load}; starting from scratch")
        return None
    if weights_only(cfg) or (found.kind == "deepspeed") == cfg.deepspeed:
        check_same_model(cfg, saved_model_config(found), found.path)  # before a tensor is read
        return found
    if cfg.deepspeed:
        raise UsageError(f"--load {cfg.load} holds a plain train.py checkpoint: resume it without "
                         f"--deepspeed, or start DeepSpeed from its weights with --no-load-optim "
                         f"(fresh optimizer states) or --finetune (a new run)")
    raise UsageError(f"--load {cfg.load} holds a DeepSpeed checkpoint: resume it with --deepspeed "
                     f"(its layout), or start from its weights with --no-load-optim (fresh "
                     f"optimizer states) or --finetune (a new run)")


def weights_only(cfg: TrainConfig) -> bool:
    """--no-load-optim and --finetune load the weights alone."""
    return cfg.no_load_optim or cfg.finetune


# What a checkpoint's weights compute. Weights of the same shapes can load into
# another model (a --vocab-size of the same padding, another epsilon or RoPE
# base), so a resume or fine-tune checks these; the kernels, dropout,
# recomputation and the layout stay the run's own choice, and a fine-tune may
# change the RoPE base (as long-context fine-tunes do). Learned positions are
# weights too: their number (max_position_embeddings, which --seq-length sets
# by default) is checked for them alone.
ARCHITECTURE = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                "layernorm_epsilon", "position_embedding_type", "rotary_base", "rotary_percent",
                "normalization", "swiglu", "untie_embeddings_and_output_weights", "disable_bias_linear",
                "num_query_groups")


def check_same_model(cfg: TrainConfig, saved: dict | None, path: str) -> None:
    """One line if the run's model is not the one `saved` (a model_config) describes."""
    mine = dataclasses.asdict(model_config(cfg))
    keys = ARCHITECTURE + (("max_position_embeddings",) if mine["position_embedding_type"] == "learned_absolute"
                           else ())
    differ = [f"{k} {saved[k]} (this run: {mine[k]})" for k in keys
              if saved and k in saved and saved[k] != mine[k] and not (cfg.finetune and k == "rotary_base")]
    if differ:
        raise UsageError(f"checkpoint {path} is another model: {', '.join(differ)}; "
                         f"give this run the checkpoint's flags")


def saved_model_config(found: Found) -> dict | None:
    """The model_config a checkpoint of any kind records, read without its
    tensors (a plain file is mapped, mmap, and only its pickle read; a file
    in torch's pre-zip format, which cannot be mapped, is read whole)."""
    if found.kind == "deepspeed":
        return read_deepspeed_meta(found.path).get("model_config")
    if found.kind == "torch_dist":
        return read_dist(found.path, {}, no_dist=True)["model_config"]
    path = os.path.join(found.path, PLAIN_FILE)
    with data_only_loads(found.path):
        return torch.load(path, map_location="cpu", mmap=zipfile.is_zipfile(path)).get("model_config")


def saved_model(found: Found, **runtime) -> tuple[GPT, dict]:
    """The model a checkpoint of any kind holds, on the host, and the rest of
    its state (read_weights): its shape from the checkpoint's model_config,
    how it runs (`runtime`: kernels, dropout, ...) from the caller. evaluate.py
    and --export-from build it here."""
    weights, state = read_weights(found)
    model = GPT(checked_model_config(state["model_config"], weights, found.path, **runtime))
    model.load_full_state_dict(weights)
    return model, state


def checked_model_config(record: dict, weights: dict, path: str, **runtime) -> GPTConfig:
    """The GPTConfig of a checkpoint's model_config `record`, once it is known
    to describe the stored `weights`: a record that claims another shape
    (damaged, edited: hidden_size 2**20 would ask for 211 GB) is one line, not
    a model of the claimed size. Its shapes come from a model built on the meta
    device (no memory), whole as a tp=1 checkpoint stores it, after the layer
    count (10**9 layers would be as many modules, even there)."""
    unknown = sorted(set(record) - {f.name for f in dataclasses.fields(GPTConfig)})
    if unknown:
        raise UsageError(f"checkpoint {path}: its model_config has {', '.join(unknown)}, which this version "
                         f"does not know: it was written by a newer train.py; read it with that version")
    mcfg = GPTConfig(**{**record, **runtime})
    layers = len({key.split(".")[1] for key in weights if key.startswith("blocks.")})
    if mcfg.num_layers != layers:
        raise UsageError(f"checkpoint {path}: its model_config says num_layers {mcfg.num_layers}, its "
                         f"tensors hold {layers} layers: the checkpoint is damaged or was edited")
    whole, parallel.layout = parallel.layout, parallel.Layout(initialized=True)
    try:
        with torch.device("meta"):
            claimed = {key: tuple(t.shape) for key, t in GPT(mcfg).state_dict().items()}
    finally:
        parallel.layout = whole
    stored = {key: tuple(t.shape) for key, t in weights.items()}
    for key in [*claimed, *(key for key in stored if key not in claimed)]:
        if claimed.get(key) != stored.get(key):
            there, said = ("absent" if s is None else f"of shape {s}" for s in (stored.get(key), claimed.get(key)))
            raise UsageError(f"checkpoint {path}: its model_config does not describe its tensors: {key} is "
                             f"{there} there, {said} by the model_config (the checkpoint is damaged or was "
                             f"edited)")
    return mcfg


@dataclasses.dataclass(frozen=True)
class Start:
    """Where a run starts: after `iteration` and `consumed` samples of the
    checkpoint at `path` (None: a fresh start, or --finetune), whose run's
    flags were `config` (its TrainConfig as a dict; None if it records none).
    train.schedule_to_follow decides which learning-rate schedule goes on."""
    iteration: int = 0
    consumed: int = 0
    path: str | None = None
    config: dict | None = None


def start_position(cfg: TrainConfig, state: dict, path: str, log) -> Start:
    """Where the run continues from, once `state` is loaded
    (checkpoint_to_load showed it is this run's model); restores its RNG
    unless told not to. --finetune starts a new run at zero."""
    if cfg.finetune:
        log(f"--finetune: loaded the weights of {path} (iteration {state['iteration']}); "
            f"starting at iteration 0")
        return Start()
    named = iteration_of(os.path.basename(path).removesuffix(".old"))
    if named is not None and named != state["iteration"]:  # it was chosen by its name (latest_checkpoint)
        raise UsageError(f"checkpoint {path} holds the state of iteration {state['iteration']}, not of "
                         f"{named}: renamed or damaged; give it its own name, or remove it to load the one before")
    if not cfg.no_load_rng and state.get("rng"):
        set_rng_state(stage_rng(state, log), log)
    log(f"loaded checkpoint {path} (iteration {state['iteration']}"
        f"{', weights only' if cfg.no_load_optim else ''})")
    return Start(state["iteration"], state["consumed_samples"], path, state.get("config"))


def stage_rng(state: dict, log) -> dict:
    """This pipeline stage's saved random streams: its own where the
    checkpoint has one per stage at this pipeline size, else the first's."""
    stages = state.get("pipeline_rng") or [state["rng"]]
    if len(stages) == parallel.layout.pp_size:
        return stages[parallel.layout.pp_rank]
    if parallel.layout.pp_size > 1:
        log(f"the random streams were saved at pipeline size {len(stages)}: every stage starts "
            f"from the first stage's")
    return stages[0]


def load_checkpoint(cfg: TrainConfig, model: GPT, optimizer, scaler, log):
    """Restore everything (or, weights_only, the weights); returns
    start_position's Start (a fresh one if --load holds no checkpoint)."""
    found = checkpoint_to_load(cfg, log)
    if found is None:
        return Start()
    if found.kind == "torch_dist":
        return load_dist_checkpoint(cfg, model, optimizer, scaler, found, log)
    weights, state = read_weights(found)
    if state.get("optimizer") is None and not weights_only(cfg):
        raise UsageError(f"--load {cfg.load} holds weights only (an --export-to plain export): "
                         f"add --no-load-optim to start fresh optimizer states from it")
    model.load_full_state_dict(weights)
    if not weights_only(cfg):
        load_full_optimizer_state(model, optimizer, state["optimizer"])
        if scaler and state["scaler"]:
            scaler.load_state_dict(state["scaler"])
    return start_position(cfg, state, found.path, log)


def read_weights(found: Found) -> tuple[dict, dict]:
    """(full fp32 weights, the rest: iteration, consumed_samples, rng, config,
    model_config, and a plain one's optimizer and scaler) of a checkpoint of
    any kind, any ZeRO stage and TP size. Needs no process group."""
    if found.kind == "torch_dist":
        return read_dist_weights(found.path)
    with data_only_loads(found.path):
        if found.kind == "plain":
            state = torch.load(os.path.join(found.path, PLAIN_FILE), map_location="cpu")
            return state.pop("model"), state
        weights, meta = consolidated_weights(found.path)
        client = torch.load(glob.glob(os.path.join(found.path, "*mp_rank_00_model_states.pt"))[0],
                            map_location="cpu")
    return weights, {"iteration": meta["iteration"], "consumed_samples": meta["consumed_samples"],
                     "rng": client["rng"], "config": client["config"],
                     "model_config": meta["model_config"]}


# torch.load unpickles, and a pickle may name any function for the reader to call:
# a downloaded checkpoint could run a command on every rank that reads it. So
# every checkpoint file is read as weights_only: tensors, numbers, strings and
# containers, plus the few types below, which rebuild data and call nothing else.
# DeepSpeed's own reads (engine.load_checkpoint, zero_to_fp32) pass
# weights_only=False; torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD overrides that.

# A file of another pickle protocol than torch.save's is refused in one line, without torch's warning too.
warnings.filterwarnings("ignore", "Detected pickle protocol")


def _data_types(deepspeed: bool) -> list:
    """numpy's ndarray, for np.random's state in every checkpoint's "rng"; with
    `deepspeed`, DeepSpeed's enum, loss scalers and fragment addresses, in its
    optimizer files (a plain or torch_dist load imports no DeepSpeed)."""
    rebuild = np.zeros(0).__reduce__()[0]  # numpy's array reconstructor, under both its module names:
    types = [np.ndarray, np.dtype, type(np.dtype(np.uint32)),  # the state's key array is uint32
             (rebuild, "numpy._core.multiarray._reconstruct"),  # numpy 2
             (rebuild, "numpy.core.multiarray._reconstruct")]  # numpy 1's checkpoints
    if not deepspeed:
        return types
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
        types += [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]
    except ImportError:  # no DeepSpeed here: no file needs its types
        pass
    return types


@contextlib.contextmanager
def data_only_loads(where: str):
    """Every torch.load inside, DeepSpeed's included, reads data only
    (weights_only=True). A file that holds anything else is not read: one
    line names it and what it holds."""
    force, before = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ[force] = "1"
    try:
        with torch.serialization.safe_globals(_data_types(kind_of(where) == "deepspeed")):
            try:
                yield
            except pickle.UnpicklingError as e:
                raise UsageError(_code_in_files(where, e)) from None
    finally:
        if before is None:
            del os.environ[force]
        else:
            os.environ[force] = before


def named_files(directory: str, names, index: str, links: bool = False) -> list[str]:
    """directory/name of each name a checkpoint's own index (DCP's .metadata,
    a Hugging Face weight map) gives: only a plain file of the directory
    (plain_file_problem: no directory part, no link, FIFO or device) and,
    where the directory has digests, one they list (so verified before it is
    read); anything else would have a checkpoint read whatever file it chose.
    `links`: a link to a regular file is read too (a Hugging Face cache's
    snapshot is links into its blobs/, as transformers reads them)."""
    listed = listed_digests(directory) if os.path.exists(os.path.join(directory, DIGESTS)) else None
    paths = {}
    for name in names:
        if isinstance(name, str) and name in paths:  # DCP's index names each file many times
            continue
        problem = plain_file_problem(directory, name) if isinstance(name, str) else f"{name!r} is not a file name"
        if problem and links and os.path.islink(os.path.join(directory, name)) and \
                os.path.isfile(os.path.join(directory, name)):
            problem = None
        if problem is None and listed is not None and name not in listed:
            problem = f"{name} is not one of the files its {DIGESTS} lists"
        if problem:
            raise UsageError(f"refusing to read the checkpoint in {directory}: {index} names {name!r}, not one of "
                             f"its own files ({problem}). Load checkpoints only from a source you trust")
        paths[name] = os.path.join(directory, name)
    return list(paths.values())


def _code_in_files(where: str, error: pickle.UnpicklingError) -> str:
    """Which files under `where` hold more than data, found without unpickling
    them (a static scan); else what the unpickler refused."""
    shown = "; ".join(f"{f} holds {', '.join(found)}" for f, found in _pickles_in(where, error) if found)
    if not shown:
        reason = [line for line in str(error).splitlines() if "global" in line.lower() or "got <" in line]
        shown = f"a file there holds {(reason or ['more than data'])[0].strip()}"
    return (f"refusing to read the checkpoint in {where}: {shown}, not data (tensors, numbers, "
            f"containers); a file like that can run code when it is read. Load checkpoints only "
            f"from a source you trust")


def _pickles_in(where: str, error: pickle.UnpicklingError):
    """(a pickle's name, the globals in it that weights_only refuses) for each
    pickle a load reads under `where`: its .pt files, or a torch_dist
    checkpoint's non-tensors, each a torch.save zip within a .distcp file
    (unless the refusal was of its index, .metadata, itself)."""
    if kind_of(where) != "torch_dist":
        for path in sorted(glob.glob(os.path.join(where, "*.pt"))) if os.path.isdir(where) else [where]:
            with open(path, "rb") as f:
                yield path, _unsafe_globals(f)
    elif DIST_METADATA not in str(error):
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata
        metadata = dist_reader(where).read_metadata()
        for index, info in metadata.storage_data.items():
            if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                with open(os.path.join(where, info.relative_path), "rb") as f:
                    f.seek(info.offset)
                    piece = io.BytesIO(f.read(info.length))
                yield f"{os.path.join(where, info.relative_path)} (its {index.fqn})", _unsafe_globals(piece)


def _unsafe_globals(f) -> list[str]:
    """The globals in a file torch.load reads (f: open, binary) that weights_only
    refuses, read statically: torch's own scan of a torch.save zip, else of
    the pickles of torch's legacy (pre-zip) format or a raw pickle, against
    the same allow-list."""
    zipped = zipfile.is_zipfile(f)
    f.seek(0)
    if zipped:
        return torch.serialization.get_unsafe_globals_in_checkpoint(f)
    from torch._weights_only_unpickler import _get_allowed_globals, _get_user_allowed_globals
    return sorted(_pickle_globals(f) - set(_get_allowed_globals()) - set(_get_user_allowed_globals()))


def _pickle_globals(f) -> set[str]:
    """Every module.name the pickles at the start of a file (f: open, binary)
    name (torch's legacy format is five pickles, then raw bytes; a raw pickle
    is one), by reading their opcodes: a protocol 4 global takes the two
    strings last pushed or fetched from the memo."""
    found, strings, memo, top = set(), [], {}, None
    for _ in range(5):
        try:
            for op, arg, _ in pickletools.genops(f):
                if op.name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
                    memo[len(memo) if arg is None else arg] = top
                    continue
                if op.name in ("GET", "BINGET", "LONG_BINGET"):
                    arg = memo.get(arg)
                if op.name == "GLOBAL":
                    found.add(arg.replace(" ", "."))
                elif op.name == "STACK_GLOBAL":
                    found.add(".".join(strings[-2:]))
                top = arg if isinstance(arg, str) and op.name != "GLOBAL" else None
                if top is not None:
                    strings.append(top)
        except ValueError:  # past the pickles: the raw bytes of tensors, or the end
            break
    return found


# --ckpt-format torch_dist: the states above under the same names, flat
# ("model.NAME", "optimizer.NAME.exp_avg", ...), written through
# torch.distributed.checkpoint (DCP): each rank writes the pieces it holds,
# each piece once (DCP's planner drops the copies other data-parallel replicas
# or stages hold), and a load reads, of every saved piece, the part that
# overlaps what this rank holds: resharding to any layout, with nothing whole
# anywhere. The non-tensors (iteration, config, ...) are written by rank 0;
# each stage's random streams are a byte tensor its first rank writes.

# DCP, and the ShardedTensor it saves, take about a second to import (DTensor's
# operator tables), paid by every rank at every launch; only torch_dist needs
# them, so the functions below import them when they run.

# DCP warns whenever it runs in one process; read_dist and a one-process save ask for that.
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
AS_THEY_ARE = dict(flatten_state_dict=False, flatten_sharded_tensors=False)  # our state is flat already


def as_shards(param, t: torch.Tensor) -> torch.Tensor:
    """`t` (a parameter, or optimizer state shaped like it) as DCP sees it:
    a tensor of the full shape. A TP shard becomes a ShardedTensor of the
    pieces it is, at their places in the full tensor: one for a plain split,
    one a block for a fused one ([Q_r | K_r | V_r] of [Q | K | V]: no
    DTensor placement describes that). Its pieces are views of t, so a load
    writes straight into the parameter or state."""
    if not getattr(param, "tensor_model_parallel", False) or parallel.layout.tp_size == 1:
        return t
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    dim, tp, group = param.partition_dim, parallel.layout.tp_size, parallel.layout.tp_group
    full = list(t.shape)
    full[dim] *= tp
    mine, everyone = [], []
    for r in range(tp):
        for start, local, length in parallel.shard_pieces(full[dim], param.partition_blocks, r, tp):
            offsets, sizes = [0] * t.dim(), list(t.shape)
            offsets[dim], sizes[dim] = start, length
            piece = ShardMetadata(offsets, sizes, f"rank:{dist.get_global_rank(group, r)}/{t.device}")
            everyone.append(piece)
            if r == parallel.layout.tp_rank:
                mine.append(Shard(t.narrow(dim, local, length), piece))
    properties = TensorProperties(dtype=t.dtype, layout=t.layout, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        mine, ShardedTensorMetadata(everyone, torch.Size(full), properties))


def dist_model_state(model: GPT) -> dict:
    params = dict(model.named_parameters())
    return {f"model.{name}": as_shards(params.get(name), t) for name, t in model.state_dict().items()}


def save_dist_checkpoint(cfg: TrainConfig, model: GPT, optimizer, scaler, iteration: int,
                         consumed_samples: int, log, saver: AsyncSave | None = None) -> None:
    """--ckpt-format torch_dist: every rank writes its own shards (dcp.save,
    collective), rank 0 publishes (write_every_rank). Nothing is gathered.
    With a saver (--async-save) the loop waits only for a host copy of the
    state, and all that runs in the background."""
    import torch.distributed.checkpoint as dcp
    params, state, like = dict(model.named_parameters()), {}, {}  # like: the parameter a tensor is shaped like
    for name, t in model.state_dict().items():
        state[f"model.{name}"], like[f"model.{name}"] = t, params.get(name)
    for name, p in params.items():
        for k, v in optimizer.state.get(p, {}).items():
            state[f"optimizer.{name}.{k}"], like[f"optimizer.{name}.{k}"] = v, p if v.shape == p.shape else None
    rng = rng_state()  # collective over TP
    if parallel.layout.tp_rank == 0 and parallel.layout.dp_rank == 0:
        buffer = io.BytesIO()
        torch.save(rng, buffer)
        state[f"rng.stage{parallel.layout.pp_rank}"] = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    state.update({"optimizer.param_groups": optimizer.state_dict()["param_groups"],
                  "scaler": scaler.state_dict() if scaler else None, "iteration": iteration,
                  "consumed_samples": consumed_samples, "config": dataclasses.asdict(cfg),
                  "model_config": dataclasses.asdict(model.config)})

    def write(state: dict, group=None) -> None:
        # TP shards as ShardedTensors from here on, of the host copy if staged (DCP's stager copies none)
        shards = {key: as_shards(like.get(key), v) for key, v in state.items()}
        write_every_rank(cfg, "torch_dist", iteration, lambda tmp: dcp_save(shards, tmp, group), log, group=group)

    def dcp_save(shards: dict, tmp: str, group) -> None:
        from torch.distributed.checkpoint.api import CheckpointException
        try:
            dcp.save(shards, storage_writer=dcp.FileSystemWriter(tmp), planner=dcp.DefaultSavePlanner(**AS_THEY_ARE),
                     process_group=group, no_dist=not dist.is_initialized())
        except CheckpointException as e:  # a BaseException (on_every_rank's vote would miss it) whose text is
            # every failed rank's traceback: a failed rank raises its own failure; the others return, and
            # the vote stops them with one line naming the rank that failed
            rank = dist.get_rank(group) if dist.is_initialized() else 0
            if rank in e.failures:
                raise e.failures[rank][0] from e

    if saver is None:
        return write(state)
    saver.start(state, write)
    log(f"staged checkpoint {iteration} in host memory; writing it to {cfg.save} in the background")


class AsyncSave:
    """--async-save: the loop waits only while DCP's stager copies the state
    to host memory (a copy even of CPU tensors, which training's in-place
    updates leave alone; it keeps each tensor's copy for the next save, which
    then copies into memory already in place); a thread then writes, hashes
    and publishes that copy (write_every_rank) as training goes on.
    One write is in flight at a time: the next save and the end of the run
    (a stop or an error included) wait for it, and raise its error. Its
    collectives, DCP's and ours, run on a gloo group of its own, so they
    never interleave with the training's on one communicator. Every rank
    creates it at the same point (new_group is collective).

    The host copy itself is first made in the background after the first
    optimizer step (when AdamW's moments exist), so the first save, like
    every later one, copies into memory already in place: memory touched for
    the first time is several times slower to fill (bench/RESULTS.md)."""

    def __init__(self, timeout, optimizer):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        self.group = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        if self.group is not None:  # every rank has joined it (see launch.init_distributed), on NCCL runs too
            dist.barrier(group=self.group)
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=False))
        self.pending = None  # the write (or the first copy) in flight: a Future
        self.first_step = optimizer.register_step_post_hook(self._make_host_copy)  # removed by start()

    def _make_host_copy(self, optimizer, args, kwargs) -> None:
        """Once, after the first step: stage the parameters and optimizer states
        in the background (what is copied does not matter; the copy's memory
        stays in the stager for every save). Only a head start: if it fails,
        the first save makes the copy, and meets the error, itself."""
        if self.pending is not None:  # made already (or a save came first)
            return
        tensors = [p for group in optimizer.param_groups for p in group["params"]]
        tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        self._in_background(self._stage_quietly, dict(enumerate(tensors)))

    def _stage_quietly(self, tensors: dict) -> None:
        try:
            self.stager.stage(tensors)
        except Exception:  # e.g. out of host memory: the first save will say so
            pass

    def start(self, state: dict, write) -> None:
        """write(a host copy of state, group) in the background, once the previous write is done."""
        self.wait()
        if self.first_step is not None:  # no head start needed any more
            self.first_step.remove()
            self.first_step = None
        self._in_background(write, self.stager.stage(state), self.group)

    def _in_background(self, fn, *args) -> None:
        """fn(*args) on a thread of its own, on this rank's GPU (a new thread's is GPU 0)."""
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def run():
            if device is not None:
                torch.cuda.set_device(device)
            return fn(*args)
        thread = ThreadPoolExecutor(1, thread_name_prefix="async-save")
        self.pending = thread.submit(run)
        thread.shutdown(wait=False)  # its one thread ends with fn

    def wait(self, report: bool = True) -> None:
        """Until the write in flight is done. A failed write raises here
        (on_every_rank's one line), unless not `report`."""
        pending, self.pending = self.pending, None
        if pending is not None:
            try:
                pending.result()
            except BaseException:
                if report:
                    raise

    def close(self) -> None:
        """Once the last write is done: the host copy and the group go."""
        self.wait()
        self.stager.close()
        if self.group is not None:
            dist.destroy_process_group(self.group)


def load_dist_checkpoint(cfg: TrainConfig, model: GPT, optimizer, scaler, found: Found, log):
    """Resume from a torch_dist checkpoint of any layout: each rank reads
    its own shards, into its parameters and new optimizer states."""
    saved = read_dist_metadata(found.path).state_dict_metadata
    state, optim = dist_model_state(model), {}
    for name, p in model.named_parameters() if not weights_only(cfg) else ():
        optim[name] = {}
        for key in (key for key in saved if key.startswith(f"optimizer.{name}.")):
            dtype, size = saved[key].properties.dtype, saved[key].size
            if len(size) == p.dim():  # shaped like p: p's shard of it
                optim[name][key.rsplit(".", 1)[1]] = t = torch.empty(p.shape, dtype=dtype, device=p.device)
                state[key] = as_shards(p, t)
            else:
                optim[name][key.rsplit(".", 1)[1]] = state[key] = torch.empty(size, dtype=dtype)
    if optim:
        state.update({"optimizer.param_groups": None, "scaler": None})
    state = read_dist(found.path, state)
    if optim:
        load_full_optimizer_state(model, optimizer, {"state": optim, "param_groups": state["optimizer.param_groups"]},
                                  shard_like=lambda p, v: v)
        if scaler and state["scaler"]:
            scaler.load_state_dict(state["scaler"])
    return start_position(cfg, state, found.path, log)


def read_dist_weights(path: str) -> tuple[dict, dict]:
    """read_weights of a torch_dist checkpoint: every tensor of "model." whole."""
    saved = read_dist_metadata(path).state_dict_metadata
    state = read_dist(path, {key: torch.empty(md.size, dtype=md.properties.dtype)
                             for key, md in saved.items() if key.startswith("model.")}, no_dist=True)
    return {key[len("model."):]: t for key, t in state.items() if key.startswith("model.")}, state


def read_dist(path: str, state: dict, no_dist: bool = False) -> dict:
    """`state` (name: this rank's tensor, or None for a non-tensor) read from
    the torch_dist checkpoint at path, with the iteration, consumed samples,
    configs and every stage's random streams ("rng", "pipeline_rng")."""
    import torch.distributed.checkpoint as dcp
    saved = read_dist_metadata(path).state_dict_metadata
    missing = sorted(set(state) - set(saved))
    if missing:
        raise UsageError(f"{path} has no {', '.join(missing[:3])}: a checkpoint of another model")
    ours = ("iteration", "consumed_samples", "config", "model_config", "rng.stage0")  # what train.py writes
    if missing := [key for key in ours if key not in saved]:
        raise UsageError(f"{path} has no {', '.join(missing)}: a torch_dist checkpoint, but not one train.py wrote")
    stages = sorted((key for key in saved if key.startswith("rng.stage")), key=lambda k: int(k[9:]))
    state.update({key: torch.empty(saved[key].size, dtype=torch.uint8) for key in stages})
    state.update(dict.fromkeys(ours[:4]))
    with data_only_loads(path):
        try:
            dcp.load(state, storage_reader=dist_reader(path), planner=dcp.DefaultLoadPlanner(**AS_THEY_ARE),
                     no_dist=no_dist or not dist.is_initialized())
        except dcp.api.CheckpointException as e:  # DCP wraps each rank's error; a refusal is data_only_loads' line
            refused = [exc for exc, _ in e.failures.values() if isinstance(exc, (pickle.UnpicklingError, UsageError))]
            raise (refused or [e])[0] from None
        state["pipeline_rng"] = [torch.load(io.BytesIO(state[key].numpy().tobytes())) for key in stages]
    state["rng"] = state["pipeline_rng"][0]
    return state


def dist_reader(path: str):
    """DCP's reader, but its index (DIST_METADATA, a pickle) is read with
    only DCP's metadata classes and torch's dtypes allowed: a torch_dist
    checkpoint never runs code from its files either (see data_only_loads)."""
    import torch.distributed.checkpoint as dcp
    reader = dcp.FileSystemReader(path)

    def read_metadata(*args, **kwargs):
        with open(os.path.join(path, DIST_METADATA), "rb") as f:
            metadata = DistMetadataUnpickler(f).load()
        named_files(path, (info.relative_path for info in metadata.storage_data.values()),
                    os.path.join(path, DIST_METADATA))  # before DCP opens any of them
        metadata.storage_meta = metadata.storage_meta or dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = reader.load_id
        return metadata
    reader.read_metadata = read_metadata  # in place of DCP's unpickling of the index
    return reader


class DistMetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes (dataclasses and enums), torch's dtypes, and the
    few helpers its pickle names; any other global is refused before it is
    looked up: finding a global imports its module, which runs its code."""
    ALSO = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}
    DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")

    def find_class(self, module: str, name: str):
        if (module, name) in dcp_metadata_globals():
            return super().find_class(module, name)  # a module imported already
        raise pickle.UnpicklingError(f"the global {module}.{name} in {DIST_METADATA}")


@functools.cache
def dcp_metadata_globals() -> frozenset:
    """What DistMetadataUnpickler allows, as (module, name): read off this
    torch's DCP modules, so the list follows torch's versions."""
    allowed = set(DistMetadataUnpickler.ALSO)
    allowed |= {("torch", n) for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
    for module in DistMetadataUnpickler.DCP_MODULES:
        for n, v in vars(importlib.import_module(module)).items():
            if isinstance(v, type) and v.__module__ == module and (
                    dataclasses.is_dataclass(v) or issubclass(v, enum.Enum)):
                allowed.add((module, n))
    return frozenset(allowed)


def read_dist_metadata(path: str):
    with data_only_loads(path):
        return dist_reader(path).read_metadata()


# ----------------------------------------------------------------------------
# 2. DeepSpeed's checkpoints (--deepspeed), and weight export from either kind
# ----------------------------------------------------------------------------

def save_deepspeed_checkpoint(cfg: TrainConfig, engine, iteration: int, consumed: int,
                              log) -> None:
    """engine.save_checkpoint under a temporary tag, published (publish) by
    rank 0 once every rank has written."""
    client_state = {"iteration": iteration, "consumed_samples": consumed, "rng": rng_state(),
                    "config": dataclasses.asdict(cfg)}
    if parallel.layout.tp_size == 1 and parallel.layout.pp_size == 1:
        # For ds_to_universal: at tp=1 nothing is split, and the version says so. At tp > 1 the
        # strided QKV split has no description, so it refuses the checkpoint rather than merge QKV
        # wrongly (and at pp > 1 its "model-parallel" files are stages, which it would merge as shards).
        client_state["universal_checkpoint_info"] = {"universal_checkpoint_version": 0.2}
    # what an export needs to merge the shards of any tp: every stage's, on the first (rank 0 writes it)
    layout = {name: [p.partition_dim, p.partition_blocks] for name, p in engine.module.named_parameters()
              if getattr(p, "tensor_model_parallel", False)}
    if parallel.layout.pp_size > 1:
        layout = {k: v for stage in gather_stages(layout) or [] for k, v in stage.items()}
    meta = {"iteration": iteration, "consumed_samples": consumed,
            "zero_stage": engine.zero_optimization_stage(), "data_parallel_size": parallel.layout.dp_size,
            "tensor_model_parallel_size": parallel.layout.tp_size,
            "pipeline_model_parallel_size": parallel.layout.pp_size,
            "model_config": dataclasses.asdict(engine.module.config),
            "tensor_parallel_layout": layout}

    def write_meta(tmp):
        text = json.dumps(meta, indent=1)
        atomic_write(os.path.join(tmp, DS_META), lambda f: f.write(text.encode()))
        return [DS_META]

    write_every_rank(cfg, "deepspeed", iteration, lambda tmp: engine.save_checkpoint(
        cfg.save, tag=os.path.basename(tmp), client_state=client_state, save_latest=False), log, write_meta)


def load_deepspeed_checkpoint(cfg: TrainConfig, engine, found: Found, log) -> Start:
    """Resume everything from the DeepSpeed checkpoint `found`, written with
    this run's layout. (Weights only, from any checkpoint: zero.DeepSpeedTraining.)"""
    meta = read_deepspeed_meta(found.path)
    layout = {"data-parallel": (meta["data_parallel_size"], parallel.layout.dp_size),
              "tensor-parallel": (meta["tensor_model_parallel_size"], parallel.layout.tp_size),
              "pipeline-parallel": (meta.get("pipeline_model_parallel_size", 1), parallel.layout.pp_size)}
    for name, (saved, now) in layout.items():
        if saved != now and (name != "data-parallel" or meta["zero_stage"] > 0):
            raise UsageError(
                f"{found.path} was written with {name} size {saved}, this run has {now}: ZeRO, "
                f"tensor- and pipeline-parallel shards only fit the layout they were written with. Relaunch with "
                f"the old layout, or continue from its weights with fresh optimizer states "
                f"(add --no-load-optim: any layout loads them)")
    with data_only_loads(found.path):
        _, client = engine.load_checkpoint(os.path.dirname(found.path), tag=os.path.basename(found.path),
                                           load_optimizer_states=True, load_lr_scheduler_states=False)
    # Each stage read its own model-parallel file: its "rng" is this stage's own streams.
    client["pipeline_rng"] = [client["rng"]] * parallel.layout.pp_size
    return start_position(cfg, client, found.path, log)


def consolidated_weights(tag_dir: str) -> tuple[dict, dict]:
    """Full fp32 weights and trainer_state of the DeepSpeed checkpoint in
    tag_dir, any ZeRO stage, tp and pp, no process group. Its model-parallel
    rank mp = pp_rank * tp + tp_rank names each stage's TP shard's files
    (zero.DeepSpeedMPU). zero_to_fp32 merges one mp rank's DP partitions at a
    time (it refuses several), so each rank's files are shown to it alone;
    stage 0 has none. Then each stage's TP shards merge, and the stages' pieces
    join (the first stage's tied embedding, the last's copy being the same)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    meta = read_deepspeed_meta(tag_dir)
    tp, layout = meta["tensor_model_parallel_size"], meta["tensor_parallel_layout"]
    full = {}
    for stage in range(meta.get("pipeline_model_parallel_size", 1)):
        shards = []
        for r in range(stage * tp, (stage + 1) * tp):
            files = sorted(glob.glob(os.path.join(tag_dir, f"*mp_rank_{r:02d}_*.pt")))
            if meta["zero_stage"] == 0:
                shards.append(stage0_master_weights(torch.load(files[0], map_location="cpu")))
                continue
            with tempfile.TemporaryDirectory() as tmp:
                os.makedirs(os.path.join(tmp, "rank"))
                for f in files:
                    os.symlink(os.path.abspath(f), os.path.join(tmp, "rank", os.path.basename(f)))
                shards.append(get_fp32_state_dict_from_zero_checkpoint(tmp, tag="rank"))
        for name, t in shards[0].items():
            if name not in full:
                full[name] = parallel.merge_shards([s[name] for s in shards], *layout[name]) \
                    if name in layout else t
    return full, meta


def stage0_master_weights(model_states: dict) -> dict:
    """The fp32 weights of one stage-0 model-states file: the module's, or
    under --bf16/--fp16 (16-bit module) the optimizer's fp32_groups, one list
    per param group in build_optimizer's order (matrices, then vectors)."""
    module = model_states["module"]
    groups = (model_states.get("optimizer") or {}).get("fp32_groups")
    if groups is None:
        return {name: t.float() for name, t in module.items()}
    names = [[n for n, t in module.items() if t.dim() >= 2], [n for n, t in module.items() if t.dim() < 2]]
    masters = {}
    for group_names, tensors in zip(names, groups, strict=True):
        for name, t in zip(group_names, tensors, strict=True):
            if t.shape != module[name].shape:
                raise UsageError(f"stage-0 checkpoint: fp32 master of {name} has shape "
                                 f"{tuple(t.shape)}, the module's {tuple(module[name].shape)}")
            masters[name] = t
    return masters


def export_weights(checkpoint: str, out: str, fmt: str = "plain") -> None:
    """Write the consolidated fp32 weights of a checkpoint of either kind, or
    of a Hugging Face directory (Hugging Face in: a fine-tune's start), as
    fmt="plain": a weights-only plain checkpoint, one file in the torch format
                 whichever format it reads (what a user hands on; resume it with
                 --load OUT --no-load-optim, or --finetune, any layout, with or
                 without --deepspeed);
    fmt="hf":    a Hugging Face GPT-2 or Llama directory (to_hf)."""
    if parallel.layout.tp_size > 1:
        raise RuntimeError("export_weights builds a tp=1 model: call it outside a tensor-parallel job")
    check_export_target(out, fmt)
    hf_source = checkpoint if is_hf_directory(checkpoint) else None
    if hf_source:
        model, state = from_hf(checkpoint), {"iteration": 0, "consumed_samples": 0, "rng": None, "config": None}
    else:
        found = verified_checkpoint(checkpoint, print)
        if found is None:
            raise UsageError(f"--export-from {checkpoint}: no checkpoint there (neither train.py's "
                             f"{LATEST} nor DeepSpeed's {DS_LATEST})")
        model, state = saved_model(found)  # tp=1, on CPU
    if fmt == "hf":
        to_hf(model, out)
        write_hf_tokenizer(out, model.config, state["config"], hf_source)
        return
    state.update(model=model.full_state_dict(), optimizer=None, scaler=None,
                 model_config=dataclasses.asdict(model.config))
    write_plain_checkpoint(out, state)


def check_export_target(out: str, fmt: str) -> None:
    """--export-to: a new or empty directory, or an earlier export of the same
    format, which this one writes over. Nothing else: written into a save
    directory, a plain export would replace the newest checkpoint's
    optimizer states by none, or point it back at an older iteration; an hf
    export's config.json would make --load refuse the directory."""
    check_writable_directory(out, "--export-to")
    held = not_an_export(out, fmt) if os.path.isdir(out) else None
    if held:
        raise UsageError(f"--export-to {out} holds {held}: an export writes only into a new or empty "
                         f"directory, or over an earlier --export-format {fmt} export; give another directory")


def not_an_export(out: str, fmt: str) -> str | None:
    """What directory `out` holds that is not an earlier export of format fmt, or None."""
    # (an iter_N.tmp is an unfinished save's, an export killed midway say, which a save replaces)
    names = [n for n in sorted(os.listdir(out)) if not (n.startswith("iter_") and n.endswith(".tmp"))]
    saved = [n for n in names if n.startswith("iter_")]
    pointers = [n for n in names if n in (LATEST, DS_LATEST)]
    if any(not is_weights_export(os.path.join(out, n)) for n in saved):
        return f"a training run's checkpoints ({first_few(saved + pointers)})"
    if fmt == "hf":
        if saved or pointers:
            return f"a plain export ({first_few(saved + pointers)})"
        return None if is_hf_directory(out) or not names else f"other files ({first_few(names)})"
    if is_hf_directory(out):
        return f"a Hugging Face model ({HF_CONFIG})"
    others = [n for n in names if n not in saved and n != LATEST]  # DeepSpeed's pointer: not an export's
    return f"other files ({first_few(others)})" if others else None


def is_weights_export(path: str) -> bool:
    """Whether path is a plain checkpoint of weights alone (export_weights'),
    read without its tensors (mmap); one that does not read is not one."""
    if not os.path.isfile(os.path.join(path, PLAIN_FILE)):
        return False
    try:
        with data_only_loads(path):
            state = torch.load(os.path.join(path, PLAIN_FILE), map_location="cpu", mmap=True)
    except Exception:  # noqa: BLE001 -- damaged, or more than data: not to be written over either way
        return False
    return isinstance(state, dict) and "optimizer" in state and state["optimizer"] is None


def first_few(names: list[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


# ----------------------------------------------------------------------------
# 3. Hugging Face GPT-2 and Llama directories, in and out
# ----------------------------------------------------------------------------
# Local directories only. Both directions drop/add the vocabulary padding rows
# (zeros on import: their logits are 0 and they are never sampled).

def from_hf(path: str, padded_vocab_size: int | None = None, **overrides) -> GPT:
    """Our GPT from a local Hugging Face GPT-2 or Llama directory: config.json
    + model.safetensors (or pytorch_model.bin, or a sharded safetensors index)."""
    hf = _read_hf_config(path)
    kind = hf.get("model_type", "gpt2")
    if kind not in ("gpt2", "llama"):
        raise UsageError(f"HF model_type {kind!r} in {path} is not supported: use a gpt2 or "
                         f"llama checkpoint")
    to_config, to_ours = ((config_from_hf, hf_to_ours) if kind == "gpt2"
                          else (llama_config_from_hf, llama_hf_to_ours))
    config = to_config(hf, padded_vocab_size, **overrides)
    model = GPT(config)
    model.load_full_state_dict(to_ours(_read_hf_weights(path), config))
    return model


def to_hf(model: GPT, path: str) -> None:
    """Write config.json + model.safetensors (pytorch_model.bin if the
    safetensors package is missing), atomically, for transformers'
    AutoModelForCausalLM.from_pretrained(path) (GPT2LMHeadModel or
    LlamaForCausalLM); see hf_architecture."""
    kind = hf_architecture(model.config)  # before the (collective) gather: fail fast
    to_config, to_hf_sd = ((config_to_hf, ours_to_hf) if kind == "gpt2"
                           else (llama_config_to_hf, llama_ours_to_hf))
    sd = to_hf_sd(model.full_state_dict(), model.config)
    os.makedirs(path, exist_ok=True)
    try:
        from safetensors.torch import save
        atomic_write(os.path.join(path, "model.safetensors"),
                     lambda f: f.write(save(sd, metadata={"format": "pt"})))
    except ImportError:
        atomic_write(os.path.join(path, "pytorch_model.bin"), lambda f: torch.save(sd, f))
    text = json.dumps(to_config(model.config), indent=2)
    atomic_write(os.path.join(path, HF_CONFIG), lambda f: f.write(text.encode()))


# A Hugging Face directory's tokenizer, in any of its forms
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                      "merges.txt", "tokenizer.model")


def write_hf_tokenizer(path: str, config: GPTConfig, run: dict | None, hf_source: str | None) -> None:
    """The tokenizer beside an exported model, so that transformers'
    AutoTokenizer.from_pretrained(path), and pipeline("text-generation",
    model=path), read text as the model was trained, with no download
    (without one they build an empty tokenizer, silently): a Hugging Face
    source's own files, else GPT-2's for a run on GPT-2's BPE (`run`: its
    TrainConfig; None for weights that came from Hugging Face: a GPT-2-sized
    vocabulary), as vocab.json and merges.txt (Megatron's gpt2-vocab.json
    and gpt2-merges.txt) and tokenizer_config.json."""
    files = {name: os.path.join(hf_source, name) for name in HF_TOKENIZER_FILES} if hf_source else {}
    files = {name: source for name, source in files.items() if os.path.isfile(source)}
    gpt2 = run["tokenizer_type"] == "GPT2BPETokenizer" if run else config.vocab_size == VOCAB_SIZE
    if not files and gpt2:
        files = dict(zip(("vocab.json", "merges.txt"), gpt2_bpe_files()))
        eod = "<|endoftext|>"  # GPT-2's one special token: also its bos and unk
        text = json.dumps({"tokenizer_class": "GPT2Tokenizer", "model_max_length": config.max_position_embeddings,
                           "bos_token": eod, "eos_token": eod, "unk_token": eod, "add_prefix_space": False})
        atomic_write(os.path.join(path, "tokenizer_config.json"), lambda f: f.write(text.encode()))
    for name, source in files.items():
        with open(source, "rb") as f:
            content = f.read()
        atomic_write(os.path.join(path, name), lambda f: f.write(content))


def hf_architecture(config: GPTConfig) -> str:
    """"gpt2" or "llama": the transformers architecture that computes exactly
    this model (the default options are GPT-2; rope + RMSNorm + SwiGLU, with
    or without GQA, biases or a tied head, is Llama; either with a head of
    its own or not). Otherwise a UsageError
    naming the closer one and the flags that would make the model fit it."""
    c = config
    # what each architecture needs: (holds for this config?, the flag that makes it hold)
    needs = {"gpt2": [(c.position_embedding_type == "learned_absolute",
                       "--position-embedding-type learned_absolute"),
                      (c.normalization == "LayerNorm", "--normalization LayerNorm"),
                      (not c.swiglu, "no --swiglu"),
                      (not c.disable_bias_linear, "no --disable-bias-linear"),
                      (c.num_query_groups == c.num_attention_heads, "no --group-query-attention")],
             "llama": [(c.position_embedding_type == "rope", "--position-embedding-type rope"),
                       (c.rotary_percent == 1.0, "--rotary-percent 1.0 (Llama rotates whole heads)"),
                       (c.normalization == "RMSNorm", "--normalization RMSNorm"),
                       (c.swiglu, "--swiglu")]}
    missing = {arch: [flag for ok, flag in needs[arch] if not ok] for arch in needs}
    for arch, flags in missing.items():
        if not flags:
            return arch
    arch = min(missing, key=lambda a: len(missing[a]))
    raise UsageError(f"--export-format hf: no transformers architecture computes this model; "
                     f"the closest, {'GPT-2' if arch == 'gpt2' else 'Llama'}, needs "
                     f"{', '.join(missing[arch])}: train with that, or use --export-format plain")


def _eos(config: GPTConfig) -> int:
    return config.vocab_size - 1  # the end of a document: GPT-2's <|endoftext|>, or NullTokenizer's N


# -----------------------------------------------------------------------------
# Hugging Face GPT-2 checkpoint conversion
#
# HF names: transformer.{wte,wpe,ln_f}, transformer.h.{i}.{ln_1,attn.c_attn,
# attn.c_proj,ln_2,mlp.c_fc,mlp.c_proj}. HF's Conv1D stores weights as
# (in, out), the transpose of nn.Linear's (out, in).

_VOCAB_TABLES = ("wte.weight", "output_layer.weight")  # padded rows here, not in HF
_HF_RENAMES = {"attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj",
               "mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}
_HF_UNSUPPORTED = {  # HF GPT-2 options this model does not implement -> required value
    "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False, "add_cross_attention": False,
}


def config_from_hf(hf: dict, padded_vocab_size: int | None = None, **overrides) -> GPTConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UsageError(f"HF activation_function {act!r} is not supported; this GPT uses "
                         f"tanh-approximate GELU ('gelu_new')")
    for key, want in _HF_UNSUPPORTED.items():
        if hf.get(key, want) != want:
            raise UsageError(f"HF config has {key}={hf[key]!r}; only {want!r} is supported")
    vocab = hf.get("vocab_size", 50257)
    return GPTConfig(**{**dict(
        num_layers=hf["n_layer"], hidden_size=hf["n_embd"], num_attention_heads=hf["n_head"],
        ffn_hidden_size=hf.get("n_inner"), max_position_embeddings=hf["n_positions"],
        vocab_size=vocab, padded_vocab_size=padded_vocab_size or pad_vocab_size(vocab),
        layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5), init_method_std=hf.get("initializer_range", 0.02),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True)),
        **overrides})  # the caller's choices win


def config_to_hf(config: GPTConfig) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.max_position_embeddings,
        "n_embd": config.hidden_size, "n_layer": config.num_layers, "n_head": config.num_attention_heads,
        "n_inner": config.ffn_hidden_size, "activation_function": "gelu_new",
        "resid_pdrop": config.hidden_dropout, "embd_pdrop": config.hidden_dropout,
        "attn_pdrop": config.attention_dropout, "layer_norm_epsilon": config.layernorm_epsilon,
        "initializer_range": config.init_method_std,
        "bos_token_id": _eos(config), "eos_token_id": _eos(config),
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
    }


def _is_conv1d_weight(name: str) -> bool:
    return name.endswith(".weight") and any(f".{k}." in name for k in _HF_RENAMES)


def hf_to_ours(sd: dict, config: GPTConfig) -> dict:
    """HF GPT-2 state dict -> ours: rename, transpose Conv1D weights, pad wte (and an untied lm_head)."""
    out = {}
    for name, t in sd.items():
        name = name.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # HF's causal-mask buffers, not weights
        if name == "lm_head.weight":
            if config.untie_embeddings_and_output_weights:
                out["output_layer.weight"] = _pad_vocab_rows(t, config)
            elif not torch.equal(t, sd.get("transformer.wte.weight", sd.get("wte.weight"))):
                raise UsageError("HF lm_head.weight differs from wte.weight, but config.json ties them "
                                 "(tie_word_embeddings)")
            continue
        if _is_conv1d_weight(name):
            t = t.t()
        for old, new in _HF_RENAMES.items():
            name = name.replace(f".{old}.", f".{new}.")
        if name.startswith("h."):
            name = "blocks." + name[2:]
        out[name] = t.contiguous()
    wte = out.get("wte.weight")
    if wte is None or wte.shape[0] != config.vocab_size:
        raise UsageError(f"HF wte.weight missing or not {config.vocab_size} rows")
    out["wte.weight"] = _pad_vocab_rows(wte, config)
    return out


def ours_to_hf(sd: dict, config: GPTConfig) -> dict:
    """Our state dict -> HF GPT-2's (a tied lm_head omitted: HF re-ties it to wte)."""
    out = {}
    for name, t in sd.items():
        if name in _VOCAB_TABLES:
            t = t[:config.vocab_size]  # drop the padding rows
        if name == "output_layer.weight":
            out["lm_head.weight"] = t.detach().cpu().contiguous().clone()
            continue
        if name.startswith("blocks."):
            name = "h." + name[len("blocks."):]
        for old, new in _HF_RENAMES.items():
            name = name.replace(f".{new}.", f".{old}.")
        if _is_conv1d_weight(name):
            t = t.t()
        out["transformer." + name] = t.detach().cpu().contiguous().clone()
    return out


# -----------------------------------------------------------------------------
# Hugging Face Llama checkpoint conversion
#
# HF names: model.embed_tokens, model.layers.{i}.{input_layernorm,
# self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj},
# model.norm, lm_head. Weights are nn.Linear's (out, in), like ours. Our fused
# qkv is [q_proj | k_proj | v_proj] and our fc is [gate_proj | up_proj], and
# both sides rotate half-dims apart (apply_rope), so nothing is permuted.


def _llama_names(config: GPTConfig) -> list[tuple[str, list[str], list[int] | None]]:
    """(our name, HF names, row sizes): each of our tensors is one HF tensor,
    or (sizes given) the HF tensors stacked along dim 0."""
    H, Fh = config.hidden_size, config.ffn_hidden_size
    kv = config.num_query_groups * config.head_dim
    table = [("wte.weight", ["model.embed_tokens.weight"], None),
             ("ln_f.weight", ["model.norm.weight"], None)]
    if config.untie_embeddings_and_output_weights:
        table.append(("output_layer.weight", ["lm_head.weight"], None))
    kinds = ("weight",) if config.disable_bias_linear else ("weight", "bias")
    for i in range(config.num_layers):
        ours, hf = f"blocks.{i}.", f"model.layers.{i}."
        table += [(ours + "ln_1.weight", [hf + "input_layernorm.weight"], None),
                  (ours + "ln_2.weight", [hf + "post_attention_layernorm.weight"], None)]
        for k in kinds:
            table += [(ours + f"attn.qkv.{k}", [hf + f"self_attn.{p}_proj.{k}" for p in "qkv"], [H, kv, kv]),
                      (ours + f"attn.proj.{k}", [hf + f"self_attn.o_proj.{k}"], None),
                      (ours + f"mlp.fc.{k}", [hf + f"mlp.{p}_proj.{k}" for p in ("gate", "up")], [Fh, Fh]),
                      (ours + f"mlp.proj.{k}", [hf + f"mlp.down_proj.{k}"], None)]
    return table


def llama_config_from_hf(hf: dict, padded_vocab_size: int | None = None, **overrides) -> GPTConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise UsageError(f"HF hidden_act {hf['hidden_act']!r} is not supported; Llama's MLP here is SwiGLU (silu)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise UsageError(f"HF RoPE scaling {rope_type!r} is not supported; only plain RoPE (rope_type 'default')")
    H, nh = hf["hidden_size"], hf["num_attention_heads"]
    if (hf.get("head_dim") or H // nh) != H // nh:
        raise UsageError(f"HF head_dim {hf['head_dim']} is not hidden_size / num_attention_heads "
                         f"({H // nh}); this model has no separate head dim")
    if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
        raise UsageError("HF attention_bias and mlp_bias differ; --disable-bias-linear sets both")
    G, vocab = hf.get("num_key_value_heads") or nh, hf["vocab_size"]
    return GPTConfig(**{**dict(
        num_layers=hf["num_hidden_layers"], hidden_size=H, num_attention_heads=nh,
        num_query_groups=None if G == nh else G, ffn_hidden_size=hf["intermediate_size"],
        max_position_embeddings=hf["max_position_embeddings"], vocab_size=vocab,
        padded_vocab_size=padded_vocab_size or pad_vocab_size(vocab),
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), init_method_std=hf.get("initializer_range", 0.02),
        attention_dropout=hf.get("attention_dropout", 0.0), position_embedding_type="rope",
        rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        normalization="RMSNorm", swiglu=True, disable_bias_linear=not hf.get("attention_bias", False),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False)),
        **overrides})  # the caller's choices win (evaluate.py: no dropout)


def llama_config_to_hf(config: GPTConfig) -> dict:
    bias, theta = not config.disable_bias_linear, config.rotary_base
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_query_groups,
        "head_dim": config.head_dim, "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.layernorm_epsilon, "initializer_range": config.init_method_std,
        # rope_theta for transformers 4.x, rope_parameters for 5.x
        "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": bias, "mlp_bias": bias, "attention_dropout": config.attention_dropout,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "bos_token_id": _eos(config), "eos_token_id": _eos(config),
    }


def llama_ours_to_hf(sd: dict, config: GPTConfig) -> dict:
    """Our state dict -> HF Llama's: split qkv and fc, drop the vocab padding."""
    out = {}
    for ours, theirs, sizes in _llama_names(config):
        t = sd[ours][:config.vocab_size] if ours in _VOCAB_TABLES else sd[ours]
        parts = t.split(sizes) if sizes else [t]
        out.update({name: part.detach().cpu().contiguous().clone() for name, part in zip(theirs, parts)})
    return out


def llama_hf_to_ours(sd: dict, config: GPTConfig) -> dict:
    """HF Llama state dict -> ours: stack q/k/v and gate/up, pad the vocab."""
    names = _llama_names(config)
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}  # a buffer, not a weight
    if not config.untie_embeddings_and_output_weights:
        sd.pop("lm_head.weight", None)  # tied: a copy of embed_tokens, if saved at all
    expected = {n for _, theirs, _ in names for n in theirs}
    if expected != set(sd):
        raise UsageError(f"HF Llama weights do not match its config.json: missing "
                         f"{sorted(expected - set(sd))[:5]}, unexpected {sorted(set(sd) - expected)[:5]}")
    out = {}
    for ours, theirs, _ in names:
        t = torch.cat([sd[n] for n in theirs])
        out[ours] = _pad_vocab_rows(t, config) if ours in _VOCAB_TABLES else t.contiguous()
    return out


def _pad_vocab_rows(t: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """(vocab_size, C) -> (padded_vocab_size, C), zeros below."""
    if t.shape[0] != config.vocab_size:
        raise UsageError(f"HF embedding has {t.shape[0]} rows, config.json's vocab_size is "
                         f"{config.vocab_size}")
    return torch.cat([t, t.new_zeros(config.padded_vocab_size - t.shape[0], t.shape[1])])


# -----------------------------------------------------------------------------
# Reading a local directory

def is_hf_directory(path: str) -> bool:
    return os.path.isfile(os.path.join(path, HF_CONFIG))


def _read_hf_config(path: str) -> dict:
    cfg_path = os.path.join(path, HF_CONFIG)
    if not os.path.isfile(cfg_path):
        raise UsageError(f"{cfg_path} not found; from_hf needs a local directory "
                         f"written by save_pretrained (no hub downloads)")
    with open(cfg_path, "rb") as f:
        hf = parse_json(f.read(), cfg_path, ": cut short or damaged")
    if not isinstance(hf, dict):
        raise UsageError(f"{cfg_path} is not a JSON object: not a Hugging Face model's config")
    return hf


def _read_hf_weights(path: str) -> dict:
    st, index, binf = (os.path.join(path, n) for n in
                       ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"))
    if os.path.isfile(st) or os.path.isfile(index):
        files = [st] if os.path.isfile(st) else _hf_shards(path, index)
        return {k: v for f in files for k, v in _read_safetensors(f).items()}
    if os.path.isfile(binf):
        with data_only_loads(binf):
            return torch.load(binf, map_location="cpu", weights_only=True)
    raise UsageError(f"no model.safetensors or pytorch_model.bin in {path}")


def _read_safetensors(path: str) -> dict:
    """A safetensors file's tensors; one line where it is not one (cut short, damaged)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        return load_file(path)
    except SafetensorError as e:
        raise UsageError(f"{path} is not a safetensors file ({e}): cut short or damaged") from None


def _hf_shards(path: str, index: str) -> list[str]:
    """The files a sharded checkpoint's index maps its weights to: safetensors
    files of its own directory, each there."""
    with open(index, "rb") as f:
        read = parse_json(f.read(), index)
    weight_map = read.get("weight_map") if isinstance(read, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise UsageError(f"{index} has no \"weight_map\" (each weight's file): not a sharded checkpoint's index")
    names = sorted(set(map(str, weight_map.values())))
    for name in names:
        if not name.endswith(".safetensors"):
            raise UsageError(f"{index} maps weights to {name!r}, not a .safetensors file (the only kind it names)")
    return named_files(path, names, index, links=True)
