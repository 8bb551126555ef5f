"""From scores to numbers: the one-run lower bound on epsilon (JAX-Privacy's
`CanaryScoreAuditor.epsilon_one_run`, Steinke, Nasr and Jagielski 2023) with the attack's AUROC
and TPR at a low FPR, the bound's ceiling for m canaries, and a loss-threshold membership
inference attack's advantage (Yeom et al. 2018).

A score is higher for what the attack believes included (a member): minus a loss, or a canary
direction's projection."""
from __future__ import annotations

import functools
import math

import numpy as np

from fedssa_jax.errors import ConfigError

SIGNIFICANCE = 0.05   # the bound holds with probability 95%
MIN_CANARIES = 50     # fewer cannot show even epsilon 1.7 at delta 1e-5 (`ceiling`)
LOW_FPR = 0.01        # the FPR of `tpr_at_low_fpr`


def _auditor(members, non_members):
  from jax_privacy.auditing import CanaryScoreAuditor  # pylint: disable=g-import-not-at-top
  return CanaryScoreAuditor(np.asarray(members, np.float64), np.asarray(non_members, np.float64))


@functools.lru_cache(maxsize=64)
def ceiling(m: int, delta: float, significance: float = SIGNIFICANCE,
            included: int | None = None) -> float:
  """The largest lower bound m canaries can show at `delta`: that of an attack that guesses
  every one right, `included` of them included (default: half)."""
  n_in = m // 2 if included is None else included
  return float(_auditor(np.arange(n_in) + m, np.arange(m - n_in)).epsilon_one_run(
      significance, delta))


def check_canaries(m: int, delta: float, flag: str = '--canaries') -> None:
  """A ConfigError naming the fix when m canaries are too few for a meaningful bound."""
  if m < MIN_CANARIES:
    best = ceiling(max(m, 2), delta) if m >= 2 else 0.0
    raise ConfigError(
        f'{flag}={m} is too few for a meaningful bound: even an attack that guesses every '
        f'canary right shows at most epsilon {best:.2f} at delta {delta:g}. Use '
        f'{flag}={max(1000, MIN_CANARIES)} (at least {MIN_CANARIES}; 1000 can show up to '
        f'{ceiling(1000, delta):.2f}).')


def audit(in_scores, out_scores, delta: float, accounted: float,
          significance: float = SIGNIFICANCE) -> dict:
  """The audit of canaries scored `in_scores` (included) and `out_scores` (excluded): the
  lower bound `epsilon_lower` at `delta` with confidence 1 - `significance`, beside the
  `accounted` epsilon (inf: none); `exceeds` whether the bound is above it (a bug in the
  mechanism or its accounting, at that confidence)."""
  a = _auditor(in_scores, out_scores)
  m = len(in_scores) + len(out_scores)
  lower = float(a.epsilon_one_run(significance, delta))
  return {'epsilon': _finite(accounted), 'epsilon_lower': lower,
          'confidence': 1 - significance, 'delta': float(delta), 'canaries': m,
          'included': len(in_scores),
          'ceiling': ceiling(m, float(delta), significance, len(in_scores)),
          'auroc': float(a.attack_auroc()),
          'tpr_at_fpr_0.01': float(a.tpr_at_given_fpr(LOW_FPR)),
          'exceeds': bool(lower > accounted)}


def _finite(x: float) -> float | None:
  return None if math.isinf(x) else float(x)


def mia_advantage(member_scores, non_member_scores) -> float:
  """max over thresholds t of TPR(t) - FPR(t), guessing 'member' for a score >= t (and 0 for
  a threshold above every score)."""
  members = np.sort(np.asarray(member_scores, np.float64))
  others = np.sort(np.asarray(non_member_scores, np.float64))
  if not len(members) or not len(others):
    return 0.0
  t = np.concatenate([members, others])
  tpr = 1 - np.searchsorted(members, t, side='left') / len(members)
  fpr = 1 - np.searchsorted(others, t, side='left') / len(others)
  return float(max(0.0, (tpr - fpr).max()))


def mia(member_scores, non_member_scores) -> dict:
  """The membership inference attack's numbers: its advantage and AUROC."""
  return {'advantage': mia_advantage(member_scores, non_member_scores),
          'auroc': float(_auditor(member_scores, non_member_scores).attack_auroc()),
          'members': int(len(member_scores)), 'non_members': int(len(non_member_scores))}
