"""What the methods' server rules are made of: masked means of per-client tables, the Inbox
that sums whole uploads as they arrive, per-client tables of rows, and training on a round's
(value, label) pairs."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from fedssa_jax.types import PyTree


def masked_sum(uploads, mask, weights=None):
  """The sum of uploads [N, C, D] over clients where mask [N, C], and its total weight [C].

  `mask` may also hold non-negative per-(client, class) weights (e.g. class sample counts);
  `weights` [N] (e.g. sample counts) weights whole clients. For a server that keeps the sums
  rather than masked_mean's quotient: FD, which subtracts a client's own upload from them."""
  w = mask.astype(uploads.dtype)
  if weights is not None:
    w = w * weights[:, None]
  return jnp.einsum('nc,ncd->cd', w, uploads), w.sum(axis=0)


def masked_mean(uploads, mask, weights=None):
  """Spec V2: the mean of uploads [N, C, D] over clients where mask [N, C]; and whether any.

  `mask` and `weights` as in masked_sum."""
  total_sum, total = masked_sum(uploads, mask, weights)
  return total_sum / jnp.where(total > 0, total, 1.0)[:, None], total > 0


@struct.dataclass
class Inbox:
  """Where a server collects a round's whole uploads (FML's memes, FedKD's updates, the
  LG-FedAvg and FedClassAvg headers): summed in server_receive as chunks arrive, so no [N, ...]
  table of whole models is kept, and divided once in server_aggregate. A field of the method's
  server state.

  Each upload counts 1 (an int32 count; `weighted` False) or its own float weight (e.g. n_k;
  `weighted` True). The two kinds keep their own sums (a masked sum, or a weighted contraction):
  either is the arithmetic the methods' results were made with."""
  sum: PyTree        # the sum of the round's uploads (a pytree shaped like one upload) ...
  weight: jax.Array  # ... and of their weights (int32 count, or float32 total weight)
  weighted: bool = struct.field(pytree_node=False, default=False)

  @classmethod
  def empty(cls, like, weighted: bool = False) -> Inbox:
    """An empty inbox for uploads shaped like `like` (a pytree)."""
    return cls(jax.tree_util.tree_map(jnp.zeros_like, like),
               jnp.zeros((), jnp.float32 if weighted else jnp.int32), weighted)

  def cleared(self) -> Inbox:
    """An empty inbox of the same kind and shapes (for the next round)."""
    return Inbox.empty(self.sum, self.weighted)

  def add(self, payloads, active, weights=None) -> Inbox:
    """Adds a chunk's uploads (leading axis), of its active clients; `weights` [chunk] are the
    uploads' weights (a weighted inbox only)."""
    if self.weighted:
      w = jnp.where(active, weights, 0.0)
      chunk_sum = jax.tree_util.tree_map(lambda a: jnp.tensordot(w, a, axes=1), payloads)
    else:
      chunk_sum = jax.tree_util.tree_map(
          lambda a: jnp.where(active.reshape((-1,) + (1,) * (a.ndim - 1)), a, 0).sum(axis=0),
          payloads)
    chunk_weight = w.sum() if self.weighted else active.sum(dtype=jnp.int32)
    return self.replace(sum=jax.tree_util.tree_map(jnp.add, self.sum, chunk_sum),
                        weight=self.weight + chunk_weight)

  def noised(self, key, std: float) -> Inbox:
    """The inbox with N(0, std^2) noise from `key` on every coordinate of its sum (central
    client-level DP; privacy.add_noise). Its weight, a count of the uploads that arrived, says
    nothing of who sent them."""
    return self.replace(sum=add_gaussian(self.sum, key, std))

  def mean(self):
    """(the (weighted) mean of the round's uploads, whether any arrived)."""
    total = self.weight
    mean = jax.tree_util.tree_map(lambda s: s / jnp.where(total > 0, total, 1.0), self.sum)
    return mean, total > 0


def add_gaussian(tree, key, std: float):
  """`tree` plus N(0, std^2) noise on every coordinate, each leaf's from fold_in(key, leaf
  index) (std 0: `tree` itself): DP-SGD's noise on a gradient sum, and central client-level
  DP's on a sum of uploads."""
  if not std:
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, [
      g + std * jax.random.normal(jax.random.fold_in(key, i), g.shape, g.dtype)
      for i, g in enumerate(leaves)])


def store_rows(table, client_ids, rows, active):
  """Writes each active client's row into `table` [N, ...]; padding (dummy) clients are dropped."""
  ids = jnp.where(active, client_ids, table.shape[0])
  return table.at[ids].set(rows, mode='drop')


def train_on_pairs(params, loss_fn: Callable, tx, values, labels, weights, key, *,
                   epochs: int, batch_size: int):
  """Server-side training on a round's (value, label) pairs, under jit: FedGH's header,
  FedTGP's prototype generator.

  `values` [M, D], `labels` [M] and `weights` [M] (> 0 on the M' valid pairs, 0 elsewhere)
  hold a fixed-shape table of pairs. Each of `epochs` epochs orders them by
  argsort(where(valid, uniform(fold_in(key, epoch)), +inf)), the valid pairs first in a random
  order, and runs ceil(M' / batch_size) steps (a while_loop: the count is dynamic) on batches of
  `batch_size` consecutive pairs, the last one partial; padding positions get weight 0. A step
  is one update of the optax transformation `tx` (its state fresh here) with the gradient of
  `loss_fn(params, x [b, D], y [b], w [b])`, a scalar (a weighted mean over the batch).

  Returns (params, the sum of the steps' losses, the number of steps, the last step's loss:
  what HtFLlib prints; 0 without a step)."""
  m = values.shape[0]
  padded = -(-m // batch_size) * batch_size
  valid = weights > 0
  count = valid.sum()
  num_steps = (count + batch_size - 1) // batch_size
  grad_fn = jax.value_and_grad(loss_fn)

  def epoch(e, carry):
    r = jax.random.uniform(jax.random.fold_in(key, e), (m,))
    order = jnp.pad(jnp.argsort(jnp.where(valid, r, jnp.inf)), (0, padded - m))

    def step(inner):
      j, params, opt_state, loss_sum, _ = inner
      pos = j * batch_size + jnp.arange(batch_size)
      idx = jax.lax.dynamic_slice(order, (j * batch_size,), (batch_size,))
      w = jnp.where(pos < count, weights[idx], 0.0)
      loss, grads = grad_fn(params, values[idx], labels[idx], w)
      updates, opt_state = tx.update(grads, opt_state, params)
      return j + 1, optax.apply_updates(params, updates), opt_state, loss_sum + loss, loss

    _, *carry = jax.lax.while_loop(
        lambda inner: inner[0] < num_steps, step, (jnp.zeros((), jnp.int32), *carry))
    return tuple(carry)

  zero = jnp.zeros((), jnp.float32)
  params, _, loss_sum, last = jax.lax.fori_loop(
      0, epochs, epoch, (params, tx.init(params), zero, zero))
  return params, loss_sum, epochs * num_steps, last
