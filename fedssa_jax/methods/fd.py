"""FD, federated distillation (Jeong et al. 2018; docs/algorithm.md §6).

Unlike FedSSA, no parameters leave the client: the exchange is per-class mean *logits*.
- Up: L_k[c] in R^C, the mean over all E epochs of the logits of the client's training forward
  passes on samples of class c, for c in S_k (accumulated on the fly, §6 V1; no extra pass).
- Server (no memory): over the round's participants P_t holding c,
    cnt_c = |{j in P_t : c in S_j}|,  G[c] = sum_j L_j[c] / cnt_c,  g[c] = [cnt_c > 0].
  `fd.exclude_own` (the FD paper): client k gets G_k[c] = (sum_j L_j[c] - L_k[c]) / (cnt_c - 1),
  subtracting its own upload only if k was among those participants; a class with
  cnt_c - 1 = 0 then has no global value (g_k[c] = 0). Under central client-level DP
  (privacy.upload_mode='central') the sums carry the round's noise and cnt_c is fixed in
  advance: q times the owners of c, q = K / N' (N': the clients that take part). The server
  keeps last round's sums and counts, and (only when excluding) each participant's upload.
- Objective: L = mean_i [ CE(z_i, y_i) + lam * g[y_i] * D(z_i, G[y_i]) ] with
  D(z, t) = -sum_c softmax(t)_c log softmax(z)_c, the targets constants. Round 0 has no global,
  so it is CE only; so is any sample whose class has no global row (g = 0).
- Inference: the local model (the default eval_params).
- Under DP-SGD (privacy.dp_sgd): L_k[c] is the class mean of the logits of one forward pass
  over the training split after training (Method.forward_pass 'after'), from a private release
  of the class sums and counts (`release_values`; docs/algorithm.md §11): the training passes
  visit an example in many batches, which no clip of one example's row bounds.
Floats per participating client and round: up C * s_k; down C * |{c in S_k : g_k[c]}|, i.e.
only the rows the client uses (its seen classes that have a global value), the spec's minimum
(HtFLlib would broadcast every available row, up to C^2). Class indices are metadata.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import struct

from fedssa_jax.methods import aggregation, base, losses


def distill_loss(logits, y, valid, targets, has_target, lam):
  """mean_i [CE(z_i, y_i) + lam * g[y_i] * CE(softmax(G[y_i]), softmax(z_i))] and #correct.

  targets [C, C] (row c is G[c]) and has_target [C] (g) are constants (§6 V3: a lookup)."""
  ce, correct = losses.ce_and_correct(logits, y, valid)
  soft = jax.nn.softmax(jax.lax.stop_gradient(targets)[y], axis=-1)
  dist = optax.softmax_cross_entropy(logits, soft) * has_target.astype(logits.dtype)[y]
  dist = jnp.sum(jnp.where(valid, dist, 0.0)) / jnp.maximum(valid.sum(), 1)
  return ce + lam * dist, correct


@struct.dataclass
class GlobalLogits:
  """The loss's constants (Download.ctx): client k's global logits."""
  has: jax.Array      # [C] bool g_k: whether G_k[c] exists
  targets: jax.Array  # [C, C] G_k: row c is class c's global mean logits


@struct.dataclass
class FDUpload:
  """A client's upload (Upload.payload)."""
  has: jax.Array     # [C] bool: the classes held (S_k, trained on)
  logits: jax.Array  # [C, C] L_k: row c the mean logits of class c, zero outside the held ones


@struct.dataclass
class FDServer:
  uploads: jax.Array      # [N, C, C] this round's uploads L_k (server_receive)
  uploads_has: jax.Array  # [N, C] which of their rows the clients hold
  sum: jax.Array          # [C, C] last round: sum_j L_j[c] ...
  cnt: jax.Array          # [C] ... and cnt_c (server_aggregate)
  # Last round's contributions, to subtract a client's own (fd.exclude_own only; else None).
  own: jax.Array | None = None      # [N, C, C]
  own_has: jax.Array | None = None  # [N, C]
  # Central client-level DP (else None): each class's owners, and the round's noise on the sums.
  owners: jax.Array | None = None   # [C] float32
  noise: jax.Array | None = None    # [C, C]


