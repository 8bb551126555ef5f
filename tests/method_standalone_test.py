"""Standalone, the control for comparing methods: a baseline whose knowledge-transfer term is
switched off trains each client's own model exactly as Standalone does (same initial models,
cohorts, batches and augmentation), to float rounding: the programs differ (FML's meme, FD's and
FedProto's zero-weighted terms), so XLA may fuse and round the shared computation differently
(a few ulps; a wrong batch, key or model would differ by orders of magnitude more)."""
import jax
import numpy as np
import pytest

from conftest import make_small_sim, rounds

# Four simulators compiled and run (slow: `pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

ROUNDS = 2


def own_models_after(sim):
  losses = []
  for state, info in rounds(sim, ROUNDS):
    losses.append(info.train_loss_sum)
  return state.population.params, np.array(losses)


@pytest.fixture(scope='module')
def standalone(small_ds):
  return own_models_after(make_small_sim(small_ds, 'standalone'))


# FedTGP's: the prototypes of the pass before training (it runs, and changes nothing of the
# training), and 2 server epochs, as method_fedtgp_test.py's simulator (the same programs).
FEDTGP_OFF = {'fedtgp.lam': 0.0, 'fedtgp.proto_timing': 'pre_train', 'fedtgp.server_epochs': 2}


@pytest.mark.parametrize('method,off', [('fml', {'fml.alpha': 1.0}), ('fd', {'fd.lam': 0.0}),
                                        ('fedproto', {'fedproto.lam': 0.0}),
                                        ('fedtgp', FEDTGP_OFF)])
def test_switched_off_baselines_train_like_standalone(small_ds, standalone, method, off):
  params, losses = own_models_after(make_small_sim(small_ds, method, **off))
  want_params, want_losses = standalone
  jax.tree.map(lambda p, w: np.testing.assert_allclose(p, w, rtol=1e-5, atol=1e-7),
               params, want_params)
  if method != 'fml':  # FML's reported loss adds its meme's
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
