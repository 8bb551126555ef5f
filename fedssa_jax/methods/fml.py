"""FML: federated mutual learning with a shared CNN-5 "meme" model (docs/algorithm.md §6).

Where FedSSA exchanges header rows, FML exchanges a whole second model: every client trains its
own heterogeneous model f_k jointly with a copy of the global meme (CNN-5 with its own C-way head),
the two distilling into each other on every batch.
- Exchange: the server's meme down, the trained meme up: P_5 floats each way (670,058 for C=10,
  counted from the parameters), every participant, every round.
- Objective, with z = f_k(x), z_m = meme(x), KL(p||q) = sum_c p_c (log p_c - log q_c) with
  batchmean reduction (mean over the valid samples) and detached targets (the decisions):
      L_loc  = alpha CE(z, y)  + (1 - alpha) KL(softmax(sg z_m) || softmax(z))
      L_meme = beta  CE(z_m, y) + (1 - beta) KL(softmax(sg z)  || softmax(z_m))
  `fml.kl_reduction='mean'` divides each KL by C and `fml.detach_targets=False` keeps the
  targets' gradients, as HtFLlib's FML does (docs/results.md, "Against HtFLlib").
  The loss returned is L_loc + L_meme: the two parameter sets are disjoint and the targets are
  detached, so each model's gradient is that of its own loss, and with one optimizer per model
  (training.local_train) this is the official code's two separate optimizers.
- Server: meme_g = unweighted mean of the participants' memes (an inbox sum and count written by
  server_receive, read only by server_aggregate); a round without participants keeps the old one.
- Inference: the local f_k (docs/algorithm.md §5). Client state: none; the meme is re-downloaded
  every round with a fresh optimizer, and at t = 0 it is the server's initial CNN-5 (from the
  init_server key).
- Training cost: each step also runs forward and backward through the CNN-5.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import struct

from fedssa_jax import models
from fedssa_jax.methods import aggregation, base, losses

MEME_FAMILY = 'cnn5'


def kl_batchmean(target_logits, logits, valid):
  """KL(softmax(target) || softmax(logits)), summed over classes, mean over valid samples."""
  log_p = jax.nn.log_softmax(target_logits)
  kl = jnp.sum(jnp.exp(log_p) * (log_p - jax.nn.log_softmax(logits)), axis=-1)
  return jnp.sum(jnp.where(valid, kl, 0.0)) / jnp.maximum(valid.sum(), 1)


@struct.dataclass
class FMLUpload:
  """A client's upload (Upload.payload)."""
  meme: dict  # its trained meme's parameters


@struct.dataclass
class FMLServer:
  meme: dict                # the global meme's parameters (CNN-5), what clients download
  inbox: aggregation.Inbox  # this round's uploaded memes (counted)


class FML(base.Method):
  name = 'fml'
  config_section = 'fml'
  per_sample_loss = True  # CE and KL terms, each a mean over the batch's samples
  ghost_norms = True  # the loss reads the parameters only through the model's apply
  private_upload = ('meme',)  # the trained meme, around the downloaded global meme
  central_noise_into = 'inbox'

  @classmethod
  def default_config(cls):
    c = ml_collections.ConfigDict()  # docs/algorithm.md §6: the method's defaults
    c.alpha = 0.5                # local model: alpha CE + (1 - alpha) KL(meme || local)
    c.beta = 0.5                 # meme: beta CE + (1 - beta) KL(local || meme)
    # HtFLlib's variants, for comparing with its code: 'mean' divides each KL by C as its
    # nn.KLDivLoss() does (batchmean is the FML paper's); detach_targets=False lets each model
    # also take the gradient of the other's loss, as HtFLlib's undetached targets do.
    c.kl_reduction = 'batchmean'  # 'batchmean' or 'mean'
    c.detach_targets = True
    return c

  @classmethod
  def check_config(cls, c):
    for field in ('alpha', 'beta'):
      if not 0.0 <= c[field] <= 1.0:
        raise ValueError(f'fml.{field} must be in [0, 1], got {c[field]}.')
    if c.kl_reduction not in ('batchmean', 'mean'):
      raise ValueError(f"fml.kl_reduction must be 'batchmean' or 'mean' (HtFLlib's), got "
                       f'{c.kl_reduction!r}.')

  def __init__(self, config, num_clients, num_classes, image_shape=None):
    super().__init__(config, num_clients, num_classes, image_shape)
    self.alpha, self.beta = float(config.fml.alpha), float(config.fml.beta)
    self.kl_scale = 1.0 if config.fml.kl_reduction == 'batchmean' else 1.0 / num_classes
    self.detach_targets = bool(config.fml.detach_targets)
    self.meme_model = models.make_model(MEME_FAMILY, num_classes, config.model.conv_impl,
                                        config.engine.compute_dtype, feature_dim=self.feature_dim,
                                        image_shape=self.image_shape)
    shapes = jax.eval_shape(lambda: models.init_params(self.meme_model, jax.random.PRNGKey(0)))
    self.meme_floats = models.param_count(shapes)  # P_5

  def init_server(self, key, seen):
    meme = models.init_params(self.meme_model, key)
    return FMLServer(meme=meme, inbox=aggregation.Inbox.empty(meme))

  def download(self, params, state, server, client):
    return base.Download(params, aux={'meme': server.meme},
                         floats=jnp.int32(self.meme_floats))

  def loss(self, apply_fn, trainable, ctx, views, y, valid):
    x = views[0]
    z, _ = apply_fn({'params': trainable['model']}, x)
    z_m, _ = self.meme_model.apply({'params': trainable['meme']}, x)
    ce, correct = losses.ce_and_correct(z, y, valid)
    ce_m, _ = losses.ce_and_correct(z_m, y, valid)
    sg = jax.lax.stop_gradient if self.detach_targets else (lambda v: v)
    loss_loc = self.alpha * ce + (1 - self.alpha) * self.kl_scale * kl_batchmean(sg(z_m), z, valid)
    loss_meme = self.beta * ce_m + (1 - self.beta) * self.kl_scale * kl_batchmean(sg(z), z_m, valid)
    return loss_loc + loss_meme, (correct, None)

  def upload(self, trainable, acc, ctx, state, client):
    return base.Upload(trainable['model'], state, payload=FMLUpload(meme=trainable['meme']),
                       floats=jnp.int32(self.meme_floats))

  def upload_reference(self, server, down, client):
    return {'meme': down.aux['meme']}

  def server_receive(self, server, client_ids, payloads, active):
    return server.replace(inbox=server.inbox.add(payloads.meme, active))

  def server_aggregate(self, server, participants, round_index, key):
    mean, any_ = server.inbox.mean()
    meme = jax.tree_util.tree_map(lambda m, old: jnp.where(any_, m, old), mean, server.meme)
    return base.Aggregated(FMLServer(meme=meme, inbox=server.inbox.cleared()))

  def train_flops_per_sample(self, own, flops_of):
    # The meme's forward and backward on every sample; the KL terms' elementwise work is ignored,
    # as are the softmax and CE in the per-model counts.
    return own + flops_of(MEME_FAMILY)
