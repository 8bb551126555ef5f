import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import models
from fedssa_jax.engine import costs

# The paper's CNNs: d = fc2's width, 500 (config_lib's default model.feature_dim).
D = models.CNN_FEATURE_DIM
make_model = functools.partial(models.make_model, feature_dim=D)

# docs/algorithm.md §1: params (S=10), params (S=100), forward MACs per sample (S=10)
SPEC = {
    'cnn1': (2_621_558, 2_666_648, 4_825_800),
    'cnn2': (1_815_142, 1_860_232, 3_385_800),
    'cnn3': (1_320_558, 1_365_648, 3_525_800),
    'cnn4': (1_060_358, 1_105_448, 3_265_800),
    'cnn5': (670_058, 715_148, 2_875_800),
}


@pytest.mark.parametrize('family', models.FAMILY_NAMES)
def test_parameter_counts_and_macs_match_spec(family):
  p10, p100, macs = SPEC[family]
  for s, want in ((10, p10), (100, p100)):
    shapes = jax.eval_shape(lambda: models.init_params(make_model(family, s, 'xla'),
                                                       jax.random.PRNGKey(0)))
    assert models.param_count(shapes) == want
  assert models.forward_macs(family, 10, D) == macs


def test_pytorch_style_init_bounds():
  params = models.init_params(make_model('cnn5', 10, 'xla'), jax.random.PRNGKey(0))
  fan_in = {'conv1': 3 * 25, 'conv2': 16 * 25, 'fc1': 800, 'fc2': 500, 'fc3': 500}
  for layer, fi in fan_in.items():
    bound = 1 / np.sqrt(fi)
    for name in ('kernel', 'bias'):
      w = np.asarray(params[layer][name])
      assert np.abs(w).max() <= bound
      # Uniform on [-b, b]: the largest magnitude is close to the bound for big tensors.
      if w.size > 1000:
        assert np.abs(w).max() > 0.95 * bound
        assert abs(w.std() - bound / np.sqrt(3)) < 0.05 * bound


@pytest.mark.slow  # forward and gradient programs of each formulation
@pytest.mark.parametrize('family,impl', [('cnn1', 'im2col'), ('cnn2', 'im2col'),
                                         ('cnn1', 'band'), ('cnn2', 'band')])
def test_cpu_formulations_equal_xla_convolution(family, impl):
  params = models.init_params(make_model(family, 10, 'xla'), jax.random.PRNGKey(1))
  x = jax.random.normal(jax.random.PRNGKey(2), (3, 32, 32, 3))
  out = {i: make_model(family, 10, i).apply({'params': params}, x) for i in ('xla', impl)}
  for a, b in zip(out['xla'], out[impl]):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  # Gradients agree too (the CPU formulations are what train on the CPU).
  def loss(p, i):
    logits, rep = make_model(family, 10, i).apply({'params': p}, x)
    return jnp.sum(logits ** 2) + jnp.sum(rep)
  ga, gb = (jax.grad(loss)(params, i) for i in ('xla', impl))
  for a, b in zip(jax.tree_util.tree_leaves(ga), jax.tree_util.tree_leaves(gb)):
    np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-4)


