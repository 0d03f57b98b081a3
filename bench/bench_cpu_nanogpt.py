"""Training speed on CPU against nanoGPT at the same shape: wall time of
iterations 11-60 and the peak resident memory, the two run interleaved.

One clock for both: this script stamps each program's log lines as they
arrive (both run unbuffered, logging every iteration) and times the span
from the iteration-10 line to the iteration-60 line. Neither program's own
timer is trusted: nanoGPT's per-iteration `time` and train.py's tokens/s
measure different spans of an iteration.

    git clone https://github.com/karpathy/nanoGPT bench/ref/nanoGPT   # git-ignored
    python prepare.py                                                  # the default corpus
    python bench/bench_cpu_nanogpt.py --rounds 2 [--batch 8]

Shape: 4 layers, 256 wide, 4 heads, block 256, fp32, no dropout, 2 threads
(nanoGPT's `--device=cpu --compile=False --dtype=float32`), both on the
tokens of data/shakespeare_text_document.bin (nanoGPT reads the same uint16
stream as its train.bin). train.py runs its defaults, then without linear
biases (nanoGPT has none), then also with --loss-impl full.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {"train.py": [], "--disable-bias-linear": ["--disable-bias-linear"],
            "--disable-bias-linear --loss-impl full": ["--disable-bias-linear", "--loss-impl", "full"]}


def timed(cmd, cwd, iteration) -> tuple[float, int]:
    """(seconds from the iteration-10 line to the iteration-60 line, on this
    script's clock; peak RSS in bytes) of one run, with 2 threads.
    iteration(line): the iteration a log line reports, or None."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(["/usr/bin/time", "-f", "peak-rss-kb %M", *cmd], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = {}
    for line in proc.stdout:
        i = iteration(line)
        if i is not None:
            seen[i] = time.monotonic()
    err = proc.stderr.read()
    if proc.wait() != 0:
        raise RuntimeError(f"{' '.join(cmd[:2])} failed:\n{err[-3000:]}")
    return seen[60] - seen[10], int(re.search(r"peak-rss-kb (\d+)", err).group(1)) * 1024


def nanogpt(args, work) -> tuple[float, int]:
    line = re.compile(r"iter (\d+): loss")
    return timed([sys.executable, "train.py", "--dataset=bench", "--device=cpu", "--compile=False",
                  "--dtype=float32", "--n_layer=4", "--n_head=4", "--n_embd=256", "--block_size=256",
                  f"--batch_size={args.batch}", "--gradient_accumulation_steps=1", "--dropout=0.0",
                  "--max_iters=60", "--lr_decay_iters=60", "--eval_interval=100000", "--eval_iters=1",
                  "--log_interval=1", "--always_save_checkpoint=False", f"--out_dir={work}"], args.nanogpt,
                 lambda text: int(m.group(1)) if (m := line.match(text)) else None)


def ours(args, flags) -> tuple[float, int]:
    line = re.compile(r"iter +(\d+) \|")
    return timed([sys.executable, "train.py", "--preset", "cpu", "--data-path", args.data,
                  "--seq-length", "256", "--micro-batch-size", str(args.batch), "--global-batch-size",
                  str(args.batch), "--train-iters", "60", "--eval-interval", "0", "--log-interval", "1",
                  "--sample-tokens", "0", *flags], ROOT,
                 lambda text: int(m.group(1)) if (m := line.match(text)) else None)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nanogpt", default=os.path.join(ROOT, "bench", "ref", "nanoGPT"))
    p.add_argument("--data", default=os.path.join(ROOT, "data", "shakespeare_text_document"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   help="which train.py runs to time against nanoGPT in each round (default: all)")
    args = p.parse_args()
    data_dir = os.path.join(args.nanogpt, "data", "bench")
    os.makedirs(data_dir, exist_ok=True)
    for split in ("train", "val"):  # nanoGPT reads data/bench/{train,val}.bin
        link = os.path.join(data_dir, f"{split}.bin")
        if not os.path.exists(link):
            os.symlink(os.path.abspath(args.data + ".bin"), link)
    print("| round | run | iterations 11-60 (s) | vs nanoGPT | peak RSS (GB) |\n|---|---|---|---|---|")
    for r in range(1, args.rounds + 1):
        with tempfile.TemporaryDirectory() as work:
            base, rss = nanogpt(args, work)
            print(f"| {r} | nanoGPT | {base:.1f} | 1.00x | {rss / 1e9:.2f} |", flush=True)
            for name, flags in ((n, VARIANTS[n]) for n in args.variants):
                seconds, rss = ours(args, flags)
                print(f"| {r} | {name} | {seconds:.1f} | {seconds / base:.2f}x | {rss / 1e9:.2f} |",
                      flush=True)


if __name__ == "__main__":
    main()
