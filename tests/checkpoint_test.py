"""Runs that survive: kill and resume, preemption, determinism, corrupt checkpoints, divergence;
every run a federation with the system section on (SYSTEM).

The end-to-end tests run the command line of `python -m fedssa_jax.main` on a tiny prepared
TFDS cifar10 written here. Most call main.run_cli in this process (a subprocess would add
seconds of imports and nothing else): the uninterrupted reference, the resumes, the two seeds,
the corrupt-checkpoint fallback and the divergence (a NaN put in by monkeypatching
simulator.Simulator.run_round). Only the runs that a real SIGKILL or SIGTERM stops are subprocesses
(a subprocess cannot see tfds.testing.mock_data, hence the prepared data). Every run has the same
flags, so all of them (subprocesses too, through the persistent XLA cache of conftest) share the
programs the first run compiles. The runs compute at their config's simulator.matmul_precision,
which replaces conftest's 'highest' here, so this process and a subprocess compute the same.
"""
import contextlib
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from fedssa_jax import main
from fedssa_jax.engine import schedule, simulator
from fedssa_jax.run import checkpoint, train

from conftest import logged_seed, write_tiny_tfds_cifar10

# Every case compiles and trains (slow: `pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 4 rounds: checkpoint_keep = 3 then drops round 1's, a signal after round 1 or 2 leaves a round
# or two to the resume, and the corrupt round-4 checkpoint falls back to round 3's.
NUM_ROUNDS = 4
TIMING_FIELDS = ('round_seconds', 'elapsed_seconds', 'wall_seconds', 'seconds_per_round_steady',
                 'first_round_seconds')
# The kill test's rounds are drawn from this seed: a fresh one each session unless it is set,
# printed at the session's end and in the test's failure messages.
KILL_SEED_VAR = 'FEDSSA_TEST_KILL_SEED'


@pytest.fixture(scope='module')
def env(tmp_path_factory):
  """What every run needs: the data and, for subprocesses, an environment with this checkout on
  the path."""
  base = tmp_path_factory.mktemp('runs')
  write_tiny_tfds_cifar10(str(base / 'tfds'))
  environ = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [ROOT] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]))
  return {'data_dir': str(base / 'tfds'), 'environ': environ}


# The system section on (fedssa_jax/system.py), every kind with a clock and a deadline that
# some uploads miss: every run here, killed and resumed or not, is a federation of dropouts,
# stragglers, lost and late uploads, whose draws and simulated seconds must resume exactly.
SYSTEM = ('--config.system.availability=0.9', '--config.system.dropout=0.2',
          '--config.system.straggler_rate=0.5', '--config.system.min_work=0.2',
          '--config.system.upload_loss=0.3', '--config.system.device_tiers=three_tiers',
          '--config.system.deadline=0.05')


def command(env, workdir, *overrides):
  # CNN-5: of the five families, the quickest round here (CNN-1's is 2-3x longer).
  return [sys.executable, '-m', 'fedssa_jax.main', f'--config={ROOT}/configs/tiny.py',
          f'--workdir={workdir}', f'--config.data_dir={env["data_dir"]}',
          '--config.model.families=("cnn5",)', f'--config.num_rounds={NUM_ROUNDS}',
          '--config.checkpoint_every=1', '--config.partition.seed=0', *SYSTEM, *overrides]


def start(env, workdir, *overrides):
  """The command in a subprocess: (its Popen, the file of its console output)."""
  os.makedirs(workdir, exist_ok=True)
  log = open(os.path.join(workdir, f'log.{time.time_ns()}.txt'), 'w')
  return subprocess.Popen(command(env, workdir, *overrides), env=env['environ'], cwd=ROOT,
                          stdout=log, stderr=subprocess.STDOUT), log.name


def cli(env, workdir, *overrides):
  """The same command in this process (main.run_cli): (its exit status, its console text)."""
  text = io.StringIO()
  with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
    status = main.run_cli(['fedssa_jax.main', *command(env, workdir, *overrides)[3:]])
  return status, text.getvalue()


