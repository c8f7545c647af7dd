"""Flax's serialization of the package's own state classes, Flax never imported for it.

``flax.serialization`` (``to_bytes``, ``to_state_dict``, what Flax's
checkpoints and a ``TrainState`` use) saves the pytree classes registered
with it and cannot save any other. :func:`register` registers one of ours
(the non-finite record, a quantised moment): at once when Flax's
serialization is already loaded, and otherwise when Flax loads it (an
import hook, :class:`_OnFlaxSerialization`), so that whatever the order of
the imports a state can be saved, and Flax is never imported for it. Its
arrays are saved by field name; its static metadata comes from the
restore target.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import sys
from typing import Any

__all__ = ["register"]

#: ``{class: its array fields}`` to register with Flax's serialization.
_CLASSES: dict[type, tuple[str, ...]] = {}
#: The classes registered with it so far.
_DONE: set[type] = set()


def register(cls: type, fields: tuple[str, ...]) -> None:
  """Lets ``flax.serialization`` save and restore the dataclass ``cls``.

  ``fields`` are its array fields, saved by name; its other fields are
  taken from the restore target (``from_bytes(target, ...)``). Registered
  now if Flax's serialization is loaded, else when it is.
  """
  _CLASSES[cls] = tuple(fields)
  if "flax.serialization" in sys.modules:
    _register_all()
  elif not any(isinstance(f, _OnFlaxSerialization) for f in sys.meta_path):
    sys.meta_path.insert(0, _OnFlaxSerialization())


def _register_all() -> None:
  from flax import serialization

  for cls, fields in _CLASSES.items():
    if cls in _DONE:
      continue

    def to_state(x: Any, fields: tuple[str, ...] = fields) -> dict[str, Any]:
      return {f: serialization.to_state_dict(getattr(x, f)) for f in fields}

    def from_state(target: Any, state: Any, fields: tuple[str, ...] = fields) -> Any:
      return dataclasses.replace(
        target,
        **{
          f: serialization.from_state_dict(getattr(target, f), state[f], name=f)
          for f in fields
        },
      )

    serialization.register_serialization_state(cls, to_state, from_state, override=True)
    _DONE.add(cls)


class _OnFlaxSerialization(importlib.abc.MetaPathFinder):
  """An import hook: when ``flax.serialization`` is loaded, registers the
  classes with it (:func:`_register_all`), then removes itself."""

  def find_spec(self, name, path, target=None):
    if name != "flax.serialization":
      return None
    for finder in sys.meta_path:
      if finder is self or not hasattr(finder, "find_spec"):
        continue
      spec = finder.find_spec(name, path, target)
      if spec is not None:
        break
    else:
      return None
    loader = spec.loader
    run = getattr(loader, "exec_module", None)
    if run is None:
      return None

    def exec_module(module):
      run(module)
      if self in sys.meta_path:
        sys.meta_path.remove(self)
      _register_all()

    loader.exec_module = exec_module
    return spec
