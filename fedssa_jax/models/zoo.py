"""HtFLlib's image model families (its `HtFE-img-*` groups), in Flax (docs/model_groups.md).

HtFLlib (TsingZ0/HtFLlib) gives client k the architecture k mod |group| of a named group
(`system/main.py`, `args.models`) and splits each model in `BaseHeadSplit`
(`system/flcore/trainmodel/models.py`): the model's classifier (`fc` in all of these) is replaced
by a parameter-free `nn.AdaptiveAvgPool1d(feature_dim)` over the feature axis, so the extractor ends
in a feature_dim-wide representation (512 by default), and a new `nn.Linear(feature_dim,
num_classes)` is the head. Every module here returns `(logits, rep)`, both float32: `rep` is that
pooled representation (`pool_features`, PyTorch's AdaptiveAvgPool1d, as `layers.feature_pool`),
and the logits come from the head, a Dense named `fc3` (`{'fc3': {'kernel': [D, C], 'bias':
[C]}}`, as `models.CNN`'s), so `models.header_rows`, `with_header_rows` and `apply_header` work on
these models too.

The families, and the definitions they follow:
- `fedavgcnn`: HtFLlib's `FedAvgCNN(in_features=3, num_classes, dim=1600)` (models.py): two
  5x5 VALID convolutions (3 -> 32 -> 64, with bias), each ReLU and 2x2 max-pool, flatten in
  PyTorch's (C, H, W) order, fc1 -> 512, ReLU. fc1's input width (1600 at 32x32) is computed
  from the image size.
- `resnet4`, `resnet6`, `resnet8`, `resnet10`: HtFLlib's own ResNet (`trainmodel/resnet.py`,
  `resnet4 = ResNet(BasicBlock, [1])`, `[1, 1]`, `[1, 1, 1]`, `[1, 1, 1, 1]`): torchvision's
  stem, then one BasicBlock per stage for the first 1-4 stages (64, 128, 256, 512 channels), the
  blocks flat as `layer_0`, `layer_1`, ... (its BasicBlock names its norms `bn2`, `bn3`). The
  extractor's features are 64, 128, 256 and 512 wide; AdaptiveAvgPool1d(512) repeats the
  narrower ones.
- `resnet18` ... `resnet152`: `torchvision.models.resnetXX(pretrained=False, num_classes)`
  (pretrained=False is weights=None): BasicBlock [2,2,2,2] and [3,4,6,3], Bottleneck (stride on
  the 3x3, "v1.5") [3,4,6,3], [3,4,23,3], [3,8,36,3]; 512 or 2048 features.
- `mobilenetv2`: HtFLlib's own `mobilenet_v2(pretrained=False, num_classes)`
  (`trainmodel/mobilenet_v2.py`, a copy of an older torchvision MobileNetV2 with its classifier
  split into `dropout` and `fc`): width 1, 1280 features, Dropout(0.2) before the pool.
- `googlenet`: `torchvision.models.googlenet(pretrained=False, aux_logits=False, num_classes)`:
  no auxiliary heads, transform_input=False (its default without weights), its own init
  (init_weights=None -> True), BatchNorm eps 1e-3, ceil-mode max-pools, and torchvision's 3x3 in
  place of the paper's 5x5 branch; 1024 features, Dropout(0.2) before the pool.

Layout: images NHWC; every module and parameter is named after its PyTorch module
(`layer1/0/downsample/0/kernel` is `layer1.0.downsample.0.weight`), so `torch_names` maps a
variable to its PyTorch state_dict entry and `from_torch_state` loads one.

Batch norm: `BatchNorm` below, PyTorch's BatchNorm2d (momentum 0.1, i.e. Flax's 0.9; eps 1e-5,
GoogLeNet's 1e-3): parameters `scale`, `bias` and statistics `mean`, `var` in the `batch_stats`
collection, as flax.linen.BatchNorm's. It normalises as both do; it differs from Flax's in the
running variance, which, as PyTorch's, is updated with the unbiased batch variance (n / (n - 1)
times the biased one that normalises), and, as PyTorch, it refuses to train on one value per
channel. `train=True` normalises with the batch's statistics and needs `mutable=['batch_stats']`;
`train=False` uses the running ones.

Dropout: GoogLeNet and MobileNetV2 keep their Dropout(0.2) in the extractor (HtFLlib replaces
only `fc`), so with `train=True` they need a `'dropout'` rng (`rngs={'dropout': key}`), unless
built with `dropout_rate=0` (`uses_dropout`).

Initialisation, as each PyTorch definition does it: convolutions of the ResNets and MobileNetV2
kaiming_normal(fan_out, gain sqrt 2); GoogLeNet's convolutions normal(0, 0.01) (torchvision's
trunc_normal(std=0.01, a=-2, b=2) truncates at 200 sigma); FedAvgCNN's convolutions and fc1, and
every head, PyTorch's default U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (`layers.torch_uniform_init`);
BatchNorm scale 1, bias 0, running mean 0, variance 1. (The classifiers whose init differs,
torchvision's fc and MobileNetV2's normal(0, 0.01) fc, are the ones HtFLlib removes.) The
distributions are PyTorch's, not its random streams.

Mixed precision as models.py: parameters float32, each layer computed in `dtype` (batch norm's
statistics in float32), logits and rep returned float32.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedssa_jax.models import layers

FEATURE_DIM = 512  # HtFLlib's --feature_dim default

kaiming_fan_out = nn.initializers.variance_scaling(2.0, 'fan_out', 'normal')  # untruncated
googlenet_init = nn.initializers.normal(0.01)


# --- Layers -------------------------------------------------------------------------------------

class BatchNorm(nn.Module):
  """PyTorch's BatchNorm2d over the last axis (module docstring): normalises as PyTorch and
  flax.linen.BatchNorm do, and updates the running variance with the unbiased batch variance."""
  epsilon: float = 1e-5
  momentum: float = 0.9  # Flax's convention: running = momentum * running + (1 - momentum) * batch
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    """`mask` [B] (training): the rows the batch's statistics count (a partial batch's padding
    rows count in none, as if the batch held only its valid rows); None: every row."""
    c = x.shape[-1]
    scale = self.param('scale', nn.initializers.ones, (c,))
    bias = self.param('bias', nn.initializers.zeros, (c,))
    ra_mean = self.variable('batch_stats', 'mean', lambda: jnp.zeros((c,), jnp.float32))
    ra_var = self.variable('batch_stats', 'var', lambda: jnp.ones((c,), jnp.float32))
    xf = x.astype(jnp.promote_types(jnp.float32, self.dtype))  # statistics in float32 at least
    if train:
      axes = tuple(range(x.ndim - 1))
      if math.prod(x.shape[:-1]) < 2:
        raise ValueError(f'Batch norm in training needs more than one value per channel; got '
                         f'input shape {x.shape} (PyTorch refuses it too).')
      if mask is None:
        n = math.prod(x.shape[:-1])
        mean = xf.mean(axes)
        var = jnp.square(xf - mean).mean(axes)
      else:  # the valid rows' values: n = valid rows x positions per row
        w = mask.reshape(mask.shape + (1,) * (x.ndim - 1)).astype(xf.dtype)
        n = w.sum() * math.prod(x.shape[1:-1])
        mean = (w * xf).sum(axes) / jnp.maximum(n, 1.0)
        var = (w * jnp.square(xf - mean)).sum(axes) / jnp.maximum(n, 1.0)
      if not self.is_initializing():
        # A partial batch of one valid value per channel (PyTorch would refuse it) leaves the
        # running variance's update at its biased 0, not n / (n - 1) of it.
        m = self.momentum
        ra_mean.value = m * ra_mean.value + (1 - m) * mean
        ra_var.value = m * ra_var.value + (1 - m) * var * (n / jnp.maximum(n - 1, 1.0))
    else:
      mean, var = ra_mean.value, ra_var.value
    y = (xf - mean) * jax.lax.rsqrt(var + self.epsilon) * scale + bias
    return y.astype(self.dtype)


class Conv2d(nn.Module):
  """PyTorch's Conv2d of NHWC inputs (symmetric padding, groups 1 or depthwise), with nn.Conv's
  parameters (`kernel` HWIO [k, k, cin / groups, features], `bias`), computed in `dtype`.

  Two formulations of the same function (`impl`; 'auto': im2col on the CPU, xla elsewhere):
  - 'xla': lax.conv_general_dilated, the accelerators' library convolution;
  - 'im2col': the k*k shifted, strided views of the padded input side by side, then one matmul
    (depthwise: a sum of k*k products per channel). XLA:CPU differentiates its own convolution
    slowly, the more so inside a loop: a ResNet-18 training step of 64 images in a fori_loop
    took 3.35 s as 'xla' and 0.15 s as 'im2col' on the 2-core CPU (tests/zoo_test.py checks
    that the two agree)."""
  features: int
  kernel: int
  stride: int = 1
  padding: int = 0
  groups: int = 1
  use_bias: bool = False
  kernel_init: Callable = kaiming_fan_out
  bias_init: Callable = nn.initializers.zeros
  dtype: Any = jnp.float32
  impl: str = 'auto'

  @nn.compact
  def __call__(self, x):
    k, s, p, g = self.kernel, self.stride, self.padding, self.groups
    cin = x.shape[-1]
    kernel = self.param('kernel', self.kernel_init, (k, k, cin // g, self.features))
    bias = self.param('bias', self.bias_init, (self.features,)) if self.use_bias else None
    x, kernel = layers.cast(self.dtype, x, kernel)
    impl = self.impl
    if impl == 'auto':
      impl = 'im2col' if jax.default_backend() == 'cpu' else 'xla'
    if impl == 'im2col' and g not in (1, cin):
      impl = 'xla'  # grouped, not depthwise: no such layer in these families
    if impl == 'xla':
      y = jax.lax.conv_general_dilated(
          x, kernel, (s, s), ((p, p), (p, p)), dimension_numbers=('NHWC', 'HWIO', 'NHWC'),
          feature_group_count=g)
    else:
      if p:
        x = jnp.pad(x, ((0, 0), (p, p), (p, p), (0, 0)))
      ho, wo = (x.shape[1] - k) // s + 1, (x.shape[2] - k) // s + 1
      views = [x[:, i:i + (ho - 1) * s + 1:s, j:j + (wo - 1) * s + 1:s]
               for i in range(k) for j in range(k)]  # the order of kernel.reshape(k * k, ...)
      if g == 1:
        y = jnp.concatenate(views, axis=-1) @ kernel.reshape(k * k * cin, self.features)
      else:  # depthwise: features == cin, one k x k filter per channel
        y = sum(v * kernel.reshape(k * k, cin)[i] for i, v in enumerate(views))
    if bias is not None:
      y = y + layers.cast(self.dtype, bias)[0]
    return y


def conv(features: int, kernel: int, stride: int = 1, padding: int = 0, groups: int = 1,
         use_bias: bool = False, kernel_init=kaiming_fan_out, bias_init=nn.initializers.zeros,
         dtype=jnp.float32, name: str | None = None) -> Conv2d:
  """PyTorch's Conv2d(..., kernel, stride, padding, groups, bias) with symmetric padding."""
  return Conv2d(features, kernel, stride, padding, groups, use_bias, kernel_init, bias_init,
                dtype, name=name)


