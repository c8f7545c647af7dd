"""TensorFlow's and Keras' own loss-scale unit tests, rewritten onto the package.

Their inputs and expected values, from TensorFlow 2.x
``tensorflow/python/training/experimental/loss_scale_test.py`` (the v1
``LossScale`` objects), tf_keras 2.x
``tf_keras/mixed_precision/loss_scale_optimizer_test.py`` and Keras 3
``keras/src/optimizers/loss_scale_optimizer_test.py``. They need no
TensorFlow. The cases that cannot apply, and why:

* TensorFlow's graph mode, ``tf.function`` and distribution strategies
  (every case is run eagerly here, under ``jax.jit``); a NaN on one replica
  only is run with ``jax.vmap`` and an ``axis_name`` instead.
* ``IndexedSlices`` gradients (``testGetUnscaledSparseGradients``): JAX has
  no sparse gradient type.
* The Keras object model: ``weights``/``set_weights``, setting
  hyper-parameters or ``iterations`` as attributes, ``dir()``, wrapped
  ``OptimizerV2`` delegation, custom gradient aggregators and
  ``apply_gradients`` receiving unwrapped tensors (testWeightMethods,
  testHyperParametersExposed, testArbitraryAttributesNotExposed, testDir,
  testIterations, testCustomAggregater,
  testApplyGradientsGetsUnwrappedTensors): an optax transformation keeps its
  state outside; the learning rate is replaced with ``set_learning_rate``.
* Keras 3's ``overwrite_with_gradient`` variables
  (``test_finite_step_with_overwrite``): Flax's float8 overwrite leaves are
  their counterpart, with an optax inner optimizer (``tests/test_flax_fp8.py``).
* Keras 3 refuses ``dynamic=False`` and the base arguments on the
  ``LossScaleOptimizer`` itself (``test_init_dynamic_arg``,
  ``test_init_base_optimizer_unsupported_args``); TensorFlow's document
  accepts them there, and so does this package: tested as giving the same
  numbers as on the inner optimizer.
* ``keep_increasing_until_capped`` grows the scale from float32's largest
  over 4 to float32's largest; here growth stops at ``2**126`` (above it
  the reciprocal the gradients are multiplied by is subnormal, flushed to
  zero on a CPU): the case runs with that ceiling.
* ``loss_scale_module.get('dynamic')``: the porting package has no ``get``;
  ``ExperimentalLossScaleOptimizer(opt, 'dynamic')`` is its counterpart
  (``tests/test_keras_facade.py``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

# --------------------------------------------------------------------------
# TensorFlow: the v1 LossScale objects.
# --------------------------------------------------------------------------


def test_fixed_basic():
  ls = ols.porting.StaticLossScale.from_config({"loss_scale_value": 1000})
  for grad in (0.0, float("nan")):
    ls, should_apply = ls.update([jnp.float32(grad)])
    assert bool(should_apply)
    assert float(ls()) == 1000


def test_fixed_serialization_and_call_type():
  ls = ols.porting.StaticLossScale.from_config({"loss_scale_value": 123})
  ls = ols.porting.StaticLossScale.from_config(ls.get_config())
  assert float(ls()) == 123.0
  assert isinstance(ls(), jax.Array)


# (inputs: finite or not, expected scales, initial, increment_period, multiplier)
DYNAMIC_CASES = {
  "increase": ([True] * 6, [1, 2, 2, 4, 4, 8], 1, 2, 2),
  # TensorFlow's from float32's largest / 4 up to float32's largest; here
  # growth stops at 2**126.
  "keep_increasing_until_capped": (
    [True] * 6,
    [2.0**124, 2.0**125, 2.0**125, 2.0**126, 2.0**126, 2.0**126],
    2.0**124,
    2,
    2,
  ),
  "decrease_every_step": ([False] * 6, [512, 256, 128, 64, 32, 16], 1024, 2, 2),
  "keep_decreasing_until_one": ([False] * 6, [8, 4, 2, 1, 1, 1], 16, 2, 2),
  "nan_clear_good_step": ([True, True, True, False, True], [1, 2, 2, 1, 1], 1, 2, 2),
  "trigger_loss_scale_update_each_step": (
    [True] * 3 + [False, True, True],
    [2, 4, 8, 4, 8, 16],
    1,
    1,
    2,
  ),
  "alternating_trigger_each_step": (
    [True, False] * 4 + [True],
    [2, 1, 2, 1, 2, 1, 2, 1, 2],
    1,
    1,
    2,
  ),
  "alternating_trigger_every_other_step": (
    [True, False] * 3 + [True],
    [32, 16, 16, 8, 8, 4, 4],
    32,
    2,
    2,
  ),
  "nondefault_multiplier": (
    [True, True, False, True, True],
    [4, 12, 4, 4, 12],
    4,
    2,
    3,
  ),
  "random_mix_good_and_bad_gradients": (
    [False, True, True, True, False, True, False, True, True, True, False],
    [2, 2, 4, 4, 2, 2, 1, 1, 2, 2, 1],
    4,
    2,
    2,
  ),
}


@pytest.mark.parametrize("case", sorted(DYNAMIC_CASES))
@pytest.mark.parametrize("replicas", [1, 2], ids=["base", "distribute"])
def test_dynamic(case, replicas):
  inputs, expected, initial, period, multiplier = DYNAMIC_CASES[case]
  ls = ols.porting.DynamicLossScale(
    initial_loss_scale=initial, increment_period=period, multiplier=multiplier
  )

  def update(ls, grad):  # per replica; the NaN is on replica 0 only
    return ls.update([grad], axis_name="replica" if replicas > 1 else None)

  step = jax.jit(
    update if replicas == 1 else jax.vmap(update, (None, 0), axis_name="replica")
  )
  actual = []
  for finite in inputs:
    grad = jnp.float32(1.0 if finite else np.nan)
    if replicas > 1:
      grad = jnp.stack([grad, jnp.float32(1.0)])
    ls, should_apply = step(ls, grad)
    if replicas > 1:  # every replica decided the same
      ls = jax.tree.map(lambda x: x[0], ls)
      assert bool(jnp.all(should_apply == finite))
    else:
      assert bool(should_apply) == finite
    actual.append(float(ls()))
  assert actual == [float(np.float32(e)) for e in expected]


def test_dynamic_single_tensor_gradient_none_gradients_and_call_type():
  ls = ols.porting.DynamicLossScale()
  _, should_apply = ls.update(jnp.float32(4.0))
  assert bool(should_apply)
  ls.update([None])
  assert isinstance(ls(), jax.Array)


def test_dynamic_serialization():
  ls = ols.porting.DynamicLossScale(
    initial_loss_scale=1, increment_period=2, multiplier=3
  )
  ls = ols.porting.DynamicLossScale.from_config(ls.get_config())
  assert float(ls()) == 1
  assert ls.increment_period == 2
  assert ls.multiplier == 3


# --------------------------------------------------------------------------
# tf_keras: LossScaleOptimizer (its V3, around the new optimizers).
# --------------------------------------------------------------------------


def _minimize(opt, state, var, loss):
  """tf_keras' ``opt.minimize(loss, [var])``: TensorFlow's idiom."""
  scaled = opt.get_scaled_loss(lambda v: jnp.sum(loss(v)), state)
  grads = opt.get_unscaled_gradients(jax.grad(scaled)(var), state)
  return opt.apply_gradients(grads, state, var)


def _sgd(lr, **kwargs):
  return {"class_name": "SGD", "config": {"learning_rate": lr, **kwargs}}


@pytest.mark.parametrize("legacy", [False, True])
def test_fixed_loss_scale_applied_to_loss_with_minimize(legacy):
  opt = ols.porting.LossScaleOptimizer(
    _sgd(2.0), dynamic=False, initial_scale=10.0, legacy_keras=legacy
  )
  var = jnp.array([5.0])
  state = opt.init(var)
  assert float(opt.loss_scale(state)) == 10.0
  # The gradient of the scaled loss is the scale.
  scaled = jax.grad(lambda v: opt.get_scaled_loss(jnp.sum(v), state))(var)
  assert float(scaled[0]) == 10.0
  var, state = _minimize(opt, state, var, lambda v: v)
  np.testing.assert_allclose(var, [3.0])


def test_dynamic_attrs_with_fixed_loss_scale():
  opt = ols.porting.LossScaleOptimizer(_sgd(0.01), dynamic=False, initial_scale=2.0)
  assert opt.dynamic is False
  assert opt.dynamic_counter(opt.init(jnp.zeros(1))) is None
  assert opt.dynamic_growth_steps is None


def test_get_scaled_loss_and_unscaled_gradients():
  opt = ols.porting.LossScaleOptimizer(_sgd(0.01), dynamic=False, initial_scale=2.0)
  state = opt.init(jnp.zeros(1))
  for dtype in (jnp.float32, jnp.float16):
    loss = jnp.asarray(5.0, dtype)
    assert float(opt.get_scaled_loss(loss, state)) == 10.0
    assert float(opt.get_scaled_loss(lambda x=loss: x, state)()) == 10.0
  scaled = [jnp.float32(3.0), None, jnp.float16(-4.0)]
  grads = opt.get_unscaled_gradients(scaled, state)
  assert [None if g is None else float(g) for g in grads] == [1.5, None, -2.0]


@pytest.mark.parametrize("legacy", [False, True])
def test_dynamic_loss_scale(legacy):
  opt = ols.porting.LossScaleOptimizer(
    _sgd(2.0), initial_scale=2, dynamic_growth_steps=1, legacy_keras=legacy
  )
  assert opt.initial_scale == 2.0 and isinstance(opt.initial_scale, float)
  assert opt.dynamic_growth_steps == 1
  var = jnp.array([5.0])
  state = opt.init(var)
  var, state = _minimize(opt, state, var, lambda v: v)
  np.testing.assert_allclose(var, [3.0])
  assert float(opt.loss_scale(state)) == 4.0  # the next gradient is doubled
  var, state = _minimize(opt, state, var, lambda v: v)
  np.testing.assert_allclose(var, [1.0])


def test_dynamic_loss_scale_default_values():
  opt = ols.porting.LossScaleOptimizer(_sgd(0.01))
  assert opt.initial_scale == 2**15
  assert opt.dynamic_growth_steps == 2000
  assert float(opt.loss_scale(opt.init(jnp.zeros(1)))) == 2**15


@pytest.mark.parametrize("clip_type", ["clipnorm", "global_clipnorm", "clipvalue"])
@pytest.mark.parametrize("legacy", [False, True])
def test_clipping(clip_type, legacy):
  opt = ols.porting.LossScaleOptimizer(
    _sgd(2.0, **{clip_type: 2.0}),
    initial_scale=2,
    dynamic_growth_steps=1,
    legacy_keras=legacy,
  )
  var = jnp.array([5.0])
  state = opt.init(var)
  var, state = _minimize(opt, state, var, lambda v: v * 4)
  np.testing.assert_allclose(var, [1.0])  # the gradient 4 is clipped to 2
  assert float(opt.loss_scale(state)) == 4
  var, state = _minimize(opt, state, var, lambda v: v * np.inf)
  np.testing.assert_allclose(var, [1.0])  # skipped, not clipped
  assert float(opt.loss_scale(state)) == 2


@pytest.mark.parametrize("legacy", [False, True])
def test_dynamic_update(legacy):
  opt = ols.porting.LossScaleOptimizer(
    _sgd(1.0), initial_scale=2, dynamic_growth_steps=1, legacy_keras=legacy
  )
  var = jnp.array([1.0, 2.0])
  state = opt.init(var)
  var, state = _minimize(opt, state, var, lambda v: v * 2.0)
  np.testing.assert_allclose(var, [-1.0, 0.0])
  assert float(opt.loss_scale(state)) == 4.0
  var, state = _minimize(opt, state, var, lambda v: v * np.nan)
  np.testing.assert_allclose(var, [-1.0, 0.0])
  assert float(opt.loss_scale(state)) == 2.0


def test_dynamic_loss_scale_with_float16_loss():
  opt = ols.porting.LossScaleOptimizer(
    _sgd(2.0), initial_scale=2, dynamic_growth_steps=1
  )
  var = jnp.array([5.0])
  state = opt.init(var)
  var, state = _minimize(opt, state, var, lambda v: v.astype(jnp.float16))
  np.testing.assert_allclose(var, [3.0])


def test_nan_on_one_replica_only():
  opt = ols.porting.LossScaleOptimizer(
    _sgd(1.0), initial_scale=2, dynamic_growth_steps=2, axis_name="replica"
  )
  var = jnp.array([1.0, 2.0])
  state = opt.init(var)
  grads = jnp.stack([var * 0 + 2.0, jnp.array([1.0, np.nan])])  # replica 1: NaN
  step = jax.vmap(opt.apply_gradients, (0, None, None), axis_name="replica")
  new_var, new_state = step(ols.porting.UnscaledGradients(grads), state, var)
  np.testing.assert_allclose(new_var, [[1.0, 2.0]] * 2)
  assert float(opt.loss_scale(jax.tree.map(lambda x: x[0], new_state))) == 1.0


@pytest.mark.parametrize("legacy", [False, True])
def test_dynamic_loss_scale_with_slots(legacy):
  opt = ols.porting.LossScaleOptimizer(
    _sgd(1.0, momentum=1.0), initial_scale=2.0, dynamic_growth_steps=1,
    legacy_keras=legacy,
  )  # fmt: skip
  var = jnp.array([1.0, 2.0])
  state = opt.init(var)
  var, state = _minimize(opt, state, var, lambda v: v)
  np.testing.assert_allclose(var, [0.0, 1.0])
  assert float(opt.loss_scale(state)) == 4.0
  var, state = _minimize(opt, state, var, lambda v: v)
  np.testing.assert_allclose(var, [-2.0, -1.0])
  assert float(opt.loss_scale(state)) == 8.0
  assert sorted(state.inner_state.slots) == ["momentum"]


@pytest.mark.parametrize("legacy, after_nan", [(True, 2), (False, 1)])
def test_iterations_incremented(legacy, after_nan):
  """tf_keras counts a skipped step in ``iterations``; Keras 3 does not."""
  opt = ols.porting.LossScaleOptimizer(_sgd(1.0), legacy_keras=legacy)
  var = jnp.array([5.0])
  state = opt.init(var)
  var, state = _minimize(opt, state, var, lambda v: v * 2.0)
  assert float(var[0]) == 3.0 and int(opt.iterations(state)) == 1
  var, state = _minimize(opt, state, var, lambda v: v * np.nan)
  assert float(var[0]) == 3.0 and int(opt.iterations(state)) == after_nan


def test_hyper_parameters_exposed():
  opt = ols.porting.LossScaleOptimizer(
    {"class_name": "Adam", "config": {"learning_rate": 1.0, "beta_1": 0.5}},
    use_ema=True,
    ema_momentum=0.88,
  )
  state = opt.set_learning_rate(opt.init(jnp.zeros(2)), 0.005)
  np.testing.assert_allclose(opt.learning_rate(state), 0.005)
  assert opt.use_ema is True and opt.ema_momentum == 0.88


# --------------------------------------------------------------------------
# Keras 3: LossScaleOptimizer.
# --------------------------------------------------------------------------

KERAS_GRADS = np.array([1.0, 6.0, 7.0, 2.0], np.float32)
KERAS_VARS = np.array([1.0, 2.0, 3.0, 4.0], np.float32)


def _keras_apply(opt, grads, steps=1):
  """Keras 3's ``optimizer.apply(grads, vars)``: scaled gradients in."""
  var = jnp.asarray(KERAS_VARS)
  state = opt.init(var)
  for _ in range(steps):
    updates, state = opt.update(jnp.asarray(grads), state, var)
    var = optax.apply_updates(var, updates)
  return var, state


