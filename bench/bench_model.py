"""Whole-model training throughput on one GPU: tokens/s and MFU.

Runs full training steps (forward, backward, fused AdamW update) of GPT-2
124M and 350M at seq 1024 under bf16 autocast, once with the PyTorch
attention/LayerNorm and once with the Triton kernels from kernels.py, on
random tokens (data loading is not what is measured). `triton-unfused` is the
Triton path with each block's residual add done by torch instead of fused
into the next LayerNorm (kernels.add_layer_norm): the pair shows what the
fusion buys in a real step.

MFU (model FLOPs utilization) = achieved model FLOP/s / the GPU's peak dense
bf16 FLOP/s, where model FLOPs per token = gpt.flops_per_token(config, T)
(6N for the weight matmuls forward+backward, plus 12*L*H*T for attention
scores, without subtracting the causal half: the PaLM / nanoGPT convention). Recomputation is not counted as useful work.

    python bench/bench_model.py
    python bench/bench_model.py --models 124M --micro-batch-size 16 --impls triton
    python bench/bench_model.py --peak-tflops 989   # when the GPU name is unknown
    python bench/bench_model.py --impls triton triton-unfused   # the residual-add fusion alone
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

# Peak dense bf16 tensor-core FLOP/s, matched against torch.cuda.get_device_name().
PEAK_BF16_FLOPS = [("H100", 989e12), ("H200", 989e12), ("A100", 312e12)]


def peak_flops(device_name: str, override_tflops: float | None) -> float | None:
    if override_tflops is not None:
        return override_tflops * 1e12
    for key, flops in PEAK_BF16_FLOPS:
        if key in device_name:
            return flops
    return None


def build_model(preset: str, impl: str, seq_length: int):
    """GPT with both attention and LayerNorm set to `impl`, or None (with a
    printed reason) when gpt.py does not offer that implementation."""
    from gpt import GPT, GPTConfig
    kernel_impl = "triton" if impl == "triton-unfused" else impl
    try:
        config = GPTConfig.from_preset(preset, attention_impl=kernel_impl, layernorm_impl=kernel_impl,
                                       max_position_embeddings=max(1024, seq_length))
    except ValueError as e:
        print(f"skipping {preset}/{impl}: {e}", file=sys.stderr)
        return None, None
    model = GPT(config).cuda()
    if impl == "triton-unfused":
        # gpt.add_and_norm then adds with torch and runs the LayerNorm alone
        for m in model.modules():
            if getattr(m, "fuses_residual_add", False):
                m.fuses_residual_add = False
    return model, config


def time_training(model, args) -> float:
    """Seconds per training step (median over args.steps after warmup)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    B, T, V = args.micro_batch_size, args.seq_length, model.config.vocab_size
    tokens = torch.randint(0, V, (B, T + 1), device="cuda")
    input_ids, labels = tokens[:, :-1], tokens[:, 1:]

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids, labels=labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):  # includes Triton autotuning and compilation
        step()
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["124M", "350M"])
    p.add_argument("--impls", nargs="+", default=["torch", "triton", "triton-unfused"],
                   choices=["torch", "triton", "triton-unfused"])
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--peak-tflops", type=float, default=None, help="peak dense bf16 TFLOP/s")
    args = p.parse_args()

    if not torch.cuda.is_available():
        sys.exit("bench_model.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    from gpt import flops_per_token
    name = torch.cuda.get_device_name()
    peak = peak_flops(name, args.peak_tflops)
    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"## Training step on {name}, seq {args.seq_length}, micro-batch "
          f"{args.micro_batch_size}, bf16 autocast, fused AdamW\n")
    print("| model | attention/LN impl | step ms | tokens/s | TFLOP/s | MFU |")
    print("|---|---|---|---|---|---|", flush=True)
    for preset in args.models:
        for impl in args.impls:
            model, config = build_model(preset, impl, args.seq_length)
            if model is None:
                continue
            seconds = time_training(model, args)
            tok_s = args.micro_batch_size * args.seq_length / seconds
            flops = tok_s * flops_per_token(config, args.seq_length)
            mfu = "n/a" if peak is None else f"{100 * flops / peak:.1f}%"
            print(f"| {preset} | {impl} | {1e3 * seconds:.1f} | {tok_s:,.0f} | "
                  f"{flops / 1e12:.1f} | {mfu} |", flush=True)
            del model
            torch.cuda.empty_cache()
    if peak is None:
        print("\nMFU n/a: unknown GPU; pass --peak-tflops", file=sys.stderr)


if __name__ == "__main__":
    main()
