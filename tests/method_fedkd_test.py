"""FedKD (docs/algorithm.md §6): the joint adaptive loss against a numpy hand computation, the SVD
rank rule and payload counts against a plain numpy loop over matrices, vmapped compression equals
per-client, the server rule, the download charges, and one engine round trip."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, models
from fedssa_jax.engine import snapshots
from fedssa_jax.methods import aggregation, base, fedkd

from conftest import aggregate, client_view, log_softmax, random_params, stack_trees

C = 4
D = config_lib.base_config('cifar10').model.feature_dim  # d of the methods' configs


def make_method(num_clients=5, num_classes=C, num_rounds=10, start=0.95, end=0.98,
                compression='update'):
  c = config_lib.base_config('cifar10')
  c.model.conv_impl = 'im2col'
  c.num_rounds = num_rounds
  c.fedkd.energy_start, c.fedkd.energy_end = start, end
  c.fedkd.compression = compression
  return fedkd.FedKD(c, num_clients, num_classes)


def numpy_compress(a, t):
  """The spec's rule on one tensor, by a plain loop. Returns (rebuilt, floats, rank or None)."""
  a = np.asarray(a, np.float64)
  if a.ndim == 1:
    return a, a.size, None
  mat = a.reshape(-1, a.shape[-1])
  m, n = mat.shape
  u, s, vt = np.linalg.svd(mat, full_matrices=False)
  total = np.sum(s ** 2)
  if total == 0:
    return a, m * n, None
  q = len(s)
  for r in range(1, len(s) + 1):
    if np.sum(s[:r] ** 2) >= t * total:
      q = r
      break
  if q * (m + n + 1) >= m * n:
    return a, m * n, q
  return ((u[:, :q] * s[:q]) @ vt[:q]).reshape(a.shape), q * (m + n + 1), q


def test_energy_schedule_and_validation():
  for t, want in ((0, 0.95 + 0.03 / 10), (4, 0.95 + 0.03 * 5 / 10), (9, 0.98)):
    assert float(fedkd.energy(t, 0.95, 0.98, 10)) == pytest.approx(want, rel=1e-6)
  with pytest.raises(ValueError, match='fedkd.energy_end'):
    make_method(end=1.2)
  assert make_method(num_classes=10).mentee_floats == 670_058
  assert make_method().mentee_floats == 665_048 + 501 * C


def test_rank_rule_and_payload_equal_numpy_loop():
  rng = np.random.default_rng(0)
  low_rank = rng.normal(size=(40, 3)) @ rng.normal(size=(3, 30)) + 0.01 * rng.normal(size=(40, 30))
  orth = np.linalg.qr(rng.normal(size=(12, 12)))[0][:, :4] * 3.0  # equal singular values
  tree = {
      'low_rank': low_rank,          # compressed, small q
      'full': rng.normal(size=(9, 7)),  # generic: q near full, dense is cheaper
      'equal_sv': orth,              # only the full rank meets T: q clamped to 4, sent dense
      'zero': np.zeros((20, 10)),    # sum s^2 = 0: dense
      'conv': rng.normal(size=(5, 5, 6, 3)) @ np.diag([5.0, 3.0, 0.05]),  # HWIO -> [150, 3]
      'wide': (rng.normal(size=(3, 1)) @ rng.normal(size=(1, 200))),  # rank 1, m < n
      'bias': rng.normal(size=(11,)),
  }
  tree = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), tree)
  t = 0.97
  recon, floats, svd, rebuild = jax.jit(fedkd.compress_update)(tree, t)
  want_floats, want_svd, want_rebuild, ranks = 0, 0.0, 0.0, {}
  for name, a in tree.items():
    r, f, q = numpy_compress(a, t)
    ranks[name] = q
    np.testing.assert_allclose(np.asarray(recon[name]), r, rtol=1e-4, atol=1e-5, err_msg=name)
    want_floats += f
    if a.ndim > 1:
      m, n = sorted(np.asarray(a).reshape(-1, a.shape[-1]).shape, reverse=True)
      want_svd += min(14 * m * n * n + 8 * n ** 3, 6 * m * n * n + 20 * n ** 3)
      if f < m * n:
        want_rebuild += 2 * q * m * n
  assert ranks['low_rank'] == 3 and ranks['equal_sv'] == 4 and ranks['wide'] == 1
  assert ranks['conv'] == 2 and ranks['zero'] is None
  assert int(floats) == want_floats
  assert float(svd) == pytest.approx(want_svd)
  assert float(rebuild) == pytest.approx(want_rebuild)


