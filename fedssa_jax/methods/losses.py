"""Loss helpers the methods' objectives are made of."""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import optax


def ce_and_correct(logits, y, valid):
  """Mean cross-entropy over the valid samples of a batch, and the number of correct ones."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  loss = jnp.sum(jnp.where(valid, ce, 0.0)) / jnp.maximum(valid.sum(), 1)
  return loss, jnp.sum((jnp.argmax(logits, -1) == y) & valid)


def cross_entropy_loss(apply_fn: Callable, params, x, y, valid):
  """The plain local objective: mean CE of the model on the valid samples."""
  logits, _ = apply_fn({'params': params}, x)
  return ce_and_correct(logits, y, valid)
