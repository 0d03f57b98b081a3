"""Sampling speed with and without the KV cache (gpt.generate, greedy).

    python bench/bench_generate.py                         # preset cpu, 16-token prompt, 200 new tokens
    python bench/bench_generate.py --preset 124M --new-tokens 500 --device cuda

Without the cache every new token re-runs the whole prefix (cost grows with
the length); with it the prompt runs once and each token runs alone against
the cached keys and values. Both decode greedily from the same random
weights, and the script checks they produce the same tokens.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()

    import parallel
    from gpt import GPT, GPTConfig
    from gpt import generate
    parallel.initialize(1)
    torch.manual_seed(0)
    config = GPTConfig.from_preset(args.preset)
    model = GPT(config).to(args.device).eval()
    prompt = torch.randint(0, config.vocab_size, (args.batch, args.prompt_tokens), device=args.device)
    out, secs = {}, {}
    for use_cache in (False, True):
        generate(model, prompt, 2, temperature=0, use_cache=use_cache)  # warm-up
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out[use_cache] = generate(model, prompt, args.new_tokens, temperature=0, use_cache=use_cache)
        if args.device == "cuda":
            torch.cuda.synchronize()
        secs[use_cache] = time.perf_counter() - t0
    same = torch.equal(out[False], out[True])
    print(f"preset {args.preset}, batch {args.batch}, prompt {args.prompt_tokens} + {args.new_tokens} new "
          f"tokens (max positions {config.max_position_embeddings}), {args.device}, torch {torch.__version__}")
    print("| generate | seconds | new tokens/s |\n|---|---|---|")
    for use_cache, name in ((False, "re-run the prefix"), (True, "KV cache")):
        print(f"| {name} | {secs[use_cache]:.2f} | {args.batch * args.new_tokens / secs[use_cache]:.1f} |")
    print(f"speed-up {secs[False] / secs[True]:.1f}x; same tokens: {same}")
    if not same:
        sys.exit("the cached and uncached greedy tokens differ")


if __name__ == "__main__":
    main()
