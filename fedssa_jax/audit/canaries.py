"""The audit's canaries and their draws (Stream.AUDIT, the one consumer of it): each canary is
included independently with probability 1/2 (Steinke, Nasr and Jagielski 2023), from the run's
seed, so an audit repeats exactly.

Training-data canaries (`data_canaries`, `with_canaries`): m images that are in no client's
training split (a test, validation or unused image), each given to an owner (the trainable
clients in turn, shuffled) with a label drawn among the owner's seen classes, other than the
image's own. An included canary is appended to its owner's training split as a new row of the
data set (the image, that label); an excluded one is in no training split. The owners' seen
classes do not change, so no method's server sees more classes than the run would.

Upload canaries (`upload_canaries`): m orthonormal random directions, and which are included.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from fedssa_jax import data
from fedssa_jax.errors import DataError
from fedssa_jax.streams import AuditDraw, Stream


@dataclasses.dataclass(frozen=True)
class DataCanaries:
  """m training-data canaries: `owner` [m] client ids, `image` [m] indices into the data set's
  images, `label` [m] their canary labels, `included` [m] bool."""
  owner: np.ndarray
  image: np.ndarray
  label: np.ndarray
  included: np.ndarray

  @property
  def size(self) -> int:
    return int(len(self.owner))


def _rng(seed: int, kind: AuditDraw) -> np.random.Generator:
  return np.random.default_rng([int(seed), Stream.AUDIT, kind])


def data_canaries(seed: int, cd: data.ClientData, labels: np.ndarray, m: int) -> DataCanaries:
  """m canaries over `cd`'s trainable clients (those with training data and a seen class),
  their images from the images in no client's training split (distinct while there are
  enough). Raises DataError when there is no client or no image to draw from."""
  rng = _rng(seed, AuditDraw.DATA)
  clients = np.flatnonzero((cd.train_n > 0) & cd.seen.any(axis=1))
  trained = np.concatenate([cd.train_idx[k, :n] for k, n in enumerate(cd.train_n)])
  pool = np.setdiff1d(np.arange(len(labels)), trained)
  if not len(clients) or not len(pool):
    raise DataError('The audit needs clients with training data and images outside every '
                    'training split (a test or validation pool) for its canaries: use a '
                    'partition that leaves a test split.')
  owner = rng.permutation(np.resize(clients, m))
  label = np.array([rng.choice(np.flatnonzero(cd.seen[k])) for k in owner], np.int32)
  image = np.empty(m, np.int64)
  free = np.ones(len(pool), bool)
  for i, c in enumerate(label):
    ok = labels[pool] != c
    choice = np.flatnonzero(ok & free) if (ok & free).any() else np.flatnonzero(ok)
    if not len(choice):  # every free image has this label: keep it (the canary is then a
      choice = np.arange(len(pool))  # correctly labelled copy, scored the same way)
    j = rng.choice(choice)
    free[j] = False
    image[i] = pool[j]
  included = rng.random(m) < 0.5
  return DataCanaries(owner=owner.astype(np.int64), image=image, label=label, included=included)


def with_canaries(ds: data.Dataset, cd: data.ClientData, canaries: DataCanaries
                  ) -> tuple[data.Dataset, data.ClientData, np.ndarray]:
  """The data set with a new row per canary (its image, its canary label) after the others, and
  the client data with each included canary appended to its owner's training split. Returns
  (the data set, the client data, each canary's row in the data set)."""
  m, rows = canaries.size, len(ds.labels) + np.arange(canaries.size)
  new_ds = dataclasses.replace(
      ds, images=np.concatenate([ds.images, ds.images[canaries.image]]),
      labels=np.concatenate([ds.labels, canaries.label]).astype(ds.labels.dtype))
  sets = [list(cd.train_idx[k, :n]) for k, n in enumerate(cd.train_n)]
  for i in np.flatnonzero(canaries.included):
    sets[canaries.owner[i]].append(rows[i])
  width = max(max(len(s) for s in sets), 1)
  train_idx = np.zeros((len(sets), width), cd.train_idx.dtype)
  for k, s in enumerate(sets):
    train_idx[k, :len(s)] = s
  train_n = np.array([len(s) for s in sets], cd.train_n.dtype)
  assert train_n.sum() == cd.train_n.sum() + canaries.included.sum() and m == len(rows)
  return new_ds, dataclasses.replace(cd, train_idx=train_idx, train_n=train_n), rows


def upload_canaries(seed: int, m: int) -> tuple[np.ndarray, np.ndarray]:
  """m orthonormal random directions in m dimensions ([m, m], row i canary i's) and which
  canaries are included [m]."""
  rng = _rng(seed, AuditDraw.UPLOAD)
  q, r = np.linalg.qr(rng.normal(size=(m, m)))
  directions = (q * np.sign(np.diag(r))).T  # Haar-distributed rows
  return directions.astype(np.float32), rng.random(m) < 0.5
