"""Differential test against Keras 3 ``LossScaleOptimizer`` (JAX backend).

With ``hysteresis=1`` and clamps out of reach, ``dynamic_loss_scale(sgd)``
must follow Keras step for step: the scale, the growth counter and the
parameters, bit for bit, on any sequence of finite and non-finite gradients.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import optax_lossscale as ols  # noqa: E402

keras = pytest.importorskip("keras")

pytestmark = pytest.mark.standard_promotion

SHAPES = [(3,), (2, 4), ()]


def _keras_run(lr, initial_scale, growth, grads_seq, params0):
  variables = [keras.Variable(np.asarray(p)) for p in params0]
  opt = keras.optimizers.LossScaleOptimizer(
    keras.optimizers.SGD(learning_rate=lr),
    initial_scale=initial_scale,
    dynamic_growth_steps=growth,
  )
  opt.build(variables)
  names = [v.path.split("/")[-1] for v in opt.variables]
  opt_vars = [v.value for v in opt.variables]
  train_vars = [v.value for v in variables]
  apply = jax.jit(opt.stateless_apply)
  trace = []
  for grads in grads_seq:
    train_vars, opt_vars = apply(opt_vars, list(grads), train_vars)
    own = dict(zip(names, opt_vars, strict=True))  # the outer optimizer's come first
    trace.append(
      (
        float(own["dynamic_scale"]),
        int(own["step_counter"]),
        [np.asarray(t) for t in train_vars],
      )
    )
  return trace


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
  growth=st.integers(1, 4),
  # Powers of two, as in practice: we unscale by multiplying with the float32
  # reciprocal (like torch's GradScaler and jmp), Keras divides; for a scale
  # such as 24 the two round differently in the last bit.
  initial_scale=st.sampled_from([2.0**15, 1.0, 2.0**4, 2.0**-3]),
  # Powers of two: ``g * lr`` is exact, so whether XLA contracts
  # ``p - g * lr`` into an FMA (it may differ between the two programs)
  # cannot change a bit, and the parameters can be compared exactly.
  lr=st.sampled_from([1.0, 0.5, 2.0**-7]),
  steps=st.lists(
    st.tuples(
      st.booleans(),
      st.sampled_from([np.inf, -np.inf, np.nan]),
      st.integers(0, len(SHAPES) - 1),
    ),
    min_size=1,
    max_size=40,
  ),
  seed=st.integers(0, 2**16),
)
def test_matches_keras_loss_scale_optimizer(growth, initial_scale, lr, steps, seed):
  rng = np.random.default_rng(seed)
  params0 = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
  # Random scaled gradients; the scale that produced them is not known in
  # advance, so feed plain normals (the rule only looks at finiteness and the
  # unscaled values are compared by both sides doing the same division).
  grads_seq = []
  for finite, bad, where in steps:
    g = [rng.normal(size=s).astype(np.float32) * 1000 for s in SHAPES]
    if not finite:
      g[where] = np.array(g[where])
      g[where].flat[0] = bad
    grads_seq.append(g)

  expected = _keras_run(lr, initial_scale, growth, grads_seq, params0)

  tx = ols.dynamic_loss_scale(
    optax.sgd(lr),
    initial_scale=initial_scale,
    growth_interval=growth,
    min_scale=2.0**-126,
    max_scale=2.0**126,
  )
  params = [jnp.asarray(p) for p in params0]
  state = tx.init(params)

  @jax.jit  # one compiled step, like Keras' stateless_apply
  def step_fn(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for step, (grads, (k_scale, k_counter, k_params)) in enumerate(
    zip(grads_seq, expected, strict=True)
  ):
    params, state = step_fn([jnp.asarray(g) for g in grads], state, params)
    assert float(state.loss_scale) == k_scale, step
    assert int(state.good_steps) == k_counter, step
    for ours, theirs in zip(params, k_params, strict=True):
      np.testing.assert_array_equal(np.asarray(ours), theirs, err_msg=str(step))


# --------------------------------------------------------------------------
# Keras' formulas on half-precision variables, against Keras 3 itself: its
# ops.divide makes the unscaled gradients float32, which clipping sees and
# the formula casts to the variable's dtype; its average's two weights are
# in the variable's dtype. (Kept half, a float16 norm overflowed at 256:
# clipnorm froze the weights, global_clipnorm made them NaN.)
# --------------------------------------------------------------------------

HALF_BASES = {
  "clipnorm": {"clipnorm": 1.0},
  "global_clipnorm": {"global_clipnorm": 1.0},
  "clipvalue": {"clipvalue": 50.0},
  "EMA, overwrite": {"use_ema": True, "ema_overwrite_frequency": 3},
  "weight decay, momentum": {"weight_decay": 0.01, "momentum": 0.9},
}


def _keras_formula_runs(base, dtype, grads_seq, init):
  hyper = {"learning_rate": 0.1, "momentum": base.get("momentum", 0.0)}
  kbase = {k: v for k, v in base.items() if k != "momentum"}
  variables = [keras.Variable(np.asarray(init), dtype=dtype)]
  theirs = keras.optimizers.LossScaleOptimizer(
    keras.optimizers.SGD(**hyper, **kbase), initial_scale=2.0, dynamic_growth_steps=2
  )
  theirs.build(variables)
  apply = jax.jit(theirs.stateless_apply)
  opt_vars, train = [v.value for v in theirs.variables], [v.value for v in variables]
  ours = ols.porting.LossScaleOptimizer(
    {"class_name": "SGD", "config": {**hyper, **kbase}},
    initial_scale=2.0,
    dynamic_growth_steps=2,
  )
  params = [jnp.asarray(init, dtype)]
  state = ours.init(params)
  update = jax.jit(ours.update)
  for step, grads in enumerate(grads_seq):
    g = [jnp.asarray(grads, dtype)]
    train, opt_vars = apply(opt_vars, g, train)
    updates, state = update(g, state, params)
    params = optax.apply_updates(params, updates)
    assert params[0].dtype == train[0].dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(
      np.asarray(params[0], np.float32), np.asarray(train[0], np.float32), str(step)
    )
  return params, train


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("base", HALF_BASES)
def test_keras_formulas_on_half_variables_step_by_step(base, dtype):
  rng = np.random.default_rng(0)
  init = rng.normal(size=(6,)).astype(np.float32)
  # scaled gradients: unscaled norms of about 300 to 1000 (squares past
  # float16's largest), a non-finite step, small ones
  seq = [rng.normal(size=(6,)) * s for s in (600, 1500, 900, 1.0, 0.5, 800)]
  seq.insert(3, np.array([np.inf, 0, 0, 0, 0, 0]))
  params, _ = _keras_formula_runs(HALF_BASES[base], dtype, seq, init)
  assert np.all(np.isfinite(np.asarray(params[0], np.float32)))


def test_float16_accumulation_takes_its_mean_in_float32():
  """Keras 3's ``(g + acc) / steps`` has the float32 unscaled gradient: a
  window of two 40000s averages to 40000, not float16's inf (which was
  applied after a finite check). Keras 3.15 on JAX cannot run accumulation
  on float16 variables itself (a lax.cond whose branches differ in dtype)."""
  opt = ols.porting.LossScaleOptimizer(
    {"class_name": "SGD", "config": {"learning_rate": 1e-4}},
    initial_scale=1.0,
    gradient_accumulation_steps=2,
  )
  params = {"w": jnp.ones(2, jnp.float16)}
  state = opt.init(params)
  for _ in range(2):
    updates, state = jax.jit(opt.update)(
      {"w": jnp.array([40000.0, 0.0], jnp.float16)}, state, params
    )
    params = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(params["w"], np.array([-3.0, 1.0], np.float16))
  assert state.inner_state.accumulators["w"].dtype == jnp.float16


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_get_unscaled_gradients_then_apply_gradients_is_update(dtype):
  """tf_keras' two-call idiom gives Keras 3's numbers too: the unscaled half
  gradients stay float32, as update keeps them (clipnorm sees them so)."""
  opt = ols.porting.LossScaleOptimizer(
    {"class_name": "SGD", "config": {"learning_rate": 0.1, "clipnorm": 1.0}},
    initial_scale=2.0,
  )
  params = [jnp.asarray([1.0, -1.0, 0.5], dtype)]
  state = opt.init(params)
  grads = [jnp.asarray([600.0, 0.0, -300.0], dtype)]  # a float16 norm overflows
  unscaled = opt.get_unscaled_gradients(grads, state)
  assert unscaled.tree[0].dtype == jnp.float32
  applied, _ = opt.apply_gradients(unscaled, state, params)
  updates, _ = opt.update(grads, state, params)
  np.testing.assert_array_equal(
    np.asarray(applied[0], np.float32),
    np.asarray(optax.apply_updates(params, updates)[0], np.float32),
  )
  # clipped to norm 1 in float32: the weights move by 0.1 at most
  moved = np.asarray(applied[0], np.float32) - np.asarray(params[0], np.float32)
  assert np.all(np.isfinite(moved)) and 0.05 < np.linalg.norm(moved) <= 0.1001


@pytest.mark.parametrize("accumulation", [None, 2])
def test_learning_rate_is_keras_learning_rate_after_every_step(accumulation):
  """A schedule's value at Keras' ``_iterations``: the rate the next step
  uses (it was the last step's, one step behind Keras')."""
  sched = keras.optimizers.schedules.ExponentialDecay(
    0.1, decay_steps=1, decay_rate=0.5
  )
  base = {"gradient_accumulation_steps": accumulation} if accumulation else {}
  variables = [keras.Variable(np.ones(2))]
  theirs = keras.optimizers.LossScaleOptimizer(
    keras.optimizers.SGD(sched, **base), initial_scale=1.0
  )
  theirs.build(variables)
  opt_vars, train = [v.value for v in theirs.variables], [v.value for v in variables]
  ours = ols.porting.LossScaleOptimizer(
    {"class_name": "SGD", "config": {"learning_rate": sched, **base}},
    initial_scale=1.0,
  )
  params = [jnp.ones(2)]
  state = ours.init(params)
  for _ in range(5):
    assert float(ours.learning_rate(state)) == float(
      theirs.inner_optimizer._learning_rate(opt_vars_iterations(theirs, opt_vars))
    )
    train, opt_vars = theirs.stateless_apply(opt_vars, [jnp.ones(2)], train)
    updates, state = ours.update([jnp.ones(2)], state, params)
    params = optax.apply_updates(params, updates)
  for v, x in zip(theirs.variables, opt_vars, strict=True):
    v.assign(x)
  assert float(ours.learning_rate(state)) == float(theirs.learning_rate)


def opt_vars_iterations(opt, opt_vars):
  """The inner optimizer's ``_iterations`` among a stateless run's variables."""
  (it,) = [
    x
    for v, x in zip(opt.variables, opt_vars, strict=True)
    if v is opt.inner_optimizer._iterations
  ]
  return it
