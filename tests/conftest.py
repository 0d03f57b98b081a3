"""Shared test setup.

Runs before any test module is imported, which matters for TRITON_INTERPRET=1:
it lets the Triton kernels in kernels.py run on CPU tensors, and Triton reads it
at import (only set when there is no CUDA device: on a GPU the real kernels
run). The GPT-2 tokenizer needs no setup: prepare.load_tokenizer builds it
from files that requirements.txt installs.
"""
import os
import socket
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
