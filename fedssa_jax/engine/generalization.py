"""What the federation gave a client beyond its own data (docs/algorithm.md §5): the global test
sample and the new clients.

- **The global test sample** (`eval_global_images` = G > 0): G images of the global test pool
  (every test image some client holds), balanced over the classes, drawn once per seed from its
  own stream (Stream.GLOBAL_TEST) and the same for every client and round. Each evaluated
  client is tested on them with its personalised model (evaluation.py counts them). A client
  trained on two classes of ten scores about 20% there on its own; what it scores above that
  is what the federation gave it.
- **New clients** (`new_clients`, a fraction f of N): round(f * N) clients with training and test
  data, drawn once per seed (Stream.NEWCOMERS), never take part in training: the rounds sample
  their cohorts among the others. At each evaluation each new client starts from its initial
  model and state, receives what the method gives a newcomer (`Method.newcomer`), trains
  `new_client_epochs` local epochs on its own training split with the method's loss (a round
  of local training as a participant's, its upload dropped, nothing kept), and is tested on
  its own test split as the participants are. The participation gap is the participants'
  mean accuracy minus the new clients'.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fedssa_jax import headcount
from fedssa_jax.engine.evaluation import ROWS_SPECS, STATE_SPEC
from fedssa_jax.engine.state import ChunkInputs, block_rows
from fedssa_jax.streams import Stream


def draw_new_clients(seed: int, fraction: float, train_n: np.ndarray,
                     test_n: np.ndarray) -> np.ndarray:
  """The seed's new clients (sorted ids): round(fraction * N) of the clients that hold both
  training and test data, uniformly, a pure function of the seed. Empty at fraction 0."""
  count = headcount.new_client_count(fraction, len(train_n))
  if not count:
    return np.zeros(0, np.int64)
  candidates = np.flatnonzero((train_n > 0) & (test_n > 0))
  if count > len(candidates):
    raise ValueError(
        f'new_clients={fraction} asks for {count} new clients, but only {len(candidates)} of '
        f'the {len(train_n)} clients hold both training and test data: lower new_clients.')
  rng = np.random.default_rng([seed, Stream.NEWCOMERS])
  return np.sort(rng.choice(candidates, size=count, replace=False))


def new_clients(config, seeds, cds) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
  """Each seed's new clients (`draw_new_clients` on its client data) and the mask [N] of the
  clients its rounds may sample (None: all, without new clients)."""
  ids = [draw_new_clients(s, config.new_clients, c.train_n, c.test_n) for s, c in zip(seeds, cds)]
  return ids, [None if not len(i) else ~np.isin(np.arange(len(c.train_n)), i)
               for i, c in zip(ids, cds)]


def unseen_classes(train_idx: np.ndarray, train_n: np.ndarray, labels: np.ndarray,
                   num_classes: int) -> np.ndarray:
  """Each client's number of classes of which its training split holds no sample [N]."""
  valid = np.arange(train_idx.shape[1])[None, :] < train_n[:, None]
  held = np.zeros((len(train_n), num_classes), bool)
  held[np.nonzero(valid)[0], labels[train_idx[valid]]] = True
  return num_classes - held.sum(1)


def global_sample(seed: int, size: int, test_idx: np.ndarray, test_n: np.ndarray,
                  labels: np.ndarray, num_classes: int) -> np.ndarray:
  """`size` indices of the global test pool (the distinct images of every client's test split),
  balanced over the classes: floor(size / S) of each class, the first size mod S classes one
  more, each drawn without replacement (with replacement from a class that has fewer images, and
  none from a class the pool lacks). A pure function of the seed."""
  valid = np.arange(test_idx.shape[1])[None, :] < test_n[:, None]
  pool = np.unique(test_idx[valid])
  rng = np.random.default_rng([seed, Stream.GLOBAL_TEST])
  per_class = np.full(num_classes, size // num_classes) + (np.arange(num_classes)
                                                           < size % num_classes)
  picks = []
  for c in range(num_classes):
    of_class = pool[labels[pool] == c]
    if len(of_class) and per_class[c]:
      picks.append(rng.choice(of_class, size=per_class[c],
                              replace=bool(per_class[c] > len(of_class))))
  if not picks:
    raise ValueError('eval_global_images: the clients hold no test image to sample from.')
  return np.sort(np.concatenate(picks)).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class NewcomerRound:
  """What a new client's call takes beside its rows, each with the seed axis first, as the
  server state (the store takes each seed's slice): the server state (with the global test
  sample beside it where that is on: Evaluator.server_arg), the seen-class masks [R, N, S], the
  root keys [R, 2] and the round [R]."""
  server: object
  seen: jax.Array
  root_key: jax.Array
  round_index: jax.Array


jax.tree_util.register_dataclass(NewcomerRound, data_fields=[
    f.name for f in dataclasses.fields(NewcomerRound)], meta_fields=[])


class Newcomers:
  """Evaluates a seed's new clients (`evaluate`): each block of them, in one call per group,
  trains from its initial rows (the store's, which never train) with `locals_[g]` (the group's
  simulator.local_fn with the method's newcomer download and new_client_epochs) and is tested
  by the evaluator's own rows function, so exactly as a participant is."""

  def __init__(self, evaluator, locals_: list, seen, root_keys):
    self.evaluator, self.seen, self.root_keys = evaluator, seen, root_keys
    ev = evaluator
    specs = ROWS_SPECS + (STATE_SPEC,)
    self.calls = [ev.store.eval_call(g, ev.placement.per_device(
        self._rows_fn(g, local), specs), with_state=True)
                  for g, local in zip(ev.groups, locals_)]

  def _rows_fn(self, g, local):
    evaluate_rows = self.evaluator.rows_fn(g)
    reads_state, global_on = self.evaluator.reads_state, self.evaluator.global_on

    def newcomer_rows(group_params, cids, valid, ctx: NewcomerRound, data_, state_rows):
      server = ctx.server[0] if global_on else ctx.server
      inputs = ChunkInputs(slots=None, ids=cids, active=valid, seen=ctx.seen, data=data_,
                           round_index=ctx.round_index,
                           root_key=jax.random.fold_in(ctx.root_key, Stream.NEWCOMERS),
                           system=None)
      params, state, _, _ = local(block_rows(group_params), state_rows, server, inputs)
      return evaluate_rows(params, cids, valid, ctx.server, data_,
                           *((state,) if reads_state else ()))
    return newcomer_rows

  def evaluate(self, state, seed_index: int, data, ids: np.ndarray) -> np.ndarray:
    """Seed `seed_index`'s new clients `ids`, at `state`'s round: each one's accuracy on its
    own test split, [N], NaN for every other client."""
    ev = self.evaluator
    r = self.root_keys.shape[0]
    ctx = NewcomerRound(server=ev.server_arg(state.server, ev.global_sample), seen=self.seen,
                        root_key=self.root_keys,
                        round_index=jnp.full((r,), int(state.round), jnp.int32))
    jobs = ev.jobs(ids, reuse=True)
    blocks = ev.store.evaluate(state.population, seed_index, jobs, self.calls, ctx, data,
                               with_state=True)
    accuracy = np.full(len(ev.group_of), np.nan)
    for (gi, slots, res), (_, _, n) in zip(blocks, jobs):
      members = ev.groups[gi].members[slots[:n]]
      counts = ev.placement.fetch(res)
      accuracy[members] = counts['correct'][:n] / np.maximum(counts['count'][:n], 1)
    return accuracy
