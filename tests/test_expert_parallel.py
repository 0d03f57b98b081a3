"""Tests for the mixture of experts: gpt.MoE (the router, top-k, capacity, the
load-balancing losses, the plain loop over experts) and expert_parallel.py
(permute, the all-to-all and all-gather dispatchers, the grouped GEMM).

The routing is checked against megatron-core's own functions on the same
inputs, the layer against transformers' Mixtral and Qwen2-MoE blocks from the
same weights, and expert parallelism against one process holding every
expert: EP = 2 and 4 give its outputs and gradients, for both dispatchers,
the loop and the grouped GEMM, dropless and with capacity."""
import math
import sys

import pytest
import torch
import torch.distributed as dist

import expert_parallel
import gpt
import parallel
from conftest import run_on_ranks, tiny, tokens
from launch import UsageError


def moe_config(**overrides):
    """A tiny MoE model: 8 experts of width 32 (64-wide tokens), top-2, every layer."""
    return tiny(**{"num_experts": 8, "moe_ffn_hidden_size": 32, **overrides})


def moe_layer(seed=0, **overrides):
    """A gpt.MoE built and initialized as GPT builds its pieces (init_weights), in training mode."""
    config = moe_config(**overrides)
    torch.manual_seed(seed)
    with torch.random.fork_rng():
        layer = gpt.MoE(config)
    gpt.init_weights(layer, config)
    return layer


def hidden(B=2, T=8, C=64, seed=1, requires_grad=False):
    return torch.randn(B, T, C, generator=torch.Generator().manual_seed(seed)).requires_grad_(requires_grad)


@pytest.fixture(scope="module")
def mcore():
    """megatron-core's MoE utilities (importing them warns on a CPU: fine)."""
    from megatron.core.transformer.moe import moe_utils
    return moe_utils


# -----------------------------------------------------------------------------
# The routing, against megatron-core


ROUTINGS = [dict(), dict(moe_router_pre_softmax=True), dict(moe_router_topk=1, moe_router_pre_softmax=True),
            dict(moe_router_score_function="sigmoid"), dict(moe_router_score_function="sigmoid", moe_router_topk=1),
            dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)]


@pytest.mark.parametrize("options", ROUTINGS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "softmax")
def test_top_k_routing_is_megatron_cores(mcore, options):
    """topk_routing's probs and routing map are topk_routing_with_score_function's,
    softmax (top-k then softmax, or pre-softmax) and sigmoid, with an expert bias
    that changes which experts are picked but not their weights."""
    config = moe_config(**options)
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    bias = torch.linspace(-0.3, 0.3, 8) if config.moe_router_enable_expert_bias else None
    probs, routing_map = gpt.topk_routing(logits, config, bias)
    want_probs, want_map = mcore.topk_routing_with_score_function(
        logits, config.moe_router_topk, use_pre_softmax=config.moe_router_pre_softmax,
        score_function=config.moe_router_score_function, expert_bias=bias)
    assert torch.equal(routing_map, want_map) and torch.equal(probs, want_probs)
    assert (routing_map.sum(1) == config.moe_router_topk).all()
    if bias is not None:  # the bias moved some choices
        assert not torch.equal(routing_map, gpt.topk_routing(logits, config)[1])


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True], ids=["drop", "pad"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 4.0])
def test_capacity_drops_the_tokens_megatron_core_drops(mcore, policy, pad, factor):
    """Over an expert's capacity ceil(k N / E x factor), drop_tokens keeps the
    tokens apply_router_token_dropping keeps (the highest probs, or by the
    position policy), and with padding marks exactly `capacity` tokens per
    expert (all N when the capacity exceeds them), the added ones weighted 0."""
    config = moe_config(moe_expert_capacity_factor=factor, moe_token_drop_policy=policy,
                        moe_pad_expert_input_to_capacity=pad)
    logits = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)) + torch.linspace(0, 2, 8)  # unbalanced
    probs, routing_map = gpt.topk_routing(logits, config)
    got_probs, got_map = gpt.drop_tokens(probs, routing_map, config)
    want_probs, want_map = mcore.apply_router_token_dropping(probs, routing_map, 2, factor, policy, pad)
    assert torch.equal(got_map, want_map) and torch.equal(got_probs, want_probs)
    capacity = math.ceil(32 * 2 / 8 * factor)
    if pad:
        assert (got_map.sum(0) == min(capacity, 32)).all()
    elif factor < 1:
        assert (got_map.sum(0) <= capacity).all() and got_map.sum() < routing_map.sum()  # some were dropped


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_the_recorded_aux_losses_are_megatron_cores(mcore, kind, score):
    """In training, the layer records its load-balancing loss (Switch's over the
    batch, or per sequence, averaged) and the z-loss, without their
    coefficients, as megatron-core computes them from the router's logits (its
    sequence loss from the same tokens laid out sequence first, as Megatron holds them)."""
    layer = moe_layer(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=1e-3,
                      moe_router_score_function=score)
    x = hidden(B=3, T=8)
    layer(x)
    logits = x.flatten(0, 1) @ layer.router.weight.T                       # (B T, E)
    chosen, scores = mcore.compute_routing_scores_for_aux_loss(logits, 2, score)
    if kind == "aux_loss":
        want = mcore.switch_load_balancing_loss_func(scores, chosen.sum(0), 24, 2, 8, 1.0)
        name = "load_balancing_loss"
    else:  # Megatron's [s, b, E] layout reshaped to (s, b E): each sequence's experts apart
        first = lambda t: t.view(3, 8, 8).transpose(0, 1).reshape(8, 24)  # noqa: E731
        want = mcore.switch_load_balancing_loss_func(first(scores), first(chosen).sum(0), 8, 2, 8, 1.0) / 3
        name = "seq_load_balancing_loss"
    torch.testing.assert_close(layer.aux_losses[name], want, rtol=1e-6, atol=0)
    torch.testing.assert_close(layer.aux_losses["z_loss"], mcore.z_loss_func(logits, 1.0), rtol=1e-6, atol=0)
    assert not layer.aux_losses[name].requires_grad


