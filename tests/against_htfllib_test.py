"""launch/against_htfllib.py's parts that run without torch: the partition written as HtFLlib's
files (read back as HtFLlib reads them), the reading of HtFLlib's printout, the config mapping
and the layer-by-layer model check. Runs neither code."""
import argparse
import json
import os
import stat

import numpy as np
import pytest

from conftest import load_file
from fedssa_jax import data


def load_script():
  return load_file('launch/against_htfllib.py')


def htfllib_read(root, dataset, split, k):
  """HtFLlib's utils/data_utils.read_data and process_image, without torch."""
  path = os.path.join(root, 'dataset', dataset, split, f'{k}.npz')
  with open(path, 'rb') as f:
    d = np.load(f, allow_pickle=True)['data'].tolist()
  return np.asarray(d['x'], np.float32), np.asarray(d['y'], np.int64)


def test_writes_each_clients_samples_as_htfllibs_files(tmp_path):
  ah = load_script()
  ds = data.synthetic_cifar(num_train=600, num_test=200)
  cd = data.partition(ds, 5, 'pathological', classes_per_client=2, seed=3)
  info = ah.write_partition(ds, cd, str(tmp_path), 'Toy')
  assert info['train'] == cd.train_n.tolist() and info['test'] == cd.test_n.tolist()
  assert (tmp_path / 'dataset' / 'Toy' / 'config.json').is_file()
  mean, std = np.asarray(ds.mean), np.asarray(ds.std)
  for k in range(5):
    for split, idx, n in (('train', cd.train_idx, cd.train_n), ('test', cd.test_idx, cd.test_n)):
      x, y = htfllib_read(str(tmp_path), 'Toy', split, k)
      rows = idx[k, :n[k]]
      assert x.shape == (n[k], 3, 32, 32) and x.dtype == np.float32
      np.testing.assert_array_equal(y, ds.labels[rows])
      # One pixel by hand: NCHW, (u8 / 255 - mean) / std per channel.
      i, c, h, w = n[k] - 1, 2, 5, 7
      want = (ds.images[rows[i], h, w, c] / 255.0 - mean[c]) / std[c]
      assert x[i, c, h, w] == pytest.approx(want, abs=1e-5)
      # All of it against our own normalisation, transposed.
      ours = (ds.images[rows] / 255.0 - mean) / std
      np.testing.assert_allclose(x, ours.transpose(0, 3, 1, 2), atol=1e-5)
    x, y = htfllib_read(str(tmp_path), 'Toy', 'train', k)
    assert set(np.unique(y)) == set(np.flatnonzero(cd.seen[k]))


# HtFLlib's printout (serverbase.evaluate and FD's round timer), two clients, rounds 0 and 1.
LOG = """\
against_htfllib runner: cnn1 layers base.conv1=1216 base.conv2=12832 base.fc1=1602000 \
base.fc2=1000500 head=5010
Join ratio / total clients: 1.0 / 2

-------------Round number: 0-------------

Evaluate heterogeneous models
Client 0: Acc: 0.25, AUC: 0.5
Client 1: Acc: 0.75, AUC: 0.5
Averaged Test Accuracy: 0.6000
Averaged Test AUC: 0.5000
Std Test Accuracy: 0.2500
-------------------------------------------------- 9.5

-------------Round number: 1-------------

Evaluate heterogeneous models
Client 1: Acc: 0.5, AUC: 0.9
Client 0: Acc: 1.0, AUC: 0.9
Averaged Test Accuracy: 0.7000
------------------------- time cost ------------------------- 8.25
"""


def test_reads_per_client_accuracies_and_round_times_from_htfllibs_printout():
  rounds = load_script().read_htfllib_log(LOG)
  assert [r['round'] for r in rounds] == [0, 1]
  assert rounds[0]['client_accuracy'] == [0.25, 0.75]
  assert rounds[1]['client_accuracy'] == [1.0, 0.5]  # in client order, as printed or not
  assert rounds[0]['mean_accuracy'] == pytest.approx(0.5)  # unweighted
  assert rounds[0]['weighted_accuracy'] == 0.6  # HtFLlib's own (sample-weighted)
  assert [r['seconds'] for r in rounds] == [9.5, 8.25]


