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

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import versions
from test_sweeps import WRAPPERS

import optax_lossscale as ols

pytestmark = pytest.mark.standard_promotion  # optax's code

F16, BF16, F32, F64 = (
  jnp.dtype(d) for d in ("float16", "bfloat16", "float32", "float64")
)
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)


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
    ols.porting.enable_mixed_precision(jnp.sum, optax.sgd(1.0), compute_dtype=v)[
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
  # a float8 dtype by its name, where one is allowed (it was refused with
  # a list of names none of which was)
  (
    "float8_e4m3fn",
    {"Float8Matmul forward_dtype": E4M3},
    "unknown dtype name 'float8_e4m3fn'",
  ),
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
    # the argument named (the policy string's field for its part)
    name = "compute_dtype" if argument in NOT_TEXT else argument.split()[-1]
    with pytest.raises(ValueError) as e:
      DTYPE_ARGUMENTS[argument](value)
    message = str(e.value)
    assert want in message, message
    assert f"`{name}`" in message, message
    float8 = any(value is d for d in (E4M3, E5M2)) or "float8" in str(value)
    if not float8 and "Float8" not in argument:
      assert "float8" not in message, message  # float8's hint, for float8 only
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
  with versions.x64():
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
      ols.porting.LossScaleOptimizer(optax.sgd(1.0), initial_scale=SCALE),
      {"w": g},
      {"w": jnp.zeros_like(g)},
    )
  ),
  "LossScaleOptimizer.get_unscaled_gradients": lambda g: (
    lambda opt: opt.get_unscaled_gradients({"w": g}, opt.init({"w": jnp.zeros_like(g)}))
  )(ols.porting.LossScaleOptimizer(optax.sgd(1.0), initial_scale=SCALE))["w"],
  "loss_scale_factor": lambda g: (
    lambda opt: opt.get_unscaled_gradients({"w": g}, opt.init({"w": jnp.zeros_like(g)}))
  )(
    ols.porting.LossScaleOptimizer(
      optax.sgd(1.0), initial_scale=1.0, loss_scale_factor=SCALE
    )
  )["w"],
  "DynamicLossScale.unscale": lambda g: ols.porting.DynamicLossScale(SCALE).unscale(
    {"w": g}
  )["w"],
  "DynamicLossScale.unscale_and_update": lambda g: ols.porting.DynamicLossScale(
    SCALE
  ).unscale_and_update({"w": g})[0]["w"],
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_float64_gradient_is_unscaled_in_float64(entry):
  with versions.x64():
    g = jnp.asarray(VALUES * SCALE, jnp.float64)
    got = ENTRY_POINTS[entry](g)
    assert got.dtype == F64, entry
    want = (VALUES * SCALE) * (1.0 / SCALE)  # NumPy, float64 throughout
    np.testing.assert_allclose(np.asarray(got), want, rtol=2**-52, atol=0)


@pytest.mark.parametrize("bad", [None, np.nan, np.inf])
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_numpy_float64_gradient_is_what_jax_makes_of_it(entry, bad):
  """x64 off: a NumPy float64 gradient gives what its float32 JAX array
  gives, eagerly, with no warning (a NaN step was once applied)."""
  g = VALUES * SCALE
  if bad is not None:
    g = g.copy()
    g[1] = bad
  got, want = ENTRY_POINTS[entry](g), ENTRY_POINTS[entry](jnp.asarray(g))
  assert got.dtype == want.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_clipnorm_of_a_float64_gradient_is_in_float64():
  with versions.x64():
    opt = ols.porting.LossScaleOptimizer(
      optax.sgd(1.0), initial_scale=1.0, clipnorm=1.0
    )
    g = jnp.asarray(VALUES, jnp.float64)
    got = -_updates(opt, {"w": g}, {"w": jnp.zeros_like(g)})
    want = VALUES / np.sqrt(np.sum(VALUES**2))
    assert got.dtype == F64
    np.testing.assert_allclose(np.asarray(got), want, rtol=4 * 2**-52)


