"""Shared fixtures and helpers: small synthetic data sets that need no TFDS, small simulators
and rounds run by hand, and the plain references the method tests compare against."""
import functools
import importlib.util
import os
import random
import sys
import tempfile

# The suite compiles hundreds of small programs and runs each on a few images, so XLA's compile
# time matters more than the speed of what it compiles. Two flags of XLA's CPU backend, each
# set unless the caller set it (tests/README.md has the measurements):
# - `xla_cpu_use_fusion_emitters=false`: fusions go through XLA's older emitters, not its MLIR
#   fusion emitters, whose compiles cost most of a small program's: tests/client_test.py took
#   33-37 s of CPU against 61-66 s with them;
# - `xla_backend_optimization_level=0` (LLVM's passes): its programs run slower, but the whole
#   suite took 13 min 6 s against 15 min 22 s at the default level.
# Set before JAX starts a backend; exported, so the subprocesses the tests start get them too.
# (Beside the package's own, fedssa_jax.XLA_FLAGS, set when it is imported.)
TEST_XLA_FLAGS = {'xla_cpu_use_fusion_emitters': 'false', 'xla_backend_optimization_level': '0'}
import fedssa_jax  # pylint: disable=g-import-not-at-top,wrong-import-position

os.environ['XLA_FLAGS'] = fedssa_jax.with_xla_flags(os.environ.get('XLA_FLAGS', ''),
                                                    TEST_XLA_FLAGS)

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

from fedssa_jax import data  # pylint: disable=g-import-not-at-top,wrong-import-position

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_file(path: str, name: str | None = None):
  """The module of a file of the repository that is no package module (a launch script, a
  config file), by its path from the repository root; registered in sys.modules as `name`."""
  name = name or os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, path))
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module

# Full float32 matmuls and convolutions: on GPUs JAX's default (TF32) rounds to ~1e-3, which
# would blur the vectorised-equals-plain comparisons. Runs keep the backend's default.
jax.config.update('jax_default_matmul_precision', 'highest')
# One persistent XLA cache for the session: the suite's many small simulators (each a new set of
# jitted functions) compile the same programs again and again; later ones load them instead. It
# is exported, so the runs the tests start as subprocesses (which inherit the environment, and
# may import this file) share it; a cache the caller set is kept.
if not os.environ.get('JAX_COMPILATION_CACHE_DIR'):
  os.environ['JAX_COMPILATION_CACHE_DIR'] = tempfile.mkdtemp(prefix='fedssa_test_xla_')
