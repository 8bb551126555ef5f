"""Local training of one client, written so that a vmapped group trains exactly like singletons.

docs/algorithm.md §3: SGD (lr 0.005, momentum 0.9, L2 weight decay 5e-5 added to the gradient as
torch does), global-norm clip 50, batch 512, E epochs over the shuffled training split, the last
partial batch kept with its loss averaged over its real samples, optimizer state reset per round.

Shapes are fixed per model family: a client's padded index array has `max_train` entries and
the loops run `E` epochs of `ceil(n_k / B)` steps, where n_k is the client's own count, so every
step has at least one valid sample (`floor(n_k / B)` full batches with `drop_last`, as a PyTorch
loader that drops the partial batch; `fixed_order` takes the samples in their stored order every
epoch, as one that does not shuffle). Under vmap the loop runs to the group's largest bound, and
JAX's batching of `while_loop` keeps each client's carry (parameters and momentum) unchanged once
its own predicate is false: steps past a client's last step are no-ops, and a dummy client with
n_k = 0 runs none. tests/client_test.py checks both against one-client-at-a-time training.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from fedssa_jax import models, privacy, system
from fedssa_jax.data import augment
from fedssa_jax.data.partition import DeviceData
from fedssa_jax.streams import StepStream
from fedssa_jax.types import PyTree


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Static local-training settings (hashable, so it can key a jit cache)."""
  batch_size: int = 512
  local_epochs: int = 1
  optimizer: str = 'sgd'  # or 'adam'
  lr: float = 0.005
  momentum: float = 0.9
  weight_decay: float = 5e-5
  clip_norm: float = 50.0  # 0: no clipping
  adam_b1: float = 0.9
  adam_b2: float = 0.999
  # Rows per forward/backward pass within a step (0: the whole batch). A step's gradient is
  # summed over passes of `micro_batch` rows, and only the passes that hold valid samples run,
  # so a partial last batch wastes less than `micro_batch` rows of padding. Used only for losses
  # that are means of per-sample terms (Method.per_sample_loss), where it changes nothing but
  # the float rounding.
  micro_batch: int = 0
  augment: bool = True
  # The batches of an epoch (config batch_order, drop_last): the stored order every epoch
  # instead of a new shuffle, and floor(n / B) full batches instead of ceil(n / B) (and the
  # forward passes over the training split without the last n mod B samples).
  fixed_order: bool = False
  drop_last: bool = False
  mean: tuple[float, ...] = (0.485, 0.456, 0.406)
  std: tuple[float, ...] = (0.229, 0.224, 0.225)
  # DP-SGD (the privacy section's dp_sgd): Poisson batches, per-example clipping and noise.
  dp: privacy.DPSGD | None = None


@struct.dataclass
class TrainStats:
  """Sums over the samples and steps a client's local training ran (`local_train`)."""
  correct: jax.Array   # int32: samples predicted right
  loss_sum: jax.Array  # float32: each step's batch-mean loss times its valid samples
  samples: jax.Array   # int32: samples processed (E * n_k)
  steps: jax.Array     # int32: optimizer steps

  @classmethod
  def zeros(cls) -> TrainStats:
    return cls(correct=jnp.zeros((), jnp.int32), loss_sum=jnp.zeros((), jnp.float32),
               samples=jnp.zeros((), jnp.int32), steps=jnp.zeros((), jnp.int32))


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  # torch order: clip_grad_norm_ on the raw gradient, then SGD (or Adam) adds wd*p to it.
  if cfg.optimizer == 'sgd':
    step = optax.sgd(cfg.lr, momentum=cfg.momentum if cfg.momentum else None)
  elif cfg.optimizer == 'adam':
    step = optax.adam(cfg.lr, b1=cfg.adam_b1, b2=cfg.adam_b2)
  else:
    raise ValueError(f"optimizer.name must be 'sgd' or 'adam', got {cfg.optimizer!r}.")
  clip = optax.clip_by_global_norm(cfg.clip_norm) if cfg.clip_norm else optax.identity()
  return optax.chain(clip,
                     optax.add_decayed_weights(cfg.weight_decay), step)


def epoch_order(key, n, padded_len):
  """A random order of positions 0..n-1 followed by the padding positions n..padded_len-1."""
  r = jax.random.uniform(key, (padded_len,))
  return jnp.argsort(jnp.where(jnp.arange(padded_len) < n, r, 2.0))


