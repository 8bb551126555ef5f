"""train_and_evaluate(config, workdir): one federated run, from data to summary.json.

Outputs in `workdir`:
- config.json     the resolved config plus derived facts (K, partition fingerprint, families)
- metrics.jsonl   one JSON record per evaluated round (schema in docs/outputs.md)
- events.out.*    TensorBoard scalars (CLU metric writer)
- checkpoints/    orbax checkpoints (checkpoint.py); a rerun in the same workdir resumes
- summary.json    final/best mean accuracy, costs to target, wall time
- representations.npz  with save_representations: every client's test representations
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import tempfile
import threading
import time
from typing import Any, Callable

import jax
import ml_collections
import numpy as np
try:
  from clu import metric_writers
  from clu import periodic_actions
except ImportError:  # an image without CLU or TensorFlow (CLU's writers need it): no events
  metric_writers = periodic_actions = None

from fedssa_jax import checkpoint, config_lib, data, distributed, engine, workdir_lock


# The keys of every metrics.jsonl record; docs/outputs.md documents each one.
METRICS_FIELDS = (
    'round', 'mean_accuracy', 'client_accuracy', 'evaluated_clients',
    'participant_accuracy_reference',
    'train_loss', 'train_accuracy', 'header_norm_max', 'header_norm_mean', 'participants',
    'up_floats', 'down_floats', 'client_flops',
    'cum_up_floats', 'cum_down_floats', 'cum_floats', 'cum_client_flops', 'method_metrics',
    'server_flops', 'server_metrics', 'round_seconds', 'elapsed_seconds')
SUMMARY_FIELDS = (
    'method', 'dataset', 'rounds', 'final_mean_accuracy', 'best_mean_accuracy', 'best_round',
    'final_client_accuracy', 'target_accuracy', 'to_target', 'cum_up_floats',
    'cum_down_floats', 'cum_client_flops', 'seconds_per_round_steady', 'first_round_seconds',
    'wall_seconds')

# The exit status of a run stopped by SIGTERM or SIGINT after checkpointing (sysexits.h's
# EX_TEMPFAIL: a temporary failure, retry later). Rerunning the same command resumes it.
EXIT_PREEMPTED = 75


class Preempted(Exception):
  """SIGTERM or SIGINT stopped the run after a round, whose checkpoint is written."""


class DivergenceError(FloatingPointError):
  """A NaN or inf in a client's training loss or parameters, or a loss that blew up (the
  `guard` config); nothing of the round was saved."""


def _jsonable(x):
  if isinstance(x, (np.integer,)):
    return int(x)
  if isinstance(x, (np.floating,)):
    return float(x)
  if isinstance(x, np.ndarray):
    return x.tolist()
  if isinstance(x, tuple):
    return list(x)
  raise TypeError(type(x))


def _dump(obj) -> str:
  return json.dumps(obj, default=_jsonable)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       dataset: data.Dataset | None = None) -> dict:
  """Runs `config` and writes its outputs to `workdir`. Returns the summary dict.

  Resumes from the newest checkpoint in `workdir` if there is one. Holds the workdir's lock
  throughout. Raises ConfigError, data.DataError or checkpoint.CheckpointError for input that
  cannot work, workdir_lock.WorkdirLocked if another process runs in `workdir`, Preempted if
  SIGTERM or SIGINT stopped the run (after checkpointing), DivergenceError on a NaN, inf or a
  blown-up loss, and checkpoint.CheckpointWriteError when a checkpoint cannot be written.
  """
  config_lib.validate(config)
  check_workdir_writable(workdir)
  with _workdir_lock(workdir), config_lib.matmul_precision(config):
    return _train_and_evaluate(config, workdir, dataset)


def replica_configs(config: ml_collections.ConfigDict, seeds) -> list:
  """`config` once per seed (copies, each with its `seed`)."""
  out = []
  for seed in seeds:
    c = config.copy_and_resolve_references()
    c.seed = int(seed)
    out.append(c)
  return out


def train_replicas(configs: list, workdirs: list[str],
                   dataset: data.Dataset | None = None) -> list[dict]:
  """Runs of one config that differ only in their seed, packed into the same compiled calls
  (engine.Replicas), each writing what it would write alone (config.json, metrics.jsonl,
  summary.json, checkpoints) into its own workdir. Returns their summaries.

  Each workdir resumes from its newest checkpoint; they must be at the same round. A replica
  that diverges stops writing (its last good checkpoint is kept) while the others go on, and
  DivergenceError names it at the end. One config is the plain run (train_and_evaluate)."""
  if len(configs) != len(workdirs):
    raise ValueError('train_replicas: one workdir per config.')
  if len(configs) == 1:
    return [train_and_evaluate(configs[0], workdirs[0], dataset)]
  for config in configs:
    config_lib.validate(config)
  if len({os.path.realpath(w) for w in workdirs}) != len(workdirs):
    raise config_lib.ConfigError(f'Packed seeds need a workdir each, got {workdirs}.')
  seeds = [c.seed for c in configs]
  if len(set(seeds)) != len(seeds):
    raise config_lib.ConfigError(f'Packed seeds must differ, got seeds {seeds}.')
  # Before anything is loaded or written.
  engine.check_packable(configs[0])
  for workdir in workdirs:
    check_workdir_writable(workdir)
  with contextlib.ExitStack() as stack:
    for workdir in workdirs:
      stack.enter_context(_workdir_lock(workdir))
    stack.enter_context(config_lib.matmul_precision(configs[0]))
    return _train_runs(configs, workdirs, dataset)


@contextlib.contextmanager
def _workdir_lock(workdir: str):
  """The workdir's lock, held by process 0 (the one that writes the outputs); every process
  stops when it is refused."""
  with contextlib.ExitStack() as stack:
    refused = None
    if jax.process_index() == 0:
      try:
        stack.enter_context(workdir_lock.hold(workdir))
      except workdir_lock.WorkdirLocked as e:
        refused = e
    if distributed.any_process(refused is not None):
      raise refused or workdir_lock.WorkdirLocked(
          f'--workdir={workdir!r} is in use by another run (process 0 says by which).')
    yield


def check_workdir_writable(workdir: str) -> None:
  try:
    os.makedirs(workdir, exist_ok=True)
    with tempfile.TemporaryFile(dir=workdir):
      pass
  except OSError as e:
    raise config_lib.ConfigError(
        f'--workdir={workdir!r} is not a writable folder ({e.strerror or e}). Choose a folder '
        'you can write to, or fix its permissions.') from e


# ----------------------------------------------------------------------------------------------
# Progress: what the outputs need beyond the engine's state (saved in every checkpoint)
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Progress:
  history: list = dataclasses.field(default_factory=list)  # the metrics.jsonl records so far
  round_times: list = dataclasses.field(default_factory=list)  # seconds of every round
  # Indices into round_times of each process's first round, which compiles.
  compile_rounds: list = dataclasses.field(default_factory=list)
  elapsed_seconds: float = 0.0  # wall time of the run so far, over all its processes
  best_train_loss: float | None = None  # the lowest round train loss so far (the blow-up guard)

  @classmethod
  def from_checkpoint(cls, saved: dict) -> Progress:
    # Fields added since a checkpoint was written take their defaults.
    return cls(**{f.name: saved[f.name] for f in dataclasses.fields(cls) if f.name in saved})


def first_reaching(history: list[dict], target: float) -> dict | None:
  """Costs at the first evaluated round whose mean accuracy reaches `target` (None if none)."""
  for r in history:
    if r['mean_accuracy'] >= target:
      return {k: r[k] for k in ('round', 'cum_floats', 'cum_up_floats', 'cum_down_floats',
                                'cum_client_flops')}
  return None


def make_summary(config, state, progress: Progress) -> dict:
  history, times = progress.history, progress.round_times
  accs = [r['mean_accuracy'] for r in history]
  steady = [t for i, t in enumerate(times) if i not in progress.compile_rounds]
  return {
      'method': config.method,
      'dataset': config.dataset,
      'rounds': state.round,
      'final_mean_accuracy': accs[-1] if accs else None,
      'best_mean_accuracy': max(accs) if accs else None,
      'best_round': history[int(np.argmax(accs))]['round'] if accs else None,
      'final_client_accuracy': history[-1]['client_accuracy'] if history else None,
      'target_accuracy': config.target_accuracy,
      'to_target': first_reaching(history, config.target_accuracy),
      'cum_up_floats': state.costs['up_floats'],
      'cum_down_floats': state.costs['down_floats'],
      'cum_client_flops': state.costs['client_flops'],
      # Steady-state seconds per round exclude each process's first round, which compiles.
      'seconds_per_round_steady': float(np.mean(steady)) if steady
                                  else (times[0] if times else None),
      'first_round_seconds': times[0] if times else None,
      'wall_seconds': progress.elapsed_seconds,
  }


def _rewrite_metrics(path: str, history: list[dict]) -> None:
  """metrics.jsonl as the history says: drops rounds written after the last checkpoint."""
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    f.writelines(_dump(r) + '\n' for r in history)
  os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# Preemption and divergence
# ----------------------------------------------------------------------------------------------

class _StopRequests:
  """Within the block, SIGTERM and SIGINT ask the run to stop after the current round.

  A second signal acts as it would have without this block (SIGINT: KeyboardInterrupt; SIGTERM:
  terminate), for a user who does not want to wait.
  """
  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.signal_name = None
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():  # signal.signal's requirement
      self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    return self

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)

  def _handle(self, signum, frame):
    del frame
    if self.signal_name is not None:
      signal.signal(signum, self._previous[signum] or signal.SIG_DFL)
      signal.raise_signal(signum)
      return
    self.signal_name = signal.Signals(signum).name
    logging.warning('%s: finishing this round, then writing a checkpoint and exiting. Send it '
                    'again to stop at once, without a checkpoint.', self.signal_name)


def check_finite(sim: engine.Simulator, state, info, ckpts: checkpoint.Checkpointer) -> None:
  """Raises DivergenceError naming the round, clients and families with a NaN or inf."""
  problems = {}  # client id -> what is not finite
  cohort = info.cohort
  for c in cohort[~np.isfinite(info.train_loss_sum)]:
    problems.setdefault(int(c), []).append('loss')
  # Only the clients that trained this round have new parameters (the engine checks them).
  for c in cohort[info.nonfinite_params]:
    problems.setdefault(int(c), []).append('parameters')
  if not problems:
    return
  by_family = {}
  for c in sorted(problems):
    by_family.setdefault(sim.groups[sim.group_of[c]].family, []).append(
        f'{c} ({" and ".join(problems[c])})')
  where = '; '.join(f'family {f}: clients {", ".join(cs)}' for f, cs in by_family.items())
  raise DivergenceError(
      f'Training diverged in round {state.round}: a NaN or inf in the training loss or '
      f'parameters of {where}. Nothing of this round was saved; {_kept(ckpts)}. A resume must '
      'keep the config, so start again in a new --workdir with a smaller optimizer.lr or '
      'optimizer.clip_norm.')


def _kept(ckpts: checkpoint.Checkpointer) -> str:
  steps = ckpts.steps()
  return (f'the last good checkpoint, of round {steps[-1]}, is kept intact in '
          f'{ckpts.directory}' if steps else 'no checkpoint was written')


def check_blowup(config, sim: engine.Simulator, state, info, best: float | None,
                 ckpts: checkpoint.Checkpointer) -> None:
  """Raises DivergenceError when the round's (finite) train loss blew up: above
  guard.max_train_loss, or above guard.loss_growth times `best` (the lowest round loss so far)
  and above ln(classes), a uniform guess's cross-entropy. Names the round, the statistic and
  the clients whose own loss is past the same bound."""
  g, loss = config.guard, info.train_loss
  chance = float(np.log(sim.num_classes))
  if g.max_train_loss and loss > g.max_train_loss:
    bound = g.max_train_loss
    stat = (f'the mean train loss {loss:.4g} is above guard.max_train_loss='
            f'{g.max_train_loss:g}')
  elif g.loss_growth and best is not None and loss > max(g.loss_growth * best, chance):
    bound = max(g.loss_growth * best, chance)
    stat = (f'the mean train loss {loss:.4g} is {loss / best:.3g} times the best round\'s '
            f'{best:.4g}, above guard.loss_growth={g.loss_growth:g} (and above ln(classes) = '
            f'{chance:.3g})')
  else:
    return
  client_loss = info.train_loss_sum / np.maximum(info.train_samples, 1)
  tripped = [f'{c} ({l:.3g})' for c, l in zip(info.cohort, client_loss) if l > bound]
  raise DivergenceError(
      f'Training blew up in round {state.round}: {stat}; clients (loss) past it: '
      f'{", ".join(tripped) or "none alone"}. Nothing of this round was saved; {_kept(ckpts)}. '
      'Start again in a new --workdir with a smaller optimizer.lr or optimizer.clip_norm (or '
      'raise or turn off the guard with --config.guard.max_train_loss / loss_growth; 0 is off).')


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Run:
  """One run in the round loop: its outputs and bookkeeping (a packed run has one per seed)."""
  config: ml_collections.ConfigDict
  workdir: str
  ckpts: checkpoint.Checkpointer
  sim: engine.Simulator | None = None
  state: Any = None  # its RunState after the last round it finished
  progress: Progress | None = None
  meta: dict | None = None
  start: float = 0.0  # when the run started, continued from its checkpoint's elapsed time
  metrics_path: str = ''
  writer: Any = None
  report_progress: Callable = lambda step: None
  last_ev: Any = None  # the last evaluation: later ones evaluate only the clients trained since
  failed: Exception | None = None  # a packed replica that diverged (the others go on)
  history_last: dict | None = None  # the record of its last round (None: not evaluated)
  prefix: str = ''  # of its console lines ('seed 3: ' in a packed run)


def _train_and_evaluate(config, workdir, dataset):
  return _train_runs([config], [workdir], dataset)[0]


def _train_runs(configs, workdirs, dataset) -> list[dict]:
  """The runs of `configs`, one alone, or several packed (engine.Replicas). Returns their
  summaries; raises DivergenceError, after the others finished, if a packed replica diverged."""
  process_start = time.time()
  packed = len(configs) > 1
  if packed and dataset is None:  # loaded once for all the replicas
    c = configs[0]
    dataset = data.load_dataset(c.dataset, c.data_dir, c.download)
  runs = []
  try:
    for config, workdir in zip(configs, workdirs):
      run = _Run(config, workdir, checkpoint.Checkpointer(
          os.path.join(workdir, 'checkpoints'), config.checkpoint_keep))
      runs.append(run)
      run.sim, run.state, run.progress, run.meta = _start_or_resume(config, workdir, dataset,
                                                                    run.ckpts)
      # The run's wall time continues from the checkpoint's (the time after it is lost).
      run.start = process_start - run.progress.elapsed_seconds
      if packed:
        run.prefix = f'seed {config.seed}: '
    pack = None
    if packed:
      rounds = [int(r.state.round) for r in runs]
      if len(set(rounds)) > 1:
        raise config_lib.ConfigError(
            'Packed seeds resume together, from checkpoints of the same round, but their '
            'workdirs are at different rounds: ' +
            ', '.join(f'{r.workdir} at round {n}' for r, n in zip(runs, rounds)) +
            '. Resume each alone (one command per --workdir, without --seeds), or start the '
            'pack in a new --workdir.')
      pack = engine.Replicas([r.sim for r in runs])
    _run_rounds(runs, pack)
    for run in runs:
      if run.failed is None and run.config.save_representations:
        # computed by every process, written by process 0
        logging.info('Representations written to %s',
                     run.sim.save_representations(run.state, run.workdir))
  finally:
    for run in runs:
      run.ckpts.close()

  summaries = []
  for run in runs:
    if run.failed is not None:
      continue
    run.progress.elapsed_seconds = time.time() - run.start
    summary = make_summary(run.config, run.state, run.progress)
    if jax.process_index() == 0:
      with open(os.path.join(run.workdir, 'summary.json'), 'w') as f:
        f.write(json.dumps(summary, indent=2, default=_jsonable))
    acc = lambda a: 'n/a' if a is None else f'{a:.4f}'
    logging.info('%sDone: final mean accuracy %s, best %s (round %s), wall %.1f s; summary in %s',
                 run.prefix, acc(summary['final_mean_accuracy']),
                 acc(summary['best_mean_accuracy']), summary['best_round'],
                 summary['wall_seconds'], os.path.join(run.workdir, 'summary.json'))
    summaries.append(summary)
  failed = [run for run in runs if run.failed is not None]
  if failed:
    raise DivergenceError(
        f'{len(failed)} of the {len(runs)} packed seeds diverged (the others finished): ' +
        ' '.join(f'Seed {r.config.seed} ({r.workdir}): {r.failed}' for r in failed))
  return summaries


def _start_or_resume(config, workdir, dataset, ckpts: checkpoint.Checkpointer):
  """Checks, data, simulator, and the state: restored from the newest checkpoint, or fresh."""
  # A resume that would change the run is refused before anything is loaded.
  latest = ckpts.latest_meta()
  if latest is not None:
    saved_round, saved_meta = latest
    checkpoint.check_resumable(saved_meta, config, workdir)
    if saved_round > config.num_rounds:
      raise config_lib.ConfigError(
          f'The checkpoint in {ckpts.directory} is of round {saved_round}, past num_rounds='
          f'{config.num_rounds}. Set --config.num_rounds to at least {saved_round}, or use a '
          'new --workdir.')

  ds = dataset or data.load_dataset(config.dataset, config.data_dir, config.download)
  data.check_fits_models(ds)
  cd = data.partition_from_config(config, ds)
  fingerprint = data.fingerprint(cd)
  if latest is not None and saved_meta['partition_fingerprint'] != fingerprint:
    raise data.DataError(
        f'The data partition ({fingerprint}) differs from the one of the checkpoint in '
        f'{ckpts.directory} ({saved_meta["partition_fingerprint"]}): data_dir='
        f'{config.data_dir!r} holds other data than the run started with. Point '
        '--config.data_dir at that data, or use a new --workdir.')
  sim = engine.Simulator(config, ds, cd, workdir=workdir)

  derived = {
      'cohort_size': sim.k,
      'num_classes': ds.num_classes,
      'partition_fingerprint': fingerprint,
      'client_family': [sim.groups[g].family for g in sim.group_of],
      'client_train_samples': cd.train_n, 'client_test_samples': cd.test_n,
      'client_seen_classes': [np.flatnonzero(s).tolist() for s in cd.seen],
      'flops_per_train_sample': sim.flops_per_sample,
      'eval_client_ids': ('all' if len(sim.evaluated_ids) == sim.num_clients
                          else sim.evaluated_ids),
      'backend': jax.default_backend(),
      'jax_version': jax.__version__,
  }
  if jax.process_index() == 0:
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      f.write(json.dumps({'config': config.to_dict(), 'derived': derived}, indent=2,
                         default=_jsonable))
  logging.info('N=%d clients, K=%d per round, groups: %s', sim.num_clients, sim.k,
               ', '.join(f'{g.family} x{g.size}' for g in sim.groups))

  state = sim.init_state(fresh=latest is None)
  restored = ckpts.restore_latest(template=sim.saved(state))
  if restored is None:
    progress = Progress()
  else:
    state, progress = sim.live(restored.state), Progress.from_checkpoint(restored.progress)
    ckpts.discard_after(restored.step)
    sim.after_checkpoint(state, ckpts.steps())
    logging.info('Resuming after round %d from %s.', restored.step, ckpts.directory)
  meta = checkpoint.run_meta(config, fingerprint)
  return sim, state, progress, meta


def _run_rounds(runs: list[_Run], pack: engine.Replicas | None = None) -> None:
  """Rounds until num_rounds, with evaluation, metrics, checkpoints and the stop requests, of
  one run (`pack` None: its Simulator's rounds) or of packed replicas (`pack`: their rounds
  together; each replica evaluates, records and checkpoints as it would alone). Leaves each
  run's last state in `run.state`."""
  config = runs[0].config
  is_main = jax.process_index() == 0
  for run in runs:
    run.metrics_path = os.path.join(run.workdir, 'metrics.jsonl')
    if is_main:
      _rewrite_metrics(run.metrics_path, run.progress.history)
    if metric_writers is None:
      logging.warning('CLU or TensorFlow is not installed: no TensorBoard events; metrics.jsonl '
                      'has every figure.')
      run.writer = _NoEvents()
    else:
      run.writer = metric_writers.create_default_writer(run.workdir, just_logging=not is_main)
    # Rounds per second and an ETA, in the logs and TensorBoard ('steps' are rounds here).
    if periodic_actions:
      run.report_progress = periodic_actions.ReportProgress(
          num_train_steps=config.num_rounds, writer=run.writer, every_steps=1)
    run.progress.compile_rounds.append(len(run.progress.round_times))
  state = runs[0].state if pack is None else pack.stack([r.state for r in runs])
  if pack is not None and state.round < config.num_rounds:
    for run in runs:  # the stacked state holds them now (each gets its own back each round)
      run.state = None

  with _StopRequests() as stop:
    while state.round < config.num_rounds:
      t0 = time.time()
      if pack is None:
        state, info = runs[0].sim.run_round(state)
        infos = [info]
      else:
        state, infos = pack.run_round(state)
        jax.block_until_ready((state.params, state.server))
        shared = time.time() - t0  # the round's training, shared by the replicas
        # A signal to any process stops all of them after the same round (its save is
        # collective); a packed run asks before its replicas evaluate, one after another.
        stopping = distributed.any_process(stop.signal_name is not None)
      rounds_done = state.round
      last = rounds_done == config.num_rounds
      for r, (run, info) in enumerate(zip(runs, infos)):
        if run.failed is not None:
          continue
        # A packed replica's own state: a copy of its slice, one replica at a time.
        run_state = state if pack is None else pack.replica(state, r)
        try:
          # A packed replica's round time: the shared training, and its own evaluation.
          _evaluate_and_record(run, run_state, info,
                               t0 if pack is None else time.time() - shared, last)
        except DivergenceError as e:
          if pack is None:
            raise
          run.failed = e
          logging.error('%s%s', run.prefix, e)
          if all(x.failed is not None for x in runs):
            raise DivergenceError(
                'Every packed seed diverged: ' +
                ' '.join(f'Seed {x.config.seed} ({x.workdir}): {x.failed}' for x in runs))
          continue
        if pack is None:
          stopping = distributed.any_process(stop.signal_name is not None)
        progress = run.progress
        if rounds_done % config.checkpoint_every == 0 or last or stopping:
          progress.elapsed_seconds = time.time() - run.start
          run.ckpts.save(run.sim.before_checkpoint(run_state), dataclasses.asdict(progress),
                         run.meta)
          run.sim.after_checkpoint(run_state, run.ckpts.steps())
        run.report_progress(rounds_done)
        _log_round(run.config, rounds_done, run.history_last, info, progress.round_times,
                   run.prefix)
        # A packed replica's copy is kept only at the end.
        run.state = run_state if pack is None or last else None
        run_state = None
      if stopping and not last:
        for run in runs:
          run.writer.flush()
        why = stop.signal_name or 'A signal to another process'
        where = ', '.join(r.ckpts.directory for r in runs if r.failed is None)
        raise Preempted(f'{why}: stopped after round {rounds_done} of {config.num_rounds}; '
                        f'{"its checkpoint is" if len(runs) == 1 else "their checkpoints are"} '
                        f'in {where}. Rerun the same command to resume.')
  for run in runs:
    run.writer.flush()


