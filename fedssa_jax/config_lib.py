"""Default configuration and the variant strings of configs/*.py.

`configs/cifar10.py:hetero,n100` calls `get_config('hetero,n100')`, which is
`build('cifar10', 'hetero,n100')` here. Variants (comma-separated, applied left to right):

  hetero   client k gets family CNN-((k mod 5)+1); the reference hetero script's N=10, C=100%,
           E=25, T_stable=2, fusion 'reference'
  homo     every client gets CNN-1; the reference homo script's N=50, C=20%, E=10, T_stable=45;
           fusion HOMO_FUSION
  n10      N=10,  C=100%     (the paper's three (N, C) settings)
  n50      N=50,  C=20%
  n100     N=100, C=10%
  n1000    N=1,000, C=10%, E=1, batch 10, Dirichlet gamma 1.0 with at least 11 training and 1
           test samples a client (every client can train, FedL2G's quiz of 10 included, and test)
  dir      Dirichlet partition (gamma = partition.dirichlet_gamma, 0.5)
  paper    the paper's 8:1:1 per-client split instead of the reference's pools
  tiny     a few clients, rounds and steps: for tests and smoke runs
  devices  model follows device: system.device_tiers 'three_tiers', the cheapest models on the
           slowest tier (system.tier_assignment 'model')
  htfe2, htfe3, htfe4, htfe5, htfe8, htfe9
           HtFLlib's model groups HtFE-img-N (client k gets the group's family k mod N;
           model.feature_dim 512; fedssa_jax/models/zoo.py)
"""
from __future__ import annotations

import functools
import math

import jax
import ml_collections
from ml_collections import config_dict

from fedssa_jax import data, headcount, methods, models, privacy, system
from fedssa_jax.errors import ConfigError, DataError, require, require_one_of
from fedssa_jax.models import zoo

DATASET_DEFAULTS = {
    # number of classes, classes per client (the paper's pathological setting) and a target
    # accuracy for cost reports
    'cifar10': dict(num_classes=10, classes_per_client=2, target_accuracy=0.8),
    'cifar100': dict(num_classes=100, classes_per_client=10, target_accuracy=0.5),
}
# The defaults of any other TFDS data set (its class count comes from its metadata): 2 classes
# per client, as the paper's CIFAR-10 setting, and CIFAR-10's target (not tuned to the data set:
# set target_accuracy for cost reports that matter).
OTHER_DATASET_DEFAULTS = dict(classes_per_client=2, target_accuracy=0.8)

# The names population_store takes: those of engine/population.py's STORES, which says what each
# store can do. The config sits below the engine (it cannot import the registry), so the names
# are here again; tests/code_shape_test.py checks that the two agree.
POPULATION_STORES = ('device', 'host', 'disk')


def dataset_defaults(dataset: str) -> dict:
  """classes_per_client and target_accuracy of `dataset` (DATASET_DEFAULTS, or the others')."""
  return DATASET_DEFAULTS.get(dataset, OTHER_DATASET_DEFAULTS)


