"""Kill a worker, let torchrun restart the job, and check it resumes exactly: N times.

    python bench/soak_restart.py                      # 10 tries, plain DDP (torch_dist saves), 2 CPU ranks
    python bench/soak_restart.py --engine zero2       # the same under DeepSpeed ZeRO-2
    python bench/soak_restart.py --engine async       # DDP, --async-save (torch_dist: the default)
    python bench/soak_restart.py --engine torch       # DDP, --ckpt-format torch (one file)
    python bench/soak_restart.py --engine tp2         # also zero1, zero3, pp2 (ENGINES)
    python bench/soak_restart.py --tries 3 --iters 20 # a quick look

Each try launches, as a cluster user would,

    torchrun --standalone --nproc_per_node 2 --max-restarts 2 train.py ... \\
        --save D --load D --save-interval S

and SIGKILLs rank 1 (a dead node: no handler runs) once rank 0 has logged a
randomly chosen iteration, at any point of the save cycle. torchrun sees the
dead worker, stops the other, and starts both again; they meet in a new
store, one for each attempt (launch.elastic_store), and resume from the latest complete
checkpoint. A try counts as finished when torchrun exits 0 and every
iteration's final loss equals an uninterrupted run's bit for bit. Per try:

    kill -> resumed   seconds from the SIGKILL to the first iteration logged
                      after the restarted job loaded its checkpoint
    iterations lost   the last iteration logged before the kill minus the
                      checkpoint's iteration (work done again)

CPU only, tiny model: the figures measure the restart machinery (detection,
process start, rendezvous, checkpoint load), not a model's load time.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

from bench_save import make_corpus, worker_pids

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITER_LINE = re.compile(r"^iter\s+(\d+) \|")
LOADED_LINE = re.compile(r"loaded checkpoint .*\(iteration (\d+)")
ENGINES = {  # --engine: train.py's flags on the 2 ranks
    "ddp": [], **{f"zero{stage}": ["--deepspeed", "--zero-stage", str(stage)] for stage in (1, 2, 3)},
    "tp2": ["--tensor-model-parallel-size", "2"], "pp2": ["--pipeline-model-parallel-size", "2"],
    "async": ["--async-save"], "torch": ["--ckpt-format", "torch"]}


def train_command(args, corpus: str, workdir: str, restarts: int) -> list[str]:
    engine = ENGINES[args.engine]
    return [sys.executable, "-u", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            f"--max-restarts={restarts}", os.path.join(HERE, "train.py"),
            "--preset", "tiny", "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "8",
            "--train-iters", str(args.iters), "--eval-interval", "0", "--log-interval", "1",
            "--sample-tokens", "0", "--seed", "7", "--data-path", corpus, *engine,
            "--metrics-file", os.path.join(workdir, "metrics.jsonl")]


def final_losses(path: str) -> dict[int, float]:
    """Each iteration's last logged loss (a restarted job logs some iterations twice)."""
    with open(path) as f:
        return {m["iteration"]: m["loss"] for m in map(json.loads, f)}


class Lines:
    """A process's stdout, line by line, each with the time it arrived."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc):
        for line in proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def last_iteration(self) -> int:
        found = [int(m.group(1)) for _, l in self.lines if (m := ITER_LINE.match(l))]
        return found[-1] if found else 0


def kill_rank(launcher_pid: int, rank: int) -> bool:
    for pid in worker_pids(launcher_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"RANK") == str(rank).encode():
            os.kill(pid, signal.SIGKILL)
            return True
    return False


def one_try(args, corpus: str, workdir: str, kill_at: int, reference: dict) -> dict:
    ckpt = os.path.join(workdir, "ckpt")
    cmd = [*train_command(args, corpus, workdir, restarts=2),
           "--save", ckpt, "--load", ckpt, "--save-interval", str(args.save_interval)]
    proc = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = Lines(proc)
    deadline = time.monotonic() + args.timeout
    while out.last_iteration() < kill_at and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    last_before_kill = out.last_iteration()
    killed_at = time.monotonic()
    killed = proc.poll() is None and kill_rank(proc.pid, 1)
    seen_before_kill = len(out.lines)
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "hung"
    out.thread.join(timeout=5)
    result = {"kill_at": last_before_kill, "killed": killed, "rc": rc, "resumed_from": None,
              "kill_to_resumed_s": None, "lost": None}
    after = out.lines[seen_before_kill:]
    loaded = [(i, int(m.group(1))) for i, (_, l) in enumerate(after) if (m := LOADED_LINE.search(l))]
    if loaded:
        i, resumed_from = loaded[-1]
        first_iter = next((t for t, l in after[i:] if ITER_LINE.match(l)), None)
        result.update(resumed_from=resumed_from, lost=last_before_kill - resumed_from,
                      kill_to_resumed_s=None if first_iter is None else first_iter - killed_at)
    result["exact"] = rc == 0 and final_losses(os.path.join(workdir, "metrics.jsonl")) == reference
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tries", type=int, default=10)
    p.add_argument("--engine", choices=list(ENGINES), default="ddp")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--save-interval", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a try may take before it counts as hung")
    p.add_argument("--seed", type=int, default=0, help="chooses the kill iterations")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="soak_restart_")
    corpus = os.path.join(root, "corpus_text_document")
    make_corpus(corpus)
    base = os.path.join(root, "uninterrupted")
    os.makedirs(base)
    subprocess.run(train_command(args, corpus, base, restarts=0), cwd=HERE, check=True,
                   capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    reference = final_losses(os.path.join(base, "metrics.jsonl"))
    rng = random.Random(args.seed)
    print("| try | killed after iteration | resumed from | iterations lost | kill -> resumed (s) | exit | losses equal |")
    print("|---|---|---|---|---|---|---|")
    results = []
    for n in range(args.tries):
        workdir = os.path.join(root, f"try{n}")
        os.makedirs(workdir)
        r = one_try(args, corpus, workdir, rng.randint(args.save_interval + 1, args.iters - 2), reference)
        results.append(r)
        secs = "-" if r["kill_to_resumed_s"] is None else f"{r['kill_to_resumed_s']:.1f}"
        print(f"| {n + 1} | {r['kill_at']} | {r['resumed_from']} | {r['lost']} | {secs} | {r['rc']} "
              f"| {'yes' if r['exact'] else 'NO'} |", flush=True)
    done = [r for r in results if r["exact"] and r["killed"]]
    times = sorted(r["kill_to_resumed_s"] for r in done if r["kill_to_resumed_s"] is not None)
    lost = [r["lost"] for r in done]
    print(f"\n{args.engine}: {len(done)} of {args.tries} killed tries finished with every loss equal to the "
          f"uninterrupted run's")
    if times:
        print(f"kill -> resumed: median {times[len(times) // 2]:.1f} s, range {times[0]:.1f}-{times[-1]:.1f} s; "
              f"iterations lost: mean {sum(lost) / len(lost):.1f}, max {max(lost)} "
              f"(save interval {args.save_interval})")


if __name__ == "__main__":
    main()
