"""The round engine: family groups, cohort sampling, vmapped local training, the server.

Clients that share a model family form a group; a group's parameters are one pytree whose leaves
have a leading axis over the group's members. A round (`Simulator.run_round`):

1. samples the cohort on the host (K = max(1, floor(C N)) clients, uniform without replacement,
   a pure function of the seed and the round);
2. for each group, splits its sampled members into chunks of a fixed size `clients_per_call`
   (padded with masked dummy clients), and trains each chunk in one jitted call
   (`train_chunk`, `local_round`): the method's download, local training of every client under
   `vmap` with the method's loss, the upload, and the server's receipt of the uploads. The population store
   (population.py) brings the chunk's rows to the call and takes them back;
3. runs the method's server rule once, under jit;
4. adds up the round's floats, FLOPs and training statistics (`RoundInfo`).

Shapes never depend on the round, so each family compiles its training call once. Dummy clients
train on zero samples (every step is a no-op), and their scatter and upload are dropped, so they
change nothing. Devices and processes: placement.py. Evaluation: evaluation.py.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedssa_jax import client, config_lib, costs, data, evaluation, methods, models, population
from fedssa_jax.placement import Placement
from fedssa_jax.state import RoundInfo, RunState

PyTree = Any

# Independent random streams, all derived from the config's seed. STREAM_INIT draws a client's
# own initial model (model.init_scope='client', keyed by client id); STREAM_FAMILY_INIT a
# family's shared one ('family', keyed by the family's index in models.FAMILY_NAMES).
(STREAM_INIT, STREAM_SAMPLE, STREAM_TRAIN, STREAM_SERVER, STREAM_CLIENT_STATE, STREAM_EVAL,
 STREAM_FAMILY_INIT) = range(7)
# The server's key of each round's aggregation (aggregate_key).
STREAM_AGGREGATE = 7


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


def eval_subset(seed: int, test_n: np.ndarray, eval_clients: int) -> np.ndarray | None:
  """The fixed random subset of `eval_clients` clients evaluated every time (sorted ids),
  drawn among the clients with test data; None: evaluate them all."""
  candidates = np.flatnonzero(test_n > 0)
  if not eval_clients or eval_clients >= len(candidates):
    return None
  rng = np.random.default_rng([seed, STREAM_EVAL])
  return np.sort(rng.choice(candidates, size=eval_clients, replace=False))


def aggregate_key(root_key: jax.Array, round_index) -> jax.Array:
  """The key Method.server_aggregate gets in round t: fold_in(fold_in(root, STREAM_AGGREGATE),
  t)."""
  return jax.random.fold_in(jax.random.fold_in(root_key, STREAM_AGGREGATE), round_index)


@jax.jit
def _client_keys(root_key: jax.Array, stream, client_ids: jax.Array) -> jax.Array:
  """Each client's key of a random stream: fold_in(fold_in(root, stream), client id)."""
  stream_key = jax.random.fold_in(root_key, stream)
  return jax.vmap(lambda c: jax.random.fold_in(stream_key, c))(client_ids)


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


