"""torch.compile over the whole model at every layout (issue 26).

The layouts run inside ONE group of 2 gloo ranks (the module's fixture
`compiled`), which writes what it measured to a JSON file that the tests
read: compiled vs eager losses and gradients, Dynamo's graph breaks, and the
order of collectives and GEMMs in the graphs AOTAutograd hands the compiler.
The layouts compile with a graph-capturing backend that is aot_eager (the
same ATen graphs, run op by op, without Inductor's C++ codegen, which costs
~25 s per layout on 2 cores); one layout (SP + Domino) compiles with Inductor,
whose scheduler order is recorded too.
train.py's own loop runs the issue's SP + Domino run and ZeRO 1-3 under
torchrun (this file is the worker). The Triton kernels' custom ops run on
CPU through Triton's interpreter (conftest.py); tests marked gpu need CUDA.
"""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import config  # noqa: E402
import parallel  # noqa: E402

# 3 rows of 12 tokens: Domino's 2 chunks are 2 rows (24 tokens) and 1 row
# (12); under sequence parallelism each rank's collectives carry half the
# tokens of each. No weight of the model (16, 32, 48, 64, 128 wide) has
# those sizes, so a node's token count names its chunk (as _OverlapRecorder's).
GEMM_CHUNKS, SP_COMM_CHUNKS = {24: 0, 12: 1}, {12: 0, 6: 1}
STEPS = 3

LAYOUTS = {  # name: (tensor-parallel size, GPTConfig options)
    "tp1": (1, {}),
    "tp1-recompute": (1, dict(activation_checkpointing=True)),
    "tp2": (2, {}),
    "tp2-recompute": (2, dict(activation_checkpointing=True)),
    "sp": (2, dict(sequence_parallel=True)),
    "sp-recompute": (2, dict(sequence_parallel=True, activation_checkpointing=True)),
    "domino2": (2, dict(domino_chunks=2)),
    "domino3": (2, dict(domino_chunks=3)),
    "sp-domino2": (2, dict(sequence_parallel=True, domino_chunks=2)),
    "sp-domino3": (2, dict(sequence_parallel=True, domino_chunks=3)),
    "sp-domino2-llama": (2, dict(sequence_parallel=True, domino_chunks=2, position_embedding_type="rope",
                                 normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
                                 untie_embeddings_and_output_weights=True, num_query_groups=2)),
}


# --------------------------------------------------------------------------
# What runs on the ranks
# --------------------------------------------------------------------------

def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 100, (3, 13), generator=g)
    return ids[:, :-1], ids[:, 1:], (torch.rand(3, 12, generator=g) > 0.2).float()


def _train(model, forward) -> tuple[list, dict, int]:
    """STEPS AdamW steps through `forward`: the losses, the full (TP-
    gathered) gradients of the first step, and the bytes of activations the
    first step kept for backward."""
    from test_parallel import _full_grads
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, grads, saved = [], None, {}
    for step in range(STEPS):
        x, y, mask = _batch(step)
        with _saved_for_backward(saved if step == 0 else {}, model):
            loss = forward(x, labels=y, loss_mask=mask)
        loss.backward()
        grads = grads or {n: g.clone() for n, g in _full_grads(model).items()}
        parallel.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads, sum(saved.values())


