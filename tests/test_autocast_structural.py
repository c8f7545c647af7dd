"""Which matmuls get which recipe, by structure, and list_matmuls that says so.

A weight matmul gets the recipe however it is written (``@``, ``dot``,
``einsum``, ``dot_general``, ``tensordot``, Flax's layers); attention's
batched products of two computed values are recognised as such, however
they are written, and run in the recipe only where its ``attention`` says.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import optax_lossscale as ols

pytest.importorskip("flax", reason="Flax's layers are among the spellings")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

pytestmark = pytest.mark.standard_promotion  # Flax layers

D, F = 32, 16
RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.normal(size=(2, 4, D)), jnp.float32)
W = jnp.asarray(RNG.normal(size=(D, F)) / np.sqrt(D), jnp.float32)


def _linen(layer):
  params = layer.init(jax.random.key(0), X)
  return lambda x: layer.apply(params, x)


def _nnx(layer):
  return lambda x: layer(x)


WEIGHT_SPELLINGS = {
  "@": lambda x: x @ W,
  "jnp.dot": lambda x: jnp.dot(x, W),
  "jnp.matmul": lambda x: jnp.matmul(x, W),
  "einsum": lambda x: jnp.einsum("btd,df->btf", x, W),
  "lax.dot_general": lambda x: lax.dot_general(x, W, (((2,), (0,)), ((), ()))),
  "tensordot": lambda x: jnp.tensordot(x, W, axes=1),
  "linen Dense": _linen(nn.Dense(F)),
  "linen DenseGeneral": _linen(nn.DenseGeneral((2, 8))),
  "linen Einsum": _linen(nn.Einsum((D, F), "btd,df->btf")),
  "nnx Linear": _nnx(nnx.Linear(D, F, rngs=nnx.Rngs(0))),
  "nnx LinearGeneral": _nnx(nnx.LinearGeneral(D, (2, 8), rngs=nnx.Rngs(0))),
  "nnx Einsum": _nnx(nnx.Einsum("btd,df->btf", (D, F), rngs=nnx.Rngs(0))),
}
RECIPES = ["float8", "mxfp8", "nvfp4"]


@pytest.mark.sampled
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("spelling", WEIGHT_SPELLINGS)
def test_a_weight_matmul_gets_the_recipe_however_written(spelling, recipe):
  f = WEIGHT_SPELLINGS[spelling]
  # A lone layer is the function's output layer, which NVFP4 keeps by default.
  matmul = ols.NVFP4Matmul(keep=()) if recipe == "nvfp4" else recipe
  fast = ols.autocast(f, compute_dtype=jnp.bfloat16, matmul=matmul)
  (found,) = ols.list_matmuls(fast, X)
  assert (found.kind, found.precision) == ("weight", recipe)
  assert found.lhs_shape == X.shape
  # And it did run in the recipe: not the bfloat16 product.
  half = ols.autocast(f, compute_dtype=jnp.bfloat16)
  assert ols.list_matmuls(half, X)[0].precision == "bfloat16"
  assert not np.array_equal(np.asarray(fast(X)), np.asarray(half(X)))


def _heads(x):
  return x.reshape(*x.shape[:2], 2, -1)


def _einsum_attention(q, k, v):
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def _matmul_attention(q, k, v):
  q, k, v = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))  # (b, h, t, d)
  return jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2)) @ v


def _library_attention(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, implementation="xla")


ATTENTION_SPELLINGS = {
  "einsum": _einsum_attention,
  "@ on batched arrays": _matmul_attention,
  "jax.nn.dot_product_attention": _library_attention,
}
WQ, WK, WV = (
  jnp.asarray(RNG.normal(size=(D, D)) / np.sqrt(D), jnp.float32) for _ in range(3)
)


def _block(attention):
  def f(x):
    q, k, v = (_heads(x @ w) for w in (WQ, WK, WV))
    return attention(q, k, v)

  return f


@pytest.mark.parametrize(
  "recipe, attention_runs_in",
  [
    ("nvfp4", "bfloat16"),
    (ols.NVFP4Matmul(attention=True), "nvfp4"),
    ("mxfp8", "bfloat16"),
    (ols.MXFP8Matmul(attention=True), "mxfp8"),
    ("float8", "bfloat16"),
    (ols.Float8Matmul(attention=True), "float8"),
  ],
)
@pytest.mark.parametrize("spelling", ATTENTION_SPELLINGS)
def test_attention_is_recognised_by_structure(spelling, recipe, attention_runs_in):
  f = _block(ATTENTION_SPELLINGS[spelling])
  fast = ols.autocast(f, compute_dtype=jnp.bfloat16, matmul=recipe)
  found = ols.list_matmuls(fast, X)
  kinds = [m.kind for m in found]
  assert kinds == ["weight"] * 3 + ["attention"] * 2, found
  name = recipe if isinstance(recipe, str) else recipe.fmt
  assert [m.precision for m in found[:3]] == [name] * 3
  assert [m.precision for m in found[3:]] == [attention_runs_in] * 2


def test_flax_attention_layers_are_recognised():
  layer = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=D)
  params = layer.init(jax.random.key(0), X)
  fast = ols.autocast(
    lambda p, x: layer.apply(p, x), compute_dtype=jnp.bfloat16, matmul="nvfp4"
  )
  found = ols.list_matmuls(fast, params, X)
  # The output projection is the function's output layer: NVFP4 keeps it.
  assert [(m.kind, m.precision, m.kept) for m in found] == [
    ("weight", "nvfp4", None)
  ] * 3 + [("attention", "bfloat16", "attention")] * 2 + [
    ("weight", "bfloat16", "output")
  ]
  assert [m.path.rsplit("/", 1)[-1] for m in found[:3]] == ["query", "key", "value"]
  module = nnx.MultiHeadAttention(2, D, qkv_features=D, decode=False, rngs=nnx.Rngs(0))
  found = ols.list_matmuls(
    ols.autocast(module, compute_dtype=jnp.bfloat16, matmul="nvfp4"), X
  )
  assert [m.kind for m in found] == ["weight"] * 3 + ["attention"] * 2 + ["weight"]


def test_layers_inside_scan_remat_and_cond_are_listed_once():
  def f(ws, x):
    def body(h, w):
      return jax.checkpoint(lambda h: jnp.tanh(h @ w))(h), None

    h, _ = lax.scan(body, x, ws)
    return lax.cond(h.sum() > 0, lambda h: h @ W, lambda h: -(h @ W), h)

  ws = jnp.stack([jnp.eye(D)] * 3)
  fast = ols.autocast(f, compute_dtype=jnp.float16, matmul="mxfp8")
  found = ols.list_matmuls(fast, ws, X)
  assert [(m.kind, m.precision) for m in found] == [("weight", "mxfp8")] * 3
  # Nothing was written or computed: a plain function lists its own dtypes.
  plain = ols.list_matmuls(f, ws, X)
  assert [m.precision for m in plain] == ["float32"] * 3


def test_exclusion_by_module_path_and_the_listing_agree():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4, name="head")(jnp.tanh(nn.Dense(D, name="body")(x)))

  model = Net()
  params = model.init(jax.random.key(0), X)
  fast = ols.autocast(
    lambda p, x: model.apply(p, x).sum(), compute_dtype=jnp.bfloat16, matmul="nvfp4"
  )
  found = ols.list_matmuls(fast, params, X)
  assert [(m.path, m.precision) for m in found] == [
    ("Net/body", "nvfp4"),
    ("Net/head", "bfloat16"),
  ]
  table = ols.format_matmuls(found)
  assert table.splitlines()[1].split()[:2] == ["Net/body", "weight"]
  assert "nvfp4" in table.splitlines()[1] and "bfloat16" in table.splitlines()[2]


def test_list_matmuls_writes_no_state():
  model = nnx.Linear(D, F, rngs=nnx.Rngs(0))
  kernel = np.asarray(model.kernel[...])

  def f(m, x):
    m.kernel[...] = m.kernel[...] * 2
    return m(x)

  (found,) = ols.list_matmuls(ols.autocast(f, compute_dtype=jnp.bfloat16), model, X)
  assert found.precision == "bfloat16"
  np.testing.assert_array_equal(model.kernel[...], kernel)


def test_a_scans_constants_and_carry_are_counted_on_this_jax():
  # JAX before 0.11 states the counts as parameters, later JAX as a flat
  # tree of the three groups; autocast's rules and evaluator read both.
  from optax_lossscale._base import jaxpr as _jaxpr

  def f(w, c0, c1, xs):
    body = lambda c, x: ((c[0] * x + w[0], c[1] + w[1]), c[0] * x)  # noqa: E731
    return lax.scan(body, (c0, c1), xs)

  closed = jax.make_jaxpr(f)(jnp.ones(2), 1.0, 2.0, jnp.ones(3))
  (scan,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
  consts, carry = _jaxpr.scan_counts(scan.params)
  assert (consts, carry) == (1, 2), scan.params.keys()
  assert len(scan.invars) == consts + carry + 1


MIN_SIZE_RECIPES = {
  "float8": lambda n: ols.Float8Matmul(min_size=n, attention=True),
  "mxfp8": lambda n: ols.MXFP8Matmul(min_size=n, attention=True),
  "nvfp4": lambda n: ols.NVFP4Matmul(min_size=n, attention=True, keep=()),
}


@pytest.mark.parametrize(
  "min_size, weights_kept, attention_kept",
  # The block's weight matmuls: M = 8 tokens, K = N = 32; attention's two
  # products: M = 4 queries, K and N 16 and 4 (the least dimension is 4).
  [
    (0, False, False),
    (4, False, False),
    (5, False, True),
    (8, False, True),
    (9, True, True),
  ],
)
@pytest.mark.parametrize("recipe", MIN_SIZE_RECIPES)
def test_min_size_keeps_the_matmuls_with_a_smaller_dimension(
  recipe, min_size, weights_kept, attention_kept
):
  f = _block(_einsum_attention)
  matmul = MIN_SIZE_RECIPES[recipe](min_size)
  fast = ols.autocast(f, compute_dtype=jnp.bfloat16, matmul=matmul)
  found = ols.list_matmuls(fast, X)
  want = [weights_kept] * 3 + [attention_kept] * 2
  assert [m.kept for m in found] == ["small" if k else None for k in want], found
  assert [m.precision for m in found] == ["bfloat16" if k else recipe for k in want], (
    found
  )
  if weights_kept and attention_kept:  # every matmul as autocast alone runs it
    half = ols.autocast(f, compute_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(fast(X)), np.asarray(half(X)))
    g = jax.grad(lambda x: fast(x).sum())(X)
    np.testing.assert_array_equal(g, jax.grad(lambda x: half(x).sum())(X))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8", None])
@pytest.mark.parametrize("recipe", MIN_SIZE_RECIPES)
def test_min_size_must_be_a_non_negative_int(recipe, bad):
  with pytest.raises(ValueError, match="`min_size` must be a non-negative int"):
    MIN_SIZE_RECIPES[recipe](bad)
