"""Mixed-precision policies: which dtype parameters, compute and outputs use.

A :class:`Policy` is three dtypes and three casts. It is created from Keras'
policy names (``'mixed_float16'``) or jmp-style strings
(``'params=float32,compute=float16,output=float32'``, short forms included).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from optax_lossscale._base import dtypes as _dtypes
from optax_lossscale._base import tree as _tree

#: The dtypes a policy holds: floating, wider than float8.
_POLICY_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
_KEYS = {
  "params": "param_dtype",
  "param": "param_dtype",
  "p": "param_dtype",
  "compute": "compute_dtype",
  "c": "compute_dtype",
  "output": "output_dtype",
  "out": "output_dtype",
  "o": "output_dtype",
}
# Keras' policy names: (params, compute, output).
_KERAS_NAMES = {
  "float16": ("float16", "float16", "float16"),
  "bfloat16": ("bfloat16", "bfloat16", "bfloat16"),
  "float32": ("float32", "float32", "float32"),
  "float64": ("float64", "float64", "float64"),
  "mixed_float16": ("float32", "float16", "float32"),
  "mixed_bfloat16": ("float32", "bfloat16", "float32"),
}


def default_half_dtype(backend: str | None = None) -> jnp.dtype:
  """The half-precision dtype to compute in on ``backend`` (default: JAX's).

  float16 on GPUs (fast float16 matmuls; pair it with loss scaling),
  bfloat16 on TPUs and CPUs (float32's exponent range: no loss scaling
  needed).

  Args:
    backend: ``None`` (JAX's default backend), ``'cpu'``, ``'gpu'``,
      ``'cuda'``, ``'rocm'`` or ``'tpu'``.

  Raises:
    ValueError: another backend name.
  """
  return _dtypes.default_half_dtype(backend)


def _dtype(
  text: str, part: str, backend: str | None, field: str = "dtype"
) -> jnp.dtype:
  try:
    return _dtypes.float_dtype(field, text, backend_name=backend)
  except ValueError as e:
    raise ValueError(f"Policy part {part!r}: {e}") from None


def _cast(tree: Any, dtype: jnp.dtype) -> Any:
  def one(x):
    if _tree.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating):
      return x.astype(dtype) if x.dtype != dtype else x
    return x

  return jax.tree.map(one, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
  """A mixed-precision policy: the dtypes of parameters, compute and outputs.

  Build one from a name or a string with :meth:`from_string` (or
  :func:`get_policy`):

  * Keras' names: ``'float32'``, ``'float16'``, ``'bfloat16'``,
    ``'float64'``, ``'mixed_float16'`` and ``'mixed_bfloat16'`` (float32
    parameters and outputs, half-precision compute);
  * jmp-style ``'params=float32,compute=float16,output=float32'``, with the
    short keys ``p``/``c``/``o`` and dtype names ``f16``, ``bf16``, ``f32``,
    ``full``, and ``half`` (:func:`default_half_dtype` of the backend);
    missing keys are float32; a single dtype (``'bf16'``) sets all three.

  The casts touch only floating array leaves of any pytree: integers,
  booleans, complex numbers, ``None`` and non-array leaves pass unchanged.

  Attributes:
    param_dtype: the dtype parameters are stored in.
    compute_dtype: the dtype the forward and backward passes run in.
    output_dtype: the dtype of the model's outputs.

  Example:
    >>> import jax.numpy as jnp, optax_lossscale as ols
    >>> policy = ols.Policy.from_string("p=f32,c=f16,o=f32")
    >>> policy == ols.Policy.from_string("mixed_float16")
    True
    >>> tree = {"w": jnp.ones(2), "step": jnp.array(3)}
    >>> {k: v.dtype.name for k, v in policy.cast_to_compute(tree).items()}
    {'step': 'int32', 'w': 'float16'}
  """

  param_dtype: Any = jnp.float32
  compute_dtype: Any = jnp.float32
  output_dtype: Any = jnp.float32

  def __post_init__(self):
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
      dtype = _dtypes.float_dtype(
        field,
        getattr(self, field),
        allowed=_POLICY_DTYPES,
        float8_hint="float8 is for matmul inputs only, with a scale per tensor; use "
        "autocast(f, compute_dtype=jnp.bfloat16, matmul='float8').",
      )
      object.__setattr__(self, field, dtype)

  @classmethod
  def from_string(cls, text: str, *, backend: str | None = None) -> Policy:
    """Parses a Keras name or a jmp-style string (see the class docstring).

    Raises:
      ValueError: an unknown name, key or dtype, a repeated key or an empty
        part; the message names the part.
    """
    if not isinstance(text, str) or not text.strip():
      raise ValueError(f"A policy string must be a non-empty string, got {text!r}.")
    name = text.strip().lower()
    if name in _KERAS_NAMES:
      return cls(*(_dtypes.NAMES[d] for d in _KERAS_NAMES[name]))
    if "=" not in name and "," not in name:
      dtype = _dtype(name, text.strip(), backend)
      return cls(dtype, dtype, dtype)
    dtypes: dict[str, jnp.dtype] = {}
    for part in text.split(","):
      if not part.strip():
        raise ValueError(f"Empty part in policy string {text!r}.")
      key, sep, value = part.partition("=")
      if not sep:
        raise ValueError(
          f"Policy part {part.strip()!r} is not key=dtype (keys: "
          "params/p, compute/c, output/o)."
        )
      field = _KEYS.get(key.strip().lower())
      if field is None:
        raise ValueError(
          f"Unknown key {key.strip()!r} in policy part {part.strip()!r}; "
          "known: params/p, compute/c, output/o."
        )
      if field in dtypes:
        raise ValueError(f"Policy part {part.strip()!r} repeats {field}.")
      dtypes[field] = _dtype(value, part.strip(), backend, field)
    return cls(**dtypes)

  @property
  def variable_dtype(self) -> jnp.dtype:
    """Keras' name for :attr:`param_dtype`."""
    return self.param_dtype

  @property
  def name(self) -> str:
    """The jmp-style string of this policy."""
    return (
      f"params={self.param_dtype.name},compute={self.compute_dtype.name},"
      f"output={self.output_dtype.name}"
    )

  def cast_to_compute(self, tree: Any) -> Any:
    """Floating array leaves of ``tree`` cast to :attr:`compute_dtype`."""
    return _cast(tree, self.compute_dtype)

  def cast_to_param(self, tree: Any) -> Any:
    """Floating array leaves of ``tree`` cast to :attr:`param_dtype`."""
    return _cast(tree, self.param_dtype)

  def cast_to_output(self, tree: Any) -> Any:
    """Floating array leaves of ``tree`` cast to :attr:`output_dtype`."""
    return _cast(tree, self.output_dtype)

  def with_output_dtype(self, dtype: Any) -> Policy:
    """The same policy with another output dtype."""
    return dataclasses.replace(self, output_dtype=dtype)


def get_policy(policy: Policy | str, *, backend: str | None = None) -> Policy:
  """``policy`` itself, or :meth:`Policy.from_string` of it."""
  if isinstance(policy, Policy):
    return policy
  return Policy.from_string(policy, backend=backend)
