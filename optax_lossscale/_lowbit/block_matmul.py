"""Block-scaled matmuls: MXFP8 and NVFP4 recipes for every GEMM of a train step.

A ``dot_general`` is brought to the form ``(B, M, K) x (B, K, N)`` (its
batch, free and contracting axes each flattened). The three GEMMs of its
forward and backward pass each quantise both operands along that GEMM's own
contraction, from the high-precision source (:func:`block_quantize`):

* forward ``y = x w``: ``x`` and ``w`` along ``K``;
* input gradient ``dx = dy wᵀ``: ``dy`` and ``w`` along ``N``;
* weight gradient ``dw = xᵀ dy``: ``x`` and ``dy`` along ``M``.

Each GEMM multiplies the quantised operands with float32 accumulation
(:mod:`~optax_lossscale._lowbit.block_gemm`): emulated, the same numbers on every
backend, or natively where a backend's block-scaled GEMM gives them. The
backward pass saves the two operands as they came (their own dtypes), as a
bfloat16 matmul does, and quantises them again.

NVFP4 adds to this: 16 x 16 tiles for the weight (``weight_2d``: the
forward and the input gradient use the same quantised weight); a 16 x 16
random Hadamard transform along ``M`` on both operands of the weight
gradient (fixed signs; ``Hᵀ H = I`` cancels it in exact arithmetic); and
stochastic rounding of the output gradient's elements. Their random numbers
come from ``key(seed)`` (the recipe's) folded with a 32-bit hash of the output
gradient's bits: they differ whenever the gradient does (every step) and
are reproducible from the same inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_lossscale._base import tree as _tree
from optax_lossscale._lowbit import block_gemm as _block_gemm
from optax_lossscale._lowbit import block_scaled as _block_scaled

__all__ = ["MXFP8Matmul", "NVFP4Matmul", "dot_general", "excluded", "kept"]

_F32 = jnp.dtype(jnp.float32)

#: The structural roles a recipe's ``keep`` can name: the output layer (a
#: weight's matmul whose result reaches the function's outputs with no other
#: matmul in between) and an embedding's (a weight's matmul with a
#: table the function also gathers rows from: a tied output layer).
ROLES = ("output", "embedding")
#: NVFP4's layers kept in the compute dtype by default: the output layer and
#: the embeddings, found by structure (Linen, NNX, Equinox, plain JAX alike).
#: Attention's matmuls are kept by structure too (``attention=False``).
NVFP4_KEEP = ROLES


def check_keep(recipe: Any) -> None:
  keep = recipe.keep
  if isinstance(keep, str) or not isinstance(keep, (tuple, list)):
    raise ValueError(f"`keep` must be a tuple of roles from {ROLES}, got {keep!r}.")
  unknown = [k for k in keep if k not in ROLES]
  if unknown:
    raise ValueError(f"`keep`: {unknown!r} are not roles; the roles are {ROLES}.")
  object.__setattr__(recipe, "keep", tuple(keep))


def check_exclude(exclude: Any) -> Any:
  if callable(exclude):
    return exclude
  if not isinstance(exclude, (tuple, list)) or not all(
    isinstance(p, str) for p in exclude
  ):
    raise ValueError(
      "`exclude` must be a tuple of regular expressions (matched against a "
      f"matmul's module path, e.g. 'Transformer/head') or a callable, got {exclude!r}."
    )
  for p in exclude:
    try:
      re.compile(p)
    except re.error as e:
      raise ValueError(f"`exclude`: {p!r} is not a regular expression: {e}.") from None
  return tuple(exclude)


def check_min_size(recipe: Any) -> None:
  """A recipe's ``min_size``: a non-negative int."""
  size = recipe.min_size
  if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer)):
    raise ValueError(f"`min_size` must be a non-negative int, got {size!r}.")
  if size < 0:
    raise ValueError(f"`min_size` must be a non-negative int, got {size!r}.")
  object.__setattr__(recipe, "min_size", int(size))


def _check_native(recipe: Any) -> None:
  native = recipe.native
  if native is not None and not isinstance(native, (bool, np.bool_)):
    raise ValueError(f"`native` must be None, True or False, got {native!r}.")
  object.__setattr__(recipe, "native", None if native is None else bool(native))


