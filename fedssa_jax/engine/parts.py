"""The parts a Simulator is built of, each by a function of its own: the local-training settings,
the seeds' checks and data on the devices, the clients evaluated, and round 0 (`Initial`).

Every part is a pure function of the config, the data and the seeds, so a resumed run and a run
alone build the same parts.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedssa_jax import data, methods, models, privacy
from fedssa_jax.data.partition import DeviceData
from fedssa_jax.engine import population, schedule, training
from fedssa_jax.engine.placement import Placement
from fedssa_jax.engine.state import ServerState
from fedssa_jax.errors import ConfigError
from fedssa_jax.streams import Stream
from fedssa_jax.types import PyTree


def train_config(config, ds: data.Dataset, accountant=None,
                 max_train: int = 0) -> training.TrainConfig:
  """The local-training settings of `config`; with DP-SGD, `accountant` (privacy.Accountant)
  gives the noise multiplier (perhaps calibrated), and `max_train`, the longest training split,
  bounds the Poisson batch."""
  o, p = config.optimizer, config.privacy
  dp = None
  if accountant is not None:
    pass_size = privacy.pass_size_for(int(p.pass_size), jax.default_backend())
    per_example = p.per_example if methods.METHODS[config.method].ghost_norms else 'vmap'
    dp = privacy.dp_sgd_settings(float(p.clip_norm), accountant.noise_multiplier,
                                 config.batch_size, max_train, pass_size, per_example,
                                 micro_batch(config), p.max_batch, float(p.release_clip),
                                 accountant.release_noise_multiplier)
  return training.TrainConfig(
      batch_size=config.batch_size, local_epochs=config.local_epochs, optimizer=o.name,
      lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, clip_norm=o.clip_norm,
      adam_b1=o.adam_b1, adam_b2=o.adam_b2, micro_batch=micro_batch(config),
      augment=config.augment, fixed_order=config.batch_order == 'fixed',
      drop_last=bool(config.drop_last), mean=tuple(ds.mean), std=tuple(ds.std), dp=dp)


def micro_batch(config) -> int:
  """engine.micro_batch, or by backend: 64-row passes on the CPU (whose activations stay in
  cache: CNN-1 trains about 1.1x faster per sample than in one 512-row pass, and a partial
  batch pads less), whole batches on accelerators."""
  if config.engine.micro_batch:
    return config.engine.micro_batch
  b = config.batch_size
  return 64 if jax.default_backend() == 'cpu' and b > 64 and b % 64 == 0 else b


def check_seeds(config, seeds, widths) -> None:
  """Raises ConfigError, naming the fix, if `seeds` of `config` cannot run packed."""
  if len(set(seeds)) != len(seeds):
    raise ConfigError(f'Packed seeds must differ, got {list(seeds)}.')
  if len(seeds) > 1 and not population.store_class(config.population_store).packs_seeds:
    raise ConfigError(
        f'Packed seeds (--seeds) need {population.either(population.stores(packs_seeds=True))}, '
        f'not {config.population_store!r}: drop --config.population_store, or run the seeds one '
        'by one (one command per seed, without --seeds).')
  # local_train's shuffles stay those of each seed alone when the training index rows are
  # padded to a common width: training.epoch_order draws uniform numbers over the padded length,
  # and with jax_threefry_partitionable (the default since JAX 0.5) the first n of a longer
  # draw are the same numbers (tests/replicas_test.py checks it).
  if len(set(widths)) > 1 and not jax.config.jax_threefry_partitionable:
    raise ConfigError(
        'Packed seeds with per-seed partitions need jax_threefry_partitionable (JAX\'s '
        'default since 0.5): set JAX_THREEFRY_PARTITIONABLE=1, or fix partition.seed.')


def device_data(ds: data.Dataset, cds: list[data.ClientData], place: Placement,
                validation: bool = False) -> tuple[list[DeviceData], DeviceData]:
  """(each seed's own data, which its evaluation reads, with its validation splits where
  `validation`; the training data of every seed, stacked: its training index rows padded to the
  widest seed's, its sizes [R, N]), on the devices, the images shared."""
  images, labels = place.replicate((jnp.asarray(ds.images), jnp.asarray(ds.labels)))
  val = lambda c: ({'val_idx': jnp.asarray(c.val_idx), 'val_n': jnp.asarray(c.val_n)}
                   if validation else {})
  seed_data = [place.replicate(DeviceData(
      images=images, labels=labels, train_idx=jnp.asarray(c.train_idx),
      train_n=jnp.asarray(c.train_n), test_idx=jnp.asarray(c.test_idx),
      test_n=jnp.asarray(c.test_n), **val(c))) for c in cds]
  width = max(c.train_idx.shape[1] for c in cds)
  pad = lambda a: np.pad(a, ((0, 0), (0, width - a.shape[1])))
  train_idx = np.stack([pad(c.train_idx) for c in cds])
  stacked = dataclasses.replace(
      seed_data[0], train_idx=place.replicate(jnp.asarray(train_idx)),
      train_n=place.replicate(jnp.asarray(np.stack([c.train_n for c in cds]))),
      val_idx=None, val_n=None)  # training never reads the validation splits
  return seed_data, stacked


def check_validation(cds: list[data.ClientData], evaluated: list[np.ndarray]) -> None:
  """A ConfigError, naming the fix, where an evaluated client (`evaluated`, each seed's ids) has
  no validation sample, so that eval_validation could not score it."""
  for c, ids in zip(cds, evaluated):
    empty = ids[c.val_n[ids] == 0]
    if len(empty):
      raise ConfigError(
          f'eval_validation: {len(empty)} of the {len(ids)} evaluated clients (client '
          f'{int(empty[0])} first) hold no validation sample. Give each client one (fewer '
          "clients, partition.scheme='reference', whose 10k validation pool is split as the "
          'training pool is), or set eval_validation=False.')


def evaluated_ids(config, seeds, cds: list[data.ClientData]) -> list[np.ndarray]:
  """Each seed's clients whose accuracy every evaluation reports: those with test data, or a
  fixed subset of them (`eval_clients`)."""
  out = []
  for seed, c in zip(seeds, cds):
    ids = schedule.eval_subset(seed, c.test_n, config.eval_clients)
    out.append(np.flatnonzero(c.test_n > 0) if ids is None else ids)
  return out


def class_counts(labels: np.ndarray, cd, num_classes: int) -> np.ndarray:
  """[N, C] float32: each client's training samples of each class (`cd` its ClientData,
  `labels` the data set's), what a method declaring Method.server_reads_class_counts gets."""
  return np.stack([np.bincount(labels[idx[:n]], minlength=num_classes)
                   for idx, n in zip(cd.train_idx, cd.train_n)]).astype(np.float32)


@jax.jit
def client_keys(root_key: jax.Array, stream, client_ids: jax.Array) -> jax.Array:
  """Each client's key of a random stream: fold_in(fold_in(root, stream), client id)."""
  stream_key = jax.random.fold_in(root_key, stream)
  return jax.vmap(lambda c: jax.random.fold_in(stream_key, c))(client_ids)


class Initial:
  """Round 0 of every seed, drawn from its key (`keys`, one per seed): each client's initial
  model (`group`) and method state (`client_state`), which the store asks for, and the server's
  initial state (`servers`)."""

  def __init__(self, config, method: methods.Method, keys: list[jax.Array], place: Placement):
    self.init_scope = config.model.init_scope
    self._family_models = {}  # init_scope 'family': each family's one model, of each seed
    self.keys, self.placement = keys, place
    self._client_state = jax.jit(jax.vmap(method.init_client_state))
    # Replicated on the mesh, as every later round's server is (an init_server that ignores
    # its inputs would otherwise leave it on one device, and round 1 would compile again).
    # A method declaring server_reads_class_counts gets the clients' class counts too.
    reads = method.server_reads_class_counts
    init = lambda key, seen, counts: method.init_server(
        key, seen, **({'class_counts': counts} if reads else {}))
    self._server = jax.jit(lambda key, seen, counts: place.constrain(
        init(key, seen, counts), sharded=False))
    self._stacked_server = jax.jit(lambda key, seen, counts: jax.tree.map(
        lambda a: a[None], init(key, seen, counts)))

  def group(self, g: schedule.Group, slots, seed_index: int) -> PyTree:
    """The initial parameters of the group's members at `slots` (stacked), of one seed: each
    one's own draw, or (init_scope 'family') copies of the family's one model, the same in
    every method."""
    slots, key = np.asarray(slots), self.keys[seed_index]
    if self.init_scope == 'family':  # drawn once per family and seed, then copied
      cached = (g.family, g.model, seed_index)
      one = self._family_models.get(cached)
      if one is None:
        family_id = np.full(1, models.all_family_names().index(g.family))
        one = _stacked_init(g.model)(client_keys(key, Stream.FAMILY_INIT,
                                                 jnp.asarray(family_id)))
        if not any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(one)):
          self._family_models[cached] = one  # not when a caller traces (jax.eval_shape)
      return _copies(one, len(slots))
    return _stacked_init(g.model)(client_keys(key, Stream.INIT, jnp.asarray(g.members[slots])))

  def client_state(self, cids, seed_index: int) -> PyTree:
    return self._client_state(client_keys(
        self.keys[seed_index], Stream.CLIENT_STATE, jnp.asarray(np.asarray(cids))))

  def servers(self, seen: np.ndarray, counts: np.ndarray | None = None) -> ServerState:
    """Every seed's initial server state, stacked; `seen` [R, N, C] the seeds' masks, `counts`
    [R, N, C] their class counts (class_counts; None for a method that reads none). One seed
    without a mesh gets its seed axis inside the call, so that a server state holding rows per
    client (FedSSA's table: 2 GB at N = 100,000) is never held twice."""
    counts = [None] * len(self.keys) if counts is None else counts
    if len(self.keys) == 1 and self.placement.mesh is None:
      return self._stacked_server(jax.random.fold_in(self.keys[0], Stream.SERVER),
                                  jnp.asarray(seen[0]),
                                  None if counts[0] is None else jnp.asarray(counts[0]))
    return self.placement.stack_seeds([
        self._server(jax.random.fold_in(key, Stream.SERVER),
                     self.placement.replicate(jnp.asarray(s)),
                     None if c is None else self.placement.replicate(jnp.asarray(c)))
        for key, s, c in zip(self.keys, seen, counts)])


@functools.partial(jax.jit, static_argnums=1)
def _copies(one: PyTree, n: int) -> PyTree:
  """`n` copies of the stacked model `one` (a leading axis of 1), each in storage of its own."""
  return jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape[1:])), one)


@functools.lru_cache(maxsize=None)
def _stacked_init(model) -> Callable:
  """The jitted initialiser of `model`'s parameters for a stack of keys: one per model (equal
  modules are equal keys), so every Simulator of a process shares its traces and programs."""
  return jax.jit(jax.vmap(functools.partial(models.init_params, model)))
