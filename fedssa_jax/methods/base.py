"""The interface every federated method implements, and that the engine drives
(docs/algorithm.md §9, "Adding a method").

A round, as the engine runs it (engine.py), for each sampled client k (vmapped within a chunk of
one model family) and then once on the server:

    v        = ClientView(id=k, seen=S_k, num_samples=n_k, round=t)
    d        = method.download(params_k, state_k, server, v)                  # Download
    trained  = local training of {'model': d.params, **d.aux} with method.loss(..., d.ctx, ...),
               summing the loss's per-step statistics into an accumulator (method.init_acc())
    [acc     = {**acc, FORWARD_PASS: forward pass sums}    # only with method.forward_pass set]
    [acc     = {**acc, AFTER_TRAINING: method.after_training(...)}  # only where it is defined]
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
  mentee): every top-level entry of {'model': ..., **aux} gets its own optimizer state.
- `d.ctx` holds constants of the round's loss (global logits, prototypes, the global header).
- The floats each side sends are counted where the exchange happens (`Download.floats`,
  `Upload.floats`), as are client FLOPs beyond the training steps (`.flops`), and the server's
  FLOPs and diagnostics of the round (`Aggregated.flops`, `.metrics`).
- `method.forward_pass` ('before' or 'after'; None, the default, runs none) asks for one more
  pass over the client's training split, before local training (on d.params) or after it (on
  the trained model): a forward of the model as evaluated (unaugmented, eval-size batches, no
  gradient; training.forward_pass_sums) summing `method.forward_pass_stats(logits, rep, y,
  valid)`, by default V1 class sums of r (FedGH's and FedTGP's prototypes).
  Its sums reach `upload` in the accumulator, under the key FORWARD_PASS (init_acc is then a
  dict), and its FLOPs (a forward over n_k samples) count as the client's extra FLOPs.
- `method.held_out_samples` Q (0 by default) holds positions 0..Q-1 of the client's training
  index row out of local training for good (FedL2G's quiz set): training sees positions
  Q..n_k-1, n_k - Q samples. `method.trains(t)` (True by default) is False in a round whose
  clients run no training step (FedL2G's warm-up). With the defaults nothing of either is traced.
- `method.after_training` (None by default: nothing traced), a step after local training with
  gradients and data (FedL2G's meta step): the engine calls
  `after_training(apply_fn, trainable, ctx, study, quiz, client)` on the trained model with a
  study batch (B samples of the trainable split, drawn with the client's key of
  STREAM_STUDY) and the held-out quiz set, each (x, y, valid), normalised and unaugmented. Its
  output reaches `upload` in the accumulator under the key AFTER_TRAINING, and its FLOPs
  (`after_training_steps` training steps per study and per quiz sample) count as the client's
  extra FLOPs.
- The server state is a flax.struct dataclass of the method's own (one per method, with named
  fields; `NoServer` when it keeps none); whole uploads it sums as they arrive go in an `Inbox`.

Evaluation (evaluation.py), for each evaluated client k and each of its test batches x:

    p              = method.eval_params(params_k, server, k)                # once per client
    logits, rep    = method.eval_forward(apply_fn, p, state_k, server, k, x)  # per batch
    extra counts   = method.eval_extra(server, k, logits, rep, y, valid)

- `eval_forward` is optional: by default it is the family's `apply_fn` on `p` (the client's
  model, its header maybe replaced by `eval_params`), and evaluation then runs exactly that,
  without reading the client state. A method that predicts through more than the client's model
  (FedMRL: its projector J_k in `state_k` and the server's shared model) overrides it;
  evaluation then brings each evaluated client's `state_k` to the call (`eval_reads_state`).

Everything runs under jit: the client hooks on one client (the engine vmaps them), the server
hooks on the whole population. Server and client states are pytrees of arrays, so they can be
checkpointed and sharded.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import struct

from fedssa_jax import models
from fedssa_jax.methods import losses
from fedssa_jax.types import PyTree

# numpy, not jax: importing a method must not start a backend (jax.distributed comes first).
ZERO_I = np.zeros((), np.int32)
ZERO_F = np.zeros((), np.float32)


class Download(NamedTuple):
  params: PyTree          # the client's own model after the download (e.g. fused header)
  aux: dict = {}          # extra trainable models, trained jointly with `params`
  ctx: PyTree = ()        # constants of the local loss
  floats: jax.Array = ZERO_I  # floats received
  flops: jax.Array = ZERO_F   # client FLOPs spent on the download (e.g. fusion)


class Upload(NamedTuple):
  params: PyTree          # the client's own model, as it keeps it
  state: PyTree = {}      # the client's persistent state
  payload: PyTree = {}    # what the server receives
  floats: jax.Array = ZERO_I  # floats sent
  flops: jax.Array = ZERO_F   # client FLOPs spent on the upload (e.g. FedKD's SVDs)


class Aggregated(NamedTuple):
  server: PyTree              # the server state after the round's rule
  flops: jax.Array = ZERO_F   # server FLOPs spent this round
  metrics: dict = {}          # scalar diagnostics of the round (e.g. a server-side loss)


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


# The key of the accumulator under which `upload` receives the forward pass's sums
# (Method.forward_pass).
FORWARD_PASS = 'forward_pass'
FORWARD_PASS_TIMES = ('before', 'after')  # Method.forward_pass: around local training
# The key of the accumulator under which `upload` receives Method.after_training's output.
AFTER_TRAINING = 'after_training'


def empty_class_sums(num_classes: int, dim: int) -> dict:
  """The zero accumulator of `class_sums` for [C, dim] values (a method's init_acc)."""
  return {'sum': jnp.zeros((num_classes, dim), jnp.float32),
          'count': jnp.zeros((num_classes,), jnp.float32)}


def class_sums(values, y, valid, num_classes):
  """Per-class sums and counts of `values` [B, D] (algorithm.md §6 V1: a one-hot matmul)."""
  onehot = jax.nn.one_hot(y, num_classes, dtype=values.dtype) * valid[:, None]
  return {'sum': onehot.T @ values, 'count': onehot.sum(axis=0)}


def class_means(acc, seen):
  """The per-class means [C, D] of the sums `class_sums` accumulated over a client's training,
  zero for a class it does not hold; and which classes it holds [C] (seen and trained on).

  What FD (mean logits) and FedProto (prototypes) upload: the rows of unheld classes are zeroed
  so that an upload carries nothing about classes the client never saw."""
  held = seen & (acc['count'] > 0)  # = S_k for any client that trained
  means = acc['sum'] / jnp.maximum(acc['count'], 1.0)[:, None]
  return jnp.where(held[:, None], means, 0.0), held


def masked_sum(uploads, mask, weights=None):
  """The sum of uploads [N, C, D] over clients where mask [N, C], and its total weight [C].

  `mask` may also hold non-negative per-(client, class) weights (e.g. class sample counts);
  `weights` [N] (e.g. sample counts) weights whole clients. For a server that keeps the sums
  rather than masked_mean's quotient: FD, which subtracts a client's own upload from them."""
  w = mask.astype(uploads.dtype)
  if weights is not None:
    w = w * weights[:, None]
  return jnp.einsum('nc,ncd->cd', w, uploads), w.sum(axis=0)


def masked_mean(uploads, mask, weights=None):
  """Spec V2: the mean of uploads [N, C, D] over clients where mask [N, C]; and whether any.

  `mask` and `weights` as in masked_sum."""
  total_sum, total = masked_sum(uploads, mask, weights)
  return total_sum / jnp.where(total > 0, total, 1.0)[:, None], total > 0


@struct.dataclass
class Inbox:
  """Where a server collects a round's whole uploads (FML's memes, FedKD's updates, the
  LG-FedAvg and FedClassAvg headers): summed in server_receive as chunks arrive, so no [N, ...]
  table of whole models is kept, and divided once in server_aggregate. A field of the method's
  server state.

  Each upload counts 1 (an int32 count; `weighted` False) or its own float weight (e.g. n_k;
  `weighted` True). The two kinds keep their own sums (a masked sum, or a weighted contraction):
  either is the arithmetic the methods' results were made with."""
  sum: PyTree        # the sum of the round's uploads (a pytree shaped like one upload) ...
  weight: jax.Array  # ... and of their weights (int32 count, or float32 total weight)
  weighted: bool = struct.field(pytree_node=False, default=False)

  @classmethod
  def empty(cls, like, weighted: bool = False) -> Inbox:
    """An empty inbox for uploads shaped like `like` (a pytree)."""
    return cls(jax.tree_util.tree_map(jnp.zeros_like, like),
               jnp.zeros((), jnp.float32 if weighted else jnp.int32), weighted)

  def cleared(self) -> Inbox:
    """An empty inbox of the same kind and shapes (for the next round)."""
    return Inbox.empty(self.sum, self.weighted)

  def add(self, payloads, active, weights=None) -> Inbox:
    """Adds a chunk's uploads (leading axis), of its active clients; `weights` [chunk] are the
    uploads' weights (a weighted inbox only)."""
    if self.weighted:
      w = jnp.where(active, weights, 0.0)
      chunk_sum = jax.tree_util.tree_map(lambda a: jnp.tensordot(w, a, axes=1), payloads)
    else:
      chunk_sum = jax.tree_util.tree_map(
          lambda a: jnp.where(active.reshape((-1,) + (1,) * (a.ndim - 1)), a, 0).sum(axis=0),
          payloads)
    chunk_weight = w.sum() if self.weighted else active.sum(dtype=jnp.int32)
    return self.replace(sum=jax.tree_util.tree_map(jnp.add, self.sum, chunk_sum),
                        weight=self.weight + chunk_weight)

  def mean(self):
    """(the (weighted) mean of the round's uploads, whether any arrived)."""
    total = self.weight
    mean = jax.tree_util.tree_map(lambda s: s / jnp.where(total > 0, total, 1.0), self.sum)
    return mean, total > 0


def store_rows(table, client_ids, rows, active):
  """Writes each active client's row into `table` [N, ...]; padding (dummy) clients are dropped."""
  ids = jnp.where(active, client_ids, table.shape[0])
  return table.at[ids].set(rows, mode='drop')


def train_on_pairs(params, loss_fn: Callable, tx, values, labels, weights, key, *,
                   epochs: int, batch_size: int):
  """Server-side training on a round's (value, label) pairs, under jit: FedGH's header,
  FedTGP's prototype generator.

  `values` [M, D], `labels` [M] and `weights` [M] (> 0 on the M' valid pairs, 0 elsewhere)
  hold a fixed-shape table of pairs. Each of `epochs` epochs orders them by
  argsort(where(valid, uniform(fold_in(key, epoch)), +inf)), the valid pairs first in a random
  order, and runs ceil(M' / batch_size) steps (a while_loop: the count is dynamic) on batches of
  `batch_size` consecutive pairs, the last one partial; padding positions get weight 0. A step
  is one update of the optax transformation `tx` (its state fresh here) with the gradient of
  `loss_fn(params, x [b, D], y [b], w [b])`, a scalar (a weighted mean over the batch).

  Returns (params, the sum of the steps' losses, the number of steps)."""
  m = values.shape[0]
  padded = -(-m // batch_size) * batch_size
  valid = weights > 0
  count = valid.sum()
  num_steps = (count + batch_size - 1) // batch_size
  grad_fn = jax.value_and_grad(loss_fn)

  def epoch(e, carry):
    r = jax.random.uniform(jax.random.fold_in(key, e), (m,))
    order = jnp.pad(jnp.argsort(jnp.where(valid, r, jnp.inf)), (0, padded - m))

    def step(inner):
      j, params, opt_state, loss_sum = inner
      pos = j * batch_size + jnp.arange(batch_size)
      idx = jax.lax.dynamic_slice(order, (j * batch_size,), (batch_size,))
      w = jnp.where(pos < count, weights[idx], 0.0)
      loss, grads = grad_fn(params, values[idx], labels[idx], w)
      updates, opt_state = tx.update(grads, opt_state, params)
      return j + 1, optax.apply_updates(params, updates), opt_state, loss_sum + loss

    _, params, opt_state, loss_sum = jax.lax.while_loop(
        lambda inner: inner[0] < num_steps, step, (jnp.zeros((), jnp.int32), *carry))
    return params, opt_state, loss_sum

  params, _, loss_sum = jax.lax.fori_loop(
      0, epochs, epoch, (params, tx.init(params), jnp.zeros((), jnp.float32)))
  return params, loss_sum, epochs * num_steps



# --- The trained clients' norms: a diagnostic any method may fill (Method.trained_norms) --------
@struct.dataclass
class Norms:
  """Norms of one trained client's model that its round reports (the record's
  header_norm_max and header_norm_mean: the largest over the participants, and the mean over
  all their norms): their largest, their sum and how many."""
  max: jax.Array
  sum: jax.Array
  count: jax.Array

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
  # A forward pass over the client's training split around local training (the module
  # docstring; FORWARD_PASS_TIMES): 'before' it, 'after' it, or None (the default: no pass, no
  # extra work). A method may set it per instance, from its config.
  forward_pass: str | None = None
  # The first `held_out_samples` positions of each client's training index row are never
  # trained on (the module docstring): 0, the default, holds none out.
  held_out_samples: int = 0
  # A step after local training with gradients and data (the module docstring): None, the
  # default, runs none. A method defines it as a method
  #   after_training(self, apply_fn, trainable, ctx, study, quiz, client) -> PyTree
  # on the trained `trainable` ({'model': params, **aux}), with the differentiable `apply_fn`
  # of the client's model, the loss's `ctx`, a study batch and the quiz set, each (x [b, H,
  # W, C], y [b], valid [b]); `upload` finds its output in the accumulator under
  # AFTER_TRAINING. `after_training_steps`: its FLOPs, in CE training steps of the client's own
  # model per (study sample, quiz sample).
  after_training: Callable | None = None
  after_training_steps: tuple[float, float] = (0.0, 0.0)

  def __init__(self, config, num_clients: int, num_classes: int,
               image_shape: Sequence[int] | None = None):
    """`image_shape`: the (height, width, channels) of the data set's images (None: CIFAR's,
    models.IMAGE_SHAPE), which a method's own models (FML's meme, ...) are built for."""
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
    static [N, C] seen-class mask."""
    return NoServer()

  def init_client_state(self, key: jax.Array) -> PyTree:
    """One client's persistent state beyond its own model (the engine vmaps this over N)."""
    return {}

  # --- client side (one client; vmapped by the engine) ---------------------------------------
  def download(self, params, state, server, client: ClientView) -> Download:
    """What the client holds before training: its model after the download, jointly trained
    extra models, the loss's constants, and the floats and FLOPs of the download."""
    return Download(params)

  def init_acc(self) -> PyTree:
    """The accumulator of per-step statistics the loss returns (e.g. per-class logit sums)."""
    return {}

  def loss(self, apply_fn: Callable, trainable: dict, ctx, views, y, valid):
    """The local objective on one batch. `trainable` is {'model': params, **aux}; `views` holds
    `num_views` augmented copies of the batch [B, H, W, C]; `valid` [B] masks padding.
    Returns (loss, (correct, accumulator update))."""
    loss, correct = losses.cross_entropy_loss(apply_fn, trainable['model'], views[0], y, valid)
    return loss, (correct, {})

  def forward_pass_stats(self, logits, rep, y, valid) -> PyTree:
    """What the forward pass (`forward_pass`) sums over a batch of the training split: by
    default the V1 class sums of the representation r."""
    return class_sums(rep, y, valid, self.num_classes)

  def trains(self, round_index):
    """Whether the round's participants run local training (a bool, or a traced bool scalar of
    `round_index`): False runs no step (the loops see zero samples), though download, the step
    after training and upload still run. The default, True, traces nothing."""
    del round_index
    return True

  def upload(self, trainable: dict, acc, ctx, state, client: ClientView) -> Upload:
    """After training: the model the client keeps, its persistent state, what the server
    receives, and the floats and FLOPs of the upload."""
    return Upload(trainable['model'], state)

  def eval_params(self, params, server, client_id):
    """The parameters a client is evaluated with (its current personalised model)."""
    return params

  def eval_forward(self, apply_fn: Callable, params, state, server, client_id, x):
    """The evaluated prediction on one normalised test batch `x` [B, H, W, C]: (logits [B, C],
    representation [B, 500]), both float32. `apply_fn` is the client's family's (forward-only)
    apply, `params` what `eval_params` returned, `state` the client's persistent state
    (`init_client_state`'s structure). The representation is what `eval_extra` and the saved
    test representations see. By default the client's model alone; a method overriding this
    reads its client state (`eval_reads_state`) and, by default, the server's."""
    del state, server, client_id
    return apply_fn({'params': params}, x)

  @property
  def eval_reads_state(self) -> bool:
    """Whether evaluation needs each client's persistent state: whether `eval_forward` is
    overridden. If not, evaluation runs the family's apply alone and never reads the state."""
    return type(self).eval_forward is not Method.eval_forward

  eval_metrics: tuple[str, ...] = ()  # names of the extra test metrics eval_extra counts
  headline_metric = 'accuracy'  # or one of eval_metrics, to report it as the accuracy

  @property
  def eval_reads_server(self) -> bool:
    """Whether a client's test results depend on the server's state (LG-FedAvg's global header,
    FedProto's prototypes). If not, they change only when the client trains, and the engine
    re-evaluates only the clients that trained since the last evaluation. By default: whether
    `eval_params`, `eval_forward` or `eval_extra` is overridden."""
    cls = type(self)
    return (cls.eval_params is not Method.eval_params or cls.eval_extra is not Method.eval_extra
            or cls.eval_forward is not Method.eval_forward)

  def eval_extra(self, server, client_id, logits, rep, y, valid) -> dict:
    """Extra per-client test metrics as int32 correct counts named `eval_metrics`, e.g.
    FedProto's nearest-prototype accuracy. Reported as accuracies per client."""
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
