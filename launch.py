"""How a program of this project starts, stops and writes files: the one
module every other may import, so it imports none of them.

  1. A user's mistake (UsageError): reported once, by rank 0, as one line;
     a collective that gave up on a dead or silent peer, named (errors_reported);
     SIGTERM before there is anything to save: the process ends at once (sigterm_exits)
  2. torchrun's environment: the default process group, with a fresh store
     for each restart of an elastic job (init_distributed)
  3. Files that appear whole: written under a temporary name, forced to disk,
     renamed into place (atomic_write, fsync_path); a lock file (take_lock)
  4. Files that may come from anyone, as checkpoint.py and huggingface.py read
     them: plain files, their digests, pickles of data only, DCP's index; the
     sizes they claim, held to the bytes they hold; a checkpoint's record read
     without its tensors' bytes, its random states, DeepSpeed's trainer_state.json
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import errno
import fcntl
import functools
import glob
import hashlib
import importlib
import io
import json
import math
import os
import pickle
import pickletools
import random
import re
import signal
import socket
import stat
import sys
import threading
import time
import traceback
import uuid
import warnings
import zipfile

import numpy as np
import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------
# 1. A user's mistake, reported once
# ----------------------------------------------------------------------------

class UsageError(ValueError):
    """A mistake in the flags, the data or a checkpoint; its message says what
    to do. errors_reported prints it once, with exit status 2 (other errors are bugs)."""


class Damaged(UsageError):
    """A checkpoint's file that is not what its writer writes (checkpoint.damage
    passes the checkpoint over for the newest intact one): one line naming it."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"checkpoint {path} is damaged: {problem}")
        self.path, self.problem = path, problem

    def __reduce__(self):  # DCP sends a rank's error to the others pickled
        return Damaged, (self.path, self.problem)


@contextlib.contextmanager
def errors_reported(prog: str):
    """Around a program's whole run (train.py's and eval_tasks.py's main): a user's
    mistake, or a collective that gave up on a dead or silent peer, said in one line."""
    try:
        yield
    except UsageError as e:
        report_usage_error(e, prog)
    except RuntimeError as e:  # gave up on a peer (timed out, or it died)? gloo raises a plain RuntimeError
        gave_up = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer")
        if not isinstance(e, dist.DistError) and not any(s in str(e) for s in gave_up):
            raise
        report_collective_failure(e, prog)


def global_rank() -> int:
    """This process's rank: the process group's, or before one exists torchrun's RANK."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def say(line: str) -> None:
    """Print a note to the user once, on rank 0."""
    if global_rank() == 0:
        print(line, flush=True)


def report_usage_error(e: UsageError, prog: str) -> None:
    """Rank 0 prints the mistake and exits with status 2; the others wait for it in
    the store (or for the launcher to stop them), and print only a mistake of their own."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # train_ops.Preemption's handler would keep it alive
    rank = global_rank()
    if rank != 0 and dist.is_initialized():
        start = time.monotonic()
        try:
            dist.distributed_c10d._get_default_store().wait(["usage_error"], datetime.timedelta(seconds=10))
            sys.exit(2)
        except RuntimeError:  # rank 0 saw nothing wrong in 10 s: this rank's own mistake
            if time.monotonic() - start < 5:  # no: the store is gone, as rank 0 reported and exited
                sys.exit(2)
    elif rank != 0:
        time.sleep(10)  # torchrun (or the deepspeed launcher) stops this rank first, as rank 0 exits
    elif dist.is_initialized() and dist.get_world_size() > 1:
        dist.distributed_c10d._get_default_store().set("usage_error", str(e))
    print(f"{prog}: error{'' if rank == 0 else f' (rank {rank})'}: {e}", file=sys.stderr, flush=True)
    sys.exit(2)


def report_collective_failure(e: RuntimeError, prog: str) -> None:
    """The traceback, then one line: which collective gave up (this
    project's line that waited on it) and what it means."""
    traceback.print_exc()
    here = os.path.dirname(os.path.abspath(__file__))
    frame = next((f for f in reversed(traceback.extract_tb(e.__traceback__))
                  if os.path.dirname(os.path.abspath(f.filename)) == here), None)
    what, where = "a collective", ""
    if frame:
        where = f" at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name} (`{frame.line}`)"
        if "backward" in frame.line:  # DDP and ZeRO reduce gradients from autograd hooks
            what = "the gradient all-reduce (run inside backward)"
    print(f"{prog}: error (rank {os.environ.get('RANK', '0')}): {what} failed{where}: "
          f"{str(e).splitlines()[0]}. Another rank stopped answering or died; its own log says "
          f"why. --distributed-timeout-minutes sets how long a collective waits.",
          file=sys.stderr, flush=True)
    sys.exit(1)


