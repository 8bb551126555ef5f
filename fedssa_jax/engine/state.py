"""The run's state between rounds, what a round reports, and what a chunk's call takes and gives:
typed pytrees.

`RunState` holds every seed of a run on a leading seed axis: the round, the client population
(`Population`), the server state and the costs. One seed's slice is what its checkpoint saves, as
the plain dict checkpoints have always held (snapshots.py). `RoundInfo` is what
`Simulator.run_round` tells the run loop about one seed's round. `ChunkInputs` is what the jitted
call of a chunk takes besides its rows and the server state, and `ChunkStats` what it reports of
each of its clients. All are flax.struct dataclasses: a reader sees their fields, and jit, orbax
and `jax.tree` see pytrees.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import numpy as np
from flax import struct

from fedssa_jax.data.partition import DeviceData
from fedssa_jax.engine.training import TrainStats
from fedssa_jax.methods.base import Norms
from fedssa_jax.system import SystemInputs
from fedssa_jax.types import PyTree


class ServerState(Protocol):
  """A method's server state: a flax.struct dataclass of the method's own (methods/base.py),
  each leaf with a leading seed axis in a RunState."""

  def replace(self, **changes) -> ServerState:
    ...


@struct.dataclass
class Costs:
  """A run's cumulative costs: floats (arrays [R] over the seeds, or one seed's)."""
  up_floats: np.ndarray | float     # floats the clients sent
  down_floats: np.ndarray | float   # ... received
  client_flops: np.ndarray | float  # client FLOPs

  @classmethod
  def zeros(cls, num_seeds: int) -> Costs:
    return cls(*(np.zeros(num_seeds) for _ in range(3)))

  @classmethod
  def stack(cls, costs: list[Costs]) -> Costs:
    return cls(*(np.array([getattr(c, f) for c in costs], np.float64) for f in FIELDS))

  def add(self, infos: list[RoundInfo]) -> Costs:
    """The costs after a round whose seeds' reports are `infos`."""
    return Costs(*(getattr(self, f) + np.array([getattr(i, f) for i in infos])
                   for f in FIELDS))

  def of(self, seed_index: int) -> Costs:
    return Costs(*(float(getattr(self, f)[seed_index]) for f in FIELDS))


FIELDS = tuple(f.name for f in dataclasses.fields(Costs))


class StalePopulation(RuntimeError):
  """A population read after the store's tables moved on: a later round wrote them in place, or
  a restore replaced them (population.py)."""


@dataclasses.dataclass(frozen=True)
class Tables:
  """A row store's handle on its tables (hashable: a static part of the Population's pytree):
  which store, and the generation of the tables it names. The store advances the generation
  whenever it writes rows (a round) or replaces its tables (a start or a restore)."""
  store: str       # the store's name: 'host' or 'disk'
  owner: int       # which store object of the process (population.py numbers them)
  generation: int


@struct.dataclass
class Population:
  """The clients of every seed between rounds: each family group's stacked models and every
  client's method state, the same type whatever the store (population.py), which alone reads
  and writes it.

  The device store's: `params` (per group, the members' models [R, rows, ...]) and
  `client_state` ([R, N', ...]) are device arrays; a round donates them, so a population a round
  took is gone (JAX raises on its deleted arrays). A host or disk store's: `tables`, the handle
  on the store's tables of rows, `params` and `client_state` None; a round writes the rows in
  place and moves the tables to a new generation, so reading a population a round took raises
  StalePopulation rather than returning the newer rows. A state the caller keeps is never
  changed by a round: it is either still valid or refused."""
  params: tuple[PyTree, ...] | None = None
  client_state: PyTree | None = None
  tables: Tables | None = struct.field(pytree_node=False, default=None)


@struct.dataclass
class RunState:
  round: int               # rounds done
  population: Population   # the clients' models and method state, every seed's
  server: ServerState      # the method's server state
  costs: Costs             # cumulative costs


@struct.dataclass
class ClientStats:
  """What `local_round` reports of each client of a chunk (arrays over its clients)."""
  train: TrainStats        # local training's sums (training.local_train)
  down_floats: jax.Array   # floats received (methods.Download.floats)
  up_floats: jax.Array     # floats sent (methods.Upload.floats)
  extra_flops: jax.Array   # client FLOPs beyond the training steps: the download's, the
                           # upload's, the forward pass's and the step after training's
  # Client-level DP on the uploads: each upload's norm before the clip (a diagnostic for
  # choosing privacy.upload_clip; None without it).
  upload_norm: jax.Array | None = None


