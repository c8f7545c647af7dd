"""A scale outside the configuration's range, and scales below 1.

A state restored from a run with another configuration comes into this
configuration's range at its first update; when its scale is below 1 and
this configuration's are not, that update is skipped (unscaling by it can
overflow, which the check of the scaled gradients does not see). With
scales below 1 allowed (``min_scale < 1``), the finiteness of the unscaled
gradients, as the inner optimizer receives them, decides the skip.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols
from optax_lossscale._loss_scale import config as _config
from optax_lossscale._loss_scale import core as _core

F16, F32 = jnp.float16, jnp.float32


def _restored(tx, params, scale):
  """``tx``'s state with the loss scale of another run."""
  state = tx.init(params)
  return state._replace(loss_scale=jnp.asarray(scale, F32))


# (name, transformation factory, the scale the state comes to)
ENTRY_POINTS = [
  ("dynamic", lambda inner: ols.dynamic_loss_scale(inner), 1.0),
  (
    "dynamic min_scale=4",
    lambda inner: ols.dynamic_loss_scale(inner, min_scale=4.0),
    4.0,
  ),
  (
    "dynamic hysteresis=2",
    lambda inner: ols.dynamic_loss_scale(inner, hysteresis=2),
    1.0,
  ),
  ("static", lambda inner: ols.static_loss_scale(inner, 8.0), 8.0),
  (
    "with_loss_scale",
    lambda inner: ols.porting.with_loss_scale(inner, ols.porting.DynamicLossScale()),
    1.0,
  ),
]


@pytest.mark.parametrize(
  "name, make, into", ENTRY_POINTS, ids=[e[0] for e in ENTRY_POINTS]
)
def test_a_scale_below_1_restored_into_a_range_above_1_is_skipped_and_brought_in(
  name, make, into
):
  params = {"w": jnp.ones(2, F16)}
  tx = make(optax.sgd(1.0))
  # The gradient of a run with min_scale=2**-4 at scale 0.25: finite scaled,
  # 30000 / 0.25 = 120000 overflows float16 when unscaled.
  state = _restored(tx, params, 0.25)
  grads = {"w": jnp.array([30000.0, 1.0], F16)}
  updates, state = jax.jit(tx.update)(grads, state, params)
  np.testing.assert_array_equal(updates["w"], 0.0)
  assert np.all(np.isfinite(optax.apply_updates(params, updates)["w"]))
  assert int(state.skipped_steps) == 1
  assert float(state.loss_scale) == into
  # From then on, in range, a finite step is applied.
  scale = float(state.loss_scale)
  updates, state = jax.jit(tx.update)({"w": jnp.full(2, scale, F16)}, state, params)
  np.testing.assert_array_equal(updates["w"], -1.0)
  assert int(state.skipped_steps) == 1


@pytest.mark.parametrize("scale", [2.0**30, 3.0])
def test_a_scale_of_1_or_more_outside_the_range_is_applied_and_brought_in(scale):
  # Unscaling by a scale >= 1 cannot overflow: the step is applied.
  params = {"w": jnp.ones(2, F32)}
  tx = ols.dynamic_loss_scale(optax.sgd(1.0), min_scale=4.0, max_scale=2.0**24)
  state = _restored(tx, params, scale)
  grads = {"w": jnp.full(2, scale, F32)}
  updates, state = jax.jit(tx.update)(grads, state, params)
  np.testing.assert_array_equal(updates["w"], -1.0)
  assert int(state.skipped_steps) == 0
  assert float(state.loss_scale) == float(np.clip(scale, 4.0, 2.0**24))


# (inner, parameter dtype, gradient, whether applied, the parameter's update)
BELOW_1 = [
  ("float16 overflows when unscaled", "sgd", F16, 30000.0, False, 0.0),
  ("float16 finite when unscaled", "sgd", F16, 1000.0, True, -4000.0),
  ("float32", "sgd", F32, 30000.0, True, -120000.0),
  # master_weights receives the gradient unscaled in float32: finite.
  ("float16 to a float32 master", "master", F16, 30000.0, True, None),
]


@pytest.mark.parametrize("case", BELOW_1, ids=[c[0] for c in BELOW_1])
@pytest.mark.parametrize("entry", ["dynamic", "static"])
def test_with_scales_below_1_the_unscaled_gradients_decide(case, entry):
  _, inner, dtype, g, applied, want = case
  params = {"w": jnp.zeros(2, dtype)}
  inner = optax.sgd(1.0)
  if case[1] == "master":
    inner = ols.master_weights(inner, store="float32")
  if entry == "dynamic":
    tx = ols.dynamic_loss_scale(inner, initial_scale=0.25, min_scale=2.0**-10)
  else:
    tx = ols.static_loss_scale(inner, 0.25)
  state = tx.init(params)
  updates, state = jax.jit(tx.update)({"w": jnp.full(2, g, dtype)}, state, params)
  assert int(state.skipped_steps) == (0 if applied else 1)
  if not applied:
    np.testing.assert_array_equal(updates["w"], 0.0)
  elif want is not None:
    np.testing.assert_array_equal(np.asarray(updates["w"], F32), want)
  else:
    applied = {"w": (params["w"].astype(F32) + updates["w"]).astype(dtype)}
    master = ols.get_master_weights(state, applied)  # apply_updates, strictly
    np.testing.assert_array_equal(master["w"], -g / 0.25)


def test_the_check_reads_the_unscaled_gradients_only_when_scales_can_be_below_1():
  # One finite check, on the scaled gradients where no scale is below 1, on
  # the unscaled ones (what the inner optimizer receives) otherwise.
  scaled = {"w": jnp.array([30000.0], F16)}
  unscaled = _core.unscale_tree(scaled, 0.25)
  default = _config.dynamic_config()
  assert bool(_core.check(scaled, unscaled, default))
  config = _config.dynamic_config(initial_scale=0.25, min_scale=0.25)
  assert not bool(_core.check(scaled, unscaled, config))
  # Given the scale the gradients were computed with, a configuration of
  # scales >= 1 refuses one below 1 (its unscale would go unchecked).
  assert bool(_core.check(scaled, unscaled, default, loss_scale=1.0))
  assert not bool(_core.check(scaled, unscaled, default, loss_scale=0.25))
  assert not bool(_core.check({}, {}, default, loss_scale=0.25))


@pytest.mark.parametrize(
  "make, into",
  [
    (lambda: ols.porting.DynamicLossScale(), 1.0),
    (lambda: ols.porting.DynamicLossScale(min_scale=4.0), 4.0),
    (lambda: ols.porting.StaticLossScale(8.0), 8.0),
  ],
  ids=["dynamic", "dynamic min_scale=4", "static"],
)
def test_a_loss_scale_object_restored_below_1_is_skipped_and_brought_in(make, into):
  """``unscale_and_update`` decides as the transformations: a state scale
  below 1 under scales of 1 or more skips the step, whose scaled gradients
  are finite but overflow float16 when unscaled."""
  ls = make()
  ls = ls.replace(ls.counters._replace(loss_scale=jnp.asarray(0.25, F32)))
  grads = {"w": jnp.array([30000.0, 1.0], F16)}
  _, new, should_apply = jax.jit(lambda ls, g: ls.unscale_and_update(g))(ls, grads)
  assert not bool(should_apply)
  assert float(new.loss_scale) == into
  assert int(new.skipped_steps) == 1