def parse_json(data, where: str, then: str = ""):
    """json.loads(data), or a UsageError naming `where` and why it is not
    JSON (nesting too deep raises RecursionError, not a ValueError). `then`: what to do."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        why = getattr(e, "msg", None) or ("nested too deeply" if isinstance(e, RecursionError) else str(e))
        raise UsageError(f"{where}: not JSON ({why}){then}") from None


_sigterm_wakeup = None  # the pipe's write end while sigterm_exits is in force


def sigterm_exits(line: str) -> None:
    """Until sigterm_calls: SIGTERM (a preemption notice, `timeout`) ends this process
    at once, with `line` on stderr and status 143 (128 + SIGTERM), whatever it does.
    Python runs a handler only between two bytecodes of the main thread, never while
    it waits inside C (a collective, a store, a file that never answers): a thread
    reads the byte the C-level handler writes to the wakeup fd."""
    global _sigterm_wakeup
    read, write = os.pipe()
    os.set_blocking(write, False)  # set_wakeup_fd requires it: a signal handler never blocks
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    if _sigterm_wakeup is not None:  # an earlier run in this process (tests): its thread ends
        os.close(_sigterm_wakeup)
    _sigterm_wakeup = write

    def exit_on_sigterm():
        while received := os.read(read, 64):  # the numbers of the signals caught; b"" once the pipe is closed
            if signal.SIGTERM in received:
                # One write of the whole line: the ranks share one stderr and end together,
                # and print's two writes (the text, then its newline) would interleave.
                os.write(sys.stderr.fileno(), f"{line}\n".encode())
                os._exit(128 + signal.SIGTERM)
        os.close(read)
    threading.Thread(target=exit_on_sigterm, daemon=True, name="sigterm").start()
    # Last: until now SIGTERM's default action ended the process (without the line); none is lost.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the thread acts; the main thread need not


def sigterm_calls(handler) -> None:
    """From now on SIGTERM calls handler (in the main thread) instead of
    ending the process. The handler goes in first: none is lost in between."""
    global _sigterm_wakeup
    signal.signal(signal.SIGTERM, handler)
    if _sigterm_wakeup is not None:
        signal.set_wakeup_fd(-1)
        os.close(_sigterm_wakeup)  # the thread reads the end of the pipe and ends
        _sigterm_wakeup = None


# ----------------------------------------------------------------------------
# 2. torchrun's environment
# ----------------------------------------------------------------------------

@dataclasses.dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    timeout: datetime.timedelta  # how long a collective waits (--distributed-timeout-minutes)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(backend: str | None = None, timeout_minutes: float = 10.0, one_queue: bool = False,
                     deepspeed: bool = False) -> Dist:
    """The default process group from torchrun's environment (one process without
    it; gloo on CPU). one_queue: one hardware queue (see parallel._SequenceParallelLinear),
    set before anything creates the CUDA context, which reads it."""
    if one_queue:
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if world > 1 and not dist.is_initialized():
        if backend == "gloo":
            # gloo connects a group's ranks inside init_process_group and new_group: the rank
            # that dials returns once connected, and leaving then (a user error, the run's end)
            # fails its peer, still accepting, with "Connection closed by peer". This barrier at
            # the end of each makes every rank wait for all. (NCCL connects at first use.)
            os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "1")
        dist.init_process_group(backend=backend, timeout=timeout, **elastic_store(rank, world, timeout))
    elif deepspeed and not dist.is_initialized():
        # DeepSpeed needs a process group and the launcher's variables, even alone.
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(name, value)
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    return Dist(rank, world, local_rank, device, timeout)


ATTEMPT_STORE_KEY = "/parallel.py/attempt_store"


def elastic_store(rank: int, world: int, timeout: datetime.timedelta) -> dict:
    """init_process_group's store under torchrun, a new one for each attempt:
    the agents' shared store (TORCHELASTIC_USE_AGENT_STORE) keeps a dead
    attempt's keys, which would connect workers to ranks that are gone. No attempt
    number is the same on every node: rank 0 publishes its own store's address with a nonce."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    host = os.environ["MASTER_ADDR"]  # the node of global rank 0, whose agent hosts this store
    agent = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout)
    if rank == 0:
        store = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        nonce = uuid.uuid4().hex
        store.set("nonce", nonce)
        agent.set(ATTEMPT_STORE_KEY, f"{host} {store.port} {nonce}")
    else:
        store = join_attempt_store(agent, world, timeout)
    return {"store": store, "rank": rank, "world_size": world}


def join_attempt_store(agent, world: int, timeout: datetime.timedelta):
    """The store rank 0 started for this attempt: read the key until its
    address answers with its nonce (it may still hold a dead attempt's)."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        host, port, nonce = agent.get(ATTEMPT_STORE_KEY).decode().split()
        try:
            socket.create_connection((host, int(port)), timeout=5).close()  # cheap, quiet refusal
            store = dist.TCPStore(host, int(port), world, is_master=False,
                                  timeout=datetime.timedelta(seconds=30))
            if store.get("nonce").decode() == nonce:
                store.set_timeout(timeout)
                return store
        except (OSError, RuntimeError):  # refused, or not a store (a port reused since)
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 published no store of this attempt within "
                               f"{timeout.total_seconds():.0f} s (--distributed-timeout-minutes)")
        time.sleep(0.2)


# ----------------------------------------------------------------------------
# 3. Files written atomically, and a lock file
# ----------------------------------------------------------------------------

def atomic_write(path: str, write) -> None:
    """write(f) into a temporary file beside `path`, force it to disk, rename
    it into place and force the directory entry: a reader, or the machine after
    a power loss, finds the old file or the new one, never a torn one. The
    temporary name is per process (ranks may write one file: to_hf under TP)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(os.path.dirname(path) or ".")
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def fsync_path(path: str) -> None:
    """Force a file's contents, or a directory's entries, to disk (POSIX: both open read-only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def take_lock(path: str) -> int | None:
    """An exclusive lock (flock) on the file `path`, made if need be, and this process's
    "pid N on HOST" in it -> its descriptor; None where the filesystem has no locks. Held
    by another process: BlockingIOError of that one's "pid N on HOST"."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    while True:
        if os.path.lexists(path) and (problem := plain_file_problem(*os.path.split(path))):
            raise UsageError(f"{os.path.dirname(path)}: {problem}: delete it (it is made when it is not there)")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = re.match(r"pid [0-9]+ on [\w.-]+", os.pread(fd, 300, 0).decode("ascii", "replace"))
            os.close(fd)
            if e.errno != errno.EWOULDBLOCK:
                return None  # (ENOLCK, EOPNOTSUPP: a filesystem without locks)
            raise BlockingIOError(holder[0] if holder else "a process whose pid it does not give") from None
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        os.close(fd)  # removed by the process that held it, as this one locked it: lock the new one
    with contextlib.suppress(OSError):  # (a full disk: the lock holds all the same)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    return fd


