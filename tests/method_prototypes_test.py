"""methods/prototypes.py by hand: the prototype term of the loss, the nearest prototype, the
uploaded prototypes and the server's table of pairs."""
import jax.numpy as jnp
import numpy as np

from fedssa_jax.methods import base, losses, prototypes


def test_the_prototype_term_by_hand():
  logits = jnp.zeros((3, 2))
  rep = jnp.array([[1., 1.], [0., 2.], [5., 5.]])
  y = jnp.array([0, 1, 1])
  valid = jnp.array([True, True, False])
  protos = jnp.array([[0., 1.], [0., 0.]])
  ce, _ = losses.ce_and_correct(logits, y, valid)
  # Class 0 has a prototype: ||(1, 1) - (0, 1)||^2 = 1; class 1 has none (avail False).
  loss, _ = prototypes.proto_loss(logits, rep, y, valid, protos, jnp.array([True, False]), 0.5)
  np.testing.assert_allclose(loss, ce + 0.5 * 1 / (2 * 2), rtol=1e-6)
  loss, _ = prototypes.proto_loss(logits, rep, y, valid, protos, jnp.array([True, True]), 0.5)
  np.testing.assert_allclose(loss, ce + 0.5 * (1 + 4) / (2 * 2), rtol=1e-6)


def test_the_nearest_prototype_is_among_the_available_ones():
  protos = jnp.array([[0., 0.], [10., 10.], [1., 1.]])
  rep = jnp.array([[0.9, 0.9], [9., 9.]])
  np.testing.assert_array_equal(
      prototypes.nearest_prototype(rep, protos, jnp.array([True, True, True])), [2, 1])
  np.testing.assert_array_equal(
      prototypes.nearest_prototype(rep, protos, jnp.array([True, False, False])), [0, 0])
  hits = prototypes.prototype_hits(rep, jnp.array([2, 1]), jnp.array([True, True]), protos,
                                   jnp.array([True, True, True]))
  assert int(hits) == 2
  assert int(prototypes.prototype_hits(rep, jnp.array([2, 1]), jnp.array([True, True]), protos,
                                       jnp.zeros(3, bool))) == 0  # no prototype yet


def test_uploaded_prototypes_are_class_means_counted_once_per_sample():
  # Training passes over E = 2 epochs: every sample seen twice, its class count halved back.
  sums = base.ClassSums(count=jnp.array([4., 0., 2.]), sum=jnp.array([[8., 4.], [0., 0.],
                                                                      [2., 6.]]))
  seen = jnp.array([True, False, True])
  acc = base.Accumulated(loss=sums)
  protos, n, held = prototypes.uploaded_prototypes(acc, seen, 'train_pass', local_epochs=2)
  np.testing.assert_allclose(protos, [[2., 1.], [0., 0.], [1., 3.]])
  np.testing.assert_allclose(n, [2., 0., 1.])
  np.testing.assert_array_equal(held, [True, False, True])
  # A forward pass visits each sample once.
  _, n, _ = prototypes.uploaded_prototypes(base.Accumulated(forward_pass=sums), seen,
                                           'post_pass', local_epochs=2)
  np.testing.assert_allclose(n, [4., 0., 2.])


def test_round_pairs_take_the_participants_held_classes():
  uploads = jnp.arange(2 * 2 * 1, dtype=jnp.float32).reshape(2, 2, 1)
  uploads_n = jnp.array([[3., 0.], [1., 2.]])
  values, labels, weights = prototypes.round_pairs(uploads, uploads_n, jnp.array([True, False]),
                                                   'samples')
  np.testing.assert_array_equal(values[:, 0], [0., 1., 2., 3.])
  np.testing.assert_array_equal(labels, [0, 1, 0, 1])
  np.testing.assert_array_equal(weights, [3., 0., 0., 0.])  # client 1 is not a participant
  _, _, weights = prototypes.round_pairs(uploads, uploads_n, jnp.array([True, True]), 'uniform')
  np.testing.assert_array_equal(weights, [1., 0., 1., 1.])
