"""FedClassAvg (docs/algorithm.md §6): SupCon against a plain double loop over anchors, the full
loss on a real model (CE on view 1, proximal term), the header exchange and weighted server mean,
the FLOP approximation, and one round through the engine."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, models
from fedssa_jax import methods
from fedssa_jax.methods import base, fedclassavg

from conftest import (aggregate, assert_floats_each_way, ce_loop, client_view, rounds,
                      stack_trees)

C = 4
D = config_lib.base_config('cifar10').model.feature_dim  # d of the methods' configs
VARIANTS = {'standard': (True, 0.07, 0.07), 'official': (False, 100.0, 0.07),
            'unnormalised': (False, 0.5, 0.07)}


def make_method(variant='standard', weighting='samples', mu=0.1, n=6):
  cfg = config_lib.base_config('cifar10')
  f = cfg.fedclassavg
  f.normalize, f.tau, f.base_tau = VARIANTS[variant]
  f.weighting, f.mu = weighting, mu
  return fedclassavg.FedClassAvg(cfg, n, C)


def supcon_loop(u, y, valid, tau, base_tau, normalize):
  """The spec's formula, one anchor at a time, in float64. u [V, d] lists all views."""
  u = np.asarray(u, np.float64)
  if normalize:
    u = u / np.maximum(np.linalg.norm(u, axis=1, keepdims=True), 1e-12)
  views = [i for i in range(len(u)) if valid[i]]
  total = 0.0
  for a in views:
    others = [j for j in views if j != a]
    positives = [q for q in others if y[q] == y[a]]
    assert positives  # the sample's own other view is always one
    lse = np.logaddexp.reduce([u[a] @ u[j] / tau for j in others])
    total += sum(u[a] @ u[q] / tau - lse for q in positives) / len(positives)
  return -(tau / base_tau) * total / len(views)


