"""FedORGP (Guo et al., arXiv 2502.16119), the paper's version by default (docs/algorithm.md §6).

FedTGP's trained global prototypes, with the server's margin CE replaced by an orthogonality
regulariser and the client's squared distance by a cosine term.
- T: FedTGP's trainable prototype net (prototypes.TGP: Embedding(C, d) -> Linear(d, d) -> ReLU
  -> Linear(d, d)), drawn from the server's key and kept by the server across rounds.
- Cosines: cos(a, b) = <a / max(||a||, 1e-12), b / max(||b||, 1e-12)> (F.normalize's).
- Objective: L = mean_i CE(z_i, y_i) + lam_c * mean_i g[y_i] (1 - cos(r_i, sg P^[y_i])),
  lam_c = `orgp.lam_c` = 100 (the paper's best cell; its scripts use 10). P^ exists for every
  class after round 0, the first aggregation; round 0 is CE only.
- Prototypes: p_k[c], the mean of r over the client's training samples of class c, c in S_k,
  from one forward pass over its training split after local training (Method.forward_pass
  'after'); `proto_source='train_pass'` takes FedProto's training-pass means instead.
  `orgp.filter_outliers` (the repository HEAD's) first drops each class's outliers
  (`filtered_means`), which needs the pass's per-sample representations
  (Method.forward_pass_rows).
- Server, each round, on the round's pairs (p_k[c], c): `server_epochs` = 1 epoch of plain SGD
  (fresh each round, lr `server_lr` = 0.01) over the pairs reshuffled into batches of B_p =
  `server_batch` = 32, the last partial (aggregation.train_on_pairs), each step on
  L_OR = lam_s (1 - s_b) + gamma o_b (`or_loss`), with G = T(0..C-1),
  s_b = mean_j cos(p_j, G[c_j]) and o_b = mean_j 1/(C-1) sum_{c != c_j} |cos(p_j, G[c])|,
  lam_s = 1, gamma = 10. `orgp.adaptive_weights` (the repository HEAD's) weights both terms
  by 1 + sigmoid((a - 0.3) / 0.5), not detached. Then P^ = T(0..C-1), for every class.
- Inference: the local classifier (the authors' metric too).
Floats per participating client and round: up d * s_k; down d * C (after round 0: all of P^,
as the authors send it). Client FLOPs: the forward pass, one forward over n_k samples. Server
FLOPs, per step: 3 * (4 C d^2 + 2 B_p C d) for T's and the cosines' forward and backward
products and 2 P_T for the update.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import struct

from fedssa_jax.methods import aggregation, base, losses, prototypes

VARIANTS = ('paper', 'repo_head')
EPS = 1e-12  # F.normalize's floor on a norm


def normalize(x):
  """x / max(||x||, 1e-12) along the last axis, with a gradient at x = 0 (zero, not NaN)."""
  return x / jnp.sqrt(jnp.maximum(jnp.sum(x * x, -1, keepdims=True), EPS * EPS))


def cosine_term(rep, y, valid, protos, avail):
  """(1/B) sum_i g[y_i] (1 - cos(r_i, sg P^[y_i])) over the B valid samples of a batch."""
  cos = jnp.sum(normalize(rep) * normalize(jax.lax.stop_gradient(protos))[y], -1)
  term = jnp.where(valid & avail[y], 1.0 - cos, 0.0)
  return term.sum() / jnp.maximum(valid.sum(), 1)


def adaptive_weight(a):
  """The repository HEAD's weight of a similarity a: 1 + sigmoid((a - 0.3) / 0.5)."""
  return 1.0 + jax.nn.sigmoid((a - 0.3) / 0.5)


def or_loss(net, x, y, w, *, num_classes: int, lam_s: float, gamma: float, adaptive: bool):
  """L_OR of T's prototypes T(0..C-1) (`orthogonality_loss`)."""
  return orthogonality_loss(prototypes.tgp_protos(net, num_classes), x, y, w, lam_s=lam_s,
                            gamma=gamma, adaptive=adaptive)


