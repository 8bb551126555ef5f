"""Runs a named sweep of configs/sweeps.py: locally, or as one SLURM or TPU-VM job per run.

  python launch/sweep.py --sweep=small --data_dir=$HOME/tensorflow_datasets
  python launch/sweep.py --sweep=table2 --dry_run            # print the commands
  python launch/sweep.py --sweep=table2 --mode=slurm         # write jobs, print how to submit
  python -m fedssa_jax.run.report --sweep_dir=runs/sweeps/small  # tables and plots

Every run has its own workdir, `<sweep_dir>/<run name>`. A run whose summary.json exists (and
reads whole) is skipped, and so is one whose diverged.json does: it ended with a DivergenceError,
and runs are deterministic, so a rerun would diverge again (delete that file, or use a new
--sweep_dir, to run it anew). Any other run is started, and one that was interrupted resumes from
its newest checkpoint (fedssa_jax.main does that by itself), so rerunning the same command
finishes a sweep. Locally, the runs end with the launcher, however it ends: SIGTERM or SIGINT
stop them after their round, checkpointed; if the launcher is killed (SIGKILL), Linux kills its
runs too (each asks for SIGKILL when its parent dies), so that a rerun finds their workdirs free
and resumes them from their last checkpoints.
`--num_rounds`, `--local_epochs`, `--data_dir` and `--set=field=value` apply to every run; they
do not change run names (a resume may change only num_rounds and data_dir; see docs/operations.md).
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from fedssa_jax.run import workdir_lock  # pylint: disable=wrong-import-position  (no JAX)
EXIT_PREEMPTED = 75  # fedssa_jax.run.train.EXIT_PREEMPTED (not imported: this script loads no JAX)
EXIT_LOCKED = 73     # fedssa_jax.main.EXIT_LOCKED: another process runs in the workdir
EXIT_FAILED = 1      # fedssa_jax.main.EXIT_FAILED: a run that diverged exits with it
DIVERGED_FILE = 'diverged.json'  # fedssa_jax.run.outputs.DIVERGED_FILE
# What a status line of a diverged run adds.
RERUN_DIVERGED = ('a rerun would diverge again (runs are deterministic); to run one anew, delete '
                  'its diverged.json (having changed what made it diverge) or use a new '
                  '--sweep_dir')

flags.DEFINE_string('sweep', None, 'A sweep name from configs/sweeps.py.')
flags.DEFINE_string('sweep_dir', None, 'Folder of the run workdirs; default runs/sweeps/<sweep>.')
flags.DEFINE_bool('dry_run', False, 'Print the commands of the runs still to do, run nothing.')
flags.DEFINE_enum('mode', 'local', ['local', 'slurm', 'tpu'],
                  'local: run here; slurm, tpu: write one job script per run into '
                  '<sweep_dir>/jobs and print how to submit them.')
flags.DEFINE_integer('parallel', 1, 'local: runs at once, sharing the devices.')
flags.DEFINE_bool('drop_checkpoints', False, 'local: delete a run\'s checkpoints/ once it has '
                  'finished (written its summary.json). A finished run needs them only to be '
                  'extended to more rounds; at N = 1,000 each is about 10 GB.')
flags.DEFINE_bool('pack_seeds', False, 'Runs that differ only in their seed run packed, in '
                  'one process and the same compiled calls (fedssa_jax.main --seeds), each in '
                  'its own workdir. For accelerators; memory grows with the seeds packed.')
flags.DEFINE_string('data_dir', None, 'TFDS data_dir for every run.')
flags.DEFINE_integer('num_rounds', None, 'Override num_rounds of every run.')
flags.DEFINE_integer('local_epochs', None, 'Override local_epochs of every run.')
flags.DEFINE_multi_string('set', [], 'field=value: a further --config.field=value for every run.')
flags.DEFINE_string('python', None, 'Python of the runs; default this one (local) or `python` '
                    '(job scripts).')
flags.DEFINE_multi_string('slurm_option', ['--gres=gpu:1', '--time=48:00:00'],
                          'slurm: an #SBATCH option (repeatable).')
flags.DEFINE_string('tpu_repo', '~/fedssa_jax', 'tpu: the repository path on the TPU VM.')
FLAGS = flags.FLAGS


def load_sweeps():
  """configs/sweeps.py as a module (configs/ is not a package)."""
  path = os.path.join(REPO, 'configs', 'sweeps.py')
  spec = importlib.util.spec_from_file_location('fedssa_sweeps', path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up
  spec.loader.exec_module(module)
  return module


def extra_overrides(data_dir=None, num_rounds=None, local_epochs=None, sets=()) -> dict:
  """The launcher's overrides for every run, as config fields."""
  extra = {k: v for k, v in (('data_dir', data_dir), ('num_rounds', num_rounds),
                             ('local_epochs', local_epochs)) if v is not None}
  for item in sets:
    field, sep, value = item.partition('=')
    if not sep or not field:
      raise app.UsageError(f'--set={item!r} must be field=value, e.g. --set=eval_every=5.')
    extra[field.removeprefix('config.')] = value
  return extra


