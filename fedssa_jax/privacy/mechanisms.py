"""The mechanisms' device-side parts: Poisson batches (a step's batch under DP-SGD), clipping to a
norm and Gaussian noise, and the upload transform of client-level DP with its keys
(docs/algorithm.md §11). They run inside the compiled calls: training.local_train's steps
(dp_sgd.py), and simulator.local_round's uploads and the server's central noise."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedssa_jax.methods import aggregation
from fedssa_jax.streams import SERVER_UPLOAD_ID, Stream

# P(a Poisson batch holds more than `max_batch` samples), per step, at the automatic bound.
TRUNCATION_TAIL = 1e-12


# ----------------------------------------------------------------------------------------------
# Poisson batches
# ----------------------------------------------------------------------------------------------
def max_batch(batch_size: int, max_train: int, pass_size: int, given: int = 0) -> int:
  """The rows of a Poisson batch of expected size `batch_size`: `given`, or the smallest count
  that a batch exceeds with probability below TRUNCATION_TAIL (Poisson's tail, which bounds the
  binomial's of the same mean), at most the longest training split, rounded up to whole passes."""
  from scipy import stats  # dp_accounting's dependency
  rows = given or int(stats.poisson.isf(TRUNCATION_TAIL, batch_size)) + 1
  rows = max(1, min(rows, max_train))
  return -(-rows // pass_size) * pass_size


def sampling_rate(batch_size, n):
  """q = min(1, B / n) in float32, as the step draws with it (host and device alike)."""
  if isinstance(n, jax.Array):
    return jnp.minimum(jnp.float32(1), jnp.float32(batch_size) / n.astype(jnp.float32))
  n = np.asarray(n)
  return np.minimum(np.float32(1), np.float32(batch_size) / np.maximum(n, 1).astype(np.float32))


def poisson_batch(key, n, padded_len: int, q, rows: int):
  """A step's Poisson batch: each of the positions 0..n-1 taken with probability q. Returns
  (positions [rows], valid [rows]): the taken positions first (a uniform subset of them if more
  than `rows` were taken), then padding."""
  u = jax.random.uniform(key, (padded_len,))
  taken = (u < q) & (jnp.arange(padded_len) < n)
  order = jnp.argsort(jnp.where(taken, u, 2.0))
  if rows > padded_len:
    order = jnp.pad(order, (0, rows - padded_len))
  return order[:rows], jnp.arange(rows) < taken.sum()


# ----------------------------------------------------------------------------------------------
# Clipping and noise
# ----------------------------------------------------------------------------------------------
def clip_factor(grads, clip_norm: float):
  """Per example (the leaves' leading axis): min(1, clip_norm / its global gradient norm)."""
  sq = sum(jnp.sum(jnp.square(g.reshape(g.shape[0], -1)), axis=1) for g in jax.tree.leaves(grads))
  return clip_scale(jnp.sqrt(sq), clip_norm)


def clip_scale(norm, clip_norm: float):
  """min(1, clip_norm / norm), elementwise; 1 where clip_norm is infinite."""
  if math.isinf(clip_norm):
    return jnp.ones_like(norm)
  return clip_norm / jnp.maximum(norm, clip_norm)


def add_noise(grad_sum, key, std: float, denom):
  """(grad_sum + N(0, std^2) on every coordinate) / denom; each leaf's noise from its own key
  (fold_in(key, leaf index))."""
  return jax.tree.map(lambda g: g / denom, aggregation.add_gaussian(grad_sum, key, std))


# ----------------------------------------------------------------------------------------------
# The upload transform of client-level DP (inside the round's call)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class UploadDP:
  """Client-level DP's static settings, as the round's call holds them (hashable)."""
  fields: tuple[str, ...]  # the payload's private fields (Method.private_upload)
  clip_norm: float         # C_u
  std: float               # the noise each client adds: z C_u (local), 0 (central)


def upload_keys(root_key, round_index, client_ids):
  """Each client's key of its upload noise in round `round_index`: fold_in(fold_in(fold_in(root
  key, Stream.UPLOAD), round), client id)."""
  round_key = jax.random.fold_in(jax.random.fold_in(root_key, Stream.UPLOAD), round_index)
  return jax.vmap(lambda c: jax.random.fold_in(round_key, c))(client_ids)


def server_upload_key(root_key, round_index):
  """The server's key of its central noise in round `round_index` (Stream.UPLOAD, at
  streams.SERVER_UPLOAD_ID)."""
  return upload_keys(root_key, round_index, jnp.array([SERVER_UPLOAD_ID]))[0]


def privatize_upload(payload, reference, key, *, fields: tuple[str, ...], clip_norm: float,
                     std: float):
  """One client's upload under client-level DP: its `fields`, less `reference` (a dict of them,
  or None: zero), clipped jointly to the global norm `clip_norm`, plus N(0, std^2) on every
  coordinate (each leaf's from fold_in(key, leaf index); std 0: none), plus `reference` again.
  The payload's other fields pass as they are. Returns (the payload, the norm before the clip)."""
  values = {f: getattr(payload, f) for f in fields}
  ref = jax.tree.map(jnp.zeros_like, values) if reference is None else reference
  delta = jax.tree.map(jnp.subtract, values, ref)
  norm = optax.global_norm(delta)
  scale = clip_scale(norm, clip_norm)
  noised = add_noise(jax.tree.map(lambda d: d * scale, delta), key, std, 1.0)
  return payload.replace(**jax.tree.map(jnp.add, ref, noised)), norm
