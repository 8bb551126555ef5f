"""Local training: vmapped == one client at a time == a plain torch-style SGD loop."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedssa_jax import config_lib, data, models
from fedssa_jax.data import augment
from fedssa_jax.data.partition import DeviceData
from fedssa_jax.engine import training
from fedssa_jax.methods import standalone

SIZES = [5, 13, 0, 20]  # uneven clients, one empty (a dummy)
CONFIG = config_lib.base_config('cifar10')


def setup(ds, cfg):
  cd = data.partition(ds, 4, 'dirichlet', dirichlet_gamma=5.0, dirichlet_min_train=1, seed=0)
  idx = np.zeros((4, max(SIZES)), np.int32)
  for c, n in enumerate(SIZES):
    idx[c, :n] = cd.train_idx[c, :n] if n <= cd.train_n[c] else np.arange(n)
  dd = DeviceData(jnp.asarray(ds.images), jnp.asarray(ds.labels), jnp.asarray(idx),
                         jnp.asarray(SIZES), jnp.asarray(idx), jnp.asarray(SIZES))
  model = models.make_model('cnn5', 10, 'im2col', feature_dim=CONFIG.model.feature_dim)
  params = jax.vmap(functools.partial(models.init_params, model))(
      jax.random.split(jax.random.PRNGKey(0), 4))
  keys = jax.random.split(jax.random.PRNGKey(1), 4)
  method = standalone.Standalone(CONFIG, 4, 10)  # plain cross-entropy

  def train(params, key, idx, n, dd, work=None):
    trainable, _, stats = training.local_train({'model': params}, None, key, idx, n, dd, work,
                                               apply_fn=model.apply, cfg=cfg, method=method)
    return trainable['model'], stats
  return dd, model, params, keys, train


def tree_allclose(a, b, **kw):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


@pytest.mark.slow  # local training compiled, vmapped and per client
@pytest.mark.parametrize('use_augment', [True, False])
def test_vmapped_group_equals_singletons(small_ds, use_augment):
  cfg = training.TrainConfig(batch_size=8, local_epochs=2, lr=0.05, augment=use_augment,
                           clip_norm=1.0, weight_decay=1e-3)
  dd, _, params, keys, train = setup(small_ds, cfg)
  vm_params, vm_stats = jax.jit(jax.vmap(train, in_axes=(0, 0, 0, 0, None)))(
      params, keys, dd.train_idx, dd.train_n, dd)
  one = jax.jit(train)
  for c, n in enumerate(SIZES):
    p_c = jax.tree_util.tree_map(lambda x: x[c], params)
    single, stats = one(p_c, keys[c], dd.train_idx[c], dd.train_n[c], dd)
    tree_allclose(jax.tree_util.tree_map(lambda x: x[c], vm_params), single, rtol=2e-4,
                  atol=2e-6)
    assert int(stats.samples) == int(vm_stats.samples[c]) == 2 * n
    assert int(stats.steps) == int(vm_stats.steps[c]) == 2 * -(-n // 8)
  # The empty client is bit-for-bit unchanged.
  tree_allclose(jax.tree_util.tree_map(lambda x: x[2], vm_params),
                jax.tree_util.tree_map(lambda x: x[2], params), rtol=0, atol=0)


@pytest.mark.slow  # local training compiled, vmapped and per client
def test_micro_batched_steps_equal_whole_batches(small_ds):
  """Gradients summed over 4-row passes (only those holding valid samples) are the batch's."""
  got = {}
  for micro in (0, 4):
    cfg = training.TrainConfig(batch_size=8, local_epochs=2, lr=0.05, micro_batch=micro,
                             clip_norm=1.0, weight_decay=1e-3)
    dd, _, params, keys, train = setup(small_ds, cfg)
    got[micro] = jax.jit(jax.vmap(train, in_axes=(0, 0, 0, 0, None)))(
        params, keys, dd.train_idx, dd.train_n, dd)
  tree_allclose(got[4][0], got[0][0], rtol=2e-4, atol=2e-6)
  for k in ('samples', 'steps', 'correct'):
    np.testing.assert_array_equal(getattr(got[4][1], k), getattr(got[0][1], k))
  np.testing.assert_allclose(got[4][1].loss_sum, got[0][1].loss_sum, rtol=1e-5)


