"""Many processes: `jax.distributed.initialize` from flags or environment variables, and the
host reads that work when arrays are sharded across processes.

A run over several hosts (or several processes on one host) starts one process per host (or per
accelerator), each running the same command. They meet at a coordinator, process 0's address:

    python -m fedssa_jax.main --config=... --workdir=/shared/run \
        --coordinator_address=10.0.0.1:1234 --num_processes=2 --process_id=0   # on host 0
    ...                                                       --process_id=1   # on host 1

Each flag falls back to an environment variable (FEDSSA_COORDINATOR_ADDRESS, FEDSSA_NUM_PROCESSES,
FEDSSA_PROCESS_ID, FEDSSA_LOCAL_DEVICE_IDS), so a launcher can set them per process. Under a
cluster manager JAX finds all of them itself: `--distributed=on` with no addresses calls
`jax.distributed.initialize()`, which reads SLURM's, Open MPI's, Kubernetes' or a Cloud TPU
slice's environment. `--distributed=auto` (the default) initializes when any address flag or
variable is set, or when SLURM or Open MPI launched more than one task; a lone process stays
single-process. `--distributed=off` never initializes.

On the CPU, processes exchange data through gloo (JAX's `jax_cpu_collectives_implementation`,
whose default is gloo in this JAX version), which is what the two-process test uses.

A lost process (killed, crashed, its host gone) must not leave the others waiting in a
collective forever. `Watchdog` (the command line's, around the run) bounds that wait: each
process bumps a counter in the coordination service's key-value store every second and watches
the others'; one that stops for `--heartbeat_timeout` seconds (default 60), or that has stopped
when this process's collective fails, is lost, and this process prints which and how to resume,
and exits with EXIT_LOST_PROCESS at once (no shutdown barrier). JAX's own heartbeat check, set
to twice that timeout, stops a process whose watchdog could not (abort, status 134); when
process 0, which hosts the coordination service, is lost, JAX stops the others at once that way,
with its own message ("the JAX distributed service detected fatal errors").
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
import threading
import time
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from fedssa_jax.errors import ConfigError


MODES = ('auto', 'on', 'off')
ENV = {'coordinator_address': 'FEDSSA_COORDINATOR_ADDRESS',
       'num_processes': 'FEDSSA_NUM_PROCESSES',
       'process_id': 'FEDSSA_PROCESS_ID',
       'local_device_ids': 'FEDSSA_LOCAL_DEVICE_IDS'}
HEARTBEAT_ENV = 'FEDSSA_HEARTBEAT_TIMEOUT'
HEARTBEAT_TIMEOUT = 60  # seconds without a sign of life after which a process counts as lost
# The exit status of a process that stopped because another process of the run was lost
# (sysexits.h's EX_UNAVAILABLE); restarting every process resumes from the last checkpoint.
EXIT_LOST_PROCESS = 69


@dataclasses.dataclass(frozen=True)
class Settings:
  """What `jax.distributed.initialize` gets; None: not given (JAX may detect it)."""
  mode: str = 'auto'
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  local_device_ids: tuple[int, ...] | None = None
  heartbeat_timeout: int = HEARTBEAT_TIMEOUT  # seconds (Watchdog; JAX's check: twice that)

  @property
  def explicit(self) -> bool:
    return any(v is not None for v in (self.coordinator_address, self.num_processes,
                                       self.process_id, self.local_device_ids))


def _int(name: str, value) -> int | None:
  if value is None or value == '':
    return None
  try:
    return int(value)
  except (TypeError, ValueError):
    raise ConfigError(
        f'--{name} (or ${ENV[name]}) must be an integer, not {value!r}.') from None


def settings(mode: str = 'auto', coordinator_address: str | None = None,
             num_processes: int | None = None, process_id: int | None = None,
             local_device_ids: Sequence[int] | str | None = None,
             environ: dict | None = None, heartbeat_timeout: int | None = None) -> Settings:
  """The settings from flag values (None: not given), each falling back to its FEDSSA_*
  environment variable; raises ConfigError on a combination that cannot work."""
  environ = os.environ if environ is None else environ
  if mode not in MODES:
    raise ConfigError(f'--distributed={mode!r}: use one of {", ".join(MODES)}.')
  given = {'coordinator_address': coordinator_address, 'num_processes': num_processes,
           'process_id': process_id, 'local_device_ids': local_device_ids}
  for name, var in ENV.items():
    if given[name] is None and environ.get(var, '') != '':
      given[name] = environ[var]
  ids = given['local_device_ids']
  if isinstance(ids, str):
    ids = [s for s in ids.replace(' ', '').split(',') if s]
  ids = None if ids is None else tuple(_int('local_device_ids', i) for i in ids)
  given_timeout = environ.get(HEARTBEAT_ENV) if heartbeat_timeout is None else heartbeat_timeout
  try:
    heartbeat_timeout = int(HEARTBEAT_TIMEOUT if given_timeout in (None, '') else given_timeout)
  except (TypeError, ValueError):
    heartbeat_timeout = 0
  if heartbeat_timeout < 1:
    raise ConfigError(f'--heartbeat_timeout (or ${HEARTBEAT_ENV}) must be a whole number of '
                      f'seconds, at least 1, not {given_timeout!r}; the default is '
                      f'{HEARTBEAT_TIMEOUT}.')
  s = Settings(mode, given['coordinator_address'] or None,
               _int('num_processes', given['num_processes']),
               _int('process_id', given['process_id']), ids or None, heartbeat_timeout)

  named = [f'--{k} (${ENV[k]})' for k in ENV if getattr(s, k) is not None]
  if mode == 'off' and s.explicit:
    raise ConfigError(
        f'--distributed=off, but {", ".join(named)} given: drop them for a single-process run, '
        'or use --distributed=auto to join the other processes.')
  if s.num_processes is not None and s.num_processes < 1:
    raise ConfigError(f'--num_processes={s.num_processes}: use 1 or more.')
  if s.process_id is not None and s.num_processes is not None and not (
      0 <= s.process_id < s.num_processes):
    raise ConfigError(
        f'--process_id={s.process_id} with --num_processes={s.num_processes}: process ids run '
        f'from 0 to {s.num_processes - 1}.')
  if s.explicit and not _cluster_detected(environ):
    # Without a cluster manager JAX cannot fill in the rest.
    missing = [f'--{k}' for k in ('coordinator_address', 'num_processes', 'process_id')
               if getattr(s, k) is None]
    if missing:
      raise ConfigError(
          f'Joining other processes needs --coordinator_address, --num_processes and '
          f'--process_id (or ${ENV["coordinator_address"]}, ${ENV["num_processes"]} and '
          f'${ENV["process_id"]}); {", ".join(missing)} missing. Outside SLURM, Open MPI or a '
          'Cloud TPU slice, give all three on every process (the coordinator is process 0\'s '
          'host:port), or none of them for a single-process run.')
  return s


def _tasks(environ) -> int:
  for var in ('SLURM_STEP_NUM_TASKS', 'SLURM_NTASKS', 'OMPI_COMM_WORLD_SIZE'):
    if environ.get(var, '').isdigit():
      return int(environ[var])
  return 1


def _cluster_detected(environ) -> bool:
  """A cluster manager JAX reads by itself started this process (SLURM or Open MPI tasks)."""
  return _tasks(environ) > 1


def wanted(s: Settings, environ: dict | None = None) -> bool:
  """Whether these settings make the process join others."""
  environ = os.environ if environ is None else environ
  if s.mode == 'off':
    return False
  return s.mode == 'on' or s.explicit or _cluster_detected(environ)


def initialize(s: Settings) -> bool:
  """Calls `jax.distributed.initialize` when `s` asks for it (before anything touches a JAX
  backend); returns whether this process is one of several."""
  if not wanted(s) or jax.distributed.is_initialized():
    return jax.process_count() > 1
  kwargs = {k: getattr(s, k) for k in ENV if getattr(s, k) is not None}
  if s.local_device_ids is not None:
    kwargs['local_device_ids'] = list(s.local_device_ids)
  try:
    # JAX's own check is the backstop of the Watchdog's, which speaks first.
    jax.distributed.initialize(**kwargs, heartbeat_timeout_seconds=2 * s.heartbeat_timeout)
  except (RuntimeError, ValueError) as e:
    how = ('with ' + ', '.join(f'{k}={v!r}' for k, v in kwargs.items())) if kwargs else (
        'with nothing given, so JAX looked for SLURM, Open MPI, Kubernetes or a Cloud TPU slice')
    raise ConfigError(
        f'jax.distributed.initialize failed {how}: {e}. Give --coordinator_address (process 0\'s '
        'host:port, reachable from every process), --num_processes and --process_id, or run a '
        'single process with --distributed=off.') from e
  logging.info('Process %d of %d; devices: %d here, %d in all.', jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())
  return jax.process_count() > 1


# ----------------------------------------------------------------------------------------------
# A lost process
# ----------------------------------------------------------------------------------------------

def _coordination_client():
  """The client of the coordination service that `jax.distributed.initialize` started, whose
  key-value store the Watchdog writes and reads; None in a process that started none.

  The package's one access to JAX's internals (`jax._src`; tests/code_shape_test.py keeps it the
  only one): JAX 0.10 gives no public handle on that key-value store (`jax.distributed` has
  initialize, is_initialized and shutdown; `multihost_utils.live_devices` tells which processes
  the service still sees, not a heartbeat or how a process ended). It reads
  `jax._src.distributed.global_state.client`, which tests/jax_internals_test.py checks is there.
  Where a JAX release has moved it, a multi-process run goes on without the Watchdog, and says
  so, rather than failing.
  """
  try:
    from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
    return jax_distributed.global_state.client
  except (ImportError, AttributeError) as e:
    if jax.distributed.is_initialized():
      logging.warning('No watchdog on the other processes: JAX %s keeps its coordination '
                      'client elsewhere (%s). A lost process may leave this one waiting until '
                      "JAX's own heartbeat check stops it.", jax.__version__, e)
    return None


class Watchdog:
  """A thread that stops this process when another process of the run is lost, with a message
  that names it and `resume` (what to do), instead of leaving it waiting in a collective.

  Used as a context around the run. Each process sets `fedssa/alive/<index>` in the
  coordination service's key-value store every `interval` seconds and reads the others'. A
  process is lost when its value stops changing for `timeout` seconds, or for `5 * interval`
  seconds (if it had changed at all) once this process's run has raised an exception that is
  not one of `expected` (a collective that failed because a peer died: then the message comes
  within seconds; where no peer is lost, the exception goes on). Leaving the block marks this
  process as ended (`done`, or `failed` with an exception), which is not lost: its own output
  says why it ended. A no-op in a single-process run.
  """
  PREFIX = 'fedssa/alive'
  ENDED = ('done', 'failed')

  def __init__(self, timeout: float, resume: str, expected: tuple = (), interval: float = 1.0):
    self.timeout, self.resume, self.expected, self.interval = timeout, resume, expected, interval
    self._client = _coordination_client()  # None in a single process (no backend started)
    self._stop = threading.Event()
    self._seen: dict[int, tuple[str, float]] = {}  # process: (value, when it last changed)
    self._lock = threading.Lock()

  def __enter__(self):
    if self._client is not None and jax.process_count() == 1:
      self._client = None
    if self._client is not None:
      self._me, now = jax.process_index(), time.monotonic()
      self._seen = {p: ('', now) for p in range(jax.process_count()) if p != self._me}
      threading.Thread(target=self._watch, name='fedssa-watchdog', daemon=True).start()
    return self

  def __exit__(self, exc_type, exc, tb):
    if self._client is None:
      return
    if exc is not None and not isinstance(exc, self.expected):
      deadline = time.monotonic() + 5 * self.interval + 1
      while time.monotonic() < deadline:
        time.sleep(self.interval / 2)
        lost = self._silent(5 * self.interval)
        if lost:
          self._lost(lost, "this process's collective failed: "
                           f'{type(exc).__name__}: {" ".join(str(exc).split())[:200]}')
    self._stop.set()
    try:
      self._client.key_value_set(f'{self.PREFIX}/{self._me}', 'failed' if exc else 'done',
                                 allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except  (the service is gone: nobody to tell)
      pass

  def _silent(self, seconds: float) -> list[int]:
    """The processes, not ended, whose value has not changed for `seconds` (for `timeout`, if it
    never changed: a process may take a while to start its watchdog)."""
    with self._lock:
      now = time.monotonic()
      return [p for p, (value, since) in self._seen.items() if value not in self.ENDED
              and now - since > (seconds if value else max(seconds, self.timeout))]

  def _watch(self) -> None:
    beat = 0
    while not self._stop.wait(self.interval):
      try:
        self._client.key_value_set(f'{self.PREFIX}/{self._me}', str(beat), allow_overwrite=True)
        values = {}
        for p in self._seen:
          try:
            values[p] = self._client.key_value_try_get(f'{self.PREFIX}/{p}')
          except Exception:  # pylint: disable=broad-except  (not set yet)
            values[p] = ''
      except Exception as e:  # pylint: disable=broad-except
        if not self._stop.is_set():
          self._lost([0], 'the coordination service, which process 0 runs, stopped answering: '
                          f'{type(e).__name__}: {" ".join(str(e).split())[:200]}')
        return
      beat += 1
      with self._lock:
        for p, value in values.items():
          if value != self._seen[p][0]:
            self._seen[p] = (value, time.monotonic())
      silent = self._silent(self.timeout)
      if silent and not self._stop.is_set():
        self._lost(silent, f'no sign of life from it for {self.timeout:g} s')

  def _lost(self, processes: list[int], why: str) -> None:
    """Prints what happened and what to do, and ends this process at once: waiting for JAX's
    shutdown barrier would wait for the lost process."""
    names = ', '.join(map(str, sorted(processes)))
    sys.stderr.write(
        f'LostProcess: process{"es" if len(processes) > 1 else ""} {names} of the '
        f'{jax.process_count()} of this run stopped answering ({why}). Process {self._me} '
        f'cannot go on without {"them" if len(processes) > 1 else "it"} and stops (exit status '
        f'{EXIT_LOST_PROCESS}). {self.resume}\n')
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(EXIT_LOST_PROCESS)  # pylint: disable=protected-access


# ----------------------------------------------------------------------------------------------
# Host reads and writes of arrays that span processes
# ----------------------------------------------------------------------------------------------

def fetch(tree: Any) -> Any:
  """`jax.device_get` that also reads arrays sharded over several processes' devices, in full
  on every process. Such an array is gathered by a collective: then every process must call this
  with the same arrays, in the same order."""
  leaves, treedef = jax.tree.flatten(tree)
  spread = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)
            and not x.is_fully_addressable and not x.sharding.is_fully_replicated]
  if spread:
    # One jitted all-gather for all of them, to replicated copies every process can read.
    gathered = _replicate_all(tuple(leaves[i] for i in spread))
    for i, x in zip(spread, gathered):
      leaves[i] = x
  out = []
  for x in leaves:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      x = np.asarray(x.addressable_data(0))  # replicated: the local copy is the whole array
    out.append(x)
  return jax.tree.unflatten(treedef, jax.device_get(out))


def _replicate_all(arrays: tuple) -> tuple:
  shardings = tuple(NamedSharding(x.sharding.mesh, P()) for x in arrays)
  return _replicating(shardings)(arrays)


@functools.lru_cache(maxsize=64)
def _replicating(shardings: tuple):
  """One jitted identity per set of output shardings: fetch runs every round, and a new jit
  each time would trace and compile again."""
  return jax.jit(lambda xs: xs, out_shardings=shardings)


def any_process(flag: bool) -> bool:
  """Whether `flag` holds on any process (a collective under several processes): how they
  agree, e.g. to stop after the same round when only some of them got a signal."""
  if jax.process_count() == 1:
    return flag
  return bool(np.asarray(multihost_utils.process_allgather(np.asarray(flag))).any())


def put(tree: Any, sharding: jax.sharding.Sharding) -> Any:
  """Host values (the same on every process) placed on `sharding`, which may span processes:
  each process fills only its own devices' shards."""
  if sharding.is_fully_addressable:
    return jax.device_put(tree, sharding)

  def one(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
  return jax.tree.map(one, fetch(tree))
