"""FedSSA's stabilisation and class-wise aggregation against plain per-class loops."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, models
from fedssa_jax.methods import fedssa


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
  server = method.init_server(None, jnp.asarray(seen))
  prev_global = rng.normal(size=(s, 501)).astype(np.float32)
  server['global'] = jnp.asarray(prev_global)
  server['avail'] = jnp.asarray([True, False, True, True, True])
  # Round A: clients 0, 1, 2 upload; round B: clients 3, 4 upload (5 never does). A chunk
  # padded with a dummy (active False) must change nothing.
  table = np.zeros((n, s, 501), np.float32)
  uploaded = np.zeros(n, bool)
  for ids, active in (([0, 1, 2, 5], [True, True, True, False]), ([3, 4], [True, True])):
    up = rng.normal(size=(len(ids), s, 501)).astype(np.float32)
    server = method.server_receive(server, jnp.asarray(ids), jnp.asarray(up),
                                   jnp.asarray(active))
    for i, a, u in zip(ids, active, up):
      if a:
        table[i], uploaded[i] = u, True
  participants = np.zeros(n, bool)
  participants[[3, 4]] = True
  server = method.server_aggregate(server, jnp.asarray(participants), 0)

  owners = uploaded if scope == 'all_owners' else participants
  want = prev_global.copy()
  want_avail = np.array([True, False, True, True, True])
  for c in range(s):
    rows = [table[k, c] for k in range(n) if seen[k, c] and owners[k]]
    if rows:
      want[c] = np.mean(rows, axis=0)
      want_avail[c] = True
  np.testing.assert_allclose(np.asarray(server['global']), want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(server['avail']), want_avail)
  np.testing.assert_array_equal(np.asarray(server['uploaded']), uploaded)


def test_comm_and_fusion_counts():
  method = make_method('all_owners', 3, 4)
  seen = jnp.array([[1, 1, 0, 0], [0, 1, 1, 1], [1, 0, 0, 1]], bool)
  server = method.init_server(jax.random.PRNGKey(0), seen)
  server['avail'] = jnp.array([True, False, True, True])
  model = models.make_model('cnn5', 4)
  params = models.init_params(model, jax.random.PRNGKey(1))
  for k, (want_down, want_up) in enumerate([(1, 2), (2, 3), (2, 2)]):
    down = method.download(params, {}, server, k, seen[k], 0)
    assert int(down.floats) == 501 * want_down
    assert float(down.flops) == 3 * 501 * want_down  # convex fusion: 3 ops per element
    up = method.upload({'model': down.params}, {}, (), {}, seen[k], 5, 0)
    assert int(up.floats) == 501 * want_up
