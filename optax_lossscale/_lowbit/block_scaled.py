"""Block-scaled quantisation: MXFP8 and NVFP4 elements with a scale per block.

:func:`block_quantize` splits an axis into blocks and stores each block as
low-precision elements times one scale:

* ``"mxfp8"``: blocks of 32, ``float8_e4m3fn`` elements (largest 448), a
  power-of-two scale stored as ``float8_e8m0fnu``, ``2**ceil(log2(amax /
  448))`` (rounded up, so no element overflows, as the MXFP8 training
  recipe does; ``rule="ocp"``: OCP MX v1.0's ``2**(floor(log2 amax) -
  8)``, elements saturated to ±448; an all-zero block takes the smallest
  scale, 2**-127), elements rounded to nearest, ties to even;
* ``"nvfp4"``: blocks of 16, ``float4_e2m1fn`` elements (largest 6), a
  ``float8_e4m3fn`` scale per block, ``e4m3(amax_block / 6 / g)``, and a
  float32 scale per tensor ``g = max(amax / (448 * 6), 2**-117)`` (the
  floor keeps every product of scales a normal float32); elements
  ``x / (block scale * g)``, in that order (``rule="transformer_engine"``:
  TransformerEngine's order, ``x * (1 / (s * (1 / S)))`` with ``S = 2688 /
  amax``, which can round otherwise), clipped to ±6 and rounded to nearest
  (ties to even) or stochastically with a key; optionally 16 x 16 tiles
  over two axes (a weight quantised so, and its transpose, are the same
  numbers).

An axis whose length is not a multiple of the block is zero-padded. A block
holding NaN or an infinity dequantises to NaN (with NVFP4 the whole tensor,
through its scale per tensor), so a loss scale sees it; an MXFP8 entry
above 248 * 2**120 (about 3.30e38) rounds up to 2**128 and dequantises to
infinity. Every step is elementwise float32 arithmetic on exact powers of two
or a rounding conversion, the same on every backend, except for float32
subnormal inputs (below 2**-126), which a backend that flushes them (XLA's
CPU backend does) reads as zeros.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_lossscale._base import rounding as _rounding
from optax_lossscale._base import tree as _tree
from optax_lossscale._lowbit import exact as _exact
from optax_lossscale._lowbit import layout as _layout

__all__ = ["FORMATS", "RULES", "BlockQuantized", "block_quantize", "round_e2m1"]

_F32 = jnp.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Format:
  block: int
  element: str  # the jnp dtype's name
  largest: float  # the element dtype's largest value
  scale: str


FORMATS = {
  "mxfp8": _Format(32, "float8_e4m3fn", 448.0, "float8_e8m0fnu"),
  "nvfp4": _Format(16, "float4_e2m1fn", 6.0, "float8_e4m3fn"),
}


def format_spec(fmt: Any) -> _Format:
  if not isinstance(fmt, str) or fmt not in FORMATS:
    raise ValueError(f"`fmt` must be 'mxfp8' or 'nvfp4', got {fmt!r}.")
  spec = FORMATS[fmt]
  missing = [d for d in (spec.element, spec.scale) if not hasattr(jnp, d)]
  if missing:
    raise ValueError(
      f"{fmt} needs the dtypes {', '.join(missing)}, which this JAX "
      f"({jax.__version__}) lacks: upgrade JAX."
    )
  return spec


def _pow2(e: jax.Array) -> jax.Array:
  """``2.0**e`` in float32 for integer ``e`` in [-126, 127], from its bits."""
  return lax.bitcast_convert_type(((e + 127) << 23).astype(jnp.int32), _F32)


def _ldexp(x: jax.Array, e: jax.Array) -> jax.Array:
  """``x * 2**e`` for ``e`` in [-127, 127], through two normal factors (a
  float32 subnormal factor could be flushed to zero by the backend)."""
  half = e // 2
  return x * _pow2(half) * _pow2(e - half)


def _axis(name: str, value: Any, ndim: int) -> int:
  """``value`` as a non-negative axis of ``ndim`` axes, or a ValueError."""
  if (
    isinstance(value, bool)
    or not isinstance(value, (int, np.integer))
    or not -ndim <= value < ndim
  ):
    raise ValueError(f"`{name}` {value!r} is out of range for an array of {ndim} axes.")
  return int(value) % ndim


def round_e2m1(v: jax.Array, key: jax.Array | None = None) -> jax.Array:
  """float32 ``v`` (``|v| <= 6``) rounded to ``float4_e2m1fn``'s values.

  To nearest, ties to even (the dtype's own conversion), or, given a
  ``key``, up with probability ``(|v| - lo) / (hi - lo)`` between the two
  neighbours ``lo <= |v| < hi``: unbiased. The random numbers are those of
  the stochastic rounding of parameters (one Threefry hash per element,
  ``_rounding.uniform``), computed where they are used.
  """
  if key is None:
    return v.astype(jnp.float4_e2m1fn)
  mag = jnp.abs(v)
  # the grid's spacing: 0.5 below 2, 1 below 4, 2 up to 6
  step = jnp.where(mag < 2.0, 0.5, jnp.where(mag < 4.0, 1.0, 2.0)).astype(_F32)
  lo = jnp.floor(mag / step) * step
  up = _rounding.uniform(key, v.shape) < (mag - lo) / step
  return (jnp.sign(v) * jnp.where(up, lo + step, lo)).astype(jnp.float4_e2m1fn)


@dataclasses.dataclass(frozen=True)
class BlockQuantized:
  """What :func:`block_quantize` returns; :meth:`dequantize` gives the values.

  Attributes:
    elements: the low-precision elements, ``x``'s shape with ``axis``
      zero-padded to whole blocks (and ``tile_axis`` with tiles).
    scales: one per block: ``x``'s shape with ``axis`` (and ``tile_axis``)
      divided into blocks (``float8_e8m0fnu`` for MXFP8, ``float8_e4m3fn``
      for NVFP4).
    global_scale: NVFP4's float32 scale per tensor (``None`` for MXFP8).
    fmt: ``"mxfp8"`` or ``"nvfp4"``.
    axis: the blocked axis (non-negative).
    tile_axis: the tiles' other axis, or ``None``.
    shape: the shape of the quantised array.
  """

  elements: jax.Array
  scales: jax.Array
  global_scale: jax.Array | None
  fmt: str
  axis: int
  tile_axis: int | None
  shape: tuple

  def dequantize(self) -> jax.Array:
    """The float32 values the matmul uses, in ``shape``: elements times their
    block's scale (times the global scale), NaN for a block that held NaN
    or an infinity."""
    v = scaled_elements(self, _F32)
    return v if self.global_scale is None else v * self.global_scale


jax.tree_util.register_dataclass(
  BlockQuantized,
  data_fields=["elements", "scales", "global_scale"],
  meta_fields=["fmt", "axis", "tile_axis", "shape"],
)


def scaled_elements(q: BlockQuantized, dtype: Any) -> jax.Array:
  """``q``'s elements times their block scales, without NVFP4's scale per
  tensor, in ``q.shape`` and ``dtype``.

  Exact in bfloat16 as in float32 down to 2**-126 (below it float32 is
  subnormal too, and flushed by XLA's CPU backend): an element has at most
  4 significant bits (MXFP8's) or 2 (NVFP4's) and its scale 1 or 4, so a
  product has at most 6 of bfloat16's 8. Products of two such values are
  exact in float32, so GEMMs of them accumulating in float32 differ only in
  the order of their sums.
  """
  block = FORMATS[q.fmt].block
  e = _exact.widen(q.elements, _F32)
  if q.tile_axis is None:
    e = _layout.blocks(e, q.axis, block)
    s = jnp.moveaxis(q.scales, q.axis, -1)[..., None]
  else:
    e = _layout.tiles(e, q.axis, q.tile_axis, block)
    s = jnp.moveaxis(q.scales, (q.tile_axis, q.axis), (-1, -2))[..., None, None]
  if q.fmt == "mxfp8":
    bits = lax.bitcast_convert_type(s, jnp.uint8).astype(jnp.int32)
    v = jnp.where(bits == 0xFF, jnp.nan, _ldexp(e, bits - 127))
  else:
    v = e * _exact.widen(s, _F32)
  v = v.astype(dtype)
  if q.tile_axis is None:
    return _layout.unblocks(v, q.axis, q.shape[q.axis])
  return _layout.untiles(v, q.axis, q.tile_axis, q.shape)


def _mx_exponent(amax: jax.Array) -> jax.Array:
  """``ceil(log2(amax / 448))`` exactly, in [-127, 127]; -127 for a zero.

  With ``amax = m * 2**k`` (``m`` in [0.5, 1)): ``448 * 2**(k - 9)`` is
  ``0.875 * 2**k``, enough unless ``m > 0.875``.
  """
  m, k = jnp.frexp(amax)
  e = k - 9 + (m > 0.875).astype(k.dtype)
  return jnp.where(amax > 0, jnp.clip(e, -127, 127), -127).astype(jnp.int32)


def _ocp_exponent(amax: jax.Array) -> jax.Array:
  """OCP MX v1.0's ``floor(log2(amax)) - 8`` (8: e4m3's largest exponent),
  in [-127, 127]; -127 for a zero. With ``amax = m * 2**k`` (``m`` in
  [0.5, 1)), ``floor(log2(amax))`` is ``k - 1``."""
  _, k = jnp.frexp(amax)
  e = k - 9
  return jnp.where(amax > 0, jnp.clip(e, -127, 127), -127).astype(jnp.int32)


#: The scale rules of :func:`block_quantize`, per format; the first is the default.
RULES = {
  "mxfp8": ("round_up", "ocp"),
  "nvfp4": ("divide", "transformer_engine"),
}

_F32_MAX = np.float32(np.finfo(np.float32).max)


def block_quantize(
  x: jax.Array,
  fmt: str,
  axis: int = -1,
  *,
  tile_axis: int | None = None,
  key: jax.Array | None = None,
  rule: str | None = None,
) -> BlockQuantized:
  """``x`` as MXFP8 or NVFP4 blocks along ``axis``.

  Args:
    x: a floating array (computed in float32).
    fmt: ``"mxfp8"`` (blocks of 32, ``float8_e4m3fn`` elements, a power-of-
      two ``float8_e8m0fnu`` scale per block) or ``"nvfp4"`` (blocks of 16,
      ``float4_e2m1fn`` elements, a ``float8_e4m3fn`` scale per block and a
      float32 one per tensor).
    axis: the axis split into blocks (a matmul's contracting axis).
    tile_axis: NVFP4 only: a second axis, for 16 x 16 tiles over ``axis``
      and it (a weight's two axes: its transpose quantises to the same
      numbers).
    key: NVFP4 only: round the elements stochastically with this key
      (unbiased); ``None``: to nearest, ties to even.
    rule: how the scales are computed, for exchanging data with other
      implementations (``None``: the format's default, the first below).
      MXFP8: ``"round_up"``, the MXFP8 training recipe's
      ``2**ceil(log2(amax / 448))`` (no element overflows), or ``"ocp"``,
      OCP MX v1.0's ``2**(floor(log2(amax)) - 8)`` (8 is e4m3's largest
      exponent), whose scaled elements above 448 saturate to ±448. NVFP4:
      ``"divide"``, ``g = max(amax / 2688, 2**-117)``, block scale
      ``s = e4m3(amax_block / 6 / g)``, elements ``x / (s * g)``; or
      ``"transformer_engine"``, TransformerEngine's order:
      ``S = min(2688 / amax, float32 max)`` (1 for a zero tensor),
      ``s = e4m3(amax_block * (S * float32(1/6)))``, elements
      ``x * min(1 / (s * (1 / S)), float32 max)``, scale per tensor
      ``1 / S``: below an amax of ``2688 * 2**-126`` (3.2e-35) ``1 / S``
      is a float32 subnormal, which a backend that flushes them makes
      zero. Each clipped to ±6 and rounded as above.

  Returns:
    A :class:`BlockQuantized`; ``.dequantize()`` is the float32 array the
    matmul multiplies.

  Raises:
    ValueError: another ``fmt``; ``tile_axis`` or ``key`` with MXFP8; a
      ``rule`` the format does not have;
      an axis out of range or ``tile_axis == axis``; ``x`` not floating; a
      JAX without the formats' dtypes.

  Example:
    >>> import jax.numpy as jnp, optax_lossscale as ols
    >>> q = ols.block_quantize(jnp.array([1.0, 3.0, 500.0, 0.1]), "mxfp8")
    >>> q.scales.astype(jnp.float32)  # 2**ceil(log2(500 / 448))
    Array([2.], dtype=float32)
    >>> q.dequantize().tolist()  # 0.1 / 2 is 0.05, in e4m3 0.05078125
    [1.0, 3.0, 512.0, 0.1015625]
  """
  spec = format_spec(fmt)
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"block_quantize: `x` must be floating, got {x.dtype}.")
  ndim = x.ndim
  if ndim == 0:
    raise ValueError("block_quantize: `x` must have at least one axis, got a scalar.")
  axis = _axis("axis", axis, ndim)
  if fmt == "mxfp8" and (tile_axis is not None or key is not None):
    raise ValueError("MXFP8 has no tiles and no stochastic rounding: pass neither.")
  if tile_axis is not None:
    tile_axis = _axis("tile_axis", tile_axis, ndim)
    if tile_axis == axis:
      raise ValueError("`tile_axis` must differ from `axis`.")
  if key is not None and not (
    isinstance(key, jax.Array)
    and (
      (jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ())
      or (key.dtype == jnp.uint32 and key.shape == (2,))
    )
  ):
    raise ValueError(
      "`key` must be one PRNG key (jax.random.key(...) or a raw "
      f"jax.random.PRNGKey(...)), got {key!r}."
    )
  if rule is None:
    rule = RULES[fmt][0]
  if not isinstance(rule, str) or rule not in RULES[fmt]:
    raise ValueError(
      f"`rule` for {fmt} must be one of {', '.join(map(repr, RULES[fmt]))}, "
      f"got {rule!r}."
    )
  x32 = _tree.widen(x).astype(_F32)  # at x's precision, whatever XLA fused
  if tile_axis is None:
    b = _layout.blocks(x32, axis, spec.block)
    amax = jnp.max(jnp.abs(b), axis=-1, keepdims=True)
  else:
    b = _layout.tiles(x32, axis, tile_axis, spec.block)
    amax = jnp.max(jnp.abs(b), axis=(-2, -1), keepdims=True)
  bad = ~jnp.isfinite(amax)  # NaN or inf in the block
  elem_dtype, scale_dtype = jnp.dtype(spec.element), jnp.dtype(spec.scale)
  if fmt == "mxfp8":
    finite_amax = jnp.where(bad, 0.0, amax)
    if rule == "round_up":
      e = _mx_exponent(finite_amax)
      q = _ldexp(b, -e).astype(elem_dtype)
    else:  # OCP: amax / 2**e is in [256, 512), saturated to 448
      e = _ocp_exponent(finite_amax)
      q = jnp.clip(_ldexp(b, -e), -spec.largest, spec.largest).astype(elem_dtype)
    scale_bits = jnp.where(bad, 0xFF, e + 127).astype(jnp.uint8)
    scales = lax.bitcast_convert_type(scale_bits, scale_dtype)
    global_scale = None
  elif rule == "transformer_engine":
    tensor_amax = jnp.max(jnp.abs(x32), initial=0.0)
    encode = jnp.minimum(jnp.float32(2688.0) / tensor_amax, _F32_MAX)
    encode = jnp.where((tensor_amax == 0) | (encode == 0), jnp.float32(1.0), encode)
    decode = jnp.float32(1.0) / encode
    global_scale = jnp.where(jnp.isfinite(tensor_amax), decode, jnp.nan).astype(_F32)
    s = jnp.minimum(amax * (encode * jnp.float32(1.0 / 6.0)), jnp.float32(448.0))
    s32 = jnp.where(bad, jnp.nan, _exact.widen(s.astype(scale_dtype), _F32))
    s = s32.astype(scale_dtype)  # exact: s32 holds a float8 value or NaN
    multiplier = jnp.minimum(jnp.float32(1.0) / (s32 * decode), _F32_MAX)
    v = jnp.where(bad, 0.0, jnp.clip(b * multiplier, -6.0, 6.0))
    q = round_e2m1(v, key)
    scales = s
  else:
    tensor_amax = jnp.max(jnp.abs(x32), initial=0.0)
    # At least 2**-117, so that a block scale (>= 2**-9) times it is a
    # normal float32, which no backend flushes to zero.
    global_scale = jnp.where(
      jnp.isfinite(tensor_amax),
      jnp.maximum(tensor_amax / jnp.float32(448.0 * 6.0), jnp.float32(2.0**-117)),
      jnp.nan,
    ).astype(_F32)
    s = (amax / jnp.float32(6.0) / global_scale).astype(scale_dtype)
    s32 = jnp.where(bad, jnp.nan, _exact.widen(s, _F32))
    s = s32.astype(scale_dtype)  # exact: s32 holds a float8 value or NaN
    v = jnp.clip(b / jnp.where(s32 > 0, s32 * global_scale, 1.0), -6.0, 6.0)
    v = jnp.where(s32 > 0, v, 0.0)
    q = round_e2m1(v, key)
    scales = s
  # back to x's layout
  if tile_axis is None:
    elements = _layout.unblocks(q, axis)
    scales = jnp.moveaxis(scales[..., 0], -1, axis)
  else:
    elements = _layout.untiles(q, axis, tile_axis)
    scales = jnp.moveaxis(scales[..., 0, 0], (-2, -1), (axis, tile_axis))
  return BlockQuantized(
    elements, scales, global_scale, fmt, axis, tile_axis, tuple(x.shape)
  )
