"""Fused GPU kernels in Triton. Sections:

  1. whether Triton runs here: the optional import, the interpreter switch,
     require_triton() naming the fix
  2. flash_attention(): causal FlashAttention-2 with grouped-query attention,
     its autotuned launchers, and its forward and backward ops (context.py's
     ring runs them on its blocks)
  3. layer_norm(), add_layer_norm() (residual add fused in; RMSNorm without a
     bias), and the drop-in modules TritonLayerNorm / TritonRMSNorm
  4. the row statistics and gradient of a span of logits: the fused LM head
     and loss's passes on CUDA (fused_loss.py)

Without a GPU: with TRITON_INTERPRET=1 set *before* this module is imported
(Triton decides at decoration time), the same kernels run on CPU tensors
through numpy. The interpreter's bf16/fp16 arithmetic is not faithful, so the
wrappers upcast inputs to fp32 and cast results back; it cannot autotune, so
one fixed config is used.
"""
import functools
import math
import os

import torch

from launch import UsageError


# ============================================================================
# 1. Whether Triton runs here
# ============================================================================

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # the kernels' names stay undefined; require_triton() says why
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_usable(device) -> bool:
    """Whether the kernels can run on `device`: CUDA, or CPU under TRITON_INTERPRET=1."""
    return HAS_TRITON and torch.device(device).type == ("cpu" if INTERPRET else "cuda")


def require_triton(device) -> None:
    """Raise a UsageError naming the fix when triton_usable(device) is False."""
    if triton_usable(device):
        return
    if not HAS_TRITON:
        why = "the triton package is not installed (pip install triton)"
    elif INTERPRET:
        why = (f"TRITON_INTERPRET=1 is set, so the kernels run only on CPU tensors, "
               f"but got a tensor on {device}; unset TRITON_INTERPRET to use the GPU")
    else:
        why = (f"got a tensor on {device}: the kernels need a CUDA device, or "
               f"TRITON_INTERPRET=1 set before importing fused_kernels to run them on CPU")
    raise UsageError(f"attention_impl/layernorm_impl='triton' cannot run: {why}. "
                     f"Use --attention-impl torch --layernorm-impl torch instead.")


# ============================================================================
# 2. Causal FlashAttention-2 (forward, backward), grouped-query attention
# ============================================================================
# Plain attention writes the (T, T) score matrix to memory and reads it back
# twice (softmax, then @ V). FlashAttention keeps a (BLOCK_M, BLOCK_N) tile of
# scores in registers and folds it into the output with an *online softmax*
# (running max and denominator per row); backward recomputes the tiles from
# the saved per-row log-sum-exp.

SUPPORTED_HEAD_DIMS = (32, 64, 128)
LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e)); exp2 is the fast hardware op


