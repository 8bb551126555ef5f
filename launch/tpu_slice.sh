#!/usr/bin/env bash
# A Cloud TPU slice (several TPU VM hosts): the same command on every worker; jax.distributed
# finds the coordinator and process ids from the TPU metadata (--distributed=on), and the
# clients are sharded over every TPU core of the slice.
#   TPU=my-v5e-32 ZONE=us-central2-b WORKDIR=/mnt/shared/runs/n1000 bash launch/tpu_slice.sh \
#       [extra flags, e.g. --config.num_rounds=500]
# The repository must be at REPO (default ~/fedssa_jax) on every worker, with its Python
# packages installed. WORKDIR must be a folder every worker sees at the same path (a Filestore
# or NFS mount, or a GCS bucket mounted with gcsfuse; the run writes through the filesystem, not
# through gs:// URLs): checkpoints are written there collectively, and worker 0 writes
# metrics.jsonl, config.json and summary.json. DATA_DIR holds the prepared TFDS data on every
# worker (each loads the images; they are replicated on every core).
# If the slice is preempted, run this again: the run resumes from the newest checkpoint.
set -euo pipefail
: "${TPU:?set TPU to the TPU VM name}" "${ZONE:?set ZONE to its zone}"
: "${WORKDIR:?set WORKDIR to a folder every worker sees}"
REPO=${REPO:-'~/fedssa_jax'}
CONFIG=${CONFIG:-configs/cifar10.py:hetero,n100}
DATA_DIR=${DATA_DIR:-'~/tensorflow_datasets'}
extra=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" --worker=all --command="cd $REPO && \
  python -m fedssa_jax.main --config=$CONFIG --workdir=$WORKDIR --config.data_dir=$DATA_DIR \
  --distributed=on$extra"
