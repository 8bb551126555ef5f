"""CIFAR-100 (k=10 classes per client). Variants: see fedssa_jax/config_lib.py.

  python -m fedssa_jax.main --config=configs/cifar100.py:homo,n50 --workdir=runs/x
"""
from fedssa_jax import config_lib


def get_config(arg=None):
  return config_lib.build('cifar100', arg)
