#!/bin/bash
# N = 20: the rule and the measured choice side by side (both at once, sharing the load), after
# rule_n10_again.sh. The measured run's budget lifted as in measured_n10.sh; its cache holds
# the N = 10 run's timings of 1 and 2 clients a call (the same groups' calls), so it times 4 only.
OUT=results/per_call_cpu
export FEDSSA_JAX_CACHE_DIR=$OUT/cache PYTHONPATH=$PWD
while pgrep -f "n10_pc0_again" > /dev/null; do sleep 10; done
FLAGS="--config=configs/cifar10.py:hetero,n10 --config.num_clients=20 --config.batch_size=10
  --config.local_epochs=1 --config.optimizer.lr=0.01 --config.optimizer.momentum=0.0
  --config.optimizer.weight_decay=0.0 --config.augment=False
  --config.data_dir=$HOME/tensorflow_datasets --eval_every=1000 --rounds=2 --alsologtostderr"
( echo "=== start $(date -u +%FT%TZ) load: $(uptime)"
  python launch/time_rounds.py $FLAGS --config.engine.clients_per_call=0 \
    --json=$OUT/n20_pc0.json 2>&1
  echo "=== done $(date -u +%FT%TZ) load: $(uptime)" ) > $OUT/log_n20_pc0.txt &
( echo "=== start $(date -u +%FT%TZ) load: $(uptime)"
  python -c "
import runpy, sys
from fedssa_jax.engine import per_call
per_call.BUDGET_S = 3600.0
sys.argv = ['launch/time_rounds.py'] + sys.argv[1:]
runpy.run_path('launch/time_rounds.py', run_name='__main__')" $FLAGS \
    --config.engine.clients_per_call=-1 --json=$OUT/n20_pc-1_budget3600.json 2>&1
  echo "=== done $(date -u +%FT%TZ) load: $(uptime)" ) > $OUT/log_n20_pc-1_budget3600.txt &
wait
