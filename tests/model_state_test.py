"""Model state (batch statistics) in local training: stored in the client's row beside its
parameters (models.MODEL_STATE), updated by training-mode forwards over the valid rows only, the
whole batch in one pass whatever the micro-batch, untouched by the optimizer, the same vmapped
as one client at a time, and read (not updated) by evaluation's forward."""
import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, models
from fedssa_jax.data import augment
from fedssa_jax.data.partition import DeviceData
from fedssa_jax.engine import snapshots, training
from fedssa_jax.methods import standalone
from fedssa_jax.run import checkpoint

from conftest import make_small_sim, params_of

SIZES = [5, 13, 0]  # uneven clients (13: a partial second batch of 8), one empty (a dummy)
B = 8


class TinyBN(nn.Module):
  """conv 3x3 -> batch norm -> ReLU -> mean pool -> fc3: the smallest model with statistics."""
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    x = nn.Conv(4, (3, 3), strides=(4, 4), name='conv')(x)
    bn_mask = None if mask is None else mask[:, None, None, None]
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9, name='bn')(x, mask=bn_mask)
    rep = nn.relu(x).mean(axis=(1, 2))
    return nn.Dense(self.num_classes, name='fc3')(rep), rep


MODEL = models.StatefulModel(TinyBN())


def setup(ds, cfg):
  idx = np.zeros((len(SIZES), max(SIZES)), np.int32)
  for c, n in enumerate(SIZES):
    idx[c, :n] = np.arange(n) * 3 + c
  dd = DeviceData(jnp.asarray(ds.images), jnp.asarray(ds.labels), jnp.asarray(idx),
                         jnp.asarray(SIZES), jnp.asarray(idx), jnp.asarray(SIZES))
  rows = jax.vmap(functools.partial(models.init_params, MODEL))(
      jax.random.split(jax.random.PRNGKey(0), len(SIZES)))
  keys = jax.random.split(jax.random.PRNGKey(1), len(SIZES))
  method = standalone.Standalone(config_lib.base_config('cifar10'), len(SIZES), 10)

  def train(row, key, idx, n):
    trainable, _, stats = training.local_train(
        {'model': row}, (), key, idx, n, dd, apply_fn=MODEL.apply, cfg=cfg, method=method,
        train_apply=MODEL.train_apply)
    return trainable['model'], stats
  return dd, rows, keys, train


def test_rows_hold_the_statistics_beside_the_parameters():
  row = models.init_params(MODEL, jax.random.PRNGKey(0))
  params, state = models.split_state(row)
  assert set(row) == {'conv', 'bn', 'fc3', models.MODEL_STATE}
  assert set(params) == {'conv', 'bn', 'fc3'}
  np.testing.assert_array_equal(state['bn']['mean'], np.zeros(4))
  np.testing.assert_array_equal(state['bn']['var'], np.ones(4))
  assert models.join_state(params, state).keys() == row.keys()
  assert models.param_count(row) == 3 * 3 * 3 * 4 + 4 + 2 * 4 + 4 * 10 + 10  # no statistic
  # A row without statistics (the five CNNs) is its parameters.
  assert models.split_state(params) == (params, None) and models.join_state(params, None) is params


@pytest.mark.slow  # local training compiled, vmapped and per client
def test_statistics_train_over_valid_rows_vmapped_as_alone_and_in_one_pass(small_ds):
  cfg = training.TrainConfig(batch_size=B, local_epochs=1, lr=0.05, augment=False)
  dd, rows, keys, train = setup(small_ds, cfg)
  vm_rows, vm_stats = jax.jit(jax.vmap(train))(rows, keys, dd.train_idx, dd.train_n)
  one = jax.jit(train)
  for c, n in enumerate(SIZES):
    row_c = jax.tree.map(lambda a: a[c], rows)
    single, stats = one(row_c, keys[c], dd.train_idx[c], dd.train_n[c])
    jax.tree.map(lambda v, s: np.testing.assert_allclose(v[c], s, rtol=2e-5, atol=1e-6),
                 vm_rows, single)
    assert int(vm_stats.steps[c]) == int(stats.steps) == -(-n // B)
  # The dummy client is unchanged, its statistics too.
  jax.tree.map(lambda v, r: np.testing.assert_array_equal(v[2], r[2]), vm_rows, rows)

  # Client 0's one step (5 valid rows of 8): the running statistics are those of its 5 rows'
  # convolution outputs under the initial parameters (momentum 0.9, Flax's biased variance),
  # however the batch's rows are ordered; the padding rows count in none.
  params, state = models.split_state(jax.tree.map(lambda a: a[0], rows))
  x = augment.normalize(dd.images[dd.train_idx[0, :5]], cfg.mean, cfg.std)
  conv = np.asarray(nn.Conv(4, (3, 3), strides=(4, 4)).apply({'params': params['conv']}, x),
                    np.float64).reshape(-1, 4)
  new_state = models.split_state(jax.tree.map(lambda a: a[0], vm_rows))[1]['bn']
  np.testing.assert_allclose(new_state['mean'], 0.1 * conv.mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new_state['var'], 0.9 + 0.1 * conv.var(0), rtol=1e-5)

  # Micro-batches of 4 rows would split the batch's statistics: a model with statistics trains
  # each batch in one pass, so the run is the same.
  micro = dataclasses.replace(cfg, micro_batch=4)
  _, _, _, train_micro = setup(small_ds, micro)
  micro_rows, _ = jax.jit(jax.vmap(train_micro))(rows, keys, dd.train_idx, dd.train_n)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), micro_rows, vm_rows)


