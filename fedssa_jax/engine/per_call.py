"""How many clients each training call holds, chosen by measurement (engine.clients_per_call=-1).

`engine.clients_per_call` > 0 fixes a group's chunk size; 0 keeps the fixed rule of
schedule.make_groups (one client a call on the CPU; on accelerators the group's expected share of
the cohort); -1 (`MEASURE`) times the group's own training call on the machine at hand for each
candidate chunk size (1, 2, 4, ... up to the rule's cap, min(group size, K), each rounded up to a
multiple of the device count, and the rule's value) and keeps the fastest. The numbers do not
depend on the choice beyond float rounding (a chunk trains each client as alone).

A candidate P is timed by calls of P clients of the group (the same jitted function as a round's,
vmapped over the seeds; the first call compiles and is not timed) at two step counts per client,
`STEPS`, each the fastest of `REPEATS`: the difference gives the seconds per step of a call,
the rest the seconds per call besides the steps (`Timing`). A round of the group then costs, per
call, those fixed seconds plus the steps of its client with the most (`round_seconds`: the
chunks take the group's clients in decreasing order of training-set size, schedule.chunks), for
the group's expected share of the cohort. The candidates are tried in increasing order, after
the rule's own value, and the scan ends at one `SLOWER` times the best before it or once the
run's `BUDGET_S` is spent (compiles included).

The timings are cached in a JSON file (`cache_path`: $FEDSSA_JAX_CACHE_DIR, else
$XDG_CACHE_HOME/fedssa_jax or ~/.cache/fedssa_jax), keyed by the machine (backend, device kind
and count, host, JAX version) and what the call computes (family, method and its section, the
training settings that shape a step, seeds packed, image shape): another run or a sweep on the
same machine times nothing again, and one with a larger cohort times only the new candidates.
A cache file that cannot be read is ignored with a warning. A run's choice is written to its
workdir (`FILE`, docs/outputs.md), and a resumed run takes it from there.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedssa_jax.engine.state import ChunkInputs

MEASURE = -1
FILE = 'clients_per_call.json'
CACHE_FORMAT = 1
STEPS = (2, 6)     # steps per client of the two timed calls (times local_epochs)
REPEATS = 3        # each timed call's fastest of
BUDGET_S = 90.0    # a run's measuring, compiles included: past it no candidate is tried
SLOWER = 1.1       # a candidate this much slower than the best smaller one ends the scan
PLAUSIBLE = 0.25   # the least share of a call's seconds per step that its slope may be


@dataclasses.dataclass(frozen=True)
class Timing:
  step_s: float  # seconds per step of a call (the chunk's clients step together)
  call_s: float  # seconds per call besides its steps


def candidates(cap: int, rows: Callable[[int], int]) -> list[int]:
  """1, 2, 4, ... below `cap`, and `cap`, each rounded by `rows` (to the device count)."""
  out, p = {rows(cap)}, 1
  while p < cap:
    out.add(rows(p))
    p *= 2
  return sorted(out)


def call_steps(steps: np.ndarray, per_call: int) -> np.ndarray:
  """The steps of each call when clients of `steps` are cut into chunks of `per_call` in
  decreasing order: the largest of each chunk (a vmapped loop runs to its longest client)."""
  return np.sort(np.asarray(steps))[::-1][::per_call]


def round_seconds(t: Timing, steps: np.ndarray, per_call: int) -> float:
  s = call_steps(steps, per_call)
  return float(len(s) * t.call_s + t.step_s * s.sum())


def typical_steps(steps: np.ndarray, share: float) -> np.ndarray:
  """The steps of the group's expected sampled clients: `share` of its members' `steps`
  (K / N of them, at least one), spread evenly over their sorted values."""
  s = np.sort(np.asarray(steps))[::-1]
  m = max(1, int(round(len(s) * share)))
  return s[np.linspace(0, len(s) - 1, m).round().astype(int)]


def choose(cands: list[int], rule: int, steps: np.ndarray,
           timing: Callable[[int], Timing | None]) -> tuple[int, dict]:
  """(the fastest of `cands` for clients of `steps`, {P: its Timing and round seconds}).
  `timing(P)` gives P's timing (cached or measured), None once the budget is spent. `rule`,
  the fixed rule's value, is timed first: the choice is never one found slower than it."""
  table = {}

  def add(p):
    t = timing(p)
    if t is not None:
      table[p] = {'step_s': t.step_s, 'call_s': t.call_s,
                  'round_s': round_seconds(t, steps, p)}
    return t is not None

  add(rule)
  scan_best = None
  for p in cands:
    if p not in table and not add(p):
      break
    est = table[p]['round_s']
    if scan_best is not None and est > SLOWER * scan_best:
      break
    scan_best = est if scan_best is None else min(scan_best, est)
  if not table:
    return rule, table
  return min(table, key=lambda p: (table[p]['round_s'], p)), table


