"""The accountants (host side): DP-SGD's (`Accountant`: each client's epsilon from the steps it
ran composed with the private releases it made (releases.py), and the noise multiplier, given or
calibrated to a target) and client-level DP's on the
uploads (`UploadAccountant`: epsilon from the releases), both by Google's `dp_accounting`. They
count nothing themselves: the run loop keeps the steps and releases so far, in each seed's
checkpoint, and asks them for epsilon."""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Callable

import ml_collections
import numpy as np

from fedssa_jax.errors import ConfigError, require
from fedssa_jax.privacy.mechanisms import sampling_rate

# The largest noise multiplier calibration may choose.
MAX_NOISE_MULTIPLIER = 1e3


# ----------------------------------------------------------------------------------------------
# DP-SGD's accountant
# ----------------------------------------------------------------------------------------------
def dp_sgd_event(q: float, noise_multiplier: float, steps: int):
  """`steps` DP-SGD steps of Poisson rate q and noise sigma, as a dp_accounting event."""
  import dp_accounting
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(float(q), dp_accounting.GaussianDpEvent(
          float(noise_multiplier))), int(steps))


def new_accountant(kind: str):
  from dp_accounting.pld import pld_privacy_accountant
  from dp_accounting.rdp import rdp_privacy_accountant
  return (rdp_privacy_accountant.RdpAccountant() if kind == 'rdp'
          else pld_privacy_accountant.PLDAccountant())


class _NoConvergenceNotes(logging.Filter):
  def filter(self, record):
    return 'failed to converge' not in record.getMessage()


@contextlib.contextmanager
def _quiet():
  """dp_accounting's RDP accountant logs a warning for every Renyi order it leaves out (where
  its series does not converge, at small orders and large rates); those orders only loosen the
  bound, so the console leaves them out."""
  absl_logger, note = logging.getLogger('absl'), _NoConvergenceNotes()
  absl_logger.addFilter(note)
  try:
    yield
  finally:
    absl_logger.removeFilter(note)


def release_event(noise_multiplier: float, releases: int):
  """`releases` private releases (releases.py), each a Gaussian mechanism of noise std
  `noise_multiplier` times its sensitivity (z_r for a table of sensitivity C_r and noise std z_r
  C_r; z_r / 2 for a whole output clipped to C_r, whose sensitivity is 2 C_r), as a
  dp_accounting event."""
  import dp_accounting
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.GaussianDpEvent(float(noise_multiplier)), int(releases))


def client_event(q: float, noise_multiplier: float, steps: int,
                 release_noise_multiplier: float = 0.0, releases: int = 0):
  """A client's events: its `steps` DP-SGD steps and its `releases` private releases, composed
  (dp_accounting's ComposedDpEvent; the steps alone without releases)."""
  import dp_accounting
  steps_event = dp_sgd_event(q, noise_multiplier, steps)
  if releases <= 0:
    return steps_event
  if steps <= 0:  # releases alone (FedGen's counts, before a client first trains)
    return release_event(release_noise_multiplier, releases)
  return dp_accounting.ComposedDpEvent(
      [steps_event, release_event(release_noise_multiplier, releases)])


@functools.lru_cache(maxsize=4096)
def epsilon(kind: str, q: float, noise_multiplier: float, steps: int, delta: float,
            release_noise_multiplier: float = 0.0, releases: int = 0) -> float:
  """epsilon at `delta` of `steps` DP-SGD steps composed with `releases` private releases
  (client_event) by `kind`'s accountant."""
  if steps <= 0 and releases <= 0:
    return 0.0
  acct = new_accountant(kind)
  with _quiet():
    acct.compose(client_event(q, noise_multiplier, max(int(steps), 0),
                              release_noise_multiplier, releases))
    return float(acct.get_epsilon(delta))


def _smallest_noise(new_acct: Callable, event_of: Callable, target: float, delta: float, *,
                    field: str, events: str, fix: str) -> float:
  """dp_accounting's calibration: the smallest noise multiplier z with which `event_of(z)`
  stays within `target` at `delta`; a ConfigError that names the config `field`, the `events`
  and the `fix` where none up to MAX_NOISE_MULTIPLIER does."""
  import dp_accounting
  from dp_accounting.mechanism_calibration import NoBracketIntervalFoundError
  try:
    with _quiet():
      z = dp_accounting.calibrate_dp_mechanism(
          new_acct, event_of, target, delta, dp_accounting.LowerEndpointAndGuess(0.01, 1.0),
          tol=1e-4)
  except (ValueError, RuntimeError, NoBracketIntervalFoundError) as e:
    raise ConfigError(f'{field}={target} cannot be met: no noise multiplier was found for '
                      f'{events} ({e}). {fix[0].upper()}{fix[1:]}') from None
  require(z <= MAX_NOISE_MULTIPLIER,
          f'{field}={target} needs a noise multiplier of {z:.4g}, above '
          f'{MAX_NOISE_MULTIPLIER:g}: {fix}')
  return float(z)


