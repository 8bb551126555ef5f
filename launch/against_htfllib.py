"""The methods shared with HtFLlib, run by its own code and by this simulator, on one partition.

  python launch/against_htfllib.py --htfllib=/path/to/HtFLlib --htfllib_fd=/path/to/HtFLlib-fd \\
      --htfllib_python=/tmp/venv-torch/bin/python --data_dir=$HOME/tensorflow_datasets \\
      --methods=standalone,fd,fedproto,lg_fedavg,fml,fedkd --rounds=20 --seeds=0,1 \\
      --out=results/against_htfllib --scratch=/tmp/against_htfllib

Methods (ours -> HtFLlib's -algo): standalone -> Local, fd -> FD, fedproto -> FedProto,
lg_fedavg -> LG-FedAvg, fml -> FML, fedkd -> FedKD, fedgh -> FedGH, fedtgp -> FedTGP,
fedmrl -> FedMRL, fedl2g -> FedL2G-feat, fedgen -> FedGen.

HtFLlib (github.com/TsingZ0/HtFLlib) runs unchanged from the checkout that `--htfllib` names, with
a Python that has torch, torchvision, h5py and scikit-learn (`--htfllib_python`; a venv of its
own keeps the system's Python as it is):

  python -m venv /tmp/venv-torch --system-site-packages
  /tmp/venv-torch/bin/pip install torch torchvision h5py scikit-learn calmsize

Both sides run `configs/cifar10.py:hetero,n10` (CNN-1..5, N=10, C=100%, two classes a client) for
`--rounds` rounds at E=1, on the CPU, one method after the other: first HtFLlib's, then
`python -m fedssa_jax.main`. A method whose outputs are already in `--out` is not run again, so
a run that stops resumes where it stopped.

The same data. This script builds our partition (seed 0) of the offline CIFAR-10 and writes
each client's training and test samples, normalised with the CIFAR-10 constants and laid out
NCHW, as HtFLlib's `dataset/<name>/{train,test}/<k>.npz` in the scratch folder. HtFLlib trains
and tests on those files; we train and test on the same index sets.

The same models. The FedSSA paper's five CNNs are registered into HtFLlib at run time, as
classes whose last layer is `fc` (500 -> 10): HtFLlib's BaseHeadSplit turns `fc` into the head
and keeps conv1, conv2, fc1 and fc2 as the base, whose output is the 500-d representation
(`--feature_dim 500`). Client k gets CNN-((k mod 5)+1), as here. FML's meme and FedKD's mentee
are CNN-5 (HtFLlib's `args.global_model`), as here. `tests/against_htfllib_test.py` checks that
each family has our parameter count, layer by layer.

The same settings (`htfllib_args`, `our_settings`). HtFLlib's optimizer is plain SGD at the
learning rate `-lr`, fixed in its code; so our side runs plain SGD as well (momentum 0, weight
decay 0, no clip except FML's and FedKD's 10, which HtFLlib hard-codes), without augmentation
(HtFLlib has none), at `--lr` (default 0.05: our default step, 0.005 with momentum 0.9, is
0.05 in plain SGD terms). Batch 512, E=1, N=10, C=100% and each method's hyperparameters are
passed to HtFLlib from our config. `--batch_size`, `--num_clients`, `--partition=dirichlet` and
`--alpha` set another federation on both sides; HtFLlib's own scripts' (system/total.sh) is

  python launch/against_htfllib.py ... --batch_size=10 --num_clients=20 --partition=dirichlet \
      --alpha=0.1 --lr=0.01 --methods=standalone,fedproto,fedgh --rounds=3

and the cross-device federation's (the n1000 variant's N, C, batch and Dirichlet 1.0; HtFLlib's
`-nc 1000 -jr 0.1`; both sides evaluate every client every round, as HtFLlib does):

  python launch/against_htfllib.py ... --batch_size=10 --num_clients=1000 --participation=0.1 \
      --partition=dirichlet --alpha=1.0 --lr=0.01 --methods=standalone,fedproto,fedtgp --rounds=50 \
      --out=results/against_htfllib_n1000

and its files are named with the federation (`_b10_n20_dir0.1_lr0.01`), so each federation's
runs resume on their own. `--model_group=htfe2` trains HtFLlib's own HtFE-img-2 (FedAvgCNN and
torchvision's ResNet-18, feature_dim 512) there and `:htfe2` here instead of the five CNNs
(files get `_htfe2`). The round's speed is printed as s/round, as training images a second
(HtFLlib's loaders drop each client's last partial batch, ours keep it) and as client GFLOP/s
(our records' training FLOPs a round, HtFLlib's in proportion to its images, over each side's
whole round) beside the float32 matmul roofline, measured at the end of the same run. FedProto is compared on the nearest global prototype, the
accuracy HtFLlib reports for it (ours: `fedproto.inference=prototype`). Where HtFLlib's code
does what one of our documented options does, our side takes that option (`HTFLLIB_BEHAVIOUR`:
FedTGP's pre-training prototypes and prototype accuracy, FedMRL's pooled shared model, uniform
mean and projector that is never saved, FedL2G without warm-up, since HtFLlib prints no round
before it, FedGen's generator that is never saved, so clients use the initial one from round 0),
and HtFLlib's server-side training reuses the local batch (FedGH, FedTGP, FedGen) and lr
(FedTGP), as does FedL2G's quiz set. What could not be matched is printed at the start and
written to the results (`UNMATCHED`).

Seeds: `--seeds` runs both sides at each seed (the partition stays seed 0's): ours as
config.seed; HtFLlib's by moving each of its torch.manual_seed(s) calls (main.py's and the one
before every client's models) to s + seed at run time. Seed 0 runs HtFLlib as written, and its
files keep the names they had; another's get `_seed<k>` on both sides. `--htfllib_seeds` gives
HtFLlib its own list (0: once). The tables give each side's mean ± sample std over its seeds and
mark, in bold, a gap larger than twice their combined std sqrt(std_HtFLlib² + std_ours²). The
results files keep the other methods of an earlier command in the same `--out` (and the same
federation and options), so a table can be filled one command at a time.

The same metric. HtFLlib prints each client's test accuracy at the start of round r (its round
0 is the initial models), after r rounds of training; ours, metrics.jsonl's `client_accuracy`
after round r. The headline is the unweighted mean over clients for both; HtFLlib's own figure
(correct / samples over all clients, the sample-weighted mean) is reported beside it.

Speed: HtFLlib's per-round seconds are those it prints (its `Budget`: the evaluation at the
round's start, the clients' training one after another and the server's step); ours are
metrics.jsonl's `round_seconds` (training, server and the evaluation of every client). The
steady state is the median after the first round, which compiles here. Each side uses its
library's default threads.

What the runner changes in HtFLlib at run time (the checkout's files are untouched; Python
writes no bytecode into it; the working folder is `<scratch>/htfllib/system`, so its data,
model files and results land in the scratch folder):
  - the five CNN classes are added to `flcore.trainmodel.models`, and `Server.__init__` first
    sets `args.models` to them and `args.global_model` to CNN-5 (`-m HtFE-img-2` is passed only
    because main.py needs a known family name; the printed HtFE-img-2 list is not used);
  - torch.cuda.is_available() is False, and `-dev cpu`;
  - TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1: HtFLlib saves and loads whole modules with torch.save and
    torch.load, which torch 2.6 and later refuse by default (weights_only=True);
  - the modules of FedKTL's three servers and FedL2G's two, which are not run here, are replaced
    by empty ones where they cannot be imported (they need StyleGAN or Stable Diffusion files,
    or the `higher` package); the runner's log names each one left out;
  - with a seed other than 0, torch.manual_seed(s) calls torch's with s + the seed.
Nothing else: HtFLlib's training, aggregation, evaluation and logging run as written. FedKD's
`decomposition` is wrapped to log each matrix's kept rank (the launcher prints how often a
truncation kept rank 0), which changes nothing it computes. Two diagnostics change more, only
when asked: `--htfllib_loader=shuffled` makes its training loaders reshuffle every epoch and
keep the last partial batch (as ours), to measure what its fixed batch order and dropped
samples do to a curve; `--fedkd_compression=off` makes its `decomposition` return every tensor
whole and runs ours at energy 1.0, to measure what each side's compression does. One changes
ours: `--our_loader=fixed` trains our side on HtFLlib's batches (batch_order=fixed,
drop_last=True: each client's samples in file order every epoch, the partial batch dropped, and
left out of FedGH's and FedTGP's prototype passes too). `launch/fedkd_round.py` checks one
local FedKD round of ours against HtFLlib's own clientKD.train from the same weights and batches.

FD: HtFLlib's FD since commit ca3e29a (29 Nov 2025) gives the raw global logits to
CrossEntropyLoss as if they were probabilities; docs/algorithm.md rejects that version. Pass the
checkout of its parent 6e6f1ae (soft targets softmax(G[y])) as `--htfllib_fd`; without it FD
runs from `--htfllib` as it is, and the results name the commit.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import side_by_side  # pylint: disable=g-import-not-at-top,wrong-import-position

REPO = side_by_side.REPO
CONFIG = 'configs/cifar10.py:hetero,n10'
DATASET = 'Cifar10_fedssa_jax'  # the folder name under HtFLlib's dataset/
Failure = side_by_side.Failure

# Our method -> HtFLlib's -algo.
ALGORITHMS = {'standalone': 'Local', 'fd': 'FD', 'fedproto': 'FedProto',
              'lg_fedavg': 'LG-FedAvg', 'fml': 'FML', 'fedkd': 'FedKD', 'fedgh': 'FedGH',
              'fedtgp': 'FedTGP', 'fedmrl': 'FedMRL', 'fedl2g': 'FedL2G-feat',
              'fedgen': 'FedGen'}
SHARED_METHODS = tuple(ALGORITHMS)
# HtFLlib clips the local gradient norm of each model at 10 in FML and FedKD and at 100 in
# FedL2G's local training, and nowhere else.
HTFLLIB_CLIP = {'fml': 10.0, 'fedkd': 10.0, 'fedl2g': 100.0}

# Differences that remain in the comparison, by method ('*' for all).
UNMATCHED = {
    '*': [
        'seeds: HtFLlib seeds torch with 0 (plus --htfllib_seeds\' offset) before each client '
        'model (clients of one family start equal, as our model.init_scope=family); we seed JAX '
        'with our seed. The initial models therefore differ.',
        'HtFLlib reads images from .npz lists of torch tensors; ours from TFDS. The pixels are '
        'the same (written from our arrays).',
    ],
    'fd': ['HtFLlib\'s FD broadcasts every class\'s global logits; ours sends each client its '
           'seen classes\' (the same training, counted floats differ).'],
    # Our defaults, the FML paper's; fml.kl_reduction=mean and fml.detach_targets=False are
    # HtFLlib's (docs/results.md ran them as a diagnostic).
    'fml': ['KL reduction: HtFLlib\'s nn.KLDivLoss() averages over batch x classes (1/C of the '
            'batchmean KL that ours and the FML paper use; ours with fml.kl_reduction=mean).',
            'KL targets: HtFLlib does not detach them, so each model also gets the other\'s '
            'loss gradients; ours (and the FML paper\'s code) detach them (ours with '
            'fml.detach_targets=False).'],
    'fedkd': ['W_h: HtFLlib seeds torch with 0 before each client\'s W_h (clientkd.py:13), so '
              'every client starts with the same one; ours draws each client\'s from its key.'],
    'fedgh': ['HtFLlib\'s global header starts as client 0\'s initial head; ours is drawn '
              'from the server\'s key.'],
    'fedtgp': ['HtFLlib takes sqrt of the prototype distances with no floor (a NaN gradient at '
               'distance 0); ours floors them at 1e-12.',
               'The TGP network\'s initial weights come from torch\'s RNG there, our server '
               'key here.'],
    'fedmrl': ['HtFLlib\'s projectors start equal on every client (torch.manual_seed(0) before '
               'each); ours are drawn per client.'],
    'fedgen': ['HtFLlib seeds torch with 0 right before it builds the generator, so every run '
               'starts from the same G; ours is drawn from the server\'s key.',
               'label prior: HtFLlib counts each client\'s classes over its full training '
               'batches only (its loader drops the last one); ours over every training sample.',
               'The generated labels and noises are drawn by each side\'s own RNG.'],
    'fedl2g': ['rows: HtFLlib uploads the guiding-vector rows whose meta-gradient is non-zero; '
               'ours the rows of the classes in the study batch, which are those rows (the '
               'same upload).',
               'The study batch is drawn by each side\'s own RNG.'],
}

# FedKD's compression differences, where ours compresses as the spec says (fedkd.compression=
# update) and neither side is off (--fedkd_compression=htfllib or off removes them).
FEDKD_UNMATCHED = [
    'compression: HtFLlib compresses the mentee\'s parameters (conv kernels as 4-D '
    'SVDs; clientkd.py:86-87) and the server recovers, averages and truncates them '
    'again (serverkd.py:89-96), so the mentee loses 1 - T of its energy twice a '
    'round; ours compresses the update (conv kernels as [O, I*25]) and adds it to '
    'the global mentee (ours with fedkd.compression=htfllib: --fedkd_compression=htfllib).',
    'zeroing: HtFLlib\'s truncation (clientkd.py:162-169) starts its rank at 0 and never '
    'tests the full rank, so a tensor whose smallest singular value holds more than '
    '1 - T of the energy is rebuilt as zeros (a head [10, 500] at torch\'s uniform '
    'init holds about 8% in sigma_min^2, so at T = 0.95-0.98 the loop ends at rank 0; '
    'measured: the mentee\'s head is kept at rank 0 of 10 by every client in round 1, '
    'rank 1 after); ours keeps the full rank there.',
    'energy schedule: HtFLlib T_t = start + (end - start) t/R; ours (t + 1)/R.',
]

# The methods whose clients make a forward pass over their training split for the upload
# (training.forward_pass_sums), which HtFLlib makes with its training loader.
PROTOTYPE_PASS = ('fedgh', 'fedtgp')

# HtFLlib's servers that aggregate every selected client whatever -cdr says (their receive
# step never samples the active clients).
CDR_IGNORED = ('standalone', 'fd', 'fedproto', 'fedtgp')


def system_has_clock(config) -> bool:
  return bool(config.system.device_tiers or config.system.device_profile)


# What our side sets, beyond the optimizer, to do what HtFLlib's code does (each is a documented
# option of ours; the value HtFLlib's code fixes is named in docs/algorithm.md).
HTFLLIB_BEHAVIOUR = {
    'fedproto': {'fedproto.inference': 'prototype'},  # HtFLlib reports the nearest prototype
    'fedtgp': {'fedtgp.inference': 'prototype', 'fedtgp.proto_timing': 'pre_train'},
    'fedmrl': {'fedmrl.shared_model': 'pool', 'fedmrl.aggregation': 'uniform',
               'fedmrl.reset_projector': True},
    # A 20-round run has no room for the 50 warm-up rounds: HtFLlib prints nothing before them.
    'fedl2g': {'fedl2g.warmup': 0},
    # HtFLlib's server trains a copy of the generator each round and never saves it.
    'fedgen': {'fedgen.frozen_generator': True},
}


# Our training batches (`--our_loader`): shuffled every epoch with the partial batch kept (our
# default), or HtFLlib's loaders' (the stored order every epoch, the partial batch dropped).
OUR_LOADERS = ('shuffled', 'fixed')

# FedKD's compression on both sides (`--fedkd_compression`): as each side's code does it, off,
# or HtFLlib's on both (ours with fedkd.compression=htfllib; HtFLlib as written)
# (HtFLlib's `decomposition` returns every tensor as it is; ours runs at energy 1.0).
FEDKD_COMPRESSION = ('as_written', 'off', 'htfllib')


# The federation both sides run (`--batch_size`, `--num_clients`, `--partition`, `--alpha`):
# FedSSA's (batch 512, N = 10, two classes a client) by default; HtFLlib's scripts' is batch 10,
# N = 20, Dirichlet alpha = 0.1 (system/total.sh).
FEDERATION = {'batch_size': 512, 'num_clients': 10, 'partition': 'pathological', 'alpha': 0.1,
              'model_group': 'cnn', 'participation': 1.0}
PARTITIONS = ('pathological', 'dirichlet')
# The models (`--model_group`): ours, a config variant, or '' for the default; HtFLlib's, its
# -m model family, or None for the FedSSA paper's five CNNs, which the runner registers.
MODEL_GROUPS = {'cnn': ('', None), 'htfe2': ('htfe2', 'HtFE-img-2')}


def federation_settings(batch_size: int = 512, num_clients: int = 10,
                        partition: str = 'pathological', alpha: float = 0.1,
                        model_group: str = 'cnn', participation: float = 1.0) -> dict:
  """{dotted config field: value} of the federation: batch, clients, the fraction C of them a
  round (HtFLlib's -jr) and partition (Dirichlet: concentration `alpha`, HtFLlib's -al of
  generate_Cifar10.py). The
  `model_group` is a config variant (`config_arg`), checked here."""
  if partition not in PARTITIONS:
    raise Failure(f'--partition must be one of {PARTITIONS}, got {partition!r}.')
  if model_group not in MODEL_GROUPS:
    raise Failure(f'--model_group must be one of {tuple(MODEL_GROUPS)}, got {model_group!r}.')
  if not 0 < participation <= 1:
    raise Failure(f'--participation must be in (0, 1], got {participation}.')
  out = {'batch_size': batch_size, 'num_clients': num_clients, 'participation': participation}
  if partition == 'dirichlet':
    out.update({'partition.kind': 'dirichlet', 'partition.dirichlet_gamma': alpha})
  return out


def our_settings(method: str, lr: float, rounds: int, batch_size: int = 512,
                 upload_loss: float = 0.0, num_clients: int = 10,
                 partition: str = 'pathological', alpha: float = 0.1,
                 model_group: str = 'cnn', fedkd_compression: str = 'as_written',
                 our_loader: str = 'shuffled', participation: float = 1.0) -> dict:
  """{dotted config field: value} that sets our side to HtFLlib's fixed choices, for `method`,
  in the federation of `batch_size`, `num_clients`, `partition` and `alpha`; `upload_loss` > 0:
  clients that lose their upload (HtFLlib's -cdr, docs/algorithm.md §10); `fedkd_compression`
  'off': FedKD at energy 1.0 throughout, which sends every tensor whole; `our_loader` 'fixed':
  our batches as HtFLlib's loaders make them (batch_order=fixed, drop_last=True)."""
  settings = {'method': method, 'num_rounds': rounds, 'local_epochs': 1, 'augment': False,
              'optimizer.name': 'sgd', 'optimizer.lr': lr, 'optimizer.momentum': 0.0,
              'optimizer.weight_decay': 0.0,
              'optimizer.clip_norm': HTFLLIB_CLIP.get(method, 0.0),
              'checkpoint_every': rounds, 'checkpoint_keep': 1,
              **federation_settings(batch_size, num_clients, partition, alpha, model_group,
                                    participation)}
  if upload_loss:
    settings['system.upload_loss'] = upload_loss
  settings.update(HTFLLIB_BEHAVIOUR.get(method, {}))
  if fedkd_compression not in FEDKD_COMPRESSION:
    raise Failure(f'--fedkd_compression must be one of {FEDKD_COMPRESSION}, got '
                  f'{fedkd_compression!r}.')
  if method == 'fedkd' and fedkd_compression == 'off':
    settings.update({'fedkd.energy_start': 1.0, 'fedkd.energy_end': 1.0})
  elif method == 'fedkd' and fedkd_compression == 'htfllib':
    settings['fedkd.compression'] = 'htfllib'
  if our_loader not in OUR_LOADERS:
    raise Failure(f'--our_loader must be one of {OUR_LOADERS}, got {our_loader!r}.')
  if our_loader == 'fixed':
    settings.update({'batch_order': 'fixed', 'drop_last': True})
  # HtFLlib's server-side training reuses the local batch size (and FedTGP's the local lr), and
  # FedL2G's quiz set is one local batch.
  if method in ('fedgh', 'fedgen'):
    settings[f'{method}.server_batch'] = batch_size
  elif method == 'fedtgp':
    settings.update({'fedtgp.server_batch': batch_size, 'fedtgp.server_lr': lr})
  elif method == 'fedl2g':
    settings['fedl2g.quiz_size'] = batch_size
  return settings


def our_overrides(method: str, lr: float, rounds: int, upload_loss: float = 0.0,
                  fedkd_compression: str = 'as_written', our_loader: str = 'shuffled',
                  **federation) -> list[str]:
  """our_settings as fedssa_jax.main's --config.* flags."""
  return [f'--config.{k}={v}' for k, v in our_settings(
      method, lr, rounds, upload_loss=upload_loss, fedkd_compression=fedkd_compression,
      our_loader=our_loader, **federation).items()]


def config_arg(model_group: str = 'cnn') -> str:
  """fedssa_jax.main's --config for the models of `model_group`."""
  variant = MODEL_GROUPS[model_group][0]
  return CONFIG + (f',{variant}' if variant else '')


def our_config(method: str, lr: float, rounds: int, upload_loss: float = 0.0,
               fedkd_compression: str = 'as_written', our_loader: str = 'shuffled',
               **federation):
  """Our config with `our_settings` applied (what fedssa_jax.main runs); `federation`: the
  keyword arguments of federation_settings."""
  sys.path.insert(0, REPO)
  from fedssa_jax import config_lib  # pylint: disable=g-import-not-at-top
  federation_settings(**federation)  # a Failure for a bad group before the config is built
  c = config_lib.build('cifar10', config_arg(federation.get('model_group', 'cnn')).split(':')[1])
  for key, value in our_settings(method, lr, rounds, upload_loss=upload_loss,
                                 fedkd_compression=fedkd_compression, our_loader=our_loader,
                                 **federation).items():
    *parents, leaf = key.split('.')
    node = c
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


CNN_FAMILIES = ('cnn1', 'cnn2', 'cnn3', 'cnn4', 'cnn5')


def model_group_of(config) -> str:
  """The `MODEL_GROUPS` key whose models `config` trains ('cnn' for anything but a group's)."""
  from fedssa_jax.models import zoo  # pylint: disable=g-import-not-at-top
  families = tuple(config.model.families)
  return next((g for g, (variant, _) in MODEL_GROUPS.items()
               if variant and zoo.GROUPS[variant] == families), 'cnn')


def htfllib_args(config, rounds: int, dataset: str = DATASET) -> tuple[list[str], list[str]]:
  """HtFLlib's main.py arguments for our `config` (its method included), and the differences
  that remain (UNMATCHED's, plus any of `config` that HtFLlib cannot express)."""
  method = config.method
  if method not in ALGORITHMS:
    raise Failure(f'method {method!r} has no HtFLlib counterpart here; choose from '
                  f'{", ".join(SHARED_METHODS)}.')
  o = config.optimizer
  group = model_group_of(config)
  # For the five CNNs any family name does: the runner replaces its models.
  args = ['-data', dataset, '-ncl', '10', '-m', MODEL_GROUPS[group][1] or 'HtFE-img-2',
          '-algo', ALGORITHMS[method],
          '-nc', str(config.num_clients), '-jr', str(config.participation),
          '-lbs', str(config.batch_size), '-lr', str(o.lr), '-ls', str(config.local_epochs),
          '-gr', str(rounds), '-fd', str(config.model.feature_dim), '-eg', '1', '-t', '1',
          '-dev', 'cpu', '-go', 'against_fedssa_jax']
  if method == 'fd':
    args += ['-lam', str(config.fd.lam)]
  elif method == 'fedproto':
    args += ['-lam', str(config.fedproto.lam)]
  elif method == 'fml':
    args += ['-al', str(config.fml.alpha), '-bt', str(config.fml.beta)]
  elif method == 'fedkd':
    args += ['-mlr', str(o.lr), '-Ts', str(config.fedkd.energy_start),
             '-Te', str(config.fedkd.energy_end)]
  elif method == 'fedgh':
    args += ['-se', str(config.fedgh.server_epochs), '-slr', str(config.fedgh.server_lr)]
  elif method == 'fedtgp':
    args += ['-lam', str(config.fedtgp.lam), '-se', str(config.fedtgp.server_epochs),
             '-mart', str(config.fedtgp.margin_cap)]
  elif method == 'fedmrl':
    args += ['-sfd', str(config.fedmrl.d1)]
  elif method == 'fedgen':
    g = config.fedgen
    args += ['-nd', str(g.noise_dim), '-hd', str(g.hidden_dim), '-glr', str(g.server_lr),
             '-se', str(g.server_steps)]
  elif method == 'fedl2g':
    # One study batch and one quiz batch of the local batch size (HtFLlib's -mdb, -mqb).
    from fedssa_jax.methods import fedl2g  # pylint: disable=g-import-not-at-top
    server_lr = config.fedl2g.server_lr
    if server_lr is None:
      server_lr = fedl2g.SERVER_LRS[config.fedl2g.variant]
    args[args.index('FedL2G-feat')] = f'FedL2G-{config.fedl2g.variant}'
    args += ['-slr', str(server_lr), '-wu',
             str(config.fedl2g.warmup), '-mdb', '1', '-mqb', '1']
  unmatched = list(UNMATCHED['*']) + list(UNMATCHED.get(method, []))
  q = config.system.upload_loss
  if q:  # HtFLlib's client drop rate: its clients train, and the server drops some uploads
    args += ['-cdr', str(q)]
    unmatched.append(f'lost uploads: HtFLlib keeps exactly int((1 - {q}) K) uploads, drawn by '
                     f"Python's unseeded random.sample; ours loses each with probability {q}, "
                     'drawn from the run\'s seed.')
    if method in CDR_IGNORED:
      unmatched.append(f'lost uploads: HtFLlib\'s {ALGORITHMS[method]} aggregates every selected '
                       'client whatever -cdr says; ours honours them.')
  if config.system.dropout or config.system.straggler_rate or system_has_clock(config):
    raise Failure('only system.upload_loss has an HtFLlib counterpart (-cdr) here; its -tsr '
                  'crashes at E = 1 and its clock reads host time (docs/algorithm.md §10).')
  if method == 'fedkd' and config.fedkd.compression == 'update' and not (
      config.fedkd.energy_start == config.fedkd.energy_end == 1.0):
    unmatched += FEDKD_UNMATCHED
  if method in PROTOTYPE_PASS and not config.drop_last:
    unmatched.append('prototype pass: HtFLlib\'s leaves out the last partial batch (its '
                     'loader\'s drop_last); ours takes every training sample (--our_loader=fixed '
                     'does as HtFLlib).')
  if config.batch_order != 'fixed' or not config.drop_last:
    unmatched.append('batch order: HtFLlib\'s training loader does not shuffle (the same batches '
                     'every round, in file order) and drops the last partial batch (up to B - 1 '
                     'of a client\'s samples are never trained on); ours reshuffles every epoch '
                     'and trains the partial batch (--our_loader=fixed does as HtFLlib).')
  if o.name != 'sgd' or o.momentum or o.weight_decay:
    unmatched.append(f'optimizer: ours {o.name} momentum {o.momentum} weight decay '
                     f'{o.weight_decay}; HtFLlib plain SGD.')
  if o.clip_norm != HTFLLIB_CLIP.get(method, 0.0):
    unmatched.append(f'gradient clip: ours {o.clip_norm or "none"}; HtFLlib '
                     f'{HTFLLIB_CLIP.get(method) or "none"}.')
  if config.augment:
    unmatched.append('augmentation: ours flip, erasing and crop; HtFLlib none.')
  if group == 'cnn' and tuple(config.model.families) != CNN_FAMILIES:
    unmatched.append(f'models: ours {tuple(config.model.families)}; HtFLlib CNN-1..5.')
  if method == 'lg_fedavg' and config.lg_fedavg.weighting != 'samples':
    unmatched.append('LG-FedAvg header mean: ours uniform; HtFLlib sample-weighted.')
  if method == 'fedproto' and config.fedproto.weighting != 'uniform':
    unmatched.append('FedProto prototype mean: ours sample-weighted; HtFLlib uniform.')
  if method == 'fd' and config.fd.exclude_own:
    unmatched.append('FD: ours excludes the client\'s own logits; HtFLlib does not.')
  if method == 'fedgen':
    unmatched += fedgen_unmatched(config.fedgen)
  return args, unmatched


def fedgen_unmatched(g) -> list[str]:
  """What FedGen's section `g` sets apart from HtFLlib's code (beyond UNMATCHED's)."""
  out = []
  if not g.frozen_generator:
    out.append('FedGen generator: ours is trained and kept by the server, and the generated '
               'term starts in round 1; HtFLlib\'s server discards the generator it trains, so '
               'its clients use the initial one from round 0 (ours with '
               'fedgen.frozen_generator=True).')
  if g.weighting != 'samples':
    out.append('FedGen header mean: ours uniform; HtFLlib sample-weighted.')
  if g.weight != 1.0:
    out.append(f'FedGen generated term: ours weight {g.weight}; HtFLlib 1.')
  return out


# --------------------------------------------------------------------------------------------
# The data, as HtFLlib's files
# --------------------------------------------------------------------------------------------

def write_partition(ds, cd, root: str, dataset: str = DATASET) -> dict:
  """Writes client k's training and test samples of partition `cd` (data.ClientData) of `ds`
  (data.Dataset) as HtFLlib's `<root>/dataset/<dataset>/{train,test}/<k>.npz`: a pickled dict
  {'x': float32 [n, C, H, W] normalised with ds.mean/ds.std, 'y': int64 [n]}, in index order.
  Returns the per-client sample counts, also written as the folder's config.json."""
  folder = os.path.join(root, 'dataset', dataset)
  mean = np.asarray(ds.mean, np.float32)[:, None, None]
  std = np.asarray(ds.std, np.float32)[:, None, None]
  counts = {'train': [], 'test': []}
  for split, idx, n in (('train', cd.train_idx, cd.train_n), ('test', cd.test_idx, cd.test_n)):
    os.makedirs(os.path.join(folder, split), exist_ok=True)
    for k in range(cd.num_clients):
      rows = idx[k, :n[k]]
      x = ds.images[rows].transpose(0, 3, 1, 2).astype(np.float32) / 255.0
      x = (x - mean) / std
      y = ds.labels[rows].astype(np.int64)
      with open(os.path.join(folder, split, f'{k}.npz'), 'wb') as f:
        np.savez(f, data={'x': x, 'y': y})
      counts[split].append(int(n[k]))
  info = {'num_clients': cd.num_clients, 'num_classes': ds.num_classes,
          'written_by': 'fedssa_jax launch/against_htfllib.py', **counts}
  with open(os.path.join(folder, 'config.json'), 'w') as f:
    json.dump(info, f)
  return info


# --------------------------------------------------------------------------------------------
# HtFLlib's output
# --------------------------------------------------------------------------------------------

_ROUND = re.compile(r'^-+Round number: (\d+)-+$')
_CLIENT = re.compile(r'^Client (\d+): Acc: ([0-9.eE+-]+|nan), AUC: ')
_WEIGHTED = re.compile(r'^Averaged Test Accuracy: ([0-9.eE+-]+|nan)$')
_BUDGET = re.compile(r'^-{25,}(?: time cost -+)? ([0-9.eE+-]+)$')


def read_htfllib_log(text: str) -> list[dict]:
  """Each evaluated round of HtFLlib's printout: {'round': r, 'client_accuracy': [per client, in
  id order], 'mean_accuracy': their unweighted mean, 'weighted_accuracy': HtFLlib's own figure,
  'seconds': the round's printed time (None for a round whose time was not printed)}."""
  rounds, cur = [], None
  for line in text.splitlines():
    line = line.strip()
    m = _ROUND.match(line)
    if m:
      cur = {'round': int(m.group(1)), 'clients': {}, 'weighted_accuracy': None,
             'seconds': None}
      rounds.append(cur)
      continue
    if cur is None:
      continue
    m = _CLIENT.match(line)
    if m:
      cur['clients'][int(m.group(1))] = float(m.group(2))
      continue
    m = _WEIGHTED.match(line)
    if m:
      cur['weighted_accuracy'] = float(m.group(1))
      continue
    m = _BUDGET.match(line)
    if m and cur['seconds'] is None:
      cur['seconds'] = float(m.group(1))
  for r in rounds:
    clients = r.pop('clients')
    ids = sorted(clients)
    if not ids or ids != list(range(len(ids))):
      raise Failure(f'HtFLlib\'s round {r["round"]} printed accuracies for clients {ids}, not '
                    '0..N-1: has its printout changed?')
    r['client_accuracy'] = [clients[k] for k in ids]
    r['mean_accuracy'] = float(np.mean(r['client_accuracy']))
  return rounds


# --------------------------------------------------------------------------------------------
# The models: HtFLlib's side is built by the runner, and checked against ours layer by layer
# --------------------------------------------------------------------------------------------

_FEDKD_RANK = re.compile(r'against_htfllib fedkd: (client|server) (\S+) (\d+)x(\d+) rank (\d+) '
                         r'of (\d+) \(energy ([\d.]+)\)')


def read_fedkd_ranks(log: str) -> dict:
  """{(side, tensor): [kept ranks, one a compression]} from the runner's FedKD log lines, with
  the full rank: what HtFLlib's decomposition kept of each matrix."""
  out = {}
  for m in _FEDKD_RANK.finditer(log):
    side, name, _, _, rank, full, _ = m.groups()
    entry = out.setdefault((side, name), {'full': int(full), 'ranks': []})
    entry['ranks'].append(int(rank))
  return out


def fedkd_rank_lines(ranks: dict) -> list[str]:
  """One line a (side, matrix): how often its truncation kept rank 0 (the tensor rebuilt as
  zeros) and the kept ranks' range."""
  return [f'{side} {name}: rank 0 in {r["ranks"].count(0)} of {len(r["ranks"])} '
          f'compressions, kept {min(r["ranks"])}-{max(r["ranks"])} of {r["full"]}'
          for (side, name), r in sorted(ranks.items())]


def our_layer_sizes(feature_dim: int, num_classes: int = 10) -> dict[str, dict[str, int]]:
  """{family: {layer: parameters}} of our five CNNs (conv1, conv2, fc1, fc2; fc3 the head), with
  `feature_dim`-wide representations."""
  sys.path.insert(0, REPO)
  import jax  # pylint: disable=g-import-not-at-top
  from fedssa_jax import models  # pylint: disable=g-import-not-at-top
  out = {}
  for name in models.FAMILY_NAMES:
    model = models.make_model(name, num_classes, feature_dim=feature_dim)
    shapes = jax.eval_shape(lambda m=model: models.init_params(m, jax.random.PRNGKey(0)))
    out[name] = {layer: int(sum(np.prod(v.shape) for v in jax.tree_util.tree_leaves(sub)))
                 for layer, sub in shapes.items()}
  return out


_LAYERS = re.compile(r'^against_htfllib runner: (cnn\d) layers (.*)$')
# HtFLlib's BaseHeadSplit names: base.<layer> for the extractor, head for our fc3.
_HTFL_LAYER = {'base.conv1': 'conv1', 'base.conv2': 'conv2', 'base.fc1': 'fc1',
               'base.fc2': 'fc2', 'head': 'fc3'}


def check_layer_sizes(log: str, ours: dict[str, dict[str, int]]) -> None:
  """A Failure unless each family's layer sizes, as the runner printed them from HtFLlib's
  models ('against_htfllib runner: cnnK layers base.conv1=N ...'), equal ours."""
  seen = {}
  for line in log.splitlines():
    m = _LAYERS.match(line.strip())
    if m:
      sizes = dict(item.split('=') for item in m.group(2).split())
      seen[m.group(1)] = {_HTFL_LAYER.get(k, k): int(v) for k, v in sizes.items()}
  for family, layers in ours.items():
    if seen.get(family) != layers:
      raise Failure(f'HtFLlib\'s {family} has layers {seen.get(family)}, ours {layers}: the '
                    'models differ.')


# The FedSSA paper's five CNNs for HtFLlib, written beside the runner as fedssa_cnn.py.
CNN_MODULE = r'''
import torch
from torch import nn
import torch.nn.functional as F


class FedSSACNN(nn.Module):
  """The FedSSA paper's CNN: conv 5x5 16, pool, conv 5x5 c2, pool, fc1, fc2 (the representation)
  with ReLUs, and fc, the head, which HtFLlib's BaseHeadSplit splits off."""

  def __init__(self, c2, fc1, num_classes=10, dim=500):
    super().__init__()
    self.conv1 = nn.Conv2d(3, 16, 5)
    self.conv2 = nn.Conv2d(16, c2, 5)
    self.fc1 = nn.Linear(c2 * 5 * 5, fc1)
    self.fc2 = nn.Linear(fc1, dim)
    self.fc = nn.Linear(dim, num_classes)

  def forward(self, x):
    x = F.max_pool2d(F.relu(self.conv1(x)), 2)
    x = F.max_pool2d(F.relu(self.conv2(x)), 2)
    x = torch.flatten(x, 1)
    x = F.relu(self.fc2(F.relu(self.fc1(x))))
    return self.fc(x)
'''


# Runs HtFLlib's main.py unchanged after the run-time changes of the docstring.
# argv: <HtFLlib's system folder> <main.py arguments...>
RUNNER = r'''
import os, runpy, sys, types
sys.dont_write_bytecode = True
system = sys.argv[1]
sys.path.insert(0, system)
import torch
torch.cuda.is_available = lambda: False
_SEED = int(os.environ.get('AGAINST_HTFLLIB_SEED', '0'))  # --htfllib_seeds: torch's seeds moved
if _SEED:
  _manual_seed = torch.manual_seed
  torch.manual_seed = lambda seed: _manual_seed(seed + _SEED)
  print(f'against_htfllib runner: torch.manual_seed(s) runs as torch.manual_seed(s + {_SEED})',
        flush=True)


from fedssa_cnn import FedSSACNN  # a module of its own, so that torch.save can pickle it

# Servers that main.py imports but that are not run here, whose imports need packages or
# files beyond torch (StyleGAN, Stable Diffusion, `higher`): an empty module where the import fails.
for name, cls in (('serverktl_stylegan_xl', 'FedKTL'), ('serverktl_stylegan_3', 'FedKTL'),
                  ('serverktl_stable_diffusion', 'FedKTL'), ('serverl2g_feat', 'FedL2G'),
                  ('serverl2g_logit', 'FedL2G')):
  try:
    __import__('flcore.servers.' + name)
  except Exception as e:  # pylint: disable=broad-except
    stub = types.ModuleType('flcore.servers.' + name)
    setattr(stub, cls, None)
    sys.modules['flcore.servers.' + name] = stub
    print(f'against_htfllib runner: flcore.servers.{name} left out ({type(e).__name__}: {e})',
          flush=True)
import flcore.trainmodel.models as htfl_models
import flcore.servers.serverbase as serverbase
htfl_models.FedSSACNN = FedSSACNN
FAMILIES = [('cnn1', 32, 2000), ('cnn2', 16, 2000), ('cnn3', 32, 1000), ('cnn4', 32, 800),
            ('cnn5', 32, 500)]
MODELS = [f'FedSSACNN({c2}, {fc1}, num_classes=args.num_classes, dim=args.feature_dim)'
          for _, c2, fc1 in FAMILIES]
_server_init = serverbase.Server.__init__


def _init(self, args, times):
  args.models, args.global_model = MODELS, MODELS[-1]
  _server_init(self, args, times)


class _Args:
  num_classes, feature_dim, models, global_model = 10, 500, MODELS, MODELS[-1]


if os.environ.get('AGAINST_HTFLLIB_MODELS') == 'htfllib':  # its own -m model family
  print('against_htfllib runner: HtFLlib\'s own models', flush=True)
else:  # the five CNNs
  serverbase.Server.__init__ = _init
  for k, (family, _, _) in enumerate(FAMILIES):
    model = htfl_models.BaseHeadSplit(_Args(), k)
    sizes = {}
    for pname, p in model.named_parameters():
      layer = pname.rsplit('.', 1)[0]
      sizes[layer] = sizes.get(layer, 0) + p.numel()
    print(f'against_htfllib runner: {family} layers '
          + ' '.join(f'{k}={v}' for k, v in sizes.items()), flush=True)
if os.environ.get('AGAINST_HTFLLIB_LOADER') == 'shuffled':  # a diagnostic (--htfllib_loader)
  import flcore.clients.clientbase as clientbase
  from torch.utils.data import DataLoader
  from utils.data_utils import read_client_data

  def _load_train_data(self, batch_size=None):
    train = read_client_data(self.dataset, self.id, is_train=True, few_shot=self.few_shot)
    return DataLoader(train, batch_size or self.batch_size, drop_last=False, shuffle=True)

  clientbase.Client.load_train_data = _load_train_data
  print('against_htfllib runner: training loaders reshuffle every epoch and keep the last '
        'partial batch', flush=True)
if '-algo' in sys.argv and sys.argv[sys.argv.index('-algo') + 1] == 'FedKD':
  # Each tensor's kept rank, as HtFLlib's decomposition truncates it (a log, nothing changed),
  # or, with AGAINST_HTFLLIB_FEDKD=off, every tensor returned whole (no compression).
  import flcore.clients.clientkd as clientkd
  import flcore.servers.serverkd as serverkd
  _decomposition = clientkd.decomposition

  def _traced(side):
    def decomposition(named_params, energy):
      named_params = list(named_params)
      if os.environ.get('AGAINST_HTFLLIB_FEDKD') == 'off':
        return {name: (p.detach().cpu().numpy() if hasattr(p, 'detach') else p)
                for name, p in named_params}
      out = _decomposition(named_params, energy)
      for name, p in named_params:
        shape = tuple(p.shape)
        if isinstance(out.get(name), list) and len(shape) == 2:
          print(f'against_htfllib fedkd: {side} {name} {shape[0]}x{shape[1]} rank '
                f'{out[name][1].shape[0]} of {min(shape)} (energy {energy:.4f})', flush=True)
      return out
    return decomposition

  clientkd.decomposition = _traced('client')
  serverkd.decomposition = _traced('server')
  print('against_htfllib runner: FedKD compression '
        + ('off' if os.environ.get('AGAINST_HTFLLIB_FEDKD') == 'off' else 'as written, ranks logged'),
        flush=True)
print(f'against_htfllib runner: torch {torch.__version__}, {torch.get_num_threads()} threads',
      flush=True)
script = os.path.join(system, 'main.py')
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name='__main__')
'''


def find_htfllib(path: str, flag: str = '--htfllib') -> str:
  """The system/ folder of an HtFLlib checkout, or a Failure naming the fix."""
  fix = (f'clone HtFLlib (git clone https://github.com/TsingZ0/HtFLlib) and pass '
         f'{flag}=<the clone>')
  if not path:
    raise Failure(f'{flag} is required: {fix}.')
  for system in (os.path.join(path, 'system'), path):
    if os.path.isfile(os.path.join(system, 'main.py')) and os.path.isdir(
        os.path.join(system, 'flcore', 'servers')):
      return os.path.abspath(system)
  raise Failure(f'{flag}={path} holds no system/main.py with flcore/: {fix}.')


def check_htfllib_python(python: str) -> str:
  """The torch version of `python`, or a Failure naming how to get one."""
  fix = ('make a venv (python -m venv /tmp/venv-torch --system-site-packages && '
         '/tmp/venv-torch/bin/pip install torch torchvision h5py scikit-learn calmsize) and pass '
         '--htfllib_python=/tmp/venv-torch/bin/python')
  return side_by_side.check_python(python, 'torch, torchvision, h5py, sklearn, calmsize',
                                   '--htfllib_python', fix)


# --------------------------------------------------------------------------------------------
# Running both sides
# --------------------------------------------------------------------------------------------

def federation(args) -> dict:
  """The federation_settings keyword arguments of the command line."""
  return {k: getattr(args, k) for k in FEDERATION}


def partition_suffix(args) -> str:
  """What the partition's files are named with, beyond the default one's (none)."""
  return ((f'_n{args.num_clients}' if args.num_clients != FEDERATION['num_clients'] else '')
          + (f'_dir{args.alpha:g}' if args.partition == 'dirichlet' else ''))


def federation_suffix(args) -> str:
  """What the runs' files are named with, beyond the default federation's (none)."""
  return ((f'_b{args.batch_size}' if args.batch_size != FEDERATION['batch_size'] else '')
          + partition_suffix(args)
          + (f'_jr{jr:g}' if (jr := getattr(args, 'participation', 1.0)) != 1.0 else '')
          + (f'_lr{args.lr:g}' if args.lr != 0.05 else '')
          + (f'_{args.model_group}' if args.model_group != FEDERATION['model_group'] else ''))


def dataset_name(args) -> str:
  """HtFLlib's dataset folder of the federation's partition."""
  return DATASET + partition_suffix(args)


def prepare_data(args, scratch):
  """Our partition of CIFAR-10 written as HtFLlib's files under <scratch>/htfllib (once)."""
  root = os.path.join(scratch, 'htfllib')
  done = os.path.join(root, 'dataset', dataset_name(args), 'config.json')
  if os.path.isfile(done):
    with open(done) as f:
      return json.load(f)
  sys.path.insert(0, REPO)
  from fedssa_jax import data  # pylint: disable=g-import-not-at-top
  config = our_config('standalone', args.lr, args.rounds, **federation(args))
  try:
    ds = data.load_dataset('cifar10', args.data_dir)
  except (data.DataError, FileNotFoundError) as e:
    raise Failure(f'--data_dir={args.data_dir}: {e}') from None
  cd = data.partition_from_config(config, ds)
  print(f'Writing our partition (fingerprint {data.fingerprint(cd)}) as HtFLlib\'s files under '
        f'{root}/dataset/{dataset_name(args)}', flush=True)
  info = write_partition(ds, cd, root, dataset_name(args))
  info['fingerprint'] = data.fingerprint(cd)
  with open(done, 'w') as f:
    json.dump(info, f)
  return info


def _kdoff(args, method: str) -> str:
  """What an HtFLlib run of `method` is named with for --fedkd_compression (only FedKD's
  change, and only when off: with 'htfllib' it runs as written)."""
  return '_kdoff' if args.fedkd_compression == 'off' and method == 'fedkd' else ''


def _kd_ours(args, method: str) -> str:
  """What our run of `method` is named with for --fedkd_compression."""
  return _kdoff(args, method) + (
      '_kdhtfl' if args.fedkd_compression == 'htfllib' and method == 'fedkd' else '')


def _suffix(args, method: str = 'fedkd'):
  """An HtFLlib run's name beyond its method and seed (`method`'s own), or, with the
  `_ourfixed` of --our_loader=fixed, the results files' (the default)."""
  return (('' if args.htfllib_loader == 'as_written' else f'_{args.htfllib_loader}')
          + _kdoff(args, method)
          + (f'_cdr{args.upload_loss:g}' if args.upload_loss else '') + federation_suffix(args))


def _our_loader(args) -> str:
  """What our runs and the results are named with for --our_loader (the default: nothing)."""
  return '_ourfixed' if args.our_loader == 'fixed' else ''


def _seed(seed: int) -> str:
  return f'_seed{seed}' if seed else ''


def run_htfllib(args, method, system, scratch, seed=0):
  """HtFLlib's run of `method`, its torch seeds moved by `seed` (0: as written)."""
  log_path = os.path.join(args.out, f'htfllib_{method}{_seed(seed)}{_suffix(args, method)}.log')
  config = our_config(method, args.lr, args.rounds, args.upload_loss, args.fedkd_compression,
                      **federation(args))
  if not os.path.isfile(log_path + '.done'):
    argv, _ = htfllib_args(config, args.rounds, dataset_name(args))
    runner = os.path.join(scratch, 'run_htfllib.py')
    with open(runner, 'w') as f:
      f.write(RUNNER)
    with open(os.path.join(scratch, 'fedssa_cnn.py'), 'w') as f:
      f.write(CNN_MODULE)
    work = os.path.join(scratch, 'htfllib', 'system')
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE='1', CUDA_VISIBLE_DEVICES='',
               TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD='1', AGAINST_HTFLLIB_LOADER=args.htfllib_loader,
               AGAINST_HTFLLIB_MODELS='cnn' if args.model_group == 'cnn' else 'htfllib',
               AGAINST_HTFLLIB_FEDKD='off' if _kdoff(args, method) else 'as_written',
               AGAINST_HTFLLIB_SEED=str(seed))
    side_by_side._run_logged([args.htfllib_python, runner, system, *argv], log_path, work, env,
                             f'HtFLlib ({method}, seed {seed})')
    os.rename(log_path, log_path + '.done')
  with open(log_path + '.done') as f:
    log = f.read()
  if args.model_group == 'cnn':  # HtFLlib's own groups: the zoo's tests match them with torch
    check_layer_sizes(log, our_layer_sizes(config.model.feature_dim))
  ranks = read_fedkd_ranks(log)
  if ranks:
    print('  HtFLlib\'s FedKD truncations (matrices):\n    '
          + '\n    '.join(fedkd_rank_lines(ranks)), flush=True)
  rounds = read_htfllib_log(log)
  if len(rounds) < args.rounds + 1:
    raise Failure(f'{log_path}.done holds {len(rounds)} evaluated rounds, not '
                  f'{args.rounds + 1}: remove it to run HtFLlib\'s {method} (seed {seed}) '
                  'again.')
  return rounds[:args.rounds + 1]


