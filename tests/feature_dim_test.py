"""model.feature_dim, d: the width of the representation, the header's rows (d + 1) and every
prototype and float count that follows them, at a d other than the paper's 500. d is one value,
read from the config and passed explicitly: no function falls back to a width of its own."""
import dataclasses
import inspect

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from fedssa_jax import config_lib, errors, methods, models
from fedssa_jax.engine import costs, snapshots

from conftest import client_view, make_small_sim, params_of, rounds, synthetic_dataset

D = 64
C = 10


def method(name, **more):
  c = config_lib.build('cifar10', 'hetero,tiny')
  c.method, c.model.feature_dim = name, D
  c.update_from_flattened_dict(more)
  return methods.get_method(name)(c, 5, C)


def test_a_cnn_of_width_d_has_a_header_of_d_plus_1_columns():
  model = models.make_model('cnn5', C, 'im2col', feature_dim=D)
  params = jax.eval_shape(lambda: models.init_params(model, jax.random.PRNGKey(0)))
  assert params['fc2']['kernel'].shape == (500, D) and params['fc3']['kernel'].shape == (D, C)
  assert models.init_header(jax.random.PRNGKey(0), C, D).shape == (C, D + 1)
  # The analytic count follows fc2's width.
  assert (models.forward_macs('cnn5', C, D) - models.forward_macs('cnn5', C, 500)
          == (D - 500) * (500 + C))


def test_headers_and_prototypes_follow_d():
  seen = np.zeros((5, C), bool)
  seen[:, :2] = True
  view = client_view(0, seen[0], 10, 0)
  fedssa = method('fedssa')
  server = fedssa.init_server(jax.random.PRNGKey(0), jnp.asarray(seen))
  assert server.global_rows.shape == (C, D + 1) and server.table.shape == (5, C, D + 1)
  params = models.init_params(models.make_model('cnn5', C, 'im2col', feature_dim=D),
                              jax.random.PRNGKey(1))
  assert int(fedssa.download(params, {}, server, view).floats) == 2 * (D + 1)
  for name in ('fedproto', 'fedtgp', 'fedgh'):
    m = method(name)
    s = m.init_server(jax.random.PRNGKey(0), jnp.asarray(seen))
    assert s.uploads.shape == (5, C, D), name
  assert method('fedtgp').tgp_size == D * C + 2 * (D * D + D)
  assert method('lg_fedavg').header_floats == method('fedgh').header_floats == (D + 1) * C
  assert method('fedkd').init_client_state(jax.random.PRNGKey(0)).w_h.shape == (D, D)
  assert method('fedl2g').dim == D


def test_fedmrl_slice_must_fit_in_d():
  with pytest.raises(ValueError, match='feature_dim = 64'):
    method('fedmrl', **{'fedmrl.d1': D + 1})


def test_d_is_read_from_the_config_and_nowhere_defaults():
  assert models.feature_dim(config_lib.base_config('cifar10')) == models.CNN_FEATURE_DIM == 500
  assert models.feature_dim(config_lib.build('cifar10', 'htfe2')) == models.zoo.FEATURE_DIM
  # Every function that receives d takes it explicitly: no default width to fall back on.
  for fn in (models.make_model, models.forward_macs, models.init_header,
             models.zoo.make_zoo_model, costs.xla_train_flops_per_sample,
             costs.xla_forward_flops_per_sample, costs.analytic_train_flops_per_sample,
             costs.model_flops, costs.forward_flops):
    param = inspect.signature(inspect.unwrap(fn)).parameters['feature_dim']
    assert param.default is inspect.Parameter.empty, fn.__qualname__
  assert models.CNN.__dataclass_fields__['feature_dim'].default is dataclasses.MISSING
  for name in ('REPR_DIM', 'HEADER_ROW'):
    assert not hasattr(models, name), name


@pytest.mark.parametrize('config', [None, ml_collections.ConfigDict({'model': {}}),
                                    ml_collections.ConfigDict({'fedssa': {}})])
def test_a_config_without_d_is_a_clear_error(config):
  with pytest.raises(errors.ConfigError, match='no model.feature_dim'):
    models.feature_dim(config)
  with pytest.raises(errors.ConfigError, match='no model.feature_dim'):
    methods.get_method('standalone')(config, 5, C)


@pytest.mark.parametrize('bad', [0, -3, 12.5, '512', True])
def test_a_bad_d_is_a_clear_error(bad):
  with pytest.raises(errors.ConfigError, match='feature_dim must be a positive integer'):
    models.feature_dim(ml_collections.ConfigDict({'model': {'feature_dim': bad}}))


@pytest.mark.slow  # a simulator compiled and run
def test_a_512_d_run_has_513_wide_header_rows_end_to_end():
  """FedSSA at d = 512 (HtFLlib's width) on the five-client CNN-5 simulator: the clients' fc2
  and fc3, the server's table and global rows, and the floats each round sends."""
  d = 512
  sim = make_small_sim(synthetic_dataset(), 'fedssa', **{'model.feature_dim': d})
  assert sim.method.feature_dim == d and sim.method.header_row == d + 1
  n, s, seen = sim.num_clients, sim.num_classes, sim.seen[0]
  state, info = next(iter(rounds(sim, 1)))
  server = snapshots.seed_state(sim.store, state).server
  assert server.table.shape == (n, s, d + 1) and server.global_rows.shape == (s, d + 1)
  for k in range(n):
    p = params_of(sim, state.population.params, k)
    assert p['fc2']['kernel'].shape == (500, d) and p['fc3']['kernel'].shape == (d, s)
    assert models.header_rows(p).shape == (s, d + 1)
  # The initial header gives every class a global row: each participant gets and sends its
  # seen rows, d + 1 floats each.
  want = (d + 1) * seen[info.cohort].sum(axis=1)
  np.testing.assert_array_equal(info.client_down_floats, want)
  np.testing.assert_array_equal(info.client_up_floats, want)
  # The training FLOPs are those of the d-wide model.
  assert sim.flops.model('cnn5') == costs.model_flops(
      'cnn5', s, sim.config.batch_size, d, sim.image_shape)
  assert sim.flops.model('cnn5') > costs.model_flops(
      'cnn5', s, sim.config.batch_size, 500, sim.image_shape)
