"""Runs one federated experiment. Intentionally kept short: flags, logging and the workdir.

  python -m fedssa_jax.main --config=configs/cifar10.py:hetero,n10 --workdir=runs/demo \
      --config.num_rounds=20 --config.local_epochs=1

Rerunning a command with the same --workdir resumes the run from its newest checkpoint. SIGTERM
or SIGINT stop a run after the current round and its checkpoint, with exit status 75
(train.EXIT_PREEMPTED).

Several processes (hosts, or one per accelerator) run the same command and join through
jax.distributed: see --distributed and fedssa_jax/distributed.py.
"""
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from fedssa_jax import distributed
from fedssa_jax import train

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues) -> None:
  config_flags.DEFINE_config_file('config', None, 'Config file, with an optional :variant.',
                                  lock_config=True, flag_values=flag_values)
  flags.DEFINE_string('workdir', None, 'Where config.json, metrics.jsonl, events and '
                      'summary.json are written.', flag_values=flag_values)
  flags.mark_flags_as_required(['config', 'workdir'], flag_values=flag_values)
  # Many processes (fedssa_jax/distributed.py): each flag falls back to its FEDSSA_* variable.
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


define_flags(FLAGS)


def run(flag_values: flags.FlagValues):
  logging.set_verbosity(logging.INFO)
  # Before anything touches a JAX backend.
  distributed.initialize(distributed.settings(
      flag_values.distributed, flag_values.coordinator_address, flag_values.num_processes,
      flag_values.process_id, flag_values.local_device_ids))
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
