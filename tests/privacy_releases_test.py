"""DP-SGD's private releases (fedssa_jax/privacy/releases.py, docs/algorithm.md §11): what a
method sends of the data beyond the DP-SGD steps, released by a Gaussian mechanism and composed
with the steps by the accountant.

Fast: the class-sums release (clip, table, noise, decoded counts) against numpy by hand, with
the noise from the same keys, and its sensitivity; the class counts a server reads, by hand,
and FedGen's simulator reading them;
each covered method's released values and its switch to one forward pass; the refusals; the
composed epsilon against dp_accounting's for the same events; calibration over the composition;
a checkpoint's state without releases.
Slow: one whole FedProto run under DP-SGD whose recorded epsilon is the composed one.
"""
import json
import math
import os

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant

from fedssa_jax import config_lib, data, methods, privacy
from fedssa_jax.errors import ConfigError
from fedssa_jax.run import observers, train
from fedssa_jax.streams import RELEASE_AT_START, Stream

C_R, Z_R, CLASSES = 2.0, 0.7, 3


def small_batch():
  rng = np.random.default_rng(0)
  values = rng.normal(size=(6, 4)).astype(np.float32) * np.array([[0.2], [3], [1], [5], [0.1],
                                                                 [2]], np.float32)
  y = np.array([0, 2, 0, 1, 2, 1], np.int32)
  valid = np.array([1, 1, 1, 1, 1, 0], bool)
  return values, y, valid


def table_by_hand(values, y, valid, clip):
  """[C, D + 1]: each valid example's [v min(1, (C/sqrt2) / |v|), C/sqrt2] in its class's row."""
  half = clip / math.sqrt(2)
  table = np.zeros((CLASSES, values.shape[1] + 1))
  for v, c, ok in zip(values.astype(np.float64), y, valid):
    if ok:
      table[c, :-1] += v * min(1.0, half / np.linalg.norm(v))
      table[c, -1] += half
  return table


def test_the_class_sums_release_is_the_clipped_table_plus_noise_by_hand():
  values, y, valid = small_batch()
  table = privacy.class_table(jnp.asarray(values), jnp.asarray(y), jnp.asarray(valid),
                              num_classes=CLASSES, clip=C_R)
  want = table_by_hand(values, y, valid, C_R)
  np.testing.assert_allclose(table.sum, want[:, :-1], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(table.count, want[:, -1], rtol=1e-6)
  # The noise: std z C on every coordinate, the count leaf's from fold_in(key, 0), the sums'
  # from fold_in(key, 1) (ClassSums' leaves: count, sum); the counts then back in examples.
  key = privacy.release_keys(jax.random.PRNGKey(3), 4, jnp.array([7]))[0]
  hand_key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(
      jax.random.PRNGKey(3), Stream.RELEASE), 4), 7)
  np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(hand_key))
  out = privacy.release_class_sums(table, key, privacy.Release(C_R, Z_R))
  noise = lambda i, shape: Z_R * C_R * np.asarray(
      jax.random.normal(jax.random.fold_in(key, i), shape))
  np.testing.assert_allclose(out.sum, want[:, :-1] + noise(1, (CLASSES, 4)), rtol=1e-5,
                             atol=1e-5)
  counts = (want[:, -1] + noise(0, (CLASSES,))) * math.sqrt(2) / C_R
  np.testing.assert_allclose(out.count, counts, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(counts - noise(0, (CLASSES,)) * math.sqrt(2) / C_R, [2, 1, 2],
                             atol=1e-5)  # the noiseless counts are the examples per class


def test_one_example_moves_the_table_by_at_most_the_clip():
  values, y, valid = small_batch()
  full = table_by_hand(values, y, valid, C_R)
  for i in np.flatnonzero(valid):
    fewer = valid.copy()
    fewer[i] = False
    moved = np.linalg.norm(full - table_by_hand(values, y, fewer, C_R))
    assert moved <= C_R + 1e-9
  big = valid & (np.linalg.norm(values, axis=1) > C_R / math.sqrt(2))
  assert big.any()  # those examples move it by exactly C
  i = np.flatnonzero(big)[0]
  fewer = valid.copy()
  fewer[i] = False
  assert np.linalg.norm(full - table_by_hand(values, y, fewer, C_R)) == pytest.approx(C_R)


def test_the_class_counts_release_is_the_counts_plus_noise_floored_by_hand():
  counts = np.array([[[3, 0, 1], [0, 5, 0]]], np.float32)  # [R=1, N=2, C=3]
  root = jax.random.PRNGKey(11)
  out = privacy.noisy_class_counts(counts, root[None], Z_R)
  for k in range(2):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(root, Stream.RELEASE),
                                                RELEASE_AT_START), k)
    want = np.maximum(counts[0, k] + Z_R * np.asarray(jax.random.normal(key, (3,))), 0.0)
    np.testing.assert_allclose(out[0, k], want, rtol=1e-6)
  assert (out >= 0).all()


