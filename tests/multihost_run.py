"""One process of a short FedSSA run through train.train_and_evaluate, on the synthetic data;
multihost_test.py starts it once alone and twice side by side (two processes joined by
jax.distributed, through the FEDSSA_* variables):

    FEDSSA_COORDINATOR_ADDRESS=localhost:12345 FEDSSA_NUM_PROCESSES=2 FEDSSA_PROCESS_ID=0 \
        JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \
        python tests/multihost_run.py WORKDIR ROUNDS [SIGNAL_ROUND]

With SIGNAL_ROUND, the last process sends itself SIGTERM in that round (the others get none):
all of them must stop after it, exit with status 75, and resume when run again.

Prints one line 'RESULT {json}': the process's index and count, the device counts, how the
groups' parameters are placed, the workdir files this process opened for writing, and whether
the run was preempted.
"""
import builtins
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fedssa_jax import distributed  # noqa: E402


def main(workdir, rounds, signal_round=None):
  # Before anything touches a JAX backend, as main.run does.
  distributed.initialize(distributed.settings())
  import jax  # pylint: disable=g-import-not-at-top
  import conftest  # pylint: disable=g-import-not-at-top  (full float32 matmuls, the data set)
  import engine_test  # pylint: disable=g-import-not-at-top  (the small config)
  from fedssa_jax import evaluation, train  # pylint: disable=g-import-not-at-top

  config = engine_test.small_config('fedssa')
  config.num_rounds = rounds
  config.checkpoint_every = 1
  config.save_representations = True
  config.engine.matmul_precision = 'highest'

  # Which of the workdir's files this process opens for writing (train.py's and
  # representations' writers; orbax writes the checkpoints).
  written = set()
  real_open = builtins.open

  def tracking_open(file, mode='r', *args, **kwargs):
    if any(m in mode for m in 'wax') and str(file).startswith(os.path.abspath(workdir)):
      written.add(os.path.relpath(str(file), workdir))
    return real_open(file, mode, *args, **kwargs)
  train.open = tracking_open
  real_savez = evaluation.np.savez_compressed

  def tracking_savez(path, **arrays):
    written.add(os.path.relpath(str(path), workdir))
    return real_savez(path, **arrays)
  evaluation.np.savez_compressed = tracking_savez

  captured = {}
  real_record = train._record  # pylint: disable=protected-access

  def capturing_record(sim, state, info, ev):
    captured['sharding'] = [str(jax.tree.leaves(p)[0].sharding.spec)
                            if hasattr(jax.tree.leaves(p)[0].sharding, 'spec') else None
                            for p in state.params]
    captured['mesh_devices'] = sim.placement.num_devices
    if state.round == signal_round and jax.process_index() == jax.process_count() - 1:
      os.kill(os.getpid(), signal.SIGTERM)  # as a preempted task gets it
    return real_record(sim, state, info, ev)
  train._record = capturing_record  # pylint: disable=protected-access

  try:
    train.train_and_evaluate(config, os.path.abspath(workdir), conftest.synthetic_dataset())
    preempted = False
  except train.Preempted:
    preempted = True
  print('RESULT ' + json.dumps({
      'process_index': jax.process_index(), 'process_count': jax.process_count(),
      'local_devices': jax.local_device_count(), 'devices': jax.device_count(),
      'written': sorted(written), 'preempted': preempted, **captured}), flush=True)
  sys.exit(train.EXIT_PREEMPTED if preempted else 0)


if __name__ == '__main__':
  main(sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:]))
