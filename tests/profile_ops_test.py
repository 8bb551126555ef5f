"""launch/profile_ops.py reads op names, result shapes and matmul shapes from compiled HLO."""

import jax
import jax.numpy as jnp

from conftest import load_file


def load_script():
  return load_file('launch/profile_ops.py')


def test_parse_finds_each_matmul_with_its_shape_and_flops():
  parse_hlo = load_script().parse_hlo
  a, b, c = jnp.ones((8, 16)), jnp.ones((16, 4)), jnp.ones((3, 8, 5))
  # A plain matmul, and a transposed one with a batch dimension (a vmapped group's form).
  f = lambda a, b, c: (jnp.tanh(a @ b), jnp.einsum('gmk,gkn->gmn', c, jnp.ones((3, 5, 6))))
  ops, dots = parse_hlo(jax.jit(f).lower(a, b, c).compile().as_text())
  found = {}
  for name, (shape, opcode, called) in ops.items():
    dot = dots.get(name) or dots.get(called)
    if dot:
      found[dot] = shape
  # (rows, contracted, columns, FLOPs): 2 FLOPs per multiply-add.
  assert (8, 16, 4, 2 * 8 * 16 * 4) in found
  assert (3 * 8, 5, 6, 2 * 3 * 8 * 5 * 6) in found
  assert len(found) == 2, found
