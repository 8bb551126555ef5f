"""The JAX internal the package reads: distributed._coordination_client, its one access to
`jax._src` (tests/code_shape_test.py keeps it the only one). A JAX release that moves the
coordination client, or changes the key-value calls the Watchdog makes on it, fails here, rather
than leaving multi-process runs without their watchdog.
"""
import logging

from jax._src import distributed as jax_distributed
from jax._src.lib import _jax

from fedssa_jax.engine import distributed


def test_the_coordination_client_is_where_the_watchdog_reads_it(monkeypatch):
  state = jax_distributed.global_state
  assert isinstance(state, jax_distributed.State)
  assert 'DistributedRuntimeClient' in str(jax_distributed.State.__annotations__['client'])
  assert state.client is None  # this process started no service
  sentinel = object()
  monkeypatch.setattr(state, 'client', sentinel)
  assert distributed._coordination_client() is sentinel


def test_the_client_has_the_key_value_calls_the_watchdog_makes():
  client = _jax.DistributedRuntimeClient
  # nanobind's signatures: key_value_set(self, key, value, allow_overwrite=False) -> None, ...
  assert 'allow_overwrite: bool' in client.key_value_set.__doc__
  assert client.key_value_try_get.__doc__.startswith('key_value_try_get(self, key: str) -> str')


def test_a_moved_client_means_no_watchdog_and_a_warning(monkeypatch, caplog):
  monkeypatch.delattr(jax_distributed, 'global_state')  # (JAX's is_initialized reads it too)
  monkeypatch.setattr(distributed.jax.distributed, 'is_initialized', lambda: False)
  assert distributed._coordination_client() is None
  assert not caplog.records  # a single process: nothing to watch, nothing to say
  monkeypatch.setattr(distributed.jax.distributed, 'is_initialized', lambda: True)
  with caplog.at_level(logging.WARNING):
    assert distributed._coordination_client() is None
  assert 'No watchdog on the other processes' in caplog.text
