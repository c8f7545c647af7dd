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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.training import train_state

from optax_lossscale import _grad, _state


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
    """As ``TrainState.create``; ``tx`` must contain one loss scale."""
    state = super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
    _state.find_loss_scale_state(state.opt_state)  # a clear error if none
    # An int32 array from the start: the same pytree (and checkpoint) before
    # and after the first step.
    return state.replace(step=jnp.zeros([], jnp.int32))

  def apply_gradients(self, *, grads, **kwargs):
    """Applies gradients of the scaled loss (unless the step is skipped)."""
    updates, new_opt_state = self.tx.update(grads, self.opt_state, self.params)
    new_params = optax.apply_updates(self.params, updates)
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
  argnums: int = 0,
  has_aux: bool = False,
) -> Callable[..., Any]:
  """``nnx.value_and_grad`` of ``fun``'s loss scaled by an optimizer's scale.

  Args:
    fun: the loss function of an ``nnx.Module`` (and more arguments).
    argnums: which argument is the module, as in ``nnx.value_and_grad``.
    has_aux: whether ``fun`` returns ``(loss, aux)``.

  Returns:
    ``g(optimizer, *args, **kwargs) -> (fun's output, scaled grads)`` where
    ``optimizer`` is the ``nnx.Optimizer`` whose ``tx`` holds the loss scale;
    pass the grads to ``optimizer.update(model, grads)``.
  """

  def wrapper(optimizer, *args, **kwargs):
    scale = _grad.scale_for(optimizer, "nnx_value_and_grad(fun)")
    scaled = _grad.scaled_loss_fn(fun, scale, has_aux)
    (_, out), grads = nnx.value_and_grad(scaled, argnums=argnums, has_aux=True)(
      *args, **kwargs
    )
    return out, grads

  return wrapper
