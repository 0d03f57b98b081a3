"""Benchmark the Triton kernels in fused_kernels.py against PyTorch's on one GPU.

Attention: causal, bf16, forward, backward and forward+backward TFLOP/s of
fused_kernels.flash_attention vs F.scaled_dot_product_attention restricted to its
FlashAttention backend, at a fixed token budget (B*T tokens, H*D hidden) so
every sequence length does the same amount of non-attention work. Inputs come
in the layout the model passes: q, k, v are (B, H, T, D) views of one (B, T,
3*H*D) QKV projection, and the output gradient is laid out (B, T, H, D).
FLOPs follow FlashAttention's convention: forward 4*B*H*T^2*D / 2 (causal),
backward 2.5x that, forward+backward 3.5x.
LayerNorm: forward and backward GB/s of fused_kernels.layer_norm vs F.layer_norm,
bf16 in and out (weights cast once, outside the timed region), counting every
byte each one must move (for ours, the dW/dB partial-sum buffers too), and as
a fraction of the GPU's peak and of a measured device-to-device copy.
Residual add + LayerNorm: microseconds for fused_kernels.add_layer_norm (one
kernel) vs the same add done by torch followed by each LayerNorm, with the
model's autocast dtypes (fp32 residual stream, bf16 branch output).

Prints markdown tables ready to paste into bench/RESULTS.md; --autotune-log
writes every config's autotune timing as JSON.

    python bench/bench_kernels.py                 # everything
    python bench/bench_kernels.py --only attention --seq-lens 1024 2048
    python bench/bench_kernels.py --peak-bw 3.35  # TB/s, when the name is unknown
    KERNELS_AUTOTUNE=wide python bench/bench_kernels.py --only attention  # search every config
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# Peak HBM bandwidth in TB/s, matched against torch.cuda.get_device_name().
# Order matters: more specific names first.
PEAK_BANDWIDTH_TBS = [("H100 PCIe", 2.0), ("H100 NVL", 3.9), ("H100", 3.35), ("H200", 4.8),
                      ("A100", 2.0)]


def peak_bandwidth(device_name: str, override: float | None) -> float | None:
    if override is not None:
        return override
    for key, tbs in PEAK_BANDWIDTH_TBS:
        if key in device_name:
            return tbs
    return None


def bench_ms(fn, warmup: int, rep: int, device: str = "cuda") -> float:
    """Median milliseconds per call (triton's do_bench flushes L2 between runs).
    On CPU (--smoke) a plain clock over three calls: the figures only show
    that every path runs."""
    if device == "cpu":
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return sorted(times)[1]
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def fmt(x: float) -> str:
    """A figure for the tables: whole numbers, or three digits when small (--smoke)."""
    return f"{x:.0f}" if abs(x) >= 10 else f"{x:.3g}"


def sm_count(device: str) -> int:
    """Streaming multiprocessors; fused_kernels.py launches as if there were 1 under the interpreter."""
    return 1 if device == "cpu" else torch.cuda.get_device_properties(0).multi_processor_count


def copy_bandwidth_tbs(args) -> float:
    """A large device-to-device copy, bytes read + written: the practical ceiling."""
    n = 2 ** 20 if args.smoke else 2 ** 28  # 1 GiB on a GPU
    src = torch.empty(n, device=args.device, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), args.warmup, args.rep, args.device)
    return 2 * src.numel() * 4 / ms / 1e9


def attention_flops(B: int, H: int, T: int, D: int, kind: str) -> float:
    """Causal attention matmul FLOPs. Forward: QK^T and PV, 2*2*B*H*T*T*D,
    halved because the causal mask skips half the scores. The backward pass
    does 2.5x the forward's matmuls (5 vs 2: recomputed QK^T, dV, dP, dQ, dK),
    so forward+backward counts 3.5x the forward (FlashAttention convention)."""
    fwd = 4 * B * H * T * T * D / 2
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd+bwd": 3.5 * fwd}[kind]


def sdpa_flash(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if q.device.type == "cpu":  # --smoke: CPU has no flash backend
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def model_layout_inputs(B, H, T, D, dtype=torch.bfloat16, device="cuda"):
    """q, k, v as views of a (B, T, 3*H*D) projection; do as the gradient of
    the model's (B, T, H*D) reshape of the output."""
    qkv = torch.randn(B, T, 3 * H * D, device=device, dtype=dtype, requires_grad=True)
    q, k, v = [t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2)]
    do = torch.randn(B, T, H, D, device=device, dtype=dtype).transpose(1, 2)
    return qkv, q, k, v, do


