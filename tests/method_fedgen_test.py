"""FedGen (docs/algorithm.md §6): the generator's forward, its loss's gradient and the server's
fresh Adam against a plain numpy transcription of HtFLlib's code (servergen.py's Generator and
train_generator) on small arrays, the label draws against the prior, the client's loss and where
its gradient goes, the exchange and the options; then rounds through the engine: the label prior
from the clients' class counts, the n_k-weighted header, the generator kept from round to round,
and a run resumed from a checkpoint after round 1 equal to the run straight through."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, models
from fedssa_jax.engine import snapshots
from fedssa_jax.methods import base, fedgen
from fedssa_jax.run import checkpoint
from fedssa_jax.streams import Stream

from conftest import client_view, log_softmax, make_small_sim

C, D = 4, config_lib.base_config('cifar10').model.feature_dim  # d of the methods' configs
ROW = D + 1  # a header row: d weights and a bias


# The server's training at the defaults (100 steps, lr 0.005, batch 10), compiled once.
train_default = jax.jit(functools.partial(fedgen.train_generator, steps=100, lr=0.005, batch=10))


def make_method(n=5, c=C, batch_size=None, **fields):
  cfg = config_lib.base_config('cifar10')
  cfg.fedgen.update(fields)
  if batch_size is not None:
    cfg.batch_size = batch_size
  return fedgen.FedGen(cfg, n, c)


def random_generator(rng, nd, c, hd, d) -> fedgen.Generator:
  """A generator with every parameter random (gamma and beta too), float32."""
  f = lambda *s: jnp.asarray(rng.normal(size=s) * 0.5, jnp.float32)
  return fedgen.Generator(w1=f(nd + c, hd), b1=f(hd), gamma=1 + f(hd), beta=f(hd), w2=f(hd, d),
                          b2=f(d))


def assert_generators_close(got: fedgen.Generator, want: fedgen.Generator, steps=100, lr=0.005):
  """Equal to float rounding (over 100 Adam steps), but for b1: BatchNorm subtracts the batch mean, so b1's gradient
  is 0 up to rounding and Adam's normalised step on it is the rounding's sign (in PyTorch too);
  two programs may round differently, so b1 is held only to Adam's bound, lr a step."""
  for k in ('w1', 'gamma', 'beta', 'w2', 'b2'):
    np.testing.assert_allclose(np.asarray(getattr(got, k)), np.asarray(getattr(want, k)),
                               rtol=1e-3, atol=1e-4, err_msg=k)
  assert np.abs(np.asarray(got.b1) - np.asarray(want.b1)).max() <= 2 * steps * lr * (1 + 1e-5)


def np_tree(g):
  return {k: np.asarray(getattr(g, k), np.float64) for k in ('w1', 'b1', 'gamma', 'beta', 'w2',
                                                             'b2')}


# --- A plain numpy transcription of HtFLlib's Generator and its training step -----------------
def np_forward(g, noise, labels, c):
  """Generator.forward in training mode: cat, Linear, BatchNorm1d (batch mean, biased variance,
  eps 1e-5, then gamma and beta), ReLU, Linear. Returns z and what the backward needs."""
  x = np.concatenate([noise, np.eye(c)[labels]], axis=1)
  h = x @ g['w1'] + g['b1']
  inv = 1.0 / np.sqrt(h.var(axis=0) + 1e-5)
  xhat = (h - h.mean(axis=0)) * inv
  hb = xhat * g['gamma'] + g['beta']
  a = np.maximum(hb, 0)
  return a @ g['w2'] + g['b2'], (x, inv, xhat, hb, a)


def np_loss_and_grad(g, head, noise, labels):
  """CE(H(G(eps, y)), y) averaged over the batch, and its gradient with respect to G (by hand)."""
  b, c = len(labels), head.shape[0]
  z, (x, inv, xhat, hb, a) = np_forward(g, noise, labels, c)
  logits = z @ head[:, :-1].T + head[:, -1]
  lsm = np.stack([log_softmax(r) for r in logits])
  loss = -lsm[np.arange(b), labels].mean()
  dlogits = (np.exp(lsm) - np.eye(c)[labels]) / b
  dz = dlogits @ head[:, :-1]
  da = dz @ g['w2'].T
  dhb = da * (hb > 0)
  dxhat = dhb * g['gamma']
  dh = inv / b * (b * dxhat - dxhat.sum(0) - xhat * (dxhat * xhat).sum(0))
  grad = {'w1': x.T @ dh, 'b1': dh.sum(0), 'gamma': (dhb * xhat).sum(0), 'beta': dhb.sum(0),
          'w2': a.T @ dz, 'b2': dz.sum(0)}
  return loss, grad


