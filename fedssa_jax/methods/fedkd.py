"""FedKD: adaptive mutual distillation with a shared CNN-5 mentee and SVD-compressed updates
(docs/algorithm.md §6, with its defaults).

Where FedSSA exchanges header rows, FedKD exchanges a whole second model, the mentee (CNN-5 with
its own C-way head), as low-rank updates. Each participant trains its own model f_k (the mentor),
the mentee and a private projection W_h [d, d] (no bias) jointly on every batch, d =
model.feature_dim (500 in the paper).
- Objective (one joint loss, gradients through everything, soft targets not detached, the
  denominator Q differentiated): with (z, h) the mentor's logits and d-wide representation and
  (z_s, h_s) the mentee's,
      Q = CE(z, y) + CE(z_s, y)
      L = Q + [KL(s(z_s) || s(z)) + KL(s(z) || s(z_s)) + 2 MSE(h, h_s W_h)] / Q
  KL with torch's 'mean' reduction (sum over valid samples and classes / (B_valid C)), MSE the
  mean over B_valid * d. W_h is stored [in, out] (a Dense kernel: h_s @ W_h).
- Round: mentee <- theta_g; train; Delta_k = mentee - theta_g; compress each tensor (below) and
  upload the reconstruction, which is exactly what the server can rebuild from what is sent.
- Compression with energy T_t = start + (end - start)(t + 1)/R, R = num_rounds: 1-D tensors are
  dense; a 2-D kernel [m, n] as it is, a conv kernel HWIO [5, 5, I, O] as [25 I, O] (the same
  singular values as docs/algorithm.md §6 has it, [O, 25 I]). Rank q = the smallest n >= 1 with
  sum_{j<=n} s_j^2 >= T sum_j s_j^2, clamped to the full rank; the tensor is sent as
  min(q (m + n + 1), m n) floats, dense when that is cheaper or when sum s^2 = 0. The SVD is
  batched over clients by the engine's vmap; the kept rank is a fixed-shape mask on s, so the
  reconstruction is U diag(s * mask) V^T.
- Server: Delta_bar = unweighted mean of the participants' reconstructions; compress it with
  T_t by the same rule; theta_g <- theta_g + recon. A round without participants keeps theta_g.
- Floats. Up: the compressed Delta_k. Down: a client that holds theta_{t-1} needs only the
  compressed Delta_bar of the last aggregation; any other one is charged P_5 dense (§6's
  default for a client that missed rounds). At t = 0 every client generates theta_0 from the
  shared seed, so round 0 downloads 0 floats; the server records, per client, the round whose
  theta it holds (0 for everyone at the start, t for a participant of round t).
- Client FLOPs beyond training: the SVDs on upload (thin SVD, Golub & Van Loan's cost for
  m >= n: min(Golub-Reinsch 14 m n^2 + 8 n^3, R-SVD 6 m n^2 + 20 n^3)); on download, rebuilding
  theta_t from a compressed Delta_bar (2 q m n per compressed matrix, plus P_5 additions).
- Inference: the local mentor f_k (docs/algorithm.md §5). Client state: W_h (the mentee is
  re-synced each round).
- `fedkd.compression='htfllib'` does what HtFLlib's code does instead (clientkd.py's
  `decomposition` and `recover`, serverkd.py's aggregation), for reproducing its numbers: the
  client compresses the mentee's *parameters*, the server averages the reconstructions and
  compresses the mean again, which becomes theta_g; T_t = start + (end - start) t / R; a conv
  kernel is O I separate 5 x 5 matrices sharing one rank, chosen by their summed energy; the
  rank is the smallest k in 1 .. r - 1 with sum_{j<=k} s_j^2 > T sum s^2, and 0 where none is
  (HtFLlib's loop never tries k = r: such a tensor is rebuilt as zeros); floats k (m + n + 1)
  per matrix however many that is. Every client downloads the compressed theta_g.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import struct

from fedssa_jax import models
from fedssa_jax.methods import aggregation, base, losses

MENTEE_FAMILY = 'cnn5'


def energy(round_index, start: float, end: float, num_rounds: int):
  """T_t = start + (end - start) (t + 1) / R."""
  t = jnp.asarray(round_index, jnp.float32)
  return start + (end - start) * (t + 1.0) / max(num_rounds, 1)


def svd_flops(m: int, n: int) -> float:
  """Golub & Van Loan's FLOPs for a thin SVD (U_1, S, V) of an m x n matrix."""
  m, n = max(m, n), min(m, n)
  return float(min(14 * m * n * n + 8 * n ** 3, 6 * m * n * n + 20 * n ** 3))