# ---------------------------------------------------------------------------
# 2a. Attention kernels: forward, backward preprocess, dK/dV, dQ
#
# q, o, do, dq are (B, H, T, D), k, v, dk, dv (B, G, T, D), with any strides
# whose last dim is contiguous: q, k, v are read in place as transposed views
# of the model's fused QKV projection, (B, T, 3, H, D) in memory; o and the
# gradients are (B, T, H, D) in memory, so the model's reshape to (B, T, C) is
# free. Program (i, bh) works on head bh = b*H + h. Grouped-query attention
# (G < H, GROUP = H/G): query head h reads key/value head h // GROUP in place,
# and dK, dV sum over the GROUP query heads that read them. lse and delta are
# (B*H, T) fp32. Scores are in base 2: s2 = (q.k) * sm_scale * log2(e),
# lse2 = max + log2(sum exp2(s2 - max)), p = exp2(s2 - lse2). T_BUCKET is
# unused by the maths: it is the autotuning key (_build_launchers).
if HAS_TRITON:

    @triton.jit
    def _load_rows(P, base, rows, T, stride_t, HEAD_DIM: tl.constexpr):
        """Rows `rows` of the head at P + base; rows at or past T read as zeros."""
        offs = base + rows[:, None] * stride_t + tl.arange(0, HEAD_DIM)[None, :]
        return tl.load(P + offs, mask=rows[:, None] < T, other=0.0)

    @triton.jit
    def _store_rows(P, base, rows, T, stride_t, tile, HEAD_DIM: tl.constexpr):
        """Write `tile` to rows `rows` of the head at P + base; rows at or past T are skipped."""
        offs = base + rows[:, None] * stride_t + tl.arange(0, HEAD_DIM)[None, :]
        tl.store(P + offs, tile.to(P.dtype.element_ty), mask=rows[:, None] < T)

    @triton.jit
    def _head_base(bh, H, stride_b, stride_h):
        """Offset of head bh = b*H + h (int64: B*H*T*D can exceed 2**31)."""
        return (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h

    @triton.jit
    def _kv_head(bh, H, GROUP):
        """The key/value head b*G + h // GROUP that query head bh = b*H + h reads."""
        return (bh // H) * (H // GROUP) + (bh % H) // GROUP

    @triton.jit
    def _heavy_first(BLOCK: tl.constexpr):
        """Start row of this program's block, counting from the end: the last
        query blocks see the most keys, and launching them first avoids a long tail."""
        return (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK

    @triton.jit
    def _attn_fwd_inner(acc, l_i, m_i, q, K, V, kv_base, stride_t, offs_m, T, qk_scale, lo, hi,
                        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                        CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """Fold key/value blocks [lo, hi) into one query block's running softmax.
        MASKED=False: the blocks are fully visible (below the diagonal, inside T)."""
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
            # online softmax: rescale the state so far to the new row max
            m_new = tl.maximum(m_i, tl.max(s, 1))           # (BM,)
            p = tl.math.exp2(s - m_new[:, None])            # (BM, BN)
            alpha = tl.math.exp2(m_i - m_new)               # (BM,) correction factor
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _attn_fwd_kernel(Q, K, V, O, LSE, T, H, GROUP: tl.constexpr, stride_qb, stride_qh, stride_qt,
                         stride_kb, stride_kh, stride_kt, stride_ob, stride_oh, stride_ot, qk_scale,
                         T_BUCKET, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
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
        lo, hi = 0, T
        if CAUSAL:  # key blocks left of the diagonal unmasked, then the diagonal; none right of it
            acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, kv_base, stride_kt, offs_m, T,
                                            qk_scale, 0, start_m, HEAD_DIM, BLOCK_N, False, True,
                                            DOT_PRECISION)
            lo, hi = start_m, tl.minimum(start_m + BLOCK_M, T)
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, kv_base, stride_kt, offs_m, T, qk_scale,
                                        lo, hi, HEAD_DIM, BLOCK_N, True, CAUSAL, DOT_PRECISION)
        o = acc / l_i[:, None]
        _store_rows(O, _head_base(bh, H, stride_ob, stride_oh), offs_m, T, stride_ot, o, HEAD_DIM)
        tl.store(LSE + bh.to(tl.int64) * T + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < T)

    @triton.jit
    def _attn_bwd_preprocess_kernel(O, DO, DELTA, T, H, stride_ob, stride_oh, stride_ot, stride_dob,
                                    stride_doh, stride_dot, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
        """delta_i = sum_d dO_id * O_id: the softmax-backward term shared by dK and dQ."""
        bh = tl.program_id(1)
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        o = _load_rows(O, _head_base(bh, H, stride_ob, stride_oh), offs_m, T, stride_ot,
                       HEAD_DIM).to(tl.float32)
        do = _load_rows(DO, _head_base(bh, H, stride_dob, stride_doh), offs_m, T, stride_dot,
                        HEAD_DIM).to(tl.float32)
        tl.store(DELTA + bh.to(tl.int64) * T + offs_m, tl.sum(o * do, 1), mask=offs_m < T)

    @triton.jit
    def _attn_bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, q_base, stride_qt, do_base, stride_dot,
                             row_base, offs_n, T, qk_scale, lo, hi, HEAD_DIM: tl.constexpr,
                             BLOCK_M: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """Accumulate dK, dV of one key block over query blocks [lo, hi), on
        transposed tiles (keys along rows): dV += P^T dO, dK += dS^T Q."""
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
                              sm_scale, qk_scale, T_BUCKET, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """One program = one block of BLOCK_N keys of one (batch, key/value head);
        it alone writes their dK, dV (no atomics), looping over the GROUP query
        heads that read them. Program 0 has the most query blocks: heavy first."""
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
            lo = 0
            if CAUSAL:  # the diagonal query blocks masked, then every query block below them
                lo = tl.minimum(start_n + BLOCK_N, T)
                dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, q_base, stride_qt,
                                              do_base, stride_dot, row_base, offs_n, T, qk_scale,
                                              start_n, lo, HEAD_DIM, BLOCK_M, True, DOT_PRECISION)
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, q_base, stride_qt,
                                          do_base, stride_dot, row_base, offs_n, T, qk_scale,
                                          lo, T, HEAD_DIM, BLOCK_M, False, DOT_PRECISION)
        # s = sm_scale * q.k: dK picks up the scale once, here
        g_base = _head_base(bkv, G, stride_gb, stride_gh)
        _store_rows(DK, g_base, offs_n, T, stride_gt, dk * sm_scale, HEAD_DIM)
        _store_rows(DV, g_base, offs_n, T, stride_gt, dv, HEAD_DIM)

    @triton.jit
    def _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, kv_base, stride_t, offs_m, T, qk_scale, lo, hi,
                           HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                           CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
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
                            sm_scale, qk_scale, T_BUCKET, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """One program = one block of BLOCK_M queries; it alone writes their dQ."""
        start_m = _heavy_first(BLOCK_M)
        bh = tl.program_id(1)
        q_base = _head_base(bh, H, stride_qb, stride_qh)
        kv_base = _head_base(_kv_head(bh, H, GROUP), H // GROUP, stride_kb, stride_kh)
        row_base = bh.to(tl.int64) * T
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_rows(Q, q_base, offs_m, T, stride_qt, HEAD_DIM)  # (BM, D)
        do = _load_rows(DO, _head_base(bh, H, stride_dob, stride_doh), offs_m, T, stride_dot, HEAD_DIM)
        lse = tl.load(LSE + row_base + offs_m, mask=offs_m < T, other=float("inf"))
        delta = tl.load(DELTA + row_base + offs_m, mask=offs_m < T, other=0.0)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        lo, hi = 0, T
        if CAUSAL:  # as the forward: unmasked left of the diagonal, then the diagonal
            dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, kv_base, stride_kt, offs_m, T,
                                    qk_scale, 0, start_m, HEAD_DIM, BLOCK_N, False, True, DOT_PRECISION)
            lo, hi = start_m, tl.minimum(start_m + BLOCK_M, T)
        dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, kv_base, stride_kt, offs_m, T,
                                qk_scale, lo, hi, HEAD_DIM, BLOCK_N, True, CAUSAL, DOT_PRECISION)
        _store_rows(DQ, _head_base(bh, H, stride_gb, stride_gh), offs_m, T, stride_gt,
                    dq * sm_scale, HEAD_DIM)


# ---------------------------------------------------------------------------
# 2b. Launchers: triton.autotune on CUDA (the best tiles depend on the GPU, T,
# D and dtype); the interpreter runs one small config.
# Candidate (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel: few, so the
# first step's autotuning stays cheap, and none that spills registers for
# 16-bit inputs (bench/check_compile.py, sm_90, fails if one does). Forward
# and dQ step through the diagonal in BLOCK_N key blocks, so BLOCK_M % BLOCK_N
# == 0; dK/dV in BLOCK_M query blocks, so BLOCK_N % BLOCK_M == 0. 128-row
# tiles are what FlashAttention-2 uses on Hopper.
ATTN_CONFIGS = {
    # head dims 32 and 64
    "fwd": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2),
            (64, 64, 4, 3), (64, 64, 4, 4)],
    "dkdv": [(32, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3)],
    "dq": [(128, 32, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2), (64, 32, 4, 3),
           (64, 64, 4, 3), (128, 128, 8, 2)],
}
# Head dim 128 doubles the accumulators: the configs above that spill there
# give way to 8-warp or shallower ones.
ATTN_CONFIGS_D128 = {
    "fwd": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 2),
            (64, 64, 4, 3), (64, 64, 4, 4)],
    "dkdv": [(32, 128, 8, 3), (64, 64, 8, 3), (64, 64, 8, 2), (32, 64, 8, 3), (32, 64, 4, 2)],
    "dq": [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (64, 64, 8, 3),
           (64, 32, 4, 3), (64, 64, 4, 3)],
}
# Grouped-query attention: the dK/dV loop over the GROUP query heads costs
# registers; at head dim 128 every candidate above spills then, these do not,
# and at 32 and 64 the 64x64 tile on 4 warps is dropped.
GQA_DKDV_CONFIGS = {
    64: [(32, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3)],
    128: [(32, 64, 8, 2), (16, 128, 8, 3), (16, 128, 8, 2), (16, 64, 8, 3), (32, 32, 4, 3), (32, 32, 4, 2)],
}
# KERNELS_AUTOTUNE=wide (read at import) searches every tile shape x warps x
# stages: slow, for finding a new GPU's best configs.
_WIDE_SHAPES = {"fwd": [(64, 32), (64, 64), (128, 32), (128, 64), (128, 128)],
                "dkdv": [(32, 64), (32, 128), (64, 64), (64, 128), (128, 128)],
                "dq": [(64, 32), (64, 64), (128, 32), (128, 64), (128, 128)]}


