"""LayerNorm and RMSNorm in Triton: one pass forward, one backward with
per-program partial dW/dB, each optionally fused with the residual add that
precedes the norm; the drop-in modules TritonLayerNorm and TritonRMSNorm.

LayerNorm is memory bound: one fused pass (read x once, write y once) beats
the several elementwise kernels an unfused version launches.

  1. the kernels (RMS: a constexpr switch, no mean and no bias)
  2. launch helpers, autograd wrappers, the public functions and modules
"""
import torch
import torch.nn.functional as F

from kernels.runtime import HAS_TRITON, INTERPRET, require_triton, tl, triton


# ---------------------------------------------------------------------------
# 1. LayerNorm kernels. x is viewed as (M, N) rows; BLOCK_N = next_pow2(N).
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
# 2. Launch helpers, autograd wrappers and public API
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
    FlashAttentionFunction.forward) when upcast is set."""
    t = t.reshape(-1, t.shape[-1])
    return (t.float() if upcast else t).contiguous()


class LayerNormFunction(torch.autograd.Function):
    """y = LayerNorm(x), or RMSNorm(x) when bias is None."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, out_dtype):
        x2 = _rows(x, INTERPRET)
        y, _, mean, rstd, config = _ln_forward(x2, None, weight, bias, eps, _kernel_dtype(out_dtype))
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.in_dtype, ctx.config, ctx.rms = x.dtype, config, bias is None
        return y.reshape(x.shape).to(out_dtype or x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _ln_backward(x2, weight, mean, rstd, _rows(dy, INTERPRET), None, ctx.config,
                                  rms=ctx.rms)
        return dx.reshape(dy.shape).to(ctx.in_dtype), dw, db, None, None


class AddLayerNormFunction(torch.autograd.Function):
    """(s, y) = (x + residual, LayerNorm(x + residual)) in one kernel
    (RMSNorm when bias is None).
    Backward: s feeds both the LayerNorm and the rest of the residual
    stream, so ds_total = ds + LayerNorm-backward(dy), and since s = x +
    residual, that is the gradient of x and of residual alike."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, out_dtype):
        sum_dtype = torch.promote_types(x.dtype, residual.dtype)
        x2, r2 = _rows(x, INTERPRET), _rows(residual, INTERPRET)
        y, s, mean, rstd, config = _ln_forward(x2, r2, weight, bias, eps, _kernel_dtype(out_dtype))
        ctx.save_for_backward(s, weight, mean, rstd)
        ctx.dtypes, ctx.config, ctx.rms = (x.dtype, residual.dtype, sum_dtype), config, bias is None
        return s.reshape(x.shape).to(sum_dtype), y.reshape(x.shape).to(out_dtype or sum_dtype)

    @staticmethod
    def backward(ctx, ds, dy):
        s2, weight, mean, rstd = ctx.saved_tensors
        dsum, dw, db = _ln_backward(s2, weight, mean, rstd, _rows(dy, INTERPRET),
                                    _rows(ds, INTERPRET), ctx.config, rms=ctx.rms)
        dsum = dsum.reshape(dy.shape)
        x_dtype, res_dtype, _ = ctx.dtypes
        return dsum.to(x_dtype), dsum.to(res_dtype), dw, db, None, None


def _check_layer_norm_inputs(x, weight, bias):
    N = x.shape[-1]
    if weight.shape != (N,) or (bias is not None and bias.shape != (N,)):
        raise ValueError(f"layer_norm: weight and bias must have shape ({N},), got "
                         f"{tuple(weight.shape)} and {None if bias is None else tuple(bias.shape)}")
    if N * 4 > _MAX_LN_BYTES:
        raise ValueError(f"layer_norm: hidden size {N} too large for the one-row-per-program "
                         f"kernel (max {_MAX_LN_BYTES // 4}); use layernorm_impl='torch'")
    if x.numel() == 0:
        raise ValueError("layer_norm: got an empty input tensor")
    require_triton(x)


def layer_norm(x, weight, bias, eps: float = 1e-5, out_dtype: torch.dtype | None = None):
    """Fused LayerNorm over the last dim of x (any leading shape), with affine
    weight and bias of shape (N,). Statistics in fp32; output in out_dtype
    (default: x's dtype). weight/bias may be fp32 while x is fp16/bf16."""
    _check_layer_norm_inputs(x, weight, bias)
    return LayerNormFunction.apply(x, weight, bias, float(eps), out_dtype)


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
        raise ValueError(f"add_layer_norm: x and residual must have the same shape and device, "
                         f"got {tuple(x.shape)} on {x.device} and {tuple(residual.shape)} "
                         f"on {residual.device}")
    _check_layer_norm_inputs(x, weight, bias)
    return AddLayerNormFunction.apply(x, residual, weight, bias, float(eps), out_dtype)


def rms_norm(x, weight, eps: float = 1e-5, out_dtype: torch.dtype | None = None):
    """Fused RMSNorm over the last dim of x: x / sqrt(mean(x^2) + eps) * weight.
    The LayerNorm kernels with their RMS switch; statistics in fp32."""
    _check_layer_norm_inputs(x, weight, None)
    return LayerNormFunction.apply(x, weight, None, float(eps), out_dtype)


def add_rms_norm(x, residual, weight, eps: float = 1e-5, out_dtype: torch.dtype | None = None):
    """Fused residual add + RMSNorm: (s, rms_norm(s)) for s = x + residual
    (see add_layer_norm)."""
    return add_layer_norm(x, residual, weight, None, eps, out_dtype)


def rms_norm_torch(x, weight, eps: float = 1e-5):
    """Reference / fallback: F.rms_norm over the last dim, same signature."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def layer_norm_torch(x, weight, bias, eps: float = 1e-5):
    """Reference / fallback: F.layer_norm over the last dim, same signature."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


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
