"""Rounding float32 to bfloat16 or float16 on its bits, to nearest or at random.

:func:`round_to` rounds float32 values to a half dtype and returns them as
float32 values that the dtype holds exactly: to nearest (ties to even), or
stochastically, by adding one random integer below the bits the dtype keeps
and truncating. Both are integer operations on the values' bits: one
elementwise pass, exact, and out of reach of the compiler rewrites that may
drop a float32-to-half-to-float32 round trip as "excess precision" (XLA's
default allows them where its fusions fall). :func:`exact_update` is the
float32 update that ``optax.apply_updates`` turns into exactly a given
rounded value. The transformations of ``low_precision`` are built on them.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_lossscale._base import tree as _tree

__all__ = [
  "HALF_DTYPES",
  "draw",
  "exact_update",
  "is_half",
  "join_remainder",
  "random_bits_dtype",
  "round_to",
  "split_remainder",
  "uniform",
  "uniform_of",
]

_F32 = jnp.dtype(jnp.float32)
_U32 = jnp.dtype(jnp.uint32)
BF16, F16 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)

#: The parameter dtypes the transformations round to.
HALF_DTYPES = (BF16, F16)

_SIGN = np.uint32(0x80000000)
_MAGNITUDE = np.uint32(0x7FFFFFFF)
_INF = np.uint32(0x7F800000)
#: The largest finite value of each dtype, as float32 bits.
_MAX = {
  BF16: np.uint32(np.float32(jnp.finfo(BF16).max).view(np.uint32)),
  F16: np.uint32(np.float32(jnp.finfo(F16).max).view(np.uint32)),
}
#: float32 biased exponents: float16's smallest normal (2**-14), and below
#: 2**-24 (float16's smallest subnormal), where a value rounds to 0 or 2**-24.
_F16_NORMAL = 127 - 14
_F16_TINY = 127 - 24


def is_half(x: Any) -> bool:
  """An array of a dtype in :data:`HALF_DTYPES`."""
  return _tree.is_array(x) and x.dtype in HALF_DTYPES


def random_bits_dtype(dtype: Any) -> jnp.dtype:
  """The random integers :func:`round_to` takes for ``dtype``: 16 bits for
  bfloat16 (it drops 16 of float32's), 32 for float16 (it drops 13 to 23, and
  the probability below its smallest subnormal is finer still)."""
  return jnp.dtype(jnp.uint16 if jnp.dtype(dtype) == BF16 else jnp.uint32)


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _threefry2x32(k0: Any, k1: Any, x0: jax.Array, x1: jax.Array) -> jax.Array:
  """The first word of the Threefry-2x32 hash (20 rounds) of counter
  ``(x0, x1)`` under key ``(k0, k1)``: JAX's own PRNG hash
  (``jax.extend.random.threefry_2x32``), written out elementwise."""
  u32 = np.uint32
  ks = (k0, k1, k0 ^ k1 ^ u32(0x1BD11BDA))
  x0, x1 = x0 + ks[0], x1 + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = x0 ^ ((x1 << u32(r)) | (x1 >> u32(32 - r)))
    x0, x1 = x0 + ks[(i + 1) % 3], x1 + ks[(i + 2) % 3] + u32(i + 1)
  return x0


def draw(key: jax.Array, shape: tuple, dtype: Any) -> jax.Array:
  """One random integer per element for rounding to ``dtype``.

  Threefry-2x32 (:func:`_threefry2x32`) of each element's index, its row
  in the leading axes and its column in the last one, keyed by ``key``
  (a threefry key's own two words; a key of another PRNG implementation
  draws two with ``jax.random.bits``); the top bits of the hash's first
  word, of :func:`random_bits_dtype`. Elementwise on the indices, it fuses into the
  rounding that reads it (``jax.random.bits`` of the whole shape is a loop
  over stored arrays on XLA's CPU backend: BENCHMARKS.md, "bfloat16
  parameters"), and an element's number does not depend on how the array
  is sharded.

  Raises:
    ValueError: more than 2**32 - 1 rows or columns.
  """
  shape = tuple(shape)
  rows = math.prod(shape[:-1])
  if rows >= 2**32 or (shape and shape[-1] >= 2**32):
    raise ValueError(
      f"stochastic rounding indexes an array by 32-bit row and column; shape "
      f"{shape} has more. Split the parameter."
    )
  words = jax.random.key_data(key).reshape(-1)
  if words.shape != (2,):  # not a threefry key: two words drawn from it
    words = jax.random.bits(key, (2,), _U32)
  column = lax.broadcasted_iota(_U32, shape, len(shape) - 1) if shape else _U32.type(0)
  row, stride = jnp.zeros(shape, _U32), 1
  for axis in range(len(shape) - 2, -1, -1):
    row = row + lax.broadcasted_iota(_U32, shape, axis) * np.uint32(stride)
    stride *= shape[axis]
  hashed = _threefry2x32(words[0], words[1], row, jnp.broadcast_to(column, shape))
  out = random_bits_dtype(dtype)
  return (hashed >> np.uint32(32 - 8 * out.itemsize)).astype(out)


def uniform_of(x: jax.Array, first: Any = 0, step: Any = None) -> jax.Array:
  """float32 numbers in [0, 1), one per element of float32 ``x``, hashed
  from the element's own bits, its flat index plus ``first`` (an int or
  an int32 scalar: where ``x`` is a tile of a larger array) and ``step``
  (an int32 scalar, or None for 0: a new set of numbers each step)
  (Threefry-2x32 under a key of ``step``): no key to carry, and a new draw
  wherever the value or the step changes."""
  index = lax.iota(_U32, x.size).reshape(x.shape)
  if not (isinstance(first, int) and first == 0):
    index = index + jnp.asarray(first).astype(_U32)
  key = np.uint32(0x0C0DE)
  if step is not None:
    key = key ^ jnp.asarray(step).astype(_U32)
  bits = lax.bitcast_convert_type(x.astype(_F32), _U32)
  hashed = _threefry2x32(np.uint32(0x5EED), key, bits, index)
  return (hashed >> np.uint32(8)).astype(_F32) * np.float32(2.0**-24)


def uniform(key: jax.Array, shape: tuple) -> jax.Array:
  """float32 numbers in [0, 1), one per element, each of 24 random bits of
  :func:`draw`'s hash (elementwise, so it fuses into the rounding)."""
  bits = draw(key, shape, jnp.float32) >> np.uint32(8)
  return bits.astype(jnp.float32) * np.float32(2.0**-24)


