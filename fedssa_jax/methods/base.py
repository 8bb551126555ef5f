"""The interface every federated method implements, and that the engine drives
(docs/algorithm.md §9, "Adding a method"), and the typed data its hooks exchange.

A round, as the engine runs it (engine/simulator.py), for each sampled client k (vmapped within
a chunk of one model family) and then once on the server:

    v        = ClientView(id=k, seen=S_k, num_samples=n_k, round=t)
    d        = method.download(params_k, state_k, server, v)                  # Download
    trained  = local training of {'model': d.params, **d.aux} with method.loss(..., d.ctx, ...),
               summing the loss's per-step statistics into an accumulator (method.init_acc())
    acc      = Accumulated(loss=those sums,
                           forward_pass=the forward pass's sums,      # None without forward_pass
                           after_training=method.after_training(...))  # None where undefined
    u        = method.upload(trained..., acc, d.ctx, state_k, v)              # Upload
    server   = method.server_receive(server, client_ids, u.payload, active)
    ...
    a        = method.server_aggregate(server, participants, t, key)          # Aggregated, once
                                                                              # per round

- `params_k` is the client's own model (its family's architecture, kept by the engine);
  `state_k` is any other per-client state the method keeps (the same shape for every client, so
  the engine stores it as one array over all N clients), e.g. FedKD's W_h.
- `v` (ClientView) is what a client hook may know of its client; a hook reads only what it needs.
- `d.aux` holds extra models trained jointly with the client's own (FML's meme, FedKD's
  mentee), by name: every top-level entry of {'model': ..., **aux} gets its own optimizer state.
- `d.ctx` holds constants of the round's loss (global logits, prototypes, the global header).
- Hook data are typed: a method's per-client state (`init_client_state`, `Upload.state`), its
  loss's constants (`Download.ctx`), its accumulator (`init_acc`, the loss's updates) and its
  payload (`Upload.payload`, what `server_receive` gets with a leading client axis) are each a
  flax.struct dataclass with named fields, or None where the method has none (`NoState` for a
  client state). Shapes several methods share have one type: `ClassSums` (V1 class sums),
  `WeightedUpload` (a whole upload and its weight); prototypes.py holds the prototype methods'.
  A dataclass's field order is its leaves' order in the compiled programs (XLA's rounding may
  depend on it): the types that replaced dicts keep the dicts' sorted key order.
- The floats each side sends are counted where the exchange happens (`Download.floats`,
  `Upload.floats`), as are client FLOPs beyond the training steps (`.flops`), and the server's
  FLOPs and diagnostics of the round (`Aggregated.flops`, `.metrics`).
- `method.forward_pass` ('before' or 'after'; None, the default, runs none) asks for one more
  pass over the client's training split, before local training (on d.params) or after it (on
  the trained model): a forward of the model as evaluated (unaugmented, eval-size batches, no
  gradient; training.forward_pass_sums) summing `method.forward_pass_stats(logits, rep, y,
  valid)`, by default `ClassSums` of r (FedGH's and FedTGP's prototypes). Its sums reach
  `upload` as `acc.forward_pass`, and its FLOPs (a forward over n_k samples) count as the
  client's extra FLOPs. Under DP-SGD (privacy.dp_sgd), a method defining `release_values`
  (what it sends class means of) gets instead, as `acc.forward_pass`, a private release of the
  pass: `ClassSums` of those values and the class counts, each example's row clipped and the
  table noised (privacy/releases.py; docs/algorithm.md §11).
- `method.held_out_samples` Q (0 by default) holds positions 0..Q-1 of the client's training
  index row out of local training for good (FedL2G's quiz set): training sees positions
  Q..n_k-1, n_k - Q samples. `method.trains(t)` (True by default) is False in a round whose
  clients run no training step (FedL2G's warm-up). With the defaults nothing of either is traced.
- `method.after_training` (None by default: nothing traced), a step after local training with
  gradients and data (FedL2G's meta step): the engine calls
  `after_training(apply_fn, trainable, ctx, study, quiz, client)` on the trained model with a
  study batch (B samples of the trainable split, drawn with the client's key of
  STREAM_STUDY) and the held-out quiz set, each (x, y, valid), normalised and unaugmented. Its
  output reaches `upload` as `acc.after_training`, and its FLOPs (`after_training_steps`
  training steps per study and per quiz sample) count as the client's extra FLOPs.
- `method.loss_draws` (False by default) gives the loss a keyword `key`, each local step's own,
  for draws of its own (FedGen's generated labels and noise); `method.server_reads_class_counts`
  (False by default) gives `init_server` a keyword `class_counts` [N, C], each client's training
  samples per class (FedGen's label prior). With the defaults neither is traced.
- The server state is a flax.struct dataclass of the method's own (one per method, with named
  fields; `NoServer` when it keeps none); whole uploads it sums as they arrive go in an `Inbox`.

Evaluation (engine/evaluation.py), for each evaluated client k and each of its test batches x:

    p              = method.eval_params(params_k, server, k)                # once per client
    logits, rep    = method.eval_forward(apply_fn, p, state_k, server, k, x)  # per batch
    extra counts   = method.eval_extra(server, k, logits, rep, y, valid)

- `eval_forward` is optional: by default it is the family's `apply_fn` on `p` (the client's
  model, its header maybe replaced by `eval_params`), and evaluation then runs exactly that,
  without reading the client state. A method that predicts through more than the client's model
  (FedMRL: its projector J_k in `state_k` and the server's shared model) overrides it and
  declares `eval_reads_state = True`; evaluation then brings each evaluated client's `state_k`
  to the call.
- Which of these a method uses is declared, not found out (`eval_reads_state`,
  `eval_reads_server` and how: the Method's class attributes), as `forward_pass` and
  `after_training` are for the round.

Everything runs under jit: the client hooks on one client (the engine vmaps them), the server
hooks on the whole population; their states are pytrees of arrays (checkpointed, sharded).
"""
from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import struct
from flax.core import FrozenDict

