"""The import graph: subsystems in layers, each importing only those below it.

From the bottom: ``_base`` (pytree, dtype, argument, jaxpr, rounding and
generic optimizer-state helpers); side by side over it, not importing each
other, the loss scale (``_loss_scale``), the low-precision parameters
(``_params``) and the low-bit matmuls (``_lowbit``); autocast
(``_autocast``, whose recipes run the low-bit matmuls); and on top the
public modules: the package itself, ``optax_lossscale.flax`` and the
porting package. Read from the sources (``import optax_lossscale``
itself imports every module, so only the source says which module needs
which).
"""

import ast
import functools
import pathlib

import optax
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

# The subsystems and their levels from the bottom: a module may import its
# own subsystem and those of lower levels; subsystems of one level (siblings)
# do not import each other.
LEVELS = {"_base": 0, "_loss_scale": 1, "_params": 1, "_lowbit": 1, "_autocast": 2}
LAYERS = tuple(LEVELS)
TOP = max(LEVELS.values()) + 1


def _subsystem(module: str) -> str | None:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 and parts[1] in LEVELS else None


def _layer(module: str) -> int:
  sub = _subsystem(module)
  return TOP if sub is None else LEVELS[sub]


CORE = sorted(m for m in GRAPH if m != "optax_lossscale" and not m.startswith(PORTING))


def _reaches_porting(deps: set[str]) -> list[str]:
  return sorted(d for d in deps if d == PORTING or d.startswith(PORTING + "."))


def test_the_graph_was_read():
  # The scan sees the modules the package is made of (a scan that found
  # nothing would pass every test below).
  assert {
    "optax_lossscale._loss_scale.core",
    "optax_lossscale._loss_scale.transform",
  } <= set(CORE)
  assert "optax_lossscale.porting._keras" in GRAPH
  assert _reaches_porting(GRAPH["optax_lossscale"])  # the re-exports


@pytest.mark.parametrize("module", CORE)
def test_no_core_module_imports_the_porting_package(module):
  assert not _reaches_porting(GRAPH[module]), (
    f"{module} imports the porting package: the core must not depend on the "
    "TensorFlow/Keras surface built on top of it."
  )


def test_every_module_is_in_a_layer_or_public():
  # A private module outside the subsystems' packages would escape the
  # direction test below (it would count as the top layer).
  for m in GRAPH:
    parts = m.split(".")
    if len(parts) > 1 and parts[1].startswith("_"):
      assert parts[1] in LAYERS, f"{m} is in no layer: {LAYERS}"
  for layer in LAYERS:
    assert f"optax_lossscale.{layer}" in GRAPH, f"{layer} has no __init__"
    assert sum(_subsystem(m) == layer for m in CORE) > 1, layer


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_run_down_the_layers(module):
  up = sorted(d for d in GRAPH[module] if d in GRAPH and _layer(d) > _layer(module))
  assert not up, (
    f"{module} (layer {_layer(module)}) imports {up} from a layer above it: "
    f"the levels from the bottom are {LEVELS}, then the public modules."
  )


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_siblings_do_not_import_each_other(module):
  # the loss scale, the parameter tools and the low-bit matmuls stand side
  # by side over _base: what two of them share lives in _base
  sub = _subsystem(module)
  sideways = sorted(
    d
    for d in GRAPH[module]
    if d in GRAPH
    and sub is not None
    and _subsystem(d) not in (None, sub)
    and _layer(d) == _layer(module)
  )
  assert not sideways, f"{module} imports its siblings' {sideways}"


