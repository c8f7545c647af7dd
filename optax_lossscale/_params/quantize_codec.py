"""The 8-bit code of quantised optimizer state: dynamic maps, blocks, nearest codes.

bitsandbytes' dynamic quantisation map (Dettmers et al. 2022, "8-bit
Optimizers via Block-wise Quantization"), signed and unsigned, and one
leaf's codec: blocks of consecutive elements with one float32 scale (their
largest magnitude, or a little more where the signed map's end needs it),
each element rounded to the nearest value of its block's map (the unsigned
one for a block that is all ``>= 0``, which holds its values' square roots
when asked), and back. :mod:`.quantize_state`
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

from optax_lossscale._base import flax_serialization as _flax_serialization
from optax_lossscale._base import rounding as _rounding
from optax_lossscale._base import tree as _tree

__all__ = [
  "QuantizedLeaf",
  "block_extremes",
  "blocks",
  "check_real",
  "code_blocks",
  "decode_blocks",
  "dynamic_map",
  "encode",
  "encode_many",
  "kept_blocks",
  "layout",
  "thresholds",
  "unblocked",
]

_F32 = jnp.dtype(jnp.float32)


def dynamic_map(signed: bool, bits: int = 8) -> np.ndarray:
  """The ``2**bits`` values of the dynamic quantisation map, sorted, float32.

  bitsandbytes' ``create_dynamic_map(signed, bits - 1, bits)`` (``bits - 1``
  exponent bits): for each decade ``10**(i - bits + 2)``, ``i = 0..bits -
  2``, the midpoints of ``n = 2**i`` (signed; ``2**(i + 1)`` unsigned)
  equal steps of ``[0.1, 1]``, times the decade, with both signs if
  ``signed``; and 0 and 1. Cell ``j``'s midpoint is ``(2n + 18j + 9) /
  (20n * 10**(bits - 2 - i))``, computed as :func:`_cell_means` does in
  float32 (exact but for one rounding), the arithmetic :func:`code_value`
  decodes with (bitsandbytes computes the steps in float32 with torch's
  ``linspace``, whose values depend on the CPU's vector width: its 8-bit
  maps and these differ in some entries by one or two units in the last
  place).

  Args:
    signed: the signed map (-0.993 to 1 in 8 bits) or the unsigned one (0
      to 1).
    bits: the code's width: 8 (seven decades, what ``quantize_state``
      stores) or less (``benchmarks/quantize_4bit.py`` simulates 4).

  Returns:
    A float32 NumPy array of ``2**bits`` increasing values.
  """
  values = [np.float32(0.0), np.float32(1.0)]
  for i in range(bits - 1):
    e = i if signed else i + 1
    n = 2**e
    means = _cell_means(np.arange(n), e, _decade_factor(i, bits))
    values += list(means) + (list(-means) if signed else [])
  return np.sort(np.array(values, np.float32))


def _decade_factor(i: int, bits: int = 8) -> np.float32:
  """``1 / (20 * 10**(bits - 2 - i))`` in float32: decade ``i``'s factor."""
  return np.float32(1.0 / (20 * 10 ** (bits - 2 - i)))


def _cell_means(j, e, factor):
  """Cell ``j``'s value in a decade of ``n = 2**e`` cells, NumPy or JAX:
  ``(2n + 18j + 9) / n`` (exact: an integer below ``2**24`` times a power
  of two) times the decade's factor, one rounding. Multiplications only:
  XLA fuses them into every consumer of the decoded state, where it would
  compute a division once and store it."""
  if isinstance(j, np.ndarray):
    m = 2 * 2**e + 18 * j + 9
    return m.astype(np.float32) * np.float32(2.0**-e) * factor
  m = 2 * jnp.left_shift(1, e) + 18 * j + 9
  return m.astype(_F32) * _pow2(-e) * factor


def thresholds(code: np.ndarray) -> np.ndarray:
  """For each pair of neighbours of ``code``, the smallest float32 above
  their exact midpoint (a value rounds up iff it is at least this), and
  ``inf`` last: 256 float32."""
  mid = (code[:-1].astype(np.float64) + code[1:].astype(np.float64)) / 2
  t = mid.astype(np.float32)
  t = np.where(t.astype(np.float64) > mid, t, np.nextafter(t, np.float32(np.inf)))
  return np.append(t, np.float32(np.inf)).astype(np.float32)


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
  x = _whole_blocks(x, k, block_size)
  lead = x.shape[:k]
  x = x.reshape(*lead, -1)
  pad = -x.shape[-1] % block_size
  if pad:
    x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad)])
  return x.reshape(*lead, -1, block_size), k


