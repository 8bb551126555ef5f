"""The privacy audit (fedssa_jax/audit/): its canaries, its numbers against hand computations,
its power and soundness on the project's own mechanisms (DP-SGD's noisy clipped gradient, the
uploads' clip and noise) with many canaries and fixed seeds: no noise shows a large lower
bound, heavy noise one below the accounted epsilon, a mechanism whose noise is scaled down
(monkeypatched) one above it; and the command end to end."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import config_lib, data, privacy
from fedssa_jax.audit import canaries, run as audit_run, scores, uploads
from fedssa_jax.errors import ConfigError
from fedssa_jax.methods import aggregation
from fedssa_jax.privacy import dp_sgd

from conftest import REPO

DELTA = 1e-5


def tiny_config(**overrides):
  c = config_lib.build('cifar10', 'hetero,tiny')
  c.model.families, c.num_rounds = ('cnn5',), 1
  c.update_from_flattened_dict(overrides)
  return c


# ------------------------------------------------------------------------------------------
# Canaries and numbers
# ------------------------------------------------------------------------------------------
def test_canaries_are_outside_training_labelled_in_seen_classes_and_appended_if_included(
    small_ds):
  cd = data.partition_from_config(tiny_config(), small_ds)
  drawn = canaries.data_canaries(3, cd, small_ds.labels, 60)
  again = canaries.data_canaries(3, cd, small_ds.labels, 60)
  assert all(np.array_equal(getattr(drawn, f), getattr(again, f))
             for f in ('owner', 'image', 'label', 'included'))  # from the seed alone
  trained = {int(i) for k, n in enumerate(cd.train_n) for i in cd.train_idx[k, :n]}
  assert not trained & set(drawn.image.tolist()) and len(set(drawn.image.tolist())) == 60
  assert all(cd.seen[k, c] for k, c in zip(drawn.owner, drawn.label))
  assert (small_ds.labels[drawn.image] != drawn.label).all()
  assert 15 < drawn.included.sum() < 45
  ds2, cd2, rows = canaries.with_canaries(small_ds, cd, drawn)
  assert np.array_equal(ds2.images[rows], small_ds.images[drawn.image])
  assert np.array_equal(ds2.labels[rows], drawn.label)
  for k in range(cd.num_clients):
    mine = rows[(drawn.owner == k) & drawn.included]
    n = cd.train_n[k]
    assert np.array_equal(cd2.train_idx[k, :n], cd.train_idx[k, :n])
    assert sorted(cd2.train_idx[k, n:cd2.train_n[k]]) == sorted(mine)
  assert np.array_equal(cd2.seen, cd.seen) and np.array_equal(cd2.test_idx, cd.test_idx)


def test_mia_advantage_is_the_best_thresholds_tpr_minus_fpr_by_hand():
  rng = np.random.default_rng(0)
  members, others = rng.normal(0.5, 1, 40), rng.normal(0, 1, 30)
  best = max(max((members >= t).mean() - (others >= t).mean()
                 for t in np.concatenate([members, others])), 0.0)
  assert scores.mia_advantage(members, others) == pytest.approx(best)
  assert scores.mia_advantage([1, 2], [3, 4]) == 0.0
  assert scores.mia_advantage([3, 4], [1, 2]) == 1.0


def test_bad_input_is_a_config_error_naming_the_fix():
  with pytest.raises(ConfigError, match='--canaries=10 is too few.*--canaries=1000'):
    audit_run.check(tiny_config(), 10, 1000, 'auto')
  with pytest.raises(ConfigError, match='privacy.dp_sgd=True'):
    audit_run.check(tiny_config(), 100, 1000, 'dp_sgd')
  with pytest.raises(ConfigError, match='privacy.upload=True'):
    audit_run.check(tiny_config(), 100, 1000, 'upload')
  with pytest.raises(ConfigError, match='--upload_canaries=5'):
    audit_run.check(tiny_config(**{'privacy.upload': True}), 100, 5, 'auto')


# ------------------------------------------------------------------------------------------
# Power and soundness: DP-SGD's step
# ------------------------------------------------------------------------------------------
M = 1024  # canaries: each a one-hot example of norm 2 (clipped to C = 1) in M dimensions


def dp_sgd_audit(sigma: float) -> dict:
  """One DP-SGD step (privacy.noisy_clipped_grads) of a linear loss over M canaries, each
  included (a valid row of the batch) with probability 1/2; a canary's score is its
  coordinate of the released gradient, negated."""
  rng = np.random.default_rng(0)
  included = rng.random(M) < 0.5
  x = 2.0 * jnp.eye(M, dtype=jnp.float32)

  def loss_of(t, views, y, valid):
    del y, valid
    return -jnp.sum(t['w'] * views[0][0]), (jnp.zeros((), jnp.int32), jnp.zeros(()))

  _, _, _, grad = dp_sgd.noisy_clipped_grads(
      loss_of, {'w': jnp.zeros(M)}, (x,), jnp.zeros(M, jnp.int32), jnp.asarray(included),
      jax.random.PRNGKey(1), 1.0, clip_norm=1.0, noise_multiplier=sigma, pass_size=M,
      per_example='vmap')
  score = -np.asarray(grad['w'])
  accounted = privacy.epsilon('rdp', 1.0, sigma, 1, DELTA) if sigma else np.inf
  return scores.audit(score[included], score[~included], DELTA, accounted)


def test_without_noise_the_lower_bound_is_as_large_as_the_canaries_allow():
  out = dp_sgd_audit(0.0)
  assert out['epsilon'] is None and out['auroc'] == 1.0
  assert out['epsilon_lower'] > 4.0 and out['epsilon_lower'] == pytest.approx(
      out['ceiling'], rel=0.02)


def test_with_heavy_noise_the_lower_bound_stays_below_the_accounted_epsilon():
  out = dp_sgd_audit(3.0)
  assert out['epsilon'] == pytest.approx(1.386, abs=1e-3)
  assert out['epsilon_lower'] < out['epsilon'] and not out['exceeds']


def test_noise_scaled_down_is_flagged(monkeypatch):
  real = dp_sgd.add_noise
  monkeypatch.setattr(dp_sgd, 'add_noise', lambda g, key, std, denom: real(g, key, std / 10,
                                                                          denom))
  out = dp_sgd_audit(3.0)
  assert out['exceeds'] and out['epsilon_lower'] > 2 * out['epsilon']


# ------------------------------------------------------------------------------------------
# Power and soundness: the uploads' clip and noise (local and central)
# ------------------------------------------------------------------------------------------
def upload_audit(mode: str, z: float) -> dict:
  score, included = uploads.upload_scores(0, 256, 1, 10, clip=1.0, std=z, central=mode ==
                                          'central')
  return scores.audit(score[included], score[~included], DELTA,
                      privacy.upload_epsilon('rdp', z, 1, DELTA))


@pytest.mark.parametrize('mode', ['local', 'central'])
def test_the_uploads_audit_is_sound_and_flags_noise_scaled_down(mode, monkeypatch):
  tiny = upload_audit(mode, 0.02)  # little noise: the bound is the canaries' ceiling
  assert tiny['epsilon_lower'] == pytest.approx(tiny['ceiling'], rel=0.02)
  heavy = upload_audit(mode, 6.0)
  assert heavy['epsilon'] == pytest.approx(1.386, abs=1e-3)
  assert heavy['epsilon_lower'] < heavy['epsilon'] and not heavy['exceeds']
  real = aggregation.add_gaussian
  monkeypatch.setattr(aggregation, 'add_gaussian', lambda t, key, std: real(t, key, std / 10))
  uploads._round_scores.clear_cache()  # pylint: disable=protected-access
  try:
    broken = upload_audit(mode, 6.0)
  finally:
    uploads._round_scores.clear_cache()  # pylint: disable=protected-access
  assert broken['exceeds'] and broken['epsilon_lower'] > 2 * broken['epsilon']


# ------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------
@pytest.mark.slow  # a run, compiled
def test_the_command_writes_audit_json(tmp_path, small_ds, capsys):
  from fedssa_jax.audit import __main__ as cli  # pylint: disable=g-import-not-at-top
  argv = ['audit', f'--config={os.path.join(REPO, "configs", "tiny.py")}',
          f'--workdir={tmp_path}', '--config.model.families=("cnn5",)',
          '--config.num_rounds=1', '--config.privacy.dp_sgd=True', '--canaries=50']
  assert cli.run_cli(argv + ['--canaries=20'], dataset=small_ds) == 2
  assert '--canaries=20 is too few' in capsys.readouterr().err
  assert cli.run_cli(argv, dataset=small_ds) == 0
  assert 'training data' in capsys.readouterr().out
  out = json.load(open(tmp_path / 'audit.json'))
  assert out['config']['privacy']['dp_sgd'] and out['rounds'] == 1 and 'upload' not in out
  assert out['trained']
  a = out['training_data']
  assert a['canaries'] == 50 and a['confidence'] == 0.95 and a['delta'] == DELTA
  assert a['epsilon'] > 0 and 0 <= a['epsilon_lower'] <= a['ceiling']
  assert 0 <= a['auroc'] <= 1 and a['exceeds'] == (a['epsilon_lower'] > a['epsilon'])
  mia = out['mia']
  assert 0 <= mia['advantage'] <= 1 and mia['members'] == 240 and mia['non_members'] > 0


@pytest.mark.parametrize('mode', ['local', 'central'])
def test_notrain_audits_the_uploads_mechanism_alone_as_a_run_would(tmp_path, mode, capsys):
  from fedssa_jax.audit import __main__ as cli  # pylint: disable=g-import-not-at-top
  z, clip, rounds = 2.0, 0.5, 3
  argv = ['audit', f'--config={os.path.join(REPO, "configs", "tiny.py")}',
          f'--workdir={tmp_path}', f'--config.num_rounds={rounds}', '--upload_canaries=200',
          '--config.privacy.upload=True', f'--config.privacy.upload_mode={mode}',
          f'--config.privacy.upload_noise_multiplier={z}', '--config.participation=0.5',
          f'--config.privacy.upload_clip={clip}', '--config.privacy.accountant=rdp', '--notrain']
  if mode == 'central':
    argv.append('--config.fedssa.scope=participants')
  assert cli.run_cli(argv) == 0
  assert 'not trained' in capsys.readouterr().out
  out = json.load(open(tmp_path / 'audit.json'))
  assert not out['trained'] and 'training_data' not in out and 'mia' not in out
  n, seed = out['config']['num_clients'], out['config']['seed']
  # The same scores a trained audit of this config computes: the canaries after the n clients.
  score, included = uploads.upload_scores(seed, 200, rounds, n, clip=clip, std=z * clip,
                                          central=mode == 'central')
  want = scores.audit(score[included], score[~included], DELTA,
                      privacy.upload_epsilon('rdp', z, rounds, DELTA))
  got = out['upload']
  assert {k: got[k] for k in want} == pytest.approx(want)
  assert got['noise_multiplier'] == z and got['mode'] == mode
  if mode == 'central':  # the run's epsilon: its rounds, each a sampled release of the sum
    k = n // 2
    assert got['run_epsilon'] == pytest.approx(
        privacy.upload_epsilon('rdp', z, rounds, DELTA, n, k)) and got['run_epsilon'] < got[
            'epsilon']
  else:
    assert got['run_epsilon'] is None


def test_notrain_refuses_what_it_cannot_audit(tmp_path):
  with pytest.raises(ConfigError, match='privacy.upload=True, or drop --notrain'):
    audit_run.check(tiny_config(), 100, 1000, 'auto', training=False)
  with pytest.raises(ConfigError, match='drop --notrain'):
    audit_run.check(tiny_config(**{'privacy.upload': True, 'privacy.dp_sgd': True}), 100,
                    1000, 'dp_sgd', training=False)
  with pytest.raises(ConfigError, match='--upload_canaries=5'):
    audit_run.check(tiny_config(**{'privacy.upload': True}), 100, 5, 'auto', training=False)