@dataclasses.dataclass(frozen=True)
class MXFP8Matmul:
  """MXFP8 for every matmul :func:`~optax_lossscale.autocast` rewrites.

  Each operand of each GEMM (forward, input gradient, weight gradient) in
  blocks of 32 along that GEMM's contraction: ``float8_e4m3fn`` elements
  rounded to nearest, a power-of-two scale per block rounded up
  (:func:`~optax_lossscale.block_quantize`), float32 accumulation.
  ``matmul="mxfp8"`` is ``MXFP8Matmul()``.

  Attributes:
    exclude: matmuls kept in the compute dtype: regular expressions
      searched in the matmul's module path (``"Transformer/block_0/Dense_1"``,
      from the jaxpr's name stack), or a callable taking that path. Module
      paths are Linen's: Flax NNX, Equinox and plain JAX have none (use
      ``keep``). A pattern that matches no matmul of the function is a
      warning when the function is traced.
    keep: structural roles kept in the compute dtype, found in the jaxpr
      however the model is written: ``"output"``, the output layer (a
      weight's matmul whose result reaches the function's outputs with no
      other matmul in between), and ``"embedding"``, a weight's
      matmul with a table the function also gathers rows from (a tied output
      layer, ``Embed.attend``). None by default.
    native: ``None``: a GEMM runs on the backend's block-scaled kernel
      (:func:`jax.nn.scaled_matmul` on a Blackwell GPU) once a probe of its
      shapes, run when first traced, gives the emulation's numbers, and is
      emulated otherwise; ``False``: always emulated (bfloat16 operands
      that hold the quantised values exactly, float32 accumulation);
      ``True``: native, or a ValueError when traced where that is not
      possible.
    attention: whether attention's matmuls run in the recipe too: batched
      products (``"bqhd,bkhd->bhqk"``) of two values the function computed,
      recognised by that structure, however they are written. Off by
      default, as :class:`~optax_lossscale.Float8Matmul`'s.
    min_size: matmuls with an M, K or N below it kept in the compute
      dtype, as :class:`~optax_lossscale.Float8Matmul`'s; 0 keeps none.
  """

  exclude: Any = ()
  native: bool | None = None
  attention: bool = False
  keep: tuple = ()
  min_size: int = 0
  fmt: ClassVar[str] = "mxfp8"

  def __post_init__(self):
    _check_native(self)
    _check_bool(self, "attention")
    check_keep(self)
    check_min_size(self)
    object.__setattr__(self, "exclude", check_exclude(self.exclude))


@dataclasses.dataclass(frozen=True)
class NVFP4Matmul:
  """NVFP4 for every matmul :func:`~optax_lossscale.autocast` rewrites.

  Each operand of each GEMM in blocks of 16 along that GEMM's contraction:
  ``float4_e2m1fn`` elements, a ``float8_e4m3fn`` scale per block and a
  float32 one per tensor (:func:`~optax_lossscale.block_quantize`), float32
  accumulation. ``matmul="nvfp4"`` is ``NVFP4Matmul()``.

  Attributes:
    random_hadamard: a 16 x 16 random Hadamard transform along the
      contraction of the weight gradient's two operands.
    stochastic_rounding: the output gradient's elements rounded
      stochastically (to nearest everywhere else, and everywhere when off).
    weight_2d: the weight (the right-hand operand) in 16 x 16 tiles, so the
      forward pass and the input gradient use the same quantised weight.
    seed: an integer (64 bits, signed); the random numbers are drawn from
      a key of all its bits, x64 on or off (``key(seed)`` for a seed in
      ``[0, 2**32)``), folded with a hash of each output gradient.
    exclude: matmuls kept in the compute dtype by module path, as
      :class:`MXFP8Matmul`'s; none by default.
    keep: structural roles kept in the compute dtype, as
      :class:`MXFP8Matmul`'s; by default the output layer and the embeddings
      (``("output", "embedding")``), as the NVFP4 recipe keeps them.
    native: as :class:`MXFP8Matmul`'s. The two scales per tensor multiply
      the GEMM's float32 result, as a native kernel's epilogue does.
    attention: as :class:`MXFP8Matmul`'s; off by default: the NVFP4 recipe
      keeps attention's matmuls in the compute dtype.
    min_size: as :class:`MXFP8Matmul`'s.
  """

  random_hadamard: bool = True
  stochastic_rounding: bool = True
  weight_2d: bool = True
  seed: int = 0
  exclude: Any = ()
  native: bool | None = None
  attention: bool = False
  keep: tuple = NVFP4_KEEP
  min_size: int = 0
  fmt: ClassVar[str] = "nvfp4"

  def __post_init__(self):
    _check_native(self)
    for f in ("random_hadamard", "stochastic_rounding", "weight_2d", "attention"):
      _check_bool(self, f)
    if not isinstance(self.seed, (int, np.integer)) or isinstance(self.seed, bool):
      raise ValueError(f"`seed` must be an int, got {self.seed!r}.")
    if not -(2**63) <= int(self.seed) < 2**63:  # what jax.random.key takes
      raise ValueError(f"`seed` must fit in 64 bits (signed), got {self.seed!r}.")
    check_keep(self)
    check_min_size(self)
    object.__setattr__(self, "exclude", check_exclude(self.exclude))


def _check_bool(recipe: Any, field: str) -> None:
  value = getattr(recipe, field)
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"`{field}` must be a bool, got {value!r}.")
  object.__setattr__(recipe, field, bool(value))


