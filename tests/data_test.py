import time
import types

import numpy as np
import pytest

from fedssa_jax import data
from fedssa_jax.data import datasets
from fedssa_jax.engine import snapshots
from conftest import synthetic_dataset


@pytest.fixture(scope='module')
def small_ds():
  """600 training and 200 test images: the counts these partition checks are written for
  (conftest's small_ds is smaller, for the simulators' sake)."""
  return synthetic_dataset(600, 200)


@pytest.mark.parametrize('n,k,s', [(10, 2, 10), (50, 2, 10), (100, 2, 10), (20, 10, 100),
                                   (50, 10, 100), (7, 10, 10)])
def test_pathological_shares_properties(n, k, s):
  shares = data.pathological_shares(n, s, k, np.random.default_rng(n))
  owns = shares > 0
  assert (owns.sum(axis=1) == k).all()                   # every client has exactly k classes
  assert (owns.sum(axis=0) == k * n // s).all()          # every class has kN/S holders
  np.testing.assert_allclose(shares.sum(axis=0), 1.0)    # a class is fully handed out
  # Each holder's weight came from U(0.4, 0.6) before normalisation: ratios within 1.5x.
  for col in shares.T:
    w = col[col > 0]
    assert w.max() / w.min() <= 1.5 + 1e-9


def test_pathological_rejects_fractional_holders_and_large_k():
  with pytest.raises(data.DataError, match='whole'):
    data.pathological_shares(7, 10, 2, np.random.default_rng(0))
  with pytest.raises(data.DataError, match='classes_per_client'):
    data.pathological_shares(10, 10, 11, np.random.default_rng(0))


def test_pathological_partition_splits(small_ds):
  cd = data.partition(small_ds, 10, 'pathological', classes_per_client=2, seed=3)
  labels = small_ds.labels
  all_idx = []
  for c in range(10):
    sets = {name: getattr(cd, f'{name}_idx')[c, :getattr(cd, f'{name}_n')[c]]
            for name in data.SPLITS}
    classes = {name: set(labels[v].tolist()) for name, v in sets.items()}
    assert len(classes['train']) == 2
    assert classes['test'] <= classes['train'] and classes['val'] <= classes['train']
    np.testing.assert_array_equal(np.flatnonzero(cd.seen[c]), sorted(classes['train']))
    for v in sets.values():
      all_idx.extend(v.tolist())
  # Disjoint across clients and splits, and every sample is handed out exactly once.
  assert len(all_idx) == len(set(all_idx)) == len(labels)
  # Reference scheme: the test pool is the TFDS test split; train+val come from TFDS train.
  test_pool = set(small_ds.tfds_splits['test'].tolist())
  for c in range(10):
    assert set(cd.test_idx[c, :cd.test_n[c]].tolist()) <= test_pool
  assert cd.val_n.sum() == 600 // 5 and cd.train_n.sum() == 600 - 600 // 5


def test_same_class_shares_in_train_and_test():
  ds = synthetic_dataset(num_train=4000, num_test=4000)
  cd = data.partition(ds, 10, 'pathological', classes_per_client=2, scheme='reference', seed=1)
  # A client's share of each class is the same in the train pool and in the test pool.
  pool_tr = sum(np.bincount(ds.labels[cd.train_idx[c, :cd.train_n[c]]], minlength=10)
                for c in range(10))
  pool_te = sum(np.bincount(ds.labels[cd.test_idx[c, :cd.test_n[c]]], minlength=10)
                for c in range(10))
  for c in range(10):
    tr = np.bincount(ds.labels[cd.train_idx[c, :cd.train_n[c]]], minlength=10) / pool_tr
    te = np.bincount(ds.labels[cd.test_idx[c, :cd.test_n[c]]], minlength=10) / pool_te
    np.testing.assert_allclose(tr, te, atol=0.005)


def test_paper_scheme_splits_811(small_ds):
  cd = data.partition(small_ds, 5, 'pathological', classes_per_client=2, scheme='paper')
  total = cd.train_n + cd.val_n + cd.test_n
  assert total.sum() == len(small_ds.labels)
  np.testing.assert_allclose(cd.train_n / total, 0.8, atol=0.02)
  np.testing.assert_allclose(cd.test_n / total, 0.1, atol=0.02)


def test_dirichlet_reproducible_and_respects_minimum(small_ds):
  a = data.partition(small_ds, 8, 'dirichlet', dirichlet_gamma=0.3, dirichlet_min_train=20,
                     seed=5)
  b = data.partition(small_ds, 8, 'dirichlet', dirichlet_gamma=0.3, dirichlet_min_train=20,
                     seed=5)
  c = data.partition(small_ds, 8, 'dirichlet', dirichlet_gamma=0.3, dirichlet_min_train=20,
                     seed=6)
  assert data.fingerprint(a) == data.fingerprint(b) != data.fingerprint(c)
  assert a.train_n.min() >= 20 and a.test_n.min() >= 1
  assert a.train_n.sum() == 480  # every training sample is handed out


def test_dirichlet_impossible_minimum_names_the_fix(small_ds):
  with pytest.raises(data.DataError, match='dirichlet_min_train'):
    data.partition(small_ds, 8, 'dirichlet', dirichlet_min_train=100, max_redraws=5)
  with pytest.raises(data.DataError, match='dirichlet_gamma'):
    data.partition(small_ds, 8, 'dirichlet', dirichlet_gamma=0.0)


def test_padded_layout(small_ds):
  cd = data.partition(small_ds, 10, 'pathological', classes_per_client=2)
  assert cd.train_idx.shape == (10, cd.train_n.max()) and cd.train_idx.dtype == np.int32
  for c in range(10):
    assert (cd.train_idx[c, cd.train_n[c]:] == 0).all()


# -- Any TFDS image data set (tfds.testing.mock_data: random images of the builder's shapes) ----

# (TFDS name, image_size, the shape the images load with, classes): grayscale at its own size, an
# RGB set other than CIFAR, and one whose images vary in size, resized.
MOCK_SETS = (('mnist', 0, (28, 28, 1), 10), ('svhn_cropped', 0, (32, 32, 3), 10),
             ('oxford_flowers102', 16, (16, 16, 3), 102))
MOCK_EXAMPLES = 100  # per split


def load_mock(name, image_size=0):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES):
    return data.load_dataset(name, image_size=image_size)


