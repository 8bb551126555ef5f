"""The XLA flags the package sets when imported (fedssa_jax.XLA_FLAGS): the caller's own kept,
and the copy the region analysis removes actually gone from a compiled training loop."""
import os

import jax
import jax.numpy as jnp
import optax

import fedssa_jax


def test_the_callers_flags_are_kept_and_the_package_adds_its_own():
  defaults = {'xla_a': 'true', 'xla_b': '0'}
  assert fedssa_jax.with_xla_flags('', defaults) == '--xla_a=true --xla_b=0'
  # a flag the caller names is theirs, whatever its value, and with or without one
  assert fedssa_jax.with_xla_flags('--xla_a=false --xla_c=1', defaults) == (
      '--xla_a=false --xla_c=1 --xla_b=0')
  assert fedssa_jax.with_xla_flags('--xla_b', defaults) == '--xla_b --xla_a=true'
  assert fedssa_jax.with_xla_flags('--xla_ab=1', defaults) == '--xla_ab=1 --xla_a=true --xla_b=0'
  # this process (conftest imports the package before JAX starts) has them
  for name in fedssa_jax.XLA_FLAGS:
    assert f'--{name}=' in os.environ['XLA_FLAGS']


def _loop_copies(hlo: str, shape: str) -> list:
  """The ops of compiled `hlo` outside its entry computation (in a loop's body) that copy an
  array of `shape` (as 'f32[256,128]')."""
  copies, entry = [], False
  for line in hlo.splitlines():
    if line and not line[0].isspace():
      entry = line.startswith('ENTRY')
    elif not entry and ' copy(' in line and line.split('=')[1].split('{')[0].strip() == shape:
      copies.append(line.strip()[:120])
  return copies


def test_a_loop_of_sgd_steps_updates_its_weights_where_they_lie():
  """Without the region analysis of XLA:CPU's copy insertion, a weight that the backward pass
  reads and the update writes is copied on every step: two more passes over the parameters
  of steps bound by them at batch 10 (a round of the five CNNs 18% slower at N = 1,000).
  Checked to fail with XLA_FLAGS=--xla_cpu_copy_insertion_use_region_analysis=false."""
  def train(w, xs):
    def step(w, x):
      g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w['a']) @ w['b']))(w)
      return optax.apply_updates(w, jax.tree.map(lambda g: -0.01 * g, g)), None
    return jax.lax.scan(step, w, xs)[0]

  w = {'a': jnp.ones((64, 256)), 'b': jnp.ones((256, 128))}
  hlo = jax.jit(train).lower(w, jnp.ones((5, 10, 64))).compile().as_text()
  assert 'while' in hlo
  assert not _loop_copies(hlo, 'f32[256,128]') and not _loop_copies(hlo, 'f32[64,256]')
