"""Reading a loss scale out of an optimizer state: the scale and its counters.

The state may sit anywhere in a nested optax state (``chain``,
``MultiSteps``, ``inject_hyperparams``, ``masked``, …), in a porting
package's ``LossScale`` object (whose pytree child is a
:class:`LossScaleState`, found by the same search), or in a Flax
``TrainState`` or ``nnx.Optimizer`` given directly (their ``opt_state``
is searched; under NNX its leaves are ``nnx`` variables, unwrapped here).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp

from optax_lossscale._base import opt_state as _opt_state
from optax_lossscale._base import state_roles as _roles
from optax_lossscale._base import tree as _tree
from optax_lossscale._loss_scale import core as _core
from optax_lossscale._loss_scale.core import LossScaleState

__all__ = [
  "HalfPrecisionStateWarning",
  "counters",
  "diagnostics",
  "find_loss_scale_state",
  "float32_gradient_leaves",
  "get_scale",
  "is_loss_scale_state",
  "warn_half_state",
  "without_half_by_design",
]


def without_half_by_design(state: Any) -> Any:
  """``state`` with every :class:`~optax_lossscale._base.state_roles.HalfByDesign`
  state (a Kahan compensation) replaced by ``None``.

  What is left holds the optimizer's own state, whose float16 leaves under-
  and overflow.
  """
  marked = _roles.is_half_by_design
  return jax.tree.map(lambda x: None if marked(x) else x, state, is_leaf=marked)


class HalfPrecisionStateWarning(UserWarning):
  """An optimizer keeps state in float16/bfloat16 where the loss scale needs
  float32 (see the message, which says where to keep it in float32)."""


def float32_gradient_leaves(opt_state: Any, grads: Any) -> Any | None:
  """Which leaves of ``grads`` an inner state keeps float32 masters for.

  A :class:`~optax_lossscale._base.state_roles.KeepsFloat32Masters` state
  (``master_weights``') holds, in its ``master`` field, a tree like the
  parameters it was made for, with an array at each half-precision leaf it
  keeps a float32 master of (``optax.MaskedNode`` or ``None`` elsewhere:
  ``chain``, ``masked``, ``multi_transform``, ``MultiSteps`` and
  ``inject_hyperparams`` keep the parameters' key paths). A leaf of
  ``grads`` is marked when its key path is one of those and it is a
  half-precision array: that leaf, and no other, reaches the inner
  optimizer in float32. A fact of the state's structure, known when
  tracing.

  Returns:
    A tree of bools like ``grads``, or ``None`` when no leaf is marked.
  """
  found = _tree.find_all(opt_state, _roles.keeps_masters)
  if not found:
    return None
  kept = set()
  for _, node in found:
    flat = jax.tree_util.tree_flatten_with_path(node.master, is_leaf=_tree.is_variable)[
      0
    ]
    kept.update(
      _tree.keystr(path) for path, x in flat if _tree.is_array(_tree.unwrap(x))
    )
  flat, treedef = jax.tree_util.tree_flatten_with_path(grads)
  marks = [
    _tree.keystr(path) in kept
    and _tree.is_float_array(g)
    and jnp.finfo(g.dtype).bits < 32
    for path, g in flat
  ]
  return jax.tree.unflatten(treedef, marks) if any(marks) else None


def is_loss_scale_state(x: Any) -> bool:
  """A :class:`LossScaleState`."""
  return isinstance(x, LossScaleState)


def find_loss_scale_state(opt_state: Any) -> LossScaleState:
  """The one :class:`LossScaleState` in ``opt_state``, at any depth.

  Searches nested optax states (``chain``, ``MultiSteps``,
  ``inject_hyperparams``, ``masked``, …), plain containers and the porting
  package's ``LossScale`` objects (pytrees holding one). Flax's
  ``TrainState`` and ``nnx.Optimizer`` are accepted too (their
  ``opt_state`` is searched); under NNX the fields are ``nnx`` variables.

  Raises:
    ValueError: when there is none, or more than one.
  """
  try:
    return _tree.find_unique(
      _opt_state.optimizer_state(opt_state), is_loss_scale_state, "loss-scale state"
    )
  except ValueError as e:
    raise ValueError(
      f"{e} Build the optimizer with optax_lossscale.dynamic_loss_scale(...) "
      "or static_loss_scale(...), and wrap it in one loss scale only."
    ) from None


def counters(opt_state: Any) -> LossScaleState:
  """The loss-scale state in ``opt_state``, its ``inner_state`` left out."""
  found = find_loss_scale_state(opt_state)
  return LossScaleState(
    **{f: _tree.unwrap(getattr(found, f)) for f in _core.COUNTER_FIELDS}
  )


def get_scale(opt_state: Any) -> jax.Array:
  """The current float32 loss scale, wherever it sits in ``opt_state``.

  Args:
    opt_state: an optimizer state holding exactly one :class:`LossScaleState`
      (at any depth; a porting ``LossScale`` object holds one), or an object
      with an ``opt_state`` attribute (Flax ``TrainState``,
      ``nnx.Optimizer``).

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


def warn_half_state(params: Any, inner_state: Any) -> None:
  """A :class:`HalfPrecisionStateWarning` when the optimizer keeps float16
  state for float16 parameters.

  Adam's moments in float16 underflow (``(1 - b2) * g**2`` is 0 below
  ``|g|`` of about 0.0055, and ``eps=1e-8`` is 0) and overflow (``g**2``
  above 256): the update divides by zero, the parameters become inf or NaN,
  and every later step is skipped while the scale falls to its floor. A
  :class:`~optax_lossscale._base.state_roles.HalfByDesign` state (a ``kahan_summation``
  compensation) is float16 by design and not counted.
  """
  leaves = jax.tree.leaves(params, is_leaf=_tree.is_variable)
  if not any(getattr(_tree.unwrap(p), "dtype", None) == jnp.float16 for p in leaves):
    return
  scanned = without_half_by_design(inner_state)
  half = [
    jax.tree_util.keystr(path)
    for path, x in jax.tree_util.tree_flatten_with_path(
      scanned, is_leaf=_tree.is_variable
    )[0]
    if getattr(_tree.unwrap(x), "dtype", None) == jnp.float16
  ]
  if not half:
    return
  warnings.warn(
    f"The parameters are float16 and the optimizer keeps {len(half)} state "
    f"leaves in float16 too (at .inner_state{half[0]}"
    f"{', ...' if len(half) > 1 else ''}). Optimizer state in float16 "
    "underflows and overflows (Adam's second moment is 0 for gradients "
    "below about 0.0055 and its eps=1e-8 is 0, g**2 is inf above 256): the "
    "parameters become inf or NaN within a few steps, every later step is "
    "skipped and the scale falls to its floor. Keep the optimizer in "
    "float32 on float32 master weights: "
    "dynamic_loss_scale(master_weights(optax.adam(...), store='float32')).",
    HalfPrecisionStateWarning,
    stacklevel=3,
  )
