"""The run's observers (fedssa_jax/run/observers.py): each keeps its own state, round by round,
and a checkpoint written before them (their states at the top level of its progress) restores
into them, so that such a run resumes as it would have. No simulator here: the accountants are
stand-ins, the rounds RoundInfo-like records; the runs that use them are privacy_test's,
system_test's and checkpoint_test's."""
import dataclasses
import json
import logging
import types

import ml_collections
import numpy as np

from fedssa_jax.run import observers, outputs

N = 4


def config():
  return ml_collections.ConfigDict({'num_rounds': 3, 'privacy': {'delta': 1e-5},
                                    'system': {'client_seconds': False,
                                               'availability_spread': 0.0}})


def dp_stand_in(**fields):
  """DP-SGD's accountant, with no private releases (a method that makes none), and `fields`."""
  return types.SimpleNamespace(releases_at_start=0, releases_per_round=0,
                               round_steps=np.full((2, N), 2), releases_after=lambda r: 0 * r,
                               **fields)


def watching(dp=None, upload=None, cohort=None):
  """The three observers; `dp` and `upload` stand in for the accountants."""
  return [observers.SystemSection(None, config(), (0,)),
          observers.DPSGDAccounting(dp or dp_stand_in(), N, cohort, 16, config()),
          observers.UploadAccounting(upload, N, 1.0, 1e-5)]


# What a checkpoint's progress held before the observers.
OLD = {'history': [{'round': 2, 'mean_accuracy': 0.5}], 'round_times': [3.0, 1.0],
       'compile_rounds': [0], 'elapsed_seconds': 4.0, 'best_train_loss': 1.5,
       'sim_seconds': 12.5, 'dp_steps': [3, 0, 2, 0], 'budget_reached': True,
       'upload_releases': [2, 0, 1, 0], 'state_digest': 'abc'}


def test_a_checkpoint_of_the_old_layout_restores_into_the_observers():
  p = outputs.Progress.from_checkpoint(OLD, watching())
  assert p.observers == {'system': {'sim_seconds': 12.5},
                         'dp_sgd': {'steps': [3, 0, 2, 0], 'budget_reached': True},
                         'upload_dp': {'releases': [2, 0, 1, 0]}}
  assert (p.history, p.round_times, p.compile_rounds, p.elapsed_seconds, p.best_train_loss) == (
      OLD['history'], [3.0, 1.0], [0], 4.0, 1.5)
  # Saved again (the new layout, through JSON as a checkpoint holds it): the same progress.
  saved = json.loads(json.dumps(dataclasses.asdict(p)))
  assert 'dp_steps' not in saved and outputs.Progress.from_checkpoint(saved, watching()) == p


def test_only_the_runs_observers_keep_a_state_and_a_new_one_starts_fresh():
  assert outputs.Progress.from_checkpoint(OLD, []).observers == {}  # the sections off
  system_only = outputs.Progress.from_checkpoint({'sim_seconds': 0.0}, watching())
  assert system_only.observers == {o.name: o.initial() for o in watching()}
  assert system_only.observers['dp_sgd'] == {'steps': [0] * N, 'releases': [0] * N,
                                             'budget_reached': False}


def round_info(cohort, steps=None, system=None, upload_norms=None):
  return types.SimpleNamespace(cohort=np.asarray(cohort), train_steps=np.asarray(steps or []),
                               system=system, upload_norms=upload_norms)


def test_each_observer_counts_its_own_rounds():
  eps = lambda counts: np.asarray(counts, np.float64) / 10
  dp = dp_stand_in(epsilons=lambda i, steps, releases: eps(steps), noise_multiplier=1.1,
                   release_noise_multiplier=1.1, q=np.full((1, N), 0.5), target=0.0)
  local = types.SimpleNamespace(central=False, epsilons=eps, noise_multiplier=2.0)
  system, dp_sgd, upload = watching(dp, local)
  states = {o.name: o.initial() for o in (system, dp_sgd, upload)}
  clock = types.SimpleNamespace(round_seconds=2.5, online=4, sampled=np.arange(3),
                                dropped=np.array([], int), stragglers=np.array([], int),
                                work=np.array([]), lost=np.array([], int),
                                late=np.array([], int), received=np.arange(2), seconds=None)
  for cohort, steps in (([0, 2], [3, 5]), ([2, 3], [1, 1])):
    info = round_info(cohort, steps, clock, np.array([0.5, 2.0]))
    for o in (system, dp_sgd, upload):
      states[o.name] = o.observe(0, info, states[o.name])
  assert states['system'] == {'sim_seconds': 5.0}
  assert states['dp_sgd']['steps'] == [3, 0, 6, 1]
  assert states['upload_dp'] == {'releases': [1, 0, 2, 1]}
  record = {k: v for o in (system, dp_sgd, upload)
            for k, v in o.record(0, info, states[o.name]).items()}
  assert (record['cum_sim_seconds'], record['dp_epsilon'], record['dp_upload_epsilon'],
          record['dp_upload_clipped']) == (5.0, 0.6, 0.2, 0.5)
  assert ''.join(o.console(info, record) for o in (system, dp_sgd, upload)) == (
      ', 2/3 uploads received, epsilon 0.6, upload epsilon 0.2')
  central = observers.UploadAccounting(types.SimpleNamespace(central=True), N, 1.0, 1e-5)
  assert central.observe(0, round_info([1]), central.initial()) == {'releases': [1] * N}


def test_dp_sgds_budget_stops_the_run_and_each_seed_notes_it(caplog):
  exceeds = lambda i, steps, cohort, releases: 9.0 if sum(steps) + len(cohort) > 4 else None
  dp = dp_stand_in(target=8.0, next_round_exceeds=exceeds)
  dp_sgd = observers.DPSGDAccounting(dp, N, lambda t, i: np.arange(2), 16, config())
  states = {0: {'steps': [1, 1, 0, 0], 'budget_reached': False},
            1: {'steps': [0, 1, 0, 0], 'budget_reached': False}}
  assert not dp_sgd.stops(1, states)
  states[0]['steps'] = [2, 1, 0, 0]
  with caplog.at_level(logging.WARNING):
    assert dp_sgd.stops(1, states)
  assert all(s['budget_reached'] for s in states.values())
  assert 'the run ends after round 1 of 3' in caplog.text