def _attn_tiles(kernel: str, head_dim: int, group: int = 1) -> list:
    """The candidate tiles of `kernel` at one head dim and GQA group size."""
    if kernel == "dkdv" and group > 1:
        return GQA_DKDV_CONFIGS[128 if head_dim == 128 else 64]
    return (ATTN_CONFIGS_D128 if head_dim == 128 else ATTN_CONFIGS)[kernel]


def _attn_configs(kernel: str, wide: bool = False):
    """Every candidate of `kernel`, for all head dims (_prune_attn_configs picks)."""
    if wide:
        tiles = [(bm, bn, w, s) for bm, bn in _WIDE_SHAPES[kernel] for w in (4, 8) for s in (2, 3, 4, 5)]
    else:
        tiles = list(dict.fromkeys(t for head_dim in (64, 128) for group in (1, 2)
                                   for t in _attn_tiles(kernel, head_dim, group)))
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in tiles]


def _keep_attn_config(config, kernel: str, head_dim: int, dtype, group: int = 1,
                      wide: bool = False) -> bool:
    """Whether autotune times `config` for this head dim, input dtype and GQA
    group. fp32 inputs take the small tiles of ATTN_CONFIGS that fit in shared
    memory; they still spill at head dim >= 64, one reason fp32 runs use TF32."""
    tile = (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)
    if dtype == torch.float32:
        return tile in ATTN_CONFIGS[kernel] and tile[0] * tile[1] <= 64 * 64 and tile[3] <= 3
    return wide or tile in _attn_tiles(kernel, head_dim, group)