def test_a_round_without_every_client_is_a_failure():
  ah = load_script()
  with pytest.raises(ah.Failure, match='clients \\[1\\]'):
    ah.read_htfllib_log(LOG.replace('Client 0: Acc: 0.25, AUC: 0.5\n', ''))


def test_config_mapping_passes_our_values_and_lists_what_differs():
  ah = load_script()
  args, unmatched = ah.htfllib_args(ah.our_config('fml', 0.05, 20), 20)
  flags = dict(zip(args[::2], args[1::2]))
  assert flags == {'-data': ah.DATASET, '-ncl': '10', '-m': 'HtFE-img-2', '-algo': 'FML',
                   '-nc': '10', '-jr': '1.0', '-lbs': '512', '-lr': '0.05', '-ls': '1',
                   '-gr': '20', '-fd': '500', '-eg': '1', '-t': '1', '-dev': 'cpu',
                   '-go': 'against_fedssa_jax', '-al': '0.5', '-bt': '0.5'}
  assert any('KLDivLoss' in u for u in unmatched)
  assert not any(u.startswith(('optimizer', 'gradient clip', 'augmentation')) for u in unmatched)
  for method, extra in (('fd', {'-lam': '1.0'}), ('fedproto', {'-lam': '1.0'}),
                        ('fedkd', {'-mlr': '0.05', '-Ts': '0.95', '-Te': '0.98'}),
                        ('fedgh', {'-se': '1', '-slr': '0.01'}),
                        ('fedtgp', {'-lam': '10.0', '-se': '100', '-mart': '100.0'}),
                        ('fedmrl', {'-sfd': '128'}),
                        ('fedl2g', {'-slr': '100.0', '-wu': '0', '-mdb': '1', '-mqb': '1'}),
                        ('fedgen', {'-nd': '32', '-hd': '512', '-glr': '0.005', '-se': '100'}),
                        ('standalone', {}), ('lg_fedavg', {})):
    args, _ = ah.htfllib_args(ah.our_config(method, 0.05, 20), 20)
    flags = dict(zip(args[::2], args[1::2]))
    assert flags['-algo'] == ah.ALGORITHMS[method]
    assert {k: flags[k] for k in extra} == extra and len(flags) == 15 + len(extra)
  # The matching flags of our side.
  c = ah.our_config('fedkd', 0.05, 20)
  assert (c.optimizer.momentum, c.optimizer.weight_decay, c.optimizer.clip_norm) == (0, 0, 10)
  assert not c.augment and c.local_epochs == 1 and c.num_rounds == 20
  assert ah.our_config('fedproto', 0.05, 20).fedproto.inference == 'prototype'
  assert ah.our_config('fd', 0.05, 20).optimizer.clip_norm == 0
  # HtFLlib's server training reuses the local batch (and FedTGP's the local lr).
  c = ah.our_config('fedtgp', 0.05, 20)
  assert (c.fedtgp.server_batch, c.fedtgp.server_lr) == (512, 0.05)
  assert (c.fedtgp.inference, c.fedtgp.proto_timing) == ('prototype', 'pre_train')
  assert ah.our_config('fedmrl', 0.05, 20).fedmrl.reset_projector is True
  c = ah.our_config('fedl2g', 0.05, 20)
  assert (c.fedl2g.warmup, c.fedl2g.quiz_size, c.optimizer.clip_norm) == (0, 512, 100)
  # FedGen: HtFLlib's clients use the initial generator, and its server batch is the local one.
  c = ah.our_config('fedgen', 0.05, 20)
  assert (c.fedgen.frozen_generator, c.fedgen.server_batch, c.optimizer.clip_norm) == (
      True, 512, 0)
  _, unmatched = ah.htfllib_args(c, 20)
  assert any('label prior' in u for u in unmatched)
  assert not any(u.startswith('FedGen generator') for u in unmatched)
  c.fedgen.frozen_generator, c.fedgen.weighting = False, 'uniform'
  _, unmatched = ah.htfllib_args(c, 20)
  assert any(u.startswith('FedGen generator') for u in unmatched)
  assert 'FedGen header mean: ours uniform; HtFLlib sample-weighted.' in unmatched