def pool_out_size(n: int, k: int, s: int, p: int, ceil_mode: bool) -> int:
  """PyTorch's pooling output size, ceil_mode's rule included (a last window that would start in
  the right padding is dropped)."""
  out = -(-(n + 2 * p - k) // s) + 1 if ceil_mode else (n + 2 * p - k) // s + 1
  if ceil_mode and (out - 1) * s >= n + p:
    out -= 1
  return out


def max_pool(x, k: int, s: int, p: int = 0, ceil_mode: bool = False):
  """PyTorch's MaxPool2d(k, s, p, ceil_mode) of NHWC `x` (padding is -inf)."""
  pads = [(0, 0)]
  for n in x.shape[1:3]:
    out = pool_out_size(n, k, s, p, ceil_mode)
    pads.append((p, max(p, (out - 1) * s + k - n - p)))
  pads.append((0, 0))
  return jax.lax.reduce_window(x, np.array(-np.inf, x.dtype), jax.lax.max, (1, k, k, 1),
                               (1, s, s, 1), pads)


def pool_features(feat, feature_dim: int):
  """HtFLlib's nn.AdaptiveAvgPool1d(feature_dim) in place of the classifier: `feat` [B, d] ->
  [B, feature_dim] (layers.feature_pool; the identity, skipped, where d == feature_dim)."""
  return feat if feat.shape[-1] == feature_dim else layers.feature_pool(feat, feature_dim)


def split_head(feat, num_classes: int, feature_dim: int, dtype):
  """BaseHeadSplit's tail: the pool, then the head `fc3` (PyTorch's Linear init). Called in a
  module's compact __call__, so fc3 is that module's child. Returns (logits, rep) float32."""
  rep = pool_features(feat, feature_dim)
  logits = layers.Dense(num_classes, dtype=dtype, name='fc3')(rep)
  return layers.cast(jnp.float32, logits, rep)


def relu6(x):
  return jnp.clip(x, 0, 6)


# --- FedAvgCNN ----------------------------------------------------------------------------------

class ConvReLUPool(nn.Module):
  """FedAvgCNN's Sequential(Conv2d 5x5 VALID with bias, ReLU, MaxPool2d(2)): the conv is '0'."""
  features: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    init = layers.torch_uniform_init(x.shape[-1] * 25)
    x = conv(self.features, 5, use_bias=True, kernel_init=init, bias_init=init, dtype=self.dtype,
             name='0')(x)
    return max_pool(nn.relu(x), 2, 2)


class LinearReLU(nn.Module):
  """FedAvgCNN's Sequential(Linear, ReLU): the Linear is '0'."""
  features: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    return nn.relu(layers.Dense(self.features, dtype=self.dtype, name='0')(x))


class FedAvgCNN(nn.Module):
  """HtFLlib's FedAvgCNN(in_features=C, num_classes, dim): conv1, conv2 (5x5 VALID, bias, ReLU,
  2x2 max-pool), fc1 -> 512 + ReLU; its `fc` is the pool. dim (1600 at 32x32x3) follows the
  image size."""
  num_classes: int
  feature_dim: int = FEATURE_DIM
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    del train, mask  # no batch norm, no dropout
    x = ConvReLUPool(32, self.dtype, name='conv1')(x)
    x = ConvReLUPool(64, self.dtype, name='conv2')(x)
    x = jnp.transpose(x, (0, 3, 1, 2)).reshape(x.shape[0], -1)  # torch.flatten of NCHW
    x = LinearReLU(512, self.dtype, name='fc1')(x)
    return split_head(x, self.num_classes, self.feature_dim, self.dtype)


# --- ResNets ------------------------------------------------------------------------------------

class Downsample(nn.Module):
  """The shortcut's Sequential(conv1x1(stride), BatchNorm)."""
  features: int
  stride: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool, mask=None):
    x = conv(self.features, 1, self.stride, dtype=self.dtype, name='0')(x)
    return BatchNorm(dtype=self.dtype, name='1')(x, train, mask)


