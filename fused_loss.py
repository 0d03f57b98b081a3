"""The LM head and the loss fused over spans of tokens (FusedLinearCrossEntropy,
GPT.head's default loss_impl, "fused"). Why: the LM head's output is the
largest activation of a GPT step. At GPT-2 124M, micro-batch 8, seq 1024,
the logits are 8192 x 50304 values: 1.65 GB in fp32 for a stable softmax,
and as much again for their gradient and the softmax kept for backward. The
fused loss (the idea of Liger-Kernel's fused linear cross-entropy and Apple's
Cut Cross-Entropy) walks the tokens in spans, so those logits never exist
whole. For each span it

  1. makes the span's logits z = h W^T             (n, V) in the matmul dtype,
  2. takes each row's max, sum of exp and target logit in fp32 (the log-sum-
     exp, lse), with one pass over z,
  3. overwrites z with its gradient (softmax(z) - onehot(target)) * w_i,
     in units of the largest weight (FusedLinearCrossEntropy says why),
  4. turns that into dh = dz W and adds dz^T h to dW, and frees z.

The gradient can be made in forward because the loss is a weighted sum of
per-token losses, sum_i w_i * loss_i: backward only scales the stored dh and
dW by the incoming scalar, in fp32. Nothing (tokens, vocab)-sized is fp32.

Under tensor parallelism (Megatron's vocab-parallel cross-entropy) W is this
rank's vocab slice: step 2 merges the rows' statistics over the TP group
(parallel.vocab_parallel_lse), and dh is a partial sum, which the f operator
in front of the head all-reduces in backward.

On CUDA steps 2 and 3 are two Triton row passes (fused_kernels.py section 4:
one read of the logits, then one read and one in-place write), elsewhere the
same maths in place in torch. loss_impl="full" (logits, F.cross_entropy) is its reference.
"""
import torch

import fused_kernels
import parallel


# Logits per span (tokens x local vocab), by device: larger spans make
# slightly faster matmuls, smaller ones save memory. 2**28 is 512 MiB of bf16
# logits, 5336 tokens of a 50304-row vocabulary. On CPU the row passes work on
# fp32 spans; 2**24 (64 MiB, 333 tokens) is faster than full logits there, at
# a fraction of their peak memory (bench/RESULTS.md).
SPAN_LOGITS = {"cuda": 2 ** 28, "cpu": 2 ** 24}


def span_lse_and_grad_(z, labels, weight, vocab_start: int, need_grads: bool = True,
                        triton_kernels: bool | None = None):
    """One span's (lse, target logit), fp32 (n,), over the full vocabulary, of
    its logits z (n, V_local), labels (n,) (full-vocabulary ids) and fp32 token
    weights (n,). With need_grads, z is overwritten by weight * (softmax(z) -
    onehot(labels)); without, by scratch values. Triton on CUDA only (the
    interpreter is far too slow to train); tests pass triton_kernels."""
    triton_kernels = fused_kernels.HAS_TRITON and (z.is_cuda if triton_kernels is None else triton_kernels)
    if triton_kernels:
        row_max, sum_exp, z_target = fused_kernels.loss_row_stats(z, labels, vocab_start)
    else:  # three in-place passes, no span-sized temporary (an fp32 copy when z is 16-bit)
        zf = z if z.dtype == torch.float32 else z.float()
        local = (labels - vocab_start).clamp(0, z.shape[1] - 1)[:, None]  # (n, 1)
        here = ((labels >= vocab_start) & (labels < vocab_start + z.shape[1])).float()
        row_max = zf.amax(dim=-1)
        z_target = zf.gather(1, local).squeeze(1) * here
        sum_exp = zf.sub_(row_max[:, None]).exp_().sum(dim=-1)    # zf is now exp(z - row_max)
    if parallel.layout.tp_size > 1:  # each rank holds a slice of every row
        lse, z_target = parallel.vocab_parallel_lse(row_max, sum_exp, z_target)
    else:
        lse = row_max + sum_exp.log()
    if not need_grads:
        return lse, z_target
    if triton_kernels:
        fused_kernels.loss_row_grad_(z, labels, lse, weight, vocab_start)
        return lse, z_target
    zf.mul_((weight * (row_max - lse).exp())[:, None])         # weight * softmax(z)
    zf.scatter_add_(1, local, -(weight * here)[:, None])       # - weight * onehot
    if zf is not z:
        z.copy_(zf)
    return lse, z_target


