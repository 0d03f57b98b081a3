"""Tests for the mixture of experts: gpt.MoE (the router, top-k, capacity, the
load-balancing losses, the plain loop over experts) and expert_parallel.py
(permute, the all-to-all and all-gather dispatchers, the grouped GEMM).

The routing is checked against megatron-core's own functions on the same
inputs, the layer against transformers' Mixtral and Qwen2-MoE blocks from the
same weights, and expert parallelism against one process holding every
expert: EP = 2 and 4 give its outputs and gradients, for both dispatchers,
the loop and the grouped GEMM, dropless and with capacity."""
import contextlib
import dataclasses
import glob
import itertools
import json
import math
import os
import sys

import pytest
import torch
import torch.distributed as dist

import checkpoint
import config
import eval_tasks
import expert_parallel
import gpt
import parallel
import train
import train_ops
from conftest import (IDS, VOCAB, as_torchrun_rank, process_env, read_metrics, run_on_ranks,
                      tiny, tiny_model, tokens, torchrun, train_on_ranks, write_zipf_corpus)
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
    torch.testing.assert_close(layer.stats[name], want, rtol=1e-6, atol=0)
    torch.testing.assert_close(layer.stats["z_loss"], mcore.z_loss_func(logits, 1.0), rtol=1e-6, atol=0)
    assert not layer.stats[name].requires_grad


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
    gpt.update_expert_biases([layer])
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
def test_a_dense_models_step_enters_no_moe_code(single_rank):
    """Without --num-experts a training step (forward, loss, backward, clipping, AdamW)
    calls no function of expert_parallel.py, none of gpt.py's MoE and none of parallel.py's
    tests of the experts' layout."""
    trainer = train.PlainTraining(config.parse_args(["--preset", "tiny", *IDS]), process_env())
    batches = [{"tokens": tokens(), "labels": tokens(seed=2), "loss_mask": torch.ones(2, 16),
                "position_ids": torch.arange(16).expand(2, 16)}]
    moe_names = {"MoE", "Experts", "AuxLoss", "topk_routing", "drop_tokens", "load_balancing_loss", "is_moe_layer"}
    layout_names = {"Layout.whole_experts", "Layout.experts_apart", "averaged_apart"}
    entered = set()

    def profile(frame, event, arg):
        if event == "call":
            code, file = frame.f_code, frame.f_code.co_filename
            if file.endswith("expert_parallel.py") or (file.endswith("gpt.py") and code.co_qualname.split(".")[0]
                                                        in moe_names) or (
                    file.endswith("parallel.py") and code.co_qualname in layout_names):
                entered.add(code.co_qualname)
    sys.setprofile(profile)
    try:
        train.train_step(trainer, batches, 1e-3)
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


@pytest.mark.parametrize("world, tp, cp, pp, ep, etp", [
    (4, 1, 1, 1, 2, 1), (4, 1, 2, 1, 2, 1), (8, 2, 1, 1, 2, 2), (8, 1, 2, 2, 2, 1), (16, 2, 2, 2, 4, 2),
    (8, 1, 1, 1, 8, 1), (4, 2, 1, 1, 2, 1), (8, 2, 1, 2, 4, 1), (16, 2, 2, 2, 8, 1), (16, 4, 1, 1, 2, 1)])