def test_keras_config():
  inner = _sgd(0.5, momentum=0.06, nesterov=True, weight_decay=0.004)
  opt = ols.porting.LossScaleOptimizer(inner)
  again = ols.porting.LossScaleOptimizer.from_config(opt.get_config())
  assert again.get_config() == opt.get_config()


@pytest.mark.parametrize("inner_factor", [None, 100])
def test_keras_finite_step(inner_factor):
  """Also with a loss_scale_factor on the inner optimizer, which Keras ignores."""
  config = {} if inner_factor is None else {"loss_scale_factor": inner_factor}
  opt = ols.porting.LossScaleOptimizer(_sgd(0.5, **config))
  var, _ = _keras_apply(opt, KERAS_GRADS * opt.initial_scale)
  np.testing.assert_allclose(var, [0.5, -1.0, -0.5, 3.0], rtol=1e-4, atol=1e-4)


def test_keras_infinite_step():
  opt = ols.porting.LossScaleOptimizer(_sgd(0.5))
  var, _ = _keras_apply(opt, np.full(4, np.inf, np.float32))
  np.testing.assert_allclose(var, KERAS_VARS)


def test_keras_downscaling_and_upscaling():
  opt = ols.porting.LossScaleOptimizer(_sgd(0.5), initial_scale=400.0)
  _, state = _keras_apply(opt, np.full(4, np.inf, np.float32), steps=4)
  np.testing.assert_allclose(opt.scale_loss(1.0, state), 25.0)
  opt = ols.porting.LossScaleOptimizer(
    _sgd(0.5), initial_scale=2.0, dynamic_growth_steps=2
  )
  _, state = _keras_apply(opt, KERAS_GRADS, steps=8)
  np.testing.assert_allclose(opt.scale_loss(1.0, state), 32.0)


