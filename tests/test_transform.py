"""The optax transformations and the helpers around them."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

FLOATS = [jnp.float16, jnp.bfloat16, jnp.float32]


def _params(dtype=jnp.float32):
  return {
    "w": jnp.arange(6, dtype=dtype).reshape(2, 3) / 10,
    "b": jnp.ones((3,), dtype),
  }


def _scaled_grads(params, scale, bad=None):
  g = jax.tree.map(lambda p: (jnp.ones_like(p) * 0.25 * scale).astype(p.dtype), params)
  if bad is not None:
    g["w"] = g["w"].at[0, 0].set(bad)
  return g


def _update(tx, jit):
  return jax.jit(tx.update) if jit else tx.update


# float16 parameters with float16 optimizer state, on purpose (the warning
# itself: tests/test_half_state.py).
@pytest.mark.sampled
@pytest.mark.filterwarnings("ignore::optax_lossscale.HalfPrecisionStateWarning")
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", FLOATS)
def test_finite_step_equals_inner_on_unscaled_grads(dtype, jit):
  params = _params(dtype)
  inner = optax.sgd(0.5, momentum=0.9)
  tx = ols.dynamic_loss_scale(inner, initial_scale=2.0**10)
  init = jax.jit(tx.init) if jit else tx.init
  state = init(params)
  grads = _scaled_grads(params, 2.0**10)
  updates, state = _update(tx, jit)(grads, state, params)

  ref_updates, ref_inner = inner.update(
    jax.tree.map(lambda g: (g.astype(jnp.float32) / 2.0**10).astype(g.dtype), grads),
    inner.init(params),
    params,
  )
  chex.assert_trees_all_equal(updates, ref_updates)
  chex.assert_trees_all_equal(state.inner_state, ref_inner)
  chex.assert_trees_all_equal_dtypes(updates, params)
  assert int(state.good_steps) == 1 and int(state.skipped_steps) == 0


# float16 parameters with float16 optimizer state, on purpose (the warning
# itself: tests/test_half_state.py).
@pytest.mark.sampled
@pytest.mark.filterwarnings("ignore::optax_lossscale.HalfPrecisionStateWarning")
@pytest.mark.standard_promotion  # optax's adam / schedules
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_nonfinite_step_is_skipped(dtype, bad, jit):
  params = _params(dtype)
  tx = ols.dynamic_loss_scale(optax.adam(1e-2), initial_scale=2.0**8)
  state = tx.init(params)
  update = _update(tx, jit)
  # One good step so the inner state is not all zeros.
  _, state = update(_scaled_grads(params, 2.0**8), state, params)
  before = state
  updates, state = update(_scaled_grads(params, 2.0**8, bad), state, params)

  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
  chex.assert_trees_all_equal_dtypes(updates, params)
  chex.assert_trees_all_equal(state.inner_state, before.inner_state)
  assert float(state.loss_scale) == 2.0**7
  assert int(state.skipped_steps) == 1 and int(state.consecutive_skips) == 1
  new_params = optax.apply_updates(params, updates)
  chex.assert_trees_all_equal(new_params, params)


@pytest.mark.standard_promotion  # optax's adam / schedules
def test_long_nonfinite_run_never_touches_params_or_inner_state():
  params = _params()
  tx = ols.dynamic_loss_scale(optax.adamw(1e-2), min_scale=2.0**-20)
  state = tx.init(params)
  update = jax.jit(tx.update)
  _, state = update(_scaled_grads(params, 2.0**15), state, params)
  inner0 = state.inner_state
  p = params
  for i in range(300):
    g = _scaled_grads(params, 1.0, jnp.nan if i % 2 else jnp.inf)
    u, state = update(g, state, p)
    p = optax.apply_updates(p, u)
  chex.assert_trees_all_equal(p, params)
  chex.assert_trees_all_equal(state.inner_state, inner0)
  assert float(state.loss_scale) == 2.0**-20
  assert int(state.consecutive_skips) == 300


def test_long_finite_run_never_reaches_inf():
  params = _params()
  tx = ols.dynamic_loss_scale(optax.sgd(1e-3), growth_interval=1)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for _ in range(200):
    _, state = update(_scaled_grads(params, 1.0), state, params)
  assert float(state.loss_scale) == ols.DEFAULT_MAX_SCALE


@pytest.mark.standard_promotion  # optax's adam / schedules
def test_schedule_does_not_advance_on_skipped_steps():
  sched = optax.linear_schedule(1.0, 0.0, 10)
  params = {"w": jnp.zeros(())}
  tx = ols.dynamic_loss_scale(optax.sgd(sched), initial_scale=4.0, growth_interval=100)
  state = tx.init(params)
  update = jax.jit(tx.update)
  lrs = []
  for bad in [False, True, True, False, False]:
    g = {"w": jnp.float32(jnp.nan) if bad else ols.get_scale(state) * 1.0}
    u, state = update(g, state, params)
    lrs.append(-float(u["w"]))
  # Applied steps see lr 1.0, 0.9, 0.8: the two skips did not consume any.
  np.testing.assert_allclose(lrs, [1.0, 0.0, 0.0, 0.9, 0.8], rtol=1e-6)
  assert int(optax.tree.get(state, "count")) == 3


# A state leaf's kind at init and as the update returns it: a skipped step
# keeps the old value whenever either is an array; two Python numbers are
# static leaves, and the new one is taken (nothing can select them).
LEAF_ORIGINS = {
  "Python int, then an array": (0, lambda c: jnp.asarray(c, jnp.int32) + 1, False),
  "Python float, then an array": (
    0.5,
    lambda c: jnp.asarray(c, jnp.float32) * 2,
    False,
  ),
  "NumPy scalar, then an array": (np.int32(3), lambda c: jnp.asarray(c) + 1, False),
  "an array, then a Python number": (jnp.float32(2.0), lambda c: 7.0, False),
  "Python ints (static)": (0, lambda c: c + 1, True),
}


def _inner_with_leaf(start, step, tag=None):
  def init(params):
    state = {"leaf": start, "m": jax.tree.map(jnp.zeros_like, params)}
    return state if tag is None else {**state, "tag": tag}

  def update(updates, state, params=None):
    del params
    m = jax.tree.map(lambda m, g: 0.5 * m + g, state["m"], updates)
    return jax.tree.map(jnp.negative, m), {**state, "leaf": step(state["leaf"]), "m": m}

  return optax.GradientTransformation(init, update)


def _skipped_and_applied(tx, params, how):
  """The inner states after a non-finite step then a finite one, run as
  ``how`` says: op by op, or init and both updates in one jax.jit (a Python
  number in the state is then still one when update reads it)."""
  bad = {"w": jnp.array([jnp.inf, 1.0])}
  good = {"w": jnp.array([4.0, 8.0])}

  def run(params):
    state = tx.init(params)
    u1, s1 = tx.update(bad, state, params)
    _, s2 = tx.update(good, s1, params)
    inner = [
      {k: v for k, v in s.inner_state.items() if k != "tag"} for s in (state, s1, s2)
    ]
    return u1, inner, [s1.skipped_steps, s2.skipped_steps]

  return jax.jit(run)(params) if how == "one jit" else run(params)


@pytest.mark.filterwarnings("ignore::optax_lossscale.SkipFallbackWarning")
@pytest.mark.parametrize("how", ["op by op", "one jit"])
@pytest.mark.parametrize(
  "entry",
  [
    "dynamic_loss_scale",
    "static_loss_scale",
    "dynamic_loss_scale, its fallback",  # a string leaf: select_after
  ],
)
@pytest.mark.parametrize("origin", LEAF_ORIGINS)
def test_a_skipped_step_keeps_every_leaf_an_array_was_made_of(origin, entry, how):
  start, step, static = LEAF_ORIGINS[origin]
  inner = _inner_with_leaf(start, step, "tag" if "fallback" in entry else None)
  if entry.startswith("static"):
    tx = ols.static_loss_scale(inner, 4.0)
  else:
    tx = ols.dynamic_loss_scale(inner, initial_scale=4.0)
  params = {"w": jnp.ones(2)}
  u1, (s0, s1, s2), skipped = _skipped_and_applied(tx, params, how)
  assert [int(n) for n in skipped] == [1, 1]
  chex.assert_trees_all_equal(u1, {"w": jnp.zeros(2)})
  chex.assert_trees_all_equal(s1["m"], s0["m"])
  if static:  # taken from the update: it advances
    assert s1["leaf"] == step(start)
    assert how == "one jit" or type(s1["leaf"]) is int  # jit's outputs are arrays
  else:
    assert float(s1["leaf"]) == float(start)  # kept
  assert float(s2["leaf"]) == float(step(s1["leaf"]))


@pytest.mark.standard_promotion  # optax's adam / schedules
def test_no_retrace_when_scale_or_counters_change():
  params = _params()
  tx = ols.dynamic_loss_scale(
    optax.adam(1e-3), initial_scale=4.0, growth_interval=2, hysteresis=2
  )
  state = tx.init(params)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(grads, state, params):
    return tx.update(grads, state, params)

  for bad in [None, jnp.inf, jnp.inf, None, None, None, jnp.nan, None]:
    _, state = step(_scaled_grads(params, 1.0, bad), state, params)
  assert int(state.skipped_steps) == 3


@pytest.mark.standard_promotion  # optax's adam / schedules
def test_jitted_state_types_are_stable():
  params = _params(jnp.bfloat16)
  tx = ols.dynamic_loss_scale(optax.adam(1e-3))
  state = tx.init(params)
  _, s1 = jax.jit(tx.update)(_scaled_grads(params, 2.0**15), state, params)
  _, s2 = jax.jit(tx.update)(_scaled_grads(params, 1.0, jnp.nan), state, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(state, s1, s2)
  assert state.loss_scale.dtype == jnp.float32


# --- leaves that loss scaling must leave alone --------------------------------


def test_special_leaves_pass_through():
  float0 = np.zeros((2,), dtype=jax.dtypes.float0)
  grads = {
    "f": jnp.array([8.0, 16.0]),
    "none": None,
    "int": jnp.array([3, 4], jnp.int32),
    "z": float0,
  }
  ident = optax.identity()
  tx = ols.dynamic_loss_scale(ident, initial_scale=8.0)
  state = tx.init(grads)
  updates, _ = jax.jit(tx.update)(grads, state)
  chex.assert_trees_all_equal(updates["f"], jnp.array([1.0, 2.0]))
  chex.assert_trees_all_equal(updates["int"], grads["int"])
  assert updates["none"] is None
  assert updates["z"].dtype == jax.dtypes.float0
  # On a skip, integer updates are zeroed like every other update.
  grads["f"] = jnp.array([jnp.nan, 1.0])
  updates, state = jax.jit(tx.update)(grads, state)
  chex.assert_trees_all_equal(updates["int"], jnp.zeros(2, jnp.int32))
  assert int(state.skipped_steps) == 1


def test_masked_nodes_pass_through():
  params = {"w": jnp.ones(3), "frozen": jnp.ones(2)}
  mask = {"w": True, "frozen": False}
  tx = optax.masked(ols.dynamic_loss_scale(optax.sgd(1.0), initial_scale=2.0), mask)
  state = tx.init(params)
  grads = {"w": jnp.full(3, 2.0), "frozen": jnp.full(2, 5.0)}
  updates, state = jax.jit(tx.update)(grads, state, params)
  chex.assert_trees_all_equal(updates["w"], jnp.full(3, -1.0))
  chex.assert_trees_all_equal(updates["frozen"], jnp.full(2, 5.0))
  # A NaN in the masked-out leaf is not this optimizer's business.
  grads["frozen"] = jnp.full(2, jnp.nan)
  updates, state = jax.jit(tx.update)(grads, state, params)
  chex.assert_trees_all_equal(updates["w"], jnp.full(3, -1.0))
  assert int(ols.find_loss_scale_state(state).skipped_steps) == 0


@pytest.mark.standard_promotion  # optax's adam / schedules
def test_empty_tree():
  tx = ols.dynamic_loss_scale(optax.adam(1e-3))
  state = tx.init({})
  updates, state = jax.jit(tx.update)({}, state, {})
  assert updates == {} and int(state.good_steps) == 1


# --- static and no-op ---------------------------------------------------------


def test_static_loss_scale():
  params = _params()
  tx = ols.static_loss_scale(optax.sgd(1.0), 64.0)
  state = tx.init(params)
  u, state = jax.jit(tx.update)(_scaled_grads(params, 64.0), state, params)
  chex.assert_trees_all_close(
    u, jax.tree.map(lambda p: -0.25 * jnp.ones_like(p), params)
  )
  u, state = jax.jit(tx.update)(_scaled_grads(params, 64.0, jnp.inf), state, params)
  chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, params))
  assert float(state.loss_scale) == 64.0 and int(state.skipped_steps) == 1


def test_static_loss_scale_without_skipping_applies_everything():
  params = _params()
  tx = ols.static_loss_scale(optax.sgd(1.0), 64.0, skip_nonfinite=False)
  state = tx.init(params)
  u, state = jax.jit(tx.update)(_scaled_grads(params, 64.0, jnp.inf), state, params)
  assert jnp.isinf(u["w"][0, 0]) and int(state.skipped_steps) == 0


@pytest.mark.standard_promotion  # optax's adam / schedules
def test_noop_loss_scale_is_the_inner_optimizer():
  params = _params()
  inner = optax.adam(1e-3)
  tx = ols.porting.with_loss_scale(inner, ols.porting.NoOpLossScale())
  grads = _scaled_grads(params, 1.0)
  u, state = jax.jit(tx.update)(grads, tx.init(params), params)
  ref, _ = inner.update(grads, inner.init(params), params)
  chex.assert_trees_all_equal(u, ref)
  assert float(ols.get_scale(state)) == 1.0


# --- finding the scale in nested states --------------------------------------


def _nested_txs():
  ls = lambda inner: ols.dynamic_loss_scale(inner, initial_scale=512.0)
  return {
    "bare": ls(optax.adam(1e-3)),
    "chain_outside": optax.chain(optax.clip(1.0), ls(optax.adam(1e-3))),
    "multisteps": optax.MultiSteps(ls(optax.adam(1e-3)), every_k_schedule=2),
    "inject": optax.inject_hyperparams(
      lambda learning_rate: ls(optax.sgd(learning_rate))
    )(learning_rate=0.1),
    "inner_inject": ls(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)),
    "masked": optax.masked(ls(optax.sgd(0.1)), {"w": True, "b": False}),
    "multi_transform": optax.multi_transform(
      {"a": ls(optax.sgd(0.1)), "b": optax.set_to_zero()}, {"w": "a", "b": "b"}
    ),
  }


@pytest.mark.standard_promotion  # optax's adam / schedules
@pytest.mark.parametrize("name", list(_nested_txs()))
def test_get_scale_finds_the_state_anywhere(name):
  tx = _nested_txs()[name]
  params = _params()
  state = tx.init(params)
  assert float(ols.get_scale(state)) == 512.0
  assert float(optax.tree.get(state, "loss_scale")) == 512.0
  assert float(jax.jit(ols.get_scale)(state)) == 512.0
  # And a non-finite step is seen through the wrapper (MultiSteps calls the
  # wrapped optimizer once per window of 2 micro-steps).
  grads = _scaled_grads(params, 512.0, jnp.nan)
  for _ in range(2 if name == "multisteps" else 1):
    _, state = jax.jit(tx.update)(grads, state, params)
  assert float(ols.get_scale(state)) == 256.0


def test_get_scale_errors():
  with pytest.raises(ValueError, match="No loss-scale state"):
    ols.get_scale(optax.adam(1e-3).init(_params()))
  two = optax.chain(
    ols.dynamic_loss_scale(optax.sgd(0.1)), ols.static_loss_scale(optax.sgd(0.1), 4.0)
  )
  with pytest.raises(ValueError, match=r"Found 2 loss-scale states.*\[0\].*\[1\]"):
    ols.get_scale(two.init(_params()))


@pytest.mark.parametrize(
  "make",
  [
    lambda: ols.dynamic_loss_scale(ols.dynamic_loss_scale(optax.sgd(0.1))),
    lambda: ols.static_loss_scale(ols.dynamic_loss_scale(optax.sgd(0.1)), 8.0),
    lambda: ols.dynamic_loss_scale(
      optax.chain(optax.clip(1.0), ols.static_loss_scale(optax.sgd(0.1), 8.0))
    ),
    lambda: ols.dynamic_loss_scale(
      optax.MultiSteps(ols.dynamic_loss_scale(optax.sgd(0.1)), 2)
    ),
    lambda: ols.porting.LossScaleOptimizer(ols.dynamic_loss_scale(optax.sgd(0.1))),
    lambda: ols.dynamic_loss_scale(ols.porting.LossScaleOptimizer("sgd")),
    lambda: ols.porting.enable_mixed_precision(
      jnp.sum, ols.dynamic_loss_scale(optax.sgd(0.1)), compute_dtype=jnp.float16
    )[1],
    lambda: ols.porting.enable_mixed_precision(
      jnp.sum, ols.dynamic_loss_scale(optax.sgd(0.1)), compute_dtype=jnp.bfloat16
    )[1],
    # A NoOpLossScale unscales nothing, but two scales still leave get_scale
    # unable to choose.
    lambda: ols.dynamic_loss_scale(
      ols.porting.with_loss_scale(optax.sgd(0.1), ols.porting.NoOpLossScale())
    ),
  ],
)
def test_a_loss_scale_inside_a_loss_scale_is_refused_at_init(make):
  tx = make()
  with pytest.raises(ValueError, match=r"holds another loss scale \(at \.inner_state"):
    tx.init(_params())
  with pytest.raises(ValueError, match="one loss scale only"):
    jax.jit(tx.init)(_params())


def test_get_scale_finds_a_loss_scale_inside_another():
  state = ols.dynamic_loss_scale(optax.sgd(0.1)).init(_params())
  nested = state._replace(inner_state=(optax.EmptyState(), state))
  with pytest.raises(
    ValueError, match=r"Found 2 loss-scale states.*<root>, \.inner_state\[1\]"
  ):
    ols.get_scale(nested)
  with pytest.raises(ValueError, match="Found 2"):
    ols.find_loss_scale_state(nested)
  with pytest.raises(ValueError, match="Found 2"):
    ols.diagnostics(nested)


def test_value_and_grad_with_the_arguments_swapped_says_what_goes_first():
  params = _params()
  state = ols.dynamic_loss_scale(optax.sgd(0.1)).init(params)
  loss_fn = lambda p: jnp.sum(p["w"])
  with pytest.raises(ValueError, match="first argument must be the optimizer state"):
    ols.value_and_grad(loss_fn)(params, state)


def test_get_scale_of_a_core_object():
  assert float(ols.get_scale(ols.porting.DynamicLossScale(64.0))) == 64.0


# --- bad input ----------------------------------------------------------------


def test_wrong_state_is_a_clear_error():
  params = _params()
  tx = ols.dynamic_loss_scale(optax.adam(1e-3))
  wrong = optax.adam(1e-3).init(params)
  with pytest.raises(ValueError, match="LossScaleState"):
    tx.update(_scaled_grads(params, 1.0), wrong, params)
  with pytest.raises(ValueError, match="LossScaleState"):
    jax.jit(tx.update)(_scaled_grads(params, 1.0), wrong, params)


def test_mismatched_grad_tree_is_a_clear_error():
  params = _params()
  tx = ols.dynamic_loss_scale(optax.adam(1e-3))
  state = tx.init(params)
  with pytest.raises(ValueError, match="does not match the parameter tree"):
    tx.update({"w": jnp.ones((2, 3))}, state, params)
  with pytest.raises(ValueError, match=r"\['b'\] has shape \(4,\)"):
    jax.jit(tx.update)({"w": jnp.ones((2, 3)), "b": jnp.ones(4)}, state, params)


STATE_MISFITS = {
  "dynamic_loss_scale": lambda: ols.dynamic_loss_scale(optax.adam(1e-3)),
  "static_loss_scale": lambda: ols.static_loss_scale(optax.adam(1e-3), 8.0),
  "master_weights": lambda: ols.master_weights(optax.adam(1e-3)),
  "dynamic_loss_scale(master_weights)": lambda: ols.dynamic_loss_scale(
    ols.master_weights(optax.adam(1e-3))
  ),
}


MISFITS = [
  "gradients of other shapes, no params",
  "gradients of another structure, no params",
  "a state made for parameters of other shapes",
]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
  "entry, case",
  [
    (entry, case)
    for entry in STATE_MISFITS
    for case in MISFITS
    if "master" not in entry or "no params" not in case  # it needs params
  ],
)
def test_a_state_that_does_not_fit_is_a_clear_error(entry, case, jit):
  tx = STATE_MISFITS[entry]()
  dtype = jnp.bfloat16 if "master" in entry else jnp.float32
  params = {"w": jnp.ones(3, dtype), "b": jnp.ones(2, dtype)}
  grads = jax.tree.map(jnp.ones_like, params)
  state, args = tx.init(params), (grads, params)
  if case.startswith("gradients of other shapes"):
    args, match = (
      ({"w": jnp.ones(4, dtype), "b": grads["b"]}, None),
      "fit these gradients",
    )
  elif case.startswith("gradients of another"):
    args, match = ({"w": grads["w"]}, None), "these gradients \\(or these gradients"
  else:
    state = tx.init({"w": jnp.ones(5, dtype), "b": params["b"]})
    match = "made for"
  update = jax.jit(tx.update) if jit else tx.update
  with pytest.raises(ValueError, match=match):
    update(args[0], state, args[1])


def test_invalid_inner_or_loss_scale():
  with pytest.raises(ValueError, match="inner"):
    ols.dynamic_loss_scale(object())
  with pytest.raises(ValueError, match="loss_scale"):
    ols.porting.with_loss_scale(optax.sgd(0.1), 2.0**15)


def test_hyper_parameters_are_not_state_leaves():
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), min_scale=0.125, initial_scale=0.25)
  state = tx.init(_params())
  assert len(jax.tree.leaves(state)) == 5  # counters only; sgd has no leaves
  update = jax.jit(tx.update)
  for _ in range(5):
    _, state = update(_scaled_grads(_params(), 1.0, jnp.inf), state, _params())
  assert float(state.loss_scale) == 0.125  # min_scale survived jit


# --- scale_loss and value_and_grad -------------------------------------------


def _loss_fn(params, x):
  y = x.astype(jnp.float16) @ params["w"].astype(jnp.float16)
  return jnp.mean((y + params["b"].astype(jnp.float16)[None]) ** 2)


def test_scale_loss():
  state = ols.dynamic_loss_scale(optax.sgd(0.1)).init(_params())
  out = ols.scale_loss(jnp.float16(3.0), state)
  assert out.dtype == jnp.float32 and float(out) == 3.0 * 2.0**15


def test_value_and_grad_returns_unscaled_loss_and_scaled_grads():
  params = _params()
  x = jnp.ones((4, 2))
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=2.0**6)
  state = tx.init(params)
  loss, grads = jax.jit(ols.value_and_grad(_loss_fn))(state, params, x)
  ref_loss, ref_grads = jax.value_and_grad(
    lambda p: _loss_fn(p, x).astype(jnp.float32) * 2.0**6
  )(params)
  assert loss.dtype == jnp.float16
  assert float(loss) == float(_loss_fn(params, x))
  chex.assert_trees_all_close(grads, ref_grads, rtol=1e-3)
  updates, state = tx.update(grads, state, params)
  _, plain = jax.value_and_grad(lambda p: _loss_fn(p, x).astype(jnp.float32))(params)
  chex.assert_trees_all_close(
    updates, jax.tree.map(lambda g: -0.1 * g, plain), rtol=1e-2
  )
  del ref_loss


def test_value_and_grad_has_aux_and_argnums():
  def f(scale_me, x, k):
    return jnp.sum(scale_me * x) * k, {"k": k}

  state = ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=4.0).init({})
  (loss, aux), (g0, g1) = ols.value_and_grad(f, argnums=(0, 1), has_aux=True)(
    state, jnp.float32(2.0), jnp.float32(3.0), k=jnp.float32(5.0)
  )
  assert float(loss) == 30.0 and float(aux["k"]) == 5.0
  assert float(g0) == 4.0 * 15.0 and float(g1) == 4.0 * 10.0
  _, g = ols.value_and_grad(lambda a, b: a * b, argnums=-1)(
    state, jnp.float32(2.0), jnp.float32(3.0)
  )
  assert float(g) == 8.0


@pytest.mark.parametrize(
  "fun",
  [lambda p: jnp.sum(p), lambda p: (jnp.sum(p),), lambda p: [jnp.sum(p), 1, 2]],
  ids=["a scalar", "a 1-tuple", "a 3-list"],
)
def test_value_and_grad_has_aux_needs_a_pair(fun):
  """Not an IndexError from inside (a scalar was indexed)."""
  state = ols.dynamic_loss_scale(optax.sgd(0.1)).init(jnp.ones(2))
  with pytest.raises(ValueError, match=r"must return a pair \(loss, auxiliary"):
    ols.value_and_grad(fun, has_aux=True)(state, jnp.ones(2))


def test_float16_underflow_is_rescued_by_the_scale():
  # A gradient of 1e-8 underflows to zero in float16 (the smallest subnormal
  # is 6e-8) but survives with a 2**15 scale.
  params = {"w": jnp.ones((), jnp.float32)}
  c = jnp.float16(1e-4)
  f = lambda p: (c * (p["w"].astype(jnp.float16) * c)).astype(jnp.float32)
  plain = jax.grad(f)(params)["w"]
  assert float(plain) == 0.0
  tx = ols.dynamic_loss_scale(optax.sgd(1.0))
  state = tx.init(params)
  _, grads = ols.value_and_grad(f)(state, params)
  updates, _ = tx.update(grads, state, params)
  np.testing.assert_allclose(-float(updates["w"]), 1e-8, rtol=1e-3)


def test_overflow_caused_by_unscaling_below_one_is_caught():
  """Below 1, unscaling multiplies: a finite scaled gradient can become inf."""
  params = {"w": jnp.zeros((3,))}
  tx = ols.dynamic_loss_scale(optax.sgd(1.0), initial_scale=2.0**-8, min_scale=2.0**-10)
  state = tx.init(params)
  grads = {"w": jnp.array([1e37, 1.0, 1.0])}  # finite; 1e37 * 2**8 overflows
  updates, state = jax.jit(tx.update)(grads, state, params)
  assert int(state.skipped_steps) == 1 and float(state.loss_scale) == 2.0**-9
  chex.assert_trees_all_equal(updates, {"w": jnp.zeros((3,))})
  # At or above 1 the check reads the scaled gradients: the same decision.
  tx = ols.dynamic_loss_scale(optax.sgd(1.0), initial_scale=1.0)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert int(state.skipped_steps) == 0
  chex.assert_trees_all_equal(updates, {"w": -grads["w"]})


def test_a_state_of_another_inner_optimizer_is_a_clear_error():
  params = _params()
  state = ols.dynamic_loss_scale(optax.sgd(0.1)).init(params)
  tx = ols.dynamic_loss_scale(optax.adam(1e-3))
  with pytest.raises(
    ValueError, match=r"(?s)not made by.*EmptyState.*ScaleByAdamState"
  ):
    tx.update(_scaled_grads(params, 1.0), state, params)
  with pytest.raises(ValueError, match="not made by"):
    jax.jit(tx.update)(_scaled_grads(params, 1.0), state, params)


def test_a_gradient_tree_that_is_a_prefix_of_the_parameters_is_refused():
  params = {"a": {"w": jnp.ones(2), "b": jnp.ones(2)}, "c": jnp.ones(1)}
  tx = ols.dynamic_loss_scale(optax.sgd(0.1))
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"\['a'\] is one array where the parameters"):
    tx.update({"a": jnp.ones(2), "c": jnp.ones(1)}, state, params)


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
  "make",
  [
    lambda: ols.dynamic_loss_scale(optax.sgd(1.0), initial_scale=4.0),
    lambda: ols.static_loss_scale(optax.sgd(1.0), 4.0),
  ],
  ids=["dynamic", "static"],
)
def test_a_python_number_parameter_takes_an_array_gradient(make, jitted):
  """As optax does; with the parameters given it was refused as "one array
  where the parameters have a subtree"."""
  params = {"w": jnp.ones(2), "t": 2.0}
  tx = make()
  state = tx.init(params)
  grads = {"w": jnp.full(2, 4.0), "t": jnp.float32(8.0)}
  update = jax.jit(tx.update) if jitted else tx.update
  for given in (None, params):
    updates, _ = update(grads, state, given)
    chex.assert_trees_all_close(updates, {"w": jnp.full(2, -1.0), "t": -2.0})
  with pytest.raises(ValueError, match=r"\['t'\] has shape \(3,\) but the parameter"):
    tx.update({"w": jnp.ones(2), "t": jnp.ones(3)}, state, params)