def np_adam(g, head, draws, lr):
  """torch.optim.Adam (betas 0.9, 0.999, eps 1e-8, fresh) over the given draws."""
  m = {k: np.zeros_like(v) for k, v in g.items()}
  v = {k: np.zeros_like(v) for k, v in g.items()}
  g, losses = dict(g), []
  for t, (noise, labels) in enumerate(draws, start=1):
    loss, grad = np_loss_and_grad(g, head, noise, labels)
    losses.append(loss)
    for k in g:
      m[k] = 0.9 * m[k] + 0.1 * grad[k]
      v[k] = 0.999 * v[k] + 0.001 * grad[k] ** 2
      mhat, vhat = m[k] / (1 - 0.9 ** t), v[k] / (1 - 0.999 ** t)
      g[k] = g[k] - lr * mhat / (np.sqrt(vhat) + 1e-8)
  return g, losses


def test_generator_forward_equals_numpy():
  b, nd, c, hd, d = 4, 3, 3, 5, 6
  rng = np.random.default_rng(0)
  g = random_generator(rng, nd, c, hd, d)
  noise = rng.random((b, nd)).astype(np.float32)
  labels = np.array([0, 2, 2, 1], np.int32)
  got = jax.jit(fedgen.generate)(g, noise, labels)
  want, _ = np_forward(np_tree(g), noise.astype(np.float64), labels, c)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  # The initial G: PyTorch's defaults, U(+-1/sqrt(fan_in)), gamma 1 and beta 0.
  g0 = fedgen.init_generator(jax.random.PRNGKey(0), nd, c, hd, d)
  assert np.abs(np.asarray(g0.w1)).max() <= (nd + c) ** -0.5
  assert np.abs(np.asarray(g0.w2)).max() <= hd ** -0.5
  np.testing.assert_array_equal(g0.gamma, 1.0)
  np.testing.assert_array_equal(g0.beta, 0.0)
  assert fedgen.generator_size(nd, c, hd, d) == sum(a.size for a in jax.tree.leaves(g0))
  assert fedgen.generator_size(32, 10, 512, 500) == 279_540  # HTFL.md §4.2
  assert fedgen.generator_size(32, 100, 512, 500) == 325_620


def test_server_gradient_and_fresh_adam_equal_numpy():
  """The gradient of L_G with respect to G against the hand-written numpy backward, itself
  checked by central differences in float64; then `train_generator`'s fresh Adam over three
  steps against torch's Adam in numpy, with the labels and noises drawn from the same keys."""
  b, nd, c, hd, d = 6, 3, 3, 5, 6
  rng = np.random.default_rng(1)
  g = random_generator(rng, nd, c, hd, d)
  head = rng.normal(size=(c, d + 1))
  noise, labels = rng.random((b, nd)), np.array([0, 1, 2, 2, 1, 0])
  gn = np_tree(g)
  _, grad = np_loss_and_grad(gn, head, noise, labels)
  for k in gn:  # central differences on a few coordinates of each parameter
    for i in rng.choice(gn[k].size, 3, replace=False):
      step = np.zeros(gn[k].size)
      step[i] = 1e-6
      plus = np_loss_and_grad({**gn, k: gn[k] + step.reshape(gn[k].shape)}, head, noise,
                              labels)[0]
      minus = np_loss_and_grad({**gn, k: gn[k] - step.reshape(gn[k].shape)}, head, noise,
                               labels)[0]
      assert (plus - minus) / 2e-6 == pytest.approx(grad[k].reshape(-1)[i], rel=1e-4, abs=1e-8)
  got = jax.jit(jax.grad(fedgen.generator_loss))(
      g, jnp.asarray(head, jnp.float32), jnp.asarray(noise, jnp.float32), jnp.asarray(labels))
  for k in gn:
    np.testing.assert_allclose(np.asarray(getattr(got, k)), grad[k], rtol=2e-3, atol=1e-5)

  prior = np.array([0.5, 0.2, 0.3], np.float32)
  key, steps, lr = jax.random.PRNGKey(7), 3, 0.05
  trained, loss_sum, last = jax.jit(lambda g, h, p, k: fedgen.train_generator(
      g, h, p, k, steps=steps, lr=lr, batch=b))(g, jnp.asarray(head, jnp.float32), prior, key)
  draws = [tuple(np.asarray(a, np.float64) for a in
                 fedgen.draw(jax.random.fold_in(key, s), prior, b, nd)) for s in range(steps)]
  want, losses = np_adam(gn, head, [(n, l.astype(int)) for n, l in draws], lr)
  for k in gn:
    if k == 'b1':
      # BatchNorm subtracts the batch mean, so b1's gradient is 0 up to rounding, and Adam's
      # normalised step on it is the rounding's sign, in either code: only its bound, lr a step.
      assert np.abs(np.asarray(trained.b1) - gn['b1']).max() <= lr * steps * (1 + 1e-5)
      assert np.abs(grad['b1']).max() < 1e-12
      continue
    np.testing.assert_allclose(np.asarray(getattr(trained, k)), want[k], rtol=1e-4, atol=1e-5)
    assert np.abs(want[k] - gn[k]).max() > 1e-3  # every other parameter moved
  assert float(loss_sum) == pytest.approx(sum(losses), rel=1e-4)
  assert float(last) == pytest.approx(losses[-1], rel=1e-4)


