"""The language-model loss: LM head and cross-entropy fused over chunks of
tokens, so that the full (tokens, vocab) logits never exist at once.

Why: the LM head's output is the largest activation of a GPT step. At GPT-2
124M, micro-batch 8, seq 1024, the logits are 8192 x 50304 values; upcast to
fp32 for a stable softmax that is 1.65 GB, plus as much again for their
gradient and the softmax kept for backward. The fused loss (the idea of
Liger-Kernel's fused linear cross-entropy and Apple's Cut Cross-Entropy)
walks the tokens in chunks. For each chunk it

  1. makes the chunk's logits z = h W^T            (n, V) in the matmul dtype,
  2. takes each row's max, sum of exp and target logit in fp32 (the log-sum-
     exp, lse), with one pass over z,
  3. overwrites z with its gradient (softmax(z) - onehot(target)) * w_i,
     kept in units of the largest weight so that it fits fp16 (see below),
  4. turns that into the input gradient dh = dz W and adds dz^T h to dW,

and then frees z. The loss gradient is computed during the forward pass,
which is possible because the loss is a weighted sum of the per-token losses,
sum_i w_i * loss_i (w_i = loss_mask_i / sum(loss_mask), or 1/N): backward
only scales the stored dh and dW by the incoming scalar gradient (under
--fp16, the loss scale), in fp32. No chunk
keeps logits for backward, and nothing (tokens, vocab)-sized is ever fp32.

Tensor parallelism (Megatron's vocab-parallel cross-entropy): W is this
rank's slice of the vocabulary, so each rank sees a slice of every row.
Step 2 all-reduces the per-row max (MAX) and the rescaled sum of exp and the
target logit (SUM) over the tensor-parallel group, exactly as
parallel.vocab_parallel_cross_entropy does; dh is then a partial sum, which
the f operator in front of the head (copy_to_tensor_parallel_region)
all-reduces in backward.

The row passes of steps 2 and 3 are Triton kernels on CUDA (one read of the
logits for the statistics, one read and one in-place write for the
gradient); elsewhere the same maths runs as torch ops, in place on the chunk
(chunk_lse_and_grad_).
`loss_impl="full"` in GPTConfig keeps the unfused path (full logits, then
parallel.vocab_parallel_cross_entropy) for comparison.
"""
import torch
import torch.distributed as dist

import parallel

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

# Logits per chunk (tokens x local vocab), by device. Larger chunks make
# larger, slightly more efficient matmuls; smaller ones save memory. On CUDA
# the Triton row passes work in place, so a chunk costs its logits alone:
# 2**28 is 512 MiB in bf16, 5336 tokens of GPT-2's 50304-row vocabulary.
# Elsewhere the row passes are torch ops, in place on fp32 chunks (16-bit
# ones get an fp32 copy); 2**24 (64 MiB, 333 tokens) cuts the head + loss
# peak several-fold against the full logits and runs faster (bench/RESULTS.md).
CHUNK_LOGITS = {"cuda": 2 ** 28, "cpu": 2 ** 24}


# ---------------------------------------------------------------------------
# Row passes over one chunk's logits z (n, V_local)

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


def _use_triton(z, triton_kernels: bool | None) -> bool:
    """Default: the Triton kernels on CUDA only. On CPU they would run
    through Triton's interpreter, far too slowly for training; the tests
    pass triton_kernels=True to check them there."""
    return HAS_TRITON and (z.is_cuda if triton_kernels is None else triton_kernels)


def _block_v(V: int, z) -> int:
    return 64 if z.device.type == "cpu" else min(4096, triton.next_power_of_2(V))


def chunk_lse_and_grad_(z, labels, weight, vocab_start: int, need_grads: bool = True,
                        triton_kernels: bool | None = None):
    """One chunk's loss statistics, and its gradient in place.

    z: the chunk's logits (n, V_local), this rank's vocab slice; labels (n,):
    full-vocabulary ids; weight (n,) fp32: each token's weight in the loss.
    Returns (lse, target logit), fp32 (n,), over the full vocabulary (under TP
    the rows' statistics are combined across the slices). With need_grads, z
    is overwritten by weight * (softmax(z) - onehot(labels)); without, z is
    left holding scratch values."""
    if _use_triton(z, triton_kernels):
        n, V = z.shape
        stats = [torch.empty(n, device=z.device, dtype=torch.float32) for _ in range(3)]
        _row_stats_kernel[(n,)](z, labels, *stats, V, z.stride(0), vocab_start, BLOCK_V=_block_v(V, z))
        lse, z_target = _over_the_vocabulary(*stats)
        if need_grads:
            _row_grad_kernel[(n,)](z, labels, lse, weight, V, z.stride(0), vocab_start,
                                   BLOCK_V=_block_v(V, z))
        return lse, z_target
    # The same maths as torch ops, exp in place: three passes over the chunk,
    # no chunk-sized temporary (a copy only when z is 16-bit, for fp32 maths).
    zf = z if z.dtype == torch.float32 else z.float()
    local = (labels - vocab_start).clamp(0, z.shape[1] - 1)[:, None]  # (n, 1)
    here = ((labels >= vocab_start) & (labels < vocab_start + z.shape[1])).float()
    row_max = zf.amax(dim=-1)
    z_target = zf.gather(1, local).squeeze(1) * here
    sum_exp = zf.sub_(row_max[:, None]).exp_().sum(dim=-1)    # zf is now exp(z - row_max)
    lse, z_target = _over_the_vocabulary(row_max, sum_exp, z_target)
    if need_grads:
        zf.mul_((weight * (row_max - lse).exp())[:, None])     # weight * softmax(z)
        zf.scatter_add_(1, local, -(weight * here)[:, None])   # - weight * onehot
        if zf is not z:
            z.copy_(zf)
    return lse, z_target


