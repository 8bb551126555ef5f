"""Per-example gradient norms without per-example gradients ("ghost" norms), for DP-SGD.

DP-SGD clips each example's gradient to a norm (fedssa_jax/privacy/dp_sgd.py). Building every
example's gradient of a dense layer writes a weight-sized array per example; its squared norm
needs only the layer's input a and output cotangent g: for one example (a batch of one row),
‖∂L/∂W‖² = ‖a‖²‖g‖² and ‖∂L/∂b‖² = ‖g‖². A 5x5 convolution's kernel gradient is small, so it is
built per example from the input's patches, ‖Σ_p patch_p g_pᵀ‖² + ‖Σ_p g_p‖².

A layer marks its output with `tap(y, x, kind, *params)`. Outside `probing`, that returns y and
adds nothing to the program. Inside `probing(probe)` (a scalar of the traced function), it is the
identity on y whose backward pass adds the layer's per-example squared norm to the probe's
cotangent, and passes y's cotangent on unchanged. So the gradient, with respect to the probe, of
one example's loss computed under `probing` is that example's squared gradient norm over every
tapped layer, with no parameter's gradient computed. `Probe.params` records the parameters each
tap covered (by identity), so that a caller can check that the taps cover every trainable
parameter exactly once before it relies on the sum (privacy.ghost_covers).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp

KINDS = ('dense', 'conv5x5')


@dataclasses.dataclass
class Probe:
  value: jax.Array              # the scalar whose cotangent collects the squared norms
  params: list = dataclasses.field(default_factory=list)  # the arrays the taps covered


_ACTIVE: list[Probe] = []


@contextlib.contextmanager
def probing(value: jax.Array):
  """Within the block, tapped layers add their per-example squared gradient norms to `value`'s
  cotangent. Yields the Probe (its `params`: what the taps covered)."""
  probe = Probe(value)
  _ACTIVE.append(probe)
  try:
    yield probe
  finally:
    _ACTIVE.pop()


def tap(y: jax.Array, x: jax.Array, kind: str, *params: jax.Array) -> jax.Array:
  """y, the output of a layer of `kind` on input x with parameters `params` (as the module holds
  them, before any cast): unchanged outside `probing`; inside, marked for the per-example
  norm."""
  if not _ACTIVE:
    return y
  probe = _ACTIVE[-1]
  probe.params.extend(params)
  return _tap(kind, y, x, probe.value)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tap(kind, y, x, probe):
  del kind, x, probe
  return y


def _tap_fwd(kind, y, x, probe):
  del kind
  return y, (x, probe)


def _tap_bwd(kind, residuals, g):
  x, probe = residuals
  sq = squared_norm(kind, x, g).astype(probe.dtype)
  return g, jnp.zeros_like(x), jnp.broadcast_to(sq, probe.shape)


_tap.defvjp(_tap_fwd, _tap_bwd)


def squared_norm(kind: str, x: jax.Array, g: jax.Array) -> jax.Array:
  """The squared norm of the gradient of a layer's kernel and bias, for the rows of `x` (its
  input) and `g` (its output's cotangent) taken as one example (the leading axis summed over)."""
  x, g = x.astype(jnp.float32), g.astype(jnp.float32)
  if kind == 'dense':
    # The kernel's gradient is Σ_r x_r g_rᵀ: its squared norm Σ_{r,r'} (x_r·x_r')(g_r·g_r').
    x, g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    kernel = jnp.sum((x @ x.T) * (g @ g.T))
    return kernel + jnp.sum(jnp.square(g.sum(axis=0)))
  if kind == 'conv5x5':
    patches = jax.lax.conv_general_dilated_patches(
        x, (5, 5), (1, 1), 'VALID', dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
    kernel = jnp.einsum('nhwk,nhwc->kc', patches, g)
    return jnp.sum(jnp.square(kernel)) + jnp.sum(jnp.square(g.sum(axis=(0, 1, 2))))
  raise ValueError(f'Unknown tap kind {kind!r}; known: {KINDS}.')