# Every program is written, the tiny ones too: a threshold of 0.1 s saved 5% of the CPU of the
# client, FedProto and FD tests (68 s against 72 s), but the full suite's compiles rose (368 s
# against 320 s, from a fresh clone against a checkout), so it is left at 0.
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')
jax.config.update('jax_compilation_cache_dir', os.environ['JAX_COMPILATION_CACHE_DIR'])
jax.config.update('jax_persistent_cache_min_compile_time_secs',
                  float(os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS']))
jax.config.update('jax_persistent_cache_min_entry_size_bytes',
                  int(os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES']))


# The files by the time they take, longest first: pytest-xdist hands out whole files in
# collection order (setup.cfg: --dist loadfile --no-loadscope-reorder), so the long ones start
# at once and the short ones fill the workers in at the end (longest processing time first: a
# long file handed out last leaves the other worker idle while it runs). A file missing here
# runs after them all, so a new file of more than a few seconds belongs in this list, by the
# slowest durations every run prints; the order changes nothing else.
LONGEST_FILES = ('sharding_test.py', 'multihost_test.py', 'main_every_method_test.py',
                 'privacy_test.py', 'zoo_test.py', 'checkpoint_test.py', 'sweep_test.py',
                 'replicas_test.py', 'engine_test.py', 'model_state_test.py', 'system_test.py',
                 'method_fedkd_test.py', 'population_test.py', 'client_test.py', 'bench_test.py',
                 'main_bad_input_test.py', 'report_test.py', 'method_fedmrl_test.py',
                 'method_fedsa_test.py', 'method_standalone_test.py', 'method_fedssa_test.py',
                 'data_test.py', 'precision_test.py', 'models_test.py',
                 'method_fedclassavg_test.py', 'method_fedgen_test.py',
                 'privacy_releases_test.py', 'audit_test.py', 'generalization_test.py',
                 'method_fedl2g_test.py', 'method_fedorgp_test.py', 'method_fml_test.py',
                 'method_fedproto_test.py', 'method_fd_test.py', 'method_fedgh_test.py',
                 'main_test.py', 'per_call_test.py', 'method_fedtgp_test.py', 'compare_test.py',
                 'feature_dim_test.py')


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
  rank = lambda item: (LONGEST_FILES.index(item.path.name) if item.path.name in LONGEST_FILES
                       else len(LONGEST_FILES))
  items.sort(key=rank)  # stable: each file's own order (its fixtures' grouping) is kept


def cpu_devices_env(devices: int, **more) -> dict:
  """The environment of a subprocess with `devices` fake CPU devices and this checkout on its
  path: the caller's XLA flags kept (conftest's optimisation level), but for the device count."""
  flags = [f for f in os.environ.get('XLA_FLAGS', '').split()
           if not f.startswith('--xla_force_host_platform_device_count')]
  return dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS='cpu', XLA_FLAGS=' '.join(
      [*flags, f'--xla_force_host_platform_device_count={devices}']), **more)


def synthetic_dataset(num_train=300, num_test=100, num_classes=10, seed=0, name='cifar10'):
  rng = np.random.default_rng(seed)
  m = num_train + num_test
  labels = np.concatenate([np.arange(num_train) % num_classes,
                           np.arange(num_test) % num_classes]).astype(np.int32)
  # Class-dependent colour, so that a few steps of training make visible progress.
  base = (labels[:, None] * 23 % 255).astype(np.float64)
  images = np.clip(base[:, None, None, :] + rng.normal(0, 40, (m, 32, 32, 3)), 0, 255)
  mean, std = data.NORMALIZATION[name]
  return data.Dataset(name, images.astype(np.uint8), labels, num_classes, mean, std,
                      {'train': np.arange(num_train), 'test': np.arange(num_train, m)})


def write_tiny_tfds_cifar10(data_dir, num_train=100, num_test=50, file_format=None):
  """A prepared TFDS 'cifar10' of a few synthetic images, as launch/prepare_offline.py
  writes the real one: the builder's own metadata, only the examples are local. `file_format`:
  TFDS's default (None), or e.g. 'array_record' (what prepare_offline.py and a download write)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from tensorflow_datasets.image_classification import cifar  # pylint: disable=g-import-not-at-top
  ds = synthetic_dataset(num_train, num_test)

  def examples(split):
    for i in ds.tfds_splits[split]:
      key = f'{split}_{i:05d}'
      yield key, {'id': key, 'image': ds.images[i], 'label': int(ds.labels[i])}

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(cifar.Cifar10, '_split_generators',
               lambda self, dl_manager: {'train': examples('train'), 'test': examples('test')})
    tfds.builder('cifar10', data_dir=data_dir).download_and_prepare(file_format=file_format)


@pytest.fixture(scope='session')
def small_ds():
  return synthetic_dataset()


def make_small_sim(ds, method, workdir=None, **overrides):
  """A Simulator of 5 CNN-5 clients, K = 2, batch 16, E = 1, on `ds` (N a multiple of 5, so
  that 2 classes each split the 10 classes); `workdir`: the disk store's."""
  from fedssa_jax import config_lib  # pylint: disable=g-import-not-at-top
  from fedssa_jax.engine import simulator
  c = config_lib.build('cifar10', 'hetero,tiny')
  c.method, c.model.families = method, ('cnn5',)
  c.num_clients, c.participation = 5, 0.4
  c.num_rounds, c.local_epochs, c.batch_size, c.eval_batch_size = 2, 1, 16, 16
  c.update_from_flattened_dict(overrides)
  return simulator.Simulator(c, ds, data.partition_from_config(c, ds), workdir)


@pytest.fixture(scope='session')
def few_images():
  """100 training and 50 test images (20 a client of make_small_sim's five): for tests whose
  time is training, not compiling (a ResNet's steps, DP-SGD's per-example work), which the
  tests' XLA level runs slowly (its convolutions' gradients about 10x slower)."""
  return synthetic_dataset(num_train=100, num_test=50)


@pytest.fixture
def small_sim(small_ds):
  """make(method, **overrides): make_small_sim on small_ds."""
  return lambda method, **overrides: make_small_sim(small_ds, method, **overrides)


def rounds(sim, num_rounds, state=None):
  """Yields (state, info) after each of `num_rounds` rounds of `sim`, run one by one as the
  training loop does, from `state` (default: the initial state)."""
  state = sim.init_state() if state is None else state
  for _ in range(num_rounds):
    state, (info,) = sim.run_round(state)
    yield state, info


def params_of(sim, params, k):
  """Client k's parameters, as numpy arrays, out of a state's per-family stacks `params`."""
  return jax.tree.map(lambda a: np.asarray(a[0, sim.slot_of[k]]), params[sim.group_of[k]])


def assert_floats_each_way(info, floats):
  """Each participant of the round sent `floats` floats up and received as many."""
  want = np.broadcast_to(floats, np.shape(info.cohort))
  np.testing.assert_array_equal(info.client_up_floats, want)
  np.testing.assert_array_equal(info.client_down_floats, want)


def capturing_round_infos(monkeypatch):
  """{(packed, seed): [RoundInfo of each round]}, filled as runs log their rounds (train's
  console line): packed is whether the run was a replica of packed seeds."""
  from fedssa_jax.run import outputs  # pylint: disable=g-import-not-at-top
  infos = {}
  log_round = outputs.log_round

  def capture(config, rounds_done, record, info, round_times, prefix='', *rest):
    infos.setdefault((bool(prefix), config.seed), []).append(info)  # a replica: 'seed S: '
    return log_round(config, rounds_done, record, info, round_times, prefix, *rest)
  monkeypatch.setattr(outputs, 'log_round', capture)
  return infos


def assert_same_round_infos(packed, alone, what=''):
  """Each participant's figures of each round, exactly, and the loss sums to float rounding."""
  assert len(packed) == len(alone), what
  for p, a in zip(packed, alone):
    for f in ('cohort', 'train_samples', 'train_steps', 'client_up_floats',
              'client_down_floats'):
      np.testing.assert_array_equal(getattr(p, f), getattr(a, f), err_msg=f'{what}: {f}')
    np.testing.assert_allclose(p.train_loss_sum, a.train_loss_sum, rtol=1e-5, err_msg=what)


def assert_same_records(records_p, records_a, what=''):
  """metrics.jsonl records of two runs of one seed (packed, alone): counts exactly, accuracies
  to 1e-9, losses and FLOPs to float rounding; timings are not compared."""
  assert len(records_p) == len(records_a), what
  for a, p in zip(records_a, records_p):
    for key in ('round', 'participants', 'up_floats', 'down_floats', 'cum_floats',
                'evaluated_clients'):
      assert p[key] == a[key], (what, a['round'], key)
    # The system section's draws and arrivals, where it is on.
    for key in ('online', 'sampled', 'dropped', 'stragglers', 'lost_uploads', 'late_uploads',
                'received'):
      assert p.get(key) == a.get(key), (what, a['round'], key)
    for key in ('mean_accuracy', 'client_accuracy', 'participant_accuracy_reference'):
      if a[key] is None:  # a round without an evaluated participant
        assert p[key] is None, (what, a['round'], key)
        continue
      np.testing.assert_allclose(p[key], a[key], atol=1e-9, err_msg=f'{what}: {key}')
    for key in ('train_loss', 'train_accuracy', 'client_flops', 'cum_client_flops',
                'header_norm_max', 'header_norm_mean'):
      np.testing.assert_allclose(p[key], a[key], rtol=1e-5, err_msg=f'{what}: {key}')
    for name, value in a['method_metrics'].items():
      np.testing.assert_allclose(p['method_metrics'][name], value, atol=1e-9, err_msg=name)


def assert_same_last_checkpoint(workdir_a, workdir_b, rounds, what=''):
  """The last checkpoints of two runs: both of round `rounds`, every array of the state equal to
  float rounding: rtol 1e-3, and atol 1e-6 or 1e-5 of the array's largest magnitude, whichever
  is larger (an element near 0 of an array of large values carries their rounding: FedL2G's
  guiding vectors, N(0, 1) moved by steps of lr 100)."""
  from fedssa_jax.run import checkpoint  # pylint: disable=g-import-not-at-top
  states = [checkpoint.Checkpointer(os.path.join(w, 'checkpoints')).restore_latest()
            for w in (workdir_a, workdir_b)]
  assert states[0].step == states[1].step == rounds, what
  (sa, ta), (sb, tb) = [jax.tree_util.tree_flatten_with_path(s.state) for s in states]
  assert ta == tb, what
  for (path, x), (_, y) in zip(sa, sb):
    x, y = np.asarray(x), np.asarray(y)
    scale = float(np.abs(x).max()) if x.size and np.issubdtype(x.dtype, np.number) else 0.0
    np.testing.assert_allclose(y, x, rtol=1e-3, atol=max(1e-6, 1e-5 * scale),
                               err_msg=f'{what}: {jax.tree_util.keystr(path)}')


# -- Plain references for the method tests -----------------------------------------------------

def log_softmax(z):
  """log softmax over the last axis, in numpy."""
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def ce_loop(logits, y, valid):
  """(mean cross-entropy, number right) over the valid samples, one sample at a time."""
  ces, right = [], 0
  for z, t, v in zip(np.asarray(logits, np.float64), y, valid):
    if v:
      ces.append(np.logaddexp.reduce(z) - z[t])
      right += int(np.argmax(z) == t)
  return np.mean(ces), right


def random_params(model, seed, scale=0.05):
  """Random parameters of `model` without compiling its initialiser."""
  from fedssa_jax import models  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(lambda: models.init_params(model, jax.random.PRNGKey(0)))
  return jax.tree.map(lambda s: jnp.asarray(rng.normal(scale=scale, size=s.shape), jnp.float32),
                      shapes)


def stack_trees(trees):
  """One tree of stacked leaves (a leading client axis) from a list of trees."""
  return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def init_clients(model, k, seed=0):
  """k clients' initial parameters of `model`, stacked: vmapped init over split keys."""
  from fedssa_jax import models  # pylint: disable=g-import-not-at-top
  return jax.vmap(functools.partial(models.init_params, model))(
      jax.random.split(jax.random.PRNGKey(seed), k))


def padded_batches(rng, k, b, num_classes):
  """k clients' batches of b random images and labels; the last two samples of each batch are
  padding, and client 2's batch (k >= 3) holds a single valid sample. (x, y, valid)."""
  x = rng.normal(size=(k, b, 32, 32, 3)).astype(np.float32)
  y = rng.integers(0, num_classes, size=(k, b)).astype(np.int32)
  valid = np.ones((k, b), bool)
  valid[:, -2:] = False           # padding
  valid[2, 1:] = False            # a nearly empty batch
  return x, y, valid


def clients_loss(method, model, params, ctx, x, y, valid):
  """method.loss of k clients at once (vmapped and jitted, as the engine runs it), each on its
  own batch (x, y, valid) with its own context `ctx`. Returns (loss, (correct, accumulator))."""
  return jax.jit(jax.vmap(
      lambda p, ctx, v, y, m: method.loss(model.apply, {'model': p}, ctx, (v,), y, m)))(
          params, ctx, jnp.asarray(x), jnp.asarray(y), jnp.asarray(valid))


def client_view(client_id=0, seen=(), num_samples=0, round_index=0):
  """One client's methods.ClientView, as the engine builds it (int32 scalars, a [C] bool mask)."""
  from fedssa_jax import methods  # pylint: disable=g-import-not-at-top
  return methods.ClientView(id=jnp.asarray(client_id, jnp.int32), seen=jnp.asarray(seen, bool),
                            num_samples=jnp.asarray(num_samples, jnp.int32),
                            round=jnp.asarray(round_index, jnp.int32))


def aggregate(method, server, participants, round_index, jit=False):
  """method.server_aggregate's new server state (`jit`: run jitted), with a fixed key (which the
  methods tested with it do not draw from), checking that it reports no server FLOPs or
  diagnostics (those methods spend none; FedGH's and FedTGP's tests check theirs)."""
  fn = jax.jit(method.server_aggregate) if jit else method.server_aggregate
  agg = fn(server, jnp.asarray(participants), round_index, jax.random.PRNGKey(0))
  assert float(agg.flops) == 0 and agg.metrics == {}
  return agg.server


def two_rounds_of_uploads(method, server, payload):
  """The server side of two rounds of 5 clients: client 3 uploads in round 0; clients 0, 1 and 2
  in round 1, in two chunks, the first padded with a dummy (client 4's slot).
  `payload(ids)` is a chunk's upload. Returns the server and round 1's participants."""
  n = 5

  def receive(server, ids, active):
    return method.server_receive(server, jnp.asarray(ids), payload(np.asarray(ids)),
                                 jnp.asarray(active))
  server = receive(server, [3], [True])
  server = aggregate(method, server, np.arange(n) == 3, 0)
  server = receive(server, [0, 1, 4], [True, True, False])
  server = receive(server, [2], [True])
  participants = np.isin(np.arange(n), [0, 1, 2])
  return aggregate(method, server, participants, 1), participants


# Seeds of the tests' random choices, printed at the end of the session so that a failure can be
# drawn again (each test also shows its seed in its failure messages).
_LOGGED_SEEDS = {}


def logged_seed(var):
  """A seed for a test's random draw: $var if set, else a fresh one; logged as `var=seed`."""
  if var not in _LOGGED_SEEDS:
    _LOGGED_SEEDS[var] = int(os.environ.get(var) or random.SystemRandom().randrange(10**6))
  return _LOGGED_SEEDS[var]


# What XLA did for each test: XLA programs built (compiled, or loaded from the persistent cache),
# those loaded instead of compiled, and the seconds spent compiling or loading. Each test's report carries
# them (user_properties), so the terminal summary sums them over pytest-xdist's workers too; the
# cache's entries at the end count the distinct programs of the whole run, subprocesses included
# (they share its folder). The summary prints them: what a slow test costs.
_COUNTS = {'/jax/compilation_cache/cache_hits': 'loads'}
_BUILT = '/jax/core/compile/backend_compile_duration'  # one per program compiled or loaded
# Seconds of each stage of a jit's first call: tracing to a jaxpr, lowering it to MLIR (neither
# is saved by the persistent cache), and XLA's compile (or the cache's load).
_STAGES = {'/jax/core/compile/jaxpr_trace_duration': 'trace_s',
           '/jax/core/compile/jaxpr_to_mlir_module_duration': 'lower_s',
           '/jax/core/compile/backend_compile_duration': 'compile_s'}
_ZERO = {'built': 0, 'loads': 0, 'trace_s': 0.0, 'lower_s': 0.0, 'compile_s': 0.0}
_NOW = dict(_ZERO)  # the running test's, reset before each
_TOTAL = dict(_ZERO)  # summed from the reports
_COMPILE_SECONDS = {}  # test id -> seconds in XLA's compile (or cache load), from the reports
_SEEDS_KEY = 'random_draws'


def _count_event(event, **kwargs):
  del kwargs
  if event in _COUNTS:
    _NOW[_COUNTS[event]] += 1


def _count_duration(event, duration, **kwargs):
  del kwargs
  if event in _STAGES:
    _NOW[_STAGES[event]] += duration
  _NOW['built'] += event == _BUILT


jax.monitoring.register_event_listener(_count_event)
jax.monitoring.register_event_duration_secs_listener(_count_duration)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
  del item, nextitem
  _NOW.update(_ZERO)
  return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
  """The last report of a test (its teardown's) carries what its setup, call and teardown
  compiled, and the seeds drawn so far."""
  del item, call
  report = yield
  if report.when == 'teardown':
    report.user_properties += [('xla', dict(_NOW)), (_SEEDS_KEY, dict(_LOGGED_SEEDS))]
  return report


def pytest_runtest_logreport(report):
  if report.when != 'teardown':
    return
  props = dict(report.user_properties)
  xla = props.get('xla')
  if xla:
    for k in _TOTAL:
      _TOTAL[k] += xla[k]
    _COMPILE_SECONDS[report.nodeid] = xla['compile_s']
  _LOGGED_SEEDS.update(props.get(_SEEDS_KEY) or {})


def pytest_terminal_summary(terminalreporter):
  cache = os.environ['JAX_COMPILATION_CACHE_DIR']
  entries = len(os.listdir(cache)) if os.path.isdir(cache) else 0
  terminalreporter.write_line(
      f"XLA: the tests' processes compiled {_TOTAL['built'] - _TOTAL['loads']} programs and "
      f"loaded {_TOTAL['loads']} from the persistent cache, in {_TOTAL['compile_s']:.0f} s, "
      f"after {_TOTAL['trace_s']:.0f} s of tracing and {_TOTAL['lower_s']:.0f} s of lowering "
      f'(subprocesses not counted); {entries} distinct programs in the cache (subprocesses '
      'included)')
  top = sorted(_COMPILE_SECONDS.items(), key=lambda kv: -kv[1])[:10]
  if top:
    terminalreporter.write_line('XLA compile seconds of the 10 costliest tests: ' +
                                '; '.join(f'{t} {s:.1f}' for t, s in top))
  if _LOGGED_SEEDS:
    terminalreporter.write_line('random draws of this session (set these to repeat them): ' +
                                ' '.join(f'{k}={v}' for k, v in sorted(_LOGGED_SEEDS.items())))