# ----------------------------------------------------------------------------
# 4. Files that may come from anyone: read only where a file is what it
# claims to be, then as data alone
# ----------------------------------------------------------------------------

DIGESTS = "checksums.sha256"  # every file's sha256, in sha256sum's format (`sha256sum -c` reads it)
DIST_METADATA = ".metadata"  # torch.distributed.checkpoint's index, written last: a torch_dist checkpoint


def _not_regular(mode: int) -> str | None:
    """What a file of this mode is, where it is not a regular file."""
    kinds = ((stat.S_ISREG, None), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
             (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    return next((what for test, what in kinds if test(mode)), "a device")


NAME_MOST = 255  # bytes in one file name (NAME_MAX: Linux's, and most filesystems')
HOLES_FROM = 64 << 20  # bytes: a file this large whose blocks hold less than half of it is sparse


def shown(name) -> str:
    """repr(name), shortened where it is long (a name from a file may be any length)."""
    text = repr(name)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text):,} characters)"


def plain_file_problem(directory: str, name: str, links: bool = False) -> str | None:
    """Why `name`, given by a checkpoint (its digests, DCP's or a Hugging Face index),
    is not a bare file name (nothing sha256sum would escape) of a regular file of
    `directory`, or None: a link, FIFO or device (a tar can carry them) would be read
    outside it or forever, and a sparse file for as long as the size it claims (its
    holes cost a tar a few bytes; no save writes one). `links`: a link that stays in
    place (link_in_place) is fine."""
    if name in ("", ".", "..") or any(c in name for c in "/\\\n\r\0") or \
            len(name.encode(errors="replace")) > NAME_MOST:
        return f"{shown(name)} is not a file name in the checkpoint's directory"
    path = os.path.join(directory, name)
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return f"{name} is missing"
    if stat.S_ISLNK(info.st_mode):
        if links and link_in_place(directory, path):
            return None
        return f"{name} is a symbolic link (to {os.readlink(path)}), not a file"
    if what := _not_regular(info.st_mode):
        return f"{name} is {what}, not a file"
    on_disk = info.st_blocks * 512
    if info.st_size >= HOLES_FROM and on_disk < info.st_size // 2:
        return f"{name} is a sparse file: {info.st_size:,} bytes, of which {on_disk:,} are on disk"
    return None


def link_in_place(directory: str, path: str) -> bool:
    """Whether the link `path` leads to a regular file inside `directory` or, where that is
    a Hugging Face cache's snapshot (REPO/snapshots/REVISION), inside REPO/blobs, where
    the cache's links lead: never to a file elsewhere on disk (/etc/passwd, a dotfile)."""
    target, here = os.path.realpath(path), os.path.realpath(directory)
    places = [here]
    if os.path.basename(os.path.dirname(here)) == "snapshots":
        places.append(os.path.join(os.path.dirname(os.path.dirname(here)), "blobs"))
    return os.path.isfile(target) and any(os.path.commonpath([target, place]) == place for place in places)


