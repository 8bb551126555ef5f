"""FedORGP (docs/algorithm.md §6): the client loss against a per-sample loop; the server's L_OR,
plain and with the adaptive weights, against a numpy transcription of the authors' code
(serverorth.py's intra_orth_loss and inter_orth_loss) and hand cases, its gradient against
central differences; the server's epoch against a plain per-step loop; the outlier filter
against a numpy transcription of clientorth.py's filter_outliers_multi_metric; and rounds
through the engine with the repository HEAD's variant (the filter on the forward pass's
per-sample representations, Method.forward_pass_rows), T kept across rounds."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, models
from fedssa_jax.engine import snapshots
from fedssa_jax.methods import base, fedorgp, prototypes
from fedssa_jax.streams import Stream

from conftest import client_view, log_softmax, make_small_sim

C, D = 4, config_lib.base_config('cifar10').model.feature_dim


def make_method(n=5, c=C, **fields):
  cfg = config_lib.base_config('cifar10')
  cfg.orgp.update(fields)
  return fedorgp.FedORGP(cfg, n, c)


def unit(x):
  """F.normalize: x / max(||x||, 1e-12) along the last axis."""
  return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def test_defaults_options_and_checks():
  m = make_method()
  assert (m.lam_c, m.lam_s, m.gamma, m.lr, m.epochs, m.batch) == (100.0, 1.0, 10.0, 0.01, 1, 32)
  assert not m.adaptive and not m.filter and m.forward_pass == 'after'
  assert not m.forward_pass_rows and m.headline_metric == 'accuracy'
  head = make_method(variant='repo_head')
  assert head.adaptive and head.filter and head.forward_pass_rows
  adaptive = make_method(adaptive_weights=True)
  assert adaptive.adaptive and not adaptive.filter
  assert make_method(proto_source='train_pass').forward_pass is None
  for field, value in (('lam_c', -1.0), ('lam_s', -1.0), ('gamma', -1.0), ('server_lr', 0.0),
                       ('server_epochs', 0), ('server_batch', 0), ('proto_source', 'pass'),
                       ('variant', 'head'), ('filter_alpha', 1.5)):
    with pytest.raises(ValueError, match=f'orgp.{field}'):
      make_method(**{field: value})
  with pytest.raises(ValueError, match='orgp.filter_outliers'):
    make_method(proto_source='train_pass', variant='repo_head')


def test_loss_equals_per_sample_loop():
  """CE + lam_c / B sum_i g[y_i] (1 - cos(r_i, P^[y_i])), normalised with eps 1e-12 (a zero r
  has cos 0), P^ under sg; CE alone before P^ exists."""
  method = make_method()
  rng = np.random.default_rng(0)
  b = 7
  logits = rng.normal(size=(b, C)).astype(np.float32)
  rep = rng.normal(size=(b, D)).astype(np.float32)
  rep[2] = 0.0
  y = rng.integers(0, C, size=b).astype(np.int32)
  valid = np.array([1, 1, 1, 1, 1, 0, 0], bool)
  protos = rng.normal(size=(C, D)).astype(np.float32)
  apply_fn = lambda variables, x: (variables['params']['z'], variables['params']['r'])

  def loss_of(r, p, avail):
    ctx = prototypes.GlobalPrototypes(protos=p, avail=avail)
    return method.loss(apply_fn, {'model': {'z': logits, 'r': r}}, ctx, (None,), y, valid)

  loss_fn = jax.jit(loss_of)
  for avail in (np.ones(C, bool), np.zeros(C, bool)):
    loss, (correct, acc) = loss_fn(rep, protos, avail)
    ce = term = 0.0
    for j in np.flatnonzero(valid):
      ce -= log_softmax(logits[j].astype(np.float64))[y[j]]
      term += 1.0 - unit(rep[j].astype(np.float64)) @ unit(protos[y[j]]) if avail[y[j]] else 0
    m = valid.sum()
    assert float(loss) == pytest.approx(ce / m + 100.0 * term / m, rel=1e-5)
    assert int(correct) == sum(logits[j].argmax() == y[j] for j in np.flatnonzero(valid))
    assert acc is None
  grads = jax.jit(jax.grad(lambda r, p: loss_of(r, p, np.ones(C, bool))[0], (0, 1)))(rep, protos)
  assert np.isfinite(np.asarray(grads[0])).all()  # the zero r too
  assert not np.asarray(grads[1]).any()  # P^ is a constant


def test_upload_download_and_floats():
  """By default the plain class means of the forward pass's V1 sums over the held classes, d
  s_k floats up; all of P^ down, d C floats, once it exists (0 before)."""
  method = make_method()
  rng = np.random.default_rng(1)
  seen = np.array([[1, 1, 0, 0], [0, 1, 1, 1]], bool)
  counts = np.where(seen, rng.integers(1, 9, size=seen.shape), 0).astype(np.float32)
  sums = (rng.normal(size=(2, C, D)) * counts[:, :, None]).astype(np.float32)
  acc = base.Accumulated(forward_pass=base.ClassSums(sum=jnp.asarray(sums),
                                                     count=jnp.asarray(counts)))
  up = jax.jit(jax.vmap(lambda a, s: method.upload(
      {'model': {}}, a, None, base.NoState(), client_view(0, s, 5, 1))))(acc, jnp.asarray(seen))
  for k in range(2):
    assert int(up.floats[k]) == D * seen[k].sum()
    want = np.where(seen[k][:, None], sums[k] / np.maximum(counts[k], 1)[:, None], 0)
    np.testing.assert_allclose(np.asarray(up.payload.protos[k]), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(up.payload.n[k]), counts[k])
  protos = jnp.asarray(rng.normal(size=(C, D)), jnp.float32)
  down = jax.jit(lambda avail: method.download({}, base.NoState(), fedorgp.FedORGPServer(
      net={}, uploads=None, uploads_n=None, protos=protos, avail=avail),
      client_view(0, seen[1], 5, 1)))
  for avail in (np.zeros(C, bool), np.ones(C, bool)):
    d = down(avail)
    assert int(d.floats) == D * avail.sum()
    np.testing.assert_array_equal(np.asarray(d.ctx.avail), avail)
    np.testing.assert_array_equal(np.asarray(d.ctx.protos), np.asarray(protos))


def reference_or_loss(rep, labels, protos, lam_s, gamma, adaptive):
  """serverorth.py's lam_s * intra_orth_loss + gamma * inter_orth_loss, in numpy."""
  rep_norm, protos_norm = unit(rep), unit(protos)
  sim_intra = np.sum(rep_norm * protos_norm[labels], 1)
  sim_all = np.abs(rep_norm @ protos_norm.T)
  mask = np.ones_like(sim_all)
  mask[np.arange(len(labels)), labels] = 0
  sigmoid = lambda z: 1 / (1 + np.exp(-z))
  if adaptive:
    other = (sim_all * mask).sum(1) / np.maximum(mask.sum(1), 1)
    intra = np.sum((1 - sim_intra) * (1 + sigmoid((other - 0.3) / 0.5))) / len(rep)
    inter = np.sum(sim_all * (1 + sigmoid((sim_all - 0.3) / 0.5)) * mask) / mask.sum()
  else:
    intra = np.sum(1 - sim_intra) / len(sim_intra)
    inter = np.sum(sim_all * mask) / mask.sum()
  return lam_s * intra + gamma * inter


