"""What a matmul recipe quantises: each operand as the matmul receives it.

Under ``autocast(compute_dtype=half, matmul=recipe)`` a float32 operand is
quantised from its float32 value (its scale from that value's amax), not
from its copy in the compute dtype, and its gradient comes back float32 in
precision, not a half value widened; a half operand is read at its own
precision (the value stored), also where XLA computed it in float32 and
would let the quantiser read it before its rounding (its "excess
precision"): jitted, a quantiser gives the codes it gives eagerly.

Axes: the recipe (float8, float8 with power-of-two scales, MXFP8, NVFP4
with and without its stochastic rounding) x the compute dtype (bfloat16,
float16), and float64 (x64) and zero-size operands; each case against the
recipe's own matmul called on the values the rule names (and not on the
other ones), the plain function, or the eager run.
The whole function jitted may still differ from it eagerly, as a plain
bfloat16 one does: XLA may compute the function's own half-precision
elementwise work from unrounded inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import versions

import optax_lossscale as ols
from optax_lossscale._lowbit import block_matmul as _block_matmul
from optax_lossscale._lowbit import float8 as _float8

HALVES = [jnp.bfloat16, jnp.float16]
RECIPES = {
  "float8": ols.Float8Matmul(),
  "float8 power_of_two": ols.Float8Matmul(power_of_two=True),
  "mxfp8": "mxfp8",
  "nvfp4": "nvfp4",
  "nvfp4 stochastic": "nvfp4 stochastic",
}
BLOCK = {"mxfp8", "nvfp4", "nvfp4 stochastic"}
DIMS = (((1,), (0,)), ((), ()))


def _recipe(name):
  """The recipe object, every matmul quantised (none kept as the output layer)."""
  if name == "mxfp8":
    return ols.MXFP8Matmul()
  if name.startswith("nvfp4"):
    return ols.NVFP4Matmul(keep=(), stochastic_rounding=name.endswith("stochastic"))
  return RECIPES[name]


def _params(name):
  return [
    pytest.param(n, marks=versions.block_formats) if n in BLOCK else n for n in name
  ]


def _data(n=64, k=96, m=32):
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (n, k), jnp.float32)
  w = jax.random.normal(keys[1], (k, m), jnp.float32) * 0.1
  c = jax.random.normal(keys[2], (n, m), jnp.float32)
  return x, w, c


def _direct(recipe, half, copies, out_dtype):
  """The recipe's own matmul on the float32 operands, or on their half copies,
  its result in ``out_dtype``."""
  dot = (
    _float8.dot_general
    if isinstance(recipe, ols.Float8Matmul)
    else _block_matmul.dot_general
  )

  def f(x, w, c):
    if copies:
      x, w = x.astype(half), w.astype(half)
    return jnp.sum(dot(x, w, DIMS, out_dtype, recipe).astype(jnp.float32) * c)

  return f


@pytest.mark.sampled
@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("name", _params(RECIPES))
def test_float32_operands_are_quantised_from_float32(name, half):
  recipe = _recipe(name)
  x, w, c = _data()
  fast = ols.autocast(
    lambda x, w, c: jnp.sum((x @ w).astype(jnp.float32) * c),
    compute_dtype=half,
    matmul=recipe,
  )
  grad = jax.jit(jax.value_and_grad(fast, argnums=(0, 1)))
  value, (dx, dw) = grad(x, w, c)
  (found,) = ols.list_matmuls(fast, x, w, c)
  out = jnp.dtype(found.out_dtype)
  assert dx.dtype == dw.dtype == jnp.float32
  want_value, want = jax.jit(
    jax.value_and_grad(_direct(recipe, half, False, out), (0, 1))
  )(x, w, c)
  assert float(value) == float(want_value)
  for got, ref in zip((dx, dw), want, strict=True):
    np.testing.assert_array_equal(got, ref)
  # The half copies quantise to other numbers: the comparison can fail.
  _, copied = jax.jit(jax.value_and_grad(_direct(recipe, half, True, out), (0, 1)))(
    x, w, c
  )
  assert not np.array_equal(dw, copied[1])
  # float32 in precision, not half values widened
  assert (
    np.mean(np.asarray(dw) != np.asarray(dw.astype(half).astype(jnp.float32))) > 0.5
  )


def _float8_codes(x):
  return _float8.quantize(x, jnp.float8_e4m3fn, False)


def _block_codes(fmt, stochastic=False, **kw):
  def f(x):
    key = jax.random.key(3) if stochastic else None
    q = ols.block_quantize(x, fmt, key=key, **kw)
    return q.elements, q.scales

  return f


QUANTISERS = {
  "float8": _float8_codes,
  "float8 e5m2 power_of_two": lambda x: _float8.quantize(x, jnp.float8_e5m2, True),
  "mxfp8": _block_codes("mxfp8"),
  "nvfp4": _block_codes("nvfp4"),
  "nvfp4 tiles": _block_codes("nvfp4", tile_axis=0),
  "nvfp4 stochastic": _block_codes("nvfp4", stochastic=True),
}


@pytest.mark.sampled
@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize(
  "name",
  [
    pytest.param(n, marks=versions.block_formats) if n.startswith(("mx", "nv")) else n
    for n in QUANTISERS
  ],
)
def test_a_quantiser_reads_a_half_value_made_in_the_same_step(name, half):
  quantise = QUANTISERS[name]
  x = jax.random.normal(jax.random.key(1), (32, 64), jnp.float32)

  def step(x):
    return quantise(jnp.exp(x * 0.37).astype(half) * jnp.asarray(1.7, half))

  eager = step(x)
  jitted = jax.jit(step)(x)
  for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), name


@pytest.mark.standard_promotion  # a bfloat16 activation times a float32 weight
@pytest.mark.parametrize("name", _params(RECIPES))
def test_list_matmuls_names_the_dtypes_quantised(name):
  recipe = _recipe(name)
  x, w, _ = _data()

  def f(x, w, v):
    h = (x @ w).astype(jnp.bfloat16)  # the function's own bfloat16 activation
    return (jnp.tanh(h) @ v).sum()

  fast = ols.autocast(f, compute_dtype=jnp.bfloat16, matmul=recipe)
  found = ols.list_matmuls(fast, x, w, w.T)
  assert [m.quantized_from for m in found] == [
    ("float32", "float32"),
    ("bfloat16", "float32"),
  ], ols.format_matmuls(found)
  assert "float32 x float32" in ols.format_matmuls(found).splitlines()[1]
  # a matmul left in the compute dtype quantises nothing
  plain = ols.list_matmuls(ols.autocast(f, compute_dtype=jnp.bfloat16), x, w, w.T)
  assert [m.quantized_from for m in plain] == [None, None]
  if name == "nvfp4":
    kept = ols.list_matmuls(
      ols.autocast(
        f, compute_dtype=jnp.bfloat16, matmul=ols.NVFP4Matmul(keep=("output",))
      ),
      x,
      w,
      w.T,
    )
    assert [m.kept for m in kept] == [None, "output"]
    assert kept[1].quantized_from is None


@pytest.mark.parametrize("name", _params(RECIPES))
def test_float64_and_empty_operands(name):
  """Under x64 a float64 operand is quantised (its float32 value: the
  quantisers compute in float32) and its gradient is float64; a zero-size
  operand gives zero-size gradients, as the plain matmul does."""
  recipe = _recipe(name)
  f = lambda x, w: jnp.sum(jnp.tanh(x @ w))  # noqa: E731
  fast = ols.autocast(f, compute_dtype=jnp.bfloat16, matmul=recipe)
  with versions.x64():
    x, w, _ = (np.asarray(a, np.float64) for a in _data())
    x, w = jnp.asarray(x), jnp.asarray(w)
    (found,) = ols.list_matmuls(fast, x, w)
    assert found.quantized_from == ("float64", "float64")
    dx, dw = jax.jit(jax.grad(fast, argnums=(0, 1)))(x, w)
    assert dx.dtype == dw.dtype == jnp.float64
    want = jax.grad(f, argnums=(0, 1))(x, w)
    for got, ref in zip((dx, dw), want, strict=True):
      # the whole gradient within the formats' error, as the benchmarks
      # measure it (NVFP4's is about 0.2), and not the plain one
      error = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
      assert 0 < error < 0.35, (name, error)
  x, w, _ = _data()
  empty = x[:0]
  dx, dw = jax.grad(fast, argnums=(0, 1))(empty, w)
  assert dx.shape == empty.shape and dw.shape == w.shape
  np.testing.assert_array_equal(dw, jnp.zeros_like(w))
