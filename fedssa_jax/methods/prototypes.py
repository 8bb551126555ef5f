"""What the prototype methods share (FedProto, FedGH, FedTGP, FedSA, FedORGP; docs/algorithm.md
§6): their hook data, the client side of their upload, the prototype term of the loss, the
nearest-prototype prediction, the server's table of (prototype, class) pairs and the trainable
prototype net T of FedTGP and FedORGP.

A client's prototypes p_k[c], c in S_k, are class means of its 500-d representations r, from
the training passes (`proto_source='train_pass'`: V1 class sums accumulated by the loss over all
E epochs; FedProto's only source) or from a forward pass over the training split
(`'post_pass'`: Method.forward_pass, one visit of each sample; FedGH's and FedTGP's default).
Under DP-SGD (privacy.dp_sgd) they always come from one forward pass (`'post_pass'`), as a
private release of the class sums of r and the class counts (`PrototypeUploads.release_values`,
`release_prototypes`; docs/algorithm.md §11): the training passes visit an example in many
batches, which no clip of one example's row bounds.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from fedssa_jax import models
from fedssa_jax.methods import aggregation, base, losses

# Where FedGH's and FedTGP's prototypes come from: the forward pass over the training split after
# (or before) local training, or the training passes' V1 sums, as FedProto's.
PROTO_SOURCES = ('post_pass', 'train_pass')


@struct.dataclass
class GlobalPrototypes:
  """The loss's constants of FedProto and FedTGP (Download.ctx): the server's prototypes."""
  avail: jax.Array   # [C] bool: g, whether P[c] exists
  protos: jax.Array  # [C, D] P


@struct.dataclass
class PrototypeUpload:
  """A client's upload (Upload.payload): its prototypes and their class sample counts."""
  n: jax.Array       # [C] float32 n_k[c] (0: not held), metadata
  protos: jax.Array  # [C, D] p_k[c], zero outside the held classes


def proto_loss(logits, rep, y, valid, protos, avail, lam):
  """mean CE + lam / (B d) * sum_i g[y_i] ||r_i - P[y_i]||^2 over valid samples, and #correct."""
  ce, correct = losses.ce_and_correct(logits, y, valid)
  sq = jnp.sum((rep - jax.lax.stop_gradient(protos)[y]) ** 2, axis=-1)
  sq = jnp.where(valid & avail[y], sq, 0.0)
  return ce + lam * sq.sum() / (jnp.maximum(valid.sum(), 1) * rep.shape[-1]), correct


def nearest_prototype(rep, protos, avail):
  """argmin_c ||r - P[c]||^2 over available classes, as ||r||^2 - 2 r.P^T + ||P||^2."""
  dist = (jnp.sum(rep ** 2, -1, keepdims=True) - 2.0 * rep @ protos.T
          + jnp.sum(protos ** 2, -1)[None, :])
  return jnp.argmin(jnp.where(avail[None, :], dist, jnp.inf), axis=-1)


def prototype_hits(rep, y, valid, protos, avail):
  """The int32 count of valid samples whose nearest available prototype is their class's (0
  while no prototype exists): FedProto's and FedTGP's `prototype_accuracy`."""
  hit = (nearest_prototype(rep, protos, avail) == y) & valid & avail.any()
  return hit.sum().astype(jnp.int32)


def uploaded_prototypes(acc: base.Accumulated, seen, source: str, local_epochs: int):
  """(prototypes [C, D], zero outside the held classes; the class sample counts n_k[c] [C];
  held [C]) of a client, from the V1 class sums of r of the forward pass (`source`
  'post_pass': acc.forward_pass, one visit of each sample) or of the training passes
  ('train_pass': acc.loss, E visits of each sample)."""
  sums, visits = (acc.loss, local_epochs) if source == 'train_pass' else (acc.forward_pass, 1)
  protos, held = base.class_means(sums, seen)
  return protos, jnp.where(held, sums.count / visits, 0.0), held


class TGP(nn.Module):
  """The trainable prototype net T of FedTGP and FedORGP: class index -> a d-dimensional
  prototype, Embedding(C, d) (N(0, 1)) -> Linear(d, d) -> ReLU -> Linear(d, d) (PyTorch's
  default init)."""
  num_classes: int
  feature_dim: int

  @nn.compact
  def __call__(self, labels):
    x = nn.Embed(self.num_classes, self.feature_dim,
                 embedding_init=jax.nn.initializers.normal(1.0), name='embedding')(labels)
    x = nn.relu(models.Dense(self.feature_dim, name='fc1')(x))
    return models.Dense(self.feature_dim, name='fc2')(x)


def tgp_protos(tgp_params, num_classes: int):
  """T(0..C-1): every class's prototype [C, d]."""
  feature_dim = tgp_params['fc2']['bias'].shape[-1]
  return TGP(num_classes, feature_dim).apply({'params': tgp_params}, jnp.arange(num_classes))


def round_pairs(uploads, uploads_n, participants, pair_weight: str):
  """The round's (prototype, class) pairs as a flat table of the N * C slots: values [N C, D],
  labels [N C] and weights [N C] (> 0 for a participant's held class: 1, or n_k[c])."""
  n, c, d = uploads.shape
  held = (uploads_n > 0) & participants[:, None]
  weights = jnp.where(held, uploads_n if pair_weight == 'samples' else 1.0, 0.0)
  labels = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (n, c))
  return uploads.reshape(n * c, d), labels.reshape(-1), weights.reshape(-1)


class PrototypeUploads:
  """The client side that FedProto, FedGH and FedTGP share: prototypes p_k[c] for c in S_k,
  from the forward pass (`proto_source='post_pass'`, Method.forward_pass) or the training passes
  ('train_pass', this class's accumulator; FedProto's only source), uploaded with their class
  counts (PrototypeUpload) into a server's `uploads` [N, C, D] and `uploads_n` [N, C] tables. A
  mixin before base.Method; the method sets `proto_source` and `local_epochs`."""
  proto_source: str
  local_epochs: int
  private_upload = ('protos',)  # the prototypes (their class counts n are sent as they are)

  def release_values(self, logits, rep):
    """Under DP-SGD, what the prototypes are class means of: the representation r."""
    del logits
    return rep

  def release_prototypes(self, config) -> None:
    """Under DP-SGD (privacy.dp_sgd), the prototypes from one forward pass: `proto_source`
    'post_pass', and the pass after training unless the method places it before. A method's
    __init__ calls it last; without DP-SGD it changes nothing."""
    if base.dp_sgd_on(config):
      self.proto_source = 'post_pass'
      self.forward_pass = self.forward_pass or 'after'

  def init_acc(self):
    if self.proto_source != 'train_pass':
      return None
    return base.ClassSums.zeros(self.num_classes, self.feature_dim)

  def train_pass_sums(self, rep, y, valid):
    """The loss's accumulator update: V1 class sums of r with 'train_pass', else None."""
    if self.proto_source != 'train_pass':
      return None
    return base.class_sums(jax.lax.stop_gradient(rep), y, valid, self.num_classes)

  def upload(self, trainable, acc, ctx, state, client):
    protos, n, held = uploaded_prototypes(acc, client.seen, self.proto_source, self.local_epochs)
    return base.Upload(trainable['model'], state, PrototypeUpload(protos=protos, n=n),
                       floats=(self.feature_dim * held.sum()).astype(jnp.int32))

  def server_receive(self, server, client_ids, payloads, active):
    return server.replace(
        uploads=aggregation.store_rows(server.uploads, client_ids, payloads.protos, active),
        uploads_n=aggregation.store_rows(server.uploads_n, client_ids, payloads.n, active))
