"""Costs of a cross-device population: one whole run (the training loop of run/train.py, its
records, config.json and checkpoints) at N clients, K a round, on the disk store with the
resampling partition, timed phase by phase.

  python launch/scale_costs.py --clients=100000 --participation=0.01 --rounds=3 \
      --workdir=/tmp/scale_100k [--data_dir=$HOME/tensorflow_datasets | --synthetic] \
      [--set=method=fedssa --set=eval_clients=1000 ...] [--json=out.json]

A run is `configs/cifar10.py:hetero` with N = --clients, C = --participation, E = 1,
`partition.kind=resample`, `population_store=disk` and `eval_clients` 1,000 (--set overrides any
field). Each round is split, from the Simulator's phase callback (which waits for each phase's
arrays, so the phases do not overlap as they do in a plain run):
- training: the cohort's chunks (read from the store, trained, written back);
- server: the method's server rule and the round's statistics;
- evaluation: the evaluated clients trained since the last evaluation (all of them the first
  time);
- outputs: the rest of the round: guards, observers, the metrics record, the checkpoint, and
  the next round's cohort.
It prints one JSON line per round and a summary: seconds of each phase (wall and the process's
CPU time, which a loaded machine inflates less), partition time, peak RSS of the process
(ru_maxrss: it counts the memory-mapped store pages it touched) and peak anonymous RSS (its own
arrays, sampled every 0.2 s), the store's
disk use (allocated blocks, the files being sparse), the checkpoints' and metrics.jsonl's sizes.
Run one population per process: the peak RSS is the process's.
"""
from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import subprocess
import threading
import time

from absl import app, flags
import jax

from fedssa_jax import config_lib, data
from fedssa_jax.engine import simulator
from fedssa_jax.run import train

FLAGS = flags.FLAGS
flags.DEFINE_integer('clients', 10_000, 'N.')
flags.DEFINE_float('participation', 0.01, 'C: K = floor(C N) a round.')
flags.DEFINE_integer('rounds', 3, 'Rounds; the first one compiles.')
flags.DEFINE_string('workdir', None, 'The run folder (emptied first).')
flags.DEFINE_string('data_dir', None, 'TFDS data_dir of CIFAR-10.')
flags.DEFINE_bool('synthetic', False, 'Random CIFAR-shaped images instead of CIFAR-10.')
flags.DEFINE_multi_string('set', [], 'field=value overrides of the config (repeatable).')
flags.DEFINE_string('json', None, 'Write the figures to this JSON file.')


def disk_bytes(path: str) -> int:
  """Bytes allocated under `path` (sparse files count their written blocks only)."""
  total = 0
  for root, _, files in os.walk(path):
    for f in files:
      try:
        total += os.stat(os.path.join(root, f)).st_blocks * 512
      except FileNotFoundError:
        pass
  return total


class PeakMemory:
  """Samples the process's anonymous resident memory (RssAnon: its own arrays, without the
  pages of the memory-mapped store, which the kernel may drop and read again) every 0.2 s."""

  def __init__(self):
    self.peak_anon = 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self):
    while not self._stop.wait(0.2):
      with open('/proc/self/status') as f:
        for line in f:
          if line.startswith('RssAnon:'):
            self.peak_anon = max(self.peak_anon, int(line.split()[1]) * 1024)

  def stop(self) -> int:
    self._stop.set()
    self._thread.join()
    return self.peak_anon


class Marks:
  """The Simulator's phase callback: the time of each phase's end, after its arrays."""

  def __init__(self):
    self.marks: list[tuple[str, float, float]] = []

  def __call__(self, name, *arrays):
    jax.block_until_ready(arrays)
    self.marks.append((name, time.perf_counter(), time.process_time()))


def split(marks: list, start: tuple, end: tuple, clock: int) -> tuple[float, list]:
  """(setup seconds, [seconds of each round's phases]) from the marks, of wall time (`clock`
  1) or of the process's CPU time (2): a round runs from its 'sample' mark to the next one (or
  `end`), its outputs after its evaluation."""
  setup, rounds, last, cur = 0.0, [], start[clock - 1], None
  for name, *times in marks:
    t = times[clock - 1]
    if name == 'sample':
      if cur is None:
        setup = t - last
      else:
        cur['outputs'] += t - last
        rounds.append(cur)
      cur = {'training': 0.0, 'server': 0.0, 'evaluation': 0.0, 'outputs': 0.0}
    elif name == 'train':
      cur['training'] += t - last
    elif name in ('aggregate', 'host'):
      cur['server'] += t - last
    elif name == 'evaluate':
      cur['evaluation'] += t - last
    last = t
  cur['outputs'] += end[clock - 1] - last
  rounds.append(cur)
  return setup, rounds


