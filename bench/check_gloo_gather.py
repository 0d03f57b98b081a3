"""Two tensor-parallel collectives in flight at once on gloo, as sequence
parallelism and Domino launch them: does the process survive?

PyTorch's gloo backend runs a group's collectives on two worker threads,
and both assign a string of the group's status (the op's name) without a
lock. The functional all-gather (torch.ops._c10d_functional.all_gather_into_tensor)
runs as gloo's ALLGATHER_COALESCED, the only name among this project's
collectives too long for std::string's inline buffer, so two collectives at
once can free the buffer the other thread is writing into.
AddressSanitizer names it (LD_PRELOAD=libasan.so.8: a heap-use-after-free in
c10d::ProcessGroupGloo::runLoop); without it a rank dies of SIGSEGV or
glibc's "malloc(): unaligned tcache chunk detected", sometimes much later.
parallel.launch_all_gather therefore gathers CPU tensors as a sum
(_launch_all_gather_as_sum).

Each round launches an all-gather and an all-reduce of the TP group of 2
CPU ranks, then waits for both, and checks the results:

    python bench/check_gloo_gather.py             # parallel.launch_all_gather (the sum on gloo)
    python bench/check_gloo_gather.py --raw       # the functional all-gather itself
    python bench/check_gloo_gather.py --rounds 20000 --runs 5

It prints one line per run and exits non-zero if a rank died or failed.
"""
import argparse
import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rank_main(rank: int, rdzv: str, rounds: int, raw: bool) -> None:
    import parallel
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    parallel.initialize(2, timeout=datetime.timedelta(seconds=60))
    name = parallel.layout.tp_group.group_name
    x, y = torch.full((4, 6, 32), float(rank)), torch.ones(4, 6, 32)   # (B, T/tp, C)
    for _ in range(rounds):
        gather = (torch.ops._c10d_functional.all_gather_into_tensor(x, 2, name) if raw
                  else parallel.launch_all_gather(x))
        total = parallel.launch_all_reduce(y)
        gathered, total = parallel.wait(gather), parallel.wait(total)
        assert gathered[:4].eq(0).all() and gathered[4:].eq(1).all() and total.eq(2).all()
    parallel.destroy()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--raw", action="store_true", help="the functional all-gather, not parallel's")
    p.add_argument("--rounds", type=int, default=20000)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    died = 0
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            start = time.time()
            try:
                mp.start_processes(rank_main, args=(os.path.join(tmp, "rdzv"), args.rounds, args.raw),
                                   nprocs=2, start_method="spawn")
                result = "ok"
            except ProcessExitedException as e:   # a rank killed by a signal
                died, result = died + 1, f"DIED: {e}"
            except ProcessRaisedException as e:   # a wrong result, or a rank failing once its peer died
                died, result = died + 1, f"FAILED: {str(e).strip().splitlines()[-1]}"
        form = "functional all-gather" if args.raw else "parallel.launch_all_gather"
        print(f"run {run + 1}: {args.rounds} rounds of {form} beside an all-reduce: {result} "
              f"({time.time() - start:.0f} s)", flush=True)
    return 1 if died else 0


if __name__ == "__main__":
    sys.exit(main())
