"""Shared fixtures: small synthetic data sets that need no TFDS."""
import jax
import numpy as np
import pytest

from fedssa_jax import data

# Full float32 matmuls and convolutions: on GPUs JAX's default (TF32) rounds to ~1e-3, which
# would blur the vectorised-equals-plain comparisons. Runs keep the backend's default.
jax.config.update('jax_default_matmul_precision', 'highest')


def synthetic_dataset(num_train=600, num_test=200, num_classes=10, seed=0, name='cifar10'):
  rng = np.random.default_rng(seed)
  m = num_train + num_test
  labels = np.concatenate([np.arange(num_train) % num_classes,
                           np.arange(num_test) % num_classes]).astype(np.int32)
  # Class-dependent colour, so that a few steps of training make visible progress.
  base = (labels[:, None] * 23 % 255).astype(np.float64)
  images = np.clip(base[:, None, None, :] + rng.normal(0, 40, (m, 32, 32, 3)), 0, 255)
  mean, std = data.NORMALIZATION[name]
  return data.Dataset(name, images.astype(np.uint8), labels, num_classes, mean, std,
                      {'train': np.arange(num_train), 'test': np.arange(num_train, m)})


@pytest.fixture(scope='session')
def small_ds():
  return synthetic_dataset()
