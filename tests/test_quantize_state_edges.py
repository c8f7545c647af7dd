"""quantize_state at its edges: bad arguments, dtypes, derivatives, extremes.

What a user tries first: arguments of the wrong kind, gradients in another
dtype than the parameters, complex parameters, differentiating through an
update, values near float32's largest, the transformation itself passed
through a tree operation (``jax.tree.map``, Equinox's ``filter_jit``), and
``dequantize_state`` of an abstract state.
"""

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols
from optax_lossscale._params import quantize_codec as codec
from optax_lossscale._params import quantize_state as q

pytestmark = pytest.mark.standard_promotion  # optax's adam and sgd

SHAPE = (16, 512)  # 8192 elements: quantised at the default min_size


def _tree(seed, dtype=jnp.float32, shape=SHAPE):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.normal(size=shape), dtype)}


# --------------------------------------------------------------------------
# Arguments.
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    ({"bits": 4}, "`bits`"),
    ({"bits": 16}, "`bits`"),
    ({"bits": True}, "`bits`"),
    ({"bits": 8.0}, "`bits`"),
    ({"bits": "8"}, "`bits`"),
    ({"block_size": 1}, "`block_size`"),
    ({"block_size": 0}, "`block_size`"),
    ({"block_size": 100}, "`block_size`"),
    ({"block_size": 2.5}, "block_size"),
    ({"block_size": 2**17}, "`block_size`"),
    ({"min_size": -1}, "`min_size`"),
    ({"min_size": "big"}, "min_size"),
    ({"store_sqrt": 1}, "`store_sqrt`"),
    ({"rounding": "random"}, "`rounding`"),
    ({"rounding": None}, "`rounding`"),
    ({"rounding": np.array(["nearest", "stochastic"])}, "`rounding`"),
  ],
)
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ols.quantize_state(optax.adam(1e-3), **kwargs)


def test_not_a_transformation():
  with pytest.raises(ValueError, match="`inner`"):
    ols.quantize_state(optax.adam)


def test_the_largest_block_is_accepted():
  tx = ols.quantize_state(optax.adam(1e-3), block_size=2**16, min_size=0)
  state = tx.init(_tree(0))
  assert state.inner_state[0].mu["w"].scales.shape == (1,)  # 8192 padded to one


# --------------------------------------------------------------------------
# Gradients in another dtype than the parameters; complex parameters.
# --------------------------------------------------------------------------

DTYPE_CASES = {
  # (parameters' dtype, gradients' dtype, whether update gets the parameters)
  "float32 params, bfloat16 grads": (jnp.float32, jnp.bfloat16, True),
  "float32 params, bfloat16 grads, no params": (jnp.float32, jnp.bfloat16, False),
  "bfloat16 params, float32 grads": (jnp.bfloat16, jnp.float32, True),
  "bfloat16 params, float32 grads, no params": (jnp.bfloat16, jnp.float32, False),
  "float16 params, float32 grads": (jnp.float16, jnp.float32, True),
}


@pytest.mark.parametrize("case", DTYPE_CASES)
def test_gradients_of_another_dtype_update_as_optax_does(case):
  """The state check compares structure and shapes, not dtypes: what optax
  itself accepts, the wrapper accepts; each update is the inner one on the
  dequantised state, and the updates follow plain Adam's."""
  p_dtype, g_dtype, with_params = DTYPE_CASES[case]
  params = _tree(0, p_dtype)
  tx, plain = ols.quantize_state(optax.adam(1e-2)), optax.adam(1e-2)
  s, r = tx.init(params), plain.init(params)
  args = (params,) if with_params else ()
  for seed in (1, 2, 3):
    g = _tree(seed, g_dtype)
    inner = q._dequantized(s.inner_state, cast=True)
    u, s = jax.jit(tx.update)(g, s, *args)
    want, _ = jax.jit(plain.update)(g, inner, *args)
    # Within XLA's excess precision: it may keep a fusion's bfloat16
    # arithmetic in float32 (quantisation errors are a hundred times more).
    np.testing.assert_allclose(u["w"], want["w"], rtol=2e-4)
    v, r = plain.update(g, r, *args)
  u, v = np.asarray(u["w"], np.float32), np.asarray(v["w"], np.float32)
  assert np.linalg.norm(u - v) < 0.02 * np.linalg.norm(v)


