"""Seconds per round of the official PyTorch FedSSA code and of this simulator, one after the other.

  python launch/side_by_side.py --official=/path/to/FedSSA \\
      --official_python=/tmp/venv-torch/bin/python --data_dir=$HOME/tensorflow_datasets --rounds=4

Both run FedSSA on CIFAR-10 at `configs/cifar10.py:hetero,n10` (CNN-1..5, N=10 clients, C=100%,
two classes a client), E=`--local_epochs` (default 1), for `--rounds` rounds, on the CPU, on one
machine: first the official code, then `python -m fedssa_jax.main`. It prints each round's
seconds, the steady state (the mean after the first round, which for this simulator compiles)
and the ratio official / ours.

The official code is never copied into this repository: `--official` names a checkout of it
(github.com/LipingYi/FedSSA; its root or its FedSSA/ folder), and `--official_python` a Python
with torch and torchvision (a venv of its own keeps the system's Python as it is):

  python -m venv /tmp/venv-torch --system-site-packages
  /tmp/venv-torch/bin/pip install torch torchvision

(Measured with torch 2.14.1 and torchvision 0.29.1, the default CUDA wheels, which run on a
CPU-only machine; a CPU-only torch wheel needs a torchvision built for it. The official script's
`--data-name` lists no 'cifar10' among its choices, so it is left at its default, cifar10.)

Data: `--data_dir` is what this simulator reads (a TFDS data_dir holding cifar10, or an .npz of
x_train, y_train, x_test, y_test). The script writes the same images and labels, in the order
TFDS gives them, as torchvision's `cifar-10-batches-py` pickles into a scratch folder, which the
official code reads through torchvision's CIFAR10 (the offline copy of CIFAR-10 is a JPEG
re-encoding, so both read those pixels, not the original files').

The official script runs unchanged, from its own folder, with `--num-nodes`, `--frac`,
`--num-steps`, `--batch-size`, `--inner-steps`, `--inner-lr`, `--inner-wd`, `--data-path` and
`--save-path` set from our config; its other arguments keep their defaults. Two things are
changed at run time by a small runner that then runs the script with runpy (the checkout's files
are not touched; Python writes no bytecode into it; its outputs go to the scratch folder):
  - torchvision's MD5 check of the CIFAR-10 files accepts any file that exists (our pickles are
    not byte for byte the originals), and it never downloads;
  - torch.cuda.is_available() is False, so the script runs on the CPU whatever GPU it finds (it
    sets CUDA_VISIBLE_DEVICES=3 itself).
Nothing else: the algorithm, the data pipeline and the logging are the official ones.
The official round times come from its log's timestamps (millisecond resolution): from
`#-----------Round:r-------------#` to the following `Global Headers are updated after
aggregation`, i.e. local training, each participant's test evaluation, the CSV row and the
class-wise aggregation. Ours are metrics.jsonl's `round_seconds` (training, server and the
evaluation of all N clients; at C=100% every client is a participant, as in the official round).

Mapped (ours -> official): num_clients -> --num-nodes 10; participation 1.0 -> --frac 1;
batch_size 512 -> --batch-size 512; local_epochs -> --inner-steps; optimizer.lr 0.005 ->
--inner-lr; optimizer.weight_decay 5e-5 -> --inner-wd. Equal already: SGD momentum 0.9 and
gradient-norm clip 50 (hard-coded there), FedSSA's mu0=0.5 and T_stable=2 (hard-coded there as
miu_0 and decay_rounds), two classes a client, the 40k/10k split of the training set, the
same five CNNs, the same augmentation (flip, RandomErasing, pad-4 crop), a test batch of 512.

What cannot be matched:
  - Random numbers: the official code seeds numpy/random/torch with 42, we seed JAX with 0, so
    the partitions (same law: two classes a client with random shares), initial models,
    shuffling and augmentation draws differ; the work per round is the same in kind and size.
  - Where the augmentation runs: per image with PIL/torchvision in the official DataLoader
    (num_workers=0, in the training loop), batched on the device here. It is part of each side's
    round time, as each code does it.
  - Threads: each side uses its library's default (torch's intra-op threads = the cores; XLA's
    thread pool); neither is tuned.
  - The official `--frac` is an int, so only C=100% (or 0) can be expressed: hence only
    `:hetero,n10`, not n50/n100.
  - Work outside the rounds is not timed on either side: the official code's pass over every
    client's training loader to find its classes before round 0 and its final collection of
    test representations; our data loading, compiles before round 1, checkpoints.
  - The official code prints test accuracy averaged over batches; ours averages over samples.
    The accuracies printed below are a sanity check, not a comparison (different seeds).
"""
import argparse
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = 'configs/cifar10.py:hetero,n10'
SCRIPT = os.path.join('experiments', 'FLHetero', 'FedSSA_hetero.py')

