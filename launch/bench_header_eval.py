"""Times the evaluation of a method that tests its clients with the server's header
(`Method.eval_server_header`: LG-FedAvg, FedGH, FedGen) at the cross-device variant's shape
with N clients (K = 10% of them), 500 global test images: an evaluation that keeps the clients'
representations and tests again only those trained since the last one, against a whole
evaluation of the same state (what every evaluation of such a method did before), alternating,
5 rounds apart as the cross-device sweeps evaluate. Prints both times, their ratio and whether
the counts agree (docs/benchmarks.md, "The lens's evaluation of the header methods").

  python launch/bench_header_eval.py --method=lg_fedavg --clients=300 \\
      --data_dir=$HOME/tensorflow_datasets
"""
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fedssa_jax import config_lib, data  # pylint: disable=g-import-not-at-top,wrong-import-position
from fedssa_jax.engine import simulator  # pylint: disable=g-import-not-at-top,wrong-import-position

_METHOD = flags.DEFINE_string('method', 'lg_fedavg', 'A method of eval_server_header.')
_CLIENTS = flags.DEFINE_integer('clients', 300, 'N (K = 10% of it).')
_REPEATS = flags.DEFINE_integer('repeats', 2, 'Pairs of evaluations timed.')
_DATA_DIR = flags.DEFINE_string('data_dir', None, 'TFDS data_dir of CIFAR-10.')


def main(argv):
  del argv
  c = config_lib.build('cifar10', 'hetero,n1000')
  c.method, c.num_clients, c.data_dir = _METHOD.value, _CLIENTS.value, _DATA_DIR.value
  c.eval_global_images, c.new_clients = 500, 0.0
  ds = data.load_dataset(c.dataset, c.data_dir)
  sim = simulator.Simulator(c, ds, data.partition_from_config(c, ds))
  if not sim.evaluator.keep_reps:
    sys.exit(f'{c.method} at N = {c.num_clients} keeps no representations (eval_server_header, '
             'no mesh, within evaluation.KEEP_REPS_BYTES): nothing to compare.')
  state, _ = sim.run_round(sim.init_state())
  ev = sim.evaluate(state)  # compiles
  for _ in range(_REPEATS.value):
    for _ in range(5):
      state, _ = sim.run_round(state)
    t0 = time.perf_counter()
    kept = sim.evaluate(state, previous=ev)
    t_kept = time.perf_counter() - t0
    t0 = time.perf_counter()
    whole = sim.evaluate(state)
    t_whole = time.perf_counter() - t0
    same = all((kept.counts[k] == whole.counts[k]).all() for k in whole.counts)
    print(f'{c.method} N={c.num_clients} round {int(state.round)}: kept values {t_kept:.1f} s '
          f'({kept.reevaluated} tested), whole {t_whole:.1f} s ({whole.reevaluated}): '
          f'{t_whole / t_kept:.2f}x; the same counts: {same}', flush=True)
    ev = kept


if __name__ == '__main__':
  app.run(main)
