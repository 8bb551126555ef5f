"""methods/losses.py by hand: the masked mean cross-entropy and the count of right predictions."""
import jax.numpy as jnp
import numpy as np

from fedssa_jax.methods import losses


def test_cross_entropy_over_the_valid_samples_by_hand():
  logits = jnp.array([[2., 0.], [0., 1.], [5., -5.]])
  y = jnp.array([0, 0, 1])
  valid = jnp.array([True, True, False])  # the third is padding
  loss, correct = losses.ce_and_correct(logits, y, valid)
  ce = lambda z, k: np.log(np.exp(z).sum()) - z[k]
  np.testing.assert_allclose(loss, (ce(np.array([2., 0.]), 0) + ce(np.array([0., 1.]), 0)) / 2,
                             rtol=1e-6)
  assert int(correct) == 1  # the padding row, wrong anyway, never counts
  loss, correct = losses.ce_and_correct(logits, y, jnp.zeros(3, bool))
  assert float(loss) == 0 and int(correct) == 0  # no valid sample: 0, not NaN


def test_the_plain_objective_reads_the_model_s_logits():
  apply_fn = lambda variables, x: (x @ variables['params']['w'], None)
  params = {'w': jnp.eye(2)}
  x = jnp.array([[2., 0.], [0., 1.]])
  got = losses.cross_entropy_loss(apply_fn, params, x, jnp.array([0, 1]), jnp.array([1, 1], bool))
  want = losses.ce_and_correct(x, jnp.array([0, 1]), jnp.array([1, 1], bool))
  np.testing.assert_allclose(got[0], want[0])
  assert int(got[1]) == 2