def run_ours(args, method, scratch, seed):
  """Our run of `method` at `seed` (the partition stays seed 0's, the one HtFLlib reads)."""
  name = f'ours_{method}' + _seed(seed) + (
      f'_loss{args.upload_loss:g}' if args.upload_loss else '') + _kd_ours(args, method) + (
      federation_suffix(args)) + _our_loader(args)
  workdir = os.path.join(scratch, name)
  metrics = os.path.join(args.out, f'{name}.jsonl')
  if not os.path.isfile(metrics):
    cmd = [sys.executable, '-m', 'fedssa_jax.main', f'--config={config_arg(args.model_group)}',
           f'--config.data_dir={args.data_dir}', f'--config.seed={seed}',
           '--config.partition.seed=0', f'--workdir={workdir}',
           *our_overrides(method, args.lr, args.rounds, args.upload_loss,
                          args.fedkd_compression, args.our_loader, **federation(args))]
    env = dict(os.environ, JAX_PLATFORMS='cpu')
    env['PYTHONPATH'] = REPO + os.pathsep + env.get('PYTHONPATH', '')
    side_by_side._run_logged(cmd, os.path.join(args.out, f'{name}.log'), REPO, env,
                             f'fedssa_jax.main ({method}, seed {seed})')
    os.replace(os.path.join(workdir, 'metrics.jsonl'), metrics)
  with open(metrics) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return [{'round': r['round'], 'client_accuracy': r['client_accuracy'],
           'mean_accuracy': r['mean_accuracy'], 'seconds': r['round_seconds'],
           'client_flops': r.get('client_flops')} for r in records]


