"""The header (docs/algorithm.md §1): a model's last layer fc3 as a [C, d + 1] table, row s =
(W[s, :], b[s]): what FedSSA, LG-FedAvg, FedClassAvg and FedGH exchange."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedssa_jax.models.layers import Dense


def init_header(key, num_classes: int, feature_dim: int) -> jax.Array:
  """A fresh [num_classes, d + 1] header drawn exactly as a client's fc3 is (PyTorch's init),
  for representations d = `feature_dim` wide."""
  fc3 = Dense(num_classes).init(key, jnp.zeros((1, feature_dim)))['params']
  return header_rows({'fc3': fc3})


def header_rows(params) -> jax.Array:
  """fc3 as [num_classes, d + 1]: row s holds class s's weights and bias."""
  fc3 = params['fc3']
  return jnp.concatenate([fc3['kernel'].T, fc3['bias'][:, None]], axis=1)


def apply_header(params, rep, dtype: Any = jnp.float32) -> jax.Array:
  """The header alone: logits (float32) of representations `rep` [B, d] under params' fc3, as
  the model computes them (in the compute dtype `dtype`), e.g. for a representation the model
  did not make itself."""
  return Dense(params['fc3']['bias'].shape[0], dtype=dtype).apply(
      {'params': params['fc3']}, rep).astype(jnp.float32)


def with_header_rows(params, rows: jax.Array):
  """Returns params with fc3 replaced by the [num_classes, d + 1] table `rows`."""
  fc3 = {'kernel': rows[:, :-1].T, 'bias': rows[:, -1]}
  return {**params, 'fc3': fc3}
