"""FedTGP (docs/algorithm.md §6): the client loss against a per-sample loop, the upload and the
float counts, the margin and the TGP net's training against a plain per-step loop in the same
order, and rounds through the engine: the prototypes of the pass before training (HtFLlib's
order) against a per-client forward. method_standalone_test.py checks that with lam = 0 it
trains every model as Standalone does."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, models
from fedssa_jax.engine import snapshots
from fedssa_jax.methods import base, fedtgp, prototypes

from conftest import client_view, log_softmax, make_small_sim

C, D = 4, config_lib.base_config('cifar10').model.feature_dim  # d of the methods' configs



def own_params(sim, params, k):
  """Client k's parameters, as numpy arrays, out of one seed's state (snapshots.seed_state)."""
  return jax.tree.map(lambda a: np.asarray(a[sim.slot_of[k]]), params[sim.group_of[k]])

def make_method(n=5, c=C, **fields):
  cfg = config_lib.base_config('cifar10')
  cfg.fedtgp.update(fields)
  return fedtgp.FedTGP(cfg, n, c)


def test_loss_equals_per_sample_loop():
  """CE + lam / (B d) sum_i g[y_i] ||r_i - P^[y_i]||^2, lam = 10 by default; the model's
  outputs come from a stand-in apply_fn, so that no network compiles."""
  method = make_method()
  assert method.lam == 10.0
  rng = np.random.default_rng(0)
  b = 7
  logits = rng.normal(size=(b, C)).astype(np.float32)
  rep = np.abs(rng.normal(size=(b, D))).astype(np.float32)
  y = rng.integers(0, C, size=b).astype(np.int32)
  valid = np.array([1, 1, 1, 1, 1, 0, 0], bool)
  protos = rng.normal(size=(C, D)).astype(np.float32)
  apply_fn = lambda variables, x: (variables['params']['z'], variables['params']['r'])
  loss_fn = jax.jit(lambda avail: method.loss(
      apply_fn, {'model': {'z': logits, 'r': rep}},
      prototypes.GlobalPrototypes(protos=protos, avail=avail), (None,), y, valid))
  for avail in (np.ones(C, bool), np.zeros(C, bool)):  # after round 0; round 0
    loss, (correct, acc) = loss_fn(avail)
    ce = sq = 0.0
    for j in np.flatnonzero(valid):
      ce -= log_softmax(logits[j].astype(np.float64))[y[j]]
      sq += ((rep[j] - protos[y[j]]) ** 2).sum() if avail[y[j]] else 0.0
    m = valid.sum()
    assert float(loss) == pytest.approx(ce / m + 10.0 * sq / (m * D), rel=1e-5)
    assert int(correct) == sum(logits[j].argmax() == y[j] for j in np.flatnonzero(valid))
    assert acc is None  # the prototypes come from the forward pass


def test_upload_download_floats_and_options():
  method = make_method()
  rng = np.random.default_rng(1)
  seen = np.array([[1, 1, 0, 0], [0, 1, 1, 1]], bool)
  counts = np.where(seen, rng.integers(1, 9, size=seen.shape), 0).astype(np.float32)
  sums = (rng.normal(size=(2, C, D)) * counts[:, :, None]).astype(np.float32)
  acc = base.Accumulated(forward_pass=base.ClassSums(sum=jnp.asarray(sums),
                                                     count=jnp.asarray(counts)))
  up = jax.jit(jax.vmap(
      lambda a, s: method.upload({'model': {}}, a, None, base.NoState(),
                                 client_view(0, s, 5, 1))))(
          acc, jnp.asarray(seen))
  for k in range(2):
    assert int(up.floats[k]) == D * seen[k].sum()
    want = np.where(seen[k][:, None], sums[k] / np.maximum(counts[k], 1)[:, None], 0)
    np.testing.assert_allclose(np.asarray(up.payload.protos[k]), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(up.payload.n[k]), counts[k])
  for inference in ('classifier', 'prototype'):
    m = make_method(inference=inference)
    floats = jax.jit(lambda avail: m.download({}, base.NoState(), fedtgp.FedTGPServer(
        tgp={}, uploads=None, uploads_n=None, protos=jnp.zeros((C, D)), avail=avail), client_view(
            0, seen[1], 5, 1)).floats)
    for avail in (np.zeros(C, bool), np.ones(C, bool)):
      want = (seen[1] & avail).sum() if inference == 'classifier' else avail.sum()
      assert int(floats(avail)) == D * want
  assert make_method(inference='prototype').headline_metric == 'prototype_accuracy'
  assert method.headline_metric == 'accuracy' and method.forward_pass == 'after'
  assert make_method(proto_timing='pre_train').forward_pass == 'before'
  assert make_method(proto_source='train_pass').forward_pass is None
  for field, value in (('proto_timing', 'late'), ('proto_source', 'pass'),
                       ('inference', 'knn'), ('lam', -1.0), ('margin_cap', -1.0),
                       ('server_epochs', 0), ('server_batch', 0), ('server_lr', 0.0)):
    with pytest.raises(ValueError, match=f'fedtgp.{field}'):
      make_method(**{field: value})
  with pytest.raises(ValueError, match='fedtgp.proto_timing'):
    make_method(proto_source='train_pass', proto_timing='pre_train')


def test_tgp_net_size_and_init():
  method = make_method(c=10)
  tgp = jax.jit(method.init_server)(jax.random.PRNGKey(0), jnp.ones((5, 10), bool)).tgp
  assert models.param_count(tgp) == method.tgp_size == 506_000  # algorithm.md §6: P_T at S = 10
  emb = np.asarray(tgp['embedding']['embedding'])
  assert emb.shape == (10, D) and 0.9 < emb.std() < 1.1  # N(0, 1)
  bound = 1 / math.sqrt(D)  # PyTorch's Linear(500, 500)
  for layer in ('fc1', 'fc2'):
    for leaf in tgp[layer].values():
      assert np.abs(np.asarray(leaf)).max() <= bound


def reference_margin(means, has, cap):
  """delta by HtFLlib's loops: gap[c] = min distance to another class, 1e9 when none, then
  replaced by the minimum gap; delta = min(max gap, cap)."""
  c = len(has)
  gap = np.full(c, 1e9)
  for i in range(c):
    for j in range(c):
      if i > j and has[i] and has[j]:
        dist = np.linalg.norm(means[i] - means[j])
        gap[i], gap[j] = min(gap[i], dist), min(gap[j], dist)
  gap = np.where(gap > 1e8, gap.min(), gap)
  return min(gap.max(), cap)


def test_margin_equals_loop():
  rng = np.random.default_rng(2)
  means = rng.normal(size=(C, D)).astype(np.float32)
  margin = jax.jit(fedtgp.margin)
  for has, cap in (([1, 1, 1, 1], 100.0), ([1, 0, 1, 1], 100.0), ([1, 1, 0, 0], 1.0),
                   ([0, 0, 1, 0], 100.0), ([0, 0, 0, 0], 100.0)):
    has = np.asarray(has, bool)
    got = float(margin(means, has, cap))
    assert got == pytest.approx(reference_margin(means, has, cap), rel=1e-5)


def plain_protos(p):
  """T(every class), layer by layer."""
  h = jnp.maximum(p['embedding']['embedding'] @ p['fc1']['kernel'] + p['fc1']['bias'], 0.0)
  return h @ p['fc2']['kernel'] + p['fc2']['bias']


def plain_tgp_loss(p, x, y, delta):
  """The TGP loss of a batch written out, with direct distances."""
  dist = jnp.sqrt(jnp.sum((x[:, None, :] - plain_protos(p)[None]) ** 2, -1))
  dist = dist.at[jnp.arange(len(y)), y].add(delta)
  return -jnp.mean(jax.nn.log_softmax(-dist)[jnp.arange(len(y)), y])


@jax.jit
def plain_sgd_step(p, x, y, delta, lr):
  loss, grads = jax.value_and_grad(plain_tgp_loss)(p, x, y, delta)
  return jax.tree.map(lambda a, g: a - lr * g, p, grads), loss


def test_server_update_equals_plain_loop():
  """The margin from the round's class means, then S epochs of SGD on T over the round's pairs
  in the order of their key (argsort(where(valid, uniform(fold_in(key, epoch)), inf))), one
  plain step per batch; P^ = T(every class) and its availability."""
  n, epochs, batch, lr = 5, 2, 3, 0.05
  method = make_method(n, server_epochs=epochs, server_batch=batch, server_lr=lr)
  rng = np.random.default_rng(3)
  seen = rng.random((n, C)) < 0.6
  seen[0] = [1, 1, 1, 0]
  protos = np.where(seen[:, :, None], np.abs(rng.normal(size=(n, C, D))), 0).astype(np.float32)
  n_kc = np.where(seen, rng.integers(1, 20, size=seen.shape), 0).astype(np.float32)
  participants = np.array([1, 0, 1, 1, 0], bool)
  server = jax.jit(method.init_server)(jax.random.PRNGKey(4), jnp.asarray(seen)).replace(
      uploads=jnp.asarray(protos), uploads_n=jnp.asarray(n_kc))
  key = jax.random.PRNGKey(5)
  agg = jax.jit(method.server_aggregate)(server, jnp.asarray(participants), 1, key)

  held = seen & participants[:, None]
  means = np.stack([protos[held[:, c], c].mean(0) if held[:, c].any() else np.zeros(D)
                    for c in range(C)])
  delta = reference_margin(means, held.any(0), 100.0)
  values, labels = protos.reshape(n * C, D), np.tile(np.arange(C), n)
  flat = held.reshape(-1)
  p, losses = server.tgp, []
  for e in range(epochs):
    u = np.asarray(jax.random.uniform(jax.random.fold_in(key, e), (n * C,)))
    order = np.argsort(np.where(flat, u, np.inf), kind='stable')[:flat.sum()]
    for start in range(0, len(order), batch):
      j = order[start:start + batch]
      p, loss = plain_sgd_step(p, values[j], labels[j], delta, lr)
      losses.append(float(loss))
  protos_of = jax.jit(plain_protos)
  want = protos_of(p)
  assert flat.sum() % batch and len(losses) == epochs * -(-flat.sum() // batch)
  np.testing.assert_allclose(np.asarray(agg.server.protos), np.asarray(want), rtol=1e-4,
                             atol=1e-5)
  assert np.abs(np.asarray(want) - np.asarray(protos_of(server.tgp))).max() > 1e-3  # T moved
  assert np.asarray(agg.server.avail).all()  # every class gets a prototype
  assert float(agg.metrics['margin']) == pytest.approx(delta, rel=1e-5)
  assert float(agg.metrics['steps']) == len(losses)
  assert float(agg.metrics['loss']) == pytest.approx(np.mean(losses), rel=1e-4)
  per_step = 3 * (4 * C * D * D + 2 * batch * C * D) + 2 * method.tgp_size
  assert float(agg.flops) == pytest.approx(3 * C * C * D + per_step * len(losses), rel=1e-6)


# The simulator of the rounds below: lam = 0, the pass before training, 2 server epochs; the
# same as method_standalone_test.py's FedTGP, whose models it checks against Standalone's (the
# two tests then share their compiled programs).
SIM_FIELDS = {'fedtgp.lam': 0.0, 'fedtgp.proto_timing': 'pre_train', 'fedtgp.server_epochs': 2}


@pytest.fixture(scope='module')
def two_rounds(small_ds):
  """FedTGP's simulator (SIM_FIELDS), its state before each of two rounds and after the last
  (one seed's), and the rounds' infos."""
  sim = make_small_sim(small_ds, 'fedtgp', **SIM_FIELDS)
  state = sim.init_state()
  states, infos = [snapshots.seed_state(sim.store, state)], []
  for _ in range(2):
    state, (info,) = sim.run_round(state)
    states.append(snapshots.seed_state(sim.store, state))
    infos.append(info)
  return sim, states, infos


@pytest.mark.slow  # a simulator compiled and run
def test_rounds_upload_pre_training_prototypes(two_rounds, small_ds):
  sim, states, infos = two_rounds
  seen = sim.seen[0]
  model = sim.groups[0].eval_model
  forward = jax.jit(lambda p, x: model.apply({'params': p}, x)[1])
  mean, std = np.asarray(sim.train_cfg.mean), np.asarray(sim.train_cfg.std)
  for t, info in enumerate(infos):
    server = states[t + 1].server
    for k in info.cohort:  # the forward, over its training split, of the model it started from
      idx = np.asarray(sim.data.train_idx[0, k])[:int(sim.train_n[0, k])]
      x = (small_ds.images[idx] / 255.0 - mean) / std
      params = own_params(sim, states[t].population.params, k)
      rep = np.asarray(forward(params, x.astype(np.float32)), np.float64)
      y = small_ds.labels[idx]
      for c in range(sim.num_classes):
        want = rep[y == c].mean(0) if seen[k, c] else np.zeros(D)
        np.testing.assert_allclose(np.asarray(server.uploads[k, c]), want, rtol=1e-4,
                                   atol=1e-5)
    np.testing.assert_array_equal(info.client_up_floats, D * seen[info.cohort].sum(1))
    # Round 0 downloads nothing; then every class has a generated prototype.
    np.testing.assert_array_equal(info.client_down_floats, t * D * seen[info.cohort].sum(1))
    assert np.asarray(server.avail).all()
    np.testing.assert_allclose(np.asarray(server.protos),
                               np.asarray(prototypes.tgp_protos(server.tgp, sim.num_classes)),
                               rtol=1e-5, atol=1e-6)
    assert np.isfinite(info.server_metrics['loss']) and info.server_flops > 0
    extra = (info.client_flops_per_client
             - sim.flops.per_client[info.cohort] * info.train_samples)
    np.testing.assert_allclose(extra, sim.flops.forward('cnn5') * sim.train_n[0, info.cohort],
                               rtol=1e-6)
