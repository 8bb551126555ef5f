"""FedTGP (Zhang et al., AAAI 2024), as HtFLlib implements it (docs/algorithm.md §6).

Clients exchange class prototypes, as in FedProto, but the server does not average them: it
trains a generator of prototypes T (the TGP net) that pushes the classes apart by a margin.
- T: Embedding(C, d) -> Linear(d, d) -> ReLU -> Linear(d, d), d = model.feature_dim (500 in
  the paper), PyTorch's default init (embedding N(0, 1), linear U(+-1/sqrt(d))), kept by the
  server across rounds: P_T = d C + 2 (d^2 + d) parameters (506,000 for C = 10, d = 500). Drawn
  from the server's key.
- Objective: L = mean_i CE(z_i, y_i) + lam * 1/(B d) * sum_i ||r_i - sg P^[y_i]||^2, lam =
  `fedtgp.lam` = 10 (prototypes.proto_loss). P^ exists for every class after round 0, the first
  aggregation; round 0 is CE only.
- Prototypes: p_k[c], the mean of r over the client's training samples of class c, c in S_k, from
  one forward pass over its training split after local training (`proto_timing='post_train'`,
  Method.forward_pass 'after'). 'pre_train' runs the pass before training, on the model as
  downloaded: HtFLlib's order (its collect_protos reloads the model saved at the start of the
  round). `proto_source='train_pass'` takes FedProto's training-pass means instead (no pass).
- Server, each round, from the round's uploads only:
  1. P_bar[c] = the unweighted mean of the participants' p_k[c] (V2).
  2. Q[c] = min over other uploaded classes c' of ||P_bar[c] - P_bar[c']||_2; a class without
     one gets min_c Q[c]; the margin delta = min(max_c Q[c], tau), tau = `margin_cap` = 100
     (tau when no two classes were uploaded).
  3. T trains for S = `server_epochs` = 100 epochs of plain SGD (fresh each round, lr
     `server_lr` = 0.01), each reshuffling the round's pairs (p_k[c], c) into batches of B_s =
     `server_batch` = 10 (aggregation.train_on_pairs). Per batch, with G = T(0..C-1) [C, d],
     dist[j, c] = sqrt(max(||p_j||^2 - 2 p_j.G[c] + ||G[c]||^2, 1e-12)) (HtFLlib has no floor,
     which gives NaN gradients at 0), dist[j, c_j] += delta, loss = mean_j CE(-dist[j], c_j).
  4. P^ = T(0..C-1), for every class.
- Inference: the local classifier is the headline (`inference='classifier'`); the accuracy of
  the nearest global prototype (prototypes.nearest_prototype over all C classes; 0 before round
  0's aggregation) is always logged as `prototype_accuracy`, and 'prototype' makes it the
  headline (what HtFLlib reports).
Floats per participating client and round: up d * s_k; down d * |S_k & avail| with
'classifier' and d * C with 'prototype' (after round 0). Client FLOPs: the forward pass, one
forward over n_k samples. Server FLOPs: the margin's 3 * C^2 * d, and per step 3 * (4 C d^2
+ 2 B_s C d) for T's and the distances' forward and backward products and 2 P_T for the
update.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import struct

from fedssa_jax.methods import aggregation, base, prototypes

PROTO_TIMINGS = ('post_train', 'pre_train')
INFERENCES = ('classifier', 'prototype')


def margin(means, has, cap):
  """delta = min(max_c Q[c], cap), with Q[c] the distance of class c's mean to its nearest other
  available class's mean, and min_c Q[c] for a class without one."""
  dist = jnp.sqrt(jnp.sum((means[:, None] - means[None]) ** 2, axis=-1))
  pair = has[:, None] & has[None, :] & ~jnp.eye(has.shape[0], dtype=bool)
  q = jnp.where(pair, dist, jnp.inf).min(axis=1)
  q = jnp.where(jnp.isfinite(q), q, q.min())
  return jnp.minimum(q.max(), cap)


def tgp_loss(tgp_params, x, y, w, *, delta, num_classes: int):
  """The weighted mean over a batch of CE(-dist[j], c_j), dist[j] the margined distances of
  p_j to every generated prototype."""
  g = prototypes.tgp_protos(tgp_params, num_classes)
  sq = jnp.sum(x ** 2, -1, keepdims=True) - 2.0 * x @ g.T + jnp.sum(g ** 2, -1)[None, :]
  dist = jnp.sqrt(jnp.maximum(sq, 1e-12)) + delta * jax.nn.one_hot(y, num_classes)
  ce = optax.softmax_cross_entropy_with_integer_labels(-dist, y)
  total = w.sum()
  return (w * ce).sum() / jnp.where(total > 0, total, 1.0)


@struct.dataclass
class FedTGPServer:
  tgp: dict             # T's parameters
  uploads: jax.Array    # [N, C, D] this round's uploaded prototypes (server_receive)
  uploads_n: jax.Array  # [N, C] their class sample counts (0: not held)
  protos: jax.Array     # [C, D] P^ = T(0..C-1), from the last aggregation
  avail: jax.Array      # [C] whether P^ exists (every class, after the first aggregation)


