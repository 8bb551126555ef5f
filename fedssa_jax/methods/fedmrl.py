"""FedMRL: federated model-heterogeneous Matryoshka representation learning (Yi et al., NeurIPS
2024), as HtFLlib implements it, with the project's defaults (docs/algorithm.md §6, FedMRL).

Every client k keeps its own model (extractor F_k, header h_k: d -> C, d = model.feature_dim,
500 in the paper) and a personal projector J_k; all clients share a small model G = (G_ex,
G_hd), trained jointly on every batch.
- Shared model (`fedmrl.shared_model`): 'fc2', CNN-5 with fc2 shrunk to d1 (`fedmrl.d1` = 128)
  and its own d1 -> C header, P_S = 478,676 + 129 C floats at d1 = 128 (479,966 for C=10,
  491,576 for C=100); or 'pool' (HtFLlib's), CNN-5 whose d-wide representation is average-pooled
  to d1 (models.feature_pool) before its d1 -> C header, P_S = 665,048 + (d1 + 1) C.
- Projector J_k: Linear(d1 + d -> d) with a bias and no activation,
  P_J = (d1 + d) d + d (314,500 at d1 = 128, d = 500), drawn independently per client
  (init_client_state, PyTorch's init) and kept in the client state; it is never sent.
- Objective on a batch, with g = G_ex(x) in R^d1, r = F_k(x) in R^d and [g; r] their
  concatenation (shared first):
      u   = J_k([g; r])                  in R^d
      z_F = h_k(u),  z_G = G_hd(u[:, :d1])   (the first d1 dimensions: the Matryoshka slice)
      L   = mean CE(z_F, y) + mean CE(z_G, y)
  Nothing is detached: both terms reach J_k, F_k and G_ex, each header only its own term. The
  engine gives each trained entry ({'model', 'shared', 'proj'}) its own optimizer and clip:
  HtFLlib's three optimizers, with the project's optimizer.
- Exchange: G down (the server's G_g) and the trained G up, P_S floats each way, every
  participant, every round; n_k goes along as metadata for the weighting.
- Server: G_g = sum_k w_k G_k / sum_k w_k over the round's participants, w_k = n_k
  (`fedmrl.aggregation='samples'`, the official code) or 1 ('uniform', HtFLlib); a round without
  uploads keeps G_g. At t = 0, G_g is a draw from the server's key.
- Inference (`eval_forward`): y_hat = argmax h_k(J_k([G_ex(x); F_k(x)])) with the latest G_g and
  the client's own persisted J_k, the local header only (both codes). The accuracy of the shared
  header on the same slice, argmax G_hd(u[:, :d1]), is logged as
  `method_metrics.shared_accuracy`; the saved test representations are u.
- `fedmrl.reset_projector=True` reproduces HtFLlib's bug: the trained J_k is never saved, so
  every round trains, and every evaluation uses, the client's initial J_k.
- Training cost: each step also runs forward and backward through G and J_k.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import struct

from fedssa_jax import models
from fedssa_jax.methods import aggregation, base, losses

SHARED_FAMILY = 'cnn5'
SHARED_MODELS = ('fc2', 'pool')
AGGREGATIONS = ('samples', 'uniform')


@struct.dataclass
class FedMRLState:
  """A client's persistent state (init_client_state)."""
  proj: dict  # its projector J_k's parameters ({'kernel' [d1 + d, d], 'bias' [d]})


@struct.dataclass
class FedMRLServer:
  shared: dict              # G_g, the shared model's parameters, what clients download
  inbox: aggregation.Inbox  # this round's uploaded shared models (weighted by n_k, or counted)