def test_a_float64_loss_is_scaled_in_float64():
  with versions.x64():
    tx = ols.dynamic_loss_scale(optax.sgd(1.0), initial_scale=SCALE)
    state = tx.init({"w": jnp.zeros(2, jnp.float64)})
    loss = jnp.asarray(1.2345678901234567, jnp.float64)
    got = ols.scale_loss(loss, state)
    assert got.dtype == F64 and float(got) == 1.2345678901234567 * SCALE


# --------------------------------------------------------------------------
# A gradient missing for a parameter.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["a leaf", "a subtree"])
@pytest.mark.parametrize("with_params", [True, False], ids=["params", "no params"])
@pytest.mark.parametrize("wrapper", WRAPPERS)
@versions.adam_refuses_none
def test_a_none_gradient_for_a_parameter_is_named(wrapper, with_params, missing):
  b = jnp.zeros(2) if missing == "a leaf" else {"x": jnp.zeros(2), "y": jnp.ones(1)}
  params = {"w": jnp.ones(3), "b": b}
  grads = {"w": jnp.ones(3), "b": None}
  tx = WRAPPERS[wrapper](optax.adam(1e-3))
  state = tx.init(params)
  with pytest.raises(ValueError) as e:
    tx.update(grads, state, params if with_params else None)
  message = str(e.value)
  # the library's own message, naming the leaf (not a pytree error about it)
  named = ("The gradient at ['b'] is None", "The gradients hold None at ['b']")
  assert message.startswith(named), message
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


# --------------------------------------------------------------------------
# Leaf kinds through every public function that takes a tree.
# --------------------------------------------------------------------------

SCALE_8 = 8.0
LEAF_KINDS = {
  # kind: (make the leaf from float64 values, its dtype when floating)
  "float16": (lambda v: jnp.asarray(v, jnp.float16), F16),
  "bfloat16": (lambda v: jnp.asarray(v, jnp.bfloat16), BF16),
  "float32": (lambda v: jnp.asarray(v, jnp.float32), F32),
  "float64": (lambda v: jnp.asarray(v, jnp.float64), F64),
  "numpy float32": (lambda v: np.asarray(v, np.float32), F32),
  "zero-size": (lambda v: jnp.zeros((0,), jnp.float32), F32),
  "int32": (lambda v: jnp.asarray(np.round(v), jnp.int32), None),
  "None": (lambda v: None, None),
  "python float": (lambda v: float(v[0]), "refused"),
}
GRAD = np.array([16.0, -24.0, 0.5])  # multiples of 8: exact in every dtype


def _reference_unscaled(kind, leaf):
  """What an unscale by 8 must give, computed in NumPy at the leaf's precision."""
  _, dtype = LEAF_KINDS[kind]
  if dtype is None:
    return leaf  # passed through
  values = np.asarray(leaf, np.float64)
  wide = np.float64 if dtype == F64 else np.float32
  return (values.astype(wide) * (1 / wide(SCALE_8))).astype(dtype)


def _updates_of(tx):
  def run(leaf):
    params = {"leaf": leaf, "w": jnp.zeros(2)}
    state = tx.init(params)
    return tx.update({"leaf": leaf, "w": jnp.full(2, 16.0)}, state, params)[0]["leaf"]

  return run


def _keras_unscaled(opt, leaf):
  """``leaf`` unscaled by a Keras optimizer's ``get_unscaled_gradients``,
  its parameter the leaf (its real part: Keras' variables are real)."""
  param = jnp.real(leaf) if jnp.iscomplexobj(leaf) else leaf
  return opt.get_unscaled_gradients({"leaf": leaf}, opt.init({"leaf": param}))["leaf"]


