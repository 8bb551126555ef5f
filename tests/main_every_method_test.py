"""Every method end to end through the command line, on TFDS mock data, at the cross-device
variant's shape reduced to 20 clients (CROSS_DEVICE), in a federation where
half the sampled clients drop out and half the uploads are lost (SYSTEM): alone, with the floats
each round sends checked against the communication table (docs/algorithm.md), for 3 rounds that
the blow-up guard, at its defaults, lets through; and packed with another seed (--seeds), where
its seed's outputs and last checkpoint equal those of its run alone, with an all-inactive chunk
added to every group's chunk list (as a replica with fewer chunks of a group is padded).

One simulator of the method per run, alone and packed, in the same process: each method's
packed-seeds check and its command-line check share their compiles (tests/README.md)."""
import json
import os

import numpy as np
import pytest
import tensorflow_datasets as tfds
from absl import flags

from fedssa_jax import config_lib, main as main_lib, methods
from fedssa_jax.engine import schedule

from conftest import (assert_same_last_checkpoint, assert_same_records, assert_same_round_infos,
                      capturing_round_infos)

# Every method compiles its programs (slow: `pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
C = 10
D = config_lib.base_config('cifar10').model.feature_dim  # d of configs/tiny.py's runs
ROW = D + 1  # a header row: d weights and a bias
P5 = 665_048 + 501 * C  # CNN-5 with its C-way head (spec §0)
PS_MRL = 478_676 + 129 * C  # FedMRL's shared CNN-5 with fc2 -> 128 and its head (HTFL.md §3.2)
# FedGen's generator, nd 32 and hd 512 to d (docs/algorithm.md §8): (nd + C) hd + 3 hd + hd d + d.
PG = (32 + C) * 512 + 3 * 512 + 512 * D + D


# The packed run: seed 0 (the run alone) second, so that replica 1 is compared (a replica that
# read replica 0's keys, data or rows would differ).
PACKED_SEEDS = (3, 0)
# The methods packed here: one of each kind of server (its state and rule), each a separate
# path through the seed axis. Those left out share their kind's path: Standalone has no server,
# LG-FedAvg and FedClassAvg average headers as FedSSA does, FedProto and FD average class means
# as FedSA does, FedTGP and FedGH train on (prototype, class) pairs as FedORGP does, FML averages
# a model as FedMRL does. Every method is packed by launch/same_numbers.py's `-seeds3` runs.
PACKED_METHODS = ('fedgen', 'fedkd', 'fedl2g', 'fedmrl', 'fedorgp', 'fedsa', 'fedssa')
TIMINGS = ('round_seconds', 'elapsed_seconds', 'wall_seconds', 'seconds_per_round_steady',
           'first_round_seconds')


# The system section on (docs/algorithm.md §10): half the sampled clients drop out and half the
# uploads are lost, so every method runs rounds whose server receives part of the uploads, or
# none, alone and packed (K = 3: some of each in the runs' three rounds).
SYSTEM = ('--config.system.dropout=0.5', '--config.system.upload_loss=0.5')


# The cross-device variant (n1000: C = 10%, E = 1) at a reduced size: 20 clients, K = 3 a round,
# each drawing 16 training and 20 test samples from its class mixture, with replacement, from
# the mock data's 100 images a split (so 20 clients can share them). The per-client sizes are
# those of 5 clients of the pathological partition: the same programs to compile.
CROSS_DEVICE = ('--config.num_clients=20', '--config.participation=0.15',
                '--config.partition.kind=resample', '--config.partition.resample_train=16',
                '--config.partition.resample_test=20')


def run_cli(monkeypatch, workdir, method, *more):
  argv = ['main', f'--config={ROOT}/configs/tiny.py:cifar10,n1000', f'--workdir={workdir}',
          f'--config.method={method}', '--config.model.families=("cnn5",)', *CROSS_DEVICE,
          '--config.num_rounds=3', '--config.batch_size=8', '--config.target_accuracy=0.01',
          '--config.engine.micro_batch=4',  # 4-row passes, where the loss allows them
          *SYSTEM, *more]
  monkeypatch.setattr('sys.argv', argv)  # config_flags reads its overrides from sys.argv
  flag_values = flags.FlagValues()  # main's flags, parsed afresh for each run
  main_lib.define_flags(flag_values)
  flag_values(argv)
  with tfds.testing.mock_data(num_examples=100):
    main_lib.run(flag_values)


