"""Differential privacy (fedssa_jax/privacy/): DP-SGD in local training, client-level DP on
the uploads, and their accountants.

Fast: the config's checks; the Poisson batch (positions, rates); per-example clipping and the
noised mean against a plain loop over examples, with the noise from the same keys; the noise's
empirical std; zero noise and no clipping as plain SGD's gradient; the accountant against
dp_accounting's own events and the published DP-SGD figures; calibration; the budget's check.
Slow: DP-SGD's local training, vmapped over clients, against a plain per-client loop; a run
whose records carry epsilon, that a budget ends early and that resumes exactly; a simulator of
models with batch norm refused.
Uploads: the config's checks and each method's refusals; a privatized upload by hand; the
accountant against dp_accounting's events; calibration; FedSSA's server table and (central)
global rows after a round, against a round without DP by hand; a run's upload epsilon and its
resume (in the run test above).
"""
import json
import math
import os

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct
from dp_accounting.rdp import rdp_privacy_accountant

from fedssa_jax import config_lib, data, models, privacy
from fedssa_jax.data import augment
from fedssa_jax.data.partition import DeviceData
from fedssa_jax.engine import training
from fedssa_jax.errors import ConfigError
from fedssa_jax.models import ghost
from fedssa_jax.methods import standalone
from fedssa_jax.streams import StepStream
from fedssa_jax.run import observers, train


def section(**fields):
  p = privacy.default_config()
  p.update(dict(dp_sgd=True, **fields))
  return p


def test_the_section_is_off_by_default():
  c = config_lib.base_config('cifar10')
  assert not privacy.enabled(c.privacy)
  privacy.check_config(c.privacy, 'fedkd', False)  # off: nothing to refuse


@pytest.mark.parametrize('fields, method, per_sample, says', [
    (dict(clip_norm=0.0), 'fedssa', True, 'privacy.clip_norm must be > 0'),
    (dict(noise_multiplier=-1.0), 'fedssa', True, 'privacy.noise_multiplier must be >= 0'),
    (dict(delta=0.0), 'fedssa', True, 'privacy.delta must be in (0, 1)'),
    (dict(delta=1.0), 'fedssa', True, 'privacy.delta must be in (0, 1)'),
    (dict(target_epsilon=-1.0), 'fedssa', True, 'privacy.target_epsilon must be > 0'),
    (dict(accountant='moments'), 'fedssa', True, 'Unknown privacy.accountant'),
    (dict(noise_multiplier=0.0), 'fedssa', True, 'no epsilon is finite'),
    ({}, 'fedkd', False, "fedkd's couples the samples"),
    ({}, 'fedclassavg', False, "fedclassavg's couples the samples"),
])
def test_bad_input_is_a_config_error_naming_the_fix(fields, method, per_sample, says):
  with pytest.raises(ConfigError) as e:
    privacy.check_config(section(**fields), method, per_sample)
  assert says in str(e.value)


def test_validate_checks_the_section():
  c = config_lib.build('cifar10', 'hetero,tiny')
  c.privacy.dp_sgd, c.method = True, 'fedclassavg'
  with pytest.raises(ConfigError, match='couples the samples'):
    config_lib.validate(c)
  c.method, c.privacy.clip_norm = 'fedssa', 0.0
  with pytest.raises(ConfigError, match='clip_norm'):
    config_lib.validate(c)


def test_a_model_with_batch_statistics_is_refused():
  privacy.check_models(section(), set())
  privacy.check_models(privacy.default_config(), {'resnet18'})  # off: allowed
  with pytest.raises(ConfigError, match='batch norm do not give: resnet18'):
    privacy.check_models(section(), {'resnet18'})


def test_what_each_method_sends_of_the_data_is_a_private_release_or_refused():
  """Under DP-SGD, every method's upload is covered: by the steps (its trained models), or by
  its private releases (privacy_releases_test.py), or the method is refused."""
  from fedssa_jax import methods
  c = config_lib.base_config('cifar10')
  releases = {name for name, cls in methods.METHODS.items() if cls.release_values is not None}
  assert sorted(releases) == ['fd', 'fedgh', 'fedorgp', 'fedproto', 'fedsa', 'fedtgp']
  assert not [name for name, cls in methods.METHODS.items() if cls.dp_sgd_refusal(c)]
  c.privacy.dp_sgd = True
  whole = [n for n, cls in methods.METHODS.items() if cls(c, 5, 10).release_after_training]
  assert whole == ['fedl2g']  # its meta gradient, released whole
  assert [n for n, cls in methods.METHODS.items() if cls.server_reads_class_counts] == ['fedgen']


# --- The batch and the gradient -------------------------------------------------------------
def test_a_poisson_batch_takes_each_valid_position_at_rate_q():
  n, padded, q, rows = 30, 40, 0.2, 24
  draw = jax.jit(jax.vmap(lambda k: privacy.poisson_batch(k, n, padded, q, rows)))
  pos, valid = map(np.asarray, draw(jax.random.split(jax.random.PRNGKey(0), 4000)))
  taken = np.zeros((4000, padded), int)
  for i in range(4000):
    chosen = pos[i][valid[i]]
    assert len(set(chosen)) == len(chosen) and (chosen < n).all()
    assert valid[i][:valid[i].sum()].all()  # the taken rows come first
    taken[i, chosen] = 1
  rate = taken[:, :n].mean(axis=0)
  assert abs(rate.mean() - q) < 0.005 and np.abs(rate - q).max() < 0.04
  assert taken[:, n:].sum() == 0
  # The batch size is Binomial(n, q): mean n q, variance n q (1 - q).
  sizes = valid.sum(axis=1)
  assert abs(sizes.mean() - n * q) < 0.1 and abs(sizes.var() - n * q * (1 - q)) < 0.3


def test_the_automatic_batch_bound_is_poissons_tail_in_whole_passes():
  from scipy import stats
  for b in (10, 50, 512):
    rows = privacy.max_batch(b, 10_000, 16)
    assert rows % 16 == 0 and stats.poisson.sf(rows, b) < privacy.TRUNCATION_TAIL
    assert stats.poisson.sf(rows - 16, b) >= privacy.TRUNCATION_TAIL
  assert privacy.max_batch(512, 100, 16) == 112  # at most the longest split
  assert privacy.max_batch(10, 10_000, 16, given=20) == 32


