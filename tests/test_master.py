"""master_weights: float32 master weights for bfloat16/float16 parameters, exactly.

Against plain optax on float32 parameters, both jitted (XLA's CPU backend
contracts multiply-adds differently in eager and jitted code): the masters
bit for bit, the half-precision parameters the masters rounded (ties of
the remainder store away from zero, counted). The float16 path under a loss
scale against float32 Adam on tiny gradients, and the recipe it replaces
failing. Skips, donation, Orbax, the loss scale's float32 gradients, the
one step ``apply_updates`` cannot land, and the errors.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols
from optax_lossscale._base import rounding as _rounding

pytestmark = pytest.mark.standard_promotion  # optax's adam, apply_updates

BF16, F16, F32 = (jnp.dtype(d) for d in ("bfloat16", "float16", "float32"))
STEPS = 200


def _fixed_gradients(shape, seed=0):
  """Gradients spanning 1e-8 to 1e-1, both signs, fixed over the steps."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(
    np.sign(rng.normal(size=shape)) * 10.0 ** rng.uniform(-8, -1, shape), F32
  )


def _start(dtype, seed=1, shape=(64, 48)):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.normal(size=shape) * 10.0 ** rng.uniform(-2, 1, shape), dtype)


def _train(tx, params, grads, steps=STEPS):
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(steps):
    params, state = step(params, state)
  return params, state


@pytest.mark.parametrize(
  "store, dtype", [("remainder", BF16), ("float32", F16), ("float32", BF16)]
)
def test_the_masters_are_float32_adamw_bit_for_bit(store, dtype):
  p0 = _start(dtype)
  g = {"w": _fixed_gradients(p0.shape)}
  adamw = lambda: optax.adamw(1e-3, weight_decay=0.1)  # noqa: E731
  params, state = _train(ols.master_weights(adamw(), store=store), {"w": p0}, g)
  ref, _ = _train(adamw(), {"w": p0.astype(F32)}, g)
  master = ols.get_master_weights(state, params)["w"]
  assert master.dtype == F32
  np.testing.assert_array_equal(
    np.asarray(master).view(np.uint32), np.asarray(ref["w"]).view(np.uint32)
  )
  # The parameter is its master rounded to nearest: ties to even with a
  # float32 copy, ties away from zero (only at a low half of 0x8000) with
  # the remainder.
  got = np.asarray(params["w"])
  rne = np.asarray(ref["w"]).astype(dtype)
  differ = got.view(np.uint16) != rne.view(np.uint16)
  if store == "float32":
    assert not differ.any()
  else:
    low = np.asarray(ref["w"]).view(np.uint32) & 0xFFFF
    assert (low[differ] == 0x8000).all()
  moved = np.asarray(params["w"], F32) != np.asarray(p0, F32)
  assert moved.mean() > 0.3  # it trained


def test_a_tie_at_0x8000_rounds_away_from_zero_and_the_join_is_exact():
  ties = np.array([0x3F808000, 0xBF808000, 0x3F818000, 0x00008000], np.uint32)
  master = jnp.asarray(ties.view(np.float32))
  param, remainder = _rounding.split_remainder(master)
  want_high = (ties + 0x8000) >> 16  # away from zero, even on an even high half
  assert np.asarray(param).view(np.uint16).tolist() == want_high.tolist()
  assert np.asarray(remainder).tolist() == [-0x8000] * 4
  back = np.asarray(_rounding.join_remainder(param, remainder)).view(np.uint32)
  assert back.tolist() == ties.tolist()


def test_the_state_is_two_bytes_a_parameter_with_the_remainder():
  params = {"w": jnp.ones((8, 8), BF16), "b": jnp.ones(8, F32), "n": jnp.arange(3)}
  state = ols.master_weights(optax.adam(1e-3)).init(params)
  assert state.master["w"].dtype == jnp.int16 and state.master["w"].shape == (8, 8)
  assert state.master["b"] is None and state.master["n"] is None
  adam = state.inner_state[0]
  assert adam.mu["w"].dtype == F32 and adam.nu["w"].dtype == F32  # on the masters
  copy = ols.master_weights(optax.adam(1e-3), store="float32").init(params)
  assert copy.master["w"].dtype == F32


