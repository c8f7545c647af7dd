"""The loss-scale state machine, with no optax in sight.

This module is the one place where the three ideas of loss scaling live:

* :func:`all_finite` — are all floating entries of a gradient tree finite?
* :func:`unscale` — divide a gradient tree by the loss scale, in float32.
* :meth:`LossScale.adjust` — the exact update rule of DESIGN.md §3.

:class:`DynamicLossScale`, :class:`StaticLossScale` and :class:`NoOpLossScale`
are the JAX form of TensorFlow's ``LossScale`` classes: immutable pytrees whose
leaves are the counters (device arrays) and whose hyper-parameters are static
metadata (never leaves, so ``jax.jit`` can neither trace nor drop them).
Calling one gives the current scale; ``update(grads)`` gives the new loss
scale and ``should_apply``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

_F32 = jnp.float32
_I32 = jnp.int32
_INT32_MAX = int(np.iinfo(np.int32).max)
# Scales live in [2**-126, 2**126]: the scale *and its reciprocal* are normal
# float32 numbers. XLA divides by a scalar by multiplying with its reciprocal,
# and a subnormal reciprocal is flushed to zero on some backends (CPU), which
# would silently zero every gradient.
SCALE_RANGE = (2.0**-126, 2.0**126)

#: Default floor of the dynamic scale. Below 1 a loss scale no longer protects
#: small gradients from underflow; a model that keeps overflowing at scale 1
#: is broken, and ``consecutive_skips`` says so.
DEFAULT_MIN_SCALE = 1.0
#: Default ceiling of the dynamic scale: finite, so a long run of finite steps
#: can never make it ``inf`` (an ``inf`` scale never comes back down).
DEFAULT_MAX_SCALE = 2.0**24


# --------------------------------------------------------------------------
# Validation of hyper-parameters: Python numbers only, checked eagerly.
# --------------------------------------------------------------------------


def _as_float(name: str, value: Any) -> float:
  if isinstance(value, bool) or not isinstance(
    value, (numbers.Real, np.ndarray, np.generic, jax.Array)
  ):
    raise ValueError(f"`{name}` must be a real number, got {value!r}.")
  try:
    out = float(value)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise ValueError(
      f"`{name}` must be a concrete Python number (a hyper-parameter, not a "
      f"traced value), got {value!r}."
    ) from e
  if not math.isfinite(out):
    raise ValueError(f"`{name}` must be finite, got {value!r}.")
  return out


def _as_int(name: str, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)):
    raise ValueError(f"`{name}` must be an integer, got {value!r}.")
  return int(value)


def _float_in(name: str, value: Any, lo: float, hi: float) -> float:
  out = _as_float(name, value)
  if not lo <= out <= hi:
    raise ValueError(f"`{name}` must be in [{lo}, {hi}], got {value!r}.")
  return out


def _optional_positive(name: str, value: Any) -> float | None:
  if value is None:
    return None
  out = _as_float(name, value)
  if out <= 0:
    raise ValueError(f"`{name}` must be positive or None, got {value!r}.")
  return out


def _optional_int_at_least(name: str, value: Any, minimum: int) -> int | None:
  if value is None:
    return None
  out = _as_int(name, value)
  if out < minimum:
    raise ValueError(
      f"`{name}` must be an integer >= {minimum} or None, got {value!r}."
    )
  return out


def _check_scale(name: str, value: Any) -> float:
  out = _as_float(name, value)
  lo, hi = SCALE_RANGE
  if not lo <= out <= hi:
    raise ValueError(
      f"`{name}` must lie in [2**-126, 2**126] (the scale and its reciprocal "
      f"are then normal float32 numbers), got {value!r}."
    )
  return out


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
  """Static hyper-parameters of a loss scale (hashable, never traced).

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
  """

  initial_scale: float = 2.0**15
  growth_interval: int = 2000
  growth_factor: float = 2.0
  backoff_factor: float = 0.5
  min_scale: float = DEFAULT_MIN_SCALE
  max_scale: float = DEFAULT_MAX_SCALE
  hysteresis: int = 1
  dynamic: bool = True
  skip_nonfinite: bool = True
  noop: bool = False


def _dynamic_config(
  initial_scale,
  growth_interval,
  growth_factor,
  backoff_factor,
  min_scale,
  max_scale,
  hysteresis,
) -> LossScaleConfig:
  """Validates the dynamic hyper-parameters; every error names the argument."""
  initial_scale = _check_scale("initial_scale", initial_scale)
  min_scale = _check_scale("min_scale", min_scale)
  max_scale = _check_scale("max_scale", max_scale)
  growth_interval = _as_int("growth_interval", growth_interval)
  if not 1 <= growth_interval <= _INT32_MAX:
    raise ValueError(
      f"`growth_interval` must be in [1, {_INT32_MAX}], got {growth_interval}."
    )
  growth_factor = _as_float("growth_factor", growth_factor)
  if growth_factor <= 1.0:
    raise ValueError(f"`growth_factor` must be > 1, got {growth_factor}.")
  backoff_factor = _as_float("backoff_factor", backoff_factor)
  if not 0.0 < backoff_factor < 1.0:
    raise ValueError(
      f"`backoff_factor` must be in the open interval (0, 1), got {backoff_factor}."
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
  hysteresis = _as_int("hysteresis", hysteresis)
  if not 1 <= hysteresis <= _INT32_MAX:
    raise ValueError(f"`hysteresis` must be >= 1, got {hysteresis}.")
  return LossScaleConfig(
    initial_scale=initial_scale,
    growth_interval=growth_interval,
    growth_factor=growth_factor,
    backoff_factor=backoff_factor,
    min_scale=min_scale,
    max_scale=max_scale,
    hysteresis=hysteresis,
  )


def _static_config(scale, skip_nonfinite) -> LossScaleConfig:
  scale = _check_scale("scale", scale)
  if not isinstance(skip_nonfinite, (bool, np.bool_)):
    raise ValueError(f"`skip_nonfinite` must be a bool, got {skip_nonfinite!r}.")
  return LossScaleConfig(
    initial_scale=scale,
    min_scale=scale,
    max_scale=scale,
    dynamic=False,
    skip_nonfinite=bool(skip_nonfinite),
  )


# --------------------------------------------------------------------------
# The three ideas, each written once.
# --------------------------------------------------------------------------


def is_array(x: Any) -> bool:
  """A JAX or NumPy array (or scalar); ``None`` and other leaves are not."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _is_float_array(x: Any) -> bool:
  """A leaf that loss scaling touches: an array of a floating dtype."""
  # float0, integer and bool arrays are not `inexact`.
  return is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def _zero_if_finite(x: jax.Array) -> jax.Array:
  """``x - x``: 0 where ``x`` is finite, NaN where it is ``inf`` or NaN."""
  if jnp.iscomplexobj(x):
    return (jnp.real(x) - jnp.real(x)) + (jnp.imag(x) - jnp.imag(x))
  return x - x


