"""The float16 state warning: optimizer state that under- and overflows.

A loss scale whose ``init`` sees float16 parameters and float16 optimizer
state (Adam's moments, a momentum) says so with a
:class:`HalfPrecisionStateWarning`; a state declared float16 by design (the
``HalfByDesign`` protocol: a Kahan compensation) is left out, here and in
``check_skipped_steps``' suspects.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp

from optax_lossscale._base import state_roles as _roles
from optax_lossscale._base import tree as _tree

__all__ = [
  "HalfPrecisionStateWarning",
  "half_leaves",
  "warn_half_state",
  "without_half_by_design",
]


class HalfPrecisionStateWarning(UserWarning):
  """An optimizer keeps state in float16/bfloat16 where the loss scale needs
  float32 (see the message, which says where to keep it in float32)."""


def without_half_by_design(state: Any) -> Any:
  """``state`` with every :class:`~optax_lossscale._base.state_roles.HalfByDesign`
  state (a Kahan compensation) replaced by ``None``.

  What is left holds the optimizer's own state, whose float16 leaves under-
  and overflow.
  """
  marked = _roles.is_half_by_design
  return jax.tree.map(lambda x: None if marked(x) else x, state, is_leaf=marked)


def half_leaves(inner_state: Any) -> list[str]:
  """The paths of ``inner_state``'s float16 leaves, a
  :class:`~optax_lossscale._base.state_roles.HalfByDesign` state left out.

  A block-quantised leaf counts by the dtype it is decoded to for each
  update (its declared ``dtype``), not by its 8-bit codes and float32
  scales; ``nnx`` variables are read through.
  """
  return [
    jax.tree_util.keystr(path)
    for path, x in _roles.state_leaves(without_half_by_design(inner_state))
    if getattr(x, "dtype", None) == jnp.float16
  ]


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
  half = half_leaves(inner_state)
  if not half:
    return
  warnings.warn(
    f"The parameters are float16 and the optimizer keeps {len(half)} state "
    f"leaves in float16 too (at .inner_state{half[0]}"
    f"{', ...' if len(half) > 1 else ''}; a quantised leaf is decoded to "
    "float16 for each update). Optimizer state in float16 "
    "underflows and overflows (Adam's second moment is 0 for gradients "
    "below about 0.0055 and its eps=1e-8 is 0, g**2 is inf above 256): the "
    "parameters become inf or NaN within a few steps, every later step is "
    "skipped and the scale falls to its floor. Keep the optimizer in "
    "float32 on float32 master weights: "
    "dynamic_loss_scale(master_weights(optax.adam(...), store='float32')).",
    HalfPrecisionStateWarning,
    stacklevel=3,
  )