def test_our_defaults_are_listed_as_differences():
  ah = load_script()
  from fedssa_jax import config_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.build('cifar10', 'hetero,n10')
  c.method = 'lg_fedavg'
  c.lg_fedavg.weighting = 'uniform'
  _, unmatched = ah.htfllib_args(c, 20)
  text = '\n'.join(unmatched)
  for what in ('momentum 0.9', 'gradient clip: ours 50.0', 'augmentation',
               'LG-FedAvg header mean'):
    assert what in text
  c.method = 'fedclassavg'
  with pytest.raises(ah.Failure, match='no HtFLlib counterpart'):
    ah.htfllib_args(c, 20)


def test_lost_uploads_map_onto_htfllib_s_client_drop_rate():
  ah = load_script()
  c = ah.our_config('fedgh', 0.05, 20, upload_loss=0.3)
  assert c.system.upload_loss == 0.3
  assert '--config.system.upload_loss=0.3' in ah.our_overrides('fedgh', 0.05, 20, 0.3)
  args, unmatched = ah.htfllib_args(c, 20)
  assert args[args.index('-cdr') + 1] == '0.3'
  assert any('int((1 - 0.3) K)' in u for u in unmatched)
  # FedProto's server in HtFLlib aggregates every selected client: named as a difference.
  _, unmatched = ah.htfllib_args(ah.our_config('fedproto', 0.05, 20, upload_loss=0.3), 20)
  assert any('whatever -cdr says' in u for u in unmatched)
  args, _ = ah.htfllib_args(ah.our_config('fedgh', 0.05, 20), 20)
  assert '-cdr' not in args
  c.system.dropout = 0.2  # no counterpart in HtFLlib
  with pytest.raises(ah.Failure, match='only system.upload_loss'):
    ah.htfllib_args(c, 20)


def test_models_are_checked_layer_by_layer():
  ah = load_script()
  ours = ah.our_layer_sizes(500)
  # CNN-1 by hand: conv 5x5 3->16, conv 5x5 16->32, fc 800->2000, fc 2000->500, head 500->10.
  assert ours['cnn1'] == {'conv1': 3 * 16 * 25 + 16, 'conv2': 16 * 32 * 25 + 32,
                          'fc1': 800 * 2000 + 2000, 'fc2': 2000 * 500 + 500, 'fc3': 5010}
  lines = '\n'.join(
      f'against_htfllib runner: {f} layers base.conv1={s["conv1"]} base.conv2={s["conv2"]} '
      f'base.fc1={s["fc1"]} base.fc2={s["fc2"]} head={s["fc3"]}' for f, s in ours.items())
  ah.check_layer_sizes(lines, ours)
  with pytest.raises(ah.Failure, match='cnn2'):
    ah.check_layer_sizes(lines.replace('base.conv2=6416', 'base.conv2=6417'), ours)
  with pytest.raises(ah.Failure, match='cnn5'):
    ah.check_layer_sizes(lines.rsplit('\n', 1)[0], ours)


def test_bad_input_gets_a_short_message(tmp_path, capsys):
  ah = load_script()
  for argv, what in (([f'--htfllib={tmp_path}'], 'holds no system/main.py'),
                     (['--htfllib=x', '--methods=fedssa'], "'fedssa' is not shared")):
    with pytest.raises(SystemExit) as exit_:
      ah.main(argv + [f'--out={tmp_path / "out"}'])
    message = str(exit_.value.code)
    assert message.startswith('against_htfllib: ') and what in message and '\n' not in message
  assert not capsys.readouterr().out
  fake = tmp_path / 'python'
  fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
  fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
  with pytest.raises(ah.Failure, match='pip install torch torchvision h5py'):
    ah.check_htfllib_python(str(fake))


