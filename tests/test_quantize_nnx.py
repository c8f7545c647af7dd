"""The 8-bit state in ``nnx.Optimizer``: the steps optax takes on the same arrays.

``nnx.Optimizer`` inits its transformation on the model's ``nnx.Param``
variables, so a moment optax makes is a variable too; ``nnx.Optimizer``'s
update writes the new state's arrays back into those variables, which hold
one array each. A quantised moment is a ``QuantizedLeaf`` (codes and
scales), so it must not stay inside a variable: it did, and the first
update wrote a dict of its codes and scales into it, which the next update
refused as a state of other parameters.
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


def _loss(model):
  return jnp.sum(model(X).astype(jnp.float32) ** 2)


def _transformation(wrapped, layout, rounding, kernel):
  if kernel is not None:
    inner = ols.adam_8bit(1e-3, min_size=256, rounding=rounding, kernel=kernel)
  else:
    inner = ols.quantize_state(
      optax.adam(1e-3), min_size=256, rounding=rounding, layout=layout
    )
  return ols.dynamic_loss_scale(ols.master_weights(inner)) if wrapped else inner


CASES = {
  "quantize_state": (False, "leaf", None),
  "quantize_state, flat": (False, "flat", None),
  "adam_8bit": (False, "leaf", "xla"),
  "all three": (True, "leaf", None),
  "all three, flat": (True, "flat", None),
}


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("case", CASES)
def test_nnx_optimizer_takes_the_steps_optax_takes(case, rounding):
  wrapped, layout, kernel = CASES[case]
  dtype = jnp.bfloat16 if wrapped else jnp.float32
  model = nnx.Linear(256, 64, param_dtype=dtype, rngs=nnx.Rngs(0))
  tx = _transformation(wrapped, layout, rounding, kernel)
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
  got = nnx.as_pure(nnx.state(model, nnx.Param))
  assert [np.asarray(x).tobytes() for x in jax.tree.leaves(got)] == [
    np.asarray(x).tobytes() for x in jax.tree.leaves(params)
  ]
  opt_state = nnx.as_pure(optimizer.opt_state)
  assert jax.tree.structure(opt_state) == jax.tree.structure(state)
  assert [np.asarray(x).tobytes() for x in jax.tree.leaves(opt_state)] == [
    np.asarray(x).tobytes() for x in jax.tree.leaves(state)
  ]