def test_a_restored_scale_comes_into_the_configuration_at_its_first_update():
  params = {"w": jnp.ones(2)}
  grads = {"w": jnp.full(2, 1024.0)}  # gradients of the loss times 1024
  saved = ols.static_loss_scale(optax.sgd(1.0), 1024.0).init(params)
  tx = ols.static_loss_scale(optax.sgd(1.0), 128.0)
  updates, state = jax.jit(tx.update)(grads, saved, params)
  # This step's gradients came from the state's scale: unscaled by it.
  chex.assert_trees_all_equal(updates, {"w": jnp.full(2, -1.0)})
  assert float(ols.get_scale(state)) == 128.0  # the configuration's from now on
  saved = ols.dynamic_loss_scale(optax.sgd(1.0), initial_scale=2.0**20).init(params)
  tx = ols.dynamic_loss_scale(optax.sgd(1.0), max_scale=2.0**16, min_scale=2.0)
  _, state = jax.jit(tx.update)(grads, saved, params)
  assert float(ols.get_scale(state)) == 2.0**16
  low = saved._replace(loss_scale=jnp.asarray(0.5, jnp.float32))
  _, state = jax.jit(tx.update)(grads, low, params)
  assert float(ols.get_scale(state)) == 2.0


# A state's scale that is no usable scale (a corrupted checkpoint, a
# hand-made state), and where the first update puts it: into the
# configuration's bounds; NaN, which a clamp keeps NaN (every later step
# was skipped), from the initial scale.
CORRUPTED_SCALES = {
  "NaN": (float("nan"), 2.0**15),
  "inf": (float("inf"), 2.0**24),
  "zero": (0.0, 1.0),
  "negative": (-1.0, 1.0),
  "subnormal": (1e-40, 1.0),
}


