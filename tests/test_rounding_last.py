"""Rounding stays last; master weights get float32 gradients from every entry point.

A loss scale hands a :func:`master_weights` optimizer its gradients unscaled
in float32, whichever loss-scale entry point wraps it and wherever in the
inner optimizer it sits (a float16 gradient of 2**-30, 0 in float16,
reaches the master). The Keras facade's weight decay, EMA, clipping and
accumulation act on the master weights, before the rounding: bit for bit
the facade's float32 rule on float32 parameters. With a rounding
transformation in the user's chain, the decay and the EMA (which would
come after it) are refused, saying how to compose them.
"""

import os
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import versions

import optax_lossscale as ols

pytestmark = pytest.mark.standard_promotion  # optax's adam, apply_updates

BF16, F16, F32 = (jnp.dtype(d) for d in ("bfloat16", "float16", "float32"))
SCALE = 2.0**15

ENTRY_POINTS = {
  "dynamic_loss_scale": lambda tx: ols.dynamic_loss_scale(tx, initial_scale=SCALE),
  "static_loss_scale": lambda tx: ols.static_loss_scale(tx, SCALE),
  "LossScaleOptimizer": lambda tx: ols.porting.LossScaleOptimizer(
    tx, initial_scale=SCALE
  ),
  "ExperimentalLossScaleOptimizer": lambda tx: (
    ols.porting.ExperimentalLossScaleOptimizer(tx, ols.porting.DynamicLossScale(SCALE))
  ),
  "with_loss_scale": lambda tx: ols.porting.with_loss_scale(
    tx, ols.porting.DynamicLossScale(SCALE)
  ),
  "enable_mixed_precision": lambda tx: ols.porting.enable_mixed_precision(
    lambda x: x, tx, compute_dtype=jnp.float16, initial_scale=SCALE
  )[1],
}

PLACES = {
  "itself": lambda mw: mw,
  "after clipping": lambda mw: optax.chain(optax.clip_by_global_norm(1e9), mw),
  "in MultiSteps": lambda mw: optax.MultiSteps(mw, 1),
  "in MultiSteps' transformation": lambda mw: optax.MultiSteps(
    mw, 1
  ).gradient_transformation(),
  "in a chain with a schedule": lambda mw: optax.chain(
    mw, optax.scale_by_schedule(lambda n: 1.0)
  ),
}


# Older optax's MultiSteps accumulates in the parameters' float16, which the
# loss scale rightly warns about at init.
_PLACES = [
  pytest.param(p, marks=versions.multisteps_dtypes) if "MultiSteps" in p else p
  for p in PLACES
]


@pytest.mark.sampled
@pytest.mark.parametrize("place", _PLACES)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_float16_gradient_reaches_the_master_in_float32(entry, place):
  params = {"w": jnp.zeros(2, F16)}
  tx = ENTRY_POINTS[entry](
    PLACES[place](ols.master_weights(optax.sgd(1.0), store="float32"))
  )
  state = tx.init(params)
  scaled = {"w": jnp.full(2, 2.0**-30 * SCALE, F16)}  # 2**-30 is 0 in float16
  updates, state = jax.jit(tx.update)(scaled, state, params)
  master = ols.get_master_weights(state, optax.apply_updates(params, updates))["w"]
  np.testing.assert_array_equal(master, np.float32(-(2.0**-30)))


def test_the_facades_unscaled_gradients_are_what_update_hands_on():
  params = {"w": jnp.ones(2, F16)}
  scaled = {"w": jnp.full(2, 2.0**-30 * SCALE, F16)}
  for inner, dtype in (
    (optax.sgd(1.0), F16),
    (ols.master_weights(optax.sgd(1.0), store="float32"), F32),
  ):
    opt = ols.porting.LossScaleOptimizer(inner, initial_scale=SCALE)
    got = opt.get_unscaled_gradients(scaled, opt.init(params))["w"]
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, np.float32(2.0**-30) if dtype == F32 else 0.0)