def test_keras_iterations_update():
  opt = ols.porting.LossScaleOptimizer(_sgd(0.5))
  var = jnp.asarray(KERAS_VARS)
  state = opt.init(var)
  assert int(opt.iterations(state)) == 0
  for i in range(3):
    updates, state = opt.update(jnp.asarray(KERAS_GRADS), state, var)
    var = optax.apply_updates(var, updates)
    assert int(opt.iterations(state)) == i + 1


def test_keras_serialization_and_backwards_compatibility():
  config = {
    "name": "test_opt",
    "inner_optimizer": {
      "module": "keras.optimizers",
      "class_name": "SGD",
      "config": {"name": "SGD", "learning_rate": 0.5},
      "registered_name": None,
    },
    "initial_scale": 3.0,
    "dynamic_growth_steps": 2,
  }
  opt = ols.porting.LossScaleOptimizer.from_config(config)
  assert (opt.initial_scale, opt.dynamic_growth_steps) == (3.0, 2)
  # The form that still carries every base argument at its default.
  base = dict.fromkeys(
    ["weight_decay", "clipnorm", "global_clipnorm", "clipvalue"], None
  ) | {"use_ema": False, "ema_momentum": 0.99, "ema_overwrite_frequency": None}
  base |= {"loss_scale_factor": None, "gradient_accumulation_steps": None}
  old = {**config, **base, "initial_scale": 2.0}
  old["inner_optimizer"] = {
    **config["inner_optimizer"],
    "config": {"name": "SGD", "learning_rate": 0.5, "momentum": 0.0, **base},
  }
  assert ols.porting.LossScaleOptimizer.from_config(old).initial_scale == 2.0


