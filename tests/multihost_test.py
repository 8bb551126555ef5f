"""Two processes joined by jax.distributed (on localhost, CPU devices, gloo collectives) run
FedSSA as one process does: the `clients` mesh spans both processes' devices, the metrics match
(cohorts and float counts exactly, accuracies and losses within float tolerance), only process 0
writes the outputs, and a run the two processes stop after its checkpoint resumes to the same
metrics. Each process is a subprocess running tests/multihost_run.py."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from fedssa_jax import config_lib, distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROCESSES, DEVICES_PER_PROCESS, ROUNDS = 2, 2, 3
EXACT = ('round', 'participants', 'up_floats', 'down_floats', 'client_flops', 'cum_up_floats',
         'cum_down_floats', 'cum_floats', 'cum_client_flops')
CLOSE = ('mean_accuracy', 'client_accuracy', 'participant_accuracy_reference', 'train_loss',
         'train_accuracy')


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def launch(workdir, rounds, processes, devices):
  """Runs multihost_run.py as `processes` processes of `devices` CPU devices each; returns
  each one's RESULT, by process index."""
  port = free_port()
  procs = []
  for i in range(processes):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu',
               XLA_FLAGS=f'--xla_force_host_platform_device_count={devices}')
    for var in distributed.ENV.values():
      env.pop(var, None)
    if processes > 1:
      env.update(FEDSSA_COORDINATOR_ADDRESS=f'localhost:{port}',
                 FEDSSA_NUM_PROCESSES=str(processes), FEDSSA_PROCESS_ID=str(i))
    procs.append(subprocess.Popen(
        [sys.executable, os.path.join(ROOT, 'tests', 'multihost_run.py'), str(workdir),
         str(rounds)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  results = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=300)
      assert p.returncode == 0, err[-3000:]
      results.append(json.loads([l for l in out.splitlines() if l.startswith('RESULT ')][-1][7:]))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return results


def records(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(l) for l in f]


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  one = tmp_path_factory.mktemp('one_process')
  two = tmp_path_factory.mktemp('two_processes')
  alone = launch(one, ROUNDS, 1, 1)
  # Two processes stop after round ROUNDS - 1 (checkpointed), then resume for the last round.
  stopped = launch(two, ROUNDS - 1, PROCESSES, DEVICES_PER_PROCESS)
  stopped_records = records(two)
  resumed = launch(two, ROUNDS, PROCESSES, DEVICES_PER_PROCESS)
  return {'one': (one, alone), 'two': (two, resumed), 'stopped': (stopped_records, stopped)}


def test_two_processes_span_one_mesh(runs):
  _, results = runs['two']
  assert [r['process_index'] for r in results] == list(range(PROCESSES))
  for r in results:
    assert r['process_count'] == PROCESSES and r['local_devices'] == DEVICES_PER_PROCESS
    assert r['devices'] == r['mesh_devices'] == PROCESSES * DEVICES_PER_PROCESS
    assert r['sharding'] == ["P('clients',)"] * 2
  assert runs['one'][1][0]['mesh_devices'] == 1


def test_two_processes_give_the_metrics_of_one(runs):
  one, two = records(runs['one'][0]), records(runs['two'][0])
  assert [r['round'] for r in one] == [r['round'] for r in two] == list(range(1, ROUNDS + 1))
  for a, b in zip(one, two):
    for key in EXACT:
      assert a[key] == b[key], (a['round'], key)
    for key in CLOSE:
      np.testing.assert_allclose(b[key], a[key], rtol=1e-3, atol=1e-6,
                                 err_msg=f'round {a["round"]}: {key}')
  # The first ROUNDS - 1 rounds were written by the run that stopped, the last after resuming.
  assert [r['round'] for r in runs['stopped'][0]] == list(range(1, ROUNDS))
  for a, b in zip(runs['stopped'][0], two):
    assert a == b


def test_representations_match(runs):
  one = np.load(os.path.join(runs['one'][0], 'representations.npz'))
  two = np.load(os.path.join(runs['two'][0], 'representations.npz'))
  np.testing.assert_array_equal(one['client'], two['client'])
  np.testing.assert_array_equal(one['labels'], two['labels'])
  np.testing.assert_allclose(two['representations'].astype(np.float32),
                             one['representations'].astype(np.float32), rtol=1e-2, atol=1e-2)


def test_only_process_zero_writes_the_outputs(runs):
  outputs = {'config.json', 'metrics.jsonl', 'summary.json', 'representations.npz'}
  for _, results in (runs['two'], runs['stopped']):
    assert outputs - {'representations.npz'} <= set(results[0]['written'])
    assert not set(results[1]['written']) & outputs, results[1]['written']
  assert 'representations.npz' in runs['two'][1][0]['written']
  assert sorted(os.listdir(os.path.join(runs['two'][0], 'checkpoints'))) == ['1', '2', '3']


@pytest.mark.parametrize('kwargs, needle', [
    (dict(mode='off', coordinator_address='localhost:1'), '--distributed=auto'),
    (dict(coordinator_address='localhost:1', num_processes=2), '--process_id missing'),
    (dict(coordinator_address='localhost:1', num_processes=2, process_id=2), 'from 0 to 1'),
    (dict(num_processes=0), 'use 1 or more'),
    (dict(mode='sometimes'), 'auto, on, off'),
])
def test_bad_settings_name_the_fix(kwargs, needle):
  with pytest.raises(config_lib.ConfigError, match=needle):
    distributed.settings(**kwargs, environ={})


def test_settings_fall_back_to_the_environment():
  env = {'FEDSSA_COORDINATOR_ADDRESS': 'host0:1234', 'FEDSSA_NUM_PROCESSES': '4',
         'FEDSSA_PROCESS_ID': '3', 'FEDSSA_LOCAL_DEVICE_IDS': '0,1'}
  s = distributed.settings(environ=env)
  assert (s.coordinator_address, s.num_processes, s.process_id, s.local_device_ids) == (
      'host0:1234', 4, 3, (0, 1))
  assert distributed.wanted(s, env)
  assert distributed.settings(process_id=1, environ=env).process_id == 1  # the flag wins
  assert not distributed.wanted(distributed.settings(environ={}), {})
  assert distributed.wanted(distributed.settings(environ={}), {'SLURM_NTASKS': '8'})
  assert not distributed.wanted(distributed.settings('off', environ={}), {'SLURM_NTASKS': '8'})
