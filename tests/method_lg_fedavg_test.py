"""LG-FedAvg (docs/algorithm.md §6): the whole-header exchange, the weighted server mean against a
plain loop over clients, evaluation with the global header, and one round through the engine."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, models
from fedssa_jax.engine import snapshots
from fedssa_jax.methods import aggregation, base, lg_fedavg

from conftest import (aggregate, assert_floats_each_way, ce_loop, client_view, params_of,
                      rounds, stack_trees)

C = 4
D = config_lib.base_config('cifar10').model.feature_dim  # d of the methods' configs


def make_method(weighting='samples', n=6, c=C):
  cfg = config_lib.base_config('cifar10')
  cfg.lg_fedavg.weighting = weighting
  return lg_fedavg.LGFedAvg(cfg, n, c)


def client_params(k, c=C):
  return models.init_params(models.make_model('cnn5', c, 'im2col', feature_dim=D),
                            jax.random.PRNGKey(k))


def test_invalid_weighting_raises():
  with pytest.raises(ValueError, match='lg_fedavg.weighting'):
    make_method('median')


def test_initial_global_header_is_a_client_header_init():
  method = make_method()
  server = method.init_server(jax.random.PRNGKey(3), jnp.ones((6, C), bool))
  g = np.asarray(server.global_header)
  assert g.shape == (C, 501)
  bound = 1 / math.sqrt(500)  # PyTorch's Linear(500, C) init, weights and bias alike
  assert np.abs(g).max() <= bound and np.abs(g).max() > 0.9 * bound
  assert np.abs(g[:, -1]).max() > 0  # the bias is random too, not zero
  again = method.init_server(jax.random.PRNGKey(3), jnp.ones((6, C), bool)).global_header
  np.testing.assert_array_equal(np.asarray(again), g)
  # The same draw as models.Dense(C), i.e. a client's fc3, from the same key.
  fc3 = models.Dense(C).init(jax.random.PRNGKey(3), jnp.zeros((1, 500)))['params']
  np.testing.assert_array_equal(g, np.asarray(models.header_rows({'fc3': fc3})))


@pytest.mark.parametrize('weighting', ['samples', 'uniform'])
def test_download_upload_over_vmapped_clients(weighting):
  method = make_method(weighting)
  server = method.init_server(jax.random.PRNGKey(0), jnp.ones((6, C), bool))
  server = server.replace(global_header=jax.random.normal(jax.random.PRNGKey(9), (C, 501)))
  params = [client_params(k) for k in range(3)]
  stacked = stack_trees(params)
  seen = jnp.array([[1, 0, 0, 1], [0, 1, 1, 1], [1, 0, 0, 0]], bool)
  down = jax.vmap(lambda p, k, s: method.download(p, base.NoState(), server,
                                                  client_view(k, s, 0, 0)))(
      stacked, jnp.arange(3), seen)
  n = jnp.array([7, 0, 12], jnp.int32)
  up = jax.vmap(lambda t, k, s, nk: method.upload(t, base.Accumulated(), down.ctx, base.NoState(),
                                                  client_view(k, s, nk, 0)))(
      {'model': down.params}, jnp.arange(3), seen, n)
  for k in range(3):
    got = jax.tree_util.tree_map(lambda a: a[k], down.params)
    # The whole header, unseen-class rows included, becomes the global header ...
    np.testing.assert_array_equal(np.asarray(models.header_rows(got)),
                                  np.asarray(server.global_header))
    for name in ('conv1', 'conv2', 'fc1', 'fc2'):  # ... and the extractor is untouched.
      for leaf in ('kernel', 'bias'):
        np.testing.assert_array_equal(np.asarray(got[name][leaf]),
                                      np.asarray(params[k][name][leaf]))
    assert int(down.floats[k]) == 501 * C and int(up.floats[k]) == 501 * C  # 2,004 each way
    np.testing.assert_array_equal(np.asarray(up.payload.value[k]),
                                  np.asarray(server.global_header))
    want_w = float(n[k]) if weighting == 'samples' else 1.0
    assert float(up.payload.weight[k]) == want_w
  assert down.floats.dtype == jnp.int32 and up.floats.dtype == jnp.int32


def receive_and_aggregate(method, server, rng, n_clients):
  """Two chunks, the first padded with a dummy; returns the server and the loop's H_g."""
  uploads = {}
  for ids, active in (([0, 2, 5], [True, True, False]), ([3, 4], [True, True])):
    rows = rng.normal(size=(len(ids), C, 501)).astype(np.float32)
    weight = rng.integers(1, 50, size=len(ids)).astype(np.float32)
    if method.weighting == 'uniform':
      weight = np.ones_like(weight)
    before = np.asarray(server.global_header)
    server = method.server_receive(server, jnp.asarray(ids),
                                   base.WeightedUpload(value=jnp.asarray(rows),
                                                       weight=jnp.asarray(weight)),
                                   jnp.asarray(active))
    # Receiving must not change what later chunks of the round download.
    np.testing.assert_array_equal(np.asarray(server.global_header), before)
    for i, a, r, w in zip(ids, active, rows, weight):
      if a:
        uploads[i] = (r.astype(np.float64), float(w))
  participants = np.zeros(n_clients, bool)
  participants[list(uploads)] = True
  server = aggregate(method, server, participants, 0)
  num = sum(w * r for r, w in uploads.values())
  den = sum(w for _, w in uploads.values())
  return server, num / den, uploads


