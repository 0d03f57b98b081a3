"""Checkpoints: train.py's own (Megatron's layout), DeepSpeed's, and weight
export (docs/checkpoints.md). In order:

  - plain (--ckpt-format torch): SAVE/iter_0000100/model_optim_rng.pt +
    latest_checkpointed_iteration.txt, full states written by rank 0 (any
    layout loads them); what every kind shares: publish, digests, the vote
  - which checkpoint --load reads (the newest intact one), and what it may take
  - torch_dist (the default): each rank writes its own shards through
    torch.distributed.checkpoint (--async-save: in the background)
  - DeepSpeed: engine.save_checkpoint's layout plus trainer_state.json (its
    tools read it); export of any kind's weights (Hugging Face: huggingface.py)
Every kind is written under a temporary name, renamed into place, then
pointed at (publish): a crash leaves the previous checkpoint and its pointer
intact. Every file is read through launch.py's section 4: a checkpoint may come from anyone.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import glob
import io
import itertools
import json
import os
import pickle
import random
import re
import shutil
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist

import parallel
from config import TrainConfig, check_numbers, model_config
from gpt import GPT, GPTConfig, claimed_shapes, wanted_type
from huggingface import HF_CONFIG, from_hf, hf_tokenizer, is_hf_directory, to_hf, write_files
from launch import (DIGESTS, DIST_METADATA, DS_META, Damaged, UsageError, atomic_write, cut_short, data_only_loads,
                    digest_files, digests_problem, dist_reader, fsync_path, plain_file_problem, read_deepspeed_meta,
                    read_dist_metadata, regular_file, rng_problem, saved_record, take_lock, write_digests, zip_problem)

LATEST = "latest_checkpointed_iteration.txt"  # Megatron's pointer: both kinds write it
PLAIN_FILE = "model_optim_rng.pt"
DS_LATEST = "latest"  # DeepSpeed's own pointer file name, so its tools work on our checkpoints
MARKERS = (("plain", PLAIN_FILE), ("torch_dist", DIST_METADATA), ("deepspeed", DS_META))  # kind: its file


def rng_state() -> dict:
    """The shared generators' states and every TP rank's own dropout stream. Collective over TP."""
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


def load_full_optimizer_state(model: GPT, optimizer, saved: dict, shard_like, path: str, log) -> None:
    """Inverse of states_for_writer: this rank's shards (shard_like), numbered as torch numbers them,
    each laid out as its parameter here before the optimizer sees it (its fused update writes in place)."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = {}
    for index, p in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        if names[id(p)] not in saved["state"]:
            raise KeyError(f"checkpoint has no optimizer state for parameter {names[id(p)]!r}")
        state[index] = {k: shard_like(p, v) if torch.is_tensor(v) and v.dim() > 0 else v
                        for k, v in saved["state"][names[id(p)]].items()}
        if problem := state_fit_problem(p, state[index]):
            raise Damaged(path, f"the optimizer state of {names[id(p)]} {problem}")
    optimizer.load_state_dict({"state": state, "param_groups": adamw_groups(optimizer, saved["param_groups"],
                                                                            path, log)})


ADAMW_STATE = ("exp_avg", "exp_avg_sq", "step")  # what torch's AdamW keeps of a parameter (none before its first step)


def state_fit_problem(p: torch.Tensor, state) -> str | None:
    """Why a parameter's AdamW state is not laid out as `p` (shape, dtype,
    strides, and the storage behind them) with a count of steps, or None.
    At a load, p is this rank's shard; judging a checkpoint, its weight (all
    on the meta device: what the file claims, no bytes read)."""
    if not isinstance(state, dict) or state and set(state) != set(ADAMW_STATE):
        held = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        return f"holds {held}, not AdamW's {', '.join(ADAMW_STATE)}"
    for key in ADAMW_STATE[:2] if state else ():
        v = state[key]
        if not torch.is_tensor(v) or (v.shape, v.dtype, v.stride()) != (p.shape, p.dtype, p.stride()) or \
                v.untyped_storage().nbytes() < (v.storage_offset() + v.numel()) * v.element_size():
            return f"has {key} {described(v)}, not laid out as its weight ({described(p)})"
    step = state.get("step", 0)
    if torch.is_tensor(step):  # (on the meta device, its value is not read)
        counts = step.dim() == 0 and step.is_floating_point() and (step.is_meta or 0 <= step.item() < float("inf"))
    else:
        counts = type(step) in (int, float) and 0 <= step < float("inf")
    return None if counts else f"has step {described(step)}, not a count of steps"


def described(v) -> str:
    if not torch.is_tensor(v):
        return repr(v)[:80]
    return f"{list(v.shape)} {str(v.dtype).removeprefix('torch.')} with strides {list(v.stride())}"


# An AdamW param group's settings (its betas, eps and weight decay) as the flags that give them
SETTINGS = {"adam_beta1": ("betas", 0), "adam_beta2": ("betas", 1), "adam_eps": ("eps", None),
            "weight_decay": ("weight_decay", None)}


def saved_settings(group: dict) -> dict:
    """TrainConfig's fields of the AdamW settings a param group holds (None: not a number)."""
    settings = {}
    for field, (key, i) in SETTINGS.items():
        if key in group:
            value = group[key]
            if i is not None:  # one of the betas
                value = value[i] if isinstance(value, (list, tuple)) and len(value) == 2 else None
            settings[field] = value if type(value) in (int, float) else None
    return settings


def settings_problem(groups) -> str | None:
    """Why a checkpoint's optimizer param_groups hold AdamW settings that the flags would refuse, or None."""
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return "its optimizer's param_groups are not a list of AdamW's parameter groups"
    for group in groups:
        settings = saved_settings(group)
        if unnumbered := [field for field, value in settings.items() if value is None]:
            return f"its optimizer's {SETTINGS[unnumbered[0]][0]} is not a number"
        try:
            check_numbers(dataclasses.replace(TrainConfig(), **settings))
        except UsageError as e:
            return f"its optimizer's param_groups hold a setting no flag may take ({e})"
    return None


