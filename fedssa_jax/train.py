"""train_and_evaluate(config, workdir): one federated run, from data to summary.json.

Outputs in `workdir`:
- config.json     the resolved config plus derived facts (K, partition fingerprint, families)
- metrics.jsonl   one JSON record per evaluated round (schema in README.md)
- events.out.*    TensorBoard scalars (CLU metric writer)
- summary.json    final/best mean accuracy, costs to target, wall time
"""
from __future__ import annotations

import json
import logging
import os
import time

import jax
import ml_collections
import numpy as np
from clu import metric_writers
from clu import periodic_actions

from fedssa_jax import config_lib, data, engine


# The keys of every metrics.jsonl record; README.md documents each one.
METRICS_FIELDS = (
    'round', 'mean_accuracy', 'client_accuracy', 'participant_accuracy_reference',
    'train_loss', 'train_accuracy', 'participants', 'up_floats', 'down_floats', 'client_flops',
    'cum_up_floats', 'cum_down_floats', 'cum_floats', 'cum_client_flops', 'method_metrics',
    'round_seconds', 'elapsed_seconds')
SUMMARY_FIELDS = (
    'method', 'dataset', 'rounds', 'final_mean_accuracy', 'best_mean_accuracy', 'best_round',
    'final_client_accuracy', 'target_accuracy', 'to_target', 'cum_up_floats',
    'cum_down_floats', 'cum_client_flops', 'seconds_per_round_steady', 'first_round_seconds',
    'wall_seconds')


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
  """Runs `config` and writes its outputs to `workdir`. Returns the summary dict."""
  config_lib.validate(config)
  with config_lib.matmul_precision(config):
    return _train_and_evaluate(config, workdir, dataset)


def _train_and_evaluate(config, workdir, dataset):
  os.makedirs(workdir, exist_ok=True)
  start = time.time()
  ds = dataset or data.load_dataset(config.dataset, config.data_dir, config.download)
  cd = data.partition_from_config(config, ds)
  sim = engine.Simulator(config, ds, cd)
  is_main = jax.process_index() == 0

  derived = {
      'cohort_size': sim.k,
      'num_classes': ds.num_classes,
      'partition_fingerprint': data.fingerprint(cd),
      'client_family': [sim.groups[g].family for g in sim.group_of],
      'client_train_samples': cd.train_n, 'client_test_samples': cd.test_n,
      'client_seen_classes': [np.flatnonzero(s).tolist() for s in cd.seen],
      'flops_per_train_sample': sim.flops_per_sample,
      'backend': jax.default_backend(),
      'jax_version': jax.__version__,
  }
  if is_main:
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      f.write(json.dumps({'config': config.to_dict(), 'derived': derived}, indent=2,
                         default=_jsonable))
  logging.info('N=%d clients, K=%d per round, groups: %s', sim.num_clients, sim.k,
               ', '.join(f'{g.family} x{g.size}' for g in sim.groups))

  writer = metric_writers.create_default_writer(workdir, just_logging=not is_main)
  metrics_path = os.path.join(workdir, 'metrics.jsonl')
  if is_main:
    open(metrics_path, 'w').close()
  # Rounds per second and an ETA, in the logs and TensorBoard ('steps' are rounds here).
  progress = periodic_actions.ReportProgress(num_train_steps=config.num_rounds, writer=writer,
                                             every_steps=1)
  state = sim.init_state()
  history = []
  target = None
  round_times = []
  for t in range(config.num_rounds):
    t0 = time.time()
    state, info = sim.run_round(state)
    rounds_done = state['round']
    last = rounds_done == config.num_rounds
    record = None
    if rounds_done % config.eval_every == 0 or last:
      ev = sim.evaluate(state)
      acc = ev['accuracy']
      cohort = info['cohort']
      record = {
          'round': rounds_done,
          'mean_accuracy': float(acc.mean()),
          'client_accuracy': acc,
          'participant_accuracy_reference': float(ev['batch_accuracy'][cohort].mean()),
          'train_loss': info['train_loss'],
          'train_accuracy': info['train_accuracy'],
          'participants': cohort,
          'up_floats': info['up_floats'], 'down_floats': info['down_floats'],
          'client_flops': info['client_flops'],
          'cum_up_floats': state['costs']['up_floats'],
          'cum_down_floats': state['costs']['down_floats'],
          'cum_floats': state['costs']['up_floats'] + state['costs']['down_floats'],
          'cum_client_flops': state['costs']['client_flops'],
          # A method's further test metrics (e.g. FedProto's nearest-prototype accuracy).
          'method_metrics': {name: float(ev[name].mean()) for name in sim.method.eval_metrics},
      }
    jax.block_until_ready(state['params'])
    dt = time.time() - t0
    round_times.append(dt)
    if record is not None:
      record['round_seconds'] = dt
      record['elapsed_seconds'] = time.time() - start
      history.append(record)
      if target is None and record['mean_accuracy'] >= config.target_accuracy:
        target = {'round': rounds_done, 'cum_floats': record['cum_floats'],
                  'cum_up_floats': record['cum_up_floats'],
                  'cum_down_floats': record['cum_down_floats'],
                  'cum_client_flops': record['cum_client_flops']}
      if is_main:
        with open(metrics_path, 'a') as f:
          f.write(_dump(record) + '\n')
        scalars = {k: v for k, v in record.items() if isinstance(v, float)}
        scalars.update(record['method_metrics'])
        scalars['accuracy_q25'], scalars['accuracy_median'], scalars['accuracy_q75'] = (
            np.quantile(record['client_accuracy'], [0.25, 0.5, 0.75]).tolist())
        writer.write_scalars(rounds_done, scalars)
    progress(rounds_done)
    # Steady-state seconds per round exclude round 1, which compiles.
    steady = np.mean(round_times[1:]) if len(round_times) > 1 else dt
    eta = steady * (config.num_rounds - rounds_done)
    acc_text = f'mean acc {record["mean_accuracy"]:.4f}' if record else 'not evaluated'
    logging.info('round %d/%d: %s, train loss %.4f, %.2f s/round, ETA %.0f s', rounds_done,
                 config.num_rounds, acc_text, info['train_loss'], dt, eta)
  writer.flush()

  accs = [r['mean_accuracy'] for r in history]
  summary = {
      'method': config.method,
      'dataset': config.dataset,
      'rounds': state['round'],
      'final_mean_accuracy': accs[-1] if accs else None,
      'best_mean_accuracy': max(accs) if accs else None,
      'best_round': history[int(np.argmax(accs))]['round'] if accs else None,
      'final_client_accuracy': history[-1]['client_accuracy'] if history else None,
      'target_accuracy': config.target_accuracy,
      'to_target': target,  # None if the target was never reached
      'cum_up_floats': state['costs']['up_floats'],
      'cum_down_floats': state['costs']['down_floats'],
      'cum_client_flops': state['costs']['client_flops'],
      'seconds_per_round_steady': float(np.mean(round_times[1:])) if len(round_times) > 1
                                  else (round_times[0] if round_times else None),
      'first_round_seconds': round_times[0] if round_times else None,
      'wall_seconds': time.time() - start,
  }
  if is_main:
    with open(os.path.join(workdir, 'summary.json'), 'w') as f:
      f.write(json.dumps(summary, indent=2, default=_jsonable))
  logging.info('Done: final mean accuracy %s, best %s, wall %.1f s',
               summary['final_mean_accuracy'], summary['best_mean_accuracy'],
               summary['wall_seconds'])
  return summary
