"""Pipeline x data parallelism: how much of the data-parallel gradient
all-reduce the step waits for, with it after the schedule and with it started
as they become final (pipeline.GradientAverager).

One training step without the optimizer: pipeline.pipeline_step (the 1F1B or
interleaved schedule, which ends with the all-reduce of the loss over the
pipeline group) then pipeline.reduce_pipeline_grads (the data-parallel
average, the tied embedding's sum). Two ways, alternated step by step:

    after      averager=None: one blocking all-reduce of every gradient once
               the schedule is over (the path before GradientAverager)
    overlapped a bucket's all-reduce launched as soon as its gradients are
               final, during the last micro-batch's backward (and what
               is left as each backward ends); reduce_pipeline_grads waits

Per rank, medians over the timed steps: the step (schedule + reduction) and
the exposed reduction (the time spent in reduce_pipeline_grads). The last
stage ends its backwards first and then waits in the loss's all-reduce for
stage 0 to drain: an all-reduce started before that wait runs during it.

    CPU (gloo):  OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 bench/bench_grad_average.py
                 (PP=2 x DP=2; 4 ranks on fewer cores share them)
"""
import argparse
import os
import statistics
import sys
import time
from contextlib import nullcontext
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import launch  # noqa: E402
import parallel  # noqa: E402
import pipeline  # noqa: E402
from gpt import GPTConfig  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pipeline-model-parallel-size", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--padded-vocab-size", type=int, default=50304, help="GPT-2's: the embedding dominates the all-reduce")
    p.add_argument("--virtual-stages", type=int, default=1)
    p.add_argument("--iters", type=int, default=6, help="timed steps of each way")
    p.add_argument("--warmup", type=int, default=2)
    return p.parse_args()


def main():
    args = parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. torchrun --nproc_per_node 4 bench/bench_grad_average.py")
    d = launch.init_distributed()
    pp = args.pipeline_model_parallel_size
    parallel.initialize(1, d.timeout, pp)
    config = GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads, max_position_embeddings=args.seq_length,
                       vocab_size=args.padded_vocab_size, padded_vocab_size=args.padded_vocab_size)
    torch.manual_seed(0)
    per_chunk = args.num_layers // (pp * args.virtual_stages)
    chunks = pipeline.pipeline_chunks(args.num_layers, pp, parallel.layout.pp_rank, per_chunk)
    stage = pipeline.stage_model(config, chunks).to(d.device)
    cfg = SimpleNamespace(seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                          enable_zero_bubble=False)
    g = torch.Generator().manual_seed(parallel.layout.dp_rank)
    shape = (args.micro_batch_size, args.seq_length)
    batches = [{"tokens": torch.randint(0, args.padded_vocab_size, shape, generator=g),
                "labels": torch.randint(0, args.padded_vocab_size, shape, generator=g),
                "loss_mask": torch.ones(shape), "position_ids": torch.arange(args.seq_length).expand(shape)}
               for _ in range(args.micro_batches)]
    times = {"after": [], "overlapped": []}
    overlapping = pipeline.GradientAverager(stage, parallel.layout.dp_group)  # its hooks idle until begin()
    for i in range(2 * (args.warmup + args.iters)):
        way = "after" if i % 2 == 0 else "overlapped"
        averager = overlapping if way == "overlapped" else None
        if averager:
            averager.begin(args.micro_batches)
        stage.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        pipeline.pipeline_step(pipeline.Stage(stage), batches, cfg, d.device, nullcontext(), averager=averager)
        schedule_end = time.perf_counter()
        pipeline.reduce_pipeline_grads(stage, averager)
        end = time.perf_counter()
        if i >= 2 * args.warmup:
            times[way].append((end - start, end - schedule_end))
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (parallel.layout.pp_rank, parallel.layout.dp_rank, times))
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in stage.parameters())
        print(f"PP={pp} x DP={parallel.layout.dp_size}, v={args.virtual_stages}, m={args.micro_batches}, "
              f"{args.num_layers} layers x {args.hidden_size}, vocab {args.padded_vocab_size}; "
              f"stage 0 all-reduces {params:,} gradients; medians of {args.iters} steps each, ms\n")
        print("| stage | DP rank | step, after | exposed, after | step, overlapped | exposed, overlapped |")
        print("|---|---|---|---|---|---|")
        for pp_rank, dp_rank, t in sorted(rows):
            cells = [f"{1e3 * statistics.median(x[k] for x in t[way]):.1f}"
                     for way in ("after", "overlapped") for k in (0, 1)]
            print(f"| {pp_rank} | {dp_rank} | " + " | ".join(cells) + " |")
    parallel.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