class BasicBlock(nn.Module):
  """torchvision's BasicBlock (norms `bn1`, `bn2`); HtFLlib's names them `bn2`, `bn3`."""
  planes: int
  stride: int = 1
  bn_names: tuple[str, str] = ('bn1', 'bn2')
  dtype: Any = jnp.float32
  expansion = 1

  @nn.compact
  def __call__(self, x, train: bool, mask=None):
    d = self.dtype
    out = conv(self.planes, 3, self.stride, 1, dtype=d, name='conv1')(x)
    out = nn.relu(BatchNorm(dtype=d, name=self.bn_names[0])(out, train, mask))
    out = conv(self.planes, 3, 1, 1, dtype=d, name='conv2')(out)
    out = BatchNorm(dtype=d, name=self.bn_names[1])(out, train, mask)
    if self.stride != 1 or x.shape[-1] != self.planes:
      x = Downsample(self.planes, self.stride, d, name='downsample')(x, train, mask)
    return nn.relu(out + x)


class Bottleneck(nn.Module):
  """torchvision's Bottleneck (ResNet v1.5: the stride on the 3x3), expansion 4."""
  planes: int
  stride: int = 1
  dtype: Any = jnp.float32
  expansion = 4

  @nn.compact
  def __call__(self, x, train: bool, mask=None):
    d, width, outc = self.dtype, self.planes, self.planes * self.expansion
    out = nn.relu(BatchNorm(dtype=d, name='bn1')(
        conv(width, 1, dtype=d, name='conv1')(x), train, mask))
    out = nn.relu(BatchNorm(dtype=d, name='bn2')(
        conv(width, 3, self.stride, 1, dtype=d, name='conv2')(out), train, mask))
    out = BatchNorm(dtype=d, name='bn3')(conv(outc, 1, dtype=d, name='conv3')(out), train, mask)
    if self.stride != 1 or x.shape[-1] != outc:
      x = Downsample(outc, self.stride, d, name='downsample')(x, train, mask)
    return nn.relu(out + x)


