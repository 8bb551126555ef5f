"""Where the client population lives between rounds: one interface, three stores.

Every FedSSA client keeps a whole private model, so the population outgrows device memory first
(10,000 clients of the five families are about 60 GB of float32), then host memory. A store
decides where each family group's stacked parameters and the per-client method state live, and
so how a chunk of clients reaches its jitted training call and goes back:

- `DeviceStore` (`population_store='device'`): arrays on the accelerator (sharded along the
  `clients` mesh axis). A chunk is gathered and scattered inside its jitted call (donated
  buffers). The fastest, and the default.
- `HostStore` ('host'): numpy tables in RAM (`HostRows`). Each chunk's rows are copied to the
  device before its call and back after it; the next chunk is read while the device trains this
  one.
- `DiskStore` ('disk'): memory-mapped files in `<workdir>/population/` (`DiskRows`), read and
  written a chunk at a time as for `host`.

The computation is the same whatever the store (the chunk's rows go through the same jitted
training step), so the three give the same metrics (identical with XLA's default flags). The
engine speaks to a store through `Store` alone, and the run state holds what the store gives, a
`Population` (state.py), the same type for every store: device arrays for the device store, a
handle on its tables for the host and disk stores. Through it the store makes the initial
population, trains and evaluates chunks, and runs the checkpoint sequence (`saved`,
`before_checkpoint`, `after_checkpoint`, `stacked`; snapshots.py), the same way for every store.

No round changes a population its caller still holds: the device store's calls donate the
arrays (JAX deletes them), and a row store, which writes its tables in place, moves them to a
new generation first, so that a population of an older generation is refused (StalePopulation)
rather than read with the newer rows.

Disk layout and checkpoints. A table of rows (one family's client models, or every client's
method state) is one file per leaf, `<table>/leaf<i>.bin`, holding `capacity` *slots* of one row
each, plus `slot_of`: the slot that holds each row's current value, or -1 for a row never
written. A row at -1 reads as its initial value, recomputed from its key (`init_fn`), so clients
that have not trained yet take no disk: at 1% participation a 10,000-client population grows by
about 100 clients a round. Writes are copy-on-write: a chunk's new rows go to free slots, then
`slot_of` points at them. A checkpoint therefore saves `slot_of` alone (one int per client), never
the population; the slots named by the `slot_of` of every checkpoint still kept are *pinned*
(never reused), so a run that dies after a checkpoint resumes from rows the later rounds did not
overwrite. Each checkpoint's map is also written beside the table, with the CRC-32 of each of its
rows (`<table>/pins/<round>.npz`, checksums taken as the rows are written), so a resumed run
knows which slots the older kept checkpoints pin, and checks before it trains that the files
still hold the checkpoint's rows: a file cut short, overwritten or of another layout, or a pins
map missing or unreadable, raises `rows.DamagedRows` naming the file, and the run falls back to
an older checkpoint whose rows are intact, or stops (train.py). Capacity grows on demand (the
files are sparse: an unused slot takes no disk); the store needs about
(N + K * checkpoint_every * checkpoint_keep) slots at most. The host store writes no files: its
rows are in the checkpoint, under its digest.
"""
from __future__ import annotations

import functools
import itertools
import os
import shutil
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedssa_jax.engine.chunk_calls import TrainThenWrite, jit_chunk_call
from fedssa_jax.engine.placement import Placement, over_replicas
from fedssa_jax.engine.rows import DiskRows, HostRows
from fedssa_jax.engine.state import SEED_AXES, Population, StalePopulation, TableRows, Tables
from fedssa_jax.errors import ConfigError
from fedssa_jax.types import PyTree


# ----------------------------------------------------------------------------------------------
# The stores
# ----------------------------------------------------------------------------------------------

def _take(tree: PyTree, rows) -> PyTree:
  return jax.tree.map(lambda a: a[rows], tree)


