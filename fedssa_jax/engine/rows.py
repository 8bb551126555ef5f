"""Tables of client rows off the device: `HostRows` in RAM, `DiskRows` in memory-mapped,
copy-on-write slot files (population.py's host and disk stores; its docstring has the disk
layout and how checkpoints pin slots)."""
from __future__ import annotations

import glob
import json
import logging
import mmap
import os
import zlib
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


class DamagedRows(ValueError):
  """A disk table's files do not hold the rows a checkpoint refers to (cut short, overwritten,
  of another layout, or its pins map missing or unreadable). `fix` says what the user can do
  when no checkpoint's rows are intact."""

  def __init__(self, directory: str, problem: str):
    super().__init__(f'{problem}.')
    self.fix = (
        f'The client rows those checkpoints refer to are lost from {directory}: put back a copy '
        'of the workdir\'s population/ folder together with its checkpoints/ (from a backup), or '
        'start the run over (delete checkpoints/ and population/ from the workdir, or use a new '
        '--workdir).')


def _row_sums(mm: np.ndarray, slots: np.ndarray) -> np.ndarray:
  """The CRC-32 of the bytes of each of `slots` of a slot file's map."""
  return np.array([zlib.crc32(mm[s].reshape(-1).view(np.uint8)) for s in slots], np.uint32)