def _over_the_vocabulary(row_max, sum_exp, z_target):
    """(lse, target logit) per row from this rank's slice's max, sum of
    exp(z - max) and target logit (0 where another slice holds the target):
    under TP the slices' statistics are combined, as in Megatron's
    vocab-parallel cross-entropy."""
    if parallel.tp_size() > 1:
        global_max = row_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=parallel.tp_group())
        both = torch.stack([sum_exp * (row_max - global_max).exp(), z_target])  # one all-reduce
        dist.all_reduce(both, group=parallel.tp_group())
        row_max, (sum_exp, z_target) = global_max, both
    return row_max + sum_exp.log(), z_target


# ---------------------------------------------------------------------------
# The fused head + loss


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """loss = sum_i w_i * (lse_i - z_i[target_i]) with z = h W^T, in chunks;
    returns the fp32 scalar and keeps only dh (like h) and dW (fp32, like W).

    The gradients are made in forward, before backward's incoming gradient
    (under --fp16, the loss scale) is known, so they are kept in units of
    w_max = max_i w_i: each logit gradient (w_i / w_max) * (softmax - onehot)
    lies in [-1, 1], and backward multiplies by grad_loss * w_max in fp32.
    With the weights themselves (1/N: 5e-4 at 2048 tokens) an fp16 logit
    gradient of a token with probability 1e-5 would be 5e-9, below fp16's
    smallest value, and flush to zero; and grad_loss (the loss scale, 65536)
    cast to fp16 would be inf."""

    @staticmethod
    def forward(ctx, h, weight, labels, token_weight, compute_dtype, need_grads):
        n_tokens, _ = h.shape
        vocab_local = weight.shape[0]
        vocab_start = parallel.tp_rank() * vocab_local
        h_c, w_c = h.to(compute_dtype), weight.to(compute_dtype)
        dh = torch.empty_like(h_c)
        dw = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
        loss = torch.zeros((), device=h.device, dtype=torch.float32)
        w_max = token_weight.max().clamp(min=torch.finfo(torch.float32).tiny)  # all masked: w = 0
        unit_weight = token_weight / w_max                           # in [0, 1]
        chunk = max(1, CHUNK_LOGITS.get(h.device.type, CHUNK_LOGITS["cpu"]) // vocab_local)
        for start in range(0, n_tokens, chunk):
            rows = slice(start, min(start + chunk, n_tokens))
            z = h_c[rows] @ w_c.t()                                  # (n, V_local)
            lse, z_target = chunk_lse_and_grad_(z, labels[rows], unit_weight[rows], vocab_start,
                                                need_grads)           # z is now dz / w_max
            loss += (token_weight[rows] * (lse - z_target)).sum()
            if not need_grads:  # evaluation: the loss alone
                continue
            torch.mm(z, w_c, out=dh[rows])                           # (n, C), partial under TP
            if z.dtype == torch.float32:
                dw.addmm_(z.t(), h_c[rows])                          # (V_local, C)
            else:
                dw += z.t() @ h_c[rows]
            del z
        ctx.save_for_backward(dh, dw, w_max)
        ctx.dtypes = h.dtype, weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dh, dw, w_max = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        scale = grad_loss.float() * w_max                            # fp32: 65536 is inf in fp16
        return (dh.float() * scale).to(h_dtype), (dw * scale).to(w_dtype), None, None, None, None


def token_weights(labels, loss_mask=None):
    """w_i such that the loss is sum_i w_i * loss_i: 1/N for a plain mean, or
    loss_mask_i / sum(loss_mask) (a fully masked batch gets 0s, not NaN)."""
    n = labels.numel()
    if loss_mask is None:
        return torch.full((n,), 1.0 / n, device=labels.device, dtype=torch.float32)
    mask = loss_mask.reshape(-1).float()
    return mask / mask.sum().clamp(min=1.0)


def fused_lm_loss(h, weight, labels, loss_mask=None):
    """The LM head h W^T and the mean (or loss_mask-weighted) cross-entropy in
    one, without full logits. h: (..., C) final hidden states (already through
    the f operator under TP); weight: (V_local, C) this rank's vocab rows;
    labels: (...) full-vocabulary ids. Returns the fp32 scalar loss. Matmuls
    run in the autocast dtype when autocast is on, else in h's dtype."""
    kind = h.device.type
    compute_dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else h.dtype
    need_grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    with torch.autocast(kind, enabled=False):  # the dtypes are chosen explicitly above
        return _FusedLinearCrossEntropy.apply(
            h.reshape(-1, h.shape[-1]), weight, labels.reshape(-1),
            token_weights(labels, loss_mask), compute_dtype, need_grads)
