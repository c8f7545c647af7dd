"""The loss-scale state machine as pure functions on one state NamedTuple.

Everything that loss scaling computes is written here once, and every entry
point (the optax transformations, the ``LossScale`` objects, the Keras-style
facade, the Flax helpers) calls these functions:

* :func:`all_finite`: are all floating entries of a tree finite?
* :func:`unscale`: a gradient tree divided by the loss scale, in float32.
* :func:`reduce_flag`: a finite flag ANDed across devices.
* :func:`unscale_and_check`: the three above, as an update step needs them.
* :func:`adjust`: the update rule of the README's "exact rule".

The state is one form, :class:`LossScaleState`; the hyper-parameters are a
``LossScaleConfig`` of Python numbers (``_config``), never traced. Nothing
here needs optax's transformations; the package-internal API is
``__all__``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from optax_lossscale._config import LossScaleConfig

__all__ = [
  "COUNTER_FIELDS",
  "FINITE_CHECK_CHUNK",
  "LossScaleState",
  "adjust",
  "all_finite",
  "array_leaves",
  "initial_state",
  "is_array",
  "is_float_array",
  "reduce_flag",
  "scale_value",
  "unscale",
  "unscale_and_check",
]

_F32 = jnp.float32
_I32 = jnp.int32

#: Leaves of one size and dtype added together before one reduction in
#: :func:`all_finite` (BENCHMARKS.md has the measurements behind it).
FINITE_CHECK_CHUNK = 32


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
  """

  loss_scale: jax.Array
  good_steps: jax.Array
  hysteresis_left: jax.Array
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  inner_state: Any = None


#: The fields of :class:`LossScaleState` that :func:`adjust` updates.
COUNTER_FIELDS = LossScaleState._fields[:-1]


def initial_state(config: LossScaleConfig, inner_state: Any = None) -> LossScaleState:
  """A fresh state (new buffers on every call, safe to donate)."""
  return LossScaleState(
    loss_scale=jnp.asarray(config.initial_scale, _F32),
    good_steps=jnp.zeros([], _I32),
    hysteresis_left=jnp.asarray(config.hysteresis, _I32),
    skipped_steps=jnp.zeros([], _I32),
    consecutive_skips=jnp.zeros([], _I32),
    inner_state=inner_state,
  )


# --------------------------------------------------------------------------
# The finite check, the unscale and the flag reduction.
# --------------------------------------------------------------------------


