"""Checkpoints: train.py's own (Megatron's layout), DeepSpeed's, and weight
export. Sections:

  1. plain: SAVE/iter_0000100/model_optim_rng.pt + latest_checkpointed_iteration.txt,
     full (unsharded) states, so any TP and DP size loads them (--ckpt-format
     torch), or the same states, each rank writing its own shards, through
     torch.distributed.checkpoint (torch_dist); which checkpoint --load reads,
     and what it may take from it
  2. DeepSpeed: engine.save_checkpoint's own layout plus trainer_state.json,
     so its tools (zero_to_fp32) read it; export of either kind's weights
     (as a Hugging Face directory: huggingface.py)
Every kind is written under a temporary name, renamed into place, then
pointed at (publish): a crash at any point leaves the previous checkpoint
and the pointer to it intact. Every file is read through untrusted.py: a
checkpoint may come from anyone.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import glob
import io
import json
import os
import pickle
import random
import shutil
import tempfile
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist

import parallel
from config import TrainConfig, model_config
from gpt import GPT, GPTConfig
from huggingface import HF_CONFIG, from_hf, is_hf_directory, to_hf, write_hf_tokenizer
from launch import UsageError, atomic_write, fsync_path, parse_json
from launch import (DIGESTS, DIST_METADATA, data_only_loads, digest_files, digests_problem, dist_reader,
                    plain_file_problem, read_dist_metadata, regular_file, write_digests)


# ----------------------------------------------------------------------------
# 1. train.py's own checkpoints
# ----------------------------------------------------------------------------

LATEST = "latest_checkpointed_iteration.txt"  # Megatron's pointer: both kinds write it
PLAIN_FILE = "model_optim_rng.pt"
DS_LATEST = "latest"  # DeepSpeed's own pointer file name, so its tools work on our checkpoints
DS_META = "trainer_state.json"
MARKERS = (("plain", PLAIN_FILE), ("torch_dist", DIST_METADATA), ("deepspeed", DS_META))  # kind: its file


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
    elsewhere. Only the first DP replica's first CP rank takes part. (Gathering
    on every rank would put 16 bytes a parameter on each GPU: 24 GB at 1.5B and tp=2.)"""
    if parallel.layout.dp_rank != 0 or parallel.layout.cp_rank != 0:
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
                 "config": cfg.flags(), "model_config": dataclasses.asdict(model.config)}
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
        named.append((int(text), checkpoint_dir(load_dir, f"iter_{int(text):07d}")))
    if os.path.exists(os.path.join(load_dir, DS_LATEST)):  # the same rules: a checkpoint of load_dir
        tag = pointer_text(os.path.join(load_dir, DS_LATEST))
        if iteration_of(tag) is None:
            raise UsageError(f"{os.path.join(load_dir, DS_LATEST)} holds {tag[:40]!r}, not the name of a "
                             f"checkpoint in {load_dir} (iter_NNNNNNN): write the one to load into it, or "
                             f"delete it to load the newest iter_N there")
        named.append((iteration_of(tag), checkpoint_dir(load_dir, tag)))
    if not named and os.path.isdir(load_dir):
        named = [(i, os.path.join(load_dir, f"iter_{i:07d}")) for i in saved_iterations(load_dir)[-1:]]
    if not named:
        return None
    iteration, path = max(named, key=lambda n: n[0])
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
    if found.kind == "torch_dist":  # every tensor of "model." whole
        saved = read_dist_metadata(found.path).state_dict_metadata
        state = read_dist(found.path, {key: torch.empty(md.size, dtype=md.properties.dtype)
                                       for key, md in saved.items() if key.startswith("model.")}, no_dist=True)
        return {key[len("model."):]: t for key, t in state.items() if key.startswith("model.")}, state
    with data_only_loads(found.path, found.kind):
        if found.kind == "plain":
            state = torch.load(os.path.join(found.path, PLAIN_FILE), map_location="cpu")
            return state.pop("model"), state
        weights, meta = consolidated_weights(found.path)
        client = torch.load(glob.glob(os.path.join(found.path, "*mp_rank_00_model_states.pt"))[0],
                            map_location="cpu")
    return weights, {"iteration": meta["iteration"], "consumed_samples": meta["consumed_samples"],
                     "rng": client["rng"], "config": client["config"],
                     "model_config": meta["model_config"]}


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
    if parallel.layout.tp_rank == parallel.layout.dp_rank == parallel.layout.cp_rank == 0:
        buffer = io.BytesIO()
        torch.save(rng, buffer)
        state[f"rng.stage{parallel.layout.pp_rank}"] = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    state.update({"optimizer.param_groups": optimizer.state_dict()["param_groups"],
                  "scaler": scaler.state_dict() if scaler else None, "iteration": iteration,
                  "consumed_samples": consumed_samples, "config": cfg.flags(),
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
        with contextlib.suppress(Exception):  # e.g. out of host memory: the first save will say so
            self.stager.stage(tensors)

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
    with data_only_loads(path, "torch_dist"):
        try:
            dcp.load(state, storage_reader=dist_reader(path), planner=dcp.DefaultLoadPlanner(**AS_THEY_ARE),
                     no_dist=no_dist or not dist.is_initialized())
        except dcp.api.CheckpointException as e:  # DCP wraps each rank's error; a refusal is data_only_loads' line
            refused = [exc for exc, _ in e.failures.values() if isinstance(exc, (pickle.UnpicklingError, UsageError))]
            raise (refused or [e])[0] from None
        state["pipeline_rng"] = [torch.load(io.BytesIO(state[key].numpy().tobytes())) for key in stages]
    state["rng"] = state["pipeline_rng"][0]
    return state


def save_deepspeed_checkpoint(cfg: TrainConfig, engine, iteration: int, consumed: int,
                              log) -> None:
    """engine.save_checkpoint under a temporary tag, published (publish) by
    rank 0 once every rank has written."""
    client_state = {"iteration": iteration, "consumed_samples": consumed, "rng": rng_state(),
                    "config": cfg.flags()}
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
            "context_parallel_size": parallel.layout.cp_size,
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
    this run's layout. ZeRO's partitions are one per rank of DP x CP
    (zero.DeepSpeedMPU), so only that product must match: CP=2 x DP=2
    resumes at CP=4 x DP=1, on the same curve (stage 0 at any DP and CP).
    (Weights only, from any checkpoint: zero.DeepSpeedTraining.)"""
    meta = read_deepspeed_meta(found.path)
    lay = parallel.layout

    def refuse(name, saved, now):
        raise UsageError(
            f"{found.path} was written with {name} size {saved}, this run has {now}: ZeRO, "
            f"tensor- and pipeline-parallel shards only fit the layout they were written with. Relaunch with "
            f"the old layout, or continue from its weights with fresh optimizer states "
            f"(add --no-load-optim: any layout loads them)")
    (dp, cp), (saved_dp, saved_cp) = (lay.dp_size, lay.cp_size), (meta["data_parallel_size"],
                                                                   meta.get("context_parallel_size", 1))
    if meta["zero_stage"] > 0 and saved_dp * saved_cp != dp * cp:
        if saved_cp == cp == 1:
            refuse("data-parallel", saved_dp, dp)
        refuse("data-parallel x context-parallel", f"{saved_dp} x {saved_cp} = {saved_dp * saved_cp}",
               f"{dp} x {cp} = {dp * cp}")
    for name, saved, now in (("tensor-parallel", meta["tensor_model_parallel_size"], lay.tp_size),
                             ("pipeline-parallel", meta.get("pipeline_model_parallel_size", 1), lay.pp_size)):
        if saved != now:
            refuse(name, saved, now)
    with data_only_loads(found.path, found.kind):
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
