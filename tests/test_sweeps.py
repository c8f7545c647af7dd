"""Sweeps: every numeric argument at float32's edges, every leaf kind through
every public wrapper, every error message. A new case of a known class of
bug should fail here before a user meets it.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

pytestmark = pytest.mark.standard_promotion  # optax's adam

EDGES = [
  0,
  -1.0,
  float("inf"),
  float("-inf"),
  float("nan"),
  1e39,  # inf in float32
  1e-46,  # 0 in float32
  2.0**127,
  1 + 1e-9,  # 1.0 in float32
  1 - 1e-9,
  True,
  "1",
  None,
]

# (name, builder taking the argument's value), for every numeric argument.
ARGUMENTS = [
  *[
    (
      f"dynamic_loss_scale {a}",
      a,
      lambda v, a=a: ols.dynamic_loss_scale(optax.sgd(0.1), **{a: v}),
    )
    for a in (
      "initial_scale",
      "growth_interval",
      "growth_factor",
      "backoff_factor",
      "min_scale",
      "max_scale",
      "hysteresis",
    )
  ],
  (
    "static_loss_scale scale",
    "scale",
    lambda v: ols.static_loss_scale(optax.sgd(0.1), v),
  ),
  *[
    (
      f"LossScaleOptimizer {a}",
      a,
      lambda v, a=a: ols.porting.LossScaleOptimizer("sgd", **{a: v}),
    )
    for a in (
      "initial_scale",
      "dynamic_growth_steps",
      "weight_decay",
      "clipnorm",
      "clipvalue",
      "global_clipnorm",
      "ema_momentum",
      "ema_overwrite_frequency",
      "loss_scale_factor",
      "gradient_accumulation_steps",
      "min_scale",
      "max_scale",
      "hysteresis",
    )
  ],
  (
    "ema_params momentum",
    "momentum",
    lambda v: optax.chain(optax.sgd(0.1), ols.ema_params(v)),
  ),
  (
    "ema_params overwrite_frequency",
    "overwrite_frequency",
    lambda v: optax.chain(optax.sgd(0.1), ols.ema_params(0.9, overwrite_frequency=v)),
  ),
]


@pytest.mark.sampled
@pytest.mark.parametrize("value", EDGES, ids=repr)
@pytest.mark.parametrize("name, arg, build", ARGUMENTS, ids=[a[0] for a in ARGUMENTS])
def test_a_value_is_refused_by_name_or_trains_finitely(name, arg, build, value):
  """No value may build an optimizer that then applies a non-finite step.

  Except a weight decay that diverges by arithmetic (2**127 times the
  learning rate 0.01 is finite, and multiplies the weights each step).
  """
  try:
    tx = build(value)
  except ValueError as e:
    assert arg in str(e), (name, value, str(e))
    return
  params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  for g in (2.0, 3.0, 4.0):
    grads = jax.tree.map(lambda p, g=g: jnp.full_like(p, g), params)
    updates, state = step(grads, state, params)
    params = optax.apply_updates(params, updates)
  if arg == "weight_decay" and value == 2.0**127:
    return
  leaves = jax.tree.leaves((params, state))
  assert all(
    bool(jnp.all(jnp.isfinite(x)))
    for x in leaves
    if jnp.issubdtype(x.dtype, jnp.floating)
  ), (name, value)


WRAPPERS = {
  "dynamic_loss_scale": lambda inner: ols.dynamic_loss_scale(inner, initial_scale=8.0),
  "static_loss_scale": lambda inner: ols.static_loss_scale(inner, 8.0),
  "with_loss_scale(NoOp)": lambda inner: ols.porting.with_loss_scale(
    inner, ols.porting.NoOpLossScale()
  ),
  "LossScaleOptimizer": lambda inner: ols.porting.LossScaleOptimizer(
    inner, initial_scale=8.0
  ),
  "LossScaleOptimizer fixed": lambda inner: ols.porting.LossScaleOptimizer(
    inner, dynamic=False, initial_scale=8.0
  ),
  "enable_mixed_precision": lambda inner: ols.porting.enable_mixed_precision(
    jnp.sum, inner, compute_dtype=jnp.float16, initial_scale=8.0
  )[1],
}
# Wrappers that apply every step whatever the gradients (TF's fixed scale,
# a no-op scale), and the scale each divides by.
APPLIES_ALWAYS = {"with_loss_scale(NoOp)", "LossScaleOptimizer fixed"}
SCALE = {"with_loss_scale(NoOp)": 1.0}

FLOAT_LEAVES = {
  "float32": lambda v: jnp.full(3, v, jnp.float32),
  "float16": lambda v: jnp.full(3, v, jnp.float16),
  "bfloat16": lambda v: jnp.full(3, v, jnp.bfloat16),
  "numpy float32": lambda v: np.full(3, v, np.float32),
  "complex64": lambda v: jnp.full(3, v + 0j, jnp.complex64),
  "zero-size": lambda v: jnp.zeros((0, 2), jnp.float32),
}
PASSED_THROUGH = {
  "int32": jnp.array([3, 4], jnp.int32),
  "bool": jnp.array([True, False]),
  "float0": np.zeros((2,), dtype=jax.dtypes.float0),
  "None": None,
}
REFUSED = {
  "python float": 8.0,
  "python int": 8,
  "string": "x",
  "python nan": float("nan"),
}


@pytest.mark.sampled
@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("kind", FLOAT_LEAVES)
def test_every_float_leaf_kind_is_unscaled_and_checked(wrapper, kind):
  tx = WRAPPERS[wrapper](optax.sgd(1.0))
  scale = SCALE.get(wrapper, 8.0)
  make = FLOAT_LEAVES[kind]
  params = {"leaf": jnp.asarray(make(0.0)), "w": jnp.zeros(2)}
  state = tx.init(params)
  grads = {"leaf": make(2.0 * scale), "w": jnp.full(2, 2.0 * scale)}
  updates, state = tx.update(grads, state, params)
  assert updates["leaf"].dtype == jnp.asarray(grads["leaf"]).dtype
  np.testing.assert_allclose(np.asarray(updates["leaf"], np.complex64), -2.0)
  grads["leaf"] = make(float("nan"))
  updates, state = tx.update(grads, state, params)
  skipped = int(ols.diagnostics(state)["last_step_skipped"])
  if kind == "zero-size":
    assert not skipped  # nothing in it to be non-finite
  elif wrapper in APPLIES_ALWAYS:
    assert not skipped
  else:
    assert skipped and not np.any(np.asarray(updates["w"])), (wrapper, kind)


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("kind", PASSED_THROUGH)
def test_non_float_leaves_pass_through(wrapper, kind):
  tx = WRAPPERS[wrapper](optax.identity())
  leaf = PASSED_THROUGH[kind]
  params = {"leaf": leaf, "w": jnp.zeros(2)}
  state = tx.init(params)
  grads = {"leaf": leaf, "w": jnp.full(2, 16.0)}
  updates, state = tx.update(grads, state, params)
  if leaf is None:
    assert updates["leaf"] is None
  else:
    assert updates["leaf"].dtype == leaf.dtype and updates["leaf"].shape == leaf.shape
  scale = SCALE.get(wrapper, 8.0)
  np.testing.assert_allclose(updates["w"], 16.0 / scale)


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("kind", REFUSED)
def test_leaves_that_are_not_arrays_are_refused_by_every_wrapper(wrapper, kind):
  tx = WRAPPERS[wrapper](optax.sgd(1.0))
  params = {"leaf": jnp.zeros(()), "w": jnp.zeros(2)}
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"\['leaf'\].*not an array"):
    tx.update({"leaf": REFUSED[kind], "w": jnp.ones(2)}, state, params)


# Every error a user can meet, and what it must tell them.
MISTAKES = [
  lambda: ols.dynamic_loss_scale(optax.sgd(1.0), backoff_factor=1 - 1e-9),
  lambda: ols.dynamic_loss_scale(optax.sgd(1.0), initial_scale=0.0),
  lambda: ols.porting.DynamicLossScale(initial_scale=1.0, initial_loss_scale=2.0),
  lambda: ols.porting.LossScaleOptimizer("sgd", dynamic=False, hysteresis=3),
  lambda: ols.porting.LossScaleOptimizer("nope"),
  lambda: ols.porting.LossScaleOptimizer(
    {"class_name": "sgd", "config": {"learning_rate": None}}
  ),
  lambda: ols.dynamic_loss_scale(ols.dynamic_loss_scale(optax.sgd(1.0))).init(
    jnp.ones(2)
  ),
  lambda: ols.get_scale(optax.sgd(1.0).init(jnp.ones(2))),
  lambda: ols.value_and_grad(jnp.sum)(
    jnp.ones(2), ols.dynamic_loss_scale(optax.sgd(1.0)).init(jnp.ones(2))
  ),
  lambda: ols.dynamic_loss_scale(optax.sgd(1.0)).update(
    {"w": 1.0}, ols.dynamic_loss_scale(optax.sgd(1.0)).init({"w": jnp.ones(())})
  ),
  lambda: ols.dynamic_loss_scale(optax.adam(1.0)).update(
    jnp.ones(2), ols.dynamic_loss_scale(optax.sgd(1.0)).init(jnp.ones(2)), jnp.ones(2)
  ),
  lambda: ols.check_skipped_steps({}, max_consecutive_skips=0),
  lambda: ols.autocast(jnp.sum, compute_dtype=jnp.float32),
  lambda: ols.Policy.from_string("params=float33"),
]
WHAT_TO_DO = re.compile(
  r"\b(must|Pass|pass|Give|give|Wrap|wrap|Make|make|Drop|Build|use|call|expected|known|Restore)\b"
)


@pytest.mark.parametrize("mistake", range(len(MISTAKES)))
def test_every_error_says_what_to_do(mistake):
  with pytest.raises(ValueError) as e:
    MISTAKES[mistake]()
  assert WHAT_TO_DO.search(str(e.value)), str(e.value)
