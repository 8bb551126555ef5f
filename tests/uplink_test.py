"""engine/uplink.py: the path of an upload from client to server, on tiny arrays (no simulator).

The path a config builds (everything off: every step the identity; the system section and upload
DP on: their steps), the identity steps returning what they were given, client-level DP on each
upload as privacy.privatize_upload computes it with each client's key, and a composed path (lost
uploads and central noise) applying its steps in their order.
"""
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from fedssa_jax import config_lib, methods, privacy, system
from fedssa_jax.engine import uplink
from fedssa_jax.engine.state import ChunkInputs, ClientStats
from fedssa_jax.engine.training import TrainStats
from fedssa_jax.streams import Stream

N = 4  # clients


@struct.dataclass
class Payload:
  rows: jax.Array  # private (Method.private_upload)
  count: jax.Array  # not


class Recorder:
  """A stand-in method whose server is {'sum': [D]} and whose hooks record their calls."""
  private_upload = ('rows',)

  def __init__(self):
    self.calls = []

  def upload_reference(self, server, down, client):
    return {'rows': server['sum']}

  def server_receive(self, server, client_ids, payloads, active):
    self.calls.append('receive')
    return {'sum': server['sum'] + jnp.where(active[:, None], payloads.rows, 0).sum(axis=0)}

  def central_noise(self, server, key, std):
    self.calls.append('noise')
    return {'sum': server['sum'] + std * jax.random.normal(key, server['sum'].shape)}

  def server_aggregate(self, server, participants, round_index, key):
    self.calls.append('rule')
    return methods.Aggregated({'sum': server['sum'] / jnp.maximum(participants.sum(), 1)},
                              flops=jnp.asarray(3.0))


def chunk(lost=(False, True, False, False), deadline=np.inf):
  """A chunk of clients 0..3 (3 a dummy) with the system section's inputs, and its stats."""
  sys_in = system.SystemInputs(
      work=jnp.ones(N), lost=jnp.asarray(lost), train_flops=jnp.ones(N), speed=jnp.ones(N),
      down=jnp.ones(N), up=jnp.ones(N), deadline=jnp.asarray(deadline, jnp.float32))
  inputs = ChunkInputs(slots=None, ids=jnp.arange(N), active=jnp.arange(N) < 3, seen=None,
                       data=None, round_index=jnp.asarray(2), root_key=jax.random.PRNGKey(7),
                       system=sys_in)
  zeros = jnp.zeros(N)
  stats = ClientStats(train=TrainStats(correct=zeros, loss_sum=zeros, samples=jnp.ones(N, int),
                                       steps=zeros),
                      down_floats=zeros, up_floats=zeros, extra_flops=zeros)
  return inputs, stats


def payloads():
  rows = jnp.asarray(np.random.default_rng(0).normal(size=(N, 3)), jnp.float32)
  return Payload(rows=rows, count=jnp.arange(N))


def test_everything_off_builds_the_identity_path_and_each_part_its_step():
  cfg = config_lib.base_config('cifar10')
  method = Recorder()
  off = uplink.Uplink.build(cfg, method, None)
  assert off == uplink.Uplink()
  assert (off.client, off.federation, off.before_rule, off.after_rule) == (
      uplink.AsSent(), uplink.Ideal(), uplink.IDENTITY, uplink.IDENTITY)
  hash(off)  # static: it can key a jit cache
  cfg.privacy.upload_clip = 1.5
  cfg.system.upload_loss = 0.3
  for central in (False, True):
    path = uplink.Uplink.build(cfg, method, types.SimpleNamespace(central=central, std=0.6))
    assert path.client == uplink.Privatize(privacy.UploadDP(
        fields=('rows',), clip_norm=1.5, std=0.0 if central else 0.6))
    assert path.federation == uplink.Drawn()
    assert path.before_rule == (uplink.CentralNoise(0.6) if central else uplink.IDENTITY)
    assert path.after_rule == uplink.KeepWhenEmpty()
    hash(path)


