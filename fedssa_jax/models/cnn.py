"""The five CNN families of FedSSA (docs/algorithm.md §1), in Flax.

Every family is

    conv1 5x5 cin->16 VALID, ReLU, maxpool 2   (32 -> 28 -> 14 on CIFAR)
    conv2 5x5 16->c2 VALID, ReLU, maxpool 2    (14 -> 10 -> 5)
    flatten -> fc1 -> ReLU -> fc2 (-> d) -> ReLU = representation
    header fc3: d -> num_classes

with d = `feature_dim`, the width of the representation (`model.feature_dim`; 500 in the paper,
CNN_FEATURE_DIM).

As in the official FedSSA code, the layers follow the input's shape: conv1 takes the images'
channels (1 for grayscale), and fc1's fan-in is the flattened size after conv2's pool (5x5xc2
for 32x32 images, 4x4xc2 for 28x28). A max-pool over an odd size drops the last row or column,
as PyTorch's MaxPool2d(2) does. Images need at least MIN_IMAGE_SIZE pixels a side.

A method may build a family with a narrower fc2 (`feature_dim`, e.g. FedMRL's shared CNN-5 with
a 128-d representation and its own 128 -> num_classes header), or with its representation
average-pooled to a narrower width (`pool_to`, `feature_pool`: HtFLlib's way); the clients'
models are always the plain d-wide ones.

Three formulations compute the same function from the same parameters:
- ``conv_impl='xla'``: ``lax.conv_general_dilated`` + ``reduce_window`` max-pool. Fast on GPU/TPU
  (cuDNN), slow on XLA:CPU.
- ``conv_impl='im2col'``: patches from 25 static slices and one matmul, max-pool as reshape + max.
  About 10x faster on XLA:CPU (docs/benchmarks.md, "CPU kernels and evaluation reuse", has
  the current CPU figures).
- ``conv_impl='band'``: each output row is cut into tiles of a few columns, and a tile is one
  matmul of its 5 input rows against a banded matrix made from the kernel (`banded_conv`). It
  multiplies some zeros, but its matmuls are wider than im2col's skinny [.., 75] @ [75, 16] and
  its patches are fewer: on the 2-core CPU, CNN-1's forward and backward step is about 1.5x
  faster than im2col's (`python -m fedssa_jax.run.bench`).
``conv_impl='auto'`` picks band for training on the CPU and xla elsewhere (and for evaluation).
tests/models_test.py checks that all three agree.

Mixed precision (``engine.compute_dtype``): parameters are always created in float32 (the master
weights, which the optimizer updates and the server aggregates); with ``dtype=jnp.bfloat16`` each
layer casts its input, kernel and bias to bfloat16 before use, so the forward (and the backward
through it) runs in bfloat16, and the model returns its logits and representation as float32,
so that losses, softmax, prototypes and metrics are computed in float32. Gradients with respect
to the float32 parameters come back float32. ``dtype=jnp.float32`` (the default) casts nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedssa_jax.models import ghost
from fedssa_jax.models.layers import (IMAGE_SHAPE, Dense, cast, feature_pool,
                                      torch_uniform_init)

# d of the five CNNs as the paper defines them (fc2's width): config_lib's default of
# model.feature_dim. Functions that build or count a model take d explicitly.
CNN_FEATURE_DIM = 500
KERNEL = 5

# The smallest side the two 5x5 VALID convolutions and 2x2 pools take: (16 - 4) // 2 = 6 -> 2
# -> 1 row after conv2's pool.
MIN_IMAGE_SIZE = 16


@dataclasses.dataclass(frozen=True)
class Family:
  name: str
  c2: int   # conv2 output channels
  fc1: int  # fc1 width


FAMILIES: tuple[Family, ...] = (
    Family('cnn1', 32, 2000),
    Family('cnn2', 16, 2000),
    Family('cnn3', 32, 1000),
    Family('cnn4', 32, 800),
    Family('cnn5', 32, 500),
)
FAMILY_NAMES = tuple(f.name for f in FAMILIES)


def get_family(name: str) -> Family:
  for f in FAMILIES:
    if f.name == name:
      return f
  raise ValueError(f'Unknown model family {name!r}; choose one of {FAMILY_NAMES}.')


CONV_IMPLS = ('auto', 'xla', 'im2col', 'band')


def resolve_conv_impl(conv_impl: str, forward_only: bool = False) -> str:
  """'auto' -> the fastest formulation here: band for training on the CPU, where XLA's native
  convolution is slow to differentiate; xla elsewhere, and for forward-only use (evaluation) on
  the CPU too, where its forward is about 1.4x band's."""
  if conv_impl == 'auto':
    return 'band' if jax.default_backend() == 'cpu' and not forward_only else 'xla'
  if conv_impl not in CONV_IMPLS:
    raise ValueError(f'conv_impl must be one of {CONV_IMPLS}, got {conv_impl!r}.')
  return conv_impl