@contextlib.contextmanager
def regular_file(path: str, follow: bool = False):
    """(binary file, size) of `path`, opened only if it is a regular file (and,
    unless `follow`, not a link), checked before the open and on the open file;
    a UsageError otherwise. A FIFO never blocks the open; a reader takes `size` bytes.
    `follow`: a file a user names (a flag's), or one link_in_place has judged."""
    if what := _not_regular((os.stat if follow else os.lstat)(path).st_mode):
        raise UsageError(f"{path} is {what}, not a file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW))
    except OSError as e:  # swapped for a link since the check
        if e.errno != errno.ELOOP:
            raise
        raise UsageError(f"{path} is a symbolic link, not a file") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if what := _not_regular(info.st_mode):  # swapped since the check
            raise UsageError(f"{path} is {what}, not a file")
        os.set_blocking(fd, True)  # O_NONBLOCK was for the open alone
        yield f, info.st_size


def named_files(directory: str, names, index: str, links: bool = False) -> list[str]:
    """directory/name of each name a checkpoint's own index (DCP's, a Hugging
    Face weight map) gives, each a plain file of it and one its digests list, if
    any. `links`: a link that stays in place too (a Hugging Face cache's snapshot's)."""
    listed = listed_digests(directory) if os.path.exists(os.path.join(directory, DIGESTS)) else None
    paths = {}
    for name in names:
        if isinstance(name, str) and name in paths:  # DCP's index names each file many times
            continue
        path = os.path.join(directory, str(name))
        problem = plain_file_problem(directory, name, links) if isinstance(name, str) else f"{name!r} is not a file name"
        if problem is None and listed is not None and name not in listed:
            problem = f"{name} is not one of the files its {DIGESTS} lists"
        if problem and (problem.endswith(" is missing") or isinstance(name, str) and not any(c in name for c in "/\\")
                        and len(name.encode(errors="replace")) > NAME_MOST):
            # a name no file of it bears (cut short, or over 255 bytes), not one reaching elsewhere: damage
            raise Damaged(directory, f"{index} names {shown(name)}, a file it does not hold ({problem})")
        if problem:
            raise UsageError(f"refusing to read the checkpoint in {directory}: {index} names {shown(name)}, not one of "
                             f"its own files ({problem}). Load checkpoints only from a source you trust")
        paths[name] = path
    return list(paths.values())


def small_file(path: str, most: int, named: str = "") -> bytes:
    """The bytes of `path`, a regular file (or a link to one: a flag's, which the user
    chose) of at most `most` bytes; else one line, `named` (the flag) before the path.
    A FIFO or a device would be read forever, and a file of any size whole."""
    try:
        with regular_file(path, follow=True) as (f, size):
            data = f.read(size) if size <= most else None
    except FileNotFoundError:
        raise UsageError(f"{named}{path}: no such file") from None
    except OSError as e:
        raise UsageError(f"{named}{path}: cannot read it ({e.strerror})") from None
    except UsageError as e:
        raise UsageError(f"{named}{e}") from None
    if data is None:
        raise UsageError(f"{named}{path} holds {size:,} bytes, more than a file of its kind ({most:,} at most)")
    return data


def text_file(path: str, most: int, named: str = "") -> str:
    """small_file's bytes as UTF-8 text."""
    try:
        return small_file(path, most, named).decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{named}{path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with regular_file(path) as (f, left):
        while left > 0 and (block := f.read(min(left, 1 << 24))):
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


def listed_digests(directory: str) -> dict[str, str]:
    """name -> sha256 of each line of directory's DIGESTS: `SHA256  NAME`, or
    `SHA256 *NAME` as `sha256sum -b` writes; any other line is a UsageError.
    It is read only as large as a line for each file there can make it."""
    with regular_file(os.path.join(directory, DIGESTS)) as (f, size):
        most = (64 + 2 + NAME_MOST + 1) * len(os.listdir(directory))
        if size > most:
            raise UsageError(f"{DIGESTS} is {size:,} bytes, more than a line for each file there can take "
                             f"({most:,})")
        text = f.read(size).decode("utf-8", "replace")
    listed = {}
    for number, line in enumerate(text.removesuffix("\n").split("\n") if text else [], 1):
        match = re.fullmatch(r"([0-9a-fA-F]{64}) [ *](.+)", line)
        if not match or match[2] in listed:
            raise UsageError(f"line {number} of {DIGESTS}, {line[:80]!r}, is not `SHA256  NAME` of a file "
                             f"listed once")
        listed[match[2]] = match[1].lower()
    return listed


def digest_files(directory: str, names: list[str]) -> dict[str, str]:
    return {name: sha256_of(os.path.join(directory, name)) for name in names}


def write_digests(directory: str, digests: dict[str, str]) -> None:
    text = "".join(f"{d}  {name}\n" for name, d in sorted(digests.items()))
    atomic_write(os.path.join(directory, DIGESTS), lambda f: f.write(text.encode()))


def digests_problem(directory: str, names: list[str]) -> str | None:
    """checkpoint.damage's verdict on the files `names` of a directory with
    DIGESTS, each of which it found a plain file already."""
    listed, there = listed_digests(directory), set(names)
    for name in listed:  # before any file is read: a listed name not there is missing, or no plain name
        if name not in there and (problem := plain_file_problem(directory, name)):
            return problem
    unlisted = [name for name in names if name not in listed and name != DIGESTS]
    if unlisted:  # another run's, saved over this one (at another data-parallel size, say)
        return (f"{', '.join(unlisted)} {'is' if len(unlisted) == 1 else 'are'} not listed in {DIGESTS} "
                f"(another save's, written over this one?)")
    for name, digest in listed.items():
        if sha256_of(os.path.join(directory, name)) != digest:
            return f"{name} is damaged (its sha256 is not the one {DIGESTS} records)"
    return None


def cut_short(directory: str, kind: str) -> str | None:
    """checkpoint.damage's verdict on a file of a checkpoint of `kind` cut short, by
    its own index, or None: a .pt's zip directory, DCP's .metadata (the extents it
    gives each file: dist_index_problem, as the checkpoint is read)."""
    if kind == "torch_dist":
        try:
            read_dist_index(directory)
        except (EOFError, pickle.UnpicklingError) as e:  # cut short, or a refused global (said by the read)
            if isinstance(e, EOFError) or "truncated" in str(e):
                return f"{DIST_METADATA} is truncated"
            read_dist_metadata(directory)
        return None
    for name in sorted(n for n in os.listdir(directory) if n.endswith(".pt")):
        with open(os.path.join(directory, name), "rb") as f:
            head = f.read(4)
        if head == b"PK\x03\x04" and not zipfile.is_zipfile(os.path.join(directory, name)):
            return f"{name} is truncated (its zip directory is gone)"
        if head != b"PK\x03\x04" and not head.startswith(b"\x80"):  # torch's pre-zip format, a pickle: no index
            return f"{name} is truncated, or not a checkpoint's file: neither a zip (torch.save's) nor a pickle"
    return None


# Data only (docs/checkpoints.md): a pickle may name any function for its reader
# to call, so every checkpoint file is read as weights_only: tensors, numbers,
# strings and containers, plus the few types below, which rebuild data and call
# nothing else. TORCH_FORCE_WEIGHTS_ONLY_LOAD overrides DeepSpeed's weights_only=False.

# A file of another pickle protocol than torch.save's is refused in one line, without torch's warning too.
warnings.filterwarnings("ignore", "Detected pickle protocol")


@contextlib.contextmanager
def data_only_loads(where: str, kind: str = "plain"):
    """Every torch.load inside, DeepSpeed's included, reads data only: numpy's
    arrays too (np.random's state in every checkpoint's "rng"), and for `kind`
    "deepspeed" the types of its optimizer files (only its loads import it). A file
    that holds more is refused in one line naming it and what it holds. `where`: the
    checkpoint's directory (or file), of `kind` ("plain", "torch_dist" or "deepspeed")."""
    rebuild = np.zeros(0).__reduce__()[0]  # numpy's array reconstructor, under both its module names:
    types = [np.ndarray, np.dtype, type(np.dtype(np.uint32)),  # the state's key array is uint32
             (rebuild, "numpy._core.multiarray._reconstruct"),  # numpy 2
             (rebuild, "numpy.core.multiarray._reconstruct")]  # numpy 1's checkpoints
    if kind == "deepspeed":
        with contextlib.suppress(ImportError):  # no DeepSpeed here: no file needs its types
            from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
            from deepspeed.runtime.zero.config import ZeroStageEnum
            from deepspeed.utils.tensor_fragment import fragment_address
            types += [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]
    force, before = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ[force] = "1"
    try:
        with torch.serialization.safe_globals(types):  # also what _code_in_files' scan allows
            try:
                yield
            except pickle.UnpicklingError as e:
                raise UsageError(_code_in_files(where, kind, e)) from None
    finally:  # this key alone: the rest of os.environ may have changed inside
        if before is None:
            del os.environ[force]
        else:
            os.environ[force] = before


def _code_in_files(where: str, kind: str, error: pickle.UnpicklingError) -> str:
    """Which pickles a load reads under `where` hold more than data, by a static scan:
    its .pt files, or a torch_dist checkpoint's non-tensors, each a torch.save zip in
    a .distcp file (unless its index was refused); else what the unpickler refused."""
    found = []  # (a pickle's name, the globals in it that weights_only refuses)
    if kind != "torch_dist":
        for path in sorted(glob.glob(os.path.join(where, "*.pt"))) if os.path.isdir(where) else [where]:
            with open(path, "rb") as f:
                found.append((path, _unsafe_globals(f)))
    elif DIST_METADATA not in str(error):
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata
        metadata = dist_reader(where).read_metadata()
        for index, info in metadata.storage_data.items():
            if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                with open(os.path.join(where, info.relative_path), "rb") as f:
                    f.seek(info.offset)
                    piece = io.BytesIO(f.read(info.length))
                found.append((f"{os.path.join(where, info.relative_path)} (its {index.fqn})", _unsafe_globals(piece)))
    shown = "; ".join(f"{name} holds {', '.join(names)}" for name, names in found if names)
    if not shown:
        reason = [line for line in str(error).splitlines() if "global" in line.lower() or "got <" in line]
        shown = f"a file there holds {(reason or ['more than data'])[0].strip()}"
    return (f"refusing to read the checkpoint in {where}: {shown}, not data (tensors, numbers, "
            f"containers); a file like that can run code when it is read. Load checkpoints only "
            f"from a source you trust")


def _unsafe_globals(f) -> list[str]:
    """The globals in a file torch.load reads (f: open, binary) that weights_only
    refuses: torch's own scan of a torch.save zip, else ours of the opcodes of
    torch's legacy format (five pickles, then raw bytes) or a raw pickle, where
    a protocol 4 global takes the two strings last pushed or fetched from the memo."""
    zipped = zipfile.is_zipfile(f)
    f.seek(0)
    if zipped:
        return torch.serialization.get_unsafe_globals_in_checkpoint(f)
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
    from torch._weights_only_unpickler import _get_allowed_globals, _get_user_allowed_globals
    return sorted(found - set(_get_allowed_globals()) - set(_get_user_allowed_globals()))


def dist_reader(path: str):
    """DCP's reader, but its index (a pickle) is read by DistMetadataUnpickler,
    may name only the checkpoint's own files and must describe them truly
    (dist_index_problem), and each piece it reads must be a zip stored as
    torch.save stores one (zip_problem)."""
    import torch.distributed.checkpoint as dcp
    reader = dcp.FileSystemReader(path)

    def read_metadata(*args, **kwargs):
        metadata = read_dist_index(path)
        if problem := dist_index_problem(path, metadata):  # before DCP allocates or reads anything
            raise Damaged(path, problem)
        metadata.storage_meta = metadata.storage_meta or dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = reader.load_id
        return metadata

    def slice_file(file, info, dcp_slice=reader._slice_file):  # each piece DCP reads is torch.load-ed whole
        if problem := zip_problem(Extent(file, info.offset, info.length)):
            raise Damaged(path, f"the piece of {info.relative_path} at byte {info.offset:,} {problem}")
        return dcp_slice(file, info)
    reader.read_metadata = read_metadata  # in place of DCP's unpickling of the index
    reader._slice_file = slice_file
    return reader


def read_dist_index(path: str):
    """DCP's index of the checkpoint in `path`, unpickled as data alone and
    naming only its own files; anything else but DCP's Metadata is a UsageError."""
    from torch.distributed.checkpoint.metadata import Metadata
    with open(os.path.join(path, DIST_METADATA), "rb") as f:
        try:
            metadata = DistMetadataUnpickler(f).load()
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError) as e:
            raise Damaged(path, f"{DIST_METADATA} is not DCP's index ({type(e).__name__}: {str(e)[:200]})") from None
    if not (isinstance(metadata, Metadata) and isinstance(metadata.state_dict_metadata, dict)
            and isinstance(metadata.storage_data, dict)):
        raise Damaged(path, f"{DIST_METADATA} holds a {type(metadata).__name__}, not DCP's index")
    named_files(path, (getattr(info, "relative_path", None) for info in metadata.storage_data.values()),
                os.path.join(path, DIST_METADATA))  # before DCP opens any of them
    return metadata


class DistMetadataUnpickler(pickle.Unpickler):
    """Only this torch's DCP metadata classes (dataclasses and enums), its dtypes and
    the few helpers DCP's pickle names: any other global is refused before it is
    looked up, as finding a global imports its module, which runs its code."""

    def find_class(self, module: str, name: str):
        if (module, name) in self.allowed():
            return super().find_class(module, name)  # a module imported already
        raise pickle.UnpicklingError(f"the global {module}.{name} in {DIST_METADATA}")

    @staticmethod
    @functools.cache
    def allowed() -> frozenset:
        names = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}
        names |= {("torch", n) for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
        for module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"):
            for n, v in vars(importlib.import_module(module)).items():
                if isinstance(v, type) and v.__module__ == module and (
                        dataclasses.is_dataclass(v) or issubclass(v, enum.Enum)):
                    names.add((module, n))
        return frozenset(names)


def read_dist_metadata(path: str):
    with data_only_loads(path, "torch_dist"):
        return dist_reader(path).read_metadata()


# What a file says of its own sizes is a claim: torch's and DCP's readers
# allocate what it claims, and read, copy or write where it points. These
# hold each claim to the bytes the file holds (as safetensors checks its
# header against its file, and DCP's planner a save's pieces against their
# tensors): memory is bounded by the files, and no write leaves a buffer.

class Extent:
    """Bytes [offset, offset + length) of an open binary file, as a file of
    their own for zipfile (DCP's view of them misreads a seek from the end)."""

    def __init__(self, f, offset: int, length: int):
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        self.pos = max(0, pos + {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence])
        return self.pos

    def read(self, n: int = -1) -> bytes:
        self.f.seek(self.offset + self.pos)
        data = self.f.read(max(0, self.length - self.pos if n < 0 else min(n, self.length - self.pos)))
        self.pos += len(data)
        return data


def zip_problem(f) -> str | None:
    """Why `f` (a binary file) is not a zip as torch.save writes one: every
    record stored as it is (torch's reader inflates a compressed record whole,
    to whatever size it claims, before anything is checked), or None."""
    try:
        with zipfile.ZipFile(f) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
        return f"is not a zip archive as torch.save writes ({e})"
    for record in records:
        if record.compress_type != zipfile.ZIP_STORED or record.compress_size != record.file_size:
            how = zipfile.compressor_names.get(record.compress_type, f"method {record.compress_type}")
            return (f"holds its record {record.filename} compressed ({how}), where torch.save stores every "
                    f"record as it is")
    return None


def saved_claims(f):
    """What a torch.save zip (f: a binary file that zip_problem passed) holds,
    unpickled as torch.load(weights_only=True) unpickles it (so inside
    data_only_loads), but with no tensor's bytes read: each storage on the meta
    device, marked with the extent of its record in f (storage.record: first
    byte, size; None: no such record)."""
    from torch._weights_only_unpickler import Unpickler
    records = {}  # a record's name, after the archive's own folder (as torch's reader names it) -> its extent
    end = f.seek(0, os.SEEK_END)  # (a zip's directory may claim a record larger than the file holds)
    with zipfile.ZipFile(f) as archive:
        for record in archive.infolist():
            f.seek(record.header_offset)
            header = f.read(30)  # a local file header: its name's and extra field's lengths at 26 and 28
            if header[:4] == b"PK\x03\x04":
                start = record.header_offset + 30 + int.from_bytes(header[26:28], "little") + \
                    int.from_bytes(header[28:30], "little")
                records[record.filename.split("/", 1)[-1]] = (start, max(0, min(record.file_size, end - start)))

    class Claims(Unpickler):
        def persistent_load(self, saved_id):  # ("storage", its type, key, device, elements), as torch.save writes
            _, kind, key, _, elements = saved_id
            dtype = torch.uint8 if kind is torch.UntypedStorage else kind.dtype
            storage = torch.UntypedStorage(elements * dtype.itemsize, device="meta")
            storage.record = records.get(f"data/{key}")
            return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
    first, size = records.get("data.pkl", (0, 0))
    f.seek(first)
    return Claims(io.BytesIO(f.read(size)), encoding="utf-8").load()


def tensors_problem(tensors: dict) -> str | None:
    """Why tensors a torch.save file holds (name -> tensor, as saved_claims
    gives them: claims, no bytes read) are not each its own bytes of the file,
    or None. A storage's size, a tensor's size and strides are claims: a record
    of another size than its storage says, a stride of 0 or elements that
    overlap, or two tensors on the same bytes would give a model, or an
    optimizer's in-place update, more elements than the file holds."""
    spans = []  # (first byte in the file, end, name) of each tensor
    for name, t in tensors.items():
        storage = t.untyped_storage()
        first, size = getattr(storage, "record", None) or (0, None)
        if size != storage.nbytes():
            return f"{name}'s storage claims {storage.nbytes():,} bytes, its record holds {size or 0:,}"
        reach = 0  # the furthest element the dimensions with smaller strides reach
        for extent, stride in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n > 1), key=lambda d: d[1]):
            if stride <= reach:
                return (f"{name} of size {tuple(t.shape)} has strides {t.stride()}: its elements overlap "
                        f"(a tensor torch.save writes has its own bytes for each)")
            reach += (extent - 1) * stride
        start, length = t.storage_offset() * t.element_size(), (reach + 1) * t.element_size()
        if t.numel() and start + length > storage.nbytes():
            return f"{name} of size {tuple(t.shape)} claims bytes up to {start + length:,} of a record of " \
                   f"{storage.nbytes():,}"
        if t.numel():
            spans.append((first + start, first + start + length, name))
    if pair := _overlapping(spans):
        return f"{pair[0]} and {pair[1]} are views of the same bytes (torch.save gives each tensor its own)"
    return None