def test_the_ep_groups_fold_dp_x_cp_as_megatron_folds_them(monkeypatch, world, tp, cp, pp, ep, etp):
    """parallel.initialize's EP groups (and the groups of ranks holding the same
    experts) are megatron-core's RankGenerator's for the experts (order
    tp-cp-ep-dp-pp, its tp the expert TP): EP takes consecutive ranks of DP x CP, CP
    first; at expert TP 1 under TP > 1 consecutive ranks of the stage's TP x CP x DP. An EP
    size that does not divide what it is folded out of is refused in one line that names it."""
    from megatron.core.parallel_state import RankGenerator
    theirs = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    monkeypatch.setattr(parallel, "layout", parallel.layout)  # put back after the test
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "new_group", lambda ranks, timeout=None: tuple(ranks))  # a group: its ranks
    for rank in range(world):
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
        parallel.initialize(tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                            expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        lay = parallel.layout
        assert list(lay.ep_group) == next(g for g in theirs.get_ranks("ep") if rank in g)
        assert list(lay.expert_dp_group) == next(g for g in theirs.get_ranks("dp") if rank in g)
        assert lay.ep_rank == lay.ep_group.index(rank)
    folded = "tensor x data x context parallel size \\(--expert-tensor-parallel-size 1\\)" if etp < tp else \
        "data x context parallel size"
    with pytest.raises(UsageError, match=f"--expert-model-parallel-size 3 must divide {folded} {world // (pp * etp)}:"):
        parallel.initialize(tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                            expert_model_parallel_size=3, expert_tensor_parallel_size=etp)


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
    """An EP size that does not divide DP x CP (here one process), or the experts;
    experts whole on each TP rank (expert TP 1) of a model built without sequence parallelism."""
    monkeypatch.setattr(parallel, "layout", parallel.layout)  # put back after the test
    with pytest.raises(UsageError, match="--expert-model-parallel-size 2 must divide"):
        parallel.initialize(expert_model_parallel_size=2)
    for layout, message in ((parallel.Layout(ep_size=3), "divisible by --expert-model-parallel-size 3"),
                            (parallel.Layout(tp_size=2, etp_size=1), "1 needs --sequence-parallel")):
        monkeypatch.setattr(parallel, "layout", layout)
        with pytest.raises(UsageError, match=message) as error:
            gpt.MoE(moe_config())
        assert "\n" not in str(error.value)


# -----------------------------------------------------------------------------
# train.py with experts: the flags, the curves at EP 1, 2 and 4, resumes across EP


# A tiny MoE model whose every option the loop touches is on: 8 experts, top-2 of
# sigmoid scores, the load-balancing and z losses, DeepSeek's expert bias.
# Global batch 16: 8 micro-batches in one process, 2 on each of 4 ranks.
MOE_RUN = ["--preset", "tiny", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "16",
           "--train-iters", "4", "--lr", "3e-3", "--eval-interval", "2",
           "--eval-iters", "1", "--log-interval", "1", "--sample-tokens", "0", "--seed", "5", *IDS,
           "--num-experts", "8", "--moe-ffn-hidden-size", "32", "--moe-router-score-function", "sigmoid",
           "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--moe-router-enable-expert-bias",
           "--moe-router-bias-update-rate", "1e-2"]
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
ETP1 = [*TP2_SP, "--expert-tensor-parallel-size", "1"]  # the experts whole on each TP rank, EP out of TP x DP
EP_RUNS = {  # name: flags, on 4 ranks (EP folded out of DP 4, or TP x DP at expert TP 1); each follows EP = 1
    "ep2": ["--expert-model-parallel-size", "2", *ALLTOALL],  # EP 2 x expert-DP 2: a loop over experts
    "ep4-allgather-grouped-recompute": ["--expert-model-parallel-size", "4", "--moe-grouped-gemm",
                                        "--recompute-activations"],
    "ep2-compiled-recompute": ["--expert-model-parallel-size", "2", *ALLTOALL, "--compile", "--compile-backend",
                               "aot_eager", "--recompute-activations"],
    # the pipelined step (4 micro-batches a step), each stage one of the two MoE layers
    # (tests/test_expert_pipeline_context.py: with EP, every schedule, and CP)
    "pp2-ep1": ["--pipeline-model-parallel-size", "2"],
    # saved at EP 2 after 2 steps, then resumed to the end at EP 1 (DP 4), 2 and 4
    **{f"save-{fmt}": ["--expert-model-parallel-size", "2", *ALLTOALL, "--exit-interval", "2",
                       "--save", f"{{out}}/{fmt}", "--ckpt-format", fmt] for fmt in ("torch", "torch_dist")},
    **{f"resume-{fmt}-ep{ep}": ["--expert-model-parallel-size", str(ep), *ALLTOALL, "--load", f"{{out}}/{fmt}",
                                "--ckpt-format", fmt] for fmt in ("torch", "torch_dist") for ep in (1, 2, 4)},
    # tensor parallelism, the experts split over TP 2 as the dense MLP (expert TP = TP), x DP 2
    "tp2": ["--tensor-model-parallel-size", "2"],
    "tp2-sp-grouped": [*TP2_SP, "--moe-grouped-gemm"],
    "ep2-tp2-sp": [*TP2_SP, "--expert-model-parallel-size", "2", *ALLTOALL],
    "ep2-tp2-sp-domino": [*TP2_SP, "--domino", "--expert-model-parallel-size", "2", *ALLTOALL],
    "tp2-sp-pp2": [*TP2_SP, "--pipeline-model-parallel-size", "2"],
    "tp2-sp-domino-pp2-zb": [*TP2_SP, "--domino", "--pipeline-model-parallel-size", "2", "--enable-zero-bubble"],
    "tp2-sp-compiled": [*TP2_SP, "--compile", "--compile-backend", "aot_eager"],
    "tp2-cp2-ep2": ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                    "--expert-model-parallel-size", "2", *ALLTOALL],
    # saved at EP 2 x TP 2 (+SP, all-to-all; all-gather) after 2 steps, resumed at EP 1 x TP 1 (DP 4);
    # saved at EP 2 x TP 1 (save-torch), resumed at EP 2 x TP 2 + SP
    **{f"save-tp-{fmt}": [*TP2_SP[:2], *TP2_SP[2:] * (fmt == "torch"), "--expert-model-parallel-size", "2",
                          *ALLTOALL * (fmt == "torch"), "--exit-interval", "2", "--save", f"{{out}}/tp-{fmt}",
                          "--ckpt-format", fmt] for fmt in ("torch", "torch_dist")},
    **{f"resume-tp-{fmt}-ep1-tp1": ["--load", f"{{out}}/tp-{fmt}", "--ckpt-format", fmt]
       for fmt in ("torch", "torch_dist")},
    "resume-torch-ep2-tp2-sp": [*TP2_SP, "--expert-model-parallel-size", "2", *ALLTOALL, "--load", "{out}/torch"],
    # expert TP 1 (TP 2 + SP x DP 2): the experts replicated on all 4 ranks, EP 2 over the TP pair, EP 4 over all
    "etp1-ep1": ETP1,
    "etp1-ep2": [*ETP1, "--expert-model-parallel-size", "2", *ALLTOALL],
    "etp1-ep4-allgather-grouped": [*ETP1, "--expert-model-parallel-size", "4", "--moe-grouped-gemm"],
    "etp1-ep2-domino": [*ETP1, "--domino", "--expert-model-parallel-size", "2", *ALLTOALL],
    "etp1-ep2-compiled": [*ETP1, "--expert-model-parallel-size", "2", *ALLTOALL, "--compile", "--compile-backend",
                          "aot_eager"],
    # saved there at EP 2 after 2 steps; resumed at the same layout, at expert TP 2 (EP 2 x TP 2 + SP), at TP 1 EP 1
    **{f"save-etp1-{fmt}": [*ETP1, "--expert-model-parallel-size", "2", *ALLTOALL, "--exit-interval", "2",
                            "--save", f"{{out}}/etp1-{fmt}", "--ckpt-format", fmt] for fmt in ("torch", "torch_dist")},
    **{f"resume-etp1-{fmt}-{to}": [*flags, "--load", f"{{out}}/etp1-{fmt}", "--ckpt-format", fmt]
       for fmt in ("torch", "torch_dist") for to, flags in (
           ("same", [*ETP1, "--expert-model-parallel-size", "2", *ALLTOALL]),
           ("etp2", [*TP2_SP, "--expert-model-parallel-size", "2", *ALLTOALL]), ("tp1-ep1", []))},
}


