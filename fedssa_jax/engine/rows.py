"""Tables of client rows off the device: `HostRows` in RAM, `DiskRows` in memory-mapped,
copy-on-write slot files (population.py's host and disk stores; its docstring has the disk
layout and how checkpoints pin slots)."""
from __future__ import annotations

import glob
import json
import os
from typing import Callable

import jax
import numpy as np

from fedssa_jax.types import PyTree


class HostRows:
  """A table of rows held in RAM: a pytree of numpy arrays with a leading row axis.

  Both tables offer read/write, `all_rows()` (host copies of every row), and for checkpoints
  `saved()` (what a checkpoint holds), `snapshot(step)` and `retain(steps)` (bookkeeping around
  a checkpoint: none here)."""

  def __init__(self, tree: PyTree):
    self.tree = jax.tree.map(np.array, tree)  # writable copies

  def read(self, rows: np.ndarray) -> PyTree:
    return jax.tree.map(lambda a: a[rows], self.tree)

  def write(self, rows: np.ndarray, values: PyTree) -> None:
    for a, v in zip(jax.tree.leaves(self.tree), jax.tree.leaves(values)):
      a[rows] = v

  def all_rows(self) -> PyTree:
    return jax.tree.map(np.array, self.tree)

  def saved(self) -> PyTree:
    return self.tree

  def snapshot(self, step: int) -> None:
    del step

  def retain(self, steps: list[int]) -> None:
    del steps