def excluded(recipe: Any, path: str) -> bool:
  """Whether ``recipe`` keeps the matmul at module path ``path`` as it is."""
  return kept(recipe, path) is not None


def kept(recipe: Any, path: str, roles=(), dims=None) -> str | None:
  """Why ``recipe`` keeps the matmul at module path ``path`` (structural
  ``roles``; ``dims``, its ``(M, K, N)``) in the compute dtype:
  ``"output"``, ``"embedding"``, ``"exclude <pattern>"``, ``"exclude"``
  (a callable's), ``"small"`` (a dimension below ``recipe.min_size``);
  ``None`` if not."""
  role = next((r for r in getattr(recipe, "keep", ()) if r in roles), None)
  if role is not None:
    return role
  exclude = getattr(recipe, "exclude", ())
  if callable(exclude):
    if exclude(path):
      return "exclude"
  else:
    found = next((f"exclude {p}" for p in exclude if re.search(p, path)), None)
    if found is not None:
      return found
  if dims is not None and min(dims) < recipe.min_size:
    return "small"
  return None


def _hadamard16(seed: int = 0x5EED) -> np.ndarray:
  """A 16 x 16 orthonormal random Hadamard matrix: ``H16 D / 4``, fixed signs."""
  h = np.array([[1.0]])
  for _ in range(4):
    h = np.block([[h, h], [h, -h]])
  signs = np.random.default_rng(seed).choice([-1.0, 1.0], 16)
  return (h * signs / 4.0).astype(np.float32)