def _train_moe_runs(out: str, data: str, runs: list) -> None:
    """The EP_RUNS named in turn on these ranks, as train.py runs them; the graphs
    and graph breaks of each (counters.json); checkpoints under out."""
    as_torchrun_rank()
    found = {}
    for name in runs:
        flags = EP_RUNS[name]
        flags = [f.format(out=out) for f in flags]
        cfg = config.parse_args([*MOE_RUN, "--data-path", data, "--data-cache-path", os.path.join(out, "cache"),
                                 "--metrics-file", os.path.join(out, name + ".jsonl"), *flags])
        parallel.destroy()
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        train.train(cfg, train_ops.init_processes(cfg))
        counters = torch._dynamo.utils.counters
        found[name] = {"graphs": counters["stats"]["unique_graphs"],
                       "graph_breaks": sum(counters["graph_break"].values())}
    if dist.get_rank() == 0:
        with open(os.path.join(out, "counters.json"), "w") as f:
            json.dump(found, f)


@pytest.fixture(scope="module")
def moe_runs(ids_corpus, tmp_path_factory):
    """EP = 1 in one process (8 micro-batches a step), then every EP_RUNS run on 4
    gloo ranks (2 each; 4 each at TP 2), in one launch. -> (the metrics of each run by name, counters, their folder)"""
    out = str(tmp_path_factory.mktemp("moe"))
    train_on_ranks([*MOE_RUN, "--data-path", ids_corpus, "--data-cache-path", os.path.join(out, "cache"),
                    "--metrics-file", os.path.join(out, "one.jsonl")])
    run_on_ranks(_train_moe_runs, out, ids_corpus, list(EP_RUNS), world_size=4)
    with open(os.path.join(out, "counters.json")) as f:
        return {name: read_metrics(os.path.join(out, name + ".jsonl")) for name in ["one", *EP_RUNS]}, json.load(f), out


# What each step logs: the LM and validation losses, the gradient norm, and the MoE layers' figures
# (their means over layers, and layer 1's own)
CURVE = ["loss", "grad_norm", "val_loss", "load_balancing_loss", "z_loss", "moe_imbalance", "moe_dropped",
         "load_balancing_loss/layer1", "z_loss/layer1", "moe_imbalance/layer1"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in EP_RUNS if not name.startswith("save")])