class Stage(nn.Module):
  """torchvision's `layerN`: a Sequential of blocks named '0', '1', ..."""
  block: str
  planes: int
  blocks: int
  stride: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool, mask=None):
    cls = Bottleneck if self.block == 'bottleneck' else BasicBlock
    for i in range(self.blocks):
      x = cls(self.planes, self.stride if i == 0 else 1, dtype=self.dtype, name=str(i))(x, train, mask)
    return x


class ResNet(nn.Module):
  """torchvision's ResNet (`htfl=False`: stages `layer1`..`layer4`) or HtFLlib's
  (`htfl=True`: 1-4 stages of BasicBlocks, flat as `layer_0`, `layer_1`, ...). Its `fc` is the
  pool."""
  block: str  # 'basic' or 'bottleneck'
  layers: tuple[int, ...]
  num_classes: int
  feature_dim: int = FEATURE_DIM
  htfl: bool = False
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    d = self.dtype
    x = conv(64, 7, 2, 3, dtype=d, name='conv1')(x)
    x = nn.relu(BatchNorm(dtype=d, name='bn1')(x, train, mask))
    x = max_pool(x, 3, 2, 1)
    flat = 0
    for stage, (planes, blocks) in enumerate(zip((64, 128, 256, 512), self.layers)):
      stride = 1 if stage == 0 else 2
      if self.htfl:
        for i in range(blocks):
          x = BasicBlock(planes, stride if i == 0 else 1, ('bn2', 'bn3'), d,
                         name=f'layer_{flat}')(x, train, mask)
          flat += 1
      else:
        x = Stage(self.block, planes, blocks, stride, d, name=f'layer{stage + 1}')(x, train, mask)
    x = x.mean(axis=(1, 2))  # AdaptiveAvgPool2d((1, 1)) + flatten
    return split_head(x, self.num_classes, self.feature_dim, d)


