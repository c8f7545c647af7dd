"""Diagnostics, the host-side skip check, and ema_params on its own."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols


def _params(dtype=jnp.float32):
  return {"w": jnp.ones((2, 3), dtype), "b": jnp.zeros((3,), dtype)}


def _grads(value, dtype=jnp.float32):
  return {"w": jnp.full((2, 3), value, dtype), "b": jnp.full((3,), 1.0, dtype)}


def test_diagnostics_inside_jit():
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=2.0**4, growth_interval=2)
  params = _params()

  @jax.jit
  def step(state, g):
    _, state = tx.update(g, state, params)
    return state, ols.diagnostics(state)

  state = tx.init(params)
  seen = []
  for v in [1.0, jnp.nan, jnp.inf, 1.0, 1.0, 1.0]:
    state, d = step(state, _grads(v))
    seen.append(jax.device_get(d))
  assert [float(d["loss_scale"]) for d in seen] == [16, 8, 4, 4, 8, 8]
  assert [int(d["good_steps"]) for d in seen] == [1, 0, 0, 1, 0, 1]
  assert [int(d["skipped_steps"]) for d in seen] == [0, 1, 2, 2, 2, 2]
  assert [int(d["consecutive_skips"]) for d in seen] == [0, 1, 2, 0, 0, 0]
  assert [bool(d["last_step_skipped"]) for d in seen] == [0, 1, 1, 0, 0, 0]
  assert set(seen[0]) == {
    "loss_scale",
    "good_steps",
    "hysteresis_left",
    "skipped_steps",
    "consecutive_skips",
    "last_step_skipped",
  }


def _run(tx, values, params):
  state = tx.init(params)
  update = jax.jit(tx.update)
  for v in values:
    _, state = update(_grads(v), state, params)
  return state


def test_check_skipped_steps_tells_a_broken_model_from_overflow():
  params = _params()
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=2.0**15)
  # NaN every step: the scale reaches its floor (1) after 15 skips.
  state = _run(tx, [jnp.nan] * 20, params)
  ols.check_skipped_steps(state, max_consecutive_skips=21)  # below the limit
  with pytest.raises(ols.NonFiniteStepsError, match="at its floor") as e:
    ols.check_skipped_steps(state, max_consecutive_skips=20)
  assert "20 steps in a row" in str(e.value) and "model produces NaN" in str(e.value)

  # Overflow: a few skips while the scale is still high.
  state = _run(tx, [jnp.inf] * 3, params)
  with pytest.raises(ols.NonFiniteStepsError, match="still backing off"):
    ols.check_skipped_steps(state, max_consecutive_skips=3)

  # An applied step resets the run of skips.
  state = _run(tx, [jnp.inf] * 3 + [1.0], params)
  ols.check_skipped_steps(state, max_consecutive_skips=1)

  # A fixed scale never backs off: the message does not say it will.
  static = _run(ols.static_loss_scale(optax.sgd(0.1), 1024.0), [jnp.nan] * 5, params)
  with pytest.raises(ols.NonFiniteStepsError, match="fixed scale .* never") as e:
    ols.check_skipped_steps(static, max_consecutive_skips=4)
  assert "The loss scale is 1024 and still backing off" not in str(e.value)
  with pytest.raises(ols.NonFiniteStepsError, match="at its floor"):
    ols.check_skipped_steps(static, max_consecutive_skips=4, min_scale=1024.0)


def test_diagnostics_of_an_abstract_state_are_abstract():
  """``jax.eval_shape``'s state, as get_scale takes it (a TypeError from
  comparing a ShapeDtypeStruct)."""
  tx = ols.dynamic_loss_scale(optax.sgd(0.1))
  abstract = jax.eval_shape(tx.init, _params())
  d = ols.diagnostics(abstract)
  assert d["last_step_skipped"] == jax.ShapeDtypeStruct((), jnp.bool_)
  assert d["loss_scale"] == jax.ShapeDtypeStruct((), jnp.float32)
  concrete = ols.diagnostics(tx.init(_params()))
  assert set(d) == set(concrete)


def test_check_skipped_steps_accepts_diagnostics_and_rejects_tracers():
  params = _params()
  tx = ols.dynamic_loss_scale(optax.sgd(0.1))
  state = _run(tx, [jnp.nan] * 2, params)
  diag = ols.diagnostics(state)
  for d in (diag, jax.device_get(diag)):
    with pytest.raises(ols.NonFiniteStepsError):
      ols.check_skipped_steps(d, max_consecutive_skips=2)
  with pytest.raises(ValueError, match="outside jax.jit"):
    jax.jit(lambda s: ols.check_skipped_steps(s, max_consecutive_skips=2))(state)
  for bad in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match="max_consecutive_skips"):
      ols.check_skipped_steps(state, max_consecutive_skips=bad)
  with pytest.raises(ValueError, match="No loss-scale state"):
    ols.check_skipped_steps(optax.sgd(0.1).init(params))


# --------------------------------------------------------------------------
# ema_params
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_ema_params_matches_a_numpy_model(dtype):
  params = _params(dtype)
  m = 0.75
  tx = optax.chain(optax.sgd(0.5), ols.ema_params(m))
  state = tx.init(params)
  update = jax.jit(tx.update)
  ref = None
  p = params
  for v in [1.0, -2.0, 3.0, 0.5]:
    updates, state = update(_grads(v, dtype), state, p)
    p = optax.apply_updates(p, updates)
    new = {k: np.asarray(x, np.float32) for k, x in p.items()}
    ref = new if ref is None else {k: m * ref[k] + (1 - m) * new[k] for k in new}
  ema = ols.get_ema_params(state)
  chex.assert_trees_all_equal_dtypes(
    ema, jax.tree.map(lambda x: x.astype(jnp.float32), params)
  )
  for k in ref:
    np.testing.assert_allclose(np.asarray(ema[k]), ref[k], rtol=1e-6)
  final = ols.porting.finalize_variable_values(p, state)
  chex.assert_trees_all_equal_dtypes(final, params)


def test_ema_overwrite_frequency_sets_the_params_to_the_average():
  params = _params()
  tx = optax.chain(optax.sgd(1.0), ols.ema_params(0.5, overwrite_frequency=2))
  state = tx.init(params)
  p = params
  for i, v in enumerate([1.0, 1.0, 1.0, 1.0]):
    updates, state = tx.update(_grads(v), state, p)
    p = optax.apply_updates(p, updates)
    if i % 2 == 1:
      chex.assert_trees_all_close(p, ols.get_ema_params(state), rtol=1e-7)
    elif i > 0:  # on the first step the average *is* the parameters
      assert not np.allclose(p["w"], ols.get_ema_params(state)["w"])


@pytest.mark.standard_promotion  # optax.sgd on the int32 leaf
def test_ema_is_frozen_on_skipped_steps_and_passes_other_leaves():
  params = {**_params(), "count": jnp.array(3, jnp.int32), "none": None}
  tx = ols.dynamic_loss_scale(
    optax.chain(optax.sgd(1.0), ols.ema_params(0.5)), initial_scale=1.0
  )
  grads = {**_grads(1.0), "count": jnp.array(0, jnp.int32), "none": None}
  state = tx.init(params)
  _, state = tx.update(grads, state, params)
  before = ols.get_ema_params(state)
  bad = {**grads, "w": grads["w"].at[0, 0].set(jnp.nan)}
  _, state = tx.update(bad, state, params)
  chex.assert_trees_all_equal(ols.get_ema_params(state), before)
  assert int(ols.get_ema_params(state)["count"]) == 3


@pytest.mark.parametrize("jit", [False, True])
def test_a_python_float_parameter_is_averaged_as_an_array(jit):
  tx = ols.ema_params(0.5)
  params = {"w": 2.0, "a": jnp.ones(2, jnp.bfloat16)}
  state = tx.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  # parameters 2.5, 3.0: the first average is the new parameter, then halfway
  for new, want in ((2.5, 2.5), (3.0, 2.75)):
    updates, state = update({"w": 0.5, "a": jnp.zeros(2, jnp.bfloat16)}, state, params)
    params = optax.apply_updates(params, updates)
    ema = ols.get_ema_params(state)
    assert float(params["w"]) == new
    assert ema["w"].dtype == jnp.float32 and float(ema["w"]) == want


def test_ema_params_bad_input():
  for m in (-0.1, 1.5, float("nan"), "0.9"):
    with pytest.raises(ValueError, match="momentum"):
      ols.ema_params(m)
  for f in (0, -3, 2.0):
    with pytest.raises(ValueError, match="overwrite_frequency"):
      ols.ema_params(0.9, overwrite_frequency=f)
  tx = ols.ema_params()
  with pytest.raises(ValueError, match="needs the parameters"):
    tx.update(_grads(1.0), tx.init(_params()))
  with pytest.raises(ValueError, match="No ema_params state"):
    ols.get_ema_params(optax.sgd(0.1).init(_params()))
  two = optax.chain(ols.ema_params(), ols.ema_params())
  with pytest.raises(ValueError, match="Found 2 ema_params states"):
    ols.get_ema_params(two.init(_params()))


@pytest.mark.standard_promotion  # optax's sgd of an integer leaf
@pytest.mark.parametrize("other", [jnp.int32(3), jnp.arange(4)], ids=str)
def test_ema_params_copies_every_array_so_a_donated_step_runs(other):
  """The state holds no buffer of the parameters (an integer one included):
  a step donating both would donate it twice."""
  params = {"w": jnp.ones(3), "n": other}
  tx = optax.chain(optax.sgd(0.1), ols.ema_params(0.9))
  state = tx.init(params)
  held = {id(x) for x in jax.tree.leaves(state)}
  assert not any(id(p) in held for p in jax.tree.leaves(params))

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  grads = {"w": jnp.ones(3), "n": jnp.zeros_like(other)}  # as its own zeros
  want = jax.jit(step)(params, state, grads)
  got = jax.jit(step, donate_argnums=(0, 1))(params, state, grads)
  chex.assert_trees_all_equal(got, want)
