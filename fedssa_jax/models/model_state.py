"""Model state: batch statistics kept beside a model's parameters (docs/algorithm.md §1).

A model with batch normalisation keeps running statistics that are no parameters: not
trained by gradient, not decayed, never sent. The engine stores them in the client's row
beside its parameters, under MODEL_STATE, so that every population store, checkpoint, mesh
placement and method hook carries them as it carries the parameters; the five CNNs have none,
and their rows are their parameters as before. Local training splits a row (`split_state`),
trains the parameters with the model's training-mode apply (`StatefulModel.train_apply`, which
returns the new statistics) and joins them back (`join_state`); every other forward (evaluation,
a method's forward pass) calls `apply` on the row, which normalises with its running
statistics, as a PyTorch model in eval() mode does.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn

from fedssa_jax.models.layers import IMAGE_SHAPE

MODEL_STATE = 'batch_stats'


def split_state(row) -> tuple[Any, Any]:
  """(parameters, model state) of a stored row; the state is None for a model without one."""
  if isinstance(row, dict) and MODEL_STATE in row:
    return {k: v for k, v in row.items() if k != MODEL_STATE}, row[MODEL_STATE]
  return row, None


def join_state(params, state):
  """The stored row of `params` and model state `state` (None: `params` itself)."""
  return params if state is None else {**params, MODEL_STATE: state}


@dataclasses.dataclass(frozen=True)
class StatefulModel:
  """A Flax module with batch statistics, called as a stateless family's model is (one with
  none, HtFLlib's FedAvgCNN, is wrapped alike: its rows are its parameters).

  The module is called `module(x, train=..., mask=...)` and returns (logits, representation);
  its batch normalisation layers keep their statistics in the 'batch_stats' collection and
  take `mask` [B] so that padding rows of a partial batch count in no statistic; in training
  its dropout layers (if any) draw from the 'dropout' key. `init` gives the row (parameters
  with the statistics under MODEL_STATE) as {'params': row}; `apply` evaluates a row with its
  running statistics; `train_apply` runs training mode on the valid rows' batch statistics
  and returns the updated running statistics too. `image_shape`: the images it is built for
  (init_params)."""
  module: nn.Module
  image_shape: tuple[int, ...] = IMAGE_SHAPE

  def init(self, key, x):
    variables = self.module.init(key, x, train=False)
    return {'params': join_state(variables['params'], variables.get(MODEL_STATE))}

  def apply(self, variables, x):
    params, state = split_state(variables['params'])
    state = {} if state is None else {MODEL_STATE: state}
    return self.module.apply({'params': params, **state}, x, train=False)

  def train_apply(self, params, state, x, mask, key):
    """((logits, representation), new statistics) of a training-mode forward of `x` [B', ...],
    whose statistics count the rows where `mask` [B'] is True; `key` draws its dropout."""
    out, updated = self.module.apply({'params': params, MODEL_STATE: state}, x, train=True,
                                     mask=mask, rngs={'dropout': key}, mutable=[MODEL_STATE])
    return out, updated[MODEL_STATE]
