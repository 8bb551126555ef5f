"""System heterogeneity: which clients are online, drop out, straggle or lose their upload, and
a simulated clock from each client's device, for every method (docs/algorithm.md §10).

The `system` config section is off by default (`enabled` is False), and then nothing here runs:
a run is the ideal federation it always was, number for number. With it on, each round of each
seed is drawn on the host, before training, from the run's own streams (`round_draws`, a pure
function of (seed, round)), so every store, mesh and packing of seeds, and a resumed run, sees
the same draws:

1. **Availability**: client i is online in round t with probability p_i (`availability`, the same
   for all, or drawn once per run from a Beta of mean `availability` and standard deviation
   `availability_spread`), or p_i(t) from a trace file (`availability_trace`). The cohort is
   K = floor(C N) clients drawn uniformly among the online ones (all of them if fewer are).
2. **Dropout**: a sampled client drops out before training with probability `dropout`: it
   neither trains nor uploads, and its stored model and state do not change.
3. **Stragglers**: a client that trains is a straggler with probability `straggler_rate`, and
   then runs only floor(f S) of its S local steps (S over all E epochs), f ~ U[min_work, 1]:
   its first floor(f S) steps of the usual schedule, a per-client bound inside the vmapped loop.
4. **Lost uploads**: a client that trained loses its upload with probability `upload_loss`. It
   keeps its trained model; the server never sees the upload.
5. **The clock** (`device_tiers` or `device_profile`): a client of speed s FLOP/s and download
   and upload bandwidths b_d, b_u bytes/s spends 4 D / b_d + F / s + 4 U / b_u simulated
   seconds, D and U being the floats it receives and sends and F its FLOPs this round, as the
   engine counts them. With a `deadline`, an upload that would arrive later is dropped like a
   lost one. A round lasts as long as its slowest training client, at most the deadline.

The server of every method aggregates the uploads that arrived (`SystemInputs` carries the
draws into a chunk's call, which receives only those).
"""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import struct

from fedssa_jax.errors import ConfigError, require, require_one_of
from fedssa_jax.streams import ProfileDraw, Stream, SystemDraw

BYTES_PER_FLOAT = 4  # uploads and downloads are float32


# Illustrative device tiers (not measurements): name, training FLOP/s, download and upload
# bytes/s, share of the clients. Slowest first.
TIER_PRESETS = {
    'three_tiers': 'low:1e9:2.5e6:1.25e6:0.3;mid:5e9:6.25e6:2.5e6:0.4;high:2e10:1.25e7:6.25e6:0.3',
}
TIER_ASSIGNMENTS = ('random', 'model')


def default_config() -> ml_collections.ConfigDict:
  s = ml_collections.ConfigDict()
  s.availability = 1.0          # P(a client is online in a round); the mean, with a spread
  s.availability_spread = 0.0   # > 0: client i's P(online) ~ Beta(mean availability, this std),
                                # drawn once per run
  s.availability_trace = ''     # a file of P(online) [N clients, T rounds] (.npy, or .csv with a
                                # row per client); round t reads column t mod T (0/1: a trace)
  s.dropout = 0.0               # P(a sampled client drops out before training)
  s.straggler_rate = 0.0        # P(a training client is a straggler) ...
  s.min_work = 0.0              # ... which runs floor(f S) of its S steps, f ~ U[min_work, 1]
  s.upload_loss = 0.0           # P(a trained client's upload is lost)
  s.device_tiers = ''           # the clock: '' (none), a preset (TIER_PRESETS: 'three_tiers') or
                                # 'name:flops:down:up:share;...' (FLOP/s, bytes/s, shares sum 1)
  s.device_profile = ''         # ... or a .csv, a row per client: flops,down,up (a header ok)
  s.tier_assignment = 'random'  # tiers to clients: 'random' (per run), or 'model' (the cheapest
                                # models on the slowest tier: model follows device)
  s.deadline = 0.0              # simulated seconds the server waits (0: for every client)
  s.client_seconds = False      # records list each participant's simulated seconds
  return s


def enabled(s: ml_collections.ConfigDict) -> bool:
  """Whether the section changes anything: a run with it off is the ideal federation."""
  return (s.availability < 1 or bool(s.availability_trace) or s.dropout > 0
          or s.straggler_rate > 0 or s.upload_loss > 0 or has_clock(s))


def has_clock(s: ml_collections.ConfigDict) -> bool:
  return bool(s.device_tiers or s.device_profile)


