"""Default configuration and the variant strings of configs/*.py.

`configs/cifar10.py:hetero,n100` calls `get_config('hetero,n100')`, which is
`build('cifar10', 'hetero,n100')` here. Variants (comma-separated, applied left to right):

  hetero   client k gets family CNN-((k mod 5)+1); reference hetero script: E=25, T_stable=2
  homo     every client gets CNN-1; reference homo script: E=10, T_stable=45
  n10      N=10,  C=100%     (the paper's three (N, C) settings)
  n50      N=50,  C=20%
  n100     N=100, C=10%
  dir      Dirichlet partition (gamma = partition.dirichlet_gamma, 0.5)
  paper    the paper's 8:1:1 per-client split instead of the reference's pools
  tiny     a few clients, rounds and steps: for tests and smoke runs
"""
from __future__ import annotations

import jax
import ml_collections
from ml_collections import config_dict

from fedssa_jax import methods, models

DATASET_DEFAULTS = {
    # classes per client (paper's pathological setting) and a target accuracy for cost reports
    'cifar10': dict(classes_per_client=2, target_accuracy=0.8),
    'cifar100': dict(classes_per_client=10, target_accuracy=0.5),
}


def base_config(dataset: str = 'cifar10') -> ml_collections.ConfigDict:
  if dataset not in DATASET_DEFAULTS:
    raise ValueError(f'Unknown dataset {dataset!r}; choose one of {sorted(DATASET_DEFAULTS)}.')
  d = DATASET_DEFAULTS[dataset]
  c = ml_collections.ConfigDict()
  c.dataset = dataset                 # a TFDS name
  c.data_dir = config_dict.placeholder(str)  # TFDS data_dir; None = TFDS's default
  c.download = False                  # let TFDS download a data set missing from data_dir
  c.method = 'fedssa'                 # fedssa, standalone, fd, fedproto, fml, fedkd, lg_fedavg,
                                      # fedclassavg (fedssa_jax/methods/)
  c.num_clients = 10                  # N
  c.participation = 1.0               # C: K = max(1, floor(C*N)) clients per round
  c.num_rounds = 500
  c.local_epochs = 25                 # E
  c.batch_size = 512                  # B
  c.seed = 0                          # model init, sampling, shuffling, augmentation
  c.eval_every = 1                    # rounds between all-client evaluations (the last is always)
  c.target_accuracy = d['target_accuracy']  # mean accuracy for "costs to target"

  c.model = ml_collections.ConfigDict()
  c.model.families = models.FAMILY_NAMES  # client k gets families[k % len(families)]
  c.model.conv_impl = 'auto'          # 'auto' (im2col on CPU, xla elsewhere), 'im2col', 'xla'

  c.partition = ml_collections.ConfigDict()
  c.partition.kind = 'pathological'   # 'pathological' or 'dirichlet'
  c.partition.classes_per_client = d['classes_per_client']  # k (pathological)
  c.partition.dirichlet_gamma = 0.5   # gamma (dirichlet)
  c.partition.dirichlet_min_train = 10  # redraw while a client has fewer training samples
  c.partition.scheme = 'reference'    # 'reference' (40k/10k/test pools) or 'paper' (8:1:1)
  c.partition.seed = -1               # partition seed; -1 = use `seed`

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = 'sgd'            # 'sgd' (every method's default) or 'adam' (torch Adam)
  c.optimizer.lr = 0.005
  c.optimizer.momentum = 0.9
  c.optimizer.weight_decay = 5e-5     # L2 added to the gradient (torch SGD)
  c.optimizer.clip_norm = 50.0        # global gradient-norm clip, per model
  c.optimizer.adam_b1 = 0.9           # Adam's betas (FedClassAvg's official code: 0.5, 0.999)
  c.optimizer.adam_b2 = 0.999

  c.augment = True                    # flip + RandomErasing + pad-4 crop, on device

  c.fedssa = ml_collections.ConfigDict()
  c.fedssa.mu0 = 0.5                  # initial weight of the local header rows
  c.fedssa.t_stable = 2               # rounds until mu_t reaches 0
  c.fedssa.fusion = 'convex'          # 'convex' (paper) or 'reference' (official code)
  c.fedssa.scope = 'all_owners'       # 'all_owners' (latest uploads) or 'participants'

  # The baselines' hyperparameters (spec BASELINES.md; defaults are its first section's).
  c.fd = ml_collections.ConfigDict()
  c.fd.lam = 1.0                      # weight of the distillation term
  c.fd.exclude_own = False            # the FD paper's global logits without the client's own
  c.fedproto = ml_collections.ConfigDict()
  c.fedproto.lam = 1.0                # weight of the prototype (MSE) term
  c.fedproto.weighting = 'uniform'    # 'uniform' over holders, or 'samples' (class counts)
  c.fedproto.inference = 'classifier'  # headline accuracy: 'classifier' or 'prototype'
  c.fml = ml_collections.ConfigDict()
  c.fml.alpha = 0.5                   # local model: alpha CE + (1 - alpha) KL(meme || local)
  c.fml.beta = 0.5                    # meme: beta CE + (1 - beta) KL(local || meme)
  c.fedkd = ml_collections.ConfigDict()
  c.fedkd.energy_start = 0.95         # SVD energy threshold T, from round 0 ...
  c.fedkd.energy_end = 0.98           # ... to the last round
  c.lg_fedavg = ml_collections.ConfigDict()
  c.lg_fedavg.weighting = 'samples'   # header mean: 'samples' (n_k) or 'uniform'
  c.fedclassavg = ml_collections.ConfigDict()
  c.fedclassavg.tau = 0.07            # SupCon temperature
  c.fedclassavg.base_tau = 0.07       # SupCon's base temperature (loss scale tau / base_tau)
  c.fedclassavg.normalize = True      # L2-normalise representations (official code: False,
                                      # with tau = 100)
  c.fedclassavg.mu = 0.1              # proximal weight towards the global header
  c.fedclassavg.weighting = 'samples'  # header mean: 'samples' (n_k) or 'uniform'

  c.eval_batch_size = 512             # also the batch of the reference's per-batch metric
  c.engine = ml_collections.ConfigDict()
  c.engine.clients_per_call = 0       # clients vmapped per training call; 0 = auto by backend
  c.engine.eval_clients_per_call = 0  # clients vmapped per evaluation step; 0 = auto
  # float32 matmul/conv precision: 'default' is the backend's (TF32 on recent NVIDIA GPUs),
  # 'highest' is full float32 everywhere, for numbers comparable across backends.
  c.engine.matmul_precision = 'default'
  return c


