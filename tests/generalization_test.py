"""The lens beyond the mean local accuracy (docs/algorithm.md §5): the spread, the worst decile
and the per-family means of a record; the global test sample; the new clients, who never train
and are tested after the method's newcomer download. Each against a hand computation or a
direct forward pass of the models."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_small_sim, params_of, rounds
from fedssa_jax import config_lib, data, headcount, models, system
from fedssa_jax.data import augment
from fedssa_jax.engine import generalization, uplink
from fedssa_jax.engine.evaluation import Evaluation
from fedssa_jax.errors import ConfigError
from fedssa_jax.methods import base
from fedssa_jax.run import lens, outputs


def _evaluation(evaluated, global_accuracy=None, new=None, unseen=None, chance=None):
  n = 12
  return Evaluation(round=1, evaluated=np.asarray(evaluated), reevaluated=0,
                    accuracy=np.zeros(n), classifier_accuracy=np.zeros(n),
                    batch_accuracy=np.zeros(n), count=np.zeros(n), metrics={}, counts={},
                    global_accuracy=global_accuracy, new_client_accuracy=new,
                    global_unseen_accuracy=unseen, global_unseen_chance=chance)


def test_lens_fields_against_a_hand_computation():
  acc = np.array([0.9, 0.1, 0.5, 0.7, 0.3, 0.8, 0.6, 0.2, 0.4, 1.0, 0.55])  # 11 clients
  families = ['a', 'b'] * 5 + ['a']
  ev = _evaluation(np.arange(11), global_accuracy=np.r_[np.linspace(0, 1, 11), 7.0],
                   new=np.r_[np.full(11, np.nan), 0.25],
                   unseen=np.r_[0.1, np.nan, 0.4, np.full(8, np.nan), 9.0],
                   chance=np.r_[0.05, np.nan, 0.15, np.full(8, np.nan), 9.0])
  got = lens.lens(acc, families, ev)
  assert got['accuracy_std'] == pytest.approx(np.sqrt(np.mean((acc - acc.mean()) ** 2)))
  # ceil(1.1) = 2 of 11: the two lowest, 0.1 and 0.2.
  assert got['worst10_accuracy'] == pytest.approx(0.15)
  a = [0.9, 0.5, 0.3, 0.6, 0.4, 0.55]
  b = [0.1, 0.7, 0.8, 0.2, 1.0]
  assert got['family_accuracy'] == pytest.approx({'a': np.mean(a), 'b': np.mean(b)})
  assert list(got['family_accuracy']) == ['a', 'b']
  assert got['global_accuracy'] == pytest.approx(0.5)  # the evaluated clients' only
  # Over the evaluated clients that lack a class (the others NaN): 0.1 and 0.4.
  assert got['global_unseen_accuracy'] == pytest.approx(0.25)
  assert got['global_unseen_chance'] == pytest.approx(0.1)
  all_seen = _evaluation(np.arange(11), unseen=np.full(12, np.nan))
  assert lens.lens(acc, families, all_seen)['global_unseen_accuracy'] is None
  assert got['new_client_accuracy'] == pytest.approx(0.25)
  assert got['participation_gap'] == pytest.approx(acc.mean() - 0.25)
  off = lens.lens(acc, families, _evaluation(np.arange(11)))
  assert (off['global_accuracy'] is off['global_unseen_accuracy'] is off['new_client_accuracy']
          is off['participation_gap'] is None)
  assert lens.worst_decile(np.array([0.3])) == 0.3


def test_new_clients_are_drawn_once_among_clients_with_data():
  train_n = np.array([5, 0, 5, 5, 5, 5, 5, 5, 5, 5])
  test_n = np.array([2, 2, 0, 2, 2, 2, 2, 2, 2, 2])
  ids = generalization.draw_new_clients(3, 0.3, train_n, test_n)
  assert len(ids) == 3 and not np.isin(ids, [1, 2]).any() and np.all(np.diff(ids) > 0)
  np.testing.assert_array_equal(ids, generalization.draw_new_clients(3, 0.3, train_n, test_n))
  assert not np.array_equal(ids, generalization.draw_new_clients(4, 0.3, train_n, test_n)) or \
      not np.array_equal(ids, generalization.draw_new_clients(5, 0.3, train_n, test_n))
  assert len(generalization.draw_new_clients(3, 0.0, train_n, test_n)) == 0
  with pytest.raises(ValueError, match='only 8 of the 10 clients'):
    generalization.draw_new_clients(3, 0.9, train_n, test_n)


def test_the_global_sample_is_balanced_over_the_test_pool():
  labels = np.repeat(np.arange(4), 10)  # 40 images, 10 a class
  test_idx = np.array([[0, 1, 2, 10, 11, 0], [20, 21, 30, 31, 32, 33]])
  test_n = np.array([5, 6])
  got = generalization.global_sample(0, 9, test_idx, test_n, labels, 4)
  assert len(got) == 9 and np.isin(got, test_idx[[0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1],
                                                  [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]]).all()
  # 9 over 4 classes: 3, 2, 2, 2; class 1 has 2 images in the pool, class 3 four.
  np.testing.assert_array_equal(np.bincount(labels[got], minlength=4), [3, 2, 2, 2])
  assert len(np.unique(got[labels[got] == 3])) == 2  # without replacement where it can
  np.testing.assert_array_equal(got, generalization.global_sample(0, 9, test_idx, test_n,
                                                                  labels, 4))


@pytest.mark.parametrize('field,value,message', [
    ('new_clients', 1.0, 'new_clients must be a fraction'),
    ('new_clients', 0.01, 'is no client'),
    ('new_client_epochs', -1, 'new_client_epochs must be'),
    ('eval_global_images', -5, 'eval_global_images must be'),
])
def test_bad_lens_settings_are_refused(field, value, message):
  c = config_lib.build('cifar10', 'hetero,n10')
  c[field] = value
  with pytest.raises(ConfigError, match=message):
    config_lib.validate(c)


def test_new_clients_are_never_sampled_even_under_the_system_section():
  eligible = np.ones(20, bool)
  eligible[[3, 7, 11]] = False
  c = config_lib.build('cifar10', 'hetero,n10').system
  c.availability, c.dropout = 0.7, 0.2
  fed = system.System(c, 20, (0,), np.ones(20))
  for t in range(30):
    _, sampled, cohort = uplink.Ideal().draw(None, 0, t, 20, 6, eligible)
    assert len(sampled) == 6 and eligible[sampled].all()
    _, sampled, cohort = uplink.Drawn().draw(fed, 0, t, 20, 6, eligible)
    assert eligible[sampled].all() and eligible[cohort].all()
  # Without new clients the draw is the one it always was.
  np.testing.assert_array_equal(uplink.Ideal().draw(None, 0, 4, 20, 6, np.ones(20, bool))[1],
                                uplink.Ideal().draw(None, 0, 4, 20, 6)[1])


@pytest.fixture(scope='module')
def lens_run(small_ds):
  """FedSSA on 10 CNN-5 clients, two of them new (never trained; 0 epochs at evaluation), with a
  global sample of 30 images and each client's validation split evaluated, after 2 rounds."""
  sim = make_small_sim(small_ds, 'fedssa', num_clients=10, participation=0.5,
                       new_clients=0.2, new_client_epochs=0, eval_global_images=30,
                       eval_validation=True)
  *_, (state, info) = rounds(sim, 2)
  return sim, state, info, sim.evaluate(state)