def test_train_py_at_ep_2_and_4_follows_one_process(moe_runs, name):
    """train.py with experts over 4 ranks, EP folded out of DP, follows one process
    holding every expert (8 micro-batches a step against 2), to 1e-5 in fp32, each
    step: the LM loss, the gradient norm, the validation loss and what the MoE
    layers log (the load-balancing and z losses, the imbalance of the tokens per
    expert, none dropped). Which proves the experts' gradients are averaged over
    the ranks holding the same experts and the rest over DP (EP 1, 2 and 4), the
    clipping norm counts each expert once, the auxiliary losses take each
    micro-batch's share of the gradient (1/8 against 1/2), the expert bias moves
    on the tokens of all ranks, and the logged figures are the whole batch's:
    with the all-to-all dispatcher and a loop over experts at EP 2 (as EP 2 x
    expert-DP 2), the all-gather one and the grouped GEMM at EP 4 with
    recomputation (whose rerun forwards are not logged twice), compiled at EP 2
    with recomputation, resumed at EP 1, 2 and 4 from a checkpoint saved at EP 2, in both formats,
    and through the pipelined step at EP 1 (rank 0 logs the other stage's layer too). Under tensor
    parallelism (the experts split over TP as the dense MLP, the mixture one f ... g region): TP 2,
    TP 2 + SP with the grouped GEMM (and compiled, the loop), EP 2 x TP 2 + SP (and under Domino), TP 2 + SP x PP 2 (and under Domino and ZB-H1), EP 2 x TP 2 x CP 2; resumed at EP 1 x TP 1 from EP 2 x TP 2
    (+ SP in the torch format, without in torch_dist's), at EP 2 x TP 2 + SP from EP 2. With the experts
    whole on each TP rank (expert TP 1, TP 2 + SP x DP 2; each TP rank routes its own tokens, EP folded
    out of TP x DP): EP 1, EP 2 over the TP pair (and under Domino, and compiled), EP 4 with the all-gather dispatcher and
    the grouped GEMM, so the experts' gradients summed over TP too, the router's over TP, the clipping
    norm counting each expert once, the expert bias and the figures over every rank; resumed from EP 2
    there at expert TP 2 (EP 2 x TP 2 + SP) and at EP 1 x TP 1, in both formats."""
    runs, _, _ = moe_runs
    one, got = {m["iteration"]: m for m in runs["one"]}, runs[name]
    assert [m["iteration"] for m in got] == ([3, 4] if name.startswith("resume") else [1, 2, 3, 4])
    for m in got:
        want = one[m["iteration"]]
        assert set(m) >= {k for k in CURVE if k != "val_loss"} and ("val_loss" in m) == ("val_loss" in want)
        for key in (k for k in CURVE if k in want):
            assert m[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (name, m["iteration"], key)
    assert runs["one"][-1]["loss"] < runs["one"][0]["loss"] - 0.1  # it trained


@pytest.mark.slow
def test_a_resume_at_the_same_ep_is_bit_identical_and_compiled_ep_breaks_no_graph(moe_runs):
    """A run saved at EP 2 and resumed at EP 2 takes the uninterrupted run's steps
    bit for bit, from either checkpoint format; train.py --compile at EP 2 (the
    all-to-all's split sizes, the tokens per expert: data-dependent), with
    recomputation (the figures recorded in a recomputed block), makes its graphs
    with no graph break; so do TP 2 + SP (the mixture's gather and reduce-scatter)
    and EP 2 at expert TP 1 (the aux losses' sums over TP).
    The same resume at expert TP 1 (EP 2 over TP 2 + SP, x DP 2), whose torch_dist
    checkpoint holds each tensor's bytes once: the experts, replicated over the
    expert-DP ranks (and the rest over DP), are written by one rank each."""
    runs, counters, out = moe_runs
    for fmt, (uninterrupted, resumed) in itertools.product(("torch", "torch_dist"), (
            ("ep2", "resume-{}-ep2"), ("etp1-ep2", "resume-etp1-{}-same"))):
        resumed = resumed.format(fmt)
        assert len(runs[resumed]) == 2 and runs[resumed] == [
            {**m, "tokens_per_sec": r["tokens_per_sec"]} for m, r in zip(runs[uninterrupted][2:], runs[resumed])]
    saved = os.path.join(out, "etp1-torch_dist", "iter_0000002")
    index = checkpoint.read_dist_metadata(saved).storage_data
    assert sum(place.length for place in index.values()) == \
        sum(os.path.getsize(f) for f in glob.glob(os.path.join(saved, "*.distcp")))
    for compiled in (counters["ep2-compiled-recompute"], counters["tp2-sp-compiled"], counters["etp1-ep2-compiled"]):
        assert compiled["graphs"] >= 1 and compiled["graph_breaks"] == 0, counters
    assert counters["ep2"]["graphs"] == 0


@pytest.mark.quick
def test_the_moe_flags_reach_the_model_and_moe_layer_freq_reads_megatrons_patterns():
    """Every GPTConfig MoE field is the flag of its name (Megatron's), and
    --qk-layernorm; --moe-layer-freq takes an interval or Megatron's pattern,
    a Python expression of 0/1 lists, + and *, read without running it. A
    resume whose routing differs from its checkpoint's is refused in one line."""
    args = ["--preset", "tiny", "--num-layers", "8", "--qk-layernorm", "--num-experts", "4",
            "--moe-layer-freq", "([1]*3+[0])*2", "--moe-ffn-hidden-size", "48", "--moe-router-topk", "1",
            "--moe-router-pre-softmax", "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate",
            "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01",
            "--moe-z-loss-coeff", "0.001", "--moe-expert-capacity-factor", "1.5", "--moe-token-drop-policy",
            "position", "--moe-pad-expert-input-to-capacity", "--moe-grouped-gemm",
            "--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", "2"]
    cfg = config.parse_args(args)
    mcfg = config.model_config(cfg)
    assert (mcfg.qk_layernorm, mcfg.num_experts, mcfg.moe_layer_freq, cfg.expert_model_parallel_size) == \
        (True, 4, [1, 1, 1, 0, 1, 1, 1, 0], 2)
    moe_fields = [name for name in gpt.GPTConfig.__dataclass_fields__ if name.startswith("moe_")]
    assert all(getattr(mcfg, name) == getattr(cfg, name) != getattr(gpt.GPTConfig(), name) for name in moe_fields
               if name not in ("moe_router_score_function", "moe_router_enable_expert_bias",
                               "moe_router_bias_update_rate", "moe_layer_freq"))
    sigmoid = config.model_config(config.parse_args(["--preset", "tiny", "--num-experts", "4", "--moe-layer-freq", "2",
                                                     "--moe-router-score-function", "sigmoid",
                                                     "--moe-router-enable-expert-bias",
                                                     "--moe-router-bias-update-rate", "0.1"]))
    assert (sigmoid.moe_layer_freq, sigmoid.moe_router_score_function, sigmoid.moe_router_enable_expert_bias,
            sigmoid.moe_router_bias_update_rate) == (2, "sigmoid", True, 0.1)
    assert config.model_config(config.parse_args(["--preset", "tiny"])).num_experts is None  # dense by default
    top2 = config.parse_args([("2" if a == "1" and args[i - 1] == "--moe-router-topk" else a) for i, a in enumerate(args)])
    with pytest.raises(UsageError, match=r"CKPT is another model: moe_router_topk 1 \(this run: 2\)"):
        checkpoint.check_same_model(top2, dataclasses.asdict(mcfg), "CKPT")  # a resume of another routing
    assert [config.layer_pattern(text) for text in ("[1,0]*2", "[0]+[1]*3", "3")] == [[1, 0, 1, 0], [0, 1, 1, 1], 3]


@pytest.mark.quick
@pytest.mark.parametrize("flags, message", [
    (["--moe-router-topk", "1"], "--moe-router-topk needs --num-experts"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size needs --num-experts"),
    (["--num-experts", "4", "--moe-layer-freq", "__import__('os').getcwd()"], "--moe-layer-freq"),
    (["--num-experts", "4", "--moe-layer-freq", "[1]*10**9"], "--moe-layer-freq"),
    (["--num-experts", "4", "--moe-layer-freq", "[[1], [0]]"], "--moe-layer-freq"),
    (["--num-experts", "4", "--deepspeed", "--zero-stage", "3"], "--num-experts with --deepspeed --zero-stage 3"),
    (["--num-experts", "4", "--expert-model-parallel-size", "2", "--deepspeed", "--zero-stage", "0", "--bf16"],
     "--expert-model-parallel-size > 1 with --deepspeed --zero-stage 0 and --bf16/--fp16"),
    (["--num-experts", "4", "--moe-grouped-gemm", "--compile"], "--compile with --moe-grouped-gemm needs --bf16"),
    (["--expert-tensor-parallel-size", "1"], "--expert-tensor-parallel-size needs --num-experts"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"],
     "--expert-tensor-parallel-size 1 at --tensor-model-parallel-size 2 needs --sequence-parallel"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "4", "--sequence-parallel",
      "--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size 2: each expert is split over the "
     "tensor-parallel ranks as the dense MLP, or whole on each, so it must be 1 or --tensor-model-parallel-size (4)"),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "2"], "must be 1 or --tensor-model-parallel-size (1)"),
    (["--num-experts", "4", *ETP1, "--deepspeed"], "--expert-tensor-parallel-size 1 with "
     "--tensor-model-parallel-size > 1 does not run under --deepspeed yet"),
])
def test_a_moe_flag_mistake_is_one_line(flags, message):
    with pytest.raises(UsageError) as error:
        config.parse_args(["--preset", "tiny", *flags])
    assert message in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(UsageError, match="--moe-layer-freq must be an int >= 1 or a list of 2 zeros and ones"):
        config.model_config(config.parse_args(["--preset", "tiny", "--num-experts", "4", "--moe-layer-freq", "[1]*3"]))


