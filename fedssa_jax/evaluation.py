"""Per-client test evaluation, and every client's test representations (the t-SNE figure).

Each client is evaluated with its current personalised model (`Method.eval_params`) on its own
test split, in blocks of clients per jitted call; the store (population.py) brings a block's
rows to the call. Results are counts per client; `Evaluation` turns them into accuracies.

A run with `save_representations=True` writes `representations.npz` into its workdir at the end:
`representations` [M, 500] float16 (M = all clients' test samples), `labels` [M] and `client`
[M] (the client id of each row), in client order. They are computed the same way, for every
store.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from fedssa_jax import augment, client

# Clients per evaluation call when evaluating a subset, or from a host or disk store.
EVAL_BLOCK = 32
COUNTS = ('correct', 'count', 'batch_acc_sum', 'num_batches')
REPRESENTATIONS_FILE = 'representations.npz'


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


class Evaluator:
  """Evaluates a Simulator's clients: `evaluate(state)` and `representations(state)`."""

  def __init__(self, sim, evaluated_ids: np.ndarray):
    self.sim = sim
    self.evaluated_ids = evaluated_ids
    self.calls = [self._eval_call(g) for g in sim.groups]

  def _per_call(self, g) -> int:
    return self.sim.config.engine.eval_clients_per_call or (
        1 if jax.default_backend() == 'cpu' else g.rows // self.sim.placement.num_devices)

  def _eval_call(self, g):
    """The group's call evaluating a block of members (rows where `valid` is False, padding,
    evaluate no test batch)."""
    sim, per_call = self.sim, self._per_call(g)
    method, cfg = sim.method, sim.train_cfg
    # No client has more than max_test samples, so a smaller batch than that gives the same
    # per-batch results with less padding.
    max_test = sim.data.test_idx.shape[1]
    eval_batch = min(sim.config.eval_batch_size, -(-max_test // 8) * 8)

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

    return sim.store.eval_call(g, sim.placement.per_device(evaluate_rows, num_sharded=3))

  def _jobs(self, ids: np.ndarray, reuse: bool) -> list[tuple[int, np.ndarray, int]]:
    """Blocks of the clients `ids` to evaluate: (group index, slots padded to the block size by
    repeating the last one, count of real slots). With `reuse`, a group's block size is fixed
    (its training chunk's), so that the first, whole evaluation compiles the calls that later
    evaluations of a few trained clients run; otherwise blocks are as large as the group's
    share of `ids` allows, up to EVAL_BLOCK."""
    sim, jobs = self.sim, []
    for gi, g in enumerate(sim.groups):
      slots = sim.slot_of[ids[sim.group_of[ids] == gi]]
      if not len(slots):
        continue
      size = sim.placement.rows(min(g.clients_per_call if reuse else len(slots), EVAL_BLOCK))
      jobs += [(gi, np.pad(slots[i:i + size], (0, max(0, i + size - len(slots))), mode='edge'),
                min(size, len(slots) - i)) for i in range(0, len(slots), size)]
    return jobs

  def evaluate(self, state, previous: Evaluation | None = None) -> Evaluation:
    """Each evaluated client's test results with its current model.

    `previous`, an earlier result of `evaluate` on this run's state at an earlier (or the same)
    round, saves work: unless the method's test results read the server's state
    (`Method.eval_reads_server`), a client's results change only when it trains, so only the
    clients sampled in between (each round's cohort is a function of the seed and the round)
    are evaluated again, and the others' results are copied. The results are the same."""
    sim = self.sim
    method = sim.method
    names = (*COUNTS, *method.eval_metrics)
    t = int(state.round)
    reuse = not method.eval_reads_server
    if reuse and previous is not None and previous.round <= t:
      counts = {k: v.copy() for k, v in previous.counts.items()}
      trained = [sim.cohort(r) for r in range(previous.round, t)]
      ids = np.intersect1d(self.evaluated_ids, np.concatenate([np.zeros(0, int), *trained]))
    else:
      counts = {k: np.full(sim.num_clients, np.nan) for k in names}
      ids = self.evaluated_ids
    jobs = self._jobs(ids, reuse)
    blocks = sim.store.evaluate(state.params, jobs, self.calls, state.server, sim.data)
    for (gi, slots, r), (_, _, n) in zip(blocks, jobs):
      members = sim.groups[gi].members[slots[:n]]
      for k, v in sim.placement.fetch(r).items():
        counts[k][members] = v[:n]
    sim.phase('evaluate')
    per_sample = lambda k: counts[k] / np.maximum(counts['count'], 1)
    metrics = {name: per_sample(name) for name in method.eval_metrics}
    accuracy = per_sample('correct')
    return Evaluation(
        round=t, evaluated=self.evaluated_ids.copy(), reevaluated=len(ids),
        accuracy=(accuracy if method.headline_metric == 'accuracy'
                  else metrics[method.headline_metric]),  # e.g. FedProto's nearest prototype
        classifier_accuracy=accuracy,
        batch_accuracy=counts['batch_acc_sum'] / np.maximum(counts['num_batches'], 1),
        count=counts['count'].copy(), metrics=metrics, counts=counts)

  # ------------------------------------------------------------------------------------------
  # Representations
  # ------------------------------------------------------------------------------------------
  def _rep_call(self, g):
    sim = self.sim
    cfg, model = sim.train_cfg, g.eval_model

    def rows_reps(group_params, cids, valid, server, data_: client.DeviceData):
      del valid
      def one(args):
        params, cid = args
        params = sim.method.eval_params(params, server, cid)
        idx = data_.test_idx[cid]
        x = augment.normalize(data_.images[idx], cfg.mean, cfg.std)
        return model.apply({'params': params}, x)[1].astype(jnp.float16), data_.labels[idx]
      return jax.lax.map(one, (group_params, cids))

    return sim.store.eval_call(g, sim.placement.per_device(rows_reps, num_sharded=3))

  def representations(self, state) -> dict[str, np.ndarray]:
    """Runs each client's evaluated model (method.eval_params) over its padded test split, in
    blocks of clients, from any store."""
    sim = self.sim
    calls = [self._rep_call(g) for g in sim.groups]
    jobs = self._jobs(np.arange(sim.num_clients), reuse=False)
    test_n = sim.placement.fetch(sim.data.test_n)
    reps, labels, clients = [], [], []
    for (gi, slots, r), (_, _, n) in zip(
        sim.store.evaluate(state.params, jobs, calls, state.server, sim.data), jobs):
      r, y = sim.placement.fetch(r)
      for i, cid in enumerate(sim.groups[gi].members[slots[:n]]):  # drop padding rows
        k = int(test_n[cid])
        reps.append(r[i, :k])
        labels.append(y[i, :k])
        clients.append(np.full(k, cid, np.int32))
    order = np.argsort(np.concatenate(clients), kind='stable')
    return {'representations': np.concatenate(reps)[order],
            'labels': np.concatenate(labels)[order], 'client': np.concatenate(clients)[order]}

  def save_representations(self, state, workdir: str) -> str:
    """Writes the file from process 0; every process must call it (`representations` is
    collective when the clients span several processes)."""
    path = os.path.join(workdir, REPRESENTATIONS_FILE)
    reps = self.representations(state)
    if jax.process_index() == 0:
      np.savez_compressed(path, **reps)
    return path