class FedTGP(prototypes.PrototypeUploads, base.Method):
  name = 'fedtgp'
  config_section = 'fedtgp'
  per_sample_loss = True  # CE plus a per-sample prototype term
  ghost_norms = True  # the loss reads the parameters only through the model's apply
  eval_metrics = ('prototype_accuracy',)
  eval_reads_server = True  # eval_extra: the server's prototypes P^
  eval_server_in_extra = True  # and nowhere else

  @classmethod
  def default_config(cls):
    c = ml_collections.ConfigDict()  # docs/algorithm.md §6: the method's defaults
    c.lam = 10.0                 # weight of the prototype (MSE) term (HtFLlib's tuned value)
    c.server_lr = 0.01           # the server's plain SGD on T (HtFLlib: the local lr, 0.01)
    c.server_epochs = 100        # S: epochs over the round's pairs
    c.server_batch = 10          # B_s: pairs per server step (HtFLlib: the local batch, 10)
    c.margin_cap = 100.0         # tau: the margin delta's cap
    c.proto_source = 'post_pass'  # 'post_pass' (a forward pass over the training split) or
                                  # 'train_pass' (training-pass means over all E epochs)
    c.proto_timing = 'post_train'  # the pass: 'post_train' (the trained model) or
                                   # 'pre_train' (the model as downloaded: HtFLlib's order)
    c.inference = 'classifier'   # headline accuracy: 'classifier' or 'prototype'
    return c

  @classmethod
  def check_config(cls, c):
    if not c.lam >= 0:
      raise ValueError(f'fedtgp.lam must be >= 0 (0 turns the prototype term off), '
                       f'got {c.lam}.')
    if not c.server_lr > 0:
      raise ValueError(f'fedtgp.server_lr must be > 0, got {c.server_lr}.')
    if not c.server_epochs >= 1:
      raise ValueError(f'fedtgp.server_epochs must be >= 1, got {c.server_epochs}.')
    if not c.server_batch >= 1:
      raise ValueError(f'fedtgp.server_batch must be >= 1, got {c.server_batch}.')
    if not c.margin_cap >= 0:
      raise ValueError(f'fedtgp.margin_cap must be >= 0, got {c.margin_cap}.')
    for field, allowed in (('proto_source', prototypes.PROTO_SOURCES),
                           ('proto_timing', PROTO_TIMINGS), ('inference', INFERENCES)):
      if c[field] not in allowed:
        raise ValueError(f'fedtgp.{field} must be one of {allowed}, got {c[field]!r}.')
    if c.proto_source == 'train_pass' and c.proto_timing != 'post_train':
      raise ValueError(
          f"fedtgp.proto_timing={c.proto_timing!r} places the forward pass, which "
          "fedtgp.proto_source='train_pass' does not run: set proto_timing='post_train', or "
          "proto_source='post_pass'.")

  def __init__(self, config, num_clients, num_classes, image_shape=None):
    super().__init__(config, num_clients, num_classes, image_shape)
    c = config.fedtgp
    self.lam, self.cap = float(c.lam), float(c.margin_cap)
    self.lr, self.epochs, self.batch = float(c.server_lr), int(c.server_epochs), int(c.server_batch)
    self.proto_source, self.inference = c.proto_source, c.inference
    self.forward_pass = (None if self.proto_source == 'train_pass' else
                         'after' if c.proto_timing == 'post_train' else 'before')
    self.headline_metric = 'accuracy' if self.inference == 'classifier' else 'prototype_accuracy'
    self.local_epochs = int(config.local_epochs)
    d = self.feature_dim
    self.tgp_size = d * num_classes + 2 * (d * d + d)  # P_T
    self.release_prototypes(config)  # under DP-SGD: one forward pass's private class sums

  def init_server(self, key, seen):
    n, c = self.num_clients, self.num_classes
    tgp = prototypes.TGP(c, self.feature_dim).init(key, jnp.arange(c))['params']
    d = self.feature_dim
    return FedTGPServer(tgp=tgp, uploads=jnp.zeros((n, c, d), jnp.float32),
                        uploads_n=jnp.zeros((n, c), jnp.float32),
                        protos=jnp.zeros((c, d), jnp.float32), avail=jnp.zeros((c,), bool))

  def download(self, params, state, server, client):
    avail = server.avail
    rows = (client.seen & avail).sum() if self.inference == 'classifier' else avail.sum()
    return base.Download(params, ctx=prototypes.GlobalPrototypes(protos=server.protos,
                                                                 avail=avail),
                         floats=(self.feature_dim * rows).astype(jnp.int32))

  def loss(self, apply_fn, trainable, ctx, views, y, valid):
    logits, rep = apply_fn({'params': trainable['model']}, views[0])
    loss, correct = prototypes.proto_loss(logits, rep, y, valid, ctx.protos, ctx.avail,
                                          self.lam)
    return loss, (correct, self.train_pass_sums(rep, y, valid))

  def server_aggregate(self, server, participants, round_index, key):
    c = self.num_classes
    held = (server.uploads_n > 0) & participants[:, None]
    means, has = aggregation.masked_mean(server.uploads, held)
    delta = margin(means, has, self.cap)
    values, labels, weights = prototypes.round_pairs(server.uploads, server.uploads_n,
                                                     participants, 'uniform')
    loss_fn = lambda p, x, y, w: tgp_loss(p, x, y, w, delta=delta, num_classes=c)
    tgp, loss_sum, steps, last = aggregation.train_on_pairs(
        server.tgp, loss_fn, optax.sgd(self.lr), values, labels, weights, key,
        epochs=self.epochs, batch_size=self.batch)
    steps = steps.astype(jnp.float32)
    d = self.feature_dim
    per_step = 3 * (4 * c * d * d + 2 * self.batch * c * d) + 2 * self.tgp_size
    flops = 3 * c * c * d + per_step * steps
    return base.Aggregated(
        server.replace(tgp=tgp, protos=prototypes.tgp_protos(tgp, c),
                       avail=server.avail | has.any()),
        flops=jnp.asarray(flops, jnp.float32),
        metrics={'loss': loss_sum / jnp.maximum(steps, 1.0), 'last_loss': last, 'steps': steps,
                 'margin': delta})

  def eval_extra(self, server, client_id, logits, rep, y, valid):
    return {'prototype_accuracy': prototypes.prototype_hits(rep, y, valid, server.protos,
                                                            server.avail)}