def test_evaluation_reads_the_running_statistics_and_changes_none(small_ds):
  row = models.init_params(MODEL, jax.random.PRNGKey(0))
  params, state = models.split_state(row)
  state = jax.tree.map(lambda a: a + 0.5, state)  # statistics of some training
  x = jnp.asarray(small_ds.images[:4], jnp.float32) / 255.0
  logits, rep = MODEL.apply({'params': models.join_state(params, state)}, x)
  want = TinyBN().apply({'params': params, 'batch_stats': state}, x, train=False)
  np.testing.assert_allclose(logits, want[0], rtol=1e-6)
  # By hand: (conv - mean) / sqrt(var + eps), the scale 1 and bias 0 of a fresh layer.
  conv = nn.Conv(4, (3, 3), strides=(4, 4)).apply({'params': params['conv']}, x)
  hand = np.maximum((conv - state['bn']['mean']) / np.sqrt(state['bn']['var'] + 1e-5), 0)
  np.testing.assert_allclose(rep, hand.mean(axis=(1, 2)), rtol=1e-5, atol=1e-6)



def test_the_step_after_training_sees_parameters_and_reads_the_statistics(small_ds):
  """client.after_training (FedL2G's meta step) differentiates the parameters alone; the model
  it calls normalises with the row's running statistics."""
  row = models.init_params(MODEL, jax.random.PRNGKey(0))
  params, state = models.split_state(row)
  state = jax.tree.map(lambda a: a + 0.5, state)
  seen = {}

  class Probe:
    held_out_samples = 2

    def after_training(self, apply_fn, trainable, ctx, study, quiz, view):
      seen['keys'] = set(trainable['model'])
      loss = lambda p: apply_fn({'params': p}, study[0])[0].sum()
      seen['logits'], seen['x'] = apply_fn({'params': trainable['model']}, study[0])[0], study[0]
      return jax.grad(loss)(trainable['model'])

  cfg = training.TrainConfig(batch_size=4, augment=False)
  dd = DeviceData(jnp.asarray(small_ds.images), jnp.asarray(small_ds.labels),
                         None, None, None, None)
  grad, _, _ = training.after_training(
      {'model': models.join_state(params, state)}, (), jax.random.PRNGKey(1),
      jnp.arange(10, dtype=jnp.int32), jnp.asarray(10), dd, None, apply_fn=MODEL.apply,
      cfg=cfg, method=Probe())
  assert seen['keys'] == set(grad) == {'conv', 'bn', 'fc3'}
  want = TinyBN().apply({'params': params, 'batch_stats': state}, seen['x'], train=False)[0]
  np.testing.assert_allclose(seen['logits'], want, rtol=1e-5, atol=1e-6)


# -- Through the engine: a mixed group (CNN-5 and HtFLlib's ResNet-4) --------------------------

def mixed_sim(ds, method, workdir=None, **more):
  """5 clients, CNN-5 and ResNet-4 alternately, every client each round, d = 512."""
  return make_small_sim(ds, method, workdir, **more, **{
                            'model.families': ('cnn5', 'resnet4'),
                            'model.feature_dim': 512, 'participation': 1.0,
                            'batch_size': 8, 'eval_batch_size': 8})


@pytest.fixture(scope='module')
def mixed_runs(few_images, tmp_path_factory):
  """Two rounds of FedSSA uninterrupted, and round 2 again in a new simulator resumed from a
  checkpoint of round 1: every client's row (host copies) initially and after each round, the
  rounds' infos, the evaluation after round 2, and the resumed round's rows and info."""
  sim = mixed_sim(few_images, 'fedssa')
  host_rows = lambda s: [params_of(sim, s.population.params, k) for k in range(sim.num_clients)]
  state = sim.init_state()
  rows, infos = [host_rows(state)], []
  for i in range(2):
    state, (info,) = sim.run_round(state)
    rows.append(host_rows(state))
    infos.append(info)
    if i == 0:
      saved = snapshots.saved(sim.store, state)  # host copies: the next round donates the state
  evaluation = sim.evaluate(state)
  ckpts = checkpoint.Checkpointer(str(tmp_path_factory.mktemp('ckpt')))
  ckpts.save(saved, {}, {})
  again = mixed_sim(few_images, 'fedssa')
  restored = snapshots.stacked(again.store, [ckpts.restore_latest(template=saved).state])
  ckpts.close()
  resumed, (resumed_info,) = again.run_round(restored)
  return dict(sim=sim, rows=rows, infos=infos, evaluation=evaluation,
              resumed_rows=[params_of(again, resumed.population.params, k)
                            for k in range(sim.num_clients)],
              resumed_info=resumed_info)


