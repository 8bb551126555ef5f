"""FedSA (docs/algorithm.md §6): the anchor projection, the gaps and the margin, each loss term
and its gradient routing, the upload and its local gap, the server's mean and EMA across rounds
(central DP too) and the nearest-prototype metric, each against a plain numpy transcription of
lokinko/FedSA's code on small arrays; then rounds through the engine, resumed from a checkpoint
after the first."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, models
from fedssa_jax.engine import snapshots
from fedssa_jax.methods import base, fedsa, prototypes

from conftest import client_view, log_softmax, make_small_sim, rounds

C, D = 4, config_lib.base_config('cifar10').model.feature_dim  # d of the methods' configs


def make_method(n=5, c=C, epochs=1, **fields):
  cfg = config_lib.base_config('cifar10')
  cfg.fedsa.update(fields)
  cfg.local_epochs = epochs
  return fedsa.FedSA(cfg, n, c)


# --- numpy transcriptions of lokinko/FedSA (serversa.py, clientsa.py) --------------------------
def np_batch_norm(h):  # SyncBN without torch.distributed: plain BN in train mode, over the rows
  return (h - h.mean(0)) / np.sqrt(h.var(0) + 1e-5)


def np_anchors(e, w1, b1, w2, b2):  # projecter_linear(random_center), x @ w as a Flax kernel
  h = np.maximum(np_batch_norm(e @ w1 + b1), 0)
  return np.maximum(np_batch_norm(h @ w2 + b2), 0)


def np_gap(points):  # cal_local_gap / cal_global_gap: cdist, diagonal inf, min, mean
  if len(points) <= 1:
    return -np.inf
  dist = np.sqrt(((points[:, None] - points[None]) ** 2).sum(-1))
  np.fill_diagonal(dist, np.inf)
  return dist.min(1).mean()


def np_ce(logits, y):
  return -np.mean([log_softmax(z)[t] for z, t in zip(logits, y)])


def np_mcl(feats, anchors, y, gap):  # cal_mcl_loss
  dist = ((feats ** 2).sum(1, keepdims=True) - 2 * feats @ anchors.T
          + (anchors ** 2).sum(1, keepdims=True).T)
  dist = np.sqrt(dist) + np.eye(len(anchors))[y] * gap
  return np_ce(-dist, y)


def np_client_loss(logits, feats, head_w, head_b, anchors, y, gap, lam, mcl, cc):  # train()
  loss = np_ce(logits, y)
  loss += cc * np_ce(anchors @ head_w + head_b, np.arange(len(anchors)))  # calibration
  loss += lam * ((feats - anchors[y]) ** 2).mean()                       # nn.MSELoss()
  return loss + mcl * np_mcl(feats, anchors, y, gap)


# --- the anchors, the gaps, the margin ---------------------------------------------------------
def test_anchor_projection_equals_numpy_and_its_biases_cancel():
  rng = np.random.default_rng(0)
  c, d = 5, 6
  e, w1, w2 = (rng.normal(size=s).astype(np.float32) for s in ((c, d), (d, d), (d, d)))
  b1, b2 = (rng.normal(size=d).astype(np.float32) for _ in range(2))
  got = np.asarray(fedsa.project_anchors(e, w1, b1, w2, b2))
  want = np_anchors(*(x.astype(np.float64) for x in (e, w1, b1, w2, b2)))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(got, np_anchors(e, w1, 0 * b1, w2, 0 * b2), rtol=1e-4, atol=1e-5)
  assert (got >= 0).all()
  # At d = 500: about half the entries are 0, |A_c| ~ sqrt(d / 2), and a new key draws others
  # (the reference seeds torch with 0 before building them, so all its runs share one A_0).
  a, other = (np.asarray(fedsa.init_anchors(jax.random.PRNGKey(s), 10, D)) for s in (0, 1))
  assert a.shape == (10, D) and (a >= 0).all() and 0.4 < (a == 0).mean() < 0.6
  np.testing.assert_allclose(np.linalg.norm(a, axis=1), np.sqrt(D / 2), rtol=0.1)
  assert 16 < np_gap(a) < 20 and not np.allclose(a, other)


def test_gaps_and_the_round_s_margin():
  rng = np.random.default_rng(1)
  points = rng.normal(size=(6, 5)).astype(np.float32)
  for mask in (np.ones(6, bool), np.array([1, 0, 1, 1, 0, 1], bool), np.eye(6, dtype=bool)[2],
               np.zeros(6, bool)):
    got = float(fedsa.mean_nearest_distance(jnp.asarray(points), jnp.asarray(mask)))
    want = np_gap(points[mask].astype(np.float64))
    assert got == pytest.approx(want, rel=1e-5) if np.isfinite(want) else got == -np.inf
  # gamma_k = max(g_loc, g_glob): g_loc is 0 before the first upload, -inf after one of a single
  # class, else the gap of the last prototypes.
  method = make_method()
  server = method.init_server(jax.random.PRNGKey(0), None)
  g_glob = float(server.global_gap)
  assert g_glob == pytest.approx(np_gap(np.asarray(server.anchors, np.float64)), rel=1e-5)
  assert method.init_client_state(None).local_gap == 0.0
  for local, want in ((0.0, g_glob), (-np.inf, g_glob), (g_glob + 3.0, g_glob + 3.0)):
    down = method.download({}, fedsa.FedSAClient(local_gap=jnp.float32(local)), server,
                           client_view(0, np.ones(C, bool), 5, 1))
    assert float(down.ctx.margin) == pytest.approx(want, rel=1e-6)
    np.testing.assert_array_equal(np.asarray(down.ctx.anchors), np.asarray(server.anchors))


def test_margin_term_equals_numpy_and_the_floor_keeps_gradients_finite():
  rng = np.random.default_rng(2)
  b, c, d = 4, 3, 5
  feats = np.abs(rng.normal(size=(b, d))).astype(np.float32)
  anchors = np.abs(rng.normal(size=(c, d))).astype(np.float32) * 3
  y = np.array([0, 2, 1, 2], np.int32)
  valid = np.ones(b, bool)
  for gap in (0.0, 1.7):
    want = np_mcl(feats.astype(np.float64), anchors.astype(np.float64), y, gap)
    for exact in (False, True):  # the floor changes nothing at distances well above 0
      got = float(fedsa.margin_loss(feats, anchors, y, valid, gap, exact))
      assert got == pytest.approx(want, rel=1e-5)
  # The margin adds to the true class's distance only: a sample's loss with margin m equals the
  # loss without it on logits whose true entry alone is lowered by m.
  one = lambda m: float(fedsa.margin_loss(feats[:1], anchors, y[:1], valid[:1], m, False))
  dist = np.sqrt(((feats[0] - anchors.astype(np.float64)) ** 2).sum(1))
  shifted = -dist - 2.5 * (np.arange(c) == y[0])
  assert one(2.5) == pytest.approx(-log_softmax(shifted)[y[0]], rel=1e-5)
  # A representation on its anchor: the floor keeps the gradient finite, the exact root does not.
  on_anchor = jnp.asarray(anchors[y[:1]])
  for exact, finite in ((False, True), (True, False)):
    g = jax.grad(lambda r: fedsa.margin_loss(r, anchors, y[:1], valid[:1], 1.0, exact))(on_anchor)
    assert bool(jnp.isfinite(g).all()) == finite


# --- the client loss -----------------------------------------------------------------------------
def linear_model(rng, d_in=7):
  """A linear extractor r = relu(x W) and the header fc3, as a model's params and apply_fn."""
  params = {'w': jnp.asarray(rng.normal(size=(d_in, D)) * 0.3, jnp.float32),
            'fc3': {'kernel': jnp.asarray(rng.normal(size=(D, C)) * 0.05, jnp.float32),
                    'bias': jnp.asarray(rng.normal(size=C) * 0.1, jnp.float32)}}

  def apply_fn(variables, x):
    p = variables['params']
    rep = jax.nn.relu(x @ p['w'])
    return models.apply_header(p, rep), rep
  return params, apply_fn


