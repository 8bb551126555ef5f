"""CIFAR-10. Variants: see fedssa_jax/config_lib.py. Default: hetero,n10.

  python -m fedssa_jax.main --config=configs/cifar10.py:hetero,n100 --workdir=runs/x
"""
from fedssa_jax import config_lib


def get_config(arg=None):
  return config_lib.build('cifar10', arg)
