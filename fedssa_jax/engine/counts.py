"""A client's test counts, batch by batch (evaluation.py sums them): the correct predictions,
those under a header from kept representations, a method's extra counts from kept values, and
those of the images of classes the client holds no training sample of (the global test
sample's `unseen` counts: docs/algorithm.md §5).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from fedssa_jax import models
from fedssa_jax.data.partition import DeviceData

# A client's counts of the global test sample's images of the classes it holds no training
# sample of: those it classifies right, all of them, and those it puts in one of those classes.
UNSEEN = ('global_unseen_correct', 'global_unseen_count', 'global_unseen_guessed')


def batch_counts(logits: jax.Array, y: jax.Array, valid: jax.Array):
  """One test batch's correct count and accuracy (the reference's per-batch metric)."""
  correct = jnp.sum((jnp.argmax(logits, -1) == y) & valid)
  return correct, correct / jnp.maximum(valid.sum(), 1)


def unseen_counts(data: DeviceData, cid: jax.Array) -> Callable:
  """The extra counts (`evaluate_client`'s extra_fn) UNSEEN of client `cid`: of a batch's valid
  images whose class has no sample in the client's training split, how many the logits classify
  right, how many there are, and how many the logits put in such a class."""
  train = data.train_idx[cid]
  held = jnp.arange(train.shape[0]) < data.train_n[cid]

  def extra(logits, rep, y, valid):
    del rep
    seen = jnp.zeros(logits.shape[-1], bool).at[data.labels[train]].max(held)
    unseen, guess = valid & ~seen[y], jnp.argmax(logits, -1)
    return dict(zip(UNSEEN, (jnp.sum((guess == y) & unseen), jnp.sum(unseen, dtype=jnp.int32),
                             jnp.sum(unseen & ~seen[guess], dtype=jnp.int32))))
  return extra


def header_counts(reps: jax.Array, idx: jax.Array, n: jax.Array, labels: jax.Array,
                  rows: jax.Array, dtype, extra_fn: Callable | None = None,
                  extra_names: tuple[str, ...] = ()) -> dict:
  """evaluate_client's 'correct' and 'batch_acc_sum' of one client from its kept
  representations of images `idx` (`reps` [batches, b, d]; its `n` first count) under the
  header `rows` [C, d + 1], computed as the model's fc3 computes its logits (in `dtype`), and
  `extra_fn`'s counts `extra_names` of those logits."""
  b = reps.shape[1]
  idx_pad = jnp.pad(idx, (0, reps.shape[0] * b - idx.shape[0]))
  head = models.with_header_rows({}, rows)

  def body(step, acc):
    y = labels[jax.lax.dynamic_slice(idx_pad, (step * b,), (b,))]
    valid = step * b + jnp.arange(b) < n
    logits = models.apply_header(head, reps[step], dtype)
    correct, batch_acc = batch_counts(logits, y, valid)
    extra = extra_fn(logits, reps[step], y, valid) if extra_fn else {}
    return acc[0] + correct, acc[1] + batch_acc, jax.tree.map(jnp.add, acc[2], extra)
  correct, batch_acc_sum, extras = jax.lax.fori_loop(
      0, (n + b - 1) // b, body, (jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32),
                                  {name: jnp.zeros((), jnp.int32) for name in extra_names}))
  return {'correct': correct, 'batch_acc_sum': batch_acc_sum, **extras}


def kept_extras(kept: tuple, test_idx: jax.Array, n: jax.Array, labels: jax.Array,
                extra_fn: Callable, extra_names: tuple[str, ...]) -> dict:
  """The extra counts of one client from its kept test logits and representations (`kept`,
  [batches, b, ...] each; evaluate_client's `keep`), batch by batch as its test loop ran."""
  logits, _ = kept
  b = logits.shape[1]
  idx_pad = jnp.pad(test_idx, (0, logits.shape[0] * b - test_idx.shape[0]))

  def body(step, acc):
    y = labels[jax.lax.dynamic_slice(idx_pad, (step * b,), (b,))]
    valid = step * b + jnp.arange(b) < n
    extra = extra_fn(*(a[step] for a in kept), y, valid)
    return jax.tree_util.tree_map(jnp.add, acc, extra)
  return jax.lax.fori_loop(0, (n + b - 1) // b, body,
                           {name: jnp.zeros((), jnp.int32) for name in extra_names})