def base_config(dataset: str = 'cifar10') -> ml_collections.ConfigDict:
  """Every config field with its default for `dataset` (any name: validate checks it); the
  variants (apply_variant) and --config.* overrides change them from here."""
  d = dataset_defaults(dataset)
  c = ml_collections.ConfigDict()
  c.dataset = dataset                 # a TFDS image-classification data set with `image` and
                                      # `label` features (data.HTFL_DATASETS, or any other)
  c.data_dir = config_dict.placeholder(str)  # TFDS data_dir; None = TFDS's default
  c.download = False                  # let TFDS download a data set missing from data_dir
  c.image_size = 0                    # 0: images as stored; N: resized to N x N at load time
                                      # (needed where their size varies; at least 16)
  c.method = 'fedssa'                 # a name of fedssa_jax/methods/ (methods.METHODS)
  c.num_clients = 10                  # N
  c.participation = 1.0               # C: K = floor(C*N) >= 1 clients per round
  c.num_rounds = 500
  c.local_epochs = 25                 # E
  c.batch_size = 512                  # B
  c.batch_order = 'shuffled'          # 'shuffled' (a new order each epoch, from the run's seed)
                                      # or 'fixed' (each client's stored order every epoch, as
                                      # a loader that does not shuffle: HtFLlib's)
  c.drop_last = False                 # True: floor(n_k / B) steps an epoch, a last partial
                                      # batch left out (HtFLlib's loaders); False: ceil(n_k / B)
  c.seed = 0                          # model init, sampling, shuffling, augmentation
  c.eval_every = 1                    # rounds between all-client evaluations (the last is always)
  c.eval_clients = 0                  # 0: evaluate all N clients; M: a fixed random subset of M
                                      # (the same every time; config.json lists it)
  # What the federation gave a client beyond its test split (docs/algorithm.md §5); off, as
  # they cost evaluation time:
  c.eval_global_images = 0            # >0: each evaluated client is also tested on this many
                                      # global test images, class-balanced, the same for all
  c.new_clients = 0.0                 # a fraction of N that never trains: at each evaluation,
                                      # the method's newcomer download, training, a test
  c.new_client_epochs = 1             # local epochs a new client trains (0: none)
  c.eval_validation = False           # also each client's validation split: val_accuracy
  # Where client models and per-client state live between rounds: 'device' (the accelerator),
  # 'host' (numpy in RAM; each round's cohort moves to the device) or 'disk' (memory-mapped
  # files in <workdir>/population/, for populations larger than RAM). Same results for all three.
  c.population_store = 'device'
  c.target_accuracy = d['target_accuracy']  # mean accuracy for "costs to target"
  c.checkpoint_every = 10             # rounds between checkpoints (the last round always saves)
  c.checkpoint_keep = 3               # how many of the latest checkpoints to keep
  c.save_representations = False      # at the end, every client's test representations
                                      # -> workdir/representations.npz (t-SNE, report)
  c.model = _model_config()
  c.partition = _partition_config(d['classes_per_client'])
  c.optimizer = _optimizer_config()
  c.augment = True                    # flip + RandomErasing + pad-4 crop, on device
  c.guard = _guard_config()
  # Each method's hyperparameters, c.<its config_section>: their defaults, with a comment on
  # each, and their checks are in its module (fedssa_jax/methods/).
  for method in methods.METHODS.values():
    if method.config_section is not None:
      c[method.config_section] = method.default_config()
  c.eval_batch_size = 512             # also the batch of the reference's per-batch metric
  # System heterogeneity (availability, dropout, stragglers, lost uploads, devices and a
  # simulated clock): off by default; fedssa_jax/system.py, docs/configuration.md.
  c.system = system.default_config()
  # Differential privacy (DP-SGD in local training and its accountant): off by default;
  # fedssa_jax/privacy/, docs/configuration.md.
  c.privacy = privacy.default_config()
  c.engine = _engine_config()
  return c


def _model_config() -> ml_collections.ConfigDict:
  m = ml_collections.ConfigDict()
  m.families = models.FAMILY_NAMES    # client k gets families[k % len(families)]
  m.conv_impl = 'auto'                # 'auto' (band on CPU, xla elsewhere), 'band', 'im2col', 'xla'
  # d, the width of every client model's representation r, which the header reads (its rows
  # hold d + 1 numbers) and prototypes share: the five CNNs' fc2 width (500 in the paper);
  # HtFLlib's model groups use 512.
  m.feature_dim = models.CNN_FEATURE_DIM
  # Initial models: 'family' (one model per family from the run's seed, which every client of
  # the family starts from, in every method: what the official code does) or 'client' (each
  # client draws its own).
  m.init_scope = 'family'
  return m


