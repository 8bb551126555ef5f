"""fedssa_jax: a JAX/Flax simulator for model-heterogeneous personalised federated learning.

Its sub-packages are layers; a module imports only from its own layer and those below it
(tests/layers_test.py checks it, and its LAYERS is the order; docs/architecture.md has the
modules), from the bottom up:

    errors, types, streams   the user's errors, the PyTree alias, the run's random streams
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
__version__ = '0.1.0'
