"""Reading a loss scale out of an optimizer state: the scale and its counters.

The state may sit anywhere in a nested optax state (``chain``,
``MultiSteps``, ``inject_hyperparams``, ``masked``, …), or in a Flax
``TrainState`` or ``nnx.Optimizer`` given directly (their ``opt_state``
is searched; under NNX its leaves are ``nnx`` variables, unwrapped here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from optax_lossscale import _core
from optax_lossscale._core import LossScaleState
from optax_lossscale._loss_scale import LossScale

__all__ = [
  "counters",
  "diagnostics",
  "find_all",
  "find_loss_scale_state",
  "find_unique",
  "is_loss_scale_state",
  "is_variable",
  "get_scale",
  "optimizer_state",
  "unwrap",
  "unwrap_variables",
]


def optimizer_state(obj: Any) -> Any:
  """The optax state held by ``obj``: itself, or its ``opt_state`` attribute.

  Flax's ``TrainState`` and ``nnx.Optimizer`` keep the optax state in an
  ``opt_state`` attribute; the helpers of this package accept them directly.
  """
  if is_loss_scale_state(obj) or isinstance(obj, (tuple, list, dict)):
    return obj
  inner = getattr(obj, "opt_state", None)
  return obj if inner is None else inner


def find_all(tree: Any, predicate: Callable[[Any], bool]) -> list[tuple[Any, Any]]:
  """Every node of ``tree`` for which ``predicate``, at any depth.

  Matching nodes are searched too, so a node nested inside another matching
  node is found as well.

  Returns:
    ``(key path, node)`` pairs, depth-first.
  """
  found: list[tuple[Any, Any]] = []

  def visit(node, prefix):
    is_match = lambda x: x is not node and predicate(x)  # noqa: E731
    for path, x in jax.tree_util.tree_flatten_with_path(node, is_leaf=is_match)[0]:
      if is_match(x):
        found.append((prefix + path, x))
        visit(x, prefix + path)

  if predicate(tree):
    found.append(((), tree))
  visit(tree, ())
  return found


def find_unique(tree: Any, predicate: Callable[[Any], bool], what: str) -> Any:
  """The one node of ``tree`` (at any depth) for which ``predicate``.

  Args:
    tree: any pytree (an optax state, nested ``chain``/``MultiSteps``/...).
    predicate: says whether a node is the one looked for.
    what: a description of the node, for the error messages.

  Raises:
    ValueError: there is no such node, or more than one (with their paths),
      one inside the other included.
  """
  found = find_all(tree, predicate)
  if not found:
    raise ValueError(
      f"No {what} in this optimizer state (of type {type(tree).__name__})."
    )
  if len(found) > 1:
    paths = ", ".join(jax.tree_util.keystr(p) or "<root>" for p, _ in found)
    raise ValueError(
      f"Found {len(found)} {what}s in this optimizer state (at {paths}); "
      "expected exactly one."
    )
  return found[0][1]


def is_loss_scale_state(x: Any) -> bool:
  """A :class:`LossScaleState` or a :class:`LossScale` object."""
  return isinstance(x, (LossScaleState, LossScale))


def find_loss_scale_state(opt_state: Any) -> LossScaleState | LossScale:
  """The one :class:`LossScaleState` (or :class:`LossScale`) in ``opt_state``.

  Searches nested optax states (``chain``, ``MultiSteps``,
  ``inject_hyperparams``, ``masked``, …) and plain containers. Flax's
  ``TrainState`` and ``nnx.Optimizer`` are accepted too (their
  ``opt_state`` is searched); under NNX the fields are ``nnx`` variables.

  Raises:
    ValueError: when there is none, or more than one.
  """
  try:
    return find_unique(
      optimizer_state(opt_state), is_loss_scale_state, "loss-scale state"
    )
  except ValueError as e:
    raise ValueError(
      f"{e} Build the optimizer with optax_lossscale.dynamic_loss_scale(...) "
      "or static_loss_scale(...), and wrap it in one loss scale only."
    ) from None


def is_variable(x: Any) -> bool:
  """An ``nnx.Variable`` (anything but an array with a ``get_value`` method)."""
  return not _core.is_array(x) and callable(getattr(x, "get_value", None))


def unwrap(x: Any) -> Any:
  """``x``, or the array an ``nnx`` variable holds."""
  return x.get_value() if is_variable(x) else x


def unwrap_variables(tree: Any) -> Any:
  """``tree`` with ``nnx`` variables replaced by the arrays they hold."""
  return jax.tree.map(unwrap, tree, is_leaf=is_variable)


def counters(opt_state: Any) -> LossScaleState:
  """The loss-scale state in ``opt_state``, its ``inner_state`` left out."""
  found = find_loss_scale_state(opt_state)
  if isinstance(found, LossScale):
    found = found.counters
  return LossScaleState(**{f: unwrap(getattr(found, f)) for f in _core.COUNTER_FIELDS})


def get_scale(opt_state: Any) -> jax.Array:
  """The current float32 loss scale, wherever it sits in ``opt_state``.

  Args:
    opt_state: an optimizer state holding exactly one :class:`LossScaleState`
      (at any depth), a :class:`LossScale` object, or an object with an
      ``opt_state`` attribute (Flax ``TrainState``, ``nnx.Optimizer``).

  Returns:
    A float32 scalar array (traced under ``jax.jit``).

  Raises:
    ValueError: no loss-scale state, or more than one.
  """
  return counters(opt_state).loss_scale


def diagnostics(opt_state: Any) -> dict[str, jax.Array]:
  """The loss-scale counters as device arrays, for logging (jit-friendly).

  Args:
    opt_state: anything :func:`get_scale` accepts.

  Returns:
    A dict of scalar arrays: ``loss_scale`` (float32), ``good_steps``,
    ``hysteresis_left``, ``skipped_steps`` (total), ``consecutive_skips``
    (int32) and ``last_step_skipped`` (bool). Inside ``jax.jit`` these are
    traced values: return them from the step and fetch them when you log, no
    host sync in the step.

  Example:
    >>> import jax.numpy as jnp, optax, optax_lossscale as ols
    >>> tx = ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=8.0)
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> _, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state)
    >>> d = ols.diagnostics(state)
    >>> float(d["loss_scale"]), int(d["skipped_steps"]), bool(d["last_step_skipped"])
    (4.0, 1, True)
  """
  c = counters(opt_state)
  out = {f: getattr(c, f) for f in _core.COUNTER_FIELDS}
  out["last_step_skipped"] = c.consecutive_skips > 0
  return out
