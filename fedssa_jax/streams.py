"""The run's random streams: one registry, so that no two draws share a stream by accident.

Every random draw of a run comes from its seed through one of these streams, so a run repeats
exactly whatever the store, the mesh or the packing of seeds, and resumes exactly
(docs/architecture.md, "Randomness"). A new draw takes a new member here, with the next free
value, and names the one module that consumes it (tests/streams_test.py checks that every
member has exactly one consumer module and that no value repeats within a registry).

`Stream`: folded into a seed's root key (jax.random.fold_in(PRNGKey(seed), stream)) or leading
a NumPy generator's seed sequence (np.random.default_rng([seed, stream, ...])).
`StepStream`: folded into a local step's key (the step's augmentation views take 0, 1, ... below
them). `SystemDraw` and `ProfileDraw`: the kinds of draw within Stream.SYSTEM (per round) and
Stream.SYSTEM_PROFILE (per run); `AuditDraw` those within Stream.AUDIT (the privacy audit,
`python -m fedssa_jax.audit`). The values are those the draws have always used: changing one
changes every number of the runs that draw from it.
"""
from __future__ import annotations

import enum


class Stream(enum.IntEnum):
  """A seed's streams; each line names its consumer and how a draw is keyed within it."""
  INIT = 0            # engine/parts.py: a client's initial model (init_scope 'client'), by id
  SAMPLE = 1          # engine/schedule.py: the round's cohort, by round
  TRAIN = 2           # engine/simulator.py: local training, by round and client id
  SERVER = 3          # engine/parts.py: the server's initial state
  CLIENT_STATE = 4    # engine/parts.py: a client's initial method state, by id
  EVAL = 5            # engine/schedule.py: the subset of clients evaluated (eval_clients)
  FAMILY_INIT = 6     # engine/parts.py: a family's shared initial model (init_scope 'family')
  AGGREGATE = 7       # engine/uplink.py: the server rule's key, by round
  STUDY = 8           # engine/simulator.py: the study batch of a step after training, by
                      # round and client id (Method.after_training)
  SYSTEM = 9          # system.py: the federation's draws, by round and SystemDraw
  SYSTEM_PROFILE = 10  # system.py: per-run draws of the federation, by ProfileDraw
  UPLOAD = 11         # privacy/mechanisms.py: upload noise, by round and client id (the
                      # server's central noise at SERVER_UPLOAD_ID)
  NEWCOMERS = 12      # engine/generalization.py: which clients never train (new_clients), per
                      # run; their local training at an evaluation, by round and client id
  GLOBAL_TEST = 13    # engine/generalization.py: the global test sample (eval_global_images)
  RELEASE = 14        # privacy/releases.py: the noise of DP-SGD's private releases, by round
                      # and client id (the class counts the server reads, at RELEASE_AT_START)
  AUDIT = 15          # audit/canaries.py: the privacy audit's canaries, per run, by AuditDraw


class StepStream(enum.IntEnum):
  """Folded into a local step's key; the step's augmentation views use 0, 1, ... below."""
  DROPOUT = 1 << 16   # engine/training.py: a model's dropout (models.StatefulModel)
  POISSON = 1 << 17   # engine/training.py: DP-SGD's Poisson batch
  NOISE = 1 << 18     # engine/training.py: DP-SGD's gradient noise
  LOSS = 1 << 19      # engine/training.py: the loss's own draws (Method.loss_draws)


class SystemDraw(enum.IntEnum):
  """Within Stream.SYSTEM: np.random.default_rng([seed, SYSTEM, round, kind])."""
  ONLINE = 0
  DROPOUT = 1
  STRAGGLER = 2
  WORK = 3
  UPLOAD_LOSS = 4


class ProfileDraw(enum.IntEnum):
  """Within Stream.SYSTEM_PROFILE: np.random.default_rng([seed, SYSTEM_PROFILE, kind])."""
  AVAILABILITY = 0
  TIERS = 1


class AuditDraw(enum.IntEnum):
  """Within Stream.AUDIT: np.random.default_rng([seed, AUDIT, kind])."""
  DATA = 0    # the training-data canaries: owners, images, labels, which are included
  UPLOAD = 1  # the upload canaries: directions, which are included


# The server's place beside the client ids in Stream.UPLOAD (its central noise of a round).
SERVER_UPLOAD_ID = 1 << 30

# The round index, in Stream.RELEASE, of the releases made once before round 0 (the clients'
# class counts a server reads at the start: Method.server_reads_class_counts).
RELEASE_AT_START = 1 << 30

REGISTRIES = (Stream, StepStream, SystemDraw, ProfileDraw, AuditDraw)
