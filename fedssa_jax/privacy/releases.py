"""DP-SGD's private releases (docs/algorithm.md §11, "Private releases"): what a method sends
that it computes from the training data outside the DP-SGD steps, released by a Gaussian
mechanism of its own, which the accountant composes with the steps (accountants.py).

- **Class sums** (`class_table`, `release_class_sums`): per-class sums of a per-example vector v
  (FD's logits, the prototype methods' representations; Method.release_values) and the class
  counts, from ONE pass over the client's training split (each example once: Method.forward_pass,
  which the engine runs with these stats under DP-SGD). Each example puts [clip(v, C/sqrt2),
  C/sqrt2] into its class's row of a [C, D + 1] table (C = `release_clip`), so one example moves
  the whole table by at most C in L2 (add or remove one). N(0, (z C)^2) on every coordinate (z =
  the release's noise multiplier) makes it a Gaussian mechanism of noise multiplier z; the noisy
  count is the last coordinate times sqrt2 / C. What the method then computes from the noisy
  sums and counts (means, which classes to send, FedSA's margin) is post-processing.
- **Class counts at the start** (`noisy_class_counts`): the [C] training samples per class of
  each client that a server reads once (Method.server_reads_class_counts: FedGen's label prior).
  One example moves its client's histogram by 1 in L2, so N(0, z^2) on each count is a Gaussian
  mechanism of noise multiplier z; the noisy counts are floored at 0 (post-processing).

Each release's noise comes from Stream.RELEASE, by round and client id (`release_keys`; the
counts at the start at streams.RELEASE_AT_START), each leaf's from fold_in(key, leaf index).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from fedssa_jax.methods import aggregation, base
from fedssa_jax.privacy.mechanisms import clip_scale, privatize_upload
from fedssa_jax.streams import RELEASE_AT_START, Stream

SQRT2 = math.sqrt(2.0)


@dataclasses.dataclass(frozen=True)
class Release:
  """A class-sums release's static settings (hashable): the clip C and the noise multiplier z
  (the noise std is z C)."""
  clip: float
  noise_multiplier: float


def release_keys(root_key, round_index, client_ids):
  """Each client's key of its release in round `round_index`: fold_in(fold_in(fold_in(root key,
  Stream.RELEASE), round), client id)."""
  round_key = jax.random.fold_in(jax.random.fold_in(root_key, Stream.RELEASE), round_index)
  return jax.vmap(lambda c: jax.random.fold_in(round_key, c))(client_ids)


def class_table(values, y, valid, *, num_classes: int, clip: float) -> base.ClassSums:
  """A batch's share of the release table: per class, the sum of the valid examples' `values`
  [B, D], each clipped to the norm C / sqrt2 (`sum`), and C / sqrt2 per example (`count`, the
  table's last column)."""
  half = clip / SQRT2
  norms = jnp.sqrt(jnp.sum(jnp.square(values.astype(jnp.float32)), axis=-1))
  clipped = values.astype(jnp.float32) * clip_scale(norms, half)[:, None]
  sums = base.class_sums(clipped, y, valid, num_classes)
  return base.ClassSums(count=sums.count * half, sum=sums.sum)


def table_stats(release_values, *, num_classes: int, clip: float):
  """The forward pass's stats under DP-SGD: `class_table` of Method.release_values(logits,
  rep)."""
  def stats(logits, rep, y, valid):
    return class_table(release_values(logits, rep), y, valid, num_classes=num_classes,
                       clip=clip)
  return stats


def release_class_sums(table: base.ClassSums, key, release: Release) -> base.ClassSums:
  """The release of one client's table (`class_table` summed over its pass): N(0, (z C)^2) on
  every coordinate of the sums and of the count column (each leaf's from fold_in(key, leaf
  index)), then the counts back in examples (times sqrt2 / C)."""
  noised = aggregation.add_gaussian(table, key, release.noise_multiplier * release.clip)
  return noised.replace(count=noised.count * (SQRT2 / release.clip))


def noisy_class_counts(counts: np.ndarray, root_keys, noise_multiplier: float) -> np.ndarray:
  """[R, N, C] class counts of every seed's clients (root_keys [R]) with N(0, z^2) on each (z =
  `noise_multiplier`), floored at 0: the release of the counts a server reads at the start."""
  counts = np.asarray(counts, np.float32)
  ids = jnp.arange(counts.shape[1])

  def one(root_key):
    keys = release_keys(root_key, RELEASE_AT_START, ids)
    return jax.vmap(lambda k: jax.random.normal(k, (counts.shape[2],)))(keys)
  noise = np.asarray(jax.jit(jax.vmap(one))(jnp.asarray(root_keys)))
  return np.maximum(counts + noise_multiplier * noise, 0.0).astype(np.float32)


def release_whole(output, key, *, fields: tuple[str, ...], release: Release):
  """The release of a step after training's output (Method.release_after_training: FedL2G's
  meta gradient): its `fields` clipped jointly to the global norm C_r, plus N(0, (z C_r)^2) on
  every coordinate (each leaf's from fold_in(key, leaf index)); its other fields as they are.
  Any change of the client's data moves the clipped fields by at most 2 C_r: a Gaussian
  mechanism of noise multiplier z / 2."""
  out, _ = privatize_upload(output, None, key, fields=fields, clip_norm=release.clip,
                            std=release.noise_multiplier * release.clip)
  return out


def releases_of(method) -> tuple[int, int, float]:
  """The private releases `method` makes under DP-SGD, as the accountant counts them: (per
  round a client trains or takes part: 1 for a method with `release_values`, its class sums, or
  with `release_after_training`; at the start: 1 for a server that reads the class counts;
  their sensitivity in units of C_r: 2 for a whole output clipped, else 1)."""
  whole = bool(method.release_after_training)
  return (int(method.release_values is not None or whole),
          int(method.server_reads_class_counts), 2.0 if whole else 1.0)
