"""``LossScaleOptimizer`` around an optax transformation: the core's loss scale.

An inner optimizer given as an optax transformation has no Keras formula to
follow: the base arguments become optax pieces chained around it (clipping
before, Keras' decoupled weight decay and the moving average of the weights
after, ``optax.MultiSteps`` for accumulation, all inside
:func:`master_weights` when the inner optimizer is one), and the whole is
wrapped in the core's ``loss_scale_transformation`` (its rule and clamps).
"""

from __future__ import annotations

from typing import Any

import optax

from optax_lossscale._base import tree as _tree
from optax_lossscale._loss_scale import transform as _transform
from optax_lossscale._loss_scale.config import LossScaleConfig
from optax_lossscale._params.low_precision import (
  KahanSummationState,
  StochasticRoundingState,
)
from optax_lossscale._params.master import MasterWeights, master_weights
from optax_lossscale.porting import _ema, _optimizers
from optax_lossscale.porting._tf_step import UnscaledGradients

__all__ = ["build"]


def _rounding_stays_last(
  inner: optax.GradientTransformation, after: list[str]
) -> optax.GradientTransformationExtraArgs:
  """``inner``, whose ``init`` refuses a rounding transformation in its
  state: what the facade adds after ``inner`` (``after``: weight decay, the
  EMA) would change the updates after they were rounded."""
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    state = inner.init(params)
    found = _tree.find_all(
      state, lambda x: isinstance(x, (StochasticRoundingState, KahanSummationState))
    )
    if found:
      kind = type(found[0][1]).__name__.removesuffix("State")
      raise ValueError(
        f"LossScaleOptimizer({', '.join(after)}) would act after the inner "
        f"optimizer's rounding ({kind}), which must come last: the decay or "
        "average would be rounded away or break what the rounding keeps. "
        "Pass master_weights(<the inner optimizer without the rounding>) "
        "instead (weight decay and EMA then act on the float32 master "
        "weights, before rounding), or put them in your chain before the "
        "rounding yourself (decoupled decay for Adam: optax.adamw(..., "
        "weight_decay=...)) and leave these arguments out."
      )
    return state

  return optax.GradientTransformationExtraArgs(init_fn, inner.update)


def build(
  inner: Any,
  config: LossScaleConfig,
  *,
  weight_decay: float | None,
  clipnorm: float | None,
  clipvalue: float | None,
  global_clipnorm: float | None,
  use_ema: bool,
  ema_momentum: float,
  ema_overwrite_frequency: int | None,
  loss_scale_factor: float | None,
  gradient_accumulation_steps: int | None,
  axis_name: Any,
  track_nonfinite: bool,
) -> optax.GradientTransformationExtraArgs:
  """The chain, innermost first, inside the core's loss scale (``config``);
  its ``update`` refuses gradients marked unscaled."""
  store = inner.store if isinstance(inner, MasterWeights) else None
  body = inner.inner if store is not None else inner
  after = [
    f"{k}={v!r}" for k, v in (("weight_decay", weight_decay), ("use_ema", use_ema)) if v
  ]
  if after:
    body = _rounding_stays_last(body, after)
  if weight_decay:
    body = _optimizers.decoupled_weight_decay(body, weight_decay)
  if use_ema:
    body = optax.chain(
      body,
      _ema.ema_params(ema_momentum, overwrite_frequency=ema_overwrite_frequency),
    )
  if clipnorm is not None:
    body = optax.chain(_optimizers.clip_each_by_norm(clipnorm), body)
  elif clipvalue is not None:
    body = optax.chain(optax.clip(clipvalue), body)
  elif global_clipnorm is not None:
    body = optax.chain(optax.clip_by_global_norm(global_clipnorm), body)
  if gradient_accumulation_steps is not None:
    body = optax.MultiSteps(body, gradient_accumulation_steps).gradient_transformation()
  if store is not None:
    body = master_weights(body, store=store)
  # The factor is divided out with the loss scale, before the finite check,
  # so the check sees what is applied.
  tx = _transform.loss_scale_transformation(
    body,
    config,
    axis_name=axis_name,
    factor=loss_scale_factor,
    track_nonfinite=track_nonfinite,
  )

  def update(updates, state, params=None, **extra):
    if isinstance(updates, UnscaledGradients):
      raise ValueError(
        "update() takes the gradients of the scaled loss, and these were "
        "unscaled by get_unscaled_gradients(): dividing them again would "
        "make the step the loss scale times too small. Pass the scaled "
        "gradients to update(), or give the inner optimizer by its Keras "
        "name and call apply_gradients(unscaled, state, params)."
      )
    return tx.update(updates, state, params, **extra)

  return optax.GradientTransformationExtraArgs(tx.init, update)
