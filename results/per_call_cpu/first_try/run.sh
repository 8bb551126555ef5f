#!/bin/bash
# s/round of the fixed rule (engine.clients_per_call=0) against the measured choice (-1), the
# five CNNs at HtFLlib's settings, N = 10 and 20, run alternately on the 2-core CPU.
# From the repository root: bash results/per_call_cpu/run.sh
OUT=results/per_call_cpu
export FEDSSA_JAX_CACHE_DIR=$OUT/cache   # starts empty: the first measured run pays the timing
git rev-parse HEAD > $OUT/commit.txt
COMMON="--config.batch_size=10 --config.local_epochs=1 --config.optimizer.lr=0.01
  --config.optimizer.momentum=0.0 --config.optimizer.weight_decay=0.0 --config.augment=False
  --config.data_dir=$HOME/tensorflow_datasets --rounds=3 --eval_every=1000 --alsologtostderr"
for rep in 1 2; do
  order="0 -1"; [ $rep = 2 ] && order="-1 0"
  for n in 10 20; do
    for pc in $order; do
      echo "=== rep $rep N=$n clients_per_call=$pc $(date -u +%FT%TZ) load: $(uptime)" >> $OUT/log.txt
      python launch/time_rounds.py --config=configs/cifar10.py:hetero,n10 --config.num_clients=$n \
        --config.engine.clients_per_call=$pc $COMMON --json=$OUT/n${n}_pc${pc}_rep${rep}.json \
        >> $OUT/log.txt 2>&1
      echo "=== done $(date -u +%FT%TZ) load: $(uptime)" >> $OUT/log.txt
    done
  done
done
