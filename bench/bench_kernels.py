"""Benchmark the Triton kernels in kernels.py against PyTorch's on one GPU.

Attention: causal, bf16, forward and forward+backward TFLOP/s of
kernels.flash_attention vs F.scaled_dot_product_attention restricted to its
FlashAttention backend, at a fixed token budget (B*T tokens, H*D hidden) so
every sequence length does the same amount of non-attention work.
LayerNorm: forward and backward GB/s of kernels.layer_norm vs F.layer_norm,
and as a fraction of the GPU's peak memory bandwidth.
Residual add + LayerNorm: microseconds for kernels.add_layer_norm (one
kernel) vs the same add done by torch followed by each LayerNorm, with the
model's autocast dtypes (fp32 residual stream, bf16 branch output).

Prints markdown tables ready to paste into bench/RESULTS.md.

    python bench/bench_kernels.py                 # everything
    python bench/bench_kernels.py --only attention --seq-lens 1024 2048
    python bench/bench_kernels.py --peak-bw 3.35  # TB/s, when the name is unknown
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# Peak HBM bandwidth in TB/s, matched against torch.cuda.get_device_name().
# Order matters: more specific names first.
PEAK_BANDWIDTH_TBS = [("H100 PCIe", 2.0), ("H100", 3.35), ("H200", 4.8), ("A100", 2.0)]


def peak_bandwidth(device_name: str, override: float | None) -> float | None:
    if override is not None:
        return override
    for key, tbs in PEAK_BANDWIDTH_TBS:
        if key in device_name:
            return tbs
    return None


def bench_ms(fn, warmup: int, rep: int) -> float:
    """Median milliseconds per call (triton's do_bench flushes L2 between runs)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def attention_flops(B: int, H: int, T: int, D: int, backward: bool) -> float:
    """Causal attention matmul FLOPs. Forward: QK^T and PV, 2*2*B*H*T*T*D,
    halved because the causal mask skips half the scores. The backward pass
    does 2.5x the forward's matmuls (5 vs 2: recomputed QK^T, dV, dP, dQ, dK),
    so forward+backward counts 3.5x the forward (FlashAttention paper convention)."""
    fwd = 4 * B * H * T * T * D / 2
    return fwd * 3.5 if backward else fwd


def sdpa_flash(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def time_attention(fn, q, k, v, do, backward: bool, args) -> float:
    if not backward:
        return bench_ms(lambda: fn(q, k, v), args.warmup, args.rep)

    def step():
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward(do)
    return bench_ms(step, args.warmup, args.rep)


def bench_attention(args) -> list[str]:
    import kernels
    rows = ["| T | D | B x H | fwd triton | fwd SDPA-flash | fwd+bwd triton | fwd+bwd SDPA-flash |",
            "|---|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    for D in args.head_dims:
        for T in args.seq_lens:
            B, H = max(1, args.tokens // T), args.hidden // D
            q, k, v, do = [torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
                           for _ in range(4)]
            for t in (q, k, v):
                t.requires_grad_()
            err = (kernels.flash_attention(q, k, v) - sdpa_flash(q, k, v)).abs().max().item()
            if err > 5e-2:
                raise RuntimeError(f"flash_attention disagrees with SDPA at T={T}, D={D}: {err}")
            cells = []
            for backward in (False, True):
                flops = attention_flops(B, H, T, D, backward)
                for fn in (kernels.flash_attention, sdpa_flash):
                    ms = time_attention(fn, q, k, v, do, backward, args)
                    cells.append(f"{flops / ms / 1e9:.0f}")
            rows.append(f"| {T} | {D} | {B} x {H} | " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
            del q, k, v, do
    return rows


def bench_layer_norm(args, peak_tbs: float | None) -> list[str]:
    import kernels
    rows = ["| hidden | fwd triton GB/s | fwd torch GB/s | bwd triton GB/s | bwd torch GB/s "
            "| triton fwd/bwd % of peak |",
            "|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    M = args.ln_rows
    for N in args.ln_hidden:
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(N, device="cuda", requires_grad=True)
        b = torch.randn(N, device="cuda", requires_grad=True)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        fns = {"triton": kernels.layer_norm,
               "torch": lambda x_, w_, b_: F.layer_norm(x_, (N,), w_.to(x_.dtype), b_.to(x_.dtype))}
        nbytes = x.numel() * x.element_size()
        gbs = {}
        for name, fn in fns.items():
            ms = bench_ms(lambda: fn(x, w, b), args.warmup, args.rep)
            gbs[name, "fwd"] = 2 * nbytes / ms / 1e6            # read x, write y
            y = fn(x, w, b)
            ms = bench_ms(lambda: torch.autograd.grad(y, (x, w, b), dy, retain_graph=True),
                          args.warmup, args.rep)
            gbs[name, "bwd"] = 3 * nbytes / ms / 1e6            # read x and dy, write dx
        pct = "n/a" if peak_tbs is None else (
            f"{100 * gbs['triton', 'fwd'] / (peak_tbs * 1e3):.0f}% / "
            f"{100 * gbs['triton', 'bwd'] / (peak_tbs * 1e3):.0f}%")
        rows.append(f"| {N} | {gbs['triton', 'fwd']:.0f} | {gbs['torch', 'fwd']:.0f} | "
                    f"{gbs['triton', 'bwd']:.0f} | {gbs['torch', 'bwd']:.0f} | {pct} |")
        print(rows[-1], flush=True)
    return rows


def bench_add_layer_norm(args) -> list[str]:
    import kernels
    rows = ["| hidden | fused fwd us | add + triton LN fwd us | add + torch LN fwd us "
            "| fused fwd+bwd us | add + triton LN fwd+bwd us | add + torch LN fwd+bwd us |",
            "|---|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    M = args.ln_rows
    for N in args.ln_hidden:
        x = torch.randn(M, N, device="cuda", requires_grad=True)                       # stream, fp32
        r = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # branch
        w = torch.randn(N, device="cuda", requires_grad=True)
        b = torch.randn(N, device="cuda", requires_grad=True)
        ds, dy = torch.randn(M, N, device="cuda"), torch.randn(M, N, device="cuda")
        variants = {
            "fused": lambda: kernels.add_layer_norm(x, r, w, b),
            "triton": lambda: (lambda s: (s, kernels.layer_norm(s, w, b)))(x + r),
            "torch": lambda: (lambda s: (s, F.layer_norm(s, (N,), w, b)))(x + r),
        }
        fwd, both = [], []
        for fn in variants.values():
            fwd.append(1e3 * bench_ms(fn, args.warmup, args.rep))
            both.append(1e3 * bench_ms(
                lambda: torch.autograd.grad(fn(), (x, r, w, b), (ds, dy)), args.warmup, args.rep))
        rows.append(f"| {N} | " + " | ".join(f"{t:.0f}" for t in fwd + both) + " |")
        print(rows[-1], flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["attention", "layernorm", "addnorm"], default=None)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--tokens", type=int, default=16384, help="B*T per attention call")
    p.add_argument("--hidden", type=int, default=2048, help="H*D per attention call")
    p.add_argument("--ln-hidden", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--ln-rows", type=int, default=16384)
    p.add_argument("--peak-bw", type=float, default=None, help="peak memory bandwidth in TB/s")
    p.add_argument("--warmup", type=int, default=25, help="ms of warmup per measurement")
    p.add_argument("--rep", type=int, default=100, help="ms of timed runs per measurement")
    args = p.parse_args()

    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                 "the kernels' correctness tests run on CPU: pytest tests/test_kernels.py")
    name = torch.cuda.get_device_name()
    peak = peak_bandwidth(name, args.peak_bw)
    print(f"## Kernel benchmarks on {name} (torch {torch.__version__})\n")
    if args.only in (None, "attention"):
        print(f"### Causal attention, bf16, TFLOP/s (B*T={args.tokens}, H*D={args.hidden})\n")
        bench_attention(args)
        print()
    if args.only in (None, "layernorm"):
        peak_txt = f"peak {peak} TB/s" if peak else "peak unknown: pass --peak-bw"
        print(f"### LayerNorm, bf16 activations, fp32 weights, {args.ln_rows} rows ({peak_txt})\n")
        bench_layer_norm(args, peak)
        print()
    if args.only in (None, "addnorm"):
        print(f"### Residual add + LayerNorm, fp32 stream + bf16 branch, {args.ln_rows} rows\n")
        bench_add_layer_norm(args)


if __name__ == "__main__":
    main()