# --- MobileNetV2 (HtFLlib's) ---------------------------------------------------------------------

def make_divisible(v: float, divisor: int = 8, min_value: int | None = None) -> int:
  """mobilenet_v2.py's _make_divisible."""
  min_value = divisor if min_value is None else min_value
  new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
  return new_v + divisor if new_v < 0.9 * v else new_v


class ConvBNReLU(nn.Module):
  """Sequential(Conv2d (no bias, padding (k-1)//2), BatchNorm2d, ReLU6): children '0', '1'."""
  features: int
  kernel: int = 3
  stride: int = 1
  groups: int = 1
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool, mask=None):
    x = conv(self.features, self.kernel, self.stride, (self.kernel - 1) // 2, self.groups,
             dtype=self.dtype, name='0')(x)
    return relu6(BatchNorm(dtype=self.dtype, name='1')(x, train, mask))


class InvertedResidualConv(nn.Module):
  """InvertedResidual's `conv` Sequential: [pw ConvBNReLU,] dw ConvBNReLU, pw-linear Conv2d,
  BatchNorm2d, named '0', '1', ..."""
  oup: int
  stride: int
  expand_ratio: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool, mask=None):
    d, i = self.dtype, 0
    hidden = int(round(x.shape[-1] * self.expand_ratio))
    if self.expand_ratio != 1:
      x = ConvBNReLU(hidden, 1, dtype=d, name='0')(x, train, mask)
      i = 1
    x = ConvBNReLU(hidden, 3, self.stride, groups=hidden, dtype=d, name=str(i))(x, train, mask)
    x = conv(self.oup, 1, dtype=d, name=str(i + 1))(x)
    return BatchNorm(dtype=d, name=str(i + 2))(x, train, mask)


class InvertedResidual(nn.Module):
  oup: int
  stride: int
  expand_ratio: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool, mask=None):
    out = InvertedResidualConv(self.oup, self.stride, self.expand_ratio, self.dtype,
                               name='conv')(x, train, mask)
    return x + out if self.stride == 1 and x.shape[-1] == self.oup else out


