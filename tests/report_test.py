"""fedssa_jax.run.report on synthetic run folders with known values."""
import json
import os

import numpy as np
import pytest

from fedssa_jax import config_lib
from fedssa_jax.engine import evaluation
from fedssa_jax.run import plots, report, runs


def write_run(root, name, *, method='fedssa', seed=0, variants='hetero,n10', dataset='cifar10',
              accs=(0.5, 0.7), to_target=None, overrides=None, clients=(0.6, 0.8),
              derived=None, sim_seconds=None, summary_extra=None, diverged=None,
              records_extra=None):
  """A run folder as train.py writes it: config.json, metrics.jsonl, summary.json (or, given
  `diverged`, diverged.json instead: the run ended with a DivergenceError). `records_extra`:
  {field: a value per round} added to the records."""
  c = config_lib.build(dataset, variants)
  c.method, c.seed = method, seed
  for field, value in (overrides or {}).items():
    node = c
    *parents, leaf = field.split('.')
    for p in parents:
      node = node[p]
    node[leaf] = value
  d = os.path.join(root, name)
  os.makedirs(d)
  with open(os.path.join(d, 'config.json'), 'w') as f:
    json.dump({'config': c.to_dict(), 'derived': {'backend': 'cpu', **(derived or {})}}, f)
  with open(os.path.join(d, 'metrics.jsonl'), 'w') as f:
    for i, a in enumerate(accs):
      record = {'round': i + 1, 'mean_accuracy': a, 'cum_floats': 100.0 * (i + 1),
                'cum_client_flops': 1e9 * (i + 1)}
      if sim_seconds:  # the system section's clock: sim_seconds a round
        record['cum_sim_seconds'] = sim_seconds * (i + 1)
      record.update({k: v[i] for k, v in (records_extra or {}).items()})
      f.write(json.dumps(record) + '\n')
  if diverged is not None:
    with open(os.path.join(d, 'diverged.json'), 'w') as f:
      json.dump(diverged, f)
    return d
  summary = {'rounds': len(accs), 'final_mean_accuracy': accs[-1],
             'best_mean_accuracy': max(accs), 'final_client_accuracy': list(clients),
             'target_accuracy': 0.6, 'to_target': to_target, **(summary_extra or {})}
  with open(os.path.join(d, 'summary.json'), 'w') as f:
    json.dump(summary, f)
  return d


def cost(rounds, floats, flops):
  return {'round': rounds, 'cum_floats': floats, 'cum_client_flops': flops}


@pytest.fixture
def sweep(tmp_path):
  root = str(tmp_path)
  # cifar10 hetero N=10: FedSSA 70 and 72 %, Standalone 75 and 77 % (best), FedProto 60 %.
  write_run(root, 'a0', accs=(0.5, 0.70), to_target=cost(2, 1000.0, 4e9))
  write_run(root, 'a1', seed=1, accs=(0.5, 0.72), to_target=cost(2, 3000.0, 8e9))
  write_run(root, 'b0', method='standalone', accs=(0.6, 0.75), to_target=cost(1, 0.0, 3e9))
  write_run(root, 'b1', method='standalone', seed=1, accs=(0.6, 0.77),
            to_target=cost(1, 0.0, 3e9))
  write_run(root, 'c0', method='fedproto', accs=(0.5, 0.60),
            to_target=cost(2, 30000.0, 1.2e10))
  # The ablation: its own row.
  write_run(root, 'd0', accs=(0.5, 0.65), overrides={'fedssa.mu0': 0.0})
  # Robustness: cifar10 hetero N=100 with k = 2 (default), 4, and a Dirichlet gamma.
  for k, acc in ((2, 0.8), (4, 0.7)):
    for m in ('fedssa', 'fedproto'):
      write_run(root, f'k{k}{m}', method=m, variants='hetero,n100', accs=(acc - 0.01, acc),
                overrides={'partition.classes_per_client': k})
  # An unfinished run is listed, not counted; so is one that diverged.
  os.makedirs(os.path.join(root, 'e0'))
  open(os.path.join(root, 'e0', 'config.json'), 'w').write('{}')
  write_run(root, 'f1', method='fedproto', seed=1, accs=(0.5,), diverged=diverged_at(2))
  return root