def adamw_groups(optimizer, saved: list, path: str, log) -> list[dict]:
    """The optimizer's own param groups (this run's implementation: fused, foreach,
    maximize, capturable, ...; and its learning rate, set every step), with the
    checkpoint's AdamW settings (betas, eps, weight decay), which go on, as in
    Megatron: said in one line where they are not this run's flags."""
    own = optimizer.state_dict()["param_groups"]
    if len(saved) != len(own):
        raise Damaged(path, f"its optimizer has {len(saved)} parameter groups, this run's {len(own)}")
    changed = {}
    for mine, theirs in zip(own, saved):
        now = saved_settings(mine)
        for field, value in saved_settings(theirs).items():
            if value != now[field]:
                changed.setdefault(field, (value, now[field]))
    if changed:
        log("the checkpoint's AdamW settings go on: " + ", ".join(
            f"--{field.replace('_', '-')} {value:g} (this run: {now:g})" for field, (value, now) in changed.items()))
    followed = [{k: (tuple(map(float, g[k])) if k == "betas" else float(g[k])) for k in ("betas", "eps", "weight_decay")
                 if k in g} for g in saved]
    return [{**mine, **theirs} for mine, theirs in zip(own, followed)]


def states_for_writer(model: GPT, optimizer) -> tuple[dict, dict] | tuple[None, None]:
    """The full states, assembled tensor by tensor on global rank 0; (None, None) elsewhere.
    Only the first DP replica's first CP rank takes part, with the EP ranks folded out of
    DP x CP beside it that hold the other experts (under expert TP 1 out of TP x DP x CP,
    with their TP groups). (Gathering on every rank would put 16 bytes a parameter on
    each GPU: 24 GB at 1.5B and tp=2.)"""
    lay = parallel.layout
    # its place in DP x CP (x TP/ETP: its TP group's first place in the stage), past the first EP group
    if (lay.dp_rank * lay.cp_size + lay.cp_rank) * lay.routing_tp_size >= lay.ep_size:
        return None, None

    def gather_to_writer(param, t):
        """The full `t` (shaped like param) on TP rank 0's host, else None: a gather straight
        to the CPU, so no GPU holds more than one full tensor beyond its own shards."""
        t = parallel.gather_like(param, t, to_first=True)
        return None if t is None else t.detach().cpu()

    params = dict(model.named_parameters())
    model_sd = {name: gather_to_writer(params[name], t) if name in params
                else (t.detach().cpu() if parallel.layout.tp_rank == 0 else None)
                for name, t in model.state_dict().items()}
    optim = {name: {k: gather_to_writer(p, v) if torch.is_tensor(v) and v.shape == p.shape else v
                    for k, v in optimizer.state.get(p, {}).items()}
             for name, p in params.items()}
    if lay.tp_rank != 0 or lay.ep_rank != 0:
        return None, None
    if parallel.layout.pp_size > 1:
        model_sd, optim = whole_pipeline(model_sd, optim)
        if model_sd is None:
            return None, None
    return model_sd, {"state": optim, "param_groups": optimizer.state_dict()["param_groups"]}


def gather_stages(obj) -> list | None:
    """Every pipeline stage's small `obj`, in stage order, on the first stage; None on the others."""
    group = parallel.layout.pp_group
    stages = [None] * parallel.layout.pp_size if parallel.layout.pp_rank == 0 else None
    dist.gather_object(obj, stages, dst=dist.get_global_rank(group, 0), group=group)
    return stages


def whole_pipeline(model_sd: dict, optim: dict) -> tuple[dict, dict] | tuple[None, None]:
    """Every stage's states, keyed as at pp=1, sent tensor by tensor to the first; (None, None)
    elsewhere. A tied embedding is on two stages: the first's copy is kept (the two are equal)."""
    items = {("model", k): v for k, v in model_sd.items()}
    items.update({("optimizer", name, k): v for name, state in optim.items() for k, v in state.items()})
    listed = {key: (v.shape, v.dtype) if torch.is_tensor(v) else v for key, v in items.items()}
    stages = gather_stages((listed, list(optim)))
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    if stages is None:
        for v in (v for v in items.values() if torch.is_tensor(v)):
            dist.send(v.to(device), dst=dist.get_global_rank(parallel.layout.pp_group, 0))
        return None, None
    for stage, (stage_listed, names) in enumerate(stages[1:], 1):  # into the first stage's own
        for name in names:
            optim.setdefault(name, {})
        for key, value in stage_listed.items():
            if isinstance(value, tuple):  # (shape, dtype): the tensor comes next
                value = torch.empty(value[0], dtype=value[1], device=device)
                dist.recv(value, src=dist.get_global_rank(parallel.layout.pp_group, stage))
                value = value.cpu()
            whole = model_sd if key[0] == "model" else optim[key[1]]
            whole.setdefault(key[-1], value)
    return model_sd, optim


def publish(tmp_dir: str, final_dir: str, kind: str, iteration: int) -> None:
    """Move a completely written checkpoint directory into place, then make it
    the latest, all forced to disk first: a crash leaves the old checkpoint and
    pointer or the new ones (a re-saved iteration's old copy is final_dir.old)."""
    for root, _, files in os.walk(tmp_dir):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)
    old = final_dir + ".old"
    if os.path.exists(final_dir):
        remove_leftover(old)  # a stale copy from an earlier crash
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    save_dir = os.path.dirname(final_dir)
    fsync_path(save_dir)
    ds_pointer = os.path.join(save_dir, DS_LATEST)  # written by a DeepSpeed save, for its tools
    if kind != "deepspeed" and os.path.exists(ds_pointer):  # it would name an older checkpoint: it goes first
        os.remove(ds_pointer)
        fsync_path(save_dir)
    atomic_write(os.path.join(save_dir, LATEST), lambda f: f.write(str(iteration).encode()))
    if kind == "deepspeed":
        atomic_write(ds_pointer, lambda f: f.write(f"iter_{iteration:07d}".encode()))
    remove_leftover(old)