def _prune_attn_configs(kernel: str, wide: bool, configs, named_args, **kwargs):
    """triton.autotune's early_config_prune hook (see _keep_attn_config)."""
    q, group = named_args["Q"], named_args["GROUP"]
    kept = [c for c in configs if _keep_attn_config(c, kernel, q.shape[-1], q.dtype, group, wide)]
    return kept or configs[:1]


def _build_launchers():
    if not HAS_TRITON:
        return {}
    kernels = {"fwd": _attn_fwd_kernel, "dkdv": _attn_bwd_dkdv_kernel, "dq": _attn_bwd_dq_kernel}
    if INTERPRET:
        return kernels
    # Tune once per key (Triton adds the dtypes), cached on disk with the compiled
    # kernels (TRITON_CACHE_DIR) for the next run. The key holds a power-of-two
    # bucket of T (T_BUCKET), not T: generate() grows T a token a step, and
    # re-timing every config per length takes seconds.
    wide = os.environ.get("KERNELS_AUTOTUNE", "").lower() == "wide"
    key = ["T_BUCKET", "HEAD_DIM", "GROUP", "CAUSAL", "DOT_PRECISION"]
    return {name: triton.autotune(
                _attn_configs(name, wide), key=key, cache_results=True,
                prune_configs_by={"early_config_prune": functools.partial(_prune_attn_configs, name, wide)})(fn)
            for name, fn in kernels.items()}


_LAUNCHERS = _build_launchers()  # built once at import; read-only afterwards


def _launch_attn(name: str, num_rows: int, bh: int, *args, **constexprs):
    """Launch attention kernel `name` over (row blocks, bh) programs; the grid
    depends on the block size autotune picks."""
    rows_block = "BLOCK_N" if name == "dkdv" else "BLOCK_M"
    grid = lambda meta: (triton.cdiv(num_rows, meta[rows_block]), bh)  # noqa: E731
    fixed = dict(BLOCK_M=16, BLOCK_N=16) if INTERPRET else {}
    bucket = max(16, triton.next_power_of_2(num_rows))
    _LAUNCHERS[name][grid](*args, T_BUCKET=bucket, **constexprs, **fixed)


# ---------------------------------------------------------------------------
# 2c. custom operators, autograd and public API
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
    require_triton(q.device)


