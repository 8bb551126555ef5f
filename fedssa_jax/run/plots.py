"""The report's figures (report.py): accuracy against rounds, training curves, per-client boxes,
robustness and t-SNE, with matplotlib, imported only when a figure is drawn."""
from __future__ import annotations

import collections

import numpy as np

from fedssa_jax import config_lib
from fedssa_jax.run.runs import METHOD_ORDER, REFERENCE_METHOD, Setting


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


def plot_accuracy_vs_rounds(setting: Setting, methods, path: str, x_key: str | None = None) -> str:
  """Mean test accuracy per method (the seeds' mean, their range shaded) against the round, or
  against the records' `x_key` (its seeds' mean at each evaluated round)."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6.4 + 2.4 * (len(methods) > 8), 4.4))
  styles = line_styles(methods)
  for m, rs in methods.items():
    common, acc = series(rs, 'mean_accuracy')
    x = common
    if x_key is not None:
      _, xs = series(rs, x_key)
      if xs.shape != acc.shape:
        continue
      x = xs.mean(0)
    if not common:
      continue
    acc = acc * 100
    line, = ax.plot(x, acc.mean(0), label=m, marker='.' if len(common) < 30 else None,
                    **styles[m])
    if len(rs) > 1:
      ax.fill_between(x, acc.min(0), acc.max(0), color=line.get_color(), alpha=0.15)
  xlabel = {None: 'round', 'cum_sim_seconds': 'simulated seconds'}.get(x_key, x_key)
  ax.set(xlabel=xlabel, ylabel='mean test accuracy (%)', title=setting.label)
  if x_key is None:
    ax.xaxis.get_major_locator().set_params(integer=True)
  ax.grid(alpha=0.3)
  if len(methods) > 8:  # beside the axes, so that no curve is hidden
    ax.legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1.0))
  else:
    ax.legend(fontsize=7)
  return _save(fig, path)


def plot_accuracy_vs_sim_time(setting: Setting, methods, path: str) -> str:
  """Mean test accuracy against the system section's simulated seconds."""
  return plot_accuracy_vs_rounds(setting, methods, path, x_key='cum_sim_seconds')


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


# The lens's panels (docs/outputs.md): record field, axis label.
LENS_PANELS = (('mean_accuracy', 'local accuracy: mean (%)'),
               ('worst10_accuracy', 'local accuracy: worst decile (%)'),
               ('global_accuracy', 'global accuracy (%)'),
               ('global_unseen_accuracy', 'global, classes never trained on (%)'),
               ('new_client_accuracy', 'new clients\' accuracy (%)'))


def has_lens_curves(methods) -> bool:
  """Whether any run of `methods` recorded the global or new clients' accuracy."""
  return any(series([r], k)[0] for rs in methods.values() for r in rs
             for k, _ in LENS_PANELS[2:])


def plot_lens_curves(setting: Setting, methods, path: str) -> str:
  """The lens against rounds, a panel per LENS_PANELS field (the seeds' mean per method): what
  a client scores on its own test split, on average and in the worst tenth, and what the
  federation gave beyond it, on the global test sample and to the clients that never trained.
  A panel no run recorded is left empty."""
  plt = _pyplot()
  fig, axes = plt.subplots(1, len(LENS_PANELS), figsize=(20 + 2 * (len(methods) > 8), 3.8))
  styles = line_styles(methods)
  for m, rs in methods.items():
    for ax, (key, _) in zip(axes, LENS_PANELS):
      rounds, ys = series(rs, key)
      if rounds:
        ax.plot(rounds, ys.mean(0) * 100, label=m,
                marker='.' if len(rounds) < 30 else None, **styles[m])
  for ax, (_, label) in zip(axes, LENS_PANELS):
    ax.set(xlabel='round', ylabel=label)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
  if len(methods) > 8:
    axes[-1].legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1.0))
  else:
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
    if s.system or s.privacy:  # a federation's conditions, not its partition
      continue
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


def plot_accuracy_vs_epsilon(title: str, methods, path: str) -> str:
  """Final mean accuracy (the seeds' mean, their range as error bars) against the privacy
  budget epsilon, on a log axis; epsilon = infinity (no differential privacy) is drawn at the
  right, past a break. `methods`: method -> {epsilon: runs} (report.privacy_series)."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6.4, 4.4))
  styles = line_styles(methods)
  finite = sorted({e for points in methods.values() for e in points if np.isfinite(e)})
  at_inf = (finite[-1] if finite else 1.0) * 4  # where epsilon = infinity is drawn
  for m, points in methods.items():
    x = [e if np.isfinite(e) else at_inf for e in points]
    accs = [np.array([r.summary['final_mean_accuracy'] * 100 for r in rs]) for rs in points.values()]
    y = np.array([a.mean() for a in accs])
    err = np.array([[a.mean() - a.min() for a in accs], [a.max() - a.mean() for a in accs]])
    ax.errorbar(x, y, yerr=err, label=m, marker='o', capsize=3, **styles[m])
  ax.set_xscale('log')
  ticks = finite + [at_inf]
  ax.set_xticks(ticks, [f'{e:.3g}' for e in finite] + ['∞'])
  ax.minorticks_off()
  ax.set(xlabel='ε at the runs\' δ (∞: without differential privacy)',
         ylabel='final mean test accuracy (%)', title=title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return _save(fig, path)


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
