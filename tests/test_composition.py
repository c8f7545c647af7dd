"""Loss scaling composed with the rest of optax (docs/guides/optax.md)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import versions

import optax_lossscale as ols

# optax's schedules, adam, inject_hyperparams and MultiSteps use `float ** int`
# and mixed-width arithmetic.
pytestmark = pytest.mark.standard_promotion

SCALE = 2.0**10


def _params(dtype=jnp.float32):
  return {
    "w": (jnp.arange(6, dtype=jnp.float32).reshape(2, 3) / 10 - 0.2).astype(dtype),
    "b": jnp.ones((3,), dtype),
  }


def _grads(params, value, scale=1.0):
  return jax.tree.map(lambda p: jnp.full_like(p, value * scale), params)


def _poison(grads, bad=jnp.nan):
  return {**grads, "w": grads["w"].at[0, 1].set(bad)}


# --------------------------------------------------------------------------
# optax.chain: clipping inside the wrapper sees unscaled gradients.
# --------------------------------------------------------------------------


def test_clipping_inside_the_wrapper_sees_unscaled_gradients():
  params = _params()
  true_grads = _grads(params, 3.0)
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
  right = ols.dynamic_loss_scale(inner, initial_scale=SCALE)
  updates, _ = jax.jit(right.update)(
    _grads(params, 3.0, SCALE), right.init(params), params
  )
  expected, _ = inner.update(true_grads, inner.init(params), params)
  chex.assert_trees_all_close(updates, expected, rtol=1e-6)
  assert float(optax.tree.norm(updates)) == pytest.approx(1.0, rel=1e-6)

  # The wrong order, clipping outside the wrapper, clips the *scaled*
  # gradients: the step comes out `SCALE` times too small.
  wrong = optax.chain(
    optax.clip_by_global_norm(1.0),
    ols.dynamic_loss_scale(optax.sgd(1.0), initial_scale=SCALE),
  )
  wrong_updates, _ = wrong.update(
    _grads(params, 3.0, SCALE), wrong.init(params), params
  )
  assert float(optax.tree.norm(wrong_updates)) == pytest.approx(1.0 / SCALE, rel=1e-5)


# --------------------------------------------------------------------------
# optax.MultiSteps, both nestings.
# --------------------------------------------------------------------------

K = 3


def _run(tx, grads_seq, params):
  state = tx.init(params)
  step = jax.jit(tx.update)
  out = []
  for g in grads_seq:
    scale = float(ols.get_scale(state))
    updates, state = step(g, state, params)
    out.append((scale, updates, state))
  return out


def test_multisteps_inside_the_scale_drops_only_the_bad_micro_batch():
  """``dynamic_loss_scale(MultiSteps(inner, k))``: the recommended nesting."""
  params = _params()
  tx = ols.dynamic_loss_scale(
    optax.MultiSteps(optax.sgd(1.0), K), initial_scale=SCALE, growth_interval=2
  )
  values = [1.0, 2.0, None, 4.0, 8.0, 16.0, 32.0]  # None: a non-finite micro-batch
  state = tx.init(params)
  step = jax.jit(tx.update)
  scales, updates_seq, mini_steps = [], [], []
  for v in values:
    scale = ols.get_scale(state)  # the scale the micro-batch is computed with
    scales.append(float(scale))
    g = _grads(params, 1.0 if v is None else v, float(scale))
    if v is None:
      g = _poison(g)
    updates, state = step(g, state, params)
    updates_seq.append(updates)
    mini_steps.append(int(state.inner_state.mini_step))

  # The bad micro-batch is skipped alone: the window does not advance
  # (mini_step stays at 2) and still collects K finite micro-batches.
  assert mini_steps == [1, 2, 2, 0, 1, 2, 0]
  # The scale reacts at once, mid-window: grown after 2 finite steps, backed
  # off by the bad one, grown again. Each micro-batch is unscaled with the
  # scale that produced it, so the window's mean is exact all the same.
  assert scales == [SCALE, SCALE, 2 * SCALE, SCALE, SCALE, 2 * SCALE, 2 * SCALE]
  expected_first = -(1.0 + 2.0 + 4.0) / 3
  expected_second = -(8.0 + 16.0 + 32.0) / 3
  for i, u in enumerate(updates_seq):
    want = {3: expected_first, 6: expected_second}.get(i, 0.0)
    chex.assert_trees_all_close(u, _grads(params, want), rtol=1e-6)
  assert int(state.skipped_steps) == 1


def _lookahead():
  return optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)


_LOOKAHEAD_ENTRIES = {  # (wrapper, the inner transformation: its reference)
  "dynamic_loss_scale": (
    lambda inner: ols.dynamic_loss_scale(inner, initial_scale=SCALE),
    _lookahead,
  ),
  "LossScaleOptimizer": (
    lambda inner: ols.porting.LossScaleOptimizer(inner, initial_scale=SCALE),
    _lookahead,
  ),
  "dynamic_loss_scale(quantize_state)": (
    lambda inner: ols.dynamic_loss_scale(inner, initial_scale=SCALE),
    lambda: ols.quantize_state(_lookahead(), min_size=0),
  ),
}


@pytest.mark.parametrize("entry", list(_LOOKAHEAD_ENTRIES))
def test_lookahead_params_under_the_loss_scale(entry):
  """optax.lookahead takes ``LookaheadParams`` (fast and slow weights) and
  the fast weights' gradients: once refused, as a gradient tree that does
  not match the parameters'. The non-finite step is skipped and every other
  is the inner transformation's own."""
  wrap, make = _LOOKAHEAD_ENTRIES[entry]
  tx, ref = wrap(make()), make()
  p = q = optax.LookaheadParams.init_synced(_params())
  state, ref_state = tx.init(p), ref.init(q)
  step, ref_step = jax.jit(tx.update), jax.jit(ref.update)
  for v in (1.0, None, 2.0, 3.0, 4.0):
    g = _grads(q.fast, 1.0 if v is None else v)
    scaled = _grads(q.fast, 1.0 if v is None else v, float(ols.get_scale(state)))
    updates, state = step(_poison(scaled) if v is None else scaled, state, p)
    p = optax.apply_updates(p, updates)
    if v is not None:
      ref_updates, ref_state = ref_step(g, ref_state, q)
      q = optax.apply_updates(q, ref_updates)
    # Equal but for the last bit: the skip's selects change XLA's fusions.
    chex.assert_trees_all_close(p, q, rtol=1e-6, atol=1e-9)
  assert int(state.skipped_steps) == 1


