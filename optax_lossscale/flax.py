"""Flax integration: a Linen ``TrainState`` with loss scaling, and NNX helpers.

Needs Flax (``pip install optax_lossscale[examples]``); the rest of the
package does not import it.

Linen::

  state = LossScaleTrainState.create(
      apply_fn=model.apply, params=params,
      tx=ols.dynamic_loss_scale(optax.adam(1e-3)))
  loss, grads = state.value_and_grad(loss_fn)(state.params, batch)
  state = state.apply_gradients(grads=grads)   # unscale, check, skip or apply

NNX: ``nnx.Optimizer`` takes any optax transformation, so loss scaling is
``nnx.Optimizer(model, ols.dynamic_loss_scale(tx), wrt=nnx.Param)``; the
helpers of the package accept the optimizer itself (``ols.get_scale(opt)``,
``ols.diagnostics(opt)``) and :func:`nnx_value_and_grad` computes the scaled
gradients.

Flax's float8 layers (``flax.linen.fp8_ops``) keep scales and amax histories
in the collection ``_overwrite_with_gradient``, whose "gradients" are their
new values: give ``LossScaleTrainState.create`` the whole variables dict; in
NNX (Linen float8 layers through ``nnx.bridge.ToNNX``) add
:func:`is_overwrite_variable` to the optimizer's ``wrt`` and update with
:func:`nnx_update`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.training import train_state

from optax_lossscale import _grad, _overwrite, _state, _telemetry

__all__ = [
  "LossScaleTrainState",
  "is_overwrite_variable",
  "nnx_update",
  "nnx_value_and_grad",
]

# Flax's msgpack and state-dict serialization of a state with the record.
_telemetry.register_flax_serialization()


class LossScaleTrainState(train_state.TrainState):
  """A Flax ``TrainState`` whose ``tx`` holds a loss scale.

  ``apply_gradients`` takes gradients of the *scaled* loss (see
  :meth:`value_and_grad`): the optimizer unscales them, skips the step if
  they are not finite, and adjusts the scale. ``step`` counts applied steps
  only, as TensorFlow's global step (a skipped step leaves it unchanged);
  :attr:`diagnostics` has the skipped ones.
  """

  @classmethod
  def create(cls, *, apply_fn, params, tx, **kwargs):
    """As ``TrainState.create``; ``tx`` must contain one loss scale.

    ``tx`` is initialised on the whole of ``params``. With Flax's float8
    layers pass the whole variables dict, ``{'params': ...,
    '_overwrite_with_gradient': ...}`` (as Flax's ``TrainState`` expects): the
    loss scale keeps the float8 scales and amax histories from the inner
    optimizer (it holds no state for them), checks them and
    :meth:`apply_gradients` overwrites them.

    Raises:
      ValueError: ``tx`` holds no loss scale, or one inside an
        ``optax.MultiSteps`` while ``params`` hold float8 overwrite leaves.
    """
    opt_state = tx.init(params)
    _state.find_loss_scale_state(opt_state)  # a clear error if none
    _overwrite.find_overwrite_state(opt_state)  # refuses MultiSteps outside
    # An int32 array from the start: the same pytree (and checkpoint) before
    # and after the first step.
    return cls(
      step=jnp.zeros([], jnp.int32),
      apply_fn=apply_fn,
      params=params,
      tx=tx,
      opt_state=opt_state,
      **kwargs,
    )

  def apply_gradients(self, *, grads, value=None, **kwargs):
    """Applies gradients of the scaled loss (unless the step is skipped).

    ``grads`` have the tree of ``params``. Leaves of Flax's
    ``_overwrite_with_gradient`` collection are overwritten with their new
    values (:func:`optax_lossscale.apply_overwrites`), the others updated by
    ``tx``. ``value``, the loss, goes to ``tx.update`` as ``value=`` when
    given (a loss scale built with ``track_nonfinite=True`` records whether
    it was finite); other keyword arguments replace fields, as in Flax.
    """
    extra = {} if value is None else {"value": value}
    updates, new_opt_state = self.tx.update(grads, self.opt_state, self.params, **extra)
    new_params = _overwrite.apply_overwrites(
      optax.apply_updates(self.params, updates), new_opt_state
    )
    skipped = _state.diagnostics(new_opt_state)["last_step_skipped"]
    step = jnp.where(skipped, self.step, self.step + 1).astype(jnp.int32)
    return self.replace(step=step, params=new_params, opt_state=new_opt_state, **kwargs)

  @property
  def loss_scale(self) -> jax.Array:
    """The current float32 loss scale."""
    return _state.get_scale(self.opt_state)

  @property
  def diagnostics(self) -> dict[str, jax.Array]:
    """:func:`optax_lossscale.diagnostics` of the optimizer state."""
    return _state.diagnostics(self.opt_state)

  def value_and_grad(
    self, loss_fn: Callable[..., Any], *, has_aux: bool = False
  ) -> Callable[..., Any]:
    """``jax.value_and_grad(loss_fn)`` of the loss scaled by this state's scale.

    Returns ``g(params, *args, **kwargs) -> (loss_fn's output, scaled grads)``;
    pass the grads to :meth:`apply_gradients`.
    """
    scaled = _grad.value_and_grad(loss_fn, argnums=0, has_aux=has_aux)
    return lambda *args, **kwargs: scaled(self.opt_state, *args, **kwargs)


def nnx_value_and_grad(
  fun: Callable[..., Any],
  *,
  argnums: int | nnx.DiffState = 0,
  has_aux: bool = False,
) -> Callable[..., Any]:
  """``nnx.value_and_grad`` of ``fun``'s loss scaled by an optimizer's scale.

  Args:
    fun: the loss function of an ``nnx.Module`` (and more arguments).
    argnums: which argument is the module, as in ``nnx.value_and_grad``. An
      integer differentiates with respect to the optimizer's ``wrt``
      variables (``nnx.DiffState(argnums, optimizer.wrt)``), so that the
      gradients are those ``optimizer.update`` takes; an ``nnx.DiffState``
      is used as it is.
    has_aux: whether ``fun`` returns ``(loss, aux)``.

  Returns:
    ``g(optimizer, *args, **kwargs) -> (fun's output, scaled grads)`` where
    ``optimizer`` is the ``nnx.Optimizer`` whose ``tx`` holds the loss scale;
    pass the grads to ``optimizer.update(model, grads)``, or to
    :func:`nnx_update` with float8 overwrite variables.
  """

  def wrapper(optimizer, *args, **kwargs):
    scale = _grad.scale_for(optimizer, "nnx_value_and_grad(fun)")
    scaled = _grad.scaled_loss_fn(fun, scale, has_aux)
    wrt = getattr(optimizer, "wrt", None)
    diff = argnums
    if isinstance(argnums, int) and wrt is not None:
      diff = nnx.DiffState(argnums, wrt)
    (_, out), grads = nnx.value_and_grad(scaled, argnums=diff, has_aux=True)(
      *args, **kwargs
    )
    return out, grads

  return wrapper


def is_overwrite_variable(path: Any, value: Any) -> bool:
  """An NNX filter: the variables of Flax's ``_overwrite_with_gradient`` collection.

  ``nnx.bridge.ToNNX`` makes a Linen float8 layer's scales and amax
  histories variables of a type of that name. Use it in the optimizer's
  ``wrt``: ``nnx.Optimizer(model, tx, wrt=nnx.Any(nnx.Param,
  is_overwrite_variable))``.
  """
  del path
  return _overwrite.is_overwrite_variable(value)


def nnx_update(optimizer: nnx.Optimizer, model: nnx.Module, grads: Any, /, **kwargs):
  """``optimizer.update(model, grads)``, then the overwrite variables written.

  ``nnx.Optimizer.update`` adds the loss scale's updates to the variables
  its ``wrt`` selects: zeros for Flax's float8 overwrite variables. This
  then writes their new values into ``model``
  (:func:`optax_lossscale.apply_overwrites`): after an applied optimizer
  step only, so a skipped step keeps the old ones. Without overwrite
  variables it is ``optimizer.update``.

  Returns:
    The updates, as ``optimizer.update`` returns them.
  """
  updates = optimizer.update(model, grads, **kwargs)
  if _overwrite.find_overwrite_state(optimizer) is not None:
    graph = {"graph": optimizer.graph} if hasattr(optimizer, "graph") else {}
    params = nnx.as_pure(nnx.state(model, optimizer.wrt, **graph))
    nnx.update(model, _overwrite.apply_overwrites(params, optimizer))
  return updates
