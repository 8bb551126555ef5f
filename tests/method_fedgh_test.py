"""FedGH (docs/algorithm.md §6): the forward pass over the training split (Method.forward_pass)
against a per-sample loop, the upload of its prototypes, the server's SGD on the global header
against a plain numpy loop in the same order, the header exchange and evaluation, and rounds
through the engine (the uploaded prototypes against a per-client forward of the trained model)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, models
from fedssa_jax.data.partition import DeviceData
from fedssa_jax.engine import snapshots, training
from fedssa_jax.methods import base, fedgh, prototypes

from conftest import client_view, log_softmax, make_small_sim

C, D = 4, config_lib.base_config('cifar10').model.feature_dim  # d of the methods' configs
ROW = D + 1  # a header row: d weights and a bias



def own_params(sim, params, k):
  """Client k's parameters, as numpy arrays, out of one seed's state (snapshots.seed_state)."""
  return jax.tree.map(lambda a: np.asarray(a[sim.slot_of[k]]), params[sim.group_of[k]])

def make_method(n=5, c=C, **fields):
  cfg = config_lib.base_config('cifar10')
  cfg.fedgh.update(fields)
  return fedgh.FedGH(cfg, n, c)


@pytest.mark.parametrize('drop_last', [False, True])
def test_forward_pass_equals_per_sample_loop(drop_last):
  """client.forward_pass_sums, vmapped over clients as the engine runs it: the class sums and
  counts of r of every training sample, once, normalised and unaugmented, in padded batches; a
  dummy client (n = 0) adds none. With drop_last (training batches of 4) only the first
  floor(n / 4) 4 samples of the stored order count, as a loader that drops the partial batch.
  A one-layer stand-in for the model keeps the compile small (the rounds below run the CNN's)."""
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, size=(30, 32, 32, 3)).astype(np.uint8)
  labels = rng.integers(0, C, size=30).astype(np.int32)
  train_idx = np.stack([rng.permutation(30)[:19] for _ in range(3)]).astype(np.int32)
  n = np.array([19, 11, 0], np.int32)  # a partial last batch of 8, and a dummy
  data = DeviceData(images=jnp.asarray(images), labels=jnp.asarray(labels),
                           train_idx=jnp.asarray(train_idx), train_n=jnp.asarray(n),
                           test_idx=jnp.asarray(train_idx), test_n=jnp.asarray(n))
  cfg = training.TrainConfig(batch_size=4, drop_last=drop_last)
  w = rng.normal(size=(3 * 32 * 32, D)).astype(np.float32) * 0.02

  def apply_fn(variables, x):  # r = relu(x W_k), and some logits
    rep = jax.nn.relu(x.reshape(x.shape[0], -1) @ variables['params']['w'])
    return rep[:, :C], rep

  stats = lambda logits, rep, y, valid: base.class_sums(rep, y, valid, C)
  one = lambda p, idx, k: training.forward_pass_sums(p, idx, k, data, apply_fn=apply_fn, cfg=cfg,
                                                  batch_size=8, stats_fn=stats)
  params = {'w': jnp.asarray(np.stack([w, 2 * w, w]))}  # each client its own model
  got = jax.jit(jax.vmap(one))(params, data.train_idx, data.train_n)
  mean, std = np.asarray(cfg.mean), np.asarray(cfg.std)
  for k in range(3):
    sums, counts = np.zeros((C, D)), np.zeros(C)
    used = n[k] // 4 * 4 if drop_last else n[k]  # 16 and 8 of 19 and 11
    for i in train_idx[k, :used]:  # one sample at a time
      x = ((images[i] / 255.0 - mean) / std).reshape(-1)
      sums[labels[i]] += np.maximum(x @ (np.asarray(params['w'][k], np.float64)), 0)
      counts[labels[i]] += 1
    np.testing.assert_allclose(np.asarray(got.sum[k]), sums, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(got.count[k]), counts)


def test_upload_download_and_evaluated_header():
  method = make_method()
  rng = np.random.default_rng(1)
  seen = np.array([[1, 1, 0, 0], [0, 1, 1, 1]], bool)
  counts = np.where(seen, rng.integers(1, 9, size=seen.shape), 0).astype(np.float32)
  sums = (rng.normal(size=(2, C, D)) * counts[:, :, None]).astype(np.float32)
  acc = base.Accumulated(forward_pass=base.ClassSums(sum=jnp.asarray(sums),
                                                     count=jnp.asarray(counts)))
  up = jax.jit(jax.vmap(lambda a, s: method.upload({'model': {}}, a, None, base.NoState(),
                                                   client_view(0, s, 5, 1))))(
      acc, jnp.asarray(seen))
  for k in range(2):
    assert int(up.floats[k]) == D * seen[k].sum()
    want = np.where(seen[k][:, None], sums[k] / np.maximum(counts[k], 1)[:, None], 0)
    np.testing.assert_allclose(np.asarray(up.payload.protos[k]), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(up.payload.n[k]), counts[k])
  # The whole header is overwritten by H_g on download and at evaluation ('global_header').
  params = {'fc2': {'bias': jnp.ones(D)},  # a stand-in for a model: its header and one more
            'fc3': {'kernel': jnp.asarray(rng.normal(size=(D, C)), jnp.float32),
                    'bias': jnp.zeros(C)}}
  server = jax.jit(method.init_server)(jax.random.PRNGKey(3), jnp.asarray(seen))
  head = np.asarray(server.head)
  down = jax.jit(method.download)(params, base.NoState(), server,
                                  client_view(0, seen[0], 5, 0))
  np.testing.assert_array_equal(np.asarray(models.header_rows(down.params)), head)
  np.testing.assert_array_equal(down.params['fc2']['bias'], params['fc2']['bias'])
  assert int(down.floats) == ROW * C and method.forward_pass == 'after'
  np.testing.assert_array_equal(
      np.asarray(models.header_rows(method.eval_params(params, server, 0))), head)
  assert method.eval_reads_server
  own = make_method(eval='post_train')
  assert own.eval_params(params, server, 0) is params and not own.eval_reads_server
  assert make_method(proto_source='train_pass').forward_pass is None