@pytest.mark.slow  # two simulators of two families, compiled and run
def test_mixed_group_trains_the_statistics_of_its_participants(mixed_runs):
  sim, rows, infos = mixed_runs['sim'], mixed_runs['rows'], mixed_runs['infos']
  resnet = [g.family for g in sim.groups].index('resnet4')
  assert isinstance(sim.groups[resnet].model, models.StatefulModel)
  for k in range(sim.num_clients):
    before, after = rows[0][k], rows[1][k]
    assert after['fc3']['kernel'].shape == (512, 10)  # d = 512 for both families
    stats = models.split_state(after)[1]
    if sim.group_of[k] == resnet:  # trained: each layer's statistics left their initial 0 and 1
      for new, old in zip(jax.tree.leaves(stats), jax.tree.leaves(models.split_state(before)[1])):
        assert not np.allclose(new, old), k
    else:
      assert stats is None
  assert all(np.isfinite(i.train_loss) and i.train_samples.sum() > 0 for i in infos)
  # Evaluation reads the statistics: every client gets an accuracy.
  ev = mixed_runs['evaluation']
  assert np.all(np.isfinite(ev.accuracy)) and np.all(ev.count > 0)


@pytest.mark.slow
def test_mixed_group_resumes_to_the_uninterrupted_run(mixed_runs):
  for resumed, uninterrupted in zip(mixed_runs['resumed_rows'], mixed_runs['rows'][2]):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 resumed, uninterrupted)
  info, want = mixed_runs['resumed_info'], mixed_runs['infos'][1]
  np.testing.assert_allclose(info.train_loss_sum, want.train_loss_sum, rtol=1e-5)
  np.testing.assert_array_equal(info.client_up_floats, want.client_up_floats)


# The methods whose server works on representations or a generator (the prototype methods, and
# FedGen's header and generator): one round each on a mixed group, d = 512 as HtFLlib's model
# groups have it, each with what the round must leave on its server.
REPRESENTATION_METHODS = ('fedproto', 'fedsa', 'fedorgp', 'fedgen')


@pytest.mark.slow  # a simulator of two families, compiled and run, a method each
@pytest.mark.parametrize('method', REPRESENTATION_METHODS)
def test_a_representation_methods_round_on_a_mixed_group(few_images, method):
  """The method's uploads from both families, 512 wide, reach its server; its evaluation
  (classifier, and the nearest prototype where the method logs it) goes through the ResNet's
  running statistics."""
  sim = mixed_sim(few_images, method)
  state, (info,) = sim.run_round(sim.init_state())
  assert np.isfinite(info.train_loss) and info.train_samples.sum() > 0
  seen = sim.seen[0][info.cohort].sum(1)
  server = state.server
  if method == 'fedgen':  # the headers (d + 1 a row) of every class
    np.testing.assert_array_equal(info.client_up_floats, 513 * sim.num_classes)
    assert server.global_header.shape[-1] == 513
    assert np.all(np.isfinite(np.asarray(server.global_header)))
  else:  # a 512-d prototype per held class
    np.testing.assert_array_equal(info.client_up_floats, 512 * seen)
    assert server.protos.shape[-1] == 512 and bool(np.all(server.avail))
    assert np.all(np.isfinite(np.asarray(server.protos)))
  ev = sim.evaluate(state)
  assert np.all(np.isfinite(ev.accuracy))
  assert set(ev.metrics) == set(sim.method.eval_metrics)
  if method in ('fedproto', 'fedsa'):
    assert set(ev.metrics) == {'prototype_accuracy'}


@pytest.mark.slow  # a third simulator
def test_mixed_group_on_the_disk_store_equals_the_device_store(few_images, mixed_runs, tmp_path):
  """The batch statistics live in the disk store's row files as the parameters do: two rounds
  give every client's row of the device store's run."""
  sim = mixed_sim(few_images, 'fedssa', str(tmp_path), population_store='disk')
  state = sim.init_state()
  for _ in range(2):
    state, _ = sim.run_round(state)
  params = snapshots.seed_state(sim.store, state).population.params  # every row, read
  for k in range(sim.num_clients):
    g, slot = sim.group_of[k], sim.slot_of[k]
    row = jax.tree.map(lambda a: a[slot], params[g])
    if g == [x.family for x in sim.groups].index('resnet4'):
      assert models.split_state(row)[1] is not None
    # Another program (the store's gather and scatter around the same step): float rounding,
    # grown through two rounds of batch norms on batches of a few images; an element near 0
    # carries the rounding of its array's larger ones (XLA:CPU's at the tests' optimisation
    # level moves with the order of a program's operations and outputs).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=1e-3, atol=max(1e-6, 1e-4 * float(np.abs(b).max()))), row,
        mixed_runs['rows'][2][k])