def write_plain_checkpoint(save_dir: str, state: dict) -> str:
    """SAVE/iter_N/model_optim_rng.pt + SAVE/latest_checkpointed_iteration.txt."""
    final = os.path.join(save_dir, f"iter_{state['iteration']:07d}")
    tmp = final + ".tmp"
    remove_leftover(tmp)
    os.makedirs(tmp)
    with freed_on_failure(tmp):
        torch.save(state, os.path.join(tmp, PLAIN_FILE))
        write_digests(tmp, digest_files(tmp, [PLAIN_FILE]))
        publish(tmp, final, "plain", state["iteration"])
    return final


def remove_leftover(path: str) -> None:
    """What an unfinished save left (SAVE/iter_N.tmp, or .old); a link there (planted, or copied
    in) is removed, never followed: a save writes only into a directory of its own."""
    if os.path.islink(path):
        os.unlink(path)
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def freed_on_failure(tmp: str, mine: bool = True):
    """A failed save's SAVE/iter_N.tmp goes at once (if `mine`), once disk_full has judged the disk."""
    try:
        yield
    except BaseException as e:
        full = None
        if isinstance(e, Exception) and not isinstance(e, UsageError):  # (a UsageError: a verdict, said)
            full = disk_full(e, os.path.dirname(tmp))
        if mine:
            shutil.rmtree(tmp, ignore_errors=True)
        if full and os_error_in(e) is None:  # (an errno says it already)
            raise OSError(errno.ENOSPC, full) from e
        raise


def saved_iterations(save_dir: str) -> list[int]:
    """The iterations of save_dir's iter_NNNNNNN directories, in order."""
    return sorted(i for i in map(iteration_of, os.listdir(save_dir)) if i is not None)


def iteration_of(name: str) -> int | None:
    """N of a checkpoint's directory name iter_NNNNNNN, else None: seven digits or
    more (iteration 10,000,000 has eight), as f"iter_{N:07d}" writes them."""
    match = re.fullmatch(r"iter_([0-9]{7,})", name)
    return int(match[1]) if match and f"{int(match[1]):07d}" == match[1] else None


def remove_old_checkpoints(save_dir: str, current: int, keep: int | None, log) -> None:
    """Delete unfinished saves (iter_N.tmp) and all but the `keep` newest checkpoints up to `current`."""
    for name in sorted(os.listdir(save_dir)):
        if name.startswith("iter_") and name.endswith(".tmp"):
            remove_leftover(os.path.join(save_dir, name))
            log(f"removed {name}, the leftover of a save that did not complete")
    if not keep:
        return
    for iteration in [i for i in saved_iterations(save_dir) if i <= current][:-keep]:
        path = os.path.join(save_dir, f"iter_{iteration:07d}")
        if os.path.islink(path):  # a checkpoint kept elsewhere: the link goes, not what it names
            target = os.path.realpath(path)
            os.unlink(path)
            log(f"removed the link iter_{iteration:07d} (--keep-last-checkpoints {keep}); "
                f"the checkpoint it named, {target}, is left as it is")
            continue
        shutil.rmtree(path)
        log(f"removed checkpoint iter_{iteration:07d} (--keep-last-checkpoints {keep})")


def on_every_rank(fn, what: str, group=None, directory: str | None = None) -> None:
    """Run fn(), then agree with every rank of `group` whether all succeeded: a
    rank that failed raises its error, the others stop with one line naming it
    (at a bare barrier they would wait forever). A failed write into `directory`
    on a full disk is the user's to fix: one line."""
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
    """How a failed write ran out of space (one line), or None: said by an
    OSError's errno, or by the filesystem: torch.save's zip writer raises a
    RuntimeError without one ("unexpected pos ...", "basic_ios::clear")."""
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


# Digests: every save lists its files' sha256 (DIGESTS), which every load checks.

def digests_of_every_rank(directory: str, what: str, group=None) -> dict[str, str]:
    """The sha256 of every file in directory, rank r hashing files r, r+W, ... (collective)."""
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    names, mine = sorted(os.listdir(directory)), {}
    on_every_rank(lambda: mine.update(digest_files(directory, names[rank::world])), what, group)
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
    return {name: d for share in everyone for name, d in share.items()}


def damage(found: Found) -> str | None:
    """What is wrong with a checkpoint, or None: a file that is not plain, not as
    DIGESTS lists it or cut short (by its own index), another iteration's, what no
    save writes (digests prove only that files are as written: found.record holds
    each claim to the file's bytes), or what it records that no load could take
    (record_problem)."""
    if found.kind is None:
        return f"it holds no checkpoint (none of {', '.join(marker for _, marker in MARKERS)})"
    names = sorted(os.listdir(found.path))
    try:
        problem = next(filter(None, (plain_file_problem(found.path, name) for name in names)), None) or (
            digests_problem(found.path, names) if DIGESTS in names else None)
        if problem is None and found.kind == "deepspeed":
            saved = found.record["iteration"]
            if saved != found.iteration:
                problem = f"its {DS_META} records iteration {saved}, not {found.iteration}"
    except UsageError as e:  # a file of the wrong form
        problem = str(e)
    # (outside: a refusal of an index or a pickle that would run code stops the run, see data_only_loads)
    try:
        return problem or cut_short(found.path, found.kind) or record_problem(found)
    except Damaged as e:  # a file not as its writer writes it, found reading it
        return e.problem


