"""Fused GPU kernels in Triton: causal FlashAttention-2 (with grouped-query
attention), and LayerNorm / RMSNorm fused with the residual add.

  runtime.py    whether Triton runs here: the optional import, the
                interpreter switch, require_triton() naming the fix
  attention.py  flash_attention(): the kernels, their autotuned launchers
                (candidates per head dim, dtype and GQA group), the autograd
                wrapper, and the torch reference attention_torch()
  norm.py       layer_norm(), add_layer_norm(), rms_norm(), add_rms_norm(),
                the drop-in modules TritonLayerNorm / TritonRMSNorm, and the
                torch references

Testing without a GPU: with TRITON_INTERPRET=1 set *before* this package is
imported, Triton runs the same kernels on CPU tensors through numpy (slow,
but exact enough to check the maths). Two interpreter quirks are handled in
the kernels' wrappers rather than in the tests: the interpreter's bf16/fp16
arithmetic is not faithful, so inputs are upcast to fp32 before launch and
results cast back; and autotuning needs a real driver, so a single fixed
config is used.
"""
# The public API, as `import kernels; kernels.flash_attention(...)`.
from kernels.runtime import HAS_TRITON, INTERPRET, require_triton, triton_usable
from kernels.attention import SUPPORTED_HEAD_DIMS, attention_torch, flash_attention
from kernels.norm import (TritonLayerNorm, TritonRMSNorm, add_layer_norm, add_rms_norm,
                          layer_norm, layer_norm_torch, rms_norm, rms_norm_torch)

__all__ = ["HAS_TRITON", "INTERPRET", "require_triton", "triton_usable", "SUPPORTED_HEAD_DIMS",
           "attention_torch", "flash_attention", "TritonLayerNorm", "TritonRMSNorm", "add_layer_norm",
           "add_rms_norm", "layer_norm", "layer_norm_torch", "rms_norm", "rms_norm_torch"]
