"""What a run writes, seed by seed: metrics.jsonl records, TensorBoard scalars, the console line
of each round, summary.json (or diverged.json), and the progress a checkpoint carries beyond the
engine's state.

`SeedOutputs` is one seed's outputs and bookkeeping in the round loop (train.py): its workdir,
checkpointer, metric writer, progress and the evaluation its next one may reuse.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from typing import Any, Callable

import jax
import ml_collections
import numpy as np

from fedssa_jax.run import checkpoint, observers
from fedssa_jax.run.lens import LENS_FIELDS, lens, lens_text, validation


def clu_writers() -> tuple[Any, Any]:
  """CLU's (metric_writers, periodic_actions), imported when a run opens its outputs: they import
  TensorFlow (about 10 CPU seconds), which a command refused before training (a bad flag, a
  locked workdir) need not pay. (None, None) in an image without CLU or TensorFlow (CLU's writers
  need it): the run then writes no TensorBoard events."""
  try:
    from clu import metric_writers, periodic_actions  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None, None
  return metric_writers, periodic_actions


# The keys of every metrics.jsonl record; docs/outputs.md documents each one.
METRICS_FIELDS = (
    'round', 'mean_accuracy', 'client_accuracy', 'evaluated_clients',
    'accuracy_std', 'worst10_accuracy', 'family_accuracy', 'global_accuracy',
    'global_unseen_accuracy', 'global_unseen_chance', 'new_client_accuracy', 'participation_gap',
    'participant_accuracy_reference',
    'train_loss', 'train_accuracy', 'header_norm_max', 'header_norm_mean', 'participants',
    'up_floats', 'down_floats', 'client_flops',
    'cum_up_floats', 'cum_down_floats', 'cum_floats', 'cum_client_flops', 'method_metrics',
    'server_flops', 'server_metrics', 'round_seconds', 'elapsed_seconds')
SUMMARY_FIELDS = (
    'method', 'dataset', 'rounds', 'final_mean_accuracy', 'best_mean_accuracy', 'best_round',
    'final_client_accuracy', *(f'final_{k}' for k in LENS_FIELDS), 'target_accuracy',
    'to_target', 'cum_up_floats',
    'cum_down_floats', 'cum_client_flops', 'seconds_per_round_steady', 'first_round_seconds',
    'wall_seconds')
# What a run that ended with a DivergenceError leaves instead of summary.json (docs/outputs.md).
DIVERGED_FILE = 'diverged.json'


def jsonable(x):
  if isinstance(x, (np.integer,)):
    return int(x)
  if isinstance(x, (np.floating,)):
    return float(x)
  if isinstance(x, np.ndarray):
    return x.tolist()
  if isinstance(x, tuple):
    return list(x)
  raise TypeError(type(x))


def dump(obj) -> str:
  return json.dumps(obj, default=jsonable)


@dataclasses.dataclass
class Progress:
  history: list = dataclasses.field(default_factory=list)  # the metrics.jsonl records so far
  round_times: list = dataclasses.field(default_factory=list)  # seconds of every round
  # Indices into round_times of each process's first round, which compiles.
  compile_rounds: list = dataclasses.field(default_factory=list)
  elapsed_seconds: float = 0.0  # wall time of the run so far, over all its processes
  best_train_loss: float | None = None  # the lowest round train loss so far (the blow-up guard)
  # The run's observers' states, by name (run/observers.py: the system section's clock, the
  # accountants), this seed's; an observer that is off has none.
  observers: dict = dataclasses.field(default_factory=dict)

  @classmethod
  def from_checkpoint(cls, saved: dict, watching=()) -> Progress:
    """The progress a checkpoint saved, with the states of the observers `watching` (those of
    others left out, an observer's initial state where it saved none)."""
    # Fields added since a checkpoint was written take their defaults; one written before the
    # observers held their states at its top level.
    progress = cls(**{f.name: saved[f.name] for f in dataclasses.fields(cls) if f.name in saved})
    states = saved['observers'] if 'observers' in saved else observers.old_layout(saved)
    progress.observers = observers.initial_states(watching, states)
    return progress


def first_reaching(history: list[dict], target: float) -> dict | None:
  """Costs at the first evaluated round whose mean accuracy reaches `target` (None if none)."""
  for r in history:
    if r['mean_accuracy'] >= target:
      return {k: r[k] for k in ('round', 'cum_floats', 'cum_up_floats', 'cum_down_floats',
                                'cum_client_flops', 'cum_sim_seconds') if k in r}
  return None


def make_summary(config, state, progress: Progress, watching=()) -> dict:
  """summary.json's fields, and those of the observers `watching` (run/observers.py)."""
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
      **{f'final_{k}': history[-1].get(k) if history else None for k in LENS_FIELDS},
      # With eval_validation only: the last record's (tuning.py selects on it).
      **({'final_val_accuracy': history[-1].get('val_accuracy') if history else None}
         if config.get('eval_validation') else {}),
      'target_accuracy': config.target_accuracy,
      'to_target': first_reaching(history, config.target_accuracy),
      'cum_up_floats': state.costs.up_floats,
      'cum_down_floats': state.costs.down_floats,
      'cum_client_flops': state.costs.client_flops,
      # Steady-state seconds per round exclude each process's first round, which compiles.
      'seconds_per_round_steady': float(np.mean(steady)) if steady
                                  else (times[0] if times else None),
      'first_round_seconds': times[0] if times else None,
      'wall_seconds': progress.elapsed_seconds,
      **{k: v for o in watching
         for k, v in o.summary(progress.observers[o.name], history).items()},
  }