def test_loss_terms_equal_numpy_and_reach_only_their_parts():
  rng = np.random.default_rng(3)
  params, apply_fn = linear_model(rng)
  b = 6
  x = jnp.asarray(rng.normal(size=(b, 7)), jnp.float32)
  y = jnp.asarray([0, 1, 3, 3, 2, 1], jnp.int32)
  valid = jnp.asarray([1, 1, 1, 1, 0, 0], bool)  # padding counts nowhere
  anchors = jnp.asarray(np.abs(rng.normal(size=(C, D))), jnp.float32)
  ctx = fedsa.FedSAContext(anchors=anchors, margin=jnp.float32(2.0))
  logits, feats = (np.asarray(a, np.float64)[:4] for a in apply_fn({'params': params}, x))
  head_w, head_b = (np.asarray(params['fc3'][k], np.float64) for k in ('kernel', 'bias'))
  weights = dict(lam=10.0, mcl=1.0, cc=1.0)
  method = make_method(**weights)
  loss_of = lambda m: lambda p, ctx: m.loss(apply_fn, {'model': p}, ctx, (x,), y, valid)
  loss, (correct, acc) = jax.jit(loss_of(method))(params, ctx)
  want = np_client_loss(logits, feats, head_w, head_b, np.asarray(anchors, np.float64),
                        np.asarray(y)[:4], 2.0, **weights)
  assert float(loss) == pytest.approx(want, rel=1e-5)
  assert int(correct) == (logits.argmax(1) == np.asarray(y)[:4]).sum()
  # The accumulator: the training pass's class sums of r (the prototypes' V1 sums).
  sums = np.zeros((C, D))
  np.add.at(sums, np.asarray(y)[:4], feats)
  np.testing.assert_allclose(np.asarray(acc.sum), sums, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(acc.count), np.bincount(np.asarray(y)[:4], minlength=C))

  # Each term alone (the loss with only its weight on, less CE) and what its gradient reaches:
  # the calibration term the header only, the MSE and margin terms the extractor only; the
  # anchors none.
  ce = loss_of(make_method(lam=0.0, mcl=0.0, cc=0.0))
  for term, moved, still in (('cc', 'fc3', 'w'), ('lam', 'w', 'fc3'), ('mcl', 'w', 'fc3')):
    alone = loss_of(make_method(**{'lam': 0.0, 'mcl': 0.0, 'cc': 0.0, term: 1.0}))
    diff = lambda p, ctx: alone(p, ctx)[0] - ce(p, ctx)[0]
    g_params, g_ctx = jax.grad(diff, argnums=(0, 1))(params, ctx)
    assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(g_params[still])), term
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(g_params[moved])), term
    assert float(jnp.abs(g_ctx.anchors).max()) == 0, term
  # The MSE is normalised by B d (B the valid samples).
  mse = loss_of(make_method(lam=1.0, mcl=0.0, cc=0.0))(params, ctx)[0] - ce(params, ctx)[0]
  assert float(mse) == pytest.approx(
      ((feats - np.asarray(anchors, np.float64)[np.asarray(y)[:4]]) ** 2).sum() / (4 * D),
      rel=1e-5)


