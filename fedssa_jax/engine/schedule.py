"""Who trains in a round, and in which calls: the family groups, the cohorts, the chunks.

Everything here runs on the host and is a pure function of the config, the seeds and the round,
so a resumed run and a run alone make the very same calls.

- Clients that share a model family form a `Group` (client i gets families[i mod F]); its
  members' parameters are one stacked pytree, `rows` long (padded to the device count).
- A round's cohort: K = max(1, floor(C N')) (headcount.cohort_size) of the N' clients that take
  part, uniform without replacement, drawn from (seed, round) (`sample_cohort`).
- `chunks` cuts each group's sampled members into chunks of the group's `clients_per_call`,
  padded with dummy slots (`g.rows`), which train on zero samples and change nothing; each chunk
  is one jitted call. `plan` does it for every seed of a run at once: chunk j of a group holds
  every seed's own chunk j (a seed with fewer chunks of the group gets all-inactive ones).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from fedssa_jax import models
from fedssa_jax.engine.placement import Placement
from fedssa_jax.streams import Stream



@dataclasses.dataclass(frozen=True)
class Group:
  family: str
  members: np.ndarray  # sorted client ids
  model: models.CNN
  clients_per_call: int  # a multiple of the mesh's device count
  rows: int  # stored rows: the size padded to a multiple of the device count
  eval_model: models.CNN  # the same function, in the formulation fastest forward-only

  @property
  def size(self) -> int:
    return len(self.members)


@dataclasses.dataclass(frozen=True)
class Chunk:
  """One jitted call's clients, of one group, for every seed: [R, P] arrays."""
  group: int
  slots: np.ndarray   # rows of the group (g.rows: a dummy)
  ids: np.ndarray     # their client ids (a dummy: the group's last member's)
  active: np.ndarray  # False for dummies


def sample_cohort(seed: int, round_index: int, num_clients: int, k: int,
                  online: np.ndarray | None = None) -> np.ndarray:
  """The round's participants, sorted; a pure function of (seed, round). `online` [N] (the
  system section's availability): drawn among the online clients only, all of them if fewer
  than K are; with every client online, the same cohort as without."""
  rng = np.random.default_rng([seed, Stream.SAMPLE, round_index])
  if online is None:
    return np.sort(rng.choice(num_clients, size=k, replace=False))
  ids = np.flatnonzero(online)
  return np.sort(ids[rng.choice(len(ids), size=min(k, len(ids)), replace=False)])


def eval_subset(seed: int, test_n: np.ndarray, eval_clients: int) -> np.ndarray | None:
  """The fixed random subset of `eval_clients` clients evaluated every time (sorted ids),
  drawn among the clients with test data; None: evaluate them all."""
  candidates = np.flatnonzero(test_n > 0)
  if not eval_clients or eval_clients >= len(candidates):
    return None
  rng = np.random.default_rng([seed, Stream.EVAL])
  return np.sort(rng.choice(candidates, size=eval_clients, replace=False))


def make_groups(config, num_classes: int, num_clients: int, k: int, place: Placement,
                image_shape: tuple[int, ...] = models.IMAGE_SHAPE) -> list[Group]:
  """The family groups (client i gets families[i mod F]), their models built for images of
  `image_shape`."""
  families = tuple(config.model.families)
  client_family = np.array([i % len(families) for i in range(num_clients)])
  groups = []
  for gi, fam in enumerate(families):
    members = np.flatnonzero(client_family == gi)
    if not len(members):
      continue
    # The rule (0, and -1 until per_call.py measures): one client per call on the CPU; on
    # accelerators, the group's expected share of the cohort, so that a typical round needs
    # one call per family and few dummies. A family sampled more often takes more calls.
    per_call = max(config.engine.clients_per_call, 0) or (
        1 if jax.default_backend() == 'cpu' else -(-k // len(families)))
    # Every device trains as many of a chunk's clients (padded with dummies).
    per_call = place.rows(int(min(per_call, len(members), k)))
    model, eval_model = (models.make_model(fam, num_classes, config.model.conv_impl,
                                           config.engine.compute_dtype, forward_only=fwd,
                                           feature_dim=config.model.feature_dim,
                                           image_shape=image_shape)
                         for fwd in (False, True))
    groups.append(Group(fam, members, model, per_call, place.rows(len(members)), eval_model))
  return groups


def group_index(groups: list[Group], num_clients: int) -> tuple[np.ndarray, np.ndarray]:
  """(group of each client, its slot within the group)."""
  group_of, slot_of = np.empty(num_clients, int), np.empty(num_clients, int)
  for gi, g in enumerate(groups):
    group_of[g.members] = gi
    slot_of[g.members] = np.arange(g.size)
  return group_of, slot_of


def chunks(groups: list[Group], group_of, slot_of, train_n: np.ndarray, cohort: np.ndarray,
           per_call: int | None = None) -> list:
  """[(group index, slots, active)]: each group's sampled members in chunks of its
  `clients_per_call` (or `per_call`), the last padded with dummy slots (`g.rows`).

  Within a group, clients are taken in decreasing order of training-set size, so that a
  vmapped chunk holds clients of similar step counts (the chunk runs its largest one's)."""
  out = []
  for gi, g in enumerate(groups):
    cids = cohort[group_of[cohort] == gi]
    cids = cids[np.argsort(-train_n[cids], kind='stable')]
    slots = slot_of[cids]
    p = per_call or g.clients_per_call
    for start in range(0, len(slots), p):
      chunk = slots[start:start + p]
      active = np.arange(p) < len(chunk)
      out.append((gi, np.pad(chunk, (0, p - len(chunk)), constant_values=g.rows), active))
  return out


def aligned_chunks(groups: list[Group], chunk_lists: list[list]) -> list:
  """[(group index, slots [R, P], active [R, P])]: chunk j of each group over the seeds, a seed
  with fewer chunks of the group padded with all-inactive ones. Each seed's chunks keep their
  order (that of its run alone)."""
  out = []
  for gi, g in enumerate(groups):
    per = [[c for c in chunk_list if c[0] == gi] for chunk_list in chunk_lists]
    p = g.clients_per_call
    idle = (gi, np.full(p, g.rows), np.zeros(p, bool))
    for j in range(max(len(c) for c in per)):
      cs = [c[j] if j < len(c) else idle for c in per]
      out.append((gi, np.stack([c[1] for c in cs]), np.stack([c[2] for c in cs])))
  return out


def plan(groups: list[Group], group_of, slot_of, train_n: np.ndarray,
         cohorts: list[np.ndarray]) -> list[Chunk]:
  """The round's calls for every seed (`train_n` [R, N], one cohort per seed)."""
  lists = [chunks(groups, group_of, slot_of, n, c) for n, c in zip(train_n, cohorts)]
  return [Chunk(gi, slots, groups[gi].members[np.minimum(slots, groups[gi].size - 1)], active)
          for gi, slots, active in aligned_chunks(groups, lists)]
