"""Checkpoints of a run (orbax), and the rules for resuming one.

A checkpoint after round r lives in `<workdir>/checkpoints/<r>/`, written atomically by orbax's
CheckpointManager (a temporary folder, renamed when complete). It holds three items:

- `state`:    one seed's run state, as a dict (engine.snapshots.saved): whatever its keys (client
              models of every family, server state, round counter, cumulative costs, ...).
- `progress`: what the outputs need beyond the state: the metrics history (every metrics.jsonl
              record so far, from which "first round reaching the target" and the summary are
              computed), per-round seconds, elapsed seconds, and a SHA-256 digest of the state.
- `meta`:     the config and the partition fingerprint, which a resume compares with its own,
              and the backend and JAX version.

There is no RNG state to save: every random draw is a pure function of the config's seed, the
round and the client id (engine.STREAM_*, engine.sample_cohort, the partition seed), so the round
counter in the state is the RNG state.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from fedssa_jax import config_lib
from fedssa_jax.engine import distributed
from fedssa_jax.errors import ConfigError

# Config fields that may differ between a checkpoint and the run that resumes it: they change
# neither what the run computes nor which metrics it records (the engine's batching changes only
# the float rounding, see ROUNDING_FIELDS). Every other field must match. (eval_every,
# eval_batch_size and engine.matmul_precision are not here: the first two decide what
# metrics.jsonl holds, the last changes the numbers on GPUs.)
MUTABLE_ON_RESUME = (
    'num_rounds',             # extend (or finish) a run
    'target_accuracy',        # only the summary's "costs to target", recomputed from the history
    'checkpoint_every', 'checkpoint_keep',
    'save_representations',   # only what is written at the end
    'data_dir', 'download',   # where the data comes from; the partition fingerprint must match
    'engine.clients_per_call', 'engine.eval_clients_per_call',  # how clients are batched
    'engine.micro_batch',     # how a step's rows are batched
    'engine.mesh_devices',    # how clients are placed on devices (checkpoints hold no padding)
    'guard.max_train_loss', 'guard.loss_growth',  # when to stop a diverging run
)
# Of those, the ones that change how XLA computes (vmapped or not), so the float rounding: a
# resume that changes them, or the backend or JAX version, gets a warning.
ROUNDING_FIELDS = ('engine.clients_per_call', 'engine.eval_clients_per_call',
                   'engine.micro_batch', 'engine.mesh_devices')

ITEMS = ('state', 'progress', 'meta')

# The layout of the saved state, in the `meta` item. 1 (absent from older checkpoints): each
# method's server state a dict of string keys. 2: a flax.struct dataclass per method, with named
# fields (docs/algorithm.md §9). A checkpoint of another layout is refused.
STATE_FORMAT = 2


class CheckpointError(RuntimeError):
  """No checkpoint in a workdir can be read, with what to do about it."""


class CheckpointWriteError(RuntimeError):
  """A checkpoint could not be written (e.g. a full disk); says which one is intact."""


@dataclasses.dataclass(frozen=True)
class Restored:
  step: int          # the round the checkpoint was written after
  state: dict        # one seed's run state, the dict engine.snapshots.saved makes
  progress: dict     # history, round_times, ...
  meta: dict         # config, partition fingerprint, backend, JAX version


def config_fields(config: ml_collections.ConfigDict | dict) -> dict[str, Any]:
  """The config as a flat {'a.b': value} dict of JSON values (tuples become lists)."""
  if isinstance(config, ml_collections.ConfigDict):
    config = config.to_dict()
  config = json.loads(json.dumps(config, default=list))
  flat = {}

  def walk(prefix, d):
    for k, v in d.items():
      if isinstance(v, dict):
        walk(f'{prefix}{k}.', v)
      else:
        flat[prefix + k] = v
  walk('', config)
  return flat


def run_meta(config: ml_collections.ConfigDict, partition_fingerprint: str) -> dict:
  """The `meta` item of a run's checkpoints: what a resume must agree with."""
  return {'config': config.to_dict(), 'partition_fingerprint': partition_fingerprint,
          'backend': jax.default_backend(), 'jax_version': jax.__version__,
          'state_format': STATE_FORMAT}


