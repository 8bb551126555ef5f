#!/bin/bash
# The rule's N = 10 run again, after measured_n10.sh (rule, measured, rule: alternately).
OUT=results/per_call_cpu
export PYTHONPATH=$PWD
while pgrep -f "n10_pc-1_budget3600" > /dev/null; do sleep 10; done
( echo "=== start $(date -u +%FT%TZ) load: $(uptime)"
  python launch/time_rounds.py --config=configs/cifar10.py:hetero,n10 --config.num_clients=10 \
    --config.engine.clients_per_call=0 --config.batch_size=10 --config.local_epochs=1 \
    --config.optimizer.lr=0.01 --config.optimizer.momentum=0.0 --config.optimizer.weight_decay=0.0 \
    --config.augment=False --config.data_dir=$HOME/tensorflow_datasets --eval_every=1000 \
    --rounds=2 --alsologtostderr --json=$OUT/n10_pc0_again.json 2>&1
  echo "=== done $(date -u +%FT%TZ) load: $(uptime)" ) > $OUT/log_n10_pc0_again.txt