def orthogonality_loss(protos, x, y, w, *, lam_s: float, gamma: float, adaptive: bool):
  """L_OR of the prototypes G [C, d] over a batch of pairs (x [b, d], y [b]) with weights w
  [b] (1 valid, 0 padding): lam_s * intra + gamma * inter, each a weighted mean over the batch
  (inter also over the C - 1 other classes)."""
  num_classes = protos.shape[0]
  cos = normalize(x) @ normalize(protos).T                   # [b, C]
  own = jax.nn.one_hot(y, num_classes, dtype=cos.dtype)
  others = max(num_classes - 1, 1)
  sim = jnp.abs(cos) * (1.0 - own)                           # |cos| off the own class
  intra = 1.0 - (cos * own).sum(-1)
  if adaptive:
    intra = adaptive_weight(sim.sum(-1) / others) * intra
    inter = (sim * adaptive_weight(jnp.abs(cos)) * (1.0 - own)).sum(-1)
  else:
    inter = sim.sum(-1)
  total = w.sum()
  total = jnp.where(total > 0, total, 1.0)
  return lam_s * (w * intra).sum() / total + gamma * (w * inter).sum() / (total * others)


@struct.dataclass
class PassRows:
  """The forward pass's per-sample representations, in the client's training row's order
  (`orgp.filter_outliers`; Method.forward_pass_rows)."""
  member: jax.Array  # [W] int32: y + 1 for a sample of the pass, 0 elsewhere
  rep: jax.Array     # [W, D] its representation r, zero elsewhere


def _class_stats(v, mask, n):
  """Per class, over its samples (mask [C, W]): mean, unbiased std, min and max of v [W]."""
  safe = jnp.maximum(n, 1.0)
  mean = jnp.where(mask, v, 0.0).sum(1) / safe
  var = jnp.where(mask, (v - mean[:, None]) ** 2, 0.0).sum(1) / jnp.maximum(n - 1.0, 1.0)
  return (mean, jnp.sqrt(var), jnp.where(mask, v, jnp.inf).min(1),
          jnp.where(mask, v, -jnp.inf).max(1))


def filtered_means(rep, member, num_classes: int, alpha: float):
  """The repository HEAD's outlier filter (clientorth.filter_outliers_multi_metric) on each
  class's representations, then their mean: (means [C, D], zero for an absent class; the
  class counts n [C], before filtering). rep [W, D], member [W] (PassRows).

  Per class with n > 2 samples f_i (n <= 2: all kept): mu = mean f, delta_i = ||f_i - mu||,
  kappa_i = cos(f_i, mu); rho = cv(delta) / cv(kappa) (cv = unbiased std / |mean|, each
  floored at 1e-8); alpha' = clip(alpha (1 - 0.3 tanh(0.5 (rho - 1))), 0.1, 0.9); score s_i =
  alpha' (1 - minmax(delta)_i) + (1 - alpha') minmax(kappa)_i (minmax(v) = (v - min) / (max -
  min + 1e-8)); keep s_i in [Q1 - 1.5 IQR, Q3 + 1.5 IQR] (linear quantiles), or the floor(n / 2)
  highest scores if fewer are kept."""
  c = num_classes
  y = jnp.maximum(member - 1, 0)
  mask = (jnp.arange(c)[:, None] == member[None, :] - 1)          # [C, W]
  maskf = mask.astype(rep.dtype)
  n = maskf.sum(1)
  mu = maskf @ rep / jnp.maximum(n, 1.0)[:, None]
  dist = jnp.sqrt(jnp.sum((rep - mu[y]) ** 2, -1))
  cos = jnp.sum(normalize(rep) * normalize(mu)[y], -1)
  dm, ds, dmin, dmax = _class_stats(dist, mask, n)
  cm, cs, cmin, cmax = _class_stats(cos, mask, n)
  ratio = (jnp.maximum(ds, 1e-8) / jnp.maximum(dm, 1e-8)) / (
      jnp.maximum(cs, 1e-8) / jnp.maximum(jnp.abs(cm), 1e-8))
  adjust = jnp.clip(1.0 - 0.3 * jnp.tanh(0.5 * (ratio - 1.0)), 0.4, 1.6)
  a = jnp.clip(alpha * adjust, 0.1, 0.9)[y]
  score = (a * (1.0 - (dist - dmin[y]) / (dmax[y] - dmin[y] + 1e-8))
           + (1.0 - a) * (cos - cmin[y]) / (cmax[y] - cmin[y] + 1e-8))
  ordered = jnp.sort(jnp.where(mask, score, jnp.inf), axis=1)     # each class's scores first
  at = lambda i: jnp.take_along_axis(ordered, i.astype(jnp.int32)[:, None], 1)[:, 0]

  def quantile(q):  # linear interpolation, as torch.quantile
    pos = q * jnp.maximum(n - 1.0, 0.0)
    lo, hi = jnp.floor(pos), jnp.ceil(pos)
    return at(lo) + (pos - lo) * (at(hi) - at(lo))

  q1, q3 = quantile(0.25), quantile(0.75)
  low, high = q1 - 1.5 * (q3 - q1), q3 + 1.5 * (q3 - q1)
  keep = mask & (score >= low[:, None]) & (score <= high[:, None])
  least = jnp.floor(n / 2.0)
  top = mask & (score >= at(jnp.maximum(n - least, 0.0))[:, None])  # the floor(n/2) highest
  keep = jnp.where((keep.sum(1) < least)[:, None], top, keep)
  keep = jnp.where((n <= 2)[:, None], mask, keep).astype(rep.dtype)
  return keep @ rep / jnp.maximum(keep.sum(1), 1.0)[:, None], n


