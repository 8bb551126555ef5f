"""model.feature_dim, d: the width of the representation, the header's rows (d + 1) and every
prototype and float count that follows them, at a d other than the paper's 500."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, methods, models

from conftest import client_view

D = 64
C = 10


def method(name, **more):
  c = config_lib.build('cifar10', 'hetero,tiny')
  c.method, c.model.feature_dim = name, D
  c.update_from_flattened_dict(more)
  return methods.get_method(name)(c, 5, C)


def test_a_cnn_of_width_d_has_a_header_of_d_plus_1_columns():
  model = models.make_model('cnn5', C, 'im2col', repr_dim=D)
  params = jax.eval_shape(lambda: models.init_params(model, jax.random.PRNGKey(0)))
  assert params['fc2']['kernel'].shape == (500, D) and params['fc3']['kernel'].shape == (D, C)
  assert models.init_header(jax.random.PRNGKey(0), C, D).shape == (C, D + 1)
  # The analytic count follows fc2's width.
  assert (models.forward_macs('cnn5', C, D) - models.forward_macs('cnn5', C)
          == (D - 500) * (500 + C))


def test_headers_and_prototypes_follow_d():
  seen = np.zeros((5, C), bool)
  seen[:, :2] = True
  view = client_view(0, seen[0], 10, 0)
  fedssa = method('fedssa')
  server = fedssa.init_server(jax.random.PRNGKey(0), jnp.asarray(seen))
  assert server.global_rows.shape == (C, D + 1) and server.table.shape == (5, C, D + 1)
  params = models.init_params(models.make_model('cnn5', C, 'im2col', repr_dim=D),
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
