"""``with_loss_scale``: optax in the loss scale that a ``LossScale`` configures."""

from __future__ import annotations

from typing import Any

import optax

from optax_lossscale._loss_scale import config as _config
from optax_lossscale._loss_scale import transform as _transform
from optax_lossscale.porting._loss_scale import LossScale
from optax_lossscale.porting._tf_rule import TFRuleConfig

__all__ = ["with_loss_scale"]


def with_loss_scale(
  inner: optax.GradientTransformation,
  loss_scale: LossScale,
  *,
  axis_name: Any = None,
  track_nonfinite: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with the loss scale that ``loss_scale`` configures.

  The same transformation as :func:`~optax_lossscale.dynamic_loss_scale`
  (for a :class:`DynamicLossScale`) or
  :func:`~optax_lossscale.static_loss_scale` (for a
  :class:`StaticLossScale`); a :class:`NoOpLossScale` keeps one code path
  for float32/bfloat16 runs (scale 1, nothing unscaled, nothing skipped).
  Only the object's configuration is used: every ``init`` starts from fresh
  counters.

  Args:
    inner: the transformation to wrap (``optax.chain(...)`` included).
    loss_scale: a :class:`LossScale`.
    axis_name: the mapped axis (``pmap``/``shard_map``) to AND the finite flag
      over, so that every replica takes the same decision.
    track_nonfinite: keep a record of which gradient leaves were not finite
      (see :func:`~optax_lossscale.nonfinite_report`); with a
      :class:`NoOpLossScale` the gradients are then checked for the record
      alone.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaleState`.

  Raises:
    ValueError: ``loss_scale`` is not a :class:`LossScale`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from optax_lossscale.porting import NoOpLossScale, with_loss_scale
    >>> tx = with_loss_scale(optax.sgd(0.1), NoOpLossScale())
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> updates, state = tx.update({"w": jnp.ones(2)}, state)
    >>> updates["w"]
    Array([-0.1, -0.1], dtype=float32)
  """
  if not isinstance(loss_scale, LossScale):
    raise ValueError(
      "`loss_scale` must be a DynamicLossScale, StaticLossScale or "
      f"NoOpLossScale, got {loss_scale!r}."
    )
  config = loss_scale.config
  if isinstance(config, TFRuleConfig):
    # The core's rule, clamped to [min(1, initial), 2**126].
    config = _config.dynamic_config(
      config.initial_scale,
      config.growth_interval,
      config.growth_factor,
      config.backoff_factor,
      config.min_scale,
      config.max_scale,
    )
  return _transform.loss_scale_transformation(
    inner, config, axis_name=axis_name, track_nonfinite=track_nonfinite
  )
