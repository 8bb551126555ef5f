"""FML (docs/algorithm.md §6): the mutual-learning loss against a numpy hand computation, the meme
average against a plain loop, the float counts, and one engine round trip."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, models
from fedssa_jax.engine import snapshots
from fedssa_jax.methods import aggregation, base, fml

from conftest import (aggregate, assert_floats_each_way, client_view, log_softmax,
                      random_params, rounds, stack_trees)

C = 4
D = config_lib.base_config('cifar10').model.feature_dim  # d of the methods' configs


def make_method(num_clients=5, num_classes=C, alpha=0.3, beta=0.6):
  c = config_lib.base_config('cifar10')
  c.model.conv_impl = 'im2col'
  c.fml.alpha, c.fml.beta = alpha, beta
  return fml.FML(c, num_clients, num_classes)


def test_p5_counted_from_params_and_floats_each_way():
  assert make_method(num_classes=10).meme_floats == 670_058
  method = make_method()
  p5 = 665_048 + 501 * C
  assert method.meme_floats == p5
  server_shapes = jax.eval_shape(method.init_server, jax.random.PRNGKey(1),
                                 jnp.ones((5, C), bool))
  assert models.param_count(server_shapes.meme) == p5
  params = random_params(models.make_model('cnn4', C, 'im2col', feature_dim=D), 0)
  meme = random_params(method.meme_model, 1)
  server = fml.FMLServer(meme=meme, inbox=aggregation.Inbox(meme, jnp.int32(0)))
  down = method.download(params, base.NoState(), server, client_view(2, jnp.ones(C, bool), 0, 0))
  assert int(down.floats) == p5 and down.floats.dtype == jnp.int32
  assert down.aux['meme'] is meme and down.params is params
  up = method.upload({'model': params, **down.aux}, base.Accumulated(), down.ctx, base.NoState(),
                     client_view(2, jnp.ones(C, bool), 7, 0))
  assert int(up.floats) == p5 and up.floats.dtype == jnp.int32
  assert up.payload.meme is meme and up.params is params and up.state == base.NoState()


def test_bad_weights_rejected():
  with pytest.raises(ValueError, match='fml.alpha'):
    make_method(alpha=1.5)
  with pytest.raises(ValueError, match='fml.beta'):
    make_method(beta=-0.1)


def test_loss_vmapped_equals_hand_computation_and_gradients_separate():
  method = make_method()
  own = models.make_model('cnn4', C, 'im2col', feature_dim=D)
  models_ = stack_trees([random_params(own, i) for i in range(2)])
  memes = stack_trees([random_params(method.meme_model, 2 + i) for i in range(2)])
  rng = np.random.default_rng(0)
  b = 6
  x = jnp.asarray(rng.normal(size=(2, b, 32, 32, 3)), jnp.float32)
  y = jnp.asarray(rng.integers(0, C, size=(2, b)), jnp.int32)
  valid = jnp.asarray([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]], bool)

  def loss(mp, mm, x, y, v):
    return method.loss(own.apply, {'model': mp, 'meme': mm}, None, (x,), y, v)

  (loss_v, (correct_v, acc_v)), grads = jax.jit(jax.vmap(jax.value_and_grad(
      loss, argnums=(0, 1), has_aux=True)))(models_, memes, x, y, valid)
  assert acc_v is None  # the loss accumulates nothing
  take = lambda t, i: jax.tree_util.tree_map(lambda a: a[i], t)
  logits = jax.jit(jax.vmap(lambda mp, mm, x: (own.apply({'params': mp}, x)[0],
                                               method.meme_model.apply({'params': mm}, x)[0])))
  zs, zms = map(np.asarray, logits(models_, memes, x))
  for i in range(2):
    z, zm = zs[i].astype(np.float64), zms[i].astype(np.float64)
    yi, vi = np.asarray(y[i]), np.asarray(valid[i])
    idx = np.flatnonzero(vi)
    lz, lm = log_softmax(z), log_softmax(zm)
    ce = -np.mean([lz[j, yi[j]] for j in idx])
    ce_m = -np.mean([lm[j, yi[j]] for j in idx])
    kl_loc = np.mean([np.sum(np.exp(lm[j]) * (lm[j] - lz[j])) for j in idx])
    kl_meme = np.mean([np.sum(np.exp(lz[j]) * (lz[j] - lm[j])) for j in idx])
    want = (0.3 * ce + 0.7 * kl_loc) + (0.6 * ce_m + 0.4 * kl_meme)
    np.testing.assert_allclose(float(loss_v[i]), want, rtol=1e-5)
    assert int(correct_v[i]) == sum(np.argmax(z[j]) == yi[j] for j in idx)

  # Detached targets: the local model's gradient is that of L_loc alone (meme logits constant),
  # so the joint loss trains the two models as separate optimisers would.
  zm0 = jnp.asarray(zms[0])

  def loss_loc(mp):
    z, _ = own.apply({'params': mp}, x[0])
    lz, lm = jax.nn.log_softmax(z), jax.nn.log_softmax(zm0)
    v = valid[0]
    ce = -jnp.sum(jnp.where(v, jnp.take_along_axis(lz, y[0][:, None], 1)[:, 0], 0)) / v.sum()
    kl = jnp.sum(jnp.where(v[:, None], jnp.exp(lm) * (lm - lz), 0)) / v.sum()
    return 0.3 * ce + 0.7 * kl

  want_grad = jax.jit(jax.grad(loss_loc))(take(models_, 0))
  for a, w in zip(jax.tree_util.tree_leaves(take(grads[0], 0)),
                  jax.tree_util.tree_leaves(want_grad)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-4, atol=1e-7)


def test_server_mean_over_two_chunks_with_dummy_equals_loop():
  n = 5
  method = make_method(num_clients=n)
  meme = random_params(method.meme_model, 0)
  server = fml.FMLServer(meme=meme, inbox=aggregation.Inbox.empty(meme))
  old = jax.tree_util.tree_map(np.asarray, server.meme)
  rng = np.random.default_rng(1)
  leaves, treedef = jax.tree_util.tree_flatten(old)

  def random_chunk(k):
    return [rng.normal(size=(k, *l.shape)).astype(np.float32) for l in leaves]

  chunks = [([0, 3, 0], [True, True, False], random_chunk(3)), ([4], [True], random_chunk(1))]
  received = []
  for ids, active, up in chunks:
    server = method.server_receive(
        server, jnp.asarray(ids), fml.FMLUpload(meme=jax.tree_util.tree_unflatten(
            treedef, [jnp.asarray(u) for u in up])), jnp.asarray(active))
    received += [[u[j] for u in up] for j in range(len(ids)) if active[j]]
  participants = np.zeros(n, bool)
  participants[[0, 3, 4]] = True
  server = aggregate(method, server, participants, 0, jit=True)
  for li, got in enumerate(jax.tree_util.tree_leaves(server.meme)):
    want = sum(r[li].astype(np.float64) for r in received) / len(received)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
  assert int(server.inbox.weight) == 0 and server.inbox.weight.dtype == jnp.int32
  assert all(not np.asarray(l).any() for l in jax.tree_util.tree_leaves(server.inbox.sum))
  # A round without participants keeps the meme.
  again = aggregate(method, server, np.zeros(n, bool), 1)
  for a, b in zip(jax.tree_util.tree_leaves(again.meme),
                  jax.tree_util.tree_leaves(server.meme)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # a simulator compiled and run
def test_engine_round_trip(small_sim):
  sim = small_sim('fml')
  c = sim.config
  p5 = 665_048 + 501 * 10
  assert sim.method.meme_floats == p5
  for fam, fps in sim.flops.per_sample.items():
    assert fps == pytest.approx(sim.flops.model(fam) + sim.flops.model('cnn5'))
  state = sim.init_state()
  meme0 = jax.tree_util.tree_map(np.asarray, snapshots.seed_state(sim.store, state).server.meme)
  for state, info in rounds(sim, c.num_rounds, state):
    assert np.isfinite(info.train_loss)
    assert_floats_each_way(info, p5)
  assert state.costs.up_floats[0] == state.costs.down_floats[0] == 2 * 2 * p5
  meme = snapshots.seed_state(sim.store, state).server.meme
  old, new = jax.tree_util.tree_leaves(meme0), jax.tree_util.tree_leaves(meme)
  assert all(not np.allclose(a, np.asarray(b)) for a, b in zip(old, new))  # every tensor moved
  ev = sim.evaluate(state)
  assert np.all((0 <= ev.accuracy) & (ev.accuracy <= 1))  # also false for NaN


def test_htfllib_variant_divides_kl_by_c_and_keeps_the_targets_gradients():
  c = config_lib.base_config('cifar10')
  c.model.conv_impl = 'im2col'
  c.fml.alpha, c.fml.beta = 0.3, 0.6
  c.fml.kl_reduction, c.fml.detach_targets = 'mean', False
  method = fml.FML(c, 2, C)
  own = models.make_model('cnn5', C, 'im2col', feature_dim=D)
  mp, mm = random_params(own, 0), random_params(method.meme_model, 1)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(3, 32, 32, 3)), jnp.float32)
  y = jnp.asarray([0, 2, 3], jnp.int32)
  valid = jnp.asarray([True, True, False])

  def ours(mp, mm):
    return method.loss(own.apply, {'model': mp, 'meme': mm}, (), (x,), y, valid)[0]

  def by_hand(mp, mm):  # HtFLlib's clientfml: KLDivLoss() ('mean' over B x C), no detach
    lz = jax.nn.log_softmax(own.apply({'params': mp}, x[:2])[0])
    lm = jax.nn.log_softmax(method.meme_model.apply({'params': mm}, x[:2])[0])
    ce = -jnp.mean(lz[jnp.arange(2), y[:2]])
    ce_m = -jnp.mean(lm[jnp.arange(2), y[:2]])
    kl_loc = jnp.mean(jnp.exp(lm) * (lm - lz))   # mean over B x C
    kl_meme = jnp.mean(jnp.exp(lz) * (lz - lm))
    return 0.3 * ce + 0.7 * kl_loc + 0.6 * ce_m + 0.4 * kl_meme

  (v1, g1), (v2, g2) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(mp, mm)
                        for f in (ours, by_hand))
  np.testing.assert_allclose(v1, v2, rtol=1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2)):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-7)
  # With detached targets (the default) the local model's gradient differs.
  method.detach_targets = True
  g3 = jax.jit(jax.grad(ours))(mp, mm)
  assert not np.allclose(g3['fc1']['kernel'], g1[0]['fc1']['kernel'])
  with pytest.raises(ValueError, match='kl_reduction'):
    c.fml.kl_reduction = 'sum'
    fml.FML.check_config(c.fml)
