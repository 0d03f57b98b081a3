"""Shared test setup.

Runs before any test module is imported, which matters for TRITON_INTERPRET=1:
it lets the Triton kernels in kernels/ run on CPU tensors, and Triton reads it
at import (only set when there is no CUDA device: on a GPU the real kernels
run). The GPT-2 tokenizer needs no setup: prepare.load_tokenizer builds it
from files that requirements.txt installs.
"""
import os
import socket
import sys

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


def free_port() -> int:
    """A TCP port nothing listens on now, for a launcher's rendezvous
    (tests: `from conftest import free_port`)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
