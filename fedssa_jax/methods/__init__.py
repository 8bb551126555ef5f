"""Federated methods: each one module implementing the hooks of `base.Method`.

Above models and data; below the config (which assembles every method's section) and the
engine (which calls the hooks). `base` is the interface the engine drives and the typed data the
hooks exchange; `losses` and `aggregation` are what the methods' objectives and server rules are
made of; `prototypes` and `headers` hold what several methods share (FedProto's, FedGH's and
FedTGP's prototypes; LG-FedAvg's, FedClassAvg's and FedGen's header exchange). No method imports
another.
`METHODS` registers them by name (`get_method`).
"""
from fedssa_jax.methods.base import (FORWARD_PASS_TIMES, Accumulated, Aggregated, ClientView,
                                     Download, Method, Upload)
from fedssa_jax.methods.fd import FD
from fedssa_jax.methods.fedclassavg import FedClassAvg
from fedssa_jax.methods.fedgen import FedGen
from fedssa_jax.methods.fedgh import FedGH
from fedssa_jax.methods.fedkd import FedKD
from fedssa_jax.methods.fedl2g import FedL2G
from fedssa_jax.methods.fedmrl import FedMRL
from fedssa_jax.methods.fedorgp import FedORGP
from fedssa_jax.methods.fedproto import FedProto
from fedssa_jax.methods.fedsa import FedSA
from fedssa_jax.methods.fedssa import FedSSA
from fedssa_jax.methods.fedtgp import FedTGP
from fedssa_jax.methods.fml import FML
from fedssa_jax.methods.lg_fedavg import LGFedAvg
from fedssa_jax.methods.standalone import Standalone

METHODS = {m.name: m for m in (FedSSA, Standalone, FD, FedProto, FML, FedKD, LGFedAvg,
                                  FedClassAvg, FedGH, FedTGP, FedL2G, FedMRL, FedSA,
                                  FedORGP, FedGen)}


def get_method(name: str):
  if name not in METHODS:
    raise ValueError(f'Unknown method {name!r}; choose one of {sorted(METHODS)}.')
  return METHODS[name]
