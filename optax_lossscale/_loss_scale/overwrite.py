"""Leaves whose gradient is their new value (Flax's float8 meta): kept apart, written.

Flax's float8 layers (``flax.linen.fp8_ops``) keep per-tensor scales and amax
histories in the variable collection ``_overwrite_with_gradient``; their
custom VJPs return each such variable's *new value* as its "gradient". Under
a loss scale these *overwrite leaves* are never unscaled and never reach the
inner optimizer (it sees ``optax.MaskedNode`` in their place, as under
``optax.masked``), but they are finite-checked with the gradients: a
non-finite new value skips the step.

* :func:`overwrite_mask`: which leaves of a tree are overwrite leaves, found
  by a key-path entry named ``_overwrite_with_gradient`` (Linen's variables
  dict), an ``nnx`` variable type of that name (``nnx.bridge.ToNNX``), or
  Flax's ``fp8_meta`` extended dtype. Flax is never imported.
* :func:`with_overwrites`: ``inner`` on the other leaves; zero updates for
  the overwrite leaves, whose new values its :class:`OverwriteState` keeps:
  the elementwise maximum over the steps of one ``optax.MultiSteps`` window,
  ready to be written when the window's update is.
* :func:`apply_overwrites`: the parameters with those values written in,
  exactly (``optax.apply_updates(p, new - p)`` is not exact in float32).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from optax_lossscale._base import opt_state as _opt_state
from optax_lossscale._base import tree as _tree
from optax_lossscale._loss_scale import skip as _skip

__all__ = [
  "OVERWRITE_WITH_GRADIENT",
  "OverwriteState",
  "apply_overwrites",
  "as_floats",
  "find_overwrite_state",
  "is_overwrite_variable",
  "mask_in",
  "merge",
  "on_regular_leaves",
  "overwrite_mask",
  "split",
  "state_mask",
  "with_overwrites",
]

#: Flax's name for the collection (``flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT``).
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"

_MASKED = optax.MaskedNode()


class OverwriteState(NamedTuple):
  """State of :func:`with_overwrites`.

  Attributes:
    overwrite_values: the tree of the parameters with the overwrite leaves'
      new values, ``optax.MaskedNode`` at the other leaves: the elementwise
      maximum over the applied steps since the last optimizer step (one
      step, or the micro-batches of an ``optax.MultiSteps`` window).
    overwrite_ready: bool scalar, whether the last applied step was an
      optimizer step (it ended the window): :func:`apply_overwrites` writes
      ``overwrite_values`` then, and leaves the parameters alone otherwise.
    inner_state: the state of the wrapped transformation, which sees the
      other leaves only.
  """

  overwrite_values: Any
  overwrite_ready: jax.Array
  inner_state: Any


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _is_overwrite_state(x: Any) -> bool:
  return isinstance(x, OverwriteState)


def _is_multi_steps_state(x: Any) -> bool:
  return isinstance(x, optax.MultiStepsState)


# --------------------------------------------------------------------------
# Which leaves, and the tree split around them.
# --------------------------------------------------------------------------


def is_overwrite_variable(x: Any) -> bool:
  """An ``nnx`` variable of Flax's collection (``nnx.bridge`` names its type so)."""
  return _tree.is_variable(x) and type(x).__name__ == OVERWRITE_WITH_GRADIENT


def _is_fp8_meta(x: Any) -> bool:
  """An array of Flax's ``fp8_meta`` extended dtype (``fp8_ops.fp32_max_grad``)."""
  dtype = getattr(x, "dtype", None)  # NumPy's dtypes (all but extended ones) fail fast
  return (
    dtype is not None
    and not isinstance(dtype, np.dtype)
    and getattr(getattr(dtype, "type", None), "__name__", None) == "fp8_meta_dtype"
  )


def _float_dtype(x: Any) -> Any:
  """The float dtype that ``x``'s values are (an ``fp8_meta`` array's, or its own)."""
  return x.dtype.float_dtype if _is_fp8_meta(x) else x.dtype


def _named(entry: Any) -> bool:
  return OVERWRITE_WITH_GRADIENT in (
    getattr(entry, "key", None),
    getattr(entry, "name", None),
  )


