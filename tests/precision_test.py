"""Mixed precision (engine.compute_dtype): bfloat16 compute with float32 master weights.

The bfloat16 forward and gradients stay close to float32's, come back as float32, and a short
engine run keeps float32 parameters with a training loss close to the float32 run's.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, methods, models

IMPLS = ('xla', 'im2col', 'band')
# The paper's CNNs: d = fc2's width, 500 (config_lib's default model.feature_dim).
make_model = functools.partial(models.make_model, feature_dim=models.CNN_FEATURE_DIM)


def rel_err(a, b):
  """||a - b|| / ||b||, in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.fixture(scope='module')
def params_and_x():
  params = models.init_params(make_model('cnn5', 10, 'xla'), jax.random.PRNGKey(0))
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 32, 32, 3))
  return params, x


def loss(model, p, x):
  logits, rep = model.apply({'params': p}, x)
  return jnp.sum(logits ** 2) + jnp.sum(rep)


@pytest.mark.parametrize('impl', IMPLS)
def test_bf16_forward_is_close_to_float32_and_returns_float32(impl, params_and_x):
  params, x = params_and_x
  # Jitted: one program a model, not one per op.
  ref = jax.jit(make_model('cnn5', 10, impl).apply)({'params': params}, x)
  out = jax.jit(make_model('cnn5', 10, impl, 'bfloat16').apply)({'params': params}, x)
  for a, b in zip(out, ref):
    assert a.dtype == jnp.float32
    np.testing.assert_allclose(a, b, rtol=5e-2, atol=5e-2)
    assert rel_err(a, b) < 2e-2


@pytest.mark.slow  # gradient programs in two precisions, three formulations
@pytest.mark.parametrize('impl', IMPLS)
def test_bf16_gradients_are_float32_and_close_to_float32(impl, params_and_x):
  params, x = params_and_x
  g32, g16 = (jax.jit(jax.grad(lambda p: loss(make_model('cnn5', 10, impl, d), p, x)))(params)
              for d in ('float32', 'bfloat16'))
  # bfloat16 keeps 8 bits of mantissa: at init the first convolution's gradient, a sum of
  # small, cancelling terms over every position, is the least precise (about 6-7%, the others
  # 0.5-2.5%); the whole gradient is within about 2.5%.
  for a, b in zip(jax.tree_util.tree_leaves(g16), jax.tree_util.tree_leaves(g32)):
    assert a.dtype == jnp.float32
    assert rel_err(a, b) < 0.15
  flat = lambda g: np.concatenate([np.ravel(a) for a in jax.tree_util.tree_leaves(g)])
  assert rel_err(flat(g16), flat(g32)) < 5e-2


def test_bf16_computes_in_bf16_and_float32_casts_nothing(params_and_x):
  params, x = params_and_x
  for impl in IMPLS:
    j32 = str(jax.make_jaxpr(lambda p: loss(make_model('cnn5', 10, impl), p, x))(params))
    j16 = str(jax.make_jaxpr(
        lambda p: loss(make_model('cnn5', 10, impl, jnp.bfloat16), p, x))(params))
    assert 'bf16' not in j32 and 'convert_element_type' not in j32, impl
    assert 'bf16[4,10]' in j16, impl  # fc3's logits, before the cast back to float32


def test_init_is_float32_and_unchanged_by_the_compute_dtype():
  key = jax.random.PRNGKey(3)
  p32 = models.init_params(make_model('cnn5', 10, 'band'), key)
  p16 = models.init_params(make_model('cnn5', 10, 'band', jnp.bfloat16), key)
  for a, b in zip(jax.tree_util.tree_leaves(p32), jax.tree_util.tree_leaves(p16)):
    assert b.dtype == jnp.float32
    np.testing.assert_array_equal(a, b)


def test_make_model_rejects_an_unknown_dtype_name():
  with pytest.raises(ValueError, match="one of \\('float32', 'bfloat16'\\)"):
    make_model('cnn5', 10, 'band', 'float16')


@pytest.mark.parametrize('method,attr', [('fml', 'meme_model'), ('fedkd', 'mentee_model')])
def test_methods_extra_models_take_the_compute_dtype(method, attr):
  c = config_lib.build('cifar10', 'tiny')
  c.method, c.engine.compute_dtype = method, 'bfloat16'
  assert getattr(methods.get_method(method)(c, 5, 10), attr).dtype == jnp.bfloat16


def run(sim):
  state, infos = sim.init_state(), []
  for _ in range(sim.config.num_rounds):
    state, (info,) = sim.run_round(state)
    infos.append(info)
  return state, infos, sim.evaluate(state)


@pytest.mark.slow  # a simulator compiled and run
def test_bf16_engine_run_keeps_float32_params_and_float32_like_loss(small_sim):
  sim32, sim16 = (small_sim('fedssa', **{'engine.compute_dtype': d})
                  for d in ('float32', 'bfloat16'))
  config_lib.validate(sim16.config)
  (s32, i32, _), (s16, i16, e16) = run(sim32), run(sim16)
  assert {g.model.dtype for g in sim16.groups} == {jnp.bfloat16}
  # Every client's parameters (the master weights) and the server's state stay float32.
  for p in (s16.population.params, s16.server):
    for a in jax.tree_util.tree_leaves(p):
      assert a.dtype in (jnp.float32, jnp.int32, jnp.bool_), a.dtype
  for a, b in zip(jax.tree_util.tree_leaves(s32), jax.tree_util.tree_leaves(s16)):
    assert np.asarray(a).dtype == np.asarray(b).dtype and np.shape(a) == np.shape(b)
  for a, b in zip(i32, i16):
    np.testing.assert_array_equal(a.cohort, b.cohort)
    assert np.isfinite(b.train_loss)
    assert b.train_loss == pytest.approx(a.train_loss, rel=5e-2)
  assert np.isfinite(e16.accuracy[e16.evaluated]).all()
