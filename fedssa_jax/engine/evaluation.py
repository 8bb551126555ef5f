"""Per-client test evaluation, and every client's test representations (the t-SNE figure).

Each client is evaluated with its current personalised model (`Method.eval_params`) on its own
test split, in blocks of clients per jitted call; the store (population.py) brings a block's
rows to the call. Results are counts per client; `Evaluation` turns them into accuracies. A
method whose prediction goes beyond the client's model (`Method.eval_forward`, e.g. FedMRL's
projector and shared model) declares `Method.eval_reads_state`: it is evaluated through that
forward, and the store then brings the block's per-client method state too; any other method's
calls are those of the family's apply alone, without the state. With `eval_validation`, the same
calls test each client on its own validation split too (the data's val_idx, val_n), with the same
model and headline metric: what hyperparameters are chosen on (run/tuning.py).

A run with `save_representations=True` writes `representations.npz` into its workdir at the end:
`representations` [M, d] float16 (M = all clients' test samples), `labels` [M] and `client`
[M] (the client id of each row), in client order. They are computed the same way, for every
store.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from fedssa_jax import models
from fedssa_jax.data import augment
from fedssa_jax.data.partition import DeviceData
from fedssa_jax.engine.counts import (UNSEEN, batch_counts, header_counts, kept_extras,
                                      unseen_counts)
from fedssa_jax.engine.placement import REPLICATED, SHARDED
from fedssa_jax.engine.state import block_loop
from fedssa_jax.engine.training import TrainConfig
from fedssa_jax.types import PyTree

# Clients per evaluation call when evaluating a subset, or from a host or disk store.
EVAL_BLOCK = 32
COUNTS = ('correct', 'count', 'batch_acc_sum', 'num_batches')
GLOBAL_CORRECT = 'global_correct'  # a client's correct count on the global test sample
# What a method of `Method.eval_server_in_extra` keeps of each client's test batches.
KEPT = ('kept_logits', 'kept_reps')
# What a method of `Method.eval_server_header` keeps of each client: its test batches' and, with
# the global test sample on, the sample's representations ([batches, b, d] each) ...
KEPT_REPS = ('kept_reps', 'kept_global_reps')
# ... where all the evaluated clients' fit in this many bytes (at N = 1,000 with 500 global
# images of d = 500, about 1 GB; beyond it, every client is tested again).
KEEP_REPS_BYTES = 2 << 30
# A client's count of its validation samples its headline metric gets right, and of them all
# (eval_validation).
VALIDATION = ('val_correct', 'val_count')
REPRESENTATIONS_FILE = 'representations.npz'
# Under a mesh, each device evaluates its share of a block's rows (evaluate_rows's arguments;
# a method that reads the client state adds its rows, STATE_SPEC, after them).
ROWS_SPECS = (SHARDED, SHARDED, SHARDED, REPLICATED, REPLICATED)
STATE_SPEC = SHARDED


def evaluate_client(params: PyTree, test_idx: jax.Array, n: jax.Array, data: DeviceData, *,
             apply_fn: Callable, cfg: TrainConfig, eval_batch_size: int,
             extra_fn: Callable | None = None, extra_names: tuple[str, ...] = (),
             keep: bool = False):
  """One client's test results: correct, count, and the sum/number of per-batch accuracies.

  The per-batch sums give the reference code's metric (mean of per-batch accuracies).
  `extra_fn(logits, rep, y, valid)` returns further int32 counts named `extra_names` (summed).
  With `keep`, the test batches' logits and representations are kept (KEPT: [batches, b, ...],
  zero past the client's last batch) and the extra counts are computed from them after the loop
  (`kept_extras`), as a later evaluation computes them again from the kept values.
  """
  b = eval_batch_size
  padded_len = -(-test_idx.shape[0] // b) * b
  idx_pad = jnp.pad(test_idx, (0, padded_len - test_idx.shape[0]))
  kept0 = () if not keep else jax.tree.map(  # a buffer per output, [batches, b, ...]
      lambda a: jnp.zeros((padded_len // b,) + a.shape, a.dtype),
      jax.eval_shape(apply_fn, {'params': params},
                     augment.normalize(data.images[idx_pad[:b]], cfg.mean, cfg.std)))

  def body(step, acc):
    idx = jax.lax.dynamic_slice(idx_pad, (step * b,), (b,))
    valid = step * b + jnp.arange(b) < n
    x = augment.normalize(data.images[idx], cfg.mean, cfg.std)
    logits, rep = apply_fn({'params': params}, x)
    y = data.labels[idx]
    correct, batch_acc = batch_counts(logits, y, valid)
    if keep:
      kept = jax.tree.map(lambda buf, v: buf.at[step].set(v), acc[3], (logits, rep))
    else:
      kept = jax.tree_util.tree_map(jnp.add, acc[3],
                                    extra_fn(logits, rep, y, valid) if extra_fn else {})
    return (acc[0] + correct, acc[1] + batch_acc, acc[2] + 1, kept)

  batches = (n + b - 1) // b
  extra0 = {name: jnp.zeros((), jnp.int32) for name in extra_names}
  correct, batch_acc_sum, num_batches, last = jax.lax.fori_loop(
      0, batches, body, (jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32),
                         jnp.zeros((), jnp.int32), kept0 if keep else extra0))
  out = {'correct': correct, 'count': n, 'batch_acc_sum': batch_acc_sum,
         'num_batches': num_batches}
  if not keep:
    return {**out, **last}
  extras = kept_extras(last, test_idx, n, data.labels, extra_fn, extra_names) if extra_fn else {}
  return {**out, **extras, **dict(zip(KEPT, last))}


@struct.dataclass
class Evaluation:
  """Every client's test results at a round: arrays of length N, NaN for clients outside the
  evaluated subset."""
  round: int
  evaluated: np.ndarray        # the ids of the clients the metrics cover
  reevaluated: int             # how many clients this evaluation ran (the others were copied)
  accuracy: np.ndarray         # the headline accuracy (the method's `headline_metric`)
  classifier_accuracy: np.ndarray  # the classifier's accuracy (the same for most methods)
  batch_accuracy: np.ndarray   # the reference's mean of per-batch accuracies
  count: np.ndarray            # test samples
  metrics: dict                # the method's further metrics (`eval_metrics`), as accuracies
  counts: dict                 # the raw per-client counts, for the next evaluation's reuse
  # Each client's accuracy on the global test sample (eval_global_images; None: off).
  global_accuracy: np.ndarray | None = None
  # ... on the sample's images of the classes it holds no training sample of (NaN: it has
  # none there).
  global_unseen_accuracy: np.ndarray | None = None
  # ... and what guessing would score there: its share of those images it puts in a class it
  # lacks, over the number of those classes.
  global_unseen_chance: np.ndarray | None = None
  # Each new client's accuracy on its own test split (new_clients; None: off), NaN elsewhere.
  new_client_accuracy: np.ndarray | None = None
  # Each client's headline accuracy on its own validation split (eval_validation; None: off).
  val_accuracy: np.ndarray | None = None
  # Under Method.eval_server_in_extra: each evaluated client's test logits and representations
  # (KEPT), host arrays [M, batches, b, ...] in the order of `evaluated`, for the next
  # evaluation's extra counts; under Method.eval_server_header, its KEPT_REPS (the global
  # sample's where on), for the next evaluation's counts under the header then.
  kept: dict | None = None


class Evaluator:
  """Evaluates the clients of a run's seeds: `evaluate(state, seed_index, data, ids, cohort)`
  and `representations(state, seed_index, data)`. Takes what evaluation needs: the method, the
  groups and their store, the placement and the training config (normalisation)."""

  def __init__(self, method, groups: list, store, placement, train_cfg: TrainConfig,
               group_of: np.ndarray, slot_of: np.ndarray, *, eval_batch_size: int,
               clients_per_call: int = 0, phase=None, global_sample=None,
               validation: bool = False, rep_floats: int = 0, dtype=jnp.float32,
               unseen_classes: list | None = None):
    self.method, self.groups, self.store, self.placement = method, groups, store, placement
    self.train_cfg = train_cfg
    self.group_of, self.slot_of = group_of, slot_of
    self.eval_batch_size = eval_batch_size
    self.clients_per_call = clients_per_call
    self.phase = phase or (lambda name, *arrays: None)
    self.reads_state = method.eval_reads_state
    # The seeds' global test samples [R, G] on the devices (generalization.global_samples);
    # None: off, and nothing of them is traced.
    self.global_sample = global_sample
    self.global_on = global_sample is not None
    self.unseen_classes = unseen_classes  # per seed, each client's count of classes it lacks
    # Each client tested on its validation split too (the data's val_idx, val_n); False: nothing
    # of it is traced.
    self.validation = validation
    # A method whose test results read the server only in eval_extra has its clients' test
    # logits and representations kept (its extras computed from them, in a run on any store or
    # mesh), and, without a mesh, a client that has not trained since the last evaluation has
    # only its extras computed again, from the kept values (`extra_call`).
    self.keep = (method.eval_server_in_extra and bool(method.eval_metrics)
                 and not self.reads_state and not validation)
    self.reuse_kept = self.keep and placement.mesh is None
    # A method whose results read the server through the header alone has its clients' test and
    # global sample representations kept (`rep_floats` a client, in the compute `dtype`), without
    # a mesh and where they fit in KEEP_REPS_BYTES; a client that has not trained since the last
    # evaluation has its counts computed again from them under the header now (`again_call`).
    self.dtype = dtype
    self.keep_reps = (method.eval_server_header and not method.eval_metrics
                      and not self.reads_state and not validation and placement.mesh is None
                      and 0 < 4 * rep_floats * len(group_of) <= KEEP_REPS_BYTES)
    self.calls = [self._eval_call(g) for g in groups]
    self.again_call = (self._extra_call() if self.reuse_kept
                       else self._header_call() if self.keep_reps else None)

  def _per_call(self, g) -> int:
    return self.clients_per_call or (
        1 if jax.default_backend() == 'cpu' else g.rows // self.placement.num_devices)

  def _forward(self, g, state: list, server, cid):
    """The evaluated forward of client `cid` of group `g`, called as the family's apply is:
    the apply itself, or the method's `eval_forward` around it with the client's state
    (`state`: [it], empty for a method that does not read it)."""
    if not self.reads_state:
      return g.eval_model.apply
    return lambda variables, x: self.method.eval_forward(
        g.eval_model.apply, variables['params'], state[0], server, cid, x)

  def _specs(self) -> tuple:
    return ROWS_SPECS + ((STATE_SPEC,) if self.reads_state else ())

  def rows_fn(self, g) -> Callable:
    """`evaluate_rows(group_params, cids, valid, server, data, state_rows=None)`: the test
    counts of a block of group `g`'s members (rows where `valid` is False, padding, evaluate no
    test batch), `group_params` their rows or a TableRows naming them; `state_rows`, the
    members' client state, only for a method that reads it.
    With the global test sample on (`global_sample`), `server` is (the server state, the
    sample's indices), and each client's count of it is `GLOBAL_CORRECT`; with `validation`,
    each client's counts of its validation split are VALIDATION's, of the headline metric."""
    method, cfg, per_call = self.method, self.train_cfg, self._per_call(g)

    def evaluate_rows(group_params, cids, valid, server, data_: DeviceData,
                      state_rows=None):
      server, global_idx = server if self.global_on else (server, None)
      # No client has more than max_test samples, so a smaller batch than that gives the same
      # per-batch results with less padding.
      max_test = data_.test_idx.shape[1]
      eval_batch = min(self.eval_batch_size, -(-max_test // 8) * 8)

      mapped, row = block_loop(group_params)

      def one(args):
        params, cid, ok, *state = args  # state: [the client's state] if the method reads it
        params = method.eval_params(row(params), server, cid)
        extra = functools.partial(method.eval_extra, server, cid)
        forward = self._forward(g, state, server, cid)
        # A padding row has no test sample, so its test loop runs no batch (one row at a time,
        # as on the CPU, it costs nothing).
        out = evaluate_client(params, data_.test_idx[cid], jnp.where(ok, data_.test_n[cid], 0),
                              data_, apply_fn=forward, cfg=cfg, eval_batch_size=eval_batch,
                              extra_fn=extra, extra_names=method.eval_metrics,
                              keep=self.keep or self.keep_reps)
        if not self.reuse_kept:  # for the header alone, the representations are kept
          drop = KEPT[:1] if self.keep_reps else KEPT
          out = {k: v for k, v in out.items() if k not in drop}
        if global_idx is not None:  # the same images for every client
          size = global_idx.shape[0]
          on_global = evaluate_client(
              params, global_idx, jnp.where(ok, size, 0), data_, apply_fn=forward, cfg=cfg,
              eval_batch_size=min(self.eval_batch_size, -(-size // 8) * 8),
              extra_fn=unseen_counts(data_, cid), extra_names=UNSEEN, keep=self.keep_reps)
          out[GLOBAL_CORRECT] = on_global['correct']
          out.update({k: on_global[k] for k in UNSEEN})
          if self.keep_reps:
            out[KEPT_REPS[1]] = on_global['kept_reps']
        if self.validation:
          out.update(self._validation(params, cid, ok, data_, forward, extra))
        return out
      # Inside shard_map, cids holds this device's rows.
      rows = (mapped, cids, valid) + ((state_rows,) if self.reads_state else ())
      return jax.lax.map(one, rows, batch_size=min(per_call, cids.shape[0]))

    return evaluate_rows

  def _validation(self, params, cid, ok, data_: DeviceData, forward, extra) -> dict:
    """VALIDATION's counts of client `cid` (none for a padding row, `ok` False): its headline
    metric (the classifier's accuracy, or the method's eval_metrics entry) on its validation
    split, with the forward and `extra` of its test."""
    method = self.method
    headline = method.headline_metric != 'accuracy'
    out = evaluate_client(
        params, data_.val_idx[cid], jnp.where(ok, data_.val_n[cid], 0), data_, apply_fn=forward,
        cfg=self.train_cfg, eval_batch_size=min(self.eval_batch_size,
                                                -(-data_.val_idx.shape[1] // 8) * 8),
        extra_fn=extra if headline else None, extra_names=method.eval_metrics if headline else ())
    return dict(zip(VALIDATION, (out[method.headline_metric if headline else 'correct'],
                                 out['count'])))

  def _eval_call(self, g):
    """The group's jitted call of `rows_fn`, from the store, each device evaluating its share."""
    return self.store.eval_call(g, self.placement.per_device(self.rows_fn(g), self._specs()),
                                with_state=self.reads_state)

  def _extra_call(self) -> Callable:
    """The jitted extra counts of a block of clients from their kept test logits and
    representations (`kept`: KEPT's arrays [block, batches, b, ...]), with one seed's server
    and data; rows where `valid` is False (padding) count nothing."""
    method = self.method

    def extras(kept, cids, valid, server, global_idx, data_: DeviceData):
      del global_idx
      def one(args):
        kept_one, cid, ok = args
        return kept_extras(kept_one, data_.test_idx[cid], jnp.where(ok, data_.test_n[cid], 0),
                           data_.labels, functools.partial(method.eval_extra, server, cid),
                           method.eval_metrics)
      return jax.lax.map(one, (kept, cids, valid))
    return jax.jit(extras)

  def _header_call(self) -> Callable:
    """The jitted test counts (and global sample's, given its indices) of a block of clients
    from their kept representations (`kept`: KEPT_REPS's arrays [block, batches, b, d], the
    global sample's where on) under the header the method gives each now, with one seed's
    server and data; rows where `valid` is False (padding) count nothing."""
    method, dtype = self.method, self.dtype

    def counts(kept, cids, valid, server, global_idx, data_: DeviceData):
      def one(args):
        kept_one, cid, ok = args
        rows = method.eval_header(server, cid)
        out = header_counts(kept_one[0], data_.test_idx[cid],
                            jnp.where(ok, data_.test_n[cid], 0), data_.labels, rows, dtype)
        if global_idx is not None:
          on_global = header_counts(
              kept_one[1], global_idx, jnp.where(ok, global_idx.shape[0], 0), data_.labels,
              rows, dtype, unseen_counts(data_, cid), UNSEEN)
          out.update({GLOBAL_CORRECT: on_global['correct'], **{k: on_global[k] for k in UNSEEN}})
        return out
      return jax.lax.map(one, (kept, cids, valid))
    return jax.jit(counts)

  def _again(self, kept: dict, row: np.ndarray, ids: np.ndarray, server, seed_index: int,
             data: DeviceData, counts: dict) -> None:
    """Writes into `counts` what `again_call` computes again of clients `ids` (not trained
    since their kept values were, at rows `row[ids]` of `kept`) with the server's state now, in
    blocks of EVAL_BLOCK."""
    server = jax.tree.map(lambda a: a[seed_index], server)
    names = KEPT if self.reuse_kept else KEPT_REPS[:1 + self.global_on]
    global_idx = self.global_sample[seed_index] if self.global_on else None
    blocks = []
    for i in range(0, len(ids), EVAL_BLOCK):  # every block dispatched, then one fetch
      block = np.pad(ids[i:i + EVAL_BLOCK], (0, max(0, i + EVAL_BLOCK - len(ids))), mode='edge')
      n = min(EVAL_BLOCK, len(ids) - i)
      blocks.append((block[:n], self.again_call(
          tuple(kept[k][row[block]] for k in names), jnp.asarray(block, jnp.int32),
          jnp.asarray(np.arange(EVAL_BLOCK) < n), server, global_idx, data)))
    for members, out in jax.device_get(blocks):
      for k, v in out.items():
        counts[k][members] = v[:len(members)]

  def server_arg(self, server, global_sample):
    """What `rows_fn`'s calls take as their server argument: the server state, with the seeds'
    global test samples [R, G] beside it when they are on."""
    return (server, global_sample) if self.global_on else server

  def jobs(self, ids: np.ndarray, reuse: bool) -> list[tuple[int, np.ndarray, int]]:
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
      size = self.placement.rows(min(g.clients_per_call if reuse else len(slots), EVAL_BLOCK))
      jobs += [(gi, np.pad(slots[i:i + size], (0, max(0, i + size - len(slots))), mode='edge'),
                min(size, len(slots) - i)) for i in range(0, len(slots), size)]
    return jobs

  def evaluate(self, state, seed_index: int, data: DeviceData, evaluated_ids: np.ndarray,
               cohort, previous: Evaluation | None = None) -> Evaluation:
    """Seed `seed_index`'s evaluated clients' (`evaluated_ids`) test results with their models
    of `state` (every seed's), on that seed's `data`; `cohort(t)` is its round t's cohort.

    `previous`, an earlier result of `evaluate` on this run's state at an earlier (or the same)
    round, saves work: unless the method's test results read the server's state
    (`Method.eval_reads_server`), a client's results change only when it trains, so only the
    clients sampled in between (each round's cohort is a function of the seed and the round)
    are evaluated again, and the others' results are copied. The results are the same.
    `previous`'s kept values are handed on to the result and updated in place: the caller drops
    `previous` for the result (as the training loop does)."""
    method = self.method
    names = ((*COUNTS, *method.eval_metrics) + (VALIDATION if self.validation else ())
             + ((GLOBAL_CORRECT, *UNSEEN) if self.global_on else ()))
    t = int(state.round)
    # Without a server in the results (or with it in the extras or the header alone, whose
    # inputs are kept), a client's results change only when it trains.
    again = self.again_call is not None
    reuse = not method.eval_reads_server or again
    kept = None
    if (reuse and previous is not None and previous.round <= t
        and (not again or (previous.kept is not None
                           and np.array_equal(previous.evaluated, evaluated_ids)))):
      counts = {k: v.copy() for k, v in previous.counts.items()}
      trained = [cohort(r) for r in range(previous.round, t)]
      ids = np.intersect1d(evaluated_ids, np.concatenate([np.zeros(0, int), *trained]))
      kept = previous.kept and dict(previous.kept)  # moved, not copied (1 GB at N = 1,000)
    else:
      counts = {k: np.full(len(self.group_of), np.nan) for k in names}
      ids = evaluated_ids
    jobs = self.jobs(ids, reuse)
    blocks = self.store.evaluate(state.population, seed_index, jobs, self.calls,
                                 self.server_arg(state.server, self.global_sample), data,
                                 with_state=self.reads_state)
    row = np.full(len(self.group_of), -1)  # a client's row of `kept`, in evaluated_ids' order
    row[evaluated_ids] = np.arange(len(evaluated_ids))
    for (gi, slots, r), (_, _, n) in zip(blocks, jobs):
      members = self.groups[gi].members[slots[:n]]
      for k, v in self.placement.fetch(r).items():
        if k.startswith('kept_'):
          if kept is None:
            kept = {}
          if k not in kept:
            kept[k] = np.zeros((len(evaluated_ids),) + v.shape[1:], v.dtype)
          kept[k][row[members]] = v[:n]
        else:
          counts[k][members] = v[:n]
    if again and len(ids) < len(evaluated_ids):
      self._again(kept, row, np.setdiff1d(evaluated_ids, ids), state.server, seed_index, data,
                  counts)
    self.phase('evaluate')
    per_sample = lambda k: counts[k] / np.maximum(counts['count'], 1)
    metrics = {name: per_sample(name) for name in method.eval_metrics}
    accuracy = per_sample('correct')
    return Evaluation(
        round=t, evaluated=evaluated_ids.copy(), reevaluated=len(ids),
        accuracy=(accuracy if method.headline_metric == 'accuracy'
                  else metrics[method.headline_metric]),  # e.g. FedProto's nearest prototype
        classifier_accuracy=accuracy,
        batch_accuracy=counts['batch_acc_sum'] / np.maximum(counts['num_batches'], 1),
        count=counts['count'].copy(), metrics=metrics, counts=counts,
        global_accuracy=(counts[GLOBAL_CORRECT] / self.global_sample.shape[-1]
                         if self.global_on else None),
        global_unseen_accuracy=(np.where(counts[UNSEEN[1]] > 0, counts[UNSEEN[0]], np.nan)
                                / np.maximum(counts[UNSEEN[1]], 1) if self.global_on else None),
        global_unseen_chance=(  # guessing among the unseen classes it predicts
            np.where(counts[UNSEEN[1]] > 0, counts[UNSEEN[2]], np.nan)
            / np.maximum(counts[UNSEEN[1]] * self.unseen_classes[seed_index], 1)
            if self.global_on else None),
        val_accuracy=(counts['val_correct'] / np.maximum(counts['val_count'], 1)
                      if self.validation else None),
        kept=kept)

  # ------------------------------------------------------------------------------------------
  # Representations
  # ------------------------------------------------------------------------------------------
  def _rep_call(self, g):
    cfg, method = self.train_cfg, self.method

    def rows_reps(group_params, cids, valid, server, data_: DeviceData, state_rows=None):
      del valid
      mapped, row = block_loop(group_params)

      def one(args):
        params, cid, *state = args
        params = method.eval_params(row(params), server, cid)
        idx = data_.test_idx[cid]
        x = augment.normalize(data_.images[idx], cfg.mean, cfg.std)
        forward = self._forward(g, state, server, cid)
        return forward({'params': params}, x)[1].astype(jnp.float16), data_.labels[idx]
      return jax.lax.map(one, (mapped, cids) + ((state_rows,) if self.reads_state else ()))

    return self.store.eval_call(g, self.placement.per_device(rows_reps, self._specs()),
                                with_state=self.reads_state)

  def representations(self, state, seed_index: int, data: DeviceData
                      ) -> dict[str, np.ndarray]:
    """Runs each client's evaluated model (method.eval_params, through method.eval_forward) over
    its padded test split, in blocks of clients, from any store."""
    calls = [self._rep_call(g) for g in self.groups]
    jobs = self.jobs(np.arange(len(self.group_of)), reuse=False)
    test_n = self.placement.fetch(data.test_n)
    reps, labels, clients = [], [], []
    for (gi, slots, r), (_, _, n) in zip(
        self.store.evaluate(state.population, seed_index, jobs, calls, state.server, data,
                            with_state=self.reads_state), jobs):
      r, y = self.placement.fetch(r)
      for i, cid in enumerate(self.groups[gi].members[slots[:n]]):  # drop padding rows
        k = int(test_n[cid])
        reps.append(r[i, :k])
        labels.append(y[i, :k])
        clients.append(np.full(k, cid, np.int32))
    order = np.argsort(np.concatenate(clients), kind='stable')
    return {'representations': np.concatenate(reps)[order],
            'labels': np.concatenate(labels)[order], 'client': np.concatenate(clients)[order]}

  def save_representations(self, state, seed_index: int, data: DeviceData,
                           workdir: str) -> str:
    """Writes the file from process 0; every process must call it (`representations` is
    collective when the clients span several processes)."""
    path = os.path.join(workdir, REPRESENTATIONS_FILE)
    reps = self.representations(state, seed_index, data)
    if jax.process_index() == 0:
      np.savez_compressed(path, **reps)
    return path