def summary_of(rounds: list) -> dict:
  return {'first_round': {k: round(v, 1) for k, v in rounds[0].items()},
          'later_rounds_mean': {k: round(sum(r[k] for r in rounds[1:]) / max(len(rounds) - 1, 1),
                                         2) for k in rounds[0]}}


def config():
  c = config_lib.build('cifar10', 'hetero')
  c.num_clients, c.participation, c.local_epochs = FLAGS.clients, FLAGS.participation, 1
  c.num_rounds, c.checkpoint_every = FLAGS.rounds, FLAGS.rounds
  c.partition.kind, c.population_store = 'resample', 'disk'
  c.eval_clients = min(1000, FLAGS.clients)
  c.data_dir = FLAGS.data_dir
  for item in FLAGS.set:
    field, value = item.split('=', 1)
    node = c
    *parents, leaf = field.split('.')
    for p in parents:
      node = node[p]
    node[leaf] = type(node[leaf])(json.loads(value) if not isinstance(node[leaf], str)
                                  else value)
  return c


def main(argv):
  del argv
  c = config()
  config_lib.validate(c)
  commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True,
                          text=True, check=False).stdout.strip()  # the code this run imported
  workdir = FLAGS.workdir
  shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(workdir)
  memory = PeakMemory()
  t0 = time.perf_counter()
  ds = (data.synthetic_cifar(10, 50_000, 10_000) if FLAGS.synthetic else
        data.load_dataset('cifar10', c.data_dir))
  load_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  data.partition_from_config(c, ds)
  partition_s = time.perf_counter() - t0
  marks = Marks()
  made = simulator.Simulator
  simulator.Simulator = functools.partial(made, phase=marks)  # train.py builds it by name
  start = (time.perf_counter(), time.process_time())
  try:
    summary = train.train_and_evaluate(c, workdir, ds)
  finally:
    simulator.Simulator = made
  end = (time.perf_counter(), time.process_time())
  wall = end[0] - start[0]
  setup, rounds = split(marks.marks, start, end, 1)
  cpu_setup, cpu_rounds = split(marks.marks, start, end, 2)
  for r, (phases, cpu) in enumerate(zip(rounds, cpu_rounds), 1):
    print(json.dumps({'round': r, 'wall': {k: round(v, 2) for k, v in phases.items()},
                      'cpu': {k: round(v, 2) for k, v in cpu.items()}}), flush=True)
  metrics = os.path.join(workdir, 'metrics.jsonl')
  out = {
      'N': c.num_clients, 'K': max(1, int(c.participation * c.num_clients)),
      'method': c.method, 'evaluated': c.eval_clients, 'rounds': FLAGS.rounds,
      'overrides': FLAGS.set, 'commit': commit, 'load_s': round(load_s, 1),
      'partition_s': round(partition_s, 2), 'wall_s': round(wall, 1),
      'cpu_s': round(end[1] - start[1], 1), 'setup_s': round(setup, 1),
      'wall': summary_of(rounds), 'cpu': summary_of(cpu_rounds),
      'peak_rss_gb': round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
      'peak_anon_rss_gb': round(memory.stop() / 2**30, 2),
      'population_gb': round(disk_bytes(os.path.join(workdir, 'population')) / 2**30, 2),
      'checkpoints_mb': round(disk_bytes(os.path.join(workdir, 'checkpoints')) / 2**20, 1),
      'metrics_jsonl_kb': round(os.path.getsize(metrics) / 2**10, 1),
      'config_json_kb': round(os.path.getsize(os.path.join(workdir, 'config.json')) / 2**10, 1),
      'final_mean_accuracy': summary['final_mean_accuracy'],
      'loadavg_1min_end': os.getloadavg()[0],
  }
  print(json.dumps(out), flush=True)
  if FLAGS.json:
    with open(FLAGS.json, 'w') as f:
      json.dump(out, f, indent=1)


if __name__ == '__main__':
  flags.mark_flag_as_required('workdir')
  app.run(main)
