"""Data sets: TFDS loading, offline files and arrays, normalisation statistics.

Any TFDS image-classification data set with `image` and `label` features loads: its image shape
(grayscale included), class count and training-set size come from the builder's metadata
(`dataset_facts`), its images may be resized to N x N once, at load time (`image_size`), and
its normalisation statistics are computed from its training images, but for CIFAR-10 and
CIFAR-100, which keep the reference's constants (NORMALIZATION).

All images of a data set live in one uint8 array (TFDS 'train' then 'test'); clients refer to
them by index. Each client's train/val/test sets are fixed-shape, padded int32 index arrays
with per-client counts (`ClientData`), so a jitted, vmapped step gathers any client's batch
with one indexing op and no Python loop (docs/algorithm.md §2).
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import logging
import os

import numpy as np

from fedssa_jax import models
from fedssa_jax.errors import DataError, UnknownDatasetError

# Normalisation of the reference code (docs/algorithm.md §2): CIFAR-10 and CIFAR-100 keep these
# constants (the results depend on them); any other data set's mean and std are computed from
# its training images when it loads (channel_stats).
NORMALIZATION = {
    'cifar10': ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    'cifar100': ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
IMAGE_SHAPE = models.IMAGE_SHAPE  # CIFAR's (height, width, channels)
NUM_CLASSES = {'cifar10': 10, 'cifar100': 100}
TRAIN_IMAGES = {'cifar10': 50_000, 'cifar100': 50_000}
# HtFLlib's image data sets that TFDS carries (tfds.builder accepts each name offline; GTSRB,
# Country211 and Tiny-ImageNet are not in TFDS). Any other TFDS image-classification data set
# loads as well; these are the names the docs and error messages suggest.
HTFL_DATASETS = ('mnist', 'fashion_mnist', 'cifar10', 'cifar100', 'oxford_flowers102',
                 'caltech101')
SPLITS = ('train', 'val', 'test')


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A whole labelled data set in memory. `pools` maps pool name -> indices into images."""
  name: str
  images: np.ndarray  # [M, H, W, C] uint8 (32x32x3 on CIFAR; C = 1 for grayscale)
  labels: np.ndarray  # [M] int32
  num_classes: int
  mean: tuple[float, ...]  # per channel, in [0, 1] units
  std: tuple[float, ...]
  tfds_splits: dict[str, np.ndarray]  # 'train'/'test' -> indices into images

  @property
  def image_shape(self) -> tuple[int, ...]:
    """(height, width, channels) of the images: what the models are built for."""
    return tuple(int(d) for d in self.images.shape[1:])


@dataclasses.dataclass(frozen=True)
class DatasetFacts:
  """What is known of a data set before it loads (config_lib.validate's checks)."""
  num_classes: int
  image_shape: tuple  # (height, width, channels); None for a side that varies between images
  train_examples: int | None  # TFDS 'train' images; None where the metadata does not say


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

def _where(data_dir):
  return data_dir or '~/tensorflow_datasets'


def _prepare_hint(name, data_dir):
  if name != 'cifar10':
    return ''
  return (' Offline, build one from a local copy of cifar-10-python.tar.gz with: python '
          'launch/prepare_offline.py --source cifar-10-python.tar.gz --tfds_data_dir '
          f'{_where(data_dir)}')


def _missing_data_error(name, split, data_dir, why, download):
  """`why`: what went wrong (an exception, or a sentence)."""
  where = _where(data_dir)
  why = f'{type(why).__name__}: {str(why)[:200]}' if isinstance(why, Exception) else why
  if download:
    why = f'no prepared copy in {where}; downloading it failed: {why}'
  return DataError(
      f'TFDS data set {name!r} (split {split!r}) cannot be read from data_dir={where!r} ({why}). '
      f'Set --config.data_dir to a folder that holds a prepared {name!r}, or, with network '
      'access, set --config.download=True so that TFDS downloads and prepares it.'
      f'{_prepare_hint(name, data_dir)}')