def _evaluate_and_record(run: _Run, state, info, t0: float, last: bool) -> None:
  """A run's round after training: the divergence guards, the evaluation and the metrics record
  (kept in `run.history_last`: the record, or None when the round is not evaluated)."""
  config, sim, progress = run.config, run.sim, run.progress
  rounds_done = state.round
  check_finite(sim, state, info, run.ckpts)
  check_blowup(config, sim, state, info, progress.best_train_loss, run.ckpts)
  if progress.best_train_loss is None or info.train_loss < progress.best_train_loss:
    progress.best_train_loss = info.train_loss
  record = None
  if rounds_done % config.eval_every == 0 or last:
    run.last_ev = sim.evaluate(state, previous=run.last_ev)
    record = _record(sim, state, info, run.last_ev)
  jax.block_until_ready((state.params, state.server))
  dt = time.time() - t0
  progress.round_times.append(dt)
  if record is not None:
    record['round_seconds'] = dt
    record['elapsed_seconds'] = time.time() - run.start
    progress.history.append(record)
    if jax.process_index() == 0:
      _write_record(run.metrics_path, run.writer, record)
  run.history_last = record


def _record(sim, state, info, ev) -> dict:
  """The metrics.jsonl record of a round (without its timings), in plain JSON types, from its
  evaluation `ev`."""
  evaluated = ev.evaluated
  acc = ev.accuracy[evaluated]
  cohort = info.cohort
  # The reference's figure, over the participants that are evaluated (None if none is).
  cohort_acc = ev.batch_accuracy[np.intersect1d(cohort, evaluated)]
  costs = state.costs
  return {
      'round': state.round,
      'mean_accuracy': float(acc.mean()),
      'client_accuracy': acc.tolist(),
      'evaluated_clients': 'all' if len(evaluated) == sim.num_clients else len(evaluated),
      'participant_accuracy_reference': float(cohort_acc.mean()) if len(cohort_acc) else None,
      'train_loss': info.train_loss,
      'train_accuracy': info.train_accuracy,
      'header_norm_max': info.header_norm_max,
      'header_norm_mean': info.header_norm_mean,
      'participants': cohort.tolist(),
      'up_floats': info.up_floats, 'down_floats': info.down_floats,
      'client_flops': info.client_flops,
      'cum_up_floats': costs['up_floats'],
      'cum_down_floats': costs['down_floats'],
      'cum_floats': costs['up_floats'] + costs['down_floats'],
      'cum_client_flops': costs['client_flops'],
      # A method's further test metrics (e.g. FedProto's nearest-prototype accuracy).
      'method_metrics': {name: float(ev.metrics[name][evaluated].mean())
                         for name in sim.method.eval_metrics},
      # The server's FLOPs and scalar diagnostics of the round (methods.Aggregated).
      'server_flops': info.server_flops,
      'server_metrics': dict(info.server_metrics),
  }


