"""TensorFlow's ``enable_mixed_precision_graph_rewrite``: autocast and a loss scale."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from optax_lossscale._autocast.transform import autocast
from optax_lossscale._loss_scale import config as _config
from optax_lossscale._loss_scale import transform as _transform

__all__ = ["enable_mixed_precision"]

_LOG = logging.getLogger("optax_lossscale")


def enable_mixed_precision(
  fun: Callable[..., Any],
  optimizer: Any,
  *,
  compute_dtype: Any = None,
  **loss_scale_kwargs: Any,
) -> tuple[Callable[..., Any], Any]:
  """TensorFlow's ``enable_mixed_precision_graph_rewrite``: autocast and a loss scale.

  Returns ``(autocast(fun), loss-scaled optimizer)`` in one call. Without
  ``compute_dtype`` the dtype is the backend's (:func:`default_half_dtype`):
  float16 with dynamic loss scaling on GPUs, bfloat16 *without* loss scaling
  on CPUs and TPUs (bfloat16 needs none, and float16 is slow there). The
  choice is logged at INFO level on the ``optax_lossscale`` logger and
  readable as ``fast.compute_dtype``; pass ``compute_dtype=jnp.float16`` to
  get loss scaling on a CPU.

  Args:
    fun: the float32 function to run in mixed precision (a model's apply or
      loss function).
    optimizer: the bare optax transformation to wrap (not one that already
      holds a loss scale: its ``init`` would raise).
    compute_dtype: the half dtype (default: :func:`default_half_dtype`).
    **loss_scale_kwargs: passed to :func:`dynamic_loss_scale`; with
      bfloat16 only ``track_nonfinite`` is accepted (the no-op scale keeps
      the record too).

  Returns:
    ``(fast, tx)``: ``fast = autocast(fun, compute_dtype=...)``; with float16,
    ``tx = dynamic_loss_scale(optimizer, **loss_scale_kwargs)``; with
    bfloat16, ``optimizer`` wrapped in a :class:`NoOpLossScale` (the same
    code path, scale 1).
  """
  fast = autocast(fun, compute_dtype=compute_dtype)
  half = fast.compute_dtype
  if half == jnp.float16:
    tx = _transform.dynamic_loss_scale(optimizer, **loss_scale_kwargs)
  else:
    # The record is not about the scale: a bfloat16 run keeps it too.
    track = loss_scale_kwargs.pop("track_nonfinite", False)
    if loss_scale_kwargs:
      raise ValueError(
        f"Loss-scale arguments {sorted(loss_scale_kwargs)} given, but "
        f"{half.name} does not need loss scaling."
      )
    tx = _transform.loss_scale_transformation(
      optimizer, _config.NOOP_CONFIG, track_nonfinite=track
    )
  chosen = (
    "given" if compute_dtype is not None else f"the {jax.default_backend()} default"
  )
  _LOG.info(
    "enable_mixed_precision: compute dtype %s (%s), %s.",
    half.name,
    chosen,
    "dynamic loss scaling" if half == jnp.float16 else "no loss scaling",
  )
  return fast, tx