def _svd(a):
  return tuple(jnp.linalg.svd(a, full_matrices=False))


@jax.custom_batching.custom_vmap
def _svd_one_at_a_time(a):
  """_svd, which under vmap runs its matrices one after another (lax.map)."""
  return _svd(a)


@_svd_one_at_a_time.def_vmap
def _svd_one_at_a_time_vmap(axis_size, in_batched, a):
  """The batched rule: its one argument, `a`, is batched (`axis_size`, `in_batched` unused)."""
  return jax.lax.map(_svd_one_at_a_time, a), (True, True, True)


def thin_svd(a):
  """(u, s, vt) of a [m, n] matrix. On the CPU, a batch of them (under vmap) runs one matrix at
  a time: XLA:CPU's batched SVD spreads a batch over the thread pool that runs the program, and
  two such SVDs running at once can wait on each other forever (seen with packed seeds on 2
  cores, JAX 0.10.2). Each matrix gets the same LAPACK call either way."""
  return (_svd_one_at_a_time if jax.default_backend() == 'cpu' else _svd)(a)


def compress_matrix(a, threshold):
  """Truncated SVD of a [m, n] matrix by the energy rule. Returns (what the receiver rebuilds,
  floats sent, the rebuild's FLOPs if compressed else 0)."""
  m, n = a.shape
  u, s, vt = thin_svd(a)
  cum = jnp.cumsum(s * s)
  total = cum[-1]
  q = jnp.minimum(jnp.sum(cum < threshold * total) + 1, s.shape[0])  # clamped to [1, full]
  compressed = (q * (m + n + 1) < m * n) & (total > 0)
  recon = (u * jnp.where(jnp.arange(s.shape[0]) < q, s, 0.0)) @ vt
  floats = jnp.where(compressed, q * (m + n + 1), m * n).astype(jnp.int32)
  rebuild = jnp.where(compressed, 2.0 * q * m * n, 0.0)
  return jnp.where(compressed, recon, a), floats, rebuild


def htfllib_rank(s, threshold):
  """HtFLlib's kept rank for singular values `s` [..., r] (matrices sharing one rank): the
  smallest k in 1 .. r - 1 whose first k hold more than `threshold` of the summed energy, else
  0 (its loop stops at r - 1)."""
  energy = jnp.sum(jnp.reshape(s * s, (-1, s.shape[-1])), axis=0)  # per index, summed
  cum = jnp.cumsum(energy)
  above = cum[:-1] > threshold * cum[-1]  # k = 1 .. r - 1
  return jnp.where(jnp.any(above), jnp.argmax(above) + 1, 0), cum[-1]


def compress_htfllib(tree, threshold):
  """HtFLlib's decomposition and recover of every tensor of a CNN-5 tree (module docstring).
  Returns (reconstruction tree, floats, SVD FLOPs, rebuild FLOPs)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  out, floats, svd, rebuild = [], jnp.int32(0), 0.0, jnp.float32(0)
  for x in leaves:
    if x.ndim == 1 or x.shape[-1] == 1:  # torch's layout [O, ...]: dense unless O > 1
      out.append(x)
      floats += x.size
      continue
    if x.ndim == 4:  # HWIO [5, 5, I, O] -> torch's [O, I, 5, 5] matrices, one per (o, i)
      mats = jnp.transpose(x, (3, 2, 0, 1)).reshape(-1, x.shape[0], x.shape[1])
    else:  # a Dense kernel [in, out]: torch's weight [out, in], the same singular values
      mats = x.T[None]
    b, m, n = mats.shape
    u, s, vt = jax.vmap(thin_svd)(mats)
    q, total = htfllib_rank(s, threshold)
    kept = jnp.where(jnp.arange(s.shape[-1]) < q, s, 0.0)
    recon = jnp.where(total > 0, (u * kept[:, None, :]) @ vt, mats)
    if x.ndim == 4:
      recon = jnp.transpose(recon.reshape(x.shape[3], x.shape[2], x.shape[0], x.shape[1]),
                            (2, 3, 1, 0))
    else:
      recon = recon[0].T
    out.append(recon)
    floats += jnp.where(total > 0, b * q * (m + n + 1), x.size).astype(jnp.int32)
    svd += b * svd_flops(m, n)
    rebuild += jnp.where(total > 0, 2.0 * b * q * m * n, 0.0)
  return jax.tree_util.tree_unflatten(treedef, out), floats, jnp.float32(svd), rebuild


COMPRESSIONS = ('update', 'htfllib')


def compress_update(delta, threshold):
  """Compresses every tensor of a CNN-5 update. Returns (reconstruction tree, floats, SVD FLOPs,
  rebuild FLOPs)."""
  leaves, treedef = jax.tree_util.tree_flatten(delta)
  out, floats, svd, rebuild = [], jnp.int32(0), 0.0, jnp.float32(0)
  for x in leaves:
    if x.ndim == 1:
      out.append(x)
      floats += x.size
      continue
    mat = x.reshape(-1, x.shape[-1])  # HWIO [5, 5, I, O] -> [25 I, O]; Dense [in, out] as is
    r, f, b = compress_matrix(mat, threshold)
    out.append(r.reshape(x.shape))
    floats, svd, rebuild = floats + f, svd + svd_flops(*mat.shape), rebuild + b
  return jax.tree_util.tree_unflatten(treedef, out), floats, jnp.float32(svd), rebuild


@struct.dataclass
class FedKDState:
  """A client's persistent state (init_client_state)."""
  w_h: jax.Array  # [d, d] its projection W_h (a Dense kernel, [in, out]), trained jointly


