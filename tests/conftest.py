"""Shared fixtures: small synthetic data sets that need no TFDS."""
import os
import tempfile

import jax
import numpy as np
import pytest

from fedssa_jax import data

# Full float32 matmuls and convolutions: on GPUs JAX's default (TF32) rounds to ~1e-3, which
# would blur the vectorised-equals-plain comparisons. Runs keep the backend's default.
jax.config.update('jax_default_matmul_precision', 'highest')
# One persistent XLA cache for the session: the suite's many small simulators (each a new set of
# jitted functions) compile the same programs again and again; later ones load them instead. It
# is exported, so the runs the tests start as subprocesses (which inherit the environment, and
# may import this file) share it; a cache the caller set is kept.
if not os.environ.get('JAX_COMPILATION_CACHE_DIR'):
  os.environ['JAX_COMPILATION_CACHE_DIR'] = tempfile.mkdtemp(prefix='fedssa_test_xla_')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')
jax.config.update('jax_compilation_cache_dir', os.environ['JAX_COMPILATION_CACHE_DIR'])
jax.config.update('jax_persistent_cache_min_compile_time_secs',
                  float(os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS']))
jax.config.update('jax_persistent_cache_min_entry_size_bytes',
                  int(os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES']))


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


def write_tiny_tfds_cifar10(data_dir, num_train=200, num_test=100, file_format=None):
  """A prepared TFDS 'cifar10' of a few synthetic images, as launch/prepare_offline.py
  writes the real one: the builder's own metadata, only the examples are local. `file_format`:
  TFDS's default (None), or e.g. 'array_record' (what prepare_offline.py and a download write)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from tensorflow_datasets.image_classification import cifar  # pylint: disable=g-import-not-at-top
  ds = synthetic_dataset(num_train, num_test)

  def examples(split):
    for i in ds.tfds_splits[split]:
      key = f'{split}_{i:05d}'
      yield key, {'id': key, 'image': ds.images[i], 'label': int(ds.labels[i])}

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(cifar.Cifar10, '_split_generators',
               lambda self, dl_manager: {'train': examples('train'), 'test': examples('test')})
    tfds.builder('cifar10', data_dir=data_dir).download_and_prepare(file_format=file_format)


@pytest.fixture(scope='session')
def small_ds():
  return synthetic_dataset()


def make_small_sim(ds, method, **overrides):
  """A Simulator of 5 CNN-5 clients, K = 2, batch 16, E = 1, on `ds` (N a multiple of 5, so
  that 2 classes each split the 10 classes)."""
  from fedssa_jax import config_lib, engine  # pylint: disable=g-import-not-at-top
  c = config_lib.build('cifar10', 'hetero,tiny')
  c.method, c.model.families = method, ('cnn5',)
  c.num_clients, c.participation = 5, 0.4
  c.num_rounds, c.local_epochs, c.batch_size, c.eval_batch_size = 2, 1, 16, 16
  c.update_from_flattened_dict(overrides)
  return engine.Simulator(c, ds, data.partition_from_config(c, ds))


@pytest.fixture
def small_sim(small_ds):
  """make(method, **overrides): make_small_sim on small_ds."""
  return lambda method, **overrides: make_small_sim(small_ds, method, **overrides)