def _overlapping(spans: list) -> tuple[str, str] | None:
    """The names of the first two of `spans` ((first byte, end, name) each) that share bytes, or None."""
    spans = sorted(spans)
    return next(((one, other) for (_, end, one), (start, _, other) in zip(spans, spans[1:]) if start < end), None)


def tensors_in(state) -> dict:
    """Every tensor of a nested state by its path ("model.wte.weight"); each container once."""
    found, todo, seen = {}, [("", state)], set()
    while todo:
        name, obj = todo.pop()
        if torch.is_tensor(obj):
            found[name] = obj
        elif isinstance(obj, (dict, list, tuple)) and id(obj) not in seen:
            seen.add(id(obj))
            items = obj.items() if isinstance(obj, dict) else enumerate(obj)
            todo += [(f"{name}.{k}" if name else str(k), v) for k, v in items]
    return found


def saved_record(directory: str, name: str):
    """What the torch.save file `name` of a checkpoint's directory holds, read as
    data alone (data_only_loads) and without a tensor's bytes: each a claim
    (saved_claims) held to the file's bytes (zip_problem, tensors_problem), else
    Damaged; but the random generators' states, which rng_problem must try, are
    read. A file in torch's pre-zip format (no records to hold claims to) is read whole."""
    with regular_file(os.path.join(directory, name)) as (f, _), data_only_loads(directory):
        if not zipfile.is_zipfile(f):
            f.seek(0)
            return torch.load(f, map_location="cpu")
        if problem := zip_problem(f):
            raise Damaged(directory, f"{name} {problem}")
        try:
            state = saved_claims(f)
        except (ValueError, TypeError, AttributeError, KeyError, IndexError, EOFError, RecursionError) as e:
            raise Damaged(directory, f"{name} is not as torch.save writes ({type(e).__name__}: {str(e)[:200]})") \
                from None
        if problem := tensors_problem(tensors_in(state)):
            raise Damaged(directory, f"{name}: {problem}")
        for _, rng in _random_states(state) if isinstance(state, dict) else ():
            if isinstance(rng, dict):
                rng.update({k: _with_bytes(f, t) for k, t in rng.items() if torch.is_tensor(t) and t.is_meta})
    return state


