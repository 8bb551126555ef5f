"""The package's code keeps its shape: no function over MAX_FUNCTION_LINES lines, no module over
MAX_MODULE_LINES lines (the model zoo's transcribed tables apart), JAX's internals reached from
one documented place, and a population store's name read in the store registry alone (the rest
of the package asks a store what it can do).

Each check is an `ast` scan of the package's sources, tried first on a small made-up source, so
that a check that finds nothing is known to be able to find something.
"""
import ast
import os

import pytest

from fedssa_jax import config_lib
from fedssa_jax.engine import parts, population

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MAX_FUNCTION_LINES = 80   # a function's lines, from `def` to its end, nested functions included
MAX_MODULE_LINES = 500
LONG_MODULES = {'fedssa_jax/models/zoo.py'}  # HtFLlib's model definitions, transcribed
# The one place that reaches into jax._src, and why (its docstring): {module: {function}}.
JAX_INTERNALS = {'fedssa_jax/engine/distributed.py': {'_coordination_client'}}
STORE_REGISTRY = 'fedssa_jax/engine/population.py'

FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def package_sources() -> dict[str, str]:
  """{path from the repository's root: text} of every module of the package."""
  out = {}
  for folder, _, files in os.walk(os.path.join(REPO, 'fedssa_jax')):
    for f in files:
      if f.endswith('.py'):
        path = os.path.join(folder, f)
        out[os.path.relpath(path, REPO).replace(os.sep, '/')] = open(path).read()
  return out


def functions(tree) -> list[tuple[ast.AST, list[str]]]:
  """Every function of a module, nested ones too, with the names of the functions (and classes)
  it is in, outermost first."""
  out = []

  def visit(node, scope):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, FUNCTIONS):
        out.append((child, scope))
      inner = scope + [child.name] if isinstance(child, FUNCTIONS + (ast.ClassDef,)) else scope
      visit(child, inner)
  visit(tree, [])
  return out


# ----------------------------------------------------------------------------------------------
# The scans
# ----------------------------------------------------------------------------------------------

def long_functions(sources: dict[str, str], limit: int = MAX_FUNCTION_LINES) -> list[str]:
  """'path:line name (n lines)' of every function longer than `limit`, nested ones checked as
  functions of their own (and counted in the function around them)."""
  found = []
  for path, text in sources.items():
    for node, scope in functions(ast.parse(text, path)):
      n = node.end_lineno - node.lineno + 1
      if n > limit:
        found.append(f'{path}:{node.lineno} {".".join(scope + [node.name])} ({n} lines)')
  return sorted(found)


def long_modules(sources: dict[str, str], limit: int = MAX_MODULE_LINES,
                 exempt=frozenset(LONG_MODULES)) -> list[str]:
  """'path (n lines)' of every module longer than `limit`, but those `exempt`."""
  return sorted(f'{path} ({len(text.splitlines())} lines)' for path, text in sources.items()
                if len(text.splitlines()) > limit and path not in exempt)


def _is_jax_internal(name: str) -> bool:
  return name == 'jax._src' or name.startswith('jax._src.')


def jax_internal_uses(sources: dict[str, str]) -> list[tuple[str, str, int]]:
  """(path, the function it is in or '', line) of every import from jax._src and every
  `jax._src` attribute."""
  found = []
  for path, text in sources.items():
    tree = ast.parse(text, path)
    where = {}  # node: the innermost function around it
    for fn, _ in functions(tree):
      for node in ast.walk(fn):
        where[node] = fn.name  # inner functions come later in the list: they win
    for node in ast.walk(tree):
      hit = (isinstance(node, ast.Import) and any(_is_jax_internal(a.name) for a in node.names)
             or isinstance(node, ast.ImportFrom) and _is_jax_internal(node.module or '')
             or isinstance(node, ast.ImportFrom) and node.module == 'jax'
             and any(a.name == '_src' for a in node.names)
             or isinstance(node, ast.Attribute) and node.attr == '_src'
             and isinstance(node.value, ast.Name) and node.value.id == 'jax')
      if hit:
        found.append((path, where.get(node, ''), node.lineno))
  return sorted(found)


