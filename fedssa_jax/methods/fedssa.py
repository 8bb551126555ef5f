"""FedSSA: semantic-similarity-based, class-wise header aggregation (docs/algorithm.md §4).

Header row s of client k is theta_k^s = (W_k[s, :], b_k[s]): d + 1 floats (d =
model.feature_dim, 500 in the paper).
- Before round 0 (`initial_header`, the default), the server holds a global header theta^0,
  drawn from the server's key exactly as a client's header is, so every class has a global row
  from the start and round 0 fuses it (the official code seeds it from a fresh model's fc3).
  Without it, no class has a global row until an owner uploads.
- Stabilise (global -> local), before training, on seen classes that have a global row:
    reference  theta_k^s <- mu_t * theta_k^s + theta^s                  (official code; default)
    convex     theta_k^s <- mu_t * theta_k^s + (1 - mu_t) * theta^s     (a reading of the paper)
  with mu_t = mu0 * cos(t * pi / (2 * T_stable)) for t <= T_stable, else 0. `reference` grows a
  seen row by about (1 + mu_t) a round while mu_t > 0; `convex` does not.
- Upload the seen rows; the server keeps a table U [N, S, d + 1] of every client's latest upload.
- Aggregate per class: theta^s = unweighted mean of U_k^s over contributing owners of s
  (`all_owners`: every owner that has uploaded at least once; `participants`: this round's).
  A class with no contributor keeps its previous global row (theta^0 until an owner uploads).
- Under central client-level DP (privacy.upload_mode='central', scope 'participants'): theta^s
  <- theta^s + (the sum of the round's clipped updates of s + noise) / (q |owners of s|), an
  update being a row less the global row it fused (the upload's reference; the row itself
  where s had none), q = K / N' the participation of the N' clients that take part (the new
  clients never do): a count fixed in advance, so that the mean reveals nothing of who took
  part, applied to the updates alone, so that the global row is not scaled by the round's
  share of owners (DP-FedAvg's estimator); every class with an owner moves each round.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import struct

from fedssa_jax import models
from fedssa_jax.methods import aggregation, base

# The stabilisation rules (fedssa.fusion, see above): a row's fused value from its local value,
# the global row and mu_t.
FUSIONS = {
    'reference': lambda rows, global_rows, mu: mu * rows + global_rows,
    'convex': lambda rows, global_rows, mu: mu * rows + (1.0 - mu) * global_rows,
}
SCOPES = ('all_owners', 'participants')  # fedssa.scope: whose uploads a class's mean takes


def mu_schedule(round_index, mu0: float, t_stable: int):
  """mu_t = mu0 * cos(t * pi / (2 T)) for t <= T, else 0 (t is the global round index)."""
  t = jnp.asarray(round_index, jnp.float32)
  mu = mu0 * jnp.cos(t * jnp.pi / (2.0 * max(t_stable, 1)))
  return jnp.where(t <= t_stable, mu, 0.0)


def stabilize(rows, global_rows, mask, mu, fusion: str):
  """Fuses a client's [S, d + 1] header rows with the global rows where `mask` [S] holds."""
  fused = FUSIONS[fusion](rows, global_rows, mu)
  return jnp.where(mask[:, None], fused, rows)


def fused_reference(server):
  """[S, d + 1]: the global row of each class that has one (what its owners fused, and their
  uploads' reference under client-level DP), zero elsewhere."""
  return jnp.where(server.avail[:, None], server.global_rows, 0.0)


def aggregate_headers(table, contrib, global_rows, avail):
  """Class-wise masked mean. table [N, S, d + 1], contrib [N, S] bool -> (global, avail)."""
  new, has = aggregation.masked_mean(table, contrib)
  return jnp.where(has[:, None], new, global_rows), avail | has


@struct.dataclass
class FedSSAUpload:
  """A client's upload (Upload.payload)."""
  rows: jax.Array  # [S, d + 1] its header rows theta_k^s of the seen classes, zero elsewhere


@struct.dataclass
class FedSSAServer:
  seen: jax.Array         # [N, S] the clients' seen-class masks
  table: jax.Array        # [N, S, d + 1] each client's latest upload
  uploaded: jax.Array     # [N] has the client ever uploaded?
  global_rows: jax.Array  # [S, d + 1] theta^s
  avail: jax.Array        # [S] does theta^s exist yet?
  noise: jax.Array | None = None  # [S, d + 1] central DP: the round's noise on the row sums