def _saved_for_backward(saved: dict, model):
    """Record the bytes of every activation autograd keeps for backward
    (each storage once; not the parameters): eager mode's, and the compiled
    graph's, which keeps what AOTAutograd's partitioner chose."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _chunk_of(node, chunks: dict):
    """The Domino chunk whose tokens a collective node moves: the per-rank
    piece (the all-gather's input, the others' output), (..., C) -> tokens."""
    val = (node.args[0] if "all_gather" in str(node.target) else node).meta["val"]
    return chunks.get(val.numel() // val.shape[-1]) if val.dim() > 1 else None


def _fx_events(nodes, comm_chunks: dict) -> list:
    """The collective launches and waits and the GEMMs among FX nodes, in
    their order, as _OverlapRecorder logs eager mode: (kind, chunk, [collective, node])."""
    events = []
    for node in nodes:
        target = str(node.target)
        if node.op != "call_function":
            continue
        if target.startswith("_c10d_functional.wait_tensor"):
            events.append(("wait", None, [None, node.args[0].name]))
        elif target.startswith("_c10d_functional."):  # all_reduce_: Inductor's in-place variant
            name = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter",
                    "all_gather_into_tensor": "all_gather"}[target.split(".")[1].rstrip("_")]
            chunk = _chunk_of(node, comm_chunks)
            if chunk is not None:
                events.append(("launch", chunk, [name, node.name]))
        elif target in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default"):
            dims = {d for a in node.args if isinstance(a, torch.fx.Node) for d in a.meta["val"].shape}
            events += [("gemm", chunk, None) for tokens, chunk in GEMM_CHUNKS.items() if tokens in dims]
    # a wait names its launch by node name; keep the waits of the chunks' launches
    launched = {e[2][1]: e[2] for e in events if e[0] == "launch"}
    return [e if e[0] != "wait" else ("wait", None, launched[e[2][1]])
            for e in events if e[0] != "wait" or e[2][1] in launched]


def _capturing_backend(graphs: list):
    """aot_eager (AOTAutograd, min-cut partitioner, graphs run op by op)
    that also keeps the forward and backward graphs it was given."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def keep(gm, example_inputs):
        graphs.append(gm.graph)
        return make_boxed_func(gm.forward)
    return aot_autograd(fw_compiler=keep, bw_compiler=keep,
                        partition_fn=min_cut_rematerialization_partition)


def _inductor_order(orders: list) -> dict:
    """torch.compile's arguments for Inductor with train.py's options for
    tensor parallelism (config.OVERLAP_INDUCTOR_OPTIONS), and a last
    scheduler pass that changes nothing but records the order in which the
    generated code will run the nodes: each scheduled node as the post-grad
    FX nodes it came from (a wait, a collective, a GEMM, fused kernels). A
    collective is lowered to a copy of its input and the collective itself:
    each FX node is placed at its last scheduled node (the launch proper)."""
    def record(snodes):
        origins = [origin for snode in snodes for sub in snode.get_nodes() if sub.node is not None
                   for origin in sorted(sub.node.origins, key=lambda n: n.name)]
        last = {node: k for k, node in enumerate(origins)}
        orders.append([node for k, node in enumerate(origins) if last[node] == k])
        return snodes
    options = {**config.OVERLAP_INDUCTOR_OPTIONS, "reorder_for_compute_comm_overlap": True,
               "reorder_for_compute_comm_overlap_passes": [record]}
    return {"backend": "inductor", "options": options}


def _compare(tp: int, options: dict, backend_of) -> dict:
    """One layout, eager then compiled from the same seed: what the tests check."""
    from test_parallel import _build_gpt
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _build_gpt(tp, **options)
    eager_losses, eager_grads, eager_saved = _train(model, model)
    graphs = []
    start = time.time()
    model = _build_gpt(tp, **options)
    kwargs = backend_of(graphs)
    compiled = torch.compile(model, **(kwargs if isinstance(kwargs, dict) else {"backend": kwargs}))
    losses, grads, saved = _train(model, compiled)
    comm = SP_COMM_CHUNKS if options.get("sequence_parallel") else GEMM_CHUNKS
    return {"eager_losses": eager_losses, "losses": losses, "seconds": time.time() - start,
            "eager_saved": eager_saved, "saved": saved,
            "grad_errors": {n: [(grads[n] - g).abs().max().item(), g.abs().max().item()]
                            for n, g in eager_grads.items()},
            "graph_breaks": {k[:300]: v for k, v in torch._dynamo.utils.counters["graph_break"].items()},
            "graphs": len(graphs), "events": [_fx_events(getattr(g, "nodes", g), comm) for g in graphs[:2]]}


