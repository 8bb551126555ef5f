#!/usr/bin/env python3
"""Builds a TFDS `cifar10` data_dir from a local copy of CIFAR-10, for machines without network.

Only needed offline: with network, `--config.download=True` (or `launch/quickstart.sh`) lets
TFDS fetch and prepare CIFAR-10 itself. Here the source is the CIFAR-10 "python version", as
published at https://www.cs.toronto.edu/~kriz/cifar.html, copied to this machine by hand:
either the archive `cifar-10-python.tar.gz` or the folder `cifar-10-batches-py` it unpacks to.

    python launch/prepare_offline.py --source cifar-10-python.tar.gz \
        --tfds_data_dir ~/tensorflow_datasets [--file_format array_record|tfrecord]
    python launch/prepare_offline.py --source cifar-10-batches-py --npz cifar10.npz

The TFDS output is the registered `cifar10` builder (version, features, label names and example
ids as a download gives), only fed from the local files, so `tfds.load('cifar10', data_dir=DIR)`
and `tfds.data_source('cifar10', data_dir=DIR)` read it as they read a downloaded copy, and so
does `--config.data_dir=DIR`. `--npz` writes plain arrays (x_train, y_train, x_test, y_test,
class_names) that `--config.data_dir=FILE.npz` reads without TFDS. Needs numpy; the TFDS output
also needs tensorflow(-cpu) and tensorflow-datasets (both in requirements.txt).
"""
import argparse
import os
import pickle
import tarfile

import numpy as np

TRAIN_BATCHES = tuple(f'data_batch_{i}' for i in range(1, 6))
TEST_BATCH = 'test_batch'
META = 'batches.meta'


class BatchReader:
  """Reads the pickled batches of the python version from its archive or its folder."""

  def __init__(self, source: str):
    self.source = os.path.expanduser(source)
    self.tar = None
    if os.path.isdir(self.source):
      return
    if not os.path.isfile(self.source):
      raise SystemExit(f'{source} does not exist: give the cifar-10-python.tar.gz archive or '
                       'the cifar-10-batches-py folder.')
    self.tar = tarfile.open(self.source, 'r:*')
    self.members = {os.path.basename(m.name): m for m in self.tar.getmembers() if m.isfile()}

  def load(self, name: str) -> dict:
    if self.tar is None:
      path = os.path.join(self.source, name)
      if not os.path.isfile(path):
        raise SystemExit(f'{path} is missing: {self.source} is not a whole cifar-10-batches-py.')
      with open(path, 'rb') as f:
        raw = f.read()
    else:
      if name not in self.members:
        raise SystemExit(f'{self.source} has no {name}: is it cifar-10-python.tar.gz?')
      raw = self.tar.extractfile(self.members[name]).read()
    # The batches were pickled by Python 2: their keys and strings come back as bytes.
    d = pickle.loads(raw, encoding='bytes')
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in d.items()}


def images_and_labels(batch: dict) -> tuple[np.ndarray, np.ndarray]:
  """A batch's rows of 3072 bytes (the red plane, then green, then blue, each 32x32 row-major)
  as [n, 32, 32, 3] uint8 images, and its labels as int64."""
  rows = np.asarray(batch['data'], np.uint8)
  images = rows.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
  return np.ascontiguousarray(images), np.asarray(batch['labels'], np.int64)


def read_cifar10(source: str) -> dict:
  reader = BatchReader(source)
  train = [images_and_labels(reader.load(name)) for name in TRAIN_BATCHES]
  x_test, y_test = images_and_labels(reader.load(TEST_BATCH))
  names = [n.decode() if isinstance(n, bytes) else n for n in reader.load(META)['label_names']]
  arrays = {'x_train': np.concatenate([x for x, _ in train]),
            'y_train': np.concatenate([y for _, y in train]),
            'x_test': x_test, 'y_test': y_test, 'class_names': np.array(names)}
  if len(arrays['y_train']) != 50_000 or len(y_test) != 10_000 or len(names) != 10:
    raise SystemExit(f'{source}: expected 50,000 training and 10,000 test images of 10 classes, '
                     f'found {len(arrays["y_train"]):,}, {len(y_test):,} and {len(names)}.')
  return arrays


def write_tfds(arrays: dict, data_dir: str, file_format: str) -> str:
  """Prepares TFDS's own `cifar10` builder under data_dir from `arrays`. Returns its folder."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from tensorflow_datasets.image_classification import cifar  # pylint: disable=g-import-not-at-top

  class LocalCifar10(cifar.Cifar10, skip_registration=True):
    """The registered builder with its download replaced by the arrays above."""
    name = 'cifar10'

    def _split_generators(self, dl_manager):
      del dl_manager
      self.info.features['label'].names = [str(n) for n in arrays['class_names']]
      return {'train': self._examples('train'), 'test': self._examples('test')}

    def _examples(self, split):
      # The keys and ids of the TFDS download: the running index within the split.
      for i, (image, label) in enumerate(zip(arrays[f'x_{split}'], arrays[f'y_{split}'])):
        yield i, {'id': f'{split}_{i:05d}', 'image': image, 'label': int(label)}

  builder = LocalCifar10(data_dir=os.path.expanduser(data_dir), file_format=file_format)
  builder.download_and_prepare(
      download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  return str(builder.data_dir)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--source', required=True,
                      help='cifar-10-python.tar.gz, or the cifar-10-batches-py folder')
  parser.add_argument('--tfds_data_dir', help='prepare TFDS cifar10 under this folder')
  parser.add_argument('--file_format', default='array_record',
                      choices=['array_record', 'tfrecord'], help='TFDS file format')
  parser.add_argument('--npz', help='also (or instead) write plain arrays to this .npz file')
  args = parser.parse_args()
  if not (args.tfds_data_dir or args.npz):
    parser.error('give --tfds_data_dir, --npz or both')
  arrays = read_cifar10(args.source)
  print(f'Read {len(arrays["y_train"]):,} training and {len(arrays["y_test"]):,} test images '
        f'from {args.source}.')
  if args.npz:
    np.savez(os.path.expanduser(args.npz), **arrays)
    print(f'Wrote {args.npz}.')
  if args.tfds_data_dir:
    where = write_tfds(arrays, args.tfds_data_dir, args.file_format)
    print(f'Prepared TFDS cifar10 in {where}; run with --config.data_dir={args.tfds_data_dir}.')


if __name__ == '__main__':
  main()
