"""Where local training's time goes, op by op, on the CPU.

  python launch/profile_ops.py --family=cnn1 [--batch=512 --micro_batch=64 --top=25]
  python launch/profile_ops.py --family=cnn1 --batch=10 --micro_batch=0 --steps=100 --plain_sgd
      (HtFLlib's settings)

Traces the engine's training call (`fedssa_jax.run.bench.train_call`, one client, synthetic
CIFAR-shaped data) with XLA:CPU's per-op trace events, and prints each compiled op's time per
training step and share of the call, its count per step, its result shape and, for matmuls
(plain dots or library fusions that hold one), the matmul's shape and GFLOP/s. Op names are those
of the compiled HLO (`--dump_hlo=PATH` writes it). Times come from the trace, so they carry its
overhead (each op's least over `--traces` calls is taken); read them as shares. Plain `dot` ops
run on Eigen's thread pool alongside the ops after them, so part of their time shows in those
ops: a dot above the machine's roofline is one.
"""
import collections
import glob
import gzip
import json
import math
import os
import re
import tempfile

if __name__ == '__main__':  # XLA reads its flags when the backend starts: before JAX's import.
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_cpu_enable_xprof_traceme=true').strip()
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app, flags
import jax
import jax.numpy as jnp

from fedssa_jax import config_lib, data, models
from fedssa_jax.engine import costs
from fedssa_jax.run import bench
# pylint: enable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_enum('family', 'cnn1', models.all_family_names(), 'Model family.')
flags.DEFINE_integer('batch', 512, 'Batch size.')
flags.DEFINE_integer('micro_batch', 64, 'Rows per forward/backward pass (0: the whole batch).')
flags.DEFINE_integer('steps', 4, 'Training steps per traced call.')
flags.DEFINE_bool('plain_sgd', False, 'HtFLlib\'s optimizer (plain SGD at lr 0.01, no '
                  'momentum, weight decay or clip, no augmentation) instead of the paper\'s.')
flags.DEFINE_integer('top', 25, 'Ops to list.')
flags.DEFINE_integer('traces', 3, 'Traced calls; each op counts with its least time among them.')
flags.DEFINE_string('dump_hlo', None, 'Write the compiled HLO text here.')

_INSTR = re.compile(r'^\s*(?:ROOT )?%([\w.-]+) = (\S+?)(?:\{[^}]*\})? ([\w-]+)\((.*)$')
_SHAPE = re.compile(r'\[([\d,]*)\]')


def _dims(shape: str) -> list[int]:
  m = _SHAPE.search(shape)
  return [int(d) for d in m.group(1).split(',') if d] if m else []


