"""The block-scaled GEMM: native where it agrees, the emulation elsewhere.

On a backend without a native block-scaled GEMM (this one, unless it is a
Blackwell GPU), ``native=True`` is refused by name and ``None`` emulates.
The dispatch itself is tested here by standing JAX's ``lax.scaled_dot``
(the composite XLA replaces with a native kernel where it has one, and
decomposes elsewhere) in for :func:`jax.nn.scaled_matmul`: the operands
and block scales the native path lays out ``(B, rows, K)`` give the
emulation's numbers for every recipe, layout and GEMM; a stand-in that
gives other numbers, or fails, is caught by the probe and not used. Where a
native kernel exists, the last test compares it with the emulation.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import versions
from jax import lax
from jaxprs import eqns as all_eqns
from test_block_matmul import LAYOUTS, RECIPES, assert_close, operands, three_gemms

import optax_lossscale as ols
from optax_lossscale._lowbit import block_gemm as _block_gemm
from optax_lossscale._lowbit import block_matmul as _block_matmul

pytestmark = versions.block_formats
has_scaled_dot = pytest.mark.skipif(
  not hasattr(lax, "scaled_dot"), reason="this JAX has no lax.scaled_dot"
)
CANONICAL = (((2,), (2,)), ((0,), (0,)))  # (B, M, K) x (B, N, K) -> (B, M, N)


def scaled_dot(lhs, rhs, lhs_scales, rhs_scales):
  return lax.scaled_dot(
    lhs,
    rhs,
    lhs_scale=lhs_scales,
    rhs_scale=rhs_scales,
    dimension_numbers=CANONICAL,
    preferred_element_type=jnp.float32,
  )


def ignores_scales(lhs, rhs, lhs_scales, rhs_scales):
  del lhs_scales, rhs_scales
  return lax.dot_general(lhs.astype(jnp.float32), rhs.astype(jnp.float32), CANONICAL)


def zero_blocks_are_nan(lhs, rhs, lhs_scales, rhs_scales):
  """Reads an all-zero block's scale (bits 0) as NaN."""

  def spoil(s):
    bits = lax.bitcast_convert_type(s, jnp.uint8)
    nan = np.uint8(0xFF if s.dtype == jnp.float8_e8m0fnu else 0x7F)
    return lax.bitcast_convert_type(jnp.where(bits == 0, nan, bits), s.dtype)

  return scaled_dot(lhs, rhs, spoil(lhs_scales), spoil(rhs_scales))


def fails(*args):
  raise RuntimeError("no kernel for these shapes")


@pytest.fixture
def stand_in(monkeypatch):
  """Makes this backend look native, with the given function as the kernel."""

  def use(fn):
    _block_gemm._VERDICTS.clear()
    monkeypatch.setattr(_block_gemm, "native_backend", lambda: True)
    monkeypatch.setattr(_block_gemm, "_native_matmul", fn)

  yield use
  _block_gemm._VERDICTS.clear()


def _primitives(jaxpr):
  return {e.primitive.name for e in all_eqns(jaxpr)}


def _three_gemms(recipe, layout, seed=0):
  """(y, dx, dw) of the layout's dot_general in ``recipe``, and the jaxpr."""
  x, w, g = operands(layout, seed)
  traced = jax.jit(three_gemms(recipe, layout)).trace(x, w, g)
  return traced.lower().compile()(x, w, g), traced.jaxpr.jaxpr


@pytest.mark.skipif(_block_gemm.native_backend(), reason="this backend has one")
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_native_true_is_refused_without_a_native_gemm(fmt):
  cls = ols.MXFP8Matmul if fmt == "mxfp8" else ols.NVFP4Matmul
  recipe = cls(native=True)
  with pytest.raises(ValueError, match=f"native=True: no native {fmt} GEMM.*has none"):
    _three_gemms(recipe, "plain")
  # None emulates: the jaxpr multiplies bfloat16 values with dot_general
  (y, _, _), jaxpr = _three_gemms(dataclasses.replace(recipe, native=None), "plain")
  assert "scaled_dot" not in _primitives(jaxpr) and np.isfinite(y).all()


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_native_must_be_none_or_a_bool(bad):
  for cls in (ols.MXFP8Matmul, ols.NVFP4Matmul):
    with pytest.raises(ValueError, match="`native` must be None, True or False"):
      cls(native=bad)


@pytest.mark.sampled
@has_scaled_dot
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_native_layout_gives_the_emulations_numbers(stand_in, recipe, layout):
  r = RECIPES[recipe]
  emulated, jaxpr = _three_gemms(dataclasses.replace(r, native=False), layout)
  assert "scaled_dot" not in _primitives(jaxpr)
  stand_in(scaled_dot)
  got, jaxpr = _three_gemms(dataclasses.replace(r, native=None), layout)
  assert "scaled_dot" in _primitives(jaxpr)  # dispatched
  for a, b in zip(got, emulated, strict=True):
    assert_close(a, b)
  # native=True is the same program (the probe's verdict kept): the same numbers
  f = three_gemms(dataclasses.replace(r, native=True), layout)
  assert str(jax.make_jaxpr(f)(*operands(layout)).jaxpr) == str(jaxpr)


@has_scaled_dot
def test_the_probe_is_run_once_per_layout(stand_in):
  calls = []

  def counted(*args):
    calls.append(1)
    return scaled_dot(*args)

  stand_in(counted)
  r = ols.NVFP4Matmul(stochastic_rounding=False)
  _three_gemms(r, "plain")
  first = len(calls)
  assert len(_block_gemm._VERDICTS) == 3  # forward, input gradient, weight gradient
  _three_gemms(r, "plain", seed=1)  # other values, the same shapes
  second = len(calls) - first
  assert second > 0  # the three GEMMs traced again
  assert first == second + 3 * 2  # and the probes ran once: finite, then a NaN