def _dropped(magnitude: jax.Array, dtype: Any) -> Any:
  """How many low float32 bits ``dtype`` does not keep (per element for float16)."""
  if dtype == BF16:  # float32's exponent range: always the low 16
    return np.uint32(16)
  exponent = magnitude >> 23
  # float16 keeps 10 of the 23 fraction bits down to 2**-14; below, its
  # subnormals keep one bit fewer per binade (a multiple of 2**-24).
  below = jnp.maximum(np.uint32(_F16_NORMAL), exponent) - exponent
  return np.uint32(13) + jnp.minimum(below, np.uint32(10))


def round_to(x: Any, dtype: Any, bits: Any = None) -> jax.Array:
  """float32 ``x`` rounded to ``dtype``, returned as the float32 values it holds.

  Works on the bits of ``|x|`` (the sign is kept): the dtype keeps the high
  bits of a float32 and drops ``d`` low ones (bfloat16: 16; float16: 13,
  and 14 to 23 in its subnormal range). Adding to the dropped bits and
  truncating them rounds the magnitude up exactly when the sum carries
  into the kept bits, and a carry out of the fraction lands on the next
  power of two, which the dtype holds too.

  * Without ``bits``: to nearest, ties to even (add ``2**(d-1) - 1`` and the
    lowest kept bit): what ``x.astype(dtype)`` does.
  * With ``bits`` (one random integer per element, uniform, of
    :func:`random_bits_dtype`: 16 bits for bfloat16, 32 for float16): add
    its top ``d`` bits and truncate. The magnitude rounds up, where the
    sum carries (``bits >= 2**B - L * 2**(B - d)``, ``B`` the integers'
    width), with probability ``L / 2**d``, ``L`` the dropped bits' value,
    which is ``(|x| - lo) / (hi - lo)`` for the two neighbours
    ``lo <= |x| < hi``: exact and unbiased. Below float16's smallest
    subnormal ``2**-24`` the neighbours are 0 and ``2**-24`` and the
    probability ``|x| / 2**-24`` is taken to 32 bits, rounded down: exact for
    ``|x| >= 2**-33``, short by less than ``2**-56`` below.

  Values of the dtype never move; ``±inf`` and NaN pass; a value beyond the
  dtype's largest finite one is rounded to nearest, ``±inf`` from half a
  unit past it, as round-to-nearest does. float32 subnormals are rounded
  as any other value (no arithmetic reads them: nothing is flushed).

  Args:
    x: a float32 array.
    dtype: ``jnp.bfloat16`` or ``jnp.float16``.
    bits: ``None``, or random integers of ``x``'s shape and of
      :func:`random_bits_dtype` (``draw`` makes them).

  Returns:
    float32, ``x``'s shape: values that ``dtype`` represents exactly, so
    that converting them to ``dtype`` is exact.

  Raises:
    ValueError: ``x`` is not float32, ``dtype`` not bfloat16 or float16, or
      ``bits`` not of :func:`random_bits_dtype` and ``x``'s shape.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_lossscale._base.rounding import round_to
    >>> x = jnp.full(2, 1 + 2.0**-9)  # a quarter of the way from 1 to 1 + 2**-7
    >>> round_to(x, jnp.bfloat16)
    Array([1., 1.], dtype=float32)
    >>> bits = jnp.array([0xD000, 0xB000], jnp.uint16)  # up iff bits >= 3/4 * 2**16
    >>> round_to(x, jnp.bfloat16, bits)
    Array([1.0078125, 1.       ], dtype=float32)
  """
  x = jnp.asarray(x)
  if x.dtype != _F32:
    raise ValueError(f"`x` must be a float32 array, got dtype {x.dtype}.")
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    dtype = None
  if dtype not in HALF_DTYPES:
    raise ValueError(f"`dtype` must be bfloat16 or float16, got {dtype!r}.")
  if bits is not None:
    bits = jnp.asarray(bits)
    want = random_bits_dtype(dtype)
    if bits.dtype != want or bits.shape != x.shape:
      raise ValueError(
        f"`bits` must be a {want} array of x's shape {x.shape}, got "
        f"{bits.dtype}{list(bits.shape)}."
      )
  return _rounder(dtype)(x, bits)


