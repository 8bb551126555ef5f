#!/usr/bin/env bash
# One GPU, one command: this simulator at HtFLlib's own settings (its system/total.sh: plain SGD
# lr 0.01, batch 10, E = 1, 20 clients all joining every round, no augmentation, Dirichlet
# alpha = 0.1), for the five CNNs, HtFE-img-2 (FedAvgCNN, ResNet-18) and HtFE-img-8, on synthetic
# CIFAR-shaped data (the same work as CIFAR-10; no data set needed). Writes each group's figures
# (s/round after the first, images/s, client GFLOP/s) as JSON beside the commit, in OUT_DIR.
#   bash launch/gpu_htfl_bench.sh [OUT_DIR]
# ROUNDS (default 3: the first compiles), SETS (the model groups) and METHODS / METHODS_HTFE8 pick the work; on a
# 2-core CPU, ROUNDS=2 METHODS=standalone SETS=hetero is a smoke run of a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package, installed or not
OUT=${1:-runs/gpu_htfl_bench}
ROUNDS=${ROUNDS:-3}
METHODS=${METHODS:-standalone,fedproto,fedgh}
METHODS_HTFE8=${METHODS_HTFE8:-standalone}
SETS=${SETS:-hetero hetero,htfe2 hetero,htfe8}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1 || true
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
HTFLLIB=(--config.num_clients=20 --config.participation=1.0 --config.batch_size=10
         --config.local_epochs=1 --config.optimizer.lr=0.01 --config.optimizer.momentum=0.0
         --config.optimizer.weight_decay=0.0 --config.optimizer.clip_norm=0.0
         --config.augment=False --config.partition.kind=dirichlet
         --config.partition.dirichlet_gamma=0.1)
for group in $SETS; do
  methods=$METHODS
  [[ $group == *htfe8* ]] && methods=$METHODS_HTFE8
  name=${group//,/_}
  python launch/time_rounds.py --config="configs/cifar10.py:$group" --synthetic "${HTFLLIB[@]}" \
    --methods="$methods" --rounds="$ROUNDS" --eval_every="$ROUNDS" --json="$OUT/$name.json" \
    | tee "$OUT/$name.txt"
done
