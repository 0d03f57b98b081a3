"""Pipeline parallelism (pipeline.py): the schedules as pure functions,
stages on 2 gloo ranks against the whole model on one, then train.py's
pipelined runs from the command line, against PP=1's."""
import inspect
import json
import os
import re
import shutil
import sys
import time
import weakref
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import checkpoint
import parallel
import pipeline
from conftest import (IDS, TINY, process_env, read_metrics, run_bounded, run_on_ranks, run_train, torchrun,
                      train_on_ranks, uneven_batch)
from gpt import GPT, GPTConfig
from launch import UsageError


def assert_close(actual, expected, tol=1e-6, what=""):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.quick
def test_pipeline_stages_hold_consecutive_layers_and_virtual_stages_go_round():
    assert pipeline.pipeline_chunks(8, 2, 1) == [range(4, 8)]
    # interleaved: chunk c of rank r is virtual stage c * pp + r
    assert pipeline.pipeline_chunks(8, 2, 1, layers_per_virtual_stage=2) == [range(2, 4), range(6, 8)]
    with pytest.raises(UsageError, match="--pipeline-model-parallel-size 4 must divide --num-layers 6"):
        pipeline.pipeline_chunks(6, 4, 0)
    with pytest.raises(UsageError, match="--num-layers-per-virtual-pipeline-stage 3 x "
                                                  "--pipeline-model-parallel-size 2 must divide --num-layers 8"):
        pipeline.pipeline_chunks(8, 2, 0, layers_per_virtual_stage=3)


@pytest.mark.quick
@pytest.mark.parametrize("pp,m,v,zb", [(2, 8, 1, False), (2, 8, 2, False), (4, 8, 1, False), (4, 8, 2, False),
                                       (2, 8, 1, True), (4, 8, 1, True)])
