"""Type aliases the package shares. Imports nothing of the package: every layer may use it."""
from typing import Any

# A pytree of arrays (nested dicts, tuples and flax.struct dataclasses): what jit, vmap, the
# population stores and the checkpoints carry. Its structure is the owner's to document.
PyTree = Any
