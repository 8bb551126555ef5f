"""The `privacy` config section: its fields and defaults, whether each mechanism is on, and the
checks that refuse, before any data is loaded, a section or a method or model it cannot apply to
(docs/configuration.md, "Differential privacy")."""
from __future__ import annotations

from typing import Callable

import ml_collections

from fedssa_jax.errors import ConfigError, require, require_one_of

ACCOUNTANTS = ('rdp', 'pld')  # privacy.accountant
PER_EXAMPLE = ('auto', 'vmap')  # privacy.per_example
UPLOAD_MODES = ('local', 'central')  # privacy.upload_mode


def default_config() -> ml_collections.ConfigDict:
  p = ml_collections.ConfigDict()
  p.dp_sgd = False            # DP-SGD in local training: Poisson batches, per-example clipping,
                              # Gaussian noise (docs/configuration.md, "Differential privacy")
  p.clip_norm = 1.0           # C: each example's gradient clipped to this global norm
  p.noise_multiplier = 1.0    # sigma: noise of std sigma C on the clipped sum; 0 with
                              # target_epsilon: calibrated to reach it at num_rounds
  p.delta = 1e-5              # the delta of every epsilon reported
  p.target_epsilon = 0.0      # > 0: the budget (calibrates sigma, or ends the run before a
                              # round that could exceed it)
  p.accountant = 'rdp'        # dp_accounting's 'rdp' or 'pld' accountant
  p.max_batch = 0             # rows a Poisson batch may hold (0: automatic, exceeded with
                              # probability < 1e-12 a step)
  p.per_example = 'auto'      # how each example's gradient norm is found: 'auto', from the
                              # layers' inputs and output cotangents where they cover every
                              # trainable parameter (ghost norms), else 'vmap'; 'vmap': each
                              # example's gradient built (speed and memory, not the numbers)
  p.pass_size = 0             # examples whose gradients 'vmap' builds at once (speed and
                              # memory, not the numbers): 0, automatic (pass_size_for)
  p.release_clip = 10.0      # C_r: under dp_sgd, the L2 norm each example's row of a method's
                              # private release (its class sums and count) is clipped to, or
                              # a whole release (FedL2G's meta gradient)
  p.release_noise_multiplier = 0.0  # z_r: the releases' noise std z_r C_r (sensitivity 1 for
                                    # the class counts a server reads); 0: noise_multiplier's
                                    # sigma (given or calibrated with the releases)
  p.upload = False            # client-level DP: each client's upload clipped and noised
                              # (docs/configuration.md, "Differential privacy")
  p.upload_mode = 'local'     # 'local': each client noises its own upload; 'central': the
                              # server noises the sum of the clipped uploads
  p.upload_clip = 1.0         # C_u: the global norm each upload (less what the server already
                              # knows: the downloaded global model) is clipped to
  p.upload_noise_multiplier = 1.0  # z: noise std z C_u; 0 with upload_target_epsilon:
                                   # calibrated to reach it at num_rounds
  p.upload_target_epsilon = 0.0    # > 0 with upload_noise_multiplier 0: calibrates z
  return p


def enabled(p: ml_collections.ConfigDict) -> bool:
  """Whether DP-SGD is on."""
  return bool(p.dp_sgd)


def upload_enabled(p: ml_collections.ConfigDict) -> bool:
  """Whether client-level DP on the uploads is on."""
  return bool(p.upload)


