"""Any TFDS image-classification data set: its name first, then the usual variants (see
fedssa_jax/config_lib.py; default hetero,n10).

  python -m fedssa_jax.main --config=configs/tfds.py:mnist,hetero,n10 --workdir=runs/x
  python -m fedssa_jax.main --config=configs/tfds.py:oxford_flowers102,dir \
      --config.image_size=32 --workdir=runs/y

HtFLlib's data sets in TFDS: mnist, fashion_mnist, cifar10, cifar100, oxford_flowers102,
caltech101 (data.HTFL_DATASETS). Images of varying size (oxford_flowers102, caltech101) need
--config.image_size; class count, image shape and normalisation come from the data set.
"""
from fedssa_jax import config_lib


def get_config(arg=None):
  dataset, _, variants = (arg or '').partition(',')
  if not dataset.strip():
    raise ValueError('configs/tfds.py takes the TFDS data set name first, then the variants: '
                     '--config=configs/tfds.py:mnist,hetero,n10')
  return config_lib.build(dataset.strip(), variants or None)