def _compile_every_layout(out: str, names: list):
    results = {name: _compare(*LAYOUTS[name], _capturing_backend) for name in names}
    results["inductor:sp-domino2"] = _compare(*LAYOUTS["sp-domino2"], _inductor_order)
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    from test_parallel import run_on_ranks
    out = str(tmp_path_factory.mktemp("compile") / "layouts.json")
    run_on_ranks(_compile_every_layout, out, list(LAYOUTS))
    with open(out) as f:
        return json.load(f)


# --------------------------------------------------------------------------
# 1. --compile equals eager; 2. no graph break
# --------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", [*LAYOUTS, "inductor:sp-domino2"])
def test_compiled_training_equals_eager(compiled, name):
    """Three AdamW steps (fp32): the compiled model's losses and first-step
    gradients equal eager mode's to 1e-5. Before issue 26 the Domino layouts
    trained on gradients read before their all-reduce had landed."""
    run = compiled[name]
    assert run["graphs"] >= 2, "nothing was compiled"
    torch.testing.assert_close(run["losses"], run["eager_losses"], rtol=1e-5, atol=0)
    for param, (error, scale) in run["grad_errors"].items():
        assert error <= 1e-5 * scale + 1e-7, f"{name}: grad of {param} off by {error} (max {scale})"


@pytest.mark.slow
@pytest.mark.parametrize("name", [*LAYOUTS, "inductor:sp-domino2"])
def test_no_graph_break_in_forward_and_backward(compiled, name):
    """Dynamo captures the model's forward (and with it backward) whole:
    torch._dynamo.utils.counters["graph_break"] stays empty, and there is
    one forward and one backward graph (plus none per step: no recompile)."""
    run = compiled[name]
    assert run["graph_breaks"] == {}, run["graph_breaks"]
    assert run["graphs"] == 2


# --------------------------------------------------------------------------
# 3. Domino's overlap survives compilation
# --------------------------------------------------------------------------

def _events(compiled, name):
    return [[(kind, chunk, tuple(launch) if launch else None) for kind, chunk, launch in graph]
            for graph in compiled[name]["events"]]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["domino2", "inductor:sp-domino2", "sp-domino2"])
def test_domino_overlap_survives_compilation(compiled, name):
    """In the graphs the compiler receives (aot_eager's), and in the order
    Inductor's generated code runs its kernels, every chunk's collective
    but the last has a GEMM of the other chunk between its launch and its
    wait, forward and backward: the order tests/test_parallel.py checks in
    eager mode. (Inductor keeps it with config.OVERLAP_INDUCTOR_OPTIONS: its
    peak-memory reordering would wait for each collective right after
    launching it.)"""
    from test_parallel import _unhidden_all_reduces
    forward, backward = _events(compiled, name)
    if "sp" not in name:  # 2 layers x 2 sublayers x 2 chunks all-reduces each way
        assert [k for k, *_ in forward].count("launch") == 8, forward
        assert [k for k, *_ in backward].count("launch") == 8, backward
        assert _unhidden_all_reduces(forward) == [], forward
        assert _unhidden_all_reduces(backward) == [], backward
        return
    launched = [launch[0] for kind, _, launch in forward if kind == "launch"]
    assert launched.count("reduce_scatter") == 8 and launched.count("all_gather") == 8, forward
    assert _unhidden_all_reduces(forward, "reduce_scatter") == [], forward
    first_gather = next(k for k, (kind, *_) in enumerate(forward) if kind == "launch")
    assert _unhidden_all_reduces(forward, "all_gather") == [first_gather], forward
    assert _unhidden_all_reduces(backward, "reduce_scatter") == [], backward
    # a row-parallel layer's dY is all-gathered and waited for at once (its
    # GEMMs need it): launch and wait side by side, 8 of them
    synchronous = [k for k, (kind, _, launch) in enumerate(backward[:-1])
                   if kind == "launch" and backward[k + 1] == ("wait", None, launch)]
    assert len(synchronous) == 8, backward
    regathers = [e for k, e in enumerate(backward) if k not in synchronous and k - 1 not in synchronous]
    assert _unhidden_all_reduces(regathers, "all_gather", other_chunk=False) == [], regathers