class FedMRL(base.Method):
  name = 'fedmrl'
  config_section = 'fedmrl'
  per_sample_loss = True  # two CE terms, each a mean over the batch's samples
  private_upload = ('value',)  # the trained shared model, around the downloaded one
  central_noise_into = 'inbox'
  eval_metrics = ('shared_accuracy',)
  # eval_forward: J_k from the client state, G_g from the server; eval_extra: G_g's header.
  eval_reads_state = eval_reads_server = True

  @classmethod
  def default_config(cls):
    c = ml_collections.ConfigDict()  # docs/algorithm.md §6: the method's defaults
    c.d1 = 128                   # the shared representation's width (the Matryoshka slice)
    c.shared_model = 'fc2'       # 'fc2': CNN-5 with fc2 -> d1; 'pool': d-wide pooled to d1
    c.aggregation = 'samples'    # shared-model mean: 'samples' (n_k) or 'uniform' (HtFLlib)
    c.reset_projector = False    # True: HtFLlib's bug, J_k reset to its initial one each round
    return c

  @classmethod
  def check_config(cls, c):
    if isinstance(c.d1, bool) or not isinstance(c.d1, int) or not c.d1 >= 1:
      raise ValueError(f'fedmrl.d1 must be an integer in [1, model.feature_dim], got {c.d1!r}.')
    if c.shared_model not in SHARED_MODELS:
      raise ValueError(f'fedmrl.shared_model must be one of {SHARED_MODELS}, '
                       f'got {c.shared_model!r}.')
    if c.aggregation not in AGGREGATIONS:
      raise ValueError(f'fedmrl.aggregation must be one of {AGGREGATIONS}, '
                       f'got {c.aggregation!r}.')
    if not isinstance(c.reset_projector, bool):
      raise ValueError(f'fedmrl.reset_projector must be True or False, '
                       f'got {c.reset_projector!r}.')

  def __init__(self, config, num_clients, num_classes, image_shape=None):
    super().__init__(config, num_clients, num_classes, image_shape)
    c = config.fedmrl
    self.d1, self.shared_kind = int(c.d1), c.shared_model
    self.weighted = c.aggregation == 'samples'
    self.reset_projector = bool(c.reset_projector)
    self.dtype = models.COMPUTE_DTYPES[config.engine.compute_dtype]
    d = self.feature_dim
    if self.d1 > d:
      raise ValueError(f'fedmrl.d1 must be an integer in [1, model.feature_dim = {d}], got '
                       f'{self.d1}.')
    width = ({'feature_dim': self.d1} if self.shared_kind == 'fc2'
             else {'feature_dim': d, 'pool_to': self.d1})
    # The shared model as it trains, and as it is evaluated (the fastest forward-only
    # formulation, as the clients' evaluated models).
    self.shared_model, self.shared_eval_model = (
        models.make_model(SHARED_FAMILY, num_classes, config.model.conv_impl, self.dtype,
                          forward_only=fwd, image_shape=self.image_shape, **width)
        for fwd in (False, True))
    shapes = jax.eval_shape(lambda: models.init_params(self.shared_model, jax.random.PRNGKey(0)))
    self.shared_floats = models.param_count(shapes)  # P_S
    self.projector = models.Dense(d, dtype=self.dtype)
    self.projector_floats = (self.d1 + d) * d + d  # P_J (client state, never sent)

  # --- state -----------------------------------------------------------------------------------
  def init_server(self, key, seen):
    shared = models.init_params(self.shared_model, key)
    return FedMRLServer(shared=shared,
                        inbox=aggregation.Inbox.empty(shared, weighted=self.weighted))

  def init_client_state(self, key):
    return FedMRLState(proj=self.projector.init(
        key, jnp.zeros((1, self.d1 + self.feature_dim)))['params'])

  # --- the fused forward -------------------------------------------------------------------------
  def project(self, proj, g, r):
    """u = J([g; r]) [B, d], float32: the projector on the shared and local representations."""
    return self.projector.apply({'params': proj}, jnp.concatenate([g, r], axis=-1)).astype(
        jnp.float32)

  def shared_logits(self, shared, u):
    """z_G = G_hd(u[:, :d1]): the shared header on the Matryoshka slice."""
    return models.apply_header(shared, u[:, :self.d1], self.dtype)

  # --- client side -----------------------------------------------------------------------------
  def download(self, params, state, server, client):
    return base.Download(params, aux={'shared': server.shared, 'proj': state.proj},
                         floats=jnp.int32(self.shared_floats))

  def loss(self, apply_fn, trainable, ctx, views, y, valid):
    x = views[0]
    _, r = apply_fn({'params': trainable['model']}, x)
    _, g = self.shared_model.apply({'params': trainable['shared']}, x)
    u = self.project(trainable['proj'], g, r)
    ce_f, correct = losses.ce_and_correct(models.apply_header(trainable['model'], u, self.dtype),
                                          y, valid)
    ce_g, _ = losses.ce_and_correct(self.shared_logits(trainable['shared'], u), y, valid)
    return ce_f + ce_g, (correct, None)

  def upload(self, trainable, acc, ctx, state, client):
    # reset_projector (HtFLlib): the trained J_k is dropped and the initial one kept.
    new_state = state if self.reset_projector else FedMRLState(proj=trainable['proj'])
    weight = jnp.asarray(client.num_samples if self.weighted else 1, jnp.float32)
    return base.Upload(trainable['model'], new_state,
                       payload=base.WeightedUpload(value=trainable['shared'], weight=weight),
                       floats=jnp.int32(self.shared_floats))

  # --- server side -----------------------------------------------------------------------------
  def upload_reference(self, server, down, client):
    return {'value': down.aux['shared']}  # the downloaded global shared model

  @classmethod
  def upload_refusal(cls, config, mode):
    if mode == 'central' and config.fedmrl.aggregation == 'samples':
      return ("shared model's mean weights each upload by its n_k, which noise on one sum does "
              "not cover (set fedmrl.aggregation='uniform' for it)")
    return super().upload_refusal(config, mode)

  def server_receive(self, server, client_ids, payloads, active):
    return server.replace(inbox=server.inbox.add(
        payloads.value, active, payloads.weight if self.weighted else None))

  def server_aggregate(self, server, participants, round_index, key):
    # The inbox holds exactly this round's participants' uploads.
    mean, any_ = server.inbox.mean()
    shared = jax.tree_util.tree_map(lambda m, old: jnp.where(any_, m, old), mean, server.shared)
    return base.Aggregated(FedMRLServer(shared=shared, inbox=server.inbox.cleared()))

  # --- evaluation ------------------------------------------------------------------------------
  def eval_forward(self, apply_fn, params, state, server, client_id, x):
    """(h_k(u), u) with u = J_k([G_ex(x); F_k(x)]), G_g the server's latest shared model."""
    _, r = apply_fn({'params': params}, x)
    _, g = self.shared_eval_model.apply({'params': server.shared}, x)
    u = self.project(state.proj, g, r)
    return models.apply_header(params, u, self.dtype), u

  def eval_extra(self, server, client_id, logits, rep, y, valid):
    right = (jnp.argmax(self.shared_logits(server.shared, rep), -1) == y) & valid
    return {'shared_accuracy': right.sum(dtype=jnp.int32)}

  # --- accounting ------------------------------------------------------------------------------
  def train_flops_per_sample(self, own, flops_of):
    # The shared model's forward and backward: CNN-5's count with its fc2 and fc3 matmuls
    # replaced by the shared model's (6 FLOPs per MAC of a layer: the forward, the weight and
    # the input gradients); the pooling (pool) adds a forward and an input-gradient matmul. The
    # projector: 6 (d1 + d) d. h_k reads u instead of r, which costs as much. The CE terms'
    # elementwise work is ignored.
    c, d1, d = self.num_classes, self.d1, self.feature_dim
    if self.shared_kind == 'fc2':
      shared = flops_of(SHARED_FAMILY) + 6.0 * (d * d1 + d1 * c - d * d - d * c)
    else:
      shared = flops_of(SHARED_FAMILY) + 6.0 * (d1 * c - d * c) + 4.0 * d * d1
    return own + shared + 6.0 * (d1 + d) * d
