"""DP-SGD's step (device side, inside training.local_train): its static settings (`DPSGD`,
`dp_sgd_settings`) and the batch's noisy sum of per-example clipped gradients
(`noisy_clipped_grads`), each example's norm from ghost norms where they are exact
(`ghost_covers`, models/ghost.py), else from its gradient, built. The Poisson batch, the clip and
the noise are mechanisms.py's."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from fedssa_jax.models import ghost
from fedssa_jax.privacy.mechanisms import add_noise, clip_factor, clip_scale, max_batch

def pass_size_for(given: int, backend: str) -> int:
  """`privacy.pass_size` (the examples whose gradients per_example 'vmap' builds at once), or
  by backend: one example at a time on the CPU, where a loop of single-example gradients ran
  2.9x faster than vmapped passes of 16 (CNN-3, 64 examples: 58 ms against 168 ms, 11 ms
  without DP-SGD) and holds the least memory; 16 elsewhere."""
  return given or (1 if backend == 'cpu' else 16)


@dataclasses.dataclass(frozen=True)
class DPSGD:
  """DP-SGD's static settings, as training.TrainConfig holds them (hashable)."""
  clip_norm: float
  noise_multiplier: float
  max_batch: int   # rows of a step's Poisson batch
  pass_size: int   # examples per pass of per-example gradients ('vmap'); divides max_batch
  per_example: str = 'auto'  # 'auto' (ghost norms where the taps cover the model) or 'vmap'
  ghost_pass: int = 0        # rows per pass of the ghost norms; divides max_batch (0: all)
  # A method's private releases of class sums (releases.py; Method.release_values): the clip
  # C_r and the noise multiplier z_r, the accountant's (given, or sigma).
  release_clip: float = 0.0
  release_noise_multiplier: float = 0.0


def dp_sgd_settings(clip_norm: float, noise_multiplier: float, batch_size: int,
                    max_train: int, pass_size: int, per_example: str, micro_batch: int,
                    given_rows: int = 0, release_clip: float = 0.0,
                    release_noise_multiplier: float = 0.0) -> DPSGD:
  """DPSGD for batches of expected size `batch_size`: ghost norms ('auto') run in the engine's
  passes of plain training (`micro_batch` rows) where it splits a batch, else all of a step's
  rows at once; the Poisson batch's rows (max_batch) are whole passes of both ways."""
  ghost_pass = micro_batch if per_example == 'auto' and micro_batch < batch_size else 0
  rows = max_batch(batch_size, max_train, math.lcm(pass_size, ghost_pass or 1), given_rows)
  return DPSGD(clip_norm=clip_norm, noise_multiplier=noise_multiplier, max_batch=rows,
               pass_size=pass_size, per_example=per_example, ghost_pass=ghost_pass,
               release_clip=release_clip, release_noise_multiplier=release_noise_multiplier)