class FD(base.Method):
  name = 'fd'
  config_section = 'fd'
  per_sample_loss = True  # CE plus a per-sample distillation term
  ghost_norms = True  # the loss reads the parameters only through the model's apply
  private_upload = ('logits',)  # its class-mean logits (`has`, the classes it holds, is sent)
  central_noise_into = 'noise'

  @classmethod
  def default_config(cls):
    c = ml_collections.ConfigDict()  # docs/algorithm.md §6: the method's defaults
    c.lam = 1.0                  # weight of the distillation term
    c.exclude_own = False        # the FD paper's global logits without the client's own
    return c

  @classmethod
  def check_config(cls, c):
    if not c.lam >= 0:
      raise ValueError(f'fd.lam must be >= 0 (0 turns distillation off), got {c.lam}.')

  def __init__(self, config, num_clients, num_classes, image_shape=None):
    super().__init__(config, num_clients, num_classes, image_shape)
    self.lam = float(config.fd.lam)
    self.exclude_own = bool(config.fd.exclude_own)  # a bool field (the config is type-safe)
    self.central_q = base.central_share(config, num_clients)  # None: no central DP
    # Under DP-SGD: the class means from one forward pass's private release, not the training
    # passes' sums.
    self.private = base.dp_sgd_on(config)
    if self.private:
      self.forward_pass = 'after'

  def init_server(self, key, seen):
    n, c = self.num_clients, self.num_classes
    own = {}
    if self.exclude_own:
      own = dict(own=jnp.zeros((n, c, c), jnp.float32), own_has=jnp.zeros((n, c), bool))
    if self.central_q is not None:
      own.update(owners=jnp.asarray(seen, jnp.float32).sum(axis=0),
                 noise=jnp.zeros((c, c), jnp.float32))
    return FDServer(uploads=jnp.zeros((n, c, c), jnp.float32),
                    uploads_has=jnp.zeros((n, c), bool), sum=jnp.zeros((c, c), jnp.float32),
                    cnt=jnp.zeros((c,), jnp.float32), **own)

  def global_logits(self, server, client_id):
    """(G_k [C, C], g_k [C]) for client k, from the last aggregation only."""
    total, cnt = server.sum, server.cnt
    if self.exclude_own:
      own_has = server.own_has[client_id]
      total = total - jnp.where(own_has[:, None], server.own[client_id], 0.0)
      cnt = cnt - own_has
    # cnt is a count (or, under central DP, q times the owners: possibly below 1).
    return total / jnp.where(cnt > 0, cnt, 1.0)[:, None], cnt > 0

  def download(self, params, state, server, client):
    targets, has = self.global_logits(server, client.id)
    rows = (client.seen & has).sum()
    return base.Download(params, ctx=GlobalLogits(targets=targets, has=has),
                         floats=(self.num_classes * rows).astype(jnp.int32))

  def init_acc(self):
    if self.private:
      return None
    return base.ClassSums.zeros(self.num_classes, self.num_classes)

  def loss(self, apply_fn, trainable, ctx, views, y, valid):
    logits, _ = apply_fn({'params': trainable['model']}, views[0])
    loss, correct = distill_loss(logits, y, valid, ctx.targets, ctx.has, self.lam)
    if self.private:
      return loss, (correct, None)
    acc = base.class_sums(jax.lax.stop_gradient(logits), y, valid, self.num_classes)
    return loss, (correct, acc)

  def release_values(self, logits, rep):
    """Under DP-SGD, what L_k is class means of: the logits."""
    del rep
    return logits

  def upload(self, trainable, acc, ctx, state, client):
    logits, has = base.class_means(acc.forward_pass if self.private else acc.loss, client.seen)
    return base.Upload(trainable['model'], state, FDUpload(logits=logits, has=has),
                       floats=(self.num_classes * has.sum()).astype(jnp.int32))

  def server_receive(self, server, client_ids, payloads, active):
    return server.replace(
        uploads=aggregation.store_rows(server.uploads, client_ids, payloads.logits, active),
        uploads_has=aggregation.store_rows(server.uploads_has, client_ids, payloads.has, active))

  def server_aggregate(self, server, participants, round_index, key):
    contrib = server.uploads_has & participants[:, None]  # stale rows of absentees drop out
    # Sums, not means: exclude_own subtracts a client's own upload from them.
    total, cnt = aggregation.masked_sum(server.uploads, contrib)
    if self.central_q is not None:  # the noised sums, over a count fixed in advance
      total, cnt = total + server.noise, self.central_q * server.owners
      server = server.replace(noise=jnp.zeros_like(server.noise))
    server = server.replace(sum=total, cnt=cnt)
    if self.exclude_own:
      server = server.replace(own=jnp.where(contrib[:, :, None], server.uploads, 0.0),
                              own_has=contrib)
    return base.Aggregated(server)
