"""Fused GPU kernels in Triton: causal FlashAttention-2 (with grouped-query
attention), LayerNorm / RMSNorm fused with the residual add, and the fused
loss's row passes. Sections:

  1. whether Triton runs here: the optional import, the interpreter switch,
     require_triton() naming the fix
  2. flash_attention(): the kernels, their autotuned launchers (candidates
     per head dim, dtype and GQA group), the autograd wrapper
  3. layer_norm(), add_layer_norm(), rms_norm(), add_rms_norm(), and the
     drop-in modules TritonLayerNorm / TritonRMSNorm
  4. the row statistics and gradient of a chunk of logits (gpt.fused_lm_loss)

Testing without a GPU: with TRITON_INTERPRET=1 set *before* this module is
imported, Triton runs the same kernels on CPU tensors through numpy (slow,
but exact enough to check the maths). Two interpreter quirks are handled in
the kernels' wrappers rather than in the tests: the interpreter's bf16/fp16
arithmetic is not faithful, so inputs are upcast to fp32 before launch and
results cast back; and autotuning needs a real driver, so a single fixed
config is used.
"""
import functools
import inspect
import math
import os

import torch

from parallel import UsageError


# ============================================================================
# 1. Whether Triton runs here
# ============================================================================
# Whether and how the Triton kernels run here: the optional Triton import,
# the interpreter switch, and the check that names the fix when they cannot.
#
# Triton decides at *decoration* time (when kernels is imported) whether
# @triton.jit functions are compiled for the GPU or interpreted on the CPU, so
# TRITON_INTERPRET is read once, here; setting it later has no effect.

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
    """Raise a UsageError explaining how to fix things when triton_usable() is False."""
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
    raise UsageError(f"attention_impl/layernorm_impl='triton' cannot run: {why}. "
                       f"Use --attention-impl torch --layernorm-impl torch instead.")


# ============================================================================
# 2. Causal FlashAttention-2 (forward, backward), grouped-query attention
# ============================================================================
# Plain attention materialises the (T, T) score matrix in GPU memory, reads it
# back for the softmax and again for the product with V: at T=2048 that is 4M
# floats per head, moved three times. FlashAttention keeps a (BLOCK_M, BLOCK_N)
# tile of scores in registers, folds it into the output with an *online
# softmax* (a running max and running denominator per row), and never writes
# the (T, T) matrix at all. The backward pass recomputes the tiles from the
# saved per-row log-sum-exp instead of storing the probabilities.
#
#   2a. the kernels: forward, backward preprocess, dK/dV, dQ
#   2b. launchers: autotuned on CUDA (candidates per head dim, dtype and GQA
#       group), a single fixed config in the interpreter
#   2c. the custom operators with their autograd, and flash_attention()

SUPPORTED_HEAD_DIMS = (32, 64, 128)
LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e)); exp2 is the fast hardware op