class Store:
  """Where the groups' parameters and the per-client state of every seed live, and how chunks
  of them reach the jitted calls: a `Population` (state.py) names them, which the run state
  holds between rounds; `params` below are the groups' (a tuple, one entry per group) and
  `client_state` the state of all N clients, on the host, as a checkpoint holds them.

  `init_group(group, slots, seed_index)` and `init_client_state(client_ids, seed_index)` give
  a seed's initial rows (stacked). `train_chunk(params, state, server, inputs)` trains one
  chunk's rows of one seed (engine.py) and `evaluate_rows(params, cids, valid, server, data)`
  evaluates them (evaluation.py), with the members' client state as a sixth argument for a
  method whose evaluation reads it (`with_state`); a store wraps each into the jitted calls that
  bring its rows to them.

  A store declares what it can do in the class attributes below, and the rest of the package
  asks them (`store_class(name).packs_seeds`), never its name: a new store is a class and an
  entry of STORES.
  """
  name = ''                # the config's population_store
  packs_seeds = False      # holds several seeds' populations at once (packed seeds, --seeds)
  spans_processes = False  # splits the population over the processes of a multi-process run
  needs_directory = False  # keeps files in the run's folder (`directory`)

  def __init__(self, placement: Placement, groups: list, num_clients: int, num_seeds: int,
               init_group: Callable, init_client_state: Callable, directory: str | None = None):
    self._check(num_seeds, directory)
    self.placement = placement
    self.groups = groups
    self.num_clients = num_clients
    self.num_seeds = num_seeds
    self.init_group = init_group
    self.init_client_state = init_client_state
    self.directory = directory  # the run's folder for the population (the disk store's files)

  @classmethod
  def _check(cls, num_seeds: int, directory: str | None) -> None:
    """Raises ConfigError, naming the stores that can, if this store cannot hold the run."""
    if num_seeds != 1 and not cls.packs_seeds:
      raise ConfigError(
          f"population_store={cls.name!r} holds one seed's population; packed seeds need "
          f'{either(stores(packs_seeds=True))}.')
    if jax.process_count() > 1 and not cls.spans_processes:
      raise ConfigError(
          f'population_store={cls.name!r} runs in one process; across {jax.process_count()} '
          f'processes use {either(stores(spans_processes=True))}, which splits the population '
          "over the processes' devices (each holds its own shards), or run one process per "
          'machine.')
    if directory is None and cls.needs_directory:
      raise ConfigError(
          f"population_store={cls.name!r} keeps the population in the run's workdir: give the "
          f'Simulator a workdir, or use the '
          f'{" or ".join(stores(needs_directory=False))} store.')

  # --- the population ---------------------------------------------------------------------------
  def initial(self, fresh: bool = True) -> Population:
    """Round 0's population. `fresh`: no checkpoint will be restored, so anything a previous run
    left (the disk store's files) is discarded."""
    raise NotImplementedError

  def saved(self, population: Population, seed_index: int) -> tuple[tuple, PyTree]:
    """What a seed's checkpoint holds of it, (params, client_state): host arrays without
    padding rows, whatever the device count (or the disk store's slot maps)."""
    raise NotImplementedError

  def seed_slice(self, population: Population, seed_index: int) -> tuple[tuple, PyTree]:
    """One seed's (params, client_state), every row, as host copies without padding rows."""
    raise NotImplementedError

  def stacked(self, saved: list) -> Population:
    """The inverse of `saved`: the seeds' checkpointed (params, client_state), made live."""
    raise NotImplementedError

  def before_checkpoint(self, population: Population, step: int) -> None:
    """Called before the checkpoint of round `step` is written (the disk store flushes its
    files and pins the rows the checkpoint refers to)."""

  def after_checkpoint(self, population: Population, kept_steps: list[int]) -> None:
    """Called after a checkpoint save or restore, with the rounds of the checkpoints still kept
    (the disk store frees the slots that none of them refers to)."""

  # --- chunks -----------------------------------------------------------------------------------
  def _jit_chunk_call(self, call: Callable) -> Callable:
    return jit_chunk_call(call, self.placement, self.num_seeds)

  def train_call(self, g, train_chunk: Callable) -> Callable:
    raise NotImplementedError

  def train(self, population: Population, server, chunks, calls, inputs):
    """Trains `chunks` (schedule.Chunk) with the groups' `calls` (`train_call`); `inputs`
    (state.ChunkInputs) holds what every chunk's call shares. Returns (the new population, the
    server, [ChunkStats of each chunk]); `population` is used up."""
    raise NotImplementedError

  def eval_call(self, g, evaluate_rows: Callable, with_state: bool = False) -> Callable:
    """The jitted call of `evaluate_rows` on a block of the group's rows; `with_state`: it also
    takes the block's members' client state (the call then takes the store's client state)."""
    raise NotImplementedError

  def evaluate(self, population: Population, seed_index: int, jobs, calls, server, data,
               with_state: bool = False) -> list:
    """Runs the group `calls` (`eval_call`) on `jobs` [(group index, slots, count of real
    slots)] of one seed, one block of clients per call, with the members' client state for
    calls made `with_state`. Returns [(group index, slots, result)], the results still on the
    device."""
    raise NotImplementedError