def is_array(x: Any) -> bool:
  """A JAX or NumPy array (or scalar); ``None`` and other leaves are not."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def is_float_array(x: Any) -> bool:
  """A leaf that loss scaling touches: an array of a floating dtype."""
  # float0, integer and bool arrays are not `inexact`.
  return is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def array_leaves(tree: Any, what: str = "gradient") -> list[Any]:
  """The leaves of ``tree``, all of them arrays (``None`` is no leaf).

  Raises:
    ValueError: a leaf is not an array (a Python number, a string, ...),
      naming its path: loss scaling cannot unscale or check it, and passing
      it through would apply it unscaled.
  """
  leaves = jax.tree.leaves(tree)
  if all(is_array(x) for x in leaves):
    return leaves
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not is_array(x):
      raise ValueError(
        f"The {what} leaf at {jax.tree_util.keystr(path) or '<root>'} is a "
        f"{type(x).__name__} ({x!r}), not an array: loss scaling can neither "
        "unscale nor check it. Make it an array (jnp.asarray), or leave it out "
        "of the tree (None)."
      )
  raise AssertionError("unreachable")


#: Unsigned integer dtypes of the float widths whose bits are tested directly.
_UINT = {16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


#: Leaves of at most this many entries, in groups of fewer than
#: :data:`CONCAT_MAX_GROUP` leaves of one size, are checked concatenated.
CONCAT_MAX_SIZE = 1 << 16
CONCAT_MAX_GROUP = 4


def _concatenated(size: int, count: int) -> bool:
  return 0 < size <= CONCAT_MAX_SIZE and count < CONCAT_MAX_GROUP


def _tested(x: jax.Array) -> jax.Array:
  """``x`` in a dtype whose bits :func:`_exponent_bits` tests.

  float16, bfloat16, float32 and float64 as they are; other floating dtypes
  (float8 formats, whose all-ones exponent can be finite) in float32, which
  is exact and keeps ``inf`` and NaN.
  """
  if x.dtype in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64):
    return x
  return x.astype(_F32)


def _exponent_bits(x: jax.Array) -> tuple[jax.Array, int]:
  """``(x's exponent bits as unsigned integers, the all-ones exponent)``.

  An IEEE float is ``inf`` or NaN exactly when its exponent bits are all
  ones. Integer ``&``, ``max`` and ``==`` cannot be folded by any
  floating-point simplification (fast-math flags fold ``x - x`` to 0 and
  ``isnan`` to false), so the test holds whatever flags XLA runs with.
  """
  info = jnp.finfo(x.dtype)
  uint = _UINT[info.bits]
  mask = ((1 << info.nexp) - 1) << info.nmant
  return lax.bitcast_convert_type(x, uint) & np.asarray(mask, uint), mask


def all_finite(tree: Any, *, chunk: int = FINITE_CHECK_CHUNK) -> jax.Array:
  """Whether every element of every floating leaf of ``tree`` is finite.

  ``None``, ``optax.MaskedNode`` and integer, boolean and ``float0`` arrays
  are ignored; an empty tree is finite. Complex leaves are checked in both
  parts. A leaf that is not an array (a Python number) is a ``ValueError``
  naming it.

  Each entry's exponent bits are tested as an unsigned integer (all ones:
  ``inf`` or NaN), so no compiler flag, fast-math included, can fold the
  check away. Leaves of one size and dtype are combined by an elementwise
  integer maximum, ``chunk`` at a time, before one reduction: each entry is
  read once, and the number of kernels (and XLA's compile time) grows with
  the number of groups, not of leaves. The other chunks' verdicts are
  folded into the smallest chunk before its reduction, so the flag is one
  reduction's output (BENCHMARKS.md says why, and what the check costs).

  Args:
    tree: a pytree, typically of gradients.
    chunk: leaves combined before one reduction.

  Returns:
    A scalar boolean array.

  Example:
    >>> import jax.numpy as jnp, optax_lossscale as ols
    >>> bool(ols.all_finite({"w": jnp.ones(3), "n": None}))
    True
    >>> bool(ols.all_finite([jnp.ones(3), jnp.array([1.0, jnp.inf])]))
    False
  """
  groups: dict[tuple[int, Any], list[jax.Array]] = {}
  for x in array_leaves(tree):
    if not is_float_array(x):
      continue
    x = jnp.ravel(x)
    for part in (jnp.real(x), jnp.imag(x)) if jnp.iscomplexobj(x) else (x,):
      part = _tested(part)
      groups.setdefault((part.size, part.dtype), []).append(part)
  # Small leaves of sizes that few other leaves share are concatenated, per
  # dtype, into one array: one reduction for them all. Each would otherwise
  # be a reduction of its own, and XLA's compile time grows much faster than
  # the number of reductions next to the skip's selects (BENCHMARKS.md). The
  # bits are tested after the concatenation: XLA splits a reduction of a
  # concatenation back into one reduction per operand.
  small: dict[Any, list[jax.Array]] = {}
  for key in [k for k, v in groups.items() if _concatenated(k[0], len(v))]:
    small.setdefault(key[1], []).extend(groups.pop(key))
  for dtype, parts in small.items():
    groups[(-1, dtype)] = [jnp.concatenate(parts)]
  chunks = []  # (the elementwise maximum of up to `chunk` leaves, all ones)
  for (size, _), parts in groups.items():
    for i in range(0, len(parts) if size else 0, chunk):
      acc, mask = _exponent_bits(parts[i])
      for part in parts[i + 1 : i + chunk]:
        acc = jnp.maximum(acc, _exponent_bits(part)[0])
      chunks.append((acc, mask))
  if not chunks:
    return jnp.array(True)
  receiver, mask = min(chunks, key=lambda c: c[0].size)
  others = [jnp.max(c) == m for c, m in chunks if c is not receiver]
  if others:
    bad = jnp.any(jnp.stack(others))
    receiver = jnp.maximum(receiver, jnp.where(bad, mask, 0).astype(receiver.dtype))
  return jnp.max(receiver) != mask


def unscale(tree: Any, loss_scale: Any) -> Any:
  """Divides every floating leaf of ``tree`` by ``loss_scale``.

  The division is a multiplication by ``1 / loss_scale``, rounded once in
  float32 (what XLA makes of a division by a scalar anyway; written out, the
  result does not depend on the compiler). Half-precision leaves are
  multiplied in float32 and cast back, so the tree's dtypes never change;
  integer, boolean and ``float0`` arrays pass through. A leaf that is not an
  array (a Python number) is a ``ValueError`` naming it.

  Example:
    >>> import jax.numpy as jnp, optax_lossscale as ols
    >>> ols.unscale({"w": jnp.array([8.0, 16.0], jnp.float16)}, 8.0)["w"]
    Array([1., 2.], dtype=float16)
  """
  inv_scale = 1.0 / jnp.asarray(loss_scale, _F32)
  array_leaves(tree)

  def one(x):
    if not is_float_array(x):
      return x
    if jnp.finfo(x.dtype).bits < 32:
      return (x.astype(_F32) * inv_scale).astype(x.dtype)
    return x * inv_scale.astype(x.dtype)

  return jax.tree.map(one, tree)


def scale_value(loss: Any, loss_scale: Any) -> jax.Array:
  """``loss * loss_scale`` in at least float32 (a float16 loss would overflow)."""
  loss = jnp.asarray(loss)
  wide = jnp.issubdtype(loss.dtype, jnp.inexact) and jnp.finfo(loss.dtype).bits >= 32
  dtype = loss.dtype if wide else _F32
  return loss.astype(dtype) * jnp.asarray(loss_scale, _F32).astype(dtype)


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

  Raises:
    ValueError: inside ``shard_map``, the flag still differs between devices
      after the reduction (``axis_name`` missing, or not naming every axis
      the gradients vary over): devices would decide on their own and their
      loss scales drift apart.
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


def unscale_and_check(
  scaled_grads: Any,
  loss_scale: Any,
  config: LossScaleConfig,
  axis_name: Any = None,
  *,
  factor: float | None = None,
) -> tuple[Any, jax.Array]:
  """Unscales gradients of the scaled loss and says whether they are finite.

  With ``factor`` (the Keras facade's ``loss_scale_factor``, a fixed extra
  factor on the loss) the gradients are divided by it too, after the loss
  scale, and the check sees what is divided out. When neither division can
  make an entry larger (``config.min_scale >= 1`` and ``factor >= 1``),
  unscaling cannot turn a finite entry into ``inf``, so the *scaled*
  gradients are checked: the same answer, read as they lie in memory
  instead of from an unscaled copy. Otherwise the unscaled ones are checked,
  which also catches an overflow caused by unscaling (a float16 gradient
  divided by a factor below 1).

  Returns:
    ``(unscaled grads, finite)``, the flag ANDed over ``axis_name``. A
    no-op configuration returns the gradients untouched and ``True``.
  """
  array_leaves(scaled_grads)  # refused by name, whatever the configuration
  if config.noop:
    return scaled_grads, jnp.array(True)
  grads = unscale(scaled_grads, loss_scale)
  if factor is not None:
    grads = unscale(grads, factor)
  shrinks = config.min_scale >= 1.0 and (factor is None or factor >= 1.0)
  checked = scaled_grads if shrinks else grads
  return grads, reduce_flag(all_finite(checked), axis_name)


# --------------------------------------------------------------------------
# The rule.
# --------------------------------------------------------------------------


def adjust(
  state: LossScaleState, finite: Any, config: LossScaleConfig
) -> tuple[LossScaleState, jax.Array]:
  """The next state given whether this step's gradients were finite.

  ``finite`` says whether the gradients that ``state.loss_scale`` produced
  were all finite. Only the counter fields change (``inner_state`` is left
  as it is); everything is ``jnp.where``, with no branch and no host sync.
  The new scale always lies in ``[min_scale, max_scale]``, and a fixed scale
  is the configuration's: a state restored from another configuration
  comes into line at its first update (which still unscales with the
  state's scale, the one its gradients were computed with).

  Returns:
    ``(new state, should_apply)``: whether this step's update is applied.
  """
  finite = jnp.asarray(finite, jnp.bool_)
  should_apply = finite if config.skip_nonfinite else jnp.array(True)
  s = state
  if config.noop:
    return s, should_apply
  if config.dynamic:
    good = s.good_steps + 1
    grow = jnp.logical_and(finite, good >= config.growth_interval)
    # Saturate at 0: `<= 0` below decides exactly as Megatron's unbounded
    # decrement, and the int32 can never wrap around.
    hyst_after_bad = jnp.maximum(s.hysteresis_left - 1, 0)
    back_off = jnp.logical_and(jnp.logical_not(finite), hyst_after_bad <= 0)
    scale = jnp.where(
      grow,
      s.loss_scale * config.growth_factor,
      jnp.where(back_off, s.loss_scale * config.backoff_factor, s.loss_scale),
    )
    # Clamped every step, so that a state restored under other bounds comes
    # into them at its first update.
    scale = jnp.clip(scale, config.min_scale, config.max_scale).astype(_F32)
    good_steps = jnp.where(finite & ~grow, good, 0).astype(_I32)
    hysteresis_left = jnp.where(
      grow, config.hysteresis, jnp.where(finite, s.hysteresis_left, hyst_after_bad)
    ).astype(_I32)
  else:
    # A fixed scale is the configuration's, whatever the state held (one
    # restored from a run with another scale): from this update on.
    scale = jnp.full_like(s.loss_scale, config.initial_scale, _F32)
    good_steps = jnp.where(finite, optax.safe_increment(s.good_steps), 0)
    hysteresis_left = s.hysteresis_left
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
