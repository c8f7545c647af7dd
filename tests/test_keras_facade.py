"""The Keras-style facade: TensorFlow's LossScaleOptimizer surface, Keras' optimizer
keyword arguments, EMA."""

import json
import os
import types

os.environ.setdefault("KERAS_BACKEND", "jax")

import chex  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import optax_lossscale as ols  # noqa: E402

# optax's inject_hyperparams and schedules do `float ** int32`.
pytestmark = pytest.mark.standard_promotion


def _params():
  return {
    "w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) / 10 - 0.2,
    "b": jnp.ones((3,), jnp.float32),
  }


# --------------------------------------------------------------------------
# TensorFlow's experimental constructor and its three get_config equalities.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("inner", ["names", "shared object"])
def test_experimental_get_config_equalities(inner):
  if inner == "names":
    sgd = lambda: "SGD"  # a fresh optimizer per call, as in TensorFlow
  else:
    shared = optax.sgd(0.01)
    sgd = lambda: shared
  E, L = ols.porting.ExperimentalLossScaleOptimizer, ols.porting.LossScaleOptimizer

  opt1 = E(sgd(), loss_scale="dynamic")
  opt2 = L(sgd())
  assert opt1.get_config() == opt2.get_config()

  opt1 = E(sgd(), loss_scale=123)
  opt2 = L(sgd(), dynamic=False, initial_scale=123)
  assert opt1.get_config() == opt2.get_config()

  loss_scale = ols.porting.DynamicLossScale(
    initial_loss_scale=2048, increment_period=500
  )
  opt1 = E(sgd(), loss_scale=loss_scale)
  opt2 = L(sgd(), initial_scale=2048, dynamic_growth_steps=500)
  assert opt1.get_config() == opt2.get_config()

  # ... and they are not all equal to each other (the equality can fail).
  assert L(sgd()).get_config() != L(sgd(), initial_scale=2048).get_config()


def test_experimental_subclassing_and_attributes():
  opt1 = ols.porting.ExperimentalLossScaleOptimizer("sgd", loss_scale="dynamic")
  opt2 = ols.porting.LossScaleOptimizer("sgd")
  assert isinstance(opt1, ols.porting.LossScaleOptimizer)
  assert not isinstance(opt2, ols.porting.ExperimentalLossScaleOptimizer)
  for opt in (opt1, opt2):
    assert isinstance(opt, optax.GradientTransformationExtraArgs)
    assert opt.dynamic is True
    assert opt.initial_scale == 2.0**15
    assert opt.dynamic_growth_steps == 2000
    assert opt.inner_optimizer.name == "sgd"  # Keras' formula, by name
  fixed = ols.porting.ExperimentalLossScaleOptimizer("sgd", loss_scale=123)
  assert fixed.dynamic is False
  assert fixed.initial_scale == 123.0
  assert fixed.dynamic_growth_steps is None  # as TF: None when not dynamic
  state = fixed.init(_params())
  assert fixed.dynamic_counter(state) is None
  assert float(fixed.loss_scale(state)) == 123.0


def test_config_is_json_and_round_trips():
  opt = ols.porting.LossScaleOptimizer(
    {"class_name": "adam", "config": {"learning_rate": 0.003, "beta_1": 0.8}},
    initial_scale=256,
    dynamic_growth_steps=7,
    clipvalue=0.5,
    weight_decay=0.01,
    use_ema=True,
    ema_overwrite_frequency=3,
    gradient_accumulation_steps=2,
    loss_scale_factor=4.0,
  )
  config = json.loads(json.dumps(opt.get_config()))
  again = ols.porting.LossScaleOptimizer.from_config(config)
  assert again.get_config() == opt.get_config()
  assert again.clipvalue == 0.5 and again.gradient_accumulation_steps == 2

  # The rebuilt optimizer computes the same thing.
  params = _params()
  grads = jax.tree.map(lambda p: jnp.full_like(p, 256.0 * 4.0 * 0.3), params)
  s1, s2 = opt.init(params), again.init(params)
  for _ in range(4):
    u1, s1 = opt.update(grads, s1, params)
    u2, s2 = again.update(grads, s2, params)
    chex.assert_trees_all_equal(u1, u2)
  chex.assert_trees_all_equal(s1, s2)


def test_experimental_from_config_keeps_class():
  opt = ols.porting.ExperimentalLossScaleOptimizer("sgd", loss_scale=64)
  again = type(opt).from_config(opt.get_config())
  assert type(again) is ols.porting.ExperimentalLossScaleOptimizer
  assert again.get_config() == opt.get_config()


@pytest.mark.parametrize(
  "loss_scale, match",
  [
    ("dynamc", "loss_scale"),
    ("", "loss_scale"),
    (-1.0, "loss_scale"),
    (0, "loss_scale"),
    (float("inf"), "loss_scale"),
    (None, "loss_scale"),
    ([2.0], "loss_scale"),
    (ols.porting.DynamicLossScale(multiplier=4.0), "multiplier"),
    (
      ols.porting.DynamicLossScale(growth_factor=2.0, backoff_factor=0.25),
      "multiplier",
    ),
    (ols.porting.NoOpLossScale(), "loss_scale"),
    (ols.porting.StaticLossScale(8.0), "skip_nonfinite=False"),
  ],
)
def test_experimental_bad_loss_scale(loss_scale, match):
  with pytest.raises(ValueError, match=match):
    ols.porting.ExperimentalLossScaleOptimizer("sgd", loss_scale=loss_scale)


def test_experimental_accepts_tf_fixed_and_dynamic_objects():
  opt = ols.porting.ExperimentalLossScaleOptimizer(
    "sgd", loss_scale=ols.porting.StaticLossScale(32.0, skip_nonfinite=False)
  )
  assert (
    opt.get_config()
    == ols.porting.LossScaleOptimizer(
      "sgd", dynamic=False, initial_scale=32
    ).get_config()
  )
  # The core's hysteresis goes with an optax transformation only.
  opt = ols.porting.ExperimentalLossScaleOptimizer(
    optax.sgd(0.1),
    loss_scale=ols.porting.DynamicLossScale(multiplier=2.0, hysteresis=2),
  )
  assert opt.get_config()["hysteresis"] == 2
  # With a Keras name, the core's arguments build optax's optimizer.
  opt = ols.porting.ExperimentalLossScaleOptimizer(
    "sgd", loss_scale=ols.porting.DynamicLossScale(multiplier=2.0, hysteresis=2)
  )
  assert opt.get_config()["hysteresis"] == 2
  assert isinstance(opt.inner_optimizer, optax.GradientTransformation)
  # TensorFlow's names alone: TensorFlow's rule, Keras' formula.
  opt = ols.porting.ExperimentalLossScaleOptimizer(
    "sgd", loss_scale=ols.porting.DynamicLossScale(initial_loss_scale=4.0)
  )
  assert opt.get_config() == ols.porting.LossScaleOptimizer("sgd", 4.0).get_config()
  assert opt.inner_optimizer.name == "sgd"


def test_tf_names_on_dynamic_loss_scale():
  ls = ols.porting.DynamicLossScale(
    initial_loss_scale=64, increment_period=10, multiplier=4
  )
  assert (ls.initial_loss_scale, ls.increment_period, ls.multiplier) == (64.0, 10, 4.0)
  assert ls.config.backoff_factor == 0.25  # TF: backoff is 1 / multiplier
  assert ols.porting.DynamicLossScale.from_config(ls.get_config()).config == ls.config
  with pytest.raises(ValueError, match="initial_loss_scale"):
    ols.porting.DynamicLossScale(4.0, initial_loss_scale=8.0)
  with pytest.raises(ValueError, match="increment_period"):
    ols.porting.DynamicLossScale(growth_interval=3, increment_period=4)
  with pytest.raises(ValueError, match="multiplier"):
    ols.porting.DynamicLossScale(growth_factor=3.0, multiplier=2.0)
  with pytest.raises(ValueError, match="multiplier"):
    ols.porting.DynamicLossScale(multiplier=1.0)