MOBILENETV2_SETTING = (  # t, c, n, s
    (1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
    (6, 320, 1, 1))


class MobileNetV2Features(nn.Module):
  """MobileNetV2's `features` Sequential ('0' .. '18'), width_mult 1, round_nearest 8."""
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool, mask=None):
    d = self.dtype
    x = ConvBNReLU(make_divisible(32), stride=2, dtype=d, name='0')(x, train, mask)
    i = 1
    for t, c, n, s in MOBILENETV2_SETTING:
      for j in range(n):
        x = InvertedResidual(make_divisible(c), s if j == 0 else 1, t, d, name=str(i))(x, train, mask)
        i += 1
    return ConvBNReLU(make_divisible(1280), 1, dtype=d, name=str(i))(x, train, mask)


class MobileNetV2(nn.Module):
  """HtFLlib's MobileNetV2: features, adaptive average pool, Dropout(0.2); its `fc` is the pool."""
  num_classes: int
  feature_dim: int = FEATURE_DIM
  dropout_rate: float = 0.2
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    x = MobileNetV2Features(self.dtype, name='features')(x, train, mask).mean(axis=(1, 2))
    x = nn.Dropout(self.dropout_rate, deterministic=not train or self.dropout_rate == 0)(x)
    return split_head(x, self.num_classes, self.feature_dim, self.dtype)


# --- GoogLeNet (torchvision's) -------------------------------------------------------------------

class BasicConv2d(nn.Module):
  """GoogLeNet's conv (no bias) + BatchNorm2d(eps=0.001) + ReLU: children `conv`, `bn`."""
  features: int
  kernel: int
  stride: int = 1
  padding: int = 0
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool, mask=None):
    x = conv(self.features, self.kernel, self.stride, self.padding, kernel_init=googlenet_init,
             dtype=self.dtype, name='conv')(x)
    return nn.relu(BatchNorm(epsilon=1e-3, dtype=self.dtype, name='bn')(x, train, mask))


class Branch(nn.Module):
  """An Inception branch's Sequential: BasicConv2d's (features, kernel, padding), named from
  '0'; `pool_first`: MaxPool2d(3, 1, 1, ceil_mode=True) is '0' and the convs follow."""
  convs: tuple[tuple[int, int, int], ...]
  pool_first: bool = False
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool, mask=None):
    if self.pool_first:
      x = max_pool(x, 3, 1, 1, ceil_mode=True)
    for i, (features, kernel, padding) in enumerate(self.convs, start=int(self.pool_first)):
      x = BasicConv2d(features, kernel, padding=padding, dtype=self.dtype, name=str(i))(x, train, mask)
    return x


class Inception(nn.Module):
  """torchvision's Inception block (its 'branch3' is 3x3, torchvision issue 906)."""
  ch1x1: int
  ch3x3red: int
  ch3x3: int
  ch5x5red: int
  ch5x5: int
  pool_proj: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool, mask=None):
    d = self.dtype
    return jnp.concatenate([
        BasicConv2d(self.ch1x1, 1, dtype=d, name='branch1')(x, train, mask),
        Branch(((self.ch3x3red, 1, 0), (self.ch3x3, 3, 1)), dtype=d, name='branch2')(x, train, mask),
        Branch(((self.ch5x5red, 1, 0), (self.ch5x5, 3, 1)), dtype=d, name='branch3')(x, train, mask),
        Branch(((self.pool_proj, 1, 0),), pool_first=True, dtype=d, name='branch4')(x, train, mask),
    ], axis=-1)


GOOGLENET_INCEPTIONS = (  # name, (ch1x1, ch3x3red, ch3x3, ch5x5red, ch5x5, pool_proj), then pool
    ('inception3a', (64, 96, 128, 16, 32, 32), None),
    ('inception3b', (128, 128, 192, 32, 96, 64), (3, 2)),    # maxpool3
    ('inception4a', (192, 96, 208, 16, 48, 64), None),
    ('inception4b', (160, 112, 224, 24, 64, 64), None),
    ('inception4c', (128, 128, 256, 24, 64, 64), None),
    ('inception4d', (112, 144, 288, 32, 64, 64), None),
    ('inception4e', (256, 160, 320, 32, 128, 128), (2, 2)),  # maxpool4
    ('inception5a', (256, 160, 320, 32, 128, 128), None),
    ('inception5b', (384, 192, 384, 48, 128, 128), None),
)


