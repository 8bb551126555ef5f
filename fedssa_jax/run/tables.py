"""Markdown tables and number formats of the report (report.py, lens.py, compare.py)."""
from __future__ import annotations

import numpy as np


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
