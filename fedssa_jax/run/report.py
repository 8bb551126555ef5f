"""Tables and plots of a sweep's runs, shaped like the paper's.

  python -m fedssa_jax.run.report --sweep_dir=runs/sweeps/table2

Reads every run folder under `sweep_dir` (any folder holding config.json and summary.json; see
docs/outputs.md) and writes into `<sweep_dir>/report/` (runs that diverged, whose folder holds
diverged.json instead, are listed in index.md and accuracy.md, and privacy.md shows their cells
as `diverged (round N)`):

- accuracy.md   per model setting (homogeneous: Table 1, heterogeneous: Table 2), rows methods,
                columns data set x (N, C) x partition; the final and the best mean test
                accuracy in %, mean ± std over seeds, the best mean per column in bold;
- privacy.md    where runs ran under differential privacy: per setting and mechanism (DP-SGD,
                upload DP local or central), rows methods, columns the target epsilons and
                epsilon = infinity (the same setting's run without it); the final mean accuracy
                and the epsilon each run reached, and the s/round against the run without;
                with a plot of accuracy against epsilon each;
- costs.md      per setting, rounds, floats and client FLOPs to the target accuracy (the runs'
                target_accuracy, or --target), and how many times more each baseline needs
                than FedSSA;
- PNG plots     accuracy against rounds per setting; per-client accuracy box plots per setting
                (FedSSA and the two best other methods); accuracy, train loss and header-row
                norms against rounds per setting; robustness curves where a setting
                varies only in classes per client or Dirichlet gamma; t-SNE panels of the saved
                representations (runs with save_representations=True);
- lens.md       per setting, the final round's spread, worst decile, global accuracy, new
                clients' accuracy and participation gap (run/lens.py)
- tuned.md      where runs evaluated their validation splits (eval_validation): per method and
                budget, the (clip, lr) chosen on validation and its test accuracy (run/tuning.py)
- index.md      links to all of them.

Runs of one setting and seed that hold different partitions (their config.json's
derived.partition_fingerprint: other data, or the same data set from a source in another
order) are named in a warning at the top of every page and on the console.

A setting is read from each run's config.json; a method's label adds its own options that
differ from the defaults (e.g. `fedssa (mu0=0.0)` for the ablation), so that variations are
rows of their own.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import os
import sys

from absl import app
from absl import flags
import numpy as np

from fedssa_jax.engine import evaluation
from fedssa_jax.run import lens, tuning
from fedssa_jax.run.tables import markdown_table, mean_std, sci  # pylint: disable=unused-import
from fedssa_jax.run.plots import (has_lens_curves, plot_accuracy_vs_epsilon,
                                  plot_accuracy_vs_rounds, plot_accuracy_vs_sim_time,
                                  plot_client_boxes, plot_lens_curves, plot_robustness,
                                  plot_training_curves, plot_tsne, robustness_series)
from fedssa_jax.run.runs import (METHOD_ORDER, REFERENCE_METHOD, _method_key, backend_of, by_setting_and_method,
                                 file_part, has_clock, load_sweep, privacy_budget, reached,
                                 reached_epsilon)


# ----------------------------------------------------------------------------------------------
# Markdown helpers (also used by fedssa_jax.run.compare)
# ----------------------------------------------------------------------------------------------

# ----------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------

MODEL_TITLES = {'homo': 'Model-homogeneous (every client CNN-1), cf. the paper\'s Table 1',
                'hetero': 'Model-heterogeneous (CNN-1..5), cf. the paper\'s Table 2'}


ACCURACIES = (('final_mean_accuracy', 'Final', 'the final round\'s'),
              ('best_mean_accuracy', 'Best', 'the best evaluated round\'s'))


def accuracy_tables(grouped, diverged=()) -> str:
  """Per model setting: rows methods, columns settings, the final and the best mean accuracy
  (%), mean ± std over seeds; the `diverged` runs listed above them."""
  out = ['# Mean test accuracy (%)', '',
         'The mean over clients of per-client test accuracy, at the final round and at the '
         'best evaluated round of each run; mean ± sample std over seeds (n seeds in the last '
         'column), the best mean per column in **bold**.', '']
  if diverged:
    out += [f'Diverged, left out (each folder\'s diverged.json says why): '
            f'{diverged_list(diverged)}.', '']
  for key, title, which in ACCURACIES:
    out += _accuracy_tables(grouped, key, f'{title}: {which} mean accuracy')
  return '\n'.join(out)


def _accuracy_tables(grouped, key: str, title: str) -> list[str]:
  out = []
  for models in ('homo', 'hetero'):
    settings = [s for s in grouped if s.models == models]
    if not settings:
      continue
    methods = sorted({m for s in settings for m in grouped[s]}, key=_method_key)
    best = {s: max(np.mean([r.summary[key] for r in rs])
                   for rs in grouped[s].values()) for s in settings}
    rows = []
    for m in methods:
      cells, seeds = [], set()
      for s in settings:
        rs = grouped[s].get(m)
        if not rs:
          cells.append('—')
          continue
        accs = [r.summary[key] for r in rs]
        seeds.add(len(rs))
        text = mean_std(accs)
        cells.append(f'**{text}**' if np.isclose(np.mean(accs), best[s]) else text)
      rows.append([m, *cells, '/'.join(str(n) for n in sorted(seeds))])
    out += [f'## {title}. {MODEL_TITLES[models]}', '',
            markdown_table(['method', *(s.column for s in settings), 'seeds'], rows), '']
  return out


def diverged_list(diverged) -> str:
  """'method on setting, seed s (round N)' of each run that diverged, in table order."""
  key = lambda r: (r.setting.sort_key(), _method_key(r.method), r.seed)
  return '; '.join(f'{r.method} on {r.setting.label}, seed {r.seed} (round '
                   f'{r.diverged.get("round", "?")})' for r in sorted(diverged, key=key))


def diverged_cell(rs) -> str:
  """A table cell's note of its runs that diverged: 'diverged (round 2)'; '1 of 3 seeds diverged
  (round 2)' where others finished."""
  failed = [r for r in rs if r.diverged is not None]
  rounds = sorted({r.diverged.get('round') for r in failed}, key=lambda n: n or 0)
  where = (f'round{"s" if len(rounds) > 1 else ""} '
           f'{", ".join("?" if n is None else str(n) for n in rounds)}')
  if len(failed) == len(rs):
    return f'diverged ({where})'
  return f'{len(failed)} of {len(rs)} seeds diverged ({where})'