def test_multisteps_outside_the_scale_fixes_the_scale_per_window():
  """``MultiSteps(dynamic_loss_scale(inner), k)``: the scale is fixed per window.

  And why this nesting is the wrong one: a non-finite micro-batch poisons its
  window *and every later one*, because MultiSteps resets its accumulator by
  multiplying it with 0, and ``0 * nan`` is ``nan``.
  """
  params = _params()
  tx = optax.MultiSteps(
    ols.dynamic_loss_scale(optax.sgd(1.0), initial_scale=SCALE, growth_interval=1), K
  )
  state = tx.init(params)
  step = jax.jit(tx.update)
  scales, applied = [], []
  values = [1.0, 2.0, 4.0, 1.0, None, 4.0, 8.0, 16.0, 32.0]
  for v in values:
    scale = float(ols.get_scale(state))
    scales.append(scale)
    g = _grads(params, 1.0 if v is None else v, scale)
    if v is None:
      g = _poison(g)
    updates, state = step(g, state, params)
    applied.append(float(updates["b"][0]))

  # The loss-scale state lives inside MultiSteps and only moves at a window's
  # end: the scale is fixed within each window (all micro-batches of a window
  # are scaled alike, so accumulating scaled gradients is consistent).
  assert scales == [SCALE] * 3 + [2 * SCALE] * 3 + [SCALE] * 3
  # Window 1 applies. Window 2 holds a NaN micro-batch: its mean is NaN, the
  # window is skipped and the scale backs off. Window 3 is all finite and is
  # skipped as well: the NaN stayed in the accumulator.
  assert applied == pytest.approx([0, 0, -7 / 3] + [0] * 6)
  assert int(ols.find_loss_scale_state(state).skipped_steps) == 2
  assert np.isnan(np.asarray(state.acc_grads["w"])).any()