def _partition_config(classes_per_client: int) -> ml_collections.ConfigDict:
  p = ml_collections.ConfigDict()
  p.kind = 'pathological'             # 'pathological', 'dirichlet' or 'resample' (each client
                                      # draws its samples with replacement from its own class
                                      # mixture ~ Dir(dirichlet_gamma): any N, samples repeat
                                      # across clients)
  p.classes_per_client = classes_per_client  # k (pathological)
  p.dirichlet_gamma = 0.5             # gamma (dirichlet, resample)
  p.dirichlet_min_train = 10          # redraw while a client has fewer training samples
  p.dirichlet_min_test = 1            # ... or fewer test samples (0: clients without test
                                      # data are allowed, and left out of every accuracy mean)
  p.resample_train = 40               # training samples of every client (resample): CIFAR's
                                      # train pool over 1,000 clients
  p.resample_test = 10                # test samples of every client (resample; >= 1 so that
                                      # every client is evaluated)
  p.scheme = 'reference'              # 'reference' (40k/10k/test pools) or 'paper' (8:1:1)
  p.seed = -1                         # partition seed; -1 = use `seed`
  return p


def _optimizer_config() -> ml_collections.ConfigDict:
  o = ml_collections.ConfigDict()
  o.name = 'sgd'                      # 'sgd' (every method's default) or 'adam' (torch Adam)
  o.lr = 0.005
  o.momentum = 0.9
  o.weight_decay = 5e-5               # L2 added to the gradient (torch SGD)
  o.clip_norm = 50.0                  # global gradient-norm clip, per model; 0 = no clip
  o.adam_b1 = 0.9                     # Adam's betas (FedClassAvg's official code: 0.5, 0.999)
  o.adam_b2 = 0.999
  return o


def _guard_config() -> ml_collections.ConfigDict:
  """The blow-up guard (train.check_blowup): stops a run whose round train loss is finite but
  diverging; 0 turns a test off (docs/operations.md, "The blow-up guard")."""
  g = ml_collections.ConfigDict()
  g.max_train_loss = 1e3              # a round's mean train loss above this stops the run
  g.loss_growth = 1e3                 # ... or above this factor times the best round so far
  return g


def _engine_config() -> ml_collections.ConfigDict:
  """How the simulator computes: batching, precision and device placement (checkpoint.py's
  MUTABLE_ON_RESUME says which of them may change on resume)."""
  e = ml_collections.ConfigDict()
  # Clients vmapped per training call: 0 = a fixed rule by backend (1 on the CPU; the group's
  # share of the cohort on accelerators); -1 = measured on the machine at hand, each group's
  # fastest, cached (fedssa_jax/engine/per_call.py); n = n.
  e.clients_per_call = 0
  e.eval_clients_per_call = 0         # clients vmapped per evaluation step; 0 = auto
  # Rows per forward/backward pass of a step (gradients summed over passes, so a partial batch
  # pads less): 0 = auto (64 on the CPU, where small passes run as fast; the whole batch on
  # accelerators); the batch size turns it off. Must divide batch_size.
  e.micro_batch = 0
  # float32 matmul/conv precision: 'default' is the backend's (TF32 on recent NVIDIA GPUs),
  # 'highest' is full float32 everywhere, for numbers comparable across backends.
  e.matmul_precision = 'default'
  # Mixed precision: 'float32', or 'bfloat16' to run the models' forward and backward in
  # bfloat16 (for GPUs/TPUs). Parameters, optimizer state, gradients, losses and the server's
  # aggregation stay float32 either way (fedssa_jax/models/cnn.py).
  e.compute_dtype = 'float32'
  # Devices of the `clients` mesh axis, over which each group's client axis is sharded:
  # 0 = every local device, 1 = one device (no sharding), n = the first n local devices.
  e.mesh_devices = 0
  return e


# FedSSA's fusion in the homo variant, chosen from measured runs at configs/cifar10.py:homo
# (docs/results.md, "The homo fusion").
HOMO_FUSION = 'reference'

# Config fields added after runs were made whose behaviour before the field existed differs from
# the field's default: a checkpoint written without the field resumes only at this value.
VALUE_BEFORE_FIELD = {'fedssa.initial_header': False, 'model.init_scope': 'client'}


