"""Peak host memory of a checkpoint save, per rank, measured from outside.

    python bench/bench_save.py                          # 350M, tp=2, CPU
    python bench/bench_save.py --repo OTHER_CHECKOUT    # the same for another commit
    python bench/bench_save.py --ckpt-format torch_dist --pp 2    # every rank its shards, tp=2 x pp=2

Runs `torchrun --nproc_per_node 2 train.py --preset 350M
--tensor-model-parallel-size 2 --train-iters 1 --save DIR` (any train.py with
those flags: pass --repo to measure an older checkout) and polls every rank's
resident memory (/proc/PID/status, every 10 ms). Memory is read against the
moment train.py prints its first log line after the step: the save starts
right after it, so

    before save   the rank's resident memory at that line (model, AdamW, grads)
    save peak     the highest resident memory after it, until the rank exits
    added         save peak - before save: what the save itself costs
    save s        from that line to train.py's "saved checkpoint" line

CPU only (it reads host memory). On a GPU the same gather happened on the
device in the old code; the figures here show where the full states live.
"""
from __future__ import annotations

import argparse
import os
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


def measure(repo: str, preset: str, tp: int, workdir: str, pp: int = 1, fmt: str | None = None) -> dict:
    corpus = os.path.join(workdir, "corpus_text_document")
    make_corpus(corpus)
    cmd = [sys.executable, "-u", "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={tp * pp}", os.path.join(repo, "train.py"),
           "--preset", preset, "--tensor-model-parallel-size", str(tp),
           *(["--pipeline-model-parallel-size", str(pp)] if pp > 1 else []),
           *(["--ckpt-format", fmt] if fmt else []),
           "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", str(pp),  # >= a micro-batch a stage
           "--train-iters", "1", "--eval-interval", "0", "--log-interval", "1",
           "--sample-tokens", "0", "--data-path", corpus, "--split", "100,0,0",
           "--data-cache-path", os.path.join(workdir, "cache"),
           "--save", os.path.join(workdir, "ckpt")]
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
    save_starts, saved, lines = None, None, []
    for line in proc.stdout:
        lines.append(line)
        if save_starts is None and line.lstrip().startswith("iter") and "loss" in line:
            save_starts = time.time()  # the step's log line; the save comes next
        if saved is None and line.startswith("saved checkpoint"):
            saved = time.time()
    proc.wait()
    done.set()
    sampler.join()
    if proc.returncode != 0 or save_starts is None:
        raise SystemExit("train.py failed or printed no step line:\n" + "".join(lines[-40:]))
    per_rank = {}
    for rank, pid in enumerate(sorted({pid for _, pid, _ in samples})):
        mine = [(t, m) for t, p, m in samples if p == pid]
        before = [m for t, m in mine if t <= save_starts]
        after = [m for t, m in mine if t > save_starts]
        per_rank[rank] = {"before_save_mib": before[-1], "save_peak_mib": max(after),
                          "added_mib": max(after) - before[-1], "save_s": saved - save_starts}
    return per_rank


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default=HERE, help="checkout whose train.py runs (default: this one)")
    ap.add_argument("--preset", default="350M")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ckpt-format", help="train.py's --ckpt-format (default: its default)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        result = measure(os.path.abspath(args.repo), args.preset, args.tp, workdir, args.pp, args.ckpt_format)
    print(f"{args.preset}, tp={args.tp}, pp={args.pp}, --ckpt-format {args.ckpt_format or 'default'}, {args.repo}")
    print(f"{'rank':>4} {'before save MiB':>16} {'save peak MiB':>14} {'added MiB':>10} {'save s':>7}")
    for rank, r in result.items():
        print(f"{rank:>4} {r['before_save_mib']:>16.0f} {r['save_peak_mib']:>14.0f} {r['added_mib']:>10.0f} "
              f"{r['save_s']:>7.1f}")


if __name__ == "__main__":
    main()
