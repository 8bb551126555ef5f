"""The system section (fedssa_jax/system.py): availability, dropout, stragglers, lost uploads,
devices and the simulated clock.

Fast: the config's checks, the draws (pure functions of seed and round, each kind on its own
stream, at their rates), the cohort among the online clients, the devices, a round's simulated
seconds by hand, and every method's server left as it was by a round whose uploads are all lost.
Slow: one small FedSSA simulator with every kind on, whose rounds are the same on the device,
host and disk stores and packed with another seed, and whose lost, dropped and received clients
are exactly what the draws say. The straggler's steps against a plain loop are in
client_test.py; a killed run resuming under every kind in checkpoint_test.py (its runs have the
section on); the 4-device mesh in sharding_test.py (its FD run has it on).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, methods, models, system
from fedssa_jax.engine import schedule, simulator, uplink
from fedssa_jax.engine.state import ClientStats
from fedssa_jax.engine.training import TrainStats
from fedssa_jax.errors import ConfigError

from conftest import make_small_sim

N, C = 5, 10
# Every kind at once, with a clock and a deadline that some uploads miss (make_small_sim's
# CNN-5 clients spend 0.005-0.5 simulated seconds a round here on the three tiers).
EVERY_KIND = {
    'participation': 0.8, 'system.availability': 0.9, 'system.dropout': 0.2,
    'system.straggler_rate': 0.5, 'system.min_work': 0.2, 'system.upload_loss': 0.3,
    'system.device_tiers': 'three_tiers', 'system.deadline': 0.2,
    'system.client_seconds': True}


def section(**fields):
  s = system.default_config()
  s.update(fields)
  return s


def test_the_section_is_off_by_default_and_the_devices_variant_turns_on_the_clock():
  assert not system.enabled(config_lib.base_config('cifar10').system)
  c = config_lib.build('cifar10', 'hetero,n10,devices')
  assert system.enabled(c.system) and system.has_clock(c.system)
  assert c.system.tier_assignment == 'model'


@pytest.mark.parametrize('fields, says', [
    (dict(upload_loss=1.5), 'system.upload_loss must be in [0, 1]'),
    (dict(dropout=-0.1), 'system.dropout must be in [0, 1]'),
    (dict(min_work=1.2), 'system.min_work must be in [0, 1]'),
    (dict(straggler_rate=2.0), 'system.straggler_rate must be in [0, 1]'),
    (dict(availability=0.0), 'leaves no client online'),
    (dict(availability=0.5, availability_spread=0.6), 'too wide'),
    (dict(device_tiers='slow:0:1e6:1e6:1'), "tier 'slow' has speed (FLOP/s) 0"),
    (dict(device_tiers='a:1e9:1e6:1e6:0.5;b:2e9:1e6:1e6:0.4'), 'sum to 0.9'),
    (dict(device_tiers='a:1e9:1e6'), "not 'name:flops:down:up:share'"),
    (dict(device_tiers='three_tiers', deadline=-1.0), 'system.deadline must be > 0'),
    (dict(deadline=10.0), 'system.deadline needs a clock'),
    (dict(tier_assignment='fastest'), 'Unknown system.tier_assignment'),
    (dict(availability_trace='/no/such/trace.npy'), 'no file'),
])
def test_bad_input_is_a_config_error_naming_the_field(fields, says):
  with pytest.raises(ConfigError, match=None) as e:
    system.check_config(section(**fields), N)
  assert says in str(e.value)


def test_validate_checks_the_section_and_a_trace_of_the_wrong_shape(tmp_path):
  c = config_lib.build('cifar10', 'hetero,tiny')
  c.system.upload_loss = 1.5
  with pytest.raises(ConfigError, match='upload_loss'):
    config_lib.validate(c)
  path = str(tmp_path / 'trace.npy')
  np.save(path, np.ones((N + 1, 4)))
  c.system.upload_loss, c.system.availability_trace = 0.0, path
  with pytest.raises(ConfigError, match=r'has shape \(6, 4\).*\[5, T\]'):
    config_lib.validate(c)
  np.save(path, np.full((N, 4), 2.0))
  with pytest.raises(ConfigError, match='outside'):
    config_lib.validate(c)


def make_system(n=N, seeds=(0,), model_flops=None, **fields):
  flops = np.arange(n, dtype=float) if model_flops is None else model_flops
  return system.System(section(**fields), n, seeds, flops)


def test_draws_are_a_pure_function_of_seed_and_round_each_kind_on_its_own_stream():
  a = make_system(n=50, seeds=(0, 1), availability=0.7, dropout=0.3, straggler_rate=0.4,
                  min_work=0.25, upload_loss=0.2)
  d = a.round_draws(0, 3)
  again = make_system(n=50, seeds=(0, 1), availability=0.7, dropout=0.3, straggler_rate=0.4,
                      min_work=0.25, upload_loss=0.2).round_draws(0, 3)
  for f in ('online', 'dropped', 'work', 'lost'):
    np.testing.assert_array_equal(getattr(d, f), getattr(again, f))
  assert not np.array_equal(d.online, a.round_draws(1, 3).online)   # another seed
  assert not np.array_equal(d.online, a.round_draws(0, 4).online)   # another round
  # One kind's rate changes none of the other kinds' draws.
  other = make_system(n=50, seeds=(0,), availability=0.7, dropout=0.9, straggler_rate=0.4,
                      min_work=0.25, upload_loss=0.2).round_draws(0, 3)
  np.testing.assert_array_equal(other.online, d.online)
  np.testing.assert_array_equal(other.work, d.work)
  np.testing.assert_array_equal(other.lost, d.lost)
  assert d.work.dtype == np.float32 and ((d.work == 1) | ((d.work >= 0.25) & (d.work < 1))).all()


def test_draws_come_at_their_rates():
  s = make_system(n=400, availability=0.7, dropout=0.3, straggler_rate=0.4, min_work=0.5,
                  upload_loss=0.2)
  draws = [s.round_draws(0, t) for t in range(50)]   # 20,000 draws of each kind
  mean = lambda f: np.mean([f(d) for d in draws])
  assert mean(lambda d: d.online.mean()) == pytest.approx(0.7, abs=0.01)
  assert mean(lambda d: d.dropped.mean()) == pytest.approx(0.3, abs=0.01)
  assert mean(lambda d: d.lost.mean()) == pytest.approx(0.2, abs=0.01)
  assert mean(lambda d: (d.work < 1).mean()) == pytest.approx(0.4, abs=0.01)
  f = np.concatenate([d.work[d.work < 1] for d in draws])
  assert f.min() >= 0.5 and f.mean() == pytest.approx(0.75, abs=0.01)   # U[0.5, 1]


def test_beta_availability_has_the_mean_and_spread_asked():
  p = make_system(n=20_000, availability=0.6, availability_spread=0.2).p_online[0]
  assert p.mean() == pytest.approx(0.6, abs=0.01) and p.std() == pytest.approx(0.2, abs=0.01)


def test_the_cohort_is_drawn_among_the_online_clients():
  k, n = 4, 10
  everyone = np.ones(n, bool)
  for t in range(20):  # every client online: the ideal federation's cohort
    np.testing.assert_array_equal(schedule.sample_cohort(3, t, n, k, everyone),
                                  schedule.sample_cohort(3, t, n, k))
  online = np.zeros(n, bool)
  online[[1, 4, 5, 8, 9]] = True
  for t in range(20):
    c = schedule.sample_cohort(3, t, n, k, online)
    assert len(c) == k and online[c].all() and (np.diff(c) > 0).all()
  online[[5, 8, 9]] = False  # fewer online than K: all of them take part
  np.testing.assert_array_equal(schedule.sample_cohort(3, 0, n, k, online), [1, 4])
  d = system.RoundDraws(online=online, dropped=np.isin(np.arange(n), [4, 7]),
                        work=np.ones(n, np.float32), lost=np.zeros(n, bool))
  np.testing.assert_array_equal(d.cohort(np.array([1, 4, 6])), [1, 6])


def test_a_trace_gives_each_round_its_column(tmp_path):
  trace = np.zeros((N, 3))
  trace[:, 0] = 1
  trace[[0, 2], 1] = 1           # round 1: clients 0 and 2 online; round 2: none
  path = str(tmp_path / 'trace.csv')
  np.savetxt(path, trace, delimiter=',')
  s = make_system(availability_trace=path)
  onl = [np.flatnonzero(s.round_draws(0, t).online).tolist() for t in range(4)]
  assert onl == [[0, 1, 2, 3, 4], [0, 2], [], [0, 1, 2, 3, 4]]   # column t mod 3


def test_tiers_go_to_clients_by_share_and_by_model_cost(tmp_path):
  tiers = system.parse_tiers('three_tiers')
  assert [t.name for t in tiers] == ['low', 'mid', 'high'] and sum(t.share for t in tiers) == 1
  assert system._apportion([0.3, 0.4, 0.3], 10) == [3, 4, 3]
  assert system._apportion([0.5, 0.5], 3) == [2, 1]
  # Model follows device: the cheapest models on the slowest tier.
  costs = np.array([5., 1., 4., 2., 3., 1., 5., 4., 2., 3.])
  s = make_system(n=10, model_flops=costs, device_tiers='three_tiers', tier_assignment='model')
  speed = s.devices[0][:, 0]
  assert (np.diff(speed[np.lexsort((np.arange(10), costs))]) >= 0).all()
  assert sorted(speed.tolist()) == [1e9] * 3 + [5e9] * 4 + [2e10] * 3
  r = make_system(n=10, device_tiers='three_tiers').devices[0]
  assert sorted(r[:, 0].tolist()) == sorted(speed.tolist())
  path = str(tmp_path / 'profile.csv')
  with open(path, 'w') as f:
    f.write('flops,down,up\n' + '\n'.join(f'{i + 1}e9,1e6,5e5' for i in range(N)))
  np.testing.assert_array_equal(make_system(device_profile=path).devices[0][:, 0],
                                [1e9, 2e9, 3e9, 4e9, 5e9])


def test_a_three_client_round_s_simulated_time_by_hand():
  """Clients 0, 1, 2 on tiers of 1e9, 2e9 and 1e10 FLOP/s, bandwidths 1e6/5e5 bytes/s (down/up),
  a deadline of 20 s; client 1's upload is lost; a fourth slot is a dummy."""
  sys_in = system.SystemInputs(
      work=jnp.ones(4), lost=jnp.array([False, True, False, False]),
      train_flops=jnp.array([1e6, 2e6, 4e6, 1e6]), speed=jnp.array([1e9, 2e9, 1e10, 1e9]),
      down=jnp.full(4, 1e6), up=jnp.full(4, 5e5), deadline=jnp.asarray(20.0))
  samples = jnp.array([1000, 5000, 10_000, 0])
  stats = ClientStats(
      train=TrainStats(correct=jnp.zeros(4, jnp.int32), loss_sum=jnp.zeros(4),
                       samples=samples.astype(jnp.int32), steps=jnp.zeros(4, jnp.int32)),
      down_floats=jnp.array([1000., 2000., 0., 0.]), up_floats=jnp.array([500., 500., 1e6, 0.]),
      extra_flops=jnp.array([0., 1e9, 0., 0.]))
  seconds, received = uplink.arrivals(sys_in, jnp.arange(4), jnp.array([1, 1, 1, 0], bool),
                                         stats)
  # Client 0: 4*1000/1e6 + 1e6*1000/1e9 + 4*500/5e5 = 0.004 + 1 + 0.004.
  # Client 1: 4*2000/1e6 + (2e6*5000 + 1e9)/2e9 + 4*500/5e5 = 0.008 + 5.5 + 0.004.
  # Client 2: 0 + 4e6*1e4/1e10 + 4*1e6/5e5 = 4 + 8 = 12 ... under 20 s; at 10 s it is late.
  np.testing.assert_allclose(seconds, [1.008, 5.512, 12.0, 0.0], rtol=1e-6)
  np.testing.assert_array_equal(received, [True, False, True, False])
  assert system.round_seconds(np.asarray(seconds[:3]), 20.0) == pytest.approx(12.0)
  late = sys_in.replace(deadline=jnp.asarray(10.0))
  _, received = uplink.arrivals(late, jnp.arange(4), jnp.array([1, 1, 1, 0], bool), stats)
  np.testing.assert_array_equal(received, [True, False, False, False])
  assert system.round_seconds(np.asarray(seconds[:3]), 10.0) == 10.0   # waits to the deadline
  assert system.round_seconds(np.zeros(0), 10.0) == 0.0


