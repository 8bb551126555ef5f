"""FedProto (Tan et al., AAAI 2022; docs/algorithm.md §6).

Unlike FedSSA, no parameters leave the client: the exchange is per-class *prototypes*, means of
the d-wide representation r = F_k(x) (d = model.feature_dim, 500 in the paper).
- Up: p_k[c], the mean over all E epochs of the training-pass representations of class c, for
  c in S_k (accumulated on the fly, §6 V1; no extra pass), with the class sample counts n_k[c]
  as metadata.
- Server (V2, no memory): P[c] = mean of p_k[c] over this round's participants holding c,
  unweighted (`fedproto.weighting='uniform'`, both codes) or weighted by n_k[c] ('samples', the
  paper). g[c] = [some participant holds c]; P is recomputed from the round's uploads only.
  Under central client-level DP (privacy.upload_mode='central', 'uniform' only): P[c] = (the
  sum of the round's clipped p_k[c] + noise) / (q |owners of c|), q = K / N' (N': the clients
  that take part), and g[c] = [c has an owner].
- Objective: L = mean_i CE(z_i, y_i) + lam * 1/(B d) * sum_i g[y_i] * ||r_i - P[y_i]||^2, with
  B the number of valid samples (torch MSELoss 'mean'): samples without a global prototype add 0
  but count in B. Round 0 has no prototype, so it is CE only.
- Inference: the local classifier is the headline (`inference='classifier'`). The accuracy of
  the nearest global prototype, argmin over c with g[c] of ||r||^2 - 2 r.P[c] + ||P[c]||^2 (one
  [B, C] matmul, unavailable classes at +inf; 0 while no prototype exists), is always logged as
  `prototype_accuracy`, against the server's latest P; `inference='prototype'` makes it the
  headline.
Floats per participating client and round: up d * s_k; down d * |S_k & avail| with
'classifier' (training needs only its own classes; the logged prototype accuracy is a
diagnostic, not charged) and d * |avail| with 'prototype'. Sample counts are metadata.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import struct

from fedssa_jax.methods import aggregation, base, prototypes


@struct.dataclass
class FedProtoServer:
  uploads: jax.Array    # [N, C, D] this round's uploaded prototypes (server_receive)
  uploads_n: jax.Array  # [N, C] their class sample counts (0: not held)
  protos: jax.Array     # [C, D] P, from the last aggregation
  avail: jax.Array      # [C] g
  # Central client-level DP (else None): each class's owners, and the round's noise on the sums.
  owners: jax.Array | None = None  # [C] float32
  noise: jax.Array | None = None   # [C, D]


class FedProto(prototypes.PrototypeUploads, base.Method):
  name = 'fedproto'
  proto_source = 'train_pass'  # the prototypes are the training passes' class means
  central_noise_into = 'noise'
  config_section = 'fedproto'
  per_sample_loss = True  # CE plus a per-sample prototype term
  ghost_norms = True  # the loss reads the parameters only through the model's apply
  eval_metrics = ('prototype_accuracy',)
  eval_reads_server = True  # eval_extra: the server's prototypes
  eval_server_in_extra = True  # and nowhere else

  @classmethod
  def default_config(cls):
    c = ml_collections.ConfigDict()  # docs/algorithm.md §6: the method's defaults
    c.lam = 1.0                  # weight of the prototype (MSE) term
    c.weighting = 'uniform'      # 'uniform' over holders, or 'samples' (class counts)
    c.inference = 'classifier'   # headline accuracy: 'classifier' or 'prototype'
    return c

  @classmethod
  def check_config(cls, c):
    if not c.lam >= 0:
      raise ValueError(f'fedproto.lam must be >= 0 (0 turns the prototype term off), '
                       f'got {c.lam}.')
    if c.weighting not in ('uniform', 'samples'):
      raise ValueError(
          f"fedproto.weighting must be 'uniform' or 'samples', got {c.weighting!r}.")
    if c.inference not in ('classifier', 'prototype'):
      raise ValueError(
          f"fedproto.inference must be 'classifier' or 'prototype', got {c.inference!r}.")

  def __init__(self, config, num_clients, num_classes, image_shape=None):
    super().__init__(config, num_clients, num_classes, image_shape)
    c = config.fedproto
    self.lam, self.weighting, self.inference = float(c.lam), c.weighting, c.inference
    self.headline_metric = 'accuracy' if self.inference == 'classifier' else 'prototype_accuracy'
    self.local_epochs = int(config.local_epochs)
    self.central_q = base.central_share(config, num_clients)  # None: no central DP
    self.release_prototypes(config)  # under DP-SGD: one forward pass's private class sums

  def init_server(self, key, seen):
    n, c = self.num_clients, self.num_classes
    central = {} if self.central_q is None else dict(
        owners=jnp.asarray(seen, jnp.float32).sum(axis=0),
        noise=jnp.zeros((c, self.feature_dim), jnp.float32))
    return FedProtoServer(uploads=jnp.zeros((n, c, self.feature_dim), jnp.float32),
                          uploads_n=jnp.zeros((n, c), jnp.float32),
                          protos=jnp.zeros((c, self.feature_dim), jnp.float32),
                          avail=jnp.zeros((c,), bool), **central)

  @classmethod
  def upload_refusal(cls, config, mode):
    if mode == 'central' and config.fedproto.weighting != 'uniform':
      return ("prototype mean weights each upload by its class counts, which noise on one sum "
              "does not cover (set fedproto.weighting='uniform' for it)")
    return super().upload_refusal(config, mode)

  def download(self, params, state, server, client):
    avail = server.avail
    rows = (client.seen & avail).sum() if self.inference == 'classifier' else avail.sum()
    return base.Download(params, ctx=prototypes.GlobalPrototypes(protos=server.protos,
                                                                 avail=avail),
                         floats=(self.feature_dim * rows).astype(jnp.int32))

  def loss(self, apply_fn, trainable, ctx, views, y, valid):
    logits, rep = apply_fn({'params': trainable['model']}, views[0])
    loss, correct = prototypes.proto_loss(logits, rep, y, valid, ctx.protos, ctx.avail, self.lam)
    return loss, (correct, self.train_pass_sums(rep, y, valid))

  def server_aggregate(self, server, participants, round_index, key):
    held = (server.uploads_n > 0) & participants[:, None]  # stale rows of absentees drop out
    if self.central_q is not None:  # the noised sums, over a count fixed in advance
      total, _ = aggregation.masked_sum(server.uploads, held)
      expected = self.central_q * server.owners
      avail = expected > 0
      protos = (total + server.noise) / jnp.where(avail, expected, 1.0)[:, None]
      return base.Aggregated(server.replace(protos=protos, avail=avail,
                                            noise=jnp.zeros_like(server.noise)))
    # masked_mean with a [N, C] weight mask: 1 per holder, or its class sample count.
    weights = held * server.uploads_n if self.weighting == 'samples' else held
    protos, avail = aggregation.masked_mean(server.uploads, weights)
    return base.Aggregated(server.replace(protos=protos, avail=avail))

  def eval_extra(self, server, client_id, logits, rep, y, valid):
    return {'prototype_accuracy': prototypes.prototype_hits(rep, y, valid, server.protos,
                                                            server.avail)}
