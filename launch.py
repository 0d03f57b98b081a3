"""How a program of this project starts, stops and writes files: the one
module every other may import, so it imports none of them.

  1. A user's mistake (UsageError): reported once, by rank 0, as one line;
     a collective that gave up on a dead or silent peer, named (errors_reported);
     SIGTERM before there is anything to save: the process ends at once (sigterm_exits)
  2. torchrun's environment: the default process group, with a fresh store
     for each restart of an elastic job (init_distributed)
  3. Files that appear whole: written under a temporary name, forced to disk,
     renamed into place (atomic_write, fsync_path)
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------
# 1. A user's mistake, reported once
# ----------------------------------------------------------------------------

class UsageError(ValueError):
    """A mistake in the flags, the data or a checkpoint; its message says what
    to do. errors_reported prints it once, with exit status 2 (other errors are bugs)."""


@contextlib.contextmanager
def errors_reported(prog: str):
    """Around a program's whole run (train.py's and evaluate.py's main): a
    user's mistake reported once, and a collective that gave up on a dead or
    silent peer named."""
    try:
        yield
    except UsageError as e:
        report_usage_error(e, prog)
    except RuntimeError as e:  # gloo's and torch.distributed's errors are RuntimeErrors
        if not is_collective_failure(e):
            raise
        report_collective_failure(e, prog)


def global_rank() -> int:
    """This process's rank: the process group's, or before one exists torchrun's RANK."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def say(line: str) -> None:
    """Print a note to the user once, on rank 0 (every one goes through here)."""
    if global_rank() == 0:
        print(line, flush=True)


def report_usage_error(e: UsageError, prog: str) -> None:
    """Rank 0 prints the mistake and exits with status 2; the others wait for
    it in the group's store (or for the launcher to stop them) and stay
    silent. A rank whose wait ends found its mistake alone and prints it."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # train.py's Preemption handler would keep it alive
    rank = global_rank()
    if rank != 0 and dist.is_initialized():
        try:
            dist.distributed_c10d._get_default_store().wait(["usage_error"], datetime.timedelta(seconds=10))
            sys.exit(2)
        except RuntimeError:  # rank 0 saw nothing wrong: this rank's own mistake
            pass
    elif rank != 0:
        time.sleep(10)  # torchrun (or the deepspeed launcher) stops this rank first, as rank 0 exits
    elif dist.is_initialized() and dist.get_world_size() > 1:
        dist.distributed_c10d._get_default_store().set("usage_error", str(e))
    print(f"{prog}: error{'' if rank == 0 else f' (rank {rank})'}: {e}", file=sys.stderr, flush=True)
    sys.exit(2)


def is_collective_failure(e: RuntimeError) -> bool:
    """A collective or the store that gave up on a peer: the timeout ran out,
    or the peer died. gloo raises a plain RuntimeError for both."""
    text = str(e)
    return isinstance(e, dist.DistError) or any(
        s in text for s in ("Timed out waiting", "Connection closed by peer", "Connection reset by peer"))


def report_collective_failure(e: RuntimeError, prog: str) -> None:
    """The traceback, then one line: which collective gave up (the line of
    this project that waited on it) and what it means."""
    traceback.print_exc()
    here = os.path.dirname(os.path.abspath(__file__))
    ours = [f for f in traceback.extract_tb(e.__traceback__)
            if os.path.dirname(os.path.abspath(f.filename)) == here]
    what, where = "a collective", ""
    if ours:
        frame = ours[-1]
        where = f" at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name} (`{frame.line}`)"
        if "backward" in frame.line:  # DDP and ZeRO reduce gradients from autograd hooks
            what = "the gradient all-reduce (run inside backward)"
    print(f"{prog}: error (rank {os.environ.get('RANK', '0')}): {what} failed{where}: "
          f"{str(e).splitlines()[0]}. Another rank stopped answering or died; its own log says "
          f"why. --distributed-timeout-minutes sets how long a collective waits.",
          file=sys.stderr, flush=True)
    sys.exit(1)


def parse_json(data, where: str, then: str = ""):
    """json.loads(data), or one line (UsageError) naming `where` and why it is
    not JSON: cut short, not UTF-8, or nested deeper than Python's parser
    recurses (a RecursionError, which is not a ValueError). `then`: what to do."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        why = getattr(e, "msg", None) or ("nested too deeply" if isinstance(e, RecursionError) else str(e))
        raise UsageError(f"{where}: not JSON ({why}){then}") from None