def test_complex_leaves_are_kept_as_the_inner_made_them():
  params = {"z": (jnp.linspace(-1, 1, 8192) + 1j * jnp.linspace(1, -1, 8192))}
  params["z"] = params["z"].astype(jnp.complex64)
  tx, plain = ols.quantize_state(optax.adam(1e-2), min_size=0), optax.adam(1e-2)
  s, r = tx.init(params), plain.init(params)
  for _ in range(2):
    u, s = tx.update(params, s, params)
    v, r = plain.update(params, r, params)
  assert not isinstance(s.inner_state[0].mu["z"], ols.QuantizedLeaf)
  np.testing.assert_array_equal(u["z"], v["z"])  # nothing quantised: optax's own


def test_encoding_a_complex_or_integer_array_is_refused():
  for x in (jnp.ones(256, jnp.complex64), jnp.ones(256, jnp.int32)):
    with pytest.raises(ValueError, match="real floating arrays"):
      codec.encode(x, 256)


# --------------------------------------------------------------------------
# Derivatives.
# --------------------------------------------------------------------------


@pytest.mark.sampled
@pytest.mark.parametrize(
  "kwargs", [{}, {"store_sqrt": False}, {"rounding": "stochastic"}], ids=str
)
@pytest.mark.parametrize("inner", ["sgd momentum", "adam"])
def test_the_stored_state_carries_no_derivative(inner, kwargs):
  """Its codes are integers: like rounding, quantising has no derivative.
  The derivative of two updates is that of the second with the state the
  first stored held constant, and finite where a block is all negative."""
  opt = optax.sgd(1.0, momentum=0.9) if inner == "sgd momentum" else optax.adam(1e-2)
  tx = ols.quantize_state(opt, min_size=0, **kwargs)
  params = {"w": jnp.zeros(512)}
  g = -jnp.linspace(1.1, 2.1, 512)  # all-negative blocks

  def second(g, state):
    return jnp.sum(tx.update({"w": g}, state, params)[0]["w"])

  def both(g):
    _, state = tx.update({"w": g}, tx.init(params), params)
    return second(g, state)

  stored = tx.update({"w": g}, tx.init(params), params)[1]
  got = jax.grad(both)(g)
  assert bool(jnp.all(jnp.isfinite(got)))
  np.testing.assert_array_equal(got, jax.grad(second)(g, stored))


def test_one_update_from_a_fresh_state_differentiates_as_optax():
  """Nothing stored is differentiated: the derivative of an update with
  respect to its gradients is the inner optimizer's."""
  g = jnp.linspace(-1.0, 1.0, 512)

  def one(g, tx):
    params = {"w": jnp.zeros(512)}
    return jnp.sum(tx.update({"w": g}, tx.init(params), params)[0]["w"] ** 2)

  opt = optax.sgd(0.5, momentum=0.9)
  got = jax.grad(one)(g, ols.quantize_state(opt, min_size=0))
  np.testing.assert_array_equal(got, jax.grad(one)(g, opt))