def equal_chances(s: ml_collections.ConfigDict) -> bool:
  """Whether every client is as likely as any other to be in a round's cohort: no spread of
  availability and no trace. Client-level DP's amplification by sampling in central mode
  assumes it (engine/uplink.py's `upload_accountant`); dropout, stragglers, lost uploads and
  a deadline only remove uploads, with chances that do not depend on the data."""
  return not (s.availability_spread > 0 or s.availability_trace)


# ----------------------------------------------------------------------------------------------
# Config: parsing and checks (ConfigError naming the fix)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Tier:
  name: str
  flops: float   # training FLOP/s
  down: float    # download bytes/s
  up: float      # upload bytes/s
  share: float   # of the clients


def parse_tiers(spec: str) -> list[Tier]:
  """The tiers of `system.device_tiers` (a preset's name or 'name:flops:down:up:share;...')."""
  text = TIER_PRESETS.get(spec, spec)
  tiers = []
  for part in filter(None, (p.strip() for p in text.replace('\n', ';').split(';'))):
    fields = part.split(':')
    require(len(fields) == 5,
            f"system.device_tiers: {part!r} is not 'name:flops:down:up:share' (training FLOP/s, "
            f"download and upload bytes/s, share of the clients), e.g. 'low:1e9:2.5e6:1.25e6:0.3'; "
            f'or use a preset: {", ".join(TIER_PRESETS)}.')
    try:
      numbers = [float(x) for x in fields[1:]]
    except ValueError:
      raise ConfigError(f'system.device_tiers: {part!r} has a field that is not a number; '
                        "each tier is 'name:flops:down:up:share'.") from None
    tiers.append(Tier(fields[0], *numbers))
  require(tiers, 'system.device_tiers names no tier.')
  for t in tiers:
    for what, v in (('speed (FLOP/s)', t.flops), ('download bandwidth', t.down),
                    ('upload bandwidth', t.up)):
      require(np.isfinite(v) and v > 0,
              f'system.device_tiers: tier {t.name!r} has {what} {v:g}; it must be > 0.')
    require(0 <= t.share <= 1, f'system.device_tiers: tier {t.name!r} has share {t.share:g}; '
            'shares are fractions of the clients, in [0, 1].')
  total = sum(t.share for t in tiers)
  require(abs(total - 1) < 1e-6, f'system.device_tiers: the shares sum to {total:g}; make them '
          'sum to 1.')
  return tiers


def read_trace(path: str, num_clients: int) -> np.ndarray:
  """The availability trace [N, T] of P(online), from a .npy or a .csv (a row per client)."""
  require(os.path.isfile(path), f'system.availability_trace: no file {path!r}. Give a .npy or '
          '.csv file with a row per client and a column per round (docs/configuration.md).')
  try:
    trace = (np.load(path) if path.endswith('.npy')
             else np.loadtxt(path, delimiter=',', ndmin=2))
  except (ValueError, OSError) as e:
    raise ConfigError(f'system.availability_trace: cannot read {path!r} ({e}). Give a .npy '
                      'array or a .csv of numbers, a row per client.') from None
  trace = np.asarray(trace, np.float64)
  if trace.ndim == 1 and num_clients == 1:
    trace = trace[None]
  require(trace.ndim == 2 and trace.shape[0] == num_clients and trace.shape[1] >= 1,
          f'system.availability_trace: {path!r} has shape {trace.shape}; it needs one row per '
          f'client and a column per round: [{num_clients}, T].')
  require(np.isfinite(trace).all() and (trace >= 0).all() and (trace <= 1).all(),
          f'system.availability_trace: {path!r} holds values outside [0, 1]; each is a client\'s '
          'probability of being online in a round (0 or 1 for a recorded trace).')
  return trace


def read_profile(path: str, num_clients: int) -> np.ndarray:
  """The device profile [N, 3] (FLOP/s, download and upload bytes/s), from a .csv."""
  require(os.path.isfile(path), f'system.device_profile: no file {path!r}. Give a .csv with a '
          'row per client: flops,down,up.')
  try:
    with open(path) as f:
      lines = [l for l in f.read().splitlines() if l.strip()]
    if lines and not _is_number(lines[0].split(',')[0]):
      lines = lines[1:]  # a header
    profile = np.array([[float(x) for x in l.split(',')] for l in lines], np.float64)
  except ValueError as e:
    raise ConfigError(f'system.device_profile: cannot read {path!r} ({e}); each row is '
                      'flops,down,up.') from None
  require(profile.ndim == 2 and profile.shape == (num_clients, 3),
          f'system.device_profile: {path!r} has shape {profile.shape}; it needs a row per client '
          f'and three columns (flops,down,up): [{num_clients}, 3].')
  require(np.isfinite(profile).all() and (profile > 0).all(),
          f'system.device_profile: {path!r} has a speed or bandwidth <= 0; each must be > 0.')
  return profile