_sigterm_wakeup = None  # the pipe's write end while sigterm_exits is in force


def sigterm_exits(line: str) -> None:
    """From now until sigterm_calls: SIGTERM (a scheduler's preemption notice,
    `timeout`) ends this process at once, with `line` on stderr and status
    143 (128 + SIGTERM, a shell's status for it), whatever the process is
    doing: reading a file that never answers, waiting on a peer. Python runs
    a handler only between two bytecodes of the main thread, never while it
    waits inside C (a collective, a store), so the byte that the C-level
    handler writes to the wakeup fd is read by a thread of its own."""
    global _sigterm_wakeup
    read, write = os.pipe()
    os.set_blocking(write, False)  # set_wakeup_fd requires it: a signal handler never blocks
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    if _sigterm_wakeup is not None:  # an earlier run in this process (tests): its thread ends
        os.close(_sigterm_wakeup)
    _sigterm_wakeup = write
    threading.Thread(target=_exit_on_sigterm, args=(read, line), daemon=True, name="sigterm").start()
    # Last: until now SIGTERM's default action ended the process (without the line); none is lost.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the thread acts; the main thread need not


def _exit_on_sigterm(read: int, line: str) -> None:
    while received := os.read(read, 64):  # the numbers of the signals caught; b"" once the pipe is closed
        if signal.SIGTERM in received:
            # One write of the whole line: the ranks share one stderr and end together,
            # and print's two writes (the text, then its newline) would interleave.
            os.write(sys.stderr.fileno(), f"{line}\n".encode())
            os._exit(128 + signal.SIGTERM)
    os.close(read)


def sigterm_calls(handler) -> None:
    """From now on SIGTERM calls handler (the main thread, between two
    bytecodes), and no longer ends the process. The handler goes in first:
    a SIGTERM in between still ends the process, none is lost."""
    global _sigterm_wakeup
    signal.signal(signal.SIGTERM, handler)
    if _sigterm_wakeup is not None:
        signal.set_wakeup_fd(-1)
        os.close(_sigterm_wakeup)  # the thread reads the end of the pipe and ends
        _sigterm_wakeup = None


# ----------------------------------------------------------------------------
# 2. torchrun's environment
# ----------------------------------------------------------------------------

@dataclass
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
    """Start the default process group from torchrun's environment (a single
    process without it; gloo on CPU). The groups of a parallel layout are
    parallel.initialize's. one_queue: one hardware queue (see
    parallel._SequenceParallelLinear), set before anything creates the
    CUDA context, which reads it."""
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
            # gloo connects a group's ranks inside init_process_group and
            # new_group, and the rank that dials returns once its connection is
            # made, while its peer may still be accepting it. A rank that then
            # leaves (a user error found right after, a run that ends) closes
            # the socket under that peer, which fails with "Connection closed
            # by peer" instead. torch's switch for a barrier at the end of each
            # makes every rank wait for all. (NCCL connects at first use.)
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
    """init_process_group's store under torchrun: a new one for each attempt.
    The agents' shared store (TORCHELASTIC_USE_AGENT_STORE) keeps a dead
    attempt's keys, and after a restart workers would connect to ranks that
    no longer exist. No attempt number is the same on every node, so rank 0
    starts a store of its own and publishes its address with a fresh nonce,
    which a dead attempt's address cannot answer with."""
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
    """The store rank 0 started for this attempt: read the key again until its
    address answers with its own nonce (it may still hold a dead attempt's)."""
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
# 3. Files written atomically
# ----------------------------------------------------------------------------

def atomic_write(path: str, write) -> None:
    """write(f) into a temporary file beside `path`, force it to disk, rename
    it into place and force the directory entry: a reader, or the machine
    after a power loss, finds the old file or the new one, never a torn one.
    The temporary name is per process: several ranks may write the same file
    (to_hf under tensor parallelism). The project's one atomic write."""
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
    """Force a file's contents, or a directory's entries (a rename into it,
    say), to disk (POSIX: both open read-only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