class DiskRows:
  """A table of `num_rows` rows of a pytree in memory-mapped, copy-on-write slot files.

  `row_spec` is a pytree of jax.ShapeDtypeStruct of one row; `init_fn(rows)` returns the initial
  values of `rows` (a pytree of arrays with a leading axis of len(rows)).

  Integrity: `snapshot` takes the CRC-32 of each row of the checkpoint (per leaf, `sums`) that
  was written since the last snapshot, as it flushes them (a row rewritten between checkpoints
  is summed once; one kept from before keeps its sum), and saves the checkpoint's slot map with
  the checksums of its rows in `pins/<round>.npz` (a zip, whose own CRCs catch a damaged pins
  file). Opening the table changes no existing file, and `restore`
  checks the files against the checkpoint before any row is used: the layout, every slot it
  refers to inside every file, its pins map present and readable, every row's checksum. What
  fails raises DamagedRows, naming the file.
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
    self._damage: list[str] = []  # what opening found wrong, raised by `restore`
    os.makedirs(os.path.join(directory, 'pins'), exist_ok=True)
    layout = {'num_rows': num_rows, 'leaves': [[list(s), str(d)] for s, d in self.specs]}
    layout_path = os.path.join(directory, 'layout.json')
    try:
      with open(layout_path) as f:
        found = json.load(f)
    except FileNotFoundError:
      found = layout
      with open(layout_path, 'w') as f:
        json.dump(layout, f)
    except (OSError, ValueError) as e:
      found = f'unreadable ({e})'
    if found != layout:  # kept as it is: a checkpoint may refer to these files
      self._damage.append(f'{layout_path} describes other rows than this run\'s ({found}, '
                          f'expected {layout})')
    self._mm: list[np.memmap] = []
    self.sums = np.zeros((0, len(self.specs)), np.uint32)  # each slot's row checksums
    self.unsummed = np.zeros(0, bool)  # slots written since their checksums were taken
    self.capacity = 0
    sizes = [os.path.getsize(self._path(i)) if os.path.exists(self._path(i)) else None
             for i in range(len(self.specs))]
    self._ragged = [f'{self._path(i)} holds {z} bytes, not a whole number of rows of '
                    f'{self._row_bytes(i)} bytes' for i, z in enumerate(sizes)
                    if z is not None and z % self._row_bytes(i)]
    self._damage += [f'{self._path(i)} is missing' for i, z in enumerate(sizes)
                     if z is None and any(z is not None for z in sizes)]
    if self._damage:
      return  # nothing is read from, or written to, damaged files
    # Files of unequal lengths are left as they are (a growth that stopped half-way adds only
    # unused slots); every slot `restore` will use must lie within all of them.
    capacity = min((z // self._row_bytes(i) for i, z in enumerate(sizes) if z is not None),
                   default=0)
    if capacity or not any(sizes):  # else a file holds no row: `restore` names it
      self._grow(max(capacity, 1), keep_files=True)

  # --- files ----------------------------------------------------------------------------------
  def _path(self, i: int) -> str:
    return os.path.join(self.directory, f'leaf{i}.bin')

  def _row_bytes(self, i: int) -> int:
    shape, dtype = self.specs[i]
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

  def _grow(self, capacity: int, keep_files: bool = False) -> None:
    """Maps `capacity` slots of each file; the files are cut or extended to that length, unless
    `keep_files` (then each already holds at least that many)."""
    self._mm = []
    for i, (shape, dtype) in enumerate(self.specs):
      path, size = self._path(i), capacity * self._row_bytes(i)
      if not (keep_files and os.path.exists(path) and os.path.getsize(path) >= size):
        with open(path, 'ab') as f:
          f.truncate(size)  # sparse: no blocks until written
      self._mm.append(np.memmap(path, dtype, 'r+', shape=(capacity, *shape)))
    self.sums = np.pad(self.sums[:capacity], ((0, max(capacity - len(self.sums), 0)), (0, 0)))
    self.unsummed = np.pad(self.unsummed[:capacity], (0, max(capacity - len(self.unsummed), 0)))
    self.capacity = capacity
    self._pin_maps(self._maps)

  def _release(self, i: int, slots: np.ndarray) -> None:
    """Unmaps the whole pages of file i's `slots` from the process (MADV_DONTNEED), once read or
    written: the rows stay in the file and the page cache (a written page stays dirty there
    until written back), but out of the process's resident memory, which would otherwise grow
    by every row a round touches (6 GB a round at K = 1,000)."""
    mm = getattr(self._mm[i], '_mmap', None)
    if mm is None or not hasattr(mmap, 'MADV_DONTNEED'):
      return
    row = self._row_bytes(i)
    for s in np.unique(slots):
      start = -(-int(s) * row // mmap.PAGESIZE) * mmap.PAGESIZE
      end = (int(s) + 1) * row // mmap.PAGESIZE * mmap.PAGESIZE
      if end > start:
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)

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
      for i, (o, mm) in enumerate(zip(out, self._mm)):
        o[stored] = mm[slots[stored]]
        self._release(i, slots[stored])
    if not stored.all():
      for o, v in zip(out, jax.tree.leaves(self.init_fn(rows[~stored]))):
        o[~stored] = np.asarray(v)
    return jax.tree.unflatten(self.treedef, out)

  def write(self, rows: np.ndarray, values: PyTree) -> None:
    rows = np.asarray(rows)
    if self._damage:
      raise DamagedRows(self.directory, '; '.join(self._damage))
    if len(np.unique(rows)) != len(rows):
      raise ValueError('DiskRows.write: a row appears twice in one write.')
    in_use = self.pinned.copy()
    in_use[self.slot_of[self.slot_of >= 0]] = True
    free = np.flatnonzero(~in_use)
    if len(free) < len(rows):
      self._grow(self.capacity + max(self.GROW, len(rows) - len(free)))
      return self.write(rows, values)
    slots = free[:len(rows)]
    for i, (mm, v) in enumerate(zip(self._mm, jax.tree.leaves(values))):
      mm[slots] = np.asarray(v)
      self._release(i, slots)
    self.unsummed[slots] = True
    self.slot_of[rows] = slots

  def all_rows(self) -> PyTree:
    return self.read(np.arange(self.num_rows))

  # --- checkpoints ----------------------------------------------------------------------------
  def saved(self) -> dict:
    """What a checkpoint holds of the table: the slot map, not the rows."""
    return {'slot_of': self.slot_of}

  def snapshot(self, step: int) -> np.ndarray:
    """Flushes the slot files and pins the current rows for the checkpoint of round `step`,
    saving their map and checksums in `pins/<step>.npz`; returns the map that checkpoint saves."""
    for mm in self._mm:
      mm.flush()
    snap = self.slot_of.copy()
    new = np.unique(snap[snap >= 0])
    new = new[self.unsummed[new]]
    for i, mm in enumerate(self._mm):
      for s in new:  # a row at a time, its pages released after (`_release`)
        self.sums[s, i] = _row_sums(mm, [s])[0]
        self._release(i, [s])
    self.unsummed[new] = False
    sums = np.where(snap[:, None] >= 0, self.sums[np.maximum(snap, 0)], 0).astype(np.uint32)
    path = os.path.join(self.directory, 'pins', f'{step}.npz')
    np.savez(path + '.tmp.npz', slot_of=snap, sums=sums)
    os.replace(path + '.tmp.npz', path)
    self._pin_maps([snap] + self._maps)
    return snap

  def _pins(self) -> dict[int, str]:
    """{round: path} of the pins files (`.npy`: a slot map of an older version, no checksums)."""
    found = {}
    for path in glob.glob(os.path.join(self.directory, 'pins', '*.np[yz]')):
      name = os.path.basename(path)
      step = name.split('.')[0]
      if step.isdigit() and '.tmp.' not in name:
        found[int(step)] = path
      else:
        os.remove(path)  # a pins file a kill left half-written
    return found

  @staticmethod
  def _load_pins(path: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(slot map, checksums or None); raises on a missing, cut or damaged file."""
    if path.endswith('.npy'):
      return np.load(path), None
    with np.load(path) as z:  # the zip checks its CRCs as the arrays are read
      return np.asarray(z['slot_of'], np.int64), np.asarray(z['sums'], np.uint32)

  def retain(self, steps: list[int]) -> None:
    """Keeps the pins of the checkpoints of `steps` (those still on disk) and drops the rest."""
    maps = []
    for step, path in self._pins().items():
      if step not in steps:
        os.remove(path)
        continue
      try:
        maps.append(self._load_pins(path)[0])
      except Exception as e:  # pylint: disable=broad-except  (unreadable: not resumable)
        logging.warning('The pins map %s cannot be read (%s): the rows of the checkpoint of '
                        'round %d are no longer protected, and a resume will not use it.',
                        path, e, step)
    self._pin_maps(maps)

  def restore(self, slot_of: np.ndarray) -> None:
    """Points the rows at the slots of a checkpoint's map (whose slots `retain` pinned), after
    checking that the files hold them; raises DamagedRows where they do not."""
    slot_of = np.asarray(slot_of, np.int64)
    if not self.specs:  # rows of nothing (a method without client state): no files to match
      self._grow(max(self.capacity, slot_of.max(initial=-1) + 1))
      self.slot_of = slot_of.copy()
      return
    if self._damage:
      raise DamagedRows(self.directory, '; '.join(self._damage))
    if slot_of.shape != self.slot_of.shape:
      raise DamagedRows(self.directory, f'The checkpoint\'s population map has '
                        f'{slot_of.shape[0]} rows, the table in {self.directory} '
                        f'{self.num_rows}: they are not the files this run wrote')
    stored = np.flatnonzero(slot_of >= 0)
    need = slot_of.max(initial=-1) + 1
    whole = [os.path.getsize(self._path(i)) // self._row_bytes(i) for i in range(len(self.specs))]
    short = [f'{self._path(i)} holds {n} row{"" if n == 1 else "s"}'
             for i, n in enumerate(whole) if n < need]
    if short:
      raise DamagedRows(self.directory, f'{", ".join(short)}, but the checkpoint refers to '
                        f'slot {need - 1}: cut short')
    sums, problems = None, []
    for step, path in sorted(self._pins().items(), reverse=True):
      try:
        saved_map, saved_sums = self._load_pins(path)
      except Exception as e:  # pylint: disable=broad-except
        problems.append(f'{path} is unreadable ({type(e).__name__}: {str(e)[:100]})')
        continue
      if np.array_equal(saved_map, slot_of):
        sums = saved_sums
        break
    else:
      raise DamagedRows(self.directory, f'No pins map in {os.path.join(self.directory, "pins")} '
                        'is this checkpoint\'s (its <round>.npz is missing, unreadable or '
                        f'altered){": " if problems else ""}{"; ".join(problems)}')
    for i, mm in enumerate(self._mm):  # (pins of an older version hold no sums to compare)
      found = _row_sums(mm, slot_of[stored])
      bad = [] if sums is None else stored[found != sums[stored, i]].tolist()
      if bad:
        raise DamagedRows(self.directory, f'{self._path(i)} does not hold what the checkpoint '
                          f'saved in rows {bad[:10]}{" ..." if len(bad) > 10 else ""} (slots '
                          f'{slot_of[bad[:10]].tolist()}): their checksums differ (overwritten '
                          'or cut short)')
      self.sums[slot_of[stored], i] = found
    for problem in self._ragged:  # only the rows after the checkpoint's could have been lost
      logging.warning('%s (cut or appended to); the rows the checkpoint refers to are intact.',
                      problem)
    self.slot_of = slot_of.copy()

  def _pin_maps(self, maps: list[np.ndarray]) -> None:
    self._maps = maps
    self.pinned = np.zeros(self.capacity, bool)
    for m in maps:
      self.pinned[m[(m >= 0) & (m < self.capacity)]] = True
