"""The experts' GEMMs on a GPU: one MoE layer's experts, forward and backward,
as a loop over the experts and as torch's grouped_mm (--moe-grouped-gemm;
CUTLASS's grouped GEMM on an H100), bf16, at the shapes of open MoE models
(issue 71's "When a GPU is lent"). bench/run_gpu.sh runs it as its `moe` stage.

For each shape: N tokens routed top-k over E experts by random router logits
(near even loads, as a trained router's balancing aims at), the rows permuted
by expert (expert_parallel.permute), then expert_parallel.local_experts with
and without grouped, the two interleaved on one clock (time.perf_counter
after a device synchronize), the median of the timed repeats after warm-up.
Also the largest difference of the two outputs, against the output's scale.

    python bench/bench_moe_gemm.py            # on a GPU: a minute or two
    python bench/bench_moe_gemm.py --smoke    # on CPU, tiny shapes: checks the script runs
"""
import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import expert_parallel  # noqa: E402
import gpt  # noqa: E402
import parallel  # noqa: E402

# name: (hidden H, expert width F, experts E, top-k, tokens N); SwiGLU experts, no biases
SHAPES = {
    "full": {"Mixtral 8x7B": (4096, 14336, 8, 2, 4096),
             "DeepSeekMoE 16B (64 experts)": (2048, 1408, 64, 6, 4096)},
    "smoke": {"tiny, 8 experts": (64, 32, 8, 2, 64), "tiny, 16 experts": (64, 16, 16, 4, 64)},
}


def experts_and_rows(H: int, F: int, E: int, k: int, N: int, device, dtype):
    """gpt.Experts of E SwiGLU experts (bf16 on the device) and N random tokens'
    rows sorted by expert -> (experts, rows (N k, H), rows per expert (E,))."""
    config = gpt.GPTConfig(hidden_size=H, num_attention_heads=1, num_layers=1, num_experts=E, moe_router_topk=k,
                           moe_ffn_hidden_size=F, swiglu=True, disable_bias_linear=True)
    torch.manual_seed(0)
    experts = gpt.Experts(config)
    experts.init_weights(0.02, 0.02)
    experts.to(device=device, dtype=dtype)
    x = torch.randn(N, H, device=device, dtype=dtype)
    logits = torch.randn(N, E, device=device)
    probs, routing_map = gpt.topk_routing(logits, config)
    rows, _, _, counts = expert_parallel.permute(x, probs, routing_map)
    return experts, rows.detach().requires_grad_(), counts


def time_variants(H, F, E, k, N, device, dtype, warmup: int, repeats: int) -> dict:
    """Median seconds of a forward and backward of the loop and of grouped_mm,
    interleaved on one clock, and the largest output difference over the largest output."""
    experts, rows, counts = experts_and_rows(H, F, E, k, N, device, dtype)
    grad = torch.randn_like(rows)
    outputs, times = {}, {"loop": [], "grouped_mm": []}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    for i in range(warmup + repeats):
        for name in times:  # interleaved: clocks and load fall on both alike
            experts.zero_grad(set_to_none=True)
            rows.grad = None
            sync()
            t0 = time.perf_counter()
            out = expert_parallel.local_experts(experts, rows, counts, grouped=name == "grouped_mm")
            out.backward(grad)
            sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
            outputs[name] = out.detach().float()
    diff = (outputs["loop"] - outputs["grouped_mm"]).abs().max() / outputs["loop"].abs().max()
    return {**{name: statistics.median(t) for name, t in times.items()}, "diff": diff.item()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks that the script runs")
    smoke = p.parse_args().smoke
    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    parallel.initialize(1)
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, bf16, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print("| shape | H | F | E | top-k | tokens | loop ms | grouped_mm ms | loop / grouped | max diff / max |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, (H, F, E, k, N) in SHAPES["smoke" if smoke else "full"].items():
        t = time_variants(H, F, E, k, N, device, torch.bfloat16, warmup=1 if smoke else 3, repeats=2 if smoke else 10)
        print(f"| {name} | {H} | {F} | {E} | {k} | {N} | {1e3 * t['loop']:.2f} | {1e3 * t['grouped_mm']:.2f} | "
              f"{t['loop'] / t['grouped_mm']:.2f} | {t['diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
