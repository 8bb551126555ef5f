"""The lens beyond the mean local accuracy (docs/algorithm.md §5, docs/outputs.md): what a
record says of the spread of the clients' personalised accuracies and of what the federation gave
a client beyond its own test split, its line in the console's summary, and its table in the
report.
"""
from __future__ import annotations

import numpy as np

from fedssa_jax.run.tables import markdown_table, mean_std

# A record's fields (metrics.jsonl); summary.json has each as final_<name>.
LENS_FIELDS = ('accuracy_std', 'worst10_accuracy', 'family_accuracy', 'global_accuracy',
               'global_unseen_accuracy', 'global_unseen_chance', 'new_client_accuracy',
               'participation_gap')


def worst_decile(accuracy: np.ndarray) -> float:
  """The mean of the lowest tenth of the accuracies (at least one of them)."""
  count = max(1, int(np.ceil(0.1 * len(accuracy))))
  return float(np.sort(accuracy)[:count].mean())


def lens(accuracy: np.ndarray, families: list[str], ev) -> dict:
  """The record's LENS_FIELDS from the evaluated clients' personalised `accuracy` (the
  participants' population, new clients apart), their model `families` (one name per client)
  and the evaluation `ev`: the spread (standard deviation over the clients), the worst decile,
  the mean per family, and, None where off, the mean global accuracy of the same clients, their
  mean accuracy on the global sample's images of the classes each holds no training sample of
  (over the clients that lack a class; None if none does) beside what guessing among the
  classes they put those images in would score, the new clients' mean accuracy and the
  participation gap (the participants' mean less theirs)."""
  families = np.asarray(families)
  new = ev.new_client_accuracy
  new = None if new is None else float(np.nanmean(new))
  def unseen(values):  # the evaluated clients that lack a class (the others NaN)
    values = None if values is None else values[ev.evaluated]
    return None if values is None or np.isnan(values).all() else float(np.nanmean(values))
  return {
      'accuracy_std': float(accuracy.std()),
      'worst10_accuracy': worst_decile(accuracy),
      'family_accuracy': {f: float(accuracy[families == f].mean())
                          for f in families[np.sort(np.unique(families, return_index=True)[1])]},
      'global_accuracy': (None if ev.global_accuracy is None
                          else float(ev.global_accuracy[ev.evaluated].mean())),
      'global_unseen_accuracy': unseen(ev.global_unseen_accuracy),
      'global_unseen_chance': unseen(ev.global_unseen_chance),
      'new_client_accuracy': new,
      'participation_gap': None if new is None else float(accuracy.mean()) - new,
  }


def validation(ev) -> dict:
  """A record's validation field, with eval_validation on: `val_accuracy`, the evaluated
  clients' mean accuracy (the headline metric's) on their own validation splits, which
  hyperparameters are chosen on (run/tuning.py); {} when off, so that the record is as
  before."""
  if ev.val_accuracy is None:
    return {}
  return {'val_accuracy': float(ev.val_accuracy[ev.evaluated].mean())}


def lens_text(summary: dict) -> str:
  """The summary's lens for the console's last line: ' (std 0.0812, worst decile 0.6120, global
  0.3350, unseen classes 0.1200, new clients 0.5400, gap 0.2010, validation 0.8100)', the parts
  that are off left out."""
  parts = [(label, summary.get(f'final_{k}')) for label, k in (
      ('std', 'accuracy_std'), ('worst decile', 'worst10_accuracy'),
      ('global', 'global_accuracy'), ('unseen classes', 'global_unseen_accuracy'),
      ('new clients', 'new_client_accuracy'),
      ('gap', 'participation_gap'), ('validation', 'val_accuracy'))]
  text = ', '.join(f'{label} {v:.4f}' for label, v in parts if v is not None)
  return f' ({text})' if text else ''



def lens_tables(grouped) -> str:
  """Per setting (report.py's `grouped`), rows methods: the final round's spread, worst decile,
  global accuracy (all classes, and the classes a client never trained on), new clients'
  accuracy and participation gap (%), mean ± std over seeds, '—' where a run recorded none (a
  field off, or a run from before these fields)."""
  out = ['# Beyond the mean: spread, worst decile, global and new clients (%)', '',
         'At the final round: the standard deviation of the clients\' personalised accuracies, '
         'the mean of the worst 10% of clients, the mean accuracy on the global test sample '
         '(eval_global_images) and on its images of the classes a client holds no training '
         'sample of, the new clients\' mean accuracy (new_clients) and the '
         'participation gap (the participants\' mean less the new clients\'); mean ± std over '
         'seeds.', '']
  columns = ('final_accuracy_std', 'final_worst10_accuracy', 'final_global_accuracy',
             'final_global_unseen_accuracy', 'final_new_client_accuracy',
             'final_participation_gap')
  for s, methods in grouped.items():
    rows = []
    for m, rs in methods.items():
      cells = []
      for key in columns:
        values = [r.summary.get(key) for r in rs]
        cells.append('—' if any(v is None for v in values) else mean_std(values))
      rows.append([m, *cells])
    out += [f'## {s.label}', '', markdown_table(
        ['method', 'std', 'worst decile', 'global', 'unseen classes', 'new clients', 'gap'],
        rows)]
  return '\n'.join(out)