def record_problem(found: Found) -> str | None:
    """What a plain or torch_dist checkpoint records (found.record: no tensor's bytes)
    that no load could take, or None: counts that are not counts, weights that its
    model_config does not describe, a parameter without its optimizer state, random
    states that no generator takes, an optimizer state that does not fit its weight,
    AdamW settings no flag may take."""
    if found.kind not in ("plain", "torch_dist"):
        return None  # (DeepSpeed's: read_deepspeed_meta)
    state = found.record
    weights = state.get("model") if isinstance(state, dict) else None
    if not isinstance(weights, dict) or not all(torch.is_tensor(t) for t in weights.values()):
        return "it holds no model weights (a dict of tensors)"
    for key in ("iteration", "consumed_samples"):
        if type(state.get(key)) is not int or state[key] < 0:
            return f"its {key} is {type(state[key]).__name__ if key in state else 'absent'}, not a count"
    if not isinstance(state.get("model_config"), dict):
        return "it has no model_config"
    try:
        checked_model_config(state["model_config"], weights, found.path)
    except UsageError as e:
        return str(e).removeprefix(f"checkpoint {found.path}: ")
    except (TypeError, ValueError, ArithmeticError) as e:  # a value of the wrong type
        return f"its model_config describes no model ({type(e).__name__}: {e})"
    optimizer = state.get("optimizer")  # (None: weights only, an export's)
    held = optimizer.get("state") if isinstance(optimizer, dict) else {}
    params = [name for name in weights if not name.endswith(".mlp.expert_bias")]  # a buffer (gpt.MoE), no state
    if optimizer is not None and (missing := [name for name in params if name not in held]):
        return f"it has no optimizer state for parameter {missing[0]!r}"
    return rng_problem(state) or (optimizer_problem(weights, held, optimizer.get("param_groups"))
                                  if isinstance(held, dict) and isinstance(optimizer, dict) else None)


def optimizer_problem(weights: dict, states: dict, groups) -> str | None:
    """Why a checkpoint's AdamW states (name -> {key: tensor}) do not fit its
    weights (name -> tensor), both on the meta device, or its param_groups'
    settings are ones the flags refuse (settings_problem), or None."""
    for name, state in states.items():
        if not torch.is_tensor(weights.get(name)):
            return f"it holds an optimizer state for {name!r}, which is none of its weights"
        if problem := state_fit_problem(weights[name], state):
            return f"the optimizer state of {name} {problem}"
    return settings_problem(groups)


def write_every_rank(cfg: TrainConfig, kind: str, iteration: int, write, log, extra=None, group=None) -> None:
    """A checkpoint every rank writes part of (torch_dist, DeepSpeed) into
    SAVE/iter_N.tmp; rank 0 adds extra(tmp) (-> their names), the digests, and publishes."""
    final = os.path.join(cfg.save, f"iter_{iteration:07d}")
    tmp, what = final + ".tmp", f"saving checkpoint {iteration} to {cfg.save}"
    first = not dist.is_initialized() or dist.get_rank() == 0
    on_every_rank(lambda: first and remove_leftover(tmp), what, group)

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
    """torch_dist: every rank writes its own shards; torch: global rank 0 writes the full states."""
    if cfg.ckpt_format == "torch_dist":
        return save_dist_checkpoint(cfg, model, optimizer, scaler, iteration, consumed_samples, log, saver)
    model_sd, optim_sd = states_for_writer(model, optimizer)
    rng = rng_state()  # collective too
    stages_rng = gather_stages(rng) if parallel.layout.pp_size > 1 else None  # dropout differs by stage

    def write():
        if model_sd is None:
            return
        state = {"model": model_sd, "optimizer": optim_sd, "scaler": scaler.state_dict() if scaler else None,
                 "iteration": iteration, "consumed_samples": consumed_samples, "rng": rng,
                 "pipeline_rng": stages_rng, "config": cfg.flags(), "model_config": dataclasses.asdict(model.config)}
        log(f"saved checkpoint {write_plain_checkpoint(cfg.save, state)}")
        remove_old_checkpoints(cfg.save, iteration, cfg.keep_last_checkpoints, log)

    on_every_rank(write, f"saving checkpoint {iteration} to {cfg.save}", directory=cfg.save)


@dataclasses.dataclass
class Found:
    """A checkpoint in a --load directory."""
    kind: str | None  # "plain" (train.py's own), "torch_dist", "deepspeed", or None: named, not there
    iteration: int
    path: str       # its directory, SAVE/iter_0000100

    @functools.cached_property
    def record(self):
        """What it records, read once (by damage, for checkpoint_to_load too) as data alone:
        DeepSpeed's trainer_state.json; a plain or torch_dist checkpoint's state, each
        tensor a claim on the meta device, held to its file's bytes (Damaged where it lies)."""
        if self.kind == "deepspeed":
            return read_deepspeed_meta(self.path)
        return dist_record(self.path) if self.kind == "torch_dist" else saved_record(self.path, PLAIN_FILE)


def latest_checkpoint(load_dir: str) -> Found | None:
    """The latest checkpoint in load_dir, or None: the newer pointer's (they differ after a crash
    between a DeepSpeed save's two writes), else the newest iter_N."""
    what_is_there(load_dir)
    named = []
    megatron, deepspeed = os.path.join(load_dir, LATEST), os.path.join(load_dir, DS_LATEST)
    if os.path.lexists(megatron):
        text = pointer_text(megatron)
        if text == "release":
            raise UsageError(f"{megatron} names Megatron's release/ directory, a layout train.py does not "
                             f"read (one file per model-parallel rank, its names)")
        if not (text.isascii() and text.isdigit()):  # a damaged file
            raise UsageError(f"{megatron} holds {text[:40]!r}, not an iteration number: write the iteration "
                             f"to load into it, or delete it to load the newest iter_N there")
        named.append(f"iter_{int(text):07d}")
    if os.path.lexists(deepspeed):  # the same rules: a checkpoint of load_dir
        tag = pointer_text(deepspeed)
        if iteration_of(tag) is None:
            raise UsageError(f"{deepspeed} holds {tag[:40]!r}, not the name of a checkpoint in {load_dir} "
                             f"(iter_NNNNNNN): write the one to load into it, or delete it to load the newest "
                             f"iter_N there")
        named.append(tag)
    if not named and os.path.isdir(load_dir):
        named = [f"iter_{i:07d}" for i in saved_iterations(load_dir)[-1:]]
    if not named:
        return None
    tag = max(named, key=lambda name: int(name[5:]))
    path = os.path.join(load_dir, tag)
    if not os.path.isdir(path) and os.path.isdir(path + ".old"):  # after a crash mid re-save (see publish)
        path += ".old"
    return Found(kind_of(path), int(tag[5:]), path)  # kind None: named, but incomplete or gone (see damage)


