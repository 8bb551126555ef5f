"""HtFLlib's image families (fedssa_jax/models/zoo.py) against their PyTorch definitions.

The numbers below come from HtFLlib's own models, built as its clients build them
(`BaseHeadSplit` on each `system/main.py` string) with torch 2.14.1 and torchvision 0.29.1, by
tests/data/make_zoo_torch_outputs.py, which also made tests/data/zoo_torch_outputs.npz: each
model's outputs in float64 under deterministic weights (`det_value`, imported from that script),
in eval and train mode. The suite needs no PyTorch.
"""
import functools
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import load_file
from fedssa_jax import models
from fedssa_jax.models import zoo

ref = load_file('tests/data/make_zoo_torch_outputs.py', 'make_zoo_torch_outputs')
OUTPUTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'zoo_torch_outputs.npz')
IMAGE = (32, 32, 3)

# PyTorch's (parameters, batch-norm running statistics) per module (ref.group_key) of HtFLlib's
# BaseHeadSplit at num_classes=10, feature_dim=512: the printout of make_zoo_torch_outputs.py.
TORCH_COUNTS = {
    'fedavgcnn': {
        'conv1.0': (2432, 0), 'conv2.0': (51264, 0), 'fc1.0': (819712, 0), 'head': (5130, 0),
    },
    'resnet4': {
        'conv1': (9408, 0), 'bn1': (128, 128), 'layer_0.conv1': (36864, 0),
        'layer_0.bn2': (128, 128), 'layer_0.conv2': (36864, 0), 'layer_0.bn3': (128, 128),
        'head': (5130, 0),
    },
    'resnet6': {
        'conv1': (9408, 0), 'bn1': (128, 128), 'layer_0.conv1': (36864, 0),
        'layer_0.bn2': (128, 128), 'layer_0.conv2': (36864, 0), 'layer_0.bn3': (128, 128),
        'layer_1.conv1': (73728, 0), 'layer_1.bn2': (256, 256), 'layer_1.conv2': (147456, 0),
        'layer_1.bn3': (256, 256), 'layer_1.downsample': (8448, 256), 'head': (5130, 0),
    },
    'resnet8': {
        'conv1': (9408, 0), 'bn1': (128, 128), 'layer_0.conv1': (36864, 0),
        'layer_0.bn2': (128, 128), 'layer_0.conv2': (36864, 0), 'layer_0.bn3': (128, 128),
        'layer_1.conv1': (73728, 0), 'layer_1.bn2': (256, 256), 'layer_1.conv2': (147456, 0),
        'layer_1.bn3': (256, 256), 'layer_1.downsample': (8448, 256), 'layer_2.conv1': (294912, 0),
        'layer_2.bn2': (512, 512), 'layer_2.conv2': (589824, 0), 'layer_2.bn3': (512, 512),
        'layer_2.downsample': (33280, 512), 'head': (5130, 0),
    },
    'resnet10': {
        'conv1': (9408, 0), 'bn1': (128, 128), 'layer_0.conv1': (36864, 0),
        'layer_0.bn2': (128, 128), 'layer_0.conv2': (36864, 0), 'layer_0.bn3': (128, 128),
        'layer_1.conv1': (73728, 0), 'layer_1.bn2': (256, 256), 'layer_1.conv2': (147456, 0),
        'layer_1.bn3': (256, 256), 'layer_1.downsample': (8448, 256), 'layer_2.conv1': (294912, 0),
        'layer_2.bn2': (512, 512), 'layer_2.conv2': (589824, 0), 'layer_2.bn3': (512, 512),
        'layer_2.downsample': (33280, 512), 'layer_3.conv1': (1179648, 0),
        'layer_3.bn2': (1024, 1024), 'layer_3.conv2': (2359296, 0), 'layer_3.bn3': (1024, 1024),
        'layer_3.downsample': (132096, 1024), 'head': (5130, 0),
    },
    'resnet18': {
        'conv1': (9408, 0), 'bn1': (128, 128), 'layer1.0': (73984, 256), 'layer1.1': (73984, 256),
        'layer2.0': (230144, 768), 'layer2.1': (295424, 512), 'layer3.0': (919040, 1536),
        'layer3.1': (1180672, 1024), 'layer4.0': (3673088, 3072), 'layer4.1': (4720640, 2048),
        'head': (5130, 0),
    },
    'resnet34': {
        'conv1': (9408, 0), 'bn1': (128, 128), 'layer1.0': (73984, 256), 'layer1.1': (73984, 256),
        'layer1.2': (73984, 256), 'layer2.0': (230144, 768), 'layer2.1': (295424, 512),
        'layer2.2': (295424, 512), 'layer2.3': (295424, 512), 'layer3.0': (919040, 1536),
        'layer3.1': (1180672, 1024), 'layer3.2': (1180672, 1024), 'layer3.3': (1180672, 1024),
        'layer3.4': (1180672, 1024), 'layer3.5': (1180672, 1024), 'layer4.0': (3673088, 3072),
        'layer4.1': (4720640, 2048), 'layer4.2': (4720640, 2048), 'head': (5130, 0),
    },
    'resnet50': {
        'conv1': (9408, 0), 'bn1': (128, 128), 'layer1.0': (75008, 1280), 'layer1.1': (70400, 768),
        'layer1.2': (70400, 768), 'layer2.0': (379392, 2560), 'layer2.1': (280064, 1536),
        'layer2.2': (280064, 1536), 'layer2.3': (280064, 1536), 'layer3.0': (1512448, 5120),
        'layer3.1': (1117184, 3072), 'layer3.2': (1117184, 3072), 'layer3.3': (1117184, 3072),
        'layer3.4': (1117184, 3072), 'layer3.5': (1117184, 3072), 'layer4.0': (6039552, 10240),
        'layer4.1': (4462592, 6144), 'layer4.2': (4462592, 6144), 'head': (5130, 0),
    },
    'resnet101': {
        'conv1': (9408, 0), 'bn1': (128, 128), 'layer1.0': (75008, 1280), 'layer1.1': (70400, 768),
        'layer1.2': (70400, 768), 'layer2.0': (379392, 2560), 'layer2.1': (280064, 1536),
        'layer2.2': (280064, 1536), 'layer2.3': (280064, 1536), 'layer3.0': (1512448, 5120),
        'layer3.1': (1117184, 3072), 'layer3.2': (1117184, 3072), 'layer3.3': (1117184, 3072),
        'layer3.4': (1117184, 3072), 'layer3.5': (1117184, 3072), 'layer3.6': (1117184, 3072),
        'layer3.7': (1117184, 3072), 'layer3.8': (1117184, 3072), 'layer3.9': (1117184, 3072),
        'layer3.10': (1117184, 3072), 'layer3.11': (1117184, 3072), 'layer3.12': (1117184, 3072),
        'layer3.13': (1117184, 3072), 'layer3.14': (1117184, 3072), 'layer3.15': (1117184, 3072),
        'layer3.16': (1117184, 3072), 'layer3.17': (1117184, 3072), 'layer3.18': (1117184, 3072),
        'layer3.19': (1117184, 3072), 'layer3.20': (1117184, 3072), 'layer3.21': (1117184, 3072),
        'layer3.22': (1117184, 3072), 'layer4.0': (6039552, 10240), 'layer4.1': (4462592, 6144),
        'layer4.2': (4462592, 6144), 'head': (5130, 0),
    },
    'resnet152': {
        'conv1': (9408, 0), 'bn1': (128, 128), 'layer1.0': (75008, 1280), 'layer1.1': (70400, 768),
        'layer1.2': (70400, 768), 'layer2.0': (379392, 2560), 'layer2.1': (280064, 1536),
        'layer2.2': (280064, 1536), 'layer2.3': (280064, 1536), 'layer2.4': (280064, 1536),
        'layer2.5': (280064, 1536), 'layer2.6': (280064, 1536), 'layer2.7': (280064, 1536),
        'layer3.0': (1512448, 5120), 'layer3.1': (1117184, 3072), 'layer3.2': (1117184, 3072),
        'layer3.3': (1117184, 3072), 'layer3.4': (1117184, 3072), 'layer3.5': (1117184, 3072),
        'layer3.6': (1117184, 3072), 'layer3.7': (1117184, 3072), 'layer3.8': (1117184, 3072),
        'layer3.9': (1117184, 3072), 'layer3.10': (1117184, 3072), 'layer3.11': (1117184, 3072),
        'layer3.12': (1117184, 3072), 'layer3.13': (1117184, 3072), 'layer3.14': (1117184, 3072),
        'layer3.15': (1117184, 3072), 'layer3.16': (1117184, 3072), 'layer3.17': (1117184, 3072),
        'layer3.18': (1117184, 3072), 'layer3.19': (1117184, 3072), 'layer3.20': (1117184, 3072),
        'layer3.21': (1117184, 3072), 'layer3.22': (1117184, 3072), 'layer3.23': (1117184, 3072),
        'layer3.24': (1117184, 3072), 'layer3.25': (1117184, 3072), 'layer3.26': (1117184, 3072),
        'layer3.27': (1117184, 3072), 'layer3.28': (1117184, 3072), 'layer3.29': (1117184, 3072),
        'layer3.30': (1117184, 3072), 'layer3.31': (1117184, 3072), 'layer3.32': (1117184, 3072),
        'layer3.33': (1117184, 3072), 'layer3.34': (1117184, 3072), 'layer3.35': (1117184, 3072),
        'layer4.0': (6039552, 10240), 'layer4.1': (4462592, 6144), 'layer4.2': (4462592, 6144),
        'head': (5130, 0),
    },
    'mobilenetv2': {
        'features.0': (928, 64), 'features.1': (896, 96), 'features.2': (5136, 432),
        'features.3': (8832, 624), 'features.4': (10000, 640), 'features.5': (14848, 832),
        'features.6': (14848, 832), 'features.7': (21056, 896), 'features.8': (54272, 1664),
        'features.9': (54272, 1664), 'features.10': (54272, 1664), 'features.11': (66624, 1728),
        'features.12': (118272, 2496), 'features.13': (118272, 2496),
        'features.14': (155264, 2624), 'features.15': (320000, 4160),
        'features.16': (320000, 4160), 'features.17': (473920, 4480),
        'features.18': (412160, 2560), 'head': (5130, 0),
    },
    'googlenet': {
        'conv1.conv': (9408, 0), 'conv1.bn': (128, 128), 'conv2.conv': (4096, 0),
        'conv2.bn': (128, 128), 'conv3.conv': (110592, 0), 'conv3.bn': (384, 384),
        'inception3a.branch1': (12416, 128), 'inception3a.branch2': (129472, 448),
        'inception3a.branch3': (7776, 96), 'inception3a.branch4': (6208, 64),
        'inception3b.branch1': (33024, 256), 'inception3b.branch2': (254592, 640),
        'inception3b.branch3': (36096, 256), 'inception3b.branch4': (16512, 128),
        'inception4a.branch1': (92544, 384), 'inception4a.branch2': (226400, 608),
        'inception4a.branch3': (14720, 128), 'inception4a.branch4': (30848, 128),
        'inception4b.branch1': (82240, 320), 'inception4b.branch2': (283808, 672),
        'inception4b.branch3': (26288, 176), 'inception4b.branch4': (32896, 128),
        'inception4c.branch1': (65792, 256), 'inception4c.branch2': (361216, 768),
        'inception4c.branch3': (26288, 176), 'inception4c.branch4': (32896, 128),
        'inception4d.branch1': (57568, 224), 'inception4d.branch2': (447840, 864),
        'inception4d.branch3': (35008, 192), 'inception4d.branch4': (32896, 128),
        'inception4e.branch1': (135680, 512), 'inception4e.branch2': (546240, 960),
        'inception4e.branch3': (54080, 320), 'inception4e.branch4': (67840, 256),
        'inception5a.branch1': (213504, 512), 'inception5a.branch2': (594880, 960),
        'inception5a.branch3': (63808, 320), 'inception5a.branch4': (106752, 256),
        'inception5b.branch1': (320256, 768), 'inception5b.branch2': (824448, 1152),
        'inception5b.branch3': (95584, 352), 'inception5b.branch4': (106752, 256),
        'head': (5130, 0),
    },
}
# sha256 of every state_dict entry's sorted 'name:shape' (ref.fingerprint), parameters and
# running statistics.
TORCH_FINGERPRINTS = {
    'fedavgcnn': 'fadf2fd75e6bb775',
    'resnet4': '81603af3c6e27ff1',
    'resnet6': '7c0e552dcf951ce0',
    'resnet8': '99c3b35a1797b058',
    'resnet10': 'dfd5e520f81e63fb',
    'resnet18': '249ff2078a1f8e6a',
    'resnet34': '23004ea57f5e4876',
    'resnet50': 'e02685c5460cb2dc',
    'resnet101': '9dac2dd35d72dfc9',
    'resnet152': 'a8c2b05560a9069f',
    'mobilenetv2': '703a499d50c8859e',
    'googlenet': 'd078cee37fe0de49',
}