def _root(builder) -> str:
  """The data_dir of a builder (its data_dir is <data_dir>/<name>/<version>)."""
  return os.path.dirname(os.path.dirname(os.path.normpath(builder.data_dir)))


def _damaged_data_error(builder, split, what):
  """The prepared files of `split` cannot be used: names them and how to prepare them again."""
  files = sorted(glob.glob(os.path.join(builder.data_dir, f'{builder.name}-{split}.*')))
  again = (_prepare_hint(builder.name, _root(builder)) or
           ' With network access, --config.download=True lets TFDS prepare it.')
  return DataError(
      f'The prepared {builder.name!r} in {builder.data_dir} is missing, truncated or corrupt: '
      f'{what}. Its {split!r} files: {", ".join(files) or "none"}. Delete {builder.data_dir} '
      f'and prepare it again.{again}')


def _builder(name, data_dir):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  try:
    return tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise UnknownDatasetError(
        f'Unknown dataset {name!r}: TFDS has no data set of that name. Set --config.dataset to '
        'a TFDS image-classification data set (with "image" and "label" features), e.g. '
        f'{", ".join(HTFL_DATASETS)}; python -c "import tensorflow_datasets as tfds; '
        'print(tfds.list_builders())" lists every TFDS name.') from None
  except Exception as e:  # pylint: disable=broad-except  (a corrupt dataset_info.json, ...)
    raise DataError(
        f'The TFDS metadata of {name!r} in data_dir={_where(data_dir)!r} cannot be read '
        f'({type(e).__name__}: {str(e)[:200]}). Delete that data set\'s folder there and '
        f'prepare it again.{_prepare_hint(name, data_dir)}') from e


def _check_prepared(builder, split) -> None:
  """DataErrors for a prepared data set without the split, or without images and labels."""
  splits = sorted(builder.info.splits.keys())
  if split not in splits:
    raise _damaged_data_error(builder, split, f'it has no {split!r} split (its splits: '
                              f'{", ".join(splits) or "none"})')
  _check_features(builder)


def _check_features(builder) -> None:
  """A DataError unless the builder's features hold an image and a class label."""
  features = builder.info.features
  missing = [f for f in ('image', 'label') if f not in features]
  what = (f'The prepared {builder.name!r} in {builder.data_dir}' if builder.is_prepared() else
          f'TFDS data set {builder.name!r}')
  if missing:
    raise DataError(
        f'{what} has no {" or ".join(missing)} feature (it has {", ".join(features.keys())}): '
        'the simulator needs labelled images. Choose an image-classification data set with '
        '"image" and "label" (--config.dataset), point --config.data_dir at one, or prepare it '
        f'again.{_prepare_hint(builder.name, _root(builder))}')
  shape = getattr(features['image'], 'shape', None)
  if not getattr(features['label'], 'num_classes', None) or shape is None or len(shape) != 3:
    raise DataError(
        f'{what} is no image-classification data set: its "image" feature is '
        f'{type(features["image"]).__name__} of shape {shape} and its "label" is '
        f'{type(features["label"]).__name__}, where the simulator needs [height, width, channels] '
        'images and a class label (ClassLabel). Choose another --config.dataset.')


@functools.lru_cache(maxsize=None)
def dataset_facts(name: str, data_dir: str | None = None) -> DatasetFacts:
  """The class count, image shape and training-set size of data set `name`, from its TFDS
  builder's metadata (the prepared copy's in `data_dir`, or the builder's code), without
  reading any image; CIFAR-10/100's from the tables here, without importing TFDS. Raises an
  UnknownDatasetError for a name TFDS does not know, a DataError for a data set without images
  and class labels."""
  if name in NUM_CLASSES:
    return DatasetFacts(NUM_CLASSES[name], IMAGE_SHAPE, TRAIN_IMAGES[name])
  builder = _builder(name, None if data_dir and data_dir.endswith('.npz') else data_dir)
  _check_features(builder)
  features = builder.info.features
  splits = builder.info.splits
  train = splits['train'].num_examples if 'train' in splits.keys() else None
  return DatasetFacts(int(features['label'].num_classes),
                      tuple(features['image'].shape), train or None)


