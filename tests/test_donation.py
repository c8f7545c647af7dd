"""Every public optimizer and wrapper survives the standard donated step.

``jax.jit(step, donate_argnums=(0, 1))`` fails on its first call when a
state leaf is the very buffer of a parameter ("Attempt to donate the same
buffer twice"): nothing that ``init`` returns may alias its input.
"""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
import versions

import optax_lossscale as ols

pytestmark = pytest.mark.standard_promotion  # optax's adam

OPTIMIZERS = {
  "dynamic_loss_scale": lambda: ols.dynamic_loss_scale(optax.adam(1e-3)),
  "static_loss_scale": lambda: ols.static_loss_scale(optax.adam(1e-3), 8.0),
  "with_loss_scale(NoOp)": lambda: ols.porting.with_loss_scale(
    optax.adam(1e-3), ols.porting.NoOpLossScale()
  ),
  "enable_mixed_precision float16": lambda: ols.porting.enable_mixed_precision(
    jnp.sum, optax.adam(1e-3), compute_dtype=jnp.float16
  )[1],
  "enable_mixed_precision bfloat16": lambda: ols.porting.enable_mixed_precision(
    jnp.sum, optax.adam(1e-3), compute_dtype=jnp.bfloat16
  )[1],
  "ema_params in a chain": lambda: ols.dynamic_loss_scale(
    optax.chain(optax.sgd(0.1), ols.ema_params(0.9))
  ),
  "LossScaleOptimizer": lambda: ols.porting.LossScaleOptimizer("adam"),
  "LossScaleOptimizer use_ema": lambda: ols.porting.LossScaleOptimizer(
    "adam", use_ema=True
  ),
  "LossScaleOptimizer use_ema overwrite": lambda: ols.porting.LossScaleOptimizer(
    "sgd", use_ema=True, ema_overwrite_frequency=2
  ),
  "LossScaleOptimizer accumulation, decay, clip": lambda: (
    ols.porting.LossScaleOptimizer(
      "adamw", gradient_accumulation_steps=2, weight_decay=0.01, clipnorm=1.0
    )
  ),
  "LossScaleOptimizer fixed, factor": lambda: ols.porting.LossScaleOptimizer(
    "sgd", dynamic=False, initial_scale=4.0, loss_scale_factor=2.0
  ),
  "ExperimentalLossScaleOptimizer": lambda: ols.porting.ExperimentalLossScaleOptimizer(
    "sgd", "dynamic"
  ),
  "track_nonfinite": lambda: ols.dynamic_loss_scale(
    optax.adam(1e-3), track_nonfinite=True
  ),
  "MultiSteps inside": lambda: ols.dynamic_loss_scale(
    optax.MultiSteps(optax.sgd(0.1), 2)
  ),
  "stochastic_rounding": lambda: ols.dynamic_loss_scale(
    optax.chain(optax.sgd(0.1), ols.stochastic_rounding(0))
  ),
  "kahan_summation": lambda: ols.dynamic_loss_scale(
    optax.chain(optax.sgd(0.1), ols.kahan_summation())
  ),
  # a float32 master of a float32 parameter would be the parameter itself
  "master_weights float32": lambda: ols.dynamic_loss_scale(
    ols.master_weights(optax.adamw(1e-3), store="float32")
  ),
  "master_weights remainder": lambda: ols.dynamic_loss_scale(
    ols.master_weights(optax.adamw(1e-3))
  ),
  "LossScaleOptimizer master_weights": lambda: ols.porting.LossScaleOptimizer(
    ols.master_weights(optax.inject_hyperparams(optax.sgd)(0.1), store="float32"),
    weight_decay=0.1,
  ),
}


@pytest.mark.sampled
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_donated_step_runs(name, dtype):
  if versions.JAX < (0, 10):  # older XLAs may not reuse some donated buffers
    warnings.filterwarnings("ignore", "Some donated buffers were not usable")
  tx = OPTIMIZERS[name]()
  params = {"w": jnp.ones((4, 3), dtype), "b": jnp.zeros((3,), dtype)}
  state = tx.init(params)  # eagerly, as training code does
  init_buffers = {id(x) for x in jax.tree.leaves(params)}
  aliased = [x for x in jax.tree.leaves(state) if id(x) in init_buffers]
  assert not aliased, name

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))
  grads = jax.tree.map(lambda p: jnp.full_like(p, 2.0), params)
  for _ in range(3):
    params, state = step(params, state, grads)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


@pytest.mark.sampled
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_an_eager_update_returns_a_state_of_its_own(name):
  """No leaf of the new state is a buffer of the state given (a static scale's
  counters were passed through): donating the new state in the next step
  must leave the old one readable."""
  tx = OPTIMIZERS[name]()
  params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}
  state = tx.init(params)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 2.0), params)
  _, new = tx.update(grads, state, params)
  given = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)}
  shared = [
    jax.tree_util.keystr(path)
    for path, x in jax.tree_util.tree_flatten_with_path(new)[0]
    if x.unsafe_buffer_pointer() in given
  ]
  assert not shared, shared