def _dot_precision(dtype) -> str:
    """Precision of tl.dot on fp32 inputs: IEEE, matching torch, unless torch's
    own fp32 matmuls use TF32 (train.py sets "high" for fp32 runs on a GPU)."""
    if dtype == torch.float32 and (INTERPRET or torch.get_float32_matmul_precision() == "highest"):
        return "ieee"
    return "tf32"


def _rows_last(t):
    """t itself when its last dim is contiguous (the kernels take any other strides)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _empty_bthd(like):
    """An empty (B, H, T, D) tensor, (B, T, H, D) in memory (see 2a)."""
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
    set of strides, fp32 under the interpreter."""
    if INTERPRET:
        q, k, v = q.float(), k.float(), v.float()
    q, k, v = _rows_last(q), _rows_last(k), _rows_last(v)
    if k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    return q, k, v


def _attn_forward(q, k, v, causal, sm_scale):
    """Launch the forward kernel on _kernel_inputs: (o, lse)."""
    B, H, T, D = q.shape
    o = _empty_bthd(q)
    _check_int32_offsets(T, q, k, o)
    lse = torch.empty((B * H, T), device=q.device, dtype=torch.float32)
    _launch_attn("fwd", T, B * H, q, k, v, o, lse, T, H, H // k.shape[1], *q.stride()[:3],
                 *k.stride()[:3], *o.stride()[:3], sm_scale * LOG2E, HEAD_DIM=D,
                 CAUSAL=causal, DOT_PRECISION=_dot_precision(q.dtype))
    return o, lse


def _attn_backward(do, q, k, v, o, lse, causal, sm_scale):
    """Launch the backward kernels on _kernel_inputs and forward's o, lse: (dq, dk, dv)."""
    B, H, T, D = q.shape
    do = _rows_last(do.to(q.dtype))
    _check_int32_offsets(T, do)
    delta = torch.empty_like(lse)
    block = 16 if INTERPRET else 64
    grid = (triton.cdiv(T, block), B * H)
    _attn_bwd_preprocess_kernel[grid](o, do, delta, T, H, *o.stride()[:3],
                                      *do.stride()[:3], HEAD_DIM=D, BLOCK_M=block)
    dq, dk, dv = _empty_bthd(q), _empty_bthd(k), _empty_bthd(k)
    consts = dict(HEAD_DIM=D, CAUSAL=causal, DOT_PRECISION=_dot_precision(q.dtype))
    G = k.shape[1]  # one dK/dV program row per (batch, key/value head)
    inputs = (T, H, H // G, *q.stride()[:3], *k.stride()[:3], *do.stride()[:3])
    scales = (sm_scale, sm_scale * LOG2E)
    _launch_attn("dkdv", T, B * G, q, k, v, do, lse, delta, dk, dv, *inputs,
                 *dk.stride()[:3], *scales, **consts)
    _launch_attn("dq", T, B * H, q, k, v, do, lse, delta, dq, *inputs,
                 *dq.stride()[:3], *scales, **consts)
    return dq, dk, dv


# The kernels as custom operators with their autograd: torch.compile sees one
# opaque op with a fake (shape-only) implementation instead of tracing into
# the launchers, and fuses the code around it; eager mode runs the same ops.

@torch.library.custom_op("fused_kernels::flash_attention", mutates_args=())
def flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) = FlashAttention-2 forward: o in q's dtype, lse (B, H, T) fp32, the
    log-sum-exp of each query's scores (the ring in context.py merges blocks by it)."""
    o, lse2 = _attn_forward(*_kernel_inputs(q, k, v), causal, sm_scale)
    return o.to(q.dtype), lse2.view(q.shape[:3]) / LOG2E  # the kernels': base 2, (B*H, T)


