"""Non-IID partitions and per-client splits, in a vectorisable layout (docs/algorithm.md §2).

Each client's train/val/test sets are fixed-shape, padded int32 index arrays into the data set's
one image array, with per-client counts (`ClientData`), so a jitted, vmapped step gathers any
client's batch with one indexing op and no Python loop; `DeviceData` is their device copy beside
the images.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import jax
import numpy as np

from fedssa_jax.data.datasets import Dataset, SPLITS
from fedssa_jax.errors import ConfigError, DataError


@dataclasses.dataclass(frozen=True)
class ClientData:
  """Per-client index sets, padded to fixed shapes. Row k belongs to client k."""
  train_idx: np.ndarray  # [N, max_train] int32, indices into Dataset.images; padding = 0
  train_n: np.ndarray    # [N] int32
  val_idx: np.ndarray
  val_n: np.ndarray
  test_idx: np.ndarray
  test_n: np.ndarray
  seen: np.ndarray       # [N, S] bool: classes present in the client's training split

  @property
  def num_clients(self) -> int:
    return int(self.train_n.shape[0])


@dataclasses.dataclass(frozen=True)
class DeviceData:
  """Images and per-client index sets, as device arrays (see ClientData)."""
  images: jax.Array     # [M, H, W, C] uint8
  labels: jax.Array     # [M] int32
  train_idx: jax.Array  # [N, max_train] int32
  train_n: jax.Array    # [N] int32
  test_idx: jax.Array   # [N, max_test] int32
  test_n: jax.Array     # [N] int32
  # The validation splits [N, max_val] and [N], where a run evaluates them (eval_validation);
  # None otherwise, and then no call takes them.
  val_idx: jax.Array | None = None
  val_n: jax.Array | None = None


jax.tree_util.register_dataclass(
    DeviceData, data_fields=[f.name for f in dataclasses.fields(DeviceData)], meta_fields=[])


# --------------------------------------------------------------------------------------------
# Pools (split schemes)
# --------------------------------------------------------------------------------------------

def make_pools(ds: Dataset, scheme: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
  """Global index pools that the partition's class shares are applied to (docs/algorithm.md §2).

  - 'reference': TFDS train is split 40k/10k (4:1) into train and val at random; the official
    test set is the test pool.
  - 'paper': one pool of all images; each client's share is later split 8:1:1.
  """
  if scheme == 'reference':
    train = rng.permutation(ds.tfds_splits['train'])
    n_val = len(train) // 5
    return {'train': np.sort(train[n_val:]), 'val': np.sort(train[:n_val]),
            'test': ds.tfds_splits['test']}
  if scheme == 'paper':
    return {'all': np.arange(len(ds.labels))}
  raise DataError(f"Unknown split scheme {scheme!r}; choose 'reference' or 'paper'.")


# --------------------------------------------------------------------------------------------
# Partitions: each returns, per class, the holders and their shares (fractions summing to 1).
# --------------------------------------------------------------------------------------------

def pathological_shares(num_clients: int, num_classes: int, k: int,
                        rng: np.random.Generator) -> np.ndarray:
  """[N, S] class shares of the reference's pathological partition (docs/algorithm.md §2).

  Every class has k*N/S holders. Clients pick classes one at a time, each pick uniform among the
  classes (not yet picked by this client) with the most holder slots left. Each holder's weight
  is drawn from U(0.4, 0.6); weights are normalised per class.
  """
  if not 1 <= k <= num_classes:
    raise DataError(f'partition.classes_per_client={k} must be in [1, {num_classes}] '
                    f'(the data set has {num_classes} classes).')
  if (k * num_clients) % num_classes:
    raise DataError(
        f'Pathological partition needs k*N/S holders per class to be whole: k={k}, '
        f'N={num_clients}, S={num_classes} gives {k * num_clients / num_classes}. Choose N a '
        f'multiple of {num_classes // np.gcd(k, num_classes)}, or another k.')
  holders = k * num_clients // num_classes
  for _ in range(100):
    slots = np.full(num_classes, holders)
    owns = np.zeros((num_clients, num_classes), bool)
    ok = True
    for c in range(num_clients):
      for _ in range(k):
        free = np.where(owns[c], -1, slots)
        best = free.max()
        if best <= 0:
          ok = False
          break
        s = rng.choice(np.flatnonzero(free == best))
        owns[c, s] = True
        slots[s] -= 1
      if not ok:
        break
    if ok:
      break
  else:  # pragma: no cover - the balanced greedy practically always succeeds.
    raise DataError('Could not build the pathological partition; try another partition.seed.')
  weights = np.where(owns, rng.uniform(0.4, 0.6, size=owns.shape), 0.0)
  return weights / weights.sum(axis=0, keepdims=True)


def dirichlet_shares(num_clients: int, num_classes: int, gamma: float,
                     rng: np.random.Generator) -> np.ndarray:
  """[N, S] class shares: for each class, client proportions ~ Dir(gamma * 1_N)."""
  if not gamma > 0:
    raise DataError(f'partition.dirichlet_gamma must be > 0, got {gamma}.')
  return rng.dirichlet(np.full(num_clients, gamma), size=num_classes).T


def split_by_shares(indices_of_class: Sequence[np.ndarray], shares: np.ndarray,
                    rng: np.random.Generator) -> list[np.ndarray]:
  """Gives each client its share of every class's shuffled index list. Returns N index arrays."""
  num_clients = shares.shape[0]
  out = [[] for _ in range(num_clients)]
  for s, idx in enumerate(indices_of_class):
    idx = rng.permutation(idx)
    bounds = np.round(np.cumsum(shares[:, s]) * len(idx)).astype(int)
    bounds[-1] = len(idx)
    lo = 0
    for c in range(num_clients):
      hi = max(lo, bounds[c])
      out[c].append(idx[lo:hi])
      lo = hi
  return [np.sort(np.concatenate(parts)) for parts in out]


