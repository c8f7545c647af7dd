"""Validation of hyper-parameters: Python numbers in, checked numbers out.

Every function takes the argument's name and its value, and either returns
the value as a Python ``float``/``int`` or raises a ``ValueError`` that names
the argument and quotes the value. Hyper-parameters are checked eagerly, when
a transformation is built, never on traced values.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "INT32_MAX",
  "SCALE_RANGE",
  "as_f32",
  "as_float",
  "as_int",
  "check_scale",
  "choice",
  "float_in",
  "int_in",
  "is_real_scalar",
  "optional_int_at_least",
  "optional_positive",
]

INT32_MAX = int(np.iinfo(np.int32).max)
#: Every loss scale lies in ``[2**-126, 2**126]``: the scale *and its
#: reciprocal* are then normal float32 numbers. XLA divides by a scalar by
#: multiplying with its reciprocal, and a subnormal reciprocal is flushed to
#: zero on some backends (CPU), which would silently zero every gradient.
SCALE_RANGE = (2.0**-126, 2.0**126)


def _concrete(name: str, value: Any, convert: Any) -> Any:
  """``convert(value)`` (``float`` or ``int``), or the ``ValueError`` of a
  traced value: hyper-parameters are fixed when a transformation is built."""
  try:
    return convert(value)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise ValueError(
      f"`{name}` must be a concrete Python number (a hyper-parameter, not a "
      f"traced value), got {value!r}: it is fixed when the transformation is "
      "built. optax.inject_hyperparams makes numeric arguments arrays, traced "
      f"in a jitted update: give it static_args naming them ({name!r} among "
      "them)."
    ) from e


def as_float(name: str, value: Any) -> float:
  """``value`` as a finite Python float (a concrete real number, not a bool;
  a 0-d real array too)."""
  array = isinstance(value, (np.ndarray, np.generic, jax.Array))
  if (
    isinstance(value, bool)
    or not (array or isinstance(value, numbers.Real))
    or (array and (np.shape(value) or not _real(value.dtype)))
  ):
    raise ValueError(f"`{name}` must be a real number, got {value!r}.")
  out = _concrete(name, value, float)
  if not math.isfinite(out):
    raise ValueError(f"`{name}` must be finite, got {value!r}.")
  return out


def _f32(value: float) -> float:
  with np.errstate(over="ignore"):  # 1e39 becomes inf, which callers refuse
    return float(np.float32(value))


def as_f32(name: str, value: Any) -> float:
  """``value`` as the float32 number the computation will use (finite).

  A hyper-parameter multiplies float32 state, so what counts is its float32
  rounding: ``1 - 1e-9`` is 1.0 there, ``1e39`` is ``inf``.
  """
  out = _f32(as_float(name, value))
  if not math.isfinite(out):
    raise ValueError(f"`{name}` is {value!r}, which is not finite in float32.")
  return out


def _real(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)


def as_int(name: str, value: Any) -> int:
  """``value`` as a Python int (an integer, not a bool; a 0-d integer array
  too, as :func:`as_float` takes a real one)."""
  array = isinstance(value, (np.ndarray, jax.Array)) and (
    jnp.issubdtype(value.dtype, jnp.integer) and not np.shape(value)
  )
  if not array and (
    isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer))
  ):
    raise ValueError(f"`{name}` must be an integer, got {value!r}.")
  return _concrete(name, value, int)


def float_in(name: str, value: Any, lo: float, hi: float) -> float:
  """``value`` as a float in the closed interval ``[lo, hi]``."""
  out = as_float(name, value)
  if not lo <= out <= hi:
    raise ValueError(f"`{name}` must be in [{lo}, {hi}], got {value!r}.")
  return out


def int_in(name: str, value: Any, lo: int, hi: int = INT32_MAX) -> int:
  """``value`` as an int in ``[lo, hi]`` (by default, what int32 holds)."""
  out = as_int(name, value)
  if not lo <= out <= hi:
    raise ValueError(f"`{name}` must be an integer in [{lo}, {hi}], got {value!r}.")
  return out


def optional_positive(name: str, value: Any, *, f32: bool = False) -> float | None:
  """``None``, or ``value`` as a positive finite float (finite in float32 too)."""
  if value is None:
    return None
  out = as_f32(name, value) if f32 else as_float(name, value)
  if out <= 0:
    raise ValueError(f"`{name}` must be positive or None, got {value!r}.")
  return out


def optional_int_at_least(name: str, value: Any, minimum: int) -> int | None:
  """``None``, or ``value`` as an int ``>= minimum``."""
  if value is None:
    return None
  out = as_int(name, value)
  if out < minimum:
    raise ValueError(
      f"`{name}` must be an integer >= {minimum} or None, got {value!r}."
    )
  return out


def check_scale(name: str, value: Any) -> float:
  """``value``, rounded to float32, in :data:`SCALE_RANGE`."""
  out = _f32(as_float(name, value))
  lo, hi = SCALE_RANGE
  if not lo <= out <= hi:
    raise ValueError(
      f"`{name}` must lie in [2**-126, 2**126] (the scale and its reciprocal "
      f"are then normal float32 numbers), got {value!r}."
    )
  return out


def choice(name: str, value: Any, options: tuple[str, ...]) -> str:
  """``value``, one of the strings ``options`` exactly (no other spelling)."""
  if not isinstance(value, str) or value not in options:
    raise ValueError(
      f"`{name}` must be one of {', '.join(repr(o) for o in options)}; got {value!r}."
    )
  return value


def is_real_scalar(x: Any) -> bool:
  """Whether ``x`` is one real number: a Python int or float (not a bool),
  or a 0-d integer or floating array, concrete or traced."""
  if isinstance(x, bool):
    return False
  real = isinstance(x, (int, float)) or (
    hasattr(x, "dtype")
    and (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer))
  )
  return real and np.ndim(x) == 0