# --- upload, server, metric --------------------------------------------------------------------
def test_upload_training_pass_means_local_gap_and_floats():
  epochs = 2
  method = make_method(epochs=epochs)
  rng = np.random.default_rng(4)
  seen = np.array([[1, 1, 0, 1], [0, 1, 0, 0], [1, 0, 1, 1]], bool)
  counts = np.where(seen, epochs * rng.integers(1, 9, size=seen.shape), 0).astype(np.float32)
  counts[2, 2] = 0  # a seen class without a sample in training: not uploaded
  sums = (rng.normal(size=(3, C, D)) * counts[:, :, None]).astype(np.float32)
  up = jax.jit(jax.vmap(lambda a, s: method.upload(
      {'model': {}}, base.Accumulated(loss=a), None, fedsa.FedSAClient(jnp.float32(0.0)),
      client_view(0, s, 5, 1))))(base.ClassSums(sum=jnp.asarray(sums), count=jnp.asarray(counts)),
                                 jnp.asarray(seen))
  for k in range(3):
    held = seen[k] & (counts[k] > 0)
    assert int(up.floats[k]) == D * held.sum()
    want = np.where(held[:, None], sums[k] / np.maximum(counts[k], 1)[:, None], 0)
    np.testing.assert_allclose(np.asarray(up.payload.protos[k]), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(up.payload.n[k]), counts[k] / epochs)
    gap = float(up.state.local_gap[k])
    assert gap == pytest.approx(np_gap(want[held])) if held.sum() > 1 else gap == -np.inf


