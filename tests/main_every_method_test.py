"""Every method end to end through the command line, on TFDS mock data, with the floats each
round sends checked against the spec's communication table (BASELINES.md §10), for 3 rounds
that the blow-up guard, at its defaults, lets through."""
import json
import os

import numpy as np
import pytest
import tensorflow_datasets as tfds
from absl import flags

from fedssa_jax import main as main_lib
from fedssa_jax import methods, models

# Every method compiles its programs (slow: `pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
C = 10
ROW = models.HEADER_ROW
P5 = 665_048 + 501 * C  # CNN-5 with its C-way head (spec §0)


def run_cli(monkeypatch, workdir, method):
  argv = ['main', f'--config={ROOT}/configs/tiny.py', f'--workdir={workdir}',
          f'--config.method={method}', '--config.model.families=("cnn5",)',
          '--config.num_clients=5', '--config.participation=0.4',
          '--config.num_rounds=3', '--config.batch_size=8', '--config.target_accuracy=0.01',
          '--config.engine.micro_batch=4']  # 4-row passes, where the loss allows them
  monkeypatch.setattr('sys.argv', argv)  # config_flags reads its overrides from sys.argv
  flag_values = flags.FlagValues()  # main's flags, parsed afresh for each run
  main_lib.define_flags(flag_values)
  flag_values(argv)
  with tfds.testing.mock_data(num_examples=200):
    main_lib.run(flag_values)
  read = lambda name: json.load(open(os.path.join(workdir, name)))
  records = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]
  return read('config.json'), records, read('summary.json')


def expected_floats(method, seen, avail_before):
  """(up, down) per participant from the spec's table, for the methods whose counts follow
  from the seen classes alone; None where they depend on trained values (FedKD's ranks)."""
  s = seen.sum(axis=1)
  has_global = (seen & avail_before).sum(axis=1)
  return {
      'standalone': (0 * s, 0 * s),
      'fedssa': (ROW * s, ROW * has_global),
      'fd': (s * C, has_global * C),
      'fedproto': (models.REPR_DIM * s, models.REPR_DIM * has_global),
      'fml': (P5 + 0 * s, P5 + 0 * s),
      'lg_fedavg': (ROW * C + 0 * s, ROW * C + 0 * s),
      'fedclassavg': (ROW * C + 0 * s, ROW * C + 0 * s),
  }.get(method)


@pytest.mark.parametrize('method', sorted(methods.METHODS))
def test_runs_from_the_command_line_with_spec_communication(monkeypatch, tmp_path, method):
  config, records, summary = run_cli(monkeypatch, str(tmp_path / method), method)
  assert config['config']['method'] == method and summary['method'] == method
  # Three rounds with the blow-up guard at its defaults (train.check_blowup), untripped.
  assert [r['round'] for r in records] == [1, 2, 3]
  for r in records:
    assert 0 <= r['mean_accuracy'] <= 1 and np.isfinite(r['train_loss'])
  seen_lists = config['derived']['client_seen_classes']
  seen = np.zeros((len(seen_lists), C), bool)
  for k, cls in enumerate(seen_lists):
    seen[k, cls] = True
  # Global class values exist after round 1 for the classes its participants hold (FedSSA's
  # initial header gives every class one from the start).
  avail = np.full(C, method == 'fedssa')
  for r in records:
    part = np.asarray(r['participants'])
    want = expected_floats(method, seen[part], avail)
    if want is not None:
      assert r['up_floats'] == want[0].sum(), 'upload'
      assert r['down_floats'] == want[1].sum(), 'download'
    else:  # FedKD: compressed updates, never above a dense CNN-5, nothing down in round 0
      assert 0 < r['up_floats'] <= P5 * len(part)
      assert r['down_floats'] <= P5 * len(part)
      assert r['round'] > 1 or r['down_floats'] == 0
    avail |= seen[part].any(axis=0)
  if method == 'fedproto':
    assert 0 <= records[-1]['method_metrics']['prototype_accuracy'] <= 1