@pytest.mark.quick
def test_the_aux_losses_reach_the_routers_gradient():
    """The load-balancing loss and the z-loss join backward without being
    returned (gpt.AuxLoss): the router's gradient is the LM-side gradient plus
    the coefficients times the losses' own gradients, times aux_loss_scale
    (the factor the loss that backward starts from carries)."""
    x, g = hidden(), hidden(seed=2)
    grads = {}
    for coeffs, scale in ((dict(moe_aux_loss_coeff=0.0), 1.0), (dict(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.2), 0.25)):
        layer = moe_layer(**coeffs)
        layer.aux_loss_scale = scale
        (layer(x) * g).sum().backward()
        grads[scale] = layer.router.weight.grad
    w = layer.router.weight.detach().requires_grad_()
    logits = x.flatten(0, 1) @ w.T
    scores = torch.softmax(logits, dim=-1)
    chosen = torch.zeros_like(scores).scatter(1, torch.topk(scores, 2, dim=-1).indices, 1.0)
    aux = 0.5 * gpt.load_balancing_loss(scores[None], chosen[None], 2) + 0.2 * torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(grads[0.25], grads[1.0] + 0.25 * torch.autograd.grad(aux, w)[0], rtol=1e-5, atol=1e-7)


def test_the_expert_bias_moves_as_megatron_cores_and_only_picks(mcore, monkeypatch):
    """Aux-loss-free balancing: the tokens each expert took over a step (the
    training forwards, not evaluation's) move its bias by the update rate
    toward the mean load, as get_updated_expert_bias does; the bias changes the
    routing map but not the weights of the chosen experts (sigmoid scores)."""
    layer = moe_layer(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                      moe_router_bias_update_rate=0.01)
    x = hidden(B=4)
    layer(x)
    layer(hidden(B=4, seed=5))
    with torch.no_grad():
        layer(x)  # not counted
    counts = layer.tokens_per_expert.clone()
    assert counts.sum() == 2 * 32 * 2
    monkeypatch.setattr(mcore.parallel_state, "get_tensor_and_data_parallel_group", lambda **kw: None)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **kw: None)
    want = mcore.get_updated_expert_bias(counts, layer.expert_bias.clone(), 0.01)
    layer.update_expert_bias()
    assert torch.equal(layer.expert_bias, want) and not layer.tokens_per_expert.any()
    logits = torch.randn(32, 8)
    biased = gpt.topk_routing(logits, layer.config, torch.full((8,), 5.0) * (torch.arange(8) < 2))
    assert biased[1][:, :2].all()  # the bias picks experts 0 and 1 for every token
    scores = torch.sigmoid(logits)[:, :2]
    torch.testing.assert_close(biased[0][:, :2], scores / scores.sum(1, keepdim=True))