def _logits(sim, params, k, idx, g=None):
  """A client's logits with `params` on the images `idx`, by a direct forward pass."""
  data = sim.seed_data[0]
  x = augment.normalize(data.images[jnp.asarray(idx)], sim.train_cfg.mean, sim.train_cfg.std)
  group = sim.groups[sim.group_of[k] if g is None else g]
  return np.asarray(group.eval_model.apply({'params': params}, x)[0])


def _accuracy(sim, params, k, idx, g=None):
  """A client's accuracy with `params` on the images `idx`, by a direct forward pass."""
  labels = np.asarray(sim.seed_data[0].labels)[idx]
  return float(np.mean(np.argmax(_logits(sim, params, k, idx, g), -1) == labels))


@pytest.mark.slow  # a simulator compiled and run
def test_new_clients_never_train_and_score_their_newcomer_model(lens_run):
  sim, state, info, ev = lens_run
  new = sim.new_clients[0]
  assert len(new) == 2 and sim.k == 4  # K = floor(0.5 * 8)
  assert not np.isin(new, np.concatenate([sim.cohort(t) for t in range(20)])).any()
  assert not np.isin(new, ev.evaluated).any()
  assert np.isnan(np.delete(ev.new_client_accuracy, new)).all()
  data = sim.seed_data[0]
  server = jax.tree.map(lambda a: a[0], state.server)
  for k in new:
    # Its initial model, untouched, with the whole global header (FedSSA's newcomer), tested
    # on its own test split.
    initial = jax.tree.map(jnp.asarray, params_of(sim, state.population.params, k))
    rows = jnp.where(server.avail[:, None], server.global_rows, models.header_rows(initial))
    params = models.with_header_rows(initial, rows)
    idx = np.asarray(data.test_idx[k])[:int(data.test_n[k])]
    assert ev.new_client_accuracy[k] == pytest.approx(_accuracy(sim, params, k, idx))
  initial = sim.init_state().population.params
  for k in new:  # their stored models are still the initial ones
    jax.tree.map(np.testing.assert_array_equal, params_of(sim, state.population.params, k),
                 params_of(sim, initial, k))


