"""Two processes joined by jax.distributed (on localhost, CPU devices, gloo collectives) run
FedSSA as one process does: the `clients` mesh spans both processes' devices, the metrics match
(cohorts and float counts exactly, accuracies and losses within float tolerance), only process 0
writes the outputs, SIGTERM to one of them stops both after the same round, from whose
checkpoint they resume to the same metrics, and SIGKILL to one of them in the middle of a round
stops the other within seconds, naming it, with nothing taken from the unfinished round.

One two-process run of ROUNDS = 2 rounds of one model family (cnn5) makes every check: SIGTERM
stops it after round 1 (that part without TensorBoard events: no TensorFlow to import), a
resume loses process 1 to SIGKILL as round 2 starts (also without events), and the next
resume does round 2 (process 0 with its TensorBoard events, process 1 without CLU's writer,
which would only log there). Each of its processes is a subprocess running
tests/multihost_run.py. The one-process reference is the same run (multihost_run.run)
made in this process, which has one CPU device, while the stopped run's processes run (where
this process has other devices, that script started alone with one CPU device instead)."""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import pytest

from fedssa_jax import config_lib
from fedssa_jax.engine import distributed
from fedssa_jax.run import checkpoint, train

import multihost_run
from conftest import cpu_devices_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROCESSES, DEVICES_PER_PROCESS, ROUNDS = 2, 2, 2
FAMILIES = 1  # multihost_run.run_config's model families (cnn5)
# The processes' --heartbeat_timeout: a survivor must stop well within it (a failed collective
# shows the loss at once), and never wait much longer.
HEARTBEAT_TIMEOUT = 30
EXACT = ('round', 'participants', 'up_floats', 'down_floats', 'client_flops', 'cum_up_floats',
         'cum_down_floats', 'cum_floats', 'cum_client_flops')
CLOSE = ('mean_accuracy', 'client_accuracy', 'participant_accuracy_reference', 'train_loss',
         'train_accuracy')


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def start(workdir, rounds, processes, devices, signal_round=None, events=1, kill_round=None):
  """Starts multihost_run.py as `processes` processes of `devices` CPU devices each (with
  `signal_round`, the last one sends itself SIGTERM in that round; with `kill_round`, SIGKILL as
  that round starts; processes from `events` on leave out CLU's metric writers and TensorFlow:
  by default process 0 alone runs them, the only one that writes TensorBoard events (CLU's writer
  of the others only logs, and TensorFlow's import is 6 CPU seconds a process); `events=0`:
  none does); `finish` waits for them.
  They share the session's compilation cache (conftest), so a resumed run loads what its first
  part compiled (process 1 too: multihost_run has it write its programs, as process 0 does)."""
  port = free_port()
  procs = []
  try:
    for i in range(processes):
      env = cpu_devices_env(devices)
      for var in (*distributed.ENV.values(), multihost_run.NO_EVENTS, multihost_run.KILL_ROUND):
        env.pop(var, None)
      if i >= events:
        env[multihost_run.NO_EVENTS] = '1'
      if kill_round:
        env[multihost_run.KILL_ROUND] = str(kill_round)
      env[distributed.HEARTBEAT_ENV] = str(HEARTBEAT_TIMEOUT)
      if processes > 1:
        env.update(FEDSSA_COORDINATOR_ADDRESS=f'localhost:{port}',
                   FEDSSA_NUM_PROCESSES=str(processes), FEDSSA_PROCESS_ID=str(i))
      args = [str(workdir), str(rounds)] + ([str(signal_round)] if signal_round else [])
      # Output to files, not pipes: nobody reads them until `finish`, and a process blocked on
      # a full pipe would stall the other in their collectives.
      out, err = tempfile.TemporaryFile('w+'), tempfile.TemporaryFile('w+')
      procs.append((subprocess.Popen(
          [sys.executable, os.path.join(ROOT, 'tests', 'multihost_run.py'), *args], env=env,
          stdout=out, stderr=err, text=True), out, err))
  except BaseException:
    kill(procs)
    raise
  return procs


def kill(procs):
  for p, out, err in procs:
    if p.poll() is None:
      p.kill()
      p.wait()
    out.close()
    err.close()


def finish(procs):
  """Each started process's exit status and RESULT, by process index."""
  results = []
  try:
    for p, out, err in procs:
      p.wait(timeout=300)
      out.seek(0)
      err.seek(0)
      lines = [l for l in out.read().splitlines() if l.startswith('RESULT ')]
      assert lines, f'exit status {p.returncode}: {err.read()[-3000:]}'
      results.append((p.returncode, json.loads(lines[-1][len('RESULT '):])))
  finally:
    kill(procs)
  return results


def launch(*args, **kwargs):
  """start, then finish."""
  return finish(start(*args, **kwargs))


def lose_the_last_process(*args, **kwargs):
  """start(..., kill_round=r): [(exit status, stderr)] by process index, and the seconds the
  first survivor took to exit after the last process died."""
  procs = start(*args, **kwargs)
  try:
    victim = procs[-1][0]
    victim.wait(timeout=300)
    died = time.monotonic()
    for p, _, _ in procs[:-1]:
      p.wait(timeout=4 * HEARTBEAT_TIMEOUT)
    took = time.monotonic() - died
    results = []
    for p, _, err in procs:
      err.seek(0)
      results.append((p.returncode, err.read()))
  finally:
    kill(procs)
  return results, took