def diverged_at(round_):
  return {'round': round_, 'train_loss': 9.1e4,
          'message': f'Training blew up in round {round_}: the mean train loss 9.1e+04 ...'}


def table_row(text, method):
  return next(l for l in text.splitlines() if l.startswith(f'| {method} |')).split(' | ')


def test_accuracy_table_mean_std_and_bold_best(sweep):
  index = report.write_report(sweep)
  out = os.path.dirname(index)
  text = open(os.path.join(out, 'accuracy.md')).read()
  assert '| method | cifar10 N=10, C=100% | cifar10 N=100, C=10% | cifar10 N=100, C=10% k=4 |' \
      in text
  # Sample std over two seeds: 70, 72 -> 71.00 ± 1.41.
  assert table_row(text, 'fedssa')[1] == f'71.00 ± {np.std([70, 72], ddof=1):.2f}'
  assert table_row(text, 'standalone')[1] == '**76.00 ± 1.41**'
  assert table_row(text, 'fedproto')[1] == '60.00'
  assert table_row(text, 'fedssa (mu0=0.0)')[1] == '65.00'
  # N=100: FedSSA and FedProto tie at 80 %: both bold.
  assert table_row(text, 'fedssa')[2] == '**80.00**' and table_row(text, 'fedproto')[2] == \
      '**80.00**'
  assert table_row(text, 'standalone')[2] == '—'


def test_costs_table_ratios_against_fedssa(sweep):
  text = open(os.path.dirname(report.write_report(sweep)) + '/costs.md').read()
  section = text.split('## cifar10 N=10, C=100% hetero, target 60%')[1].split('##')[0]
  # FedSSA's means over its two seeds: 2000 floats, 6e9 FLOPs.
  assert table_row(section, 'fedssa') == ['| fedssa', '2/2', '2', '2e+03', '6e+09', '1.00×',
                                          '1.00× |']
  assert table_row(section, 'fedproto') == ['| fedproto', '1/1', '2', '3e+04', '1.2e+10',
                                            '15.00×', '2.00× |']
  assert table_row(section, 'standalone')[5:] == ['0.00×', '0.50× |']
  assert table_row(section, 'fedssa (mu0=0.0)')[1:3] == ['0/1', '—']


def test_best_accuracy_table_labels_and_a_target_from_the_history(tmp_path):
  root = str(tmp_path)
  write_run(root, 'a0', accs=(0.5, 0.8, 0.7))  # final 70 %, best 80 % (round 2)
  write_run(root, 'b0', method='standalone', accs=(0.55, 0.6, 0.65))
  write_run(root, 'b1', method='standalone', accs=(0.6, 0.7, 0.75),
            overrides={'optimizer.lr': 0.01})  # a control: a row of its own
  out = os.path.dirname(report.write_report(root, target=0.7))
  text = open(os.path.join(out, 'accuracy.md')).read()
  final, best = text.split('## Best')
  assert table_row(final, 'fedssa')[1] == '70.00'
  assert table_row(best, 'fedssa')[1] == '**80.00**'
  assert table_row(final, 'standalone (lr=0.01)')[1] == '**75.00**'
  assert table_row(final, 'standalone')[1] == '65.00'
  costs = open(os.path.join(out, 'costs.md')).read()
  assert 'target 70%' in costs
  # First evaluated round at or above 70 %, read from metrics.jsonl (not the summary's target).
  assert table_row(costs, 'fedssa')[1:5] == ['1/1', '2', '200', '2e+09']
  assert table_row(costs, 'standalone (lr=0.01)')[1:5] == ['1/1', '2', '200', '2e+09']
  assert table_row(costs, 'standalone')[1:3] == ['0/1', '—']