def apply_variant(c: ml_collections.ConfigDict, name: str) -> None:
  if name == 'hetero':
    c.model.families = models.FAMILY_NAMES
    c.num_clients, c.participation = 10, 1.0
    c.local_epochs, c.fedssa.t_stable, c.fedssa.fusion = 25, 2, 'reference'
  elif name == 'homo':
    c.model.families = ('cnn1',)
    c.num_clients, c.participation = 50, 0.2
    c.local_epochs, c.fedssa.t_stable, c.fedssa.fusion = 10, 45, HOMO_FUSION
  elif name in ('n10', 'n50', 'n100'):
    c.num_clients, c.participation = {'n10': (10, 1.0), 'n50': (50, 0.2),
                                      'n100': (100, 0.1)}[name]
  elif name == 'n1000':
    # Cross-device: 1,000 clients, 10% a round, one local epoch. A Dirichlet partition over the
    # 40k/10k/10k pools gives a client about 40 training and 10 test samples; at gamma 0.5 about
    # 1% of the clients hold fewer than 11 training samples and 0.2% no test sample, so no draw
    # would meet the minimums below. Gamma 1.0 meets them in a draw or two: every client trains
    # (FedL2G holds out a quiz of 10 of them: 11 leaves it one to train on) and is evaluated.
    # Batch 10 (HtFLlib's scripts'): a client of about 40 samples takes 4 steps a round; at the
    # default 512 it would take one, and 50 rounds would give it about 5 steps in all.
    c.num_clients, c.participation, c.local_epochs, c.batch_size = 1000, 0.1, 1, 10
    c.partition.kind, c.partition.dirichlet_gamma = 'dirichlet', 1.0
    c.partition.dirichlet_min_train, c.partition.dirichlet_min_test = 11, 1
  elif name == 'dir':
    c.partition.kind = 'dirichlet'
  elif name == 'xdevice':
    # Cross-device scale: 10,000 clients, 1% a round, Dirichlet. CIFAR cannot give each of them
    # a test sample (10k test images), so clients without test data are allowed and left out of
    # the means; the population lives on disk, and a fixed subset of 1,000 clients is evaluated.
    c.num_clients, c.participation = 10_000, 0.01
    c.partition.kind = 'dirichlet'
    c.partition.dirichlet_min_train = c.partition.dirichlet_min_test = 0
    c.population_store, c.eval_clients = 'disk', 1000
    c.engine.micro_batch = 16  # clients hold about 4 training samples: pad passes to 16, not 64
  elif name == 'paper':
    c.partition.scheme = 'paper'
  elif name == 'tiny':
    c.num_clients, c.participation = 5, 0.6
    c.num_rounds, c.local_epochs, c.batch_size, c.eval_batch_size = 3, 1, 16, 32
  elif name == 'devices':
    # The paper's scenario: clients pick the model their device can train, so the slowest tier
    # holds the cheapest models (fedssa_jax/system.py).
    c.system.device_tiers, c.system.tier_assignment = 'three_tiers', 'model'
  elif name in zoo.GROUPS:
    # HtFLlib's model group HtFE-img-N (zoo.py): client k gets its family k mod |group|, every
    # representation pooled to HtFLlib's feature_dim 512. Nothing else changes.
    c.model.families, c.model.feature_dim = zoo.GROUPS[name], zoo.FEATURE_DIM
  else:
    raise ValueError(f'Unknown config variant {name!r}; known: hetero, homo, n10, n50, n100, '
                     f'n1000, dir, xdevice, paper, tiny, devices, {", ".join(zoo.GROUPS)}.')


def build(dataset: str, arg: str | None) -> ml_collections.ConfigDict:
  c = base_config(dataset)
  for name in filter(None, (arg or 'hetero,n10').split(',')):
    apply_variant(c, name.strip())
  return c


def matmul_precision(c: ml_collections.ConfigDict):
  """A context that applies `engine.matmul_precision` to everything traced inside it."""
  p = c.engine.matmul_precision
  return jax.default_matmul_precision(None if p == 'default' else p)


def _numbers(d: dict, prefix: str = ''):
  """(dotted field, value) of every float in a nested config dict."""
  for k, v in d.items():
    if isinstance(v, dict):
      yield from _numbers(v, f'{prefix}{k}.')
    elif isinstance(v, float):
      yield prefix + k, v


