"""autocast keeps what the function chose: only float32 work is cast.

A matmul whose operands the function put in a 16-bit dtype itself, or
whose result type it set, keeps that dtype; complex, integer and boolean
values are never rewritten. Each over every rule kind: the allow, deny and
infer lists and the float8, MXFP8 and NVFP4 recipes.
"""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import versions
from jax import lax

import optax_lossscale as ols

BF16 = jnp.dtype(jnp.bfloat16)
RECIPES = [
  None,
  "float8",
  pytest.param("mxfp8", marks=versions.block_formats),
  pytest.param("nvfp4", marks=versions.block_formats),
]
# 32 x 64 x 3744 = 119808: finite in bfloat16, above float16's 65504.
A = jnp.full((2, 32), 64.0, jnp.float32)
B = jnp.full((32, 2), 58.5, jnp.float32)
BIG = 64.0 * 58.5 * 32


def _lone(matmul):
  """A recipe for a function with one matmul: its output layer, which NVFP4
  keeps by default."""
  return ols.NVFP4Matmul(keep=()) if matmul == "nvfp4" else matmul


def _own_operands(a, b):
  return a.astype(jnp.bfloat16) @ b.astype(jnp.bfloat16)


def _own_result_type(a, b):
  return jnp.dot(a, b, preferred_element_type=jnp.bfloat16)


@pytest.mark.sampled
@pytest.mark.parametrize("matmul", RECIPES)
@pytest.mark.parametrize("f", [_own_operands, _own_result_type])
def test_a_matmul_the_function_put_in_bfloat16_stays_bfloat16(f, matmul):
  fast = ols.autocast(f, compute_dtype=jnp.float16, matmul=_lone(matmul))
  got = fast(A, B)
  assert got.dtype == BF16
  assert bool(jnp.all(jnp.isfinite(got)))  # float16 would overflow to inf
  if matmul is None:  # the values are exact in every recipe but NVFP4's
    np.testing.assert_array_equal(got.astype(jnp.float32), BIG)
  else:
    np.testing.assert_allclose(got.astype(jnp.float32), BIG, rtol=0.1)
  (found,) = ols.list_matmuls(fast, A, B)
  assert found.out_dtype == "bfloat16"
  want = {None: "bfloat16" if f is _own_operands else "float16"}.get(matmul, matmul)
  assert found.precision == want


@pytest.mark.parametrize(
  "name, f",
  [
    ("deny: exp", lambda x: jnp.exp(x.astype(jnp.bfloat16))),
    ("infer: add", lambda x: x.astype(jnp.bfloat16) + x.astype(jnp.bfloat16)),
    ("infer: tanh", lambda x: jnp.tanh(x.astype(jnp.bfloat16))),
    ("clear: reshape", lambda x: x.astype(jnp.bfloat16).reshape(-1)),
  ],
)
def test_elementwise_work_the_function_put_in_bfloat16_stays_bfloat16(name, f):
  x = jnp.linspace(-2, 2, 8, dtype=jnp.float32)
  fast = ols.autocast(f, compute_dtype=jnp.float16)
  eqns = jax.make_jaxpr(fast)(x).eqns[0].params["jaxpr"].eqns
  # no float16 anywhere: nothing of the function's own bfloat16 work is recast
  assert not any(v.aval.dtype == jnp.float16 for e in eqns for v in e.outvars), name
  np.testing.assert_array_equal(fast(x), f(x))


C = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4)) * (1 + 1j), jnp.complex64)
INTS = jnp.arange(16, dtype=jnp.int32).reshape(4, 4)
NON_REAL = {
  "complex matmul read by real": lambda c, i: jnp.sum(jnp.real(c @ c)),
  "complex matmul read by abs": lambda c, i: jnp.sum(jnp.abs(c @ c)),
  "complex matmul read by conj": lambda c, i: jnp.real(jnp.sum(jnp.conj(c @ c))),
  "complex exp (deny)": lambda c, i: jnp.sum(jnp.real(jnp.exp(c))),
  "complex mul (infer)": lambda c, i: jnp.sum(jnp.imag(c * c + c)),
  "complex einsum": lambda c, i: jnp.sum(jnp.angle(jnp.einsum("ij,jk->ik", c, c))),
  "integer matmul read in float32": lambda c, i: jnp.sum((i @ i).astype(jnp.float32)),
  "integer dot_general": lambda c, i: lax.dot_general(
    i.astype(jnp.int8), i.astype(jnp.int8), (((1,), (0,)), ((), ()))
  ).sum(),
  "boolean matmul": lambda c, i: jnp.sum(((i > 7) @ (i > 3)).astype(jnp.float32)),
}