#: Public entry points that unscale a tree, each ``leaf -> unscaled leaf``.
UNSCALERS = {
  "unscale": lambda leaf: ols.unscale({"leaf": leaf}, SCALE_8)["leaf"],
  "dynamic_loss_scale(identity)": _updates_of(
    ols.dynamic_loss_scale(optax.identity(), initial_scale=SCALE_8)
  ),
  "static_loss_scale(identity)": _updates_of(
    ols.static_loss_scale(optax.identity(), SCALE_8)
  ),
  "LossScaleOptimizer.get_unscaled_gradients": lambda leaf: _keras_unscaled(
    ols.porting.LossScaleOptimizer("sgd", initial_scale=SCALE_8), leaf
  ),
  "LossScaleOptimizer.get_unscaled_gradients, tf_keras": lambda leaf: _keras_unscaled(
    ols.porting.LossScaleOptimizer("sgd", initial_scale=SCALE_8, legacy_keras=True),
    leaf,
  ),
  "DynamicLossScale.unscale": lambda leaf: ols.porting.DynamicLossScale(
    SCALE_8
  ).unscale({"leaf": leaf})["leaf"],
  "DynamicLossScale.unscale_and_update": lambda leaf: ols.porting.DynamicLossScale(
    SCALE_8
  ).unscale_and_update({"leaf": leaf})[0]["leaf"],
}


#: Keras 3's formulas keep a half gradient float32 once divided (and clip
#: and accumulate it so), as Keras 3's ``ops.divide`` does.
WIDENS_HALF = {"LossScaleOptimizer.get_unscaled_gradients"}


@pytest.mark.sampled
@pytest.mark.parametrize("entry", UNSCALERS)
@pytest.mark.parametrize("kind", LEAF_KINDS)
def test_every_leaf_kind_is_unscaled_exactly_or_refused_by_name(entry, kind):
  make, dtype = LEAF_KINDS[kind]
  with versions.x64():
    leaf = make(GRAD * SCALE_8)
    if dtype == "refused":
      with pytest.raises(ValueError, match=r"\['leaf'\].*not an array"):
        UNSCALERS[entry](leaf)
      return
    got = UNSCALERS[entry](leaf)
    if leaf is None:
      assert got is None
      return
    want = _reference_unscaled(kind, leaf)
    if entry in WIDENS_HALF and dtype in (F16, BF16):
      want = want.astype(np.float32)  # Keras 3's ops.divide by a float32 scale
    assert jnp.asarray(got).dtype == want.dtype, (entry, kind)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _complex(real, imag, dtype):
  """A complex array of these parts (``real + 1j * imag`` would make NaN of
  ``0 * inf``)."""
  out = np.empty(len(real), dtype)
  out.real, out.imag = real, imag
  return out


#: Complex gradients' (real parts, imaginary parts), unscaled.
COMPLEX_CASES = {
  "finite": ([2.0, -3.0], [0.0, 0.0625]),
  "inf in one part": ([np.inf, 2.0], [0.0, -np.inf]),
  "NaN in one part": ([np.nan, 2.0], [1.0, np.nan]),
  "NaN and inf": ([np.nan, -np.inf], [np.inf, 0.0]),
}
#: Entry points that skip a non-finite step (their updates are then zero).
SKIPPING = {"dynamic_loss_scale(identity)", "static_loss_scale(identity)"}


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
@pytest.mark.parametrize("case", COMPLEX_CASES)
@pytest.mark.parametrize("entry", UNSCALERS)
def test_a_complex_gradient_is_unscaled_part_by_part(entry, case, dtype):
  """Each part divided by the scale: a complex product with ``1/8 + 0j``
  would turn an infinite part's partner into NaN (``inf * 0``)."""
  real, imag = (np.asarray(p) for p in COMPLEX_CASES[case])
  with versions.x64():
    got = UNSCALERS[entry](jnp.asarray(_complex(real * SCALE_8, imag * SCALE_8, dtype)))
  want = _complex(real, imag, dtype)  # exact: powers of two
  if entry in SKIPPING and case != "finite":
    want = np.zeros_like(want)  # skipped
  assert got.dtype == dtype, (entry, case)
  np.testing.assert_array_equal(np.real(got), want.real)
  np.testing.assert_array_equal(np.imag(got), want.imag)


#: Public entry points that check a tree, each ``leaf -> bool``.
CHECKERS = {
  "all_finite": lambda leaf: bool(ols.all_finite({"leaf": leaf})),
  "check_checkpoint": lambda leaf: ols.check_checkpoint({"leaf": leaf}) is not None,
  "LossScaleOptimizer.check_finite": lambda leaf: bool(
    ols.porting.LossScaleOptimizer.check_finite({"leaf": leaf})
  ),
  "DynamicLossScale.update": lambda leaf: bool(
    ols.porting.DynamicLossScale(SCALE_8).update({"leaf": leaf})[1]
  ),
}