def loss_kwargs(method, step_key: jax.Array | None) -> dict:
  """The keywords `method.loss` takes beyond its batch: the step's own key of its draws,
  fold_in(`step_key`, StepStream.LOSS), for a method whose loss draws (Method.loss_draws); none
  otherwise."""
  if not method.loss_draws:
    return {}
  if step_key is None:
    raise ValueError(f'{method.name}\'s loss draws at random: it needs the step\'s key.')
  return {'key': jax.random.fold_in(step_key, StepStream.LOSS)}


def batch_grads(method, apply_fn: Callable, ctx: PyTree, trainable: dict, views, y, valid, *,
                micro_batch: int, step_key: jax.Array | None = None):
  """`method.loss` on one batch: the batch-mean loss, #correct, accumulator update and gradient.

  With `micro_batch` m below the batch size, the loss and gradient are summed over passes of m
  rows, weighted by their valid samples, and divided by the batch's (only for a loss that is a
  mean of per-sample terms, Method.per_sample_loss); only passes holding valid samples run."""
  b, m = y.shape[0], micro_batch
  zero = jnp.zeros((), jnp.float32)
  more = loss_kwargs(method, step_key)
  loss_of = lambda t, views, y, valid: method.loss(apply_fn, t, ctx, views, y, valid, **more)
  if m >= b:
    (loss, (correct, acc_update)), grads = jax.value_and_grad(loss_of, has_aux=True)(
        trainable, views, y, valid)
    return loss, correct, acc_update, grads

  def one_pass(j, sums):  # rows [j m, (j + 1) m): sums of per-sample losses and gradients
    part = lambda a: jax.lax.dynamic_slice_in_dim(a, j * m, m)
    v = part(valid)
    w = v.sum()
    (loss, (correct, acc_update)), grads = jax.value_and_grad(loss_of, has_aux=True)(
        trainable, tuple(map(part, views)), part(y), v)
    loss_sum, correct_sum, acc_sum, grad_sum = sums
    return (loss_sum + loss * w, correct_sum + correct,
            jax.tree_util.tree_map(jnp.add, acc_sum, acc_update),
            jax.tree_util.tree_map(lambda s, g: s + g * w, grad_sum, grads))

  count = valid.sum()
  zeros = (zero, jnp.zeros((), jnp.int32), method.init_acc(),
           jax.tree_util.tree_map(jnp.zeros_like, trainable))
  loss_sum, correct, acc_update, grad_sum = jax.lax.fori_loop(
      0, (count + m - 1) // m, one_pass, zeros)
  denom = jnp.maximum(count, 1)
  return (loss_sum / denom, correct, acc_update,
          jax.tree_util.tree_map(lambda g: g / denom, grad_sum))


def stateful_batch_grads(method, train_apply: Callable, model_state: PyTree, key: jax.Array,
                         ctx: PyTree, trainable: dict, views, y, valid,
                         step_key: jax.Array | None = None):
  """batch_grads for a model with batch statistics (models.StatefulModel), on the whole batch
  in one pass, so that a step's statistics are those of its batch: (loss, #correct, accumulator
  update, gradient, the new running statistics).

  The loss's calls of the client's model run in training mode, each on the statistics the
  previous call left (as a PyTorch model in train() mode updates its buffers at every forward),
  over the batch's valid rows (a call on k views concatenated, [k B] rows, repeats `valid`),
  call i with dropout drawn from fold_in(`key`, i)."""
  more = loss_kwargs(method, step_key)

  def loss_of(t, views, y, valid):
    state, calls = [model_state], [0]

    def apply_fn(variables, x):
      out, state[0] = train_apply(variables['params'], state[0], x,
                                  jnp.tile(valid, x.shape[0] // valid.shape[0]),
                                  jax.random.fold_in(key, calls[0]))
      calls[0] += 1
      return out
    loss, aux = method.loss(apply_fn, t, ctx, views, y, valid, **more)
    return loss, (aux, state[0])

  (loss, ((correct, acc_update), new_state)), grads = jax.value_and_grad(
      loss_of, has_aux=True)(trainable, views, y, valid)
  return loss, correct, acc_update, grads, new_state


# ----------------------------------------------------------------------------------------------
# A local step's parts, each chosen once from the settings (local_train)
# ----------------------------------------------------------------------------------------------
def shuffled_batches(cfg: TrainConfig, n, padded_len: int):
  """Epochs of batches over the training split: (`order_of(key)`, each epoch's order of the
  positions, a new shuffle or with `cfg.fixed_order` the stored order; `positions(order, step,
  step_key)`, a step's (positions, valid): the order's step-th batch, valid below n)."""
  b = cfg.batch_size

  def order_of(key):
    return jnp.arange(padded_len) if cfg.fixed_order else epoch_order(key, n, padded_len)

  def positions(order, step, step_key):
    del step_key
    return jax.lax.dynamic_slice(order, (step * b,), (b,)), step * b + jnp.arange(b) < n
  return order_of, positions


def poisson_batches(cfg: TrainConfig, n, padded_len: int):
  """DP-SGD's batches (`cfg.dp`), as shuffled_batches's: no epoch order, and each step a
  Poisson sample of rate min(1, B / n) drawn from its key (privacy.poisson_batch)."""
  q = privacy.sampling_rate(cfg.batch_size, n)

  def positions(order, step, step_key):
    del order, step
    return privacy.poisson_batch(jax.random.fold_in(step_key, StepStream.POISSON), n,
                                 padded_len, q, cfg.dp.max_batch)
  return (lambda key: None), positions


def step_gradient(cfg: TrainConfig, method, apply_fn: Callable, train_apply: Callable | None,
                  ctx: PyTree, n, model_state: PyTree):
  """A step's gradient: (`grads_of(trainable, model_state, step_key, views, y, valid)`, which
  returns (loss, #correct, accumulator update, gradient, model state); `counted(count)`, the
  steps a step of `count` valid samples counts). DP-SGD's (`cfg.dp`): the noised mean of the
  clipped per-example gradients (privacy.noisy_clipped_grads), every step counted, the noise
  being added whether or not the batch holds a sample. Else a model with batch statistics':
  its whole batch in one pass (stateful_batch_grads); or the plain one, in passes of
  `cfg.micro_batch` rows for a loss that is a mean of per-sample terms (batch_grads)."""
  b, dp = cfg.batch_size, cfg.dp
  if model_state is not None and train_apply is None:
    raise ValueError('A model with batch statistics trains with its train_apply.')
  # Micro-batches only for a loss that is a mean of per-sample terms, on a model whose batch
  # statistics (if any) would not then change.
  per_sample = method.per_sample_loss and model_state is None
  m = cfg.micro_batch if cfg.micro_batch and per_sample else b
  if b % m:
    raise ValueError(f'engine.micro_batch={m} must divide batch_size={b}.')
  if dp is not None:
    if model_state is not None:
      raise ValueError('DP-SGD needs per-example gradients, which batch statistics prevent.')
    denom = jnp.maximum(jnp.minimum(n, b), 1).astype(jnp.float32)  # q n, the expected batch
    def noisy(trainable, model_state, step_key, views, y, valid):
      more = loss_kwargs(method, step_key)
      loss_of = lambda t, views, y, valid: method.loss(apply_fn, t, ctx, views, y, valid, **more)
      return (*privacy.noisy_clipped_grads(
          loss_of, trainable, views, y, valid, jax.random.fold_in(step_key, StepStream.NOISE),
          denom, clip_norm=dp.clip_norm, noise_multiplier=dp.noise_multiplier,
          pass_size=dp.pass_size, per_example=dp.per_example, ghost_pass=dp.ghost_pass),
              model_state)
    return noisy, lambda count: 1
  if model_state is not None:
    def stateful(trainable, model_state, step_key, views, y, valid):
      return stateful_batch_grads(method, train_apply, model_state,
                                  jax.random.fold_in(step_key, StepStream.DROPOUT), ctx,
                                  trainable, views, y, valid, step_key)
    return stateful, lambda count: count > 0

  def plain(trainable, model_state, step_key, views, y, valid):
    return (*batch_grads(method, apply_fn, ctx, trainable, views, y, valid, micro_batch=m,
                         step_key=step_key), model_state)
  return plain, lambda count: count > 0


def epoch_steps(steps, work, epochs: int) -> Callable:
  """The steps epoch e runs: all its `steps`; or for a straggler running a fraction `work` of
  the round's E `steps` (the system section's), those among its first floor(work E steps)
  (system.step_bound), then none."""
  if work is None:
    return lambda e: steps
  bound = system.step_bound(work, epochs * steps)
  return lambda e: jnp.clip(bound - e * steps, 0, steps)


def local_train(trainable: dict, ctx: PyTree, key: jax.Array, train_idx: jax.Array,
                n: jax.Array, data: DeviceData, work: jax.Array | None = None, *,
                apply_fn: Callable, cfg: TrainConfig, method,
                train_apply: Callable | None = None) -> tuple[dict, PyTree, TrainStats]:
  """Trains one client for E epochs with `method.loss`. Returns (trainable, acc, stats).

  `trainable` is {'model': params, **aux}; each entry has its own optimizer (and clip), as
  separate torch optimizers would. `train_idx` is the client's padded [max_train] index row, `n`
  its true count (0 for a masked dummy client, which then runs no step and stays unchanged).
  `acc` sums the loss's per-step statistics (method.init_acc() to start). `stats` (TrainStats)
  sums over the samples and steps actually run. `work` (a straggler's fraction f, the system
  section's): only the first floor(f S) of the S = E ceil(n / B) steps run, the rest are no-ops.

  A model with batch statistics (models.StatefulModel, whose `train_apply` is given) has them in
  its row (models.MODEL_STATE): they are no trainable parameter, and each step trains its whole
  batch in one pass (stateful_batch_grads) and leaves the statistics it updated.

  With DP-SGD (`cfg.dp`, fedssa_jax/privacy/dp_sgd.py) each of the S steps draws a Poisson
  batch of rate min(1, B / n) from its key, and its gradient is the noised mean of the clipped
  per-example gradients (privacy.noisy_clipped_grads); every step counts in `stats.steps`,
  the noise being added whether or not the batch holds a sample.

  These are chosen once from the settings, not at each step: the batches (shuffled_batches,
  poisson_batches), the gradient (step_gradient) and the epochs' steps (epoch_steps).
  """
  tx = make_optimizer(cfg)
  b = cfg.batch_size
  padded_len = -(-train_idx.shape[0] // b) * b
  idx_pad = jnp.pad(train_idx, (0, padded_len - train_idx.shape[0]))
  steps = n // b if cfg.drop_last else (n + b - 1) // b
  params, model_state = models.split_state(trainable['model'])
  trainable = {**trainable, 'model': params}
  # The step's parts, chosen once: its batch, its gradient, and the epochs' steps.
  order_of, positions = (shuffled_batches if cfg.dp is None else poisson_batches)(
      cfg, n, padded_len)
  grads_of, counted = step_gradient(cfg, method, apply_fn, train_apply, ctx, n, model_state)
  steps_of = epoch_steps(steps, work, cfg.local_epochs)

  def grad_step(step, carry, order, aug_key):
    (trainable, model_state), opt_state, acc, stats = carry
    step_key = jax.random.fold_in(aug_key, step)
    pos, valid = positions(order, step, step_key)
    idx = idx_pad[pos]
    x = augment.normalize(data.images[idx], cfg.mean, cfg.std)
    views = tuple(
        augment.augment_batch(step_key if v == 0 else jax.random.fold_in(step_key, v), x)
        if cfg.augment else x for v in range(method.num_views))
    loss, correct, acc_update, grads, model_state = grads_of(
        trainable, model_state, step_key, views, data.labels[idx], valid)
    new_trainable, new_opt_state = {}, {}
    for part in trainable:  # one optimizer per model
      updates, new_opt_state[part] = tx.update(grads[part], opt_state[part], trainable[part])
      new_trainable[part] = optax.apply_updates(trainable[part], updates)
    acc = jax.tree_util.tree_map(jnp.add, acc, acc_update)
    count = valid.sum()
    stats = TrainStats(correct=stats.correct + correct, loss_sum=stats.loss_sum + loss * count,
                       samples=stats.samples + count, steps=stats.steps + counted(count))
    return (new_trainable, model_state), new_opt_state, acc, stats

  def epoch(e, carry):
    k_order, k_aug = jax.random.split(jax.random.fold_in(key, e))
    order = order_of(k_order)
    return jax.lax.fori_loop(0, steps_of(e), lambda s, c: grad_step(s, c, order, k_aug), carry)

  opt_state = {part: tx.init(p) for part, p in trainable.items()}
  (trainable, model_state), _, acc, stats = jax.lax.fori_loop(
      0, cfg.local_epochs, epoch,
      ((trainable, model_state), opt_state, method.init_acc(), TrainStats.zeros()))
  trainable = {**trainable, 'model': models.join_state(trainable['model'], model_state)}
  return trainable, acc, stats


def forward_pass_sums(params: PyTree, train_idx: jax.Array, n: jax.Array, data: DeviceData, *,
                      apply_fn: Callable, cfg: TrainConfig, batch_size: int,
                      stats_fn: Callable, rows: bool = False):
  """One forward pass of `params` over a client's training split, in batches of `batch_size`
  padded and masked as `evaluate`'s: the images normalised, not augmented, and no gradient.
  Returns the sum over the batches of `stats_fn(logits, rep, y, valid)` (a pytree of arrays,
  e.g. V1 class sums of r); zeros for `n` = 0 (a dummy client), which runs no batch. With
  `cfg.drop_last` the pass reads the training split as that loader does: the last n mod B
  samples of the stored order (B the training batch, cfg.batch_size) are left out. With `rows`
  (Method.forward_pass_rows), `stats_fn` also gets the batch's positions in the row (`pos`
  [b]) and the row's width W = train_idx.shape[0] (`width`).

  The pass a method asks for with Method.forward_pass (the engine runs it before or after local
  training)."""
  params = jax.lax.stop_gradient(params)
  if rows:
    stats_fn = functools.partial(stats_fn, width=train_idx.shape[0])
  if cfg.drop_last:
    n = n // cfg.batch_size * cfg.batch_size
  b = batch_size
  padded_len = -(-train_idx.shape[0] // b) * b
  idx_pad = jnp.pad(train_idx, (0, padded_len - train_idx.shape[0]))

  def body(step, acc):
    idx = jax.lax.dynamic_slice(idx_pad, (step * b,), (b,))
    valid = step * b + jnp.arange(b) < n
    x = augment.normalize(data.images[idx], cfg.mean, cfg.std)
    logits, rep = apply_fn({'params': params}, x)
    extra = (step * b + jnp.arange(b),) if rows else ()
    return jax.tree_util.tree_map(jnp.add, acc,
                                  stats_fn(logits, rep, data.labels[idx], valid, *extra))

  # The sums start at zero, shaped as stats_fn's output on one batch.
  x = jax.ShapeDtypeStruct((b, *data.images.shape[1:]), jnp.float32)
  logits, rep = jax.eval_shape(lambda p, x: apply_fn({'params': p}, x), params, x)
  extra = (jax.ShapeDtypeStruct((b,), jnp.int32),) if rows else ()
  shapes = jax.eval_shape(stats_fn, logits, rep, jax.ShapeDtypeStruct((b,), data.labels.dtype),
                          jax.ShapeDtypeStruct((b,), jnp.bool_), *extra)
  zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  return jax.lax.fori_loop(0, (n + b - 1) // b, body, zeros)


def study_and_quiz(key: jax.Array, train_idx: jax.Array, n: jax.Array, data: DeviceData, *,
                   held_out: int, batch_size: int, cfg: TrainConfig):
  """A client's study batch and quiz set for a step after training (Method.after_training),
  each (x [b, H, W, C] normalised and unaugmented, y [b], valid [b]).

  The quiz set is positions 0..Q-1 of the client's training index row (Q = `held_out`, the
  held-out samples; valid where < n). The study batch is the first `batch_size` positions of
  a random order (epoch_order, from `key`) of the trainable split, positions Q..n-1 (valid for
  the first min(n - Q, batch_size)). Returns (study, quiz)."""
  width = train_idx.shape[0]
  rest = train_idx[held_out:] if width > held_out else jnp.zeros((1,), train_idx.dtype)
  rest_n = jnp.maximum(n - held_out, 0)
  padded_len = max(rest.shape[0], batch_size)
  rest = jnp.pad(rest, (0, padded_len - rest.shape[0]))
  study_idx = rest[epoch_order(key, rest_n, padded_len)[:batch_size]]
  quiz_idx = jnp.pad(train_idx[:held_out], (0, max(0, held_out - width)))

  def batch(idx, valid):
    return augment.normalize(data.images[idx], cfg.mean, cfg.std), data.labels[idx], valid

  return (batch(study_idx, jnp.arange(batch_size) < rest_n),
          batch(quiz_idx, jnp.arange(held_out) < n))


def after_training(trainable: dict, ctx: PyTree, key: jax.Array, train_idx: jax.Array,
                   n: jax.Array, data: DeviceData, view, *, apply_fn: Callable,
                   cfg: TrainConfig, method):
  """`method.after_training` on one client's trained `trainable`, with its study batch (B =
  cfg.batch_size samples of the trainable split) and quiz set (the method's held-out samples),
  study_and_quiz's. Returns (its output, the study batch's and the quiz set's valid samples)."""
  study, quiz = study_and_quiz(key, train_idx, n, data, held_out=method.held_out_samples,
                               batch_size=cfg.batch_size, cfg=cfg)
  # A model's batch statistics are no parameter the step may differentiate or move: the step
  # sees the parameters, and the model reads its running statistics (models.MODEL_STATE).
  params, model_state = models.split_state(trainable['model'])
  if model_state is not None:
    row_apply = apply_fn
    apply_fn = lambda variables, x: row_apply(
        {'params': models.join_state(variables['params'], model_state)}, x)
    trainable = {**trainable, 'model': params}
  out = method.after_training(apply_fn, trainable, ctx, study, quiz, view)
  return out, study[2].sum(), quiz[2].sum()
