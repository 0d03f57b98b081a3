"""Per-rank memory of model states and step time for ZeRO stages 0-3.

    torchrun --nproc_per_node 2 bench/bench_zero.py                  # CPU (gloo), tiny model
    torchrun --nproc_per_node 8 bench/bench_zero.py --preset 124M    # GPUs
    ... --json OUT.json                                              # figures for tests/CI

Builds the same GPT and our AdamW under train.py's DeepSpeed path for each
stage, runs a few steps, and counts the bytes each rank holds in the engine's
own tensors (after a step, fp32 training):

    params      module weights: full for stages 0-2, this rank's partition for 3
    master      DeepSpeed's fp32 copy of the partition the optimizer updates
                (stages 1-3; stage 0 updates the module weights in place)
    optimizer   AdamW's exp_avg + exp_avg_sq
    grads       gradient storage at the accumulation boundary: p.grad for
                stage 0, the optimizer's reduced partitions for stages 1-3
                (stage 1 differs from 2 only between micro-batches, where it
                keeps full gradients; this bench uses one micro-batch)

ZeRO paper (Psi params, D data-parallel ranks; fp32 weights and grads 4 Psi
bytes each, Adam moments 8 Psi): stage 1 divides the optimizer states by D,
stage 2 also the gradients, stage 3 also the parameters.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402
import parallel  # noqa: E402
import train  # noqa: E402
import train_ops  # noqa: E402
import zero  # noqa: E402


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def grad_bytes(engine, stage: int) -> int:
    """Bytes of gradient storage right after the accumulation boundary's backward."""
    opt = engine.optimizer
    if stage == 0:
        return nbytes(p.grad for p in engine.module.parameters() if p.grad is not None)
    if stage in (1, 2):  # reduced gradient partitions, per param group (a list or one flat tensor)
        groups = opt.averaged_gradients.values()
        return nbytes(t for g in groups for t in (g if isinstance(g, list) else [g]))
    return nbytes([opt.grad_partitions_flat_buffer])  # stage 3: one flat buffer of partitions


def model_state_bytes(engine, stage: int) -> dict:
    module_params = list(engine.module.parameters())
    if stage == 3:
        params = nbytes(p.ds_tensor for p in module_params)
    else:
        params = nbytes(module_params)
    opt = engine.optimizer
    if stage == 0:
        master, torch_opt = 0, opt
    elif stage in (1, 2):
        master, torch_opt = nbytes(opt.single_partition_of_fp32_groups), opt.optimizer
    else:
        master, torch_opt = nbytes(opt.fp32_partitioned_groups_flat), opt.optimizer
    moments = nbytes(v for state in torch_opt.state.values() for k, v in state.items()
                     if k in ("exp_avg", "exp_avg_sq"))
    return {"params": params, "master": master, "optimizer": moments}


def bench_stage(stage: int, args, env) -> dict:
    cfg = config.parse_args(["--preset", args.preset, "--seq-length", str(args.seq_length),
                            "--micro-batch-size", str(args.micro_batch_size), "--deepspeed",
                            "--zero-stage", str(stage), "--sample-tokens", "0", "--lr", "1e-4"])
    engine = zero.DeepSpeedTraining(cfg, env, 1, lambda message: None, train.build_model, train.build_optimizer,
                                    train.clip_grad_norm_).engine
    V = engine.module.config.vocab_size
    tokens = torch.randint(0, V, (args.micro_batch_size, args.seq_length + 1), device=env.device)
    times, grads = [], 0
    for i in range(args.steps):
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.time()
        loss = engine(tokens[:, :-1], labels=tokens[:, 1:])
        engine.backward(loss)
        grads = grad_bytes(engine, stage)
        engine.step()
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.time() - t0)
    result = {"stage": stage, **model_state_bytes(engine, stage), "grads": grads,
              "num_params": sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()),
              "dp_size": parallel.layout.dp_size,
              "step_ms": 1000 * sorted(times[1:] or times)[len(times[1:] or times) // 2]}
    if env.device.type == "cuda":
        result["max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20
        torch.cuda.reset_peak_memory_stats()
    engine.destroy()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--json", default=None, help="write the figures here (rank 0)")
    args = p.parse_args()
    cfg = config.parse_args(["--preset", args.preset, "--deepspeed"])
    env = train_ops.init_processes(cfg)
    results = [bench_stage(int(s), args, env) for s in args.stages.split(",")]
    if env.rank == 0:
        psi = results[0]["num_params"]
        print(f"Psi = {psi:,} parameters, D = {results[0]['dp_size']}, device {env.device}")
        print(f"{'stage':>5} {'params MB':>10} {'master MB':>10} {'grads MB':>9} {'adam MB':>8} "
              f"{'total MB':>9} {'bytes/Psi':>9} {'step ms':>8}")
        for r in results:
            total = r["params"] + r["master"] + r["grads"] + r["optimizer"]
            mb = lambda b: f"{b / 2 ** 20:.2f}"
            print(f"{r['stage']:>5} {mb(r['params']):>10} {mb(r['master']):>10} {mb(r['grads']):>9} "
                  f"{mb(r['optimizer']):>8} {mb(total):>9} {total / psi:>9.2f} {r['step_ms']:>8.1f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