def _names_a_store(node) -> bool:
  """Whether an expression is named like a store: `store`, `config.population_store`,
  `c['population_store']`, `held.store`."""
  if isinstance(node, ast.Name):
    return 'store' in node.id.lower()
  if isinstance(node, ast.Attribute):
    return 'store' in node.attr.lower()
  if isinstance(node, ast.Subscript):
    key = node.slice
    return (isinstance(key, ast.Constant) and isinstance(key.value, str)
            and 'store' in key.value.lower()) or _names_a_store(node.value)
  return False


def _store_names_in(node, names) -> bool:
  """Whether an expression is a store's name, or a tuple, list or set holding one."""
  if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
    return any(_store_names_in(e, names) for e in node.elts)
  return isinstance(node, ast.Constant) and node.value in names


def store_name_comparisons(sources: dict[str, str], names,
                           registry: str = STORE_REGISTRY) -> list[str]:
  """'path:line' of every comparison of something named like a store with a store's name
  (`config.population_store != 'device'`, `store in ('host', 'disk')`), outside `registry`."""
  found = []
  for path, text in sources.items():
    if path == registry:
      continue
    for node in ast.walk(ast.parse(text, path)):
      if isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
        if (any(_names_a_store(o) for o in operands)
            and any(_store_names_in(o, names) for o in operands)):
          found.append(f'{path}:{node.lineno}')
  return sorted(found)


# ----------------------------------------------------------------------------------------------
# The scans, on made-up sources
# ----------------------------------------------------------------------------------------------

def _function(name: str, lines: int, indent: str = '') -> str:
  """A function of `lines` lines."""
  body = ''.join(f'{indent}  x{i} = {i}\n' for i in range(lines - 2))
  return f'{indent}def {name}():\n{body}{indent}  return 0\n'


def test_the_long_function_scan_finds_them_nested_too():
  nested = ('def outer():\n' + _function('inner', 81, '  ') + '  return inner\n')
  sources = {'pkg/a.py': _function('fits', 80) + _function('over', 81),
             'pkg/b.py': 'class C:\n' + _function('method', 90, '  '),
             'pkg/c.py': nested}
  assert long_functions(sources) == ['pkg/a.py:81 over (81 lines)',
                                     'pkg/b.py:2 C.method (90 lines)',
                                     'pkg/c.py:1 outer (83 lines)',
                                     'pkg/c.py:2 outer.inner (81 lines)']


def test_the_long_module_scan_finds_them_and_spares_the_exempt():
  sources = {'pkg/fits.py': 'x = 0\n' * 500, 'pkg/over.py': 'x = 0\n' * 501,
             'pkg/tables.py': 'x = 0\n' * 900}
  assert long_modules(sources, exempt={'pkg/tables.py'}) == ['pkg/over.py (501 lines)']


def test_the_jax_internals_scan_finds_every_way_in():
  sources = {'pkg/a.py': 'from jax._src import core\nimport jax._src.distributed\n'
                         'import jax\nx = jax._src.config\nfrom jax import _src\n'
                         'from jax import numpy, experimental\nimport jax.numpy\n',
             'pkg/b.py': 'def client():\n'
                         '  def inner():\n'
                         '    from jax._src import distributed\n'
                         '  return inner\n'}
  assert jax_internal_uses(sources) == [('pkg/a.py', '', 1), ('pkg/a.py', '', 2),
                                        ('pkg/a.py', '', 4), ('pkg/a.py', '', 5),
                                        ('pkg/b.py', 'inner', 3)]


def test_the_store_name_scan_finds_comparisons_outside_the_registry():
  source = ("if config.population_store != 'device': pass\n"
            "if store in ('host', 'disk'): pass\n"
            "if 'disk' == c['population_store']: pass\n"
            "if held.store == 'host' or phase == 'host': pass\n"
            "if self.store is None and kind == 'device': pass\n"
            "if config.population_store == 'tape': pass\n")
  names = {'device', 'host', 'disk'}
  assert store_name_comparisons({'pkg/a.py': source, 'pkg/registry.py': source}, names,
                                registry='pkg/registry.py') == [
      'pkg/a.py:1', 'pkg/a.py:2', 'pkg/a.py:3', 'pkg/a.py:4']


