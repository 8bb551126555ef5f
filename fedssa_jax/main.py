"""Runs one federated experiment. Intentionally kept short: flags, console and exit status.

  python -m fedssa_jax.main --config=configs/cifar10.py:hetero,n10 --workdir=runs/demo \
      --config.num_rounds=20 --config.local_epochs=1

Rerunning a command with the same --workdir resumes the run from its newest checkpoint; while a
run is going, its workdir is locked (fedssa_jax/run/workdir_lock.py). SIGTERM or SIGINT stop a run
after the current round and its checkpoint, with exit status 75 (train.EXIT_PREEMPTED): the
handlers are this command's (console.StopRequests), installed around the training call only.

A user's error (a config, data, workdir or checkpoint that cannot work, a diverged run) prints as
one paragraph that says what to do, without a traceback; --verbose (or FEDSSA_VERBOSE=1) shows
tracebacks and every library's logs. Exit statuses: EXIT_* below and in docs/operations.md.

Several processes (hosts, or one per accelerator) run the same command and join through
jax.distributed: see --distributed and fedssa_jax/engine/distributed.py. When one of them is
lost, the others stop within seconds (at most --heartbeat_timeout) with status 69 and a message
that names it and how to resume (distributed.Watchdog, installed around the run).
"""
import sys

from fedssa_jax.run import console

if __name__ == '__main__' and not console.verbose_requested(sys.argv):
  console.import_tensorflow_quietly()

# pylint: disable=g-import-not-at-top,wrong-import-position
import logging
import os
import shlex
import traceback

from absl import flags
from ml_collections import config_flags

from fedssa_jax.engine import distributed
from fedssa_jax.errors import ConfigError, DataError
from fedssa_jax.run import checkpoint, train, workdir_lock

EXIT_FAILED = 1       # the run failed: it diverged, a checkpoint could not be written, or a bug
EXIT_BAD_INPUT = 2    # a config, command line, data set, workdir or checkpoint that cannot work
EXIT_LOCKED = 73      # another run holds the workdir (sysexits.h's EX_CANTCREAT)
EXIT_LOST_PROCESS = distributed.EXIT_LOST_PROCESS  # 69: another process of the run was lost
EXIT_PREEMPTED = train.EXIT_PREEMPTED  # 75: stopped by a signal after a checkpoint; rerun
EXIT_INTERRUPTED = 130  # a second SIGINT: stopped at once, after the last checkpoint

# Errors that are the user's to fix, each with its exit status; their message is the whole story.
USER_ERRORS = (
    (ConfigError, EXIT_BAD_INPUT),
    (DataError, EXIT_BAD_INPUT),
    (checkpoint.CheckpointError, EXIT_BAD_INPUT),
    (workdir_lock.WorkdirLocked, EXIT_LOCKED),
    (train.DivergenceError, EXIT_FAILED),
    (checkpoint.CheckpointWriteError, EXIT_FAILED),
)


def define_flags(flag_values: flags.FlagValues) -> None:
  config_flags.DEFINE_config_file('config', None, 'Config file, with an optional :variant.',
                                  lock_config=True, flag_values=flag_values)
  flags.DEFINE_string('workdir', None, 'Where config.json, metrics.jsonl, events and '
                      'summary.json are written.', flag_values=flag_values)
  flags.mark_flags_as_required(['config', 'workdir'], flag_values=flag_values)
  flags.DEFINE_list('seeds', None, 'Packs runs of these seeds (e.g. 0,1,2) into the same '
                    'compiled calls, one process; seed s writes to <workdir>/seed<s>, as a run '
                    'of --config.seed=s alone would (docs/operations.md#packed-seeds).',
                    flag_values=flag_values)
  flags.DEFINE_list('seed_workdirs', None, 'With --seeds: the workdir of each seed, in the '
                    'same order, instead of <workdir>/seed<s> (launch/sweep.py --pack_seeds).',
                    flag_values=flag_values)
  flags.DEFINE_bool('verbose', False, 'Tracebacks for every error, and every library\'s logs '
                    '(also FEDSSA_VERBOSE=1).', flag_values=flag_values)
  # Many processes (fedssa_jax/engine/distributed.py): each flag falls back to its FEDSSA_* variable.
  flags.DEFINE_enum('distributed', 'auto', list(distributed.MODES),
                    'jax.distributed.initialize: auto (when an address below or SLURM/Open MPI '
                    'tasks say so), on (always; with no address JAX detects SLURM, Open MPI, '
                    'Kubernetes or a Cloud TPU slice), off (one process).',
                    flag_values=flag_values)
  flags.DEFINE_string('coordinator_address', None, 'host:port of process 0, reachable by every '
                      'process ($FEDSSA_COORDINATOR_ADDRESS).', flag_values=flag_values)
  flags.DEFINE_integer('num_processes', None, 'How many processes the run has '
                       '($FEDSSA_NUM_PROCESSES).', flag_values=flag_values)
  flags.DEFINE_integer('process_id', None, "This process's index, 0 to num_processes - 1 "
                       '($FEDSSA_PROCESS_ID).', flag_values=flag_values)
  flags.DEFINE_list('local_device_ids', None, 'The local devices this process uses, e.g. 0,1 '
                    '($FEDSSA_LOCAL_DEVICE_IDS; default all).', flag_values=flag_values)
  flags.DEFINE_integer('heartbeat_timeout', None, 'Seconds without a sign of life after which '
                       'another process of the run counts as lost: this one then stops with '
                       f'status {distributed.EXIT_LOST_PROCESS} ($FEDSSA_HEARTBEAT_TIMEOUT; '
                       f'default {distributed.HEARTBEAT_TIMEOUT}).', flag_values=flag_values)


