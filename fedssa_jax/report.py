"""Tables and plots of a sweep's runs, shaped like the paper's.

  python -m fedssa_jax.report --sweep_dir=runs/sweeps/table2

Reads every run folder under `sweep_dir` (any folder holding config.json and summary.json; see
docs/outputs.md) and writes into `<sweep_dir>/report/`:

- accuracy.md   per model setting (homogeneous: Table 1, heterogeneous: Table 2), rows methods,
                columns data set x (N, C) x partition; the final and the best mean test
                accuracy in %, mean ± std over seeds, the best mean per column in bold;
- costs.md      per setting, rounds, floats and client FLOPs to the target accuracy (the runs'
                target_accuracy, or --target), and how many times more each baseline needs
                than FedSSA;
- PNG plots     accuracy against rounds per setting; per-client accuracy box plots per setting
                (FedSSA and the two best other methods); accuracy, train loss and header-row
                norms against rounds per setting; robustness curves where a setting
                varies only in classes per client or Dirichlet gamma; t-SNE panels of the saved
                representations (runs with save_representations=True);
- index.md      links to all of them.

A setting is read from each run's config.json; a method's label adds its own options that
differ from the defaults (e.g. `fedssa (mu0=0.0)` for the ablation), so that variations are
rows of their own.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os

from absl import app
from absl import flags
import numpy as np

from fedssa_jax import config_lib, evaluation
from fedssa_jax import methods as methods_lib

METHOD_ORDER = tuple(methods_lib.METHODS)  # registration order: FedSSA, then the baselines
REFERENCE_METHOD = 'fedssa'


# ----------------------------------------------------------------------------------------------
# Markdown helpers (also used by fedssa_jax.compare)
# ----------------------------------------------------------------------------------------------

def sci(x) -> str:
  """A number in 3 significant digits, or — for None."""
  return '—' if x is None else f'{x:.3g}'


def markdown_table(columns, rows) -> str:
  lines = ['| ' + ' | '.join(columns) + ' |', '|' + '---|' * len(columns)]
  lines += ['| ' + ' | '.join(str(c) for c in r) + ' |' for r in rows]
  return '\n'.join(lines) + '\n'


def mean_std(values, scale: float = 100.0, digits: int = 2) -> str:
  """'mean ± std' (sample std over seeds) of values × scale; just the value for one seed."""
  v = np.asarray(values, float) * scale
  if len(v) == 1:
    return f'{v[0]:.{digits}f}'
  return f'{v.mean():.{digits}f} ± {v.std(ddof=1):.{digits}f}'


# ----------------------------------------------------------------------------------------------
# Reading runs
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Setting:
  """What a run was run on, apart from the method and the seed."""
  dataset: str
  models: str           # 'homo' (one family) or 'hetero'
  num_clients: int
  participation: float
  partition: str        # '' (the data set's default pathological k), 'k=4', 'Dir(0.1)'
  scheme: str           # '' (reference pools) or '8:1:1'

  @property
  def column(self) -> str:
    """The label within a table of one model setting."""
    parts = [self.dataset, f'N={self.num_clients}, C={self.participation * 100:g}%']
    parts += [p for p in (self.partition, self.scheme) if p]
    return ' '.join(parts)

  @property
  def label(self) -> str:
    return f'{self.column} {self.models}'

  @property
  def slug(self) -> str:
    text = f'{self.dataset}_{self.models}_n{self.num_clients}_c{self.participation:g}'
    text += ''.join(f'_{p}' for p in (self.partition, self.scheme) if p)
    return ''.join(ch if ch.isalnum() or ch in '._-' else '_' for ch in text)

  def sort_key(self):
    return (self.dataset, self.models, self.num_clients, -self.participation,
            self.partition.split('=')[0], _number_in(self.partition), self.scheme)


def _number_in(text: str) -> float:
  digits = ''.join(ch for ch in text if ch.isdigit() or ch == '.')
  try:
    return float(digits)
  except ValueError:
    return 0.0


@dataclasses.dataclass
class Run:
  path: str
  config: dict
  derived: dict
  summary: dict
  metrics: list
  setting: Setting
  method: str           # label: the method plus its options that differ from the defaults
  seed: int


def setting_of(config: dict) -> Setting:
  p = config['partition']
  default_k = config_lib.dataset_defaults(config['dataset'])['classes_per_client']
  if p['kind'] == 'dirichlet':
    partition = f'Dir({p["dirichlet_gamma"]:g})'
  else:
    partition = '' if p['classes_per_client'] == default_k else f'k={p["classes_per_client"]}'
  return Setting(config['dataset'],
                 'homo' if len(config['model']['families']) == 1 else 'hetero',
                 config['num_clients'], float(config['participation']), partition,
                 '8:1:1' if p['scheme'] == 'paper' else '')


def method_label(config: dict, models: str) -> str:
  """The method, plus its own options (its config section, Method.config_section) and the
  optimizer's that differ from the variant's, e.g. `fedssa (mu0=0.0)` or
  `standalone (lr=0.01)`."""
  method = config['method']
  defaults = config_lib.build(config['dataset'], models).to_dict()
  known = methods_lib.METHODS
  own_section = known[method].config_section if method in known else method
  changed = []
  for section in (own_section, 'optimizer'):
    own, default = config.get(section), defaults.get(section)
    if isinstance(own, dict) and isinstance(default, dict):
      changed += [f'{k}={v}' for k, v in sorted(own.items()) if default.get(k) != v]
  return f'{method} ({", ".join(changed)})' if changed else method


def load_runs(sweep_dir: str) -> tuple[list[Run], list[str]]:
  """(finished runs, folders with a config.json but no summary.json yet)."""
  runs, unfinished = [], []
  for folder, dirs, files in os.walk(sweep_dir):
    dirs[:] = sorted(d for d in dirs if d not in ('checkpoints', 'report', 'jobs'))
    if 'config.json' not in files:
      continue
    if 'summary.json' not in files:
      unfinished.append(folder)
      continue
    with open(os.path.join(folder, 'config.json')) as f:
      cfg = json.load(f)
    with open(os.path.join(folder, 'summary.json')) as f:
      summary = json.load(f)
    metrics = []
    if 'metrics.jsonl' in files:
      with open(os.path.join(folder, 'metrics.jsonl')) as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    config = cfg['config']
    setting = setting_of(config)
    runs.append(Run(folder, config, cfg.get('derived', {}), summary, metrics, setting,
                    method_label(config, setting.models), config['seed']))
  return runs, unfinished


def _method_key(label: str):
  base = label.split(' ')[0]
  return (METHOD_ORDER.index(base) if base in METHOD_ORDER else len(METHOD_ORDER), label)


def by_setting_and_method(runs) -> dict[Setting, dict[str, list[Run]]]:
  """setting -> method label -> runs (one per seed), both in table order."""
  table = collections.defaultdict(lambda: collections.defaultdict(list))
  for r in runs:
    table[r.setting][r.method].append(r)
  return {s: {m: sorted(table[s][m], key=lambda r: r.seed)
              for m in sorted(table[s], key=_method_key)}
          for s in sorted(table, key=Setting.sort_key)}


# ----------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------

MODEL_TITLES = {'homo': 'Model-homogeneous (every client CNN-1), cf. the paper\'s Table 1',
                'hetero': 'Model-heterogeneous (CNN-1..5), cf. the paper\'s Table 2'}


ACCURACIES = (('final_mean_accuracy', 'Final', 'the final round\'s'),
              ('best_mean_accuracy', 'Best', 'the best evaluated round\'s'))


def accuracy_tables(grouped) -> str:
  """Per model setting: rows methods, columns settings, the final and the best mean accuracy
  (%), mean ± std over seeds."""
  out = ['# Mean test accuracy (%)', '',
         'The mean over clients of per-client test accuracy, at the final round and at the '
         'best evaluated round of each run; mean ± sample std over seeds (n seeds in the last '
         'column), the best mean per column in **bold**.', '']
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


def reached(r: Run, target: float | None = None) -> dict | None:
  """The run's costs at the first evaluated round whose mean accuracy reaches `target` (round,
  cum_floats, cum_client_flops), from its history; None if it never did. Without `target`,
  the run's own (summary.json, at its config's target_accuracy)."""
  if target is None:
    return r.summary.get('to_target')
  for x in r.metrics:
    if x.get('mean_accuracy') is not None and x['mean_accuracy'] >= target:
      return {'round': x['round'], 'cum_floats': x['cum_floats'],
              'cum_client_flops': x['cum_client_flops']}
  return None


def _to_target(rs, key, target=None):
  """Mean over the seeds that reached the target of their cost `key`, and how many did."""
  vals = [c[key] for c in (reached(r, target) for r in rs) if c]
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
    rows = []
    for m, rs in methods.items():
      rounds, hits = _to_target(rs, 'round', target)
      floats, _ = _to_target(rs, 'cum_floats', target)
      flops, _ = _to_target(rs, 'cum_client_flops', target)
      rows.append([m, f'{hits}/{len(rs)}', sci(rounds), sci(floats), sci(flops),
                   ratio_text(floats, ref_floats), ratio_text(flops, ref_flops)])
    out += [f'## {s.label}, target {shown * 100:g}%', '',
            markdown_table(['method', 'reached', 'rounds', 'floats', 'client FLOPs',
                            'floats / FedSSA\'s', 'FLOPs / FedSSA\'s'], rows)]
  return '\n'.join(out)


# ----------------------------------------------------------------------------------------------
# Plots (matplotlib and scikit-learn are imported only here)
# ----------------------------------------------------------------------------------------------

def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def _save(fig, path):
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  _pyplot().close(fig)
  return path


def series(rs, key: str) -> tuple[list[int], np.ndarray]:
  """(the rounds where every run of `rs` recorded `key`, [runs, rounds] of its values)."""
  rounds = sorted(set.intersection(*(
      {x['round'] for x in r.metrics if x.get(key) is not None} for r in rs)))
  by_round = [{x['round']: x.get(key) for x in r.metrics} for r in rs]
  return rounds, np.array([[b[t] for t in rounds] for b in by_round], np.float64)


def line_styles(labels) -> dict[str, dict]:
  """matplotlib styles per method label: a colour per method (the same in every plot) and,
  for its variants (labels with options), that colour in dashed and dotted lines."""
  # tab10's ten colours (the first ten methods'), then Dark2's eight for the ones after them.
  cmap = _pyplot().get_cmap
  palette = cmap('tab10').colors + cmap('Dark2').colors
  styles, variants = {}, collections.Counter()
  for label in labels:
    base = label.split(' ')[0]
    i = METHOD_ORDER.index(base) if base in METHOD_ORDER else len(METHOD_ORDER) + len(styles)
    dash = ('--', ':', '-.')[variants[base] % 3] if label != base else '-'
    variants[base] += label != base
    styles[label] = {'color': palette[i % len(palette)], 'linestyle': dash}
  return styles


def plot_accuracy_vs_rounds(setting: Setting, methods, path: str) -> str:
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6.4 + 2.4 * (len(methods) > 8), 4.4))
  styles = line_styles(methods)
  for m, rs in methods.items():
    common, acc = series(rs, 'mean_accuracy')
    if not common:
      continue
    acc = acc * 100
    line, = ax.plot(common, acc.mean(0), label=m, marker='.' if len(common) < 30 else None,
                    **styles[m])
    if len(rs) > 1:
      ax.fill_between(common, acc.min(0), acc.max(0), color=line.get_color(), alpha=0.15)
  ax.set(xlabel='round', ylabel='mean test accuracy (%)', title=setting.label)
  ax.xaxis.get_major_locator().set_params(integer=True)
  ax.grid(alpha=0.3)
  if len(methods) > 8:  # beside the axes, so that no curve is hidden
    ax.legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1.0))
  else:
    ax.legend(fontsize=7)
  return _save(fig, path)


def plot_training_curves(setting: Setting, methods, path: str) -> str:
  """Per method (seed-mean curves): mean test accuracy, train loss, and the header-row norms
  (largest, and mean over the trained clients' seen rows), against rounds. A run whose
  accuracy falls while its header norms climb has headers that grow (FedSSA's `reference`
  fusion with a long T_stable)."""
  plt = _pyplot()
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
  panels = (('mean_accuracy', 'mean test accuracy (%)', 100.0),
            ('train_loss', 'train loss', 1.0),
            ('header_norm_max', 'header-row norm: max (—), mean (--)', 1.0))
  styles = line_styles(methods)
  for m, rs in methods.items():
    for ax, (key, label, scale) in zip(axes, panels):
      keys = (key, 'header_norm_mean') if key == 'header_norm_max' else (key,)
      for k, style in zip(keys, ('-', '--')):
        rounds, ys = series(rs, k)
        if not rounds:
          continue
        ax.plot(rounds, ys.mean(0) * scale, style if len(keys) > 1 else styles[m]['linestyle'],
                color=styles[m]['color'], label=m if style == '-' else None)
      ax.set(xlabel='round', ylabel=label)
      ax.xaxis.get_major_locator().set_params(integer=True)
      ax.grid(alpha=0.3)
  plain = lambda v, _: f'{v:g}'
  for ax in axes[1:]:
    ax.set_yscale('log')
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.tick_params(axis='y', which='minor', labelsize=7)
  axes[0].legend(fontsize=7)
  fig.suptitle(setting.label, fontsize=10)
  return _save(fig, path)


def boxplot_methods(methods) -> list[str]:
  """FedSSA and the two best other methods by mean final accuracy (the paper's Figure 4;
  variants with options, such as ablations, are not candidates); every method when there are
  at most three."""
  if len(methods) <= 3 or REFERENCE_METHOD not in methods:
    return list(methods)
  mean = {m: np.mean([r.summary['final_mean_accuracy'] for r in rs])
          for m, rs in methods.items() if m != REFERENCE_METHOD and ' (' not in m}
  best = sorted(mean, key=mean.get, reverse=True)[:2]
  return [REFERENCE_METHOD, *best]


def plot_client_boxes(setting: Setting, methods, path: str) -> str:
  plt = _pyplot()
  names = boxplot_methods(methods)
  data = [np.concatenate([r.summary['final_client_accuracy'] for r in methods[m]]) * 100
          for m in names]
  fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(names), 4))
  ax.boxplot(data)
  ax.set_xticks(range(1, len(names) + 1), names, rotation=20, fontsize=8)
  ax.set(ylabel='client test accuracy (%)', title=f'{setting.label}\n(clients of all seeds)')
  ax.grid(alpha=0.3, axis='y')
  return _save(fig, path)


def robustness_series(grouped) -> dict[tuple, dict]:
  """Settings that differ only in k (classes per client) or Dirichlet gamma: (dataset, models,
  N, C, 'k' or 'gamma') -> {method: [(x, mean accuracy, std), ...]}. Kept only with >= 2 x."""
  series = collections.defaultdict(lambda: collections.defaultdict(list))
  for s, methods in grouped.items():
    if s.partition.startswith('Dir('):
      axis, x = 'gamma', float(s.partition[4:-1])
    else:
      k = s.partition[2:] if s.partition else config_lib.dataset_defaults(s.dataset)[
          'classes_per_client']
      axis, x = 'k', float(k)
    key = (s.dataset, s.models, s.num_clients, s.participation, axis)
    for m, rs in methods.items():
      accs = [r.summary['final_mean_accuracy'] * 100 for r in rs]
      series[key][m].append((x, float(np.mean(accs)), float(np.std(accs))))
  return {k: {m: sorted(v) for m, v in ms.items()} for k, ms in series.items()
          if len({x for v in ms.values() for x, _, _ in v}) >= 2}


def plot_robustness(key, methods, path: str) -> str:
  plt = _pyplot()
  dataset, models, n, c, axis = key
  fig, ax = plt.subplots(figsize=(5, 3.6))
  for m, pts in methods.items():
    x, y, e = map(np.array, zip(*pts))
    ax.errorbar(x, y, yerr=e, label=m, marker='o', capsize=3)
  ax.set_xticks(sorted({x for pts in methods.values() for x, _, _ in pts}))
  ax.set(xlabel='classes per client' if axis == 'k' else 'Dirichlet γ',
         ylabel='mean test accuracy (%)', title=f'{dataset} {models} N={n}, C={c * 100:g}%')
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return _save(fig, path)


FAMILY_MARKERS = 'o^sDv'  # CNN-1..5


def plot_tsne(title: str, reps: dict[str, dict], path: str, max_points: int = 3000,
              seed: int = 0, families: dict[str, list] | None = None) -> str:
  """One panel per method: t-SNE of the saved representations, coloured by class, with a
  marker per model family where `families` (method -> each client's family) is given, and
  legends for both (a colour bar for more than 20 classes)."""
  from sklearn.manifold import TSNE  # pylint: disable=g-import-not-at-top
  plt = _pyplot()
  fig, axes = plt.subplots(1, len(reps), figsize=(4.5 * len(reps) + 1.5, 4.6), squeeze=False)
  rng = np.random.default_rng(seed)
  num_classes = 1 + max(int(saved['labels'].max()) for saved in reps.values())
  listed = num_classes <= 20  # one colour per class, with a legend; else a colour bar
  cmap = plt.get_cmap('tab10' if num_classes <= 10 else 'tab20' if listed else 'viridis')
  colour = lambda y: cmap(y) if listed else cmap(y / max(num_classes - 1, 1))
  for ax, (m, saved) in zip(axes[0], reps.items()):
    x, y, c = saved['representations'].astype(np.float32), saved['labels'], saved['client']
    if len(x) > max_points:
      keep = rng.choice(len(x), max_points, replace=False)
      x, y, c = x[keep], y[keep], c[keep]
    emb = TSNE(n_components=2, init='pca', random_state=seed,
               perplexity=float(min(30, max(2, len(x) // 4)))).fit_transform(x)
    fam = np.asarray((families or {}).get(m, ['all'] * (c.max() + 1)))[c]
    names = sorted(set(fam))
    for i, f in enumerate(names):
      pts = fam == f
      ax.scatter(emb[pts, 0], emb[pts, 1], color=colour(y[pts]), s=4,
                 marker=FAMILY_MARKERS[i % 5], linewidths=0)
    ax.set(title=m, xticks=[], yticks=[])
    if len(names) > 1:
      ax.legend([plt.Line2D([], [], marker=FAMILY_MARKERS[i % 5], color='grey', ls='')
                 for i in range(len(names))], names, title='family', fontsize=7,
                title_fontsize=7, loc='best', markerscale=1.2)
  if listed:
    fig.legend([plt.Line2D([], [], marker='o', color=colour(k), ls='')
                for k in range(num_classes)],
               [f'class {k}' for k in range(num_classes)], loc='center right', fontsize=7,
               title='class', title_fontsize=8)
    fig.subplots_adjust(right=0.86)
  else:
    bar = plt.cm.ScalarMappable(plt.Normalize(0, num_classes - 1), cmap)
    fig.colorbar(bar, ax=axes[0].tolist(), label='class')
  fig.suptitle(title)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


# ----------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------

def write_report(sweep_dir: str, out_dir: str | None = None,
                 target: float | None = None) -> str:
  """Writes the tables, plots and index.md; returns the path of index.md. `target`: the mean
  accuracy of the costs table (default: each run's own target_accuracy)."""
  runs, unfinished = load_runs(sweep_dir)
  if not runs:
    raise FileNotFoundError(
        f'No finished runs (folders with config.json and summary.json) under {sweep_dir!r}. '
        'Run the sweep first: python launch/sweep.py --sweep=<name> --sweep_dir=' + sweep_dir)
  out_dir = out_dir or os.path.join(sweep_dir, 'report')
  os.makedirs(out_dir, exist_ok=True)
  grouped = by_setting_and_method(runs)
  rel = lambda p: os.path.relpath(p, out_dir)

  for name, text in (('accuracy.md', accuracy_tables(grouped)),
                     ('costs.md', costs_tables(grouped, target))):
    with open(os.path.join(out_dir, name), 'w') as f:
      f.write(text)
  index = [f'# Report of {os.path.abspath(sweep_dir)}', '',
           f'{len(runs)} finished runs in {len(grouped)} settings'
           + (f'; {len(unfinished)} not finished (left out): '
              + ', '.join(rel(u) for u in unfinished) if unfinished else '') + '.', '',
           '- [Mean test accuracy, Tables 1 and 2](accuracy.md)',
           '- [Communication and computation to the target](costs.md)', '']

  rows = []
  for s, methods in grouped.items():
    rounds = sorted({r.summary['rounds'] for rs in methods.values() for r in rs})
    curves = plot_accuracy_vs_rounds(s, methods, os.path.join(out_dir, f'rounds_{s.slug}.png'))
    boxes = plot_client_boxes(s, methods, os.path.join(out_dir, f'boxes_{s.slug}.png'))
    training = plot_training_curves(s, methods, os.path.join(out_dir, f'training_{s.slug}.png'))
    rows.append([s.label, len(methods), '/'.join(map(str, rounds)), f'[png]({rel(curves)})',
                 f'[png]({rel(boxes)})', f'[png]({rel(training)})'])
  index += ['## Per setting', '', markdown_table(
      ['setting', 'methods', 'rounds', 'accuracy against rounds', 'client accuracy boxes',
       'accuracy, train loss and header norms'], rows)]

  robust = robustness_series(grouped)
  if robust:
    index += ['## Robustness', '']
    for key, methods in robust.items():
      dataset, models, n, c, axis = key
      path = plot_robustness(key, methods, os.path.join(
          out_dir, f'robustness_{axis}_{dataset}_{models}_n{n}_c{c:g}.png'))
      index.append(f'- [{dataset} {models} N={n}, C={c * 100:g}%, against '
                   f'{"classes per client" if axis == "k" else "Dirichlet γ"}]({rel(path)})')
    index.append('')

  tsne = collections.defaultdict(dict)  # (setting, seed) -> method -> saved arrays
  families = collections.defaultdict(dict)  # (setting, seed) -> method -> each client's family
  for r in runs:
    path = os.path.join(r.path, evaluation.REPRESENTATIONS_FILE)
    if os.path.exists(path):
      tsne[(r.setting, r.seed)][r.method] = dict(np.load(path))
      if 'client_family' in r.derived:
        families[(r.setting, r.seed)][r.method] = r.derived['client_family']
  if tsne:
    index += ['## t-SNE of the test representations', '']
    for (s, seed), reps in sorted(tsne.items(), key=lambda kv: (kv[0][0].sort_key(), kv[0][1])):
      reps = dict(sorted(reps.items(), key=lambda kv: _method_key(kv[0])))
      path = plot_tsne(f'{s.label}, seed {seed}', reps,
                       os.path.join(out_dir, f'tsne_{s.slug}_s{seed}.png'),
                       families=families[(s, seed)])
      index.append(f'- [{s.label}, seed {seed}: {", ".join(reps)}]({rel(path)})')
    index.append('')

  path = os.path.join(out_dir, 'index.md')
  with open(path, 'w') as f:
    f.write('\n'.join(index))
  return path


FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  path = write_report(FLAGS.sweep_dir, FLAGS.out_dir, FLAGS.target)
  print(f'Wrote {path}')


if __name__ == '__main__':
  flags.DEFINE_string('sweep_dir', None, 'A folder of run folders (e.g. a sweep\'s).')
  flags.DEFINE_string('out_dir', None, 'Where to write; default <sweep_dir>/report.')
  flags.DEFINE_float('target', None, 'Mean accuracy (0-1) of the costs-to-target table, read '
                     'from each run\'s history; default: the runs\' own target_accuracy.')
  flags.mark_flags_as_required(['sweep_dir'])
  app.run(main)
