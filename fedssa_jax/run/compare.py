"""Runs several methods on one config and seed, and tabulates them side by side.

  python -m fedssa_jax.run.compare --config=configs/cifar10.py:hetero,n10 --workdir=runs/cmp \
      --methods=fedssa,standalone,fd,fedproto,fml,fedkd,lg_fedavg,fedclassavg \
      --config.num_rounds=20 --config.local_epochs=1

Every method runs with the same data, partition, models, seed and evaluation, each in
`workdir/<method>/` (the usual run outputs). A method whose summary.json exists is not run again
(pass --rerun to force), so an interrupted comparison continues where it stopped. The table goes
to `workdir/comparison.md` and the console.

The console is main's (fedssa_jax/run/console.py): quiet unless --verbose or FEDSSA_VERBOSE=1.
SIGTERM or SIGINT stop the method being run after its current round and its checkpoint, with
exit status 75 (train.EXIT_PREEMPTED); the same command then resumes it and runs the rest.
"""
from __future__ import annotations

import sys

from fedssa_jax.run import console

if __name__ == '__main__' and not console.verbose_requested(sys.argv):
  console.import_tensorflow_quietly()

# pylint: disable=g-import-not-at-top,wrong-import-position
import json
import os

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags
import numpy as np

from fedssa_jax import config_lib, data, methods
from fedssa_jax.run import report, train

COLUMNS = ('method', 'final acc', 'best acc (round)', 'client acc q25 / median / q75',
           'rounds to target', 'floats to target', 'client FLOPs to target',
           'floats per round', 'wall s')


def table_rows(summaries: dict[str, dict]) -> list[list[str]]:
  """One row per method, from its summary.json (see train.SUMMARY_FIELDS)."""
  rows = []
  for name, s in summaries.items():
    q = np.quantile(s['final_client_accuracy'], [0.25, 0.5, 0.75])
    to = s['to_target'] or {}
    floats = s['cum_up_floats'] + s['cum_down_floats']
    rows.append([
        name, f"{s['final_mean_accuracy']:.4f}",
        f"{s['best_mean_accuracy']:.4f} ({s['best_round']})",
        ' / '.join(f'{v:.3f}' for v in q),
        str(to.get('round', '—')), report.sci(to.get('cum_floats')),
        report.sci(to.get('cum_client_flops')), report.sci(floats / max(s['rounds'], 1)),
        f"{s['wall_seconds']:.0f}"])
  return rows


def markdown_table(summaries: dict[str, dict], target: float) -> str:
  lines = [report.markdown_table(COLUMNS, table_rows(summaries))]
  lines.append(f'Accuracies are the unweighted mean over clients of per-sample test accuracy; '
               f'"to target" is the first evaluated round with mean accuracy >= {target}, and '
               'costs are cumulative up to it (— if never reached). Floats count both '
               'directions.')
  return '\n'.join(lines) + '\n'


def run_comparison(config, workdir: str, method_names, rerun: bool = False, stop=None) -> str:
  """Runs each method (unless done) and returns the markdown table, also written to disk.
  `stop` as in train.train_and_evaluate (None: never asked)."""
  for m in method_names:
    methods.get_method(m)  # fail before any compute on a typo
  config_lib.validate(config)
  os.makedirs(workdir, exist_ok=True)
  ds = None
  summaries = {}
  for m in method_names:
    run_dir = os.path.join(workdir, m)
    path = os.path.join(run_dir, 'summary.json')
    if rerun or not os.path.exists(path):
      if ds is None:
        ds = data.load_dataset(config.dataset, config.data_dir, config.download,
                               config.image_size)
      c = config.copy_and_resolve_references()
      c.method = m
      logging.info('=== %s ===', m)
      train.train_and_evaluate(c, run_dir, dataset=ds, stop=stop)
    with open(path) as f:
      summaries[m] = json.load(f)
  text = markdown_table(summaries, config.target_accuracy)
  with open(os.path.join(workdir, 'comparison.md'), 'w') as f:
    f.write(text)
  return text


def define_flags(flag_values: flags.FlagValues) -> None:
  config_flags.DEFINE_config_file('config', None, 'Config file, with an optional :variant.',
                                  lock_config=True, flag_values=flag_values)
  flags.DEFINE_string('workdir', None, 'Folder for the runs and comparison.md.',
                      flag_values=flag_values)
  flags.DEFINE_list('methods', ['fedssa', 'standalone'], 'Methods to compare, in table order.',
                    flag_values=flag_values)
  flags.DEFINE_bool('rerun', False, 'Run methods again even if their summary.json exists.',
                    flag_values=flag_values)
  flags.DEFINE_bool('verbose', False, 'Every library\'s logs (also FEDSSA_VERBOSE=1).',
                    flag_values=flag_values)
  flags.mark_flags_as_required(['config', 'workdir'], flag_values=flag_values)


def main(argv, flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """The command line, once absl has parsed `flag_values`: main's console (quiet unless
  --verbose or FEDSSA_VERBOSE=1) and stop requests around the comparison."""
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  f = flag_values
  with console.configured(f.verbose or console.verbose_requested(sys.argv)):
    try:
      with console.StopRequests() as stop:
        text = run_comparison(f.config, f.workdir, f.methods, f.rerun, stop)
    except train.Preempted as e:
      logging.warning('%s', e)
      sys.exit(train.EXIT_PREEMPTED)
  print(text, flush=True)


if __name__ == '__main__':
  define_flags(flags.FLAGS)
  app.run(main)
