"""float8 matmuls in autocast: error bounds, the rewritten jaxpr, edge cases.

The bounds come from the float8 formats. Rounding ``x * scale`` to a format
with ``m`` mantissa bits errs by at most ``u = 2**-(m + 1)`` relative
(e4m3: 1/16, e5m2: 1/8) where the result is normal, and by at most half the
smallest subnormal ``d`` below that; dividing by the scale back, one entry's
reconstruction errs by ``E(x) = u |x| + d / scale`` (plus float32 rounding
of the scale, ``3 * 2**-24`` relative). A product of two reconstructed
operands accumulated in float32 then errs, entry by entry, by at most
``E(a) |b| + |a| E(b) + E(a) E(b)`` summed over the contraction, plus
float32 accumulation (``(K + 3) * 2**-24`` relative to ``|a| |b|``). That
is the bound the single-matmul tests assert, forward (e4m3 x e4m3) and
backward (e5m2 gradient x e4m3 saved operand).

For whole models the worst case compounds into something useless, so the
model tests use the typical error instead: with rounding errors of mean zero
and variance ``u**2 / 3`` (uniform within half a unit), a matmul whose terms
have random signs (as at initialisation) has a relative root-mean-square
error of ``sqrt(2 / 3) u`` forward and ``sqrt((u_e5m2**2 + u_e4m3**2) / 3)``
backward; independent errors of ``n`` matmuls add in quadrature, and the
assertion allows three times that.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jaxprs import eqns

import optax_lossscale as ols
from optax_lossscale._lowbit import float8 as _float8

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
F32_ROUND = 2.0**-24


def _u(dtype):
  return float(jnp.finfo(dtype).eps) / 2


def _entry_error(x, dtype):
  """``E(x)``: the largest reconstruction error of each entry of ``x``."""
  x = jnp.abs(x.astype(jnp.float32))
  scale = _float8.current_scale(jnp.max(x), dtype)
  d = float(jnp.finfo(dtype).smallest_subnormal) / 2
  return (_u(dtype) + 3 * F32_ROUND) * x + d / scale


def _bound(bilinear, a, b, a_dtype, b_dtype, length):
  """The entrywise bound on ``bilinear(a, b)``'s error from quantising both."""
  ea, eb = _entry_error(a, a_dtype), _entry_error(b, b_dtype)
  abs_a, abs_b = jnp.abs(a), jnp.abs(b)
  gamma = (length + 3) * F32_ROUND
  return (
    bilinear(ea, abs_b)
    + bilinear(abs_a, eb)
    + bilinear(ea, eb)
    + gamma * bilinear(abs_a + ea, abs_b + eb)
  )


# (lhs shape, rhs shape, dimension numbers): a Dense layer, attention's
# scores (batch dimensions), and contractions over several, permuted axes.
DOTS = {
  "dense": ((4, 6, 32), (32, 24), (((2,), (0,)), ((), ()))),
  "attention": ((2, 5, 3, 8), (2, 7, 3, 8), (((3,), (3,)), ((0, 2), (0, 2)))),
  "two contractions": ((3, 7, 2), (2, 3, 5), (((2, 0), (0, 1)), ((), ()))),
  "batch last": ((6, 2, 5), (5, 6, 4), (((2,), (0,)), ((0,), (1,)))),
}


def _operand(rng, shape):
  """Normal entries spread over four decades: some quantise to subnormals."""
  x = rng.normal(size=shape) * 10.0 ** rng.uniform(-4, 0, size=shape)
  return jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize("name", DOTS)
