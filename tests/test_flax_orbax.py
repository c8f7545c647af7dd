"""Flax Linen TrainState, Flax NNX nnx.Optimizer, Orbax checkpoints."""

import subprocess

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_examples import run_example

import optax_lossscale as ols

flax = pytest.importorskip("flax")
from flax import nnx  # noqa: E402

from optax_lossscale.flax import LossScaleTrainState, nnx_value_and_grad  # noqa: E402

pytestmark = pytest.mark.standard_promotion  # Flax layers
SCALE = 2.0**8


class _Linen(flax.linen.Module):
  @flax.linen.compact
  def __call__(self, x):
    return flax.linen.Dense(2, dtype=jnp.float16, param_dtype=jnp.float32)(x)


def _linen_state(tx):
  model = _Linen()
  params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
  return model, LossScaleTrainState.create(apply_fn=model.apply, params=params, tx=tx)


def _loss(model, params, x):
  return jnp.mean(model.apply({"params": params}, x).astype(jnp.float32) ** 2)


def test_linen_train_state_applies_skips_and_counts():
  model, state = _linen_state(
    ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=SCALE)
  )
  x = jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 10

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, x):
    loss, grads = state.value_and_grad(lambda p: _loss(model, p, x))(state.params)
    return state.apply_gradients(grads=grads), loss, grads

  new, loss, grads = step(state, x)
  plain = jax.grad(lambda p: _loss(model, p, x))(state.params)
  chex.assert_trees_all_close(
    grads, jax.tree.map(lambda g: g * SCALE, plain), rtol=2e-3
  )
  assert float(loss) == pytest.approx(float(_loss(model, state.params, x)))
  assert int(new.step) == 1 and float(new.loss_scale) == SCALE
  assert int(new.diagnostics["good_steps"]) == 1

  skipped, _, _ = step(new, x.at[0, 0].set(jnp.nan))
  assert int(skipped.step) == 1  # a skipped step does not count
  chex.assert_trees_all_equal(skipped.params, new.params)
  assert float(skipped.loss_scale) == SCALE / 2
  assert bool(skipped.diagnostics["last_step_skipped"])
  assert skipped.step.dtype == jnp.int32 == state.step.dtype


def test_linen_train_state_refuses_two_loss_scales():
  # None is Flax's TrainState (tests/test_flax_trainstate.py); two are refused.
  tx = optax.chain(
    ols.dynamic_loss_scale(optax.sgd(0.1)), ols.static_loss_scale(optax.sgd(0.1), 2.0)
  )
  with pytest.raises(ValueError, match="Found 2 loss-scale states"):
    _linen_state(tx)


class _Nnx(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(
      3, 2, dtype=jnp.float16, param_dtype=jnp.float32, rngs=rngs
    )

  def __call__(self, x):
    return self.linear(x)


def test_nnx_optimizer_with_loss_scale():
  model = _Nnx(nnx.Rngs(0))
  ref = nnx.clone(model)
  optimizer = nnx.Optimizer(
    model, ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=SCALE), wrt=nnx.Param
  )
  assert float(ols.get_scale(optimizer)) == SCALE
  loss_fn = lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2)

  @nnx.jit
  def step(model, optimizer, x):
    loss, grads = nnx_value_and_grad(loss_fn)(optimizer, model, x)
    optimizer.update(model, grads)
    return loss, grads, ols.diagnostics(optimizer)

  x = jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 10
  loss, grads, diag = step(model, optimizer, x)
  plain = nnx.grad(loss_fn)(ref, x)
  chex.assert_trees_all_close(
    nnx.state(grads), jax.tree.map(lambda g: g * SCALE, nnx.state(plain)), rtol=2e-3
  )
  assert float(loss) == pytest.approx(float(loss_fn(ref, x)))
  assert int(diag["good_steps"]) == 1 and not bool(diag["last_step_skipped"])
  # The applied step is sgd on the unscaled gradients.
  unscaled = ols.unscale(nnx.state(grads, nnx.Param), jnp.float32(SCALE))
  expected = jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(ref, nnx.Param), unscaled)
  chex.assert_trees_all_close(nnx.state(model, nnx.Param), expected, rtol=1e-6)

  before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
  _, _, diag = step(model, optimizer, x.at[0, 0].set(jnp.inf))
  chex.assert_trees_all_equal(nnx.state(model, nnx.Param), before)
  assert (
    bool(diag["last_step_skipped"]) and float(ols.get_scale(optimizer)) == SCALE / 2
  )
  assert int(optimizer.step[...]) == 2  # nnx counts update calls