def test_system_conditions_are_settings_of_their_own_with_simulated_time_to_target(tmp_path):
  root = str(tmp_path)
  write_run(root, 'ideal', accs=(0.5, 0.7))
  write_run(root, 'lost', accs=(0.4, 0.6), overrides={'system.upload_loss': 0.3})
  clock = {'system.device_tiers': 'three_tiers', 'system.tier_assignment': 'model',
           'system.deadline': 90.0}
  write_run(root, 'dev', accs=(0.5, 0.7), overrides=clock, sim_seconds=70.0)
  write_run(root, 'dev_fml', method='fml', accs=(0.4, 0.6, 0.7), overrides=clock,
            sim_seconds=90.0)
  labels = sorted(s.system for s in runs.by_setting_and_method(runs.load_runs(root)[0]))
  assert labels == ['', 'devices three_tiers (model), deadline 90 s', 'lost 30%']
  out = os.path.dirname(report.write_report(root, target=0.7))
  costs = open(os.path.join(out, 'costs.md')).read()
  section = costs.split('deadline 90 s hetero, target 70%')[1]
  # FedSSA reaches 70% at round 2 (140 simulated s), FML at round 3 (270 s): 1.93x.
  assert table_row(section, 'fedssa')[-2:] == ['140', '1.00× |']
  assert table_row(section, 'fml')[-2:] == ['270', '1.93× |']
  assert 'simulated s' not in costs.split('deadline 90 s hetero')[0]  # no clock, no column
  index = open(os.path.join(out, 'index.md')).read()
  assert index.count('simtime_') == 1 and os.path.exists(os.path.join(
      out, next(w for w in index.split('(') if w.startswith('simtime_')).split(')')[0]))


def test_privacy_budgets_are_columns_of_a_table_against_epsilon(tmp_path):
  """Runs under DP-SGD and upload DP are settings of their own; privacy.md has, per mechanism,
  the accuracy at each target epsilon and without DP (infinity), the epsilon reached, and the
  s/round against the run without; the plot is drawn and linked."""
  root = str(tmp_path)
  dp = lambda e: {'privacy.dp_sgd': True, 'privacy.noise_multiplier': 0.0,
                  'privacy.target_epsilon': e}
  up = lambda e: {'privacy.upload': True, 'privacy.upload_clip': 0.03,
                  'privacy.upload_noise_multiplier': 0.0, 'privacy.upload_target_epsilon': e}
  fast = lambda t: {'seconds_per_round_steady': t}
  write_run(root, 'ideal', accs=(0.5, 0.80), summary_extra=fast(7.0))
  write_run(root, 'ideal1', seed=1, accs=(0.5, 0.82), summary_extra=fast(7.0))
  write_run(root, 'sa', method='standalone', accs=(0.5, 0.78), summary_extra=fast(5.0))
  write_run(root, 'e1', accs=(0.3, 0.40), overrides=dp(1.0),
            summary_extra={**fast(70.0), 'dp_epsilon': 0.998})
  write_run(root, 'e4', accs=(0.3, 0.60), overrides=dp(4.0),
            summary_extra={**fast(84.0), 'dp_epsilon': 3.99})
  write_run(root, 'sa4', method='standalone', accs=(0.3, 0.55), overrides=dp(4.0),
            summary_extra={**fast(60.0), 'dp_epsilon': 3.97})
  # A private run on another backend: its s/round is a row of its own, not averaged in.
  write_run(root, 'sa1', method='standalone', accs=(0.3, 0.50), overrides=dp(1.0),
            summary_extra={**fast(0.5), 'dp_epsilon': 0.99}, derived={'backend': 'gpu'})
  write_run(root, 'u1', accs=(0.5, 0.70), overrides=up(1.0),
            summary_extra={**fast(7.7), 'dp_upload_epsilon': 1.0})
  # A noise multiplier given instead of a target: its column is the epsilon reached.
  write_run(root, 'u_sigma', accs=(0.5, 0.75),
            overrides={**up(0.0), 'privacy.upload_noise_multiplier': 2.0},
            summary_extra={**fast(7.0), 'dp_upload_epsilon': 6.5})
  settings = {s.privacy for s in runs.by_setting_and_method(runs.load_runs(root)[0])}
  assert settings == {'', 'DP-SGD clip 1 ε 1', 'DP-SGD clip 1 ε 4',
                      'upload DP, local clip 0.03 ε 1', 'upload DP, local clip 0.03 σ 2'}
  out = os.path.dirname(report.write_report(root))
  text = open(os.path.join(out, 'privacy.md')).read()
  dpsgd = text.split(', DP-SGD')[1].split('## ')[0]
  assert '| method | ε = 1 | ε = 4 | ε = ∞ |' in dpsgd
  assert '| fedssa | 40.00 (ε 0.998) | 60.00 (ε 3.99) | 81.00 ± 1.41 |' in dpsgd
  assert '| standalone | 50.00 (ε 0.99) | 55.00 (ε 3.97) | 78.00 |' in dpsgd
  # s/round: FedSSA's private runs (70 + 84) / 2 = 77 against 7: 11x; each backend apart.
  assert '| fedssa | cpu | 7.0 | 77.0 | 11.00× |' in dpsgd
  assert '| standalone | cpu | 5.0 | 60.0 | 12.00× |' in dpsgd
  assert '| standalone | gpu | — | 0.5 | — |' in dpsgd
  upload = text.split(', upload DP, local')[1]
  assert '| method | ε = 1 | ε = 6.5 | ε = ∞ |' in upload
  assert '| fedssa | 70.00 (ε 1) | 75.00 (ε 6.5) | 81.00 ± 1.41 |' in upload
  assert 'Global accuracy' not in text and 'New clients' not in text  # no lens recorded
  # The ideal runs stay a setting of their own in accuracy.md (two seeds, no private run).
  assert table_row(open(os.path.join(out, 'accuracy.md')).read(), 'fedssa')[1] == '**81.00 ± 1.41**'
  index = open(os.path.join(out, 'index.md')).read()
  plots = [w.split(')')[0] for w in index.split('(') if w.startswith('privacy_')]
  assert len(plots) == 2 and all(os.path.exists(os.path.join(out, p)) for p in plots)