def resample_sets(pool: np.ndarray, labels: np.ndarray, mixtures: np.ndarray, per_client: int,
                  rng: np.random.Generator) -> np.ndarray:
  """[N, per_client] sorted indices into the data set: each client's `per_client` samples drawn
  from `pool` WITH replacement: its class counts ~ Multinomial(per_client, its row of
  `mixtures` [N, S]), then each sample uniform within its class in the pool
  (docs/algorithm.md §2). A class the pool lacks is left out of every mixture (the rest
  renormalised). Vectorised: no loop over clients."""
  num_clients, num_classes = mixtures.shape
  if per_client == 0:
    return np.zeros((num_clients, 0), np.int32)
  cls_of = labels[pool]
  order = np.argsort(cls_of, kind='stable')
  by_class = pool[order]  # the pool sorted by class: class s is by_class[start[s]:start[s+1]]
  sizes = np.bincount(cls_of, minlength=num_classes)[:num_classes]
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.float64)
  p = np.where(sizes > 0, mixtures, 0.0)
  total = p.sum(axis=1, keepdims=True)
  p = np.where(total > 0, p / np.where(total > 0, total, 1), sizes / sizes.sum())
  # Each client's class counts, then its samples' classes in class order.
  counts = rng.multinomial(per_client, p)
  cls = np.repeat(np.tile(np.arange(num_classes, dtype=np.int32), num_clients),
                  counts.ravel()).reshape(num_clients, per_client)
  # starts + floor(u * size): a uniform member of the class (exact in float64).
  pick = (starts[cls] + rng.random((num_clients, per_client)) * sizes[cls]).astype(np.int32)
  return np.sort(by_class[pick], axis=1).astype(np.int32)