@pytest.mark.parametrize('name,image_size,shape,classes', MOCK_SETS, ids=[m[0] for m in MOCK_SETS])
def test_any_tfds_image_data_set_loads_with_its_metadata(name, image_size, shape, classes):
  ds = load_mock(name, image_size)
  assert ds.images.shape == (2 * MOCK_EXAMPLES, *shape) and ds.images.dtype == np.uint8
  assert ds.image_shape == shape and ds.num_classes == classes
  assert ds.labels.min() >= 0 and ds.labels.max() < classes
  # Its normalisation: the per-channel statistics of its training images, in [0, 1] units.
  train = ds.images[ds.tfds_splits['train']].reshape(-1, shape[2]) / 255.0
  assert len(ds.mean) == len(ds.std) == shape[2]
  np.testing.assert_allclose(ds.mean, train.mean(axis=0), rtol=1e-9)
  np.testing.assert_allclose(ds.std, train.std(axis=0), rtol=1e-9)
  facts = data.dataset_facts(name)
  assert facts.num_classes == classes and facts.image_shape[2] == shape[2]


def test_cifar_keeps_the_reference_normalisation_and_resizing_keeps_channels():
  ds = load_mock('cifar10', image_size=20)
  assert ds.image_shape == (20, 20, 3)
  assert (ds.mean, ds.std) == data.NORMALIZATION['cifar10']  # the constants, not computed
  assert load_mock('mnist', image_size=32).image_shape == (32, 32, 1)  # grayscale stays grayscale


def test_resize_is_bilinear_per_channel_and_a_no_op_at_the_same_size():
  rng = np.random.default_rng(0)
  image = rng.integers(0, 256, (28, 20, 2), dtype=np.uint8)
  assert data.resize(image, 28) is not image and data.resize(image, 28).shape == (28, 28, 2)
  square = image[:20]
  assert data.resize(square, 20) is square
  flat = np.full((40, 40, 1), 77, np.uint8)
  np.testing.assert_array_equal(data.resize(flat, 16), np.full((16, 16, 1), 77, np.uint8))


def test_images_without_a_fixed_size_need_image_size():
  with pytest.raises(data.DataError, match=r'no fixed size .*--config.image_size=32'):
    load_mock('oxford_flowers102')
  with pytest.raises(data.DataError, match=r'image_size=8 is too small.*--config.image_size=32'):
    load_mock('mnist', image_size=8)
  with pytest.raises(data.UnknownDatasetError, match="Unknown dataset 'no_such_data'"):
    data.load_dataset('no_such_data')