def test_vmapped_compression_equals_per_client():
  rng = np.random.default_rng(1)
  k = 3
  tree = {'a': rng.normal(size=(k, 30, 4)) @ rng.normal(size=(k, 4, 20)),
          'b': rng.normal(size=(k, 5, 5, 2, 4)), 'c': rng.normal(size=(k, 6))}
  tree['a'][1] = 0.0  # one client's zero update
  tree = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), tree)
  batched = jax.jit(jax.vmap(fedkd.compress_update, in_axes=(0, None)))(tree, 0.95)
  for i in range(k):
    one = fedkd.compress_update(jax.tree_util.tree_map(lambda a: a[i], tree), 0.95)
    for got, want in zip(jax.tree_util.tree_leaves(batched), jax.tree_util.tree_leaves(one)):
      # Batched and single SVDs may take different float32 paths (e.g. Jacobi vs QR on GPUs).
      np.testing.assert_allclose(np.asarray(got)[i], np.asarray(want), rtol=1e-4, atol=1e-4)


def test_thin_svd_under_nested_vmap_is_each_matrix_s():
  # Replicas x clients, as packed seeds batch it: on the CPU one matrix after another (two
  # concurrent batched SVDs can deadlock XLA:CPU's thread pool), the same numbers as alone.
  a = jnp.asarray(np.random.default_rng(2).normal(size=(2, 3, 12, 5)), jnp.float32)
  u, s, vt = jax.jit(jax.vmap(jax.vmap(fedkd.thin_svd)))(a)
  assert u.shape == (2, 3, 12, 5) and s.shape == (2, 3, 5) and vt.shape == (2, 3, 5, 5)
  for r in range(2):
    for c in range(3):
      want = jnp.linalg.svd(a[r, c], full_matrices=False)
      for got, w in zip((u, s, vt), want):
        np.testing.assert_allclose(np.asarray(got[r, c]), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_loss_vmapped_equals_hand_computation():
  method = make_method()
  own = models.make_model('cnn4', C, 'im2col', feature_dim=D)
  mentors = stack_trees([random_params(own, i) for i in range(2)])
  mentees = stack_trees([random_params(method.mentee_model, 2 + i) for i in range(2)])
  rng = np.random.default_rng(0)
  w_h = jnp.asarray(rng.uniform(-0.045, 0.045, size=(2, 500, 500)), jnp.float32)
  b = 6
  x = jnp.asarray(rng.normal(size=(2, b, 32, 32, 3)), jnp.float32)
  y = jnp.asarray(rng.integers(0, C, size=(2, b)), jnp.int32)
  valid = jnp.asarray([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]], bool)

  def loss(mp, ms, w, x, y, v):
    return method.loss(own.apply, {'model': mp, 'mentee': ms, 'w_h': w}, None, (x,), y, v)

  loss_v, (correct_v, acc_v) = jax.jit(jax.vmap(loss))(mentors, mentees, w_h, x, y, valid)
  assert acc_v is None  # the loss accumulates nothing
  outs = jax.jit(jax.vmap(lambda mp, ms, x: (own.apply({'params': mp}, x),
                                             method.mentee_model.apply({'params': ms}, x))))
  (zs, hs), (zss, hss) = jax.tree_util.tree_map(np.asarray, outs(mentors, mentees, x))
  for i in range(2):
    z, h = zs[i].astype(np.float64), hs[i].astype(np.float64)
    z_s, h_s = zss[i].astype(np.float64), hss[i].astype(np.float64)
    yi, idx = np.asarray(y[i]), np.flatnonzero(np.asarray(valid[i]))
    lz, ls = log_softmax(z), log_softmax(z_s)
    q = -np.mean([lz[j, yi[j]] for j in idx]) - np.mean([ls[j, yi[j]] for j in idx])
    kl_s_z = sum(np.sum(np.exp(ls[j]) * (ls[j] - lz[j])) for j in idx) / (len(idx) * C)
    kl_z_s = sum(np.sum(np.exp(lz[j]) * (lz[j] - ls[j])) for j in idx) / (len(idx) * C)
    proj = h_s @ np.asarray(w_h[i], np.float64)
    mse = sum(np.sum((h[j] - proj[j]) ** 2) for j in idx) / (len(idx) * 500)
    want = q + (kl_s_z + kl_z_s + 2 * mse) / q
    np.testing.assert_allclose(float(loss_v[i]), want, rtol=1e-5)
    assert int(correct_v[i]) == sum(np.argmax(z[j]) == yi[j] for j in idx)


