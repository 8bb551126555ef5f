"""Differential privacy: DP-SGD in every client's local training, client-level DP on the
uploads, and their accountants (docs/algorithm.md §11).

The `privacy` config section is off by default (`enabled` is False), and then nothing here runs:
a run's numbers are what they always were. With `privacy.dp_sgd` on:

1. **Batches by Poisson sampling.** Each of a client's S = E ceil(n_k / B) local steps takes each
   of its n_k training samples independently with probability q_k = min(1, B / n_k), drawn from
   the step's key (`poisson_batch`). A batch holds B samples on average; the compiled program
   holds `max_batch` rows of it, a bound that a batch exceeds with probability below
   TRUNCATION_TAIL (then the extra samples are left out of that step).
2. **Per-example clipping and noise.** Each selected sample's gradient, over every model the
   client trains (its own, and FML's meme, FedMRL's small model, ...), is clipped to the global
   norm C (`clip_norm`); the clipped gradients are summed, Gaussian noise of standard deviation
   sigma C (`noise_multiplier` sigma) is added to every coordinate, and the sum is divided by the
   expected batch size q_k n_k (`noisy_clipped_grads`). The optimizer (momentum, weight decay,
   its own norm clip) then treats that as the step's gradient: post-processing. Each example's
   norm comes from ghost norms where they are exact (`per_example` 'auto': models/ghost.py,
   `ghost_covers`, Method.ghost_norms), else from the example's gradient, built.
3. **The accountant** (`Accountant`, Google's `dp_accounting`): a client's S steps of a round
   are S Poisson-sampled Gaussian mechanisms of rate q_k and noise sigma; its epsilon at `delta`
   composes every step it ran so far (RDP by default, or PLD). A run's epsilon is the largest
   over its clients. With `target_epsilon`, noise_multiplier 0 calibrates sigma so that every
   client ends within the target having trained every round; a given sigma instead ends the run
   before a round that could take a client past the target.

The guarantee is sample-level, for each client's training data, and covers what is computed
from the trained models alone (FedSSA's and LG-FedAvg's header rows, FML's meme, FedMRL's
shared model). What a method computes from the data outside the gradient steps (FD's logits,
the prototypes of FedProto, FedTGP and FedGH, FedL2G's step after training) is not covered:
`uncovered_uploads` names it, and the run warns.

With `privacy.upload` on, each client's upload is protected as a whole (client-level DP):

4. **Clip and noise the upload.** The payload's fields that carry what the client computed from
   its data (`Method.private_upload`: header rows, prototypes, logits, a model), less a value the
   server already knows (`Method.upload_reference`: the global model the client downloaded; else
   zero), are clipped jointly to the global norm C_u (`upload_clip`) (`privatize_upload`). In
   `upload_mode` 'local' the client adds N(0, (z C_u)^2) to every coordinate before it sends;
   in 'central' the server adds it once to the round's sum of the clipped uploads, and divides
   by a count that reveals nothing of who took part (the method's `central_noise`).
5. **Their accountant** (`UploadAccountant`): replacing one client's data moves its clipped
   upload by at most 2 C_u, so each release is a Gaussian mechanism of noise multiplier z / 2.
   Local: a client's epsilon composes the uploads it sent. Central: each round is that mechanism
   on a cohort of K of the N clients drawn without replacement (RDP, replace-one neighbours);
   the population's epsilon composes the rounds.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from fedssa_jax.errors import ConfigError, require, require_one_of
from fedssa_jax.methods import aggregation
from fedssa_jax.models import ghost
from fedssa_jax.streams import SERVER_UPLOAD_ID, Stream

ACCOUNTANTS = ('rdp', 'pld')
PER_EXAMPLE = ('auto', 'vmap')  # privacy.per_example
UPLOAD_MODES = ('local', 'central')
# P(a Poisson batch holds more than `max_batch` samples), per step, at the automatic bound.
TRUNCATION_TAIL = 1e-12
# The largest noise multiplier calibration may choose.
MAX_NOISE_MULTIPLIER = 1e3

# What each method uploads that is computed from the training data outside the DP-SGD steps.
UNCOVERED = {
    'fd': "its class-mean logits, summed over the training batches' forward passes",
    'fedproto': "its prototypes, summed over the training batches' forward passes",
    'fedtgp': 'its prototypes, from a forward pass over the training data',
    'fedgh': 'its prototypes, from a forward pass over the training data',
    'fedl2g': 'its guiding rows, from a gradient step on a study batch and the quiz set',
}


def default_config() -> ml_collections.ConfigDict:
  p = ml_collections.ConfigDict()
  p.dp_sgd = False            # DP-SGD in local training: Poisson batches, per-example clipping,
                              # Gaussian noise (docs/configuration.md, "Differential privacy")
  p.clip_norm = 1.0           # C: each example's gradient clipped to this global norm
  p.noise_multiplier = 1.0    # sigma: noise of std sigma C on the clipped sum; 0 with
                              # target_epsilon: calibrated to reach it at num_rounds
  p.delta = 1e-5              # the delta of every epsilon reported
  p.target_epsilon = 0.0      # > 0: the budget (calibrates sigma, or ends the run before a
                              # round that could exceed it)
  p.accountant = 'rdp'        # dp_accounting's 'rdp' or 'pld' accountant
  p.max_batch = 0             # rows a Poisson batch may hold (0: automatic, exceeded with
                              # probability < 1e-12 a step)
  p.per_example = 'auto'      # how each example's gradient norm is found: 'auto', from the
                              # layers' inputs and output cotangents where they cover every
                              # trainable parameter (ghost norms), else 'vmap'; 'vmap': each
                              # example's gradient built (speed and memory, not the numbers)
  p.pass_size = 0             # examples whose gradients 'vmap' builds at once (speed and
                              # memory, not the numbers): 0, automatic (pass_size_for)
  p.upload = False            # client-level DP: each client's upload clipped and noised
                              # (docs/configuration.md, "Differential privacy")
  p.upload_mode = 'local'     # 'local': each client noises its own upload; 'central': the
                              # server noises the sum of the clipped uploads
  p.upload_clip = 1.0         # C_u: the global norm each upload (less what the server already
                              # knows: the downloaded global model) is clipped to
  p.upload_noise_multiplier = 1.0  # z: noise std z C_u; 0 with upload_target_epsilon:
                                   # calibrated to reach it at num_rounds
  p.upload_target_epsilon = 0.0    # > 0 with upload_noise_multiplier 0: calibrates z
  return p


def enabled(p: ml_collections.ConfigDict) -> bool:
  """Whether DP-SGD is on."""
  return bool(p.dp_sgd)


def upload_enabled(p: ml_collections.ConfigDict) -> bool:
  """Whether client-level DP on the uploads is on."""
  return bool(p.upload)


def check_config(p: ml_collections.ConfigDict, method: str, per_sample_loss: bool,
                 upload_refusal: Callable[[str], str | None] = lambda mode: None) -> None:
  """Every field of the section, before any data is loaded. `upload_refusal(mode)`: the
  method's Method.upload_refusal(config, mode)."""
  check_upload(p, method, upload_refusal)
  _check_gaussian(p, 'clip_norm', "it bounds each example's gradient norm (1.0 is usual)",
                  'noise_multiplier', 'the noise std is noise_multiplier x clip_norm (1.1 is '
                  'usual; 0 with privacy.target_epsilon calibrates it)', 'target_epsilon')
  require(0 < p.delta < 1, f'privacy.delta must be in (0, 1), got {p.delta}; use less than '
          '1 / (training samples), e.g. 1e-5.')
  require_one_of('privacy.accountant', p.accountant, ACCOUNTANTS)
  require(p.max_batch >= 0, f'privacy.max_batch must be >= 0 (0: automatic), got {p.max_batch}.')
  require(p.pass_size >= 0, f'privacy.pass_size must be >= 1, or 0 (automatic); got '
          f'{p.pass_size}.')
  require_one_of('privacy.per_example', p.per_example, PER_EXAMPLE)
  if not p.dp_sgd:
    return
  _require_noise(p, 'noise_multiplier', 'target_epsilon', ' (1.1 is usual)')
  require(per_sample_loss,
          f'privacy.dp_sgd needs a loss that is a mean of per-example terms, to clip each '
          f"example's gradient; {method}'s couples the samples of a batch (FedKD: 1/Q with Q the "
          "batch's mean CE; FedClassAvg: contrastive pairs). Choose another method, or turn "
          'privacy.dp_sgd off.')


