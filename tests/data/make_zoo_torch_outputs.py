"""Makes tests/data/zoo_torch_outputs.npz and prints the counts tests/zoo_test.py holds, from
HtFLlib's own PyTorch models (not run by the suite: it needs PyTorch and a checkout of HtFLlib).

    python -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch==2.14.1 \\
        torchvision==0.29.1
    git clone https://github.com/TsingZ0/HtFLlib /tmp/HtFLlib   # e959261 was used
    /tmp/torchvenv/bin/python tests/data/make_zoo_torch_outputs.py --htfllib=/tmp/HtFLlib

Each family is built as HtFLlib builds a client's model: `BaseHeadSplit(args, cid)` of
`system/flcore/trainmodel/models.py` on its `system/main.py` string (MODELS below, verbatim),
which swaps the classifier for AdaptiveAvgPool1d(512) and adds the Linear(512, 10) head. For
each it prints the parameters and batch-norm running statistics (running_mean and running_var,
not num_batches_tracked) per module (`group_key`) and a fingerprint of every state_dict name and
shape, then loads the deterministic `det_value` weights, converts the model to float64 and
records, for the input `det_uniform(INPUTS[mode], 'input')` (NCHW, 2 images):
- `eval`: the representation (`model.base(x)`) and logits (`model.head(rep)`) in eval mode, on
  32x32 images;
- `train`: the same in train mode (one forward of a fresh model, dropout set to p=0) on 64x64
  images (FedAvgCNN with dim=10816, main.py's line for 64x64), and each batch norm's running
  mean and variance after it, summed per layer (layers in sorted name order).
A training-mode forward of a deep ResNet on two 32x32 images is ill-conditioned (its last batch
norms see 2 values a channel): PyTorch's own float32 and float64 logits differ by 70% on
ResNet-50, and even in float64 a 1e-13 change of the input moves them by 6e-7. At 64x64 they see
8, and ResNet-152's float32 and float64 logits differ by 1e-3. Everything is computed in float64;
the outputs are stored as float32 (what the Flax models return), the sums as float64.

The functions above `main` are imported by tests/zoo_test.py, so both sides make the same
weights; they need only numpy.
"""
import hashlib
import math
import sys
import zlib

import numpy as np

MODELS = {  # system/main.py's strings, verbatim (HtFE-img-2/3/5/8/9)
    'fedavgcnn': 'FedAvgCNN(in_features=3, num_classes=args.num_classes, dim=1600)',
    'resnet4': 'resnet4(num_classes=args.num_classes)',
    'resnet6': 'resnet6(num_classes=args.num_classes)',
    'resnet8': 'resnet8(num_classes=args.num_classes)',
    'resnet10': 'resnet10(num_classes=args.num_classes)',
    'resnet18': 'torchvision.models.resnet18(pretrained=False, num_classes=args.num_classes)',
    'resnet34': 'torchvision.models.resnet34(pretrained=False, num_classes=args.num_classes)',
    'resnet50': 'torchvision.models.resnet50(pretrained=False, num_classes=args.num_classes)',
    'resnet101': 'torchvision.models.resnet101(pretrained=False, num_classes=args.num_classes)',
    'resnet152': 'torchvision.models.resnet152(pretrained=False, num_classes=args.num_classes)',
    'mobilenetv2': 'mobilenet_v2(pretrained=False, num_classes=args.num_classes)',
    'googlenet': ('torchvision.models.googlenet(pretrained=False, aux_logits=False, '
                  'num_classes=args.num_classes)'),
}
NUM_CLASSES, FEATURE_DIM = 10, 512
# The inputs (NCHW): eval mode at CIFAR's 32x32; train mode at 64x64, where the deep ResNets'
# last batch norms see 8 values a channel, not 2 (the module docstring).
INPUTS = {'eval': (2, 3, 32, 32), 'train': (2, 3, 64, 64)}


def det_uniform(shape, name: str) -> np.ndarray:
  """Float64 values in [-1, 1) from a 32-bit integer hash of (position, crc32(name)): the same
  on every machine and numpy version."""
  n = math.prod(shape)
  with np.errstate(over='ignore'):  # uint32 arithmetic wraps modulo 2**32, as meant
    h = np.arange(n, dtype=np.uint32) * np.uint32(0x9E3779B1)
    h += np.uint32((zlib.crc32(name.encode()) * 0x85EBCA77 + 1) & 0xFFFFFFFF)
    h ^= h >> np.uint32(15)
    h *= np.uint32(0x2C1B3C6D)
    h ^= h >> np.uint32(12)
    h *= np.uint32(0x297A2D39)
    h ^= h >> np.uint32(15)
  return (h / 2**32 * 2 - 1).reshape(shape)