# --------------------------------------------------------------------------
# The facade's additions act on the master weights.
# --------------------------------------------------------------------------

FACADE = {
  "decay": dict(weight_decay=0.1),
  "everything": dict(
    weight_decay=0.1,
    global_clipnorm=0.05,
    use_ema=True,
    ema_momentum=0.9,
    ema_overwrite_frequency=7,
    gradient_accumulation_steps=2,
  ),
}


def _gradients(shape, steps, dtype):
  """Per-step gradients from 1e-6 to 1e-1, exact in ``dtype``."""
  rng = np.random.default_rng(2)
  g = np.sign(rng.normal(size=(steps, *shape))) * 10.0 ** rng.uniform(
    -6, -1, (steps, *shape)
  )
  return jnp.asarray(g, dtype)


def _facade_run(opt, params, grads):
  state = opt.init(params)

  @jax.jit
  def step(params, state, g):
    scaled = {"w": (g.astype(F32) * opt.loss_scale(state)).astype(g.dtype)}
    updates, state = opt.update(scaled, state, params)
    return optax.apply_updates(params, updates), state

  for g in grads:
    params, state = step(params, state, g)
  return params, state


#: XLA's CPU backend contracts a multiply and an add into one fused
#: multiply-add where its fusions allow, which differs between two programs
#: (a few units in the last place, measured): without FMA instructions the
#: two programs compute the same float32 operations, bit for bit. The test
#: below runs in a subprocess with them off.
NO_FMA = "--xla_cpu_max_isa=AVX"


@pytest.mark.integration
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flag")
def test_the_facade_on_master_weights_is_its_float32_rule_without_fma():
  env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {NO_FMA}"}
  run = subprocess.run(
    [
      sys.executable,
      "-m",
      "pytest",
      "-q",
      "-p",
      "no:cacheprovider",
      "-x",
      f"{__file__}::test_the_facade_on_master_weights_is_its_float32_rule_bit_for_bit",
    ],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    cwd=os.path.dirname(__file__),
  )
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  assert "4 passed" in run.stdout, run.stdout[-500:]


@pytest.mark.parametrize("config", FACADE)
@pytest.mark.parametrize("store, dtype", [("remainder", BF16), ("float32", F16)])
def test_the_facade_on_master_weights_is_its_float32_rule_bit_for_bit(
  store, dtype, config
):
  if NO_FMA not in os.environ.get("XLA_FLAGS", ""):
    pytest.skip("runs in a subprocess without FMA instructions (NO_FMA)")
  steps = 100
  rng = np.random.default_rng(1)
  p0 = jnp.asarray(rng.normal(size=(16, 8)), dtype)
  grads = _gradients(p0.shape, steps, dtype)
  inner = lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)  # noqa: E731
  kwargs = dict(initial_scale=2.0**10, **FACADE[config])
  opt = ols.porting.LossScaleOptimizer(
    ols.master_weights(inner(), store=store), **kwargs
  )
  params, state = _facade_run(opt, {"w": p0}, grads)
  ref_opt = ols.porting.LossScaleOptimizer(inner(), **kwargs)
  ref, ref_state = _facade_run(ref_opt, {"w": p0.astype(F32)}, grads.astype(F32))
  master = np.asarray(ols.get_master_weights(state, params)["w"])
  np.testing.assert_array_equal(
    master.view(np.uint32), np.asarray(ref["w"]).view(np.uint32)
  )
  # The parameters are the masters rounded (the remainder's ties at 0x8000
  # away from zero).
  diff = np.asarray(params["w"]).view(np.uint16) != master.astype(dtype).view(np.uint16)
  assert not diff.any() or (master.view(np.uint32)[diff] & 0xFFFF == 0x8000).all()
  if FACADE[config].get("use_ema"):
    np.testing.assert_array_equal(
      np.asarray(ols.get_ema_params(state)["w"]),
      np.asarray(ols.get_ema_params(ref_state)["w"]),
    )
  assert opt.inner_optimizer.store == store
  rebuilt = ols.porting.LossScaleOptimizer.from_config(opt.get_config())
  again, _ = _facade_run(rebuilt, {"w": p0}, grads[:3])
  first, _ = _facade_run(opt, {"w": p0}, grads[:3])
  np.testing.assert_array_equal(np.asarray(again["w"]), np.asarray(first["w"]))