def views_of(y, valid):
  return np.concatenate([y, y]), np.concatenate([valid, valid])


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_supcon_equals_double_loop_under_vmap(variant):
  normalize, tau, base_tau = VARIANTS[variant]
  rng = np.random.default_rng(0)
  b, d = 6, 8
  u = rng.random((3, 2 * b, d)).astype(np.float32)
  u[1, 4] = 0.0  # a dead (all-zero) representation of a valid view
  y = np.array([[0, 1, 1, 2, 0, 3], [2, 2, 2, 1, 0, 0], [1, 0, 3, 3, 3, 1]])
  valid = np.array([[1, 1, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 1]], bool)
  y2, v2 = zip(*(views_of(yy, vv) for yy, vv in zip(y, valid)))
  got = jax.vmap(lambda u, y, v: fedclassavg.supcon(u, y, v, tau, base_tau, normalize))(
      jnp.asarray(u), jnp.asarray(np.stack(y2)), jnp.asarray(np.stack(v2)))
  for k in range(3):
    want = supcon_loop(u[k], y2[k], v2[k], tau, base_tau, normalize)
    assert float(got[k]) == pytest.approx(want, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize('normalize', [True, False])
def test_supcon_ignores_padded_views(normalize):
  rng = np.random.default_rng(1)
  b, d = 5, 8
  y2, v2 = views_of(np.array([0, 1, 0, 1, 2]), np.array([1, 1, 0, 1, 1], bool))
  y2, v2 = jnp.asarray(y2), jnp.asarray(v2)
  u = rng.random((2 * b, d)).astype(np.float32)
  f = jax.value_and_grad(lambda u: fedclassavg.supcon(u, y2, v2, 1.0, 0.07, normalize))
  loss, grad = f(jnp.asarray(u))
  u_changed = u.copy()
  u_changed[[2, b + 2]] = rng.random((2, d)) * 1e3  # the padded sample's two views
  loss2, grad2 = f(jnp.asarray(u_changed))
  assert float(loss2) == pytest.approx(float(loss), rel=1e-6)
  for g in (grad, grad2):
    assert np.isfinite(np.asarray(g)).all()
    assert not np.asarray(g)[[2, b + 2]].any()
  # With every view padded the loss is 0 and its gradient finite.
  loss0, grad0 = jax.value_and_grad(
      lambda u: fedclassavg.supcon(u, y2, jnp.zeros_like(v2), 1.0, 0.07, normalize))(u)
  assert float(loss0) == 0.0 and np.isfinite(np.asarray(grad0)).all()


def proximal_loop(params, global_rows):
  w, bias = np.asarray(params['fc3']['kernel'], np.float64), np.asarray(params['fc3']['bias'])
  g = np.asarray(global_rows, np.float64)
  sq_w = sum((w[j, c] - g[c, j]) ** 2 for c in range(C) for j in range(500))
  sq_b = sum((bias[c] - g[c, 500]) ** 2 for c in range(C))
  return sq_w / (C * 500) + sq_b / C


@pytest.mark.parametrize('variant', ['standard', 'official'])
def test_loss_on_a_real_model_equals_loop(variant):
  method = make_method(variant, mu=0.3)
  normalize, tau, base_tau = VARIANTS[variant]
  model = models.make_model('cnn5', C, 'im2col', feature_dim=D)
  params = [models.init_params(model, jax.random.PRNGKey(k)) for k in range(2)]
  rng = np.random.default_rng(2)
  # A global header near each client's own (so the proximal term is neither 0 nor dominant).
  ctx = np.stack([np.asarray(models.header_rows(p)) + 0.05 * rng.normal(size=(C, 501))
                  for p in params]).astype(np.float32)
  b = 6
  x1, x2 = (rng.normal(size=(2, b, 32, 32, 3)).astype(np.float32) for _ in range(2))
  y = np.array([[0, 3, 1, 1, 2, 0], [2, 2, 0, 1, 3, 3]])
  valid = np.array([[1, 1, 0, 1, 1, 0], [1, 0, 1, 1, 1, 1]], bool)
  stacked = stack_trees(params)

  @jax.jit
  def run(x1, x2):
    def one(p, ctx, x1, x2, y, valid):
      return jax.value_and_grad(lambda p: method.loss(
          model.apply, {'model': p}, fedclassavg.GlobalHeader(rows=ctx), (x1, x2), y, valid),
                                has_aux=True)(p)
    return jax.vmap(one)(stacked, jnp.asarray(ctx), x1, x2, jnp.asarray(y), jnp.asarray(valid))

  (loss, (correct, acc)), grads = run(jnp.asarray(x1), jnp.asarray(x2))
  assert acc is None  # the loss accumulates nothing
  for k in range(2):
    logits1, u1 = model.apply({'params': params[k]}, jnp.asarray(x1[k]))
    _, u2 = model.apply({'params': params[k]}, jnp.asarray(x2[k]))
    y2, v2 = views_of(y[k], valid[k])
    sc = supcon_loop(np.concatenate([u1, u2]), y2, v2, tau, base_tau, normalize)
    ce, right = ce_loop(logits1, y[k], valid[k])
    want = sc + ce + 0.3 / 2 * proximal_loop(params[k], ctx[k])
    assert float(loss[k]) == pytest.approx(want, rel=1e-4)
    assert int(correct[k]) == right
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree_util.tree_leaves(grads))
  # The padded samples' images do not matter.
  x1b, x2b = x1.copy(), x2.copy()
  x1b[~valid], x2b[~valid] = 5.0, -5.0
  (loss_b, _), _ = run(jnp.asarray(x1b), jnp.asarray(x2b))
  np.testing.assert_allclose(np.asarray(loss_b), np.asarray(loss), rtol=1e-5)


def test_proximal_term_equals_loop():
  rng = np.random.default_rng(3)
  params = {'fc3': {'kernel': jnp.asarray(rng.normal(size=(500, C)), jnp.float32),
                    'bias': jnp.asarray(rng.normal(size=C), jnp.float32)}}
  g = rng.normal(size=(C, 501)).astype(np.float32)
  got = fedclassavg.proximal(params, jnp.asarray(g))
  assert float(got) == pytest.approx(proximal_loop(params, g), rel=1e-5)
  assert float(fedclassavg.proximal(params, models.header_rows(params))) == 0.0


