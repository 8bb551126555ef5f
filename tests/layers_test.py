"""The package's layers: no import cycle, and no import that runs back up the layer order.

Reads every module's imports with `ast` (those inside functions too), as the interpreter would
resolve them, and checks them against LAYERS, the order fedssa_jax/__init__.py and
docs/architecture.md describe. The checker is tested on a small package of its own first, so
that a test that finds nothing is known to be able to find something.
"""
import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Bottom to top: a module may import its own layer's modules and those of the layers below.
LAYERS = (
    ('errors', 'types', 'streams', 'headcount'),
    ('models',),
    ('data',),
    ('methods',),
    ('system', 'privacy'),
    ('config_lib',),
    ('engine',),
    ('run',),
    ('main', 'audit'),
)


def modules(root: str, package: str) -> dict[str, str]:
  """{dotted module name: path} of every module of `package` under `root`."""
  out = {}
  for folder, _, files in os.walk(os.path.join(root, package)):
    for f in files:
      if f.endswith('.py'):
        rel = os.path.relpath(os.path.join(folder, f), root)[:-3].split(os.sep)
        if rel[-1] == '__init__':
          rel = rel[:-1]
        out['.'.join(rel)] = os.path.join(folder, f)
  return out


def imports(path: str, name: str, known: set[str], package: str) -> set[str]:
  """The modules of `package` that the module `name` at `path` imports (`from a import b` is
  a.b where a.b is a module, else a)."""
  tree = ast.parse(open(path).read(), path)
  is_package = path.endswith('__init__.py')
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names if a.name.split('.')[0] == package)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:  # relative: from the module's own package
        parts = name.split('.')[:len(name.split('.')) - node.level + (1 if is_package else 0)]
        base = '.'.join(parts + ([base] if base else []))
      if base.split('.')[0] != package:
        continue
      for a in node.names:
        out.add(f'{base}.{a.name}' if f'{base}.{a.name}' in known else base)
  return {m for m in out if m in known} - {name}


def layer_of(module: str, package: str) -> int:
  parts = module.split('.')
  top = parts[1] if len(parts) > 1 else '__init__'
  if top == '__init__':
    return 0
  for i, names in enumerate(LAYERS):
    if top in names:
      return i
  raise AssertionError(f'{module} is in no layer: add its top-level name to LAYERS (and to '
                       'docs/architecture.md).')


def problems(root: str, package: str) -> list[str]:
  """Every upward import and every import cycle among `package`'s modules, as sentences."""
  mods = modules(root, package)
  graph = {m: imports(p, m, set(mods), package) for m, p in mods.items()}
  found = []
  for m, targets in sorted(graph.items()):
    for t in sorted(targets):
      if layer_of(t, package) > layer_of(m, package):
        found.append(f'{m} imports {t}, a higher layer')
  # Cycles: a depth-first search that reports each back edge's loop.
  state, stack = {}, []

  def visit(m):
    state[m] = 'open'
    stack.append(m)
    for t in sorted(graph[m]):
      if state.get(t) == 'open':
        found.append('cycle: ' + ' -> '.join(stack[stack.index(t):] + [t]))
      elif t not in state:
        visit(t)
    stack.pop()
    state[m] = 'done'

  for m in sorted(graph):
    if m not in state:
      visit(m)
  return found


def test_the_checker_finds_an_upward_import_and_a_cycle(tmp_path):
  pkg = tmp_path / 'pkg'
  for sub in ('models', 'engine'):
    (pkg / sub).mkdir(parents=True)
    (pkg / sub / '__init__.py').write_text('')
  (pkg / '__init__.py').write_text('')
  (pkg / 'errors.py').write_text('')
  (pkg / 'models' / 'cnn.py').write_text('from pkg.engine import sim\n')  # up a layer
  (pkg / 'engine' / 'sim.py').write_text('from pkg.engine import store\nfrom pkg import errors\n')
  (pkg / 'engine' / 'store.py').write_text('def f():\n  from pkg.engine import sim\n')  # a cycle
  found = problems(str(tmp_path), 'pkg')
  assert 'pkg.models.cnn imports pkg.engine.sim, a higher layer' in found
  assert any(f.startswith('cycle: ') and 'pkg.engine.sim' in f and 'pkg.engine.store' in f
             for f in found), found
  assert len(found) == 2, found