# ----------------------------------------------------------------------------------------------
# Every method: a round whose uploads are all lost leaves its server as it was
# ----------------------------------------------------------------------------------------------
def random_uploads(tree, num, rng):
  """`num` clients' random uploads shaped as `tree`'s leaves with a leading client axis (floats
  normal, ints in [1, 5), bools mostly True), made with numpy: nothing to compile."""
  def one(leaf):
    shape = (num, *leaf.shape)
    if np.issubdtype(leaf.dtype, np.floating):
      return rng.standard_normal(shape).astype(leaf.dtype)
    if leaf.dtype == np.bool_:
      return rng.random(shape) < 0.8
    return rng.integers(1, 5, shape).astype(leaf.dtype)
  return jax.tree.map(one, tree)


@pytest.mark.parametrize('name', sorted(methods.METHODS))
def test_a_round_whose_uploads_are_all_lost_leaves_every_method_s_server_as_it_was(name):
  import method_hooks_test  # pylint: disable=g-import-not-at-top
  cfg = config_lib.base_config('cifar10')
  method = methods.get_method(name)(cfg, N, C)
  model = models.make_model('cnn5', C, feature_dim=cfg.model.feature_dim)
  payload_shape = method_hooks_test.hook_data(method, model)['Upload.payload']
  key = jax.random.PRNGKey(0)
  seen = jnp.asarray(np.random.default_rng(1).random((N, C)) < 0.4)
  server = jax.jit(method.init_server)(key, seen)

  rng = np.random.default_rng(0)

  # Jitted, as the engine runs them (and compiled once, not op by op).
  path = uplink.Uplink(after_rule=uplink.KeepWhenEmpty())
  agg = jax.jit(lambda server, participants, t: path.aggregate(
      method, server, participants, t, jax.random.PRNGKey(0)).server)
  receive = jax.jit(method.server_receive)

  if payload_shape is not None:  # a round that arrives: clients 0, 1 and 2
    server = receive(server, jnp.arange(3), random_uploads(payload_shape, 3, rng),
                     jnp.ones(3, bool))
  before = agg(server, jnp.arange(N) < 3, 0)
  after = before
  if payload_shape is not None:  # a round whose uploads (clients 3, 4) are all lost
    after = receive(after, jnp.array([3, 4]), random_uploads(payload_shape, 2, rng),
                    jnp.zeros(2, bool))
  after = agg(after, jnp.zeros(N, bool), 1)
  for path, a, b in zip(jax.tree_util.tree_leaves_with_path(before), jax.tree.leaves(before),
                        jax.tree.leaves(after)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                  err_msg=f'{name}: {jax.tree_util.keystr(path[0])}')


