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