def _to_target(rs, key, target=None):
  """Mean over the seeds that reached the target of their cost `key`, and how many did."""
  vals = [c[key] for c in (reached(r, target) for r in rs) if c and key in c]
  return (float(np.mean(vals)) if vals else None), len(vals)


def ratio_text(baseline, reference) -> str:
  return '—' if baseline is None or reference is None or reference == 0 else \
      f'{baseline / reference:.2f}×'


def costs_tables(grouped, target: float | None = None) -> str:
  """Per setting: rounds, floats and FLOPs to target (the runs' own target_accuracy, or
  `target`), and baseline / FedSSA ratios."""
  out = ['# Communication and computation to the target accuracy', '',
         'Costs at the first evaluated round whose mean accuracy reaches the target, '
         'cumulative over the run (floats up + down; client FLOPs of training and fusion), '
         'averaged over the seeds that reached it ("reached" counts them). A ratio is the '
         'baseline\'s mean cost divided by FedSSA\'s: how many times more the baseline needs '
         '(— where either never reached the target).', '']
  for s, methods in grouped.items():
    shown = target or next(iter(methods.values()))[0].summary['target_accuracy']
    ref = methods.get(REFERENCE_METHOD)
    ref_floats = _to_target(ref, 'cum_floats', target)[0] if ref else None
    ref_flops = _to_target(ref, 'cum_client_flops', target)[0] if ref else None
    # With the system section's clock: the simulated seconds to the target too.
    clock = any(has_clock(r) for rs in methods.values() for r in rs)
    ref_sim = _to_target(ref, 'cum_sim_seconds', target)[0] if ref and clock else None
    rows = []
    for m, rs in methods.items():
      rounds, hits = _to_target(rs, 'round', target)
      floats, _ = _to_target(rs, 'cum_floats', target)
      flops, _ = _to_target(rs, 'cum_client_flops', target)
      row = [m, f'{hits}/{len(rs)}', sci(rounds), sci(floats), sci(flops),
             ratio_text(floats, ref_floats), ratio_text(flops, ref_flops)]
      if clock:
        sim, _ = _to_target(rs, 'cum_sim_seconds', target)
        row += [sci(sim), ratio_text(sim, ref_sim)]
      rows.append(row)
    columns = ['method', 'reached', 'rounds', 'floats', 'client FLOPs', 'floats / FedSSA\'s',
               'FLOPs / FedSSA\'s']
    if clock:
      columns += ['simulated s', 'simulated s / FedSSA\'s']
    out += [f'## {s.label}, target {shown * 100:g}%', '', markdown_table(columns, rows)]
  return '\n'.join(out)