class _NoEvents:
  """Stands in for CLU's metric writer where TensorBoard events cannot be written."""

  def write_scalars(self, step, scalars):
    del step, scalars

  def flush(self):
    pass


def _write_record(metrics_path, writer, record) -> None:
  with open(metrics_path, 'a') as f:
    f.write(_dump(record) + '\n')
  scalars = {k: v for k, v in record.items() if isinstance(v, float)}
  scalars.update(record['method_metrics'])
  scalars.update({f'server_{k}': v for k, v in record['server_metrics'].items()})
  scalars['accuracy_q25'], scalars['accuracy_median'], scalars['accuracy_q75'] = (
      np.quantile(record['client_accuracy'], [0.25, 0.5, 0.75]).tolist())
  writer.write_scalars(record['round'], scalars)


def _log_round(config, rounds_done, record, info, round_times, prefix='') -> None:
  # The ETA leaves out the first round, which compiles.
  steady = np.mean(round_times[1:]) if len(round_times) > 1 else round_times[-1]
  eta = steady * (config.num_rounds - rounds_done)
  acc_text = f'mean acc {record["mean_accuracy"]:.4f}' if record else 'not evaluated'
  logging.info('%sround %d/%d: %s, train loss %.4f, %.2f s/round, ETA %.0f s', prefix,
               rounds_done, config.num_rounds, acc_text, info.train_loss, round_times[-1], eta)
