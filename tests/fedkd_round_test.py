"""launch/fedkd_round.py's parts that run without torch: HtFLlib's CNN weights in our layout
(a forward pass written out in torch's layout, NCHW, against our model's), and a missing HtFLlib
named with its fix. Runs neither side's round."""
import jax
import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

from conftest import load_file
from fedssa_jax import models


def torch_layout_forward(state, prefix, x_nchw):
  """FedSSACNN.forward (launch/against_htfllib.py's CNN_MODULE) in numpy on torch-layout
  weights: conv [O, I, 5, 5] as a cross-correlation, 2x2 max-pool, flatten (C, H, W)."""
  get = lambda k: np.asarray(state[f'{prefix}/model/{k}'], np.float64)

  def conv_relu_pool(x, w, b):
    win = sliding_window_view(x, (5, 5), axis=(2, 3))  # [B, I, H', W', 5, 5]
    y = np.maximum(np.einsum('bihwkl,oikl->bohw', win, w) + b[None, :, None, None], 0)
    h, w_ = y.shape[2] // 2 * 2, y.shape[3] // 2 * 2
    return y[:, :, :h, :w_].reshape(y.shape[0], y.shape[1], h // 2, 2, w_ // 2, 2).max((3, 5))

  x = conv_relu_pool(x_nchw, get('base.conv1.weight'), get('base.conv1.bias'))
  x = conv_relu_pool(x, get('base.conv2.weight'), get('base.conv2.bias'))
  x = x.reshape(x.shape[0], -1)
  x = np.maximum(x @ get('base.fc1.weight').T + get('base.fc1.bias'), 0)
  x = np.maximum(x @ get('base.fc2.weight').T + get('base.fc2.bias'), 0)
  return x @ get('head.weight').T + get('head.bias')


@pytest.mark.parametrize('family', ['cnn2', 'cnn4'])  # conv2 widths 16 and 32
def test_htfllibs_weights_in_our_layout_give_its_outputs(family):
  fr = load_file('launch/fedkd_round.py')
  rng = np.random.default_rng(0)
  c2, fc1 = {'cnn2': (16, 2000), 'cnn4': (32, 800)}[family]
  shapes = {'base.conv1.weight': (16, 3, 5, 5), 'base.conv1.bias': (16,),
            'base.conv2.weight': (c2, 16, 5, 5), 'base.conv2.bias': (c2,),
            'base.fc1.weight': (fc1, c2 * 25), 'base.fc1.bias': (fc1,),
            'base.fc2.weight': (500, fc1), 'base.fc2.bias': (500,),
            'head.weight': (10, 500), 'head.bias': (10,)}
  state = {f'before/model/{k}': rng.uniform(-0.1, 0.1, s).astype(np.float32)
           for k, s in shapes.items()}
  ours = fr.ours_from_torch(state, 'before', 'model', c2)
  x = rng.standard_normal((3, 32, 32, 3)).astype(np.float32)
  model = models.make_model(family, 10, 'xla', feature_dim=500)
  assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(
      models.init_params(model, jax.random.PRNGKey(0)))
  logits, _ = model.apply({'params': ours}, x)
  want = torch_layout_forward(state, 'before', x.transpose(0, 3, 1, 2).astype(np.float64))
  np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-4, atol=1e-5)


def test_a_missing_htfllib_is_named_with_its_fix(capsys):
  fr = load_file('launch/fedkd_round.py')
  assert fr.main(['--htfllib=/nonexistent']) == 2
  assert 'git clone https://github.com/TsingZ0/HtFLlib' in capsys.readouterr().err
