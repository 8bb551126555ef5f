"""Packed seeds (simulator.Simulator's seed axis, train.train_replicas): replica r of a packed run
equals the run of its seed alone, with each replica's own partition (padded index rows); chunk lists of
replicas with different cohorts are aligned with all-inactive chunks; a stopped packed run
resumes to the same records; what is not supported is refused by name. Every method packed
against its seed alone: tests/main_every_method_test.py."""
import json
import os
import types

import jax
import numpy as np
import pytest

from conftest import assert_same_last_checkpoint, assert_same_records, assert_same_round_infos
from conftest import capturing_round_infos
from fedssa_jax import config_lib, data, main

from fedssa_jax.engine import schedule, simulator, training
from fedssa_jax.run import console, guards, train

SEEDS = (0, 3)
ROUNDS = 2
# Record fields that are timings (the rest must match a run alone).
TIMINGS = ('round_seconds', 'elapsed_seconds')


def test_epoch_order_is_invariant_to_the_padding_width():
  # Packed replicas pad their training index rows to a common width; each client's shuffle must
  # stay that of its run alone (jax_threefry_partitionable: a longer draw starts the same).
  key = jax.random.PRNGKey(7)
  for n, short, long in [(5, 16, 48), (16, 16, 32), (0, 16, 64), (33, 48, 512)]:
    a = np.asarray(training.epoch_order(key, n, short))
    b = np.asarray(training.epoch_order(key, n, long))
    np.testing.assert_array_equal(a[:n], b[:n])
    np.testing.assert_array_equal(np.sort(b[:n]), np.arange(n))


def test_aligned_chunks_pad_a_replica_with_fewer_chunks_of_a_group():
  # Two groups of 2 clients per call (padding slot 9); replica 0 has two chunks of group 0 and
  # none of group 1, replica 1 one of each. Each replica keeps its own chunks in order.
  groups = [types.SimpleNamespace(clients_per_call=2, rows=9)] * 2
  c = lambda gi, slots, active: (gi, np.asarray(slots), np.asarray(active))
  lists = [[c(0, [0, 1], [1, 1]), c(0, [2, 9], [1, 0])],
           [c(0, [3, 9], [1, 0]), c(1, [4, 5], [1, 1])]]
  out = schedule.aligned_chunks(groups, lists)
  assert [gi for gi, *_ in out] == [0, 0, 1]
  np.testing.assert_array_equal(out[0][1], [[0, 1], [3, 9]])
  np.testing.assert_array_equal(out[1][1], [[2, 9], [9, 9]])  # replica 1: an idle chunk
  np.testing.assert_array_equal(out[1][2], [[1, 0], [0, 0]])
  np.testing.assert_array_equal(out[2][1], [[9, 9], [4, 5]])  # replica 0: an idle chunk
  np.testing.assert_array_equal(out[2][2], [[0, 0], [1, 1]])


# Every method's packed replicas against its seed alone (with an all-inactive chunk in every
# group, as aligned_chunks pads): tests/main_every_method_test.py, through the command line.


# -- Whole runs: outputs, resume, refusals --------------------------------------------------------

def tiny_config(seed=0, **more):
  c = config_lib.build('cifar10', 'hetero,tiny')
  c.model.families = ('cnn5',)  # one group: the packed mechanics are the same for two
  c.num_clients, c.participation, c.num_rounds = 5, 0.4, ROUNDS
  c.batch_size, c.eval_batch_size, c.local_epochs = 16, 16, 1
  c.seed = seed
  c.update_from_flattened_dict(more)
  return c


def records(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS} for line in f]


def capturing_evaluations(monkeypatch):
  """{(phase, seed): [Evaluation of each round]}, as runs evaluate; phase: the list's one item,
  set by the caller before each run."""
  evals, phase = {}, ['']
  evaluate = simulator.Simulator.evaluate

  def capture(sim, state, previous=None, seed_index=0):
    ev = evaluate(sim, state, previous, seed_index)
    evals.setdefault((phase[0], sim.seeds[seed_index]), []).append(ev)
    return ev
  monkeypatch.setattr(simulator.Simulator, 'evaluate', capture)
  return evals, phase


