"""The errors that are the user's to fix: each message names what is wrong and the fix.

Every layer may raise them; this module imports nothing, so it sits below them all. The command
line (fedssa_jax/main.py) prints them as one paragraph, without a traceback.
"""


class ConfigError(ValueError):
  """A config value that cannot work, with the fix in its message."""


class DataError(ValueError):
  """A data set or partition that cannot be used, with the fix in its message."""


class UnknownDatasetError(DataError):
  """A data set name TFDS does not know."""


def require(ok, msg: str) -> None:
  """A ConfigError with `msg` (which names the fix) unless `ok`."""
  if not ok:
    raise ConfigError(msg)


def require_one_of(field: str, value, choices) -> None:
  """A ConfigError naming `field`'s choices unless `value` is one of them."""
  require(value in choices, f'Unknown {field} {value!r}; choose one of {sorted(choices)}.')