@pytest.mark.parametrize('weighting', ['samples', 'uniform'])
def test_server_rule_equals_loop(weighting):
  method = make_method(weighting, n=6)
  server = method.init_server(jax.random.PRNGKey(0), jnp.ones((6, C), bool))
  rng = np.random.default_rng(0)
  server, want, uploads = receive_and_aggregate(method, server, rng, 6)
  assert sorted(uploads) == [0, 2, 3, 4]  # the dummy (client 5) is dropped
  np.testing.assert_allclose(np.asarray(server.global_header), want, rtol=1e-5, atol=1e-6)
  if weighting == 'uniform':
    np.testing.assert_allclose(want, np.mean([r for r, _ in uploads.values()], axis=0))
  # The inbox is emptied; a round without uploads keeps H_g.
  assert float(server.inbox.weight) == 0 and not np.asarray(server.inbox.sum).any()
  assert server.inbox.weighted and server.inbox.weight.dtype == jnp.float32
  again = aggregate(method, server, np.zeros(6, bool), 1)
  np.testing.assert_array_equal(np.asarray(again.global_header),
                                np.asarray(server.global_header))
  # A second round averages only its own uploads.
  server, want2, _ = receive_and_aggregate(method, again, rng, 6)
  np.testing.assert_allclose(np.asarray(server.global_header), want2, rtol=1e-5, atol=1e-6)


def test_weighted_inbox_hand_computed():
  """A weighted aggregation.Inbox, the LG-FedAvg and FedClassAvg inbox: a chunk's active uploads are
  summed, each counting its float weight, under the fields and dtypes their checkpoints hold;
  a counted one (FML's, FedKD's) counts each active upload 1, in int32."""
  inbox = aggregation.Inbox.empty(jnp.zeros((1, 2)), weighted=True)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(inbox)]
  assert paths == ['.sum', '.weight'] and inbox.weight.dtype == jnp.float32 and inbox.weighted
  rows = jnp.asarray([[[1., 2.]], [[3., 4.]], [[100., 100.]]])
  inbox = inbox.add(rows, jnp.asarray([True, True, False]),  # 3rd: padding
                    jnp.asarray([1., 3., 7.]))
  inbox = inbox.add(rows[:1], jnp.asarray([True]), jnp.asarray([4.]))
  assert float(inbox.weight) == 8.0
  np.testing.assert_array_equal(np.asarray(inbox.sum), [[14., 22.]])
  mean, any_ = inbox.mean()
  assert bool(any_)
  np.testing.assert_array_equal(np.asarray(mean), [[1.75, 2.75]])
  cleared = inbox.cleared()
  assert cleared.weighted and float(cleared.weight) == 0 and not np.asarray(cleared.sum).any()
  counted = aggregation.Inbox.empty(jnp.zeros((1, 2)))
  assert not counted.weighted and counted.weight.dtype == jnp.int32
  counted = counted.add(rows, jnp.asarray([True, True, False]))
  assert int(counted.weight) == 2 and counted.weight.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(counted.sum), [[4., 6.]])
  np.testing.assert_array_equal(np.asarray(counted.mean()[0]), [[2., 3.]])


def test_eval_uses_local_extractor_with_global_header():
  method = make_method()
  model = models.make_model('cnn5', C, 'im2col', feature_dim=D)
  params = client_params(1)
  server = method.init_server(jax.random.PRNGKey(0), None).replace(
      global_header=jax.random.normal(jax.random.PRNGKey(2), (C, 501)))
  ev = method.eval_params(params, server, 0)
  x = jax.random.normal(jax.random.PRNGKey(4), (3, 32, 32, 3))
  logits, rep = model.apply({'params': ev}, x)
  _, rep_own = model.apply({'params': params}, x)
  np.testing.assert_allclose(np.asarray(rep), np.asarray(rep_own), rtol=1e-6)
  g = np.asarray(server.global_header, np.float64)
  want = np.asarray(rep, np.float64) @ g[:, :-1].T + g[:, -1]
  np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-5, atol=1e-5)


def test_loss_is_plain_cross_entropy_over_valid_samples():
  method = make_method()
  model = models.make_model('cnn5', C, 'im2col', feature_dim=D)
  params = client_params(5)
  x = jax.random.normal(jax.random.PRNGKey(6), (6, 32, 32, 3))
  y = jnp.array([0, 3, 1, 1, 2, 0])
  valid = jnp.array([True, True, False, True, True, False])
  loss, (correct, acc) = method.loss(model.apply, {'model': params}, None, (x,), y, valid)
  ce, right = ce_loop(model.apply({'params': params}, x)[0], np.asarray(y), np.asarray(valid))
  assert float(loss) == pytest.approx(ce, rel=1e-5)
  assert int(correct) == right and acc is None  # the loss accumulates nothing


@pytest.mark.slow  # a simulator compiled and run
def test_one_round_through_the_engine(small_sim):
  sim = small_sim('lg_fedavg')
  for state, info in rounds(sim, 2):
    assert np.isfinite(info.train_loss)
    assert_floats_each_way(info, 501 * sim.num_classes)  # 5,010 each way
    # H_g is the n_k-weighted mean of the participants' trained headers (which they keep).
    rows, weights = [], []
    for k in info.cohort:
      p = params_of(sim, state.population.params, k)
      rows.append(np.asarray(models.header_rows(p), np.float64))
      weights.append(sim.train_n[0][k])
    want = np.tensordot(weights, rows, axes=1) / np.sum(weights)
    np.testing.assert_allclose(
        np.asarray(snapshots.seed_state(sim.store, state).server.global_header), want,
        rtol=1e-4, atol=1e-6)
  ev = sim.evaluate(state)
  assert np.isfinite(ev.accuracy).all() and (ev.count > 0).all()