def _default(dataset: str, field: str):
  node = base_config(dataset)
  for part in field.split('.'):
    node = node[part]
  return node


def validate(c: ml_collections.ConfigDict) -> None:
  """Cheap checks that run before any data is loaded or any compile starts.

  Each failure is a ConfigError that names the field and says how to fix it. The checks run
  section by section, in this order, and the first failure is raised.
  """
  _check_names_and_numbers(c)
  _check_run(c)
  _check_partition(c)
  _check_precision(c)
  _check_optimizer(c)
  _check_guard(c)
  _check_engine_batching(c)
  _check_method_sections(c)
  system.check_config(c.system, c.num_clients)
  cls = methods.METHODS[c.method]
  privacy.check_config(c.privacy, c.method, cls.per_sample_loss,
                       functools.partial(cls.upload_refusal, c),
                       functools.partial(cls.dp_sgd_refusal, c))


def dataset_facts(c: ml_collections.ConfigDict) -> data.DatasetFacts:
  """data.dataset_facts of the config's data set: a ConfigError, naming the fix, for a name TFDS
  does not know."""
  try:
    return data.dataset_facts(c.dataset, c.data_dir)
  except data.UnknownDatasetError as e:
    raise ConfigError(str(e)) from None


def _check_names_and_numbers(c: ml_collections.ConfigDict) -> None:
  """The data set and its image size, the method, every float field finite, and the model
  families."""
  require(c.image_size >= 0,
          f'image_size must be 0 (the images as stored) or a size N >= '
          f'{models.MIN_IMAGE_SIZE} to resize them to N x N; got {c.image_size}.')
  facts = dataset_facts(c)
  try:
    data.check_image_size(c.dataset, facts.image_shape, c.image_size)
  except DataError as e:
    raise ConfigError(str(e)) from None
  require_one_of('method', c.method, methods.METHODS)
  for field, value in _numbers(c.to_dict()):
    if not math.isfinite(value):  # the message builds a default config: only when it fails
      raise ConfigError(f'{field} is {value}; it must be a finite number. Set --config.{field} '
                        f'to one (its default is {_default(c.dataset, field)}).')
  require(len(c.model.families) >= 1, 'model.families must name at least one family.')
  names = models.all_family_names()
  for f in c.model.families:
    require(f in names, f'Unknown model family {f!r} in model.families; choose from {names}.')
  require_one_of('model.conv_impl', c.model.conv_impl, models.CONV_IMPLS)
  require(isinstance(c.model.feature_dim, int) and c.model.feature_dim >= 1,
          f'model.feature_dim must be a positive integer, got {c.model.feature_dim!r} '
          f'(the paper\'s CNNs: {models.CNN_FEATURE_DIM}; HtFLlib\'s model groups: '
          f'{zoo.FEATURE_DIM}).')
  require_one_of('model.init_scope', c.model.init_scope, ('family', 'client'))