@pytest.mark.slow  # whole runs compiled
def test_packed_run_writes_each_seeds_outputs_and_resumes_after_a_stop(small_ds, tmp_path,
                                                                       monkeypatch):
  """Each replica of the packed run equals its seed's run alone: the records, each round's
  figures of each participant and evaluation of each client, and the last checkpoint (every
  array of the state). The seeds' partitions differ in width (padded index rows)."""
  seeds = SEEDS
  base = tiny_config()
  widths = {int(data.partition_from_config(tiny_config(seed=s), small_ds).train_idx.shape[1])
            for s in seeds}
  assert len(widths) > 1, 'the replicas\' partitions have one width: pick other seeds'
  infos = capturing_round_infos(monkeypatch)
  evals, phase = capturing_evaluations(monkeypatch)
  alone = {}
  for s in seeds:
    alone[s] = str(tmp_path / f'alone{s}')
    train.train_and_evaluate(tiny_config(seed=s), alone[s], dataset=small_ds)
  whole = [str(tmp_path / 'whole' / f'seed{s}') for s in seeds]
  phase[0] = 'packed'
  summaries = train.train_replicas(train.replica_configs(base, seeds), whole, dataset=small_ds)
  phase[0] = 'later'
  assert len(summaries) == len(seeds)
  for s, w in zip(seeds, whole):
    got = records(w)
    assert [r['round'] for r in got] == list(range(1, ROUNDS + 1))
    assert_same_records(got, records(alone[s]), f'seed {s}')
    assert_same_round_infos(infos[True, s], infos[False, s], f'seed {s}')
    assert len(evals['packed', s]) == len(evals['', s]) == ROUNDS
    for p, a in zip(evals['packed', s], evals['', s]):
      np.testing.assert_allclose(p.accuracy, a.accuracy, atol=1e-9)
      np.testing.assert_allclose(p.batch_accuracy, a.batch_accuracy, atol=1e-9)
    assert_same_last_checkpoint(alone[s], w, ROUNDS, f'seed {s}')
    assert json.load(open(os.path.join(w, 'config.json')))['config']['seed'] == s
    assert os.path.exists(os.path.join(w, 'summary.json'))

  # A stop request (SIGTERM) after round 1: every replica checkpoints, then Preempted.
  stopped = [str(tmp_path / 'stopped' / f'seed{s}') for s in seeds]
  stop = console.StopRequests()
  stop.signal_name = 'SIGTERM'  # what its handler sets on a first SIGTERM
  with pytest.raises(train.Preempted, match='stopped after round 1'):
    train.train_replicas(train.replica_configs(base, seeds), stopped, dataset=small_ds,
                         stop=stop)
  for w in stopped:
    assert os.listdir(os.path.join(w, 'checkpoints')) == ['1']
  train.train_replicas(train.replica_configs(base, seeds), stopped, dataset=small_ds)
  for a, b in zip(stopped, whole):
    assert records(a) == records(b)

  # A replica that diverges fails alone: the other finishes, and the error names it. It leaves
  # diverged.json; the other's, stale, of an earlier try, goes when the run starts.
  real_check = guards.check_finite

  def diverge(sim, state, info, ckpts):
    if ckpts.directory == os.path.join(failing[1], 'checkpoints'):  # the second seed's
      raise train.DivergenceError('a divergence for the test')
    real_check(sim, state, info, ckpts)
  failing = [str(tmp_path / 'failing' / f'seed{s}') for s in seeds]
  os.makedirs(failing[0])
  with open(os.path.join(failing[0], 'diverged.json'), 'w') as f:
    json.dump({'round': 9, 'train_loss': None, 'message': 'an earlier try'}, f)
  monkeypatch.setattr(guards, 'check_finite', diverge)
  with pytest.raises(train.DivergenceError,
                     match=f'1 of the 2 packed seeds diverged.*Seed {seeds[1]} '):
    train.train_replicas(train.replica_configs(base, seeds), failing, dataset=small_ds)
  monkeypatch.setattr(guards, 'check_finite', real_check)
  assert records(failing[0]) == records(whole[0])
  assert os.path.exists(os.path.join(failing[0], 'summary.json'))
  assert not os.path.exists(os.path.join(failing[1], 'summary.json'))
  assert not os.path.exists(os.path.join(failing[0], 'diverged.json'))
  diverged = json.load(open(os.path.join(failing[1], 'diverged.json')))
  assert diverged['round'] == 1 and diverged['message'] == 'a divergence for the test'
  assert diverged['train_loss'] > 0

  # Workdirs at different rounds are refused, naming them.
  with pytest.raises(config_lib.ConfigError, match='different rounds'):
    train.train_replicas(train.replica_configs(base, (seeds[0], 5)),
                         [stopped[0], str(tmp_path / 'fresh')], dataset=small_ds)


@pytest.mark.parametrize('store', ['host', 'disk'])
def test_row_stores_are_refused(tmp_path, store):
  configs = train.replica_configs(tiny_config(population_store=store), (0, 1))
  with pytest.raises(config_lib.ConfigError, match="population_store='device'"):
    train.train_replicas(configs, [str(tmp_path / 'a'), str(tmp_path / 'b')])


def test_refusals_of_replicas_that_cannot_pack(tmp_path):
  with pytest.raises(config_lib.ConfigError, match='differ only in their seed'):
    train.train_replicas([tiny_config(0), tiny_config(1, local_epochs=2)],
                         [str(tmp_path / 'a'), str(tmp_path / 'b')])
  with pytest.raises(config_lib.ConfigError, match='must differ'):
    train.train_replicas([tiny_config(1), tiny_config(1)],
                         [str(tmp_path / 'a'), str(tmp_path / 'b')])
  with pytest.raises(config_lib.ConfigError, match='a workdir each'):
    train.train_replicas([tiny_config(0), tiny_config(1)], [str(tmp_path)] * 2)


def test_seeds_flag_is_checked(capsys, tmp_path):
  for bad in ('0,0', 'a,1', '-1'):
    rc = main.run_cli(['main', '--config=configs/tiny.py', f'--workdir={tmp_path}',
                       f'--seeds={bad}'])
    assert rc == main.EXIT_BAD_INPUT
    assert '--seeds' in capsys.readouterr().err
  rc = main.run_cli(['main', '--config=configs/tiny.py', f'--workdir={tmp_path}',
                     '--seeds=0,1', '--config.population_store=host'])
  assert rc == main.EXIT_BAD_INPUT
  assert "population_store='device'" in capsys.readouterr().err
  assert main.replica_workdir('W', 3) == os.path.join('W', 'seed3')