@pytest.mark.parametrize('weighting', ['samples', 'uniform'])
def test_exchange_and_server_rule_equal_loop(weighting):
  method = make_method(weighting=weighting, n=6)
  server = method.init_server(jax.random.PRNGKey(0), jnp.ones((6, C), bool))
  params = models.init_params(models.make_model('cnn5', C, 'im2col', feature_dim=D),
                              jax.random.PRNGKey(1))
  down = method.download(params, base.NoState(), server,
                         client_view(0, jnp.array([1, 0, 1, 0], bool)))
  np.testing.assert_array_equal(np.asarray(down.ctx.rows), np.asarray(server.global_header))
  np.testing.assert_array_equal(np.asarray(models.header_rows(down.params)),
                                np.asarray(server.global_header))
  up = method.upload({'model': down.params}, base.Accumulated(), down.ctx, base.NoState(),
                     client_view(0, jnp.ones(C, bool), 17, 0))
  assert int(down.floats) == int(up.floats) == 501 * C
  assert float(up.payload.weight) == (17.0 if weighting == 'samples' else 1.0)
  assert method.eval_params(params, server, 0) is params  # the post-training local model

  rng = np.random.default_rng(4)
  uploads = []
  for ids, active in (([1, 4, 0], [True, True, False]), ([2], [True])):
    rows = rng.normal(size=(len(ids), C, 501)).astype(np.float32)
    n = rng.integers(1, 40, size=len(ids))
    w = n.astype(np.float32) if weighting == 'samples' else np.ones(len(ids), np.float32)
    server = method.server_receive(server, jnp.asarray(ids),
                                   base.WeightedUpload(value=jnp.asarray(rows),
                                                       weight=jnp.asarray(w)),
                                   jnp.asarray(active))
    uploads += [(r, wk) for r, wk, a in zip(rows.astype(np.float64), w, active) if a]
  participants = np.isin(np.arange(6), [1, 4, 2])
  server = aggregate(method, server, participants, 0)
  want = sum(wk * r for r, wk in uploads) / sum(wk for _, wk in uploads)
  np.testing.assert_allclose(np.asarray(server.global_header), want, rtol=1e-5, atol=1e-6)


def test_every_method_declares_per_sample_loss():
  """per_sample_loss has no default: a method that does not say whether its loss couples a
  batch's samples is refused when built, naming the attribute; SupCon's FedClassAvg says False."""
  assert not hasattr(base.Method, 'per_sample_loss')
  for cls in methods.METHODS.values():
    assert isinstance(cls.per_sample_loss, bool), cls.name
  assert make_method().per_sample_loss is False

  class Undeclared(base.Method):
    name = 'undeclared'
  with pytest.raises(TypeError, match='Undeclared must set the class attribute '
                                      'per_sample_loss = True or False.*micro-batch'):
    Undeclared(config_lib.base_config('cifar10'), 3, C)


def test_invalid_config_raises():
  with pytest.raises(ValueError, match='fedclassavg.weighting'):
    make_method(weighting='median')
  with pytest.raises(ValueError, match='fedclassavg.mu'):
    make_method(mu=-1.0)
  cfg = config_lib.base_config('cifar10')
  cfg.fedclassavg.tau = 0.0
  with pytest.raises(ValueError, match='fedclassavg.tau'):
    fedclassavg.FedClassAvg(cfg, 4, C)


@pytest.mark.slow  # a simulator compiled and run
def test_one_round_through_the_engine(small_sim):
  sim = small_sim('fedclassavg')
  c = sim.config
  for fam in c.model.families:  # a second view plus the 2B x 2B similarity matrix
    assert sim.flops.per_sample[fam] == 2 * sim.flops.model(fam) + 24 * 16 * 500
  for state, info in rounds(sim, 2):
    assert np.isfinite(info.train_loss)
    assert_floats_each_way(info, 501 * sim.num_classes)  # 5,010 each way
    np.testing.assert_allclose(info.client_flops_per_client,
                               sim.flops.per_client[info.cohort]
                               * sim.train_n[0][info.cohort])
  ev = sim.evaluate(state)
  assert np.isfinite(ev.accuracy).all() and (ev.count > 0).all()