#: Leaves of one size combined into one reduction (see :func:`all_finite`).
FINITE_CHECK_CHUNK = 32


def all_finite(tree: Any) -> jax.Array:
  """Whether every element of every floating leaf of ``tree`` is finite.

  ``None``, integer, boolean, ``float0`` and non-array leaves (such as
  ``optax.MaskedNode``) are ignored; an empty tree is finite.

  Every entry is mapped to ``x - x``: ``0`` when finite, NaN for ``inf`` or
  NaN (no constant operand for the compiler to materialise), so a sum of
  them is NaN exactly when some entry is not finite, and it can never
  overflow (no ``min``/``max``, whose NaN handling compiler flags
  such as XLA's fast-min-max can change). Leaves are grouped by size and
  dtype; up to :data:`FINITE_CHECK_CHUNK` leaves of a group are added elementwise
  and reduced *together*: XLA fuses the additions into the reduction, so each
  gradient entry is read once and the check costs one reduction per group
  instead of one per leaf (with 4096 leaves, per-leaf reductions made XLA's
  CPU compile time explode, see BENCHMARKS.md).

  Args:
    tree: a pytree, typically of gradients.

  Returns:
    A scalar boolean array.
  """
  # Grouped by size and dtype, summed in their own dtype: a sum of zeros is
  # exact in any precision, and no array-sized conversion is needed (XLA
  # would materialise it for the reduction). Only the scalars are converted.
  groups: dict[tuple[int, Any], list[jax.Array]] = {}
  for x in jax.tree.leaves(tree):
    if _is_float_array(x):
      zero = _zero_if_finite(jnp.ravel(x))
      groups.setdefault((zero.size, zero.dtype), []).append(zero)
  chunks = []
  for zeros in groups.values():
    for i in range(0, len(zeros), FINITE_CHECK_CHUNK):
      chunk = zeros[i : i + FINITE_CHECK_CHUNK]
      total = chunk[0]
      for z in chunk[1:]:
        total = total + z
      chunks.append(total)
  nonempty = [c for c in chunks if c.size]
  if not nonempty:
    return jnp.array(True)
  # The other chunks' sums (0 or NaN) are added into the smallest non-empty
  # chunk before it is reduced, so that the flag is the output of one
  # reduction. Were it a sum of scalars, XLA would duplicate that cheap sum
  # into every kernel that reads the flag (each select of the skip): with
  # thousands of leaves the compile time grew quadratically (BENCHMARKS.md).
  receiver = min(nonempty, key=lambda c: c.size)
  others = [jnp.sum(c).astype(_F32) for c in nonempty if c is not receiver]
  if others:
    receiver = receiver + jnp.sum(jnp.stack(others)).astype(receiver.dtype)
  return jnp.isfinite(jnp.sum(receiver))


