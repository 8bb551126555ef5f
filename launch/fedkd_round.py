"""One local round of FedKD, ours against HtFLlib's own client code, from the same weights and
batches.

  python launch/fedkd_round.py --htfllib=/path/to/HtFLlib \\
      --htfllib_python=/tmp/venv-torch/bin/python [--family=cnn3 --samples=1024 --batch_size=128]

HtFLlib's side is its `clientKD.train` (flcore/clients/clientkd.py) called as it is, on a client
object that holds the mentor, the CNN-5 mentee and W_h drawn by torch, and a loader of
`--samples` random images of two classes in batches of `--batch_size` (stored order, partial
batch dropped, as HtFLlib's loader). Our side starts from those weights (converted to our layout,
`ours_from_torch`) and trains the same batches with FedKD's loss (fedssa_jax/methods/fedkd.py),
a clip of 10 per model and SGD at `--lr`:
  - in float64 (torch's default dtype set to float64, JAX with x64): our loss in a plain loop of
    steps against HtFLlib's code. Float rounding is then far below the training's movement, so
    any difference in the loss, its gradient, the clips or the step order shows;
  - in float32 (torch's float32 weights): each side's round against the exact one, our loss in
    float64 from the same start (float32 rounding alone sometimes flips a ReLU or max-pool
    decision, which carries a round further), and our engine's `local_train` (the batches in
    stored order, the partial batch dropped: batch_order=fixed, drop_last=True) against our
    plain loop.
It prints the largest difference of the trained weights, relative to how far training moved
them, and exits 1 if the float64 difference exceeds --tolerance.

Mapped: the FedSSA CNNs are launch/against_htfllib.py's (its CNN_MODULE in torch); torch's
conv kernels [O, I, 5, 5] are our [5, 5, I, O], its Linear weights [out, in] our [in, out], and
fc1's inputs, which torch flattens as (channel, row, column), ours flattens as (row, column,
channel). HtFLlib's code is not changed; the runner only makes torch.load accept pickled models
(as the comparison's runner does).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import against_htfllib  # pylint: disable=g-import-not-at-top,wrong-import-position

sys.path.insert(0, against_htfllib.REPO)
from fedssa_jax.data.datasets import NORMALIZATION  # pylint: disable=g-import-not-at-top,wrong-import-position
from fedssa_jax.models.cnn import CNN_FEATURE_DIM, FAMILIES  # pylint: disable=g-import-not-at-top,wrong-import-position

Failure = against_htfllib.Failure
FAMILY = {f.name: f for f in FAMILIES}
C2 = {f.name: f.c2 for f in FAMILIES}
MODELS = ('model', 'global_model', 'W_h')  # HtFLlib's names of the mentor, mentee and W_h
CIFAR_MEAN, CIFAR_STD = NORMALIZATION['cifar10']

# argv: <HtFLlib's system folder> <scratch> <input .npz> <output .npz>
TORCH_SIDE = r'''
import os, sys, tempfile, types
sys.dont_write_bytecode = True
system, scratch, inp_path, out_path = sys.argv[1:5]
sys.path.insert(0, system); sys.path.insert(0, scratch)
import numpy as np
import torch
from torch import nn
_load = torch.load
torch.load = lambda *a, **k: _load(*a, **{**k, 'weights_only': False})  # its pickled models
from fedssa_cnn import FedSSACNN
import flcore.trainmodel.models as htfl_models
htfl_models.FedSSACNN = FedSSACNN
from flcore.clients.clientbase import load_item, save_item
import flcore.clients.clientkd as clientkd
inp = np.load(inp_path)
if bool(inp['float64']):
  torch.set_default_dtype(torch.float64)
x = torch.tensor(inp['x']).to(torch.get_default_dtype())
y = torch.tensor(inp['y']).long()
args = types.SimpleNamespace(models=[str(inp['mentor'])], global_model=str(inp['mentee']),
                             feature_dim=int(inp['feature_dim']), num_classes=int(inp['classes']))
torch.manual_seed(int(inp['seed']))
mentor = htfl_models.BaseHeadSplit(args, 0)
mentee = htfl_models.BaseHeadSplit(args, is_global=True)
w_h = nn.Linear(args.feature_dim, args.feature_dim, bias=False)
folder = tempfile.mkdtemp(dir=scratch)
loader = torch.utils.data.DataLoader(list(zip(x, y)), int(inp['batch_size']), drop_last=True,
                                     shuffle=False)
client = types.SimpleNamespace(
    role='Client_0', save_folder_name=folder, learning_rate=float(inp['lr']),
    mentee_learning_rate=float(inp['lr']), local_epochs=1, train_slow=False, device='cpu',
    loss=nn.CrossEntropyLoss(), KL=nn.KLDivLoss(), MSE=nn.MSELoss(), energy=0.95,
    train_time_cost={'num_rounds': 0, 'total_cost': 0.0}, load_train_data=lambda: loader)
out = {}
def dump(prefix):
  for name in ('model', 'global_model', 'W_h'):
    for k, v in load_item('Client_0', name, folder).state_dict().items():
      out[f'{prefix}/{name}/{k}'] = v.detach().numpy().copy()
for name, m in (('model', mentor), ('global_model', mentee), ('W_h', w_h)):
  save_item(m, 'Client_0', name, folder)
dump('before')
clientkd.clientKD.train(client)
dump('after')
np.savez(out_path, **out)
'''


def ours_from_torch(state: dict, prefix: str, name: str, c2: int) -> dict:
  """Our CNN parameters from the torch state `state[f'{prefix}/{name}/<torch name>']` of a
  BaseHeadSplit(FedSSACNN) with conv2 width `c2` (numpy arrays, their dtype kept)."""
  get = lambda k: np.asarray(state[f'{prefix}/{name}/{k}'])
  p = {layer: {'kernel': get(f'base.{layer}.weight').transpose(2, 3, 1, 0),
               'bias': get(f'base.{layer}.bias')} for layer in ('conv1', 'conv2')}
  fc1 = get('base.fc1.weight')  # [out, (c, h, w)] -> [(h, w, c), out]
  side = int(round((fc1.shape[1] // c2) ** 0.5))
  p['fc1'] = {'kernel': fc1.reshape(-1, c2, side, side).transpose(2, 3, 1, 0).reshape(
      side * side * c2, -1), 'bias': get('base.fc1.bias')}
  p['fc2'] = {'kernel': get('base.fc2.weight').T, 'bias': get('base.fc2.bias')}
  p['fc3'] = {'kernel': get('head.weight').T, 'bias': get('head.bias')}
  return p


def trainables(state: dict, prefix: str, family: str) -> dict:
  """{'model', 'mentee', 'w_h'} (our FedKD trainable) of HtFLlib's dumped weights."""
  return {'model': ours_from_torch(state, prefix, 'model', C2[family]),
          'mentee': ours_from_torch(state, prefix, 'global_model', 32),
          'w_h': np.asarray(state[f'{prefix}/W_h/weight']).T}


