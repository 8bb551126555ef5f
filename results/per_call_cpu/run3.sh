#!/bin/bash
# The rule (engine.clients_per_call=0) and the measured choice (-1) side by side: the four runs
# (N = 10 and 20, each setting) at once, so that each pair shares the machine's load (other
# jobs ran on the 2 cores throughout). 2 rounds each: s/round is round 2's (round 1 compiles).
# From the repository root: bash results/per_call_cpu/run3.sh
OUT=results/per_call_cpu
export FEDSSA_JAX_CACHE_DIR=$OUT/cache PYTHONPATH=$PWD   # this checkout's package
COMMON="--config.batch_size=10 --config.local_epochs=1 --config.optimizer.lr=0.01
  --config.optimizer.momentum=0.0 --config.optimizer.weight_decay=0.0 --config.augment=False
  --config.data_dir=$HOME/tensorflow_datasets --eval_every=1000 --rounds=2 --alsologtostderr"
git rev-parse HEAD > $OUT/commit.txt
for n in 10 20; do
  for pc in 0 -1; do
    ( echo "=== start $(date -u +%FT%TZ) load: $(uptime)"
      python launch/time_rounds.py --config=configs/cifar10.py:hetero,n10 --config.num_clients=$n \
        --config.engine.clients_per_call=$pc $COMMON --json=$OUT/n${n}_pc${pc}.json 2>&1
      echo "=== done $(date -u +%FT%TZ) load: $(uptime)" ) > $OUT/log_n${n}_pc${pc}.txt &
  done
done
while true; do echo "$(date -u +%FT%TZ) $(uptime)" >> $OUT/load.txt; sleep 60; done &
wait %1 %2 %3 %4; kill %5