from fedssa_jax import headcount, models
from fedssa_jax.methods import losses
from fedssa_jax.types import PyTree

# numpy, not jax: importing a method must not start a backend (jax.distributed comes first).
# Read-only, as they are shared defaults.
ZERO_I = np.zeros((), np.int32)
ZERO_F = np.zeros((), np.float32)
ZERO_I.flags.writeable = ZERO_F.flags.writeable = False


class Download(NamedTuple):
  params: PyTree          # the client's own model after the download (e.g. fused header)
  # Extra trainable models by name, trained jointly with `params`, each with its own optimizer.
  aux: Mapping[str, PyTree] = FrozenDict()
  ctx: PyTree = None      # constants of the local loss (a dataclass of the method's; None: none)
  floats: jax.Array = ZERO_I  # floats received
  flops: jax.Array = ZERO_F   # client FLOPs spent on the download (e.g. fusion)


class Upload(NamedTuple):
  params: PyTree          # the client's own model, as it keeps it
  state: PyTree           # the client's persistent state (init_client_state's type)
  payload: PyTree = None  # what the server receives (a dataclass of the method's; None: nothing)
  floats: jax.Array = ZERO_I  # floats sent
  flops: jax.Array = ZERO_F   # client FLOPs spent on the upload (e.g. FedKD's SVDs)


class Aggregated(NamedTuple):
  server: PyTree              # the server state after the round's rule
  flops: jax.Array = ZERO_F   # server FLOPs spent this round
  # Scalar diagnostics of the round by name (e.g. a server-side loss).
  metrics: Mapping[str, jax.Array] = FrozenDict()