def test_privacy_tables_add_the_lens_where_the_runs_recorded_it(tmp_path):
  """Upload DP at the cross-device scale: the global and new clients' accuracies at each
  epsilon, in tables of their own after the mean accuracy's; a cell without the value is '—'."""
  root = str(tmp_path)
  up = lambda e: {'privacy.upload': True, 'privacy.upload_clip': 0.016,
                  'privacy.upload_noise_multiplier': 0.0, 'privacy.upload_target_epsilon': e}
  lens = lambda g, n: {'final_global_accuracy': g, 'final_new_client_accuracy': n}
  write_run(root, 'ideal', variants='hetero,n1000', accs=(0.2, 0.28),
            summary_extra=lens(0.11, 0.22))
  write_run(root, 'u1', variants='hetero,n1000', accs=(0.2, 0.26), overrides=up(1.0),
            summary_extra={**lens(0.10, None), 'dp_upload_epsilon': 1.0})
  write_run(root, 'u4', variants='hetero,n1000', accs=(0.2, 0.27), overrides=up(4.0),
            summary_extra={**lens(0.105, 0.21), 'dp_upload_epsilon': 4.0})
  write_run(root, 'u4s1', variants='hetero,n1000', seed=1, accs=(0.2, 0.27), overrides=up(4.0),
            summary_extra={**lens(0.115, 0.23), 'dp_upload_epsilon': 4.0})
  text = open(os.path.join(os.path.dirname(report.write_report(root)), 'privacy.md')).read()
  accuracy, rest = text.split('Global accuracy (%), the same runs:')
  glob, new = rest.split('New clients\' accuracy (%), the same runs:')
  assert '| fedssa | 26.00 (ε 1) | 27.00 ± 0.00 (ε 4) | 28.00 |' in accuracy
  assert '| fedssa | 10.00 | 11.00 ± 0.71 | 11.00 |' in glob
  assert '| fedssa | — | 22.00 ± 1.41 | 22.00 |' in new