# ----------------------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------------------

def cache_path() -> str:
  root = os.environ.get('FEDSSA_JAX_CACHE_DIR') or os.path.join(
      os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache'),
      'fedssa_jax')
  return os.path.join(root, FILE)


def machine() -> dict:
  d = jax.local_devices()[0]
  return {'backend': jax.default_backend(), 'device_kind': d.device_kind,
          'local_devices': jax.local_device_count(), 'host': platform.node(),
          'cpus': os.cpu_count(), 'jax': jax.__version__}


# TrainConfig fields that change no step's program, only its numbers.
_NUMBERS_ONLY = ('lr', 'momentum', 'weight_decay', 'adam_b1', 'adam_b2', 'mean', 'std',
                 'clip_norm')


def group_key(config, family: str, train_cfg, num_seeds: int, image_shape, num_classes: int,
              devices: int) -> tuple[str, dict]:
  """(the cache key of a group's training call on this machine, what it is made of)."""
  cfg = {k: v for k, v in dataclasses.asdict(train_cfg).items() if k not in _NUMBERS_ONLY}
  section = config.get(config.method)
  what = {
      'machine': machine(), 'mesh_devices': devices, 'family': family,
      'method': config.method,
      'method_config': section.to_dict() if hasattr(section, 'to_dict') else None,
      'model': {k: v for k, v in config.model.to_dict().items() if k != 'families'},
      'compute_dtype': config.engine.compute_dtype,
      'matmul_precision': config.engine.matmul_precision, 'train': cfg,
      'clip': train_cfg.clip_norm > 0, 'seeds': num_seeds, 'image_shape': list(image_shape),
      'num_classes': num_classes, 'system': bool(config.system.get('enabled', False)),
      'privacy': config.privacy.to_dict()}
  text = json.dumps(what, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:20], what


class Cache:
  """{key: {'what': ..., 'timings': {P: Timing fields}}} in a JSON file; a file that cannot be
  read is ignored (a warning) and rewritten on the next save."""

  def __init__(self, path: str):
    self.path = path
    self.entries = {}
    if not os.path.exists(path):
      return
    try:
      with open(path) as f:
        saved = json.load(f)
      if saved.get('format') != CACHE_FORMAT:
        raise ValueError(f'format {saved.get("format")!r}, not {CACHE_FORMAT}')
      for entry in saved['entries'].values():
        for t in entry['timings'].values():
          Timing(float(t['step_s']), float(t['call_s']))
      self.entries = saved['entries']
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
      logging.warning('Ignoring the clients-per-call cache %s, which cannot be read (%s); the '
                      'calls are timed again and the file rewritten.', path, e)

  def get(self, key: str, p: int) -> Timing | None:
    t = self.entries.get(key, {}).get('timings', {}).get(str(p))
    return None if t is None else Timing(float(t['step_s']), float(t['call_s']))

  def put(self, key: str, what: dict, p: int, t: Timing) -> None:
    entry = self.entries.setdefault(key, {'what': what, 'timings': {}})
    entry['timings'][str(p)] = dataclasses.asdict(t)

  def save(self) -> None:
    try:
      os.makedirs(os.path.dirname(self.path), exist_ok=True)
      fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix='.tmp')
      with os.fdopen(fd, 'w') as f:
        json.dump({'format': CACHE_FORMAT, 'entries': self.entries}, f, indent=1)
      os.replace(tmp, self.path)
    except OSError as e:
      logging.warning('The clients-per-call cache %s cannot be written (%s).', self.path, e)