@pytest.mark.parametrize(
  "kwargs",
  [
    # Our name given with its default value, TensorFlow's with another.
    {"initial_scale": 2.0**15, "initial_loss_scale": 1024},
    {"initial_scale": 1024, "initial_loss_scale": 1024},
    {"growth_interval": 2000, "increment_period": 5},
    {"growth_factor": 2.0, "multiplier": 2.0},
    {"backoff_factor": 0.5, "multiplier": 4.0},
  ],
)
def test_both_names_of_one_argument_is_an_error_whatever_the_values(kwargs):
  tf_name = next(
    k for k in kwargs if k in ("initial_loss_scale", "increment_period", "multiplier")
  )
  (ours,) = set(kwargs) - {tf_name}
  with pytest.raises(ValueError, match=f"not both.*{tf_name}") as e:
    ols.porting.DynamicLossScale(**kwargs)
  assert f"`{ours}`" in str(e.value)  # both spellings named, each once


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"clipnorm": 1.0, "clipvalue": 1.0}, "Only one of"),
    ({"clipnorm": 1.0, "global_clipnorm": 1.0}, "Only one of"),
    ({"clipnorm": -1.0}, "clipnorm"),
    ({"clipvalue": 0.0}, "clipvalue"),
    ({"global_clipnorm": float("nan")}, "global_clipnorm"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"weight_decay": "0.1"}, "weight_decay"),
    ({"use_ema": 1}, "use_ema"),
    ({"ema_momentum": 1.5}, "ema_momentum"),
    ({"ema_overwrite_frequency": 0}, "ema_overwrite_frequency"),
    ({"ema_overwrite_frequency": 2.5}, "ema_overwrite_frequency"),
    ({"loss_scale_factor": 0.0}, "loss_scale_factor"),
    ({"gradient_accumulation_steps": 1}, "gradient_accumulation_steps"),
    ({"initial_scale": -2.0}, "initial_scale"),
    ({"dynamic_growth_steps": 0}, "dynamic_growth_steps"),  # its own name
    ({"dynamic": False, "initial_scale": 2.0, "dynamic_growth_steps": 3}, "None"),
    ({"dynamic": False}, "initial_scale"),  # TensorFlow requires it
    ({"dynamic": "yes"}, "dynamic"),
    ({"min_scale": 4.0, "initial_scale": 2.0}, "initial_scale"),
    ({"hysteresis": 2, "legacy_keras": True}, "hysteresis=2 with legacy_keras"),
    ({"legacy_keras": 1}, "legacy_keras"),
  ],
)
def test_bad_keyword_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ols.porting.LossScaleOptimizer("sgd", **kwargs)


@pytest.mark.parametrize(
  "inner, match",
  [
    ("adamm", "no Keras formula"),
    ("lion", "no Keras formula"),
    ({"class_name": "rmsprop", "config": {"momentum": 0.5}}, None),  # known
    (optax.sgd(0.1), None),
    ({"class_name": "sgd", "config": {"learning_rat": 0.1}}, "learning_rat"),
    ({"name": "sgd"}, "inner_optimizer"),
    (3, "inner_optimizer"),
  ],
)
def test_bad_inner_optimizer(inner, match):
  if match is None:
    ols.porting.LossScaleOptimizer(inner)
    ols.porting.LossScaleOptimizer(optax.sgd(0.1), legacy_keras=False)
    with pytest.raises(ValueError, match="legacy_keras.*Keras name"):
      ols.porting.LossScaleOptimizer(optax.sgd(0.1), legacy_keras=True)
    return
  with pytest.raises(ValueError, match=match):
    ols.porting.LossScaleOptimizer(inner)


def test_weight_decay_needs_a_learning_rate():
  opt = ols.porting.LossScaleOptimizer(optax.sgd(0.1), weight_decay=0.01)
  with pytest.raises(ValueError, match="inject_hyperparams"):
    opt.init(_params())
  # With an injected learning rate it works.
  opt = ols.porting.LossScaleOptimizer(
    optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), weight_decay=0.01
  )
  opt.init(_params())


# --------------------------------------------------------------------------
# The methods that read the state.
# --------------------------------------------------------------------------


def test_state_methods():
  opt = ols.porting.LossScaleOptimizer(
    "sgd", initial_scale=8.0, dynamic_growth_steps=2, loss_scale_factor=4.0
  )
  params = _params()
  state = opt.init(params)
  assert float(opt.loss_scale(state)) == 8.0
  assert int(opt.dynamic_counter(state)) == 0
  loss = jnp.asarray(1.5, jnp.float16)
  scaled = opt.scale_loss(loss, state)
  assert scaled.dtype == jnp.float32 and float(scaled) == 1.5 * 8.0 * 4.0

  # The gradients of scale_loss's loss, unscaled, are the plain gradients,
  # and they are exactly what update feeds the inner optimizer (sgd: -lr * g).
  f = lambda p: jnp.sum(p["w"] ** 2) + jnp.sum(p["b"])
  grads = jax.grad(lambda p: opt.scale_loss(f(p), state))(params)
  unscaled = opt.get_unscaled_gradients(grads, state)
  assert isinstance(unscaled, ols.porting.UnscaledGradients)
  chex.assert_trees_all_close(unscaled.tree, jax.grad(f)(params), rtol=1e-6)
  updates, state = jax.jit(opt.update)(grads, state, params)
  # Keras' SGD: p - g * lr, as the new parameters minus the old.
  new = jax.tree.map(lambda p, g: p - g * jnp.float32(0.01), params, unscaled.tree)
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.subtract, new, params))

  assert bool(opt.check_finite(grads))
  assert not bool(opt.check_finite({"a": jnp.array([1.0, jnp.nan])}))
  assert int(opt.dynamic_counter(state)) == 1
  _, state = opt.update(grads, state, params)
  assert int(opt.dynamic_counter(state)) == 0 and float(opt.loss_scale(state)) == 16.0


def test_learning_rate_read_and_changed_under_jit():
  opt = ols.porting.LossScaleOptimizer("sgd", initial_scale=1.0)
  params = _params()
  state = opt.init(params)
  assert float(opt.learning_rate(state)) == pytest.approx(0.01)
  assert opt.lr(state) is opt.learning_rate(state)
  state = jax.jit(opt.set_learning_rate)(state, 0.5)
  assert float(opt.learning_rate(state)) == 0.5
  grads = jax.tree.map(jnp.ones_like, params)
  unscaled = ols.porting.UnscaledGradients(grads)  # scale 1
  new, _ = opt.apply_gradients(unscaled, state, params)
  chex.assert_trees_all_equal(
    new, jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
  )

  plain = ols.porting.LossScaleOptimizer(optax.sgd(0.1))
  with pytest.raises(ValueError, match="inject_hyperparams"):
    plain.learning_rate(plain.init(params))


# --------------------------------------------------------------------------
# Base keyword arguments: the unscaled gradients reach clipping and decay.
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
  "kwargs, clip",
  [
    ({"clipnorm": 1.0}, lambda g: g / jnp.maximum(jnp.linalg.norm(g), 1.0)),
    ({"clipvalue": 0.1}, lambda g: jnp.clip(g, -0.1, 0.1)),
  ],
)
def test_clipping_sees_unscaled_gradients(kwargs, clip):
  scale = 2.0**12
  opt = ols.porting.LossScaleOptimizer(
    {"class_name": "sgd", "config": {"learning_rate": 1.0}},
    initial_scale=scale,
    **kwargs,
  )
  params = _params()
  true_grads = jax.tree.map(lambda p: jnp.full_like(p, 0.7), params)
  scaled = jax.tree.map(lambda g: g * scale, true_grads)
  updates, _ = opt.update(scaled, opt.init(params), params)
  # Unscale first, then clip. Clipping the scaled gradients and unscaling
  # afterwards would give updates `scale` times smaller.
  expected = jax.tree.map(lambda g: -clip(g), true_grads)
  chex.assert_trees_all_close(updates, expected, rtol=1e-6)


def test_global_clipnorm_sees_unscaled_gradients():
  scale = 2.0**12
  opt = ols.porting.LossScaleOptimizer(
    {"class_name": "sgd", "config": {"learning_rate": 1.0}},
    initial_scale=scale,
    global_clipnorm=1.0,
  )
  params = _params()
  true_grads = jax.tree.map(lambda p: jnp.full_like(p, 0.7), params)
  scaled = jax.tree.map(lambda g: g * scale, true_grads)
  updates, _ = opt.update(scaled, opt.init(params), params)
  norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(true_grads)))
  chex.assert_trees_all_close(
    updates, jax.tree.map(lambda g: -g / norm, true_grads), rtol=1e-6
  )


# --------------------------------------------------------------------------
# Differential: every base keyword argument against Keras 3 (JAX backend).
# --------------------------------------------------------------------------

SHAPES = [(3,), (2, 4)]
# A pattern of finite (True) and non-finite (False) steps that makes the scale
# grow, back off, and skip inside accumulation windows and EMA periods.
PATTERN = [True] * 5 + [False] + [True] * 3 + [False, False] + [True] * 9 + [False]


def _grad_sequence(seed):
  rng = np.random.default_rng(seed)
  seq = []
  for i, finite in enumerate(PATTERN):
    g = [rng.normal(size=s).astype(np.float32) * 2.0**9 for s in SHAPES]
    if not finite:
      g[i % len(SHAPES)].flat[0] = [np.inf, np.nan, -np.inf][i % 3]
    seq.append(g)
  return seq


