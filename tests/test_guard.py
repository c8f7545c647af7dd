"""check_checkpoint: a state with a non-finite value is refused, naming where."""

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_lossscale as ols

pytestmark = pytest.mark.standard_promotion  # optax's adam


def _state():
  params = {"dense": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}}
  tx = ols.dynamic_loss_scale(optax.adam(1e-3))
  opt_state = tx.init(params)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
  _, opt_state = tx.update(grads, opt_state, params)
  return {"params": params, "opt_state": opt_state, "step": 1, "name": "run"}


def _poison(state, where, value):
  def one(path, x):
    hit = where in jax.tree_util.keystr(path) and "bias" in jax.tree_util.keystr(path)
    return x.at[..., 0].set(value) if hit else x

  return jax.tree_util.tree_map_with_path(one, state)


def test_a_finite_state_is_returned_as_it_is():
  state = _state()
  assert ols.check_checkpoint(state) is state


def test_a_nan_in_an_adam_moment_is_refused_and_named():
  state = _poison(_state(), ".nu", jnp.nan)
  with pytest.raises(ValueError) as e:
    ols.check_checkpoint(state)
  msg = str(e.value)
  assert "nu" in msg and "['bias']" in msg and "1 NaN (of 2 entries)" in msg
  assert "kernel" not in msg and "mu" not in msg.replace("nu", "")  # only that leaf


def test_nan_and_infinity_are_told_apart_and_counted():
  state = _poison(_state(), "params", jnp.inf)
  state["params"]["dense"]["kernel"] = (
    state["params"]["dense"]["kernel"].at[0].set(jnp.nan)
  )
  with pytest.raises(ValueError) as e:
    ols.check_checkpoint(state, what="checkpoint")
  msg = str(e.value)
  assert msg.startswith("Refusing to save the checkpoint: non-finite values at")
  assert "['params']['dense']['bias']: 1 inf (of 2 entries)" in msg
  assert "['params']['dense']['kernel']: 2 NaN (of 6 entries)" in msg


def test_integer_and_non_array_leaves_are_not_checked():
  ok = {"count": jnp.array([2**31 - 1]), "flag": jnp.array(True), "note": "x", "n": 3}
  assert ols.check_checkpoint(ok) is ok


def test_inside_jit_it_says_to_call_it_outside():
  with pytest.raises(ValueError, match="outside jax.jit"):
    jax.jit(ols.check_checkpoint)({"w": jnp.ones(2)})


def test_nnx_variables_are_read_through():
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  assert ols.check_checkpoint(nnx.state(model)) is not None
  model.bias.set_value(model.bias.get_value().at[1].set(jnp.inf))
  with pytest.raises(ValueError, match="bias.*1 inf"):
    ols.check_checkpoint(nnx.state(model))


def test_zero_size_half_complex_and_float8_leaves():
  ok = {"empty": jnp.zeros((0, 3)), "f8": jnp.array([1.0], jnp.float8_e4m3fn)}
  assert ols.check_checkpoint(ok) is ok
  with pytest.raises(ValueError, match=r"\['b'\]: 1 NaN"):
    ols.check_checkpoint({"b": jnp.array([1.0, jnp.nan], jnp.bfloat16)})
  with pytest.raises(ValueError, match=r"\['c'\]: 1 inf"):
    ols.check_checkpoint({"c": jnp.array([1 + 1j, complex(0, float("inf"))])})


def _compiled_during(fn):
  """The XLA compilations ``fn()`` ran (jax.log_compiles' messages)."""
  import io
  import logging

  stream = io.StringIO()
  handler = logging.StreamHandler(stream)
  logger = logging.getLogger("jax")
  logger.addHandler(handler)
  try:
    with jax.log_compiles(True):
      fn()
  finally:
    logger.removeHandler(handler)
  return [line for line in stream.getvalue().splitlines() if "Compiling" in line]


def test_naming_the_bad_leaves_compiles_nothing():
  # The error path costs what the happy path costs: after the finite check
  # (compiled once per set of shapes), the leaves are counted on the host.
  good = {f"leaf{i}": jnp.ones(i + 1) for i in range(60)}  # 60 distinct shapes
  bad = {**good, "leaf7": good["leaf7"].at[3].set(jnp.inf)}
  ols.check_checkpoint(good)

  def refuse():
    with pytest.raises(ValueError, match=r"\['leaf7'\]: 1 inf \(of 8 entries\)"):
      ols.check_checkpoint(bad)

  assert _compiled_during(refuse) == []
  # The control: a new shape does compile (the log is read).
  assert _compiled_during(lambda: ols.check_checkpoint({"x": jnp.ones(1234)}))