def check_config(p: ml_collections.ConfigDict, method: str, per_sample_loss: bool,
                 upload_refusal: Callable[[str], str | None] = lambda mode: None,
                 dp_sgd_refusal: Callable[[], str | None] = lambda: None) -> None:
  """Every field of the section, before any data is loaded. `upload_refusal(mode)`: the
  method's Method.upload_refusal(config, mode); `dp_sgd_refusal()`: its
  Method.dp_sgd_refusal(config)."""
  check_upload(p, method, upload_refusal)
  _check_gaussian(p, 'clip_norm', "it bounds each example's gradient norm (1.0 is usual)",
                  'noise_multiplier', 'the noise std is noise_multiplier x clip_norm (1.1 is '
                  'usual; 0 with privacy.target_epsilon calibrates it)', 'target_epsilon')
  require(0 < p.delta < 1, f'privacy.delta must be in (0, 1), got {p.delta}; use less than '
          '1 / (training samples), e.g. 1e-5.')
  require_one_of('privacy.accountant', p.accountant, ACCOUNTANTS)
  require(p.max_batch >= 0, f'privacy.max_batch must be >= 0 (0: automatic), got {p.max_batch}.')
  require(p.pass_size >= 0, f'privacy.pass_size must be >= 1, or 0 (automatic); got '
          f'{p.pass_size}.')
  require_one_of('privacy.per_example', p.per_example, PER_EXAMPLE)
  _check_gaussian(p, 'release_clip', "it bounds each example's row of a private release (a "
                  'class mean of logits or representations, with its count)',
                  'release_noise_multiplier', "the releases' noise std is "
                  "release_noise_multiplier x release_clip (0: noise_multiplier's)",
                  'target_epsilon')
  if not p.dp_sgd:
    return
  refusal = dp_sgd_refusal()
  if refusal is not None:
    raise ConfigError(f'privacy.dp_sgd does not apply to {method}: {refusal}. Choose another '
                      'method, or turn privacy.dp_sgd off.')
  _require_noise(p, 'noise_multiplier', 'target_epsilon', ' (1.1 is usual)')
  require(per_sample_loss,
          f'privacy.dp_sgd needs a loss that is a mean of per-example terms, to clip each '
          f"example's gradient; {method}'s couples the samples of a batch (FedKD: 1/Q with Q the "
          "batch's mean CE; FedClassAvg: contrastive pairs). Choose another method, or turn "
          'privacy.dp_sgd off.')


def check_upload(p: ml_collections.ConfigDict, method: str,
                 refusal_of: Callable[[str], str | None]) -> None:
  """The upload fields; with `upload` on, that the method can take it in the mode asked
  (`refusal_of(mode)` says why not, or None)."""
  require_one_of('privacy.upload_mode', p.upload_mode, UPLOAD_MODES)
  _check_gaussian(p, 'upload_clip', "it bounds each client's upload norm (less the global "
                  'model it downloaded)', 'upload_noise_multiplier', 'the noise std is '
                  'upload_noise_multiplier x upload_clip (0 with privacy.upload_target_epsilon '
                  'calibrates it)', 'upload_target_epsilon')
  if not p.upload:
    return
  _require_noise(p, 'upload_noise_multiplier', 'upload_target_epsilon')
  require(not (p.upload_noise_multiplier > 0 and p.upload_target_epsilon > 0),
          'privacy.upload_target_epsilon calibrates the noise: set '
          'privacy.upload_noise_multiplier=0 with it, or drop the target.')
  refusal = refusal_of(p.upload_mode)
  if refusal is not None:
    other = [m for m in UPLOAD_MODES if m != p.upload_mode and refusal_of(m) is None]
    fix = (f"Use privacy.upload_mode='{other[0]}', or turn privacy.upload off."
           if other else 'Turn privacy.upload off.')
    raise ConfigError(f'privacy.upload ({p.upload_mode}) does not apply to {method}: its '
                      f'{refusal}. {fix}')


def _check_gaussian(p: ml_collections.ConfigDict, clip: str, clip_says: str, sigma: str,
                    sigma_says: str, target: str) -> None:
  """A Gaussian mechanism's fields of the section: its clip norm > 0, its noise multiplier and
  its target epsilon >= 0 (each named by its field, with what it does)."""
  require(p[clip] > 0, f'privacy.{clip} must be > 0, got {p[clip]}: {clip_says}.')
  require(p[sigma] >= 0, f'privacy.{sigma} must be >= 0, got {p[sigma]}: {sigma_says}.')
  require(p[target] >= 0, f'privacy.{target} must be > 0, or 0 for no budget; got '
          f'{p[target]}.')


def _require_noise(p: ml_collections.ConfigDict, sigma: str, target: str,
                   usual: str = '') -> None:
  """A mechanism that is on needs noise: its multiplier, or a target to calibrate it by."""
  require(p[sigma] > 0 or p[target] > 0,
          f'privacy.{sigma}=0 adds no noise, so no epsilon is finite: set it{usual}, or set '
          f'privacy.{target} to calibrate it.')


def check_models(p: ml_collections.ConfigDict, families_with_state) -> None:
  """DP-SGD clips per example, which a model with batch statistics (the zoo's ResNets,
  GoogLeNet and MobileNetV2) does not allow: its examples' gradients depend on each other."""
  if p.dp_sgd and families_with_state:
    raise ConfigError(
        'privacy.dp_sgd needs per-example gradients, which models with batch norm do not give: '
        f'{", ".join(sorted(families_with_state))}. Use families without it (the five CNNs '
        'cnn1..cnn5, or fedavgcnn), or turn privacy.dp_sgd off.')
