"""Mixture of experts on CPU: the step's tokens/s, the memory per EP rank, and
where the all-to-all sits in the step (issue 71's "Measured").

1. tokens/s of a training step (forward, backward, AdamW) in one process:
   E=8, top-2 experts of width F against the dense model of the same active
   parameters (its MLP 2F wide), the experts as a loop and as grouped_mm
   (--moe-grouped-gemm). One clock, the variants interleaved (A B C A B C ...),
   the median of the timed steps after warm-up; the load average beside it.
2. Memory of rank 0 at EP = 1, 2, 4 (4 gloo processes, EP folded out of DP 4),
   after one step: numel x element size of the expert weights it holds, their
   grads and AdamW states, and of everything else; read from the live model
   and optimizer.
3. The order of operations of one MoE layer's forward and backward at EP = 2
   (alltoall dispatcher), recorded by a TorchDispatchMode on rank 0: the
   GEMMs and the collectives (a2a: an all-to-all posted; land: its wait).
4. Why grouped_mm is not the default: the same rows placed 0-7 floats further
   on in memory, each grouped_mm bit for bit the aligned one's or not (a
   resumed run's tensors lie elsewhere: it would leave the curve's last bits).

    OMP_NUM_THREADS=2 python bench/bench_moe.py           # minutes on 2 idle cores
    python bench/bench_moe.py --smoke                     # tiny sizes, seconds
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import expert_parallel  # noqa: E402
import gpt  # noqa: E402
import parallel  # noqa: E402
from train import build_optimizer  # noqa: E402

ADAMW = types.SimpleNamespace(lr=1e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)
SIZES = {  # Mixtral's shape (Llama options, SwiGLU experts), scaled to a CPU; vocab small so the MLPs weigh
    "full": dict(preset="cpu", F=512, B=4, T=256, warmup=1, steps=5, mem_B=1, mem_T=64),
    "smoke": dict(preset="tiny", F=32, B=2, T=16, warmup=1, steps=2, mem_B=1, mem_T=16),
}


def model_config(size: dict, **moe) -> gpt.GPTConfig:
    """The size's model with 8 experts of width F, top-2 (moe), or dense 2F wide (no moe)."""
    common = dict(gpt.LLAMA_OPTIONS, vocab_size=2000, padded_vocab_size=2048, hidden_dropout=0.0,
                  attention_dropout=0.0, max_position_embeddings=max(size["T"], 64))
    if not moe:
        return gpt.GPTConfig.from_preset(size["preset"], ffn_hidden_size=2 * size["F"], **common)
    return gpt.GPTConfig.from_preset(size["preset"], num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=size["F"],
                                     moe_aux_loss_coeff=1e-2, **common, **moe)


def step_fn(config, B: int, T: int, seed: int = 0):
    """A GPT of config, its AdamW, and one training step on random ids -> step()."""
    torch.manual_seed(seed)
    model = gpt.GPT(config)
    opt = build_optimizer(model, ADAMW)
    x, y = (torch.randint(0, 2000, (B, T), generator=torch.Generator().manual_seed(seed + i)) for i in (1, 2))

    def step():  # (the grads stay after it, as they are held until the next step's zero_grad)
        opt.zero_grad(set_to_none=True)
        model(x, labels=y).backward()
        expert_parallel.reduce_expert_grads(model)
        opt.step()
    return model, opt, step


def tokens_per_sec(size: dict) -> list:
    parallel.initialize(1)
    variants = {"dense (MLP 2F)": model_config(size), "MoE, loop": model_config(size, moe_grouped_gemm=False),
                "MoE, grouped_mm": model_config(size, moe_grouped_gemm=True)}
    steps = {name: step_fn(cfg, size["B"], size["T"])[2] for name, cfg in variants.items()}
    times = {name: [] for name in variants}
    for i in range(size["warmup"] + size["steps"]):
        for name, step in steps.items():  # interleaved: the machine's load falls on every variant alike
            t0 = time.perf_counter()
            step()
            if i >= size["warmup"]:
                times[name].append(time.perf_counter() - t0)
    rows = []
    for name, cfg in variants.items():
        s = statistics.median(times[name])
        rows.append([name, f"{gpt.count_parameters(cfg):,}", f"{gpt.count_parameters(cfg, active=True):,}",
                     f"{1e3 * s:.0f}", f"{size['B'] * size['T'] / s:,.0f}", f"{min(times[name]) * 1e3:.0f}"])
    return rows


def memory_of(model, opt) -> dict:
    """Bytes this rank holds: (weights, grads, AdamW states) of the experts and of the rest."""
    out = dict.fromkeys(("expert weights", "expert grads", "expert AdamW", "other weights", "other grads",
                         "other AdamW"), 0)
    for p in model.parameters():
        kind = "expert" if getattr(p, "expert_parallel", False) else "other"
        out[f"{kind} weights"] += p.numel() * p.element_size()
        out[f"{kind} grads"] += 0 if p.grad is None else p.grad.numel() * p.grad.element_size()
        out[f"{kind} AdamW"] += sum(t.numel() * t.element_size() for t in opt.state[p].values() if torch.is_tensor(t))
    return out