def test_compare_puts_both_curves_side_by_side():
  ah = load_script()
  # HtFLlib's rounds 0..20 (round 0: the initial models); ours 1..20 at two seeds.
  theirs = [{'round': r, 'mean_accuracy': r / 100, 'weighted_accuracy': r / 100 + 0.001,
             'seconds': 9.0 if r != 3 else 30.0} for r in range(21)]
  ours = [[{'round': r, 'mean_accuracy': r / 100 + d, 'seconds': 40.0 if r == 1 else 7.0}
           for r in range(1, 21)] for d in (0.01, 0.03)]
  res = ah.compare('fd', [theirs], ours)
  rows = {row['round']: row for row in res['rows']}
  assert list(rows) == [5, 10, 15, 20, '16-20']
  assert rows[20]['htfllib'] == 0.2 and rows[20]['ours_seeds'] == pytest.approx([0.21, 0.23])
  assert rows[20]['difference'] == pytest.approx(0.02)
  assert rows[20]['ours_std'] == pytest.approx(0.02 / np.sqrt(2))  # sample std of two
  # HtFLlib at one seed: its std is taken to be ours, so the combined std is sqrt(2) 0.01414 =
  # 0.02 and the 2-point gap is within twice it.
  assert rows[20]['htfllib_std'] is None and rows[20]['std_assumed'] is True
  assert rows[20]['combined_std'] == pytest.approx(0.02)
  assert rows[20]['beyond_noise'] is False
  # Ours at one seed too: no std on either side, no mark.
  one = {row['round']: row for row in ah.compare('fd', [theirs], ours[:1])['rows']}
  assert one[20]['combined_std'] is None and one[20]['beyond_noise'] is None
  assert one[20]['std_assumed'] is False
  # A gap beyond it: ours 0.21 and 0.23 against 0.15 (7 points > 2 x 2).
  far = ah.gap_row(20, [0.15], [0.15], [0.21, 0.23])
  assert far['beyond_noise'] is True and far['std_assumed'] is True
  assert '**+7.0***' in ah.markdown([{**res, 'rows': [far]}])
  assert rows['16-20']['htfllib'] == pytest.approx(0.18)
  assert rows['16-20']['ours'] == pytest.approx(0.20)
  # Medians after the first round: a slow round (other work) does not move them.
  assert (res['htfllib_seconds_per_round'], res['ours_seconds_per_round']) == (9.0, 7.0)
  assert res['speedup'] == pytest.approx(9 / 7)
  table = ah.markdown([res])
  assert ('| fd (FD) | 20 | 0.2000 | 0.2000 | 0.2010 | 0.2200 ± 0.0141 | 0.2100, 0.2300 | +2.0* |'
          in table)
  assert '| fd | 9.0 | 7.0 | 1.29x | — | — |' in table
  # Images a second: HtFLlib's loaders drop each client's partial batch, ours keep it.
  res.update(ah.images_per_second(res, [25, 7, 10], 10))
  assert (res['htfllib_images_per_round'], res['ours_images_per_round']) == (30, 42)
  assert res['htfllib_images_per_second'] == pytest.approx(30 / 9)
  assert res['ours_images_per_second'] == pytest.approx(42 / 7)
  assert '| fd | 9.0 | 7.0 | 1.29x | 3 | 6 | — | — |' in ah.markdown([res])
  # GFLOP/s: our round's FLOPs (the median after round 1) over each side's s/round, HtFLlib's
  # in proportion to the images it trains; and each side's share of the roofline.
  ours[0][1]['client_flops'], ours[0][2]['client_flops'] = 84e9, 42e9
  ours[0][3]['client_flops'] = 42e9
  assert ah.steady_flops(ours) == 42e9 and ah.steady_flops([ours[1]]) is None
  res.update(ah.images_per_second(res, [25, 7, 10], 10, 42e9, 12e9))
  assert res['ours_gflops'] == pytest.approx(42 / 7)  # 1e9 FLOPs an image, 6 images/s
  assert res['htfllib_gflops'] == pytest.approx(30 / 9)
  assert res['ours_roofline_share'] == pytest.approx(0.5)
  assert '| fd | 9.0 | 7.0 | 1.29x | 3 | 6 | 3.3 | 6.0 |' in ah.markdown([res])


