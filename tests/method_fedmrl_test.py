"""FedMRL (docs/algorithm.md §6): the sizes P_S and P_J against the spec's, the client loss and its
gradient against a plain per-client computation, the download, upload and client state (with
`reset_projector`), the server's weighted mean against a hand-written one, the evaluated forward
against a plain per-sample computation, the stores bringing the client state to evaluation
calls, and one simulator through a round and its evaluation (against a numpy CNN)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, methods, models
from fedssa_jax.engine import population, schedule, snapshots
from fedssa_jax.engine.placement import Placement
from fedssa_jax.engine.state import block_rows
from fedssa_jax.methods import base, fedmrl
from fedssa_jax.methods.aggregation import Inbox

from conftest import (aggregate, assert_floats_each_way, ce_loop, client_view, make_small_sim,
                      params_of, random_params, rounds)

C = 4
D1 = 128
IMPL = 'band'  # the quickest of the three formulations to compile, forward and backward


def make_method(num_clients=5, num_classes=C, **fields):
  c = config_lib.base_config('cifar10')
  c.model.conv_impl = IMPL
  c.fedmrl.update(fields)
  return fedmrl.FedMRL(c, num_clients, num_classes)


class TinyOwn(nn.Module):
  """A stand-in for a client's family in the loss and forward checks (the method sees only its
  (logits, 500-d representation) and its header fc3), cheaper to compile than a CNN: the
  simulator below trains and evaluates real ones."""
  num_classes: int

  @nn.compact
  def __call__(self, x):
    rep = nn.relu(models.Dense(500, name='fc2')(x.mean(axis=(1, 2))))
    return models.Dense(self.num_classes, name='fc3')(rep), rep


def random_proj(seed, d1=D1, scale=0.05):
  rng = np.random.default_rng(seed)
  return {'kernel': jnp.asarray(rng.normal(scale=scale, size=(d1 + 500, 500)), jnp.float32),
          'bias': jnp.asarray(rng.normal(scale=scale, size=(500,)), jnp.float32)}


def host(tree):
  """numpy copies (indexing them compiles nothing, unlike indexing device arrays eagerly)."""
  return jax.tree.map(np.asarray, tree)


def test_sizes_are_the_spec_s_and_config_is_checked():
  # HTFL.md §3.2: P_S = 478,676 + 129 C (fc2 -> d1 = 128); pooled: 665,048 + 129 C.
  assert make_method(num_classes=10).shared_floats == 479_966
  assert make_method(num_classes=100).shared_floats == 491_576
  assert make_method(num_classes=10, shared_model='pool').shared_floats == 666_338
  assert make_method(num_classes=100, shared_model='pool').shared_floats == 677_948
  method = make_method()
  assert method.shared_floats == 478_676 + 129 * C
  state = jax.eval_shape(method.init_client_state, jax.random.PRNGKey(0))
  assert models.param_count(state) == method.projector_floats == 314_500  # P_J
  assert state.proj['kernel'].shape == (D1 + 500, 500)
  server = jax.eval_shape(method.init_server, jax.random.PRNGKey(1), jnp.ones((5, C), bool))
  assert models.param_count(server.shared) == method.shared_floats
  assert server.shared['fc2']['kernel'].shape == (500, D1)
  assert server.shared['fc3']['kernel'].shape == (D1, C)
  assert server.inbox.weighted and not make_method(aggregation='uniform').weighted
  defaults = config_lib.base_config('cifar10').fedmrl
  assert (defaults.d1, defaults.shared_model, defaults.aggregation,
          defaults.reset_projector) == (128, 'fc2', 'samples', False)
  for field, value in (('d1', 0), ('d1', 501), ('shared_model', 'wide'),
                       ('aggregation', 'median')):
    with pytest.raises(ValueError, match=f'fedmrl.{field}'):
      make_method(**{field: value})


def test_feature_pool_is_torch_s_adaptive_average_pool_over_features():
  # The 'pool' shared model's pooling (HtFLlib): output i averages inputs
  # floor(i D / d1) .. ceil((i + 1) D / d1) - 1, windows overlapping where d1 does not divide D.
  x = np.random.default_rng(1).normal(size=(3, 500))
  want = np.stack([x[:, i * 500 // D1:-(-(i + 1) * 500 // D1)].mean(1) for i in range(D1)], 1)
  got = np.asarray(models.feature_pool(jnp.asarray(x, jnp.float32), D1))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_only_methods_overriding_eval_forward_read_the_client_state_in_evaluation():
  # The paper's eight keep the family's apply alone (and their evaluation programs).
  for name in ('fedssa', 'standalone', 'fd', 'fedproto', 'fml', 'fedkd', 'lg_fedavg',
               'fedclassavg'):
    method = methods.get_method(name)(config_lib.base_config('cifar10'), 5, C)
    assert not method.eval_reads_state, name
  assert make_method().eval_reads_state and make_method().eval_reads_server


def plain_loss(own, shared_model, t, x, y, valid):
  """The spec's loss on one client, written out: (loss, (z_F, z_G))."""
  _, r = own.apply({'params': t['model']}, x)
  _, g = shared_model.apply({'params': t['shared']}, x)
  u = jnp.concatenate([g, r], axis=1) @ t['proj']['kernel'] + t['proj']['bias']
  z_f = u @ t['model']['fc3']['kernel'] + t['model']['fc3']['bias']
  z_g = u[:, :D1] @ t['shared']['fc3']['kernel'] + t['shared']['fc3']['bias']
  n = valid.sum()

  def ce(z):
    lp = jax.nn.log_softmax(z)
    return -jnp.sum(jnp.where(valid, jnp.take_along_axis(lp, y[:, None], 1)[:, 0], 0.0)) / n
  return ce(z_f) + ce(z_g), (z_f, z_g)