def test_runs_of_one_setting_on_two_partitions_are_flagged(tmp_path, capsys):
  """A setting's run without DP made on other data (another partition fingerprint) than its
  private runs: every page and the console say so, naming both fingerprints and the runs'
  data_dir; another seed's runs, or runs on one partition, are not flagged."""
  root = str(tmp_path)
  dp = {'privacy.dp_sgd': True, 'privacy.noise_multiplier': 0.0, 'privacy.target_epsilon': 4.0}
  fp = lambda f: {'partition_fingerprint': f}
  write_run(root, 'ideal', method='fd', derived=fp('aaaa'), overrides={'data_dir': '/d/tfds'})
  write_run(root, 'dp', method='fd', derived=fp('bbbb'), overrides={**dp, 'data_dir': '/d/x.npz'},
            summary_extra={'dp_epsilon': 4.0})
  write_run(root, 'dp2', derived=fp('bbbb'), overrides={**dp, 'data_dir': '/d/x.npz'},
            summary_extra={'dp_epsilon': 4.0})
  write_run(root, 'other_seed', seed=1, derived=fp('cccc'))
  out = os.path.dirname(report.write_report(root))
  err = capsys.readouterr().err
  assert err.count('different partitions') == 1
  for page in ('index.md', 'accuracy.md', 'costs.md', 'privacy.md'):
    text = open(os.path.join(out, page)).read()
    assert text.startswith('# ') and text.count('different partitions') == 1, page
    line = [l for l in text.split('\n') if l.startswith('- cifar10')]
    assert len(line) == 1 and 'seed 0: 2 partitions' in line[0], page
    assert 'bbbb (2 runs: dp, dp2; data_dir /d/x.npz)' in line[0], line[0]
    assert 'aaaa (1 run: ideal; data_dir /d/tfds)' in line[0], line[0]
  # One partition per (setting, seed): nothing to say.
  assert report.partition_mismatches(
      [r for r in runs.load_runs(root)[0] if os.path.basename(r.path) != 'ideal']) == []


def test_a_diverged_run_is_a_cell_of_the_privacy_table_and_listed(tmp_path):
  """A run that diverged (diverged.json, no summary.json) is 'diverged (round N)' in its privacy
  cell, not '—' (a run never made); a cell where other seeds finished keeps their accuracy; the
  accuracy tables list it; load_runs keeps its two lists, without it."""
  root = str(tmp_path)
  up = lambda e: {'privacy.upload': True, 'privacy.upload_clip': 0.03,
                  'privacy.upload_noise_multiplier': 0.0, 'privacy.upload_target_epsilon': e}
  write_run(root, 'ideal', accs=(0.5, 0.80))
  write_run(root, 'proto', method='fedproto', accs=(0.5, 0.70))
  write_run(root, 'u1', accs=(0.5, 0.60), overrides=up(1.0),
            summary_extra={'dp_upload_epsilon': 1.0})
  write_run(root, 'proto_u1', method='fedproto', accs=(0.1,), overrides=up(1.0),
            diverged=diverged_at(2))
  write_run(root, 'proto_u4', method='fedproto', accs=(0.5, 0.65), overrides=up(4.0),
            summary_extra={'dp_upload_epsilon': 3.9})
  write_run(root, 'proto_u4s1', method='fedproto', seed=1, accs=(0.2, 0.3), overrides=up(4.0),
            diverged=diverged_at(3))
  finished, diverged, unfinished = runs.load_sweep(root)
  assert sorted(os.path.basename(r.path) for r in diverged) == ['proto_u1', 'proto_u4s1']
  assert [r.diverged['round'] for r in diverged] == [2, 3] and not unfinished
  assert all(r.summary == {} and r.method == 'fedproto' for r in diverged)
  assert runs.load_runs(root) == (finished, [])
  text = report.privacy_tables(report.privacy_series(finished + diverged))
  assert '| method | ε = 1 | ε = 4 | ε = ∞ |' in text
  assert '| fedssa | 60.00 (ε 1) | — | 80.00 |' in text
  assert '| fedproto | diverged (round 2) | 65.00 (ε 3.9); 1 of 2 seeds diverged (round 3) | ' \
      '70.00 |' in text
  assert 'diverged (round N): the cell\'s runs stopped with a DivergenceError' in text
  accuracy = report.accuracy_tables(runs.by_setting_and_method(finished), diverged)
  assert ('Diverged, left out (each folder\'s diverged.json says why): fedproto on cifar10 '
          'N=10, C=100% upload DP, local clip 0.03 ε 1 hetero, seed 0 (round 2); fedproto on '
          'cifar10 N=10, C=100% upload DP, local clip 0.03 ε 4 hetero, seed 1 (round 3).') \
      in accuracy
  # Without diverged runs, neither says a word of them.
  assert 'diverged' not in report.privacy_tables(report.privacy_series(finished))
  assert 'Diverged' not in report.accuracy_tables(runs.by_setting_and_method(finished))