# ----------------------------------------------------------------------------------------------
# Runs that should share a federation
# ----------------------------------------------------------------------------------------------

def partition_mismatches(runs) -> list[str]:
  """One line for each (setting, seed) whose runs hold more than one partition (their
  config.json's derived.partition_fingerprint). The system and privacy sections leave the
  partition alone, so a setting's runs with and without them should share it; runs that do not
  were made on other data (the same data set from another source, e.g. an .npz and a TFDS
  data_dir, whose images come in other orders) or other code, and a table that sets them side
  by side compares two federations."""
  groups = collections.defaultdict(lambda: collections.defaultdict(list))
  for r in runs:
    fp = r.derived.get('partition_fingerprint')
    if fp:
      base = dataclasses.replace(r.setting, system='', privacy='')
      groups[(base, r.seed)][fp].append(r)
  lines = []
  for (base, seed), by_fp in sorted(groups.items(), key=lambda kv: (kv[0][0].sort_key(),
                                                                    kv[0][1])):
    if len(by_fp) > 1:
      parts = [f'{fp} ({len(rs)} run{"s" if len(rs) > 1 else ""}: '
               + ', '.join(os.path.basename(r.path) for r in rs[:3])
               + (', ...' if len(rs) > 3 else '') + '; data_dir '
               + ', '.join(sorted({str(r.config.get('data_dir')) for r in rs})) + ')'
               for fp, rs in sorted(by_fp.items(), key=lambda kv: -len(kv[1]))]
      lines.append(f'{base.label}, seed {seed}: {len(by_fp)} partitions, '
                   + '; '.join(parts))
  return lines


def mismatch_note(lines) -> list[str]:
  """The warning a report's pages open with where `partition_mismatches` found some."""
  if not lines:
    return []
  return ['**Warning: runs of one setting and seed hold different partitions** (config.json, '
          'derived.partition_fingerprint), so the tables set different federations side by '
          'side. Rerun one side on the other\'s data (data_dir) before comparing them:', '',
          *[f'- {line}' for line in lines], '']


# ----------------------------------------------------------------------------------------------
# Differential privacy
# ----------------------------------------------------------------------------------------------

def privacy_series(runs) -> dict[tuple, dict[str, dict]]:
  """(setting without the privacy section, mechanism) -> method -> {epsilon: runs}, the
  epsilons of the runs' budgets (their target, or for a noise multiplier given instead, the
  epsilon the first seed's run reached) and math.inf for that setting's runs without
  differential privacy. Only settings with a private run are kept. Runs that diverged may be
  among `runs` (privacy_tables shows them); one with a noise multiplier given that diverged
  before any record has no epsilon, and no place."""
  plain = collections.defaultdict(list)   # (setting, method) -> runs without DP
  private = collections.defaultdict(lambda: collections.defaultdict(
      lambda: collections.defaultdict(list)))
  for r in runs:
    budget = privacy_budget(r.config)
    if budget is None:
      plain[(r.setting, r.method)].append(r)
      continue
    base = dataclasses.replace(r.setting, privacy='')
    eps = budget.target if budget.target else reached_epsilon(r)
    if eps is None and r.diverged is not None:
      continue
    private[(base, budget.mechanism)][r.method][eps].append(r)
  out = {}
  for key in sorted(private, key=lambda k: (k[0].sort_key(), k[1])):
    base, _ = key
    methods = {}
    for m in sorted(private[key], key=_method_key):
      points = dict(private[key][m])
      if plain.get((base, m)):
        points[math.inf] = plain[(base, m)]
      methods[m] = {e: sorted(points[e], key=lambda r: r.seed) for e in sorted(points)}
    out[key] = methods
  return out


