"""The hyper-parameters of a loss scale: their defaults, validated into a config.

A :class:`LossScaleConfig` holds Python numbers only: the transformations
close over it, and the ``LossScale`` objects keep it as static pytree
metadata, so ``jax.jit`` can neither trace nor drop a hyper-parameter.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from optax_lossscale._base import validate as _validate

__all__ = [
  "DEFAULT_BACKOFF_FACTOR",
  "DEFAULT_GROWTH_FACTOR",
  "DEFAULT_GROWTH_INTERVAL",
  "DEFAULT_INITIAL_SCALE",
  "DEFAULT_MAX_SCALE",
  "DEFAULT_MIN_SCALE",
  "NOOP_CONFIG",
  "LossScaleConfig",
  "dynamic_config",
  "static_config",
]

#: The scale a fresh dynamic state starts from (TensorFlow's and Keras').
DEFAULT_INITIAL_SCALE = 2.0**15
#: Finite steps in a row before the scale grows (TensorFlow's and Keras').
DEFAULT_GROWTH_INTERVAL = 2000
DEFAULT_GROWTH_FACTOR = 2.0
DEFAULT_BACKOFF_FACTOR = 0.5
#: Default floor of the dynamic scale. Below 1 a loss scale no longer protects
#: small gradients from underflow; a model that keeps overflowing at scale 1
#: is broken, and ``consecutive_skips`` says so.
DEFAULT_MIN_SCALE = 1.0
#: Default ceiling of the dynamic scale: finite, so a long run of finite steps
#: can never make it ``inf`` (an ``inf`` scale never comes back down).
DEFAULT_MAX_SCALE = 2.0**24


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
  """Static hyper-parameters of a loss scale (hashable, never traced).

  Build one with :func:`dynamic_config` or :func:`static_config`, which
  validate every field; the dataclass itself does not.

  Attributes:
    initial_scale: the scale a fresh state starts from.
    growth_interval: finite steps in a row after which the scale grows.
    growth_factor: factor applied on growth.
    backoff_factor: factor applied on a non-finite step (after hysteresis).
    min_scale: floor of the scale.
    max_scale: ceiling of the scale.
    hysteresis: non-finite steps tolerated before the scale backs off.
    dynamic: whether the scale ever changes.
    skip_nonfinite: whether a step with non-finite gradients is skipped.
    noop: the scale is 1 and nothing is unscaled or checked.
    bounds: how the bounds apply to a dynamic scale. ``"clamp"`` (the
      default): every new scale is clipped to ``[min_scale, max_scale]``.
      ``"tensorflow"``: TensorFlow's rule: the scale grows only where the
      grown value is at most ``max_scale`` (TensorFlow's: a finite
      float32), a backoff divides by ``growth_factor`` and floors at 1, and
      nothing else moves the scale, so an initial scale is kept until it
      grows or backs off; a fixed scale keeps the state's scale and counter.
      ``"keras"``: the same, but a backoff divides and floors at
      ``min_scale`` (Keras 3's ``LossScaleOptimizer`` has no floor: a scale
      below 1 keeps halving).
  """

  initial_scale: float = DEFAULT_INITIAL_SCALE
  growth_interval: int = DEFAULT_GROWTH_INTERVAL
  growth_factor: float = DEFAULT_GROWTH_FACTOR
  backoff_factor: float = DEFAULT_BACKOFF_FACTOR
  min_scale: float = DEFAULT_MIN_SCALE
  max_scale: float = DEFAULT_MAX_SCALE
  hysteresis: int = 1
  dynamic: bool = True
  skip_nonfinite: bool = True
  noop: bool = False
  bounds: str = "clamp"

  def __post_init__(self):
    if self.bounds not in BOUNDS:
      raise ValueError(f"`bounds` must be one of {BOUNDS}, got {self.bounds!r}.")


#: How the bounds apply to a dynamic scale (:class:`LossScaleConfig`'s ``bounds``).
BOUNDS = ("clamp", "tensorflow", "keras")


def dynamic_config(
  initial_scale: float = DEFAULT_INITIAL_SCALE,
  growth_interval: int = DEFAULT_GROWTH_INTERVAL,
  growth_factor: float = DEFAULT_GROWTH_FACTOR,
  backoff_factor: float = DEFAULT_BACKOFF_FACTOR,
  min_scale: float = DEFAULT_MIN_SCALE,
  max_scale: float = DEFAULT_MAX_SCALE,
  hysteresis: int = 1,
) -> LossScaleConfig:
  """A validated dynamic configuration; every error names the argument.

  Every float is validated and stored as the float32 number the computation
  uses.

  Raises:
    ValueError: a scale outside ``[2**-126, 2**126]``, ``growth_interval`` or
      ``hysteresis`` below 1, ``growth_factor <= 1``, ``backoff_factor``
      outside ``(0, 1)``, ``min_scale > max_scale`` or ``initial_scale``
      outside ``[min_scale, max_scale]``.
  """
  initial_scale = _validate.check_scale("initial_scale", initial_scale)
  min_scale = _validate.check_scale("min_scale", min_scale)
  max_scale = _validate.check_scale("max_scale", max_scale)
  growth_interval = _validate.int_in("growth_interval", growth_interval, 1)
  # Validated as the float32 numbers that multiply the scale: 1 + 1e-9 is
  # 1.0 there, and the scale would never grow (or back off).
  given = growth_factor
  growth_factor = _validate.as_f32("growth_factor", growth_factor)
  if growth_factor <= 1.0:
    raise ValueError(
      f"`growth_factor` must be > 1 in float32, got {given!r} (float32: "
      f"{growth_factor!r})."
    )
  given = backoff_factor
  backoff_factor = _validate.as_f32("backoff_factor", backoff_factor)
  if not 0.0 < backoff_factor < 1.0:
    raise ValueError(
      "`backoff_factor` must be in the open interval (0, 1) in float32, got "
      f"{given!r} (float32: {backoff_factor!r})."
    )
  if min_scale > max_scale:
    raise ValueError(
      f"`min_scale` ({min_scale}) must not exceed `max_scale` ({max_scale})."
    )
  if not min_scale <= initial_scale <= max_scale:
    raise ValueError(
      f"`initial_scale` ({initial_scale}) must lie in [min_scale, max_scale]"
      f" = [{min_scale}, {max_scale}]."
    )
  hysteresis = _validate.int_in("hysteresis", hysteresis, 1)
  return LossScaleConfig(
    initial_scale=initial_scale,
    growth_interval=growth_interval,
    growth_factor=growth_factor,
    backoff_factor=backoff_factor,
    min_scale=min_scale,
    max_scale=max_scale,
    hysteresis=hysteresis,
  )


def static_config(scale: float, skip_nonfinite: bool = True) -> LossScaleConfig:
  """A validated fixed-scale configuration."""
  scale = _validate.check_scale("scale", scale)
  if not isinstance(skip_nonfinite, (bool, np.bool_)):
    raise ValueError(f"`skip_nonfinite` must be a bool, got {skip_nonfinite!r}.")
  return LossScaleConfig(
    initial_scale=scale,
    min_scale=scale,
    max_scale=scale,
    dynamic=False,
    skip_nonfinite=bool(skip_nonfinite),
  )


#: Scale 1, nothing unscaled or checked, every step applied.
NOOP_CONFIG = LossScaleConfig(
  initial_scale=1.0,
  min_scale=1.0,
  max_scale=1.0,
  dynamic=False,
  skip_nonfinite=False,
  noop=True,
)
