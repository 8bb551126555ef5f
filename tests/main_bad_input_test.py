"""The command line on bad input: every case exits with its status and one clear paragraph, no
traceback. docs/operations.md's troubleshooting section lists these cases and their messages.

Cases call main.run_cli in this process (a subprocess per case would cost seconds of imports);
the console it sets up writes to the stderr that capsys captures. The lock test starts one real
subprocess.
"""
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Callable

import numpy as np
import orbax.checkpoint as ocp
import pytest

from fedssa_jax import config_lib, main
from fedssa_jax.run import outputs, workdir_lock

from conftest import write_tiny_tfds_cifar10
from validation_test import save_checkpoints

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every case's command line starts so; the runs that get to train share these programs (CNN-5:
# of the five families, the quickest round here).
BASE_OVERRIDES = ('--config.model.families=("cnn5",)', '--config.partition.seed=0',
                  '--config.checkpoint_every=1')
# The first line of the message of each kind of error.
PREFIXES = ('Command line error: ', 'ConfigError: ', 'DataError: ', 'CheckpointError: ',
            'WorkdirLocked: ', 'DivergenceError: ', 'CheckpointWriteError: ', 'Interrupted',
            'WARNING: SIGTERM: stopped')


@pytest.fixture(scope='module')
def tfds_dir(tmp_path_factory):
  """A tiny prepared TFDS cifar10 in array_record files, as a download writes."""
  d = str(tmp_path_factory.mktemp('tfds'))
  write_tiny_tfds_cifar10(d, file_format='array_record')
  return d


@dataclasses.dataclass
class Ctx:
  tmp_path: object
  data_dir: str
  monkeypatch: object

  @property
  def workdir(self):
    return str(self.tmp_path / 'run')


def base_argv(ctx: Ctx):
  return ['main', f'--config={ROOT}/configs/tiny.py', f'--workdir={ctx.workdir}',
          f'--config.data_dir={ctx.data_dir}', *BASE_OVERRIDES]


def cli_config(ctx: Ctx, **overrides):
  """The config that base_argv gives, with `overrides`."""
  c = config_lib.build('cifar10', 'hetero,tiny')
  c.update_from_flattened_dict({'model.families': ('cnn5',), 'partition.seed': 0,
                                'checkpoint_every': 1, 'data_dir': ctx.data_dir, **overrides})
  return c


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  args: tuple                 # appended to base_argv (a callable: of ctx)
  status: int
  needles: tuple              # each must be in the message
  prepare: Callable = None    # (ctx) -> None, before the command
  argv: Callable = None       # (ctx) -> the whole argv, instead of base_argv + args


def flag(field, value):
  return Case(f'{field}={value}', (f'--config.{field}={value}',), main.EXIT_BAD_INPUT, ())


def bad(field, value, *needles):
  return dataclasses.replace(flag(field, value), needles=needles)


# -- data files -----------------------------------------------------------------------------------

def tfds_copy(ctx, damage):
  """A copy of the tiny TFDS cifar10 with `damage(version_dir)` done to it, as data_dir."""
  copy = str(ctx.tmp_path / 'tfds')
  shutil.copytree(ctx.data_dir, copy)
  (version_dir,) = [os.path.join(r, '') for r, _, fs in os.walk(copy) if 'dataset_info.json' in fs]
  damage(version_dir)
  ctx.data_dir = copy


def split_file(version_dir, split):
  (name,) = [f for f in os.listdir(version_dir) if f.startswith(f'cifar10-{split}.')]
  return os.path.join(version_dir, name)


def edit_json(path, edit):
  with open(path) as f:
    d = json.load(f)
  edit(d)
  with open(path, 'w') as f:
    json.dump(d, f)