def records(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(l) for l in f]


def alone(workdir):
  """The one-process reference run, as launch's results. In this process if it has a single
  CPU device: its compiled programs differ from those of the script started alone with one
  device only in their source locations, and its records in the compared fields are the same.
  Else the script started alone with one CPU device."""
  if jax.default_backend() == 'cpu' and jax.device_count() == 1 and jax.process_count() == 1:
    result = multihost_run.run(workdir, ROUNDS)
    return [(train.EXIT_PREEMPTED if result['preempted'] else 0, result)]
  return launch(workdir, ROUNDS, 1, 1)


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  one = tmp_path_factory.mktemp('one_process')
  two = tmp_path_factory.mktemp('two_processes')
  # SIGTERM to the second process only, in round 1: both stop after it, then resume (round 2).
  # The reference runs meanwhile, in this process: it keeps a core busy while the two processes
  # are not both busy (starting, waiting for each other). The stopped part leaves out CLU's
  # writers (TensorFlow's import, in each process); the resumed part, whose outputs the tests
  # check, runs them in process 0, the one that writes events.
  stopping = start(two, ROUNDS, PROCESSES, DEVICES_PER_PROCESS, signal_round=1, events=0)
  try:
    reference = alone(one)
  except BaseException:
    kill(stopping)
    raise
  stopped = finish(stopping)
  stopped_records = records(two)
  # Process 1 lost as round 2 starts: process 0 stops; nothing of round 2 is kept.
  lost = lose_the_last_process(two, ROUNDS, PROCESSES, DEVICES_PER_PROCESS, events=0,
                               kill_round=ROUNDS)
  lost_steps = checkpoint.Checkpointer(os.path.join(two, 'checkpoints')).steps()
  lost_records = records(two)
  resumed = launch(two, ROUNDS, PROCESSES, DEVICES_PER_PROCESS)
  return {'one': (one, reference), 'two': (two, resumed), 'stopped': (stopped_records, stopped),
          'lost': (*lost, lost_steps, lost_records)}


@pytest.mark.slow  # the runs are subprocesses
def test_two_processes_span_one_mesh(runs):
  _, results = runs['two']
  assert [r['process_index'] for _, r in results] == list(range(PROCESSES))
  for status, r in results:
    assert status == 0 and not r['preempted']
    assert r['process_count'] == PROCESSES and r['local_devices'] == DEVICES_PER_PROCESS
    assert r['devices'] == r['mesh_devices'] == PROCESSES * DEVICES_PER_PROCESS
    assert r['sharding'] == ["P(None, 'clients')"] * FAMILIES  # the seed axis, then clients
  assert runs['one'][1][0][1]['mesh_devices'] == 1


@pytest.mark.slow  # the runs are subprocesses
def test_a_signal_to_one_process_stops_all_after_the_same_round(runs):
  stopped_records, results = runs['stopped']
  for status, r in results:
    assert status == train.EXIT_PREEMPTED and r['preempted']
  assert [r['round'] for r in stopped_records] == [1]


@pytest.mark.slow  # the runs are subprocesses
def test_a_process_lost_mid_round_stops_the_other_naming_it(runs):
  """SIGKILL to process 1 as round 2 starts: process 0 exits with status 69 within seconds (far
  under the heartbeat timeout: its collective failed), naming process 1 and how to resume; the
  round's checkpoint is not taken as complete, and the next run resumes from round 1's (its
  metrics: test_two_processes_give_the_metrics_of_one)."""
  (survivor, victim), took, steps, records_after = runs['lost']
  assert victim[0] == -signal.SIGKILL
  status, stderr = survivor
  assert status == distributed.EXIT_LOST_PROCESS, stderr[-3000:]
  assert took < HEARTBEAT_TIMEOUT, took
  assert ('LostProcess: process 1 of the 2 of this run stopped answering (this process\'s '
          'collective failed') in stderr, stderr[-3000:]
  assert 'Process 0 cannot go on without it and stops (exit status 69). Rerun the same ' in stderr
  assert steps == [1]
  assert [r['round'] for r in records_after] == [1]


@pytest.mark.slow  # the runs are subprocesses
def test_two_processes_give_the_metrics_of_one(runs):
  one, two = records(runs['one'][0]), records(runs['two'][0])
  assert [r['round'] for r in one] == [r['round'] for r in two] == list(range(1, ROUNDS + 1))
  for a, b in zip(one, two):
    for key in EXACT:
      assert a[key] == b[key], (a['round'], key)
    for key in CLOSE:
      np.testing.assert_allclose(b[key], a[key], rtol=1e-3, atol=1e-6,
                                 err_msg=f'round {a["round"]}: {key}')
  # Round 1 was written before the stop, the later ones after resuming.
  assert runs['stopped'][0][0] == two[0]