def test_one_matmul_within_the_float8_bound_forward_and_backward(name):
  sa, sb, dn = DOTS[name]
  rng = np.random.default_rng(0)
  a, b = _operand(rng, sa), _operand(rng, sb)
  exact = lambda a, b: lax.dot_general(a, b, dn, precision="highest")
  length = max(int(np.prod(s)) for s in (sa, sb))
  g = _operand(rng, jax.eval_shape(exact, a, b).shape)

  @jax.jit  # one program (op by op, the bounds compiled dozens)
  def errors_and_bounds(a, b, g):
    got, vjp = jax.vjp(
      lambda a, b: _float8.dot_general(a, b, dn, jnp.float32, _float8.Float8Matmul()),
      a,
      b,
    )
    want, exact_vjp = jax.vjp(exact, a, b)
    bound = _bound(exact, a, b, E4M3, E4M3, length)
    # Cotangents are bilinear in (g, the other operand): the same bound with
    # the e5m2 gradient and the saved e4m3 operand.
    (da, db), (want_da, want_db) = vjp(g), exact_vjp(g)
    assert da.shape == a.shape and db.shape == b.shape
    lhs_t = lambda g, b: jax.vjp(lambda x: exact(x, b), a)[1](g)[0]
    rhs_t = lambda g, a: jax.vjp(lambda y: exact(a, y), b)[1](g)[0]
    return {
      "forward": (jnp.abs(got - want), bound),
      "typical": bound / exact(jnp.abs(a), jnp.abs(b)),
      "lhs": (jnp.abs(da - want_da), _bound(lhs_t, g, b, E5M2, E4M3, length)),
      "rhs": (jnp.abs(db - want_db), _bound(rhs_t, g, a, E5M2, E4M3, length)),
    }

  out = jax.tree.map(np.asarray, errors_and_bounds(a, b, g))
  err, bound = out["forward"]
  assert np.all(err <= bound), np.max(err - bound)
  assert np.max(err) > 0  # it was quantised
  # The bound is not vacuous: for a typical entry about 2u + u**2 = 0.13 of
  # |a| |b| (more where the subnormal term dominates a short contraction).
  assert np.median(out["typical"]) < 0.15
  for side in ("lhs", "rhs"):
    err, bound = out[side]
    assert np.all(err <= bound), (side, np.max(err - bound))


# DOTS' layouts, large enough for float8 GEMMs (``_float8.small`` widens a
# tiny product's operands to float32).
LARGE_DOTS = {
  "dense": DOTS["dense"],
  "attention": ((2, 50, 3, 16), (2, 70, 3, 16), DOTS["attention"][2]),
  "two contractions": ((3, 70, 20), (20, 3, 50), DOTS["two contractions"][2]),
  "batch last": ((6, 20, 50), (50, 6, 40), DOTS["batch last"][2]),
}


@pytest.mark.parametrize("name", LARGE_DOTS)
def test_each_gradient_product_keeps_the_forward_operand_order(name):
  """``d lhs = g . rhs`` and ``d rhs = lhs . g``: the output gradient takes
  the place of the operand whose cotangent it makes. Written ``g . lhs``, a
  weight's gradient comes out of XLA's GPU float8 GEMM transposed, and the
  update step reads it through a transposing kernel and copies the
  parameter and its moments (BENCHMARKS.md)."""
  sa, sb, dn = LARGE_DOTS[name]
  recipe = _float8.Float8Matmul()
  f = lambda a, b: _float8.dot_general(a, b, dn, jnp.float32, recipe)  # noqa: E731
  a, b = jnp.ones(sa), jnp.ones(sb)
  jaxpr = jax.make_jaxpr(lambda a, b, g: jax.vjp(f, a, b)[1](g))(a, b, f(a, b))
  dots = [
    [(v.aval.dtype, v.aval.shape) for v in e.invars]
    for e in eqns(jaxpr.jaxpr)
    if e.primitive.name == "dot_general"
  ]
  g = (E5M2, jax.eval_shape(f, a, b).shape)
  assert sorted(dots, key=str) == sorted(
    [[(E4M3, sa), (E4M3, sb)], [g, (E4M3, sb)], [(E4M3, sa), g]], key=str
  )


@pytest.mark.parametrize("name", DOTS)
def test_power_of_two_scales_are_exact_on_representable_values(name):
  # Small integers are exact in e4m3 and e5m2 after a power-of-two scale,
  # so the float8 product and its gradients equal float32's exactly.
  sa, sb, dn = DOTS[name]
  rng = np.random.default_rng(1)
  a, b = (jnp.asarray(rng.integers(-2, 3, s), jnp.float32) for s in (sa, sb))
  recipe = ols.Float8Matmul(power_of_two=True)
  f = lambda a, b: _float8.dot_general(a, b, dn, jnp.float32, recipe)
  out, vjp = jax.vjp(f, a, b)
  want, exact_vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, dn), a, b)
  g = jnp.asarray(rng.integers(-2, 3, out.shape), jnp.float32)
  np.testing.assert_array_equal(out, want)
  for got, ref in zip(vjp(g), exact_vjp(g), strict=True):
    np.testing.assert_array_equal(got, ref)