@pytest.mark.quick
def test_the_model_summary_counts_total_and_active_parameters():
    """gpt.count_parameters is the model's parameter count, MoE layers, shared
    experts and qk norms included; active counts k of E experts (those a token
    runs), and the FLOPs per token (MFU's) are those of the active parameters."""
    for options in (dict(), dict(moe_layer_freq=[0, 1], swiglu=True, disable_bias_linear=True, qk_layernorm=True,
                                 moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True)):
        config = moe_config(**options)
        model = gpt.GPT(config)
        total = sum(p.numel() for p in model.parameters())
        one_expert = sum(p[0].numel() for p in model.blocks[1].mlp.experts.parameters())
        assert gpt.count_parameters(config) == total
        assert gpt.count_parameters(config, active=True) == total - (8 - 2) * one_expert * sum(
            gpt.is_moe_layer(config, i) for i in range(2))
    dense_like = tiny(ffn_hidden_size=2 * 32, disable_bias_linear=True)  # the MLP of 2 experts of 32
    assert gpt.flops_per_token(moe_config(disable_bias_linear=True), 32) - gpt.flops_per_token(dense_like, 32) == \
        6 * 2 * 64 * 8  # and the 2 routers


def test_a_forward_is_recorded_once_under_recomputation_and_the_figures_read_as_logged():
    """A training forward records its figures once, also where activation
    recomputation reruns it in backward; train_ops.moe_figures reads them (and
    clears them): each loss's mean over the forwards, the tokens per expert's max
    over mean, the share of choices dropped over capacity; per layer and averaged."""
    model = tiny_model(num_experts=8, moe_ffn_hidden_size=32, activation_checkpointing=True,
                       moe_aux_loss_coeff=0.1, moe_expert_capacity_factor=0.5)
    for seed in (1, 2):
        model(tokens(seed=seed), labels=tokens(seed=seed + 10)).backward()
    layer = model.blocks[1].mlp
    assert layer.stats["forwards"] == 2 and layer.stats["tokens"].sum() == 2 * 32 * 2
    stats = {i: {k: v.clone() for k, v in model.blocks[i].mlp.stats.items()} for i in (0, 1)}
    figures = train_ops.moe_figures({i: model.blocks[i].mlp for i in (0, 1)})
    for i, s in stats.items():
        assert figures[f"load_balancing_loss/layer{i}"] == pytest.approx(s["load_balancing_loss"].item() / 2)
        assert figures[f"moe_imbalance/layer{i}"] == pytest.approx((s["tokens"].max() / s["tokens"].mean()).item())
        assert figures[f"moe_dropped/layer{i}"] == pytest.approx(s["dropped"].item() / 128) and s["dropped"] > 0
    assert figures["moe_dropped"] == pytest.approx((figures["moe_dropped/layer0"] + figures["moe_dropped/layer1"]) / 2)
    assert not layer.stats  # read
    with torch.no_grad():
        model(tokens())
    assert not layer.stats  # evaluation records nothing