# ----------------------------------------------------------------------------------------------
# Timing a call
# ----------------------------------------------------------------------------------------------

def time_calls(run: Callable[[int], None], steps: tuple[int, int], repeats: int = REPEATS,
               clock: Callable[[], float] = time.perf_counter) -> Timing:
  """The Timing of `run(s)` (one call of s steps per client, returning when done): the first
  call compiles (untimed), then the fastest of `repeats` calls at each of the two `steps`. A
  slope under PLAUSIBLE times the longer call's mean seconds per step is taken for noise (the
  machine busier during the shorter calls): the mean, with no fixed part, is used instead."""
  lo, hi = steps
  run(lo)
  best = {lo: np.inf, hi: np.inf}
  for _ in range(repeats):
    for s in (lo, hi):
      t0 = clock()
      run(s)
      best[s] = min(best[s], clock() - t0)
  step_s, mean = (best[hi] - best[lo]) / max(hi - lo, 1), best[hi] / hi
  if step_s < PLAUSIBLE * mean:  # more steps for (almost) nothing: a load spike, not a rate
    return Timing(step_s=float(mean), call_s=0.0)
  return Timing(step_s=float(step_s), call_s=float(max(best[lo] - lo * step_s, 0.0)))


def client_steps(train_n: np.ndarray, train_cfg, held_out: int) -> np.ndarray:
  """Each client's local steps in a round (training.local_train): E ceil(n / B), or E floor
  with drop_last, of its trainable split."""
  n, b = np.maximum(np.asarray(train_n) - held_out, 0), train_cfg.batch_size
  per_epoch = n // b if train_cfg.drop_last else -(-n // b)
  return train_cfg.local_epochs * per_epoch


def chunk_runner(sim, g, train_chunk: Callable, jit_call: Callable, p: int) -> Callable:
  """`run(s)` for `time_calls`: one call of `train_chunk` (jitted by `jit_call`, as the store's
  calls) on P of the group's clients, those with the most data (repeated where the group has
  fewer), every one trained, each on at most s steps of its data; its rows fed back in. Uses the
  Simulator's data, initial state and round-0 federation draws; the run's state is untouched."""
  place, r = sim.placement, sim.num_seeds
  slots = np.resize(np.argsort(-sim.train_n[0][g.members], kind='stable'), p)
  ids = g.members[slots]
  call = jit_call(train_chunk)
  stack = lambda trees: jax.tree.map(lambda *a: jnp.stack(a), *trees)
  rows = place.to_device(stack([sim.initial.group(g, slots, i) for i in range(r)]), stacked=True)
  cstate = place.to_device(stack([sim.initial.client_state(ids, i) for i in range(r)]),
                           stacked=True)
  carry = [rows, cstate, sim.initial.servers(sim.seen)]
  draws = [sim.federation(0, i)[0] for i in range(r)]
  system_inputs = sim.uplink.federation.inputs(sim.system_devices, draws, place)
  b, q = sim.train_cfg.batch_size, sim.method.held_out_samples
  shape = (r, p)

  def run(s):
    data = dataclasses.replace(sim.data, train_n=place.replicate(
        jnp.asarray(np.minimum(sim.train_n, s * b + q))))
    inputs = ChunkInputs(
        slots=jnp.asarray(np.broadcast_to(slots, shape), jnp.int32),
        ids=jnp.asarray(np.broadcast_to(ids, shape), jnp.int32), active=jnp.ones(shape, bool),
        seen=sim.seen_dev, data=data, round_index=jnp.asarray(0, jnp.int32),
        root_key=sim.root_keys, system=system_inputs)
    *carry[:3], stats = call(*carry, inputs)
    jax.block_until_ready((carry, stats))
  return run


def measure_group(sim, g, p: int, *, make_chunk: Callable, jit_call: Callable) -> Timing:
  """The Timing of group `g`'s training call of `p` clients (`make_chunk(g)`: its train_chunk),
  per local step."""
  t = time_calls(chunk_runner(sim, g, make_chunk(g), jit_call, p), STEPS)
  return Timing(step_s=t.step_s / sim.train_cfg.local_epochs, call_s=t.call_s)


