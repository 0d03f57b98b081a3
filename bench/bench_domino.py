"""How much tensor-parallel communication does Domino hide?

Times one training micro-step (forward + backward, no optimizer: it is the
same in every variant) of a GPT under tensor parallelism, three ways:

    (a) plain TP     every all-reduce blocks the computation
    (b) Domino       micro-batch split into --domino-chunks; all-reduces overlap compute
    (c) no comm      plain TP with parallel.py's collectives on the TP group skipped
                     (without_tp_communication): the compute-only floor. Results are
                     wrong; only the time matters.

    hidden fraction = (a - b) / (a - c)    (1 = all communication hidden, 0 = none)

Also reported: Domino with communication skipped, i.e. the cost of computing
in smaller chunks (if it is slower than (c), chunking itself costs time).

The variants are timed round-robin (a, b, c, a, b, c, ...) so slow drifts on a
shared machine hit them equally; each reported time is the median over
iterations of the slowest rank's step.

    CPU (gloo):  torchrun --nproc_per_node 2 bench/bench_domino.py
    GPU (nccl):  torchrun --nproc_per_node 8 bench/bench_domino.py --num-layers 24 \\
                     --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --micro-batch-size 4
"""
import argparse
import contextlib
import os
import statistics
import sys
import time
from unittest import mock

# One hardware queue: kernels start in launch order, so an all-reduce launched
# before a GEMM really runs beside it (see parallel._SequenceParallelLinear).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import parallel  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--padded-vocab-size", type=int, default=50304,
                   help="smaller makes the (communication-free) LM head cheaper, "
                        "so the layers' all-reduces weigh more")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--tensor-model-parallel-size", type=int, default=None,
                   help="default: the whole world (WORLD_SIZE)")
    p.add_argument("--domino-chunks", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                   help="default: bf16 on GPU, fp32 on CPU")
    return p.parse_args()


def setup(args):
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. "
                         "torchrun --nproc_per_node 2 bench/bench_domino.py")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        # Ranks share the CPU: one compute thread each leaves room for gloo's.
        cores = len(os.sched_getaffinity(0))
        torch.set_num_threads(max(1, cores // int(os.environ["LOCAL_WORLD_SIZE"])))
        dist.init_process_group("gloo")
    parallel.initialize(args.tensor_model_parallel_size or dist.get_world_size())
    return device


def build(args, device, dtype, domino_chunks):
    torch.manual_seed(0)
    config = GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads,
                       max_position_embeddings=args.seq_length,
                       vocab_size=min(50257, args.padded_vocab_size),
                       padded_vocab_size=args.padded_vocab_size, domino_chunks=domino_chunks)
    return GPT(config).to(device=device, dtype=dtype)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


@contextlib.contextmanager
def without_tp_communication():
    """parallel.py's collectives on the tensor-parallel group return at once,
    leaving their outputs as they are (an all-reduce's is a copy of its input,
    an all-gather's and a reduce-scatter's are zeros): the same compute with
    no TP communication (the cross-entropy's small per-token all-reduces in
    parallel.py are skipped too). Patched from outside, so that parallel.py
    carries nothing for the benchmark; wait() on a tensor no collective
    launched returns it at once."""
    real = parallel.dist
    tp = parallel.layout.tp_size

    class NoTP:
        def __getattr__(self, name):
            return getattr(real, name)

        def all_reduce(self, *args, group=None, **kwargs):
            if group is not parallel.layout.tp_group:
                return real.all_reduce(*args, group=group, **kwargs)

    launches = {
        "launch_all_reduce": lambda x: x.clone(memory_format=torch.contiguous_format),
        "launch_all_gather": lambda x: x.new_zeros((tp * x.shape[0], *x.shape[1:])),
        "launch_reduce_scatter_sequence": lambda x: x.new_zeros((x.shape[0], x.shape[1] // tp, *x.shape[2:])),
    }
    with mock.patch.object(parallel, "dist", NoTP()), mock.patch.multiple(parallel, **launches):
        yield


def timed_step(model, batch, device, skip_comm: bool) -> float:
    """Seconds for one forward+backward, the slowest rank's."""
    x, y = batch
    sync(device)
    start = time.perf_counter()
    with without_tp_communication() if skip_comm else contextlib.nullcontext():
        model(x, labels=y).backward()
    sync(device)
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    if device.type == "cuda":
        elapsed = elapsed.to(device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    model.zero_grad(set_to_none=True)
    return elapsed.item()


def main():
    args = parse_args()
    device = setup(args)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    plain, domino = build(args, device, dtype, 1), build(args, device, dtype, args.domino_chunks)
    g = torch.Generator().manual_seed(1)  # same batch on every TP rank
    ids = torch.randint(0, min(50257, args.padded_vocab_size), (args.micro_batch_size, args.seq_length + 1), generator=g).to(device)
    batch = (ids[:, :-1], ids[:, 1:])
    variants = {"(a) plain TP": (plain, False), "(b) Domino": (domino, False),
                "(c) no comm": (plain, True), "Domino, no comm": (domino, True)}
    times = {name: [] for name in variants}
    for it in range(args.warmup + args.iters):
        for name, (model, skip) in variants.items():
            t = timed_step(model, batch, device, skip)
            if it >= args.warmup:
                times[name].append(t)
    if dist.get_rank() == 0:
        report(args, device, dtype, {k: statistics.median(v) for k, v in times.items()})
    parallel.destroy()
    dist.destroy_process_group()


def report(args, device, dtype, med):
    a, b, c = med["(a) plain TP"], med["(b) Domino"], med["(c) no comm"]
    print(f"GPT L={args.num_layers} H={args.hidden_size} heads={args.num_attention_heads} "
          f"seq={args.seq_length} vocab={args.padded_vocab_size} "
          f"micro-batch={args.micro_batch_size} | "
          f"TP={parallel.layout.tp_size} DP={parallel.layout.dp_size} | {device.type} {str(dtype)[6:]} | "
          f"domino chunks={args.domino_chunks} | median of {args.iters} fwd+bwd steps")
    for name, t in med.items():
        print(f"  {name:<18} {t * 1e3:9.1f} ms")
    comm = a - c
    print(f"  communication (a-c) {comm * 1e3:8.1f} ms; "
          f"saved by Domino (a-b) {(a - b) * 1e3:.1f} ms")
    if comm > 0:
        print(f"  hidden fraction (a-b)/(a-c) = {(a - b) / comm:.2f}")
    else:
        print("  hidden fraction undefined: no measurable communication time")


if __name__ == "__main__":
    main()
