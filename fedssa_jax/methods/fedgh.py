"""FedGH (Yi et al., ACM MM 2023), as HtFLlib implements it (docs/algorithm.md §6).

Clients share a global header H_g [C, d + 1] (row c = (W_g[c], b_g[c]), d = model.feature_dim),
which the server trains on the clients' class prototypes; no client parameter leaves the client.
- Server state: H_g, drawn from the server's key as a client's header is (as LG-FedAvg's; HtFLlib
  takes client 0's initial header).
- Download: a participant overwrites its whole header with H_g, unseen-class rows included.
- Objective: plain CE over the whole model (base.Method.loss).
- Prototypes: p_k[c] = the mean of r over the client's training samples of class c, c in S_k,
  from one forward pass over its training split after local training (Method.forward_pass
  'after': unaugmented, no gradient; HtFLlib's collect_protos), `fedgh.proto_source='post_pass'`.
  'train_pass' takes FedProto's training-pass means over all E epochs instead (no extra pass).
- Up: p_k[c] for c in S_k, with the class sample counts n_k[c] as metadata. The trained header
  stays with the client, and the next download overwrites it.
- Server: the round's pairs D_t = {(p_k[c], c) : k in P_t, c in S_k} (no memory), each counted
  once (`pair_weight='uniform'`; 'samples' weights a pair's CE by n_k[c], which no code does).
  H_g is trained by plain SGD (fresh each round), lr eta_s = `server_lr` = 0.01, for
  `server_epochs` = 1 epochs, each reshuffling D_t into batches of B_s = `server_batch` = 10 (the
  last partial): per batch, the mean over its pairs of CE(W_g p_j + b_g, c_j)
  (aggregation.train_on_pairs; server_epochs * ceil(|D_t| / B_s) steps).
- Inference: every client's own extractor with the latest H_g (`eval='global_header'`, as
  HtFLlib); 'post_train' keeps the client's own header as trained (the official code's).
Floats per participating client and round: up d * s_k, down (d + 1) C (HtFLlib broadcasts H_g
to all N clients every round; only participants are counted). Client FLOPs: the forward pass,
one forward over n_k samples. Server FLOPs, per step: 3 * (2 * B_s * (d + 1) * C) for the batch's
forward and backward products, and 2 * (d + 1) * C for the update.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import struct

from fedssa_jax import models
from fedssa_jax.methods import aggregation, base, losses, prototypes

PAIR_WEIGHTS = ('uniform', 'samples')
EVALS = ('global_header', 'post_train')


def header_loss(head, x, y, w):
  """The weighted mean over a batch of CE(W p_j + b, c_j), with `head` = [W | b] [C, d + 1]."""
  logits = x @ head[:, :-1].T + head[:, -1]
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  total = w.sum()
  return (w * ce).sum() / jnp.where(total > 0, total, 1.0)


@struct.dataclass
class FedGHServer:
  head: jax.Array       # [C, d + 1] H_g, what clients download
  uploads: jax.Array    # [N, C, D] this round's uploaded prototypes (server_receive)
  uploads_n: jax.Array  # [N, C] their class sample counts (0: not held)


class FedGH(prototypes.PrototypeUploads, base.Method):
  name = 'fedgh'
  config_section = 'fedgh'
  per_sample_loss = True  # plain cross-entropy
  ghost_norms = True  # the loss reads the parameters only through the model's apply
  # Evaluated with H_g (both False with eval='post_train', set in __init__).
  eval_reads_server = eval_server_header = True

  @classmethod
  def default_config(cls):
    c = ml_collections.ConfigDict()  # docs/algorithm.md §6: the method's defaults
    c.server_lr = 0.01           # eta_s: the server's plain SGD on H_g (HtFLlib)
    c.server_epochs = 1          # epochs over the round's pairs (HtFLlib's tuned script; its
                                 # default, 100, overfits H_g to one round)
    c.server_batch = 10          # B_s: pairs per server step (HtFLlib: the local batch, 10)
    c.pair_weight = 'uniform'    # a pair's CE weight: 'uniform' (1) or 'samples' (n_k[c])
    c.proto_source = 'post_pass'  # 'post_pass' (a forward pass after training) or
                                  # 'train_pass' (training-pass means over all E epochs)
    c.eval = 'global_header'     # evaluated header: 'global_header' (H_g) or 'post_train'
                                 # (the client's own header as trained)
    return c

  @classmethod
  def check_config(cls, c):
    if not c.server_lr > 0:
      raise ValueError(f'fedgh.server_lr must be > 0, got {c.server_lr}.')
    if not c.server_epochs >= 1:
      raise ValueError(f'fedgh.server_epochs must be >= 1, got {c.server_epochs}.')
    if not c.server_batch >= 1:
      raise ValueError(f'fedgh.server_batch must be >= 1, got {c.server_batch}.')
    for field, allowed in (('pair_weight', PAIR_WEIGHTS),
                           ('proto_source', prototypes.PROTO_SOURCES), ('eval', EVALS)):
      if c[field] not in allowed:
        raise ValueError(f'fedgh.{field} must be one of {allowed}, got {c[field]!r}.')

  def __init__(self, config, num_clients, num_classes, image_shape=None):
    super().__init__(config, num_clients, num_classes, image_shape)
    c = config.fedgh
    self.lr, self.epochs, self.batch = float(c.server_lr), int(c.server_epochs), int(c.server_batch)
    self.pair_weight, self.proto_source, self.eval = c.pair_weight, c.proto_source, c.eval
    self.forward_pass = 'after' if self.proto_source == 'post_pass' else None
    self.local_epochs = int(config.local_epochs)
    self.header_floats = self.header_row * num_classes
    self.eval_reads_server = self.eval_server_header = self.eval == 'global_header'
    self.release_prototypes(config)  # under DP-SGD: one forward pass's private class sums

  def init_server(self, key, seen):
    n, c = self.num_clients, self.num_classes
    return FedGHServer(head=models.init_header(key, c, self.feature_dim),
                       uploads=jnp.zeros((n, c, self.feature_dim), jnp.float32),
                       uploads_n=jnp.zeros((n, c), jnp.float32))

  def download(self, params, state, server, client):
    return base.Download(models.with_header_rows(params, server.head),
                         floats=jnp.int32(self.header_floats))

  def loss(self, apply_fn, trainable, ctx, views, y, valid):
    logits, rep = apply_fn({'params': trainable['model']}, views[0])
    loss, correct = losses.ce_and_correct(logits, y, valid)
    return loss, (correct, self.train_pass_sums(rep, y, valid))

  def server_aggregate(self, server, participants, round_index, key):
    values, labels, weights = prototypes.round_pairs(server.uploads, server.uploads_n, participants,
                                          self.pair_weight)
    head, loss_sum, steps, last = aggregation.train_on_pairs(
        server.head, header_loss, optax.sgd(self.lr), values, labels, weights, key,
        epochs=self.epochs, batch_size=self.batch)
    steps = steps.astype(jnp.float32)
    per_step = 3 * 2 * self.batch * self.header_floats + 2 * self.header_floats
    return base.Aggregated(server.replace(head=head), flops=per_step * steps,
                           metrics={'loss': loss_sum / jnp.maximum(steps, 1.0), 'steps': steps,
                                    'last_loss': last})

  def eval_header(self, server, client_id):
    return server.head
