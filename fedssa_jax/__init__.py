"""fedssa_jax: a JAX/Flax simulator for model-heterogeneous personalised federated learning.

Its sub-packages are layers; a module imports only from its own layer and those below it
(tests/layers_test.py checks it, and its LAYERS is the order; docs/architecture.md has the
modules), from the bottom up:

    errors, types, streams, headcount
                             the user's errors, the PyTree alias, the run's random streams, the
                             federation's counts (new clients, N', K)
    models                   the client model families (the five CNNs, HtFLlib's zoo)
    data                     data sets, partitions, augmentation
    methods                  FedSSA and the baselines, as hooks of one interface
    system, privacy          system heterogeneity (availability, dropout, stragglers, lost
                             uploads, devices and a simulated clock); differential privacy
                             (DP-SGD, the uploads' clip and noise, the accountants)
    config_lib               the config: defaults, variants, validation
    engine                   the round: the simulator, the upload path, the population, local
                             training, evaluation
    run                      a whole experiment: training loop, checkpoints, outputs, reports
    main, audit              the command lines: python -m fedssa_jax.main, and the privacy
                             audit (python -m fedssa_jax.audit: canaries, a lower bound on
                             epsilon, a membership inference attack)
"""
import os as _os

__version__ = '0.1.0'

# XLA flags the package sets, each unless the caller's XLA_FLAGS names it. They change how XLA
# compiles, not what it computes (launch/same_numbers.py gives the same records without them).
# Set before JAX starts a backend: importing the package first is enough.
# - `xla_cpu_copy_insertion_use_region_analysis`: without it, XLA:CPU copies weights inside
#   the training loop on every step (the update writes one where the backward pass, or the
#   momentum's update, still reads it), two more passes over them for steps that the passes
#   bound at batch 10: a round of the five CNNs at N = 1,000 with the default SGD (momentum)
#   took 18% less with it (docs/benchmarks.md, "Copies of the weights in the training loop").
XLA_FLAGS = {'xla_cpu_copy_insertion_use_region_analysis': 'true'}


def with_xla_flags(flags: str, defaults=None) -> str:
  """`flags` (an XLA_FLAGS value) with each of `defaults` (default: XLA_FLAGS) that it does not
  name appended."""
  named = {token.split('=')[0] for token in flags.split()}
  for name, value in (XLA_FLAGS if defaults is None else defaults).items():
    if f'--{name}' not in named:
      flags = f'{flags} --{name}={value}'.strip()
  return flags


_os.environ['XLA_FLAGS'] = with_xla_flags(_os.environ.get('XLA_FLAGS', ''))