def test_facts_use_the_builders_split_sizes_where_it_has_them(monkeypatch):
  """A prepared data set's metadata gives its training-set size (config_lib.validate checks
  num_clients against it); an unprepared builder's does not, and the check is skipped."""
  assert data.dataset_facts('kmnist').train_examples is None
  info = types.SimpleNamespace(features=datasets._builder('kmnist', None).info.features,
                               splits={'train': types.SimpleNamespace(num_examples=60)})
  prepared = types.SimpleNamespace(name='kmnist', data_dir='/prepared', info=info,
                                   is_prepared=lambda: True)
  monkeypatch.setattr(datasets, '_builder', lambda name, data_dir: prepared)
  facts = data.dataset_facts('kmnist', '/prepared')
  assert (facts.num_classes, facts.image_shape, facts.train_examples) == (10, (28, 28, 1), 60)


def test_a_partition_that_cannot_be_built_is_a_config_error():
  from fedssa_jax import config_lib  # pylint: disable=g-import-not-at-top
  ds = synthetic_dataset(num_train=50, num_test=20)  # 4 training-pool samples of each class
  c = config_lib.build('cifar10', 'hetero,tiny')
  c.num_clients = 25  # k*N/S = 5 holders for each class's 4 samples
  with pytest.raises(config_lib.ConfigError, match=r"class \d has 4 sample\(s\) in the 'train' "
                     r'pool for its 5 holders.*--config.partition.kind=dirichlet'):
    data.partition_from_config(c, ds)
  c.num_clients, c.partition.classes_per_client = 5, 11
  with pytest.raises(config_lib.ConfigError, match=r'classes_per_client=11 must be in \[1, 10\]'):
    data.partition_from_config(c, ds)


@pytest.mark.slow  # three simulators compiled and run
def test_one_fedssa_round_on_each_mock_data_set():
  """One round of FedSSA through the engine, and an evaluation, on each data set of MOCK_SETS:
  the CNN-5 built for its shape and classes (the flowers' 102 over a Dirichlet partition: 80
  training images cannot give 5 clients 2 of 102 classes each)."""
  from conftest import make_small_sim  # pylint: disable=g-import-not-at-top
  for name, image_size, shape, classes in MOCK_SETS:
    ds = load_mock(name, image_size)
    partition = {'partition.kind': 'dirichlet', 'partition.dirichlet_min_train': 4} \
        if classes > 10 else {}
    sim = make_small_sim(ds, 'fedssa', dataset=name, image_size=image_size, batch_size=8,
                         eval_batch_size=8, **partition)
    state = sim.init_state()
    # the group's stacked clients
    params = snapshots.seed_state(sim.store, state).population.params[0]
    assert params['conv1']['kernel'].shape[1:] == (5, 5, shape[2], 16)
    assert params['fc3']['kernel'].shape[1:] == (500, classes)
    state, (info,) = sim.run_round(state)
    assert np.isfinite(info.train_loss) and info.train_samples.sum() > 0, name
    assert info.client_flops > 0 and info.up_floats == 501 * sim.seen[0][info.cohort].sum()
    ev = sim.evaluate(state)
    assert 0 <= ev.accuracy.min() and ev.accuracy.max() <= 1, name


# -- The resampling partition (docs/algorithm.md §2) -------------------------------------------

def labels_only_dataset(num_train, num_test, num_classes=10):
  """A data set of labels (and 1-pixel images): what a partition reads."""
  m = num_train + num_test
  labels = (np.arange(m) % num_classes).astype(np.int32)
  return data.Dataset('cifar10', np.zeros((m, 1, 1, 1), np.uint8), labels, num_classes,
                      (0.5,), (0.5,),
                      {'train': np.arange(num_train), 'test': np.arange(num_train, m)})


