"""The bench scripts work before a full run: bench/run_gpu.sh, the one command
a GPU session runs, before it meets a GPU, and bench/bench_moe.py.

Their --smoke modes run every stage on CPU (Triton interpreter, tiny shapes);
the figures mean little, but every table must come out filled.
"""
import os
import re
import sys

import pytest

from conftest import run_bounded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_run_gpu_smoke_fills_every_table_of_one_results_file(tmp_path):
    out = tmp_path / "out"
    proc = run_bounded(["bash", "bench/run_gpu.sh", "--smoke", str(out)], 600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for stage in ("env", "tests", "kernels", "profile", "model", "firststep"):
        assert re.search(rf"== {stage}: exit 0 after \d+ s", proc.stdout), stage
    results = (out / "RESULTS.md").read_text()
    assert "torch 2." in results and "triton" in results           # the versions
    assert re.search(r"\d+ skipped", results)                      # the GPU tests, collected
    assert re.search(r"\| 64 \| 32 \| 1 x 2 \|( [\d.e+-]+ \|){9}", results)  # attention row
    assert re.search(r"\| 128 \| 32 \|( [\d.e+-]+ \|){4}", results)        # LayerNorm row
    assert "| attention |" in results and "| LayerNorm |" in results      # the profile
    for variant in ("triton", "torch"):                                   # the model rows
        assert re.search(rf"\| tiny \| {variant} \| 2 \| [\d,]+ \| n/a \| [\d.]+ \|", results), variant
    assert re.search(r"cold cache: \| tiny \| triton", results)  # (the warm pass only on a GPU)


def test_profile_step_blames_gpu_idle_on_the_host_op_that_launched_the_next_kernel(tmp_path):
    """A Chrome trace of two streams and two host threads: kernel a (0-10 us) and
    b (5-40 us) overlap, so the GPU idles from 40 to 100 us, until c, launched in
    aten::pow (inside clip) on thread 1 while thread 2 ran aten::copy_; then 5 us
    until d, a Triton kernel launched through the driver from a compiled graph;
    then 3 us until e, whose launch the trace lacks."""
    import json
    import sys
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from profile_step import idle_by_host_op

    def kernel(name, ts, dur, corr):
        return dict(ph="X", cat="kernel", name=name, ts=ts, dur=dur, args={"correlation": corr})

    def host(cat, name, ts, dur, tid, corr=None):
        return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, tid=tid,
                    **({"args": {"correlation": corr}} if corr else {}))
    ev = [kernel("a", 0, 10, 1), kernel("b", 5, 35, 2), kernel("c", 100, 10, 3),
          kernel("d", 115, 10, 4), kernel("e", 128, 2, 5),
          host("cuda_runtime", "cudaLaunchKernel", 95, 1, 1, 3),
          host("cuda_driver", "cuLaunchKernel", 99, 1, 1, 4),
          host("cpu_op", "clip", 0, 97, 1), host("cpu_op", "aten::mul_", 10, 20, 1),
          host("cpu_op", "aten::pow", 90, 6, 1), host("cpu_op", "aten::copy_", 92, 10, 2),
          host("cpu_op", "## Call CompiledFxGraph abc", 98, 5, 1)]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": ev}))
    assert idle_by_host_op(str(tmp_path / "t.json")) == [
        ("aten::pow", 0.06), ("(compiled graph)", 0.005), ("(launch unknown)", 0.003)]


@pytest.mark.slow
def test_bench_moe_smoke_fills_its_three_tables():
    """bench/bench_moe.py --smoke (tiny sizes): the step's tokens/s of the dense
    model, the expert loop and grouped_mm; rank 0's memory at EP = 1, 2, 4, the
    experts' weights and AdamW states 1/EP of EP=1's; and the order of one MoE
    layer's GEMMs and all-to-alls at EP = 2, forward and backward; grouped_mm's bits
    for the same rows at 8 places in memory."""
    proc = run_bounded([sys.executable, "bench/bench_moe.py", "--smoke"], 600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"load average at start [\d.]+ [\d.]+ [\d.]+", out)
    for model in (r"dense \(MLP 2F\)", "MoE, loop", "MoE, grouped_mm"):
        assert re.search(rf"\| {model} \|( [\d,]+ \|){{5}}\n", out), model
    for ep, share in (("1", "1.000"), ("2", "0.500"), ("4", "0.250")):
        assert re.search(rf"\| EP={ep} \|( [\d.]+ \|){{7}} {share} \| {share} \|\n", out), ep
    for variant, gemm in (("loop", "gemm"), ("grouped_mm", "grouped_mm")):
        forward = re.search(rf"{variant}, forward: +(.*)", out).group(1)
        backward = re.search(rf"{variant}, backward: +(.*)", out).group(1)
        assert forward.startswith("router  a2a(counts)  land  a2a(rows)  land  ") and gemm in forward, forward
        assert backward.startswith("a2a(rows)  land  ") and gemm in backward and "router" in backward, backward
    for shift in range(8):  # section 4: reported, whichever way this CPU rounds
        assert re.search(rf"\| {shift} \| (yes|no) \| [\d.e+-]+ \|\n", out), shift
