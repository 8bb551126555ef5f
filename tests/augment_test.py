"""Training augmentation (fedssa_jax.data.augment): normalisation against hand-computed values, and
each augmented image taken apart again into its flip, erased box and crop offset, which must be
those of docs/algorithm.md §2: flip p = 0.5, erasing p = 0.5 of one box of 4% to 20% of the
image with aspect ratio in [0.5, 2], a crop of the image zero-padded by 4."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedssa_jax import data
from fedssa_jax.data import augment

H = W = 32
N = 512  # images in the batch that is taken apart
augment_batch = jax.jit(augment.augment_batch)  # as training calls it: one program, not op by op


def test_normalize_equals_hand_computed_values():
  mean, std = data.NORMALIZATION['cifar10']
  pixels = np.array([[[[0, 0, 0], [255, 255, 255]], [[51, 102, 204], [128, 64, 32]]]], np.uint8)
  got = np.asarray(augment.normalize(jnp.asarray(pixels), mean, std))
  assert got.dtype == np.float32 and got.shape == pixels.shape
  want = [[[-0.485 / 0.229, -0.456 / 0.224, -0.406 / 0.225],
           [0.515 / 0.229, 0.544 / 0.224, 0.594 / 0.225]],
          [[(0.2 - 0.485) / 0.229, (0.4 - 0.456) / 0.224, (0.8 - 0.406) / 0.225],
           [(128 / 255 - 0.485) / 0.229, (64 / 255 - 0.456) / 0.224,
            (32 / 255 - 0.406) / 0.225]]]
  np.testing.assert_allclose(got[0], want, rtol=1e-6, atol=1e-6)
  # The erased value and the crop's padding, 0, is the data set's mean colour.
  mean_u8 = np.round(np.array(mean) * 255).astype(np.uint8)
  np.testing.assert_allclose(augment.normalize(mean_u8, mean, std), 0, atol=0.5 / 255 / 0.22)


def coded_image():
  """An image whose every value is positive and tells its row, column and channel."""
  rows, cols, chans = np.meshgrid(np.arange(H), np.arange(W), np.arange(3), indexing='ij')
  return (1 + 3 * (rows * W + cols) + chans).astype(np.float32)


def take_apart(y, x):
  """(flipped, (row offset, column offset), erased mask) of the augmented image y of x, checked
  to be exactly that flip, erasing and crop of x."""
  assert (y == 0).all(-1).sum() == (y == 0).any(-1).sum()  # a pixel is erased in all channels
  rr, cc = np.nonzero(y[..., 0])
  code = (y[rr, cc, 0].astype(np.int64) - 1) // 3
  i, j = code // W, code % W
  assert len(set(i - rr)) == 1, 'the rows moved by one offset'
  flipped = len(set(j - cc)) > 1
  assert len(set(j + cc if flipped else j - cc)) == 1, 'the columns moved by one offset'
  off = (i[0] - rr[0] + augment.PAD,
         (W - 1 - j[0] - cc[0] if flipped else j[0] - cc[0]) + augment.PAD)
  padded = np.pad(x[:, ::-1] if flipped else x, ((augment.PAD,) * 2, (augment.PAD,) * 2, (0, 0)))
  crop = padded[off[0]:off[0] + H, off[1]:off[1] + W]
  erased = (y == 0).all(-1) & (crop != 0).all(-1)
  np.testing.assert_array_equal(y, np.where(erased[..., None], 0.0, crop))
  return flipped, off, erased


@pytest.fixture(scope='module')
def parts():
  x = coded_image()
  y = np.asarray(augment_batch(jax.random.PRNGKey(0), jnp.broadcast_to(x, (N, H, W, 3))))
  return x, y, [take_apart(y[b], x) for b in range(N)]


def test_each_image_is_a_flip_an_erased_box_and_a_crop(parts):
  x, y, taken = parts
  assert y.shape == (N, H, W, 3) and y.dtype == np.float32
  flips = np.mean([f for f, _, _ in taken])
  offsets = np.array([o for _, o, _ in taken])
  erased = np.array([e.any() for _, _, e in taken])
  assert 0.4 < flips < 0.6 and 0.4 < erased.mean() < 0.6  # p = 0.5 each
  for axis in (0, 1):  # every offset of 0..8 (a shift of -4..4), each about 1/9 of the time
    counts = np.bincount(offsets[:, axis], minlength=2 * augment.PAD + 1)
    assert len(counts) == 2 * augment.PAD + 1 and counts.min() > N / 9 / 2
  # One key per image: the images of the batch are augmented differently.
  assert len({(f, o) for f, o, _ in taken}) > 40


def test_the_erased_pixels_are_one_box_of_the_spec_size(parts):
  _, _, taken = parts
  whole = []
  for _, (oi, oj), e in taken:
    if not e.any():
      continue
    rows, cols = np.flatnonzero(e.any(1)), np.flatnonzero(e.any(0))
    r0, r1, c0, c1 = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
    assert e[r0:r1, c0:c1].all() and e.sum() == (r1 - r0) * (c1 - c0), 'a rectangle'
    assert r1 - r0 <= 20 and c1 - c0 <= 20  # the largest box, sqrt(0.2 * 1024 * 2) rounded
    # The image's rows and columns in view (the rest of the crop is padding).
    v0, v1 = max(0, augment.PAD - oi), min(H, H + augment.PAD - oi)
    w0, w1 = max(0, augment.PAD - oj), min(W, W + augment.PAD - oj)
    if v0 < r0 and r1 < v1 and w0 < c0 and c1 < w1:  # the whole box is in view
      whole.append((r1 - r0, c1 - c0))
  assert len(whole) > 50
  h, w = np.array(whole).T
  # eh, ew = round(sqrt(area * aspect)), round(sqrt(area / aspect)), area in [0.04, 0.2] * 1024,
  # aspect in [0.5, 2]: sides from round(sqrt(40.96 / 2)) = 5, areas and ratios within rounding.
  assert h.min() >= 5 and w.min() >= 5
  assert (0.04 * H * W - 0.5 * (h + w) - 0.25 <= h * w).all()
  assert (h * w <= 0.2 * H * W + 0.5 * (h + w) + 0.75).all()
  assert (h <= 2 * w + 1.5).all() and (w <= 2 * h + 1.5).all()
  # The area is uniform in [0.04, 0.2]: its mean is about 0.12 of the image.
  assert 0.10 < (h * w).mean() / (H * W) < 0.14


def test_augmentation_shapes_and_invariants():
  x = jax.random.normal(jax.random.PRNGKey(0), (64, 32, 32, 3))
  y = augment_batch(jax.random.PRNGKey(1), x)
  assert y.shape == x.shape
  y = np.asarray(y)
  # Zeros appear (erasing / crop padding) in some images, and some images are untouched flips.
  zero_frac = (y == 0).all(axis=-1).mean(axis=(1, 2))
  assert (zero_frac > 0).mean() > 0.5
  assert (zero_frac <= 0.2 + 2 * 8 * 32 / 1024 + 1e-6).all()
  # Deterministic for a key, and another key gives other images.
  np.testing.assert_array_equal(y, augment_batch(jax.random.PRNGKey(1), x))
  assert not np.array_equal(y, augment_batch(jax.random.PRNGKey(2), x))