# ---------------------------------------------------------------------------
# 2a. Attention kernels
#
# q, o, do and dq are (B, H, T, D) tensors, k, v, dk and dv (B, G, T, D),
# with any strides whose last dim is contiguous: the model passes q, k, v as
# transposed views of its fused QKV projection, (B, T, 3, H, D) in memory,
# and the kernels read them in place instead of copying. Program (i, bh)
# works on head bh = b*H + h, whose row t starts at b*stride_b + h*stride_h +
# t*stride_t. Grouped-query attention (G < H key/value heads, GROUP = H/G):
# query head h reads key/value head h // GROUP in place (_kv_head), never a
# per-query-head copy, and dK, dV sum over the GROUP query heads that read
# them. k and v share one set of strides, q its own; o and the gradients
# ((B, T, H, D) in memory, so the model's transpose back to (B, T, C) is
# free) theirs; do its own. lse and delta are (B*H, T) fp32.
# Scores are kept in base 2: s2 = (q.k) * sm_scale * log2(e), and
# lse2 = max + log2(sum exp2(s2 - max)), so that p = exp2(s2 - lse2).
# T_BUCKET (next power of two >= T) is unused by the maths: it is only the
# autotuning key on CUDA, see _build_launchers.
# ---------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _load_rows(P, base, rows, T, stride_t, HEAD_DIM: tl.constexpr):
        """The (len(rows), HEAD_DIM) tile of rows `rows` of the head starting at
        P + base; rows at or past T (the ragged last block) read as zeros."""
        offs = base + rows[:, None] * stride_t + tl.arange(0, HEAD_DIM)[None, :]
        return tl.load(P + offs, mask=rows[:, None] < T, other=0.0)

    @triton.jit
    def _store_rows(P, base, rows, T, stride_t, tile, HEAD_DIM: tl.constexpr):
        """Write `tile` to rows `rows` of the head starting at P + base, in P's
        dtype; rows at or past T are skipped."""
        offs = base + rows[:, None] * stride_t + tl.arange(0, HEAD_DIM)[None, :]
        tl.store(P + offs, tile.to(P.dtype.element_ty), mask=rows[:, None] < T)

    @triton.jit
    def _head_base(bh, H, stride_b, stride_h):
        """Offset of head bh = b*H + h in a tensor with these strides (int64:
        B*H*T*D can exceed 2**31)."""
        return (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h

    @triton.jit
    def _kv_head(bh, H, GROUP):
        """The key/value head b*G + h // GROUP that query head bh = b*H + h
        reads (G = H / GROUP; GROUP = 1 is plain multi-head attention)."""
        return (bh // H) * (H // GROUP) + (bh % H) // GROUP

    @triton.jit
    def _heavy_first(BLOCK: tl.constexpr):
        """Start row of this program's block, counting from the end: under the
        causal mask the last query blocks have the most keys to visit, and
        launching them first keeps the GPU from idling on a long tail."""
        return (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK

    @triton.jit
    def _attn_fwd_inner(acc, l_i, m_i, q, K, V, kv_base, stride_t, offs_m, T, qk_scale,
                        lo, hi, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                        MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
        """Fold key/value blocks [lo, hi) into the running softmax state of one
        query block. MASKED=False is the fast path for blocks that are fully
        visible (strictly below the causal diagonal and inside T)."""
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = _load_rows(K, kv_base, offs_n, T, stride_t, HEAD_DIM)  # (BN, D)
            v = _load_rows(V, kv_base, offs_n, T, stride_t, HEAD_DIM)  # (BN, D)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BM, BN)
            if MASKED:
                keep = offs_n[None, :] < T
                if CAUSAL:
                    keep = keep & (offs_m[:, None] >= offs_n[None, :])
                s = tl.where(keep, s, float("-inf"))
            # online softmax: rescale what we have so far to the new row max
            m_new = tl.maximum(m_i, tl.max(s, 1))           # (BM,)
            p = tl.math.exp2(s - m_new[:, None])            # (BM, BN)
            alpha = tl.math.exp2(m_i - m_new)               # (BM,) correction factor
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _attn_fwd_kernel(Q, K, V, O, LSE, T, H, GROUP: tl.constexpr, stride_qb, stride_qh, stride_qt,
                         stride_kb, stride_kh, stride_kt,
                         stride_ob, stride_oh, stride_ot, qk_scale, T_BUCKET,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
        """One program = one block of BLOCK_M queries of one (batch, head)."""
        start_m = _heavy_first(BLOCK_M)
        bh = tl.program_id(1)
        q_base = _head_base(bh, H, stride_qb, stride_qh)
        kv_base = _head_base(_kv_head(bh, H, GROUP), H // GROUP, stride_kb, stride_kh)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_rows(Q, q_base, offs_m, T, stride_qt, HEAD_DIM)  # (BM, D)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running row max
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                # running denominator
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)      # running numerator @ V
        if CAUSAL:
            # stage 1: key blocks entirely left of the diagonal, no mask needed
            acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, kv_base, stride_kt, offs_m,
                                            T, qk_scale, 0, start_m, HEAD_DIM, BLOCK_N, False,
                                            True, DOT_PRECISION)
            # stage 2: the diagonal blocks; key blocks right of them are skipped
            hi = tl.minimum(start_m + BLOCK_M, T)
            acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, kv_base, stride_kt, offs_m,
                                            T, qk_scale, start_m, hi, HEAD_DIM, BLOCK_N, True,
                                            True, DOT_PRECISION)
        else:
            acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, kv_base, stride_kt, offs_m,
                                            T, qk_scale, 0, T, HEAD_DIM, BLOCK_N, True, False,
                                            DOT_PRECISION)
        o = acc / l_i[:, None]
        _store_rows(O, _head_base(bh, H, stride_ob, stride_oh), offs_m, T, stride_ot, o, HEAD_DIM)
        tl.store(LSE + bh.to(tl.int64) * T + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < T)

    @triton.jit
    def _attn_bwd_preprocess_kernel(O, DO, DELTA, T, H, stride_ob, stride_oh, stride_ot,
                                    stride_dob, stride_doh, stride_dot,
                                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
        """delta_i = sum_d dO_id * O_id: the softmax-backward term shared by dK and dQ."""
        bh = tl.program_id(1)
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        o = _load_rows(O, _head_base(bh, H, stride_ob, stride_oh), offs_m, T, stride_ot,
                       HEAD_DIM).to(tl.float32)
        do = _load_rows(DO, _head_base(bh, H, stride_dob, stride_doh), offs_m, T, stride_dot,
                        HEAD_DIM).to(tl.float32)
        tl.store(DELTA + bh.to(tl.int64) * T + offs_m, tl.sum(o * do, 1), mask=offs_m < T)

    @triton.jit
    def _attn_bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, q_base, stride_qt, do_base,
                             stride_dot, row_base, offs_n, T, qk_scale, lo, hi,
                             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                             MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """Accumulate dK, dV of one key block over query blocks [lo, hi).
        Works on transposed tiles (keys along rows) so the sums over queries
        are plain matmuls: dV += P^T dO, dK += dS^T Q."""
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q = _load_rows(Q, q_base, offs_m, T, stride_qt, HEAD_DIM)      # (BM, D)
            do = _load_rows(DO, do_base, offs_m, T, stride_dot, HEAD_DIM)  # (BM, D)
            # padded query rows get lse=+inf, so their probabilities are exactly 0
            lse = tl.load(LSE + row_base + offs_m, mask=offs_m < T, other=float("inf"))
            delta = tl.load(DELTA + row_base + offs_m, mask=offs_m < T, other=0.0)
            s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # (BN, BM)
            p_t = tl.math.exp2(s_t - lse[None, :])                                 # (BN, BM)
            if MASKED:
                p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)           # (BN, BM)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
        return dk, dv

    @triton.jit
    def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, T, H, GROUP: tl.constexpr,
                              stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                              stride_dob, stride_doh, stride_dot, stride_gb, stride_gh, stride_gt,
                              sm_scale, qk_scale, T_BUCKET,
                              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                              DOT_PRECISION: tl.constexpr):
        """One program = one block of BLOCK_N keys of one (batch, key/value
        head); it alone writes their dK, dV (no atomics), looping over the
        GROUP query heads that read them and every query block that can see
        them. Program 0 has the most query blocks to visit: heavy blocks start first."""
        start_n = tl.program_id(0) * BLOCK_N
        bkv = tl.program_id(1)                   # b*G + g
        G = H // GROUP
        kv_base = _head_base(bkv, G, stride_kb, stride_kh)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(K, kv_base, offs_n, T, stride_kt, HEAD_DIM)  # (BN, D)
        v = _load_rows(V, kv_base, offs_n, T, stride_kt, HEAD_DIM)  # (BN, D)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        for j in range(0, GROUP):                # the query heads sharing this K, V
            bh = (bkv // G) * H + (bkv % G) * GROUP + j
            q_base = _head_base(bh, H, stride_qb, stride_qh)
            do_base = _head_base(bh, H, stride_dob, stride_doh)
            row_base = bh.to(tl.int64) * T
            if CAUSAL:
                # diagonal query blocks (masked), then every query block below them
                mid = tl.minimum(start_n + BLOCK_N, T)
                dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, q_base, stride_qt,
                                              do_base, stride_dot, row_base, offs_n, T, qk_scale,
                                              start_n, mid, HEAD_DIM, BLOCK_M, True, DOT_PRECISION)
                dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, q_base, stride_qt,
                                              do_base, stride_dot, row_base, offs_n, T, qk_scale,
                                              mid, T, HEAD_DIM, BLOCK_M, False, DOT_PRECISION)
            else:
                dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, q_base, stride_qt,
                                              do_base, stride_dot, row_base, offs_n, T, qk_scale,
                                              0, T, HEAD_DIM, BLOCK_M, False, DOT_PRECISION)
        # s = sm_scale * q.k, so dK picks up the scale once, here
        g_base = _head_base(bkv, G, stride_gb, stride_gh)
        _store_rows(DK, g_base, offs_n, T, stride_gt, dk * sm_scale, HEAD_DIM)
        _store_rows(DV, g_base, offs_n, T, stride_gt, dv, HEAD_DIM)

    @triton.jit
    def _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, kv_base, stride_t, offs_m, T, qk_scale,
                           lo, hi, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                           MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                           DOT_PRECISION: tl.constexpr):
        """Accumulate dQ of one query block over key blocks [lo, hi): dQ += dS K."""
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = _load_rows(K, kv_base, offs_n, T, stride_t, HEAD_DIM)  # (BN, D)
            v = _load_rows(V, kv_base, offs_n, T, stride_t, HEAD_DIM)  # (BN, D)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BM, BN)
            p = tl.math.exp2(s - lse[:, None])
            if MASKED:
                keep = offs_n[None, :] < T
                if CAUSAL:
                    keep = keep & (offs_m[:, None] >= offs_n[None, :])
                p = tl.where(keep, p, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)           # (BM, BN)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
        return dq

    @triton.jit
    def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, T, H, GROUP: tl.constexpr,
                            stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                            stride_dob, stride_doh, stride_dot, stride_gb, stride_gh, stride_gt,
                            sm_scale, qk_scale, T_BUCKET,
                            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                            DOT_PRECISION: tl.constexpr):
        """One program = one block of BLOCK_M queries; it alone writes their dQ."""
        start_m = _heavy_first(BLOCK_M)
        bh = tl.program_id(1)
        q_base = _head_base(bh, H, stride_qb, stride_qh)
        kv_base = _head_base(_kv_head(bh, H, GROUP), H // GROUP, stride_kb, stride_kh)
        row_base = bh.to(tl.int64) * T
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_rows(Q, q_base, offs_m, T, stride_qt, HEAD_DIM)                      # (BM, D)
        do = _load_rows(DO, _head_base(bh, H, stride_dob, stride_doh), offs_m, T, stride_dot,
                        HEAD_DIM)                                                        # (BM, D)
        lse = tl.load(LSE + row_base + offs_m, mask=offs_m < T, other=float("inf"))
        delta = tl.load(DELTA + row_base + offs_m, mask=offs_m < T, other=0.0)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        if CAUSAL:
            dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, kv_base, stride_kt, offs_m, T,
                                    qk_scale, 0, start_m, HEAD_DIM, BLOCK_N, False, True,
                                    DOT_PRECISION)
            hi = tl.minimum(start_m + BLOCK_M, T)
            dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, kv_base, stride_kt, offs_m, T,
                                    qk_scale, start_m, hi, HEAD_DIM, BLOCK_N, True, True,
                                    DOT_PRECISION)
        else:
            dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, kv_base, stride_kt, offs_m, T,
                                    qk_scale, 0, T, HEAD_DIM, BLOCK_N, True, False,
                                    DOT_PRECISION)
        _store_rows(DQ, _head_base(bh, H, stride_gb, stride_gh), offs_m, T, stride_gt,
                    dq * sm_scale, HEAD_DIM)


