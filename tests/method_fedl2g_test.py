"""FedL2G (docs/algorithm.md §6): the guided loss against a per-sample loop in both variants; the
meta gradient's closed form against autodiff through the inner step and against finite
differences, on a tiny stand-in model; the server's clipped step against a hand loop; the
config, floats and warm-up switch; the study batch and quiz set; the engine's held-out split and
training switch (local_round with stand-in training); and two rounds through the engine."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from fedssa_jax import config_lib

from fedssa_jax.data.partition import DeviceData
from fedssa_jax.engine import simulator, snapshots, training
from fedssa_jax.streams import Stream
from fedssa_jax.engine.state import ChunkInputs
from fedssa_jax.methods import base, fedl2g

from conftest import client_view, log_softmax, make_small_sim

C, D = 4, config_lib.base_config('cifar10').model.feature_dim  # d of the methods' configs


def make_method(n=5, c=C, **fields):
  cfg = config_lib.base_config('cifar10')
  cfg.fedl2g.update(fields)
  return fedl2g.FedL2G(cfg, n, c)


@pytest.mark.parametrize('variant', fedl2g.VARIANTS)
def test_loss_equals_per_sample_loop(variant):
  """CE + w / (B D) sum_i ||phi_i - V[y_i]||^2 over the valid samples, phi = r ('feat') or z
  ('logit'); the model's outputs come from a stand-in apply_fn, so that no network compiles."""
  method = make_method(variant=variant, guide_weight=0.7)
  dim = D if variant == 'feat' else C
  rng = np.random.default_rng(0)
  b = 7
  logits = rng.normal(size=(b, C)).astype(np.float32)
  rep = np.abs(rng.normal(size=(b, D))).astype(np.float32)
  y = rng.integers(0, C, size=b).astype(np.int32)
  valid = np.array([1, 1, 1, 1, 1, 0, 0], bool)
  vectors = rng.normal(size=(C, dim)).astype(np.float32)
  apply_fn = lambda variables, x: (variables['params']['z'], variables['params']['r'])
  loss, (correct, acc) = jax.jit(lambda: method.loss(
      apply_fn, {'model': {'z': logits, 'r': rep}}, fedl2g.GuidingVectors(vectors=vectors),
      (None,), y, valid))()
  phi = rep if variant == 'feat' else logits
  ce = sq = 0.0
  for j in np.flatnonzero(valid):
    ce -= log_softmax(logits[j].astype(np.float64))[y[j]]
    sq += ((phi[j].astype(np.float64) - vectors[y[j]]) ** 2).sum()
  m = valid.sum()
  assert float(loss) == pytest.approx(ce / m + 0.7 * sq / (m * dim), rel=1e-5)
  assert int(correct) == sum(logits[j].argmax() == y[j] for j in np.flatnonzero(valid))
  assert acc is None  # the loss accumulates nothing


# A tiny stand-in model: x [b, F] -> h = tanh(x W1 + b1) [b, H] (the "representation"),
# z = h W2 + b2 [b, C]; smooth, so that finite differences are exact to their order.
F, H = 6, 5


def tiny_apply(variables, x):
  p = variables['params']
  h = jnp.tanh(x @ p['w1'] + p['b1'])
  return h @ p['w2'] + p['b2'], h


def tiny_case(rng, variant, dtype=np.float32):
  params = {'w1': rng.normal(size=(F, H)), 'b1': rng.normal(size=H) * 0.1,
            'w2': rng.normal(size=(H, C)), 'b2': rng.normal(size=C) * 0.1}
  params = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
  dim = H if variant == 'feat' else C
  vectors = jnp.asarray(rng.normal(size=(C, dim)), dtype)
  b, q = 9, 4
  study = (jnp.asarray(rng.normal(size=(b, F)), dtype),
           jnp.asarray([0, 1, 1, 2, 0, 1, 2, 3, 3], jnp.int32),
           jnp.asarray([1, 1, 1, 1, 1, 1, 1, 0, 0], bool))  # class 3 only in padding
  quiz = (jnp.asarray(rng.normal(size=(q, F)), dtype), jnp.asarray([2, 0, 3, 1], jnp.int32),
          jnp.asarray([1, 1, 1, 0], bool))
  return params, vectors, study, quiz