@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in [*LAYOUTS, "inductor:sp-domino2"] if "recompute" not in n])
def test_compilation_keeps_no_more_for_backward_than_eager_mode(compiled, name):
    """The activations autograd keeps from forward for backward (bytes, each
    storage once): the compiled graph keeps no more than eager mode does.
    Sequence parallelism keeps each rank's slice of a column-parallel
    layer's input and re-gathers it in backward; AOTAutograd, which never
    recomputes a collective, would run that re-gather in forward and keep
    its output, tp times the slice, but for layers._after. (Not under
    --recompute-activations: there the compiled graph also keeps the RNG
    state of each checkpoint as a tensor, which eager mode keeps on ctx,
    out of the hooks' sight.)"""
    run = compiled[name]
    assert run["saved"] <= run["eager_saved"], (run["saved"], run["eager_saved"])


# --------------------------------------------------------------------------
# 4. The Triton kernels as custom ops (CPU: Triton's interpreter, conftest.py)
# --------------------------------------------------------------------------

OPS = ["flash_attention", "flash_attention-mha-noncausal", "layer_norm", "rms_norm", "add_layer_norm",
       "add_rms_norm", "loss_row_stats", "loss_row_grad_", "parallel_after"]


def _op_cases():
    """(op, args) for every custom op (OPS), at tiny shapes."""
    import kernels
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape, grad=True: torch.randn(*shape, generator=g).requires_grad_(grad)  # noqa: E731
    q, k, v = rand(1, 4, 20, 32), rand(1, 2, 20, 32), rand(1, 2, 20, 32)   # grouped-query
    x, res, w, b = rand(3, 5, 48), rand(3, 5, 48), rand(48), rand(48)
    z, labels = rand(6, 40, grad=False), torch.randint(0, 40, (6,), generator=g)
    return {
        "flash_attention": (kernels.flash_attention_op, (q, k, v, True, 0.2)),
        "flash_attention-mha-noncausal": (kernels.flash_attention_op, (q, q.detach().requires_grad_(),
                                                                         rand(1, 4, 20, 32), False, 0.1)),
        "layer_norm": (kernels.layer_norm_op, (x, w, b, 1e-5, None)),
        "rms_norm": (kernels.layer_norm_op, (x, w, None, 1e-5, None)),
        "add_layer_norm": (kernels.add_layer_norm_op, (x, res, w, b, 1e-5, None)),
        "add_rms_norm": (kernels.add_layer_norm_op, (x, res, w, None, 1e-5, None)),
        "loss_row_stats": (kernels.loss_row_stats, (z, labels, 10)),
        "loss_row_grad_": (kernels.loss_row_grad_, (z.clone(), labels, z.logsumexp(-1), torch.rand(6, generator=g), 0)),
        "parallel_after": (torch.ops.parallel.after, (x.detach(), res.detach())),  # backward only
    }


@pytest.mark.parametrize("name", OPS)
def test_custom_ops_trace_with_fake_tensors(name):
    """torch.library.opcheck: the op's schema, its fake (shape-only)
    implementation against the real kernel's outputs (shapes, strides,
    dtypes), its autograd registration, and AOTAutograd tracing it with fake
    tensors and dynamic shapes, then running it, against eager."""
    op, args = _op_cases()[name]
    torch.library.opcheck(op, args)


def _triton_gpt(**options):
    from gpt import GPT, GPTConfig
    parallel.destroy()
    parallel.initialize(1)
    torch.manual_seed(0)
    return GPT(GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=2, max_position_embeddings=16,
                         vocab_size=100, padded_vocab_size=128, attention_impl="triton",
                         layernorm_impl="triton", **options))


@pytest.mark.parametrize("options", [{}, dict(position_embedding_type="rope", normalization="RMSNorm",
                                              swiglu=True, num_query_groups=1)], ids=["gpt2", "llama"])