@has_scaled_dot
def test_a_failed_probe_is_tried_again(stand_in):
  failed = []

  def fails_once(*args):
    if not failed:
      failed.append(1)
      raise RuntimeError("out of memory")
    return scaled_dot(*args)

  stand_in(fails_once)
  r = ols.MXFP8Matmul()
  _, jaxpr = _three_gemms(r, "plain")
  assert len(_block_gemm._VERDICTS) == 2  # the failure is not kept
  _, jaxpr = _three_gemms(r, "plain")
  assert len(_block_gemm._VERDICTS) == 3
  assert "scaled_dot" in _primitives(jaxpr)


@has_scaled_dot
@pytest.mark.parametrize("cls", [ols.MXFP8Matmul, ols.NVFP4Matmul])
def test_numpy_bools_are_bools(stand_in, cls):
  stand_in(scaled_dot)
  assert cls(native=np.False_).native is False and cls(native=np.True_).native is True
  _, jaxpr = _three_gemms(cls(native=np.False_), "plain")
  assert "scaled_dot" not in _primitives(jaxpr) and not _block_gemm._VERDICTS


@pytest.mark.parametrize("magnitude", [1e-17, 1e-3, 1e23])
def test_nvfp4_scales_per_tensor_at_extreme_magnitudes(magnitude):
  """The product of two operands' scales per tensor may not be a normal
  float32 where the result is: they multiply the result one at a time."""
  rng = np.random.default_rng(0)
  a = rng.standard_normal((1, 8, 64)) * magnitude
  a[0, 0] = 0.0  # a zero row gives zeros, not 0 * inf
  b = rng.standard_normal((1, 64, 16)) * magnitude

  @jax.jit
  def quantised_and_product(a, b):
    qa = ols.block_quantize(a, "nvfp4", 2)
    qb = ols.block_quantize(b, "nvfp4", 1)
    return qa.dequantize(), qb.dequantize(), _block_gemm.gemm(qa, qb, native=False)

  da, db, got = quantised_and_product(
    jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  )
  want = np.einsum(
    "bmk,bkn->bmn", np.asarray(da, np.float64), np.asarray(db, np.float64)
  )
  got = np.asarray(got, np.float64)
  assert np.all(got[0, 0] == 0.0) and np.all(got[0, 1:] != 0.0)
  finite = np.abs(want) < np.finfo(np.float32).max  # the rest overflow
  np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4)
  np.testing.assert_array_equal(got[~finite], np.sign(want[~finite]) * np.inf)


def test_a_tiny_nvfp4_gradient_reaches_the_weights():
  r = ols.NVFP4Matmul(stochastic_rounding=False, random_hadamard=False)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
  g = jnp.asarray(3e-33 * rng.standard_normal((64, 16)), jnp.float32)
  dn = (((1,), (0,)), ((), ()))

  @jax.jit
  def weight_gradient(x, w, g):
    _, vjp = jax.vjp(
      lambda x, w: _block_matmul.dot_general(x, w, dn, jnp.float32, r), x, w
    )
    return vjp(g)[1]

  dw = weight_gradient(x, w, g)
  exact = np.abs(np.asarray(x, np.float64).T @ np.asarray(g, np.float64))
  assert exact.max() > np.finfo(np.float32).tiny  # a normal float32 result
  assert np.count_nonzero(np.asarray(dw)) == dw.size


@pytest.mark.sampled
@pytest.mark.parametrize(
  "kernel, why",
  [
    (ignores_scales, "numbers differ"),
    pytest.param(zero_blocks_are_nan, "numbers differ", marks=has_scaled_dot),
    (fails, "RuntimeError: no kernel"),
  ],
)
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4 2d hadamard"])
def test_a_native_gemm_that_disagrees_is_not_used(stand_in, recipe, kernel, why):
  r = RECIPES[recipe]
  emulated, _ = _three_gemms(dataclasses.replace(r, native=False), "ragged contraction")
  stand_in(kernel)
  got, jaxpr = _three_gemms(r, "ragged contraction")
  for a, b in zip(got, emulated, strict=True):
    np.testing.assert_array_equal(a, b)  # the emulation, bit for bit
  with pytest.raises(ValueError, match=f"native=True: no native .*{why}"):
    _three_gemms(dataclasses.replace(r, native=True), "ragged contraction")


@pytest.mark.skipif(
  not _block_gemm.native_backend(), reason="no native block-scaled GEMM here"
)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_backends_native_gemm(recipe, layout):
  r = RECIPES[recipe]
  emulated, _ = _three_gemms(dataclasses.replace(r, native=False), layout)
  got, _ = _three_gemms(dataclasses.replace(r, native=True), layout)
  for a, b in zip(got, emulated, strict=True):
    assert_close(a, b)


@has_scaled_dot
@pytest.mark.parametrize("native", [None, True])
def test_an_empty_product_is_emulated(stand_in, native):
  stand_in(scaled_dot)
  r = ols.NVFP4Matmul(native=native)
  x, w = jnp.zeros((0, 48), jnp.float32), jnp.ones((48, 24), jnp.float32)
  y, dx, dw = jax.jit(three_gemms(r, "plain"))(x, w, jnp.zeros((0, 24), jnp.float32))
  assert y.shape == (0, 24) and dx.shape == (0, 48)
  np.testing.assert_array_equal(dw, np.zeros((48, 24)))
  assert not _block_gemm._VERDICTS  # no probe ran