def unscale(tree: Any, loss_scale: jax.Array) -> Any:
  """Divides every floating leaf of ``tree`` by ``loss_scale``.

  The division is a multiplication by ``1 / loss_scale``, rounded once in
  float32 (XLA rewrites a division by a scalar into exactly this anyway;
  written out, the result no longer depends on what the compiler chooses).
  Half-precision leaves are multiplied in float32 and cast back to their own
  dtype, so the tree's dtypes never change; other leaves pass through.
  """
  inv_scale = 1.0 / jnp.asarray(loss_scale, _F32)

  def one(x):
    if not _is_float_array(x):
      return x
    if jnp.finfo(x.dtype).bits < 32:
      return (x.astype(_F32) * inv_scale).astype(x.dtype)
    return x * inv_scale.astype(x.dtype)

  return jax.tree.map(one, tree)


def scale_value(loss: Any, loss_scale: jax.Array) -> jax.Array:
  """``loss * loss_scale`` in at least float32 (a float16 loss would overflow)."""
  loss = jnp.asarray(loss)
  wide = jnp.issubdtype(loss.dtype, jnp.inexact) and jnp.finfo(loss.dtype).bits >= 32
  dtype = loss.dtype if wide else _F32
  return loss.astype(dtype) * jnp.asarray(loss_scale, _F32).astype(dtype)


def select(pred: jax.Array, on_true: jax.Array, on_false: Any) -> jax.Array:
  """``lax.select`` of one array, ``on_false`` taken in ``on_true``'s dtype."""
  return lax.select(pred, on_true, jnp.asarray(on_false, on_true.dtype))


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
  """``on_true`` where ``pred`` else ``on_false``, leaf by leaf.

  Array leaves are selected with ``lax.select`` (no host sync, no branch);
  other leaves are taken from ``on_true``. Dtypes and shapes must match.
  """

  def one(a, b):
    if is_array(a) and a.dtype != jax.dtypes.float0:
      return select(pred, a, b)
    return a

  return jax.tree.map(one, on_true, on_false)


def _varying_axes(x: jax.Array) -> frozenset:
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


def reduce_flag(flag: jax.Array, axis_name: Any) -> jax.Array:
  """ANDs a boolean flag across a named axis (pmap, shard_map, vmap).

  Inside ``shard_map``, a flag that still differs between devices after the
  reduction (``axis_name`` missing, or not naming every axis the gradients
  vary over) would let devices take different decisions and their loss
  scales drift apart: that is a ``ValueError`` at trace time.
  """
  if axis_name is not None:
    any_bad = lax.psum(jnp.logical_not(flag).astype(_I32), axis_name)
    flag = any_bad == 0
  varying = _varying_axes(flag)
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


# --------------------------------------------------------------------------
# The loss-scale objects.
# --------------------------------------------------------------------------


class Counters(NamedTuple):
  """The device-side state of a loss scale (DESIGN.md §3).

  Attributes:
    loss_scale: float32 scalar, the current scale.
    good_steps: int32, finite steps in a row since the scale last changed.
    hysteresis_left: int32, non-finite steps left before the scale backs off.
    skipped_steps: int32, total skipped steps (saturating).
    consecutive_skips: int32, skipped steps in a row.
  """

  loss_scale: jax.Array
  good_steps: jax.Array
  hysteresis_left: jax.Array
  skipped_steps: jax.Array
  consecutive_skips: jax.Array