def _with_bytes(f, t: torch.Tensor) -> torch.Tensor:
    """A claim of saved_claims' that tensors_problem has passed, with its bytes read from its record in f."""
    first, size = t.untyped_storage().record
    data = torch.empty(size, dtype=torch.uint8)
    f.seek(first)
    f.readinto(data.numpy())
    return data.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


def _random_states(state: dict) -> list[tuple[str, object]]:
    """(where, state) of each random generators' state a checkpoint records: its rng, each pipeline stage's."""
    stages = state.get("pipeline_rng") or []
    return [("rng", state.get("rng")),
            *((f"pipeline_rng[{i}]", r) for i, r in enumerate(stages if isinstance(stages, list) else []))]


def rng_problem(state: dict) -> str | None:
    """Why a checkpoint's random states (its rng, each pipeline stage's) are not ones that
    checkpoint.set_rng_state restores, or None: each is tried on a generator of its own."""
    if not isinstance(state.get("pipeline_rng") or [], list):
        return "its pipeline_rng is not a list"
    for where, rng in _random_states(state):
        if rng is None:  # (an export's)
            continue
        restore = {"python": random.Random().setstate, "numpy": np.random.RandomState().set_state,
                   "torch": torch.Generator().set_state}
        if torch.cuda.is_available() and isinstance(rng, dict) and "cuda" in rng:
            restore["cuda"] = torch.Generator("cuda").set_state
        for key, set_state in restore.items():
            try:
                set_state(rng[key])
            except (KeyError, TypeError, ValueError, IndexError, OverflowError, RuntimeError):
                return f"its {where}[{key!r}] is not the state of a {key} random generator"
    return None


