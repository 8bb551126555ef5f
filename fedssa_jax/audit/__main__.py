r"""The audit's command line: main's --config (with its variants and --config.* overrides) and
--workdir, and the audit's own flags.

  python -m fedssa_jax.audit --config=configs/cifar10.py:hetero,n10 --workdir=runs/audit \
      --config.privacy.dp_sgd=True --config.privacy.noise_multiplier=1.1 --canaries=1000

  python -m fedssa_jax.audit --config=configs/cifar10.py:hetero,n10 --workdir=runs/audit \
      --config.privacy.upload=True --config.privacy.upload_target_epsilon=4 --notrain

Prints the table and writes audit.json into --workdir. Exit statuses are main's: 2 for input
that cannot work (with one paragraph naming the fix), 1 for a failure.
"""
import sys

from fedssa_jax.run import console

if __name__ == '__main__' and not console.verbose_requested(sys.argv):
  console.import_tensorflow_quietly()

# pylint: disable=g-import-not-at-top,wrong-import-position
import traceback

from absl import flags
from ml_collections import config_flags

from fedssa_jax import main as main_lib
from fedssa_jax.audit import run as audit_run
from fedssa_jax.audit import scores


def define_flags(fv: flags.FlagValues) -> None:
  config_flags.DEFINE_config_file('config', None, 'Config file, with an optional :variant.',
                                  lock_config=True, flag_values=fv)
  flags.DEFINE_string('workdir', None, 'Where audit.json is written.', flag_values=fv)
  flags.mark_flags_as_required(['config', 'workdir'], flag_values=fv)
  flags.DEFINE_integer('canaries', 1000, 'Training-data canaries m, each included with '
                       f'probability 1/2 (at least {scores.MIN_CANARIES}).', flag_values=fv)
  flags.DEFINE_integer('upload_canaries', 1000, 'Upload canaries, with privacy.upload on.',
                       flag_values=fv)
  flags.DEFINE_enum('mechanism', 'auto', ['auto', 'dp_sgd', 'upload'], 'What to audit: auto '
                    '(what the config turns on; training-data canaries always), or require '
                    'dp_sgd or upload to be on.', flag_values=fv)
  flags.DEFINE_bool('train', True, 'Train the config with canaries (the default). --notrain '
                    "audits the uploads' clip and noise alone (privacy.upload on), from the "
                    'config, without data or a run: seconds.', flag_values=fv)
  flags.DEFINE_bool('verbose', False, 'Tracebacks for every error, and every library\'s logs.',
                    flag_values=fv)


def run_cli(argv, dataset=None) -> int:
  """The command line: parses `argv` (argv[0] is the program), audits, returns the exit
  status. `dataset`: a data.Dataset instead of the config's (tests)."""
  verbose = console.verbose_requested(argv)
  with console.configured(verbose):
    fv = flags.FlagValues()
    define_flags(fv)
    if any(a in ('-h', '--help', '--helpshort', '--helpfull') for a in argv[1:]):
      print(__doc__ + '\n' + fv.get_help(), flush=True)
      return 0
    previous_argv, sys.argv = sys.argv, list(argv)  # config_flags reads the overrides here
    try:
      try:
        rest = fv(list(argv))
        fv.config.method  # a config file that failed to load raises here
        if len(rest) > 1:
          raise ValueError(f'unexpected arguments {rest[1:]}')
      except Exception as e:  # pylint: disable=broad-except
        if verbose:
          traceback.print_exc()
        text = main_lib._flag_error_text(e)  # pylint: disable=protected-access
        print(f'Command line error: {text} (python -m fedssa_jax.audit --help lists the '
              'flags.)', file=sys.stderr, flush=True)
        return main_lib.EXIT_BAD_INPUT
      try:
        out = audit_run.run_audit(
            fv.config, fv.workdir, canaries=fv.canaries, upload_canaries=fv.upload_canaries,
            mechanisms=fv.mechanism, training=fv.train, dataset=dataset,
            progress=lambda line: print(line, flush=True))
      except tuple(error for error, _ in main_lib.USER_ERRORS) as e:
        if verbose:
          traceback.print_exc()
        print(f'{type(e).__name__}: {e}', file=sys.stderr, flush=True)
        return next(s for error, s in main_lib.USER_ERRORS if isinstance(e, error))
      print(audit_run.table(out), flush=True)
      print(f'Written to {fv.workdir}/{audit_run.FILE}', flush=True)
      return 0
    finally:
      sys.argv = previous_argv


if __name__ == '__main__':
  sys.exit(run_cli(sys.argv))
