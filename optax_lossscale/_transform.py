"""The loss-scale optax transformations: any optax transformation, loss-scaled.

:func:`dynamic_loss_scale` and :func:`static_loss_scale` validate their
hyper-parameters into a ``LossScaleConfig``; :func:`with_loss_scale` takes a
``LossScale`` object's. All three build the same transformation, whose
``update`` calls the core (unscale and check, adjust) and the skip.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_lossscale import _config, _core, _overwrite, _skip, _state, _telemetry
from optax_lossscale._config import LossScaleConfig
from optax_lossscale._core import LossScaleState
from optax_lossscale._loss_scale import LossScale

__all__ = [
  "dynamic_loss_scale",
  "loss_scale_transformation",
  "static_loss_scale",
  "with_loss_scale",
]


def _check_grads_match(grads: Any, params: Any) -> None:
  """A readable error, at trace time, when ``grads`` do not fit ``params``."""
  if params is None:
    return
  try:
    jax.tree.map(lambda g, p: None, grads, params, is_leaf=lambda x: x is None)
  except (ValueError, TypeError):
    raise ValueError(
      "The gradient tree does not match the parameter tree.\n"
      f"  grads:  {jax.tree.structure(grads)}\n"
      f"  params: {jax.tree.structure(params)}"
    ) from None

  def check(path, g, p):
    if _core.is_array(g) and not _core.is_array(p):
      raise ValueError(
        f"Gradient at {jax.tree_util.keystr(path)} is one array where the "
        f"parameters have a subtree ({jax.tree.structure(p)}): the gradient "
        "tree must have the parameters' structure."
      )
    if _core.is_array(g) and _core.is_array(p) and g.shape != p.shape:
      raise ValueError(
        f"Gradient at {jax.tree_util.keystr(path)} has shape {g.shape} but "
        f"the parameter has shape {p.shape}."
      )

  jax.tree_util.tree_map_with_path(check, grads, params, is_leaf=lambda x: x is None)


def _check_inner_state(inner: Any, inner_state: Any, grads: Any, params: Any) -> None:
  """A readable error, at trace time, for a state made by another optimizer."""
  like = params if params is not None else grads
  try:
    expected = jax.tree.structure(jax.eval_shape(inner.init, like))
  except Exception:  # noqa: BLE001 - init needs what we cannot give: no check
    return
  got = jax.tree.structure(inner_state)
  if got != expected:
    raise ValueError(
      "The state's inner_state was not made by this loss scale's inner "
      "optimizer (a state saved with another optimizer?). Restore it into "
      "the optimizer that made it, or init a fresh state with this one.\n"
      f"  state holds:    {_short(got)}\n"
      f"  inner.init has: {_short(expected)}"
    )


def _short(treedef: Any, limit: int = 300) -> str:
  text = str(treedef)
  return text if len(text) <= limit else text[:limit] + " ..."


def loss_scale_transformation(
  inner: optax.GradientTransformation,
  config: LossScaleConfig,
  *,
  axis_name: Any = None,
  check: Callable[..., tuple[Any, jax.Array]] = _core.unscale_and_check,
  skip: Callable[..., tuple[Any, Any]] = _skip.apply_or_skip,
  factor: float | None = None,
  track_nonfinite: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """The loss-scaled transformation for a validated ``config``.

  What :func:`with_loss_scale` and its two shorthands return. ``check`` and
  ``skip`` are the core's ``unscale_and_check`` and the skip's
  ``apply_or_skip``, with the same signatures; ``benchmarks/bench.py``
  passes other designs in their place to measure them. ``factor`` is the
  Keras facade's ``loss_scale_factor``, divided out after the scale;
  ``track_nonfinite`` keeps a :class:`NonFiniteRecord` in the state.
  """
  if not (
    callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))
  ):
    raise ValueError(f"`inner` must be an optax GradientTransformation, got {inner!r}.")
  if not isinstance(track_nonfinite, bool):
    raise ValueError(f"`track_nonfinite` must be a bool, got {track_nonfinite!r}.")
  inner = optax.with_extra_args_support(inner)
  # The inner transformation on the other leaves, when the parameters hold
  # leaves that Flax overwrites with their new value (float8 meta).
  overwriting = _overwrite.with_overwrites(inner)

  def init_fn(params):
    has_overwrites = _overwrite.overwrite_mask(params) is not None
    inner_state = (overwriting if has_overwrites else inner).init(params)
    nested = _state.find_all(inner_state, _state.is_loss_scale_state)
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
    record = _telemetry.initial_record(params) if track_nonfinite else None
    return _core.initial_state(config, inner_state, record)

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, LossScaleState):
      raise ValueError(
        "The loss-scaled optimizer expects the LossScaleState made by its "
        f"own init(); got a state of type {type(state).__name__}. Was this "
        "state produced by another optimizer?"
      )
    _check_grads_match(updates, params)
    if track_nonfinite and state.nonfinite is None:
      raise ValueError(
        "This loss scale was built with track_nonfinite=True but the state "
        "holds no non-finite record: it was made by a loss scale without it. "
        "Init a fresh state with this optimizer (or restore into one)."
      )
    scale = state.loss_scale
    mask = _overwrite.state_mask(state.inner_state, updates)
    if mask is None:
      body = inner
      _check_inner_state(inner, state.inner_state, updates, params)
      grads, finite = check(updates, scale, config, axis_name, factor=factor)
    else:
      # Overwrite leaves: not unscaled, not seen by `inner`, but checked.
      body = overwriting
      regular, values = _overwrite.split(updates, mask)
      regular_params = None if params is None else _overwrite.split(params, mask)[0]
      _check_inner_state(inner, state.inner_state.inner_state, regular, regular_params)
      grads, finite = check(regular, scale, config, axis_name, factor=factor)
      if not config.noop:
        values_finite = _core.reduce_flag(_overwrite.all_finite(values), axis_name)
        finite = jnp.logical_and(finite, values_finite)
      grads = _overwrite.merge(grads, values)
    new_state, should_apply = _core.adjust(state, finite, config)
    if track_nonfinite:

      def unscaled(g):  # what the check read (float8 meta values as floats)
        if mask is None:
          return _core.unscale_all(g, scale, factor)
        regular, values = _overwrite.split(g, mask)
        values = _overwrite.as_floats(values)
        return _overwrite.merge(_core.unscale_all(regular, scale, factor), values)

      if config.noop:  # nothing was checked: check for the record alone
        try:
          finite = _core.reduce_flag(_core.all_finite(unscaled(updates)), axis_name)
        except ValueError as e:
          raise ValueError(
            "NoOpLossScale skips nothing, but its non-finite record needs one "
            "flag for all devices. " + str(e).replace("skip the step", "record it")
          ) from None

      record = _telemetry.note(
        state.nonfinite,
        finite,
        updates,
        unscaled,
        extra_args.get("value"),
        scale,
        axis_name,
      )
      new_state = new_state._replace(nonfinite=record)
    if config.skip_nonfinite:
      new_updates, new_inner = skip(
        body, should_apply, grads, state.inner_state, params, extra_args
      )
    else:
      new_updates, new_inner = body.update(
        grads, state.inner_state, params, **extra_args
      )
    return new_updates, new_state._replace(inner_state=new_inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def with_loss_scale(
  inner: optax.GradientTransformation,
  loss_scale: LossScale,
  *,
  axis_name: Any = None,
  track_nonfinite: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with the loss scale ``loss_scale`` (any kind).

  :func:`dynamic_loss_scale` and :func:`static_loss_scale` are this function
  with a :class:`DynamicLossScale` or :class:`StaticLossScale`; pass a
  :class:`NoOpLossScale` to keep one code path for float32/bfloat16 runs.

  ``update(grads, state, params)`` takes gradients of the *scaled* loss and:

  1. unscales them with the state's current scale, in float32;
  2. checks that every floating entry is finite (ANDed over ``axis_name``);
  3. feeds the unscaled gradients to ``inner``; on a skipped step the updates
     are zeros of the same dtypes and the inner state is returned unchanged
     (a schedule's step count does not advance);
  4. adjusts the scale and counters.

  The skip is a ``lax.select``, not a ``lax.cond``: no branch and no host
  sync, so it fuses with the inner update.

  Leaves that Flax's float8 layers overwrite with their new value (the
  collection ``_overwrite_with_gradient``: scales and amax histories) are
  not unscaled and not given to ``inner``, but checked with the gradients;
  their updates are zeros and :func:`apply_overwrites` writes their new
  values (the maximum over an ``optax.MultiSteps`` window inside).

  Args:
    inner: the transformation to wrap (``optax.chain(...)`` included).
    loss_scale: a :class:`LossScale`; only its configuration is used, every
      ``init`` starts from fresh counters.
    axis_name: the mapped axis (``pmap``/``shard_map``) to AND the finite flag
      over, so that every replica takes the same decision.
    track_nonfinite: record, in the state, which gradient leaves were not
      finite on which steps, NaN or infinity, and whether the loss (passed
      to ``update`` as ``value=``) was itself not finite; read it with
      :func:`nonfinite_report`. Finite steps do none of this work.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaleState`.
  """
  if not isinstance(loss_scale, LossScale):
    raise ValueError(
      "`loss_scale` must be a DynamicLossScale, StaticLossScale or "
      f"NoOpLossScale, got {loss_scale!r}."
    )
  return loss_scale_transformation(
    inner, loss_scale.config, axis_name=axis_name, track_nonfinite=track_nonfinite
  )


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
  on a non-finite step, which is skipped (the README's "exact rule"). With
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