def rewrite_metrics(path: str, history: list[dict]) -> None:
  """metrics.jsonl as the history says: drops rounds written after the last checkpoint."""
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    f.writelines(dump(r) + '\n' for r in history)
  os.replace(tmp, path)



@dataclasses.dataclass
class SeedOutputs:
  """One seed's outputs and bookkeeping in the round loop (a packed run has one per seed)."""
  config: ml_collections.ConfigDict
  workdir: str
  ckpts: checkpoint.Checkpointer
  progress: Progress
  meta: dict  # what its checkpoints record of the run (checkpoint.run_meta)
  start: float  # when the run started, continued from its checkpoint's elapsed time
  prefix: str = ''  # of its console lines ('seed 3: ' in a packed run)
  writer: Any = None  # CLU's metric writer (NoEvents without CLU)
  report_progress: Callable = lambda step: None  # rounds per second and an ETA
  last_ev: Any = None  # the last evaluation: later ones evaluate only the clients trained since
  last_record: dict | None = None  # the record of its last round (None: not evaluated)
  observers: list = dataclasses.field(default_factory=list)  # the run's (observers.watching)
  failed: Exception | None = None  # a packed seed that diverged (the others go on)

  @property
  def metrics_path(self) -> str:
    return os.path.join(self.workdir, 'metrics.jsonl')

  def open(self) -> None:
    """metrics.jsonl as the progress says, the metric writer, the progress reporter. A
    diverged.json of an earlier try goes: the run starts again, and writes its own if it
    diverges again (a resume may raise the guard, and then finish)."""
    is_main = jax.process_index() == 0
    if is_main:
      rewrite_metrics(self.metrics_path, self.progress.history)
      with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(self.workdir, DIVERGED_FILE))
    metric_writers, periodic_actions = clu_writers()
    if metric_writers is None:
      logging.warning('CLU or TensorFlow is not installed: no TensorBoard events; metrics.jsonl '
                      'has every figure.')
      self.writer = NoEvents()
    else:
      self.writer = metric_writers.create_default_writer(self.workdir, just_logging=not is_main)
    # Rounds per second and an ETA, in the logs and TensorBoard ('steps' are rounds here).
    if periodic_actions:
      self.report_progress = periodic_actions.ReportProgress(
          num_train_steps=self.config.num_rounds, writer=self.writer, every_steps=1)
    self.progress.compile_rounds.append(len(self.progress.round_times))

  def add_record(self, record: dict | None, seconds: float, now: float) -> None:
    """The round's timing, and its record (None: not evaluated) in the outputs."""
    self.progress.round_times.append(seconds)
    if record is not None:
      record['round_seconds'] = seconds
      record['elapsed_seconds'] = now - self.start
      self.progress.history.append(record)
      if jax.process_index() == 0:
        write_record(self.metrics_path, self.writer, record)
    self.last_record = record

  def write_diverged(self, round_: int, error: Exception, train_loss: float) -> None:
    """diverged.json (from process 0): the round that diverged, the error's message and the
    round's mean train loss (null when it is not finite). A sweep counts the run as ended, not
    to be rerun: the same config diverges again. A file that cannot be written is a warning,
    not a second error in place of the divergence."""
    if jax.process_index() != 0:
      return
    loss = float(train_loss)
    record = {'round': int(round_), 'train_loss': loss if np.isfinite(loss) else None,
              'message': str(error)}
    path = os.path.join(self.workdir, DIVERGED_FILE)
    try:  # whole or not at all, as summary.json
      with open(path + '.tmp', 'w') as f:
        f.write(json.dumps(record, indent=2))
      os.replace(path + '.tmp', path)
    except OSError as e:
      logging.warning('%sCould not write %s: %s', self.prefix, path, e)

  def write_summary(self, state, now: float) -> dict:
    """summary.json (from process 0), and the console's last line."""
    self.progress.elapsed_seconds = now - self.start
    summary = make_summary(self.config, state, self.progress, self.observers)
    if jax.process_index() == 0:  # whole or not at all: a sweep skips a run that has one
      path = os.path.join(self.workdir, 'summary.json')
      with open(path + '.tmp', 'w') as f:
        f.write(json.dumps(summary, indent=2, default=jsonable))
      os.replace(path + '.tmp', path)
    acc = lambda a: 'n/a' if a is None else f'{a:.4f}'
    logging.info('%sDone: final mean accuracy %s%s, best %s (round %s), wall %.1f s; summary in '
                 '%s', self.prefix, acc(summary['final_mean_accuracy']), lens_text(summary),
                 acc(summary['best_mean_accuracy']), summary['best_round'],
                 summary['wall_seconds'], os.path.join(self.workdir, 'summary.json'))
    return summary


