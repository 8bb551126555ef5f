"""train_and_evaluate(config, workdir): one federated run, from data to summary.json.

Outputs in `workdir` (outputs.py):
- config.json     the resolved config plus derived facts (K, partition fingerprint, families)
- metrics.jsonl   one JSON record per evaluated round (schema in docs/outputs.md)
- events.out.*    TensorBoard scalars (CLU metric writer)
- checkpoints/    orbax checkpoints (checkpoint.py); a rerun in the same workdir resumes
- summary.json    final/best mean accuracy, costs to target, wall time
- diverged.json   instead, when the run diverged (DivergenceError): the round, the message and
                  the train loss; a sweep does not rerun it (outputs.SeedOutputs.write_diverged)
- representations.npz  with save_representations: every client's test representations

`train_replicas` runs several seeds of one config packed into the same compiled calls, each
writing into its own workdir what it would write alone. Both go through one loop
(`_run_rounds`): a Simulator of R >= 1 seeds, one `run_round` per round, then for each seed the
guards, its evaluation, its record and its checkpoint. What follows the rounds beside the engine
(the system section's clock, the privacy accountants) are the run's observers (observers.py),
each seed's states of which its progress and checkpoint carry.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from fedssa_jax import config_lib, data
from fedssa_jax.engine import distributed, parts, per_call, simulator, snapshots
from fedssa_jax.engine.rows import DamagedRows
from fedssa_jax.run import checkpoint, guards, observers, outputs, workdir_lock
from fedssa_jax.run.outputs import METRICS_FIELDS, SUMMARY_FIELDS  # noqa: F401  (the schemas)
from fedssa_jax.errors import ConfigError, DataError

# The exit status of a run stopped by SIGTERM or SIGINT after checkpointing (sysexits.h's
# EX_TEMPFAIL: a temporary failure, retry later). Rerunning the same command resumes it.
EXIT_PREEMPTED = 75
DivergenceError = guards.DivergenceError


class Preempted(Exception):
  """SIGTERM or SIGINT stopped the run after a round, whose checkpoint is written."""


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       dataset: data.Dataset | None = None, stop: Any = None) -> dict:
  """Runs `config` and writes its outputs to `workdir`. Returns the summary dict.

  Resumes from the newest checkpoint in `workdir` if there is one. Holds the workdir's lock
  throughout. `stop`, if given, is asked after every round whether a stop was requested (its
  `signal_name` set, e.g. console.StopRequests, which main installs); the run then checkpoints
  and raises Preempted; the function installs no signal handlers, log handlers or hooks of its
  own. Raises ConfigError, DataError or checkpoint.CheckpointError for
  input that cannot work, workdir_lock.WorkdirLocked if another process runs in `workdir`,
  DivergenceError on a NaN, inf or a blown-up loss (once diverged.json is written), and
  checkpoint.CheckpointWriteError when a checkpoint cannot be written.
  """
  config_lib.validate(config)
  check_workdir_writable(workdir)
  with _workdir_lock(workdir), config_lib.matmul_precision(config):
    return _train_seeds([config], [workdir], dataset, stop)[0]


def replica_configs(config: ml_collections.ConfigDict, seeds) -> list:
  """`config` once per seed (copies, each with its `seed`)."""
  out = []
  for seed in seeds:
    c = config.copy_and_resolve_references()
    c.seed = int(seed)
    out.append(c)
  return out


def _without_seed(config) -> dict:
  d = config.to_dict()
  d.pop('seed')
  return d


def train_replicas(configs: list, workdirs: list[str], dataset: data.Dataset | None = None,
                   stop: Any = None) -> list[dict]:
  """Runs of one config that differ only in their seed, packed into the same compiled calls
  (simulator.Simulator's seed axis), each writing what it would write alone (config.json,
  metrics.jsonl, summary.json, checkpoints) into its own workdir. Returns their summaries.

  Each workdir resumes from its newest checkpoint; they must be at the same round. A seed that
  diverges stops writing (its last good checkpoint is kept, and its diverged.json written)
  while the others go on, and DivergenceError names it at the end. One config is the plain run
  (train_and_evaluate)."""
  if len(configs) != len(workdirs):
    raise ValueError('train_replicas: one workdir per config.')
  if len(configs) == 1:
    return [train_and_evaluate(configs[0], workdirs[0], dataset, stop)]
  for config in configs:
    config_lib.validate(config)
    if _without_seed(config) != _without_seed(configs[0]):
      raise ConfigError(
          'Packed runs must differ only in their seed; these configs differ in other fields.')
  if len({os.path.realpath(w) for w in workdirs}) != len(workdirs):
    raise ConfigError(f'Packed seeds need a workdir each, got {workdirs}.')
  # Before anything is loaded or written.
  parts.check_seeds(configs[0], [c.seed for c in configs], widths=[])
  for workdir in workdirs:
    check_workdir_writable(workdir)
  with contextlib.ExitStack() as stack:
    for workdir in workdirs:
      stack.enter_context(_workdir_lock(workdir))
    stack.enter_context(config_lib.matmul_precision(configs[0]))
    return _train_seeds(configs, workdirs, dataset, stop)


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
    raise ConfigError(
        f'--workdir={workdir!r} is not a writable folder ({e.strerror or e}). Choose a folder '
        'you can write to, or fix its permissions.') from e


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------

def _train_seeds(configs, workdirs, dataset, stop) -> list[dict]:
  """The runs of `configs` (one per seed), in one Simulator. Returns their summaries; raises
  DivergenceError, after the others finished, if some of several seeds diverged."""
  process_start = time.time()
  ckpts = [checkpoint.Checkpointer(os.path.join(w, 'checkpoints'), c.checkpoint_keep)
           for c, w in zip(configs, workdirs)]
  try:
    sim, watching, metas, fresh = _simulator(configs, workdirs, dataset, ckpts)
    state, progresses = _initial_state(sim, watching, ckpts, workdirs, fresh)
    packed = len(configs) > 1
    runs = [outputs.SeedOutputs(
        config=c, workdir=w, ckpts=k, progress=p, meta=m,
        # The run's wall time continues from the checkpoint's (the time after it is lost).
        start=process_start - p.elapsed_seconds, prefix=f'seed {c.seed}: ' if packed else '',
        observers=watching)
            for c, w, k, p, m in zip(configs, workdirs, ckpts, progresses, metas)]
    state = _run_rounds(sim, state, runs, stop)
    for i, run in enumerate(runs):
      if run.failed is None and run.config.save_representations:
        # computed by every process, written by process 0
        logging.info('Representations written to %s',
                     sim.save_representations(state, run.workdir, i))
  finally:
    for k in ckpts:
      k.close()
  summaries = [run.write_summary(state.replace(costs=state.costs.of(i)), time.time())
               for i, run in enumerate(runs) if run.failed is None]
  failed = [run for run in runs if run.failed is not None]
  if failed:
    raise DivergenceError(
        f'{len(failed)} of the {len(runs)} packed seeds diverged (the others finished): ' +
        ' '.join(f'Seed {r.config.seed} ({r.workdir}): {r.failed}' for r in failed))
  return summaries


def _simulator(configs, workdirs, dataset, ckpts):
  """Checks, data and the Simulator of every seed; writes each seed's config.json. Returns
  (the Simulator, its observers, each seed's checkpoint.run_meta, whether no seed has a
  checkpoint)."""
  latest = []
  for config, k in zip(configs, ckpts):  # a resume that would change a run is refused first
    latest.append(k.latest_meta())
    if latest[-1] is not None:
      checkpoint.check_resumable(latest[-1][1], config, os.path.dirname(k.directory))
      if latest[-1][0] > config.num_rounds:
        raise ConfigError(
            f'The checkpoint in {k.directory} is of round {latest[-1][0]}, past num_rounds='
            f'{config.num_rounds}. Set --config.num_rounds to at least {latest[-1][0]}, or use '
            'a new --workdir.')
  c0 = configs[0]
  ds = dataset or data.load_dataset(c0.dataset, c0.data_dir, c0.download, c0.image_size)
  data.check_fits_models(ds)
  cds = [data.partition_from_config(c, ds) for c in configs]
  fingerprints = [data.fingerprint(cd) for cd in cds]
  for meta, fp, k, c in zip(latest, fingerprints, ckpts, configs):
    if meta is not None and meta[1]['partition_fingerprint'] != fp:
      raise DataError(
          f'The data partition ({fp}) differs from the one of the checkpoint in {k.directory} '
          f'({meta[1]["partition_fingerprint"]}): data_dir={c.data_dir!r} holds other data than '
          'the run started with. Point --config.data_dir at that data, or use a new --workdir.')
  # A resumed run keeps the clients per call its workdir records (engine.clients_per_call=-1).
  recorded = per_call.read_record(workdirs[0]) if latest[0] is not None else None
  sim = simulator.Simulator(c0, ds, cds, workdir=workdirs[0], seeds=[c.seed for c in configs],
                            per_call_choice=recorded)
  _write_per_call(sim, workdirs)
  watching = observers.watching(sim)
  for i, (config, workdir, cd) in enumerate(zip(configs, workdirs, cds)):
    if jax.process_index() == 0:
      with open(os.path.join(workdir, 'config.json'), 'w') as f:
        f.write(json.dumps({'config': config.to_dict(),
                            'derived': _derived(sim, watching, cd, i)},
                           indent=2, default=outputs.jsonable))
  logging.info('N=%d clients, K=%d per round, groups: %s', sim.num_clients, sim.k,
               ', '.join(f'{g.family} x{g.size}' for g in sim.groups))
  return (sim, watching, [checkpoint.run_meta(c, fp) for c, fp in zip(configs, fingerprints)],
          all(meta is None for meta in latest))


def _write_per_call(sim: simulator.Simulator, workdirs) -> None:
  """Each workdir's per_call.FILE: the measured clients per call and the candidates' timings
  (kept as it is by a run that took its choice from there)."""
  record = sim.per_call_record
  if record is None:
    return
  logging.info('Clients per call (%s): %s%s.', record['source'], ', '.join(
      f'{g["family"]} {g["clients_per_call"]}' for g in record['groups']),
               '' if record['source'] == 'workdir' else
               f'; the candidates compared in {per_call.FILE}')
  if record['source'] == 'workdir' or jax.process_index() != 0:
    return
  for workdir in workdirs:
    with open(os.path.join(workdir, per_call.FILE), 'w') as f:
      f.write(json.dumps(record, indent=2))


def _derived(sim: simulator.Simulator, watching, cd: data.ClientData, i: int) -> dict:
  """What config.json records of seed i's run beyond its config, the observers' facts last."""
  evaluated = sim.evaluated_ids[i]
  return {
      'cohort_size': sim.k,
      'num_classes': sim.num_classes,
      'partition_fingerprint': data.fingerprint(cd),
      'client_family': [sim.groups[g].family for g in sim.group_of],
      'client_train_samples': cd.train_n, 'client_test_samples': cd.test_n,
      'client_seen_classes': [np.flatnonzero(s).tolist() for s in cd.seen],
      'flops_per_train_sample': sim.flops.per_sample,
      'eval_client_ids': 'all' if len(evaluated) == sim.num_clients else evaluated,
      'backend': jax.default_backend(),
      'jax_version': jax.__version__,
      **{k: v for o in watching for k, v in o.derived(i).items()},
  }


def _initial_state(sim: simulator.Simulator, watching, ckpts, workdirs, fresh: bool):
  """Every seed's state, restored from its newest checkpoint (all of the same round), or fresh;
  and each one's outputs.Progress, with its observers' states (of `watching`). `fresh`: no seed
  has a checkpoint (read once, before)."""
  state = sim.init_state(fresh=fresh)
  restored = [k.restore_latest(template=snapshots.saved(sim.store, state, i))
              for i, k in enumerate(ckpts)]
  rounds = [0 if r is None else r.step for r in restored]
  if len(set(rounds)) > 1:
    raise ConfigError(
        'Packed seeds resume together, from checkpoints of the same round, but their '
        'workdirs are at different rounds: ' +
        ', '.join(f'{w} at round {n}' for w, n in zip(workdirs, rounds)) +
        '. Resume each alone (one command per --workdir, without --seeds), or start the '
        'pack in a new --workdir.')
  if restored[0] is None:
    return state, [outputs.Progress(observers=observers.initial_states(watching)) for _ in ckpts]
  del state  # the fresh state's buffers go before the restored one is placed
  while True:
    try:
      state = snapshots.stacked(sim.store, [r.state for r in restored])
      break
    except DamagedRows as e:  # the disk store (one seed): its files lack the checkpoint's rows
      (k,), (r,) = ckpts, restored
      k.reject(r.step, e)
      restored = [k.restore_latest(template=r.state)]  # the one before, or CheckpointError
  for k, r in zip(ckpts, restored):
    k.discard_after(r.step)
    snapshots.after_checkpoint(sim.store, state, k.steps())
    logging.info('Resuming after round %d from %s.', r.step, k.directory)
  return state, [outputs.Progress.from_checkpoint(r.progress, watching) for r in restored]


def _run_rounds(sim: simulator.Simulator, state, runs: list[outputs.SeedOutputs], stop):
  """Rounds until num_rounds: the round of every seed, then, seed by seed, its guards,
  evaluation and record, and then its checkpoint and console line. A signal (`stop`) to any
  process stops all of them after the same round (its save is collective), checkpointed.
  Returns the last state."""
  config = runs[0].config
  for run in runs:
    run.open()
  ended = _observers_stop(state.round, runs)  # a resumed run whose privacy budget is spent
  while state.round < config.num_rounds and not ended:
    t0 = time.time()
    state, infos = sim.run_round(state)
    jax.block_until_ready((state.population, state.server))
    shared = time.time() - t0  # the round's training, shared by the seeds
    for i, (run, info) in enumerate(zip(runs, infos)):
      if run.failed is None:
        states = run.progress.observers
        for o in run.observers:
          states[o.name] = o.observe(i, info, states[o.name])
    ended = _observers_stop(state.round, runs)
    last = state.round == config.num_rounds or ended
    for i, (run, info) in enumerate(zip(runs, infos)):
      if run.failed is None:
        # A seed's round time: the shared training, and its own evaluation.
        _evaluate_or_fail(sim, state, i, runs, info, time.time() - shared, last)
    # Asked once the round is evaluated, by every process at the same point.
    stopping = distributed.any_process(stop is not None and stop.signal_name is not None)
    for i, (run, info) in enumerate(zip(runs, infos)):
      if run.failed is not None:
        continue
      if state.round % config.checkpoint_every == 0 or last or stopping:
        run.progress.elapsed_seconds = time.time() - run.start
        run.ckpts.save(snapshots.before_checkpoint(sim.store, state, i),
                       dataclasses.asdict(run.progress), run.meta)
        snapshots.after_checkpoint(sim.store, state, run.ckpts.steps())
      run.report_progress(state.round)
      outputs.log_round(run.config, state.round, run.last_record, info,
                        run.progress.round_times, run.prefix,
                        ''.join(o.console(info, run.last_record) for o in run.observers))
    if stopping and not last:
      for run in runs:
        run.writer.flush()
      why = stop.signal_name or 'A signal to another process'
      where = ', '.join(r.ckpts.directory for r in runs if r.failed is None)
      raise Preempted(f'{why}: stopped after round {state.round} of {config.num_rounds}; '
                      f'{"its checkpoint is" if len(runs) == 1 else "their checkpoints are"} '
                      f'in {where}. Rerun the same command to resume.')
  for run in runs:
    run.writer.flush()
  return state


def _observers_stop(rounds_done: int, runs) -> bool:
  """Whether an observer ends the run after `rounds_done` rounds, before num_rounds (DP-SGD's
  privacy budget), asked with the states of the seeds that go on."""
  if rounds_done >= runs[0].config.num_rounds:
    return False
  live = {i: run for i, run in enumerate(runs) if run.failed is None}
  return any([o.stops(rounds_done, {i: run.progress.observers[o.name] for i, run in live.items()})
              for o in runs[0].observers])  # each asked


def _evaluate_or_fail(sim, state, i: int, runs, info, t0: float, last: bool) -> None:
  """_evaluate_and_record of seed i; a seed that diverges is marked failed (the others go on)
  and writes its diverged.json, and DivergenceError is raised once every seed has."""
  run = runs[i]
  try:
    _evaluate_and_record(sim, state, i, run, info, t0, last)
  except DivergenceError as e:
    run.failed = e
    run.write_diverged(state.round, e, info.train_loss)
    if len(runs) == 1:
      raise
    if all(x.failed is not None for x in runs):
      raise DivergenceError(
          'Every packed seed diverged: ' +
          ' '.join(f'Seed {x.config.seed} ({x.workdir}): {x.failed}' for x in runs)) from e
    logging.error('%s%s', run.prefix, e)


def _evaluate_and_record(sim: simulator.Simulator, state, i: int, run: outputs.SeedOutputs, info,
                         t0: float, last: bool) -> None:
  """Seed i's round after training: the divergence guards, the evaluation and the metrics
  record (kept in `run.last_record`: the record, or None when the round is not evaluated)."""
  config, progress = run.config, run.progress
  guards.check_finite(sim, state, info, run.ckpts)
  guards.check_blowup(config, sim, state, info, progress.best_train_loss, run.ckpts)
  progress.best_train_loss = guards.best_train_loss(progress.best_train_loss, info)
  record = None
  if state.round % config.eval_every == 0 or last:
    run.last_ev = sim.evaluate(state, previous=run.last_ev, seed_index=i)
    observed = {k: v for o in run.observers
                for k, v in o.record(i, info, progress.observers[o.name]).items()}
    record = outputs.record(sim, state.replace(costs=state.costs.of(i)), info, run.last_ev,
                            observed)
  now = time.time()
  run.add_record(record, now - t0, now)