# ---------------------------------------------------------------------------
# 2b. Launchers. On CUDA the attention kernels go through triton.autotune (the
# best tiles depend on the GPU, T, D and dtype); the interpreter has no driver
# to time configs with, so it runs one fixed, small config (small tiles are
# also what keeps the numpy interpreter fast).
# ---------------------------------------------------------------------------
_FIXED_ATTN = dict(BLOCK_M=16, BLOCK_N=16)

# Candidate (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and head dim:
# few enough that autotuning the first step stays cheap, and none that spills
# registers for 16-bit inputs (bench/check_compile.py, sm_90, fails if one
# does). The forward and dQ kernels step through the diagonal with
# BLOCK_N-sized key blocks, so BLOCK_M % BLOCK_N == 0; the dK/dV kernel steps
# with BLOCK_M-sized query blocks, so BLOCK_N % BLOCK_M == 0. 128-row tiles
# are what FlashAttention-2 uses on Hopper.
ATTN_CONFIGS = {
    # head dims 32 and 64
    "fwd": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2),
            (64, 64, 4, 3), (64, 64, 4, 4)],
    "dkdv": [(32, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3)],
    "dq": [(128, 32, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2), (64, 32, 4, 3),
           (64, 64, 4, 3), (128, 128, 8, 2)],
}
# Head dim 128 doubles the accumulators: the configs above that spilled there
# (fwd 128x64 with 4 warps; dK/dV with 128-wide key blocks on 4 warps, or
# 64x128 on 8; dQ 128x32 and 128x128) give way to 8-warp or shallower ones
# that compile without spills.
ATTN_CONFIGS_D128 = {
    "fwd": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 2),
            (64, 64, 4, 3), (64, 64, 4, 4)],
    "dkdv": [(32, 128, 8, 3), (64, 64, 8, 3), (64, 64, 8, 2), (32, 64, 8, 3), (32, 64, 4, 2)],
    "dq": [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (64, 64, 8, 3),
           (64, 32, 4, 3), (64, 64, 4, 3)],
}
# Grouped-query attention: a dK/dV program loops over the GROUP query heads
# that read its key/value head, and the loop costs registers. At head dim
# 128 every dK/dV candidate above spills then; these smaller tiles do not
# (GROUP 1 and 4). At 32 and 64 only 64x64 on 4 warps does, and is dropped.
GQA_DKDV_CONFIGS = {
    64: [(32, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3)],
    128: [(32, 64, 8, 2), (16, 128, 8, 3), (16, 128, 8, 2), (16, 64, 8, 3), (32, 32, 4, 3), (32, 32, 4, 2)],
}
# KERNELS_AUTOTUNE=wide (read at import) searches every tile shape x warps x
# stages instead: slow to tune, for finding a new GPU's best configs.
_WIDE_SHAPES = {"fwd": [(64, 32), (64, 64), (128, 32), (128, 64), (128, 128)],
                "dkdv": [(32, 64), (32, 128), (64, 64), (64, 128), (128, 128)],
                "dq": [(64, 32), (64, 64), (128, 32), (128, 64), (128, 128)]}


def _attn_tiles(kernel: str, head_dim: int, group: int = 1) -> list:
    """The candidate tiles of `kernel` at one head dim and GQA group size
    (see ATTN_CONFIGS and GQA_DKDV_CONFIGS)."""
    if kernel == "dkdv" and group > 1:
        return GQA_DKDV_CONFIGS[128 if head_dim == 128 else 64]
    return (ATTN_CONFIGS_D128 if head_dim == 128 else ATTN_CONFIGS)[kernel]


def _attn_configs(kernel: str, wide: bool = False):
    """Every candidate of `kernel`, for all head dims: autotune gets them all,
    and _prune_attn_configs keeps the ones for the head dim at hand."""
    if wide:
        tiles = [(bm, bn, w, s) for bm, bn in _WIDE_SHAPES[kernel] for w in (4, 8)
                 for s in (2, 3, 4, 5)]
    else:
        tiles = list(dict.fromkeys(t for head_dim in (64, 128) for group in (1, 2)
                                   for t in _attn_tiles(kernel, head_dim, group)))
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in tiles]