# Runs the official script unchanged after two run-time patches (see the docstring).
# argv: <FedSSA folder> <script arguments...>
RUNNER = r'''
import os, runpy, sys
sys.dont_write_bytecode = True
root = sys.argv[1]
script = os.path.join(root, 'experiments', 'FLHetero', 'FedSSA_hetero.py')
sys.path.insert(0, root)
import torch
torch.cuda.is_available = lambda: False
import torchvision.datasets.cifar as cifar
cifar.check_integrity = lambda fpath, md5=None: os.path.isfile(fpath)
def _no_download(*args, **kwargs):
  raise RuntimeError('side_by_side: the CIFAR-10 pickles are missing and downloading is off')
cifar.download_and_extract_archive = _no_download
print(f'side_by_side runner: torch {torch.__version__}, {torch.get_num_threads()} threads',
      flush=True)
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name='__main__')
'''

_STAMP = r'(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})'
_START = re.compile(_STAMP + r' - .* - INFO - #-+Round:(\d+)-+#')
_END = re.compile(_STAMP + r' - .* - INFO - Global Headers are updated after aggregation')
_ACC = re.compile(r'INFO - Round:(\d+) \| mean_local_loss:\S+ \| mean_local_acc:([0-9.eE+-]+)')


class Failure(Exception):
  """A problem with a short message that names the fix."""


def _seconds(date, millis):
  return time.mktime(time.strptime(date, '%Y-%m-%d %H:%M:%S')) + int(millis) / 1000


def official_round_times(log: str) -> list[float]:
  """Each round's seconds from the official script's log: its round-start line to the next
  'Global Headers are updated after aggregation' line. Rounds without an end are left out."""
  times, start = [], None
  for line in log.splitlines():
    m = _START.search(line)
    if m:
      start = _seconds(m.group(1), m.group(2))
      continue
    m = _END.search(line)
    if m and start is not None:
      times.append(_seconds(m.group(1), m.group(2)) - start)
      start = None
  return times


def official_accuracies(log: str) -> list[float]:
  """The official log's mean test accuracy of each round's participants."""
  return [float(m.group(2)) for m in _ACC.finditer(log)]


def find_official(path: str) -> str:
  """The FedSSA folder (the one holding experiments/) of a checkout, or a Failure."""
  fix = ('clone the official code (git clone https://github.com/LipingYi/FedSSA) and pass '
         '--official=<the clone>')
  if not path:
    raise Failure(f'--official is required: {fix}.')
  if not os.path.isdir(path):
    raise Failure(f'--official={path} is not a folder: {fix}.')
  for root in (os.path.join(path, 'FedSSA'), path):
    if os.path.isfile(os.path.join(root, SCRIPT)):
      return os.path.abspath(root)
  raise Failure(f'--official={path} holds no FedSSA/{SCRIPT}: {fix}.')


def check_python(python: str, modules: str, flag: str, fix: str) -> str:
  """The torch version of `python` (which must import the comma-separated `modules`), or a
  Failure that names `flag` and how to get such a Python (`fix`)."""
  try:
    out = subprocess.run([python, '-c', f'import {modules}; print(torch.__version__)'],
                         capture_output=True, text=True, check=False)
  except OSError as e:
    raise Failure(f'{flag}={python} cannot be run ({e.strerror}): {fix}.') from None
  if out.returncode != 0:
    last = (out.stderr.strip().splitlines() or ['?'])[-1]
    raise Failure(f'{flag}={python} cannot import {modules} ({last}): {fix}.')
  return out.stdout.strip()


