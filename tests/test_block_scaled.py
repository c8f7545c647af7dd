"""block_quantize against an independent NumPy/ml_dtypes reference, bit for bit.

Axes: the format (MXFP8, NVFP4) x edge blocks (zeros, 1e-30, 1e30, an amax
at a power of two times 448 (MXFP8) or 6 * 448 (NVFP4), a ragged length,
NaN, inf) x the blocked axis (last, first) x eager and jit. The reference
computes each block's scale from its definition in float64/float32 NumPy
and rounds with ml_dtypes.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import versions

import optax_lossscale as ols

pytestmark = versions.block_formats


def ref_mxfp8(x, rule="round_up"):
  """Blocks of 32 along the last axis: (dequantised, scales as float).

  ``"round_up"``: the smallest power of two with ``448 * 2**e >= amax``;
  ``"ocp"``: OCP MX v1.0's ``floor(log2(amax)) - 8``, elements saturated
  to ±448.
  """
  x = np.asarray(x, np.float32)
  n = x.shape[-1]
  pad = -n % 32
  xp = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]).reshape(*x.shape[:-1], -1, 32)
  out = np.empty_like(xp)
  scales = np.empty(xp.shape[:-1])
  for idx in np.ndindex(*xp.shape[:-1]):
    blk = xp[idx].astype(np.float64)
    amax = np.max(np.abs(blk))
    if not np.isfinite(amax):
      out[idx], scales[idx] = np.nan, np.nan
      continue
    if amax == 0:
      e = -127
    elif rule == "round_up":  # the smallest e with 448 * 2**e >= amax
      e = int(np.ceil(np.log2(amax / 448.0)))
      while 448.0 * 2.0**e < amax:
        e += 1
      while 448.0 * 2.0 ** (e - 1) >= amax:
        e -= 1
      e = min(max(e, -127), 127)
    else:  # 2**(f + 8) <= amax < 2**(f + 9), f = floor(log2 amax) - 8
      f = int(np.floor(np.log2(amax)))
      while 2.0**f > amax:
        f -= 1
      while 2.0 ** (f + 1) <= amax:
        f += 1
      e = min(max(f - 8, -127), 127)
    scaled = blk * 2.0**-e
    if rule == "ocp":
      scaled = np.clip(scaled, -448.0, 448.0)
    q = scaled.astype(ml_dtypes.float8_e4m3fn)
    out[idx] = q.astype(np.float64) * 2.0**e
    scales[idx] = 2.0**e
  out = out.reshape(*x.shape[:-1], -1)[..., :n]
  return out, scales


F32_MAX = np.finfo(np.float32).max


def _flushes_subnormals():
  """Whether the backend computes float32 subnormal results as zeros."""
  tiny = jax.jit(lambda a: a * np.float32(2.0**-10))(np.float32(2.0**-120))
  return float(tiny) == 0.0


def ref_nvfp4(x, tiles=False, rule="divide"):
  """Blocks of 16 along the last axis (16 x 16 tiles over the last two).

  ``"divide"``: ``x / (s * g)``; ``"transformer_engine"``: TransformerEngine's
  ``x * min(1 / (s * (1 / S)), max)`` with ``S = min(2688 / amax, max)``,
  ``s = e4m3(amax_block * (S * float32(1/6)))``, scale per tensor ``1 / S``.
  """
  x = np.asarray(x, np.float32)
  amax_t = np.max(np.abs(x))
  if not np.isfinite(amax_t):
    return np.full(x.shape, np.nan, np.float32)
  if rule == "divide":
    # at least 2**-117: a block scale times it stays a normal float32
    g = max(np.float32(amax_t) / np.float32(2688.0), np.float32(2.0**-117))
  else:
    with np.errstate(divide="ignore", over="ignore"):
      enc = np.minimum(np.float32(2688.0) / np.float32(amax_t), F32_MAX)
    enc = np.float32(1.0) if amax_t == 0 or enc == 0 else np.float32(enc)
    g = np.float32(1.0) / enc
    if g < 2.0**-126 and _flushes_subnormals():  # amax below 2688 * 2**-126
      g = np.float32(0.0)
  r, c = x.shape[-2:] if tiles else (1, x.shape[-1])
  xp = x.reshape(-1, r, c) if tiles else x.reshape(-1, 1, c)
  pr, pc = (-r % 16 if tiles else 0), -c % 16
  xp = np.pad(xp, [(0, 0), (0, pr), (0, pc)])
  out = np.zeros_like(xp)
  br = 16 if tiles else 1
  for i in range(xp.shape[0]):
    for a in range(0, xp.shape[1], br):
      for b in range(0, xp.shape[2], 16):
        blk = xp[i, a : a + br, b : b + 16]
        amax = np.float32(np.max(np.abs(blk)))
        if rule == "divide":
          s = (amax / np.float32(6.0) / g).astype(ml_dtypes.float8_e4m3fn)
        else:
          s = np.minimum(amax * (enc * np.float32(1.0 / 6.0)), np.float32(448.0))
          s = s.astype(ml_dtypes.float8_e4m3fn)
        s32 = np.float32(s)
        if s32 == 0:
          continue
        if rule == "divide":
          v = np.clip(blk / (s32 * g), np.float32(-6), np.float32(6))
        else:
          with np.errstate(divide="ignore"):
            m = np.minimum(np.float32(1.0) / (s32 * g), F32_MAX)
          v = np.clip(blk * np.float32(m), np.float32(-6), np.float32(6))
        q = v.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
        out[i, a : a + br, b : b + 16] = q * s32 * g
  return out[:, :r, :c].reshape(x.shape)


def edge_rows(block, largest):
  rng = np.random.default_rng(0)
  rows = {
    "normal": rng.standard_normal(3 * block),
    "zeros": np.zeros(3 * block),
    "1e-30": 1e-30 * rng.standard_normal(3 * block),
    "1e30": 1e30 * rng.standard_normal(3 * block),
    "1e-36": 1e-36 * rng.standard_normal(3 * block),
    "amax at 2**k * max": np.concatenate(
      [
        [largest * 2.0**3],
        rng.uniform(-1, 1, block - 1),
        rng.standard_normal(2 * block),
      ]
    ),
    "just above it": np.concatenate(
      [[largest * 2.0**3 * (1 + 2**-20)], rng.standard_normal(3 * block - 1)]
    ),
    "ragged": rng.standard_normal(2 * block + 5),
    "one huge, rest tiny": np.concatenate(
      [[3e4], 1e-3 * rng.standard_normal(block - 1)]
    ),
  }
  return {k: np.asarray(v, np.float32) for k, v in rows.items()}


def _equal(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape
  assert np.array_equal(np.isnan(got), np.isnan(want))
  assert np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])


@pytest.mark.sampled
@pytest.mark.parametrize("rule", ["round_up", "ocp"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("row", list(edge_rows(32, 448)))
def test_mxfp8_is_the_reference_bit_for_bit(row, jit, rule):
  x = edge_rows(32, 448.0)[row]
  f = lambda x: ols.block_quantize(x, "mxfp8", rule=rule)  # noqa: E731
  q = (jax.jit(f) if jit else f)(x)
  want, scales = ref_mxfp8(x, rule)
  _equal(q.dequantize(), want)
  _equal(q.scales.astype(jnp.float32), scales)
  assert q.elements.dtype == jnp.float8_e4m3fn and q.elements.shape[-1] % 32 == 0


@pytest.mark.sampled
@pytest.mark.parametrize("rule", ["divide", "transformer_engine"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("row", list(edge_rows(16, 2688)))
def test_nvfp4_is_the_reference_bit_for_bit(row, jit, rule):
  x = edge_rows(16, 2688.0)[row]
  f = lambda x: ols.block_quantize(x, "nvfp4", rule=rule)  # noqa: E731
  q = (jax.jit(f) if jit else f)(x)
  _equal(q.dequantize(), ref_nvfp4(x, rule=rule))
  assert q.elements.dtype == jnp.float4_e2m1fn and q.global_scale.dtype == jnp.float32


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_non_finite_blocks_dequantise_to_nan(fmt):
  x = np.ones(64, np.float32)
  for bad in (np.nan, np.inf, -np.inf):
    x[3] = bad
    d = np.asarray(ols.block_quantize(x, fmt).dequantize())
    assert np.isnan(d[3]), fmt
    if fmt == "mxfp8":  # other blocks are untouched
      np.testing.assert_array_equal(d[32:], 1.0)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_any_axis_is_the_last_axis_moved(fmt):
  x = np.random.default_rng(3).standard_normal((37, 5, 3)).astype(np.float32)
  a = ols.block_quantize(x, fmt, axis=0).dequantize()
  b = ols.block_quantize(np.moveaxis(x, 0, -1), fmt).dequantize()
  np.testing.assert_array_equal(np.asarray(a), np.moveaxis(np.asarray(b), -1, 0))


def test_nvfp4_tiles_are_the_reference_and_transpose_exactly():
  w = np.random.default_rng(4).standard_normal((40, 24)).astype(np.float32)
  w[:16, :16] *= 100  # one loud tile
  q = ols.block_quantize(w, "nvfp4", axis=0, tile_axis=1)
  _equal(q.dequantize(), ref_nvfp4(w, tiles=True))
  qt = ols.block_quantize(w.T, "nvfp4", axis=1, tile_axis=0)
  np.testing.assert_array_equal(
    np.asarray(q.dequantize()).T, np.asarray(qt.dequantize())
  )


def test_nvfp4_stochastic_rounding_is_unbiased_and_keyed():
  x = jnp.asarray(np.random.default_rng(5).uniform(-1, 1, 64), jnp.float32)
  keys = jax.random.split(jax.random.key(0), 4000)
  one = jax.jit(lambda k: ols.block_quantize(x, "nvfp4", key=k).dequantize())
  draws = jax.vmap(one)(keys)
  nearest = ols.block_quantize(x, "nvfp4").dequantize()
  mean, err = draws.mean(0), draws.std(0) / np.sqrt(len(keys))
  assert np.all(np.abs(mean - x) <= 5 * err + 1e-6)  # unbiased
  assert np.abs(nearest - x).max() > 1e-3  # where nearest is biased
  np.testing.assert_array_equal(one(keys[0]), one(keys[0]))  # reproducible
  assert not np.array_equal(one(keys[0]), one(keys[1]))  # differs with the key


def test_errors_name_the_argument():
  with pytest.raises(ValueError, match="`fmt` must be 'mxfp8' or 'nvfp4'"):
    ols.block_quantize(jnp.ones(4), "fp8")
  with pytest.raises(ValueError, match="`axis` 2 is out of range"):
    ols.block_quantize(jnp.ones((4, 4)), "mxfp8", axis=2)
  with pytest.raises(ValueError, match="MXFP8 has no tiles"):
    ols.block_quantize(jnp.ones((4, 4)), "mxfp8", tile_axis=0)
  with pytest.raises(ValueError, match="`tile_axis` must differ"):
    ols.block_quantize(jnp.ones((4, 4)), "nvfp4", axis=1, tile_axis=-1)
  with pytest.raises(ValueError, match="must be floating"):
    ols.block_quantize(jnp.ones(4, jnp.int32), "nvfp4")
  with pytest.raises(ValueError, match="`axis` True is out of range"):
    ols.block_quantize(jnp.ones(4), "mxfp8", axis=True)
  for key in (0, jax.random.split(jax.random.key(0), 3)):
    with pytest.raises(ValueError, match="`key` must be one PRNG key"):
      ols.block_quantize(jnp.ones(4), "nvfp4", key=key)
  ols.block_quantize(jnp.ones(4), "nvfp4", key=jax.random.PRNGKey(0))  # raw: fine


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_edge_inputs(fmt):
  # jitted (op by op, each shape compiled dozens of operations); the eager
  # path is the bit-for-bit tests'
  qdq = jax.jit(
    lambda x, axis=-1: ols.block_quantize(x, fmt, axis=axis).dequantize(),
    static_argnums=1,
  )
  for empty in (np.zeros((0,), np.float32), np.zeros((3, 0)), np.zeros((0, 20))):
    for axis in (0, -1):
      got = qdq(empty, axis % empty.ndim)
      assert got.shape == empty.shape
  with pytest.raises(ValueError, match="at least one axis, got a scalar"):
    ols.block_quantize(3.0, fmt)
  # a tiny but normal tensor: finite, near its values (NVFP4's scale per
  # tensor would be a subnormal without its floor)
  tiny = np.full(16, 1e-36, np.float32)
  np.testing.assert_allclose(np.asarray(qdq(tiny)), tiny, rtol=0.1)
  x = np.random.default_rng(6).standard_normal(40).astype(np.float32)
  want = np.asarray(qdq(x))
  for dtype in (jnp.bfloat16, jnp.float16):  # a half array: its own values
    low = jnp.asarray(x, dtype)
    np.testing.assert_array_equal(qdq(low), qdq(low.astype(jnp.float32)))
  np.testing.assert_array_equal(ols.block_quantize(list(x), fmt).dequantize(), want)


def test_mxfp8_rounds_up_to_infinity_only_above_248_times_2_to_120():
  edge = np.float32(248 * 2.0**120)
  x = np.array([np.nextafter(edge, np.float32(0)), 1.0], np.float32)
  assert np.isfinite(np.asarray(ols.block_quantize(x, "mxfp8").dequantize())).all()
  x[0] = edge
  assert np.isinf(np.asarray(ols.block_quantize(x, "mxfp8").dequantize())[0])


def test_the_rules_differ_where_the_standards_do():
  # MXFP8: the rules part exactly where amax / 2**floor(log2 amax) > 1.75
  # (mantissa above 0.875), a share of Gaussian blocks measured here.
  x = np.random.default_rng(1).standard_normal((4096, 32)).astype(np.float32)
  up = ols.block_quantize(x, "mxfp8").scales.astype(jnp.float32)
  ocp = ols.block_quantize(x, "mxfp8", rule="ocp").scales.astype(jnp.float32)
  m, _ = np.frexp(np.max(np.abs(x), axis=-1, keepdims=True))
  np.testing.assert_array_equal(np.asarray(up) != np.asarray(ocp), m > 0.875)
  np.testing.assert_array_equal(
    np.asarray(up)[m > 0.875], 2 * np.asarray(ocp)[m > 0.875]
  )
  assert 0.05 < np.mean(m > 0.875) < 0.5
  # NVFP4: the two orders give other numbers for this Gaussian tensor (its
  # scale per tensor, amax / 2688 against 1 / (2688 / amax), one unit apart),
  # and each is its own reference's.
  x = np.random.default_rng(1).standard_normal((256, 256)).astype(np.float32)
  ours = np.asarray(ols.block_quantize(x, "nvfp4").dequantize())
  te = np.asarray(
    ols.block_quantize(x, "nvfp4", rule="transformer_engine").dequantize()
  )
  _equal(ours, ref_nvfp4(x))
  _equal(te, ref_nvfp4(x, rule="transformer_engine"))
  assert np.any(ours != te)


def test_a_rule_the_format_lacks_is_refused_by_name():
  for fmt, rule in [("mxfp8", "transformer_engine"), ("nvfp4", "ocp"), ("mxfp8", 1)]:
    with pytest.raises(ValueError, match="`rule`"):
      ols.block_quantize(jnp.ones(32), fmt, rule=rule)