@pytest.mark.slow  # a simulator compiled and run
def test_global_accuracy_is_each_clients_accuracy_on_the_sample(lens_run):
  sim, state, info, ev = lens_run
  sample = np.asarray(sim.evaluator.global_sample[0])
  assert len(sample) == 30
  data = sim.seed_data[0]
  labels = np.asarray(data.labels)
  for k in ev.evaluated[:3]:
    params = jax.tree.map(jnp.asarray, params_of(sim, state.population.params, k))
    assert ev.global_accuracy[k] == pytest.approx(_accuracy(sim, params, k, sample))
    # The sample's images of the classes client k holds no training sample of.
    seen = labels[np.asarray(data.train_idx[k])[:int(data.train_n[k])]]
    unseen = sample[~np.isin(labels[sample], seen)]
    assert 0 < len(unseen) < len(sample)
    assert ev.global_unseen_accuracy[k] == pytest.approx(_accuracy(sim, params, k, unseen))
    # Guessing: the share of those images put in a class the client lacks, over their number.
    lacks = np.setdiff1d(np.arange(10), seen)
    guess = np.argmax(_logits(sim, params, k, unseen), -1)
    assert ev.global_unseen_chance[k] == pytest.approx(
        np.isin(guess, lacks).mean() / len(lacks))
  rec = outputs.record(sim, state.replace(costs=state.costs.of(0)), info, ev)
  assert rec['global_accuracy'] == pytest.approx(float(ev.global_accuracy[ev.evaluated].mean()))
  assert rec['global_unseen_accuracy'] == pytest.approx(
      float(np.nanmean(ev.global_unseen_accuracy[ev.evaluated])))
  assert rec['global_unseen_chance'] == pytest.approx(
      float(np.nanmean(ev.global_unseen_chance[ev.evaluated])))
  assert rec['participation_gap'] == pytest.approx(
      rec['mean_accuracy'] - rec['new_client_accuracy'])
  assert set(lens.LENS_FIELDS) <= set(rec)
  assert set(rec) - set(outputs.METRICS_FIELDS) == {'val_accuracy'}  # eval_validation's


