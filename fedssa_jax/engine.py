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

The run state is a plain dict of arrays (`RunState`), ready to checkpoint. Checkpoints hold it
without the padding rows (`Simulator.unpadded`, `Simulator.place`), so a run may resume on
another number of devices.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from fedssa_jax import client, config_lib, costs, data, distributed, methods, models

PyTree = Any
# {'round': int, 'params': tuple per group, 'client_state': pytree over all N clients,
#  'server': pytree, 'costs': dict}
RunState = dict

# Independent random streams, all derived from the config's seed.
STREAM_INIT, STREAM_SAMPLE, STREAM_TRAIN, STREAM_SERVER, STREAM_CLIENT_STATE = range(5)

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

  @property
  def size(self) -> int:
    return len(self.members)


def cohort_size(num_clients: int, participation: float) -> int:
  return max(1, int(np.floor(participation * num_clients)))


def sample_cohort(seed: int, round_index: int, num_clients: int, k: int) -> np.ndarray:
  """The round's participants, sorted; a pure function of (seed, round)."""
  rng = np.random.default_rng([seed, STREAM_SAMPLE, round_index])
  return np.sort(rng.choice(num_clients, size=k, replace=False))


def train_config(config, ds: data.Dataset) -> client.TrainConfig:
  o = config.optimizer
  return client.TrainConfig(
      batch_size=config.batch_size, local_epochs=config.local_epochs, optimizer=o.name,
      lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, clip_norm=o.clip_norm,
      adam_b1=o.adam_b1, adam_b2=o.adam_b2, micro_batch=micro_batch(config),
      augment=config.augment, mean=tuple(ds.mean), std=tuple(ds.std))


def micro_batch(config) -> int:
  """engine.micro_batch, or by backend: 64-row passes on the CPU (as fast per sample as whole
  batches there), whole batches on accelerators."""
  if config.engine.micro_batch:
    return config.engine.micro_batch
  b = config.batch_size
  return 64 if jax.default_backend() == 'cpu' and b > 64 and b % 64 == 0 else b