def det_value(name: str, shape) -> np.ndarray:
  """The deterministic value of state_dict entry `name` (PyTorch layout): weights of He scale
  (variance 2 / fan_in), norm scales 1 +- 0.1, biases and running means +-0.1, running
  variances 1 +- 0.2."""
  u = det_uniform(shape, name)
  leaf = name.rsplit('.', 1)[1]
  if leaf == 'weight' and len(shape) >= 2:
    return u * math.sqrt(6 / math.prod(shape[1:]))
  if leaf == 'weight':
    return 1 + 0.1 * u
  if leaf == 'running_var':
    return 1 + 0.2 * u
  return 0.1 * u


def group_key(name: str) -> str:
  """The module a state_dict entry is counted under: `head`, or the first two levels of the
  base model's module path (`layer1.0`, `features.3`, `inception4a.branch2`, `conv1`)."""
  parts = name.rsplit('.', 1)[0].split('.')
  return 'head' if parts[0] == 'head' else '.'.join(parts[1:3])


def fingerprint(names_and_shapes) -> str:
  """sha256 (16 hex digits) of the sorted 'name:shape' lines."""
  lines = sorted(f'{name}:{tuple(shape)}' for name, shape in names_and_shapes)
  return hashlib.sha256('\n'.join(lines).encode()).hexdigest()[:16]


def main(argv):
  import argparse  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import warnings  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser()
  parser.add_argument('--htfllib', required=True, help='a checkout of TsingZ0/HtFLlib')
  parser.add_argument('--out', default=os.path.join(os.path.dirname(__file__),
                                                    'zoo_torch_outputs.npz'))
  flags = parser.parse_args(argv)
  sys.path.insert(0, os.path.join(flags.htfllib, 'system'))
  warnings.simplefilter('ignore')
  import torch  # pylint: disable=g-import-not-at-top
  from flcore.trainmodel.models import BaseHeadSplit  # pylint: disable=g-import-not-at-top

  class Args:
    num_classes, feature_dim = NUM_CLASSES, FEATURE_DIM

  def build(spec):
    args = Args()
    args.models = [spec]
    model = BaseHeadSplit(args, 0)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith('num_batches_tracked')}
    model = model.double()
    model.load_state_dict({k: torch.tensor(det_value(k, tuple(v.shape))) for k, v in
                           state.items()}, strict=False)
    for m in model.modules():
      if isinstance(m, torch.nn.Dropout):
        m.p = 0.0
    return model, state

  arrays = {}
  for family, spec in MODELS.items():
    model, state = build(spec)
    params = {k for k, _ in model.named_parameters()}
    counts = {}
    for k, v in state.items():
      counts.setdefault(group_key(k), [0, 0])[0 if k in params else 1] += v.numel()
    print(f"'{family}': {fingerprint((k, v.shape) for k, v in state.items())!r},")
    print(f"'{family}': {{{', '.join(f'{k!r}: ({a}, {b})' for k, (a, b) in counts.items())}}},")
    with torch.no_grad():
      for mode in ('eval', 'train'):
        if mode == 'train':  # a fresh model, as HtFLlib's comment has it for 64x64 images
          model, _ = build(spec.replace('dim=1600', 'dim=10816'))
        model.train(mode == 'train')
        rep = model.base(torch.tensor(det_uniform(INPUTS[mode], 'input')))
        arrays[f'{family}/{mode}_rep'] = rep.numpy().astype(np.float32)
        arrays[f'{family}/{mode}_logits'] = model.head(rep).numpy().astype(np.float32)
      after = model.state_dict()
      bns = sorted(k[:-len('.running_mean')] for k in after if k.endswith('running_mean'))
      for stat in ('mean', 'var'):
        arrays[f'{family}/train_{stat}_sums'] = np.array(
            [after[f'{k}.running_{stat}'].sum().item() for k in bns], np.float64)
  np.savez_compressed(flags.out, **arrays)


if __name__ == '__main__':
  main(sys.argv[1:])
