"""A sweep's finished runs, read back from their folders and grouped by setting and method: what
report.py tabulates and plots.py draws; and its diverged ones, which report.py lists; and what a
run's records say: the costs and the epsilon it reached, its clock, its backend."""
from __future__ import annotations

import collections
import dataclasses
import json
import os

from fedssa_jax import config_lib, methods as methods_lib
from fedssa_jax.run.outputs import DIVERGED_FILE


METHOD_ORDER = tuple(methods_lib.METHODS)  # registration order: FedSSA, then the baselines


REFERENCE_METHOD = 'fedssa'


@dataclasses.dataclass(frozen=True)
class Setting:
  """What a run was run on, apart from the method and the seed."""
  dataset: str
  models: str           # 'homo' (one family) or 'hetero'
  num_clients: int
  participation: float
  partition: str        # '' (the data set's default pathological k), 'k=4', 'Dir(0.1)'
  scheme: str           # '' (reference pools) or '8:1:1'
  system: str = ''      # '' (the ideal federation), or the system section's (system_label)
  privacy: str = ''     # '' (no differential privacy), or the privacy section's (privacy_label)

  @property
  def column(self) -> str:
    """The label within a table of one model setting."""
    parts = [self.dataset, f'N={self.num_clients}, C={self.participation * 100:g}%']
    parts += [p for p in (self.partition, self.scheme, self.system, self.privacy) if p]
    return ' '.join(parts)

  @property
  def label(self) -> str:
    return f'{self.column} {self.models}'

  @property
  def slug(self) -> str:
    text = f'{self.dataset}_{self.models}_n{self.num_clients}_c{self.participation:g}'
    text += ''.join(f'_{p}' for p in (self.partition, self.scheme, self.system, self.privacy)
                    if p)
    return file_part(text)

  def sort_key(self):
    return (self.dataset, self.models, self.num_clients, -self.participation,
            self.partition.split('=')[0], _number_in(self.partition), self.scheme, self.system,
            self.privacy.split(' ε')[0], _number_in(self.privacy.split(' ε')[-1]), self.privacy)


def file_part(text: str) -> str:
  """`text` as part of a file name: letters, digits and ._- kept, anything else '_'."""
  return ''.join(ch if ch.isalnum() or ch in '._-' else '_' for ch in text)


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
  # A run that diverged: its diverged.json (the round, the message, the train loss); its
  # summary is then empty and its metrics the rounds before.
  diverged: dict | None = None


def reached(r: Run, target: float | None = None) -> dict | None:
  """The run's costs at the first evaluated round whose mean accuracy reaches `target` (round,
  cum_floats, cum_client_flops), from its history; None if it never did. Without `target`,
  the run's own (summary.json, at its config's target_accuracy)."""
  if target is None:
    return r.summary.get('to_target')
  for x in r.metrics:
    if x.get('mean_accuracy') is not None and x['mean_accuracy'] >= target:
      return {k: x[k] for k in ('round', 'cum_floats', 'cum_client_flops', 'cum_sim_seconds')
              if k in x}
  return None


def has_clock(r: Run) -> bool:
  """Whether the run's records carry the system section's simulated seconds."""
  return any('cum_sim_seconds' in x for x in r.metrics)


def reached_epsilon(r: Run) -> float | None:
  """The epsilon a private run's summary reports (its largest client's), or for a run that
  diverged its last record; None if absent."""
  reported = r.summary if r.diverged is None else (r.metrics[-1] if r.metrics else {})
  for key in ('dp_epsilon', 'dp_upload_epsilon'):
    if reported.get(key) is not None:
      return float(reported[key])
  return None


def backend_of(r: Run) -> str:
  """The backend a run ran on ('cpu', 'gpu', 'tpu'; '?' in records from before it was kept)."""
  return r.derived.get('backend') or '?'


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
                 '8:1:1' if p['scheme'] == 'paper' else '', system_label(config),
                 privacy_label(config))


