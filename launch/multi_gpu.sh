#!/usr/bin/env bash
# One node, several GPUs: one process that sees every GPU of the node (or those in
# CUDA_VISIBLE_DEVICES) and shards the clients over all of them (the `clients` mesh). No
# jax.distributed: one process drives all local devices.
#   bash launch/multi_gpu.sh [WORKDIR] [extra flags, e.g. --config.num_rounds=100]
#   CUDA_VISIBLE_DEVICES=0,1 bash launch/multi_gpu.sh runs/two_gpus
# CONFIG picks the experiment (default configs/cifar10.py:hetero,n100); DATA_DIR the TFDS data.
# Rerunning the same command resumes from the newest checkpoint in WORKDIR; exit status 75
# means the run was stopped by SIGTERM/SIGINT after checkpointing.
set -euo pipefail
cd "$(dirname "$0")/.."
WORKDIR=${1:-runs/multi_gpu}
shift || true
CONFIG=${CONFIG:-configs/cifar10.py:hetero,n100}
DATA_DIR=${DATA_DIR:-$HOME/tensorflow_datasets}
nvidia-smi --query-gpu=index,name,memory.total --format=csv || true
exec python -m fedssa_jax.main --config="$CONFIG" --workdir="$WORKDIR" \
  --config.data_dir="$DATA_DIR" --distributed=off "$@"
