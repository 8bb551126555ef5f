"""FedSA (Zhou et al., AAAI 2025: semantic anchors), as lokinko/FedSA implements it
(docs/algorithm.md §6).

Clients exchange class prototypes, as in FedProto, but train towards server-held *semantic
anchors* A [C, d] (d = model.feature_dim) rather than towards the prototypes' mean.
- Anchors: A_0 = ReLU(BN(L_2(ReLU(BN(L_1(E)))))), E ~ N(0, I) [C, d], L_1 and L_2 Linear(d, d)
  with PyTorch's default init, BN the batch norm over the C rows (batch mean, biased variance,
  eps 1e-5, gamma 1, beta 0; it cancels the biases): a frozen random projection, drawn once from
  the server's key (the reference re-seeds torch with 0, so its runs share one A_0) and never
  trained.
- Margin, fixed for a round: gamma_k = max(g_loc, g_glob), with g_glob the mean over classes of
  the distance from A_c to its nearest other anchor, and g_loc the same over the client's own
  prototypes of its previous participation (0 before its first, -inf where they covered one
  class or none); kept per client (FedSAClient), computed when it uploads.
- Objective, with r_i = F_k(x_i), h_k the header and sg(A) a constant:
    L = mean_i CE(h_k(r_i), y_i) + cc * mean_c CE(h_k(A_c), c)
        + lam / (B d) * sum_i ||r_i - A[y_i]||^2 + mcl * mean_i CE(-(D_i + gamma_k e_{y_i}), y_i),
  D_ic = sqrt(max(||r_i||^2 - 2 r_i.A_c + ||A_c||^2, 1e-12)) (`exact_sqrt`: no floor, as the
  reference, whose rounding below 0 gives NaN), lam = 10, cc = mcl = 1 (the authors' scripts).
  The calibration term (CC) covers all C anchors and reaches only the header; the MSE and the
  margin term (MCL) reach only the extractor.
- Up: p_k[c], the training-pass means of r over all E epochs (FedProto's V1 accumulator), for
  c in S_k; the class counts go along as metadata.
- Server, each round: P_bar[c] = the unweighted mean of the round's p_k[c] (V2, no memory;
  g[c] = some participant uploaded c); A[c] <- mu A[c] + (1 - mu) P_bar[c] for the uploaded
  classes only, mu = `ema_momentum` = 0.9999 (the other rows stay as they are); g_glob of the new
  A. Under central client-level DP, P_bar[c] = (the round's sum of clipped p_k[c] + noise) /
  (q |owners of c|), as FedProto's, and every class with an owner moves.
- Inference: the local classifier is the headline (`inference='classifier'`); the authors'
  figure, the nearest P_bar by (mean) squared distance over the uploaded classes (0 while none
  exists), is always logged as `prototype_accuracy`, and 'prototype' makes it the headline.
Floats per participating client and round: up d * s_k; down d * C (the anchors, round 0
included), plus d * |g| with 'prototype' (P_bar). Client FLOPs: the model's step plus the anchor
terms, 6 C d a sample and 6 C (d + 1) a step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import struct

from fedssa_jax import models
from fedssa_jax.methods import aggregation, base, losses, prototypes

INFERENCES = ('classifier', 'prototype')
BN_EPS = 1e-5     # the anchor projector's batch norm (PyTorch's default)
SQRT_FLOOR = 1e-12  # the floor under the squared distances of the margin term


def batch_norm_rows(h):
  """Batch norm over the rows of h [C, d] in training mode: batch mean, biased variance, eps
  1e-5, gamma 1, beta 0."""
  mean = h.mean(axis=0)
  var = ((h - mean) ** 2).mean(axis=0)
  return (h - mean) / jnp.sqrt(var + BN_EPS)


def project_anchors(noise, w1, b1, w2, b2):
  """A_0 = ReLU(BN(ReLU(BN(E W_1 + b_1)) W_2 + b_2)) of E = `noise` [C, d] (w: [d, d], as
  x @ w, a Flax kernel)."""
  dot = lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST)
  h = jax.nn.relu(batch_norm_rows(dot(noise, w1) + b1))
  return jax.nn.relu(batch_norm_rows(dot(h, w2) + b2))


def init_anchors(key, num_classes: int, feature_dim: int):
  """The initial anchors [C, d]: E ~ N(0, I) through two Linear(d, d) layers of PyTorch's init,
  each followed by batch norm over the C rows and ReLU; all drawn from `key`."""
  k_noise, k1, k2 = jax.random.split(key, 3)
  noise = jax.random.normal(k_noise, (num_classes, feature_dim), jnp.float32)
  l1 = models.Dense(feature_dim).init(k1, noise)['params']
  l2 = models.Dense(feature_dim).init(k2, noise)['params']
  return project_anchors(noise, l1['kernel'], l1['bias'], l2['kernel'], l2['bias'])


def mean_nearest_distance(points, mask):
  """The mean over the rows c with mask[c] of the Euclidean distance from points[c] to the
  nearest other such row (torch.cdist with the diagonal at inf, min, mean): FedSA's gap; -inf
  where fewer than two rows are masked in."""
  sq = (jnp.sum(points ** 2, -1)[:, None] + jnp.sum(points ** 2, -1)[None, :]
        - 2.0 * jnp.dot(points, points.T, precision=jax.lax.Precision.HIGHEST))
  dist = jnp.sqrt(jnp.maximum(sq, 0.0))
  pair = mask[:, None] & mask[None, :] & ~jnp.eye(mask.shape[0], dtype=bool)
  nearest = jnp.where(pair, dist, jnp.inf).min(axis=1)
  count = mask.sum()
  gap = jnp.where(mask, nearest, 0.0).sum() / jnp.maximum(count, 1)
  return jnp.where(count > 1, gap, -jnp.inf)


def anchor_distances(rep, anchors, exact_sqrt: bool):
  """D [B, C]: sqrt(||r||^2 - 2 r.A^T + ||A||^2), floored at 1e-12 under the root unless
  `exact_sqrt` (the reference's expanded form)."""
  sq = (jnp.sum(rep ** 2, -1, keepdims=True) - 2.0 * rep @ anchors.T
        + jnp.sum(anchors ** 2, -1)[None, :])
  return jnp.sqrt(sq if exact_sqrt else jnp.maximum(sq, SQRT_FLOOR))


def margin_loss(rep, anchors, y, valid, margin, exact_sqrt: bool):
  """The MCL term: mean over valid samples of CE(-(D_i + margin e_{y_i}), y_i)."""
  dist = anchor_distances(rep, anchors, exact_sqrt)
  dist = dist + margin * jax.nn.one_hot(y, anchors.shape[0], dtype=dist.dtype)
  return losses.ce_and_correct(-dist, y, valid)[0]


@struct.dataclass
class FedSAContext:
  """The loss's constants (Download.ctx): the anchors and the client's margin gamma_k."""
  anchors: jax.Array  # [C, D] A
  margin: jax.Array   # float32 gamma_k = max(g_loc, g_glob)


@struct.dataclass
class FedSAClient:
  """A client's persistent state: g_loc, the gap of its last uploaded prototypes (0 before its
  first upload, -inf where they covered fewer than two classes)."""
  local_gap: jax.Array  # float32


@struct.dataclass
class FedSAServer:
  anchors: jax.Array    # [C, D] A
  global_gap: jax.Array  # float32 g_glob of A
  uploads: jax.Array    # [N, C, D] this round's uploaded prototypes (server_receive)
  uploads_n: jax.Array  # [N, C] their class sample counts (0: not held)
  protos: jax.Array     # [C, D] P_bar, from the last aggregation (the logged metric's)
  avail: jax.Array      # [C] g, the classes of P_bar
  # Central client-level DP (else None): each class's owners, and the round's noise on the sums.
  owners: jax.Array | None = None  # [C] float32
  noise: jax.Array | None = None   # [C, D]


class FedSA(prototypes.PrototypeUploads, base.Method):
  name = 'fedsa'
  config_section = 'fedsa'
  proto_source = 'train_pass'  # the prototypes are the training passes' class means
  central_noise_into = 'noise'
  # A mean of per-sample terms plus the calibration term, which is the same for every pass of
  # a batch: a step's micro-batch passes, weighted by their samples, add it up once.
  per_sample_loss = True
  # ghost_norms stays False: the calibration term applies the header to the anchors, a second
  # use of the layer, so each example's gradient is built under DP-SGD.
  eval_metrics = ('prototype_accuracy',)
  eval_reads_server = True  # eval_extra: the server's P_bar
  eval_server_in_extra = True  # and nowhere else

  @classmethod
  def default_config(cls):
    c = ml_collections.ConfigDict()  # docs/algorithm.md §6: the method's defaults
    c.lam = 10.0                # lambda: weight of the MSE to the anchor (the authors' scripts)
    c.mcl = 1.0                 # weight of the margin-enhanced contrastive term (MCL)
    c.cc = 1.0                  # weight of the anchor-based classifier calibration (CC)
    c.ema_momentum = 0.9999     # mu: A[c] <- mu A[c] + (1 - mu) P_bar[c]
    c.exact_sqrt = False        # True: no floor under the squared distances (the reference)
    c.inference = 'classifier'  # headline accuracy: 'classifier' or 'prototype'
    return c

  @classmethod
  def check_config(cls, c):
    for field in ('lam', 'mcl', 'cc'):
      if not c[field] >= 0:
        raise ValueError(f'fedsa.{field} must be >= 0 (0 turns its term off), got {c[field]}.')
    if not 0 <= c.ema_momentum <= 1:
      raise ValueError(f'fedsa.ema_momentum must be in [0, 1] (1 keeps the anchors fixed), '
                       f'got {c.ema_momentum}.')
    if c.inference not in INFERENCES:
      raise ValueError(f'fedsa.inference must be one of {INFERENCES}, got {c.inference!r}.')

  def __init__(self, config, num_clients, num_classes, image_shape=None):
    super().__init__(config, num_clients, num_classes, image_shape)
    c = config.fedsa
    self.lam, self.mcl, self.cc = float(c.lam), float(c.mcl), float(c.cc)
    self.mu, self.exact_sqrt, self.inference = float(c.ema_momentum), c.exact_sqrt, c.inference
    self.headline_metric = 'accuracy' if self.inference == 'classifier' else 'prototype_accuracy'
    self.local_epochs, self.batch_size = int(config.local_epochs), int(config.batch_size)
    self.dtype = models.COMPUTE_DTYPES[config.engine.compute_dtype]
    self.central_q = base.central_share(config, num_clients)  # None: no central DP
    # Under DP-SGD: one forward pass's private class sums (the margin's local gap, from them,
    # is post-processing).
    self.release_prototypes(config)

  def init_server(self, key, seen):
    n, c, d = self.num_clients, self.num_classes, self.feature_dim
    anchors = init_anchors(key, c, d)
    central = {} if self.central_q is None else dict(
        owners=jnp.asarray(seen, jnp.float32).sum(axis=0), noise=jnp.zeros((c, d), jnp.float32))
    return FedSAServer(anchors=anchors,
                       global_gap=mean_nearest_distance(anchors, jnp.ones((c,), bool)),
                       uploads=jnp.zeros((n, c, d), jnp.float32),
                       uploads_n=jnp.zeros((n, c), jnp.float32),
                       protos=jnp.zeros((c, d), jnp.float32), avail=jnp.zeros((c,), bool),
                       **central)

  def init_client_state(self, key):
    return FedSAClient(local_gap=jnp.zeros((), jnp.float32))

  def download(self, params, state, server, client):
    rows = self.num_classes + (server.avail.sum() if self.inference == 'prototype' else 0)
    margin = jnp.maximum(state.local_gap, server.global_gap)
    return base.Download(params, ctx=FedSAContext(anchors=server.anchors, margin=margin),
                         floats=jnp.asarray(self.feature_dim * rows, jnp.int32))

  def loss(self, apply_fn, trainable, ctx, views, y, valid):
    logits, rep = apply_fn({'params': trainable['model']}, views[0])
    anchors = jax.lax.stop_gradient(ctx.anchors)
    every = jnp.ones((self.num_classes,), bool)
    # CE + lam / (B d) sum_i ||r_i - A[y_i]||^2
    loss, correct = prototypes.proto_loss(logits, rep, y, valid, anchors, every, self.lam)
    classes = jnp.arange(self.num_classes)
    calibration, _ = losses.ce_and_correct(
        models.apply_header(trainable['model'], anchors, self.dtype), classes, every)
    contrast = margin_loss(rep, anchors, y, valid, jax.lax.stop_gradient(ctx.margin),
                           self.exact_sqrt)
    loss = loss + self.cc * calibration + self.mcl * contrast
    return loss, (correct, self.train_pass_sums(rep, y, valid))

  def upload(self, trainable, acc, ctx, state, client):
    protos, n, held = prototypes.uploaded_prototypes(acc, client.seen, self.proto_source,
                                                     self.local_epochs)
    return base.Upload(trainable['model'],
                       FedSAClient(local_gap=mean_nearest_distance(protos, held)),
                       prototypes.PrototypeUpload(protos=protos, n=n),
                       floats=(self.feature_dim * held.sum()).astype(jnp.int32))

  def server_aggregate(self, server, participants, round_index, key):
    held = (server.uploads_n > 0) & participants[:, None]  # stale rows of absentees drop out
    if self.central_q is not None:  # the noised sums, over a count fixed in advance
      total, _ = aggregation.masked_sum(server.uploads, held)
      expected = self.central_q * server.owners
      avail = expected > 0
      protos = (total + server.noise) / jnp.where(avail, expected, 1.0)[:, None]
      server = server.replace(noise=jnp.zeros_like(server.noise))
    else:
      protos, avail = aggregation.masked_mean(server.uploads, held)
    moved = self.mu * server.anchors + (1.0 - self.mu) * protos
    anchors = jnp.where(avail[:, None], moved, server.anchors)
    gap = mean_nearest_distance(anchors, jnp.ones((self.num_classes,), bool))
    return base.Aggregated(server.replace(anchors=anchors, global_gap=gap, protos=protos,
                                          avail=avail))

  def train_flops_per_sample(self, own, flops_of):
    """The model's step, plus the anchor terms: the distances r.A^T forward and backward
    (6 C d a sample) and the calibration's header on the C anchors (6 C (d + 1) a step)."""
    c, d = self.num_classes, self.feature_dim
    return own + 6 * c * d + 6 * c * (d + 1) / self.batch_size

  def eval_extra(self, server, client_id, logits, rep, y, valid):
    return {'prototype_accuracy': prototypes.prototype_hits(rep, y, valid, server.protos,
                                                            server.avail)}
