"""engine.clients_per_call=-1: the chunk size measured per group (fedssa_jax/engine/per_call.py).

The chooser and its cache run under a fake timer (no model compiled); one small Simulator times
its real calls."""
import json
import logging
import os
import types

import numpy as np
import pytest

from fedssa_jax import config_lib
from fedssa_jax.engine import per_call, schedule, training
from fedssa_jax.engine.per_call import Timing
from fedssa_jax.run import train


def test_candidates_are_powers_of_two_to_the_cap_rounded_to_the_devices():
  assert per_call.candidates(5, lambda n: n) == [1, 2, 4, 5]
  assert per_call.candidates(1, lambda n: n) == [1]
  assert per_call.candidates(5, lambda n: -(-n // 2) * 2) == [2, 4, 6]


def test_round_seconds_counts_each_call_at_its_longest_client():
  steps = np.array([3, 10, 5, 7, 1])
  np.testing.assert_array_equal(per_call.call_steps(steps, 2), [10, 5, 1])
  t = Timing(step_s=0.5, call_s=2.0)
  assert per_call.round_seconds(t, steps, 1) == pytest.approx(5 * 2.0 + 0.5 * 26)
  assert per_call.round_seconds(t, steps, 2) == pytest.approx(3 * 2.0 + 0.5 * 16)
  assert per_call.round_seconds(t, steps, 8) == pytest.approx(2.0 + 0.5 * 10)
  np.testing.assert_array_equal(per_call.typical_steps(np.arange(10), 0.3), [9, 5, 0])


def test_time_calls_separates_the_steps_from_the_fixed_cost():
  now = [0.0]
  calls = []

  def run(s):  # 3 s a call and 0.25 s a step, the first (compiling) call 100 s longer
    calls.append(s)
    now[0] += 3 + 0.25 * s + (100 if len(calls) == 1 else 0)
  t = per_call.time_calls(run, (2, 6), repeats=2, clock=lambda: now[0])
  assert calls == [2, 2, 6, 2, 6]
  assert t.step_s == pytest.approx(0.25) and t.call_s == pytest.approx(3.0)
  # Shorter calls slowed by a load spike: no near-free steps, the long call's mean instead.
  times = iter([50, 9, 10, 9, 10])  # compile; then (2 steps, 6 steps) twice
  t = per_call.time_calls(lambda s: now.__setitem__(0, now[0] + next(times)), (2, 6),
                          repeats=2, clock=lambda: now[0])
  assert t.step_s == pytest.approx(10 / 6) and t.call_s == 0.0


def test_choose_takes_the_fastest_and_stops_past_a_slower_one():
  # Per step: 1 client 1 s, 2 clients 1.2 s, 4 clients 3 s, 8: 0.1 s (never reached).
  per_step = {1: 1.0, 2: 1.2, 4: 3.0, 8: 0.1}
  asked = []

  def timing(p):
    asked.append(p)
    return Timing(per_step[p], 0.0)
  steps = np.full(8, 10)
  best, table = per_call.choose([1, 2, 4, 8], 1, steps, timing)
  assert best == 2 and asked == [1, 2, 4]  # 4 is slower than 2: 8 is not tried
  assert table[2]['round_s'] == pytest.approx(4 * 1.2 * 10)
  assert table[1]['round_s'] == pytest.approx(8 * 10)
  # The rule's value first; a budget spent (None) ends the scan with the best so far.
  asked.clear()
  best, table = per_call.choose([1, 2, 4, 8], 8, steps, lambda p: asked.append(p) or (
      None if len(asked) > 2 else Timing(per_step[p], 0.0)))
  assert asked == [8, 1, 2] and best == 8 and sorted(table) == [1, 8]
  assert per_call.choose([1, 2], 1, steps, lambda p: None) == (1, {})


def _fake_sim(method='standalone', num_clients=12, k=12):
  c = config_lib.build('cifar10', 'hetero')
  c.method, c.num_clients, c.engine.clients_per_call = method, num_clients, -1
  families = ('cnn1', 'cnn2')
  members = [np.arange(i, num_clients, 2) for i in range(2)]
  groups = [schedule.Group(f, m, None, 1, len(m), None) for f, m in zip(families, members)]
  sim = types.SimpleNamespace(
      config=c, num_seeds=1, image_shape=(32, 32, 3), num_classes=10, k=k,
      num_clients=num_clients, train_n=np.full((1, num_clients), 50),
      train_cfg=training.TrainConfig(batch_size=10), method=types.SimpleNamespace(
          held_out_samples=0),
      placement=types.SimpleNamespace(rows=lambda n: n, num_devices=1))
  return sim, groups


def _fake_measure(log):
  """cnn1 fastest at 2 clients a call, cnn2 at 4 (seconds per step of a call of p clients)."""
  per_step = {'cnn1': {1: 1.0, 2: 1.5, 4: 4.0, 6: 6.0},
              'cnn2': {1: 1.0, 2: 1.2, 4: 1.5, 6: 3.5, 8: 5.0}}

  def measure(g, p):
    log.append((g.family, p))
    return Timing(per_step[g.family][p], 0.01)
  return measure


def test_choose_groups_measures_once_then_reads_the_cache(tmp_path):
  sim, groups = _fake_sim()
  path = str(tmp_path / 'cache' / per_call.FILE)
  log = []
  chosen, record = per_call.choose_groups(sim, groups, _fake_measure(log),
                                          cache=per_call.Cache(path))
  assert [g.clients_per_call for g in chosen] == [2, 4]
  assert log == [('cnn1', 1), ('cnn1', 2), ('cnn1', 4), ('cnn2', 1), ('cnn2', 2), ('cnn2', 4),
                 ('cnn2', 6)]
  assert record['source'] == 'measured' and record['setting'] == -1
  g0 = record['groups'][0]
  assert g0['family'] == 'cnn1' and g0['clients_per_call'] == 2 and g0['rule'] == 1
  # 6 clients of 5 steps: 6 calls of 1, 3 of 2, 2 of 4.
  assert g0['candidates']['2']['round_s'] == pytest.approx(3 * (0.01 + 1.5 * 5))
  assert sorted(g0['candidates']) == ['1', '2', '4']
  # Another run on the same machine: nothing timed, the same choice.
  log.clear()
  again, record = per_call.choose_groups(sim, groups, _fake_measure(log),
                                         cache=per_call.Cache(path))
  assert log == [] and record['source'] == 'cache'
  assert [g.clients_per_call for g in again] == [2, 4]
  # A larger cohort times only its new candidates (8 clients a family: 8).
  sim16, groups16 = _fake_sim(num_clients=16, k=16)
  chosen16, _ = per_call.choose_groups(sim16, groups16, _fake_measure(log),
                                       cache=per_call.Cache(path))
  assert log == [('cnn2', 8)] and [g.clients_per_call for g in chosen16] == [2, 4]


def test_the_cache_key_ignores_the_numbers_only_settings():
  sim, groups = _fake_sim()
  key = lambda cfg, fam='cnn1': per_call.group_key(sim.config, fam, cfg, 1, (32, 32, 3), 10,
                                                   1)[0]
  base = training.TrainConfig(batch_size=10)
  assert key(base) == key(training.TrainConfig(batch_size=10, lr=0.5, momentum=0.0,
                                               clip_norm=5.0))
  assert key(base) != key(training.TrainConfig(batch_size=10, clip_norm=0.0))
  assert key(base) != key(training.TrainConfig(batch_size=20))
  assert key(base) != key(base, 'cnn2')


def test_a_bad_cache_file_is_ignored_with_a_warning_and_rewritten(tmp_path, caplog):
  path = tmp_path / per_call.FILE
  sim, groups = _fake_sim()
  for text in ('{not json', json.dumps({'format': 1, 'entries': {'k': {'timings': {'1': 3}}}}),
               json.dumps([1, 2])):
    path.write_text(text)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      cache = per_call.Cache(str(path))
    assert cache.entries == {} and 'cannot be read' in caplog.text
  log = []
  per_call.choose_groups(sim, groups, _fake_measure(log), cache=cache)
  assert log and per_call.Cache(str(path)).entries  # rewritten, readable


def test_the_workdir_records_the_choice_and_a_resume_takes_it(tmp_path, caplog):
  sim, groups = _fake_sim()
  chosen, record = per_call.choose_groups(sim, groups, _fake_measure([]),
                                          cache=per_call.Cache(str(tmp_path / 'c.json')))
  workdirs = [str(tmp_path / 'a'), str(tmp_path / 'b')]
  for w in workdirs:
    os.makedirs(w)
  train._write_per_call(types.SimpleNamespace(per_call_record=record), workdirs)  # pylint: disable=protected-access
  for w in workdirs:
    with open(os.path.join(w, per_call.FILE)) as f:
      assert json.load(f) == record
  recorded = per_call.read_record(workdirs[0])
  assert recorded == {'cnn1': 2, 'cnn2': 4}
  log = []
  resumed, again = per_call.choose_groups(sim, groups, _fake_measure(log), recorded=recorded,
                                          cache=per_call.Cache(str(tmp_path / 'none.json')))
  assert log == [] and again['source'] == 'workdir'
  assert [g.clients_per_call for g in resumed] == [2, 4]
  # What the resumed run would write keeps the measured record.
  train._write_per_call(types.SimpleNamespace(per_call_record=again), workdirs)  # pylint: disable=protected-access
  assert per_call.read_record(workdirs[1]) == recorded
  with open(os.path.join(workdirs[1], per_call.FILE)) as f:
    assert json.load(f)['source'] == 'measured'
  (tmp_path / 'a' / per_call.FILE).write_text('{')
  with caplog.at_level(logging.WARNING):
    assert per_call.read_record(workdirs[0]) is None
  assert 'cannot be read' in caplog.text
  assert per_call.read_record(str(tmp_path / 'nowhere')) is None


def test_a_clients_per_call_below_minus_one_is_refused():
  c = config_lib.build('cifar10', 'hetero')
  c.engine.clients_per_call = -2
  with pytest.raises(ValueError, match='clients_per_call=-2'):
    config_lib.validate(c)


@pytest.mark.slow  # a tiny run times its real call (K = 1: one candidate), then resumes
def test_a_run_measures_records_and_its_resume_keeps_the_choice(small_ds, monkeypatch,
                                                                 tmp_path, caplog):
  monkeypatch.setenv('FEDSSA_JAX_CACHE_DIR', str(tmp_path / 'cache'))
  monkeypatch.setattr(per_call, 'REPEATS', 1)
  c = config_lib.build('cifar10', 'hetero,tiny')
  c.method, c.model.families = 'standalone', ('cnn5',)
  c.num_clients, c.participation, c.num_rounds = 5, 0.2, 1
  c.batch_size, c.eval_batch_size, c.engine.clients_per_call = 16, 16, -1
  workdir = str(tmp_path / 'run')
  with caplog.at_level(logging.INFO):
    train.train_and_evaluate(c, workdir, dataset=small_ds)
  with open(os.path.join(workdir, per_call.FILE)) as f:
    record = json.load(f)
  (group,) = record['groups']
  assert record['source'] == 'measured' and group['family'] == 'cnn5'
  assert list(group['candidates']) == ['1'] and group['clients_per_call'] == 1
  assert group['candidates']['1']['step_s'] > 0 and group['candidates']['1']['round_s'] > 0
  assert per_call.Cache(os.path.join(tmp_path, 'cache', per_call.FILE)).entries
  assert 'Clients per call (measured): cnn5 1' in caplog.text
  # The resume takes the workdir's choice: nothing timed (an empty cache), the file kept.
  monkeypatch.setenv('FEDSSA_JAX_CACHE_DIR', str(tmp_path / 'other'))
  def no_timing(*args, **kwargs):
    raise AssertionError('the resumed run timed a call')
  monkeypatch.setattr(per_call, 'measure_group', no_timing)
  c.num_rounds = 2
  train.train_and_evaluate(c, workdir, dataset=small_ds)
  with open(os.path.join(workdir, per_call.FILE)) as f:
    assert json.load(f) == record
  assert not os.path.exists(tmp_path / 'other')