class GoogLeNet(nn.Module):
  """torchvision's GoogLeNet(aux_logits=False, transform_input=False, init_weights=True):
  1024 features, Dropout(0.2); its `fc` is the pool."""
  num_classes: int
  feature_dim: int = FEATURE_DIM
  dropout_rate: float = 0.2
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    d = self.dtype
    x = BasicConv2d(64, 7, 2, 3, dtype=d, name='conv1')(x, train, mask)
    x = max_pool(x, 3, 2, ceil_mode=True)                                  # maxpool1
    x = BasicConv2d(64, 1, dtype=d, name='conv2')(x, train, mask)
    x = BasicConv2d(192, 3, padding=1, dtype=d, name='conv3')(x, train, mask)
    x = max_pool(x, 3, 2, ceil_mode=True)                                  # maxpool2
    for name, channels, pool in GOOGLENET_INCEPTIONS:
      x = Inception(*channels, dtype=d, name=name)(x, train, mask)
      if pool:
        x = max_pool(x, *pool, ceil_mode=True)
    x = x.mean(axis=(1, 2))  # AdaptiveAvgPool2d((1, 1)) + flatten
    x = nn.Dropout(self.dropout_rate, deterministic=not train or self.dropout_rate == 0)(x)
    return split_head(x, self.num_classes, self.feature_dim, d)


# --- Registry -----------------------------------------------------------------------------------

def _resnet(block: str, layers: Sequence[int], htfl: bool = False):
  return functools.partial(ResNet, block, tuple(layers), htfl=htfl)


# name -> constructor(num_classes, feature_dim=..., dtype=...) of an unbound Flax module.
ZOO_FAMILIES: dict[str, Callable[..., nn.Module]] = {
    'fedavgcnn': FedAvgCNN,
    'resnet4': _resnet('basic', [1], htfl=True),
    'resnet6': _resnet('basic', [1, 1], htfl=True),
    'resnet8': _resnet('basic', [1, 1, 1], htfl=True),
    'resnet10': _resnet('basic', [1, 1, 1, 1], htfl=True),
    'resnet18': _resnet('basic', [2, 2, 2, 2]),
    'resnet34': _resnet('basic', [3, 4, 6, 3]),
    'resnet50': _resnet('bottleneck', [3, 4, 6, 3]),
    'resnet101': _resnet('bottleneck', [3, 4, 23, 3]),
    'resnet152': _resnet('bottleneck', [3, 8, 36, 3]),
    'mobilenetv2': MobileNetV2,
    'googlenet': GoogLeNet,
}
ZOO_FAMILY_NAMES = tuple(ZOO_FAMILIES)

# HtFLlib's image groups (system/main.py, --model_family HtFE-img-N), in its order: client k
# gets GROUPS[g][k % len(GROUPS[g])].
GROUPS: dict[str, tuple[str, ...]] = {
    'htfe2': ('fedavgcnn', 'resnet18'),
    'htfe3': ('resnet10', 'resnet18', 'resnet34'),
    'htfe4': ('fedavgcnn', 'googlenet', 'mobilenetv2', 'resnet18'),
    'htfe5': ('googlenet', 'mobilenetv2', 'resnet18', 'resnet34', 'resnet50'),
    'htfe8': ('fedavgcnn', 'googlenet', 'mobilenetv2', 'resnet18', 'resnet34', 'resnet50',
              'resnet101', 'resnet152'),
    'htfe9': ('resnet4', 'resnet6', 'resnet8', 'resnet10', 'resnet18', 'resnet34', 'resnet50',
              'resnet101', 'resnet152'),
}


def uses_dropout(name: str) -> bool:
  """Whether `name`'s extractor has dropout (GoogLeNet, MobileNetV2): training it needs a
  'dropout' rng."""
  return name in ('mobilenetv2', 'googlenet')