def check_resumable(saved_meta: dict, config: ml_collections.ConfigDict, where: str) -> None:
  """Raises a ConfigError naming every config field, outside MUTABLE_ON_RESUME, that differs.

  Logs a warning when the rest of the run may differ from an uninterrupted one in float
  rounding: another backend or JAX version, or other engine batching. A checkpoint whose state
  layout (STATE_FORMAT) is not this code's is refused first.
  """
  layout = saved_meta.get('state_format', 1)
  if layout != STATE_FORMAT:
    raise ConfigError(
        f'Cannot resume the run in {where}: its checkpoints hold the run\'s state in layout '
        f'{layout}, and this code reads layout {STATE_FORMAT} (since layout 2 each method\'s '
        'server state is a typed dataclass, not a dict). Finish the run with the code that '
        'started it, or use a new --workdir for a new run.')
  saved, now = config_fields(saved_meta['config']), config_fields(config)
  # A field added to the config after the checkpoint was written is fine at the value that
  # gives the behaviour the run had: its default, or config_lib.VALUE_BEFORE_FIELD's.
  base = config_fields(config_lib.base_config(config.dataset))
  before = {k: config_lib.VALUE_BEFORE_FIELD.get(k, base[k]) for k in base if k not in saved}
  show = lambda d, k: (repr(d[k]) if k in d else
                       f'(absent: the run behaves as {before[k]!r})' if k in before else '(absent)')
  differ = [k for k in sorted(set(saved) | set(now)) if show(saved, k) != show(now, k)]
  added = {k for k in differ if k in before and now.get(k) == before[k]}
  refused = [f'{k}: checkpoint {show(saved, k)}, now {show(now, k)}' for k in differ
             if k not in MUTABLE_ON_RESUME and k not in added]
  for on, sigma, target in (('dp_sgd', 'noise_multiplier', 'target_epsilon'),
                            ('upload', 'upload_noise_multiplier', 'upload_target_epsilon')):
    if (now.get(f'privacy.{on}') and not now.get(f'privacy.{sigma}')
        and saved.get('num_rounds') != now['num_rounds']):
      refused.append(f'num_rounds: checkpoint {saved.get("num_rounds")!r}, now '
                     f'{now["num_rounds"]!r} (privacy.{target} calibrated the noise '
                     'multiplier to the checkpoint\'s num_rounds)')
  if refused:
    raise ConfigError(
        f'Cannot resume the run in {where}: its config differs in fields that change the '
        f'run\'s meaning: {"; ".join(refused)}. Rerun with the checkpoint\'s values, or use a new '
        f'--workdir for a new run. Fields that may change on resume: '
        f'{", ".join(MUTABLE_ON_RESUME)}.')
  rounding = [f'{k} {show(saved, k)} -> {show(now, k)}' for k in differ if k in ROUNDING_FIELDS]
  rounding += [f'{k} {saved_meta[k]!r} -> {v!r}' for k, v in
               (('backend', jax.default_backend()), ('jax_version', jax.__version__))
               if saved_meta.get(k, v) != v]
  if rounding:
    logging.warning('Resuming %s with %s: the remaining rounds match an uninterrupted run only '
                    'up to float rounding.', where, ', '.join(rounding))


def _path_name(path) -> str:
  """A leaf's path as 'a/b/0': the same for a dataclass field, a dict key or a list index of that
  name, so that a state restored without a template (in dicts and lists) has the digest of the
  one saved (with the methods' server dataclasses)."""
  names = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      names.append(str(k.key))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      names.append(k.name)
    elif isinstance(k, jax.tree_util.SequenceKey):
      names.append(str(k.idx))
    else:
      names.append(str(k))
  return '/'.join(names)