def initial_counters(config: LossScaleConfig) -> Counters:
  """Fresh counters (new buffers on every call, safe to donate)."""
  return Counters(
    loss_scale=jnp.asarray(config.initial_scale, _F32),
    good_steps=jnp.zeros([], _I32),
    hysteresis_left=jnp.asarray(config.hysteresis, _I32),
    skipped_steps=jnp.zeros([], _I32),
    consecutive_skips=jnp.zeros([], _I32),
  )


def adjust(
  counters: Counters, finite: jax.Array, config: LossScaleConfig
) -> tuple[Counters, jax.Array]:
  """The update rule of DESIGN.md §3: returns (new counters, should_apply).

  ``finite`` is whether the gradients that ``counters.loss_scale`` produced
  were all finite. Everything is ``jnp.where``: no branch, no host sync.
  """
  finite = jnp.asarray(finite, jnp.bool_)
  should_apply = finite if config.skip_nonfinite else jnp.array(True)
  c = counters
  if config.noop:
    return c, should_apply
  if config.dynamic:
    good = c.good_steps + 1
    grow = jnp.logical_and(finite, good >= config.growth_interval)
    # Saturate at 0: `<= 0` below behaves exactly as Megatron's unbounded
    # decrement, and the int32 can never wrap around.
    hyst_after_bad = jnp.maximum(c.hysteresis_left - 1, 0)
    back_off = jnp.logical_and(jnp.logical_not(finite), hyst_after_bad <= 0)
    scale = jnp.where(
      grow,
      jnp.minimum(c.loss_scale * config.growth_factor, config.max_scale),
      jnp.where(
        back_off,
        jnp.maximum(c.loss_scale * config.backoff_factor, config.min_scale),
        c.loss_scale,
      ),
    ).astype(_F32)
    good_steps = jnp.where(finite & ~grow, good, 0).astype(_I32)
    hysteresis_left = jnp.where(
      grow, config.hysteresis, jnp.where(finite, c.hysteresis_left, hyst_after_bad)
    ).astype(_I32)
  else:
    scale = c.loss_scale
    good_steps = jnp.where(finite, optax.safe_increment(c.good_steps), 0)
    hysteresis_left = c.hysteresis_left
  skipped = jnp.logical_not(should_apply)
  new = Counters(
    loss_scale=scale,
    good_steps=good_steps,
    hysteresis_left=hysteresis_left,
    skipped_steps=jnp.where(
      skipped, optax.safe_increment(c.skipped_steps), c.skipped_steps
    ),
    consecutive_skips=jnp.where(
      skipped, optax.safe_increment(c.consecutive_skips), 0
    ).astype(_I32),
  )
  return new, should_apply


