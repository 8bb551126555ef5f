#!/usr/bin/env bash
# One GPU, one command: packed seeds against side-by-side processes (launch/replica_bench.py),
# R = 1, 3 and 8 at E=5, float32 and bfloat16, on synthetic CIFAR-shaped data. The paper grid's
# time is projected from each row's rate (the grid's FLOPs are computed with the first config).
#   bash launch/gpu_replicas.sh [OUT_DIR]
# CONFIGS (default "hetero,n10 hetero,n100"), REPLICAS (1,3,8), ROUNDS (5) shorten it; GRID=0
# leaves out the grid's FLOPs (a minute of compiles), e.g. in a second call.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_replicas}
CONFIGS=${CONFIGS:-hetero,n10 hetero,n100}
REPLICAS=${REPLICAS:-1,3,8}
ROUNDS=${ROUNDS:-5}
# The side-by-side processes compile what the packed R = 1 row compiled: cache it.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_compilation_cache}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt" || true
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
grid=$([[ ${GRID:-1} == 0 ]] && echo --nogrid || echo --grid)
for cfg in $CONFIGS; do
  python launch/replica_bench.py --config="configs/cifar10.py:$cfg" --config.local_epochs=5 \
    --replicas="$REPLICAS" --dtypes=float32,bfloat16 --rounds="$ROUNDS" --processes $grid \
    --out="$OUT/replicas_$cfg.json" | tee "$OUT/replicas_$cfg.md"
  grid=--nogrid
done
