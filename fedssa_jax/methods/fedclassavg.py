"""FedClassAvg (Jang et al., ICPP 2022): header averaging plus SupCon and a proximal term
(docs/algorithm.md §6).

Exchange and server: exactly LG-FedAvg's (headers.SharedHeader): participants overwrite their
whole [C, d + 1] header with the global H_g (the common initial header before the first round),
train, upload the header with n_k, and H_g becomes the n_k-weighted mean over the round's
participants (`fedclassavg.weighting`: 'samples', the default, or 'uniform'). Floats: (d + 1) C
down and (d + 1) C up per participant (d = model.feature_dim, 500 in the paper); n_k is
metadata. No pretraining round (Decisions).

Objective, on two independently augmented views x1, x2 of the batch (`num_views = 2`), with
u = the d-wide post-ReLU representations of the 2B views (L2-normalised when `normalize`):

  L = L_SC + mean CE(H_k(u1), y) + (mu/2) * sum_{p in {W, b}} mean((p - p_g)^2)

  L_SC = -(tau/tau_b) (1/2B) sum_a (1/|P(a)|) sum_{q in P(a)} [s_aq - log sum_{j in A(a)} e^{s_aj}]

with s_aj = u_a.u_j / tau, A(a) = every other view, P(a) = the other views with a's label (always
including the sample's own other view), and p_g the downloaded global header (the loss's ctx).
Padded views are neither anchors nor members of P(a) or A(a), and 2B counts valid views only.
Defaults: normalize=True, tau = tau_b = 0.07 (standard SupCon), mu = 0.1; the official code's
variant is normalize=False, tau=100, tau_b=0.07. The training accuracy is CE's view 1.

Inference (docs/algorithm.md §5): each client's own model as it stands after its last local
training (its post-training header; non-participants keep theirs).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import struct

from fedssa_jax import models
from fedssa_jax.methods import headers, losses


def supcon(u, y, valid, tau: float, base_tau: float, normalize: bool):
  """SupCon over views u [V, d] with labels y [V] and validity valid [V] (fixed [V, V] masks)."""
  if normalize:  # u / max(||u||, 1e-12), as torch's F.normalize
    u = u * jax.lax.rsqrt(jnp.maximum(jnp.sum(u * u, axis=1, keepdims=True), 1e-24))
  s = (u @ u.T) / tau
  others = ~jnp.eye(u.shape[0], dtype=bool) & valid[:, None] & valid[None, :]  # A(a)
  pos = others & (y[:, None] == y[None, :])                                     # P(a)
  # Stable masked logsumexp over A(a); rows of padded anchors (A empty) give 0, not -inf.
  m = jax.lax.stop_gradient(jnp.max(jnp.where(others, s, -jnp.inf), axis=1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  denom = jnp.sum(jnp.exp(jnp.where(others, s - m, -jnp.inf)), axis=1)
  lse = m[:, 0] + jnp.log(jnp.where(valid, denom, 1.0))
  mean_pos = jnp.sum(jnp.where(pos, s, 0.0), axis=1) / jnp.maximum(pos.sum(axis=1), 1) - lse
  anchors = jnp.maximum(valid.sum(), 1)
  return -(tau / base_tau) * jnp.sum(jnp.where(valid, mean_pos, 0.0)) / anchors


def proximal(params, global_rows):
  """sum over p in {W, b} of mean((p - p_g)^2), the header against the global [C, d + 1]."""
  d = models.header_rows(params) - global_rows
  return jnp.mean(jnp.square(d[:, :-1])) + jnp.mean(jnp.square(d[:, -1]))


@struct.dataclass
class GlobalHeader:
  """The loss's constants (Download.ctx): the proximal term's anchor."""
  rows: jax.Array  # [C, d + 1] p_g, the downloaded global header H_g


class FedClassAvg(headers.SharedHeader):
  name = 'fedclassavg'
  per_sample_loss = False  # SupCon pairs every view of the batch
  ghost_norms = False  # (DP-SGD refuses its coupled loss anyway)
  config_section = 'fedclassavg'
  num_views = 2

  @classmethod
  def default_config(cls):
    c = ml_collections.ConfigDict()  # docs/algorithm.md §6: the method's defaults
    c.tau = 0.07                 # SupCon temperature
    c.base_tau = 0.07            # SupCon's base temperature (loss scale tau / base_tau)
    c.normalize = True           # L2-normalise representations (official code: False,
                                 # with tau = 100)
    c.mu = 0.1                   # proximal weight towards the global header
    c.weighting = 'samples'      # header mean: 'samples' (n_k) or 'uniform'
    return c

  @classmethod
  def check_config(cls, c):
    super().check_config(c)  # the shared header's weighting
    for field in ('tau', 'base_tau'):
      if not c[field] > 0:
        raise ValueError(f'fedclassavg.{field} must be > 0, got {c[field]!r}.')
    if not c.mu >= 0:
      raise ValueError(f'fedclassavg.mu must be >= 0, got {c.mu!r}.')
    if not isinstance(c.normalize, bool):
      raise ValueError(f'fedclassavg.normalize must be True or False, got {c.normalize!r}.')

  def __init__(self, config, num_clients, num_classes, image_shape=None):
    super().__init__(config, num_clients, num_classes, image_shape)
    c = config.fedclassavg
    self.tau, self.base_tau, self.mu = float(c.tau), float(c.base_tau), float(c.mu)
    self.normalize = c.normalize
    self.batch_size = int(config.batch_size)

  def download(self, params, state, server, client):
    down = super().download(params, state, server, client)
    return down._replace(ctx=GlobalHeader(rows=server.global_header))

  def loss(self, apply_fn, trainable, ctx, views, y, valid):
    params = trainable['model']
    b = y.shape[0]
    logits, rep = apply_fn({'params': params}, jnp.concatenate(views, axis=0))  # [2B, ...]
    ce, correct = losses.ce_and_correct(logits[:b], y, valid)
    sc = supcon(rep, jnp.concatenate([y, y]), jnp.concatenate([valid, valid]),
                self.tau, self.base_tau, self.normalize)
    return sc + ce + 0.5 * self.mu * proximal(params, ctx.rows), (correct, None)

  def train_flops_per_sample(self, own, flops_of):
    """Approximation: the second view costs another forward+backward of the own model (`own`
    again, its unused view-2 header included); the [2B, 2B] similarity matrix costs (2B)^2 d
    multiply-adds forward and twice that backward per step, i.e. 3 * 2 * 4 B^2 d FLOPs per step,
    24 B d per sample with B = config.batch_size (a partial last batch is counted as full).
    Normalisation, the softmax and the proximal term are ignored."""
    return 2.0 * own + 24.0 * self.batch_size * self.feature_dim
