"""A run's state and its checkpoints: what one seed's checkpoint holds of the stacked RunState,
and the stacked state again from every seed's, whatever the store and device count.

A seed's checkpoint holds a plain dict, the layout checkpoints have always had (SAVED): the
round, `params` (per group, the members' rows without padding rows, or the disk store's slot
maps), `client_state` (the same, of every client's method state), `server` (the method's server
dataclass) and `costs` (a dict of floats). The run loop (run/train.py) writes a checkpoint as
`before_checkpoint` (the store's bookkeeping, then `saved`), the save, and `after_checkpoint`; a
resume restores each seed's dict with `saved` of a fresh state as the template, then `stacked`
makes them live, and `after_checkpoint` frees what no kept checkpoint needs. `seed_state` is one
seed's state on the host, for tests and tools.
"""
from __future__ import annotations

from fedssa_jax.engine.population import Store
from fedssa_jax.engine.state import FIELDS, Costs, Population, RunState

SAVED = ('round', 'params', 'client_state', 'server', 'costs')  # a checkpoint's keys


def saved(store: Store, state: RunState, seed_index: int = 0) -> dict:
  """What seed `seed_index`'s checkpoint holds of the stacked `state`: host arrays without
  padding rows (or the disk store's slot maps), a dict of SAVED."""
  params, client_state = store.saved(state.population, seed_index)
  costs = state.costs.of(seed_index)
  return {'round': state.round, 'params': params, 'client_state': client_state,
          'server': store.placement.fetch_seed(state.server, seed_index),
          'costs': {f: getattr(costs, f) for f in FIELDS}}


def seed_state(store: Store, state: RunState, seed_index: int = 0) -> RunState:
  """Seed `seed_index`'s own state out of the stacked one, without the seed axis: host copies of
  every client's rows (`population.params` and `.client_state`, whatever the store), its server
  state and costs. For tests and tools; the run loop reads the stacked state."""
  params, client_state = store.seed_slice(state.population, seed_index)
  return RunState(round=state.round,
                  population=Population(params=params, client_state=client_state),
                  server=store.placement.fetch_seed(state.server, seed_index),
                  costs=state.costs.of(seed_index))


def stacked(store: Store, saved_states: list[dict]) -> RunState:
  """The state of every seed from what their checkpoints hold (`saved_states`, one per seed, of
  the same round), live in the store and on the devices."""
  rounds = [int(s['round']) for s in saved_states]
  if len(set(rounds)) != 1:
    raise ValueError(f'Seeds at different rounds: {rounds}.')
  population = store.stacked([(s['params'], s['client_state']) for s in saved_states])
  return RunState(
      round=saved_states[0]['round'], population=population,
      server=store.placement.stack_seeds([s['server'] for s in saved_states]),
      costs=Costs.stack([Costs(**{f: float(s['costs'][f]) for f in FIELDS})
                         for s in saved_states]))


def before_checkpoint(store: Store, state: RunState, seed_index: int = 0) -> dict:
  """The store's bookkeeping before seed `seed_index`'s checkpoint of `state` is written (the
  disk store flushes its files and pins the rows it names), then what it holds (`saved`)."""
  store.before_checkpoint(state.population, state.round)
  return saved(store, state, seed_index)


def after_checkpoint(store: Store, state: RunState, kept_steps: list[int]) -> None:
  """The store's bookkeeping after a checkpoint is saved or restored: `kept_steps`, the rounds
  of the checkpoints still kept (the disk store frees the slots none of them names)."""
  store.after_checkpoint(state.population, kept_steps)