def _keep_attn_config(config, kernel: str, head_dim: int, dtype, group: int = 1,
                      wide: bool = False) -> bool:
    """Whether autotune times `config` for this head dim, input dtype and
    GQA group size.

    16-bit inputs: the head dim's own candidates (all of them in wide mode).
    fp32 inputs (only without autocast) take 4 bytes an element: the small
    tiles of ATTN_CONFIGS, which fit in shared memory; they still spill at
    head dim >= 64 (every fp32 config does), one reason fp32 runs use TF32."""
    tile = (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)
    if dtype == torch.float32:
        return tile in ATTN_CONFIGS[kernel] and tile[0] * tile[1] <= 64 * 64 and tile[3] <= 3
    return wide or tile in _attn_tiles(kernel, head_dim, group)


def _prune_attn_configs(kernel: str, wide: bool, configs, named_args, **kwargs):
    """triton.autotune's early_config_prune hook: the configs worth timing
    for q's head dim and dtype and the GQA group size."""
    q, group = named_args["Q"], named_args["GROUP"]
    kept = [c for c in configs if _keep_attn_config(c, kernel, q.shape[-1], q.dtype, group, wide)]
    return kept or configs[:1]


def _autotune_kwargs(kernel: str, wide: bool) -> dict:
    """Tune once per (T bucket, head dim, GQA group, causal, dot precision; Triton adds
    the dtypes) and, where this Triton can, keep the result on disk next to the
    compiled kernels (~/.triton/cache, or TRITON_CACHE_DIR), keyed by the GPU
    target, the Triton version and the kernel source: the first step of a
    second run reuses it instead of re-timing every config. Only the
    candidates for the head dim and dtype at hand are timed (_keep_attn_config)."""
    kw = dict(key=["T_BUCKET", "HEAD_DIM", "GROUP", "CAUSAL", "DOT_PRECISION"],
              prune_configs_by={"early_config_prune": functools.partial(_prune_attn_configs, kernel, wide)})
    if "cache_results" in inspect.signature(triton.autotune).parameters:  # Triton >= 3.2
        kw["cache_results"] = True
    return kw


def _build_launchers():
    if not HAS_TRITON:
        return {}
    kernels = {"fwd": _attn_fwd_kernel, "dkdv": _attn_bwd_dkdv_kernel, "dq": _attn_bwd_dq_kernel}
    if INTERPRET:
        return kernels
    # Tune per power-of-two bucket of T (the kernels' T_BUCKET argument, unused
    # inside them), not per exact T: generate() grows T by one token per step,
    # and re-benchmarking all configs for every new length takes seconds.
    wide = os.environ.get("KERNELS_AUTOTUNE", "").lower() == "wide"
    return {name: triton.autotune(_attn_configs(name, wide), **_autotune_kwargs(name, wide))(fn)
            for name, fn in kernels.items()}


_LAUNCHERS = _build_launchers()  # built once at import; read-only afterwards


def _launch_attn(name: str, num_rows: int, bh: int, *args, **constexprs):
    """Launch attention kernel `name` over (row blocks, B*H) programs. The grid is
    a function of the chosen config because autotuning changes the block size;
    `rows_block` is the constexpr whose block tiles the grid's first axis."""
    rows_block = "BLOCK_N" if name == "dkdv" else "BLOCK_M"
    grid = lambda meta: (triton.cdiv(num_rows, meta[rows_block]), bh)  # noqa: E731
    fixed = _FIXED_ATTN if INTERPRET else {}
    bucket = max(16, triton.next_power_of_2(num_rows))  # autotuning key, see _build_launchers
    _LAUNCHERS[name][grid](*args, T_BUCKET=bucket, **constexprs, **fixed)


# ---------------------------------------------------------------------------
# 2c. custom operators, autograd and public API
# ---------------------------------------------------------------------------
def _check_attention_inputs(q, k, v):
    B, H, T, D = q.shape if q.dim() == 4 else (None,) * 4
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or (k.shape[0], k.shape[2:]) != (B, (T, D)) \
            or H % k.shape[1] != 0:
        raise UsageError(f"flash_attention expects q (B, H, T, D) and k, v (B, G, T, D) with G "
                         f"dividing H (G < H: grouped-query attention); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise UsageError(f"flash_attention supports head dims {SUPPORTED_HEAD_DIMS}, got "
                         f"D={q.shape[-1]}; change hidden_size/num_attention_heads or use "
                         f"attention_impl='torch'")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or len({q.dtype, k.dtype, v.dtype}) != 1:
        raise UsageError(f"flash_attention needs q, k, v of one dtype among fp32/fp16/bf16; "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}")
    require_triton(q)


def _dot_precision(dtype) -> str:
    """Precision of tl.dot on fp32 inputs. Exact IEEE products by default, so
    fp32 matches the torch reference; TF32 (~1e-3 relative error, 8x the
    speed on Ampere and later) when torch's own fp32 matmuls use it
    (torch.set_float32_matmul_precision("high"), as train.py sets for fp32
    runs on a GPU). Ignored for 16-bit inputs."""
    if dtype == torch.float32 and (INTERPRET or torch.get_float32_matmul_precision() == "highest"):
        return "ieee"
    return "tf32"


def _bhtd_strides(t):
    """(stride_b, stride_h, stride_t) of a (B, H, T, D) tensor."""
    return t.stride(0), t.stride(1), t.stride(2)


