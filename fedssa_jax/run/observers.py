"""The run's observers: what follows a run round by round beside the engine, keeps a state of
its own for each seed, and adds its fields to the outputs: the system section (the clock's
simulated seconds, the federation's draws), DP-SGD's accountant and the uploads' accountant.

The round loop (train.py) knows none of them by name. `watching(sim)` is the list of a run's
observers, those of the sections that are on (an observer that is off is not in it), and the
loop calls, for each of them and each seed i that goes on (a packed seed that diverged stops):

- `initial()`: seed i's state before its first round. A state is the observer's own and
  JSON-able: a seed's outputs.Progress keeps it under the observer's `name` (`observers`), and
  the seed's checkpoint with it, so that a resumed run goes on from it.
- `observe(i, info, state)`, after each round (info: engine.state.RoundInfo of seed i: its
  cohort, train_steps, system draws, upload_norms, ...): the state after that round.
- `record(i, info, state)`: the fields the observer adds to an evaluated round's metrics.jsonl
  record (docs/outputs.md); `console(info, record)`: what it adds to the round's console line
  (record None: the round is not evaluated).
- `summary(state, history)`: its fields of summary.json; `derived(i)`: its facts of
  config.json's `derived`.
- `stops(rounds_done, states)`: before round rounds_done + 1, whether the run ends now (the
  states, seed index -> state, of the seeds that go on; an observer that ends the run notes it
  in them and says why in the log). DP-SGD's budget ends a run so.

Every hook but `name` has a default that adds nothing. The order of `watching` is the order of
the fields in the outputs. A checkpoint written before the observers (their states at the top
level of its progress: sim_seconds, dp_steps, budget_reached, upload_releases) is read by
`old_layout`.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

from fedssa_jax import privacy

# The observers' names: their keys in a seed's progress and checkpoint.
SYSTEM, DP_SGD, UPLOAD_DP = 'system', 'dp_sgd', 'upload_dp'


class Observer:
  """The hooks the round loop calls (the module docstring); each default adds nothing."""
  name: str

  def initial(self) -> Any:
    return None

  def observe(self, i: int, info, state):
    del i, info
    return state

  def record(self, i: int, info, state) -> dict:
    del i, info, state
    return {}

  def console(self, info, record: dict | None) -> str:
    del info, record
    return ''

  def summary(self, state, history: list[dict]) -> dict:
    del state, history
    return {}

  def derived(self, i: int) -> dict:
    del i
    return {}

  def stops(self, rounds_done: int, states: dict[int, Any]) -> bool:
    del rounds_done, states
    return False


def watching(sim) -> list[Observer]:
  """The observers of `sim`'s run (a simulator.Simulator), those of its sections that are on,
  in the order of their fields in the outputs."""
  out = []
  if sim.system is not None:
    out.append(SystemSection(sim.system, sim.config, sim.seeds))
  if sim.privacy is not None:
    out.append(DPSGDAccounting(sim.privacy, sim.num_clients, sim.cohort,
                               sim.train_cfg.dp.max_batch, sim.config))
  if sim.upload_privacy is not None:
    out.append(UploadAccounting(sim.upload_privacy, sim.num_clients,
                                sim.config.privacy.upload_clip, sim.config.privacy.delta))
  return out


def initial_states(observers: list[Observer], saved: dict | None = None) -> dict:
  """{name: state} of a seed: each observer's from `saved` (a checkpoint's), else its initial
  one. The states of observers not in the list are left out."""
  saved = saved or {}
  return {o.name: saved[o.name] if o.name in saved else o.initial() for o in observers}


def old_layout(progress: dict) -> dict:
  """The observers' states in a checkpoint's progress written before them, which held them at
  its top level (sim_seconds, dp_steps, budget_reached, upload_releases)."""
  out = {SYSTEM: {'sim_seconds': progress.get('sim_seconds', 0.0)}}
  if progress.get('dp_steps'):
    out[DP_SGD] = {'steps': progress['dp_steps'],
                   'budget_reached': progress.get('budget_reached', False)}
  if progress.get('upload_releases'):
    out[UPLOAD_DP] = {'releases': progress['upload_releases']}
  return out


# ----------------------------------------------------------------------------------------------
# The system section
# ----------------------------------------------------------------------------------------------
class SystemSection(Observer):
  """The federation (the system section on): each round's draws in its record, and with a
  clock, the simulated seconds so far. State: {'sim_seconds': the seconds so far}."""
  name = SYSTEM

  def __init__(self, federation, config, seeds):
    """`federation`: the run's system.System; `seeds`: the seed of each seed index."""
    self.federation, self.config, self.seeds = federation, config, seeds

  def initial(self) -> dict:
    return {'sim_seconds': 0.0}

  def observe(self, i, info, state) -> dict:
    if info.system is not None and info.system.round_seconds is not None:
      return {**state, 'sim_seconds': state['sim_seconds'] + info.system.round_seconds}
    return state

  def record(self, i, info, state) -> dict:
    if info.system is None:
      return {}
    return system_fields(info.system, state['sim_seconds'], self.config.system.client_seconds)

  def console(self, info, record) -> str:
    s = info.system
    return '' if s is None else f', {len(s.received)}/{len(s.sampled)} uploads received'

  def summary(self, state, history) -> dict:
    # With the clock: the simulated seconds of the run.
    if history and 'cum_sim_seconds' in history[-1]:
      return {'cum_sim_seconds': state['sim_seconds']}
    return {}

  def derived(self, i) -> dict:
    # The clock: each client's device (FLOP/s, download and upload bytes/s), and with
    # availability_spread its own probability of being online.
    seed = self.seeds[i]
    return {
        **({'client_device': self.federation.devices[seed].tolist()}
           if self.federation.clock else {}),
        **({'client_p_online': self.federation.p_online[seed].tolist()}
           if self.config.system.availability_spread else {}),
    }