def _check_run(c: ml_collections.ConfigDict) -> None:
  """The top-level fields: clients and participation, rounds, seeds, batches, evaluation,
  population store, target and checkpoints."""
  n = c.num_clients
  require(n >= 1, f'num_clients must be >= 1, got {n}.')
  require(0 < c.participation <= 1,
          f'participation must be in (0, 1], got {c.participation}. It is the fraction C of the '
          'clients sampled per round.')
  require(int(math.floor(c.participation * n)) >= 1,
          f'participation={c.participation} samples floor({c.participation}*{n}) = 0 of the '
          f'num_clients={n} clients per round. Set participation to at least 1/N = {1 / n:.6g}.')
  train_images = dataset_facts(c).train_examples  # None: the metadata does not say
  require(train_images is None or n <= train_images or c.partition.kind == 'resample',
          f'num_clients={n} is more than the {train_images or 0:,} training images of '
          f'{c.dataset}, and every client needs at least one training sample. Set num_clients to '
          f'at most {train_images or 0:,} (the cross-device variant xdevice uses 10,000), or '
          "draw each client's samples with replacement: --config.partition.kind=resample.")
  require(c.num_rounds >= 1, f'num_rounds must be >= 1, got {c.num_rounds}.')
  require(c.local_epochs >= 1,
          f'local_epochs must be >= 1, got {c.local_epochs}: with no local training a round '
          'changes nothing.')
  require(0 <= c.seed < 2**63, f'seed must be in [0, 2**63), got {c.seed}.')
  require(-1 <= c.partition.seed < 2**63,
          f'partition.seed must be in [0, 2**63), or -1 to use `seed`; got {c.partition.seed}.')
  require(c.batch_size > 0, f'batch_size must be > 0, got {c.batch_size}.')
  require_one_of('batch_order', c.batch_order, ('shuffled', 'fixed'))
  require(isinstance(c.drop_last, bool), f'drop_last must be True or False, got {c.drop_last!r}.')
  require(not (c.privacy.dp_sgd and (c.batch_order == 'fixed' or c.drop_last)),
          'privacy.dp_sgd draws every batch by Poisson sampling, which batch_order=fixed and '
          'drop_last=True would contradict: set batch_order=shuffled and drop_last=False, or '
          'turn privacy.dp_sgd off.')
  require(c.eval_batch_size > 0, f'eval_batch_size must be > 0, got {c.eval_batch_size}.')
  require(c.eval_every >= 1, f'eval_every must be >= 1, got {c.eval_every}.')
  require(c.eval_clients >= 0,
          f'eval_clients must be 0 (all clients) or a count of clients to evaluate, got '
          f'{c.eval_clients}.')
  require(c.eval_clients <= n,
          f'eval_clients={c.eval_clients} is more than the num_clients={n} clients: set it to at '
          f'most {n}, or to 0 to evaluate all of them.')
  require(isinstance(c.eval_global_images, int) and c.eval_global_images >= 0,
          f'eval_global_images must be 0 (off) or a count of global test images, got '
          f'{c.eval_global_images!r}.')
  require(0 <= c.new_clients < 1,
          f'new_clients must be a fraction of the clients in [0, 1) (0: off), got '
          f'{c.new_clients!r}.')
  require(c.new_clients == 0 or headcount.new_client_count(c.new_clients, n) >= 1,
          f'new_clients={c.new_clients} of num_clients={n} is no client: raise it to at least '
          f'{1 / n:.3g}, or set 0 for none.')
  require(isinstance(c.new_client_epochs, int) and c.new_client_epochs >= 0,
          f'new_client_epochs must be an integer >= 0, got {c.new_client_epochs!r}.')
  require_one_of('population_store', c.population_store, POPULATION_STORES)
  require(0 < c.target_accuracy <= 1,
          f'target_accuracy must be in (0, 1], got {c.target_accuracy}; it is a mean accuracy, '
          'a fraction (0.8 is 80%).')
  require(c.checkpoint_every >= 1, f'checkpoint_every must be >= 1, got {c.checkpoint_every}.')
  require(c.checkpoint_keep >= 1, f'checkpoint_keep must be >= 1, got {c.checkpoint_keep}.')


