"""Where arrays live: the `clients` mesh axis, sharding and padding rows.

With more than one device (`engine.mesh_devices`), the engine builds a one-axis mesh, `clients`.
Every array with a leading client axis (each group's parameters, the per-client state) is
sharded along it with `NamedSharding(mesh, P('clients'))`; that axis is padded to a multiple of
the device count with rows that no client owns (never trained, evaluated results dropped),
because XLA shards only evenly. A chunk's size is a multiple of the device count too, and its
clients train under `jax.shard_map`, each device its own rows. The server state, the data and
the seen masks are replicated: the gather of a chunk from a sharded group, the scatter back, and
the server's receipt of sharded uploads into its replicated state are the collectives, which XLA
inserts under jit. With one device there is no mesh, nothing is padded, and every method here
returns its argument.

Processes: a run may span several processes (hosts, or one per accelerator), joined by
`jax.distributed` (distributed.py). Every process runs the same program on the same inputs; the
mesh then spans all processes' devices. What is split across processes is the client
population: each process holds only its devices' rows. Host values enter the mesh through
`distributed.put` (each process fills its own shards), and every host read of mesh arrays
(`Placement.fetch`) all-gathers them, a collective that every process makes at the same point.
"""
from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from fedssa_jax.engine import distributed
from fedssa_jax.errors import ConfigError
from fedssa_jax.types import PyTree

CLIENTS = 'clients'  # the mesh axis over which client axes are sharded
SHARDED = P(CLIENTS)  # a per_device argument with a leading client axis, each device its rows
REPLICATED = P()      # ... one that every device holds whole


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def make_mesh(mesh_devices: int) -> jax.sharding.Mesh | None:
  """The `clients` mesh over the first `mesh_devices` devices (0: all of them); None for a
  single device, which then runs unsharded programs.

  With one process these are its local devices. With several (`jax.distributed`), the mesh
  spans every process's devices, all of them: a subset would leave some process without a
  device of the mesh."""
  if jax.process_count() > 1:
    devices = jax.devices()
    if mesh_devices not in (0, len(devices)):
      raise ConfigError(
          f'engine.mesh_devices={mesh_devices}, but with {jax.process_count()} processes the '
          f'mesh spans all {len(devices)} of their devices. Use 0, or start fewer processes or '
          'devices per process (--local_device_ids).')
    return jax.sharding.Mesh(np.array(devices), (CLIENTS,))
  devices = jax.local_devices()
  n = mesh_devices or len(devices)
  if n > len(devices):
    raise ConfigError(
        f'engine.mesh_devices={mesh_devices}, but this process has {len(devices)} '
        f'{jax.default_backend()} devices. Use 0 (all of them) or at most {len(devices)}.')
  return None if n == 1 else jax.sharding.Mesh(np.array(devices[:n]), (CLIENTS,))


class Placement:
  """The mesh (or none) and how client-axis and replicated arrays are put on it."""

  def __init__(self, mesh_devices: int):
    self.mesh = make_mesh(mesh_devices)
    self.num_devices = 1 if self.mesh is None else self.mesh.size

  def rows(self, n: int) -> int:
    """Stored rows of a client axis of `n`: a multiple of the device count."""
    return round_up(n, self.num_devices)

  def replicate(self, tree: PyTree) -> PyTree:
    """`tree` on every device of the mesh."""
    return tree if self.mesh is None else distributed.put(tree, NamedSharding(self.mesh, P()))

  def to_device(self, tree: PyTree, stacked: bool = False) -> PyTree:
    """Host rows with a leading client axis (after a seed axis, `stacked`), onto the device
    (sharded along `clients`)."""
    if self.mesh is None:
      return jax.device_put(tree)
    return jax.device_put(tree, NamedSharding(self.mesh, P(*[None] * stacked, CLIENTS)))

  def stack_seeds(self, trees: list, rows=None) -> PyTree:
    """The seeds' `trees` (host or device arrays) stacked on a leading seed axis. `rows`, a
    pytree prefix of one tree (an int, or None for a replicated part): each array's client axis
    is padded to it and sharded along `clients` (each process fills its own shards). Without a
    mesh, one jitted call stacks them on the device."""
    if self.mesh is None:
      return _stack(trees)
    host = [distributed.fetch(t) for t in trees]

    def place(rows_, *parts):
      def one(*a):
        a = np.stack(a)
        if rows_ is None:
          return a
        return np.pad(a, [(0, 0), (0, rows_ - a.shape[1])] + [(0, 0)] * (a.ndim - 2))
      spec = P() if rows_ is None else P(None, CLIENTS)
      return distributed.put(jax.tree.map(one, *parts), NamedSharding(self.mesh, spec))
    return jax.tree.map(place, rows, *host, is_leaf=lambda x: x is None)

  def fetch_seed(self, tree: PyTree, seed_index: int) -> PyTree:
    """Seed `seed_index`'s slice of a stacked tree, on the host (under several processes a
    collective, as `fetch`)."""
    return jax.tree.map(lambda a: a[seed_index], distributed.fetch(tree))

  def constrain(self, tree: PyTree, sharded: bool, stacked: bool = False) -> PyTree:
    """Under jit: `tree`'s arrays sharded along `clients` (or replicated); nothing without a
    mesh. `stacked`: their client axis comes after a leading seed axis, which is not
    sharded."""
    if self.mesh is None:
      return tree
    spec = P(*[None] * stacked, CLIENTS) if sharded else P()
    return jax.lax.with_sharding_constraint(tree, NamedSharding(self.mesh, spec))

  def per_device(self, fn: Callable, in_specs: tuple) -> Callable:
    """`fn`, every output of which has a leading client axis, run by each device on its own
    rows (`jax.shard_map`): `in_specs` says of each argument (a pytree prefix) whether it is
    SHARDED (a leading client axis) or REPLICATED. Without a mesh, `fn` itself."""
    if self.mesh is None:
      return fn
    # check_vma off: `fn` has no collectives, and its outputs are per client by construction.
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=SHARDED,
                         check_vma=False)

  @staticmethod
  def fetch(tree: PyTree) -> PyTree:
    """`tree`'s arrays on the host, in full: under several processes a collective, so every
    process calls it at the same point of the run (see distributed.fetch)."""
    return distributed.fetch(tree)


@jax.jit
def _stack(trees: list) -> PyTree:
  return jax.tree.map(lambda *a: jax.numpy.stack(a), *trees)


def over_replicas(fn: Callable, num_seeds: int, in_axes: tuple) -> Callable:
  """`fn` of one seed, run for each of `num_seeds` on a leading seed axis: `in_axes` says of
  each argument (a pytree prefix) whether it has that axis (0) or is shared (None); every
  output has it. With several seeds, `jax.vmap`; with one, `fn` on the seed's slice, so that a
  run alone computes exactly what it would without the axis (bit for bit)."""
  if num_seeds > 1:
    return jax.vmap(fn, in_axes=in_axes)

  def alone(*args):
    own = lambda axis, arg: arg if axis is None else jax.tree.map(lambda a: a[0], arg)
    args = jax.tree.map(own, in_axes, args, is_leaf=lambda x: x is None)
    return jax.tree.map(lambda a: a[None], fn(*args))
  return alone