def test_loss_and_gradient_equal_plain_per_client_computation():
  method = make_method()
  own = TinyOwn(C)
  k, b = 2, 6
  clients = [host({'model': random_params(own, i),
                   'shared': random_params(method.shared_model, 2 + i),
                   'proj': random_proj(4 + i)}) for i in range(k)]
  trainable = jax.tree.map(lambda *a: np.stack(a), *clients)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(k, b, 32, 32, 3)).astype(np.float32)
  y = rng.integers(0, C, size=(k, b)).astype(np.int32)
  valid = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]], bool)

  def loss(t, x, y, v):
    return method.loss(own.apply, t, None, (x,), y, v)

  (loss_v, (correct_v, acc_v)), grads_v = host(jax.jit(jax.vmap(jax.value_and_grad(
      loss, has_aux=True)))(trainable, x, y, valid))
  assert acc_v is None  # the loss accumulates nothing
  plain = jax.jit(jax.value_and_grad(
      lambda t, x, y, v: plain_loss(own, method.shared_model, t, x, y, v), has_aux=True))
  for i in range(k):  # one client at a time, no vmap
    take = lambda tree: jax.tree.map(lambda a: a[i], tree)
    (want, (z_f, z_g)), want_grads = host(plain(clients[i], x[i], y[i], valid[i]))
    ce_f, right = ce_loop(z_f, y[i], valid[i])
    ce_g, _ = ce_loop(z_g, y[i], valid[i])
    np.testing.assert_allclose(float(loss_v[i]), ce_f + ce_g, rtol=1e-5)
    np.testing.assert_allclose(float(loss_v[i]), float(want), rtol=1e-5)
    assert int(correct_v[i]) == right  # the local header's predictions
    # Nothing detached: every entry's gradient is the whole loss's, each header its own term's.
    assert set(grads_v) == {'model', 'shared', 'proj'}
    for (path, got), w in zip(jax.tree_util.tree_leaves_with_path(take(grads_v)),
                              jax.tree_util.tree_leaves(want_grads)):
      np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-6,
                                 err_msg=jax.tree_util.keystr(path))
    assert np.abs(want_grads['proj']['kernel']).max() > 0