@pytest.mark.parametrize("case", CORRUPTED_SCALES)
def test_a_state_with_an_unusable_scale_recovers_at_its_first_update(case):
  bad, expected = CORRUPTED_SCALES[case]
  params = {"w": jnp.ones(3)}
  tx = ols.dynamic_loss_scale(optax.sgd(0.1))
  state = tx.init(params)._replace(loss_scale=jnp.float32(bad))
  loss = lambda p: jnp.sum(p["w"] ** 2)  # noqa: E731
  step = jax.jit(lambda s: tx.update(ols.value_and_grad(loss)(s, params)[1], s, params))
  _, state = step(state)  # its gradients came from the unusable scale
  assert float(ols.get_scale(state)) == expected
  updates, state = step(state)
  chex.assert_trees_all_close(updates, {"w": jnp.full(3, -0.2)})
  assert int(state.skipped_steps) <= 1


# Leaves that Flax overwrites with their new value (float8 meta), by their
# collection's name; tests/test_flax_fp8.py runs Flax's own float8 layers.
OW = "_overwrite_with_gradient"


def _with_overwrites():
  return {"params": _params(), OW: {"amax": jnp.zeros(4), "scale": jnp.ones(1)}}


def _grads_with(params, scale, amax, new_scale=2.0):
  regular = _scaled_grads(params["params"], scale)
  return {"params": regular, OW: {"amax": amax, "scale": jnp.full(1, new_scale)}}