def run_command(run, sweep_dir: str, extra: dict, python: str) -> list[str]:
  """The fedssa_jax.main command line of one run; `extra` overrides the run's own fields."""
  fields = {**run.override_dict, **extra}
  return [python, '-m', 'fedssa_jax.main', f'--config={run.config}',
          f'--workdir={os.path.join(sweep_dir, run.name)}',
          *(f'--config.{k}={v}' for k, v in sorted(fields.items()))]


def packed_jobs(runs, sweep_dir: str, cmd_dir: str, extra: dict,
                python: str) -> list[tuple[str, list[str], str]]:
  """(name, command, workdir) jobs in which the `runs` that differ only in their seed run
  packed: one fedssa_jax.main --seeds command per such set, each seed in its own sweep workdir.
  A set of one is its plain command. The job's workdir (its log) is its first seed's."""
  sets = {}
  for r in runs:
    fields = {**r.override_dict, **extra}
    key = (r.config, tuple(sorted((k, str(v)) for k, v in fields.items() if k != 'seed')))
    sets.setdefault(key, []).append(r)
  jobs = []
  for (config, _), members in sets.items():
    first = members[0]
    if len(members) == 1:
      jobs.append((first.name, run_command(first, cmd_dir, extra, python),
                   os.path.join(sweep_dir, first.name)))
      continue
    seeds = [str(r.override_dict['seed']) for r in members]
    fields = {k: v for k, v in {**first.override_dict, **extra}.items() if k != 'seed'}
    name = first.name.rsplit('-s', 1)[0] + '-s' + '+'.join(seeds)
    cmd = [python, '-m', 'fedssa_jax.main', f'--config={config}', f'--workdir={cmd_dir}',
           f'--seeds={",".join(seeds)}',
           f'--seed_workdirs={",".join(os.path.join(cmd_dir, r.name) for r in members)}',
           *(f'--config.{k}={v}' for k, v in sorted(fields.items()))]
    jobs.append((name, cmd, os.path.join(sweep_dir, first.name)))
  return jobs


def is_done(sweep_dir: str, run) -> bool:
  """Whether the run wrote its summary.json, whole (one cut short by a kill is not done)."""
  return _read_json(os.path.join(sweep_dir, run.name, 'summary.json')) is not None


def divergence(workdir: str) -> dict | None:
  """The diverged.json of the run in `workdir` (its round, message and train loss): the run
  ended with a DivergenceError. None if it has none that reads whole."""
  record = _read_json(os.path.join(workdir, DIVERGED_FILE))
  return record if isinstance(record, dict) else None


def has_ended(sweep_dir: str, run) -> bool:
  """Whether the run is done or diverged: either way, not to be started again."""
  return is_done(sweep_dir, run) or divergence(os.path.join(sweep_dir, run.name)) is not None


