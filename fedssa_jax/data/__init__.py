"""Data: data sets, their partition over clients, and augmentation.

Above `models` (whose input shapes it checks) and below the methods. `datasets` loads any TFDS
image data set (or arrays, or an offline file) into one uint8 array; `partition` deals its
images out to the clients as padded index sets (`ClientData`, and `DeviceData` on the device);
`augment` normalises and augments a batch inside the jitted step. The names below are the
layer's interface (`data.load_dataset`, `data.partition_from_config`, ...).
"""
from fedssa_jax.data import augment
from fedssa_jax.data.datasets import (HTFL_DATASETS, IMAGE_SHAPE, NORMALIZATION, NUM_CLASSES,
                                      SPLITS, TRAIN_IMAGES, Dataset, DatasetFacts,
                                      channel_stats, check_fits_models, check_image_size,
                                      dataset_facts, from_arrays, load_dataset, load_npz, resize,
                                      synthetic_cifar)
from fedssa_jax.data.partition import (ClientData, DeviceData, dirichlet_shares, fingerprint,
                                       make_pools, partition, partition_from_config,
                                       pathological_shares, split_by_shares)
from fedssa_jax.errors import DataError, UnknownDatasetError
