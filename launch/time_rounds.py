"""Times rounds with no output files: training + server, and evaluation, separately.

Data, in order of preference: `--jpeg_npz` (the offline CIFAR-10 JPEG archive of
../shared/data/cifar10, decoded here with Pillow; needs no TFDS or TensorFlow), `--synthetic`
(random images of CIFAR's shape and class balance), or TFDS (`--config.data_dir`).
`--methods` runs several methods on the same data and partition, one after another.

  python launch/time_rounds.py --config=configs/cifar10.py:hetero,n100 \
      --config.local_epochs=1 --rounds=3 [--synthetic] [--methods=fedssa,standalone]

`--workdir` is where the disk store keeps its files (`--config.population_store=disk`).
`--json` writes each method's figures (s/round after the first, images/s, client GFLOP/s, the
backend and device) to a JSON file, beside the commit (launch/gpu_htfl_bench.sh).
"""
import io
import json
import subprocess
import time

from absl import app, flags
import jax
import numpy as np
from ml_collections import config_flags

from fedssa_jax import config_lib, data
from fedssa_jax.engine import simulator

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', None, 'Config file with variants.', lock_config=True)
flags.DEFINE_integer('rounds', 3, 'Rounds to time; the first one compiles.')
flags.DEFINE_bool('synthetic', False, 'Random CIFAR-shaped data instead of TFDS.')
flags.DEFINE_string('jpeg_npz', None, 'Path of cifar10_jpeg.npz to read instead of TFDS.')
flags.DEFINE_list('methods', [], 'Methods to run in turn; default: the config\'s method.')
flags.DEFINE_integer('eval_every', 1, 'Evaluate all clients every this many rounds.')
flags.DEFINE_string('workdir', None, 'The run folder of the disk store (population/).')
flags.DEFINE_string('json', None, 'Write every method\'s figures to this JSON file.')


def jpeg_cifar10(path):
  from PIL import Image  # pylint: disable=g-import-not-at-top
  z = np.load(path)
  arrays = []
  for split in ('train', 'test'):
    blob, off = z[f'{split}_jpeg'], z[f'{split}_offsets']
    x = np.stack([np.asarray(Image.open(io.BytesIO(blob[off[i]:off[i + 1]].tobytes()))
                             .convert('RGB')) for i in range(len(off) - 1)])
    arrays += [x, z[f'{split}_labels']]
  return data.from_arrays('cifar10', *arrays, 10)


def time_method(c, ds):
  t0 = time.time()
  sim = simulator.Simulator(c, ds, data.partition_from_config(c, ds), FLAGS.workdir)
  state = sim.init_state()
  jax.block_until_ready(state)
  print(f'{c.method}: backend {jax.default_backend()} ({jax.devices()[0].device_kind}), setup '
        f'{time.time() - t0:.1f} s, groups: '
        + ', '.join(f'{g.family} x{g.size} ({g.clients_per_call}/call)' for g in sim.groups))
  setup = time.time() - t0
  start, steady, ev, first = time.time(), [], None, None
  images = flops = 0.0
  for r in range(1, FLAGS.rounds + 1):
    t0 = time.time()
    state, (info,) = sim.run_round(state)
    jax.block_until_ready(state)
    t1 = time.time()
    steady += [t1 - t0] if r > 1 else []
    first = t1 - t0 if r == 1 else first
    if r > 1:
      images, flops = images + float(info.train_samples.sum()), flops + info.client_flops
    line = (f'{c.method} round {r}: train+server {t1 - t0:.2f} s '
            f'({info.train_samples.sum() / (t1 - t0):.0f} img/s)')
    if r % FLAGS.eval_every == 0 or r == FLAGS.rounds:
      ev = sim.evaluate(state, previous=ev)
      line += f', eval {time.time() - t1:.2f} s, mean acc {ev.accuracy.mean():.4f}'
      print(line, flush=True)
  print(f'{c.method}: {FLAGS.rounds} rounds in {time.time() - start:.1f} s including compiles '
        f'and evaluations; train+server {np.mean(steady or [0]):.3f} s/round after round 1',
        flush=True)
  seconds = float(np.sum(steady)) if steady else 0.0
  return {'method': c.method, 'families': list(c.model.families),
          'num_clients': c.num_clients, 'participation': c.participation,
          'batch_size': c.batch_size, 'local_epochs': c.local_epochs,
          'backend': jax.default_backend(), 'device': jax.devices()[0].device_kind,
          'setup_seconds': setup, 'first_round_seconds': first,
          'steady_seconds_per_round': float(np.mean(steady)) if steady else None,
          'images_per_second': images / seconds if seconds else None,
          'client_gflops_per_second': flops / seconds / 1e9 if seconds else None,
          'mean_accuracy': float(ev.accuracy.mean()) if ev is not None else None}


def commit() -> str:
  try:
    return subprocess.run(['git', 'rev-parse', 'HEAD'], capture_output=True, text=True,
                          check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return 'unknown'


def main(_):
  c = FLAGS.config
  config_lib.validate(c)
  num_classes = 10 if c.dataset == 'cifar10' else 100
  if FLAGS.jpeg_npz:
    ds = jpeg_cifar10(FLAGS.jpeg_npz)
  elif FLAGS.synthetic:
    ds = data.synthetic_cifar(num_classes)
  else:
    ds = data.load_dataset(c.dataset, c.data_dir, c.download)
  results = []
  for method in FLAGS.methods or [c.method]:
    with c.unlocked():
      c.method = method
    with config_lib.matmul_precision(c):
      results.append(time_method(c, ds))
  if FLAGS.json:
    with open(FLAGS.json, 'w') as f:
      json.dump({'commit': commit(), 'rounds': FLAGS.rounds, 'runs': results}, f, indent=2)


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  app.run(main)