@pytest.mark.parametrize('aggregation,reset', [('samples', False), ('uniform', True)])
def test_download_upload_and_client_state(aggregation, reset):
  method = make_method(aggregation=aggregation, reset_projector=reset)
  params, shared = random_params(TinyOwn(C), 0), random_params(method.shared_model, 1)
  state = fedmrl.FedMRLState(proj=random_proj(2))
  server = fedmrl.FedMRLServer(shared=shared, inbox=None)  # download reads G_g alone
  view = client_view(3, jnp.ones(C, bool), 7, 2)
  down = method.download(params, state, server, view)
  assert down.params is params and down.ctx is None
  assert down.aux['shared'] is shared and down.aux['proj'] is state.proj
  assert int(down.floats) == 478_676 + 129 * C and down.floats.dtype == jnp.int32
  trained = {'model': params, 'shared': random_params(method.shared_model, 3),
             'proj': random_proj(4)}
  up = method.upload(trained, base.Accumulated(), down.ctx, state, view)
  assert up.params is params and int(up.floats) == int(down.floats)
  assert up.payload.value is trained['shared']
  assert float(up.payload.weight) == (7.0 if aggregation == 'samples' else 1.0)
  # The trained J_k is kept; reset_projector (HtFLlib) keeps the one it started from, so the next
  # round's download starts from it again.
  assert up.state.proj is (state.proj if reset else trained['proj'])
  again = method.download(params, up.state, server, view)
  assert again.aux['proj'] is (state.proj if reset else trained['proj'])


@pytest.mark.parametrize('aggregation', ['samples', 'uniform'])
def test_server_mean_over_chunks_with_a_dummy_equals_hand_weighted_mean(aggregation):
  n = 5
  method = make_method(num_clients=n, aggregation=aggregation)
  # The rule is the same for any tree of arrays: a small one stands in for G.
  rng = np.random.default_rng(0)
  old = {'fc1': {'kernel': jnp.asarray(rng.normal(size=(6, 3)), jnp.float32),
                 'bias': jnp.asarray(rng.normal(size=(3,)), jnp.float32)},
         'fc3': {'kernel': jnp.asarray(rng.normal(size=(3, C)), jnp.float32)}}
  server = fedmrl.FedMRLServer(shared=old,
                               inbox=Inbox.empty(old, weighted=method.weighted))
  leaves, treedef = jax.tree_util.tree_flatten(old)
  rng = np.random.default_rng(1)
  n_k = {0: 9.0, 3: 2.0, 4: 5.0, 1: 100.0}  # client 1 is the dummy, with a weight of its own
  chunks = [([0, 3, 1], [True, True, False]), ([4], [True])]
  received = []
  for ids, active in chunks:
    up = [rng.normal(size=(len(ids), *l.shape)).astype(np.float32) for l in leaves]
    w = np.array([n_k[i] if aggregation == 'samples' else 1.0 for i in ids], np.float32)
    payload = base.WeightedUpload(
        value=jax.tree_util.tree_unflatten(treedef, [jnp.asarray(u) for u in up]),
        weight=jnp.asarray(w))
    server = method.server_receive(server, jnp.asarray(ids), payload, jnp.asarray(active))
    received += [(w[j], [u[j] for u in up]) for j in range(len(ids)) if active[j]]
  participants = np.isin(np.arange(n), [0, 3, 4])
  server = aggregate(method, server, participants, 0)
  total = sum(w for w, _ in received)
  for li, got in enumerate(jax.tree_util.tree_leaves(server.shared)):
    want = sum(w * np.asarray(u[li], np.float64) for w, u in received) / total
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
  assert not np.asarray(server.inbox.weight).any()
  # A round without uploads keeps G_g.
  again = aggregate(method, server, np.zeros(n, bool), 1)
  for a, b in zip(jax.tree_util.tree_leaves(again.shared),
                  jax.tree_util.tree_leaves(server.shared)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_eval_forward_and_shared_accuracy_equal_plain_per_sample_computation():
  method = make_method()
  own = TinyOwn(C)
  params = random_params(own, 0, scale=0.1)
  server = fedmrl.FedMRLServer(shared=random_params(method.shared_eval_model, 1, scale=0.1),
                               inbox=None)
  state = fedmrl.FedMRLState(proj=random_proj(2, scale=0.1))
  rng = np.random.default_rng(3)
  b = 4
  x = rng.normal(size=(b, 32, 32, 3)).astype(np.float32)
  y = rng.integers(0, C, size=b).astype(np.int32)
  valid = np.array([True, True, True, False])

  def forward(params, state, server, x, y, valid):
    logits, u = method.eval_forward(own.apply, params, state, server, 0, x)
    return logits, u, method.eval_extra(server, 0, logits, u, y, valid)

  logits, u, extra = host(jax.jit(forward)(params, state, server, x, y, valid))
  assert method.eval_reads_state and method.eval_reads_server
  assert method.eval_metrics == ('shared_accuracy',) and set(extra) == {'shared_accuracy'}
  reps = jax.jit(lambda params, shared, x: (
      own.apply({'params': params}, x)[1],
      method.shared_eval_model.apply({'params': shared}, x)[1]))
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), (params, server.shared, state.proj))
  reps_of = lambda xj: host(reps(params, server.shared, xj))
  right = 0
  for j in range(b):  # one sample at a time
    r, g = (a.astype(np.float64)[0] for a in reps_of(x[j:j + 1]))
    assert g.shape == (D1,)
    uj = np.concatenate([g, r]) @ p[2]['kernel'] + p[2]['bias']
    zj = uj @ p[0]['fc3']['kernel'] + p[0]['fc3']['bias']
    zg = uj[:D1] @ p[1]['fc3']['kernel'] + p[1]['fc3']['bias']
    # float32 sums of 628 terms against float64 ones: to 1e-5 of the vectors' scale
    np.testing.assert_allclose(u[j], uj, atol=1e-5 * np.abs(uj).max())
    np.testing.assert_allclose(logits[j], zj, atol=1e-5 * np.abs(zj).max())
    right += bool(valid[j]) and int(np.argmax(zg) == y[j])
  assert int(extra['shared_accuracy']) == right