@pytest.mark.sampled
@pytest.mark.parametrize("matmul", RECIPES)
@pytest.mark.parametrize("name", NON_REAL)
def test_non_real_values_are_never_rewritten(name, matmul):
  f = NON_REAL[name]
  fast = ols.autocast(f, compute_dtype=jnp.float16, matmul=matmul)
  got, want = fast(C, INTS), f(C, INTS)
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("matmul", RECIPES)
def test_float32_work_is_still_cast(matmul):
  f = lambda a, b: jnp.tanh(a @ b)  # noqa: E731
  fast = ols.autocast(f, compute_dtype=jnp.float16, matmul=_lone(matmul))
  (found,) = ols.list_matmuls(fast, A / 64, B / 64)
  assert found.precision == (matmul or "float16") and found.out_dtype == "float16"
  assert fast(A / 64, B / 64).dtype == jnp.float32


# --- every output autocast can meet ---------------------------------------------

#: Outputs beside the loss, each made inside the function from its input ``x``
#: (float32): constants of every dtype (a jaxpr literal where JAX makes one),
#: Python numbers, ``None``, NumPy constants it closes over, and its input
#: passed straight through.
#: float8 products of exact values come back exact (jax >= 0.10's XLA).
F8_EXACT = versions.JAX >= (0, 10)
#: jax 0.4 raises "Reverse-mode differentiation does not work for
#: lax.while_loop" on autocast's while loop carrying an output computed from
#: the input (the plain function differentiates): measured on 0.4.35.
OLD_WHILE = versions.JAX < (0, 10)
X_OUTPUTS = ("the input", "the input, reshaped", "a float32 result")

OUTPUTS = {
  "bool array": lambda x: jnp.array(True),
  "Python bool": lambda x: True,
  "bool vector": lambda x: jnp.array([True, False]),
  "int32 array": lambda x: jnp.array(3),
  "Python int": lambda x: 3,
  "uint8 array": lambda x: jnp.arange(3, dtype=jnp.uint8),
  "int8 scalar": lambda x: jnp.int8(-2),
  "float32 array": lambda x: jnp.array(1.5, jnp.float32),
  "Python float": lambda x: 2.5,
  "float16 array": lambda x: jnp.array([1.5, 65504.0], jnp.float16),
  "bfloat16 array": lambda x: jnp.array(1.5, jnp.bfloat16),
  "complex64 array": lambda x: jnp.array(1 + 2j, jnp.complex64),
  "None": lambda x: None,
  "NumPy float32": lambda x: np.float32(2.0),
  "NumPy bool array": lambda x: np.array([True, False]),
  "NumPy uint8 array": lambda x: np.arange(3, dtype=np.uint8),
  "the input": lambda x: x,
  "the input, reshaped": lambda x: x.reshape(-1),
  "a float32 result": lambda x: jnp.sin(x),
  "a boolean result": lambda x: x > 1,
}


def _loss_and(make, form):
  """``x -> (loss, output)``: the output made by ``make`` reached by ``form``."""

  def loss(x):
    return jnp.sum(x @ x)

  def direct(x):
    return loss(x), make(x)

  def scan(x):  # a loop's stacked outputs and its carry
    carry, ys = lax.scan(lambda c, _: (c, make(x)), make(x), length=2)
    return loss(x), (carry, ys)

  def while_loop(x):
    _, out = lax.while_loop(
      lambda s: s[0] < 2, lambda s: (s[0] + 1, make(x)), (0, make(x))
    )
    return loss(x), out

  def cond(x):  # a branch's output
    return loss(x), lax.cond(x[0, 0] > 0, lambda: make(x), lambda: make(x))

  def checkpoint(x):
    return jax.checkpoint(lambda x: (loss(x), make(x)))(x)

  def jit(x):  # a call's output
    return jax.jit(lambda x: (loss(x), make(x)))(x)

  return {
    "direct": direct,
    "scan": scan,
    "while": while_loop,
    "cond": cond,
    "checkpoint": checkpoint,
    "jit": jit,
  }[form]


