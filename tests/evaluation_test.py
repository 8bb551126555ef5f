"""evaluation.py: save_representations writes every client's test representations at the end."""
import json
import os

import numpy as np
import pytest

from fedssa_jax import config_lib
from fedssa_jax.engine import evaluation
from fedssa_jax.run import train
from conftest import synthetic_dataset

# A whole run, compiled (slow: `pytest -m "not slow"` leaves it out).
pytestmark = pytest.mark.slow


def test_a_run_saves_every_clients_test_representations(tmp_path):
  c = config_lib.build('cifar10', 'hetero,tiny')
  c.method, c.model.families = 'lg_fedavg', ('cnn5',)  # evaluated with the global header
  c.num_rounds, c.save_representations = 1, True
  ds = synthetic_dataset()
  train.train_and_evaluate(c, str(tmp_path), dataset=ds)

  saved = np.load(os.path.join(tmp_path, evaluation.REPRESENTATIONS_FILE))
  derived = json.load(open(tmp_path / 'config.json'))['derived']
  test_n = derived['client_test_samples']
  m = sum(test_n)
  assert saved['representations'].shape == (m, 500)
  assert saved['representations'].dtype == np.float16
  assert np.isfinite(saved['representations'].astype(np.float32)).all()
  np.testing.assert_array_equal(saved['client'], np.repeat(np.arange(len(test_n)), test_n))
  for k, seen in enumerate(derived['client_seen_classes']):  # each client's labels are its own
    assert set(saved['labels'][saved['client'] == k].tolist()) <= set(seen)
