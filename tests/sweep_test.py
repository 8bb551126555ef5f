"""Sweep expansion (configs/sweeps.py), the launcher's commands and job scripts, and a sweep
that is killed (the launcher, and one of its runs) and finished by rerunning the same command."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, load_file


sweep = load_file('launch/sweep.py', 'sweep_launcher')
sweeps = sweep.load_sweeps()


@pytest.mark.parametrize('name, count', [
    ('table1', 2 * 3 * 8 * 3), ('table2', 2 * 3 * 8 * 3), ('fig4', 144), ('fig8', 144),
    ('comm_compute', 2 * 8 * 3), ('fig5', 2), ('fig6_7', (5 + 6 + 2 * 5) * 2 * 3),
    ('appendix_participation', 2 * 5 * 2 * 3), ('appendix_ablation', 2 * 2 * 3 * 3),
    ('appendix_mu0', 2 * 7 * 3), ('appendix_t_stable', 2 * 7 * 3), ('small', 6),
    ('partial', 8 * 3 + 2 + 3), ('partial_homo', 8 * 3 + 2 + 3), ('tiny', 3),
    ('system', 12 * 4 * 3), ('system_devices', 8), ('privacy', 5 * 4 + 1),
    ('privacy_upload', 7 * 3), ('cross_device', 15), ('cross_device_seeds', 15 * 2),
    ('cross_device_long', 3),
    ('cross_device_system', 15),
    ('cross_device_upload', 1 + 7 * 3)])
def test_every_sweep_expands_to_unique_names_and_valid_configs(name, count):
  from fedssa_jax import config_lib
  runs = sweeps.get_sweep(name)
  assert len(runs) == count
  assert len({r.name for r in runs}) == count
  for r in runs:  # every run's config passes validation (e.g. k*N/S whole), before compute
    path, variants = r.config.split(':')
    c = config_lib.build(os.path.basename(path)[:-3], variants)
    for field, value in r.overrides:
      node = c
      *parents, leaf = field.split('.')
      for p in parents:
        node = node[p]
      node[leaf] = value
    config_lib.validate(c)


def test_shared_runs_have_the_same_names():
  table2 = {r.name for r in sweeps.get_sweep('table2')}
  assert {r.name for r in sweeps.get_sweep('comm_compute')} <= table2
  assert {r.name for r in sweeps.get_sweep('fig8')} == table2
  # The privacy sweep's runs without DP-SGD are the system sweep's ideal ones.
  ideal = {r.name for r in sweeps.get_sweep('privacy') if 'dp_' not in r.name}
  assert len(ideal) == 5 and ideal <= {r.name for r in sweeps.get_sweep('system')}


def test_unknown_sweep_lists_the_known_ones():
  with pytest.raises(ValueError, match='known sweeps: table1, table2'):
    sweeps.get_sweep('tabel2')


@pytest.mark.slow  # starts subprocesses
def test_dry_run_lists_the_small_sweep_and_skips_finished_runs(tmp_path):
  run_dir = tmp_path / 'cifar10-hetero-n10-E1-R2-fedssa-s1'
  run_dir.mkdir()
  (run_dir / 'summary.json').write_text('{}')
  env = dict(os.environ, PYTHONPATH=REPO)
  out = subprocess.run(
      [sys.executable, 'launch/sweep.py', '--sweep=small', '--dry_run', f'--sweep_dir={tmp_path}',
       '--data_dir=/data', '--num_rounds=3', '--set=eval_every=2'],
      cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
  lines = out.strip().splitlines()
  assert lines[0].startswith('Sweep small: 6 runs, 1 done, 5 to do')
  cmds = lines[1:]
  assert len(cmds) == 5
  assert not any('fedssa-s1' in c for c in cmds)
  first = cmds[0]
  assert (f'-m fedssa_jax.main --config=configs/cifar10.py:hetero,n10 '
          f'--workdir={tmp_path}/cifar10-hetero-n10-E1-R2-fedssa-s0 ') in first
  # The launcher's overrides replace the sweep's (num_rounds 2 -> 3) and add to them.
  for flag in ('--config.data_dir=/data', '--config.num_rounds=3', '--config.eval_every=2',
               '--config.method=fedssa', '--config.seed=0', '--config.local_epochs=1'):
    assert flag in first.split()
  assert not (tmp_path / 'sweep.json').exists()  # a dry run writes nothing


@pytest.mark.parametrize('mode, suffix', [('slurm', '.sbatch'), ('tpu', '.sh')])
def test_job_scripts_one_per_run(tmp_path, mode, suffix):
  runs = sweeps.get_sweep('small')
  jobs = [(r.name, sweep.run_command(r, str(tmp_path), {}, 'python'), str(tmp_path / r.name))
          for r in runs]
  paths = sweep.write_jobs(mode, jobs, str(tmp_path), ['--gres=gpu:1'], '~/repo')
  assert sorted(os.path.basename(p) for p in paths) == sorted(r.name + suffix for r in runs)
  text = open(paths[0]).read()
  assert '-m fedssa_jax.main --config=configs/cifar10.py:hetero,n10' in text
  if mode == 'slurm':
    assert '#SBATCH --gres=gpu:1' in text and 'scontrol requeue' in text
    assert f'[ -f {tmp_path}/{runs[0].name}/diverged.json ] && {{ echo' in text
  else:
    assert 'gcloud compute tpus tpu-vm ssh "$TPU_NAME"' in text and '--worker=all' in text


def test_bad_set_flag_names_the_form():
  with pytest.raises(Exception, match='field=value'):
    sweep.extra_overrides(sets=['eval_every'])


@pytest.mark.slow  # starts subprocesses
def test_local_mode_runs_jobs_in_parallel_and_reports_unfinished_ones(tmp_path, capsys):
  seen = tmp_path / 'seen'
  ok = [sys.executable, '-c', 'import os, sys; open(sys.argv[1], "w").write('
        'os.getcwd() + "\\n" + os.environ["PYTHONPATH"])', str(seen)]
  # A run that diverges writes diverged.json and exits 1: it has ended, not failed.
  diverge = ('import sys; open(sys.argv[1], "w").write(\'{"round": 2}\'); raise SystemExit(1)')
  jobs = [('ok', ok, str(tmp_path / 'ok')),
          ('preempted', [sys.executable, '-c', 'raise SystemExit(75)'], str(tmp_path / 'p')),
          ('broken', [sys.executable, '-c', 'raise SystemExit(3)'], str(tmp_path / 'b')),
          ('diverged', [sys.executable, '-c', diverge, str(tmp_path / 'd' / 'diverged.json')],
           str(tmp_path / 'd'))]
  unfinished = sweep.run_local(jobs, parallel=2)
  assert sorted(unfinished) == ['broken', 'preempted']
  out = capsys.readouterr().out
  assert 'preempted: stopped after a checkpoint (rerun the sweep to resume it)' in out
  assert f'broken: FAILED with exit status 3; see {tmp_path}/b/sweep.log' in out
  assert f'diverged: diverged in round 2 (see {tmp_path}/d/diverged.json)\n' in out
  assert sweep.RERUN_DIVERGED not in out  # said once, in the launcher's last words (tally)
  # The runs start in the repository root (config paths are relative to it) and import it.
  cwd, pythonpath = seen.read_text().splitlines()
  assert cwd == REPO and pythonpath.split(os.pathsep)[0] == REPO


@pytest.mark.slow  # starts subprocesses
def test_drop_checkpoints_deletes_those_of_finished_runs_only(tmp_path):
  """With drop, a run that wrote its summary.json loses its checkpoints/; one that stopped
  (preempted, to resume) keeps them."""
  write = ('import os, sys; os.makedirs(os.path.join(sys.argv[1], "checkpoints", "3")); '
           'open(os.path.join(sys.argv[1], "summary.json"), "w").write(sys.argv[2]); '
           'raise SystemExit(int(sys.argv[3]))')
  done, stopped = tmp_path / 'done', tmp_path / 'stopped'
  jobs = [('done', [sys.executable, '-c', write, str(done), '{"final": 1}', '0'], str(done)),
          ('stopped', [sys.executable, '-c', write, str(stopped), '{', '75'], str(stopped))]
  assert sweep.run_local(jobs, parallel=1, drop=True) == ['stopped']
  assert not (done / 'checkpoints').exists() and (done / 'summary.json').exists()
  assert (stopped / 'checkpoints' / '3').is_dir()  # its summary.json does not read whole


@pytest.mark.slow  # starts subprocesses
def test_local_mode_never_starts_a_second_copy_of_a_run(tmp_path, capsys):
  """A run whose workdir another process holds (another sweep, a user) is not started; one that
  got past that check is refused by the run itself (exit status 73), and both are reported."""
  from fedssa_jax.run import workdir_lock  # pylint: disable=g-import-not-at-top
  held, raced = tmp_path / 'held', tmp_path / 'raced'
  held.mkdir()
  marker = tmp_path / 'started'
  jobs = [('held', [sys.executable, '-c', f'open({str(marker)!r}, "w")'], str(held)),
          ('raced', [sys.executable, '-c', 'raise SystemExit(73)'], str(raced))]
  with workdir_lock.hold(str(held)):
    unfinished = sweep.run_local(jobs, parallel=1)
  assert sorted(unfinished) == ['held', 'raced'] and not marker.exists()
  out = capsys.readouterr().out
  assert (f'held: not started: another process is running it in this workdir; rerun the sweep '
          f'once that one is done (pid {os.getpid()} on host') in out
  assert 'raced: not started: another process is running it in this workdir' in out
  assert workdir_lock.in_use(str(held)) is None  # released


@pytest.mark.slow  # starts subprocesses
def test_sigterm_to_the_launcher_is_passed_on_to_its_runs(tmp_path, capsys):
  """The runs (each stops with status 75 on SIGTERM, as a run checkpoints) get the launcher's
  SIGTERM and end at once; the launcher waits for them and reports every run unfinished."""
  import threading  # pylint: disable=g-import-not-at-top
  run = ('import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(75)); '
         'open(sys.argv[1], "w").close(); time.sleep(120)')
  jobs = [(f'r{i}', [sys.executable, '-c', run, str(tmp_path / f'started{i}')],
           str(tmp_path / f'r{i}')) for i in range(3)]

  def terminate_once_both_run():
    while not all((tmp_path / f'started{i}').exists() for i in range(2)):
      time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)
  threading.Thread(target=terminate_once_both_run, daemon=True).start()
  start = time.time()
  assert sorted(sweep.run_local(jobs, parallel=2)) == ['r0', 'r1', 'r2']
  assert time.time() - start < 60  # the runs ended on the signal, not after their sleep
  assert 'Interrupted: waiting for the running runs to checkpoint.' in capsys.readouterr().out
  assert not (tmp_path / 'started2').exists()  # the queued run never started


def test_sigint_is_passed_on_where_the_launcher_started_ignoring_it(tmp_path, capsys):
  """A launcher started in the background by a shell without job control starts with SIGINT
  ignored, and `kill -INT` reaches it alone: it passes SIGINT on as it does SIGTERM, and its
  runs stop. With SIGINT handled (a terminal's Ctrl-C reaches the runs too), it passes on
  SIGTERM alone."""
  import threading  # pylint: disable=g-import-not-at-top
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    assert sweep.passed_on_signals() == [signal.SIGTERM]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    assert sweep.passed_on_signals() == [signal.SIGTERM, signal.SIGINT]
    run = ('import signal, sys, time; signal.signal(signal.SIGINT, lambda *a: sys.exit(75)); '
           'open(sys.argv[1], "w").close(); time.sleep(120)')
    jobs = [('r0', [sys.executable, '-c', run, str(tmp_path / 'started')], str(tmp_path / 'r0'))]

    def interrupt_once_it_runs():
      while not (tmp_path / 'started').exists():
        time.sleep(0.05)
      os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=interrupt_once_it_runs, daemon=True).start()
    start = time.time()
    assert sweep.run_local(jobs, parallel=1) == ['r0']
    assert time.time() - start < 60  # the run ended on the signal, not after its sleep
    assert 'Interrupted' in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # as the launcher found it
  finally:
    signal.signal(signal.SIGINT, previous)


def test_pack_seeds_packs_the_runs_that_differ_only_in_their_seed(tmp_path):
  run_dir = tmp_path / 'cifar10-hetero-n10-E1-R2-fedssa-s1'
  run_dir.mkdir()
  (run_dir / 'summary.json').write_text('{}')
  sweep_dir, runs, jobs = sweep.plan('small', str(tmp_path), {'num_rounds': 3}, 'python',
                                     pack_seeds=True)
  assert len(runs) == 6 and len(jobs) == 3  # 3 methods; fedssa's seed 1 is done
  by_name = {name: (cmd, workdir) for name, cmd, workdir in jobs}
  cmd, workdir = by_name['cifar10-hetero-n10-E1-R2-fedssa-s0']
  assert '--config.seed=0' in cmd and not any(c.startswith('--seeds') for c in cmd)
  packed = [name for name in by_name if name.endswith('-s0+1')]
  assert len(packed) == 2
  cmd, workdir = by_name[packed[0]]
  base = packed[0][:-len('-s0+1')]
  assert workdir == os.path.join(sweep_dir, base + '-s0')
  assert '--seeds=0,1' in cmd and '--config.num_rounds=3' in cmd
  assert (f'--seed_workdirs={os.path.join(sweep_dir, base + "-s0")},'
          f'{os.path.join(sweep_dir, base + "-s1")}') in cmd
  assert not any(c.startswith('--config.seed') for c in cmd)


def test_a_diverged_run_has_ended_and_is_not_started_again(tmp_path):
  """A run whose workdir holds diverged.json (whole) counts as ended: no job runs it, packed or
  not, and the tally names it with how to run it anew; one cut short is still to do."""
  runs = sweeps.get_sweep('small')  # fedssa, fedproto, standalone; seeds 0 and 1
  done, diverged, torn = runs[1], runs[2], runs[3]
  record = {'round': 2, 'train_loss': 9e4, 'message': 'Training blew up in round 2: ...'}
  for r, name, text in ((done, 'summary.json', '{}'), (diverged, 'diverged.json',
                                                         json.dumps(record)),
                        (torn, 'diverged.json', '{"round": 2, "mess')):
    (tmp_path / r.name).mkdir()
    (tmp_path / r.name / name).write_text(text)
  sweep_dir, _, jobs = sweep.plan('small', str(tmp_path), {}, 'python')
  assert [name for name, _, _ in jobs] == [r.name for r in runs if r not in (done, diverged)]
  assert sweep.has_ended(sweep_dir, diverged) and not sweep.has_ended(sweep_dir, torn)
  assert sweep.diverged_runs(sweep_dir, runs) == [(diverged.name, record)]
  _, _, packed = sweep.plan('small', str(tmp_path), {}, 'python', pack_seeds=True)
  workdirs = [w for name, cmd, workdir in packed for w in sweep.job_workdirs(cmd, workdir)]
  assert sorted(workdirs) == sorted(os.path.join(sweep_dir, r.name) for r in runs
                                    if r not in (done, diverged))
  text, status = sweep.tally(sweep_dir, runs, ['a-run'])
  assert status == 1 and text.endswith(
      f'\n1 runs diverged, not to be rerun: {diverged.name} (round 2); a rerun would diverge '
      'again (runs are deterministic); to run one anew, delete its diverged.json (having changed '
      'what made it diverge) or use a new --sweep_dir.')
  for r in runs:
    if r is not diverged:
      (tmp_path / r.name).mkdir(exist_ok=True)
      (tmp_path / r.name / 'summary.json').write_text('{}')
  text, status = sweep.tally(sweep_dir, runs, [])
  assert status == 0 and text.startswith(
      f'All 6 runs ended: 5 done, 1 diverged: {diverged.name} (round 2); a rerun would')
  # A packed job whose one seed diverged while the other finished has ended too.
  pair = [os.path.join(sweep_dir, r.name) for r in (runs[3], diverged)]
  assert sweep._diverged_outcome(1, pair).startswith(
      f'1 of its 2 packed seeds diverged ({diverged.name} in round 2), the others are done')
  assert sweep._diverged_outcome(3, pair) is None  # another failure
  assert sweep._diverged_outcome(1, pair[:1]) is None  # no diverged.json: it failed


# ----------------------------------------------------------------------------------------------
# A killed sweep
# ----------------------------------------------------------------------------------------------

TIMING_FIELDS = ('round_seconds', 'elapsed_seconds')


def rounds_written(workdir) -> int:
  try:
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      return sum(1 for _ in f)
  except FileNotFoundError:
    return 0


def metrics(workdir) -> list:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_FIELDS} for line in f]


# A sitecustomize.py for the killed sweep's processes (on their PYTHONPATH): they run as in an
# image without TensorFlow, which main imports up front (for CLU's writers and TFDS) and these
# runs, on a .npz, need only for TensorBoard events, which this test does not read: a tiny run
# took 6.5 CPU seconds against 11.4, and the sweep makes five. The rest of a run is the same
# (outputs.clu_writers: no events, every figure in metrics.jsonl).
NO_TENSORFLOW_SITECUSTOMIZE = """import sys
sys.modules['tensorflow'] = None
"""


def wait_for(condition, what, launcher):
  deadline = time.time() + 300
  while not condition():
    assert launcher.poll() is None, f'the launcher ended (status {launcher.returncode}) {what}'
    assert time.time() < deadline, f'not {what} after 300 s'
    time.sleep(0.05)


@pytest.mark.slow  # a real sweep: the launcher and its runs are subprocesses
def test_a_killed_sweep_finishes_when_rerun(tmp_path):
  """`--sweep=tiny --parallel=2`, 4 rounds, a checkpoint after each: SIGKILL to the run of seed
  0 once it has recorded 2 rounds, so that round 1's checkpoint is complete (the launcher
  reports it and starts seed 2's), then SIGKILL to the launcher once seed 1's run is done and
  seed 2's has recorded 2 rounds (seed 2's run dies with it). The same command again skips
  seed 1, resumes the others, and every run's metrics.jsonl is an uninterrupted run's: the
  sweep's `--set=seed=0` makes its three runs one computation, so seed 1's run, which nothing
  interrupted, is the reference of the other two (and no run need be made twice). The runs
  import no TensorFlow and write no TensorBoard events (NO_TENSORFLOW_SITECUSTOMIZE)."""
  from conftest import synthetic_dataset  # pylint: disable=g-import-not-at-top
  from fedssa_jax.run import workdir_lock  # pylint: disable=g-import-not-at-top
  ds = synthetic_dataset(100, 50)
  data = str(tmp_path / 'data.npz')  # plain arrays: no TFDS to prepare
  train, test = ds.tfds_splits['train'], ds.tfds_splits['test']
  np.savez(data, x_train=ds.images[train], y_train=ds.labels[train], x_test=ds.images[test],
           y_test=ds.labels[test])
  sweep_dir = str(tmp_path / 'sweep')
  flags = ['--sweep=tiny', f'--sweep_dir={sweep_dir}', '--parallel=2', f'--data_dir={data}',
           '--num_rounds=4', '--set=model.families=("cnn5",)', '--set=checkpoint_every=1',
           '--set=seed=0']
  runs = sweeps.get_sweep('tiny')
  workdirs = [os.path.join(sweep_dir, r.name) for r in runs]
  command = [sys.executable, 'launch/sweep.py', *flags]
  no_tensorflow = tmp_path / 'no_tensorflow'
  no_tensorflow.mkdir()
  (no_tensorflow / 'sitecustomize.py').write_text(NO_TENSORFLOW_SITECUSTOMIZE)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, str(no_tensorflow)]))
  with open(tmp_path / 'launcher.log', 'w') as log:
    launcher = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
  try:
    wait_for(lambda: rounds_written(workdirs[0]) >= 2, '2 rounds of seed 0', launcher)
    with open(os.path.join(workdirs[0], workdir_lock.LOCK_FILE)) as f:
      os.kill(int(f.read().split()[1]), signal.SIGKILL)  # 'pid <pid> on host ...'
    wait_for(lambda: sweep.is_done(sweep_dir, runs[1]) and rounds_written(workdirs[2]) >= 2,
             'seed 1 done and 2 rounds of seed 2', launcher)
    launcher.kill()
    assert launcher.wait() == -signal.SIGKILL
  finally:
    if launcher.poll() is None:
      launcher.kill()
  deadline = time.time() + 60
  while workdir_lock.in_use(workdirs[2]):  # seed 2's run died with the launcher
    assert time.time() < deadline, 'seed 2\'s run outlived the launcher by 60 s'
    time.sleep(0.05)
  text = (tmp_path / 'launcher.log').read_text()
  assert (f'{runs[0].name}: killed by SIGKILL (rerun the sweep to resume it from its last '
          'checkpoint)') in text, text
  assert not sweep.is_done(sweep_dir, runs[0]) and not sweep.is_done(sweep_dir, runs[2])

  rerun = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
  assert rerun.returncode == 0, rerun.stdout + rerun.stderr
  assert f'Sweep tiny: 3 runs, 1 done, 2 to do, in {sweep_dir}' in rerun.stdout
  assert 'All 3 runs done.' in rerun.stdout
  reference = metrics(workdirs[1])
  assert [r['round'] for r in reference] == [1, 2, 3, 4]
  for i in (0, 2):
    with open(os.path.join(workdirs[i], 'sweep.log')) as f:
      assert 'Resuming after round' in f.read()
    assert metrics(workdirs[i]) == reference, i
