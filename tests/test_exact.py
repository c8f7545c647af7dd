"""Every widening of a float8 or float4 value passes an optimisation barrier.

XLA's GPU backend drops ``float32 -> float8 -> float32`` conversion pairs
when excess precision is allowed (its default), so an emulated float8,
MXFP8 or NVFP4 matmul would skip its rounding under jit there. The CPU
backend keeps the pairs, so these tests read the jaxprs instead: in each
entry point's traced step, every conversion from a type of at most 8 bits
to a wider float must take an ``optimization_barrier``'s result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jaxprs
import numpy as np
import pytest
import versions

import optax_lossscale as ols
from optax_lossscale._lowbit import exact


def _bits(dtype) -> int:
  return jnp.finfo(dtype).bits


def widenings(jaxpr) -> tuple[int, int]:
  """``(guarded, bare)``: the jaxpr's widening conversions of float8/float4
  values that take a barrier's result, and those that do not."""
  guarded = bare = 0
  barrier_outs = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "optimization_barrier":
      barrier_outs.update(id(v) for v in eqn.outvars)
    if eqn.primitive.name == "convert_element_type":
      src, dst = eqn.invars[0].aval.dtype, eqn.params["new_dtype"]
      if (
        jnp.issubdtype(src, jnp.floating)
        and jnp.issubdtype(dst, jnp.floating)
        and _bits(src) <= 8 < _bits(dst)
      ):
        if id(eqn.invars[0]) in barrier_outs:
          guarded += 1
        else:
          bare += 1
    for sub in jaxprs.sub_jaxprs(eqn.params):
      g, b = widenings(sub)
      guarded, bare = guarded + g, bare + b
  return guarded, bare


def _dense_loss(w, x):
  return jnp.sum(jnp.tanh(x @ w) ** 2)


def _autocast_grad(matmul, k):
  """The jit-compiled gradient of a dense layer of contraction ``k``."""
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((k, 32)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((16, k)), jnp.float32)
  f = ols.autocast(_dense_loss, compute_dtype=jnp.bfloat16, matmul=matmul)
  return jax.jit(jax.grad(f)), (w, x)


def _quantize_round_trip(fmt, rule, stochastic=False):
  x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 64)), jnp.float32)
  key = jax.random.key(0) if stochastic else None

  def f(x):
    q = ols.block_quantize(x, fmt, rule=rule, key=key)
    return q.dequantize()

  return jax.jit(f), (x,)


CASES = {
  # float8: a small dot is multiplied in float32 after widening its operands
  "float8, small dot": lambda: _autocast_grad("float8", 8),
  "mxfp8": lambda: _autocast_grad("mxfp8", 64),
  # (the lone layer is the output layer, which NVFP4 keeps by default)
  "nvfp4": lambda: _autocast_grad(ols.NVFP4Matmul(keep=()), 64),
  "nvfp4, stochastic gradients": lambda: _autocast_grad(
    ols.NVFP4Matmul(stochastic_rounding=True, keep=()), 64
  ),
  "mxfp8 round_up round trip": lambda: _quantize_round_trip("mxfp8", "round_up"),
  "mxfp8 ocp round trip": lambda: _quantize_round_trip("mxfp8", "ocp"),
  "nvfp4 divide round trip": lambda: _quantize_round_trip("nvfp4", "divide"),
  "nvfp4 transformer_engine round trip": lambda: _quantize_round_trip(
    "nvfp4", "transformer_engine"
  ),
  "nvfp4 stochastic round trip": lambda: _quantize_round_trip(
    "nvfp4", "divide", stochastic=True
  ),
}


def _marked(case):
  """Every case but the float8 one needs the block-scaled formats' dtypes."""
  marks = () if case.startswith("float8") else (versions.block_formats,)
  return pytest.param(case, marks=marks)


@pytest.mark.parametrize("case", [_marked(c) for c in CASES])
def test_every_widening_of_a_quantised_value_is_behind_a_barrier(case):
  f, args = CASES[case]()
  guarded, bare = widenings(jax.make_jaxpr(f)(*args).jaxpr)
  assert bare == 0, f"{case}: {bare} widening conversions without a barrier"
  assert guarded > 0, f"{case}: no widening found (is the walk blind?)"


def test_the_walk_sees_a_bare_pair():
  """The check itself: a plain round trip is found and counted as bare."""

  def f(x):
    return x.astype(jnp.float8_e4m3fn).astype(jnp.float32)

  assert widenings(jax.make_jaxpr(jax.jit(f))(jnp.ones(4)).jaxpr) == (0, 1)
  g = lambda x: exact.widen(x.astype(jnp.float8_e4m3fn), jnp.float32)  # noqa: E731
  assert widenings(jax.make_jaxpr(jax.jit(g))(jnp.ones(4)).jaxpr) == (1, 0)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_widen_keeps_the_stored_value_and_gradients_flow(jit):
  x = jnp.array([0.3, 500.0, jnp.inf, -jnp.inf, jnp.nan, 1e-3], jnp.float32)
  f = lambda x: exact.widen(x.astype(jnp.float8_e4m3fn), jnp.float32)  # noqa: E731
  got = (jax.jit(f) if jit else f)(x)
  want = np.asarray(x).astype(jnp.float8_e4m3fn).astype(np.float32)
  np.testing.assert_array_equal(got, want)  # 0.3125, NaN for the overflows
  np.testing.assert_array_equal(jax.vmap(f)(x), want)
  # The barrier is transparent to differentiation: d/dx of the round trip is 1.
  loss = lambda x: jnp.sum(f(x))  # noqa: E731
  np.testing.assert_array_equal(jax.grad(loss)(x[:1]), [1.0])
  np.testing.assert_array_equal(jax.vmap(jax.grad(loss))(x[:2, None]), [[1.0], [1.0]])