def check_upload(p: ml_collections.ConfigDict, method: str,
                 refusal_of: Callable[[str], str | None]) -> None:
  """The upload fields; with `upload` on, that the method can take it in the mode asked
  (`refusal_of(mode)` says why not, or None)."""
  require_one_of('privacy.upload_mode', p.upload_mode, UPLOAD_MODES)
  _check_gaussian(p, 'upload_clip', "it bounds each client's upload norm (less the global "
                  'model it downloaded)', 'upload_noise_multiplier', 'the noise std is '
                  'upload_noise_multiplier x upload_clip (0 with privacy.upload_target_epsilon '
                  'calibrates it)', 'upload_target_epsilon')
  if not p.upload:
    return
  _require_noise(p, 'upload_noise_multiplier', 'upload_target_epsilon')
  require(not (p.upload_noise_multiplier > 0 and p.upload_target_epsilon > 0),
          'privacy.upload_target_epsilon calibrates the noise: set '
          'privacy.upload_noise_multiplier=0 with it, or drop the target.')
  refusal = refusal_of(p.upload_mode)
  if refusal is not None:
    other = [m for m in UPLOAD_MODES if m != p.upload_mode and refusal_of(m) is None]
    fix = (f"Use privacy.upload_mode='{other[0]}', or turn privacy.upload off."
           if other else 'Turn privacy.upload off.')
    raise ConfigError(f'privacy.upload ({p.upload_mode}) does not apply to {method}: its '
                      f'{refusal}. {fix}')