def steady(seconds):
  """The median s/round after the first round (which compiles here): the median, so that a
  round slowed by other work on the machine does not move it."""
  s = [t for t in seconds[1:] if t is not None]
  return float(np.median(s)) if s else float('nan')


def mean_std(values) -> tuple[float, float | None]:
  """The mean of one value per seed, and their sample standard deviation (None for one seed)."""
  v = np.asarray(values, np.float64)
  return float(v.mean()), (float(v.std(ddof=1)) if len(v) > 1 else None)


def gap_row(label, theirs: list[float], theirs_weighted: list[float], ours: list[float]) -> dict:
  """One row of the comparison: each side's mean and std over its seeds, the difference of the
  means, and whether it exceeds twice the combined std sqrt(std_HtFLlib^2 + std_ours^2), the
  spread of one run's difference. Where HtFLlib ran one seed and ours two or more, its std is
  taken to be ours (the same partition, schedule and models), so the combined std is
  sqrt(2) std_ours, and `std_assumed` says so; None where ours has one seed."""
  h, h_sd = mean_std(theirs)
  o, o_sd = mean_std(ours)
  assumed = h_sd is None and o_sd is not None
  if o_sd is None:
    combined = None
  else:
    combined = float(np.hypot(o_sd if assumed else h_sd, o_sd))
  return {'round': label, 'htfllib': h, 'htfllib_std': h_sd, 'htfllib_seeds': list(theirs),
          'htfllib_weighted': mean_std(theirs_weighted)[0], 'ours': o, 'ours_std': o_sd,
          'ours_seeds': list(ours), 'difference': o - h, 'combined_std': combined,
          'std_assumed': assumed,
          'beyond_noise': None if combined is None else bool(abs(o - h) > 2 * combined)}


