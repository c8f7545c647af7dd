"""Reading a loss scale out of an optimizer state: the scale and its counters.

The state may sit anywhere in a nested optax state (``chain``,
``MultiSteps``, ``inject_hyperparams``, ``masked``, …), in a porting
package's ``LossScale`` object (whose pytree child is a
:class:`LossScaleState`, found by the same search), or in a Flax
``TrainState`` or ``nnx.Optimizer`` given directly (their ``opt_state``
is searched; under NNX its leaves are ``nnx`` variables, unwrapped here).
"""

from __future__ import annotations

from typing import Any

import jax

from optax_lossscale._base import opt_state as _opt_state
from optax_lossscale._base import tree as _tree
from optax_lossscale._loss_scale import core as _core
from optax_lossscale._loss_scale.core import LossScaleState

__all__ = [
  "counters",
  "diagnostics",
  "find_loss_scale_state",
  "get_scale",
  "is_loss_scale_state",
]


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
  skips = c.consecutive_skips
  out["last_step_skipped"] = (
    jax.ShapeDtypeStruct(skips.shape, bool)  # of an abstract state
    if isinstance(skips, jax.ShapeDtypeStruct)
    else skips > 0
  )
  return out
