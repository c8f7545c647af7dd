"""The everyday run's sample of a table of cases, and what CI runs besides.

A test marked ``sampled`` is a product of parameters; without ``--cases``
the run keeps a sample with each value of each parameter, ``--cases rest``
only what the sample leaves out and ``--cases all`` everything
(``tests/conftest.py``). CI runs every case. Runs keep XLA's compiled
programs in a cache in the checkout, cut to a size bound.
"""

import itertools
import os
import types
import warnings

import pytest
from docs_blocks import ROOT

import conftest


def test_the_sample_keeps_each_value_once_where_it_can():
  square = list(itertools.product(range(4), range(4)))
  assert conftest.sample(square) == [(0, 0), (1, 1), (2, 2), (3, 3)]
  table = list(itertools.product(range(2), range(5), range(3)))
  kept = conftest.sample(table)
  assert len(kept) == 5 and len(set(kept)) == 5
  for axis, n in enumerate((2, 5, 3)):
    assert {case[axis] for case in kept} == set(range(n))
  # a table with holes (cases skipped or left out of the product) is covered
  holes = [(0, 0), (0, 1), (1, 0), (2, 2)]
  kept = conftest.sample(holes)
  assert {c[0] for c in kept} == {0, 1, 2} and {c[1] for c in kept} == {0, 1, 2}
  assert conftest.sample([(0,), (1,), (2,)]) == [(0,), (1,), (2,)]  # one axis: all


VALUES = (object(), object(), object())  # parameter values, matched by identity


class _Item:
  def __init__(self, name, params=None, sampled=True):
    self.path, self.originalname, self.name = "t.py", name, name
    if params is not None:
      self.callspec = types.SimpleNamespace(params=params)
    self._sampled = sampled and params is not None

  def get_closest_marker(self, name):
    return object() if name == "sampled" and self._sampled else None


def _select(cases):
  deselected = []
  config = types.SimpleNamespace(
    getoption=lambda name: cases,
    hook=types.SimpleNamespace(
      pytest_deselected=lambda items: deselected.extend(items)
    ),
  )
  a, b, c = VALUES
  table = [
    _Item("test_table", {"x": x, "y": y})
    for x, y in itertools.product((a, b, c), (1, 2))
  ]
  plain = [_Item("test_plain"), _Item("test_unmarked", {"x": a}, sampled=False)]
  items = plain + table
  conftest.pytest_collection_modifyitems(config, items)
  assert {id(i) for i in items} | {id(i) for i in deselected} == {
    id(i) for i in plain + table
  }
  assert not {id(i) for i in items} & {id(i) for i in deselected}
  return items, table, plain


def test_sample_rest_and_all_split_the_run():
  sample, table, plain = _select("sample")
  rest, _, _ = _select("rest")
  every, _, _ = _select("all")
  assert len(every) == 8
  kept = [i for i in sample if i in table]
  assert len(kept) == 3  # (a, 1), (b, 2), (c, 1): each value of x and of y
  assert {i.callspec.params["y"] for i in kept} == {1, 2}
  assert all(i in sample for i in plain)  # what is not a table always runs
  assert len(rest) == 3 and not any(
    i.name in ("test_plain", "test_unmarked") for i in rest
  )
  names = lambda items: sorted(
    str(i.callspec.params) for i in items if i.name == "test_table"
  )  # noqa: E731
  assert sorted(names(kept) + names(rest)) == names(table) == names(every)


def test_ci_runs_every_case():
  """Every pytest run of CI takes every case of the sampled tables: with
  ``--cases all``, or over files without such tables."""
  lines = [x.strip() for x in (ROOT / ".ci" / "run").read_text().splitlines()]
  runs = [x for x in lines if x.startswith("suite ") and "-m pytest" in x]
  assert any('-m "not integration" --cases all' in x for x in runs), runs
  for x in runs:
    if "--cases all" in x:
      continue
    if "-m integration" in x:
      continue  # no integration test is sampled (the next test)
    paths = [ROOT / p.split("::")[0] for p in x.split() if p.startswith("tests/")]
    assert paths, f"{x}: samples the whole suite"
    files = [f for p in paths for f in ([p] if p.is_file() else p.rglob("test_*.py"))]
    assert files and not [f for f in files if "mark.sampled" in f.read_text()], x


def test_an_integration_test_is_never_sampled():
  item = _Item("test_both", {"x": VALUES[0]})
  item.get_closest_marker = lambda name: object()  # sampled and integration
  item.nodeid = "t.py::test_both"
  for cases in ("sample", "rest", "all"):
    config = types.SimpleNamespace(getoption=lambda name, c=cases: c)
    with pytest.raises(pytest.UsageError, match="integration suite is not sampled"):
      conftest.pytest_collection_modifyitems(config, [item])


def test_runs_keep_their_compilation_cache_in_the_checkout(monkeypatch, tmp_path):
  import jax

  updates = {}
  monkeypatch.setattr(jax.config, "update", updates.__setitem__)
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
  config = types.SimpleNamespace(rootpath=ROOT, addinivalue_line=lambda *a: None)
  conftest.pytest_configure(config)  # the first process: pytest-xdist's controller
  cache = str(ROOT / ".jax_cache")
  assert os.environ["JAX_COMPILATION_CACHE_DIR"] == cache  # for workers, processes
  assert updates["jax_compilation_cache_dir"] == cache
  assert ".jax_cache/" in (ROOT / ".gitignore").read_text().splitlines()
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path))  # your own
  conftest.pytest_configure(config)
  assert updates["jax_compilation_cache_dir"] == str(tmp_path)


def test_the_cache_loses_its_entries_written_longest_ago_down_to_its_bound(tmp_path):
  sizes = {"a": 300, "b": 200, "c": 400, "d": 100}  # written in this order
  for age, (name, size) in enumerate(sizes.items()):
    (tmp_path / name).write_bytes(b"x" * size)
    os.utime(tmp_path / name, (1000 + age, 1000 + age))
  conftest.prune(str(tmp_path), 1000)  # all of it: nothing goes
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c", "d"]
  conftest.prune(str(tmp_path), 650)  # a and b go: c and d are 500
  assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "d"]
  conftest.prune(str(tmp_path), 0)
  assert not list(tmp_path.iterdir())
  conftest.prune(str(tmp_path / "none"), 0)  # no cache yet: nothing to do


def test_an_entry_a_killed_run_left_half_written_is_compiled_again():
  import inspect

  from jax._src import compiler

  # JAX's words when it cannot read an entry (then it compiles the program)
  words = "Error reading persistent compilation cache entry for "
  assert words in inspect.getsource(compiler)
  # not an error, though warnings are errors here (pyproject.toml)
  warnings.warn(
    words + "'jit_f': error: Error -5 while decompressing data: incomplete or "
    "truncated stream",
    UserWarning,
    stacklevel=1,
  )
