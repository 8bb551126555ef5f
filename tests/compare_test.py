"""fedssa_jax.run.compare: the table's cells from hand-made summaries, and run_comparison's runs,
reuse of finished runs, --rerun and early failure on a typo; a real comparison through its
command line, with main's quiet console."""
import json
import os
import re
import sys

from absl import flags
import pytest

from fedssa_jax import config_lib, data
from fedssa_jax.run import compare, console, train

from conftest import synthetic_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def summary(method, final, best, best_round, clients, to_target, up, down, rounds, wall):
  return {'method': method, 'dataset': 'cifar10', 'rounds': rounds, 'final_mean_accuracy': final,
          'best_mean_accuracy': best, 'best_round': best_round, 'final_client_accuracy': clients,
          'target_accuracy': 0.5, 'to_target': to_target, 'cum_up_floats': up,
          'cum_down_floats': down, 'cum_client_flops': 9e12, 'seconds_per_round_steady': 1.0,
          'first_round_seconds': 2.0, 'wall_seconds': wall}


SUMMARIES = {
    'fedssa': summary('fedssa', 0.73571, 0.74, 4, [0.1, 0.2, 0.3, 0.4, 0.5],
                      {'round': 3, 'cum_floats': 1234567.0, 'cum_client_flops': 2.5e12},
                      600_000.0, 400_000.0, 5, 61.4),
    'standalone': summary('standalone', 0.5, 0.625, 2, [0.0, 1.0], None, 0.0, 0.0, 4, 12.6),
}


def test_table_rows_equal_hand_computed_cells():
  fedssa, standalone = compare.table_rows(SUMMARIES)
  assert fedssa == ['fedssa', '0.7357', '0.7400 (4)', '0.200 / 0.300 / 0.400', '3', '1.23e+06',
                    '2.5e+12', '2e+05', '61']  # floats per round: (6e5 + 4e5) / 5 rounds
  # Never at target: dashes; quantiles of two clients interpolate between them.
  assert standalone == ['standalone', '0.5000', '0.6250 (2)', '0.250 / 0.500 / 0.750', '—',
                        '—', '—', '0', '13']
  assert len(fedssa) == len(compare.COLUMNS)


def test_markdown_table_lists_the_methods_in_order_under_the_columns():
  text = compare.markdown_table({k: SUMMARIES[k] for k in ('standalone', 'fedssa')}, 0.5)
  lines = text.splitlines()
  assert lines[0] == '| ' + ' | '.join(compare.COLUMNS) + ' |'
  assert lines[1] == '|' + '---|' * len(compare.COLUMNS)
  assert lines[2].startswith('| standalone | 0.5000 | 0.6250 (2) |')
  assert lines[3] == ('| fedssa | 0.7357 | 0.7400 (4) | 0.200 / 0.300 / 0.400 | 3 | 1.23e+06 | '
                      '2.5e+12 | 2e+05 | 61 |')
  assert 'mean accuracy >= 0.5' in lines[-1] and text.endswith('\n')


@pytest.fixture
def fake_runs(monkeypatch):
  """train.train_and_evaluate and data.load_dataset replaced by fakes that record their calls;
  a fake run writes the method's hand-made summary."""
  calls = {'load': 0, 'runs': []}

  def load_dataset(name, data_dir=None, download=False, image_size=0):
    calls['load'] += 1
    return ('dataset', name)

  def train_and_evaluate(config, workdir, dataset=None, stop=None):
    assert dataset == ('dataset', 'cifar10')
    calls['runs'].append((config.method, workdir))
    calls.setdefault('stops', []).append(stop)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, 'summary.json'), 'w') as f:
      json.dump(SUMMARIES[config.method], f)

  monkeypatch.setattr(data, 'load_dataset', load_dataset)
  monkeypatch.setattr(train, 'train_and_evaluate', train_and_evaluate)
  return calls


