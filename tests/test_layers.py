"""The import graph: the porting package sits above a core that never imports it.

Read from the sources (``import optax_lossscale`` itself imports every
module, so only the source says which module needs which).
"""

import ast
import functools
import pathlib

import pytest

import optax_lossscale as ols
import optax_lossscale.porting as porting

ROOT = pathlib.Path(ols.__file__).parent
PORTING = "optax_lossscale.porting"


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(path: pathlib.Path) -> set[str]:
  """The package modules ``path`` imports (``from optax_lossscale import _x`` too)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
      "optax_lossscale"
    ):
      for a in node.names:  # a submodule, or a name the module defines
        sub = f"{node.module}.{a.name}"
        out.add(sub if sub in MODULES else node.module)
    elif isinstance(node, ast.Import):
      out.update(a.name for a in node.names if a.name.startswith("optax_lossscale"))
  return out


GRAPH = {name: _imports(path) for name, path in MODULES.items()}
CORE = sorted(m for m in GRAPH if m != "optax_lossscale" and not m.startswith(PORTING))


def _reaches_porting(deps: set[str]) -> list[str]:
  return sorted(d for d in deps if d == PORTING or d.startswith(PORTING + "."))


def test_the_graph_was_read():
  # The scan sees the modules the package is made of (a scan that found
  # nothing would pass every test below).
  assert {"optax_lossscale._core", "optax_lossscale._transform"} <= set(CORE)
  assert "optax_lossscale.porting._keras" in GRAPH
  assert _reaches_porting(GRAPH["optax_lossscale"])  # the re-exports


@pytest.mark.parametrize("module", CORE)
def test_no_core_module_imports_the_porting_package(module):
  assert not _reaches_porting(GRAPH[module]), (
    f"{module} imports the porting package: the core must not depend on the "
    "TensorFlow/Keras surface built on top of it."
  )


def test_the_tree_utilities_are_at_the_bottom():
  deps = {d for d in GRAPH["optax_lossscale._tree"] if d in GRAPH}
  assert not deps, deps


def test_the_core_graph_has_no_cycle():
  modules = set(GRAPH)

  @functools.cache
  def floor(m, seen=()):
    assert m not in seen, f"import cycle: {' -> '.join((*seen, m))}"
    deps = {d for d in GRAPH[m] if d in modules and d != m}
    return 1 + max((floor(d, (*seen, m)) for d in deps), default=0)

  floors = {m: floor(m) for m in CORE}
  # The porting package is above every core module it uses.
  for m in GRAPH:
    if m.startswith(PORTING + "."):
      for d in GRAPH[m]:
        if d in floors:
          assert floor(m) > floors[d], (m, d)


def test_every_porting_name_is_reexported_at_the_top():
  for name in porting.__all__:
    assert getattr(ols, name) is getattr(porting, name), name
    assert name in ols.__all__, name


def test_a_loss_scale_object_is_found_by_the_state_search():
  ls = ols.DynamicLossScale(initial_scale=8.0)
  found = ols.find_loss_scale_state({"a": [ls]})
  assert type(found) is ols.LossScaleState
  assert float(found.loss_scale) == 8.0 == float(ols.get_scale(ls))
  with pytest.raises(ValueError, match="Found 2 loss-scale states"):
    ols.get_scale([ls, ols.StaticLossScale(2.0)])