def pointer_text(path: str) -> str:
    """A pointer file's first bytes (an iteration, a tag); not UTF-8: U+FFFD. It is a file of
    the save directory like any other (plain_file_problem): a link is not followed, nor echoed."""
    if problem := plain_file_problem(*os.path.split(path)):
        raise UsageError(f"{os.path.dirname(path)}: its pointer {problem}: replace it with a file that names "
                         f"the checkpoint to load, or delete it to load the newest iter_N there")
    with regular_file(path) as (f, _):
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
                         f"eval_tasks.py reads it with --hf, and train.py --export-from {load_dir} --export-to "
                         f"DIR makes one that --load DIR --finetune trains from")


def check_writable_directory(path: str, flag: str) -> None:
    """--save (or --export-to) checked before any work, as --load is. Nothing is created."""
    there = os.path.abspath(path)
    while not os.path.lexists(there):  # the deepest part of the path that is there
        there = os.path.dirname(there)
    if not os.path.isdir(there):
        what = "a file" if os.path.isfile(there) else "not a directory"
        where = f"is {what}" if there == os.path.abspath(path) else f"lies under {there}, {what}"
        raise UsageError(f"{flag} {path} {where}: give a directory (one that is not there yet is made)")
    if not os.access(there, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: this user cannot write {there}: give a directory it can write")


LOCK = "train.lock"  # in --save while a run writes it, holding "pid N on HOST" (writing_alone)


@contextlib.contextmanager
def writing_alone(save: str | None):
    """--save checked, then this run's alone until the block ends: global rank 0 holds
    SAVE/train.lock. Another run given the same --save (it would delete this one's
    unfinished save as a leftover, then write over its checkpoints) stops in one line.
    The kernel releases the lock (flock) however its process ends, so the rank 0 of a
    restart, on this node or another, finds the lock of one killed before it free."""
    if not save:
        yield
        return
    check_writable_directory(save, "--save")
    path, held, mistake = os.path.join(save, LOCK), None, [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            held = take_lock(path)
        except BlockingIOError as e:
            mistake = [f"another run is writing {save} ({e}, which holds {LOCK}): wait for it to end, or give "
                       f"this run another --save"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(mistake, src=0)  # every rank stops, not rank 0 alone
    if mistake[0]:
        raise UsageError(mistake[0])
    try:
        yield
    finally:
        if held is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)  # before the lock goes (see take_lock)
            os.close(held)


def kind_of(path: str) -> str | None:
    return next((kind for kind, marker in MARKERS if os.path.exists(os.path.join(path, marker))), None)


def verified_checkpoint(load_dir: str, log) -> Found | None:
    """The newest intact checkpoint in load_dir, or None where it holds none (none intact: an error)."""
    latest, problems = latest_checkpoint(load_dir), []
    if latest is None:
        return None
    candidates = [latest]  # then the older complete ones, newest first
    for i in reversed(saved_iterations(load_dir)):
        path = os.path.join(load_dir, f"iter_{i:07d}")
        if i < latest.iteration and kind_of(path):
            candidates.append(Found(kind_of(path), i, path))
    for found in candidates:
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
    raise UsageError(f"no intact checkpoint in {load_dir}: {'; '.join(problems)}")


def checkpoint_to_load(cfg: TrainConfig, log) -> Found | None:
    """--load's checkpoint (None: start from scratch), refused where this run cannot take it."""
    if not cfg.load:
        return None
    log(f"loading --load {cfg.load}")  # verifying and reading a large checkpoint takes a while
    found = verified_checkpoint(cfg.load, log)
    if found is None:
        log(f"no checkpoint in {cfg.load}; starting from scratch")
        return None
    if weights_only(cfg) or (found.kind == "deepspeed") == cfg.deepspeed:
        check_same_model(cfg, found.record.get("model_config"), found.path)  # before a tensor is read
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


# What a checkpoint's weights compute (weights of the same shapes can load into another model);
# a fine-tune may change the RoPE base, and learned positions add max_position_embeddings.
ARCHITECTURE = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                "layernorm_epsilon", "position_embedding_type", "rotary_base", "rotary_percent",
                "normalization", "swiglu", "untie_embeddings_and_output_weights", "disable_bias_linear",
                "num_query_groups", "qk_layernorm", "num_experts", "moe_router_topk", "moe_layer_freq")


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


def saved_model(found: Found, **runtime) -> tuple[GPT, dict]:
    """The model a checkpoint of any kind holds, on the host, and the rest of its state."""
    weights, state = read_weights(found)
    model = GPT(checked_model_config(state["model_config"], weights, found.path, **runtime))
    model.load_full_state_dict(weights)
    return model, state


def checked_model_config(record: dict, weights: dict, path: str, **runtime) -> GPTConfig:
    """The GPTConfig of a checkpoint's model_config `record`, once its values are
    of their fields' types and its layer count and shapes (gpt.claimed_shapes) are
    the stored `weights`': a damaged or edited record (hidden_size 2**20 would ask
    for 211 GB, layernorm_epsilon NaN compute NaN) is one line, not a model."""
    if not isinstance(record, dict):
        raise UsageError(f"checkpoint {path}: its model_config is {type(record).__name__}, not a dict of "
                         f"GPTConfig's fields: the checkpoint is damaged or was edited")
    unknown = sorted(set(record) - {f.name for f in dataclasses.fields(GPTConfig)})
    if unknown:
        raise UsageError(f"checkpoint {path}: its model_config has {', '.join(unknown)}, which this version "
                         f"does not know: it was written by a newer train.py; read it with that version")
    for name, value in record.items():
        if wanted := wanted_type(name, value):
            raise UsageError(f"checkpoint {path}: its model_config's {name} is {value!r}, not {wanted}: the "
                             f"checkpoint is damaged or was edited")
    try:
        mcfg = GPTConfig(**{**record, **runtime})
    except UsageError as e:  # a value out of its field's range
        raise UsageError(f"checkpoint {path}: its model_config describes no model: {e}") from None
    layers = len({key.split(".")[1] for key in weights if key.startswith("blocks.")})
    if mcfg.num_layers != layers:
        raise UsageError(f"checkpoint {path}: its model_config says num_layers {mcfg.num_layers}, its "
                         f"tensors hold {layers} layers: the checkpoint is damaged or was edited")
    claimed = claimed_shapes(mcfg, f"checkpoint {path}: its model_config")
    stored = {key: tuple(t.shape) for key, t in weights.items()}
    for key in claimed | stored:
        if claimed.get(key) != stored.get(key):
            there, said = ("absent" if s is None else f"of shape {s}" for s in (stored.get(key), claimed.get(key)))
            raise UsageError(f"checkpoint {path}: its model_config does not describe its tensors: {key} is "
                             f"{there} there, {said} by the model_config (the checkpoint is damaged or was "
                             f"edited)")
    return mcfg


@dataclasses.dataclass(frozen=True)
class Start:
    """After `iteration` and `consumed` samples of the checkpoint at `path`, whose flags were `config`."""
    iteration: int = 0
    consumed: int = 0
    path: str | None = None
    config: dict | None = None


def start_position(cfg: TrainConfig, state: dict, path: str, log) -> Start:
    """Where the run continues from, once `state` is loaded; restores its RNG."""
    if cfg.finetune:
        log(f"--finetune: loaded the weights of {path} (iteration {state['iteration']}); "
            f"starting at iteration 0")
        return Start()
    named = iteration_of(os.path.basename(path).removesuffix(".old"))
    if named is not None and named != state["iteration"]:  # it was chosen by its name (latest_checkpoint)
        raise UsageError(f"checkpoint {path} holds the state of iteration {state['iteration']}, not of "
                         f"{named}: renamed or damaged; give it its own name, or remove it to load the one before")
    if not cfg.no_load_rng and state.get("rng"):  # this stage's own streams, if saved at this pipeline size
        stages = state.get("pipeline_rng") or [state["rng"]]
        pp = parallel.layout.pp_size
        if len(stages) != pp and pp > 1:
            log(f"the random streams were saved at pipeline size {len(stages)}: every stage starts "
                f"from the first stage's")
        own = parallel.layout.pp_rank if len(stages) == pp else 0
        set_rng_state(stages[own], log)
    log(f"loaded checkpoint {path} (iteration {state['iteration']}"
        f"{', weights only' if cfg.no_load_optim else ''})")
    return Start(state["iteration"], state["consumed_samples"], path, state.get("config"))


def load_checkpoint(cfg: TrainConfig, model: GPT, optimizer, scaler, log):
    """Restore everything (or, weights_only, the weights) into a train.py run."""
    found = checkpoint_to_load(cfg, log)
    if found is None:
        return Start()
    if found.kind == "torch_dist":
        state = read_dist_shards(cfg, model, found)

        def shard_like(p, v):  # DCP read this rank's shards already
            return v
    else:
        weights, state = read_weights(found)
        if state.get("optimizer") is None and not weights_only(cfg):
            raise UsageError(f"--load {cfg.load} holds weights only (an --export-to plain export): "
                             f"add --no-load-optim to start fresh optimizer states from it")
        model.load_full_state_dict(weights)
        shard_like = parallel.shard_like
    if not weights_only(cfg):
        load_full_optimizer_state(model, optimizer, state["optimizer"], shard_like, found.path, log)
        if scaler and state["scaler"]:
            scaler.load_state_dict(state["scaler"])
    return start_position(cfg, state, found.path, log)


def read_weights(found: Found) -> tuple[dict, dict]:
    """(full fp32 weights, the rest of its state) of a checkpoint of any kind; no process group."""
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
                     "rng": client["rng"], "config": client["config"], "model_config": meta["model_config"]}