@struct.dataclass
class ChunkStats:
  """What a chunk's call reports of each of its clients (arrays over its clients)."""
  clients: ClientStats
  nonfinite: jax.Array     # whether its parameters hold a NaN or inf after training
  norms: Norms             # the method's norms of its trained model (Method.trained_norms)
  # Whether the server received its upload (the uplink's federation step: every trained
  # client's, or with the system section on, not lost nor late), and with the system section
  # on, its simulated seconds (None without it).
  received: jax.Array | None = None
  seconds: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class SystemRound:
  """One seed's round of the federation (the system section on), for its record: client ids,
  sorted, unless said otherwise."""
  online: int                 # clients online
  sampled: np.ndarray         # sampled among them (fewer than K when fewer were online)
  dropped: np.ndarray         # sampled, dropped out before training
  stragglers: np.ndarray      # trained, on part of their steps ...
  work: np.ndarray            # ... the fraction f of each
  lost: np.ndarray            # trained, upload lost
  late: np.ndarray            # trained, upload later than the deadline (and not lost)
  received: np.ndarray        # trained, upload received by the server
  seconds: np.ndarray | None  # with a clock: each trained client's simulated seconds (cohort
                              # order)
  round_seconds: float | None  # ... the round's: its slowest trained client, at most the deadline


@struct.dataclass
class RoundInfo:
  """One round, for the run loop: the cohort and the costs and training statistics of its
  clients (arrays over the cohort, in cohort order)."""
  cohort: np.ndarray            # the participants' ids, sorted
  up_floats: float              # floats sent this round, all participants
  down_floats: float            # floats received
  client_flops: float           # client FLOPs
  train_loss: float             # mean training loss over every processed sample
  train_accuracy: float
  train_samples: np.ndarray     # per participant: samples processed (E * n_k)
  train_loss_sum: np.ndarray    # ... summed training loss
  train_steps: np.ndarray       # ... optimizer steps
  client_up_floats: np.ndarray
  client_down_floats: np.ndarray
  client_flops_per_client: np.ndarray
  nonfinite_params: np.ndarray  # ... whether its parameters hold a NaN or inf after training
  header_norm_max: float        # the largest of the participants' norms (Method.trained_norms;
  header_norm_mean: float       # by default their seen-class header rows'), and their mean
  server_flops: float           # FLOPs the server spent this round (methods.Aggregated)
  server_metrics: dict          # the server's scalar diagnostics of the round, by name
  system: SystemRound | None = None  # the federation's draws and clock (system section on)
  upload_norms: np.ndarray | None = None  # per participant: its upload's norm before the clip
                                          # (client-level DP on the uploads)


@struct.dataclass
class ChunkInputs:
  """What a chunk's jitted call takes besides the rows it trains and the server state, for one
  seed (the call vmaps them over the seeds as `SEED_AXES`, the same dataclass holding axes,
  says)."""
  slots: jax.Array         # [P] the chunk's rows of its group (g.rows: a dummy)
  ids: jax.Array           # [P] their client ids
  active: jax.Array        # [P] False for dummies
  seen: jax.Array          # [N, C] every client's seen-class mask
  data: DeviceData         # the images and the clients' training indices
  round_index: jax.Array   # the global round t (the same for every seed)
  root_key: jax.Array      # the seed's key
  system: SystemInputs | None = None  # the round's draws and devices (system section on)


SEED_AXES = ChunkInputs(
    slots=0, ids=0, active=0, seen=0, round_index=None, root_key=0, system=0,
    data=DeviceData(images=None, labels=None, train_idx=0, train_n=0, test_idx=None,
                    test_n=None))  # the images are shared


@struct.dataclass
class TableRows:
  """A block of a group's clients to evaluate, named rather than gathered: `table` the group's
  stacked rows [R, rows, ...] of every seed, `seed` the seed's index and `slots` [P] the block's
  rows. The evaluation reads each client's row inside its loop (`row`), so the block's rows are
  never copied out of the table first. The device store's evaluation without a mesh passes it;
  otherwise the rows themselves come."""
  table: PyTree
  seed: jax.Array
  slots: jax.Array

  def row(self, slot: jax.Array) -> PyTree:
    return jax.tree.map(lambda a: a[self.seed, slot], self.table)


def block_loop(group_params) -> tuple:
  """(what a block's loop runs over, the client's parameters of one of its elements): the
  rows themselves, or the slots of a TableRows and the row each names."""
  if isinstance(group_params, TableRows):
    return group_params.slots, group_params.row
  return group_params, lambda params: params


def block_rows(group_params) -> PyTree:
  """The rows of a block as an evaluation call gets them (the rows, or a TableRows): gathered
  where a computation needs them all at once (a new client's training)."""
  if isinstance(group_params, TableRows):
    return group_params.row(group_params.slots)
  return group_params