class Simulator:
  """Holds the static parts of a run (data, groups, compiled steps); state is passed in/out."""

  def __init__(self, config, ds: data.Dataset, cd: data.ClientData, profile: bool = False):
    self.config = config
    # Profiling blocks on each phase's results to time it (`phase_seconds`, summed over
    # rounds); off by default, since the syncs cost overlap.
    self.profile = profile
    self.phase_seconds: dict[str, float] = {}
    self.num_clients = cd.num_clients
    self.num_classes = ds.num_classes
    self.k = cohort_size(self.num_clients, config.participation)
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
      model = models.make_model(fam, ds.num_classes, config.model.conv_impl)
      self.groups.append(Group(fam, members, model, per_call,
                               round_up(len(members), self.num_devices)))
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
    """A state without padding rows (fresh, or as a checkpoint holds it), padded and placed on
    the mesh: client axes sharded, the server replicated. Without a mesh, `state` itself."""
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
    """The state without padding rows, on the host under a mesh: what a checkpoint holds,
    whatever the device count. Without a mesh, `state` itself."""
    if self.mesh is None:
      return state
    host = self.fetch(state)
    return {**host,
            'params': tuple(jax.tree.map(lambda a: a[:g.size], p)
                            for g, p in zip(self.groups, host['params'])),
            'client_state': jax.tree.map(lambda a: a[:self.num_clients], host['client_state'])}

  # ------------------------------------------------------------------------------------------
  # State
  # ------------------------------------------------------------------------------------------
  def _client_keys(self, stream: int, client_ids) -> jax.Array:
    stream_key = jax.random.fold_in(self.root_key, stream)
    return jax.vmap(lambda c: jax.random.fold_in(stream_key, c))(jnp.asarray(client_ids))

  def init_state(self) -> RunState:
    """Each client's model from its own key (no aliasing across clients, spec §2)."""
    params = []
    for g in self.groups:
      keys = self._client_keys(STREAM_INIT, g.members)
      params.append(jax.jit(jax.vmap(functools.partial(models.init_params, g.model)))(keys))
    client_state = jax.jit(jax.vmap(self.method.init_client_state))(
        self._client_keys(STREAM_CLIENT_STATE, np.arange(self.num_clients)))
    server_key = jax.random.fold_in(self.root_key, STREAM_SERVER)
    return self.place({
        'round': 0,
        'params': tuple(params),
        'client_state': client_state,
        'server': jax.jit(self.method.init_server)(server_key, self.seen_dev),
        'costs': {'up_floats': 0.0, 'down_floats': 0.0, 'client_flops': 0.0},
    })

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

    def call(group_params, client_state, server, data_: client.DeviceData, seen, slots, active,
             round_index, root_key):
      """Trains one chunk. slots [P] index the group (g.rows = dummy), active [P] bool."""
      safe = jnp.minimum(slots, g.size - 1)
      cids = members[safe]
      take = lambda tree, i: jax.tree_util.tree_map(lambda a: a[i], tree)
      params, state = take(group_params, safe), take(client_state, cids)
      new_params, new_state, payload, stats = local_round(
          params, state, cids, active, server, data_, seen, round_index, root_key)
      server = method.server_receive(server, cids, payload, active)
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
    chunk_stats = []
    for gi, slots, active in chunks:
      params[gi], client_state, server, stats = self._train_calls[gi](
          params[gi], client_state, server, self.data, self.seen_dev,
          jnp.asarray(slots, jnp.int32), jnp.asarray(active), jnp.asarray(t, jnp.int32),
          self.root_key)
      chunk_stats.append((gi, slots, active, stats))
    tick('train', params, server)
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
    }
    new_state = {'round': t + 1, 'params': tuple(params), 'client_state': client_state,
                 'server': server, 'costs': new_costs}
    tick('host')
    return new_state, info

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
  def _make_eval_call(self, g: Group):
    method, cfg = self.method, self.train_cfg
    # Padding rows are evaluated as the group's last member; their results are dropped.
    members = jnp.asarray(np.pad(g.members, (0, g.rows - g.size), mode='edge'))
    per_device = g.rows // self.num_devices
    per_call = self.config.engine.eval_clients_per_call or (
        1 if jax.default_backend() == 'cpu' else per_device)

    # No client has more than max_test samples, so a smaller batch than that gives the same
    # per-batch results with less padding.
    max_test = self.data.test_idx.shape[1]
    eval_batch = min(self.config.eval_batch_size, -(-max_test // 8) * 8)

    def evaluate_rows(group_params, cids, server, data_: client.DeviceData):
      def one(args):
        params, cid = args
        params = method.eval_params(params, server, cid)
        extra = functools.partial(method.eval_extra, server, cid)
        return client.evaluate(params, data_.test_idx[cid], data_.test_n[cid], data_,
                               apply_fn=g.model.apply, cfg=cfg, eval_batch_size=eval_batch,
                               extra_fn=extra, extra_names=method.eval_metrics)
      return jax.lax.map(one, (group_params, cids), batch_size=min(per_call, per_device))

    evaluate_rows = self._per_device(evaluate_rows, num_sharded=2)
    return jax.jit(lambda group_params, server, data_: evaluate_rows(
        group_params, members, server, data_))

  def evaluate(self, state: RunState) -> dict[str, np.ndarray]:
    """Every client's test results with its current model: per-client arrays of length N."""
    out = {k: np.zeros(self.num_clients) for k in
           ('correct', 'count', 'batch_acc_sum', 'num_batches', *self.method.eval_metrics)}
    tick = self._phase_timer()
    results = [(g, call(p, state['server'], self.data))
               for g, call, p in zip(self.groups, self._eval_calls, state['params'])]
    for g, r in results:
      for k, v in self.fetch(r).items():
        out[k][g.members] = v[:g.size]
    tick('evaluate')
    out['accuracy'] = out['correct'] / np.maximum(out['count'], 1)
    out['batch_accuracy'] = out['batch_acc_sum'] / np.maximum(out['num_batches'], 1)
    for name in self.method.eval_metrics:  # extra metrics, as accuracies
      out[name] = out[name] / np.maximum(out['count'], 1)
    out['classifier_accuracy'] = out['accuracy']
    if self.method.headline_metric != 'accuracy':  # e.g. FedProto's nearest prototype
      out['accuracy'] = out[self.method.headline_metric]
    return out
