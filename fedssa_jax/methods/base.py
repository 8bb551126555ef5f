"""The interface every federated method implements, and that the engine drives.

A round, as the engine runs it (engine.py):

    server' = server
    for each family group, for each fixed-size chunk of its sampled clients (vmapped):
        params  = method.client_prepare(params, server, client_id, seen, round)  # download
        params  = local training with method's loss
        upload  = method.client_upload(params, seen)
        server' = method.server_receive(server', client_ids, uploads, active)
    server = method.server_aggregate(server', participants, round)

Everything but `comm_floats` and `extra_client_flops` runs under jit, on one client (the
`client_*` hooks, vmapped by the engine) or on the whole population (the `server_*` hooks).
Server state is a pytree of arrays, so it can be checkpointed and sharded.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from fedssa_jax import client

PyTree = Any


class Method:
  """Defaults: no exchange at all (which is Standalone)."""
  name = 'base'
  loss_fn = staticmethod(client.cross_entropy_loss)

  def __init__(self, config, num_clients: int, num_classes: int):
    self.config = config
    self.num_clients = num_clients
    self.num_classes = num_classes

  # --- server state -------------------------------------------------------------------------
  def init_server(self, seen: jax.Array) -> PyTree:
    """The server's initial state. `seen` is the static [N, S] seen-class mask."""
    del seen
    return {}

  # --- client side (one client; vmapped by the engine) --------------------------------------
  def client_prepare(self, params, server, client_id, seen, round_index):
    """What a sampled client does with its download before training."""
    del server, client_id, seen, round_index
    return params

  def client_upload(self, params, seen) -> PyTree:
    """What a client sends after training (a pytree with no leading client axis)."""
    del params, seen
    return {}

  def eval_params(self, params, server, client_id):
    """The parameters a client is evaluated with (its current personalised model)."""
    del server, client_id
    return params

  # --- server side ---------------------------------------------------------------------------
  def server_receive(self, server, client_ids, uploads, active):
    """Stores one chunk's uploads. `active` is False for padding (dummy) clients."""
    del client_ids, uploads, active
    return server

  def server_aggregate(self, server, participants, round_index):
    """The server rule, once per round. `participants` is an [N] bool mask of this round."""
    del participants, round_index
    return server

  # --- accounting (host side, numpy) -----------------------------------------------------------
  def comm_floats(self, server, cohort: np.ndarray, seen: np.ndarray):
    """Floats sent (up, down) per cohort client this round; `server` is the state at the
    round's start, as numpy arrays."""
    del server, seen
    zeros = np.zeros(len(cohort), np.int64)
    return zeros, zeros

  def extra_client_flops(self, server, cohort: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """Client FLOPs beyond local training (e.g. FedSSA's fusion), per cohort client."""
    del server, seen
    return np.zeros(len(cohort), np.float64)