def test_seeds_on_both_sides_mark_the_gaps_beyond_twice_the_combined_std():
  """Three seeds a side: each side's mean and sample std, the gap marked (bold) where it
  exceeds 2 sqrt(std_h^2 + std_o^2), computed by hand; HtFLlib's seeds run as offsets to its
  torch.manual_seed calls, named _seed<k>, seed 0 keeping its name."""
  ah = load_script()
  curve = lambda f, first: [{'round': r, 'mean_accuracy': f(r), 'weighted_accuracy': f(r),
                             'seconds': 5.0} for r in range(first, 21)]
  # HtFLlib: 0.50 +- 0.01 every round; ours at round 20 0.60 +- 0.01 (a gap of 10 points,
  # beyond 2 sqrt(2) 0.01 = 2.8), elsewhere 0.51 +- 0.01 (1 point: within).
  theirs = [curve(lambda r, d=d: 0.50 + d, 0) for d in (-0.01, 0.0, 0.01)]
  ours = [curve(lambda r, d=d: (0.60 if r == 20 else 0.51) + d, 1) for d in (-0.01, 0.0, 0.01)]
  res = ah.compare('fedtgp', theirs, ours)
  rows = {row['round']: row for row in res['rows']}
  assert rows[20]['htfllib_std'] == pytest.approx(0.01)
  assert rows[20]['ours_std'] == pytest.approx(0.01)
  assert rows[20]['combined_std'] == pytest.approx(0.01 * np.sqrt(2))
  assert rows[20]['beyond_noise'] is True and rows[15]['beyond_noise'] is False
  # 16-20: ours (4 x 0.51 + 0.60) / 5 = 0.528, std 0.01; the gap 2.8 points < 2.83: within.
  assert rows['16-20']['ours'] == pytest.approx(0.528)
  assert rows['16-20']['beyond_noise'] is False
  table = ah.markdown([res])
  assert ('| fedtgp (FedTGP) | 20 | 0.5000 ± 0.0100 | 0.4900, 0.5000, 0.5100 | 0.5000 | '
          '0.6000 ± 0.0100 | 0.5900, 0.6000, 0.6100 | **+10.0** |') in table
  assert '| fedtgp (FedTGP) | 15 | 0.5000 ± 0.0100 |' in table and '| +1.0 |' in table
  # The table by round: a row a method, each side's mean ± std and the gap per column.
  assert '| method (HtFLlib) | seeds | r5 | r10 | r15 | r20 | r16–20 |' in table
  assert ('| fedtgp (FedTGP) | 3 / 3 | 0.5000 ± 0.0100 / 0.5100 ± 0.0100 (+1.0) |' in table)
  assert '0.5000 ± 0.0100 / 0.6000 ± 0.0100 (**+10.0**) |' in table
  assert len(res['htfllib_curves']) == 3 and len(res['ours_curves']) == 3
  # The runner moves every torch.manual_seed(s) to s + AGAINST_HTFLLIB_SEED.
  compile(ah.RUNNER, 'run_htfllib.py', 'exec')
  assert "torch.manual_seed = lambda seed: _manual_seed(seed + _SEED)" in ah.RUNNER
  assert ah._seed(0) == '' and ah._seed(2) == '_seed2'


def test_our_loader_fixed_trains_on_htfllibs_batches(tmp_path):
  """--our_loader=fixed: our config takes HtFLlib's batches (batch_order=fixed, drop_last), the
  batch-order difference leaves the list, our runs and the results get _ourfixed; results of
  another command's methods are kept in the results file."""
  ah = load_script()
  c = ah.our_config('fedtgp', 0.05, 20, our_loader='fixed')
  assert (c.batch_order, c.drop_last) == ('fixed', True)
  from fedssa_jax import config_lib
  config_lib.validate(c)
  for what in ('batch order', 'prototype pass'):  # its prototype pass drops the partial batch
    assert not any(u.startswith(what) for u in ah.htfllib_args(c, 20)[1])
  c = ah.our_config('fedtgp', 0.05, 20)
  assert (c.batch_order, c.drop_last) == ('shuffled', False)
  for what in ('batch order', 'prototype pass'):
    assert any(u.startswith(what) for u in ah.htfllib_args(c, 20)[1])
  with pytest.raises(ah.Failure, match='--our_loader must be one of'):
    ah.our_config('fedtgp', 0.05, 20, our_loader='sorted')
  assert ah._our_loader(argparse.Namespace(our_loader='fixed')) == '_ourfixed'
  path = tmp_path / 'results.json'
  path.write_text(json.dumps({'results': [{'method': 'fedtgp', 'old': 1},
                                          {'method': 'standalone', 'old': 1}]}))
  got = ah.merged(str(path), [{'method': 'fedkd'}, {'method': 'fedtgp'}])
  assert got == [{'method': 'standalone', 'old': 1}, {'method': 'fedkd'}, {'method': 'fedtgp'}]
  assert ah.merged(str(tmp_path / 'none.json'), [{'method': 'fd'}]) == [{'method': 'fd'}]


