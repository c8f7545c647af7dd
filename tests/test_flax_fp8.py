"""Flax's own float8 layers under the loss scale: overwrite leaves, Linen and NNX.

The layers of ``flax.linen.fp8_ops`` keep scales and amax histories in the
collection ``_overwrite_with_gradient``; their "gradients" are their new
values. The expected values here are always Flax's own: the gradients its
custom VJPs return, and Flax's ``TrainState``, which overwrites them.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

flax = pytest.importorskip("flax")
from flax import nnx  # noqa: E402
from flax.linen import fp8_ops  # noqa: E402
from flax.training import train_state  # noqa: E402

from optax_lossscale._base import tree as _tree  # noqa: E402
from optax_lossscale._loss_scale import overwrite as _overwrite  # noqa: E402
from optax_lossscale.flax import (  # noqa: E402
  LossScaleTrainState,
  is_overwrite_variable,
  nnx_update,
  nnx_value_and_grad,
)

pytestmark = pytest.mark.standard_promotion  # Flax layers, optax's adam
nn = flax.linen
OW = fp8_ops.OVERWRITE_WITH_GRADIENT
SCALE = 2.0**10
HISTORY = 4  # amax history length: short, so that a few steps fill it
_FP8_DOT = functools.partial(fp8_ops.Fp8DirectDotGeneralOp, amax_history_length=HISTORY)
# Every dot, forward and backward, has (M + N) * K >= 100: smaller ones XLA's
# GPU backend keeps out of its float8 GEMM and multiplies in float16, where
# Flax's scaled operands overflow (448 * 448) and every step would be skipped.
BATCH, IN, HIDDEN, OUT = 16, 16, 32, 8


class _Fp8Model(nn.Module):
  """A float8 Dense (Fp8DirectDotGeneralOp), then a float8 einsum (Fp8Einsum)."""

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(HIDDEN, dot_general_cls=_FP8_DOT)(x))
    w = self.param("w", nn.initializers.lecun_normal(), (HIDDEN, OUT))
    return fp8_ops.Fp8Einsum(amax_history_length=HISTORY)("bi,io->bo", h, w)


MODEL = _Fp8Model()


def _batch(seed, scale=1.0):
  kx, ky = jax.random.split(jax.random.key(seed))
  return (
    jax.random.normal(kx, (BATCH, IN)) * scale,
    jax.random.normal(ky, (BATCH, OUT)) * scale,
  )


def _loss(variables, x, y):
  return jnp.mean((MODEL.apply(variables, x) - y) ** 2)


def _variables():
  return MODEL.init(jax.random.key(0), _batch(0)[0])


def _create(tx):
  return LossScaleTrainState.create(apply_fn=MODEL.apply, params=_variables(), tx=tx)


def _poison_overwrite_leaf(grads):
  """An inf in one new amax only: the ordinary gradients stay finite."""
  leaf = grads[OW]["Dense_0"]["Fp8DirectDotGeneralOp_0"]["input_amax_history"]
  new = jax.tree.map(lambda g: g, grads)
  new[OW]["Dense_0"]["Fp8DirectDotGeneralOp_0"]["input_amax_history"] = leaf.at[0].set(
    jnp.inf
  )
  return new


@functools.partial(jax.jit, static_argnames="poison")
def _step(state, x, y, poison=False):
  loss, grads = state.value_and_grad(lambda v: _loss(v, x, y))(state.params)
  if poison:
    grads = _poison_overwrite_leaf(grads)
  return state.apply_gradients(grads=grads), grads


def _adam_state(opt_state):
  return _tree.find_unique(
    opt_state, lambda s: isinstance(s, optax.ScaleByAdamState), "adam state"
  )


def _nonzero_history(variables):
  ow = variables[OW]["Dense_0"]["Fp8DirectDotGeneralOp_0"]
  return int(jnp.count_nonzero(ow["input_amax_history"]))


TXS = {
  "dynamic": lambda: ols.dynamic_loss_scale(optax.adam(1e-2), initial_scale=SCALE),
  "static": lambda: ols.static_loss_scale(optax.adam(1e-2), SCALE),
  "keras": lambda: ols.porting.LossScaleOptimizer(
    optax.adam(1e-2), initial_scale=SCALE
  ),
}


@pytest.mark.parametrize("name", sorted(TXS))
def test_linen_step_overwrites_as_flax_train_state_does(name):
  """Overwrite leaves: Flax's new values bit for bit; params: Adam on grads / S."""
  state = _create(TXS[name]())
  flax_state = train_state.TrainState.create(
    apply_fn=MODEL.apply, params=_variables(), tx=optax.adam(1e-2)
  )
  for seed in range(3):  # from the second step on, the float8 scales move
    x, y = _batch(seed)
    new, grads = _step(state, x, y)
    # Flax's own TrainState, given the same new values and unscaled gradients.
    flax_grads = {"params": jax.tree.map(lambda g: g / SCALE, grads["params"])}
    flax_state = flax_state.apply_gradients(grads=flax_grads | {OW: grads[OW]})

    chex.assert_trees_all_equal(new.params[OW], grads[OW])  # never unscaled
    chex.assert_trees_all_equal(new.params[OW], flax_state.params[OW])
    chex.assert_trees_all_close(
      new.params["params"], flax_state.params["params"], rtol=1e-6, atol=1e-7
    )
    # The scaled gradient's amax is recorded as it is: S times the unscaled one.
    dense = grads[OW]["Dense_0"]["Fp8DirectDotGeneralOp_0"]
    assert float(dense["output_grad_amax_history"][0]) > 0
    assert int(new.step) == seed + 1
    flax_state = flax_state.replace(params=new.params)  # stay in lockstep
    state = new
  assert float(state.params[OW]["Fp8Einsum_0"]["input_scale"][0]) != 1.0