def test_train_pass_option_accumulates_training_means():
  """proto_source='train_pass': no forward pass; the loss (plain CE) accumulates the class sums
  of the training batches' r, and the upload divides their counts by the E epochs."""
  epochs = 3
  cfg = config_lib.base_config('cifar10')
  cfg.fedgh.proto_source, cfg.local_epochs = 'train_pass', epochs
  method = fedgh.FedGH(cfg, 5, C)
  rng = np.random.default_rng(6)
  logits = rng.normal(size=(6, C)).astype(np.float32)
  rep = np.abs(rng.normal(size=(6, D))).astype(np.float32)
  y, valid = np.array([0, 1, 1, 3, 0, 2], np.int32), np.array([1, 1, 1, 1, 0, 0], bool)
  apply_fn = lambda variables, x: (variables['params']['z'], variables['params']['r'])
  loss, (correct, acc) = jax.jit(lambda: method.loss(
      apply_fn, {'model': {'z': logits, 'r': rep}}, (), (None,), y, valid))()
  want_ce = np.mean([-log_softmax(logits[j].astype(np.float64))[y[j]] for j in range(4)])
  assert float(loss) == pytest.approx(want_ce, rel=1e-5)
  for c in range(C):
    np.testing.assert_allclose(np.asarray(acc.sum[c]), rep[:4][y[:4] == c].sum(0), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(acc.count), [1, 2, 0, 1])
  seen = np.array([1, 1, 0, 1], bool)
  acc = jax.tree.map(lambda a: a * epochs, acc)  # E epochs over the same batch
  up = jax.jit(lambda a: method.upload({'model': {}}, base.Accumulated(loss=a), None,
                                       base.NoState(), client_view(0, seen, 4, 0)))(acc)
  np.testing.assert_array_equal(np.asarray(up.payload.n), [1, 2, 0, 1])
  np.testing.assert_allclose(np.asarray(up.payload.protos[1]), rep[1:3].mean(0), rtol=1e-6)
  assert method.forward_pass is None and int(up.floats) == 3 * D


def reference_sgd(head, protos, n_kc, participants, key, *, lr, epochs, batch, weight):
  """The server's SGD on H_g, one pair at a time in numpy: each epoch's order is
  argsort(where(valid, uniform(fold_in(key, epoch)), inf)), cut into batches of `batch`."""
  n, c, _ = protos.shape
  values, labels = protos.reshape(n * c, -1).astype(np.float64), np.tile(np.arange(c), n)
  held = ((n_kc > 0) & participants[:, None]).reshape(-1)
  w_all = np.where(held, n_kc.reshape(-1) if weight == 'samples' else 1.0, 0.0)
  h, losses = head.astype(np.float64), []
  for e in range(epochs):
    u = np.asarray(jax.random.uniform(jax.random.fold_in(key, e), (n * c,)))
    order = np.argsort(np.where(held, u, np.inf), kind='stable')[:held.sum()]
    for start in range(0, len(order), batch):
      grad, loss, total = np.zeros_like(h), 0.0, 0.0
      for j in order[start:start + batch]:
        x, y, w = values[j], labels[j], w_all[j]
        z = h[:, :-1] @ x + h[:, -1]
        p = np.exp(log_softmax(z))
        loss -= w * log_softmax(z)[y]
        p[y] -= 1.0  # dCE/dz
        grad += w * np.concatenate([np.outer(p, x), p[:, None]], axis=1)
        total += w
      h -= lr * grad / total
      losses.append(loss / total)
  return h, losses


