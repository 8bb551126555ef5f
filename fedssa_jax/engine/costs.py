"""Client FLOPs of local training, from XLA's cost analysis with an analytic cross-check.

Training FLOPs of a client in a round = (forward + backward FLOPs per sample) x (samples actually
processed, E * n_k), docs/algorithm.md §8. The per-sample figure is XLA's count for one gradient
step of the family's model, at the run's batch size, divided by the batch size. It is taken from
the standard-convolution formulation, analysed by the CPU backend, so that it does not depend on
the backend or its choice of kernel (im2col would count its patch copies).

`Flops` is a run's accounting: each family's training step and forward pass, and each client's
training FLOPs per processed sample, its own model's plus what its method adds
(Method.train_flops_per_sample).
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from fedssa_jax import methods, models
from fedssa_jax.methods import losses


class Flops:
  """A run's FLOPs per sample (XLA's counts): `model(family)`, one CE training step of the
  family's model at the run's batch size; `forward(family)`, one forward pass at its evaluation
  batch size; `per_sample`, each group's family's training FLOPs per processed sample, its own
  model's plus what the method adds (e.g. a jointly trained CNN-5); `per_client`, the same for
  each client [N]."""

  def __init__(self, config, num_classes: int, image_shape: tuple[int, ...],
               method: methods.Method, groups: list, group_of: np.ndarray):
    self.num_classes, self.image_shape = num_classes, image_shape
    self.batch_size, self.eval_batch_size = config.batch_size, config.eval_batch_size
    self.feature_dim = config.model.feature_dim
    self.per_sample = {g.family: method.train_flops_per_sample(self.model(g.family), self.model)
                       for g in groups}
    self.per_client = np.array([self.per_sample[groups[g].family] for g in group_of])

  def model(self, family: str) -> float:
    """FLOPs of one CE training step of `family`'s model, per sample (XLA's count)."""
    return model_flops(family, self.num_classes, self.batch_size, self.feature_dim,
                       self.image_shape)

  def forward(self, family: str) -> float:
    """FLOPs of one forward pass of `family`'s model, per sample (XLA's count)."""
    return forward_flops(family, self.num_classes, self.eval_batch_size, self.feature_dim,
                         self.image_shape)


@functools.lru_cache(maxsize=None)
def model_flops(family: str, num_classes: int, batch_size: int, feature_dim: int,
                image_shape: tuple[int, ...] = models.IMAGE_SHAPE) -> float:
  """FLOPs of one CE training step of `family`'s model, per sample (XLA's count), checked
  against the analytic count."""
  xla = xla_train_flops_per_sample(family, num_classes, batch_size, feature_dim, image_shape)
  analytic = analytic_train_flops_per_sample(family, num_classes, feature_dim, image_shape)
  if analytic and not 0.9 < xla / analytic < 1.15:
    logging.warning('FLOPs of %s: XLA counts %.4g per sample, the analytic count %.4g.',
                    family, xla, analytic)
  return xla


@functools.lru_cache(maxsize=None)
def forward_flops(family: str, num_classes: int, batch_size: int, feature_dim: int,
                  image_shape: tuple[int, ...] = models.IMAGE_SHAPE) -> float:
  """FLOPs of one forward pass of `family`'s model, per sample (XLA's count): what the forward
  pass of a method that asks for one (Method.forward_pass) costs per training sample."""
  return xla_forward_flops_per_sample(family, num_classes, batch_size, feature_dim, image_shape)


def xla_train_flops_per_sample(family: str, num_classes: int, batch_size: int,
                               feature_dim: int, image_shape=models.IMAGE_SHAPE) -> float:
  """XLA's FLOP count of one CE gradient step, per sample of `image_shape`, of the model with
  a `feature_dim`-wide representation (d)."""
  model = models.make_model(family, num_classes, conv_impl='xla', feature_dim=feature_dim,
                            image_shape=image_shape)

  def grad(p, x, y, valid):
    return jax.grad(lambda p: losses.cross_entropy_loss(model.apply, p, x, y, valid)[0])(p)
  return _xla_flops_per_sample(model, grad, batch_size)


def xla_forward_flops_per_sample(family: str, num_classes: int, batch_size: int,
                                 feature_dim: int, image_shape=models.IMAGE_SHAPE) -> float:
  """XLA's FLOP count of one forward pass (logits and representation), per sample of
  `image_shape`, of the model with a `feature_dim`-wide representation (d)."""
  model = models.make_model(family, num_classes, conv_impl='xla', feature_dim=feature_dim,
                            image_shape=image_shape)
  return _xla_flops_per_sample(
      model, lambda p, x, y, valid: model.apply({'params': p}, x), batch_size)


def _xla_flops_per_sample(model, fn, batch_size: int) -> float:
  """XLA's FLOP count of fn(params, x, y, valid) on a batch of `batch_size` of the model's
  image_shape, per sample."""
  params = jax.eval_shape(lambda: models.init_params(model, jax.random.PRNGKey(0)))
  x = jax.ShapeDtypeStruct((batch_size, *model.image_shape), jnp.float32)
  y = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
  valid = jax.ShapeDtypeStruct((batch_size,), bool)
  # Counted on the CPU backend on every machine, so the figure does not depend on where the run
  # is (GPU backends give no count for the lowered program, and hide convolutions in library
  # calls once compiled).
  with jax.default_device(jax.devices('cpu')[0]):
    lowered = jax.jit(fn).lower(params, x, y, valid)
    analysis = lowered.cost_analysis() or lowered.compile().cost_analysis()
  if isinstance(analysis, (list, tuple)):  # older JAX returns one dict per device
    analysis = analysis[0]
  if not analysis or 'flops' not in analysis:
    raise RuntimeError(f'XLA gave no FLOP count on {jax.default_backend()}: {analysis!r}')
  return float(analysis['flops']) / batch_size


def analytic_train_flops_per_sample(family: str, num_classes: int, feature_dim: int,
                                    image_shape=models.IMAGE_SHAPE) -> float:
  """2 FLOPs per MAC for forward, weight gradient and input gradient; conv1 needs no input
  gradient. Elementwise ops (ReLU, pooling, softmax) are ignored. 0 for a family with no
  analytic count (those of HtFLlib's groups)."""
  if family not in models.FAMILY_NAMES:
    return 0.0
  macs = models.forward_macs(family, num_classes, feature_dim, image_shape)
  return 2.0 * (3 * macs - models.conv1_macs(image_shape))
