"""Named sweeps: the paper's experiments as lists of runs, for launch/sweep.py.

A run is a name, a config string (`configs/<dataset>.py:<variants>`) and `--config.*` overrides;
a sweep is a function returning its runs (methods x settings x seeds). Run names depend only on
the dataset, the variants, the overrides, the method and the seed, so two sweeps that share a
run give it the same name: pointing `--sweep_dir` of fig4, fig8 or comm_compute at table2's
folder reuses table2's runs instead of running them again.

  python launch/sweep.py --sweep=table2 --dry_run

Mapping of the paper's ablations to config options (docs/algorithm.md §4):
- without adaptive stabilisation = plain replacement of the seen rows by the global ones:
  `fedssa.mu0=0` (then mu_t = 0 in every round). `fedssa.fusion='reference'` is the official
  code's fusion, not the ablation.
- without class-wise aggregation = whole-header averaging: method `lg_fedavg` with
  `lg_fedavg.weighting='uniform'` (the server averages every participant's whole header,
  unweighted like FedSSA's class means, and each client's extractor stays local). It differs
  from "FedSSA minus class-wise aggregation" in one respect: LG-FedAvg evaluates with the
  global header and has no stabilisation schedule, which is the closest the methods provide.
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import os

METHODS = ('fedssa', 'standalone', 'fd', 'fedproto', 'fml', 'fedkd', 'lg_fedavg',
           'fedclassavg')
SEEDS = (0, 1, 2)
DATASETS = ('cifar10', 'cifar100')
PAPER_SETTINGS = ('n10', 'n50', 'n100')  # (N, C) = (10, 100%), (50, 20%), (100, 10%)

# Short names of overridden fields in run names; other fields use their last component.
_SHORT = {'partition.classes_per_client': 'k', 'partition.dirichlet_gamma': 'gamma',
          'participation': 'C', 'fedssa.mu0': 'mu0_', 'fedssa.t_stable': 'tstable',
          'lg_fedavg.weighting': 'w', 'save_representations': 'reps_',
          'num_rounds': 'R', 'local_epochs': 'E', 'batch_size': 'B', 'eval_every': 'ev',
          'optimizer.lr': 'lr', 'fedssa.scope': 'scope_', 'fedssa.initial_header': 'ih_',
          'system.upload_loss': 'loss', 'system.straggler_rate': 'strag',
          'system.min_work': 'minwork', 'system.dropout': 'drop', 'system.deadline': 'deadline',
          'privacy.dp_sgd': 'dp_', 'privacy.noise_multiplier': 'sigma',
          'privacy.target_epsilon': 'eps', 'privacy.upload': 'updp_',
          'privacy.upload_mode': 'mode_', 'privacy.upload_clip': 'uclip',
          'privacy.upload_noise_multiplier': 'usigma', 'privacy.upload_target_epsilon': 'ueps',
          'eval_global_images': 'glob', 'new_clients': 'new', 'new_client_epochs': 'newE',
          'privacy.clip_norm': 'clip', 'eval_validation': 'val_',
          'system.availability': 'avail', 'system.availability_spread': 'aspread',
          'system.device_tiers': 'tiers_'}


@dataclasses.dataclass(frozen=True)
class Run:
  name: str
  config: str                # e.g. 'configs/cifar10.py:hetero,n10'
  overrides: tuple = ()      # ((field, value), ...), sorted by field; includes method and seed

  @property
  def override_dict(self) -> dict:
    return dict(self.overrides)


def _value_text(v) -> str:
  if isinstance(v, bool):
    return str(v).lower()
  return str(v)


def make_run(dataset: str, variants: str, method: str, seed: int, **overrides) -> Run:
  """One run; overrides use '__' for '.' (partition__classes_per_client=4)."""
  fields = {k.replace('__', '.'): v for k, v in overrides.items()}
  parts = [dataset, *variants.split(',')]
  parts += [f'{_SHORT.get(k, k.rsplit(".", 1)[-1])}{_value_text(v)}'
            for k, v in sorted(fields.items())]
  parts += [method, f's{seed}']
  fields.update(method=method, seed=seed)
  return Run('-'.join(parts), f'configs/{dataset}.py:{variants}', tuple(sorted(fields.items())))


def grid(datasets, variants, methods=METHODS, seeds=SEEDS, override_sets=({},)) -> list[Run]:
  """Every combination of dataset, variant string, override set, method and seed."""
  return [make_run(d, v, m, s, **o) for d, v, o, m, s in
          itertools.product(datasets, variants, override_sets, methods, seeds)]


# ----------------------------------------------------------------------------------------------
# The sweeps
# ----------------------------------------------------------------------------------------------

def table1():
  """Table 1: model-homogeneous (CNN-1), 8 methods, both data sets, the three (N, C)."""
  return grid(DATASETS, [f'homo,{s}' for s in PAPER_SETTINGS])


def table2():
  """Table 2: model-heterogeneous (CNN-1..5), 8 methods, both data sets, the three (N, C)."""
  return grid(DATASETS, [f'hetero,{s}' for s in PAPER_SETTINGS])


def comm_compute():
  """Communication and computation to the target accuracy (a subset of table2's runs)."""
  return grid(DATASETS, ['hetero,n10'])


def fig4():
  """Figure 4: per-client accuracy box plots: table2's runs."""
  return table2()


def fig5():
  """Figure 5: t-SNE of every client's test representations, FedSSA vs FedProto, CIFAR-10."""
  return grid(['cifar10'], ['hetero,n10'], ('fedssa', 'fedproto'), (0,),
              [{'save_representations': True}])


def fig6_7():
  """Figures 6 and 7: robustness at (100, 10%), FedSSA vs FedProto: classes per client, and
  Dirichlet gamma. k * N / S must be whole (N=100: any k on either data set)."""
  vs = ('fedssa', 'fedproto')
  return (grid(['cifar10'], ['hetero,n100'], vs,
               override_sets=[{'partition__classes_per_client': k} for k in (2, 4, 6, 8, 10)])
          + grid(['cifar100'], ['hetero,n100'], vs,
                 override_sets=[{'partition__classes_per_client': k}
                                for k in (10, 30, 50, 70, 90, 100)])
          + grid(DATASETS, ['hetero,n100,dir'], vs,
                 override_sets=[{'partition__dirichlet_gamma': g}
                                for g in (0.1, 0.2, 0.3, 0.4, 0.5)]))


def appendix_participation():
  """Participation rate C at N=100, FedSSA vs FedProto, CIFAR-10 and CIFAR-100."""
  return grid(DATASETS, ['hetero,n100'], ('fedssa', 'fedproto'),
              override_sets=[{'participation': c} for c in (0.1, 0.2, 0.3, 0.5, 1.0)])


def appendix_ablation():
  """FedSSA, without adaptive stabilisation (mu0=0) and without class-wise aggregation
  (whole-header averaging, lg_fedavg uniform): see the module docstring."""
  settings = ['hetero,n10', 'hetero,n100']
  return (grid(DATASETS, settings, ('fedssa',))
          + grid(DATASETS, settings, ('fedssa',), override_sets=[{'fedssa__mu0': 0.0}])
          + grid(DATASETS, settings, ('lg_fedavg',),
                 override_sets=[{'lg_fedavg__weighting': 'uniform'}]))


def appendix_mu0():
  """FedSSA's mu0 in {0, 0.1, 0.3, 0.5, 0.7, 0.9, 1}, CIFAR-10 and CIFAR-100, hetero N=10."""
  return grid(DATASETS, ['hetero,n10'], ('fedssa',),
              override_sets=[{'fedssa__mu0': m} for m in (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0)])


def appendix_t_stable():
  """FedSSA's T_stable in {0, 1, 2, 5, 10, 20, 45}, CIFAR-10 and CIFAR-100, hetero N=10."""
  return grid(DATASETS, ['hetero,n10'], ('fedssa',),
              override_sets=[{'fedssa__t_stable': t} for t in (0, 1, 2, 5, 10, 20, 45)])


def fig8():
  """Figure 8: mean accuracy against rounds: table2's runs (the report plots every run)."""
  return table2()


# The partial-participation schedule: with E=1 and batch 512 a client of about 400 samples
# takes one step per participation (about 10 in 100 rounds at C=10%); E=5 at batch 64 over 60
# rounds gives it about 200.
PARTIAL_SCHEDULE = {'local_epochs': 5, 'batch_size': 64, 'num_rounds': 60, 'eval_every': 5}


def _partial_participation(models: str) -> list[Run]:
  setting = f'{models},n100'
  s = PARTIAL_SCHEDULE
  # Seed 0 of every method first, with its controls and ablations, so that a sweep cut short
  # already holds a complete one-seed comparison.
  return ([r for seed in SEEDS for r in grid(['cifar10'], [setting], seeds=(seed,),
                                              override_sets=[s])]
          # Controls: a method that only rescales the cross-entropy step shows up against these.
          + grid(['cifar10'], [setting], ('standalone',), (0,),
                 [{**s, 'optimizer__lr': lr} for lr in (0.0025, 0.01)])
          # FedSSA's own ablations at this setting.
          + grid(['cifar10'], [setting], ('fedssa',), (0,),
                 [{**s, 'fedssa__scope': 'participants'}, {**s, 'fedssa__initial_header': False},
                  {**s, 'fedssa__mu0': 0.0}]))


def partial():
  """(N, C) = (100, 10%) on CIFAR-10, heterogeneous: 8 methods x seeds 0-2 at
  PARTIAL_SCHEDULE; Standalone at lr 0.0025 and 0.01 (seed 0); FedSSA with
  scope=participants, initial_header=False and mu0=0 (seed 0). 29 runs."""
  return _partial_participation('hetero')


def partial_homo():
  """The same at (100, 10%) with every client CNN-1 (29 runs)."""
  return _partial_participation('homo')


def small():
  """A small check of the whole pipeline: 3 methods x 2 seeds, CIFAR-10, hetero N=10, 2 rounds
  of one local epoch."""
  return grid(['cifar10'], ['hetero,n10'], ('fedssa', 'standalone', 'fedproto'), (0, 1),
              [{'num_rounds': 2, 'local_epochs': 1}])


def tiny():
  """FedSSA's three seeds on the tiny config (5 clients, 3 rounds): a sweep of seconds, for smoke
  checks of the launcher (tests/sweep_test.py kills it and its runs)."""
  return grid(['cifar10'], ['hetero,tiny'], ('fedssa',))


# Every method of the registry (fedssa_jax/methods/__init__.py), the paper's eight first.
ALL_METHODS = METHODS + ('fedgh', 'fedtgp', 'fedl2g', 'fedmrl')
# With the methods of 2025 (FedSA, FedORGP) and FedGen: the cross-device sweep's.
ALL_FIFTEEN = ALL_METHODS + ('fedsa', 'fedorgp', 'fedgen')
# The system section's conditions (docs/algorithm.md §10) beside the ideal federation.
SYSTEM_CONDITIONS = (
    {},
    {'system__upload_loss': 0.3},
    {'system__straggler_rate': 0.5, 'system__min_work': 0.2},
    {'system__dropout': 0.3},
)
SYSTEM_SCHEDULE = {'local_epochs': 1, 'num_rounds': 20}


# FedL2G's warm-up in 20-round runs: a tenth of them, as its default of 50 is a tenth of its
# 500-round schedules (docs/results.md, "All twelve methods").
FEDL2G_SHORT = {'fedl2g__warmup': 2}


def system():
  """Under system heterogeneity: the twelve methods at hetero,n10, E = 1, 20 rounds, in the
  ideal federation and under lost uploads (0.3), stragglers (0.5, min_work 0.2) and dropout
  (0.3). Seed 0 of every method and condition first, method by method, so that a sweep cut
  short holds whole rows of the table; then seeds 1 and 2. 144 runs."""
  return [r for seed in SEEDS for m in ALL_METHODS
          for r in grid(['cifar10'], ['hetero,n10'], (m,), (seed,),
                        [{**SYSTEM_SCHEDULE, **(FEDL2G_SHORT if m == 'fedl2g' else {}), **c}
                         for c in SYSTEM_CONDITIONS])]


# The devices scenario's deadline. At E = 1 on hetero,n10's 4,000 samples a client, the slowest
# tier's (1 GFLOP/s) CNN-5 and CNN-4 clients train about 62 and 71 simulated seconds, the fastest
# tier's CNN-1 clients about 6 s: every client of a method that trains one model arrives, while
# a method that trains a second model beside its own (FML, FedKD, FedMRL) takes about twice as
# long and loses its slow clients' uploads.
DEVICES_DEADLINE = 90.0


def system_devices():
  """Model follows device (the `devices` variant: three_tiers, the cheapest models on the
  slowest tier) with a deadline of DEVICES_DEADLINE simulated seconds: FedSSA and the seven
  baselines at hetero,n10, E = 1, 20 rounds, seed 0. Accuracy against simulated time."""
  return grid(['cifar10'], ['hetero,n10,devices'], METHODS, (0,),
              [{**SYSTEM_SCHEDULE, 'system__deadline': DEVICES_DEADLINE}])


# Under differential privacy: the methods of docs/results.md's privacy-utility table, and the
# budgets epsilon (delta 1e-5) each is calibrated to over the 20 rounds.
PRIVACY_METHODS = ('fedssa', 'standalone', 'fd', 'fedproto', 'fedgh')
PRIVACY_EPSILONS = (1.0, 4.0, 8.0)


# DP-SGD's control: the clip with almost no noise (sigma 0.01: each step's noise about 0.03 in
# norm against the clipped mean's 1 at most; epsilon about 1e6), which tells the clip's cost
# from the noise's. FedSSA's alone, as its cost in time is a DP-SGD run's.
CLIP_ONLY = {'privacy__dp_sgd': True, 'privacy__noise_multiplier': 0.01}


def privacy():
  """DP-SGD at hetero,n10, E = 1, 20 rounds: each method without DP-SGD (epsilon infinite: the
  `system` sweep's ideal runs, which share their names) and with the noise calibrated to each
  epsilon of PRIVACY_EPSILONS at delta 1e-5, seed 0; method by method, so that a sweep cut
  short holds whole rows of the table; FedSSA also with the clip alone (CLIP_ONLY)."""
  budgets = [{}] + [{'privacy__dp_sgd': True, 'privacy__noise_multiplier': 0.0,
                     'privacy__target_epsilon': e} for e in PRIVACY_EPSILONS]
  controls = lambda m: [CLIP_ONLY] if m == 'fedssa' else []
  return [r for m in PRIVACY_METHODS
          for r in grid(['cifar10'], ['hetero,n10'], (m,), (0,),
                        [{**SYSTEM_SCHEDULE, **b} for b in budgets + controls(m)])]


# Client-level DP on the uploads: each method's upload_clip, near the median norm its uploads
# (less their reference) had before any clip in round 4 of the run without noise, as their norms
# over rounds 1-4 were (commit b78dbbc): FedSSA's rows 0.42, 0.39, 0.10, 0.036 (from round 3 on
# the rows are the global ones plus one round's training); FD's logits 0.23, 1.1, 3.1, 4.1;
# FedProto's prototypes 1.3, 2.7, 9.2, 13; FedGH's 1.8, 4.3, 16, 29. The prototypes' and logits'
# norms still grow by round 4, so later rounds clip more of them.
UPLOAD_CLIPS = {'fedssa': 0.03, 'fd': 4.0, 'fedproto': 12.0, 'fedgh': 25.0}


def privacy_upload():
  """Client-level DP on the uploads at hetero,n10, E = 1, 20 rounds, seed 0: each method of
  UPLOAD_CLIPS in local mode, and FedSSA (scope participants), FD and FedProto in central mode
  (FedGH's server trains on each prototype and takes no central noise), with the noise
  calibrated to each epsilon of PRIVACY_EPSILONS at delta 1e-5 (the runs without DP are the
  `system` sweep's ideal runs, Standalone's the floor: it sends nothing)."""
  def budgets(method, mode):
    extra = {'fedssa__scope': 'participants'} if mode == 'central' else {}
    return [{**SYSTEM_SCHEDULE, **extra, 'privacy__upload': True, 'privacy__upload_mode': mode,
             'privacy__upload_clip': UPLOAD_CLIPS[method], 'privacy__upload_noise_multiplier': 0.0,
             'privacy__upload_target_epsilon': e} for e in PRIVACY_EPSILONS]
  cells = ([(m, 'local') for m in UPLOAD_CLIPS]
           + [(m, 'central') for m in ('fedssa', 'fd', 'fedproto')])
  return [r for m, mode in cells
          for r in grid(['cifar10'], ['hetero,n10'], (m,), (0,), budgets(m, mode))]


# The cross-device runs: 50 rounds, evaluated every 5 (each evaluation also tests every client on
# 500 global test images and trains and tests the 100 new clients, which never take part).
CROSS_DEVICE_SCHEDULE = {'num_rounds': 50, 'eval_every': 5, 'eval_global_images': 500,
                         'new_clients': 0.1, 'new_client_epochs': 1}


def _cross_device(methods, conditions, seeds=(0,)) -> list[Run]:
  """Each of `methods` at hetero,n1000 with the lens of CROSS_DEVICE_SCHEDULE, at `seeds`, under
  each override set of `conditions`, method by method (FedL2G with a warm-up of a tenth of the
  rounds)."""
  return [r for m in methods for r in grid(
      ['cifar10'], ['hetero,n1000'], (m,), seeds,
      [{**CROSS_DEVICE_SCHEDULE, **({'fedl2g__warmup': 5} if m == 'fedl2g' else {}), **c}
       for c in conditions])]


def cross_device():
  """Cross-device scale: every method at hetero,n1000 (N = 1,000, C = 10% of the 900 that train,
  E = 1, the Dirichlet partition of the n1000 variant), CIFAR-10, seed 0, each at its defaults
  (FedL2G with a warm-up of a tenth of the rounds), with the lens of CROSS_DEVICE_SCHEDULE."""
  return _cross_device(ALL_FIFTEEN, [{}])


def cross_device_seeds():
  """The cross_device sweep's runs at seeds 1 and 2 (its table is seed 0's): with
  `--pack_seeds` each method's two seeds run as one program."""
  return _cross_device(ALL_FIFTEEN, [{}], seeds=(1, 2))


def cross_device_long():
  """FedSSA, Standalone and FedProto at hetero,n1000 for 300 rounds, evaluated every 25 with
  the lens of CROSS_DEVICE_SCHEDULE, seed 0: a client trains about one round in ten, so 50
  rounds leave every method at its clients' class priors (docs/results.md); these show
  whether sharing a header, or prototypes, gives a client more once the models learn."""
  return _cross_device(('fedssa', 'standalone', 'fedproto'),
                       [{'num_rounds': 300, 'eval_every': 25}])


# The cross-device federation of the system section (docs/algorithm.md §10), every mechanism at
# once: a client is online with its own probability (Beta, mean 0.8, std 0.1), a sampled one
# drops out with probability 0.1, a training one straggles with probability 0.3 (doing 20-100% of
# its steps), and the three_tiers clock (random tiers) with a deadline of 1 simulated second.
# At n1000 a client of about 40 samples trains in 0.02-0.6 s on those devices; what it sends
# sets the rest: FedSSA's participants arrive in 0.02-1.6 s (median 0.2; 1.0 s is its 90th
# percentile in round 1 without a deadline), FedKD's, which send a compressed global model, in
# 0.4-9.6 s (median 1.6) (commit of the sweep, 2 rounds each, client_seconds).
CROSS_DEVICE_SYSTEM = {'system__availability': 0.8, 'system__availability_spread': 0.1,
                       'system__dropout': 0.1, 'system__straggler_rate': 0.3,
                       'system__min_work': 0.2, 'system__device_tiers': 'three_tiers',
                       'system__deadline': 1.0}


def cross_device_system():
  """The cross_device sweep's fifteen methods under CROSS_DEVICE_SYSTEM."""
  return _cross_device(ALL_FIFTEEN, [CROSS_DEVICE_SYSTEM])


# Client-level DP on the uploads at n1000: each method's upload_clip near the median norm of its
# uploads (less their reference) in round 10 of 50 without noise and clip (commit of the sweep):
# FedSSA's rows 0.016, FD's logits 0.37, FedProto's prototypes 2.97, FedGH's 3.20. A client of
# about 40 samples trains 4 steps a round, so these are far below n10's (UPLOAD_CLIPS).
CROSS_DEVICE_UPLOAD_CLIPS = {'fedssa': 0.016, 'fd': 0.37, 'fedproto': 3.0, 'fedgh': 3.2}


def cross_device_upload():
  """Client-level DP on the uploads at n1000 (K = 90 of 900 a round share central noise),
  with the cross_device sweep's schedule and lens, seed 0: central mode for FedSSA (scope
  participants), FD and FedProto, then local mode for them and FedGH, each at
  CROSS_DEVICE_UPLOAD_CLIPS with the noise calibrated to each epsilon of PRIVACY_EPSILONS
  (delta 1e-5) over the 50 rounds; the runs without DP are the cross_device sweep's, and
  FedSSA's at scope participants, the first run here."""
  def budget(method, mode, eps):
    central_fedssa = mode == 'central' and method == 'fedssa'
    return {**({'fedssa__scope': 'participants'} if central_fedssa else {}),
            'privacy__upload': True, 'privacy__upload_mode': mode,
            'privacy__upload_clip': CROSS_DEVICE_UPLOAD_CLIPS[method],
            'privacy__upload_noise_multiplier': 0.0, 'privacy__upload_target_epsilon': eps}
  cells = ([(m, 'central') for m in ('fedssa', 'fd', 'fedproto')]
           + [(m, 'local') for m in CROSS_DEVICE_UPLOAD_CLIPS])
  # FedSSA's central runs average the round's participants' rows (scope participants), not
  # the cross_device run's table of every owner's latest: their run without DP is its own.
  return _cross_device(('fedssa',), [{'fedssa__scope': 'participants'}]) + [
      r for m, mode in cells
      for r in _cross_device((m,), [budget(m, mode, e) for e in PRIVACY_EPSILONS])]


# Tuning DP-SGD on validation (docs/results.md, "Under differential privacy"): the `privacy`
# sweep's setting and budgets, each run also tested on its clients' validation splits, which
# alone choose (fedssa_jax/run/tuning.py). With most examples' gradients clipped, a DP-SGD step
# is lr x C times a mean of unit vectors, so the grid pairs each clip with its own lrs, lr x C in
# {0.02, 0.06, 0.2} (the untuned runs' 0.005 x 1 moved their models too little; lr 0.05 at C = 1
# reached 78% at epsilon 8): small clips with large lrs, as De et al. (2022) advise, beside
# C = 1 (the untuned runs') and C = 5, above the median example's gradient norm at
# initialisation (2.6-3.3), where little is clipped and the noise is 5 times larger.
DP_TUNING_GRID = {0.1: (0.2, 0.6, 2.0), 1.0: (0.02, 0.06, 0.2), 5.0: (0.004, 0.012, 0.04)}
# Without DP-SGD (epsilon infinite) the lr alone, around the default 0.005.
NON_DP_LRS = (0.0025, 0.005, 0.01, 0.02)
# FedSSA first (its stage-1 grid chooses the other methods' cells), then the baselines.
TUNING_METHODS = ('fedssa', 'standalone', 'fd', 'fedproto', 'fedgh', 'fedtgp', 'lg_fedavg')


def _tuning_runs(method: str, cells: dict) -> list[Run]:
  """`method`'s runs at hetero,n10, E = 1, 20 rounds, seed 0, eval_validation on: for each
  budget epsilon of `cells` (math.inf: without DP-SGD) its [(clip or None, lr)]."""
  out = []
  for eps, pairs in cells.items():
    dp = ({} if eps == float('inf') else
          {'privacy__dp_sgd': True, 'privacy__noise_multiplier': 0.0,
           'privacy__target_epsilon': eps})
    out += grid(['cifar10'], ['hetero,n10'], (method,), (0,), [
        {**SYSTEM_SCHEDULE, **dp, 'eval_validation': True, 'optimizer__lr': lr,
         **({} if clip is None else {'privacy__clip_norm': clip})} for clip, lr in pairs])
  return out


def _tuning_cells(grid_of_eps) -> dict:
  """{epsilon: [(clip, lr)]}: infinity's NON_DP_LRS, and each of PRIVACY_EPSILONS's
  `grid_of_eps(eps)`."""
  return {float('inf'): [(None, lr) for lr in NON_DP_LRS],
          **{e: grid_of_eps(e) for e in PRIVACY_EPSILONS}}


def dp_tuning():
  """Stage 1 of the DP-SGD tuning: FedSSA at every (clip, lr) of DP_TUNING_GRID at each epsilon
  of PRIVACY_EPSILONS, and at each lr of NON_DP_LRS without DP-SGD (31 runs). Then
  `dp_tuning_others` in the same --sweep_dir."""
  full = lambda e: [(clip, lr) for clip, lrs in DP_TUNING_GRID.items() for lr in lrs]
  return _tuning_runs('fedssa', _tuning_cells(full))


def dp_tuning_others(sweep_dir: str):
  """Stage 2: each other method of TUNING_METHODS at each budget, at the clip that FedSSA's
  stage-1 runs in `sweep_dir` chose on validation and each of that clip's lrs (without DP-SGD,
  every lr of NON_DP_LRS): 13 runs a method. A ValueError, naming the command, until stage 1
  has ended."""
  from fedssa_jax.run import tuning  # pylint: disable=g-import-not-at-top  (no JAX)
  todo = [r.name for r in dp_tuning() if not any(
      os.path.exists(os.path.join(sweep_dir, r.name, f)) for f in ('summary.json',
                                                                   'diverged.json'))]
  if todo:
    raise ValueError(
        f'dp_tuning_others chooses its runs from the dp_tuning runs in {sweep_dir}, of which '
        f'{len(todo)} have not ended (e.g. {todo[0]}): run python launch/sweep.py '
        f'--sweep=dp_tuning --sweep_dir={sweep_dir} first, then this sweep with the same '
        '--sweep_dir.')
  chosen = tuning.chosen(sweep_dir, 'fedssa')
  missing = [e for e in PRIVACY_EPSILONS if e not in chosen]
  if missing:
    raise ValueError(f'No finished FedSSA run of dp_tuning in {sweep_dir} at epsilon '
                     f'{missing[0]:g} (all diverged?): nothing to choose the others\' clip by.')
  row = lambda e: [(chosen[e].clip, lr) for lr in DP_TUNING_GRID[chosen[e].clip]]
  return [r for m in TUNING_METHODS[1:] for r in _tuning_runs(m, _tuning_cells(row))]


SWEEPS = {f.__name__: f for f in (
    table1, table2, comm_compute, fig4, fig5, fig6_7, appendix_participation,
    appendix_ablation, appendix_mu0, appendix_t_stable, fig8, partial, partial_homo, small, tiny,
    system, system_devices, privacy, privacy_upload, cross_device, cross_device_seeds,
    cross_device_long,
    cross_device_system, cross_device_upload, dp_tuning,
    dp_tuning_others)}


def get_sweep(name: str, sweep_dir: str | None = None) -> list[Run]:
  """The runs of sweep `name`; a sweep that chooses its runs from earlier ones
  (dp_tuning_others) reads them in `sweep_dir`."""
  if name not in SWEEPS:
    raise ValueError(f'Unknown sweep {name!r}; known sweeps: {", ".join(SWEEPS)}.')
  sweep = SWEEPS[name]
  if 'sweep_dir' not in inspect.signature(sweep).parameters:
    return sweep()
  if sweep_dir is None:
    raise ValueError(f'Sweep {name!r} chooses its runs from the runs in its --sweep_dir: give '
                     'the folder of its first stage.')
  return sweep(sweep_dir)
