"""The federation's head counts, each defined once (docs/algorithm.md): the new clients a run
sets aside, the clients that take part, and the cohort a round samples. The config's checks, the
engine's rounds and the central-DP servers' shares all read them here, so that they cannot
disagree. Imports nothing of the package."""
import math


def new_client_count(fraction: float, num_clients: int) -> int:
  """round(f N): the clients that `new_clients` = f sets aside; they never train."""
  return round(fraction * num_clients)


def participating(num_clients: int, new_clients: float) -> int:
  """N' = N - round(f N): the clients a round may sample (all N without new clients)."""
  return num_clients - new_client_count(new_clients, num_clients)


def cohort_size(num_clients: int, participation: float) -> int:
  """K = max(1, floor(C N)) of `num_clients` (N', where a run has new clients)."""
  return max(1, math.floor(participation * num_clients))