def test_stores_bring_the_members_state_rows_to_evaluation_calls_only_when_asked():
  """Both kinds of store: the block's parameter rows, and (with_state) its members' client-state
  rows, reach the evaluation call; without it, the call takes what it took before."""
  g = schedule.Group('cnn5', np.array([1, 3, 4]), None, 2, 3, None)
  slot_params = {'w': np.arange(6.0, dtype=np.float32).reshape(3, 2)}  # the group's 3 rows
  state = {'s': np.arange(5, dtype=np.float32) * 10}                  # every client's, N = 5
  jobs = [(0, np.array([0, 2, 2]), 2)]  # slots 0 and 2, padded by repeating the last
  place = Placement(1)
  stacked = lambda tree: jax.tree.map(lambda a: jnp.asarray(a)[None], tree)  # the seed axis
  server = stacked({'z': np.zeros(1)})
  for name in ('device', 'host'):
    store = population.STORES[name](place, [g], 5, 1, None, None)
    held = store.stacked([((slot_params,), state)])  # the store's own, as from a checkpoint
    for with_state in (False, True):
      def rows(p, cids, valid, server, data_, *state_rows):
        return block_rows(p), cids, valid, state_rows  # the device store names the rows
      calls = [store.eval_call(g, rows, with_state=with_state)]
      (_, _, (p, cids, valid, state_rows)), = store.evaluate(
          held, 0, jobs, calls, server, None, with_state)
      np.testing.assert_array_equal(np.asarray(p['w']), slot_params['w'][[0, 2, 2]], name)
      np.testing.assert_array_equal(np.asarray(cids), [1, 4, 4], name)
      np.testing.assert_array_equal(np.asarray(valid), [True, True, False], name)
      if with_state:
        (got,) = state_rows
        np.testing.assert_array_equal(np.asarray(got['s']), [10.0, 40.0, 40.0], name)
      else:
        assert state_rows == (), name


# -- One simulator through a round (shared by the checks below) ---------------------------------

@pytest.fixture(scope='module')
def run(small_ds):
  """(simulator, its seed's state before and after one round, the stacked state after it, the
  round's RoundInfo)."""
  sim = make_small_sim(small_ds, 'fedmrl')
  state = sim.init_state()
  before = snapshots.seed_state(sim.store, state)  # host copies: a round donates the state
  (state, info), = rounds(sim, 1, state)
  return sim, before, snapshots.seed_state(sim.store, state), state, info


def numpy_representation(p, x):
  """A CNN's representation (models.CNN: conv, ReLU, max-pool twice, fc1, fc2, ReLUs) of NHWC
  images `x`, in float64 numpy."""
  relu = lambda a: np.maximum(a, 0.0)

  def conv_relu_pool(x, layer):
    patches = np.lib.stride_tricks.sliding_window_view(x, (5, 5), axis=(1, 2))  # b h w c i j
    b, h, w = patches.shape[:3]
    kernel = layer['kernel'].transpose(2, 0, 1, 3).reshape(-1, layer['kernel'].shape[-1])
    y = relu(patches.reshape(b * h * w, -1) @ kernel + layer['bias']).reshape(b, h, w, -1)
    c = y.shape[-1]
    return y.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))

  x = conv_relu_pool(conv_relu_pool(x, p['conv1']), p['conv2']).reshape(len(x), -1)
  x = relu(x @ p['fc1']['kernel'] + p['fc1']['bias'])
  return relu(x @ p['fc2']['kernel'] + p['fc2']['bias'])