def test_bfloat16_results_add_only_bfloat16_rounding():
  sa, sb, dn = DOTS["dense"]
  rng = np.random.default_rng(2)
  a, b = _operand(rng, sa), _operand(rng, sb)
  f = lambda a, b: _float8.dot_general(a, b, dn, jnp.bfloat16, ols.Float8Matmul())
  exact = lambda a, b: lax.dot_general(a, b, dn, precision="highest")
  got = f(a, b)
  assert got.dtype == jnp.bfloat16
  # On top of the float32 bound: the float32 result rounded to bfloat16
  # (u = 2**-8); the bound allows (1 + u)**3 - 1 relative, room for the
  # power-of-two path's bfloat16 product and rescale.
  u = _u(jnp.bfloat16)
  mag = exact(jnp.abs(a), jnp.abs(b))
  bound = _bound(exact, a, b, E4M3, E4M3, 32) + ((1 + u) ** 3 - 1) * 1.2 * mag
  assert bool(jnp.all(jnp.abs(got.astype(jnp.float32) - exact(a, b)) <= bound))


def test_scales_of_edge_amaxes():
  fmax = float(jnp.finfo(E4M3).max)
  amax = jnp.array([0.0, jnp.inf, jnp.nan, -jnp.inf, 1e-30, 2.0, 1e38], jnp.float32)
  scale = _float8.current_scale(amax, E4M3)
  assert bool(jnp.all(jnp.isfinite(scale) & (scale > 0)))
  np.testing.assert_array_equal(scale[:4], 1.0)  # zero or not finite: 1
  assert float(scale[4]) == _float8.MAX_SCALE  # clamped
  np.testing.assert_allclose(scale[5:], fmax / amax[5:], rtol=1e-7)
  # The product of two inverse scales is a normal float32.
  assert float(1 / scale[4] ** 2) >= float(jnp.finfo(jnp.float32).tiny)
  pow2 = _float8.current_scale(amax, E4M3, power_of_two=True)
  mantissa, _ = np.frexp(np.asarray(pow2))
  np.testing.assert_array_equal(mantissa, 0.5)  # powers of two
  assert bool(jnp.all((pow2 <= scale) & (pow2 > scale / 2)))


def _dense_loss(w, x):
  return jnp.sum(jnp.tanh(x @ w) ** 2)


def test_an_all_zero_operand_gives_zeros_not_nans():
  w = jnp.ones((8, 4))
  f = ols.autocast(_dense_loss, compute_dtype=jnp.bfloat16, matmul="float8")
  value, grad = jax.value_and_grad(f)(w, jnp.zeros((3, 8)))
  assert float(value) == 0.0
  np.testing.assert_array_equal(grad, 0.0)
  # And an all-zero output gradient (a loss that does not depend on it).
  g = jax.grad(lambda w, x: 0.0 * f(w, x))(w, jnp.ones((3, 8)))
  np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_a_non_finite_entry_reaches_the_gradients_and_the_step_is_skipped(bad):
  x = jnp.ones((3, 8)).at[1, 2].set(bad)
  w = jnp.full((8, 4), 0.1)
  f = ols.autocast(_dense_loss, compute_dtype=jnp.bfloat16, matmul="float8")
  tx = ols.dynamic_loss_scale(optax.sgd(0.1))
  state = tx.init(w)
  loss, grads = jax.jit(ols.value_and_grad(f))(state, w, x)
  assert not bool(jnp.isfinite(loss))
  assert not bool(jnp.all(jnp.isfinite(grads)))
  updates, state = jax.jit(tx.update)(grads, state, w)
  np.testing.assert_array_equal(optax.apply_updates(w, updates), w)
  assert bool(ols.diagnostics(state)["last_step_skipped"])