def test_other_leaves_are_the_inner_optimizers_as_they_are():
  params = {"w": jnp.ones(4, BF16), "f": jnp.full(3, 2.0), "i": jnp.arange(2)}
  grads = {"w": jnp.full(4, 0.5), "f": jnp.full(3, 0.25), "i": jnp.arange(2)}
  tx = ols.master_weights(optax.sgd(1.0))
  updates, _ = tx.update(grads, tx.init(params), params)
  plain, _ = optax.sgd(1.0).update(grads, optax.sgd(1.0).init(params), params)
  np.testing.assert_array_equal(updates["f"], plain["f"])
  np.testing.assert_array_equal(updates["i"], plain["i"])
  assert updates["w"].dtype == F32


def test_a_step_apply_updates_cannot_land_keeps_param_and_remainder_the_master():
  # From 1.0 to 1e-6 in one step: a shrink past 2**15, which no float32
  # update added to 1.0 can land exactly (exact_update's one exception).
  params = {"w": jnp.ones(3, BF16)}
  tx = ols.master_weights(optax.sgd(1.0))
  state = tx.init(params)
  grads = {"w": jnp.full(3, 1.0 - 1e-6)}
  updates, state = tx.update(grads, state, params)
  params = optax.apply_updates(params, updates)
  master = ols.get_master_weights(state, params)["w"]
  # The invariant holds: the master is what parameter and state make, and it
  # is the parameter, within one bfloat16 unit of the float32 master (which is
  # 1 - float32(1 - 1e-6) = 1.0133e-6, float32's own cancellation).
  np.testing.assert_array_equal(master, np.asarray(params["w"], F32))
  want = np.float32(1.0) - np.float32(1.0 - 1e-6)
  assert np.all(np.abs(np.asarray(master) - want) <= want * 2.0**-8)


# --------------------------------------------------------------------------
# Under a loss scale: float32 gradients, skips, the float16 path.
# --------------------------------------------------------------------------


def test_the_loss_scale_hands_it_float32_gradients():
  # 2**-30 is 0 in float16: unscaled back into float16 it would be lost.
  scale = 2.0**15
  params = {"w": jnp.zeros(2, F16)}
  tx = ols.dynamic_loss_scale(
    ols.master_weights(optax.sgd(1.0), store="float32"), initial_scale=scale
  )
  state = tx.init(params)
  scaled = {"w": jnp.full(2, 2.0**-30 * scale, F16)}  # a float16 gradient
  updates, state = tx.update(scaled, state, params)
  master = ols.get_master_weights(state, optax.apply_updates(params, updates))["w"]
  np.testing.assert_array_equal(master, np.float32(-(2.0**-30)))


@pytest.mark.parametrize("store", ["remainder", "float32"])
def test_a_skipped_step_changes_nothing(store):
  params = {"w": _start(BF16, shape=(6,))}
  tx = ols.dynamic_loss_scale(ols.master_weights(optax.adam(1e-2), store=store))
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  updates, state = step(params, state, {"w": jnp.ones(6)})
  params = optax.apply_updates(params, updates)
  before = jax.tree.map(np.asarray, (params, state.inner_state))
  updates, after = step(params, state, {"w": jnp.ones(6).at[2].set(jnp.nan)})
  assert int(after.skipped_steps) == 1
  np.testing.assert_array_equal(updates["w"], 0.0)
  for a, b in zip(
    jax.tree.leaves(before[1]), jax.tree.leaves(after.inner_state), strict=True
  ):
    np.testing.assert_array_equal(a, np.asarray(b))
  np.testing.assert_array_equal(
    np.asarray(optax.apply_updates(params, updates)["w"]).view(np.uint16),
    before[0]["w"].view(np.uint16),
  )


def _tiny_gradient_run(tx, params, steps=60, scale=2.0**15):
  """Steps on gradients of 1e-7 to 1e-3, given scaled (as of loss * scale)."""
  rng = np.random.default_rng(3)
  g = jnp.asarray(
    np.sign(rng.normal(size=params["w"].shape))
    * 10.0 ** rng.uniform(-7, -3, params["w"].shape),
    F32,
  )
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    s = ols.get_scale(state) if scale else 1.0
    grads = {"w": (g * s).astype(params["w"].dtype)}
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates

  largest = 0.0
  for _ in range(steps):
    params, state, updates = step(params, state)
    largest = max(largest, float(jnp.max(jnp.abs(updates["w"]))))
  return params, state, largest