@pytest.mark.standard_promotion  # optax's adam
def test_overwrite_leaves_are_written_as_they_are_and_kept_from_the_inner_state():
  params = _with_overwrites()
  tx = ols.dynamic_loss_scale(optax.adam(0.1), initial_scale=8.0)
  state = tx.init(params)
  adam = state.inner_state.inner_state[0]
  assert jax.tree.leaves(adam.mu[OW]) == [] and jax.tree.leaves(adam.mu["params"])
  amax = jnp.array([3.0, 5.0, 0.0, 0.5])
  grads = _grads_with(params, 8.0, amax)
  updates, new_state = jax.jit(tx.update)(grads, state, params)
  unscaled = _scaled_grads(params["params"], 1.0)
  plain, _ = optax.adam(0.1).update(unscaled, optax.adam(0.1).init(params["params"]))
  chex.assert_trees_all_close(updates["params"], plain, rtol=1e-6)
  chex.assert_trees_all_equal(updates[OW], jax.tree.map(jnp.zeros_like, grads[OW]))
  new = ols.apply_overwrites(optax.apply_updates(params, updates), new_state)
  chex.assert_trees_all_equal(new[OW], grads[OW])  # not divided by 8
  # A non-finite new value skips the step like a non-finite gradient.
  bad = _grads_with(params, 8.0, amax.at[1].set(jnp.nan))
  updates, skipped = jax.jit(tx.update)(bad, new_state, new)
  assert bool(ols.diagnostics(skipped)["last_step_skipped"])
  chex.assert_trees_all_equal(
    ols.apply_overwrites(optax.apply_updates(new, updates), skipped), new
  )