def _to_float32():
  """Returns float32 updates for any gradients (e.g. a float32 master copy)."""
  return optax.stateless(
    lambda u, p=None: jax.tree.map(lambda x: x.astype(jnp.float32), u)
  )


@pytest.mark.parametrize("nesting", ["scale(MultiSteps)", "MultiSteps(scale)"])
@versions.multisteps_dtypes
def test_multisteps_keeps_dtypes_on_every_branch(nesting):
  """bfloat16 params, float32 updates: skip/apply and mid/end of window."""
  params = _params(jnp.bfloat16)
  inner = optax.chain(optax.sgd(0.5), _to_float32())
  if nesting == "scale(MultiSteps)":
    tx = ols.dynamic_loss_scale(optax.MultiSteps(inner, 2), initial_scale=SCALE)
  else:
    tx = optax.MultiSteps(ols.dynamic_loss_scale(inner, initial_scale=SCALE), 2)
  state = tx.init(params)
  step = jax.jit(tx.update)
  good = _grads(params, 0.5, SCALE)
  for g in [good, _poison(good), good, good, _poison(good), good]:
    updates, new_state = step(g, state, params)
    chex.assert_trees_all_equal_dtypes(
      updates, jax.tree.map(lambda p: p.astype(jnp.float32), params)
    )
    chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)
    state = new_state


# --------------------------------------------------------------------------
# inject_hyperparams and schedules.
# --------------------------------------------------------------------------


def test_inject_hyperparams_learning_rate_readable_and_changeable():
  params = _params()
  tx = ols.dynamic_loss_scale(
    optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), initial_scale=SCALE
  )
  state = tx.init(params)
  assert float(ols.get_learning_rate(state)) == pytest.approx(0.1)
  state = jax.jit(ols.set_learning_rate)(state, 0.25)
  updates, state = jax.jit(tx.update)(_grads(params, 2.0, SCALE), state, params)
  chex.assert_trees_all_close(updates, _grads(params, -0.5))
  assert float(ols.get_learning_rate(state)) == 0.25


def test_loss_scale_inside_inject_hyperparams():
  """The other nesting works too: only the learning rate is injected."""
  params = _params()
  tx = optax.inject_hyperparams(
    lambda learning_rate: ols.dynamic_loss_scale(
      optax.sgd(learning_rate), initial_scale=SCALE
    )
  )(learning_rate=0.1)
  state = tx.init(params)
  assert float(ols.get_scale(state)) == SCALE
  state.hyperparams["learning_rate"] = jnp.asarray(0.5)
  updates, state = tx.update(_grads(params, 2.0, SCALE), state, params)
  chex.assert_trees_all_close(updates, _grads(params, -1.0))
  _, state = tx.update(_poison(_grads(params, 2.0, SCALE)), state, params)
  assert float(ols.get_scale(state)) == SCALE / 2


#: dynamic_loss_scale's numeric arguments, and values other than the defaults.
NUMERIC = {
  "initial_scale": SCALE,
  "growth_interval": 2,
  "growth_factor": 4.0,
  "backoff_factor": 0.25,
  "min_scale": 2.0,
  "max_scale": 2.0**12,
  "hysteresis": 2,
}


