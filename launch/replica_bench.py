"""Packed seeds against separate processes: training throughput on one device, and the time of
the paper's grid projected from it.

For each compute dtype, `simulator.clients_per_call` and R in `--replicas`: R seeds (0..R-1) of the
config on synthetic CIFAR-shaped data (the same work as the data set), packed into the same
compiled calls (one Simulator of R seeds; R = 1 is a plain run). One round compiles,
then `--rounds` rounds of training and server are timed; evaluation is timed apart, once. With
`--processes`, the same R seeds also run as R processes side by side on the device (what
`launch/sweep.py --parallel` does), each of its seed alone, starting their timed rounds together;
their images/s add up.

Each row gives s/round, training images/s, the FLOP/s achieved by XLA's count of the families'
training steps (RoundInfo.client_flops), and that rate's share of two references: the matmul
rate measured here in the row's dtype (float32 at the config's `simulator.matmul_precision`, which
on recent NVIDIA GPUs means TF32 under 'default'), and the chip's datasheet peak where it is
known. Then the paper's grid (Tables 1 and 2: 8 methods x 2 data sets x 3 (N, C) x {hetero,
homo}, 500 rounds each, 3 seeds: 288 runs) as FLOPs of client training, and its time at each
row's rate.

  python launch/replica_bench.py --config=configs/cifar10.py:hetero,n10 \\
      --config.local_epochs=5 --replicas=1,3,8 --dtypes=float32,bfloat16 --rounds=5 \\
      --processes --out=runs/replica_bench/n10.json

The seeds share one partition here (row_config), unlike `--seeds`, whose seeds each draw their
own by default: the work per round is alike, and the shapes are the same in every process.
"""
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time

from absl import app, flags
import jax
import numpy as np
from ml_collections import config_flags

from fedssa_jax import config_lib, data, methods
from fedssa_jax.engine import costs, simulator
from fedssa_jax.run import bench, console

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', None, 'Config file with variants.', lock_config=True)
flags.DEFINE_list('replicas', ['1', '3', '8'], 'Seeds packed per row (R).')
flags.DEFINE_list('dtypes', ['float32', 'bfloat16'], 'engine.compute_dtype of the rows.')
flags.DEFINE_list('per_call', ['0'], 'engine.clients_per_call of the rows (0: the default).')
flags.DEFINE_integer('rounds', 5, 'Timed rounds, after one that compiles.')
flags.DEFINE_bool('processes', False, 'Also run each R > 1 as R processes side by side.')
flags.DEFINE_bool('grid', True, 'Project the paper grid\'s time from each row\'s rate.')
flags.DEFINE_string('out', None, 'Write the rows (and the grid) as JSON here.')
# The side-by-side processes (--processes) are this script again, one seed each.
flags.DEFINE_integer('child_seed', None, 'Internal: run this seed alone, as one of the processes.')
flags.DEFINE_string('barrier', None, 'Internal: the processes\' folder to start together.')

# Dense datasheet peaks, FLOP/s: (TF32, bfloat16), by a name in jax's device_kind.
DATASHEET = {'H200': (494.7e12, 989.4e12), 'H100 80GB HBM3': (494.7e12, 989.4e12),
             'A100': (156e12, 312e12)}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def datasheet_peak(dtype: str) -> float | None:
  kind = jax.devices()[0].device_kind
  for name, (tf32, bf16) in DATASHEET.items():
    if name in kind:
      return bf16 if dtype == 'bfloat16' else tf32
  return None


def row_config(dtype: str, per_call: int, seed: int = 0):
  """Seed `seed` of the row. The seeds share partition 0: the same shapes in every process, so
  that the side-by-side processes find their programs in a persistent compilation cache
  (JAX_COMPILATION_CACHE_DIR) once one of them has compiled them."""
  c = FLAGS.config.copy_and_resolve_references()
  c.engine.compute_dtype, c.engine.clients_per_call, c.seed = dtype, per_call, seed
  c.engine.mesh_devices, c.partition.seed = 1, 0
  config_lib.validate(c)
  return c


def timed_rounds(run_round, state, rounds: int, wait=None):
  """Runs one round (compiles), calls `wait`, then times `rounds` rounds. Returns (state, wall
  seconds, start and end times, training samples, FLOPs) of the timed rounds."""
  state, _ = run_round(state)
  jax.block_until_ready(state)
  if wait:
    wait()
  samples = flops = 0.0
  start = time.time()
  for _ in range(rounds):
    state, infos = run_round(state)
    for info in infos:
      samples += float(info.train_samples.sum())
      flops += info.client_flops
  jax.block_until_ready(state)
  end = time.time()
  return state, end - start, start, end, samples, flops