def plain_sgd(params, key, idx_row, n, ds, apply_fn, cfg, max_steps=None):
  """torch-style SGD written out: clip, L2 added to the gradient, momentum buffer, lr step;
  `max_steps`: stop after that many steps (a straggler's); cfg.fixed_order: the stored order
  every epoch; cfg.drop_last: only the full batches."""
  images = np.asarray(augment.normalize(ds.images, cfg.mean, cfg.std))
  b = cfg.batch_size
  padded = -(-len(idx_row) // b) * b

  @jax.jit
  def grad_of_mean_ce(p, x, y):
    return jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
        apply_fn({'params': p}, x)[0], y).mean())(p)

  buf = jax.tree_util.tree_map(np.zeros_like, params)
  steps = 0
  for e in range(cfg.local_epochs):
    k_order, _ = jax.random.split(jax.random.fold_in(key, e))
    order = (np.arange(n) if cfg.fixed_order else
             np.asarray(training.epoch_order(k_order, n, padded))[:n])
    for start in range(0, n - b + 1 if cfg.drop_last else n, b):
      if max_steps is not None and steps == max_steps:
        return params
      steps += 1
      sel = idx_row[order[start:start + b]]   # the last batch is partial
      g = grad_of_mean_ce(params, images[sel], ds.labels[sel])
      norm = np.sqrt(sum(float(np.sum(np.square(x))) for x in jax.tree_util.tree_leaves(g)))
      scale = min(1.0, cfg.clip_norm / norm)
      d = jax.tree_util.tree_map(lambda gi, p: gi * scale + cfg.weight_decay * p, g, params)
      buf = jax.tree_util.tree_map(lambda m, di: cfg.momentum * m + di, buf, d)
      params = jax.tree_util.tree_map(lambda p, m: p - cfg.lr * m, params, buf)
  return params


@pytest.mark.slow  # local training compiled, vmapped and per client
@pytest.mark.parametrize('clip_norm', [0.5, 1e6])  # clipping active, and never active
def test_matches_plain_torch_style_sgd(small_ds, clip_norm):
  cfg = training.TrainConfig(batch_size=8, local_epochs=2, lr=0.05, augment=False,
                           clip_norm=clip_norm, weight_decay=1e-2, mean=small_ds.mean,
                           std=small_ds.std)
  dd, model, params, keys, train = setup(small_ds, cfg)
  c = 1  # 13 samples: a full and a partial batch per epoch
  p_c = jax.tree_util.tree_map(lambda x: x[c], params)
  got, _ = jax.jit(train)(p_c, keys[c], dd.train_idx[c], dd.train_n[c], dd)
  want = plain_sgd(p_c, keys[c], np.asarray(dd.train_idx[c]), SIZES[c], small_ds,
                   model.apply, cfg)
  tree_allclose(got, want, rtol=1e-3, atol=1e-5)
  # And training did move the parameters.
  assert not np.allclose(got['fc3']['kernel'], p_c['fc3']['kernel'])


