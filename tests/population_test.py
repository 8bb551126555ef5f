"""The population stores: device, host and disk give the same metrics (counts exactly, values to
float rounding: their training programs differ in where the rows come from); the disk store's rows,
lazy initial values, copy-on-write checkpoints and resume; evaluation of a fixed subset."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib
from fedssa_jax.engine import population, schedule, simulator
from fedssa_jax.engine.placement import Placement
from fedssa_jax.engine.state import StalePopulation
from fedssa_jax.run import train

from conftest import assert_same_records, synthetic_dataset

TIMING = ('round_seconds', 'elapsed_seconds')


def small_config(**overrides):
  """8 CNN-5 clients, K = 3, 3 rounds, a checkpoint after rounds 2 and 3 (only one kept)."""
  c = config_lib.build('cifar10', 'hetero,tiny')
  c.model.families = ('cnn5',)
  c.num_clients, c.participation = 8, 0.375
  c.partition.classes_per_client = 5
  c.num_rounds, c.local_epochs, c.batch_size, c.eval_batch_size = 3, 1, 16, 16
  c.checkpoint_every, c.checkpoint_keep = 2, 1
  c.update_from_flattened_dict(overrides)
  return c


@pytest.fixture(scope='module')
def ds():
  return synthetic_dataset(400, 160)


def records(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]


@pytest.fixture(scope='module')
def device_run(ds, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('device'))
  train.train_and_evaluate(small_config(), workdir, dataset=ds)
  return records(workdir)


@pytest.mark.slow  # whole runs, compiled
@pytest.mark.parametrize('store', ['host', 'disk'])
def test_stores_give_the_metrics_of_the_device_store(store, ds, device_run, tmp_path):
  train.train_and_evaluate(small_config(population_store=store), str(tmp_path), dataset=ds)
  got = records(str(tmp_path))
  assert len(got) == len(device_run) == 3
  assert [r.keys() for r in got] == [r.keys() for r in device_run]
  assert_same_records(got, device_run, store)
  # The run trained: accuracies moved off their first values.
  assert got[-1]['mean_accuracy'] != got[0]['mean_accuracy']


@pytest.mark.slow  # whole runs, compiled
def test_disk_store_resumes_after_a_crash_between_checkpoints(ds, device_run, tmp_path,
                                                             monkeypatch):
  """Round 3 writes its clients' rows after the checkpoint of round 2 (the only one kept); the
  crash comes before round 3's checkpoint. Resuming must read round 2's rows, untouched."""
  real = simulator.Simulator.run_round

  def crash_after_round_3(self, state):
    state, infos = real(self, state)
    if state.round == 3:
      raise KeyboardInterrupt('simulated crash')
    return state, infos

  monkeypatch.setattr(simulator.Simulator, 'run_round', crash_after_round_3)
  with pytest.raises(KeyboardInterrupt):
    train.train_and_evaluate(small_config(population_store='disk'), str(tmp_path), dataset=ds)
  assert os.listdir(tmp_path / 'checkpoints') == ['2']
  monkeypatch.setattr(simulator.Simulator, 'run_round', real)
  train.train_and_evaluate(small_config(population_store='disk'), str(tmp_path), dataset=ds)
  assert_same_records(records(str(tmp_path)), device_run, 'disk, resumed')
  # The checkpoint holds slot maps, not the population.
  restored = train.checkpoint.Checkpointer(str(tmp_path / 'checkpoints')).restore_latest()
  assert set(restored.state['params'][0]) == {'slot_of'}
  assert restored.state['params'][0]['slot_of'].shape == (8,)


@pytest.mark.slow  # whole runs, compiled
def test_subset_evaluation_equals_the_full_evaluation_of_those_clients(ds, device_run,
                                                                      tmp_path):
  """A subset gathered on the device (the host and disk stores' block evaluation is the same
  call on rows read from the store, checked above)."""
  train.train_and_evaluate(small_config(eval_clients=3), str(tmp_path), dataset=ds)
  with open(tmp_path / 'config.json') as f:
    ids = json.load(f)['derived']['eval_client_ids']
  assert len(ids) == 3 and ids == sorted(ids)
  for full, sub in zip(device_run, records(str(tmp_path))):
    assert full['evaluated_clients'] == 'all' and sub['evaluated_clients'] == 3
    np.testing.assert_array_equal(sub['client_accuracy'], np.array(full['client_accuracy'])[ids])
    assert sub['mean_accuracy'] == pytest.approx(np.mean(sub['client_accuracy']))
    assert sub['participants'] == full['participants']


def test_disk_rows_lazy_init_copy_on_write_and_growth(tmp_path):
  calls = []

  def init_fn(rows):
    calls.append(list(rows))
    return {'w': np.stack([np.full((2, 3), r, np.float32) for r in rows])}

  spec = {'w': jax.ShapeDtypeStruct((2, 3), jnp.float32)}
  table = population.DiskRows(str(tmp_path / 't'), spec, 10, init_fn)
  table.GROW = 2
  np.testing.assert_array_equal(table.read(np.array([3, 7]))['w'][:, 0, 0], [3, 7])
  assert table.disk_bytes() <= 4096  # nothing written: the sparse file holds no data blocks
  table.write(np.array([3, 7]), {'w': np.full((2, 2, 3), -1.0, np.float32)})
  calls.clear()
  np.testing.assert_array_equal(table.read(np.array([3, 5, 7]))['w'][:, 1, 2], [-1, 5, -1])
  assert calls == [[5]]  # only the row never written is initialised
  first = table.snapshot(step=1)
  table.write(np.array([3, 4, 7]), {'w': np.full((3, 2, 3), -2.0, np.float32)})
  assert not set(table.slot_of[[3, 4, 7]]) & set(first[[3, 7]])  # pinned slots not reused
  assert table.capacity >= 5
  # Resume from the checkpoint of round 1: its rows are intact.
  reopened = population.DiskRows(str(tmp_path / 't'), spec, 10, init_fn)
  reopened.retain([1])
  reopened.restore(first)
  np.testing.assert_array_equal(reopened.read(np.array([3, 4, 7]))['w'][:, 0, 0], [-1, 4, -1])
  # Without the checkpoint (deleted), its slots are free again.
  reopened.retain([])
  assert not reopened.pinned.any()
  with pytest.raises(ValueError, match='not the files this run wrote'):
    reopened.restore(np.full(11, -1))


def test_disk_store_needs_a_workdir(ds):
  from fedssa_jax import data  # pylint: disable=g-import-not-at-top
  c = small_config(population_store='disk')
  with pytest.raises(config_lib.ConfigError, match='workdir'):
    simulator.Simulator(c, ds, data.partition_from_config(c, ds))


def test_a_row_store_refuses_a_population_that_a_later_round_superseded():
  """A round writes a row store's tables in place: the population it was given is refused from
  then on, as a donated device population is gone, and the one it returns reads the new rows;
  a restore supersedes the tables too, and a population of arrays is no row store's."""
  g = schedule.Group('cnn5', np.array([0, 1]), None, 1, 2, None)
  store = population.HostStore(Placement(1), [g], 2, 1, None, None)
  params = {'w': np.zeros((2, 3), np.float32)}
  old = store.stacked([((params,), {'s': np.zeros(2, np.float32)})])
  new, server, stats = store.train(old, 'server', [], [], None)  # a round of no chunk
  assert (server, stats) == ('server', [])
  np.testing.assert_array_equal(store.saved(new, 0)[0][0]['w'], params['w'])
  for call in (lambda p: store.saved(p, 0), lambda p: store.seed_slice(p, 0),
               lambda p: store.evaluate(p, 0, [], [], None, None),
               lambda p: store.train(p, None, [], [], None)):
    with pytest.raises(StalePopulation, match='generation 0, superseded by generation 1'):
      call(old)
  restored = store.stacked([store.saved(new, 0)])
  with pytest.raises(StalePopulation, match='superseded by generation 2'):
    store.saved(new, 0)
  np.testing.assert_array_equal(store.seed_slice(restored, 0)[1]['s'], np.zeros(2))
  other = population.HostStore(Placement(1), [g], 2, 1, None, None)
  with pytest.raises(StalePopulation, match='another store'):
    other.saved(restored, 0)
  device = population.DeviceStore(Placement(1), [g], 2, 1, None, None)
  with pytest.raises(StalePopulation, match='device arrays'):
    store.saved(device.stacked([((params,), {})]), 0)
