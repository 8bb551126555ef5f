"""The round engine: every seed of a run, every family group, one jitted call per chunk.

A Simulator runs R >= 1 seeds of one config (R = 1 for a plain run; `--seeds` packs more). Every
array of the state has a leading seed axis: each group's stacked parameters [R, rows, ...], the
per-client state [R, N, ...] (the population, which the store keeps: population.py), the server
state [R, ...], the costs [R]. A round (`Simulator.run_round`):

1. samples each seed's cohort and cuts it into chunks of one family group (schedule.py); chunk j
   of a group holds chunk j of every seed;
2. trains each chunk in one jitted call (`train_chunk` around `local_round`): the method's
   download, local training of every client under `vmap` with the method's loss, the upload,
   the server's receipt of the uploads that arrive; the population store brings the chunk's
   rows to the call and takes them back. The call is vmapped over the seeds, each with its own
   rows, server, seen-class masks, training indices and root key (`ChunkInputs`); with one seed
   it runs on the seed's slice, computing exactly what a run without the axis did;
3. runs the method's server rule over the clients whose uploads arrived, per seed, under jit;
4. adds up each seed's floats, FLOPs and training statistics (`ChunkStats` into `RoundInfo`).

The federation (the `system` section, fedssa_jax/system.py) and client-level DP on the uploads
(the privacy section's upload) act on the path of the uploads from client to server, `Uplink`
(uplink.py), which the Simulator builds once from the config and the round calls without
knowing which of its steps are on: in step 1 the federation's draws (who is online, drops out,
straggles, loses its upload: `Uplink.federation.draw`), in step 2 a straggler's share of its
steps (`.work`), each upload's clip and local noise (`Uplink.send`) and which uploads arrive
(`Uplink.receive`: not those lost or late), in step 3 central noise on the server's sum before
the rule and, with the system section on, a round that received nothing leaving the server as
it was (`Uplink.aggregate`). With all of them off, every step is the identity. DP-SGD acts
inside local training (training.py).

Shapes never depend on the round, so each family compiles its training call once. Dummy clients
train on zero samples (every step is a no-op), and their scatter and upload are dropped, so they
change nothing. The Simulator's parts are built elsewhere: the seeds' data and round 0
(parts.py), the FLOP counts (costs.py), the store (population.py), the evaluator
(evaluation.py); devices and processes: placement.py; checkpoints: snapshots.py.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedssa_jax import data, headcount, methods, models, privacy, system
from fedssa_jax.engine import (costs, evaluation, generalization, parts, per_call, schedule,
                               training)
from fedssa_jax.engine.parts import check_seeds, train_config
from fedssa_jax.engine.placement import Placement, REPLICATED, SHARDED, over_replicas
from fedssa_jax.engine.chunk_calls import jit_chunk_call
from fedssa_jax.engine.population import make_store
from fedssa_jax.engine.state import (ChunkInputs, ChunkStats, ClientStats, Costs, Population,
                                     RoundInfo, RunState, ServerState)
from fedssa_jax.engine.uplink import VIEW_AXES, Uplink, upload_accountant
from fedssa_jax.streams import Stream


# Under a mesh, each device trains its share of a chunk's clients (local_round's arguments).
LOCAL_SPECS = (SHARDED, SHARDED, REPLICATED,
               ChunkInputs(slots=SHARDED, ids=SHARDED, active=SHARDED, seen=REPLICATED,
                           data=REPLICATED, round_index=REPLICATED, root_key=REPLICATED,
                           system=REPLICATED))


def local_round(params, state, server, inputs: ChunkInputs, *, method: methods.Method,
                train_one: Callable, pass_one: Callable | None = None,
                pass_flops_per_sample: float = 0.0, after_one: Callable | None = None,
                step_flops_per_sample: float = 0.0, uplink: Uplink = Uplink(),
                download: Callable | None = None, release: privacy.Release | None = None):
  """Download, local training and upload of a chunk's clients (a device's share of them under a
  mesh), vmapped over the clients; every output has a leading client axis. `train_one` is
  training.local_train for the family's model; `pass_one`, training.forward_pass_sums for its
  evaluated model, runs where the method asks for a forward pass (`method.forward_pass`), which
  costs `pass_flops_per_sample` FLOPs per training sample; `after_one`, training.after_training
  for its model, runs the method's step after training (`method.after_training`), which costs
  `method.after_training_steps` CE training steps of `step_flops_per_sample` FLOPs per study
  and quiz sample. Without them (the default), nothing of them is traced; nor of the held-out
  split (`method.held_out_samples`) at 0, nor of the training switch (`method.trains`) at its
  default. `uplink`, the path of the uploads (uplink.py): its federation step gives each
  client's share of its steps (a straggler's), and its client step takes each upload (client-level
  DP's clip and local noise); by default (the ideal federation, no DP) neither traces anything.
  `download`: the hook that gives each client what it holds before training, `method.download`
  by default (a new client's evaluation passes `method.newcomer`: generalization.py).
  `release` (DP-SGD with a method's `release_values` or `release_after_training`): the forward
  pass's sums are a private release table (privacy.release_class_sums), or the step after
  training's output is released whole (privacy.release_whole), noised here with each client's
  key of the round; None (the default) traces nothing of it."""
  ids, data_, t = inputs.ids, inputs.data, inputs.round_index
  n = jnp.where(inputs.active, data_.train_n[ids], 0)
  # Each client's view; the round is the same for all (unbatched).
  view = methods.ClientView(id=ids, seen=inputs.seen[ids], num_samples=n, round=t)
  down = jax.vmap(download or method.download, in_axes=(0, 0, None, VIEW_AXES))(
      params, state, server, view)
  round_key = jax.random.fold_in(jax.random.fold_in(inputs.root_key, Stream.TRAIN), t)
  keys = jax.vmap(lambda c: jax.random.fold_in(round_key, c))(ids)
  when = method.forward_pass
  forward = lambda p: jax.vmap(pass_one, in_axes=(0, 0, 0, None))(
      p, data_.train_idx[ids], n, data_)
  passed = after = None  # the forward pass's sums and the step after training's output
  if when == 'before':
    passed = forward(down.params)
  # The trainable split: positions Q.. of each row (Method.held_out_samples), n_k - Q samples,
  # none in a round without training (Method.trains).
  rows, q = data_.train_idx[ids], method.held_out_samples
  if q:
    split_n = jnp.maximum(n - q, 0)
    split_rows = rows[:, q:] if rows.shape[1] > q else jnp.zeros((rows.shape[0], 1), rows.dtype)
  else:
    split_n, split_rows = n, rows
  trains = method.trains(t)
  train_n = split_n if trains is True else jnp.where(trains, split_n, 0)
  work = uplink.federation.work(inputs)  # with the system section, a straggler's f
  in_axes = (0, 0, 0, 0, 0, None) + (0,) * len(work)
  trainable, loss_sums, stats = jax.vmap(train_one, in_axes=in_axes)(
      {'model': down.params, **down.aux}, down.ctx, keys, split_rows, train_n, data_, *work)
  if when == 'after':
    passed = forward(trainable['model'])
  if release is not None and method.release_values is not None:
    passed = jax.vmap(functools.partial(privacy.release_class_sums, release=release))(
        passed, privacy.release_keys(inputs.root_key, t, ids))
  if after_one is not None:  # keyed by round and client, as the training shuffles
    study_round = jax.random.fold_in(jax.random.fold_in(inputs.root_key, Stream.STUDY), t)
    study_keys = jax.vmap(lambda c: jax.random.fold_in(study_round, c))(ids)
    after, study_count, quiz_count = jax.vmap(
        after_one, in_axes=(0, 0, 0, 0, 0, None, VIEW_AXES))(
            trainable, down.ctx, study_keys, data_.train_idx[ids], n, data_, view)
  if release is not None and method.release_after_training:
    after = jax.vmap(functools.partial(privacy.release_whole, fields=method.private_upload,
                                       release=release))(
        after, privacy.release_keys(inputs.root_key, t, ids))
  acc = methods.Accumulated(loss=loss_sums, forward_pass=passed, after_training=after)
  up = jax.vmap(method.upload, in_axes=(0, 0, 0, 0, VIEW_AXES))(
      trainable, acc, down.ctx, state, view)
  payload, upload_norm = uplink.send(method, up.payload, server, down, view, inputs.root_key)
  extra_flops = down.flops + up.flops
  if after_one is not None:  # the step: CE training steps' FLOPs per study and quiz sample
    per_study, per_quiz = method.after_training_steps
    extra_flops = extra_flops + step_flops_per_sample * (
        per_study * study_count.astype(jnp.float32) + per_quiz * quiz_count.astype(jnp.float32))
  if when is not None:  # the pass: one forward of each training sample
    extra_flops = extra_flops + pass_flops_per_sample * n.astype(jnp.float32)
  stats = ClientStats(train=stats, down_floats=down.floats, up_floats=up.floats,
                      extra_flops=extra_flops, upload_norm=upload_norm)
  return up.params, up.state, payload, stats


def train_chunk(params, state, server, inputs: ChunkInputs, *, method: methods.Method,
                local: Callable, uplink: Uplink = Uplink()):
  """One chunk of a group, on its rows: `local` (local_round, per device under a mesh), then
  the server's receipt of the uploads that arrive (`uplink`'s, uplink.py), and the chunk's
  statistics. Returns (params, state, server, ChunkStats); the store's call brings the rows and
  takes them back."""
  new_params, new_state, payload, stats = local(params, state, server, inputs)
  server, received, seconds = uplink.receive(method, server, inputs, payload, stats)
  # Which trained clients hold a NaN or inf in their parameters (the divergence guard).
  nonfinite = jnp.stack([
      ~jnp.isfinite(l).reshape(l.shape[0], -1).all(axis=1)
      for l in jax.tree.leaves(new_params) if jnp.issubdtype(l.dtype, jnp.inexact)
  ]).any(axis=0) & inputs.active
  norms = jax.vmap(method.trained_norms)(new_params, inputs.seen[inputs.ids])
  return new_params, new_state, server, ChunkStats(clients=stats, nonfinite=nonfinite,
                                                   norms=norms, received=received,
                                                   seconds=seconds)


def local_fn(g: schedule.Group, method: methods.Method, train_cfg: training.TrainConfig,
             flops: costs.Flops, max_train: int, eval_batch_size: int,
             uplink: Uplink = Uplink(), download: Callable | None = None) -> Callable:
  """`local_round` for group `g`'s model, with the method's forward pass and step after
  training where it asks for them, the uploads' path `uplink` and the `download` hook (the
  method's by default). `max_train`: the longest training index row."""
  train_one = functools.partial(training.local_train, apply_fn=g.model.apply, cfg=train_cfg,
                                method=method, train_apply=getattr(g.model, 'train_apply', None))
  local = functools.partial(local_round, method=method, train_one=train_one, uplink=uplink,
                            download=download)
  if method.forward_pass not in (None, *methods.FORWARD_PASS_TIMES):
    raise ValueError(f'{type(method).__name__}.forward_pass must be None or one of '
                     f'{methods.FORWARD_PASS_TIMES}, got {method.forward_pass!r}.')
  stats_fn, rows, dp = method.forward_pass_stats, method.forward_pass_rows, train_cfg.dp
  if dp is not None and (method.release_after_training or method.release_values is not None):
    local = functools.partial(local, release=privacy.Release(dp.release_clip,
                                                             dp.release_noise_multiplier))
  if dp is not None and method.release_values is not None:
    # DP-SGD: the pass sums each example's clipped row of the release table, which
    # local_round noises (privacy/releases.py).
    if method.forward_pass is None:
      raise ValueError(f'{type(method).__name__} releases class sums under DP-SGD '
                       '(release_values) and must set forward_pass for them.')
    stats_fn, rows = privacy.table_stats(method.release_values, num_classes=method.num_classes,
                                         clip=dp.release_clip), False
  if method.forward_pass is not None:
    # training.forward_pass_sums for the group's evaluated model, in evaluation-size batches
    # (at most the longest training split, rounded up to 8, as evaluation cuts test batches).
    pass_one = functools.partial(
        training.forward_pass_sums, apply_fn=g.eval_model.apply, cfg=train_cfg,
        batch_size=min(eval_batch_size, -(-max_train // 8) * 8), stats_fn=stats_fn, rows=rows)
    local = functools.partial(local, pass_one=pass_one,
                              pass_flops_per_sample=flops.forward(g.family))
  if method.after_training is not None:
    local = functools.partial(
        local, after_one=functools.partial(training.after_training, apply_fn=g.model.apply,
                                           cfg=train_cfg, method=method),
        step_flops_per_sample=flops.model(g.family))
  return local


def chunk_fn(g: schedule.Group, method: methods.Method, train_cfg: training.TrainConfig,
             flops: costs.Flops, placement: Placement, max_train: int,
             eval_batch_size: int, uplink: Uplink = Uplink()) -> Callable:
  """`train_chunk` for group `g`'s model, one seed's (the store vmaps it over the seeds), around
  `local_fn`'s round, each device training its share of the chunk."""
  local = local_fn(g, method, train_cfg, flops, max_train, eval_batch_size, uplink)
  return functools.partial(train_chunk, method=method, uplink=uplink,
                           local=placement.per_device(local, LOCAL_SPECS))


class Simulator:
  """Holds the static parts of a run of `seeds` (default: the config's), each with its client
  data `cd` (one ClientData for all, or one per seed): data, groups, FLOP counts, the store and
  the compiled calls. The state is passed in and out (`init_state`, `run_round`; its
  checkpoints: snapshots.py). `phase(name, *arrays)`, if given, is called after each phase of a
  round (a benchmark's timer; bench.py). `per_call_choice`: {family: clients per call} that a
  resumed run's workdir records (per_call.read_record), taken instead of measuring."""

  def __init__(self, config, ds: data.Dataset, cd, workdir: str | None = None,
               phase: Callable | None = None, *, seeds=None,
               per_call_choice: dict | None = None):
    self.config = config
    self.seeds = tuple(int(s) for s in (seeds if seeds is not None else (config.seed,)))
    cds = list(cd) if isinstance(cd, (list, tuple)) else [cd] * len(self.seeds)
    check_seeds(config, self.seeds, [c.train_idx.shape[1] for c in cds])
    self.phase = phase or (lambda name, *arrays: None)
    self.num_seeds = r = len(self.seeds)
    self.num_clients, self.num_classes = cds[0].num_clients, ds.num_classes
    self.image_shape = ds.image_shape
    # The new clients (config new_clients) never train: the rounds sample K of the others.
    self.new_clients, self.eligible = generalization.new_clients(config, self.seeds, cds)
    self.taking_part = headcount.participating(self.num_clients, config.new_clients)  # N'
    self.k = headcount.cohort_size(self.taking_part, config.participation)
    self.method = methods.get_method(config.method)(config, self.num_clients, ds.num_classes,
                                                    self.image_shape)
    place = self.placement = Placement(config.engine.mesh_devices)
    # Host copies, [R, ...]: each seed's seen classes and training-set sizes; then the devices'.
    self.seen = np.stack([c.seen for c in cds])
    self.class_counts = (np.stack([parts.class_counts(ds.labels, c, ds.num_classes) for c in cds])
                         if self.method.server_reads_class_counts else None)
    self.train_n = np.stack([c.train_n for c in cds])
    # DP-SGD's accountant (None: the privacy section off), and the training settings.
    self.privacy = (privacy.Accountant(
        config.privacy, np.maximum(self.train_n - self.method.held_out_samples, 0),
        config.batch_size, config.local_epochs, config.num_rounds,
        releases=privacy.releases_of(self.method))
                    if privacy.enabled(config.privacy) else None)
    self.train_cfg = train_config(config, ds, self.privacy,
                                  max(c.train_idx.shape[1] for c in cds))
    self.seed_data, self.data = parts.device_data(ds, cds, place, config.eval_validation)
    self.seen_dev = place.replicate(jnp.asarray(self.seen))
    keys = [jax.random.PRNGKey(s) for s in self.seeds]
    self.root_keys = place.replicate(jnp.stack(keys))
    if self.privacy is not None and self.class_counts is not None:  # a private release
      self.class_counts = privacy.noisy_class_counts(self.class_counts, jnp.stack(keys),
                                                     self.privacy.release_noise_multiplier)
    self.evaluated_ids = [np.setdiff1d(ids, new) for ids, new in zip(
        parts.evaluated_ids(config, self.seeds, cds), self.new_clients)]
    if config.eval_validation:
      parts.check_validation(cds, self.evaluated_ids)

    self.groups = schedule.make_groups(config, ds.num_classes, self.num_clients, self.k, place,
                                       self.image_shape)
    if self.privacy is not None:  # DP-SGD clips per example: no batch statistics
      privacy.check_models(config.privacy, {g.family for g in self.groups if models.split_state(
          jax.eval_shape(lambda k, g=g: models.init_params(g.model, k, self.image_shape),
                         jax.random.PRNGKey(0)))[1] is not None})
    self.group_of, self.slot_of = schedule.group_index(self.groups, self.num_clients)
    self.flops = costs.Flops(config, ds.num_classes, self.image_shape, self.method, self.groups,
                             self.group_of)
    # The federation's draws and devices (None: the ideal federation).
    self.system = (system.System(config.system, self.num_clients, self.seeds,
                                 self.flops.per_client)
                   if system.enabled(config.system) else None)
    self.initial = parts.Initial(config, self.method, keys, place)
    # Client-level DP on the uploads: its accountant (None: off).
    self.upload_privacy = (upload_accountant(config, self.taking_part, self.k)
                           if privacy.upload_enabled(config.privacy) else None)
    # The path of the uploads from client to server, with the federation's and privacy's steps
    # that are on (uplink.py), and what the calls take of the devices, once (each round adds
    # its draws: train_chunks).
    self.uplink = Uplink.build(config, self.method, self.upload_privacy)
    self.system_devices = self.uplink.federation.devices(self.system, self.seeds,
                                                         self.flops.per_client, place)
    self._calls(config, workdir, per_call_choice)
    self.evaluator = evaluation.Evaluator(
        self.method, self.groups, self.store, place, self.train_cfg, self.group_of,
        self.slot_of, eval_batch_size=config.eval_batch_size,
        clients_per_call=config.engine.eval_clients_per_call, phase=self.phase,
        global_sample=self._global_sample(config, ds, cds), validation=config.eval_validation,
        unseen_classes=[generalization.unseen_classes(c.train_idx, c.train_n, ds.labels,
                                                      ds.num_classes) for c in cds],
        rep_floats=(self.data.test_idx.shape[-1] + config.eval_global_images)
        * self.method.feature_dim, dtype=models.COMPUTE_DTYPES[config.engine.compute_dtype])
    self.newcomers = self._newcomers(config)

  def _calls(self, config, workdir: str | None, per_call_choice: dict | None) -> None:
    """The groups' chunk sizes (measured where engine.clients_per_call=-1: per_call.py, whose
    record `per_call_record` keeps), the store, and the jitted training and aggregation calls."""
    place, r = self.placement, self.num_seeds
    make_chunk = lambda g: chunk_fn(
        g, self.method, self.train_cfg, self.flops, place, self.data.train_idx.shape[-1],
        config.eval_batch_size, self.uplink)
    self.per_call_record = None
    if config.engine.clients_per_call == per_call.MEASURE:
      self.groups, self.per_call_record = per_call.choose_groups(
          self, self.groups, functools.partial(
              per_call.measure_group, self, make_chunk=make_chunk,
              jit_call=lambda call: jit_chunk_call(call, place, r)), recorded=per_call_choice)
    self.store = make_store(
        config.population_store, place, self.groups, self.num_clients, r,
        self.initial.group, self.initial.client_state,
        directory=workdir and os.path.join(os.path.abspath(workdir), 'population'))
    self._train_calls = [self.store.train_call(g, make_chunk(g)) for g in self.groups]
    self._aggregate = jax.jit(lambda *a: place.constrain(over_replicas(
        functools.partial(self.uplink.aggregate, self.method), r, (0, 0, None, 0))(*a),
        sharded=False), donate_argnums=0)

  def _newcomers(self, config) -> generalization.Newcomers | None:
    """The new clients' evaluation (None without new clients): each group's round of local
    training as a participant's, with the method's newcomer download and new_client_epochs."""
    if not len(self.new_clients[0]):
      return None
    cfg = dataclasses.replace(self.train_cfg, local_epochs=config.new_client_epochs)
    return generalization.Newcomers(
        self.evaluator, [local_fn(g, self.method, cfg, self.flops, self.data.train_idx.shape[-1],
                                  config.eval_batch_size, download=self.method.newcomer)
                         for g in self.groups], self.seen_dev, self.root_keys)

  def _global_sample(self, config, ds: data.Dataset, cds):
    """Each seed's global test sample [R, G] on the devices (generalization.global_sample);
    None with eval_global_images at 0."""
    if not config.eval_global_images:
      return None
    return self.placement.replicate(jnp.asarray(np.stack([
        generalization.global_sample(s, config.eval_global_images, c.test_idx, c.test_n,
                                     ds.labels, ds.num_classes)
        for s, c in zip(self.seeds, cds)])))

  def init_state(self, fresh: bool = True) -> RunState:
    """Round 0 of every seed: each client's initial model and method state (parts.Initial), in
    storage of its own (no aliasing across clients, docs/algorithm.md §2), and the server's
    initial state. `fresh`: no checkpoint will be restored (population.Store.initial)."""
    # The server knows the classes (and class counts) of the clients that take part: each
    # seed's new clients, which never do, hold none for it (central DP's owner counts).
    known = lambda t: t if t is None or not len(self.new_clients[0]) else t * np.stack(
        [~np.isin(np.arange(self.num_clients), i) for i in self.new_clients])[..., None]
    return RunState(round=0, population=self.store.initial(fresh),
                    server=self.initial.servers(known(self.seen), known(self.class_counts)),
                    costs=Costs.zeros(self.num_seeds))

  # ------------------------------------------------------------------------------------------
  # The round
  # ------------------------------------------------------------------------------------------
  def run_round(self, state: RunState) -> tuple[RunState, list[RoundInfo]]:
    """One round of every seed: sample, train the cohorts chunk by chunk, aggregate, account.
    Returns the new state and each seed's RoundInfo; `state` is used up (its population is the
    store's to change: population.py)."""
    t = int(state.round)
    rounds = [self.federation(t, i) for i in range(self.num_seeds)]
    cohorts = [cohort for _, _, cohort in rounds]
    chunks = self.plan(cohorts)
    self.phase('sample')
    population, server, chunk_stats = self.train_chunks(
        state.population, state.server, chunks, t, [draws for draws, _, _ in rounds])
    self.phase('train', population, server)
    # The clients whose uploads the server received, as the chunks found them.
    participants = jnp.zeros((self.num_seeds, self.num_clients), bool)
    for c, stats in zip(chunks, chunk_stats):
      participants = _mark(participants, jnp.asarray(c.ids, jnp.int32), stats.received)
    agg = self._aggregate(server, participants, jnp.asarray(t, jnp.int32), self.root_keys)
    server = agg.server
    self.phase('aggregate', server)
    # One transfer for the round: the chunks' statistics, the server's FLOPs and diagnostics.
    all_stats, server_flops, server_metrics = self.placement.fetch(
        (chunk_stats, agg.flops, agg.metrics))
    infos = [self._round_info(cohorts[i], chunks,
                              [jax.tree.map(lambda v, i=i: v[i], s) for s in all_stats], i,
                              rounds[i])
             .replace(server_flops=float(server_flops[i]),
                      server_metrics={k: float(v[i]) for k, v in server_metrics.items()})
             for i in range(self.num_seeds)]
    self.phase('host')
    return RunState(round=t + 1, population=population, server=server,
                    costs=state.costs.add(infos)), infos

  def cohort(self, t: int, seed_index: int = 0) -> np.ndarray:
    """The clients that train in round `t` (sorted ids)."""
    return self.federation(t, seed_index)[2]

  def federation(self, t: int, seed_index: int = 0
                 ) -> tuple[system.RoundDraws | None, np.ndarray, np.ndarray]:
    """Round `t` of a seed: (the system section's draws, or None when it is off; the sampled
    clients; those of them that train, the cohort), a pure function of (seed, t)."""
    return self.uplink.federation.draw(self.system, self.seeds[seed_index], t,
                                       self.num_clients, self.k, self.eligible[seed_index])

  def chunks(self, cohort: np.ndarray, per_call: int | None = None,
             seed_index: int = 0) -> list:
    """[(group index, slots, active)] of one seed's `cohort` (schedule.chunks)."""
    return schedule.chunks(self.groups, self.group_of, self.slot_of, self.train_n[seed_index],
                           cohort, per_call)

  def plan(self, cohorts: list[np.ndarray]) -> list[schedule.Chunk]:
    """The calls of a round whose cohorts (one per seed) are `cohorts` (schedule.plan). A round
    in which no seed trains anyone (the system section's dropouts) gets one all-inactive chunk,
    a no-op whose statistics are the round's zeros."""
    chunks = schedule.plan(self.groups, self.group_of, self.slot_of, self.train_n, cohorts)
    if not chunks:
      g = self.groups[0]
      shape = (self.num_seeds, g.clients_per_call)
      chunks = [schedule.Chunk(0, np.full(shape, g.rows), np.full(shape, g.members[-1]),
                               np.zeros(shape, bool))]
    return chunks

  def train_chunks(self, population: Population, server: ServerState, chunks, t: int,
                   draws: list | None = None
                   ) -> tuple[Population, ServerState, list[ChunkStats]]:
    """Trains round `t`'s `chunks`, with each seed's system draws (`draws`, the system section
    on). Returns (the new population, the server, [the statistics of each chunk]); `population`
    and `server` are used up."""
    inputs = ChunkInputs(slots=None, ids=None, active=None, seen=self.seen_dev, data=self.data,
                         round_index=jnp.asarray(t, jnp.int32), root_key=self.root_keys,
                         system=self.uplink.federation.inputs(self.system_devices, draws,
                                                              self.placement))
    return self.store.train(population, server, chunks, self._train_calls, inputs)

  def _round_info(self, cohort: np.ndarray, chunks, chunk_stats: list[ChunkStats],
                  i: int, federation=None) -> RoundInfo:
    """Seed i's round: per-client stats and counts, from the fetched stats of every chunk
    (and its `federation`'s draws, with the system section on)."""
    per_client = jax.tree.map(lambda _: np.zeros(self.num_clients), chunk_stats[0])
    for c, stats in zip(chunks, chunk_stats):
      active = c.active[i]
      cids = self.groups[c.group].members[c.slots[i][active]]
      jax.tree.map(lambda table, v: table.__setitem__(cids, np.asarray(v)[active]),
                   per_client, stats)
    s = jax.tree.map(lambda v: v[cohort], per_client)
    train = s.clients.train
    # Samples processed = E * n_k: every sample once per epoch, the last batch partial.
    flops = self.flops.per_client[cohort] * train.samples + s.clients.extra_flops
    samples = max(train.samples.sum(), 1)
    return RoundInfo(
        cohort=cohort,
        up_floats=float(s.clients.up_floats.sum()),
        down_floats=float(s.clients.down_floats.sum()),
        client_flops=float(flops.sum()),
        train_loss=float(train.loss_sum.sum() / samples),
        train_accuracy=float(train.correct.sum() / samples),
        train_samples=train.samples, train_loss_sum=train.loss_sum, train_steps=train.steps,
        client_up_floats=s.clients.up_floats, client_down_floats=s.clients.down_floats,
        client_flops_per_client=flops,
        nonfinite_params=s.nonfinite.astype(bool),
        header_norm_max=float(s.norms.max.max(initial=0.0)),  # 0 for a round without clients
        header_norm_mean=float(s.norms.sum.sum() / max(s.norms.count.sum(), 1)),
        server_flops=0.0, server_metrics={},  # the server's: run_round fills them in
        system=self.uplink.federation.record(self.system, cohort, s, *federation),
        upload_norms=jax.tree.map(lambda v: np.asarray(v, np.float64), s.clients.upload_norm))

  # ------------------------------------------------------------------------------------------
  # Evaluation (evaluation.py)
  # ------------------------------------------------------------------------------------------
  def evaluate(self, state: RunState, previous: evaluation.Evaluation | None = None,
               seed_index: int = 0) -> evaluation.Evaluation:
    """Seed `seed_index`'s evaluated clients, with their models of `state`."""
    ev = self.evaluator.evaluate(
        state, seed_index, self.seed_data[seed_index], self.evaluated_ids[seed_index],
        functools.partial(self.cohort, seed_index=seed_index), previous)
    if self.newcomers is None:
      return ev
    return ev.replace(new_client_accuracy=self.newcomers.evaluate(
        state, seed_index, self.seed_data[seed_index], self.new_clients[seed_index]))

  def save_representations(self, state: RunState, workdir: str, seed_index: int = 0) -> str:
    return self.evaluator.save_representations(state, seed_index,
                                               self.seed_data[seed_index], workdir)


@jax.jit
def _mark(participants, ids, received):
  """`participants` [R, N] with each seed's `received` clients of a chunk ([R, P] `ids`) set;
  a dummy slot (not received) never clears a client that was."""
  rows = jnp.arange(ids.shape[0])[:, None]
  return participants | jnp.zeros_like(participants).at[rows, ids].max(received)
