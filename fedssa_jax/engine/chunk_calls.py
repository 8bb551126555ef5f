"""The jitted calls that train a chunk of clients: `jit_chunk_call` (one call, over the seeds)
and the device store's pair of them, `TrainThenWrite` (population.py)."""
from __future__ import annotations

from typing import Callable

import jax

from fedssa_jax.engine.placement import Placement, over_replicas
from fedssa_jax.engine.state import SEED_AXES


def jit_chunk_call(call: Callable, place: Placement, num_seeds: int,
                   donate: tuple[int, ...] = (0, 1, 2)) -> Callable:
  """`call(rows, state, server, inputs)` of one seed, jitted over the `num_seeds` seeds, the
  arguments `donate` donated (its rows, state and server by default), placed as the run state
  is between calls."""
  over = over_replicas(call, num_seeds, (0, 0, 0, SEED_AXES))

  def seeds(rows, state, server, inputs):
    rows, state, server, stats = over(rows, state, server, inputs)
    return (place.constrain(rows, True, stacked=True), place.constrain(state, True, stacked=True),
            place.constrain(server, False), stats)
  return jax.jit(seeds, donate_argnums=donate)


class TrainThenWrite:
  """The device store's chunk call: `train(tables, state table, server, inputs)` reads the
  chunk's rows of the tables and trains them, and `write(tables, state table, rows, state,
  inputs)` writes them back, in a call of its own whose tables are donated and only written, so
  that XLA updates them in place. (In one call, XLA ordered a read of the rows that the write
  does not wait for, FedTGP's forward pass before training, after the write, and copied each
  whole table to keep it: at N = 1,000, 2 GB twice a client.) Called as the stores' chunk calls
  are, `call(tables, state table, server, inputs)`."""

  def __init__(self, train: Callable, write: Callable):
    self.train, self.write = train, write

  def __call__(self, tables, state_table, server, inputs):
    rows, state, server, stats = self.train(tables, state_table, server, inputs)
    return (*self.write(tables, state_table, rows, state, inputs), server, stats)

  def _cache_size(self) -> int:
    """The programs of the more retraced of the two calls (1: neither retraced)."""
    return max(self.train._cache_size(), self.write._cache_size())  # pylint: disable=protected-access