@pytest.mark.slow  # the runs are subprocesses
def test_representations_match(runs):
  one = np.load(os.path.join(runs['one'][0], 'representations.npz'))
  two = np.load(os.path.join(runs['two'][0], 'representations.npz'))
  np.testing.assert_array_equal(one['client'], two['client'])
  np.testing.assert_array_equal(one['labels'], two['labels'])
  np.testing.assert_allclose(two['representations'].astype(np.float32),
                             one['representations'].astype(np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.slow  # the runs are subprocesses
def test_only_process_zero_writes_the_outputs(runs):
  outputs = {'config.json', 'metrics.jsonl', 'summary.json', 'representations.npz'}
  files = lambda r: {f.removesuffix('.tmp') for f in r['written']}  # metrics.jsonl's rewrite
  (_, first), (_, second) = runs['two'][1]
  assert files(first) == outputs and not second['written']
  (_, first), (_, second) = runs['stopped'][1]  # no summary: the run stopped
  assert files(first) == {'config.json', 'metrics.jsonl'} and not second['written']
  assert sorted(os.listdir(os.path.join(runs['two'][0], 'checkpoints')), key=int) == [
      str(r) for r in range(1, ROUNDS + 1)]


def test_watchdog_names_a_process_gone_silent_and_not_one_that_ended(monkeypatch):
  """The watchdog's rules on a stand-in for the coordination service (three processes, this one
  process 0): process 2 stops beating while process 1 beats on, then ends (`done`). Silent for
  `timeout`, process 2 is lost whatever this process does; after this process's run fails, one
  silent for 5 beats is. An ended process never is. (The two-process runs above show the real
  service.)"""
  store, lost = {}, []

  class Service:
    def key_value_set(self, key, value, allow_overwrite=False):
      store[key] = value

    def key_value_try_get(self, key):
      return store[key]

  monkeypatch.setattr(distributed, '_coordination_client', Service)
  monkeypatch.setattr(distributed.jax, 'process_count', lambda: 3)
  monkeypatch.setattr(distributed.jax, 'process_index', lambda: 0)

  def run(timeout, peers_beat, fail=None):
    store.clear()
    lost.clear()
    dog = distributed.Watchdog(timeout, 'Restart.', (KeyError,), interval=0.05)
    dog._lost = lambda processes, why: lost.append((processes, why)) or dog._stop.set()
    with contextlib.suppress(ValueError, KeyError), dog:
      for beat in range(peers_beat):
        store['fedssa/alive/1'] = str(beat)
        if beat < 10:
          store['fedssa/alive/2'] = str(beat)
        time.sleep(0.05)
      store['fedssa/alive/1'] = 'done'
      if fail:
        raise fail
    return lost, store['fedssa/alive/0']

  # Process 2 stops after 10 beats; 1 s later (timeout) the thread names it.
  found, mark = run(timeout=1, peers_beat=45)
  assert found[0] == ([2], 'no sign of life from it for 1 s') and mark == 'done'
  # This process's run fails before the timeout: process 2, silent 5 beats, is named.
  found, mark = run(timeout=60, peers_beat=12, fail=ValueError('Gloo AllGather failed'))
  assert found[0][0] == [2] and mark == 'failed'
  assert found[0][1] == "this process's collective failed: ValueError: Gloo AllGather failed"
  # An expected error (a user's) names nobody; nor does a normal end with an ended process 1.
  assert run(timeout=60, peers_beat=12, fail=KeyError('x'))[0] == []
  assert run(timeout=60, peers_beat=12)[0] == []


@pytest.mark.parametrize('kwargs, needle', [
    (dict(mode='off', coordinator_address='localhost:1'), '--distributed=auto'),
    (dict(coordinator_address='localhost:1', num_processes=2), '--process_id missing'),
    (dict(coordinator_address='localhost:1', num_processes=2, process_id=2), 'from 0 to 1'),
    (dict(num_processes=0), 'use 1 or more'),
    (dict(mode='sometimes'), 'auto, on, off'),
    (dict(heartbeat_timeout=0), 'at least 1, not 0; the default is 60'),
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
  assert distributed.settings(environ={}).heartbeat_timeout == distributed.HEARTBEAT_TIMEOUT
  assert distributed.settings(environ={distributed.HEARTBEAT_ENV: '15'}).heartbeat_timeout == 15
  with pytest.raises(config_lib.ConfigError, match="not 'soon'"):
    distributed.settings(environ={distributed.HEARTBEAT_ENV: 'soon'})


def test_main_refuses_contradictory_flags_before_running(tmp_path):
  from absl import flags  # pylint: disable=g-import-not-at-top
  from fedssa_jax import main  # pylint: disable=g-import-not-at-top
  fv = flags.FlagValues()
  main.define_flags(fv)
  fv(['main', f'--config={ROOT}/configs/tiny.py', f'--workdir={tmp_path}', '--distributed=off',
      '--num_processes=2', '--process_id=1'])
  with pytest.raises(config_lib.ConfigError, match='--distributed=off, but --num_processes'):
    main.run(fv)
  assert not os.listdir(tmp_path)  # refused before anything was written
