"""The 8-bit state on nnx variables: the steps optax takes on the same arrays.

``nnx.Optimizer`` inits its transformation on the model's ``nnx.Param``
variables, so a moment optax makes is a variable too, and updates it on
the arrays (``nnx.as_pure``), writing the new state's arrays back into the
variables, which hold one array each. A quantised moment is a
``QuantizedLeaf`` (codes and scales), so it must not stay inside a
variable (the update would write a dict of its codes and scales into it),
its leaves are chosen and grouped by their paths without the variables
(as ``update`` sees them), and a transformation given the variables
themselves (``tx.update(nnx.grad(...), state, nnx.state(model))``) runs
on their arrays and gives its updates and state back in them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("flax", reason="the Flax tests need flax")
pytestmark = pytest.mark.standard_promotion  # optax's adam, Flax's own code

from flax import nnx  # noqa: E402

import optax_lossscale as ols  # noqa: E402
from optax_lossscale.flax import nnx_update, nnx_value_and_grad  # noqa: E402

X = jnp.linspace(-1.0, 1.0, 4 * 256).reshape(4, 256)


class MLP(nnx.Module):
  def __init__(self, dtype):
    self.hidden = nnx.Linear(256, 64, param_dtype=dtype, rngs=nnx.Rngs(0))
    self.out = nnx.Linear(64, 32, param_dtype=dtype, rngs=nnx.Rngs(1))

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def _loss(model):
  return jnp.sum(model(X).astype(jnp.float32) ** 2)


def _kernels(path, leaf):  # chosen by the path's end, as update sees it
  return jax.tree_util.keystr(path).endswith("['kernel']")


def _transformation(wrapped, layout, rounding, kernel, select=None):
  if kernel is not None:
    inner = ols.adam_8bit(1e-3, min_size=256, rounding=rounding, kernel=kernel)
  else:
    inner = ols.quantize_state(
      optax.adam(1e-3), min_size=256, rounding=rounding, layout=layout, select=select
    )
  return ols.dynamic_loss_scale(ols.master_weights(inner)) if wrapped else inner


CASES = {
  "quantize_state": (False, "leaf", None, None),
  "quantize_state, flat": (False, "flat", None, None),
  "quantize_state, select": (False, "leaf", None, _kernels),
  "adam_8bit": (False, "leaf", "xla", None),
  "all three": (True, "leaf", None, None),
  "all three, flat": (True, "flat", None, None),
}


def _bytes(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("case", CASES)
def test_nnx_optimizer_takes_the_steps_optax_takes(case, rounding):
  wrapped, layout, kernel, select = CASES[case]
  model = MLP(jnp.bfloat16 if wrapped else jnp.float32)
  tx = _transformation(wrapped, layout, rounding, kernel, select)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  # the same steps on the arrays, by optax
  graphdef, params = nnx.split(model, nnx.Param)
  params = nnx.as_pure(params)
  state = tx.init(params)

  def pure_loss(p):
    return _loss(nnx.merge(graphdef, p))

  @jax.jit
  def optax_step(p, s):
    scaled = (lambda p: ols.scale_loss(pure_loss(p), s)) if wrapped else pure_loss
    u, s = tx.update(jax.grad(scaled)(p), s, p)
    return optax.apply_updates(p, u), s

  @nnx.jit
  def nnx_step(model, optimizer):
    if wrapped:
      _, grads = nnx_value_and_grad(_loss)(optimizer, model)
      nnx_update(optimizer, model, grads)
    else:
      optimizer.update(model, nnx.grad(_loss)(model))

  for _ in range(3):
    nnx_step(model, optimizer)
    params, state = optax_step(params, state)
  assert _bytes(nnx.as_pure(nnx.state(model, nnx.Param))) == _bytes(params)
  opt_state = nnx.as_pure(optimizer.opt_state)
  assert jax.tree.structure(opt_state) == jax.tree.structure(state)
  assert _bytes(opt_state) == _bytes(state)
  # the moments of both kernels quantised, in one buffer a field when flat
  stored = ols.loss_scale_plan(state, params) if wrapped else None
  if stored is not None:
    assert [len(x.quantized_state) for x in stored.leaves] == [0, 2, 0, 2]


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("case", [c for c in CASES if not CASES[c][0]])
def test_a_transformation_given_the_variables_runs_on_their_arrays(case, rounding):
  _, layout, kernel, select = CASES[case]
  model = MLP(jnp.float32)
  tx = _transformation(False, layout, rounding, kernel, select)
  variables = nnx.state(model, nnx.Param)
  params = nnx.as_pure(variables)
  state, pure_state = tx.init(variables), tx.init(params)
  for _ in range(2):
    grads = nnx.grad(_loss)(model)  # a State of variables
    updates, state = tx.update(grads, state, variables)
    pure_updates, pure_state = tx.update(nnx.as_pure(grads), pure_state, params)
    assert jax.tree.structure(updates) == jax.tree.structure(grads)
    assert _bytes(updates) == _bytes(pure_updates)
  assert jax.tree.structure(nnx.as_pure(state)) == jax.tree.structure(pure_state)
  assert _bytes(state) == _bytes(pure_state)


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_adam_8bits_apply_gradients_on_the_variables_gives_them_back(kernel):
  # apply_gradients given a State of variables: new parameters in the
  # parameters' variables, the arrays and state those of the arrays' step
  model = MLP(jnp.float32)
  tx = ols.adam_8bit(1e-3, min_size=256, kernel=kernel)
  variables = nnx.state(model, nnx.Param)
  params = nnx.as_pure(variables)
  state, pure_state = tx.init(variables), tx.init(params)
  grads = nnx.grad(_loss)(model)
  new, state = tx.apply_gradients(grads, state, variables)
  pure_new, pure_state = tx.apply_gradients(nnx.as_pure(grads), pure_state, params)
  assert jax.tree.structure(new) == jax.tree.structure(variables)
  assert _bytes(new) == _bytes(pure_new)
  assert _bytes(state) == _bytes(pure_state)
  assert all(a != b for a, b in zip(_bytes(new), _bytes(params), strict=True))
