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
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
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


@dataclasses.dataclass(frozen=True)
class Settings:
  """What `jax.distributed.initialize` gets; None: not given (JAX may detect it)."""
  mode: str = 'auto'
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  local_device_ids: tuple[int, ...] | None = None

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
             environ: dict | None = None) -> Settings:
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
  s = Settings(mode, given['coordinator_address'] or None,
               _int('num_processes', given['num_processes']),
               _int('process_id', given['process_id']), ids or None)

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
    jax.distributed.initialize(**kwargs)
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