# --- The methods ------------------------------------------------------------------------------
def method_under_dp(name, **overrides):
  c = config_lib.base_config('cifar10')
  c.method, c.privacy.dp_sgd = name, True
  c.update_from_flattened_dict(overrides)
  return methods.get_method(name)(c, 5, 10)


@pytest.mark.parametrize('name, released', [
    ('fd', 'logits'), ('fedproto', 'rep'), ('fedtgp', 'rep'), ('fedgh', 'rep'), ('fedsa', 'rep'),
    ('fedorgp', 'rep')])
def test_each_covered_method_releases_its_class_means_from_one_forward_pass(name, released):
  logits, rep = jnp.ones((2, 10)), 2 * jnp.ones((2, 500))
  m = method_under_dp(name)
  got = m.release_values(logits, rep)
  assert got is (logits if released == 'logits' else rep)
  assert m.forward_pass == 'after' and m.init_acc() is None  # no training-pass sums
  assert getattr(m, 'proto_source', 'post_pass') == 'post_pass'
  assert privacy.releases_of(m) == (1, 0, 1.0)
  plain = config_lib.base_config('cifar10')
  plain.method = name
  off = methods.get_method(name)(plain, 5, 10)  # without DP-SGD: as it always was
  if name in ('fd', 'fedproto', 'fedsa'):
    assert off.forward_pass is None and off.init_acc() is not None
  assert method_under_dp('fedtgp', **{'fedtgp.proto_timing': 'pre_train'}).forward_pass == 'before'


def test_fedgens_class_counts_are_a_release_at_the_start(small_ds):
  """The counts FedGen's server reads for its prior are the clients' counts, noised by hand
  with the seed's release keys (a simulator built, nothing run)."""
  from conftest import make_small_sim
  from fedssa_jax.engine import parts
  assert privacy.releases_of(method_under_dp('fedgen')) == (0, 1, 1.0)
  assert privacy.releases_of(method_under_dp('fedssa')) == (0, 0, 1.0)
  sim = make_small_sim(small_ds, 'fedgen', **{'privacy.dp_sgd': True,
                                              'privacy.release_noise_multiplier': 3.0})
  exact = parts.class_counts(small_ds.labels, data.partition_from_config(sim.config, small_ds),
                             10)[None]
  want = privacy.noisy_class_counts(exact, jax.random.PRNGKey(sim.seeds[0])[None], 3.0)
  np.testing.assert_array_equal(sim.class_counts, want)
  assert np.abs(want - exact).max() > 1 and sim.privacy.releases_at_start == 1


@pytest.mark.parametrize('name, overrides, says', [
    ('fedorgp', {'orgp.filter_outliers': True},
     'privacy.dp_sgd does not apply to fedorgp: its outlier filter'),
    ('fedorgp', {'orgp.variant': 'repo_head'}, "set filter_outliers=False with variant='paper'"),
])
def test_a_method_no_release_bounds_is_refused_before_data_loads(name, overrides, says):
  c = config_lib.build('cifar10', 'hetero,tiny')
  c.method, c.privacy.dp_sgd = name, True
  c.update_from_flattened_dict(overrides)
  with pytest.raises(ConfigError) as e:
    config_lib.validate(c)
  assert says in str(e.value) and 'turn privacy.dp_sgd off' in str(e.value)
  c.privacy.dp_sgd = False
  config_lib.validate(c)  # off: allowed