def test_keras_unsupported_and_dynamic_args():
  with pytest.raises(ValueError, match="foo=True, bar=3"):
    ols.porting.LossScaleOptimizer(_sgd(0.5), foo=True, bar=3)
  ols.porting.LossScaleOptimizer(_sgd(0.5), dynamic=True)
  with pytest.raises(ValueError, match="initial_scale"):
    ols.porting.LossScaleOptimizer(_sgd(0.5), dynamic=False)


@pytest.mark.parametrize(
  "name, value",
  [
    ("weight_decay", 0.5),
    ("clipnorm", 0.5),
    ("global_clipnorm", 0.5),
    ("clipvalue", 0.5),
    ("use_ema", True),
    ("gradient_accumulation_steps", 2),
  ],
)
def test_base_arguments_on_either_optimizer_give_the_same_numbers(name, value):
  outer = ols.porting.LossScaleOptimizer(_sgd(0.5), initial_scale=4.0, **{name: value})
  inner = ols.porting.LossScaleOptimizer(_sgd(0.5, **{name: value}), initial_scale=4.0)
  assert outer.get_config() == inner.get_config()
  a, _ = _keras_apply(outer, KERAS_GRADS * 4, steps=2)
  b, _ = _keras_apply(inner, KERAS_GRADS * 4, steps=2)
  np.testing.assert_array_equal(a, b)
