"""The loss-scale state machine as pure functions on one state NamedTuple.

Everything that loss scaling computes is written here once, and every entry
point (the optax transformations, the ``LossScale`` objects, the Keras-style
facade, the Flax helpers) calls these functions:

* :func:`unscale`: a gradient tree divided by the loss scale, in float32
  (the public form validates the tree; :func:`unscale_tree` is the one the
  transformations call on a tree they validated once);
* :func:`check`: whether an update's gradients are finite (``finite``'s
  check on the scaled or the unscaled tree), ANDed across devices
  (:func:`reduce_flag`);
* :func:`adjust`: the update rule of the documentation's "exact rule".

The state is one form, :class:`LossScaleState`; the hyper-parameters are a
``LossScaleConfig`` of Python numbers (``config``), never traced. Nothing
here needs optax's transformations; the package-internal API is
``__all__``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_lossscale._base import tree as _tree
from optax_lossscale._base import validate as _validate
from optax_lossscale._loss_scale import finite as _finite
from optax_lossscale._loss_scale.config import LossScaleConfig

__all__ = [
  "COUNTER_FIELDS",
  "LossScaleState",
  "adjust",
  "check",
  "initial_state",
  "reduce_flag",
  "scale_value",
  "unscale",
  "unscale_tree",
  "varying_axes",
]

_F32 = jnp.float32
_I32 = jnp.int32


class LossScaleState(NamedTuple):
  """State of a loss scale: the scale, its counters and the wrapped state.

  The field names are distinctive so that ``optax.tree.get(opt_state,
  'loss_scale')`` finds the scale anywhere in a nested optax state.

  Attributes:
    loss_scale: float32 scalar, the scale the next gradients are computed with.
    good_steps: int32, finite steps in a row since the scale last changed
      (Keras' ``dynamic_counter``).
    hysteresis_left: int32, non-finite steps left before the scale backs off.
    skipped_steps: int32, total skipped steps (saturating).
    consecutive_skips: int32, skipped steps in a row (0 after an applied step).
    inner_state: the state of the wrapped transformation (``None`` in a
      ``LossScale`` object, which wraps none).
    nonfinite: where the gradients were not finite, a
      :class:`NonFiniteRecord` when the transformation was built with
      ``track_nonfinite=True``, else ``None``.
  """

  loss_scale: jax.Array
  good_steps: jax.Array
  hysteresis_left: jax.Array
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  inner_state: Any = None
  nonfinite: Any = None


#: The fields of :class:`LossScaleState` that :func:`adjust` updates.
COUNTER_FIELDS = LossScaleState._fields[:5]


def initial_state(
  config: LossScaleConfig, inner_state: Any = None, nonfinite: Any = None
) -> LossScaleState:
  """A fresh state (new buffers on every call, safe to donate)."""
  return LossScaleState(
    loss_scale=jnp.asarray(config.initial_scale, _F32),
    good_steps=jnp.zeros([], _I32),
    hysteresis_left=jnp.asarray(config.hysteresis, _I32),
    skipped_steps=jnp.zeros([], _I32),
    consecutive_skips=jnp.zeros([], _I32),
    inner_state=inner_state,
    nonfinite=nonfinite,
  )


# --------------------------------------------------------------------------
# The unscale and the flag reduction.
# --------------------------------------------------------------------------


def unscale(tree: Any, loss_scale: Any) -> Any:
  """Divides every floating leaf of ``tree`` by ``loss_scale``.

  The division is a multiplication by ``1 / loss_scale``, rounded once in
  float32 (what XLA makes of a division by a scalar anyway; written out, the
  result does not depend on the compiler). Half-precision leaves are
  multiplied in float32 and cast back, so the tree's dtypes never change;
  integer, boolean and ``float0`` arrays pass through. A leaf that is not an
  array (a Python number) is a ``ValueError`` naming it, and so is a
  ``loss_scale`` that is not one real number (a vector, a string, the state
  itself: pass ``get_scale(state)``).

  Example:
    >>> import jax.numpy as jnp, optax_lossscale as ols
    >>> ols.unscale({"w": jnp.array([8.0, 16.0], jnp.float16)}, 8.0)["w"]
    Array([1., 2.], dtype=float16)
  """
  _tree.array_leaves(tree)
  _check_divisor(loss_scale)
  return unscale_tree(tree, loss_scale)


def _check_divisor(loss_scale: Any) -> None:
  """A ValueError unless ``loss_scale`` is one real number (a Python number,
  or a 0-d integer or floating array, traced or not)."""
  if isinstance(loss_scale, tuple) and hasattr(loss_scale, "_fields"):
    raise ValueError(
      f"`loss_scale` is a {type(loss_scale).__name__}: pass the scale it "
      "holds, optax_lossscale.get_scale(state)."
    )
  if not _validate.is_real_scalar(loss_scale):
    shape = getattr(loss_scale, "shape", None)
    raise ValueError(
      "`loss_scale` must be one real number (a scalar), got "
      f"{type(loss_scale).__name__}{'' if shape is None else list(shape)}."
    )


def unscale_tree(
  tree: Any,
  loss_scale: Any,
  factor: float | None = None,
  *,
  keep: Any = None,
  float32: Any = False,
) -> Any:
  """:func:`unscale` of a tree whose leaves are known to be arrays.

  Divides by ``loss_scale``, then by ``factor`` (the Keras facade's
  ``loss_scale_factor``) unless it is ``None``. ``keep``, a tree of bools
  like ``tree`` (or ``None``), marks leaves passed through as they are:
  Flax's float8 overwrite leaves, which hold new values, not gradients.
  ``float32``, a bool or a tree of bools like ``tree`` (or ``None``), marks
  the half-precision leaves that come back in float32, as they were
  divided, instead of cast back to their dtype (those an inner optimizer
  keeps float32 master weights of: ``_plan.float32_gradient_leaves``).
  """

  # Each reciprocal is computed once per (divisor, leaf dtype), not once per
  # leaf: the same values, and a step of n leaves traces and compiles n
  # multiplications by it rather than n divisions as well.
  inverses: dict[tuple[int, Any], jax.Array] = {}

  def divide(x, by, which):
    # In float32 for half leaves, in the leaf's own precision otherwise: a
    # float64 leaf gets a float64 reciprocal, not a float32 one.
    # A complex leaf is multiplied part by part (``_tree.real_op``).
    real = jnp.finfo(_tree.wide_dtype(x.dtype)).dtype
    inv = inverses.get((which, real))
    if inv is None:
      inv = inverses[which, real] = 1.0 / jnp.asarray(by, _F32).astype(real)
    return _tree.real_op(jnp.multiply, _tree.widen(x), inv)

  def one(x, kept, wide):
    if kept or not _tree.is_float_array(x):
      return x
    x = _tree.held(x)  # a NumPy float64 leaf is float32 unless x64 is on
    out = divide(x, loss_scale, 0)
    if factor is not None:  # after a cast back to x's dtype, as Keras does
      out = divide(out if wide else out.astype(x.dtype), factor, 1)
    return out if wide else out.astype(x.dtype)

  if float32 is None or isinstance(float32, bool):
    float32 = jax.tree.map(lambda x, w=bool(float32): w, tree)
  if keep is None:
    return jax.tree.map(lambda x, w: one(x, False, w), tree, float32)
  # `keep` is a prefix of the tree (a kept subtree is kept whole).
  return jax.tree.map(
    lambda k, xs, ws: jax.tree.map(lambda x, w: one(x, k, w), xs, ws),
    keep,
    tree,
    float32,
  )


def scale_value(loss: Any, loss_scale: Any) -> jax.Array:
  """``loss * loss_scale`` in at least float32 (a float16 loss would overflow)."""
  loss = jnp.asarray(loss)
  wide = jnp.issubdtype(loss.dtype, jnp.inexact) and jnp.finfo(loss.dtype).bits >= 32
  dtype = loss.dtype if wide else _F32
  return loss.astype(dtype) * jnp.asarray(loss_scale, _F32).astype(dtype)


def varying_axes(x: jax.Array) -> frozenset:
  """The ``shard_map`` mesh axes along which ``x`` differs between devices.

  ``shard_map`` (with its default ``check_vma=True``) types every value with
  the manual axes it varies over; elsewhere (``jit``, ``pmap``, ``vmap``)
  this is empty.
  """
  typeof = getattr(jax, "typeof", None)
  aval = typeof(x) if typeof is not None else jax.core.get_aval(x)
  manual = getattr(aval, "manual_axis_type", None)  # JAX >= 0.9
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))  # older JAX


def psum_over(x: jax.Array, axis_name: Any) -> jax.Array:
  """``lax.psum(x, axis_name)``, where ``x`` may vary over fewer of the named
  axes than ``shard_map`` requires (it is then marked as varying over the
  others, ``lax.pcast(..., to="varying")``: naming an axis the gradients
  are replicated over changes no flag), or a ValueError naming
  ``axis_name`` where no mapped axis of that name is bound (a name the mesh
  lacks, ``jit`` without ``shard_map``), in place of JAX's ``NameError`` or
  bare ``AssertionError``.
  """
  try:
    return lax.psum(x, axis_name)
  except (NameError, AssertionError, ValueError) as e:
    error = e
  names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  missing = tuple(a for a in names if a not in varying_axes(x))
  if missing and hasattr(lax, "pcast"):  # JAX >= 0.8: lax.pvary's successor
    try:
      return lax.psum(lax.pcast(x, missing, to="varying"), axis_name)
    except (NameError, AssertionError, ValueError):
      pass
  elif missing and hasattr(lax, "pvary"):
    try:
      return lax.psum(lax.pvary(x, missing), axis_name)
    except (NameError, AssertionError, ValueError):
      pass
  raise ValueError(
    f"axis_name={axis_name!r} names no axis the loss scale can reduce its "
    "finite flag over here: name the axes of the pmap, vmap or shard_map "
    "(its mesh's axis names) the step runs in, or pass axis_name=None under "
    f"jax.jit, where the flag is already global. ({type(error).__name__}: "
    f"{str(error)[:200]})"
  ) from error


def reduce_flag(flag: jax.Array, axis_name: Any) -> jax.Array:
  """ANDs a boolean flag across a named axis (pmap, shard_map, vmap).

  Raises:
    ValueError: inside ``shard_map``, the flag still differs between devices
      after the reduction (``axis_name`` missing, or not naming every axis
      the gradients vary over): devices would decide on their own and their
      loss scales drift apart.
  """
  if axis_name is not None:
    any_bad = psum_over(jnp.logical_not(flag).astype(_I32), axis_name)
    flag = any_bad == 0
  varying = varying_axes(flag)
  if varying:
    axes = ", ".join(repr(a) for a in sorted(varying, key=str))
    raise ValueError(
      "The gradients differ between devices along the shard_map mesh "
      f"axis/axes {axes}, so each device would decide on its own whether to "
      f"skip the step (axis_name={axis_name!r}). Pass axis_name= naming "
      f"{'them' if len(varying) > 1 else 'it'} to the loss-scaled optimizer "
      "so that the finite check is global (or, if every device should hold "
      "the whole gradients, reduce them with lax.pmean before the update)."
    )
  return flag


def check(
  scaled: Any,
  unscaled: Any,
  config: LossScaleConfig,
  axis_name: Any = None,
  *,
  factor: float | None = None,
  loss_scale: Any = None,
) -> jax.Array:
  """Whether an update's gradients are finite, the same on every device.

  ``scaled`` are the gradients as ``update`` received them (leaves known to
  be arrays), ``unscaled`` the same divided by the scale and ``factor``.
  When neither division can make an entry larger (``config.min_scale >= 1``
  and ``factor >= 1``), unscaling cannot turn a finite entry into ``inf``,
  so the *scaled* gradients are checked: the same answer, read as they lie
  in memory instead of from an unscaled copy. Otherwise the unscaled ones
  are, which also catches an overflow caused by unscaling (a float16
  gradient divided by a scale or a factor below 1): with scales below 1,
  the finiteness of the gradients the inner optimizer receives decides.

  ``loss_scale``, the scale the gradients were computed with: where the
  scaled gradients are checked and it is below 1 (a state restored from a
  configuration with ``min_scale < 1``), unscaling can overflow unseen, and
  the flag is false: the step is skipped and :func:`adjust` brings the
  scale into this configuration's range. The test is folded into the
  check's one reduction (``_finite.leaves_finite``'s ``bad``).

  Returns:
    The flag, ANDed over ``axis_name`` (:func:`reduce_flag`).
  """
  shrinks = config.min_scale >= 1.0 and (factor is None or factor >= 1.0)
  checked = scaled if shrinks else unscaled
  bad = None
  if shrinks and loss_scale is not None:
    bad = jnp.asarray(loss_scale, _F32) < 1.0
  return reduce_flag(
    _finite.leaves_finite(jax.tree.leaves(checked), bad=bad), axis_name
  )


# --------------------------------------------------------------------------
# The rule.
# --------------------------------------------------------------------------


def _kept(x: Any) -> jax.Array:
  """A counter that does not change, in a buffer of its own: a state an
  eager update returns shares none with the one it was given (which a
  donated step may delete)."""
  return jnp.array(x, copy=True)


def adjust(
  state: LossScaleState, finite: Any, config: LossScaleConfig
) -> tuple[LossScaleState, jax.Array]:
  """The next state given whether this step's gradients were finite.

  ``finite`` says whether the gradients that ``state.loss_scale`` produced
  were all finite. Only the counter fields change (``inner_state`` is left
  as it is); everything is ``jnp.where``, with no branch and no host sync.
  Under ``config.bounds == "clamp"`` (the default) the new scale always
  lies in ``[min_scale, max_scale]``, and a fixed scale is the
  configuration's: a state restored from another configuration
  (or one whose scale is NaN, which starts over from ``initial_scale``)
  comes into line at its first update (which still unscales with the
  state's scale, the one its gradients were computed with). That update is
  applied when :func:`check` finds it finite, which it does not where the
  state's scale is below 1 and the configuration's scales are not. Under
  ``"tensorflow"`` it is TensorFlow's rule (``LossScaleConfig.bounds``):
  growth only to ``max_scale`` (TensorFlow's: to any finite float32), a
  backoff to ``max(scale / growth_factor, 1)``, no other clamp; under
  ``"keras"`` (Keras 3's) the backoff is ``scale / growth_factor``, floored
  at ``min_scale`` only (``2**-126`` in the porting package, where Keras 3
  has no floor).

  Returns:
    ``(new state, should_apply)``: whether this step's update is applied.
  """
  finite = jnp.asarray(finite, jnp.bool_)
  s = state
  should_apply = finite if config.skip_nonfinite else jnp.array(True)
  if config.noop:  # new buffers for the counters, as every update makes
    return s._replace(**{f: _kept(getattr(s, f)) for f in COUNTER_FIELDS}), (
      should_apply
    )
  tensorflow = config.bounds in ("tensorflow", "keras")
  if config.dynamic:
    good = s.good_steps + 1
    grow = jnp.logical_and(finite, good >= config.growth_interval)
    # Saturate at 0: `<= 0` below decides exactly as Megatron's unbounded
    # decrement, and the int32 can never wrap around.
    hyst_after_bad = jnp.maximum(s.hysteresis_left - 1, 0)
    back_off = jnp.logical_and(jnp.logical_not(finite), hyst_after_bad <= 0)
    grown = s.loss_scale * config.growth_factor
    if tensorflow:
      # TensorFlow's bounds: growth kept only up to max_scale (TensorFlow's
      # while finite: above 2**126 the reciprocal is subnormal, flushed to
      # zero), a backoff divided by the multiplier and floored at 1, no clip.
      grown = jnp.where(grown <= config.max_scale, grown, s.loss_scale)
      backed_off = s.loss_scale / config.growth_factor
      # tf_keras' floor is 1; Keras 3's has none, and below 2**-126 its
      # scale is subnormal, then 0: every later step skipped (min_scale)
      floor = 1.0 if config.bounds == "tensorflow" else config.min_scale
      backed_off = jnp.maximum(backed_off, floor)
    else:
      backed_off = s.loss_scale * config.backoff_factor
    scale = jnp.where(grow, grown, jnp.where(back_off, backed_off, s.loss_scale))
    if not tensorflow:
      # Clamped every step, so that a state restored under other bounds
      # comes into them at its first update; a scale that is not a number
      # (a corrupted or hand-made state: NaN is clamped to NaN) starts over
      # from the initial scale.
      scale = jnp.clip(scale, config.min_scale, config.max_scale)
      restart = min(max(config.initial_scale, config.min_scale), config.max_scale)
      scale = jnp.where(jnp.isnan(scale), jnp.float32(restart), scale)
    scale = scale.astype(_F32)
    good_steps = jnp.where(finite & ~grow, good, 0).astype(_I32)
    hysteresis_left = jnp.where(
      grow, config.hysteresis, jnp.where(finite, s.hysteresis_left, hyst_after_bad)
    ).astype(_I32)
  elif tensorflow:
    # TensorFlow's fixed scale: the state's scale and counter stay.
    scale, good_steps, hysteresis_left = (
      _kept(s.loss_scale),
      _kept(s.good_steps),
      _kept(s.hysteresis_left),
    )
  else:
    # A fixed scale is the configuration's, whatever the state held (one
    # restored from a run with another scale): from this update on.
    scale = jnp.full_like(s.loss_scale, config.initial_scale, _F32)
    good_steps = jnp.where(finite, optax.safe_increment(s.good_steps), 0)
    hysteresis_left = _kept(s.hysteresis_left)
  skipped = jnp.logical_not(should_apply)
  new = s._replace(
    loss_scale=scale,
    good_steps=good_steps,
    hysteresis_left=hysteresis_left,
    skipped_steps=jnp.where(
      skipped, optax.safe_increment(s.skipped_steps), s.skipped_steps
    ),
    consecutive_skips=jnp.where(
      skipped, optax.safe_increment(s.consecutive_skips), 0
    ).astype(_I32),
  )
  return new, should_apply