def blocks(x: jax.Array, block_size: int) -> jax.Array:
  """``x`` as ``(*leading axes, blocks, block_size)``: the blocks the codec
  cuts it into (:func:`_block_axis`), zero-padded."""
  return _blocked(x, block_size)[0]


def unblocked(b: jax.Array, shape: tuple, block_size: int) -> jax.Array:
  """The array of ``shape`` whose :func:`blocks` are ``b`` (padding cut)."""
  k = _block_axis(shape, block_size)
  return b.reshape(*shape[:k], -1)[..., : math.prod(shape[k:])].reshape(shape)


def _whole_blocks(x: jax.Array, k: int, block_size: int) -> jax.Array:
  """``x``, resharded where JAX's explicit sharding could not cut it into
  blocks in place: where its axes from ``k`` on are sharded other than
  each shard holding whole blocks of their first axis (a block would span
  two devices), those axes are gathered (the blocks' values, and so the
  codes, are the same on any sharding). Under automatic sharding, or
  where each device holds whole blocks, ``x`` as it is."""
  spec = _tree.explicit_spec(x)
  if spec is None:
    return x
  spec = tuple(spec) + (None,) * (x.ndim - len(spec))
  trailing = spec[k:]
  if all(s is None for s in trailing):
    return x
  size = math.prod(x.shape[k:])
  mesh = jax.typeof(x).sharding.mesh
  names = trailing[0] if isinstance(trailing[0], tuple) else (trailing[0],)
  shards = math.prod(mesh.shape[n] for n in names if n is not None)
  if (
    all(s is None for s in trailing[1:])
    and size % block_size == 0
    and (size // block_size) % shards == 0
  ):
    return x
  return jax.sharding.reshard(x, jax.sharding.PartitionSpec(*spec[:k]))


def _as_sharded_as(v: jax.Array, like: jax.Array) -> jax.Array:
  """``v`` in ``like``'s explicit sharding (replicated included), where the
  two differ: where :func:`_whole_blocks` gathered ``like``, or where a
  state was placed otherwise than its update computes (restored, or put
  with ``jax.device_put``). A no-op without explicit sharding."""
  spec = _tree.explicit_spec(like)
  if _tree.explicit_spec(v) == spec:
    return v
  return jax.sharding.reshard(v, jax.sharding.PartitionSpec(*(spec or ())))


@dataclasses.dataclass(frozen=True)
class QuantizedLeaf:
  """One block-quantised leaf of a :func:`quantize_state` state.

  Attributes:
    codes: uint8, the leaf's shape: each element's index in its block's map.
    scales: float32, one per block (shape: the leaf's leading axes that the
      blocks do not span, then the number of blocks): the block's largest
      magnitude (or its least value's magnitude over 0.993, the signed
      map's least value, where that is larger), negated for a block that
      uses the signed map; infinite
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

  #: the ``StoredQuantized`` protocol of ``_base/state_roles.py``
  stored_quantized = True  # a class attribute, not a field

  def dequantize(self) -> jax.Array:
    """The leaf in float32: each code's map value times its block's absmax."""
    return _decode(self)


jax.tree_util.register_dataclass(
  QuantizedLeaf,
  data_fields=["codes", "scales"],
  meta_fields=["dtype", "block_size", "sqrt"],
)
# Flax's serialization (to_bytes, a TrainState's checkpoint) saves its arrays.
_flax_serialization.register(QuantizedLeaf, ("codes", "scales"))


_DECADES = np.float32(10.0) ** np.arange(-7, 0, dtype=np.float32)  # 1e-7 ... 0.1
_POW10 = [np.float32(10.0**k) for k in range(7)]
_FACTORS = [_decade_factor(i) for i in range(7)]


def _pick(i: jax.Array, values: list) -> jax.Array:
  """``values[i]`` for a short list of float32 constants, as a chain of
  selects: elementwise, so XLA fuses it into every consumer, where a
  gather from a table stops fusion (the dequantised state would then be
  written out in float32 and read back: BENCHMARKS.md, 8-bit state)."""
  out = jnp.where(i == 0, values[-1], values[-1])  # in i's shape and sharding
  for k in range(len(values) - 2, -1, -1):
    out = jnp.where(i == k, values[k], out)
  return out


def _top_bit(t: jax.Array) -> jax.Array:
  """``floor(log2(t))`` of int32 ``t`` in [1, 2**24] (0 for ``t`` below 1),
  from float32's exponent field (exact)."""
  bits = jax.lax.bitcast_convert_type(jnp.maximum(t, 1).astype(_F32), jnp.int32)
  return jnp.right_shift(bits, 23) - 127


def code_value(c: jax.Array, signed: jax.Array) -> jax.Array:
  """The value of code ``c`` (int32, 0 to 255) in the signed or unsigned
  8-bit map, :func:`dynamic_map`'s entry ``c``, from the code's structure.

  A signed map's codes ``127 ± r`` hold ``±`` its ``r``-th magnitude and an
  unsigned map's code ``r - 1`` its ``r``-th; the ``r``-th magnitude
  (``r >= 1``) lies in decade ``i = e - u`` (``e``: the top bit of ``r``,
  ``u``: 1 for the unsigned map), cell ``j = r - 2**e`` of ``n = 2**e``,
  and is ``(2n + 18j + 9) / (20n * 10**(6 - i))`` (:func:`_cell_means`);
  0 and the top code's 1 are set apart.
  """
  c = c.astype(jnp.int32)
  u = jnp.where(signed, 0, 1)
  r = jnp.where(signed, c - 127, c + 1)
  t = jnp.abs(r)
  e = _top_bit(t)
  i = e - u
  v = _cell_means(t - jnp.left_shift(1, e), e, _pick(i, _FACTORS))
  v = jnp.where((t == 0) | (i < 0), 0.0, v)
  v = jnp.where(c == 255, 1.0, v)
  return jnp.where(r < 0, -v, v)


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``a + b`` as ``(sum, err)`` with ``sum + err`` exact (Knuth's two-sum)."""
  total = a + b
  bv = total - a
  return total, (a - (total - bv)) + (b - bv)


def _pow2(e: jax.Array) -> jax.Array:
  """``2.0**e`` for int32 ``e`` in [-126, 127], from the exponent field."""
  return jax.lax.bitcast_convert_type(jnp.left_shift(e + 127, 23), _F32)


def nearest_code(s: jax.Array, signed: jax.Array) -> jax.Array:
  """The index of the nearest value of the map (signed or not) to ``s`` in
  [-1, 1] (a value exactly halfway between two rounds down; NaN to 0's
  code), from the map's structure.

  A magnitude ``a`` in decade ``i`` (``[1e-7, 1e-6) * 10**i``) lies in one
  of the decade's ``n`` equal cells of ``[0.1, 1] * 10**(i - 6)``, whose
  midpoint is a code; a cell's edges are its codes' midpoints, so the
  nearest code is the cell's, or (at a decade's edge, or where float32
  puts ``a`` in the neighbouring cell) its neighbour on ``s``'s side:
  comparing ``s`` with their exact midpoint (``2s`` against the two-sum
  of the two values) settles it. The candidate's value is computed as
  :func:`code_value` computes it, from its decade and cell.
  """
  u = jnp.where(signed, 0, 1).astype(jnp.int32)  # 2**(i + u) codes in decade i
  a = jnp.abs(s)
  # One chain over the decades' lower edges: a's decade and its factors.
  i, factor, to_unit = jnp.int32(0), _FACTORS[0], _POW10[6]
  for k in range(1, 7):
    ge = a >= _DECADES[k]
    i = jnp.where(ge, k, i)
    factor = jnp.where(ge, _FACTORS[k], factor)
    to_unit = jnp.where(ge, _POW10[6 - k], to_unit)
  low = ~(a >= _DECADES[0])  # below 1e-7 (or NaN): 0's code
  e = i + u
  n = _pow2(e)
  cell = jnp.clip(jnp.floor((a * to_unit - 0.1) * n * np.float32(1 / 0.9)), 0.0, n - 1)
  mag = jnp.where(low, 0.0, (2 * n + 18 * cell + 9) * _pow2(-e) * factor)
  rank = jnp.where(
    low, 0, jnp.left_shift(1, e) - jnp.left_shift(1, u) + 1 + cell.astype(jnp.int32)
  )
  zero = jnp.where(signed, 127, 0)
  c = jnp.where(s < 0, zero - rank, zero + rank)
  v = jnp.where(s < 0, -mag, mag)
  up = s > v  # the neighbour to compare with: above, or else below
  total, err = _two_sum(v, code_value(jnp.where(up, c + 1, c - 1), signed))
  above = 2.0 * s - total > err  # s above the exact midpoint
  move = jnp.where(up, above & (c < 255), ~above & (c > 0) & (s == s))
  return c + jnp.where(move, jnp.where(up, 1, -1), 0)


def _stochastic(
  s: jax.Array, signed: jax.Array, nearest: jax.Array, first=0, step=None
) -> jax.Array:
  """The code of each ``s`` rounded at random between the two map values
  around it, up with probability its distance from the lower one over
  their gap (so the code's value is ``s`` on average); ``nearest`` is its
  nearest code. The random numbers are :func:`rounding.uniform_of` of
  ``s`` (its first element's flat index ``first``) at ``step``."""
  v = code_value(nearest, signed)
  lo = jnp.where(v <= s, nearest, jnp.maximum(nearest - 1, 0))
  hi = jnp.minimum(lo + 1, 255)
  v_lo, v_hi = code_value(lo, signed), code_value(hi, signed)
  gap = v_hi - v_lo
  p = jnp.where(gap > 0, (s - v_lo) / jnp.where(gap > 0, gap, 1.0), 0.0)
  return lo + (_rounding.uniform_of(s, first, step) < p).astype(jnp.int32)


def layout(x: Any, block_size: int, sqrt: bool = True) -> QuantizedLeaf:
  """The :class:`QuantizedLeaf` :func:`encode` makes of ``x`` (an array or
  its abstract value), abstract: its codes' and scales' shapes and dtypes,
  from ``x``'s shape alone (nothing is encoded)."""
  shape = tuple(x.shape)
  k = _block_axis(shape, block_size)
  blocks = -(-math.prod(shape[k:]) // block_size)
  return QuantizedLeaf(
    jax.ShapeDtypeStruct(shape, jnp.uint8),
    jax.ShapeDtypeStruct((*shape[:k], blocks), _F32),
    jnp.dtype(x.dtype),
    block_size,
    sqrt,
  )


def encode(
  x: jax.Array,
  block_size: int,
  sqrt: bool = True,
  stochastic: bool = False,
  step: Any = None,
) -> QuantizedLeaf:
  """``x`` as codes and scales, each element to the nearest value of its
  block's map (a value exactly halfway between two rounds down), or with
  ``stochastic`` to one of the two around it at random (:func:`_stochastic`,
  its random numbers drawn for ``step``, an int32 scalar); with ``sqrt``, a
  block that is all ``>= 0`` as its square roots."""
  return encode_many([x], block_size, sqrt, stochastic, step=step)[0]


def encode_many(
  xs: list,
  block_size: int,
  sqrt: bool = True,
  stochastic: bool = False,
  firsts: list | None = None,
  step: Any = None,
  olds: list | None = None,
) -> list:
  """:func:`encode` of each of ``xs``, arrays of one shape (and sharding),
  whose blocks' extremes one reduction finds: it reads what the arrays are
  computed from (a gradient, Adam's two moments) once, not once an array
  (BENCHMARKS.md, 8-bit state). ``firsts``: for a one-dimensional array
  holding several leaves, per block (shape ``(blocks, 1)``) what to add to
  an element's index to make it its index in its own leaf, which the
  stochastic rounding's random numbers hash (with ``step``). ``olds``: for
  each of ``xs``, None or ``(the QuantizedLeaf it is an update of, the
  values that leaf was decoded to)``, whose unchanged blocks it keeps
  (:func:`kept_blocks`)."""
  for x in xs:
    check_real(x.dtype, x.shape)
  olds = [None] * len(xs) if olds is None else list(olds)
  return _encode_many(list(xs), firsts, step, olds, block_size, sqrt, stochastic)


def check_real(dtype: Any, shape: tuple) -> None:
  """A ValueError unless ``dtype`` is a real floating dtype: what is encoded."""
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
      f"quantize_state encodes real floating arrays, got a {jnp.dtype(dtype).name} "
      f"array of shape {tuple(shape)}."
    )


# One program, not hundreds of operations dispatched one by one where it
# runs outside a jitted function (an optimizer's init, usually); inside one
# it is inlined.
@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def _encode_many(
  xs: list, firsts, step, olds: list, block_size: int, sqrt: bool, stochastic: bool
) -> list:
  # The codes are integers: like rounding, quantising has no derivative, so
  # the stored state carries none (its scales would carry a partial one).
  xs = [jax.lax.stop_gradient(x) for x in xs]
  blocked = [_blocked(x.astype(_F32), block_size) for x in xs]
  reads = [
    None if o is None else blocks(jax.lax.stop_gradient(o[1]).astype(_F32), block_size)
    for o in olds
  ]
  extremes = block_extremes([b for b, _ in blocked], reads=reads)
  firsts = [0] * len(xs) if firsts is None else firsts
  out = []
  for n, (x, (b, _)) in enumerate(zip(xs, blocked, strict=True)):
    lo, hi, changed = extremes[n]
    idx, scales = code_blocks(b, lo, hi, sqrt, stochastic, firsts[n], step)
    if olds[n] is not None:
      old = olds[n][0]
      idx, scales = kept_blocks(
        changed, idx, scales, blocks(old.codes, block_size), old.scales
      )
    codes = _as_sharded_as(unblocked(idx.astype(jnp.uint8), x.shape, block_size), x)
    out.append(QuantizedLeaf(codes, scales, jnp.dtype(x.dtype), block_size, sqrt))
  return out


def kept_blocks(changed, codes, scales, old_codes, old_scales) -> tuple:
  """``(codes, scales)`` of blocks, with each block not ``changed`` (its
  values those its state was decoded to, in the dtype the inner
  transformation read them: a state it left as it was; see
  :func:`block_extremes`) as ``old_codes`` and ``old_scales``: encoding
  again a block that did not change changes nothing, neither its scale (a
  half-precision moment's block is scaled by its rounded extreme) nor,
  rounding stochastically, a code. ``changed`` None: as they are."""
  if changed is None:
    return codes, scales
  old_codes, old_scales = (
    _as_sharded_as(old_codes, codes),
    _as_sharded_as(old_scales, scales),
  )
  codes = jnp.where(changed[..., None], codes, old_codes.astype(codes.dtype))
  return codes, jnp.where(changed, scales, old_scales)


#: The magnitude of the signed map's least value (0.9930, short of 1).
_SIGNED_END = np.float32(-dynamic_map(True)[0])
#: Its reciprocal in float32: a multiplication, which XLA leaves as it is.
_SIGNED_SCALE = np.float32(1) / _SIGNED_END

#: Above it, ``1 / absmax`` is below float32's normal range (where XLA may
#: flush it to 0): such a block is normalised by ``absmax * 2**-4`` instead.
_HUGE = np.float32(2.0**126)


def block_extremes(bs: list, one_pass: bool = True, reads: list | None = None) -> list:
  """Each block's least and largest value and whether it changed,
  ``(lo, hi, changed)`` for each of ``bs`` (float32, blocked along the last
  axis, of one shape). ``lo`` and ``hi`` count NaN as an infinity: no NaN
  reaches a reduction, whose NaN rule differs by backend (XLA's min and max
  keep a NaN, Pallas' Triton lowering drops it); the largest magnitude
  follows from the two. ``changed``: whether the block differs bit for bit
  from the block of ``reads`` (for each of ``bs``, None or the float32
  values its state was decoded to: :func:`kept_blocks`), None where that is
  None. ``one_pass``: one variadic reduction reads every array once (what
  XLA fuses with what the arrays are computed from: a gradient, Adam's two
  moments); else a reduction a quantity (what Pallas' Triton lowering has:
  min and max, so ``changed`` is a maximum, not ``any``)."""
  reads = [None] * len(bs) if reads is None else reads
  nan_up = [jnp.where(jnp.isnan(b), jnp.inf, b) for b in bs]
  bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint32)  # noqa: E731
  diffs = [
    None if r is None else jnp.where(bits(b) != bits(r), np.float32(1), np.float32(0))
    for b, r in zip(bs, reads, strict=True)
  ]
  if not one_pass:
    return [
      (jnp.min(u, axis=-1), jnp.max(u, axis=-1), None if d is None else d.max(-1) > 0)
      for u, d in zip(nan_up, diffs, strict=True)
    ]
  operands, inits, ops = [], [], []
  for u, d in zip(nan_up, diffs, strict=True):
    operands += [u, u] + ([] if d is None else [d])
    inits += [np.float32(np.inf), np.float32(-np.inf)] + ([] if d is None else [0])
    ops += [jnp.minimum, jnp.maximum] + ([] if d is None else [jnp.maximum])
  out = list(
    jax.lax.reduce(
      tuple(operands),
      tuple(np.float32(i) for i in inits),
      lambda x, y: tuple(op(a, c) for op, a, c in zip(ops, x, y, strict=True)),
      (bs[0].ndim - 1,),
    )
  )
  result = []
  for d in diffs:
    lo, hi = out.pop(0), out.pop(0)
    result.append((lo, hi, None if d is None else out.pop(0) > 0))
  return result


def code_blocks(
  b, lo, hi, sqrt, stochastic, first=0, step=None
) -> tuple[jax.Array, jax.Array]:
  """The codes (int32, ``b``'s shape) and scales (one a block) of ``b``,
  float32 blocked along its last axis, given each block's least and largest
  values: the one encoder every path uses. ``first`` is the flat index of
  ``b``'s first element in its leaf's blocks (a kernel's tile), or an
  array of such offsets a block (the flat layout's buffer), which the
  stochastic rounding's random numbers hash with ``step``."""
  lo, hi = lo[..., None], hi[..., None]
  signed = lo < 0
  # The signed map ends at 1 above but at -_SIGNED_END below: a block whose
  # least value has the larger magnitude is scaled so that it is that end
  # (stored as itself, not 0.7% short at each requantisation); where that
  # would overflow, by its magnitude.
  end = -lo * _SIGNED_SCALE
  end = jnp.where(jnp.isinf(end) & jnp.isfinite(lo), -lo, end)
  absmax = jnp.where(signed, jnp.maximum(end, hi), jnp.sqrt(hi) if sqrt else hi)
  if sqrt:
    b = jnp.where(signed, b, jnp.sqrt(jnp.where(signed, 0.0, b)))
  # f is 1 for every block below _HUGE, so these are b * (1 / absmax) there,
  # bitsandbytes' arithmetic; above it both factors stay normal.
  f = jnp.where(absmax > _HUGE, np.float32(2.0**-4), np.float32(1.0))
  inv = jnp.where(absmax > 0, 1.0 / (absmax * f), 0.0).astype(_F32)
  s = jnp.clip((b * f) * inv, -1.0, 1.0)
  idx = nearest_code(s, signed)
  if stochastic:
    idx = _stochastic(s, signed, idx, first, step)
  return idx, jnp.where(signed, -absmax, absmax)[..., 0]


def decode_blocks(c: jax.Array, scales: jax.Array, sqrt: bool) -> jax.Array:
  """float32 values of codes ``c`` (blocked along the last axis, one scale
  a block) in the maps their scales' signs select (squared for an unsigned
  block stored as square roots): the one decoder every path uses."""
  unsigned = (scales >= 0)[..., None]
  v = code_value(c, ~unsigned) * jnp.abs(scales)[..., None]
  return jnp.where(unsigned, v * v, v) if sqrt else v


def _stacked_axes(q: QuantizedLeaf) -> int:
  """How many leading axes of ``q`` stack leaves (a ``jax.vmap``-ed or
  scanned state's): the fewest whose removal leaves codes and scales of
  one leaf's layout (:func:`layout`)."""
  shape = tuple(q.codes.shape)
  for s in range(len(shape) + 1):
    one = layout(jax.ShapeDtypeStruct(shape[s:], _F32), q.block_size)
    if (*shape[:s], *one.scales.shape) == tuple(q.scales.shape):
      return s
  raise ValueError(
    f"a QuantizedLeaf's scales {tuple(q.scales.shape)} do not fit its codes "
    f"{shape} in blocks of {q.block_size}."
  )


@jax.jit  # one program (see _encode_many)
def _decode(q: QuantizedLeaf) -> jax.Array:
  """float32 values of ``q``'s codes in the maps its scales' signs select
  (squared for an unsigned block stored as square roots); a stack of leaves
  (:func:`_stacked_axes`) leaf by leaf."""
  stacked = _stacked_axes(q)
  if stacked:
    lead = q.codes.shape[:stacked]
    one = dataclasses.replace(
      q,
      codes=q.codes.reshape(-1, *q.codes.shape[stacked:]),
      scales=q.scales.reshape(-1, *q.scales.shape[stacked:]),
    )
    values = jax.vmap(
      lambda c, s: _decode(dataclasses.replace(one, codes=c, scales=s))
    )(one.codes, one.scales)
    return values.reshape(*lead, *values.shape[1:])
  c = blocks(q.codes.astype(jnp.int32), q.block_size)
  v = decode_blocks(c, q.scales, q.sqrt)
  return _as_sharded_as(unblocked(v, q.codes.shape, q.block_size), q.codes)
