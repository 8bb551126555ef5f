"""End to end: `python -m fedssa_jax.main` flags, TFDS loading (mock data), the output files."""
import glob
import json
import logging
import os
import signal
import sys
import threading

import numpy as np
import pytest
import tensorflow_datasets as tfds
from absl import flags

from ml_collections import config_flags

from fedssa_jax.run import console, train

from conftest import REPO as ROOT, load_file


def load_config_module(name):
  return load_file(f'configs/{name}.py', f'config_{name}')


def test_config_file_variants_and_overrides(monkeypatch):
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, 'config', flag_values=fv, lock_config=True)
  argv = ['main', f'--config={ROOT}/configs/cifar100.py:homo,n100', '--config.num_rounds=7',
          '--config.model.families=("cnn5",)', '--config.fedssa.fusion=reference']
  monkeypatch.setattr('sys.argv', argv)  # config_flags reads the overrides from sys.argv
  fv(argv)
  c = fv.config
  assert (c.dataset, c.num_clients, c.participation) == ('cifar100', 100, 0.1)
  assert (c.local_epochs, c.fedssa.t_stable, c.partition.classes_per_client) == (10, 45, 10)
  assert (c.num_rounds, tuple(c.model.families), c.fedssa.fusion) == (7, ('cnn5',), 'reference')


@pytest.mark.slow  # a whole run, compiled
def test_end_to_end_on_tfds_mock_data_writes_documented_outputs(tmp_path, monkeypatch):
  dataset = 'cifar100'
  workdir = str(tmp_path / 'run')
  c = load_config_module('tiny').get_config(dataset)
  c.model.families = ('cnn5',)
  c.num_clients, c.participation, c.num_rounds = 10, 0.5, 2
  c.batch_size, c.target_accuracy = 32, 0.01
  c.engine.matmul_precision = 'highest'
  # A library call changes nothing process-wide: signal handlers, hooks and logging stay the
  # caller's (the command lines install theirs, console.py).
  process_wide = lambda: (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT),
                          sys.unraisablehook, logging.getLogger().handlers[:],
                          logging.getLogger('asyncio').filters[:],
                          logging.getLogger('absl').filters[:])
  before = process_wide()
  seen = []
  real_rounds = train._run_rounds

  def run_rounds(*args, **kwargs):
    seen.append(process_wide())
    return real_rounds(*args, **kwargs)
  monkeypatch.setattr(train, '_run_rounds', run_rounds)
  # 1,000 mock images: with fewer, some of the 100 classes have no training sample for their
  # holder, which the pathological partition refuses (data_test).
  with tfds.testing.mock_data(num_examples=1000):
    train.train_and_evaluate(c, workdir)
  assert seen == [before] and process_wide() == before

  config = json.load(open(os.path.join(workdir, 'config.json')))
  assert config['config']['dataset'] == dataset and config['config']['num_clients'] == 10
  assert config['derived']['cohort_size'] == 5 and config['derived']['num_classes'] == 100
  records = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]
  assert [r['round'] for r in records] == [1, 2]
  for r in records:
    assert set(r) == set(train.METRICS_FIELDS)
    assert len(r['client_accuracy']) == 10 and len(r['participants']) == 5
    assert r['mean_accuracy'] == pytest.approx(np.mean(r['client_accuracy']))
    assert 0 <= r['participant_accuracy_reference'] <= 1
  assert records[1]['cum_up_floats'] == records[0]['up_floats'] + records[1]['up_floats']
  summary = json.load(open(os.path.join(workdir, 'summary.json')))
  assert set(summary) == set(train.SUMMARY_FIELDS)
  assert summary['final_mean_accuracy'] == records[-1]['mean_accuracy']
  # The costs to target are the totals of the first round whose accuracy reaches it (1%).
  first = next(r for r in records if r['mean_accuracy'] >= c.target_accuracy)
  assert summary['to_target']['round'] == first['round']
  assert summary['to_target']['cum_floats'] == first['cum_floats']
  assert glob.glob(os.path.join(workdir, 'events.out.tfevents.*'))


def test_missing_data_dir_names_the_fix(tmp_path):
  from fedssa_jax import data
  with pytest.raises(data.DataError, match='prepare_offline.py'):
    data.load_dataset('cifar10', str(tmp_path / 'nothing'))


def test_bad_config_values_are_rejected_before_compute():
  from fedssa_jax import config_lib
  for field, value, needle in [('participation', 0.0, 'participation'),
                               ('batch_size', 0, 'batch_size'),
                               ('target_accuracy', 1.5, 'target_accuracy'),
                               ('method', 'fedavg', 'method'),
                               ('fedssa.mu0', 1.5, 'mu0'),
                               ('model.families', ('cnn9',), 'cnn9'),
                               ('engine.matmul_precision', 'fp64', 'matmul_precision')]:
    c = config_lib.build('cifar10', 'tiny')
    c.update_from_flattened_dict({field: value})
    with pytest.raises(config_lib.ConfigError, match=needle):
      config_lib.validate(c)


@pytest.fixture
def python_sigint():
  """Python's own SIGINT handler for the test, as an interactive start has it: a job that a
  shell starts in the background inherits SIGINT ignored, and a second SIGINT would then be
  ignored, as it would be without the block."""
  before = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, before)


def test_stop_requests_ask_once_then_act_as_without(python_sigint):
  """console.StopRequests: the first signal only asks (signal_name), the second acts as it
  would without the block (SIGINT: KeyboardInterrupt); the handlers come back after it, and
  outside the main thread nothing is installed."""
  previous = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  with console.StopRequests() as stop:
    assert stop.signal_name is None
    signal.raise_signal(signal.SIGTERM)
    assert stop.signal_name == 'SIGTERM'
  assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == previous
  with pytest.raises(KeyboardInterrupt):
    with console.StopRequests() as stop:
      signal.raise_signal(signal.SIGINT)
      assert stop.signal_name == 'SIGINT'
      signal.raise_signal(signal.SIGINT)
  assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == previous
  installed = []

  def in_a_thread():
    with console.StopRequests() as s:
      installed.append((s._previous, signal.getsignal(signal.SIGINT)))
  t = threading.Thread(target=in_a_thread)
  t.start()
  t.join()
  assert installed == [({}, previous[0])]
  assert console.NO_STOP.signal_name is None
