"""The path of an upload from client to server, written once: `Uplink`, a composition of steps.

Between a client's `Method.upload` and the server's rule, an upload may be clipped and noised
(the privacy section's client-level DP), lost or late (the system section), and the server's sum
of the uploads noised before the rule. The engine does not branch on which of these are on: it
builds the path once from the config (`Uplink.build`) and calls its three ends, whose steps
each have an identity default that traces nothing, so that a run with everything off takes the
same path and computes exactly what it always did.

1. `Uplink.send` (the client end, in the round's call, engine/simulator.py's local_round): the
   `client` step on each client's upload, vmapped over the chunk's clients. `AsSent` (identity)
   passes it as it is; `Privatize` (upload DP) clips the method's private fields
   (Method.private_upload) around its reference (Method.upload_reference) and, in local mode,
   noises them (privacy.privatize_upload), and reports each upload's norm before the clip.
2. `Uplink.receive` (the arrival, in the same call, train_chunk): the `federation` step says
   which uploads arrive, and the server receives those (Method.server_receive). `Ideal` (the
   system section off): every trained client's. `Drawn` (the system section on,
   fedssa_jax/system.py): not those lost, nor with a clock those later than the deadline
   (`arrivals`). The same step holds the federation's other parts of the round: the host's
   draws and the cohort (`draw`), what the calls take of the devices and the draws (`devices`,
   `inputs`), a straggler's share of its steps (`work`, which local training reads), and the
   round's record (`record`).
3. `Uplink.aggregate` (the server end, once a round under jit): the `before_rule` step on the
   server state (`CentralNoise`: central upload DP's noise on the round's sum of the clipped
   uploads, Method.central_noise), the method's rule over the clients whose uploads arrived
   (Method.server_aggregate, with the round's key, Stream.AGGREGATE), then the `after_rule` step
   on the aggregate (`KeepWhenEmpty`, the system section on: a round that received nothing leaves
   the server as it was and costs it nothing). `IDENTITY` is either's default.

Every step is a frozen dataclass (static and hashable), so the path can be closed over in jit.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from fedssa_jax import methods, privacy, system
from fedssa_jax.engine.schedule import sample_cohort
from fedssa_jax.engine.state import ChunkInputs, ChunkStats, ClientStats, SystemRound
from fedssa_jax.streams import Stream

# How the engine vmaps a ClientView over a chunk's clients: the round is the same for all.
VIEW_AXES = methods.ClientView(id=0, seen=0, num_samples=0, round=None)


def upload_accountant(config, eligible: int, k: int) -> privacy.UploadAccountant:
  """Client-level DP's accountant for a run of `eligible` clients that may train, K = `k` a
  round. Central mode amplifies by sampling K of them without replacement; where the `system`
  section gives clients unequal chances to be sampled (system.equal_chances: a spread of
  availability, or a trace), a client online more often than the rest would be in more cohorts
  than that accounts for, so the rounds are accounted without sampling (each a release of
  every client's upload: a valid bound, and more noise for a calibrated target)."""
  p = config.privacy
  if (p.upload_mode == 'central' and 0 < k < eligible
      and not system.equal_chances(config.system)):
    logging.warning('Central upload DP with clients online at unequal rates (system.'
                    'availability_spread or availability_trace): its rounds are accounted '
                    'without amplification by sampling (docs/algorithm.md §11).')
    k = 0
  return privacy.UploadAccountant(p, eligible, k, config.num_rounds)


@dataclasses.dataclass(frozen=True)
class Identity:
  """A step that changes nothing: it returns its first argument."""

  def __call__(self, value, *context):
    del context
    return value


IDENTITY = Identity()


# ----------------------------------------------------------------------------------------------
# The client step: on each client's upload, inside the round's call
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AsSent:
  """The upload as the client's Method.upload made it, and no norm (no client-level DP)."""

  def __call__(self, method, payload, server, down, view, root_key):
    del method, server, down, view, root_key
    return payload, None


@dataclasses.dataclass(frozen=True)
class Privatize:
  """Client-level DP on one client's upload (the privacy section's upload): its private fields
  clipped around its reference and noised with `dp.std` (0 in central mode, where the server
  noises the sum), each client from its key of the round (privacy.upload_keys). Returns (the
  payload, its norm before the clip)."""
  dp: privacy.UploadDP

  def __call__(self, method, payload, server, down, view, root_key):
    reference = method.upload_reference(server, down, view)
    key = privacy.upload_keys(root_key, view.round, view.id[None])[0]
    return privacy.privatize_upload(payload, reference, key, fields=self.dp.fields,
                                    clip_norm=self.dp.clip_norm, std=self.dp.std)


# ----------------------------------------------------------------------------------------------
# The federation step: which clients train, how much, and whose uploads arrive
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Ideal:
  """The ideal federation (the system section off): the sampled clients train, all their steps,
  and every trained client's upload arrives."""

  def draw(self, fed, seed: int, t: int, num_clients: int, k: int, eligible=None):
    """(no draws, the sampled clients, the cohort: the same); `eligible` [N] (None: all): the
    clients the round may sample (not the new clients)."""
    del fed
    sampled = sample_cohort(seed, t, num_clients, k, eligible)
    return None, sampled, sampled

  def devices(self, fed, seeds, train_flops, place):
    del fed, seeds, train_flops, place
    return None

  def inputs(self, devices, draws, place):
    del devices, draws, place
    return None

  def work(self, inputs: ChunkInputs) -> tuple:
    """local_train's extra arguments: none (every client runs all its steps)."""
    del inputs
    return ()

  def arrivals(self, inputs: ChunkInputs, stats: ClientStats):
    """(whether each upload arrives: every trained client's, their seconds: none)."""
    del stats
    return inputs.active, None

  def record(self, fed, cohort, s: ChunkStats, draws, sampled, _) -> SystemRound | None:
    del fed, cohort, s, draws, sampled
    return None


@dataclasses.dataclass(frozen=True)
class Drawn:
  """The federation of the system section (fedssa_jax/system.py): its draws made on the host
  before the round (who is online, drops out, straggles, loses its upload), taken by the call
  as data (ChunkInputs.system), and each client's clock."""

  def draw(self, fed: system.System, seed: int, t: int, num_clients: int, k: int,
           eligible=None):
    """(the round's draws, the clients sampled among the online ones that are `eligible` (None:
    all; not the new clients), those that train)."""
    draws = fed.round_draws(seed, t)
    online = draws.online if eligible is None else draws.online & eligible
    sampled = sample_cohort(seed, t, num_clients, k, online)
    return draws, sampled, draws.cohort(sampled)

  def devices(self, fed: system.System, seeds, train_flops: np.ndarray, place):
    """What the calls take of the devices, the same every round (System.device_inputs)."""
    return place.replicate(jax.tree.map(jnp.asarray, fed.device_inputs(seeds, train_flops)))

  def inputs(self, devices: system.SystemInputs, draws: list, place):
    """What the round's calls take: the devices' inputs with each seed's draws."""
    return devices.replace(**place.replicate(
        {'work': jnp.asarray(np.stack([d.work for d in draws])),
         'lost': jnp.asarray(np.stack([d.lost for d in draws]))}))

  def work(self, inputs: ChunkInputs) -> tuple:
    """local_train's extra argument: each client's share of its steps (a straggler's f)."""
    return (inputs.system.work[inputs.ids],)

  def arrivals(self, inputs: ChunkInputs, stats: ClientStats):
    """(whether each upload arrives, each client's simulated seconds): `arrivals`."""
    seconds, received = arrivals(inputs.system, inputs.ids, inputs.active, stats)
    return received, seconds

  def record(self, fed: system.System, cohort, s: ChunkStats, draws: system.RoundDraws,
             sampled: np.ndarray, _) -> SystemRound:
    """A round's federation, for its record: `s` the cohort's statistics."""
    received = s.received.astype(bool)
    lost = draws.lost[cohort]
    straggler = draws.work[cohort] < 1
    seconds = round_seconds = None
    if fed.clock:
      seconds = np.asarray(s.seconds, np.float64)
      round_seconds = system.round_seconds(seconds, fed.deadline)
    return SystemRound(
        online=int(draws.online.sum()), sampled=sampled,
        dropped=sampled[draws.dropped[sampled]], stragglers=cohort[straggler],
        work=draws.work[cohort][straggler], lost=cohort[lost],
        late=cohort[~received & ~lost], received=cohort[received], seconds=seconds,
        round_seconds=round_seconds)


def arrivals(sys_in: system.SystemInputs, ids, active, stats: ClientStats):
  """(each client's simulated seconds, whether the server receives its upload): a trained
  client's upload arrives unless it is lost or later than the deadline."""
  flops = sys_in.train_flops[ids] * stats.train.samples.astype(jnp.float32) + stats.extra_flops
  seconds = jnp.where(active, system.client_seconds(sys_in, ids, stats.down_floats,
                                                    stats.up_floats, flops), 0.0)
  return seconds, active & ~sys_in.lost[ids] & (seconds <= sys_in.deadline)


# ----------------------------------------------------------------------------------------------
# The server steps: before and after the rule
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CentralNoise:
  """Central client-level DP: N(0, std^2) noise on the round's sum of the clipped uploads, from
  the server's key of the round (privacy.server_upload_key), before the rule
  (Method.central_noise)."""
  std: float

  def __call__(self, server, method, root_key, round_index):
    return method.central_noise(server, privacy.server_upload_key(root_key, round_index),
                                self.std)


@dataclasses.dataclass(frozen=True)
class KeepWhenEmpty:
  """A round that received no upload (the system section on) leaves the server state as it was
  before the rule, and costs the server nothing."""

  def __call__(self, agg: methods.Aggregated, before, participants) -> methods.Aggregated:
    any_ = participants.any()
    return agg._replace(server=jax.tree.map(lambda new, old: jnp.where(any_, new, old),
                                            agg.server, before),
                        flops=jnp.where(any_, agg.flops, 0.0))


# ----------------------------------------------------------------------------------------------
# The path
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Uplink:
  """The path of the uploads from client to server: its steps, each the identity by default."""
  client: AsSent | Privatize = AsSent()    # on each client's upload (send)
  federation: Ideal | Drawn = Ideal()      # which clients train, and whose uploads arrive
  before_rule: Identity | CentralNoise = IDENTITY  # on the server state before the rule
  after_rule: Identity | KeepWhenEmpty = IDENTITY  # on the aggregate after it

  @classmethod
  def build(cls, config, method: methods.Method,
            upload_privacy: privacy.UploadAccountant | None) -> Uplink:
    """The path of `config`'s uploads: client-level DP with `upload_privacy` (its accountant; None:
    off), clipped on every client, noised there (local) or on the server's sum (central); the
    system section's federation where it is on (system.enabled)."""
    client, before = AsSent(), IDENTITY
    if upload_privacy is not None:
      central = upload_privacy.central
      client = Privatize(privacy.UploadDP(
          fields=tuple(method.private_upload), clip_norm=float(config.privacy.upload_clip),
          std=0.0 if central else upload_privacy.std))
      if central and upload_privacy.std:
        before = CentralNoise(upload_privacy.std)
    drawn = system.enabled(config.system)
    return cls(client=client, federation=Drawn() if drawn else Ideal(), before_rule=before,
               after_rule=KeepWhenEmpty() if drawn else IDENTITY)

  def send(self, method: methods.Method, payloads, server, down: methods.Download,
           view: methods.ClientView, root_key):
    """The client end: the `client` step on each of a chunk's uploads (`payloads`, `down` and
    `view` with a leading client axis). Returns (the payloads, each one's norm before a clip, or
    None)."""
    return jax.vmap(functools.partial(self.client, method), in_axes=(0, None, 0, VIEW_AXES, None))(
        payloads, server, down, view, root_key)

  def receive(self, method: methods.Method, server, inputs: ChunkInputs, payloads,
              stats: ClientStats):
    """The arrival: the server receives the uploads that arrive (the `federation` step's).
    Returns (the server, whether each arrived, each client's simulated seconds or None)."""
    received, seconds = self.federation.arrivals(inputs, stats)
    return method.server_receive(server, inputs.ids, payloads, received), received, seconds

  def aggregate(self, method: methods.Method, server, participants, round_index,
                root_key) -> methods.Aggregated:
    """The server end, one seed's: `before_rule`, the method's rule over the `participants`
    (those whose uploads arrived) with its key of the round (Stream.AGGREGATE), `after_rule`."""
    key = jax.random.fold_in(jax.random.fold_in(root_key, Stream.AGGREGATE), round_index)
    agg = method.server_aggregate(self.before_rule(server, method, root_key, round_index),
                                  participants, round_index, key)
    return self.after_rule(agg, server, participants)
