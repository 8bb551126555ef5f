#!/bin/bash
# The measured choice at N = 10 with the measuring budget lifted (per_call.BUDGET_S, 90 s by
# default, covered only cnn1's first candidate on the loaded machine), beside run3.sh's rule run.
OUT=results/per_call_cpu
export FEDSSA_JAX_CACHE_DIR=$OUT/cache PYTHONPATH=$PWD
( echo "=== start $(date -u +%FT%TZ) load: $(uptime)"
  python -c "
import runpy, sys
from fedssa_jax.engine import per_call
per_call.BUDGET_S = 3600.0
sys.argv = ['launch/time_rounds.py'] + sys.argv[1:]
runpy.run_path('launch/time_rounds.py', run_name='__main__')" \
    --config=configs/cifar10.py:hetero,n10 --config.num_clients=10 \
    --config.engine.clients_per_call=-1 --config.batch_size=10 --config.local_epochs=1 \
    --config.optimizer.lr=0.01 --config.optimizer.momentum=0.0 --config.optimizer.weight_decay=0.0 \
    --config.augment=False --config.data_dir=$HOME/tensorflow_datasets --eval_every=1000 \
    --rounds=2 --alsologtostderr --json=$OUT/n10_pc-1_budget3600.json 2>&1
  echo "=== done $(date -u +%FT%TZ) load: $(uptime)" ) > $OUT/log_n10_pc-1_budget3600.txt
