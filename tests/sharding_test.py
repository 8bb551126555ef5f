"""Clients sharded over 4 (fake CPU) devices give the metrics of one device: same cohorts,
samples and float counts, losses, accuracies and server state within float tolerance, with
cohorts that do not divide by 4 (FedSSA's 3 clients, one chunk; FD's 5 of 7 after the
dropouts, two chunks: dummies fill the last chunk of every round) and 10 clients padded to 12
rows (a multiple of the devices). The runs happen in one subprocess
(tests/sharding_run.py), as XLA's host device count is fixed when JAX starts.

Four devices, not eight: every property checked here (a padded client axis, chunks of the
device count holding dummies, the seed axis unsharded) holds on 4 as on 8, and the 4-device
subprocess costs less CPU (this file: 54 s against 66 s on 8, on 2 cores). Two devices would
not do: 10 clients divide by 2 (no padding rows).

Its time is each distinct config's XLA programs (traced, compiled, run), so the runs are few and
all have the same shapes: one family of 10 clients (12 rows, three per device), two rounds.
FedSSA on 1 and 4 devices; the 1-device run's checkpoint resumed on 4; the host store on 4; FD
on 1 and 4 (a second method's server state); FedSSA seeds 0 and 15 packed on 4, whose reference
for seed 0 is the FedSSA run on 4 (the same config) and for seed 15 its run alone (the same
programs)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import cpu_devices_env

# The runs are a subprocess of 4 devices (slow: `pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = 4
# method:rounds:families. Both methods as engine_test's small config (10 clients, K = 3) with
# one group of 10 clients (padded to 12 rows, three per device) and two rounds; the first run also
# gives the resume, the host store and the packed seeds (tests/sharding_run.py). FD's runs have
# the system section on (every kind, a clock and a deadline; K = 7).
RUNS = ('fedssa:2:cnn4', 'fd:2:cnn4:system')
SHARDING = {  # per group: stored rows, clients, chunk size, rows per device
    'fedssa': [(12, 10, 4, 3)],
    'fd': [(12, 10, 4, 3)],
}


@pytest.fixture(scope='module')
def results():
  proc = subprocess.run([sys.executable, os.path.join(ROOT, 'tests', 'sharding_run.py'), *RUNS,
                         'replicas'],
                        env=cpu_devices_env(DEVICES), capture_output=True, text=True,
                        timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith('RESULT ')][-1]
  return json.loads(line[len('RESULT '):])


@pytest.mark.parametrize('method', [r.split(':')[0] for r in RUNS])
def test_four_devices_give_the_metrics_of_one(results, method):
  one, mesh = results[method]['1'], results[method]['0']
  # Exact: cohorts, samples trained and the floats exchanged.
  for key in ('cohorts', 'train_samples', 'up_floats', 'down_floats', 'client_flops',
              'params_rows'):
    assert one[key] == mesh[key], key
  assert one['costs'] == mesh['costs']
  assert all(len(c) % DEVICES for c in one['cohorts'])  # every round's last chunk holds dummies
  if method == 'fd':  # two chunks a round on the mesh
    assert all(len(c) > DEVICES for c in one['cohorts'])
  # The system section's draws and arrivals (FD's runs), and its clock up to rounding.
  for a, b in zip(one['system'], mesh['system']):
    assert (a is None) == (b is None) == (method != 'fd')
    if a is not None:
      for key in ('dropped', 'stragglers', 'lost', 'late', 'received'):
        assert a[key] == b[key], key
      np.testing.assert_allclose(b['seconds'], a['seconds'], rtol=1e-6)
  if method == 'fd':  # the federation did more than the ideal one
    kinds = [sum(len(r[k]) for r in one['system']) for k in ('dropped', 'stragglers', 'lost')]
    assert all(kinds), kinds
  for key in ('train_loss', 'accuracy', 'batch_accuracy', 'server_abs_sum', 'params_abs_sum'):
    np.testing.assert_allclose(mesh[key], one[key], rtol=1e-3, atol=1e-6, err_msg=key)


@pytest.mark.parametrize('method', [r.split(':')[0] for r in RUNS])
def test_four_devices_shard_the_client_axis(results, method):
  assert results['devices'] == DEVICES
  one, mesh = results[method]['1']['sharding'], results[method]['0']['sharding']
  assert len(one) == len(mesh) == len(SHARDING[method])
  # Round 1 compiled nothing that round 0 had not: the state is placed alike from the start.
  for devices in ('1', '0'):
    assert results[method][devices]['train_compiles'] == [1] * len(SHARDING[method])
  for a, b, (rows, size, per_call, per_device) in zip(one, mesh, SHARDING[method]):
    assert a['devices'] == 1 and a['rows'] == a['size'] == size  # unsharded, unpadded
    # Sharded along the clients axis, padded to a multiple of the devices; chunks of 4.
    assert b == {'rows': rows, 'size': size, 'clients_per_call': per_call,
                 'spec': "P(None, 'clients')", 'devices': DEVICES, 'shard_rows': [per_device]}


def test_a_one_device_checkpoint_resumes_on_four(results):
  """Checkpoints hold no padding rows: one device's state, restored and placed on the mesh,
  trains its next round as the one-device run does."""
  resume = results[RUNS[0].split(':')[0]]['resume']
  assert resume['sharding'] == results['fedssa']['0']['sharding']
  assert resume['cohorts'][0] == resume['cohorts'][1]
  assert resume['up_floats'][0] == resume['up_floats'][1]
  np.testing.assert_allclose(resume['train_loss'][1], resume['train_loss'][0], rtol=1e-3)


def test_the_host_store_on_four_devices_gives_the_device_store_metrics(results):
  device, host = results['fedssa']['0'], results['fedssa']['0host']
  for key in ('cohorts', 'train_samples', 'up_floats', 'down_floats', 'client_flops',
              'params_rows', 'train_loss', 'accuracy', 'batch_accuracy', 'server_abs_sum',
              'params_abs_sum'):
    np.testing.assert_allclose(host[key], device[key], rtol=1e-6, err_msg=key)


def test_packed_seeds_on_the_mesh_equal_their_runs_alone(results):
  """Two seeds of one Simulator under the mesh: each seed's client axis sharded as alone (the
  seed axis not), and each seed's records and state those of its seed alone on the mesh, through a
  checkpoint round trip after round 1. Seed 0 alone is the FedSSA run on the mesh above."""
  rep = results['replicas']
  assert rep['stacked'] == {'shape': [2, 12, 16], 'spec': "P(None, 'clients')",
                            'shard_shapes': [[2, 3]]}  # 2 seeds, 10 clients in 12 rows, a bias
  assert rep['packed'][0]['cohorts'] != rep['packed'][1]['cohorts']
  for packed, alone in zip(rep['packed'], rep['alone']):
    assert packed['cohorts'] == alone['cohorts'] and packed['up_floats'] == alone['up_floats']
    np.testing.assert_allclose(packed['accuracy'], alone['accuracy'], atol=1e-9)
    for key in ('train_loss', 'abs_sums'):
      np.testing.assert_allclose(packed[key], alone[key], rtol=1e-5, err_msg=key)
