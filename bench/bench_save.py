"""Peak host memory of a checkpoint save, per rank, measured from outside.

    python bench/bench_save.py                          # 350M, tp=2, CPU, the default format (torch_dist)
    python bench/bench_save.py --repo OTHER_CHECKOUT    # the same for another commit
    python bench/bench_save.py --ckpt-format torch --pp 2    # one file, gathered on rank 0, tp=2 x pp=2
    python bench/bench_save.py --async-save    # torch_dist, synchronous then --async-save, 2 saves each

Runs `torchrun --nproc_per_node 2 train.py --preset 350M
--tensor-model-parallel-size 2 --train-iters 1 --save DIR` (any train.py with
those flags: pass --repo to measure an older checkout) and polls every rank's
resident memory (/proc/PID/status, every 10 ms). Memory is read against the
moment train.py prints its first log line after the step: the save starts
right after it, so

    before save   the rank's resident memory at that line (model, AdamW, grads)
    save peak     the highest resident memory after it, until the rank exits
    added         save peak - before save: what the save itself costs
    save s        from that line to train.py's "saved checkpoint" line (published)
    blocked s     from that line until the loop goes on: the same as save s, or
                  with --async-save to its "staged checkpoint" line; at a later
                  save from the later of the step's line and the previous
                  checkpoint's "saved" line (the end of the wait for its write)

--async-save saves twice, at --save-interval and twice that: train.py makes
the host copy in the background after the first step, and both saves copy
into it (at --save-interval 1 the first save waits for that copy to finish).

--load-tp/--load-pp then resume the checkpoint at that layout (one more
iteration, no save) and report, per rank, the time from train.py's
"loading --load" line to its "loaded checkpoint" line (verifying the digests,
reading, resharding) and the host memory that adds.

CPU only (it reads host memory). On a GPU the same gather happened on the
device in the old code; the figures here show where the full states live.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_corpus(prefix: str) -> None:
    """A few hundred random documents in the Megatron format (enough for one step)."""
    sys.path.insert(0, HERE)
    import data as data_lib
    rng = np.random.default_rng(0)
    builder = data_lib.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(200):
        builder.add_document(list(rng.integers(0, 50000, size=200)) + [50256])
    builder.finalize(prefix + ".idx")


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def worker_pids(launcher_pid: int) -> list[int]:
    """torchrun's worker processes: the children of its agent (the launcher)."""
    try:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(launcher_pid)],
                             capture_output=True, text=True).stdout
    except OSError:
        return []
    return sorted(int(p) for p in out.split())


def train_command(repo: str, preset: str, tp: int, pp: int, workdir: str, iters: int, *flags) -> list[str]:
    corpus = os.path.join(workdir, "corpus_text_document")
    if not os.path.exists(corpus + ".idx"):
        make_corpus(corpus)
    return [sys.executable, "-u", "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={tp * pp}", os.path.join(repo, "train.py"),
            "--preset", preset, "--tensor-model-parallel-size", str(tp),
            *(["--pipeline-model-parallel-size", str(pp)] if pp > 1 else []),
            "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", str(pp),  # >= a micro-batch a stage
            "--train-iters", str(iters), "--eval-interval", "0", "--log-interval", "1",
            "--sample-tokens", "0", "--data-path", corpus, "--split", "100,0,0",
            "--data-cache-path", os.path.join(workdir, "cache"), *flags]