@struct.dataclass
class ClientView:
  """What a client hook knows of the client it runs for (the engine vmaps the hooks over a
  chunk's clients, so each field is one client's)."""
  id: jax.Array           # int32 client id
  seen: jax.Array         # [C] bool: the classes the client holds (S_k)
  num_samples: jax.Array  # int32 training samples this round (n_k; 0 for a padding dummy)
  round: jax.Array        # int32 global round index t


@struct.dataclass
class NoServer:
  """The server state of a method that keeps none (Standalone)."""


@struct.dataclass
class NoState:
  """The per-client state of a method that keeps none beyond the client's model."""


@struct.dataclass
class Accumulated:
  """What `upload` receives of a client's round besides its trained models (the module
  docstring): each field None where the round had no such part."""
  loss: PyTree = None            # the sum of the loss's accumulator updates (init_acc's type)
  forward_pass: PyTree = None    # the forward pass's sums (forward_pass_stats's type)
  after_training: PyTree = None  # what after_training returned


FORWARD_PASS_TIMES = ('before', 'after')  # Method.forward_pass: around local training


@struct.dataclass
class ClassSums:
  """Per-class sums of [C, D] values and the class counts (algorithm.md §6 V1): FD's logits,
  the prototype methods' representations, the forward pass's default."""
  count: jax.Array  # [C] float32
  sum: jax.Array    # [C, D]

  @classmethod
  def zeros(cls, num_classes: int, dim: int) -> ClassSums:
    """The zero accumulator of `class_sums` for [C, dim] values (a method's init_acc)."""
    return cls(sum=jnp.zeros((num_classes, dim), jnp.float32),
               count=jnp.zeros((num_classes,), jnp.float32))


@struct.dataclass
class WeightedUpload:
  """A whole upload the server averages in an Inbox (LG-FedAvg's and FedClassAvg's header,
  FedMRL's shared model) and its weight in that mean, n_k or 1."""
  value: PyTree      # the uploaded array or model parameters
  weight: jax.Array  # float32 scalar


def class_sums(values, y, valid, num_classes) -> ClassSums:
  """Per-class sums and counts of `values` [B, D] (algorithm.md §6 V1: a one-hot matmul)."""
  onehot = jax.nn.one_hot(y, num_classes, dtype=values.dtype) * valid[:, None]
  return ClassSums(sum=onehot.T @ values, count=onehot.sum(axis=0))


def class_means(sums: ClassSums, seen):
  """The per-class means [C, D] of the sums `class_sums` accumulated over a client's training,
  zero for a class it does not hold; and which classes it holds [C] (seen and trained on).

  What FD (mean logits) and FedProto (prototypes) upload: the rows of unheld classes are zeroed
  so that an upload carries nothing about classes the client never saw."""
  held = seen & (sums.count > 0)  # = S_k for any client that trained
  means = sums.sum / jnp.maximum(sums.count, 1.0)[:, None]
  return jnp.where(held[:, None], means, 0.0), held


# --- The trained clients' norms: a diagnostic any method may fill (Method.trained_norms) --------
@struct.dataclass
class Norms:
  """Norms of one trained client's model that its round reports (the record's
  header_norm_max and header_norm_mean: the largest over the participants, and the mean over
  all their norms): their largest, their sum and how many."""
  max: jax.Array
  sum: jax.Array
  count: jax.Array

def dp_sgd_on(config) -> bool:
  """Whether `config` trains with DP-SGD (privacy.dp_sgd): then a method that sends class means
  of the data (`Method.release_values`) takes them from one private release."""
  p = config.get('privacy')
  return p is not None and bool(p.dp_sgd)


def central_share(config, num_clients: int) -> float | None:
  """Under central client-level DP on the uploads, q = K / N', the share of the N' clients that
  take part (not the new clients) a round samples (`headcount`'s K): a server that noises a sum
  divides it by q times the class's owners among them, a count fixed in advance."""
  p = config.get('privacy')
  if p is None or not p.upload or p.upload_mode != 'central':
    return None
  eligible = headcount.participating(num_clients, config.get('new_clients') or 0.0)
  return headcount.cohort_size(eligible, config.participation) / eligible


