"""autocast's state: the Flax NNX Variables a function writes, carried back.

``autocast`` traces its function and evaluates a rewritten jaxpr, so a
Variable the function writes while traced would hold a value of that trace
only. Every NNX graph node among the arguments (a ``Module``, ``Rngs``, a
``Variable``, or ``fun`` itself being a module or one of its methods) is
split into its graph and its state (``nnx.split``, one split for all of
them, so shared Variables stay shared); the state is traced as explicit
inputs, the nodes merged again inside the trace, and their state after
the call returned as explicit outputs and written into the caller's
objects (``nnx.update``), as ``nnx.jit`` does. Flax is never imported
here: without ``flax.nnx`` loaded there are no graph nodes.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Any

import jax

__all__ = ["Hole", "Nodes", "Static", "bound", "find", "nnx_error"]


@dataclasses.dataclass(frozen=True)
class Hole:
  """Where graph node ``index`` stood among the arguments."""

  index: int


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Static:
  """A value carried in a pytree's structure (an output's graph)."""

  value: Any


def _graph():
  return sys.modules.get("flax.nnx.graphlib") or sys.modules.get("flax.nnx.graph")


@dataclasses.dataclass(frozen=True)
class Nodes:
  """The graph nodes of a call: ``objects``, and how the call reaches them.

  Attributes:
    objects: the caller's graph nodes, each once.
    tree: the ``(args, kwargs)`` with a :class:`Hole` for each node.
    owner: the index of the node ``fun`` is (or is a method of), or None.
  """

  objects: tuple
  tree: Any
  owner: int | None

  def split(self):
    """``(graphdef, state)`` of all the nodes together."""
    return sys.modules["flax.nnx"].split(self.objects)

  @staticmethod
  def merge(graphdef, state) -> tuple:
    return sys.modules["flax.nnx"].merge(graphdef, state)

  @staticmethod
  def fill(tree, nodes: tuple):
    """``tree`` with each :class:`Hole` replaced by its node."""
    return jax.tree.map(
      lambda x: nodes[x.index] if isinstance(x, Hole) else x,
      tree,
      is_leaf=lambda x: isinstance(x, Hole),
    )

  def write_back(self, graphdef_after, state_after) -> None:
    """The state the call left written into the caller's nodes.

    Raises:
      ValueError: the call changed what a state cannot carry (a Python
        attribute, a sub-module replaced by another kind of object).
    """
    nnx = sys.modules["flax.nnx"]
    nnx.update(self.objects, state_after)
    if nnx.graphdef(self.objects) != graphdef_after:
      raise ValueError(
        "autocast(fun) carried the NNX Variables `fun` wrote back into its "
        "arguments, but `fun` also changed their structure in a way a state "
        "cannot carry (a Python attribute set, a sub-module replaced); make "
        "that change outside the autocast function."
      )


def find(fun: Any, tree: Any) -> Nodes | None:
  """The NNX graph nodes ``fun`` reaches through ``tree`` or itself, or None."""
  graph = _graph()
  if graph is None:
    return None
  is_node = graph.is_graph_node
  objects: list[Any] = []

  def take(x):
    if not is_node(x):
      return x
    for i, seen in enumerate(objects):
      if seen is x:
        return Hole(i)
    objects.append(x)
    return Hole(len(objects) - 1)

  holed = jax.tree.map(take, tree, is_leaf=is_node)
  owner_obj = fun if is_node(fun) else getattr(fun, "__self__", None)
  owner = None
  if owner_obj is not None and is_node(owner_obj):
    owner = next((i for i, o in enumerate(objects) if o is owner_obj), None)
    if owner is None:
      objects.append(owner_obj)
      owner = len(objects) - 1
  if not objects:
    return None
  return Nodes(tuple(objects), holed, owner)


def bound(fun: Any, owner: int | None, merged: tuple) -> Any:
  """``fun`` on the merged nodes: the merged module, or its method."""
  if owner is None:
    return fun
  if inspect.ismethod(fun):
    return fun.__func__.__get__(merged[owner])
  return merged[owner]


def nnx_error(error: Exception) -> Exception | None:
  """A clearer error for NNX's refusal to write a closed-over Variable."""
  if type(error).__name__ != "TraceContextError":
    return None
  return ValueError(
    "autocast(fun) traces `fun`, and `fun` wrote an NNX Variable it reaches "
    "through a closure, which autocast cannot carry back. Pass the module (or "
    "Rngs, or Variable) as an argument, `autocast(lambda model, x: ...)(model, "
    f"x)`, or autocast the module itself, `autocast(model)(x)`. ({error})"
  )