class DiskRows:
  """A table of `num_rows` rows of a pytree in memory-mapped, copy-on-write slot files.

  `row_spec` is a pytree of jax.ShapeDtypeStruct of one row; `init_fn(rows)` returns the initial
  values of `rows` (a pytree of arrays with a leading axis of len(rows)).
  """

  GROW = 256  # slots added at a time, at least (sparse files: unused slots take no disk)

  def __init__(self, directory: str, row_spec: PyTree, num_rows: int,
               init_fn: Callable[[np.ndarray], PyTree]):
    self.directory = directory
    self.treedef = jax.tree.structure(row_spec)
    self.specs = [(tuple(s.shape), np.dtype(s.dtype)) for s in jax.tree.leaves(row_spec)]
    self.num_rows = num_rows
    self.init_fn = init_fn
    self.slot_of = np.full(num_rows, -1, np.int64)
    self.pinned = np.zeros(0, bool)
    self._maps: list[np.ndarray] = []
    os.makedirs(os.path.join(directory, 'pins'), exist_ok=True)
    layout = {'num_rows': num_rows, 'leaves': [[list(s), str(d)] for s, d in self.specs]}
    layout_path = os.path.join(directory, 'layout.json')
    if os.path.exists(layout_path):
      with open(layout_path) as f:
        if json.load(f) != layout:  # another run's files, with no checkpoint of ours: start over
          for path in glob.glob(os.path.join(directory, 'leaf*.bin')):
            os.remove(path)
    with open(layout_path, 'w') as f:
      json.dump(layout, f)
    self._mm: list[np.memmap] = []
    sizes = [os.path.getsize(self._path(i)) if os.path.exists(self._path(i)) else 0
             for i in range(len(self.specs))]
    self.capacity = min((size // self._row_bytes(i) for i, size in enumerate(sizes)),
                        default=0)
    self._grow(max(self.capacity, 1))

  # --- files ----------------------------------------------------------------------------------
  def _path(self, i: int) -> str:
    return os.path.join(self.directory, f'leaf{i}.bin')

  def _row_bytes(self, i: int) -> int:
    shape, dtype = self.specs[i]
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

  def _grow(self, capacity: int) -> None:
    self._mm = []
    for i, (shape, dtype) in enumerate(self.specs):
      with open(self._path(i), 'ab') as f:
        f.truncate(capacity * self._row_bytes(i))  # sparse: no blocks until written
      self._mm.append(np.memmap(self._path(i), dtype, 'r+', shape=(capacity, *shape)))
    self.pinned = np.pad(self.pinned, (0, capacity - len(self.pinned)))
    self.capacity = capacity

  def disk_bytes(self) -> int:
    """Bytes of disk the slot files take (their allocated blocks, not their sparse size)."""
    return sum(os.stat(self._path(i)).st_blocks * 512 for i in range(len(self.specs)))

  # --- rows -----------------------------------------------------------------------------------
  def read(self, rows: np.ndarray) -> PyTree:
    rows = np.asarray(rows)
    slots = self.slot_of[rows]
    stored = slots >= 0
    out = [np.empty((len(rows), *shape), dtype) for shape, dtype in self.specs]
    if stored.any():
      for o, mm in zip(out, self._mm):
        o[stored] = mm[slots[stored]]
    if not stored.all():
      for o, v in zip(out, jax.tree.leaves(self.init_fn(rows[~stored]))):
        o[~stored] = np.asarray(v)
    return jax.tree.unflatten(self.treedef, out)

  def write(self, rows: np.ndarray, values: PyTree) -> None:
    rows = np.asarray(rows)
    if len(np.unique(rows)) != len(rows):
      raise ValueError('DiskRows.write: a row appears twice in one write.')
    in_use = self.pinned.copy()
    in_use[self.slot_of[self.slot_of >= 0]] = True
    free = np.flatnonzero(~in_use)
    if len(free) < len(rows):
      self._grow(self.capacity + max(self.GROW, len(rows) - len(free)))
      return self.write(rows, values)
    slots = free[:len(rows)]
    for mm, v in zip(self._mm, jax.tree.leaves(values)):
      mm[slots] = np.asarray(v)
    self.slot_of[rows] = slots

  def all_rows(self) -> PyTree:
    return self.read(np.arange(self.num_rows))

  # --- checkpoints ----------------------------------------------------------------------------
  def saved(self) -> dict:
    """What a checkpoint holds of the table: the slot map, not the rows."""
    return {'slot_of': self.slot_of}

  def snapshot(self, step: int) -> np.ndarray:
    """Flushes the slot files and pins the current rows for the checkpoint of round `step`;
    returns the map that checkpoint saves."""
    for mm in self._mm:
      mm.flush()
    snap = self.slot_of.copy()
    path = os.path.join(self.directory, 'pins', f'{step}.npy')
    np.save(path + '.tmp.npy', snap)
    os.replace(path + '.tmp.npy', path)
    self._pin_maps([snap] + self._maps)
    return snap

  def retain(self, steps: list[int]) -> None:
    """Keeps the pins of the checkpoints of `steps` (those still on disk) and drops the rest."""
    maps = []
    for path in glob.glob(os.path.join(self.directory, 'pins', '*.npy')):
      step = os.path.basename(path).split('.')[0]
      if step.isdigit() and int(step) in steps and not path.endswith('.tmp.npy'):
        maps.append(np.load(path))
      else:
        os.remove(path)
    self._pin_maps(maps)

  def restore(self, slot_of: np.ndarray) -> None:
    """Points the rows at the slots of a checkpoint's map (whose slots `retain` pinned)."""
    slot_of = np.asarray(slot_of, np.int64)
    if not self.specs:  # rows of nothing (a method without client state): no files to match
      self._grow(max(self.capacity, slot_of.max(initial=-1) + 1))
    if slot_of.shape != self.slot_of.shape or slot_of.max(initial=-1) >= self.capacity:
      raise ValueError(
          f'The checkpoint\'s population map ({slot_of.shape[0]} rows, largest slot '
          f'{slot_of.max(initial=-1)}) does not fit the slot files in {self.directory} '
          f'({self.num_rows} rows, {self.capacity} slots): they are not the files this run '
          'wrote. Restore the workdir\'s population/ folder with its checkpoints, or start a new '
          '--workdir.')
    self.slot_of = slot_of.copy()

  def _pin_maps(self, maps: list[np.ndarray]) -> None:
    self._maps = maps
    self.pinned = np.zeros(self.capacity, bool)
    for m in maps:
      self.pinned[m[m >= 0]] = True
