"""The one parser for dtype and backend arguments: documented spellings only.

Every argument that names a dtype (a policy's three dtypes, autocast's
``compute_dtype``, a float8 recipe's formats) or a backend goes through
:func:`float_dtype` or :func:`backend`. A dtype is a JAX or NumPy dtype or
scalar type, or one of the names in :data:`NAMES`; nothing else. NumPy's own
string codes are not accepted: ``np.dtype("f16")`` is a 16-*byte* float
(float128), where the policy strings say ``f16`` is float16, and
``np.dtype(None)`` is float64.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["BACKENDS", "NAMES", "backend", "default_half_dtype", "float_dtype"]

#: The dtype names the package documents (policy strings use them too);
#: ``half`` is :func:`default_half_dtype`'s.
NAMES = {
  "float16": jnp.dtype(jnp.float16),
  "f16": jnp.dtype(jnp.float16),
  "bfloat16": jnp.dtype(jnp.bfloat16),
  "bf16": jnp.dtype(jnp.bfloat16),
  "float32": jnp.dtype(jnp.float32),
  "f32": jnp.dtype(jnp.float32),
  "full": jnp.dtype(jnp.float32),
  "single": jnp.dtype(jnp.float32),
  "float64": jnp.dtype(jnp.float64),
  "f64": jnp.dtype(jnp.float64),
  "double": jnp.dtype(jnp.float64),
}

#: Backend names: JAX's platforms and their aliases.
BACKENDS = ("cpu", "gpu", "cuda", "rocm", "tpu")


def backend(value: Any) -> str:
  """A backend name, lowercased; ``None`` is JAX's default backend.

  Raises:
    ValueError: anything but ``None`` or one of :data:`BACKENDS`.
  """
  if value is None:
    return jax.default_backend().lower()
  if not isinstance(value, str) or value.strip().lower() not in BACKENDS:
    raise ValueError(
      f"`backend` must be None (JAX's default) or one of {', '.join(BACKENDS)}; "
      f"got {value!r}."
    )
  return value.strip().lower()


def default_half_dtype(backend_name: str | None = None) -> jnp.dtype:
  """The half-precision dtype to compute in on a backend (default: JAX's).

  float16 on GPUs (fast float16 matmuls; pair it with loss scaling),
  bfloat16 on TPUs and CPUs (float32's exponent range: no loss scaling
  needed).

  Raises:
    ValueError: an unknown backend name.
  """
  if backend(backend_name) in ("gpu", "cuda", "rocm"):
    return jnp.dtype(jnp.float16)
  return jnp.dtype(jnp.bfloat16)


def float_dtype(
  name: str,
  value: Any,
  *,
  allowed: Iterable[Any] | None = None,
  backend_name: str | None = None,
  float8_hint: str = "",
) -> jnp.dtype:
  """``value`` as a floating dtype; a ``ValueError`` naming ``name`` otherwise.

  Args:
    name: the argument's name, for the message.
    value: a JAX or NumPy dtype or scalar type (``jnp.float16``,
      ``np.dtype("float32")``, ``jnp.bfloat16``), or a name of
      :data:`NAMES` (case-insensitive), or ``"half"``.
    allowed: the dtypes the argument accepts (default: every floating one).
    backend_name: the backend ``"half"`` is resolved for.
    float8_hint: what to do instead, appended to the message for a float8
      dtype that is not ``allowed``.

  Raises:
    ValueError: ``None``, a Python type (``float``), a string that is not a
      documented name, anything that is not a floating dtype, a dtype not
      in ``allowed``, or float64 while ``jax_enable_x64`` is off (JAX would
      compute in float32 instead).
  """
  spellings = "a dtype such as jnp.float16, or one of " + ", ".join(["half", *NAMES])
  if isinstance(value, str):
    key = value.strip().lower()
    if key == "half":
      dtype = default_half_dtype(backend_name)
    elif key in NAMES:
      dtype = NAMES[key]
    elif allowed is not None and key in {jnp.dtype(a).name for a in allowed}:
      dtype = jnp.dtype(key)  # an allowed dtype by its own name ("float8_e4m3fn")
    else:
      use = (
        spellings
        if allowed is None
        else "one of " + ", ".join(jnp.dtype(a).name for a in allowed)
      )
      raise ValueError(f"`{name}`: unknown dtype name {value!r}; use {use}.")
  elif (
    value is None
    or any(value is t for t in (float, int, complex, bool))
    or isinstance(value, (bool, int, float, complex))
  ):
    raise ValueError(f"`{name}` must be {spellings}; got {value!r}.")
  else:
    try:
      dtype = jnp.dtype(value)
    except TypeError:
      raise ValueError(f"`{name}` must be {spellings}; got {value!r}.") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"`{name}` must be a floating dtype, got {dtype.name}.")
  allowed = None if allowed is None else [jnp.dtype(a) for a in allowed]
  if allowed is not None and dtype not in allowed:
    hint = float8_hint if float8_hint and jnp.finfo(dtype).bits == 8 else ""
    raise ValueError(
      f"`{name}` must be one of {', '.join(a.name for a in allowed)}; got "
      f"{dtype.name}.{' ' + hint if hint else ''}"
    )
  if dtype == jnp.float64 and not jax.config.jax_enable_x64:
    raise ValueError(
      f"`{name}` is float64, but jax_enable_x64 is off: JAX would compute in "
      "float32. Enable it (jax.config.update('jax_enable_x64', True)) first."
    )
  return dtype
