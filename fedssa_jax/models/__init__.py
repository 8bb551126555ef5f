"""Models: every client's model family and the parts methods take from models.

The lowest layer of the package above `errors`: it imports nothing else of it. `cnn` holds the
five CNNs of FedSSA, `zoo` HtFLlib's image families, `build` makes any of them by name;
`layers` the building blocks they share, `header` the header table the methods exchange, and
`model_state` the batch statistics some families keep beside their parameters. The names below
are the layer's interface (`models.make_model`, `models.header_rows`, ...).
"""
from fedssa_jax.models import zoo
from fedssa_jax.models.build import (all_family_names, feature_dim, init_params, make_model,
                                     param_count)
from fedssa_jax.models.cnn import (CNN, CNN_FEATURE_DIM, CONV_IMPLS, FAMILIES, FAMILY_NAMES,
                                   KERNEL, MIN_IMAGE_SIZE, Conv5x5, Family, band_tile,
                                   banded_conv, conv1_macs, feature_sizes, forward_macs,
                                   get_family, max_pool_2x2, resolve_conv_impl)
from fedssa_jax.models.header import apply_header, header_rows, init_header, with_header_rows
from fedssa_jax.models.layers import (COMPUTE_DTYPES, IMAGE_SHAPE, Dense, cast, feature_pool,
                                      torch_uniform_init)
from fedssa_jax.models.model_state import MODEL_STATE, StatefulModel, join_state, split_state
