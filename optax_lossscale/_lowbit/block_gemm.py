"""The GEMM of two block-quantised operands: emulated, or a native kernel.

:func:`gemm` multiplies two :class:`~optax_lossscale.BlockQuantized`
operands of three axes, batched along the first and contracted along their
blocked axes; the result is ``(B, a's free axis, b's free axis)`` in
float32.

Emulated, on every backend: each operand's elements times its block scales,
exact in bfloat16 (:func:`~optax_lossscale._lowbit.block_scaled.scaled_elements`),
multiplied with float32 accumulation. NVFP4's scales per tensor multiply
the result, as a native kernel's epilogue does. bfloat16 operands hold half
the bytes of float32 ones and run on bfloat16 units (BENCHMARKS.md).

Native: :func:`jax.nn.scaled_matmul` (cuDNN's block-scaled GEMM on
Blackwell GPUs, compute capability 10 and above) on the elements and block
scales laid out ``(B, rows, K)``. ``native=None`` uses it for a GEMM's
shapes only once a probe of those shapes, run when they are first traced,
gives the emulation's numbers within the order of float32 sums; otherwise
(another backend, an error, other numbers) the emulation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_lossscale._lowbit import block_scaled as _block_scaled
from optax_lossscale._lowbit.block_scaled import BlockQuantized

__all__ = ["gemm", "native_backend"]

_F32 = jnp.dtype(jnp.float32)


def native_backend() -> bool:
  """Whether the default backend has a native block-scaled GEMM: a CUDA GPU
  of compute capability 10 or above, with :func:`jax.nn.scaled_matmul`."""
  if not hasattr(jax.nn, "scaled_matmul"):
    return False
  device = jax.devices()[0]
  try:
    capability = float(getattr(device, "compute_capability", "nan"))
  except (TypeError, ValueError):
    return False
  return device.platform == "gpu" and capability >= 10.0


def _native_matmul(lhs, rhs, lhs_scales, rhs_scales):
  return jax.nn.scaled_matmul(
    lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=_F32
  )


def _rows(q: BlockQuantized) -> tuple[jax.Array, jax.Array]:
  """``q``'s elements ``(B, rows, K)`` (``K`` padded to whole blocks) and
  block scales ``(B, rows, K / block)``, as :func:`jax.nn.scaled_matmul`
  takes them; a tile's scale repeated for each of its rows."""
  free = 3 - q.axis
  e, s = q.elements, q.scales
  if q.tile_axis is not None:
    s = jnp.repeat(s, _block_scaled.FORMATS[q.fmt].block, axis=free)
    e = lax.slice_in_dim(e, 0, q.shape[free], axis=free)
    s = lax.slice_in_dim(s, 0, q.shape[free], axis=free)
  if q.axis == 1:
    e, s = jnp.swapaxes(e, 1, 2), jnp.swapaxes(s, 1, 2)
  return e, s


def _emulated(qa: BlockQuantized, qb: BlockQuantized) -> jax.Array:
  va, vb = (_block_scaled.scaled_elements(q, jnp.bfloat16) for q in (qa, qb))
  dims = (((qa.axis,), (qb.axis,)), ((0,), (0,)))
  return lax.dot_general(va, vb, dims, preferred_element_type=_F32)


def _native(qa: BlockQuantized, qb: BlockQuantized) -> jax.Array:
  (ea, sa), (eb, sb) = _rows(qa), _rows(qb)
  return _native_matmul(ea, eb, sa, sb)


def _layout(q: BlockQuantized) -> tuple:
  return (q.axis, q.tile_axis, q.shape)


#: (fmt, layouts, backend) -> None (native agrees) or why not; failures that
#: may pass (an exception: out of memory, a transfer guard) are not kept.
_VERDICTS: dict[tuple, str | None] = {}