# The families whose training step runs numerically in the vmap test: no batch norm; HtFLlib's
# BasicBlocks with a downsampling shortcut. MobileNetV2's and GoogLeNet's pieces run in smaller
# networks (MiniMobileNetV2, MiniGoogLeNet); every family is checked by shape. Whole, their steps
# would take 13-15 s each on the 2-core CPU, nearly all compiling, and in float32 their last
# batch norms (2 or 4 values a channel) make two programs' gradients differ by several percent
# (by 1e-9 in float64, whose convolutions XLA:CPU runs 10-20x slower). What each test takes there
# decides the marks: one above a couple of seconds is `slow`.
VMAP_FAMILIES = ('fedavgcnn', 'resnet6')
SLOW = ('resnet34', 'resnet50', 'resnet101', 'resnet152', 'mobilenetv2', 'googlenet')
# Compiled as one program, the forward of these is quicker than run op by op (GoogLeNet: 2 s
# against 11 s); the ResNets' repeated blocks are the other way round (ResNet-152: 9 s, 6 s).
JIT_FORWARD = ('mobilenetv2', 'googlenet')


def marked(names, slow=SLOW):
  return [pytest.param(n, marks=pytest.mark.slow) if n in slow else n for n in names]


@functools.cache
def abstract(name: str, image=IMAGE):
  """(model, its variables as shapes for `image`-sized inputs), without compiling anything."""
  model = zoo.make_zoo_model(name, ref.NUM_CLASSES, ref.FEATURE_DIM)
  variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, *image)))
  return model, {'batch_stats': {}, **variables}