def packed_row(ds, dtype: str, per_call: int, r: int) -> dict:
  configs = [row_config(dtype, per_call, s) for s in range(r)]
  sim = simulator.Simulator(configs[0], ds, [data.partition_from_config(c, ds) for c in configs],
                         seeds=range(r))
  state, wall, _, _, samples, flops = timed_rounds(sim.run_round, sim.init_state(),
                                                    FLAGS.rounds)
  eval_s = {}
  if r == 1:
    t0 = time.time()
    jax.block_until_ready(sim.evaluate(state).accuracy)
    t1 = time.time()  # again, not from the previous evaluation (which would reuse it)
    jax.block_until_ready(sim.evaluate(state).accuracy)
    eval_s = {'eval_first_s': t1 - t0, 'eval_s': time.time() - t1}
  return {'mode': 'packed', 'seconds_per_round': wall / FLAGS.rounds,
          'images_per_s': samples / wall, 'flops_per_s': flops / wall,
          'clients_per_call': [g.clients_per_call for g in sim.groups], **eval_s}


def processes_row(dtype: str, per_call: int, r: int) -> dict:
  """R processes of this script side by side, one seed each, timed over the same window."""
  with tempfile.TemporaryDirectory() as barrier:
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=f'{0.9 / r:.3f}')
    argv = [a for a in sys.argv[1:] if not a.startswith(('--replicas', '--dtypes', '--per_call',
                                                          '--processes', '--out', '--grid'))]
    procs = [subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *argv, f'--dtypes={dtype}',
         f'--per_call={per_call}', f'--child_seed={s}', f'--barrier={barrier}'],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for s in range(r)]
    deadline = time.time() + 1800
    while len([f for f in os.listdir(barrier) if f.startswith('ready')]) < r:
      if any(p.poll() is not None for p in procs) or time.time() > deadline:
        for p in procs:
          p.kill()
        errors = [p.communicate()[1][-2000:] for p in procs]
        raise RuntimeError(f'A side-by-side process did not get ready: {errors}')
      time.sleep(0.2)
    open(os.path.join(barrier, 'go'), 'w').close()
    results = []
    for p in procs:
      out, err = p.communicate()
      lines = [l for l in out.splitlines() if l.startswith('CHILD ')]
      if p.returncode or not lines:
        raise RuntimeError(f'A side-by-side process failed: {err[-2000:]}')
      results.append(json.loads(lines[-1][len('CHILD '):]))
  wall = max(x['end'] for x in results) - min(x['start'] for x in results)
  return {'mode': 'processes', 'seconds_per_round': wall / FLAGS.rounds,
          'images_per_s': sum(x['samples'] for x in results) / wall,
          'flops_per_s': sum(x['flops'] for x in results) / wall}


def child(ds) -> None:
  c = row_config(FLAGS.dtypes[0], int(FLAGS.per_call[0]), FLAGS.child_seed)
  sim = simulator.Simulator(c, ds, data.partition_from_config(c, ds))

  def wait():
    open(os.path.join(FLAGS.barrier, f'ready{FLAGS.child_seed}'), 'w').close()
    while not os.path.exists(os.path.join(FLAGS.barrier, 'go')):
      time.sleep(0.05)
  _, _, start, end, samples, flops = timed_rounds(sim.run_round, sim.init_state(), FLAGS.rounds,
                                                  wait)
  print('CHILD ' + json.dumps({'start': start, 'end': end, 'samples': samples, 'flops': flops}),
        flush=True)


def grid_flops() -> dict:
  """FLOPs of client training in the paper's grid (configs/sweeps.py's table1 and table2, 288
  runs), by model setting: each run's expected participation x E x (sum over clients of samples
  x FLOPs per sample of its family and method) per round, times its rounds. Evaluation and the
  server are left out."""
  sweeps = runpy.run_path(os.path.join(REPO, 'configs', 'sweeps.py'))
  total, datasets, partitions = {}, {}, {}
  for run in sweeps['table1']() + sweeps['table2']():
    dataset, variants = os.path.splitext(os.path.basename(run.config))[0], run.config.split(':')[1]
    c = config_lib.build(dataset, variants)
    c.update_from_flattened_dict(run.override_dict)
    classes = 10 if dataset == 'cifar10' else 100
    if classes not in datasets:
      datasets[classes] = data.synthetic_cifar(classes)
    key = (run.config, c.seed)  # the methods of a setting and seed share its partition
    if key not in partitions:
      partitions[key] = data.partition_from_config(c, datasets[classes]).train_n
    train_n = partitions[key]
    method = methods.get_method(c.method)(c, len(train_n), classes)
    flops_of = lambda f, classes=classes, c=c: costs.model_flops(f, classes, c.batch_size,
                                                                 c.model.feature_dim)
    per_family = {f: method.train_flops_per_sample(flops_of(f), flops_of)
                  for f in c.model.families}
    per_sample = np.array([per_family[c.model.families[i % len(c.model.families)]]
                           for i in range(len(train_n))])
    model = variants.split(',')[0]
    total[model] = total.get(model, 0.0) + (
        c.participation * c.local_epochs * float(per_sample @ train_n) * c.num_rounds)
  return total


