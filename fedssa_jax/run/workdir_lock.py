"""An exclusive lock on a run's workdir: two processes never run in one workdir at once.

`hold(workdir)` takes an OS lock (flock) on `<workdir>/.lock` and writes its holder's pid, host
and start time into the file, for the message a second run gets. The operating system releases
the lock when the holder's file is closed, however the process ends (exit, exception, kill -9),
so a lock left by a dead process never blocks a rerun; the file itself stays, and says nothing
once unlocked.

On a filesystem without flock (some Lustre or FUSE mounts) the run goes on unlocked, with a
warning. On NFS, Linux clients emulate flock with NFS byte-range locks, which work across hosts
when the server's lock service runs (NFSv4, or NFSv3 with lockd); docs/operations.md says more.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import time

LOCK_FILE = '.lock'


class WorkdirLocked(RuntimeError):
  """Another live process is running in the workdir."""


def _holder(fd: int) -> str:
  text = os.pread(fd, 512, 0).decode(errors='replace').strip()
  return text or 'a process that has not written its pid yet'


def _take(fd: int, path: str, workdir: str) -> bool:
  """Locks `fd`; False where the filesystem cannot lock. Raises WorkdirLocked if it is held."""
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
      raise WorkdirLocked(
          f'--workdir={workdir!r} is in use by another run ({_holder(fd)}). Wait for it to '
          'finish (rerunning the same command then resumes or completes it), or use another '
          f'--workdir. A lock whose process has died is released by the OS; {path} itself may '
          'stay.') from None
    logging.warning('Cannot lock %s (%s): this filesystem has no flock, so nothing stops a '
                    'second run in the same workdir.', path, e.strerror or e)
    return False
  return True


@contextlib.contextmanager
def hold(workdir: str):
  """Holds the workdir's lock for the block. Raises WorkdirLocked if another process holds it."""
  path = os.path.join(workdir, LOCK_FILE)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    if _take(fd, path, workdir):
      os.ftruncate(fd, 0)
      os.pwrite(fd, f'pid {os.getpid()} on host {socket.gethostname()}, since '
                    f'{time.strftime("%Y-%m-%d %H:%M:%S")}\n'.encode(), 0)
    yield path
  finally:
    os.close(fd)  # releases the lock


def in_use(workdir: str) -> str | None:
  """Who holds the workdir's lock ("pid ... on host ..."), or None when no live process does."""
  path = os.path.join(workdir, LOCK_FILE)
  if not os.path.exists(path):
    return None
  try:
    with hold(workdir):
      return None
  except WorkdirLocked:
    with open(path) as f:
      return f.read().strip() or 'a process that has not written its pid yet'
