"""The round engine: family groups, cohort sampling, vmapped local training, server, evaluation.

Clients that share a model family form a group; a group's parameters are one pytree whose leaves
have a leading axis over the group's members. A round:

1. samples the cohort on the host (K = max(1, floor(C N)) clients, uniform without replacement);
2. for each group, splits its sampled members into chunks of a fixed size `clients_per_call`
   (padded with masked dummy clients), and for each chunk runs one jitted call that gathers the
   chunk's states, applies the method's download, trains all of them under `vmap` with the
   method's loss, uploads to the server, and scatters the states back in place (donated
   buffers);
3. runs the method's server rule once, under jit.

Shapes never depend on the round, so each family compiles its training call once. Dummy clients
train on zero samples (every step is a no-op), and their scatter and upload are dropped, so they
change nothing.

Devices: with more than one device (`engine.mesh_devices`), the engine builds a one-axis mesh,
`clients`. Every array with a leading client axis (each group's parameters, the per-client
state) is sharded along it with `NamedSharding(mesh, P('clients'))`; that axis is padded to a
multiple of the device count with rows that no client owns (never trained, evaluated results
dropped), because XLA shards only evenly. A chunk's size is a multiple of the device count too,
and its clients train under `jax.shard_map`, each device its own rows. The server state, the data
and the seen masks are replicated: the gather of a chunk from the sharded group, the scatter back,
and the server's receipt of sharded uploads into its replicated state are the collectives, which
XLA inserts under jit. With one device there is no mesh and nothing is padded.

Processes: a run may span several processes (hosts, or one per accelerator), joined by
`jax.distributed` (fedssa_jax/distributed.py). Every process runs the same program on the same
inputs; the mesh then spans all processes' devices (`jax.devices()`; engine.mesh_devices must be
0 or their count). What is split across processes is the client population: each process holds
only its devices' rows of every group's parameters and of the per-client state. What is
replicated on every device of every process: the image data, the partition, the seen masks and
the server state. Host values enter the mesh through `distributed.put` (each process fills its
own shards), and every host read of mesh arrays (`Simulator.fetch`: per-chunk training stats,
evaluation results, `unpadded`) all-gathers them, a collective that every process makes at the
same point of the round.

The run state is a plain dict (`RunState`), ready to checkpoint. Checkpoints hold it without the
padding rows (`Simulator.unpadded`, `Simulator.place`), so a run may resume on another number of
devices.

Population store (`population_store`): with `device`, the groups' parameters and the per-client
state are arrays in the state, and a chunk is gathered and scattered inside its jitted call.
With `host` or `disk` they are tables of rows (population.HostRows, population.DiskRows): the
host reads each chunk's rows, the jitted call trains them (the same step as on the device), and
the host writes them back, reading the next chunk while this one trains. Evaluation goes by
blocks of clients for every store: gathered on the device, or read from the store.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from fedssa_jax import client, config_lib, costs, data, distributed, methods, models, population

PyTree = Any
# {'round': int, 'params': tuple per group, 'client_state': pytree over all N clients,
#  'server': pytree, 'costs': dict}
RunState = dict

# Independent random streams, all derived from the config's seed. STREAM_INIT draws a client's
# own initial model (model.init_scope='client', keyed by client id); STREAM_FAMILY_INIT a
# family's shared one ('family', keyed by the family's index in models.FAMILY_NAMES).
(STREAM_INIT, STREAM_SAMPLE, STREAM_TRAIN, STREAM_SERVER, STREAM_CLIENT_STATE, STREAM_EVAL,
 STREAM_FAMILY_INIT) = range(7)

CLIENTS = 'clients'  # the mesh axis over which client axes are sharded


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def make_mesh(mesh_devices: int) -> jax.sharding.Mesh | None:
  """The `clients` mesh over the first `mesh_devices` devices (0: all of them); None for a
  single device, which then runs unsharded programs.

  With one process these are its local devices. With several (`jax.distributed`), the mesh
  spans every process's devices, all of them: a subset would leave some process without a
  device of the mesh."""
  if jax.process_count() > 1:
    devices = jax.devices()
    if mesh_devices not in (0, len(devices)):
      raise config_lib.ConfigError(
          f'engine.mesh_devices={mesh_devices}, but with {jax.process_count()} processes the '
          f'mesh spans all {len(devices)} of their devices. Use 0, or start fewer processes or '
          'devices per process (--local_device_ids).')
    return jax.sharding.Mesh(np.array(devices), (CLIENTS,))
  devices = jax.local_devices()
  n = mesh_devices or len(devices)
  if n > len(devices):
    raise config_lib.ConfigError(
        f'engine.mesh_devices={mesh_devices}, but this process has {len(devices)} '
        f'{jax.default_backend()} devices. Use 0 (all of them) or at most {len(devices)}.')
  return None if n == 1 else jax.sharding.Mesh(np.array(devices[:n]), (CLIENTS,))


@dataclasses.dataclass(frozen=True)
class Group:
  family: str
  members: np.ndarray  # sorted client ids
  model: models.CNN
  clients_per_call: int  # a multiple of the mesh's device count
  rows: int  # stored rows: the size padded to a multiple of the device count
  eval_model: models.CNN  # the same function, in the formulation fastest forward-only

  @property
  def size(self) -> int:
    return len(self.members)


def cohort_size(num_clients: int, participation: float) -> int:
  return max(1, int(np.floor(participation * num_clients)))


def sample_cohort(seed: int, round_index: int, num_clients: int, k: int) -> np.ndarray:
  """The round's participants, sorted; a pure function of (seed, round)."""
  rng = np.random.default_rng([seed, STREAM_SAMPLE, round_index])
  return np.sort(rng.choice(num_clients, size=k, replace=False))