def np_server_round(anchors, protos, held, mu):
  """receive_protos (proto_aggregation) and update_semantic_anchors, class by class."""
  anchors, mean = anchors.copy(), {}
  for c in range(anchors.shape[0]):
    holders = np.flatnonzero(held[:, c])
    if len(holders):
      mean[c] = protos[holders, c].mean(0)
      anchors[c] = mu * anchors[c] + (1 - mu) * mean[c]
  return anchors, mean


def test_server_mean_and_ema_across_rounds():
  n = 5
  method = make_method(n)
  mu = 0.9999
  rng = np.random.default_rng(5)
  seen = np.array([[1, 0, 1, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 1, 1], [0, 1, 0, 1]], bool)
  server = method.init_server(jax.random.PRNGKey(3), jnp.asarray(seen))
  aggregate = jax.jit(method.server_aggregate)
  anchors = np.asarray(server.anchors, np.float64)
  for cohort in ([3], [0, 1, 2], [4]):  # class 3 in rounds 0 and 2, class 1 in 1 and 2, ...
    protos = np.where(seen[:, :, None], rng.normal(size=(n, C, D)) * 10, 0).astype(np.float32)
    # every client's rows are stored; only this round's participants count
    server = method.server_receive(server, jnp.arange(n), prototypes.PrototypeUpload(
        protos=jnp.asarray(protos), n=jnp.asarray(seen * 3.0, jnp.float32)), jnp.ones(n, bool))
    participants = np.isin(np.arange(n), cohort)
    before = np.asarray(server.anchors)
    agg = aggregate(server, jnp.asarray(participants), 0, jax.random.PRNGKey(0))
    server = agg.server
    assert float(agg.flops) == 0 and agg.metrics == {}
    anchors, mean = np_server_round(anchors, protos.astype(np.float64),
                                    seen & participants[:, None], mu)
    np.testing.assert_allclose(np.asarray(server.anchors), anchors, rtol=1e-6, atol=1e-6)
    avail = np.isin(np.arange(C), list(mean))
    np.testing.assert_array_equal(np.asarray(server.avail), avail)
    for c in mean:  # the unweighted mean over holders
      np.testing.assert_allclose(np.asarray(server.protos[c]), mean[c], rtol=1e-5, atol=1e-5)
    # Rows without an upload stay bitwise as they were; the others move by (1 - mu) of the way.
    np.testing.assert_array_equal(np.asarray(server.anchors)[~avail], before[~avail])
    assert not np.array_equal(np.asarray(server.anchors)[avail], before[avail])
    assert float(server.global_gap) == pytest.approx(np_gap(anchors), rel=1e-5)


