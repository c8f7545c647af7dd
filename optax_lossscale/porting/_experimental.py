"""TensorFlow's deprecated ``experimental.LossScaleOptimizer`` constructor.

One ``loss_scale`` argument (``'dynamic'``, a number, a ``DynamicLossScale``
or a ``StaticLossScale``) translated into :class:`LossScaleOptimizer`'s
arguments; everything else is that class's.
"""

from __future__ import annotations

import inspect
from typing import Any

from optax_lossscale._base import tree as _tree
from optax_lossscale._base import validate as _validate
from optax_lossscale._loss_scale import config as _config
from optax_lossscale.porting import _keras, _loss_scale, _tf_rule
from optax_lossscale.porting._keras import LossScaleOptimizer

__all__ = ["ExperimentalLossScaleOptimizer"]


@_keras.documented_init
@_tree.rebuilt_as_itself
class ExperimentalLossScaleOptimizer(LossScaleOptimizer):
  """The deprecated ``tf.keras.mixed_precision.experimental.LossScaleOptimizer``.

  Its constructor takes one ``loss_scale`` argument instead of three:

  * ``'dynamic'``: ``LossScaleOptimizer(optimizer)``;
  * a number ``x``: ``LossScaleOptimizer(optimizer, dynamic=False,
    initial_scale=x)``;
  * a :class:`DynamicLossScale` (TensorFlow's names ``initial_loss_scale``,
    ``increment_period``, ``multiplier`` are accepted): its initial scale and
    growth interval; ``multiplier`` must be 2;
  * a :class:`StaticLossScale` with ``skip_nonfinite=False`` (TensorFlow's
    ``FixedLossScale``): its scale.

  ``get_config()`` equals that of the equivalent :class:`LossScaleOptimizer`.
  It subclasses :class:`LossScaleOptimizer`, not the other way round, as in
  TensorFlow.

  Example:
    >>> import optax_lossscale as ols
    >>> opt1 = ols.porting.ExperimentalLossScaleOptimizer("sgd", loss_scale=123)
    >>> opt2 = ols.porting.LossScaleOptimizer("sgd", dynamic=False, initial_scale=123)
    >>> opt1.get_config() == opt2.get_config()
    True
  """

  def __new__(cls, optimizer: Any, loss_scale: Any, **unexpected: Any):
    if unexpected:
      raise ValueError(_unexpected_message(optimizer, unexpected))
    kwargs = _from_loss_scale(loss_scale)
    return LossScaleOptimizer.__new__(cls, optimizer, **kwargs)


def _unexpected_message(optimizer: Any, unexpected: dict[str, Any]) -> str:
  """What to write instead: TensorFlow's deprecated constructor takes only
  ``optimizer`` and ``loss_scale``; ``LossScaleOptimizer`` takes the rest."""
  own = inspect.signature(LossScaleOptimizer.__new__).parameters
  theirs = {k: v for k, v in unexpected.items() if k in own}
  if not theirs:  # an optimizer's hyper-parameters
    return _keras.unexpected_message(
      optimizer, unexpected, owner="ExperimentalLossScaleOptimizer"
    )
  given = ", ".join(f"{k}={v!r}" for k, v in unexpected.items())
  return (
    f"ExperimentalLossScaleOptimizer got unexpected keyword argument(s) "
    f"{given}. TensorFlow's deprecated constructor takes only `optimizer` "
    "and `loss_scale`; for the other arguments write LossScaleOptimizer("
    f"optimizer, {', '.join(f'{k}={v!r}' for k, v in theirs.items())}, ...) "
    "(loss_scale=x is dynamic=False, initial_scale=x there)."
  )


def _from_loss_scale(loss_scale: Any) -> dict[str, Any]:
  if isinstance(loss_scale, str):
    if loss_scale != "dynamic":
      raise ValueError(
        f"`loss_scale` must be 'dynamic', a number or a LossScale; got the "
        f"string {loss_scale!r}."
      )
    return {}
  if isinstance(loss_scale, _loss_scale.DynamicLossScale):
    c = loss_scale.config
    if c.growth_factor != 2.0 or c.backoff_factor != 0.5:
      raise ValueError(
        "`loss_scale`: a DynamicLossScale passed to the Keras optimizer must "
        f"have multiplier 2 (growth_factor=2, backoff_factor=0.5); got "
        f"growth_factor={c.growth_factor}, backoff_factor={c.backoff_factor}."
      )
    defaults = (
      c.min_scale == _config.DEFAULT_MIN_SCALE
      and c.max_scale == _config.DEFAULT_MAX_SCALE
      and c.hysteresis == 1
    )
    if isinstance(c, _tf_rule.TFRuleConfig) or defaults:
      return {
        "initial_scale": c.initial_scale,
        "dynamic_growth_steps": c.growth_interval,
      }
    return {
      "initial_scale": c.initial_scale,
      "dynamic_growth_steps": c.growth_interval,
      "min_scale": c.min_scale,
      "max_scale": c.max_scale,
      "hysteresis": c.hysteresis,
    }
  if isinstance(loss_scale, _loss_scale.StaticLossScale):
    if loss_scale.config.skip_nonfinite:
      raise ValueError(
        "`loss_scale`: the Keras optimizer's fixed scale applies every step, "
        "as TensorFlow's FixedLossScale; pass StaticLossScale(x, "
        "skip_nonfinite=False), or use optax_lossscale.static_loss_scale for "
        "a fixed scale that skips non-finite steps."
      )
    return {"dynamic": False, "initial_scale": loss_scale.config.initial_scale}
  if isinstance(loss_scale, _loss_scale.LossScale):
    raise ValueError(
      f"`loss_scale` must be 'dynamic', a number, a DynamicLossScale or a "
      f"StaticLossScale; got {loss_scale!r}."
    )
  try:
    value = _validate.check_scale("loss_scale", loss_scale)
  except ValueError as e:
    raise ValueError(
      f"{e} (`loss_scale` must be 'dynamic', a positive number or a LossScale.)"
    ) from None
  return {"dynamic": False, "initial_scale": value}