def test_no_cycle_and_no_import_up_the_layers():
  found = problems(REPO, 'fedssa_jax')
  assert not found, '\n'.join(found)


@pytest.mark.parametrize('sub', ['models', 'data', 'methods', 'privacy', 'engine', 'run'])
def test_every_sub_package_says_what_it_holds(sub):
  doc = ast.get_docstring(ast.parse(open(os.path.join(REPO, 'fedssa_jax', sub,
                                                      '__init__.py')).read()))
  assert doc and len(doc.split()) >= 20, f'fedssa_jax/{sub}/__init__.py needs its paragraph.'


def test_the_privacy_package_is_one_layer_split_by_job():
  """privacy/ is a package whose modules (its config, mechanisms, DP-SGD's step, the releases
  and the accountants) sit in the privacy layer, beside system, under the engine that calls them; the
  mechanisms and DP-SGD's step import no accountant (host-side state stays apart from what runs
  in a compiled call)."""
  mods = modules(REPO, 'fedssa_jax')
  jobs = {'config', 'mechanisms', 'dp_sgd', 'releases', 'accountants'}
  assert {f'fedssa_jax.privacy.{j}' for j in jobs} <= set(mods)
  privacy_layer = layer_of('fedssa_jax.privacy', 'fedssa_jax')
  assert privacy_layer == layer_of('fedssa_jax.system', 'fedssa_jax')
  assert privacy_layer < layer_of('fedssa_jax.engine.simulator', 'fedssa_jax')
  for job in jobs:
    assert layer_of(f'fedssa_jax.privacy.{job}', 'fedssa_jax') == privacy_layer
  for job in ('mechanisms', 'dp_sgd', 'releases'):
    name = f'fedssa_jax.privacy.{job}'
    assert 'fedssa_jax.privacy.accountants' not in imports(mods[name], name, set(mods),
                                                           'fedssa_jax'), name


def method_imports(root: str, package: str, method_modules: set[str]) -> list[str]:
  """Every import of a method module by another module of `package`.methods but its
  `__init__` (the registry), as sentences: what methods share lives in modules of its own
  (base, losses, aggregation, prototypes, headers), not in one of them."""
  mods = {m: p for m, p in modules(root, package).items() if m.startswith(f'{package}.methods.')}
  found = []
  for m, p in sorted(mods.items()):
    for t in sorted(imports(p, m, set(mods), package) & method_modules):
      found.append(f'{m} imports the method module {t}')
  return found


def test_the_method_import_checker_finds_a_method_importing_another(tmp_path):
  methods_dir = tmp_path / 'pkg' / 'methods'
  methods_dir.mkdir(parents=True)
  (tmp_path / 'pkg' / '__init__.py').write_text('')
  (methods_dir / '__init__.py').write_text('from pkg.methods import a, b\n')  # the registry
  (methods_dir / 'shared.py').write_text('')
  (methods_dir / 'a.py').write_text('from pkg.methods import shared\n')
  (methods_dir / 'b.py').write_text('from pkg.methods import a, shared\n')
  (methods_dir / 'c.py').write_text('def f():\n  import pkg.methods.b\n')
  found = method_imports(str(tmp_path), 'pkg', {'pkg.methods.a', 'pkg.methods.b',
                                                'pkg.methods.c'})
  assert found == ['pkg.methods.b imports the method module pkg.methods.a',
                   'pkg.methods.c imports the method module pkg.methods.b'], found


def test_no_method_module_imports_another():
  from fedssa_jax import methods  # pylint: disable=g-import-not-at-top
  method_modules = {cls.__module__ for cls in methods.METHODS.values()}
  assert len(method_modules) == len(methods.METHODS)  # one module per method
  found = method_imports(REPO, 'fedssa_jax', method_modules)
  assert not found, '\n'.join(found)