class Method:
  """Defaults: no exchange and plain cross-entropy (which is Standalone)."""
  name = 'base'
  # The config block of the method's hyperparameters (config.<section>), whose fields and
  # defaults `default_config` gives and `check_config` checks; None: the method has none.
  # config_lib.base_config assembles every method's block, and config_lib.validate checks them.
  config_section: str | None = None
  num_views = 1  # augmented views of each training batch the loss receives
  # Is the loss a mean of per-sample terms? Then a step's gradient may be summed over smaller
  # passes (training.TrainConfig.micro_batch). False for a loss that couples a batch's samples
  # (contrastive pairs, batch statistics). No default: every method declares it.
  per_sample_loss: bool
  # Does the loss read the trainable parameters only through the models' layers (their
  # apply)? Then DP-SGD may find each example's gradient norm from the layers' inputs and
  # output cotangents (privacy.per_example='auto', models/ghost.py), which counts only what
  # passes through a layer. A loss that also reads a parameter directly (a header row in a
  # regulariser, say) leaves it False, the default: each example's gradient is then built.
  ghost_norms: bool = False
  # A forward pass over the client's training split around local training (the module
  # docstring; FORWARD_PASS_TIMES): 'before' it, 'after' it, or None (the default: no pass, no
  # extra work). A method may set it per instance, from its config.
  forward_pass: str | None = None
  # With True, the forward pass also gives `forward_pass_stats` each batch's positions in the
  # client's training row (`pos` [b]) and the row's width W (`width`, static), so that its
  # stats may place per-sample values in [W, ...] tables (zero elsewhere; the pass sums them):
  # FedORGP's outlier filter, which needs each sample's representation. False: the four alone.
  forward_pass_rows: bool = False
  # The first `held_out_samples` positions of each client's training index row are never
  # trained on (the module docstring): 0, the default, holds none out.
  held_out_samples: int = 0
  # A step after local training with gradients and data (the module docstring): None, the
  # default, runs none. A method defines it as a method
  #   after_training(self, apply_fn, trainable, ctx, study, quiz, client) -> PyTree
  # on the trained `trainable` ({'model': params, **aux}), with the differentiable `apply_fn`
  # of the client's model, the loss's `ctx`, a study batch and the quiz set, each (x [b, H,
  # W, C], y [b], valid [b]); `upload` finds its output as `acc.after_training`.
  # `after_training_steps`: its FLOPs, in CE steps of the client's model per (study, quiz) sample.
  after_training: Callable | None = None
  after_training_steps: tuple[float, float] = (0.0, 0.0)
  # Does the loss draw at random (FedGen's labels and noise)? Then it is called with a keyword
  # `key`, each step's own (fold_in(the step's key, StepStream.LOSS)); False: without it.
  loss_draws: bool = False
  # Does the server's initial state need the clients' class counts (FedGen's label prior)? Then
  # `init_server` gets a keyword `class_counts` [N, C] float32, each client's training samples
  # per class (noised under DP-SGD: a private release); False: it is called without them.
  server_reads_class_counts: bool = False
  # What evaluation reads besides the client's model (the module docstring), declared by the
  # method (the class, or an instance from its config) and never found out by the engine:
  # - eval_reads_state: evaluation brings each client's persistent state to `eval_forward`,
  #   which the method overrides. False (the default): the family's apply alone, no state.
  # - eval_reads_server: a client's test results depend on the server's state (LG-FedAvg's
  #   global header, FedProto's prototypes), through the `eval_params`, `eval_forward` or
  #   `eval_extra` the method overrides. False (the default): they change only when the client
  #   trains, and the engine re-evaluates only the clients that trained since the last one.
  # - eval_server_in_extra: the server reaches the results through `eval_extra` alone (FedProto's
  #   nearest prototype); its inputs are kept, and an untrained client has only it run again.
  # - eval_server_header: through the header alone (`eval_header(server, client_id)` [C, d + 1]
  #   on the client's extractor, LG-FedAvg's H_g); an untrained client's comes from kept reps.
  eval_reads_state: bool = False
  eval_reads_server: bool = False
  eval_server_in_extra: bool = False
  eval_server_header: bool = False
  eval_metrics: tuple[str, ...] = ()  # names of the extra test metrics eval_extra counts
  headline_metric = 'accuracy'  # or one of eval_metrics, to report it as the accuracy
  # Client-level DP on the uploads (privacy.upload; docs/algorithm.md §11): the names of the
  # payload's fields that carry what the client computed from its data, which the engine clips
  # jointly (less `upload_reference`) and noises; the payload's other fields (class counts,
  # weights, which rows are sent) go as they are. () (the default): nothing to protect.
  private_upload: tuple[str, ...] = ()
  # Under DP-SGD (privacy.dp_sgd; docs/algorithm.md §11, "Private releases"), what the method
  # sends of the data beyond the steps, released privately by the engine (one release each
  # round a client takes part), else nothing traced: `release_values(self, logits, rep)` ->
  # [B, D], the per-example vectors it sends class means of (FD's logits, the prototypes' r),
  # summed per class over one forward pass (`forward_pass`, set by the method), each example's
  # row clipped, the table with its counts noised (to `upload` as `acc.forward_pass`, a noisy
  # ClassSums); `release_after_training`: the step after training's output, its
  # `private_upload` fields clipped jointly and noised (FedL2G's meta gradient).
  release_values: Callable | None = None
  release_after_training: bool = False
  # Where central client-level DP noises the round's sum of the clipped uploads (`central_noise`):
  # 'inbox', the server's `aggregation.Inbox`, in place; 'noise', a server field of the sum's
  # shape that `server_aggregate` adds to its own; None (the default): central mode is refused.
  central_noise_into: str | None = None

  def __init__(self, config, num_clients: int, num_classes: int,
               image_shape: Sequence[int] | None = None):
    """`config` must hold model.feature_dim (d; config_lib's configs do: a ConfigError
    otherwise). `image_shape`: the (height, width, channels) of the data set's images (None:
    CIFAR's, models.IMAGE_SHAPE), which a method's own models (FML's meme, ...) are built for."""
    if not isinstance(getattr(type(self), 'per_sample_loss', None), bool):
      raise TypeError(
          f'{type(self).__name__} must set the class attribute per_sample_loss = True or False: '
          'True when its loss is a mean of per-sample terms (a step\'s gradient may then be '
          'summed over micro-batches), False when it couples the samples of a batch '
          '(contrastive pairs, batch statistics), whose micro-batch gradients must not be '
          'summed.')
    # The same checks as config_lib.validate's, so that no method is built from a config that
    # cannot work, validated or not (tests and tools build methods directly).
    if self.config_section is not None:
      self.check_config(config[self.config_section])
    self.config = config
    self.num_clients = num_clients
    self.num_classes = num_classes
    self.feature_dim = models.feature_dim(config)  # d: the representation's width
    self.header_row = self.feature_dim + 1  # numbers in a header row (weights and bias)
    self.image_shape = tuple(models.IMAGE_SHAPE if image_shape is None else image_shape)

  # --- configuration ---------------------------------------------------------------------------
  @classmethod
  def default_config(cls) -> ml_collections.ConfigDict:
    """The fields of config.<config_section> and their defaults, each with a comment."""
    raise NotImplementedError(f'{cls.__name__} has no config section.')

  @classmethod
  def check_config(cls, section: ml_collections.ConfigDict) -> None:
    """Raises ValueError, naming the field and the values that work, for a value of
    config.<config_section> that cannot work. Builds nothing: it runs before any data loads."""

  # --- state ---------------------------------------------------------------------------------
  def init_server(self, key: jax.Array, seen: jax.Array) -> PyTree:
    """The server's initial state, a flax.struct dataclass of the method's own. `seen` is the
    static [N, C] seen-class mask (and, for a method declaring `server_reads_class_counts`, the
    keyword `class_counts` [N, C] the clients' class counts)."""
    return NoServer()

  def init_client_state(self, key: jax.Array) -> PyTree:
    """One client's persistent state beyond its own model, a flax.struct dataclass of the
    method's own (`NoState` when it keeps none; the engine vmaps this over N)."""
    return NoState()

  # --- client side (one client; vmapped by the engine) ---------------------------------------
  def download(self, params, state, server, client: ClientView) -> Download:
    """What the client holds before training: its model after the download, jointly trained
    extra models, the loss's constants, and the floats and FLOPs of the download."""
    return Download(params)

  def newcomer(self, params, state, server, client: ClientView) -> Download:
    """What a new client, one that never took part (config new_clients), receives before it
    trains for the first time: by default what a participant's `download` gives (FedProto's
    global prototypes, FD's global logits, LG-FedAvg's global header, nothing for Standalone).
    A method whose download mixes in what the client learned in earlier rounds overrides it
    (FedSSA: the whole global header). `params` and `state` are the client's initial ones;
    docs/algorithm.md §5 says what each method's newcomer receives."""
    return self.download(params, state, server, client)

  def init_acc(self) -> PyTree:
    """The zero accumulator of the per-step statistics the loss returns (e.g. FD's
    `ClassSums` of the logits), a flax.struct dataclass; None, the default: the loss sums
    nothing."""
    return None

  def loss(self, apply_fn: Callable, trainable: dict, ctx, views, y, valid):
    """The local objective on one batch. `trainable` is {'model': params, **aux}; `views` holds
    `num_views` augmented copies of the batch [B, H, W, C]; `valid` [B] masks padding. A method
    declaring `loss_draws` takes the keyword `key` too, the step's own.
    Returns (loss, (correct, accumulator update of init_acc's type))."""
    loss, correct = losses.cross_entropy_loss(apply_fn, trainable['model'], views[0], y, valid)
    return loss, (correct, None)

  def forward_pass_stats(self, logits, rep, y, valid, pos=None, width=None) -> PyTree:
    """What the forward pass (`forward_pass`) sums over a batch of the training split: by
    default the V1 `ClassSums` of the representation r. `pos` and `width`: with
    `forward_pass_rows`, the batch's positions in the training row and its width."""
    del pos, width
    return class_sums(rep, y, valid, self.num_classes)

  def trains(self, round_index):
    """Whether the round's participants run local training (a bool, or a traced bool scalar of
    `round_index`): False runs no step (the loops see zero samples), though download, the step
    after training and upload still run. The default, True, traces nothing."""
    del round_index
    return True

  def upload(self, trainable: dict, acc: Accumulated, ctx, state,
             client: ClientView) -> Upload:
    """After training: the model the client keeps, its persistent state, what the server
    receives, and the floats and FLOPs of the upload. `acc` holds what the round accumulated
    (the loss's sums, the forward pass's, the step after training's output)."""
    return Upload(trainable['model'], state)

  def upload_reference(self, server, down: Download, client: ClientView):
    """What the client's `private_upload` fields are clipped and noised around: a dict of
    them holding values the server already knows (the global model the client downloaded), so
    that the clip bounds what training changed; None (the default): zero, the values themselves
    are clipped."""
    del server, down, client
    return None

  @classmethod
  def upload_refusal(cls, config, mode: str) -> str | None:
    """Why the method cannot take client-level DP on its uploads in `mode`
    (privacy.upload_mode), a clause that follows the method's name ("fml's ..."); None where it
    can. 'central' needs a server that noises one sum of the clipped uploads
    (`central_noise_into`); an override adds the method's own conditions and ends with this."""
    del config
    if not cls.private_upload:
      return 'clients send nothing to protect'
    if mode == 'central' and cls.central_noise_into is None:
      return 'server keeps each upload apart, not one sum of them that noise could cover'
    return None

  @classmethod
  def dp_sgd_refusal(cls, config) -> str | None:
    """Why the method cannot run under DP-SGD (privacy.dp_sgd) with `config`: a clause that
    says what it would send of the data that no private release bounds; None (the default)
    where every upload is covered (by the steps, or by `release_values`' releases)."""
    del config
    return None

  def central_noise(self, server, key: jax.Array, std: float):
    """Central client-level DP: the server state with N(0, std^2) noise from `key` added to the
    round's sum of the clipped uploads, before `server_aggregate`, whose mean then divides by a
    count that reveals nothing of who took part. Where the noise goes is `central_noise_into`."""
    if self.central_noise_into == 'inbox':
      return server.replace(inbox=server.inbox.noised(key, std))
    if self.central_noise_into == 'noise':
      return server.replace(noise=std * jax.random.normal(key, server.noise.shape))
    raise NotImplementedError(f'{type(self).__name__} does not noise its uploads centrally.')

  def eval_params(self, params, server, client_id):
    """The parameters a client is evaluated with (its personalised model; under
    `eval_server_header`, with `eval_header`'s rows as header). An override reading the server
    declares `eval_reads_server`."""
    if self.eval_server_header:
      return models.with_header_rows(params, self.eval_header(server, client_id))
    return params

  def eval_forward(self, apply_fn: Callable, params, state, server, client_id, x):
    """The evaluated prediction on one normalised test batch `x` [B, H, W, C]: (logits [B, C],
    representation [B, d]), both float32. `apply_fn` is the client's family's (forward-only)
    apply, `params` what `eval_params` returned, `state` the client's persistent state
    (`init_client_state`'s structure). The representation is what `eval_extra` and the saved
    test representations see. By default the client's model alone; evaluation calls an
    override only where the method declares `eval_reads_state` (and `eval_reads_server` if it
    reads the server)."""
    del state, server, client_id
    return apply_fn({'params': params}, x)

  def eval_extra(self, server, client_id, logits, rep, y, valid) -> dict:
    """Extra per-client test metrics as int32 correct counts named `eval_metrics`, e.g.
    FedProto's nearest-prototype accuracy. Reported as accuracies per client. An override that
    reads the server declares `eval_reads_server`."""
    return {}

  # --- server side -----------------------------------------------------------------------------
  def server_receive(self, server, client_ids, payloads, active):
    """Stores one chunk's uploads. `active` is False for padding (dummy) clients."""
    return server

  def server_aggregate(self, server, participants, round_index, key) -> Aggregated:
    """The server rule, once per round. `participants` is an [N] bool mask of this round;
    `key` is the round's own key of the server (engine.STREAM_AGGREGATE), for a rule that
    draws. Returns the new state, with the server's FLOPs and diagnostics of the round."""
    return Aggregated(server)

  # --- accounting (host side) ------------------------------------------------------------------
  def train_flops_per_sample(self, own: float, flops_of: Callable[[str], float]) -> float:
    """Training FLOPs per processed sample, given the client's own model's (`own`);
    `flops_of(family)` gives another family's, e.g. for a jointly trained CNN-5."""
    return own

  # --- diagnostics ------------------------------------------------------------------------------
  def trained_norms(self, params, seen) -> Norms:
    """After local training, the norms of a client's model (`params`, the model it keeps; `seen`
    [C] its classes) that the round reports. By default those of its seen-class header rows
    (weights and bias), whose growth shows a header blowing up (FedSSA's `reference` fusion).
    The engine vmaps it over a chunk's clients."""
    norms = jnp.linalg.norm(models.header_rows(params), axis=-1)
    return Norms(max=jnp.where(seen, norms, 0.0).max(), sum=jnp.where(seen, norms, 0.0).sum(),
                 count=seen.sum())
