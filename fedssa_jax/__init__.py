"""fedssa_jax: a JAX/Flax simulator for model-heterogeneous personalised federated learning.

Its sub-packages are layers; a module imports only from its own layer and those below it
(tests/layers_test.py checks it), from the bottom up:

    errors, types   the user's errors and the PyTree alias
    models          the client model families (the five CNNs, HtFLlib's zoo)
    data            data sets, partitions, augmentation
    methods         FedSSA and the baselines, as hooks of one interface
    system          system heterogeneity: availability, dropout, stragglers, lost uploads,
                    devices and a simulated clock
    config_lib      the config: defaults, variants, validation
    engine          the round: the simulator, the population, local training, evaluation
    run             a whole experiment: training loop, checkpoints, outputs, reports
    main            the command line: python -m fedssa_jax.main
"""
__version__ = '0.1.0'