def _read_json(path: str):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def diverged_runs(sweep_dir: str, runs) -> list[tuple[str, dict]]:
  """(name, diverged.json) of each run that diverged (and is not done)."""
  out = []
  for r in runs:
    record = divergence(os.path.join(sweep_dir, r.name))
    if record is not None and not is_done(sweep_dir, r):
      out.append((r.name, record))
  return out


def diverged_list(diverged: list[tuple[str, dict]]) -> str:
  """'name (round 2), ...' of diverged_runs."""
  return ', '.join(f'{name} (round {record.get("round", "?")})' for name, record in diverged)


def job_workdirs(cmd: list[str], workdir: str) -> list[str]:
  """The workdirs of a job's runs: its --seed_workdirs (packed seeds), or its own."""
  for arg in cmd:
    if arg.startswith('--seed_workdirs='):
      return arg.split('=', 1)[1].split(',')
  return [workdir]


def tally(sweep_dir: str, runs, unfinished: list[str]) -> tuple[str, int]:
  """The launcher's last words and exit status: 1 while runs remain to finish; 0 once every run
  is done or diverged (a rerun would change nothing)."""
  diverged = diverged_runs(sweep_dir, runs)
  listed = diverged_list(diverged)
  report = f'Report: python -m fedssa_jax.run.report --sweep_dir={sweep_dir}'
  if unfinished:
    text = (f'{len(unfinished)} runs did not finish: {", ".join(unfinished)}. Rerun the same '
            'command to resume them.')
    if diverged:
      text += f'\n{len(diverged)} runs diverged, not to be rerun: {listed}; {RERUN_DIVERGED}.'
    return text, 1
  if diverged:
    return (f'All {len(runs)} runs ended: {len(runs) - len(diverged)} done, {len(diverged)} '
            f'diverged: {listed}; {RERUN_DIVERGED}. {report}'), 0
  return f'All {len(runs)} runs done. {report}', 0


# ----------------------------------------------------------------------------------------------
# Local runs
# ----------------------------------------------------------------------------------------------

def _die_with_parent(parent: int):
  """preexec_fn of a run: Linux sends it SIGKILL when the launcher dies (PR_SET_PDEATHSIG), so
  that a killed launcher leaves no run behind to hold its workdir. Elsewhere, nothing."""
  def preexec():
    try:
      ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (AttributeError, OSError):
      return
    if os.getppid() != parent:  # the launcher died before prctl
      os.kill(os.getpid(), signal.SIGKILL)
  return preexec


def drop_checkpoints(workdirs: list[str]) -> None:
  """Deletes the checkpoints/ of each of `workdirs` whose run has finished (summary.json)."""
  for w in workdirs:
    if _read_json(os.path.join(w, 'summary.json')) is not None:
      shutil.rmtree(os.path.join(w, 'checkpoints'), ignore_errors=True)