def test_the_loss_scale_as_inject_hyperparams_function():
  """optax.inject_hyperparams(dynamic_loss_scale): every numeric argument,
  integers included, arrives as a concrete array at init and in an eager
  update (taken as its number), and traced in a jitted one (refused, naming
  static_args; with static_args naming them, it is the plain loss scale)."""
  params = _params()
  plain = ols.dynamic_loss_scale(optax.sgd(0.1), **NUMERIC)
  injected = optax.inject_hyperparams(ols.dynamic_loss_scale)(optax.sgd(0.1), **NUMERIC)
  static = optax.inject_hyperparams(ols.dynamic_loss_scale, static_args=tuple(NUMERIC))(
    optax.sgd(0.1), **NUMERIC
  )
  states = [tx.init(params) for tx in (plain, injected, static)]
  assert sorted(states[1].hyperparams) == sorted(NUMERIC)
  updates = [
    lambda g, s: plain.update(g, s, params),
    lambda g, s: injected.update(g, s, params),  # eagerly: concrete arrays
    lambda g, s: jax.jit(static.update)(g, s, params),
  ]
  for value in [1.0, None, None, 2.0, 3.0, 4.0]:  # skips, a back-off, growth
    scale = float(ols.get_scale(states[0]))
    g = _grads(params, 1.0 if value is None else value, scale)
    g = _poison(g) if value is None else g
    outs = [update(g, s) for update, s in zip(updates, states, strict=True)]
    states = [s for _, s in outs]
    for u, s in outs[1:]:
      chex.assert_trees_all_equal(u, outs[0][0])
      assert float(ols.get_scale(s)) == float(ols.get_scale(states[0]))
  with pytest.raises(ValueError, match=r"traced value.*static_args naming them"):
    jax.jit(injected.update)(g, states[1], params)


@pytest.mark.parametrize("name", NUMERIC)
def test_a_hyper_parameter_may_be_a_0d_array(name):
  """A concrete 0-d array of the right kind is its number (an integer
  argument's, an integer array); another kind, shape or a bool is refused."""
  params = _params()
  value = NUMERIC[name]
  as_array = ols.dynamic_loss_scale(
    optax.sgd(0.1), **{**NUMERIC, name: jnp.asarray(value)}
  )
  as_number = ols.dynamic_loss_scale(optax.sgd(0.1), **NUMERIC)
  state_a, state_n = as_array.init(params), as_number.init(params)
  for v in [1.0, None, 2.0, 3.0, 4.0]:
    g = _grads(params, 1.0 if v is None else v, float(ols.get_scale(state_n)))
    g = _poison(g) if v is None else g
    u_a, state_a = as_array.update(g, state_a, params)
    u_n, state_n = as_number.update(g, state_n, params)
    chex.assert_trees_all_equal((u_a, state_a), (u_n, state_n))
  for bad in (jnp.asarray([value, value]), jnp.array(True)):
    with pytest.raises(ValueError, match=name):
      ols.dynamic_loss_scale(optax.sgd(0.1), **{**NUMERIC, name: bad})
  if isinstance(value, int):
    with pytest.raises(ValueError, match=f"`{name}` must be an integer"):
      ols.dynamic_loss_scale(optax.sgd(0.1), **{**NUMERIC, name: jnp.float32(value)})