def _rows_last(t):
    """t itself when its last dim is contiguous (any other strides are fine:
    the kernels take them), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _empty_bthd(like):
    """An empty (B, H, T, D) tensor laid out as (B, T, H, D) in memory: the
    layout the model reshapes to (B, T, C) next, so that reshape is free."""
    B, H, T, D = like.shape
    return torch.empty((B, T, H, D), device=like.device, dtype=like.dtype).transpose(1, 2)


def _check_int32_offsets(T, *tensors):
    # Row offsets t * stride_t are int32 inside the kernels (heads are int64).
    for t in tensors:
        if T * t.stride(2) >= 2 ** 31:
            raise UsageError(f"flash_attention: sequence length {T} with a row stride of "
                             f"{t.stride(2)} elements overflows the kernels' int32 row offsets; "
                             f"use a shorter sequence or attention_impl='torch'")


def _kernel_inputs(q, k, v):
    """q, k, v as the kernels read them: last dim contiguous, k and v with one
    set of strides, fp32 under the interpreter (its half-precision maths is
    unreliable)."""
    if INTERPRET:
        q, k, v = q.float(), k.float(), v.float()
    q, k, v = _rows_last(q), _rows_last(k), _rows_last(v)
    if k.stride() != v.stride():  # the kernels take one set of strides for both
        k, v = k.contiguous(), v.contiguous()
    return q, k, v


def _attn_forward(q, k, v, causal, sm_scale):
    """Launch the forward kernel on _kernel_inputs: (o, lse), o in q's dtype
    and (B, T, H, D) memory layout, lse (B*H, T) fp32."""
    B, H, T, D = q.shape
    o = _empty_bthd(q)
    _check_int32_offsets(T, q, k, o)
    lse = torch.empty((B * H, T), device=q.device, dtype=torch.float32)
    _launch_attn("fwd", T, B * H, q, k, v, o, lse, T, H, H // k.shape[1], *_bhtd_strides(q),
                 *_bhtd_strides(k), *_bhtd_strides(o), sm_scale * LOG2E, HEAD_DIM=D,
                 CAUSAL=causal, DOT_PRECISION=_dot_precision(q.dtype))
    return o, lse


def _attn_backward(do, q, k, v, o, lse, causal, sm_scale):
    """Launch the backward kernels on _kernel_inputs and forward's o, lse:
    (dq, dk, dv) in q's dtype."""
    B, H, T, D = q.shape
    do = _rows_last(do.to(q.dtype))
    _check_int32_offsets(T, do)
    delta = torch.empty_like(lse)
    block = 16 if INTERPRET else 64
    grid = (triton.cdiv(T, block), B * H)
    _attn_bwd_preprocess_kernel[grid](o, do, delta, T, H, *_bhtd_strides(o),
                                      *_bhtd_strides(do), HEAD_DIM=D, BLOCK_M=block)
    dq, dk, dv = _empty_bthd(q), _empty_bthd(k), _empty_bthd(k)  # strides: o's layout
    consts = dict(HEAD_DIM=D, CAUSAL=causal, DOT_PRECISION=_dot_precision(q.dtype))
    G = k.shape[1]  # key/value heads: one dK/dV program row per (batch, kv head)
    inputs = (T, H, H // G, *_bhtd_strides(q), *_bhtd_strides(k), *_bhtd_strides(do))
    scales = (sm_scale, sm_scale * LOG2E)
    _launch_attn("dkdv", T, B * G, q, k, v, do, lse, delta, dk, dv, *inputs,
                 *_bhtd_strides(dk), *scales, **consts)
    _launch_attn("dq", T, B * H, q, k, v, do, lse, delta, dq, *inputs,
                 *_bhtd_strides(dq), *scales, **consts)
    return dq, dk, dv


# The kernels as custom operators with their autograd: torch.compile sees one
# opaque op with a fake (shape-only) implementation instead of tracing into
# the launchers (and, on CPU, into Triton's interpreter), and fuses the code
# around it; eager mode runs the same ops.

@torch.library.custom_op("kernels::flash_attention", mutates_args=())
def flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) = FlashAttention-2 forward, o in q's dtype."""
    o, lse = _attn_forward(*_kernel_inputs(q, k, v), causal, sm_scale)
    return o.to(q.dtype), lse


@flash_attention_op.register_fake
def _(q, k, v, causal, sm_scale):
    B, H, T, _ = q.shape
    return _empty_bthd(q), q.new_empty((B * H, T), dtype=torch.float32)