@struct.dataclass
class FedORGPServer:
  net: dict             # T's parameters
  uploads: jax.Array    # [N, C, D] this round's uploaded prototypes (server_receive)
  uploads_n: jax.Array  # [N, C] their class sample counts (0: not held)
  protos: jax.Array     # [C, D] P^ = T(0..C-1), from the last aggregation
  avail: jax.Array      # [C] whether P^ exists (every class, after the first aggregation)


class FedORGP(prototypes.PrototypeUploads, base.Method):
  name = 'fedorgp'
  config_section = 'orgp'
  per_sample_loss = True  # CE plus a per-sample cosine term
  ghost_norms = True  # the loss reads the parameters only through the model's apply

  @classmethod
  def default_config(cls):
    c = ml_collections.ConfigDict()  # docs/algorithm.md §6: the method's defaults
    c.lam_c = 100.0              # lambda_c: the client's cosine term (paper; its scripts: 10)
    c.lam_s = 1.0                # lambda_s: the server's intra-class term
    c.gamma = 10.0               # gamma: the server's inter-class (orthogonality) term
    c.server_lr = 0.01           # the server's plain SGD on T
    c.server_epochs = 1          # epochs over the round's pairs
    c.server_batch = 32          # B_p: pairs per server step (the paper's)
    c.proto_source = 'post_pass'  # 'post_pass' (a forward pass over the training split after
                                  # training) or 'train_pass' (training-pass means)
    c.variant = 'paper'          # 'paper', or 'repo_head': both options below on
    c.adaptive_weights = False   # the repository HEAD's adaptive weights in L_OR
    c.filter_outliers = False    # the repository HEAD's outlier filter on the client
    c.filter_alpha = 0.5         # alpha: the filter's distance vs cosine weight
    return c

  @classmethod
  def check_config(cls, c):
    for field in ('lam_c', 'lam_s', 'gamma'):
      if not c[field] >= 0:
        raise ValueError(f'orgp.{field} must be >= 0, got {c[field]}.')
    if not c.server_lr > 0:
      raise ValueError(f'orgp.server_lr must be > 0, got {c.server_lr}.')
    for field in ('server_epochs', 'server_batch'):
      if not c[field] >= 1:
        raise ValueError(f'orgp.{field} must be >= 1, got {c[field]}.')
    for field, allowed in (('proto_source', prototypes.PROTO_SOURCES), ('variant', VARIANTS)):
      if c[field] not in allowed:
        raise ValueError(f'orgp.{field} must be one of {allowed}, got {c[field]!r}.')
    if not 0 <= c.filter_alpha <= 1:
      raise ValueError(f'orgp.filter_alpha must be in [0, 1], got {c.filter_alpha}.')
    if c.proto_source == 'train_pass' and (c.filter_outliers or c.variant == 'repo_head'):
      raise ValueError(
          "orgp.filter_outliers needs the forward pass's representations, which "
          "orgp.proto_source='train_pass' does not run: set proto_source='post_pass', or "
          "filter_outliers=False with variant='paper'.")

  def __init__(self, config, num_clients, num_classes, image_shape=None):
    super().__init__(config, num_clients, num_classes, image_shape)
    c = config.orgp
    head = c.variant == 'repo_head'
    self.lam_c, self.lam_s, self.gamma = float(c.lam_c), float(c.lam_s), float(c.gamma)
    self.lr, self.epochs, self.batch = float(c.server_lr), int(c.server_epochs), int(c.server_batch)
    self.adaptive, self.filter = bool(c.adaptive_weights) or head, bool(c.filter_outliers) or head
    self.alpha = float(c.filter_alpha)
    self.proto_source = c.proto_source
    self.forward_pass = None if self.proto_source == 'train_pass' else 'after'
    self.forward_pass_rows = self.filter
    self.local_epochs = int(config.local_epochs)
    d = self.feature_dim
    self.tgp_size = d * num_classes + 2 * (d * d + d)  # P_T
    self.release_prototypes(config)  # under DP-SGD: one forward pass's private class sums

  @classmethod
  def dp_sgd_refusal(cls, config):
    c = config.orgp
    if c.filter_outliers or c.variant == 'repo_head':
      return ("its outlier filter (orgp.filter_outliers, on in variant='repo_head') keeps or "
              "drops each sample by the others' representations, which no clip of one "
              "example's share bounds (set filter_outliers=False with variant='paper')")
    return super().dp_sgd_refusal(config)

  def init_server(self, key, seen):
    n, c, d = self.num_clients, self.num_classes, self.feature_dim
    net = prototypes.TGP(c, d).init(key, jnp.arange(c))['params']
    return FedORGPServer(net=net, uploads=jnp.zeros((n, c, d), jnp.float32),
                         uploads_n=jnp.zeros((n, c), jnp.float32),
                         protos=jnp.zeros((c, d), jnp.float32), avail=jnp.zeros((c,), bool))

  def download(self, params, state, server, client):
    return base.Download(params, ctx=prototypes.GlobalPrototypes(protos=server.protos,
                                                                 avail=server.avail),
                         floats=(self.feature_dim * server.avail.sum()).astype(jnp.int32))

  def loss(self, apply_fn, trainable, ctx, views, y, valid):
    logits, rep = apply_fn({'params': trainable['model']}, views[0])
    ce, correct = losses.ce_and_correct(logits, y, valid)
    loss = ce + self.lam_c * cosine_term(rep, y, valid, ctx.protos, ctx.avail)
    return loss, (correct, self.train_pass_sums(rep, y, valid))

  def forward_pass_stats(self, logits, rep, y, valid, pos=None, width=None):
    if not self.filter:
      return super().forward_pass_stats(logits, rep, y, valid)
    return PassRows(
        member=jnp.zeros((width,), jnp.int32).at[pos].set(jnp.where(valid, y + 1, 0),
                                                           mode='drop'),
        rep=jnp.zeros((width, rep.shape[-1]), rep.dtype).at[pos].set(
            jnp.where(valid[:, None], rep, 0.0), mode='drop'))

  def upload(self, trainable, acc, ctx, state, client):
    if not self.filter:
      return super().upload(trainable, acc, ctx, state, client)
    protos, n = filtered_means(acc.forward_pass.rep, acc.forward_pass.member,
                               self.num_classes, self.alpha)
    held = client.seen & (n > 0)
    payload = prototypes.PrototypeUpload(protos=jnp.where(held[:, None], protos, 0.0),
                                         n=jnp.where(held, n, 0.0))
    return base.Upload(trainable['model'], state, payload,
                       floats=(self.feature_dim * held.sum()).astype(jnp.int32))

  def server_aggregate(self, server, participants, round_index, key):
    c, d = self.num_classes, self.feature_dim
    values, labels, weights = prototypes.round_pairs(server.uploads, server.uploads_n,
                                                     participants, 'uniform')
    loss_fn = lambda p, x, y, w: or_loss(p, x, y, w, num_classes=c, lam_s=self.lam_s,
                                         gamma=self.gamma, adaptive=self.adaptive)
    net, loss_sum, steps, last = aggregation.train_on_pairs(
        server.net, loss_fn, optax.sgd(self.lr), values, labels, weights, key,
        epochs=self.epochs, batch_size=self.batch)
    steps = steps.astype(jnp.float32)
    per_step = 3 * (4 * c * d * d + 2 * self.batch * c * d) + 2 * self.tgp_size
    return base.Aggregated(
        server.replace(net=net, protos=prototypes.tgp_protos(net, c),
                       avail=server.avail | (weights > 0).any()),
        flops=jnp.asarray(per_step * steps, jnp.float32),
        metrics={'loss': loss_sum / jnp.maximum(steps, 1.0), 'last_loss': last, 'steps': steps})
