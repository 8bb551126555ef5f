"""Short runs on 1 and on several (fake CPU) devices, printed as one JSON line; sharding_test.py
runs this in a subprocess, since the device count is fixed when JAX starts:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/sharding_run.py \
        fedssa:2:cnn4 fd:2:cnn4 replicas

Each run is engine_test's small config (10 clients, K = 3) with the rounds and families given.
Every distinct config is a new set of XLA programs (most of the time), so the runs are few
and share what they can (the persistent compilation cache of conftest.py loads a program
compiled before): the first run's mesh run also resumes the one-device run's checkpoint, and is
seed 0's run alone for 'replicas', which packs FedSSA seeds 0 and 15 of the same config.
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
from fedssa_jax import data  # noqa: E402
from fedssa_jax.engine import simulator, snapshots
from fedssa_jax.run import checkpoint


# The system section of a run marked ':system' (fedssa_jax/system.py): every kind, a clock and
# a deadline that some uploads miss. K = 7, of whom the dropouts leave 5 in each of the two
# rounds (of seed 0): two chunks on 4 devices, the second padded with dummies.
SYSTEM = {'participation': 0.7, 'system.availability': 0.9, 'system.dropout': 0.2,
          'system.straggler_rate': 0.5, 'system.min_work': 0.2, 'system.upload_loss': 0.3,
          'system.device_tiers': 'three_tiers', 'system.deadline': 0.3}


def make_config(method, rounds, families, mesh_devices, store='device', seed=0, system=False):
  """engine_test's small config (10 clients, K = 3), with these rounds, families and seed, on
  `mesh_devices` (0: all) with the population store `store`; `system`: with SYSTEM (K = 7)."""
  config = engine_test.small_config(method)
  if system:
    config.update_from_flattened_dict(SYSTEM)
  config.engine.mesh_devices = mesh_devices
  config.population_store = store
  config.num_rounds = rounds
  config.model.families = families
  config.seed = seed
  return config


def sharding_facts(sim, state):
  """How the state is placed: per group, the spec and device count of its parameters' sharding
  and the rows of each addressable shard (the client axis, after the seed axis)."""
  facts = []
  for g, params in zip(sim.groups, state.population.params):
    leaf = jax.tree.leaves(params)[0]
    s = leaf.sharding
    facts.append({'rows': leaf.shape[1], 'size': g.size, 'clients_per_call': g.clients_per_call,
                  'spec': str(getattr(s, 'spec', None)), 'devices': len(s.device_set),
                  'shard_rows': sorted({sh.data.shape[1] for sh in leaf.addressable_shards})})
  return facts


def one_run(config, ds):
  """engine_test.run of `config`: (sim, state, what the tests compare of it)."""
  sim, state, infos, ev = engine_test.run(config, ds)
  # The server state and per-client state, without padding rows, to compare across meshes.
  host = snapshots.saved(sim.store, state)
  server_sum = sum(float(np.abs(np.asarray(x, np.float64)).sum())
                   for x in jax.tree.leaves(host['server']))
  return sim, state, {
      'sharding': sharding_facts(sim, state) if config.population_store == 'device' else None,
      # Programs of each group's training call: one for every round (the server's placement
      # from init_state on is the one later rounds give it).
      'train_compiles': ([call._cache_size() for call in sim._train_calls]
                         if config.population_store == 'device' else None),
      'cohorts': [i.cohort.tolist() for i in infos],
      'train_loss': [i.train_loss for i in infos],
      'train_samples': [i.train_samples.tolist() for i in infos],
      # The system section's rounds (None: off): who was dropped, lost, late and received.
      'system': [None if i.system is None else
                 {k: getattr(i.system, k).tolist() for k in ('dropped', 'stragglers', 'lost',
                                                              'late', 'received', 'seconds')}
                 for i in infos],
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
      # What replicas_on_the_mesh compares (summary): every leaf's sum, params and server.
      'abs_sums': [float(np.abs(np.asarray(x, np.float64)).sum())
                   for x in jax.tree.leaves((host['params'], host['server']))],
  }


def summary(sim, state, infos, ev, seed_index=0):
  """What replicas_on_the_mesh compares of a run (of one of its seeds): its records, and its
  state's sums (the keys of one_run's that it shares)."""
  host = snapshots.saved(sim.store, state, seed_index)
  return {'cohorts': [i.cohort.tolist() for i in infos],
          'train_loss': [i.train_loss for i in infos],
          'up_floats': [i.up_floats for i in infos],
          'accuracy': ev.accuracy.tolist(),
          'abs_sums': [float(np.abs(np.asarray(x, np.float64)).sum())
                       for x in jax.tree.leaves((host['params'], host['server']))]}


def replicas_on_the_mesh(ds, rounds, families, seed0_alone, seeds=(0, 15)):
  """FedSSA seeds packed (one Simulator of both seeds) on the mesh of all devices, and each
  alone on it. The packed state goes through its replicas' checkpoint form (saved, then live and stacked again)
  after round 1, as a resume does. `seed0_alone`: (config, one_run's result) of the FedSSA run
  of seeds[0] alone on the mesh, already run (its config must be the replicas'); the others run
  alone here. Seed 15's partition has seed 0's index-row widths (27 training, 11 test samples),
  so its run alone is seed 0's programs, loaded from the cache; replicas_test.py packs seeds of
  unequal widths (padded index rows)."""
  configs = [make_config('fedssa', rounds, families, 0, seed=seed) for seed in seeds]
  config0, result0 = seed0_alone
  assert configs[0].to_dict() == config0.to_dict(), 'seed 0 alone must be the packed config'
  sim = simulator.Simulator(configs[0], ds, [data.partition_from_config(c, ds) for c in configs],
                         seeds=seeds)
  state = sim.init_state()
  infos, evs = [[] for _ in seeds], [None] * len(seeds)
  for t in range(rounds):
    state, round_infos = sim.run_round(state)
    for r in range(len(seeds)):
      evs[r] = sim.evaluate(state, previous=evs[r], seed_index=r)
      infos[r].append(round_infos[r])
    if t == 0:
      state = snapshots.stacked(
          sim.store, [snapshots.saved(sim.store, state, r) for r in range(len(seeds))])
  leaf = jax.tree.leaves(state.population.params[0])[0]
  out = {'stacked': {'shape': list(leaf.shape), 'spec': str(leaf.sharding.spec),
                     'shard_shapes': sorted({sh.data.shape[:2] for sh in leaf.addressable_shards})},
         'packed': [summary(sim, state, infos[r], evs[r], r) for r in range(len(seeds))]}
  alone0 = {k: result0[k] for k in out['packed'][0]}
  out['alone'] = [alone0] + [summary(*engine_test.run(c, ds)) for c in configs[1:]]
  return out


def main(runs):
  """runs: 'method:rounds:family,family[:system]' each (':system': with the system section on,
  SYSTEM); every one on one device and on all of them.
  The first also resumes one device's checkpoint on all of them, and runs with the host store
  on all of them. 'replicas': replicas_on_the_mesh, with the rounds and families of the first
  run, which must be FedSSA (its mesh run is seed 0's run alone)."""
  ds = conftest.synthetic_dataset()
  out = {'devices': jax.device_count()}
  packed = 'replicas' in runs
  runs = [r for r in runs if r != 'replicas']
  for i, run in enumerate(runs):
    method, rounds, families, *system = run.split(':')
    rounds, families = int(rounds), tuple(families.split(','))
    configs = {d: make_config(method, rounds, families, d, system=system == ['system'])
               for d in (1, 0)}
    sims = {d: one_run(c, ds) for d, c in configs.items()}
    out[method] = {str(d): r for d, (_, _, r) in sims.items()}
    if i == 0:
      out[method]['resume'] = resume_across_meshes(sims[1][:2], sims[0][:2])
      # The host store on the mesh: chunks read from RAM and placed sharded.
      out[method]['0host'] = one_run(make_config(method, rounds, families, 0, store='host'),
                                     ds)[2]
      if packed:
        assert method == 'fedssa', 'replicas pack FedSSA seeds: the first run must be FedSSA'
        out['replicas'] = replicas_on_the_mesh(ds, rounds, families, (configs[0], sims[0][2]))
  print('RESULT ' + json.dumps(out))


def resume_across_meshes(run1, run8):
  """Checkpoints the one-device run, resumes it on the mesh, and runs one more round on both."""
  (sim1, state1), (sim8, state8) = run1, run8
  with tempfile.TemporaryDirectory() as d:
    ckpts = checkpoint.Checkpointer(d)
    ckpts.save(snapshots.saved(sim1.store, state1), {}, {})
    template = snapshots.saved(sim8.store, state8)
    restored = snapshots.stacked(sim8.store, [ckpts.restore_latest(template=template).state])
    ckpts.close()
  facts = sharding_facts(sim8, restored)
  _, (info1,) = sim1.run_round(state1)
  _, (info8,) = sim8.run_round(restored)
  return {'sharding': facts, 'cohorts': [info1.cohort.tolist(), info8.cohort.tolist()],
          'train_loss': [info1.train_loss, info8.train_loss],
          'up_floats': [info1.up_floats, info8.up_floats]}


if __name__ == '__main__':
  main(sys.argv[1:])