def run_sampled(cmd: list[str], repo: str) -> tuple[object, list, list]:
    """Run cmd; (process, [(time, line)] as they arrived, [(time, pid, MiB)] of its workers)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    samples: list[tuple[float, int, float]] = []  # (time, pid, MiB)
    done = threading.Event()

    def poll():
        while not done.is_set():
            now = time.time()
            for pid in worker_pids(proc.pid):
                mib = rss_mib(pid)
                if mib is not None:
                    samples.append((now, pid, mib))
            time.sleep(0.01)

    sampler = threading.Thread(target=poll, daemon=True)
    sampler.start()
    lines = [(time.time(), line) for line in proc.stdout]  # each with the time it arrived
    proc.wait()
    done.set()
    sampler.join()
    return proc, lines, samples


def added_memory(samples: list, start: float, end: float = float("inf")) -> dict:
    """{rank: resident MiB at `start`, the peak from then to `end`, and the difference}."""
    per_rank = {}
    for rank, pid in enumerate(sorted({pid for _, pid, _ in samples})):
        mine = [(t, m) for t, p, m in samples if p == pid]
        before = [m for t, m in mine if t <= start]
        after = [m for t, m in mine if start < t <= end]
        per_rank[rank] = {"before_save_mib": before[-1], "save_peak_mib": max(after),
                          "added_mib": max(after) - before[-1]}
    return per_rank


def measure(repo: str, preset: str, tp: int, workdir: str, pp: int = 1, fmt: str | None = None,
            flags: tuple = (), saves: int = 1, interval: int = 1) -> tuple[dict, list]:
    shutil.rmtree(os.path.join(workdir, "ckpt"), ignore_errors=True)
    cmd = train_command(repo, preset, tp, pp, workdir, saves * interval, *(["--ckpt-format", fmt] if fmt else []),
                        "--save-interval", str(interval), "--save", os.path.join(workdir, "ckpt"), *flags)
    proc, lines, samples = run_sampled(cmd, repo)

    def when(pattern: str) -> float | None:
        return next((t for t, line in lines if re.match(pattern, line)), None)

    at = [k * interval for k in range(1, saves + 1)]  # the saved iterations
    steps = [when(rf"\s*iter\s+{k} \|") for k in at]  # each one's step line; its save comes next
    saved = [when(rf"saved checkpoint .*iter_{k:07d}$") for k in at]
    if proc.returncode != 0 or None in steps or None in saved:
        raise SystemExit("train.py failed or printed no step line:\n" + "".join(l for _, l in lines[-40:]))
    timings = []
    for k in range(1, saves + 1):
        starts = max(steps[k - 1], saved[k - 2] if k > 1 else 0)  # once the previous write is waited for
        timings.append({"blocked_s": (when(rf"staged checkpoint {at[k - 1]} ") or saved[k - 1]) - starts,
                        "save_s": saved[k - 1] - steps[k - 1]})
    return added_memory(samples, steps[0]), timings


def measure_load(repo: str, preset: str, tp: int, pp: int, workdir: str, saves: int) -> tuple[float, dict]:
    """Resume workdir/ckpt at tp x pp: (seconds from "loading --load" to
    "loaded checkpoint", {rank: memory added between those lines})."""
    cmd = train_command(repo, preset, tp, pp, workdir, saves + 1, "--load", os.path.join(workdir, "ckpt"))
    proc, lines, samples = run_sampled(cmd, repo)
    start = next((t for t, line in lines if line.startswith("loading --load")), None)
    end = next((t for t, line in lines if line.startswith("loaded checkpoint")), None)
    if proc.returncode != 0 or start is None or end is None:
        raise SystemExit("the resume failed or printed no load lines:\n" + "".join(l for _, l in lines[-40:]))
    return end - start, added_memory(samples, start, end)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default=HERE, help="checkout whose train.py runs (default: this one)")
    ap.add_argument("--preset", default="350M")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ckpt-format", help="train.py's --ckpt-format (default: its default)")
    ap.add_argument("--async-save", action="store_true",
                    help="torch_dist twice, synchronous then --async-save, and the loop's blocked time of each")
    ap.add_argument("--save-interval", type=int, default=1, help="train.py's; the first save is at this iteration")
    ap.add_argument("--load-tp", type=int, help="then resume the (last) checkpoint at this TP size ...")
    ap.add_argument("--load-pp", type=int, default=1, help="... and this PP size, and time its load")
    args = ap.parse_args()
    runs = {"torch_dist": ("torch_dist", ()), "torch_dist --async-save": ("torch_dist", ("--async-save",))} \
        if args.async_save else {args.ckpt_format or "default": (args.ckpt_format, ())}
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for name, (fmt, flags) in runs.items():
            results[name] = measure(os.path.abspath(args.repo), args.preset, args.tp, workdir, args.pp, fmt, flags,
                                    saves=2 if args.async_save else 1, interval=args.save_interval)
        if args.load_tp:  # the last format's checkpoint, read at another layout
            load_s, load_mem = measure_load(os.path.abspath(args.repo), args.preset, args.load_tp, args.load_pp,
                                            workdir, saves=(2 if args.async_save else 1) * args.save_interval)
    print(f"{args.preset}, tp={args.tp}, pp={args.pp}, {args.repo}")
    print(f"{'--ckpt-format':>24} {'rank':>4} {'before save MiB':>16} {'save peak MiB':>14} {'added MiB':>10}")
    for name, (per_rank, _) in results.items():
        for rank, r in per_rank.items():
            print(f"{name:>24} {rank:>4} {r['before_save_mib']:>16.0f} {r['save_peak_mib']:>14.0f} "
                  f"{r['added_mib']:>10.0f}")
    print(f"\n{'--ckpt-format':>24} {'save':>4} {'blocked s':>9} {'save s':>7}")
    for name, (_, timings) in results.items():
        for k, t in enumerate(timings, 1):
            print(f"{name:>24} {k:>4} {t['blocked_s']:>9.1f} {t['save_s']:>7.1f}")
    if args.load_tp:
        print(f"\nloaded at tp={args.load_tp}, pp={args.load_pp} in {load_s:.1f} s (\"loading --load\" to "
              f"\"loaded checkpoint\"); added MiB per rank: "
              + ", ".join(f"{r['added_mib']:.0f}" for r in load_mem.values()))
    if args.async_save:
        sync, background = (results[name][1] for name in runs)
        print("the loop blocked with --async-save / without: " + ", ".join(
            f"save {k}: {b['blocked_s'] / s['blocked_s']:.0%}" for k, (s, b) in enumerate(zip(sync, background), 1)))


if __name__ == "__main__":
    main()