def test_the_reported_losses_are_the_lm_loss_alone_and_the_aux_losses_join_backward(ids_corpus, tmp_path):
    """At --lr 0 the model never changes: with the auxiliary losses on (and
    their coefficients large) the logged loss and validation loss are those
    without them, bit for bit, while the gradient norm shows the auxiliary
    losses in backward, and their values are logged on their own."""
    common = [*MOE_RUN, "--data-path", ids_corpus, "--train-iters", "2", "--eval-interval", "1", "--lr", "0",
              "--min-lr", "0", "--global-batch-size", "4", "--moe-router-score-function", "softmax"]
    common = [f for i, f in enumerate(common) if "bias" not in f and "bias" not in common[i - 1]]  # no expert bias
    rows = {}
    for coeff in ("0", "1"):
        train.main([*common, "--moe-aux-loss-coeff", coeff, "--moe-z-loss-coeff", coeff,
                    "--metrics-file", str(tmp_path / f"{coeff}.jsonl")])
        rows[coeff] = read_metrics(tmp_path / f"{coeff}.jsonl")
    for without, with_aux in zip(rows["0"], rows["1"], strict=True):
        assert (without["loss"], without["val_loss"]) == (with_aux["loss"], with_aux["val_loss"])
        assert with_aux["grad_norm"] > 1.01 * without["grad_norm"]
        assert "z_loss" not in without and with_aux["z_loss"] > 0 and with_aux["load_balancing_loss"] >= 1


# Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh (its main at
# d98e8a6), every argument as pasted but: the sizes scaled down (layers, hidden, heads
# and query groups 4:1 as Mixtral's, ffn 3.5 x hidden, sequence, global batch, EP 8 -> 2,
# and the iteration counts: 10 steps, decay over 8, warm-up 1, save and evaluate at 5
# and 10), its layout DP x EP (its --pipeline-model-parallel-size 4 at 1: PP with experts
# has tests of its own), its data ours (NullTokenizer ids), and these not taken, each
# refused in one line: --use-distributed-optimizer (ZeRO-1 is --deepspeed, refused with experts),
# --sequence-parallel (needs TP > 1; Megatron turns it off at TP 1), --tokenizer-type
# Llama2Tokenizer and --tokenizer-model (GPT-2's BPE or ids only).
MIXTRAL_RECIPE = """
    --use-mcore-models --disable-bias-linear --seq-length 64 --max-position-embeddings 32768 --num-layers 2
    --hidden-size 128 --ffn-hidden-size 448 --num-attention-heads 8 --init-method-std 0.01 --attention-dropout 0.0
    --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
    --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 --no-masked-softmax-fusion
    --no-position-embedding --rotary-base 1000000
    --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
    --split 99990,8,2
    --micro-batch-size 1 --global-batch-size 8 --lr 1e-4 --train-iters 10 --lr-decay-iters 8
    --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 1 --clip-grad 1.0 --bf16
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 2
    --log-interval 1 --save-interval 5 --eval-interval 5 --eval-iters 10 --no-load-optim --no-load-rng
""".split()