def test_method_labels_read_each_methods_own_section():
  """A label names the options of its method's own config section (Method.config_section),
  whatever the method, and every registered method has a colour of its own."""
  c = config_lib.build('cifar10', 'hetero,n10')
  for method, field, value in (('fedgh', 'eval', 'post_train'), ('fedtgp', 'lam', 1.0)):
    c.method = method
    d = c.to_dict()
    assert runs.method_label(d, 'hetero') == method
    d['fedproto']['lam'] = 2.0  # another method's section: not this one's label
    d[method][field] = value
    assert runs.method_label(d, 'hetero') == f'{method} ({field}={value})'
  styles = plots.line_styles(list(runs.METHOD_ORDER))
  assert len({s['color'] for s in styles.values()}) == len(runs.METHOD_ORDER)


def test_line_styles_variants_take_their_methods_colour_dashed():
  styles = plots.line_styles(['fedssa', 'fedssa (mu0=0.0)', 'fedssa (scope=participants)',
                               'standalone', 'standalone (lr=0.01)'])
  assert styles['fedssa']['linestyle'] == '-' and styles['standalone']['linestyle'] == '-'
  assert styles['fedssa (mu0=0.0)']['color'] == styles['fedssa']['color']
  assert styles['fedssa']['color'] != styles['standalone']['color']
  assert {styles['fedssa (mu0=0.0)']['linestyle'],
          styles['fedssa (scope=participants)']['linestyle']} == {'--', ':'}
  assert styles['standalone (lr=0.01)']['linestyle'] == '--'


def test_plots_and_index(sweep):
  index = report.write_report(sweep)
  out = os.path.dirname(index)
  text = open(index).read()
  assert ('10 finished runs in 3 settings; 1 diverged (not in the accuracy and cost tables; each '
          'folder\'s diverged.json says why): ../f1 (round 2); 1 not finished (left out): ../e0.') \
      in text
  pngs = sorted(f for f in os.listdir(out) if f.endswith('.png'))
  assert 'robustness_k_cifar10_hetero_n100_c0.1.png' in pngs
  assert len([p for p in pngs if p.startswith('rounds_')]) == 3
  assert len([p for p in pngs if p.startswith('boxes_')]) == 3
  assert len([p for p in pngs if p.startswith('training_')]) == 3
  for p in pngs:
    assert f'({p})' in text
    assert open(os.path.join(out, p), 'rb').read(8) == b'\x89PNG\r\n\x1a\n'
  assert '(accuracy.md)' in text and '(costs.md)' in text