def test_run_comparison_runs_each_method_once_and_writes_the_table(tmp_path, fake_runs):
  config = config_lib.build('cifar10', 'hetero,tiny')
  workdir = str(tmp_path / 'cmp')
  text = compare.run_comparison(config, workdir, ['fedssa', 'standalone'])
  assert fake_runs == {'load': 1, 'runs': [('fedssa', os.path.join(workdir, 'fedssa')),
                                           ('standalone', os.path.join(workdir, 'standalone'))],
                       'stops': [None, None]}  # a library call: no stop requests
  assert config.method == 'fedssa'  # each run has its own copy of the config
  assert text == compare.markdown_table(SUMMARIES, config.target_accuracy)
  assert open(os.path.join(workdir, 'comparison.md')).read() == text
  # Finished runs are read, not run again; --rerun runs them again.
  assert compare.run_comparison(config, workdir, ['standalone', 'fedssa']) == (
      compare.markdown_table({k: SUMMARIES[k] for k in ('standalone', 'fedssa')},
                             config.target_accuracy))
  assert fake_runs['load'] == 1 and len(fake_runs['runs']) == 2
  stop = console.StopRequests()  # passed on to the run, as the command line does
  compare.run_comparison(config, workdir, ['standalone'], rerun=True, stop=stop)
  assert fake_runs['load'] == 2 and fake_runs['runs'][-1][0] == 'standalone'
  assert fake_runs['stops'][-1] is stop


def test_a_misspelled_method_fails_before_any_run(tmp_path, fake_runs):
  workdir = str(tmp_path / 'cmp')
  with pytest.raises(ValueError, match="Unknown method 'fedsaa'"):
    compare.run_comparison(config_lib.build('cifar10', 'hetero,tiny'), workdir,
                           ['fedssa', 'fedsaa'])
  assert fake_runs == {'load': 0, 'runs': []} and not os.path.exists(workdir)


@pytest.mark.slow  # two whole runs, compiled
def test_a_real_comparison_tabulates_the_runs_summaries(tmp_path, monkeypatch, capfd):
  """Through the command line (compare.main after absl's parsing), whose console is main's:
  this package's lines only, none of orbax's INFO dumps or absl's prefixed lines."""
  ds = synthetic_dataset()
  monkeypatch.setattr(data, 'load_dataset', lambda *args: ds)
  config = config_lib.build('cifar10', 'hetero,tiny')
  config.model.families, config.num_rounds = ('cnn5',), 1
  workdir = str(tmp_path / 'cmp')
  argv = ['fedssa_jax.run.compare', f'--config={ROOT}/configs/tiny.py', f'--workdir={workdir}',
          '--methods=standalone,fedssa', '--config.model.families=("cnn5",)',
          '--config.num_rounds=1']
  monkeypatch.setattr(sys, 'argv', argv)  # config_flags reads the --config.* overrides there
  flag_values = flags.FlagValues()
  compare.define_flags(flag_values)
  compare.main(flag_values(argv), flag_values)
  out, err = capfd.readouterr()
  text = open(os.path.join(workdir, 'comparison.md')).read()
  assert text in out
  lines = err.splitlines()
  assert '=== fedssa ===' in lines and any(l.startswith('round 1/1: mean acc') for l in lines)
  absl_prefixed = re.compile(r'^[IWEF]\d{4} ')  # absl's 'I0101 12:00:00.000 ...' lines
  assert not [l for l in lines if 'orbax' in l.lower() or absl_prefixed.match(l)], err
  summaries = {}
  for m in ('standalone', 'fedssa'):
    with open(os.path.join(workdir, m, 'summary.json')) as f:
      summaries[m] = json.load(f)
    assert summaries[m]['method'] == m and summaries[m]['rounds'] == 1
  assert text == compare.markdown_table(summaries, config.target_accuracy)
  assert summaries['standalone']['cum_up_floats'] == 0 < summaries['fedssa']['cum_up_floats']