@pytest.mark.integration
def test_orbax_restore_in_a_new_process_is_bit_identical(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  script = "orbax_resume.py"
  common = ["--steps", 40, "--nan-at", "5,21,22"]
  a, b = tmp_path / "uninterrupted.npz", tmp_path / "resumed.npz"
  ckpt = tmp_path / "ckpt"
  out_a = run_example(script, *common, "--save-at", 20, "--ckpt", ckpt, "--final", a)
  out_b = run_example(script, *common, "--resume", ckpt / "20", "--final", b)
  assert "saved step 20" in out_a and "restored step 20" in out_b
  fa, fb = np.load(a), np.load(b)
  assert sorted(fa.files) == sorted(fb.files)
  assert any("loss_scale" in k for k in fa.files)
  for k in fa.files:
    assert fa[k].dtype == fb[k].dtype, k
    np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)
  # The run skipped the three NaN steps, on both sides of the checkpoint.
  skipped = [k for k in fa.files if k.endswith(".skipped_steps")]
  assert len(skipped) == 1 and int(fa[skipped[0]]) == 3
  step = [k for k in fa.files if k.endswith(".step")]
  assert int(fa[step[0]]) == 37

  # A restore that went wrong (a fresh run from step 20) would differ.
  c = tmp_path / "fresh.npz"
  run_example(script, "--steps", 20, "--nan-at", "", "--final", c)
  assert not np.array_equal(np.load(c)[step[0]], fb[step[0]])


@pytest.mark.integration
def test_orbax_example_compares_both_halves_itself_and_refuses_to_overwrite(tmp_path):
  out = run_example("orbax_resume.py", "--compare", "--steps", 24, "--nan-at", "3,13")
  assert "bit-identical: yes" in out, out
  args = ["--steps", 6, "--save-at", 3, "--ckpt", tmp_path / "ckpt", "--nan-at", ""]
  run_example("orbax_resume.py", *args)
  with pytest.raises(subprocess.CalledProcessError) as again:
    run_example("orbax_resume.py", *args)
  message = again.value.stderr.strip().splitlines()
  assert message == [
    f"checkpoint {tmp_path / 'ckpt' / '3'} already exists: pass --overwrite to "
    "replace it, or another --ckpt"
  ]
  assert "saved step 3" in run_example("orbax_resume.py", *args, "--overwrite")


@pytest.mark.integration
@pytest.mark.parametrize("name", ["flax_linen.py", "flax_nnx.py"])
def test_flax_examples(name):
  out = run_example(name, "--steps", 200)
  acc = [
    float(w)
    for line in out.splitlines()
    if line.startswith("test accuracy")
    for w in line.split()[2:3]
  ]
  assert acc and acc[0] > 0.8, out
  assert "skipped" in out and "final scale" in out


def test_nnx_with_the_keras_facade_and_its_ema():
  model = _Nnx(nnx.Rngs(0))
  opt = ols.porting.LossScaleOptimizer(
    "sgd", initial_scale=SCALE, use_ema=True, ema_momentum=0.5
  )
  optimizer = nnx.Optimizer(model, opt, wrt=nnx.Param)
  loss_fn = lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2)
  x = jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 10
  history = []
  for _ in range(3):
    _, grads = nnx_value_and_grad(loss_fn)(optimizer, model, x)
    optimizer.update(model, grads)
    history.append(jax.tree.map(jnp.copy, nnx.as_pure(nnx.state(model, nnx.Param))))
  expected = history[0]
  for p in history[1:]:
    expected = jax.tree.map(lambda e, q: 0.5 * e + 0.5 * q, expected, p)
  averaged = opt.finalize_variable_values(
    nnx.as_pure(nnx.state(model, nnx.Param)), optimizer
  )
  chex.assert_trees_all_close(averaged, expected, rtol=1e-6)
  nnx.update(model, averaged)  # swap the averaged weights in
  chex.assert_trees_all_close(
    nnx.as_pure(nnx.state(model, nnx.Param)), expected, rtol=1e-6
  )


def test_orbax_restore_under_another_configuration(tmp_path):
  """A fixed scale is the configuration's, a dynamic one clamped into it."""
  ocp = pytest.importorskip("orbax.checkpoint")
  params = {"w": jnp.ones(2)}
  grads = {"w": jnp.full(2, 1024.0)}
  cases = [
    (
      ols.static_loss_scale(optax.sgd(1.0), 1024.0),
      ols.static_loss_scale(optax.sgd(1.0), 128.0),
      128.0,
    ),
    (
      ols.dynamic_loss_scale(optax.sgd(1.0), initial_scale=1024.0),
      ols.dynamic_loss_scale(optax.sgd(1.0), initial_scale=16.0, max_scale=64.0),
      64.0,
    ),
  ]
  checkpointer = ocp.StandardCheckpointer()
  for i, (before, after, expected) in enumerate(cases):
    path = tmp_path / str(i)
    checkpointer.save(path, before.init(params))
    checkpointer.wait_until_finished()
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, after.init(params))
    state = checkpointer.restore(path, target)
    assert float(ols.get_scale(state)) == 1024.0  # as saved
    updates, state = jax.jit(after.update)(grads, state, params)
    chex.assert_trees_all_equal(updates, {"w": jnp.full(2, -1.0)})
    assert float(ols.get_scale(state)) == expected
  checkpointer.close()