def make_zoo_model(name: str, num_classes: int, feature_dim: int,
                   dtype: Any = jnp.float32, **kwargs) -> nn.Module:
  """Family `name` with a d = `feature_dim`-wide representation and a d -> num_classes head;
  `dtype` is the compute dtype (a dtype or a layers.COMPUTE_DTYPES name); kwargs go to the module
  (e.g. dropout_rate)."""
  if name not in ZOO_FAMILIES:
    raise ValueError(f'Unknown zoo family {name!r}; choose one of {ZOO_FAMILY_NAMES}.')
  if isinstance(dtype, str):
    if dtype not in layers.COMPUTE_DTYPES:
      raise ValueError(f'compute dtype must be one of {tuple(layers.COMPUTE_DTYPES)}, '
                       f'got {dtype!r}.')
    dtype = layers.COMPUTE_DTYPES[dtype]
  return ZOO_FAMILIES[name](num_classes, feature_dim=feature_dim, dtype=dtype, **kwargs)


@functools.lru_cache(maxsize=None)
def _init_fn(model: nn.Module, image_shape: tuple[int, ...]):
  def init(key):
    variables = model.init(key, jnp.zeros((1, *image_shape), jnp.float32))
    return {'params': variables['params'], 'batch_stats': variables.get('batch_stats', {})}
  return jax.jit(init)


def init_variables(model: nn.Module, key, image_shape: Sequence[int] = (32, 32, 3)) -> dict:
  """{'params': ..., 'batch_stats': ...} of a fresh `model` (batch_stats {} for FedAvgCNN), by
  one jitted init per (model, image shape), compiled once (ResNet-152's takes 10-15 s on the
  2-core CPU, as long as running the init op by op). For many clients, vmap it over their
  keys: `jax.vmap(lambda k: init_variables(model, k))(keys)`."""
  return _init_fn(model, tuple(image_shape))(key)


# --- PyTorch names ------------------------------------------------------------------------------

def torch_name(collection: str, path: Sequence[str]) -> str:
  """The PyTorch state_dict name of the variable at `path` of `collection` in HtFLlib's
  BaseHeadSplit (`base.` + the model's name; the head `fc3` is `head`)."""
  *modules, leaf = path
  ndim_free = {('params', 'scale'): 'weight', ('batch_stats', 'mean'): 'running_mean',
               ('batch_stats', 'var'): 'running_var'}
  leaf = ndim_free.get((collection, leaf), 'weight' if leaf == 'kernel' else leaf)
  if modules[0] == 'fc3':
    return '.'.join(['head', *modules[1:], leaf])
  return '.'.join(['base', *modules, leaf])


def to_torch_layout(x: np.ndarray) -> np.ndarray:
  """A Flax kernel in PyTorch's layout: conv HWIO -> OIHW, Dense [in, out] -> [out, in]."""
  x = np.asarray(x)
  if x.ndim == 4:
    return x.transpose(3, 2, 0, 1)
  return x.T if x.ndim == 2 else x


def from_torch_layout(x: np.ndarray) -> np.ndarray:
  x = np.asarray(x)
  if x.ndim == 4:
    return x.transpose(2, 3, 1, 0)
  return x.T if x.ndim == 2 else x


def torch_names(variables) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
  """PyTorch name -> (collection + Flax path, PyTorch shape) of every variable."""
  out = {}
  for collection in ('params', 'batch_stats'):
    flat = jax.tree_util.tree_flatten_with_path(variables.get(collection, {}))[0]
    for keypath, leaf in flat:
      path = tuple(k.key for k in keypath)
      shape = tuple(leaf.shape)
      if len(shape) == 4:
        shape = (shape[3], shape[2], shape[0], shape[1])
      elif len(shape) == 2:
        shape = shape[::-1]
      out[torch_name(collection, path)] = ((collection, *path), shape)
  return out


def from_torch_state(variables, state: dict[str, Any], dtype=np.float32) -> dict:
  """`variables` (arrays or shapes) with every entry replaced by PyTorch state_dict `state`'s
  (numpy arrays in torch layout, named as torch_names; num_batches_tracked ignored), as `dtype`.
  Every variable must be there."""
  out = jax.tree_util.tree_map(lambda x: x, dict(variables))
  for name, ((collection, *path), shape) in torch_names(variables).items():
    value = np.asarray(state[name], dtype)
    if tuple(value.shape) != shape:
      raise ValueError(f'{name}: shape {value.shape}, expected {shape}.')
    node = out[collection]
    for k in path[:-1]:
      node = node[k]
    node[path[-1]] = jnp.asarray(from_torch_layout(value))
  return out
