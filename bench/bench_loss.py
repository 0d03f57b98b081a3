"""Peak memory and time of the LM head + loss: the full-logits path vs the
fused one (fused_loss.FusedLinearCrossEntropy), forward + backward, at GPT-2 124M's head (hidden 768,
50304 rows) for micro-batch x seq tokens.

    python bench/bench_loss.py                    # CUDA if present (bf16 autocast), else CPU (fp32)
    python bench/bench_loss.py --tokens 16384 --dtype fp32

Peak memory is the allocator's peak above what was allocated before (CUDA),
or, on CPU, the rise of the peak resident memory of a fresh process per path
over what the inputs took.
"""
import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fused_loss  # noqa: E402
import parallel  # noqa: E402


def full_logits_loss(h, weight, labels):
    logits = h @ weight.t()                                           # (N, V)
    return F.cross_entropy(logits.float(), labels)


def max_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports KiB)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def fused_head_loss(h, weight, labels):
    return fused_loss.FusedLinearCrossEntropy.apply(h, weight, labels, None, True)


PATHS = {"full logits": full_logits_loss, "fused (fused_loss.FusedLinearCrossEntropy)": fused_head_loss}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8 * 1024, help="micro-batch x seq")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                   help="autocast bf16 (default on CUDA) or fp32 (default on CPU)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--only", choices=list(PATHS), default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or ("bf16" if device == "cuda" else "fp32")
    parallel.initialize(1)
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(args.tokens, args.hidden, device=device, generator=g)
    weight = 0.02 * torch.randn(args.vocab, args.hidden, device=device, generator=g)
    labels = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=g)
    if args.only is None:
        print(f"## LM head + loss, {args.tokens} tokens x {args.vocab} vocab x {args.hidden} hidden, "
              f"{dtype}, {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'CPU'})\n")
        print("| path | peak memory MB | fwd+bwd ms |\n|---|---|---|")
    for name, fn in PATHS.items():
        if args.only not in (None, name):
            continue
        if device == "cpu" and args.only is None:
            # CPU: one fresh process per path, whose peak RSS nothing else has raised
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--only", name],
                                 capture_output=True, text=True, check=True).stdout.splitlines()[-1]
            print(out, flush=True)
            continue
        hh, ww = h.clone().requires_grad_(), weight.clone().requires_grad_()

        def step():
            hh.grad = ww.grad = None
            with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bf16"):
                value = fn(hh, ww, labels)
            value.backward()

        base = max_rss_bytes()
        step()  # warm-up (kernels compile here)
        if device == "cuda":
            torch.cuda.synchronize()
            hh.grad = ww.grad = None
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        else:  # the inputs were made before `base`: this is the head + loss alone
            peak = max_rss_bytes() - base
        times = []
        for _ in range(args.reps):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        print(f"| {name} | {peak / 2**20:,.0f} | {1e3 * sorted(times)[len(times) // 2]:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
