"""Rounding to bfloat16 or float16, to nearest or at random; the update landing there.

:func:`round_to` rounds float32 values to a half dtype, to nearest even or
stochastically (an exact probability from a uniform draw);
:func:`exact_update` is the float32 update that ``optax.apply_updates``
turns into exactly a given rounded value. The transformations of
``_low_precision`` are built on them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from optax_lossscale import _tree

__all__ = ["HALF_DTYPES", "exact_update", "is_half", "round_to"]

_F32 = jnp.dtype(jnp.float32)

#: The parameter dtypes that the two transformations round to.
HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def is_half(x: Any) -> bool:
  """An array of a dtype in :data:`HALF_DTYPES`."""
  return _tree.is_array(x) and x.dtype in HALF_DTYPES


# --------------------------------------------------------------------------
# The rounding, and the update that applies it.
# --------------------------------------------------------------------------


def round_to(x: Any, dtype: Any, uniform: Any = None) -> jax.Array:
  """A float32 array rounded to ``dtype``: to nearest even, or stochastically.

  Without ``uniform``, ``x.astype(dtype)``: round to nearest, ties to even.
  With ``uniform`` (random numbers in [0, 1) of ``x``'s shape, float32 as
  ``jax.random.uniform`` draws them), each entry becomes its upper
  ``dtype`` neighbour ``hi`` where ``uniform < (x - lo) / (hi - lo)`` and
  its lower one ``lo`` otherwise: ``hi`` with probability
  ``(x - lo) / (hi - lo)``, so the expected result is ``x``.

  The neighbours are ``x``'s nearest ``dtype`` value and the next one on the
  other side of ``x`` (``jnp.nextafter`` in ``dtype``), which covers negative
  values, subnormals and the step across zero. The two differences are
  exact in float32 and the spacing ``hi - lo`` is a power of two, so the
  probability is exact, and a multiple of 2**-16 (bfloat16), 2**-13 (normal
  float16) or at least 2**-23 (float16's subnormals), which float32 uniforms
  (multiples of 2**-23) hit exactly: the rounding is unbiased. The one
  exception: between 0 and float16's smallest subnormal 2**-24 the
  probability can be finer than 2**-23 and is rounded up to a multiple of
  it (a bias below 2**-47). Values of ``dtype`` (exactly representable),
  ``±inf``, NaN and values beyond ``dtype``'s largest finite value are
  rounded to nearest, whatever ``uniform`` says: they never move, and
  overflow as round-to-nearest does. Where the backend flushes float32
  subnormals to zero (XLA's CPU backend), a subnormal ``x`` (below 2**-126,
  where bfloat16's subnormals lie) is read as zero, and rounded to nearest;
  no other input is affected (the differences are taken after scaling
  values below 1 by 2**64, so none of them is subnormal).

  Args:
    x: a float32 array.
    dtype: ``jnp.bfloat16`` or ``jnp.float16``.
    uniform: ``None``, or float32 uniform random numbers in [0, 1) of
      ``x``'s shape.

  Returns:
    ``x`` rounded, in ``dtype``.

  Raises:
    ValueError: ``x`` is not float32, ``dtype`` is not bfloat16 or float16,
      or ``uniform`` is not a float32 array of ``x``'s shape.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_lossscale._rounding import round_to
    >>> x = jnp.full(2, 1 + 2.0**-9)  # a quarter of the way from 1 to 1 + 2**-7
    >>> round_to(x, jnp.bfloat16)
    Array([1, 1], dtype=bfloat16)
    >>> round_to(x, jnp.bfloat16, jnp.array([0.2, 0.3]))  # 1 + 2**-7 if u < 1/4
    Array([1.00781, 1], dtype=bfloat16)
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
  nearest = x.astype(dtype)
  if uniform is None:
    return nearest
  uniform = jnp.asarray(uniform)
  if uniform.dtype != _F32 or uniform.shape != x.shape:
    raise ValueError(
      f"`uniform` must be a float32 array of x's shape {x.shape}, got "
      f"{uniform.dtype}{list(uniform.shape)}."
    )
  near32 = nearest.astype(_F32)
  below = near32 < x  # the nearest value is the lower neighbour
  toward = jnp.where(below, jnp.inf, -jnp.inf).astype(dtype)
  other = jnp.nextafter(nearest, toward)
  lo = jnp.where(below, nearest, other)
  hi = jnp.where(below, other, nearest)
  # To nearest: values of the dtype, inf, NaN, beyond the largest value.
  keep = (near32 == x) | ~(jnp.abs(x) <= float(jnp.finfo(dtype).max))
  # Below 1 the differences are taken 2**64 times larger (exactly), so that
  # none is a float32 subnormal, which some backends flush to zero.
  scale = jnp.where(jnp.abs(x) < 1.0, 2.0**64, 1.0).astype(_F32)
  lo_scaled = lo.astype(_F32) * scale
  spacing = jnp.where(keep, 1.0, hi.astype(_F32) * scale - lo_scaled)
  p_hi = (x * scale - lo_scaled) / spacing
  return jnp.where(keep, nearest, jnp.where(uniform < p_hi, hi, lo))


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
  parameter that is ``±inf`` and stays so gets a zero update (``inf - inf``
  would be NaN).

  Args:
    new: the rounded new parameter, in ``param``'s dtype.
    param: the current parameter.

  Returns:
    The float32 update.
  """
  new32, param32 = new.astype(_F32), param.astype(_F32)
  return jnp.where(new32 == param32, 0.0, new32 - param32)
