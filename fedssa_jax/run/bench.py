"""The benchmark harness: speed figures, each beside a reference measured in the same run.

  python -m fedssa_jax.run.bench [--quick] [--out=bench.json]

Prints one table per section and writes all figures as JSON:
- roofline: the machine's matmul rate (large jitted float32 matmuls), the reference for every
  FLOP/s figure below;
- local training: images/s per model family at batch 512 and 64, for one client and vmapped
  groups of 2, 5 and 10, with achieved FLOP/s as a share of the roofline;
- rounds: FedSSA's whole-round wall time at `cifar10:hetero,n10`, `:hetero,n100` and
  `:homo,n50`, E=1, split into phases (sampling, training calls, of which gather/download/
  upload/scatter, aggregation, host transfers, evaluation), compile count and seconds (none after
  round 1), peak memory;
- padding: the share of padded training work at `:hetero,n100`, pathological and Dirichlet
  0.1 / 0.5, under the backend's chunking;
- dp_sgd: DP-SGD's local training (per-example gradients, clipped and noised: privacy/dp_sgd.py)
  against plain training of the same family, batch and steps, in seconds and in the compiled
  program's temporary memory (XLA's memory analysis), with each example's gradient built and
  with ghost norms.

Data are synthetic CIFAR-shaped images (data.synthetic_cifar): the work is that of the real data
set. `--quick` (CI smoke) runs small cases only, in well under two minutes on 2 cores.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import resource
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from fedssa_jax import config_lib, data, models, privacy
from fedssa_jax.data.partition import DeviceData
from fedssa_jax.engine import costs, parts, simulator, training
from fedssa_jax.methods import standalone

FLAGS = flags.FLAGS


class CompileCounter:
  """Counts XLA compilations and their seconds, from JAX's monitoring events."""

  def __init__(self):
    self.count, self.seconds = 0, 0.0
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, name, seconds, **_):
    if name == '/jax/core/compile/backend_compile_duration':
      self.count += 1
      self.seconds += seconds


def best_time(fn, repeats: int) -> float:
  """The fastest of `repeats` calls of fn() (which must block), in seconds."""
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return min(times)