def privacy_tables(series) -> str:
  """Per setting and mechanism: the final mean accuracy (%) at each epsilon, mean ± std over
  seeds, with the largest epsilon the runs reached, or 'diverged (round N)' where they diverged;
  then each method's steady s/round with and without differential privacy."""
  out = ['# Under differential privacy', '',
         'Final mean accuracy (%), mean ± sample std over seeds, at each privacy budget: the '
         'target epsilon the noise was calibrated to (at the runs\' delta), and in brackets the '
         'largest epsilon a run reached (its most exposed client\'s). ε = ∞: the same setting '
         'without differential privacy. s/round: the steady seconds a round, the private runs\' '
         'mean over the budgets against the run without, each backend apart (a run\'s '
         'config.json, derived.backend).', '']
  if any(r.diverged is not None for methods in series.values() for points in methods.values()
         for rs in points.values() for r in rs):
    out += ['diverged (round N): the cell\'s runs stopped with a DivergenceError in round N '
            '(each folder\'s diverged.json says why); where some seeds did not, the accuracy is '
            'of those.', '']
  for (base, mechanism), methods in series.items():
    budgets = sorted({e for points in methods.values() for e in points})
    rows, speed = [], []
    lens_keys = [(k, title) for k, title in PRIVACY_LENS if any(
        r.summary.get(k) is not None for points in methods.values() for rs in points.values()
        for r in rs if r.diverged is None)]
    lens_rows = {k: [] for k, _ in lens_keys}
    for m, points in methods.items():
      rows.append([m, *(_privacy_cell(points.get(e), e, 'final_mean_accuracy')
                        for e in budgets)])
      for k, _ in lens_keys:
        lens_rows[k].append([m, *(_privacy_cell(points.get(e), e, k) for e in budgets)])
      for backend in sorted({backend_of(r) for rs in points.values() for r in rs}):
        steady = lambda rs: [r.summary.get('seconds_per_round_steady') for r in rs
                             if backend_of(r) == backend]
        priv = [t for e, rs in points.items() if e != math.inf for t in steady(rs) if t]
        base_t = [t for t in steady(points.get(math.inf, [])) if t]
        if priv:
          ratio = (f'{np.mean(priv) / np.mean(base_t):.2f}×' if base_t else '—')
          speed.append([m, backend, f'{np.mean(base_t):.1f}' if base_t else '—',
                        f'{np.mean(priv):.1f}', ratio])
    names = ['ε = ∞' if e == math.inf else f'ε = {e:.3g}' for e in budgets]
    out += [f'## {base.label}, {mechanism}', '', markdown_table(['method', *names], rows)]
    for k, title in lens_keys:
      out += [f'{title} (%), the same runs:', '', markdown_table(['method', *names], lens_rows[k])]
    out += [markdown_table(['method', 'backend', 's/round, ε = ∞', 's/round, private',
                            'private / ∞'], speed), '']
  return '\n'.join(out)


# The lens's final values (docs/outputs.md) that privacy.md tables beside the mean accuracy,
# for a setting whose runs recorded them: what can tell a shared header from noise.
PRIVACY_LENS = (('final_global_accuracy', 'Global accuracy'),
                ('final_global_unseen_accuracy', 'Global accuracy on the classes a client never '
                 'trained on'),
                ('final_new_client_accuracy', 'New clients\' accuracy'))


def _privacy_cell(rs, eps: float, key: str) -> str:
  """privacy_tables' cell of runs `rs` (the seeds of one method at budget `eps`) for the
  summary's `key` (%, mean ± std over the seeds that finished), with the largest epsilon they
  reached after the mean accuracy, and 'diverged (round N)' for those that diverged."""
  if not rs:
    return '—'
  done = [r for r in rs if r.diverged is None]
  values = [r.summary[key] for r in done if r.summary.get(key) is not None]
  text = mean_std(values) if values else ('—' if done else '')
  if values:
    reached = [x for x in map(reached_epsilon, done) if x is not None]
    if key == 'final_mean_accuracy' and reached and eps != math.inf:
      text += f' (ε {max(reached):.3g})'
  if len(done) < len(rs):
    text += ('; ' if text else '') + diverged_cell(rs)
  return text


