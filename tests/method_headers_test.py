"""methods/headers.py (LG-FedAvg's and FedClassAvg's whole-header exchange) by hand: the download
overwrites the header, the upload's weight, the weighted mean, and a round without uploads."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, methods, models
from fedssa_jax.methods import headers

from conftest import client_view

N, C, D = 4, 3, 2


def method(weighting):
  cfg = config_lib.base_config('cifar10')
  cfg.model.feature_dim = D
  cfg.lg_fedavg.weighting = weighting
  m = methods.get_method('lg_fedavg')(cfg, N, C)
  assert isinstance(m, headers.SharedHeader)
  return m


def rows(value):
  return jnp.full((C, D + 1), value, jnp.float32)


@pytest.mark.parametrize('weighting, want', [('samples', (1 * 10 + 5 * 30) / 40),
                                             ('uniform', (1 + 5) / 2)])
def test_the_global_header_is_the_weighted_mean_of_the_uploads(weighting, want):
  m = method(weighting)
  server = m.init_server(jax.random.PRNGKey(0), jnp.ones((N, C), bool))
  params = models.with_header_rows({}, rows(7.0))
  down = m.download(params, None, server, client_view(0, [True] * C, 10))
  np.testing.assert_array_equal(models.header_rows(down.params), server.global_header)
  assert int(down.floats) == C * (D + 1)
  uploads = [m.upload({'model': models.with_header_rows({}, rows(v))}, None, None, None,
                      client_view(k, [True] * C, n)) for k, (v, n) in enumerate([(1., 10),
                                                                                 (5., 30)])]
  np.testing.assert_allclose(float(uploads[1].payload.weight),
                             30 if weighting == 'samples' else 1)
  payload = jax.tree.map(lambda *a: jnp.stack(a), *[u.payload for u in uploads])
  server = m.server_receive(server, jnp.array([0, 1]), payload, jnp.array([True, True]))
  new = m.server_aggregate(server, jnp.array([True, True, False, False]), 0, None).server
  np.testing.assert_allclose(new.global_header, rows(want), rtol=1e-6)
  # A round without uploads keeps H_g, and the inbox starts empty again.
  again = m.server_aggregate(new, jnp.zeros(N, bool), 1, None).server
  np.testing.assert_array_equal(again.global_header, new.global_header)
  assert float(again.inbox.weight) == 0