def linear_problem(b=12, d=6, c=4, seed=0):
  """A linear softmax classifier and a batch whose first 9 rows are valid."""
  rng = np.random.default_rng(seed)
  trainable = {'model': {'w': jnp.asarray(rng.normal(size=(d, c)), jnp.float32)},
               'aux': {'b': jnp.asarray(rng.normal(size=(c,)), jnp.float32)}}
  x = jnp.asarray(rng.normal(size=(b, d)) * 3, jnp.float32)
  y = jnp.asarray(rng.integers(0, c, b), jnp.int32)
  valid = jnp.arange(b) < 9

  def loss_of(t, views, y, valid):
    logits = views[0] @ t['model']['w'] + t['aux']['b']
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    loss = jnp.sum(jnp.where(valid, ce, 0.0)) / jnp.maximum(valid.sum(), 1)
    correct = jnp.sum((jnp.argmax(logits, -1) == y) & valid)
    return loss, (correct, {'seen': (jax.nn.one_hot(y, c) * valid[:, None]).sum(axis=0)})
  return trainable, (x,), y, valid, loss_of


def test_clipped_noised_mean_equals_a_plain_loop_over_examples():
  trainable, views, y, valid, loss_of = linear_problem()
  clip, sigma, denom, key = 8.0, 1.3, 10.0, jax.random.PRNGKey(3)
  loss, correct, acc, grads = privacy.noisy_clipped_grads(
      loss_of, trainable, views, y, valid, key, denom, clip_norm=clip, noise_multiplier=sigma,
      pass_size=4)
  total = jax.tree.map(np.zeros_like, trainable)
  norms, losses = [], []
  for i in range(int(valid.sum())):  # by hand: each example's gradient, clipped
    (l, _), g = jax.value_and_grad(loss_of, has_aux=True)(
        trainable, (views[0][i:i + 1],), y[i:i + 1], jnp.ones(1, bool))
    norm = math.sqrt(sum(float(np.sum(np.square(v))) for v in jax.tree.leaves(g)))
    norms.append(norm)
    losses.append(float(l))
    total = jax.tree.map(lambda s, v: s + np.asarray(v) * min(1.0, clip / norm), total, g)
  assert min(norms) < clip < max(norms)  # some examples clipped, some not
  leaves, tree = jax.tree.flatten(total)
  noise = [np.asarray(jax.random.normal(jax.random.fold_in(key, i), v.shape)) * sigma * clip
           for i, v in enumerate(leaves)]
  want = jax.tree.unflatten(tree, [(v + z) / denom for v, z in zip(leaves, noise)])
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(loss, np.mean(losses), rtol=1e-5)
  assert int(correct) == int(loss_of(trainable, views, y, valid)[1][0])
  np.testing.assert_array_equal(acc['seen'], loss_of(trainable, views, y, valid)[1][1]['seen'])


def cnn_problem(family='cnn5', conv_impl='band', b=8, seed=0):
  """A CNN of the paper's (every parameter in a tapped layer) with its CE loss, and a batch
  of 32x32 images whose first 6 rows are valid."""
  model = models.make_model(family, 10, conv_impl, feature_dim=64)
  params = models.init_params(model, jax.random.PRNGKey(seed))
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(b, 32, 32, 3)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, b), jnp.int32)
  valid = jnp.arange(b) < 6

  def loss_of(t, views, y, valid):
    logits, _ = model.apply({'params': t['model']}, views[0])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    loss = jnp.sum(jnp.where(valid, ce, 0.0)) / jnp.maximum(valid.sum(), 1)
    return loss, (jnp.sum((jnp.argmax(logits, -1) == y) & valid), None)
  return {'model': params}, (x,), y, valid, loss_of


def one_of(loss_of):
  return lambda t, v, y, ok: loss_of(t, tuple(a[None] for a in v), y[None], ok[None])


def test_ghost_norms_are_each_examples_gradient_norm():
  """The probe's gradient under the taps is each example's squared gradient norm over every
  layer (convolutions and dense), as jax.grad of the example alone gives it. (The taps mark
  the layers' outputs, the same for every conv_impl.)"""
  trainable, views, y, valid, loss_of = cnn_problem(conv_impl='im2col')
  one = one_of(loss_of)

  def probed(probes):
    def example(v, yy, ok, probe):
      with ghost.probing(probe):
        return one(trainable, v, yy, ok)[0]
    return jax.vmap(example)(views, y, valid, probes).sum()
  sq = jax.jit(jax.grad(probed))(jnp.zeros(8))
  np.testing.assert_allclose(sq, squared_norms(one, trainable, views, y, valid), rtol=2e-4)
  assert sq[6] == sq[7] == 0.0  # invalid rows: no loss, no gradient


def squared_norms(one, trainable, views, y, valid):
  """Each example's squared gradient norm, from its gradient (jax.grad of it alone)."""
  grads = jax.jit(jax.vmap(jax.grad(lambda t, v, yy, ok: one(t, v, yy, ok)[0]),
                           in_axes=(None, 0, 0, 0)))(trainable, views, y, valid)
  return sum(np.sum(np.square(g.reshape(g.shape[0], -1)), axis=1)
             for g in jax.tree.leaves(grads))


def test_ghost_norms_cover_a_model_only_if_every_parameter_is_tapped_once():
  trainable, views, y, valid, loss_of = cnn_problem()
  assert privacy.ghost_covers(one_of(loss_of), trainable, views, y, valid)
  # A raw parameter (no layer), and one beside the model, are not covered.
  lin = linear_problem()
  assert not privacy.ghost_covers(one_of(lin[4]), *lin[:4])
  extra = {**trainable, 'aux': {'scale': jnp.ones(())}}
  scaled = lambda t, v, yy, ok: loss_of(t, tuple(a * t['aux']['scale'] for a in v), yy, ok)
  assert not privacy.ghost_covers(one_of(scaled), extra, views, y, valid)
  # A layer applied twice: its two taps would not add up to its gradient's norm.
  dense = models.layers.Dense(10)
  p = {'model': dense.init(jax.random.PRNGKey(0), jnp.zeros((1, 10)))['params']}
  twice = lambda t, v, yy, ok: (jnp.sum(dense.apply({'params': t['model']}, dense.apply(
      {'params': t['model']}, v[0].reshape(v[0].shape[0], -1)[:, :10]))), (0, None))
  assert not privacy.ghost_covers(one_of(twice), p, views, y, valid)