def test_the_identity_path_hands_on_what_it_is_given():
  method, path = Recorder(), uplink.Uplink()
  inputs, stats = chunk()
  up = payloads()
  server = {'sum': jnp.arange(3.0)}
  view = methods.ClientView(id=inputs.ids, seen=None, num_samples=None, round=inputs.round_index)
  sent, norms = path.send(method, up, server, None, view, inputs.root_key)
  for a, b in zip(jax.tree.leaves(sent), jax.tree.leaves(up)):
    np.testing.assert_array_equal(a, b)
  assert norms is None
  assert path.federation.work(inputs) == ()
  received_server, received, seconds = path.receive(method, server, inputs, up, stats)
  np.testing.assert_array_equal(received, inputs.active)  # lost does not count here
  assert seconds is None
  agg = path.aggregate(method, received_server, jnp.asarray(received), 2, inputs.root_key)
  key = jax.random.fold_in(jax.random.fold_in(inputs.root_key, Stream.AGGREGATE), 2)
  want = Recorder().server_aggregate(received_server, jnp.asarray(received), 2, key)
  np.testing.assert_array_equal(agg.server['sum'], want.server['sum'])
  assert method.calls == ['receive', 'rule']


def test_client_level_dp_clips_and_noises_each_upload_with_its_client_s_key():
  method = Recorder()
  inputs, _ = chunk()
  dp = privacy.UploadDP(fields=('rows',), clip_norm=0.5, std=0.3)
  up, server = payloads(), {'sum': jnp.ones(3)}
  view = methods.ClientView(id=inputs.ids, seen=None, num_samples=None, round=inputs.round_index)
  sent, norms = uplink.Uplink(client=uplink.Privatize(dp)).send(method, up, server, None, view,
                                                                inputs.root_key)
  keys = privacy.upload_keys(inputs.root_key, inputs.round_index, inputs.ids)
  for k in range(N):
    want, norm = privacy.privatize_upload(
        jax.tree.map(lambda v, k=k: v[k], up), {'rows': server['sum']}, keys[k],
        fields=dp.fields, clip_norm=dp.clip_norm, std=dp.std)
    np.testing.assert_array_equal(sent.rows[k], want.rows)
    np.testing.assert_array_equal(sent.count[k], up.count[k])  # not private: as sent
    np.testing.assert_array_equal(norms[k], norm)


def test_lost_uploads_and_central_noise_act_in_their_order():
  """Client 1's upload is lost: the server receives clients 0 and 2, noises its sum, then runs
  the rule over them; a round that received nothing keeps the server as it was, unnoised."""
  method = Recorder()
  path = uplink.Uplink(federation=uplink.Drawn(), before_rule=uplink.CentralNoise(0.25),
                       after_rule=uplink.KeepWhenEmpty())
  inputs, stats = chunk()
  up, server = payloads(), {'sum': jnp.zeros(3)}
  assert len(path.federation.work(inputs)) == 1
  received_server, received, seconds = path.receive(method, server, inputs, up, stats)
  np.testing.assert_array_equal(received, [True, False, True, False])
  np.testing.assert_allclose(seconds, [1.0, 1.0, 1.0, 0.0])  # 1 FLOP at 1 FLOP/s each
  np.testing.assert_allclose(received_server['sum'], up.rows[0] + up.rows[2])
  participants = jnp.zeros(N, bool).at[inputs.ids].max(received)
  agg = path.aggregate(method, received_server, participants, 2, inputs.root_key)
  noise = 0.25 * jax.random.normal(privacy.server_upload_key(inputs.root_key, 2), (3,))
  np.testing.assert_allclose(agg.server['sum'], (up.rows[0] + up.rows[2] + noise) / 2,
                             rtol=1e-6)
  assert float(agg.flops) == 3.0
  assert method.calls == ['receive', 'noise', 'rule']
  empty = path.aggregate(method, received_server, jnp.zeros(N, bool), 3, inputs.root_key)
  np.testing.assert_array_equal(empty.server['sum'], received_server['sum'])
  assert float(empty.flops) == 0.0
  late_inputs, late_stats = chunk(lost=(False,) * N, deadline=0.5)  # 1 s each: all late
  _, received, _ = path.receive(method, server, late_inputs, up, late_stats)
  np.testing.assert_array_equal(received, [False] * N)