@flash_attention_op.register_fake
def _(q, k, v, causal, sm_scale):
    return _empty_bthd(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("fused_kernels::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                o: torch.Tensor, lse: torch.Tensor, causal: bool,
                                sm_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of flash_attention_op, in q's dtype, from its o and lse (of a
    ring's block: the merged o and lse of its query rows, context.py)."""
    q2, k2, v2 = _kernel_inputs(q, k, v)
    lse2 = (lse * LOG2E).reshape(-1, q.shape[2])          # (B*H, T), base 2, as the kernels read it
    grads = _attn_backward(do, q2, k2, v2, o.to(q2.dtype), lse2, causal, sm_scale)
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
    """softmax(q k^T * sm_scale + causal mask) v, differentiable, fp32 accumulation.
    q (B, H, T, D), k, v (B, G, T, D) of one dtype, D in SUPPORTED_HEAD_DIMS;
    G < H is grouped-query attention. sm_scale defaults to 1/sqrt(D)."""
    _check_attention_inputs(q, k, v)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    return flash_attention_op(q, k, v, bool(causal), float(sm_scale))[0]


# ============================================================================
# 3. LayerNorm and RMSNorm, fused with the residual add
# ============================================================================
# LayerNorm is memory bound: one fused pass (read x once, write y once) beats
# the several elementwise kernels an unfused version launches.

# ---------------------------------------------------------------------------
# 3a. The kernels, on x viewed as (M, N) rows; BLOCK_N = next_pow2(N). RMS is a
# constexpr switch: no mean and no bias.
if HAS_TRITON:

    @triton.jit
    def _layer_norm_fwd_kernel(X, RES, W, B, Y, SUM, MEAN, RSTD, M, N, eps, HAS_RESIDUAL: tl.constexpr,
                               RMS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        """One program = ROWS whole rows: y = (x - mean) * rstd * w + b, in fp32.
        RMS (RMSNorm, Zhang & Sennrich 2019): y = x * rstd * w with
        rstd = 1/sqrt(mean(x^2) + eps); MEAN and B unused. HAS_RESIDUAL: first
        s = x + res, written to SUM once and normalized from registers."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (R,)
        cols = tl.arange(0, BLOCK_N)                          # (BN,)
        mask = (rows[:, None] < M) & (cols[None, :] < N)      # (R, BN)
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(RES + offs, mask=mask, other=0.0).to(tl.float32)
            # round s to its storage dtype, as an unfused add would; backward re-reads it
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
        """Program p handles row tiles p, p+G, p+2G, ... (G programs). dW and dB
        are sums over rows: each program writes its fp32 partial sums to row p
        of a (G, N) buffer, summed afterwards (no atomics, deterministic).
        HAS_DSUM: s = x + res also flowed on along the residual stream, so its
        gradient DSUM is added to dx, which is then the gradient of x and res."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)  # (BN,)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_N], dtype=tl.float32)
        for tile in range(pid, tl.cdiv(M, ROWS), tl.num_programs(0)):
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
# 3b. Launch, the custom operators with their autograd, public API and modules
_MAX_LN_BYTES = 65536  # one row must fit in a program's registers/shared memory


def _layer_norm_config(N: int):
    """(BLOCK_N, ROWS, num_warps) for rows of N elements: narrow rows are
    batched so each program still moves a useful amount of memory; wide rows
    get one row per program and more warps."""
    block_n = triton.next_power_of_2(N)
    rows = max(1, min(16, 2048 // block_n)) if not INTERPRET else 16
    num_warps = min(max(block_n * rows // 512, 1), 16)
    return block_n, rows, num_warps


def _rows(t):
    """(..., N) -> contiguous (M, N); fp32 under the interpreter. None stays None."""
    if t is None:
        return None
    t = t.reshape(-1, t.shape[-1])
    return (t.float() if INTERPRET else t).contiguous()


def _stats(mean, bias):
    """forward's mean, or for RMSNorm (bias None, no mean) an empty tensor."""
    return mean if bias is not None else mean.new_empty(0)


def _sum_dtype(x, residual):
    return x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)


# The kernels as custom operators with their autograd (see flash_attention_op).
# bias None is RMSNorm: no mean, no bias gradient (both empty).

@torch.library.custom_op("fused_kernels::layer_norm", mutates_args=())
def layer_norm_op(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                  bias: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(s, y, mean, rstd): y = LayerNorm(s) (RMSNorm) over the last dim, in
    out_dtype (default: s's), of s = x + residual in their promoted dtype, like
    torch's `+`. s is as stored for backward (fp32 under the interpreter;
    add_layer_norm casts); without a residual s = x, returned empty."""
    x2, res2 = _rows(x), _rows(residual)  # (M, N)
    M, N = x2.shape
    rms = bias is None
    weight = weight.contiguous()
    s = x2 if res2 is None else torch.empty_like(x2, dtype=torch.promote_types(x2.dtype, res2.dtype))
    y = torch.empty_like(s, dtype=None if INTERPRET else out_dtype)
    mean, rstd = (torch.empty(M, device=x.device, dtype=torch.float32) for _ in range(2))
    block_n, rows, num_warps = _layer_norm_config(N)
    # stand-ins for what is unused: x2 for RES without a residual, weight for RMSNorm's B
    _layer_norm_fwd_kernel[(triton.cdiv(M, rows),)](
        x2, x2 if res2 is None else res2, weight, weight if rms else bias.contiguous(), y, s, mean, rstd, M, N, eps,
        HAS_RESIDUAL=res2 is not None, RMS=rms, ROWS=rows, BLOCK_N=block_n, num_warps=num_warps)
    s = x.new_empty(0) if residual is None else s.reshape(x.shape)
    return s, y.reshape(x.shape).to(out_dtype or _sum_dtype(x, residual)), _stats(mean, bias), rstd


@layer_norm_op.register_fake
def _(x, residual, weight, bias, eps, out_dtype):
    sum_dtype = _sum_dtype(x, residual)
    s = x.new_empty(0) if residual is None else torch.empty_like(
        x, dtype=torch.float32 if INTERPRET else sum_dtype)
    mean, rstd = (x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32) for _ in range(2))
    return s, torch.empty_like(x, dtype=out_dtype or sum_dtype), _stats(mean, bias), rstd


@torch.library.custom_op("fused_kernels::layer_norm_backward", mutates_args=())
def layer_norm_backward_op(dy: torch.Tensor, dsum: torch.Tensor | None, x: torch.Tensor,
                           weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                           rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db) at the normalized input x (s for the fused add, and dsum the
    gradient that reached s along the residual stream); db empty for RMSNorm."""
    x2, dy2, dsum2 = _rows(x), _rows(dy), _rows(dsum)  # (M, N)
    M, N = x2.shape
    dx = torch.empty_like(x2)
    block_n, rows, num_warps = _layer_norm_config(N)
    # enough programs to fill the GPU, few enough that the (G, N) partials stay small
    sms = 1 if INTERPRET else torch.cuda.get_device_properties(x.device).multi_processor_count
    programs = min(triton.cdiv(M, rows), 4 * sms)
    dw_partial, db_partial = (torch.empty((programs, N), device=x.device, dtype=torch.float32) for _ in range(2))
    _layer_norm_bwd_kernel[(programs,)](x2, weight, dy2, dy2 if dsum2 is None else dsum2, dx,
                                        mean, rstd, dw_partial, db_partial, M, N,
                                        HAS_DSUM=dsum2 is not None, RMS=rms, ROWS=rows,
                                        BLOCK_N=block_n, num_warps=num_warps)
    db = weight.new_empty(0) if rms else db_partial.sum(0).to(weight.dtype)
    return dx.reshape(x.shape).to(x.dtype), dw_partial.sum(0).to(weight.dtype), db


@layer_norm_backward_op.register_fake
def _(dy, dsum, x, weight, mean, rstd, rms):
    return torch.empty_like(x), torch.empty_like(weight), weight.new_empty(0 if rms else weight.shape[0])


def _layer_norm_setup(ctx, inputs, output):
    x, residual, weight, bias, _, _ = inputs
    s, _, mean, rstd = output
    ctx.fused_add = residual is not None
    ctx.save_for_backward(s if ctx.fused_add else x, weight, mean, rstd)
    ctx.rms, ctx.dtypes = bias is None, (x.dtype, residual.dtype if ctx.fused_add else None)


def _layer_norm_grad(ctx, ds, dy, dmean, drstd):
    """With the fused add, s feeds both the norm and the residual stream:
    ds_total = ds + LayerNorm-backward(dy), the gradient of x and of residual alike."""
    s, weight, mean, rstd = ctx.saved_tensors
    dsum, dw, db = layer_norm_backward_op(dy, ds if ctx.fused_add else None, s, weight, mean, rstd, ctx.rms)
    x_dtype, res_dtype = ctx.dtypes
    d_residual = dsum.to(res_dtype) if ctx.fused_add else None
    return dsum.to(x_dtype), d_residual, dw, None if ctx.rms else db, None, None


layer_norm_op.register_autograd(_layer_norm_grad, setup_context=_layer_norm_setup)


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
    require_triton(x.device)


def layer_norm(x, weight, bias, eps: float = 1e-5, out_dtype: torch.dtype | None = None):
    """LayerNorm over the last dim of x (RMSNorm when bias is None); weight and
    bias (N,) may be fp32 for 16-bit x. Statistics in fp32; output in out_dtype
    (default: x's)."""
    _check_layer_norm_inputs(x, weight, bias)
    return layer_norm_op(x, None, weight, bias, float(eps), out_dtype)[1]


def add_layer_norm(x, residual, weight, bias, eps: float = 1e-5,
                   out_dtype: torch.dtype | None = None):
    """(s, layer_norm(s)) for s = x + residual in their promoted dtype, from one
    kernel. In a pre-LN block, `x = x + attn(ln_1(x)); h = ln_2(x)` becomes
    `x, h = add_layer_norm(x, attn(ln_1(x)), ...)`: s is written once, and in
    backward the residual stream's gradient is folded into the norm's kernel."""
    if residual.shape != x.shape or residual.device != x.device:
        raise UsageError(f"add_layer_norm: x and residual must have the same shape and device, "
                         f"got {tuple(x.shape)} on {x.device} and {tuple(residual.shape)} "
                         f"on {residual.device}")
    _check_layer_norm_inputs(x, weight, bias)
    s, y, _, _ = layer_norm_op(x, residual, weight, bias, float(eps), out_dtype)
    return s.to(_sum_dtype(x, residual)), y


class _FusedNorm:
    """forward of the drop-in modules below: LayerNorm, or RMSNorm without a bias."""

    fuses_residual_add = True  # gpt.add_and_norm checks this

    def forward(self, x, residual=None):
        """x (..., N) -> norm(x); with residual, add_layer_norm's (s, norm(s)),
        through the module call so hooks (ZeRO-3's gathering) see it. Under
        autocast norm(x) is written in the autocast dtype, as the matmul it feeds
        would round it: a write, a read and a cast saved. s keeps its dtype."""
        bias = getattr(self, "bias", None)
        if residual is None:
            return layer_norm(x, self.weight, bias, self.eps, _autocast_dtype(x))
        return add_layer_norm(x, residual, self.weight, bias, self.eps, _autocast_dtype(x))


class TritonLayerNorm(_FusedNorm, torch.nn.LayerNorm):
    """nn.LayerNorm (same parameters, state_dict keys and init; isinstance
    checks hold) whose forward runs the fused kernel."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None):
        # always affine with bias: without one the kernel would compute RMSNorm
        super().__init__(hidden_size, eps=eps, device=device, dtype=dtype)


class TritonRMSNorm(_FusedNorm, torch.nn.RMSNorm):
    """nn.RMSNorm whose forward runs the fused kernel."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__(hidden_size, eps=eps, device=device, dtype=dtype)


def _autocast_dtype(x) -> torch.dtype | None:
    """The dtype autocast would cast x to before a matmul, or None outside autocast."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


# ============================================================================
# 4. The fused loss's row passes over a span of logits (fused_loss.py)
# ============================================================================

if HAS_TRITON:

    @triton.jit
    def _row_stats_kernel(Z, LABELS, MAX, SUMEXP, TARGET, V, stride_z, vocab_start,
                          BLOCK_V: tl.constexpr):
        """Program r: row r's max m, sum(exp(z - m)) (an online softmax, as in
        _attn_fwd_inner), and the target logit if this rank's vocab slice holds
        the target (else 0)."""
        log2e = 1.4426950408889634  # LOG2E
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


@torch.library.custom_op("fused_kernels::loss_row_stats", mutates_args=())
def loss_row_stats(z: torch.Tensor, labels: torch.Tensor, vocab_start: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, sum(exp(z - max)), target logit or 0), fp32 (n,) each, of the rows
    of a span of logits z (n, V_local)."""
    n, V = z.shape
    stats = [torch.empty(n, device=z.device, dtype=torch.float32) for _ in range(3)]
    _row_stats_kernel[(n,)](z, labels, *stats, V, z.stride(0), vocab_start, BLOCK_V=_block_v(V, z))
    return tuple(stats)


@loss_row_stats.register_fake
def _(z, labels, vocab_start):
    return tuple(z.new_empty(z.shape[0], dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("fused_kernels::loss_row_grad_", mutates_args=("z",))
def loss_row_grad_(z: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, weight: torch.Tensor,
                   vocab_start: int) -> None:
    """z <- weight * (softmax(z) - onehot(labels)), in place, given each row's lse."""
    n, V = z.shape
    _row_grad_kernel[(n,)](z, labels, lse, weight, V, z.stride(0), vocab_start, BLOCK_V=_block_v(V, z))