@pytest.mark.parametrize("entry", CHECKERS)
@pytest.mark.parametrize("kind", LEAF_KINDS)
def test_every_leaf_kind_is_checked_or_refused_by_name(entry, kind):
  make, dtype = LEAF_KINDS[kind]
  with versions.x64():
    if dtype == "refused":
      if entry == "check_checkpoint":  # a saved step counter: not checked
        assert CHECKERS[entry](make(GRAD))
        return
      with pytest.raises(ValueError, match=r"\['leaf'\].*not an array"):
        CHECKERS[entry](make(GRAD))
      return
    assert CHECKERS[entry](make(GRAD)) is True
    if dtype not in (None,) and kind != "zero-size":
      bad = make(np.array([1.0, np.nan, 2.0]))
      if entry == "check_checkpoint":
        with pytest.raises(ValueError, match=r"\['leaf'\]: 1 NaN"):
          CHECKERS[entry](bad)
      else:
        assert CHECKERS[entry](bad) is False, (entry, kind)


@pytest.mark.parametrize("kind", ["float16", "bfloat16", "float32", "float64"])
def test_every_float_kind_of_loss_is_scaled_at_least_in_float32(kind):
  make, dtype = LEAF_KINDS[kind]
  with versions.x64():
    state = ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=SCALE_8).init(
      jnp.zeros(2)
    )
    loss = make(np.array(3.0)).reshape(())
    got = ols.scale_loss(loss, state)
    assert got.dtype == (F64 if dtype == F64 else F32)
    assert float(got) == 24.0


# --------------------------------------------------------------------------
# States not made by this configuration.
# --------------------------------------------------------------------------

PARAMS = {"w": jnp.ones(3)}
GRADS = {"w": jnp.full(3, 2.0)}
MAKERS = {
  "dynamic 2**20": lambda: ols.dynamic_loss_scale(
    optax.sgd(0.1), initial_scale=2.0**20
  ),
  "dynamic, max 2**16": lambda: ols.dynamic_loss_scale(
    optax.sgd(0.1), max_scale=2.0**16
  ),
  "static 4": lambda: ols.static_loss_scale(optax.sgd(0.1), 4.0),
  "dynamic, record": lambda: ols.dynamic_loss_scale(
    optax.sgd(0.1), track_nonfinite=True
  ),
  "dynamic(adam)": lambda: ols.dynamic_loss_scale(optax.adam(0.1)),
  "LossScaleOptimizer(sgd)": lambda: ols.porting.LossScaleOptimizer("sgd"),
  "dynamic(MultiSteps)": lambda: ols.dynamic_loss_scale(
    optax.MultiSteps(optax.sgd(0.1), 2)
  ),
}
# (made by, loaded into): what the first update does (a callable checking the
# new state), or an error fragment that says what to do.
FOREIGN = [
  ("dynamic 2**20", "dynamic, max 2**16", lambda s: float(s.loss_scale) == 2.0**16),
  ("dynamic 2**20", "static 4", lambda s: float(s.loss_scale) == 4.0),
  ("static 4", "dynamic 2**20", lambda s: float(s.loss_scale) == 4.0),
  ("dynamic, record", "dynamic 2**20", lambda s: int(s.nonfinite.steps) == 0),
  ("dynamic 2**20", "dynamic, record", "holds no non-finite record"),
  ("dynamic(adam)", "dynamic 2**20", "not made by this loss scale's inner optimizer"),
  ("dynamic 2**20", "dynamic(adam)", "not made by this loss scale's inner optimizer"),
  ("LossScaleOptimizer(sgd)", "dynamic 2**20", "not made by this loss scale's inner"),
  ("dynamic(MultiSteps)", "dynamic 2**20", "not made by this loss scale's inner"),
]