def plain_eval(sim, state, seed_state):
  """Every client's test accuracy and shared accuracy by the spec's formula, sample by sample
  in numpy, from its parameters (of the stacked `state`), its projector and the server's G_g
  (of its seed's): [N] and [N]."""
  data_, cfg = sim.seed_data[0], sim.train_cfg
  images, test_idx, test_n, labels = host(
      (data_.images, data_.test_idx, data_.test_n, data_.labels))
  mean, std = np.asarray(cfg.mean), np.asarray(cfg.std)
  f64 = lambda tree: jax.tree.map(lambda a: np.asarray(a, np.float64), tree)
  shared = f64(seed_state.server.shared)
  group_params = host(state.population.params)  # then indexed on the host (params_of would compile)
  acc, shared_acc = np.zeros(sim.num_clients), np.zeros(sim.num_clients)
  for k in range(sim.num_clients):
    assert sim.groups[sim.group_of[k]].family == 'cnn5'
    params = f64(params_of(sim, group_params, k))
    proj = f64(jax.tree.map(lambda a: a[k], seed_state.population.client_state.proj))
    idx = test_idx[k][:int(test_n[k])]
    x = (images[idx] / 255.0 - mean) / std  # augment.normalize
    y = labels[idx]
    r, g = numpy_representation(params, x), numpy_representation(shared, x)
    u = np.concatenate([g, r], axis=1) @ proj['kernel'] + proj['bias']
    z = u @ params['fc3']['kernel'] + params['fc3']['bias']
    z_g = u[:, :D1] @ shared['fc3']['kernel'] + shared['fc3']['bias']
    acc[k], shared_acc[k] = np.mean(np.argmax(z, 1) == y), np.mean(np.argmax(z_g, 1) == y)
  return acc, shared_acc


@pytest.mark.slow  # a simulator compiled and run through a round
def test_a_round_sends_p_s_each_way_keeps_projectors_and_moves_g(run):
  sim, before, after, state, info = run
  p_s = 478_676 + 129 * 10
  for fam, fps in sim.flops.per_sample.items():
    shared = sim.flops.model('cnn5') + 6.0 * (500 * D1 + D1 * 10 - 500 * 500 - 500 * 10)
    assert fps == pytest.approx(sim.flops.model(fam) + shared + 6.0 * (D1 + 500) * 500)
  assert np.isfinite(info.train_loss)
  assert_floats_each_way(info, p_s)
  assert state.costs.up_floats[0] == state.costs.down_floats[0] == 2 * p_s
  trained = info.cohort
  assert len(trained) == 2
  # Each client's J_k: its own draw of PyTorch's Linear(628, 500) init.
  first = before.population.client_state.proj['kernel']
  bound = 1 / np.sqrt(D1 + 500)
  assert np.abs(first).max() <= bound and np.abs(first).max() > 0.9 * bound
  assert not np.allclose(first[0], first[1])
  for k in range(sim.num_clients):  # J_k moved exactly for the clients that trained
    moved = not np.allclose(before.population.client_state.proj['kernel'][k],
                            after.population.client_state.proj['kernel'][k])
    assert moved == (k in trained), k
  for a, b in zip(jax.tree_util.tree_leaves(before.server.shared),
                  jax.tree_util.tree_leaves(after.server.shared)):
    assert not np.allclose(np.asarray(a), np.asarray(b))  # every tensor of G_g moved


@pytest.mark.slow  # a simulator's evaluation compiled and run
def test_evaluation_uses_each_client_s_projector_and_the_latest_g(run):
  sim, _, after, state, _ = run
  ev = sim.evaluate(state)
  assert set(ev.metrics) == {'shared_accuracy'}
  acc, shared_acc = plain_eval(sim, state, after)
  ids = ev.evaluated
  np.testing.assert_allclose(ev.accuracy[ids], acc[ids], atol=1e-9)
  np.testing.assert_allclose(ev.metrics['shared_accuracy'][ids], shared_acc[ids], atol=1e-9)