def batches(seed: int, samples: int, classes=(3, 7)):
  """Random uint8 images of two classes, and them normalised with CIFAR's constants, NHWC."""
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (samples, 32, 32, 3), dtype=np.uint8)
  labels = rng.choice(classes, samples).astype(np.int32)
  x = (images.astype(np.float64) / 255.0 - np.asarray(CIFAR_MEAN)) / np.asarray(CIFAR_STD)
  return images, labels, x


def plain_round(method, apply_fn, trainable, x, labels, *, batch_size: int, lr: float,
                clip: float, dtype):
  """Our FedKD loss in a plain loop: the batches in order, the partial batch dropped, each
  model's gradient clipped to `clip` by its own norm (torch's clip_grad_norm_), plain SGD."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  tr = jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), trainable)
  x = jnp.asarray(x, dtype)
  grad = jax.jit(jax.grad(lambda t, xb, yb: method.loss(
      apply_fn, t, None, (xb,), yb, jnp.ones(yb.shape[0], bool))[0]))
  for s in range(x.shape[0] // batch_size):
    sl = slice(s * batch_size, (s + 1) * batch_size)
    g = grad(tr, x[sl], jnp.asarray(labels[sl]))
    new = {}
    for part in tr:
      norm = jnp.sqrt(sum(jnp.sum(v ** 2) for v in jax.tree_util.tree_leaves(g[part])))
      scale = jnp.minimum(1.0, clip / (norm + 1e-6))  # torch's clip_grad_norm_
      new[part] = jax.tree_util.tree_map(lambda p, gi: p - lr * scale * gi, tr[part], g[part])
    tr = new
  return tr


def largest_gap(a: dict, b: dict, start: dict) -> tuple[float, str]:
  """max over tensors of max|a - b| / max|b - start| (how far apart, relative to how far the
  round moved the tensor), and the tensor where it is reached."""
  import jax  # pylint: disable=g-import-not-at-top
  worst, where = 0.0, ''
  flat_b = dict(jax.tree_util.tree_flatten_with_path(b)[0])
  flat_s = dict(jax.tree_util.tree_flatten_with_path(start)[0])
  for path, x in jax.tree_util.tree_flatten_with_path(a)[0]:
    moved = float(np.max(np.abs(np.asarray(flat_b[path], np.float64)
                                - np.asarray(flat_s[path], np.float64))))
    gap = float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(flat_b[path], np.float64))))
    if moved > 0 and gap / moved > worst:
      worst, where = gap / moved, jax.tree_util.keystr(path)
  return worst, where


def htfllib_round(args, scratch: str, float64: bool, images_x) -> dict:
  """HtFLlib's clientKD.train on the batches; returns its weights before and after."""
  _, labels, x = images_x
  torch_model = lambda f: (f'FedSSACNN({f.c2}, {f.fc1}, num_classes=10, '
                           f'dim={CNN_FEATURE_DIM})')
  inp, out = os.path.join(scratch, 'in.npz'), os.path.join(scratch, 'out.npz')
  np.savez(inp, x=x.transpose(0, 3, 1, 2).astype(np.float64 if float64 else np.float32),
           y=labels, batch_size=args.batch_size, lr=args.lr, seed=args.seed, float64=float64,
           mentor=torch_model(FAMILY[args.family]), mentee=torch_model(FAMILY['cnn5']),
           feature_dim=CNN_FEATURE_DIM, classes=10)
  with open(os.path.join(scratch, 'fedssa_cnn.py'), 'w') as f:
    f.write(against_htfllib.CNN_MODULE)
  with open(os.path.join(scratch, 'torch_side.py'), 'w') as f:
    f.write(TORCH_SIDE)
  env = dict(os.environ, PYTHONDONTWRITEBYTECODE='1', CUDA_VISIBLE_DEVICES='')
  done = subprocess.run([args.htfllib_python, os.path.join(scratch, 'torch_side.py'),
                         args.htfllib, scratch, inp, out], env=env, capture_output=True,
                        text=True, check=False)
  if done.returncode:
    raise Failure(f'HtFLlib\'s side failed:\n{done.stderr[-3000:]}')
  return dict(np.load(out))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--htfllib', default='', help='an HtFLlib checkout')
  parser.add_argument('--htfllib_python', default='', help='a Python with torch')
  parser.add_argument('--family', default='cnn3', choices=sorted(C2), help="the mentor's CNN")
  parser.add_argument('--samples', type=int, default=1024)
  parser.add_argument('--batch_size', type=int, default=128)
  parser.add_argument('--lr', type=float, default=0.05)
  parser.add_argument('--seed', type=int, default=0, help="torch's seed and the images'")
  parser.add_argument('--tolerance', type=float, default=1e-6)
  args = parser.parse_args(argv)
  try:
    args.htfllib = against_htfllib.find_htfllib(args.htfllib)
    against_htfllib.check_htfllib_python(args.htfllib_python)
    if args.samples < args.batch_size:
      raise Failure(f'--samples={args.samples} holds no full batch of --batch_size='
                    f'{args.batch_size}: HtFLlib\'s loader would train nothing.')
  except Failure as e:
    print(f'fedkd_round: {e}', file=sys.stderr)
    return 2
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from fedssa_jax import config_lib, models  # pylint: disable=g-import-not-at-top
  from fedssa_jax.data.partition import DeviceData  # pylint: disable=g-import-not-at-top
  from fedssa_jax.engine import training  # pylint: disable=g-import-not-at-top
  from fedssa_jax.methods import fedkd  # pylint: disable=g-import-not-at-top

  data = batches(args.seed, args.samples)
  steps = args.samples // args.batch_size
  print(f'FedKD, one local round: mentor {args.family}, mentee cnn5, {steps} steps of '
        f'{args.batch_size} (the stored order, the partial batch dropped), lr {args.lr}, clip 10')
  method = fedkd.FedKD(config_lib.base_config('cifar10'), 1, 10)
  ok = True
  with tempfile.TemporaryDirectory() as scratch:
    for f64 in (True, False):
      jax.config.update('jax_enable_x64', f64)  # our engine runs in float32 only
      dtype = jnp.float64 if f64 else jnp.float32
      state = htfllib_round(args, scratch, f64, data)
      start, theirs = trainables(state, 'before', args.family), trainables(state, 'after',
                                                                           args.family)
      mentor = models.make_model(args.family, 10, 'xla', dtype, feature_dim=500)
      method.mentee_model = models.make_model('cnn5', 10, 'xla', dtype, feature_dim=500)
      kw = dict(batch_size=args.batch_size, lr=args.lr, clip=10.0, dtype=dtype)
      plain = plain_round(method, mentor.apply, start, data[2], data[1], **kw)
      gap, where = largest_gap(plain, theirs, start)
      print(f'  {"float64" if f64 else "float32"}: our loss in a plain loop vs HtFLlib\'s '
            f'clientKD.train: {gap:.1e} of the movement (at {where})')
      if f64:
        ok = gap <= args.tolerance
        continue
      # Float32: how far each side's round is from the same round in float64 (our loss in the
      # plain loop, float64 from the same float32 start: the exact round), and our engine
      # against the plain loop.
      jax.config.update('jax_enable_x64', True)
      exact = plain_round(method, models.make_model(args.family, 10, 'xla', jnp.float64,
                                                    feature_dim=500).apply,
                          start, data[2], data[1], **{**kw, 'dtype': jnp.float64})
      jax.config.update('jax_enable_x64', False)
      for who, trained in (('HtFLlib\'s', theirs), ('our plain loop\'s', plain)):
        print(f'  float32: {who} round vs the exact one: {largest_gap(trained, exact, start)[0]:.1e}')
      cfg = training.TrainConfig(batch_size=args.batch_size, local_epochs=1, lr=args.lr,
                                 momentum=0.0, weight_decay=0.0, clip_norm=10.0, augment=False,
                                 fixed_order=True, drop_last=True, mean=CIFAR_MEAN,
                                 std=CIFAR_STD)
      n = args.samples
      dd = DeviceData(jnp.asarray(data[0]), jnp.asarray(data[1]), jnp.arange(n)[None],
                      jnp.array([n]), jnp.arange(n)[None], jnp.array([n]))
      engine, _, _ = jax.jit(lambda t: training.local_train(
          t, None, jax.random.PRNGKey(0), dd.train_idx[0], dd.train_n[0], dd,
          apply_fn=mentor.apply, cfg=cfg, method=method))(
              jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), start))
      print(f'  float32: our engine\'s local_train vs our plain loop: '
            f'{largest_gap(engine, plain, start)[0]:.1e}')
  print('same round' if ok else f'DIFFERENT: float64 gap above --tolerance={args.tolerance}')
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