def calibrate(kind: str, schedules, target_epsilon: float, delta: float,
              release_noise_multiplier: float = 0.0, release_sensitivity: float = 1.0) -> float:
  """The smallest noise multiplier sigma with which every (q, steps) or (q, steps, releases) of
  `schedules` ends within `target_epsilon` at `delta` (dp_accounting's calibration), the
  releases' noise multiplier being `release_noise_multiplier` (0: sigma itself) over their
  sensitivity in units of their clip (`release_sensitivity`); ConfigError where none up to
  MAX_NOISE_MULTIPLIER does."""
  def event_of(q, steps, releases, sig):
    return client_event(q, sig, steps, (release_noise_multiplier or sig) / release_sensitivity,
                        releases)
  triples = sorted({(*s, 0) if len(s) == 2 else tuple(s) for s in schedules})
  return max(_smallest_noise(
      functools.partial(new_accountant, kind), functools.partial(event_of, q, steps, releases),
      target_epsilon, delta, field='privacy.target_epsilon',
      events=f'{steps} steps at sampling rate {q:.4g}'
             + (f' and {releases} private releases' if releases else ''),
      fix='raise the target' + (' or privacy.release_noise_multiplier (0: calibrated too)'
                                if releases and release_noise_multiplier else '')
          + ', or lower num_rounds or local_epochs.')
      for q, steps, releases in triples)