@pytest.mark.parametrize(
  "made_by, loaded_into, expect", FOREIGN, ids=[f"{a} -> {b}" for a, b, _ in FOREIGN]
)
def test_a_state_from_another_configuration_comes_into_line_or_is_refused(
  made_by, loaded_into, expect
):
  saved = MAKERS[made_by]().init(PARAMS)
  # As Orbax restores it: the same pytree, into the other optimizer.
  tx = MAKERS[loaded_into]()
  if isinstance(expect, str):
    with pytest.raises(ValueError, match=expect) as e:
      jax.jit(tx.update)(GRADS, saved, PARAMS)
    assert "another optimizer" in str(e.value) or "init" in str(e.value)
  else:
    _, state = jax.jit(tx.update)(GRADS, saved, PARAMS)
    assert expect(state)


def test_a_loss_scale_object_of_the_earlier_layout_unflattens():
  # Earlier versions flattened a LossScale object into its five counters.
  ls = ols.porting.DynamicLossScale(2.0**7, growth_interval=3)
  counters = [getattr(ls.counters, f) for f in ols.LossScaleState._fields[:5]]
  old = type(ls).tree_unflatten(ls.config, counters)
  assert old.config == ls.config and float(old()) == 2.0**7
  assert jax.tree.leaves(old) == jax.tree.leaves(ls)
  with pytest.raises(ValueError, match="one child"):
    type(ls).tree_unflatten(ls.config, counters[:3])


# --------------------------------------------------------------------------
# The ways a program is set up: which modules, in which order.
# --------------------------------------------------------------------------

IMPORT_ORDERS = {
  "record made before flax.serialization is imported": """
import jax.numpy as jnp, optax, optax_lossscale as ols
tx = ols.dynamic_loss_scale(optax.sgd(0.1), track_nonfinite=True)
state = tx.init({"w": jnp.ones(2)})
from flax import serialization
restored = serialization.from_bytes(state, serialization.to_bytes(state))
assert type(restored.nonfinite).__name__ == "NonFiniteRecord"
""",
  "a record made without importing Flax": """
import sys
import jax.numpy as jnp, optax, optax_lossscale as ols
tx = ols.dynamic_loss_scale(optax.sgd(0.1), track_nonfinite=True)
state = tx.init({"w": jnp.ones(2)})
assert "flax" not in sys.modules, "the record imported Flax"
import flax.serialization as serialization  # Flax loaded later: registered then
restored = serialization.from_bytes(state, serialization.to_bytes(state))
assert type(restored.nonfinite).__name__ == "NonFiniteRecord"
""",
  "an 8-bit state made without importing Flax": """
import sys
import jax, jax.numpy as jnp, numpy as np, optax, optax_lossscale as ols
params = {"w": jnp.linspace(-1.0, 1.0, 4096).reshape(16, 256)}
for layout in ("leaf", "flat"):
  tx = ols.quantize_state(optax.adam(1e-3), layout=layout)
  state = tx.update(params, tx.init(params), params)[1]
  assert "flax" not in sys.modules, "the 8-bit state imported Flax"
import flax.serialization as serialization  # Flax loaded later: registered then
for layout in ("leaf", "flat"):
  tx = ols.quantize_state(optax.adam(1e-3), layout=layout)
  state = tx.update(params, tx.init(params), params)[1]
  restored = serialization.from_bytes(tx.init(params), serialization.to_bytes(state))
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
""",
  "flax.serialization first": """
from flax import serialization
import jax.numpy as jnp, optax, optax_lossscale as ols
tx = ols.dynamic_loss_scale(optax.sgd(0.1), track_nonfinite=True)
state = tx.init({"w": jnp.ones(2)})
restored = serialization.from_bytes(state, serialization.to_bytes(state))
assert restored.nonfinite is not None
""",
  "the porting package first": """
import optax_lossscale.porting as porting
import jax.numpy as jnp, optax, optax_lossscale as ols
ls = porting.DynamicLossScale(8.0)
assert float(ols.get_scale(ls)) == 8.0
assert porting.LossScaleOptimizer is ols.porting.LossScaleOptimizer
""",
  "a private porting module first": """
from optax_lossscale.porting import _keras
import optax_lossscale as ols
assert _keras.LossScaleOptimizer is ols.porting.LossScaleOptimizer
""",
  "the Flax helpers first": """
import optax_lossscale.flax as olf
import optax_lossscale as ols
assert olf.LossScaleTrainState.create is not None and ols.get_scale is not None
""",
  "the guard and autocast alone": """
from optax_lossscale._loss_scale import guard
from optax_lossscale._autocast import transform
import jax.numpy as jnp
guard.check_checkpoint({"w": jnp.ones(2)})
fast = transform.autocast(jnp.sum, compute_dtype=jnp.float16)
assert float(fast(jnp.ones(3))) == 3.0
""",
}


