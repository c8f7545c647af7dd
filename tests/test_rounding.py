"""Stochastic rounding and Kahan summation of bfloat16/float16 parameters.

The rounding is checked against a reference that finds a value's two
neighbours by searching the sorted table of every finite value of the dtype
(NumPy/ml_dtypes, float64), fed the same random bits; the transformations
through ``optax.apply_updates``, bit for bit. ``same_values`` compares bits,
with ``+0.0 == -0.0`` (a zero comes out of IEEE addition as ``+0.0``) and
NaN equal to NaN.
"""

import functools
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import versions

import optax_lossscale as ols
from optax_lossscale._base.rounding import (
  draw,
  exact_update,
  random_bits_dtype,
  round_to,
)

F32 = np.dtype(np.float32)
BF16, F16 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
HALF = [BF16, F16]
#: Significant bits (with the implicit one) of each dtype.
PRECISION = {BF16: 8, F16: 11}
#: The factor within which apply_updates is exact (exact_update's docstring).
EXACT_FACTOR = {BF16: 2.0**15, F16: 2.0**12}


def _backend_flushes_subnormals():
  """Whether float32 arithmetic here reads and writes subnormals as zero."""
  tiny = np.float32(2.0**-130)
  return bool(jax.jit(lambda a: a + a)(tiny) == 0)


FLUSHES = _backend_flushes_subnormals()


# --------------------------------------------------------------------------
# The reference and the comparison.
# --------------------------------------------------------------------------


def finite_values(dtype):
  """Every finite value of ``dtype`` as float64, sorted, one zero."""
  info = jnp.finfo(dtype)
  bits = np.arange(2**16, dtype=np.uint16)
  exponent = ((1 << info.nexp) - 1) << info.nmant
  finite = bits[(bits & exponent) != exponent]
  return np.unique(finite.view(dtype).astype(np.float64))


def reference_round(x, dtype, bits):
  """``(rounded, lo, hi)`` of float32 ``x``: its magnitude up where ``bits`` say.

  The magnitude's neighbours ``lo <= |x| < hi`` are found in the table of
  every finite value; it rounds up where ``bits >= 2**B - floor(p * 2**B)``
  (the carry of ``bits``' top bits added below the kept ones), with
  ``p = (|x| - lo) / (hi - lo)`` and ``B`` the random integers' width (16
  for bfloat16, 32 for float16), and keeps its sign. Values of the dtype,
  non-finite values and values beyond the largest are cast (round to
  nearest, as NumPy/ml_dtypes do). ``lo`` and ``hi`` are returned signed, in
  increasing order.
  """
  x = np.asarray(x, F32)
  table = finite_values(dtype)
  table = table[table >= 0]
  width = np.iinfo(np.asarray(bits).dtype).bits
  with np.errstate(all="ignore"):  # NaN inputs (signalling ones too)
    x64 = x.astype(np.float64)
    a = np.abs(x64)
    inside = np.isfinite(x64) & (a <= table[-1])
    a = np.where(inside, a, 0.0)
    i = np.clip(np.searchsorted(table, a, side="right"), 1, len(table) - 1)
    small, big = table[i - 1], table[i]
    p = np.where(small == a, 0.0, (a - small) / (big - small))
    up = np.asarray(bits, np.float64) >= 2.0**width - np.floor(p * 2.0**width)
    picked = np.copysign(np.where(up, big, small), x64)
    nearest = x.astype(dtype).astype(np.float64)
    out = np.where(inside, picked, nearest).astype(dtype)
    lo = np.where(x64 < 0, -big, small)
    hi = np.where(x64 < 0, -small, big)
  return out, lo, hi


def same_values(actual, expected):
  """Where ``actual`` and ``expected`` (same dtype) differ, up to ±0 and NaN."""
  a, e = np.asarray(actual), np.asarray(expected)
  assert a.dtype == e.dtype, (a.dtype, e.dtype)
  with np.errstate(invalid="ignore"):
    a64, e64 = a.astype(np.float64), e.astype(np.float64)
  bits = a.view(np.uint16) == e.view(np.uint16)
  return bits | ((a64 == 0) & (e64 == 0)) | (np.isnan(a64) & np.isnan(e64))


def assert_same_values(actual, expected, inputs=None):
  ok = same_values(actual, expected)
  if not ok.all():
    bad = np.flatnonzero(~ok.ravel())[:5]
    where = "" if inputs is None else f" for {np.asarray(inputs).ravel()[bad]}"
    raise AssertionError(
      f"{bad.size} of {ok.size} differ{where}: got "
      f"{np.asarray(actual).ravel()[bad]}, expected {np.asarray(expected).ravel()[bad]}"
    )


