"""float8 autocast on Flax models: every matmul in float8, typical-error bounds.

The bound (derived in ``test_float8.py``'s docstring): a matmul with
rounding errors of mean zero has relative root-mean-square error
``sqrt(2 / 3) u`` forward (both operands e4m3, ``u = 1/16``) and
``sqrt((u_e5m2**2 + u_e4m3**2) / 3)`` backward (``u_e5m2 = 1/8``); over a
path of ``n`` matmuls the errors add in quadrature, and we allow three times
the result. Outputs are compared with float32 over the whole output array,
gradients over all parameters together (relative Frobenius norms).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_lossscale as ols
from optax_lossscale._lowbit import float8 as _float8

pytest.importorskip("flax", reason="the models are Flax's")
from jaxprs import eqns as _eqns  # noqa: E402
from models import CNN, MLP, Attention, ScanRemat  # noqa: E402

pytestmark = pytest.mark.standard_promotion  # Flax layers
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
U4, U5 = 2.0**-4, 2.0**-3


# name: (model, input shape, matmuls on the longest path)
MODELS = {
  "mlp": (MLP, (16, 32), 3),
  "attention": (Attention, (4, 6, 16), 5),
  "cnn": (CNN, (4, 8, 8, 3), 1),
  "scan+remat": (ScanRemat, (4, 5, 16), 6),
}


def _setup(name):
  cls, shape, depth = MODELS[name]
  model = cls()
  x = jnp.asarray(np.random.default_rng(0).normal(size=shape), jnp.float32)
  variables = jax.jit(model.init)(jax.random.key(0), x)
  params = variables["params"]
  apply = lambda p, x: model.apply({**variables, "params": p}, x)
  loss = lambda p, x: -jnp.mean(jax.nn.log_softmax(apply(p, x))[:, 0])
  return apply, loss, params, x, depth


def _relative(got, want):
  flat = lambda tree: np.concatenate(
    [np.asarray(t, np.float64).ravel() for t in jax.tree.leaves(tree)]
  )
  got, want = flat(got), flat(want)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("name", MODELS)
def test_outputs_and_gradients_within_the_float8_bound(name):
  apply, loss, params, x, n = _setup(name)
  fast = lambda f: ols.autocast(f, compute_dtype=jnp.bfloat16, matmul="float8")
  # Output and gradients in one program each, float8 and float32.
  both = lambda apply, loss: jax.jit(lambda p, x: (apply(p, x), jax.grad(loss)(p, x)))
  out, grads = both(fast(apply), fast(loss))(params, x)
  want_out, want_grads = both(apply, loss)(params, x)
  assert out.dtype == jnp.float32
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  forward = 3 * math.sqrt(n * 2 / 3) * U4
  backward = 3 * math.sqrt(n * 2 / 3 * U4**2 + n * (U5**2 + U4**2) / 3)
  assert _relative(out, want_out) <= forward
  assert _relative(grads, want_grads) <= backward


@pytest.mark.parametrize("name", MODELS)
def test_every_matmul_has_float8_operands_forward_and_backward(name):
  _, loss, params, x, _ = _setup(name)
  recipe = ols.Float8Matmul(attention=True)  # attention's matmuls too
  fast = ols.autocast(loss, compute_dtype=jnp.bfloat16, matmul=recipe)
  eqns = list(_eqns(jax.make_jaxpr(jax.grad(fast))(params, x).jaxpr))
  dots = [e for e in eqns if e.primitive.name == "dot_general"]
  assert dots
  made = {v: e for e in eqns for v in e.outvars}

  def quantised(v):  # the float8 type a tiny dot's float32 operand came from
    e = made.get(v)
    if v.aval.dtype == jnp.float32 and e and e.primitive.name == "convert_element_type":
      return e.invars[0].aval.dtype
    if v.aval.dtype == jnp.float32 and e is None:
      return "a loop's input"  # converted outside the loop body (scan + remat)
    return v.aval.dtype

  for e in dots:
    # A tiny dot multiplies the float8 values in float32 (exact), where XLA's
    # GPU backend would multiply them in float16 (inexact); the others
    # multiply float8 arrays.
    tiny = _float8.small(
      *(v.aval.shape for v in e.invars), e.params["dimension_numbers"]
    )
    operands = {v.aval.dtype for v in e.invars}
    dtypes = {quantised(v) for v in e.invars}
    if tiny:
      assert operands == {jnp.dtype(jnp.float32)}, e
      dtypes -= {"a loop's input"}
      assert dtypes and dtypes <= {E4M3, E5M2}, (e, dtypes)
    else:
      assert dtypes in ({E4M3}, {E4M3, E5M2}), (e, dtypes)
  # The backward products: an e5m2 gradient with an e4m3 saved operand.
  assert any({quantised(v) for v in e.invars} == {E4M3, E5M2} for e in dots)
  # No other computation sees float8 (calls and loops may carry the saved
  # float8 operands); convolutions run in bfloat16.
  for e in eqns:
    if any(hasattr(getattr(p, "jaxpr", p), "eqns") for p in e.params.values()):
      continue  # a call, loop or custom_vjp: its body's equations are checked
    if e.primitive.name == "conv_general_dilated":
      assert {v.aval.dtype for v in e.invars} == {jnp.dtype(jnp.bfloat16)}
    elif e.primitive.name not in (
      "dot_general",
      "convert_element_type",
      "optimization_barrier",  # before a tiny dot's widening (_lowbit.exact)
    ):
      assert not any(
        getattr(v, "aval", None) is not None and v.aval.dtype in (E4M3, E5M2)
        for v in (*e.invars, *e.outvars)
      ), e
