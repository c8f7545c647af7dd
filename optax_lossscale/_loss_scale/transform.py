"""The loss-scale optax transformations: any optax transformation, loss-scaled.

:func:`dynamic_loss_scale` and :func:`static_loss_scale` validate their
hyper-parameters into a ``LossScaleConfig`` and build the one
transformation, :func:`loss_scale_transformation`, whose ``update``
validates the gradients once and calls the core (unscale, check, adjust),
the non-finite record and the skip. The porting package's
``with_loss_scale`` and ``LossScaleOptimizer`` build it too.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_lossscale._base import opt_state as _opt_state
from optax_lossscale._base import tree as _tree
from optax_lossscale._base.init_memo import InitMemo
from optax_lossscale._loss_scale import config as _config
from optax_lossscale._loss_scale import core as _core
from optax_lossscale._loss_scale import half_state as _half_state
from optax_lossscale._loss_scale import overwrite as _overwrite
from optax_lossscale._loss_scale import plan as _plan
from optax_lossscale._loss_scale import search as _search
from optax_lossscale._loss_scale import skip as _skip
from optax_lossscale._loss_scale import telemetry as _telemetry
from optax_lossscale._loss_scale.config import LossScaleConfig
from optax_lossscale._loss_scale.core import LossScaleState

__all__ = [
  "dynamic_loss_scale",
  "loss_scale_transformation",
  "static_loss_scale",
]


def _validate_grads(grads: Any, params: Any) -> None:
  """The one validation of an update's gradients, with readable errors at trace time.

  Every leaf must be an array (:func:`_tree.array_leaves`), and with
  ``params`` the tree must have the parameters' structure and shapes
  (:func:`_tree.check_grads`).
  """
  _tree.array_leaves(grads)
  _tree.check_grads(grads, params)


_HALF_STATE_MESSAGE = (
  "master_weights sits after a transformation whose state holds the "
  "gradients in half precision (optax.trace or scale_by_adam in a chain "
  "before it, say): the loss scale hands the gradients over in their own "
  "dtype, so that this state keeps its dtypes, and small gradients are "
  "lost in it. Put master_weights around the whole optimizer: "
  "dynamic_loss_scale(master_weights(optax.chain(...), ...))."
)


def loss_scale_transformation(
  inner: optax.GradientTransformation,
  config: LossScaleConfig,
  *,
  axis_name: Any = None,
  factor: float | None = None,
  track_nonfinite: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """The loss-scaled transformation for a validated ``config``.

  What :func:`dynamic_loss_scale`, :func:`static_loss_scale` and the
  porting package's ``with_loss_scale`` and ``LossScaleOptimizer`` return.
  ``factor`` is the Keras facade's ``loss_scale_factor``, divided out after
  the scale; ``track_nonfinite`` keeps a :class:`NonFiniteRecord` in the
  state.
  """
  if not (
    callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))
  ):
    raise ValueError(f"`inner` must be an optax GradientTransformation, got {inner!r}.")
  if not isinstance(track_nonfinite, bool):
    raise ValueError(f"`track_nonfinite` must be a bool, got {track_nonfinite!r}.")
  inner = optax.with_extra_args_support(inner)
  # What the inner init makes, remembered for the update's state check.
  memo = InitMemo(inner.init)
  recorded = optax.GradientTransformationExtraArgs(
    lambda params: memo.record(params, inner.init(params)), inner.update
  )
  # The inner transformation on the other leaves, when the parameters hold
  # leaves that Flax overwrites with their new value (float8 meta).
  overwriting = _overwrite.with_overwrites(recorded)

  def init_fn(params):
    has_overwrites = _overwrite.overwrite_mask(params) is not None
    inner_state = (overwriting if has_overwrites else recorded).init(params)
    nested = _tree.find_all(inner_state, _search.is_loss_scale_state)
    if nested:
      paths = ", ".join(".inner_state" + jax.tree_util.keystr(p) for p, _ in nested)
      raise ValueError(
        "The optimizer wrapped in this loss scale holds another loss scale "
        f"(at {paths}). Two loss scales in one optimizer state cannot work: "
        "get_scale cannot tell which one to scale the loss with, and unless "
        "one is a NoOpLossScale the gradients are unscaled twice, making "
        "every update the loss scale times too small. Wrap the bare optax "
        "optimizer in one loss scale only, e.g. "
        "dynamic_loss_scale(optax.adam(1e-3)); LossScaleOptimizer and "
        "enable_mixed_precision add their own, so give them the bare one too."
      )
    _half_state.warn_half_state(params, inner_state)
    record = _telemetry.initial_record(params) if track_nonfinite else None
    return _core.initial_state(config, inner_state, record)

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, LossScaleState):
      raise ValueError(
        "The loss-scaled optimizer expects the LossScaleState made by its "
        f"own init(); got a state of type {type(state).__name__}. Was this "
        "state produced by another optimizer?"
        f"{_tree.restored_hint(state)}"
      )
    _validate_grads(updates, params)
    if track_nonfinite and state.nonfinite is None:
      raise ValueError(
        "This loss scale was built with track_nonfinite=True but the state "
        "holds no non-finite record: it was made by a loss scale without it. "
        "Init a fresh state with this optimizer (or restore into one)."
      )
    scale = state.loss_scale
    # Flax's float8 overwrite leaves (new values, not gradients): never
    # unscaled and never seen by `inner`, but checked with the gradients.
    plan = _plan.plan_of(state.inner_state, updates)  # what loss_scale_plan prints
    if not config.noop and any(  # NoOpLossScale hands every leaf over as it is
      leaf.handed_over == _plan.HALF_STATE_FIRST for leaf in plan.leaves
    ):
      warnings.warn(
        _HALF_STATE_MESSAGE, _half_state.HalfPrecisionStateWarning, stacklevel=2
      )
    mask = plan.overwrite
    body = inner if mask is None else overwriting
    if mask is None:
      inner_state = _opt_state.check_inner_state(
        "this loss scale", memo, state.inner_state, updates, params
      )
    else:
      regular_params = None if params is None else _overwrite.split(params, mask)[0]
      inner_state = state.inner_state._replace(
        inner_state=_opt_state.check_inner_state(
          "this loss scale",
          memo,
          state.inner_state.inner_state,
          _overwrite.split(updates, mask)[0],
          regular_params,
        )
      )
    state = state._replace(inner_state=inner_state)  # as init made it

    def as_checked(tree):  # float8 meta values as the floats they hold
      return tree if mask is None else _overwrite.as_floats(tree)

    def step(float32):
      """Unscale, check, adjust, record, skip, with ``float32`` marking the
      leaves handed over unscaled in float32."""

      def unscaled(g):
        return _core.unscale_tree(g, scale, factor, keep=mask, float32=float32)

      grads = updates if config.noop else unscaled(updates)
      if config.noop and not track_nonfinite:
        finite = jnp.array(True)  # nothing is checked
      else:
        try:
          finite = _core.check(
            as_checked(updates),
            as_checked(grads),
            config,
            axis_name,
            factor=factor,
            loss_scale=scale,
          )
        except ValueError as e:
          if not config.noop:
            raise
          raise ValueError(
            "NoOpLossScale skips nothing, but its non-finite record needs one "
            "flag for all devices. " + str(e).replace("skip the step", "record it")
          ) from None
      new_state, should_apply = _core.adjust(state, finite, config)
      if track_nonfinite:
        record = _telemetry.note(
          state.nonfinite,
          finite,
          updates,
          lambda g: as_checked(unscaled(g)),  # what the check read
          extra_args.get("value"),
          scale,
          axis_name,
          params,
        )
        new_state = new_state._replace(nonfinite=record)
      keep = float32 is not None  # the inner state must keep its dtypes
      try:
        if config.skip_nonfinite:
          new_updates, new_inner = _skip.apply_or_skip(
            body,
            should_apply,
            grads,
            state.inner_state,
            params,
            extra_args,
            keep,
            stacklevel=4,  # the code that called update
          )
        else:
          new_updates, new_inner = body.update(
            grads, state.inner_state, params, **extra_args
          )
          if keep and _skip.dtypes_changed(state.inner_state, new_inner):
            raise _skip.StateDtypesChanged
      except (ValueError, TypeError) as e:
        _opt_state.blame_none_gradients(updates, params, e)
        raise
      return new_updates, new_state._replace(inner_state=new_inner)

    # The leaves an inner state keeps float32 master weights of
    # (master_weights, at any depth) take their gradients unscaled in
    # float32; every other leaf keeps its dtype, and so does one whose
    # gradients a half-precision state before master_weights holds (the
    # plan says which). Should the inner state change dtype all the same
    # (a half-precision state leaf of no parameter, holding gradients),
    # the inner update is traced again without float32 leaves.
    try:
      return step(plan.float32)
    except _skip.StateDtypesChanged:
      warnings.warn(
        _HALF_STATE_MESSAGE, _half_state.HalfPrecisionStateWarning, stacklevel=2
      )
      return step(None)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def dynamic_loss_scale(
  inner: optax.GradientTransformation,
  *,
  initial_scale: float = _config.DEFAULT_INITIAL_SCALE,
  growth_interval: int = _config.DEFAULT_GROWTH_INTERVAL,
  growth_factor: float = _config.DEFAULT_GROWTH_FACTOR,
  backoff_factor: float = _config.DEFAULT_BACKOFF_FACTOR,
  min_scale: float = _config.DEFAULT_MIN_SCALE,
  max_scale: float = _config.DEFAULT_MAX_SCALE,
  hysteresis: int = 1,
  axis_name: Any = None,
  track_nonfinite: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """Dynamic loss scaling around any optax transformation.

  The scale doubles after ``growth_interval`` finite steps in a row and halves
  on a non-finite step, which is skipped (the documentation's "exact rule"). With
  ``hysteresis=1`` this is exactly Keras 3 ``LossScaleOptimizer`` and
  ``torch.amp.GradScaler``; with ``hysteresis > 1``, Megatron-LM's
  ``DynamicGradScaler``. The scale is clamped to ``[min_scale, max_scale]``.

  Args:
    inner: the transformation to wrap.
    initial_scale: the starting scale.
    growth_interval: finite steps in a row before the scale grows.
    growth_factor: growth multiplier, > 1.
    backoff_factor: backoff multiplier, in (0, 1).
    min_scale: floor of the scale (positive, normal float32).
    max_scale: ceiling of the scale (finite).
    hysteresis: non-finite steps tolerated before backing off.
    axis_name: mapped axis to AND the finite flag over (pmap/shard_map).
    track_nonfinite: record, in the state, which gradient leaves were not
      finite on which steps, NaN or infinity, and whether the loss (passed
      to ``update`` as ``value=``) was itself not finite; read it with
      :func:`nonfinite_report`. Finite steps do none of this work.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; its ``update`` takes
    gradients of the scaled loss (see :func:`value_and_grad`).

  Raises:
    ValueError: an invalid hyper-parameter (the message names it).

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=8.0)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
    >>> loss, grads = ols.value_and_grad(loss_fn)(state, params)
    >>> grads["w"]  # gradients of 8 * loss
    Array([16., 16.], dtype=float32)
    >>> updates, state = jax.jit(tx.update)(grads, state, params)
    >>> updates["w"]  # sgd on the unscaled gradients
    Array([-0.2, -0.2], dtype=float32)

  References:
    Micikevicius et al., 2018, "Mixed Precision Training",
    https://arxiv.org/abs/1710.03740
  """
  config = _config.dynamic_config(
    initial_scale,
    growth_interval,
    growth_factor,
    backoff_factor,
    min_scale,
    max_scale,
    hysteresis,
  )
  return loss_scale_transformation(
    inner, config, axis_name=axis_name, track_nonfinite=track_nonfinite
  )


def static_loss_scale(
  inner: optax.GradientTransformation,
  scale: float,
  *,
  skip_nonfinite: bool = True,
  axis_name: Any = None,
  track_nonfinite: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """A fixed loss scale around any optax transformation.

  Gradients are unscaled and checked on the same path as
  :func:`dynamic_loss_scale`; the scale never changes.

  Args:
    inner: the transformation to wrap.
    scale: the fixed loss scale (positive, finite).
    skip_nonfinite: skip non-finite steps (default). ``False`` applies every
      step, as TF's ``FixedLossScale`` does.
    axis_name: mapped axis to AND the finite flag over (pmap/shard_map).
    track_nonfinite: record, in the state, which gradient leaves were not
      finite on which steps, NaN or infinity, and whether the loss (passed
      to ``update`` as ``value=``) was itself not finite; read it with
      :func:`nonfinite_report`. Finite steps do none of this work.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaleState`.
  """
  config = _config.static_config(scale, skip_nonfinite)
  return loss_scale_transformation(
    inner, config, axis_name=axis_name, track_nonfinite=track_nonfinite
  )