def _keras_trace(keras, kwargs, grads_seq, params0, lr):
  variables = [keras.Variable(np.asarray(p)) for p in params0]
  opt = keras.optimizers.LossScaleOptimizer(
    keras.optimizers.SGD(learning_rate=lr, **kwargs),
    initial_scale=2.0**8,
    dynamic_growth_steps=3,
  )
  opt.build(variables)
  names = [v.path for v in opt.variables]
  opt_vars = [v.value for v in opt.variables]
  train_vars = [v.value for v in variables]
  apply = jax.jit(opt.stateless_apply)
  trace = []
  for grads in grads_seq:
    train_vars, opt_vars = apply(opt_vars, [jnp.asarray(g) for g in grads], train_vars)
    named = dict(zip(names, opt_vars, strict=True))
    averages = [np.asarray(v) for n, v in named.items() if n.endswith("_average")]
    trace.append(
      (
        float(next(v for n, v in named.items() if n.endswith("/dynamic_scale"))),
        [np.asarray(t) for t in train_vars],
        averages,
      )
    )
  return trace


@pytest.mark.parametrize(
  "kwargs",
  [
    {},
    {"clipnorm": 0.5},
    {"clipvalue": 0.3},
    {"global_clipnorm": 0.5},
    {"weight_decay": 0.1},
    {"use_ema": True, "ema_momentum": 0.75},
    {"use_ema": True, "ema_momentum": 0.5, "ema_overwrite_frequency": 4},
    {"gradient_accumulation_steps": 3},
    {"gradient_accumulation_steps": 2, "global_clipnorm": 0.5, "weight_decay": 0.1},
  ],
  ids=lambda k: ",".join(k) or "plain",
)
def test_base_kwargs_match_keras(kwargs):
  keras = pytest.importorskip("keras")
  lr = 0.25
  rng = np.random.default_rng(1)
  params0 = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
  grads_seq = _grad_sequence(7)
  expected = _keras_trace(keras, kwargs, grads_seq, params0, lr)

  opt = ols.porting.LossScaleOptimizer(
    {"class_name": "sgd", "config": {"learning_rate": lr}},
    initial_scale=2.0**8,
    dynamic_growth_steps=3,
    **kwargs,
  )
  params = [jnp.asarray(p) for p in params0]
  state = opt.init(params)

  @jax.jit
  def step(grads, state, params):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def check(ours, theirs, i):
    # Not bit for bit: XLA contracts `a * b + c` into an FMA in one program
    # and not in the other (clipping factors, EMA momenta and averages are not
    # powers of two), and Keras decays the variable and then applies the step
    # (two roundings of the parameter) where an optax update is one addition.
    # Each costs at most an ulp of the parameters per step; a wrong order of
    # operations (clipping scaled gradients, decaying after the step, a late
    # EMA) is off by orders of magnitude more.
    atol = (i + 1) * np.spacing(np.abs(theirs).max())
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=atol, err_msg=f"step {i}")

  for i, (grads, (k_scale, k_params, k_avg)) in enumerate(
    zip(grads_seq, expected, strict=True)
  ):
    params, state = step([jnp.asarray(g) for g in grads], state, params)
    assert float(opt.loss_scale(state)) == k_scale, i
    for ours, theirs in zip(params, k_params, strict=True):
      check(np.asarray(ours), theirs, i)
    if kwargs.get("use_ema"):
      averages = opt.finalize_variable_values(params, state)
      for ours, theirs in zip(averages, k_avg, strict=True):
        check(np.asarray(ours), theirs, i)


