"""FD (docs/algorithm.md §6): the distillation loss, the accumulator, the server rule with and
without the client's own contribution, and the float counts, against plain per-client loops."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, models
from fedssa_jax.methods import aggregation, base, fd

from conftest import (client_view, clients_loss, init_clients, log_softmax, padded_batches, rounds,
                      two_rounds_of_uploads)

C = 4
D = config_lib.base_config('cifar10').model.feature_dim  # d of the methods' configs


def make_method(n=5, exclude_own=False, lam=1.0):
  c = config_lib.base_config('cifar10')
  c.fd.exclude_own, c.fd.lam = exclude_own, lam
  return fd.FD(c, n, C)


def test_loss_and_accumulator_equal_per_sample_loop():
  lam, k, b = 0.7, 3, 6
  method = make_method(lam=lam)
  model = models.make_model('cnn5', C, 'im2col', feature_dim=D)
  params = init_clients(model, k)
  rng = np.random.default_rng(0)
  x, y, valid = padded_batches(rng, k, b, C)
  targets = rng.normal(size=(k, C, C)).astype(np.float32) * 3
  has = np.array([[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 1]], bool)  # client 1: round 0
  ctx = fd.GlobalLogits(targets=jnp.asarray(targets), has=jnp.asarray(has))
  loss, (correct, acc) = clients_loss(method, model, params, ctx, x, y, valid)
  for i in range(k):
    logits = np.asarray(model.apply({'params': jax.tree_util.tree_map(lambda a: a[i], params)},
                                    jnp.asarray(x[i]))[0], np.float64)  # one client at a time
    total, n, right = 0.0, 0, 0
    sums, counts = np.zeros((C, C)), np.zeros(C)
    for j in range(b):
      if not valid[i, j]:
        continue
      yj, lp = y[i, j], log_softmax(logits[j])
      term = -lp[yj]
      if has[i, yj]:
        t = np.exp(log_softmax(targets[i, yj].astype(np.float64)))
        term += lam * -(t * lp).sum()
      total, n, right = total + term, n + 1, right + (logits[j].argmax() == yj)
      sums[yj] += logits[j]
      counts[yj] += 1
    assert float(loss[i]) == pytest.approx(total / n, rel=1e-5)
    assert int(correct[i]) == right
    np.testing.assert_allclose(np.asarray(acc.sum[i]), sums, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(acc.count[i]), counts)


def test_upload_means_and_floats():
  method = make_method()
  rng = np.random.default_rng(1)
  seen = np.array([[1, 1, 0, 0], [0, 1, 1, 1], [1, 1, 1, 1]], bool)
  counts = np.where(seen, rng.integers(1, 9, size=seen.shape), 0).astype(np.float32)
  sums = rng.normal(size=(3, C, C)).astype(np.float32) * counts[:, :, None]
  up = jax.vmap(lambda a, s: method.upload({'model': {}}, base.Accumulated(loss=a), None,
                                            base.NoState(), client_view(0, s, 5, 1)))(
      base.ClassSums(sum=jnp.asarray(sums), count=jnp.asarray(counts)), jnp.asarray(seen))
  for i in range(3):
    assert int(up.floats[i]) == C * seen[i].sum()
    for c in range(C):
      want = sums[i, c] / counts[i, c] if seen[i, c] else np.zeros(C)
      np.testing.assert_allclose(np.asarray(up.payload.logits[i, c]), want, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(up.payload.has[i]), seen[i])


def test_class_means_and_masked_sums_hand_computed():
  """base.class_means (FD's and FedProto's uploads) and aggregation.masked_sum, FD's server
  sums, which masked_mean divides."""
  acc = base.ClassSums(sum=jnp.asarray([[2., 4.], [3., 6.], [5., 5.]]),
                       count=jnp.asarray([2., 3., 0.]))
  means, held = base.class_means(acc, jnp.asarray([True, False, True]))
  # Class 1 was trained on but is not seen; class 2 is seen but was never trained on.
  np.testing.assert_array_equal(np.asarray(means), [[1., 2.], [0., 0.], [0., 0.]])
  np.testing.assert_array_equal(np.asarray(held), [True, False, False])

  uploads = jnp.asarray([[[1., 2.], [3., 4.]], [[5., 6.], [7., 8.]]])  # [N=2, C=2, D=2]
  mask = jnp.asarray([[True, False], [True, True]])
  total, weight = aggregation.masked_sum(uploads, mask)
  np.testing.assert_array_equal(np.asarray(total), [[6., 8.], [7., 8.]])
  np.testing.assert_array_equal(np.asarray(weight), [2., 1.])
  total, weight = aggregation.masked_sum(uploads, mask, weights=jnp.asarray([2., 3.]))
  np.testing.assert_array_equal(np.asarray(total), [[17., 22.], [21., 24.]])
  np.testing.assert_array_equal(np.asarray(weight), [5., 3.])
  mean, has = aggregation.masked_mean(uploads, mask & jnp.asarray([[True], [False]]))
  np.testing.assert_array_equal(np.asarray(mean), [[1., 2.], [0., 0.]])
  np.testing.assert_array_equal(np.asarray(has), [True, False])


@pytest.mark.parametrize('exclude_own', [False, True])
def test_server_rule_equals_loop(exclude_own):
  n = 5
  method = make_method(n, exclude_own)
  seen = np.array([[1, 0, 1, 0],
                   [1, 1, 1, 0],    # class 1: only client 1 of the round holds it
                   [1, 0, 1, 0],
                   [0, 0, 1, 1],    # uploads in round 0 only (class 3 then goes stale)
                   [1, 0, 0, 1]], bool)  # never participates
  server = method.init_server(None, jnp.asarray(seen))
  down = jax.vmap(lambda k, s: method.download({}, base.NoState(), server,
                                               client_view(k, s, 0, 0)))(
      jnp.arange(n), jnp.asarray(seen))
  assert not np.asarray(down.ctx.has).any() and not np.asarray(down.floats).any()  # round 0

  rng = np.random.default_rng(2)
  uploads = np.where(seen[:, :, None], rng.normal(size=(n, C, C)), 0).astype(np.float32)
  server, participants = two_rounds_of_uploads(
      method, server, lambda ids: fd.FDUpload(logits=jnp.asarray(uploads[ids]),
                                              has=jnp.asarray(seen[ids])))

  down = jax.vmap(lambda k, s: method.download({}, base.NoState(), server,
                                               client_view(k, s, 0, 2)))(
      jnp.arange(n), jnp.asarray(seen))
  for k in range(n):
    for c in range(C):
      holders = [j for j in range(n) if participants[j] and seen[j, c]]
      if exclude_own and k in holders:
        holders.remove(k)
      assert bool(down.ctx.has[k, c]) == bool(holders)
      if holders:
        np.testing.assert_allclose(np.asarray(down.ctx.targets[k, c]),
                                   np.mean(uploads[holders, c], axis=0), rtol=1e-5, atol=1e-6)
    rows = sum(1 for c in range(C) if seen[k, c] and down.ctx.has[k, c])
    assert int(down.floats[k]) == C * rows
  if exclude_own:  # class 1 is held by client 1 alone: no global for it under exclusion
    assert not bool(down.ctx.has[1, 1]) and bool(down.ctx.has[0, 1])


@pytest.mark.slow  # a simulator compiled and run
def test_engine_smoke(small_sim):
  sim = small_sim('fd', **{'fd.exclude_own': True})
  (_, info0), (state, info1) = rounds(sim, 2)
  ev = sim.evaluate(state)
  nc = sim.num_classes
  for info in (info0, info1):
    assert np.isfinite(info.train_loss)
    np.testing.assert_array_equal(info.client_up_floats, nc * sim.seen[0][info.cohort].sum(1))
  assert not info0.client_down_floats.any()
  # Round 1: rows of the client's seen classes held by another round-0 participant.
  p0 = info0.cohort
  for k, got in zip(info1.cohort, info1.client_down_floats):
    holders = sim.seen[0][p0].sum(0) - (sim.seen[0][k] if k in p0 else 0)
    assert got == nc * (sim.seen[0][k] & (holders > 0)).sum()
  assert np.isfinite(ev.accuracy).all() and (ev.count > 0).all()