def test_resample_draws_each_clients_samples_from_its_mixture_as_a_loop_does(small_ds):
  """Every client gets exactly its counts, from the reference scheme's train and test pools,
  its class counts multinomial from its Dirichlet mixture, each sample uniform within its
  class: the same indices as a plain per-client, per-sample loop over the same draws."""
  n, n_train, n_test, gamma, seed = 30, 40, 10, 0.5, 3
  cd = data.partition(small_ds, n, 'resample', dirichlet_gamma=gamma, seed=seed,
                      resample_train=n_train, resample_test=n_test)
  assert (cd.train_n == n_train).all() and (cd.test_n == n_test).all() and not cd.val_n.any()
  rng = np.random.default_rng(seed)
  pools = data.make_pools(small_ds, 'reference', rng)
  mixtures = rng.dirichlet(np.full(10, gamma), size=n)
  for split, count, got in (('train', n_train, cd.train_idx), ('test', n_test, cd.test_idx)):
    members = [pools[split][small_ds.labels[pools[split]] == s] for s in range(10)]
    counts = [rng.multinomial(count, mixtures[k]) for k in range(n)]
    v = rng.random((n, count))
    for k in range(n):
      classes = [s for s in range(10) for _ in range(counts[k][s])]
      want = [members[s][int(v[k, j] * len(members[s]))] for j, s in enumerate(classes)]
      np.testing.assert_array_equal(got[k], np.sort(want))
    assert np.isin(got, pools[split]).all()
  seen = np.zeros((n, 10), bool)
  for k in range(n):
    seen[k, small_ds.labels[cd.train_idx[k]]] = True
  np.testing.assert_array_equal(cd.seen, seen)


def test_resample_class_frequencies_follow_the_mixtures_and_the_seed():
  ds = labels_only_dataset(5000, 1000)
  cd = data.partition(ds, 4, 'resample', dirichlet_gamma=1.0, seed=1, resample_train=4000)
  mixtures = np.random.default_rng(1)
  data.make_pools(ds, 'reference', mixtures)
  mixtures = mixtures.dirichlet(np.ones(10), size=4)
  freq = np.stack([np.bincount(ds.labels[row], minlength=10) for row in cd.train_idx]) / 4000
  assert np.abs(freq - mixtures).max() < 0.04  # 4000 draws: sd <= 0.008
  again = data.partition(ds, 4, 'resample', dirichlet_gamma=1.0, seed=1, resample_train=4000)
  other = data.partition(ds, 4, 'resample', dirichlet_gamma=1.0, seed=2, resample_train=4000)
  assert data.fingerprint(cd) == data.fingerprint(again) != data.fingerprint(other)


def test_resample_builds_100000_clients_in_seconds():
  """More clients than training images (samples repeat across clients), vectorised: CIFAR's
  pools, 100,000 clients of 40 training and 10 test samples."""
  ds = labels_only_dataset(50_000, 10_000)
  t0 = time.perf_counter()
  cd = data.partition(ds, 100_000, 'resample', seed=0)
  assert time.perf_counter() - t0 < 10  # about 0.5 s on an idle core
  assert cd.train_idx.shape == (100_000, 40) and cd.test_idx.shape == (100_000, 10)
  assert cd.seen.any(axis=1).all() and (cd.test_n >= 1).all()


def test_n1000_partition_gives_every_client_training_and_test_data():
  """The n1000 variant's Dirichlet partition on CIFAR-10's pools (50,000 / 10,000 images):
  every client has at least 11 training samples (FedL2G holds 10 out) and a test sample."""
  from fedssa_jax import config_lib  # pylint: disable=import-outside-toplevel
  c = config_lib.build('cifar10', 'hetero,n1000')
  assert (c.num_clients, c.participation, c.local_epochs) == (1000, 0.1, 1)
  config_lib.validate(c)
  cd = data.partition_from_config(c, labels_only_dataset(50_000, 10_000))
  assert cd.train_n.min() >= 11 and cd.test_n.min() >= 1
  assert c.partition.dirichlet_min_train > config_lib.base_config().fedl2g.quiz_size


def test_resample_config_checks():
  from fedssa_jax import config_lib  # pylint: disable=import-outside-toplevel
  c = config_lib.build('cifar10', 'hetero')
  c.num_clients, c.partition.kind = 100_000, 'dirichlet'
  with pytest.raises(config_lib.ConfigError, match='partition.kind=resample'):
    config_lib.validate(c)
  c.partition.kind = 'resample'
  config_lib.validate(c)  # more clients than images: samples repeat
  c.partition.scheme = 'paper'
  with pytest.raises(config_lib.ConfigError, match="partition.scheme='reference'"):
    config_lib.validate(c)
  c.partition.scheme, c.partition.resample_train = 'reference', 0
  with pytest.raises(config_lib.ConfigError, match='resample_train must be >= 1'):
    config_lib.validate(c)
