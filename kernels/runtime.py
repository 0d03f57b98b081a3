"""Whether and how the Triton kernels run here: the optional Triton import,
the interpreter switch, and the check that names the fix when they cannot.

Triton decides at *decoration* time (when kernels is imported) whether
@triton.jit functions are compiled for the GPU or interpreted on the CPU, so
TRITON_INTERPRET is read once, here; setting it later has no effect.
"""
import os

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # the torch fallbacks still work
    triton = None
    tl = None
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

def _device_of(device_or_tensor) -> torch.device:
    if isinstance(device_or_tensor, torch.Tensor):
        return device_or_tensor.device
    return torch.device(device_or_tensor)


def triton_usable(device_or_tensor) -> bool:
    """True when the Triton kernels can run on this device (or tensor's device):
    Triton imports and either the device is CUDA, or the device is CPU and
    TRITON_INTERPRET=1 was set before this module was imported."""
    if not HAS_TRITON:
        return False
    device = _device_of(device_or_tensor)
    if INTERPRET:
        return device.type == "cpu"
    return device.type == "cuda"


def require_triton(device_or_tensor) -> None:
    """Raise a RuntimeError explaining how to fix things when triton_usable() is False."""
    if triton_usable(device_or_tensor):
        return
    device = _device_of(device_or_tensor)
    if not HAS_TRITON:
        why = "the triton package is not installed (pip install triton)"
    elif INTERPRET:
        why = (f"TRITON_INTERPRET=1 is set, so the kernels run only on CPU tensors, "
               f"but got a tensor on {device}; unset TRITON_INTERPRET to use the GPU")
    else:
        why = (f"got a tensor on {device}: the kernels need a CUDA device, or "
               f"TRITON_INTERPRET=1 set before importing kernels to run them on CPU")
    raise RuntimeError(f"attention_impl/layernorm_impl='triton' cannot run: {why}. "
                       f"Use --attention-impl torch --layernorm-impl torch instead.")
