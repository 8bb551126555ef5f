"""The population stores: device, host and disk give the same metrics (counts exactly, values to
float rounding: their training programs differ in where the rows come from); the disk store's rows,
lazy initial values, copy-on-write checkpoints and resume; damaged disk state found before a
resume, and the fallback past it; evaluation of a fixed subset."""
import glob
import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib
from fedssa_jax.engine import population, schedule, simulator
from fedssa_jax.engine.placement import Placement
from fedssa_jax.engine.rows import DamagedRows, DiskRows
from fedssa_jax.engine.state import StalePopulation
from fedssa_jax.run import checkpoint, train

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


# ----------------------------------------------------------------------------------------------
# Damaged disk state: found before a resume, named, and fallen back past
# ----------------------------------------------------------------------------------------------

def disk_config():
  """small_config on the disk store, a checkpoint after each of its 3 rounds, all kept."""
  return small_config(population_store='disk', checkpoint_every=1, checkpoint_keep=3)


@pytest.fixture(scope='module')
def disk_run(ds, tmp_path_factory):
  """An uninterrupted run of disk_config: its workdir."""
  workdir = str(tmp_path_factory.mktemp('disk_uninterrupted'))
  train.train_and_evaluate(disk_config(), workdir, dataset=ds)
  return workdir


def damaged_copy(disk_run, tmp_path):
  """A copy of the finished run, to damage: (workdir, its CNN-5 table's folder). Rerun, it
  resumes after its last round, or trains again the rounds after the checkpoint it falls back
  to."""
  workdir = str(tmp_path / 'run')
  shutil.copytree(disk_run, workdir)
  return workdir, os.path.join(workdir, 'population', 'cnn5')


def resume(ds, workdir, caplog):
  """Resumes the run in `workdir`; the text of its warnings and info lines."""
  caplog.clear()
  with caplog.at_level(logging.INFO):
    train.train_and_evaluate(disk_config(), workdir, dataset=ds)
  return '\n'.join(r.getMessage() for r in caplog.records)


def largest_leaf(table):
  """The table's slot file of the largest rows (CNN-5's fc1 kernel), and its row size."""
  path = max(glob.glob(os.path.join(table, 'leaf*.bin')), key=os.path.getsize)
  with open(os.path.join(table, 'layout.json')) as f:
    shape, dtype = json.load(f)['leaves'][int(os.path.basename(path)[4:-4])]
  return path, int(np.prod(shape)) * np.dtype(dtype).itemsize


@pytest.mark.slow  # whole runs, compiled
def test_disk_store_falls_back_past_overwritten_rows(ds, disk_run, tmp_path, caplog):
  """Bytes flipped in a row that only round 3's checkpoint holds: its checksum names the file,
  the run resumes from round 2's checkpoint, and ends with the uninterrupted numbers."""
  workdir, table = damaged_copy(disk_run, tmp_path)
  with np.load(os.path.join(table, 'pins', '3.npz')) as z3, \
       np.load(os.path.join(table, 'pins', '2.npz')) as z2:
    new = np.flatnonzero((z3['slot_of'] >= 0) & (z3['slot_of'] != z2['slot_of']))
    row, slot = int(new[0]), int(z3['slot_of'][new[0]])
  path, row_bytes = largest_leaf(table)
  with open(path, 'r+b') as f:
    f.seek(slot * row_bytes + row_bytes // 2)
    byte = f.read(1)[0]
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte ^ 0x10]))
  text = resume(ds, workdir, caplog)
  assert (f'The checkpoint of round 3 in {workdir}/checkpoints cannot be resumed: the files it '
          f'refers to are damaged (DamagedRows: {path} does not hold what the checkpoint saved '
          f'in rows [{row}]') in text, text
  assert 'falling back to the previous one (round 2)' in text
  assert 'Resuming after round 2' in text
  assert records(workdir) == records(disk_run)