def test_run_pipelines_coupling_idles_as_the_schedules_formula(pp, m, v, zb):
    """Actions of the tick clock's lengths (a forward 1, a backward 2) run
    through run_pipeline's exchanges (bench_pipeline.replay models them)
    idle (pp-1)/(v*m+pp-1) of the step on every rank. Interleaved at pp=2
    idled 0.238, not 0.059, while a rank inside a backward held up the
    neighbour sending to it until the backward ended; it now posts that
    receive before the backward starts. ZB-H1 (zb): (pp-1)/(3m+pp-1)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from bench_pipeline import replay
    ticks = pipeline.pipeline_timeline(pp, m, v, zero_bubble=zb)
    clock = [[(t, t, t + pipeline.DURATION[row[r].kind]) for t, row in enumerate(ticks) if row[r]] for r in range(pp)]
    for bubble in replay(clock, m, v, zero_bubble=zb):
        assert bubble == pytest.approx((pp - 1) / (3 * m + pp - 1) if zb else (pp - 1) / (v * m + pp - 1))


@pytest.mark.quick
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 4)])
def test_1f1b_warms_up_with_pp_minus_1_minus_rank_forwards_then_alternates(pp, m):
    for rank in range(pp):
        kinds = "".join(a.kind for a in pipeline.rank_order(pp, rank, m))
        warmup = pp - 1 - rank
        assert kinds == "F" * warmup + "FB" * (m - warmup) + "B" * warmup
        assert [a.micro for a in pipeline.rank_order(pp, rank, m) if a.kind == "B"] == list(range(m))


@pytest.mark.quick
@pytest.mark.parametrize("pp,m,v", [(2, 4, 1), (4, 8, 1), (4, 4, 1), (2, 4, 2), (4, 8, 2), (4, 8, 3)])
def test_bubble_of_the_schedule_is_narayanan_et_al_s(pp, m, v):
    """Idle ticks / all ticks: (pp-1)/(m+pp-1), and interleaved (pp-1)/(v*m+pp-1)."""
    ticks = pipeline.pipeline_timeline(pp, m, v)
    busy = sum(pipeline.DURATION[a.kind] for row in ticks for a in row if a)  # a backward: 2 ticks
    assert 1 - busy / (len(ticks) * pp) == pytest.approx((pp - 1) / (v * m + pp - 1))
    for rank in range(pp):  # every forward and backward of every chunk, once
        done = [row[rank] for row in ticks if row[rank] is not None]
        assert sorted(done) == sorted(pipeline.Action(k, c, i) for k in "FB" for c in range(v) for i in range(m))


@pytest.mark.quick
@pytest.mark.parametrize("pp,m", [(4, 8), (2, 8), (2, 4), (4, 4), (3, 5)])
def test_zb_h1_idles_pp_minus_1_ticks_a_stage_a_third_of_1f1b(pp, m):
    """ZB-H1 on the same clock, F, I and W a tick each (1F1B's backward, I+W,
    two): every stage idles pp-1 of 3m+pp-1 ticks, against 1F1B's 3(pp-1)
    of 3m+3(pp-1). At pp=4, m=8: 3/27 = 0.111 against 9/33 = 0.273."""
    ticks = pipeline.pipeline_timeline(pp, m, zero_bubble=True)
    assert len(ticks) == 3 * m + pp - 1
    for rank in range(pp):
        done = [row[rank] for row in ticks if row[rank] is not None]
        assert sum(pipeline.DURATION[a.kind] for a in done) == len(ticks) - (pp - 1)  # pp-1 idle ticks
        assert sorted(done) == sorted(pipeline.Action(k, 0, i) for k in "FIW" for i in range(m))
        kinds = "".join(a.kind for a in done)  # the forwards and input gradients in 1F1B's order
        warmup = pp - 1 - rank
        assert kinds.replace("W", "") == "F" * warmup + "FI" * (m - warmup) + "I" * warmup
    one_f_one_b = pipeline.pipeline_timeline(pp, m)
    assert len(one_f_one_b) == 3 * m + 3 * (pp - 1)
    if (pp, m) == (4, 8):
        assert (len(ticks), len(one_f_one_b)) == (27, 33)  # idle 3/27 = 0.111 vs 9/33 = 0.273


@pytest.mark.quick
def test_the_charts_pipeline_py_draws_are_the_schedules_it_runs():
    """pipeline.py's comments draw 1F1B (pp=4, m=8), interleaved 1F1B (pp=2,
    v=2, m=4) and ZB-H1 (pp=4, m=8), in that order; each is, character for
    character, chart() of pipeline_timeline, which run_pipeline walks tick by
    tick: the text and the code agree."""
    drawn = re.findall(r"(?:^#     stage \d+  \S+\n)+", inspect.getsource(pipeline), re.M)
    drawn = [block.replace("#     ", "").rstrip("\n") for block in drawn]
    assert drawn == [pipeline.chart(pipeline.pipeline_timeline(4, 8)),
                     pipeline.chart(pipeline.pipeline_timeline(2, 4, 2)),
                     pipeline.chart(pipeline.pipeline_timeline(4, 8, zero_bubble=True))]
    # the chart's idle ticks ('.') are the bubble: 9 of 33 a 1F1B stage, 3 of 27 a ZB-H1 stage
    assert [row.count(".") for row in drawn[0].splitlines()] == [9] * 4
    assert [row.count(".") for row in drawn[2].splitlines()] == [3] * 4


@pytest.mark.quick
def test_too_few_micro_batches_for_the_pipeline_name_the_flags():
    with pytest.raises(UsageError, match="1 micro-batch.*cannot fill 2 pipeline stages.*--global-batch-size"):
        pipeline.check_micro_batches(1, 2, 1)
    with pytest.raises(UsageError, match="groups of --pipeline-model-parallel-size 2: 3 micro-batches"):
        pipeline.check_micro_batches(3, 2, 2)
    pipeline.check_micro_batches(3, 2, 1)  # plain 1F1B takes any m >= pp
    # (ZB-H1 refuses interleaving in config.validate_pipeline: tests/test_config.py)


class _Saved:
    """A tensor saved for backward, freed with its autograd graph."""
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


class _InFlight:
    """Saved-tensor hooks that count, at every save, the micro-batches whose
    saved activations are still alive (they are freed after their backward)."""

    def __init__(self):
        self.alive, self.micro, self.peak = {}, None, 0

    def pack(self, t):
        self.alive[self.micro] = self.alive.get(self.micro, 0) + 1
        self.peak = max(self.peak, sum(1 for n in self.alive.values() if n))
        saved = _Saved(t)
        weakref.finalize(saved, self._free, self.micro)
        return saved

    def _free(self, micro):
        self.alive[micro] -= 1


def _check_pipeline_stage_pair_matches_the_whole_model(v: int, recompute: bool, zb: bool = False):
    m, pp, rank = 4, 2, dist.get_rank()
    shape = dict(num_layers=4, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
                 vocab_size=100, padded_vocab_size=128, activation_checkpointing=recompute)
    batches = []
    for i in range(m):
        x, y, mask = uneven_batch(i, batch_size=2)
        documents = torch.tensor([0] * (i + 2) + [i + 2] * (6 - i)).expand(2, 8)  # two, as --reset-attention-mask
        batches.append({"tokens": x, "labels": y, "loss_mask": mask,
                        "position_ids": torch.arange(8).expand(2, 8), "document_ids": documents})
    cfg = SimpleNamespace(bf16=False, fp16=False, compile=False, seq_length=8, micro_batch_size=2,
                          enable_zero_bubble=zb)
    # the whole model, one process: micro-batches accumulated in turn
    parallel.destroy()
    parallel.initialize(1)
    torch.manual_seed(0)
    whole = GPT(GPTConfig(**shape))
    want_loss = torch.zeros(())
    for batch in batches:
        loss = whole(batch["tokens"], batch["position_ids"], batch["labels"], batch["loss_mask"],
                     document_ids=batch["document_ids"]) / m
        loss.backward()
        want_loss += loss.detach()
    # two stages: each builds the same model and keeps its layers
    parallel.destroy()
    parallel.initialize(1, pipeline_model_parallel_size=pp)
    torch.manual_seed(0)
    stage = pipeline.stage_model(GPTConfig(**shape), pipeline.pipeline_chunks(4, pp, rank, 1 if v == 2 else None))
    in_flight, calls, timeline = _InFlight(), iter(range(100)), []
    runner = pipeline.Stage(stage)
    forward = runner.forward

    def counted(chunk, *args):
        in_flight.micro = next(calls) if chunk == 0 else in_flight.micro
        return forward(chunk, *args)
    run_pipeline, weight_grads, deferred = pipeline.run_pipeline, pipeline.weight_grads, []
    runner.forward = counted
    pipeline.run_pipeline = lambda *a, **k: run_pipeline(*a, **k, timeline=timeline)
    pipeline.weight_grads = lambda store: (deferred.append(len(store)), weight_grads(store))[1]
    try:
        with torch.autograd.graph.saved_tensors_hooks(in_flight.pack, lambda saved: saved.t):
            loss = pipeline.pipeline_step(runner, batches, cfg, torch.device("cpu"), nullcontext())
    finally:
        pipeline.run_pipeline = run_pipeline
        pipeline.weight_grads = weight_grads
    pipeline.reduce_pipeline_grads(stage)
    assert_close(loss, want_loss, tol=1e-6, what="loss")
    wanted = dict(whole.named_parameters())
    for name, p in stage.named_parameters():
        assert_close(p.grad, wanted[name].grad, tol=1e-5, what=f"grad of {name}")
    # the schedule ran as drawn, and stage s held at most pp-s micro-batches' saved
    # activations (ZB-H1 as 1F1B; its W's inputs, beyond, are in bench_pipeline's table)
    ticks = pipeline.pipeline_timeline(pp, m, v, zero_bubble=zb)
    assert [(t, a) for t, a, _, _ in timeline] == [(t, row[rank]) for t, row in enumerate(ticks) if row[rank]]
    if v == 1:
        assert in_flight.peak == pp - rank, in_flight.peak
    # ZB-H1: each W computed the dW of its micro-batch's 2 blocks x 4 linears (none, 1F1B)
    assert deferred == ([2 * 4] * m if zb else []), deferred


@pytest.mark.quick
@pytest.mark.parametrize("v,recompute,zb", [(1, False, False), (2, False, False), (1, True, False),
                                            (1, False, True), (1, True, True)],
                         ids=["1F1B", "interleaved", "1F1B-recompute", "ZB-H1", "ZB-H1-recompute"])
def test_pipeline_stage_pair_matches_the_whole_model(v, recompute, zb):
    run_on_ranks(_check_pipeline_stage_pair_matches_the_whole_model, v, recompute, zb)


def _check_zb_h1_takes_1f1bs_gradients_in_16_bit(dtype):
    m, pp = 4, 2
    parallel.destroy()
    parallel.initialize(1, pipeline_model_parallel_size=pp)
    torch.manual_seed(0)
    config = GPTConfig(num_layers=4, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
                       vocab_size=100, padded_vocab_size=128, hidden_dropout=0.1, attention_dropout=0.1)
    stage = pipeline.stage_model(config, pipeline.pipeline_chunks(4, pp, parallel.layout.pp_rank))
    batches = []
    for i in range(m):
        x, y, mask = uneven_batch(i, batch_size=2)
        batches.append({"tokens": x, "labels": y, "loss_mask": mask, "position_ids": torch.arange(8).expand(2, 8)})
    scale = (lambda loss: loss * 1024.0) if dtype == torch.float16 else None  # --fp16's loss scale
    grads, weight_grads, deferred = [], pipeline.weight_grads, []
    pipeline.weight_grads = lambda store: (deferred.append(len(store)), weight_grads(store))[1]
    try:
        for zb in (False, True):
            cfg = SimpleNamespace(seq_length=8, micro_batch_size=2, enable_zero_bubble=zb)
            torch.manual_seed(1)  # the same dropout masks for both schedules
            pipeline.pipeline_step(pipeline.Stage(stage), batches, cfg, torch.device("cpu"), torch.autocast("cpu", dtype=dtype), scale)
            grads.append({n: p.grad.clone() for n, p in stage.named_parameters()})
            stage.zero_grad(set_to_none=True)
    finally:
        pipeline.weight_grads = weight_grads
    assert deferred == [2 * 4] * m  # ZB-H1's W ran, with each micro-batch's 2 blocks x 4 linears
    for name, want in grads[0].items():
        assert torch.equal(grads[1][name], want), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_zb_h1_takes_1f1bs_gradients_in_16_bit_with_dropout(dtype):
    """Under --bf16 / --fp16 autocast (fp16: through a loss scale), with
    dropout, ZB-H1's deferred W computes 1F1B's weight gradients bit for
    bit: dW from the same 16-bit dY and X, returned in the weight's dtype."""
    run_on_ranks(_check_zb_h1_takes_1f1bs_gradients_in_16_bit, dtype)