def _whole_numbers(values) -> bool:
    return isinstance(values, (tuple, list)) and all(type(v) is int and v >= 0 for v in values)


def dist_index_problem(directory: str, metadata) -> str | None:
    """Why DCP's index of the checkpoint in `directory` does not describe its
    files as DCP's save writes them, or None. DCP's reader trusts it: it
    allocates each tensor's size, reads each piece where the index says, and
    leaves any part of a tensor no piece covers as it was (uninitialized
    memory). So each tensor's pieces tile it exactly, and each piece's bytes
    lie in its file, hold at least its elements and are no other piece's."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata
    least = {}  # MetadataIndex of each piece -> the fewest bytes it takes in its file
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            least[MetadataIndex(fqn)] = 0
            continue
        if not (isinstance(md, TensorStorageMetadata) and isinstance(getattr(md.properties, "dtype", None),
                                                                      torch.dtype)):
            return f"{DIST_METADATA} describes {fqn!r} as neither a tensor nor bytes"
        if problem := _tiling_problem(md):
            return f"{DIST_METADATA}: {fqn} of size {list(md.size)} {problem}"
        for chunk in md.chunks:
            least[MetadataIndex(fqn, chunk.offsets)] = math.prod(chunk.sizes) * md.properties.dtype.itemsize
    if missing := next((index for index in least if index not in metadata.storage_data), None):
        piece = "" if missing.offset is None else f"'s piece at {list(missing.offset)}"
        return f"{DIST_METADATA} gives no bytes for {missing.fqn}{piece}"
    return _extents_problem(directory, metadata.storage_data, least)


def _tiling_problem(md) -> str | None:
    """Why a tensor's pieces (DCP's chunks) do not tile its size exactly, or None."""
    size, chunks = md.size, md.chunks
    if not _whole_numbers(size) or not isinstance(chunks, list):
        return "is not a tensor's shape, in pieces"
    boxes = []  # (first, end) index of each piece that holds elements
    for chunk in chunks:
        first, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if not (_whole_numbers(first) and _whole_numbers(sizes) and len(first) == len(sizes) == len(size)):
            return f"has a piece that is not one of {len(size)} dimensions ({str(chunk)[:100]})"
        end = [a + n for a, n in zip(first, sizes)]
        if any(e > n for e, n in zip(end, size)):
            return f"has a piece outside it (at {list(first)}, of size {list(sizes)})"
        if math.prod(sizes):
            boxes.append((first, end))
    held = sum(math.prod(e - a for a, e in zip(first, end)) for first, end in boxes)
    if held != math.prod(size):
        return f"is {math.prod(size):,} elements, its pieces hold {held:,}"
    if size:  # a sweep along the dimension the pieces are split most along: each overlap is found
        dim = max(range(len(size)), key=lambda d: len({first[d] for first, _ in boxes}))
        boxes.sort(key=lambda box: box[0][dim])
        reaching = []  # the pieces so far that reach past this one's start along dim
        for first, end in boxes:
            reaching = [(a, e) for a, e in reaching if e[dim] > first[dim]]
            if any(all(x < f and y < g for x, f, y, g in zip(first, e, a, end)) for a, e in reaching):
                return f"has pieces that overlap (one at {list(first)})"
            reaching.append((first, end))
    return None


def _extents_problem(directory: str, storage_data: dict, least: dict) -> str | None:
    """Why the bytes DCP's index gives each piece (storage_data) do not lie
    in its file, the piece's own and as many as it holds (`least`), or None."""
    spans = {}  # file name -> [(first byte, end, the piece's tensor)]
    for index, info in storage_data.items():
        fqn, name = getattr(index, "fqn", index), getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if name == DIST_METADATA:
            return f"{DIST_METADATA} gives its own bytes as {fqn}'s (they are in a .distcp file)"
        if not _whole_numbers([offset, length]):
            return f"{DIST_METADATA} places {fqn} at byte {offset!r}, {length!r} bytes: not an extent of a file"
        if getattr(info, "transform_descriptors", None):
            return f"{DIST_METADATA} gives {fqn}'s bytes transformed ({info.transform_descriptors}), as no save does"
        if length < least.get(index, 0):
            return (f"{DIST_METADATA} gives {fqn} {length:,} bytes of {name}, fewer than its piece's "
                    f"{least[index]:,}")
        spans.setdefault(name, []).append((offset, offset + length, fqn))
    for name, extents in sorted(spans.items()):
        size, (_, end, fqn) = os.path.getsize(os.path.join(directory, name)), max(extents, key=lambda s: s[1])
        if end > size:
            return f"{name} is truncated: {DIST_METADATA} places {fqn}'s bytes up to byte {end:,}, past its {size:,}"
        if pair := _overlapping(extents):
            return f"{DIST_METADATA} places {pair[0]} and {pair[1]} on the same bytes of {name}"
    return None


