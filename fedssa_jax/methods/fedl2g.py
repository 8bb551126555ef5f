"""FedL2G (Zhang et al., arXiv 2410.06490), as HtFLlib implements it (docs/algorithm.md §6).

The server learns guiding vectors V [C, D], one row per class, which the clients' local loss
pulls their outputs towards; V is trained on the clients' meta gradients, how a step towards it
would change the loss of samples never trained on.
- Variants (`fedl2g.variant`): 'feat' guides the representation, phi(x) = r, D = d; 'logit'
  guides the logits, phi(x) = z, D = C.
- Server state: V, initialised N(0, 1) from the server's key (HtFLlib's nn.Embedding), kept
  across rounds.
- Held-out quiz set: the first Q = `quiz_size` = 10 positions of each client's training index
  row (Method.held_out_samples); local training never sees them, so a client trains on
  n_k - Q samples.
- Warm-up: in rounds t < `warmup` = 50 nobody trains (Method.trains); the meta step and the
  exchange run every round, and the warm-up rounds count in the round and float budgets.
- Objective: L = mean_i CE(z_i, y_i) + w * 1/(B D) * sum_i ||phi(x_i) - sg V[y_i]||^2 over the
  B valid samples, w = `guide_weight` = 1. Every class has a V row from round 0 on.
- Meta step, every round, on the trained theta (Method.after_training): a study batch (x_s,
  y_s) of B samples of the trainable split, drawn with the client's key of STREAM_STUDY, and the
  quiz set (x_q, y_q), both unaugmented. One plain SGD step at the local lr eta (no momentum, no
  clip, no weight decay), theta' = theta - eta * grad_theta [CE(x_s) + w MSE(phi(x_s), V[y_s])],
  and g_V = d mean CE(f(x_q; theta'), y_q) / dV. The guiding term is quadratic in V, so exactly
      g_V[c] = eta * w * 2/(B D) * sum_{i in study, y_i = c} J_phi(x_i; theta) v,
  v = grad_theta' CE(x_q; theta'): one JVP of phi on the study batch, then V1 class sums
  (`meta_gradient`; tests/method_fedl2g_test.py checks it against autodiff through the step).
- Up: g_V[c] for the classes present in the study batch (HtFLlib selects rows by sum|g| > 0).
- Server, each round: G[c] = the unweighted mean of the round's uploaded rows of class c (0 if
  none); G [C, D] is clipped to a global norm of `server_clip` = 100 (torch's clip_grad_norm_,
  scale min(1, 100 / (||G|| + 1e-6))); V <- V - eta_s G, eta_s = `server_lr`: None takes the
  variant's tuned value (TsingZ0/FedL2G's scripts), 100 for 'feat' and 0.1 for 'logit'.
- Inference: the local model (the default).
- Under DP-SGD (privacy.dp_sgd): g_V is released whole (Method.release_after_training;
  docs/algorithm.md §11): clipped to the global norm C_r = privacy.release_clip and noised by
  the engine, one release a round; its rows are those of every class in S_k, not only the
  study batch's (which classes the batch holds comes from the data), absent ones zero before
  the noise.
Floats per participating client and round: down D * s_k (V[c] for c in S_k); up D * (classes
in the study batch) <= D * s_k. Client FLOPs: the meta step, charged as 5/3 CE training steps
per study sample (the inner gradient, and the JVP, a forward with its tangent) and 1 per quiz
sample (the gradient at theta'). The server's rule (a mean, a norm and an update over C * D
numbers) is not counted, as FedProto's mean is not.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import struct
from ml_collections import config_dict

from fedssa_jax.methods import base, losses

VARIANTS = ('feat', 'logit')
# The tuned server lr of each variant (TsingZ0/FedL2G system/total.sh), for server_lr None.
SERVER_LRS = {'feat': 100.0, 'logit': 0.1}


def guided(logits, rep, variant: str):
  """phi(x): what the guiding vectors guide, the representation r ('feat') or the logits."""
  return rep if variant == 'feat' else logits


def guided_loss(logits, rep, y, valid, vectors, weight, variant: str):
  """mean CE + weight / (B D) * sum_i ||phi_i - V[y_i]||^2 over the valid samples, and #correct
  (V as given: the training loss passes sg V, the meta step's inner loss V itself)."""
  ce, correct = losses.ce_and_correct(logits, y, valid)
  phi = guided(logits, rep, variant)
  sq = jnp.where(valid, jnp.sum((phi - vectors[y]) ** 2, axis=-1), 0.0)
  return ce + weight * sq.sum() / (jnp.maximum(valid.sum(), 1) * phi.shape[-1]), correct


def inner_step(apply_fn, params, vectors, study, *, lr, weight, variant: str):
  """theta' = theta - lr * grad_theta of the guided loss on the study batch (plain SGD)."""
  x, y, valid = study

  def loss(p):
    logits, rep = apply_fn({'params': p}, x)
    return guided_loss(logits, rep, y, valid, vectors, weight, variant)[0]
  grads = jax.grad(loss)(params)
  return jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)


