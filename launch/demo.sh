#!/usr/bin/env bash
# FedSSA against Standalone on the offline CIFAR-10, heterogeneous models, N=10, 20 rounds of
# E=1, same seed and partition: the run behind docs/results.md.
#   bash launch/demo.sh [extra --config.* overrides]
set -euo pipefail
cd "$(dirname "$0")/.."
DATA_DIR=${DATA_DIR:-$HOME/tensorflow_datasets}
OUT=${OUT:-runs/demo}
PREPARE=../shared/data/cifar10/prepare.py  # this project's machines' offline copy, if present
download=False
if ! ls "$DATA_DIR"/cifar10/*/dataset_info.json >/dev/null 2>&1; then
  if [[ -f $PREPARE ]]; then
    python "$PREPARE" --tfds_data_dir "$DATA_DIR"
  else
    download=True  # TFDS downloads it (or see launch/prepare_offline.py)
  fi
fi
for method in fedssa standalone; do
  python -m fedssa_jax.main --config=configs/cifar10.py:hetero,n10 --workdir="$OUT/$method" \
    --config.data_dir="$DATA_DIR" --config.download=$download --config.num_rounds=20 --config.local_epochs=1 \
    --config.method=$method "$@"
done
python - "$OUT" <<'PY'
import json, sys
for m in ('fedssa', 'standalone'):
  s = json.load(open(f'{sys.argv[1]}/{m}/summary.json'))
  print(f"{m:10s} final mean acc {s['final_mean_accuracy']:.4f}  best {s['best_mean_accuracy']:.4f}"
        f"  {s['seconds_per_round_steady']:.1f} s/round")
PY