# Every case ZB-H1's deferral treats apart: a plain F.linear (the mode), a column
# layer's SP GEMM (its own Function: a hook keeps its tokens), a row layer under SP
# (its dY is the reduce-scatter's input, whole), Domino's chunks (each weight twice),
# CP's local tokens, and recomputation in I (the mode re-entered per block; Domino
# refuses it).
ZB_DEFERRALS = {  # name: (tp, cp, sequence_parallel, domino_chunks, recompute)
    "TP=1": (1, 1, False, 1, False), "TP=1, recompute": (1, 1, False, 1, True),
    "TP=2": (2, 1, False, 1, False), "TP=2, SP": (2, 1, True, 1, False),
    "TP=2, SP, recompute": (2, 1, True, 1, True), "TP=2, Domino": (2, 1, False, 2, False),
    "TP=2, SP, Domino": (2, 1, True, 2, False),
    "CP=2": (1, 2, False, 1, False), "CP=2, recompute": (1, 2, False, 1, True),
}


def _check_zb_h1_defers_every_kind_of_linear():
    import context
    m, failed = 2, []
    for name, (tp, cp, sp, chunks, recompute) in ZB_DEFERRALS.items():
        parallel.destroy()
        parallel.initialize(tp, context_parallel_size=cp)
        torch.manual_seed(0)
        model = GPT(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
                              vocab_size=100, padded_vocab_size=128, sequence_parallel=sp, domino_chunks=chunks,
                              activation_checkpointing=recompute))
        batches = []
        for i in range(m):
            x, y, mask = uneven_batch(i, batch_size=2)
            batch = {"tokens": x, "labels": y, "loss_mask": mask, "position_ids": torch.arange(8).expand(2, 8)}
            batches.append(context.split_batch(batch) if cp > 1 else batch)
        grads, weight_grads, deferred = [], pipeline.weight_grads, []
        pipeline.weight_grads = lambda store: (deferred.append(len(store)), weight_grads(store))[1]
        try:
            for zb in (False, True):  # 1F1B's backward, then ZB-H1's I and W, on the same micro-batches
                cfg = SimpleNamespace(seq_length=8, micro_batch_size=2, enable_zero_bubble=zb)
                pipeline.pipeline_step(pipeline.Stage(model), batches, cfg, torch.device("cpu"), nullcontext())
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
                model.zero_grad(set_to_none=True)
        finally:
            pipeline.weight_grads = weight_grads
        # each W took the dW of 2 blocks x 4 linears, of each Domino chunk
        if deferred != [2 * 4 * chunks] * m:
            failed.append(f"{name}: W kept {deferred} operands, not {[2 * 4 * chunks] * m}")
        failed += [f"{name}: {n}" for n, want in grads[0].items()
                   if not torch.allclose(grads[1][n], want, rtol=1e-6, atol=1e-7)]
    assert not failed, failed


@pytest.mark.quick
def test_zb_h1_defers_the_weight_gradient_of_every_kind_of_linear():
    """ZB-H1's W computes autograd's dW for every kind of linear the deferral
    treats apart (ZB_DEFERRALS: TP 1 and 2, SP on and off, Domino on and off,
    recomputation on and off, CP on and off), in one launch of 2 ranks: the
    gradients of one stage's 1F1B backward and of its I + W agree."""
    run_on_ranks(_check_zb_h1_defers_every_kind_of_linear)


def test_a_deferred_weight_gradient_of_the_wrong_shape_names_its_layer():
    """A kept X whose tokens do not match dY's (issue 73: an SP row layer's
    input gathered again) is a programming error named before any matmul."""
    w = torch.nn.Parameter(torch.zeros(4, 8))
    store = [("blocks.0.mlp.proj", w, torch.ones(2, 3, 4), torch.ones(2, 6, 8))]
    with pytest.raises(RuntimeError, match=r"zero bubble: blocks.0.mlp.proj kept dY \(2, 3, 4\) and X \(2, 6, 8\)"):
        pipeline.weight_grads(store)
    assert w.grad is None