def test_fedl2gs_meta_gradient_is_released_whole_clipped_and_noised_by_hand():
  """FedL2G under DP-SGD: the rows of every class it holds (not only the study batch's), the
  whole g_V clipped to C_r and noised with std z C_r from the release key (its leaf 0), the
  classes sent as they are; sensitivity 2 C_r, so the accountant's Gaussian is z / 2."""
  from fedssa_jax.methods import base, fedl2g
  m = method_under_dp('fedl2g', **{'fedl2g.variant': 'logit'})  # V guides the logits x w
  assert m.release_after_training and privacy.releases_of(m) == (1, 0, 2.0)
  seen = jnp.arange(10) < 4
  view = base.ClientView(id=jnp.int32(1), seen=seen, num_samples=jnp.int32(8),
                         round=jnp.int32(0))
  model = lambda variables, x: (x @ variables['params']['w'], x)
  rng = np.random.default_rng(0)
  params = {'w': jnp.asarray(rng.normal(size=(3, 10)), jnp.float32)}
  study = (jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), jnp.array([0, 1, 1, 0]),
           jnp.ones(4, bool))
  quiz = (jnp.asarray(rng.normal(size=(2, 3)), jnp.float32), jnp.array([2, 3]), jnp.ones(2, bool))
  vectors = fedl2g.GuidingVectors(vectors=jnp.asarray(rng.normal(size=(10, 10)), jnp.float32))
  out = m.after_training(model, {'model': params}, vectors, study, quiz, view)
  np.testing.assert_array_equal(out.present, seen)  # classes 2, 3: not in the study batch
  key = privacy.release_keys(jax.random.PRNGKey(0), 2, jnp.array([1]))[0]
  released = privacy.release_whole(out, key, fields=m.private_upload,
                                   release=privacy.Release(1e-4, Z_R))
  grad = np.asarray(out.grad, np.float64)
  want = grad * min(1.0, 1e-4 / np.linalg.norm(grad)) + Z_R * 1e-4 * np.asarray(
      jax.random.normal(jax.random.fold_in(key, 0), grad.shape))
  assert np.linalg.norm(grad) > 1e-4  # the clip acts
  np.testing.assert_allclose(released.grad, want, rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(released.present, seen)
  a = accountant((1, 0, 2.0), noise_multiplier=1.1, release_noise_multiplier=3.0)
  lib = rdp_privacy_accountant.RdpAccountant()
  lib.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.5), 4))
  assert a.epsilons(0, [0, 0, 0], [4, 0, 0])[0] == pytest.approx(lib.get_epsilon(1e-5),
                                                                rel=1e-9)


def test_the_release_fields_are_checked():
  p = privacy.default_config()
  p.release_clip = 0.0
  with pytest.raises(ConfigError, match='privacy.release_clip must be > 0'):
    privacy.check_config(p, 'fd', True)
  p.release_clip, p.release_noise_multiplier = 1.0, -1.0
  with pytest.raises(ConfigError, match='privacy.release_noise_multiplier must be >= 0'):
    privacy.check_config(p, 'fd', True)


# --- The accountant ---------------------------------------------------------------------------
def accountant(releases, train_n=(100, 40, 0), **fields):
  p = privacy.default_config()
  p.update(dict(dp_sgd=True, **fields))
  return privacy.Accountant(p, np.asarray([train_n]), batch_size=10, local_epochs=2,
                            num_rounds=5, releases=releases)


def test_the_composed_epsilon_is_the_librarys_for_the_same_events():
  a = accountant((1, 1), noise_multiplier=1.1, release_noise_multiplier=3.0)
  assert (a.noise_multiplier, a.release_noise_multiplier) == (1.1, 3.0)
  steps, releases = [40, 8, 0], [3, 2, 1]  # client 2 never trained: its release at the start
  eps = a.epsilons(0, steps, releases)
  for k, q in enumerate([np.float32(10) / np.float32(100), np.float32(10) / np.float32(40)]):
    lib = rdp_privacy_accountant.RdpAccountant()
    lib.compose(dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            float(q), dp_accounting.GaussianDpEvent(1.1)), steps[k]),
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(3.0), releases[k])]))
    assert eps[k] == pytest.approx(lib.get_epsilon(1e-5), rel=1e-9)
    assert eps[k] > a.epsilons(0, steps)[k]  # the releases cost
  lib = rdp_privacy_accountant.RdpAccountant()
  lib.compose(dp_accounting.GaussianDpEvent(3.0))
  assert eps[2] == pytest.approx(lib.get_epsilon(1e-5), rel=1e-9)
  # 0: the releases take DP-SGD's sigma.
  assert accountant((1, 0), noise_multiplier=1.1).release_noise_multiplier == 1.1


