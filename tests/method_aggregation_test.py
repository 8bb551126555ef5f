"""methods/aggregation.py by hand: masked sums and means, the Inbox, per-client tables and the
server's training on (value, label) pairs."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedssa_jax.methods import aggregation


def test_masked_sum_and_mean_by_hand():
  # 2 clients, 2 classes, 1-d values: client 0 holds class 0 (3) and 1 (5); client 1 class 0 (7).
  uploads = jnp.array([[[3.], [5.]], [[7.], [11.]]])
  mask = jnp.array([[True, True], [True, False]])
  total, weight = aggregation.masked_sum(uploads, mask)
  np.testing.assert_allclose(total, [[10.], [5.]])
  np.testing.assert_allclose(weight, [2., 1.])
  mean, has = aggregation.masked_mean(uploads, mask, weights=jnp.array([1., 3.]))
  np.testing.assert_allclose(mean, [[(3 + 21) / 4], [5.]])  # (1*3 + 3*7) / 4
  np.testing.assert_array_equal(has, [True, True])
  mean, has = aggregation.masked_mean(uploads, jnp.zeros((2, 2), bool))
  np.testing.assert_array_equal(mean, 0.0)  # nobody: zeros, and `has` says so
  np.testing.assert_array_equal(has, [False, False])


def test_an_inbox_sums_whole_uploads_of_active_clients_only():
  like = {'w': jnp.zeros((2,))}
  box = aggregation.Inbox.empty(like)
  # Two chunks: the first padded with a dummy whose upload must count for nothing.
  box = box.add({'w': jnp.array([[1., 2.], [100., 100.]])}, jnp.array([True, False]))
  box = box.add({'w': jnp.array([[3., 6.]])}, jnp.array([True]))
  mean, any_ = box.mean()
  np.testing.assert_allclose(mean['w'], [2., 4.])
  assert bool(any_) and int(box.weight) == 2 and box.weight.dtype == jnp.int32
  weighted = aggregation.Inbox.empty(like, weighted=True)
  weighted = weighted.add({'w': jnp.array([[1., 2.], [3., 6.], [9., 9.]])},
                          jnp.array([True, True, False]), jnp.array([1., 3., 5.]))
  mean, _ = weighted.mean()
  np.testing.assert_allclose(mean['w'], [2.5, 5.])  # (1*1 + 3*3) / 4, (1*2 + 3*6) / 4
  cleared = weighted.cleared()
  assert cleared.weighted and float(cleared.weight) == 0
  _, any_ = cleared.mean()
  assert not bool(any_)


def test_store_rows_writes_active_clients_and_drops_dummies():
  table = jnp.zeros((4, 2))
  out = aggregation.store_rows(table, jnp.array([2, 0, 3]), jnp.array([[1., 1.], [2., 2.],
                                                                        [9., 9.]]),
                               jnp.array([True, True, False]))
  np.testing.assert_array_equal(out, [[2., 2.], [0., 0.], [1., 1.], [0., 0.]])


def test_training_on_pairs_is_plain_sgd_over_the_valid_pairs():
  """A 1-d linear model w, loss the weighted mean of (w x - y)^2 over a batch: with the batch
  larger than the 3 valid pairs, each epoch is one step on all of them, whatever the order."""
  values = jnp.array([[1.], [2.], [0.], [3.]])
  labels = jnp.array([2, 4, 0, 6])
  weights = jnp.array([1., 1., 0., 2.])   # the third pair is padding

  def loss_fn(w, x, y, wt):
    return jnp.sum(wt * (w * x[:, 0] - y) ** 2) / jnp.maximum(wt.sum(), 1e-9)

  lr, w = 0.01, 0.5
  got, loss_sum, steps, last = aggregation.train_on_pairs(
      jnp.float32(w), loss_fn, optax.sgd(lr), values, labels, weights, jax.random.PRNGKey(0),
      epochs=2, batch_size=8)
  x, y, wt = np.array([1., 2., 3.]), np.array([2., 4., 6.]), np.array([1., 1., 2.])
  losses = []
  for _ in range(2):
    losses.append(np.sum(wt * (w * x - y) ** 2) / wt.sum())
    w -= lr * np.sum(wt * 2 * (w * x - y) * x) / wt.sum()
  np.testing.assert_allclose(got, w, rtol=1e-6)
  np.testing.assert_allclose(loss_sum, sum(losses), rtol=1e-6)
  np.testing.assert_allclose(last, losses[-1], rtol=1e-6)  # HtFLlib prints the last step's
  assert int(steps) == 2
  # Batches of 2: ceil(3 / 2) = 2 steps an epoch.
  assert int(aggregation.train_on_pairs(jnp.float32(w), loss_fn, optax.sgd(lr), values, labels,
                                        weights, jax.random.PRNGKey(0), epochs=3,
                                        batch_size=2)[2]) == 6