def test_or_loss_hand_cases():
  """C = 3, d = 2, G = (e1, e2, -e1), lam_s = gamma = 1: L = (1 - s_b) + o_b, o_b over the
  C - 1 = 2 other classes, |cos| counting cos = -1 as 1; padding rows add nothing."""
  g = jnp.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
  loss = jax.jit(lambda x, y, w, adaptive: fedorgp.orthogonality_loss(
      g, x, y, w, lam_s=1.0, gamma=1.0, adaptive=adaptive), static_argnums=3)
  e1, e2 = [1.0, 0.0], [0.0, 1.0]
  for x, y, w, want in (([e2], [1], [1], 0.0),                  # s = 1, orthogonal: o = 0
                        ([e1], [0], [1], 0.5),                  # |cos(e1, -e1)| = 1, over 2
                        ([[0.0, -3.0]], [1], [1], 2.0),         # s = -1
                        ([e1, e2], [0, 1], [1, 1], 0.25),
                        ([e1, [5.0, 7.0]], [0, 2], [1, 0], 0.5)):  # a padding row
    got = loss(jnp.asarray(x), jnp.asarray(y), jnp.asarray(w, jnp.float32), False)
    assert float(got) == pytest.approx(want, abs=1e-6)
  x = jnp.asarray([e1, [5.0, 7.0]])
  assert float(loss(x, jnp.asarray([0, 2]), jnp.zeros(2), True)) == 0.0  # no valid row