@pytest.mark.slow  # local training compiled and vmapped
def test_a_straggler_runs_the_first_floor_f_s_steps_as_a_plain_loop_does(small_ds):
  """The system section's stragglers: work fractions f per client, vmapped; S = E ceil(n / B)
  steps (E = 2, B = 8), of which floor(f S) run, across the epoch boundary too."""
  cfg = training.TrainConfig(batch_size=8, local_epochs=2, lr=0.05, augment=False,
                             clip_norm=0.5, weight_decay=1e-2, mean=small_ds.mean,
                             std=small_ds.std)
  dd, model, params, keys, train = setup(small_ds, cfg)
  work = jnp.array([0.5, 0.8, 0.3, 0.2], jnp.float32)  # S = 2, 4, 0, 6: 1, 3, 0, 1 steps
  got, stats = jax.jit(jax.vmap(train, in_axes=(0, 0, 0, 0, None, 0)))(
      params, keys, dd.train_idx, dd.train_n, dd, work)
  np.testing.assert_array_equal(stats.steps, [1, 3, 0, 1])
  np.testing.assert_array_equal(stats.samples, [5, 8 + 5 + 8, 0, 8])
  for c, steps in ((1, 3), (3, 1)):
    p_c = jax.tree_util.tree_map(lambda x: x[c], params)
    want = plain_sgd(p_c, keys[c], np.asarray(dd.train_idx[c]), SIZES[c], small_ds,
                     model.apply, cfg, max_steps=steps)
    tree_allclose(jax.tree_util.tree_map(lambda x: x[c], got), want, rtol=1e-3, atol=1e-5)
  # And f = 1 is the whole round.
  full, _ = jax.jit(train)(jax.tree_util.tree_map(lambda x: x[1], params), keys[1],
                           dd.train_idx[1], dd.train_n[1], dd)
  one, _ = jax.jit(train)(jax.tree_util.tree_map(lambda x: x[1], params), keys[1],
                          dd.train_idx[1], dd.train_n[1], dd, jnp.float32(1.0))
  tree_allclose(one, full, rtol=1e-6, atol=1e-9)  # another program: rounding only


@pytest.mark.slow  # local training compiled and vmapped
def test_fixed_order_and_dropped_last_batch_as_a_plain_loop(small_ds):
  """batch_order=fixed, drop_last=True (a PyTorch loader without shuffling that drops the
  partial batch): floor(n / B) batches of the stored order every epoch, vmapped, against the
  loop written out; a client with fewer than B samples trains nothing."""
  cfg = training.TrainConfig(batch_size=8, local_epochs=2, lr=0.05, augment=False,
                             clip_norm=0.5, weight_decay=1e-2, mean=small_ds.mean,
                             std=small_ds.std, fixed_order=True, drop_last=True)
  dd, model, params, keys, train = setup(small_ds, cfg)
  got, stats = jax.jit(jax.vmap(train, in_axes=(0, 0, 0, 0, None)))(
      params, keys, dd.train_idx, dd.train_n, dd)
  np.testing.assert_array_equal(stats.steps, [0, 2, 0, 4])  # E floor(n / 8), n = 5, 13, 0, 20
  np.testing.assert_array_equal(stats.samples, [0, 16, 0, 32])
  for c in (1, 3):
    p_c = jax.tree_util.tree_map(lambda x: x[c], params)
    want = plain_sgd(p_c, keys[c], np.asarray(dd.train_idx[c]), SIZES[c], small_ds,
                     model.apply, cfg)
    tree_allclose(jax.tree_util.tree_map(lambda x: x[c], got), want, rtol=1e-3, atol=1e-5)
  # The key plays no part: another key trains the same.
  other, _ = jax.jit(train)(jax.tree_util.tree_map(lambda x: x[3], params), keys[0],
                            dd.train_idx[3], dd.train_n[3], dd)
  tree_allclose(other, jax.tree_util.tree_map(lambda x: x[3], got), rtol=1e-5, atol=1e-7)
  tree_allclose(jax.tree_util.tree_map(lambda x: x[0], got),  # 5 < B samples: unchanged
                jax.tree_util.tree_map(lambda x: x[0], params), rtol=0, atol=0)


def test_epoch_order_is_a_permutation_of_the_valid_positions():
  order = np.asarray(training.epoch_order(jax.random.PRNGKey(0), 13, 16))
  assert sorted(order[:13]) == list(range(13)) and sorted(order[13:]) == [13, 14, 15]