def torch_variables(name: str, dtype=np.float32, salt: str = '', image=IMAGE):
  """`name`'s variables holding the deterministic weights of the PyTorch reference
  (ref.det_value of each PyTorch name; a `salt` gives other weights)."""
  _, shapes = abstract(name, tuple(image))
  state = {k: ref.det_value(salt + k, shape) for k, (_, shape) in zoo.torch_names(shapes).items()}
  return zoo.from_torch_state(shapes, state, dtype)


def lookup(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def test_groups_follow_htfllib():
  assert zoo.GROUPS == {
      'htfe2': ('fedavgcnn', 'resnet18'),
      'htfe3': ('resnet10', 'resnet18', 'resnet34'),
      'htfe4': ('fedavgcnn', 'googlenet', 'mobilenetv2', 'resnet18'),
      'htfe5': ('googlenet', 'mobilenetv2', 'resnet18', 'resnet34', 'resnet50'),
      'htfe8': ('fedavgcnn', 'googlenet', 'mobilenetv2', 'resnet18', 'resnet34', 'resnet50',
                'resnet101', 'resnet152'),
      'htfe9': ('resnet4', 'resnet6', 'resnet8', 'resnet10', 'resnet18', 'resnet34', 'resnet50',
                'resnet101', 'resnet152'),
  }
  assert set(zoo.ZOO_FAMILIES) == set(TORCH_COUNTS) == set(ref.MODELS)
  assert {n for g in zoo.GROUPS.values() for n in g} == set(zoo.ZOO_FAMILIES)
  with pytest.raises(ValueError, match='Unknown zoo family'):
    zoo.make_zoo_model('resnet12', 10, zoo.FEATURE_DIM)
  assert zoo.make_zoo_model('resnet4', 10, zoo.FEATURE_DIM, 'bfloat16').dtype == jnp.bfloat16


@pytest.mark.parametrize('name', zoo.ZOO_FAMILY_NAMES)
def test_counts_and_names_match_pytorch(name):
  """Every module's parameters and running statistics as PyTorch's, every variable named and
  shaped as its PyTorch state_dict entry, and (logits, rep) of shapes [B, 10], [B, 512]."""
  model, variables = abstract(name)
  names = zoo.torch_names(variables)
  counts = {}
  for torch_name, ((collection, *_), shape) in names.items():
    entry = counts.setdefault(ref.group_key(torch_name), [0, 0])
    entry[collection == 'batch_stats'] += int(np.prod(shape))
  assert {k: tuple(v) for k, v in counts.items()} == TORCH_COUNTS[name]
  assert ref.fingerprint((k, shape) for k, (_, shape) in names.items()) == \
      TORCH_FINGERPRINTS[name]
  assert models.param_count(variables['params']) == sum(p for p, _ in TORCH_COUNTS[name].values())
  assert variables['params']['fc3']['kernel'].shape == (512, 10)
  out = jax.eval_shape(model.apply, variables, jnp.zeros((3, *IMAGE)))
  assert [(o.shape, o.dtype) for o in out] == [((3, 10), jnp.float32), ((3, 512), jnp.float32)]
  # FedAvgCNN's fc1 reads what the convolutions leave: HtFLlib's dim=1600 at 32x32, 10816 at 64
  # (test_forward_matches_pytorch runs every family on 64x64 images too).
  if name == 'fedavgcnn':
    assert abstract(name, (64, 64, 3))[1]['params']['fc1']['0']['kernel'].shape == (10816, 512)


# ResNet-101 and -152 are ResNet-50's bottleneck blocks, more of them: their layout is checked
# by their parameter counts and fingerprints against PyTorch's (above), and their forward is
# left to ResNet-50's (9 s of the suite's budget).
@pytest.mark.parametrize('name', marked(
    [n for n in zoo.ZOO_FAMILY_NAMES if n not in ('resnet101', 'resnet152')]))
def test_forward_matches_pytorch(name):
  """Float64 logits and representation, in eval mode on 32x32 images and in train mode on 64x64
  ones, and the running statistics after the training forward, against PyTorch's under the same
  weights (make_zoo_torch_outputs.py; its docstring says why training is checked at 64x64)."""
  expected = np.load(OUTPUTS)
  xe, xt = (ref.det_uniform(ref.INPUTS[mode], 'input').transpose(0, 2, 3, 1)
            for mode in ('eval', 'train'))
  with jax.enable_x64(True):
    model = zoo.make_zoo_model(name, ref.NUM_CLASSES, ref.FEATURE_DIM, jnp.float64,
                               **({'dropout_rate': 0.0} if zoo.uses_dropout(name) else {}))
    eval_vars = torch_variables(name, np.float64)
    same = jax.tree_util.tree_structure(abstract(name)) == jax.tree_util.tree_structure(
        abstract(name, xt.shape[1:])) and all(a.shape == b.shape for a, b in zip(
            jax.tree_util.tree_leaves(abstract(name)[1]),
            jax.tree_util.tree_leaves(abstract(name, xt.shape[1:])[1])))
    train_vars = eval_vars if same else torch_variables(name, np.float64, image=xt.shape[1:])

    def forward(eval_vars, xe, train_vars, xt):
      return model.apply(eval_vars, xe), model.apply(train_vars, xt, train=True,
                                                     mutable=['batch_stats'])
    if name in JIT_FORWARD:
      forward = jax.jit(forward)
    got = {}
    got['eval'], (got['train'], updated) = forward(eval_vars, xe, train_vars, xt)
    for mode, (logits, rep) in got.items():
      for key, value in (('logits', logits), ('rep', rep)):
        want = expected[f'{name}/{mode}_{key}']
        np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                   err_msg=f'{name} {mode} {key}')
    names = zoo.torch_names(updated)
    bns = sorted(k[:-len('.running_mean')] for k in names if k.endswith('running_mean'))
    for stat in ('mean', 'var'):
      sums = [np.asarray(lookup(updated, names[f'{k}.running_{stat}'][0])).sum() for k in bns]
      np.testing.assert_allclose(sums, expected[f'{name}/train_{stat}_sums'], rtol=1e-9,
                                 atol=1e-9, err_msg=f'{name} running {stat}')