def state_digest(state) -> str:
  """A SHA-256 of every leaf (path, dtype, shape, bytes) of a pytree, for restore checks; the
  leaves in the order of their paths' names (a dataclass keeps its fields' order, a dict sorts
  its keys)."""
  h = hashlib.sha256()
  leaves = [(_path_name(path), leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(distributed.fetch(state))]
  for name, leaf in sorted(leaves, key=lambda item: item[0]):
    a = np.ascontiguousarray(leaf)  # Python numbers too: an int is int64, a float float64
    h.update(f'{name} {a.dtype}{a.shape}'.encode())
    h.update(a.reshape(-1).view(np.uint8))  # its bytes, read in place (no copy of a table)
  return h.hexdigest()


@contextlib.contextmanager
def _numpy_arrays_written_in_place():
  """Orbax's handler of numpy arrays without its defensive copy, for one save. It copies each
  array before writing, in case the caller changes it during an asynchronous save; saves here
  are synchronous (`enable_async_checkpointing=False`), so the copy only doubled a save's host
  memory (about 5 GB more at N = 1,000: the run was killed for memory at its last round)."""
  default = ocp.type_handlers.get_type_handler(np.ndarray)

  def register(handler):  # without orbax's warning that a handler is replaced
    absl_logger = logging.getLogger('absl')
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
      ocp.type_handlers.register_type_handler(np.ndarray, handler, override=True)
    finally:
      absl_logger.setLevel(level)
  register(ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False))
  try:
    yield
  finally:
    register(default)


def _root_cause(e: BaseException) -> str:
  """`type: message` of the innermost exception (orbax wraps the OSError of a full disk)."""
  while (e.__cause__ or e.__context__) is not None:
    e = e.__cause__ or e.__context__
  return f'{type(e).__name__}: {str(e)[:200]}'


def _place_like(value: np.ndarray, like):
  """A restored host array, placed as `like` is: a run that resumes then compiles the very
  programs of an uninterrupted run (committed arrays would add sharding annotations)."""
  if not isinstance(like, jax.Array):
    return value
  if like.committed:
    return distributed.put(value, like.sharding)
  return jnp.asarray(value)