def test_the_lens_is_drawn_for_the_settings_that_recorded_it(tmp_path, monkeypatch):
  root = str(tmp_path)
  write_run(root, 'a', variants='hetero,n1000', accs=(0.2, 0.3), records_extra={
      'worst10_accuracy': (0.05, 0.1), 'global_accuracy': (0.1, 0.15),
      'global_unseen_accuracy': (0.0, 0.02), 'new_client_accuracy': (None, 0.25)})
  write_run(root, 'b', method='standalone', variants='hetero,n1000', accs=(0.2, 0.25),
            records_extra={'worst10_accuracy': (0.04, 0.08)})  # no global or new clients
  write_run(root, 'c', accs=(0.5, 0.7), records_extra={'worst10_accuracy': (0.4, 0.6)})
  grouped = runs.by_setting_and_method(runs.load_runs(root)[0])
  n1000 = next(s for s in grouped if '_n1000_' in s.slug)
  index = open(report.write_report(root)).read()
  links = [w.split(')')[0] for w in index.split('(') if w.startswith('lens_')]
  assert links == [f'lens_{n1000.slug}.png']  # n10 recorded no global accuracy
  assert os.path.exists(tmp_path / 'report' / links[0])
  figures = []
  monkeypatch.setattr(plots, '_save', lambda fig, path: figures.append(fig) or path)
  plots.plot_lens_curves(n1000, grouped[n1000], 'unused.png')
  panels = [{l.get_label(): (list(l.get_xdata()), list(l.get_ydata())) for l in ax.lines}
            for ax in figures[0].axes]
  assert panels[0] == {'fedssa': ([1, 2], [20.0, 30.0]), 'standalone': ([1, 2], [20.0, 25.0])}
  assert panels[1] == {'fedssa': ([1, 2], [5.0, 10.0]), 'standalone': ([1, 2], [4.0, 8.0])}
  assert panels[2] == {'fedssa': ([1, 2], [10.0, 15.0])}
  assert panels[3] == {'fedssa': ([1, 2], [0.0, 2.0])}
  assert panels[4] == {'fedssa': ([2], [25.0])}  # the rounds that recorded it


def test_series_keeps_the_rounds_every_run_recorded():
  recorded = [runs.Run(path='', config={}, derived={}, summary={}, metrics=m, setting=None,
                         method='fedssa', seed=s)
          for s, m in enumerate([
              [{'round': 1, 'header_norm_max': 2.0}, {'round': 2, 'header_norm_max': 4.0},
               {'round': 3, 'header_norm_max': 8.0}],
              [{'round': 2, 'header_norm_max': 6.0}, {'round': 3, 'header_norm_max': None},
               {'round': 4, 'header_norm_max': 1.0}]])]
  rounds, values = plots.series(recorded, 'header_norm_max')
  assert rounds == [2] and values.tolist() == [[4.0], [6.0]]
  assert plots.series(recorded, 'train_loss')[0] == []


def test_box_plots_show_fedssa_and_the_two_best_others():
  summaries = {m: [type('R', (), {'summary': {'final_mean_accuracy': a}})()]
               for m, a in (('fedssa', 0.5), ('fd', 0.9), ('fml', 0.1), ('fedkd', 0.8))}
  assert plots.boxplot_methods(summaries) == ['fedssa', 'fd', 'fedkd']
  # Variants (ablations, controls) are not "other methods".
  summaries['fedssa (mu0=0.0)'] = summaries['fd (lam=2.0)'] = summaries['fd'] * 2
  assert plots.boxplot_methods(summaries) == ['fedssa', 'fd', 'fedkd']


@pytest.mark.slow  # t-SNE fits and plots
def test_tsne_panels_from_saved_representations(tmp_path):
  rng = np.random.default_rng(0)
  for m in ('fedssa', 'fedproto'):
    d = write_run(str(tmp_path), m, method=m, derived={'client_family': ['cnn1', 'cnn2']})
    labels = np.repeat(np.arange(4), 15)
    reps = (labels[:, None] * 3 + rng.normal(size=(60, 500))).astype(np.float16)
    np.savez(os.path.join(d, evaluation.REPRESENTATIONS_FILE), representations=reps, labels=labels,
             client=np.arange(60, dtype=np.int32) % 2)
  text = open(report.write_report(str(tmp_path))).read()
  assert '[cifar10 N=10, C=100% hetero, seed 0: fedssa, fedproto](tsne_cifar10_hetero_n10_c1_s0.png)' \
      in text
  assert os.path.exists(tmp_path / 'report' / 'tsne_cifar10_hetero_n10_c1_s0.png')


def test_no_runs_names_the_fix(tmp_path):
  with pytest.raises(FileNotFoundError, match='Run the sweep first'):
    report.write_report(str(tmp_path))
