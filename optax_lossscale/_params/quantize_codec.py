"""The 8-bit code of quantised optimizer state: dynamic maps, blocks, nearest codes.

bitsandbytes' dynamic quantisation map (Dettmers et al. 2022, "8-bit
Optimizers via Block-wise Quantization"), signed and unsigned, and one
leaf's codec: blocks of consecutive elements with one float32 scale (their
largest magnitude), each element rounded to the nearest value of its
block's map (the unsigned one for a block that is all ``>= 0``, which holds
its values' square roots when asked), and back. :mod:`.quantize_state`
builds the optax transformation on it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._base import tree as _tree
from optax_lossscale._params import rounding as _rounding

__all__ = ["QuantizedLeaf", "dynamic_map", "thresholds"]

_F32 = jnp.dtype(jnp.float32)


def dynamic_map(signed: bool, bits: int = 8) -> np.ndarray:
  """The ``2**bits`` values of the dynamic quantisation map, sorted, float32.

  bitsandbytes' ``create_dynamic_map(signed, bits - 1, bits)`` (``bits - 1``
  exponent bits): for each decade ``10**(i - bits + 2)``, ``i = 0..bits -
  2``, the midpoints of ``2**i`` (signed; ``2**(i + 1)`` unsigned) equal
  steps of ``[0.1, 1]``, times the decade, with both signs if ``signed``;
  and 0 and 1. Computed in float64 and rounded to float32 once
  (bitsandbytes computes the steps in float32 with torch's ``linspace``,
  whose values depend on the CPU's vector width: its 8-bit maps differ from
  these in some entries by one or two units in the last place).

  Args:
    signed: the signed map (-0.993 to 1 in 8 bits) or the unsigned one (0
      to 1).
    bits: the code's width: 8 (seven decades, what ``quantize_state``
      stores) or less (``benchmarks/quantize_4bit.py`` simulates 4).

  Returns:
    A float32 NumPy array of ``2**bits`` increasing values.
  """
  values = [0.0, 1.0]
  for i in range(bits - 1):
    n = 2 ** (i if signed else i + 1)
    edges = np.linspace(0.1, 1.0, n + 1)
    means = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - bits + 2)
    values += list(means) + (list(-means) if signed else [])
  return np.sort(np.array(values)).astype(np.float32)


def thresholds(code: np.ndarray) -> np.ndarray:
  """For each pair of neighbours of ``code``, the smallest float32 above
  their exact midpoint (a value rounds up iff it is at least this), and
  ``inf`` last: 256 float32."""
  mid = (code[:-1].astype(np.float64) + code[1:].astype(np.float64)) / 2
  t = mid.astype(np.float32)
  t = np.where(t.astype(np.float64) > mid, t, np.nextafter(t, np.float32(np.inf)))
  return np.append(t, np.float32(np.inf)).astype(np.float32)


@functools.cache
def tables() -> tuple[np.ndarray, np.ndarray]:
  """The two maps, signed then unsigned (512 values), and their thresholds."""
  codes = [dynamic_map(True), dynamic_map(False)]
  return np.concatenate(codes), np.concatenate([thresholds(c) for c in codes])


# --------------------------------------------------------------------------
# One leaf: blocks, codes, scales.
# --------------------------------------------------------------------------


def _block_axis(shape: tuple, block_size: int) -> int:
  """The first axis of the blocks: the last ``k`` with ``prod(shape[k:])`` a
  multiple of ``block_size`` (the blocks then are ``block_size``
  consecutive elements of the flattened array, and the axes before ``k``
  stay whole: a shard along them holds whole blocks when its size is a
  multiple of ``block_size``); 0 when there is none (the flattened array,
  its last block zero-padded)."""
  for k in range(len(shape) - 1, -1, -1):
    if math.prod(shape[k:]) % block_size == 0:
      return k
  return 0


def _blocked(x: jax.Array, block_size: int) -> tuple[jax.Array, int]:
  """``x`` as ``(*x.shape[:k], blocks, block_size)``, zero-padded, and ``k``."""
  k = _block_axis(x.shape, block_size)
  lead = x.shape[:k]
  x = x.reshape(*lead, -1)
  pad = -x.shape[-1] % block_size
  if pad:
    x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad)])
  return x.reshape(*lead, -1, block_size), k


@dataclasses.dataclass(frozen=True)
class QuantizedLeaf:
  """One block-quantised leaf of a :func:`quantize_state` state.

  Attributes:
    codes: uint8, the leaf's shape: each element's index in its block's map.
    scales: float32, one per block (shape: the leaf's leading axes that the
      blocks do not span, then the number of blocks): the block's largest
      magnitude, negated for a block that uses the signed map; infinite
      where the block held NaN or an infinity (its values then dequantise
      to infinities and NaN).
    dtype: the dtype the inner transformation made the leaf in.
    block_size: elements per block.
    sqrt: whether a block of the unsigned map holds its values' square
      roots (its scale then is their largest).
  """

  codes: jax.Array
  scales: jax.Array
  dtype: Any
  block_size: int
  sqrt: bool

  def dequantize(self) -> jax.Array:
    """The leaf in float32: each code's map value times its block's absmax."""
    return _decode(self)


jax.tree_util.register_dataclass(
  QuantizedLeaf,
  data_fields=["codes", "scales"],
  meta_fields=["dtype", "block_size", "sqrt"],
)


_DECADES = np.float32(10.0) ** np.arange(-7, 0, dtype=np.float32)  # 1e-7 ... 0.1
_TO_UNIT = np.array([10.0 ** (6 - i) for i in range(7)], np.float32)


def _lookup(table: np.ndarray, idx: jax.Array) -> jax.Array:
  """``table[idx]`` for a small constant table, in ``idx``'s sharding (under
  explicit sharding a gather must be told where its result lies)."""
  table = jnp.asarray(table)
  if _tree.explicit_spec(idx) is None:
    return table[idx]
  return table.at[idx].get(out_sharding=jax.typeof(idx).sharding)


def nearest_code(s: jax.Array, signed: jax.Array, thresholds: np.ndarray) -> jax.Array:
  """The index of the nearest value of the map (signed or not) to ``s`` in
  [-1, 1], from the map's structure and two of its thresholds.

  A magnitude ``a`` in decade ``i`` (``[1e-7, 1e-6) * 10**i``) lies in one
  of the decade's ``n`` equal cells of ``[0.1, 1] * 10**(i - 6)``, whose
  midpoint is a code; a cell's edges are its codes' midpoints, so the
  nearest code is the cell's, or (at a decade's edge, or where float32
  puts ``a`` in the neighbouring cell) the next one either way: comparing
  ``s`` with the thresholds on both sides of the candidate settles it.
  """
  u = jnp.where(signed, 0, 1).astype(jnp.int32)  # 2**(i + u) codes in decade i
  a = jnp.abs(s)
  decade = sum((a >= t).astype(jnp.int32) for t in _DECADES)  # 0: below 1e-7
  i = jnp.maximum(decade - 1, 0)
  n = jnp.left_shift(1, i + u)
  cell = jnp.floor((a * _lookup(_TO_UNIT, i) - 0.1) * n.astype(_F32) / 0.9)
  cell = jnp.clip(cell.astype(jnp.int32), 0, n - 1)
  rank = jnp.where(decade > 0, 1 + (jnp.left_shift(1, i + u) - (1 << u)) + cell, 0)
  zero = jnp.where(signed, 127, 0)
  c = jnp.where(s < 0, zero - rank, zero + rank)
  base = jnp.where(signed, 0, 256)
  up = _lookup(thresholds, base + c) <= s
  down = (c > 0) & (_lookup(thresholds, base + jnp.maximum(c - 1, 0)) > s)
  return c + up.astype(jnp.int32) - down.astype(jnp.int32)


def _stochastic(s: jax.Array, signed: jax.Array, nearest: jax.Array) -> jax.Array:
  """The code of each ``s`` rounded at random between the two map values
  around it, up with probability its distance from the lower one over
  their gap (so the code's value is ``s`` on average); ``nearest`` is its
  nearest code. The random numbers are :func:`rounding.uniform_of` of
  ``s``."""
  code = tables()[0]
  base = jnp.where(signed, 0, 256)
  v = _lookup(code, base + nearest)
  lo = jnp.where(v <= s, nearest, jnp.maximum(nearest - 1, 0))
  hi = jnp.minimum(lo + 1, 255)
  v_lo, v_hi = _lookup(code, base + lo), _lookup(code, base + hi)
  gap = v_hi - v_lo
  p = jnp.where(gap > 0, (s - v_lo) / jnp.where(gap > 0, gap, 1.0), 0.0)
  return lo + (_rounding.uniform_of(s) < p).astype(jnp.int32)


def encode(
  x: jax.Array, block_size: int, sqrt: bool = True, stochastic: bool = False
) -> QuantizedLeaf:
  """``x`` as codes and scales, each element to the nearest value of its
  block's map (a value exactly halfway between two rounds down), or with
  ``stochastic`` to one of the two around it at random (:func:`_stochastic`);
  with ``sqrt``, a block that is all ``>= 0`` as its square roots."""
  thresholds = tables()[1]
  b, k = _blocked(x.astype(_F32), block_size)
  # One pass over each block finds both its least value (a block with one
  # below 0 uses the signed map) and its largest (NaN counted as an
  # infinity: XLA's max reductions may drop a NaN); the largest magnitude
  # follows from the two, and for a block stored as square roots it is
  # the root of the largest value.
  lo, hi = jax.lax.reduce(
    (b, jnp.where(jnp.isnan(b), jnp.inf, b)),
    (np.float32(np.inf), np.float32(-np.inf)),
    lambda x, y: (jnp.minimum(x[0], y[0]), jnp.maximum(x[1], y[1])),
    (b.ndim - 1,),
  )
  lo, hi = lo[..., None], hi[..., None]
  signed = lo < 0
  absmax = jnp.where(signed, jnp.maximum(-lo, hi), jnp.sqrt(hi) if sqrt else hi)
  if sqrt:
    b = jnp.where(signed, b, jnp.sqrt(jnp.where(signed, 0.0, b)))
  inv = jnp.where(absmax > 0, 1.0 / absmax, 0.0).astype(_F32)
  s = jnp.clip(b * inv, -1.0, 1.0)
  idx = nearest_code(s, signed, thresholds)
  if stochastic:
    idx = _stochastic(s, signed, idx)
  codes = idx.astype(jnp.uint8).reshape(*x.shape[:k], -1)
  codes = codes[..., : math.prod(x.shape[k:])].reshape(x.shape)
  scales = jnp.where(signed, -absmax, absmax)[..., 0]
  return QuantizedLeaf(codes, scales, jnp.dtype(x.dtype), block_size, sqrt)


def _decode(q: QuantizedLeaf) -> jax.Array:
  """float32 values of ``q``'s codes in the maps its scales' signs select
  (squared for an unsigned block stored as square roots)."""
  code = tables()[0]
  c, k = _blocked(q.codes.astype(jnp.int32), q.block_size)
  unsigned = (q.scales >= 0)[..., None]
  v = _lookup(code, jnp.where(unsigned, 256, 0) + c) * jnp.abs(q.scales)[..., None]
  if q.sqrt:
    v = jnp.where(unsigned, v * v, v)
  v = v.reshape(*q.codes.shape[:k], -1)[..., : math.prod(q.codes.shape[k:])]
  return v.reshape(q.codes.shape)