def run_local(jobs: list[tuple[str, list[str], str]], parallel: int,
              drop: bool = False) -> list[str]:
  """Runs (name, command, workdir) jobs, `parallel` at a time, each logging to
  <workdir>/sweep.log. Returns the names of the runs that did not finish (one that diverged has
  ended: it is not among them). With `drop`, a finished run's checkpoints are deleted. SIGTERM to the launcher is passed on to the runs, which stop
  after their round, checkpointed; so is SIGINT where it would not reach them otherwise
  (passed_on_signals)."""
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(filter(None, [REPO, env.get('PYTHONPATH')]))
  if parallel > 1:  # share accelerator memory instead of each process taking 75%
    env.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', f'{0.9 / parallel:.2f}')
  queue, running, unfinished = list(jobs), {}, []
  total = len(jobs)

  def on_sigterm(signum, frame):
    del frame
    for proc, *_ in running.values():
      proc.send_signal(signum)
    raise KeyboardInterrupt
  try:  # the launcher's main thread (signal handlers can be set from no other)
    previous = {sig: signal.signal(sig, on_sigterm) for sig in passed_on_signals()}
  except ValueError:
    previous = {}
  try:
    while queue or running:
      while queue and len(running) < parallel:
        name, cmd, workdir = queue.pop(0)
        holder = workdir_lock.in_use(workdir) if os.path.isdir(workdir) else None
        if holder:  # another sweep (or a user) runs it; its lock would refuse a second copy
          print(f'[{total - len(queue)}/{total}] {name}: {_outcome(EXIT_LOCKED, workdir)} '
                f'({holder})', flush=True)
          unfinished.append(name)
          continue
        os.makedirs(workdir, exist_ok=True)
        log = open(os.path.join(workdir, 'sweep.log'), 'a')
        running[name] = (subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log,
                                          stderr=subprocess.STDOUT,
                                          preexec_fn=_die_with_parent(os.getpid())), log, workdir,
                         job_workdirs(cmd, workdir))
        print(f'[{total - len(queue)}/{total}] {name}: '
              f'started (log {os.path.join(workdir, "sweep.log")})', flush=True)
      time.sleep(0.5)
      for name, (proc, log, workdir, workdirs) in list(running.items()):
        rc = proc.poll()
        if rc is None:
          continue
        log.close()
        del running[name]
        diverged = _diverged_outcome(rc, workdirs)
        print(f'{name}: {diverged or _outcome(rc, workdir)}', flush=True)
        if drop:
          drop_checkpoints(workdirs)
        if rc and not diverged:
          unfinished.append(name)
  except KeyboardInterrupt:
    # The runs got the same SIGINT (or the SIGTERM passed on): each finishes its round,
    # checkpoints and exits 75.
    for sig in previous:  # a second one may not cut the waits short
      signal.signal(sig, signal.SIG_IGN)
    print('Interrupted: waiting for the running runs to checkpoint. Rerun the same command to '
          'resume.', flush=True)
    for name, (proc, log, *_) in running.items():
      proc.wait()
      log.close()
      unfinished.append(name)
    unfinished += [name for name, _, _ in queue]
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
  return unfinished


def passed_on_signals() -> list[int]:
  """The signals the launcher passes on to its runs: SIGTERM, and SIGINT where the launcher
  started with SIGINT ignored. A shell without job control starts a background command so
  (`python launch/sweep.py ... &` in a script): its SIGINT then comes from `kill -INT` to the
  launcher alone, and without this it would be ignored. From a terminal, Ctrl-C reaches the
  launcher and its runs together, and the launcher passes nothing on."""
  ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
  return [signal.SIGTERM] + ([signal.SIGINT] if ignored else [])


def _diverged_outcome(rc: int, workdirs: list[str]) -> str | None:
  """The status line of a job that ended with a DivergenceError: some of its runs wrote
  diverged.json and the others (packed seeds go on without the one that diverged) their
  summary.json. None for any other end. What to do about it (RERUN_DIVERGED) is said once, in
  the launcher's last words (tally), not on every such line."""
  if rc != EXIT_FAILED:
    return None
  records = [(w, divergence(w)) for w in workdirs]
  if not any(r for _, r in records) or not all(
      r or _read_json(os.path.join(w, 'summary.json')) is not None for w, r in records):
    return None
  if len(records) == 1:
    (w, record), = records
    return (f'diverged in round {record.get("round", "?")} (see '
            f'{os.path.join(w, DIVERGED_FILE)})')
  failed = [f'{os.path.basename(w)} in round {r.get("round", "?")}' for w, r in records if r]
  return (f'{len(failed)} of its {len(records)} packed seeds diverged ({", ".join(failed)}), '
          'the others are done')