def damaged(how):
  def truncate(v):
    p = split_file(v, 'train')
    os.truncate(p, os.path.getsize(p) // 2)

  def garble(v):
    p = split_file(v, 'train')
    size = os.path.getsize(p)
    with open(p, 'wb') as f:
      f.write(np.random.default_rng(0).bytes(size))

  return {
      'truncated': truncate,
      'missing': lambda v: os.remove(split_file(v, 'train')),
      'garbled': garble,
      'no test split': lambda v: edit_json(
          os.path.join(v, 'dataset_info.json'),
          lambda d: d.update(splits=[s for s in d['splits'] if s['name'] != 'test'])),
      'corrupt metadata': lambda v: open(os.path.join(v, 'dataset_info.json'), 'w').write('{"na'),
  }[how]


def unlabelled(ctx):
  """A TFDS cifar10 whose features have no label (the builder's code defines them)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from tensorflow_datasets.image_classification import cifar  # pylint: disable=g-import-not-at-top
  ctx.monkeypatch.setattr(cifar.Cifar10, '_info', lambda self: tfds.core.DatasetInfo(
      builder=self, features=tfds.features.FeaturesDict(
          {'id': tfds.features.Text(), 'image': tfds.features.Image(shape=(32, 32, 3))})))


def data_case(how, *needles):
  return Case(f'data: {how}', (), main.EXIT_BAD_INPUT, needles,
              prepare=lambda ctx: tfds_copy(ctx, damaged(how)))


def npz(ctx, arrays):
  path = str(ctx.tmp_path / 'data.npz')
  if arrays is not None:
    np.savez(path, **arrays)
  ctx.data_dir = path


# -- checkpoints, workdirs, runs --------------------------------------------------------------------

def checkpoint_of(round_, **overrides):
  def prepare(ctx):
    ctx.tmp_path.joinpath('run').mkdir(exist_ok=True)
    save_checkpoints(ctx.tmp_path, [round_], cli_config(ctx, **overrides)).close()
  return prepare


def all_checkpoints_damaged(ctx):
  save_checkpoints(ctx.tmp_path, [1], cli_config(ctx)).close()
  for d, _, fs in os.walk(ctx.tmp_path / 'run' / 'checkpoints' / '1'):
    for f in fs:
      os.truncate(os.path.join(d, f), 0)


def workdir_in_a_file(ctx):
  ctx.tmp_path.joinpath('a_file').write_text('')
  return [*base_argv(ctx)[:2], f'--workdir={ctx.tmp_path}/a_file/run', *base_argv(ctx)[3:]]


def locked(ctx):
  os.makedirs(ctx.workdir)
  lock = workdir_lock.hold(ctx.workdir)
  lock.__enter__()
  ctx.release = lambda: lock.__exit__(None, None, None)


def after_round(n, action):
  """Calls `action()` once round `n` has logged its line."""
  def prepare(ctx):
    log_round = outputs.log_round

    def patched(config, rounds_done, *args):
      log_round(config, rounds_done, *args)
      if rounds_done == n:
        action()
    ctx.monkeypatch.setattr(outputs, 'log_round', patched)
  return prepare


def disk_full_at(step):
  def prepare(ctx):
    save = ocp.CheckpointManager.save

    def patched(self, s, *args, **kwargs):
      if s == step:
        raise OSError(28, 'No space left on device')
      return save(self, s, *args, **kwargs)
    ctx.monkeypatch.setattr(ocp.CheckpointManager, 'save', patched)
  return prepare


def twice_sigint():
  signal.raise_signal(signal.SIGINT)
  signal.raise_signal(signal.SIGINT)


def with_sigint_handled(prepare):
  """`prepare`, with SIGINT raising KeyboardInterrupt as in a shell's foreground, also when the
  tests run in the background (`nohup pytest &`), where SIGINT comes ignored."""
  def both(ctx):
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    ctx.release = lambda: signal.signal(signal.SIGINT, previous)
    prepare(ctx)
  return both


CASES = [
    # Config fields: each named, with its range or fix.
    bad('optimizer.lr', -1.0, 'optimizer.lr must be > 0, got -1.0'),
    bad('optimizer.lr', 0.0, 'optimizer.lr must be > 0, got 0.0'),
    bad('optimizer.lr', 'nan', 'optimizer.lr is nan; it must be a finite number',
        '--config.optimizer.lr', 'default is 0.005'),
    bad('optimizer.lr', 'inf', 'optimizer.lr is inf; it must be a finite number'),
    bad('optimizer.momentum', 1.0, 'optimizer.momentum must be in [0, 1), got 1.0'),
    bad('optimizer.momentum', 'nan', 'optimizer.momentum is nan'),
    bad('optimizer.clip_norm', -1.0, 'optimizer.clip_norm must be > 0, or 0 to turn clipping off'),
    bad('optimizer.weight_decay', -0.1, 'optimizer.weight_decay must be >= 0, got -0.1'),
    bad('optimizer.adam_b2', 1.0, 'optimizer.adam_b2 must be in [0, 1), got 1.0'),
    bad('optimizer.name', 'adamw', "Unknown optimizer.name 'adamw'; choose one of"),
    bad('seed', -1, 'seed must be in [0, 2**63), got -1'),
    bad('partition.seed', -2, 'partition.seed must be in [0, 2**63), or -1 to use `seed`'),
    bad('num_clients', 0, 'num_clients must be >= 1, got 0'),
    bad('num_clients', 1_000_000_000, 'num_clients=1000000000 is more than the 50,000 training',
        'every client needs at least one training sample'),
    bad('num_clients', 7, 'k*N/S holders per class', 'Set num_clients to a multiple of 5'),
    bad('eval_clients', 7, 'eval_clients=7 is more than the num_clients=5 clients',
        'or to 0 to evaluate all'),
    bad('num_rounds', 0, 'num_rounds must be >= 1, got 0'),
    bad('local_epochs', 0, 'local_epochs must be >= 1, got 0'),
    bad('participation', 0.0, 'participation must be in (0, 1], got 0.0'),
    bad('batch_size', 0, 'batch_size must be > 0, got 0'),
    bad('engine.micro_batch', 5, 'engine.micro_batch=5 must divide batch_size=16'),
    bad('method', 'fedavg', "Unknown method 'fedavg'"),
    bad('dataset', 'no_such_data', "Unknown dataset 'no_such_data'", 'tfds.list_builders()'),
    bad('dataset', 'oxford_flowers102', 'have no fixed size', '--config.image_size=32'),
    bad('image_size', 8, 'image_size=8 is too small', '--config.image_size=32'),
    bad('num_clients', 50, "samples of all its 2 classes", "in the 'train' pool for its 10 holders",
        '--config.partition.kind=dirichlet'),
    bad('target_accuracy', 80.0, 'target_accuracy must be in (0, 1], got 80.0', '0.8 is 80%'),
    bad('guard.loss_growth', 0.5, 'guard.loss_growth=0.5 would stop a run', 'set it above 1'),
    bad('guard.max_train_loss', -1.0, 'guard.max_train_loss must be >= 0 (0 turns that test off)'),
    bad('fd.lam', 'inf', 'fd.lam is inf; it must be a finite number', '--config.fd.lam'),
    bad('fedssa.mu0', 1.5, 'fedssa.mu0 must be in [0, 1], got 1.5'),
    bad('model.families', '("cnn9",)', "Unknown model family 'cnn9'"),
    # The command line itself.
    Case('misspelled field', ('--config.num_client=5',), main.EXIT_BAD_INPUT,
         ('Command line error: No such config field', 'Did you mean "num_clients"')),
    Case('misspelled flag', ('--workdirr=x',), main.EXIT_BAD_INPUT,
         ('Command line error:', 'workdirr', '--help lists the flags')),
    Case('value of the wrong type', ('--config.num_clients=five',), main.EXIT_BAD_INPUT,
         ('Command line error:', 'five')),
    Case('stray argument', ('run_it',), main.EXIT_BAD_INPUT,
         ("unexpected arguments ['run_it']", 'every setting is a flag')),
    Case('no --workdir', (), main.EXIT_BAD_INPUT, ('Command line error:', '--workdir'),
         argv=lambda ctx: ['main', f'--config={ROOT}/configs/tiny.py']),
    Case('no --config', (), main.EXIT_BAD_INPUT, ('Command line error:', '--config'),
         argv=lambda ctx: ['main', f'--workdir={ctx.workdir}']),
    Case('config file missing', (), main.EXIT_BAD_INPUT, ('Command line error:', 'nope.py'),
         argv=lambda ctx: ['main', f'--config={ROOT}/configs/nope.py',
                           f'--workdir={ctx.workdir}']),
    Case('unknown variant', (), main.EXIT_BAD_INPUT,
         ('Command line error:', "Unknown config variant 'hetro'", 'known: hetero'),
         argv=lambda ctx: ['main', f'--config={ROOT}/configs/cifar10.py:hetro',
                           f'--workdir={ctx.workdir}']),
    Case('contradictory distributed flags', ('--distributed=off', '--num_processes=2'),
         main.EXIT_BAD_INPUT, ('ConfigError: ', '--distributed=off, but --num_processes')),
    # Workdirs.
    Case('workdir inside a file', (), main.EXIT_BAD_INPUT,
         ('ConfigError: ', 'is not a writable folder', 'Choose a folder you can write to'),
         argv=workdir_in_a_file),
    Case('workdir in use', (), main.EXIT_LOCKED,
         ('WorkdirLocked: ', 'is in use by another run', f'pid {os.getpid()} on host '
          f'{socket.gethostname()}', 'or use another --workdir'), prepare=locked),
    # Data files.
    Case('data_dir without the data set', (), main.EXIT_BAD_INPUT,
         ("cannot be read from data_dir=", 'no prepared copy there, and --config.download=False',
          'launch/prepare_offline.py --source'),
         prepare=lambda ctx: setattr(ctx, 'data_dir', str(ctx.tmp_path / 'empty'))),
    data_case('truncated', 'cifar10-train.array_record', 'missing, truncated or corrupt',
              'prepare it again', 'launch/prepare_offline.py --source'),
    data_case('missing', "Its 'train' files: none", 'missing, truncated or corrupt',
              'prepare it again'),
    data_case('garbled', 'cifar10-train.array_record', 'missing, truncated or corrupt'),
    data_case('no test split', "it has no 'test' split (its splits: train)", 'prepare it again'),
    Case('data: no labels', (), main.EXIT_BAD_INPUT,
         ('has no label feature', 'needs labelled images'), prepare=unlabelled),
    data_case('corrupt metadata', 'The TFDS metadata of', 'cannot be read', 'prepare it again'),
    Case('npz missing', (), main.EXIT_BAD_INPUT, ('data.npz does not exist', '--npz'),
         prepare=lambda ctx: npz(ctx, None)),
    Case('npz without labels', (), main.EXIT_BAD_INPUT,
         ("lacks the arrays ['y_test', 'y_train']",),
         prepare=lambda ctx: npz(ctx, {'x_train': np.zeros((2, 32, 32, 3), np.uint8),
                                       'x_test': np.zeros((2, 32, 32, 3), np.uint8)})),
    # Checkpoints.
    Case('resume with another config', ('--config.seed=3',), main.EXIT_BAD_INPUT,
         ('Cannot resume the run in', 'seed: checkpoint 0, now 3', 'or use a new --workdir'),
         prepare=checkpoint_of(2)),
    Case('resume past num_rounds', (), main.EXIT_BAD_INPUT,
         ('is of round 5, past num_rounds=3', 'Set --config.num_rounds to at least 5'),
         prepare=checkpoint_of(5)),
    Case('no readable checkpoint', (), main.EXIT_BAD_INPUT,
         ('CheckpointError: No checkpoint in', 'delete that folder to start the run over'),
         prepare=all_checkpoints_damaged),
    # Runs stopped by signals, a full disk, or a blow-up.
    Case('SIGTERM', (), main.EXIT_PREEMPTED,
         ('SIGTERM: stopped after round 2 of 3', 'Rerun the same command to resume'),
         prepare=after_round(1, lambda: signal.raise_signal(signal.SIGTERM))),
    Case('SIGINT twice', (), main.EXIT_INTERRUPTED,
         ('Interrupted at once', 'resume from the last checkpoint'),
         prepare=with_sigint_handled(after_round(1, twice_sigint))),
    Case('disk full', (), main.EXIT_FAILED,
         ('Could not write the checkpoint of round 2', 'No space left on device',
          'The checkpoint of round 1 is intact', 'rerun of the same command resumes from it'),
         prepare=disk_full_at(2)),
    Case('blow-up', ('--config.optimizer.lr=1000.0',), main.EXIT_FAILED,
         ('DivergenceError: Training ', 'in round 1', 'smaller optimizer.lr')),
]


# The cases that compile and train rounds before their error (slow: `pytest -m "not slow"`
# leaves them out).
TRAINING_CASES = ('SIGTERM', 'SIGINT twice', 'disk full', 'blow-up')


def test_there_are_forty_cases_or_more():
  assert len(CASES) >= 40 and len({c.name for c in CASES}) == len(CASES)
  assert set(TRAINING_CASES) <= {c.name for c in CASES}


@pytest.mark.parametrize('case', [
    pytest.param(c, id=c.name, marks=pytest.mark.slow if c.name in TRAINING_CASES else ())
    for c in CASES])
def test_bad_input_exits_with_one_clear_message(case, tmp_path, tfds_dir, monkeypatch, capsys):
  ctx = Ctx(tmp_path, tfds_dir, monkeypatch)
  if case.prepare:
    case.prepare(ctx)
  argv = case.argv(ctx) if case.argv else [*base_argv(ctx), *case.args]
  try:
    status = main.run_cli(argv)
  finally:
    getattr(ctx, 'release', lambda: None)()
  out, err = capsys.readouterr()
  text = out + err
  assert status == case.status, text
  assert 'Traceback' not in text, text
  messages = [l for l in text.splitlines() if l.startswith(PREFIXES)]
  assert len(messages) == 1, text
  for needle in case.needles:
    assert needle in messages[0], text


def test_verbose_shows_the_traceback(tmp_path, tfds_dir, monkeypatch, capsys):
  ctx = Ctx(tmp_path, tfds_dir, monkeypatch)
  assert main.run_cli([*base_argv(ctx), '--config.seed=-1', '--verbose']) == 2
  _, err = capsys.readouterr()
  assert 'Traceback' in err and 'ConfigError: seed must be in' in err
  monkeypatch.setenv('FEDSSA_VERBOSE', '1')
  assert main.run_cli([*base_argv(ctx), '--config.seed=-1']) == 2
  assert 'Traceback' in capsys.readouterr().err


@pytest.mark.slow  # a subprocess, and runs compiled
def test_a_second_process_on_a_locked_workdir_exits_at_once(tmp_path, tfds_dir):
  """A run finishes; while this process holds its workdir, the same command in a second
  process is refused at once, and leaves metrics.jsonl as it was."""
  workdir = str(tmp_path / 'run')
  argv = ['main', f'--config={ROOT}/configs/tiny.py', f'--workdir={workdir}',
          f'--config.data_dir={tfds_dir}', *BASE_OVERRIDES, '--config.num_rounds=2']
  assert main.run_cli(argv) == 0
  metrics = open(os.path.join(workdir, 'metrics.jsonl')).read()
  assert [json.loads(l)['round'] for l in metrics.splitlines()] == [1, 2]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]))
  with workdir_lock.hold(workdir):
    t0 = time.time()
    p = subprocess.run([sys.executable, '-m', 'fedssa_jax.main', *argv[1:],
                        '--config.num_rounds=4'], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    elapsed = time.time() - t0
  assert p.returncode == main.EXIT_LOCKED, p.stderr
  assert f'WorkdirLocked: --workdir={workdir!r} is in use by another run (pid {os.getpid()}' in (
      p.stderr)
  assert 'Traceback' not in p.stderr and len(p.stderr.strip().splitlines()) <= 2, p.stderr
  assert elapsed < 60  # refused before any data loads or compiles
  assert open(os.path.join(workdir, 'metrics.jsonl')).read() == metrics
  # Released: the same command now extends the run.
  assert main.run_cli([*argv, '--config.num_rounds=3']) == 0


@pytest.mark.slow  # a subprocess
def test_a_lock_left_by_a_dead_process_does_not_block(tmp_path):
  workdir = str(tmp_path)
  code = ('import os, sys; from fedssa_jax.run import workdir_lock; '
          'workdir_lock.hold(sys.argv[1]).__enter__(); os._exit(0)')  # dies holding it
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]))
  subprocess.run([sys.executable, '-c', code, workdir], env=env, check=True, timeout=60)
  assert 'pid' in open(os.path.join(workdir, workdir_lock.LOCK_FILE)).read()  # its file stays
  with workdir_lock.hold(workdir):
    with pytest.raises(workdir_lock.WorkdirLocked, match=f'pid {os.getpid()} on host'):
      with workdir_lock.hold(workdir):  # a second open file description conflicts too
        pass