class FedSSA(base.Method):
  name = 'fedssa'
  config_section = 'fedssa'
  per_sample_loss = True  # plain cross-entropy
  ghost_norms = True  # the loss reads the parameters only through the model's apply
  private_upload = ('rows',)  # the seen rows, around the global rows they were fused with
  central_noise_into = 'noise'

  @classmethod
  def default_config(cls):
    c = ml_collections.ConfigDict()
    c.mu0 = 0.5                  # initial weight of the local header rows
    c.t_stable = 2               # rounds until mu_t reaches 0
    c.fusion = 'reference'       # 'reference' (official code: mu*local + global) or
                                 # 'convex' (mu*local + (1-mu)*global)
    c.scope = 'all_owners'       # 'all_owners' (latest uploads) or 'participants'
    c.initial_header = True      # the server's global header theta^0 before round 0 (as
                                 # the official code); False: no global row until uploads
    return c

  @classmethod
  def check_config(cls, c):
    if not c.t_stable >= 0:
      raise ValueError(f'fedssa.t_stable must be >= 0, got {c.t_stable}.')
    if not 0 <= c.mu0 <= 1:
      raise ValueError(f'fedssa.mu0 must be in [0, 1], got {c.mu0}.')
    for field, value, choices in (('fusion', c.fusion, FUSIONS), ('scope', c.scope, SCOPES)):
      if value not in choices:
        raise ValueError(f'Unknown fedssa.{field} {value!r}; choose one of {sorted(choices)}.')
    if not isinstance(c.initial_header, bool):
      raise ValueError(
          f'fedssa.initial_header must be True or False, got {c.initial_header!r}.')

  def __init__(self, config, num_clients, num_classes, image_shape=None):
    super().__init__(config, num_clients, num_classes, image_shape)
    c = config.fedssa
    self.mu0, self.t_stable = float(c.mu0), int(c.t_stable)
    self.fusion, self.scope = c.fusion, c.scope
    self.initial_header = bool(c.initial_header)
    self.central_q = base.central_share(config, num_clients)  # None: no central DP

  def init_server(self, key, seen):
    n, s = seen.shape
    row = self.header_row
    if self.initial_header:  # theta^0: every class has a global row before round 0
      global_rows, avail = models.init_header(key, s, self.feature_dim), jnp.ones((s,), bool)
    else:
      global_rows, avail = jnp.zeros((s, row), jnp.float32), jnp.zeros((s,), bool)
    return FedSSAServer(
        seen=jnp.array(seen, bool, copy=True),  # own buffer: the server state is donated
        table=jnp.zeros((n, s, row), jnp.float32), uploaded=jnp.zeros((n,), bool),
        global_rows=global_rows, avail=avail,
        noise=jnp.zeros((s, row), jnp.float32) if self.central_q is not None else None)

  def download(self, params, state, server, client):
    mu = mu_schedule(client.round, self.mu0, self.t_stable)
    fused = client.seen & server.avail  # the rows downloaded and fused
    rows = stabilize(models.header_rows(params), server.global_rows, fused, mu, self.fusion)
    per_element = 3 if self.fusion == 'convex' else 2  # two products and a sum, or one of each
    n_fused = fused.sum()
    return base.Download(models.with_header_rows(params, rows),
                         floats=self.header_row * n_fused,
                         flops=(per_element * self.header_row * n_fused).astype(jnp.float32))

  def newcomer(self, params, state, server, client):
    # The global header: every row the server holds replaces the initial one (no blend, as a
    # new client has nothing of its own to keep).
    rows = jnp.where(server.avail[:, None], server.global_rows, models.header_rows(params))
    return base.Download(models.with_header_rows(params, rows),
                         floats=self.header_row * server.avail.sum())

  def upload(self, trainable, acc, ctx, state, client):
    params = trainable['model']
    rows = jnp.where(client.seen[:, None], models.header_rows(params), 0.0)
    return base.Upload(params, state, payload=FedSSAUpload(rows=rows),
                       floats=self.header_row * client.seen.sum())

  def upload_reference(self, server, down, client):
    # The global rows the seen rows were fused with (known to the server); zero elsewhere.
    return {'rows': jnp.where(client.seen[:, None], fused_reference(server), 0.0)}

  @classmethod
  def upload_refusal(cls, config, mode):
    if mode == 'central' and config.fedssa.scope != 'participants':
      return ("class means re-use every owner's latest rows, so one round's noise would not "
              "cover the rows kept from earlier rounds (set fedssa.scope='participants' for "
              "it)")
    return super().upload_refusal(config, mode)

  def server_receive(self, server, client_ids, payloads, active):
    return server.replace(
        table=aggregation.store_rows(server.table, client_ids, payloads.rows, active),
        uploaded=aggregation.store_rows(server.uploaded, client_ids, active, active))

  def server_aggregate(self, server, participants, round_index, key):
    owners = server.uploaded if self.scope == 'all_owners' else participants
    contrib = server.seen & owners[:, None]
    if self.central_q is not None:  # noised sums over a count fixed in advance (module docstring)
      total, count = aggregation.masked_sum(server.table, contrib)
      reference = fused_reference(server)  # what every owner of a class was clipped around
      updates = total - count[:, None] * reference
      expected = self.central_q * server.seen.sum(axis=0)
      has = expected > 0
      g = jnp.where(has[:, None],
                    reference + (updates + server.noise) / jnp.where(has, expected, 1.0)[:, None],
                    server.global_rows)
      return base.Aggregated(server.replace(global_rows=g, avail=server.avail | has,
                                            noise=jnp.zeros_like(server.noise)))
    g, avail = aggregate_headers(server.table, contrib, server.global_rows, server.avail)
    return base.Aggregated(server.replace(global_rows=g, avail=avail))