def _check_a_receive_due_inside_an_action_is_posted_before_it():
    pp, m, v = 2, 8, 2
    parallel.destroy()
    parallel.initialize(1, pipeline_model_parallel_size=pp)
    rank, last = parallel.layout.pp_rank, pp * v - 1
    w = torch.nn.Linear(4, 4)

    def forward(chunk, micro, x):  # the last virtual stage returns a loss, the others (2, 4)
        y = w(torch.ones(2, 4) if x is None else x)
        return y.sum() if chunk * pp + rank == last else y
    events, real_batch, real_act = [], dist.batch_isend_irecv, pipeline._act

    def batch(ops):
        events.append(("post", sum(op.op is dist.irecv for op in ops), sum(op.op is dist.isend for op in ops)))
        return real_batch(ops)
    dist.batch_isend_irecv = batch
    pipeline._act = lambda a, *args: events.append(("act", a)) or real_act(a, *args)
    try:
        ticks = pipeline.pipeline_timeline(pp, m, v)
        pipeline.run_pipeline(ticks, v, forward, (2, 4), torch.device("cpu"))
    finally:
        dist.batch_isend_irecv, pipeline._act = real_batch, real_act
    ending = {(t + pipeline.DURATION[a.kind] - 1, r): a for t, row in enumerate(ticks) for r, a in enumerate(row) if a}
    to_me = {t for (t, r), a in ending.items() if (pipeline._messages(a, r, pp, v) or (None,))[0] == rank}
    inside = 0
    for t, row in enumerate(ticks):
        a = row[rank]
        due = len(to_me & set(range(t, t + pipeline.DURATION[a.kind] - 1))) if a else 0
        if due:  # posted for just before the action starts, receives only
            assert events[events.index(("act", a)) - 1] == ("post", due, 0), (t, a)
            inside += due
    assert sum(e[1] for e in events if e[0] == "post") == len(to_me)  # each message received once
    assert inside > 0  # the schedule has such messages at pp=2 with interleaving


def test_a_message_due_inside_a_backward_is_received_into_a_buffer_posted_before_it():
    """At pp=2, interleaved, a neighbour's output can arrive while this rank
    runs a backward (two ticks). The receive is posted before the backward
    starts, so the sender goes on instead of waiting for the backward to end."""
    run_on_ranks(_check_a_receive_due_inside_an_action_is_posted_before_it)


def _check_pipeline_stages_share_one_loss_scale():
    """fp16 under PP=2: an inf in a gradient of the last stage alone makes
    both stages skip the step and halve their loss scale, and the two copies
    of the tied embedding (first and last stage) stay bitwise equal."""
    import config
    import train
    cfg = config.parse_args(["--preset", "tiny", "--num-layers", "4", "--clip-grad", "1.0", "--fp16",
                             "--initial-loss-scale", "1024", "--seq-length", "8", "--micro-batch-size", "3",
                             "--pipeline-model-parallel-size", "2"])
    parallel.destroy()
    parallel.initialize(1, pipeline_model_parallel_size=2)
    trainer = train.PlainTraining(cfg, process_env(), print)  # its stage of the model
    model, scaler = trainer.raw, trainer.scaler
    poison = []
    if dist.get_rank() == 1:
        model.get_parameter("blocks.3.mlp.fc.weight").register_post_accumulate_grad_hook(
            lambda p: p.grad.view(-1).__setitem__(0, float("inf")) if poison else None)

    def step(i):
        batches = []
        for j in (2 * i, 2 * i + 1):
            x, y, mask = uneven_batch(j)
            batches.append({"tokens": x, "labels": y, "loss_mask": mask,
                            "position_ids": torch.arange(x.shape[1]).expand_as(x)})
        return train.train_step(trainer, batches, lr=1e-2)

    assert step(0)[2] == 0
    poison.append(True)
    loss, norm, skipped = step(1)
    poison.clear()
    assert skipped == 1 and not torch.isfinite(norm) and torch.isfinite(loss)
    scales = [None, None]
    dist.all_gather_object(scales, scaler.state_dict()["scale"])
    assert scales == [2.0 ** 9] * 2
    assert step(2)[2] == 0
    copies = [torch.empty_like(model.wte.weight) for _ in range(2)]
    dist.all_gather(copies, model.wte.weight.detach())
    assert torch.equal(copies[0], copies[1])


def test_pipeline_stages_share_one_loss_scale():
    run_on_ranks(_check_pipeline_stages_share_one_loss_scale)


def _check_data_parallel_average_starts_as_gradients_become_final():
    pp, m, v = 2, 4, 2
    parallel.destroy()
    parallel.initialize(1, pipeline_model_parallel_size=pp)  # 4 ranks: PP=2 x DP=2
    shape = dict(num_layers=4, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
                 vocab_size=100, padded_vocab_size=128)
    torch.manual_seed(0)
    stage = pipeline.stage_model(GPTConfig(**shape), pipeline.pipeline_chunks(4, pp, parallel.layout.pp_rank, 1))
    cfg = SimpleNamespace(bf16=False, fp16=False, compile=False, seq_length=8, micro_batch_size=2,
                          enable_zero_bubble=False)
    batches = []
    for i in range(m):  # each data-parallel rank its own micro-batches
        x, y, mask = uneven_batch(10 * parallel.layout.dp_rank + i, batch_size=2)
        batches.append({"tokens": x, "labels": y, "loss_mask": mask, "position_ids": torch.arange(8).expand(2, 8)})
    # after the schedule, one blocking all-reduce: the reference gradients
    pipeline.pipeline_step(pipeline.Stage(stage), batches, cfg, torch.device("cpu"), nullcontext())
    pipeline.reduce_pipeline_grads(stage)
    want = {n: p.grad.clone() for n, p in stage.named_parameters()}
    # with an averager whose buckets hold 4 KB: launched as gradients become final
    stage.zero_grad(set_to_none=True)
    averager = pipeline.GradientAverager(stage, parallel.layout.dp_group, bucket_bytes=4096)
    events, real_flush, real_act = [], averager.flush, pipeline._act
    averager.flush = lambda: (events.append(("launch", len(averager.bucket), time.time())), real_flush())[1]
    pipeline._act = lambda a, *args: (events.append(("start", a, time.time())), real_act(a, *args),
                                      events.append(("end", a, time.time())))[1]
    try:
        averager.begin(m)
        pipeline.pipeline_step(pipeline.Stage(stage), batches, cfg, torch.device("cpu"), nullcontext(), averager=averager)
    finally:
        pipeline._act = real_act
    pipeline.reduce_pipeline_grads(stage, averager)
    for name, p in stage.named_parameters():  # the same numbers, bit for bit
        assert torch.equal(p.grad, want[name]), name
    launches = [e for e in events if e[0] == "launch" and e[1]]
    assert sum(e[1] for e in launches) == len(list(stage.parameters()))  # each parameter once
    # Buckets were launched during each chunk's last backward, not after it
    for c in range(v):
        start = next(i for i, e in enumerate(events) if e[:2] == ("start", pipeline.Action("B", c, m - 1)))
        end = next(i for i, e in enumerate(events) if e[:2] == ("end", pipeline.Action("B", c, m - 1)))
        assert any(e[0] == "launch" and e[1] for e in events[start:end]), (c, events[start:end])
    # The last stage's last all-reduce started before stage 0 ended its drain.
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (parallel.layout.pp_rank, parallel.layout.dp_rank, events))
    by_stage = {(pp_rank, dp_rank): events for pp_rank, dp_rank, events in seen}
    launched = max(e[2] for e in by_stage[(1, 0)] if e[0] == "launch" and e[1])
    drained = max(e[2] for e in by_stage[(0, 0)] if e[0] == "end")
    assert launched < drained, "stage 1 started averaging only after stage 0's drain"