def compare(method, htfl_by_seed, ours_by_seed, checkpoints=(5, 10, 15, 20)):
  """The per-method summary: each side's curves (one per seed) and, at `checkpoints` and over
  the last five of them, gap_row's means, stds and difference; the steady s/round of both
  (each side's first seed's run)."""
  theirs = [{r['round']: r for r in run} for run in htfl_by_seed]
  mine = [{r['round']: r for r in ours} for ours in ours_by_seed]
  have = lambda r: all(r in t for t in theirs) and all(r in m for m in mine)
  acc = lambda runs, rounds, key='mean_accuracy': [
      float(np.mean([run[r][key] for r in rounds])) for run in runs]
  rows = [gap_row(r, acc(theirs, [r]), acc(theirs, [r], 'weighted_accuracy'), acc(mine, [r]))
          for r in checkpoints if have(r)]
  # The mean over the last five rounds: single rounds swing by a few points (HtFLlib's fixed
  # batch order makes its curve jagged), so this is the steadier figure to compare.
  last = [r for r in checkpoints[-1:] if have(r)]
  if last and last[0] >= 5:
    window = range(last[0] - 4, last[0] + 1)
    rows.append(gap_row(f'{window[0]}-{window[-1]}', acc(theirs, window),
                        acc(theirs, window, 'weighted_accuracy'), acc(mine, window)))
  # HtFLlib's round r is the evaluation at its start plus the training r -> r + 1.
  t_htfl = steady([r['seconds'] for r in htfl_by_seed[0]])
  t_ours = steady([r['seconds'] for r in ours_by_seed[0]])
  return {'method': method, 'algorithm': ALGORITHMS[method], 'rows': rows,
          'htfllib_seconds_per_round': t_htfl, 'ours_seconds_per_round': t_ours,
          'speedup': t_htfl / t_ours,
          'htfllib_curves': [[r['mean_accuracy'] for r in run] for run in htfl_by_seed],
          'ours_curves': [[None] + [r['mean_accuracy'] for r in ours] for ours in ours_by_seed]}