def test_permute_and_unpermute_are_megatron_cores(mcore):
    """permute sorts one row per (token, chosen expert) by expert, each expert's
    tokens in order, as megatron-core's permute; unpermute weighs and sums them
    back as its unpermute."""
    config = moe_config()
    x = torch.randn(16, 64)
    probs, routing_map = gpt.topk_routing(torch.randn(16, 8), config)
    rows, row_probs, token, counts = expert_parallel.permute(x, probs, routing_map)
    want_rows, want_probs, want_index = mcore.permute(x, routing_map, probs)
    assert torch.equal(rows, want_rows) and torch.equal(row_probs, want_probs) and torch.equal(token, want_index)
    assert counts.tolist() == routing_map.sum(0).tolist() and len(rows) == 16 * 2
    out = rows * 3.0
    torch.testing.assert_close(expert_parallel.unpermute(out, row_probs, token, x),
                               mcore.unpermute(out, want_index, x.shape, probs, routing_map), rtol=1e-6, atol=1e-6)


# -----------------------------------------------------------------------------
# The layer, against transformers'


@pytest.mark.quick
def test_a_mixtral_shaped_layer_is_transformers_mixtral_block():
    """SwiGLU experts without biases, softmax over the top-2 logits: the layer is
    MixtralSparseMoeBlock, from the same weights (router = gate, experts.fc =
    gate_up_proj, experts.proj = down_proj), to 1e-5."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    layer = moe_layer(swiglu=True, disable_bias_linear=True).eval()
    theirs = MixtralSparseMoeBlock(MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=8,
                                                 num_experts_per_tok=2, hidden_act="silu")).eval()
    with torch.no_grad():
        theirs.gate.weight.copy_(layer.router.weight)
        theirs.experts.gate_up_proj.copy_(layer.experts.fc)
        theirs.experts.down_proj.copy_(layer.experts.proj)
    x = hidden()
    torch.testing.assert_close(layer(x), theirs(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("normalized", [False, True], ids=["qwen2-moe", "norm-topk-prob"])
def test_a_shared_expert_layer_is_transformers_qwen2_moe_block(normalized):
    """With a gated shared expert: Qwen2MoeSparseMoeBlock (its top-k of the full
    softmax, unnormalized: --moe-router-pre-softmax; normalized: the default),
    its shared expert our MLP ([gate | up] = fc) times sigmoid(shared_expert_gate)."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    layer = moe_layer(swiglu=True, disable_bias_linear=True, moe_shared_expert_intermediate_size=48,
                      moe_shared_expert_gate=True, moe_router_pre_softmax=not normalized).eval()
    theirs = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(
        hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=normalized, hidden_act="silu")).eval()
    with torch.no_grad():
        theirs.gate.weight.copy_(layer.router.weight)
        theirs.experts.gate_up_proj.copy_(layer.experts.fc)
        theirs.experts.down_proj.copy_(layer.experts.proj)
        gate, up = layer.shared_expert.fc.weight.chunk(2)
        theirs.shared_expert.gate_proj.weight.copy_(gate)
        theirs.shared_expert.up_proj.weight.copy_(up)
        theirs.shared_expert.down_proj.weight.copy_(layer.shared_expert.proj.weight)
        theirs.shared_expert_gate.weight.copy_(layer.shared_expert_gate.weight)
    x = hidden()
    torch.testing.assert_close(layer(x), theirs(x), rtol=1e-5, atol=1e-5)


# -----------------------------------------------------------------------------
# The grouped GEMM, the model, compile