# The most per-client accuracies a record lists (docs/outputs.md): beyond, the record keeps
# this many quantiles of them, so records, checkpoints (which hold the history) and reports
# stay of a bounded size whatever N.
CLIENT_LIST_MAX = 1000


def client_list(acc: np.ndarray) -> list:
  """`client_accuracy` of a record: the evaluated clients' accuracies (in id order) where there
  are at most CLIENT_LIST_MAX; beyond, CLIENT_LIST_MAX quantiles of them, at the levels
  (i + 1/2) / CLIENT_LIST_MAX (sorted), whose quartiles, box plots and mean are the clients'
  to about 1/CLIENT_LIST_MAX."""
  if len(acc) <= CLIENT_LIST_MAX:
    return acc.tolist()
  return np.quantile(acc, (np.arange(CLIENT_LIST_MAX) + 0.5) / CLIENT_LIST_MAX).tolist()


def record(sim, state, info, ev, observed: dict | None = None) -> dict:
  """The metrics.jsonl record of a round (without its timings), in plain JSON types, from its
  evaluation `ev`, and last the fields of the run's observers, `observed` (the system section's,
  the accountants': run/observers.py)."""
  evaluated = ev.evaluated
  acc = ev.accuracy[evaluated]
  cohort = info.cohort
  # The reference's figure, over the participants that are evaluated (None if none is).
  cohort_acc = ev.batch_accuracy[np.intersect1d(cohort, evaluated)]
  costs = state.costs
  return {
      'round': state.round,
      'mean_accuracy': float(acc.mean()),
      'client_accuracy': client_list(acc),
      'evaluated_clients': 'all' if len(evaluated) == sim.num_clients else len(evaluated),
      **lens(acc, np.array([g.family for g in sim.groups])[sim.group_of[evaluated]], ev),
      **validation(ev),  # with eval_validation only
      'participant_accuracy_reference': float(cohort_acc.mean()) if len(cohort_acc) else None,
      'train_loss': info.train_loss,
      'train_accuracy': info.train_accuracy,
      'header_norm_max': info.header_norm_max,
      'header_norm_mean': info.header_norm_mean,
      'participants': cohort.tolist(),
      'up_floats': info.up_floats, 'down_floats': info.down_floats,
      'client_flops': info.client_flops,
      'cum_up_floats': costs.up_floats,
      'cum_down_floats': costs.down_floats,
      'cum_floats': costs.up_floats + costs.down_floats,
      'cum_client_flops': costs.client_flops,
      # A method's further test metrics (e.g. FedProto's nearest-prototype accuracy).
      'method_metrics': {name: float(ev.metrics[name][evaluated].mean())
                         for name in sim.method.eval_metrics},
      # The server's FLOPs and scalar diagnostics of the round (methods.Aggregated).
      'server_flops': info.server_flops,
      'server_metrics': dict(info.server_metrics),
      **(observed or {}),
  }


class NoEvents:
  """Stands in for CLU's metric writer where TensorBoard events cannot be written."""

  def write_scalars(self, step, scalars):
    del step, scalars

  def flush(self):
    pass


def write_record(metrics_path, writer, record) -> None:
  with open(metrics_path, 'a') as f:
    f.write(dump(record) + '\n')
  scalars = {k: v for k, v in record.items() if isinstance(v, float)}
  scalars.update(record['method_metrics'])
  scalars.update({f'server_{k}': v for k, v in record['server_metrics'].items()})
  scalars['accuracy_q25'], scalars['accuracy_median'], scalars['accuracy_q75'] = (
      np.quantile(record['client_accuracy'], [0.25, 0.5, 0.75]).tolist())
  writer.write_scalars(record['round'], scalars)


def log_round(config, rounds_done, record, info, round_times, prefix='', observed='') -> None:
  """The round's console line; `observed`: what the run's observers add to it (', 3/5 uploads
  received, epsilon 1.2')."""
  # The ETA leaves out the first round, which compiles.
  steady = np.mean(round_times[1:]) if len(round_times) > 1 else round_times[-1]
  eta = steady * (config.num_rounds - rounds_done)
  acc_text = f'mean acc {record["mean_accuracy"]:.4f}' if record else 'not evaluated'
  logging.info('%sround %d/%d: %s, train loss %.4f%s, %.2f s/round, ETA %.0f s', prefix,
               rounds_done, config.num_rounds, acc_text, info.train_loss, observed,
               round_times[-1], eta)