def run(flag_values: flags.FlagValues):
  # Before anything touches a JAX backend.
  settings = distributed.settings(
      flag_values.distributed, flag_values.coordinator_address, flag_values.num_processes,
      flag_values.process_id, flag_values.local_device_ids,
      heartbeat_timeout=flag_values.heartbeat_timeout)
  distributed.initialize(settings)
  resume = (f'Restart every process of the run with the command it was started with (this '
            f'one: {shlex.join(["python", "-m", "fedssa_jax.main", *sys.argv[1:]])}): they '
            f'resume from the last complete checkpoint in {flag_values.workdir}.')
  expected = (*(error for error, _ in USER_ERRORS), train.Preempted, KeyboardInterrupt)
  with distributed.Watchdog(settings.heartbeat_timeout, resume, expected):
    return _run(flag_values)


def _run(flag_values: flags.FlagValues):
  config = flag_values.config
  if flag_values.seeds is None:
    if flag_values.seed_workdirs is not None:
      raise ConfigError('--seed_workdirs goes with --seeds (one workdir per seed).')
    logging.info('Running %s on %s (%s), outputs in %s', config.method, config.dataset,
                 flag_values['config'].config_filename, flag_values.workdir)
    with console.StopRequests() as stop:
      return train.train_and_evaluate(config, flag_values.workdir, stop=stop)
  seeds = seeds_of(flag_values.seeds)
  workdirs = ([replica_workdir(flag_values.workdir, s) for s in seeds]
              if flag_values.seed_workdirs is None else list(flag_values.seed_workdirs))
  if len(workdirs) != len(seeds):
    raise ConfigError(
        f'--seed_workdirs names {len(workdirs)} workdirs for {len(seeds)} --seeds: give one '
        'per seed, in the same order.')
  logging.info('Running %s on %s (%s), seeds %s packed, outputs in %s', config.method,
               config.dataset, flag_values['config'].config_filename,
               ','.join(map(str, seeds)), ', '.join(workdirs))
  with console.StopRequests() as stop:
    return train.train_replicas(train.replica_configs(config, seeds), workdirs, stop=stop)


def seeds_of(values: list[str]) -> list[int]:
  """--seeds as ints: distinct, non-negative; a ConfigError naming the fix otherwise."""
  try:
    seeds = [int(v) for v in values]
  except ValueError:
    seeds = None
  if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
    raise ConfigError(
        f'--seeds={",".join(values)} must be distinct non-negative integers, e.g. --seeds=0,1,2.')
  return seeds


def replica_workdir(workdir: str, seed: int) -> str:
  """Where seed `seed` of a packed run (--seeds) writes: <workdir>/seed<seed>."""
  return os.path.join(workdir, f'seed{seed}')


def _flag_error_text(e: Exception) -> str:
  """A flag or config-override error as one line (config_flags nests KeyErrors' reprs)."""
  text = str(e)
  head, _, trace = text.partition('Traceback (most recent call last):')
  if trace:  # config_flags puts the config file's traceback in the message: keep its last line
    text = head + trace.strip().splitlines()[-1]
  while len(text) > 1 and text[0] == text[-1] and text[0] in '\'"':
    text = text[1:-1].replace('\\n', ' ').replace("\\'", "'")
  text = ' '.join(text.split())
  if isinstance(e, (KeyError, AttributeError)):
    return f'No such config field: {text}'
  return text


def _error(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def run_cli(argv) -> int:
  """The command line: parses `argv` (argv[0] is the program), runs, returns the exit status.

  Sets up the console (quiet unless --verbose or FEDSSA_VERBOSE=1) and turns the user's errors
  into one paragraph each; bugs keep their traceback.
  """
  verbose = console.verbose_requested(argv)
  with console.configured(verbose):
    return _run_cli(argv, verbose)


def _run_cli(argv, verbose: bool) -> int:
  flag_values = flags.FlagValues()
  define_flags(flag_values)
  if any(a in ('-h', '--help', '--helpshort', '--helpfull') for a in argv[1:]):
    print(flag_values.main_module_help() or flag_values.get_help(), flush=True)
    return 0
  previous_argv = sys.argv
  sys.argv = list(argv)  # config_flags reads the --config.* overrides from sys.argv
  try:
    try:
      rest = flag_values(list(argv))
      flag_values.config.method  # a config file that failed to load raises here
    except Exception as e:  # pylint: disable=broad-except  (flags, config file or an override)
      if verbose:
        traceback.print_exc()
      _error(f'Command line error: {_flag_error_text(e)} (python -m fedssa_jax.main --help '
             'lists the flags; configs/*.py and config_lib.base_config the config fields.)')
      return EXIT_BAD_INPUT
    if len(rest) > 1:
      _error(f'Command line error: unexpected arguments {rest[1:]}; every setting is a flag, '
             'e.g. --config.num_rounds=5.')
      return EXIT_BAD_INPUT
    try:
      run(flag_values)
    except train.Preempted as e:
      logging.warning('%s', e)
      return EXIT_PREEMPTED
    except KeyboardInterrupt:
      _error('Interrupted at once, without a checkpoint of the current round. Rerun the same '
             'command to resume from the last checkpoint.')
      return EXIT_INTERRUPTED
    except tuple(error for error, _ in USER_ERRORS) as e:
      if verbose:
        traceback.print_exc()
      _error(f'{type(e).__name__}: {e}')
      return next(status for error, status in USER_ERRORS if isinstance(e, error))
    return 0
  finally:
    sys.argv = previous_argv


def main() -> None:
  sys.exit(run_cli(sys.argv))


if __name__ == '__main__':
  main()