def _rotate(x: jax.Array, axis: int) -> jax.Array:
  """``x`` with each run of 16 along ``axis`` multiplied by the Hadamard
  matrix (the axis zero-padded to a multiple of 16)."""
  x = jnp.moveaxis(x, axis, -1)
  n = x.shape[-1]
  pad = -n % 16
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  blocks = x.reshape(*x.shape[:-1], x.shape[-1] // 16, 16)
  out = jnp.einsum(
    "...j,jk->...k", blocks, jnp.asarray(_hadamard16()), precision=lax.Precision.HIGHEST
  )
  return jnp.moveaxis(out.reshape(x.shape), -1, axis)


def _key(recipe: NVFP4Matmul, g: jax.Array) -> jax.Array:
  """The step's key: ``key(recipe.seed)`` folded with a 32-bit hash of ``g``'s bits."""
  bits = lax.bitcast_convert_type(_tree.widen(g).astype(_F32), jnp.uint32)
  mixed = bits * jnp.uint32(0x9E3779B1) + jnp.arange(
    bits.size, dtype=jnp.uint32
  ).reshape(bits.shape)
  return jax.random.fold_in(_seed_key(recipe.seed), jnp.sum(mixed, dtype=jnp.uint32))


def _seed_key(seed: int) -> jax.Array:
  """``key(seed)`` of all 64 bits of ``seed``, x64 on or off: its low 32
  bits, folded with its high 32 bits unless they are 0 (``key(2**40)``
  without x64 keeps only the low bits, and would be ``key(0)``)."""
  seed = int(seed) % 2**64
  key = jax.random.key(seed % 2**32)
  high = seed >> 32
  return key if high == 0 else jax.random.fold_in(key, high)


def _q(x: jax.Array, axis: int, recipe: Any, *, tile_axis=None, key=None):
  """``x`` quantised along ``axis``: a GEMM's operand."""
  return _quantized(x, key, axis, recipe.fmt, tile_axis)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def _quantized(x, key, axis, fmt, tile_axis):
  """The rounding, not differentiable in forward mode: a ``jvp`` or
  ``jax.hessian`` raises instead of sending tangents through it."""
  return _block_scaled.block_quantize(x, fmt, axis, tile_axis=tile_axis, key=key)


@_quantized.defjvp
def _quantized_jvp(axis, fmt, tile_axis, primals, tangents):
  del axis, tile_axis, primals, tangents
  raise NotImplementedError(
    f"{fmt} matmuls (autocast(..., matmul={fmt!r})) can be differentiated in "
    "reverse mode once (jax.grad, jax.vjp), not in forward mode (jax.jvp, "
    "jax.hessian, a jvp of a gradient)."
  )


def _canonical(lhs, rhs, dimension_numbers):
  """``(B, M, K)`` and ``(B, K, N)`` views, and how to undo them."""
  (lc, rc), (lb, rb) = ((tuple(c) for c in dn) for dn in dimension_numbers)
  lf = tuple(d for d in range(lhs.ndim) if d not in lc and d not in lb)
  rf = tuple(d for d in range(rhs.ndim) if d not in rc and d not in rb)
  size = lambda x, dims: math.prod(x.shape[d] for d in dims)  # noqa: E731
  B, M, K, N = size(lhs, lb), size(lhs, lf), size(lhs, lc), size(rhs, rf)
  lorder, rorder = (*lb, *lf, *lc), (*rb, *rc, *rf)
  a = lax.transpose(lhs, lorder).reshape(B, M, K)
  b = lax.transpose(rhs, rorder).reshape(B, K, N)
  out_shape = (
    *(lhs.shape[d] for d in lb),
    *(lhs.shape[d] for d in lf),
    *(rhs.shape[d] for d in rf),
  )

  def back(x, operand, order):
    shaped = x.reshape(tuple(operand.shape[d] for d in order))
    return lax.transpose(shaped, tuple(np.argsort(order)))

  return (
    a,
    b,
    out_shape,
    (lambda da: back(da, lhs, lorder)),
    (lambda db: back(db, rhs, rorder)),
  )


def dot_general(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers: Any,
  out_dtype: Any,
  recipe: Any,
  *,
  out_sharding: Any = None,
) -> jax.Array:
  """``lax.dot_general(lhs, rhs, dimension_numbers)`` in ``recipe``'s format.

  Forward and backward as the module describes; the result in
  ``out_dtype``, the cotangents in the operands' dtypes. Under explicit
  sharding the operands are gathered (each device computes the whole
  product, so the blocks are those of one device) and the result takes the
  sharding the ``dot_general`` would give it (``out_sharding``, or JAX's);
  the cotangents take the operands'.
  """
  if any(_tree.explicit_spec(x) is not None for x in (lhs, rhs)):
    kwargs = {} if out_sharding is None else {"out_sharding": out_sharding}
    want = jax.eval_shape(
      lambda a, b: lax.dot_general(a, b, dimension_numbers, **kwargs), lhs, rhs
    )
    whole = jax.sharding.PartitionSpec()
    out = _dot_general(
      jax.sharding.reshard(lhs, whole),
      jax.sharding.reshard(rhs, whole),
      dimension_numbers,
      out_dtype,
      recipe,
    )
    return jax.sharding.reshard(out, want.sharding.spec)
  return _dot_general(lhs, rhs, dimension_numbers, out_dtype, recipe)


def _dot_general(lhs, rhs, dimension_numbers, out_dtype, recipe):
  """:func:`dot_general` on operands whose types name no mesh axis."""
  nv = recipe.fmt == "nvfp4"
  tiles = nv and recipe.weight_2d
  gemm = functools.partial(_block_gemm.gemm, native=recipe.native)

  def weight(b, axis):  # (B, K, N) along K (forward) or N (input gradient)
    if tiles:
      return _q(b, axis, recipe, tile_axis=3 - axis)
    return _q(b, axis, recipe)

  @jax.custom_vjp
  def product(a, b):
    return _forward(a, b)[0]

  def _forward(a, b):
    a3, b3, out_shape, _, _ = _canonical(a, b, dimension_numbers)
    y = gemm(_q(a3, 2, recipe), weight(b3, 1))  # (B, M, N)
    return y.reshape(out_shape).astype(out_dtype), (a, b)

  def _backward(saved, g):
    a, b = saved
    a3, b3, _, back_a, back_b = _canonical(a, b, dimension_numbers)
    g3 = g.reshape(a3.shape[0], a3.shape[1], b3.shape[2])
    key = _key(recipe, g3) if nv and recipe.stochastic_rounding else None
    k1, k2 = (None, None) if key is None else tuple(jax.random.split(key))
    # input gradient dy wᵀ: contract N
    dg = _q(g3, 2, recipe, key=k1) if nv else _q(g3, 2, recipe)
    da = gemm(dg, weight(b3, 2))  # (B, M, K)
    # weight gradient xᵀ dy: contract M (the Hadamard transform along it)
    x, dy = a3, g3
    if nv and recipe.random_hadamard:
      x, dy = (_rotate(_tree.widen(v).astype(_F32), 1) for v in (x, dy))
    dyq = _q(dy, 1, recipe, key=k2) if nv else _q(dy, 1, recipe)
    db = gemm(_q(x, 1, recipe), dyq)  # (B, K, N)
    return back_a(da).astype(a.dtype), back_b(db).astype(b.dtype)

  product.defvjp(_forward, _backward)
  return product(lhs, rhs)


def as_block_recipe(matmul: Any) -> MXFP8Matmul | NVFP4Matmul | None:
  """``"mxfp8"``/``"nvfp4"`` or a recipe object as a recipe; else ``None``."""
  if isinstance(matmul, (MXFP8Matmul, NVFP4Matmul)):
    return matmul
  if isinstance(matmul, str) and matmul in ("mxfp8", "nvfp4"):
    _block_scaled.format_spec(matmul)  # a clear error on a JAX without the dtypes
    return MXFP8Matmul() if matmul == "mxfp8" else NVFP4Matmul()
  return None