def _output_and_grads(layer, x, g):
    x = x.detach().requires_grad_()
    y = layer(x)
    (y * g).sum().backward()
    return [y, x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("options", [dict(), pytest.param(dict(swiglu=True, disable_bias_linear=True, moe_aux_loss_coeff=0.1),
                                                          marks=pytest.mark.quick),
                                     dict(moe_expert_capacity_factor=0.5),
                                     dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
                                          moe_token_drop_policy="position")],
                         ids=["gelu-bias", "swiglu", "capacity", "padded"])
def test_the_grouped_gemm_is_the_loop(options):
    """moe_grouped_gemm: every expert's MLP as one torch grouped_mm per matrix
    over the permuted rows gives the loop's output and every gradient (input,
    router, stacked weights and biases), dropless and with capacity."""
    x, g = hidden(), hidden(seed=2)
    loop = _output_and_grads(moe_layer(**options), x, g)
    grouped = _output_and_grads(moe_layer(**options, moe_grouped_gemm=True), x, g)
    for a, b in zip(loop, grouped):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.quick
def test_moe_layer_freq_picks_the_moe_layers_and_the_model_trains():
    """--moe-layer-freq as an interval (layers 0, 2, ...) or a 0/1 pattern; the
    other layers keep the dense MLP. A MoE model's loss and gradients flow."""
    assert [gpt.is_moe_layer(moe_config(num_layers=4, moe_layer_freq=2), i) for i in range(4)] == [1, 0, 1, 0]
    config = moe_config(moe_layer_freq=[0, 1], moe_aux_loss_coeff=0.01, qk_layernorm=True)
    model = gpt.GPT(config)
    assert [type(b.mlp) for b in model.blocks] == [gpt.MLP, gpt.MoE]
    model(tokens(), labels=tokens(seed=2)).backward()
    assert all(p.grad is not None for p in model.parameters())
    assert not any(gpt.is_moe_layer(tiny(), i) for i in range(2))


