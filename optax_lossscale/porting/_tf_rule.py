"""TensorFlow's dynamic loss-scale rule, on the core's ``LossScaleState``.

``tf.compat.v1.mixed_precision.DynamicLossScale`` and tf_keras'
``LossScaleOptimizer`` (``_DynamicLossScaleState.update``): after
``growth_steps`` finite steps in a row the scale is multiplied by the
multiplier *if the product is finite* (else it stays), and a non-finite
step sets it to ``max(scale / multiplier, 1)``. There is no ceiling but
float32's and no floor but 1, applied on a backoff only: a scale that starts
below 1 grows from there and jumps to 1 at its first backoff. Here the
ceiling is ``2**126``: above it the scale's reciprocal, which multiplies
the gradients, is subnormal, and XLA and TensorFlow on a CPU flush it to
zero. The core's rule (:func:`optax_lossscale._loss_scale.core.adjust`)
clamps every change to ``[min_scale, max_scale]`` by default; TensorFlow's is its
``bounds="tensorflow"`` configuration, which this module builds for the
porting package.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from optax_lossscale._base import validate as _validate
from optax_lossscale._loss_scale import config as _config
from optax_lossscale._loss_scale.config import LossScaleConfig

__all__ = [
  "TFRuleConfig",
  "check_ceiling",
  "config",
  "fixed_config",
  "fixed_value",
  "keras_config",
]


@dataclasses.dataclass(frozen=True)
class TFRuleConfig(LossScaleConfig):
  """The configuration of a :class:`DynamicLossScale` that follows TensorFlow.

  Its fields are the core's (``growth_factor`` is TensorFlow's multiplier,
  ``backoff_factor`` its reciprocal; ``min_scale`` is ``min(1,
  initial_scale)`` and ``max_scale`` ``2**126``, what :func:`with_loss_scale`
  clamps to), its class says which rule :meth:`LossScale.adjust` runs:
  TensorFlow's (grow while the product is finite, back off to no less than
  1) rather than the core's clamped one: ``bounds="tensorflow"``, which
  :func:`optax_lossscale._loss_scale.core.adjust` reads.
  """

  bounds: str = "tensorflow"


def fixed_value(config: dict[str, Any]) -> float:
  """The scale of a ``FixedLossScale`` config (TensorFlow's or ours)."""
  for key in ("loss_scale_value", "scale"):
    if key in config:
      return config[key]
  raise ValueError(f"A fixed loss scale's config needs `loss_scale_value`: {config!r}.")


def fixed_config(scale: Any, skip_nonfinite: Any) -> LossScaleConfig:
  """The core's fixed-scale configuration, for a float32 scale in
  ``[2**-126, 2**126]``. TensorFlow's ``FixedLossScale`` takes any value up
  to float32's largest, but above ``2**126`` the reciprocal the gradients
  are multiplied by is subnormal, which XLA and TensorFlow on a CPU flush to
  zero: every update would be zero. Refused, as the core refuses it."""
  return _config.static_config(_validate.check_scale("scale", scale), skip_nonfinite)


def config(kwargs: dict[str, Any]) -> TFRuleConfig:
  """A validated :class:`TFRuleConfig`: a positive float32 initial scale up
  to ``2**126``, an integer growth interval, a multiplier above 1."""
  initial = _validate.as_f32("initial_scale", kwargs["initial_scale"])
  if initial <= 0:
    raise ValueError(f"`initial_scale` must be positive, got {initial!r}.")
  initial = check_ceiling("initial_scale", initial)
  growth = _validate.int_in("growth_interval", kwargs["growth_interval"], 1)
  multiplier = _validate.as_f32("growth_factor", kwargs["growth_factor"])
  if multiplier <= 1:
    raise ValueError(f"`growth_factor` must be > 1 in float32, got {multiplier!r}.")
  _, hi = _validate.SCALE_RANGE
  return TFRuleConfig(
    initial_scale=initial,
    growth_interval=growth,
    growth_factor=multiplier,
    backoff_factor=_validate.as_f32("backoff_factor", 1.0 / multiplier),
    min_scale=min(1.0, initial),
    max_scale=hi,
  )


def keras_config(
  initial_scale: float, growth_steps: int | None, *, legacy: bool
) -> TFRuleConfig:
  """The configuration of tf_keras' and Keras 3's loss scale: multiplier 2,
  ``growth_steps`` finite steps before growing, or ``None`` for a fixed
  scale that applies every step (as TensorFlow's fixed scale does).

  tf_keras (``legacy``) floors a backoff at 1 (``bounds="tensorflow"``);
  Keras 3 halves with no floor (``bounds="keras"``), so that a scale below
  1 keeps halving, as in Keras 3, down to ``2**-126``: below it the scale
  is a subnormal float32 number and then 0, whose reciprocal makes every
  gradient NaN, and every later step would be skipped.
  """
  lo, hi = _validate.SCALE_RANGE
  dynamic = growth_steps is not None
  return TFRuleConfig(
    initial_scale=initial_scale,
    growth_interval=growth_steps if dynamic else 1,
    min_scale=min(1.0, initial_scale) if legacy else lo,
    max_scale=hi,
    dynamic=dynamic,
    skip_nonfinite=dynamic,
    bounds="tensorflow" if legacy else "keras",
  )


def check_ceiling(name: str, value: float) -> float:
  """``value`` unless it is above ``2**126``, whose reciprocal is subnormal."""
  _, hi = _validate.SCALE_RANGE
  if value > hi:
    raise ValueError(
      f"`{name}` must be at most 2**126, got {value!r}: the gradients are "
      "multiplied by the scale's reciprocal, which above 2**126 is a "
      "subnormal float32 number that XLA and TensorFlow flush to zero on a "
      "CPU, so every update would be zero (TensorFlow takes such a scale, "
      "and does that)."
    )
  return value