# --ckpt-format torch_dist: the states above, flat ("model.NAME", "optimizer.NAME.exp_avg", ...),
# through torch.distributed.checkpoint (DCP): each rank writes the pieces it holds, each once (DCP's
# planner drops the copies other replicas or stages hold), and a load reads what overlaps its own, at
# any layout. Rank 0 writes the non-tensors; each stage's first rank its random streams (a byte tensor).
# DCP takes a second to import: only the functions that use it do.

# DCP warns whenever it runs in one process; read_dist and a one-process save ask for that.
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
AS_THEY_ARE = dict(flatten_state_dict=False, flatten_sharded_tensors=False)  # our state is flat already


def as_shards(param, t: torch.Tensor) -> torch.Tensor:
    """`t` (a parameter, or state shaped like it) as DCP sees it: a TP (or EP, or EP x TP) shard as a
    ShardedTensor of views of its pieces of the full tensor ([Q_r | K_r | V_r]: no DTensor placement describes it)."""
    splits = parallel.split_of(param)
    if not splits:
        return t
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    full = list(t.shape)
    for _, size, _, dim, _ in splits:
        full[dim] *= size
    mine, everyone = [], []
    for places in itertools.product(*(range(split[1]) for split in splits)):  # a rank's place in each split
        # its global rank: TP's and EP's offsets from this rank's add up (TP ranks are consecutive)
        owner = dist.get_rank() + sum(dist.get_global_rank(group, r) - dist.get_global_rank(group, here)
                                      for (group, _, here, _, _), r in zip(splits, places))
        for pieces in itertools.product(*(parallel.shard_pieces(full[dim], blocks, r, size)
                                          for (_, size, _, dim, blocks), r in zip(splits, places))):
            offsets, sizes, view = [0] * t.dim(), list(t.shape), t
            for (_, _, _, dim, _), (start, local, length) in zip(splits, pieces):
                offsets[dim], sizes[dim], view = start, length, view.narrow(dim, local, length)
            piece = ShardMetadata(offsets, sizes, f"rank:{owner}/{t.device}")
            everyone.append(piece)
            if owner == dist.get_rank():
                mine.append(Shard(view, piece))
    properties = TensorProperties(dtype=t.dtype, layout=t.layout, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        mine, ShardedTensorMetadata(everyone, torch.Size(full), properties))


def dist_model_state(model: GPT) -> dict:
    params = dict(model.named_parameters())
    return {f"model.{name}": as_shards(params.get(name), t) for name, t in model.state_dict().items()}