def test_the_decay_with_master_weights_is_the_keras_rule():
  # The case that went wrong with the decay after the rounding: 100 steps
  # of SGD on a zero gradient, decay 0.1 at learning rate 0.01 in bfloat16.
  # The Keras rule, p -= p * wd * lr, from 1.0: 0.999**100 = 0.9048.
  params = {"w": jnp.ones(4, BF16)}
  sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.01)
  zero = jnp.zeros((100, 4), BF16)
  opt = ols.porting.LossScaleOptimizer(ols.master_weights(sgd), weight_decay=0.1)
  params, state = _facade_run(opt, params, zero)
  master = ols.get_master_weights(state, params)["w"]
  np.testing.assert_allclose(master, 0.999**100, rtol=1e-5)
  np.testing.assert_array_equal(params["w"], jnp.asarray(master).astype(BF16))
  # The control: on bfloat16 parameters without master weights, every
  # decay step (1e-3 of a weight near 1) is below half a unit: nothing moves.
  plain, _ = _facade_run(
    ols.porting.LossScaleOptimizer(
      optax.inject_hyperparams(optax.sgd)(learning_rate=0.01), weight_decay=0.1
    ),
    {"w": jnp.ones(4, BF16)},
    zero,
  )
  np.testing.assert_array_equal(plain["w"], 1.0)


# --------------------------------------------------------------------------
# A rounding in the user's chain: what comes after it is refused.
# --------------------------------------------------------------------------

ROUNDINGS = {
  "stochastic_rounding": lambda: ols.stochastic_rounding(0),
  "kahan_summation": ols.kahan_summation,
}


@pytest.mark.parametrize("after", [dict(weight_decay=0.1), dict(use_ema=True)], ids=str)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_decay_or_ema_after_a_rounding_is_refused_saying_how_to_compose(
  rounding, after
):
  sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.01)
  opt = ols.porting.LossScaleOptimizer(optax.chain(sgd, ROUNDINGS[rounding]()), **after)
  with pytest.raises(ValueError) as e:
    opt.init({"w": jnp.ones(4, BF16)})
  message = str(e.value)
  assert rounding.replace("_", "").lower() in message.replace("_", "").lower()
  assert "master_weights(" in message and "before the rounding" in message
  assert list(after)[0] in message


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_clipping_and_accumulation_come_before_a_rounding(rounding):
  # Clipping and accumulation act on the gradients, before the inner
  # optimizer: accepted, and the rounding's result lands exactly. (A float32
  # learning rate: optax before 0.2.6 infers bfloat16 from the parameters.)
  inject = optax.inject_hyperparams(optax.sgd, hyperparam_dtype=jnp.float32)
  sgd = inject(learning_rate=0.01)
  opt = ols.porting.LossScaleOptimizer(
    optax.chain(sgd, ROUNDINGS[rounding]()),
    initial_scale=1.0,
    clipvalue=0.5,
    gradient_accumulation_steps=2,
  )
  params = {"w": jnp.ones(4, BF16)}
  state = opt.init(params)
  for _ in range(2):
    updates, state = opt.update({"w": jnp.full(4, 3.0, BF16)}, state, params)
  params = optax.apply_updates(params, updates)
  # The mean of two gradients of 3, clipped to 0.5: w = 1 - 0.005, rounded
  # to a neighbour of bfloat16 (1 - 2**-7 or 1 - 2**-8).
  assert set(np.asarray(params["w"], F32).tolist()) <= {1.0 - 2.0**-7, 1.0 - 2.0**-8}