def test_label_draws_follow_the_prior():
  prior = np.array([0.1, 0.0, 0.6, 0.3], np.float32)
  n = 100_000
  noise, labels = jax.jit(lambda k: fedgen.draw(k, prior, n, 3))(jax.random.PRNGKey(2))
  freq = np.bincount(np.asarray(labels), minlength=C) / n
  sigma = np.sqrt(prior * (1 - prior) / n)
  assert np.all(np.abs(freq - prior) <= 3 * sigma + 1e-12), (freq, prior)
  noise = np.asarray(noise)
  assert noise.shape == (n, 3) and noise.min() >= 0 and noise.max() < 1  # U[0, 1)
  assert abs(noise.mean() - 0.5) < 0.01


def stand_in(rng, d=D, c=C):
  """A model stand-in with a header: r = relu(x W), logits = fc3(r)."""
  params = {'fc2': {'kernel': jnp.asarray(rng.normal(size=(12, d)) * 0.1, jnp.float32)},
            'fc3': {'kernel': jnp.asarray(rng.normal(size=(d, c)) * 0.1, jnp.float32),
                    'bias': jnp.asarray(rng.normal(size=c) * 0.1, jnp.float32)}}

  def apply_fn(variables, x):
    p = variables['params']
    rep = jax.nn.relu(x @ p['fc2']['kernel'])
    return models.apply_header(p, rep), rep
  return params, apply_fn


def test_client_loss_and_where_its_gradient_goes():
  """L = mean CE on the real batch + lambda mean CE(h(sg G(eps, yhat)), yhat) over B generated
  samples drawn from the step's key (B the local batch, whatever the valid samples): against
  numpy; the generated term's gradient reaches only the header (F_k's gradient is plain CE's),
  and G, in the context, is no trainable parameter."""
  b = 6
  method = make_method(batch_size=b, noise_dim=3, hidden_dim=7)
  rng = np.random.default_rng(3)
  params, apply_fn = stand_in(rng)
  g = random_generator(rng, 3, C, 7, D)
  prior = np.array([0.4, 0.1, 0.2, 0.3], np.float32)
  x = rng.normal(size=(b, 12)).astype(np.float32)
  y = np.array([0, 1, 3, 3, 2, 0], np.int32)
  valid = np.array([1, 1, 1, 1, 0, 0], bool)
  key = jax.random.PRNGKey(4)
  ctx = fedgen.FedGenContext(g, prior, jnp.float32(0.7))
  grad_fn = jax.jit(jax.value_and_grad(
      lambda p, ctx: method.loss(apply_fn, {'model': p}, ctx, (x,), y, valid, key=key)[0],
      argnums=(0, 1)))
  loss, (grads, g_grad) = grad_fn(params, ctx)
  # numpy: the real CE and the generated CE, with the draws from the same key.
  noise, labels = (np.asarray(a) for a in fedgen.draw(key, prior, b, 3))
  z, _ = np_forward(np_tree(g), noise.astype(np.float64), labels, C)
  head = np.asarray(models.header_rows(params), np.float64)
  gen_logits = z @ head[:, :-1].T + head[:, -1]
  gen = -np.mean([log_softmax(gen_logits[j])[labels[j]] for j in range(b)])
  rep = np.maximum(x.astype(np.float64) @ np.asarray(params['fc2']['kernel'], np.float64), 0)
  logits = rep @ head[:, :-1].T + head[:, -1]
  real = -np.mean([log_softmax(logits[j])[y[j]] for j in range(4)])
  assert float(loss) == pytest.approx(real + 0.7 * gen, rel=1e-5)
  # The gradient: F_k's is plain CE's; the header's is plain CE's plus the generated term's.
  _, (plain, _) = grad_fn(params, ctx.replace(weight=jnp.float32(0.0)))
  np.testing.assert_array_equal(grads['fc2']['kernel'], plain['fc2']['kernel'])
  p_gen = np.exp(np.stack([log_softmax(r) for r in gen_logits])) - np.eye(C)[labels]
  want_w = np.asarray(plain['fc3']['kernel']) + 0.7 * z.T @ p_gen / b
  np.testing.assert_allclose(np.asarray(grads['fc3']['kernel']), want_w, rtol=1e-4, atol=1e-6)
  # The context's G gets no gradient from the loss (sg), and G is not in the trainable tree.
  assert all(float(jnp.abs(a).max()) == 0 for a in jax.tree.leaves(g_grad.generator))