def check_config(s: ml_collections.ConfigDict, num_clients: int) -> None:
  """Every field of the section, and the files it names, before any data is loaded."""
  for field in ('availability', 'dropout', 'straggler_rate', 'min_work', 'upload_loss'):
    require(0 <= s[field] <= 1, f'system.{field} must be in [0, 1], got {s[field]}; it is a '
            'probability' + (' (a fraction of the local steps).' if field == 'min_work' else '.'))
  require(s.availability > 0 or s.availability_trace,
          'system.availability=0 leaves no client online: set it in (0, 1].')
  require(s.availability_spread >= 0,
          f'system.availability_spread must be >= 0, got {s.availability_spread}.')
  if s.availability_spread > 0:
    m, sd = s.availability, s.availability_spread
    require(0 < m < 1 and sd ** 2 < m * (1 - m),
          f'system.availability_spread={sd} is too wide for mean availability={m}: a Beta of '
          f'that mean has a standard deviation below sqrt(m (1 - m)) = '
          f'{np.sqrt(max(m * (1 - m), 0)):.4g}. Lower the spread, or set it to 0.')
  if s.availability_trace:
    require(s.availability == 1 and s.availability_spread == 0,
          'system.availability_trace replaces system.availability: leave availability at 1 '
          'and availability_spread at 0 with a trace.')
    read_trace(s.availability_trace, num_clients)
  require_one_of('system.tier_assignment', s.tier_assignment, TIER_ASSIGNMENTS)
  require(not (s.device_tiers and s.device_profile),
          'system.device_tiers and system.device_profile both give the devices: set one.')
  if s.device_tiers:
    parse_tiers(s.device_tiers)
  if s.device_profile:
    read_profile(s.device_profile, num_clients)
  require(s.deadline >= 0, f'system.deadline must be > 0 simulated seconds, or 0 for none; got '
          f'{s.deadline}.')
  require(not s.deadline or has_clock(s),
          'system.deadline needs a clock: set system.device_tiers (e.g. three_tiers) or '
          'system.device_profile.')
  require(not s.client_seconds or has_clock(s),
          'system.client_seconds needs a clock: set system.device_tiers or system.device_profile.')


def _is_number(text: str) -> bool:
  try:
    float(text)
    return True
  except ValueError:
    return False


# ----------------------------------------------------------------------------------------------
# The draws (host side)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RoundDraws:
  """One seed's round of the federation, drawn before training: per client [N]. The cohort is
  then sampled among the online clients (engine/schedule.py's sample_cohort), and those that
  drop out leave it."""
  online: np.ndarray    # bool
  dropped: np.ndarray   # bool: drops out if sampled
  work: np.ndarray      # float32: the fraction f of its local steps it runs if it trains
  lost: np.ndarray      # bool: its upload is lost if it trains

  def cohort(self, sampled: np.ndarray) -> np.ndarray:
    """The clients of `sampled` (sorted ids) that train: those that do not drop out."""
    return sampled[~self.dropped[sampled]]