def client_step(model, variables, x, y, key):
  """One client's training forward and gradient (batch_stats updated, dropout from `key`) and
  eval forward."""
  def loss(params):
    (logits, rep), updated = model.apply(
        {'params': params, 'batch_stats': variables['batch_stats']}, x, train=True,
        mutable=['batch_stats'], rngs={'dropout': key})
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), (
        logits, rep, updated)
  (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(variables['params'])
  return value, aux, grads, model.apply(variables, x)


def assert_vmap_equals_alone(model, clients, x, y, keys):
  """client_step vmapped over the clients equals each client's alone, to float32 rounding: each
  part (loss, training outputs, gradient, eval outputs) to 1e-4 of its entries, plus 1e-5 of its
  largest (a bias that a batch norm follows has a gradient of rounding noise)."""
  step = functools.partial(client_step, model)
  alone = jax.jit(step)
  want = [alone(clients[i], x[i], y[i], keys[i]) for i in range(2)]
  stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *clients)
  got = jax.jit(jax.vmap(step))(stacked, x, y, keys)
  for i in range(2):
    for got_part, want_part in zip(got, want[i]):
      scale = max(float(np.abs(w).max()) for w in jax.tree_util.tree_leaves(want_part))
      for g, w in zip(jax.tree_util.tree_leaves(got_part), jax.tree_util.tree_leaves(want_part)):
        np.testing.assert_allclose(g[i], w, rtol=1e-4, atol=1e-5 * scale)
  return alone, want


