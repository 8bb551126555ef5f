#!/usr/bin/env bash
# A Cloud TPU slice (several TPU VM hosts): the same command on every worker; jax.distributed
# finds the coordinator and process ids from the TPU metadata (--distributed=on), and the
# clients are sharded over every TPU core of the slice.
#   TPU=my-v5e-32 ZONE=us-central2-b WORKDIR=gs://my-bucket/runs/n1000 bash launch/tpu_slice.sh \
#       [extra flags, e.g. --config.num_rounds=500]
# The repository must be at REPO (default ~/fedssa_jax) on every worker, with its Python
# packages installed. WORKDIR must be on storage every worker sees (a gs:// bucket or a shared
# filesystem): checkpoints are written there collectively, and worker 0 writes metrics.jsonl,
# config.json and summary.json. DATA_DIR (a gs:// TFDS folder works) holds the data for all.
# If the slice is preempted, run this again: the run resumes from the newest checkpoint.
set -euo pipefail
: "${TPU:?set TPU to the TPU VM name}" "${ZONE:?set ZONE to its zone}"
: "${WORKDIR:?set WORKDIR to a gs:// path or a shared folder}"
REPO=${REPO:-'~/fedssa_jax'}
CONFIG=${CONFIG:-configs/cifar10.py:hetero,n100}
DATA_DIR=${DATA_DIR:-'~/tensorflow_datasets'}
extra=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" --worker=all --command="cd $REPO && \
  python -m fedssa_jax.main --config=$CONFIG --workdir=$WORKDIR --config.data_dir=$DATA_DIR \
  --distributed=on$extra"