def test_one_huge_entry_keeps_everything_finite():
  rng = np.random.default_rng(3)
  x = _operand(rng, (4, 16)).at[0, 0].set(1e30)
  w = _operand(rng, (16, 8))
  f = lambda x, w: _float8.dot_general(
    x, w, (((1,), (0,)), ((), ())), jnp.float32, ols.Float8Matmul()
  )
  out, vjp = jax.vjp(f, x, w)
  dx, dw = vjp(jnp.ones_like(out))
  assert all(bool(jnp.all(jnp.isfinite(t))) for t in (out, dx, dw))
  # Entries far below the huge one are lost (they quantise to 0), within
  # the bound; the huge one's row is right to e4m3 precision.
  exact = lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ())))
  bound = _bound(exact, x, w, E4M3, E4M3, 16)
  assert bool(jnp.all(jnp.abs(out - exact(x, w)) <= bound))
  np.testing.assert_allclose(out[0], exact(x, w)[0], rtol=0.15)


def test_a_float8_compute_dtype_points_to_the_matmul_option():
  for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
    with pytest.raises(ValueError, match="matmul='float8'"):
      ols.autocast(_dense_loss, compute_dtype=dtype)
  for bad in ("fp8", "float16", 8, True):
    with pytest.raises(ValueError, match="`matmul`"):
      ols.autocast(_dense_loss, compute_dtype=jnp.bfloat16, matmul=bad)
  with pytest.raises(ValueError, match="forward_dtype"):
    ols.Float8Matmul(forward_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="backward_dtype"):
    ols.Float8Matmul(backward_dtype="float32")
  with pytest.raises(ValueError, match="power_of_two"):
    ols.Float8Matmul(power_of_two="yes")
  for bad in ("fast", "Forward", True, None, ("forward",)):
    with pytest.raises(ValueError, match="fast_accumulation"):
      ols.Float8Matmul(fast_accumulation=bad)
  if hasattr(jnp, "float8_e8m0fnu"):  # a scale format: no sign, no zero
    with pytest.raises(ValueError, match="forward_dtype"):
      ols.Float8Matmul(forward_dtype=jnp.float8_e8m0fnu)
    with pytest.raises(ValueError, match="matmul='float8'"):
      ols.autocast(_dense_loss, compute_dtype=jnp.float8_e8m0fnu)


@pytest.mark.parametrize(
  "fast, forward, backward",
  [
    ("forward", None, lax.Precision.HIGHEST),  # the default
    ("all", None, None),
    ("none", lax.Precision.HIGHEST, lax.Precision.HIGHEST),
  ],
)
def test_fast_accumulation_sets_each_products_precision(fast, forward, backward):
  """A float8 dot with the default precision lets a GPU's cuBLASLt accumulate
  with fewer bits than float32; ``HIGHEST`` asks for float32. The forward
  product and the two gradient products each get the recipe's, in a layer
  and under ``autocast`` (batched and 3-d operands included); on a CPU the
  gradients are the same bits whichever it is."""
  recipe = ols.Float8Matmul(fast_accumulation=fast, attention=True)
  assert recipe.precision(backward=False) == forward
  assert recipe.precision(backward=True) == backward

  def loss(w, x):
    h = jnp.einsum("btk,kn->btn", x, w)
    return jnp.sum(jnp.einsum("btn,bsn->bts", h, h) ** 2)

  w = jax.random.normal(jax.random.key(0), (32, 48))
  x = jax.random.normal(jax.random.key(1), (2, 40, 32))
  f = ols.autocast(loss, compute_dtype=jnp.bfloat16, matmul=recipe)
  jaxpr = jax.make_jaxpr(jax.grad(f))(w, x).jaxpr
  dots = [e for e in eqns(jaxpr) if e.primitive.name == "dot_general"]
  assert len(dots) == 2 * 3  # two float8 matmuls, each a product and two gradients
  # Precision (a, b) of each dot: the forward ones before the gradients'.
  got = [e.params["precision"] for e in dots]
  want = (None if p is None else (p, p) for p in [forward] * 2 + [backward] * 4)
  assert [None if g is None else tuple(g) for g in got] == list(want)
  default = ols.autocast(
    loss, compute_dtype=jnp.bfloat16, matmul=ols.Float8Matmul(attention=True)
  )
  grads = jax.grad(f, argnums=(0, 1))(w, x)
  for a, b in zip(grads, jax.grad(default, argnums=(0, 1))(w, x), strict=True):
    np.testing.assert_array_equal(a, b)