@pytest.mark.slow
def test_data_parallel_average_starts_as_gradients_become_final():
    """PP=2 x DP=2, interleaved: each gradient's average over its
    data-parallel pair is launched, in a bucket, during the backward that
    makes it final (the step's last micro-batch's), and the last stage's
    while stage 0 still drains the pipeline; every parameter's once, and
    bit for bit the gradients of one all-reduce after the schedule."""
    run_on_ranks(_check_data_parallel_average_starts_as_gradients_become_final, world_size=4)


def _check_zb_h1_averages_over_data_parallel_as_1f1b():
    m, pp = 4, 2
    parallel.destroy()
    parallel.initialize(1, pipeline_model_parallel_size=pp)  # 4 ranks: PP=2 x DP=2
    torch.manual_seed(0)
    config = GPTConfig(num_layers=4, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
                       vocab_size=100, padded_vocab_size=128)
    stage = pipeline.stage_model(config, pipeline.pipeline_chunks(4, pp, parallel.layout.pp_rank))
    batches = []
    for i in range(m):  # each data-parallel rank its own micro-batches
        x, y, mask = uneven_batch(10 * parallel.layout.dp_rank + i, batch_size=2)
        batches.append({"tokens": x, "labels": y, "loss_mask": mask, "position_ids": torch.arange(8).expand(2, 8)})
    grads = []
    for zb in (False, True):
        cfg = SimpleNamespace(seq_length=8, micro_batch_size=2, enable_zero_bubble=zb)
        averager = pipeline.GradientAverager(stage, parallel.layout.dp_group, bucket_bytes=4096)
        averager.begin(m)
        pipeline.pipeline_step(pipeline.Stage(stage), batches, cfg, torch.device("cpu"), nullcontext(), averager=averager)
        pipeline.reduce_pipeline_grads(stage, averager)
        grads.append({n: p.grad.clone() for n, p in stage.named_parameters()})
        stage.zero_grad(set_to_none=True)
    for name, want in grads[0].items():
        assert_close(grads[1][name], want, tol=1e-6, what=name)


def test_zb_h1_averages_over_data_parallel_ranks_as_1f1b():
    """PP=2 x DP=2: ZB-H1's weight gradients, accumulated in W, reach the
    data-parallel averager as final exactly once (an AccumulateGrad left in
    the graph of I ran gradient-less there, and the averager, counting the
    micro-batches, sent the weights' gradients off before their last W)."""
    run_on_ranks(_check_zb_h1_averages_over_data_parallel_as_1f1b, world_size=4)


# ----------------------------------------------------------------------------
# Pipeline parallelism from the command line: every layout trains the curve
# of one stage (PP=1), and checkpoints cross pipeline sizes both ways

# 4 layers, micro-batch 2, global batch 8: 4 micro-batches a step at DP=1.
PIPELINE_RUN = [*TINY, "--num-layers", "4", "--micro-batch-size", "2", "--global-batch-size", "8",
                "--train-iters", "8"]
PIPELINE_LAYOUTS = {  # name: (processes, flags), each trained from scratch for 8 iterations
    "PP=4": (4, ["--pipeline-model-parallel-size", "4"]),
    "interleaved PP=2, 2 virtual stages a rank": (2, ["--pipeline-model-parallel-size", "2",
                                                      "--num-layers-per-virtual-pipeline-stage", "1"]),
    "PP=2 x DP=2": (4, ["--pipeline-model-parallel-size", "2"]),
    "interleaved PP=2 x DP=2": (4, ["--pipeline-model-parallel-size", "2",
                                    "--num-layers-per-virtual-pipeline-stage", "1"]),
    "PP=2 with recomputation": (2, ["--pipeline-model-parallel-size", "2", "--recompute-activations"]),
    # PP=2 x TP=2 with SP: under ZB-H1 here (issue 73's command; with Domino and recomputation, against
    # 1F1B, in test_zb_h1_defers_the_weight_gradient_of_every_kind_of_linear); with Domino under 1F1B
    # over DP=2, interleaved and compiled below
    "ZB-H1 PP=2 x TP=2, sequence parallel": (4, ["--pipeline-model-parallel-size", "2",
                                                 "--tensor-model-parallel-size", "2",
                                                 "--sequence-parallel", "--enable-zero-bubble"]),
    # every kind of parallelism at once: 8 ranks, each micro-batch through 2 stages of 2 TP ranks (also DIST_WRITER)
    "PP=2 x TP=2 x DP=2, sequence parallel, Domino": (8, ["--pipeline-model-parallel-size", "2",
                                                          "--tensor-model-parallel-size", "2",
                                                          "--sequence-parallel", "--domino"]),
    "interleaved PP=2 x TP=2, sequence parallel, Domino": (4, ["--pipeline-model-parallel-size", "2",
                                                               "--num-layers-per-virtual-pipeline-stage", "1",
                                                               "--tensor-model-parallel-size", "2",
                                                               "--sequence-parallel", "--domino"]),
    "interleaved PP=2 with recomputation": (2, ["--pipeline-model-parallel-size", "2", "--recompute-activations",
                                                "--num-layers-per-virtual-pipeline-stage", "1"]),
    # ZB-H1 over data-parallel replicas (each gradient averaged once its last W is done), and recomputing
    "ZB-H1 PP=2 x DP=2": (4, ["--pipeline-model-parallel-size", "2", "--enable-zero-bubble"]),
    "ZB-H1 PP=2 with recomputation": (2, ["--pipeline-model-parallel-size", "2", "--recompute-activations",
                                          "--enable-zero-bubble"]),
    # --compile with stages at 4 ranks (the compile worker's pipeline runs, at 2, also count graph breaks)
    "PP=2 x TP=2, sequence parallel, Domino, compiled": (4, ["--pipeline-model-parallel-size", "2",
                                                             "--tensor-model-parallel-size", "2",
                                                             "--sequence-parallel", "--domino", "--compile",
                                                             "--compile-backend", "aot_eager"]),
    # context parallelism (context.py): each sequence split over 2 or 4 ranks, alone and with TP, SP, Domino, ZB-H1
    "CP=2, ring attention": (2, ["--context-parallel-size", "2"]),
    "CP=2 all-to-all x TP=2, sequence parallel, Domino": (4, ["--context-parallel-size", "2", "--cp-comm-type", "a2a",
                                                              "--tensor-model-parallel-size", "2",
                                                              "--sequence-parallel", "--domino"]),
    "ZB-H1 PP=2 x CP=2": (2 * 2, ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2",
                                  "--enable-zero-bubble"]),
}
CP_SAVES = {  # layout: its checkpoint's format (saved at 4 and 8), resumed at another CP size by CP_READERS
    "CP=2, ring attention": "torch", "CP=2 all-to-all x TP=2, sequence parallel, Domino": "torch_dist"}
