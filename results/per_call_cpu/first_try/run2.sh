#!/bin/bash
# The rest of run.sh's first pass, shortened for a machine shared by other jobs: after the rule's
# N = 10 run (run.sh, 3 rounds), the measured N = 10 run (3 rounds), then N = 20 rule and
# measured (2 rounds each: one steady round after the compiling one), alternately.
OUT=results/per_call_cpu
export FEDSSA_JAX_CACHE_DIR=$OUT/cache
while kill -0 27365 2>/dev/null; do sleep 10; done   # the rule's N = 10 run of run.sh
COMMON="--config.batch_size=10 --config.local_epochs=1 --config.optimizer.lr=0.01
  --config.optimizer.momentum=0.0 --config.optimizer.weight_decay=0.0 --config.augment=False
  --config.data_dir=$HOME/tensorflow_datasets --eval_every=1000 --alsologtostderr"
run() {  # n, clients_per_call, rounds, tag
  echo "=== N=$1 clients_per_call=$2 rounds=$3 $(date -u +%FT%TZ) load: $(uptime)" >> $OUT/log.txt
  python launch/time_rounds.py --config=configs/cifar10.py:hetero,n10 --config.num_clients=$1 \
    --config.engine.clients_per_call=$2 --rounds=$3 $COMMON --json=$OUT/n$1_pc$2_$4.json \
    >> $OUT/log.txt 2>&1
  echo "=== done $(date -u +%FT%TZ) load: $(uptime)" >> $OUT/log.txt
}
run 10 -1 3 rep1
run 20 0 2 rep1
run 20 -1 2 rep1
run 10 0 2 rep2
run 10 -1 2 rep2
