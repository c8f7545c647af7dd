"""The functional core: finite check, unscale, the adjust rule, the classes."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols
from optax_lossscale._loss_scale import core as _core

FLOATS = [jnp.float16, jnp.bfloat16, jnp.float32]


# --- all_finite -----------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
@pytest.mark.parametrize("jit", [False, True])
def test_all_finite_detects_each_bad_value(dtype, bad, jit):
  check = jax.jit(ols.all_finite) if jit else ols.all_finite
  tree = {"a": jnp.ones((3, 4), dtype), "b": [jnp.zeros(5, jnp.float32)]}
  assert bool(check(tree))
  tree["a"] = tree["a"].at[2, 1].set(bad)
  assert not bool(check(tree))


def test_all_finite_mixed_infinities_and_large_values():
  # +inf and -inf in one leaf must not cancel; huge finite values must not
  # overflow the reduction into a false alarm.
  big = jnp.full((1000,), jnp.finfo(jnp.float32).max, jnp.float32)
  assert bool(jax.jit(ols.all_finite)([big, -big]))
  f16_big = jnp.full((100_000,), 65504.0, jnp.float16)
  assert bool(jax.jit(ols.all_finite)(f16_big))
  assert not bool(ols.all_finite(jnp.array([jnp.inf, -jnp.inf])))


def test_all_finite_ignores_non_float_leaves():
  float0 = np.zeros((2,), dtype=jax.dtypes.float0)
  tree = {
    "none": None,
    "int": jnp.array([1, 2], jnp.int32),
    "bool": jnp.array([True]),
    "float0": float0,
    "masked": optax.MaskedNode(),
    "f": jnp.ones(2),
  }
  assert bool(ols.all_finite(tree))
  assert bool(ols.all_finite({}))
  assert bool(ols.all_finite([None, optax.MaskedNode()]))
  tree["f"] = jnp.array([1.0, jnp.nan])
  assert not bool(ols.all_finite(tree))


def test_all_finite_complex():
  assert bool(ols.all_finite(jnp.array([1 + 2j], jnp.complex64)))
  assert not bool(ols.all_finite(jnp.array([complex(1, np.inf)], jnp.complex64)))


@pytest.mark.parametrize("chunk", [-1, 0, 2.0, True, "3", None])
@pytest.mark.parametrize("jit", [False, True])
def test_all_finite_refuses_a_chunk_that_is_not_a_positive_integer(chunk, jit):
  """``chunk=-1`` once made no reduction at all: a NaN tree was finite."""
  leaves = [jnp.array([jnp.nan])] * 5  # one size: combined chunk by chunk
  check = functools.partial(ols.all_finite, chunk=chunk)
  with pytest.raises(ValueError, match="`chunk` must be an integer"):
    (jax.jit(check) if jit else check)(leaves)
  assert not bool(ols.all_finite(leaves, chunk=1))


# --- NumPy leaves ------------------------------------------------------------

_NUMPY_LAYOUTS = {  # the check's three paths: concatenated, combined, alone
  "small": lambda x: [x[:3]],
  "4 of one size": lambda x: [x[:3]] * 4,
  "large": lambda x: [np.resize(x, 70_000)],
  "beside an empty leaf": lambda x: [x[:0], x[:3]],
}


def _numpy_leaf(dtype, value):
  x = np.ones(5, dtype)
  x[1] = value
  return x


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("layout", list(_NUMPY_LAYOUTS))
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 1e300, 2.0])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, jnp.bfloat16])
def test_numpy_leaves_are_checked_as_jax_holds_them(dtype, value, layout):
  """A NumPy leaf is checked as the array JAX makes of it (float64 is
  float32 unless x64 is on, where 1e300 overflows to inf), eagerly, under
  jit and in the loss scale's step; a float64 leaf's bits were once tested
  as 32-bit words, and a NaN passed."""
  if dtype != np.float64 and value == 1e300:
    pytest.skip("1e300 is a float64 value")
  leaves = _NUMPY_LAYOUTS[layout](_numpy_leaf(dtype, value))
  finite = all(np.isfinite(np.asarray(jnp.asarray(x))).all() for x in leaves)
  assert bool(ols.all_finite(leaves)) == finite
  assert bool(jax.jit(ols.all_finite)(leaves)) == finite
  # Closed over by a jitted function, beside a traced leaf.
  beside = jax.jit(lambda g: ols.all_finite([g, *leaves]))
  assert bool(beside(jnp.ones(2))) == finite
  if layout == "small":  # a NumPy scalar
    assert bool(ols.all_finite([dtype(value)])) == bool(
      np.isfinite(jnp.asarray(dtype(value)))
    )
  tx = ols.dynamic_loss_scale(optax.sgd(1.0))
  params = [jnp.ones(x.shape) for x in leaves]
  state = tx.init(params)
  updates, new = tx.update(leaves, state, params)
  assert bool(new.loss_scale < state.loss_scale) != finite
  for u in updates:
    assert np.isfinite(np.asarray(u)).all() and (finite or not np.asarray(u).any())


# --- unscale ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
def test_unscale_keeps_dtypes_and_divides_in_float32(dtype):
  scale = jnp.asarray(2.0**15, jnp.float32)
  g = jnp.array([2.0**15, 3.0 * 2.0**14], dtype)
  out = jax.jit(ols.unscale)({"g": g, "i": jnp.arange(2), "n": None}, scale)
  assert out["g"].dtype == dtype
  chex.assert_trees_all_equal(out["g"], jnp.array([1.0, 1.5], dtype))
  chex.assert_trees_all_equal(out["i"], jnp.arange(2))
  assert out["n"] is None


def _divisions(fn, *args):
  eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
  return sum(e.primitive.name == "div" for e in eqns)


@pytest.mark.parametrize("factor, divisors", [(None, 1), (4.0, 2)])
@pytest.mark.parametrize("n", [3, 40])
def test_unscale_divides_once_per_divisor_whatever_the_leaves(factor, divisors, n):
  """The reciprocal is computed once per divisor and computing dtype (float32
  for float32, bfloat16 and float16 leaves alike), not once per leaf: a tree
  of n leaves traces the same divisions as a tree of one."""
  dtypes = [jnp.float32, jnp.bfloat16, jnp.float16]
  tree = [jnp.full((i + 1,), 3.0 * 2.0**4, dtypes[i % 3]) * (i + 1) for i in range(n)]
  scale = jnp.asarray(2.0**10, jnp.float32)

  def unscaled(t, s):
    return _core.unscale_tree(t, s, factor)

  assert _divisions(unscaled, tree, scale) == divisors
  # The values are each leaf's own division (the unshared form).
  out = jax.jit(unscaled)(tree, scale)
  for x, y in zip(tree, out, strict=True):
    want = np.asarray(x, np.float32) * np.float32(1 / 2.0**10)
    if factor is not None:
      want = want.astype(x.dtype).astype(np.float32) * np.float32(1 / factor)
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(y), want.astype(x.dtype))


def test_unscale_half_goes_through_float32():
  # 60000 (float16) / 0.5 overflows float16 but not float32; the cast back to
  # float16 must then give inf. 1e-7 * 2**-10 computed in float16 underflows,
  # in float32 and cast back it is the nearest subnormal.
  g = jnp.array([60000.0], jnp.float16)
  assert jnp.isinf(ols.unscale(g, jnp.float32(0.5)))[0]
  # A scale above float16's range (2**20) must not become inf in the division.
  out = ols.unscale(jnp.array([2.0**15], jnp.float16), jnp.float32(2.0**20))
  assert float(out[0]) == 2.0**-5
  tiny = jnp.array([2.0**-14], jnp.float16)
  out = ols.unscale(tiny, jnp.float32(2.0**10))
  assert float(out[0]) == 2.0**-24


# A loss scale that is not one real number: a vector broadcast silently, a
# string was read as a number, a state failed inside JAX.
BAD_DIVISORS = {
  "a vector": (jnp.ones(3), "one real number"),
  "a 1-element vector": (jnp.ones((1,)), "one real number"),
  "a string": ("8", "one real number"),
  "a bool": (True, "one real number"),
  "None": (None, "one real number"),
  "a complex number": (jnp.complex64(8), "one real number"),
  "the state": ("state", "pass the scale it holds"),
}


@pytest.mark.parametrize("case", BAD_DIVISORS)
def test_unscale_takes_one_real_number(case):
  g = {"w": jnp.ones(3)}
  bad, match = BAD_DIVISORS[case]
  if bad == "state":
    bad = ols.dynamic_loss_scale(optax.sgd(1.0)).init(g)
  with pytest.raises(ValueError, match=match):
    ols.unscale(g, bad)
  for good in (8, 8.0, jnp.int32(8), jnp.float16(8), np.float32(8)):
    np.testing.assert_array_equal(ols.unscale(g, good)["w"], 0.125)


# --- validation -------------------------------------------------------------

BAD_DYNAMIC = [
  (dict(initial_scale=0.0), "initial_scale"),
  (dict(initial_scale=-1.0), "initial_scale"),
  (dict(initial_scale=float("inf")), "initial_scale"),
  (dict(initial_scale=float("nan")), "initial_scale"),
  (dict(initial_scale=1e-45), "initial_scale"),  # subnormal in float32
  (dict(initial_scale="big"), "initial_scale"),
  (dict(initial_scale=2.0**30), "initial_scale"),  # above max_scale
  (dict(initial_scale=0.5), "initial_scale"),  # below min_scale
  (dict(growth_interval=0), "growth_interval"),
  (dict(growth_interval=-3), "growth_interval"),
  (dict(growth_interval=2.5), "growth_interval"),
  (dict(growth_interval=True), "growth_interval"),
  (dict(growth_interval=2**31), "growth_interval"),
  (dict(growth_factor=1.0), "growth_factor"),
  (dict(growth_factor=0.5), "growth_factor"),
  (dict(growth_factor=float("inf")), "growth_factor"),
  (dict(backoff_factor=0.0), "backoff_factor"),
  (dict(backoff_factor=1.0), "backoff_factor"),
  (dict(backoff_factor=-0.5), "backoff_factor"),
  (dict(backoff_factor=float("nan")), "backoff_factor"),
  (dict(min_scale=0.0), "min_scale"),
  (dict(min_scale=-1.0), "min_scale"),
  (dict(max_scale=float("inf")), "max_scale"),
  (dict(max_scale=1e39), "max_scale"),  # inf in float32
  (dict(min_scale=8.0, max_scale=4.0, initial_scale=4.0), "min_scale"),
  (dict(hysteresis=0), "hysteresis"),
  (dict(hysteresis=1.5), "hysteresis"),
]


@pytest.mark.parametrize(("kwargs", "name"), BAD_DYNAMIC)
def test_invalid_dynamic_configuration_names_the_argument(kwargs, name):
  with pytest.raises(ValueError, match=name):
    ols.porting.DynamicLossScale(**kwargs)
  with pytest.raises(ValueError, match=name):
    ols.dynamic_loss_scale(optax.sgd(0.1), **kwargs)


def test_invalid_value_is_in_message():
  with pytest.raises(ValueError, match=r"growth_interval.*-3"):
    ols.porting.DynamicLossScale(growth_interval=-3)
  with pytest.raises(ValueError, match=r"backoff_factor.*1\.5"):
    ols.porting.DynamicLossScale(backoff_factor=1.5)


def test_traced_hyper_parameter_is_rejected():
  @jax.jit
  def f(x):
    return ols.porting.DynamicLossScale(initial_scale=x)

  with pytest.raises(ValueError, match="initial_scale"):
    f(jnp.float32(4.0))


@pytest.mark.parametrize("scale", [0.0, -2.0, float("inf"), float("nan"), None])
def test_invalid_static_scale(scale):
  with pytest.raises(ValueError, match="scale"):
    ols.porting.StaticLossScale(scale)
  with pytest.raises(ValueError, match="scale"):
    ols.static_loss_scale(optax.sgd(0.1), scale)


def test_invalid_skip_nonfinite():
  with pytest.raises(ValueError, match="skip_nonfinite"):
    ols.porting.StaticLossScale(4.0, skip_nonfinite="yes")


def test_numpy_and_jax_concrete_numbers_are_accepted():
  ls = ols.porting.DynamicLossScale(np.float32(1024.0), growth_interval=np.int64(10))
  assert ls.config.initial_scale == 1024.0 and ls.config.growth_interval == 10


# --- the rule ---------------------------------------------------------------


def _run(ls, pattern, jit=True):
  adjust = jax.jit(lambda s, f: s.adjust(f)) if jit else (lambda s, f: s.adjust(f))
  scales, applied = [], []
  for finite in pattern:
    ls, ok = adjust(ls, jnp.asarray(finite))
    scales.append(float(ls()))
    applied.append(bool(ok))
  return ls, scales, applied


@pytest.mark.parametrize("jit", [False, True])
def test_growth_happens_on_the_growth_interval_th_finite_step(jit):
  ls = ols.porting.DynamicLossScale(8.0, growth_interval=3)
  ls, scales, applied = _run(ls, [True] * 7, jit)
  # Grows *at* step 3 and 6 (Keras/torch), not one step later (Flax).
  assert scales == [8, 8, 16, 16, 16, 32, 32]
  assert applied == [True] * 7
  assert int(ls.good_steps) == 1


def test_backoff_resets_good_steps_and_counts_skips():
  ls = ols.porting.DynamicLossScale(8.0, growth_interval=3)
  ls, scales, applied = _run(ls, [True, True, False, True, True, True, False, False])
  assert scales == [8, 8, 4, 4, 4, 8, 4, 2]
  assert applied == [True, True, False, True, True, True, False, False]
  assert int(ls.skipped_steps) == 3
  assert int(ls.consecutive_skips) == 2
  assert int(ls.good_steps) == 0


def test_hysteresis_tolerates_h_minus_one_bad_steps_and_refills_on_growth():
  ls = ols.porting.DynamicLossScale(64.0, growth_interval=2, hysteresis=3)
  pattern = [False, False, False, False, True, True, False, False, False]
  ls, scales, applied = _run(ls, pattern)
  assert scales == [64, 64, 32, 16, 16, 32, 32, 32, 16]
  assert applied == pattern
  assert int(ls.hysteresis_left) == 0


def test_extreme_scales_unscale_exactly():
  # At both ends of the allowed range the unscale is exact (a reciprocal that
  # XLA flushes to zero would make these 0 or inf).
  for scale, value in ((2.0**126, 0.25), (2.0**-126, 4.0)):
    g = jnp.full((4,), value * scale, jnp.float32)  # a normal float32
    out = jax.jit(ols.unscale)(g, jnp.float32(scale))
    chex.assert_trees_all_equal(out, jnp.full((4,), value, jnp.float32))


def test_clamps_never_zero_subnormal_nan_or_inf():
  ls = ols.porting.DynamicLossScale(
    2.0**15,
    growth_interval=1,
    min_scale=2.0**-126,
    max_scale=2.0**126,
  )
  step = jax.jit(lambda s, f: s.adjust(f)[0])
  for _ in range(400):
    ls = step(ls, jnp.asarray(False))
  assert float(ls()) == 2.0**-126  # the smallest normal, never 0 or subnormal
  for _ in range(400):
    ls = step(ls, jnp.asarray(True))
  assert float(ls()) == 2.0**126
  assert np.isfinite(float(ls()))


def test_default_clamps():
  ls = ols.porting.DynamicLossScale(growth_interval=1)
  step = jax.jit(lambda s, f: s.adjust(f)[0])
  for _ in range(100):
    ls = step(ls, jnp.asarray(True))
  assert float(ls()) == ols.DEFAULT_MAX_SCALE
  for _ in range(100):
    ls = step(ls, jnp.asarray(False))
  assert float(ls()) == ols.DEFAULT_MIN_SCALE


def test_counters_saturate():
  big = jnp.iinfo(jnp.int32).max
  ls = ols.porting.DynamicLossScale(4.0, min_scale=1.0)
  ls = ls.replace(
    ls.counters._replace(
      skipped_steps=jnp.asarray(big, jnp.int32),
      consecutive_skips=jnp.asarray(big, jnp.int32),
    )
  )
  ls, _ = ls.adjust(jnp.asarray(False))
  assert int(ls.skipped_steps) == big and int(ls.consecutive_skips) == big


def test_state_dtypes_are_explicit():
  ls = ols.porting.DynamicLossScale()
  ls, _ = jax.jit(lambda s: s.adjust(jnp.asarray(False)))(ls)
  assert ls.loss_scale.dtype == jnp.float32 and ls.loss_scale.shape == ()
  for name in ("good_steps", "hysteresis_left", "skipped_steps", "consecutive_skips"):
    assert getattr(ls, name).dtype == jnp.int32, name


def test_update_takes_unscaled_grads_and_returns_should_apply():
  ls = ols.porting.DynamicLossScale(16.0, growth_interval=2)
  grads = ls.unscale({"w": jnp.array([32.0]), "n": None})
  ls2, ok = jax.jit(lambda s, g: s.update(g))(ls, grads)
  assert bool(ok) and int(ls2.good_steps) == 1
  ls3, ok = ls2.update({"w": jnp.array([jnp.nan])})
  assert not bool(ok) and float(ls3()) == 8.0


def test_scale_loss_is_float32_for_half_losses():
  ls = ols.porting.DynamicLossScale(2.0**15)
  out = ls.scale_loss(jnp.float16(4.0))  # 131072 would be inf in float16
  assert out.dtype == jnp.float32 and float(out) == 131072.0


# --- pytree behaviour (jmp dropped min_loss_scale under jit) -----------------


def test_config_survives_jit_and_tree_map():
  ls = ols.porting.DynamicLossScale(
    1024.0,
    growth_interval=7,
    growth_factor=3.0,
    backoff_factor=0.25,
    min_scale=2.0,
    max_scale=4096.0,
    hysteresis=2,
  )
  out = jax.jit(lambda s: s)(ls)
  assert type(out) is ols.porting.DynamicLossScale and out.config == ls.config
  out = jax.tree.map(lambda x: x, ls)
  assert out.config == ls.config
  leaves, treedef = jax.tree.flatten(ls)
  assert len(leaves) == 5
  assert jax.tree.unflatten(treedef, leaves).config == ls.config
  paths = [
    jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ls)[0]
  ]
  # The one child is the LossScaleState (found by get_scale's search).
  assert paths == [
    ".counters.loss_scale",
    ".counters.good_steps",
    ".counters.hysteresis_left",
    ".counters.skipped_steps",
    ".counters.consecutive_skips",
  ]


def test_no_retrace_when_scale_changes():
  traces = []

  @jax.jit
  def step(ls, g):
    traces.append(1)
    return ls.update(ls.unscale(g))

  ls = ols.porting.DynamicLossScale(8.0, growth_interval=1)
  for bad in [False, True, False, False, True]:
    g = jnp.array([jnp.nan if bad else 1.0])
    ls, _ = step(ls, g)
  assert len(traces) == 1


# --- static and no-op -------------------------------------------------------


def test_static_scale_never_changes_and_skips():
  ls = ols.porting.StaticLossScale(128.0)
  ls, scales, applied = _run(ls, [True, False, False, True])
  assert scales == [128.0] * 4
  assert applied == [True, False, False, True]
  assert int(ls.skipped_steps) == 2 and int(ls.consecutive_skips) == 0


def test_static_without_skip_always_applies_like_fixed_loss_scale():
  ls = ols.porting.StaticLossScale(128.0, skip_nonfinite=False)
  ls, scales, applied = _run(ls, [True, False, True])
  assert applied == [True, True, True]
  assert int(ls.skipped_steps) == 0


def test_noop_does_nothing():
  ls = ols.porting.NoOpLossScale()
  g = {"w": jnp.array([1.5, jnp.nan], jnp.bfloat16)}
  assert ls.unscale(g) is g
  assert float(ls()) == 1.0
  new, ok = ls.update(g)
  assert bool(ok) and new is ls
  assert ls.scale_loss(jnp.float32(3.0)) == 3.0


def test_reduce_flag_over_vmap_axis():
  flags = jnp.array([True, False, True])
  out = jax.vmap(lambda f: _core.reduce_flag(f, "i"), axis_name="i")(flags)
  assert not bool(out.any())
  out = jax.vmap(lambda f: _core.reduce_flag(f, "i"), axis_name="i")(jnp.ones(3, bool))
  assert bool(out.all())


def test_all_finite_with_empty_leaves():
  assert bool(ols.all_finite([jnp.zeros((0,)), jnp.zeros((0, 3))]))
  assert not bool(ols.all_finite([jnp.array([jnp.nan]), jnp.zeros((0,))]))
  assert not bool(ols.all_finite([jnp.zeros((0,)), jnp.array([1.0, jnp.inf])]))
  # Several sizes, the non-finite entry in each position in turn.
  tree = [
    jnp.ones((5,)),
    jnp.ones((3, 2)),
    jnp.zeros((0,)),
    jnp.ones((7,), jnp.float16),
  ]
  assert bool(jax.jit(ols.all_finite)(tree))
  for i in (0, 1, 3):
    bad = list(tree)
    bad[i] = bad[i].ravel().at[0].set(jnp.nan).reshape(bad[i].shape)
    assert not bool(jax.jit(ols.all_finite)(bad)), i


@pytest.mark.parametrize(
  "name", ["initial_scale", "growth_interval", "growth_factor", "backoff_factor"]
)
def test_none_is_not_a_default(name):
  with pytest.raises(ValueError, match=name):
    ols.porting.DynamicLossScale(**{name: None})


def test_replace_takes_a_state_or_the_five_counters():
  ls = ols.porting.DynamicLossScale(4.0)
  other = ols.porting.DynamicLossScale(8.0)
  assert float(ls.replace(other.counters)()) == 8.0
  assert float(ls.replace(tuple(jax.tree.leaves(other)))()) == 8.0
  assert ls.replace(other.counters).config == ls.config
  with pytest.raises(ValueError, match="5 counters"):
    ls.replace(tuple(jax.tree.leaves(other))[:4])


@pytest.mark.parametrize(
  "leaf", [float("nan"), 8.0, 3, True, 1j, "not an array", object()]
)
def test_leaves_that_are_not_arrays_are_refused_by_name(leaf):
  """A Python float NaN was once neither checked nor unscaled, and applied."""
  tree = {"w": jnp.ones(2), "b": leaf}
  with pytest.raises(ValueError, match=r"leaf at \['b'\] is a .*not an array"):
    ols.all_finite(tree)
  with pytest.raises(ValueError, match=r"\['b'\]"):
    ols.unscale(tree, 8.0)
  tx = ols.dynamic_loss_scale(optax.sgd(1.0), initial_scale=8.0)
  params = {"w": jnp.ones(2), "b": jnp.ones(())}
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"\['b'\]"):
    tx.update(tree, state, params)


@pytest.mark.parametrize(
  "kwargs, name",
  [
    ({"growth_factor": 1 + 1e-9}, "growth_factor"),  # 1.0 in float32
    ({"growth_factor": 1e39}, "growth_factor"),  # inf in float32
    ({"backoff_factor": 1 - 1e-9}, "backoff_factor"),  # 1.0 in float32
    ({"backoff_factor": 1e-46}, "backoff_factor"),  # 0.0 in float32
    ({"initial_scale": 2.0**126 * (1 + 2.0**-22)}, "initial_scale"),
    ({"max_scale": 2.0**-127}, "max_scale"),
  ],
)
def test_factors_and_scales_are_validated_as_float32(kwargs, name):
  with pytest.raises(ValueError, match=name):
    ols.porting.DynamicLossScale(**kwargs)
  with pytest.raises(ValueError, match=name):
    ols.dynamic_loss_scale(optax.sgd(1.0), **kwargs)


def test_the_config_holds_the_float32_numbers_it_computes_with():
  c = ols.porting.DynamicLossScale(
    growth_factor=1 + 2.0**-20, backoff_factor=0.1
  ).config
  assert c.growth_factor == float(np.float32(1 + 2.0**-20)) > 1
  assert c.backoff_factor == float(np.float32(0.1))


_F32MAX_POW2 = 2.0**127
# (case, growth_factor, scale, finite, the next scale by TensorFlow's rule)
TENSORFLOW_BOUNDS = [
  ("grows below 1", 2.0, 0.25, True, np.float32(0.25) * np.float32(2.0)),
  ("backs off from below 1 to 1", 2.0, 0.25, False, 1.0),
  ("backs off to no less than 1", 2.0, 1.5, False, 1.0),
  ("backs off by the factor", 4.0, 2.0**10, False, 2.0**8),
  # growth only up to max_scale (TensorFlow's: while finite; the porting
  # package's max_scale is 2**126, whose reciprocal is still normal)
  ("grows to max_scale", 2.0, 2.0**23, True, 2.0**24),
  ("stays where growth passes max_scale", 2.0, 2.0**24, True, 2.0**24),
  ("stays where growth would pass max_scale", 3.0, 2.0**23, True, 2.0**23),
  ("stays where growth overflows", 2.0, _F32MAX_POW2, True, _F32MAX_POW2),
]


@pytest.mark.parametrize(
  "case, factor, scale, finite, expected",
  TENSORFLOW_BOUNDS,
  ids=[c[0] for c in TENSORFLOW_BOUNDS],
)
def test_adjust_with_tensorflow_bounds(case, factor, scale, finite, expected):
  config = ols.LossScaleConfig(
    initial_scale=1.0,
    growth_interval=1,
    growth_factor=factor,
    backoff_factor=float(np.float32(1.0 / factor)),
    min_scale=1.0,
    max_scale=2.0**24,
    bounds="tensorflow",
  )
  state = _core.initial_state(config)._replace(
    loss_scale=jnp.asarray(scale, jnp.float32)
  )
  new, apply = jax.jit(_core.adjust, static_argnums=2)(state, finite, config)
  assert float(new.loss_scale) == float(expected)
  assert bool(apply) == finite
  # The default clamps the same step into [min_scale, max_scale].
  clamped = _core.adjust(state, finite, dataclasses.replace(config, bounds="clamp"))
  assert 1.0 <= float(clamped[0].loss_scale) <= 2.0**24


@pytest.mark.parametrize("bounds", ["Clamp", "tf", "", None, 1])
def test_a_config_with_unknown_bounds_is_refused(bounds):
  with pytest.raises(ValueError, match="`bounds` must be one of"):
    ols.LossScaleConfig(bounds=bounds)