def images_per_second(res: dict, train_counts, batch_size: int,
                      client_flops: float | None = None, roofline: float | None = None) -> dict:
  """The training images a round of each side takes (E = 1, every client: HtFLlib's loaders
  drop each client's last partial batch, ours keep it) over its steady s/round, which holds the
  round's evaluation on both sides. `client_flops`: our round's training FLOPs (the records'
  count), which HtFLlib's round does in proportion to its images: each side's GFLOP/s, and
  their share of the float32 matmul `roofline` (FLOP/s) where it is given."""
  n = np.asarray(train_counts, np.int64)
  theirs, ours = int((n // batch_size * batch_size).sum()), int(n.sum())
  out = {'htfllib_images_per_round': theirs, 'ours_images_per_round': ours,
         'htfllib_images_per_second': theirs / res['htfllib_seconds_per_round'],
         'ours_images_per_second': ours / res['ours_seconds_per_round']}
  if client_flops:
    per_image = client_flops / ours
    for side in ('htfllib', 'ours'):
      out[f'{side}_gflops'] = per_image * out[f'{side}_images_per_second'] / 1e9
      if roofline:
        out[f'{side}_roofline_share'] = out[f'{side}_gflops'] * 1e9 / roofline
  return out


def steady_flops(ours_by_seed) -> float | None:
  """Our steady round's training FLOPs: the median over rounds 2 on of the first seed's."""
  flops = [r.get('client_flops') for r in ours_by_seed[0][1:]]
  flops = [f for f in flops if f]
  return float(np.median(flops)) if flops else None


def roofline_flops() -> float:
  """The machine's float32 matmul rate (run.bench's roofline), measured now, in this run."""
  sys.path.insert(0, REPO)
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_platforms', 'cpu')  # both sides train on the CPU
  from fedssa_jax.run import bench  # pylint: disable=g-import-not-at-top
  return bench.matmul_roofline(quick=False)['flops_per_s']


def print_table(results):
  print('\nUnweighted mean accuracy over clients (HtFLlib / ours, difference in points); '
        's/round steady')
  for res in results:
    cells = '  '.join(f'r{row["round"]} {row["htfllib"]:.4f}/{row["ours"]:.4f} '
                      f'({100 * row["difference"]:+.1f})' for row in res['rows'])
    rate = ''
    if 'ours_images_per_second' in res:
      rate = (f' ({res["htfllib_images_per_second"]:.0f} vs {res["ours_images_per_second"]:.0f} '
              'images/s')
      if 'ours_gflops' in res:
        rate += f'; {res["htfllib_gflops"]:.1f} vs {res["ours_gflops"]:.1f} GFLOP/s'
      rate += ')'
    print(f'  {res["method"]:<11} {cells}  |  {res["htfllib_seconds_per_round"]:.1f} s vs '
          f'{res["ours_seconds_per_round"]:.1f} s = {res["speedup"]:.1f}x{rate}', flush=True)


def markdown(results) -> str:
  """The accuracy and speed tables, as docs/results.md shows them."""
  def gap(row):
    text = f'{100 * row["difference"]:+.1f}'
    text = f'**{text}**' if row.get('beyond_noise') else text
    return text + ('*' if row.get('std_assumed') else '')

  def side(row, name):
    sd = row.get(f'{name}_std')
    return f'{row[name]:.4f}' + ('' if sd is None else f' ± {sd:.4f}')

  by_seed = lambda row, name: ', '.join(f'{v:.4f}' for v in row.get(f'{name}_seeds', ()))
  out = ['| method (HtFLlib) | rounds | HtFLlib | HtFLlib by seed | HtFLlib, weighted | ours | '
         'ours by seed | ours - HtFLlib, points |', '|---|---|---|---|---|---|---|---|']
  for res in results:
    for row in res['rows']:
      out.append(f'| {res["method"]} ({res["algorithm"]}) | {row["round"]} | '
                 f'{side(row, "htfllib")} | {by_seed(row, "htfllib")} | '
                 f'{row["htfllib_weighted"]:.4f} | {side(row, "ours")} | '
                 f'{by_seed(row, "ours")} | {gap(row)} |')
  out += ['', 'Mean ± sample std over each side\'s seeds; a difference in bold exceeds twice '
          'their combined std, sqrt(std_HtFLlib² + std_ours²). *: HtFLlib ran one seed, and its '
          'std is taken to be ours (sqrt(2) std_ours combined).']
  out += ['', 'By round (mean accuracy, ± the sample std where a side ran several seeds; '
          'HtFLlib / ours, then ours - HtFLlib in points):', '',
          '| method (HtFLlib) | seeds | ' + ' | '.join(
              f'r{r["round"]}'.replace('-', '–') for r in results[0]['rows']) + ' |',
          '|---|---|' + '---|' * len(results[0]['rows'])] if results else []
  for res in results:
    cell = lambda row: (f'{side(row, "htfllib")} / {side(row, "ours")} ({gap(row)})')
    # Seeds a side, from the rows (results kept from older commands hold no curves).
    count = lambda name: len(res['rows'][0].get(f'{name}_seeds') or [None]) if res['rows'] else 0
    seeds = f'{count("htfllib")} / {count("ours")}'
    out.append(f'| {res["method"]} ({res["algorithm"]}) | {seeds} | '
               + ' | '.join(cell(row) for row in res['rows']) + ' |')
  out += ['', '| method | HtFLlib s/round | ours s/round | HtFLlib / ours | HtFLlib images/s | '
          'ours images/s | HtFLlib GFLOP/s | ours GFLOP/s |', '|---|---|---|---|---|---|---|---|']
  for res in results:
    rates = ' | '.join(
        (f'{res[k]:.0f}' if 'images' in k else f'{res[k]:.1f}') if k in res else '—'
        for k in ('htfllib_images_per_second', 'ours_images_per_second', 'htfllib_gflops',
                  'ours_gflops'))
    out.append(f'| {res["method"]} | {res["htfllib_seconds_per_round"]:.1f} | '
               f'{res["ours_seconds_per_round"]:.1f} | {res["speedup"]:.2f}x | {rates} |')
  return '\n'.join(out) + '\n'


def plot(results, path):
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    print('  (no matplotlib: no figure)')
    return
  cols = min(3, len(results))
  rows = -(-len(results) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
  for ax, res in zip(axes.flat, results):
    for i, h in enumerate(res.get('htfllib_curves') or [res['htfllib_curve']]):
      ax.plot(range(len(h)), h, color='tab:orange', alpha=1.0 if i == 0 else 0.4,
              label='HtFLlib' if i == 0 else None)
    for i, o in enumerate(res['ours_curves']):
      ax.plot(range(1, len(o)), o[1:], color='tab:blue', alpha=1.0 if i == 0 else 0.4,
              label='fedssa_jax' if i == 0 else None)
    ax.set_title(f'{res["method"]} ({res["algorithm"]})')
    ax.set_xlabel('round')
    ax.set_ylabel('mean client accuracy')
    ax.grid(alpha=0.3)
  for ax in list(axes.flat)[len(results):]:
    ax.axis('off')
  axes.flat[0].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f'  figure: {path}')


def parse_seeds(parser, flag: str, text: str) -> list[int]:
  try:
    seeds = [int(v) for v in text.split(',') if v.strip()]
  except ValueError:
    seeds = []
  if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
    parser.error(f'{flag} must be distinct comma-separated integers >= 0, got {text!r}')
  return seeds


def merged(path: str, results: list[dict]) -> list[dict]:
  """`results` with those of the other methods that the results file at `path` holds (an
  earlier command's, in the same --out and of the same federation and options), in
  SHARED_METHODS' order: a table can be filled one command at a time."""
  try:
    with open(path) as f:
      earlier = json.load(f)['results']
  except (OSError, ValueError, KeyError):
    earlier = []
  now = {r['method'] for r in results}
  keep = [r for r in earlier if r.get('method') not in now]
  if keep:
    print(f'  kept from {path}: {", ".join(r["method"] for r in keep)}', flush=True)
  order = {m: i for i, m in enumerate(SHARED_METHODS)}
  return sorted(keep + results, key=lambda r: order.get(r['method'], len(order)))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--htfllib', help='a checkout of HtFLlib (its root or system/)')
  p.add_argument('--htfllib_fd', help='the checkout to run FD from (default: --htfllib)')
  p.add_argument('--htfllib_python', default='python', help='a Python with torch, torchvision, '
                 'h5py and scikit-learn')
  p.add_argument('--data_dir', default=os.path.expanduser('~/tensorflow_datasets'),
                 help='a TFDS data_dir holding cifar10')
  p.add_argument('--methods', default=','.join(SHARED_METHODS),
                 help=f'comma-separated, of {", ".join(SHARED_METHODS)}')
  p.add_argument('--rounds', type=int, default=20)
  p.add_argument('--lr', type=float, default=0.05, help='plain SGD learning rate, both sides')
  p.add_argument('--htfllib_loader', default='as_written', choices=('as_written', 'shuffled'),
                 help='a diagnostic: "shuffled" patches HtFLlib\'s training loaders to reshuffle '
                 'every epoch and keep the last partial batch, as ours do (its logs and results '
                 'get the suffix _shuffled)')
  p.add_argument('--batch_size', type=int, default=FEDERATION['batch_size'],
                 help='the local batch, both sides (HtFLlib\'s scripts: 10)')
  p.add_argument('--num_clients', type=int, default=FEDERATION['num_clients'],
                 help='N (HtFLlib\'s scripts: 20)')
  p.add_argument('--participation', type=float, default=FEDERATION['participation'],
                 help='the fraction C of the N clients that trains each round, both sides '
                 '(HtFLlib\'s -jr; its scripts: 1.0; the n1000 variant: 0.1)')
  p.add_argument('--partition', default=FEDERATION['partition'], choices=PARTITIONS,
                 help='our partition, written as HtFLlib\'s files: two classes a client '
                 '(FedSSA\'s) or Dirichlet of concentration --alpha (HtFLlib\'s scripts)')
  p.add_argument('--alpha', type=float, default=FEDERATION['alpha'],
                 help='the Dirichlet concentration (HtFLlib\'s scripts: 0.1)')
  p.add_argument('--model_group', default=FEDERATION['model_group'], choices=tuple(MODEL_GROUPS),
                 help='the models, both sides: the FedSSA paper\'s five CNNs (registered into '
                 'HtFLlib) or HtFLlib\'s HtFE-img-2 (FedAvgCNN, ResNet-18; ours :htfe2)')
  p.add_argument('--fedkd_compression', default='as_written', choices=FEDKD_COMPRESSION,
                 help='"off": FedKD without compression on both sides (HtFLlib\'s decomposition '
                 'returns each tensor as it is; ours at energy 1.0); files get _kdoff. '
                 '"htfllib": ours does what HtFLlib\'s code does (fedkd.compression=htfllib), '
                 'HtFLlib runs as written; our files get _kdhtfl')
  p.add_argument('--upload_loss', type=float, default=0.0,
                 help='clients lose their upload with this probability: our '
                 'system.upload_loss, HtFLlib\'s -cdr (results get the suffix _cdr<q>)')
  p.add_argument('--seeds', default='0', help='seeds, comma-separated, of both sides: ours '
                 'as config.seed, HtFLlib\'s as an offset to each of its torch.manual_seed '
                 'calls; the partition is seed 0\'s for all')
  p.add_argument('--htfllib_seeds', help='HtFLlib\'s seeds, where not --seeds\' (0: once, as '
                 'written)')
  p.add_argument('--our_loader', default='shuffled', choices=OUR_LOADERS,
                 help='a diagnostic: "fixed" trains our side on HtFLlib\'s batches (each '
                 'client\'s stored order every epoch, the partial batch dropped: batch_order='
                 'fixed, drop_last=True); our runs and the results get the suffix _ourfixed')
  p.add_argument('--out', default='results/against_htfllib',
                 help='logs, metrics, results.json and the figure; methods already there are '
                 'not run again')
  p.add_argument('--scratch', help='data and run folders (default: <out>/scratch)')
  args = p.parse_args(argv)
  methods = [m.strip() for m in args.methods.split(',') if m.strip()]
  seeds = parse_seeds(p, '--seeds', args.seeds)
  htfllib_seeds = (seeds if args.htfllib_seeds is None else
                   parse_seeds(p, '--htfllib_seeds', args.htfllib_seeds))
  try:
    for m in methods:
      if m not in ALGORITHMS:
        raise Failure(f'--methods: {m!r} is not shared with HtFLlib here; choose from '
                      f'{", ".join(SHARED_METHODS)}.')
    system = find_htfllib(args.htfllib)
    fd_system = find_htfllib(args.htfllib_fd, '--htfllib_fd') if args.htfllib_fd else system
    torch_version = check_htfllib_python(args.htfllib_python)
    os.makedirs(args.out, exist_ok=True)
    scratch = args.scratch or os.path.join(args.out, 'scratch')
    os.makedirs(scratch, exist_ok=True)
    head = lambda s: side_by_side._git_head(os.path.dirname(s), code=('system',))
    header = {'command': ' '.join([os.path.relpath(__file__, REPO)] + sys.argv[1:]),
              'ours_commit': side_by_side._git_head(REPO, code=('fedssa_jax', 'configs')),
              'htfllib_commit': head(system), 'htfllib_fd_commit': head(fd_system),
              'torch': torch_version, 'cpus': os.cpu_count(),
              'config': config_arg(args.model_group),
              'lr': args.lr, 'rounds': args.rounds, 'seeds': seeds,
              'htfllib_seeds': htfllib_seeds, **federation(args),
              'htfllib_loader': args.htfllib_loader, 'our_loader': args.our_loader,
              'upload_loss': args.upload_loss, 'fedkd_compression': args.fedkd_compression}
    print(json.dumps(header, indent=1), flush=True)
    info = prepare_data(args, scratch)
    results = []
    for m in methods:
      _, unmatched = htfllib_args(our_config(m, args.lr, args.rounds, args.upload_loss,
                                             args.fedkd_compression, args.our_loader,
                                             **federation(args)), args.rounds)
      print(f'\n{m}: not matched:\n  - ' + '\n  - '.join(unmatched), flush=True)
      htfl = [run_htfllib(args, m, fd_system if m == 'fd' else system, scratch, seed)
              for seed in htfllib_seeds]
      ours = [run_ours(args, m, scratch, seed) for seed in seeds]
      res = compare(m, htfl, ours)
      res['unmatched'], res['client_flops'] = unmatched, steady_flops(ours)
      res['seeds'] = {'htfllib': htfllib_seeds, 'ours': seeds}
      res.update(images_per_second(res, info['train'], args.batch_size, res['client_flops']))
      results.append(res)
      print_table([res])
    # The float32 matmul roofline of this machine, in this run, after both sides' runs.
    header['roofline_gflops'] = roofline_flops() / 1e9
    for res in results:
      res.update(images_per_second(res, info['train'], args.batch_size, res.get('client_flops'),
                                   header['roofline_gflops'] * 1e9))
  except Failure as e:
    sys.exit(f'against_htfllib: {e}')
  print_table(results)
  print(f'\nfloat32 matmul roofline: {header["roofline_gflops"]:.1f} GFLOP/s; client GFLOP/s '
        'are the training FLOPs over the whole round (its evaluation included):')
  for res in results:
    if 'ours_roofline_share' in res:
      print(f'  {res["method"]:<11} HtFLlib {100 * res["htfllib_roofline_share"]:.0f}%, ours '
            f'{100 * res["ours_roofline_share"]:.0f}% of the roofline', flush=True)
  name = (_suffix(args) + _our_loader(args)
          + ('_kdhtfl' if args.fedkd_compression == 'htfllib' else ''))
  results = merged(os.path.join(args.out, f'results{name}.json'), results)
  with open(os.path.join(args.out, f'results{name}.json'), 'w') as f:
    json.dump({**header, 'partition': info.get('fingerprint'), 'finished': time.ctime(),
               'results': results}, f, indent=1)
  with open(os.path.join(args.out, f'results{name}.md'), 'w') as f:
    f.write(markdown(results))
  plot(results, os.path.join(args.out, f'curves{name}.png'))


if __name__ == '__main__':
  main()