def _check_gaussian(p: ml_collections.ConfigDict, clip: str, clip_says: str, sigma: str,
                    sigma_says: str, target: str) -> None:
  """A Gaussian mechanism's fields of the section: its clip norm > 0, its noise multiplier and
  its target epsilon >= 0 (each named by its field, with what it does)."""
  require(p[clip] > 0, f'privacy.{clip} must be > 0, got {p[clip]}: {clip_says}.')
  require(p[sigma] >= 0, f'privacy.{sigma} must be >= 0, got {p[sigma]}: {sigma_says}.')
  require(p[target] >= 0, f'privacy.{target} must be > 0, or 0 for no budget; got '
          f'{p[target]}.')


def _require_noise(p: ml_collections.ConfigDict, sigma: str, target: str,
                   usual: str = '') -> None:
  """A mechanism that is on needs noise: its multiplier, or a target to calibrate it by."""
  require(p[sigma] > 0 or p[target] > 0,
          f'privacy.{sigma}=0 adds no noise, so no epsilon is finite: set it{usual}, or set '
          f'privacy.{target} to calibrate it.')


def check_models(p: ml_collections.ConfigDict, families_with_state) -> None:
  """DP-SGD clips per example, which a model with batch statistics (the zoo's ResNets,
  GoogLeNet and MobileNetV2) does not allow: its examples' gradients depend on each other."""
  if p.dp_sgd and families_with_state:
    raise ConfigError(
        'privacy.dp_sgd needs per-example gradients, which models with batch norm do not give: '
        f'{", ".join(sorted(families_with_state))}. Use families without it (the five CNNs '
        'cnn1..cnn5, or fedavgcnn), or turn privacy.dp_sgd off.')


def uncovered_uploads(method: str) -> str | None:
  """What `method` uploads that DP-SGD does not cover (None: every upload is covered)."""
  return UNCOVERED.get(method)


# ----------------------------------------------------------------------------------------------
# The batch and the gradient (device side, inside training.local_train)
# ----------------------------------------------------------------------------------------------
def pass_size_for(given: int, backend: str) -> int:
  """`privacy.pass_size` (the examples whose gradients per_example 'vmap' builds at once), or
  by backend: one example at a time on the CPU, where a loop of single-example gradients ran
  2.9x faster than vmapped passes of 16 (CNN-3, 64 examples: 58 ms against 168 ms, 11 ms
  without DP-SGD) and holds the least memory; 16 elsewhere."""
  return given or (1 if backend == 'cpu' else 16)


@dataclasses.dataclass(frozen=True)
class DPSGD:
  """DP-SGD's static settings, as training.TrainConfig holds them (hashable)."""
  clip_norm: float
  noise_multiplier: float
  max_batch: int   # rows of a step's Poisson batch
  pass_size: int   # examples per pass of per-example gradients ('vmap'); divides max_batch
  per_example: str = 'auto'  # 'auto' (ghost norms where the taps cover the model) or 'vmap'
  ghost_pass: int = 0        # rows per pass of the ghost norms; divides max_batch (0: all)


