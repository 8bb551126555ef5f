"""The run's state between rounds, and what a round reports: typed pytrees.

`RunState` is what a checkpoint saves (as a plain dict, `to_saved`/`from_saved`, the layout
checkpoints have always had). `RoundInfo` is what `Simulator.run_round` tells the run loop about
the round. Both are flax.struct dataclasses: a reader sees their fields, and jit, orbax and
`jax.tree` see pytrees.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from flax import struct

PyTree = Any


@struct.dataclass
class RunState:
  round: int          # rounds done
  params: tuple       # per family group: the members' stacked models, or the store's table
  client_state: Any   # every client's method state (e.g. FedKD's W_h), or the store's table
  server: Any         # the method's server state (a flax.struct dataclass of the method's)
  costs: dict         # cumulative 'up_floats', 'down_floats', 'client_flops'

  def to_saved(self) -> dict:
    """The dict a checkpoint holds (its keys are the fields)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  @classmethod
  def from_saved(cls, saved: dict) -> RunState:
    return cls(**saved)


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
  header_norm_max: float        # over the participants' seen-class header rows, after training
  header_norm_mean: float
  server_flops: float           # FLOPs the server spent this round (methods.Aggregated)
  server_metrics: dict          # the server's scalar diagnostics of the round, by name