def test_the_sibling_test_can_fail(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text("from optax_lossscale._loss_scale import search as _s\n")
  (dep,) = _imports(bad)
  assert _subsystem(dep) == "_loss_scale" and _layer(dep) == LEVELS["_params"]


def test_the_direction_test_sees_an_upward_import(tmp_path):
  # The check above, on a module that imports against the direction.
  bad = tmp_path / "bad.py"
  bad.write_text("from optax_lossscale._autocast import transform as _t\n")
  deps = _imports(bad)
  assert "optax_lossscale._autocast.transform" in deps
  assert max(_layer(d) for d in deps) > _layer("optax_lossscale._loss_scale.core")


def test_the_base_helpers_import_no_package_module_above_them():
  for m in GRAPH:
    if _layer(m) == 0:
      deps = {d for d in GRAPH[m] if d in GRAPH and _layer(d) != 0}
      assert not deps, (m, deps)


def _private_names_from_elsewhere(path: pathlib.Path) -> list[str]:
  """Underscore names ``path`` takes from another package module.

  ``from m import _x`` where ``_x`` is not a module, and ``alias._x`` on a
  module imported from the package. (A package's own private modules, such
  as the porting package's, are modules, not names.)
  """
  tree = ast.parse(path.read_text())
  aliases, out = set(), []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
      "optax_lossscale"
    ):
      for a in node.names:
        if f"{node.module}.{a.name}" in MODULES:
          aliases.add(a.asname or a.name)
        elif a.name.startswith("_") and not a.name.startswith("__"):
          out.append(f"from {node.module} import {a.name}")
  for node in ast.walk(tree):
    if (
      isinstance(node, ast.Attribute)
      and isinstance(node.value, ast.Name)
      and node.value.id in aliases
      and node.attr.startswith("_")
      and not node.attr.startswith("__")
    ):
      out.append(f"{node.value.id}.{node.attr} (line {node.lineno})")
  return out


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_is_taken_from_another_module(module):
  taken = _private_names_from_elsewhere(MODULES[module])
  assert not taken, f"{module} uses another module's private names: {taken}"


def test_the_private_name_check_sees_both_forms(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text(
    "from optax_lossscale._params.low_precision import _helper\n"
    "from optax_lossscale._base import tree as _tree\n"
    "_tree._hidden(1)\n"
  )
  assert len(_private_names_from_elsewhere(bad)) == 2


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


#: The general helpers the porting package holds, exported at the top too.
GENERAL = {
  "EmaParamsState",
  "ema_params",
  "get_ema_params",
  "get_learning_rate",
  "set_learning_rate",
}


def test_the_tensorflow_names_are_the_porting_packages_and_the_old_ones_warn():
  assert GENERAL <= set(porting.__all__)
  for name in porting.__all__:
    if name in GENERAL:  # one namespace per audience: these are everyone's
      assert getattr(ols, name) is getattr(porting, name), name
      assert name in ols.__all__, name
      continue
    assert name not in ols.__all__, name
    assert name not in vars(ols), name  # resolved only by the deprecation
    with pytest.warns(DeprecationWarning, match=f"optax_lossscale.porting.{name}"):
      assert getattr(ols, name) is getattr(porting, name), name
  with pytest.warns(DeprecationWarning, match="porting.LossScaleOptimizer"):
    from optax_lossscale import LossScaleOptimizer  # noqa: F401
  with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
    ols.NoSuchName  # noqa: B018


def test_a_renamed_name_warns_and_is_the_new_one():
  # The transformation quantize_state returns, beside its state QuantizedState.
  assert "StateQuantizer" in ols.__all__ and "QuantizeState" not in ols.__all__
  assert "QuantizeState" not in vars(ols)
  tx = ols.quantize_state(optax.adam(1e-3))
  assert isinstance(tx, ols.StateQuantizer)
  with pytest.warns(DeprecationWarning, match="optax_lossscale.StateQuantizer"):
    assert ols.QuantizeState is ols.StateQuantizer
  with pytest.warns(DeprecationWarning, match="StateQuantizer"):
    from optax_lossscale import QuantizeState  # noqa: F401


def test_a_loss_scale_object_is_found_by_the_state_search():
  ls = ols.porting.DynamicLossScale(initial_scale=8.0)
  found = ols.find_loss_scale_state({"a": [ls]})
  assert type(found) is ols.LossScaleState
  assert float(found.loss_scale) == 8.0 == float(ols.get_scale(ls))
  with pytest.raises(ValueError, match="Found 2 loss-scale states"):
    ols.get_scale([ls, ols.porting.StaticLossScale(2.0)])


def test_the_development_page_names_every_module():
  page = (ROOT.parent / "docs" / "development.md").read_text()
  missing = [
    str(p.relative_to(ROOT))
    for p in MODULES.values()
    if p.name != "__init__.py" and p.name not in page
  ]
  assert not missing, f"docs/development.md does not name {missing}"
  for layer in LAYERS:
    assert f"`{layer}/" in page or f"  {layer}" in page, layer
