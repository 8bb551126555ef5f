"""FedMRL (docs/algorithm.md §6): the sizes P_S and P_J against the spec's, the client loss and its
gradient against a plain per-client computation, the download, upload and client state (with
`reset_projector`), the server's weighted mean against a hand-written one, the evaluated forward
against a plain per-sample computation, and one simulator through rounds and evaluation (device
and host stores)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import augment, config_lib, methods, models
from fedssa_jax.methods import base, fedmrl

from conftest import (aggregate, assert_floats_each_way, ce_loop, client_view, make_small_sim,
                      params_of, random_params, rounds, stack_trees)

C = 4
D1 = 128
IMPL = 'band'  # the quickest of the three formulations to compile, forward and backward


def make_method(num_clients=5, num_classes=C, **fields):
  c = config_lib.base_config('cifar10')
  c.model.conv_impl = IMPL
  c.fedmrl.update(fields)
  return fedmrl.FedMRL(c, num_clients, num_classes)


def random_proj(seed, d1=D1, scale=0.05):
  rng = np.random.default_rng(seed)
  return {'kernel': jnp.asarray(rng.normal(scale=scale, size=(d1 + 500, 500)), jnp.float32),
          'bias': jnp.asarray(rng.normal(scale=scale, size=(500,)), jnp.float32)}


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
  assert state['proj']['kernel'].shape == (D1 + 500, 500)
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


def test_only_methods_overriding_eval_forward_read_the_client_state_in_evaluation():
  # The paper's eight keep the family's apply alone (and their evaluation programs).
  for name in ('fedssa', 'standalone', 'fd', 'fedproto', 'fml', 'fedkd', 'lg_fedavg',
               'fedclassavg'):
    method = methods.get_method(name)(config_lib.base_config('cifar10'), 5, C)
    assert not method.eval_reads_state, name
  assert make_method().eval_reads_state and make_method().eval_reads_server


def test_projectors_are_independent_draws_of_torch_s_init():
  method = make_method()
  a, b = (np.asarray(method.init_client_state(jax.random.PRNGKey(k))['proj']['kernel'])
          for k in (0, 1))
  bound = 1 / np.sqrt(D1 + 500)  # PyTorch's Linear(628, 500)
  assert np.abs(a).max() <= bound and np.abs(a).max() > 0.9 * bound
  assert not np.allclose(a, b)


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
  own = models.make_model('cnn5', C, IMPL)
  k, b = 2, 6
  trainable = stack_trees([{'model': random_params(own, i),
                            'shared': random_params(method.shared_model, 2 + i),
                            'proj': random_proj(4 + i)} for i in range(k)])
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(k, b, 32, 32, 3)), jnp.float32)
  y = jnp.asarray(rng.integers(0, C, size=(k, b)), jnp.int32)
  valid = jnp.asarray([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]], bool)

  def loss(t, x, y, v):
    return method.loss(own.apply, t, (), (x,), y, v)

  (loss_v, (correct_v, acc_v)), grads_v = jax.jit(jax.vmap(jax.value_and_grad(
      loss, has_aux=True)))(trainable, x, y, valid)
  assert acc_v == {}
  plain = jax.jit(jax.value_and_grad(
      lambda t, x, y, v: plain_loss(own, method.shared_model, t, x, y, v), has_aux=True))
  for i in range(k):  # one client at a time, no vmap
    take = lambda tree: jax.tree.map(lambda a: a[i], tree)
    (want, (z_f, z_g)), want_grads = plain(take(trainable), x[i], y[i], valid[i])
    ce_f, right = ce_loop(z_f, np.asarray(y[i]), np.asarray(valid[i]))
    ce_g, _ = ce_loop(z_g, np.asarray(y[i]), np.asarray(valid[i]))
    np.testing.assert_allclose(float(loss_v[i]), ce_f + ce_g, rtol=1e-5)
    np.testing.assert_allclose(float(loss_v[i]), float(want), rtol=1e-5)
    assert int(correct_v[i]) == right  # the local header's predictions
    # Nothing detached: every entry's gradient is the whole loss's, each header its own term's.
    assert set(grads_v) == {'model', 'shared', 'proj'}
    for (path, got), w in zip(jax.tree_util.tree_leaves_with_path(take(grads_v)),
                              jax.tree_util.tree_leaves(want_grads)):
      np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=1e-4, atol=1e-6,
                                 err_msg=jax.tree_util.keystr(path))
    assert np.abs(np.asarray(want_grads['proj']['kernel'])).max() > 0


@pytest.mark.parametrize('aggregation,reset', [('samples', False), ('uniform', True)])
def test_download_upload_and_client_state(aggregation, reset):
  method = make_method(aggregation=aggregation, reset_projector=reset)
  own = models.make_model('cnn5', C, IMPL)
  params, shared = random_params(own, 0), random_params(method.shared_model, 1)
  state = {'proj': random_proj(2)}
  server = fedmrl.FedMRLServer(shared=shared, inbox=base.Inbox.empty(shared, weighted=True))
  view = client_view(3, jnp.ones(C, bool), 7, 2)
  down = method.download(params, state, server, view)
  assert down.params is params and down.ctx == ()
  assert down.aux['shared'] is shared and down.aux['proj'] is state['proj']
  assert int(down.floats) == 478_676 + 129 * C and down.floats.dtype == jnp.int32
  trained = {'model': params, 'shared': random_params(method.shared_model, 3),
             'proj': random_proj(4)}
  up = method.upload(trained, {}, down.ctx, state, view)
  assert up.params is params and int(up.floats) == int(down.floats)
  assert up.payload['shared'] is trained['shared']
  assert float(up.payload['weight']) == (7.0 if aggregation == 'samples' else 1.0)
  # The trained J_k is kept; reset_projector (HtFLlib) keeps the one it started from, so the next
  # round's download starts from it again.
  assert up.state['proj'] is (state['proj'] if reset else trained['proj'])
  again = method.download(params, up.state, server, view)
  assert again.aux['proj'] is (state['proj'] if reset else trained['proj'])


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
                               inbox=base.Inbox.empty(old, weighted=method.weighted))
  leaves, treedef = jax.tree_util.tree_flatten(old)
  rng = np.random.default_rng(1)
  n_k = {0: 9.0, 3: 2.0, 4: 5.0, 1: 100.0}  # client 1 is the dummy, with a weight of its own
  chunks = [([0, 3, 1], [True, True, False]), ([4], [True])]
  received = []
  for ids, active in chunks:
    up = [rng.normal(size=(len(ids), *l.shape)).astype(np.float32) for l in leaves]
    w = np.array([n_k[i] if aggregation == 'samples' else 1.0 for i in ids], np.float32)
    payload = {'shared': jax.tree_util.tree_unflatten(treedef, [jnp.asarray(u) for u in up]),
               'weight': jnp.asarray(w)}
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
  own = models.make_model('cnn5', C, IMPL, forward_only=True)
  params = random_params(own, 0, scale=0.1)
  server = fedmrl.FedMRLServer(shared=random_params(method.shared_eval_model, 1, scale=0.1),
                               inbox=None)
  state = {'proj': random_proj(2, scale=0.1)}
  rng = np.random.default_rng(3)
  b = 4
  x = jnp.asarray(rng.normal(size=(b, 32, 32, 3)), jnp.float32)
  y = jnp.asarray(rng.integers(0, C, size=b), jnp.int32)
  valid = jnp.asarray([True, True, True, False])

  def forward(params, state, server, x, y, valid):
    logits, u = method.eval_forward(own.apply, params, state, server, 0, x)
    return logits, u, method.eval_extra(server, 0, logits, u, y, valid)

  logits, u, extra = jax.jit(forward)(params, state, server, x, y, valid)
  assert method.eval_reads_state and method.eval_reads_server
  assert method.eval_metrics == ('shared_accuracy',) and set(extra) == {'shared_accuracy'}
  reps = jax.jit(lambda params, shared, x: (
      own.apply({'params': params}, x)[1],
      method.shared_eval_model.apply({'params': shared}, x)[1]))
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), (params, server.shared, state['proj']))
  right = 0
  for j in range(b):  # one sample at a time
    r, g = (np.asarray(a, np.float64)[0] for a in reps(params, server.shared, x[j:j + 1]))
    assert g.shape == (D1,)
    uj = np.concatenate([g, r]) @ p[2]['kernel'] + p[2]['bias']
    zj = uj @ p[0]['fc3']['kernel'] + p[0]['fc3']['bias']
    zg = uj[:D1] @ p[1]['fc3']['kernel'] + p[1]['fc3']['bias']
    # float32 sums of 628 terms against float64 ones: to 1e-5 of the vectors' scale
    np.testing.assert_allclose(np.asarray(u[j]), uj, atol=1e-5 * np.abs(uj).max())
    np.testing.assert_allclose(np.asarray(logits[j]), zj, atol=1e-5 * np.abs(zj).max())
    right += bool(valid[j]) and int(np.argmax(zg) == int(y[j]))
  assert int(extra['shared_accuracy']) == right


# -- One simulator through rounds (shared by the checks below) -----------------------------------

@pytest.fixture(scope='module')
def run(small_ds):
  """(simulator, its seed's state before and after 2 rounds, the final state, each round's
  RoundInfo)."""
  sim = make_small_sim(small_ds, 'fedmrl')
  state = sim.init_state()
  before, infos = sim.seed_state(state), []  # host copies: a round donates the state's buffers
  for state, info in rounds(sim, sim.config.num_rounds, state):
    infos.append(info)
  return sim, before, sim.seed_state(state), state, infos


def plain_eval(sim, state, seed_state):
  """Every client's test accuracy and shared accuracy by the spec's formula, from its
  parameters (of the stacked `state`), its projector and the server's G_g (of its seed's):
  [N] and [N]."""
  data_, cfg = sim.seed_data[0], sim.train_cfg
  # The two extractors on a client's padded test split (one program for all clients).
  reps = jax.jit(lambda params, shared, idx: (
      sim.groups[0].eval_model.apply(
          {'params': params}, augment.normalize(data_.images[idx], cfg.mean, cfg.std))[1],
      sim.method.shared_eval_model.apply(
          {'params': shared}, augment.normalize(data_.images[idx], cfg.mean, cfg.std))[1]))
  shared = jax.tree.map(lambda a: np.asarray(a, np.float64), seed_state.server.shared)
  acc, shared_acc = np.zeros(sim.num_clients), np.zeros(sim.num_clients)
  for k in range(sim.num_clients):
    assert sim.groups[sim.group_of[k]].family == 'cnn5'
    params = params_of(sim, state.params, k)
    proj = jax.tree.map(lambda a: np.asarray(a[k], np.float64), seed_state.client_state['proj'])
    n = int(data_.test_n[k])
    r, g = (np.asarray(a, np.float64)[:n]
            for a in reps(params, seed_state.server.shared, data_.test_idx[k]))
    y = np.asarray(data_.labels[data_.test_idx[k][:n]])
    u = np.concatenate([g, r], axis=1) @ proj['kernel'] + proj['bias']
    z = u @ params['fc3']['kernel'] + params['fc3']['bias']
    z_g = u[:, :D1] @ shared['fc3']['kernel'] + shared['fc3']['bias']
    acc[k], shared_acc[k] = np.mean(np.argmax(z, 1) == y), np.mean(np.argmax(z_g, 1) == y)
  return acc, shared_acc


@pytest.mark.slow  # a simulator compiled and run through rounds
def test_rounds_send_p_s_each_way_keep_projectors_and_move_g(run):
  sim, before, after, state, infos = run
  p_s = 478_676 + 129 * 10
  for fam, fps in sim.flops_per_sample.items():
    shared = sim.model_flops('cnn5') + 6.0 * (500 * D1 + D1 * 10 - 500 * 500 - 500 * 10)
    assert fps == pytest.approx(sim.model_flops(fam) + shared + 6.0 * (D1 + 500) * 500)
  for info in infos:
    assert np.isfinite(info.train_loss)
    assert_floats_each_way(info, p_s)
  assert state.costs.up_floats[0] == state.costs.down_floats[0] == 2 * 2 * p_s
  trained = np.unique(np.concatenate([i.cohort for i in infos]))
  for k in range(sim.num_clients):  # J_k moved exactly for the clients that trained
    moved = not np.allclose(before.client_state['proj']['kernel'][k],
                            after.client_state['proj']['kernel'][k])
    assert moved == (k in trained), k
  for a, b in zip(jax.tree_util.tree_leaves(before.server.shared),
                  jax.tree_util.tree_leaves(after.server.shared)):
    assert not np.allclose(np.asarray(a), np.asarray(b))  # every tensor of G_g moved


@pytest.mark.slow  # a simulator's evaluation compiled and run
def test_evaluation_uses_each_client_s_projector_and_the_latest_g(run, small_ds):
  sim, _, after, state, _ = run
  ev = sim.evaluate(state)
  assert set(ev.metrics) == {'shared_accuracy'}
  acc, shared_acc = plain_eval(sim, state, after)
  ids = ev.evaluated
  np.testing.assert_allclose(ev.accuracy[ids], acc[ids], atol=1e-9)
  np.testing.assert_allclose(ev.metrics['shared_accuracy'][ids], shared_acc[ids], atol=1e-9)
  # The host store brings the state rows to its evaluation calls itself: the same results.
  host = make_small_sim(small_ds, 'fedmrl', population_store='host')
  ev_host = host.evaluate(host.stacked([sim.saved(state)]))
  np.testing.assert_array_equal(ev_host.accuracy, ev.accuracy)
  np.testing.assert_array_equal(ev_host.metrics['shared_accuracy'],
                                ev.metrics['shared_accuracy'])
