"""float8 matmuls with current per-tensor scaling: quantise, multiply, rescale.

Loss scaling moves a whole backward pass into float16's range with one
scale; float8 is narrower still, so each matmul input gets its own scale,
from its current largest magnitude (amax): ``scale = float8 max / amax``.
The forward pass quantises both inputs to ``float8_e4m3fn``; the backward
pass quantises the output gradient to ``float8_e5m2`` (more range, less
precision) and reuses the saved float8 inputs. Every product accumulates in
float32 and is rescaled by the inverse scales.

The spelling is the one XLA's GPU backend turns into one cuBLASLt float8
GEMM on Hopper (``gemm_rewriter``): a ``dot_general`` whose operands are
float8 arrays (e4m3 x e4m3 forward, e5m2 x e4m3 backward), its result in
float32 (or bfloat16 with power-of-two scales), multiplied directly by one
scalar (the product of the inverse scales), which XLA folds into the GEMM.
Elsewhere (CPU) XLA converts the operands to float32 and multiplies in
float32: the numbers are those of float8, the speed is not.

Hopper's float8 GEMMs can accumulate with fewer bits than float32 (cuBLASLt's
fast accumulation, which XLA asks for when a float8 dot has the default
precision). The forward product does (its contractions are a layer's
width); the two gradient products, whose contraction in the weight's
gradient runs over every token of the batch, ask for
``lax.Precision.HIGHEST`` and accumulate in float32, as TransformerEngine's
and Flax's float8 recipes do (:attr:`Float8Matmul.fast_accumulation`).

A tiny matmul is the exception. XLA's GPU backend leaves a dot with
``(M + N) * K`` under 100 (its ``xla_gpu_gemm_rewrite_size_threshold``)
out of cuBLAS. It then widens float8 operands to float16 and multiplies in
float16, so a product past 65504 (448 x 448 is 200704) becomes inf. Such a
matmul (:func:`small`, with a margin of 10; each device's part under
explicit sharding) gets its float8 operands converted to float32 here.
That is exact: the products of float8 values are exact in float32, as in
the float8 GEMM.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_lossscale._base import dtypes as _dtypes
from optax_lossscale._base import tree as _tree
from optax_lossscale._lowbit import block_matmul as _block_matmul
from optax_lossscale._lowbit import exact as _exact

__all__ = ["Float8Matmul", "as_recipe", "current_scale", "dot_general", "quantize"]

#: Scales are clamped to at most this (2**63), so that the product of two
#: inverse scales is a normal float32 (>= 2**-126).
MAX_SCALE = 2.0**63

#: The float8 formats a recipe may use: signed, with a zero
#: (``float8_e8m0fnu``, a scale format, has neither).
_RECIPE_DTYPES = tuple(
  jnp.dtype(getattr(jnp, name))
  for name in (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3b11fnuz",
    "float8_e4m3",
    "float8_e3m4",
  )
  if hasattr(jnp, name)
)


#: :attr:`Float8Matmul.fast_accumulation`'s values.
_FAST = ("forward", "all", "none")


@dataclasses.dataclass(frozen=True)
class Float8Matmul:
  """How :func:`~optax_lossscale.autocast` runs matmuls in float8.

  Each ``dot_general`` with floating operands (but attention's, unless
  ``attention``) becomes a float8 matmul with current per-tensor scaling:
  both inputs are quantised to ``forward_dtype`` with
  ``scale = max(forward_dtype) / amax``, multiplied
  with float32 accumulation and rescaled; in the backward pass the output
  gradient is quantised to ``backward_dtype`` and multiplied with the saved
  float8 inputs. An amax of zero or one that is not finite gives scale 1: a
  tensor that is not finite stays not finite (its gradients are too, and a
  loss scale skips the step). ``matmul="float8"`` is ``Float8Matmul()``.

  Attributes:
    forward_dtype: the dtype of the forward inputs (and the saved ones).
    backward_dtype: the dtype of the output gradient.
    power_of_two: round each scale down to a power of two, so scaling and
      rescaling are exact (the quantisation uses at most one bit less of the
      range). A bfloat16 result then comes out of the matmul itself, with
      the rescale folded into it on GPUs; otherwise the product is rescaled
      in float32 and converted, which costs one more pass over the result
      but biases no entry (a bfloat16 copy of a scale that is not a power
      of two would bias them all alike).
    attention: whether attention's matmuls run in float8 too: batched
      products of two values the function computed (``"bqhd,bkhd->bhqk"``),
      recognised by that structure, however they are written. Off by
      default, as in torchao's and TransformerEngine's recipes: quantising
      the scores (batch x heads x queries x keys) and their gradient moves
      more memory than their float8 GEMMs save (BENCHMARKS.md).
    fast_accumulation: which products may use a GPU's fast float8
      accumulation (fewer bits than float32, faster): ``"forward"`` (the
      default: the forward product; the gradient products, whose
      contraction in the weight's gradient runs over every token, accumulate
      in float32), ``"all"`` or ``"none"``. The others are computed with
      ``lax.Precision.HIGHEST``. A CPU accumulates in float32 either way.
    exclude: matmuls kept in the compute dtype, by module path, as
      :class:`~optax_lossscale.MXFP8Matmul`'s: regular expressions searched
      in the matmul's module path, or a callable taking that path.
    keep: structural roles kept in the compute dtype, as
      :class:`~optax_lossscale.MXFP8Matmul`'s: ``"output"``, the output
      layer, and ``"embedding"``, a matmul with a table the function also
      gathers rows from. None by default.
    min_size: a matmul whose M, K or N (:func:`gemm_dims`, of one device's
      part) is below it stays in the compute dtype, listed as kept
      ``"small"``: its float8 GEMM saves less than quantising its operands
      costs. 0 (the default) keeps none. The shapes are those of the
      function autocast wraps: under ``jax.vmap(ols.autocast(f))``, one
      example's (wrap the batched function instead).
  """

  forward_dtype: Any = jnp.float8_e4m3fn
  backward_dtype: Any = jnp.float8_e5m2
  power_of_two: bool = False
  attention: bool = False
  fast_accumulation: str = "forward"
  exclude: Any = ()
  keep: tuple = ()
  min_size: int = 0
  fmt: ClassVar[str] = "float8"

  def __post_init__(self):
    for field in ("forward_dtype", "backward_dtype"):
      dtype = _dtypes.float_dtype(field, getattr(self, field), allowed=_RECIPE_DTYPES)
      object.__setattr__(self, field, dtype)
    for field in ("power_of_two", "attention"):
      if not isinstance(getattr(self, field), (bool, np.bool_)):
        raise ValueError(f"`{field}` must be a bool, got {getattr(self, field)!r}.")
    if not (
      isinstance(self.fast_accumulation, str) and self.fast_accumulation in _FAST
    ):
      raise ValueError(
        f"`fast_accumulation` must be one of {', '.join(map(repr, _FAST))}, got "
        f"{self.fast_accumulation!r}."
      )
    _block_matmul.check_keep(self)
    object.__setattr__(self, "exclude", _block_matmul.check_exclude(self.exclude))
    _block_matmul.check_min_size(self)

  def precision(self, backward: bool) -> Any:
    """The ``precision`` of a forward (``backward=False``) or gradient
    product: ``None`` (the default, which lets a GPU accumulate fast) or
    ``lax.Precision.HIGHEST``."""
    fast = self.fast_accumulation == "all" or (
      self.fast_accumulation == "forward" and not backward
    )
    return None if fast else lax.Precision.HIGHEST


def as_recipe(matmul: Any) -> Any:
  """``autocast``'s ``matmul`` argument as a recipe (``None``: none): a
  :class:`Float8Matmul`, or a block-scaled ``MXFP8Matmul``/``NVFP4Matmul``."""
  if matmul is None or isinstance(matmul, Float8Matmul):
    return matmul
  if isinstance(matmul, str) and matmul == "float8":
    return Float8Matmul()
  block = _block_matmul.as_block_recipe(matmul)
  if block is not None:
    return block
  raise ValueError(
    "`matmul` must be None, 'float8', 'mxfp8', 'nvfp4', or an ols.Float8Matmul, "
    f"ols.MXFP8Matmul or ols.NVFP4Matmul, got {matmul!r}."
  )


def current_scale(amax: jax.Array, dtype: Any, power_of_two: bool = False) -> jax.Array:
  """The float32 scale that maps ``amax`` to ``dtype``'s largest value.

  ``max(dtype) / amax``, clamped to at most 2**63; 1 where ``amax`` is zero
  or not finite; with ``power_of_two``, the largest power of two not above.
  """
  amax = jnp.asarray(amax, jnp.float32)
  fmax = jnp.float32(jnp.finfo(dtype).max)
  usable = (amax > 0) & jnp.isfinite(amax)
  scale = jnp.where(usable, fmax / jnp.where(usable, amax, 1), 1)
  scale = jnp.minimum(scale, jnp.float32(MAX_SCALE))
  if power_of_two:
    mantissa, exponent = jnp.frexp(scale)  # scale = mantissa * 2**exponent
    del mantissa
    scale = jnp.ldexp(jnp.float32(1), exponent - 1)
  return scale


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def quantize(x: jax.Array, dtype: Any, power_of_two: bool = False):
  """``x`` in float8 with its current per-tensor scale: ``(q, 1 / scale)``.

  ``q = float8(x * scale)`` approximates ``x * scale``; ``q * (1 / scale)``
  approximates ``x``. No clipping: ``|x| * scale <= max(dtype)`` by
  construction, and a value that is not finite stays so (``float8_e4m3fn``
  has no infinity: it becomes NaN). Not differentiable in forward mode, so
  that ``jax.hessian`` or a ``jvp`` of a gradient of a float8 matmul raises
  instead of sending tangents through an unscaled float8 cast. A half
  ``x`` is read at its own precision (``_tree.widen``), never at the
  float32 precision XLA may have computed it in before rounding.
  """
  x32 = _tree.widen(x).astype(jnp.float32)
  scale = current_scale(jnp.max(jnp.abs(x32), initial=0.0), dtype, power_of_two)
  return (x32 * scale).astype(dtype), 1 / scale


@quantize.defjvp
def _quantize_jvp(dtype, power_of_two, primals, tangents):
  del dtype, power_of_two, primals, tangents
  raise NotImplementedError(
    "float8 matmuls (autocast(..., matmul='float8')) can be differentiated in "
    "reverse mode once (jax.grad, jax.vjp), not in forward mode (jax.jvp, "
    "jax.hessian, a jvp of a gradient)."
  )


def _product_dtype(out_dtype, exact_scale: bool) -> jnp.dtype:
  """The matmul's result type, before the conversion to ``out_dtype``.

  ``out_dtype`` itself when the rescaling is exact in it: float32, or
  bfloat16 with power-of-two scales (XLA then folds the whole rescale into
  the GEMM). Otherwise float32, converted after the rescaling: a bfloat16
  copy of a scale that is not a power of two would bias every entry the
  same way, and the unscaled float8 product (up to ``max**2`` times the
  contraction length) overflows float16.
  """
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype == jnp.float32 or (exact_scale and jnp.finfo(out_dtype).maxexp >= 128):
    return out_dtype
  return jnp.dtype(jnp.float32)


#: XLA's GPU default ``xla_gpu_gemm_rewrite_size_threshold``, times a margin
#: for a larger flag: a float8 dot below it is multiplied in float32.
SMALL_DOT = 1000


def gemm_dims(lhs_shape, rhs_shape, dimension_numbers) -> tuple[int, int, int]:
  """``(M, K, N)`` of a dot: the products of the left operand's free axes,
  of the contracting axes and of the right operand's free axes (batch axes
  not counted, as XLA counts)."""
  (lc, rc), (lb, rb) = dimension_numbers
  k = math.prod(lhs_shape[d] for d in lc)
  m, n = (
    math.prod(d for i, d in enumerate(shape) if i not in c and i not in b)
    for shape, c, b in ((lhs_shape, lc, lb), (rhs_shape, rc, rb))
  )
  return m, k, n


def device_dims(lhs, rhs, dimension_numbers) -> tuple[int, int, int]:
  """:func:`gemm_dims` of the product one device computes of ``lhs`` and
  ``rhs`` (arrays or tracers: their parts under explicit sharding)."""
  return gemm_dims(_device_shape(lhs), _device_shape(rhs), dimension_numbers)


def small(lhs_shape, rhs_shape, dimension_numbers) -> bool:
  """Whether XLA's GPU backend may multiply this float8 dot in float16.

  ``(M + N) * K`` below :data:`SMALL_DOT` (:func:`gemm_dims`), or no
  operand with a free axis longer than 1 (a dot cuBLAS does not take).
  """
  m, k, n = gemm_dims(lhs_shape, rhs_shape, dimension_numbers)
  return (m + n) * k < SMALL_DOT or (m == 1 and n == 1)


def _scaled_dot(
  a,
  b,
  dimension_numbers,
  inverse_scale,
  out_dtype,
  exact_scale,
  out_sharding=None,
  precision=None,
):
  """``dot_general(a, b) * inverse_scale`` of float8 ``a``, ``b``, in ``out_dtype``.

  The product accumulates in float32 (fast on a GPU with ``precision``
  ``None``: :meth:`Float8Matmul.precision`) and comes out in ``out_dtype``;
  the one scalar multiplication directly on the result is what XLA's GPU
  backend folds into the cuBLASLt float8 GEMM. ``out_sharding`` is the
  product's, under explicit sharding (``None``: JAX's own).
  """
  pet = _product_dtype(out_dtype, exact_scale)
  kwargs = {} if out_sharding is None else {"out_sharding": out_sharding}
  if small(_device_shape(a), _device_shape(b), dimension_numbers):  # module docstring
    a, b = _exact.widen(a, jnp.float32), _exact.widen(b, jnp.float32)
  out = lax.dot_general(
    a, b, dimension_numbers, precision=precision, preferred_element_type=pet, **kwargs
  )
  return (out * inverse_scale.astype(pet)).astype(out_dtype)


def _device_shape(x: jax.Array) -> tuple[int, ...]:
  """The shape of ``x``'s part on one device, where its type says it.

  Under explicit sharding each device multiplies its own blocks, which can
  be tiny where the whole product is not. Under automatic sharding the
  partitioner decides after tracing, so this is the global shape (inside
  ``shard_map`` shapes are per device already).
  """
  spec = _tree.explicit_spec(x)
  if spec is None:
    return tuple(x.shape)
  sizes = jax.typeof(x).sharding.mesh.shape
  spec = spec + (None,) * (x.ndim - len(spec))
  return tuple(
    d // math.prod(sizes[a] for a in (() if axes is None else _names(axes)))
    for d, axes in zip(x.shape, spec, strict=True)
  )


def _names(axes: Any) -> tuple:
  """A partition spec entry's mesh axes: one name or a tuple of them."""
  return axes if isinstance(axes, tuple) else (axes,)


