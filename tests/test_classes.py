"""Classes of mistakes, swept over every entry point rather than one case at a time.

Axes, each a table:

* **dtype and backend arguments** (every constructor that takes one):
  the documented spellings parse to what the documentation says (``f16``
  is float16, ``half`` the backend's), anything else (``None``, NumPy's
  codes such as ``"f16"`` for float128, Python's ``float``, integers,
  float8 where a 16-bit dtype is needed) is a ``ValueError`` naming the
  argument;
* **the precision of the leaf** (every function that unscales, clips or
  scales): a float64 leaf under ``jax_enable_x64`` is computed in float64,
  to float64's last bit against NumPy, never through a float32 reciprocal;
* **a gradient missing for a parameter** (every loss-scaled
  transformation, with ``params`` given and without): a ``ValueError``
  that names the leaf and says what to do, not one that blames the
  optimizer state.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_sweeps import WRAPPERS

import optax_lossscale as ols

pytestmark = pytest.mark.standard_promotion  # optax's code

F16, BF16, F32, F64 = (
  jnp.dtype(d) for d in ("float16", "bfloat16", "float32", "float64")
)
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)


@contextlib.contextmanager
def x64():
  """float64 on, for the block (JAX's context manager, old or new)."""
  enable = getattr(jax, "enable_x64", None)
  if enable is not None:
    with enable(True):
      yield
  else:  # jax < 0.6
    from jax.experimental import enable_x64

    with enable_x64():
      yield


# --------------------------------------------------------------------------
# dtype and backend arguments: one parser, documented spellings only.
# --------------------------------------------------------------------------

DTYPE_ARGUMENTS = {
  "Policy compute_dtype": lambda v: ols.Policy(compute_dtype=v).compute_dtype,
  "Policy param_dtype": lambda v: ols.Policy(param_dtype=v).param_dtype,
  "Policy.from_string": lambda v: ols.Policy.from_string(f"c={v}").compute_dtype,
  "autocast compute_dtype": lambda v: (
    ols.autocast(jnp.sum, compute_dtype=v).compute_dtype
  ),
  "enable_mixed_precision compute_dtype": lambda v: (
    ols.enable_mixed_precision(jnp.sum, optax.sgd(1.0), compute_dtype=v)[
      0
    ].compute_dtype
  ),
  "Float8Matmul forward_dtype": lambda v: (
    ols.Float8Matmul(forward_dtype=v).forward_dtype
  ),
}
# value: {argument: what it gives (a dtype) or an error fragment}
HALF_ONLY = ("autocast compute_dtype", "enable_mixed_precision compute_dtype")
DTYPE_CASES = [
  ("f16", {"Float8Matmul forward_dtype": "must be one of"}, F16),
  ("F16", {"Float8Matmul forward_dtype": "must be one of"}, F16),
  ("float16", {"Float8Matmul forward_dtype": "must be one of"}, F16),
  (jnp.float16, {"Float8Matmul forward_dtype": "must be one of"}, F16),
  (np.dtype("float16"), {"Float8Matmul forward_dtype": "must be one of"}, F16),
  ("bf16", {"Float8Matmul forward_dtype": "must be one of"}, BF16),
  (jnp.bfloat16, {"Float8Matmul forward_dtype": "must be one of"}, BF16),
  (
    "f32",
    {a: "must be one of" for a in (*HALF_ONLY, "Float8Matmul forward_dtype")},
    F32,
  ),
  # autocast's documented default: the backend's half dtype (a CPU's here).
  (None, {a: ols.default_half_dtype() for a in HALF_ONLY}, "must be a dtype such"),
  (float, {}, "must be a dtype such as jnp.float16"),
  (int, {}, "must be a dtype such as jnp.float16"),
  (3.0, {}, "must be a dtype such as jnp.float16"),
  ("f2", {}, "unknown dtype name 'f2'"),
  ("<f2", {}, "unknown dtype name '<f2'"),
  ("e", {}, "unknown dtype name 'e'"),
  ("float128", {}, "unknown dtype name 'float128'"),
  ("f8", {}, "unknown dtype name 'f8'"),
  (np.dtype("int32"), {}, "must be a floating dtype"),
  (
    jnp.float64,
    {a: "must be one of" for a in (*HALF_ONLY, "Float8Matmul forward_dtype")},
    "jax_enable_x64 is off",
  ),
  (E4M3, {"Float8Matmul forward_dtype": E4M3}, "matmul='float8'"),
  (E5M2, {"Float8Matmul forward_dtype": E5M2}, "matmul='float8'"),
]
# Policy.from_string reads text only: a dtype object there is not a string.
NOT_TEXT = {"Policy.from_string"}


@pytest.mark.parametrize("argument", DTYPE_ARGUMENTS)
@pytest.mark.parametrize(
  "value, special, default", DTYPE_CASES, ids=[repr(c[0]) for c in DTYPE_CASES]
)
def test_a_dtype_argument_takes_the_documented_spellings_only(
  argument, value, special, default
):
  if argument in NOT_TEXT and not isinstance(value, str):
    pytest.skip("a policy string holds text")
  want = special.get(argument, default)
  if isinstance(want, str):
    name = argument.split()[-1]
    with pytest.raises(ValueError) as e:
      DTYPE_ARGUMENTS[argument](value)
    message = str(e.value)
    assert want in message, message
    if argument not in NOT_TEXT and not want.startswith("unknown"):
      assert name in message, message
  else:
    assert DTYPE_ARGUMENTS[argument](value) == want


def test_half_is_the_backends_half_dtype():
  assert ols.Policy.from_string("c=half", backend="gpu").compute_dtype == F16
  assert ols.Policy.from_string("c=half", backend="tpu").compute_dtype == BF16
  assert ols.default_half_dtype("CUDA") == F16
  for bad in ("metal", "", 3, "gpu0"):
    with pytest.raises(ValueError, match="`backend` must be None"):
      ols.default_half_dtype(bad)


def test_float64_is_accepted_where_x64_is_on():
  with x64():
    assert ols.Policy(param_dtype="f64").param_dtype == F64
    assert ols.Policy.from_string("double").output_dtype == F64


# --------------------------------------------------------------------------
# float64 leaves: computed in float64.
# --------------------------------------------------------------------------

SCALE = 1000.0  # its float32 reciprocal is off by 4.7e-8 relative
VALUES = np.array([1.2345678901234567, -3.0e-7, 7.0, 0.1], np.float64)


def _updates(tx, grads, params):
  state = tx.init(params)
  return tx.update(grads, state, params)[0]["w"]


ENTRY_POINTS = {
  "unscale": lambda g: ols.unscale({"w": g}, SCALE)["w"],
  "static_loss_scale": lambda g: (
    -_updates(
      ols.static_loss_scale(optax.sgd(1.0), SCALE), {"w": g}, {"w": jnp.zeros_like(g)}
    )
  ),
  "dynamic_loss_scale": lambda g: (
    -_updates(
      ols.dynamic_loss_scale(optax.sgd(1.0), initial_scale=SCALE),
      {"w": g},
      {"w": jnp.zeros_like(g)},
    )
  ),
  "LossScaleOptimizer": lambda g: (
    -_updates(
      ols.LossScaleOptimizer(optax.sgd(1.0), initial_scale=SCALE),
      {"w": g},
      {"w": jnp.zeros_like(g)},
    )
  ),
  "LossScaleOptimizer.get_unscaled_gradients": lambda g: (
    lambda opt: opt.get_unscaled_gradients({"w": g}, opt.init({"w": jnp.zeros_like(g)}))
  )(ols.LossScaleOptimizer(optax.sgd(1.0), initial_scale=SCALE))["w"],
  "loss_scale_factor": lambda g: (
    lambda opt: opt.get_unscaled_gradients({"w": g}, opt.init({"w": jnp.zeros_like(g)}))
  )(ols.LossScaleOptimizer(optax.sgd(1.0), initial_scale=1.0, loss_scale_factor=SCALE))[
    "w"
  ],
  "DynamicLossScale.unscale": lambda g: ols.DynamicLossScale(SCALE).unscale({"w": g})[
    "w"
  ],
  "DynamicLossScale.unscale_and_update": lambda g: ols.DynamicLossScale(
    SCALE
  ).unscale_and_update({"w": g})[0]["w"],
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_float64_gradient_is_unscaled_in_float64(entry):
  with x64():
    g = jnp.asarray(VALUES * SCALE, jnp.float64)
    got = ENTRY_POINTS[entry](g)
    assert got.dtype == F64, entry
    want = (VALUES * SCALE) * (1.0 / SCALE)  # NumPy, float64 throughout
    np.testing.assert_allclose(np.asarray(got), want, rtol=2**-52, atol=0)


def test_clipnorm_of_a_float64_gradient_is_in_float64():
  with x64():
    opt = ols.LossScaleOptimizer(optax.sgd(1.0), initial_scale=1.0, clipnorm=1.0)
    g = jnp.asarray(VALUES, jnp.float64)
    got = -_updates(opt, {"w": g}, {"w": jnp.zeros_like(g)})
    want = VALUES / np.sqrt(np.sum(VALUES**2))
    assert got.dtype == F64
    np.testing.assert_allclose(np.asarray(got), want, rtol=4 * 2**-52)


def test_a_float64_loss_is_scaled_in_float64():
  with x64():
    tx = ols.dynamic_loss_scale(optax.sgd(1.0), initial_scale=SCALE)
    state = tx.init({"w": jnp.zeros(2, jnp.float64)})
    loss = jnp.asarray(1.2345678901234567, jnp.float64)
    got = ols.scale_loss(loss, state)
    assert got.dtype == F64 and float(got) == 1.2345678901234567 * SCALE


# --------------------------------------------------------------------------
# A gradient missing for a parameter.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("with_params", [True, False], ids=["params", "no params"])
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_none_gradient_for_a_parameter_is_named(wrapper, with_params):
  tx = WRAPPERS[wrapper](optax.adam(1e-3))
  params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
  state = tx.init(params)
  grads = {"w": jnp.ones(3), "b": None}
  with pytest.raises(ValueError) as e:
    tx.update(grads, state, params if with_params else None)
  message = str(e.value)
  assert "['b']" in message and "None" in message, message
  assert "another optimizer" not in message, message  # not the state's fault


def test_a_none_gradient_that_the_inner_optimizer_takes_is_handled_exactly():
  # optax's sgd leaves a None gradient's parameter alone: so does the scale.
  tx = ols.dynamic_loss_scale(optax.sgd(1.0), initial_scale=4.0)
  params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
  updates, state = tx.update(
    {"w": jnp.full(3, 8.0), "b": None}, tx.init(params), params
  )
  assert updates["b"] is None
  np.testing.assert_array_equal(updates["w"], -2.0)
  assert int(ols.diagnostics(state)["good_steps"]) == 1