@pytest.mark.integration
@pytest.mark.parametrize("order", IMPORT_ORDERS)
def test_every_import_order_works(order):
  import subprocess
  import sys

  pytest.importorskip("flax")
  result = subprocess.run(
    [sys.executable, "-c", IMPORT_ORDERS[order]],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-3000:]


# --------------------------------------------------------------------------
# a state as a serializer or a user's conversion gives it back: the same state.
# --------------------------------------------------------------------------

#: Every transformation whose update checks its (inner) state against what
#: ``init`` makes, and optax's own for reference.
LISTED = {
  "optax.adamw": lambda: optax.adamw(1e-3),
  "dynamic_loss_scale": lambda: ols.dynamic_loss_scale(optax.adamw(1e-3)),
  "static_loss_scale": lambda: ols.static_loss_scale(optax.adamw(1e-3), 2.0),
  "dynamic_loss_scale, tracked": lambda: ols.dynamic_loss_scale(
    optax.adamw(1e-3), track_nonfinite=True
  ),
  "master_weights": lambda: ols.master_weights(optax.adamw(1e-3)),
  "quantize_state": lambda: ols.quantize_state(optax.adamw(1e-3)),
  "quantize_state, flat": lambda: ols.quantize_state(optax.adamw(1e-3), layout="flat"),
  "quantize_state(inject_hyperparams)": lambda: ols.quantize_state(
    optax.inject_hyperparams(optax.adamw, hyperparam_dtype=jnp.float32)(1e-3)
  ),
  "adam_8bit": lambda: ols.adam_8bit(1e-3),
  "all three": lambda: ols.dynamic_loss_scale(
    ols.master_weights(ols.quantize_state(optax.adamw(1e-3)))
  ),
  "all three, flat": lambda: ols.dynamic_loss_scale(
    ols.master_weights(ols.quantize_state(optax.adamw(1e-3), layout="flat"))
  ),
  "LossScaleOptimizer('adam')": lambda: ols.porting.LossScaleOptimizer("adam"),
  "LossScaleOptimizer('adam', tf_keras)": lambda: ols.porting.LossScaleOptimizer(
    "adam", legacy_keras=True
  ),
}


def _as_lists(tree):
  """``tree`` with every plain tuple a list, as a serializer may give it back."""
  if type(tree) is tuple:
    return [_as_lists(x) for x in tree]
  if isinstance(tree, tuple):  # a NamedTuple keeps its type
    return type(tree)(*map(_as_lists, tree))
  if isinstance(tree, dict):
    return {k: _as_lists(v) for k, v in tree.items()}
  return tree


def _scalars_as(convert):
  """A state's 0-d arrays as ``convert`` gives them: Python numbers
  (``x.item()``), or weakly typed arrays of them (``jnp.asarray``)."""
  return lambda tree: jax.tree.map(
    lambda x: convert(x.item()) if np.ndim(x) == 0 else x, tree
  )


#: State origins whose leaves are the state init made, in other containers
#: or as other kinds of scalar.
ORIGINS = {
  "tuples as lists": _as_lists,
  "Python scalars": _scalars_as(lambda v: v),
  "weakly typed scalars": _scalars_as(jnp.asarray),
}