class Accountant:
  """A run's DP-SGD accounting, for each of its seeds (packed seeds share the compiled program,
  so one noise multiplier): each client's sampling rate and steps in a round, the noise
  multipliers (sigma, given or calibrated; the releases' z_r, given or sigma), and epsilon from
  the steps each client ran and the private releases it made: `releases` = (per round a client
  trains, at the start[, their sensitivity in units of the clip C_r: 1, or 2 for a whole output
  clipped]), the method's (releases.releases_of)."""

  def __init__(self, p: ml_collections.ConfigDict, train_n: np.ndarray, batch_size: int,
               local_epochs: int, num_rounds: int, releases: tuple = (0, 0)):
    """`train_n` [R, N]: each seed's clients' trainable samples (the n_k of their rates)."""
    self.kind, self.delta, self.target = p.accountant, float(p.delta), float(p.target_epsilon)
    n = np.atleast_2d(np.asarray(train_n))
    self.q = sampling_rate(batch_size, n).astype(np.float64)
    self.round_steps = local_epochs * ((n + batch_size - 1) // batch_size)
    self.releases_per_round, self.releases_at_start = map(int, releases[:2])
    self.release_sensitivity = float(releases[2]) if len(releases) > 2 else 1.0
    given_release = float(p.get('release_noise_multiplier', 0.0))
    if p.noise_multiplier > 0:
      self.noise_multiplier = float(p.noise_multiplier)
      self.release_noise_multiplier = given_release or self.noise_multiplier
      if self.target:
        first = max(self.epsilons(i, s, self.releases_after(s > 0)).max(initial=0.0)
                    for i, s in enumerate(self.round_steps))
        require(first <= self.target,
                f'privacy.target_epsilon={self.target:g} cannot be met: one round of DP-SGD '
                f'already spends epsilon {first:.4g} at noise_multiplier='
                f'{self.noise_multiplier:g}. Raise the noise multiplier or the target, or set '
                'privacy.noise_multiplier=0 to calibrate it.')
    else:  # every client training every round ends within the target
      alone = epsilon(self.kind, 1.0, 1.0, 0, self.delta, given_release / self.release_sensitivity,
                      int(self.releases_after(num_rounds))) if given_release else 0.0
      require(alone <= self.target,
              f'privacy.target_epsilon={self.target:g} cannot be met: the private releases '
              f'alone spend epsilon {alone:.4g} at release_noise_multiplier={given_release:g}. '
              'Raise it or the target, or set it to 0 to take the calibrated sigma.')
      self.noise_multiplier = calibrate(
          self.kind, [(float(q), int(s) * num_rounds, int(self.releases_after(num_rounds)))
                      for q, s in zip(self.q.ravel(), self.round_steps.ravel()) if s],
          self.target, self.delta, given_release, self.release_sensitivity)
      self.release_noise_multiplier = given_release or self.noise_multiplier

  @property
  def release_event_multiplier(self) -> float:
    """The releases' noise multiplier as dp_accounting's Gaussian events take it: z_r over
    their sensitivity in units of C_r."""
    return self.release_noise_multiplier / self.release_sensitivity

  def releases_after(self, rounds):
    """The private releases of a client that trained in `rounds` rounds (an int or an array)."""
    return self.releases_at_start + self.releases_per_round * np.asarray(rounds, np.int64)

  def client_epsilon(self, i: int, k: int, steps: int, releases: int = 0) -> float:
    """Seed i's client k's epsilon after `steps` DP-SGD steps and `releases` releases."""
    return epsilon(self.kind, float(self.q[i, k]), self.noise_multiplier, int(steps), self.delta,
                   self.release_event_multiplier, int(releases))

  def epsilons(self, i: int, steps, releases=None) -> np.ndarray:
    """Seed i's clients' epsilons after `steps` [N] DP-SGD steps and `releases` [N] private
    releases (None: none): one accounting per distinct (rate, steps, releases), however many
    clients share it."""
    releases = np.zeros(len(self.q[i])) if releases is None else releases
    rows, which = np.unique(np.stack([self.q[i], np.asarray(steps, np.float64),
                                      np.asarray(releases, np.float64)], axis=1),
                            axis=0, return_inverse=True)
    eps = [epsilon(self.kind, float(q), self.noise_multiplier, int(s), self.delta,
                   self.release_event_multiplier, int(r)) for q, s, r in rows]
    return np.asarray(eps)[which.reshape(-1)]

  def next_round_exceeds(self, i: int, steps, next_cohort, releases=None) -> float | None:
    """With a target: the largest epsilon a client of seed i's `next_cohort` would reach by
    running all its steps of a round, and its releases, after `steps` [N] and `releases` [N]
    (None: none), where that is above the target; else None."""
    if not self.target:
      return None
    releases = np.zeros(len(self.q[i]), np.int64) if releases is None else releases
    worst = max((self.client_epsilon(i, k, steps[k] + self.round_steps[i, k],
                                     releases[k] + self.releases_per_round)
                 for k in next_cohort), default=0.0)
    return worst if worst > self.target else None


# ----------------------------------------------------------------------------------------------
# Client-level DP's accountant (the uploads)
# ----------------------------------------------------------------------------------------------
def upload_event(noise_multiplier: float, releases: int, num_clients: int = 0, cohort: int = 0):
  """`releases` releases of uploads clipped to C_u with noise std z C_u (`noise_multiplier` z),
  as a dp_accounting event. Replacing one client's data moves its clipped upload by up to
  2 C_u, so each is a Gaussian mechanism of noise multiplier z / 2; in central mode (`cohort`
  > 0) it runs on a cohort of `cohort` of the `num_clients` clients drawn without replacement."""
  import dp_accounting
  event = dp_accounting.GaussianDpEvent(float(noise_multiplier) / 2)
  if 0 < cohort < num_clients:
    event = dp_accounting.SampledWithoutReplacementDpEvent(int(num_clients), int(cohort), event)
  return dp_accounting.SelfComposedDpEvent(event, int(releases))


def _upload_accountant(kind: str, sampled: bool):
  if not sampled:
    return new_accountant(kind)
  from dp_accounting import privacy_accountant
  from dp_accounting.rdp import rdp_privacy_accountant
  return rdp_privacy_accountant.RdpAccountant(
      neighboring_relation=privacy_accountant.NeighboringRelation.REPLACE_ONE)


@functools.lru_cache(maxsize=4096)
def upload_epsilon(kind: str, noise_multiplier: float, releases: int, delta: float,
                   num_clients: int = 0, cohort: int = 0) -> float:
  """epsilon at `delta` of `releases` upload releases (upload_event) by `kind`'s accountant."""
  if releases <= 0:
    return 0.0
  acct = _upload_accountant(kind, 0 < cohort < num_clients)
  with _quiet():
    acct.compose(upload_event(noise_multiplier, releases, num_clients, cohort))
    return float(acct.get_epsilon(delta))


class UploadAccountant:
  """A run's client-level accounting: the noise multiplier z (given or calibrated) and the
  noise std, and epsilon from the releases so far. Local: each client's own uploads sent.
  Central: the rounds, each a release of the population's sum (one epsilon for every client)."""

  def __init__(self, p: ml_collections.ConfigDict, num_clients: int, cohort: int,
               num_rounds: int):
    self.kind, self.delta = p.accountant, float(p.delta)
    self.central = p.upload_mode == 'central'
    self.num_clients, self.cohort = int(num_clients), int(cohort) if self.central else 0
    self.target = float(p.upload_target_epsilon)
    require(not (self.kind == 'pld' and 0 < self.cohort < self.num_clients),
            "privacy.upload_mode='central' with a cohort smaller than the population composes "
            "a sampling without replacement, which the PLD accountant does not take: use "
            "privacy.accountant='rdp'.")
    if p.upload_noise_multiplier > 0:
      self.noise_multiplier = float(p.upload_noise_multiplier)
    else:
      self.noise_multiplier = self._calibrate(num_rounds)
    self.std = self.noise_multiplier * float(p.upload_clip)

  def _calibrate(self, num_rounds: int) -> float:
    """The smallest z with which `num_rounds` releases stay within the target."""
    sampled = 0 < self.cohort < self.num_clients
    return _smallest_noise(
        lambda: _upload_accountant(self.kind, sampled),
        lambda z: upload_event(z, num_rounds, self.num_clients, self.cohort),
        self.target, self.delta, field='privacy.upload_target_epsilon',
        events=f'{num_rounds} rounds', fix='raise the target, or lower num_rounds.')

  def epsilons(self, releases) -> np.ndarray:
    """Each client's epsilon after `releases` [N] (local: the uploads each sent; central: the
    rounds run, the same for all)."""
    releases = np.asarray(releases, np.int64)
    counts, which = np.unique(releases, return_inverse=True)
    eps = [upload_epsilon(self.kind, self.noise_multiplier, int(r), self.delta,
                          self.num_clients, self.cohort) for r in counts]
    return np.asarray(eps)[which.reshape(-1)]