def save_dist_checkpoint(cfg: TrainConfig, model: GPT, optimizer, scaler, iteration: int,
                         consumed_samples: int, log, saver: AsyncSave | None = None) -> None:
    """Every rank writes its own shards (dcp.save); with a saver (--async-save), in the background."""
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
        except CheckpointException as e:  # a BaseException, of every failed rank's traceback: a failed
            # rank raises its own failure; the others return, and on_every_rank's vote names the rank
            rank = dist.get_rank(group) if dist.is_initialized() else 0
            if rank in e.failures:
                raise e.failures[rank][0] from e

    if saver is None:
        return write(state)
    saver.start(state, write)
    log(f"staged checkpoint {iteration} in host memory; writing it to {cfg.save} in the background")


class AsyncSave:
    """--async-save (docs/checkpoints.md): the loop waits only while DCP's stager copies the state
    to host memory; a thread writes that copy (write_every_rank) on a gloo group of its own. The
    next save and the end of the run wait for it, and raise its error."""

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
        """Once, after the first step: a head start on the first save's host copy."""
        if self.pending is not None:  # made already (or a save came first)
            return
        tensors = [p for group in optimizer.param_groups for p in group["params"]]
        tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]

        def stage_quietly():
            with contextlib.suppress(Exception):  # e.g. out of host memory: the first save will say so
                self.stager.stage(dict(enumerate(tensors)))
        self._in_background(stage_quietly)

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
        """Until the write in flight is done; a failed one raises here, if `report`."""
        pending, self.pending = self.pending, None
        error = pending.exception() if pending is not None else None
        if error is not None and report:
            raise error

    def close(self) -> None:
        """Once the last write is done: the host copy and the group go."""
        self.wait()
        self.stager.close()
        if self.group is not None:
            dist.destroy_process_group(self.group)


def read_dist_shards(cfg: TrainConfig, model: GPT, found: Found) -> dict:
    """A torch_dist checkpoint read into this rank's parameters and (unless weights_only) optimizer states:
    into buffers of this run's sizes (p's shard of each moment, a 0-dim step), never the sizes the index says."""
    saved = read_dist_metadata(found.path).state_dict_metadata
    state, optim = dist_model_state(model), {}
    for name, p in model.named_parameters() if not weights_only(cfg) else ():
        optim[name] = {}
        for key in (key for key in saved if key.startswith(f"optimizer.{name}.")):
            k = key.rsplit(".", 1)[1]
            optim[name][k] = t = torch.zeros(()) if k == "step" else torch.empty_like(p)
            state[key] = t if k == "step" else as_shards(p, t)
    for key, t in state.items():  # the sizes this run reads into against the index's, before DCP reads any
        mine = (list(t.size()), t.dtype if torch.is_tensor(t) else t.metadata().tensor_properties.dtype)
        theirs = key in saved and (list(saved[key].size), saved[key].properties.dtype)
        if theirs and (theirs[0] != mine[0] or key.startswith("optimizer.") and theirs[1] != mine[1]):
            raise Damaged(found.path, f"its {DIST_METADATA} gives {key} as {theirs[0]} {theirs[1]}, where this run's "
                                      f"is {mine[0]} {mine[1]}")
    if optim:
        state.update({"optimizer.param_groups": None, "scaler": None})
    state = read_dist(found.path, state)
    state["optimizer"] = {"state": optim, "param_groups": state.get("optimizer.param_groups")}
    return state


def dist_record(path: str) -> dict:
    """A torch_dist checkpoint's record in a plain one's form (Found.record): its
    non-tensors and random states, read, and each tensor as .metadata describes it,
    on the meta device (no bytes read)."""
    saved = read_dist_metadata(path).state_dict_metadata
    groups = "optimizer.param_groups" in saved
    record = read_dist(path, {"optimizer.param_groups": None} if groups else {}, no_dist=True)
    weights, states = {}, {}
    for key, md in saved.items():
        held = torch.empty(md.size, dtype=md.properties.dtype, device="meta") if hasattr(md, "size") else md
        if key.startswith("model.") and hasattr(md, "size"):
            weights[key[len("model."):]] = held
        elif key.startswith("optimizer.") and key != "optimizer.param_groups":
            name, _, k = key[len("optimizer."):].rpartition(".")
            states.setdefault(name, {})[k] = held
    for name in weights:  # a parameter without a state (none before its first step) has no keys here
        states.setdefault(name, {})
    return {**record, "model": weights, "optimizer": {"state": states,
                                                      "param_groups": record.get("optimizer.param_groups", [])}}


def read_dist(path: str, state: dict, no_dist: bool = False) -> dict:
    """`state` (this rank's tensors, None for non-tensors), and what train.py writes, read from path."""
    import torch.distributed.checkpoint as dcp
    saved = read_dist_metadata(path).state_dict_metadata
    if missing := sorted(set(state) - set(saved)):
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
            failed = next(iter(e.failures.values()))[0]  # a piece that is not what the index says it is
            said = (str(failed).strip().splitlines() or [""])[0][:300]
            raise (refused or [Damaged(path, f"reading it failed: {type(failed).__name__}: {said}")])[0] from None
        pieces = [state[key].numpy().tobytes() for key in stages]
        if problem := next(filter(None, (zip_problem(io.BytesIO(piece)) for piece in pieces)), None):
            raise Damaged(path, f"a stage's random state {problem}")
        state["pipeline_rng"] = [torch.load(io.BytesIO(piece)) for piece in pieces]
    state["rng"] = state["pipeline_rng"][0]
    return state