@pytest.mark.parametrize('name', marked(VMAP_FAMILIES))
def test_vmap_over_clients_equals_each_alone(name):
  """Two clients with their own weights, batches and dropout keys: the vmapped training forward
  (loss, logits, representation, updated batch_stats), gradient and eval forward equal each
  client's alone."""
  model, _ = abstract(name)
  clients = [torch_variables(name, salt=s) for s in ('', 'client1.')]
  x = np.random.default_rng(0).uniform(-1, 1, (2, 4, *IMAGE)).astype(np.float32)
  y = np.array([[0, 1, 2, 3], [4, 5, 6, 9]])
  keys = jax.random.split(jax.random.key(3), 2)
  assert_vmap_equals_alone(model, clients, x, y, keys)


class MiniMobileNetV2(nn.Module):
  """MobileNetV2's pieces, fewer: stem, inverted residuals (expansion 6 with stride 2, and with
  the residual), the last 1x1 ConvBNReLU, dropout and the split head."""

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = zoo.ConvBNReLU(8, stride=2, name='0')(x, train)
    for i, stride in enumerate((2, 1), start=1):
      x = zoo.InvertedResidual(16, stride, 6, name=str(i))(x, train)
    x = zoo.ConvBNReLU(64, 1, name='3')(x, train).mean(axis=(1, 2))
    x = nn.Dropout(0.2, deterministic=not train)(x)
    return zoo.split_head(x, ref.NUM_CLASSES, ref.FEATURE_DIM, jnp.float32)