@pytest.mark.slow  # a simulator compiled and run
def test_val_accuracy_is_each_clients_accuracy_on_its_validation_split(lens_run, small_ds):
  sim, state, info, ev = lens_run
  cd = data.partition_from_config(sim.config, small_ds)
  d = sim.seed_data[0]
  x = augment.normalize(d.images, sim.train_cfg.mean, sim.train_cfg.std)
  forward = jax.jit(sim.groups[0].eval_model.apply)  # every client a CNN-5: one compile
  accs = []
  for k in ev.evaluated:
    params = jax.tree.map(jnp.asarray, params_of(sim, state.population.params, k))
    right = np.argmax(np.asarray(forward({'params': params}, x)[0]), -1) == np.asarray(d.labels)
    val, test = cd.val_idx[k, :cd.val_n[k]], cd.test_idx[k, :cd.test_n[k]]
    assert len(val) and not np.isin(val, test).any()
    assert not np.isin(val, cd.train_idx[k, :cd.train_n[k]]).any()
    assert ev.val_accuracy[k] == pytest.approx(right[val].mean())
    assert ev.accuracy[k] == pytest.approx(right[test].mean())  # the test split's as before
    accs.append(ev.val_accuracy[k])
  assert len(set(accs)) > 2  # each client's own split and model
  rec = outputs.record(sim, state.replace(costs=state.costs.of(0)), info, ev)
  assert rec['val_accuracy'] == pytest.approx(np.mean(accs))


@pytest.mark.slow  # simulators built, their initial states compiled
def test_the_server_knows_nothing_of_the_new_clients(small_ds):
  """The server's initial state counts the clients that take part only: under central upload DP
  a class's owners (the count its noised sum is divided by, times q = K / N' with N' the clients
  that take part) leave out the new clients, which never upload; FedSSA's seen table holds
  nothing of them; FedGen's label prior is the other clients' class counts."""
  central = {'privacy.upload': True, 'privacy.upload_mode': 'central',
             'privacy.upload_clip': 1.0, 'privacy.upload_noise_multiplier': 1.0}
  common = dict(num_clients=10, participation=0.3, new_clients=0.2)
  for method, extra in (('fedproto', central),
                        ('fedssa', {**central, 'fedssa.scope': 'participants'}),
                        ('fedgen', {})):
    sim = make_small_sim(small_ds, method, **common, **extra)
    new = sim.new_clients[0]
    takes_part = ~np.isin(np.arange(10), new)
    assert len(new) == 2 and sim.k == 2  # K = floor(0.3 * 8)
    server = jax.tree.map(lambda a: np.asarray(a)[0], sim.init_state().server)
    seen = sim.seen[0]
    if method == 'fedproto':
      assert sim.method.central_q == 2 / 8
      np.testing.assert_array_equal(server.owners, seen[takes_part].sum(axis=0))
    elif method == 'fedssa':
      assert sim.method.central_q == 2 / 8
      np.testing.assert_array_equal(server.seen, seen & takes_part[:, None])
    else:
      counts = sim.class_counts[0][takes_part].sum(axis=0)
      np.testing.assert_allclose(server.prior, counts / counts.sum(), rtol=1e-6)


def test_the_headcounts_by_hand():
  """N' and K at the cross-device variant (1,000 clients, 10% new, C = 10%) and at the edges,
  and the central servers' share q = K / N' from the same counts (docs/algorithm.md §11)."""
  assert headcount.new_client_count(0.1, 1000) == 100
  assert headcount.participating(1000, 0.1) == 900 and headcount.participating(10, 0.0) == 10
  assert headcount.cohort_size(900, 0.1) == 90 and headcount.cohort_size(10, 0.01) == 1
  c = config_lib.base_config('cifar10')
  c.update_from_flattened_dict({'num_clients': 1000, 'participation': 0.1, 'new_clients': 0.1,
                                'privacy.upload': True, 'privacy.upload_mode': 'central'})
  assert base.central_share(c, 1000) == 90 / 900
  c.privacy.upload_mode = 'local'
  assert base.central_share(c, 1000) is None
