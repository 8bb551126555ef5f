"""FedGen (Zhu et al., ICML 2021) as HtFLlib shares it between heterogeneous models, with its
generator kept (docs/algorithm.md §6).

Clients share the whole header H = fc3 as a [C, d + 1] table (row c = (W[c], b[c]), d =
model.feature_dim), exactly as LG-FedAvg (headers.SharedHeader), and the server keeps a
conditional feature generator G that teaches every header the classes its client lacks:

    G(eps, y) = W2 ReLU(BN(W1 [eps; onehot(y)] + b1)) + b2,   eps ~ U[0, 1)^nd,

W1 [(nd + C), hd], W2 [hd, d]; BN normalises with the batch's mean and biased variance (eps
1e-5), then scales by gamma and shifts by beta: batch statistics everywhere, server and client.
G starts as PyTorch's defaults (weights and biases U(+-1/sqrt(fan_in)), gamma 1, beta 0), drawn
from the server's key.
- Label prior: p(y) = sum_k n_k[y] / sum_k n_k, over all N clients' training splits, which the
  server reads at the start (Method.server_reads_class_counts).
- Download: a participant overwrites its whole header with H_g and receives G and p(y).
- Objective, per batch of B real samples (x_i, y_i):
      L = mean_i CE(h_k(F_k(x_i)), y_i) + lambda_t mean_j CE(h_k(sg G(eps_j, yhat_j)), yhat_j),
  j = 1..B (B the local batch size, whatever the batch's valid samples), yhat_j ~ p(y), the
  draws from the step's own key (Method.loss_draws). The second term reaches only the header.
  lambda_t = `weight` (1) from round 1 on, 0 in round 0 (G is first trained at the end of round
  0); with `frozen_generator` from round 0 on.
- Upload: the trained header, with n_k as its weight (`weighting='samples'`).
- Server: H_g = sum_k n_k H_k / sum_k n_k over the round's uploads (kept without any); then, in
  a round with uploads, `server_steps` = 100 Adam steps (lr `server_lr` = 0.005, betas (0.9,
  0.999), eps 1e-8, its state fresh each round) on G, each drawing B_s = `server_batch` = 10
  labels yhat ~ p(y) and noises from fold_in(round key, step), on
      L_G = mean_j CE(H_g(G(eps_j, yhat_j)), yhat_j),
  which is HtFLlib's CE of the n_k-weighted sum of the uploaded headers' logits (the headers
  are affine and the weights sum to 1). G persists in the server state; HtFLlib throws the
  trained copy away and its clients always use the initial G, which `frozen_generator=True`
  reproduces (no server step; the client term from round 0).
- Inference: every client's own extractor with the latest H_g.
Floats per participating client and round: down (d + 1) C + P_G, with P_G = (nd + C) hd + 3 hd +
hd d + d (G's weights, biases, gamma and beta; p(y) is metadata), up (d + 1) C. Client FLOPs per
trained sample: G's forward on one generated sample, 2 ((nd + C) hd + hd d), and the header's
forward and weight gradient on it, 4 d C. Server FLOPs per step: 6 B_s ((nd + C) hd + hd d + d C)
for the forward and backward products, and 12 P_G for Adam's update.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import struct

from fedssa_jax import models
from fedssa_jax.methods import aggregation, base, headers, losses

BN_EPS = 1e-5  # PyTorch's BatchNorm1d
ADAM_FLOPS = 12  # FLOPs per parameter of one Adam update (moments, bias correction, step)


@struct.dataclass
class Generator:
  """G's parameters (the module docstring)."""
  w1: jax.Array     # [nd + C, hd]
  b1: jax.Array     # [hd]
  gamma: jax.Array  # [hd] BatchNorm's scale
  beta: jax.Array   # [hd] BatchNorm's shift
  w2: jax.Array     # [hd, d]
  b2: jax.Array     # [d]


def init_generator(key, noise_dim: int, num_classes: int, hidden_dim: int,
                   out_dim: int) -> Generator:
  """G as PyTorch builds it: Linear weights and biases U(+-1/sqrt(fan_in)), gamma 1, beta 0."""
  k1, k2, k3, k4 = jax.random.split(key, 4)
  fan1 = noise_dim + num_classes
  uniform = lambda k, shape, fan: jax.random.uniform(k, shape, jnp.float32, -fan ** -0.5,
                                                     fan ** -0.5)
  return Generator(w1=uniform(k1, (fan1, hidden_dim), fan1), b1=uniform(k2, (hidden_dim,), fan1),
                   gamma=jnp.ones((hidden_dim,), jnp.float32),
                   beta=jnp.zeros((hidden_dim,), jnp.float32),
                   w2=uniform(k3, (hidden_dim, out_dim), hidden_dim),
                   b2=uniform(k4, (out_dim,), hidden_dim))