def test_central_dp_mean_is_the_noised_sum_over_q_owners():
  cfg = config_lib.base_config('cifar10')
  cfg.num_clients, cfg.participation = 4, 0.5  # q = 2 / 4
  cfg.privacy.upload, cfg.privacy.upload_mode = True, 'central'
  method = fedsa.FedSA(cfg, 4, 3)
  assert fedsa.FedSA.upload_refusal(cfg, 'central') is None
  seen = np.array([[1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, 0]], bool)  # owners 3, 3, 2
  server = method.init_server(jax.random.PRNGKey(0), jnp.asarray(seen))
  rng = np.random.default_rng(6)
  protos = np.where(seen[:, :, None], rng.normal(size=(4, 3, D)), 0).astype(np.float32)
  server = method.server_receive(server, jnp.arange(4), prototypes.PrototypeUpload(
      protos=jnp.asarray(protos), n=jnp.asarray(seen, jnp.float32)), jnp.ones(4, bool))
  noised = method.central_noise(server, jax.random.PRNGKey(7), 0.5)
  participants = np.array([1, 0, 1, 0], bool)  # nobody uploads class 1... but it has owners
  new = method.server_aggregate(noised, jnp.asarray(participants), 0, None).server
  total = (protos * (seen & participants[:, None])[:, :, None]).sum(0)
  want = (total + np.asarray(noised.noise)) / (0.5 * seen.sum(0))[:, None]
  np.testing.assert_allclose(np.asarray(new.protos), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(new.avail), [True, True, True])
  np.testing.assert_allclose(np.asarray(new.anchors),
                             0.9999 * np.asarray(server.anchors) + 0.0001 * want, rtol=1e-6,
                             atol=1e-6)
  assert not np.asarray(new.noise).any()


def test_nearest_prototype_metric_over_the_uploaded_classes():
  method = make_method()
  rng = np.random.default_rng(7)
  k, b = 3, 8
  protos = np.abs(rng.normal(size=(C, D))).astype(np.float32)
  rep = np.abs(rng.normal(size=(k, b, D))).astype(np.float32)
  y = rng.integers(0, C, size=(k, b)).astype(np.int32)
  rep[:, :C] = protos + 0.1 * rng.normal(size=(C, D))  # some samples near their class's row
  y[:, :C] = np.arange(C)
  valid = np.ones((k, b), bool)
  valid[1, -3:] = False
  server = method.init_server(jax.random.PRNGKey(0), None)
  for avail in (np.array([1, 0, 1, 1], bool), np.zeros(C, bool)):
    s = server.replace(protos=jnp.asarray(protos), avail=jnp.asarray(avail))
    got = jax.vmap(lambda r, y, v: method.eval_extra(s, 0, None, r, y, v))(
        jnp.asarray(rep), jnp.asarray(y), jnp.asarray(valid))['prototype_accuracy']
    for i in range(k):  # test_metrics: argmin over the rows of P_bar of MSE(r, P_bar[c])
      right = 0
      for j in np.flatnonzero(valid[i]):
        out = np.full(C, np.inf)
        for c in np.flatnonzero(avail):
          out[c] = ((rep[i, j].astype(np.float64) - protos[c]) ** 2).mean()
        right += bool(avail.any()) and out.argmin() == y[i, j]
      assert int(got[i]) == right
    assert int(got.sum()) > 0 or not avail.any()


def test_config_options_and_download_floats():
  method = make_method()
  assert (method.lam, method.mcl, method.cc, method.mu) == (10.0, 1.0, 1.0, 0.9999)
  assert method.headline_metric == 'accuracy' and not method.exact_sqrt
  assert make_method(inference='prototype').headline_metric == 'prototype_accuracy'
  b = config_lib.base_config('cifar10').batch_size
  assert method.train_flops_per_sample(1e6, None) == 1e6 + 6 * C * D + 6 * C * (D + 1) / b
  for field, value in (('lam', -1.0), ('mcl', -0.5), ('cc', -1.0), ('ema_momentum', 1.5),
                       ('inference', 'anchor')):
    with pytest.raises(ValueError, match=f'fedsa.{field}'):
      make_method(**{field: value})
  server = method.init_server(jax.random.PRNGKey(0), None)
  state = method.init_client_state(None)
  for inference in ('classifier', 'prototype'):
    m = make_method(inference=inference)
    for avail in (np.zeros(C, bool), np.array([1, 0, 1, 0], bool)):
      down = m.download({}, state, server.replace(avail=jnp.asarray(avail)),
                        client_view(0, np.array([1, 1, 0, 0], bool), 5, 1))
      want = C + (avail.sum() if inference == 'prototype' else 0)  # the anchors, every round
      assert int(down.floats) == D * want


