"""Hyperparameters chosen on validation alone, and the table of what they give on test.

A tuning sweep (configs/sweeps.py's `dp_tuning` and `dp_tuning_others`) runs each method at
several learning rates (`optimizer.lr`) and, under DP-SGD, clips (`privacy.clip_norm`), with
`eval_validation` on: every run's summary.json then holds `final_val_accuracy`, the evaluated
clients' mean accuracy on their own validation splits (held out of the training pool, disjoint
from the test split). For each method and privacy budget (the target epsilon; infinity without
DP-SGD) and whatever else its runs share, `select` takes the candidate (clip, lr) whose final
validation accuracy (the mean over its seeds) is highest, and only then reads that candidate's
test accuracy (`final_mean_accuracy`). No test number takes part in the choice, so the test
accuracy reported is an honest estimate of the tuned method's; the privacy cost of the choice
itself is not accounted (docs/results.md, "Under differential privacy").

Reads the runs' config.json and summary.json with the standard library and numpy alone (no
JAX), so that launch/sweep.py may choose the second stage's runs from the first's.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from fedssa_jax.run.tables import markdown_table

# The fields a tuning sweep varies; a candidate is a value of each.
TUNED = ('privacy.clip_norm', 'optimizer.lr')
# Fields that say where and how a run was computed, not what it is, and the privacy section
# (its budget is the table's column): runs that differ only in them (and in the tuned fields
# and the seed) are candidates of one choice.
NOT_THE_SETTING = ('seed', 'data_dir', 'download', 'checkpoint_every', 'checkpoint_keep',
                   'save_representations', 'target_accuracy', 'engine.', 'guard.', 'privacy.')


@dataclasses.dataclass
class Candidate:
  """One (clip, lr) of a method at a budget: its runs' (one per seed) final validation and test
  accuracies."""
  method: str
  epsilon: float          # the target epsilon of DP-SGD; math.inf without it
  setting: str            # the rest of the config, as a key (runs of one choice share it)
  clip: float | None      # privacy.clip_norm (None without DP-SGD)
  lr: float
  val: list = dataclasses.field(default_factory=list)
  test: list = dataclasses.field(default_factory=list)
  paths: list = dataclasses.field(default_factory=list)

  @property
  def val_mean(self) -> float:
    return float(np.mean(self.val))

  @property
  def test_mean(self) -> float:
    return float(np.mean(self.test))


@dataclasses.dataclass
class Selection:
  """A choice: the candidate chosen, how many there were, and whether it lies on the edge of
  the grid (its lr the smallest or largest tried at its clip, or its clip the smallest or
  largest tried): then a wider grid might choose better."""
  chosen: Candidate
  candidates: int
  edge: bool


def flat(config: dict, prefix: str = '') -> dict:
  """A nested config dict as {'a.b': value}."""
  out = {}
  for k, v in config.items():
    if isinstance(v, dict):
      out.update(flat(v, f'{prefix}{k}.'))
    else:
      out[prefix + k] = v
  return out


def budget(fields: dict) -> float:
  """The run's privacy budget as a tuning sweep's table reads it: DP-SGD's target epsilon, or
  math.inf without differential privacy. A DP-SGD run with a noise multiplier given instead,
  or one with DP on the uploads, is no candidate: None."""
  if fields.get('privacy.upload'):
    return None
  if not fields.get('privacy.dp_sgd'):
    return math.inf
  return float(fields['privacy.target_epsilon']) or None


def setting_key(fields: dict) -> str:
  """What a run shares with the other candidates of its choice: its config, but the tuned
  fields, the seed and NOT_THE_SETTING's."""
  kept = {k: v for k, v in fields.items()
          if k not in TUNED and not any(k == n or (n.endswith('.') and k.startswith(n))
                                        for n in NOT_THE_SETTING)}
  return json.dumps(kept, sort_keys=True, default=str)


def _read(path: str):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def candidates(sweep_dir: str) -> list[Candidate]:
  """Every candidate of the finished runs under `sweep_dir` that evaluated their validation
  splits (summary.json's final_val_accuracy), seeds gathered; runs without it are left out."""
  found = {}
  for folder, dirs, files in os.walk(sweep_dir):
    dirs[:] = sorted(d for d in dirs if d not in ('checkpoints', 'report', 'jobs'))
    if 'config.json' not in files or 'summary.json' not in files:
      continue
    summary, config = (_read(os.path.join(folder, f)) for f in ('summary.json', 'config.json'))
    if not summary or not config or summary.get('final_val_accuracy') is None:
      continue
    fields = flat(config['config'])
    eps = budget(fields)
    if eps is None:
      continue
    clip = float(fields['privacy.clip_norm']) if eps != math.inf else None
    key = (fields['method'], eps, setting_key(fields), clip, float(fields['optimizer.lr']))
    c = found.setdefault(key, Candidate(*key))
    c.val.append(summary['final_val_accuracy'])
    c.test.append(summary['final_mean_accuracy'])
    c.paths.append(folder)
  return list(found.values())


