"""TensorFlow's dynamic loss-scale rule, on the core's ``LossScaleState``.

``tf.compat.v1.mixed_precision.DynamicLossScale`` and tf_keras'
``LossScaleOptimizer`` (``_DynamicLossScaleState.update``): after
``growth_steps`` finite steps in a row the scale is multiplied by the
multiplier *if the product is finite* (else it stays), and a non-finite
step sets it to ``max(scale / multiplier, 1)``. There is no ceiling but
float32's and no floor but 1, applied on a backoff only: a scale that starts
below 1 grows from there and jumps to 1 at its first backoff. The core's
rule (:func:`optax_lossscale._core.adjust`) clamps every change to
``[min_scale, max_scale]`` instead; this is TensorFlow's, for the porting
package.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_lossscale import _validate
from optax_lossscale._config import LossScaleConfig
from optax_lossscale._core import LossScaleState

__all__ = ["TFRuleConfig", "config", "fixed_value", "initial_state", "tf_adjust"]

_F32 = jnp.float32
_I32 = jnp.int32


def initial_state(scale: float, inner_state: Any = None) -> LossScaleState:
  """A fresh state at ``scale`` (any positive finite float32 number)."""
  return LossScaleState(
    loss_scale=jnp.asarray(scale, _F32),
    good_steps=jnp.zeros([], _I32),
    hysteresis_left=jnp.ones([], _I32),
    skipped_steps=jnp.zeros([], _I32),
    consecutive_skips=jnp.zeros([], _I32),
    inner_state=inner_state,
  )


def tf_adjust(
  state: LossScaleState,
  finite: Any,
  growth_steps: int | None,
  multiplier: float = 2.0,
  *,
  skip_nonfinite: bool = True,
) -> tuple[LossScaleState, jax.Array]:
  """The next state under TensorFlow's rule, and whether to apply the step.

  Args:
    state: the state whose scale produced this step's gradients.
    finite: whether they were all finite (a bool scalar).
    growth_steps: TensorFlow's ``increment_period``/``dynamic_growth_steps``;
      ``None`` for a fixed scale (the scale and counter never change).
    multiplier: the growth factor, whose reciprocal is the backoff.
    skip_nonfinite: whether a non-finite step is skipped (a fixed scale in
      TensorFlow applies every step).

  Returns:
    ``(new state, should_apply)``; ``inner_state`` is left as it is, the
    skip counters are kept as the core keeps them.
  """
  finite = jnp.asarray(finite, jnp.bool_)
  should_apply = finite if skip_nonfinite else jnp.array(True)
  s = state
  scale = s.loss_scale
  good = s.good_steps
  if growth_steps is not None:
    m = jnp.asarray(multiplier, _F32)
    grow = finite & (s.good_steps + 1 >= growth_steps)
    grown = scale * m
    backed_off = jnp.maximum(scale / m, jnp.ones([], _F32))
    scale = jnp.where(
      grow,
      jnp.where(jnp.isfinite(grown), grown, scale),
      jnp.where(finite, scale, backed_off),
    ).astype(_F32)
    good = jnp.where(finite & ~grow, s.good_steps + 1, 0).astype(_I32)
  skipped = jnp.logical_not(should_apply)
  new = s._replace(
    loss_scale=scale,
    good_steps=good,
    skipped_steps=jnp.where(
      skipped, optax.safe_increment(s.skipped_steps), s.skipped_steps
    ),
    consecutive_skips=jnp.where(
      skipped, optax.safe_increment(s.consecutive_skips), 0
    ).astype(_I32),
  )
  return new, should_apply


@dataclasses.dataclass(frozen=True)
class TFRuleConfig(LossScaleConfig):
  """The configuration of a :class:`DynamicLossScale` that follows TensorFlow.

  Its fields are the core's (``growth_factor`` is TensorFlow's multiplier,
  ``backoff_factor`` its reciprocal; ``min_scale`` is ``min(1,
  initial_scale)`` and ``max_scale`` ``2**126``, what :func:`with_loss_scale`
  clamps to), its class says which rule :meth:`LossScale.adjust` runs:
  TensorFlow's (grow while the product is finite, back off to no less than
  1) rather than the core's clamped one.
  """


def fixed_value(config: dict[str, Any]) -> float:
  """The scale of a ``FixedLossScale`` config (TensorFlow's or ours)."""
  for key in ("loss_scale_value", "scale"):
    if key in config:
      return config[key]
  raise ValueError(f"A fixed loss scale's config needs `loss_scale_value`: {config!r}.")


def config(kwargs: dict[str, Any]) -> TFRuleConfig:
  """A validated :class:`TFRuleConfig`: any positive finite float32 initial
  scale, an integer growth interval, a multiplier above 1."""
  initial = _validate.as_f32("initial_scale", kwargs["initial_scale"])
  if initial <= 0:
    raise ValueError(f"`initial_scale` must be positive, got {initial!r}.")
  growth = _validate.int_in("growth_interval", kwargs["growth_interval"], 1)
  multiplier = _validate.as_f32("growth_factor", kwargs["growth_factor"])
  if multiplier <= 1:
    raise ValueError(f"`growth_factor` must be > 1 in float32, got {multiplier!r}.")
  lo, hi = _validate.SCALE_RANGE
  return TFRuleConfig(
    initial_scale=initial,
    growth_interval=growth,
    growth_factor=multiplier,
    backoff_factor=_validate.as_f32("backoff_factor", 1.0 / multiplier),
    min_scale=min(1.0, initial),
    max_scale=max(hi, initial),
  )