def dp_sgd_settings(clip_norm: float, noise_multiplier: float, batch_size: int,
                    max_train: int, pass_size: int, per_example: str, micro_batch: int,
                    given_rows: int = 0) -> DPSGD:
  """DPSGD for batches of expected size `batch_size`: ghost norms ('auto') run in the engine's
  passes of plain training (`micro_batch` rows) where it splits a batch, else all of a step's
  rows at once; the Poisson batch's rows (max_batch) are whole passes of both ways."""
  ghost_pass = micro_batch if per_example == 'auto' and micro_batch < batch_size else 0
  rows = max_batch(batch_size, max_train, math.lcm(pass_size, ghost_pass or 1), given_rows)
  return DPSGD(clip_norm=clip_norm, noise_multiplier=noise_multiplier, max_batch=rows,
               pass_size=pass_size, per_example=per_example, ghost_pass=ghost_pass)


def max_batch(batch_size: int, max_train: int, pass_size: int, given: int = 0) -> int:
  """The rows of a Poisson batch of expected size `batch_size`: `given`, or the smallest count
  that a batch exceeds with probability below TRUNCATION_TAIL (Poisson's tail, which bounds the
  binomial's of the same mean), at most the longest training split, rounded up to whole passes."""
  from scipy import stats  # dp_accounting's dependency
  rows = given or int(stats.poisson.isf(TRUNCATION_TAIL, batch_size)) + 1
  rows = max(1, min(rows, max_train))
  return -(-rows // pass_size) * pass_size


def sampling_rate(batch_size, n):
  """q = min(1, B / n) in float32, as the step draws with it (host and device alike)."""
  if isinstance(n, jax.Array):
    return jnp.minimum(jnp.float32(1), jnp.float32(batch_size) / n.astype(jnp.float32))
  n = np.asarray(n)
  return np.minimum(np.float32(1), np.float32(batch_size) / np.maximum(n, 1).astype(np.float32))


def poisson_batch(key, n, padded_len: int, q, rows: int):
  """A step's Poisson batch: each of the positions 0..n-1 taken with probability q. Returns
  (positions [rows], valid [rows]): the taken positions first (a uniform subset of them if more
  than `rows` were taken), then padding."""
  u = jax.random.uniform(key, (padded_len,))
  taken = (u < q) & (jnp.arange(padded_len) < n)
  order = jnp.argsort(jnp.where(taken, u, 2.0))
  if rows > padded_len:
    order = jnp.pad(order, (0, rows - padded_len))
  return order[:rows], jnp.arange(rows) < taken.sum()


def noisy_clipped_grads(loss_of: Callable, trainable, views, y, valid, key, denom, *,
                        clip_norm: float, noise_multiplier: float, pass_size: int,
                        per_example: str = 'auto', ghost_pass: int = 0):
  """DP-SGD's gradient of a batch: each valid example's gradient of `loss_of` (called on a batch
  of one), over the whole `trainable` tree, clipped to the global norm `clip_norm`; their sum
  plus N(0, (noise_multiplier clip_norm)^2) noise from `key` on every coordinate, divided by
  `denom`. Returns (the batch-mean loss, #correct, the accumulator's sum, the gradient), like
  training.batch_grads.

  per_example 'vmap': each example's gradient is built, in passes of `pass_size` rows.
  'auto': where the model's layers' taps cover every trainable parameter once (ghost_covers),
  the norms come from the layers' inputs and output cotangents (models/ghost.py) and the clipped
  sum from one backward pass of the examples' losses weighted by their clip factors, in passes
  of `ghost_pass` rows (0: the whole batch); else as 'vmap'. Only passes that hold a valid
  example run (the valid rows come first)."""
  def one(t, ex_views, ex_y, ex_valid):
    return loss_of(t, tuple(v[None] for v in ex_views), ex_y[None], ex_valid[None])

  if per_example == 'auto' and ghost_covers(one, trainable, views, y, valid):
    m = ghost_pass or y.shape[0]
    pass_sums = functools.partial(_ghost_pass, one, clip_norm)
  else:
    m = pass_size
    pass_sums = functools.partial(_vmap_pass, one, clip_norm)
  if y.shape[0] % m:
    raise ValueError(f'The pass size {m} must divide the batch rows {y.shape[0]}.')

  def one_pass(j, sums):
    part = lambda a: jax.lax.dynamic_slice_in_dim(a, j * m, m)
    loss, correct, acc, grad = pass_sums(trainable, tuple(map(part, views)), part(y),
                                         part(valid))
    return jax.tree.map(jnp.add, sums, (loss, correct, acc, grad))

  # The accumulator's zeros, shaped as one example's.
  acc_shape = jax.eval_shape(
      lambda: one(trainable, tuple(v[0] for v in views), y[0], valid[0])[1][1])
  zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32),
           jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), acc_shape),
           jax.tree.map(jnp.zeros_like, trainable))
  count = valid.sum()
  loss_sum, correct, acc, grad_sum = jax.lax.fori_loop(0, (count + m - 1) // m, one_pass, zeros)
  return (loss_sum / jnp.maximum(count, 1), correct, acc,
          add_noise(grad_sum, key, noise_multiplier * clip_norm if noise_multiplier else 0.0,
                    denom))


def _vmap_pass(one, clip_norm, trainable, views, y, valid):
  """A pass's sums (loss, #correct, accumulator, clipped gradient) from each example's
  gradient, built by vmap."""
  per_example = jax.vmap(jax.value_and_grad(one, has_aux=True), in_axes=(None, 0, 0, 0))
  (loss, (correct, acc)), grads = per_example(trainable, views, y, valid)
  scale = jnp.where(valid, clip_factor(grads, clip_norm), 0.0)
  return (jnp.where(valid, loss, 0.0).sum(), correct.sum(),
          jax.tree.map(lambda a: a.sum(axis=0), acc),
          jax.tree.map(lambda g: jnp.tensordot(scale, g, axes=1), grads))


def _ghost_pass(one, clip_norm, trainable, views, y, valid):
  """A pass's sums from ghost norms: the gradient, with respect to a zero probe per example, of
  the examples' losses with the layers tapped is each one's squared gradient norm; then the
  gradient of the losses weighted by their clip factors is the sum of the clipped gradients."""
  def probed_loss(probes):
    def example(ex_views, ex_y, ex_valid, probe):
      with ghost.probing(probe):
        return one(trainable, ex_views, ex_y, ex_valid)[0]
    losses = jax.vmap(example)(views, y, valid, probes)
    return jnp.where(valid, losses, 0.0).sum()

  sq = jax.grad(probed_loss)(jnp.zeros(y.shape[0], jnp.float32))
  scale = jax.lax.stop_gradient(
      jnp.where(valid, clip_scale(jnp.sqrt(jnp.maximum(sq, 0.0)), clip_norm), 0.0))

  def weighted(t):
    loss, (correct, acc) = jax.vmap(one, in_axes=(None, 0, 0, 0))(t, views, y, valid)
    return jnp.sum(scale * loss), (jnp.where(valid, loss, 0.0).sum(), correct.sum(),
                                   jax.tree.map(lambda a: a.sum(axis=0), acc))
  grads, (loss, correct, acc) = jax.grad(weighted, has_aux=True)(trainable)
  return loss, correct, acc, grads


def ghost_covers(one, trainable, views, y, valid) -> bool:
  """Whether one example's loss, traced with the layers tapped (models/ghost.py), passes every
  leaf of `trainable` through exactly one tap: then the taps' squared norms sum to the
  example's squared gradient norm. Not so for a parameter used outside the tapped layers (a
  raw array, a layer of another kind) or by two of them (a layer applied twice)."""
  verdict = []

  def trace(t, ex_views, ex_y, ex_valid):
    with ghost.probing(jnp.zeros((), jnp.float32)) as probe:
      one(t, ex_views, ex_y, ex_valid)
    covered = [id(p) for p in probe.params]
    leaves = {id(leaf) for leaf in jax.tree.leaves(t)}
    verdict.append(len(covered) == len(set(covered)) and set(covered) == leaves)

  jax.eval_shape(trace, trainable, tuple(v[0] for v in views), y[0], valid[0])
  return verdict[0]


def clip_factor(grads, clip_norm: float):
  """Per example (the leaves' leading axis): min(1, clip_norm / its global gradient norm)."""
  sq = sum(jnp.sum(jnp.square(g.reshape(g.shape[0], -1)), axis=1) for g in jax.tree.leaves(grads))
  return clip_scale(jnp.sqrt(sq), clip_norm)


def clip_scale(norm, clip_norm: float):
  """min(1, clip_norm / norm), elementwise; 1 where clip_norm is infinite."""
  if math.isinf(clip_norm):
    return jnp.ones_like(norm)
  return clip_norm / jnp.maximum(norm, clip_norm)


def add_noise(grad_sum, key, std: float, denom):
  """(grad_sum + N(0, std^2) on every coordinate) / denom; each leaf's noise from its own key
  (fold_in(key, leaf index))."""
  return jax.tree.map(lambda g: g / denom, aggregation.add_gaussian(grad_sum, key, std))


# ----------------------------------------------------------------------------------------------
# Client-level DP on the uploads (device side, inside the round's call)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class UploadDP:
  """Client-level DP's static settings, as the round's call holds them (hashable)."""
  fields: tuple[str, ...]  # the payload's private fields (Method.private_upload)
  clip_norm: float         # C_u
  std: float               # the noise each client adds: z C_u (local), 0 (central)


def upload_keys(root_key, round_index, client_ids):
  """Each client's key of its upload noise in round `round_index`: fold_in(fold_in(fold_in(root
  key, Stream.UPLOAD), round), client id)."""
  round_key = jax.random.fold_in(jax.random.fold_in(root_key, Stream.UPLOAD), round_index)
  return jax.vmap(lambda c: jax.random.fold_in(round_key, c))(client_ids)


def server_upload_key(root_key, round_index):
  """The server's key of its central noise in round `round_index` (Stream.UPLOAD, at
  streams.SERVER_UPLOAD_ID)."""
  return upload_keys(root_key, round_index, jnp.array([SERVER_UPLOAD_ID]))[0]


def privatize_upload(payload, reference, key, *, fields: tuple[str, ...], clip_norm: float,
                     std: float):
  """One client's upload under client-level DP: its `fields`, less `reference` (a dict of them,
  or None: zero), clipped jointly to the global norm `clip_norm`, plus N(0, std^2) on every
  coordinate (each leaf's from fold_in(key, leaf index); std 0: none), plus `reference` again.
  The payload's other fields pass as they are. Returns (the payload, the norm before the clip)."""
  values = {f: getattr(payload, f) for f in fields}
  ref = jax.tree.map(jnp.zeros_like, values) if reference is None else reference
  delta = jax.tree.map(jnp.subtract, values, ref)
  norm = optax.global_norm(delta)
  scale = clip_scale(norm, clip_norm)
  noised = add_noise(jax.tree.map(lambda d: d * scale, delta), key, std, 1.0)
  return payload.replace(**jax.tree.map(jnp.add, ref, noised)), norm


# ----------------------------------------------------------------------------------------------
# The accountant (host side)
# ----------------------------------------------------------------------------------------------
def dp_sgd_event(q: float, noise_multiplier: float, steps: int):
  """`steps` DP-SGD steps of Poisson rate q and noise sigma, as a dp_accounting event."""
  import dp_accounting
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(float(q), dp_accounting.GaussianDpEvent(
          float(noise_multiplier))), int(steps))