@torch.library.custom_op("kernels::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                o: torch.Tensor, lse: torch.Tensor, causal: bool,
                                sm_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of flash_attention_op, in q's dtype."""
    q2, k2, v2 = _kernel_inputs(q, k, v)
    grads = _attn_backward(do, q2, k2, v2, o.to(q2.dtype), lse, causal, sm_scale)
    return tuple(g.to(q.dtype) for g in grads)


@flash_attention_backward_op.register_fake
def _(do, q, k, v, o, lse, causal, sm_scale):
    return _empty_bthd(q), _empty_bthd(k), _empty_bthd(k)


def _flash_attention_setup(ctx, inputs, output):
    q, k, v, causal, sm_scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.causal, ctx.sm_scale = causal, sm_scale


def _flash_attention_grad(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    return (*flash_attention_backward_op(do, q, k, v, o, lse, ctx.causal, ctx.sm_scale), None, None)


flash_attention_op.register_autograd(_flash_attention_grad, setup_context=_flash_attention_setup)


def flash_attention(q, k, v, causal: bool = True, sm_scale: float | None = None):
    """Fused attention softmax(q k^T * sm_scale + causal mask) v.

    q: (B, H, T, D), k, v: (B, G, T, D) tensors, same dtype (fp32/fp16/bf16),
    D in {32, 64, 128}; G < H is grouped-query attention (query head h
    attends with key/value head h // (H/G), read in place);
    accumulation is fp32. sm_scale defaults to 1/sqrt(D). Returns (B, H, T, D).
    Differentiable (FlashAttention-2 backward, recomputing probabilities)."""
    _check_attention_inputs(q, k, v)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    return flash_attention_op(q, k, v, bool(causal), float(sm_scale))[0]


# ============================================================================
# 3. LayerNorm and RMSNorm, fused with the residual add
# ============================================================================
# One pass forward, one backward with per-program partial dW/dB, each
# optionally fused with the residual add that precedes the norm. LayerNorm is
# memory bound: one fused pass (read x once, write y once) beats the several
# elementwise kernels an unfused version launches.
#
#   3a. the kernels (RMS: a constexpr switch, no mean and no bias)
#   3b. launch helpers, autograd wrappers, the public functions and modules

# ---------------------------------------------------------------------------
# 3a. LayerNorm kernels. x is viewed as (M, N) rows; BLOCK_N = next_pow2(N).
# ---------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _layer_norm_fwd_kernel(X, RES, W, B, Y, SUM, MEAN, RSTD, M, N, eps,
                               HAS_RESIDUAL: tl.constexpr, RMS: tl.constexpr, ROWS: tl.constexpr,
                               BLOCK_N: tl.constexpr):
        """One program = a tile of ROWS whole rows (ROWS=1 for wide rows):
        y = (x - mean) * rstd * w + b, statistics in fp32.
        RMS (RMSNorm, Zhang & Sennrich 2019): no mean and no bias,
        y = x * rstd * w with rstd = 1/sqrt(mean(x^2) + eps); MEAN, B unused.
        HAS_RESIDUAL: first s = x + res (the pre-LN block's residual add),
        written to SUM, then y = LayerNorm(s). Unfused, one kernel writes s
        and the next reads it back; here it is written once and normalized
        from registers. RES and SUM are not touched otherwise."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (R,)
        cols = tl.arange(0, BLOCK_N)                          # (BN,)
        mask = (rows[:, None] < M) & (cols[None, :] < N)      # (R, BN)
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(RES + offs, mask=mask, other=0.0).to(tl.float32)
            # round s to its storage dtype before normalizing, exactly like
            # an unfused add would; backward re-reads the stored s
            s = x.to(SUM.dtype.element_ty)
            tl.store(SUM + offs, s, mask=mask)
            x = s.to(tl.float32)
        if RMS:
            xc = x                                               # padded columns are 0
        else:
            mean = tl.sum(x, 1) / N                              # (R,)
            xc = tl.where(mask, x - mean[:, None], 0.0)  # padded columns must not add to the variance
            tl.store(MEAN + rows, mean, mask=rows < M)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 1) / N + eps)       # (R,)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * w[None, :]
        if not RMS:
            y += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd, mask=rows < M)

    @triton.jit
    def _layer_norm_bwd_kernel(X, W, DY, DSUM, DX, MEAN, RSTD, DW_PARTIAL, DB_PARTIAL, M, N,
                               HAS_DSUM: tl.constexpr, RMS: tl.constexpr, ROWS: tl.constexpr,
                               BLOCK_N: tl.constexpr):
        """Program p handles row tiles p, p+G, p+2G, ... (G = number of programs).
        dx is finished per row; dW and dB are sums over rows, so each program
        keeps its own fp32 partial sums and writes them to row p of a (G, N)
        buffer, summed afterwards. No atomics, and the result is deterministic.
        HAS_DSUM (fused residual add): s = x + res also flowed on along the
        residual stream, so its gradient DSUM is added to dx here; the sum is
        then the gradient of both x and res. RMS: xhat = x * rstd has no
        mean term, so dx loses its mean(w*dy) term, and there is no dB."""
        pid = tl.program_id(0)
        num_programs = tl.num_programs(0)
        cols = tl.arange(0, BLOCK_N)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)  # (BN,)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_N], dtype=tl.float32)
        for tile in range(pid, tl.cdiv(M, ROWS), num_programs):
            rows = tile * ROWS + tl.arange(0, ROWS)                 # (R,)
            mask = (rows[:, None] < M) & (cols[None, :] < N)        # (R, BN)
            offs = rows[:, None].to(tl.int64) * N + cols[None, :]
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=rows < M, other=0.0)
            if RMS:
                xhat = x * rstd[:, None]                            # padded columns are 0
            else:
                mean = tl.load(MEAN + rows, mask=rows < M, other=0.0)
                xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            wdy = w[None, :] * dy
            # dx = rstd * (w*dy - mean(w*dy) - xhat * mean(w*dy*xhat)); RMS: no mean(w*dy)
            c1 = tl.sum(xhat * wdy, 1) / N                          # (R,)
            dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
            if not RMS:
                dx -= (tl.sum(wdy, 1) / N)[:, None] * rstd[:, None]
            if HAS_DSUM:
                dx += tl.load(DSUM + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
            dw += tl.sum(dy * xhat, 0)
            if not RMS:
                db += tl.sum(dy, 0)
        tl.store(DW_PARTIAL + pid * N + cols, dw, mask=cols < N)
        if not RMS:
            tl.store(DB_PARTIAL + pid * N + cols, db, mask=cols < N)


# ---------------------------------------------------------------------------
# 3b. Launch helpers, autograd wrappers and public API
# ---------------------------------------------------------------------------
_MAX_LN_BYTES = 65536  # one row must fit in a program's registers/shared memory


def _layer_norm_config(N: int):
    """(BLOCK_N, ROWS, num_warps) for rows of N elements. A program holds
    ROWS x BLOCK_N fp32 values: narrow rows are batched so each program still
    moves a useful amount of memory (and the interpreter launches fewer
    programs); wide rows get one row per program and more warps."""
    block_n = triton.next_power_of_2(N)
    rows = max(1, min(16, 2048 // block_n)) if not INTERPRET else 16
    num_warps = min(max(block_n * rows // 512, 1), 16)
    return block_n, rows, num_warps


def _ln_forward(x2, res2, weight, bias, eps, out_dtype=None):
    """Launch the forward kernel on (M, N) rows. With res2, s = x2 + res2 is
    computed first (in the promoted dtype, like torch's `+`) and normalized.
    y is written in out_dtype (default: the dtype of what is normalized).
    bias None: RMSNorm (no mean, no bias). Returns y, s (None without
    res2), mean, rstd and the launch config."""
    M, N = x2.shape
    rms = bias is None
    weight = weight.contiguous()
    bias = weight if rms else bias.contiguous()  # RMS: an unused stand-in
    s = None
    if res2 is not None:
        s = torch.empty_like(x2, dtype=torch.promote_types(x2.dtype, res2.dtype))
    y = torch.empty_like(x2 if s is None else s, dtype=out_dtype)
    mean = torch.empty(M, device=x2.device, dtype=torch.float32)
    rstd = torch.empty(M, device=x2.device, dtype=torch.float32)
    block_n, rows, num_warps = _layer_norm_config(N)
    # without a residual, x2 stands in for the unused RES and SUM pointers
    _layer_norm_fwd_kernel[(triton.cdiv(M, rows),)](
        x2, x2 if res2 is None else res2, weight, bias, y, x2 if s is None else s, mean, rstd,
        M, N, eps, HAS_RESIDUAL=res2 is not None, RMS=rms, ROWS=rows, BLOCK_N=block_n,
        num_warps=num_warps)
    return y, s, mean, rstd, (block_n, rows, num_warps)


def _ln_backward(x2, weight, mean, rstd, dy2, dsum2, config, rms=False):
    """Launch the backward kernel: returns dx (in x2's dtype), dw, db (None
    for RMSNorm). x2 is the normalized input (s for the fused add); dsum2, if
    given, is the gradient that reached s along the residual stream."""
    M, N = x2.shape
    dx = torch.empty_like(x2)
    block_n, rows, num_warps = config
    # enough programs to fill the GPU, few enough that the (G, N) partial
    # buffers stay small; the interpreter runs programs serially anyway
    sms = 1 if INTERPRET else torch.cuda.get_device_properties(x2.device).multi_processor_count
    programs = min(triton.cdiv(M, rows), 4 * sms)
    dw_partial = torch.empty((programs, N), device=x2.device, dtype=torch.float32)
    db_partial = torch.empty((programs, N), device=x2.device, dtype=torch.float32)
    _layer_norm_bwd_kernel[(programs,)](x2, weight, dy2, dy2 if dsum2 is None else dsum2, dx,
                                        mean, rstd, dw_partial, db_partial, M, N,
                                        HAS_DSUM=dsum2 is not None, RMS=rms, ROWS=rows,
                                        BLOCK_N=block_n, num_warps=num_warps)
    db = None if rms else db_partial.sum(0).to(weight.dtype)
    return dx, dw_partial.sum(0).to(weight.dtype), db


def _kernel_dtype(out_dtype):
    """The dtype the kernel writes y in: out_dtype, except under the
    interpreter, which computes in fp32 and is cast afterwards."""
    return None if INTERPRET else out_dtype


def _rows(t, upcast: bool):
    """(..., N) -> contiguous (M, N); fp32 under the interpreter (see
    _kernel_inputs) when upcast is set."""
    t = t.reshape(-1, t.shape[-1])
    return (t.float() if upcast else t).contiguous()


# The kernels as custom operators with their autograd (see flash_attention_op).
# bias None is RMSNorm; out_dtype None writes y in the normalized dtype.
# RMSNorm has no mean (an empty tensor) and no bias gradient (empty).

@torch.library.custom_op("kernels::layer_norm", mutates_args=())
def layer_norm_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                  out_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd) of LayerNorm (RMSNorm) over the last dim of x."""
    y, _, mean, rstd, _ = _ln_forward(_rows(x, INTERPRET), None, weight, bias, eps, _kernel_dtype(out_dtype))
    return y.reshape(x.shape).to(out_dtype or x.dtype), _stats(mean, bias), rstd


@layer_norm_op.register_fake
def _(x, weight, bias, eps, out_dtype):
    mean, rstd = (x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32) for _ in range(2))
    return torch.empty_like(x, dtype=out_dtype or x.dtype), _stats(mean, bias), rstd


@torch.library.custom_op("kernels::add_layer_norm", mutates_args=())
def add_layer_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(s, y, mean, rstd) for s = x + residual and y = LayerNorm(s) (RMSNorm).
    s is as the kernel stored it, which backward reads again: in the promoted
    dtype of x and residual (fp32 under the interpreter; add_layer_norm casts)."""
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    y, s, mean, rstd, _ = _ln_forward(_rows(x, INTERPRET), _rows(residual, INTERPRET), weight, bias,
                                      eps, _kernel_dtype(out_dtype))
    return s.reshape(x.shape), y.reshape(x.shape).to(out_dtype or sum_dtype), _stats(mean, bias), rstd


@add_layer_norm_op.register_fake
def _(x, residual, weight, bias, eps, out_dtype):
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    mean, rstd = (x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32) for _ in range(2))
    return (torch.empty_like(x, dtype=torch.float32 if INTERPRET else sum_dtype),
            torch.empty_like(x, dtype=out_dtype or sum_dtype), _stats(mean, bias), rstd)


@torch.library.custom_op("kernels::layer_norm_backward", mutates_args=())
def layer_norm_backward_op(dy: torch.Tensor, dsum: torch.Tensor | None, x: torch.Tensor,
                           weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                           rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db) of layer_norm_op at its input x (for the fused add: at s,
    with dsum the gradient that reached s along the residual stream)."""
    x2, N = _rows(x, INTERPRET), x.shape[-1]
    dsum2 = None if dsum is None else _rows(dsum, INTERPRET)
    dx, dw, db = _ln_backward(x2, weight, mean, rstd, _rows(dy, INTERPRET), dsum2,
                              _layer_norm_config(N), rms=rms)
    return dx.reshape(x.shape).to(x.dtype), dw, weight.new_empty(0) if db is None else db


@layer_norm_backward_op.register_fake
def _(dy, dsum, x, weight, mean, rstd, rms):
    return torch.empty_like(x), torch.empty_like(weight), weight.new_empty(0 if rms else weight.shape[0])


def _stats(mean, bias):
    """forward's mean, or for RMSNorm (bias None, no mean) an empty tensor."""
    return mean if bias is not None else mean.new_empty(0)


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, _, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.rms = bias is None


def _layer_norm_grad(ctx, dy, dmean, drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = layer_norm_backward_op(dy, None, x, weight, mean, rstd, ctx.rms)
    return dx, dw, None if ctx.rms else db, None, None


def _add_layer_norm_setup(ctx, inputs, output):
    x, residual, weight, bias, _, _ = inputs
    s, _, mean, rstd = output
    ctx.save_for_backward(s, weight, mean, rstd)
    ctx.rms, ctx.dtypes = bias is None, (x.dtype, residual.dtype)


def _add_layer_norm_grad(ctx, ds, dy, dmean, drstd):
    """s feeds both the LayerNorm and the rest of the residual stream, so
    ds_total = ds + LayerNorm-backward(dy); since s = x + residual, that is
    the gradient of x and of residual alike."""
    s, weight, mean, rstd = ctx.saved_tensors
    dsum, dw, db = layer_norm_backward_op(dy, ds, s, weight, mean, rstd, ctx.rms)
    x_dtype, res_dtype = ctx.dtypes
    return dsum.to(x_dtype), dsum.to(res_dtype), dw, None if ctx.rms else db, None, None


layer_norm_op.register_autograd(_layer_norm_grad, setup_context=_layer_norm_setup)
add_layer_norm_op.register_autograd(_add_layer_norm_grad, setup_context=_add_layer_norm_setup)


def _check_layer_norm_inputs(x, weight, bias):
    N = x.shape[-1]
    if weight.shape != (N,) or (bias is not None and bias.shape != (N,)):
        raise UsageError(f"layer_norm: weight and bias must have shape ({N},), got "
                         f"{tuple(weight.shape)} and {None if bias is None else tuple(bias.shape)}")
    if N * 4 > _MAX_LN_BYTES:
        raise UsageError(f"layer_norm: hidden size {N} too large for the one-row-per-program "
                         f"kernel (max {_MAX_LN_BYTES // 4}); use layernorm_impl='torch'")
    if x.numel() == 0:
        raise UsageError("layer_norm: got an empty input tensor")
    require_triton(x)


def layer_norm(x, weight, bias, eps: float = 1e-5, out_dtype: torch.dtype | None = None):
    """Fused LayerNorm over the last dim of x (any leading shape), with affine
    weight and bias of shape (N,). Statistics in fp32; output in out_dtype
    (default: x's dtype). weight/bias may be fp32 while x is fp16/bf16."""
    _check_layer_norm_inputs(x, weight, bias)
    return layer_norm_op(x, weight, bias, float(eps), out_dtype)[0]


def add_layer_norm(x, residual, weight, bias, eps: float = 1e-5,
                   out_dtype: torch.dtype | None = None):
    """Fused residual add + LayerNorm: returns (s, layer_norm(s)) for
    s = x + residual, s in the promoted dtype of x and residual, and
    layer_norm(s) in out_dtype (default: the same).

    In a pre-LN block, `x = x + attn(ln_1(x)); h = ln_2(x)` is
    `x, h = add_layer_norm(x, attn(ln_1(x)), ...)`: the sum is written once
    and normalized without a second trip through memory, and in backward
    the residual stream's gradient is folded into the LayerNorm kernel."""
    if residual.shape != x.shape or residual.device != x.device:
        raise UsageError(f"add_layer_norm: x and residual must have the same shape and device, "
                         f"got {tuple(x.shape)} on {x.device} and {tuple(residual.shape)} "
                         f"on {residual.device}")
    _check_layer_norm_inputs(x, weight, bias)
    s, y, _, _ = add_layer_norm_op(x, residual, weight, bias, float(eps), out_dtype)
    return s.to(torch.promote_types(x.dtype, residual.dtype)), y


def rms_norm(x, weight, eps: float = 1e-5, out_dtype: torch.dtype | None = None):
    """Fused RMSNorm over the last dim of x: x / sqrt(mean(x^2) + eps) * weight.
    The LayerNorm kernels with their RMS switch; statistics in fp32."""
    _check_layer_norm_inputs(x, weight, None)
    return layer_norm_op(x, weight, None, float(eps), out_dtype)[0]


def add_rms_norm(x, residual, weight, eps: float = 1e-5, out_dtype: torch.dtype | None = None):
    """Fused residual add + RMSNorm: (s, rms_norm(s)) for s = x + residual
    (see add_layer_norm)."""
    return add_layer_norm(x, residual, weight, None, eps, out_dtype)


class TritonLayerNorm(torch.nn.LayerNorm):
    """Drop-in nn.LayerNorm (same parameters, state_dict keys and init) whose
    forward runs the fused Triton kernel. Subclassing keeps isinstance checks
    (weight-decay grouping, init) and checkpoints interchangeable with torch."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None):
        # always affine with bias: the kernel expects both weight and bias
        super().__init__(hidden_size, eps=eps, device=device, dtype=dtype)

    fuses_residual_add = True  # gpt.add_and_norm checks this

    def forward(self, x, residual=None):
        """x (..., N) -> LayerNorm(x). With residual (same shape): the pair
        (x + residual, LayerNorm(x + residual)) from one fused kernel. Both go
        through forward (module call) so that module hooks, e.g. ZeRO-3's
        parameter gathering, see the fused use too.

        Under autocast the LayerNorm output is written in the autocast dtype:
        in this model every LayerNorm feeds a matmul, which would cast an fp32
        output down anyway (the same round-to-nearest, up to the last fp32
        bit: the two compiled variants may contract multiply-adds
        differently), so writing it narrow saves a full-width
        write, a read and a cast kernel. The residual stream keeps its own dtype."""
        out_dtype = _autocast_dtype(x)
        if residual is None:
            return layer_norm(x, self.weight, self.bias, self.eps, out_dtype)
        return add_layer_norm(x, residual, self.weight, self.bias, self.eps, out_dtype)


class TritonRMSNorm(torch.nn.RMSNorm):
    """Drop-in nn.RMSNorm (same parameter, state_dict key and init) whose
    forward runs the fused Triton kernel, residual add included (see
    TritonLayerNorm.forward, which this mirrors)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__(hidden_size, eps=eps, device=device, dtype=dtype)

    fuses_residual_add = True  # gpt.add_and_norm checks this

    def forward(self, x, residual=None):
        out_dtype = _autocast_dtype(x)
        if residual is None:
            return rms_norm(x, self.weight, self.eps, out_dtype)
        return add_rms_norm(x, residual, self.weight, self.eps, out_dtype)


def _autocast_dtype(x) -> torch.dtype | None:
    """The dtype autocast would cast x to before a matmul, or None outside autocast."""
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


# ============================================================================
# 4. The fused loss's row passes over a chunk of logits (gpt.fused_lm_loss)
# ============================================================================

if HAS_TRITON:

    @triton.jit
    def _row_stats_kernel(Z, LABELS, MAX, SUMEXP, TARGET, V, stride_z, vocab_start,
                          BLOCK_V: tl.constexpr):
        """Program r: over row r of z, the max m, sum(exp(z - m)) (an online
        softmax denominator, rescaled whenever the running max grows), and
        the target logit if this rank's vocab slice holds the target (else 0)."""
        log2e = 1.4426950408889634  # exp(x) = exp2(x * log2(e))
        r = tl.program_id(0)
        row = Z + r.to(tl.int64) * stride_z
        m = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)  # per-lane running max
        s = tl.zeros([BLOCK_V], dtype=tl.float32)                  # per-lane sum, scaled to m
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            z = tl.load(row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, z)
            s = s * tl.math.exp2((m - m_new) * log2e) + tl.math.exp2((z - m_new) * log2e)
            # a lane that has seen only padding (-inf) computed -inf - -inf = NaN: it holds 0
            s = tl.where(m_new == float("-inf"), 0.0, s)
            m = m_new
        row_max = tl.max(m, 0)
        row_sum = tl.sum(s * tl.math.exp2((m - row_max) * log2e), 0)
        target = tl.load(LABELS + r) - vocab_start
        here = (target >= 0) & (target < V)
        z_t = tl.load(row + tl.where(here, target, 0)).to(tl.float32)
        tl.store(MAX + r, row_max)
        tl.store(SUMEXP + r, row_sum)
        tl.store(TARGET + r, tl.where(here, z_t, 0.0))

    @triton.jit
    def _row_grad_kernel(Z, LABELS, LSE, WEIGHT, V, stride_z, vocab_start,
                         BLOCK_V: tl.constexpr):
        """Program r: overwrite row r of z with w_r * (softmax(z) - onehot(target))."""
        log2e = 1.4426950408889634
        r = tl.program_id(0)
        row = Z + r.to(tl.int64) * stride_z
        lse = tl.load(LSE + r)
        w = tl.load(WEIGHT + r)
        target = tl.load(LABELS + r) - vocab_start
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            z = tl.load(row + cols, mask=cols < V, other=0.0).to(tl.float32)
            p = tl.math.exp2((z - lse) * log2e)
            dz = (p - tl.where(cols == target, 1.0, 0.0)) * w
            tl.store(row + cols, dz.to(Z.dtype.element_ty), mask=cols < V)


def _block_v(V: int, z) -> int:
    return 64 if z.device.type == "cpu" else min(4096, triton.next_power_of_2(V))


@torch.library.custom_op("kernels::loss_row_stats", mutates_args=())
def loss_row_stats(z: torch.Tensor, labels: torch.Tensor, vocab_start: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, sum(exp(z - max)), target logit or 0) of each row of a chunk of
    logits z (n, V_local), fp32 (n,) each; z is not changed. A custom
    operator (see flash_attention_op), as is loss_row_grad_."""
    n, V = z.shape
    stats = [torch.empty(n, device=z.device, dtype=torch.float32) for _ in range(3)]
    _row_stats_kernel[(n,)](z, labels, *stats, V, z.stride(0), vocab_start, BLOCK_V=_block_v(V, z))
    return tuple(stats)


@loss_row_stats.register_fake
def _(z, labels, vocab_start):
    return tuple(z.new_empty(z.shape[0], dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("kernels::loss_row_grad_", mutates_args=("z",))
def loss_row_grad_(z: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, weight: torch.Tensor,
                   vocab_start: int) -> None:
    """z <- weight * (softmax(z) - onehot(labels)), in place, given each row's lse."""
    n, V = z.shape
    _row_grad_kernel[(n,)](z, labels, lse, weight, V, z.stride(0), vocab_start, BLOCK_V=_block_v(V, z))


@loss_row_grad_.register_fake
def _(z, labels, lse, weight, vocab_start):
    return None