class _NotFromOrbax(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return f'{os.sep}orbax{os.sep}' not in record.pathname


@contextlib.contextmanager
def _orbax_logs_dropped():
  """Within the block, orbax's own log lines (through absl's logger) are dropped: restoring an
  unreadable step logs an ERROR with a traceback per item, where `_skip` says it once."""
  absl_logger, drop = logging.getLogger('absl'), _NotFromOrbax()
  absl_logger.addFilter(drop)
  try:
    yield
  finally:
    absl_logger.removeFilter(drop)


class Checkpointer:
  """Saves and restores a run's checkpoints in one folder; skips unreadable ones with a warning.

  Saving is synchronous: the engine donates the state's buffers to the next round, so the state
  is copied to the host and written before the round starts.

  With several processes (`jax.distributed`), every process makes the same calls in the same
  order: orbax's manager synchronises them, the saved state is a host copy that is identical on
  every process (`distributed.fetch`), and orbax has only process 0 write it and the JSON items.
  The directory must then be on a filesystem every process sees at the same path.

  Skipping an unreadable checkpoint leaves orbax's reads of its other arrays in flight, and
  their failures may print afterwards ("Event loop is closed" tracebacks); this class installs
  nothing process-wide against them. The command lines drop them
  (console.abandoned_reads_silenced), which a library caller may use too.
  """

  def __init__(self, directory: str, keep: int = 3):
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
        self.directory, item_names=ITEMS,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False,
            cleanup_tmp_directories=True))  # what a kill during a save left behind
    self._unreadable: dict[int, Exception] = {}  # step: why it cannot be resumed

  def steps(self) -> list[int]:
    """The rounds with a complete checkpoint, oldest first."""
    return sorted(self._manager.all_steps())

  def _candidates(self):
    return [s for s in reversed(self.steps()) if s not in self._unreadable]

  def _skip(self, step: int, error: Exception,
            what: str = 'is corrupt or truncated') -> None:
    self._unreadable[step] = error
    earlier = [s for s in self._candidates() if s < step]
    then = (f'falling back to the previous one (round {earlier[0]})' if earlier
            else 'no earlier checkpoint is left')
    logging.warning('The checkpoint of round %d in %s %s (%s: %s); %s.', step, self.directory,
                    what, type(error).__name__, str(error)[:600], then)

  def reject(self, step: int, error: Exception) -> None:
    """Marks the checkpoint of `step`, which read back whole, as not resumable: what it refers
    to outside it is damaged (`error`, e.g. the disk store's rows.DamagedRows, whose `fix` the
    final error repeats if no checkpoint is left). restore_latest then tries the one before."""
    self._skip(step, error, 'cannot be resumed: the files it refers to are damaged')

  def _none_readable(self) -> CheckpointError:
    fixes = [e.fix for e in self._unreadable.values() if isinstance(getattr(e, 'fix', None), str)]
    if fixes:
      return CheckpointError(
          f'No checkpoint in {self.directory} can be resumed (rounds {self.steps()}): '
          f'{fixes[0]} The warnings above name each damaged file.')
    return CheckpointError(
        f'No checkpoint in {self.directory} can be read (rounds {self.steps()}; see the '
        'warnings above). If the code has changed what a run\'s state holds, finish the run with '
        'the code that started it, or start a new --workdir; otherwise delete that folder to '
        'start the run over.')

  def latest_meta(self) -> tuple[int, dict] | None:
    """(round, `meta` item) of the newest readable checkpoint; None when there is none."""
    if not self.steps():
      return None
    for step in self._candidates():
      try:
        with _orbax_logs_dropped():
          return step, self._manager.restore(
              step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
      except Exception as e:  # pylint: disable=broad-except  (any failure means unreadable)
        self._skip(step, e)
    raise self._none_readable()

  def restore_latest(self, template=None) -> Restored | None:
    """The newest checkpoint that reads back whole; None when there is no checkpoint.

    `template` is a state of the right structure (e.g. snapshots.saved of a fresh one): each array
    comes back placed like the template's (see `_place_like`). Without one, the state comes back
    as saved, in numpy arrays (and tuples as lists), for inspection. Checkpoints newer than the
    one restored could not be read; `discard_after` removes them.
    """
    if not self.steps():
      return None
    on_host = None if template is None else jax.tree.map(
        lambda x: np.empty(x.shape, x.dtype)
        if isinstance(x, (jax.Array, np.ndarray, np.generic)) else x,  # numpy scalars: 0-d leaves
        template)
    for step in self._candidates():
      try:
        with _orbax_logs_dropped():
          r = self._manager.restore(step, args=ocp.args.Composite(
              state=ocp.args.StandardRestore(on_host), progress=ocp.args.JsonRestore(),
              meta=ocp.args.JsonRestore()))
        if state_digest(r.state) != r.progress['state_digest']:
          raise ValueError('the state does not match the digest saved with it')
      except Exception as e:  # pylint: disable=broad-except
        self._skip(step, e)
        continue
      state = r.state if template is None else jax.tree.map(_place_like, r.state, template)
      return Restored(step, state, r.progress, r.meta)
    raise self._none_readable()

  def discard_after(self, step: int) -> None:
    """Deletes the checkpoints of rounds after `step`: a resumed run writes them again."""
    for newer in [s for s in self.steps() if s > step]:
      logging.warning('Deleting the unreadable checkpoint of round %d in %s.', newer,
                      self.directory)
      self._manager.delete(newer)

  def save(self, state, progress: dict, meta: dict) -> None:
    """Writes the checkpoint of round state['round'] and drops the oldest beyond `keep`."""
    host_state = distributed.fetch(state)  # the same on every process
    progress = dict(progress, state_digest=state_digest(host_state))
    step = int(state['round'])
    try:
      with _numpy_arrays_written_in_place():
        self._manager.save(
            step, force=True,
            args=ocp.args.Composite(state=ocp.args.StandardSave(host_state),
                                    progress=ocp.args.JsonSave(progress),
                                    meta=ocp.args.JsonSave(meta)))
    except Exception as e:  # pylint: disable=broad-except  (orbax wraps OSErrors variously)
      earlier = [s for s in self.steps() if s < step]
      safe = (f'The checkpoint of round {earlier[-1]} is intact, and a rerun of the same '
              'command resumes from it' if earlier else
              'No earlier checkpoint exists, so a rerun of the same command starts over')
      raise CheckpointWriteError(
          f'Could not write the checkpoint of round {step} to {self.directory} '
          f'({_root_cause(e)}). {safe} once there is space (or the folder is writable) '
          'again.') from e

  def close(self) -> None:
    self._manager.close()