# ----------------------------------------------------------------------------------------------
# A simulator with every kind on (slow: compiled and run)
# ----------------------------------------------------------------------------------------------
ROUNDS = 3


def system_rounds(sim, state=None, rounds=ROUNDS):
  """(the state after `rounds` rounds, each round's RoundInfo)."""
  state = sim.init_state() if state is None else state
  infos = []
  for _ in range(rounds):
    state, (info,) = sim.run_round(state)
    infos.append(info)
  return state, infos


@pytest.fixture(scope='module')
def device_run(small_ds):
  sim = make_small_sim(small_ds, 'fedssa', **EVERY_KIND)
  return sim, *system_rounds(sim)


def assert_same_federation(a, b, what):
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x.cohort, y.cohort, err_msg=what)
    for f in ('sampled', 'dropped', 'stragglers', 'work', 'lost', 'late', 'received'):
      np.testing.assert_array_equal(getattr(x.system, f), getattr(y.system, f),
                                    err_msg=f'{what}: {f}')
    assert x.system.online == y.system.online, what
    np.testing.assert_allclose(x.system.seconds, y.system.seconds, rtol=1e-6, err_msg=what)
    assert x.train_loss == pytest.approx(y.train_loss, rel=1e-5), what


@pytest.mark.slow
def test_every_kind_happens_and_the_records_say_so(device_run):
  sim, _, infos = device_run
  s = [i.system for i in infos]
  # The draws of this config (seed 0) hold each kind at least once in three rounds.
  assert any(len(x.dropped) for x in s) and any(len(x.stragglers) for x in s)
  assert any(len(x.lost) for x in s) and any(len(x.late) for x in s)
  assert any(x.online < N for x in s) and all(len(x.sampled) <= sim.k for x in s)
  for t, (info, x) in enumerate(zip(infos, s)):
    draws = sim.system.round_draws(0, t)
    np.testing.assert_array_equal(x.lost, info.cohort[draws.lost[info.cohort]])
    np.testing.assert_array_equal(np.sort(np.concatenate([x.lost, x.late, x.received])),
                                  info.cohort)
    assert (x.seconds[np.isin(info.cohort, x.late)] > 0.2).all()
    assert (x.seconds[np.isin(info.cohort, x.received)] <= 0.2).all()
    assert x.round_seconds == pytest.approx(min(x.seconds.max(initial=0), 0.2))
    # A straggler runs floor(f S) of its S = ceil(n / B) steps (E = 1).
    steps = -(-sim.train_n[0][info.cohort] // 16)
    want = np.where(draws.work[info.cohort] < 1,
                    np.floor(draws.work[info.cohort] * steps.astype(np.float32)), steps)
    np.testing.assert_array_equal(info.train_steps, want)


@pytest.mark.slow
@pytest.mark.parametrize('store', ['host', 'disk'])
def test_the_stores_draw_and_train_alike(device_run, small_ds, store, tmp_path):
  _, _, infos = device_run
  sim = make_small_sim(small_ds, 'fedssa', workdir=str(tmp_path), population_store=store,
                       **EVERY_KIND)
  assert_same_federation(system_rounds(sim)[1], infos, store)


@pytest.mark.slow
def test_a_seed_packed_with_another_draws_and_trains_as_alone(device_run, small_ds):
  from fedssa_jax import data  # pylint: disable=g-import-not-at-top
  _, _, infos = device_run
  c = make_small_sim(small_ds, 'fedssa', **EVERY_KIND).config
  configs = [c.copy_and_resolve_references() for _ in range(2)]
  configs[0].seed = 3
  sim = simulator.Simulator(configs[1], small_ds,
                            [data.partition_from_config(x, small_ds) for x in configs],
                            seeds=(3, 0))
  state = sim.init_state()
  packed = []
  for _ in range(ROUNDS):
    state, (_, info) = sim.run_round(state)
    packed.append(info)
  assert_same_federation(packed, infos, 'seed 0 packed after seed 3')


@pytest.mark.slow
def test_a_lost_upload_and_a_dropout_are_exactly_what_they_say(device_run, monkeypatch):
  """Round 0 from the same state, all clients online, three ways: client c's upload lost, no
  upload lost, c dropped out. Lost: every model as with no loss, the server as without c.
  Dropped: c's model as it started, the others' and the server as with the loss."""
  sim = device_run[0]
  n = sim.num_clients
  c = int(schedule.sample_cohort(0, 0, n, sim.k)[0])  # in round 0's cohort, all online

  def round_with(lost=(), dropped=()):
    draws = system.RoundDraws(online=np.ones(n, bool), dropped=np.isin(np.arange(n), dropped),
                              work=np.ones(n, np.float32), lost=np.isin(np.arange(n), lost))
    monkeypatch.setattr(sim.system, 'round_draws', lambda seed, t: draws)
    monkeypatch.setattr(sim.system, 'deadline', np.inf)  # no late upload
    state = sim.init_state()
    initial = jax.tree.map(np.asarray, state.population.params)
    state, (info,) = sim.run_round(state)
    return (initial, jax.tree.map(np.asarray, state.population.params),
            jax.tree.map(np.asarray, state.server), info)

  init, p_lost, s_lost, i_lost = round_with(lost=[c])
  _, p_ok, s_ok, _ = round_with()
  _, p_drop, s_drop, i_drop = round_with(dropped=[c])
  np.testing.assert_array_equal(i_lost.system.lost, [c])
  assert c not in i_drop.cohort and c in i_drop.system.dropped
  eq = lambda a, b: jax.tree.map(np.testing.assert_array_equal, a, b)
  eq(p_lost, p_ok)         # a lost upload: the client keeps its trained model
  eq(s_lost, s_drop)       # ... and the server never saw it
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(s_ok),
                                                      jax.tree.leaves(s_lost)))
  for k in range(n):       # a dropout: its model unchanged, the others trained alike
    want = init if k == c else p_lost
    eq(jax.tree.map(lambda a: a[:, sim.slot_of[k]], p_drop[sim.group_of[k]]),
       jax.tree.map(lambda a: a[:, sim.slot_of[k]], want[sim.group_of[k]]))
