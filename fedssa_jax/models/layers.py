"""Building blocks every model family shares: PyTorch's initialisation, its Linear layer as a
Flax Dense, the compute-dtype cast, HtFLlib's feature pooling, and the default input shape."""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedssa_jax.models import ghost

IMAGE_SHAPE = (32, 32, 3)  # CIFAR's (height, width, channels): the default input shape


def torch_uniform_init(fan_in: int):
  """PyTorch's default Conv2d/Linear init: U(-1/sqrt(fan_in), +1/sqrt(fan_in))
  (docs/algorithm.md §1)."""
  bound = 1.0 / math.sqrt(fan_in)

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


def cast(dtype, *xs):
  """`xs` in `dtype` (the compute dtype); arrays already in it are returned as they are."""
  return tuple(x if x.dtype == dtype else x.astype(dtype) for x in xs)


class Dense(nn.Module):
  """Fully connected layer, computed in `dtype` (the parameters stay float32)."""
  features: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    fan_in = x.shape[-1]
    kernel = self.param('kernel', torch_uniform_init(fan_in), (fan_in, self.features))
    bias = self.param('bias', torch_uniform_init(fan_in), (self.features,))
    params = kernel, bias
    x, kernel, bias = cast(self.dtype, x, kernel, bias)
    return ghost.tap(x @ kernel + bias, x, 'dense', *params)  # DP-SGD's per-example norms


def feature_pool(rep, width: int) -> jax.Array:
  """PyTorch's AdaptiveAvgPool1d(width) over the last axis of `rep` [B, D] (docs/algorithm.md,
  FedMRL): output i is the mean of inputs floor(i D / width) .. ceil((i + 1) D / width) - 1,
  windows that overlap where width does not divide D. One matmul with a constant matrix."""
  d = rep.shape[-1]
  pool = np.zeros((d, width), np.float32)
  for i in range(width):
    lo, hi = i * d // width, -(-(i + 1) * d // width)
    pool[lo:hi, i] = 1.0 / (hi - lo)
  return rep @ jnp.asarray(pool, rep.dtype)


COMPUTE_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
