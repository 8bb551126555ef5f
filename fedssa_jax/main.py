"""Runs one federated experiment. Intentionally kept short: flags, logging and the workdir.

  python -m fedssa_jax.main --config=configs/cifar10.py:hetero,n10 --workdir=runs/demo \
      --config.num_rounds=20 --config.local_epochs=1

Rerunning a command with the same --workdir resumes the run from its newest checkpoint. SIGTERM
or SIGINT stop a run after the current round and its checkpoint, with exit status 75
(train.EXIT_PREEMPTED).
"""
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from fedssa_jax import train

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues) -> None:
  config_flags.DEFINE_config_file('config', None, 'Config file, with an optional :variant.',
                                  lock_config=True, flag_values=flag_values)
  flags.DEFINE_string('workdir', None, 'Where config.json, metrics.jsonl, events and '
                      'summary.json are written.', flag_values=flag_values)
  flags.mark_flags_as_required(['config', 'workdir'], flag_values=flag_values)


define_flags(FLAGS)


def run(flag_values: flags.FlagValues):
  logging.set_verbosity(logging.INFO)
  return train.train_and_evaluate(flag_values.config, flag_values.workdir)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  try:
    run(FLAGS)
  except train.Preempted as e:
    logging.warning('%s', e)
    sys.exit(train.EXIT_PREEMPTED)


if __name__ == '__main__':
  app.run(main)
