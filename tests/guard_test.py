"""The blow-up guard (guards.check_blowup): it stops a run whose finite loss diverges, naming the
round, the statistic and the clients, and leaves healthy runs alone. (main_every_method_test.py
runs every method 3 rounds with the guard at its defaults.)"""
import json
import os
import types

import numpy as np
import pytest

from fedssa_jax import config_lib
from fedssa_jax.run import guards, train

from conftest import load_file


def tiny(**overrides):
  c = config_lib.build('cifar10', 'hetero,tiny')
  c.model.families = ('cnn5',)
  c.num_clients, c.participation, c.num_rounds = 5, 0.4, 2
  c.update_from_flattened_dict(overrides)
  return c


@pytest.mark.slow  # a whole run, compiled
def test_guard_stops_a_run_whose_loss_blows_up(tmp_path, small_ds):
  """lr=1e3 (gradients clipped at norm 50): the loss is finite but enormous from round 1. The
  run leaves diverged.json (a sweep does not rerun it): the round, its loss, the message."""
  with pytest.raises(train.DivergenceError) as e:
    train.train_and_evaluate(tiny(**{'optimizer.lr': 1e3}), str(tmp_path), dataset=small_ds)
  message = str(e.value)
  assert 'Training blew up in round 1: the mean train loss' in message, message
  assert 'is above guard.max_train_loss=1000' in message
  assert 'clients (loss) past it: ' in message
  assert 'Nothing of this round was saved; no checkpoint was written' in message
  assert 'smaller optimizer.lr' in message
  assert not os.path.exists(tmp_path / 'summary.json')
  assert open(tmp_path / 'metrics.jsonl').read() == ''
  diverged = json.load(open(tmp_path / 'diverged.json'))
  assert diverged['round'] == 1 and diverged['message'] == message
  assert diverged['train_loss'] > 1000 and f'{diverged["train_loss"]:.4g}' in message
  assert not any(f.endswith('.tmp') for f in os.listdir(tmp_path))  # written whole, then moved


def fake_round(loss_by_client: dict, round_=7):
  """check_blowup's arguments for a round whose cohort had these mean losses (10 samples each)."""
  cohort = np.array(sorted(loss_by_client))
  losses = np.array([loss_by_client[c] for c in cohort], np.float64)
  info = types.SimpleNamespace(cohort=cohort, train_samples=np.full(len(cohort), 10.0),
                               train_loss_sum=losses * 10, train_loss=float(losses.mean()))
  sim = types.SimpleNamespace(num_classes=10)
  ckpts = types.SimpleNamespace(steps=lambda: [5, 6], directory='/w/checkpoints')
  return sim, types.SimpleNamespace(round=round_), info, ckpts


def test_growth_over_the_best_round_trips_and_names_the_clients():
  sim, state, info, ckpts = fake_round({3: 0.01, 8: 60.0})  # mean 30, 3000x the best
  with pytest.raises(train.DivergenceError) as e:
    guards.check_blowup(tiny(), sim, state, info, 0.01, ckpts)
  message = str(e.value)
  assert 'Training blew up in round 7: the mean train loss 30 is 3e+03 times the best' in message
  assert 'guard.loss_growth=1000' in message and 'clients (loss) past it: 8 (60)' in message
  assert 'the last good checkpoint, of round 6, is kept intact in /w/checkpoints' in message


@pytest.mark.parametrize('losses, best, overrides', [
    ({3: 2.0, 8: 2.2}, 1e-4, {}),        # 20,000x the best, but below ln(10): a wobble
    ({3: 900.0}, 5.0, {}),               # below max_train_loss, 180x the best
    ({3: 1e6}, 1.0, {'guard.max_train_loss': 0.0, 'guard.loss_growth': 0.0}),  # guard off
    ({3: 1e6}, None, {'guard.max_train_loss': 0.0}),  # the first round has no best to grow on
])
def test_healthy_or_unguarded_rounds_pass(losses, best, overrides):
  guards.check_blowup(tiny(**overrides), *fake_round(losses)[:3], best, fake_round(losses)[3])


def test_best_loss_skips_rounds_that_trained_nothing():
  """A round that trained no sample (its train loss reads 0) is no best round: after it, a
  first trained round's loss above ln(classes) must not trip the guard."""
  round_of = lambda loss, samples: types.SimpleNamespace(train_loss=loss,
                                                         train_samples=np.array(samples))
  best = None
  for loss, samples, want in ((0.0, [0, 0], None), (3.3, [40, 30], 3.3), (0.0, [0, 0], 3.3),
                              (4.0, [40, 30], 3.3), (2.0, [40, 0], 2.0)):
    best = guards.best_train_loss(best, round_of(loss, samples))
    assert best == want


def test_every_config_keeps_the_guard_on():
  """The configs in configs/ run with the documented thresholds (docs/operations.md, the
  blow-up guard)."""
  base = config_lib.base_config()
  for name, arg in [('cifar10', 'hetero,n10'), ('cifar10', 'homo,n100'), ('cifar100', 'dir,n50'),
                    ('tiny', None)]:
    c = load_file(f'configs/{name}.py', f'config_{name}').get_config(arg)
    assert (c.guard.max_train_loss, c.guard.loss_growth) == (
        base.guard.max_train_loss, base.guard.loss_growth) == (1e3, 1e3)