def assert_trees_bitwise_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(la, lb, strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()


# --------------------------------------------------------------------------
# round_to.
# --------------------------------------------------------------------------


def _inputs(dtype, n, seed):
  """float32 inputs: random bits, realistic values, values between
  neighbours, and the edges (zeros, subnormals, the largest value, inf, NaN)."""
  rng = np.random.default_rng(seed)
  table = finite_values(dtype)
  info = jnp.finfo(dtype)
  anything = rng.integers(0, 2**32, n, dtype=np.uint32).view(F32)
  realistic = (rng.normal(size=n) * 10.0 ** rng.uniform(-8, 4, n)).astype(F32)
  j = rng.integers(0, len(table) - 1, n)
  between = (table[j] + rng.uniform(size=n) * (table[j + 1] - table[j])).astype(F32)
  dmin, tiny, big = (float(v) for v in (info.smallest_subnormal, info.tiny, info.max))
  ulp_max = big - float(np.nextafter(np.asarray(big, dtype), np.asarray(0, dtype)))
  edges = [0.0, dmin, dmin / 2, 0.3 * dmin, 0.7 * dmin, 2.5 * dmin, tiny, 0.5 * tiny]
  edges += [big, big + 0.25 * ulp_max, big + 0.5 * ulp_max, big + ulp_max, np.inf]
  edges += [1.0, 1.0 + 2.0**-9, 1.0 - 2.0**-10, 3.0e-5, 65504.0, 65520.0, 1e38]
  edges = np.asarray(edges + [-e for e in edges] + [np.nan], np.float64)
  with np.errstate(over="ignore"):
    edges = np.repeat(edges.astype(F32), 16)  # each edge with several random draws
  return np.concatenate([anything, realistic, between, edges])


def _rounded(x, dtype, bits=None):
  """round_to's float32 values, in ``dtype`` (the conversion is exact)."""
  got = np.asarray(jax.jit(round_to, static_argnums=1)(x, dtype, bits))
  assert got.dtype == F32
  with np.errstate(all="ignore"):
    assert np.array_equal(
      got.astype(dtype).astype(F32), got, equal_nan=True
    )  # values the dtype holds
    return got.astype(dtype)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_round_to_matches_the_reference(dtype):
  x = _inputs(dtype, 4096, seed=0)
  bits = draw(jax.random.key(1), x.shape, dtype)
  got = _rounded(x, dtype, bits)
  expected, lo, hi = reference_round(x, dtype, bits)
  # float32 subnormals included: the rounding reads bits, no arithmetic
  # flushes them.
  assert_same_values(got, expected, x)
  # Both neighbours come up: the rounding is stochastic.
  strictly_between = (lo < x) & (x < hi)
  got64 = got.astype(np.float64)
  assert (got64[strictly_between] == lo[strictly_between]).sum() > 1000
  assert (got64[strictly_between] == hi[strictly_between]).sum() > 1000


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_round_to_nearest_is_the_cast(dtype):
  x = _inputs(dtype, 4096, seed=2)
  with np.errstate(all="ignore"):
    expected = x.astype(dtype)
  assert_same_values(_rounded(x, dtype), expected, x)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_values_of_the_dtype_never_move(dtype):
  values = np.arange(2**16, dtype=np.uint16).view(dtype)  # every bit pattern
  x = values.astype(F32)
  for seed in range(3):
    got = _rounded(x, dtype, draw(jax.random.key(seed), x.shape, dtype))
    finite = np.isfinite(x)
    # Bit for bit, -0.0 and subnormals included; inf stays inf, NaN NaN.
    assert (
      got[finite].view(np.uint16).tolist() == values[finite].view(np.uint16).tolist()
    )
    assert_same_values(got, values)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_round_to_is_unbiased(dtype):
  """The mean over many keys is within 5 binomial standard errors of x."""
  table = finite_values(dtype)
  info = jnp.finfo(dtype)
  one = int(np.searchsorted(table, 1.0))
  dmin = float(info.smallest_subnormal)
  rng = np.random.default_rng(3)
  cases = [  # (lo, hi, fraction of the way)
    (table[one], table[one + 1], 0.25),  # 1 and the next value up
    (table[one - 1], table[one], 0.75),  # below 1: half the spacing
    (table[one + 40], table[one + 41], 1 / 16),
    (-table[one + 5], -table[one + 4], 0.5),
    (-3.0 * dmin, -2.0 * dmin, 0.375),  # subnormals
    (-dmin, 0.0, 0.125),  # across zero
    (0.0, dmin, 0.625),
  ]
  unit = 2.0 ** -(24 - PRECISION[dtype])  # float32 bits below the dtype's
  cases += [(table[k], table[k + 1], rng.integers(1, 2**10) * unit) for k in [7, 9]]
  cases = [(lo, hi, f) for lo, hi, f in cases if np.isfinite(lo) and lo != hi]
  n = 1 << 15
  keys = jax.random.split(jax.random.key(4), 64)

  @jax.jit
  def mean_of(x):
    def one(key):
      bits = draw(key, (n // 64,), dtype)
      return round_to(jnp.full(n // 64, x), dtype, bits)

    return jax.vmap(one)(keys)

  for lo, hi, fraction in cases:
    x = np.float32(lo + fraction * (hi - lo))
    p = (float(x) - lo) / (hi - lo)
    samples = np.asarray(mean_of(x), np.float64)
    assert set(np.unique(samples)) <= {lo, hi}
    bound = 5 * (hi - lo) * np.sqrt(p * (1 - p) / n) + (hi - lo) * 2.0**-23
    assert abs(samples.mean() - x) <= bound, (lo, hi, fraction, samples.mean())
    # The control: round to nearest misses by far more than the bound.
    assert abs(float(round_to(jnp.float32(x), dtype)) - x) > bound


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_draw_is_jaxs_threefry_of_each_elements_row_and_column(dtype):
  from jax.extend.random import threefry_2x32

  key = jax.random.key(3)
  shape = (3, 5, 7)
  got = np.asarray(draw(key, shape, dtype))
  words = jax.random.key_data(key)
  index = np.arange(105, dtype=np.uint32).reshape(shape)
  counts = np.concatenate([(index // 7).ravel(), (index % 7).ravel()])
  first = np.asarray(threefry_2x32(words, counts))[:105].reshape(shape)
  width = 8 * np.dtype(got.dtype).itemsize
  np.testing.assert_array_equal(got, (first >> (32 - width)).astype(got.dtype))
  assert draw(key, (), dtype).shape == ()
  with pytest.raises(ValueError, match="32-bit row and column"):
    jax.eval_shape(lambda: draw(key, (2**16, 2**16, 1), dtype))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_draw_is_uniform_and_neighbours_are_uncorrelated(dtype):
  bits = np.asarray(draw(jax.random.key(5), (512, 512), dtype)).astype(np.float64)
  width = 8 * np.dtype(random_bits_dtype(dtype)).itemsize
  n = bits.size
  for part in (np.floor(bits / 2 ** (width - 8)), bits % 256):  # top and low byte
    counts = np.bincount(part.astype(np.int64).ravel(), minlength=256)
    chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum()
    assert chi2 < 255 + 6 * np.sqrt(2 * 255), chi2  # 255 degrees of freedom
  u = bits / 2.0**width - 0.5
  for a, b in ((u[:, 1:], u[:, :-1]), (u[1:], u[:-1])):  # along rows, columns
    assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 5 / np.sqrt(a.size)


@pytest.mark.standard_promotion
def test_stochastic_rounding_reads_no_more_bytes_than_rounding_to_nearest():
  """The random numbers are computed where they are used: XLA's cost
  analysis counts the same bytes for the update step with and without."""
  params = {"w": jnp.ones((256, 1024), BF16)}
  grads = {"w": jnp.full((256, 1024), 1e-3, BF16)}
  adam = optax.adam(1e-3)

  def cost(tx, state):
    def step(p, s, g):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    compiled = jax.jit(step).lower(params, state, grads).compile()
    analysis = compiled.cost_analysis()
    return (analysis[0] if isinstance(analysis, list) else analysis)["bytes accessed"]

  moments = adam.init(jax.tree.map(lambda p: p.astype(F32), params))
  nearest = cost(adam, moments)
  rounding = ols.stochastic_rounding(0)
  stochastic = cost(optax.chain(adam, rounding), (moments, rounding.init(params)))
  assert stochastic <= nearest + 4096, (stochastic, nearest)


def test_round_to_refuses_bad_arguments():
  x = jnp.ones(3)
  with pytest.raises(ValueError, match="`x` must be a float32"):
    round_to(x.astype(jnp.float16), jnp.bfloat16)
  for dtype in (jnp.float32, jnp.float8_e4m3fn, "nope"):
    with pytest.raises(ValueError, match="`dtype` must be bfloat16 or float16"):
      round_to(x, dtype)
  for bits in (jnp.ones(2, jnp.uint16), jnp.ones(3), jnp.ones(3, jnp.uint32)):
    with pytest.raises(ValueError, match="`bits` must be a uint16 array"):
      round_to(x, jnp.bfloat16, bits)
  with pytest.raises(ValueError, match="`bits` must be a uint32 array"):
    round_to(x, jnp.float16, jnp.ones(3, jnp.uint16))


# --------------------------------------------------------------------------
# What optax.apply_updates makes of the updates.
# --------------------------------------------------------------------------


@pytest.mark.standard_promotion  # optax.apply_updates: bfloat16 + float32
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_apply_updates_exact_within_the_documented_bound(dtype):
  """Every (old, new) pair: exact unless it shrinks by more than the factor.

  Old values: 256 random values of the dtype; new values: all of them.
  """
  table = finite_values(dtype)
  if FLUSHES and dtype == BF16:  # differences below 2**-126 are flushed here
    table = table[(table == 0) | (np.abs(table) >= 2.0**-118)]
  rng = np.random.default_rng(5)
  old = rng.choice(table, 256).astype(dtype)
  new = table.astype(dtype)

  @jax.jit
  def applied(old, new):
    a, b = jnp.meshgrid(old, new, indexing="ij")
    return optax.apply_updates(a, exact_update(b, a))

  got = np.asarray(applied(old, new))
  a = old.astype(np.float64)[:, None]
  b = new.astype(np.float64)[None, :]
  ok = same_values(got, np.broadcast_to(new, got.shape))
  overflows = np.abs(b - a) > np.finfo(F32).max
  guaranteed = ((a == 0) | (np.abs(a) <= EXACT_FACTOR[dtype] * np.abs(b))) & ~overflows
  assert ok[guaranteed].all()
  assert guaranteed.sum() > 0.3 * ok.size
  # The bound is not vacuous: steps that shrink a weight further do miss.
  assert not ok[~guaranteed].all()


def _realistic(dtype, seed, shape=(64, 48)):
  """Weights over eight decades and updates from 1e-8 to 0.3 of them."""
  rng = np.random.default_rng(seed)
  p = rng.normal(size=shape) * 10.0 ** rng.uniform(-5, 2, shape)
  u = (
    -np.sign(rng.normal(size=shape)) * np.abs(p) * 10.0 ** rng.uniform(-8, -0.5, shape)
  )
  return jnp.asarray(p, dtype), jnp.asarray(u, F32)


def _bits(state, index, shape, dtype):
  """The random bits an update draws for leaf ``index`` (the documented schedule)."""
  _, step = jax.random.split(jax.random.wrap_key_data(state.rounding_key))
  return draw(jax.random.fold_in(step, index), shape, dtype)


@pytest.mark.standard_promotion
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_stochastic_rounding_applies_exactly_the_reference_rounding(dtype):
  tx = ols.stochastic_rounding(jax.random.key(6))
  p, u = _realistic(dtype, seed=7)
  params = {"a": p, "b": -p[:5]}  # leaves 0 and 1
  updates = {"a": u, "b": u[:5].astype(dtype)}  # a half update is read as f32
  state = tx.init(params)
  for _ in range(3):
    new_updates, new_state = jax.jit(tx.update)(updates, state, params)
    new_params = optax.apply_updates(params, new_updates)
    for i, k in enumerate(sorted(params)):
      assert new_updates[k].dtype == F32
      x = np.asarray(params[k], F32) + np.asarray(updates[k], F32)
      expected, _, _ = reference_round(x, dtype, _bits(state, i, x.shape, dtype))
      assert_same_values(new_params[k], expected, x)
    # The key advanced by one split, and the rounding moved weights.
    next_key, _ = jax.random.split(jax.random.wrap_key_data(state.rounding_key))
    assert np.array_equal(new_state.rounding_key, jax.random.key_data(next_key))
    assert not np.array_equal(new_params["a"], params["a"])
    params, state = new_params, new_state


@pytest.mark.standard_promotion
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_stochastic_rounding_of_a_zero_update_moves_nothing(dtype):
  values = np.arange(2**16, dtype=np.uint16).view(dtype)  # inf and NaN included
  params = {"w": jnp.asarray(values)}
  zeros = {"w": jnp.zeros(values.shape)}
  tx = ols.stochastic_rounding(0)
  updates, _ = tx.update(zeros, tx.init(params), params)
  got = optax.apply_updates(params, updates)["w"]
  normal = ~(np.abs(values.astype(F32)) < 2.0**-126)  # NaN included
  assert_same_values(got[normal], values[normal])
  # Subnormals stay, unless float32 arithmetic flushes them (apply_updates too).
  plain = optax.apply_updates(params, zeros)["w"]
  assert_same_values(got, plain if FLUSHES else values)


@pytest.mark.standard_promotion
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_stochastic_rounding_is_unbiased_over_keys(dtype):
  """The transformation end to end: many keys, the mean of the new weights."""
  table = finite_values(dtype)
  one = int(np.searchsorted(table, 1.0))
  n_keys, width = 256, 128
  tx = ols.stochastic_rounding(0)
  keys = jax.random.key_data(jax.random.split(jax.random.key(8), n_keys))
  states = ols.StochasticRoundingState(rounding_key=keys)

  @jax.jit
  @functools.partial(jax.vmap, in_axes=(0, None, None))
  def new_weights(state, params, grads):
    updates, _ = tx.update(grads, state, params)
    return optax.apply_updates(params, updates)["w"].astype(jnp.float32)

  for lo, hi, p in [
    (table[one], table[one + 1], 0.3),
    (-table[one + 9], -table[one + 8], 0.8),
  ]:
    params = {"w": jnp.full(width, lo, dtype)}
    u = np.float32(lo + p * (hi - lo)) - np.float32(lo)  # x - lo, exact in float32
    grads = {"w": jnp.full(width, u)}
    p = float(u) / (hi - lo)
    samples = np.asarray(new_weights(states, params, grads), np.float64)
    n = samples.size
    assert set(np.unique(samples)) == {lo, hi}
    bound = 5 * (hi - lo) * np.sqrt(p * (1 - p) / n)
    assert abs(samples.mean() - (lo + float(u))) <= bound
    nearest = optax.apply_updates(params, grads)["w"].astype(jnp.float32)
    assert abs(float(nearest[0]) - (lo + float(u))) > bound  # the control


@pytest.mark.standard_promotion
def test_other_leaves_keep_their_updates():
  params = {
    "f32": jnp.ones(3),
    "int": jnp.arange(3),
    "none": None,
    "bf16": jnp.ones(3, jnp.bfloat16),
  }
  updates = {
    "f32": jnp.full(3, 1e-9),
    "int": jnp.ones(3, jnp.int32),
    "none": None,
    "bf16": jnp.full(3, 1e-9),
  }
  for tx in (ols.stochastic_rounding(0), ols.kahan_summation()):
    state = tx.init(params)
    new, _ = tx.update(updates, state, params)
    for k in ("f32", "int", "none"):
      assert new[k] is updates[k]
    new_jit, _ = jax.jit(tx.update)(updates, state, params)
    chex.assert_trees_all_equal(
      {k: new_jit[k] for k in ("f32", "int")}, {k: updates[k] for k in ("f32", "int")}
    )
    assert new_jit["f32"].dtype == F32 and new_jit["int"].dtype == jnp.int32
    assert new["bf16"].dtype == F32
  kahan = ols.kahan_summation().init(params)
  assert isinstance(kahan, ols.KahanSummationState)
  assert kahan.compensation["f32"] is None and kahan.compensation["int"] is None
  assert kahan.compensation["bf16"].dtype == BF16


# --------------------------------------------------------------------------
# Kahan summation.
# --------------------------------------------------------------------------


@pytest.mark.standard_promotion
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_kahans_limit_is_the_documented_one(dtype):
  """While a weight does not move, its compensation (in the weight's dtype,
  t significant bits) grows by u a step, rounded to t bits, and stops at
  2**(floor(log2 |u|) + t + 1); the weight moves only if |u| reaches
  2**-(t + 2) of its spacing. For a bfloat16 weight at 1024 (spacing 8
  below it): 2**-7. For a float16 one at 1024 (spacing 0.5 below it):
  2**-14, float32's own unit there: the sum is float32, and below half of
  that unit an update is lost as it is on a float32 weight."""
  t = PRECISION[dtype]
  weight = 1024.0
  spacing = weight * 2.0**-t  # below a power of two
  threshold = spacing * 2.0 ** -(t + 2)
  tx = optax.chain(optax.sgd(1.0), ols.kahan_summation())

  @jax.jit
  def run(u):
    params = {"w": jnp.full(1, weight, dtype)}

    def step(carry, _):
      p, s = carry
      up, s = tx.update({"w": u}, s, p)
      return (optax.apply_updates(p, up), s), None

    (p, s), _ = jax.lax.scan(step, (params, tx.init(params)), None, length=3000)
    return p["w"][0], s[1].compensation["w"][0]

  if dtype == F16:
    u = threshold * 0.45  # below half a float32 unit: lost, as in float32
    w, c = run(jnp.full(1, u, F32))
    assert float(w) == weight and float(c) == 0.0
    assert np.float32(weight) - np.float32(u) == np.float32(weight)
  else:
    for fraction in (0.3, 0.6, 0.9, 0.97):
      u = threshold * fraction
      w, c = run(jnp.full(1, u, F32))  # sgd: w -= u
      assert float(w) == weight  # never moves
      assert float(c) == -(2.0 ** (np.floor(np.log2(u)) + t + 1))  # stalled there
      assert 3000 * u > 4 * abs(float(c))  # far from the exact sum
  for factor in (1.05, 2.0, 8.0) if dtype == BF16 else (2.0, 8.0):
    w, c = run(jnp.full(1, threshold * factor, F32))
    assert float(w) < weight  # moves


@pytest.mark.standard_promotion
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_kahan_keeps_what_round_to_nearest_loses(dtype):
  """1e-4 added 100 times to 1.0 (and to other weights)."""
  start = jnp.asarray([1.0, -2.0, 0.75, 3.0], dtype)
  step, steps = 1e-4, 100
  tx = optax.chain(optax.sgd(1.0), ols.kahan_summation())
  params, nearest = {"w": start}, {"w": start}
  state = tx.init(params)
  update = jax.jit(tx.update)
  bound = np.zeros(start.shape)  # what storing the compensation can lose
  for _ in range(steps):
    updates, state = update({"w": jnp.full(start.shape, -step)}, state, params)
    params = optax.apply_updates(params, updates)
    c = np.asarray(state[1].compensation["w"], np.float64)
    s = np.asarray(params["w"], np.float64) + c
    bound += 2.0 ** -PRECISION[dtype] * np.abs(c) + 2.0**-23 * np.abs(s)
    nearest = optax.apply_updates(nearest, {"w": jnp.full(start.shape, step)})
  total = np.asarray(start, np.float64) + steps * step
  kept = np.asarray(params["w"], np.float64) + c
  assert (np.abs(kept - total) <= bound).all(), (kept, total, bound)
  # The weights themselves moved, to the dtype's value nearest the sum ...
  spacing = np.abs(np.asarray(start, np.float64)) * 2.0 ** (1 - PRECISION[dtype])
  assert (np.abs(np.asarray(params["w"], np.float64) - total) <= spacing).all()
  assert not np.array_equal(params["w"], start)
  # ... where round to nearest lost every step (the control).
  assert np.array_equal(nearest["w"], start)
  assert (np.abs(total - np.asarray(start, np.float64)) > bound).all()


@pytest.mark.standard_promotion
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_kahan_applies_exactly_its_rounding(dtype):
  p, u = _realistic(dtype, seed=9)
  params = {"w": p}
  tx = ols.kahan_summation()
  state = tx.init(params)
  assert state.compensation["w"].dtype == dtype
  assert not np.asarray(state.compensation["w"], np.float64).any()
  for _ in range(3):
    updates, new_state = jax.jit(tx.update)({"w": u}, state, params)
    new = optax.apply_updates(params, updates)["w"]
    c = np.asarray(state.compensation["w"], F32)
    s = np.asarray(p, F32) + (np.asarray(u) + c)  # float32, as documented
    with np.errstate(over="ignore"):
      expected = s.astype(dtype)
    assert_same_values(new, expected, s)
    with np.errstate(all="ignore"):
      lost = (s - expected.astype(F32)).astype(dtype)
    assert_same_values(new_state.compensation["w"], lost, s)
    params, state, p = {"w": new}, new_state, new


# --------------------------------------------------------------------------
# Under a loss scale: skipped steps, resumption, Orbax, donation.
# --------------------------------------------------------------------------


#: Stochastic rounding on some leaves, Kahan summation on the others, in one
#: optimizer (``optax.multi_transform``), each with a float32 leaf it passes.
LABELS = {
  "w": "stochastic",
  "h": "stochastic",
  "b": "stochastic",
  "k": "kahan",
  "g": "kahan",
  "c": "kahan",
}


def _params():
  rng = np.random.default_rng(10)
  shapes = {"w": (16, 24), "h": (24,), "b": (24,), "k": (8, 24), "g": (24,), "c": (3,)}
  dtypes = {"w": BF16, "h": F16, "b": F32, "k": BF16, "g": F16, "c": F32}
  return {k: jnp.asarray(rng.normal(size=shapes[k]), dtypes[k]) for k in LABELS}


def _loss_scaled():
  rounding = {
    "stochastic": ols.stochastic_rounding(jax.random.key(11)),
    "kahan": ols.kahan_summation(),
  }
  # Adam's moments take the parameters' dtypes: eps=1e-8 would be 0 in float16.
  adam = optax.adam(3e-3, eps=1e-3)
  inner = {k: optax.chain(adam, r) for k, r in rounding.items()}
  return ols.dynamic_loss_scale(
    optax.multi_transform(inner, LABELS), initial_scale=2.0**8, growth_interval=3
  )


def _rounding_states(state):
  """The stochastic rounding state and the Kahan state inside ``state``."""
  kinds = (ols.StochasticRoundingState, ols.KahanSummationState)
  found = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kinds))
  found = [x for x in found if isinstance(x, kinds)]
  assert sorted(type(x).__name__ for x in found) == sorted(k.__name__ for k in kinds)
  return sorted(found, key=lambda x: kinds.index(type(x)))


def _loss(params, t, bad):
  total = 0.0
  for _, p in sorted(params.items()):
    p = p.astype(jnp.float32)
    total = total + jnp.sum(jnp.sin(p * (1.0 + 0.1 * t)) * jnp.cos(p)) / p.size
  return total * jnp.where(bad, jnp.nan, 1.0)


def _step_fn(tx, **jit_kwargs):
  def step(params, state, t, bad):
    _, grads = ols.value_and_grad(_loss)(state, params, t, bad)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, **jit_kwargs)


@functools.cache
def _optimizer():
  """``(tx, jitted step)``, compiled once for the tests below."""
  tx = _loss_scaled()
  return tx, _step_fn(tx)


def _train(step, params, state, steps, bad_steps):
  for t in steps:
    params, state = step(params, state, jnp.float32(t), t in bad_steps)
  return params, state


# float16 parameters with float16 optimizer state, on purpose (the warning
# itself: tests/test_half_state.py).
@pytest.mark.filterwarnings("ignore::optax_lossscale.HalfPrecisionStateWarning")
@pytest.mark.standard_promotion  # optax's adam
def test_a_skipped_step_changes_nothing_and_a_resumed_run_is_bit_identical():
  bad = {3, 7}
  tx, step = _optimizer()
  params = _params()
  state = tx.init(params)
  history = [(params, state)]
  for t in range(12):
    history.append(_train(step, *history[-1], [t], bad))
  for t in range(12):
    (p0, s0), (p1, s1) = history[t], history[t + 1]
    assert bool(s1.consecutive_skips > 0) == (t in bad), t
    if t in bad:  # parameters, Adam, the key, the buffers: all kept
      assert_trees_bitwise_equal(p1, p0)
      assert_trees_bitwise_equal(s1.inner_state, s0.inner_state)
      assert float(s1.loss_scale) == float(s0.loss_scale) / 2
    else:
      for k in ("w", "h", "k", "g"):
        assert not np.array_equal(p1[k], p0[k]), (t, k)
      for before, after in zip(*map(_rounding_states, (s0, s1)), strict=True):
        assert not all(map(np.array_equal, *map(jax.tree.leaves, (before, after))))
  # Split after 6 steps, through host memory, into a new optimizer and step.
  saved = jax.device_get(history[6])
  fresh = _step_fn(_loss_scaled())
  resumed = _train(fresh, *jax.device_put(saved), range(6, 12), bad)
  assert_trees_bitwise_equal(resumed, history[12])
  assert all(np.isfinite(np.asarray(p, F32)).all() for p in resumed[0].values())


# float16 parameters with float16 optimizer state, on purpose (the warning
# itself: tests/test_half_state.py).
@pytest.mark.filterwarnings("ignore::optax_lossscale.HalfPrecisionStateWarning")
@pytest.mark.standard_promotion
def test_orbax_round_trip_of_the_state(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  tx, step = _optimizer()
  params = _params()
  state = _train(step, params, tx.init(params), range(4), {2})[1]
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", state)
  checkpointer.wait_until_finished()
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, tx.init(params))
  restored = checkpointer.restore(tmp_path / "state", target)
  checkpointer.close()
  assert_trees_bitwise_equal(restored, state)
  key_state, kahan_state = _rounding_states(restored)
  assert key_state.rounding_key.dtype == np.uint32
  assert kahan_state.compensation["c"] is None  # the float32 leaf
  assert kahan_state.compensation["k"].dtype == BF16
  after = [_train(step, params, s, range(4, 6), set()) for s in (state, restored)]
  assert_trees_bitwise_equal(after[0], after[1])


# float16 parameters with float16 optimizer state, on purpose (the warning
# itself: tests/test_half_state.py).
@pytest.mark.filterwarnings("ignore::optax_lossscale.HalfPrecisionStateWarning")
@pytest.mark.standard_promotion
def test_a_donated_jit_gives_the_same_results():
  if versions.JAX < (0, 10):  # older XLAs may not reuse some donated buffers
    warnings.filterwarnings("ignore", "Some donated buffers were not usable")
  tx, step = _optimizer()
  params = _params()
  state = tx.init(params)
  buffers = {id(x) for x in jax.tree.leaves(params)}
  assert not [x for x in jax.tree.leaves(state) if id(x) in buffers]
  plain = _train(step, params, state, range(5), {1})
  copies = jax.tree.map(jnp.copy, (params, state))
  donating = _step_fn(tx, donate_argnums=(0, 1))
  donated = _train(donating, *copies, range(5), {1})
  assert_trees_bitwise_equal(donated, plain)
  assert jax.tree.leaves(copies[0])[0].is_deleted()


# --------------------------------------------------------------------------
# Keys, and bad inputs.
# --------------------------------------------------------------------------


@pytest.mark.standard_promotion
def test_every_form_of_the_key_gives_the_same_rounding():
  p, u = _realistic(BF16, seed=12, shape=(32,))
  params, updates = {"w": p}, {"w": u}

  def first_update(key):
    tx = ols.stochastic_rounding(key)
    state = tx.init(params)
    assert state.rounding_key.dtype == np.uint32
    return tx.update(updates, state, params)[0]["w"]

  forms = [
    jax.random.key(5),
    jax.random.PRNGKey(5),
    np.asarray(jax.random.PRNGKey(5)),
    5,
    np.int64(5),
    jnp.asarray(5),
  ]
  results = [np.asarray(first_update(k)) for k in forms]
  for r in results[1:]:
    np.testing.assert_array_equal(r, results[0])
  other = np.asarray(first_update(6))
  assert not np.array_equal(other, results[0])
  # Another PRNG implementation is kept: its key data has its own shape.
  rbg = jax.random.key(5, impl="rbg")
  tx = ols.stochastic_rounding(rbg)
  state = tx.init(params)
  assert state.rounding_key.shape == jax.random.key_data(rbg).shape
  _, state = jax.jit(tx.update)(updates, state, params)
  next_key, _ = jax.random.split(rbg)
  np.testing.assert_array_equal(state.rounding_key, jax.random.key_data(next_key))


def test_bad_inputs_are_value_errors():
  for key in (
    1.5,
    "0",
    None,
    True,
    2**70,
    np.zeros(3, np.uint32),  # no key of the default implementation
    np.zeros((4, 2), np.uint32),  # four raw keys
    jax.random.split(jax.random.key(0), 3),  # three typed keys
    np.zeros(2, np.int32),
    jnp.ones(2),
  ):
    with pytest.raises(ValueError, match="`key` must be"):
      ols.stochastic_rounding(key)
  params = {"w": jnp.ones(3, jnp.bfloat16)}
  updates = {"w": jnp.ones(3)}
  for name, tx in (
    ("stochastic_rounding", ols.stochastic_rounding(0)),
    ("kahan_summation", ols.kahan_summation()),
  ):
    state = tx.init(params)
    with pytest.raises(ValueError, match=f"{name} needs the parameters"):
      tx.update(updates, state)
    with pytest.raises(ValueError, match="does not match"):
      tx.update({"v": jnp.ones(3)}, state, {"w": params["w"], "v": params["w"]})
    with pytest.raises(ValueError, match=r"has shape \(2,\)"):
      tx.update({"w": jnp.ones(2)}, state, params)
    with pytest.raises(ValueError, match=r"\['w'\] is a float .*jnp.asarray"):
      tx.update({"w": 1e-3}, state, params)
  kahan = ols.kahan_summation()
  with pytest.raises(ValueError, match="made for other parameters"):
    kahan.update(updates, kahan.init({"w": jnp.ones(3)}), params)