def test_htfllibs_federation_maps_onto_both_sides():
  """HtFLlib's scripts' federation (batch 10, 20 clients, Dirichlet 0.1): our config, its
  flags, and the files' names, which keep the default federation's as they were."""
  ah = load_script()
  fed = dict(batch_size=10, num_clients=20, partition='dirichlet', alpha=0.1, model_group='cnn')
  c = ah.our_config('fedgh', 0.01, 3, **fed)
  assert (c.batch_size, c.num_clients, c.participation) == (10, 20, 1.0)
  assert (c.partition.kind, c.partition.dirichlet_gamma) == ('dirichlet', 0.1)
  assert c.fedgh.server_batch == 10  # HtFLlib's server reuses the local batch
  ns = argparse.Namespace  # the command line's arguments
  args, _ = ah.htfllib_args(c, 3, ah.dataset_name(ns(lr=0.01, **fed)))
  flags = dict(zip(args[::2], args[1::2]))
  assert (flags['-nc'], flags['-lbs'], flags['-lr']) == ('20', '10', '0.01')
  assert flags['-data'] == ah.DATASET + '_n20_dir0.1'
  assert ah.federation_suffix(ns(lr=0.01, **fed)) == '_b10_n20_dir0.1_lr0.01'
  assert ah.federation_suffix(ns(lr=0.05, **ah.FEDERATION)) == ''
  assert ah.dataset_name(ns(lr=0.05, **ah.FEDERATION)) == ah.DATASET
  from fedssa_jax import config_lib
  config_lib.validate(c)  # a federation our side can build
  with pytest.raises(ah.Failure, match='--partition must be one of'):
    ah.our_config('fedgh', 0.01, 3, partition='iid')
  with pytest.raises(ah.Failure, match='--model_group must be one of'):
    ah.our_config('fedgh', 0.01, 3, model_group='htfe7')


def test_a_cross_device_federation_samples_the_same_fraction_on_both_sides():
  """--num_clients=1000 --participation=0.1: K = 100 a round here, HtFLlib's -jr 0.1 there,
  the files named with it (HtFLlib's -nc 1000 -jr 0.1)."""
  ah = load_script()
  fed = dict(batch_size=10, num_clients=1000, partition='dirichlet', alpha=1.0,
             model_group='cnn', participation=0.1)
  c = ah.our_config('fedproto', 0.01, 3, **fed)
  assert (c.num_clients, c.participation, c.eval_clients, c.eval_every) == (1000, 0.1, 0, 1)
  args, _ = ah.htfllib_args(c, 3)
  flags = dict(zip(args[::2], args[1::2]))
  assert (flags['-nc'], flags['-jr']) == ('1000', '0.1')
  assert ah.federation_suffix(argparse.Namespace(lr=0.01, **fed)) == '_b10_n1000_dir1_jr0.1_lr0.01'
  with pytest.raises(ah.Failure, match='--participation must be in'):
    ah.our_config('fedproto', 0.01, 3, participation=0.0)


def test_htfllibs_own_model_group_on_both_sides():
  """--model_group=htfe2: HtFLlib's own HtFE-img-2 there (its -m, its feature_dim 512), our
  :htfe2 here, the files named with it; the five CNNs keep their names and their check."""
  ah = load_script()
  fed = dict(batch_size=10, num_clients=20, partition='dirichlet', alpha=0.1,
             model_group='htfe2')
  c = ah.our_config('standalone', 0.01, 3, **fed)
  assert tuple(c.model.families) == ('fedavgcnn', 'resnet18') and c.model.feature_dim == 512
  assert ah.model_group_of(c) == 'htfe2'
  assert ah.config_arg('htfe2') == ah.CONFIG + ',htfe2' and ah.config_arg('cnn') == ah.CONFIG
  args, unmatched = ah.htfllib_args(c, 3)
  flags = dict(zip(args[::2], args[1::2]))
  assert (flags['-m'], flags['-fd']) == ('HtFE-img-2', '512')
  assert not any(u.startswith('models') for u in unmatched)
  ns = argparse.Namespace
  assert ah.federation_suffix(ns(lr=0.01, **fed)) == '_b10_n20_dir0.1_lr0.01_htfe2'
  assert ah.dataset_name(ns(lr=0.01, **fed)) == ah.DATASET + '_n20_dir0.1'  # the same data
  # Any other families on our side are a difference from the five CNNs.
  c = ah.our_config('standalone', 0.01, 3)
  c.model.families = ('cnn1', 'cnn2')
  assert ah.model_group_of(c) == 'cnn'
  assert any(u.startswith('models') for u in ah.htfllib_args(c, 3)[1])