def new_accountant(kind: str):
  from dp_accounting.pld import pld_privacy_accountant
  from dp_accounting.rdp import rdp_privacy_accountant
  return (rdp_privacy_accountant.RdpAccountant() if kind == 'rdp'
          else pld_privacy_accountant.PLDAccountant())


class _NoConvergenceNotes(logging.Filter):
  def filter(self, record):
    return 'failed to converge' not in record.getMessage()


@contextlib.contextmanager
def _quiet():
  """dp_accounting's RDP accountant logs a warning for every Renyi order it leaves out (where
  its series does not converge, at small orders and large rates); those orders only loosen the
  bound, so the console leaves them out."""
  absl_logger, note = logging.getLogger('absl'), _NoConvergenceNotes()
  absl_logger.addFilter(note)
  try:
    yield
  finally:
    absl_logger.removeFilter(note)


@functools.lru_cache(maxsize=4096)
def epsilon(kind: str, q: float, noise_multiplier: float, steps: int, delta: float) -> float:
  """epsilon at `delta` of `steps` DP-SGD steps (dp_sgd_event) by `kind`'s accountant."""
  if steps <= 0:
    return 0.0
  acct = new_accountant(kind)
  with _quiet():
    acct.compose(dp_sgd_event(q, noise_multiplier, steps))
    return float(acct.get_epsilon(delta))