@pytest.mark.parametrize('variant', fedl2g.VARIANTS)
def test_meta_gradient_closed_form_equals_autodiff_and_finite_differences(variant):
  """g_V = eta w 2/(B D) sum_{y_i = c} J_phi v (one JVP) equals the gradient through the inner
  SGD step w.r.t. V, and a central finite difference of the quiz loss after the step along
  random directions (float64); rows of classes absent from the study batch are 0."""
  rng = np.random.default_rng(1)
  kw = dict(lr=0.3, weight=1.5, variant=variant)
  params, vectors, study, quiz = tiny_case(rng, variant)
  closed = jax.jit(lambda p, v: fedl2g.meta_gradient(tiny_apply, p, v, study, quiz, **kw))(
      params, vectors)
  auto = jax.jit(lambda p, v: fedl2g.meta_gradient_autodiff(
      tiny_apply, p, v, study, quiz, **kw))(params, vectors)
  np.testing.assert_allclose(np.asarray(closed), np.asarray(auto), rtol=1e-4, atol=1e-7)
  assert np.abs(np.asarray(closed)[:3]).max() > 1e-4
  np.testing.assert_array_equal(np.asarray(closed)[3], 0.0)  # class 3: padding only
  with jax.enable_x64(True):
    params, vectors, study, quiz = tiny_case(np.random.default_rng(1), variant, np.float64)
    after = jax.jit(lambda v: fedl2g.quiz_loss(tiny_apply, fedl2g.inner_step(
        tiny_apply, params, v, study, **kw), quiz))
    g = np.asarray(jax.jit(lambda v: fedl2g.meta_gradient(
        tiny_apply, params, v, study, quiz, **kw))(vectors))
    np.testing.assert_allclose(g, np.asarray(closed), rtol=1e-4, atol=1e-7)
    eps = 1e-5
    for _ in range(3):
      u = rng.normal(size=vectors.shape)
      fd = (float(after(vectors + eps * u)) - float(after(vectors - eps * u))) / (2 * eps)
      assert fd == pytest.approx(float((g * u).sum()), rel=1e-5, abs=1e-10)


def test_after_training_uploads_present_classes():
  """The meta step's payload: g_V's rows of the classes in the study batch (presence, not
  |g| > 0), with the floats D * |present|; download floats D * s_k."""
  method = make_method(variant='logit', c=C)
  params, vectors, study, quiz = tiny_case(np.random.default_rng(2), 'logit')
  view = client_view(3, [1, 1, 1, 1], 20, 0)
  out = jax.jit(lambda p: method.after_training(
      tiny_apply, {'model': p}, fedl2g.GuidingVectors(vectors=vectors), study, quiz, view))(params)
  np.testing.assert_array_equal(np.asarray(out.present), [1, 1, 1, 0])
  want = jax.jit(lambda p: fedl2g.meta_gradient(
      tiny_apply, p, vectors, study, quiz, lr=method.inner_lr, weight=1.0, variant='logit'))(
          params)
  np.testing.assert_allclose(np.asarray(out.grad), np.asarray(want), rtol=1e-5, atol=1e-9)
  up = method.upload({'model': params}, base.Accumulated(after_training=out), None,
                     base.NoState(), view)
  assert int(up.floats) == C * 3 and up.payload is out
  seen = np.array([1, 0, 1, 0], bool)
  for m, dim in ((method, C), (make_method(), D)):
    server = fedl2g.FedL2GServer(vectors=jnp.zeros((C, dim)), grad_sum=None, grad_count=None)
    assert int(m.download({}, base.NoState(), server,
                          client_view(0, seen, 20, 0)).floats) == dim * 2


