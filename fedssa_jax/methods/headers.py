"""The whole-header exchange LG-FedAvg and FedClassAvg share (docs/algorithm.md §6): the server
keeps a global header H_g [C, d + 1] (row c = (W[c], b[c])); a participant overwrites its whole
header with H_g, trains, and uploads its header with a weight (n_k, or 1); H_g becomes the
weighted mean of the round's uploads, or stays as it was in a round without any.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import struct

from fedssa_jax import models
from fedssa_jax.methods import aggregation, base

WEIGHTINGS = ('samples', 'uniform')


@struct.dataclass
class SharedHeaderServer:
  global_header: jax.Array  # [C, d + 1] H_g, what clients download
  inbox: aggregation.Inbox  # this round's sum_k w_k H_k and sum_k w_k (weighted)


class SharedHeader(base.Method):
  """The whole-header exchange: download H_g over the header, upload it, weighted mean."""
  config_section = 'lg_fedavg'  # the config block holding `weighting`
  per_sample_loss = True  # plain cross-entropy (FedClassAvg, with SupCon, sets False)
  ghost_norms = True  # the loss reads the parameters only through the model's apply
  private_upload = ('value',)  # the trained header, around the downloaded H_g
  central_noise_into = 'inbox'

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
    return SharedHeaderServer(global_header=header,
                              inbox=aggregation.Inbox.empty(header, weighted=True))

  def download(self, params, state, server, client):
    return base.Download(models.with_header_rows(params, server.global_header),
                         floats=jnp.int32(self.header_floats))

  def upload(self, trainable, acc, ctx, state, client):
    params = trainable['model']
    weight = jnp.asarray(client.num_samples if self.weighting == 'samples' else 1, jnp.float32)
    payload = base.WeightedUpload(value=models.header_rows(params), weight=weight)
    return base.Upload(params, state, payload, floats=jnp.int32(self.header_floats))

  def upload_reference(self, server, down, client):
    return {'value': models.header_rows(down.params)}  # H_g, as downloaded

  @classmethod
  def upload_refusal(cls, config, mode):
    if mode == 'central' and config[cls.config_section].weighting != 'uniform':
      return (f"header mean weights each upload by its n_k, which noise on one sum does not "
              f"cover (set {cls.config_section}.weighting='uniform' for it)")
    return super().upload_refusal(config, mode)

  def server_receive(self, server, client_ids, payloads, active):
    return server.replace(inbox=server.inbox.add(payloads.value, active, payloads.weight))

  def server_aggregate(self, server, participants, round_index, key):
    # The inbox holds exactly this round's participants' uploads.
    mean, any_ = server.inbox.mean()
    return base.Aggregated(SharedHeaderServer(
        global_header=jnp.where(any_, mean, server.global_header), inbox=server.inbox.cleared()))