class MiniGoogLeNet(nn.Module):
  """GoogLeNet's pieces, narrower and fewer: stem, ceil-mode pools, one inception block (its
  pool branch too), dropout and the split head."""

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = zoo.BasicConv2d(16, 7, 2, 3, name='conv1')(x, train)
    x = zoo.max_pool(x, 3, 2, ceil_mode=True)
    x = zoo.Inception(8, 8, 16, 4, 8, 8, name='inception')(x, train)
    x = zoo.max_pool(x, 2, 2, ceil_mode=True)
    x = nn.Dropout(0.2, deterministic=not train)(x.mean(axis=(1, 2)))
    return zoo.split_head(x, ref.NUM_CLASSES, ref.FEATURE_DIM, jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize('module', (MiniMobileNetV2, MiniGoogLeNet))
def test_vmap_over_clients_equals_each_alone_pieces(module):
  """As test_vmap_over_clients_equals_each_alone, for networks of MobileNetV2's and GoogLeNet's
  pieces (depthwise convolutions, ceil-mode pools, concatenated branches, dropout), on 32x32
  images: their batch norms see 16 or more values a channel."""
  model = module()
  x = np.random.default_rng(1).uniform(-1, 1, (2, 4, *IMAGE)).astype(np.float32)
  init = jax.jit(model.init)  # quicker than op by op
  clients = [{'batch_stats': {}, **init(jax.random.key(i), x[0])} for i in range(2)]
  y = np.array([[0, 1, 2, 3], [4, 5, 6, 9]])
  keys = jax.random.split(jax.random.key(3), 2)
  alone, want = assert_vmap_equals_alone(model, clients, x, y, keys)
  # The two keys' dropout masks differ: each client's dropout is its own.
  assert not np.allclose(want[0][1][0], alone(clients[0], x[0], y[0], keys[1])[1][0])


@pytest.mark.parametrize('name', marked(
    ('resnet4', 'resnet8', 'resnet10', 'resnet18', 'resnet34', 'resnet50', 'resnet152',
     'mobilenetv2', 'googlenet'), slow=('resnet50', 'resnet152', 'mobilenetv2', 'googlenet')))
def test_vmap_shapes_of_the_other_families(name):
  """The families the test above does not run (ResNet-101 is ResNet-152's blocks, fewer): their
  vmapped training step traces, with each client's shapes."""
  model, variables = abstract(name)
  stacked = jax.tree_util.tree_map(lambda v: jax.ShapeDtypeStruct((2, *v.shape), v.dtype),
                                   variables)
  x = jax.ShapeDtypeStruct((2, 4, *IMAGE), jnp.float32)
  y = jax.ShapeDtypeStruct((2, 4), jnp.int32)
  keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 2))
  value, (logits, rep, updated), grads, (eval_logits, eval_rep) = jax.eval_shape(
      jax.vmap(functools.partial(client_step, model)), stacked, x, y, keys)
  assert value.shape == (2,) and logits.shape == eval_logits.shape == (2, 4, 10)
  assert rep.shape == eval_rep.shape == (2, 4, 512)
  shapes = lambda tree: jax.tree_util.tree_map(lambda a: a.shape, tree)
  assert shapes(grads) == shapes(stacked['params'])
  assert shapes(updated['batch_stats']) == shapes(stacked['batch_stats'])