CP_READERS = {  # name: (processes, flags, the CP layout whose checkpoint of iteration 4 it resumes)
    "CP=2's torch checkpoint, resumed at CP=1": (1, [], "CP=2, ring attention"),
    "CP=2 x TP=2's torch_dist checkpoint, resumed at CP=4": (
        4, ["--context-parallel-size", "4"], "CP=2 all-to-all x TP=2, sequence parallel, Domino"),
}


HALF_LAYOUTS = {  # name: (processes, flags), each against PP=1 in its own 16-bit format
    "bf16 PP=1": (1, ["--bf16"]),
    "bf16 PP=2": (2, ["--bf16", "--pipeline-model-parallel-size", "2"]),
    "bf16 interleaved PP=2": (2, ["--bf16", "--pipeline-model-parallel-size", "2",
                                  "--num-layers-per-virtual-pipeline-stage", "1"]),
    "bf16 ZB-H1 PP=2": (2, ["--bf16", "--pipeline-model-parallel-size", "2", "--enable-zero-bubble"]),
    # fp16 from a loss scale of 2**20, which overflows step 1's gradients: skipped, then halved
    "fp16 PP=1": (1, ["--fp16", "--initial-loss-scale", "1048576"]),
    "fp16 PP=2": (2, ["--fp16", "--initial-loss-scale", "1048576", "--pipeline-model-parallel-size", "2"]),
    "fp16 interleaved PP=2": (2, ["--fp16", "--initial-loss-scale", "1048576", "--pipeline-model-parallel-size",
                                  "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
    "fp16 ZB-H1 PP=2": (2, ["--fp16", "--initial-loss-scale", "1048576", "--pipeline-model-parallel-size", "2",
                            "--enable-zero-bubble"]),
}


DIST_WRITER = "PP=2 x TP=2 x DP=2, sequence parallel, Domino"
DIST_READERS = {  # name: (processes, flags) of a run resuming DIST_WRITER's torch_dist checkpoint
    "torch_dist of PP=2 x TP=2 x DP=2, resumed at PP=1": (1, []),
    "torch_dist of PP=2 x TP=2 x DP=2, resumed at TP=2": (2, ["--tensor-model-parallel-size", "2"]),
    "torch_dist of PP=2 x TP=2 x DP=2, resumed at PP=2": (2, ["--pipeline-model-parallel-size", "2"]),
    "torch_dist of PP=2 x TP=2 x DP=2, resumed at interleaved PP=2": PIPELINE_LAYOUTS[
        "interleaved PP=2, 2 virtual stages a rank"],
    "torch_dist of PP=2 x TP=2 x DP=2, resumed at DP=4": (4, []),
    "torch_dist of PP=2 x TP=2 x DP=2, resumed at its own layout": PIPELINE_LAYOUTS[DIST_WRITER],
}


@pytest.fixture(scope="module")
def pipeline_runs(ids_corpus, tmp_path_factory):
    """{name: {iteration: metrics}} of each run (the saves in the single-file torch format but
    DIST_WRITER's, in the default, torch_dist): PP=1 (saving at iteration 4),
    PP=2 stopped at 4 (--exit-interval), PP=1 resumed from PP=2's iteration 4,
    PP=2 resumed from PP=1's, PIPELINE_LAYOUTS (DIST_WRITER saving torch_dist),
    DIST_READERS, PP=2 with dropout, whole and resumed from its own iteration 4,
    and ZB-H1 with dropout: whole, resumed from its own iteration 4 and from 1F1B's."""
    out = tmp_path_factory.mktemp("pipeline")

    compiled = {}  # run: each rank's graphs and graph breaks, for the --compile runs

    def run(name, nproc, *flags):
        path = str(out / f"{name}.jsonl")
        counts = str(out / f"{name}.compiled") if "--compile" in flags else None
        train_on_ranks([*PIPELINE_RUN, *IDS, "--data-path", ids_corpus, "--metrics-file", path, *flags], nproc=nproc,
                       compile_counts=counts)
        if counts:
            compiled[name] = [json.loads(open(f"{counts}.{rank}").read()) for rank in range(nproc)]
        return {m["iteration"]: m for m in read_metrics(path)}
    one_file = ["--ckpt-format", "torch"]  # the single-file format (torch_dist: DIST_WRITER's)
    runs = {"PP=1": run("pp1", 1, "--save", str(out / "pp1"), "--save-interval", "4", *one_file)}
    pp2 = ["--pipeline-model-parallel-size", "2", "--save", str(out / "pp2"), "--save-interval", "4", *one_file]
    runs["PP=2, stopped at 4"] = run("pp2", 2, *pp2, "--exit-interval", "4")
    shutil.copytree(out / "pp2", out / "pp2-to-pp1")
    runs["PP=2's checkpoint resumed at PP=1"] = run("pp2-to-pp1", 1, "--load", str(out / "pp2-to-pp1"))
    shutil.copytree(out / "pp1", out / "pp1-to-pp2")
    (out / "pp1-to-pp2" / checkpoint.LATEST).write_text("4")
    runs["PP=1's checkpoint resumed at PP=2"] = run(
        "pp1-to-pp2", 2, "--pipeline-model-parallel-size", "2", "--load", str(out / "pp1-to-pp2"))
    for name, (nproc, flags) in PIPELINE_LAYOUTS.items():
        if name == DIST_WRITER:  # also saves torch_dist (the default) at 4 and 8, in the background
            flags = [*flags, "--async-save", "--save", str(out / "dist"),
                     "--save-interval", "4"]
        if name in CP_SAVES:
            flags = [*flags, "--save", str(out / f"cp{len(runs)}"), "--save-interval", "4",
                     "--ckpt-format", CP_SAVES[name]]
        runs[name] = run(name.replace(" ", "_").replace(",", ""), nproc, *flags)
    for k, (name, (nproc, flags, writer)) in enumerate(CP_READERS.items()):
        slug = f"cp-reader{k}"  # a copy of the writer's directory, pointing at iteration 4
        shutil.copytree(out / f"cp{list(runs).index(writer)}", out / slug)
        (out / slug / checkpoint.LATEST).write_text("4")
        runs[name] = run(slug, nproc, *flags, "--load", str(out / slug))
    for name, (nproc, flags) in HALF_LAYOUTS.items():
        runs[name] = run(name.replace(" ", "_"), nproc, *flags)
    for name, (nproc, flags) in DIST_READERS.items():  # each from the torch_dist checkpoint of iteration 4
        slug = name.split(", ")[-1].replace(" ", "_").replace("=", "")
        shutil.copytree(out / "dist", out / slug)
        (out / slug / checkpoint.LATEST).write_text("4")
        runs[name] = run(slug, nproc, *flags, "--load", str(out / slug))
    dropout = ["--pipeline-model-parallel-size", "2", "--hidden-dropout", "0.2", "--save-interval", "4", *one_file]
    for name, slug, flags in (("PP=2", "drop", dropout),
                              ("interleaved PP=2", "idrop", [*dropout, "--num-layers-per-virtual-pipeline-stage", "1"])):
        runs[f"{name} with dropout"] = run(slug, 2, *flags, "--save", str(out / slug))
        (out / slug / checkpoint.LATEST).write_text("4")
        runs[f"{name} with dropout, resumed at 4"] = run(f"{slug}-resumed", 2, *flags, "--load", str(out / slug))
    zb = [*dropout, "--enable-zero-bubble"]  # ZB-H1: whole, resumed from its own iteration 4, and from 1F1B's
    runs["ZB-H1 PP=2 with dropout"] = run("zb-drop", 2, *zb, "--save", str(out / "zb-drop"))
    (out / "zb-drop" / checkpoint.LATEST).write_text("4")
    runs["ZB-H1 PP=2 with dropout, resumed at 4"] = run("zb-drop-resumed", 2, *zb, "--load", str(out / "zb-drop"))
    shutil.copytree(out / "drop", out / "drop-to-zb")
    (out / "drop-to-zb" / checkpoint.LATEST).write_text("4")
    runs["ZB-H1 PP=2 with dropout, from 1F1B's iteration 4"] = run("drop-to-zb", 2, *zb, "--load",
                                                                   str(out / "drop-to-zb"))
    runs["dir"], runs["compile counts"] = out, compiled
    return runs


@pytest.mark.slow
def test_a_pipelined_runs_checkpoint_exports_and_samples_as_the_whole_model(pipeline_runs):
    """PP=2's checkpoint (iteration 4) is the whole model, and so are CP=2's
    (torch) and CP=2 x TP=2's (torch_dist): exported to Hugging Face each
    holds PP=1's weights of iteration 4 (the same curve). eval_tasks.py samples
    from a pipelined run's (DIST_WRITER's torch_dist), and names a context-
    parallel flag it was given in one line, as a training flag it ignores."""
    out = pipeline_runs["dir"]
    # pp1-to-pp2: a copy of PP=1's run pointing at iteration 4; cp-reader0, 1: of the CP runs' (CP_READERS)
    exported = ("pp1-to-pp2", "pp2", "cp-reader0", "cp-reader1")
    for name in exported:
        checkpoint.export_weights(str(out / name), str(out / f"{name}-hf"), "hf")
    from safetensors.torch import load_file
    whole, *others = (load_file(str(out / f"{n}-hf" / "model.safetensors")) for n in exported)
    for name, weights in zip(exported[1:], others):
        assert whole.keys() == weights.keys(), name
        for key in whole:
            torch.testing.assert_close(weights[key], whole[key], rtol=0, atol=1e-5, msg=f"{name}: {key}")
    proc = torchrun("eval_tasks.py", "--task", "GENERATE", "--load", str(out / "dist"), "--num-samples", "1",
                    "--out-seq-length", "4", "--seq-length", "32", "--context-parallel-size", "2", *IDS)
    assert json.loads(proc.stdout.strip().splitlines()[-1])["tokens"]
    ignored = [line for line in proc.stdout.splitlines() if "--context-parallel-size" in line]
    assert ignored == ["eval_tasks.py: ignoring --context-parallel-size: train.py's flags, which do not apply to "
                       "evaluation"], proc.stdout[-2000:]


@pytest.mark.slow
def test_four_compiled_ranks_of_two_stages_compile_their_chunks_whole(pipeline_runs):
    """PP=2 x TP=2 with sequence parallelism and Domino under --compile: every
    rank compiles its stage's model chunk (forward and backward) with no graph
    break, as the compile worker checks at two ranks."""
    counts = pipeline_runs["compile counts"]["PP=2_x_TP=2_sequence_parallel_Domino_compiled"]
    assert len(counts) == 4 and all(c["graphs"] >= 1 and c["graph_breaks"] == 0 for c in counts), counts


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["PP=2", "interleaved PP=2"])
def test_pipeline_stages_draw_their_own_dropout_and_resume_it(pipeline_runs, schedule):
    """Each stage keeps its own random streams in the checkpoint: a PP=2 run
    with dropout (1F1B, or interleaved: two model chunks a rank) resumed at
    iteration 4 retraces the uninterrupted run."""
    want, got = pipeline_runs[f"{schedule} with dropout"], pipeline_runs[f"{schedule} with dropout, resumed at 4"]
    assert sorted(got) == [5, 6, 7, 8]
    for i in got:
        assert (got[i]["loss"], got[i]["grad_norm"]) == (want[i]["loss"], want[i]["grad_norm"]), i
    assert want[8]["loss"] != pipeline_runs["PP=1"][8]["loss"]  # dropout is on


@pytest.mark.slow
def test_zb_h1_takes_1f1bs_steps_resumes_bit_for_bit_and_from_1f1bs_checkpoint(pipeline_runs):
    """With dropout (each stage its own streams), ZB-H1 at PP=2 takes 1F1B's
    steps; resumed from its own iteration 4 it retraces itself bit for bit,
    and from 1F1B's checkpoint of iteration 4 it goes on along 1F1B's curve."""
    one_f_one_b, zb = pipeline_runs["PP=2 with dropout"], pipeline_runs["ZB-H1 PP=2 with dropout"]
    resumed = pipeline_runs["ZB-H1 PP=2 with dropout, resumed at 4"]
    crossed = pipeline_runs["ZB-H1 PP=2 with dropout, from 1F1B's iteration 4"]
    assert sorted(zb) == list(range(1, 9)) and sorted(resumed) == sorted(crossed) == [5, 6, 7, 8]
    for i in zb:
        for key in ("loss", "grad_norm", "val_loss"):
            assert zb[i].get(key) == pytest.approx(one_f_one_b[i].get(key), abs=1e-5), (i, key)
            if i > 4:
                assert resumed[i].get(key) == zb[i].get(key), (i, key)
                assert crossed[i].get(key) == pytest.approx(one_f_one_b[i].get(key), abs=1e-5), (i, key)


@pytest.mark.slow
def test_a_torch_dist_checkpoint_resumes_bit_for_bit_in_its_own_layout(pipeline_runs):
    """PP=2 x TP=2 x DP=2 (SP, Domino) resumed from its own torch_dist
    checkpoint of iteration 4 (written with --async-save: each rank's shards
    staged, then written in the background) retraces the uninterrupted run
    exactly. Each of the 8 ranks wrote its own file, and the files hold each
    piece once: of what two data-parallel replicas hold, one copy.
    PyTorch's converter gives PP=1's weights of iteration 4 (the same curve:
    to 5e-5) from those shards."""
    want, got = pipeline_runs[DIST_WRITER], pipeline_runs[
        "torch_dist of PP=2 x TP=2 x DP=2, resumed at its own layout"]
    assert sorted(got) == [5, 6, 7, 8]
    for i in got:
        assert (got[i]["loss"], got[i]["grad_norm"]) == (want[i]["loss"], want[i]["grad_norm"]), i
    out = pipeline_runs["dir"]
    tag = out / "dist" / "iter_0000004"
    files = sorted(tag.glob("*.distcp"))
    assert [p.name for p in files] == [f"__{r}_0.distcp" for r in range(8)]
    # together about what one process writes of the same state (measured: 1.14x, DCP's framing;
    # twice that with both replicas' copies)
    plain = out / "pp1" / "iter_0000004" / checkpoint.PLAIN_FILE
    assert sum(p.stat().st_size for p in files) < 1.5 * plain.stat().st_size
    proc = run_bounded([sys.executable, "-m", "torch.distributed.checkpoint.format_utils", "dcp_to_torch",
                        str(tag), str(out / "dist.pt")], 120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    converted = torch.load(out / "dist.pt", weights_only=True)
    with checkpoint.data_only_loads(str(out)):
        whole = torch.load(out / "pp1" / "iter_0000004" / checkpoint.PLAIN_FILE)["model"]
    assert {k for k in converted if k.startswith("model.")} == {f"model.{k}" for k in whole}
    for key, t in whole.items():  # (Adam turns float-order differences in near-zero gradients into a
        # few weights 2e-5 apart after 4 steps at lr 3e-3; a misplaced shard is 1e-2 off)
        torch.testing.assert_close(converted[f"model.{key}"], t, rtol=0, atol=5e-5, msg=key)


def test_layers_that_do_not_divide_into_stages_are_one_line_from_rank_0(corpus):
    proc = run_train([*PIPELINE_RUN, "--num-layers", "3", "--pipeline-model-parallel-size", "2",
                      "--data-path", corpus], nproc=2, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("train.py: error")]
    assert proc.returncode != 0 and errors == [
        "train.py: error: --pipeline-model-parallel-size 2 must divide --num-layers 3 "
        "(each stage holds as many layers)"], proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in HALF_LAYOUTS if not name.endswith(" PP=1")])