def test_fedkd_compression_off_and_htfllibs_kept_ranks():
  """--fedkd_compression=off: ours at energy 1.0 (every tensor sent whole), the files named
  _kdoff; the runner's FedKD log lines read back as each matrix's kept ranks, rank 0 counted
  (HtFLlib's truncation rebuilds such a tensor as zeros)."""
  ah = load_script()
  compile(ah.RUNNER, 'run_htfllib.py', 'exec')  # the runner HtFLlib's Python executes
  c = ah.our_config('fedkd', 0.05, 20, fedkd_compression='off')
  assert (c.fedkd.energy_start, c.fedkd.energy_end) == (1.0, 1.0)
  c = ah.our_config('fedkd', 0.05, 20)
  assert (c.fedkd.energy_start, c.fedkd.energy_end) == (0.95, 0.98)
  assert ah.our_config('fml', 0.05, 20, fedkd_compression='off').fml == ah.our_config(
      'fml', 0.05, 20).fml
  with pytest.raises(ah.Failure, match='--fedkd_compression must be one of'):
    ah.our_config('fedkd', 0.05, 20, fedkd_compression='half')
  ns = argparse.Namespace(htfllib_loader='as_written', upload_loss=0.0, fedkd_compression='off',
                          lr=0.05, **ah.FEDERATION)
  assert ah._suffix(ns) == ah._suffix(ns, 'fedkd') == '_kdoff'
  assert ah._suffix(ns, 'fedproto') == ''  # only FedKD's runs change
  # --fedkd_compression=htfllib: ours does as HtFLlib's code (its runs as written, their names
  # unchanged); the compression differences leave the list, the W_h init stays.
  c = ah.our_config('fedkd', 0.05, 20, fedkd_compression='htfllib')
  assert c.fedkd.compression == 'htfllib'
  unmatched = ah.htfllib_args(c, 20)[1]
  assert not any(u.startswith(('compression', 'zeroing', 'energy')) for u in unmatched)
  assert any(u.startswith('W_h') for u in unmatched)
  assert sum(u.startswith(('compression', 'zeroing', 'energy')) for u in
             ah.htfllib_args(ah.our_config('fedkd', 0.05, 20), 20)[1]) == 3
  ns.fedkd_compression = 'htfllib'
  assert ah._suffix(ns) == '' and ah._kd_ours(ns, 'fedkd') == '_kdhtfl'
  assert ah._kd_ours(ns, 'fedproto') == ''
  log = '\n'.join([
      'against_htfllib fedkd: client head.weight 10x500 rank 0 of 10 (energy 0.9500)',
      'against_htfllib fedkd: client base.fc2.weight 500x500 rank 212 of 500 (energy 0.9500)',
      'against_htfllib fedkd: server head.weight 10x500 rank 9 of 10 (energy 0.9515)',
      'other output',
      'against_htfllib fedkd: client head.weight 10x500 rank 0 of 10 (energy 0.9515)'])
  ranks = ah.read_fedkd_ranks(log)
  assert ranks[('client', 'head.weight')] == {'full': 10, 'ranks': [0, 0]}
  assert ranks[('server', 'head.weight')] == {'full': 10, 'ranks': [9]}
  assert ah.fedkd_rank_lines(ranks) == [
      'client base.fc2.weight: rank 0 in 0 of 1 compressions, kept 212-212 of 500',
      'client head.weight: rank 0 in 2 of 2 compressions, kept 0-0 of 10',
      'server head.weight: rank 0 in 0 of 1 compressions, kept 9-9 of 10']
