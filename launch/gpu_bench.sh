#!/usr/bin/env bash
# One GPU, one command (under 8 minutes on an H200): the benchmark harness, then full-length
# timed FedSSA runs (500 rounds, E=5) at :hetero,n100 and :hetero,n10, and :hetero,n100 again in
# mixed precision (engine.compute_dtype=bfloat16), on synthetic CIFAR-shaped data (the same work
# as CIFAR-10; no data set needed).
#   bash launch/gpu_bench.sh [OUT_DIR]
# Set ROUNDS to shorten the timed runs, SECTIONS to pick harness sections.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_bench}
ROUNDS=${ROUNDS:-500}
SECTIONS=${SECTIONS:-training,rounds,padding}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt" || true
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
python -m fedssa_jax.run.bench --out="$OUT/bench.json" --sections="$SECTIONS" | tee "$OUT/bench.md"
for cfg in hetero,n100 hetero,n10; do
  python launch/time_rounds.py --config="configs/cifar10.py:$cfg" --synthetic \
    --config.local_epochs=5 --rounds="$ROUNDS" --eval_every=50 | tee "$OUT/rounds_$cfg.txt"
done
python launch/time_rounds.py --config=configs/cifar10.py:hetero,n100 --synthetic \
  --config.local_epochs=5 --config.engine.compute_dtype=bfloat16 --rounds="$ROUNDS" \
  --eval_every=50 | tee "$OUT/rounds_hetero,n100_bf16.txt"