def _chunk_inputs(inputs, chunk):
  return inputs.replace(slots=jnp.asarray(chunk.slots, jnp.int32),
                        ids=jnp.asarray(chunk.ids, jnp.int32), active=jnp.asarray(chunk.active))


class DeviceStore(Store):
  """Every group's parameters and the per-client state as device arrays [R, rows, ...], the
  client axis padded to a multiple of the device count and sharded along `clients`
  (placement.py)."""
  name = 'device'
  packs_seeds = True
  spans_processes = True

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.client_rows = self.placement.rows(self.num_clients)

  def _arrays(self, population: Population) -> tuple[tuple, PyTree]:
    if population.tables is not None:
      raise StalePopulation(
          f'The device store holds its population in arrays; this one names the '
          f'{population.tables.store} store\'s tables.')
    return population.params, population.client_state

  def initial(self, fresh=True):
    return self.stacked([
        (tuple(self.init_group(g, np.arange(g.size), i) for g in self.groups),
         self.init_client_state(np.arange(self.num_clients), i))
        for i in range(self.num_seeds)])

  def seed_slice(self, population, seed_index):
    return self.saved(population, seed_index)

  def saved(self, population, seed_index):
    """On the host (one transfer, no program; a copy of every seed where there are several)."""
    params, client_state = self.placement.fetch_seed(self._arrays(population), seed_index)
    return (tuple(_take(p, slice(0, g.size)) for g, p in zip(self.groups, params)),
            _take(client_state, slice(0, self.num_clients)))

  def stacked(self, saved):
    params, client_state = self.placement.stack_seeds(
        [(tuple(p), s) for p, s in saved],
        (tuple(g.rows for g in self.groups), self.client_rows))
    return Population(params=tuple(params), client_state=client_state)

  def train_call(self, g, train_chunk):
    def train(group_params, client_state, server, inputs):
      """Trains one chunk of one seed. inputs.slots [P] index the group (g.rows = dummy)."""
      safe = jnp.minimum(inputs.slots, g.size - 1)
      return train_chunk(_take(group_params, safe), _take(client_state, inputs.ids), server,
                         inputs)

    def write(group_params, client_state, new_params, new_state, inputs):
      # Dummies scatter out of range, so their writes are dropped.
      put = lambda tree, new, dest: jax.tree.map(
          lambda a, b: a.at[dest].set(b, mode='drop'), tree, new)
      return (put(group_params, new_params, jnp.where(inputs.active, inputs.slots, g.rows)),
              put(client_state, new_state, jnp.where(inputs.active, inputs.ids, self.client_rows)))

    place = self.placement
    over = over_replicas(write, self.num_seeds, (0, 0, 0, 0, SEED_AXES))
    return TrainThenWrite(
        jit_chunk_call(train, place, self.num_seeds, donate=(2,)),  # the server alone
        jax.jit(lambda *a: tuple(place.constrain(t, True, stacked=True) for t in over(*a)),
                donate_argnums=(0, 1)))

  def train(self, population, server, chunks, calls, inputs):
    params, client_state = self._arrays(population)
    params, chunk_stats = list(params), []
    for c in chunks:
      params[c.group], client_state, server, stats = calls[c.group](
          params[c.group], client_state, server, _chunk_inputs(inputs, c))
      chunk_stats.append(stats)
    return Population(params=tuple(params), client_state=client_state), server, chunk_stats

  def eval_call(self, g, evaluate_rows, with_state=False):
    members = jnp.asarray(g.members)
    mesh = self.placement.mesh

    def rows(group_params, i, slots):
      # Without a mesh, each client's row is read from the table in the evaluation's loop: a
      # gather of the block copied its rows first, at N = 1,000 most of an evaluation's time
      # (the CPU's page faults of a fresh block each call). Under a mesh, the block's rows are
      # gathered and each device gets its share.
      if mesh is None:
        return TableRows(group_params, i, slots)
      return jax.tree.map(lambda a: a[i, slots], group_params)
    if not with_state:
      return jax.jit(lambda group_params, i, slots, valid, server, data_: evaluate_rows(
          rows(group_params, i, slots), members[slots], valid,
          jax.tree.map(lambda a: a[i], server), data_))
    return jax.jit(lambda group_params, i, slots, valid, server, data_, client_state: (
        evaluate_rows(rows(group_params, i, slots), members[slots], valid,
                      jax.tree.map(lambda a: a[i], server), data_,
                      jax.tree.map(lambda a: a[i, members[slots]], client_state))))

  def evaluate(self, population, seed_index, jobs, calls, server, data, with_state=False):
    params, client_state = self._arrays(population)
    i = jnp.asarray(seed_index, jnp.int32)
    state = (client_state,) if with_state else ()
    return [(gi, slots, calls[gi](params[gi], i, jnp.asarray(slots, jnp.int32),
                                  jnp.asarray(np.arange(len(slots)) < n), server, data, *state))
            for gi, slots, n in jobs]


