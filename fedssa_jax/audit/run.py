"""`run_audit(config, workdir, canaries=..., upload_canaries=...)`: one audited run, from data to
audit.json (the package's docstring says what it measures)."""
from __future__ import annotations

import json
import logging
import math
import os
import time

import jax
import ml_collections
import numpy as np

from fedssa_jax import config_lib, data, privacy
from fedssa_jax.audit import canaries as canaries_lib
from fedssa_jax.audit import losses, scores, uploads
from fedssa_jax.engine import simulator, uplink
from fedssa_jax.headcount import cohort_size
from fedssa_jax.errors import require
from fedssa_jax.run import observers, train

FILE = 'audit.json'


def check(config: ml_collections.ConfigDict, canaries: int, upload_canaries: int,
          mechanisms: str, training: bool = True) -> None:
  """The audit's own checks, before any data loads (after config_lib.validate's)."""
  p = config.privacy
  require(mechanisms in ('auto', 'dp_sgd', 'upload'),
          f"--mechanism={mechanisms!r}: choose 'auto' (what the config turns on), 'dp_sgd' "
          "or 'upload'.")
  require(config.new_clients == 0, 'The audit counts every client a participant: set '
          '--config.new_clients=0 (new clients hold no canary and are never trained).')
  if training:
    require(mechanisms != 'dp_sgd' or privacy.enabled(p),
            '--mechanism=dp_sgd audits DP-SGD, which this config leaves off: add '
            '--config.privacy.dp_sgd=True (and a noise_multiplier or target_epsilon), or use '
            '--mechanism=auto.')
    require(mechanisms != 'upload' or privacy.upload_enabled(p),
            '--mechanism=upload audits client-level DP on the uploads, which this config '
            'leaves off: add --config.privacy.upload=True, or use --mechanism=auto.')
    scores.check_canaries(canaries, p.delta, '--canaries')
  else:
    require(mechanisms != 'dp_sgd', '--notrain audits the uploads\' mechanism alone; DP-SGD '
            'is audited through a run: drop --notrain.')
    require(privacy.upload_enabled(p), '--notrain audits client-level DP on the uploads, which '
            'this config leaves off: add --config.privacy.upload=True, or drop --notrain to '
            'train the config with canaries.')
  if privacy.upload_enabled(p) and mechanisms != 'dp_sgd':
    scores.check_canaries(upload_canaries, p.delta, '--upload_canaries')


def run_audit(config: ml_collections.ConfigDict, workdir: str, *, canaries: int = 1000,
              upload_canaries: int = 1000, mechanisms: str = 'auto', training: bool = True,
              dataset: data.Dataset | None = None, progress=logging.info) -> dict:
  """Trains `config` once with `canaries` training-data canaries (each included w.p. 1/2),
  audits them and, with privacy.upload on, `upload_canaries` upload canaries; writes
  audit.json into `workdir` and returns its contents. `progress(line)` takes a line per round
  (the command prints them). Without `training`, only the uploads' mechanism is audited (it
  reads no data and no model: `mechanism_audit`)."""
  config_lib.validate(config)
  check(config, canaries, upload_canaries, mechanisms, training)
  train.check_workdir_writable(workdir)
  if not training:
    return _write(config, workdir, mechanism_audit(config, upload_canaries))
  start = time.time()
  with config_lib.matmul_precision(config):
    ds = dataset or data.load_dataset(config.dataset, config.data_dir, config.download,
                                      config.image_size)
    data.check_fits_models(ds)
    cd = data.partition_from_config(config, ds)
    drawn = canaries_lib.data_canaries(config.seed, cd, ds.labels, canaries)
    audit_ds, audit_cd, rows = canaries_lib.with_canaries(ds, cd, drawn)
    progress(f'Auditing {config.method} on {config.dataset}: {canaries} canaries, '
             f'{int(drawn.included.sum())} of them in training, outputs in {workdir}')
    sim = simulator.Simulator(config, audit_ds, audit_cd, workdir=workdir)  # its disk store's
    state, record = _train(sim, config, progress)
    out = {'method': config.method, 'dataset': config.dataset, 'rounds': int(state.round),
           'trained': True,
           'mean_accuracy': float(np.nanmean(sim.evaluate(state).accuracy)),
           'training_data': _data_audit(sim, state, drawn, rows, record, config),
           'mia': _mia(sim, state, cd, drawn)}
    if privacy.upload_enabled(config.privacy) and mechanisms != 'dp_sgd':
      out['upload'] = _upload_audit(config, sim.upload_privacy, sim.num_clients,
                                    upload_canaries, record.get('dp_upload_epsilon'))
  out['seconds'] = round(time.time() - start, 1)
  return _write(config, workdir, out)