# ----------------------------------------------------------------------------------------------
# The package
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def sources():
  return package_sources()


def test_no_function_is_over_the_limit(sources):
  long = long_functions(sources)
  assert not long, (f'Functions over {MAX_FUNCTION_LINES} lines: {long}. Split each into '
                    'named parts.')


def test_no_module_is_over_the_limit(sources):
  long = long_modules(sources)
  assert not long, (f'Modules over {MAX_MODULE_LINES} lines: {long}. Split each (a package of '
                    'modules, or a module for a part), or, for transcribed tables, add it to '
                    'LONG_MODULES saying why.')


def test_jax_internals_are_reached_from_one_documented_place(sources):
  uses = jax_internal_uses(sources)
  elsewhere = [u for u in uses if u[1] not in JAX_INTERNALS.get(u[0], set())]
  assert not elsewhere, (f'Imports from jax._src outside {JAX_INTERNALS}: {elsewhere}. Use a '
                         'public JAX API, or go through the function that reaches it now.')
  # Each documented place still reaches in (else drop it from JAX_INTERNALS), and says so.
  for path, names in JAX_INTERNALS.items():
    tree = ast.parse(sources[path], path)
    for name in names:
      assert any(u[:2] == (path, name) for u in uses), f'{path}: {name} no longer uses jax._src'
      fn = next(f for f, _ in functions(tree) if f.name == name)
      assert 'jax._src' in ast.get_docstring(fn), f'{path}: {name} should say it reaches in'


def test_no_store_name_is_compared_outside_the_registry(sources):
  found = store_name_comparisons(sources, set(population.STORES))
  assert not found, (f'Store names compared outside {STORE_REGISTRY}: {found}. Ask the store '
                     'instead: give its class a capability (population.Store) and read it '
                     'through population.store_class(name).')


# ----------------------------------------------------------------------------------------------
# The stores' seam: the registry and the capabilities the package asks
# ----------------------------------------------------------------------------------------------

def test_the_config_takes_the_registry_s_stores():
  assert config_lib.POPULATION_STORES == tuple(population.STORES)
  assert all(population.store_class(n).name == n for n in population.STORES)
  with pytest.raises(config_lib.ConfigError, match=r"choose one of \['device', 'disk', 'host'\]"):
    population.store_class('tape')


def test_a_store_that_cannot_hold_the_run_names_those_that_can(monkeypatch):
  population.DeviceStore._check(2, None)  # packs seeds, and needs no folder
  with pytest.raises(config_lib.ConfigError,
                     match="'host' holds one seed's population; packed seeds need "
                           "population_store='device'."):
    population.HostStore._check(2, '/tmp')
  with pytest.raises(config_lib.ConfigError, match='workdir, or use the device or host store.'):
    population.DiskStore._check(1, None)
  monkeypatch.setattr(population.jax, 'process_count', lambda: 2)
  population.DeviceStore._check(1, None)
  with pytest.raises(config_lib.ConfigError, match="across 2 processes use "
                                                   "population_store='device', which"):
    population.DiskStore._check(1, '/tmp')


def test_a_new_store_is_asked_what_it_can_do_not_its_name(monkeypatch):
  """A store added to the registry that packs seeds is taken for packed seeds, and named as one
  that can when another cannot."""
  tape = type('TapeStore', (population.Store,), {'name': 'tape', 'packs_seeds': True})
  monkeypatch.setitem(population.STORES, 'tape', tape)
  config = config_lib.build('cifar10', 'hetero,tiny')
  config.population_store = 'tape'
  parts.check_seeds(config, [0, 1], [])
  config.population_store = 'host'
  with pytest.raises(config_lib.ConfigError, match="need population_store='device' or "
                                                   "population_store='tape', not 'host'"):
    parts.check_seeds(config, [0, 1], [])
