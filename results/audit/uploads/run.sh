#!/bin/bash
# The uploads' mechanism audited alone (--notrain) at the privacy sweeps' settings, epsilon 1, 4, 8.
# Run from the repository root: bash results/audit/uploads/run.sh
set -e
OUT=results/audit/uploads
for e in 1 4 8; do
  for mode in local central; do
    scope=$([ $mode = central ] && echo --config.fedssa.scope=participants || true)
    # n10: 10 clients, all of them every round, 20 rounds, FedSSA's clip (UPLOAD_CLIPS)
    python -m fedssa_jax.audit --config=configs/cifar10.py:hetero,n10 --notrain \
      --workdir=$OUT/n10-$mode-eps$e --config.num_rounds=20 --config.privacy.upload=True \
      --config.privacy.upload_mode=$mode --config.privacy.upload_clip=0.03 \
      --config.privacy.upload_target_epsilon=$e --config.privacy.upload_noise_multiplier=0 $scope
    # n1000: 1,000 clients, 100 a round, 50 rounds, FedSSA's clip (CROSS_DEVICE_UPLOAD_CLIPS);
    # the audit counts every client a participant (new_clients 0, where the sweep has 0.1)
    python -m fedssa_jax.audit --config=configs/cifar10.py:hetero,n1000 --notrain \
      --workdir=$OUT/n1000-$mode-eps$e --config.num_rounds=50 --config.new_clients=0 \
      --config.privacy.upload=True --config.privacy.upload_mode=$mode \
      --config.privacy.upload_clip=0.016 --config.privacy.accountant=rdp \
      --config.privacy.upload_target_epsilon=$e --config.privacy.upload_noise_multiplier=0 $scope
  done
done
