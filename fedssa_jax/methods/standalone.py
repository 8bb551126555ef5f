"""Standalone: local training only, no exchange. The lower bound and the control."""
from fedssa_jax.methods import base


class Standalone(base.Method):
  name = 'standalone'
  per_sample_loss = True  # plain cross-entropy
  ghost_norms = True  # the loss reads the parameters only through the model's apply