def quiz_loss(apply_fn, params, quiz):
  """Mean CE of the model on the quiz set."""
  x, y, valid = quiz
  return losses.cross_entropy_loss(apply_fn, params, x, y, valid)[0]


def meta_gradient(apply_fn, params, vectors, study, quiz, *, lr, weight, variant: str):
  """g_V [C, D] by the closed form (the module docstring): v = the quiz loss's gradient at
  theta' = inner_step(theta), then lr * weight * 2/(B D) * the class sums over the study batch of
  the JVP J_phi(x_i; theta) v. Rows of classes absent from the study batch are 0."""
  x, y, valid = study
  stepped = inner_step(apply_fn, params, vectors, study, lr=lr, weight=weight, variant=variant)
  v = jax.grad(lambda p: quiz_loss(apply_fn, p, quiz))(stepped)
  phi = lambda p: guided(*apply_fn({'params': p}, x), variant)
  _, jv = jax.jvp(phi, (params,), (v,))
  sums = base.class_sums(jv, y, valid, vectors.shape[0]).sum
  return lr * weight * 2.0 / (jnp.maximum(valid.sum(), 1) * vectors.shape[1]) * sums


def meta_gradient_autodiff(apply_fn, params, vectors, study, quiz, *, lr, weight,
                           variant: str):
  """g_V by differentiating the quiz loss through the inner step with respect to V (what
  HtFLlib's `higher` computes; the closed form's reference)."""
  return jax.grad(lambda vec: quiz_loss(apply_fn, inner_step(
      apply_fn, params, vec, study, lr=lr, weight=weight, variant=variant), quiz))(vectors)


def clipped_step(vectors, grad, lr, clip):
  """V - lr * G with G scaled to a global norm of at most `clip` (torch's clip_grad_norm_:
  min(1, clip / (||G|| + 1e-6))). Returns (V, ||G|| before the clip)."""
  norm = jnp.sqrt(jnp.sum(grad ** 2))
  scale = jnp.minimum(1.0, clip / (norm + 1e-6))
  return vectors - lr * scale * grad, norm


@struct.dataclass
class GuidingVectors:
  """The loss's and the meta step's constants (Download.ctx)."""
  vectors: jax.Array  # [C, D] V, as downloaded


@struct.dataclass
class MetaGradient:
  """The meta step's output (after_training), which is the client's upload (Upload.payload)."""
  grad: jax.Array     # [C, D] g_V, zero outside the classes present in the study batch
  present: jax.Array  # [C] bool: the classes present in the study batch (the rows sent)


@struct.dataclass
class FedL2GServer:
  vectors: jax.Array     # [C, D] V, the guiding vectors clients download
  grad_sum: jax.Array    # [C, D] the sum of this round's uploaded meta-gradient rows
  grad_count: jax.Array  # [C] how many rows of each class were uploaded this round


