"""One process of a short FedSSA run through train.train_and_evaluate, on the synthetic data;
multihost_test.py starts it twice side by side (two processes joined by jax.distributed, through
the FEDSSA_* variables), first stopped by a signal, then resumed:

    FEDSSA_COORDINATOR_ADDRESS=localhost:12345 FEDSSA_NUM_PROCESSES=2 FEDSSA_PROCESS_ID=0 \
        JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \
        python tests/multihost_run.py WORKDIR ROUNDS [SIGNAL_ROUND]

With SIGNAL_ROUND, the last process sends itself SIGTERM in that round (the others get none):
all of them must stop after it, exit with status 75, and resume when run again. With
MULTIHOST_RUN_KILL_ROUND=r in the environment, the last process sends itself SIGKILL as round r
starts, while the others train it: they must stop within seconds, with status 69 and a message
that names it (distributed.Watchdog, which this script installs as main does).
With MULTIHOST_RUN_NO_EVENTS=1 in the environment, the run leaves out CLU's metric writers
(no TensorBoard events, no TensorFlow to import).

Prints one line 'RESULT {json}': the process's index and count, the device counts, how the
groups' parameters are placed, the workdir files this process opened for writing, and whether
the run was preempted. The one-process reference is `run` called in the test's own process
(one CPU device), or this script started alone where that process has other devices.
"""
import builtins
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
NO_EVENTS = 'MULTIHOST_RUN_NO_EVENTS'
KILL_ROUND = 'MULTIHOST_RUN_KILL_ROUND'
if __name__ == '__main__' and os.environ.get(NO_EVENTS):
  # Before anything imports fedssa_jax.run.train: without CLU's writers (and the TensorFlow they
  # import, several CPU seconds a process), the run takes train.py's branch for an image
  # without CLU and writes no TensorBoard events; the rest of the run is the same.
  sys.modules['clu.metric_writers'] = sys.modules['clu.periodic_actions'] = None
from fedssa_jax.engine import distributed  # noqa: E402


def run_config(rounds):
  """engine_test's small FedSSA config with one model family (cnn5), `rounds` rounds, a
  checkpoint every round, the representations saved and full float32 matmuls."""
  import engine_test  # pylint: disable=g-import-not-at-top  (the small config)
  config = engine_test.small_config('fedssa')
  config.model.families = ('cnn5',)
  config.num_rounds = rounds
  config.checkpoint_every = 1
  config.save_representations = True
  config.engine.matmul_precision = 'highest'
  return config


def run(workdir, rounds, signal_round=None):
  """The run of run_config(rounds) in `workdir` (resumed if it has a checkpoint); returns the
  RESULT dict. What it patches to watch the run is restored afterwards, so that the test's own
  process can call it."""
  import jax  # pylint: disable=g-import-not-at-top
  import conftest  # pylint: disable=g-import-not-at-top  (full float32 matmuls, the data set)
  from fedssa_jax.run import console  # pylint: disable=g-import-not-at-top
  from fedssa_jax.engine import evaluation, simulator  # pylint: disable=g-import-not-at-top
  from fedssa_jax.run import outputs  # pylint: disable=g-import-not-at-top
  from fedssa_jax.run import train  # pylint: disable=g-import-not-at-top

  config = run_config(rounds)
  workdir = os.path.abspath(str(workdir))

  # Which of the workdir's files this process opens for writing (train.py's and
  # representations' writers; orbax writes the checkpoints).
  written = set()
  real_open = builtins.open

  def tracking_open(file, mode='r', *args, **kwargs):
    if any(m in mode for m in 'wax') and str(file).startswith(workdir):
      written.add(os.path.relpath(str(file), workdir))
    return real_open(file, mode, *args, **kwargs)
  real_savez = evaluation.np.savez_compressed

  def tracking_savez(path, **arrays):
    written.add(os.path.relpath(str(path), workdir))
    return real_savez(path, **arrays)

  captured = {}
  real_record = outputs.record

  def capturing_record(sim, state, info, ev, *more):
    captured['sharding'] = [str(jax.tree.leaves(p)[0].sharding.spec)
                            if hasattr(jax.tree.leaves(p)[0].sharding, 'spec') else None
                            for p in state.population.params]
    captured['mesh_devices'] = sim.placement.num_devices
    if state.round == signal_round and jax.process_index() == jax.process_count() - 1:
      os.kill(os.getpid(), signal.SIGTERM)  # as a preempted task gets it
    return real_record(sim, state, info, ev, *more)

  real_run_round = simulator.Simulator.run_round
  kill_round = int(os.environ.get(KILL_ROUND, 0))

  def run_round_or_die(sim, state):
    if state.round + 1 == kill_round and jax.process_index() == jax.process_count() - 1:
      os.kill(os.getpid(), signal.SIGKILL)  # as a lost host goes: no cleanup, no message
    return real_run_round(sim, state)

  writers = (train, outputs)  # the modules that write the outputs (with the builtin open)
  for module in writers:
    module.open = tracking_open
  evaluation.np.savez_compressed = tracking_savez
  outputs.record = capturing_record
  simulator.Simulator.run_round = run_round_or_die
  settings = distributed.settings()
  try:
    # As main installs them.
    with distributed.Watchdog(settings.heartbeat_timeout, 'Rerun the same commands.',
                              (train.Preempted,)), console.StopRequests() as stop:
      train.train_and_evaluate(config, workdir, conftest.synthetic_dataset(), stop=stop)
    preempted = False
  except train.Preempted:
    preempted = True
  finally:
    for module in writers:
      del module.open
    evaluation.np.savez_compressed = real_savez
    outputs.record = real_record
    simulator.Simulator.run_round = real_run_round
  return {
      'process_index': jax.process_index(), 'process_count': jax.process_count(),
      'local_devices': jax.local_device_count(), 'devices': jax.device_count(),
      'written': sorted(written), 'preempted': preempted, **captured}


def every_process_writes_the_compilation_cache():
  """Lets this process write its programs to the persistent compilation cache, as process 0
  does: JAX writes from process 0 only, and the CPU's cache keys differ by process (their
  topology fingerprint), so without this process 1 would compile every program again when the
  run resumes, while process 0 loads its own and waits for it in the first collective. The keys
  differing, the processes never write the same entry. JAX internals: where they have changed,
  nothing is patched, and process 1 compiles as before."""
  try:
    from jax._src import compiler  # pylint: disable=g-import-not-at-top
    from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  real_write = getattr(compiler, '_cache_write', None)
  state = getattr(jax_distributed, 'global_state', None)
  if real_write is None or not getattr(state, 'process_id', 0):
    return

  def write(*args, **kwargs):
    process_id, state.process_id = state.process_id, 0  # what _cache_write checks
    try:
      return real_write(*args, **kwargs)
    finally:
      state.process_id = process_id
  compiler._cache_write = write  # pylint: disable=protected-access


def main(workdir, rounds, signal_round=None):
  # Before anything touches a JAX backend, as main.run does.
  distributed.initialize(distributed.settings())
  every_process_writes_the_compilation_cache()
  from fedssa_jax.run import train  # pylint: disable=g-import-not-at-top
  result = run(workdir, rounds, signal_round)
  print('RESULT ' + json.dumps(result), flush=True)
  sys.exit(train.EXIT_PREEMPTED if result['preempted'] else 0)


if __name__ == '__main__':
  main(sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:]))