@pytest.mark.slow
def test_megatrons_mixtral_recipe_as_pasted_trains_logs_the_experts_and_its_checkpoint_samples(tmp_path):
    """Megatron-LM's Mixtral example trains as written under torchrun at EP 2,
    bf16: its loss and validation loss finite, the loss falling (lr 1e-4). The
    run opens with its total and active parameters and its EP (the flags of
    Megatron's own kernels named in one line); each log line carries the MoE
    layers' means (the load-balancing loss, the imbalance, the dropped share),
    each layer's are in the metrics file and TensorBoard. Its closing sample is
    generated at EP 2, and its checkpoint (experts gathered from both EP ranks)
    samples in one process with eval_tasks.py, greedy with the KV cache as without."""
    data = write_zipf_corpus(str(tmp_path / "ids_text_document"), documents=15000)  # --split's 8e-5: 1 valid document
    ckpt, metrics = str(tmp_path / "ckpt"), tmp_path / "m.jsonl"
    proc = torchrun("train.py", *MIXTRAL_RECIPE, "--data-path", data, *IDS, "--save", ckpt, "--load", ckpt,
                    "--tensorboard-dir", f"{ckpt}/tensorboard", "--metrics-file", str(metrics), "--sample-tokens", "4",
                    nproc=2, timeout=600)
    mcfg = config.model_config(config.parse_args([*MIXTRAL_RECIPE, *IDS]))
    total, active = gpt.count_parameters(mcfg), gpt.count_parameters(mcfg, active=True)
    assert f"model: {total:,} parameters ({active:,} active) | world 2 = TP 1 x DP 2 (EP 2) x PP 1" in proc.stdout
    assert "--use-mcore-models, --no-masked-softmax-fusion, --overlap-param-gather, --overlap-grad-reduce: " \
           "no effect here" in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("iter ")]
    assert len(lines) == 10 and all("load_balancing_loss" in line and "moe_imbalance" in line and
                                    "moe_dropped 0" in line for line in lines), proc.stdout
    rows = read_metrics(metrics)
    losses = [row["loss"] for row in rows]
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.02, losses  # it learns
    assert [row["iteration"] for row in rows if "val_loss" in row] == [5, 10]
    assert all(math.isfinite(row["val_loss"]) for row in rows if "val_loss" in row)
    per_layer = {f"{name}/layer{i}" for name in ("load_balancing_loss", "moe_imbalance", "moe_dropped") for i in (0, 1)}
    assert all(set(row) >= per_layer and row["moe_imbalance"] >= 1 for row in rows)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(f"{ckpt}/tensorboard")
    events.Reload()
    assert {f"train/{key}" for key in per_layer} <= set(events.Tags()["scalars"])
    assert "-" * 40 + " sample " in proc.stdout
    out = tmp_path / "samples.jsonl"
    eval_tasks.main(["--task", "GENERATE", "--load", ckpt, *IDS, "--num-samples", "1", "--out-seq-length", "12",
                     "--temperature", "0", "--sample-output-file", str(out)])
    sample = read_metrics(out)[0]["tokens"]
    model, _ = checkpoint.saved_model(checkpoint.verified_checkpoint(ckpt, print))
    assert model.blocks[0].mlp.experts.fc.shape[0] == 8
    uncached = gpt.generate(model, torch.tensor([[VOCAB]]), 12, temperature=0, use_cache=False)[0, 1:].tolist()
    assert sample == uncached[:len(sample)] and len(sample) > 0


@pytest.mark.slow
def test_a_layout_the_experts_cannot_take_is_one_line_from_rank_0(ids_corpus):
    """A mistake found once the ranks have started (building the experts over 2
    EP ranks; EP 4 folded out of TP 2 at expert TP 1): one line from rank 0, no traceback."""
    for flags, error in ((["--num-experts", "3", "--expert-model-parallel-size", "2"],
                          "--num-experts 3 must be divisible by --expert-model-parallel-size 2"),
                         ([*ETP1, "--expert-model-parallel-size", "4"], "--expert-model-parallel-size 4 must divide "
                          "tensor x data x context parallel size (--expert-tensor-parallel-size 1) 2")):
        proc = torchrun("train.py", *MOE_RUN, "--data-path", ids_corpus, *flags, "--train-iters", "1", nproc=2,
                        check=False)
        assert proc.returncode != 0 and proc.stderr.count("train.py: error") == 1, proc.stderr[-3000:]
        assert f"train.py: error: {error}" in proc.stderr
        assert 'train.py", line' not in proc.stderr


def test_the_aux_losses_gradient_carries_the_fp16_loss_scale(single_rank):
    """Under --fp16 backward starts from the loss times the loss scale (2^16):
    the auxiliary losses join it with the same factor (train_step hands the
    engine's scale to gpt.set_aux_loss_scale), so once unscaled the step's
    gradients are fp32's. (Both forwards run in fp32 here: the scale alone differs.)"""
    g = torch.Generator().manual_seed(0)
    batches = [{"tokens": torch.randint(0, VOCAB, (2, 16), generator=g), "loss_mask": torch.ones(2, 16),
                "labels": torch.randint(0, VOCAB, (2, 16), generator=g), "position_ids": torch.arange(16).expand(2, 16)}
               for _ in range(2)]
    norms = []
    for precision in ([], ["--fp16"]):
        cfg = config.parse_args(["--preset", "tiny", *IDS, "--num-experts", "8", "--moe-aux-loss-coeff", "1",
                                 "--moe-z-loss-coeff", "0.1", "--lr", "0", *precision])
        trainer = train.PlainTraining(cfg, process_env())
        trainer.precision = contextlib.nullcontext()
        norms.append(float(train.train_step(trainer, batches, 0.0)[1]))
    assert norms[1] == pytest.approx(norms[0], rel=1e-6)


# -----------------------------------------------------------------------------
# Tensor parallelism (expert TP = TP): the experts split as the dense MLP, the
# whole mixture one f ... g region (under SP: gather ... reduce-scatter)


