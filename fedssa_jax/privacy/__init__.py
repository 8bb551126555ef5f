"""Differential privacy: DP-SGD in every client's local training, client-level DP on the
uploads, and their accountants (docs/algorithm.md §11).

The `privacy` config section is off by default (`enabled` is False), and then nothing here runs:
a run's numbers are what they always were. With `privacy.dp_sgd` on:

1. **Batches by Poisson sampling.** Each of a client's S = E ceil(n_k / B) local steps takes each
   of its n_k training samples independently with probability q_k = min(1, B / n_k), drawn from
   the step's key (`poisson_batch`). A batch holds B samples on average; the compiled program
   holds `max_batch` rows of it, a bound that a batch exceeds with probability below
   TRUNCATION_TAIL (then the extra samples are left out of that step).
2. **Per-example clipping and noise.** Each selected sample's gradient, over every model the
   client trains (its own, and FML's meme, FedMRL's small model, ...), is clipped to the global
   norm C (`clip_norm`); the clipped gradients are summed, Gaussian noise of standard deviation
   sigma C (`noise_multiplier` sigma) is added to every coordinate, and the sum is divided by the
   expected batch size q_k n_k (`noisy_clipped_grads`). The optimizer (momentum, weight decay,
   its own norm clip) then treats that as the step's gradient: post-processing. Each example's
   norm comes from ghost norms where they are exact (`per_example` 'auto': models/ghost.py,
   `ghost_covers`, Method.ghost_norms), else from the example's gradient, built.
3. **Private releases** (releases.py): what a method sends that it computes from the data
   outside the steps. Class sums of a per-example vector (FD's logits, the prototypes' r;
   Method.release_values) with the class counts, from ONE forward pass over the client's
   training split (each example once): each example's row [clip(v, C_r/sqrt2), C_r/sqrt2] of a
   per-class table (C_r `release_clip`) has L2 norm at most C_r, and N(0, (z_r C_r)^2) on every
   coordinate (z_r `release_noise_multiplier`, 0: sigma) gives noisy sums and counts, one
   Gaussian mechanism a round the client trains (`table_stats`, `release_class_sums`). The
   class counts a server reads at the start (FedGen's prior) get N(0, z_r^2) each, once
   (`noisy_class_counts`). A step after training's output (FedL2G's meta gradient;
   Method.release_after_training) is clipped whole to C_r and noised with std z_r C_r
   (`release_whole`): sensitivity 2 C_r, noise multiplier z_r / 2. What no release bounds
   (FedORGP's outlier filter) is refused (Method.dp_sgd_refusal).
4. **The accountant** (`Accountant`, Google's `dp_accounting`): a client's S steps of a round
   are S Poisson-sampled Gaussian mechanisms of rate q_k and noise sigma, each release a
   Gaussian mechanism of noise z_r; its epsilon at `delta` composes every step it ran and every
   release it made so far (`client_event`; RDP by default, or PLD). A run's epsilon is the
   largest over its clients. With `target_epsilon`, noise_multiplier 0 calibrates sigma so that
   every client ends within the target having trained (and released) every round; a given sigma
   instead ends the run before a round that could take a client past the target.

The guarantee is sample-level, for each client's training data, and covers everything the
client sends: what is computed from the trained models alone (FedSSA's and LG-FedAvg's header
rows, FML's meme, FedMRL's shared model) is post-processing, and the rest is a release above.

With `privacy.upload` on, each client's upload is protected as a whole (client-level DP):

5. **Clip and noise the upload.** The payload's fields that carry what the client computed from
   its data (`Method.private_upload`: header rows, prototypes, logits, a model), less a value the
   server already knows (`Method.upload_reference`: the global model the client downloaded; else
   zero), are clipped jointly to the global norm C_u (`upload_clip`) (`privatize_upload`). In
   `upload_mode` 'local' the client adds N(0, (z C_u)^2) to every coordinate before it sends;
   in 'central' the server adds it once to the round's sum of the clipped uploads, and divides
   by a count that reveals nothing of who took part (the method's `central_noise`).
6. **Their accountant** (`UploadAccountant`): replacing one client's data moves its clipped
   upload by at most 2 C_u, so each release is a Gaussian mechanism of noise multiplier z / 2.
   Local: a client's epsilon composes the uploads it sent. Central: each round is that mechanism
   on a cohort of K of the N clients drawn without replacement (RDP, replace-one neighbours);
   the population's epsilon composes the rounds.

The package, by job (its names are all here too, as `privacy.<name>`):
- config.py       the section: its defaults, `enabled` / `upload_enabled`, and its checks
- mechanisms.py   Poisson batches, the clip and the noise, and the upload transform with its keys
- dp_sgd.py       DP-SGD's step: its settings and the batch's noisy clipped gradient
- releases.py     DP-SGD's private releases: the class-sums table, its noise, the class counts
- accountants.py  the host-side accountants
"""
from fedssa_jax.privacy.accountants import (MAX_NOISE_MULTIPLIER, Accountant, UploadAccountant,
                                            calibrate, client_event, dp_sgd_event, epsilon,
                                            new_accountant, release_event, upload_epsilon,
                                            upload_event)
from fedssa_jax.privacy.config import (ACCOUNTANTS, PER_EXAMPLE, UPLOAD_MODES, check_config,
                                       check_models, check_upload, default_config, enabled,
                                       upload_enabled)
from fedssa_jax.privacy.dp_sgd import (DPSGD, dp_sgd_settings, ghost_covers, noisy_clipped_grads,
                                       pass_size_for)
from fedssa_jax.privacy.mechanisms import (TRUNCATION_TAIL, UploadDP, add_noise, clip_factor,
                                           clip_scale, max_batch, poisson_batch, privatize_upload,
                                           sampling_rate, server_upload_key, upload_keys)
from fedssa_jax.privacy.releases import (Release, class_table, noisy_class_counts,
                                         release_class_sums, release_keys, release_whole,
                                         releases_of, table_stats)