def resample(ds: Dataset, num_clients: int, pools: dict[str, np.ndarray], alpha: float,
             train_per_client: int, test_per_client: int,
             rng: np.random.Generator) -> ClientData:
  """The resampling partition (`partition.kind='resample'`, docs/algorithm.md §2): client k's
  class mixture q_k ~ Dir(alpha * 1_S); its `train_per_client` training and `test_per_client`
  test samples drawn from q_k with replacement out of the train and test pools, so any number of
  clients can be built from any data set, samples repeating across clients. No validation split."""
  if not alpha > 0:
    raise DataError(f'partition.dirichlet_gamma must be > 0, got {alpha}.')
  if 'train' not in pools:
    raise DataError("partition.kind='resample' draws from the reference scheme's train and test "
                    "pools: set partition.scheme='reference'.")
  mixtures = rng.dirichlet(np.full(ds.num_classes, alpha), size=num_clients)
  train_idx = resample_sets(pools['train'], ds.labels, mixtures, train_per_client, rng)
  test_idx = resample_sets(pools['test'], ds.labels, mixtures, test_per_client, rng)
  seen = np.zeros((num_clients, ds.num_classes), bool)
  seen[np.arange(num_clients)[:, None], ds.labels[train_idx]] = True
  full = lambda a: (a if a.shape[1] else np.zeros((num_clients, 1), np.int32),
                    np.full(num_clients, a.shape[1], np.int32))
  (train_idx, train_n), (test_idx, test_n) = full(train_idx), full(test_idx)
  val_idx, val_n = np.zeros((num_clients, 1), np.int32), np.zeros(num_clients, np.int32)
  return ClientData(train_idx, train_n, val_idx, val_n, test_idx, test_n, seen)


# --------------------------------------------------------------------------------------------
# The whole thing
# --------------------------------------------------------------------------------------------

