"""FedSSA's stabilisation and class-wise aggregation against plain per-class loops, and whole
engine rounds (round 0 and its initial global header included) against a plain per-client loop."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, models

from fedssa_jax.engine import schedule, snapshots, training
from fedssa_jax.methods import base, fedssa
from fedssa_jax.streams import Stream

from conftest import aggregate, client_view, make_small_sim, params_of, rounds, synthetic_dataset

D = config_lib.base_config('cifar10').model.feature_dim  # d of the methods' configs


def test_mu_schedule_hand_computed():
  assert float(fedssa.mu_schedule(0, 0.5, 2)) == pytest.approx(0.5)
  assert float(fedssa.mu_schedule(1, 0.5, 2)) == pytest.approx(0.5 * math.cos(math.pi / 4))
  assert float(fedssa.mu_schedule(2, 0.5, 2)) == pytest.approx(0.0, abs=1e-7)
  assert float(fedssa.mu_schedule(3, 0.5, 2)) == 0.0
  assert float(fedssa.mu_schedule(10, 0.5, 45)) == pytest.approx(
      0.5 * math.cos(10 * math.pi / 90), rel=1e-6)
  assert float(fedssa.mu_schedule(0, 0.5, 0)) == pytest.approx(0.5)
  assert float(fedssa.mu_schedule(1, 0.5, 0)) == 0.0


@pytest.mark.parametrize('fusion', ['convex', 'reference'])
def test_stabilize_equals_per_class_loop(fusion):
  rng = np.random.default_rng(0)
  rows, g = rng.normal(size=(7, 501)), rng.normal(size=(7, 501))
  mask = rng.random(7) < 0.5
  mu = 0.3
  got = np.asarray(fedssa.stabilize(jnp.asarray(rows), jnp.asarray(g), jnp.asarray(mask), mu,
                                    fusion))
  want = rows.copy()
  for s in range(7):
    if mask[s]:
      want[s] = mu * rows[s] + ((1 - mu) if fusion == 'convex' else 1.0) * g[s]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def make_method(scope, n=6, s=5, fusion='convex'):
  c = config_lib.base_config('cifar10')
  c.fedssa.scope, c.fedssa.fusion = scope, fusion
  return fedssa.FedSSA(c, n, s)


@pytest.mark.parametrize('scope', ['all_owners', 'participants'])
def test_server_round_equals_per_class_loop(scope):
  n, s = 6, 5
  rng = np.random.default_rng(1)
  seen = rng.random((n, s)) < 0.5
  seen[:, 4] = False  # a class nobody owns
  method = make_method(scope, n, s)
  server = method.init_server(jax.random.PRNGKey(0), jnp.asarray(seen))
  prev_global = rng.normal(size=(s, 501)).astype(np.float32)
  server = server.replace(global_rows=jnp.asarray(prev_global),
                          avail=jnp.asarray([True, False, True, True, True]))
  # Round A: clients 0, 1, 2 upload; round B: clients 3, 4 upload (5 never does). A chunk
  # padded with a dummy (active False) must change nothing.
  table = np.zeros((n, s, 501), np.float32)
  uploaded = np.zeros(n, bool)
  for ids, active in (([0, 1, 2, 5], [True, True, True, False]), ([3, 4], [True, True])):
    up = rng.normal(size=(len(ids), s, 501)).astype(np.float32)
    server = method.server_receive(server, jnp.asarray(ids),
                                   fedssa.FedSSAUpload(rows=jnp.asarray(up)), jnp.asarray(active))
    for i, a, u in zip(ids, active, up):
      if a:
        table[i], uploaded[i] = u, True
  participants = np.zeros(n, bool)
  participants[[3, 4]] = True
  server = aggregate(method, server, participants, 0)

  owners = uploaded if scope == 'all_owners' else participants
  want = prev_global.copy()
  want_avail = np.array([True, False, True, True, True])
  for c in range(s):
    rows = [table[k, c] for k in range(n) if seen[k, c] and owners[k]]
    if rows:
      want[c] = np.mean(rows, axis=0)
      want_avail[c] = True
  np.testing.assert_allclose(np.asarray(server.global_rows), want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(server.avail), want_avail)
  np.testing.assert_array_equal(np.asarray(server.uploaded), uploaded)


def test_comm_and_fusion_counts():
  method = make_method('all_owners', 3, 4)
  seen = jnp.array([[1, 1, 0, 0], [0, 1, 1, 1], [1, 0, 0, 1]], bool)
  server = method.init_server(jax.random.PRNGKey(0), seen)
  server = server.replace(avail=jnp.array([True, False, True, True]))
  model = models.make_model('cnn5', 4, feature_dim=D)
  params = models.init_params(model, jax.random.PRNGKey(1))
  for k, (want_down, want_up) in enumerate([(1, 2), (2, 3), (2, 2)]):
    down = method.download(params, base.NoState(), server, client_view(k, seen[k], 0, 0))
    assert int(down.floats) == 501 * want_down
    assert float(down.flops) == 3 * 501 * want_down  # convex fusion: 3 ops per element
    up = method.upload({'model': down.params}, base.Accumulated(), down.ctx, base.NoState(),
                       client_view(k, seen[k], 5, 0))
    assert int(up.floats) == 501 * want_up


@pytest.mark.parametrize('initial_header', [True, False])
def test_initial_global_header_is_a_client_header_draw_from_the_server_key(initial_header):
  c = config_lib.base_config('cifar10')
  c.fedssa.initial_header = initial_header
  method = fedssa.FedSSA(c, 3, 10)
  key = jax.random.PRNGKey(7)
  server = method.init_server(key, jnp.ones((3, 10), bool))
  if initial_header:
    fc3 = models.Dense(10).init(key, jnp.zeros((1, 500)))['params']  # a client's fc3 init
    want = np.concatenate([fc3['kernel'].T, fc3['bias'][:, None]], axis=1)
    np.testing.assert_array_equal(np.asarray(server.global_rows), want)
    assert np.abs(want).max() <= 1 / math.sqrt(500) and np.asarray(server.avail).all()
  else:
    assert not np.asarray(server.global_rows).any() and not np.asarray(server.avail).any()


@pytest.mark.slow  # a simulator compiled and run
@pytest.mark.parametrize('fusion', ['reference', 'convex'])
def test_whole_rounds_equal_a_plain_per_client_loop(small_sim, fusion):
  """Three engine rounds (T_stable=2: mu_t = 0.5, 0.35, 0) against the spec's round written
  as plain loops: theta^0 from the server key, each sampled client fusing its seen rows, training
  alone, uploading its seen rows, and per-class means over every owner that has uploaded."""
  sim = small_sim('fedssa', **{'fedssa.fusion': fusion})
  n, s, seen = sim.num_clients, sim.num_classes, sim.seen[0]
  state = sim.init_state()
  params = [params_of(sim, state.population.params, k) for k in range(n)]
  for p in params[1:]:  # init_scope 'family': every client starts from the family's one model
    jax.tree.map(np.testing.assert_array_equal, p, params[0])
  server_key = jax.random.fold_in(sim.root_keys[0], Stream.SERVER)
  glob = np.array(models.init_header(server_key, s, sim.config.model.feature_dim))
  g, data_ = sim.groups[0], sim.seed_data[0]
  train = jax.jit(functools.partial(training.local_train, apply_fn=g.model.apply,
                                    cfg=sim.train_cfg, method=sim.method))
  uploads = {}
  for t, (state, info) in enumerate(rounds(sim, 3, state)):
    cohort = schedule.sample_cohort(sim.config.seed, t, n, sim.k)
    np.testing.assert_array_equal(info.cohort, cohort)
    mu = 0.5 * math.cos(t * math.pi / 4) if t <= 2 else 0.0
    down = 0
    for k in cohort:
      rows = np.array(models.header_rows(params[k]))
      for c in np.flatnonzero(seen[k]):  # every class has a global row from round 0 on
        rows[c] = mu * rows[c] + (glob[c] if fusion == 'reference' else (1 - mu) * glob[c])
        down += 501
      key = jax.random.fold_in(
          jax.random.fold_in(jax.random.fold_in(sim.root_keys[0], Stream.TRAIN), t), k)
      trained, _, _ = train({'model': models.with_header_rows(params[k], rows)}, (), key,
                            data_.train_idx[k], data_.train_n[k], data_)
      params[k] = jax.tree.map(np.asarray, trained['model'])
      uploads[k] = np.asarray(models.header_rows(params[k]))
    for c in range(s):
      owners = [uploads[k][c] for k in uploads if seen[k, c]]
      if owners:
        glob[c] = np.mean(owners, axis=0)
    assert info.down_floats == down and info.up_floats == 501 * seen[cohort].sum()
    np.testing.assert_allclose(
        np.asarray(snapshots.seed_state(sim.store, state).server.global_rows), glob,
        rtol=2e-4, atol=2e-5)
    for k in cohort:
      jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=2e-4, atol=2e-5),
                   params_of(sim, state.population.params, k), params[k])


# Per-client training-loss sums of rounds 0..2 on conftest's 5-client simulator (cohort [2, 4]
# every round) on 600 training and 200 test images, recorded before the initial header and
# family initialisation existed.
BEFORE_INITIAL_HEADER = {
    'convex': [[226.3909454346, 209.8608856201], [139.2159118652, 187.4028167725],
               [81.8213043213, 126.9172973633]],
    'reference': [[226.3909454346, 209.8608856201], [124.6630554199, 177.3008880615],
                  [90.6684188843, 94.1738739014]],
}


@pytest.mark.slow  # a simulator compiled and run
@pytest.mark.parametrize('fusion', ['convex', 'reference'])
def test_without_initial_header_and_with_client_init_the_numbers_are_unchanged(fusion):
  sim = make_small_sim(synthetic_dataset(600, 200), 'fedssa', **{'fedssa.fusion': fusion, 'fedssa.initial_header': False,
                               'model.init_scope': 'client'})
  for (_, info), want in zip(rounds(sim, 3), BEFORE_INITIAL_HEADER[fusion]):
    np.testing.assert_array_equal(info.cohort, [2, 4])
    np.testing.assert_allclose(info.train_loss_sum, want, rtol=1e-6)
