"""The 8-bit code of quantize_state: the maps, nearest codes, one leaf.

The maps against their definition, the arithmetic decoder against the
maps, nearest codes against a NumPy search in float64 (every midpoint
between two codes, one float32 step either side, included), and one
leaf's codes and scales.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxprs import eqns as all_eqns

from optax_lossscale._params import quantize_codec as codec
from optax_lossscale._params import quantize_state as q


def _nearest(x, code):
  """Nearest code index in float64, ties to the lower index."""
  d = np.abs(x[:, None].astype(np.float64) - code[None, :].astype(np.float64))
  return np.argmin(d, axis=1)


# --------------------------------------------------------------------------
# The maps and one leaf.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("signed", [True, False])
def test_the_dynamic_maps(signed):
  code = q.dynamic_map(signed)
  assert code.dtype == np.float32 and code.shape == (256,)
  assert np.all(np.diff(code) > 0)
  assert code[-1] == 1.0 and 0.0 in code
  assert (code < 0).sum() == (127 if signed else 0)
  # seven decades: the smallest positive value is in [1e-7, 1e-6)
  assert 1e-7 <= code[code > 0].min() < 1e-6
  # each value is its cell's midpoint, (2n + 18j + 9) / (20n 10**(6 - i)),
  # computed as the exact (2n + 18j + 9) / n times the decade's factor
  # rounded to float32 (relative error <= 2**-24, so at most 2**-24 of a
  # value below 2**(E + 1): one unit of its binade's last place), the
  # product rounded once more (half a unit): 1.5 units at most
  exact = [0.0, 1.0]
  for i in range(7):
    n = 2 ** (i if signed else i + 1)
    mids = [(2 * n + 18 * j + 9) / (20 * n * 10 ** (6 - i)) for j in range(n)]
    exact += mids + ([-m for m in mids] if signed else [])
  exact = np.sort(np.array(exact))
  ulps = np.abs(code - exact) / np.spacing(np.abs(code))
  assert ulps.max() <= 1.5


@pytest.mark.parametrize("signed", [True, False])
def test_the_decoder_computes_the_map(signed):
  # code_value's arithmetic (no table: XLA fuses it into every consumer)
  # gives each code's map value bit for bit, in and out of jit
  codes = jnp.arange(256, dtype=jnp.int32)
  want = q.dynamic_map(signed)
  for fn in (codec.code_value, jax.jit(codec.code_value)):
    got = np.asarray(fn(codes, jnp.asarray(signed)))
    np.testing.assert_array_equal(got, want)
    assert np.signbit(got[want == 0]).sum() == 0  # 0, not -0


@pytest.mark.parametrize("signed", [True, False])
def test_every_midpoint_rounds_as_a_float64_search(signed):
  # For every two neighbouring codes: float32 values at, below and above
  # their exact midpoint (two steps each way), and every code itself; a
  # value exactly halfway rounds down. The signed map's negative half too.
  code = q.dynamic_map(signed)
  mid = (code[:-1].astype(np.float64) + code[1:]) / 2
  m32 = mid.astype(np.float32)
  near = [m32]
  for direction in (-1.0, 1.0):
    x = m32
    for _ in range(2):
      x = np.nextafter(x, np.float32(direction))
      near.append(x)
  x = np.concatenate([*near, code]).astype(np.float32)
  x = x[(x >= code[0]) & (x <= 1.0)]
  if signed:
    x = np.concatenate([x, -x])
    x = x[(x >= code[0]) & (x <= 1.0)]
  got = np.asarray(jax.jit(codec.nearest_code)(jnp.asarray(x), jnp.asarray(signed)))
  np.testing.assert_array_equal(got, _nearest(x, code))
  # NaN (a block holding one: its scale is infinite) takes 0's code
  nan = codec.nearest_code(jnp.asarray([np.nan], np.float32), jnp.asarray(signed))
  assert int(nan[0]) == int(np.flatnonzero(code == 0)[0])


def test_leaves_encoded_together_equal_each_encoded_alone():
  rng = np.random.default_rng(3)
  xs = [
    jnp.asarray(rng.normal(size=(8, 512)) * 10.0 ** rng.uniform(-8, 0, (8, 512)), dt)
    for dt in (jnp.float32, jnp.float32, jnp.bfloat16)
  ]
  xs[1] = jnp.abs(xs[1])  # unsigned blocks (square roots) beside signed ones
  for stochastic in (False, True):
    together = codec.encode_many(xs, 256, True, stochastic)
    alone = [codec.encode(x, 256, True, stochastic) for x in xs]
    for a, b in zip(together, alone, strict=True):
      np.testing.assert_array_equal(a.codes, b.codes)
      np.testing.assert_array_equal(a.scales, b.scales)
      assert a.dtype == b.dtype
  # one reduction finds every block's extremes
  jaxpr = jax.make_jaxpr(lambda *x: codec.encode_many(list(x), 256))(*xs)
  assert [e.primitive.name for e in all_eqns(jaxpr.jaxpr)].count("reduce") == 1


@pytest.mark.parametrize(
  ("shape", "block", "scales"),
  [
    ((4096,), 256, (16,)),
    ((16, 512), 256, (16, 2)),  # blocks along the last axis, rows whole
    ((8, 32, 16), 256, (8, 2)),  # the trailing 512 elements hold 2 blocks
    ((3, 100), 256, (2,)),  # no axis fits: the flattened array, padded
    ((64, 64), 64, (64, 1)),
  ],
)
def test_each_element_takes_its_nearest_code(shape, block, scales):
  rng = np.random.default_rng(0)
  x = rng.normal(size=shape).astype(np.float32) * np.logspace(-6, 1, shape[-1])
  x = x.astype(np.float32)
  x.reshape(-1)[:block] = np.abs(x.reshape(-1)[:block])
  leaf = q.encode(jnp.asarray(x), block, sqrt=False)
  assert leaf.codes.shape == shape and leaf.codes.dtype == jnp.uint8
  assert leaf.scales.shape == scales
  flat = x.reshape(-1)
  pad = -flat.size % block
  blocks = np.concatenate([flat, np.zeros(pad, np.float32)]).reshape(-1, block)
  # A block's scale: the least that puts its values in its map's range, 0
  # to 1, or -0.993 (the signed map's least value) to 1 (times the float32
  # reciprocal of 0.993).
  end = -q.dynamic_map(True)[0]
  absmax = np.maximum(blocks.max(axis=1), -blocks.min(axis=1) * (np.float32(1) / end))
  signed = (blocks < 0).any(axis=1)
  assert (-blocks.min(axis=1) > blocks.max(axis=1)).any()  # such blocks too
  np.testing.assert_array_equal(
    np.asarray(leaf.scales).reshape(-1), np.where(signed, -absmax, absmax)
  )
  want = [
    _nearest(np.clip(b * (np.float32(1) / a), -1, 1), q.dynamic_map(s))
    for b, a, s in zip(blocks, absmax, signed, strict=True)
  ]
  np.testing.assert_array_equal(
    np.asarray(leaf.codes).reshape(-1), np.concatenate(want)[: flat.size]
  )
  assert not signed[0]  # the first block is all >= 0: the unsigned map
  back = np.asarray(leaf.dequantize())
  assert back.shape == shape
  np.testing.assert_allclose(back, x, rtol=0, atol=float(np.abs(x).max()) * 0.04)


def test_a_value_halfway_between_two_codes_rounds_down():
  code = q.dynamic_map(False)
  mids = (code[:-1].astype(np.float64) + code[1:]) / 2
  i = next(i for i in range(200, 255) if np.float32(mids[i]) == mids[i])
  mid = mids[i]  # a midpoint that float32 holds exactly
  x = jnp.asarray(np.r_[np.float32(mid), np.float32(1.0), np.zeros(254, np.float32)])
  assert int(q.encode(x, 256, sqrt=False).codes[0]) == i
  above = jnp.asarray(np.nextafter(np.float32(mid), np.float32(2)))
  assert int(q.encode(x.at[0].set(above), 256, sqrt=False).codes[0]) == i + 1


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_stochastic_rounding_takes_a_neighbour_right_on_average(signed):
  code = q.dynamic_map(signed)
  k = 200  # between two codes of the top decade
  lo, hi = float(code[k]), float(code[k + 1])
  target = lo + 0.3 * (hi - lo)
  # 400 blocks of 255 distinct values around the target (each its own
  # random number) and 1.0, the block's largest: the scale is 1.
  n = 400 * 255
  vals = target + (np.arange(n) - n / 2) * 1e-12
  x = np.ones((400, 256), np.float32)
  x[:, 1:] = vals.reshape(400, 255)
  if signed:
    x[:, 0] = code[0]  # the map's least value, -0.993: the scale stays 1
  leaf = q.encode(jnp.asarray(x), 256, sqrt=False, stochastic=True)
  codes = np.asarray(leaf.codes)[:, 1:]
  assert set(np.unique(codes)) == {k, k + 1}  # the two around it, both drawn
  got = float(np.asarray(leaf.dequantize())[:, 1:].mean())
  sigma = (hi - lo) * np.sqrt(0.3 * 0.7 / n)
  assert abs(got - float(x[:, 1:].mean())) < 5 * sigma
  # Nearest rounding is off by 0.3 of the gap, far outside that.
  nearest = float(
    np.asarray(q.encode(jnp.asarray(x), 256, sqrt=False).dequantize())[:, 1:].mean()
  )
  assert abs(nearest - float(x[:, 1:].mean())) > 100 * sigma
  # The same values draw the same codes; a value of the map keeps its code.
  again = q.encode(jnp.asarray(x), 256, sqrt=False, stochastic=True)
  np.testing.assert_array_equal(again.codes, leaf.codes)
  exact = x.copy()
  exact[:, 1:] = lo
  assert np.all(
    np.asarray(q.encode(jnp.asarray(exact), 256, sqrt=False, stochastic=True).codes)[
      :, 1:
    ]
    == k
  )


def test_an_unsigned_block_stores_its_square_roots():
  rng = np.random.default_rng(3)
  x = np.sign(rng.normal(size=1024)) * 10.0 ** rng.uniform(-10, 0, 1024)
  x[:512] = np.abs(x[:512])  # two unsigned blocks, two signed
  x = jnp.asarray(x.astype(np.float32))
  leaf = q.encode(x, 256)
  plain = q.encode(x, 256, sqrt=False)
  roots = q.encode(jnp.sqrt(jnp.abs(x)), 256, sqrt=False)
  np.testing.assert_array_equal(leaf.codes[:512], roots.codes[:512])
  np.testing.assert_array_equal(leaf.scales[:2], roots.scales[:2])
  np.testing.assert_array_equal(leaf.codes[512:], plain.codes[512:])
  np.testing.assert_array_equal(leaf.scales[2:], plain.scales[2:])
  back = np.asarray(leaf.dequantize())
  want = np.asarray(roots.dequantize()[:512]) ** 2
  np.testing.assert_array_equal(back[:512], want.astype(np.float32))
  # entries down to 1e-10 of their block's largest: 0 as they are, kept as roots
  small = np.asarray(x[:512]) > 0
  assert (np.asarray(plain.dequantize())[:512][small] == 0).sum() > 0
  assert (back[:512][small] == 0).sum() == 0


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_zeros_and_non_finite_blocks(stochastic):
  x = jnp.zeros(512).at[300].set(jnp.nan)
  leaf = q.encode(x, 256, stochastic=stochastic)
  assert float(leaf.scales[0]) == 0.0 and np.isposinf(leaf.scales[1])
  back = leaf.dequantize()
  np.testing.assert_array_equal(back[:256], 0.0)
  assert not bool(jnp.any(jnp.isfinite(back[256:])))
  inf = q.encode(jnp.ones(256).at[3].set(-jnp.inf), 256, stochastic=stochastic)
  assert np.isinf(inf.scales[0])


@pytest.mark.parametrize("one_pass", [True, False], ids=["one pass", "min and max"])
def test_a_nan_counts_as_an_infinity_in_both_extremes(one_pass):
  # No NaN reaches a reduction: XLA's min and max keep one, Pallas' Triton
  # lowering (a GPU kernel) drops it, and both must give these blocks.
  b = jnp.asarray(
    [
      [-3.0, np.nan, 1.0, 2.0],  # a NaN among negative and positive values
      [np.nan, np.nan, np.nan, np.nan],
      [0.5, 0.25, np.nan, 1.0],  # non-negative but for the NaN
      [-1.0, -2.0, 0.0, 4.0],  # finite: as it is
    ],
    jnp.float32,
  )
  up = jnp.where(jnp.isnan(b), jnp.inf, b)
  (lo, hi, _), (lo_up, hi_up, _) = (
    codec.block_extremes([x], one_pass)[0] for x in (b, up)
  )
  np.testing.assert_array_equal(lo, lo_up)
  np.testing.assert_array_equal(hi, hi_up)
  np.testing.assert_array_equal(lo, [-3.0, np.inf, 0.25, -2.0])
  np.testing.assert_array_equal(hi, [np.inf, np.inf, np.inf, 4.0])