@jax.jit
def _client_keys(root_key: jax.Array, stream, client_ids: jax.Array) -> jax.Array:
  """Each client's key of a random stream: fold_in(fold_in(root, stream), client id)."""
  stream_key = jax.random.fold_in(root_key, stream)
  return jax.vmap(lambda c: jax.random.fold_in(stream_key, c))(client_ids)


def eval_subset(seed: int, test_n: np.ndarray, eval_clients: int) -> np.ndarray | None:
  """The fixed random subset of `eval_clients` clients evaluated every time (sorted ids),
  drawn among the clients with test data; None: evaluate them all."""
  candidates = np.flatnonzero(test_n > 0)
  if not eval_clients or eval_clients >= len(candidates):
    return None
  rng = np.random.default_rng([seed, STREAM_EVAL])
  return np.sort(rng.choice(candidates, size=eval_clients, replace=False))


def train_config(config, ds: data.Dataset) -> client.TrainConfig:
  o = config.optimizer
  return client.TrainConfig(
      batch_size=config.batch_size, local_epochs=config.local_epochs, optimizer=o.name,
      lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, clip_norm=o.clip_norm,
      adam_b1=o.adam_b1, adam_b2=o.adam_b2, micro_batch=micro_batch(config),
      augment=config.augment, mean=tuple(ds.mean), std=tuple(ds.std))


def micro_batch(config) -> int:
  """engine.micro_batch, or by backend: 64-row passes on the CPU (whose activations stay in
  cache: CNN-1 trains about 1.1x faster per sample than in one 512-row pass, and a partial
  batch pads less), whole batches on accelerators."""
  if config.engine.micro_batch:
    return config.engine.micro_batch
  b = config.batch_size
  return 64 if jax.default_backend() == 'cpu' and b > 64 and b % 64 == 0 else b