def outputs(workdir):
  """config.json, the metrics.jsonl records and summary.json of a run."""
  read = lambda name: json.load(open(os.path.join(workdir, name)))
  records = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]
  return read('config.json'), records, read('summary.json')


def untimed(d):
  return {k: v for k, v in d.items() if k not in TIMINGS}


def with_an_idle_chunk_per_group(monkeypatch):
  """schedule.aligned_chunks with one all-inactive chunk appended to every group (each seed's
  rows at the padding slot), which must change nothing."""
  aligned = schedule.aligned_chunks

  def padded(groups, chunk_lists):
    out = aligned(groups, chunk_lists)
    r = len(chunk_lists)
    for gi, g in enumerate(groups):
      p = g.clients_per_call
      out.append((gi, np.full((r, p), g.rows), np.zeros((r, p), bool)))
    return out
  monkeypatch.setattr(schedule, 'aligned_chunks', padded)


@pytest.fixture(scope='module', params=sorted(methods.METHODS))
def method_runs(request, tmp_path_factory):
  """(method, its run alone, its seed-0 replica of the packed run, their RoundInfos): the
  workdirs, and the infos of each round of both."""
  method = request.param
  base = tmp_path_factory.mktemp(method)
  with pytest.MonkeyPatch.context() as mp:
    infos = capturing_round_infos(mp)
    run_cli(mp, str(base / 'alone'), method)
    if method in PACKED_METHODS:
      with_an_idle_chunk_per_group(mp)
      run_cli(mp, str(base / 'packed'), method, '--seeds=' + ','.join(map(str, PACKED_SEEDS)))
  return (method, str(base / 'alone'), str(base / 'packed' / 'seed0'),
          (infos[False, 0], infos.get((True, 0))))


def expected_floats(method, seen, avail_before):
  """(up, down) per participant from the spec's table, for the methods whose counts follow
  from the seen classes alone; None where they depend on trained values (FedKD's ranks). A
  registered method missing here fails, naming what to add."""
  s = seen.sum(axis=1)
  has_global = (seen & avail_before).sum(axis=1)
  table = {
      'standalone': (0 * s, 0 * s),
      'fedssa': (ROW * s, ROW * has_global),
      'fd': (s * C, has_global * C),
      'fedproto': (D * s, D * has_global),
      'fml': (P5 + 0 * s, P5 + 0 * s),
      'fedkd': None,
      'lg_fedavg': (ROW * C + 0 * s, ROW * C + 0 * s),
      'fedclassavg': (ROW * C + 0 * s, ROW * C + 0 * s),
      'fedgh': (D * s, ROW * C + 0 * s),
      'fedtgp': (D * s, D * has_global),
      'fedmrl': (PS_MRL + 0 * s, PS_MRL + 0 * s),
      # Up: the rows of the classes in the study batch, at most s_k (UPLOAD_AT_MOST).
      'fedl2g': (D * s, D * s),
      'fedsa': (D * s, D * C + 0 * s),  # down: the anchors, every round
      'fedorgp': (D * s, D * avail_before.sum() + 0 * s),  # all of P^ down, after round 1
      'fedgen': (ROW * C + 0 * s, ROW * C + PG + 0 * s),
  }
  if method not in table:
    pytest.fail(f'The registered method {method!r} has no entry in expected_floats: add '
                f"'{method}': (up, down), its floats per participant from the communication "
                'table (docs/algorithm.md §8), or None where they depend on trained values.')
  return table[method]


# The methods whose upload in expected_floats is a bound, not the count: FedL2G sends the rows
# of the classes its study batch holds, whole rows of D floats.
UPLOAD_AT_MOST = {'fedl2g': D}