def test_copy_and_pickle_rebuild_from_the_config():
  import copy
  import pickle

  opt = ols.porting.ExperimentalLossScaleOptimizer(
    "adam", loss_scale=ols.porting.DynamicLossScale(64.0)
  )
  for again in (copy.copy(opt), copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
    assert type(again) is ols.porting.ExperimentalLossScaleOptimizer
    assert again.get_config() == opt.get_config()
    assert float(again.loss_scale(again.init(_params()))) == 64.0


@pytest.mark.parametrize(
  "factor", [1e-40, 0.0, -1.0, float("inf"), float("nan"), 2.0**127]
)
def test_loss_scale_factor_must_be_a_usable_scale(factor):
  with pytest.raises(ValueError, match="loss_scale_factor"):
    ols.porting.LossScaleOptimizer("sgd", loss_scale_factor=factor)


def test_the_check_sees_the_gradients_divided_by_loss_scale_factor():
  """float16 40000 / 0.5 is inf in float16: skipped, never applied."""
  opt = ols.porting.LossScaleOptimizer("sgd", initial_scale=1.0, loss_scale_factor=0.5)
  params = {"w": jnp.ones(2, jnp.float16)}
  state = opt.init(params)
  grads = {"w": jnp.full(2, 40000.0, jnp.float16)}
  updates, state = jax.jit(opt.update)(grads, state, params)
  chex.assert_trees_all_equal(updates, {"w": jnp.zeros(2, jnp.float16)})
  assert int(state.skipped_steps) == 1
  # Keras 3 halves the scale with no floor at 1 (tf_keras stops at 1).
  assert float(opt.loss_scale(state)) == 0.5
  # And a factor that divides out to finite values is applied exactly:
  # 2 / 0.5 (the scale) / 0.5 (the factor) = 8.
  grads = {"w": jnp.full(2, 2.0, jnp.float16)}
  updates, state = jax.jit(opt.update)(grads, state, params)
  new = optax.apply_updates(params, updates)
  chex.assert_trees_all_equal(new, {"w": jnp.full(2, 1 - 0.08, jnp.float16)})


@pytest.mark.parametrize(
  "kwargs",
  [
    {"hysteresis": 2},
    {"hysteresis": 0},  # invalid, and silently ignored before
    {"min_scale": 2.0},
    {"max_scale": 2.0**20},
  ],
)
def test_dynamic_only_arguments_with_a_fixed_scale_are_refused(kwargs):
  (name,) = kwargs
  with pytest.raises(ValueError, match=f"{name}=.*dynamic=False"):
    ols.porting.LossScaleOptimizer(
      optax.sgd(0.1), dynamic=False, initial_scale=8, **kwargs
    )
  with pytest.raises(ValueError, match="dynamic_growth_steps.*None"):
    ols.porting.LossScaleOptimizer(
      "sgd", dynamic=False, initial_scale=8, dynamic_growth_steps=9
    )


def test_a_fixed_scale_accepts_the_defaults_it_reports():
  opt = ols.porting.LossScaleOptimizer(
    "sgd", dynamic=False, initial_scale=8, dynamic_growth_steps=None
  )
  again = ols.porting.LossScaleOptimizer.from_config(opt.get_config())
  assert again.get_config() == opt.get_config()


@pytest.mark.parametrize("lr", [None, "0.1", -0.1, float("nan"), float("inf")])
def test_a_learning_rate_that_is_not_a_number_is_refused(lr):
  with pytest.raises(ValueError, match="learning_rate"):
    ols.porting.LossScaleOptimizer(
      {"class_name": "sgd", "config": {"learning_rate": lr}}
    )


def test_mixing_the_idioms_never_divides_twice():
  params = {"w": jnp.ones(2)}
  scaled = {"w": jnp.full(2, 8.0 * 3)}
  sgd = {"class_name": "sgd", "config": {"learning_rate": 1.0}}
  named = ols.porting.LossScaleOptimizer(sgd, initial_scale=8.0)
  state = named.init(params)
  unscaled = named.get_unscaled_gradients(scaled, state)
  u1, _ = named.update(unscaled, state, params)  # taken as unscaled
  u2, _ = named.update(scaled, state, params)
  new, _ = named.apply_gradients(unscaled, state, params)
  chex.assert_trees_all_equal(u1, u2, {"w": jnp.full(2, -3.0)})
  chex.assert_trees_all_equal(new, {"w": jnp.full(2, -2.0)})

  # The scaled gradients where unscaled ones belong: applied as given (the
  # step 8 times too large), as tf_keras applies them, with a warning.
  with pytest.warns(UserWarning, match=r"opt.get_unscaled_gradients\(grads, state\)"):
    wrong, _ = named.apply_gradients(scaled, state, params)
  chex.assert_trees_all_equal(wrong, {"w": jnp.full(2, 1.0 - 24.0)})
  with pytest.warns(UserWarning, match="loss scale times too large"):
    jax.jit(named.apply_gradients)(scaled, state, params)

  plain = ols.porting.LossScaleOptimizer(optax.sgd(1.0), initial_scale=8.0)
  state = plain.init(params)
  unscaled = plain.get_unscaled_gradients(scaled, state)
  with pytest.raises(ValueError, match="unscaled by get_unscaled_gradients"):
    plain.update(unscaled, state, params)
  with pytest.raises(ValueError, match="apply_gradients"):
    plain.apply_gradients(unscaled, state, params)
  with pytest.raises(ValueError, match="iterations"):
    plain.iterations(state)


def test_get_unscaled_gradients_chooses_float32_leaf_by_leaf_as_update():
  """Only the leaves a master_weights state keeps float32 masters of come
  back in float32, as ``update`` hands them to the inner optimizer."""
  inner = optax.multi_transform(
    {"master": ols.master_weights(optax.sgd(1.0)), "plain": optax.sgd(1.0)},
    {"a": "master", "b": "plain"},
  )
  opt = ols.porting.LossScaleOptimizer(inner, initial_scale=8.0)
  params = {"a": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2, jnp.bfloat16)}
  state = opt.init(params)
  grads = {"a": jnp.full(2, 24.0, jnp.bfloat16), "b": jnp.full(2, 40.0, jnp.bfloat16)}
  unscaled = opt.get_unscaled_gradients(grads, state).tree
  assert unscaled["a"].dtype == jnp.float32
  assert unscaled["b"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(unscaled["a"], 3.0)
  np.testing.assert_array_equal(unscaled["b"], 5.0)


# An inner optimizer's name or config, read by the one Keras config parser on
# both paths: Keras' formulas (the default) and optax's optimizer under the
# core's arguments (min_scale and the like). The config's own arguments are
# Keras' names on the first path, optax's on the second.
INNER_FORMS = {
  "a name": ("adam", {}, None),
  "class_name and config": ({"class_name": "Adam", "config": {}}, {}, None),
  "Keras 3's serialised form": (
    {
      "module": "keras.optimizers",
      "class_name": "Adam",
      "config": {"name": "adam", "jit_compile": True, "clipnorm": 2.0},
      "registered_name": None,
    },
    {"clipnorm": 2.0},
    None,
  ),
  "tf_keras' form, legacy decay 0": (
    {
      "class_name": "Adam",
      "config": {"name": "Adam", "decay": 0.0, "is_legacy_optimizer": False},
    },
    {},
    None,
  ),
  "a legacy decay": (
    {"class_name": "Adam", "config": {"decay": 0.1}},
    {},
    "legacy `decay",
  ),
  "a serialised schedule": (
    {
      "class_name": "Adam",
      "config": {"learning_rate": {"class_name": "ExponentialDecay"}},
    },
    {},
    "serialised learning-rate schedule",
  ),
  "an unknown key": ({"class_name": "Adam", "bogus": 1}, {}, "must be an optax"),
  "an unknown optimizer": ("adamax9", {}, "unknown optimizer|adamax9"),
  "tf_keras' legacy optimizer's module": (
    {"module": "keras.optimizers.legacy", "class_name": "Adam", "config": {},
     "registered_name": None},
    {},
    None,
  ),
  "a custom optimizer's module": (
    {"module": "mylib.optim", "class_name": "Adam", "config": {},
     "registered_name": "mylib>Adam"},
    {},
    "not one of Keras' optimizers",
  ),
  "a custom optimizer registered as Adam": (
    {"module": "keras.optimizers", "class_name": "Adam", "config": {},
     "registered_name": "mylib>Adam"},
    {},
    "not one of Keras' optimizers",
  ),
}  # fmt: skip


@pytest.mark.parametrize("form", INNER_FORMS)
@pytest.mark.parametrize(
  "core", [False, True], ids=["keras formulas", "core arguments"]
)
def test_one_config_parser_on_both_paths(form, core):
  inner, base, error = INNER_FORMS[form]
  extra = {"min_scale": 1.0} if core else {}
  if error:
    with pytest.raises(ValueError, match=error):
      ols.porting.LossScaleOptimizer(inner, **extra)
    return
  opt = ols.porting.LossScaleOptimizer(inner, **extra)
  config = opt.get_config()
  assert config["inner_optimizer"]["class_name"].lower() == "adam"
  for k, v in base.items():  # base arguments in the inner config are honoured
    assert config[k] == v
  params = {"w": jnp.ones(3)}
  state = opt.init(params)
  updates, _ = opt.update({"w": jnp.ones(3) * 1e3}, state, params)
  assert np.all(np.isfinite(np.asarray(updates["w"])))


@pytest.mark.parametrize(
  "config",
  [
    {"class_name": "sgd", "config": {"momentum": 2.0}},
    {"class_name": "sgd", "config": {"momentum": -0.1}},
    {"class_name": "adam", "config": {"beta_1": 1.5}},
    {"class_name": "rmsprop", "config": {"rho": -1.0}},
  ],
  ids=str,
)
@pytest.mark.parametrize("legacy", [False, True], ids=["keras 3", "tf_keras"])
def test_a_hyper_parameter_keras_refuses_is_refused(config, legacy):
  if legacy and config["class_name"] == "rmsprop":
    pytest.skip("tf_keras' formulas here: sgd, adam, adamw")
  (key,) = config["config"]
  with pytest.raises(ValueError, match=f"`{key}` must be in"):
    P.LossScaleOptimizer(config, legacy_keras=legacy)


# optax's optimizers that decay the weights themselves, by Keras name under the
# core's arguments: the config's weight_decay is theirs (optax's default when
# absent), so the step decays once.
@pytest.mark.parametrize("name", ["adamw", "lion", "lamb"])
@pytest.mark.parametrize("weight_decay", [None, 0.0, 0.004])
def test_an_optax_optimizer_by_name_decays_once(name, weight_decay):
  config = {} if weight_decay is None else {"weight_decay": weight_decay}
  opt = P.LossScaleOptimizer(
    {"class_name": name, "config": config}, initial_scale=1.0, min_scale=1.0
  )
  assert opt.get_config()["inner_optimizer"]["config"].get("weight_decay") == (
    weight_decay
  )
  # float32 hyper-parameters, as the facade injects them
  inject = optax.inject_hyperparams(getattr(optax, name), hyperparam_dtype=jnp.float32)
  want = inject(0.001, **config)
  params = {"w": jnp.linspace(-2.0, 2.0, 8)}
  grads = {"w": jnp.linspace(0.5, -0.5, 8)}
  got, _ = opt.update(grads, opt.init(params), params)
  expected, _ = want.update(grads, want.init(params), params)
  np.testing.assert_array_equal(got["w"], expected["w"])


# optax's optimizer by Keras name, under the core's arguments: its config in
# optax's names, each of the kind of its default (it was accepted, and made
# NaN updates or a TypeError at update).
OPTAX_ARGUMENTS = {
  "a bool for a number": ("adam", {"b1": True}, "`b1` must be a real number"),
  "NaN": ("adam", {"b1": float("nan")}, "`b1` must be finite"),
  "a string for a number": ("adam", {"eps": "x"}, "`eps` must be a real number"),
  "a string for an optional number": (
    "sgd", {"momentum": "0.9"}, "`momentum` must be a real number"
  ),
  "an int for a bool": ("sgd", {"nesterov": 1}, "`nesterov` .* must be a bool"),
  "Keras' name": ("adam", {"beta_1": 0.9}, "unknown argument.*'beta_1'.*optax's"),
  "numbers": ("adam", {"b1": 0.8, "eps": 1e-7}, None),
  "a NumPy number": ("adam", {"b1": np.float32(0.8)}, None),
  "a schedule": ("adam", {"b1": lambda count: 0.9}, None),
  "sgd's momentum and nesterov": ("sgd", {"momentum": 0.9, "nesterov": True}, None),
  "None where optax takes it": ("adafactor", {"clipping_threshold": None}, None),
  "None where optax does not": ("adam", {"b1": None}, "`b1` must be a real number"),
}  # fmt: skip


@pytest.mark.parametrize("case", OPTAX_ARGUMENTS)
def test_an_optax_optimizer_by_name_checks_its_arguments(case):
  name, config, match = OPTAX_ARGUMENTS[case]
  make = lambda: P.LossScaleOptimizer(  # noqa: E731
    {"class_name": name, "config": config}, initial_scale=1.0, min_scale=1.0
  )
  if match:
    with pytest.raises(ValueError, match=match):
      make()
    return
  opt = make()
  params = {"w": jnp.linspace(-1.0, 1.0, 4)}
  updates, _ = opt.update({"w": jnp.ones(4)}, opt.init(params), params)
  assert np.all(np.isfinite(np.asarray(updates["w"])))


@pytest.mark.parametrize("name", ["adamw", "lion", "lamb"])
def test_keras_decay_on_an_optax_optimizer_that_decays_is_refused(name):
  with pytest.raises(ValueError, match="decays the weights itself"):
    P.LossScaleOptimizer(name, min_scale=1.0, weight_decay=0.01)


def test_keras_decay_on_an_optax_optimizer_without_its_own_is_keras():
  """adam by name under the core's arguments: weight_decay is Keras' decay,
  ``p * weight_decay * learning_rate`` off each weight, besides the step."""
  opt = P.LossScaleOptimizer("adam", initial_scale=1.0, min_scale=1.0, weight_decay=0.5)
  params = {"w": jnp.linspace(-2.0, 2.0, 8)}
  grads = {"w": jnp.zeros(8)}
  got, _ = opt.update(grads, opt.init(params), params)
  np.testing.assert_allclose(got["w"], -params["w"] * 0.5 * 0.001, rtol=1e-6)


# --------------------------------------------------------------------------
# Every from_config: unknown keys refused, a valid config round-trips.
# --------------------------------------------------------------------------

P = ols.porting
# name: (the object, a key of another class of this table)
FROM_CONFIG = {
  "DynamicLossScale, ours": (
    lambda: P.DynamicLossScale(1024.0, growth_interval=7, hysteresis=2),
    "loss_scale_value",
  ),
  "DynamicLossScale, TensorFlow's": (
    lambda: P.DynamicLossScale(initial_loss_scale=64.0, increment_period=3),
    "skip_nonfinite",
  ),
  "StaticLossScale, skipping": (lambda: P.StaticLossScale(8.0), "growth_interval"),
  "StaticLossScale, TensorFlow's FixedLossScale": (
    lambda: P.StaticLossScale(8.0, skip_nonfinite=False),
    "skip_nonfinite",
  ),
  "NoOpLossScale": (lambda: P.NoOpLossScale(), "scale"),
  "LossScaleOptimizer, by name": (
    lambda: P.LossScaleOptimizer("sgd", 8.0, 3, clipnorm=1.0),
    "initial_loss_scale",
  ),
  "LossScaleOptimizer, tf_keras": (
    lambda: P.LossScaleOptimizer("adam", legacy_keras=True, use_ema=True),
    "loss_scale_value",
  ),
  "LossScaleOptimizer, optax": (
    lambda: P.LossScaleOptimizer(optax.sgd(0.1), min_scale=2.0),
    "growth_interval",
  ),
  "ExperimentalLossScaleOptimizer": (
    lambda: P.ExperimentalLossScaleOptimizer("sgd", loss_scale=123.0),
    "scale",
  ),
}


def _rebuilt(obj, config):
  return type(obj).from_config(config)


@pytest.mark.parametrize("case", ["an unknown key", "a key of another class"])
@pytest.mark.parametrize("name", FROM_CONFIG)
def test_from_config_refuses_keys_it_does_not_read(name, case):
  """A key the class does not read is a ValueError naming it, never dropped."""
  make, other = FROM_CONFIG[name]
  obj = make()
  key = "bogus" if case == "an unknown key" else other
  config = {**obj.get_config(), key: 1}
  with pytest.raises(ValueError, match=rf"unknown key\(s\) '{key}'"):
    _rebuilt(obj, config)


@pytest.mark.parametrize("name", FROM_CONFIG)
def test_from_config_round_trips(name):
  obj = FROM_CONFIG[name][0]()
  again = _rebuilt(obj, obj.get_config())
  assert type(again) is type(obj)
  assert again.get_config() == obj.get_config()
  if isinstance(obj, P.LossScale):
    assert again.config == obj.config


_FIXED = {"class_name": "FixedLossScale", "config": {"loss_scale_value": 8.0}}
# (class, config, the message): a ValueError naming what is wrong, never a
# TypeError or KeyError from inside.
MALFORMED = {
  "not a dict": (lambda: P.LossScaleOptimizer, None, "takes a dict"),
  "no inner optimizer": (lambda: P.LossScaleOptimizer, {}, "lacks 'inner_optimizer'"),
  "TensorFlow 2.3's, no optimizer": (
    lambda: P.LossScaleOptimizer,
    {"loss_scale": _FIXED},
    "lacks 'optimizer'",
  ),
  "TensorFlow 2.3's, a loss scale config None": (
    lambda: P.LossScaleOptimizer,
    {
      "optimizer": "sgd",
      "loss_scale": {"class_name": "FixedLossScale", "config": None},
    },
    "FixedLossScale config as a dict",
  ),
  "TensorFlow 2.3's, multiplier None": (
    lambda: P.LossScaleOptimizer,
    {
      "optimizer": "sgd",
      "loss_scale": {"class_name": "DynamicLossScale", "config": {"multiplier": None}},
    },
    "`multiplier` must be a real number",
  ),
  "StaticLossScale, empty": (lambda: P.StaticLossScale, {}, "lacks 'scale'"),
  "StaticLossScale, not a dict": (lambda: P.StaticLossScale, [8.0], "takes a dict"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_from_config_refuses_a_malformed_config(name):
  cls, config, match = MALFORMED[name]
  with pytest.raises(ValueError, match=match):
    cls().from_config(config)


def _tf23(loss_scale):
  return lambda: P.LossScaleOptimizer.from_config(
    {"optimizer": "sgd", "loss_scale": loss_scale}
  )


def _tf23_dynamic(**config):
  return _tf23({"class_name": "DynamicLossScale", "config": config})


# A value given under TensorFlow's name and checked under the name it is
# translated to: the error names what the caller wrote (it named
# growth_factor for a multiplier, initial_scale for loss_scale_value).
AS_WRITTEN = {
  "multiplier, not finite in float32": (
    lambda: P.DynamicLossScale(multiplier=1e39), "`multiplier` is 1e.39"
  ),
  "multiplier, 1 in float32": (
    lambda: P.DynamicLossScale(multiplier=1 + 1e-9), "`multiplier` must be > 1"
  ),
  "initial_loss_scale, not finite in float32": (
    lambda: P.DynamicLossScale(initial_loss_scale=1e39), "`initial_loss_scale` is"
  ),
  "initial_loss_scale, zero": (
    lambda: P.DynamicLossScale(initial_loss_scale=0.0),
    "`initial_loss_scale` must be positive",
  ),
  "increment_period, zero": (
    lambda: P.DynamicLossScale(increment_period=0), "`increment_period` must be"
  ),
  "increment_period, not an integer": (
    lambda: P.DynamicLossScale(increment_period=2.5), "`increment_period` must be"
  ),
  "from_config, multiplier": (
    lambda: P.DynamicLossScale.from_config(
      {"initial_loss_scale": 2.0, "increment_period": 2, "multiplier": 1e39}
    ),
    "`multiplier` is",
  ),
  "from_config, increment_period": (
    lambda: P.DynamicLossScale.from_config(
      {"initial_loss_scale": 2.0, "increment_period": 0, "multiplier": 2.0}
    ),
    "`increment_period` must be",
  ),
  "TensorFlow 2.3's, loss_scale_value": (
    _tf23({"class_name": "FixedLossScale", "config": {"loss_scale_value": 1e39}}),
    "`loss_scale_value` is",
  ),
  "TensorFlow 2.3's, initial_loss_scale": (
    _tf23_dynamic(initial_loss_scale=-1.0), "`initial_loss_scale` must be a positive"
  ),
  "TensorFlow 2.3's, increment_period": (
    _tf23_dynamic(increment_period=0), "`increment_period` must be"
  ),
}  # fmt: skip


@pytest.mark.parametrize("case", AS_WRITTEN)
def test_an_error_names_the_argument_as_written(case):
  make, match = AS_WRITTEN[case]
  with pytest.raises(ValueError, match=match):
    make()


def test_our_names_are_ours_in_errors_beside_tensorflow_names():
  """Only the arguments given by TensorFlow's names are renamed."""
  with pytest.raises(ValueError, match="`growth_factor` is 1e"):
    P.DynamicLossScale(growth_factor=1e39, initial_scale=8.0)
  with pytest.raises(ValueError, match="`growth_interval` must be"):
    P.DynamicLossScale(growth_interval=0, initial_loss_scale=8.0)


def test_from_config_reads_any_mapping():
  config = types.MappingProxyType({"loss_scale_value": 8.0})
  obj = P.StaticLossScale.from_config(config)
  assert obj.get_config() == P.StaticLossScale(8.0, skip_nonfinite=False).get_config()


@pytest.mark.parametrize(
  "config, key",
  [
    ({"optimizer": "sgd", "loss_scale": "dynamic", "bogus": 1}, "bogus"),
    ({"optimizer": "sgd", "loss_scale": {"class_name": "FixedLossScale",
      "config": {"loss_scale_value": 8.0, "skip_nonfinite": True}}},
     "skip_nonfinite"),
    ({"optimizer": "sgd", "loss_scale": {"class_name": "DynamicLossScale",
      "config": {"initial_loss_scale": 8.0, "bogus": 2}}}, "bogus"),
    ({"optimizer": "sgd", "initial_scale": 8.0, "loss_scale": {
      "class_name": "FixedLossScale", "config": {"loss_scale_value": 8.0}}},
     "initial_scale"),
  ],
)  # fmt: skip
def test_from_config_tensorflow_2_3_form_refuses_keys(config, key):
  """TensorFlow 2.3's form (``optimizer`` and ``loss_scale``) is checked too,
  the nested ``LossScale`` config included; the two forms are not mixed."""
  with pytest.raises(ValueError, match=rf"unknown key\(s\) '{key}'"):
    P.LossScaleOptimizer.from_config(config)


def test_from_config_reads_keras_3_metadata():
  """Keras 3's own config (``name``, the inner optimizer's ``module`` and
  ``registered_name``), as ``keras.optimizers.LossScaleOptimizer`` writes it."""
  keras3 = {
    "name": "my_lso",
    "inner_optimizer": {
      "module": "keras.optimizers",
      "class_name": "SGD",
      "config": {
        "name": "sgd", "learning_rate": 0.1, "weight_decay": None,
        "clipnorm": None, "global_clipnorm": None, "clipvalue": None,
        "use_ema": False, "ema_momentum": 0.99, "ema_overwrite_frequency": None,
        "loss_scale_factor": None, "gradient_accumulation_steps": None,
        "momentum": 0.9, "nesterov": False,
      },
      "registered_name": None,
    },
    "initial_scale": 8.0,
    "dynamic_growth_steps": 2000,
  }  # fmt: skip
  opt = P.LossScaleOptimizer.from_config(keras3)
  assert opt.get_config()["name"] == "my_lso"
  assert (opt.initial_scale, dict(opt.inner_optimizer.hyper)["momentum"]) == (8.0, 0.9)
  assert P.LossScaleOptimizer("sgd").get_config()["name"] == "loss_scale_optimizer"


_F32_MAX = float(np.finfo(np.float32).max)
_DYNAMIC_TF = {"class_name": "DynamicLossScale", "config": {"increment_period": 2}}


def _tf23_initial(value):
  config = {"initial_loss_scale": value, "increment_period": 2}
  return {"class_name": "DynamicLossScale", "config": config}


# Every way to give a scale above 2**126, whose reciprocal (what the
# gradients are multiplied by) is subnormal: XLA flushes it to zero on a
# CPU, and every update was zero eagerly (TensorFlow takes such scales,
# with the same result).
ABOVE_2_126 = {
  "StaticLossScale": lambda v: P.StaticLossScale(v),
  "StaticLossScale.from_config": lambda v: P.StaticLossScale.from_config(
    {"loss_scale_value": v}
  ),
  "DynamicLossScale, TensorFlow's names": lambda v: P.DynamicLossScale(
    initial_loss_scale=v
  ),
  "LossScaleOptimizer": lambda v: P.LossScaleOptimizer("sgd", initial_scale=v),
  "LossScaleOptimizer, tf_keras": lambda v: P.LossScaleOptimizer(
    "sgd", initial_scale=v, legacy_keras=True
  ),
  "LossScaleOptimizer, fixed": lambda v: P.LossScaleOptimizer(
    "sgd", initial_scale=v, dynamic=False
  ),
  "ExperimentalLossScaleOptimizer": lambda v: P.ExperimentalLossScaleOptimizer(
    "sgd", loss_scale=v
  ),
  "TensorFlow 2.3's config, fixed": lambda v: P.LossScaleOptimizer.from_config(
    {"optimizer": "sgd", "loss_scale": {"class_name": "FixedLossScale",
     "config": {"loss_scale_value": v}}}
  ),
  "TensorFlow 2.3's config, dynamic": lambda v: P.LossScaleOptimizer.from_config(
    {"optimizer": "sgd", "loss_scale": _tf23_initial(v)}
  ),
}  # fmt: skip


@pytest.mark.parametrize("value", [2.0**127, _F32_MAX], ids=["2**127", "f32 max"])
@pytest.mark.parametrize("entry", ABOVE_2_126)
def test_a_scale_above_2_126_is_refused(entry, value):
  with pytest.raises(ValueError, match="2\\*\\*126"):
    ABOVE_2_126[entry](value)
  ABOVE_2_126[entry](2.0**126)  # the ceiling itself is taken


# Below 2**-126 (subnormal) the reciprocal overflows: a fixed scale applied
# inf every step. StaticLossScale refused it, LossScaleOptimizer took it.
BELOW_2_M126 = [k for k in ABOVE_2_126 if "DynamicLossScale" not in k]


@pytest.mark.parametrize("entry", BELOW_2_M126)
def test_a_subnormal_scale_is_refused(entry):
  with pytest.raises(ValueError, match="2\\*\\*-126"):
    ABOVE_2_126[entry](1e-39)
  ABOVE_2_126[entry](2.0**-126)  # the floor itself is taken


@pytest.mark.parametrize("legacy", [False, True], ids=["keras 3", "tf_keras"])
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_growth_stops_at_2_126_and_updates_stay_right(legacy, jitted):
  """Keras' and TensorFlow's rule doubles while the result is finite, to
  2**127, whose reciprocal is subnormal: the updates were zero (eagerly in
  both modes, under jit with tf_keras' reciprocal too)."""
  opt = P.LossScaleOptimizer(
    "sgd", initial_scale=2.0**125, dynamic_growth_steps=1, legacy_keras=legacy
  )
  update = jax.jit(opt.update) if jitted else opt.update
  params = {"w": jnp.ones(4)}
  state = opt.init(params)
  scales = []
  for _ in range(3):
    scale = ols.get_scale(state)
    scales.append(float(scale))
    updates, state = update({"w": jnp.full(4, 0.5) * scale}, state, params)
    np.testing.assert_allclose(updates["w"], -0.005, rtol=1e-6)  # sgd, 0.01
  assert scales == [2.0**125, 2.0**126, 2.0**126]


# --------------------------------------------------------------------------
# Keras 3's rule: a backoff halves with no floor; tf_keras floors at 1.
# --------------------------------------------------------------------------


def _rule_reference(initial, growth, finite_seq, floor):
  """TensorFlow's and Keras' rule, written out in NumPy float32."""
  scale, good, out = np.float32(initial), 0, []
  for finite in finite_seq:
    if finite:
      good += 1
      if good >= growth:
        grown = scale * np.float32(2)
        scale, good = (grown if np.isfinite(grown) else scale), 0
    else:
      scale, good = scale / np.float32(2), 0
      if floor:
        scale = max(scale, np.float32(1))
    out.append(float(scale))
  return out


@pytest.mark.parametrize("legacy", [False, True], ids=["keras 3", "tf_keras"])
@pytest.mark.parametrize("initial", [2.0**-10, 3.0, 2.0**100])
def test_the_dynamic_scale_step_by_step(initial, legacy):
  """Growth 3, then two overflows, four times: from 2**-10 Keras 3's scale
  keeps halving below 1, tf_keras' backs off to no less than 1."""
  finite_seq = ([True] * 3 + [False] * 2) * 4
  opt = P.LossScaleOptimizer("sgd", initial, 3, legacy_keras=legacy)
  params = {"w": jnp.ones(2)}
  state = opt.init(params)
  step = jax.jit(opt.apply_gradients)
  scales = []
  for finite in finite_seq:
    grads = {"w": jnp.full(2, 1.0 if finite else jnp.inf)}
    params, state = step(P.UnscaledGradients(grads), state, params)
    scales.append(float(opt.loss_scale(state)))
  assert scales == _rule_reference(initial, 3, finite_seq, floor=legacy)
  if initial == 2.0**-10:  # after the first backoff (step 4)
    assert (min(scales[3:]) < 1) == (not legacy)


# --------------------------------------------------------------------------
# get_ema_params reads every average the library keeps.
# --------------------------------------------------------------------------

EMA_FORMS = {
  "ema_params": (lambda: P.ema_params(0.5), "keras 3"),
  "chain(sgd, ema_params)": (
    lambda: optax.chain(optax.sgd(0.1), P.ema_params(0.5)),
    "keras 3",
  ),
  "LossScaleOptimizer(optax, use_ema)": (
    lambda: P.LossScaleOptimizer(optax.sgd(0.1), 8.0, use_ema=True, ema_momentum=0.5),
    "keras 3",
  ),
  "LossScaleOptimizer(name, use_ema)": (
    lambda: P.LossScaleOptimizer("sgd", 8.0, use_ema=True, ema_momentum=0.5),
    "keras 3",
  ),
  "LossScaleOptimizer(name, use_ema, accumulation)": (
    lambda: P.LossScaleOptimizer(
      "adam", 8.0, use_ema=True, ema_momentum=0.5, gradient_accumulation_steps=1 + 1
    ),
    "keras 3, accumulation 2",
  ),
  "LossScaleOptimizer(name, use_ema, legacy_keras)": (
    lambda: P.LossScaleOptimizer(
      "sgd", 8.0, use_ema=True, ema_momentum=0.5, legacy_keras=True
    ),
    "tf_keras",
  ),
}


@pytest.mark.parametrize("form", EMA_FORMS)
def test_get_ema_params_reads_every_average(form):
  """The average, against NumPy's over the recorded weights: Keras 3 (and
  ema_params) start at the first new weights, tf_keras at the initial ones."""
  make, kind = EMA_FORMS[form]
  tx = make()
  params = {"w": jnp.array([1.0, -2.0, 3.0])}
  state = tx.init(params)
  history = [np.asarray(params["w"])]
  for i in range(4):
    grads = {"w": jnp.array([0.5, 1.0, -1.5]) * (i + 1) * 8.0}
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    history.append(np.asarray(params["w"]))
  m = np.float32(0.5)
  if kind == "tf_keras":
    ema = history[0]
    for p in history[1:]:
      ema = m * ema + (1 - m) * p
  else:
    every = 2 if "accumulation" in kind else 1
    applied = history[every::every]
    ema = applied[0]
    for p in applied[1:]:
      ema = m * ema + (1 - m) * p
  got = P.get_ema_params(state)["w"]
  np.testing.assert_allclose(np.asarray(got), ema, rtol=1e-6)
  final = P.finalize_variable_values(params, state)["w"]
  np.testing.assert_allclose(np.asarray(final), ema, rtol=1e-6)


# --------------------------------------------------------------------------
# Errors that say what to write; help() shows the signature.
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
  "call, match",
  [
    (lambda: P.LossScaleOptimizer("adam", learning_rate=1e-3),
     r"LossScaleOptimizer\(\{'class_name': 'adam', 'config': "
     r"\{'learning_rate': 0.001\}\}"),
    (lambda: P.LossScaleOptimizer(optax.adam(1e-3), beta_1=0.5),
     r"optax.adam\(learning_rate=...\)"),
    (lambda: P.LossScaleOptimizer("sgd").get_scaled_loss(1.0),
     r"opt.get_scaled_loss\(loss, state\)"),
    (lambda: P.LossScaleOptimizer("sgd").scale_loss(1.0),
     r"opt.scale_loss\(loss, state\)"),
    (lambda: P.LossScaleOptimizer("sgd").get_unscaled_gradients({"w": jnp.ones(1)}),
     r"opt.get_unscaled_gradients\(grads, state\)"),
    (lambda: P.ExperimentalLossScaleOptimizer("adam", "dynamic", learning_rate=1e-3),
     r"^ExperimentalLossScaleOptimizer got .*LossScaleOptimizer\(\{'class_name': "
     r"'adam', 'config': \{'learning_rate': 0.001\}\}"),
    (lambda: P.ExperimentalLossScaleOptimizer("sgd", loss_scale=8, clipnorm=1.0),
     r"takes only `optimizer` and `loss_scale`.*"
     r"LossScaleOptimizer\(optimizer, clipnorm=1.0, ...\)"),
    # TensorFlow's names and misspellings are not hyper-parameters: they were
    # told to go in the optimizer's config, where they fail again.
    (lambda: P.LossScaleOptimizer("sgd", loss_scale=128),
     r"For `loss_scale` write initial_scale=..., dynamic=False"),
    (lambda: P.LossScaleOptimizer("sgd", initial_loss_scale=2.0),
     r"For `initial_loss_scale` write initial_scale"),
    (lambda: P.LossScaleOptimizer("sgd", increment_period=5),
     r"For `increment_period` write dynamic_growth_steps"),
    (lambda: P.LossScaleOptimizer("sgd", dynamic_growth_step=2),
     r"`dynamic_growth_step` is no argument .*did you mean `dynamic_growth_steps`"),
    (lambda: P.LossScaleOptimizer("adam", beta_1=0.5, loss_scale=2),
     r"`beta_1`, an optimizer's hyper-parameter, goes in its config\. "
     r"For `loss_scale`"),
    (lambda: P.LossScaleOptimizer("adam", min_scale=1.0, b1=0.5),
     r"LossScaleOptimizer\(\{'class_name': 'adam', 'config': \{'b1': 0.5\}\}"),
  ],
)  # fmt: skip
def test_errors_say_what_to_write(call, match):
  with pytest.raises(ValueError, match=match):
    call()


@pytest.mark.parametrize(
  "cls", [P.LossScaleOptimizer, P.ExperimentalLossScaleOptimizer]
)
def test_help_shows_the_constructor(cls):
  import inspect
  import pydoc

  text = pydoc.render_doc(cls.__init__)
  assert "Initialize self" not in text
  assert cls.__doc__.splitlines()[0] in text
  params = list(inspect.signature(cls.__init__).parameters)
  assert params[1:] == list(inspect.signature(cls.__new__).parameters)[1:]
  assert "inner_optimizer" in params or "loss_scale" in params


def test_a_callable_loss_gives_a_callable():
  """TensorFlow's get_scaled_loss of a callable returns a callable."""
  loss = lambda x: x * 3.0  # noqa: E731
  ls = P.DynamicLossScale(8.0)
  assert float(ls.scale_loss(loss)(jnp.float32(2.0))) == 48.0
  opt = P.LossScaleOptimizer("sgd", 8.0)
  state = opt.init({"w": jnp.ones(1)})
  assert float(opt.get_scaled_loss(loss, state)(jnp.float32(2.0))) == 48.0


def _sgd_by_name():
  return P.LossScaleOptimizer({"class_name": "SGD", "config": {"learning_rate": 0.1}})


def _sgd_optax():
  return P.LossScaleOptimizer(optax.inject_hyperparams(optax.sgd)(0.1))


# A learning rate set in the state is one number: a vector became a rate per
# element, a callable failed with a TypeError from inside.
@pytest.mark.parametrize("make", [_sgd_by_name, _sgd_optax], ids=["keras", "optax"])
@pytest.mark.parametrize(
  "rate",
  [jnp.array([0.1, 5.0]), lambda step: 0.1, "0.1", True, None],
  ids=["a vector", "a schedule", "a string", "a bool", "None"],
)
def test_set_learning_rate_takes_one_number(make, rate):
  opt = make()
  state = opt.init({"w": jnp.ones(2)})
  with pytest.raises(ValueError, match="one real number"):
    opt.set_learning_rate(state, rate)
  state = jax.jit(opt.set_learning_rate)(state, 0.05)  # traced: taken
  assert float(opt.learning_rate(state)) == pytest.approx(0.05)


@pytest.mark.parametrize(
  "config, match",
  [
    ({"class_name": "SGD", "config": {"learning_rate": lambda: 0.05}},
     "does not take it"),
    ({"class_name": "AdamW", "config": {"weight_decay": None}},
     "AdamW's `weight_decay` must be a float"),
  ],
  ids=["a zero-argument learning rate", "AdamW's weight_decay None"],
)  # fmt: skip
def test_keras_configs_keras_refuses_or_we_cannot_run(config, match):
  """Refused when made, with the argument named (a zero-argument callable,
  which Keras takes, failed inside init with a TypeError; AdamW's None,
  which Keras refuses, became 0.004)."""
  with pytest.raises(ValueError, match=match):
    P.LossScaleOptimizer(config)


# --------------------------------------------------------------------------
# What TensorFlow and Keras write differently, or refuse: never run with
# another formula or semantics silently.
# --------------------------------------------------------------------------

#: OptimizerV2 configs (tf.keras.optimizers.legacy; TensorFlow <= 2.10 with
#: `decay`): RMSprop's and Adagrad's epsilon sits outside the square root.
_V2 = {
  "legacy module": lambda name: {
    "module": "keras.optimizers.legacy",
    "class_name": name,
    "config": {"learning_rate": 0.01},
  },
  "decay key": lambda name: {
    "class_name": name,
    "config": {"learning_rate": 0.01, "decay": 0.0},
  },
}


@pytest.mark.parametrize("name", ["RMSprop", "Adagrad", "SGD", "Adam"])
@pytest.mark.parametrize("form", _V2)
def test_optimizer_v2_rmsprop_and_adagrad_are_refused(form, name):
  config = _V2[form](name)
  if name in ("RMSprop", "Adagrad"):
    with pytest.raises(ValueError, match="OptimizerV2"):
      P.LossScaleOptimizer(config)
    with pytest.raises(ValueError, match="OptimizerV2"):
      P.LossScaleOptimizer.from_config(
        {"inner_optimizer": config, "initial_scale": 2.0}
      )
  else:  # the same formula as Keras 3's
    opt = P.LossScaleOptimizer(config, initial_scale=2.0)
    params = {"w": jnp.ones(3)}
    updates, _ = opt.update({"w": jnp.full(3, 2.0)}, opt.init(params), params)
    assert np.all(np.asarray(updates["w"]) < 0)


@pytest.mark.parametrize("legacy", [False, True], ids=["keras 3", "tf_keras"])
@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("where", ["parameter", "gradient"])
def test_a_complex_leaf_is_refused_by_keras_formulas(where, name, legacy):
  """Keras' formulas square a gradient (a complex one needs |g|**2), and
  TensorFlow and Keras refuse complex variables: a ValueError naming it."""
  opt = P.LossScaleOptimizer(name, initial_scale=8.0, legacy_keras=legacy)
  real = {"w": jnp.ones(2), "z": jnp.ones(2)}
  if where == "parameter":
    with pytest.raises(ValueError, match=r"parameter at \['z'\] is complex"):
      opt.init({**real, "z": jnp.ones(2, jnp.complex64)})
    return
  state = opt.init(real)
  grads = {"w": jnp.ones(2), "z": jnp.full(2, 1j, jnp.complex64)}
  for call in (
    lambda: opt.update(grads, state, real),
    lambda: opt.apply_gradients(P.UnscaledGradients(grads), state, real),
  ):
    with pytest.raises(ValueError, match=r"gradient at \['z'\] is complex"):
      call()
  # optax's Adam takes complex parameters: the transformation path is open
  ok = P.LossScaleOptimizer(optax.adam(1e-3), initial_scale=8.0)
  z = {"z": jnp.ones(2, jnp.complex64)}
  updates, _ = ok.update({"z": jnp.full(2, 8j, jnp.complex64)}, ok.init(z), z)
  np.testing.assert_allclose(np.asarray(updates["z"]), -1e-3j, rtol=1e-5)


@pytest.mark.parametrize("legacy", [False, True], ids=["keras 3", "tf_keras"])
@pytest.mark.parametrize("overwrite", [None, 2])
def test_the_weight_average_leaves_integer_leaves_as_they_are(overwrite, legacy):
  """Not averaged, so never swapped in: a counter set to 8 stays 8 through
  an overwrite step and finalize_variable_values (it became 0, Keras 3's
  average's zeros, or the initial value with tf_keras' average)."""
  opt = P.LossScaleOptimizer(
    "sgd",
    initial_scale=2.0,
    use_ema=True,
    ema_momentum=0.5,
    ema_overwrite_frequency=overwrite,
    legacy_keras=legacy,
  )
  params = {"w": jnp.ones(3), "count": jnp.array(7, jnp.int32)}
  state = opt.init(params)
  grads = {"w": jnp.full(3, 2.0), "count": jnp.array(0, jnp.int32)}
  step = jax.jit(opt.apply_gradients)
  for _ in range(2):
    params = {**params, "count": params["count"] + 1}  # the model's own counter
    params, state = step(P.UnscaledGradients(grads), state, params)
    assert int(params["count"]) == {0: 8, 1: 9}[_]
  final = opt.finalize_variable_values(params, state)
  assert int(final["count"]) == 9
  # the floats averaged (an overwrite at step 2 already swapped them in)
  swapped = np.allclose(np.asarray(final["w"]), np.asarray(params["w"]))
  assert swapped == (overwrite == 2)


@pytest.mark.parametrize("call", ["update", "apply_gradients"])
@pytest.mark.parametrize(
  "grad_shape, param_shape", [((3,), (3, 1)), ((1,), (3,)), ((3, 1), (3,))]
)
def test_keras_formulas_check_each_gradient_shape(grad_shape, param_shape, call):
  """As the optax path: a ValueError naming the leaf and both shapes (a (1,)
  gradient was broadcast to every element of a (3,) parameter)."""
  opt = P.LossScaleOptimizer("sgd", initial_scale=2.0)
  params = {"w": jnp.ones(param_shape)}
  state = opt.init(params)
  grads = {"w": jnp.ones(grad_shape)}
  fn = {
    "update": lambda: opt.update(grads, state, params),
    "apply_gradients": lambda: opt.apply_gradients(
      P.UnscaledGradients(grads), state, params
    ),
  }[call]
  with pytest.raises(ValueError, match=r"\['w'\] has shape"):
    fn()


@pytest.mark.parametrize("jitted", [False, True])
def test_keras_3_backoff_stops_at_2_to_the_minus_126(jitted):
  """Keras 3 halves with no floor: below 2**-126 the scale is subnormal,
  then 0, whose reciprocal makes every gradient NaN, and every later step
  was skipped, finite ones too. Here it stops at 2**-126, and finite steps
  apply and grow it again."""
  opt = P.LossScaleOptimizer("sgd", initial_scale=2.0**-125, dynamic_growth_steps=1)
  step = jax.jit(opt.apply_gradients) if jitted else opt.apply_gradients
  params = {"w": jnp.ones(2)}
  state = opt.init(params)
  scales = []
  for finite in [False] * 4 + [True] * 2:
    grads = {"w": jnp.full(2, 1.0 if finite else jnp.nan)}
    new, state = step(P.UnscaledGradients(grads), state, params)
    assert bool(np.all(new["w"] != params["w"])) == finite
    params = new
    scales.append(float(opt.loss_scale(state)))
  assert scales == [2.0**-126] * 4 + [2.0**-125, 2.0**-124]


#: tf_keras' and TensorFlow 2.3's LossScaleOptimizer configs (as they write
#: them): their semantics count a skipped step in `iterations`.
_TF_CONFIGS = {
  "tf_keras": lambda inner: {
    "inner_optimizer": inner,
    "dynamic": True,
    "initial_scale": 4.0,
    "dynamic_growth_steps": 2000,
  },
  "TensorFlow 2.3": lambda inner: {
    "optimizer": inner,
    "loss_scale": {
      "class_name": "DynamicLossScale",
      "config": {"initial_loss_scale": 4.0, "increment_period": 2000},
    },
  },
}


@pytest.mark.parametrize("name", ["SGD", "Adam", "RMSprop"])
@pytest.mark.parametrize("form", _TF_CONFIGS)
def test_a_tf_keras_config_is_read_with_tf_keras_semantics(form, name):
  inner = {"class_name": name, "config": {"learning_rate": 0.1}}
  config = _TF_CONFIGS[form](inner)
  if name == "RMSprop":  # tf_keras' semantics are not written for it
    with pytest.raises(ValueError, match="'legacy_keras': False"):
      P.LossScaleOptimizer.from_config(config)
    opt = P.LossScaleOptimizer.from_config({**config, "legacy_keras": False})
    assert not opt.legacy_keras
    return
  opt = P.LossScaleOptimizer.from_config(config)
  assert opt.legacy_keras
  params = {"w": jnp.ones(2)}
  state = opt.init(params)
  for g in (jnp.inf, 1.0):  # a skipped step, then an applied one
    params, state = opt.apply_gradients(
      P.UnscaledGradients({"w": jnp.full(2, g)}), state, params
    )
  assert int(opt.iterations(state)) == 2  # tf_keras counts the skipped one
  # this package's own config says which, and round-trips
  again = P.LossScaleOptimizer.from_config(opt.get_config())
  assert again.legacy_keras


#: Configs with `dynamic` that are not tf_keras': this package's own before
#: `legacy_keras` (with the core's arguments) and a hand-written one around
#: an optax transformation. Read as they were written, Keras 3's semantics.
_OWN_FORMS = {
  "an earlier own config": lambda: {
    "inner_optimizer": {"class_name": "rmsprop", "config": {"learning_rate": 0.001}},
    "dynamic": True,
    "initial_scale": 2.0**15,
    "dynamic_growth_steps": 2000,
    "min_scale": 1.0,
    "max_scale": 2.0**24,
    "hysteresis": 1,
    "track_nonfinite": False,
  },
  "an optax inner": lambda: {"inner_optimizer": optax.adam(1e-3), "dynamic": True},
}


@pytest.mark.parametrize("form", _OWN_FORMS)
def test_a_config_with_dynamic_that_is_not_tf_keras_is_read_as_written(form):
  opt = P.LossScaleOptimizer.from_config(_OWN_FORMS[form]())
  assert not opt.legacy_keras


def test_a_tf_keras_config_of_an_optimizer_without_a_formula_says_so():
  config = _TF_CONFIGS["tf_keras"]({"class_name": "Adamax", "config": {}})
  with pytest.raises(ValueError, match="no Keras formula for 'Adamax'"):
    P.LossScaleOptimizer.from_config(config)


@pytest.mark.parametrize("jitted", [False, True])
@pytest.mark.parametrize("legacy", [False, True], ids=["keras 3", "tf_keras"])
def test_an_integer_parameter_with_a_float0_gradient_is_left_alone(legacy, jitted):
  """jax.grad(allow_int=True) gives a counter a float0 gradient: tf_keras'
  cast to the variable's dtype failed on it eagerly."""
  params = {"w": jnp.ones(4), "n": jnp.full((), 5, jnp.int32)}
  grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2), allow_int=True)(params)
  opt = P.LossScaleOptimizer("sgd", initial_scale=1.0, legacy_keras=legacy)
  update = jax.jit(opt.update) if jitted else opt.update
  updates, _ = update(grads, opt.init(params), params)
  new = optax.apply_updates(params, updates)
  assert int(new["n"]) == 5
  np.testing.assert_allclose(np.asarray(new["w"]), 0.98, rtol=1e-6)  # sgd, 0.01


@pytest.mark.parametrize("call", ["update", "apply_gradients"])
@pytest.mark.parametrize("where", ["['w']", "['b']"], ids=["a leaf", "a subtree"])
def test_keras_formulas_name_a_none_gradient(where, call):
  """Keras skips a variable whose gradient is None (with a warning); its
  formulas here need one: a ValueError naming it, on both entry points."""
  opt = P.LossScaleOptimizer("sgd", initial_scale=2.0)
  params = {"w": jnp.ones(3), "b": {"x": jnp.ones(2)}}
  state = opt.init(params)
  grads = {"w": jnp.ones(3), "b": {"x": jnp.ones(2)}}
  grads[where[2]] = None
  fn = {
    "update": lambda: opt.update(grads, state, params),
    "apply_gradients": lambda: opt.apply_gradients(
      P.UnscaledGradients(grads), state, params
    ),
  }[call]
  with pytest.raises(ValueError, match=rf"gradient at \{where[:-1]}\] is None"):
    fn()
