"""Scaling a loss by the state's loss scale, and differentiating it.

:func:`value_and_grad` gives the gradients that the loss-scale
transformations' ``update`` expects (those of ``loss * scale``) and the loss
as the function returned it. :func:`scaled_loss_fn` is the one place where a
loss function is scaled; the Flax helpers use it too.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from optax_lossscale._base import tree as _tree
from optax_lossscale._loss_scale import core as _core
from optax_lossscale._loss_scale import search as _search

__all__ = ["scale_for", "scale_loss", "scaled_loss_fn", "value_and_grad"]


def scale_loss(loss: Any, opt_state: Any) -> jax.Array:
  """``loss * get_scale(opt_state)``, computed in at least float32."""
  return _core.scale_value(loss, _search.get_scale(opt_state))


def scale_for(opt_state: Any, caller: str) -> jax.Array:
  """``get_scale(opt_state)``, with an error that says what ``caller`` takes."""
  try:
    return _search.get_scale(opt_state)
  except ValueError as e:
    raise ValueError(
      f"{caller} returns g(opt_state, *args, **kwargs): its first argument "
      "must be the optimizer state holding the loss scale (or a Flax "
      "TrainState or nnx.Optimizer), followed by the loss function's own "
      f"arguments; got a {type(opt_state).__name__} first. {e}"
    ) from None


def scaled_loss_fn(
  fun: Callable[..., Any], scale: jax.Array, has_aux: bool
) -> Callable[..., Any]:
  """``fun`` returning ``(loss * scale, fun's own output)``, for ``has_aux`` grads."""

  def scaled(*args, **kwargs):
    out = fun(*args, **kwargs)
    if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
      got = (
        f"an array of shape {tuple(out.shape)}"
        if hasattr(out, "shape")
        else type(out).__name__
      )
      raise ValueError(
        "value_and_grad(has_aux=True): the loss function must return a pair "
        f"(loss, auxiliary output), got {got}."
      )
    if not has_aux and isinstance(out, (tuple, list, dict)):
      raise ValueError(
        "value_and_grad: the loss function returned a "
        f"{type(out).__name__}, not a scalar loss; if it returns (loss, "
        "auxiliary output), pass has_aux=True."
      )
    loss = out[0] if has_aux else out
    dtype = getattr(loss, "dtype", None) or jnp.result_type(loss)
    if not jnp.issubdtype(dtype, jnp.inexact):  # jax.grad refuses it too
      raise ValueError(
        "value_and_grad: the loss function must return a floating loss (its "
        f"gradient is otherwise 0), got {jnp.dtype(dtype).name}. Cast it "
        "(loss.astype(jnp.float32))."
      )
    return _core.scale_value(loss, scale), out

  return scaled


def _is_index(x: Any) -> bool:
  """An integer (a NumPy one too, as JAX takes it), not a bool."""
  return _index(x) is not None


def _index(x: Any) -> int | None:
  if isinstance(x, bool):
    return None
  try:
    return operator.index(x)
  except TypeError:
    return None


def _positions(argnums: int | Sequence[int], count: int) -> tuple[int, ...]:
  """``argnums`` as non-negative positions among ``count`` arguments."""
  try:
    nums = tuple(map(_index, (argnums,) if _is_index(argnums) else argnums))
  except TypeError:  # neither an integer nor a sequence of them
    nums = (None,)
  bad = [i for i in nums if i is None or not -count <= i < count]
  if bad or not nums:
    raise ValueError(
      f"value_and_grad(argnums={argnums!r}): positions of the loss function's "
      f"arguments after the optimizer state, of which there are {count}."
    )
  positions = tuple(i % count for i in nums)
  if len(set(positions)) < len(positions):  # one argument's gradient twice
    raise ValueError(
      f"value_and_grad(argnums={argnums!r}) names one argument twice (as "
      f"positions {positions} among {count}): name each once."
    )
  return positions


def _split(tree: Any) -> tuple[Any, Any]:
  """``tree``'s floating-point array leaves, and its other leaves (``None`` each)."""
  arrays = jax.tree.map(lambda x: x if _tree.is_float_array(x) else None, tree)
  others = jax.tree.map(lambda x: None if _tree.is_float_array(x) else x, tree)
  return arrays, others


def _merge(arrays: Any, others: Any) -> Any:
  """The tree :func:`_split` split: each leaf from whichever part holds it."""
  pick = lambda a, b: b if a is None else a  # noqa: E731
  return jax.tree.map(pick, arrays, others, is_leaf=lambda x: x is None)


def value_and_grad(
  fun: Callable[..., Any],
  argnums: int | Sequence[int] = 0,
  has_aux: bool = False,
) -> Callable[..., Any]:
  """``jax.value_and_grad`` of the scaled loss, returning the unscaled loss.

  The differentiated arguments may be any pytrees, Equinox modules with
  their activation functions and static fields included: as with
  ``equinox.filter_value_and_grad``, their floating-point array leaves (JAX
  or NumPy) are differentiated, and every other leaf (a function, an
  integer array, a Python number, a string) is held constant and gets
  ``None`` for its gradient. Give the optimizer the same leaves:
  ``tx.init(eqx.filter(model, eqx.is_inexact_array))``.

  Args:
    fun: the loss function; returns a scalar (or ``(loss, aux)`` with
      ``has_aux=True``).
    argnums: which positional arguments of ``fun`` to differentiate.
    has_aux: whether ``fun`` returns ``(loss, aux)``.

  Returns:
    A function ``g(opt_state, *args, **kwargs) -> (value, grads)``: ``value``
    is ``fun``'s own output (the loss unscaled, in its own dtype, with
    ``aux``) and ``grads`` are the gradients of ``loss * scale``, for the
    loss-scaled optimizer's ``update``, which unscales them. ``opt_state``
    is anything that ``get_scale`` accepts.

  Raises:
    ValueError: ``argnums`` names no argument of the call.

  Example:
    >>> import jax.numpy as jnp, optax, optax_lossscale as ols
    >>> tx = ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=4.0)
    >>> state = tx.init(jnp.ones(2))
    >>> loss, grads = ols.value_and_grad(lambda p: jnp.sum(p))(state, jnp.ones(2))
    >>> float(loss), grads
    (2.0, Array([4., 4.], dtype=float32))
  """

  def wrapper(opt_state, *args, **kwargs):
    scale = scale_for(opt_state, "value_and_grad(fun)")
    scaled = scaled_loss_fn(fun, scale, has_aux)
    nums = _positions(argnums, len(args))
    arrays, others = zip(*(_split(args[i]) for i in nums), strict=True)

    def on_arrays(*parts):
      full = list(args)
      for i, part, other in zip(nums, parts, others, strict=True):
        full[i] = _merge(part, other)
      return scaled(*full, **kwargs)

    positions = tuple(range(len(nums)))
    (_, out), grads = jax.value_and_grad(on_arrays, positions, has_aux=True)(*arrays)
    return out, grads[0] if _is_index(argnums) else grads

  return wrapper