def generator_size(noise_dim: int, num_classes: int, hidden_dim: int, out_dim: int) -> int:
  """P_G: G's floats."""
  return (noise_dim + num_classes) * hidden_dim + 3 * hidden_dim + hidden_dim * out_dim + out_dim


def generate(g: Generator, noise, labels):
  """G(eps, y) [B, d] for noises [B, nd] and labels [B], BatchNorm on the batch's statistics."""
  num_classes = g.w1.shape[0] - noise.shape[1]
  h = jnp.concatenate([noise, jax.nn.one_hot(labels, num_classes, dtype=noise.dtype)], -1)
  h = h @ g.w1 + g.b1
  mean = h.mean(axis=0)
  var = jnp.square(h - mean).mean(axis=0)  # biased, as BatchNorm in training mode
  h = (h - mean) * jax.lax.rsqrt(var + BN_EPS) * g.gamma + g.beta
  return jax.nn.relu(h) @ g.w2 + g.b2


def draw(key, prior, batch: int, noise_dim: int):
  """(noises [batch, nd] ~ U[0, 1), labels [batch] ~ prior [C]) from `key`."""
  k_label, k_noise = jax.random.split(key)
  labels = jax.random.categorical(k_label, jnp.log(prior), shape=(batch,))
  return jax.random.uniform(k_noise, (batch, noise_dim), jnp.float32), labels


def generator_loss(g: Generator, head, noise, labels):
  """L_G: mean_j CE(H(G(eps_j, y_j)), y_j), with `head` = [W | b] [C, d + 1]."""
  logits = generate(g, noise, labels) @ head[:, :-1].T + head[:, -1]
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def train_generator(g: Generator, head, prior, key, *, steps: int, lr: float, batch: int):
  """`steps` Adam steps (its state fresh) on L_G against `head`, step s drawing `batch` labels
  from `prior` and noises from fold_in(key, s). Returns (G, the sum of the steps' losses, the
  last step's loss)."""
  tx = optax.adam(lr, b1=0.9, b2=0.999, eps=1e-8)
  grad_fn = jax.value_and_grad(generator_loss)
  noise_dim = g.w1.shape[0] - head.shape[0]

  def step(s, carry):
    g, opt_state, loss_sum, _ = carry
    noise, labels = draw(jax.random.fold_in(key, s), prior, batch, noise_dim)
    loss, grads = grad_fn(g, head, noise, labels)
    # BatchNorm subtracts the batch mean, so b1's gradient is exactly 0: what autodiff returns is
    # rounding, which Adam would scale into steps of up to lr that differ between two programs
    # (a packed seed and its run alone). Its true gradient, 0, keeps b1 as initialised.
    grads = grads.replace(b1=jnp.zeros_like(grads.b1))
    updates, opt_state = tx.update(grads, opt_state, g)
    return optax.apply_updates(g, updates), opt_state, loss_sum + loss, loss

  zero = jnp.zeros((), jnp.float32)
  g, _, loss_sum, last = jax.lax.fori_loop(0, steps, step, (g, tx.init(g), zero, zero))
  return g, loss_sum, last


@struct.dataclass
class FedGenServer:
  global_header: jax.Array   # [C, d + 1] H_g, what clients download
  inbox: aggregation.Inbox   # this round's sum_k n_k H_k and sum_k n_k
  generator: Generator       # G, trained each round (as initialised with frozen_generator)
  prior: jax.Array           # [C] p(y), from every client's class counts


@struct.dataclass
class FedGenContext:
  """The loss's constants: G, the label prior and the generated term's weight this round."""
  generator: Generator
  prior: jax.Array   # [C]
  weight: jax.Array  # float32 scalar: lambda_t


