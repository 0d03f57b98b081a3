"""Mixtures of experts under pipeline and context parallelism, with expert
parallelism (and at expert TP 1 with TP 2 + SP): train.py over 4 gloo ranks trains one process's curve.

Under PP each stage holds its own MoE layers: the stages' figures are
gathered for rank 0's log line and metrics file, the experts' gradients are
averaged over the ranks holding the same experts (not with the stage's other
weights), and ZB-H1 computes the experts' weight gradients in I (pipeline.py,
section 3b). Under CP each rank routes its own tokens, but the load-balancing
losses count whole sequences: their sums are the CP group's
(expert_parallel.sum_over_sequence)."""
import os

import pytest
import torch.distributed as dist

import config
import parallel
import train
import train_ops
from conftest import as_torchrun_rank, read_metrics, run_on_ranks
from test_expert_parallel import ALLTOALL, ETP1, MOE_RUN

# MOE_RUN (8 experts, top-2 of sigmoid scores, the load-balancing and z losses, the
# expert bias) on 4 layers, the last two MoE: the first pipeline stage holds none of them.
# Without the loss on each document's last token, CP ranks keep different shares of the
# loss (context.split_batch's weights), which the auxiliary losses must not take.
RUN = [*MOE_RUN, "--num-layers", "4", "--moe-layer-freq", "[0,0,1,1]", "--eod-mask-loss"]
SEQ = ["--moe-router-load-balancing-type", "seq_aux_loss"]
BASELINES = {"one": [], "one-seq": SEQ}  # one process, every expert, 8 micro-batches a step
PP2, CP2 = ["--pipeline-model-parallel-size", "2"], ["--context-parallel-size", "2"]
RUNS = {  # name: (baseline, flags), on 4 ranks
    "pp2-1f1b-ep2": ("one", [*PP2, "--expert-model-parallel-size", "2", *ALLTOALL]),
    "pp2-interleaved-ep2-allgather": ("one", [*PP2, "--num-layers-per-virtual-pipeline-stage", "1",
                                              "--expert-model-parallel-size", "2"]),
    "pp2-zb-h1-ep2-grouped": ("one", [*PP2, "--enable-zero-bubble", "--expert-model-parallel-size", "2",
                                      *ALLTOALL, "--moe-grouped-gemm"]),
    "cp2-ring-ep2": ("one", [*CP2, "--cp-comm-type", "p2p", "--expert-model-parallel-size", "2", *ALLTOALL]),
    "cp2-a2a-ep4-seq": ("one-seq", [*CP2, "--cp-comm-type", "a2a", "--expert-model-parallel-size", "4", *SEQ]),
    "cp2-ring-ep2-seq": ("one-seq", [*CP2, "--cp-comm-type", "p2p", "--expert-model-parallel-size", "2",
                                     *ALLTOALL, *SEQ]),
    # the experts whole on each TP rank (TP 2 + SP, expert TP 1): EP 2 over the TP pair, EP 4 over TP x CP
    "tp2-etp1-pp2-1f1b-ep2": ("one", [*ETP1, *PP2, "--expert-model-parallel-size", "2", *ALLTOALL]),
    "tp2-etp1-pp2-zb-h1-ep2-grouped": ("one", [*ETP1, *PP2, "--enable-zero-bubble", "--expert-model-parallel-size",
                                               "2", *ALLTOALL, "--moe-grouped-gemm"]),
    "tp2-etp1-cp2-ring-ep4-seq": ("one-seq", [*ETP1, *CP2, "--cp-comm-type", "p2p", "--expert-model-parallel-size",
                                              "4", *SEQ]),
}


def _train_runs(out: str, data: str, runs: dict) -> None:
    """Each run (name: flags) in turn on these ranks, as train.py runs it."""
    as_torchrun_rank()
    if dist.get_world_size() == 1:  # a single process has no process group
        dist.destroy_process_group()
    for name, flags in runs.items():
        cfg = config.parse_args([*RUN, "--data-path", data, "--data-cache-path", os.path.join(out, "cache"),
                                 "--metrics-file", os.path.join(out, name + ".jsonl"), *flags])
        parallel.destroy()
        train.train(cfg, train_ops.init_processes(cfg))


@pytest.fixture(scope="module")
def runs(ids_corpus, tmp_path_factory):
    """The baselines in one process, then every RUNS run on 4 gloo ranks, in one launch. -> metrics by name"""
    out = str(tmp_path_factory.mktemp("moe-pp-cp"))
    run_on_ranks(_train_runs, out, ids_corpus, BASELINES, world_size=1)
    run_on_ranks(_train_runs, out, ids_corpus, {name: flags for name, (_, flags) in RUNS.items()}, world_size=4)
    return {name: read_metrics(os.path.join(out, name + ".jsonl")) for name in [*BASELINES, *RUNS]}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_experts_under_pp_and_cp_follow_one_process(runs, name):
    """With EP 2 or 4 folded out of DP x CP, to 1e-5 in fp32, each step: the LM
    loss, the gradient norm, the validation loss, and every figure the MoE
    layers log, each layer's and their means. Under PP2 (1F1B with the
    all-to-all dispatcher, interleaved with the all-gather one, ZB-H1 with the
    grouped GEMM) rank 0, whose stage holds no MoE layer, logs layers 2 and 3:
    the stages' figures are gathered, the experts' gradients averaged apart
    from the stage's others, and the expert bias moves per stage. Under CP2
    (ring and all-to-all attention) aux_loss and seq_aux_loss, their values
    and their gradients, are the whole sequences' (the CP sums), and the
    auxiliary losses' gradients do not take the LM loss's CP weight (the
    ranks keep different shares of the loss: --eod-mask-loss). With the experts
    whole on each TP rank (TP 2 + SP, expert TP 1, EP folded out of TP x CP x DP):
    EP 2 under PP2 (1F1B, ZB-H1 with the grouped GEMM), and EP 4 under CP2, whose
    seq_aux_loss sums each sequence over TP x CP."""
    baseline, _ = RUNS[name]
    want, got = {m["iteration"]: m for m in runs[baseline]}, runs[name]
    assert [m["iteration"] for m in got] == [1, 2, 3, 4]
    loss_kind = "seq_load_balancing_loss" if baseline == "one-seq" else "load_balancing_loss"
    for m in got:
        one = want[m["iteration"]]
        per_layer = {k for k in one if "/layer" in k}
        assert {f"{loss_kind}/layer2", f"{loss_kind}/layer3", "moe_imbalance/layer3"} <= per_layer
        assert set(m) == set(one) and not any(k.endswith("layer0") or k.endswith("layer1") for k in m)
        for key, value in one.items():
            if key not in ("tokens_per_sec", "mfu", "skipped_iterations"):
                assert m[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (name, m["iteration"], key)
    assert runs[baseline][-1]["loss"] < runs[baseline][0]["loss"] - 0.1  # it trained
