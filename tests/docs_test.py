"""The documentation's links: every relative link in README.md and docs/*.md names a file of the
repository (and, with a #fragment, a heading of it), and no page sends readers outside the
repository (a clone has no ../shared); the pages under docs/ (the runs' READMEs) are checked too.
The README is an entry point: short, with a link to every page of docs/; the variants it names
are documented in docs/configuration.md, every one of them; and the layers that
docs/architecture.md and the package docstring list are those tests/layers_test.py checks."""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted([os.path.join(ROOT, 'README.md'),
                *glob.glob(os.path.join(ROOT, 'docs', '**', '*.md'), recursive=True)])
LINK = re.compile(r'\[[^\]]*\]\(([^)\s]+)\)')


def outside_fences(text):
  """The lines outside fenced code blocks."""
  fenced = False
  for line in text.split('\n'):
    if line.lstrip().startswith('```'):
      fenced = not fenced
    elif not fenced:
      yield line


def anchors(path):
  """The fragments GitHub gives the headings of a Markdown file."""
  seen, out = {}, set()
  with open(path, encoding='utf-8') as f:
    for line in outside_fences(f.read()):
      m = re.match(r'#{1,6} (.*)', line.replace('`', ''))
      if not m:
        continue
      slug = re.sub(r'[^\w\- ]', '', m.group(1).strip().lower()).replace(' ', '-')
      n = seen.get(slug, 0)
      seen[slug] = n + 1
      out.add(slug if n == 0 else f'{slug}-{n}')
  return out


def links(path):
  with open(path, encoding='utf-8') as f:
    for line in outside_fences(f.read()):
      yield from LINK.findall(re.sub(r'`[^`]*`', '', line))


@pytest.mark.parametrize('page', PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(page):
  broken = []
  for target in links(page):
    if re.match(r'[a-z]+:', target):  # http:, https:, mailto:
      continue
    path, _, fragment = target.partition('#')
    dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
    if os.path.relpath(dest, ROOT).split(os.sep)[0] == '..':
      broken.append(f'{target} (outside the repository)')
    elif not os.path.exists(dest):
      broken.append(f'{target} (no such file)')
    elif fragment and dest.endswith('.md') and fragment not in anchors(dest):
      broken.append(f'{target} (no such heading)')
  assert not broken, f'{os.path.relpath(page, ROOT)}: {broken}'


@pytest.mark.parametrize('page', PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_no_page_points_outside_the_repository(page):
  with open(page, encoding='utf-8') as f:
    text = f.read()
  assert '../shared' not in text and 'shared/spec' not in text, os.path.relpath(page, ROOT)


@pytest.mark.parametrize('page', PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_commands_name_real_modules(page):
  """Every `python -m fedssa_jax...` a page gives (in code blocks too) names a module of the
  package, so a reader who copies the command does not meet 'No module named ...'."""
  with open(page, encoding='utf-8') as f:
    modules = re.findall(r'python3? -m (fedssa_jax(?:\.\w+)*)', f.read())
  missing = [m for m in modules
             if not os.path.exists(os.path.join(ROOT, *m.split('.')) + '.py')
             and not os.path.exists(os.path.join(ROOT, *m.split('.'), '__init__.py'))]
  assert not missing, f'{os.path.relpath(page, ROOT)}: no such module {sorted(set(missing))}'


def test_readme_is_an_entry_point():
  """README.md stays short (at most 13 kB) and links every page of docs/: the detail lives
  there, and a reader finds each page from the README's map."""
  path = os.path.join(ROOT, 'README.md')
  assert os.path.getsize(path) <= 13_000, f'README.md is {os.path.getsize(path)} bytes'
  linked = {os.path.normpath(t.partition('#')[0]) for t in links(path)}
  pages = {os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, 'docs', '*.md'))}
  assert not pages - linked, f'README.md does not link {sorted(pages - linked)}'


def test_every_variant_is_documented():
  """Every variant config_lib.apply_variant knows has its row in configuration.md's table of
  variants (the table the README points to)."""
  from fedssa_jax import config_lib  # pylint: disable=import-outside-toplevel
  try:
    config_lib.apply_variant(config_lib.base_config('cifar10'), 'no-such-variant')
  except ValueError as e:
    known = re.search(r'known: (.*)\.$', str(e)).group(1).split(', ')
  with open(os.path.join(ROOT, 'docs', 'configuration.md'), encoding='utf-8') as f:
    text = f.read()
  table = text[text.index('## Variants'):].split('\n## ')[0]
  rows = [line for line in table.split('\n') if line.startswith('| `')]
  documented = {v for line in rows for v in re.findall(r'`(\w+)`', line.split(' | ')[0])}
  assert len(known) > 10 and not set(known) - documented, sorted(set(known) - documented)


def test_layer_lists_follow_the_checker():
  """docs/architecture.md and the package docstring list the layers that tests/layers_test.py
  checks, in its order."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location(
      'layers_test', os.path.join(ROOT, 'tests', 'layers_test.py'))
  checker = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(checker)
  want = [sorted(names) for names in checker.LAYERS]
  with open(os.path.join(ROOT, 'docs', 'architecture.md'), encoding='utf-8') as f:
    text = f.read()
  order = re.search(r'`tests/layers_test.py` checks it[^:]*: (.*?)\.\n', text, re.S).group(1)
  assert [sorted(re.findall(r'`(\w+)/?`', part)) for part in re.split(r'\s+<\s+', order)] == want, order
  with open(os.path.join(ROOT, 'fedssa_jax', '__init__.py'), encoding='utf-8') as f:
    doc = f.read().split('"""')[1]
  rows = re.findall(r'^    (\w[\w, ]*?)\s{2,}', doc, re.M)
  assert [sorted(r.split(', ')) for r in rows] == want, rows
