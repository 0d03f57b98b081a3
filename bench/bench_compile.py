"""Kernels per transformer layer, eager vs torch.compile (Inductor), forward
and backward, on CPU or GPU.

Eager: the ATen ops that do work in one training micro-step, as they reach
the kernels (a TorchDispatchMode sees them below autograd, composite ops
decomposed: linear as addmm), not the ones that only make views or
allocate. Each is at least one kernel launch on a GPU. Compiled: the kernels Inductor's generated
code calls (its fused C++/Triton kernels, extern GEMMs and fallback ops).
Per layer = (count with 2 layers) - (count with 1 layer), so the embedding,
the head and the loss drop out.

    python bench/bench_compile.py                         # GPT-2 layer (124M width), fp32
    python bench/bench_compile.py --llama --bf16          # rope, RMSNorm, SwiGLU, GQA; bf16 autocast

First-step compile times come from train.py's own log line ("first step
(iteration 1) took ..."): see bench/results_compile.md.
"""
import argparse
import collections
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# ATen ops that launch no kernel: allocation and metadata (views are told by
# their schema, see eager_ops).
NO_KERNEL = {"_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
             "lift_fresh", "_local_scalar_dense", "set_", "resize_", "record_stream"}
# A call of a kernel in Inductor's generated code (CPU: cpp_fused_*; GPU: triton_*.run).
CALL = re.compile(r"^\s+(?:\w+ = )?(cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|"
                  r"torch\.ops\.\w+\.\w+|aten\.\w+)(?:\.default)?\(")


def build(layers: int, llama: bool, device):
    import parallel
    from gpt import GPT, GPTConfig, LLAMA_OPTIONS
    parallel.destroy()
    parallel.initialize(1)
    torch.manual_seed(0)
    options = dict(LLAMA_OPTIONS, num_query_groups=4) if llama else {}
    config = GPTConfig(num_layers=layers, hidden_size=768, num_attention_heads=12, vocab_size=512,
                       padded_vocab_size=512, **options)
    return GPT(config).to(device)


class _Ops(TorchDispatchMode):
    """Counts the ATen ops that reach the kernels (below autograd, so that
    composite ops arrive decomposed: linear as addmm), views excluded."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NO_KERNEL:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def eager_ops(model, ids, autocast) -> tuple[collections.Counter, collections.Counter]:
    """(forward, backward) ATen ops that do work, by name."""
    with _Ops() as forward:
        with autocast():
            loss = model(ids[:, :-1], labels=ids[:, 1:])
    with _Ops() as backward:
        loss.backward()
    return forward.counts, backward.counts


def compiled_kernels(model, ids, autocast) -> tuple[collections.Counter, collections.Counter]:
    """(forward, backward) kernels in Inductor's generated code, by name
    (the fused kernels' names say what they fuse; their numeric suffix dropped)."""
    from torch._inductor.utils import run_and_get_code
    compiled = torch.compile(model)

    def step():
        with autocast():
            loss = compiled(ids[:, :-1], labels=ids[:, 1:])
        loss.backward()
    torch._dynamo.reset()
    _, codes = run_and_get_code(step)
    assert len(codes) == 2, f"expected one forward and one backward graph, got {len(codes)}"
    return tuple(collections.Counter(re.sub(r"_\d+$", "", m.group(1))
                                     for line in code[code.index("def call("):].splitlines()
                                     if (m := CALL.match(line))) for code in codes)


def per_layer(count) -> tuple[collections.Counter, collections.Counter]:
    """(forward, backward) counts of a 2-layer model minus a 1-layer one's,
    by name (negative where a name is rarer with 2 layers: Inductor names a
    fused kernel after all it fuses, and the boundary of the stack changes)."""
    one, two = count(1), count(2)
    diffs = []
    for a, b in zip(one, two):
        b = collections.Counter(b)
        b.subtract(a)
        diffs.append(collections.Counter({k: v for k, v in b.items() if v}))
    return tuple(diffs)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama", action="store_true", help="Llama's layer: rope, RMSNorm, SwiGLU, GQA, no biases")
    p.add_argument("--bf16", action="store_true", help="under bf16 autocast")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--verbose", action="store_true", help="list the ops and kernels by name")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if args.bf16 else None
    autocast = lambda: torch.autocast(device, dtype, enabled=dtype is not None)  # noqa: E731
    ids = torch.randint(0, 512, (args.micro_batch_size, args.seq_length + 1), device=device)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench_compile_"))
    eager = per_layer(lambda layers: eager_ops(build(layers, args.llama, device), ids, autocast))
    compiled = per_layer(lambda layers: compiled_kernels(build(layers, args.llama, device), ids, autocast))
    layer = "Llama (rope, RMSNorm, SwiGLU, GQA)" if args.llama else "GPT-2 (LayerNorm, GeLU, biases)"
    print(f"{layer} layer, 768 wide, {'bf16 autocast' if args.bf16 else 'fp32'}, {device}, torch {torch.__version__}")
    print("| | forward | backward |\n|---|---|---|")
    for name, (fwd, bwd) in (("eager ATen ops", eager), ("Inductor kernels", compiled)):
        print(f"| {name} | {sum(fwd.values())} | {sum(bwd.values())} |")
    if args.verbose:
        for name, counts in (("eager", eager), ("compiled", compiled)):
            for phase, c in zip(("forward", "backward"), counts):
                print(f"{name} {phase}: {dict(sorted(c.items()))}")


if __name__ == "__main__":
    main()