@pytest.mark.parametrize('adaptive', (False, True))
def test_or_loss_equals_reference_and_central_differences(adaptive):
  rng = np.random.default_rng(1)
  b, c, d = 6, 5, 8
  x = rng.normal(size=(b, d))
  y = rng.integers(0, c, size=b)
  g = rng.normal(size=(c, d))
  got = jax.jit(lambda g, x, w: fedorgp.orthogonality_loss(
      g, x, jnp.asarray(y), w, lam_s=1.0, gamma=10.0, adaptive=adaptive))
  want = reference_or_loss(x, y, g, 1.0, 10.0, adaptive)
  assert float(got(g.astype(np.float32), x.astype(np.float32), np.ones(b, np.float32))) == (
      pytest.approx(want, rel=1e-5))
  # Padding rows: the same loss as the valid rows alone.
  xp, wp = np.concatenate([x, rng.normal(size=(2, d))]), np.r_[np.ones(b), 0, 0]
  yp = np.r_[y, 0, 1]
  padded = jax.jit(lambda g, x, y, w: fedorgp.orthogonality_loss(
      g, x, y, w, lam_s=1.0, gamma=10.0, adaptive=adaptive))(
          g.astype(np.float32), xp.astype(np.float32), yp, wp.astype(np.float32))
  assert float(padded) == pytest.approx(want, rel=1e-5)
  # The gradient in G of the whole expression (the adaptive weights are not detached).
  with jax.enable_x64(True):
    f = lambda g: fedorgp.orthogonality_loss(g, jnp.asarray(x), jnp.asarray(y), jnp.ones(b),
                                             lam_s=1.0, gamma=10.0, adaptive=adaptive)
    grad = np.asarray(jax.jit(jax.grad(f))(jnp.asarray(g)))
    v, h = rng.normal(size=g.shape), 1e-6
    numeric = (reference_or_loss(x, y, g + h * v, 1.0, 10.0, adaptive)
               - reference_or_loss(x, y, g - h * v, 1.0, 10.0, adaptive)) / (2 * h)
    assert (grad * v).sum() == pytest.approx(numeric, rel=1e-6)


def plain_protos(p):
  """T(every class), layer by layer."""
  h = jnp.maximum(p['embedding']['embedding'] @ p['fc1']['kernel'] + p['fc1']['bias'], 0.0)
  return h @ p['fc2']['kernel'] + p['fc2']['bias']


def plain_or_loss(p, x, y, adaptive):
  """L_OR (lam_s = 1, gamma = 10) of a batch written out as serverorth.py's, in jnp."""
  g = plain_protos(p)
  xn = x / jnp.maximum(jnp.linalg.norm(x, axis=1, keepdims=True), 1e-12)
  gn = g / jnp.maximum(jnp.linalg.norm(g, axis=1, keepdims=True), 1e-12)
  sim_intra = jnp.sum(xn * gn[y], 1)
  sim_all = jnp.abs(xn @ gn.T)
  mask = 1.0 - jax.nn.one_hot(y, g.shape[0])
  if adaptive:
    other = (sim_all * mask).sum(1) / mask.sum(1)
    intra = jnp.sum((1 - sim_intra) * (1 + jax.nn.sigmoid((other - 0.3) / 0.5))) / len(y)
    inter = jnp.sum(sim_all * (1 + jax.nn.sigmoid((sim_all - 0.3) / 0.5)) * mask) / mask.sum()
  else:
    intra, inter = jnp.mean(1 - sim_intra), jnp.sum(sim_all * mask) / mask.sum()
  return intra + 10.0 * inter