def make_groups(config, num_classes: int, num_clients: int, k: int,
                place: Placement) -> list[Group]:
  """The family groups (client i gets families[i mod F])."""
  families = tuple(config.model.families)
  client_family = np.array([i % len(families) for i in range(num_clients)])
  groups = []
  for gi, fam in enumerate(families):
    members = np.flatnonzero(client_family == gi)
    if not len(members):
      continue
    # Auto: one client per call on the CPU, where vmapping over clients gains nothing; on
    # accelerators, the group's expected share of the cohort, so that a typical round needs
    # one call per family and few dummies. A family sampled more often takes more calls.
    per_call = config.engine.clients_per_call or (
        1 if jax.default_backend() == 'cpu' else -(-k // len(families)))
    # Every device trains as many of a chunk's clients (padded with dummies).
    per_call = place.rows(int(min(per_call, len(members), k)))
    model, eval_model = (models.make_model(fam, num_classes, config.model.conv_impl,
                                           config.engine.compute_dtype, forward_only=fwd)
                         for fwd in (False, True))
    groups.append(Group(fam, members, model, per_call, place.rows(len(members)), eval_model))
  return groups


def local_round(params, state, cids, active, server, data_: client.DeviceData, seen,
                round_index, root_key, *, method: methods.Method, train_one: Callable):
  """Download, local training and upload of a chunk's clients (a device's share of them under a
  mesh), vmapped over the clients; every output has a leading client axis. `train_one` is
  client.local_train for the family's model."""
  n = jnp.where(active, data_.train_n[cids], 0)
  # Each client's view; the round is the same for all (unbatched: in_axes None).
  view = methods.ClientView(id=cids, seen=seen[cids], num_samples=n, round=round_index)
  view_axes = methods.ClientView(id=0, seen=0, num_samples=0, round=None)
  down = jax.vmap(method.download, in_axes=(0, 0, None, view_axes))(params, state, server, view)
  round_key = jax.random.fold_in(jax.random.fold_in(root_key, STREAM_TRAIN), round_index)
  keys = jax.vmap(lambda c: jax.random.fold_in(round_key, c))(cids)
  trainable, acc, stats = jax.vmap(train_one, in_axes=(0, 0, 0, 0, 0, None))(
      {'model': down.params, **down.aux}, down.ctx, keys, data_.train_idx[cids], n, data_)
  up = jax.vmap(method.upload, in_axes=(0, 0, 0, 0, view_axes))(
      trainable, acc, down.ctx, state, view)
  stats = {**stats, 'down_floats': down.floats, 'up_floats': up.floats,
           'extra_flops': down.flops + up.flops}
  return up.params, up.state, up.payload, stats


def train_chunk(params, state, cids, active, server, data_, seen, round_index, root_key, *,
                method: methods.Method, local: Callable):
  """One chunk of a group, on its rows: `local` (local_round, per device under a mesh), then
  the server's receipt of the uploads, and the chunk's statistics. Returns (params, state,
  server, stats); the store's call brings the rows and takes them back."""
  new_params, new_state, payload, stats = local(
      params, state, cids, active, server, data_, seen, round_index, root_key)
  server = method.server_receive(server, cids, payload, active)
  # Which trained clients hold a NaN or inf in their parameters (the divergence guard).
  stats['nonfinite'] = jnp.stack([
      ~jnp.isfinite(l).reshape(l.shape[0], -1).all(axis=1)
      for l in jax.tree.leaves(new_params) if jnp.issubdtype(l.dtype, jnp.inexact)
  ]).any(axis=0) & active
  # The norms of each trained client's seen-class header rows, after training (a diagnostic of
  # header growth, e.g. FedSSA's `reference` fusion).
  norms = jnp.linalg.norm(jax.vmap(models.header_rows)(new_params), axis=-1)
  own = seen[cids]
  stats['header_norm_max'] = jnp.where(own, norms, 0.0).max(axis=1)
  stats['header_norm_sum'] = jnp.where(own, norms, 0.0).sum(axis=1)
  stats['header_rows'] = own.sum(axis=1)
  return new_params, new_state, server, stats


class Simulator:
  """Holds the static parts of a run (data, groups, compiled steps); the state is passed in
  and out. `phase(name, *arrays)`, if given, is called after each phase of a round (a
  benchmark's timer; bench.py)."""

  def __init__(self, config, ds: data.Dataset, cd: data.ClientData,
               workdir: str | None = None, phase: Callable | None = None):
    self.config = config
    self.phase = phase or (lambda name, *arrays: None)
    self.num_clients = cd.num_clients
    self.num_classes = ds.num_classes
    self.k = cohort_size(self.num_clients, config.participation)
    self.seen, self.train_n = cd.seen, cd.train_n
    self.method = methods.get_method(config.method)(config, self.num_clients, ds.num_classes)
    self.train_cfg = train_config(config, ds)
    self.root_key = jax.random.PRNGKey(config.seed)
    self.placement = Placement(config.engine.mesh_devices)
    self.data = self.placement.replicate(client.DeviceData(
        images=jnp.asarray(ds.images), labels=jnp.asarray(ds.labels),
        train_idx=jnp.asarray(cd.train_idx), train_n=jnp.asarray(cd.train_n),
        test_idx=jnp.asarray(cd.test_idx), test_n=jnp.asarray(cd.test_n)))
    self.seen_dev = self.placement.replicate(jnp.asarray(cd.seen))

    self.groups = make_groups(config, ds.num_classes, self.num_clients, self.k, self.placement)
    # client id -> (group index, slot within the group)
    self.group_of = np.empty(self.num_clients, int)
    self.slot_of = np.empty(self.num_clients, int)
    for gi, g in enumerate(self.groups):
      self.group_of[g.members] = gi
      self.slot_of[g.members] = np.arange(g.size)

    # Training FLOPs per processed sample: the family's own model, plus what the method adds
    # (e.g. a jointly trained CNN-5).
    self.flops_per_sample = {g.family: self.method.train_flops_per_sample(
        self.model_flops(g.family), self.model_flops) for g in self.groups}
    self.client_flops_per_sample = np.array(
        [self.flops_per_sample[self.groups[g].family] for g in self.group_of])

    self._init_client_state_fn = jax.jit(jax.vmap(self.method.init_client_state))
    self.store = population.make_store(
        config.population_store, self.placement, self.groups, self.num_clients,
        self._init_group, self._init_client_state,
        directory=workdir and os.path.join(os.path.abspath(workdir), 'population'))
    self._train_calls = [self.store.train_call(g, self._train_chunk_fn(g)) for g in self.groups]
    # (server, participants, round, root key) -> methods.Aggregated, with the round's key.
    self._aggregate = jax.jit(lambda server, participants, t, root_key: self.placement.constrain(
        self.method.server_aggregate(server, participants, t, aggregate_key(root_key, t)),
        sharded=False), donate_argnums=0)
    # Replicated on the mesh, as every later round's server is (an init_server that ignores
    # its inputs would otherwise leave it on one device, and round 1 would compile again).
    self._init_server = jax.jit(lambda key, seen: self.placement.constrain(
        self.method.init_server(key, seen), sharded=False))
    eval_ids = eval_subset(config.seed, cd.test_n, config.eval_clients)
    # The clients whose accuracy every evaluation reports (those with test data, or the subset).
    self.evaluated_ids = np.flatnonzero(cd.test_n > 0) if eval_ids is None else eval_ids
    self.evaluator = evaluation.Evaluator(self, self.evaluated_ids)

  # ------------------------------------------------------------------------------------------
  # The round
  # ------------------------------------------------------------------------------------------
  def run_round(self, state: RunState) -> tuple[RunState, RoundInfo]:
    """One round: sample, train the cohort chunk by chunk, aggregate, account."""
    t = state.round
    cohort = self.cohort(t)
    chunks = self.chunks(cohort)
    self.phase('sample')
    params = list(state.params)
    client_state, server, chunk_stats = self.train_chunks(params, state.client_state,
                                                          state.server, chunks, t)
    self.phase('train', params, server)
    participants = np.zeros(self.num_clients, bool)
    participants[cohort] = True
    agg = self._aggregate(server, jnp.asarray(participants), jnp.asarray(t, jnp.int32),
                          self.root_key)
    server = agg.server
    self.phase('aggregate', server)
    info = self._round_info(cohort, chunk_stats, agg.flops, agg.metrics)
    new_costs = dict(state.costs)
    new_costs['up_floats'] += info.up_floats
    new_costs['down_floats'] += info.down_floats
    new_costs['client_flops'] += info.client_flops
    self.phase('host')
    return RunState(round=t + 1, params=tuple(params), client_state=client_state,
                    server=server, costs=new_costs), info

  def cohort(self, t: int) -> np.ndarray:
    return sample_cohort(self.config.seed, t, self.num_clients, self.k)

  def chunks(self, cohort: np.ndarray, per_call: int | None = None) -> list:
    """[(group index, slots, active)]: each group's sampled members in chunks of its
    `clients_per_call` (or `per_call`), the last padded with dummy slots (`g.rows`).

    Within a group, clients are taken in decreasing order of training-set size, so that a
    vmapped chunk holds clients of similar step counts (the chunk runs its largest one's)."""
    out = []
    for gi, g in enumerate(self.groups):
      cids = cohort[self.group_of[cohort] == gi]
      cids = cids[np.argsort(-self.train_n[cids], kind='stable')]
      slots = self.slot_of[cids]
      p = per_call or g.clients_per_call
      for start in range(0, len(slots), p):
        chunk = slots[start:start + p]
        active = np.arange(p) < len(chunk)
        out.append((gi, np.pad(chunk, (0, p - len(chunk)), constant_values=g.rows), active))
    return out

  def train_chunks(self, params: list, client_state, server, chunks, t: int):
    """Trains round `t`'s `chunks`, updating the list `params` (one entry per group) in place.
    Returns (client_state, server, [(group index, slots, active, stats) per chunk])."""
    consts = (self.data, self.seen_dev, jnp.asarray(t, jnp.int32), self.root_key)
    return self.store.train(params, client_state, server, chunks, self._train_calls, consts)

  def _train_chunk_fn(self, g: Group) -> Callable:
    """`train_chunk` for the group's model."""
    train_one = functools.partial(client.local_train, apply_fn=g.model.apply,
                                  cfg=self.train_cfg, method=self.method)
    local = functools.partial(local_round, method=self.method, train_one=train_one)
    return functools.partial(train_chunk, method=self.method,
                             local=self.placement.per_device(local, num_sharded=4))

  def _round_info(self, cohort: np.ndarray, chunk_stats, server_flops,
                  server_metrics: dict) -> RoundInfo:
    """The round's per-client stats and counts, and the server's FLOPs and diagnostics
    (methods.Aggregated): one host transfer for the whole round."""
    per_client = {}
    all_stats, (server_flops, server_metrics) = self.fetch(
        ([stats for *_, stats in chunk_stats], (server_flops, server_metrics)))
    for (gi, slots, active, _), stats in zip(chunk_stats, all_stats):
      cids = self.groups[gi].members[slots[active]]
      for k, v in stats.items():
        per_client.setdefault(k, np.zeros(self.num_clients))[cids] = np.asarray(v)[active]
    c = {k: v[cohort] for k, v in per_client.items()}
    # Samples processed = E * n_k: every sample once per epoch, the last batch partial.
    flops = self.client_flops_per_sample[cohort] * c['samples'] + c['extra_flops']
    samples = max(c['samples'].sum(), 1)
    return RoundInfo(
        cohort=cohort,
        up_floats=float(c['up_floats'].sum()), down_floats=float(c['down_floats'].sum()),
        client_flops=float(flops.sum()),
        train_loss=float(c['loss_sum'].sum() / samples),
        train_accuracy=float(c['correct'].sum() / samples),
        train_samples=c['samples'], train_loss_sum=c['loss_sum'], train_steps=c['steps'],
        client_up_floats=c['up_floats'], client_down_floats=c['down_floats'],
        client_flops_per_client=flops,
        nonfinite_params=c['nonfinite'].astype(bool),
        header_norm_max=float(c['header_norm_max'].max()),
        header_norm_mean=float(c['header_norm_sum'].sum() / max(c['header_rows'].sum(), 1)),
        server_flops=float(server_flops),
        server_metrics={k: float(v) for k, v in server_metrics.items()})

  # ------------------------------------------------------------------------------------------
  # Evaluation (evaluation.py)
  # ------------------------------------------------------------------------------------------
  def evaluate(self, state: RunState,
               previous: evaluation.Evaluation | None = None) -> evaluation.Evaluation:
    return self.evaluator.evaluate(state, previous)

  def save_representations(self, state: RunState, workdir: str) -> str:
    return self.evaluator.save_representations(state, workdir)

  # ------------------------------------------------------------------------------------------
  # State and checkpoints
  # ------------------------------------------------------------------------------------------
  def init_state(self, fresh: bool = True) -> RunState:
    """Round 0: the server's initial state and each client's initial model (`_init_group`),
    in storage of its own (no aliasing across clients, spec §2). `fresh`: no checkpoint will be
    restored (population.Store.initial)."""
    server_key = jax.random.fold_in(self.root_key, STREAM_SERVER)
    params, client_state = self.store.initial(fresh)
    return RunState(round=0, params=params, client_state=client_state,
                    server=self._init_server(server_key, self.seen_dev),
                    costs={'up_floats': 0.0, 'down_floats': 0.0, 'client_flops': 0.0})

  def saved(self, state: RunState) -> dict:
    """What a checkpoint holds of `state`, whatever the device count and store: host arrays
    without padding rows (the disk store's slot maps), as a dict."""
    params, client_state = self.store.saved(state.params, state.client_state)
    return state.replace(params=params, client_state=client_state,
                         server=self.placement.unshard(state.server)).to_saved()

  def live(self, saved: dict) -> RunState:
    """A checkpoint's state (`saved`) made live: in the store, on the devices."""
    state = RunState.from_saved(saved)
    params, client_state = self.store.live(state.params, state.client_state)
    return state.replace(params=params, client_state=client_state,
                         server=self.placement.reshard_replicated(state.server))

  def before_checkpoint(self, state: RunState) -> dict:
    """The store's bookkeeping, then what the checkpoint of `state` holds (`saved`)."""
    self.store.before_checkpoint(state.params, state.client_state, state.round)
    return self.saved(state)

  def after_checkpoint(self, state: RunState, kept_steps: list[int]) -> None:
    self.store.after_checkpoint(state.params, state.client_state, kept_steps)

  def fetch(self, tree):
    return self.placement.fetch(tree)

  def model_flops(self, family: str) -> float:
    """FLOPs of one CE training step of `family`'s model, per sample (XLA's count)."""
    return model_flops(family, self.num_classes, self.config.batch_size)

  def _init_group(self, g: Group, slots) -> PyTree:
    """The initial parameters of the group's members at `slots` (stacked): each one's own draw,
    or (init_scope 'family') copies of the family's one model, the same in every method."""
    slots = np.asarray(slots)
    if self.config.model.init_scope == 'family':
      family_ids = np.full(len(slots), models.FAMILY_NAMES.index(g.family))
      return _stacked_init(g.model)(_client_keys(self.root_key, STREAM_FAMILY_INIT,
                                                 jnp.asarray(family_ids)))
    return _stacked_init(g.model)(_client_keys(self.root_key, STREAM_INIT,
                                               jnp.asarray(g.members[slots])))

  def _init_client_state(self, cids) -> PyTree:
    return self._init_client_state_fn(_client_keys(self.root_key, STREAM_CLIENT_STATE,
                                                   jnp.asarray(np.asarray(cids))))


@functools.lru_cache(maxsize=None)
def _stacked_init(model) -> Callable:
  """The jitted initialiser of `model`'s parameters for a stack of keys: one per model (equal
  modules are equal keys), so every Simulator of a process shares its traces and programs."""
  return jax.jit(jax.vmap(functools.partial(models.init_params, model)))


@functools.lru_cache(maxsize=None)
def model_flops(family: str, num_classes: int, batch_size: int) -> float:
  """FLOPs of one CE training step of `family`'s model, per sample (XLA's count)."""
  xla = costs.xla_train_flops_per_sample(family, num_classes, batch_size)
  analytic = costs.analytic_train_flops_per_sample(family, num_classes)
  if not 0.9 < xla / analytic < 1.15:
    logging.warning('FLOPs of %s: XLA counts %.4g per sample, the analytic count %.4g.',
                    family, xla, analytic)
  return xla


# ----------------------------------------------------------------------------------------------
# Replicas: R runs of one config that differ only in their seed, in the same compiled calls
# ----------------------------------------------------------------------------------------------

def _without_seed(config) -> dict:
  d = config.to_dict()
  d.pop('seed')
  return d


def check_packable(config) -> None:
  """Raises ConfigError, naming the fix, if seeds of `config` cannot run packed (Replicas)."""
  if config.population_store != 'device':
    raise config_lib.ConfigError(
        f"Packed seeds (--seeds) need population_store='device', not "
        f'{config.population_store!r}: drop --config.population_store, or run the seeds one by '
        'one (one command per seed, without --seeds).')


class Replicas:
  """R runs of one config that differ only in `seed`, trained in the same compiled calls.

  Each replica has its own Simulator (its seed's keys, cohorts and partition, its evaluation and
  checkpoints); this class runs their rounds together. Their states are kept stacked between
  rounds (`stack`: every leaf of params, client_state and server with a leading replica axis;
  `replica(state, r)` is replica r's own RunState). In a round, each replica samples its cohort
  and cuts it into chunks as it would alone; the chunk lists are aligned group by group, padding
  a replica that has fewer chunks of a group with all-inactive chunks (which change nothing), and
  chunk j of a group is ONE jitted call: the device store's chunk call vmapped over the replica
  axis (R x clients_per_call clients), each replica with its own rows, server, seen-class masks,
  training indices and root key, the images shared. The server rule is vmapped the same way, so
  each replica aggregates only its own uploads. Only the device store.

  Under a `clients` mesh (placement.py), the stacked arrays keep each replica's client axis
  sharded as a run alone has it (P(None, 'clients'): the replica axis is not sharded), and a
  chunk's clients of every replica train under the same shard_map: each device trains its share
  of every replica's chunk, as it would of one run's.
  """

  def __init__(self, sims: list[Simulator]):
    if not sims:
      raise ValueError('Replicas needs at least one Simulator.')
    self.sims = sims
    s0 = sims[0]
    c0 = s0.config
    check_packable(c0)
    seeds = [s.config.seed for s in sims]
    if len(set(seeds)) != len(seeds):
      raise config_lib.ConfigError(f'Packed seeds must differ, got {seeds}.')
    for s in sims[1:]:
      if _without_seed(s.config) != _without_seed(c0):
        raise config_lib.ConfigError(
            'Packed runs must differ only in their seed; these configs differ in other fields.')
      if [(g.family, tuple(g.members), g.clients_per_call, g.rows) for g in s.groups] != [
          (g.family, tuple(g.members), g.clients_per_call, g.rows) for g in s0.groups]:
        raise config_lib.ConfigError('Packed runs must have the same family groups.')
    self.num = len(sims)
    self.groups = s0.groups
    # The replicas' own partitions (partition.seed = -1: each its seed's), their training
    # index rows padded to a common width. local_train's shuffles stay those of each alone:
    # client.epoch_order draws uniform numbers over the padded length, and with
    # jax_threefry_partitionable (the default since JAX 0.5) the first n of a longer draw are
    # the same numbers (tests/replicas_test.py checks it).
    widths = [int(s.data.train_idx.shape[1]) for s in sims]
    width = max(widths)
    if len(set(widths)) > 1 and not jax.config.jax_threefry_partitionable:
      raise config_lib.ConfigError(
          'Packed seeds with per-seed partitions need jax_threefry_partitionable (JAX\'s '
          'default since 0.5): set JAX_THREEFRY_PARTITIONABLE=1, or fix partition.seed.')
    place = self.placement = s0.placement
    stack = lambda arrays: place.replicate(jnp.asarray(np.stack(place.fetch(arrays))))
    pad = lambda a: np.pad(a, ((0, 0), (0, width - a.shape[1])))
    for s in sims[1:]:  # one copy of the images on the device
      s.data = dataclasses.replace(s.data, images=s0.data.images, labels=s0.data.labels)
    # Evaluation does not come through here (each replica evaluates with its own Simulator):
    # test_idx and test_n are replica 0's, unused by training.
    self.data = dataclasses.replace(
        s0.data, train_idx=stack([pad(s.fetch(s.data.train_idx)) for s in sims]),
        train_n=stack([s.data.train_n for s in sims]))
    data_axes = client.DeviceData(images=None, labels=None, train_idx=0, train_n=0,
                                  test_idx=None, test_n=None)
    self.seen = stack([s.seen_dev for s in sims])
    self.root_keys = stack([s.root_key for s in sims])
    self._train_calls = [s0.store.packed_train_call(g, s0._train_chunk_fn(g), data_axes)
                         for g in self.groups]
    # Each replica's server rule with its own round key (from its own root key).
    self._aggregate = jax.jit(lambda server, participants, t, root_keys: place.constrain(
        jax.vmap(lambda s, p, k: s0.method.server_aggregate(s, p, t, aggregate_key(k, t)))(
            server, participants, root_keys), sharded=False), donate_argnums=0)
    # Stacking the replicas' trees, and slicing one out, placed as above.
    self._stack = jax.jit(lambda trees, sharded: place.constrain(
        jax.tree.map(lambda *a: jnp.stack(a), *trees), sharded, stacked=True), static_argnums=1)
    self._slice = jax.jit(lambda tree, r, sharded: place.constrain(
        jax.tree.map(lambda a: a[r], tree), sharded), static_argnums=2)

  # --- the stacked state ---------------------------------------------------------------------
  def stack(self, states: list[RunState]) -> RunState:
    """The replicas' states as one: arrays with a leading replica axis (costs: one dict per
    replica). They must be at the same round."""
    rounds = {int(s.round) for s in states}
    if len(rounds) != 1:
      raise ValueError(f'Replicas at different rounds: {[int(s.round) for s in states]}.')
    return RunState(round=states[0].round,
                    params=tuple(self._stack([s.params[gi] for s in states], True)
                                 for gi in range(len(self.groups))),
                    client_state=self._stack([s.client_state for s in states], True),
                    server=self._stack([s.server for s in states], False),
                    costs=tuple(dict(s.costs) for s in states))

  def replica(self, state: RunState, r: int) -> RunState:
    """Replica r's own RunState, out of the stacked one (its arrays sliced)."""
    i = jnp.asarray(r, jnp.int32)
    return RunState(round=state.round, params=tuple(self._slice(p, i, True) for p in state.params),
                    client_state=self._slice(state.client_state, i, True),
                    server=self._slice(state.server, i, False), costs=dict(state.costs[r]))

  # --- the round -----------------------------------------------------------------------------
  def aligned_chunks(self, chunk_lists: list[list]) -> list:
    """[(group index, slots [R, P], active [R, P])]: chunk j of each group over the replicas,
    a replica with fewer chunks of the group padded with all-inactive ones. Each replica's
    chunks keep their order (that of its run alone)."""
    out = []
    for gi, g in enumerate(self.groups):
      per = [[c for c in chunks if c[0] == gi] for chunks in chunk_lists]
      p = g.clients_per_call
      idle = (gi, np.full(p, g.rows), np.zeros(p, bool))
      for j in range(max(len(c) for c in per)):
        cs = [c[j] if j < len(c) else idle for c in per]
        out.append((gi, np.stack([c[1] for c in cs]), np.stack([c[2] for c in cs])))
    return out

  def run_round(self, state: RunState) -> tuple[RunState, list[RoundInfo]]:
    """One round of every replica: each its own cohort, in the same calls. Returns the stacked
    state and each replica's RoundInfo."""
    t = int(state.round)
    cohorts = [s.cohort(t) for s in self.sims]
    chunks = self.aligned_chunks([s.chunks(c) for s, c in zip(self.sims, cohorts)])
    params, client_state, server = list(state.params), state.client_state, state.server
    t_dev = jnp.asarray(t, jnp.int32)
    chunk_stats = []
    for gi, slots, active in chunks:
      params[gi], client_state, server, stats = self._train_calls[gi](
          params[gi], client_state, server, self.data, self.seen, jnp.asarray(slots, jnp.int32),
          jnp.asarray(active), t_dev, self.root_keys)
      chunk_stats.append(stats)
    participants = np.zeros((self.num, self.sims[0].num_clients), bool)
    for r, c in enumerate(cohorts):
      participants[r, c] = True
    agg = self._aggregate(server, jnp.asarray(participants), t_dev, self.root_keys)
    server = agg.server
    # One transfer for the round.
    all_stats, server_flops, server_metrics = self.placement.fetch(
        (chunk_stats, agg.flops, agg.metrics))
    infos, costs = [], []
    for r, sim in enumerate(self.sims):
      mine = [(gi, slots[r], active[r], {k: v[r] for k, v in stats.items()})
              for (gi, slots, active), stats in zip(chunks, all_stats)]
      info = sim._round_info(cohorts[r], mine, server_flops[r],
                             {k: v[r] for k, v in server_metrics.items()})
      c = dict(state.costs[r])
      c['up_floats'] += info.up_floats
      c['down_floats'] += info.down_floats
      c['client_flops'] += info.client_flops
      infos.append(info)
      costs.append(c)
    return RunState(round=t + 1, params=tuple(params), client_state=client_state,
                    server=server, costs=tuple(costs)), infos