# --------------------------------------------------------------------------
# Values near float32's largest.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("sqrt", [True, False])
@pytest.mark.parametrize("sign", ["signed", "non-negative"])
@pytest.mark.parametrize("k", [100, 126, 127])
def test_a_huge_block_has_the_codes_of_the_same_block_scaled_down(k, sign, sqrt):
  """Scaling a block by 2**k changes its scale by exactly 2**k and no code,
  also where 1 / absmax would be below float32's normal range (2**126)."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=1024), jnp.float32)
  x = x / jnp.max(jnp.abs(x)) * 1.9  # largest magnitude 1.9: times 2**127 is finite
  if sign == "non-negative":
    x = jnp.abs(x)
    if sqrt:
      k -= k % 2  # square roots scale exactly by 2**(k / 2)
  big = x * np.float32(2.0**k)
  assert bool(jnp.all(jnp.isfinite(big)))
  small, huge = codec.encode(x, 256, sqrt), codec.encode(big, 256, sqrt)
  np.testing.assert_array_equal(huge.codes, small.codes)
  factor = 2.0 ** (k / 2 if sqrt and sign == "non-negative" else k)
  np.testing.assert_array_equal(huge.scales, small.scales * np.float32(factor))
  assert bool(jnp.any(huge.dequantize() != 0))


# --------------------------------------------------------------------------
# The transformation through tree operations; abstract states.
# --------------------------------------------------------------------------

TRANSFORMATIONS = {
  "quantize_state": lambda: ols.quantize_state(optax.adam(1e-2), min_size=0),
  "master_weights": lambda: ols.master_weights(optax.adam(1e-2)),
  "LossScaleOptimizer, Keras name": lambda: ols.porting.LossScaleOptimizer("adam"),
  "LossScaleOptimizer, optax": lambda: ols.porting.LossScaleOptimizer(optax.adam(1e-2)),
  "ExperimentalLossScaleOptimizer": lambda: ols.porting.ExperimentalLossScaleOptimizer(
    "sgd", loss_scale=128
  ),
}


@pytest.mark.parametrize("name", TRANSFORMATIONS)
def test_a_tree_operation_rebuilds_the_transformation_as_itself(name):
  tx = TRANSFORMATIONS[name]()
  same = jax.tree.map(lambda f: f, tx)
  assert type(same) is type(tx) and repr(same) == repr(tx)
  assert vars(same).keys() == vars(tx).keys()
  assert jax.tree.structure(same) == jax.tree.structure(tx)
  params = _tree(0)
  state = tx.init(params)
  got = jax.jit(same.update)(_tree(1), state, params)
  want = jax.jit(tx.update)(_tree(1), state, params)
  jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("name", TRANSFORMATIONS)
def test_equinox_filter_jit_takes_the_transformation_as_an_argument(name):
  eqx = pytest.importorskip("equinox")
  tx = TRANSFORMATIONS[name]()
  params = _tree(0)
  state = tx.init(params)
  got = eqx.filter_jit(lambda tx, g, s, p: tx.update(g, s, p))(
    tx, _tree(1), state, params
  )
  want = jax.jit(tx.update)(_tree(1), state, params)
  jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize(
  "make",
  [
    lambda: ols.quantize_state(optax.adam(1e-2)),
    lambda: ols.quantize_state(optax.adam(1e-2), layout="flat"),  # a TypeError
    lambda: ols.dynamic_loss_scale(ols.quantize_state(optax.adam(1e-2), layout="flat")),
  ],
  ids=["leaf", "flat", "flat under a loss scale"],
)
def test_dequantize_state_of_an_abstract_state(make):
  tx = make()
  params = {**_tree(0), "b": jnp.ones(7)}
  abstract = jax.eval_shape(tx.init, params)
  got = ols.dequantize_state(abstract)
  want = jax.eval_shape(lambda: ols.dequantize_state(tx.init(params)))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert (a.shape, a.dtype) == (b.shape, b.dtype)


# --------------------------------------------------------------------------
# The signed map's end: -0.993, not -1.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("spread", [False, True], ids=["constant", "spread"])
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["positive", "negative"])
@pytest.mark.parametrize(
  "name, opt, field",
  [
    ("sgd momentum 0.99", optax.sgd(1.0, momentum=0.99), "trace"),
    ("adam", optax.adam(1e-3), "mu"),
  ],
  ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_steady_gradient_keeps_its_first_moment_whatever_its_sign(
  name, opt, field, sign, spread
):
  """1000 steps of one gradient: the stored first moment stays within 1% of
  float32's, its largest magnitude within 0.1%, for either sign (a block
  whose largest magnitude was negative lost 0.7% at each requantisation:
  0.59 of float32's for momentum 0.99, 0.93 for Adam)."""
  n = 4096
  g = sign * (jnp.linspace(0.5, 1.0, n) if spread else jnp.ones(n))
  params = {"w": jnp.zeros(n)}
  tx = ols.quantize_state(opt)

  @jax.jit
  def run():
    def body(_, states):
      s, r = states
      return tx.update({"w": g}, s, params)[1], opt.update({"w": g}, r, params)[1]

    return jax.lax.fori_loop(0, 1000, body, (tx.init(params), opt.init(params)))

  state, ref = run()
  got = getattr(ols.dequantize_state(state)[0], field)["w"]
  want = getattr(ref[0], field)["w"]
  assert abs(float(got[-1] / want[-1]) - 1) < 1e-3, (name, float(got[-1] / want[-1]))
  assert abs(float(jnp.mean(got) / jnp.mean(want)) - 1) < 1e-2


def _lion_loss(rounding, steps=600):
  """Lion (b2 = 0.99) on a quadratic, float32 or 8-bit: the final loss."""
  k1, k2 = jax.random.split(jax.random.key(0))
  p0 = jax.random.normal(k1, (64, 64))
  target = jax.random.normal(k2, (64, 64)) * 0.5
  loss = lambda p: 0.5 * jnp.mean((p - target) ** 2)  # noqa: E731
  tx = optax.lion(3e-3)
  if rounding is not None:
    tx = ols.quantize_state(tx, rounding=rounding)

  @jax.jit
  def train(p, s):
    def step(carry, _):
      p, s = carry
      u, s = tx.update(jax.grad(loss)(p), s, p)
      return (optax.apply_updates(p, u), s), None

    return jax.lax.scan(step, (p, s), None, steps)[0][0]

  return float(loss(train(p0, tx.init(p0))))