class OpOrder(TorchDispatchMode):
    """Records the GEMMs and the collectives dispatched, as short labels."""

    def __init__(self, E: int, N: int):
        super().__init__()
        self.E, self.N, self.events = E, N, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm"):
            # the router's: to the (N, E) logits, or from their grads (N, E) or (E, N); no expert has these shapes
            shapes = {tuple(args[-2].shape), tuple(args[-1].shape)}
            router = out.shape[-1] == self.E or bool(shapes & {(self.N, self.E), (self.E, self.N)})
            self.events.append("router" if router else "gemm")
        elif name == "_grouped_mm":
            self.events.append("grouped_mm")
        elif name == "all_to_all_single":
            self.events.append("a2a(counts)" if args[0].dtype == torch.int64 else "a2a(rows)")
        elif name == "wait_tensor":
            self.events.append("land")
        return out


def compress(events: list) -> str:
    """Runs of one label as 'label xN'."""
    runs = []
    for e in events:
        if runs and runs[-1][0] == e:
            runs[-1][1] += 1
        else:
            runs.append([e, 1])
    return "  ".join(e if n == 1 else f"{e} x{n}" for e, n in runs)


def op_order(grouped: bool) -> tuple:
    """One MoE layer (64 wide, 8 experts of 48, 32 tokens a rank) at this EP: (forward, backward)."""
    rank = dist.get_rank()
    config = gpt.GPTConfig.from_preset("tiny", num_experts=8, moe_ffn_hidden_size=48, moe_token_dispatcher_type="alltoall",
                                       moe_grouped_gemm=grouped, **gpt.LLAMA_OPTIONS)
    torch.manual_seed(0)
    layer = gpt.MoE(config)
    gpt.init_weights(layer, config)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    with OpOrder(8, 32) as fwd:
        y = layer(x)
    with OpOrder(8, 32) as bwd:
        y.sum().backward()
    return compress(fwd.events), compress(bwd.events)


def rank_main(rank: int, world: int, init: str, out: str, size: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    found = {"memory": {}, "order": {}}
    for ep in (1, 2, 4):
        parallel.destroy()
        parallel.initialize(expert_model_parallel_size=ep)
        model, opt, step = step_fn(model_config(size, moe_token_dispatcher_type="alltoall"), size["mem_B"], size["mem_T"], seed=rank)
        step()
        found["memory"][ep] = memory_of(model, opt)
        if ep == 2:
            for grouped in (False, True):
                found["order"]["grouped_mm" if grouped else "loop"] = op_order(grouped)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(found, f)
    dist.barrier()
    parallel.destroy()
    dist.destroy_process_group()


def on_four_ranks(size: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "found.json")
        mp.start_processes(rank_main, args=(4, f"file://{tmp}/init", out, size), nprocs=4, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def alignment_rounding() -> list:
    """grouped_mm of the same (100, 64) rows, the rows' first float at 4-byte
    shifts 0..7 from an aligned address -> a row per shift: bit for bit the
    shift-0 output or not, and the largest difference."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(100, 64, generator=g), torch.randn(4, 32, 64, generator=g)
    offsets = torch.tensor([10, 40, 40, 100], dtype=torch.int32)
    rows = []
    for shift in range(8):
        shifted = torch.empty(x.numel() + shift)[shift:].view_as(x).copy_(x)
        out = torch.nn.functional.grouped_mm(shifted, w.transpose(1, 2), offs=offsets)
        base = out if shift == 0 else base
        rows.append([shift, "yes" if torch.equal(out, base) else "no", f"{(out - base).abs().max().item():.2e}"])
    return rows


def table(header: list, rows: list) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    print(flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 2 timed steps: checks that the script runs")
    size = SIZES["smoke" if p.parse_args().smoke else "full"]
    cfg = model_config(size, moe_grouped_gemm=False)
    load = os.getloadavg()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, fp32; "
          f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
    print(f"## 1. Training step, preset {size['preset']} with Llama's options ({cfg.num_layers} layers, "
          f"{cfg.hidden_size} wide), vocab 2,048, E=8 top-2 of F={size['F']} (aux loss 1e-2) against a dense "
          f"MLP of 2F, {size['B']} x {size['T']} tokens; median of {size['steps']} steps after {size['warmup']}, "
          f"interleaved\n")
    table(["model", "parameters", "active", "step ms", "tokens/s", "fastest step ms"], tokens_per_sec(size))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    found = on_four_ranks(size)
    mem = found["memory"]
    print("## 2. Memory of rank 0 at EP = 1, 2, 4 (4 gloo ranks, EP folded out of DP 4), after one step, MiB\n")
    keys = list(mem["1"])
    rows = [[f"EP={ep}", *(f"{mem[ep][k] / 2**20:.3f}" for k in keys), f"{sum(mem[ep].values()) / 2**20:.3f}",
             f"{mem[ep]['expert weights'] / mem['1']['expert weights']:.3f}",
             f"{mem[ep]['expert AdamW'] / mem['1']['expert AdamW']:.3f}"] for ep in ("1", "2", "4")]
    table(["EP", *keys, "all", "experts / EP=1's", "expert AdamW / EP=1's"], rows)
    print("## 3. One MoE layer at EP = 2 (alltoall), rank 0's order of operations\n")
    for variant, (fwd, bwd) in found["order"].items():
        print(f"    {variant}, forward:  {fwd}\n    {variant}, backward: {bwd}\n")
    print("## 4. grouped_mm of the same rows shifted in memory (fp32, 4 experts, 100 x 64)\n")
    table(["shift (floats)", "bit for bit shift 0's", "largest difference"], alignment_rounding())


if __name__ == "__main__":
    main()