@pytest.mark.parametrize('adaptive', (False, True))
def test_server_epoch_equals_plain_loop(adaptive):
  """One epoch (the default) of SGD on T over the round's pairs in the order of the round's key
  (argsort(where(valid, uniform(fold_in(key, 0)), inf))), batches of 3, the last partial;
  P^ = T(every class); a round without pairs leaves T as it was."""
  n, batch, lr = 5, 3, 0.05
  method = make_method(n, server_batch=batch, server_lr=lr, adaptive_weights=adaptive)
  rng = np.random.default_rng(3)
  seen = rng.random((n, C)) < 0.6
  seen[0] = [1, 1, 1, 0]
  protos = np.where(seen[:, :, None], rng.normal(size=(n, C, D)), 0).astype(np.float32)
  n_kc = np.where(seen, rng.integers(1, 20, size=seen.shape), 0).astype(np.float32)
  participants = np.array([1, 0, 1, 1, 0], bool)
  server = jax.jit(method.init_server)(jax.random.PRNGKey(4), jnp.asarray(seen)).replace(
      uploads=jnp.asarray(protos), uploads_n=jnp.asarray(n_kc))
  key = jax.random.PRNGKey(5)
  aggregate = jax.jit(method.server_aggregate)
  agg = aggregate(server, jnp.asarray(participants), 1, key)

  flat = (seen & participants[:, None]).reshape(-1)
  values, labels = protos.reshape(n * C, D), np.tile(np.arange(C), n)
  u = np.asarray(jax.random.uniform(jax.random.fold_in(key, 0), (n * C,)))
  order = np.argsort(np.where(flat, u, np.inf), kind='stable')[:flat.sum()]
  step = jax.jit(jax.value_and_grad(lambda p, x, y: plain_or_loss(p, x, y, adaptive)))
  p, losses = server.net, []
  for start in range(0, len(order), batch):
    j = order[start:start + batch]
    loss, grads = step(p, values[j], labels[j])
    p = jax.tree.map(lambda a, g: a - lr * g, p, grads)
    losses.append(float(loss))
  assert flat.sum() % batch and len(losses) == -(-flat.sum() // batch)
  want = jax.jit(plain_protos)(p)
  np.testing.assert_allclose(np.asarray(agg.server.protos), np.asarray(want), rtol=1e-4,
                             atol=1e-6)
  assert np.asarray(agg.server.avail).all()
  assert float(agg.metrics['steps']) == len(losses)
  assert float(agg.metrics['loss']) == pytest.approx(np.mean(losses), rel=1e-5)
  assert float(agg.metrics['last_loss']) == pytest.approx(losses[-1], rel=1e-5)
  per_step = 3 * (4 * C * D * D + 2 * batch * C * D) + 2 * method.tgp_size
  assert float(agg.flops) == pytest.approx(per_step * len(losses), rel=1e-6)
  none = aggregate(server, jnp.zeros(n, bool), 1, key)
  assert float(none.metrics['steps']) == 0 and not np.asarray(none.server.avail).any()
  for a, b in zip(jax.tree.leaves(none.server.net), jax.tree.leaves(server.net)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def reference_filter(feats, alpha=0.5):
  """clientorth.py's filter_outliers_multi_metric on one class's features [n, d], in numpy:
  the kept features."""
  n = len(feats)
  if n <= 2:
    return feats
  center = feats.mean(0)
  dists = np.linalg.norm(feats - center, axis=1)
  cos = unit(feats) @ unit(center)
  dist_cv = max(dists.std(ddof=1), 1e-8) / max(dists.mean(), 1e-8)
  cos_cv = max(cos.std(ddof=1), 1e-8) / max(abs(cos.mean()), 1e-8)
  adjust = np.clip(1.0 - 0.3 * np.tanh(0.5 * (dist_cv / cos_cv - 1.0)), 0.4, 1.6)
  a = np.clip(alpha * adjust, 0.1, 0.9)
  scores = (a * (1 - (dists - dists.min()) / (dists.max() - dists.min() + 1e-8))
            + (1 - a) * (cos - cos.min()) / (cos.max() - cos.min() + 1e-8))
  q1, q3 = np.quantile(scores, 0.25), np.quantile(scores, 0.75)  # linear, as torch.quantile
  keep = (scores >= q1 - 1.5 * (q3 - q1)) & (scores <= q3 + 1.5 * (q3 - q1))
  if keep.sum() < n // 2:
    keep = np.zeros(n, bool)
    keep[np.argsort(-scores)[:n // 2]] = True
  return feats[keep]


def test_outlier_filter_equals_reference():
  """Classes of 1, 2 (passed through), 3, 9 and 40 samples in a scattered row of width 64
  (zero rows outside the pass), with planted outliers: the kept samples' mean per class."""
  rng = np.random.default_rng(6)
  c, d, width = 6, 16, 64
  sizes = {0: 40, 1: 1, 2: 2, 3: 3, 5: 9}  # class 4 absent
  member = np.zeros(width, np.int32)
  rep = np.zeros((width, d), np.float32)
  slots = rng.permutation(width)
  used = 0
  for cls, size in sizes.items():
    rows = slots[used:used + size]
    used += size
    feats = np.abs(rng.normal(size=(size, d)) + 3 * rng.normal(size=d))
    feats[:max(1, size // 10)] *= 6.0 if size > 3 else 1.0  # outliers
    member[rows], rep[rows] = cls + 1, feats
  means, n = jax.jit(fedorgp.filtered_means, static_argnums=(2, 3))(rep, member, c, 0.5)
  dropped = 0
  for cls in range(c):
    feats = rep[member == cls + 1].astype(np.float64)
    assert float(n[cls]) == len(feats)
    if not len(feats):
      assert not np.asarray(means[cls]).any()
      continue
    kept = reference_filter(feats)
    dropped += len(feats) - len(kept)
    assert len(kept) >= len(feats) // 2
    np.testing.assert_allclose(np.asarray(means[cls]), kept.mean(0), rtol=1e-5)
  assert dropped > 0  # the planted outliers went


# The simulator of the rounds below: the repository HEAD's variant, batches of 4 on the server.
SIM_FIELDS = {'orgp.variant': 'repo_head', 'orgp.server_batch': 4}


@pytest.fixture(scope='module')
def two_rounds(small_ds):
  """FedORGP's simulator (SIM_FIELDS), its state before each of two rounds and after the last
  (one seed's), and the rounds' infos."""
  sim = make_small_sim(small_ds, 'fedorgp', **SIM_FIELDS)
  state = sim.init_state()
  states, infos = [snapshots.seed_state(sim.store, state)], []
  for _ in range(2):
    state, (info,) = sim.run_round(state)
    states.append(snapshots.seed_state(sim.store, state))
    infos.append(info)
  return sim, states, infos


@pytest.mark.slow  # a simulator compiled and run
def test_rounds_upload_filtered_prototypes_and_keep_the_net(two_rounds, small_ds):
  """Each participant uploads its filtered class means of the forward pass after training
  (the trained model, unaugmented); the server trains the T it kept, with the round's key, and
  sends P^ = T(every class) from round 1 on."""
  sim, states, infos = two_rounds
  method, seen = sim.method, sim.seen[0]
  model = sim.groups[0].eval_model
  forward = jax.jit(lambda p, x: model.apply({'params': p}, x)[1])
  mean, std = np.asarray(sim.train_cfg.mean), np.asarray(sim.train_cfg.std)
  aggregate = jax.jit(method.server_aggregate)
  for t, info in enumerate(infos):
    server = states[t + 1].server
    for k in info.cohort:
      idx = np.asarray(sim.data.train_idx[0, k])[:int(sim.train_n[0, k])]
      x = (small_ds.images[idx] / 255.0 - mean) / std
      params = jax.tree.map(lambda a: np.asarray(a[sim.slot_of[k]]),
                            states[t + 1].population.params[sim.group_of[k]])
      rep = np.asarray(forward(params, x.astype(np.float32)), np.float64)
      y = small_ds.labels[idx]
      for c in range(sim.num_classes):
        want = reference_filter(rep[y == c]).mean(0) if seen[k, c] else np.zeros(D)
        np.testing.assert_allclose(np.asarray(server.uploads[k, c]), want, rtol=1e-4,
                                   atol=1e-5)
    np.testing.assert_array_equal(info.client_up_floats, D * seen[info.cohort].sum(1))
    np.testing.assert_array_equal(info.client_down_floats, t * D * sim.num_classes)
    # T: the previous round's, trained on this round's uploads with the round's key.
    part = np.zeros(sim.num_clients, bool)
    part[info.cohort] = True
    key = jax.random.fold_in(jax.random.fold_in(sim.root_keys[0], Stream.AGGREGATE), t)
    again = aggregate(states[t].server.replace(uploads=server.uploads,
                                               uploads_n=server.uploads_n), part, t, key)
    for a, b in zip(jax.tree.leaves(again.server.net), jax.tree.leaves(server.net)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert np.asarray(server.avail).all()
    np.testing.assert_allclose(np.asarray(server.protos),
                               np.asarray(prototypes.tgp_protos(server.net, sim.num_classes)),
                               rtol=1e-5, atol=1e-6)
    assert np.isfinite(info.server_metrics['loss']) and info.server_flops > 0
  assert models.param_count(states[0].server.net) == method.tgp_size
