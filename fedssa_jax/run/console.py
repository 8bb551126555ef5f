"""The command line's edge: its console, and what it installs process-wide for a run.

Quiet, the console shows this package's INFO lines (what runs, one line per round, the summary)
and WARNING or worse from anyone, bar the known chatter below. Verbose, it shows every INFO line
of every library, with levels, times and sources, as absl would. Log files (metrics.jsonl,
events, summary.json) do not depend on either.

Everything here that changes the process (the root logger's handlers, sys.unraisablehook, the
asyncio logger's filters, signal handlers, file descriptor 2) is done only by the command lines
(main.py, compare.py) and undone when their block ends: a library call of train.py changes none
of it, and its logs go wherever the caller's logging setup sends them.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
VERBOSE_ENV = 'FEDSSA_VERBOSE'
# Warnings of libraries that say nothing a user of this simulator can act on.
CHATTER = (
    'Unable to initialize backend',          # jax, probing for TPUs and GPUs
    'All log messages before absl::InitializeLog',
    'OpenCV is not installed',               # TFDS, decoding PNGs with PIL instead
)


def verbose_requested(argv) -> bool:
  """--verbose on the command line, or FEDSSA_VERBOSE set to anything but '' or 0."""
  return '--verbose' in argv or os.environ.get(VERBOSE_ENV, '0') not in ('', '0')


@contextlib.contextmanager
def _native_stderr_silenced():
  """Sends file descriptor 2 (what C++ code logs to) to /dev/null within the block."""
  sys.stderr.flush()
  saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)
  os.close(devnull)
  try:
    yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)


def import_tensorflow_quietly() -> None:
  """Imports TensorFlow (which CLU's writers and TFDS load) with its C++ start-up lines hidden:
  since TF 2.16 it logs them through absl's C++ logging (oneDNN, CPU features), which ignores
  TF_CPP_MIN_LOG_LEVEL. An ImportError still reaches the caller."""
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '1')  # older TensorFlows
  with _native_stderr_silenced():
    try:
      import tensorflow  # pylint: disable=g-import-not-at-top,unused-import
    except ImportError:  # an image without TensorFlow: train.py does without events
      pass


class _Quiet(logging.Filter):

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno >= logging.WARNING:
      message = record.getMessage()
      return not any(c in message for c in CHATTER)
    return record.pathname.startswith(PACKAGE_DIR)


class _QuietFormatter(logging.Formatter):
  """INFO as the bare message; warnings and errors with their level."""

  def format(self, record: logging.LogRecord) -> str:
    message = record.getMessage()
    if record.levelno >= logging.WARNING:
      message = f'{record.levelname}: {message}'
    return message


class _NotFromAbandonedReads(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith('Future exception was never retrieved')


@contextlib.contextmanager
def abandoned_reads_silenced():
  """Within the block, the aftermath of a skipped unreadable checkpoint stays off the console.

  A restore that fails on one array returns while orbax's reads of the step's other arrays are
  in flight. As they finish, tensorstore calls back into the asyncio loop that orbax has closed
  by then ("RuntimeError: Event loop is closed", through sys.unraisablehook, one traceback per
  array), and asyncio logs their failures ("Future exception was never retrieved").
  checkpoint.Checkpointer's warning says all of that once, so both are dropped here; other
  unraisable exceptions and asyncio logs still get through. The hook and the filter before the
  block come back after it."""
  previous = sys.unraisablehook

  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == 'Event loop is closed'):
      previous(unraisable)
  asyncio_logger, drop = logging.getLogger('asyncio'), _NotFromAbandonedReads()
  sys.unraisablehook = hook
  asyncio_logger.addFilter(drop)
  try:
    yield
  finally:
    asyncio_logger.removeFilter(drop)
    sys.unraisablehook = previous


class StopRequests:
  """Within the block, SIGTERM and SIGINT ask a run to stop after the current round: the first
  sets `signal_name` (e.g. 'SIGTERM'), which train.train_and_evaluate(..., stop=...) reads
  after each round.

  A second signal acts as it would have without this block (SIGINT: KeyboardInterrupt; SIGTERM:
  terminate), for a user who does not want to wait. Outside the main thread (where Python
  cannot install signal handlers) the block installs nothing and no stop is ever asked.
  """
  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.signal_name = None
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():  # signal.signal's requirement
      self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    return self

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)

  def _handle(self, signum, frame):
    del frame
    if self.signal_name is not None:
      signal.signal(signum, self._previous[signum] or signal.SIG_DFL)
      signal.raise_signal(signum)
      return
    self.signal_name = signal.Signals(signum).name
    logging.warning('%s: finishing this round, then writing a checkpoint and exiting. Send it '
                    'again to stop at once, without a checkpoint.', self.signal_name)


class _NoStop:
  """A stop request that is never made: what a run gets when its caller passes none."""
  signal_name = None


NO_STOP = _NoStop()


@contextlib.contextmanager
def configured(verbose: bool):
  """Within the block, all logging (Python's, and absl's, which feeds it) goes to stderr,
  filtered unless `verbose`, and a skipped checkpoint's abandoned reads stay quiet
  (`abandoned_reads_silenced`); the setup before it comes back after it."""
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  root = logging.getLogger()
  saved = root.handlers[:], root.level, absl_logging.get_verbosity()
  handler = logging.StreamHandler(sys.stderr)
  if verbose:
    handler.setFormatter(logging.Formatter(
        '%(levelname).1s%(asctime)s %(filename)s:%(lineno)d] %(message)s'))
  else:
    handler.setFormatter(_QuietFormatter())
    handler.addFilter(_Quiet())
  root.handlers = [handler]
  root.setLevel(logging.INFO)
  absl_logging.set_verbosity(absl_logging.INFO)
  logging.captureWarnings(True)  # warnings.warn(...) through the same filter
  try:
    with abandoned_reads_silenced():
      yield
  finally:
    logging.captureWarnings(False)
    root.handlers, _, _ = saved
    root.setLevel(saved[1])
    absl_logging.set_verbosity(saved[2])