def test_server_sgd_equals_plain_loop():
  """H_g's SGD with each pair weighted by its class sample count (`pair_weight='samples'`;
  'uniform' differs only in the weights, prototypes.round_pairs's, checked at the end)."""
  n, epochs, batch, lr, weight = 5, 2, 3, 0.5, 'samples'  # a large lr: the header moves
  method = make_method(n, server_epochs=epochs, server_batch=batch, server_lr=lr,
                       pair_weight=weight)
  rng = np.random.default_rng(2)
  seen = rng.random((n, C)) < 0.6
  seen[0] = [1, 1, 1, 0]
  protos = np.where(seen[:, :, None], np.abs(rng.normal(size=(n, C, D))), 0).astype(np.float32)
  n_kc = np.where(seen, rng.integers(1, 20, size=seen.shape), 0).astype(np.float32)
  participants = np.array([1, 0, 1, 1, 0], bool)
  server = jax.jit(method.init_server)(jax.random.PRNGKey(4), jnp.asarray(seen)).replace(
      uploads=jnp.asarray(protos), uploads_n=jnp.asarray(n_kc))
  key = jax.random.PRNGKey(5)
  agg = jax.jit(method.server_aggregate)(server, jnp.asarray(participants), 3, key)
  want, losses = reference_sgd(np.asarray(server.head), protos, n_kc, participants, key, lr=lr,
                               epochs=epochs, batch=batch, weight=weight)
  pairs = (seen & participants[:, None]).sum()
  assert len(losses) == epochs * -(-pairs // batch) and pairs % batch  # a partial batch
  np.testing.assert_allclose(np.asarray(agg.server.head), want, rtol=1e-4, atol=1e-5)
  assert np.abs(want - np.asarray(server.head)).max() > 1e-2  # the header did move
  assert float(agg.metrics['steps']) == len(losses)
  assert float(agg.metrics['loss']) == pytest.approx(np.mean(losses), rel=1e-4)
  assert float(agg.flops) == len(losses) * (6 * batch * ROW * C + 2 * ROW * C)
  # The uploads table is kept (the next round overwrites its participants' rows).
  np.testing.assert_array_equal(np.asarray(agg.server.uploads), protos)
  held = (seen & participants[:, None]).reshape(-1)
  for pair_weight, want in (('samples', np.where(held, n_kc.reshape(-1), 0)), ('uniform', held)):
    values, labels, weights = prototypes.round_pairs(protos, n_kc, participants, pair_weight)
    np.testing.assert_array_equal(np.asarray(weights), want)
    np.testing.assert_array_equal(np.asarray(labels), np.tile(np.arange(C), n))
    np.testing.assert_array_equal(np.asarray(values), protos.reshape(n * C, D))


def test_options():
  for field, value in (('pair_weight', 'mean'), ('proto_source', 'pass'), ('eval', 'local'),
                       ('server_epochs', 0), ('server_batch', 0), ('server_lr', 0.0)):
    with pytest.raises(ValueError, match=f'fedgh.{field}'):
      make_method(**{field: value})


@pytest.fixture(scope='module')
def two_rounds(small_ds):
  """FedGH's simulator, its initial state's server and two rounds (state, info) of it."""
  sim = make_small_sim(small_ds, 'fedgh')
  state = sim.init_state()
  head0 = np.asarray(snapshots.seed_state(sim.store, state).server.head)
  out = []
  for _ in range(2):
    state, (info,) = sim.run_round(state)
    out.append((snapshots.seed_state(sim.store, state), info))
  return sim, head0, out


@pytest.mark.slow  # a simulator compiled and run
def test_rounds_upload_post_training_prototypes(two_rounds, small_ds):
  sim, head0, out = two_rounds
  cd = sim.data
  seen = sim.seen[0]
  model = sim.groups[0].eval_model
  forward = jax.jit(lambda p, x: model.apply({'params': p}, x)[1])
  mean, std = np.asarray(sim.train_cfg.mean), np.asarray(sim.train_cfg.std)
  for state, info in out:
    server = state.server
    for k in info.cohort:  # the trained model's forward over the client's training split
      idx = np.asarray(cd.train_idx[0, k])[:int(sim.train_n[0, k])]
      x = (small_ds.images[idx] / 255.0 - mean) / std
      rep = np.asarray(forward(own_params(sim, state.population.params, k), x.astype(np.float32)),
                       np.float64)
      y = small_ds.labels[idx]
      for c in range(sim.num_classes):
        want = rep[y == c].mean(0) if seen[k, c] else np.zeros(D)
        np.testing.assert_allclose(np.asarray(server.uploads[k, c]), want, rtol=1e-4, atol=1e-5)
      np.testing.assert_array_equal(np.asarray(server.uploads_n[k]),
                                    np.bincount(y, minlength=sim.num_classes))
    np.testing.assert_array_equal(info.client_up_floats, D * seen[info.cohort].sum(1))
    np.testing.assert_array_equal(info.client_down_floats, ROW * sim.num_classes)
    # The pass's FLOPs: one forward over the n_k training samples.
    extra = (info.client_flops_per_client
             - sim.flops.per_client[info.cohort] * info.train_samples)
    np.testing.assert_allclose(extra, sim.flops.forward('cnn5') * sim.train_n[0, info.cohort],
                               rtol=1e-6)
    assert np.isfinite(info.server_metrics['loss']) and info.server_flops > 0
  assert np.abs(np.asarray(out[0][0].server.head) - head0).max() > 0  # H_g trained