def test_exchange_prior_weight_and_evaluated_header():
  """init_server's prior from the clients' class counts; the download (H_g over the header, G,
  p(y), the term's weight: 0 in round 0, lambda from round 1; from round 0 with
  frozen_generator), its floats, the n_k-weighted header mean and the evaluated header."""
  n = 3
  method = make_method(n)
  rng = np.random.default_rng(5)
  counts = rng.integers(0, 9, size=(n, C)).astype(np.float32)
  server = jax.jit(lambda k, s, c: method.init_server(k, s, class_counts=c))(
      jax.random.PRNGKey(6), jnp.asarray(counts > 0), jnp.asarray(counts))
  np.testing.assert_allclose(np.asarray(server.prior), counts.sum(0) / counts.sum(), rtol=1e-6)
  params, _ = stand_in(rng)
  pg = fedgen.generator_size(32, C, 512, D)
  for frozen, weights in ((False, (0.0, 1.0, 1.0)), (True, (1.0, 1.0, 1.0))):
    download = jax.jit(make_method(n, frozen_generator=frozen).download)
    for t, w in enumerate(weights):
      down = download(params, base.NoState(), server, client_view(0, counts[0] > 0, 5, t))
      assert float(down.ctx.weight) == w
  np.testing.assert_array_equal(np.asarray(models.header_rows(down.params)),
                                np.asarray(server.global_header))
  assert int(down.floats) == ROW * C + pg
  # Upload: the header and n_k; the server's H_g is the n_k-weighted mean.
  heads = rng.normal(size=(n, C, ROW)).astype(np.float32)
  n_k = np.array([5, 12, 3], np.int32)
  upload = jax.jit(method.upload)
  ups = [upload({'model': models.with_header_rows(params, jnp.asarray(h))},
                                base.Accumulated(), down.ctx, base.NoState(),
                                client_view(k, counts[k] > 0, n_k[k], 1))
         for k, h in enumerate(heads)]
  assert all(int(u.floats) == ROW * C for u in ups)
  payloads = jax.tree.map(lambda *a: jnp.stack(a), *[u.payload for u in ups])
  active = jnp.array([True, False, True])
  received = method.server_receive(server, jnp.arange(n), payloads, active)
  aggregate = jax.jit(method.server_aggregate)
  agg = aggregate(received, active, 1, jax.random.PRNGKey(8))
  want = (5 * heads[0] + 3 * heads[2]) / 8
  np.testing.assert_allclose(np.asarray(agg.server.global_header), want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(agg.server.inbox.weight, 0.0)  # emptied for the next round
  np.testing.assert_array_equal(
      np.asarray(models.header_rows(method.eval_params(params, agg.server, 0))),
      np.asarray(agg.server.global_header))
  # The server's loss is HtFLlib's CE of the n_k-weighted sum of the uploaded headers' logits.
  z = rng.normal(size=(6, D))
  mixed = (5 * (z @ heads[0][:, :-1].T + heads[0][:, -1])
           + 3 * (z @ heads[2][:, :-1].T + heads[2][:, -1])) / 8
  np.testing.assert_allclose(mixed, z @ want[:, :-1].T + want[:, -1], rtol=1e-4, atol=1e-5)
  # The generator trained (against that header, with the round's key: the rounds below); with
  # frozen_generator G is left as it was.
  assert max(float(jnp.abs(a - b).max()) for a, b in zip(
      jax.tree.leaves(agg.server.generator), jax.tree.leaves(server.generator))) > 1e-3
  assert float(agg.metrics['steps']) == 100 and float(agg.flops) > 0
  frozen = make_method(n, frozen_generator=True)
  agg = jax.jit(frozen.server_aggregate)(received, active, 1, jax.random.PRNGKey(8))
  for a, b in zip(jax.tree.leaves(agg.server.generator), jax.tree.leaves(server.generator)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # A round with no upload keeps H_g and G.
  agg = aggregate(server, jnp.zeros(n, bool), 1, jax.random.PRNGKey(8))
  assert float(agg.metrics['steps']) == float(agg.metrics['loss']) == float(agg.flops) == 0
  for a, b in zip(jax.tree.leaves((agg.server.global_header, agg.server.generator)),
                  jax.tree.leaves((server.global_header, server.generator))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_options():
  for field, value in (('noise_dim', 0), ('hidden_dim', 0), ('server_steps', 0),
                       ('server_batch', 0), ('server_lr', 0.0), ('weight', -1.0),
                       ('weighting', 'counts')):
    with pytest.raises(ValueError, match=f'fedgen.{field}'):
      make_method(**{field: value})
  # Client-level DP on the uploads: the header, around H_g; central mode with a uniform mean.
  cfg = config_lib.base_config('cifar10')
  assert fedgen.FedGen.private_upload == ('value',) and fedgen.FedGen.server_reads_class_counts
  assert fedgen.FedGen.upload_refusal(cfg, 'local') is None
  assert 'fedgen.weighting' in fedgen.FedGen.upload_refusal(cfg, 'central')
  cfg.fedgen.weighting = 'uniform'
  assert fedgen.FedGen.upload_refusal(cfg, 'central') is None


# --- Rounds through the engine ------------------------------------------------------------------
@pytest.fixture(scope='module')
def runs(small_ds, tmp_path_factory):
  """FedGen's simulator, its initial server, two rounds (seed state, info) of it, and round 2
  again from a checkpoint written after round 1 and restored."""
  sim = make_small_sim(small_ds, 'fedgen')
  state = sim.init_state()
  server0 = snapshots.seed_state(sim.store, state).server
  out = []
  for i in range(2):
    state, (info,) = sim.run_round(state)
    out.append((snapshots.seed_state(sim.store, state), info))
    if i == 0:
      saved = snapshots.saved(sim.store, state)  # host copies: the next round donates the state
  ckpts = checkpoint.Checkpointer(str(tmp_path_factory.mktemp('fedgen_ckpt')))
  ckpts.save(saved, {}, {})
  restored = snapshots.stacked(sim.store, [ckpts.restore_latest(template=saved).state])
  ckpts.close()
  resumed, (resumed_info,) = sim.run_round(restored)
  return sim, server0, out, (snapshots.seed_state(sim.store, resumed), resumed_info)


@pytest.mark.slow  # a simulator compiled and run
def test_rounds_prior_header_and_generator_kept(runs, small_ds):
  sim, server0, out, _ = runs
  counts = np.stack([np.bincount(small_ds.labels[np.asarray(sim.data.train_idx[0, k])[
      :int(sim.train_n[0, k])]], minlength=sim.num_classes) for k in range(sim.num_clients)])
  np.testing.assert_allclose(np.asarray(server0.prior), counts.sum(0) / counts.sum(), rtol=1e-6)
  root = jax.random.PRNGKey(sim.seeds[0])
  generator = server0.generator
  pg = fedgen.generator_size(32, sim.num_classes, 512, D)
  for t, (state, info) in enumerate(out):
    server = state.server
    # H_g: the n_k-weighted mean of the participants' trained headers.
    n_k = sim.train_n[0, info.cohort].astype(np.float64)
    heads = [np.asarray(models.header_rows(
        jax.tree.map(lambda a: a[sim.slot_of[k]], state.population.params[sim.group_of[k]])))
             for k in info.cohort]
    want = sum(w * h for w, h in zip(n_k, heads)) / n_k.sum()
    np.testing.assert_allclose(np.asarray(server.global_header), want, rtol=1e-5, atol=1e-6)
    # G: the previous round's G, trained against this H_g with the round's key.
    key = jax.random.fold_in(jax.random.fold_in(root, Stream.AGGREGATE), t)  # the round's
    g_want, _, _ = train_default(generator, server.global_header, server.prior, key)
    assert_generators_close(server.generator, g_want)
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(
        jax.tree.leaves(server.generator), jax.tree.leaves(generator))) > 1e-3  # G moved
    generator = server.generator
    np.testing.assert_array_equal(info.client_up_floats, ROW * sim.num_classes)
    np.testing.assert_array_equal(info.client_down_floats, ROW * sim.num_classes + pg)
    assert np.isfinite(info.server_metrics['loss']) and info.server_flops > 0


@pytest.mark.slow  # the simulator above, resumed
def test_resumed_round_equals_the_run_straight_through(runs):
  _, _, out, (resumed, resumed_info) = runs
  straight, info = out[1]
  for a, b in zip(jax.tree.leaves((straight.server, straight.population.params)),
                  jax.tree.leaves((resumed.server, resumed.population.params))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(info.train_loss, resumed_info.train_loss)