def noisy_clipped_grads(loss_of: Callable, trainable, views, y, valid, key, denom, *,
                        clip_norm: float, noise_multiplier: float, pass_size: int,
                        per_example: str = 'auto', ghost_pass: int = 0):
  """DP-SGD's gradient of a batch: each valid example's gradient of `loss_of` (called on a batch
  of one), over the whole `trainable` tree, clipped to the global norm `clip_norm`; their sum
  plus N(0, (noise_multiplier clip_norm)^2) noise from `key` on every coordinate, divided by
  `denom`. Returns (the batch-mean loss, #correct, the accumulator's sum, the gradient), like
  training.batch_grads.

  per_example 'vmap': each example's gradient is built, in passes of `pass_size` rows.
  'auto': where the model's layers' taps cover every trainable parameter once (ghost_covers),
  the norms come from the layers' inputs and output cotangents (models/ghost.py) and the clipped
  sum from one backward pass of the examples' losses weighted by their clip factors, in passes
  of `ghost_pass` rows (0: the whole batch); else as 'vmap'. Only passes that hold a valid
  example run (the valid rows come first)."""
  def one(t, ex_views, ex_y, ex_valid):
    return loss_of(t, tuple(v[None] for v in ex_views), ex_y[None], ex_valid[None])

  if per_example == 'auto' and ghost_covers(one, trainable, views, y, valid):
    m = ghost_pass or y.shape[0]
    pass_sums = functools.partial(_ghost_pass, one, clip_norm)
  else:
    m = pass_size
    pass_sums = functools.partial(_vmap_pass, one, clip_norm)
  if y.shape[0] % m:
    raise ValueError(f'The pass size {m} must divide the batch rows {y.shape[0]}.')

  def one_pass(j, sums):
    part = lambda a: jax.lax.dynamic_slice_in_dim(a, j * m, m)
    loss, correct, acc, grad = pass_sums(trainable, tuple(map(part, views)), part(y),
                                         part(valid))
    return jax.tree.map(jnp.add, sums, (loss, correct, acc, grad))

  # The accumulator's zeros, shaped as one example's.
  acc_shape = jax.eval_shape(
      lambda: one(trainable, tuple(v[0] for v in views), y[0], valid[0])[1][1])
  zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32),
           jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), acc_shape),
           jax.tree.map(jnp.zeros_like, trainable))
  count = valid.sum()
  loss_sum, correct, acc, grad_sum = jax.lax.fori_loop(0, (count + m - 1) // m, one_pass, zeros)
  return (loss_sum / jnp.maximum(count, 1), correct, acc,
          add_noise(grad_sum, key, noise_multiplier * clip_norm if noise_multiplier else 0.0,
                    denom))


def _vmap_pass(one, clip_norm, trainable, views, y, valid):
  """A pass's sums (loss, #correct, accumulator, clipped gradient) from each example's
  gradient, built by vmap."""
  per_example = jax.vmap(jax.value_and_grad(one, has_aux=True), in_axes=(None, 0, 0, 0))
  (loss, (correct, acc)), grads = per_example(trainable, views, y, valid)
  scale = jnp.where(valid, clip_factor(grads, clip_norm), 0.0)
  return (jnp.where(valid, loss, 0.0).sum(), correct.sum(),
          jax.tree.map(lambda a: a.sum(axis=0), acc),
          jax.tree.map(lambda g: jnp.tensordot(scale, g, axes=1), grads))


def _ghost_pass(one, clip_norm, trainable, views, y, valid):
  """A pass's sums from ghost norms: the gradient, with respect to a zero probe per example, of
  the examples' losses with the layers tapped is each one's squared gradient norm; then the
  gradient of the losses weighted by their clip factors is the sum of the clipped gradients."""
  def probed_loss(probes):
    def example(ex_views, ex_y, ex_valid, probe):
      with ghost.probing(probe):
        return one(trainable, ex_views, ex_y, ex_valid)[0]
    losses = jax.vmap(example)(views, y, valid, probes)
    return jnp.where(valid, losses, 0.0).sum()

  sq = jax.grad(probed_loss)(jnp.zeros(y.shape[0], jnp.float32))
  scale = jax.lax.stop_gradient(
      jnp.where(valid, clip_scale(jnp.sqrt(jnp.maximum(sq, 0.0)), clip_norm), 0.0))

  def weighted(t):
    loss, (correct, acc) = jax.vmap(one, in_axes=(None, 0, 0, 0))(t, views, y, valid)
    return jnp.sum(scale * loss), (jnp.where(valid, loss, 0.0).sum(), correct.sum(),
                                   jax.tree.map(lambda a: a.sum(axis=0), acc))
  grads, (loss, correct, acc) = jax.grad(weighted, has_aux=True)(trainable)
  return loss, correct, acc, grads


def ghost_covers(one, trainable, views, y, valid) -> bool:
  """Whether one example's loss, traced with the layers tapped (models/ghost.py), passes every
  leaf of `trainable` through exactly one tap: then the taps' squared norms sum to the
  example's squared gradient norm. Not so for a parameter used outside the tapped layers (a
  raw array, a layer of another kind) or by two of them (a layer applied twice)."""
  verdict = []

  def trace(t, ex_views, ex_y, ex_valid):
    with ghost.probing(jnp.zeros((), jnp.float32)) as probe:
      one(t, ex_views, ex_y, ex_valid)
    covered = [id(p) for p in probe.params]
    leaves = {id(leaf) for leaf in jax.tree.leaves(t)}
    verdict.append(len(covered) == len(set(covered)) and set(covered) == leaves)

  jax.eval_shape(trace, trainable, tuple(v[0] for v in views), y[0], valid[0])
  return verdict[0]