def select(cands: list[Candidate]) -> dict[tuple, Selection]:
  """(setting, method, epsilon) -> the Selection among its candidates: the highest mean final
  validation accuracy; a tie goes to the smaller clip, then the smaller lr. Reads no test
  accuracy."""
  groups = {}
  for c in cands:
    groups.setdefault((c.setting, c.method, c.epsilon), []).append(c)
  out = {}
  for key, group in groups.items():
    order = sorted(group, key=lambda c: (c.clip or 0.0, c.lr))
    best = max(order, key=lambda c: c.val_mean)  # the first of the best, in that order
    lrs = [c.lr for c in group if c.clip == best.clip]
    clips = [c.clip for c in group if c.clip is not None]
    edge = (len(lrs) > 1 and best.lr in (min(lrs), max(lrs))) or (
        len(set(clips)) > 1 and best.clip in (min(clips), max(clips)))
    out[key] = Selection(best, len(group), edge)
  return out


def chosen(sweep_dir: str, method: str) -> dict[float, Candidate]:
  """{epsilon: the candidate chosen} of `method` under `sweep_dir`, for each budget its runs
  have (one setting: a ValueError where the method's runs hold several)."""
  picks = {k: s.chosen for k, s in select(candidates(sweep_dir)).items() if k[1] == method}
  if len({k[0] for k in picks}) > 1:
    raise ValueError(f'{sweep_dir} holds {method} runs of several settings; a tuning sweep '
                     'reads one: give it a folder of its own.')
  return {k[2]: c for k, c in picks.items()}


def _eps_name(e: float) -> str:
  return 'ε = ∞' if e == math.inf else f'ε = {e:g}'


def setting_label(setting: str) -> str:
  """A few words of a setting_key: 'cifar10, N=10, C=100%, 5 families, E=1, 20 rounds'."""
  f = json.loads(setting)
  families = f.get('model.families') or []
  return (f"{f.get('dataset')}, N={f.get('num_clients')}, C={f.get('participation', 0) * 100:g}%"
          f", {len(families)} famil{'y' if len(families) == 1 else 'ies'}, "
          f"E={f.get('local_epochs')}, {f.get('num_rounds')} rounds")


def tuned_tables(selections: dict[tuple, Selection], method_order=()) -> str:
  """The privacy-utility frontier of tuned runs, a table per setting: rows methods, columns
  budgets; each cell the chosen candidate's final test accuracy (%, mean over seeds), its clip
  and lr, and the validation accuracy that chose it ('†': on the grid's edge)."""
  out = ['# Tuned on validation: the privacy-utility frontier', '',
         'For each method and budget, the (clip C, lr) whose final validation accuracy (each '
         'client\'s own validation split, held out of training; mean over the clients, then '
         'over seeds) is highest among the runs tried, and that run\'s final test accuracy '
         '(%). The choice reads no test number. † the choice lies on the edge of the grid (its '
         'lr or clip the smallest or largest tried): a wider grid may do better. The choice '
         'itself is not privacy-accounted (docs/results.md).', '']
  rank = lambda m: (list(method_order).index(m) if m in method_order else len(method_order), m)
  settings = sorted({k[0] for k in selections})
  for setting in settings:
    picks = {k[1:]: s for k, s in selections.items() if k[0] == setting}
    budgets = sorted({e for _, e in picks})
    rows, runs = [], []
    for m in sorted({m for m, _ in picks}, key=rank):
      cells = []
      for e in budgets:
        s = picks.get((m, e))
        if s is None:
          cells.append('—')
          continue
        c = s.chosen
        clip = f'C {c.clip:g}, ' if c.clip is not None else ''
        cells.append(f'{c.test_mean * 100:.2f} ({clip}lr {c.lr:g}; val '
                     f'{c.val_mean * 100:.2f}, {s.candidates} tried){" †" if s.edge else ""}')
        runs.append(f'- {m}, {_eps_name(e)}: '
                    + ', '.join(os.path.basename(p) for p in c.paths))
      rows.append([m, *cells])
    out += [f'## {setting_label(setting)}', '',
            markdown_table(['method', *map(_eps_name, budgets)], rows),
            'The chosen runs:', '', *runs, '']
  return '\n'.join(out)