def matmul_roofline(quick: bool, dtype: str = 'float32') -> dict:
  """Matmul FLOP/s in `dtype` (at the matmul precision in effect): the best over a few large
  shapes, and on an accelerator an 8192-cube too, with about 20 GFLOP (CPU) or 20 TFLOP per
  timing."""
  shapes = [(512, 800, 2000)] if quick else [(512, 800, 2000), (1024, 1024, 1024),
                                             (2048, 2048, 2048)]
  on_cpu = jax.default_backend() == 'cpu'
  if not (quick or on_cpu):
    shapes.append((8192, 8192, 8192))
  best, rates = 0.0, []
  for m, k, n in shapes:
    a = jax.random.normal(jax.random.PRNGKey(0), (m, k), dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (k, n), dtype)
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    reps = max(1, int((2e10 if on_cpu else 2e13) // (2 * m * k * n)))

    def run():
      for _ in range(reps):
        out = f(a, b)
      out.block_until_ready()
    rates.append(reps * 2 * m * k * n / best_time(run, 3))
    best = max(best, rates[-1])
  return {'flops_per_s': best, 'shapes': shapes, 'shape_flops_per_s': rates}


def train_call(family: str, batch: int, clients: int, steps: int, ds: data.Dataset,
               micro_batch: int = 0, **train):
  """The engine's vmapped local_train for a group of `clients` clients of `steps` full batches
  each, with forward/backward passes of `micro_batch` rows (0: the whole batch); `train`: other
  `training.TrainConfig` fields (the optimizer's: the paper's by default). Returns
  (call, args, images): the jitted call, its arguments, and the samples a call trains on."""
  config = config_lib.base_config('cifar10')  # the paper's models: model.feature_dim's default
  model = models.make_model(family, ds.num_classes, feature_dim=config.model.feature_dim)
  cfg = training.TrainConfig(batch_size=batch, local_epochs=1, mean=ds.mean, std=ds.std,
                             micro_batch=micro_batch, **train)
  n = batch * steps
  idx = np.stack([np.arange(n) + c * n for c in range(clients)]).astype(np.int32)
  dd = DeviceData(jnp.asarray(ds.images[:clients * n]), jnp.asarray(ds.labels[:clients * n]),
                         jnp.asarray(idx), jnp.full((clients,), n), jnp.asarray(idx),
                         jnp.full((clients,), n))
  keys = jax.random.split(jax.random.PRNGKey(0), clients)
  params = jax.vmap(functools.partial(models.init_params, model))(keys)
  method = standalone.Standalone(config, clients, ds.num_classes)
  train = functools.partial(training.local_train, apply_fn=model.apply, cfg=cfg, method=method,
                            train_apply=getattr(model, 'train_apply', None))
  call = jax.jit(jax.vmap(lambda p, k, i, n: train({'model': p}, (), k, i, n, dd)))
  return call, (params, keys, dd.train_idx, dd.train_n), clients * n


def train_throughput(family: str, batch: int, clients: int, steps: int, roofline: float,
                     ds: data.Dataset, micro_batch: int = 0) -> dict:
  """Images/s of local training (`train_call`) and its FLOP/s as a share of `roofline`."""
  call, args, images = train_call(family, batch, clients, steps, ds, micro_batch)
  run = lambda: jax.block_until_ready(call(*args))
  run()
  images_per_s = images / best_time(run, 3)
  feature_dim = config_lib.base_config('cifar10').model.feature_dim  # as train_call's model
  flops = costs.xla_train_flops_per_sample(family, ds.num_classes, batch,
                                           feature_dim) * images_per_s
  return {'family': family, 'batch': batch, 'passes': micro_batch or batch, 'clients': clients,
          'images_per_s': images_per_s, 'flops_per_s': flops, 'roofline_share': flops / roofline}


def compiled_with_temp_bytes(call, args):
  """`call` compiled once for `args` (ahead of time), and that program's temporary memory (XLA's
  memory analysis; None where the backend gives none)."""
  compiled = call.lower(*args).compile()
  try:
    temp = int(compiled.memory_analysis().temp_size_in_bytes)
  except (AttributeError, NotImplementedError, TypeError):
    temp = None
  return compiled, temp


def timed_program(call, args) -> tuple[float, int | None]:
  """Seconds a call of `call` on `args` takes (compiled once, run once first) and its
  program's temporary bytes."""
  compiled, temp = compiled_with_temp_bytes(call, args)
  run = lambda: jax.block_until_ready(compiled(*args))
  run()
  return best_time(run, 3), temp


def dp_sgd_cost(family: str, batch: int, steps: int, ds: data.Dataset, pass_size: int,
                per_example: str = 'vmap', plain_cache: dict | None = None) -> dict:
  """One client's local training of `steps` batches with DP-SGD (Poisson batches of expected
  size `batch`, each example's gradient clipped to 1 and the sum noised at sigma 1.1, in passes
  of `pass_size` examples) against plain training of the same family, batch and steps (in the
  engine's passes): seconds a call and the compiled program's temporary bytes, and their
  ratios. `plain_cache`: the plain figures of earlier calls by (family, batch, steps), which
  the cases of two per-example modes share (each program is compiled once)."""
  passes = parts.micro_batch(config_lib.build('cifar10', 'hetero'))
  cache = {} if plain_cache is None else plain_cache
  if (family, batch, steps) not in cache:
    plain, plain_args, images = train_call(family, batch, 1, steps, ds,
                                           passes if batch % passes == 0 else 0)
    cache[family, batch, steps] = (*timed_program(plain, plain_args), images)
  plain_s, plain_temp, images = cache[family, batch, steps]
  dp = privacy.dp_sgd_settings(1.0, 1.1, batch, batch * steps, pass_size, per_example, passes)
  noisy, noisy_args, _ = train_call(family, batch, 1, steps, ds, dp=dp)
  dp_s, dp_temp = timed_program(noisy, noisy_args)
  out = {'family': family, 'batch': batch, 'steps': steps, 'per_example': per_example,
         'pass_size': dp.ghost_pass or dp.max_batch if per_example == 'auto' else pass_size,
         'max_batch': dp.max_batch, 'images': images, 'plain_s': plain_s,
         'plain_temp_bytes': plain_temp, 'dp_sgd_s': dp_s, 'dp_sgd_temp_bytes': dp_temp}
  out['time_ratio'] = out['dp_sgd_s'] / out['plain_s']
  if out['plain_temp_bytes'] and out['dp_sgd_temp_bytes']:
    out['memory_ratio'] = out['dp_sgd_temp_bytes'] / out['plain_temp_bytes']
  return out


def padding_share(sim: simulator.Simulator, rounds: int, per_call: int | None = None) -> float:
  """Share of the training rows computed that are padding, over the cohorts of `rounds` rounds.

  A vmapped chunk runs its largest client's step count for all its slots; within a step it runs
  the passes of `micro_batch` rows that its fullest client needs (one whole batch without
  micro-batching, or for losses that couple a batch's samples)."""
  b = sim.config.batch_size
  m = sim.train_cfg.micro_batch if sim.method.per_sample_loss else b
  useful = total = 0
  for t in range(rounds):
    for gi, slots, active in sim.chunks(sim.cohort(t), per_call):
      n = sim.train_n[0][sim.groups[gi].members[slots[active]]]
      useful += n.sum()
      for step in range(-(-n.max() // b)):
        rows = np.clip(n - step * b, 0, b)
        total += len(slots) * (-(-rows.max() // m)) * m
  return 1.0 - useful / max(total, 1)


def peak_memory() -> dict:
  dev = jax.devices()[0]
  stats = dev.memory_stats() if hasattr(dev, 'memory_stats') else None
  if stats and 'peak_bytes_in_use' in stats:
    return {'peak_device_bytes': stats['peak_bytes_in_use']}
  return {'peak_rss_bytes': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def masked_train_seconds(sim: simulator.Simulator, state, rounds: int) -> float:
  """Seconds per round of the training calls' work besides training: the same compiled calls
  on the chunks of the last `rounds` rounds (run already, so compiled) with every client
  masked, so that no step runs (`Simulator.train_chunks`). The calls take the state's
  population (donated), so `state` is used up."""
  population, server = state.population, state.server
  t0 = time.perf_counter()
  for t in range(state.round - rounds, state.round):
    masked = [dataclasses.replace(c, active=np.zeros_like(c.active))
              for c in sim.plan([sim.cohort(t)])]
    population, server, _ = sim.train_chunks(population, server, masked, t)
  jax.block_until_ready((population, server))
  return (time.perf_counter() - t0) / rounds


class PhaseTimer:
  """The Simulator's `phase` callback of a benchmark: adds the time since the last call to
  phase `name`, after waiting for `arrays` (the syncs cost overlap, so runs go without it)."""

  def __init__(self):
    self.seconds: dict[str, float] = {}
    self.last = time.perf_counter()

  def __call__(self, name: str, *arrays) -> None:
    jax.block_until_ready(arrays)
    now = time.perf_counter()
    self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
    self.last = now


def round_phases(arg: str, rounds: int, ds: data.Dataset, compiles: CompileCounter,
                 overhead: bool, **overrides) -> dict:
  """FedSSA's rounds at `cifar10:<arg>`, E=1: per-phase seconds over rounds 2..R."""
  c = config_lib.build('cifar10', arg)
  c.local_epochs, c.num_rounds = 1, rounds
  c.update_from_flattened_dict(overrides)
  with config_lib.matmul_precision(c):
    timer = PhaseTimer()
    sim = simulator.Simulator(c, ds, data.partition_from_config(c, ds), phase=timer)
    state = sim.init_state()
    before = compiles.count, compiles.seconds
    t0 = time.perf_counter()
    state, _ = sim.run_round(state)
    ev = sim.evaluate(state)
    first = time.perf_counter() - t0
    first_compiles = (compiles.count - before[0], compiles.seconds - before[1])
    timer.seconds.clear()
    before = compiles.count
    t0 = time.perf_counter()
    for _ in range(rounds - 1):  # as the training loop evaluates: only clients trained since
      state, _ = sim.run_round(state)
      ev = sim.evaluate(state, previous=ev)
    steady = (time.perf_counter() - t0) / (rounds - 1)
    phases = {k: v / (rounds - 1) for k, v in timer.seconds.items()}
    later_compiles = compiles.count - before
    if overhead:
      phases['train: gather/download/upload/scatter'] = masked_train_seconds(sim, state, rounds - 1)
  return {'config': f'cifar10:{arg}', 'E': 1, 'first_round_s': first,
          'first_round_compiles': first_compiles[0],
          'first_round_compile_s': first_compiles[1], 'later_compiles': later_compiles,
          'steady_round_s': steady, 'phases_s': phases, **peak_memory()}


def print_table(title, header, rows):
  print(f'\n## {title}\n')
  print('| ' + ' | '.join(header) + ' |')
  print('|' + '---|' * len(header))
  for r in rows:
    print('| ' + ' | '.join(r) + ' |')


SECTIONS = ('training', 'rounds', 'padding', 'dp_sgd')


def run(quick: bool, rounds: int, sections=SECTIONS, families=models.FAMILY_NAMES) -> dict:
  compiles = CompileCounter()
  out = {'backend': jax.default_backend(), 'device': str(jax.devices()[0]),
         'jax_version': jax.__version__, 'quick': quick}
  roof = matmul_roofline(quick)
  out['roofline'] = roof
  print_table('Roofline (the best is the reference below)', ['float32 matmul', 'GFLOP/s'],
              [['x'.join(map(str, s)), f'{r / 1e9:.1f}']
               for s, r in zip(roof['shapes'], roof['shape_flops_per_s'])])

  # Quick: 200 training images a client in the rounds section (it times, not trains).
  ds = data.synthetic_cifar(10, 50_000 if not quick else 1_000, 10_000 if not quick else 500)
  if 'training' in sections:
    _training(out, quick, ds, roof, families)
  if 'rounds' in sections:
    _rounds(out, quick, rounds, ds, compiles)
  if 'padding' in sections:
    _padding(out, quick, ds)
  if 'dp_sgd' in sections:
    _dp_sgd(out, quick, ds, families)
  return out


def _training(out, quick, ds, roof, families):
  # Batch 512 as the engine runs it on this backend (in passes of parts.micro_batch's auto
  # rows), batch 64, and batch 512 in one pass for one client.
  passes = parts.micro_batch(config_lib.build('cifar10', 'hetero'))
  cases = ([('cnn5', 64, 2, 2, 0)] if quick else  # quick: one vmapped group
           [(f, b, k, max(2, 2048 // b), m) for f in families
            for b, m in ((512, passes), (64, 0)) for k in (1, 2, 5, 10)]
           + ([(f, 512, 1, 4, 0) for f in families] if passes != 512 else []))
  out['training'] = [train_throughput(f, b, k, s, roof['flops_per_s'], ds, m)
                     for f, b, k, s, m in cases]
  print_table('Local training', ['family', 'batch', 'rows per pass', 'clients', 'images/s',
                                 'GFLOP/s', 'share of roofline'],
              [[r['family'], str(r['batch']), str(r['passes']), str(r['clients']),
                f"{r['images_per_s']:.0f}", f"{r['flops_per_s'] / 1e9:.1f}",
                f"{r['roofline_share']:.0%}"] for r in out['training']])


def _rounds(out, quick, rounds, ds, compiles):
  if quick:  # one small family, every client in round 1: later rounds must compile nothing
    out['rounds'] = [round_phases('homo,tiny', rounds, ds, compiles, overhead=False,
                                  participation=1.0, **{'model.families': ('cnn5',)})]
  else:
    out['rounds'] = [round_phases(a, rounds, ds, compiles, overhead=True)
                     for a in ('hetero,n10', 'hetero,n100', 'homo,n50')]
  rows = []
  for r in out['rounds']:
    total = sum(v for k, v in r['phases_s'].items() if not k.startswith('train:'))
    shares = ', '.join(f'{k} {v / total:.0%}' for k, v in r['phases_s'].items())
    rows.append([r['config'], f"{r['steady_round_s']:.2f}", f"{r['first_round_s']:.1f}",
                 f"{r['first_round_compiles']} / {r['first_round_compile_s']:.1f} s",
                 str(r['later_compiles']), shares])
  print_table('FedSSA rounds, E=1 (rounds after the first)',
              ['config', 's/round', 'round 1 s', 'round 1 compiles', 'later compiles',
               'phases (share of the round)'], rows)


def _padding(out, quick, ds):
  pad_rows = []
  out['padding'] = []
  cases = [('tiny', None)] if quick else [('hetero,n100', None), ('hetero,n100,dir', 0.1),
                                          ('hetero,n100,dir', 0.5)]
  for arg, gamma in cases:
    c = config_lib.build('cifar10', arg)
    if gamma is not None:
      c.partition.dirichlet_gamma = gamma
    kind = f'dirichlet {gamma}' if gamma is not None else c.partition.kind
    sim = simulator.Simulator(c, ds, data.partition_from_config(c, ds))
    row = {'config': f'cifar10:{arg}', 'partition': kind,
           'padded_share': padding_share(sim, 20),
           'padded_share_vmapped': padding_share(sim, 20, -(-sim.k // len(sim.groups)))}
    out['padding'].append(row)
    pad_rows.append([row['config'], kind, f"{row['padded_share']:.1%}",
                     f"{row['padded_share_vmapped']:.1%}"])
  print_table('Padded share of training work (20 rounds of cohorts)',
              ['config', 'partition', 'this backend\'s chunks', 'chunks of ceil(K/families)'],
              pad_rows)


def _dp_sgd(out, quick, ds, families):
  # The paper's batch for every family: each example's gradient built ('vmap', at the
  # backend's automatic pass size) and ghost norms ('auto', in the engine's passes).
  auto = privacy.pass_size_for(0, jax.default_backend())
  # Quick: ghost norms only (the engine's default; privacy_test checks the built gradients).
  cases = ([('cnn5', 16, 2, auto, 'auto')] if quick else
           [(f, 512, 2, auto, mode) for f in families for mode in ('vmap', 'auto')])
  plain = {}  # the plain program's figures, once per family
  out['dp_sgd'] = [dp_sgd_cost(f, b, s, ds, p, mode, plain) for f, b, s, p, mode in cases]
  mb = lambda v: '—' if v is None else f'{v / 2**20:.0f}'
  print_table('DP-SGD against plain local training (one client, 2 steps)',
              ['family', 'batch', 'per-example norms', 'rows a pass', 'plain s', 'DP-SGD s',
               'ratio', 'plain temp MiB', 'DP-SGD temp MiB', 'ratio'],
              [[r['family'], str(r['batch']),
                'ghost' if r['per_example'] == 'auto' else 'gradients built',
                str(r['pass_size']), f"{r['plain_s']:.3f}", f"{r['dp_sgd_s']:.3f}",
                f"{r['time_ratio']:.1f}x", mb(r['plain_temp_bytes']),
                mb(r['dp_sgd_temp_bytes']),
                f"{r['memory_ratio']:.1f}x" if 'memory_ratio' in r else '—']
               for r in out['dp_sgd']])


def main(argv):
  del argv
  out = run(FLAGS.quick, FLAGS.rounds, FLAGS.sections, FLAGS.families)
  if FLAGS.out:
    with open(FLAGS.out, 'w') as f:
      json.dump(out, f, indent=2)
    print(f'\nWrote {FLAGS.out}')


if __name__ == '__main__':
  flags.DEFINE_bool('quick', False, 'Small cases only (CI smoke, under two minutes).')
  flags.DEFINE_integer('rounds', 3, 'Rounds per round-timing case (the first compiles).')
  flags.DEFINE_string('out', 'bench.json', 'Where to write the figures as JSON.')
  flags.DEFINE_list('sections', list(SECTIONS), 'Sections to run besides the roofline.')
  flags.DEFINE_list('families', list(models.FAMILY_NAMES), 'Families of the training section.')
  app.run(main)
