"""FedProto (docs/algorithm.md §6): the prototype loss, the accumulator, the server rule (both
weightings), nearest-prototype inference and the float counts, against plain per-client loops."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, models
from fedssa_jax.engine import snapshots
from fedssa_jax.methods import base, fedproto, prototypes

from conftest import (client_view, clients_loss, init_clients, log_softmax, padded_batches, rounds,
                      two_rounds_of_uploads)

C, D = 4, config_lib.base_config('cifar10').model.feature_dim  # d of the methods' configs


def make_method(n=5, lam=1.0, weighting='uniform', inference='classifier', epochs=2):
  c = config_lib.base_config('cifar10')
  c.fedproto.lam, c.fedproto.weighting, c.fedproto.inference = lam, weighting, inference
  c.local_epochs = epochs
  return fedproto.FedProto(c, n, C)


def test_loss_and_accumulator_equal_per_sample_loop():
  lam, k, b = 0.3, 3, 6
  method = make_method(lam=lam)
  model = models.make_model('cnn5', C, 'im2col', feature_dim=D)
  params = init_clients(model, k)
  rng = np.random.default_rng(0)
  x, y, valid = padded_batches(rng, k, b, C)
  protos = rng.normal(size=(k, C, D)).astype(np.float32) * 0.1
  avail = np.array([[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 1]], bool)  # client 1: round 0
  ctx = prototypes.GlobalPrototypes(protos=jnp.asarray(protos), avail=jnp.asarray(avail))
  loss, (correct, acc) = clients_loss(method, model, params, ctx, x, y, valid)
  for i in range(k):
    logits, rep = model.apply({'params': jax.tree_util.tree_map(lambda a: a[i], params)},
                              jnp.asarray(x[i]))  # one client at a time
    logits, rep = np.asarray(logits, np.float64), np.asarray(rep, np.float64)
    ce = sq = 0.0
    n, right = 0, 0
    sums, counts = np.zeros((C, D)), np.zeros(C)
    for j in range(b):
      if not valid[i, j]:
        continue
      yj = y[i, j]
      ce -= log_softmax(logits[j])[yj]
      if avail[i, yj]:  # no prototype: contributes 0 but counts in B
        sq += ((rep[j] - protos[i, yj]) ** 2).sum()
      n, right = n + 1, right + (logits[j].argmax() == yj)
      sums[yj] += rep[j]
      counts[yj] += 1
    assert float(loss[i]) == pytest.approx(ce / n + lam * sq / (n * D), rel=1e-5)
    assert int(correct[i]) == right
    np.testing.assert_allclose(np.asarray(acc.sum[i]), sums, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(acc.count[i]), counts)


def test_upload_prototypes_counts_and_floats():
  epochs = 3
  method = make_method(epochs=epochs)
  rng = np.random.default_rng(1)
  seen = np.array([[1, 1, 0, 0], [0, 1, 1, 1], [1, 1, 1, 1]], bool)
  n_kc = np.where(seen, rng.integers(1, 9, size=seen.shape), 0)
  counts = (epochs * n_kc).astype(np.float32)  # E epochs over every sample
  sums = rng.normal(size=(3, C, D)).astype(np.float32) * counts[:, :, None]
  up = jax.vmap(lambda a, s: method.upload({'model': {}}, base.Accumulated(loss=a), None,
                                            base.NoState(), client_view(0, s, 5, 1)))(
      base.ClassSums(sum=jnp.asarray(sums), count=jnp.asarray(counts)), jnp.asarray(seen))
  for i in range(3):
    assert int(up.floats[i]) == D * seen[i].sum()
    for c in range(C):
      want = sums[i, c] / counts[i, c] if seen[i, c] else np.zeros(D)
      np.testing.assert_allclose(np.asarray(up.payload.protos[i, c]), want, rtol=1e-5,
                                 atol=1e-6)
    np.testing.assert_allclose(np.asarray(up.payload.n[i]), n_kc[i])


@pytest.mark.parametrize('weighting', ['uniform', 'samples'])
def test_server_rule_and_download_floats_equal_loop(weighting):
  n = 5
  seen = np.array([[1, 0, 1, 0],
                   [1, 1, 1, 0],
                   [1, 0, 1, 0],
                   [0, 0, 1, 1],         # uploads in round 0 only (class 3 then goes stale)
                   [1, 0, 0, 1]], bool)  # never participates
  methods_ = {inf: make_method(n, weighting=weighting, inference=inf)
              for inf in ('classifier', 'prototype')}
  method = methods_['classifier']
  server = method.init_server(None, jnp.asarray(seen))
  rng = np.random.default_rng(2)
  protos = np.where(seen[:, :, None], rng.normal(size=(n, C, D)), 0).astype(np.float32)
  n_kc = np.where(seen, rng.integers(1, 20, size=seen.shape), 0).astype(np.float32)
  server, participants = two_rounds_of_uploads(
      method, server, lambda ids: prototypes.PrototypeUpload(protos=jnp.asarray(protos[ids]),
                                                             n=jnp.asarray(n_kc[ids])))

  want_avail = np.zeros(C, bool)
  for c in range(C):
    holders = [j for j in range(n) if participants[j] and seen[j, c]]
    want_avail[c] = bool(holders)
    if holders:
      w = n_kc[holders, c] if weighting == 'samples' else np.ones(len(holders))
      want = (w[:, None] * protos[holders, c]).sum(0) / w.sum()
      np.testing.assert_allclose(np.asarray(server.protos[c]), want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(server.avail), want_avail)
  assert not want_avail[3]  # no memory: client 3's round-0 prototype is gone

  for inf, m in methods_.items():
    down = jax.vmap(lambda k, s: m.download({}, base.NoState(), server, client_view(k, s, 0, 2)))(
        jnp.arange(n), jnp.asarray(seen))
    for k in range(n):
      rows = (seen[k] & want_avail).sum() if inf == 'classifier' else want_avail.sum()
      assert int(down.floats[k]) == D * rows


def test_nearest_prototype_accuracy_equals_loop():
  k, b = 3, 8
  method = make_method()
  rng = np.random.default_rng(3)
  rep = np.maximum(rng.normal(size=(k, b, D)), 0).astype(np.float32)
  protos = np.maximum(rng.normal(size=(C, D)), 0).astype(np.float32)
  rep[:, :C] = protos + 0.1 * rng.normal(size=(C, D))  # some samples near their class
  y = rng.integers(0, C, size=(k, b)).astype(np.int32)
  y[:, :C] = np.arange(C)
  valid = np.ones((k, b), bool)
  valid[1, -3:] = False
  for avail in (np.array([1, 0, 1, 1], bool), np.zeros(C, bool)):
    server = method.init_server(None, None).replace(protos=jnp.asarray(protos),
                                                    avail=jnp.asarray(avail))
    got = jax.vmap(lambda r, y, v: method.eval_extra(server, 0, None, r, y, v))(
        jnp.asarray(rep), jnp.asarray(y), jnp.asarray(valid))['prototype_accuracy']
    for i in range(k):
      right = 0
      for j in range(b):
        dists = [((rep[i, j] - protos[c]) ** 2).sum() for c in range(C) if avail[c]]
        if valid[i, j] and dists:
          right += [c for c in range(C) if avail[c]][int(np.argmin(dists))] == y[i, j]
      assert int(got[i]) == right
      if not avail.any():
        assert right == 0
    if avail.any():
      assert int(got.sum()) > 0  # the test can fail: some samples are classified right


def test_options():
  assert make_method().headline_metric == 'accuracy'
  assert make_method(inference='prototype').headline_metric == 'prototype_accuracy'
  with pytest.raises(ValueError, match='fedproto.weighting'):
    make_method(weighting='median')
  with pytest.raises(ValueError, match='fedproto.inference'):
    make_method(inference='knn')


@pytest.mark.slow  # a simulator compiled and run
def test_engine_smoke(small_sim):
  sim = small_sim('fedproto')
  (_, info0), (state, info1) = rounds(sim, 2)
  ev = sim.evaluate(state)
  for info in (info0, info1):
    assert np.isfinite(info.train_loss)
    np.testing.assert_array_equal(info.client_up_floats, D * sim.seen[0][info.cohort].sum(1))
  assert not info0.client_down_floats.any()
  avail = sim.seen[0][info0.cohort].any(0)  # held by a round-0 participant
  np.testing.assert_array_equal(info1.client_down_floats,
                                D * (sim.seen[0][info1.cohort] & avail).sum(1))
  np.testing.assert_array_equal(np.asarray(snapshots.seed_state(sim.store, state).server.avail),
                                sim.seen[0][info1.cohort].any(0))
  assert np.isfinite(ev.accuracy).all() and (ev.count > 0).all()
  assert 'prototype_accuracy' in ev.metrics and np.all((0 <= ev.metrics['prototype_accuracy'])
                                               & (ev.metrics['prototype_accuracy'] <= 1))
  np.testing.assert_array_equal(ev.accuracy, ev.classifier_accuracy)
