"""Widening a float8 or float4 value as it is stored, whatever XLA rewrites.

XLA may drop a narrowing conversion whose result is widened again: with
excess precision allowed (``--xla_allow_excess_precision``, on by default),
its GPU backend turns ``float32 -> float8 -> float32`` into the identity. A
quantised value then keeps its float32 bits, an infinity stays infinite
where ``float8_e4m3fn`` holds a NaN, and a jit-compiled emulation of a
float8, MXFP8 or NVFP4 matmul computes other numbers than the same code run
eagerly. Every widening of a quantised value in this package goes through
:func:`widen`, whose optimisation barrier keeps the two conversions apart.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax import lax
from jax.interpreters import ad, batching


def widen(x: jax.Array, dtype: Any) -> jax.Array:
  """``x`` converted to the wider ``dtype`` from the value ``x`` holds.

  Never from the value ``x`` was rounded from: XLA cannot fold the
  conversion into the one that made ``x``. The barrier costs one stored copy
  of ``x`` in its own (narrow) dtype where XLA would otherwise have fused
  both conversions into one loop.

  >>> import jax, jax.numpy as jnp
  >>> f = jax.jit(lambda x: widen(x.astype(jnp.float8_e4m3fn), jnp.float32))
  >>> f(jnp.float32(0.3))  # float8_e4m3fn's nearest value, also on a GPU
  Array(0.3125, dtype=float32)
  """
  _complete_barrier_rules()
  return lax.optimization_barrier(x).astype(dtype)


@functools.cache
def _complete_barrier_rules() -> None:
  """Give the barrier the vmap and derivative rules older JAX lacks.

  JAX 0.4.35, the oldest release this package supports, lowers
  ``optimization_barrier`` but cannot batch or differentiate it; later
  releases register exactly these rules (the barrier of the batched values,
  of the tangents, of the cotangents), and there nothing is changed.
  """
  barrier = jax.make_jaxpr(lax.optimization_barrier)(0.0).eqns[0].primitive

  def batch(args, dims, **params):
    return barrier.bind(*args, **params), dims

  def jvp(primals, tangents):
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    return lax.optimization_barrier(primals), lax.optimization_barrier(tangents)

  def transpose(cts, *primals):
    return lax.optimization_barrier([ad.instantiate_zeros(ct) for ct in cts])

  if barrier not in ad.primitive_jvps:  # then it has none of the three
    batching.primitive_batchers[barrier] = batch
    ad.primitive_jvps[barrier] = jvp
    ad.primitive_transposes[barrier] = transpose
