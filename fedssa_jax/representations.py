"""Every client's test-set representations with its evaluated model, for the t-SNE figure.

A run with `save_representations=True` writes `representations.npz` into its workdir at the end:
`representations` [M, 500] float16 (M = all clients' test samples), `labels` [M] and `client`
[M] (the client id of each row), in client order.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from fedssa_jax import augment, population

FILENAME = 'representations.npz'


def compute(sim, state) -> dict[str, np.ndarray]:
  """Runs each client's evaluated model (method.eval_params) over its padded test split: one
  jitted call per group (lax.map over its members), one host transfer per group."""
  cfg, data = sim.train_cfg, sim.data
  test_n = sim.fetch(data.test_n)
  reps, labels, clients = [], [], []
  for g, group_params in zip(sim.groups, state['params']):
    if isinstance(group_params, population.HostRows):  # the host store: put the group on device
      group_params = group_params.tree

    @jax.jit
    def group_reps(group_params, server, model=g.eval_model, members=jnp.asarray(g.members)):
      def one(args):
        slot, cid = args
        params = jax.tree.map(lambda leaf: leaf[slot], group_params)
        params = sim.method.eval_params(params, server, cid)
        idx = data.test_idx[cid]
        x = augment.normalize(data.images[idx], cfg.mean, cfg.std)
        return model.apply({'params': params}, x)[1].astype(jnp.float16), data.labels[idx]
      return jax.lax.map(one, (jnp.arange(len(g.members)), members))

    r, y = sim.fetch(group_reps(group_params, state['server']))
    for slot, cid in enumerate(g.members):  # drop each client's padding rows
      n = int(test_n[cid])
      reps.append(r[slot, :n])
      labels.append(y[slot, :n])
      clients.append(np.full(n, cid, np.int32))
  order = np.argsort(np.concatenate(clients), kind='stable')
  return {'representations': np.concatenate(reps)[order],
          'labels': np.concatenate(labels)[order], 'client': np.concatenate(clients)[order]}


def save(sim, state, workdir: str) -> str:
  """Writes the file from process 0; every process must call it (`compute` is collective when
  the clients span several processes)."""
  path = os.path.join(workdir, FILENAME)
  reps = compute(sim, state)
  if jax.process_index() == 0:
    np.savez_compressed(path, **reps)
  return path