def check_image_size(name: str, image_shape, image_size: int) -> None:
  """A DataError, naming --config.image_size, unless images of `image_shape` (None for a side
  that varies) resized to `image_size` (0: not resized) fit the CNNs."""
  smallest = models.MIN_IMAGE_SIZE
  fix = (f'Set --config.image_size=32 (or another size of at least {smallest}) to resize them '
         'to that square size at load time.')
  if image_size:
    if image_size < smallest:
      raise DataError(f'image_size={image_size} is too small: the CNNs (two 5x5 convolutions '
                      f'and 2x2 pools) need images of at least {smallest}x{smallest}. {fix}')
    return
  h, w = image_shape[:2]
  if h is None or w is None:
    raise DataError(f'The images of data set {name!r} have no fixed size (TFDS gives their '
                    f'shape as {tuple(image_shape)}), and the simulator holds them in one '
                    f'array. {fix}')
  if min(h, w) < smallest:
    raise DataError(f'The images of data set {name!r} are {h}x{w}: too small for the CNNs, '
                    f'which need at least {smallest}x{smallest}. {fix}')


def _read_split(name: str, split: str, data_dir: str | None, download: bool,
                image_size: int = 0):
  """Reads a whole split as (uint8 images, int32 labels), each image resized to `image_size`
  squared (0: as stored)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  builder = _builder(name, data_dir)
  if download and not builder.is_prepared():
    try:
      builder.download_and_prepare(file_format='array_record')
    except Exception as e:  # pylint: disable=broad-except
      raise _missing_data_error(name, split, data_dir, e, download) from e
  prepared = builder.is_prepared()  # (tfds.testing.mock_data reads without a prepared copy)
  if prepared:
    _check_prepared(builder, split)
  try:
    if prepared and 'TFRECORD' in str(builder.info.file_format).upper():
      # tfrecord data dirs (tfds.load's classic format) are read through tf.data: in one batch,
      # or example by example where images are resized or vary in size.
      fixed = None not in builder.info.features['image'].shape
      if fixed and not image_size:
        arrays = tfds.as_numpy(tfds.load(name, split=split, data_dir=data_dir, batch_size=-1,
                                         download=False))
        return arrays['image'].astype(np.uint8), arrays['label'].astype(np.int32)
      images, labels = [], []
      for r in tfds.as_numpy(tfds.load(name, split=split, data_dir=data_dir, download=False)):
        images.append(resize(r['image'], image_size) if image_size else r['image'])
        labels.append(r['label'])
      return np.stack(images).astype(np.uint8), np.asarray(labels, np.int32)
    return _read_records(tfds.data_source(name, split=split, data_dir=data_dir, download=False),
                         image_size)
  except Exception as e:  # pylint: disable=broad-except  (Riegeli, open(), tf.data errors)
    if not prepared:
      raise _missing_data_error(name, split, data_dir, 'no prepared copy there, and '
                                '--config.download=False', download=False) from e
    raise _damaged_data_error(builder, split, f'{type(e).__name__}: {str(e)[:120]}') from e


def _read_records(source, image_size: int = 0):
  """(images, labels) of a sequence of records (a TFDS data source, or a list), each image
  resized to `image_size` squared (0: as stored, which must be the same for all)."""
  n = len(source)
  first = np.shape(source[0]['image']) if n else IMAGE_SHAPE
  # Shaped like the stored images, so that check_fits_models can say what does not fit.
  shape = (image_size, image_size, first[-1]) if image_size else first
  images = np.empty((n, *shape), np.uint8)
  labels = np.empty((n,), np.int32)
  chunk = 2048
  for start in range(0, n, chunk):
    keys = list(range(start, min(n, start + chunk)))
    try:
      records = source.__getitems__(keys)
    except (TypeError, AttributeError):  # mock_data's source (and a list): one at a time.
      records = [source[i] for i in keys]
    for i, r in zip(keys, records):
      images[i] = resize(np.asarray(r['image']), image_size) if image_size else r['image']
      labels[i] = r['label']
  return images, labels


def resize(image: np.ndarray, size: int) -> np.ndarray:
  """A uint8 [H, W, C] image resized to [size, size, C] (an image of that size is returned as it
  is): PIL's bilinear filter, antialiased when shrinking (torchvision's Resize on PIL images),
  channel by channel, so any channel count works."""
  if image.shape[:2] == (size, size):
    return image
  from PIL import Image  # pylint: disable=g-import-not-at-top
  return np.stack([np.asarray(Image.fromarray(image[..., c]).resize((size, size),
                                                                   Image.Resampling.BILINEAR))
                   for c in range(image.shape[-1])], axis=-1)


def channel_stats(images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
  """Per-channel mean and standard deviation of uint8 [M, H, W, C] images in [0, 1] units (what
  normalisation subtracts and divides by), accumulated in float64 over chunks of images. A
  channel without spread gets std 1."""
  c = images.shape[-1]
  total, squares, count = np.zeros(c), np.zeros(c), 0
  for start in range(0, len(images), 4096):
    x = images[start:start + 4096].reshape(-1, c).astype(np.float64) / 255.0
    total += x.sum(axis=0)
    squares += np.square(x).sum(axis=0)
    count += len(x)
  mean = total / max(count, 1)
  std = np.sqrt(np.maximum(squares / max(count, 1) - np.square(mean), 0.0))
  std = np.where(std > 0, std, 1.0)
  return tuple(float(m) for m in mean), tuple(float(v) for v in std)


def load_dataset(name: str, data_dir: str | None = None, download: bool = False,
                 image_size: int = 0) -> Dataset:
  """Loads a TFDS image-classification data set ('train' and 'test') into memory.

  Any TFDS data set with `image` and `label` features: its class count comes from the
  builder's metadata. `image_size` N > 0 resizes every image to N x N as it is read (`resize`);
  0 keeps them as stored, which needs a fixed size. With `download`, a data set that is not
  prepared under `data_dir` is downloaded and prepared (array_record) first, as tfds.load
  would. A `data_dir` ending in `.npz` is read as plain arrays instead (x_train, y_train,
  x_test, y_test: what launch/prepare_offline.py --npz writes), which needs neither TFDS nor
  TensorFlow.
  """
  if data_dir and data_dir.endswith('.npz'):
    return load_npz(name, data_dir, image_size)
  facts = dataset_facts(name, data_dir)
  check_image_size(name, facts.image_shape, image_size)
  parts = [_read_split(name, split, data_dir, download, image_size)
           for split in ('train', 'test')]
  logging.info('Loaded %s: %d train + %d test images of %s, %d classes.', name,
               len(parts[0][1]), len(parts[1][1]), 'x'.join(map(str, parts[0][0].shape[1:])),
               facts.num_classes)
  return from_arrays(name, *parts[0], *parts[1], facts.num_classes)


def load_npz(name: str, path: str, image_size: int = 0) -> Dataset:
  """A data set from an .npz of uint8 images and integer labels (x_/y_ train and test), its
  images resized to `image_size` squared (0: as stored). The class count is CIFAR's for
  cifar10/cifar100, else one more than the largest label."""
  if not os.path.exists(path):
    raise DataError(f'{path} does not exist. Write it with python launch/prepare_offline.py '
                    f'--source cifar-10-python.tar.gz --npz {path}, or point data_dir at a TFDS '
                    'data_dir.')
  z = np.load(path)
  missing = {'x_train', 'y_train', 'x_test', 'y_test'} - set(z.files)
  if missing:
    raise DataError(f'{path} lacks the arrays {sorted(missing)}; it needs x_train, y_train, '
                    'x_test and y_test.')
  # Grayscale images may be stored without a channel axis: [M, H, W] -> [M, H, W, 1].
  x_train, x_test = (x[..., None] if x.ndim == 3 else x for x in (z['x_train'], z['x_test']))
  if image_size:
    check_image_size(name, (None, None), image_size)
    x_train, x_test = (np.stack([resize(i, image_size) for i in x]) if len(x) else
                       np.zeros((0, image_size, image_size, x.shape[-1]), np.uint8)
                       for x in (x_train, x_test))
  num_classes = NUM_CLASSES.get(name) or int(max(z['y_train'].max(initial=0),
                                                 z['y_test'].max(initial=0))) + 1
  return from_arrays(name, x_train, z['y_train'], x_test, z['y_test'], num_classes)


def from_arrays(name: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray,
                y_test: np.ndarray, num_classes: int) -> Dataset:
  """A Dataset from in-memory uint8 images ([M, H, W, C], or [M, H, W] grayscale) and integer
  labels, normalised with CIFAR's constants for cifar10/cifar100 (NORMALIZATION) and with the
  per-channel statistics of `x_train` (channel_stats) for any other `name`."""
  x_train, x_test = (x[..., None] if x.ndim == 3 else x for x in (x_train, x_test))
  images = np.concatenate([x_train, x_test]).astype(np.uint8)
  labels = np.concatenate([y_train, y_test]).astype(np.int32)
  n = len(y_train)
  if len(labels) and not 0 <= labels.min() <= labels.max() < num_classes:
    raise DataError(f'The labels of data set {name!r} run from {labels.min()} to '
                    f'{labels.max()}, outside the {num_classes} classes 0..{num_classes - 1} '
                    'its metadata gives. Prepare the data set again.')
  mean, std = NORMALIZATION[name] if name in NORMALIZATION else channel_stats(x_train)
  ds = Dataset(name, images, labels, num_classes, mean, std,
               {'train': np.arange(n), 'test': np.arange(n, len(labels))})
  check_fits_models(ds)
  return ds


def check_fits_models(ds: Dataset) -> None:
  """Raises a DataError unless the images are what the models take: [height, width, channels]
  of at least models.MIN_IMAGE_SIZE a side, any channel count."""
  shape = tuple(ds.images.shape[1:])
  smallest = models.MIN_IMAGE_SIZE
  if len(shape) == 3 and min(shape[:2]) >= smallest and shape[2] >= 1:
    return
  if len(shape) == 3:
    problem = (f'{shape[0]}x{shape[1]} pixels; the CNNs (two 5x5 convolutions and 2x2 pools) '
               f'need at least {smallest}x{smallest}')
  else:
    problem = f'shape {shape}; the models take (height, width, channels) images'
  raise DataError(
      f'The images of data set {ds.name!r} have {problem}. Set --config.image_size=32 (or '
      f'another size of at least {smallest}) to resize them at load time, or convert the '
      'images before building the Dataset.')


def synthetic_cifar(num_classes: int = 10, num_train: int = 50_000,
                    num_test: int = 10_000) -> Dataset:
  """Random uint8 images with CIFAR's shapes and class balance: the same work per round as the
  real data set, for timing where it is not at hand."""
  rng = np.random.default_rng(0)
  x = rng.integers(0, 256, (num_train + num_test, *IMAGE_SHAPE), dtype=np.uint8)
  y_train, y_test = np.arange(num_train) % num_classes, np.arange(num_test) % num_classes
  name = 'cifar10' if num_classes == 10 else 'cifar100'
  return from_arrays(name, x[:num_train], y_train, x[num_train:], y_test, num_classes)