def main(_):
  with console.configured(verbose=False):
    bench_rows()


def bench_rows():
  c = FLAGS.config
  ds = data.synthetic_cifar(10 if c.dataset == 'cifar10' else 100)
  if FLAGS.child_seed is not None:
    with config_lib.matmul_precision(c):
      return child(ds)
  device = jax.devices()[0].device_kind
  rows = []
  with config_lib.matmul_precision(c):
    for dtype in FLAGS.dtypes:
      rate = bench.matmul_roofline(quick=False, dtype=dtype)['flops_per_s']
      peak = datasheet_peak(dtype)
      for per_call in map(int, FLAGS.per_call):
        for r in map(int, FLAGS.replicas):
          modes = [packed_row] + ([processes_row] if FLAGS.processes and r > 1 else [])
          for mode in modes:
            row = mode(ds, dtype, per_call, r) if mode is packed_row else mode(dtype, per_call, r)
            row.update(dtype=dtype, per_call=per_call, replicas=r, matmul_flops_per_s=rate,
                       datasheet_flops_per_s=peak)
            rows.append(row)
            print(row_line(row, rows), flush=True)
  grid = grid_flops() if FLAGS.grid else None
  print(report(rows, grid, device))
  if FLAGS.out:
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    with open(FLAGS.out, 'w') as f:
      json.dump({'device': device, 'backend': jax.default_backend(), 'config': c.to_dict(),
                 'rounds': FLAGS.rounds, 'rows': rows, 'grid_flops': grid}, f, indent=1)


def row_line(row: dict, rows: list) -> str:
  """One row as a markdown table line; its speed also against R = 1 packed of its dtype."""
  one = [x for x in rows if x['mode'] == 'packed' and x['replicas'] == 1
         and x['dtype'] == row['dtype'] and x['per_call'] == row['per_call']]
  gain = f"{row['images_per_s'] / one[0]['images_per_s']:.2f}x" if one else '-'
  peak = row['datasheet_flops_per_s']
  return (f"| {row['dtype']} | {row['per_call'] or 'auto'} | {row['replicas']} | {row['mode']} | "
          f"{row['seconds_per_round']:.3f} | {row['images_per_s']:,.0f} | {gain} | "
          f"{row['flops_per_s'] / 1e12:.3g} | {row['flops_per_s'] / row['matmul_flops_per_s']:.1%}"
          f" | {'-' if peak is None else format(row['flops_per_s'] / peak, '.1%')} |")


def report(rows: list, grid: dict | None, device: str) -> str:
  lines = [f'{device} ({jax.default_backend()}), {FLAGS.rounds} timed rounds', '',
           '| dtype | clients/call | R | mode | s/round | images/s | vs R=1 | TFLOP/s | '
           'of matmul rate | of datasheet peak |', '|---|---|---|---|---|---|---|---|---|---|']
  lines += [row_line(r, rows[:i + 1]) for i, r in enumerate(rows)]
  evals = [r for r in rows if 'eval_s' in r]
  for r in evals:
    lines.append(f"\nEvaluation of all clients ({r['dtype']}): {r['eval_s']:.3f} s "
                 f"({r['eval_s'] / (r['eval_s'] + r['seconds_per_round']):.0%} of a round that "
                 'evaluates), first call with compile ' f"{r['eval_first_s']:.1f} s.")
  if grid:
    total = sum(grid.values())
    lines += ['', f'Paper grid: 288 runs, {total / 1e15:,.0f} PFLOP of client training ('
              + ', '.join(f'{k} {v / 1e15:,.0f}' for k, v in grid.items()) + '); its time at '
              'each row\'s rate, hours:', '']
    lines += [f"- {r['dtype']}, {r['per_call'] or 'auto'}/call, R={r['replicas']} {r['mode']}: "
              f"{total / r['flops_per_s'] / 3600:,.1f}" for r in rows]
  return '\n'.join(lines)


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  app.run(main)
