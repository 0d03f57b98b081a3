"""Whole-model training throughput on one GPU, measured through train.py itself.

Each variant is a real `train.py` run (bf16 autocast, fused AdamW, clipping,
the data loader, logging) on a random-token corpus that this script writes
once; the figures are train.py's own logged tokens/s and MFU, taken as the
median of the log intervals after the first (which holds warm-up). The first
step's time (compilation and autotuning) is reported separately.

    variant          what runs
    triton           our model, Triton attention + LayerNorm (the CUDA default)
    torch            our model, F.scaled_dot_product_attention + nn.LayerNorm
    torch-compile    torch kernels under --compile
    triton-compile   Triton kernels under --compile
    torch-graphs     torch kernels under --compile --compile-mode reduce-overhead
                     (the step replayed as CUDA graphs)
    triton-graphs    Triton kernels, likewise
    nanogpt-compile  nanoGPT's model.py at the same shape, torch.compile'd, its
                     fused AdamW, bf16 autocast: a yardstick, not part of this
                     project. Fetch it first (git-ignored):
                     mkdir -p bench/ref/nanogpt && curl -o bench/ref/nanogpt/model.py \\
                       https://raw.githubusercontent.com/karpathy/nanoGPT/master/model.py

MFU (model FLOPs utilization) = achieved model FLOP/s / the GPU's peak dense
bf16 FLOP/s (train_ops.PEAK_FLOPS by GPU name, or --peak-tflops), with model
FLOPs per token = gpt.flops_per_token(config, T): 6N for the weight matmuls
forward+backward plus 12*L*H*T for attention, the causal half not subtracted
(the PaLM / nanoGPT convention). The same count is used for nanoGPT.

    python bench/bench_model.py
    python bench/bench_model.py --models 124M --micro-batch-size 16 32 --variants triton torch
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VARIANTS = {
    "triton": ["--attention-impl", "triton", "--layernorm-impl", "triton"],
    "torch": ["--attention-impl", "torch", "--layernorm-impl", "torch"],
    "torch-compile": ["--attention-impl", "torch", "--layernorm-impl", "torch", "--compile"],
    "triton-compile": ["--attention-impl", "triton", "--layernorm-impl", "triton", "--compile"],
    "torch-graphs": ["--attention-impl", "torch", "--layernorm-impl", "torch", "--compile",
                     "--compile-mode", "reduce-overhead"],
    "triton-graphs": ["--attention-impl", "triton", "--layernorm-impl", "triton", "--compile",
                      "--compile-mode", "reduce-overhead"],
    "nanogpt-compile": None,  # not train.py: see run_nanogpt
}
NANOGPT = os.path.join(ROOT, "bench", "ref", "nanogpt", "model.py")


def write_random_corpus(prefix: str, tokens: int, seed: int = 0) -> None:
    """A Megatron .bin/.idx of uniformly random GPT-2 token ids in 1024-token
    documents: enough for the timed steps, and its content does not matter."""
    import numpy as np
    import data
    rng = np.random.default_rng(seed)
    builder = data.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(tokens // 1024):
        builder.add_document(rng.integers(0, 50256, size=1023).tolist() + [50256])
    builder.finalize(prefix + ".idx")


def run_train(args, preset: str, variant: str, micro_batch: int, corpus: str, workdir: str) -> dict:
    metrics = os.path.join(workdir, f"{preset}-{variant}-{micro_batch}.jsonl")
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--preset", preset,
           "--data-path", corpus, "--split", "1,0,0", "--seq-length", str(args.seq_length),
           "--micro-batch-size", str(micro_batch), "--train-iters", str(args.iters),
           "--log-interval", str(args.log_interval), "--eval-interval", "0", "--sample-tokens", "0",
           "--lr", "6e-4", "--lr-warmup-iters", "10", "--metrics-file", metrics, *VARIANTS[variant]]
    # --smoke: fp32 on CPU, and head dim 32, which the Triton kernels have (tiny's is 16)
    cmd += ["--num-attention-heads", "2"] if args.smoke else ["--bf16"]
    if args.peak_tflops:
        cmd += ["--peak-flops", str(args.peak_tflops * 1e12)]
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    wall = time.time() - start
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return {"error": " / ".join(tail)[-400:] or f"exit {proc.returncode}", "wall": wall}
    rows = [json.loads(line) for line in open(metrics)]
    steady = rows[1:] or rows  # the first interval holds warm-up
    first = re.search(r"first step \(iteration \d+\) took ([\d.]+) s", proc.stdout)
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    return {"tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in steady),
            "mfu": statistics.median(mfus) if mfus else None,
            "first_step": float(first.group(1)) if first else None, "wall": wall}


def run_nanogpt_subprocess(args, preset: str, micro_batch: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--nanogpt-worker", preset,
           "--micro-batch-size", str(micro_batch), "--seq-length", str(args.seq_length),
           "--iters", str(args.iters)]
    if args.peak_tflops:
        cmd += ["--peak-tflops", str(args.peak_tflops)]
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    wall = time.time() - start
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return {"error": " / ".join(tail)[-400:], "wall": wall}
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "wall": wall}


def nanogpt_worker(args) -> None:
    """Time nanoGPT's own model and optimizer at our preset's shape; prints
    one JSON line with the same figures run_train reports."""
    import importlib.util
    import torch
    from gpt import GPTConfig, flops_per_token
    from train_ops import peak_flops_by_name
    if not os.path.exists(NANOGPT):
        sys.exit(f"{NANOGPT} is missing; see this script's docstring")
    spec = importlib.util.spec_from_file_location("nanogpt_model", NANOGPT)
    nano = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nano)
    ours = GPTConfig.from_preset(args.nanogpt_worker)
    torch.backends.cuda.matmul.allow_tf32 = True  # as nanoGPT's train.py
    torch.backends.cudnn.allow_tf32 = True
    model = nano.GPT(nano.GPTConfig(block_size=args.seq_length, vocab_size=ours.padded_vocab_size,
                                    n_layer=ours.num_layers, n_head=ours.num_attention_heads,
                                    n_embd=ours.hidden_size, dropout=0.0, bias=True)).cuda()
    opt = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cuda")
    model = torch.compile(model)
    B, T = args.micro_batch_size, args.seq_length
    x = torch.randint(0, 50257, (B, T), device="cuda")
    y = torch.randint(0, 50257, (B, T), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.time()
    step()
    torch.cuda.synchronize()
    first = time.time() - t0
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.time()
    for _ in range(args.iters):
        step()
    torch.cuda.synchronize()
    tok_s = B * T * args.iters / (time.time() - t0)
    name = torch.cuda.get_device_name()
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops_by_name(name)
    flops = flops_per_token(ours, T) * tok_s
    print(json.dumps({"tokens_per_sec": tok_s, "mfu": flops / peak if peak else None,
                      "first_step": first}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["124M", "350M"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--micro-batch-size", type=int, nargs="+", default=[16])
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--iters", type=int, default=40, help="training iterations per run")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--corpus", default=None, help="data prefix (default: random tokens in --workdir)")
    p.add_argument("--workdir", default=None, help="metrics files and the corpus (default: a temp dir)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per run")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak dense bf16 TFLOP/s")
    p.add_argument("--nanogpt-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true",
                   help="CPU, fp32, the tiny preset, 2 iterations (the second timed), triton (interpreted: "
                        "TRITON_INTERPRET=1) and torch variants: checks that the script runs")
    args = p.parse_args()
    if args.nanogpt_worker:
        args.micro_batch_size = args.micro_batch_size[0]
        return nanogpt_worker(args)

    import torch
    if args.smoke:
        args.models, args.micro_batch_size, args.seq_length = ["tiny"], [2], 32
        args.iters, args.log_interval = 2, 1
        args.variants = [v for v in args.variants if v in ("triton", "torch")]
    elif not torch.cuda.is_available():
        sys.exit("bench_model.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_model_")
    os.makedirs(workdir, exist_ok=True)
    corpus = args.corpus or os.path.join(workdir, "random_text_document")
    if not os.path.exists(corpus + ".idx"):
        needed = max(args.micro_batch_size) * (args.seq_length + 1) * (args.iters + 10)
        write_random_corpus(corpus, max(needed, 2 ** 16 if args.smoke else 2 ** 22))
    where = "CPU, fp32 (--smoke)" if args.smoke else f"{torch.cuda.get_device_name()}, bf16 autocast"
    print(f"## Training step through train.py on {where}, seq {args.seq_length}, fused AdamW, "
          f"{args.iters} iterations (median of log intervals 2+)\n")
    print("| model | variant | micro-batch | tokens/s | MFU | first step s | run s |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for preset in args.models:
        for variant in args.variants:
            for mb in args.micro_batch_size:
                if variant == "nanogpt-compile":
                    r = run_nanogpt_subprocess(args, preset, mb)
                else:
                    r = run_train(args, preset, variant, mb, corpus, workdir)
                if "error" in r:
                    print(f"| {preset} | {variant} | {mb} | failed: {r['error']} | | | "
                          f"{r['wall']:.0f} |", flush=True)
                    continue
                mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
                first = "?" if r["first_step"] is None else f"{r['first_step']:.1f}"
                print(f"| {preset} | {variant} | {mb} | {r['tokens_per_sec']:,.0f} | {mfu} | "
                      f"{first} | {r['wall']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