def check_official_python(python: str) -> str:
  """The torch version of `python`, or a Failure naming how to get one with torch."""
  fix = ('make a venv with torch and torchvision (python -m venv /tmp/venv-torch '
         '--system-site-packages && /tmp/venv-torch/bin/pip install torch torchvision) and pass '
         '--official_python=/tmp/venv-torch/bin/python')
  return check_python(python, 'torch, torchvision, tqdm', '--official_python', fix)


def write_cifar_pickles(data_dir: str, out: str) -> None:
  """Our CIFAR-10 (TFDS data_dir or .npz) as torchvision's cifar-10-batches-py under `out`."""
  sys.path.insert(0, REPO)
  from fedssa_jax import data  # pylint: disable=g-import-not-at-top
  try:
    ds = data.load_dataset('cifar10', data_dir)
  except (data.DataError, FileNotFoundError) as e:
    raise Failure(f'--data_dir={data_dir}: {e}') from None
  folder = os.path.join(out, 'cifar-10-batches-py')
  os.makedirs(folder, exist_ok=True)

  def batch(idx, name):
    x = ds.images[idx].transpose(0, 3, 1, 2).reshape(len(idx), -1)  # rows of R, G, B planes
    return {'batch_label': name, 'labels': [int(v) for v in ds.labels[idx]],
            'data': np.ascontiguousarray(x, np.uint8),
            'filenames': [f'{i}.png' for i in idx]}

  train, test = ds.tfds_splits['train'], ds.tfds_splits['test']
  if len(train) != 50_000 or len(test) != 10_000:
    raise Failure(f'--data_dir={data_dir} holds {len(train)} + {len(test)} images, not '
                  'CIFAR-10\'s 50000 + 10000.')
  files = {f'data_batch_{i + 1}': batch(train[i * 10_000:(i + 1) * 10_000],
                                        f'training batch {i + 1} of 5') for i in range(5)}
  files['test_batch'] = batch(test, 'testing batch 1 of 1')
  files['batches.meta'] = {'label_names': ['airplane', 'automobile', 'bird', 'cat', 'deer', 'dog',
                                           'frog', 'horse', 'ship', 'truck'],
                           'num_cases_per_batch': 10_000, 'num_vis': 3072}
  for name, content in files.items():
    with open(os.path.join(folder, name), 'wb') as f:
      pickle.dump(content, f, protocol=2)


def _git_head(path, *, code=('.',)):
  """The commit of `path`'s checkout, and whether the files under `code` differ from it."""
  git = lambda *a: subprocess.run(['git', '-C', path, *a], capture_output=True, text=True,
                                  check=False)
  head = git('rev-parse', '--short', 'HEAD')
  if head.returncode != 0:
    return 'not a git checkout'
  dirty = git('status', '--porcelain', '--untracked-files=no', '--', *code).stdout.strip()
  return head.stdout.strip() + (', with uncommitted changes' if dirty else '')


def _run_logged(cmd, log_path, cwd, env, what):
  print(f'\n$ {" ".join(cmd)}\n  (log: {log_path})', flush=True)
  t0 = time.time()
  with open(log_path, 'w') as log:
    rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                        check=False).returncode
  with open(log_path) as f:
    text = f.read()
  if rc != 0:
    tail = '\n'.join(text.splitlines()[-15:])
    raise Failure(f'{what} exited with status {rc}; the end of {log_path}:\n{tail}')
  print(f'  done in {time.time() - t0:.1f} s; load average '
        f'{", ".join(f"{v:.2f}" for v in os.getloadavg())}', flush=True)
  return text


def run_official(args, root, scratch):
  data_path = os.path.join(scratch, 'official_data')
  print(f'Writing CIFAR-10 from {args.data_dir} as cifar-10-batches-py under {data_path}',
        flush=True)
  write_cifar_pickles(args.data_dir, data_path)
  runner = os.path.join(scratch, 'run_official.py')
  with open(runner, 'w') as f:
    f.write(RUNNER)
  work = os.path.join(scratch, 'official_run')
  os.makedirs(work, exist_ok=True)
  cmd = [args.official_python, runner, root,
         '--num-nodes', '10', '--frac', '1', '--num-steps', str(args.rounds),
         '--batch-size', '512', '--inner-steps', str(args.local_epochs),
         '--inner-lr', '0.005', '--inner-wd', '5e-05',
         '--data-path', data_path, '--save-path', os.path.join(work, 'Results', 'temp')]
  env = dict(os.environ, PYTHONDONTWRITEBYTECODE='1')
  log = _run_logged(cmd, os.path.join(scratch, 'official.log'), work, env, 'The official code')
  times = official_round_times(log)
  if len(times) != args.rounds:
    raise Failure(f'found {len(times)} timed rounds, not {args.rounds}, in '
                  f'{scratch}/official.log: has the official log format changed?')
  return times, official_accuracies(log)