def test_the_inner_optimizer_holds_no_state_for_overwrite_leaves():
  state = _create(TXS["dynamic"]())
  adam = _adam_state(state.opt_state)
  for moment in (adam.mu, adam.nu):
    assert jax.tree.leaves(moment[OW]) == []
    assert jax.tree.structure(moment["params"]) == jax.tree.structure(
      state.params["params"]
    )
  # And after a step (the tree is the same, nothing was added).
  new, _ = _step(state, *_batch(1))
  assert jax.tree.structure(new.opt_state) == jax.tree.structure(state.opt_state)


@pytest.mark.parametrize("where", ["batch", "overwrite_leaf"])
def test_a_nonfinite_step_keeps_the_old_values(where):
  """An inf in the batch, or only in one new amax, skips the whole step."""
  state, _ = _step(_create(TXS["dynamic"]()), *_batch(1))
  x, y = _batch(2)
  if where == "batch":
    skipped, grads = _step(state, x.at[0, 0].set(jnp.inf), y)
  else:
    skipped, grads = _step(state, x, y, poison=True)
    assert bool(ols.all_finite(grads["params"]))  # only the new amax is inf
  assert not bool(ols.all_finite(grads[OW]))
  chex.assert_trees_all_equal(skipped.params, state.params)
  chex.assert_trees_all_equal(
    _adam_state(skipped.opt_state), _adam_state(state.opt_state)
  )
  assert int(skipped.step) == int(state.step)
  assert float(skipped.loss_scale) == SCALE / 2
  # The next finite step writes Flax's new values again.
  after, grads = _step(skipped, x, y)
  chex.assert_trees_all_equal(after.params[OW], grads[OW])


ACCUMULATING = {
  "multisteps_inside": lambda: ols.dynamic_loss_scale(
    optax.MultiSteps(optax.adam(1e-2), 2), initial_scale=SCALE
  ),
  "keras": lambda: ols.porting.LossScaleOptimizer(
    optax.adam(1e-2), initial_scale=SCALE, gradient_accumulation_steps=2
  ),
}