def test_every_schedule_in_16_bits_trains_the_16_bit_curve_of_one_stage(pipeline_runs, name):
    """Under --bf16 or --fp16 autocast the stages (1F1B, interleaved, ZB-H1)
    exchange the residual stream in fp32, as one stage keeps it: PP=1's steps
    in the same format, to a relative 5e-4 (measured in bf16: loss 1.6e-5,
    grad norm 1.1e-4 at most, where bf16 itself resolves 4e-3; a wrong
    gradient is off by percents). Under --fp16 the stages also skip the steps
    one stage skips for overflow."""
    want, got = pipeline_runs[name.split()[0] + " PP=1"], pipeline_runs[name]
    assert sorted(got) == sorted(want) == list(range(1, 9))
    for i, m in got.items():
        for key in ("loss", "grad_norm", "val_loss"):
            if want[i].get(key) is None:  # no validation at this iteration (pytest 9.2's approx takes no None)
                assert m.get(key) is None, (name, i, key)
            else:
                assert m.get(key) == pytest.approx(want[i][key], rel=5e-4), (name, i, key)
        assert m.get("skipped_iterations") == want[i].get("skipped_iterations"), (name, i)
    if name.startswith("fp16"):
        assert [got[i]["skipped_iterations"] for i in (1, 2)] == [1, 0]  # the overflow and the halved scale


@pytest.mark.slow
@pytest.mark.parametrize("name, iterations", [
    *((name, range(1, 9)) for name in PIPELINE_LAYOUTS), ("PP=2, stopped at 4", range(1, 5)),
    ("PP=2's checkpoint resumed at PP=1", range(5, 9)), ("PP=1's checkpoint resumed at PP=2", range(5, 9)),
    *((name, range(5, 9)) for name in DIST_READERS), *((name, range(5, 9)) for name in CP_READERS)])
def test_every_pipeline_layout_trains_the_curve_of_one_stage(pipeline_runs, name, iterations):
    """Each layout, from scratch or from a checkpoint of another layout, takes
    PP=1's steps (resuming in one layout: the dropout tests above, bit for bit)."""
    want, got = pipeline_runs["PP=1"], pipeline_runs[name]
    assert len(want) == 8 and sorted(got) == list(iterations), sorted(got)
    for i, m in got.items():
        for key in ("loss", "grad_norm", "lr", "val_loss"):
            assert (key in m) == (key in want[i])
            if key in m:
                assert m[key] == pytest.approx(want[i][key], abs=1e-5), (name, i, key)