class System:
  """A run's federation: its config, each seed's per-client profile (P(online), devices), and
  each round's draws."""

  def __init__(self, s: ml_collections.ConfigDict, num_clients: int, seeds,
               model_flops: np.ndarray):
    """`model_flops` [N]: each client's model's training FLOPs per sample (the order of
    tier_assignment='model')."""
    self.config = s
    self.num_clients = n = num_clients
    self.trace = read_trace(s.availability_trace, n) if s.availability_trace else None
    self.clock = has_clock(s)
    self.deadline = float(s.deadline) if s.deadline else np.inf
    self.p_online = {seed: self._p_online(seed) for seed in seeds}
    self.devices = {seed: self._devices(seed, np.asarray(model_flops)) for seed in seeds}

  def _p_online(self, seed: int) -> np.ndarray:
    s, n = self.config, self.num_clients
    if s.availability_spread > 0:
      m, sd = s.availability, s.availability_spread
      kappa = m * (1 - m) / sd ** 2 - 1
      return _rng(seed, Stream.SYSTEM_PROFILE, ProfileDraw.AVAILABILITY).beta(m * kappa, (1 - m) * kappa, n)
    return np.full(n, float(s.availability))

  def _devices(self, seed: int, model_flops: np.ndarray) -> np.ndarray:
    """[N, 3]: each client's FLOP/s and download and upload bytes/s (ones without a clock)."""
    s, n = self.config, self.num_clients
    if s.device_profile:
      return read_profile(s.device_profile, n)
    if not s.device_tiers:
      return np.ones((n, 3))
    tiers = sorted(parse_tiers(s.device_tiers), key=lambda t: t.flops)
    counts = _apportion([t.share for t in tiers], n)
    if s.tier_assignment == 'model':  # cheapest models first, ties by client id
      order = np.lexsort((np.arange(n), model_flops))
    else:
      order = _rng(seed, Stream.SYSTEM_PROFILE, ProfileDraw.TIERS).permutation(n)
    out = np.empty((n, 3))
    start = 0
    for t, c in zip(tiers, counts):
      out[order[start:start + c]] = (t.flops, t.down, t.up)
      start += c
    return out

  def round_draws(self, seed: int, t: int) -> RoundDraws:
    """Seed `seed`'s round `t`: who is online, who drops out if sampled, who straggles and how
    much, whose upload is lost. Every client's draw is made every round, so one client's draws
    do not depend on the others'."""
    s, n = self.config, self.num_clients
    p = self.trace[:, t % self.trace.shape[1]] if self.trace is not None else self.p_online[seed]
    straggler = _rng(seed, Stream.SYSTEM, t, SystemDraw.STRAGGLER).random(n) < s.straggler_rate
    f = s.min_work + (1 - s.min_work) * _rng(seed, Stream.SYSTEM, t, SystemDraw.WORK).random(n)
    return RoundDraws(
        online=_rng(seed, Stream.SYSTEM, t, SystemDraw.ONLINE).random(n) < p,
        dropped=_rng(seed, Stream.SYSTEM, t, SystemDraw.DROPOUT).random(n) < s.dropout,
        work=np.where(straggler, f, 1.0).astype(np.float32),
        lost=_rng(seed, Stream.SYSTEM, t, SystemDraw.UPLOAD_LOSS).random(n) < s.upload_loss)

  def device_inputs(self, seeds, train_flops: np.ndarray) -> SystemInputs:
    """What a chunk's call takes of the devices, the same every round ([R, N] arrays; the
    round's draws None): `train_flops` [N], each client's training FLOPs per processed
    sample."""
    dev = np.stack([self.devices[s] for s in seeds]).astype(np.float32)
    r = len(seeds)
    return SystemInputs(
        work=None, lost=None,
        train_flops=np.broadcast_to(np.asarray(train_flops, np.float32),
                                    (r, self.num_clients)).copy(),
        speed=dev[..., 0], down=dev[..., 1], up=dev[..., 2],
        deadline=np.full(r, self.deadline, np.float32))


def _rng(seed: int, *path: int) -> np.random.Generator:
  return np.random.default_rng([seed, *map(int, path)])


def _apportion(shares, n: int) -> list[int]:
  """Whole client counts for `shares` of n (largest remainders), summing to n."""
  exact = np.asarray(shares, np.float64) * n
  counts = np.floor(exact).astype(int)
  for i in np.argsort(-(exact - counts), kind='stable')[:n - counts.sum()]:
    counts[i] += 1
  return counts.tolist()


# ----------------------------------------------------------------------------------------------
# In a chunk's call (device side)
# ----------------------------------------------------------------------------------------------
@struct.dataclass
class SystemInputs:
  """A round's federation as a chunk's call takes it: per client [N] (a seed's), all data, so
  the compiled program does not change with the draws."""
  work: jax.Array         # fraction of its local steps each client runs (1: all)
  lost: jax.Array         # bool: its upload is lost
  train_flops: jax.Array  # training FLOPs per processed sample (its model's)
  speed: jax.Array        # FLOP/s
  down: jax.Array         # download bytes/s
  up: jax.Array           # upload bytes/s
  deadline: jax.Array     # scalar: simulated seconds the server waits (inf: no deadline)


def step_bound(work: jax.Array, steps: jax.Array) -> jax.Array:
  """floor(f S): the local steps a client with work fraction f runs of its S (float32)."""
  return jnp.floor(work * steps.astype(jnp.float32)).astype(jnp.int32)


def client_seconds(sys_in: SystemInputs, ids, down_floats, up_floats, flops) -> jax.Array:
  """Each client's simulated seconds: download, training FLOPs (`flops`, all its FLOPs of the
  round), upload."""
  return (BYTES_PER_FLOAT * down_floats / sys_in.down[ids] + flops / sys_in.speed[ids]
          + BYTES_PER_FLOAT * up_floats / sys_in.up[ids])


def round_seconds(seconds: np.ndarray, deadline: float) -> float:
  """A round's simulated seconds from its training clients' (`seconds`): the server waits for
  the slowest, at most until the deadline; 0 without a client."""
  return float(min(np.max(seconds, initial=0.0), deadline))