def test_float16_parameters_train_under_a_loss_scale_with_a_float32_master():
  lr = 1e-3
  p0 = {"w": _start(F16, seed=5, shape=(500,))}
  tx = ols.dynamic_loss_scale(ols.master_weights(optax.adam(lr), store="float32"))
  params, state, largest = _tiny_gradient_run(tx, p0)
  ref, _, _ = _tiny_gradient_run(optax.adam(lr), {"w": p0["w"].astype(F32)}, scale=None)
  master = ols.get_master_weights(state, params)["w"]
  assert int(ols.diagnostics(state)["skipped_steps"]) == 0
  # No update larger than a few learning rates (float16 steps are coarse:
  # a weight moves by its own resolution when it moves), the trajectory as
  # float32 Adam's.
  assert largest <= 5 * lr + float(jnp.max(jnp.abs(p0["w"]))) * 2.0**-10
  np.testing.assert_allclose(master, ref["w"], atol=1e-3)


# float16 parameters with float16 optimizer state, on purpose (the warning
# itself: tests/test_half_state.py).
@pytest.mark.filterwarnings("ignore::optax_lossscale.HalfPrecisionStateWarning")
def test_the_recipe_it_replaces_trains_on_garbage():
  # The control: Adam on float32 copies of float16 parameters, stochastic
  # rounding last, under a loss scale: the scale hands Adam float16
  # gradients, (1 - b2) g**2 underflows, and the steps are huge.
  lr = 1e-3
  p0 = {"w": _start(F16, seed=5, shape=(500,))}
  adam, rounding = optax.adam(lr), ols.stochastic_rounding(0)
  tx = ols.dynamic_loss_scale(optax.chain(adam, rounding))
  init = tx.init

  def init_on_float32(params):
    state = init(params)
    f32 = jax.tree.map(lambda p: p.astype(F32), params)
    return state._replace(inner_state=(adam.init(f32), rounding.init(params)))

  tx = tx._replace(init=init_on_float32)
  _, _, largest = _tiny_gradient_run(tx, p0, steps=3)
  assert largest > 100 * lr


def test_check_skipped_steps_blames_the_update_not_the_model():
  params = {"w": jnp.array([1.0, jnp.nan], F16)}  # an applied update made it so
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), min_scale=1.0, initial_scale=1.0)
  state = tx.init(params)
  for _ in range(3):
    _, state = tx.update({"w": jnp.array([1.0, jnp.nan], F16)}, state, params)
  with pytest.raises(ols.NonFiniteStepsError) as e:
    ols.check_skipped_steps(state, max_consecutive_skips=2, params=params)
  message = str(e.value)
  assert "the loss was finite but the optimizer's update was not" in message
  assert "['w']: 1 NaN" in message and "master_weights" in message
  # Without params nothing says whether the model or an applied update
  # made the gradients NaN: the message names both and asks for params.
  with pytest.raises(ols.NonFiniteStepsError, match="pass params= to tell which"):
    ols.check_skipped_steps(state, max_consecutive_skips=2)