def _check_partition(c: ml_collections.ConfigDict) -> None:
  p, n = c.partition, c.num_clients
  require_one_of('partition.kind', p.kind, ('pathological', 'dirichlet', 'resample'))
  require_one_of('partition.scheme', p.scheme, ('reference', 'paper'))
  num_classes = dataset_facts(c).num_classes
  if p.kind == 'pathological':
    k = p.classes_per_client
    require(1 <= k <= num_classes,
          f'partition.classes_per_client={k} must be in [1, {num_classes}]: {c.dataset} has '
          f'{num_classes} classes.')
    # Every class has k*N/S holders (data.pathological_shares).
    require((k * n) % num_classes == 0,
          f'The pathological partition needs k*N/S holders per class to be a whole number: '
          f'partition.classes_per_client={k}, num_clients={n}, S={num_classes} classes gives '
          f'{k * n / num_classes:g}. Set num_clients to a multiple of '
          f'{num_classes // math.gcd(k, num_classes)}, or change partition.classes_per_client.')
  elif p.kind == 'resample':
    require(not c.eval_validation, "eval_validation needs each client's validation split, and "
            "partition.kind='resample' draws none: use the pathological or Dirichlet partition.")
    require(p.dirichlet_gamma > 0,
          f'partition.dirichlet_gamma must be > 0, got {p.dirichlet_gamma}: it is the '
          "concentration of each client's class mixture (smaller is more skewed).")
    require(p.resample_train >= 1 and p.resample_test >= 0,
          f'partition.resample_train must be >= 1 (every client trains) and '
          f'partition.resample_test >= 0; got {p.resample_train} and {p.resample_test}.')
    require(p.scheme == 'reference',
          "partition.kind='resample' draws from the reference scheme's train and test pools: "
          "set partition.scheme='reference'.")
  else:
    require(p.dirichlet_gamma > 0,
          f'partition.dirichlet_gamma must be > 0, got {p.dirichlet_gamma} (smaller is more '
          'skewed; 0.1 to 1 are usual).')
    require(p.dirichlet_min_train >= 0,
          f'partition.dirichlet_min_train must be >= 0, got {p.dirichlet_min_train}.')
    require(p.dirichlet_min_test >= 0,
          f'partition.dirichlet_min_test must be >= 0, got {p.dirichlet_min_test}.')


def _check_precision(c: ml_collections.ConfigDict) -> None:
  require(c.engine.matmul_precision in ('default', 'high', 'highest'),
          f"engine.matmul_precision must be 'default', 'high' or 'highest', got "
          f'{c.engine.matmul_precision!r}.')
  require_one_of('engine.compute_dtype', c.engine.compute_dtype, models.COMPUTE_DTYPES)


def _check_optimizer(c: ml_collections.ConfigDict) -> None:
  o = c.optimizer
  require_one_of('optimizer.name', o.name, ('sgd', 'adam'))
  require(o.lr > 0, f'optimizer.lr must be > 0, got {o.lr} (the default is 0.005).')
  require(0 <= o.momentum < 1,
          f'optimizer.momentum must be in [0, 1), got {o.momentum} (0 is plain SGD; the default '
          'is 0.9).')
  require(o.weight_decay >= 0, f'optimizer.weight_decay must be >= 0, got {o.weight_decay}.')
  require(o.clip_norm >= 0,
          f'optimizer.clip_norm must be > 0, or 0 to turn clipping off; got {o.clip_norm}.')
  for b in ('adam_b1', 'adam_b2'):
    require(0 <= o[b] < 1, f'optimizer.{b} must be in [0, 1), got {o[b]}.')


def _check_guard(c: ml_collections.ConfigDict) -> None:
  for field in ('max_train_loss', 'loss_growth'):
    require(c.guard[field] >= 0,
            f'guard.{field} must be >= 0 (0 turns that test off), got {c.guard[field]}.')
  require(c.guard.loss_growth == 0 or c.guard.loss_growth > 1,
          f'guard.loss_growth={c.guard.loss_growth} would stop a run whose loss merely stays '
          'level: set it above 1 (the default is 1000), or to 0 to turn that test off.')


def _check_engine_batching(c: ml_collections.ConfigDict) -> None:
  require(c.engine.clients_per_call >= -1,
          f'engine.clients_per_call={c.engine.clients_per_call} must be a count of clients, 0 '
          '(the fixed rule by backend) or -1 (measured on this machine).')
  require(c.engine.mesh_devices >= 0,
          f'engine.mesh_devices={c.engine.mesh_devices} must be 0 (every local device) or a '
          'device count.')
  mb = c.engine.micro_batch
  require(mb >= 0 and (mb == 0 or c.batch_size % mb == 0),
          f'engine.micro_batch={mb} must divide batch_size={c.batch_size} (or be 0, automatic).')


def _check_method_sections(c: ml_collections.ConfigDict) -> None:
  """The methods' hyperparameters, by each method's own checks: every method's section, not
  only the configured method's, as every other field is checked whether or not the run reads
  it."""
  for method in methods.METHODS.values():
    if method.config_section is not None:
      try:
        method.check_config(c[method.config_section])
      except ValueError as e:
        raise ConfigError(str(e)) from None