def test_header_helpers_work_on_zoo_models():
  """fc3 is models.CNN's header: header_rows, with_header_rows and apply_header read and write
  it, and apply_header of the representation gives the model's logits."""
  model, _ = abstract('fedavgcnn')
  variables = torch_variables('fedavgcnn')
  x = ref.det_uniform((3, *IMAGE), 'x').astype(np.float32)
  logits, rep = model.apply(variables, x)
  rows = models.header_rows(variables['params'])
  assert rows.shape == (ref.NUM_CLASSES, ref.FEATURE_DIM + 1)
  np.testing.assert_allclose(models.apply_header(variables['params'], rep), logits, rtol=1e-6,
                             atol=1e-6)
  params = models.with_header_rows(variables['params'], 2 * rows)
  assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
      variables['params'])
  np.testing.assert_array_equal(models.header_rows(params), 2 * rows)


def test_init_follows_pytorch():
  """init_variables: PyTorch's distributions, BatchNorm's scale 1, bias 0, mean 0, variance 1;
  {} batch_stats for FedAvgCNN."""
  key = jax.random.key(0)
  cnn = zoo.init_variables(zoo.make_zoo_model('fedavgcnn', 10, zoo.FEATURE_DIM), key)
  assert cnn['batch_stats'] == {}
  for path, fan_in in ((('conv1', '0'), 3 * 25), (('conv2', '0'), 32 * 25), (('fc1', '0'), 1600),
                       (('fc3',), 512)):
    for leaf in ('kernel', 'bias'):  # U(-1/sqrt(fan_in), 1/sqrt(fan_in))
      w = np.asarray(lookup(cnn['params'], (*path, leaf)))
      assert 0.9 < np.abs(w).max() * np.sqrt(fan_in) <= 1, (path, leaf)
  res = zoo.init_variables(zoo.make_zoo_model('resnet4', 10, zoo.FEATURE_DIM), key)
  kernel = np.asarray(res['params']['conv1']['kernel'])  # kaiming normal, fan_out = 64 * 7 * 7
  assert kernel.shape == (7, 7, 3, 64)
  assert abs(kernel.std() * np.sqrt(64 * 49 / 2) - 1) < 0.05 and abs(kernel.mean()) < 1e-3
  bn = res['params']['layer_0']['bn2']
  np.testing.assert_array_equal(bn['scale'], 1)
  np.testing.assert_array_equal(bn['bias'], 0)
  np.testing.assert_array_equal(res['batch_stats']['bn1']['mean'], 0)
  np.testing.assert_array_equal(res['batch_stats']['bn1']['var'], 1)
  # MobileNetV2's depthwise kernels: PyTorch's fan_out of a [32, 1, 3, 3] weight is 32 * 9.
  x = jnp.zeros((1, 8, 8, 32))
  dw = zoo.ConvBNReLU(32, groups=32).init(key, x, False)['params']['0']['kernel']
  assert dw.shape == (3, 3, 1, 32) and abs(np.std(dw) * np.sqrt(32 * 9 / 2) - 1) < 0.15
  # GoogLeNet's: normal(0, 0.01).
  gk = zoo.BasicConv2d(64, 7, 2, 3).init(key, jnp.zeros((1, 8, 8, 3)), False)['params']
  assert abs(np.std(gk['conv']['kernel']) / 0.01 - 1) < 0.05