_STORE_NUMBERS = itertools.count()  # Tables.owner: which row store of the process


class _RowStore(Store):
  """A store of tables of rows off the device (`HostRows`, `DiskRows`), of one seed: the host
  reads each chunk's rows and puts them on the device, the jitted call trains them (the same
  step as on the device), and the host writes them back, reading the next chunk while this one
  trains. The store keeps its tables; the population it gives out is a handle on them
  (state.Tables), valid until the store next writes or replaces them. It holds one seed, in one
  process (the capabilities `Store` declares are all off)."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self._number = next(_STORE_NUMBERS)
    self._rows = None  # its tables: (one per group, the client state's), once made
    self._handle = None  # the Tables that names them now

  def _next_generation(self) -> Population:
    """Moves the tables to a new generation (before they change): the populations handed out
    before are refused from now on. Returns the one that names them."""
    generation = 0 if self._handle is None else self._handle.generation + 1
    self._handle = Tables(self.name, self._number, generation)
    return Population(tables=self._handle)

  def _open(self, params: tuple, client_state) -> Population:
    """Makes these tables the store's (round 0's, or a checkpoint's)."""
    self._rows = (tuple(params), client_state)
    return self._next_generation()

  def _tables_of(self, population: Population) -> tuple[tuple, PyTree]:
    """The tables `population` names, if it names them as they are now."""
    held = population.tables
    if held is None or held.store != self.name or held.owner != self._number:
      where = ('device arrays' if held is None else
               f'the tables of {"another" if held.store == self.name else "the " + held.store} '
               'store')
      raise StalePopulation(f'The {self.name} store was given a population of {where}.')
    if held != self._handle:
      raise StalePopulation(
          f'This population of the {self.name} store is of generation {held.generation}, '
          f'superseded by generation {self._handle.generation}: a later round wrote the '
          'tables in place (or a restore replaced them). Read the state that round returned, '
          'as a round of the device store donates the arrays of the state it is given.')
    return self._rows

  def saved(self, population, seed_index):
    params, client_state = self._tables_of(population)
    return tuple(t.saved() for t in params), client_state.saved()

  def seed_slice(self, population, seed_index):
    del seed_index  # a row store holds one seed
    params, client_state = self._tables_of(population)
    return tuple(t.all_rows() for t in params), client_state.all_rows()

  def train_call(self, g, train_chunk):
    # The host passes the chunk's rows in, and gets them back.
    return self._jit_chunk_call(train_chunk)

  def train(self, population, server, chunks, calls, inputs):
    params, client_state = self._tables_of(population)
    new = self._next_generation()  # the tables change from here on

    def load(c):
      g = self.groups[c.group]
      safe = np.minimum(c.slots[0], g.size - 1)  # dummies run on a copy of a real row
      rows = (params[c.group].read(safe), client_state.read(c.ids[0]))
      return self.placement.to_device(jax.tree.map(lambda a: a[None], rows), stacked=True)

    def write_back(c, new_params, new_state):
      new_params, new_state = jax.device_get((new_params, new_state))
      active = c.active[0]
      params[c.group].write(c.slots[0][active], _take(new_params, (0, active)))
      client_state.write(c.ids[0][active], _take(new_state, (0, active)))

    chunk_stats, pending = [], None
    loaded = load(chunks[0]) if chunks else None
    for i, c in enumerate(chunks):
      rows, cstate = loaded
      new_params, new_state, server, stats = calls[c.group](
          rows, cstate, server, _chunk_inputs(inputs, c))
      chunk_stats.append(stats)
      if pending is not None:
        write_back(*pending)
      loaded = load(chunks[i + 1]) if i + 1 < len(chunks) else None
      pending = (c, new_params, new_state)
    if pending is not None:
      write_back(*pending)
    return new, server, chunk_stats

  def eval_call(self, g, evaluate_rows, with_state=False):
    del with_state  # the call takes the state rows the host brings (`evaluate`), if any
    members = jnp.asarray(g.members)
    return jax.jit(lambda rows, i, slots, valid, server, data_, *state_rows: evaluate_rows(
        rows, members[slots], valid, jax.tree.map(lambda a: a[i], server), data_, *state_rows))

  def evaluate(self, population, seed_index, jobs, calls, server, data, with_state=False):
    """The next block is read while the device evaluates this one."""
    params, client_state = self._tables_of(population)

    def load(gi, slots, n):
      del n
      rows = (params[gi].read(slots),)
      if with_state:
        rows += (client_state.read(self.groups[gi].members[slots]),)
      return self.placement.to_device(rows)

    i = jnp.asarray(seed_index, jnp.int32)
    results, loaded = [], load(*jobs[0]) if jobs else None
    for j, (gi, slots, n) in enumerate(jobs):
      rows, *state_rows = loaded
      r = calls[gi](rows, i, jnp.asarray(slots, jnp.int32),
                    jnp.asarray(np.arange(len(slots)) < n), server, data, *state_rows)
      loaded = load(*jobs[j + 1]) if j + 1 < len(jobs) else None
      results.append((gi, slots, r))
    return results


