"""Short runs on 1 and on several (fake CPU) devices, printed as one JSON line; sharding_test.py
runs this in a subprocess, since the device count is fixed when JAX starts:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_run.py fedssa:3:cnn5,cnn4
"""
import json
import os
import sys
import tempfile

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import conftest  # noqa: E402  (full float32 matmuls, the synthetic data set)
import engine_test  # noqa: E402  (the small configs)
from fedssa_jax import checkpoint, data, engine  # noqa: E402


def sharding_facts(sim, state):
  """How the state is placed: per group, the spec and device count of its parameters' sharding
  and the rows of each addressable shard."""
  facts = []
  for g, params in zip(sim.groups, state.params):
    leaf = jax.tree.leaves(params)[0]
    s = leaf.sharding
    facts.append({'rows': leaf.shape[0], 'size': g.size, 'clients_per_call': g.clients_per_call,
                  'spec': str(getattr(s, 'spec', None)), 'devices': len(s.device_set),
                  'shard_rows': sorted({sh.data.shape[0] for sh in leaf.addressable_shards})})
  return facts


def one_run(method, mesh_devices, ds, rounds, families, store='device'):
  """One run of engine_test's small config (K = 3) on `mesh_devices` (0: all)."""
  config = engine_test.small_config(method)
  config.engine.mesh_devices = mesh_devices
  config.population_store = store
  config.num_rounds = rounds
  config.model.families = families
  sim, state, infos, ev = engine_test.run(config, ds)
  # The server state and per-client state, without padding rows, to compare across meshes.
  host = sim.saved(state)
  server_sum = sum(float(np.abs(np.asarray(x, np.float64)).sum())
                   for x in jax.tree.leaves(host['server']))
  return sim, state, {
      'sharding': sharding_facts(sim, state) if store == 'device' else None,
      'cohorts': [i.cohort.tolist() for i in infos],
      'train_loss': [i.train_loss for i in infos],
      'train_samples': [i.train_samples.tolist() for i in infos],
      'up_floats': [i.up_floats for i in infos],
      'down_floats': [i.down_floats for i in infos],
      'client_flops': [i.client_flops for i in infos],
      'costs': host['costs'],
      'accuracy': ev.accuracy.tolist(),
      'batch_accuracy': ev.batch_accuracy.tolist(),
      'server_abs_sum': server_sum,
      'params_abs_sum': [float(sum(np.abs(np.asarray(x, np.float64)).sum()
                                   for x in jax.tree.leaves(p))) for p in host['params']],
      'params_rows': [[np.asarray(x).shape[0] for x in jax.tree.leaves(p)][0]
                      for p in host['params']],
  }


def summary(sim, state, infos, ev):
  """What replicas_on_the_mesh compares of a run: its records, and its state's sums."""
  host = sim.saved(state)
  return {'cohorts': [i.cohort.tolist() for i in infos],
          'train_loss': [i.train_loss for i in infos],
          'up_floats': [i.up_floats for i in infos],
          'accuracy': ev.accuracy.tolist(),
          'abs_sums': [float(np.abs(np.asarray(x, np.float64)).sum())
                       for x in jax.tree.leaves((host['params'], host['server']))]}


def replicas_on_the_mesh(ds, seeds=(0, 3), rounds=2):
  """FedSSA seeds packed (engine.Replicas) on the mesh of all devices, and each alone on it. The
  packed state goes through its replicas' checkpoint form (saved, then live and stacked again)
  after round 1, as a resume does."""
  configs = []
  for seed in seeds:
    c = engine_test.small_config('fedssa')
    c.engine.mesh_devices, c.num_rounds, c.seed = 0, rounds, seed
    c.model.families = ('cnn5',)  # one group: half the compiles of small_config's two
    configs.append(c)
  sims = [engine.Simulator(c, ds, data.partition_from_config(c, ds)) for c in configs]
  pack = engine.Replicas(sims)
  state = pack.stack([s.init_state() for s in sims])
  infos, evs = [[] for _ in seeds], [None] * len(seeds)
  for t in range(rounds):
    state, round_infos = pack.run_round(state)
    for r, sim in enumerate(sims):
      evs[r] = sim.evaluate(pack.replica(state, r), previous=evs[r])
      infos[r].append(round_infos[r])
    if t == 0:
      state = pack.stack([sim.live(sim.saved(pack.replica(state, r)))
                          for r, sim in enumerate(sims)])
  leaf = jax.tree.leaves(state.params[0])[0]
  out = {'stacked': {'shape': list(leaf.shape), 'spec': str(leaf.sharding.spec),
                     'shard_shapes': sorted({sh.data.shape[:2] for sh in leaf.addressable_shards})},
         'packed': [summary(sim, pack.replica(state, r), infos[r], evs[r])
                    for r, sim in enumerate(sims)]}
  out['alone'] = [summary(*engine_test.run(c, ds)) for c in configs]
  return out


def main(runs):
  """runs: 'method:rounds:family,family' each; every one on one device and on all of them.
  'replicas': replicas_on_the_mesh."""
  ds = conftest.synthetic_dataset()
  out = {'devices': jax.device_count()}
  if 'replicas' in runs:
    runs = [r for r in runs if r != 'replicas']
    out['replicas'] = replicas_on_the_mesh(ds)
  for i, run in enumerate(runs):
    method, rounds, families = run.split(':')
    sims = {d: one_run(method, d, ds, int(rounds), tuple(families.split(','))) for d in (1, 0)}
    out[method] = {str(d): r for d, (_, _, r) in sims.items()}
    if i == 0:
      out[method]['resume'] = resume_across_meshes(sims[1][:2], sims[0][:2])
      # The host store on the mesh: chunks read from RAM and placed sharded.
      out[method]['0host'] = one_run(method, 0, ds, int(rounds), tuple(families.split(',')),
                                     store='host')[2]
  print('RESULT ' + json.dumps(out))


def resume_across_meshes(run1, run8):
  """Checkpoints the one-device run, resumes it on the mesh, and runs one more round on both."""
  (sim1, state1), (sim8, state8) = run1, run8
  with tempfile.TemporaryDirectory() as d:
    ckpts = checkpoint.Checkpointer(d)
    ckpts.save(sim1.saved(state1), {}, {})
    restored = sim8.live(ckpts.restore_latest(template=sim8.saved(state8)).state)
    ckpts.close()
  facts = sharding_facts(sim8, restored)
  _, info1 = sim1.run_round(state1)
  _, info8 = sim8.run_round(restored)
  return {'sharding': facts, 'cohorts': [info1.cohort.tolist(), info8.cohort.tolist()],
          'train_loss': [info1.train_loss, info8.train_loss],
          'up_floats': [info1.up_floats, info8.up_floats]}


if __name__ == '__main__':
  main(sys.argv[1:])
