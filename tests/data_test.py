import numpy as np
import pytest

from fedssa_jax import data
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