def _outcome(rc: int, workdir: str) -> str:
  if rc == 0:
    return 'done'
  if rc == EXIT_PREEMPTED:
    return 'stopped after a checkpoint (rerun the sweep to resume it)'
  if rc == EXIT_LOCKED:
    return ('not started: another process is running it in this workdir; rerun the sweep once '
            'that one is done')
  if rc < 0:
    return (f'killed by {signal.Signals(-rc).name} (rerun the sweep to resume it from its last '
            'checkpoint)')
  return f'FAILED with exit status {rc}; see {os.path.join(workdir, "sweep.log")}'


# ----------------------------------------------------------------------------------------------
# Job scripts
# ----------------------------------------------------------------------------------------------

def slurm_script(name: str, cmd: list[str], workdir: str, options) -> str:
  """A single-host SLURM job. SIGTERM 2 minutes before the time limit (or on preemption) makes
  the run checkpoint and exit 75, and the job requeues itself to resume."""
  lines = ['#!/bin/bash', f'#SBATCH --job-name={name}',
           f'#SBATCH --output={os.path.join(workdir, "slurm-%j.out")}', '#SBATCH --requeue',
           '#SBATCH --signal=B:TERM@120', *(f'#SBATCH {o}' for o in options),
           f'cd {shlex.quote(REPO)}',
           f'[ -f {shlex.quote(os.path.join(workdir, "summary.json"))} ] && exit 0',
           f'[ -f {shlex.quote(os.path.join(workdir, DIVERGED_FILE))} ] && {{ echo "Diverged '
           f'before (its {DIVERGED_FILE}): not rerun."; exit 0; }}',
           f'export PYTHONPATH={shlex.quote(REPO)}${{PYTHONPATH:+:$PYTHONPATH}}',
           'trap \'kill -TERM "$child" 2>/dev/null\' TERM',
           f'{shlex.join(cmd)} &', 'child=$!',
           'wait "$child"; rc=$?',
           'while kill -0 "$child" 2>/dev/null; do wait "$child"; rc=$?; done',
           f'if [ "$rc" -eq {EXIT_PREEMPTED} ]; then scontrol requeue "$SLURM_JOB_ID"; fi',
           'exit "$rc"']
  return '\n'.join(lines) + '\n'


def tpu_script(name: str, cmd: list[str], remote_repo: str) -> str:
  """Runs one run on a single-host TPU VM over gcloud; the VM holds the repository and data."""
  remote = f'cd {remote_repo} && PYTHONPATH=. {shlex.join(cmd)}'
  return '\n'.join([
      '#!/bin/bash', f'# Sweep run {name} on the TPU VM $TPU_NAME in zone $TPU_ZONE.',
      'set -euo pipefail',
      ': "${TPU_NAME:?set TPU_NAME to the TPU VM}" "${TPU_ZONE:?set TPU_ZONE to its zone}"',
      'gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$TPU_ZONE" --worker=all '
      f'--command={shlex.quote(remote)}']) + '\n'


def write_jobs(mode: str, jobs, sweep_dir: str, slurm_options, remote_repo: str) -> list[str]:
  jobs_dir = os.path.join(sweep_dir, 'jobs')
  os.makedirs(jobs_dir, exist_ok=True)
  paths = []
  for name, cmd, workdir in jobs:
    if mode == 'slurm':
      os.makedirs(workdir, exist_ok=True)
      path, text = os.path.join(jobs_dir, f'{name}.sbatch'), slurm_script(name, cmd, workdir,
                                                                         slurm_options)
    else:
      path, text = os.path.join(jobs_dir, f'{name}.sh'), tpu_script(name, cmd, remote_repo)
    with open(path, 'w') as f:
      f.write(text)
    os.chmod(path, 0o755)
    paths.append(path)
  return paths


# ----------------------------------------------------------------------------------------------

