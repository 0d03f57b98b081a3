#!/usr/bin/env bash
# train.py on a Slurm allocation: one torchrun per node (through srun), every
# node's torchrun meeting at the allocation's first node (c10d rendezvous).
#
#   sbatch --nodes 4 --ntasks-per-node 1 --gpus-per-node 8 slurm.sh \
#       --preset 1.5B --tensor-model-parallel-size 2 --data-path data/my-gpt2_text_document \
#       --save ckpt/run --load ckpt/run --bf16 ...          # flags go to train.py
#
# Environment: what Slurm sets (SLURM_JOB_NODELIST, SLURM_NNODES, SLURM_JOB_ID,
# SLURM_GPUS_ON_NODE), and optionally GPUS_PER_NODE (default SLURM_GPUS_ON_NODE,
# else 8), MASTER_PORT (default 29500), MAX_RESTARTS (default 0: with --save D
# --load D, a restart resumes from D's latest checkpoint), DRY_RUN=1 (print the
# command instead of running it).
#
# Tensor-parallel groups are consecutive ranks, and torchrun numbers each
# node's processes consecutively, so a TP group never spans two nodes as long
# as --tensor-model-parallel-size divides GPUS_PER_NODE.
set -euo pipefail
# train.py beside this script; under sbatch, which runs a copy of the script
# from Slurm's spool directory, in the directory sbatch was called from (the
# job's working directory, where relative paths such as --data-path resolve).
CODE=$(cd "$(dirname "$0")" && pwd)
[ -f "$CODE/train.py" ] || CODE=${SLURM_SUBMIT_DIR:-$PWD}
if [ ! -f "$CODE/train.py" ]; then
    echo "slurm.sh: no train.py beside the script or in $CODE: call sbatch from the repository" >&2
    exit 2
fi

: "${SLURM_JOB_NODELIST:?run this inside a Slurm allocation (sbatch/salloc), or set the SLURM_* variables}"
NNODES=${SLURM_NNODES:?}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
PORT=${MASTER_PORT:-29500}

# The first host of the node list ("gpu[07-09,12],cpu3" -> gpu07); scontrol
# knows every form, the fallback the common ones.
if command -v scontrol > /dev/null; then
    HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
else
    HEAD=$(python -c '
import re, sys
first = re.match(r"([^,\[]+)(\[([^\]]+)\])?", sys.argv[1])
prefix, ranges = first.group(1), first.group(3)
print(prefix + (ranges.split(",")[0].split("-")[0] if ranges else ""))' "$SLURM_JOB_NODELIST")
fi

CMD=(srun --nodes "$NNODES" --ntasks-per-node 1 --kill-on-bad-exit=1
     python -m torch.distributed.run --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE"
     --rdzv-backend c10d --rdzv-endpoint "$HEAD:$PORT" --rdzv-id "${SLURM_JOB_ID:-train}"
     --max-restarts "${MAX_RESTARTS:-0}"
     "$CODE/train.py" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "${CMD[@]}"
    echo
else
    exec "${CMD[@]}"
fi
