"""Each client's per-sample loss on a set of its own, with its personalised model as evaluation
sees it (`Method.eval_params`, through `Method.eval_forward` where the method declares
`eval_reads_state`): what the audit's attacks score. The calls run from the run's store, in
blocks of clients, as evaluation's do (engine/evaluation.py)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fedssa_jax.data import augment
from fedssa_jax.engine.evaluation import ROWS_SPECS, STATE_SPEC
from fedssa_jax.engine.state import block_loop


def _rows_fn(sim, g, batch: int):
  """Group `g`'s call: each block member's cross-entropy on the rows `test_idx[cid]` of the
  data it is given, in batches of `batch`."""
  method, cfg, reads_state = sim.method, sim.train_cfg, sim.method.eval_reads_state

  def rows(group_params, cids, valid, server, data_, state_rows=None):
    del valid
    mapped, row = block_loop(group_params)  # the rows, or the slots of the table's rows

    def one(args):
      params, cid, *state = args
      params = method.eval_params(row(params), server, cid)
      if reads_state:
        forward = lambda v, x: method.eval_forward(g.eval_model.apply, v['params'], state[0],
                                                   server, cid, x)
      else:
        forward = g.eval_model.apply

      def losses(idx):
        x = augment.normalize(data_.images[idx], cfg.mean, cfg.std)
        logp = jax.nn.log_softmax(forward({'params': params}, x)[0].astype(jnp.float32))
        return -jnp.take_along_axis(logp, data_.labels[idx][:, None], axis=1)[:, 0]
      return jax.lax.map(losses, data_.test_idx[cid].reshape(-1, batch)).reshape(-1)
    return jax.lax.map(one, (mapped, cids) + ((state_rows,) if reads_state else ()))

  specs = ROWS_SPECS + ((STATE_SPEC,) if reads_state else ())
  return sim.store.eval_call(g, sim.placement.per_device(rows, specs), with_state=reads_state)


def client_losses(sim, state, sets: list[np.ndarray], batch: int = 64) -> list[np.ndarray]:
  """Client k's per-sample loss on the data set's rows `sets[k]` (their labels the data set's),
  for every client k of seed 0 of `sim` at `state`."""
  width = max(max((len(s) for s in sets), default=0), 1)
  width = -(-width // batch) * batch
  idx = np.zeros((len(sets), width), np.int32)
  for k, s in enumerate(sets):
    idx[k, :len(s)] = s
  data_ = dataclasses.replace(sim.seed_data[0],
                              test_idx=sim.placement.replicate(jnp.asarray(idx)))
  calls = [_rows_fn(sim, g, batch) for g in sim.groups]
  jobs = sim.evaluator.jobs(np.arange(sim.num_clients), reuse=False)
  out = [None] * len(sets)
  for (gi, slots, r), (_, _, n) in zip(
      sim.store.evaluate(state.population, 0, jobs, calls, state.server, data_,
                         with_state=sim.method.eval_reads_state), jobs):
    r = np.asarray(sim.placement.fetch(r))
    for i, cid in enumerate(sim.groups[gi].members[slots[:n]]):
      out[cid] = r[i, :len(sets[cid])]
  return out
