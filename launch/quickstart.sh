#!/usr/bin/env bash
# The default experiment (configs/cifar10.py: heterogeneous CNN-1..5, N=10), shortened to 5
# rounds of one local epoch. Uses CIFAR-10 from DATA_DIR (default ~/tensorflow_datasets); if it
# is not prepared there, prepares the offline copy from ../shared/data/cifar10 when present, and
# otherwise lets TFDS download it. Extra arguments are passed to fedssa_jax.main.
#   bash launch/quickstart.sh [--config.num_rounds=20 ...]
set -euo pipefail
cd "$(dirname "$0")/.."
DATA_DIR=${DATA_DIR:-$HOME/tensorflow_datasets}
WORKDIR=${WORKDIR:-runs/quickstart}
PREPARE=../shared/data/cifar10/prepare.py
download=False
if ! ls "$DATA_DIR"/cifar10/*/dataset_info.json >/dev/null 2>&1; then
  if [[ -f $PREPARE ]]; then
    echo "Preparing the offline CIFAR-10 under $DATA_DIR (about a minute)..."
    python "$PREPARE" --tfds_data_dir "$DATA_DIR"
  else
    download=True
  fi
fi
python -m fedssa_jax.main --config=configs/cifar10.py --workdir="$WORKDIR" \
  --config.data_dir="$DATA_DIR" --config.download=$download \
  --config.num_rounds=5 --config.local_epochs=1 "$@"
echo "Outputs: $WORKDIR/{config.json,metrics.jsonl,summary.json}"