def test_config_defaults_checks_and_warmup_switch():
  m = make_method()
  assert (m.variant, m.dim, m.server_lr, m.warmup, m.held_out_samples, m.weight, m.clip) == (
      'feat', D, 100.0, 50, 10, 1.0, 100.0)
  assert m.inner_lr == 0.005 and m.per_sample_loss and m.forward_pass is None
  assert make_method(variant='logit').server_lr == 0.1
  assert make_method(variant='logit', server_lr=2.0).server_lr == 2.0
  assert make_method(variant='logit').dim == C
  trains = jax.jit(m.trains)
  assert [bool(trains(t)) for t in (0, 49, 50, 51)] == [False, False, True, True]
  assert make_method(warmup=0).trains(0) is True  # nothing traced
  assert base.Method.trains(m, 0) is True and base.Method.held_out_samples == 0
  assert base.Method.after_training is None
  for field, value in (('variant', 'both'), ('server_lr', 0.0), ('warmup', -1),
                       ('quiz_size', 0), ('guide_weight', -1.0), ('server_clip', 0.0)):
    with pytest.raises(ValueError, match=f'fedl2g.{field}'):
      make_method(**{field: value})
  server = jax.jit(make_method(c=10).init_server)(jax.random.PRNGKey(0), None)
  v = np.asarray(server.vectors)
  assert v.shape == (10, D) and 0.9 < v.std() < 1.1 and abs(v.mean()) < 0.05  # N(0, 1)


@pytest.mark.parametrize('scale', [1e-3, 50.0])  # the clip idle, then binding
def test_server_update_equals_hand_loop_with_clip(scale):
  """Two chunks of uploads (the first padded with a dummy) and a participant that uploaded
  nothing of a class: G[c] = the unweighted mean of the rows uploaded for c, 0 for none; G
  clipped to norm 100 (torch's clip_grad_norm_); V <- V - eta_s G. The sums are cleared."""
  n, dim = 5, 3
  method = make_method(n=n, variant='logit', c=dim, server_lr=0.5)  # D = C = 3
  rng = np.random.default_rng(3)
  server = method.init_server(jax.random.PRNGKey(1), None)
  grads = (rng.normal(size=(n, dim, dim)) * scale).astype(np.float32)
  present = np.array([[1, 1, 0], [1, 0, 0], [0, 1, 0], [1, 1, 1], [0, 0, 1]], bool)
  grads = np.where(present[:, :, None], grads, 0.0).astype(np.float32)
  receive = jax.jit(method.server_receive)
  for ids, active in (([0, 1, 4], [True, True, False]), ([2], [True])):
    ids = np.asarray(ids)
    server = receive(server, jnp.asarray(ids),
                     fedl2g.MetaGradient(grad=jnp.asarray(grads[ids]),
                                         present=jnp.asarray(present[ids])),
                     jnp.asarray(active))
  participants = np.isin(np.arange(n), [0, 1, 2])
  agg = jax.jit(method.server_aggregate)(server, jnp.asarray(participants), 0,
                                         jax.random.PRNGKey(0))
  mean = np.zeros((dim, dim))
  for c in range(dim):
    rows = [grads[k, c].astype(np.float64) for k in (0, 1, 2) if present[k, c]]
    mean[c] = np.mean(rows, axis=0) if rows else 0.0
  norm = np.sqrt((mean ** 2).sum())
  coef = min(1.0, 100.0 / (norm + 1e-6))
  assert (coef < 1) == (scale > 1)
  want = np.asarray(server.vectors) - 0.5 * coef * mean
  np.testing.assert_allclose(np.asarray(agg.server.vectors), want, rtol=1e-5, atol=1e-6)
  assert float(agg.metrics['grad_norm']) == pytest.approx(norm, rel=1e-5)
  assert float(agg.metrics['classes']) == 2 and float(agg.flops) == 0
  assert not np.asarray(agg.server.grad_sum).any() and not np.asarray(agg.server.grad_count).any()


