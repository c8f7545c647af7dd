"""Optimizer state in 8 bits: block-quantised moments around any optax transformation.

:func:`quantize_state` stores each large floating leaf of an optax state
that has a parameter's shape (Adam's two moments, a momentum, an RMS
accumulator) as 8-bit codes with one float32 scale per block of
``block_size`` consecutive elements, the scheme of bitsandbytes' 8-bit
optimizers (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization"):

* the scale of a block is its largest magnitude (its "absmax");
* each element is divided by it (multiplied by its reciprocal, as
  bitsandbytes does) and rounded to the nearest of 256 values of the
  *dynamic quantisation map*, a code of one sign bit, a run of zeros that
  gives a decimal exponent (1 down to 1e-6) and a linear fraction in the
  remaining bits: relative precision where Adam's moments live, across
  seven decades below the block's largest value;
* a block whose elements are all ``>= 0`` (every block of Adam's second
  moment) takes the *unsigned* map (no sign bit: one more fraction bit per
  decade), any other block the signed one; the stored scale is negated for
  a signed block, so that the block's map is read from the sign of its
  scale; by default an unsigned block holds its values' square roots (half
  the decades: Adam's second moment keeps its smallest entries).

:func:`dequantize_state` returns the state in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_lossscale import _state, _tree, _validate

__all__ = [
  "QuantizedLeaf",
  "QuantizeState",
  "QuantizedState",
  "dequantize_state",
  "dynamic_map",
  "quantize_state",
]

_F32 = jnp.dtype(jnp.float32)
_BITS = (8,)


def dynamic_map(signed: bool) -> np.ndarray:
  """The 256 values of the 8-bit dynamic quantisation map, sorted, float32.

  bitsandbytes' ``create_dynamic_map(signed)`` (7 exponent bits): for each
  decade ``10**(i - 6)``, ``i = 0..6``, the midpoints of ``2**i`` (signed;
  ``2**(i + 1)`` unsigned) equal steps of ``[0.1, 1]``, times the decade,
  with both signs if ``signed``; and 0 and 1. Computed in float64 and
  rounded to float32 once (bitsandbytes computes the steps in float32 with
  torch's ``linspace``, whose values depend on the CPU's vector width: its
  maps differ from these in some entries by one or two units in the last
  place).

  Args:
    signed: the signed map (-0.993 to 1) or the unsigned one (0 to 1).

  Returns:
    A float32 NumPy array of 256 increasing values.
  """
  values = [0.0, 1.0]
  for i in range(7):
    n = 2 ** (i if signed else i + 1)
    edges = np.linspace(0.1, 1.0, n + 1)
    means = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)
    values += list(means) + (list(-means) if signed else [])
  return np.sort(np.array(values)).astype(np.float32)


def _thresholds(code: np.ndarray) -> np.ndarray:
  """For each pair of neighbours of ``code``, the smallest float32 above
  their exact midpoint (a value rounds up iff it is at least this), and
  ``inf`` last: 256 float32."""
  mid = (code[:-1].astype(np.float64) + code[1:].astype(np.float64)) / 2
  t = mid.astype(np.float32)
  t = np.where(t.astype(np.float64) > mid, t, np.nextafter(t, np.float32(np.inf)))
  return np.append(t, np.float32(np.inf)).astype(np.float32)


@functools.cache
def _tables() -> tuple[np.ndarray, np.ndarray]:
  """The two maps, signed then unsigned (512 values), and their thresholds."""
  codes = [dynamic_map(True), dynamic_map(False)]
  return np.concatenate(codes), np.concatenate([_thresholds(c) for c in codes])


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


def _nearest_code(s: jax.Array, signed: jax.Array, thresholds: np.ndarray) -> jax.Array:
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


def _encode(x: jax.Array, block_size: int, sqrt: bool = True) -> QuantizedLeaf:
  """``x`` as codes and scales, each element to the nearest value of its
  block's map (a value exactly halfway between two rounds down); with
  ``sqrt``, a block that is all ``>= 0`` as its square roots."""
  thresholds = _tables()[1]
  b, k = _blocked(x.astype(_F32), block_size)
  signed = jnp.min(b, axis=-1, keepdims=True) < 0
  if sqrt:
    b = jnp.where(signed, b, jnp.sqrt(jnp.where(signed, 0.0, b)))
  # NaN counts as an infinity (XLA's max reductions may drop a NaN)
  mag = jnp.where(jnp.isnan(b), jnp.inf, jnp.abs(b))
  absmax = jnp.max(mag, axis=-1, keepdims=True)
  inv = jnp.where(absmax > 0, 1.0 / absmax, 0.0).astype(_F32)
  s = jnp.clip(b * inv, -1.0, 1.0)
  idx = _nearest_code(s, signed, thresholds)
  codes = idx.astype(jnp.uint8).reshape(*x.shape[:k], -1)
  codes = codes[..., : math.prod(x.shape[k:])].reshape(x.shape)
  scales = jnp.where(signed, -absmax, absmax)[..., 0]
  return QuantizedLeaf(codes, scales, jnp.dtype(x.dtype), block_size, sqrt)


def _decode(q: QuantizedLeaf) -> jax.Array:
  """float32 values of ``q``'s codes in the maps its scales' signs select
  (squared for an unsigned block stored as square roots)."""
  code = _tables()[0]
  c, k = _blocked(q.codes.astype(jnp.int32), q.block_size)
  unsigned = (q.scales >= 0)[..., None]
  v = _lookup(code, jnp.where(unsigned, 256, 0) + c) * jnp.abs(q.scales)[..., None]
  if q.sqrt:
    v = jnp.where(unsigned, v * v, v)
  v = v.reshape(*q.codes.shape[:k], -1)[..., : math.prod(q.codes.shape[k:])]
  return v.reshape(q.codes.shape)


# --------------------------------------------------------------------------
# The transformation.
# --------------------------------------------------------------------------


class QuantizedState(NamedTuple):
  """State of :func:`quantize_state`.

  Attributes:
    inner_state: the wrapped transformation's state, each quantised leaf a
      :class:`QuantizedLeaf` (the others as the inner transformation made
      them).
  """

  inner_state: Any


class QuantizeState(optax.GradientTransformationExtraArgs):
  """What :func:`quantize_state` returns: an optax transformation.

  Attributes:
    inner: the wrapped transformation.
    bits, block_size, min_size, store_sqrt: as given.
  """

  def __new__(cls, init, update, inner, **options):
    self = super().__new__(cls, init, update)
    self.inner, self.options = inner, options
    for name, value in options.items():
      setattr(self, name, value)
    return self

  def __reduce__(self):  # copy/pickle: rebuilt from what made it
    return (functools.partial(quantize_state, **self.options), (self.inner,))


def _is_quantized(x: Any) -> bool:
  return isinstance(x, QuantizedLeaf)


def _dequantized(tree: Any, cast: bool) -> Any:
  """``tree`` with each :class:`QuantizedLeaf` as its values (in its dtype
  if ``cast``, else float32)."""

  def leaf(x):
    if not _is_quantized(x):
      return x
    v = x.dequantize()
    return v.astype(x.dtype) if cast else v

  return jax.tree.map(leaf, tree, is_leaf=_is_quantized)


def quantize_state(
  inner: optax.GradientTransformation,
  *,
  bits: int = 8,
  block_size: int = 256,
  min_size: int = 4096,
  store_sqrt: bool = True,
) -> QuantizeState:
  """``inner`` with its large state leaves stored in 8 bits, blockwise.

  A leaf of ``inner``'s state is quantised when it is a floating array
  with the shape of one of the parameters and at least ``min_size``
  elements (Adam's ``mu`` and ``nu``, SGD's momentum, ...); other leaves
  (counters, scalars, small leaves) are kept as ``inner`` made them. It is
  stored as a :class:`QuantizedLeaf`: blocks of ``block_size`` consecutive
  elements of the flattened leaf (blocks that do not cross the leaf's
  leading axes where its trailing ones hold whole blocks), one float32
  scale per block, 8-bit codes of bitsandbytes' dynamic map (unsigned for
  a block that is all ``>= 0``, signed otherwise), rounded to nearest.
  With ``store_sqrt`` (the default) a block that is all ``>= 0`` is stored
  as its values' square roots: rounded to nearest, Adam's second moment
  loses its smallest entries to 0 (where the update ``m / (sqrt(0) +
  eps)`` is too large by orders of magnitude); square roots span half as
  many decades, and no entry measured in BENCHMARKS.md became 0 (its
  "8-bit optimizer state" section). ``store_sqrt=False`` is bitsandbytes'
  ``Adam8bit`` storage. ``update`` dequantises the state (each leaf in its
  own dtype), runs ``inner.update``, and quantises the new state; a leaf
  holding NaN or an infinity gets an infinite scale, which the checkpoint
  guard sees.

  Put it inside the loss scale and inside :func:`master_weights`
  (``dynamic_loss_scale(master_weights(quantize_state(optax.adam(...))))``):
  the master weights are parameters, not moments, and are never quantised;
  a :func:`master_weights` state inside it is refused. Put
  ``optax.MultiSteps`` outside it too (its accumulated gradients have the
  parameters' shapes).

  Args:
    inner: any optax transformation (a chain included).
    bits: bits per code; 8 (the one width offered).
    block_size: elements per block, a power of two >= 2.
    min_size: leaves with fewer elements are not quantised (>= 0).
    store_sqrt: store the square roots of a block that is all ``>= 0``.

  Returns:
    A :class:`QuantizeState` (an ``optax.GradientTransformationExtraArgs``)
    whose state is a :class:`QuantizedState`.

  Raises:
    ValueError: a bad ``bits``, ``block_size``, ``min_size`` or
      ``store_sqrt``; ``init``
      where ``inner``'s state holds a :func:`master_weights` state;
      ``update`` with a state made for other parameters or by another
      transformation (naming the leaf).

  Example:
    >>> import jax.numpy as jnp, optax, optax_lossscale as ols
    >>> tx = ols.quantize_state(optax.adam(1e-3), min_size=0)
    >>> params = {"w": jnp.linspace(-1.0, 1.0, 512)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.linspace(1.0, -1.0, 512)}, state, params)
    >>> mu = state.inner_state[0].mu["w"]
    >>> mu.codes.dtype, mu.scales.shape  # one scale per 256 elements
    (dtype('uint8'), (2,))
    >>> float(ols.dequantize_state(state)[0].mu["w"][0])  # 0.1 * 1.0
    0.10000000149011612
  """
  if isinstance(bits, bool) or bits not in _BITS:
    raise ValueError(f"`bits` must be one of {_BITS}, got {bits!r}.")
  block_size = _validate.as_int("block_size", block_size)
  if block_size < 2 or block_size & (block_size - 1):
    raise ValueError(f"`block_size` must be a power of two >= 2, got {block_size}.")
  min_size = _validate.as_int("min_size", min_size)
  if min_size < 0:
    raise ValueError(f"`min_size` must be >= 0, got {min_size}.")
  if not isinstance(store_sqrt, (bool, np.bool_)):
    raise ValueError(f"`store_sqrt` must be True or False, got {store_sqrt!r}.")
  store_sqrt = bool(store_sqrt)
  if not (
    callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))
  ):
    raise ValueError(f"`inner` must be an optax GradientTransformation, got {inner!r}.")
  wrapped = optax.with_extra_args_support(inner)

  def quantized(inner_state, shapes):
    def leaf(x):
      if (
        _tree.is_float_array(x)
        and tuple(x.shape) in shapes
        and x.size >= min_size
        and x.size > 0
      ):
        return _encode(x, block_size, store_sqrt)
      return x

    return jax.tree.map(leaf, inner_state)

  def init_fn(params):
    inner_state = wrapped.init(params)
    if _state.wants_float32_gradients(inner_state):
      raise ValueError(
        "quantize_state: the inner state holds a master_weights state, whose "
        "master weights would be quantised. Put quantize_state inside it: "
        "master_weights(quantize_state(optax.adam(...)))."
      )
    shapes = {tuple(p.shape) for p in jax.tree.leaves(params) if _tree.is_array(p)}
    return QuantizedState(quantized(inner_state, shapes))

  def requantized(template, new_state):
    """``new_state`` quantised where ``template`` (the old state) was."""
    t_flat, treedef = jax.tree.flatten(template, is_leaf=_is_quantized)
    n_flat = treedef.flatten_up_to(new_state)
    out = [
      _encode(n, block_size, store_sqrt) if _is_quantized(t) else n
      for t, n in zip(t_flat, n_flat, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)

  def update_fn(updates, state, params=None, **extra_args):
    _state.check_state_type("quantize_state", state, QuantizedState)
    like = params if params is not None else updates
    _check_layout(jax.eval_shape(init_fn, like), state)
    inner_state = _dequantized(state.inner_state, cast=True)
    new_updates, new_inner = wrapped.update(updates, inner_state, params, **extra_args)
    return new_updates, QuantizedState(requantized(state.inner_state, new_inner))

  return QuantizeState(
    init_fn,
    update_fn,
    inner,
    bits=bits,
    block_size=block_size,
    min_size=min_size,
    store_sqrt=store_sqrt,
  )


def _check_layout(expected: Any, state: Any) -> None:
  """``state`` has ``expected``'s structure, shapes and dtypes, or a
  ValueError naming the first leaf that differs."""
  got = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_quantized)[0]
  want = jax.tree_util.tree_flatten_with_path(expected, is_leaf=_is_quantized)[0]
  got_d, want_d = dict(got), dict(want)
  for path in [p for p, _ in want] + [p for p, _ in got]:
    g, w = got_d.get(path), want_d.get(path)
    if _describe(g) != _describe(w):
      raise ValueError(
        f"quantize_state: the state's leaf at {_tree.keystr(path)} is "
        f"{_describe(g)}, where this transformation makes {_describe(w)} for "
        "these parameters: the state was made for other parameters or by "
        "another transformation (or with another block_size or min_size). "
        "Init a fresh state, or pass the parameters it was made for."
      )


def _describe(x: Any) -> str:
  if x is None:
    return "nothing"
  if _is_quantized(x):
    return (
      f"quantised {jnp.dtype(x.dtype).name}{list(x.codes.shape)} (scales "
      f"{list(x.scales.shape)}, block_size {x.block_size}, store_sqrt {x.sqrt})"
    )
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return type(x).__name__
  return f"{jnp.dtype(dtype).name}{list(getattr(x, 'shape', ()))}"


def dequantize_state(state: Any) -> Any:
  """The optimizer state with every quantised leaf in float32.

  For inspection and export: a :class:`QuantizedState` becomes the
  inner state it holds, each :class:`QuantizedLeaf` in it a float32 array
  (codes' map values times their block's largest magnitude); everything
  else is returned as it is. Works on a state holding them at any depth
  (under a loss scale, in a chain).

  Args:
    state: an optimizer state holding at least one :func:`quantize_state`
      state.

  Returns:
    The state, dequantised.

  Raises:
    ValueError: ``state`` holds no quantised leaf.
  """
  state = _state.optimizer_state(state)
  is_q = lambda x: isinstance(x, QuantizedState) or _is_quantized(x)  # noqa: E731
  if not _tree.find_all(state, is_q):
    raise ValueError(
      f"dequantize_state: the state (a {type(state).__name__}) holds no "
      "quantize_state state."
    )

  def node(x):
    if isinstance(x, QuantizedState):
      return _dequantized(x.inner_state, cast=False)
    return _dequantized(x, cast=False)

  return jax.tree.map(node, state, is_leaf=is_q)