def _spread(shape: tuple, salt: int) -> jax.Array:
  """float32 numbers of both signs, magnitudes from ``2**-8`` to ``2**9``,
  each a hash of its index and ``salt``: integer arithmetic, where the
  random number generator's rounds were most of the probe's compile time."""

  def mix(h):  # MurmurHash3's finaliser
    h = (h ^ (h >> 16)) * np.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)

  size = math.prod(shape)
  h1 = mix(lax.iota(jnp.uint32, size) + np.uint32(salt * 0x9E3779B9 % 2**32))
  h2 = mix(h1 ^ np.uint32(0x9E3779B9))
  exponent = h2 % np.uint32(17) + np.uint32(127 - 8)
  bits = (h2 & np.uint32(1 << 31)) | (exponent << 23) | (h1 >> 9)
  return lax.bitcast_convert_type(bits, _F32).reshape(shape)


def _probe(fmt: str, a: tuple, b: tuple, backend: str) -> str | None:
  """``None`` if the native GEMM gives the emulation's numbers on operands of
  these layouts, else why not: block scales from 2**-8 to 2**8 times apart
  and an all-zero block; then the same with a NaN, which must make the same
  entries NaN. One jitted computation on the device, compiled afresh (the
  kernel is whatever ``_native_matmul`` is now)."""
  key = (fmt, a, b, backend)
  if key in _VERDICTS:
    return _VERDICTS[key]
  block = _block_scaled.FORMATS[fmt].block

  def operand(salt, layout, nan):
    axis, tile_axis, shape = layout
    x = _spread(shape, salt)
    # a block (or a tile) of zeros, unless it would be the whole operand
    zero = np.zeros(shape, bool)
    at = [0, slice(None), slice(None)]
    at[axis], free = slice(0, block), 3 - axis
    at[free] = slice(0, block) if tile_axis is not None else slice(-1, None)
    zero[tuple(at)] = True
    if not zero.all():
      x = jnp.where(zero, 0.0, x)
    if nan:
      x = x.at[0, -1, -1].set(jnp.nan)
    return _block_scaled.block_quantize(x, fmt, axis, tile_axis=tile_axis)

  def agrees(nan):
    qa, qb = operand(1, a, nan), operand(2, b, nan)
    absolute = [jnp.abs(_block_scaled.scaled_elements(q, _F32)) for q in (qa, qb)]
    dims = (((qa.axis,), (qb.axis,)), ((0,), (0,)))
    bound = lax.dot_general(
      *absolute, dims, precision=lax.Precision.HIGHEST, preferred_element_type=_F32
    )
    got, want = _native(qa, qb), _emulated(qa, qb)
    close = jnp.abs(got - want) <= 2 * a[2][a[0]] * 2.0**-24 * bound
    return jnp.all(jnp.where(jnp.isnan(want), jnp.isnan(got), close))

  try:
    # Both checks in one program, compiled ahead of time whatever trace the
    # caller is in (evaluated op by op, they compiled hundreds).
    both = jax.jit(lambda: agrees(False) & agrees(True))
    ok = bool(both.lower().compile()())
  except Exception as e:  # noqa: BLE001 (a kernel that will not compile)
    return f"the native GEMM failed: {type(e).__name__}: {e}"
  why = None if ok else "the native GEMM's numbers differ from the emulation's"
  _VERDICTS[key] = why
  return why


def gemm(qa: BlockQuantized, qb: BlockQuantized, native: bool | None) -> jax.Array:
  """The float32 product of two quantised operands (see the module).

  Args:
    qa, qb: operands of three axes, quantised along the axis they contract
      (1 or 2); axis 0 is the batch.
    native: ``None``: the native GEMM where :func:`native_backend` and the
      probe agree, else the emulation; ``False``: the emulation; ``True``:
      the native GEMM, or a ValueError where there is none or its numbers
      differ. An empty product is emulated (it is zeros either way).
  """
  use = False
  if (native is None or native) and qa.elements.size and qb.elements.size:
    why = "this backend has none (a Blackwell GPU has one)"
    if native_backend():
      why = _probe(qa.fmt, _layout(qa), _layout(qb), jax.default_backend())
    if native and why is not None:
      raise ValueError(f"native=True: no native {qa.fmt} GEMM to use: {why}.")
    use = why is None
  y = _native(qa, qb) if use else _emulated(qa, qb)
  if qa.global_scale is not None:  # one at a time: their product may not be normal
    y = y * qa.global_scale * qb.global_scale
  return y
