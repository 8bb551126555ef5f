"""Tuning without reading the test split: nothing of eval_validation with the field off (with it
on, each client's validation accuracy against a direct forward pass is in
generalization_test.py, on its simulator); a partition without validation splits refused; the
tuning sweep's two stages; and the choice of (clip, lr) on validation alone, which poisoned test
accuracies cannot move."""
import json
import math
import os

import numpy as np
import pytest

from conftest import load_file
from fedssa_jax import config_lib, data
from fedssa_jax.engine import parts
from fedssa_jax.engine.evaluation import Evaluation
from fedssa_jax.errors import ConfigError
from fedssa_jax.run import lens, outputs, tuning

sweeps = load_file('launch/sweep.py', 'sweep_launcher').load_sweeps()


# ----------------------------------------------------------------------------------------------
# The validation split evaluated
# ----------------------------------------------------------------------------------------------

def _evaluation(val=None):
  n = 4
  return Evaluation(round=1, evaluated=np.array([0, 2, 3]), reevaluated=0,
                    accuracy=np.zeros(n), classifier_accuracy=np.zeros(n),
                    batch_accuracy=np.zeros(n), count=np.zeros(n), metrics={}, counts={},
                    val_accuracy=val)


class _State:
  round = 2
  costs = type('Costs', (), {'up_floats': 0, 'down_floats': 0, 'client_flops': 0})()


def test_with_eval_validation_off_records_and_summaries_have_no_val_field():
  assert lens.validation(_evaluation()) == {}
  assert lens.validation(_evaluation(np.array([0.5, 9.0, 0.25, 0.75]))) == {
      'val_accuracy': pytest.approx(0.5)}  # the evaluated clients' only
  c = config_lib.build('cifar10', 'hetero,tiny')
  assert c.eval_validation is False
  progress = outputs.Progress(history=[{'round': 2, 'mean_accuracy': 0.5,
                                        'client_accuracy': [0.5]}], round_times=[1.0])
  summary = outputs.make_summary(c, _State(), progress)
  assert 'final_val_accuracy' not in summary and set(summary) == set(outputs.SUMMARY_FIELDS)
  assert 'validation' not in lens.lens_text(summary)
  c.eval_validation = True
  progress.history[-1]['val_accuracy'] = 0.75
  summary = outputs.make_summary(c, _State(), progress)
  assert summary['final_val_accuracy'] == 0.75
  assert lens.lens_text(summary).endswith('validation 0.7500)')


def test_a_partition_without_validation_splits_is_refused():
  c = config_lib.build('cifar10', 'hetero,n1000')
  c.partition.kind, c.eval_validation = 'resample', True
  with pytest.raises(ConfigError, match="partition.kind='resample' draws none"):
    config_lib.validate(c)
  c.eval_validation = False
  config_lib.validate(c)
  z, n = np.zeros((3, 2), np.int32), np.ones(3, np.int32)
  cd = data.ClientData(z, n, z, np.array([4, 0, 2]), z, n, np.ones((3, 10), bool))
  parts.check_validation([cd], [np.array([0, 2])])  # client 1 is not evaluated
  with pytest.raises(ConfigError, match=r'1 of the 3 evaluated clients \(client 1 first\)'):
    parts.check_validation([cd], [np.arange(3)])


# ----------------------------------------------------------------------------------------------
# The choice on validation alone
# ----------------------------------------------------------------------------------------------

def _config(run) -> dict:
  """The config.json 'config' a run of a sweep would write (its variant and overrides)."""
  path, variants = run.config.split(':')
  c = config_lib.build(os.path.basename(path)[:-3], variants)
  for field, value in run.overrides:
    node = c
    *parents, leaf = field.split('.')
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


def _write(sweep_dir, run, val, test, config=None):
  folder = os.path.join(sweep_dir, run.name)
  os.makedirs(folder, exist_ok=True)
  config = config or _config(run).to_dict()
  with open(os.path.join(folder, 'config.json'), 'w') as f:
    json.dump({'config': config, 'derived': {}}, f, default=list)
  with open(os.path.join(folder, 'summary.json'), 'w') as f:
    json.dump({'final_val_accuracy': val, 'final_mean_accuracy': test}, f)