def mechanism_audit(config: ml_collections.ConfigDict, upload_canaries: int = 1000) -> dict:
  """The uploads' mechanism-level audit of `config` without its run: the accountant a run of
  it builds (every client a participant: new_clients 0), its canary clients after the
  config's num_clients. `run_epsilon` is the run's epsilon where it is the same for every
  client (central mode: each round a release of the sum); in local mode it depends on how
  often each client is drawn, and only a run gives it (None here)."""
  start = time.time()
  n = int(config.num_clients)
  acct = uplink.upload_accountant(config, n, cohort_size(n, config.participation))
  run_eps = float(acct.epsilons([config.num_rounds])[0]) if acct.central else None
  return {'method': config.method, 'rounds': int(config.num_rounds), 'trained': False,
          'upload': _upload_audit(config, acct, n, upload_canaries, run_eps),
          'seconds': round(time.time() - start, 1)}


def _write(config, workdir: str, out: dict) -> dict:
  if jax.process_index() == 0:
    with open(os.path.join(workdir, FILE), 'w') as f:
      f.write(json.dumps({'config': config.to_dict(), **out}, indent=2, default=_jsonable))
  return out


def _jsonable(x):
  if isinstance(x, (np.integer, np.floating, np.bool_)):
    return x.item()
  if isinstance(x, (tuple, np.ndarray)):
    return list(x)
  return str(x)


def _train(sim: simulator.Simulator, config, progress):
  """The run's rounds, its accountants following them as a run's observers do. Returns the
  last state and the observers' record of the last round."""
  watching = observers.watching(sim)
  states = observers.initial_states(watching)
  state, info = sim.init_state(), None
  while state.round < config.num_rounds:
    if any(o.stops(int(state.round), {0: states[o.name]}) for o in watching):
      break
    t0 = time.time()
    state, (info,) = sim.run_round(state)
    for o in watching:
      states[o.name] = o.observe(0, info, states[o.name])
    progress(f'round {state.round}/{config.num_rounds}: train loss {info.train_loss:.4f}, '
             f'{time.time() - t0:.2f} s')
  record = {} if info is None else {
      k: v for o in watching for k, v in o.record(0, info, states[o.name]).items()}
  return state, record


def _data_audit(sim, state, drawn: canaries_lib.DataCanaries, rows, record, config) -> dict:
  """The training-data canaries' audit: each scored minus its owner's loss on it."""
  sets = [rows[drawn.owner == k] for k in range(sim.num_clients)]
  per_client = losses.client_losses(sim, state, sets)
  score = np.empty(drawn.size)
  for k in range(sim.num_clients):
    score[drawn.owner == k] = -per_client[k]
  accounted = record.get('dp_epsilon', math.inf) if sim.privacy is not None else math.inf
  return scores.audit(score[drawn.included], score[~drawn.included],
                      config.privacy.delta, accounted)


def _mia(sim, state, cd: data.ClientData, drawn: canaries_lib.DataCanaries) -> dict:
  """The loss-threshold attack, pooled over the clients: members each client's training
  samples, non-members its test samples (less the canaries' images)."""
  train_sets = [cd.train_idx[k, :n] for k, n in enumerate(cd.train_n)]
  test_sets = [np.setdiff1d(cd.test_idx[k, :n], drawn.image) for k, n in enumerate(cd.test_n)]
  members = losses.client_losses(sim, state, train_sets)
  others = losses.client_losses(sim, state, test_sets)
  return {**scores.mia(-np.concatenate(members), -np.concatenate(others)),
          'pooled': 'over clients'}


def _upload_audit(config, acct, num_clients: int, m: int, run_epsilon) -> dict:
  """The uploads' mechanism-level audit (uploads.py) with the accountant `acct` of a run of
  `num_clients` clients (the canaries' ids follow theirs), beside the epsilon of its
  num_rounds releases without sampling; `run_epsilon` the run's own (None: not known)."""
  p = config.privacy
  score, included = uploads.upload_scores(
      config.seed, m, config.num_rounds, num_clients, clip=float(p.upload_clip),
      std=float(acct.std), central=acct.central)
  audited = privacy.upload_epsilon(p.accountant, acct.noise_multiplier, config.num_rounds,
                                   p.delta)
  return {**scores.audit(score[included], score[~included], p.delta, audited),
          'mode': p.upload_mode, 'noise_multiplier': float(acct.noise_multiplier),
          'run_epsilon': run_epsilon, 'level': 'mechanism'}


def table(out: dict) -> str:
  """The console's table of an audit's numbers."""
  fmt = lambda x: 'none' if x is None else f'{x:.3g}'
  lines = [f'{"canaries in":<16}{"epsilon":>9}{"lower bound (95%)":>19}{"canaries":>10}'
           f'{"AUROC":>7}']
  for name, what in (('training_data', 'training data'), ('upload', 'uploads')):
    if name in out:
      a = out[name]
      lines.append(f'{what:<16}{fmt(a["epsilon"]):>9}{a["epsilon_lower"]:>19.3g}'
                   f'{a["canaries"]:>10}{a["auroc"]:>7.3f}'
                   + ('  ABOVE epsilon: a bug' if a['exceeds'] else ''))
  if 'mia' in out:
    mia = out['mia']
    lines.append(f'membership inference (loss threshold): advantage {mia["advantage"]:.3f}, '
                 f'AUROC {mia["auroc"]:.3f}; mean accuracy {out["mean_accuracy"]:.4f}')
  else:
    lines.append('not trained (--notrain): the uploads\' mechanism alone')
  return '\n'.join(lines)