class HostStore(_RowStore):
  """Numpy tables in RAM."""
  name = 'host'

  def initial(self, fresh=True):
    params = tuple(self.init_group(g, np.arange(g.size), 0) for g in self.groups)
    return self.stacked([jax.device_get(
        (params, self.init_client_state(np.arange(self.num_clients), 0)))])

  def stacked(self, saved):
    (params, client_state), = saved
    return self._open(tuple(HostRows(p) for p in params), HostRows(client_state))


def _in_powers_of_two(init_fn: Callable) -> Callable:
  """init_fn(ids), computed for a power-of-two count of ids (so that a store making initial rows
  on demand compiles a few programs, not one per count) and cut back. Each row's values depend
  on its own id alone, so they do not depend on the count."""
  def padded(ids):
    ids = np.asarray(ids)
    n = len(ids)
    size = 1 << max(n - 1, 0).bit_length()
    out = init_fn(np.pad(ids, (0, size - n), mode='edge'))
    return out if size == n else jax.tree.map(lambda a: a[:n], out)
  return padded


class DiskStore(_RowStore):
  """Memory-mapped, copy-on-write slot files in `directory` (`DiskRows`). Rows never written
  read as their initial values, made on demand."""
  name = 'disk'
  needs_directory = True

  def initial(self, fresh=True):
    if fresh:  # what a run without a checkpoint left
      shutil.rmtree(self.directory, ignore_errors=True)
    return self._open(*self._tables())

  def _tables(self):
    """The tables over the files in the directory, every row at its initial value until
    `restore` or a write: (one per group, the per-client state's)."""
    def table(name, num_rows, init_fn):
      init_fn = _in_powers_of_two(init_fn)
      row = jax.eval_shape(lambda: jax.tree.map(lambda a: a[0], init_fn(np.zeros(1, int))))
      return DiskRows(os.path.join(self.directory, name), row, num_rows, init_fn)
    return (tuple(table(g.family, g.size, functools.partial(self.init_group, g, seed_index=0))
                  for g in self.groups),
            table('client_state', self.num_clients,
                  functools.partial(self.init_client_state, seed_index=0)))

  def stacked(self, saved):
    (params, client_state), = saved
    tables, state_table = self._tables()
    for table, saved in zip((*tables, state_table), (*params, client_state)):
      table.restore(saved['slot_of'])
    return self._open(tables, state_table)

  def before_checkpoint(self, population, step):
    params, client_state = self._tables_of(population)
    for table in (*params, client_state):
      table.snapshot(step)

  def after_checkpoint(self, population, kept_steps):
    params, client_state = self._tables_of(population)
    for table in (*params, client_state):
      table.retain(kept_steps)


# The registry: outside this module, a store is asked what it can do, never its name.
STORES = {s.name: s for s in (DeviceStore, HostStore, DiskStore)}


def store_class(name: str) -> type[Store]:
  """The store of the config's `population_store`, whose class attributes say what it can do."""
  if name not in STORES:
    raise ConfigError(f'Unknown population_store {name!r}; choose one of {sorted(STORES)}.')
  return STORES[name]


def stores(**capabilities: bool) -> list[str]:
  """The names of the stores whose capabilities have these values, e.g.
  `stores(packs_seeds=True)`, in STORES's order."""
  return [name for name, s in STORES.items()
          if all(getattr(s, c) == v for c, v in capabilities.items())]


def either(names: list[str]) -> str:
  """The settings that would do, for a message: "population_store='a' or population_store='b'"."""
  return ' or '.join(f'population_store={n!r}' for n in names)


def make_store(name: str, *args, directory: str | None = None) -> Store:
  return store_class(name)(*args, directory=directory)