def _smallest_noise(new_acct: Callable, event_of: Callable, target: float, delta: float, *,
                    field: str, events: str, fix: str) -> float:
  """dp_accounting's calibration: the smallest noise multiplier z with which `event_of(z)`
  stays within `target` at `delta`; a ConfigError that names the config `field`, the `events`
  and the `fix` where none up to MAX_NOISE_MULTIPLIER does."""
  import dp_accounting
  try:
    with _quiet():
      z = dp_accounting.calibrate_dp_mechanism(
          new_acct, event_of, target, delta, dp_accounting.LowerEndpointAndGuess(0.01, 1.0),
          tol=1e-4)
  except (ValueError, RuntimeError) as e:
    raise ConfigError(f'{field}={target} cannot be met: no noise multiplier was found for '
                      f'{events} ({e}). {fix[0].upper()}{fix[1:]}') from None
  require(z <= MAX_NOISE_MULTIPLIER,
          f'{field}={target} needs a noise multiplier of {z:.4g}, above '
          f'{MAX_NOISE_MULTIPLIER:g}: {fix}')
  return float(z)


def calibrate(kind: str, schedules, target_epsilon: float, delta: float) -> float:
  """The smallest noise multiplier with which every (q, steps) of `schedules` ends within
  `target_epsilon` at `delta` (dp_accounting's calibration); ConfigError where none up to
  MAX_NOISE_MULTIPLIER does."""
  return max(_smallest_noise(
      functools.partial(new_accountant, kind),
      functools.partial(lambda q, steps, sig: dp_sgd_event(q, sig, steps), q, steps),
      target_epsilon, delta, field='privacy.target_epsilon',
      events=f'{steps} steps at sampling rate {q:.4g}',
      fix='raise the target, or lower num_rounds or local_epochs.')
      for q, steps in sorted(set(schedules)))


