#!/bin/bash
# N = 10 once more when the machine had become quieter: the measured choice (from the cache the
# earlier runs filled, nothing timed), then the rule, one after the other.
OUT=results/per_call_cpu
export FEDSSA_JAX_CACHE_DIR=$OUT/cache PYTHONPATH=$PWD
FLAGS="--config=configs/cifar10.py:hetero,n10 --config.num_clients=10 --config.batch_size=10
  --config.local_epochs=1 --config.optimizer.lr=0.01 --config.optimizer.momentum=0.0
  --config.optimizer.weight_decay=0.0 --config.augment=False
  --config.data_dir=$HOME/tensorflow_datasets --eval_every=1000 --rounds=2 --alsologtostderr"
for pc in -1 0; do
  ( echo "=== start $(date -u +%FT%TZ) load: $(uptime)"
    python launch/time_rounds.py $FLAGS --config.engine.clients_per_call=$pc \
      --json=$OUT/n10_pc${pc}_quieter.json 2>&1
    echo "=== done $(date -u +%FT%TZ) load: $(uptime)" ) > $OUT/log_n10_pc${pc}_quieter.txt
done