def globals_after(method, avail, seen_of_received):
  """The classes with a global value after a round, from those before it: those the clients
  whose uploads the server received hold (FedTGP's generator gives every class one after its
  first round that receives any; so does FedORGP's)."""
  if method in ('fedtgp', 'fedorgp'):
    return avail | len(seen_of_received) > 0
  return avail | seen_of_received.any(axis=0)


def test_runs_from_the_command_line_with_spec_communication(method_runs):
  method, alone, *_ = method_runs
  config, records, summary = outputs(alone)
  assert config['config']['method'] == method and summary['method'] == method
  assert config['config']['model']['feature_dim'] == D
  # Three rounds with the blow-up guard at its defaults (guards.check_blowup), untripped.
  assert [r['round'] for r in records] == [1, 2, 3]
  # The federation: dropouts and lost uploads happened, and some uploads arrived.
  assert any(r['dropped'] for r in records) and any(r['lost_uploads'] for r in records)
  assert any(r['received'] for r in records)
  for r in records:
    assert 0 <= r['mean_accuracy'] <= 1 and np.isfinite(r['train_loss'])
  seen_lists = config['derived']['client_seen_classes']
  seen = np.zeros((len(seen_lists), C), bool)
  for k, cls in enumerate(seen_lists):
    seen[k, cls] = True
  # Global class values exist after round 1 for the classes its participants hold (FedSSA's
  # initial header gives every class one from the start).
  avail = np.full(C, method == 'fedssa')
  for r in records:
    part = np.asarray(r['participants'], int)
    want = expected_floats(method, seen[part], avail)
    if method in UPLOAD_AT_MOST:
      assert (0 < r['up_floats'] or not len(part)) and r['up_floats'] <= want[0].sum(), 'upload'
      assert r['up_floats'] % UPLOAD_AT_MOST[method] == 0, 'upload'
      assert r['down_floats'] == want[1].sum(), 'download'
    elif want is not None:
      assert r['up_floats'] == want[0].sum(), 'upload'
      assert r['down_floats'] == want[1].sum(), 'download'
    else:  # FedKD: compressed updates, never above a dense CNN-5, nothing down in round 0
      assert (0 < r['up_floats'] or not len(part)) and r['up_floats'] <= P5 * len(part)
      assert r['down_floats'] <= P5 * len(part)
      assert r['round'] > 1 or r['down_floats'] == 0
    avail = globals_after(method, avail, seen[np.asarray(r['received'], int)])
  if method in ('fedproto', 'fedtgp', 'fedsa'):
    assert 0 <= records[-1]['method_metrics']['prototype_accuracy'] <= 1
  if method in ('fedgh', 'fedtgp', 'fedorgp'):  # the server trains: its loss, FLOPs recorded
    for r in records:  # ... none in a round that received nothing (kept as it was)
      assert np.isfinite(r['server_metrics']['loss'])
      assert (r['server_flops'] > 0) == bool(r['received']), r['round']


@pytest.mark.parametrize('method_runs', PACKED_METHODS, indirect=True)
def test_packed_seeds_equal_their_runs_alone(method_runs):
  """Replica 1 of the packed run (seed 0) writes what its run alone writes: the same records and
  summary but for timings, and the same last checkpoint (every array of the state)."""
  method, alone, packed, (infos_a, infos_p) = method_runs
  assert len(infos_a) == 3
  assert_same_round_infos(infos_p, infos_a, method)
  (config_a, records_a, summary_a), (config_p, records_p, summary_p) = (
      outputs(alone), outputs(packed))
  assert config_p['config']['seed'] == 0 and config_p == config_a
  assert len(records_p) == len(records_a) == 3
  assert_same_records(records_p, records_a, method)
  assert untimed(summary_p).keys() == untimed(summary_a).keys()
  assert summary_p['cum_up_floats'] == summary_a['cum_up_floats']
  assert_same_last_checkpoint(alone, packed, 3, method)