# ----------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------

def write_report(sweep_dir: str, out_dir: str | None = None,
                 target: float | None = None) -> str:
  """Writes the tables, plots and index.md; returns the path of index.md. `target`: the mean
  accuracy of the costs table (default: each run's own target_accuracy)."""
  runs, diverged, unfinished = load_sweep(sweep_dir)
  if not runs:
    raise FileNotFoundError(
        f'No finished runs (folders with config.json and summary.json) under {sweep_dir!r}. '
        'Run the sweep first: python launch/sweep.py --sweep=<name> --sweep_dir=' + sweep_dir)
  out_dir = out_dir or os.path.join(sweep_dir, 'report')
  os.makedirs(out_dir, exist_ok=True)
  grouped = by_setting_and_method(runs)

  private = privacy_series(runs + diverged)
  mismatches = partition_mismatches(runs + diverged)
  for line in mismatches:
    print(f'warning: runs of one setting and seed hold different partitions: {line}',
          file=sys.stderr)
  note = mismatch_note(mismatches)
  texts = [('accuracy.md', accuracy_tables(grouped, diverged)),
           ('costs.md', costs_tables(grouped, target)),
           ('lens.md', lens.lens_tables(grouped))]
  if private:
    texts.append(('privacy.md', privacy_tables(private)))
  tuned = tuning.select(tuning.candidates(sweep_dir))
  if tuned:
    texts.append(('tuned.md', tuning.tuned_tables(tuned, METHOD_ORDER)))
  for name, text in texts:
    title, _, rest = text.partition('\n')  # the note goes under each page's title
    with open(os.path.join(out_dir, name), 'w') as f:
      f.write('\n'.join([title, '', *note]) + rest if note else text)

  index = _index_head(sweep_dir, out_dir, runs, grouped, diverged, unfinished, note)
  if private:
    index.append(_privacy_link(runs, out_dir))
  if tuned:
    index.append('- [Tuned on validation: the privacy-utility frontier](tuned.md)')
  index += ['', *_settings_section(grouped, out_dir), *_robustness_section(grouped, out_dir),
            *_tsne_section(runs, out_dir)]
  path = os.path.join(out_dir, 'index.md')
  with open(path, 'w') as f:
    f.write('\n'.join(index))
  return path


def _index_head(sweep_dir, out_dir, runs, grouped, diverged, unfinished, note) -> list[str]:
  """index.md's title, its count of runs (naming those that diverged or did not finish), the
  partition `note`, and the links to the tables."""
  rel = lambda p: os.path.relpath(p, out_dir)
  return [f'# Report of {os.path.abspath(sweep_dir)}', '',
          f'{len(runs)} finished runs in {len(grouped)} settings'
          + (f'; {len(diverged)} diverged (not in the accuracy and cost tables; each '
             'folder\'s diverged.json says why): ' + ', '.join(
                 f'{rel(r.path)} (round {r.diverged.get("round", "?")})' for r in diverged)
             if diverged else '')
          + (f'; {len(unfinished)} not finished (left out): '
             + ', '.join(rel(u) for u in unfinished) if unfinished else '') + '.', '',
          *note,
          '- [Mean test accuracy, Tables 1 and 2](accuracy.md)',
          '- [Communication and computation to the target](costs.md)',
          '- [Beyond the mean: spread, worst decile, global and new clients](lens.md)']


def _privacy_link(runs, out_dir) -> str:
  """index.md's link to privacy.md, with a plot of accuracy against epsilon per setting and
  mechanism of the finished `runs`."""
  plots = []
  for (base, mechanism), methods in privacy_series(runs).items():
    path = plot_accuracy_vs_epsilon(f'{base.label}, {mechanism}', methods, os.path.join(
        out_dir, f'privacy_{base.slug}_{file_part(mechanism)}.png'))
    plots.append(f'[{base.column}, {mechanism}]({os.path.relpath(path, out_dir)})')
  return '- [Under differential privacy](privacy.md)' + (
      '; accuracy against epsilon: ' + ', '.join(plots) if plots else '')


