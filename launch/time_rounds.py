"""Times FedSSA rounds with no output files: training, server and evaluation separately.

Reads CIFAR from TFDS (`--config.data_dir`), or, with `--synthetic`, uses random images of the
same shape and class balance, which needs neither TFDS nor the data (e.g. on an accelerator
machine that can't see the data set).

  python launch/time_rounds.py --config=configs/cifar10.py:hetero,n100 \
      --config.local_epochs=1 --rounds=3 [--synthetic]
"""
import time

from absl import app, flags, logging
import jax
import numpy as np
from ml_collections import config_flags

from fedssa_jax import config_lib, data, engine

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', None, 'Config file with variants.', lock_config=True)
flags.DEFINE_integer('rounds', 3, 'Rounds to time; the first one compiles.')
flags.DEFINE_bool('synthetic', False, 'Random CIFAR-shaped data instead of TFDS.')


def synthetic_cifar(num_classes):
  rng = np.random.default_rng(0)
  labels = np.concatenate([np.arange(50000), np.arange(10000)]) % num_classes
  images = rng.integers(0, 256, (60000, 32, 32, 3), dtype=np.uint8)
  mean, std = data.NORMALIZATION['cifar10' if num_classes == 10 else 'cifar100']
  return data.Dataset('synthetic', images, labels.astype(np.int32), num_classes, mean, std,
                      {'train': np.arange(50000), 'test': np.arange(50000, 60000)})


def main(_):
  c = FLAGS.config
  config_lib.validate(c)
  ds = (synthetic_cifar(10 if c.dataset == 'cifar10' else 100) if FLAGS.synthetic
        else data.load_dataset(c.dataset, c.data_dir, c.download))
  t0 = time.time()
  sim = engine.Simulator(c, ds, data.partition_from_config(c, ds))
  state = sim.init_state()
  jax.block_until_ready(state)
  print(f'backend {jax.default_backend()} ({jax.devices()[0].device_kind}), setup '
        f'{time.time() - t0:.1f} s, groups: '
        + ', '.join(f'{g.family} x{g.size} ({g.clients_per_call}/call)' for g in sim.groups))
  for r in range(FLAGS.rounds):
    t0 = time.time()
    state, info = sim.run_round(state)
    jax.block_until_ready(state)
    t1 = time.time()
    ev = sim.evaluate(state)
    t2 = time.time()
    samples = info['train_samples'].sum()
    print(f'round {r + 1}: train+server {t1 - t0:.2f} s ({samples / (t1 - t0):.0f} img/s), '
          f'eval {t2 - t1:.2f} s, total {t2 - t0:.2f} s, mean acc {ev["accuracy"].mean():.4f}')


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  app.run(main)