# What train.py writes beside a DeepSpeed checkpoint's own files (checkpoint.save_deepspeed_checkpoint):
# each field of this value's type, an int at least it (the context- and pipeline-parallel sizes were
# added later: 1 where absent)
DS_META = "trainer_state.json"
DS_FIELDS = {"iteration": 0, "consumed_samples": 0, "zero_stage": 0, "data_parallel_size": 1,
             "tensor_model_parallel_size": 1, "context_parallel_size": 1, "pipeline_model_parallel_size": 1,
             "expert_model_parallel_size": 1, "model_config": {}, "tensor_parallel_layout": {}}


def read_deepspeed_meta(tag_dir: str) -> dict:
    """trainer_state.json of a DeepSpeed checkpoint written by train.py, or a UsageError
    naming what it lacks or records wrong."""
    path = os.path.join(tag_dir, DS_META)
    if not os.path.lexists(path):
        raise UsageError(f"{path} is missing: not a complete checkpoint written by train.py")
    with regular_file(path) as (f, size):
        meta = parse_json(f.read(size), path, ": cut short or damaged")
    if not isinstance(meta, dict) or type(meta.get("iteration")) is not int:
        raise UsageError(f"{path} records no iteration: not the {DS_META} train.py writes")
    meta = {"context_parallel_size": 1, "pipeline_model_parallel_size": 1, "expert_model_parallel_size": 1, **meta}
    if wrong := deepspeed_meta_problem(meta, tag_dir):
        raise UsageError(f"{path} records {wrong}: not the {DS_META} train.py writes, or damaged")
    return meta


def deepspeed_meta_problem(meta: dict, tag_dir: str) -> str | None:
    """What a trainer_state.json records that no load can take, or None."""
    for key, least in DS_FIELDS.items():
        if key not in meta:
            return f"no {key}"
        if type(meta[key]) is not type(least):
            return f"{key} of type {type(meta[key]).__name__}"
        if type(least) is int and meta[key] < least:
            return f"{key} {meta[key]}"
    if meta["zero_stage"] > 3:
        return f"zero_stage {meta['zero_stage']}"
    if not all(isinstance(v, list) and len(v) == 2 and all(type(i) is int for i in v)
               for v in meta["tensor_parallel_layout"].values()):
        return "a tensor_parallel_layout entry that is not [dim, blocks]"
    tp, pp = meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]
    ranks = {int(m[1]) for m in map(re.compile(r".*mp_rank_([0-9]+)_model_states\.pt").fullmatch,
                                    os.listdir(tag_dir)) if m}  # (under ZeRO-3 one file a DP rank too)
    if ranks != set(range(tp * pp)):  # the model-parallel ranks' files
        return (f"tensor- x pipeline-parallel size {tp} x {pp} ({tp * pp} model-parallel ranks), where model "
                f"states are there for {len(ranks)}")
    return None
