"""The command line's console: a quiet one by default, every library's logs with --verbose.

Quiet, the console shows this package's INFO lines (what runs, one line per round, the summary)
and WARNING or worse from anyone, bar the known chatter below. Verbose, it shows every INFO line
of every library, with levels, times and sources, as absl would. Log files (metrics.jsonl,
events, summary.json) do not depend on either.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys

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


@contextlib.contextmanager
def configured(verbose: bool):
  """Within the block, all logging (Python's, and absl's, which feeds it) goes to stderr,
  filtered unless `verbose`; the logging setup before it comes back after it."""
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
    yield
  finally:
    logging.captureWarnings(False)
    root.handlers, _, _ = saved
    root.setLevel(saved[1])
    absl_logging.set_verbosity(saved[2])