def test_batch_norm_and_bfloat16():
  """PyTorch's refusal of one value a channel in training; in bfloat16, float32 outputs and
  running statistics, close to float32's."""
  bn = zoo.BatchNorm()
  variables = bn.init(jax.random.key(0), jnp.ones((1, 1, 1, 4)))
  with pytest.raises(ValueError, match='more than one value per channel'):
    bn.apply(variables, jnp.ones((1, 1, 1, 4)), train=True, mutable=['batch_stats'])
  variables = torch_variables('resnet4')
  x = ref.det_uniform((4, *IMAGE), 'x').astype(np.float32)
  out = {}
  for dtype in ('float32', 'bfloat16'):
    model = zoo.make_zoo_model('resnet4', 10, zoo.FEATURE_DIM, dtype)
    out[dtype] = model.apply(variables, x, train=True, mutable=['batch_stats'])
  (logits, rep), stats = out['bfloat16']
  assert logits.dtype == rep.dtype == jnp.float32
  assert {a.dtype for a in jax.tree_util.tree_leaves(stats)} == {jnp.dtype(jnp.float32)}
  want = out['float32'][0][0]
  np.testing.assert_allclose(logits, want, rtol=0, atol=0.02 * np.abs(want).max())


@pytest.mark.parametrize('kernel,stride,padding,groups', [
    (7, 2, 3, 1), (3, 1, 1, 1), (1, 2, 0, 1), (3, 2, 1, 6), (5, 1, 0, 1)])
def test_im2col_convolution_equals_xla_and_its_gradients(kernel, stride, padding, groups):
  """Conv2d's two formulations (im2col on the CPU, XLA's elsewhere) compute the same function
  and gradients from the same parameters, strided, padded and depthwise (groups = channels)."""
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 11, 11, 6))
  layers = {impl: zoo.Conv2d(6 if groups > 1 else 5, kernel, stride, padding, groups,
                             use_bias=True, impl=impl) for impl in ('xla', 'im2col')}
  params = layers['xla'].init(jax.random.PRNGKey(1), x)
  outs = {impl: jax.value_and_grad(lambda p, x: jnp.sum(jnp.sin(m.apply(p, x))), argnums=(0, 1))(
      params, x) for impl, m in layers.items()}
  want_shape = layers['xla'].apply(params, x).shape
  assert layers['im2col'].apply(params, x).shape == want_shape
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5),
               outs['im2col'], outs['xla'])


def test_batch_norm_with_a_mask_equals_the_valid_rows_alone():
  """A partial batch's padding rows (mask False) count in no statistic: the valid rows'
  outputs and the running statistics are those of a batch of the valid rows alone."""
  x = jax.random.normal(jax.random.PRNGKey(0), (5, 3, 3, 4)) * 2 + 1
  padded = jnp.concatenate([x, 100 + jax.random.normal(jax.random.PRNGKey(1), (3, 3, 3, 4))])
  mask = jnp.arange(8) < 5
  bn = zoo.BatchNorm()
  variables = bn.init(jax.random.PRNGKey(2), x)
  alone, stats_alone = bn.apply(variables, x, True, mutable=['batch_stats'])
  masked, stats_masked = bn.apply(variables, padded, True, mask, mutable=['batch_stats'])
  np.testing.assert_allclose(masked[:5], alone, rtol=1e-5, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), stats_masked,
               stats_alone)
  # By hand: momentum 0.1 towards the 45 valid values' mean and unbiased variance.
  flat = np.asarray(x, np.float64).reshape(-1, 4)
  np.testing.assert_allclose(stats_masked['batch_stats']['mean'], 0.1 * flat.mean(0), rtol=1e-5)
  np.testing.assert_allclose(stats_masked['batch_stats']['var'],
                             0.9 + 0.1 * flat.var(0, ddof=1), rtol=1e-5)