def run_ours(args, scratch):
  workdir = os.path.join(scratch, 'ours')
  cmd = [sys.executable, '-m', 'fedssa_jax.main', f'--config={CONFIG}',
         f'--config.local_epochs={args.local_epochs}', f'--config.num_rounds={args.rounds}',
         f'--config.data_dir={args.data_dir}', f'--workdir={workdir}']
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env['PYTHONPATH'] = REPO + os.pathsep + env.get('PYTHONPATH', '')
  _run_logged(cmd, os.path.join(scratch, 'ours.log'), REPO, env, 'fedssa_jax.main')
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return [r['round_seconds'] for r in records], [r['mean_accuracy'] for r in records]


def steady(times):
  return float(np.mean(times[1:])) if len(times) > 1 else float('nan')


def report(official, ours, rounds, local_epochs):
  (t_off, acc_off), (t_ours, acc_ours) = official, ours
  fmt = lambda ts: ', '.join(f'{t:.1f}' for t in ts)
  s_off, s_ours = steady(t_off), steady(t_ours)
  lines = [
      '',
      f'FedSSA at {CONFIG}, E={local_epochs}, {rounds} rounds each, seconds per round '
      '(steady: the mean after round 1)',
      f'  official: {fmt(t_off)} s; steady {s_off:.1f} s/round; '
      f'last mean acc {acc_off[-1] if acc_off else float("nan"):.4f}',
      f'  ours:     {fmt(t_ours)} s; steady {s_ours:.1f} s/round; '
      f'last mean acc {acc_ours[-1] if acc_ours else float("nan"):.4f}',
      f'  official / ours: {s_off / s_ours:.2f}x',
  ]
  print('\n'.join(lines), flush=True)
  return s_off, s_ours


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--official', help='a checkout of the official FedSSA code (root or FedSSA/)')
  p.add_argument('--official_python', default='python',
                 help='a Python with torch and torchvision')
  p.add_argument('--data_dir', default=os.path.expanduser('~/tensorflow_datasets'),
                 help='a TFDS data_dir holding cifar10, or an .npz of x_train, y_train, x_test, '
                 'y_test')
  p.add_argument('--rounds', type=int, default=4, help='rounds of each; the first is not counted')
  p.add_argument('--local_epochs', type=int, default=1, help='E, for both')
  p.add_argument('--scratch', help='folder for the data, logs and outputs (kept); default: a '
                 'temporary folder, removed at the end unless a run fails')
  args = p.parse_args(argv)
  if args.rounds < 2:
    p.error('--rounds must be at least 2 (the first round is not counted)')
  try:
    root = find_official(args.official)
    torch_version = check_official_python(args.official_python)
    scratch = args.scratch or tempfile.mkdtemp(prefix='side_by_side_')
    os.makedirs(scratch, exist_ok=True)
    ours = _git_head(REPO, code=('fedssa_jax', 'configs'))
    print(f'official code: {root} (commit {_git_head(root)}), torch {torch_version}; '
          f'this repository at commit {ours}; {os.cpu_count()} CPUs, load average '
          f'{", ".join(f"{v:.2f}" for v in os.getloadavg())}', flush=True)
    official = run_official(args, root, scratch)
    ours = run_ours(args, scratch)
  except Failure as e:
    sys.exit(f'side_by_side: {e}')
  if not args.scratch:  # kept after a failure, for its logs
    shutil.rmtree(scratch, ignore_errors=True)
  report(official, ours, args.rounds, args.local_epochs)
  print(f'  load average at the end: {", ".join(f"{v:.2f}" for v in os.getloadavg())}')


if __name__ == '__main__':
  main()