def overwrite_mask(tree: Any) -> Any | None:
  """A tree of bools like ``tree``: which leaves are overwrite leaves.

  A leaf is one when an entry of its key path is named
  ``_overwrite_with_gradient`` (a dict key or an attribute), when it is an
  ``nnx`` variable whose type has that name, or when its dtype is Flax's
  ``fp8_meta`` extended dtype. ``nnx`` variables are leaves here.

  Returns:
    The mask, or ``None`` when ``tree`` has no overwrite leaf (the common
    case, decided at trace time: nothing is computed for it).
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_tree.is_variable)
  mask = [
    any(_named(e) for e in path)
    or is_overwrite_variable(x)
    or _is_fp8_meta(_tree.unwrap(x))
    for path, x in flat
  ]
  return jax.tree.unflatten(treedef, mask) if any(mask) else None


def split(tree: Any, mask: Any) -> tuple[Any, Any]:
  """``(other leaves, overwrite leaves)``, each with ``MaskedNode`` for the rest."""
  regular = jax.tree.map(lambda m, x: _MASKED if m else x, mask, tree)
  overwrite = jax.tree.map(lambda m, x: x if m else _MASKED, mask, tree)
  return regular, overwrite


def merge(regular: Any, overwrite: Any) -> Any:
  """The inverse of :func:`split`: ``regular`` with its ``MaskedNode`` filled in."""
  return jax.tree.map(
    lambda r, o: o if _is_masked(r) else r, regular, overwrite, is_leaf=_is_masked
  )


def state_mask(inner_state: Any, grads: Any) -> Any | None:
  """The mask of a loss scale's ``inner_state``; ``None`` if it has none.

  Raises:
    ValueError: ``grads`` hold overwrite leaves but the state was made
      without them (by ``init`` on a tree that lacked them).
  """
  if isinstance(inner_state, OverwriteState):
    values = _tree.unwrap_variables(inner_state.overwrite_values)
    return jax.tree.map(lambda v: not _is_masked(v), values, is_leaf=_is_masked)
  named = overwrite_mask(grads)
  if named is not None:
    flat = jax.tree_util.tree_flatten_with_path(named)[0]
    paths = [jax.tree_util.keystr(p) for p, m in flat if m]
    raise ValueError(
      f"The gradients hold {len(paths)} leaves that Flax overwrites with their "
      f"new value (float8 scales and amax histories, e.g. at {paths[0]}), but "
      "this optimizer state was made without them. Call init on the same "
      "tree as the gradients (the whole variables dict, "
      f"{{'params': ..., '{OVERWRITE_WITH_GRADIENT}': ...}}): the loss scale "
      "then keeps them from the inner optimizer and overwrites them."
    )
  return None


def _as_float(x: jax.Array) -> jax.Array:
  """``x``, or the float array an ``fp8_meta`` array holds (for arithmetic)."""
  return lax.convert_element_type(x, _float_dtype(x))


def as_floats(tree: Any) -> Any:
  """``tree`` with ``fp8_meta`` arrays as the float arrays they hold."""
  return jax.tree.map(_as_float, tree)


# --------------------------------------------------------------------------
# The transformation.
# --------------------------------------------------------------------------


def _empty(x: Any) -> jax.Array:
  """An array like ``x`` of ``-inf``, the identity of the maximum (a new buffer)."""
  x = _tree.unwrap(x)
  if not (_tree.is_float_array(x) or _is_fp8_meta(x)):
    raise ValueError(
      f"An overwrite leaf must be a floating array (Flax's float8 scales and "
      f"amax histories are float32); got {x!r}."
    )
  full = jnp.full(x.shape, -jnp.inf, _float_dtype(x))
  return lax.convert_element_type(full, x.dtype)


def _window_ended(old_inner: Any, new_inner: Any) -> jax.Array:
  """Whether ``inner``'s update was an optimizer step (the window's last one).

  Always, unless an ``optax.MultiSteps`` inside emits its update now and
  then: then when its ``gradient_step`` advanced.
  """
  old = _tree.find_all(old_inner, _is_multi_steps_state)
  if not old:
    return jnp.array(True)
  if len(old) > 1:
    raise ValueError(
      f"Found {len(old)} optax.MultiSteps inside the loss scale: with float8 "
      "overwrite leaves the loss scale must know when the optimizer steps, "
      "and cannot tell which of them decides. Use one MultiSteps."
    )
  new = _tree.find_all(new_inner, _is_multi_steps_state)
  return new[0][1].gradient_step != old[0][1].gradient_step


def with_overwrites(
  inner: optax.GradientTransformationExtraArgs,
) -> optax.GradientTransformationExtraArgs:
  """``inner`` on the leaves that are not overwrite leaves.

  ``init(params)`` gives ``inner`` the parameters with ``MaskedNode`` in
  place of the overwrite leaves (so it holds no state for them).
  ``update(grads, state, params)`` takes the gradients with the overwrite
  leaves' new values (already checked, never unscaled) and returns
  ``inner``'s updates with zeros for the overwrite leaves. The new values go
  into the state: after an optimizer step, fresh; within an
  ``optax.MultiSteps`` window, the elementwise maximum with those of the
  window's earlier steps (so an amax history advances once per optimizer
  step, by the maximum over its micro-batches, as Flax's ``fp32_max_grad``
  combines the uses of one variable within a step). A skipped step leaves
  the whole state as it was.

  Raises:
    ValueError: ``init``'s parameters hold no overwrite leaf, or one that
      is not a floating array.
  """

  def init_fn(params):
    mask = overwrite_mask(params)
    if mask is None:
      raise ValueError("with_overwrites: the parameters hold no overwrite leaf.")
    regular, overwrite = split(params, mask)
    values = jax.tree.map(_empty, overwrite, is_leaf=_tree.is_variable)
    return OverwriteState(values, jnp.zeros([], jnp.bool_), inner.init(regular))

  def update_fn(updates, state, params=None, **extra_args):
    mask = state_mask(state, None)
    grads, new = split(updates, mask)
    regular_params = None if params is None else split(params, mask)[0]
    inner_updates, inner_state = inner.update(
      grads, state.inner_state, regular_params, **extra_args
    )
    fresh = state.overwrite_ready  # the last applied step was an optimizer step

    def combine(old, x):
      x = lax.convert_element_type(x, old.dtype)
      top = jnp.maximum(_as_float(old), _as_float(x))
      return _skip.select(fresh, x, lax.convert_element_type(top, old.dtype))

    values = jax.tree.map(combine, state.overwrite_values, new)
    zeros = jax.tree.map(jnp.zeros_like, new)
    ready = _window_ended(state.inner_state, inner_state)
    return merge(inner_updates, zeros), OverwriteState(values, ready, inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# --------------------------------------------------------------------------
# Writing the values.
# --------------------------------------------------------------------------


def find_overwrite_state(opt_state: Any) -> OverwriteState | None:
  """The :class:`OverwriteState` in ``opt_state``, or ``None`` if there is none.

  ``opt_state`` may be a Flax ``TrainState`` or ``nnx.Optimizer``.

  Raises:
    ValueError: the state sits inside an ``optax.MultiSteps``
      (``MultiSteps(dynamic_loss_scale(inner), k)``): MultiSteps averages
      the overwrite leaves' new values over its window before the loss scale
      sees them, and their maximum cannot be recovered from the mean.
  """
  tree = _opt_state.optimizer_state(opt_state)
  found = _tree.find_all(tree, _is_overwrite_state)
  if not found:
    return None
  for _, multi_steps in _tree.find_all(tree, _is_multi_steps_state):
    if _tree.find_all(multi_steps, _is_overwrite_state):
      raise ValueError(
        "optax.MultiSteps(<loss scale>(inner), k) with Flax's float8 "
        "overwrite leaves: MultiSteps averages their new values (amax "
        "histories, scales) over the window before the loss scale sees "
        "them, which corrupts them, and the maximum over the micro-batches "
        "cannot be recovered from the mean. Accumulate inside the loss "
        "scale instead: dynamic_loss_scale(optax.MultiSteps(inner, k)), or "
        "LossScaleOptimizer(..., gradient_accumulation_steps=k)."
      )
  if len(found) > 1:
    paths = ", ".join(jax.tree_util.keystr(p) for p, _ in found)
    raise ValueError(f"Found {len(found)} overwrite states (at {paths}).")
  return found[0][1]


def apply_overwrites(params: Any, opt_state: Any) -> Any:
  """``params`` with the overwrite leaves' new values written in, exactly.

  Call it after ``optax.apply_updates(params, updates)`` (the loss-scaled
  transformation's updates are zeros for these leaves).
  ``LossScaleTrainState.apply_gradients`` and
  ``optax_lossscale.flax.nnx_update`` call it for you. The values are written
  when the last update applied was an optimizer step: not on a skipped step
  (which keeps the old values, or rewrites the same ones), nor in the middle
  of an ``optax.MultiSteps`` window (the leaves keep their values while the
  window collects the maximum of its micro-batches' new values).

  Args:
    params: the parameters, the tree that the optimizer was initialised on.
    opt_state: the optimizer state the update returned (or a Flax
      ``TrainState`` or ``nnx.Optimizer``).

  Returns:
    ``params`` itself when the state has no overwrite leaves; else a new
    tree.

  Raises:
    ValueError: ``params`` do not fit the state, or the loss scale sits
      inside an ``optax.MultiSteps`` (see :func:`find_overwrite_state`).

  Example:
    >>> import jax.numpy as jnp, optax, optax_lossscale as ols
    >>> params = {"params": {"w": jnp.ones(2)},
    ...           "_overwrite_with_gradient": {"amax": jnp.zeros(2)}}
    >>> tx = ols.dynamic_loss_scale(optax.sgd(0.5), initial_scale=4.0)
    >>> state = tx.init(params)
    >>> grads = {"params": {"w": jnp.full(2, 4.0)},
    ...          "_overwrite_with_gradient": {"amax": jnp.array([3.0, 5.0])}}
    >>> updates, state = tx.update(grads, state, params)
    >>> params = ols.apply_overwrites(optax.apply_updates(params, updates), state)
    >>> params["params"]["w"], params["_overwrite_with_gradient"]["amax"]
    (Array([0.5, 0.5], dtype=float32), Array([3., 5.], dtype=float32))
  """
  state = find_overwrite_state(opt_state)
  if state is None:
    return params
  ready = _tree.unwrap(state.overwrite_ready)
  values = _tree.unwrap_variables(state.overwrite_values)

  if jax.tree.structure(values, is_leaf=_is_masked) != jax.tree.structure(params):
    raise ValueError(
      "apply_overwrites: the parameter tree does not match the optimizer "
      "state's; pass the tree that the optimizer was initialised on.\n"
      f"  params: {_tree.short(jax.tree.structure(params))}\n"
      f"  state:  {_tree.short(jax.tree.structure(values, is_leaf=_is_masked))}"
    )

  def write(path, value, p):
    if _is_masked(value):
      return p
    if not _tree.is_array(p) or (p.shape, p.dtype) != (value.shape, value.dtype):
      raise ValueError(
        f"apply_overwrites: the parameter at {jax.tree_util.keystr(path)} "
        f"({getattr(p, 'shape', p)}, {getattr(p, 'dtype', '')}) does not fit "
        f"the optimizer state's new value ({value.shape}, {value.dtype}): "
        "pass the tree that the optimizer was initialised on."
      )
    return _skip.select(ready, value, p)

  return jax.tree_util.tree_map_with_path(write, values, params, is_leaf=_is_masked)


def mask_in(opt_state: Any) -> Any | None:
  """The overwrite mask of the optimizer state ``opt_state``; ``None`` if none."""
  state = find_overwrite_state(opt_state)
  return None if state is None else state_mask(state, None)


def on_regular_leaves(fn: Callable[[Any], Any], tree: Any, opt_state: Any) -> Any:
  """``fn`` of ``tree`` without the overwrite leaves, which are put back as they are."""
  mask = mask_in(opt_state)
  if mask is None:
    return fn(tree)
  regular, overwrite = split(tree, mask)
  return merge(fn(regular), overwrite)