def test_model_with_triton_kernels_compiles_whole(options):
    """The model with the Triton attention and LayerNorm/RMSNorm (fused add)
    compiles with no graph break, and a step's loss and gradients equal
    eager mode's. Before the kernels were custom ops, Dynamo traced into the
    launchers (here into Triton's interpreter) and failed."""
    ids = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(0))

    def step(model, forward):
        forward(ids[:, :-1], labels=ids[:, 1:]).backward()
        return {n: p.grad for n, p in model.named_parameters()}
    want = step(model := _triton_gpt(**options), model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got = step(model := _triton_gpt(**options), torch.compile(model, backend="aot_eager", fullgraph=True))
    assert not torch._dynamo.utils.counters["graph_break"]
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_fused_loss_row_kernels_compile_whole():
    """The fused loss's Triton row passes inside a compiled graph (no graph
    break) give eager mode's statistics and in-place gradient."""
    import gpt
    g = torch.Generator().manual_seed(0)
    z, labels, weight = torch.randn(8, 40, generator=g), torch.randint(0, 40, (8,), generator=g), torch.rand(8, generator=g)

    def passes(z):
        lse, target = gpt.chunk_lse_and_grad_(z, labels, weight, 0, triton_kernels=True)
        return lse, target, z
    want = passes(z.clone())
    torch._dynamo.reset()
    got = torch.compile(passes, backend="aot_eager", fullgraph=True)(z.clone())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_autocast_adds_no_cast_around_the_custom_kernels():
    """Under bf16 autocast the compiled graphs feed the custom kernels with
    no cast (the custom ops have no autocast rule, and the kernels take the
    dtypes they are given: attention the 16-bit q, k, v; LayerNorm the fp32
    residual stream, writing its output in bf16 for the next GEMM), and no
    cast follows a forward kernel."""
    import operator
    graphs = []
    ids = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with torch.autocast("cpu", torch.bfloat16):
        loss = torch.compile(_triton_gpt(), backend=_capturing_backend(graphs))(ids[:, :-1], labels=ids[:, 1:])
    loss.backward()
    casts = ("aten._to_copy", "prims.convert_element_type")
    kernel_nodes = 0
    for graph, phase in zip(graphs, ("forward", "backward")):
        for node in graph.nodes:
            if not str(node.target).startswith("kernels."):
                continue
            kernel_nodes += 1
            assert not [a for a in node.all_input_nodes if str(a.target).startswith(casts)], (phase, node)
            users = [w for u in node.users for w in ([u] if u.target is not operator.getitem else u.users)]
            if phase == "forward":  # (backward casts the fused add's gradient to the branch's bf16)
                assert not [u for u in users if str(u.target).startswith(casts)], (phase, node)
    assert kernel_nodes == 14  # 7 forward (2 x (LN, attention, add+LN) + ln_f), 7 backward


def _kernels_of(code: str) -> list:
    """The kernels Inductor's generated code calls, in order (bench/bench_compile.py)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from bench_compile import CALL
    return [m.group(1) for line in code[code.index("def call("):].splitlines() if (m := CALL.match(line))]


@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
def test_inductor_fuses_the_mlp_epilogues(swiglu):
    """Inductor compiles the MLP's activation into one kernel besides the
    GEMMs: forward bias + tanh-GeLU (on CPU the bias rides in the addmm) or
    SwiGLU's silu(gate) * up, where eager mode runs two or three; backward
    the activation's gradient with the fc bias's sum, two kernels besides
    the GEMMs where eager mode runs three (GeLU) or six (SwiGLU)."""
    from torch._inductor.utils import run_and_get_code
    from gpt import GPTConfig, MLP
    parallel.destroy()
    parallel.initialize(1)
    mlp = MLP(GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=2, swiglu=swiglu))
    x = torch.randn(2, 16, 64, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(mlp)
    _, (forward, backward) = run_and_get_code(lambda: compiled(x).sum().backward())
    gemm = re.compile(r"(extern_kernels|aten|torch\.ops\.aten)\.(addmm|mm|bmm)$")
    forward, backward = ([k for k in _kernels_of(code) if not gemm.match(k)] for code in (forward, backward))
    assert len(forward) == 1, forward
    assert len(backward) <= 2, backward


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, dict(position_embedding_type="rope", normalization="RMSNorm",
                                              swiglu=True, num_query_groups=1)], ids=["gpt2", "llama"])
def test_gpu_inductor_compiles_the_model_with_the_triton_kernels(options):
    """On a GPU, Inductor compiles the model with the Triton kernels (and the
    fused loss's row passes) whole: no graph break, and bf16 autocast training
    steps follow eager mode's."""
    from gpt import GPT, GPTConfig
    parallel.destroy()
    parallel.initialize(1)

    def build():
        torch.manual_seed(0)
        return GPT(GPTConfig(num_layers=2, hidden_size=128, num_attention_heads=2, max_position_embeddings=256,
                             vocab_size=1000, padded_vocab_size=1024, attention_impl="triton",
                             layernorm_impl="triton", **options)).cuda()
    ids = torch.randint(0, 1000, (4, 257), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def losses(model, forward):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out = []
        for _ in range(3):
            with torch.autocast("cuda", torch.bfloat16):
                loss = forward(ids[:, :-1], labels=ids[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out
    want = losses(model := build(), model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got = losses(model := build(), torch.compile(model, fullgraph=True))
    assert not torch._dynamo.utils.counters["graph_break"]
    torch.testing.assert_close(got, want, rtol=2e-2, atol=0)


# --------------------------------------------------------------------------
# 6. CUDA graphs: --compile-mode reduce-overhead
# --------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message; a GPU runs the mode")
def test_cuda_graph_mode_on_cpu_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"--compile-mode reduce-overhead replays the step as CUDA graphs, "
                                         r"which needs a GPU: on CPU use --compile alone$"):
        config.parse_args(["--preset", "tiny", "--compile", "--compile-mode", "reduce-overhead"])


@pytest.mark.parametrize("argv, message", [
    (["--compile-mode", "max-autotune"], "--compile-backend / --compile-mode need --compile"),
    (["--compile", "--compile-mode", "fast"], "--compile-mode 'fast': use one of default, reduce-overhead"),
    (["--compile", "--compile-backend", "aot_eager", "--compile-mode", "max-autotune-no-cudagraphs"],
     "is an Inductor mode"),
    (["--compile", "--compile-backend", "tvm2"], "is not a torch.compile backend"),
])
def test_bad_compile_flags_are_one_line_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        config.parse_args(["--preset", "tiny", *argv])


def test_compile_options_keep_the_overlap_and_the_mode():
    """train.py hands Inductor config.OVERLAP_INDUCTOR_OPTIONS whenever the
    graph holds overlapped collectives (Domino, sequence parallelism), merged
    with --compile-mode's options (torch.compile takes a mode or options)."""
    cfg = config.TrainConfig(compile=True, tensor_model_parallel_size=2, domino=True,
                             compile_mode="reduce-overhead")
    assert config.compile_options(cfg) == {
        "backend": "inductor", "options": {"triton.cudagraphs": True, **config.OVERLAP_INDUCTOR_OPTIONS}}
    assert config.compile_options(config.TrainConfig(compile=True)) == {"backend": "inductor", "options": {}}
    assert config.compile_options(config.TrainConfig(compile=True, compile_backend="aot_eager")) == {
        "backend": "aot_eager"}


@pytest.mark.gpu
def test_gpu_reduce_overhead_replays_the_step_as_cuda_graphs(tmp_path):
    """--compile --compile-mode reduce-overhead: the fixed-shape step is
    captured once and replayed (Inductor's cudagraph trees: no step is
    skipped for CUDA graphs), and trains like --compile alone."""
    from test_train import losses, run_train
    from test_zero import make_corpus
    make_corpus(str(tmp_path / "corpus_text_document"))
    common = ["--preset", "tiny", "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
              "--train-iters", "6", "--eval-interval", "0", "--log-interval", "1", "--sample-tokens", "0",
              "--data-path", str(tmp_path / "corpus_text_document"), "--bf16"]
    run_train([*common, "--compile", "--metrics-file", str(tmp_path / "compiled.jsonl")])
    proc = run_train([*common, "--compile", "--compile-mode", "reduce-overhead",
                      "--metrics-file", str(tmp_path / "graphs.jsonl")],
                     env={"TORCH_LOGS": "perf_hints"})
    assert "skipping cudagraphs" not in proc.stdout + proc.stderr
    torch.testing.assert_close(losses(tmp_path / "graphs.jsonl"), losses(tmp_path / "compiled.jsonl"),
                               rtol=1e-3, atol=0)


# --------------------------------------------------------------------------
# train.py --compile: the run, and ZeRO 1-3 (this file is the
# torchrun worker: `python -m torch.distributed.run ... test_compile.py OUT`)
# --------------------------------------------------------------------------

# The setup: 2 layers, 64 wide, seq 32, micro-batch 2, global batch 8.
RUN = ["--preset", "tiny", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
       "--train-iters", "4", "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-interval", "0",
       "--log-interval", "1", "--sample-tokens", "0", "--seed", "1234"]
COMPILE = ["--compile", "--compile-backend", "aot_eager"]
TRAIN_RUNS = {  # name: flags; each runs eagerly and with COMPILE
    "tp2-sp-domino": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--domino"],
    **{f"zero{stage}": ["--deepspeed", "--zero-stage", str(stage)] for stage in (1, 2, 3)},
}


def worker(out: str) -> None:
    import torch.distributed as dist
    import train
    from test_zero import make_corpus
    os.environ["DS_ACCELERATOR"] = "cpu"
    dist.init_process_group("gloo")
    data = os.path.join(out, "corpus_text_document")
    if dist.get_rank() == 0:
        make_corpus(data)
    dist.barrier()
    found = {}
    for name, flags in TRAIN_RUNS.items():
        for run, extra in ((name, []), (name + "-compiled", COMPILE)):
            cfg = config.parse_args([*RUN, "--data-path", data, "--data-cache-path", os.path.join(out, "cache"),
                                     "--metrics-file", os.path.join(out, run + ".jsonl"), *flags, *extra])
            parallel.destroy()
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            train.train(cfg, train.init_distributed(cfg))
            counters = torch._dynamo.utils.counters
            found[run] = {"graph_breaks": sum(counters["graph_break"].values()),
                          "graphs": counters["stats"]["unique_graphs"]}
    if dist.get_rank() == 0:
        with open(os.path.join(out, "counters.json"), "w") as f:
            json.dump(found, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def train_runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("train"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.abspath(__file__), out]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    with open(os.path.join(out, "counters.json")) as f:
        return out, json.load(f)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRAIN_RUNS))
def test_train_py_compile_follows_eager_mode(train_runs, name):
    """train.py --compile (aot_eager graphs) takes the same 4 steps as eager
    mode, loss and gradient norm to 1e-5: tensor parallelism with sequence
    parallelism and Domino (the issue's run; before the fix its gradient
    norms were NaN and every step was skipped, bench/results_compile.md),
    and ZeRO 1, 2 and 3 (refused before). Each compiled run really compiled
    (Dynamo made a graph), with no graph break but under ZeRO-3."""
    out, counters = train_runs

    def metrics(run):
        with open(os.path.join(out, run + ".jsonl")) as f:
            return [json.loads(line) for line in f]
    eager, compiled = metrics(name), metrics(name + "-compiled")
    assert [m["iteration"] for m in compiled] == [1, 2, 3, 4]
    for a, b in zip(eager, compiled, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (a, b)
    assert counters[name + "-compiled"]["graphs"] >= 1 and counters[name]["graphs"] == 0
    if name != "zero3":  # ZeRO-3 keeps its parameter hooks out of the graph: see README
        assert counters[name + "-compiled"]["graph_breaks"] == 0, counters


if __name__ == "__main__" and len(sys.argv) == 2:
    worker(sys.argv[1])