class Simulator:
  """Holds the static parts of a run (data, groups, compiled steps); state is passed in/out."""

  def __init__(self, config, ds: data.Dataset, cd: data.ClientData, profile: bool = False,
               workdir: str | None = None):
    self.config = config
    self.store = config.population_store
    if self.store == 'disk' and workdir is None:
      raise config_lib.ConfigError(
          "population_store='disk' keeps the population in the run's workdir: give the "
          'Simulator a workdir, or use the device or host store.')
    self.population_dir = workdir and os.path.join(os.path.abspath(workdir), 'population')
    if self.store != 'device' and jax.process_count() > 1:
      raise config_lib.ConfigError(
          f"population_store={self.store!r} runs in one process; across {jax.process_count()} "
          "processes use population_store='device', which splits the population over the "
          "processes' devices (each holds its own shards), or run one process per machine.")
    # Profiling blocks on each phase's results to time it (`phase_seconds`, summed over
    # rounds); off by default, since the syncs cost overlap.
    self.profile = profile
    self.phase_seconds: dict[str, float] = {}
    self.num_clients = cd.num_clients
    self.num_classes = ds.num_classes
    self.k = cohort_size(self.num_clients, config.participation)
    self.eval_ids = eval_subset(config.seed, cd.test_n, config.eval_clients)
    # The clients whose accuracy every evaluation reports (those with test data, or the subset).
    self.evaluated_ids = (np.flatnonzero(cd.test_n > 0) if self.eval_ids is None
                          else self.eval_ids)
    self.seen = cd.seen
    self.train_n = cd.train_n
    self.method = methods.get_method(config.method)(config, self.num_clients, ds.num_classes)
    self.train_cfg = train_config(config, ds)
    self.root_key = jax.random.PRNGKey(config.seed)
    self.mesh = make_mesh(config.engine.mesh_devices)
    self.num_devices = 1 if self.mesh is None else self.mesh.size
    self.client_rows = round_up(self.num_clients, self.num_devices)  # of client_state
    self.data = self._replicate(client.DeviceData(
        images=jnp.asarray(ds.images), labels=jnp.asarray(ds.labels),
        train_idx=jnp.asarray(cd.train_idx), train_n=jnp.asarray(cd.train_n),
        test_idx=jnp.asarray(cd.test_idx), test_n=jnp.asarray(cd.test_n)))
    self.seen_dev = self._replicate(jnp.asarray(cd.seen))

    families = tuple(config.model.families)
    for f in families:
      models.get_family(f)
    self.client_family = np.array([i % len(families) for i in range(self.num_clients)])
    backend = jax.default_backend()
    self.groups: list[Group] = []
    for gi, fam in enumerate(families):
      members = np.flatnonzero(self.client_family == gi)
      if not len(members):
        continue
      # Auto: one client per call on the CPU, where vmapping over clients gains nothing; on
      # accelerators, the group's expected share of the cohort, so that a typical round needs
      # one call per family and few dummies. A family sampled more often takes more calls.
      per_call = config.engine.clients_per_call or (
          1 if backend == 'cpu' else -(-self.k // len(families)))
      # Every device trains as many of a chunk's clients (padded with dummies).
      per_call = round_up(int(min(per_call, len(members), self.k)), self.num_devices)
      model, eval_model = (models.make_model(fam, ds.num_classes, config.model.conv_impl,
                                             config.engine.compute_dtype, forward_only=fwd)
                           for fwd in (False, True))
      self.groups.append(Group(fam, members, model, per_call,
                               round_up(len(members), self.num_devices), eval_model))
    # client id -> (group index, slot within the group)
    self.group_of = np.empty(self.num_clients, int)
    self.slot_of = np.empty(self.num_clients, int)
    for gi, g in enumerate(self.groups):
      self.group_of[g.members] = gi
      self.slot_of[g.members] = np.arange(g.size)

    # Training FLOPs per processed sample: the family's own model, plus what the method adds
    # (e.g. a jointly trained CNN-5).
    self._flops_memo = {}
    self.flops_per_sample = {}
    for g in self.groups:
      self.flops_per_sample[g.family] = self.method.train_flops_per_sample(
          self._model_flops(g.family), self._model_flops)
    self.client_flops_per_sample = np.array(
        [self.flops_per_sample[self.groups[g].family] for g in self.group_of])

    self._init_fns = {}
    self._init_client_state_fn = jax.jit(jax.vmap(self.method.init_client_state))
    self._train_calls = [self._make_train_call(g) for g in self.groups]
    self._eval_calls = [self._make_eval_call(g) for g in self.groups]
    self._aggregate = jax.jit(
        lambda *a: self._constrain(self.method.server_aggregate(*a), P()), donate_argnums=0)

  def _model_flops(self, family: str) -> float:
    """FLOPs of one CE training step of `family`'s model, per sample (XLA's count)."""
    if family in self._flops_memo:
      return self._flops_memo[family]
    xla = costs.xla_train_flops_per_sample(family, self.num_classes, self.config.batch_size)
    analytic = costs.analytic_train_flops_per_sample(family, self.num_classes)
    if not 0.9 < xla / analytic < 1.15:
      logging.warning('FLOPs of %s: XLA counts %.4g per sample, the analytic count %.4g.',
                      family, xla, analytic)
    self._flops_memo[family] = xla
    return xla

  # ------------------------------------------------------------------------------------------
  # Devices
  # ------------------------------------------------------------------------------------------
  def _replicate(self, tree):
    return tree if self.mesh is None else distributed.put(tree, NamedSharding(self.mesh, P()))

  def _constrain(self, tree, spec: P):
    """Under jit: `tree`'s arrays sharded as `spec` on the mesh (nothing without a mesh)."""
    if self.mesh is None:
      return tree
    return jax.lax.with_sharding_constraint(tree, NamedSharding(self.mesh, spec))

  def _per_device(self, fn, num_sharded: int):
    """`fn`, whose first `num_sharded` arguments and every output have a leading client axis,
    run by each device on its own rows (`jax.shard_map`); the other arguments are replicated.
    Without a mesh, `fn` itself."""
    if self.mesh is None:
      return fn

    def sharded(*args):
      in_specs = (P(CLIENTS),) * num_sharded + (P(),) * (len(args) - num_sharded)
      # check_vma off: `fn` has no collectives, and its outputs are per client by construction.
      return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=P(CLIENTS),
                           check_vma=False)(*args)
    return sharded

  def place(self, state: RunState) -> RunState:
    """A state as a checkpoint holds it (no padding rows; the `host` store's rows as arrays,
    the `disk` store's as slot maps), made live: on the device, padded and placed on the mesh
    (client axes sharded, the server replicated), or in the store."""
    if self.store == 'host':
      return {**state, 'server': self._replicate(state['server']),
              'params': tuple(population.HostRows(p) for p in state['params']),
              'client_state': population.HostRows(state['client_state'])}
    if self.store == 'disk':
      params, client_state = self._disk_tables()
      for table, saved in zip((*params, client_state),
                              (*state['params'], state['client_state'])):
        table.restore(saved['slot_of'])
      return {**state, 'server': self._replicate(state['server']),
              'params': params, 'client_state': client_state}
    if self.mesh is None:
      return state
    pad = lambda tree, rows: jax.tree.map(
        lambda a: np.pad(a, [(0, rows - len(a))] + [(0, 0)] * (a.ndim - 1)),
        distributed.fetch(tree))
    clients = NamedSharding(self.mesh, P(CLIENTS))
    return {**state,
            'params': tuple(distributed.put(pad(p, g.rows), clients)
                            for g, p in zip(self.groups, state['params'])),
            'client_state': distributed.put(pad(state['client_state'], self.client_rows),
                                            clients),
            'server': self._replicate(distributed.fetch(state['server']))}

  def fetch(self, tree):
    """`tree`'s arrays on the host, in full: under several processes a collective, so every
    process calls it at the same point of the run (see distributed.fetch)."""
    return distributed.fetch(tree)

  def unpadded(self, state: RunState) -> RunState:
    """What a checkpoint holds of `state`, whatever the device count: no padding rows; the
    `host` store's rows as arrays; the `disk` store's as their slot maps (the slot files are not
    copied: population.py). Without a mesh and on the device, `state` itself."""
    if self.store != 'device':
      return {**state, 'params': tuple(t.saved() for t in state['params']),
              'client_state': state['client_state'].saved()}
    if self.mesh is None:
      return state
    host = self.fetch(state)
    return {**host,
            'params': tuple(jax.tree.map(lambda a: a[:g.size], p)
                            for g, p in zip(self.groups, host['params'])),
            'client_state': jax.tree.map(lambda a: a[:self.num_clients], host['client_state'])}

  def _tables(self, state: RunState) -> tuple:
    """The host or disk store's tables of rows (none for the device store)."""
    return () if self.store == 'device' else (*state['params'], state['client_state'])

  def before_checkpoint(self, state: RunState) -> RunState:
    """What the checkpoint of `state` holds (`unpadded`). The disk store first flushes its slot
    files and pins the rows this checkpoint refers to."""
    for table in self._tables(state):
      table.snapshot(state['round'])
    return self.unpadded(state)

  def after_checkpoint(self, state: RunState, kept_steps: list[int]) -> None:
    """The disk store keeps the pins of the checkpoints still on disk (after a save, which may
    have deleted the oldest, or after a restore) and frees its other slots."""
    for table in self._tables(state):
      table.retain(kept_steps)

  # ------------------------------------------------------------------------------------------
  # State
  # ------------------------------------------------------------------------------------------
  def _client_keys(self, stream: int, client_ids) -> jax.Array:
    return _client_keys(self.root_key, stream, jnp.asarray(client_ids))

  def _init_group(self, g: Group, slots) -> PyTree:
    """The initial parameters of the group's members at `slots` (stacked): each one's own draw,
    or (init_scope 'family') copies of the family's one model, the same in every method."""
    slots = np.asarray(slots)
    if self.config.model.init_scope == 'family':
      family_ids = np.full(len(slots), models.FAMILY_NAMES.index(g.family))
      return self._init_fn_padded(self._init_params_fn(g), STREAM_FAMILY_INIT, family_ids)
    return self._init_fn_padded(self._init_params_fn(g), STREAM_INIT, g.members[slots])

  def _init_fn_padded(self, fn, stream: int, cids: np.ndarray) -> PyTree:
    """fn(keys of `cids`), computed for a power-of-two count of clients (so a store that makes
    initial rows on demand compiles a few programs, not one per count) and cut back. Each
    client's values depend on its own key alone, so they do not depend on the count."""
    n = len(cids)
    size = 1 << max(n - 1, 0).bit_length() if self.store == 'disk' else n
    out = fn(self._client_keys(stream, np.pad(cids, (0, size - n), mode='edge')))
    return out if size == n else jax.tree.map(lambda a: a[:n], out)

  def _init_params_fn(self, g: Group):
    if g.family not in self._init_fns:
      self._init_fns[g.family] = jax.jit(jax.vmap(functools.partial(models.init_params, g.model)))
    return self._init_fns[g.family]

  def _init_client_state(self, cids) -> PyTree:
    return self._init_fn_padded(self._init_client_state_fn, STREAM_CLIENT_STATE,
                                np.asarray(cids))

  def init_state(self) -> RunState:
    """Each client's initial model (`_init_group`), in storage of its own (no aliasing across
    clients, spec §2).

    With the `disk` store, the population is not computed here: a row never written reads as
    its initial value, made from the same key on demand (population.DiskRows)."""
    server_key = jax.random.fold_in(self.root_key, STREAM_SERVER)
    state = {
        'round': 0,
        'server': jax.jit(self.method.init_server)(server_key, self.seen_dev),
        'costs': {'up_floats': 0.0, 'down_floats': 0.0, 'client_flops': 0.0},
    }
    if self.store == 'disk':
      params, client_state = self._disk_tables()
      return {**state, 'params': params, 'client_state': client_state}
    state['params'] = tuple(self._init_group(g, np.arange(g.size)) for g in self.groups)
    state['client_state'] = self._init_client_state(np.arange(self.num_clients))
    if self.store == 'host':
      return {**state, 'params': tuple(population.HostRows(jax.device_get(p))
                                       for p in state['params']),
              'client_state': population.HostRows(jax.device_get(state['client_state']))}
    return self.place(state)

  def _disk_tables(self):
    """The disk store's tables over the files in the workdir, every row at its initial value
    until `restore` or a write: (one per group, the per-client state's)."""
    def table(name, num_rows, init_fn):
      row = jax.eval_shape(lambda: jax.tree.map(lambda a: a[0], init_fn(np.zeros(1, int))))
      return population.DiskRows(os.path.join(self.population_dir, name), row, num_rows,
                                 init_fn)
    return (tuple(table(g.family, g.size, functools.partial(self._init_group, g))
                  for g in self.groups),
            table('client_state', self.num_clients, self._init_client_state))

  # ------------------------------------------------------------------------------------------
  # Training
  # ------------------------------------------------------------------------------------------
  def _make_train_call(self, g: Group):
    method, cfg = self.method, self.train_cfg
    members = jnp.asarray(g.members)
    train_one = functools.partial(client.local_train, apply_fn=g.model.apply, cfg=cfg,
                                  method=method)

    def local_round(params, state, cids, active, server, data_, seen, round_index, root_key):
      """Download, local training and upload of a chunk's clients (a device's share of them
      under a mesh); every output has a leading client axis."""
      down = jax.vmap(method.download, in_axes=(0, 0, None, 0, 0, None))(
          params, state, server, cids, seen[cids], round_index)
      round_key = jax.random.fold_in(jax.random.fold_in(root_key, STREAM_TRAIN), round_index)
      keys = jax.vmap(lambda c: jax.random.fold_in(round_key, c))(cids)
      n = jnp.where(active, data_.train_n[cids], 0)
      trainable, acc, stats = jax.vmap(train_one, in_axes=(0, 0, 0, 0, 0, None))(
          {'model': down.params, **down.aux}, down.ctx, keys, data_.train_idx[cids], n, data_)
      up = jax.vmap(method.upload, in_axes=(0, 0, 0, 0, 0, 0, None))(
          trainable, acc, down.ctx, state, seen[cids], n, round_index)
      stats = {**stats, 'down_floats': down.floats, 'up_floats': up.floats,
               'extra_flops': down.flops + up.flops}
      return up.params, up.state, up.payload, stats

    local_round = self._per_device(local_round, num_sharded=4)

    def train_chunk(params, state, cids, active, server, data_, seen, round_index, root_key):
      new_params, new_state, payload, stats = local_round(
          params, state, cids, active, server, data_, seen, round_index, root_key)
      server = method.server_receive(server, cids, payload, active)
      # Which trained clients hold a NaN or inf in their parameters (the divergence guard).
      stats['nonfinite'] = jnp.stack([
          ~jnp.isfinite(l).reshape(l.shape[0], -1).all(axis=1)
          for l in jax.tree.leaves(new_params) if jnp.issubdtype(l.dtype, jnp.inexact)
      ]).any(axis=0) & active
      # The norms of each trained client's seen-class header rows, after training (a diagnostic
      # of header growth, e.g. FedSSA's `reference` fusion).
      norms = jnp.linalg.norm(jax.vmap(models.header_rows)(new_params), axis=-1)
      own = seen[cids]
      stats['header_norm_max'] = jnp.where(own, norms, 0.0).max(axis=1)
      stats['header_norm_sum'] = jnp.where(own, norms, 0.0).sum(axis=1)
      stats['header_rows'] = own.sum(axis=1)
      return new_params, new_state, server, stats

    if self.store != 'device':
      def call_rows(params, state, server, data_: client.DeviceData, seen, cids, active,
                    round_index, root_key):
        """Trains one chunk whose rows (params, state) the host passed in; returns them."""
        params, state, server, stats = train_chunk(
            params, state, cids, active, server, data_, seen, round_index, root_key)
        return (self._constrain(params, P(CLIENTS)), self._constrain(state, P(CLIENTS)),
                self._constrain(server, P()), stats)
      return jax.jit(call_rows, donate_argnums=(0, 1, 2))

    def call(group_params, client_state, server, data_: client.DeviceData, seen, slots, active,
             round_index, root_key):
      """Trains one chunk. slots [P] index the group (g.rows = dummy), active [P] bool."""
      safe = jnp.minimum(slots, g.size - 1)
      cids = members[safe]
      take = lambda tree, i: jax.tree_util.tree_map(lambda a: a[i], tree)
      params, state = take(group_params, safe), take(client_state, cids)
      new_params, new_state, server, stats = train_chunk(
          params, state, cids, active, server, data_, seen, round_index, root_key)
      # Dummies scatter out of range, so their writes are dropped.
      put = lambda tree, new, dest: jax.tree_util.tree_map(
          lambda a, b: a.at[dest].set(b, mode='drop'), tree, new)
      group_params = put(group_params, new_params, jnp.where(active, slots, g.rows))
      client_state = put(client_state, new_state, jnp.where(active, cids, self.client_rows))
      return (self._constrain(group_params, P(CLIENTS)), self._constrain(client_state, P(CLIENTS)),
              self._constrain(server, P()), stats)

    return jax.jit(call, donate_argnums=(0, 1, 2))

  def cohort_chunks(self, cohort: np.ndarray, per_call: int | None = None):
    """Yields (group index, slots, active) chunks of fixed size per group.

    Within a group, clients are taken in decreasing order of training-set size, so that a
    vmapped chunk holds clients of similar step counts (the chunk runs its largest one's)."""
    for gi, g in enumerate(self.groups):
      cids = cohort[self.group_of[cohort] == gi]
      cids = cids[np.argsort(-self.train_n[cids], kind='stable')]
      slots = self.slot_of[cids]
      p = per_call or g.clients_per_call
      for start in range(0, len(slots), p):
        chunk = slots[start:start + p]
        active = np.arange(p) < len(chunk)
        yield gi, np.pad(chunk, (0, p - len(chunk)), constant_values=g.rows), active

  def run_round(self, state: RunState):
    """One round. Returns (new state, info) with the cohort and per-client training stats."""
    t = state['round']
    tick = self._phase_timer()
    cohort = sample_cohort(self.config.seed, t, self.num_clients, self.k)
    chunks = list(self.cohort_chunks(cohort))
    tick('sample')
    params, client_state, server = list(state['params']), state['client_state'], state['server']
    if self.store == 'device':
      client_state, server, chunk_stats = self.train_on_device(params, client_state, server,
                                                               chunks, t)
    else:
      server, chunk_stats = self._train_from_store(state, chunks, server, t)
    tick('train', [p for p in params if self.store == 'device'], server)
    participants = np.zeros(self.num_clients, bool)
    participants[cohort] = True
    server = self._aggregate(server, jnp.asarray(participants), jnp.asarray(t, jnp.int32))
    tick('aggregate', server)

    # Per-client stats and counts: one host transfer for the whole round.
    per_client = {}
    all_stats = self.fetch([stats for *_, stats in chunk_stats])
    for (gi, slots, active, _), stats in zip(chunk_stats, all_stats):
      cids = self.groups[gi].members[slots[active]]
      for k, v in stats.items():
        per_client.setdefault(k, np.zeros(self.num_clients))[cids] = np.asarray(v)[active]
    c = {k: v[cohort] for k, v in per_client.items()}
    # Samples processed = E * n_k: every sample once per epoch, the last batch partial.
    flops = self.client_flops_per_sample[cohort] * c['samples'] + c['extra_flops']
    up, down = float(c['up_floats'].sum()), float(c['down_floats'].sum())
    new_costs = dict(state['costs'])
    new_costs['up_floats'] += up
    new_costs['down_floats'] += down
    new_costs['client_flops'] += float(flops.sum())
    samples = max(c['samples'].sum(), 1)
    info = {
        'cohort': cohort,
        'up_floats': up, 'down_floats': down, 'client_flops': float(flops.sum()),
        'train_loss': float(c['loss_sum'].sum() / samples),
        'train_accuracy': float(c['correct'].sum() / samples),
        'train_samples': c['samples'],
        'train_loss_sum': c['loss_sum'],
        'train_steps': c['steps'],
        'client_up_floats': c['up_floats'],
        'client_down_floats': c['down_floats'],
        'client_flops_per_client': flops,
        'nonfinite_params': c['nonfinite'].astype(bool),
        # Over the seen-class header rows of this round's clients, after training.
        'header_norm_max': float(c['header_norm_max'].max()),
        'header_norm_mean': float(c['header_norm_sum'].sum() / max(c['header_rows'].sum(), 1)),
    }
    new_state = {'round': t + 1, 'params': tuple(params), 'client_state': client_state,
                 'server': server, 'costs': new_costs}
    tick('host')
    return new_state, info

  def train_on_device(self, params: list, client_state, server, chunks, t: int,
                      masked: bool = False):
    """Trains round `t`'s `chunks` with the device store, updating the list `params` (one group
    each) in place. Returns (client_state, server, [(gi, slots, active, stats) per chunk]).
    `masked` runs the same compiled calls with every client masked, so no step runs: the
    calls' own work (gather, download, upload, scatter), which the benchmark measures."""
    chunk_stats = []
    for gi, slots, active in chunks:
      active_dev = jnp.asarray(np.zeros_like(active) if masked else active)
      params[gi], client_state, server, stats = self._train_calls[gi](
          params[gi], client_state, server, self.data, self.seen_dev,
          jnp.asarray(slots, jnp.int32), active_dev, jnp.asarray(t, jnp.int32), self.root_key)
      chunk_stats.append((gi, slots, active, stats))
    return client_state, server, chunk_stats

  def _train_from_store(self, state: RunState, chunks, server, t: int):
    """Training with the population off the device (`host` or `disk` store): each chunk's rows
    are read from the store and put on the device, trained, and written back. The next chunk is
    read while the device trains this one (calls are dispatched asynchronously), and a chunk is
    written back while the next one trains."""
    tables, client_rows = state['params'], state['client_state']
    t_dev = jnp.asarray(t, jnp.int32)

    def load(gi, slots, active):
      g = self.groups[gi]
      safe = np.minimum(slots, g.size - 1)  # dummies run on a copy of a real row
      cids = g.members[safe]
      rows = self._to_device((tables[gi].read(safe), client_rows.read(cids)))
      return rows, jnp.asarray(cids, jnp.int32), jnp.asarray(active)

    def write_back(gi, slots, active, new_params, new_state):
      new_params, new_state = jax.device_get((new_params, new_state))
      keep = lambda tree: jax.tree.map(lambda a: a[active], tree)
      tables[gi].write(slots[active], keep(new_params))
      client_rows.write(self.groups[gi].members[slots[active]], keep(new_state))

    chunk_stats, pending = [], None
    loaded = load(*chunks[0]) if chunks else None
    for i, (gi, slots, active) in enumerate(chunks):
      (params, cstate), cids, active_dev = loaded
      new_params, new_state, server, stats = self._train_calls[gi](
          params, cstate, server, self.data, self.seen_dev, cids, active_dev, t_dev,
          self.root_key)
      chunk_stats.append((gi, slots, active, stats))
      if pending is not None:
        write_back(*pending)
      loaded = load(*chunks[i + 1]) if i + 1 < len(chunks) else None
      pending = (gi, slots, active, new_params, new_state)
    if pending is not None:
      write_back(*pending)
    return server, chunk_stats

  def _to_device(self, tree):
    """Host rows with a leading client axis, onto the device (sharded along `clients`)."""
    if self.mesh is None:
      return jax.device_put(tree)
    return jax.device_put(tree, NamedSharding(self.mesh, P(CLIENTS)))

  def _phase_timer(self):
    """tick(name, *arrays): adds the time since the last tick to phase `name`, after waiting
    for `arrays`; a no-op unless profiling."""
    last = [time.perf_counter()]

    def tick(name, *arrays):
      if not self.profile:
        return
      jax.block_until_ready(arrays)
      now = time.perf_counter()
      self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + now - last[0]
      last[0] = now
    return tick

  # ------------------------------------------------------------------------------------------
  # Evaluation
  # ------------------------------------------------------------------------------------------
  # Clients per evaluation call when evaluating a subset, or from a host or disk store.
  EVAL_BLOCK = 32

  def _make_eval_call(self, g: Group):
    """Two jitted calls: `rows_call(rows, slots, valid, server, data)` evaluates a block of
    members at `slots` whose parameters `rows` came from a store; `gather_call(group_params,
    slots, valid, server, data)` the same block gathered from the group on the device. Rows
    where `valid` is False (padding) evaluate no test batch."""
    method, cfg = self.method, self.train_cfg
    members = jnp.asarray(g.members)
    per_call = self.config.engine.eval_clients_per_call or (
        1 if jax.default_backend() == 'cpu' else g.rows // self.num_devices)

    # No client has more than max_test samples, so a smaller batch than that gives the same
    # per-batch results with less padding.
    max_test = self.data.test_idx.shape[1]
    eval_batch = min(self.config.eval_batch_size, -(-max_test // 8) * 8)

    def evaluate_rows(group_params, cids, valid, server, data_: client.DeviceData):
      def one(args):
        params, cid, ok = args
        params = method.eval_params(params, server, cid)
        extra = functools.partial(method.eval_extra, server, cid)
        # A padding row has no test sample, so its test loop runs no batch (one row at a time,
        # as on the CPU, it costs nothing).
        return client.evaluate(params, data_.test_idx[cid], jnp.where(ok, data_.test_n[cid], 0),
                               data_, apply_fn=g.eval_model.apply, cfg=cfg,
                               eval_batch_size=eval_batch, extra_fn=extra,
                               extra_names=method.eval_metrics)
      # Inside shard_map, cids holds this device's rows.
      return jax.lax.map(one, (group_params, cids, valid),
                         batch_size=min(per_call, cids.shape[0]))

    evaluate_rows = self._per_device(evaluate_rows, num_sharded=3)
    rows_call = jax.jit(lambda rows, slots, valid, server, data_: evaluate_rows(
        rows, members[slots], valid, server, data_))
    gather_call = jax.jit(lambda group_params, slots, valid, server, data_: evaluate_rows(
        jax.tree.map(lambda a: a[slots], group_params), members[slots], valid, server, data_))
    return rows_call, gather_call

  def _eval_jobs(self, ids: np.ndarray, reuse: bool) -> list[tuple[int, np.ndarray, int]]:
    """Blocks of the clients `ids` to evaluate: (group index, slots padded to the block size by
    repeating the last one, count of real slots). With `reuse`, a group's block size is fixed
    (its training chunk's), so that the first, whole evaluation compiles the calls that later
    evaluations of a few trained clients run; otherwise blocks are as large as the group's
    share of `ids` allows, up to EVAL_BLOCK."""
    jobs = []
    for gi, g in enumerate(self.groups):
      slots = self.slot_of[ids[self.group_of[ids] == gi]]
      if not len(slots):
        continue
      size = round_up(min(g.clients_per_call if reuse else len(slots), self.EVAL_BLOCK),
                      self.num_devices)
      jobs += [(gi, np.pad(slots[i:i + size], (0, max(0, i + size - len(slots))), mode='edge'),
                min(size, len(slots) - i)) for i in range(0, len(slots), size)]
    return jobs

  EVAL_COUNTS = ('correct', 'count', 'batch_acc_sum', 'num_batches')

  def evaluate(self, state: RunState, previous: dict | None = None) -> dict[str, np.ndarray]:
    """Each evaluated client's test results with its current model: per-client arrays of length
    N (NaN for clients outside the `eval_clients` subset), and `evaluated`: the ids of the
    clients the metrics cover (the subset, or every client with test data).

    `previous`, an earlier result of `evaluate` on this run's state at an earlier (or the same)
    round, saves work: unless the method's test results read the server's state
    (`Method.eval_reads_server`), a client's results change only when it trains, so only the
    clients sampled in between (each round's cohort is a function of the seed and the round)
    are evaluated again, and the others' results are copied. The results are the same."""
    names = (*self.EVAL_COUNTS, *self.method.eval_metrics)
    t = int(state['round'])
    reuse = not self.method.eval_reads_server
    if reuse and previous is not None and previous['round'] <= t:
      counts = {k: v.copy() for k, v in previous['counts'].items()}
      trained = [sample_cohort(self.config.seed, r, self.num_clients, self.k)
                 for r in range(previous['round'], t)]
      ids = np.intersect1d(self.evaluated_ids, np.concatenate([np.zeros(0, int), *trained]))
    else:
      counts = {k: np.full(self.num_clients, np.nan) for k in names}
      ids = self.evaluated_ids
    tick = self._phase_timer()
    for g, slots, r in self._evaluate_blocks(state, self._eval_jobs(ids, reuse)):
      for k, v in self.fetch(r).items():
        counts[k][g.members[slots]] = v[:len(slots)]
    tick('evaluate')
    out = {k: v.copy() for k, v in counts.items()}
    out['round'], out['counts'], out['reevaluated'] = t, counts, len(ids)
    out['evaluated'] = self.evaluated_ids.copy()
    out['accuracy'] = out['correct'] / np.maximum(out['count'], 1)
    out['batch_accuracy'] = out['batch_acc_sum'] / np.maximum(out['num_batches'], 1)
    for name in self.method.eval_metrics:  # extra metrics, as accuracies
      out[name] = out[name] / np.maximum(out['count'], 1)
    out['classifier_accuracy'] = out['accuracy']
    if self.method.headline_metric != 'accuracy':  # e.g. FedProto's nearest prototype
      out['accuracy'] = out[self.method.headline_metric]
    return out

  def _evaluate_blocks(self, state: RunState, jobs):
    """Evaluates `jobs` (`_eval_jobs`), a block of clients per call: gathered on the device
    (device store), or read from the store (the next block is read while the device evaluates
    this one)."""
    server = state['server']

    def load(gi, slots, n):
      del n
      if self.store == 'device':
        return state['params'][gi]
      return self._to_device(state['params'][gi].read(slots))

    results, loaded = [], load(*jobs[0]) if jobs else None
    for i, (gi, slots, n) in enumerate(jobs):
      rows_call, gather_call = self._eval_calls[gi]
      call = gather_call if self.store == 'device' else rows_call
      r = call(loaded, jnp.asarray(slots, jnp.int32), jnp.asarray(np.arange(len(slots)) < n),
               server, self.data)
      loaded = load(*jobs[i + 1]) if i + 1 < len(jobs) else None
      results.append((self.groups[gi], slots[:n], r))
    return results