# --- rounds through the engine -----------------------------------------------------------------
@pytest.fixture(scope='module')
def two_rounds(small_ds, tmp_path_factory):
  """FedSA's small simulator: one seed's state before each of two rounds and after the last, the
  rounds' infos, and the state after round 2 run again from round 1's checkpoint on disk."""
  from fedssa_jax.run import checkpoint  # pylint: disable=import-outside-toplevel
  sim = make_small_sim(small_ds, 'fedsa')
  state = sim.init_state()
  states, infos = [snapshots.seed_state(sim.store, state)], []
  saver = checkpoint.Checkpointer(str(tmp_path_factory.mktemp('fedsa_ckpt')))
  for t in range(2):
    if t == 1:
      saver.save(snapshots.before_checkpoint(sim.store, state), {}, {})
    state, (info,) = sim.run_round(state)
    states.append(snapshots.seed_state(sim.store, state))
    infos.append(info)
  fresh = sim.init_state()
  restored = saver.restore_latest(template=snapshots.saved(sim.store, fresh))
  del fresh
  [(state, _)] = list(rounds(sim, 1, snapshots.stacked(sim.store, [restored.state])))
  return sim, states, infos, snapshots.seed_state(sim.store, state), sim.evaluate(state)


@pytest.mark.slow  # a simulator compiled and run
def test_rounds_move_uploaded_anchors_keep_local_gaps_and_resume(two_rounds):
  sim, states, infos, resumed, ev = two_rounds
  seen = sim.seen[0]
  for t, info in enumerate(infos):
    before, after = states[t], states[t + 1]
    assert np.isfinite(info.train_loss)
    np.testing.assert_array_equal(info.client_up_floats, D * seen[info.cohort].sum(1))
    np.testing.assert_array_equal(info.client_down_floats,
                                  D * sim.num_classes + 0 * info.cohort)
    uploaded = seen[info.cohort].any(0)
    np.testing.assert_array_equal(np.asarray(after.server.avail), uploaded)
    a0, a1 = np.asarray(before.server.anchors), np.asarray(after.server.anchors)
    np.testing.assert_array_equal(a1[~uploaded], a0[~uploaded])
    np.testing.assert_allclose(a1[uploaded], 0.9999 * a0[uploaded] + 0.0001 * np.asarray(
        after.server.protos)[uploaded], rtol=1e-6, atol=1e-6)
    # Each participant keeps the gap of the prototypes it uploaded (2 classes each here).
    gaps = np.asarray(after.population.client_state.local_gap)
    for k in info.cohort:
      p = np.asarray(after.server.uploads[k])[seen[k]]
      assert gaps[k] == pytest.approx(np_gap(p.astype(np.float64)), rel=1e-4)
    others = np.setdiff1d(np.arange(sim.num_clients), info.cohort)
    kept = np.asarray(before.population.client_state.local_gap)
    np.testing.assert_array_equal(gaps[others], kept[others])
  # Round 2 from round 1's checkpoint: the same state.
  for a, b in zip(jax.tree.leaves((states[2].server, states[2].population)),
                  jax.tree.leaves((resumed.server, resumed.population))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.isfinite(ev.accuracy).all() and (ev.count > 0).all()
  acc = ev.metrics['prototype_accuracy']
  assert np.all((0 <= acc) & (acc <= 1))
  np.testing.assert_array_equal(ev.accuracy, ev.classifier_accuracy)