def _sharding_of(x: jax.Array, order: list[int] | None = None) -> Any:
  """``x``'s sharding, its axes in ``order``, when its type names mesh axes.

  ``None`` without explicit sharding (JAX then chooses, as for any matmul).
  """
  spec = _tree.explicit_spec(x)
  if spec is None:
    return None
  spec = tuple(spec) + (None,) * (x.ndim - len(spec))
  if order is not None:
    spec = tuple(spec[i] for i in order)
  return jax.sharding.NamedSharding(
    jax.typeof(x).sharding.mesh, jax.sharding.PartitionSpec(*spec)
  )


def _transpose(
  g,
  other,
  dimension_numbers,
  shapes,
  wrt,
  scale,
  out_dtype,
  exact,
  operand=None,
  precision=None,
):
  """The cotangent of operand ``wrt`` (0: lhs, 1: rhs) of a ``dot_general``.

  ``g`` is the output's cotangent and ``other`` the other operand. The
  output of ``dot_general`` is laid out as (batch, lhs free, rhs free).
  Contracting ``g``'s free axes of ``other`` with ``other``'s free axes,
  the product keeps the forward's operand order (``g . rhs`` for the left
  operand, ``lhs . g`` for the right), which leaves (batch, free axes of
  ``wrt``, contracting axes of ``other`` in ascending order) for the left
  and (batch, contracting axes of ``other``, free axes of ``wrt``) for the
  right; a transpose puts them in operand ``wrt``'s order.
  ``operand`` (the float8 operand ``wrt``) gives the cotangent its sharding
  under explicit sharding; ``precision`` is the product's.
  """
  (lc, rc), (lb, rb) = ((list(c) for c in dn) for dn in dimension_numbers)
  free = [
    [d for d in range(len(shape)) if d not in c and d not in b]
    for shape, c, b in zip(shapes, (lc, rc), (lb, rb), strict=True)
  ]
  # g's axes: (batch, lhs free, rhs free).
  nb, n0, n1 = len(lb), len(free[0]), len(free[1])
  batch = list(range(nb))
  g_free = [list(range(nb, nb + n0)), list(range(nb + n0, nb + n0 + n1))]
  contract = (lc, rc)
  mine, theirs = wrt, 1 - wrt
  contracted = [
    contract[mine][contract[theirs].index(d)] for d in sorted(contract[theirs])
  ]
  # The forward product's operand order kept: d lhs = g . rhs^T, d rhs =
  # lhs^T . g. In the other order XLA's GPU backend writes a float8 weight
  # gradient transposed, and the update then transposes it (BENCHMARKS.md).
  # `order`: operand `mine`'s axis for each axis of the product.
  if wrt == 0:
    operands = (g, other)
    dims = ((g_free[theirs], free[theirs]), (batch, (lb, rb)[theirs]))
    order = [*(lb, rb)[mine], *free[mine], *contracted]
  else:
    operands = (other, g)
    dims = ((free[theirs], g_free[theirs]), ((lb, rb)[theirs], batch))
    order = [*(lb, rb)[mine], *contracted, *free[mine]]
  out = _scaled_dot(
    *operands,
    dims,
    scale,
    out_dtype,
    exact,
    # Under explicit sharding: the cotangent sharded as its operand.
    out_sharding=None if operand is None else _sharding_of(operand, order),
    precision=precision,
  )
  return lax.transpose(out, tuple(np.argsort(order)))