def _call(f, x):
  return f(x)


def _grad(f, x):
  grads, out = jax.grad(f, has_aux=True)(x)
  return grads, out


def _value_and_grad(f, x):
  (loss, out), grads = jax.value_and_grad(f, has_aux=True)(x)
  return (loss, grads), out


def _assert_same_outputs(got, want):
  """Same tree, dtypes, weak types, shapes and values."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert (g.dtype, g.weak_type, g.shape) == (w.dtype, w.weak_type, w.shape)
    np.testing.assert_array_equal(g, w)


@pytest.mark.sampled
@pytest.mark.parametrize("entry", [_call, _grad, _value_and_grad])
@pytest.mark.parametrize(
  "form", ["direct", "scan", "while", "cond", "checkpoint", "jit"]
)
@pytest.mark.parametrize("matmul", [None, "float8"])
@pytest.mark.parametrize("output", OUTPUTS)
def test_every_output_comes_back_as_from_the_plain_function(
  output, matmul, form, entry
):
  # x holds small integers: the loss, its gradient and the outputs computed
  # from x are exact in bfloat16 and float8, so the plain function (jitted,
  # as autocast is) is the reference for every value.
  x = jnp.asarray([[0.0, 1.0], [2.0, -1.0]], jnp.float32)
  f = _loss_and(OUTPUTS[output], form)
  fast = ols.autocast(f, compute_dtype=jnp.bfloat16, matmul=matmul)
  if form == "while" and entry is not _call and output in X_OUTPUTS and OLD_WHILE:
    pytest.skip(
      "jax 0.4 cannot reverse-differentiate autocast's rewritten while loop "
      "when an auxiliary output is computed from the input in it"
    )
  want_main, want = jax.jit(lambda x: entry(f, x))(x)
  got_main, got = entry(fast, x)
  _assert_same_outputs(got, want)
  if matmul == "float8" and (entry is not _call or not F8_EXACT):
    # The gradient of a float32 input is float32, rescaled by the product of
    # two inverse scales that are not powers of two (and on jax 0.4 the loss
    # too, its XLA rescaling by an inexact reciprocal): within one float32
    # rounding of the exact values (2 units in the last place).
    chex.assert_trees_all_close(got_main, want_main, rtol=2**-22, atol=0)
    return
  _assert_same_outputs(got_main, want_main)


def test_float64_outputs_come_back_as_from_the_plain_function():
  with versions.x64():
    x = jnp.asarray([[0.0, 1.0], [2.0, -1.0]], jnp.float32)
    wide = jnp.asarray([1.0, 1e-300], jnp.float64)

    def f(x, wide):
      extra = (jnp.array(1.5), 2.5, jnp.array(3), wide, -wide, np.float64(1e300))
      return jnp.sum(x @ x), extra

    fast = ols.autocast(f, compute_dtype=jnp.bfloat16)
    want = jax.jit(f)(x, wide)
    assert jnp.dtype(want[1][0].dtype) == jnp.float64  # x64 is on
    _assert_same_outputs(fast(x, wide)[1], want[1])
    _, got = jax.grad(fast, has_aux=True)(x, wide)
    _assert_same_outputs(got, want[1])


# --------------------------------------------------------------------------
# Primitives whose jaxpr combines scalars (scatter-add's update_jaxpr,
# lax.reduce's computation): first-order, run in the dtypes written. They
# raised NotImplementedError as higher-order primitives.
# --------------------------------------------------------------------------

_IDX = jnp.array([0, 1, 1, 3])

# (function of (w, x), differentiable by JAX itself)
COMBINERS = {
  "scatter-add": (lambda w, x: jnp.zeros((6, 8)).at[_IDX].add(x @ w), True),
  "scatter-mul": (lambda w, x: jnp.ones((6, 8)).at[_IDX].multiply(x @ w), False),
  "scatter-max": (lambda w, x: jnp.zeros((6, 8)).at[_IDX].max(x @ w), True),
  "scatter-min": (lambda w, x: jnp.zeros((6, 8)).at[_IDX].min(x @ w), True),
  "segment_sum": (lambda w, x: jax.ops.segment_sum(x @ w, _IDX, 6), True),
  "bincount": (
    lambda w, x: jnp.bincount(_IDX, weights=(x @ w)[:, 0], length=6), True
  ),
  "lax.reduce": (
    lambda w, x: lax.reduce(
      (x @ w, x @ w), (0.0, 1.0), lambda a, b: (a[0] + b[0], a[1] * b[1]), (0,)
    )[1],
    True,
  ),
  "lax.reduce_window": (
    lambda w, x: lax.reduce_window(
      x @ w, 0.0, lambda a, b: a + jnp.sin(b), (2, 2), (1, 1), "VALID"
    ),
    False,
  ),
  "the gradient of a take": (
    lambda w, x: jax.grad(lambda w: jnp.take(x @ w, _IDX, axis=0).sum())(w), True
  ),
}  # fmt: skip


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=str)
@pytest.mark.parametrize("case", COMBINERS)
def test_primitives_that_combine_scalars_run_as_written(case, dtype):
  fun, differentiable = COMBINERS[case]
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.normal(size=(8, 8)) * 0.3, jnp.float32)
  x = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
  cast = ols.autocast(fun, compute_dtype=dtype)
  out, want = cast(w, x), fun(w, x)
  assert out.dtype == want.dtype == jnp.float32
  tol = 3e-2 if dtype == jnp.bfloat16 else 3e-3
  np.testing.assert_allclose(out, want, rtol=tol, atol=tol)
  chex.assert_trees_all_equal(jax.jit(cast)(w, x), out)
  # the matmul before it still runs in the compute dtype
  (matmul, *_) = ols.list_matmuls(cast, w, x)
  assert matmul.precision == jnp.dtype(dtype).name
  if differentiable:
    grad = jax.grad(lambda w: cast(w, x).sum())(w)
    assert grad.dtype == jnp.float32
    np.testing.assert_allclose(
      grad, jax.grad(lambda w: fun(w, x).sum())(w), rtol=tol, atol=tol * 10
    )


# jax.grad, jax.vmap and jax.jit copy an autocast function's attributes
# (functools.wraps): list_matmuls listed the inner function instead (no
# backward matmuls under grad, the batched shapes under vmap).
@pytest.mark.parametrize(
  "transform",
  [
    lambda g: jax.grad(g, (0, 1)),
    lambda g: jax.vmap(g, (0, None)),
    lambda g: jax.jit(g),
  ],
  ids=["grad", "vmap", "jit"],
)
def test_list_matmuls_refuses_a_transformed_autocast_function(transform):
  g = ols.autocast(lambda v, w: jnp.tanh(v @ w).sum(), compute_dtype=jnp.bfloat16)
  x, w = jnp.ones((6, 32)), jnp.ones((32, 16))
  with pytest.raises(ValueError, match="list the autocast function itself"):
    ols.list_matmuls(transform(g), x, w)
  (m,) = ols.list_matmuls(g, x, w)  # the function itself
  assert m.precision == "bfloat16"
  assert len(ols.list_matmuls(jax.grad(lambda v, w: jnp.tanh(v @ w).sum()), x, w)) == 2


@pytest.mark.parametrize(
  "fun",
  [
    lambda a, b: a.astype(jnp.int32) @ b.astype(jnp.int32),
    lambda a, b: a.astype(jnp.int32) @ b,
    lambda a, b: a.astype(jnp.complex64) @ b.astype(jnp.complex64),
  ],
  ids=["integer", "integer x float", "complex"],
)
@pytest.mark.parametrize("matmul", [None, "float8"])
@pytest.mark.standard_promotion  # an integer times a float
def test_list_matmuls_lists_the_matmuls_autocast_leaves_as_written(fun, matmul):
  """They ran, as written, and were missing from the listing."""
  x, w = jnp.ones((8, 32)), jnp.ones((32, 16))
  cast = ols.autocast(fun, compute_dtype=jnp.bfloat16, matmul=matmul)
  assert ols.list_matmuls(cast, x, w) == ols.list_matmuls(fun, x, w)
  (m,) = ols.list_matmuls(cast, x, w)
  assert m.out_dtype == cast(x, w).dtype.name


def _nested_operands():
  k = jax.random.split(jax.random.key(3), 4)
  x = jax.random.normal(k[0], (32, 128))
  ws = [jax.random.normal(kk, (128, 128)) / 8 for kk in k[1:]]
  return x, *ws


@pytest.mark.parametrize("outer", RECIPES, ids=str)
@pytest.mark.parametrize("inner", RECIPES, ids=str)
def test_an_inner_autocast_decides_for_its_own_matmuls(inner, outer):
  """The innermost autocast decides (as nested autocast regions do in
  PyTorch): an outer one does not rewrite again what an inner one made, its
  bfloat16 matmuls and its recipe's emulation GEMMs (they were quantised a
  second time, with a CustomRuleWarning about the library's own rule).
  Values and gradients bit for bit, no warning; a listing shows the inner
  matmul as it runs and the outer's own by the outer's recipe."""
  x, w1, w2, w3 = _nested_operands()
  part = ols.autocast(
    lambda x, w: jnp.tanh(x @ w),
    compute_dtype=jnp.bfloat16,
    matmul=inner,
  )
  outer_of = lambda f: ols.autocast(  # noqa: E731
    f, compute_dtype=jnp.bfloat16, matmul=outer
  )
  loss = lambda f: lambda x, w: jnp.sum(f(x, w) ** 2)  # noqa: E731
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    got = jax.jit(jax.value_and_grad(loss(outer_of(part)), argnums=(0, 1)))(x, w1)
    want = jax.jit(jax.value_and_grad(loss(part), argnums=(0, 1)))(x, w1)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      assert np.asarray(a).tobytes() == np.asarray(b).tobytes()

    def model(x, w1, w2, w3):  # the part, then a hidden and an output layer
      return (jnp.tanh(part(x, w1) @ w2) @ w3).sum()

    listed = ols.list_matmuls(outer_of(model), x, w1, w2, w3)
  inner_rows = [m for m in listed if m.kept == "inner autocast"]
  assert inner_rows  # as they run (a recipe's emulation GEMMs: batched)
  rest = outer_of(lambda h, w2, w3: (jnp.tanh(h @ w2) @ w3).sum())
  own = [(m.precision, m.kept) for m in listed if m.kept != "inner autocast"]
  assert own == [(m.precision, m.kept) for m in ols.list_matmuls(rest, x, w2, w3)]


#: Every XLA compile in this process (jax.monitoring has no unregister in
#: JAX 0.4): ``test_an_unhashable_static_argument_...`` counts them.
_COMPILES: list = []
jax.monitoring.register_event_duration_secs_listener(
  lambda event, *_, **__: (
    _COMPILES.append(event) if event.endswith("backend_compile_duration") else None
  )
)


class _Config:
  """A static argument with ``__eq__`` and no ``__hash__``."""

  __hash__ = None  # type: ignore[assignment]

  def __init__(self, depth):
    self.depth = depth

  def __eq__(self, other):
    return isinstance(other, _Config) and other.depth == self.depth


def test_an_unhashable_static_argument_compiles_nothing_again_and_nests():
  """Rewritten at every call (it cannot key a cache), op by op: nothing is
  compiled again after the first call; under an outer autocast the inner
  one still decides for its matmul."""

  def f(cfg, w, x):
    for _ in range(cfg.depth):
      x = jnp.tanh(x @ w)
    return x.sum()

  g = ols.autocast(f, compute_dtype=jnp.bfloat16)
  w, x, cfg = jnp.full((64, 64), 0.01), jnp.ones((8, 64)), _Config(3)
  first = g(cfg, w, x)
  before = len(_COMPILES)
  again = [g(cfg, w, x) for _ in range(3)]
  assert len(_COMPILES) == before
  assert all(bool(a == first) for a in again)
  outer = ols.autocast(
    lambda cfg, w, x: g(cfg, w, x) * 2, compute_dtype=jnp.bfloat16, matmul="float8"
  )
  # both compiled (op by op, XLA may round bfloat16 otherwise than fused)
  got = jax.jit(lambda w, x: outer(cfg, w, x))(w, x)
  want = jax.jit(lambda w, x: g(cfg, w, x) * 2)(w, x)
  assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