def test_ghost_clipping_equals_building_each_examples_gradient():
  """per_example 'auto' (ghost norms, then one weighted backward pass, in passes of 4 rows)
  gives 'vmap''s clipped, noised mean, loss and count, some examples clipped and some not."""
  trainable, views, y, valid, loss_of = cnn_problem(conv_impl='im2col')
  args = (loss_of, trainable, views, y, valid, jax.random.PRNGKey(2), 6.0)
  norms = np.sqrt(squared_norms(one_of(loss_of), trainable, views, y, valid))[:6]
  clip = float(np.median(norms))
  assert min(norms) < clip < max(norms)
  run = lambda mode: jax.jit(lambda: privacy.noisy_clipped_grads(
      *args, clip_norm=clip, noise_multiplier=0.7, pass_size=2, per_example=mode,
      ghost_pass=4))()
  want, got = run('vmap'), run('auto')
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  assert int(got[1]) == int(want[1])
  for a, b in zip(jax.tree.leaves(got[3]), jax.tree.leaves(want[3])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_zero_noise_and_no_clipping_give_plain_sgds_gradient():
  trainable, views, y, valid, loss_of = linear_problem()
  _, _, _, grads = privacy.noisy_clipped_grads(
      loss_of, trainable, views, y, valid, jax.random.PRNGKey(0), valid.sum().astype(
          jnp.float32), clip_norm=math.inf, noise_multiplier=0.0, pass_size=4)
  want = jax.grad(lambda t: loss_of(t, views, y, valid)[0])(trainable)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_the_noise_has_std_sigma_times_c():
  sigma, clip = 1.1, 0.5
  zeros = {'a': jnp.zeros((200, 300)), 'b': jnp.zeros((50_000,))}
  noised = privacy.add_noise(zeros, jax.random.PRNGKey(7), sigma * clip, 1.0)
  for leaf in jax.tree.leaves(noised):
    assert abs(float(jnp.std(leaf)) / (sigma * clip) - 1) < 0.02
    assert abs(float(jnp.mean(leaf))) < 0.02
  # Each leaf has its own noise.
  assert not np.allclose(np.asarray(noised['a']).ravel()[:1000], noised['b'][:1000])


# --- The accountant ---------------------------------------------------------------------------
def test_the_published_dp_sgd_setting_gives_the_known_epsilons():
  """q = 256/60000, sigma = 1.1, 60 epochs, delta = 1e-5: epsilon 2.60 (RDP) and 2.38 (PLD)
  with dp_accounting 0.6."""
  q = 256 / 60000
  steps = int(60 / q)
  assert privacy.epsilon('rdp', q, 1.1, steps, 1e-5) == pytest.approx(2.60, abs=0.005)
  assert privacy.epsilon('pld', q, 1.1, steps, 1e-5) == pytest.approx(2.38, abs=0.005)


def accountant(train_n, **fields):
  p = section(**fields)
  return privacy.Accountant(p, np.asarray([train_n]), batch_size=10, local_epochs=2,
                            num_rounds=5)


def test_the_accountants_epsilon_is_the_librarys_for_the_same_events_and_grows():
  a = accountant([100, 40, 7, 0], noise_multiplier=1.1)
  np.testing.assert_array_equal(a.round_steps, [[20, 8, 2, 0]])
  np.testing.assert_allclose(a.q, [[0.1, 0.25, 1.0, 1.0]], rtol=1e-7)
  steps = [20, 8, 2, 0]
  eps = a.epsilons(0, steps)
  for k in range(3):
    lib = rdp_privacy_accountant.RdpAccountant()
    for _ in range(steps[k]):  # step by step, as the library composes any events
      lib.compose(dp_accounting.PoissonSampledDpEvent(
          float(np.float32(10) / np.float32([100, 40, 7][k]) if k < 2 else 1.0),
          dp_accounting.GaussianDpEvent(1.1)))
    assert eps[k] == pytest.approx(lib.get_epsilon(1e-5), rel=1e-9)
  assert eps[3] == 0.0  # never trained
  later = a.epsilons(0, [40, 16, 4, 0])
  assert (later[:3] > eps[:3]).all()


def test_calibration_meets_the_target_over_the_whole_schedule():
  a = accountant([100, 40], noise_multiplier=0.0, target_epsilon=3.0)
  full = [int(s) * 5 for s in a.round_steps[0]]
  eps = a.epsilons(0, full)
  assert eps.max() <= 3.0 and eps.max() == pytest.approx(3.0, abs=0.01)
  with pytest.raises(ConfigError, match='cannot be met'):
    accountant([100, 40], noise_multiplier=0.5, target_epsilon=0.01)


def test_a_round_that_could_exceed_the_target_is_named_before_it_runs():
  a = accountant([100, 40], noise_multiplier=3.0, target_epsilon=2.0)
  assert a.next_round_exceeds(0, [0, 0], [0, 1]) is None
  per_round = a.round_steps[0]
  rounds_within = 1  # the most rounds of every client's steps within the target (1 at least)
  while a.epsilons(0, per_round * (rounds_within + 1)).max() <= 2.0:
    rounds_within += 1
  assert rounds_within < 5
  steps = per_round * rounds_within
  worst = a.next_round_exceeds(0, steps, [0, 1])
  assert worst is not None and worst > 2.0
  assert a.next_round_exceeds(0, steps, []) is None  # nobody trains next round
  assert accountant([100], noise_multiplier=1.0).next_round_exceeds(0, [10**6], [0]) is None


# --- Local training ---------------------------------------------------------------------------
SIZES = [13, 0, 6]  # a client with two Poisson steps a round, an empty one, one with q = 1


def dp_setup(ds, cfg):
  cd = data.partition(ds, 3, 'dirichlet', dirichlet_gamma=5.0, dirichlet_min_train=1, seed=0)
  idx = np.zeros((3, max(SIZES)), np.int32)
  for c, n in enumerate(SIZES):
    idx[c, :n] = cd.train_idx[c, :n]
  dd = DeviceData(jnp.asarray(ds.images), jnp.asarray(ds.labels), jnp.asarray(idx),
                  jnp.asarray(SIZES), jnp.asarray(idx), jnp.asarray(SIZES))
  config = config_lib.base_config('cifar10')
  model = models.make_model('cnn5', 10, 'im2col', feature_dim=config.model.feature_dim)
  params = jax.vmap(lambda k: models.init_params(model, k))(
      jax.random.split(jax.random.PRNGKey(0), 3))
  keys = jax.random.split(jax.random.PRNGKey(1), 3)
  method = standalone.Standalone(config, 3, 10)

  def local(params, key, idx, n, dd):
    trainable, _, stats = training.local_train({'model': params}, None, key, idx, n, dd,
                                               apply_fn=model.apply, cfg=cfg, method=method)
    return trainable['model'], stats
  return dd, model, params, keys, local


def plain_dp_sgd(params, key, idx_row, n, ds, apply_fn, cfg):
  """DP-SGD written out for one client: per step, each position taken with probability
  min(1, B / n) (the step's uniform draws), each taken example's CE gradient clipped to C,
  their sum plus noise from the step's keys, over min(n, B); then torch-style SGD."""
  images = np.asarray(augment.normalize(ds.images, cfg.mean, cfg.std))
  b, dp = cfg.batch_size, cfg.dp
  padded = -(-len(idx_row) // b) * b
  q = min(1.0, np.float32(b) / np.float32(n))
  grad_one = jax.jit(jax.grad(lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(
      apply_fn({'params': p}, x[None])[0], y[None]).mean()))
  buf = jax.tree.map(np.zeros_like, params)
  steps = 0
  for e in range(cfg.local_epochs):
    _, k_aug = jax.random.split(jax.random.fold_in(key, e))
    for s in range(-(-n // b)):
      steps += 1
      step_key = jax.random.fold_in(k_aug, s)
      u = np.asarray(jax.random.uniform(jax.random.fold_in(step_key, StepStream.POISSON),
                                        (padded,)))
      taken = np.flatnonzero((u < q) & (np.arange(padded) < n))
      total = jax.tree.map(np.zeros_like, params)
      for pos in taken:
        g = grad_one(params, images[idx_row[pos]], ds.labels[idx_row[pos]])
        norm = math.sqrt(sum(float(np.sum(np.square(v))) for v in jax.tree.leaves(g)))
        total = jax.tree.map(lambda t, v: t + np.asarray(v) * min(1.0, dp.clip_norm / norm),
                             total, g)
      leaves, tree = jax.tree.flatten(total)
      noise_key = jax.random.fold_in(step_key, StepStream.NOISE)
      g = jax.tree.unflatten(tree, [
          (v + dp.noise_multiplier * dp.clip_norm * np.asarray(
              jax.random.normal(jax.random.fold_in(noise_key, i), v.shape))) / min(n, b)
          for i, v in enumerate(leaves)])
      d = jax.tree.map(lambda gi, p: gi + cfg.weight_decay * p, g, params)
      buf = jax.tree.map(lambda m, di: cfg.momentum * m + di, buf, d)
      params = jax.tree.map(lambda p, m: p - cfg.lr * m, params, buf)
  return params, steps


@pytest.mark.slow  # local training compiled, vmapped, and a plain loop
def test_dp_sgd_local_training_vmapped_equals_a_plain_loop(small_ds):
  dp = privacy.DPSGD(clip_norm=0.5, noise_multiplier=0.8, max_batch=16, pass_size=8)
  cfg = training.TrainConfig(batch_size=8, local_epochs=2, lr=0.05, augment=False,
                             clip_norm=0.0, weight_decay=1e-2, mean=small_ds.mean,
                             std=small_ds.std, dp=dp)
  dd, model, params, keys, local = dp_setup(small_ds, cfg)
  got, stats = jax.jit(jax.vmap(local, in_axes=(0, 0, 0, 0, None)))(
      params, keys, dd.train_idx, dd.train_n, dd)
  np.testing.assert_array_equal(stats.steps, [4, 0, 2])  # every step counts, E ceil(n / B)
  for c in (0, 2):
    p_c = jax.tree.map(lambda x: x[c], params)
    want, steps = plain_dp_sgd(p_c, keys[c], np.asarray(dd.train_idx[c]), SIZES[c],
                               small_ds, model.apply, cfg)
    assert steps == int(stats.steps[c])
    for a, b in zip(jax.tree.leaves(jax.tree.map(lambda x: x[c], got)), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-5)
  assert stats.samples[2] == 2 * SIZES[2]  # q = 1: every sample, every step
  # The empty client is unchanged.
  for a, b in zip(jax.tree.leaves(jax.tree.map(lambda x: x[1], got)),
                  jax.tree.leaves(jax.tree.map(lambda x: x[1], params))):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # a simulator's models built
def test_a_simulator_of_models_with_batch_norm_is_refused(small_ds):
  from conftest import make_small_sim
  with pytest.raises(ConfigError, match='batch norm do not give: resnet4'):
    make_small_sim(small_ds, 'fedssa', **{'privacy.dp_sgd': True,
                                          'model.families': ('resnet4', 'fedavgcnn')})


@pytest.mark.slow  # simulators compiled and run
@pytest.mark.parametrize('method', ['fml', 'fd'])  # a jointly trained meme; a private release
def test_a_method_with_a_second_model_or_a_release_trains_under_dp_sgd(few_images, method):
  """Every method that DP-SGD applies to ran two such rounds by hand (docs: the closing note);
  these two keep the paths that differ from plain CE: an aux model's gradient clipped with the
  client's own, and a private release of class sums (FD's logits), which the server receives as
  the trained model's forward pass over the training split, clipped and noised, by hand. FML's
  two models: ghost norms (the default) and each example's gradient built
  (privacy.per_example='vmap') train the same round."""
  small_ds = few_images  # 20 training images a client
  from conftest import make_small_sim, params_of, rounds
  modes = ('auto', 'vmap') if method == 'fml' else ('auto',)
  sims = {mode: make_small_sim(small_ds, method, **{'privacy.dp_sgd': True,
                                                      'privacy.per_example': mode})
          for mode in modes}
  assert sims['auto'].train_cfg.dp.per_example == 'auto'
  sim = sims['auto']
  start = sim.init_state()
  before = {k: params_of(sim, start.population.params, k) for k in range(5)}
  for state, info in rounds(sim, 1, sim.init_state()):
    n = sim.train_n[0][info.cohort]
    np.testing.assert_array_equal(info.train_steps, -(-n // 16))  # E ceil(n / B), E = 1
    assert np.isfinite(info.train_loss)
  moved = [k for k in info.cohort
           if not np.allclose(jax.tree.leaves(params_of(sim, state.population.params, k))[0],
                              jax.tree.leaves(before[k])[0])]
  assert moved == list(info.cohort)
  if method == 'fd':
    fd_upload_by_hand(sim, state, info)
  if 'vmap' not in sims:
    return
  (built, built_info), = rounds(sims['vmap'], 1, sims['vmap'].init_state())
  np.testing.assert_allclose(built_info.train_loss, info.train_loss, rtol=1e-5)
  for k in info.cohort:
    for a, b in zip(jax.tree.leaves(params_of(sim, state.population.params, k)),
                    jax.tree.leaves(params_of(sim, built.population.params, k))):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def fd_upload_by_hand(sim, state, info):
  """Each participant's FD upload: its trained model's logits over its training split, each
  clipped to C_r / sqrt2, summed per class with C_r / sqrt2 a count; N(0, (z C_r)^2) from its
  release key (the count's leaf 0, the sums' 1); the counts times sqrt2 / C_r; the means of its
  held classes."""
  from conftest import params_of
  dp, d = sim.train_cfg.dp, sim.seed_data[0]
  assert dp.release_noise_multiplier == sim.privacy.noise_multiplier == 1.0
  half, std = dp.release_clip / math.sqrt(2), dp.release_noise_multiplier * dp.release_clip
  server = jax.tree.map(lambda a: np.asarray(a[0]), state.server)
  g = sim.groups[0]
  for k in info.cohort:
    idx = np.asarray(d.train_idx[k][:int(d.train_n[k])])
    x = augment.normalize(d.images[idx], sim.train_cfg.mean, sim.train_cfg.std)
    logits = np.asarray(g.eval_model.apply({'params': params_of(sim, state.population.params,
                                                                 k)}, x)[0], np.float64)
    y = np.asarray(d.labels)[idx]
    sums, counts = np.zeros((10, 10)), np.zeros(10)
    for v, c in zip(logits, y):
      sums[c] += v * min(1.0, half / np.linalg.norm(v))
      counts[c] += half
    key = privacy.release_keys(sim.root_keys[0], 0, jnp.array([k]))[0]
    noise = lambda i, shape: std * np.asarray(jax.random.normal(jax.random.fold_in(key, i),
                                                                shape))
    counts = (counts + noise(0, (10,))) * math.sqrt(2) / dp.release_clip
    sums = sums + noise(1, (10, 10))
    held = sim.seen[0, k] & (counts > 0)
    want = np.where(held[:, None], sums / np.maximum(counts, 1.0)[:, None], 0.0)
    np.testing.assert_allclose(server.uploads[k], want, rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(server.uploads_has[k], held)


def test_a_method_whose_loss_reads_parameters_directly_builds_each_gradient(small_ds):
  """FedMRL applies a header to a representation it builds itself: its DP-SGD builds each
  example's gradient, whatever privacy.per_example says (Method.ghost_norms)."""
  from conftest import make_small_sim
  sim = make_small_sim(small_ds, 'fedmrl', **{'privacy.dp_sgd': True})
  assert sim.train_cfg.dp.per_example == 'vmap'


# --- Runs -------------------------------------------------------------------------------------
def tiny(**overrides):
  c = config_lib.build('cifar10', 'hetero,tiny')
  c.model.families = ('cnn5',)
  c.num_clients, c.participation, c.num_rounds = 5, 0.4, 3
  c.privacy.dp_sgd, c.privacy.noise_multiplier, c.privacy.clip_norm = True, 1.1, 1.0
  # and client-level DP on FedSSA's header rows, accounted beside DP-SGD
  c.privacy.upload, c.privacy.upload_noise_multiplier, c.privacy.upload_clip = True, 2.0, 5.0
  c.update_from_flattened_dict(overrides)
  return c


def records(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(l) for l in f]


class RoundCounter(observers.Observer):
  """An observer of the test's own, beside the accountants: it counts the rounds it sees and
  the participants, and adds the counts to every output."""
  name = 'round_counter'

  def initial(self):
    return {'rounds': 0, 'participants': 0}

  def observe(self, i, info, state):
    return {'rounds': state['rounds'] + 1, 'participants': state['participants'] + len(info.cohort)}

  def record(self, i, info, state):
    return {'observed_rounds': state['rounds'], 'observed_participants': state['participants']}

  def summary(self, state, history):
    return {'observed_rounds': state['rounds']}

  def derived(self, i):
    return {'observed_seed_index': i}


@pytest.mark.slow  # whole runs, compiled
def test_a_run_reports_epsilon_resumes_exactly_and_ends_at_its_budget(tmp_path, few_images,
                                                                      monkeypatch):
  small_ds = few_images  # 20 training images a client
  # The loop reaches the accountants only through its observers, as it reaches any other.
  accountants = observers.watching
  monkeypatch.setattr(observers, 'watching', lambda sim: [*accountants(sim), RoundCounter()])
  whole = str(tmp_path / 'whole')
  summary = train.train_and_evaluate(tiny(), whole, dataset=small_ds)
  recs = records(whole)
  assert [r['observed_rounds'] for r in recs] == [1, 2, 3] and summary['observed_rounds'] == 3
  assert recs[-1]['observed_participants'] == sum(len(r['participants']) for r in recs)
  eps = [r['dp_epsilon'] for r in recs]
  assert len(eps) == 3 and 0 < eps[0] <= eps[1] <= eps[2]
  assert summary['dp_epsilon'] == eps[-1] and not summary['privacy_budget_reached']
  with open(os.path.join(whole, 'config.json')) as f:
    derived = json.load(f)['derived']
  assert derived['dp_noise_multiplier'] == 1.1 and derived['dp_max_batch'] > 16
  # The uploads' epsilon: the largest client's, from the uploads it sent (local mode).
  sent = np.zeros(5, int)
  for r in recs:
    sent[r['participants']] += 1
    assert r['dp_upload_epsilon'] == pytest.approx(
        privacy.upload_epsilon('rdp', 2.0, int(sent.max()), 1e-5), rel=1e-12)
  assert summary['dp_upload_epsilon'] == recs[-1]['dp_upload_epsilon']
  assert all(0 <= r['dp_upload_clipped'] <= 1 and r['dp_upload_norm_median'] > 0 for r in recs)
  assert derived['dp_upload_noise_multiplier'] == 2.0 and derived['observed_seed_index'] == 0

  # Stopped after round 1 and resumed: the same records.
  split = str(tmp_path / 'split')
  train.train_and_evaluate(tiny(num_rounds=1), split, dataset=small_ds)
  train.train_and_evaluate(tiny(), split, dataset=small_ds)
  for a, b in zip(records(split), recs):
    for k in ('dp_epsilon', 'dp_upload_epsilon', 'mean_accuracy', 'train_loss',
              'participants', 'observed_rounds', 'observed_participants'):
      assert a[k] == b[k], k

  # A budget between round 1's epsilon and round 3's ends the run before a round could pass it.
  target = (eps[0] + eps[-1]) / 2
  budget = str(tmp_path / 'budget')
  summary = train.train_and_evaluate(tiny(**{'privacy.target_epsilon': target}), budget,
                                     dataset=small_ds)
  assert summary['privacy_budget_reached'] and summary['rounds'] < 3
  assert summary['dp_epsilon'] <= target
  assert os.path.exists(os.path.join(budget, 'summary.json'))


# --- Client-level DP on the uploads -----------------------------------------------------------
def upload_section(**fields):
  p = privacy.default_config()
  p.update(dict(upload=True, **fields))
  return p


def refusal_of(method, **overrides):
  c = config_lib.base_config('cifar10')
  c.method = method
  c.update_from_flattened_dict(overrides)
  from fedssa_jax import methods
  return lambda mode: methods.METHODS[method].upload_refusal(c, mode)


@pytest.mark.parametrize('fields, method, overrides, says', [
    (dict(upload_clip=0.0), 'fedssa', {}, 'privacy.upload_clip must be > 0'),
    (dict(upload_noise_multiplier=-1.0), 'fedssa', {}, 'upload_noise_multiplier must be >= 0'),
    (dict(upload_noise_multiplier=0.0), 'fedssa', {}, 'no epsilon is finite'),
    (dict(upload_target_epsilon=4.0), 'fedssa', {}, 'set privacy.upload_noise_multiplier=0'),
    (dict(upload_mode='both'), 'fedssa', {}, 'Unknown privacy.upload_mode'),
    ({}, 'standalone', {}, 'clients send nothing to protect. Turn privacy.upload off'),
    ({}, 'fedkd', {}, "truncated SVD of the update, which noise on it would make dense (central "
                      "noise leaves the clipped uploads low-rank). Use privacy.upload_mode="
                      "'central'"),
    (dict(upload_mode='central'), 'fedgh', {}, "keeps each upload apart, not one sum of them "
                                               "that noise could cover. Use "
                                               "privacy.upload_mode='local'"),
    (dict(upload_mode='central'), 'fedssa', {}, "set fedssa.scope='participants' for it"),
    (dict(upload_mode='central'), 'lg_fedavg', {},
     "set lg_fedavg.weighting='uniform' for it"),
    (dict(upload_mode='central'), 'fedmrl', {}, "set fedmrl.aggregation='uniform' for it"),
])
def test_bad_upload_input_is_a_config_error_naming_the_fix(fields, method, overrides, says):
  with pytest.raises(ConfigError) as e:
    privacy.check_config(upload_section(**fields), method, True,
                         refusal_of(method, **overrides))
  assert says in str(e.value)


@pytest.mark.parametrize('method, overrides, mode', [
    ('fedssa', {'fedssa.scope': 'participants'}, 'central'), ('fml', {}, 'central'),
    ('fml', {}, 'local'), ('lg_fedavg', {'lg_fedavg.weighting': 'uniform'}, 'central'),
    ('fedkd', {}, 'central'), ('fd', {}, 'local'), ('fd', {}, 'central'), ('fedgh', {}, 'local'),
    ('fedproto', {}, 'central'),
])
def test_what_each_method_accepts(method, overrides, mode):
  privacy.check_config(upload_section(upload_mode=mode), method, True,
                       refusal_of(method, **overrides))


@struct.dataclass
class Payload:
  count: jax.Array  # metadata: sent as it is
  rows: jax.Array
  model: dict


def test_a_privatized_upload_is_the_clipped_delta_plus_noise_by_hand():
  rng = np.random.default_rng(0)
  payload = Payload(count=jnp.asarray([3.0, 0.0]), rows=jnp.asarray(rng.normal(size=(2, 3))),
                    model={'b': jnp.asarray(rng.normal(size=4)),
                           'w': jnp.asarray(rng.normal(size=(2, 2)))})
  reference = {'rows': jnp.asarray(rng.normal(size=(2, 3))),
               'model': {'b': jnp.zeros(4), 'w': jnp.ones((2, 2))}}
  key = jax.random.PRNGKey(7)
  out, pre_clip = privacy.privatize_upload(payload, reference, key, fields=('model', 'rows'),
                                           clip_norm=0.5, std=0.3)
  # By hand: the delta over both fields, its global norm, the clip, then the noise of each leaf
  # in the order of the fields' tree ({'model': {'b', 'w'}, 'rows'}).
  deltas = [np.asarray(payload.model['b']), np.asarray(payload.model['w']) - 1.0,
            np.asarray(payload.rows) - np.asarray(reference['rows'])]
  norm = math.sqrt(sum(float((d ** 2).sum()) for d in deltas))
  assert norm > 0.5 and float(pre_clip) == pytest.approx(norm, rel=1e-6)  # the clip binds
  noise = [0.3 * np.asarray(jax.random.normal(jax.random.fold_in(key, i), d.shape))
           for i, d in enumerate(deltas)]
  want = [d * 0.5 / norm + n for d, n in zip(deltas, noise)]
  np.testing.assert_allclose(out.model['b'], want[0], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(out.model['w'], 1.0 + want[1], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(out.rows, np.asarray(reference['rows']) + want[2], rtol=1e-6,
                             atol=1e-6)
  np.testing.assert_array_equal(out.count, payload.count)
  # No noise and no clip: the upload as it was.
  same, _ = privacy.privatize_upload(payload, reference, key, fields=('model', 'rows'),
                                     clip_norm=math.inf, std=0.0)
  for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(payload)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_the_upload_accountants_epsilon_is_the_librarys_for_the_same_mechanism():
  local = privacy.UploadAccountant(upload_section(upload_noise_multiplier=4.0), 10, 3, 20)
  eps = local.epsilons([0, 1, 5, 5])
  assert eps[0] == 0.0 and eps[2] == eps[3] and 0 < eps[1] < eps[2]
  lib = rdp_privacy_accountant.RdpAccountant()
  for _ in range(5):  # each release: a Gaussian mechanism of sensitivity 2 C, std 4 C
    lib.compose(dp_accounting.GaussianDpEvent(2.0))
  assert eps[2] == pytest.approx(lib.get_epsilon(1e-5), rel=1e-9)
  central = privacy.UploadAccountant(
      upload_section(upload_mode='central', upload_noise_multiplier=4.0), 10, 3, 20)
  lib = rdp_privacy_accountant.RdpAccountant(
      neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
  for _ in range(5):  # a cohort of 3 of 10, drawn without replacement, each round
    lib.compose(dp_accounting.SampledWithoutReplacementDpEvent(
        10, 3, dp_accounting.GaussianDpEvent(2.0)))
  assert central.epsilons([5] * 10)[0] == pytest.approx(lib.get_epsilon(1e-5), rel=1e-9)
  assert central.epsilons([5] * 10)[0] < eps[2]  # the cohort's sampling amplifies
  with pytest.raises(ConfigError, match="does not take: use privacy.accountant='rdp'"):
    privacy.UploadAccountant(upload_section(upload_mode='central', accountant='pld'), 10, 3, 20)


def test_central_mode_drops_the_amplification_where_clients_have_unequal_chances(caplog):
  """A client online more often than the others is in more cohorts than K of N drawn uniformly:
  with a spread of availability (or a trace) the rounds are accounted without sampling."""
  from fedssa_jax.engine import uplink  # pylint: disable=g-import-not-at-top
  c = config_lib.base_config('cifar10')
  c.num_rounds = 20
  c.privacy = upload_section(upload_mode='central', upload_noise_multiplier=4.0,
                             accountant='rdp')
  c.system.availability = 0.8
  uniform = uplink.upload_accountant(c, 10, 3)  # the same chances for all: amplified
  assert uniform.cohort == 3 and not caplog.records
  c.system.availability_spread = 0.1
  unequal = uplink.upload_accountant(c, 10, 3)
  assert unequal.cohort == 0 and 'without amplification' in caplog.text
  eps = unequal.epsilons([5] * 10)[0]
  assert eps == pytest.approx(privacy.upload_epsilon('rdp', 4.0, 5, 1e-5))
  assert eps > uniform.epsilons([5] * 10)[0]
  c.system.availability_spread, c.system.availability_trace = 0.0, 'trace.npy'
  assert uplink.upload_accountant(c, 10, 3).cohort == 0
  c.privacy.upload_mode = 'local'  # no amplification to drop
  assert uplink.upload_accountant(c, 10, 3).epsilons([5])[0] == unequal.epsilons([5])[0]


def test_upload_calibration_meets_the_target_at_num_rounds():
  for mode in privacy.UPLOAD_MODES:
    a = privacy.UploadAccountant(upload_section(
        upload_mode=mode, upload_noise_multiplier=0.0, upload_target_epsilon=4.0), 10, 3, 20)
    eps = a.epsilons([20])[0]
    assert eps <= 4.0 and eps == pytest.approx(4.0, abs=0.01)
    assert a.std == a.noise_multiplier * 1.0


@pytest.mark.slow  # two simulators compiled and run
@pytest.mark.parametrize('mode', privacy.UPLOAD_MODES)
def test_fedssas_server_gets_the_privatized_rows_of_a_plain_round(small_ds, mode):
  """A round of FedSSA under client-level DP, against the same round without it, by hand: the
  server's table holds each participant's rows around the global rows it fused, clipped (and,
  in local mode, noised with its own key); in central mode each global row moves by the noised
  sum of the updates (rows less that global row) over the count fixed in advance, and the
  global row itself is not scaled by the round's share of owners."""
  from conftest import make_small_sim, rounds
  from fedssa_jax.engine import snapshots
  clip, z = 0.5, 0.7
  common = {'fedssa.scope': 'participants'}
  plain = make_small_sim(small_ds, 'fedssa', **common)
  start = snapshots.seed_state(plain.store, plain.init_state()).server
  (state, info), = rounds(plain, 1)
  table = np.asarray(snapshots.seed_state(plain.store, state).server.table)
  sim = make_small_sim(small_ds, 'fedssa', **common, **{
      'privacy.upload': True, 'privacy.upload_mode': mode, 'privacy.upload_clip': clip,
      'privacy.upload_noise_multiplier': z})
  (state, dp_info), = rounds(sim, 1)
  server = snapshots.seed_state(sim.store, state).server
  np.testing.assert_array_equal(dp_info.cohort, info.cohort)
  seen, g0 = sim.seen[0], np.asarray(start.global_rows)
  want, norms = {}, {}
  for k in info.cohort:
    reference = np.where((seen[k] & np.asarray(start.avail))[:, None], g0, 0.0)
    delta = table[k] - reference
    scale = min(1.0, clip / np.linalg.norm(delta))
    noise = 0.0
    if mode == 'local':
      key = jax.random.fold_in(privacy.upload_keys(sim.root_keys[0], 0, jnp.array([k]))[0], 0)
      noise = z * clip * np.asarray(jax.random.normal(key, delta.shape))
    want[k] = reference + delta * scale + noise
    norms[k] = np.linalg.norm(delta)
    np.testing.assert_allclose(np.asarray(server.table[k]), want[k], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dp_info.upload_norms, [norms[k] for k in info.cohort], rtol=1e-5)
  if mode == 'central':
    noise = z * clip * np.asarray(jax.random.normal(
        privacy.server_upload_key(sim.root_keys[0], 0), g0.shape))
    reference = np.where(np.asarray(start.avail)[:, None], g0, 0.0)  # what every owner fused
    updates = sum(np.where(seen[k][:, None], want[k] - reference, 0.0) for k in info.cohort)
    expected = 2 / 5 * seen.sum(axis=0)  # q = K / N, times the owners of each class
    assert (seen[info.cohort].sum(axis=0) != expected).any()  # a share that would scale g0
    np.testing.assert_allclose(np.asarray(server.global_rows),
                               reference + (updates + noise) / expected[:, None],
                               rtol=1e-5, atol=1e-5)


# Each method's payload fields and reference, on one client without training: the reference is
# what the server sent (the global model it downloaded), so a client that changed nothing
# uploads exactly it, and without noise its privatized upload is its upload.
REFERENCES = {  # method: (its private fields, where its reference comes from in the server)
    'fml': lambda server: {'meme': server.meme},
    'lg_fedavg': lambda server: {'value': server.global_header},
    'fedmrl': lambda server: {'value': server.shared},
    'fedssa': lambda server: {'rows': jnp.where(server.avail[:, None], server.global_rows, 0.0)},
}


@pytest.mark.parametrize('method', sorted(REFERENCES))
def test_each_methods_reference_is_what_its_client_downloaded(method):
  from conftest import client_view
  from fedssa_jax import methods
  c = config_lib.base_config('cifar10')
  cls = methods.METHODS[method]
  m = cls(c, 3, 4)
  seen = jnp.ones(4, bool)  # every class: FedSSA's reference covers every row
  server = m.init_server(jax.random.PRNGKey(0), jnp.ones((3, 4), bool))
  params = models.init_params(models.make_model('cnn5', 4, 'im2col', feature_dim=m.feature_dim),
                              jax.random.PRNGKey(1))
  view = client_view(0, seen, 10)
  state = m.init_client_state(jax.random.PRNGKey(2))
  down = m.download(params, state, server, view)
  reference = m.upload_reference(server, down, view)
  for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(REFERENCES[method](server))):
    np.testing.assert_array_equal(a, b)
  if method == 'fedssa':  # FedSSA's fused rows are not the global ones while mu_t > 0
    return
  trainable = {'model': down.params, **down.aux}
  up = m.upload(trainable, methods.Accumulated(), down.ctx, state, view)
  for f in m.private_upload:  # nothing trained: the upload is the reference
    for a, b in zip(jax.tree.leaves(getattr(up.payload, f)), jax.tree.leaves(reference[f])):
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('method', ['fml', 'fedkd', 'lg_fedavg', 'fedmrl'])
def test_central_noise_lands_on_the_inbox_sum_and_its_mean(method):
  from fedssa_jax import methods
  from fedssa_jax.methods import aggregation
  c = config_lib.base_config('cifar10')
  m = methods.METHODS[method](c, 3, 4)
  server = m.init_server(jax.random.PRNGKey(0), jnp.ones((3, 4), bool))
  key = jax.random.PRNGKey(5)
  noised = m.central_noise(server, key, 0.25)
  want = aggregation.add_gaussian(server.inbox.sum, key, 0.25)
  for a, b, s in zip(jax.tree.leaves(noised.inbox.sum), jax.tree.leaves(want),
                     jax.tree.leaves(server.inbox.sum)):
    np.testing.assert_array_equal(a, b)
    assert np.std(np.asarray(a) - np.asarray(s)) == pytest.approx(0.25, rel=0.2) or a.size < 50
  assert noised.inbox.weight == server.inbox.weight


def test_fds_central_rule_is_the_noised_sum_over_a_fixed_count_by_hand():
  """FD under central DP: the server's class sums of the round's clipped logits plus its noise,
  over q times each class's owners (q = K / N), whoever took part; a client's targets are those."""
  from fedssa_jax.methods import fd
  c = config_lib.base_config('cifar10')
  c.num_clients, c.participation = 4, 0.5  # K = 2 of 4: q = 0.5
  c.privacy.upload, c.privacy.upload_mode = True, 'central'
  m = fd.FD(c, 4, 3)
  seen = np.array([[1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, 0]], bool)  # owners 3, 3, 2
  server = m.init_server(jax.random.PRNGKey(0), jnp.asarray(seen))
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 3, 3)).astype(np.float32)
  has = seen[[0, 2]]
  server = m.server_receive(server, jnp.array([0, 2]), fd.FDUpload(
      logits=jnp.asarray(logits * has[:, :, None]), has=jnp.asarray(has)), jnp.array([True, True]))
  key = jax.random.PRNGKey(3)
  server = m.central_noise(server, key, 0.4)
  agg = m.server_aggregate(server, jnp.array([True, False, True, False]), 0, None).server
  noise = 0.4 * np.asarray(jax.random.normal(key, (3, 3)))
  total = (logits * has[:, :, None]).sum(axis=0) + noise
  np.testing.assert_allclose(np.asarray(agg.sum), total, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(agg.cnt), [1.5, 1.5, 1.0])
  targets, avail = m.global_logits(agg, 1)
  np.testing.assert_allclose(np.asarray(targets), total / np.array([1.5, 1.5, 1.0])[:, None],
                             rtol=1e-6)
  assert np.asarray(avail).all() and not np.asarray(agg.noise).any()  # the noise is spent


def test_fedprotos_central_rule_is_the_noised_sum_over_a_fixed_count_by_hand():
  from fedssa_jax.methods import fedproto, prototypes
  c = config_lib.base_config('cifar10')
  c.num_clients, c.participation = 4, 0.5  # q = 0.5
  c.privacy.upload, c.privacy.upload_mode = True, 'central'
  m = fedproto.FedProto(c, 4, 3)
  seen = np.array([[1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 0, 0]], bool)  # owners 3, 2, 2
  server = m.init_server(jax.random.PRNGKey(0), jnp.asarray(seen))
  rng = np.random.default_rng(1)
  protos = rng.normal(size=(2, 3, m.feature_dim)).astype(np.float32) * seen[[0, 2], :, None]
  server = m.server_receive(server, jnp.array([0, 2]), prototypes.PrototypeUpload(
      protos=jnp.asarray(protos), n=jnp.asarray(seen[[0, 2]] * 5.0)), jnp.array([True, True]))
  key = jax.random.PRNGKey(4)
  server = m.central_noise(server, key, 0.3)
  agg = m.server_aggregate(server, jnp.array([True, False, True, False]), 0, None).server
  noise = 0.3 * np.asarray(jax.random.normal(key, (3, m.feature_dim)))
  want = (protos.sum(axis=0) + noise) / np.array([1.5, 1.0, 1.0])[:, None]
  np.testing.assert_allclose(np.asarray(agg.protos), want, rtol=1e-5, atol=1e-6)
  assert np.asarray(agg.avail).all() and not np.asarray(agg.noise).any()
  with pytest.raises(ConfigError, match="set fedproto.weighting='uniform' for it"):
    privacy.check_config(upload_section(upload_mode='central'), 'fedproto', True,
                         refusal_of('fedproto', **{'fedproto.weighting': 'samples'}))