def test_study_batch_and_quiz_set():
  """The quiz set is positions 0..Q-1 of the index row; the study batch B distinct positions of
  Q..n-1 (all of them, padded, when n - Q < B), valid for min(n - Q, B)."""
  m, q, b = 40, 10, 16
  images = np.arange(m, dtype=np.uint8)[:, None, None, None] * np.ones((1, 32, 32, 3), np.uint8)
  labels = np.arange(m, dtype=np.int32)  # a sample's label is its index
  row = np.random.default_rng(4).permutation(m).astype(np.int32)
  cfg = training.TrainConfig(mean=(0.0,) * 3, std=(1.0,) * 3)
  fn = jax.jit(lambda key, n: training.study_and_quiz(
      key, jnp.asarray(row), n, DeviceData(jnp.asarray(images), jnp.asarray(labels),
                                                  None, None, None, None),
      held_out=q, batch_size=b, cfg=cfg))
  for n, key in ((40, 0), (40, 1), (17, 2), (6, 3)):
    (xs, ys, vs), (xq, yq, vq) = fn(jax.random.PRNGKey(key), n)
    np.testing.assert_array_equal(np.asarray(yq), row[:q])
    np.testing.assert_array_equal(np.asarray(vq), np.arange(q) < n)
    np.testing.assert_allclose(np.asarray(xq)[:, 0, 0, 0], row[:q] / 255.0, rtol=1e-6)
    k = min(max(n - q, 0), b)
    np.testing.assert_array_equal(np.asarray(vs), np.arange(b) < k)
    drawn = np.asarray(ys)[:k]
    assert len(set(drawn)) == k and set(drawn) <= set(row[q:n])
    if n - q <= b:
      assert set(drawn) == set(row[q:n])


def test_local_round_holds_the_quiz_out_and_skips_warmup_training():
  """engine.local_round with stand-in training (recording the index row and count it gets) and
  a stand-in meta step: training sees positions Q.. of each row, n_k - Q samples, and none in a
  warm-up round (t < warmup); the meta step sees the whole row and n_k, every round, and its
  output reaches the upload; its FLOPs are after_training_steps per study and quiz sample."""
  method = make_method(n=3, c=C, warmup=2, quiz_size=4)
  width = 12
  rows = np.arange(3 * width, dtype=np.int32).reshape(3, width)
  train_n = np.array([12, 7, 3], np.int32)
  data_ = DeviceData(None, None, jnp.asarray(rows), jnp.asarray(train_n), None, None)
  seen = jnp.asarray(np.ones((3, C), bool))
  server = method.init_server(jax.random.PRNGKey(0), seen)

  def train_one(trainable, ctx, key, idx, n, data):
    stats = {'loss_sum': jnp.zeros(()), 'samples': n, 'correct': n, 'steps': n}
    return trainable, None, {**stats, 'row': idx}  # FedL2G's loss accumulates nothing

  @struct.dataclass
  class Seen(fedl2g.MetaGradient):  # a meta gradient that also records what the step saw
    row: jax.Array
    n: jax.Array
    key: jax.Array

  def after_one(trainable, ctx, key, idx, n, data, view):
    out = Seen(grad=jnp.zeros((C, D)), present=jnp.arange(C) < 2, row=idx, n=n,
               key=jax.random.key_data(key))
    return out, jnp.minimum(jnp.maximum(n - 4, 0), 8), jnp.minimum(n, 4)

  local = jax.jit(functools.partial(simulator.local_round, method=method, train_one=train_one,
                                    after_one=after_one, step_flops_per_sample=3.0))
  for t in (1, 2):
    inputs = ChunkInputs(slots=None, ids=jnp.arange(3), active=jnp.asarray([True, True, False]),
                         seen=seen, data=data_, round_index=jnp.asarray(t),
                         root_key=jax.random.PRNGKey(0))
    _, _, payload, stats = local({'w': jnp.zeros((3, 2))}, base.NoState(), server, inputs)
    np.testing.assert_array_equal(np.asarray(stats.train['row']), rows[:, 4:])
    n = np.array([12, 7, 0])
    np.testing.assert_array_equal(np.asarray(stats.train['samples']), (n - 4).clip(0) * (t >= 2))
    # The meta step's output is the upload (FedL2G's payload is acc.after_training).
    np.testing.assert_array_equal(np.asarray(payload.row), rows)
    np.testing.assert_array_equal(np.asarray(payload.n), n)
    study_round = jax.random.fold_in(jax.random.fold_in(inputs.root_key, Stream.STUDY), t)
    for k in range(3):  # the study batch's key: (Stream.STUDY, round, client id)
      np.testing.assert_array_equal(np.asarray(payload.key[k]), np.asarray(
          jax.random.key_data(jax.random.fold_in(study_round, k))))
    np.testing.assert_array_equal(np.asarray(payload.present), np.tile(np.arange(C) < 2,
                                                                       (3, 1)))
    study, quiz = np.minimum((n - 4).clip(0), 8), np.minimum(n, 4)
    np.testing.assert_allclose(np.asarray(stats.extra_flops),
                               3.0 * (5 / 3 * study + quiz), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(stats.up_floats), [2 * D, 2 * D, 2 * D])
    np.testing.assert_array_equal(np.asarray(stats.down_floats), [C * D] * 3)


