"""Client FLOPs of local training, from XLA's cost analysis with an analytic cross-check.

Training FLOPs of a client in a round = (forward + backward FLOPs per sample) x (samples actually
processed, E * n_k), docs/algorithm.md §8. The per-sample figure is XLA's count for one gradient
step of the family's model, at the run's batch size, divided by the batch size. It is taken from
the standard-convolution formulation, analysed by the CPU backend, so that it does not depend on
the backend or its choice of kernel (im2col would count its patch copies).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fedssa_jax import models
from fedssa_jax.methods import losses


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