class LossScale:
  """Base class: a loss scale as an immutable pytree (the seed's ``LossScale``).

  The counters (:class:`Counters` fields) are the pytree's leaves; the
  :class:`LossScaleConfig` is static metadata, kept intact through
  ``jax.jit``, ``jax.tree.map`` and flatten/unflatten.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> ls = ols.DynamicLossScale(initial_scale=2.0**10, growth_interval=2)
    >>> float(ls())
    1024.0
    >>> grads = {"w": jnp.array([2048.0, 4096.0])}
    >>> ls.unscale(grads)["w"]
    Array([2., 4.], dtype=float32)
    >>> ls, ok = ls.update({"w": jnp.array([jnp.inf])})
    >>> bool(ok), float(ls())
    (False, 512.0)
  """

  __slots__ = ("_counters", "_config")

  def __init__(self, config: LossScaleConfig):
    self._config = config
    self._counters = initial_counters(config)

  # -- construction from parts (used by pytree unflatten and the optax
  # -- transformations, which keep the counters in their own state) --------

  @classmethod
  def _from_parts(cls, counters: Counters, config: LossScaleConfig):
    obj = object.__new__(cls)
    obj._counters = Counters(*counters)
    obj._config = config
    return obj

  def replace(self, counters: Counters) -> LossScale:
    """The same loss scale (same config) with other counters."""
    return self._from_parts(counters, self._config)

  def tree_flatten_with_keys(self):
    keys = [jax.tree_util.GetAttrKey(f) for f in Counters._fields]
    return list(zip(keys, self._counters, strict=True)), self._config

  def tree_flatten(self):
    return tuple(self._counters), self._config

  @classmethod
  def tree_unflatten(cls, config, children):
    return cls._from_parts(Counters(*children), config)

  # -- read access ---------------------------------------------------------

  @property
  def config(self) -> LossScaleConfig:
    return self._config

  @property
  def counters(self) -> Counters:
    return self._counters

  @property
  def loss_scale(self) -> jax.Array:
    return self._counters.loss_scale

  @property
  def good_steps(self) -> jax.Array:
    return self._counters.good_steps

  @property
  def hysteresis_left(self) -> jax.Array:
    return self._counters.hysteresis_left

  @property
  def skipped_steps(self) -> jax.Array:
    return self._counters.skipped_steps

  @property
  def consecutive_skips(self) -> jax.Array:
    return self._counters.consecutive_skips

  def get_config(self) -> dict[str, Any]:
    """The constructor arguments (Python numbers): ``from_config`` inverts it."""
    raise NotImplementedError

  @classmethod
  def from_config(cls, config: dict[str, Any]) -> LossScale:
    """A fresh loss scale (initial counters) from :meth:`get_config`'s output."""
    return cls(**config)

  def __call__(self) -> jax.Array:
    """The current loss scale, a float32 scalar."""
    return self._counters.loss_scale

  def __repr__(self):
    name = type(self).__name__
    return f"{name}(scale={self._counters.loss_scale!r}, config={self._config})"

  # -- the operations ------------------------------------------------------

  def scale_loss(self, loss: Any) -> jax.Array:
    """The loss multiplied by the current scale, in at least float32."""
    if self._config.noop:
      return jnp.asarray(loss)
    return scale_value(loss, self._counters.loss_scale)

  def unscale(self, grads: Any) -> Any:
    """Gradients of the scaled loss divided by the current scale."""
    if self._config.noop:
      return grads
    return unscale(grads, self._counters.loss_scale)

  def adjust(self, finite: jax.Array) -> tuple[LossScale, jax.Array]:
    """The next loss scale given whether this step's gradients were finite."""
    counters, should_apply = adjust(self._counters, finite, self._config)
    return self.replace(counters), should_apply

  def update(self, grads: Any, *, axis_name: Any = None) -> tuple[LossScale, jax.Array]:
    """Checks already-unscaled ``grads`` and adjusts the scale (seed API).

    Args:
      grads: the unscaled gradients; ``None`` leaves are ignored.
      axis_name: if set, the finite flag is ANDed across this mapped axis, so
        every replica takes the same decision.

    Returns:
      ``(new_loss_scale, should_apply_gradients)``: a new object of the same
      type and a scalar boolean array.
    """
    if self._config.noop:
      return self, jnp.array(True)
    return self.adjust(reduce_flag(all_finite(grads), axis_name))

  def unscale_and_update(
    self, scaled_grads: Any, *, axis_name: Any = None
  ) -> tuple[Any, LossScale, jax.Array]:
    """:meth:`unscale`, then :meth:`update`: what an optimizer step needs.

    Returns ``(unscaled_grads, new_loss_scale, should_apply)``. When the
    scale can never go below 1 (``min_scale >= 1``, known when tracing),
    unscaling multiplies by at most 1 and cannot turn a finite entry into
    ``inf``, so the finite check reads the *scaled* gradients, exactly
    equivalent and cheaper: XLA then reduces the gradients as they are in
    memory instead of materialising their unscaled copy for the reduction
    (the optimizer's own kernels recompute the cheap multiply). Below 1 the
    unscaled gradients are checked, which also catches an overflow caused by
    unscaling.
    """
    grads = self.unscale(scaled_grads)
    checked = scaled_grads if self._config.min_scale >= 1.0 else grads
    new, should_apply = self.update(checked, axis_name=axis_name)
    return grads, new, should_apply


