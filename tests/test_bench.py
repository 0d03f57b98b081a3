"""bench/run_gpu.sh, the one command a GPU session runs, works before it meets a GPU.

Its --smoke mode runs every stage on CPU (Triton interpreter, tiny shapes);
the figures mean nothing, but every table must come out filled.
"""
import os
import re

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
    assert re.search(r"cold cache: \| tiny \| triton", results)
    assert re.search(r"warm cache: \| tiny \| triton", results)


def test_profile_step_blames_gpu_idle_on_the_host_op_that_launched_the_next_kernel(tmp_path):
    """A Chrome trace: kernel a, 90 us idle, kernel b launched inside aten::pow
    (itself inside clip), 5 us, kernel c launched from a compiled graph."""
    import json
    import sys
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from profile_step import idle_by_host_op
    ev = [dict(ph="X", cat="kernel", name="a", ts=0, dur=10, args={"correlation": 1}),
          dict(ph="X", cat="kernel", name="b", ts=100, dur=10, args={"correlation": 2}),
          dict(ph="X", cat="kernel", name="c", ts=115, dur=10, args={"correlation": 3}),
          dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=5, dur=1, args={"correlation": 1}),
          dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=95, dur=1, args={"correlation": 2}),
          dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=99, dur=1, args={"correlation": 3}),
          dict(ph="X", cat="cpu_op", name="clip", ts=0, dur=97),
          dict(ph="X", cat="cpu_op", name="aten::mul_", ts=10, dur=20),
          dict(ph="X", cat="cpu_op", name="aten::pow", ts=90, dur=6)]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": ev}))
    assert idle_by_host_op(str(tmp_path / "t.json")) == [("aten::pow", 0.09), ("(compiled graph)", 0.005)]