def _fake_stage1(sweep_dir, best, poisoned):
  """Every dp_tuning run, with a validation accuracy highest at `best[eps]` = (clip, lr) and a
  test accuracy highest at `poisoned[eps]` instead (and the lowest at `best`)."""
  for r in sweeps.get_sweep('dp_tuning'):
    o = r.override_dict
    eps = o.get('privacy.target_epsilon', math.inf)
    cell = (o.get('privacy.clip_norm'), o['optimizer.lr'])
    val = 0.8 if cell == best[eps] else 0.5 + 0.01 * o['optimizer.lr']
    test = 0.95 if cell == poisoned[eps] else 0.3 if cell == best[eps] else 0.6
    _write(sweep_dir, r, val, test)


BEST = {math.inf: (None, 0.01), 1.0: (0.1, 0.6), 4.0: (1.0, 0.2), 8.0: (1.0, 0.06)}
POISON = {math.inf: (None, 0.02), 1.0: (5.0, 0.04), 4.0: (0.1, 2.0), 8.0: (1.0, 0.02)}


def test_the_choice_reads_validation_only_and_reports_the_chosen_runs_test(tmp_path):
  _fake_stage1(tmp_path, BEST, POISON)
  picks = tuning.chosen(str(tmp_path), 'fedssa')
  assert {e: (c.clip, c.lr) for e, c in picks.items()} == BEST
  assert all(c.test == [0.3] for c in picks.values())  # the chosen run's test, not the best
  selections = tuning.select(tuning.candidates(str(tmp_path)))
  assert sorted(s.candidates for s in selections.values()) == [4, 9, 9, 9]
  edge = {k[2]: s.edge for k, s in selections.items()}
  assert edge == {math.inf: False, 1.0: True, 4.0: True, 8.0: False}  # the smallest clip, lr
  table = tuning.tuned_tables(selections, ('fedssa',))
  assert ('| fedssa | 30.00 (C 0.1, lr 0.6; val 80.00, 9 tried) † | 30.00 (C 1, lr 0.2; val '
          '80.00, 9 tried) † | 30.00 (C 1, lr 0.06; val 80.00, 9 tried) | 30.00 (lr 0.01; val '
          '80.00, 4 tried) |') in table
  assert '95.00' not in table and '| method | ε = 1 | ε = 4 | ε = 8 | ε = ∞ |' in table
  # Other test accuracies, the same validation ones: the same choice, its own test accuracy.
  for folder in os.listdir(tmp_path):
    path = os.path.join(tmp_path, folder, 'summary.json')
    s = json.load(open(path))
    s['final_mean_accuracy'] = 1 - s['final_mean_accuracy']
    json.dump(s, open(path, 'w'))
  again = tuning.chosen(str(tmp_path), 'fedssa')
  assert {e: (c.clip, c.lr, c.test) for e, c in again.items()} == {
      e: (c.clip, c.lr, [0.7]) for e, c in picks.items()}


def test_ties_and_runs_outside_a_tuning_sweep():
  a = tuning.Candidate('fd', 4.0, 's', 1.0, 0.2, [0.7, 0.9], [0.1, 0.1])
  b = tuning.Candidate('fd', 4.0, 's', 0.1, 2.0, [0.8], [0.9])
  (s,) = tuning.select([a, b]).values()
  assert s.chosen is b  # equal means (0.8): the smaller clip
  assert tuning.budget({'privacy.dp_sgd': False}) == math.inf
  assert tuning.budget({'privacy.dp_sgd': True, 'privacy.target_epsilon': 0.0}) is None


def test_the_tuning_sweeps_stages(tmp_path):
  stage1 = sweeps.get_sweep('dp_tuning')
  assert len(stage1) == len({r.name for r in stage1}) == 4 + 3 * 9
  for r in stage1[::5]:
    config_lib.validate(_config(r))
  with pytest.raises(ValueError, match='31 have not ended'):
    sweeps.get_sweep('dp_tuning_others', str(tmp_path))
  _fake_stage1(tmp_path, BEST, POISON)
  stage2 = sweeps.get_sweep('dp_tuning_others', str(tmp_path))
  assert len(stage2) == len({r.name for r in stage2}) == 6 * (4 + 3 * 3)
  for r in stage2:
    o = r.override_dict
    assert o['eval_validation'] is True and o['method'] != 'fedssa'
    eps = o.get('privacy.target_epsilon', math.inf)
    assert o.get('privacy.clip_norm') == BEST[eps][0]  # FedSSA's chosen clip, its lrs
  for r in stage2[::7]:
    config_lib.validate(_config(r))