def parse_hlo(text: str):
  """{op name: (result shape, opcode, called computation)}, and {computation: its dot's
  (m, k, n, flops)} for every computation that holds a dot."""
  ops, shapes, comp_dots, comp = {}, {}, {}, None
  for line in text.splitlines():
    head = re.match(r'^(?:ENTRY )?%([\w.-]+) ', line)
    if head and line.rstrip().endswith('{'):
      comp = head.group(1)
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    name, shape, opcode, rest = m.groups()
    shapes[name] = shape
    called = re.search(r'calls=%([\w.-]+)', rest)
    ops[name] = (shape, opcode, called.group(1) if called else None)
    if opcode == 'dot':
      operands = re.findall(r'%([\w.-]+)', rest.split(')')[0])
      lhs = _dims(shapes.get(operands[0], ''))
      contracting = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', rest)
      k = math.prod(lhs[int(d)] for d in contracting.group(1).split(',') if d) if contracting else 1
      dims = _dims(shape)
      out, n = math.prod(dims), (dims[-1] if dims else 1)
      comp_dots[comp] = comp_dots[name] = (out // n, k, n, 2 * out * k)
  return ops, comp_dots


def trace_call(run, ops):
  """Seconds and count of each compiled op in one traced call of run()."""
  with tempfile.TemporaryDirectory() as tmp:
    jax.profiler.start_trace(tmp, create_perfetto_trace=True)
    run()
    jax.profiler.stop_trace()
    trace = json.load(gzip.open(glob.glob(f'{tmp}/**/*.json.gz', recursive=True)[0]))
  events = trace['traceEvents'] if isinstance(trace, dict) else trace
  total, count = collections.Counter(), collections.Counter()
  for e in events:
    if e.get('ph') == 'X' and e['name'] in ops:
      total[e['name']] += e['dur'] * 1e-6
      count[e['name']] += 1
  return total, count


def main(_):
  ds = data.synthetic_cifar(10, FLAGS.batch * FLAGS.steps, 100)
  plain = dict(lr=0.01, momentum=0.0, weight_decay=0.0, clip_norm=0.0, augment=False)
  call, args, images = bench.train_call(FLAGS.family, FLAGS.batch, 1, FLAGS.steps, ds,
                                        FLAGS.micro_batch, **(plain if FLAGS.plain_sgd else {}))
  text = call.lower(*args).compile().as_text()
  if FLAGS.dump_hlo:
    with open(FLAGS.dump_hlo, 'w') as f:
      f.write(text)
  ops, dots = parse_hlo(text)
  run = lambda: jax.block_until_ready(call(*args))
  run()
  seconds = bench.best_time(run, 3)
  total, count = None, None
  for _ in range(FLAGS.traces):  # each op's least total over the traced calls
    t, c = trace_call(run, ops)
    total = t if total is None else collections.Counter(
        {name: min(v, t[name]) for name, v in total.items()})
    count = c
  traced = sum(total.values())
  steps = FLAGS.steps
  print(f'{FLAGS.family}, batch {FLAGS.batch} in passes of {FLAGS.micro_batch or FLAGS.batch}: '
        f'{images / seconds:,.0f} img/s untraced, {seconds / steps * 1e3:.1f} ms per step; '
        f'ops in the trace: {traced / steps * 1e3:.1f} ms per step')
  print(f'{"ms/step":>8} {"share":>6} {"per step":>8}  {"op":34} {"result":26} matmul')
  for name, t in total.most_common(FLAGS.top):
    shape, opcode, called = ops[name]
    dot = dots.get(name) or dots.get(called)
    mm = (f'[{dot[0]},{dot[1]}]@[{dot[1]},{dot[2]}] {dot[3] * count[name] / t / 1e9:5.0f} GFLOP/s'
          if dot else '')
    print(f'{t / steps * 1e3:8.2f} {t / traced:6.1%} {count[name] / steps:8.1f}  {name[:34]:34} '
          f'{shape[:26]:26} {mm}')
  by_kind = collections.Counter()
  for name, t in total.items():
    by_kind['matmuls' if (dots.get(name) or dots.get(ops[name][2])) else 'other ops'] += t
  print('; '.join(f'{k} {v / traced:.0%}' for k, v in by_kind.most_common()))
  memory_floor(args[0], seconds / steps, bench.matmul_roofline(quick=False)['flops_per_s'],
               costs.xla_train_flops_per_sample(FLAGS.family, ds.num_classes, FLAGS.batch,
                                                config_lib.base_config('cifar10').model
                                                .feature_dim) * FLAGS.batch)


def memory_floor(params, step_seconds: float, roofline: float, step_flops: float):
  """What the step's parameter traffic costs at least, measured in this run: an SGD step reads
  every weight for the forward pass and again for the input gradients, writes its gradient,
  and the update reads both and writes the weight (6 passes over the parameters, whatever the
  batch); timed as streaming y = x * a + y over arrays of the parameters' size. Beside it, the
  step's FLOPs at the float32 matmul roofline."""
  n = sum(x.size for x in jax.tree.leaves(params))
  x, y = jnp.ones(n, jnp.float32), jnp.ones(n, jnp.float32)
  axpy = jax.jit(lambda x, y: x * 0.5 + y)
  axpy(x, y).block_until_ready()
  t = bench.best_time(lambda: axpy(x, y).block_until_ready(), 20)
  rate = 3 * 4 * n / t  # bytes a second: two reads and a write
  floor = 6 * 4 * n / rate
  at_roofline = step_flops / roofline
  print(f'parameters {n / 1e6:.2f} M ({4 * n / 1e6:.1f} MB); streaming over them {rate / 1e9:.0f} '
        f'GB/s, so their 6 passes a step take at least {floor * 1e3:.2f} ms '
        f'({floor / step_seconds:.0%} of the step); the step\'s {step_flops / 1e9:.2f} GFLOP at the '
        f'roofline ({roofline / 1e9:.0f} GFLOP/s) take {at_roofline * 1e3:.2f} ms '
        f'({at_roofline / step_seconds:.0%}); the step runs at '
        f'{step_flops / step_seconds / 1e9:.0f} GFLOP/s, {step_flops / step_seconds / roofline:.0%} '
        'of the roofline')


if __name__ == '__main__':
  app.run(main)