def dot_general(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers: Any,
  out_dtype: Any,
  recipe: Float8Matmul,
  *,
  out_sharding: Any = None,
) -> jax.Array:
  """``lax.dot_general(lhs, rhs, dimension_numbers)`` as a float8 matmul.

  Forward: both operands quantised to ``recipe.forward_dtype`` with their
  current scales (:func:`quantize`), multiplied with float32 accumulation,
  rescaled, cast to ``out_dtype``. Backward (a ``custom_vjp``): the output
  gradient quantised to ``recipe.backward_dtype`` and multiplied with the
  saved float8 operands, each product rescaled; the cotangents have the
  operands' dtypes. Each product's ``precision`` is the recipe's
  (:meth:`Float8Matmul.precision`). Under explicit sharding the product has
  ``out_sharding`` (the ``dot_general``'s own) and each cotangent its
  operand's sharding.
  """
  pow2 = recipe.power_of_two
  shapes = (lhs.shape, rhs.shape)
  dtypes = (lhs.dtype, rhs.dtype)

  def forward(a, b):
    qa, ia = quantize(a, recipe.forward_dtype, pow2)
    qb, ib = quantize(b, recipe.forward_dtype, pow2)
    out = _scaled_dot(
      qa,
      qb,
      dimension_numbers,
      ia * ib,
      out_dtype,
      pow2,
      out_sharding,
      recipe.precision(backward=False),
    )
    return out, (qa, ia, qb, ib)

  @jax.custom_vjp
  def product(a, b):
    return forward(a, b)[0]

  def backward(saved, g):
    qa, ia, qb, ib = saved
    qg, ig = quantize(g, recipe.backward_dtype, pow2)
    precise = recipe.precision(backward=True)
    da = _transpose(
      qg, qb, dimension_numbers, shapes, 0, ig * ib, dtypes[0], pow2, qa, precise
    )
    db = _transpose(
      qg, qa, dimension_numbers, shapes, 1, ig * ia, dtypes[1], pow2, qb, precise
    )
    return da, db

  product.defvjp(forward, backward)
  return product(lhs, rhs)