def _pad(index_sets: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
  counts = np.array([len(s) for s in index_sets], np.int32)
  out = np.zeros((len(index_sets), max(1, counts.max())), np.int32)
  for i, s in enumerate(index_sets):
    out[i, :len(s)] = s
  return out, counts


def partition(ds: Dataset, num_clients: int, kind: str, *, classes_per_client: int = 2,
              dirichlet_gamma: float = 0.5, dirichlet_min_train: int = 10,
              dirichlet_min_test: int = 1, scheme: str = 'reference', seed: int = 0,
              max_redraws: int = 1000, resample_train: int = 40,
              resample_test: int = 10) -> ClientData:
  """Builds every client's train/val/test index sets (docs/algorithm.md §2)."""
  if num_clients < 1:
    raise DataError(f'num_clients must be >= 1, got {num_clients}.')
  rng = np.random.default_rng(seed)
  pools = make_pools(ds, scheme, rng)
  if kind == 'resample':
    return resample(ds, num_clients, pools, dirichlet_gamma, resample_train, resample_test, rng)
  by_class = {name: [pool[ds.labels[pool] == s] for s in range(ds.num_classes)]
              for name, pool in pools.items()}
  for attempt in range(max_redraws):
    if kind == 'pathological':
      shares = pathological_shares(num_clients, ds.num_classes, classes_per_client, rng)
    elif kind == 'dirichlet':
      shares = dirichlet_shares(num_clients, ds.num_classes, dirichlet_gamma, rng)
    else:
      raise DataError(f"Unknown partition.kind {kind!r}; choose 'pathological', 'dirichlet' or "
                      "'resample'.")
    sets = {name: split_by_shares(by_class[name], shares, rng) for name in pools}
    if kind == 'pathological':
      pool = 'all' if scheme == 'paper' else 'train'
      _check_every_holder_served(ds, shares, by_class[pool], sets[pool], pool,
                                 classes_per_client)
    if scheme == 'paper':
      sets = _split_811(sets['all'], rng)
    train_n = np.array([len(s) for s in sets['train']])
    test_n = np.array([len(s) for s in sets['test']])
    if kind == 'pathological':
      if test_n.min() < 1 or train_n.min() < 1:
        raise DataError(
            f'Some client gets no {"train" if train_n.min() < 1 else "test"} samples: '
            f'{num_clients} clients is too many for this data set. Use fewer clients.')
      break
    # Dirichlet: redraw while a client has too few training or test samples.
    if train_n.min() >= dirichlet_min_train and test_n.min() >= dirichlet_min_test:
      break
    logging.info('Dirichlet draw %d: smallest client has %d train / %d test samples; redrawing.',
                 attempt, train_n.min(), test_n.min())
  else:
    raise DataError(
        f'No Dirichlet partition with gamma={dirichlet_gamma} gave every one of {num_clients} '
        f'clients >= {dirichlet_min_train} training and >= {dirichlet_min_test} test samples in '
        f'{max_redraws} draws. Raise partition.dirichlet_gamma, lower '
        'partition.dirichlet_min_train or partition.dirichlet_min_test, or use fewer clients.')
  train_idx, train_n = _pad(sets['train'])
  val_idx, val_n = _pad(sets['val'])
  test_idx, test_n = _pad(sets['test'])
  seen = np.zeros((num_clients, ds.num_classes), bool)
  for c, s in enumerate(sets['train']):
    seen[c, np.unique(ds.labels[s])] = True
  return ClientData(train_idx, train_n, val_idx, val_n, test_idx, test_n, seen)


def _check_every_holder_served(ds: Dataset, shares: np.ndarray, by_class, sets, pool: str,
                               k: int) -> None:
  """A DataError, naming the fix, where a client of the pathological partition gets no sample of
  one of its k classes from `pool` (the pool the shares split): that class has too few samples
  for its k*N/S holders, and the client would train on fewer than k classes."""
  num_clients, num_classes = shares.shape
  got = np.stack([np.bincount(ds.labels[s], minlength=num_classes) for s in sets])
  starved = (shares > 0) & (got == 0)
  if not starved.any():
    return
  s = int(np.flatnonzero(starved.any(axis=0))[0])
  holders = k * num_clients // num_classes
  raise DataError(
      f'The pathological partition cannot give each of the {num_clients} clients samples of all '
      f'its {k} classes: class {s} has {len(by_class[s])} sample(s) in the {pool!r} pool for its '
      f'{holders} holders (k*N/S = {k}*{num_clients}/{num_classes}); in all, '
      f'{int(starved.any(axis=1).sum())} client(s) would get no sample of a class they hold. Use '
      'fewer clients (--config.num_clients), fewer classes per client '
      '(--config.partition.classes_per_client), or the Dirichlet partition '
      '(--config.partition.kind=dirichlet).')


def _split_811(all_sets, rng):
  """The 'paper' scheme: each client's assigned data is split 8:1:1 into train/val/test."""
  out = {name: [] for name in SPLITS}
  for s in all_sets:
    s = rng.permutation(s)
    n_train, n_val = int(round(0.8 * len(s))), int(round(0.1 * len(s)))
    out['train'].append(np.sort(s[:n_train]))
    out['val'].append(np.sort(s[n_train:n_train + n_val]))
    out['test'].append(np.sort(s[n_train + n_val:]))
  return out


def fingerprint(cd: ClientData) -> str:
  """A short hash of the partition, for logs and checkpoints."""
  import hashlib  # pylint: disable=g-import-not-at-top
  h = hashlib.sha256()
  for a in (cd.train_idx, cd.train_n, cd.val_idx, cd.val_n, cd.test_idx, cd.test_n):
    h.update(np.ascontiguousarray(a).tobytes())
  return h.hexdigest()[:16]


def partition_from_config(config, ds: Dataset) -> ClientData:
  """The partition a config asks for (`partition.seed` < 0 means: use `seed`). A partition that
  cannot be built on `ds` is a ConfigError, before any training: its message names the
  config fields to change."""
  p = config.partition
  seed = config.seed if p.seed < 0 else p.seed
  try:
    return partition(ds, config.num_clients, p.kind, classes_per_client=p.classes_per_client,
                     dirichlet_gamma=p.dirichlet_gamma, dirichlet_min_train=p.dirichlet_min_train,
                     dirichlet_min_test=p.dirichlet_min_test, scheme=p.scheme, seed=seed,
                     resample_train=p.resample_train, resample_test=p.resample_test)
  except DataError as e:
    raise ConfigError(f'{e} (data set {ds.name!r}: {len(ds.tfds_splits["train"]):,} '
                                 f'training images, {ds.num_classes} classes)') from None