def time_attention(fn, qkv, q, k, v, do, kind: str, args) -> float:
    if kind == "fwd":
        with torch.no_grad():
            return bench_ms(lambda: fn(q, k, v), args.warmup, args.rep, args.device)
    if kind == "bwd":
        o = fn(q, k, v)
        return bench_ms(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
                        args.warmup, args.rep, args.device)
    return bench_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do), args.warmup, args.rep,
                    args.device)


def autotune_snapshot() -> dict:
    """{kernel: {tuning key: {config: ms}}} of every tuning the launchers have
    done so far (Triton keeps only the last timings per launcher, so this is
    called after each launch that may have tuned)."""
    import fused_kernels
    out = {}
    for name, launcher in fused_kernels._LAUNCHERS.items():
        timings = getattr(launcher, "configs_timings", None) or {}
        best = getattr(launcher, "best_config", None)
        key = next((k for k, v in launcher.cache.items() if v is best), None) if best else None
        if timings and key is not None:
            out.setdefault(name, {})[str(key)] = {
                str(c): (t[0] if isinstance(t, (list, tuple)) else t) for c, t in timings.items()}
    return out


def bench_attention(args) -> list[str]:
    import fused_kernels
    kinds = ("fwd", "bwd", "fwd+bwd")
    rows = ["| T | D | B x H | " + " | ".join(f"{k} ours | {k} SDPA | {k} ratio" for k in kinds) + " |",
            "|---|---|---|" + "---|" * 3 * len(kinds)]
    print("\n".join(rows), flush=True)
    tuning = {}
    for D in args.head_dims:
        for T in args.seq_lens:
            B, H = max(1, args.tokens // T), args.hidden // D
            qkv, q, k, v, do = model_layout_inputs(B, H, T, D, args.dtype, args.device)
            o = fused_kernels.flash_attention(q, k, v)
            torch.autograd.grad(o, (q, k, v), do)  # tunes (once) outside the timing
            for name, per_key in autotune_snapshot().items():
                tuning.setdefault(name, {}).update(per_key)
            err = (o - sdpa_flash(q, k, v)).abs().max().item()
            if err > 5e-2:
                raise RuntimeError(f"flash_attention disagrees with SDPA at T={T}, D={D}: {err}")
            cells = []
            for kind in kinds:
                flops = attention_flops(B, H, T, D, kind)
                ours, ref = (flops / time_attention(fn, qkv, q, k, v, do, kind, args) / 1e9
                             for fn in (fused_kernels.flash_attention, sdpa_flash))
                cells += [fmt(ours), fmt(ref), f"{ours / ref:.2f}"]
            rows.append(f"| {T} | {D} | {B} x {H} | " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
            del qkv, q, k, v, do, o
    if args.autotune_log:
        with open(args.autotune_log, "w") as f:
            json.dump(tuning, f, indent=1)
    print("\nAutotune picks (kernel, key -> best config, ms):")
    for name, per_key in tuning.items():
        for key, timings in per_key.items():
            best = min(timings, key=timings.get)
            print(f"  {name} {key}: {best} {timings[best]:.3f} ms (of {len(timings)} configs)")
    return rows


def layer_norm_bytes(impl: str, kind: str, M: int, N: int, device: str = "cuda") -> int:
    """Bytes a LayerNorm of M rows of N bf16 values must move. Forward: read
    x, write y and the fp32 mean and rstd per row. Backward: read x, dy, mean,
    rstd; write dx; for ours also the fp32 dW/dB partial sums each program
    writes and the reduction reads back (torch's are counted as zero)."""
    import fused_kernels
    act = 2 * M * N  # one bf16 (M, N) tensor
    if kind == "fwd":
        return 2 * act + 8 * M
    total = 3 * act + 8 * M
    if impl == "ours":
        block_n, rows, _ = fused_kernels._layer_norm_config(N)
        programs = min(-(-M // rows), 4 * sm_count(device))  # as fused_kernels.layer_norm_backward_op
        total += 2 * (2 * programs * N * 4)           # dW, dB partials: written, then read
    return total


def bench_layer_norm(args, peak_tbs: float | None, copy_tbs: float) -> list[str]:
    import fused_kernels
    rows = ["| hidden | rows | fwd ours GB/s | fwd torch GB/s | bwd ours GB/s | bwd torch GB/s "
            "| ours fwd / bwd, % of peak | % of measured copy |",
            "|---|---|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    for N in args.ln_hidden:
        M = args.ln_elements // N
        x = torch.randn(M, N, device=args.device, dtype=args.dtype, requires_grad=True)
        dy = torch.randn(M, N, device=args.device, dtype=args.dtype)
        w32, b32 = (torch.randn(N, device=args.device, requires_grad=True) for _ in range(2))
        w16, b16 = (t.detach().to(args.dtype).requires_grad_() for t in (w32, b32))
        fns = {"ours": lambda: fused_kernels.layer_norm(x, w32, b32),          # the model's fp32 weights
               "torch": lambda: F.layer_norm(x, (N,), w16, b16)}         # weights cast beforehand
        params = {"ours": (x, w32, b32), "torch": (x, w16, b16)}
        gbs = {}
        for name, fn in fns.items():
            ms = bench_ms(fn, args.warmup, args.rep, args.device)
            gbs[name, "fwd"] = layer_norm_bytes(name, "fwd", M, N, args.device) / ms / 1e6
            y = fn()
            ms = bench_ms(lambda: torch.autograd.grad(y, params[name], dy, retain_graph=True),
                          args.warmup, args.rep, args.device)
            gbs[name, "bwd"] = layer_norm_bytes(name, "bwd", M, N, args.device) / ms / 1e6
        f, b = gbs["ours", "fwd"], gbs["ours", "bwd"]
        pct = "n/a" if peak_tbs is None else f"{f / (10 * peak_tbs):.0f}% / {b / (10 * peak_tbs):.0f}%"
        rows.append(f"| {N} | {M} | {fmt(f)} | {fmt(gbs['torch', 'fwd'])} | {fmt(b)} | "
                    f"{fmt(gbs['torch', 'bwd'])} | {pct} | {fmt(f / (10 * copy_tbs))}% / "
                    f"{fmt(b / (10 * copy_tbs))}% |")
        print(rows[-1], flush=True)
    return rows


def sweep_layer_norm(args) -> list[str]:
    """Time the LayerNorm kernels directly over (rows a program, warps) and,
    for backward, programs per SM, to choose fused_kernels._layer_norm_config."""
    import itertools
    import triton
    import fused_kernels
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows_out = ["| hidden | pass | config (rows, warps[, programs/SM]) | GB/s | current config GB/s |",
                "|---|---|---|---|---|"]
    print("\n".join(rows_out), flush=True)
    for N in args.ln_hidden:
        M = args.ln_elements // N
        block_n = triton.next_power_of_2(N)
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        dy, y, dx = torch.randn_like(x), torch.empty_like(x), torch.empty_like(x)
        w, b = torch.randn(N, device="cuda"), torch.randn(N, device="cuda")
        mean, rstd = (torch.empty(M, device="cuda") for _ in range(2))

        def fwd(rows, warps):
            fused_kernels._layer_norm_fwd_kernel[(triton.cdiv(M, rows),)](
                x, x, w, b, y, x, mean, rstd, M, N, 1e-5, HAS_RESIDUAL=False, ROWS=rows,
                BLOCK_N=block_n, num_warps=warps)

        def bwd(rows, warps, per_sm):
            programs = min(triton.cdiv(M, rows), per_sm * sms)
            dw_p = torch.empty((programs, N), device="cuda")
            db_p = torch.empty((programs, N), device="cuda")
            fused_kernels._layer_norm_bwd_kernel[(programs,)](
                x, w, dy, dy, dx, mean, rstd, dw_p, db_p, M, N, HAS_DSUM=False, ROWS=rows,
                BLOCK_N=block_n, num_warps=warps)
            return dw_p.sum(0), db_p.sum(0)

        fwd(*fused_kernels._layer_norm_config(N)[1:])  # mean/rstd for the backward
        results = {"fwd": {}, "bwd": {}}
        for rows, warps in itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8, 16)):
            if rows * block_n > 32768 or rows * block_n < 32 * warps:
                continue
            ms = bench_ms(lambda: fwd(rows, warps), 10, 40)
            results["fwd"][(rows, warps)] = layer_norm_bytes("torch", "fwd", M, N) / ms / 1e6
            for per_sm in (2, 4, 8):
                ms = bench_ms(lambda: bwd(rows, warps, per_sm), 10, 40)
                programs = min(triton.cdiv(M, rows), per_sm * sms)
                nbytes = layer_norm_bytes("torch", "bwd", M, N) + 4 * 2 * programs * N * 4
                results["bwd"][(rows, warps, per_sm)] = nbytes / ms / 1e6
        _, cur_rows, cur_warps = fused_kernels._layer_norm_config(N)
        current = {"fwd": results["fwd"].get((cur_rows, cur_warps)),
                   "bwd": results["bwd"].get((cur_rows, cur_warps, 4))}
        for kind in ("fwd", "bwd"):
            for cfg, gbs in sorted(results[kind].items(), key=lambda kv: -kv[1])[:3]:
                cur = "-" if current[kind] is None else f"{current[kind]:.0f}"
                rows_out.append(f"| {N} | {kind} | {cfg} | {gbs:.0f} | {cur} |")
                print(rows_out[-1], flush=True)
    return rows_out


def bench_add_layer_norm(args) -> list[str]:
    import fused_kernels
    rows = ["| hidden | fused fwd us | add + triton LN fwd us | add + torch LN fwd us "
            "| fused fwd+bwd us | add + triton LN fwd+bwd us | add + torch LN fwd+bwd us |",
            "|---|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    M = args.ln_rows
    for N in args.ln_hidden:
        dev = args.device
        x = torch.randn(M, N, device=dev, requires_grad=True)                       # stream, fp32
        r = torch.randn(M, N, device=dev, dtype=args.dtype, requires_grad=True)     # branch
        w = torch.randn(N, device=dev, requires_grad=True)
        b = torch.randn(N, device=dev, requires_grad=True)
        ds, dy = torch.randn(M, N, device=dev), torch.randn(M, N, device=dev)
        variants = {
            "fused": lambda: fused_kernels.add_layer_norm(x, r, w, b),
            "triton": lambda: (lambda s: (s, fused_kernels.layer_norm(s, w, b)))(x + r),
            "torch": lambda: (lambda s: (s, F.layer_norm(s, (N,), w, b)))(x + r),
        }
        fwd, both = [], []
        for fn in variants.values():
            fwd.append(1e3 * bench_ms(fn, args.warmup, args.rep, dev))
            both.append(1e3 * bench_ms(
                lambda: torch.autograd.grad(fn(), (x, r, w, b), (ds, dy)), args.warmup, args.rep, dev))
        rows.append(f"| {N} | " + " | ".join(f"{t:.0f}" for t in fwd + both) + " |")
        print(rows[-1], flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["attention", "layernorm", "addnorm", "ln-sweep"], default=None)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--tokens", type=int, default=16384, help="B*T per attention call")
    p.add_argument("--hidden", type=int, default=2048, help="H*D per attention call")
    p.add_argument("--ln-hidden", type=int, nargs="+", default=[768, 1024, 2048, 4096, 8192])
    p.add_argument("--ln-elements", type=int, default=2 ** 26,
                   help="rows x hidden per LayerNorm call (128 MiB of bf16: far past L2)")
    p.add_argument("--ln-rows", type=int, default=16384, help="rows for the residual add + LayerNorm")
    p.add_argument("--peak-bw", type=float, default=None, help="peak memory bandwidth in TB/s")
    p.add_argument("--warmup", type=int, default=25, help="ms of warmup per measurement")
    p.add_argument("--rep", type=int, default=100, help="ms of timed runs per measurement")
    p.add_argument("--autotune-log", default=None, help="write every autotune timing here (JSON)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, Triton interpreter (TRITON_INTERPRET=1), tiny shapes, fp32: checks that "
                        "every path of this script runs before it meets a GPU")
    args = p.parse_args()
    args.device, args.dtype = "cuda", torch.bfloat16
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
        # The interpreter computes bf16 dots in numpy, without bf16: fp32 there.
        args.device, args.dtype = "cpu", torch.float32
        args.seq_lens, args.head_dims, args.tokens, args.hidden = [64], [32], 64, 64
        args.ln_hidden, args.ln_elements, args.ln_rows = [128], 4096, 32
    elif not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                 "the kernels' correctness tests run on CPU: pytest tests/test_fused_kernels.py")
    import triton
    name = "CPU (Triton interpreter, --smoke)" if args.smoke else torch.cuda.get_device_name()
    peak = peak_bandwidth(name, args.peak_bw)
    copy_tbs = copy_bandwidth_tbs(args)
    print(f"## Kernel benchmarks on {name} (torch {torch.__version__}, triton {triton.__version__})\n")
    print(f"device-to-device copy: {copy_tbs:.3g} TB/s (read + write); "
          f"peak {peak or 'unknown'} TB/s\n")
    if args.only in (None, "attention"):
        print(f"### Causal attention, bf16, TFLOP/s (B*T={args.tokens}, H*D={args.hidden}; "
              f"ratio = ours / SDPA flash)\n")
        bench_attention(args)
        print()
    if args.only in (None, "layernorm"):
        peak_txt = f"peak {peak} TB/s" if peak else "peak unknown: pass --peak-bw"
        print(f"### LayerNorm, bf16 in and out, {args.ln_elements} elements a call ({peak_txt})\n")
        bench_layer_norm(args, peak, copy_tbs)
        print()
    if args.only in (None, "addnorm"):
        print(f"### Residual add + LayerNorm, fp32 stream + bf16 branch, {args.ln_rows} rows\n")
        bench_add_layer_norm(args)
    if args.only == "ln-sweep":
        print("### LayerNorm kernel configs, bf16, best three per hidden size\n")
        sweep_layer_norm(args)


if __name__ == "__main__":
    main()
