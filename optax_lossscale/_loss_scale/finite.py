"""The finite check, and the classification of what is not finite, on float bits.

:func:`all_finite` is the loss scale's check (one fused reduction over a
whole tree); :func:`nonfinite_kinds` says, leaf by leaf, whether a tree
holds NaN, infinities or both (what the non-finite record and the reports
name); :func:`count_nonfinite` counts the NaN and infinite entries of an
array on the host (what the checkpoint guard reports). All of them test each
entry's bits as unsigned integers (:func:`_words`), so that no compiler
flag, fast-math included, can fold them away: values are moved as words,
never as floats, and where float computations in the same program may have
made them, only reductions of them are compared (:func:`_exponent_bytes`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_lossscale._base import validate as _validate
from optax_lossscale._base.tree import array_leaves, explicit_spec, held, is_float_array

__all__ = [
  "CONCAT_MAX_SIZE",
  "FINITE_CHECK_CHUNK",
  "INF",
  "KINDS_STACK_MAX_SIZE",
  "NAN",
  "all_finite",
  "count_nonfinite",
  "count_nonfinite_device",
  "leaves_finite",
  "nonfinite_kinds",
]

_F32 = jnp.float32

#: Leaves of one size and dtype added together before one reduction in
#: :func:`all_finite` (BENCHMARKS.md has the measurements behind it).
FINITE_CHECK_CHUNK = 32


#: Unsigned integer dtypes of the float widths whose bits are tested directly.
_UINT = {16: np.uint16, 32: np.uint32, 64: np.uint64}


#: Leaves of at most this many entries, in groups of fewer than
#: :data:`CONCAT_MAX_GROUP` leaves of one size, are checked concatenated.
CONCAT_MAX_SIZE = 1 << 16
CONCAT_MAX_GROUP = 4


def _concatenated(size: int, count: int) -> bool:
  return 0 < size <= CONCAT_MAX_SIZE and count < CONCAT_MAX_GROUP


def _tested(x: Any) -> Any:
  """``x`` (a JAX or NumPy array) in a dtype whose bits are tested directly.

  float16, bfloat16, float32 and float64 as they are; other floating dtypes
  (float8 formats, whose all-ones exponent can be finite) in float32, which
  is exact and keeps ``inf`` and NaN.
  """
  if x.dtype in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64):
    return x
  return x.astype(np.float32)


def _layout(dtype: Any) -> tuple[Any, int]:
  """``(the unsigned integer dtype of dtype's width, its all-ones exponent)``."""
  info = jnp.finfo(dtype)
  return _UINT[info.bits], ((1 << info.nexp) - 1) << info.nmant


def _words(x: Any) -> Any:
  """``x``'s bits as unsigned integers: ``x`` a JAX or NumPy array of a
  dtype :func:`_tested` returns."""
  uint, _ = _layout(x.dtype)
  return (
    x.view(uint) if isinstance(x, np.ndarray) else lax.bitcast_convert_type(x, uint)
  )


def _exponent_bits(x: jax.Array, dtype: Any) -> jax.Array:
  """The exponent bits of ``x``, floats of ``dtype`` or their :func:`_words`.

  An IEEE float is ``inf`` or NaN exactly when its exponent bits are all
  ones. Integer ``&`` and ``max`` cannot be folded by any floating-point
  simplification (fast-math flags fold ``x - x`` to 0 and ``isnan`` to
  false); a comparison can, where it reads bits a float computation made,
  so only maxima of them are compared (:func:`_exponent_bytes`).
  """
  uint, mask = _layout(dtype)
  if x.dtype != uint:
    x = _words(x)
  return x & np.asarray(mask, uint)


def _concatenable(x: jax.Array) -> jax.Array:
  """``x`` as it is concatenated: bfloat16 as its :func:`_words` (XLA's CPU
  backend concatenates bfloat16 through float32, and under fast-math that
  conversion may drop NaN and infinities), other dtypes as they are (their
  concatenation copies, and can be fused)."""
  return _words(x) if x.dtype == jnp.bfloat16 else x


def all_finite(tree: Any, *, chunk: int = FINITE_CHECK_CHUNK) -> jax.Array:
  """Whether every element of every floating leaf of ``tree`` is finite.

  ``None``, ``optax.MaskedNode`` and integer, boolean and ``float0`` arrays
  are ignored; an empty tree is finite. Complex leaves are checked in both
  parts. A leaf that is not an array (a Python number) is a ``ValueError``
  naming it.

  Each entry's exponent bits are tested as an unsigned integer (all ones:
  ``inf`` or NaN), so no compiler flag, fast-math included, can fold the
  check away. Leaves of one size and dtype are combined by an elementwise
  integer maximum, ``chunk`` at a time, and each chunk's exponents are
  reduced as bytes: each entry is read once, and the number of kernels
  (and XLA's compile time) grows with the number of groups, not of leaves.
  The other chunks' maxima are folded into the smallest chunk before its
  reduction, so the flag is one reduction's output (BENCHMARKS.md says
  why, and what the check costs).

  Args:
    tree: a pytree, typically of gradients.
    chunk: leaves combined before one reduction, a positive integer.

  Returns:
    A scalar boolean array.

  Raises:
    ValueError: a leaf is not an array (a Python number), or ``chunk`` is
      not a positive integer.

  Example:
    >>> import jax.numpy as jnp, optax_lossscale as ols
    >>> bool(ols.all_finite({"w": jnp.ones(3), "n": None}))
    True
    >>> bool(ols.all_finite([jnp.ones(3), jnp.array([1.0, jnp.inf])]))
    False
  """
  leaves = array_leaves(tree)
  groups = device_groups(leaves)
  if len(groups) > 1:  # concrete leaves on several devices: a check each
    return jnp.asarray(all(bool(leaves_finite(g, chunk=chunk)) for g in groups))
  return leaves_finite(leaves, chunk=chunk)


def device_groups(leaves: list[Any]) -> list[list[Any]]:
  """``leaves`` grouped by the set of devices each lies on, for one check
  each: a computation takes its arguments from one set, and a tree may
  hold a leaf placed on another device. Leaves among which one is traced
  (under ``jax.jit``) are one group; host arrays are one group."""
  if any(isinstance(x, jax.core.Tracer) for x in leaves):
    return [list(leaves)]
  groups: dict[Any, list[Any]] = {}
  for x in leaves:
    key = frozenset(x.sharding.device_set) if isinstance(x, jax.Array) else None
    groups.setdefault(key, []).append(x)
  return list(groups.values())


def leaves_finite(
  leaves: list[Any], *, chunk: int = FINITE_CHECK_CHUNK, bad: Any = None
) -> jax.Array:
  """:func:`all_finite` of a tree's leaves, already checked to be arrays.

  ``bad``, a scalar bool (or ``None``), makes the flag false when true: it
  is folded into the one reduction with the other chunks' verdicts, so the
  flag stays that reduction's output.
  """
  chunk = _validate.int_in("chunk", chunk, 1)
  # Leaves are grouped by size and dtype or, when their type names mesh
  # axes (explicit sharding), by shape, dtype and partition spec: arrays of
  # other specs cannot be combined elementwise, concatenated, or always
  # raveled. Each group ends in one reduction to a replicated scalar.
  groups: dict[tuple[Any, Any, Any], list[jax.Array]] = {}
  for x in leaves:
    if not is_float_array(x):
      continue
    x = held(x)
    spec = explicit_spec(x)
    for part in _parts(x):
      part = _tested(part)
      size = part.size if spec is None else part.shape
      groups.setdefault((size, part.dtype, spec), []).append(part)
  # Small unsharded leaves of sizes that few other leaves share are
  # concatenated, per dtype, into one array: one reduction for them all.
  # Each would otherwise be a reduction of its own, and XLA's compile time
  # grows much faster than the number of reductions next to the skip's
  # selects (BENCHMARKS.md). The bits are tested after the concatenation:
  # XLA splits a reduction of a concatenation back into one reduction per
  # operand. bfloat16 is concatenated as words (:func:`_concatenable`).
  small: dict[Any, list[jax.Array]] = {}
  for key in [
    k for k, v in groups.items() if k[2] is None and _concatenated(k[0], len(v))
  ]:
    small.setdefault(key[1], []).extend(groups.pop(key))
  for dtype, parts in small.items():
    words = [jnp.ravel(_concatenable(p)) for p in parts]
    groups[(-1, dtype, None)] = [jnp.concatenate(words)]
  exponents = []  # of the elementwise maximum of up to `chunk` leaves
  for (_, dtype, _), parts in groups.items():
    if parts[0].size:
      parts = sorted(parts, key=lambda p: p.shape)  # one shape's leaves together
      for i in range(0, len(parts), chunk):
        exponents.append(_exponent_bytes(_combined(parts[i : i + chunk], dtype), dtype))
  if not exponents:
    return jnp.array(True) if bad is None else jnp.logical_not(bad)
  receiver = min(exponents, key=lambda e: e.size)
  others = [jnp.max(e) for e in exponents if e is not receiver]
  if bad is not None:
    others.append(jnp.where(bad, np.uint8(255), np.uint8(0)))
  if others:
    receiver = jnp.maximum(receiver, jnp.max(jnp.stack(others)))
  return jnp.max(receiver) != 255


def _exponent_bytes(combined: jax.Array, dtype: Any) -> jax.Array:
  """The exponent field of each entry of ``combined`` (exponent bits of
  ``dtype``) as one uint8, 255 exactly where it is all ones.

  The check reduces these bytes, and compares only the maximum: an entry's
  bits compared with the all-ones exponent where a float computation made
  them (an unscale) are an ``isinf``/``isnan`` idiom LLVM folds to false
  under fast-math. Bytes rather than the exponent words, because XLA's CPU
  backend compiles a byte reduction as one library call where it stages a
  32-bit one in three kernels, and writes one byte an entry where it wrote
  four (BENCHMARKS.md).
  """
  info = jnp.finfo(dtype)
  ones = (1 << info.nexp) - 1  # the all-ones exponent field
  field = combined >> np.asarray(info.nmant, combined.dtype)
  if ones <= 255:
    return (field + np.asarray(255 - ones, field.dtype)).astype(jnp.uint8)
  low = np.asarray(ones - 255, field.dtype)  # float64: 2047 -> 255, below 1792 -> 0
  return (jnp.maximum(field, low) - low).astype(jnp.uint8)


def _combined(parts: list[jax.Array], dtype: Any) -> jax.Array:
  """The elementwise maximum of the exponent bits of parts of one size and
  float ``dtype`` (floats or their :func:`_words`).

  Parts of one shape are combined as they are, and only the results of
  different shapes raveled: XLA's simplifier moves a reshape past one
  maximum per round of its pipeline, so a chain of raveled leaves of one
  shape made it run once per leaf (BENCHMARKS.md, investigation log).
  """
  by_shape: dict[tuple[int, ...], jax.Array] = {}
  for part in parts:
    bits = _exponent_bits(part, dtype)
    acc = by_shape.get(part.shape)
    by_shape[part.shape] = bits if acc is None else jnp.maximum(acc, bits)
  accs = list(by_shape.values())
  if len(accs) > 1:
    accs = [jnp.ravel(a) for a in accs]
  return functools.reduce(jnp.maximum, accs)


#: Bits of :func:`nonfinite_kinds`' codes: the leaf holds a NaN, an infinity.
NAN = 1
INF = 2

#: Leaves of at most this many entries are classified stacked (padded, by
#: dtype and power-of-two size), one reduction per stack; larger ones are
#: reduced where they lie, so the copies stay small.
KINDS_STACK_MAX_SIZE = 1 << 12


def _magnitude(x: Any) -> tuple[Any, Any]:
  """``(x's bits without the sign, as unsigned integers, the all-ones exponent)``.

  For a JAX array (in the step) or a NumPy array (on the host) of a dtype
  :func:`_tested` returns. An IEEE float's bits without the sign, as an
  unsigned integer, equal the all-ones exponent exactly for an infinity and
  exceed it for a NaN.
  """
  uint, mask = _layout(x.dtype)
  sign = np.iinfo(uint).max >> 1  # every bit but the sign
  return _words(x) & np.asarray(sign, uint), np.asarray(mask, uint)


def _kind_codes(words: jax.Array, dtype: Any, axis: int | None = None) -> jax.Array:
  """``NAN | INF`` bits (uint8) of entries whose :func:`_words` (of floats
  of ``dtype``) are ``words``, combined along ``axis``.

  No entry is compared (see :func:`_exponent_bytes`): each gives two bytes
  made with bit operations only, 255 exactly where it is a NaN and where it
  is an infinity, and only their maxima are. Each is a maximum of its own
  (not a bitwise-or reduction, which sharded arrays would turn into an
  all-reduce that collectives do not implement).
  """
  uint, _ = _layout(dtype)
  nmant = jnp.finfo(dtype).nmant
  exponent = _exponent_bytes(_exponent_bits(words, dtype), dtype)
  ones = np.asarray((1 << nmant) - 1, uint)  # the fraction's bits
  nonzero = (((words & ones) + ones) >> np.asarray(nmant, uint)).astype(jnp.uint8)
  nan = exponent & (np.uint8(0) - nonzero)  # the exponent, where the fraction is not 0
  inf = exponent & (nonzero - np.uint8(1))  # the exponent, where it is 0
  nan = (jnp.max(nan, axis=axis) == 255).astype(jnp.uint8)
  inf = (jnp.max(inf, axis=axis) == 255).astype(jnp.uint8)
  return nan * np.uint8(NAN) | inf * np.uint8(INF)


def count_nonfinite(x: Any) -> tuple[int, int]:
  """``(NaN entries, infinite entries)`` of one array, counted on the host.

  The array is fetched (``np.asarray``) and its bits tested with NumPy as
  :func:`nonfinite_kinds` tests them in a step: no compilation, so naming
  the bad leaves of a large tree costs what reading it costs. A complex
  entry counts as NaN when either part is NaN and as infinite when either
  part is infinite (NumPy's ``isnan`` and ``isinf``: ``nan + infj`` is
  both); arrays that are not floating count 0.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_lossscale._loss_scale import finite as _finite
    >>> _finite.count_nonfinite(jnp.array([jnp.nan, -jnp.inf, 1.0, jnp.nan]))
    (2, 1)
  """
  dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
  if not jnp.issubdtype(dtype, jnp.inexact):  # before a PRNG key is fetched
    return 0, 0
  x = np.ravel(np.asarray(x))
  nan, inf = _entry_kinds([np.ascontiguousarray(_tested(p)) for p in _parts(x)])
  return int(np.count_nonzero(nan)), int(np.count_nonzero(inf))


def _parts(x: Any) -> tuple:
  """``x``'s real and imaginary parts if it is complex, else ``(x,)``."""
  if np.iscomplexobj(x):
    return (x.real, x.imag) if isinstance(x, np.ndarray) else (jnp.real(x), jnp.imag(x))
  return (x,)


def _entry_kinds(parts: list) -> tuple[Any, Any]:
  """``(NaN, infinite)`` masks of the entries whose parts are ``parts`` (of
  a dtype :func:`_tested` returns): an entry is NaN where a part is, and
  infinite where a part is (NumPy's ``isnan``, ``isinf``)."""
  nan = inf = None
  for part in parts:
    magnitude, mask = _magnitude(part)
    n, i = magnitude > mask, magnitude == mask
    nan = n if nan is None else nan | n  # NumPy or JAX booleans alike
    inf = i if inf is None else inf | i
  return nan, inf


def count_nonfinite_device(x: jax.Array) -> jax.Array:
  """:func:`count_nonfinite` computed where ``x`` lies, for an array no host holds.

  Returns an int32 array of shape ``(2, rows)``: the NaN and infinite
  entries of each row of ``x`` (its first axis; one row for a scalar or a
  vector), so that no single count can overflow int32; sum it on the host.
  Nothing is reshaped, so any sharding of ``x`` is kept.
  """
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros((2, 1), jnp.int32)
  x = held(x)
  axes = tuple(range(1, x.ndim)) if x.ndim > 1 else None
  nan, inf = _entry_kinds([_tested(p) for p in _parts(x)])
  return jnp.stack(
    [
      jnp.atleast_1d(jnp.sum(nan, axis=axes, dtype=jnp.int32)),
      jnp.atleast_1d(jnp.sum(inf, axis=axes, dtype=jnp.int32)),
    ]
  )


def nonfinite_kinds(leaves: list[Any]) -> jax.Array:
  """What each leaf holds that is not finite: a uint8 vector of ``NAN | INF`` bits.

  Entry ``i`` is 0 when ``leaves[i]`` is finite (or not floating), and has
  the :data:`NAN` bit when it holds a NaN and the :data:`INF` bit when it
  holds an infinity. Complex leaves are read in both parts; float8 leaves
  in float32 (exact). Small leaves are stacked by dtype and power-of-two
  size, so the number of reductions (and XLA's compile time) grows with the
  number of such classes, not of leaves.

  Args:
    leaves: arrays (``jax.tree.leaves`` of a tree).

  Returns:
    A ``uint8`` array of shape ``(len(leaves),)``.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_lossscale._loss_scale import finite as _finite
    >>> _finite.nonfinite_kinds([jnp.ones(2), jnp.array([jnp.nan, jnp.inf])])
    Array([0, 3], dtype=uint8)
  """
  pieces, order = [], []
  stacks: dict[tuple[Any, int], list[tuple[int, jax.Array]]] = {}
  for i, x in enumerate(leaves):
    if not is_float_array(x) or x.size == 0:
      continue
    x = held(x)
    parts = [_tested(p) for p in _parts(x)]
    dtype = parts[0].dtype
    if explicit_spec(x) is not None:  # sharded in its type: reduced where it lies
      codes = [_kind_codes(_words(part), dtype) for part in parts]
      pieces.append(functools.reduce(jnp.bitwise_or, codes)[None])
      order.append(i)
      continue
    # Moved (raveled, concatenated, padded, stacked) as words, never as
    # floats: XLA's CPU backend moves bfloat16 through float32, and under
    # fast-math that conversion may drop NaN and infinities.
    x = jnp.concatenate([jnp.ravel(_words(part)) for part in parts])
    if x.size > KINDS_STACK_MAX_SIZE:
      pieces.append(_kind_codes(x, dtype)[None])
      order.append(i)
    else:
      width = 1 << (x.size - 1).bit_length()
      stacks.setdefault((dtype, width), []).append((i, x))
  for (dtype, width), items in stacks.items():
    rows = jnp.stack([jnp.pad(x, (0, width - x.size)) for _, x in items])
    pieces.append(_kind_codes(rows, dtype, axis=1))
    order.extend(i for i, _ in items)
  kinds = jnp.zeros(len(leaves), jnp.uint8)
  if pieces:
    kinds = kinds.at[np.asarray(order)].set(jnp.concatenate(pieces))
  return kinds
