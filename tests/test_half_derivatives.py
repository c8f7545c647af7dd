"""Derivatives through the step in half precision: what works on the bits
of a bfloat16 or float16 value (widening it, rounding to it, splitting a
master weight into parameter and remainder) is differentiated as the cast
it is, as JAX differentiates ``astype``; bit operations alone have a zero
derivative, and differentiating through an update (hypergradients, MAML,
a learned optimizer) silently lost the gradients' term.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

LR, SCALE = 0.5, 8.0

# (transformation, the parameters' dtype, d sum(update) / d gradient)
STEPS = {
  "dynamic_loss_scale": (
    lambda: ols.dynamic_loss_scale(optax.sgd(LR), initial_scale=SCALE), -LR / SCALE
  ),
  "static_loss_scale": (
    lambda: ols.static_loss_scale(optax.sgd(LR), SCALE), -LR / SCALE
  ),
  "master_weights, remainder": (
    lambda: ols.master_weights(optax.sgd(LR)), -LR
  ),
  "master_weights, float32 copy": (
    lambda: ols.master_weights(optax.sgd(LR), store="float32"), -LR
  ),
  "loss scale over master weights": (
    lambda: ols.dynamic_loss_scale(
      ols.master_weights(optax.sgd(LR), store="float32"), initial_scale=SCALE
    ),
    -LR / SCALE,
  ),
  "stochastic_rounding": (
    lambda: optax.chain(optax.sgd(LR), ols.stochastic_rounding(jax.random.key(0))),
    -LR,
  ),
  "kahan_summation": (lambda: optax.chain(optax.sgd(LR), ols.kahan_summation()), -LR),
}  # fmt: skip


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=str)
@pytest.mark.parametrize("name", STEPS)
def test_an_update_differentiates_in_half_precision(name, dtype, jitted):
  make, expected = STEPS[name]
  if name == "master_weights, remainder" and dtype == jnp.float16:
    pytest.skip("the remainder is bfloat16's (float16 takes store='float32')")
  tx = make()
  params = {"w": jnp.linspace(1.0, 2.0, 4).astype(dtype)}
  state = tx.init(params)

  def total(g):
    updates, _ = tx.update({"w": g}, state, params)
    return jnp.sum(updates["w"].astype(jnp.float32))

  grad = (jax.jit(jax.grad(total)) if jitted else jax.grad(total))(
    jnp.full(4, 0.25, dtype)
  )
  np.testing.assert_allclose(np.asarray(grad, np.float32), expected, rtol=1e-2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=str)
def test_unscale_differentiates_in_half_precision(dtype):
  grad = jax.grad(
    lambda x: jnp.sum(ols.unscale({"w": x}, SCALE)["w"]).astype(jnp.float32)
  )
  np.testing.assert_allclose(
    np.asarray(grad(jnp.full(3, 8.0, dtype)), np.float32), 1 / SCALE
  )
  # forward mode too
  _, tangent = jax.jvp(
    lambda x: ols.unscale({"w": x}, SCALE)["w"],
    (jnp.ones(3, dtype),),
    (jnp.ones(3, dtype),),
  )
  np.testing.assert_allclose(np.asarray(tangent, np.float32), 1 / SCALE)
