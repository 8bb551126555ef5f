"""The round engine: chunked vmapped training with dummies equals one-client-at-a-time, no
retracing across rounds, and cost counters that match hand counts."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, data, headcount
from fedssa_jax.engine import evaluation, schedule, simulator, snapshots
from fedssa_jax.engine.state import ChunkInputs
from fedssa_jax.methods import base, standalone

ROUNDS = 3


def small_config(method='fedssa', clients_per_call=1):
  c = config_lib.build('cifar10', 'hetero,tiny')
  c.model.families = ('cnn5', 'cnn4')
  c.num_clients, c.participation = 10, 0.3   # K = 3; 0..3 sampled per family each round
  c.num_rounds, c.local_epochs, c.batch_size, c.eval_batch_size = ROUNDS, 2, 16, 16
  c.method = method
  c.engine.clients_per_call = clients_per_call
  return c


def run(config, ds):
  """Rounds evaluated as the training loop does (each from the previous evaluation)."""
  sim = simulator.Simulator(config, ds, data.partition_from_config(config, ds))
  state = sim.init_state()
  infos, ev = [], None
  for _ in range(config.num_rounds):
    state, (info,) = sim.run_round(state)
    ev = sim.evaluate(state, previous=ev)
    infos.append(info)
  return sim, state, infos, ev


@pytest.fixture(scope='module')
def runs(small_ds):
  return {per_call: run(small_config(clients_per_call=per_call), small_ds)
          for per_call in (1, 3)}


@pytest.mark.slow  # simulators compiled and run
def test_chunked_vmap_with_dummies_equals_one_client_per_call(runs):
  (_, s1, i1, e1), (sim3, s3, i3, e3) = runs[1], runs[3]
  assert [g.clients_per_call for g in sim3.groups] == [3, 3]
  # Some round padded a family's chunk with dummies (fewer than 3 of it sampled).
  counts = [np.bincount(sim3.group_of[i.cohort], minlength=2) for i in i3]
  assert any((c % 3 != 0).any() for c in counts)
  for a, b in zip(i1, i3):
    np.testing.assert_array_equal(a.cohort, b.cohort)
    np.testing.assert_array_equal(a.train_samples, b.train_samples)
    assert a.train_loss == pytest.approx(b.train_loss, rel=1e-4)
    assert a.client_flops == b.client_flops and a.up_floats == b.up_floats
  for x, y in zip(jax.tree_util.tree_leaves(s1), jax.tree_util.tree_leaves(s3)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-3, atol=1e-5)
  np.testing.assert_allclose(e1.accuracy, e3.accuracy, atol=1e-9)


@pytest.mark.slow  # simulators compiled and run
def test_no_retracing_across_rounds(runs):
  for sim, *_ in runs.values():
    # FedSSA's evaluations, whole or of the trained clients, run blocks of one fixed size.
    for call in (*sim._train_calls, *sim.evaluator.calls, sim._aggregate):
      assert call._cache_size() == 1


@pytest.mark.slow  # simulators compiled and run
def test_evaluation_from_the_previous_one_equals_a_whole_evaluation(runs):
  sim, state, infos, ev = runs[1]
  # The last evaluation re-evaluated only the last round's cohort.
  assert ev.round == ROUNDS and ev.reevaluated == len(infos[-1].cohort)
  whole = sim.evaluate(state)
  assert whole.reevaluated == sim.num_clients
  for k in evaluation.COUNTS:
    np.testing.assert_array_equal(ev.counts[k], whole.counts[k])
  np.testing.assert_array_equal(ev.accuracy, whole.accuracy)
  np.testing.assert_array_equal(ev.batch_accuracy, whole.batch_accuracy)
  # Two rounds on from an older evaluation: both cohorts are evaluated again.
  older = sim.evaluate(sim.init_state())
  assert older.round == 0
  again = sim.evaluate(state, previous=older)
  trained = np.unique(np.concatenate([i.cohort for i in infos]))
  assert again.reevaluated == len(trained)
  np.testing.assert_array_equal(again.accuracy, whole.accuracy)


@pytest.mark.parametrize('method,reads', [('fedssa', False), ('standalone', False),
                                          ('fml', False), ('lg_fedavg', True),
                                          ('fedproto', True)])
def test_methods_say_whether_evaluation_reads_the_server(method, reads):
  from fedssa_jax import methods  # pylint: disable=g-import-not-at-top
  m = methods.get_method(method)(small_config(method), 10, 10)
  assert m.eval_reads_server is reads


@pytest.mark.slow  # simulators compiled and run
def test_methods_reading_the_server_are_evaluated_whole(small_sim):
  sim = small_sim('fedmrl')  # its prediction reads the shared model and the client's state
  state, ev = sim.init_state(), None
  for _ in range(2):
    state, _ = sim.run_round(state)
    ev = sim.evaluate(state, previous=ev)
  assert ev.reevaluated == sim.num_clients
  np.testing.assert_array_equal(ev.accuracy, sim.evaluate(state).accuracy)


@pytest.mark.slow  # simulators compiled and run
@pytest.mark.parametrize('method,global_images', [('lg_fedavg', 30), ('fedgh', 0)])
def test_header_methods_test_only_the_trained_clients_again(small_sim, method, global_images):
  """A method whose results read the server through the header alone (the global header on
  the client's extractor) tests again only the clients that trained; the others' test and
  global sample counts are computed again from their kept representations under the header
  now. The counts equal a whole evaluation's, and those of the evaluation that keeps nothing."""
  # 10 clients, K = 3, lr 0.05: the header moves the predictions of clients that do not train.
  sim = small_sim(method, num_rounds=4, eval_global_images=global_images, num_clients=10,
                  participation=0.3, **{'optimizer.lr': 0.05})
  assert sim.evaluator.keep_reps
  state, evs, cohorts = sim.init_state(), [], []
  for _ in range(4):
    state, (info,) = sim.run_round(state)
    evs.append(sim.evaluate(state, previous=evs[-1] if evs else None))
    cohorts.append(info.cohort)
  ev = evs[-1]
  assert ev.reevaluated == len(info.cohort) < sim.num_clients
  assert sorted(ev.kept) == ['kept_global_reps', 'kept_reps'][not global_images:]
  # A client that did not train changed its counts from one evaluation to the next (the header
  # moved): copying them would fail.
  count = evaluation.GLOBAL_CORRECT if global_images else 'correct'
  assert any((a.counts[count][idle] != b.counts[count][idle]).any()
             for a, b, c in zip(evs, evs[1:], cohorts[1:])
             for idle in [np.setdiff1d(np.arange(sim.num_clients), c)])
  whole = sim.evaluate(state)
  plain = sim.evaluator
  plain.keep_reps, plain.again_call = False, None
  plain.calls = [plain._eval_call(g) for g in plain.groups]
  in_loop = sim.evaluate(state)
  assert whole.reevaluated == in_loop.reevaluated == sim.num_clients and in_loop.kept is None
  for other in (whole, in_loop):
    for k in (*evaluation.COUNTS,
              *([evaluation.GLOBAL_CORRECT, *evaluation.UNSEEN] if global_images else [])):
      np.testing.assert_array_equal(ev.counts[k], other.counts[k])
    np.testing.assert_array_equal(ev.accuracy, other.accuracy)


@pytest.mark.slow  # simulators compiled and run
@pytest.mark.parametrize('method,eval_clients', [('fedproto', 0), ('fedtgp', 0),
                                                 ('fedproto', 4)])
def test_prototype_methods_test_only_the_trained_clients_again(small_sim, method,
                                                                eval_clients):
  """A method whose results read the server only in eval_extra (the nearest prototype) tests
  again only the clients that trained; the others' prototype counts are computed again from
  their kept test representations (kept for the evaluated clients alone). The results equal a
  whole evaluation's, and those of the evaluation that computes the counts inside the test loop
  (no values kept)."""
  sim = small_sim(method, num_rounds=4, eval_clients=eval_clients)
  assert sim.evaluator.reuse_kept
  evaluated = sim.evaluated_ids[0]
  state, evs = sim.init_state(), []
  for _ in range(4):
    state, (info,) = sim.run_round(state)
    evs.append(sim.evaluate(state, previous=evs[-1] if evs else None))
  ev = evs[-1]
  assert ev.reevaluated == len(np.intersect1d(info.cohort, evaluated)) < len(evaluated)
  assert len(ev.kept['kept_reps']) == len(evaluated)
  # The server's prototypes moved a client that did not train: copying its count would fail.
  idle = np.setdiff1d(evaluated, info.cohort)
  proto = lambda e: e.counts['prototype_accuracy'][idle]
  assert any((proto(e) != proto(ev)).any() for e in evs[:-1])
  whole = sim.evaluate(state)
  assert whole.reevaluated == len(evaluated)
  plain = sim.evaluator
  plain.keep = plain.reuse_kept = False
  plain.calls = [plain._eval_call(g) for g in plain.groups]
  in_loop = sim.evaluate(state)
  assert in_loop.kept is None
  for other in (whole, in_loop):
    for k in (*evaluation.COUNTS, 'prototype_accuracy'):
      np.testing.assert_array_equal(ev.counts[k], other.counts[k])
    np.testing.assert_array_equal(ev.accuracy, other.accuracy)


@pytest.mark.slow  # simulators compiled and run
def test_costs_match_hand_counts(runs):
  sim, state, infos, _ = runs[1]
  cfg = sim.config
  up = sum(501 * sim.seen[0][i.cohort].sum() for i in infos)
  costs = state.costs.of(0)
  assert costs.up_floats == up
  # Every class has a global row from the start (the initial header): every round downloads
  # each participant's seen rows, round 0 included.
  for i in infos:
    assert i.down_floats == 501 * sim.seen[0][i.cohort].sum() == i.up_floats
  fps = np.array([sim.flops.per_sample[sim.config.model.families[c % 2]]
                  for c in range(sim.num_clients)])  # client k has families[k % 2]
  train_flops = sum((fps[i.cohort] * cfg.local_epochs * sim.train_n[0][i.cohort]).sum()
                    for i in infos)
  fusion = costs.client_flops - train_flops
  assert 0 < fusion <= 3 * 501 * sim.seen[0].sum() * ROUNDS
  for i in infos:
    np.testing.assert_array_equal(i.train_samples, cfg.local_epochs * sim.train_n[0][i.cohort])


@pytest.mark.slow  # simulators compiled and run
def test_standalone_exchanges_nothing_and_differs_from_fedssa(small_ds, runs):
  sim, state, infos, ev = run(small_config('standalone'), small_ds)
  state = snapshots.seed_state(sim.store, state)
  assert state.server == base.NoServer() and not jax.tree.leaves(state.server)
  assert state.costs.up_floats == state.costs.down_floats == 0
  fs_sim, fs_state, fs_infos, fs_ev = runs[1]
  fs_state = snapshots.seed_state(fs_sim.store, fs_state)
  # The same initial models and cohorts; FedSSA fuses the initial global header from round 0.
  jax.tree.map(np.testing.assert_array_equal, sim.init_state().population.params,
               fs_sim.init_state().population.params)
  np.testing.assert_array_equal(infos[0].cohort, fs_infos[0].cohort)
  assert infos[0].train_loss != pytest.approx(fs_infos[0].train_loss, rel=1e-4)
  assert not np.allclose(state.population.params[0]['fc3']['kernel'],
                         fs_state.population.params[0]['fc3']['kernel'])
  # Extractors of clients that never took part are their own initial ones, in both runs.
  never = sorted(set(range(10)) - set(np.concatenate([i.cohort for i in infos]).tolist()))
  assert never, 'pick a seed that leaves a client out'
  for c in never:
    g, slot = sim.group_of[c], sim.slot_of[c]
    np.testing.assert_array_equal(state.population.params[g]['fc1']['kernel'][slot],
                                  fs_state.population.params[g]['fc1']['kernel'][slot])


@pytest.mark.slow  # simulators compiled and run
@pytest.mark.parametrize('scope', ['family', 'client'])
def test_initial_models_per_family_or_per_client(small_ds, scope):
  config = small_config()
  config.model.init_scope = scope
  sim = simulator.Simulator(config, small_ds, data.partition_from_config(config, small_ds))
  params = snapshots.seed_state(sim.store, sim.init_state()).population.params
  kernels = [np.asarray(p['conv1']['kernel']) for p in params]  # same shape in both families
  distinct = {k.tobytes() for group in kernels for k in group}
  if scope == 'client':
    assert len(distinct) == sum(len(k) for k in kernels)
  else:  # one model per family, copied to each member (rows of their own, not aliases)
    assert len(distinct) == len(kernels) == 2
    # The family's model is its own draw: the same whichever families the run has.
    config.model.families = ('cnn4',)
    sim4 = simulator.Simulator(config, small_ds, data.partition_from_config(config, small_ds))
    np.testing.assert_array_equal(
        sim4.init_state().population.params[0]['conv1']['kernel'][0, 0], kernels[1][0])


@pytest.mark.slow  # simulators compiled and run
def test_header_norms_are_those_of_the_trained_clients_seen_rows(runs):
  sim, state, infos, _ = runs[3]
  state = snapshots.seed_state(sim.store, state)
  norms = []
  for c in infos[-1].cohort:
    g, slot = sim.group_of[c], sim.slot_of[c]
    rows = np.concatenate([state.population.params[g]['fc3']['kernel'][slot].T,
                           state.population.params[g]['fc3']['bias'][slot][:, None]], axis=1)
    norms += [np.linalg.norm(rows[s]) for s in np.flatnonzero(sim.seen[0][c])]
  assert infos[-1].header_norm_max == pytest.approx(max(norms), rel=1e-5)
  assert infos[-1].header_norm_mean == pytest.approx(np.mean(norms), rel=1e-5)


def test_a_chunk_reports_the_methods_norms_of_its_trained_clients():
  """train_chunk reports each client's Method.trained_norms after training: by default those of
  its seen-class header rows; a method may report norms of its own."""
  rng = np.random.default_rng(0)
  params = {'fc3': {'kernel': rng.normal(size=(3, 4, 5)).astype(np.float32),
                    'bias': rng.normal(size=(3, 5)).astype(np.float32)}}
  seen = np.array([[1, 1, 0, 0, 0], [0, 0, 1, 1, 1], [1, 0, 0, 0, 0], [0] * 5], bool)
  inputs = ChunkInputs(slots=None, ids=jnp.array([0, 1, 3]), active=jnp.array([True, True, False]),
                       seen=jnp.asarray(seen), data=None, round_index=None, root_key=None)
  local = lambda p, state, server, inputs: (p, state, {}, 'client stats')

  class WeightNorms(standalone.Standalone):
    def trained_norms(self, params, seen):
      return base.Norms(max=jnp.abs(params['fc3']['bias']).max(), sum=jnp.zeros(()),
                        count=seen.sum() * 0)

  config = config_lib.base_config()
  for method in (standalone.Standalone(config, 4, 5), WeightNorms(config, 4, 5)):
    _, _, _, stats = simulator.train_chunk(params, {}, (), inputs, method=method, local=local)
    assert stats.clients == 'client stats'
    np.testing.assert_array_equal(stats.nonfinite, [False, False, False])
    for k, c in enumerate([0, 1, 3]):
      if isinstance(method, WeightNorms):
        want = [np.abs(params['fc3']['bias'][k]).max(), 0.0, 0]
      else:
        rows = np.concatenate([params['fc3']['kernel'][k].T, params['fc3']['bias'][k][:, None]],
                              axis=1)
        norms = np.linalg.norm(rows[seen[c]], axis=1)
        want = [norms.max(initial=0.0), norms.sum(), seen[c].sum()]
      got = [stats.norms.max[k], stats.norms.sum[k], stats.norms.count[k]]
      np.testing.assert_allclose(got, want, rtol=1e-6)


def test_cohort_sampling_is_a_pure_function_of_seed_and_round():
  a = schedule.sample_cohort(0, 5, 100, 10)
  assert len(set(a.tolist())) == 10 and (np.diff(a) > 0).all()
  np.testing.assert_array_equal(a, schedule.sample_cohort(0, 5, 100, 10))
  assert not np.array_equal(a, schedule.sample_cohort(0, 6, 100, 10))
  assert headcount.cohort_size(100, 0.1) == 10 and headcount.cohort_size(10, 0.01) == 1


@pytest.mark.slow  # simulators compiled and run
def test_evaluation_equals_plain_per_client_loop(runs, small_ds):
  sim, state, _, ev = runs[3]
  state, data_ = snapshots.seed_state(sim.store, state), sim.seed_data[0]
  images = np.asarray(jax.numpy.asarray(small_ds.images, np.float32) / 255.0)
  images = (images - np.array(small_ds.mean)) / np.array(small_ds.std)
  for c in range(sim.num_clients):
    g, slot = sim.group_of[c], sim.slot_of[c]
    params = jax.tree_util.tree_map(lambda p: p[slot], state.population.params[g])
    idx = data_.test_idx[c, :data_.test_n[c]]
    logits, _ = sim.groups[g].eval_model.apply({'params': params}, images[np.asarray(idx)])
    correct = np.argmax(logits, -1) == small_ds.labels[np.asarray(idx)]
    assert ev.count[c] == len(idx)
    assert ev.accuracy[c] == pytest.approx(correct.mean())
    # The reference's per-batch metric: mean over batches of eval_batch_size.
    b = sim.config.eval_batch_size
    batches = [correct[i:i + b].mean() for i in range(0, len(correct), b)]
    assert ev.batch_accuracy[c] == pytest.approx(np.mean(batches))