def small_tree(rng, lead=()):
  """A stand-in for the CNN-5 tree (the server hooks only map over leaves)."""
  return {'fc': {'kernel': rng.normal(size=(*lead, 30, 12)).astype(np.float32),
                 'bias': rng.normal(size=(*lead, 12)).astype(np.float32)},
          'conv': {'kernel': rng.normal(size=(*lead, 5, 5, 2, 3)).astype(np.float32)}}


def htfllib_decomposition(tree, energy):
  """HtFLlib's clientkd.py `decomposition` then `recover`, transcribed line by line in numpy on
  torch's layouts (conv [O, I, 5, 5], dense [out, in]), of our tree (HWIO, [in, out]). Returns
  (the rebuilt tree in our layout, the floats of the compressed form)."""
  out, floats = {}, 0
  for name, x in tree.items():
    x = np.asarray(x, np.float64)
    p = (np.transpose(x, (3, 2, 0, 1)) if x.ndim == 4 else x.T if x.ndim == 2 else x)
    if p.shape[0] > 1 and len(p.shape) > 1:
      u, sigma, v = np.linalg.svd(p, full_matrices=False)
      if len(u.shape) == 4:
        u, sigma, v = (np.transpose(u, (2, 3, 0, 1)), np.transpose(sigma, (2, 0, 1)),
                       np.transpose(v, (2, 3, 0, 1)))
      threshold = 0
      if np.sum(np.square(sigma)) == 0:
        rebuilt, floats = p, floats + p.size
      else:
        for singular_value_num in range(len(sigma)):
          if np.sum(np.square(sigma[:singular_value_num])) > energy * np.sum(np.square(sigma)):
            threshold = singular_value_num
            break
        u, sigma, v = u[:, :threshold], sigma[:threshold], v[:threshold, :]
        if len(u.shape) == 4:
          u, sigma, v = (np.transpose(u, (2, 3, 0, 1)), np.transpose(sigma, (1, 2, 0)),
                         np.transpose(v, (2, 3, 0, 1)))
        floats += u.size + sigma.size + v.size
        rebuilt = np.matmul(u * sigma[..., None, :], v)  # recover
    else:
      rebuilt, floats = p, floats + p.size
    out[name] = (np.transpose(rebuilt, (2, 3, 1, 0)) if x.ndim == 4 else
                 rebuilt.T if x.ndim == 2 else rebuilt)
  return out, floats


def test_htfllib_compression_equals_its_code_transcribed():
  """fedkd.compression=htfllib: the rebuilt tensors and floats of HtFLlib's decomposition,
  its rank-0 outcome included: a head whose smallest singular value holds more than 1 - T of
  the energy (ten equal ones: 10% each) is rebuilt as zeros."""
  rng = np.random.default_rng(4)
  tree = {
      'head': np.linalg.qr(rng.normal(size=(40, 10)))[0] * 2.0,  # [in 40, out 10], equal s
      'low_rank': rng.normal(size=(30, 3)) @ rng.normal(size=(3, 12))
                  + 0.01 * rng.normal(size=(30, 12)),
      'conv': rng.normal(size=(5, 5, 3, 4)) + 4.0 * rng.normal(size=(5, 1, 1, 1)),
      'full': rng.normal(size=(9, 7)),
      'out_one': rng.normal(size=(7, 1)),  # torch's [1, 7]: sent as it is
      'zero': np.zeros((20, 10)),
      'bias': rng.normal(size=(11,)),
  }
  tree = {k: jnp.asarray(v, jnp.float32) for k, v in tree.items()}
  t = 0.96
  recon, floats, svd, rebuild = jax.jit(fedkd.compress_htfllib)(tree, t)
  want, want_floats = htfllib_decomposition(tree, t)
  for name in tree:
    np.testing.assert_allclose(np.asarray(recon[name]), want[name], rtol=1e-4, atol=1e-4,
                               err_msg=name)
  assert int(floats) == want_floats
  assert not np.asarray(recon['head']).any()  # rank 0: zeros
  assert 0 < np.abs(np.asarray(recon['conv']) - np.asarray(tree['conv'])).max()  # truncated
  np.testing.assert_array_equal(np.asarray(recon['out_one']), np.asarray(tree['out_one']))
  assert float(svd) == pytest.approx(fedkd.svd_flops(10, 40) + fedkd.svd_flops(12, 30)
                                     + 12 * fedkd.svd_flops(5, 5) + fedkd.svd_flops(7, 9)
                                     + fedkd.svd_flops(10, 20))
  assert float(rebuild) > 0