def feature_sizes(image_shape: Sequence[int]) -> tuple[tuple[int, int], tuple[int, int],
                                                      tuple[int, int]]:
  """(height, width) of conv1's output, conv2's output and conv2's pooled output for images of
  `image_shape` (32x32: (28, 28), (10, 10), (5, 5)). Raises ValueError for images smaller than
  MIN_IMAGE_SIZE a side."""
  h, w = image_shape[:2]
  if min(h, w) < MIN_IMAGE_SIZE:
    raise ValueError(f'Images of {h}x{w} are too small for the CNNs, which need at least '
                     f'{MIN_IMAGE_SIZE}x{MIN_IMAGE_SIZE}.')
  c1 = (h - KERNEL + 1, w - KERNEL + 1)
  c2 = (c1[0] // 2 - KERNEL + 1, c1[1] // 2 - KERNEL + 1)
  return c1, c2, (c2[0] // 2, c2[1] // 2)


def band_tile(width: int) -> int:
  """Output columns per tile of the band formulation: the largest divisor of the output width
  up to 5 (4 of conv1's 28 columns and 5 of conv2's 10 on CIFAR, the tiles measured fastest on
  the 2-core CPU; 4 and 4 for 28x28 images)."""
  return max(t for t in range(1, 6) if width % t == 0)


def banded_conv(x, kernel, tile: int):
  """5x5 VALID convolution of NHWC `x` with an HWIO `kernel`, as one matmul per tile.

  Output rows are cut into tiles of `tile` columns. A tile's input is its KERNEL input rows by
  tile + KERNEL - 1 columns, flattened; the matrix it multiplies holds the kernel on a band
  (entry [(i, a, c), (s, f)] = kernel[i, a - s, c, f] where 0 <= a - s < KERNEL, else 0). The
  zeros cost (tile + KERNEL - 1) / KERNEL times im2col's FLOPs, for matmuls `tile` times wider.
  """
  b, height, width, cin = x.shape
  features = kernel.shape[-1]
  h, w = height - KERNEL + 1, width - KERNEL + 1
  if w % tile:
    raise ValueError(f'tile={tile} must divide the output width {w}.')
  win = tile + KERNEL - 1
  # band[a, s, j] = 1 where input column a of a tile feeds output column s through kernel column j.
  band = np.equal.outer(np.arange(win), np.add.outer(np.arange(tile), np.arange(KERNEL)))
  matrix = jnp.einsum('asj,ijcf->iacsf', band.astype(x.dtype), kernel).reshape(
      KERNEL * win * cin, tile * features)
  rows = jnp.stack([x[:, i:i + h] for i in range(KERNEL)], axis=2)  # [b, h, KERNEL, W, C]
  tiles = jnp.stack([rows[:, :, :, t:t + win] for t in range(0, w, tile)], axis=2)
  y = tiles.reshape(-1, KERNEL * win * cin) @ matrix  # [(b, h, tile index), (s, f)]
  return y.reshape(b, h, w, features)


class Conv5x5(nn.Module):
  """5x5 VALID convolution with an HWIO kernel, in any of the formulations, computed in `dtype`."""
  features: int
  conv_impl: str
  tile: int = 0  # output columns per tile of conv_impl='band'; 0: band_tile(output width)
  dtype: Any = jnp.float32  # compute dtype; the parameters stay float32

  @nn.compact
  def __call__(self, x):
    cin = x.shape[-1]
    fan_in = cin * KERNEL * KERNEL
    kernel = self.param('kernel', torch_uniform_init(fan_in), (KERNEL, KERNEL, cin, self.features))
    bias = self.param('bias', torch_uniform_init(fan_in), (self.features,))
    params = kernel, bias
    x, kernel, bias = cast(self.dtype, x, kernel, bias)
    if self.conv_impl == 'xla':
      y = jax.lax.conv_general_dilated(
          x, kernel, window_strides=(1, 1), padding='VALID',
          dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
    elif self.conv_impl == 'band':
      y = banded_conv(x, kernel, self.tile or band_tile(x.shape[-2] - KERNEL + 1))
    else:
      h, w = x.shape[-3] - KERNEL + 1, x.shape[-2] - KERNEL + 1
      # Channel order (i, j, c) matches kernel.reshape(25*cin, features) for an HWIO kernel.
      patches = jnp.concatenate(
          [x[..., i:i + h, j:j + w, :] for i in range(KERNEL) for j in range(KERNEL)], axis=-1)
      y = patches @ kernel.reshape(fan_in, self.features)
    return ghost.tap(y + bias, x, 'conv5x5', *params)  # DP-SGD's per-example norms


def max_pool_2x2(x, conv_impl: str):
  """2x2 max-pool, stride 2; an odd last row or column is dropped (PyTorch's floor mode)."""
  if conv_impl == 'xla':
    return nn.max_pool(x, (2, 2), strides=(2, 2))
  b, h, w, c = x.shape
  if h % 2 or w % 2:
    x = x[:, :h - h % 2, :w - w % 2]
  return x.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


class CNN(nn.Module):
  """One FedSSA CNN family. Returns (logits, representation), both float32.

  `feature_dim` is fc2's width, d (a client model's: model.feature_dim); `dtype` is the compute
  dtype of every layer (float32 or bfloat16); parameters are float32. `pool_to` > 0: the
  representation is fc2's output average-pooled over its features to this width
  (`feature_pool`), and the header reads that. `image_shape` is the (height, width, channels) of
  the images the model is built for: init_params draws its parameters for that input (the layers
  themselves follow whatever input they get).
  """
  family: Family
  num_classes: int
  feature_dim: int
  conv_impl: str = 'im2col'
  dtype: Any = jnp.float32
  pool_to: int = 0
  image_shape: tuple[int, ...] = IMAGE_SHAPE

  @nn.compact
  def __call__(self, x):
    impl, dtype = self.conv_impl, self.dtype
    # Band tiles from each output width (band_tile): 4 of conv1's 28 columns, 5 of conv2's 10.
    x = max_pool_2x2(nn.relu(Conv5x5(16, impl, dtype=dtype, name='conv1')(x)), impl)
    x = max_pool_2x2(
        nn.relu(Conv5x5(self.family.c2, impl, dtype=dtype, name='conv2')(x)), impl)
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(Dense(self.family.fc1, dtype=dtype, name='fc1')(x))
    rep = nn.relu(Dense(self.feature_dim, dtype=dtype, name='fc2')(x))
    if self.pool_to:
      rep = feature_pool(rep, self.pool_to)
    logits = Dense(self.num_classes, dtype=dtype, name='fc3')(rep)
    return cast(jnp.float32, logits, rep)


def conv1_macs(image_shape: Sequence[int] = IMAGE_SHAPE) -> int:
  """Multiply-accumulates of conv1 on one sample of `image_shape` (28 * 28 * 16 * 75 at 32x32x3)."""
  (h1, w1), _, _ = feature_sizes(image_shape)
  return h1 * w1 * 16 * (image_shape[2] * KERNEL * KERNEL)


def forward_macs(family_name: str, num_classes: int, feature_dim: int,
                 image_shape: Sequence[int] = IMAGE_SHAPE) -> int:
  """Analytic multiply-accumulates of one forward pass of one sample of `image_shape` (32x32x3
  by default: docs/algorithm.md §1, its table), with fc2 `feature_dim` (d) wide."""
  f = get_family(family_name)
  _, (h2, w2), (hp, wp) = feature_sizes(image_shape)
  conv2 = h2 * w2 * f.c2 * (16 * KERNEL * KERNEL)
  return (conv1_macs(image_shape) + conv2 + hp * wp * f.c2 * f.fc1 + f.fc1 * feature_dim +
          feature_dim * num_classes)
