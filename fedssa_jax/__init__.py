"""fedssa_jax: a JAX/Flax simulator for model-heterogeneous personalised federated learning."""
__version__ = '0.1.0'