class Accountant:
  """A run's DP-SGD accounting, for each of its seeds (packed seeds share the compiled program,
  so one noise multiplier): each client's sampling rate and steps in a round, the noise
  multiplier (given or calibrated), and epsilon from the steps each client ran."""

  def __init__(self, p: ml_collections.ConfigDict, train_n: np.ndarray, batch_size: int,
               local_epochs: int, num_rounds: int):
    """`train_n` [R, N]: each seed's clients' trainable samples (the n_k of their rates)."""
    self.kind, self.delta, self.target = p.accountant, float(p.delta), float(p.target_epsilon)
    n = np.atleast_2d(np.asarray(train_n))
    self.q = sampling_rate(batch_size, n).astype(np.float64)
    self.round_steps = local_epochs * ((n + batch_size - 1) // batch_size)
    if p.noise_multiplier > 0:
      self.noise_multiplier = float(p.noise_multiplier)
      if self.target:
        first = max(self.epsilons(i, s).max(initial=0.0)
                    for i, s in enumerate(self.round_steps))
        require(first <= self.target,
                f'privacy.target_epsilon={self.target:g} cannot be met: one round of DP-SGD '
                f'already spends epsilon {first:.4g} at noise_multiplier='
                f'{self.noise_multiplier:g}. Raise the noise multiplier or the target, or set '
                'privacy.noise_multiplier=0 to calibrate it.')
    else:  # every client training every round ends within the target
      self.noise_multiplier = calibrate(
          self.kind, [(float(q), int(s) * num_rounds)
                      for q, s in zip(self.q.ravel(), self.round_steps.ravel()) if s],
          self.target, self.delta)

  def client_epsilon(self, i: int, k: int, steps: int) -> float:
    """Seed i's client k's epsilon after `steps` DP-SGD steps."""
    return epsilon(self.kind, float(self.q[i, k]), self.noise_multiplier, int(steps), self.delta)

  def epsilons(self, i: int, steps) -> np.ndarray:
    """Seed i's clients' epsilons after `steps` [N] DP-SGD steps: one accounting per distinct
    (rate, steps), however many clients share it."""
    pairs, which = np.unique(np.stack([self.q[i], np.asarray(steps, np.float64)], axis=1),
                             axis=0, return_inverse=True)
    eps = [epsilon(self.kind, float(q), self.noise_multiplier, int(s), self.delta)
           for q, s in pairs]
    return np.asarray(eps)[which.reshape(-1)]

  def next_round_exceeds(self, i: int, steps, next_cohort) -> float | None:
    """With a target: the largest epsilon a client of seed i's `next_cohort` would reach by
    running all its steps of a round after `steps` [N], where that is above the target; else
    None."""
    if not self.target:
      return None
    worst = max((self.client_epsilon(i, k, steps[k] + self.round_steps[i, k])
                 for k in next_cohort), default=0.0)
    return worst if worst > self.target else None


# ----------------------------------------------------------------------------------------------
# The uploads' accountant (host side)
# ----------------------------------------------------------------------------------------------
def upload_event(noise_multiplier: float, releases: int, num_clients: int = 0, cohort: int = 0):
  """`releases` releases of uploads clipped to C_u with noise std z C_u (`noise_multiplier` z),
  as a dp_accounting event. Replacing one client's data moves its clipped upload by up to
  2 C_u, so each is a Gaussian mechanism of noise multiplier z / 2; in central mode (`cohort`
  > 0) it runs on a cohort of `cohort` of the `num_clients` clients drawn without replacement."""
  import dp_accounting
  event = dp_accounting.GaussianDpEvent(float(noise_multiplier) / 2)
  if 0 < cohort < num_clients:
    event = dp_accounting.SampledWithoutReplacementDpEvent(int(num_clients), int(cohort), event)
  return dp_accounting.SelfComposedDpEvent(event, int(releases))


def _upload_accountant(kind: str, sampled: bool):
  if not sampled:
    return new_accountant(kind)
  from dp_accounting import privacy_accountant
  from dp_accounting.rdp import rdp_privacy_accountant
  return rdp_privacy_accountant.RdpAccountant(
      neighboring_relation=privacy_accountant.NeighboringRelation.REPLACE_ONE)


@functools.lru_cache(maxsize=4096)
def upload_epsilon(kind: str, noise_multiplier: float, releases: int, delta: float,
                   num_clients: int = 0, cohort: int = 0) -> float:
  """epsilon at `delta` of `releases` upload releases (upload_event) by `kind`'s accountant."""
  if releases <= 0:
    return 0.0
  acct = _upload_accountant(kind, 0 < cohort < num_clients)
  with _quiet():
    acct.compose(upload_event(noise_multiplier, releases, num_clients, cohort))
    return float(acct.get_epsilon(delta))


class UploadAccountant:
  """A run's client-level accounting: the noise multiplier z (given or calibrated) and the
  noise std, and epsilon from the releases so far. Local: each client's own uploads sent.
  Central: the rounds, each a release of the population's sum (one epsilon for every client)."""

  def __init__(self, p: ml_collections.ConfigDict, num_clients: int, cohort: int,
               num_rounds: int):
    self.kind, self.delta = p.accountant, float(p.delta)
    self.central = p.upload_mode == 'central'
    self.num_clients, self.cohort = int(num_clients), int(cohort) if self.central else 0
    self.target = float(p.upload_target_epsilon)
    require(not (self.kind == 'pld' and 0 < self.cohort < self.num_clients),
            "privacy.upload_mode='central' with a cohort smaller than the population composes "
            "a sampling without replacement, which the PLD accountant does not take: use "
            "privacy.accountant='rdp'.")
    if p.upload_noise_multiplier > 0:
      self.noise_multiplier = float(p.upload_noise_multiplier)
    else:
      self.noise_multiplier = self._calibrate(num_rounds)
    self.std = self.noise_multiplier * float(p.upload_clip)

  def _calibrate(self, num_rounds: int) -> float:
    """The smallest z with which `num_rounds` releases stay within the target."""
    sampled = 0 < self.cohort < self.num_clients
    return _smallest_noise(
        lambda: _upload_accountant(self.kind, sampled),
        lambda z: upload_event(z, num_rounds, self.num_clients, self.cohort),
        self.target, self.delta, field='privacy.upload_target_epsilon',
        events=f'{num_rounds} rounds', fix='raise the target, or lower num_rounds.')

  def epsilons(self, releases) -> np.ndarray:
    """Each client's epsilon after `releases` [N] (local: the uploads each sent; central: the
    rounds run, the same for all)."""
    releases = np.asarray(releases, np.int64)
    counts, which = np.unique(releases, return_inverse=True)
    eps = [upload_epsilon(self.kind, self.noise_multiplier, int(r), self.delta,
                          self.num_clients, self.cohort) for r in counts]
    return np.asarray(eps)[which.reshape(-1)]