@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("origin", ORIGINS)
@pytest.mark.parametrize("entry", LISTED)
def test_a_state_from_a_serializer_steps_as_the_state_init_made(
  entry, origin, dtype, jitted
):
  """Bit for bit the step of the state ``init`` made, its new state in
  ``init``'s structure (as optax's chain gives it back), not an error deep
  in the 8-bit requantisation or the non-finite record's branches, nor a
  refusal as another optimizer's state; a skipped (NaN) step too."""
  tx = LISTED[entry]()
  params = {"w": jnp.linspace(-1, 1, 512, dtype=dtype), "b": jnp.ones(300, dtype)}
  grads = jax.tree.map(lambda p: (0.1 * p + 0.01).astype(p.dtype), params)
  state = tx.init(params)
  other = ORIGINS[origin](state)
  step = jax.jit(tx.update) if jitted else tx.update
  for g in (grads, {**grads, "b": grads["b"].at[3].set(jnp.nan)}):
    want, got = step(g, state, params), step(g, other, params)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for w, x in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
      assert np.asarray(x).tobytes() == np.asarray(w).tobytes()  # NaN too
  assert all(
    np.isfinite(u).all() for u in jax.tree.leaves(step(grads, state, params)[0])
  )


def as_restored_without_target(tree):
  """``tree`` as a checkpoint restored without a target gives it back
  (Orbax's): NamedTuples as dicts of their fields, tuples as lists."""
  if isinstance(tree, tuple) and hasattr(tree, "_fields"):
    return {k: as_restored_without_target(v) for k, v in tree._asdict().items()}
  if isinstance(tree, (tuple, list)):
    return [as_restored_without_target(x) for x in tree]
  if isinstance(tree, dict):
    return {k: as_restored_without_target(v) for k, v in tree.items()}
  return tree


#: Every transformation whose state type this library defines.
RESTORED = {
  **{
    k: LISTED[k] for k in LISTED if k != "optax.adamw" and "LossScaleOptimizer" not in k
  },
  "ema_params": lambda: ols.ema_params(0.9),
  "stochastic_rounding": lambda: ols.stochastic_rounding(jax.random.key(0)),
  "kahan_summation": lambda: ols.kahan_summation(),
  "LossScaleOptimizer('adam')": lambda: ols.porting.LossScaleOptimizer("adam"),
  "LossScaleOptimizer(optax.adam)": lambda: ols.porting.LossScaleOptimizer(
    optax.adam(1e-3)
  ),
}


@pytest.mark.parametrize("entry", RESTORED)
def test_a_state_restored_without_a_target_says_how_to_restore_it(entry):
  """Not only "made by another optimizer": the message names the likely
  cause and the restore that works."""
  tx = RESTORED[entry]()
  params = {"w": jnp.ones(512, BF16), "b": jnp.ones(300, BF16)}
  restored = as_restored_without_target(tx.init(params))
  with pytest.raises(ValueError, match="restored without a target: restore against"):
    jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), restored, params)


#: Every public reader of a state, each ``state -> value``, with the
#: transformation whose state it reads.
READERS = {
  "get_scale": (lambda: ols.dynamic_loss_scale(optax.adam(1e-3)), ols.get_scale),
  "diagnostics": (lambda: ols.dynamic_loss_scale(optax.adam(1e-3)), ols.diagnostics),
  "nonfinite_report": (
    lambda: ols.dynamic_loss_scale(optax.adam(1e-3), track_nonfinite=True),
    ols.nonfinite_report,
  ),
  "get_learning_rate": (
    lambda: optax.inject_hyperparams(optax.adam)(1e-3),
    ols.get_learning_rate,
  ),
  "get_ema_params": (lambda: ols.ema_params(0.9), ols.get_ema_params),
  "LossScaleOptimizer.get_unscaled_gradients": (
    lambda: ols.porting.LossScaleOptimizer("adam"),
    lambda s: ols.porting.LossScaleOptimizer("adam").get_unscaled_gradients(
      {"w": jnp.ones(8)}, s
    ),
  ),
  "LossScaleOptimizer.iterations": (
    lambda: ols.porting.LossScaleOptimizer("adam"),
    ols.porting.LossScaleOptimizer("adam").iterations,
  ),
}


@pytest.mark.parametrize("reader", READERS)
def test_a_reader_of_a_state_restored_without_a_target_says_how_to_restore_it(reader):
  make, read = READERS[reader]
  restored = as_restored_without_target(make().init({"w": jnp.ones(8)}))
  with pytest.raises(ValueError, match="restored without a target: restore against"):
    read(restored)