def choose_groups(sim, groups: list, measure: Callable[[object, int], Timing],
                  recorded: dict | None = None, cache: Cache | None = None,
                  clock: Callable[[], float] = time.perf_counter) -> tuple[list, dict]:
  """(`groups` with their measured clients_per_call, what `FILE` records of it). `groups` hold
  the rule's values; `measure(g, p)` times a candidate (measure_group); `recorded`, the choice
  of the run's workdir ({family: P}, a resumed run's), is taken as it is; `cache` (default: the
  file at cache_path()) holds the timings of earlier runs."""
  setting, rules = MEASURE, [g.clients_per_call for g in groups]
  if recorded is not None and all(g.family in recorded for g in groups):
    chosen = [dataclasses.replace(g, clients_per_call=recorded[g.family]) for g in groups]
    logging.info('Clients per call, as the workdir records: %s.', _listing(chosen))
    return chosen, record(setting, 'workdir', chosen, [{}] * len(groups), rules, 0.0)
  if jax.process_count() > 1:  # every process must make the same calls: no measuring
    logging.warning('engine.clients_per_call=-1 measures in one process only; across %d '
                    'processes the fixed rule applies (set the value to fix it).',
                    jax.process_count())
    return groups, record(setting, 'rule', groups, [{}] * len(groups), rules, 0.0)
  cache = cache if cache is not None else Cache(cache_path())
  steps = client_steps(sim.train_n[0], sim.train_cfg, sim.method.held_out_samples)
  start, measured = clock(), []
  chosen, tables = [], []
  for g, rule in zip(groups, rules):
    key, what = group_key(sim.config, g.family, sim.train_cfg, sim.num_seeds, sim.image_shape,
                          sim.num_classes, sim.placement.num_devices)

    def timing(p, g=g, key=key, what=what):
      t = cache.get(key, p)
      if t is None and clock() - start <= BUDGET_S:
        t = measure(g, p)
        cache.put(key, what, p, t)
        measured.append((g.family, p))
      return t
    best, table = choose(candidates(min(g.size, sim.k), sim.placement.rows), rule,
                         typical_steps(steps[g.members], sim.k / sim.num_clients), timing)
    chosen.append(dataclasses.replace(g, clients_per_call=best))
    tables.append(table)
  if measured:
    cache.save()
  seconds = clock() - start
  source = 'measured' if measured else 'cache'
  logging.info('Clients per call (%s, %.1f s; est. s/round of each candidate): %s.', source,
               seconds, '; '.join(
                   f'{g.family} {g.clients_per_call} of ' + (', '.join(
                       f'{p}: {row["round_s"]:.3g}' for p, row in sorted(table.items()))
                       or 'none timed (the budget spent): the rule\'s')
                   for g, table in zip(chosen, tables)))
  return chosen, record(setting, source, chosen, tables, rules, seconds)


def _listing(groups) -> str:
  return ', '.join(f'{g.family} {g.clients_per_call}' for g in groups)


def record(setting: int, source: str, groups: list, tables: list, rules: list,
           seconds: float) -> dict:
  """What `FILE` holds: the setting, where the choice came from, each group's choice, the
  rule's value and the candidates compared."""
  return {
      'setting': setting, 'source': source, 'measure_seconds': round(seconds, 3),
      'groups': [{'family': g.family, 'clients': g.size, 'clients_per_call': g.clients_per_call,
                  'rule': rule,
                  'candidates': {str(p): {k: round(v, 6) for k, v in row.items()}
                                 for p, row in table.items()}}
                 for g, table, rule in zip(groups, tables, rules)]}


def read_record(workdir: str | None) -> dict | None:
  """{family: clients_per_call} of the choice recorded in `workdir`, None if there is none
  readable (a warning where the file exists but cannot be read)."""
  path = workdir and os.path.join(workdir, FILE)
  if not path or not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      return {g['family']: int(g['clients_per_call']) for g in json.load(f)['groups']}
  except (OSError, ValueError, KeyError, TypeError) as e:
    logging.warning('Ignoring %s, which cannot be read (%s): clients per call measured again.',
                    path, e)
    return None