@pytest.mark.parametrize("name", sorted(ACCUMULATING))
def test_accumulation_takes_the_maximum_and_advances_the_history_once(name):
  state = _create(ACCUMULATING[name]())
  initial = state.params
  # Micro-batches whose amaxes differ either way: inputs larger in the
  # second, targets (so output gradients) larger in the first.
  x1, y1 = _batch(1)
  y1 = y1 * 10
  x2, y2 = _batch(2, scale=3.0)

  mid, g1 = _step(state, x1, y1)
  chex.assert_trees_all_equal(mid.params, initial)  # nothing moves mid-window
  end, g2 = _step(mid, x2, y2)
  expected = jax.tree.map(jnp.maximum, g1[OW], g2[OW])
  chex.assert_trees_all_equal(end.params[OW], expected)
  for other in (g2[OW], jax.tree.map(lambda a, b: (a + b) / 2, g1[OW], g2[OW])):
    assert not all(jax.tree.leaves(jax.tree.map(jnp.array_equal, expected, other)))
  assert _nonzero_history(end.params) == 1  # one optimizer step, one entry
  assert not jnp.array_equal(end.params["params"]["w"], initial["params"]["w"])

  # The second window, with a non-finite micro-batch in the middle: it is
  # skipped alone and its values never enter the maximum.
  x3, y3 = _batch(3)
  s3, g3 = _step(end, x3, y3)
  nan, _ = _step(s3, x3.at[0, 0].set(jnp.nan), y3)
  assert bool(nan.diagnostics["last_step_skipped"])
  chex.assert_trees_all_equal(nan.params, end.params)
  s4, g4 = _step(nan, *_batch(4))
  chex.assert_trees_all_equal(s4.params[OW], jax.tree.map(jnp.maximum, g3[OW], g4[OW]))
  assert _nonzero_history(s4.params) == 2


def test_keras_facade_ema_and_unscaling_leave_overwrite_leaves_alone():
  opt = ols.porting.LossScaleOptimizer(
    optax.adam(1e-2), initial_scale=SCALE, use_ema=True
  )
  state, _ = _step(_create(opt), *_batch(1))
  state, grads = _step(state, *_batch(2))
  ema = ols.get_ema_params(state.opt_state)
  assert jax.tree.leaves(ema[OW]) == []  # the average holds no float8 meta
  final = opt.finalize_variable_values(state.params, state.opt_state)
  chex.assert_trees_all_equal(final[OW], state.params[OW])
  chex.assert_trees_all_equal(final["params"], ema["params"])
  assert not jnp.array_equal(final["params"]["w"], state.params["params"]["w"])
  unscaled = opt.get_unscaled_gradients(grads, state.opt_state)
  chex.assert_trees_all_equal(unscaled[OW], grads[OW])
  chex.assert_trees_all_equal(
    unscaled["params"], jax.tree.map(lambda g: g / SCALE, grads["params"])
  )


def test_multisteps_outside_the_loss_scale_is_refused():
  tx = optax.MultiSteps(ols.dynamic_loss_scale(optax.adam(1e-2)), 2)
  with pytest.raises(ValueError, match=r"MultiSteps\(<loss scale>\(inner\), k\)"):
    _create(tx)


def test_orbax_round_trip_of_the_train_state(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  state, _ = _step(_create(TXS["dynamic"]()), *_batch(1))
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", state)
  checkpointer.wait_until_finished()
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, _create(TXS["dynamic"]()))
  restored = checkpointer.restore(tmp_path / "ckpt", target)
  checkpointer.close()
  chex.assert_trees_all_equal(restored.params, state.params)
  chex.assert_trees_all_equal(restored.opt_state, state.opt_state)
  # And it goes on exactly as the original does.
  batch = _batch(2)
  chex.assert_trees_all_equal(
    _step(restored, *batch)[0].params, _step(state, *batch)[0].params
  )


