"""CPU step time of the Llama-shaped preset against GPT-2 of the same size.

    python bench/llama_vs_gpt2.py [--presets 124M llama-124M] [--steps 10]

Both models are built in this one process and trained step by step in
alternation (forward, backward, AdamW on the same random batch), so that
whatever else the machine runs slows both alike; the median step time of
each is reported. Loss comparisons come from train.py runs (bench/RESULTS.md).
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpt import GPT, GPTConfig, count_parameters  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["124M", "llama-124M"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=256)
    args = p.parse_args()
    torch.manual_seed(0)
    models = {name: GPT(GPTConfig.from_preset(name)) for name in args.presets}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for name, m in models.items()}
    times = {name: [] for name in models}
    for step in range(args.steps + 1):  # step 0 warms up
        x = torch.randint(0, 50257, (args.micro_batch_size, args.seq_length + 1))
        for name, model in models.items():
            start = time.perf_counter()
            model(x[:, :-1], labels=x[:, 1:]).backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            if step:
                times[name].append(time.perf_counter() - start)
    tokens = args.micro_batch_size * args.seq_length
    print("| preset | parameters | median step (s) | tokens/s | steps |")
    print("| --- | --- | --- | --- | --- |")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {count_parameters(models[name].config) / 1e6:.1f}M | {med:.2f} | "
              f"{tokens / med:.0f} | {len(ts)} |")


if __name__ == "__main__":
    main()