@pytest.mark.parametrize('tile', [1, 2, 7, 28])
def test_banded_conv_any_tile_equals_xla(tile):
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 32, 32, 3))
  k = jax.random.normal(jax.random.PRNGKey(1), (5, 5, 3, 4))
  want = jax.lax.conv_general_dilated(x, k, (1, 1), 'VALID',
                                      dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
  np.testing.assert_allclose(models.banded_conv(x, k, tile), want, rtol=1e-4, atol=1e-4)


def test_auto_picks_band_for_training_on_the_cpu_and_xla_for_evaluation():
  train = 'band' if jax.default_backend() == 'cpu' else 'xla'
  assert make_model('cnn1', 10).conv_impl == train
  assert make_model('cnn1', 10, forward_only=True).conv_impl == 'xla'
  assert make_model('cnn1', 10, 'im2col', forward_only=True).conv_impl == 'im2col'


def test_banded_conv_tile_must_divide_width():
  with pytest.raises(ValueError, match='must divide'):
    models.banded_conv(jnp.zeros((1, 14, 14, 2)), jnp.zeros((5, 5, 2, 3)), tile=3)


def test_representation_is_500_dim_after_relu():
  model = make_model('cnn3', 100, 'im2col')
  params = models.init_params(model, jax.random.PRNGKey(0))
  logits, rep = model.apply({'params': params}, jnp.ones((2, 32, 32, 3)))
  assert logits.shape == (2, 100) and rep.shape == (2, 500)
  assert (np.asarray(rep) >= 0).all()


def test_header_rows_round_trip():
  params = models.init_params(make_model('cnn5', 10, 'xla'), jax.random.PRNGKey(0))
  rows = models.header_rows(params)
  assert rows.shape == (10, 501)
  np.testing.assert_array_equal(rows[3, :500], params['fc3']['kernel'][:, 3])
  assert rows[3, 500] == params['fc3']['bias'][3]
  back = models.with_header_rows(params, rows * 2)
  np.testing.assert_allclose(back['fc3']['kernel'], params['fc3']['kernel'] * 2)
  np.testing.assert_allclose(back['fc3']['bias'], params['fc3']['bias'] * 2)
  assert back['fc2'] is params['fc2']


@pytest.mark.parametrize('family', ['cnn1', 'cnn5'])
def test_xla_flop_count_agrees_with_analytic(family):
  xla = costs.xla_train_flops_per_sample(family, 10, 8, D)
  analytic = costs.analytic_train_flops_per_sample(family, 10, D)
  # XLA also counts elementwise work (ReLU, pooling, softmax): a little above the matmuls.
  assert 1.0 <= xla / analytic < 1.03


def test_band_tiles_follow_the_width_and_keep_cifars():
  assert (models.band_tile(28), models.band_tile(10)) == (4, 5)  # CIFAR's conv1 and conv2
  assert (models.band_tile(24), models.band_tile(8), models.band_tile(27)) == (4, 4, 3)
  assert models.band_tile(23) == 1


@pytest.mark.parametrize('shape', [(28, 28, 1), (29, 33, 3), (16, 16, 3)],
                         ids=['mnist', 'odd', 'smallest'])
def test_the_cnns_follow_the_input_shape(shape):
  """As the official CNNs: conv1 takes the images' channels, fc1 the flattened size after
  conv2's pool (an odd size's last row and column dropped); the band formulation (with tiles of
  the widths) agrees with XLA's convolution, and the analytic MACs and FLOPs follow the shape."""
  _, _, (hp, wp) = models.feature_sizes(shape)
  assert (hp, wp) == {(28, 28, 1): (4, 4), (29, 33, 3): (4, 5), (16, 16, 3): (1, 1)}[shape]
  model = {i: make_model('cnn5', 7, i, image_shape=shape) for i in ('xla', 'band')}
  params = jax.eval_shape(lambda: models.init_params(model['xla'], jax.random.PRNGKey(0)))
  assert params['conv1']['kernel'].shape == (5, 5, shape[2], 16)
  assert params['fc1']['kernel'].shape == (hp * wp * 32, 500)
  h1, w1 = shape[0] - 4, shape[1] - 4
  h2, w2 = h1 // 2 - 4, w1 // 2 - 4
  macs = (h1 * w1 * 16 * shape[2] * 25 + h2 * w2 * 32 * 400 + hp * wp * 32 * 500 + 500 * 500 +
          500 * 7)
  assert models.forward_macs('cnn5', 7, D, image_shape=shape) == macs
  if shape == (16, 16, 3):  # the shapes above; the programs below for the other two
    return
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: rng.normal(scale=0.05, size=s.shape).astype(np.float32), params)
  x = rng.normal(size=(2, *shape)).astype(np.float32)
  apply = lambda impl: jax.jit(model[impl].apply)({'params': params}, x)
  for a, b in zip(apply('xla'), apply('band')):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  ratio = (costs.xla_train_flops_per_sample('cnn5', 7, 8, D, image_shape=shape) /
           costs.analytic_train_flops_per_sample('cnn5', 7, D, image_shape=shape))
  assert 1.0 <= ratio < 1.03


def test_images_too_small_for_the_cnns_are_refused():
  with pytest.raises(ValueError, match='15x32 are too small for the CNNs, which need at least 16'):
    make_model('cnn1', 10, image_shape=(15, 32, 3))