TP_CASES = [  # SwiGLU, no biases, a gated shared expert, both losses per sequence; GELU with biases, grouped, capacity
    dict(swiglu=True, disable_bias_linear=True, moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True,
         moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01),
    dict(moe_grouped_gemm=True, moe_aux_loss_coeff=0.1, moe_expert_capacity_factor=1.0),
    dict(moe_layer_freq=[1, 0], moe_aux_loss_coeff=0.1),  # experts, then a dense MLP
]
# (TP, SP, EP, Domino's chunks, expert TP) on 4 ranks; expert TP 1: the experts whole on each TP rank,
# EP folded out of TP x DP
TP_LAYOUTS = [(2, False, 1, 1, 2), (2, True, 1, 1, 2), (2, True, 2, 1, 2), (2, False, 2, 1, 2), (2, False, 1, 2, 2),
              (2, True, 2, 2, 2), (2, True, 1, 1, 1), (2, True, 2, 1, 1), (2, True, 4, 1, 1), (2, True, 2, 2, 1)]


def _model_loss_and_grads(options, sp=False, domino=1):
    """A tiny MoE GPT at this process's layout, one forward and backward of the same
    tokens on every rank -> (loss, {name: the full gradient, as one process holds it})."""
    config = moe_config(hidden_dropout=0.0, attention_dropout=0.0, sequence_parallel=sp, domino_chunks=domino,
                        **options)
    torch.manual_seed(0)
    model = gpt.GPT(config)
    loss = model(tokens(B=2, T=16, seed=3), labels=tokens(B=2, T=16, seed=4))
    loss.backward()
    expert_parallel.reduce_expert_grads(model)  # the experts' averages over DP; the others' as DDP takes them
    lay = parallel.layout
    return loss.detach(), {n: parallel.gather_like(p, p.grad if parallel.averaged_apart(p) else
                                                   parallel.all_reduce_mean(p.grad, lay.dp_cp_group))
                           for n, p in model.named_parameters()}


def _check_tensor_parallel_is_one_process():
    parallel.initialize(1)
    want = [_model_loss_and_grads(options) for options in TP_CASES]
    for tp, sp, ep, domino, etp in TP_LAYOUTS:
        parallel.destroy()
        parallel.initialize(tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        for options, (loss, grads) in zip(TP_CASES, want):
            if etp == 1 and "moe_expert_capacity_factor" in options:  # each TP rank drops from its own tokens
                continue
            got_loss, got = _model_loss_and_grads(options, sp, domino)
            case = f"TP={tp} SP={sp} EP={ep} Domino={domino} ETP={etp} {options}"
            torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-6, msg=case)
            for name, grad in grads.items():
                torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=f"{case}: {name}")


def _ddp_takes_the_experts_at_ep_1_only():
    for ep in (1, 2):
        parallel.destroy()
        parallel.initialize(1, expert_model_parallel_size=ep)
        cfg = config.parse_args(["--preset", "tiny", *IDS, "--num-experts", "4", "--expert-model-parallel-size",
                                 str(ep)])
        trainer = train.PlainTraining(cfg, process_env())
        experts = {n for n, _ in trainer.raw.named_parameters() if ".experts." in n}  # 2 layers x 4
        assert len(experts) == 8 and trainer.model.parameters_to_ignore == (experts if ep > 1 else set()), \
            (ep, experts, trainer.model.parameters_to_ignore)


@pytest.mark.slow
def test_ddp_averages_the_experts_at_ep_1_and_leaves_them_to_their_holders_at_ep_2():
    """On 2 data-parallel ranks at EP 1 every rank holds every expert: DDP averages the
    experts' gradients with the rest (bucketed, overlapped with backward); at EP 2 they
    leave DDP for expert_parallel.reduce_expert_grads, over the ranks holding the same
    experts. (The curves at either EP: test_train_py_at_ep_2_and_4_follows_one_process.)"""
    run_on_ranks(_ddp_takes_the_experts_at_ep_1_only, world_size=2)


@pytest.mark.slow
def test_tensor_parallel_experts_give_one_processs_loss_and_gradients():
    """On 4 ranks, TP 2 (x DP 2), TP 2 + SP, and EP 2 x TP 2 with and without SP
    give one process's loss and every parameter's full gradient, to 1e-5 in fp32:
    the experts split as the dense MLP (fc by columns, proj by rows, the proj bias
    a 1/tp share a rank), the router and the capacity on every token of the TP
    group, the aux losses a 1/tp share of the gradient a rank, the router's summed
    over TP; a gated shared expert (a dense MLP beside them), SwiGLU, capacity, the
    loop and the grouped GEMM. Under Domino (2 chunks, TP 2, and EP 2 x TP 2 + SP) the
    chunks rejoin for each mixture: the aux loss and capacity over the micro-batch, as
    without Domino; every layer MoE, or experts then a dense MLP (overlapped again).
    With the experts whole on each TP rank (expert TP 1, under SP) at EP 1, 2 (over TP)
    and 4 (over TP x DP), and EP 2 under Domino, no capacity (each TP rank routes its own
    tokens): the same, the aux losses' sums (aux_loss and seq_aux_loss) over the TP group,
    the router's gradient summed over TP, the experts' over TP x DP."""
    run_on_ranks(_check_tensor_parallel_is_one_process, world_size=4)
