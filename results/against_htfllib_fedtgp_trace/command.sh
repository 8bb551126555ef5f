#!/usr/bin/env bash
cd /work/main
OV=$(python -c "import sys; sys.path.insert(0,'launch'); import against_htfllib as a; print(' '.join(a.our_overrides('fedtgp',0.05,20)))")
python -m fedssa_jax.main --config=configs/cifar10.py:hetero,n10 --config.data_dir=/work/tfds --config.seed=0 --config.partition.seed=0 --workdir=/tmp/ah_scratch/ours_fedtgp_post $OV --config.fedtgp.proto_timing=post_train > results/against_htfllib_fedtgp_trace/ours_fedtgp_post_train.log 2>&1
cp /tmp/ah_scratch/ours_fedtgp_post/metrics.jsonl results/against_htfllib_fedtgp_trace/ours_fedtgp_post_train.jsonl