class FusedLinearCrossEntropy(torch.autograd.Function):
    """loss = sum_i w_i * (lse_i - z_i[target_i]) with z = h W^T, in spans, and
    w_i = loss_mask_i / sum(loss_mask) (1/N without a mask): the masked mean
    cross-entropy, an fp32 scalar. Keeps only dh (like h) and dW (fp32, like W).
    h: (..., C) (through f under TP); weight: (V_local, C), this rank's vocab
    rows; labels, loss_mask (or None): (...), full-vocabulary ids. need_grads:
    whether backward will run (False: the loss alone, for evaluation). Matmuls
    run in the autocast dtype when autocast is on, else in h's dtype.

    The gradients are made before the incoming gradient (under --fp16, the
    loss scale) is known, so they are kept in units of w_max = max_i w_i:
    each logit gradient (w_i / w_max) * (softmax - onehot) lies in [-1, 1], and
    backward multiplies by grad_loss * w_max in fp32. With the weights
    themselves (1/N: 5e-4 at 2048 tokens) the fp16 gradient of a token with
    probability 1e-5 would be 5e-9 and flush to zero; and the loss scale
    (65536) cast to fp16 would be inf."""

    @staticmethod
    def forward(ctx, h, weight, labels, loss_mask, need_grads):
        kind = h.device.type
        compute_dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else h.dtype
        need_grads = need_grads and (h.requires_grad or weight.requires_grad)
        ctx.h_shape = h.shape
        h, labels = h.reshape(-1, h.shape[-1]), labels.reshape(-1)  # (N, C), (N,)
        n_tokens, vocab_local = h.shape[0], weight.shape[0]
        if loss_mask is None:
            token_weight = torch.full((n_tokens,), 1.0 / n_tokens, device=h.device, dtype=torch.float32)
        else:
            mask = loss_mask.reshape(-1).float()
            token_weight = mask / mask.sum().clamp(min=1.0)          # a fully masked batch: 0s, not NaN
        vocab_start = parallel.layout.tp_rank * vocab_local
        h_c, w_c = h.to(compute_dtype), weight.to(compute_dtype)
        dh = torch.empty_like(h_c)
        dw = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
        loss = torch.zeros((), device=h.device, dtype=torch.float32)
        w_max = token_weight.max().clamp(min=torch.finfo(torch.float32).tiny)  # all masked: w = 0
        unit_weight = token_weight / w_max                           # in [0, 1]
        span = max(1, SPAN_LOGITS.get(kind, SPAN_LOGITS["cpu"]) // vocab_local)
        with torch.autocast(kind, enabled=False):  # the dtypes are chosen explicitly above
            for start in range(0, n_tokens, span):
                rows = slice(start, min(start + span, n_tokens))
                z = h_c[rows] @ w_c.t()                              # (n, V_local)
                lse, z_target = span_lse_and_grad_(z, labels[rows], unit_weight[rows], vocab_start,
                                                    need_grads)       # z is now dz / w_max
                loss += (token_weight[rows] * (lse - z_target)).sum()
                if not need_grads:  # evaluation: the loss alone
                    continue
                torch.mm(z, w_c, out=dh[rows])                       # (n, C), partial under TP
                dw += (z.t() @ h_c[rows]).float()                    # (V_local, C)
                del z
        ctx.save_for_backward(dh, dw, w_max)
        ctx.dtypes = h.dtype, weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dh, dw, w_max = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        scale = grad_loss.float() * w_max                            # fp32: 65536 is inf in fp16
        return (dh.float() * scale).to(h_dtype).view(ctx.h_shape), (dw * scale).to(w_dtype), None, None, None