# --------------------------------------------------------------------------
# Donation, checkpoints, errors.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("store", ["remainder", "float32"])
def test_a_donated_jitted_step_runs_and_matches(store):
  p0 = {"w": _start(BF16, shape=(8, 4))}
  tx = ols.dynamic_loss_scale(ols.master_weights(optax.adam(1e-2), store=store))
  g = {"w": _fixed_gradients((8, 4))}

  def step(params, state):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  donated = jax.jit(step, donate_argnums=(0, 1))
  plain = jax.jit(step)
  a = jax.tree.map(jnp.copy, (p0, tx.init(p0)))
  b = (p0, tx.init(p0))
  for _ in range(3):
    a, b = donated(*a), plain(*b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_an_orbax_round_trip_continues_bit_for_bit(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  p0 = {"w": _start(BF16, shape=(8, 4))}
  tx = ols.dynamic_loss_scale(ols.master_weights(optax.adam(1e-2)))
  g = {"w": _fixed_gradients((8, 4))}

  @jax.jit
  def step(params, state):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  run = (p0, tx.init(p0))
  for _ in range(3):
    run = step(*run)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", run)
  checkpointer.wait_until_finished()
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, (p0, tx.init(p0)))
  restored = checkpointer.restore(tmp_path / "ckpt", target)
  for _ in range(3):
    run, restored = step(*run), step(*restored)
  for x, y in zip(jax.tree.leaves(run), jax.tree.leaves(restored), strict=True):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_the_errors_say_what_to_do():
  with pytest.raises(ValueError, match="`store` must be one of 'remainder', 'float32'"):
    ols.master_weights(optax.sgd(1.0), store="bf16")
  with pytest.raises(ValueError, match="Use store='float32'"):
    ols.master_weights(optax.sgd(1.0)).init({"w": jnp.ones(2, F16)})
  tx = ols.master_weights(optax.sgd(1.0))
  state = tx.init({"w": jnp.ones(2, BF16)})
  with pytest.raises(ValueError, match="needs the parameters"):
    tx.update({"w": jnp.ones(2)}, state)
  with pytest.raises(ValueError, match="made for other parameters"):
    tx.update({"w": jnp.ones(2)}, state, {"w": jnp.ones(2, F32)})
  with pytest.raises(ValueError, match="No master_weights state"):
    ols.get_master_weights(optax.sgd(1.0).init({"w": jnp.ones(2)}), {"w": jnp.ones(2)})
  with pytest.raises(ValueError, match="`inner` must be an optax"):
    ols.master_weights("adam")


# (dtype, store, the parameter's start, steps taking its master past the
# dtype's largest value and back): the parameter overflows to inf, then its
# master comes back. No update takes a parameter back from inf (inf + u is
# inf or NaN); it was given new - inf, and became NaN (with "remainder",
# the master too).
PAST_THE_LARGEST = {
  "float16, float32 copy": (jnp.float16, "float32", 65400.0, [-200.0, -200.0, 1e3]),
  "bfloat16, float32 copy": (jnp.bfloat16, "float32", 3.385e38, [-6e35, -6e35, 3e36]),
  "bfloat16, remainder": (jnp.bfloat16, "remainder", 3.385e38, [-6e35, -6e35, 3e36]),
}  # fmt: skip


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", PAST_THE_LARGEST)
def test_a_parameter_at_inf_stays_there_and_never_becomes_nan(case, jitted):
  dtype, store, start, grads = PAST_THE_LARGEST[case]
  tx = ols.master_weights(optax.sgd(1.0), store=store)
  params = {"w": jnp.array([start], dtype)}
  state = tx.init(params)
  update = jax.jit(tx.update) if jitted else tx.update
  seen = []
  for g in grads:
    updates, state = update({"w": jnp.array([g], jnp.float32)}, state, params)
    params = optax.apply_updates(params, updates)
    seen.append(float(params["w"][0]))
  master = float(ols.get_master_weights(state, params)["w"][0])
  assert seen[1] == np.inf and seen[2] == np.inf  # never NaN
  expected = np.float32(float(jnp.array(start, dtype)))
  for g in grads:  # sgd(1.0) on the float32 master
    expected = np.float32(expected - np.float32(g))
  if store == "float32":  # the copy keeps the exact master, finite again
    np.testing.assert_allclose(master, expected, rtol=1e-6)
  else:  # the master is the parameter it could not leave
    assert master == np.inf


def test_a_loss_scale_of_one_skips_a_nonfinite_step_where_apply_if_finite_cannot():
  """What the guide recommends: static_loss_scale(master_weights(...), 1.0)
  skips a NaN step and changes nothing; optax's apply_if_finite around
  master_weights fails to trace (its skip's zeros are in the gradients'
  dtype, master_weights' updates float32), as the guide says."""
  params = {"w": jnp.linspace(-1.0, 1.0, 8).astype(jnp.bfloat16)}
  good = {"w": jnp.full(8, 0.25, jnp.bfloat16)}
  bad = {"w": good["w"].at[3].set(jnp.nan)}
  tx = ols.static_loss_scale(ols.master_weights(optax.adam(1e-3)), 1.0)
  update = jax.jit(tx.update)
  _, state = update(good, tx.init(params), params)
  updates, skipped = update(bad, state, params)
  np.testing.assert_array_equal(updates["w"], 0.0)
  chex.assert_trees_all_equal(skipped.inner_state, state.inner_state)
  assert int(ols.diagnostics(skipped)["skipped_steps"]) == 1
  plain = optax.apply_if_finite(ols.master_weights(optax.adam(1e-3)), 3)
  with pytest.raises(TypeError, match="float32.*bfloat16"):  # JAX's words vary
    jax.jit(plain.update)(good, plain.init(params), params)
