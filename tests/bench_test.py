"""The benchmark harness's quick mode (the CI smoke run): every section reports sane figures,
and rounds after the first compile nothing."""
import pytest

from fedssa_jax.run import bench

# The benchmark compiles many programs (slow: `pytest -m "not slow"` leaves it out).
pytestmark = pytest.mark.slow


def test_quick_benchmark_reports_every_section(capsys, monkeypatch):
  # Each case timed once, not the best of 3: the figures are checked for sanity, not precision
  # (the best of 3 ran the roofline, training and DP-SGD calls twice more).
  best_time = bench.best_time
  monkeypatch.setattr(bench, 'best_time', lambda fn, repeats: best_time(fn, 1))
  out = bench.run(quick=True, rounds=2)
  assert out['roofline']['flops_per_s'] > 1e8
  for r in out['training']:
    assert r['images_per_s'] > 0 and 0 < r['roofline_share'] < 1.5
  (rounds,) = out['rounds']
  assert rounds['first_round_compiles'] >= 2  # training and evaluation
  assert rounds['later_compiles'] == 0
  assert set(rounds['phases_s']) == {'sample', 'train', 'aggregate', 'host', 'evaluate'}
  for p in out['padding']:
    assert 0 <= p['padded_share'] < 1 and 0 <= p['padded_share_vmapped'] < 1
  assert [dp['per_example'] for dp in out['dp_sgd']] == ['auto']  # quick: ghost norms only
  for dp in out['dp_sgd']:
    assert dp['plain_s'] > 0 and dp['dp_sgd_s'] > 0 and dp['time_ratio'] > 0
    assert dp['max_batch'] >= dp['batch'] and dp['max_batch'] % dp['pass_size'] == 0
  printed = capsys.readouterr().out
  for title in ('Roofline', 'Local training', 'FedSSA rounds', 'Padded share', 'DP-SGD'):
    assert title in printed
