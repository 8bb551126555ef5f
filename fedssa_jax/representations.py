"""Every client's test-set representations with its evaluated model, for the t-SNE figure.

A run with `save_representations=True` writes `representations.npz` into its workdir at the end:
`representations` [M, 500] float16 (M = all clients' test samples), `labels` [M] and `client`
[M] (the client id of each row), in client order.
"""
from __future__ import annotations

import os

import jax
import numpy as np

from fedssa_jax import augment

FILENAME = 'representations.npz'


def compute(sim, state) -> dict[str, np.ndarray]:
  """Runs each client's evaluated model (method.eval_params) over its test split."""
  cfg, data = sim.train_cfg, sim.data
  test_idx, test_n = np.asarray(data.test_idx), np.asarray(data.test_n)
  b = sim.config.eval_batch_size
  out = {'representations': [], 'labels': [], 'client': []}
  for g, group_params in zip(sim.groups, state['params']):

    @jax.jit
    def reps(group_params, server, slot, cid, idx, model=g.model):
      params = jax.tree.map(lambda leaf: leaf[slot], group_params)
      params = sim.method.eval_params(params, server, cid)
      x = augment.normalize(data.images[idx], cfg.mean, cfg.std)
      return model.apply({'params': params}, x)[1]

    for slot, cid in enumerate(g.members):
      n = int(test_n[cid])
      for start in range(0, n, b):
        idx = np.zeros(b, np.int32)  # fixed shape: one compile per group
        idx[:min(b, n - start)] = test_idx[cid, start:start + b]
        rows = min(b, n - start)
        r = np.asarray(reps(group_params, state['server'], slot, cid, idx))[:rows]
        out['representations'].append(r.astype(np.float16))
        out['labels'].append(np.asarray(data.labels)[idx[:rows]])
        out['client'].append(np.full(rows, cid, np.int32))
  order = np.argsort(np.concatenate(out['client']), kind='stable')
  return {k: np.concatenate(v)[order] for k, v in out.items()}


def save(sim, state, workdir: str) -> str:
  path = os.path.join(workdir, FILENAME)
  np.savez_compressed(path, **compute(sim, state))
  return path
