"""A run around the engine: what `python -m fedssa_jax.main` does beyond the rounds.

The top layer below the command line. `train` runs one experiment (data, partition,
simulator, the rounds, checkpoints, outputs); `checkpoint` saves and restores, `guards` stops a
diverged run, `workdir_lock` keeps two runs out of one workdir, `observers` follow the rounds
beside the engine (the system section's clock, the privacy accountants), `outputs` and
`console` write the records and the one line a round; `compare`, `report`, `runs` and `plots`
read finished runs back into tables and figures (`tuning` chooses hyperparameters on
validation), and `bench` times the engine's parts. It
imports nothing at import time, so a launcher may take `workdir_lock` alone without loading
JAX.
"""