def system_fields(s, sim_seconds: float, client_seconds: bool) -> dict:
  """A record's fields of the federation (the system section on): who was online, sampled,
  dropped out, straggled, lost or was late with an upload, and with a clock, the simulated
  seconds (each participant's too with `client_seconds`)."""
  out = {
      'online': s.online, 'sampled': s.sampled.tolist(), 'dropped': s.dropped.tolist(),
      'stragglers': s.stragglers.tolist(), 'straggler_work': s.work.tolist(),
      'lost_uploads': s.lost.tolist(), 'late_uploads': s.late.tolist(),
      'received': s.received.tolist(),
  }
  if s.round_seconds is not None:
    out.update(sim_seconds=s.round_seconds, cum_sim_seconds=sim_seconds)
    if client_seconds:
      out['client_sim_seconds'] = s.seconds.tolist()
  return out


# ----------------------------------------------------------------------------------------------
# The accountants (the privacy section)
# ----------------------------------------------------------------------------------------------
class DPSGDAccounting(Observer):
  """DP-SGD's accountant (privacy.Accountant) over the rounds. State: {'steps': each client's
  DP-SGD steps so far, 'releases': the private releases each made so far (its method's at the
  start, and its releases each round it was in the cohort), 'budget_reached': whether the run
  ended before num_rounds because a further round could take a client past
  privacy.target_epsilon}. A state written before the releases were counted has none: its
  clients' releases are derived from their steps (`releases`)."""
  name = DP_SGD

  def __init__(self, accountant: privacy.Accountant, num_clients: int,
               cohort: Callable[[int, int], np.ndarray], max_batch: int, config):
    """`cohort(t, i)`: seed i's clients that train in round t (simulator.Simulator.cohort);
    `max_batch`: the rows of a Poisson batch; `config`: the run's (its num_rounds, and
    privacy.delta as it gives it)."""
    self.accountant, self.num_clients, self.cohort = accountant, num_clients, cohort
    self.max_batch, self.delta = max_batch, config.privacy.delta
    self.num_rounds = config.num_rounds

  def initial(self) -> dict:
    return {'steps': [0] * self.num_clients,
            'releases': [self.accountant.releases_at_start] * self.num_clients,
            'budget_reached': False}

  def releases(self, i, state) -> np.ndarray:
    """Seed i's clients' private releases so far: the state's, or, in a state without them,
    those of the rounds each client's steps show it trained (a full round's steps a round)."""
    if 'releases' in state:
      return np.asarray(state['releases'], np.int64)
    per_round = np.maximum(self.accountant.round_steps[i], 1)
    return self.accountant.releases_after(-(-np.asarray(state['steps'], np.int64) // per_round))

  def observe(self, i, info, state) -> dict:
    steps = np.array(state['steps'], np.int64)
    releases = self.releases(i, state)
    steps[info.cohort] += np.asarray(info.train_steps, np.int64)
    releases[info.cohort] += self.accountant.releases_per_round
    return {**state, 'steps': steps.tolist(), 'releases': releases.tolist()}

  def record(self, i, info, state) -> dict:
    return privacy_fields(self.accountant.epsilons(i, state['steps'], self.releases(i, state)))

  def console(self, info, record) -> str:
    return f', epsilon {record["dp_epsilon"]:.3g}' if record else ''

  def summary(self, state, history) -> dict:
    # The run's final epsilon (its largest client's), and whether the budget ended it.
    if history and 'dp_epsilon' in history[-1]:
      return {'dp_epsilon': history[-1]['dp_epsilon'], 'dp_delta': self.delta,
              'privacy_budget_reached': state['budget_reached']}
    return {}

  def derived(self, i) -> dict:
    # The noise multiplier (given or calibrated), each client's Poisson rate and the rows a
    # batch may hold.
    return {'dp_noise_multiplier': self.accountant.noise_multiplier,
            'dp_release_noise_multiplier': self.accountant.release_noise_multiplier,
            'dp_sampling_rate': self.accountant.q[i].tolist(), 'dp_max_batch': self.max_batch}

  def stops(self, rounds_done, states) -> bool:
    """With a target and a given noise multiplier: whether round `rounds_done` + 1 could take a
    client of a seed's next cohort past it; then the run ends after `rounds_done` rounds."""
    acct = self.accountant
    if not acct.target:
      return False
    worst = [acct.next_round_exceeds(i, state['steps'], self.cohort(rounds_done, i),
                                     self.releases(i, state))
             for i, state in states.items()]
    if all(w is None for w in worst):
      return False
    for state in states.values():
      state['budget_reached'] = True
    logging.warning(
        'Privacy budget: round %d could take a client to epsilon %.4g, past privacy.'
        'target_epsilon=%g; the run ends after round %d of %d.', rounds_done + 1,
        max(w for w in worst if w is not None), acct.target, rounds_done, self.num_rounds)
    return True


class UploadAccounting(Observer):
  """Client-level DP's accountant on the uploads (privacy.UploadAccountant) over the rounds,
  and the round's upload norms before the clip. State: {'releases': each client's uploads sent
  so far (local mode; every trained client sends, whether or not its upload arrives), or the
  rounds run, the same for every client (central mode: each round releases the noised sum
  once)}."""
  name = UPLOAD_DP

  def __init__(self, accountant: privacy.UploadAccountant, num_clients: int, clip: float,
               delta: float):
    """`clip`: privacy.upload_clip; `delta`: privacy.delta, as the config gives them."""
    self.accountant, self.num_clients = accountant, num_clients
    self.clip, self.delta = clip, delta

  def initial(self) -> dict:
    return {'releases': [0] * self.num_clients}

  def observe(self, i, info, state) -> dict:
    releases = np.array(state['releases'], np.int64)
    if self.accountant.central:
      releases += 1
    else:
      releases[info.cohort] += 1
    return {**state, 'releases': releases.tolist()}

  def record(self, i, info, state) -> dict:
    return {**privacy_fields(self.accountant.epsilons(state['releases']), 'dp_upload_epsilon'),
            **({} if info.upload_norms is None else
               upload_norm_fields(info.upload_norms, self.clip))}

  def console(self, info, record) -> str:
    return f', upload epsilon {record["dp_upload_epsilon"]:.3g}' if record else ''

  def summary(self, state, history) -> dict:
    # The run's final epsilon (its largest client's).
    if history and 'dp_upload_epsilon' in history[-1]:
      return {'dp_upload_epsilon': history[-1]['dp_upload_epsilon'], 'dp_delta': self.delta}
    return {}

  def derived(self, i) -> dict:
    # The noise multiplier (given or calibrated).
    return {'dp_upload_noise_multiplier': self.accountant.noise_multiplier}


def privacy_fields(epsilons: np.ndarray, name: str = 'dp_epsilon') -> dict:
  """A record's fields of DP-SGD (or, with `name`, of the uploads): the run's epsilon (its
  largest client's: every client's data is at least that private) and the mean over the clients
  that spent any."""
  spent = epsilons[epsilons > 0]
  return {name: float(epsilons.max(initial=0.0)),
          f'{name}_mean': float(spent.mean()) if len(spent) else 0.0}


def upload_norm_fields(norms: np.ndarray, clip: float) -> dict:
  """A record's diagnostic of the uploads' clip (client-level DP): the median of the round's
  upload norms before the clip, and the share of them the clip shortened. A simulator's view for
  choosing privacy.upload_clip, not something the server sees."""
  return {'dp_upload_norm_median': float(np.median(norms)) if len(norms) else 0.0,
          'dp_upload_clipped': float((norms > clip).mean()) if len(norms) else 0.0}