def test_htfllib_server_schedule_and_download():
  """compression=htfllib: T_t = start + (end - start) t / R; theta_g becomes the compressed
  mean of the uploaded (compressed) parameters; every client downloads it after round 0."""
  n, t = 4, 3
  method = make_method(num_clients=n, compression='htfllib')
  assert float(method.threshold(0)) == pytest.approx(0.95)
  assert float(method.threshold(t)) == pytest.approx(0.95 + 0.03 * t / 10, rel=1e-6)
  rng = np.random.default_rng(5)
  theta = small_tree(rng)
  server = fedkd.FedKDServer(theta=theta, inbox=aggregation.Inbox.empty(theta),
                             held=jnp.zeros(n, jnp.int32), last_floats=jnp.int32(7),
                             last_rebuild=jnp.float32(0))
  up = small_tree(rng, (2,))
  server = method.server_receive(server, jnp.asarray([0, 2]), fedkd.FedKDUpload(update=up),
                                 jnp.asarray([True, True]))
  server = aggregate(method, server, np.array([True, False, True, False]), t, jit=True)
  flat = lambda tree: {'/'.join(map(str, k)): v for k, v in
                       jax.tree_util.tree_flatten_with_path(tree)[0]}
  mean = {k: (v[0].astype(np.float64) + v[1]) / 2 for k, v in flat(up).items()}
  want, want_floats = htfllib_decomposition(mean, float(method.threshold(t)))
  for k, v in flat(server.theta).items():
    np.testing.assert_allclose(np.asarray(v), want[k], rtol=1e-4, atol=1e-4, err_msg=k)
  assert int(server.last_floats) == want_floats
  params, seen = {}, jnp.ones(C, bool)
  state = fedkd.FedKDState(w_h=jnp.zeros((D, D)))
  for r, floats in ((0, 0), (t + 1, want_floats), (t + 5, want_floats)):  # held or not
    assert int(method.download(params, state, server, client_view(1, seen, 0, r)).floats) == floats
  with pytest.raises(Exception, match='uploads the mentee.s parameters'):
    c = config_lib.base_config('cifar10')
    c.method, c.fedkd.compression = 'fedkd', 'htfllib'
    c.privacy.upload, c.privacy.upload_mode = True, 'central'
    c.privacy.upload_noise_multiplier = 1.0
    config_lib.validate(c)


def test_server_rule_equals_loop():
  n, t = 5, 3
  method = make_method(num_clients=n)
  rng = np.random.default_rng(2)
  theta = small_tree(rng)
  server = fedkd.FedKDServer(
      theta=theta, inbox=aggregation.Inbox.empty(theta),
      held=jnp.asarray([0, 2, 1, 0, 2], jnp.int32),
      last_floats=jnp.int32(7), last_rebuild=jnp.float32(0))
  received = []
  for ids, active in (([0, 3, 0], [True, True, False]), ([4], [True])):
    up = small_tree(rng, (len(ids),))
    # Uploads are low rank plus noise, as real updates are, so the mean compresses.
    up['fc']['kernel'] = (rng.normal(size=(len(ids), 30, 2)) @ rng.normal(size=(2, 12))
                          + 1e-3 * up['fc']['kernel']).astype(np.float32)
    server = method.server_receive(server, jnp.asarray(ids), fedkd.FedKDUpload(update=up),
                                   jnp.asarray(active))
    received += [jax.tree_util.tree_map(lambda a: a[j], up) for j in range(len(ids)) if active[j]]
  participants = np.zeros(n, bool)
  participants[[0, 3, 4]] = True
  server = aggregate(method, server, participants, t, jit=True)

  energy_t = 0.95 + 0.03 * (t + 1) / 10
  want_floats = 0
  received = [jax.tree_util.tree_leaves(r) for r in received]
  for li, (old, got) in enumerate(zip(jax.tree_util.tree_leaves(theta),
                                      jax.tree_util.tree_leaves(server.theta))):
    mean = sum(r[li].astype(np.float64) for r in received) / len(received)
    rebuilt, f, _ = numpy_compress(mean, energy_t)
    want_floats += f
    np.testing.assert_allclose(np.asarray(got), old + rebuilt, rtol=1e-4, atol=1e-5)
  assert want_floats < 30 * 12 + 12 + 150 * 3  # the fc kernel went compressed
  assert int(server.last_floats) == want_floats
  np.testing.assert_array_equal(np.asarray(server.held), [3, 2, 1, 3, 3])
  assert int(server.inbox.weight) == 0 and server.inbox.weight.dtype == jnp.int32
  assert all(not np.asarray(l).any() for l in jax.tree_util.tree_leaves(server.inbox.sum))


