"""Where a training step spends its GPU time: a torch.profiler trace of a few
of train.py's own steps (its engine, train.PlainTraining, and train.train_step:
bf16 autocast, fused AdamW, clipping), summed by kernel category. Flags this
script does not know are train.py's, so any layout of one GPU can be profiled.

    python bench/profile_step.py                          # 124M, Triton kernels, micro-batch 16
    python bench/profile_step.py --preset 350M --impl torch --trace step.json
    python bench/profile_step.py --compile                # the compiled step

Categories are matched on kernel names: attention (ours or flash), matmul
(cuBLAS / CUTLASS GEMMs), LayerNorm, cross-entropy (log-softmax, NLL and
the fp32 logits' casts), optimizer (AdamW, grad-norm clipping), and the
rest (elementwise ops, embedding, copies). "GPU idle" is the wall time of
the profiled steps not covered by any kernel: host-side stalls and launch gaps.
With --trace it is also summed by the host op that launched the kernel the GPU
waited for (idle_by_host_op): a loop of small ops on the host shows up there.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

CATEGORIES = [  # first match wins; lower-case substrings of kernel names
    ("attention", ("_attn_", "flash", "fmha", "attention")),
    ("LayerNorm", ("layer_norm", "layernorm")),
    ("cross-entropy", ("log_softmax", "nll_loss", "cross_entropy", "softmax")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "norm")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "sm90", "sm80", "cublas", "wgmma")),
]


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other (elementwise, embedding, copies)"


def idle_by_host_op(trace: str, top: int = 12) -> list:
    """GPU idle time (ms over the trace) by the host op that launched the kernel
    the GPU waited for: the innermost ATen op, on the launching thread, whose span
    holds the launch. Kernels that Inductor's generated code launches count as
    "(compiled graph)"; a gap whose launch the trace lacks, as "(launch unknown)"."""
    import json
    events = [e for e in json.load(open(trace))["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events  # runtime API, or the driver's (Triton)
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    idle, waits, busy_until = {}, {}, gpu[0]["ts"] if gpu else 0  # waits: thread -> [(launch, gap)]
    for k in gpu:  # a gap: no kernel on any stream runs
        if k["ts"] > busy_until:
            launch = launches.get(k.get("args", {}).get("correlation"))
            if launch is None:
                idle["(launch unknown)"] = idle.get("(launch unknown)", 0.0) + (k["ts"] - busy_until) / 1e3
            else:
                waits.setdefault(launch["tid"], []).append((launch["ts"], k["ts"] - busy_until))
        busy_until = max(busy_until, k["ts"] + k["dur"])
    ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: (e["ts"], -e["dur"]))
    for tid, gaps in waits.items():  # one sweep per thread: the stack holds the ops open at t
        mine, stack, i = [e for e in ops if e["tid"] == tid], [], 0
        for t, gap in sorted(gaps):
            while i < len(mine) and mine[i]["ts"] <= t:
                stack.append(mine[i])
                i += 1
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < t:
                stack.pop()
            name = stack[-1]["name"] if stack else "(no op)"
            if name.startswith(("## Call CompiledFxGraph", "CompiledFunction", "Torch-Compiled Region")):
                name = "(compiled graph)"
            idle[name] = idle.get(name, 0.0) + gap / 1e3
    return sorted(idle.items(), key=lambda kv: -kv[1])[:top]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="124M")
    p.add_argument("--impl", default="triton", choices=["triton", "torch"])
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3, help="profiled steps (after 3 warm-up steps)")
    p.add_argument("--top", type=int, default=20, help="kernels listed individually")
    p.add_argument("--trace", default=None, help="also write a Chrome trace here")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, fp32, the tiny preset (Triton kernels interpreted: TRITON_INTERPRET=1), "
                        "CPU op times instead of kernels: checks that the script runs")
    args, train_flags = p.parse_known_args()
    if args.smoke:
        args.preset, args.micro_batch_size, args.seq_length, args.steps = "tiny", 2, 32, 1
    elif not torch.cuda.is_available():
        sys.exit("profile_step.py needs a CUDA GPU")
    dev = torch.device("cpu" if args.smoke else "cuda")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    import datetime
    import config
    import launch
    import parallel
    import train
    from torch.profiler import ProfilerActivity, profile
    parallel.initialize(1)
    B, T = args.micro_batch_size, args.seq_length
    flags = ["--preset", args.preset, "--attention-impl", args.impl, "--layernorm-impl", args.impl,
             "--micro-batch-size", str(B), "--seq-length", str(T), "--max-position-embeddings", str(max(1024, T))]
    flags += ["--num-attention-heads", "2"] if args.smoke else ["--bf16"]  # smoke: head dim 32, as the kernels have
    cfg = config.parse_args(flags + train_flags)
    trainer = train.PlainTraining(cfg, launch.Dist(0, 1, 0, dev, datetime.timedelta(minutes=5)))
    tokens = torch.randint(0, 50257, (B, T + 1))
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
             "position_ids": torch.arange(T).expand(B, T).contiguous(), "loss_mask": torch.ones(B, T)}
    if dev.type == "cuda":  # as the data loader hands them over
        batch = {k: v.pin_memory() for k, v in batch.items()}

    def step():
        train.train_step(trainer, [batch], 1e-4)

    for _ in range(1 if args.smoke else 3):  # warm-up: compile, autotune, allocate
        step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        wall_ms = 1e3 * (time.perf_counter() - t0) / args.steps
    if args.trace:
        prof.export_chrome_trace(args.trace)
        if dev.type == "cuda":
            print(f"## GPU idle by the host op launching the kernel it waited for ({args.steps} steps)\n")
            print("| host op | idle ms |\n|---|---|")
            for name, ms in idle_by_host_op(args.trace):
                print(f"| {name[:70]} | {ms:.2f} |")
            print()

    kernels = {}  # on CPU (--smoke): the ops' own CPU time
    kind = torch.autograd.DeviceType.CUDA if dev.type == "cuda" else torch.autograd.DeviceType.CPU
    for evt in prof.key_averages():
        us = (getattr(evt, "self_device_time_total", 0) if dev.type == "cuda" else evt.self_cpu_time_total) or 0
        if us > 0 and evt.device_type == kind:
            kernels[evt.key] = kernels.get(evt.key, 0) + us / 1e3 / args.steps  # ms per step
    busy = sum(kernels.values())
    by_cat = {}
    for name, ms in kernels.items():
        by_cat[category(name)] = by_cat.get(category(name), 0) + ms
    where = "CPU, fp32 (--smoke)" if args.smoke else f"bf16, on {torch.cuda.get_device_name()}"
    extra = f", {' '.join(train_flags)}" if train_flags else ""
    print(f"## Profile: GPT {args.preset}, {args.impl} kernels, micro-batch {B}, seq {T}, {where}{extra}\n")
    print(f"step wall time {wall_ms:.1f} ms, kernels {busy:.1f} ms, GPU idle "
          f"{max(wall_ms - busy, 0):.1f} ms ({100 * max(wall_ms - busy, 0) / wall_ms:.0f}%)\n")
    print("| category | ms per step | % of kernel time |\n|---|---|---|")
    for cat, ms in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"| {cat} | {ms:.2f} | {100 * ms / busy:.1f}% |")
    print(f"\n| top {args.top} kernels | category | ms per step |\n|---|---|---|")
    for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"| {name[:90]} | {category(name)} | {ms:.2f} |")


if __name__ == "__main__":
    main()