@pytest.mark.slow  # whole runs, compiled
def test_disk_store_falls_back_past_a_missing_pins_map(ds, disk_run, tmp_path, caplog):
  workdir, table = damaged_copy(disk_run, tmp_path)
  os.remove(os.path.join(table, 'pins', '3.npz'))
  text = resume(ds, workdir, caplog)
  assert (f'The checkpoint of round 3 in {workdir}/checkpoints cannot be resumed: the files it '
          f'refers to are damaged (DamagedRows: No pins map in {table}/pins is this '
          'checkpoint\'s (its <round>.npz is missing, unreadable or altered)') in text, text
  assert 'Resuming after round 2' in text
  assert records(workdir) == records(disk_run)


@pytest.mark.slow  # compiles the simulator's setup, trains nothing
def test_disk_store_cut_short_stops_naming_the_file_and_the_fix(ds, disk_run, tmp_path, caplog):
  """A slot file cut to a row and a half: every checkpoint refers to rows it lost, so the run
  stops before training, naming the file, and says what to do; the files are left as found."""
  workdir, table = damaged_copy(disk_run, tmp_path)
  path, row_bytes = largest_leaf(table)
  os.truncate(path, row_bytes * 3 // 2)
  caplog.clear()
  with pytest.raises(checkpoint.CheckpointError) as e, caplog.at_level(logging.WARNING):
    train.train_and_evaluate(disk_config(), workdir, dataset=ds)
  message = str(e.value)
  assert message.startswith(f'No checkpoint in {workdir}/checkpoints can be resumed (rounds '
                            '[1, 2, 3]): The client rows those checkpoints refer to are lost from '
                            f'{table}: put back a copy'), message
  assert 'start the run over (delete checkpoints/ and population/' in message
  text = '\n'.join(r.getMessage() for r in caplog.records)
  for step in (3, 2, 1):
    assert (f'The checkpoint of round {step} in {workdir}/checkpoints cannot be resumed' in text)
  assert f'{path} holds 1 row, but the checkpoint refers to slot' in text
  assert os.path.getsize(path) == row_bytes * 3 // 2  # nothing was written over it
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['1', '2', '3']


def test_disk_rows_find_damage_before_a_resume(tmp_path, caplog):
  """Each kind of damage, made for real on a table's files, raises DamagedRows naming the file
  from `restore`, before any row is read; opening the table changes no file."""
  spec = {'a': jax.ShapeDtypeStruct((2, 3), jnp.float32), 'b': jax.ShapeDtypeStruct((), jnp.int32)}

  def init_fn(rows):
    return {'a': np.zeros((len(rows), 2, 3), np.float32), 'b': np.asarray(rows, np.int32)}

  folder = str(tmp_path / 'table')
  table = DiskRows(folder, spec, 6, init_fn)
  table.write(np.array([0, 2]), {'a': np.ones((2, 2, 3), np.float32), 'b': np.array([5, 6])})
  first = table.snapshot(1)
  table.retain([1])
  table.write(np.array([2, 3]), {'a': np.full((2, 2, 3), 2, np.float32), 'b': np.array([7, 8])})
  second = table.snapshot(2)
  table.retain([1, 2])
  a_file, a_bytes = os.path.join(folder, 'leaf0.bin'), 24
  row, slot = 3, int(second[3])  # a row only the second checkpoint holds

  def damaged(make, steps=(1, 2)):
    """Damage made on a copy: what opening and restoring each checkpoint of `steps` raise."""
    shutil.rmtree(str(tmp_path / 'copy'), ignore_errors=True)
    copy = shutil.copytree(folder, str(tmp_path / 'copy'))
    make(copy)
    files = {f: open(os.path.join(copy, f), 'rb').read() for f in os.listdir(copy)
             if f.endswith('.bin') or f == 'layout.json'}
    out = []
    for step in steps:
      opened = DiskRows(copy, spec, 6, init_fn)
      try:
        opened.restore({1: first, 2: second}[step])
        out.append(None)
      except DamagedRows as e:
        out.append(str(e).replace(copy, '<copy>'))
    assert files == {f: open(os.path.join(copy, f), 'rb').read() for f in files}
    return out

  def flip(copy):
    with open(os.path.join(copy, 'leaf0.bin'), 'r+b') as f:
      f.seek(slot * a_bytes + 5)
      f.write(b'\xff')
  assert damaged(flip) == [None, f'<copy>/leaf0.bin does not hold what the checkpoint saved in '
                                 f'rows [{row}] (slots [{slot}]): their checksums differ '
                                 '(overwritten or cut short).']
  cut = lambda copy: os.truncate(os.path.join(copy, 'leaf0.bin'), a_bytes * 2 + 7)
  assert damaged(cut)[0] is None  # its rows are in the two slots left
  assert damaged(cut)[1] == ('<copy>/leaf0.bin holds 2 rows, but the checkpoint refers to slot '
                          f'{int(second.max())}: cut short.')
  caplog.clear()
  appended = lambda copy: open(os.path.join(copy, 'leaf0.bin'), 'ab').write(b'xyz')
  with caplog.at_level(logging.WARNING):
    assert damaged(appended) == [None, None]  # the rows are intact: a warning names the file
  assert (f'leaf0.bin holds {os.path.getsize(a_file) + 3} bytes, not a whole number of rows of '
          '24 bytes (cut or appended to); the rows the checkpoint refers to are intact'
          ) in caplog.text

  def unreadable(copy):
    with open(os.path.join(copy, 'pins', '2.npz'), 'r+b') as f:
      f.seek(os.path.getsize(f.name) // 3)  # in the slot map: the zip's CRC catches it
      f.write(b'\x01')
  assert damaged(unreadable) == [None, (
      "No pins map in <copy>/pins is this checkpoint's (its <round>.npz is missing, unreadable "
      "or altered): <copy>/pins/2.npz is unreadable (BadZipFile: Bad CRC-32 for file "
      "'slot_of.npy').")]
  missing = lambda copy: os.remove(os.path.join(copy, 'pins', '2.npz'))
  assert damaged(missing) == [None, "No pins map in <copy>/pins is this checkpoint's (its "
                                    '<round>.npz is missing, unreadable or altered).']
  gone = lambda copy: os.remove(os.path.join(copy, 'leaf1.bin'))
  assert damaged(gone, [2]) == ['<copy>/leaf1.bin is missing.']
  other = lambda copy: open(os.path.join(copy, 'layout.json'), 'w').write('{"num_rows": 7}')
  assert damaged(other, [2])[0].startswith(
      "<copy>/layout.json describes other rows than this run's ({'num_rows': 7}, expected")
  # Intact, the table reads back both checkpoints' rows.
  for m, values in ((first, [1, 0, 1, 0]), (second, [1, 0, 2, 2])):
    opened = DiskRows(folder, spec, 6, init_fn)
    opened.restore(m)
    np.testing.assert_array_equal(opened.read(np.arange(4))['a'][:, 0, 0], values)


@pytest.mark.slow  # a whole run, compiled, and its resume
def test_cross_device_path_at_reduced_size(ds, tmp_path, monkeypatch):
  """The xdevice path, reduced: more clients (600) than the data set's training images (the
  resampling partition), K = 3, the disk store, a fixed evaluated subset, availability draws of
  N rows, central client-level DP on the uploads; stopped after round 2 and resumed for round 3.
  The store keeps only the trained clients' rows, the checkpoint N-long slot maps, and a
  record at most CLIENT_LIST_MAX accuracies (here 3 quantiles of the 5 evaluated)."""
  from fedssa_jax.run import outputs  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(outputs, 'CLIENT_LIST_MAX', 3)
  config = small_config(
      num_clients=600, participation=0.005, population_store='disk', eval_clients=5,
      **{'partition.kind': 'resample', 'partition.resample_train': 40,
         'partition.resample_test': 20, 'system.availability': 0.5,
         'privacy.upload': True, 'privacy.upload_mode': 'central',
         'privacy.upload_clip': 0.1, 'fedssa.scope': 'participants'})
  config.num_rounds, config.checkpoint_every, config.checkpoint_keep = 2, 1, 2
  config_lib.validate(config)
  train.train_and_evaluate(config, str(tmp_path), dataset=ds)
  config.num_rounds = 3
  train.train_and_evaluate(config, str(tmp_path), dataset=ds)  # resumes after round 2
  got = records(str(tmp_path))
  assert [r['round'] for r in got] == [1, 2, 3]
  trained = set()
  for r in got:
    assert r['evaluated_clients'] == 5 and len(r['client_accuracy']) == 3
    assert r['client_accuracy'] == sorted(r['client_accuracy'])
    assert len(r['participants']) <= 3 and r['dp_upload_epsilon'] > 0
    assert r['online'] < 600  # about half of the 600 online
    trained |= set(r['participants'])
  table = tmp_path / 'population' / 'cnn5'
  rows = sum(os.path.getsize(p) for p in glob.glob(str(table / 'leaf*.bin')))
  used = sum(os.stat(p).st_blocks * 512 for p in glob.glob(str(table / 'leaf*.bin')))
  assert 0 < used < rows / 10  # sparse: the few trained clients' slots (of 257 or more)
  restored = checkpoint.Checkpointer(str(tmp_path / 'checkpoints')).restore_latest()
  assert restored.step == 3 and restored.state['params'][0]['slot_of'].shape == (600,)
  assert (restored.state['params'][0]['slot_of'] >= 0).sum() == len(trained)


def _table_copies(hlo: str, shapes: set) -> list:
  """The ops of compiled `hlo` that copy an array of one of `shapes` (as 'f32[1,5,...]')."""
  return [line.strip()[:120] for line in hlo.splitlines()
          if ' copy(' in line and line.split('=')[1].split('{')[0].strip() in shapes]


@pytest.mark.parametrize('method,overrides', [
    ('fedtgp', {'fedtgp.proto_timing': 'pre_train'}),  # a forward pass before training
    ('fedtgp', {}),                                    # and after it
    ('fedssa', {})])
def test_a_chunk_call_updates_the_group_table_in_place(small_ds, monkeypatch, method, overrides):
  """The device store's chunk call reads the chunk's rows of the group's table (donated) and
  scatters the trained ones back in place: no copy of the table, whatever the method reads of
  the rows before training. (A copy costs the table's size each call: at N = 1,000 FedTGP's
  pre-training pass once cost 0.8 s a client for two copies of 2 GB.)"""
  from conftest import make_small_sim  # pylint: disable=g-import-not-at-top
  # 50 clients, 2 a round: with 5, XLA made no copy even without the fix.
  sim = make_small_sim(small_ds, method, num_clients=50, participation=0.04, **overrides)
  seen = []
  train = population.DeviceStore.train

  def spy(store, pop, server, chunks, calls, inputs):
    params, client_state = store._arrays(pop)
    c, call = chunks[0], calls[chunks[0].group]
    rows, state, *_ = jax.eval_shape(call.train, params[c.group], client_state, server,
                                     population._chunk_inputs(inputs, c))
    hlo = [f.lower(*args, population._chunk_inputs(inputs, c)).compile().as_text()
           for f, args in ((call.train, (params[c.group], client_state, server)),
                           (call.write, (params[c.group], client_state, rows, state)))]
    shapes = {f'f32[{",".join(map(str, a.shape))}]' for a in jax.tree.leaves(params[c.group])
              if a.size > 1000}
    seen.append((shapes, _table_copies('\n'.join(hlo), shapes)))
    return train(store, pop, server, chunks, calls, inputs)

  monkeypatch.setattr(population.DeviceStore, 'train', spy)
  sim.run_round(sim.init_state())
  assert seen and seen[0][0], seen
  assert not seen[0][1], seen[0][1]
