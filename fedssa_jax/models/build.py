"""Every family a client may have, built by name: the five CNNs (cnn.py) and HtFLlib's
(zoo.py); their parameters and parameter counts."""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from fedssa_jax import errors
from fedssa_jax.models import zoo
from fedssa_jax.models.cnn import (CNN, FAMILY_NAMES, feature_sizes, get_family,
                                   resolve_conv_impl)
from fedssa_jax.models.layers import COMPUTE_DTYPES, IMAGE_SHAPE
from fedssa_jax.models.model_state import StatefulModel, split_state


def make_model(family_name: str, num_classes: int, conv_impl: str = 'auto',
               dtype: Any = jnp.float32, forward_only: bool = False, *, feature_dim: int,
               pool_to: int = 0, image_shape: Sequence[int] = IMAGE_SHAPE) -> CNN:
  """`family_name`'s model with a `feature_dim`-wide representation (d: a client model's is
  model.feature_dim, a method's own model may have its own width); `dtype` is its compute dtype
  (a dtype, or a COMPUTE_DTYPES name); `forward_only`: the model is not differentiated (picks
  'auto''s formulation); `pool_to` as CNN's (a method's own model; client models keep 0);
  `image_shape`: the (height, width, channels) of its input images (CIFAR's by default)."""
  if isinstance(dtype, str):
    if dtype not in COMPUTE_DTYPES:
      raise ValueError(f'compute dtype must be one of {tuple(COMPUTE_DTYPES)}, got {dtype!r}.')
    dtype = COMPUTE_DTYPES[dtype]
  if family_name not in FAMILY_NAMES:  # HtFLlib's families (zoo.py), whatever the formulation
    if pool_to:
      raise ValueError(f'pool_to applies to the five CNNs, not to {family_name!r}.')
    return StatefulModel(zoo.make_zoo_model(family_name, num_classes, feature_dim, dtype),
                         tuple(int(d) for d in image_shape))
  feature_sizes(image_shape)  # a ValueError for images too small to build the model for
  return CNN(get_family(family_name), num_classes, feature_dim,
             resolve_conv_impl(conv_impl, forward_only), dtype, pool_to,
             tuple(int(d) for d in image_shape))


def all_family_names() -> tuple[str, ...]:
  """Every model family a client may have: the five CNNs, then HtFLlib's (zoo.py)."""
  return FAMILY_NAMES + zoo.ZOO_FAMILY_NAMES


def feature_dim(config) -> int:
  """d, the width of every client model's representation, read from `config.model.feature_dim`
  (config_lib's configs: 500 for the five CNNs, 512 in HtFLlib's model groups); the header's rows
  hold d + 1 numbers. A config without it is a ConfigError: there is no default width."""
  d = getattr(getattr(config, 'model', None), 'feature_dim', None)
  if d is None:
    raise errors.ConfigError(
        'The config has no model.feature_dim (d, the width of the clients\' representation): '
        'build it with config_lib.base_config() or config_lib.build(), or set model.feature_dim.')
  if isinstance(d, bool) or not isinstance(d, int) or d < 1:
    raise errors.ConfigError(f'model.feature_dim must be a positive integer, got {d!r}.')
  return int(d)


def init_params(model: CNN, key, image_shape: Sequence[int] | None = None) -> Any:
  """`model`'s parameters for images of `image_shape` (default: the model's own image_shape,
  CIFAR's for a model without one)."""
  shape = getattr(model, 'image_shape', IMAGE_SHAPE) if image_shape is None else image_shape
  return model.init(key, jnp.zeros((1, *shape), jnp.float32))['params']


def param_count(params) -> int:
  """Parameters of a row (its model state, if any, is no parameter)."""
  return sum(int(x.size) for x in jax.tree_util.tree_leaves(split_state(params)[0]))