def system_label(config: dict) -> str:
  """The system section of a run's config in a few words ('' when off, or absent: a run from
  before the section): e.g. 'lost 30%', 'stragglers 50% (f >= 0.2)', 'devices three_tiers
  (model), deadline 90 s'."""
  s = {**config_lib.base_config(config['dataset']).system.to_dict(), **config.get('system', {})}
  parts = []
  if s['availability_trace']:
    parts.append(f'trace {os.path.basename(s["availability_trace"])}')
  elif s['availability'] < 1:
    spread = f' ± {s["availability_spread"]:g}' if s['availability_spread'] else ''
    parts.append(f'online {s["availability"] * 100:g}%{spread}')
  if s['dropout']:
    parts.append(f'dropout {s["dropout"] * 100:g}%')
  if s['straggler_rate']:
    parts.append(f'stragglers {s["straggler_rate"] * 100:g}% (f >= {s["min_work"]:g})')
  if s['upload_loss']:
    parts.append(f'lost {s["upload_loss"] * 100:g}%')
  if s['device_tiers'] or s['device_profile']:
    devices = s['device_tiers'] or os.path.basename(s['device_profile'])
    parts.append(f'devices {devices}' + (' (model)' if s['tier_assignment'] == 'model' else ''))
  if s['deadline']:
    parts.append(f'deadline {s["deadline"]:g} s')
  return ', '.join(parts)


@dataclasses.dataclass(frozen=True)
class Budget:
  """A run's differential privacy, as the privacy table reads it: the mechanism ('DP-SGD',
  'upload DP, local', 'upload DP, central'), its clip, and the target epsilon its noise was
  calibrated to (None: a noise multiplier given instead, `noise`)."""
  mechanism: str
  clip: float
  target: float | None
  noise: float | None
  delta: float


def privacy_budget(config: dict) -> Budget | None:
  """The run's Budget; None without differential privacy (or from before the section)."""
  p = config.get('privacy') or {}
  if p.get('dp_sgd'):
    target, noise = p['target_epsilon'], p['noise_multiplier']
    return Budget('DP-SGD', p['clip_norm'], target or None, None if target else noise,
                  p['delta'])
  if p.get('upload'):
    target, noise = p['upload_target_epsilon'], p['upload_noise_multiplier']
    return Budget(f'upload DP, {p["upload_mode"]}', p['upload_clip'], target or None,
                  None if target else noise, p['delta'])
  return None


def privacy_label(config: dict) -> str:
  """The privacy section of a run's config in a few words ('' when off), e.g. 'DP-SGD clip 1
  ε 4' (the noise calibrated to epsilon 4 at the run's delta) or 'upload DP, local clip 0.03
  σ 1.1'."""
  b = privacy_budget(config)
  if b is None:
    return ''
  return f'{b.mechanism} clip {b.clip:g} ' + (f'ε {b.target:g}' if b.target else f'σ {b.noise:g}')


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
  """(finished runs, folders with a config.json but neither summary.json nor diverged.json):
  load_sweep without the runs that diverged."""
  runs, _, unfinished = load_sweep(sweep_dir)
  return runs, unfinished


def load_sweep(sweep_dir: str) -> tuple[list[Run], list[Run], list[str]]:
  """(finished runs, runs that diverged, folders with a config.json but neither summary.json nor
  diverged.json yet). A diverged run has `diverged` set (its diverged.json) and an empty
  summary."""
  runs, diverged, unfinished = [], [], []
  for folder, dirs, files in os.walk(sweep_dir):
    dirs[:] = sorted(d for d in dirs if d not in ('checkpoints', 'report', 'jobs'))
    if 'config.json' not in files:
      continue
    if 'summary.json' in files:
      with open(os.path.join(folder, 'summary.json')) as f:
        summary, failed = json.load(f), None
    elif DIVERGED_FILE in files:
      with open(os.path.join(folder, DIVERGED_FILE)) as f:
        summary, failed = {}, json.load(f)
    else:
      unfinished.append(folder)
      continue
    with open(os.path.join(folder, 'config.json')) as f:
      cfg = json.load(f)
    metrics = []
    if 'metrics.jsonl' in files:
      with open(os.path.join(folder, 'metrics.jsonl')) as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    config = cfg['config']
    setting = setting_of(config)
    run = Run(folder, config, cfg.get('derived', {}), summary, metrics, setting,
              method_label(config, setting.models), config['seed'], failed)
    (runs if failed is None else diverged).append(run)
  return runs, diverged, unfinished


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
