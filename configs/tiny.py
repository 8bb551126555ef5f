"""A tiny run for tests and smoke checks: 5 heterogeneous clients, 3 rounds, batch 16.

  python -m fedssa_jax.main --config=configs/tiny.py --workdir=/tmp/tiny
Pass a dataset as the argument (configs/tiny.py:cifar100); other variants may follow it.
"""
from fedssa_jax import config_lib


def get_config(arg=None):
  dataset, *rest = (arg or 'cifar10').split(',')
  return config_lib.build(dataset, ','.join(['hetero', 'tiny', *rest]))
