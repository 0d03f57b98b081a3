"""How close does prepare.py get to raw tokenizer speed?

    python bench/bench_prepare.py --workers 2 --mb 25

Tokenizes the same documents (the default Shakespeare scenes, repeated to
about --mb megabytes) three ways on the same number of cores:

  threads   enc.encode_ordinary_batch(docs, num_threads=workers)  (tiktoken only)
  processes multiprocessing.Pool(workers), each encoding chunks, returning counts only
  prepare   prepare.write_dataset: tokenize + append EOD + write .bin/.idx

The faster of the two tiktoken-only variants is the baseline; the ratio
prepare / baseline is the pipeline's efficiency (target >= 80%). Each variant
runs --repeats times, interleaved, and its best time counts, because a shared
machine's noise only ever makes a run slower. CPU seconds (this process's
threads plus any child processes) are reported too: on a machine shared with
other jobs, tokens per CPU-second compares the variants' *work* even when
wall-clock time mostly measures the neighbours.
"""
import argparse
import os
import resource
import sys
import tempfile
import time
from multiprocessing import Pool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import prepare  # noqa: E402


def corpus(megabytes: float) -> list[str]:
    scenes = list(prepare.iter_shakespeare_documents())
    size = sum(len(s) for s in scenes)
    repeats = max(1, round(megabytes * 1e6 / size))
    return scenes * repeats


def _count_chunk(docs: list[str]) -> int:
    enc = prepare.load_tokenizer()  # built once in each process, then cached
    return sum(len(enc.encode_ordinary(d)) for d in docs)


def run_threads(docs, enc, workers, out_prefix) -> int:
    return sum(len(t) for t in enc.encode_ordinary_batch(docs, num_threads=workers))


def run_processes(docs, enc, workers, out_prefix) -> int:
    chunks = [docs[i:i + 64] for i in range(0, len(docs), 64)]
    pool = Pool(workers)
    count = sum(pool.imap(_count_chunk, chunks))
    pool.close()
    pool.join()  # reaped children: their CPU time shows up in RUSAGE_CHILDREN
    return count


def run_prepare(docs, enc, workers, out_prefix) -> int:
    stats = prepare.write_dataset(iter(docs), out_prefix, enc, workers=workers, log_interval=0)
    return stats.tokens - stats.documents  # content tokens only (not EOD), like the baselines


def cpu_seconds() -> float:
    """CPU time of this process (all threads) plus its finished children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--mb", type=float, default=25.0, help="corpus size in MB of text")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    docs = corpus(args.mb)
    enc = prepare.load_tokenizer()
    print(f"{len(docs):,} documents, {sum(map(len, docs)) / 1e6:.1f} MB of text, workers={args.workers}")
    variants = {"threads": run_threads, "processes": run_processes, "prepare": run_prepare}
    wall = {name: float("inf") for name in variants}
    cpu = dict(wall)
    tokens = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for name, fn in variants.items():
                w0, c0 = time.perf_counter(), cpu_seconds()
                tokens[name] = fn(docs, enc, args.workers, os.path.join(tmp, "bench"))
                wall[name] = min(wall[name], time.perf_counter() - w0)
                cpu[name] = min(cpu[name], cpu_seconds() - c0)
    if len(set(tokens.values())) != 1:
        raise RuntimeError(f"variants disagree on the token count: {tokens}")
    rate = {name: tokens[name] / wall[name] for name in variants}
    cpu_rate = {name: tokens[name] / cpu[name] for name in variants}
    for name in variants:
        print(f"{name:>10}: {rate[name] / 1e6:6.3f} M tokens/s wall ({wall[name]:.2f}s), "
              f"{cpu_rate[name] / 1e6:6.3f} M tokens per CPU-second ({cpu[name]:.2f} CPU s)")
    baseline = max("threads", "processes", key=rate.get)
    print(f"wall clock: prepare / raw tiktoken ({baseline}) = {rate['prepare'] / rate[baseline]:.1%}")
    cpu_baseline = max("threads", "processes", key=cpu_rate.get)
    print(f"CPU time:   prepare / raw tiktoken ({cpu_baseline}) = {cpu_rate['prepare'] / cpu_rate[cpu_baseline]:.1%}")


if __name__ == "__main__":
    main()
