"""On-device training augmentation, in the reference's order (docs/algorithm.md §2).

Applied after normalisation, per sample:
1. random horizontal flip, p = 0.5;
2. RandomErasing: p = 0.5, area scale (0.04, 0.2), aspect ratio (0.5, 2) log-uniform, value 0;
3. random crop of the image's own size (32x32 on CIFAR) after zero-padding by 4.

Zeros after normalisation are the mean colour, as in the reference. Torchvision's RandomErasing
retries up to 10 times until the box fits; with scale <= 0.2 and ratio in [0.5, 2] on square
images the box is at most 0.64 of a side (20x20 on 32x32), so the first try always fits and one
draw is exact. On images of another aspect ratio, where a box could be taller or wider than the
image, it is cut to the image's height and width.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

PAD = 4


def normalize(images_u8: jax.Array, mean, std) -> jax.Array:
  x = images_u8.astype(jnp.float32) / 255.0
  return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)


def _augment_one(key, x):
  h, w, _ = x.shape
  k_flip, k_erase, k_area, k_ratio, k_i, k_j, k_crop = jax.random.split(key, 7)
  # 1. Horizontal flip.
  x = jnp.where(jax.random.bernoulli(k_flip, 0.5), x[:, ::-1, :], x)
  # 2. RandomErasing (torchvision's parameter draw).
  area = h * w * jax.random.uniform(k_area, (), minval=0.04, maxval=0.2)
  aspect = jnp.exp(jax.random.uniform(k_ratio, (), minval=math.log(0.5), maxval=math.log(2.0)))
  eh = jnp.round(jnp.sqrt(area * aspect)).astype(jnp.int32)
  ew = jnp.round(jnp.sqrt(area / aspect)).astype(jnp.int32)
  if round(math.sqrt(0.2 * h * w * 2.0)) > min(h, w):  # (never on square images: no op traced)
    eh, ew = jnp.minimum(eh, h), jnp.minimum(ew, w)
  i = jax.random.randint(k_i, (), 0, h - eh + 1)
  j = jax.random.randint(k_j, (), 0, w - ew + 1)
  rows = jnp.arange(h)[:, None]
  cols = jnp.arange(w)[None, :]
  box = (rows >= i) & (rows < i + eh) & (cols >= j) & (cols < j + ew)
  erase = jax.random.bernoulli(k_erase, 0.5) & box
  x = jnp.where(erase[:, :, None], 0.0, x)
  # 3. Random crop of the zero-padded image.
  off = jax.random.randint(k_crop, (2,), 0, 2 * PAD + 1)
  padded = jnp.pad(x, ((PAD, PAD), (PAD, PAD), (0, 0)))
  return jax.lax.dynamic_slice(padded, (off[0], off[1], 0), x.shape)


def augment_batch(key, x: jax.Array) -> jax.Array:
  """Augments a [B, H, W, C] batch of normalised images; one key per batch."""
  return jax.vmap(_augment_one)(jax.random.split(key, x.shape[0]), x)