def apply_variant(c: ml_collections.ConfigDict, name: str) -> None:
  if name == 'hetero':
    c.model.families = models.FAMILY_NAMES
    c.local_epochs, c.fedssa.t_stable = 25, 2
  elif name == 'homo':
    c.model.families = ('cnn1',)
    c.local_epochs, c.fedssa.t_stable = 10, 45
  elif name in ('n10', 'n50', 'n100'):
    c.num_clients, c.participation = {'n10': (10, 1.0), 'n50': (50, 0.2),
                                      'n100': (100, 0.1)}[name]
  elif name == 'dir':
    c.partition.kind = 'dirichlet'
  elif name == 'paper':
    c.partition.scheme = 'paper'
  elif name == 'tiny':
    c.num_clients, c.participation = 5, 0.6
    c.num_rounds, c.local_epochs, c.batch_size, c.eval_batch_size = 3, 1, 16, 32
  else:
    raise ValueError(f'Unknown config variant {name!r}; known: hetero, homo, n10, n50, n100, '
                     'dir, paper, tiny.')


def build(dataset: str, arg: str | None) -> ml_collections.ConfigDict:
  c = base_config(dataset)
  for name in filter(None, (arg or 'hetero,n10').split(',')):
    apply_variant(c, name.strip())
  return c


def matmul_precision(c: ml_collections.ConfigDict):
  """A context that applies `engine.matmul_precision` to everything traced inside it."""
  p = c.engine.matmul_precision
  return jax.default_matmul_precision(None if p == 'default' else p)


class ConfigError(ValueError):
  """A config value that cannot work, with the fix in its message."""


def validate(c: ml_collections.ConfigDict) -> None:
  """Cheap checks that run before any data is loaded or any compile starts."""
  def need(ok, msg):
    if not ok:
      raise ConfigError(msg)
  need(c.dataset in DATASET_DEFAULTS,
       f'Unknown dataset {c.dataset!r}; choose one of {sorted(DATASET_DEFAULTS)}.')
  need(c.method in methods.METHODS,
       f'Unknown method {c.method!r}; choose one of {sorted(methods.METHODS)}.')
  need(c.num_clients >= 1, f'num_clients must be >= 1, got {c.num_clients}.')
  need(0 < c.participation <= 1, f'participation must be in (0, 1], got {c.participation}.')
  need(c.num_rounds >= 0, f'num_rounds must be >= 0, got {c.num_rounds}.')
  need(c.local_epochs >= 0, f'local_epochs must be >= 0, got {c.local_epochs}.')
  need(c.batch_size > 0, f'batch_size must be > 0, got {c.batch_size}.')
  need(c.eval_batch_size > 0, f'eval_batch_size must be > 0, got {c.eval_batch_size}.')
  need(c.eval_every >= 1, f'eval_every must be >= 1, got {c.eval_every}.')
  need(0 < c.target_accuracy <= 1,
       f'target_accuracy must be in (0, 1], got {c.target_accuracy}.')
  need(c.fedssa.t_stable >= 0, f'fedssa.t_stable must be >= 0, got {c.fedssa.t_stable}.')
  need(0 <= c.fedssa.mu0 <= 1, f'fedssa.mu0 must be in [0, 1], got {c.fedssa.mu0}.')
  need(len(c.model.families) >= 1, 'model.families must name at least one family.')
  need(c.engine.matmul_precision in ('default', 'high', 'highest'),
       f"engine.matmul_precision must be 'default', 'high' or 'highest', got "
       f'{c.engine.matmul_precision!r}.')
  for f in c.model.families:
    need(f in models.FAMILY_NAMES,
         f'Unknown model family {f!r} in model.families; choose from {models.FAMILY_NAMES}.')