class FedL2G(base.Method):
  name = 'fedl2g'
  config_section = 'fedl2g'
  per_sample_loss = True  # CE plus a per-sample guiding term
  ghost_norms = True  # the loss reads the parameters only through the model's apply
  private_upload = ('grad',)  # the meta-gradient rows (`present`, which are sent, goes as is)
  # The meta step: the inner gradient and phi's JVP on the study batch (1 + 2/3 CE training
  # steps per sample), the quiz loss's gradient at theta' (1 per quiz sample).
  after_training_steps = (5.0 / 3.0, 1.0)

  @classmethod
  def default_config(cls):
    c = ml_collections.ConfigDict()  # docs/algorithm.md §6: the method's defaults
    c.variant = 'feat'           # what V guides: 'feat' (r, D = d) or 'logit' (z, D = C)
    c.server_lr = config_dict.placeholder(float)  # eta_s: None takes the variant's tuned value,
                                                  # 100 ('feat') or 0.1 ('logit')
    c.warmup = 50                # rounds t < warmup train nothing (the meta step still runs)
    c.quiz_size = 10             # Q: the first Q training samples, never trained on
    c.guide_weight = 1.0         # w: the guiding (MSE) term's weight (HtFLlib: 1)
    c.server_clip = 100.0        # the global-norm clip of the aggregated meta gradient
    return c

  @classmethod
  def check_config(cls, c):
    if c.variant not in VARIANTS:
      raise ValueError(f'fedl2g.variant must be one of {VARIANTS}, got {c.variant!r}.')
    if c.server_lr is not None and not c.server_lr > 0:
      raise ValueError(f"fedl2g.server_lr must be > 0, or None (the variant's default: "
                       f'{SERVER_LRS}), got {c.server_lr}.')
    if not c.warmup >= 0:
      raise ValueError(f'fedl2g.warmup must be >= 0 (0: train from round 0), got {c.warmup}.')
    if not c.quiz_size >= 1:
      raise ValueError(f'fedl2g.quiz_size must be >= 1, got {c.quiz_size}.')
    if not c.guide_weight >= 0:
      raise ValueError(f'fedl2g.guide_weight must be >= 0, got {c.guide_weight}.')
    if not c.server_clip > 0:
      raise ValueError(f'fedl2g.server_clip must be > 0, got {c.server_clip}.')

  def __init__(self, config, num_clients, num_classes, image_shape=None):
    super().__init__(config, num_clients, num_classes, image_shape)
    c = config.fedl2g
    self.variant = c.variant
    self.dim = self.feature_dim if self.variant == 'feat' else num_classes  # D
    self.server_lr = float(SERVER_LRS[self.variant] if c.server_lr is None else c.server_lr)
    self.warmup, self.weight = int(c.warmup), float(c.guide_weight)
    self.clip = float(c.server_clip)
    self.held_out_samples = int(c.quiz_size)
    self.inner_lr = float(config.optimizer.lr)  # eta: the local lr, plain SGD
    # Under DP-SGD, g_V is a private release of its own, whole (Method.release_after_training),
    # with the rows of every class the client holds.
    self.private = base.dp_sgd_on(config)
    self.release_after_training = self.private

  def init_server(self, key, seen):
    c, d = self.num_classes, self.dim
    return FedL2GServer(vectors=jax.random.normal(key, (c, d), jnp.float32),
                        grad_sum=jnp.zeros((c, d), jnp.float32),
                        grad_count=jnp.zeros((c,), jnp.float32))

  def trains(self, round_index):
    return True if self.warmup == 0 else round_index >= self.warmup

  def download(self, params, state, server, client):
    return base.Download(params, ctx=GuidingVectors(vectors=server.vectors),
                         floats=(self.dim * client.seen.sum()).astype(jnp.int32))

  def loss(self, apply_fn, trainable, ctx, views, y, valid):
    logits, rep = apply_fn({'params': trainable['model']}, views[0])
    loss, correct = guided_loss(logits, rep, y, valid, jax.lax.stop_gradient(ctx.vectors),
                                self.weight, self.variant)
    return loss, (correct, None)

  def after_training(self, apply_fn, trainable, ctx, study, quiz, client):
    grad = meta_gradient(apply_fn, trainable['model'], ctx.vectors, study, quiz,
                         lr=self.inner_lr, weight=self.weight, variant=self.variant)
    _, y, valid = study
    present = (jax.nn.one_hot(y, self.num_classes) * valid[:, None]).sum(axis=0) > 0
    if self.private:  # which classes the study batch holds is the data's: send all of S_k
      present = client.seen
    return MetaGradient(grad=jnp.where(present[:, None], grad, 0.0), present=present)

  def upload(self, trainable, acc, ctx, state, client):
    meta = acc.after_training
    return base.Upload(trainable['model'], state, meta,
                       floats=(self.dim * meta.present.sum()).astype(jnp.int32))

  def server_receive(self, server, client_ids, payloads, active):
    rows = payloads.present & active[:, None]
    return server.replace(
        grad_sum=server.grad_sum + jnp.einsum('nc,ncd->cd', rows.astype(jnp.float32),
                                              payloads.grad),
        grad_count=server.grad_count + rows.sum(axis=0))

  def server_aggregate(self, server, participants, round_index, key):
    count = server.grad_count
    mean = jnp.where(count[:, None] > 0,
                     server.grad_sum / jnp.maximum(count, 1.0)[:, None], 0.0)
    vectors, norm = clipped_step(server.vectors, mean, self.server_lr, self.clip)
    return base.Aggregated(
        server.replace(vectors=vectors, grad_sum=jnp.zeros_like(server.grad_sum),
                       grad_count=jnp.zeros_like(count)),
        metrics={'grad_norm': norm, 'classes': (count > 0).sum().astype(jnp.float32)})