def own_params(sim, params, k):
  """Client k's parameters, as numpy arrays, out of one seed's state (snapshots.seed_state)."""
  return jax.tree.map(lambda a: np.asarray(a[sim.slot_of[k]]), params[sim.group_of[k]])


@pytest.mark.slow  # a simulator compiled and run
def test_rounds_warmup_then_training(small_ds):
  """Two rounds, warm-up 1: round 0 trains nothing (the participants' models unchanged, V
  moved by the clipped mean of their meta gradients, in the rows of their classes); round 1
  trains n_k - Q samples per participant. Floats: down D s_k, up D * (classes in the study
  batch) <= D s_k; extra FLOPs: the meta step's."""
  sim = make_small_sim(small_ds, 'fedl2g', **{'fedl2g.warmup': 1})
  q, b = sim.method.held_out_samples, sim.config.batch_size
  state = sim.init_state()
  before = snapshots.seed_state(sim.store, state)
  for t in range(2):
    state, (info,) = sim.run_round(state)
    after = snapshots.seed_state(sim.store, state)
    n = sim.train_n[0, info.cohort]
    seen = sim.seen[0, info.cohort]
    np.testing.assert_array_equal(info.train_samples, (n - q) * (t >= 1))
    np.testing.assert_array_equal(info.train_steps, -(-(n - q) // b) * (t >= 1))
    for k in info.cohort:
      changed = [not np.array_equal(x, y) for x, y in zip(
          jax.tree.leaves(own_params(sim, before.population.params, k)),
          jax.tree.leaves(own_params(sim, after.population.params, k)))]
      assert (any(changed) if t >= 1 else not any(changed)), (t, k)
    moved = np.abs(np.asarray(after.server.vectors) - np.asarray(before.server.vectors)).max(1)
    assert (moved > 0).any() and not moved[~seen.any(0)].any()
    np.testing.assert_array_equal(info.client_down_floats, D * seen.sum(1))
    assert (info.client_up_floats <= D * seen.sum(1)).all() and (info.client_up_floats > 0).all()
    assert info.client_up_floats.sum() % D == 0
    extra = (info.client_flops_per_client
             - sim.flops.per_client[info.cohort] * info.train_samples)
    want = sim.flops.model('cnn5') * (5 / 3 * np.minimum(n - q, b) + q)
    np.testing.assert_allclose(extra, want, rtol=1e-6)
    assert np.isfinite(info.server_metrics['grad_norm'])
    before = after