def test_nearest_rounding_holds_a_slow_moment_stochastic_rounding_tracks_it():
  # The guide's caveat: rounded to nearest, a moment that moves by less than
  # half its codes' gap a step keeps its code. Lion's momentum moves 1% a
  # step and its sign is the update: 8-bit Lion stalls; stochastic rounding
  # (right on average) trains as float32 Lion does.
  exact = _lion_loss(None)
  assert _lion_loss("stochastic") <= 1.25 * exact
  assert _lion_loss("nearest") >= 3 * exact


# --------------------------------------------------------------------------
# Python numbers: jit makes them arrays, and the choice must not depend on
# whether the step is jitted.
# --------------------------------------------------------------------------


class _CountState(NamedTuple):
  count: Any  # a Python float, left one by eager updates
  m: Any


def _counting():
  """An inner transformation whose state keeps a Python float."""

  def init(params):
    return _CountState(0.0, jax.tree.map(jnp.zeros_like, params))

  def update(updates, state, params=None):
    m = jax.tree.map(lambda a, g: 0.9 * a + g, state.m, updates)
    return m, _CountState(state.count + 1.0, m)

  return optax.GradientTransformation(init, update)


def _everything(path, leaf):
  return True


def _moments_only(path, leaf):
  return getattr(path[0], "name", None) == "m"


# (inner, kwargs, params): a Python float as a parameter, or in the inner
# state unchosen or chosen. Eagerly its moment was kept while jit quantised
# it; an eager update refused a Python float in the state as made "for
# other parameters".
PYTHON_NUMBERS = {
  "a float parameter, min_size=0": (optax.adam, {"min_size": 0}, {"w": 0.5}),
  "a float in the state, not chosen": (
    _counting, {"select": _moments_only}, _tree(0)
  ),
  "a float in the state, chosen": (
    _counting, {"min_size": 0, "select": _everything}, _tree(0)
  ),
  "a float in the state, chosen, flat": (
    _counting, {"min_size": 0, "select": _everything, "layout": "flat"}, _tree(0)
  ),
}  # fmt: skip


@pytest.mark.parametrize("case", PYTHON_NUMBERS)
def test_python_numbers_are_chosen_alike_eagerly_and_under_jit(case):
  make, kwargs, params = PYTHON_NUMBERS[case]
  inner = make(0.1) if make is optax.adam else make()
  tx = ols.quantize_state(inner, **kwargs)
  grads = jax.tree.map(lambda p: 0.5 * jnp.ones_like(jnp.asarray(p)), params)
  is_stored = lambda x: isinstance(x, (q.QuantizedLeaf, q.GroupedLeaf))  # noqa: E731
  runs = {}
  for mode, (init, update) in {
    "eager": (tx.init, tx.update),
    "jit": (jax.jit(tx.init), jax.jit(tx.update)),
  }.items():
    state = init(params)
    stored = [is_stored(x) for x in jax.tree.leaves(state, is_leaf=is_stored)]
    for _ in range(2):
      updates, state = update(grads, state, params)
    runs[mode] = stored, updates
  assert runs["eager"][0] == runs["jit"][0]
  chex.assert_trees_all_close(runs["eager"][1], runs["jit"][1], rtol=1e-6)
  # a state made eagerly updates under jit, and the other way round
  jax.jit(tx.update)(grads, tx.init(params), params)
  tx.update(grads, jax.jit(tx.init)(params), params)


@pytest.mark.parametrize("layout", ["leaf", "flat"])
@pytest.mark.parametrize(
  "number",
  [0.3, np.float32(0.3)],
  ids=["Python float", "NumPy float32"],
)
def test_a_python_number_gradient_is_taken_eagerly_as_under_jit(layout, number):
  """optax takes a Python number as a gradient: so does every layout, eagerly
  too (the flat layout's eager update crashed reshaping it)."""
  params = {"w": 1.5, "x": jnp.ones(300)}
  grads = {"w": number, "x": jnp.full(300, 0.5)}
  tx = ols.quantize_state(optax.adam(1e-2), min_size=0, layout=layout)
  want, _ = optax.adam(1e-2).update(grads, optax.adam(1e-2).init(params), params)
  for update in (tx.update, jax.jit(tx.update)):
    got, _ = update(grads, tx.init(params), params)
    chex.assert_trees_all_close(got, want, rtol=1e-6)


def test_injected_layout_arguments_are_refused_naming_static_args():
  """optax.inject_hyperparams makes every number an array, ``bits`` and
  ``block_size`` too ("`bits` must be one of (8,), got Array(8)")."""
  tx = optax.inject_hyperparams(ols.quantize_state)(optax.adam(1e-3))
  with pytest.raises(
    ValueError, match=r"static_args=\('bits', 'block_size', 'min_size'\)"
  ):
    tx.init({"w": jnp.ones(8)})
