"""Time the GPT sample-index build (doc_idx + sample_idx + shuffle_idx) on a big corpus.

Writes a synthetic Megatron .bin/.idx pair of --tokens uint16 tokens (default 1e9,
~2 GB) split into documents of random length (mean --mean-doc tokens). The index
build only reads document lengths, so the .bin is a sparse file made with
truncate(): it takes no disk space and no time to write.

    python bench/bench_index.py                      # 1e9 tokens, seq 1024 and 2048
    python bench/bench_index.py --tokens 1e8 --dir /tmp/x
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import (GPTDataset, IndexedDataset, build_blending_indices, build_gpt_indices,  # noqa: E402
                  write_index_file)


def make_corpus(prefix: str, num_tokens: int, mean_doc: int, seed: int = 0) -> None:
    """Random document lengths summing to exactly num_tokens; sparse .bin of the right size."""
    rng = np.random.default_rng(seed)
    num_docs = max(1, num_tokens // mean_doc)
    sizes = rng.integers(1, 2 * mean_doc, num_docs).astype(np.int64)
    sizes = np.maximum(1, sizes * num_tokens // sizes.sum())   # rescale to the target total
    sizes[-1] += num_tokens - sizes.sum()                       # fix the rounding remainder
    if sizes[-1] < 1:
        raise ValueError("--tokens too small for --mean-doc")
    write_index_file(prefix + ".idx", sizes, np.arange(num_docs + 1), np.uint16)
    with open(prefix + ".bin", "wb") as f:
        f.truncate(num_tokens * 2)


def timed(label: str, fn):
    t0 = time.perf_counter()
    out = fn()
    print(f"{label:<58s} {time.perf_counter() - t0:7.2f} s", flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=float, default=1e9, help="corpus size in tokens")
    p.add_argument("--mean-doc", type=int, default=1000, help="mean document length in tokens")
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--blend-samples", type=int, default=1_000_000, help="0 skips the blending timing")
    p.add_argument("--dir", default=None, help="where to put the corpus (default: a temp dir, deleted after)")
    args = p.parse_args()
    tmp = None if args.dir else tempfile.TemporaryDirectory()
    root = args.dir or tmp.name
    os.makedirs(root, exist_ok=True)
    prefix = os.path.join(root, "synthetic_text_document")
    num_tokens = int(args.tokens)

    timed(f"write synthetic corpus ({num_tokens:.2e} tokens, sparse .bin)",
          lambda: make_corpus(prefix, num_tokens, args.mean_doc))
    ds = timed("open + validate IndexedDataset", lambda: IndexedDataset(prefix))
    print(f"  {len(ds):,} documents, {ds.num_tokens:,} tokens")
    documents = np.arange(len(ds))
    for S in args.seq_lengths:
        one_epoch = (ds.num_tokens - 1) // S
        timed(f"build_gpt_indices S={S}, {one_epoch:,} samples (1 epoch)",
              lambda: build_gpt_indices(ds.sizes, documents, S, one_epoch, seed=1234))
        cache = os.path.join(root, "cache")
        timed(f"GPTDataset S={S} cold (build + save cache)",
              lambda: GPTDataset(ds, documents, one_epoch, S, 1234, cache))
        timed(f"GPTDataset S={S} warm (load cache)",
              lambda: GPTDataset(ds, documents, one_epoch, S, 1234, cache))
    if args.blend_samples:
        timed(f"build_blending_indices 3 datasets, {args.blend_samples:,} samples",
              lambda: build_blending_indices([0.2, 0.3, 0.5], args.blend_samples))
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