def save_deepspeed_checkpoint(cfg: TrainConfig, engine, iteration: int, consumed: int, log) -> None:
    """engine.save_checkpoint under a temporary tag, published by rank 0 once every rank has written."""
    client_state = {"iteration": iteration, "consumed_samples": consumed, "rng": rng_state(), "config": cfg.flags()}
    if parallel.layout.tp_size == 1 and parallel.layout.pp_size == 1 and not engine.has_moe_layers:
        # For ds_to_universal, which would merge a strided QKV split, stages or experts wrongly: it refuses without it
        client_state["universal_checkpoint_info"] = {"universal_checkpoint_version": 0.2}
    # what an export needs to merge the shards of any tp: every stage's, on the first (rank 0 writes it)
    layout = {name: [p.partition_dim, p.partition_blocks] for name, p in engine.module.named_parameters()
              if getattr(p, "tensor_model_parallel", False)}
    if parallel.layout.pp_size > 1:
        layout = {k: v for stage in gather_stages(layout) or [] for k, v in stage.items()}
    meta = {"iteration": iteration, "consumed_samples": consumed,
            "zero_stage": engine.zero_optimization_stage(), "data_parallel_size": parallel.layout.dp_size,
            "context_parallel_size": parallel.layout.cp_size, "tensor_model_parallel_size": parallel.layout.tp_size,
            "pipeline_model_parallel_size": parallel.layout.pp_size,
            "expert_model_parallel_size": parallel.layout.ep_size,
            "model_config": dataclasses.asdict(engine.module.config), "tensor_parallel_layout": layout}

    def write_meta(tmp):
        atomic_write(os.path.join(tmp, DS_META), lambda f: f.write(json.dumps(meta, indent=1).encode()))
        return [DS_META]

    write_every_rank(cfg, "deepspeed", iteration, lambda tmp: engine.save_checkpoint(
        cfg.save, tag=os.path.basename(tmp), client_state=client_state, save_latest=False), log, write_meta)


def load_deepspeed_checkpoint(cfg: TrainConfig, engine, found: Found, log) -> Start:
    """Resume everything from a DeepSpeed checkpoint of this run's layout (ZeRO's
    partitions are one per rank of DP x CP: only that product must match)."""
    meta, lay = found.record, parallel.layout  # trainer_state.json, as damage read and checked it

    def refuse(name, saved, now):
        raise UsageError(
            f"{found.path} was written with {name} size {saved}, this run has {now}: ZeRO, "
            f"tensor- and pipeline-parallel shards only fit the layout they were written with. Relaunch with "
            f"the old layout, or continue from its weights with fresh optimizer states "
            f"(add --no-load-optim: any layout loads them)")
    saved_dp, saved_cp = meta["data_parallel_size"], meta["context_parallel_size"]
    if meta["zero_stage"] > 0 and saved_dp * saved_cp != lay.dp_cp_size:
        if saved_cp == lay.cp_size == 1:
            refuse("data-parallel", saved_dp, lay.dp_size)
        refuse("data-parallel x context-parallel", f"{saved_dp} x {saved_cp} = {saved_dp * saved_cp}",
               f"{lay.dp_size} x {lay.cp_size} = {lay.dp_cp_size}")
    for name, saved, now in (("tensor-parallel", meta["tensor_model_parallel_size"], lay.tp_size),
                             ("pipeline-parallel", meta["pipeline_model_parallel_size"], lay.pp_size),
                             ("expert-parallel", meta["expert_model_parallel_size"], lay.ep_size)):
        if saved != now:
            refuse(name, saved, now)
    with data_only_loads(found.path, found.kind):
        _, client = engine.load_checkpoint(os.path.dirname(found.path), tag=os.path.basename(found.path),
                                           load_optimizer_states=True, load_lr_scheduler_states=False)
    if engine.has_moe_layers:  # its model file holds rank 0's experts: each rank's own are in its ZeRO partition
        engine.optimizer.update_lp_params()
    client["pipeline_rng"] = [client["rng"]] * lay.pp_size  # each stage read its own file, its own streams
    return start_position(cfg, client, found.path, log)


def consolidated_weights(tag_dir: str) -> tuple[dict, dict]:
    """Full fp32 weights and trainer_state of a DeepSpeed checkpoint, any layout: zero_to_fp32 merges
    each model-parallel rank's (pp_rank * tp + tp_rank) DP partitions, then its TP shards merge."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    meta = read_deepspeed_meta(tag_dir)
    if (ep := meta["expert_model_parallel_size"]) > 1:  # zero_to_fp32 would merge its experts over DP
        raise UsageError(f"{tag_dir}: a DeepSpeed checkpoint of experts over --expert-model-parallel-size {ep} "
                         f"resumes in its own layout only (its weights do not export yet): relaunch with that layout")
    tp, layout = meta["tensor_model_parallel_size"], meta["tensor_parallel_layout"]
    full = {}
    for stage in range(meta["pipeline_model_parallel_size"]):
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
            if name not in full:  # (a tied embedding: the first stage's)
                full[name] = parallel.merge_shards([s[name] for s in shards], *layout[name]) if name in layout else t
    return full, meta


def stage0_master_weights(model_states: dict) -> dict:
    """The fp32 weights of one stage-0 model-states file: under --bf16/--fp16 the optimizer's."""
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
    """The fp32 weights of a checkpoint of any kind, or of a Hugging Face directory, written as
    fmt="plain" (a weights-only torch-format checkpoint) or fmt="hf" (a Hugging Face directory)."""
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
        tokenizer = hf_tokenizer(model.config, state["config"], hf_source)  # read (and checked) first
        to_hf(model, out)
        write_files(out, tokenizer)
        return
    state.update(model=model.full_state_dict(), optimizer=None, scaler=None,
                 model_config=dataclasses.asdict(model.config))
    write_plain_checkpoint(out, state)


def check_export_target(out: str, fmt: str) -> None:
    """--export-to: a new or empty directory, or an earlier export of the same format."""
    check_writable_directory(out, "--export-to")
    if os.path.isdir(out) and (held := not_an_export(out, fmt)):
        raise UsageError(f"--export-to {out} holds {held}: an export writes only into a new or empty "
                         f"directory, or over an earlier --export-format {fmt} export; give another directory")


def not_an_export(out: str, fmt: str) -> str | None:
    """What directory `out` holds that is not an earlier export of format fmt, or None."""
    # (an iter_N.tmp is an unfinished save's, which a save replaces)
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
    """Whether path is a plain checkpoint of weights alone (export_weights'), read without its tensors."""
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
