"""What an optimizer-state class declares to the transformations around it.

A wrapper (the loss scale) must know a few facts about states made by
transformations above it in the package's layers (the parameter tools)
without importing them. Those states declare the facts as typed class
members of the protocols below, and the wrapper tests ``isinstance``
against the protocol: one declared contract, no registry filled at import,
no attribute looked up by a string.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import jax

from optax_lossscale._base import tree as _tree

__all__ = [
  "HalfByDesign",
  "KeepsFloat32Masters",
  "StoredInGroup",
  "StoredQuantized",
  "holds_masters",
  "is_half_by_design",
  "is_in_group",
  "is_quantized",
  "keeps_masters",
  "state_leaves",
  "tested_array",
]


@runtime_checkable
class KeepsFloat32Masters(Protocol):
  """A state that keeps float32 master weights of half-precision parameters.

  ``master`` is a tree like the parameters the state was made for, with an
  array at each half-precision leaf a float32 master is kept of (``None`` or
  ``optax.MaskedNode`` elsewhere). A loss scale whose inner state holds such
  a state hands those leaves' gradients over unscaled in float32, not cast
  back to the parameters' dtype (``master_weights``' state).
  """

  keeps_float32_masters: ClassVar[bool]
  master: Any


@runtime_checkable
class HalfByDesign(Protocol):
  """A state whose half-precision leaves are so by design (a Kahan
  compensation, which holds what rounding lost, in the parameters' dtype):
  the float16 warnings and suspects leave it out."""

  half_by_design: ClassVar[bool]


@runtime_checkable
class StoredQuantized(Protocol):
  """A state leaf stored block-quantised (``quantize_state``'s): the inner
  transformation made it in ``dtype``; ``block_size`` elements share a
  scale. Inspectors read its dtype here, not from an array; ``scales``
  holds one float32 scale a block, infinite where the block held NaN or an
  infinity."""

  stored_quantized: ClassVar[bool]
  dtype: Any
  block_size: int
  scales: Any


@runtime_checkable
class StoredInGroup(Protocol):
  """A state leaf stored block-quantised in a buffer it shares with other
  leaves (``quantize_state``'s flat layout): the inner transformation made
  it in ``dtype``; ``block_size`` elements share a scale. It holds no
  array: its group's buffer, a :class:`StoredQuantized` leaf, holds its
  values."""

  stored_in_group: ClassVar[bool]
  dtype: Any
  block_size: int


def keeps_masters(x: Any) -> bool:
  """Whether ``x`` is a :class:`KeepsFloat32Masters` state (a class, not an
  instance, is not)."""
  return _declares(x, KeepsFloat32Masters)


def is_half_by_design(x: Any) -> bool:
  """Whether ``x`` is a :class:`HalfByDesign` state."""
  return _declares(x, HalfByDesign)


def is_quantized(x: Any) -> bool:
  """Whether ``x`` is a :class:`StoredQuantized` state leaf."""
  return _declares(x, StoredQuantized)


def is_in_group(x: Any) -> bool:
  """Whether ``x`` is a :class:`StoredInGroup` state leaf."""
  return _declares(x, StoredInGroup)


def state_leaves(tree: Any) -> list[tuple[tuple, Any]]:
  """The leaves of an optimizer state as an inspector must read them.

  Every array leaf, and every :class:`StoredQuantized` and
  :class:`StoredInGroup` leaf whole (its ``dtype`` is the dtype the
  optimizer computes it in, which its codes and scales, arrays of other
  dtypes, do not show); ``nnx`` variables are read
  through (the path stops at the variable), at any depth. The one walk
  behind every reader of a state's dtypes and values (the float16 state
  warning, ``check_skipped_steps``' suspects, the checkpoint guard, the
  loss-scale plan), so that each sees inside every state form alike.

  Returns:
    ``(key path, leaf)`` pairs in ``jax.tree`` order; a leaf is an array (or
    other non-pytree leaf), a :class:`StoredQuantized` or a
    :class:`StoredInGroup` leaf.
  """
  out: list[tuple[tuple, Any]] = []

  def visit(node: Any, prefix: tuple) -> None:
    if is_quantized(node) or is_in_group(node):
      out.append((prefix, node))
      return
    stop = lambda x: (
      x is not node
      and (  # noqa: E731
        is_quantized(x) or is_in_group(x) or _tree.is_variable(x)
      )
    )
    for path, x in jax.tree_util.tree_flatten_with_path(node, is_leaf=stop)[0]:
      if is_quantized(x) or is_in_group(x) or _tree.is_variable(x):
        visit(_tree.unwrap(x), prefix + path)
      else:
        out.append((prefix + path, x))

  visit(tree, ())
  return out


def tested_array(leaf: Any) -> Any:
  """The floating array whose entries are all finite exactly when ``leaf``'s
  are: a floating array itself, a :class:`StoredQuantized` leaf's block
  scales; ``None`` for any other leaf (an integer counter, ``None``)."""
  if is_quantized(leaf):
    return leaf.scales
  return leaf if _tree.is_float_array(leaf) else None


def holds_masters(opt_state: Any) -> bool:
  """Whether ``opt_state`` holds, at any depth, a
  :class:`~optax_lossscale._base.state_roles.KeepsFloat32Masters` state
  (``master_weights``'): the gradients are then unscaled into float32 for
  it, not cast back to their dtype. A fact of the state's structure, known
  when tracing."""
  return bool(_tree.find_all(opt_state, keeps_masters))


#: (class, protocol) -> whether the class's instances are the protocol's. A
#: runtime protocol's ``isinstance`` looks up every member (10 ms over a
#: 150-leaf state's nodes); what a class declares does not change.
_DECLARED: dict[tuple[type, type], bool] = {}


def _declares(x: Any, protocol: type) -> bool:
  if isinstance(x, type):
    return False
  key = (type(x), protocol)
  if key not in _DECLARED:
    _DECLARED[key] = isinstance(x, protocol)
  return _DECLARED[key]
