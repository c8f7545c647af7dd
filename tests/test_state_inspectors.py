"""Every reader of an optimizer state sees inside every state form the library makes.

The getters (the scale, the counters, the non-finite record, the per-leaf
plan, the master weights, the dequantised moments, the parameter average,
the learning rate), the float16 state warning, ``check_skipped_steps``'
suspects and the checkpoint guard, read from a state made by each of the
library's optimizers (plain Adam, ``quantize_state``, ``adam_8bit``,
``master_weights``, both together, ``ema_params``, ``inject_hyperparams``)
under each loss scale, inside each of optax's wrappers (``chain``,
``inject_hyperparams``, ``MultiSteps``, ``masked``, nested) and an
``nnx.Optimizer``. Each value is checked against an independent
computation: plain optax Adam on the same gradients, NumPy, the parameters.
A block-quantised leaf carries its dtype as metadata (its codes are uint8,
its scales float32): a reader that looked at its arrays would miss a
float16 state.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import versions
from test_per_leaf import _warns_if

import optax_lossscale as ols

# optax's adam, MultiSteps and inject_hyperparams use mixed-width arithmetic.
pytestmark = pytest.mark.standard_promotion

SCALE = 2.0**10
LR = 0.01
DTYPES = {"float16": jnp.float16, "float32": jnp.float32}
QUANTIZED = ("quantize_state", "adam_8bit", "master_weights(quantize_state)")
MASTER = ("master_weights", "master_weights(quantize_state)")


def _params(dtype):
  # 512 elements: two blocks of 256; "b" is one short block.
  return {
    "b": jnp.linspace(0.5, 1.0, 3).astype(dtype),
    "w": jnp.linspace(-1.0, 1.0, 512).reshape(2, 256).astype(dtype),
  }


def _grads(dtype):
  """Unscaled gradients, exact in float16 (multiples of 2**-10), and of
  magnitudes (0.25 to 0.75) whose Adam second moment float16 holds: the
  states compared here are finite in every form."""
  k = jnp.arange(512, dtype=jnp.float32).reshape(2, 256)
  sign = jnp.where(k % 2 == 0, 1.0, -1.0).astype(jnp.float32)
  return {
    "b": jnp.asarray([0.25, -0.5, 0.75], dtype),
    "w": (sign * (256.0 + k) / 1024.0).astype(dtype),
  }


def _form(name):
  quantized = lambda tx: ols.quantize_state(tx, min_size=0)  # noqa: E731
  store = {"store": "float32"}  # a float32 master of float16 parameters
  return {
    "adam": lambda: optax.adam(LR),
    "quantize_state": lambda: quantized(optax.adam(LR)),
    "adam_8bit": lambda: ols.adam_8bit(LR, min_size=0),
    "master_weights": lambda: ols.master_weights(optax.adam(LR), **store),
    "master_weights(quantize_state)": lambda: ols.master_weights(
      quantized(optax.adam(LR)), **store
    ),
    "ema_params": lambda: optax.chain(optax.adam(LR), ols.ema_params(0.9)),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(
      learning_rate=LR
    ),
  }[name]()


def _loss_scale(kind, inner):
  if kind == "dynamic":
    return ols.dynamic_loss_scale(inner, initial_scale=SCALE, track_nonfinite=True)
  return ols.static_loss_scale(inner, SCALE, track_nonfinite=True)


def _wrapped(wrapper, tx, params):
  every = jax.tree.map(lambda _: True, params)
  if wrapper == "none":
    return tx
  if wrapper == "chain":
    return optax.chain(optax.identity(), tx)
  if wrapper == "inject_hyperparams":
    return optax.inject_hyperparams(
      lambda factor: optax.chain(tx, optax.scale(factor))
    )(factor=1.0)
  if wrapper == "MultiSteps":
    return optax.MultiSteps(tx, 1)
  if wrapper == "masked":
    return optax.masked(tx, every)
  if wrapper == "nested":
    return optax.MultiSteps(optax.chain(optax.identity(), optax.masked(tx, every)), 1)
  raise AssertionError(wrapper)


FORMS = [
  "adam",
  "quantize_state",
  "adam_8bit",
  "master_weights",
  "master_weights(quantize_state)",
  "ema_params",
  "inject_hyperparams",
]
WRAPPERS = [
  "none",
  "chain",
  pytest.param("inject_hyperparams", marks=versions.inject_dtypes),
  pytest.param("MultiSteps", marks=versions.multisteps_dtypes),
  "masked",
  pytest.param("nested", marks=versions.multisteps_dtypes),
]


def _reference_adam(form, dtype):
  """Plain optax Adam's state and parameters after the first step, in the
  dtype the form computes in (float32 on a float32 master)."""
  compute = jnp.float32 if form in MASTER else dtype
  params = jax.tree.map(lambda p: p.astype(compute), _params(dtype))
  adam = optax.adam(LR)
  grads = jax.tree.map(lambda g: g.astype(compute), _grads(dtype))
  updates, state = adam.update(grads, adam.init(params), params)
  return state[0], optax.apply_updates(params, updates)


def _run(form, loss, wrapper, dtype):
  """The state after an applied step and a skipped one (NaN gradients)."""
  params = _params(dtype)
  tx = _wrapped(wrapper, _loss_scale(loss, _form(form)), params)
  half_state = dtype == jnp.float16 and form not in MASTER
  with _warns_if(half_state):
    state = tx.init(params)
  step = jax.jit(tx.update)
  scaled = jax.tree.map(lambda g: g * jnp.asarray(SCALE, dtype), _grads(dtype))
  updates, state = step(scaled, state, params)
  params = optax.apply_updates(params, updates)
  nan = jax.tree.map(lambda g: jnp.full_like(g, jnp.nan), scaled)
  updates, state = step(nan, state, params)
  assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
  return state, params


@pytest.mark.sampled
@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("loss", ["dynamic", "static"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_inspector_reads_every_state_form(dtype, form, loss, wrapper):
  dtype = DTYPES[dtype]
  state, params = _run(form, loss, wrapper, dtype)
  half_state = dtype == jnp.float16 and form not in MASTER
  half_params = jnp.finfo(dtype).bits < 32

  # the counters: one skipped step (the dynamic scale halves on it)
  assert float(ols.get_scale(state)) == (SCALE / 2 if loss == "dynamic" else SCALE)
  d = ols.diagnostics(state)
  assert int(d["skipped_steps"]) == 1 and bool(d["last_step_skipped"])

  # the non-finite record: two steps, the second NaN in both leaves
  report = ols.nonfinite_report(state)
  assert (report.steps, report.nonfinite_steps) == (2, 1)
  assert sorted(x.path for x in report.leaves) == ["b", "w"]

  # the suspects: float16 optimizer state is named where the form keeps it
  # (a quantised one counts by the dtype it is decoded to for each step)
  with pytest.raises(ols.NonFiniteStepsError) as e:
    ols.check_skipped_steps(state, max_consecutive_skips=1, min_scale=SCALE * 4)
  named = re.search(r"keeps float16 state \(at \.inner_state(\S+)[,)]", str(e.value))
  assert (named is not None) == half_state, str(e.value)
  if half_state:
    # the first float16 leaf of the same optimizer's state unquantised
    plain = {"quantize_state": "adam", "adam_8bit": "adam"}.get(form, form)
    first = next(
      jax.tree_util.keystr(path)
      for path, x in jax.tree_util.tree_flatten_with_path(
        _form(plain).init(_params(dtype))
      )[0]
      if x.dtype == jnp.float16
    )
    assert named.group(1).endswith(first), (named.group(1), first)

  # the plan: float32 gradients where a master is kept, and Adam's two
  # moments of each leaf quantised, in the dtype Adam computes them in
  compute = "float32" if form in MASTER else jnp.dtype(dtype).name
  for leaf in ols.loss_scale_plan(state, params).leaves:
    handed = "float32" if form in MASTER and half_params else "own dtype"
    assert leaf.handed_over == handed, leaf
    if form in QUANTIZED:
      assert len(leaf.quantized_state) == 2, leaf
      assert all(f"({compute}, blocks of 256)" in q for q in leaf.quantized_state)
    else:
      assert leaf.quantized_state == (), leaf

  # a finite state is saved as it is; MultiSteps keeps the last (NaN)
  # gradients it was given, and only those are named
  if wrapper in ("MultiSteps", "nested"):
    with pytest.raises(ValueError, match="Refusing to save") as e:
      ols.check_checkpoint(state)
    named = re.findall(r"(?:at |; )(\S+?):", str(e.value))
    assert named == [".acc_grads['b']", ".acc_grads['w']"], str(e.value)
  else:
    assert ols.check_checkpoint(state) is state

  reference_adam, reference_params = _reference_adam(form, dtype)
  if form in MASTER:
    master = ols.get_master_weights(state, params)
    for name in params:
      assert master[name].dtype == (jnp.float32 if half_params else dtype)
      np.testing.assert_array_equal(master[name].astype(dtype), params[name])
      np.testing.assert_allclose(
        master[name], reference_params[name], rtol=1e-6, atol=1e-7
      )
  if form in QUANTIZED:
    moments = (
      optax.tree_utils.tree_get(ols.dequantize_state(state), "mu"),
      (optax.tree_utils.tree_get(ols.dequantize_state(state), "nu")),
    )
    for got, want in zip(moments, (reference_adam.mu, reference_adam.nu), strict=True):
      for name in params:
        assert got[name].dtype == jnp.float32
        want_32 = np.asarray(want[name], np.float32)
        # 8-bit blocks: within 2% of the block's largest magnitude
        np.testing.assert_allclose(
          got[name], want_32, rtol=0, atol=0.02 * np.abs(want_32).max()
        )
  else:
    with pytest.raises(ValueError, match="holds no quantize_state state"):
      ols.dequantize_state(state)
  if form == "ema_params":
    # the first average is the parameters the first step made: float16 ones
    # exactly (read on their bits, not XLA's float32 values), float32 ones
    # within a unit of 1.0 (XLA may contract the step's own sum into a fused
    # multiply-add)
    for name, avg in ols.get_ema_params(state).items():
      assert avg.dtype == jnp.float32
      np.testing.assert_allclose(
        avg, params[name].astype(jnp.float32), rtol=0, atol=0 if half_params else 1e-7
      )
  if form == "inject_hyperparams":
    # in the dtype inject_hyperparams keeps it in (the parameters')
    kept = _form(form).init(_params(dtype)).hyperparams["learning_rate"]
    assert ols.get_learning_rate(state).dtype == kept.dtype
    assert float(ols.get_learning_rate(state)) == float(kept)
    changed = ols.set_learning_rate(state, 0.5)
    assert jax.tree.structure(changed) == jax.tree.structure(state)
    assert float(ols.get_learning_rate(changed)) == 0.5


def _poisoned(state):
  """Every floating array of ``state`` NaN: a quantised leaf's scales too."""
  return jax.tree.map(
    lambda x: (
      x * jnp.asarray(jnp.nan, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    ),
    state,
  )


@pytest.mark.sampled
@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("form", FORMS)
def test_the_checkpoint_guard_names_each_state_leaf_whole(form, wrapper):
  state, _ = _run(form, "dynamic", wrapper, jnp.float16)
  bad = _poisoned(state)
  # the paths of the floating arrays, as JAX flattens the state, a quantised
  # leaf's scales as the leaf itself (its uint8 codes hold no NaN)
  expected = set()
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    if jnp.issubdtype(x.dtype, jnp.floating):
      expected.add(re.sub(r"\.scales$", "", jax.tree_util.keystr(path)))
  with pytest.raises(ValueError, match="Refusing to save") as e:
    ols.check_checkpoint(bad)
  message = str(e.value)
  named = set(re.findall(r"(?:at |; )(\S+?)(?: \(quantised \w+\))?:", message))
  assert named == expected, message
  assert ".scales" not in message and ".codes" not in message
  # Adam's two moments of each of the two leaves
  assert message.count("(quantised float") == (4 if form in QUANTIZED else 0)


def _nnx_optimizer(form):
  nnx = pytest.importorskip("flax.nnx")

  class Model(nnx.Module):
    def __init__(self):
      self.lin = nnx.Linear(16, 32, rngs=nnx.Rngs(0), param_dtype=jnp.float16)

  model = Model()
  tx = ols.dynamic_loss_scale(_form(form), initial_scale=SCALE, track_nonfinite=True)
  half_state = form not in MASTER
  with _warns_if(half_state):
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  return nnx, model, optimizer


@pytest.mark.parametrize("form", FORMS)
def test_an_nnx_optimizer_is_read_like_its_state(form):
  # nnx.Optimizer keeps each state array (a quantised leaf's codes and
  # scales too) in a variable: every reader sees the same as on the plain
  # state.
  nnx, model, optimizer = _nnx_optimizer(form)
  plain = jax.tree.map(
    lambda x: x.get_value() if hasattr(x, "get_value") else x,
    optimizer.opt_state,
    is_leaf=lambda x: hasattr(x, "get_value"),
  )
  grads = nnx.state(model, nnx.Param)  # a State of variables, as nnx.grad gives
  pure = nnx.to_pure_dict(grads)
  got = ols.loss_scale_plan(optimizer, grads)
  assert got.leaves == ols.loss_scale_plan(plain, pure).leaves
  assert [x.path for x in got.leaves] == ["['lin']['bias']", "['lin']['kernel']"]
  for leaf in got.leaves:
    assert len(leaf.quantized_state) == (2 if form in QUANTIZED else 0), leaf
  if form in QUANTIZED:
    for a, b in zip(
      jax.tree.leaves(ols.dequantize_state(optimizer)),
      jax.tree.leaves(ols.dequantize_state(plain)),
      strict=True,
    ):
      np.testing.assert_array_equal(a, b)
  assert ols.check_checkpoint(optimizer) is optimizer
  bad = _poisoned(plain)
  with pytest.raises(ValueError, match="Refusing to save") as e:
    ols.check_checkpoint(bad)
  assert ".scales" not in str(e.value)


NOT_ARRAYS = {"a Python float": 0.5, "a Python int": 1, "a string": "w"}


@pytest.mark.parametrize("where", ["top", "nested"])
@pytest.mark.parametrize("leaf", NOT_ARRAYS)
def test_the_plan_refuses_the_leaves_update_refuses(leaf, where):
  # The plan describes what update does with each leaf: a leaf update
  # refuses gets no row of the plan (an "own dtype" row would say it is
  # unscaled and checked), but update's error.
  params = _params(jnp.float32)
  tx = ols.dynamic_loss_scale(ols.master_weights(optax.adam(LR)))
  state = tx.init(params)
  grads = _grads(jnp.float32)
  if where == "top":
    grads["b"] = NOT_ARRAYS[leaf]
  else:
    grads["b"] = [grads["b"], NOT_ARRAYS[leaf]]
  with pytest.raises(ValueError, match="not an array") as planned:
    ols.loss_scale_plan(state, grads)
  with pytest.raises(ValueError, match="not an array") as updated:
    tx.update(grads, state, params if where == "top" else None)
  assert str(planned.value) == str(updated.value)
  grads["b"] = jnp.ones(3)
  assert [x.path for x in ols.loss_scale_plan(state, grads).leaves] == [
    "['b']",
    "['w']",
  ]
