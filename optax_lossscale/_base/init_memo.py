"""What a transformation's ``init`` made, remembered for its ``update``'s checks.

A wrapper's ``update`` checks that the state it is given is the one its inner
transformation's ``init`` makes for these parameters (a state restored into
the wrong optimizer is a readable error, not a crash deep in optax). Tracing
``init`` again for that check, at every trace of every wrapper, is what made
a loss-scaled step cost more to compile than the optimizer it wraps.
:class:`InitMemo` keeps the abstract state (shapes and dtypes, no values)
that ``init`` made, keyed by the parameters' abstract signature: recorded when
``init`` runs, traced once with ``jax.eval_shape`` when a state arrives that
no ``init`` of this process made (a restored checkpoint), then reused.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax

from optax_lossscale._base import tree as _tree

__all__ = ["InitMemo", "signature"]


def signature(tree: Any) -> Hashable:
  """The abstract signature of ``tree``: its structure and each leaf's shape,
  dtype and explicit sharding (what an ``init`` may decide by), no values."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple(
    (x.shape, x.dtype, _tree.explicit_spec(x))
    if _tree.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)
    else (type(x),)
    for x in leaves
  )


def abstract(state: Any) -> Any:
  """``state`` as ``jax.eval_shape`` gives it: a ``ShapeDtypeStruct`` an array
  or Python number leaf, other leaves (a string tag) as they are."""
  leaves, treedef = jax.tree.flatten(state)
  numeric = [
    i
    for i, x in enumerate(leaves)
    if _tree.is_array(x) or isinstance(x, (bool, int, float, complex))
  ]
  structs = jax.eval_shape(lambda *xs: xs, *(leaves[i] for i in numeric))
  for i, x in zip(numeric, structs, strict=True):
    leaves[i] = x
  return jax.tree.unflatten(treedef, leaves)


class InitMemo:
  """The abstract states an ``init`` function made, by parameter signature.

  Args:
    init: the transformation's ``init`` (``params -> state``).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from optax_lossscale._base.init_memo import InitMemo
    >>> tx = optax.adam(1e-3)
    >>> memo = InitMemo(tx.init)
    >>> params = {"w": jnp.ones(3)}
    >>> state = memo.record(params, tx.init(params))
    >>> memo.made(params)[0].mu["w"].shape  # no trace of init
    (3,)
  """

  def __init__(self, init: Callable[[Any], Any]):
    self._init = init
    self._made: dict[Hashable, Any] = {}

  def record(self, params: Any, state: Any) -> Any:
    """Remembers that ``init(params)`` made ``state``; returns ``state``."""
    self._made[signature(params)] = abstract(state)
    return state

  def seen_for(self, structure: Any) -> list[Hashable]:
    """The parameter signatures (:func:`signature`) for which ``init`` made a
    state of this tree ``structure``, most recent first."""
    return [
      key
      for key, state in reversed(self._made.items())
      if jax.tree.structure(state) == structure
    ]

  def made(self, params: Any) -> Any:
    """The abstract state ``init(params)`` makes: remembered, or traced once
    (``jax.eval_shape``; what ``init`` raises propagates, and is not kept)."""
    key = signature(params)
    if key not in self._made:
      self._made[key] = jax.eval_shape(self._init, params)
    return self._made[key]