def run(env, workdir, *overrides, expect=0):
  status, text = cli(env, workdir, *overrides)
  assert status == expect, f'exit status {status}, expected {expect}:\n{text[-5000:]}'
  return text


def rounds_written(workdir):
  try:
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      return sum(1 for _ in f)
  except FileNotFoundError:
    return 0


def signal_after_round(proc, workdir, r, sig):
  """Sends `sig` as soon as metrics.jsonl shows round r, while the run goes on."""
  deadline = time.time() + 300
  while rounds_written(workdir) < r:
    assert proc.poll() is None, f'the run ended (status {proc.returncode}) before round {r}'
    assert time.time() < deadline, f'no round {r} after 300 s'
    time.sleep(0.01)
  assert proc.poll() is None, f'the run had finished before the signal after round {r}'
  proc.send_signal(sig)
  return proc.wait(timeout=300)


def outputs(workdir):
  """metrics.jsonl records and summary.json, without the timing fields."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  with open(os.path.join(workdir, 'summary.json')) as f:
    summary = json.load(f)
  drop = lambda d: {k: v for k, v in d.items() if k not in TIMING_FIELDS}
  return [drop(r) for r in records], drop(summary)


@pytest.fixture(scope='module')
def uninterrupted(env, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('uninterrupted') / 'run')
  run(env, workdir)
  return workdir


def test_uninterrupted_run_writes_every_round_and_keeps_the_last_checkpoints(uninterrupted):
  records, summary = outputs(uninterrupted)
  assert [r['round'] for r in records] == list(range(1, NUM_ROUNDS + 1))
  assert summary['rounds'] == NUM_ROUNDS
  # The federation's records: the simulated seconds add up, and the kinds happened.
  assert summary['cum_sim_seconds'] == pytest.approx(sum(r['sim_seconds'] for r in records))
  assert records[-1]['cum_sim_seconds'] == summary['cum_sim_seconds'] > 0
  for kind in ('dropped', 'stragglers', 'lost_uploads', 'late_uploads'):
    assert any(r[kind] for r in records), kind
  with open(os.path.join(uninterrupted, 'config.json')) as f:
    devices = json.load(f)['derived']['client_device']
  assert len(devices) == 5 and {d[0] for d in devices} <= {1e9, 5e9, 2e10}  # three_tiers
  steps = checkpoint.Checkpointer(os.path.join(uninterrupted, 'checkpoints')).steps()
  assert steps == [NUM_ROUNDS - 2, NUM_ROUNDS - 1, NUM_ROUNDS]  # checkpoint_keep = 3


def kill_round(seed, sig):
  """The round after which `sig` is sent, drawn from `seed` (each signal its own draw)."""
  return random.Random(f'{seed}:{sig.name}').randint(1, NUM_ROUNDS - 2)


def test_kill_rounds_drawn_from_seeds_cover_every_round_a_signal_can_follow():
  for sig in (signal.SIGKILL, signal.SIGTERM):
    rounds = {kill_round(seed, sig) for seed in range(100)}
    assert rounds == set(range(1, NUM_ROUNDS - 1))  # a SIGTERM then stops by NUM_ROUNDS - 1
  assert any(kill_round(s, signal.SIGKILL) != kill_round(s, signal.SIGTERM) for s in range(10))


@pytest.mark.parametrize('sig', [signal.SIGKILL, signal.SIGTERM], ids=['SIGKILL', 'SIGTERM'])
def test_killed_run_resumes_to_the_uninterrupted_outputs(sig, env, uninterrupted, tmp_path):
  """A subprocess, stopped by a real signal after a drawn round; the same command, rerun in this
  process, resumes it."""
  workdir = str(tmp_path / 'run')
  seed = logged_seed(KILL_SEED_VAR)
  r = kill_round(seed, sig)
  drawn = f'{sig.name} after round {r}, drawn from {KILL_SEED_VAR}={seed}'
  print(drawn)  # shown with any failure, also one inside the helpers
  proc, log = start(env, workdir)
  rc = signal_after_round(proc, workdir, r, sig)
  if sig == signal.SIGKILL:
    assert rc == -signal.SIGKILL, drawn
  else:
    text = open(log).read()
    assert rc == train.EXIT_PREEMPTED, f'{drawn}: status {rc}:\n{text[-5000:]}'
    assert 'SIGTERM: stopped after round' in text, drawn
    # It finished its round and checkpointed it: nothing after the checkpoint to redo.
    steps = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints')).steps()
    assert steps[-1] == rounds_written(workdir) >= r, drawn
  # A SIGKILL may land before the first checkpoint is complete: then the rerun starts over.
  saved = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints')).steps()
  text = run(env, workdir)
  assert (f'Resuming after round {saved[-1]}' in text) if saved else ('Resuming' not in text), (
      drawn)
  assert outputs(workdir) == outputs(uninterrupted), drawn


def test_resume_falls_back_past_a_corrupt_checkpoint(env, uninterrupted, tmp_path):
  """The last checkpoint's files cut in half, and metrics.jsonl's last line torn (a kill while
  it was written): the checkpoint is named and deleted, the run resumes from the one before,
  and no round is recorded twice or torn."""
  workdir = str(tmp_path / 'run')
  shutil.copytree(uninterrupted, workdir)
  latest = os.path.join(workdir, 'checkpoints', str(NUM_ROUNDS))
  for folder, _, files in os.walk(latest):
    for name in files:
      path = os.path.join(folder, name)
      os.truncate(path, os.path.getsize(path) // 2)
  metrics = os.path.join(workdir, 'metrics.jsonl')
  with open(metrics) as f:
    lines = f.readlines()
  with open(metrics, 'w') as f:
    f.writelines(lines[:-1] + [lines[-1][:len(lines[-1]) // 2]])
  text = run(env, workdir)
  assert (f'The checkpoint of round {NUM_ROUNDS} in' in text and
          'is corrupt or truncated' in text and
          f'falling back to the previous one (round {NUM_ROUNDS - 1})' in text)
  assert f'Resuming after round {NUM_ROUNDS - 1}' in text
  # The skipped step's abandoned reads stay off the console (console.abandoned_reads_silenced).
  assert 'Event loop is closed' not in text and 'Traceback' not in text, text[-5000:]
  assert outputs(workdir) == outputs(uninterrupted)
  assert checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints')).steps() == [
      NUM_ROUNDS - 2, NUM_ROUNDS - 1, NUM_ROUNDS]  # the corrupt one deleted, then written again


def test_same_seed_gives_identical_outputs_and_another_seed_differs(env, uninterrupted,
                                                                    tmp_path):
  run(env, str(tmp_path / 'same'))
  assert outputs(str(tmp_path / 'same')) == outputs(uninterrupted)
  # partition.seed stays 0: the init, cohorts, shuffling and augmentation change.
  run(env, str(tmp_path / 'other'), '--config.seed=1')
  (other, _), (reference, _) = outputs(str(tmp_path / 'other')), outputs(uninterrupted)
  assert [r['participants'] for r in other] != [r['participants'] for r in reference]
  assert [r['train_loss'] for r in other] != [r['train_loss'] for r in reference]


def put_a_nan_after_round(monkeypatch, nan_round):
  """Patches simulator.Simulator.run_round to put NaN into the parameters of one client of the
  cohort of round `nan_round` before it trains, so that its training diverges. Prints which
  client and family."""
  run_round = simulator.Simulator.run_round

  def run_round_with_a_nan(sim, state):
    if state.round + 1 == nan_round:
      cohort = schedule.sample_cohort(sim.config.seed, state.round, sim.num_clients, sim.k)
      client = int(cohort[-1])
      g, slot = sim.group_of[client], sim.slot_of[client]
      params = list(state.population.params)
      params[g] = jax.tree.map(lambda p: p.at[0, slot].set(np.nan), params[g])
      state = state.replace(population=state.population.replace(params=tuple(params)))
      print(f'NaN in client {client} of family {sim.groups[g].family}', flush=True)
    return run_round(sim, state)

  monkeypatch.setattr(simulator.Simulator, 'run_round', run_round_with_a_nan)


def test_divergence_stops_the_run_naming_round_clients_and_family(env, tmp_path, monkeypatch):
  workdir = str(tmp_path / 'run')
  put_a_nan_after_round(monkeypatch, 2)
  rc, text = cli(env, workdir)
  assert rc != 0, text[-5000:]
  assert rc == main.EXIT_FAILED, text[-5000:]
  client, family = re.search(r'NaN in client (\d+) of family (\w+)', text).groups()
  assert 'DivergenceError: Training diverged in round 2' in text, text[-5000:]
  assert f'family {family}: clients {client} (loss and parameters)' in text
  assert 'the last good checkpoint, of round 1, is kept intact' in text
  assert 'optimizer.lr' in text
  # Nothing of round 2 was written, and round 1's checkpoint reads back whole (its digest).
  assert rounds_written(workdir) == 1
  ckpts = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'))
  assert ckpts.steps() == [1] and ckpts.restore_latest().step == 1
  # diverged.json: the round and the message; a NaN loss is no number (null).
  diverged = json.load(open(os.path.join(workdir, 'diverged.json')))
  assert diverged['round'] == 2 and diverged['train_loss'] is None
  assert diverged['message'].startswith('Training diverged in round 2')


def test_a_template_with_numpy_scalars_restores(tmp_path):
  """A seed's saved state holds numpy scalars where the server keeps 0-d arrays (an Inbox's
  weight, after the seed axis is taken off): a restore with it as the template reads them back."""
  state = {'server': {'weight': np.float32(2.5), 'rows': np.arange(6, dtype=np.float32)},
           'round': 1}
  ckpt = checkpoint.Checkpointer(str(tmp_path / 'checkpoints'))
  ckpt.save(state, {'round': 1}, {'config': {}})
  ckpt.close()
  template = {'server': {'weight': np.float32(0), 'rows': np.zeros(6, np.float32)}, 'round': 0}
  restored = checkpoint.Checkpointer(str(tmp_path / 'checkpoints')).restore_latest(template)
  assert float(restored.state['server']['weight']) == 2.5
  np.testing.assert_array_equal(np.asarray(restored.state['server']['rows']), np.arange(6))


def test_a_save_writes_the_arrays_without_copying_them(tmp_path, monkeypatch):
  """A save is synchronous, so orbax's defensive copy of each numpy array (a second copy of
  the population in host memory: at N = 1,000, 5 GB) is turned off for it, and only for it; the
  state digest reads each array in place, and is the hash of its bytes as before."""
  import copy  # pylint: disable=g-import-not-at-top
  import hashlib  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  rows = np.arange(12, dtype=np.float32).reshape(3, 4)
  copied = []
  deepcopy = copy.deepcopy
  monkeypatch.setattr(copy, 'deepcopy', lambda v, *a: copied.append(v is rows) or deepcopy(v, *a))
  state = {'params': {'rows': rows}, 'round': 1}
  ckpt = checkpoint.Checkpointer(str(tmp_path / 'checkpoints'))
  ckpt.save(state, {'round': 1}, {'config': {}})
  ckpt.close()
  assert not any(copied)
  assert ocp.type_handlers.get_type_handler(np.ndarray)._deepcopy_host_arrays  # restored
  template = {'params': {'rows': np.zeros((3, 4), np.float32)}, 'round': 0}
  restored = checkpoint.Checkpointer(str(tmp_path / 'checkpoints')).restore_latest(template)
  np.testing.assert_array_equal(np.asarray(restored.state['params']['rows']), rows)
  want = hashlib.sha256()
  for name, a in (('params/rows', rows), ('round', np.ascontiguousarray(1))):
    want.update(f'{name} {a.dtype}{a.shape}'.encode())
    want.update(a.tobytes())
  assert checkpoint.state_digest(state) == want.hexdigest()