@functools.cache
def _rounder(dtype: Any) -> Any:
  """:func:`round_to` for ``dtype``, differentiated as a cast."""
  return _tree.differentiated_as_cast(functools.partial(_round_bits, dtype=dtype))


def _round_bits(x: jax.Array, bits: Any, dtype: Any) -> jax.Array:
  raw = lax.bitcast_convert_type(x, _U32)
  sign, magnitude = raw & _SIGN, raw & _MAGNITUDE
  dropped = _dropped(magnitude, dtype)
  one = np.uint32(1)
  if bits is None:
    add = (one << (dropped - one)) - one + ((magnitude >> dropped) & one)
  else:
    width = np.uint32(jnp.iinfo(bits.dtype).bits)
    add = bits.astype(_U32) >> (width - dropped)  # its top `dropped` bits
  rounded = (magnitude + add) & ~((one << dropped) - one)
  if dtype == F16:  # below 2**-24: 0 or 2**-24
    exponent = magnitude >> 23
    if bits is None:  # to nearest: 2**-24 above 2**-25, the tie (2**-25) to 0
      up = magnitude > np.float32(2.0**-25).view(np.uint32)
    else:  # up with probability |x| / 2**-24 = |x| * 2**56 / 2**32
      significand = (magnitude & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
      shift = exponent.astype(jnp.int32) - 94  # |x| * 2**56 = significand * 2**shift
      threshold = jnp.where(
        shift >= 0,
        significand << jnp.clip(shift, 0, 31).astype(_U32),
        significand >> jnp.clip(-shift, 0, 31).astype(_U32),
      )
      threshold = jnp.where(exponent == 0, np.uint32(0), threshold)
      # bits >= 2**32 - threshold, as the carry of the other values.
      up = ~bits.astype(_U32) < threshold
    smallest = np.float32(2.0**-24).view(np.uint32)
    tiny = exponent < np.uint32(_F16_TINY)
    rounded = jnp.where(tiny, jnp.where(up, smallest, np.uint32(0)), rounded)
  if bits is not None:  # beyond the largest finite value: to nearest
    half_unit = np.uint32(1 << (15 if dtype == BF16 else 12))
    nearest = jnp.where(magnitude >= _MAX[dtype] + half_unit, _INF, _MAX[dtype])
    rounded = jnp.where(magnitude > _MAX[dtype], nearest, rounded)
  rounded = jnp.where(rounded > _MAX[dtype], _INF, rounded)  # overflow: inf
  rounded = jnp.where(magnitude > _INF, magnitude, rounded)  # NaN passes
  return lax.bitcast_convert_type(sign | rounded, _F32)


def exact_update(new: jax.Array, param: jax.Array) -> jax.Array:
  """The float32 update that ``optax.apply_updates`` turns into exactly ``new``.

  ``apply_updates`` computes ``(param + update).astype(param.dtype)`` in
  float32. With ``update = float32(new) - float32(param)``: when that
  difference is exact in float32, ``param + update`` is ``new`` exactly (no
  rounding at all), and it is exact when one of them is zero or their
  magnitudes are within a factor of 2**15 (bfloat16) or 2**12 (float16):
  both are multiples of ``2**(e - t)``, with ``e`` the smaller one's exponent
  and ``t`` the dtype's fraction bits (7, 10), and their difference is below
  ``2**(E + 2)``, with ``E`` the larger one's exponent, so it is an integer
  of at most ``E - e + t + 2 <= 24`` bits times a power of two. When the
  difference is rounded but ``|new| >= |param|`` (a weight that grows, by
  any factor), ``param + update`` is within four float32 units of ``new``
  and rounds back to it. So the only steps that can come out a unit off (or
  zero) are those that shrink a weight's magnitude by more than 2**15
  (bfloat16) or 2**12 (float16) without making it zero, and a sign change of
  a bfloat16 weight beyond 1.7e38 (the difference overflows float32). Where
  the backend flushes float32 subnormals to zero (XLA's CPU backend), add
  bfloat16 weights below 2**-118, whose differences can be subnormal. A zero
  comes back as ``+0.0`` where ``new`` is ``-0.0`` (IEEE addition), and a
  parameter that is ``±inf`` gets a zero update and stays so, whatever
  ``new`` is: no update takes it back (``inf + u`` is ``inf`` or NaN), and
  ``new - inf`` would make it NaN.

  Args:
    new: the rounded new parameter: float32 values the parameter's dtype
      holds (:func:`round_to`'s), or already in that dtype.
    param: the current parameter.

  Returns:
    The float32 update.
  """
  new32, param32 = new.astype(_F32), param.astype(_F32)
  # Where both are equal and finite the difference is already +0.0 (or
  # -0.0, which the addition makes +0.0): only an infinite parameter needs
  # the select, and one test covers it.
  return jnp.where(jnp.isinf(param32), 0.0, new32 - param32)


@_tree.differentiated_as_cast
def split_remainder(master: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A float32 array as ``(bfloat16 parameter, int16 remainder)``, exactly.

  bfloat16 is the high half of a float32: the parameter is ``master``
  rounded to nearest, ties away from zero (its high 16 bits plus the carry
  of the low 16 bits' top bit; round-to-nearest-even differs only where the
  low 16 bits are exactly ``0x8000``), and the remainder is what the low 16
  bits then mean relative to it, in ``[-2**15, 2**15)``:
  :func:`join_remainder` gives ``master`` back, bit for bit. NaN becomes
  bfloat16 NaN with remainder 0; a float32 beyond bfloat16's largest finite
  value by half a unit or more is ``±inf`` in the parameter (and still
  exact in the join).
  """
  bits = lax.bitcast_convert_type(master, _U32)
  high = (bits + np.uint32(0x8000)) >> np.uint32(16)
  nan = (bits & _MAGNITUDE) > _INF
  high = jnp.where(nan, (bits >> np.uint32(16)) | np.uint32(0x40), high)  # quiet
  remainder = jnp.where(
    nan, 0, bits.astype(jnp.int32) - (high << np.uint32(16)).astype(jnp.int32)
  )
  param = lax.bitcast_convert_type(high.astype(jnp.uint16), BF16)
  return param, remainder.astype(jnp.int16)


@_tree.differentiated_as_cast
def join_remainder(param: jax.Array, remainder: jax.Array) -> jax.Array:
  """The float32 master weight of a bfloat16 ``param`` and its int16 ``remainder``."""
  high = lax.bitcast_convert_type(param, jnp.uint16).astype(_U32) << np.uint32(16)
  bits = high + remainder.astype(jnp.int32).astype(_U32)  # modulo 2**32
  return lax.bitcast_convert_type(bits, _F32)