def test_forward_mode_differentiation_raises_instead_of_a_wrong_hessian():
  w, x = jnp.ones((3, 3)), jnp.ones((4, 3))
  f = ols.autocast(
    lambda w, x: jnp.sum((x @ w) @ w), compute_dtype=jnp.bfloat16, matmul="float8"
  )
  assert jax.grad(f)(w, x).shape == w.shape
  with pytest.raises(NotImplementedError, match="reverse mode"):
    jax.hessian(f)(w, x)
  with pytest.raises(NotImplementedError, match="reverse mode"):
    jax.jvp(jax.grad(f), (w, x), (w, x))


def test_empty_operands_give_empty_or_zero_results():
  f = ols.autocast(lambda a, b: a @ b, compute_dtype=jnp.bfloat16, matmul="float8")
  assert f(jnp.ones((0, 4)), jnp.ones((4, 3))).shape == (0, 3)
  np.testing.assert_array_equal(f(jnp.ones((2, 0)), jnp.ones((0, 3))), 0.0)
  g = jax.grad(lambda b: jnp.sum(f(jnp.ones((0, 4)), b)))(jnp.ones((4, 3)))
  np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize(
  "lhs, rhs, dn, tiny",
  [
    ((2, 4), (4, 2), (((1,), (0,)), ((), ())), True),  # (2 + 2) * 4 = 16
    ((31, 16), (16, 31), (((1,), (0,)), ((), ())), True),  # 992
    ((32, 16), (16, 32), (((1,), (0,)), ((), ())), False),  # 1024
    # Batch axes are not counted; free axes multiply.
    ((64, 2, 4), (64, 4, 2), (((2,), (1,)), ((0,), (0,))), True),
    ((2, 3, 32), (32, 40), (((2,), (0,)), ((), ())), False),  # (6 + 40) * 32
    # No operand with a free axis longer than 1: a vector dot, any length.
    ((1, 4096), (4096, 1), (((1,), (0,)), ((), ())), True),
    ((4096,), (4096,), (((0,), (0,)), ((), ())), True),
  ],
)
def test_a_tiny_matmul_multiplies_its_float8_values_in_float32(lhs, rhs, dn, tiny):
  # XLA's GPU backend keeps a tiny dot out of cuBLAS and multiplies float8
  # operands in float16 (448 * 448 overflows it); in float32 the products of
  # float8 values are exact.
  assert _float8.small(lhs, rhs, dn) is tiny
  recipe = ols.Float8Matmul(power_of_two=True)  # exact on ones
  f = lambda a, b: _float8.dot_general(a, b, dn, jnp.float32, recipe)
  a, b = jnp.ones(lhs), jnp.ones(rhs)
  jaxpr = jax.make_jaxpr(f)(a, b).jaxpr
  (dot,) = [e for e in eqns(jaxpr) if e.primitive.name == "dot_general"]
  operands = {v.aval.dtype for v in dot.invars}
  assert operands == ({jnp.dtype(jnp.float32)} if tiny else {E4M3}), operands
  np.testing.assert_array_equal(f(a, b), lax.dot_general(a, b, dn))


def test_the_default_rescale_is_unbiased_in_bfloat16():
  # A scale that is not a power of two (448 / 1) must not be rounded to
  # bfloat16 before the rescale: 4 ones times 4 ones is exactly 4.
  dn = (((1,), (0,)), ((), ()))
  for recipe in (ols.Float8Matmul(), ols.Float8Matmul(power_of_two=True)):
    out = _float8.dot_general(
      jnp.ones((2, 4)), jnp.ones((4, 2)), dn, jnp.bfloat16, recipe
    )
    np.testing.assert_array_equal(out.astype(jnp.float32), 4.0)


def test_jit_grad_and_vmap_agree():
  rng = np.random.default_rng(4)
  w, x = _operand(rng, (8, 4)), _operand(rng, (5, 8))
  f = ols.autocast(_dense_loss, compute_dtype=jnp.bfloat16, matmul="float8")
  assert f.matmul == ols.Float8Matmul()
  grad = jax.grad(f)(w, x)
  np.testing.assert_array_equal(jax.jit(jax.grad(f))(w, x), grad)
  # vmap: each example is its own call, with its own scales.
  per_example = jax.vmap(jax.grad(f), in_axes=(None, 0))(w, x[:, None])
  for i in range(x.shape[0]):
    np.testing.assert_array_equal(per_example[i], jax.grad(f)(w, x[i : i + 1]))
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(lambda w: f(w, x), (w,), (w,))