def plan(sweep: str, sweep_dir: str | None, extra: dict, python: str, remote: bool = False,
         pack_seeds: bool = False):
  """(sweep_dir, all runs, [(name, command, workdir)] of the runs still to do: neither done nor
  diverged). With `remote`, commands name workdirs relative to the repository (for the copy on a
  TPU VM)."""
  sweeps = load_sweeps()
  sweep_dir = os.path.abspath(sweep_dir or os.path.join(REPO, 'runs', 'sweeps', sweep))
  try:
    runs = sweeps.get_sweep(sweep, sweep_dir)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  cmd_dir = (os.path.relpath(sweep_dir, REPO) if remote and sweep_dir.startswith(REPO + os.sep)
             else sweep_dir)
  todo = [r for r in runs if not has_ended(sweep_dir, r)]
  if pack_seeds:
    return sweep_dir, runs, packed_jobs(todo, sweep_dir, cmd_dir, extra, python)
  jobs = [(r.name, run_command(r, cmd_dir, extra, python), os.path.join(sweep_dir, r.name))
          for r in todo]
  return sweep_dir, runs, jobs


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if FLAGS.parallel < 1:
    raise app.UsageError(f'--parallel must be >= 1, got {FLAGS.parallel}.')
  if FLAGS.drop_checkpoints and FLAGS.mode != 'local':
    raise app.UsageError('--drop_checkpoints works with --mode=local only: delete the '
                         'checkpoints/ of finished runs by hand on the cluster.')
  python = FLAGS.python or (sys.executable if FLAGS.mode == 'local' else 'python')
  extra = extra_overrides(FLAGS.data_dir, FLAGS.num_rounds, FLAGS.local_epochs, FLAGS.set)
  sweep_dir, runs, jobs = plan(FLAGS.sweep, FLAGS.sweep_dir, extra, python,
                               remote=FLAGS.mode == 'tpu', pack_seeds=FLAGS.pack_seeds)
  done = sum(1 for r in runs if is_done(sweep_dir, r))
  diverged = diverged_runs(sweep_dir, runs)
  todo = len(runs) - done - len(diverged)
  packs = f' (in {len(jobs)} packed processes)' if FLAGS.pack_seeds else ''
  failed = f'{len(diverged)} diverged, ' if diverged else ''
  print(f'Sweep {FLAGS.sweep}: {len(runs)} runs, {done} done, {failed}{todo} to do{packs}, in '
        f'{sweep_dir}', flush=True)
  if diverged:
    print(f'Not rerun, as they diverged: {diverged_list(diverged)}; {RERUN_DIVERGED}.',
          flush=True)
  if FLAGS.dry_run:
    for _, cmd, _ in jobs:
      print(shlex.join(cmd))
    return 0
  os.makedirs(sweep_dir, exist_ok=True)
  with open(os.path.join(sweep_dir, 'sweep.json'), 'w') as f:
    json.dump({'sweep': FLAGS.sweep, 'extra_overrides': extra,
               'runs': [{'name': r.name, 'config': r.config, 'overrides': r.override_dict}
                        for r in runs]}, f, indent=2)
  if FLAGS.mode == 'local':
    text, status = tally(sweep_dir, runs, run_local(jobs, FLAGS.parallel,
                                                      FLAGS.drop_checkpoints))
    print(text)
    return status
  paths = write_jobs(FLAGS.mode, jobs, sweep_dir, FLAGS.slurm_option, FLAGS.tpu_repo)
  jobs_dir = os.path.join(sweep_dir, 'jobs')
  if FLAGS.mode == 'slurm':
    print(f'Wrote {len(paths)} SLURM jobs. Submit them with:\n'
          f'  for f in {jobs_dir}/*.sbatch; do sbatch "$f"; done')
  else:
    print(f'Wrote {len(paths)} TPU-VM jobs. With the repository and data on the VM at '
          f'{FLAGS.tpu_repo}, run them one after another with:\n'
          f'  export TPU_NAME=... TPU_ZONE=...; for f in {jobs_dir}/*.sh; do bash "$f"; done\n'
          f'then copy the run folders back (gcloud compute tpus tpu-vm scp --recurse) for the '
          'report.')
  return 0


if __name__ == '__main__':
  flags.mark_flag_as_required('sweep')
  app.run(lambda argv: sys.exit(main(argv)))