@pytest.mark.standard_promotion  # optax's MultiSteps
def test_overwrite_leaves_take_the_maximum_over_a_multisteps_window():
  params = _with_overwrites()
  tx = ols.dynamic_loss_scale(optax.MultiSteps(optax.sgd(0.1), 2), initial_scale=4.0)
  state = tx.init(params)
  update = jax.jit(tx.update)
  a1, a2 = jnp.array([1.0, 5.0, 0.0, 0.0]), jnp.array([3.0, 2.0, 0.0, 0.0])
  micro_batches = [  # (new amax, new scale); the NaN one is skipped alone
    (a1, 1.0),
    (a1.at[0].set(jnp.nan), 9.0),
    (a2, 1.0),
  ]
  for i, (amax, new_scale) in enumerate(micro_batches):
    grads = _grads_with(params, 4.0, amax, new_scale)
    updates, state = update(grads, state, params)
    written = ols.apply_overwrites(optax.apply_updates(params, updates), state)
    if i < 2:  # mid-window: nothing is written
      chex.assert_trees_all_equal(written, params)
  chex.assert_trees_all_equal(written[OW]["amax"], jnp.maximum(a1, a2))
  chex.assert_trees_all_equal(written[OW]["scale"], jnp.full(1, 1.0))
  assert int(ols.diagnostics(state)["skipped_steps"]) == 1


def test_overwrite_leaves_misuse_is_a_clear_error():
  params = _with_overwrites()
  grads = _grads_with(params, 1.0, jnp.ones(4))
  tx = ols.dynamic_loss_scale(optax.sgd(0.1))
  # A state made without them (Flax's TrainState.create inits on params only).
  with pytest.raises(ValueError, match="made without them"):
    tx.update(grads, tx.init(params["params"]), params)
  outside = optax.MultiSteps(tx, 2)
  with pytest.raises(ValueError, match="Accumulate inside the loss scale"):
    ols.apply_overwrites(params, outside.init(params))
  with pytest.raises(ValueError, match="does not match"):
    ols.apply_overwrites(params["params"], tx.init(params))
  plain = tx.init(params["params"])  # no overwrite leaves: params as they are
  assert ols.apply_overwrites(params["params"], plain) is params["params"]
