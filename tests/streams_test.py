"""The run's random streams come from one registry (fedssa_jax/streams.py): no value repeats
within a registry, every stream has exactly one consumer module, and no module of the package
numbers a stream of its own (a literal folded into a key or leading a generator's seed)."""
import ast
import os

import pytest

from fedssa_jax import streams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, 'fedssa_jax')


def package_sources() -> dict[str, str]:
  out = {}
  for folder, _, files in os.walk(PACKAGE):
    for f in files:
      if f.endswith('.py'):
        path = os.path.join(folder, f)
        out[os.path.relpath(path, REPO)] = open(path).read()
  return out


def consumers(sources: dict[str, str]) -> dict[str, set[str]]:
  """{'Stream.TRAIN': {modules that name it as an attribute}} over the package (the registry's
  own module left out)."""
  found = {}
  for path, text in sources.items():
    if path.endswith('streams.py'):
      continue
    for node in ast.walk(ast.parse(text, path)):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id in {r.__name__ for r in streams.REGISTRIES}):
        found.setdefault(f'{node.value.id}.{node.attr}', set()).add(path)
  return found


def literal_streams(sources: dict[str, str]) -> list[str]:
  """Calls that fold a literal integer other than a loop's index into a key
  (jax.random.fold_in(key, 11)) or seed a generator with a list holding one
  (np.random.default_rng([seed, 1, t]))."""
  found = []
  for path, text in sources.items():
    for node in ast.walk(ast.parse(text, path)):
      if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        continue
      args = node.args
      if node.func.attr == 'fold_in' and len(args) == 2 and _is_int(args[1]):
        found.append(f'{path}:{node.lineno}')
      if (node.func.attr == 'default_rng' and args and isinstance(args[0], ast.List)
          and any(_is_int(e) for e in args[0].elts)):
        found.append(f'{path}:{node.lineno}')
  return found


def _is_int(node) -> bool:
  if isinstance(node, ast.BinOp):  # 1 << 17
    return _is_int(node.left) and _is_int(node.right)
  return isinstance(node, ast.Constant) and isinstance(node.value, int)


@pytest.mark.parametrize('registry', streams.REGISTRIES, ids=lambda r: r.__name__)
def test_no_value_repeats_within_a_registry(registry):
  values = [m.value for m in registry]
  assert len(values) == len(set(values)), registry


def test_step_streams_stay_clear_of_the_views():
  # A step's augmentation views fold 1, 2, ... into its key: far below the step streams.
  assert min(streams.StepStream) > 1 << 8
  assert streams.SERVER_UPLOAD_ID > 1 << 24  # beyond any client id


def test_every_stream_has_exactly_one_consumer_module():
  used = consumers(package_sources())
  for registry in streams.REGISTRIES:
    for member in registry:
      name = f'{registry.__name__}.{member.name}'
      assert len(used.get(name, ())) == 1, (
          f'{name} is used by {sorted(used.get(name, ())) or "no module"}: each stream has one '
          'consumer; give a new draw a new member of fedssa_jax/streams.py.')


def test_no_module_numbers_a_stream_of_its_own():
  assert literal_streams(package_sources()) == []


def test_the_checks_can_fail(tmp_path):
  """The scanners find a shared stream and a literal one in sources made to have them."""
  sources = {
      'fedssa_jax/a.py': 'from fedssa_jax.streams import Stream\nk = fold(Stream.TRAIN)\n',
      'fedssa_jax/b.py': ('import jax, numpy as np\nk = Stream.TRAIN\n'
                          'j = jax.random.fold_in(k, 1 << 17)\n'
                          'g = np.random.default_rng([0, 3, t])\n'),
  }
  assert consumers(sources)['Stream.TRAIN'] == {'fedssa_jax/a.py', 'fedssa_jax/b.py'}
  assert literal_streams(sources) == ['fedssa_jax/b.py:3', 'fedssa_jax/b.py:4']