@struct.dataclass
class FedKDContext:
  """What the client keeps of the download for its upload (Download.ctx; the loss reads none)."""
  theta: dict  # the downloaded global mentee theta_g, the base of the update


@struct.dataclass
class FedKDUpload:
  """A client's upload (Upload.payload)."""
  update: dict  # the reconstruction of its compressed mentee update Delta_k (CNN-5's tree;
               # with compression=htfllib, of its compressed mentee parameters)


@struct.dataclass
class FedKDServer:
  theta: dict               # the global mentee theta_g (CNN-5)
  inbox: aggregation.Inbox  # this round's reconstructed updates (counted)
  held: jax.Array          # [N] int32: the round of the theta a client holds
  last_floats: jax.Array   # int32: the last compressed Delta_bar's floats ...
  last_rebuild: jax.Array  # float32: ... and its rebuild FLOPs


class FedKD(base.Method):
  name = 'fedkd'
  per_sample_loss = False  # 1/Q with Q the batch's mean CE
  config_section = 'fedkd'
  private_upload = ('update',)  # the compressed update, already a difference from theta_g
  central_noise_into = 'inbox'

  @classmethod
  def default_config(cls):
    c = ml_collections.ConfigDict()  # docs/algorithm.md §6: the method's defaults
    c.energy_start = 0.95        # SVD energy threshold T, from round 0 ...
    c.energy_end = 0.98          # ... to the last round
    c.compression = 'update'     # 'update' (the spec's) or 'htfllib' (HtFLlib's code: the
                                 # mentee's parameters, its rank rule and schedule; the module
                                 # docstring)
    return c

  @classmethod
  def check_config(cls, c):
    for field in ('energy_start', 'energy_end'):
      if not 0.0 < c[field] <= 1.0:
        raise ValueError(f'fedkd.{field} must be in (0, 1], got {c[field]}.')
    if c.compression not in COMPRESSIONS:
      raise ValueError(f'fedkd.compression must be one of {COMPRESSIONS}, got '
                       f'{c.compression!r}.')

  def __init__(self, config, num_clients, num_classes, image_shape=None):
    super().__init__(config, num_clients, num_classes, image_shape)
    c = config.fedkd
    self.energy_start, self.energy_end = float(c.energy_start), float(c.energy_end)
    self.htfllib = c.compression == 'htfllib'
    self.num_rounds = int(config.num_rounds)
    self.mentee_model = models.make_model(MENTEE_FAMILY, num_classes, config.model.conv_impl,
                                          config.engine.compute_dtype,
                                          feature_dim=self.feature_dim,
                                          image_shape=self.image_shape)
    shapes = jax.eval_shape(lambda: models.init_params(self.mentee_model, jax.random.PRNGKey(0)))
    self.mentee_floats = models.param_count(shapes)  # P_5

  def threshold(self, round_index):
    if self.htfllib:  # HtFLlib's T_t = start + (end - start) t / R
      return energy(jnp.asarray(round_index) - 1, self.energy_start, self.energy_end,
                    self.num_rounds)
    return energy(round_index, self.energy_start, self.energy_end, self.num_rounds)

  def init_server(self, key, seen):
    theta = models.init_params(self.mentee_model, key)
    return FedKDServer(theta=theta, inbox=aggregation.Inbox.empty(theta),
                       held=jnp.zeros((self.num_clients,), jnp.int32),
                       last_floats=jnp.zeros((), jnp.int32),
                       last_rebuild=jnp.zeros((), jnp.float32))

  def init_client_state(self, key):
    d = self.feature_dim
    return FedKDState(w_h=models.torch_uniform_init(d)(key, (d, d)))

  def download(self, params, state, server, client):
    held = server.held[client.id]
    delta_only = held == client.round - 1
    if self.htfllib:  # the compressed theta_g, to every client after round 0
      delta_only = client.round > 0
    floats = jnp.where(held == client.round, 0,
                       jnp.where(delta_only, server.last_floats, self.mentee_floats))
    flops = jnp.where(delta_only, server.last_rebuild + self.mentee_floats, 0.0)
    return base.Download(params, aux={'mentee': server.theta, 'w_h': state.w_h},
                         ctx=FedKDContext(theta=server.theta), floats=floats.astype(jnp.int32),
                         flops=flops.astype(jnp.float32))

  def loss(self, apply_fn, trainable, ctx, views, y, valid):
    x = views[0]
    z, h = apply_fn({'params': trainable['model']}, x)
    z_s, h_s = self.mentee_model.apply({'params': trainable['mentee']}, x)
    ce, correct = losses.ce_and_correct(z, y, valid)
    ce_s, _ = losses.ce_and_correct(z_s, y, valid)
    q = ce + ce_s
    n_valid = jnp.maximum(valid.sum(), 1)
    lp, lp_s = jax.nn.log_softmax(z), jax.nn.log_softmax(z_s)
    kl = jnp.exp(lp_s) * (lp_s - lp) + jnp.exp(lp) * (lp - lp_s)  # both directions, [B, C]
    kl = jnp.sum(jnp.where(valid[:, None], kl, 0.0)) / (n_valid * z.shape[-1])
    se = jnp.sum((h - h_s @ trainable['w_h']) ** 2, axis=-1)
    mse = jnp.sum(jnp.where(valid, se, 0.0)) / (n_valid * self.feature_dim)
    return q + (kl + 2.0 * mse) / q, (correct, None)

  def upload(self, trainable, acc, ctx, state, client):
    if self.htfllib:
      recon, floats, svd, _ = compress_htfllib(trainable['mentee'], self.threshold(client.round))
    else:
      delta = jax.tree_util.tree_map(jnp.subtract, trainable['mentee'], ctx.theta)
      recon, floats, svd, _ = compress_update(delta, self.threshold(client.round))
    return base.Upload(trainable['model'], FedKDState(w_h=trainable['w_h']),
                       payload=FedKDUpload(update=recon), floats=floats, flops=svd)

  @classmethod
  def upload_refusal(cls, config, mode):
    if config.fedkd.compression == 'htfllib':
      return ('fedkd.compression=htfllib uploads the mentee\'s parameters, not an update, and '
              'clipping them would change the model; use fedkd.compression=update')
    if mode == 'local':
      return ('upload is a truncated SVD of the update, which noise on it would make dense '
              '(central noise leaves the clipped uploads low-rank)')
    return super().upload_refusal(config, mode)

  def server_receive(self, server, client_ids, payloads, active):
    return server.replace(inbox=server.inbox.add(payloads.update, active))

  def server_aggregate(self, server, participants, round_index, key):
    mean, any_ = server.inbox.mean()
    if self.htfllib:  # the mean of the parameters, compressed, is theta_g
      recon, floats, _, rebuild = compress_htfllib(mean, self.threshold(round_index))
      theta = jax.tree_util.tree_map(lambda t, r: jnp.where(any_, r, t), server.theta, recon)
    else:
      recon, floats, _, rebuild = compress_update(mean, self.threshold(round_index))
      theta = jax.tree_util.tree_map(lambda t, r: jnp.where(any_, t + r, t), server.theta,
                                     recon)
    return base.Aggregated(FedKDServer(
        theta=theta, inbox=server.inbox.cleared(),
        held=jnp.where(participants, round_index, server.held).astype(jnp.int32),
        last_floats=jnp.where(any_, floats, 0).astype(jnp.int32),
        last_rebuild=jnp.where(any_, rebuild, 0.0).astype(jnp.float32)))

  def train_flops_per_sample(self, own, flops_of):
    # Mentor and mentee forward + backward, plus h_s @ W_h: 2 FLOPs per MAC for the forward and
    # the two backward matmuls (grad of W_h and of h_s). KL/MSE elementwise work is ignored.
    return own + flops_of(MENTEE_FAMILY) + 6.0 * self.feature_dim ** 2
