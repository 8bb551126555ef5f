"""The audit of client-level DP on the uploads, at the mechanism: m canary clients, each with
a known random direction u_i (orthonormal), upload in every one of the run's rounds through the
engine's own code: `privacy.privatize_upload` (the clip around a reference, and in local mode
the client's noise, from its key of (seed, round, client): `privacy.upload_keys`), and in
central mode the server's noise on the round's sum (`engine.uplink.CentralNoise`, through
`Method.central_noise` into an inbox, from `privacy.server_upload_key`). An included canary's
upload is its reference plus 3 C_u u_i (clipped to C_u u_i), an excluded one's minus that: the
replace-one neighbours 2 C_u apart that the accountant assumes.

The attack sees what the server sees. Local: each canary's uploads; its score is the sum over
rounds of (upload - reference) . u_i. Central: the noised sums; a canary's score is the sum over
rounds of (sum - m reference) . u_i. Every canary uploads every round, so the audited mechanism
is `num_rounds` releases without the cohort's sampling: its accounted epsilon is
`privacy.upload_epsilon` of those releases, at or above the run's (which the report gives
beside it)."""
from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from fedssa_jax import methods, privacy
from fedssa_jax.audit import canaries as canaries_lib
from fedssa_jax.engine import uplink
from fedssa_jax.methods import aggregation

# An upload's private field is pushed this many times C_u out, so that the clip acts.
PUSH = 3.0


@struct.dataclass
class _Upload:
  value: jax.Array


@struct.dataclass
class _Server:
  inbox: aggregation.Inbox


def _server_noise(std: float):
  """The central noise step as the engine builds it, on a server state whose inbox holds the
  round's sum (a method that noises its inbox: Method.central_noise_into 'inbox')."""
  step = uplink.CentralNoise(std)
  method = types.SimpleNamespace(central_noise_into='inbox')
  method.central_noise = functools.partial(methods.Method.central_noise, method)
  return lambda server, root_key, t: step(server, method, root_key, t)


@functools.partial(jax.jit, static_argnames=('clip', 'std', 'central'))
def _round_scores(root_key, t, ids, values, reference, directions, *, clip, std, central):
  """One round's scores of every canary: [m]."""
  keys = privacy.upload_keys(root_key, t, ids)
  sent = jax.vmap(lambda v, k: privacy.privatize_upload(
      _Upload(v), {'value': reference}, k, fields=('value',), clip_norm=clip,
      std=0.0 if central else std)[0].value)(values, keys)
  if not central:
    return jnp.einsum('md,md->m', sent - reference, directions)
  inbox = aggregation.Inbox.empty(reference).add(sent, jnp.ones(len(ids), bool))
  if std:
    inbox = _server_noise(std)(_Server(inbox), root_key, t).inbox
  return directions @ (inbox.sum - len(ids) * reference)


def upload_scores(seed: int, m: int, num_rounds: int, first_id: int, *, clip: float,
                  std: float, central: bool) -> tuple[np.ndarray, np.ndarray]:
  """(each canary's score summed over `num_rounds` rounds, which are included): m canary
  clients of ids first_id.. of seed `seed`'s run, clip C_u = `clip`, noise std `std`."""
  directions, included = canaries_lib.upload_canaries(seed, m)
  reference = np.linspace(-1.0, 1.0, m, dtype=np.float32)  # a known, nonzero reference
  sign = np.where(included, 1.0, -1.0).astype(np.float32)[:, None]
  values = jnp.asarray(reference + PUSH * clip * sign * directions)
  root_key = jax.random.PRNGKey(seed)
  ids = jnp.arange(first_id, first_id + m, dtype=jnp.int32)
  total = jnp.zeros(m, jnp.float32)
  for t in range(num_rounds):
    total = total + _round_scores(root_key, jnp.asarray(t, jnp.int32), ids, values,
                                  jnp.asarray(reference), jnp.asarray(directions),
                                  clip=float(clip), std=float(std), central=central)
  return np.asarray(total), included