ENTRY_POINTS = {
  "static_loss_scale": (
    lambda v: ols.get_scale(ols.static_loss_scale(optax.sgd(0.1), v).init(_params())),
    8.0,
  ),
  "porting.StaticLossScale": (ols.porting.StaticLossScale, 8.0),
  "porting.DynamicLossScale, initial_scale": (
    lambda v: ols.porting.DynamicLossScale(initial_scale=v),
    8.0,
  ),
  "porting.DynamicLossScale, growth_interval": (
    lambda v: ols.porting.DynamicLossScale(growth_interval=v),
    8,
  ),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_takes_0d_arrays_and_refuses_bool_arrays(entry):
  make, value = ENTRY_POINTS[entry]
  dtype = jnp.int32 if isinstance(value, int) else jnp.float32
  assert repr(make(jnp.asarray(value, dtype))) == repr(make(value))
  not_numbers = (
    jnp.array(True),
    np.bool_(True),
    jnp.float32(jnp.nan),
    jnp.float32(jnp.inf),
  )
  for bad in (*not_numbers, jnp.asarray([value, value], dtype)):
    with pytest.raises(ValueError, match="must be"):
      make(bad)


def test_skipped_steps_do_not_advance_schedules():
  params = _params()
  schedule = optax.linear_schedule(1.0, 0.0, transition_steps=4)
  tx = ols.dynamic_loss_scale(optax.adam(schedule), initial_scale=SCALE)
  ref = optax.adam(schedule)
  state, ref_state = tx.init(params), ref.init(params)
  p, ref_p = params, params
  step = jax.jit(tx.update)
  sequence = [1.0, None, None, 2.0, None, 3.0]
  for v in sequence:
    scale = float(ols.get_scale(state))
    g = _grads(params, 1.0 if v is None else v, scale)
    if v is None:
      g = _poison(g, jnp.inf)
    updates, state = step(g, state, p)
    p = optax.apply_updates(p, updates)
    if v is not None:
      ref_updates, ref_state = ref.update(_grads(params, v), ref_state, ref_p)
      ref_p = optax.apply_updates(ref_p, ref_updates)
  counts = [int(c) for c in jax.tree.leaves(state.inner_state) if c.dtype == jnp.int32]
  assert counts and all(c == 3 for c in counts)  # 3 applied steps, not 6
  chex.assert_trees_all_close(p, ref_p, rtol=1e-6)


# --------------------------------------------------------------------------
# masked / multi_transform: MaskedNode leaves.
# --------------------------------------------------------------------------


def test_masked_inside_the_scale():
  params = _params()
  tx = ols.dynamic_loss_scale(
    optax.masked(optax.sgd(1.0), {"w": True, "b": False}), initial_scale=SCALE
  )
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(_grads(params, 2.0, SCALE), state, params)
  chex.assert_trees_all_close(updates["w"], jnp.full((2, 3), -2.0))
  # Masked-out leaves pass through: unscaled, not updated by sgd.
  chex.assert_trees_all_close(updates["b"], jnp.full((3,), 2.0))
  # The loss scale checks every leaf, masked out or not.
  bad = _grads(params, 2.0, SCALE)
  bad["b"] = bad["b"].at[0].set(jnp.nan)
  _, state = tx.update(bad, state, params)
  assert int(state.skipped_steps) == 1


def test_scale_inside_masked_sees_masked_nodes():
  """``masked(dynamic_loss_scale(...))``: the inner state holds MaskedNode leaves."""
  params = _params()
  tx = optax.masked(
    ols.dynamic_loss_scale(optax.sgd(1.0), initial_scale=SCALE), {"w": True, "b": False}
  )
  state = jax.jit(tx.init)(params)
  assert float(ols.get_scale(state)) == SCALE
  updates, state = jax.jit(tx.update)(_grads(params, 2.0, SCALE), state, params)
  chex.assert_trees_all_close(updates["w"], jnp.full((2, 3), -2.0))
  _, state = jax.jit(tx.update)(_poison(_grads(params, 2.0, SCALE)), state, params)
  assert float(ols.get_scale(state)) == SCALE / 2


def test_multi_transform_inside_the_scale():
  params = _params()
  tx = ols.dynamic_loss_scale(
    optax.multi_transform(
      {"fast": optax.sgd(1.0), "frozen": optax.set_to_zero()},
      {"w": "fast", "b": "frozen"},
    ),
    initial_scale=SCALE,
  )
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(_grads(params, 2.0, SCALE), state, params)
  chex.assert_trees_all_close(updates, {"w": jnp.full((2, 3), -2.0), "b": jnp.zeros(3)})
  updates, state = jax.jit(tx.update)(
    _poison(_grads(params, 2.0, SCALE)), state, params
  )
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
  assert float(ols.get_scale(state)) == SCALE / 2


def test_two_scales_in_multi_transform_is_an_error_for_get_scale():
  params = _params()
  tx = optax.multi_transform(
    {
      "a": ols.dynamic_loss_scale(optax.sgd(1.0)),
      "b": ols.dynamic_loss_scale(optax.sgd(1.0)),
    },
    {"w": "a", "b": "b"},
  )
  with pytest.raises(ValueError, match="Found 2 loss-scale state"):
    ols.get_scale(tx.init(params))
