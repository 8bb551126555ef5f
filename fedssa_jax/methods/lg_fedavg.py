"""LG-FedAvg (Liang et al. 2020) sharing the whole header (docs/algorithm.md §6).

Unlike FedSSA, which exchanges only the rows of a client's seen classes and averages them class
by class, LG-FedAvg shares the *whole* header H = fc3 as a [C, d + 1] table (row c = (W[c], b[c]),
d = model.feature_dim):

- Server state: the global header H_g. It starts as one fresh header drawn from the server's key
  with a client header's init (models.Dense: PyTorch's U(+-1/sqrt(d)) for weights and bias).
  This is the common initial header (HtFLlib takes client 0's initial header; ours is an
  independent draw from the same distribution).
- Download: a participant overwrites its whole header with H_g, unseen-class rows included.
- Objective: plain CE over the whole model (base.Method.loss).
- Upload: the trained header, plus n_k as metadata for the weighting.
- Server: H_g = sum_k n_k H_k / sum_k n_k over this round's participants (`weighting='samples'`,
  the default, as HtFLlib) or their unweighted mean (`'uniform'`, the original code). The
  uploads are summed as they arrive (an inbox kept apart from H_g, which clients download) and
  divided once per round; a round with no upload keeps H_g.
- Inference (docs/algorithm.md §5): every client's local extractor with the latest H_g.
- Floats: (d + 1) C down and (d + 1) C up per participant (n_k is metadata, not counted). Evaluating
  non-participants with H_g implies HtFLlib's broadcast to all N clients, which is not counted.

`SharedHeader` holds this exchange; FedClassAvg (fedclassavg.py) reuses it with its own loss.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import struct

from fedssa_jax import models
from fedssa_jax.methods import base

WEIGHTINGS = ('samples', 'uniform')


@struct.dataclass
class SharedHeaderServer:
  global_header: jax.Array  # [C, d + 1] H_g, what clients download
  inbox: base.Inbox         # this round's sum_k w_k H_k and sum_k w_k (weighted)


class SharedHeader(base.Method):
  """The whole-header exchange: download H_g over the header, upload it, weighted mean."""
  config_section = 'lg_fedavg'  # the config block holding `weighting`
  per_sample_loss = True  # plain cross-entropy (FedClassAvg, with SupCon, sets False)

  @classmethod
  def default_config(cls):
    c = ml_collections.ConfigDict()  # docs/algorithm.md §6: the method's defaults
    c.weighting = 'samples'      # header mean: 'samples' (n_k) or 'uniform'
    return c

  @classmethod
  def check_config(cls, c):
    if c.weighting not in WEIGHTINGS:
      raise ValueError(f'{cls.config_section}.weighting must be one of {WEIGHTINGS}, '
                       f'got {c.weighting!r}.')

  def __init__(self, config, num_clients, num_classes, image_shape=None):
    super().__init__(config, num_clients, num_classes, image_shape)
    self.weighting = config[self.config_section].weighting
    self.header_floats = self.header_row * num_classes

  def init_server(self, key, seen):
    header = models.init_header(key, self.num_classes, self.feature_dim)
    return SharedHeaderServer(global_header=header, inbox=base.Inbox.empty(header, weighted=True))

  def download(self, params, state, server, client):
    return base.Download(models.with_header_rows(params, server.global_header),
                         floats=jnp.int32(self.header_floats))

  def upload(self, trainable, acc, ctx, state, client):
    params = trainable['model']
    weight = jnp.asarray(client.num_samples if self.weighting == 'samples' else 1, jnp.float32)
    return base.Upload(params, state,
                       payload={'rows': models.header_rows(params), 'weight': weight},
                       floats=jnp.int32(self.header_floats))

  def server_receive(self, server, client_ids, payloads, active):
    return server.replace(inbox=server.inbox.add(payloads['rows'], active, payloads['weight']))

  def server_aggregate(self, server, participants, round_index, key):
    # The inbox holds exactly this round's participants' uploads.
    mean, any_ = server.inbox.mean()
    return base.Aggregated(SharedHeaderServer(
        global_header=jnp.where(any_, mean, server.global_header), inbox=server.inbox.cleared()))


class LGFedAvg(SharedHeader):
  name = 'lg_fedavg'

  def eval_params(self, params, server, client_id):
    return models.with_header_rows(params, server.global_header)