def test_a_model_without_float8_layers_is_unchanged():
  """No overwrite leaves: the state is the plain one, the params untouched."""

  class Plain(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(2)(x)

  variables = Plain().init(jax.random.key(0), _batch(0)[0])
  tx = ols.dynamic_loss_scale(optax.adam(1e-2), initial_scale=SCALE)
  state = LossScaleTrainState.create(apply_fn=Plain().apply, params=variables, tx=tx)
  assert _overwrite.find_overwrite_state(state.opt_state) is None
  assert jax.tree.structure(state.opt_state.inner_state) == jax.tree.structure(
    optax.adam(1e-2).init(variables)
  )
  assert ols.apply_overwrites(variables, state.opt_state) is variables


def test_flax_fp8_meta_dtype_leaves_are_overwrite_leaves_by_their_dtype():
  """Leaves of Flax's fp32_max_grad dtype, under no collection name."""
  to_meta = jax.jit(lambda a: jax.lax.convert_element_type(a, fp8_ops.fp32_max_grad))
  params = {"w": jnp.ones(2), "amax": to_meta(jnp.zeros(3))}
  tx = ols.dynamic_loss_scale(optax.sgd(1.0), initial_scale=4.0)
  state = tx.init(params)
  update = jax.jit(tx.update)
  new_amax = to_meta(jnp.array([1.0, 2.0, 3.0]))
  updates, state = update({"w": jnp.full(2, 4.0), "amax": new_amax}, state, params)
  assert not bool(ols.diagnostics(state)["last_step_skipped"])
  np.testing.assert_array_equal(updates["w"], -1.0)  # unscaled: 4 / 4
  written = jax.jit(ols.apply_overwrites)(params, state)
  assert written["amax"].dtype == fp8_ops.fp32_max_grad
  np.testing.assert_array_equal(
    jax.jit(lambda a: a.astype(jnp.float32))(written["amax"]), [1.0, 2.0, 3.0]
  )
  bad = to_meta(jnp.array([1.0, jnp.inf, 3.0]))
  _, state = update({"w": jnp.full(2, 4.0), "amax": bad}, state, params)
  assert bool(ols.diagnostics(state)["last_step_skipped"])


# --------------------------------------------------------------------------
# NNX: Flax has no float8 layer of its own; a Linen one through ToNNX.
# --------------------------------------------------------------------------


def _nnx_model():
  model = nnx.bridge.ToNNX(nn.Dense(HIDDEN, dot_general_cls=_FP8_DOT), rngs=nnx.Rngs(0))
  nnx.bridge.lazy_init(model, _batch(0)[0])
  return model


def _nnx_loss(model, x, y):
  return jnp.mean((model(x)[:, :OUT] - y) ** 2)


@nnx.jit
def _nnx_step(model, optimizer, x, y):
  _, grads = nnx_value_and_grad(_nnx_loss)(optimizer, model, x, y)
  nnx_update(optimizer, model, grads)
  return grads


def test_nnx_optimizer_overwrites_to_nnx_float8_variables():
  model = _nnx_model()
  wrt = nnx.Any(nnx.Param, is_overwrite_variable)
  tx = ols.dynamic_loss_scale(optax.adam(1e-2), initial_scale=SCALE)
  optimizer = nnx.Optimizer(model, tx, wrt=wrt)
  adam = _adam_state(nnx.as_pure(optimizer.opt_state))
  assert jax.tree.leaves(adam.mu["Fp8DirectDotGeneralOp_0"]) == []
  assert jax.tree.leaves(adam.mu["kernel"])

  def fp8_vars():
    return nnx.as_pure(nnx.state(model, is_overwrite_variable))

  for seed in range(2):
    kernel = nnx.as_pure(nnx.state(model, nnx.Param))["kernel"]
    grads = _nnx_step(model, optimizer, *_batch(seed))
    chex.assert_trees_all_equal(
      fp8_vars(), nnx.as_pure(nnx.state(grads, is_overwrite_variable))
    )
    assert not jnp.array_equal(
      nnx.as_pure(nnx.state(model, nnx.Param))["kernel"], kernel
    )

  before = (fp8_vars(), nnx.as_pure(nnx.state(model, nnx.Param)))
  x, y = _batch(5)
  _nnx_step(model, optimizer, x.at[0, 0].set(jnp.inf), y)
  assert bool(ols.diagnostics(optimizer)["last_step_skipped"])
  chex.assert_trees_all_equal(
    (fp8_vars(), nnx.as_pure(nnx.state(model, nnx.Param))), before
  )