def test_calibration_covers_the_steps_and_the_releases():
  a = accountant((1, 0), (100, 0), noise_multiplier=0.0, target_epsilon=3.0)
  assert a.release_noise_multiplier == a.noise_multiplier
  full = a.round_steps[0] * 5
  eps = a.epsilons(0, full, [5, 0])
  assert eps.max() <= 3.0 and eps.max() == pytest.approx(3.0, abs=0.01)
  assert a.epsilons(0, full).max() < 2.9  # the steps alone: the releases took their share
  with pytest.raises(ConfigError, match='the private releases alone spend epsilon'):
    accountant((1, 0), (100, 0), noise_multiplier=0.0, target_epsilon=3.0,
               release_noise_multiplier=0.1)
  # A round that could take a client past the target counts its release too.
  c = accountant((1, 0), (100, 0), noise_multiplier=a.noise_multiplier, target_epsilon=3.0)
  four = a.round_steps[0] * 4
  assert c.next_round_exceeds(0, four, [0, 1], [4, 0]) is None
  assert c.next_round_exceeds(0, full, [0, 1], [5, 0]) is not None


def test_the_observer_counts_releases_and_derives_them_for_an_old_state():
  a = accountant((1, 1), noise_multiplier=1.1)
  c = config_lib.base_config('cifar10')
  obs = observers.DPSGDAccounting(a, 3, lambda t, i: np.arange(2), 16, c)
  state = obs.initial()
  assert state['releases'] == [1, 1, 1]
  info = type('Info', (), dict(cohort=np.array([0, 2]), train_steps=np.array([20, 0])))
  state = obs.observe(0, info, state)
  assert state['steps'] == [20, 0, 0] and state['releases'] == [2, 1, 2]
  old = {'steps': [40, 9, 0], 'budget_reached': False}  # a checkpoint without releases
  np.testing.assert_array_equal(obs.releases(0, old), [3, 3, 1])  # 2 and 2 rounds, + 1
  assert obs.record(0, info, old)['dp_epsilon'] == pytest.approx(
      a.epsilons(0, [40, 9, 0], [3, 3, 1]).max())


# --- A run --------------------------------------------------------------------------------------
@pytest.mark.slow  # a whole run, compiled
def test_a_prototype_runs_recorded_epsilon_is_the_composed_one(tmp_path, small_ds):
  c = config_lib.build('cifar10', 'hetero,tiny')
  c.method, c.model.families = 'fedproto', ('cnn5',)
  c.num_clients, c.participation, c.num_rounds = 5, 0.4, 2
  c.eval_batch_size = 16  # make_small_sim's: the evaluation programs of the other small runs
  c.privacy.dp_sgd, c.privacy.noise_multiplier, c.privacy.release_noise_multiplier = True, 1.1, 2.0
  workdir = str(tmp_path / 'run')
  summary = train.train_and_evaluate(c, workdir, dataset=small_ds)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    recs = [json.loads(line) for line in f]
  with open(os.path.join(workdir, 'config.json')) as f:
    derived = json.load(f)['derived']
  assert derived['dp_release_noise_multiplier'] == 2.0
  train_n = data.partition_from_config(c, small_ds).train_n
  steps, rounds_in = np.zeros(5, int), np.zeros(5, int)
  for r in recs:
    for k in r['participants']:
      steps[k] += c.local_epochs * -(-train_n[k] // c.batch_size)
      rounds_in[k] += 1
    eps = []
    for k in range(5):
      if not steps[k]:
        continue
      lib = rdp_privacy_accountant.RdpAccountant()
      lib.compose(dp_accounting.ComposedDpEvent([
          dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
              derived['dp_sampling_rate'][k], dp_accounting.GaussianDpEvent(1.1)),
              int(steps[k])),
          dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(2.0),
                                            int(rounds_in[k]))]))
      eps.append(lib.get_epsilon(c.privacy.delta))
    assert r['dp_epsilon'] == pytest.approx(max(eps), rel=1e-9)
  assert summary['dp_epsilon'] == recs[-1]['dp_epsilon'] and np.isfinite(recs[-1]['mean_accuracy'])