@jax.tree_util.register_pytree_with_keys_class
class DynamicLossScale(LossScale):
  """Dynamic loss scaling (Keras ``LossScaleOptimizer``, torch ``GradScaler``).

  Args:
    initial_scale: the starting scale (default ``2**15``).
    growth_interval: after this many finite steps in a row the scale is
      multiplied by ``growth_factor``.
    growth_factor: growth multiplier, > 1.
    backoff_factor: backoff multiplier on a non-finite step, in (0, 1).
    min_scale: the scale never goes below this (positive, normal float32).
    max_scale: the scale never goes above this (finite).
    hysteresis: non-finite steps tolerated before backing off (Megatron-LM);
      the count refills when the scale grows. 1 backs off on every one.
    initial_loss_scale: TensorFlow's name for ``initial_scale``.
    increment_period: TensorFlow's name for ``growth_interval``.
    multiplier: TensorFlow's growth factor; the backoff factor is then
      ``1 / multiplier``, as in TensorFlow.

  Raises:
    ValueError: an invalid value, or a TensorFlow name given together with
      its counterpart (the message names both).

  Example:
    >>> import optax_lossscale as ols
    >>> tf_style = ols.DynamicLossScale(initial_loss_scale=2048, increment_period=500)
    >>> tf_style.config == ols.DynamicLossScale(2048, growth_interval=500).config
    True
  """

  __slots__ = ()

  def __init__(
    self,
    initial_scale: float = 2.0**15,
    *,
    growth_interval: int = 2000,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    min_scale: float = DEFAULT_MIN_SCALE,
    max_scale: float = DEFAULT_MAX_SCALE,
    hysteresis: int = 1,
    initial_loss_scale: float | None = None,
    increment_period: int | None = None,
    multiplier: float | None = None,
  ):
    # TensorFlow's names (tf.compat.v1.mixed_precision.DynamicLossScale).
    aliases = (
      (
        "initial_loss_scale",
        initial_loss_scale,
        "initial_scale",
        initial_scale,
        2.0**15,
      ),
      ("increment_period", increment_period, "growth_interval", growth_interval, 2000),
    )
    for alias, alias_value, name, value, default in aliases:
      if alias_value is not None and value != default:
        raise ValueError(
          f"Give `{name}` or its TensorFlow name `{alias}`, not both "
          f"(got {name}={value!r}, {alias}={alias_value!r})."
        )
    if initial_loss_scale is not None:
      initial_scale = initial_loss_scale
    if increment_period is not None:
      growth_interval = increment_period
    if multiplier is not None:
      if (growth_factor, backoff_factor) != (2.0, 0.5):
        raise ValueError(
          "Give `growth_factor`/`backoff_factor` or TensorFlow's `multiplier`, "
          f"not both (got multiplier={multiplier!r})."
        )
      growth_factor = _as_float("multiplier", multiplier)
      if growth_factor <= 1.0:
        raise ValueError(f"`multiplier` must be > 1, got {multiplier!r}.")
      backoff_factor = 1.0 / growth_factor
    super().__init__(
      _dynamic_config(
        initial_scale,
        growth_interval,
        growth_factor,
        backoff_factor,
        min_scale,
        max_scale,
        hysteresis,
      )
    )

  # TensorFlow's attribute names.
  @property
  def initial_loss_scale(self) -> float:
    return self._config.initial_scale

  @property
  def increment_period(self) -> int:
    return self._config.growth_interval

  @property
  def multiplier(self) -> float:
    return self._config.growth_factor

  def get_config(self) -> dict[str, Any]:
    c = self._config
    return {
      "initial_scale": c.initial_scale,
      "growth_interval": c.growth_interval,
      "growth_factor": c.growth_factor,
      "backoff_factor": c.backoff_factor,
      "min_scale": c.min_scale,
      "max_scale": c.max_scale,
      "hysteresis": c.hysteresis,
    }


@jax.tree_util.register_pytree_with_keys_class
class StaticLossScale(LossScale):
  """A fixed loss scale (TF's ``FixedLossScale``).

  Args:
    scale: the fixed scale (positive, finite).
    skip_nonfinite: skip steps whose gradients are not finite (default). With
      ``False`` every step is applied, exactly as TF's ``FixedLossScale``.
  """

  __slots__ = ()

  def __init__(self, scale: float, *, skip_nonfinite: bool = True):
    super().__init__(_static_config(scale, skip_nonfinite))

  def get_config(self) -> dict[str, Any]:
    return {
      "scale": self._config.initial_scale,
      "skip_nonfinite": self._config.skip_nonfinite,
    }


@jax.tree_util.register_pytree_with_keys_class
class NoOpLossScale(LossScale):
  """Scale 1, nothing unscaled, nothing checked, every step applied.

  For float32 or bfloat16 training through the same code path.
  """

  __slots__ = ()

  def __init__(self):
    super().__init__(
      LossScaleConfig(
        initial_scale=1.0,
        min_scale=1.0,
        max_scale=1.0,
        dynamic=False,
        skip_nonfinite=False,
        noop=True,
      )
    )

  def get_config(self) -> dict[str, Any]:
    return {}