@pytest.mark.quick
def test_a_dense_models_step_enters_no_moe_code():
    """Without --num-experts a training step (forward, loss, backward) calls no
    function of expert_parallel.py and none of gpt.py's MoE."""
    model = gpt.GPT(tiny())
    moe_names = {"MoE", "Experts", "AuxLoss", "topk_routing", "drop_tokens", "load_balancing_loss", "is_moe_layer"}
    entered = set()

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code.co_filename.endswith("expert_parallel.py") or (
                    code.co_filename.endswith("gpt.py") and code.co_qualname.split(".")[0] in moe_names):
                entered.add(code.co_qualname)
    sys.setprofile(profile)
    try:
        model(tokens(), labels=tokens(seed=2)).backward()
    finally:
        sys.setprofile(None)
    assert not entered, entered


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped-bf16"])
def test_the_layer_compiles_whole(grouped):
    """torch.compile captures the layer, forward and backward, in one graph
    (fullgraph) when Dynamo may trace nonzero's data-dependent sizes
    (capture_dynamic_output_shape_ops): the loop's tokens per expert, permute's
    rows. The grouped GEMM compiles in bf16 only: torch 2.13's grouped_mm
    fake kernel takes nothing else (in fp32 it runs in eager mode alone)."""
    layer = moe_layer(moe_grouped_gemm=grouped, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=1e-3)
    x, g = hidden(), hidden(seed=2)
    precision = torch.autocast("cpu", torch.bfloat16, enabled=grouped)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        with precision:
            got = _output_and_grads(compiled, x, g)
    layer.zero_grad()
    with precision:
        want = _output_and_grads(layer, x, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# -----------------------------------------------------------------------------
# Expert parallelism: EP = 2 and 4 are EP = 1, on 4 gloo ranks


EP_CASES = [  # options of each case; each runs at EP 2 and 4
    dict(moe_token_dispatcher_type="alltoall"),
    dict(moe_token_dispatcher_type="allgather", swiglu=True, disable_bias_linear=True,
         moe_shared_expert_intermediate_size=32),
    dict(moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True, swiglu=True, disable_bias_linear=True,
         moe_aux_loss_coeff=0.1, moe_z_loss_coeff=1e-3),
    dict(moe_token_dispatcher_type="allgather", moe_grouped_gemm=True),
    dict(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=0.5),
    dict(moe_token_dispatcher_type="allgather", moe_grouped_gemm=True, moe_expert_capacity_factor=1.0,
         moe_pad_expert_input_to_capacity=True, moe_token_drop_policy="position"),
]


def _layer_on_every_rank(options, world):
    """EP = 1 on this rank: each rank's tokens through one layer holding every
    expert, the loss the mean over ranks -> (outputs, input grads, {name: grad})."""
    layer = moe_layer(**options)
    layer.aux_loss_scale = 1 / world  # each rank's loss enters the mean with 1/world
    xs = [hidden(seed=10 + r, requires_grad=True) for r in range(world)]
    ys = [layer(x) for x in xs]
    sum((y * hidden(seed=20 + r)).sum() for r, y in enumerate(ys)).div(world).backward()
    return ys, [x.grad for x in xs], {n: p.grad for n, p in layer.named_parameters()}


def _check_expert_parallel_is_one_process():
    rank, world = dist.get_rank(), dist.get_world_size()
    parallel.initialize(1)
    want = [_layer_on_every_rank(options, world) for options in EP_CASES]
    for ep in (2, 4):
        parallel.destroy()
        parallel.initialize(expert_model_parallel_size=ep)
        lay = parallel.layout
        assert (lay.ep_size, lay.ep_rank, dist.get_world_size(lay.expert_dp_group)) == (ep, rank % ep, world // ep)
        for options, (ys, x_grads, grads) in zip(EP_CASES, want):
            layer = moe_layer(**options)
            x = hidden(seed=10 + rank, requires_grad=True)
            y = layer(x)
            (y * hidden(seed=20 + rank)).sum().backward()
            expert_parallel.reduce_expert_grads(layer)  # experts: summed over their holders, / DP
            case = f"EP={ep} {options}"
            torch.testing.assert_close(y, ys[rank], rtol=1e-5, atol=1e-6, msg=case)
            torch.testing.assert_close(x.grad / world, x_grads[rank], rtol=1e-5, atol=1e-6, msg=case)
            first, El = rank % ep * 8 // ep, 8 // ep
            for name, p in layer.named_parameters():
                grad = p.grad if name.startswith("experts.") else parallel.all_reduce_mean(p.grad, lay.dp_cp_group)
                full = grads[name][first:first + El] if name.startswith("experts.") else grads[name]
                torch.testing.assert_close(grad, full, rtol=1e-5, atol=1e-6, msg=f"{case}: {name}")
        if ep == 2:
            _check_compiled_expert_parallel_is_eager(rank)


def _check_compiled_expert_parallel_is_eager(rank):
    """Both dispatchers compile whole (fullgraph), forward and backward, when
    Dynamo may trace data-dependent sizes: nonzero's (permute) and the host
    ints of the all-to-all's split sizes (capture_scalar_outputs)."""
    for dispatcher in ("alltoall", "allgather"):
        layer = moe_layer(moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=0.1)
        x, g = hidden(seed=10 + rank), hidden(seed=20 + rank)
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True):
            got = _output_and_grads(torch.compile(layer, backend="aot_eager", fullgraph=True), x, g)
        layer.zero_grad()
        for a, b in zip(got, _output_and_grads(layer, x, g)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=dispatcher)


@pytest.mark.slow
def test_expert_parallel_gives_one_processs_outputs_and_gradients():
    """On 4 ranks, EP = 2 and EP = 4 (each rank its own tokens, E/EP experts,
    the EP ranks folded out of DP) give, to 1e-5 in fp32, what one layer holding
    all 8 experts gives each rank's tokens: outputs, input gradients, the
    router's (averaged over DP as DDP does) and each expert's
    (reduce_expert_grads), for the all-to-all and all-gather dispatchers, the
    loop and the grouped GEMM, dropless and with capacity (each rank drops
    from its own tokens, as one process does), with the aux losses. At EP = 2
    both dispatchers also compile whole and give eager mode's numbers."""
    run_on_ranks(_check_expert_parallel_is_one_process, world_size=4)


@pytest.mark.parametrize("world, tp, cp, pp, ep", [(4, 1, 1, 1, 2), (4, 1, 2, 1, 2), (8, 2, 1, 1, 2), (8, 1, 2, 2, 2),
                                                   (16, 2, 2, 2, 4), (8, 1, 1, 1, 8)])
def test_the_ep_groups_fold_dp_x_cp_as_megatron_folds_them(monkeypatch, world, tp, cp, pp, ep):
    """parallel.initialize's EP groups (and the groups of ranks holding the same
    experts) are megatron-core's RankGenerator's for the experts (order
    tp-cp-ep-dp-pp, expert TP = TP): EP takes consecutive ranks of DP x CP, CP first."""
    from megatron.core.parallel_state import RankGenerator
    theirs = RankGenerator(tp=tp, ep=ep, dp=world // (tp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    monkeypatch.setattr(parallel, "layout", parallel.layout)  # put back after the test
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "new_group", lambda ranks, timeout=None: tuple(ranks))  # a group: its ranks
    for rank in range(world):
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
        parallel.initialize(tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                            expert_model_parallel_size=ep)
        lay = parallel.layout
        assert list(lay.ep_group) == next(g for g in theirs.get_ranks("ep") if rank in g)
        assert list(lay.expert_dp_group) == next(g for g in theirs.get_ranks("dp") if rank in g)
        assert lay.ep_rank == lay.ep_group.index(rank)


# -----------------------------------------------------------------------------
# Refusals: one line each


@pytest.mark.quick
@pytest.mark.parametrize("bad, flag", [
    (dict(num_experts=0), "--num-experts"),
    (dict(num_experts=4, moe_router_topk=5), "--moe-router-topk"),
    (dict(num_experts=4, moe_layer_freq=[1, 0, 1]), "--moe-layer-freq"),
    (dict(num_experts=4, moe_layer_freq=0), "--moe-layer-freq"),
    (dict(num_experts=4, moe_router_score_function="relu"), "--moe-router-score-function"),
    (dict(num_experts=4, moe_router_load_balancing_type="sinkhorn"), "--moe-router-load-balancing-type"),
    (dict(num_experts=4, moe_token_drop_policy="random"), "--moe-token-drop-policy"),
    (dict(num_experts=4, moe_token_dispatcher_type="flex"), "--moe-token-dispatcher-type"),
    (dict(num_experts=4, moe_ffn_hidden_size=-1), "--moe-ffn-hidden-size"),
    (dict(num_experts=4, moe_aux_loss_coeff=-0.1), "--moe-aux-loss-coeff"),
    (dict(num_experts=4, moe_router_topk=1), "--moe-router-pre-softmax"),
    (dict(num_experts=4, moe_router_enable_expert_bias=True), "--moe-router-score-function sigmoid"),
    (dict(num_experts=4, moe_expert_capacity_factor=0.0), "--moe-expert-capacity-factor"),
    (dict(num_experts=4, moe_pad_expert_input_to_capacity=True), "--moe-expert-capacity-factor"),
    (dict(num_experts=4, moe_shared_expert_gate=True), "--moe-shared-expert-intermediate-size"),
    (dict(num_experts=4, moe_grouped_gemm=True, moe_ffn_hidden_size=36), "divisible by 8"),
])
def test_a_bad_moe_option_is_refused_in_one_line(bad, flag):
    with pytest.raises(UsageError) as error:
        tiny(**bad)
    assert flag in str(error.value) and "\n" not in str(error.value)


@pytest.mark.quick
def test_layouts_the_experts_do_not_run_under_are_refused_in_one_line(monkeypatch):
    """An EP size that does not divide DP x CP (here one process), or the
    experts; and, so far, TP, CP or PP with experts."""
    monkeypatch.setattr(parallel, "layout", parallel.layout)  # put back after the test
    with pytest.raises(UsageError, match="--expert-model-parallel-size 2 must divide"):
        parallel.initialize(expert_model_parallel_size=2)
    for layout, flag in ((parallel.Layout(ep_size=3), "divisible by --expert-model-parallel-size 3"),
                         (parallel.Layout(tp_size=2), "--tensor-model-parallel-size"),
                         (parallel.Layout(cp_size=2), "--context-parallel-size"),
                         (parallel.Layout(pp_size=2), "--pipeline-model-parallel-size")):
        monkeypatch.setattr(parallel, "layout", layout)
        with pytest.raises(UsageError, match=flag) as error:
            gpt.MoE(moe_config())
        assert "\n" not in str(error.value)
