"""What every registered method declares and exchanges, checked on all of them: the hooks of
evaluation it overrides are declared (`eval_reads_state`, `eval_reads_server`,
`eval_server_in_extra`, `eval_server_header`), since the engine reads the declarations and never looks at which
functions a method overrides; and its hook data (per-client state, the loss's constants, the
accumulator, the forward pass's sums, the step after training's output, the payload) are typed,
flax.struct dataclasses or None, never dicts. Each checker is first shown to find what it looks
for, on a method made to break the rule. The hooks are traced with jax.eval_shape: nothing
compiles."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

from fedssa_jax import config_lib, methods, models
from fedssa_jax.methods import base, standalone

C, N = 10, 5
EVAL_HOOKS = ('eval_params', 'eval_forward', 'eval_extra')


def undeclared(cls) -> list[str]:
  """The hooks of evaluation that class `cls` overrides without declaring what they read, and
  the declarations it makes of hooks it does not override (identity checks: the test's, never
  the engine's)."""
  overrides = {h for h in EVAL_HOOKS if getattr(cls, h) is not getattr(base.Method, h)}
  found = [f'{cls.__name__} overrides {h} but does not declare eval_reads_server = True'
           for h in sorted(overrides) if not cls.eval_reads_server]
  if 'eval_forward' in overrides and not cls.eval_reads_state:
    found.append(f'{cls.__name__} overrides eval_forward but does not declare '
                 'eval_reads_state = True (evaluation would never call it)')
  if cls.eval_reads_state and 'eval_forward' not in overrides:
    found.append(f'{cls.__name__} declares eval_reads_state but keeps the default eval_forward, '
                 'which reads no state')
  if cls.eval_server_in_extra and (overrides - {'eval_extra'} or not cls.eval_reads_server):
    found.append(f'{cls.__name__} declares eval_server_in_extra but its server reaches more than '
                 'eval_extra (a kept result would go stale)')
  if cls.eval_server_header and (overrides or not cls.eval_reads_server
                                 or not hasattr(cls, 'eval_header')):
    found.append(f'{cls.__name__} declares eval_server_header but its server reaches more than '
                 'the rows of its eval_header (a kept representation would go stale)')
  return found


def test_the_declaration_checker_finds_an_undeclared_override():
  class ReadsPrototypes(standalone.Standalone):
    def eval_extra(self, server, client_id, logits, rep, y, valid):
      return {'hits': (rep.sum() > server.threshold).astype(jnp.int32)}

  class PredictsThroughState(standalone.Standalone):
    eval_reads_server = True

    def eval_forward(self, apply_fn, params, state, server, client_id, x):
      return apply_fn({'params': params}, x * state.scale)

  class DeclaresInVain(standalone.Standalone):
    eval_reads_state = True

  class ServerBeyondExtra(standalone.Standalone):
    eval_reads_server = eval_server_in_extra = True

    def eval_params(self, params, server, client_id):
      return server.header

  assert undeclared(ReadsPrototypes) == [
      'ReadsPrototypes overrides eval_extra but does not declare eval_reads_server = True']
  assert undeclared(PredictsThroughState) == [
      'PredictsThroughState overrides eval_forward but does not declare eval_reads_state = True '
      '(evaluation would never call it)']
  assert len(undeclared(DeclaresInVain)) == 1
  class ServerBeyondHeader(standalone.Standalone):
    eval_reads_server = eval_server_header = True

    def eval_header(self, server, client_id):
      return server.header

    def eval_extra(self, server, client_id, logits, rep, y, valid):
      return {'hits': (rep.sum() > server.threshold).astype(jnp.int32)}

  class HeaderFromNowhere(standalone.Standalone):
    eval_reads_server = eval_server_header = True

  assert undeclared(ServerBeyondExtra) == [
      'ServerBeyondExtra declares eval_server_in_extra but its server reaches more than '
      'eval_extra (a kept result would go stale)']
  beyond_header = ('declares eval_server_header but its server reaches more than the rows of '
                   'its eval_header (a kept representation would go stale)')
  assert undeclared(ServerBeyondHeader) == [f'ServerBeyondHeader {beyond_header}']
  assert undeclared(HeaderFromNowhere) == [f'HeaderFromNowhere {beyond_header}']


def test_every_method_declares_the_evaluation_hooks_it_overrides():
  found = [p for cls in methods.METHODS.values() for p in undeclared(cls)]
  assert not found, '\n'.join(found)
  # A declaration an instance may narrow from its config: FedGH evaluating its own header.
  cfg = config_lib.base_config('cifar10')
  cfg.fedgh.eval = 'post_train'
  assert methods.METHODS['fedgh'].eval_reads_server and methods.METHODS['fedgh'].eval_server_header
  own = methods.get_method('fedgh')(cfg, N, C)
  assert not own.eval_reads_server and not own.eval_server_header


def shape(dtype, *dims):
  return jax.ShapeDtypeStruct(dims, dtype)


def hook_data(method, model) -> dict:
  """The data one client's round passes between `method`'s hooks, as traced shapes."""
  key = jax.random.PRNGKey(0)
  counts = ({'class_counts': jnp.ones((N, C), jnp.float32)}
            if method.server_reads_class_counts else {})
  server = jax.eval_shape(lambda k, s: method.init_server(k, s, **counts), key,
                          jnp.ones((N, C), bool))
  state = jax.eval_shape(method.init_client_state, key)
  params = jax.eval_shape(lambda: models.init_params(model, key))
  view = base.ClientView(id=shape(jnp.int32), seen=shape(jnp.bool_, C),
                         num_samples=shape(jnp.int32), round=shape(jnp.int32))
  down = jax.eval_shape(method.download, params, state, server, view)
  trainable = {'model': down.params, **down.aux}
  b = 4
  x, y, valid = shape(jnp.float32, b, 32, 32, 3), shape(jnp.int32, b), shape(jnp.bool_, b)
  _, (_, acc) = jax.eval_shape(
      lambda t, ctx, x, y, v: method.loss(model.apply, t, ctx, (x,) * method.num_views, y, v,
                                          **({'key': key} if method.loss_draws else {})),
      trainable, down.ctx, x, y, valid)
  passed = after = None
  if method.forward_pass is not None:
    logits, rep = jax.eval_shape(lambda p, x: model.apply({'params': p}, x), down.params, x)
    passed = jax.eval_shape(method.forward_pass_stats, logits, rep, y, valid)
  if method.after_training is not None:
    after = jax.eval_shape(
        lambda t, ctx, study, quiz, v: method.after_training(model.apply, t, ctx, study, quiz, v),
        trainable, down.ctx, (x, y, valid), (x, y, valid), view)
  up = jax.eval_shape(method.upload, trainable,
                      base.Accumulated(loss=acc, forward_pass=passed, after_training=after),
                      down.ctx, state, view)
  return {'init_client_state': state, 'Download.ctx': down.ctx, 'init_acc': method.init_acc(),
          'the loss\'s accumulator update': acc, 'the forward pass\'s sums': passed,
          'after_training': after, 'Upload.state': up.state, 'Upload.payload': up.payload}


def untyped(name: str, data: dict) -> list[str]:
  """The hook data of method `name` that are neither None nor a dataclass (a dict, an array, a
  tuple), and a state or accumulator whose type the round changes."""
  found = [f'{name}: {what} is a {type(value).__name__}, not a flax.struct dataclass or None'
           for what, value in data.items()
           if value is not None and not (dataclasses.is_dataclass(value)
                                          and not isinstance(value, type))]
  for first, then in (('init_client_state', 'Upload.state'),
                      ('init_acc', 'the loss\'s accumulator update')):
    if jax.tree.structure(data[first]) != jax.tree.structure(data[then]):
      found.append(f'{name}: {then} is not shaped as {first}')
  return found


@pytest.fixture(scope='module')
def model():
  return models.make_model('cnn5', C, 'im2col', feature_dim=500)


def test_the_type_checker_finds_a_dict_payload_and_a_changed_state(model):
  class DictUpload(standalone.Standalone):
    def upload(self, trainable, acc, ctx, state, client):
      return base.Upload(trainable['model'], {'kept': client.id},
                         payload={'rows': models.header_rows(trainable['model'])})

  method = DictUpload(config_lib.base_config('cifar10'), N, C)
  assert untyped('dict_upload', hook_data(method, model)) == [
      'dict_upload: Upload.state is a dict, not a flax.struct dataclass or None',
      'dict_upload: Upload.payload is a dict, not a flax.struct dataclass or None',
      'dict_upload: Upload.state is not shaped as init_client_state']


@pytest.mark.parametrize('name', sorted(methods.METHODS))
def test_every_method_s_hook_data_are_typed(name, model):
  method = methods.get_method(name)(config_lib.base_config('cifar10'), N, C)
  data = hook_data(method, model)
  assert not untyped(name, data), '\n'.join(untyped(name, data))
  # A method that keeps no state beyond its model says so with the one empty type.
  keeps_state = ('fedkd', 'fedmrl', 'fedsa')
  assert (data['init_client_state'] == base.NoState()) == (name not in keeps_state)