def _settings_section(grouped, out_dir) -> list[str]:
  """index.md's table of the settings, a row each linking its plots (drawn here)."""
  rel = lambda p: f'[png]({os.path.relpath(p, out_dir)})'
  png = lambda kind, s: os.path.join(out_dir, f'{kind}_{s.slug}.png')
  rows = []
  for s, methods in grouped.items():
    rounds = sorted({r.summary['rounds'] for rs in methods.values() for r in rs})
    curves = plot_accuracy_vs_rounds(s, methods, png('rounds', s))
    boxes = plot_client_boxes(s, methods, png('boxes', s))
    training = plot_training_curves(s, methods, png('training', s))
    clock = any(has_clock(r) for rs in methods.values() for r in rs)
    sim = rel(plot_accuracy_vs_sim_time(s, methods, png('simtime', s))) if clock else '—'
    lens_png = (rel(plot_lens_curves(s, methods, png('lens', s)))
                if has_lens_curves(methods) else '—')
    rows.append([s.label, len(methods), '/'.join(map(str, rounds)), rel(curves), rel(boxes),
                 rel(training), sim, lens_png])
  return ['## Per setting', '', markdown_table(
      ['setting', 'methods', 'rounds', 'accuracy against rounds', 'client accuracy boxes',
       'accuracy, train loss and header norms', 'accuracy against simulated time',
       'the lens against rounds (worst decile, global, new clients)'], rows)]


def _robustness_section(grouped, out_dir) -> list[str]:
  """index.md's links to the robustness plots (drawn here), if any setting varies only in
  classes per client or Dirichlet gamma."""
  robust = robustness_series(grouped)
  if not robust:
    return []
  out = ['## Robustness', '']
  for key, methods in robust.items():
    dataset, models, n, c, axis = key
    path = plot_robustness(key, methods, os.path.join(
        out_dir, f'robustness_{axis}_{dataset}_{models}_n{n}_c{c:g}.png'))
    out.append(f'- [{dataset} {models} N={n}, C={c * 100:g}%, against '
               f'{"classes per client" if axis == "k" else "Dirichlet γ"}]'
               f'({os.path.relpath(path, out_dir)})')
  return out + ['']


def _tsne_section(runs, out_dir) -> list[str]:
  """index.md's links to a t-SNE panel (drawn here) per setting and seed whose runs saved their
  test representations, if any did."""
  tsne = collections.defaultdict(dict)  # (setting, seed) -> method -> saved arrays
  families = collections.defaultdict(dict)  # (setting, seed) -> method -> each client's family
  for r in runs:
    path = os.path.join(r.path, evaluation.REPRESENTATIONS_FILE)
    if os.path.exists(path):
      tsne[(r.setting, r.seed)][r.method] = dict(np.load(path))
      if 'client_family' in r.derived:
        families[(r.setting, r.seed)][r.method] = r.derived['client_family']
  if not tsne:
    return []
  out = ['## t-SNE of the test representations', '']
  for (s, seed), reps in sorted(tsne.items(), key=lambda kv: (kv[0][0].sort_key(), kv[0][1])):
    reps = dict(sorted(reps.items(), key=lambda kv: _method_key(kv[0])))
    path = plot_tsne(f'{s.label}, seed {seed}', reps,
                     os.path.join(out_dir, f'tsne_{s.slug}_s{seed}.png'),
                     families=families[(s, seed)])
    out.append(f'- [{s.label}, seed {seed}: {", ".join(reps)}]({os.path.relpath(path, out_dir)})')
  return out + ['']


FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  try:
    path = write_report(FLAGS.sweep_dir, FLAGS.out_dir, FLAGS.target)
  except FileNotFoundError as e:  # no runs there: the message names the fix, no traceback
    sys.exit(f'error: {e}')
  print(f'Wrote {path}')


if __name__ == '__main__':
  flags.DEFINE_string('sweep_dir', None, 'A folder of run folders (e.g. a sweep\'s).')
  flags.DEFINE_string('out_dir', None, 'Where to write; default <sweep_dir>/report.')
  flags.DEFINE_float('target', None, 'Mean accuracy (0-1) of the costs-to-target table, read '
                     'from each run\'s history; default: the runs\' own target_accuracy.')
  flags.mark_flags_as_required(['sweep_dir'])
  app.run(main)