@pytest.mark.slow  # SVDs and charges, op by op: many small programs
def test_download_charges_and_upload():
  n = 5
  method = make_method(num_clients=n)
  p5 = method.mentee_floats
  rng = np.random.default_rng(3)
  theta = random_params(method.mentee_model, 0)
  server = fedkd.FedKDServer(theta=theta, inbox=aggregation.Inbox(theta, jnp.int32(0)),
                             held=None,
                             last_floats=jnp.int32(12_345), last_rebuild=jnp.float32(1e6))
  state = jax.vmap(method.init_client_state)(jax.random.split(jax.random.PRNGKey(0), n))
  w = np.asarray(state.w_h)
  assert w.shape == (n, 500, 500) and np.abs(w).max() <= 500 ** -0.5 and w.std() > 0.02
  params = random_params(models.make_model('cnn4', C, 'im2col', feature_dim=D), 1)
  seen = jnp.ones(C, bool)
  # Rounds 0 and 1: everyone holds theta_0 (shared seed), so round 0 needs nothing and round 1
  # needs Delta_bar_0. Round 3: clients 1 and 4 took part in round 2 and need only the compressed
  # Delta_bar_2; the others hold older thetas and are charged P_5 dense.
  for t, held, want in ((0, [0] * n, [0] * n), (1, [0] * n, [12_345] * n),
                        (3, [0, 2, 1, 0, 2], [p5, 12_345, p5, p5, 12_345])):
    server = server.replace(held=jnp.asarray(held, jnp.int32))
    for k in range(n):
      down = method.download(params, fedkd.FedKDState(w_h=state.w_h[k]), server,
                             client_view(k, seen, 0, t))
      assert int(down.floats) == want[k] and down.floats.dtype == jnp.int32, (t, k)
      assert float(down.flops) == (1e6 + p5 if want[k] == 12_345 else 0.0)
      np.testing.assert_array_equal(np.asarray(down.aux['w_h']), w[k])
  assert down.aux['mentee'] is theta and down.ctx.theta is theta
  # Upload: the compressed mentee update, W_h kept as state.
  mentee = jax.tree_util.tree_map(lambda a: a + 0.01 * jnp.asarray(
      rng.normal(size=a.shape), jnp.float32), theta)
  trainable = {'model': params, 'mentee': mentee, 'w_h': state.w_h[4] + 1.0}
  up = method.upload(trainable, base.Accumulated(), fedkd.FedKDContext(theta=theta),
                     fedkd.FedKDState(w_h=state.w_h[4]), client_view(4, seen, 9, 3))
  want_payload, want_floats = fedkd.compress_update(
      jax.tree_util.tree_map(jnp.subtract, mentee, theta), method.threshold(3))[:2]
  assert int(up.floats) == int(want_floats) and 1048 + C < int(up.floats) <= p5
  for a, b in zip(jax.tree_util.tree_leaves(up.payload.update),
                  jax.tree_util.tree_leaves(want_payload)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(up.state.w_h), np.asarray(trainable['w_h']))
  assert up.params is params and float(up.flops) > 0


@pytest.mark.slow  # a simulator compiled and run
def test_engine_round_trip(small_sim):
  # seed 1: cohorts [1 2], [1 3], [3 4]: round 2 has a Delta_bar and a dense download
  sim = small_sim('fedkd', num_rounds=3, seed=1)
  c = sim.config
  p5 = 665_048 + 501 * 10
  for fam, fps in sim.flops.per_sample.items():
    assert fps == pytest.approx(sim.flops.model(fam) + sim.flops.model('cnn5') + 6 * 500 ** 2)
  state = sim.init_state()
  held = np.zeros(c.num_clients, int)
  charged = set()
  for t in range(c.num_rounds):
    last = int(snapshots.seed_state(sim.store, state).server.last_floats)
    state, (info,) = sim.run_round(state)
    assert np.isfinite(info.train_loss)
    want_down = [0 if t == 0 else last if held[k] == t - 1 else p5 for k in info.cohort]
    np.testing.assert_array_equal(info.client_down_floats, want_down)
    charged |= {'zero' if w == 0 else 'dense' if w == p5 else 'delta' for w in want_down}
    up = info.client_up_floats
    assert np.all((up > 1048 + 10) & (up <= p5))
    held[info.cohort] = t
    np.testing.assert_array_equal(
        np.asarray(snapshots.seed_state(sim.store, state).server.held), held)
  assert charged == {'zero', 'delta', 'dense'}
  last = snapshots.seed_state(sim.store, state)
  assert 0 < int(last.server.last_floats) <= p5
  assert np.asarray(last.population.client_state.w_h).shape == (c.num_clients, 500, 500)
  ev = sim.evaluate(state)
  assert np.all((0 <= ev.accuracy) & (ev.accuracy <= 1))  # also false for NaN