class FedGen(headers.SharedHeader):
  name = 'fedgen'
  config_section = 'fedgen'
  per_sample_loss = True  # CE per sample plus a term the real samples do not enter
  ghost_norms = False  # the generated term applies the header outside the model's apply
  loss_draws = True  # the generated labels and noises, each step's own
  server_reads_class_counts = True  # p(y)
  # Client-level DP on the uploads is headers.SharedHeader's: private_upload ('value', the header
  # clipped around the downloaded H_g), central_noise_into ('inbox') and upload_refusal (central
  # mode needs fedgen.weighting='uniform'). The class counts go as metadata (as FedGH's do).
  eval_reads_server = eval_server_header = True  # evaluated with the latest H_g

  @classmethod
  def default_config(cls):
    c = super().default_config()  # docs/algorithm.md §6: the method's defaults
    c.noise_dim = 32              # nd: G's noise width (HtFLlib's scripts)
    c.hidden_dim = 512            # hd: G's hidden width
    c.server_lr = 0.005           # the server's Adam on G (HtFLlib's default)
    c.server_steps = 100          # Adam steps on G per round, a fresh Adam each round
    c.server_batch = 10           # B_s: generated samples per server step (HtFLlib's local batch)
    c.weight = 1.0                # lambda: the generated term's weight in the client loss
    c.frozen_generator = False    # True: G stays as initialised and the term starts in round 0
                                  # (HtFLlib, whose server discards the G it trains)
    return c

  @classmethod
  def check_config(cls, c):
    super().check_config(c)
    for field in ('noise_dim', 'hidden_dim', 'server_steps', 'server_batch'):
      if not (isinstance(c[field], int) and c[field] >= 1):
        raise ValueError(f'fedgen.{field} must be an integer >= 1, got {c[field]!r}.')
    if not c.server_lr > 0:
      raise ValueError(f'fedgen.server_lr must be > 0, got {c.server_lr}.')
    if not c.weight >= 0:
      raise ValueError(f'fedgen.weight must be >= 0 (0: no generated term), got {c.weight}.')
    if not isinstance(c.frozen_generator, bool):
      raise ValueError(f'fedgen.frozen_generator must be True or False, got '
                       f'{c.frozen_generator!r}.')

  def __init__(self, config, num_clients, num_classes, image_shape=None):
    super().__init__(config, num_clients, num_classes, image_shape)
    c = config.fedgen
    self.noise_dim, self.hidden_dim = int(c.noise_dim), int(c.hidden_dim)
    self.lr, self.steps, self.server_batch = float(c.server_lr), int(c.server_steps), int(
        c.server_batch)
    self.weight, self.frozen = float(c.weight), bool(c.frozen_generator)
    self.first_round = 0 if self.frozen else 1
    self.gen_batch = int(config.batch_size)  # B generated samples per local step
    self.generator_floats = generator_size(self.noise_dim, num_classes, self.hidden_dim,
                                           self.feature_dim)

  def init_server(self, key, seen, class_counts=None):
    k_head, k_gen = jax.random.split(key)
    header = models.init_header(k_head, self.num_classes, self.feature_dim)
    if class_counts is None:  # no counts given: every class held equally
      class_counts = jnp.ones((self.num_classes,), jnp.float32)
    totals = jnp.asarray(class_counts, jnp.float32).reshape(-1, self.num_classes).sum(axis=0)
    return FedGenServer(
        global_header=header, inbox=aggregation.Inbox.empty(header, weighted=True),
        generator=init_generator(k_gen, self.noise_dim, self.num_classes, self.hidden_dim,
                                 self.feature_dim),
        prior=totals / totals.sum())

  def download(self, params, state, server, client):
    weight = jnp.where(client.round >= self.first_round, self.weight, 0.0).astype(jnp.float32)
    return base.Download(models.with_header_rows(params, server.global_header),
                         ctx=FedGenContext(server.generator, server.prior, weight),
                         floats=jnp.int32(self.header_floats + self.generator_floats))

  def loss(self, apply_fn, trainable, ctx, views, y, valid, key):
    params = trainable['model']
    logits, _ = apply_fn({'params': params}, views[0])
    loss, correct = losses.ce_and_correct(logits, y, valid)
    noise, labels = draw(key, ctx.prior, self.gen_batch, self.noise_dim)
    z = jax.lax.stop_gradient(generate(ctx.generator, noise, labels))
    generated = optax.softmax_cross_entropy_with_integer_labels(
        models.apply_header(params, z), labels).mean()
    return loss + ctx.weight * generated, (correct, None)

  def server_aggregate(self, server, participants, round_index, key):
    mean, any_ = server.inbox.mean()
    head = jnp.where(any_, mean, server.global_header)
    new = server.replace(global_header=head, inbox=server.inbox.cleared())
    if self.frozen:
      return base.Aggregated(new)
    trained, loss_sum, last = train_generator(server.generator, head, server.prior, key,
                                              steps=self.steps, lr=self.lr,
                                              batch=self.server_batch)
    generator = jax.tree.map(lambda a, b: jnp.where(any_, a, b), trained, server.generator)
    steps = jnp.where(any_, self.steps, 0).astype(jnp.float32)
    macs = ((self.noise_dim + self.num_classes) * self.hidden_dim
            + self.hidden_dim * self.feature_dim + self.feature_dim * self.num_classes)
    per_step = 6 * self.server_batch * macs + ADAM_FLOPS * self.generator_floats
    return base.Aggregated(new.replace(generator=generator), flops=per_step * steps,
                           metrics={'loss': jnp.where(any_, loss_sum / self.steps, 0.0),
                                    'last_loss': jnp.where(any_, last, 0.0), 'steps': steps})

  def eval_header(self, server, client_id):
    return server.global_header

  def train_flops_per_sample(self, own, flops_of):
    # One generated sample per trained sample: G's forward, and the header's forward and weight
    # gradient (sg G: no input gradient); BatchNorm's and the CE's elementwise work are ignored.
    d, c = self.feature_dim, self.num_classes
    return own + 2.0 * ((self.noise_dim + c) * self.hidden_dim + self.hidden_dim * d) + 4.0 * d * c
