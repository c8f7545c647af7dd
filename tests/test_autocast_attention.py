"""autocast on attention whose logits overflow float16: float32 logits, no NaN.

A matmul whose every reader computes in float32 (the softmax's exp, a
division, a reduction, a conversion to float32) accumulates and returns
float32 itself under autocast, so no float16 result exists to overflow.
Tested on ``jax.nn.dot_product_attention``, Flax's
``MultiHeadDotProductAttention`` and a hand-written softmax attention, with
inputs whose logits exceed float16's largest value (the control below shows
that they do), against float32; and the rule's other side: a matmul read by
another matmul stays in float16. With bfloat16 the derivatives of such a
product (the logits', a language model's output layer's, a convolution's)
are bfloat16 products: no backward matmul reads a float32 operand; float16
keeps them float32, so that an output layer's small gradients stay.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import versions

import optax_lossscale as ols

F16_MAX = float(jnp.finfo(jnp.float16).max)


def _qkv(scale=100.0, seed=0):
  rng = np.random.default_rng(seed)
  # Queries equal to the keys, entries of `scale`: logits of 8 * scale**2.
  q = jnp.asarray(scale + rng.normal(size=(2, 6, 2, 8)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(2, 6, 2, 8)), jnp.float32)
  return q, q, v


def hand_written(q, k, v):
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
  weights = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def scaled_by_division(q, k, v):
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def library(q, k, v):
  return jax.nn.dot_product_attention(q, k, v)


ATTENTION = {
  "hand-written softmax attention": hand_written,
  "divided logits": scaled_by_division,
  "jax.nn.dot_product_attention": library,
}


def test_the_logits_overflow_float16():
  # The control: computed in float16, these logits are infinite.
  q, k, _ = _qkv()
  logits16 = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float16), k.astype(jnp.float16))
  assert not bool(jnp.all(jnp.isfinite(logits16)))
  assert float(jnp.max(jnp.einsum("bqhd,bkhd->bhqk", q, k))) > F16_MAX


@pytest.mark.parametrize("name", ATTENTION)
def test_attention_with_overflowing_logits_matches_float32(name):
  fn = ATTENTION[name]
  q, k, v = _qkv()
  want = fn(q, k, v)
  got = ols.autocast(fn, compute_dtype=jnp.float16)(q, k, v)
  assert got.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(got))), name
  # The values are float16-rounded (v and the weights): within float16's
  # resolution of the output's largest entry.
  np.testing.assert_allclose(got, want, atol=4e-3 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("name", ATTENTION)
def test_the_gradients_match_float32(name):
  fn = ATTENTION[name]
  q, k, v = _qkv(scale=1.0)  # weights not saturated: the gradients mean something
  loss = lambda f: lambda q: jnp.sum(f(q, k, v) ** 2)  # noqa: E731
  want = jax.grad(loss(fn))(q)
  got = jax.grad(loss(ols.autocast(fn, compute_dtype=jnp.float16)))(q)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, atol=2e-2 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("name", ATTENTION)
def test_the_gradients_of_overflowing_logits_are_finite(name):
  q, k, v = _qkv()
  f = ols.autocast(ATTENTION[name], compute_dtype=jnp.float16)
  g = jax.grad(lambda q: jnp.sum(f(q, k, v) ** 2))(q)
  assert bool(jnp.all(jnp.isfinite(g))), name


def _dots(fn, *args, names=("dot_general",)):
  """``(input dtypes, output dtype)`` of every dot_general (or primitive of
  ``names``), in order, nested too."""
  found = []

  def visit(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name in names:
        found.append(
          (tuple(str(v.aval.dtype) for v in e.invars), str(e.outvars[0].aval.dtype))
        )
      for p in e.params.values():
        for sub in p if isinstance(p, (tuple, list)) else (p,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            visit(inner)

  visit(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


@pytest.mark.parametrize("name", ATTENTION)
def test_the_logits_matmul_reads_half_and_returns_float32(name):
  q, k, v = _qkv()
  dots = _dots(ols.autocast(ATTENTION[name], compute_dtype=jnp.float16), q, k, v)
  assert len(dots) == 2, dots
  logits, values = dots
  assert logits == (("float16", "float16"), "float32"), dots  # half inputs, f32 out
  assert values[0] == ("float16", "float16"), dots  # the weights times v: half


def test_a_matmul_read_by_another_matmul_stays_half():
  def mlp(w1, w2, x):
    return jnp.sum(jnp.exp(jnp.tanh(x @ w1) @ w2))

  args = (jnp.ones((4, 8)), jnp.ones((8, 3)), jnp.ones((5, 4)))
  dots = _dots(ols.autocast(mlp, compute_dtype=jnp.float16), *args)
  # The first feeds tanh and the next matmul: half. The second is read by
  # exp only: float32.
  assert [out for _, out in dots] == ["float16", "float32"], dots


def test_a_result_the_function_returns_stays_half():
  # The function's own outputs come back in its dtypes; the matmul that
  # makes one is not read in float32 by anything inside: half, then cast.
  f = lambda a, b: a @ b  # noqa: E731
  dots = _dots(
    ols.autocast(f, compute_dtype=jnp.float16), jnp.ones((2, 3)), jnp.ones((3, 4))
  )
  assert dots == [(("float16", "float16"), "float16")]


@versions.examples  # Flax
def test_flax_multi_head_attention_with_overflowing_logits():
  import flax.linen as nn

  mha = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)
  x = 1000.0 + jax.random.normal(jax.random.key(1), (2, 6, 16))
  params = mha.init(jax.random.key(0), x)
  f = lambda p, x: mha.apply(p, x)  # noqa: E731
  # Flax divides the queries by sqrt(head size) before the logits' matmul.
  q = jnp.einsum("btd,dhk->bthk", x, params["params"]["query"]["kernel"]) / np.sqrt(8)
  k = jnp.einsum("btd,dhk->bthk", x, params["params"]["key"]["kernel"])
  assert float(jnp.max(jnp.abs(jnp.einsum("bqhd,bkhd->bhqk", q, k)))) > F16_MAX
  want = f(params, x)
  got = ols.autocast(f, compute_dtype=jnp.float16)(params, x)
  assert bool(jnp.all(jnp.isfinite(got)))
  np.testing.assert_allclose(got, want, atol=4e-3 * float(jnp.max(jnp.abs(want))))


def _output_layer(w, x):
  """A language model's last matmul: its logits read by log_softmax."""
  return -jnp.mean(jax.nn.log_softmax(x @ w)[..., 0])


def _conv(w, x):
  """A convolution read in float32 only (exp, then a mean)."""
  y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME")
  return jnp.mean(jnp.exp(-jnp.abs(y)))


def _attention(w, x):
  return jnp.sum(hand_written(x, x @ w, x) ** 2)


FLOAT32_RESULTS = {  # name: (function of (w, x), w, x)
  "output layer": (_output_layer, (8, 32), (4, 8)),
  "attention logits": (_attention, (8, 8), (2, 3, 2, 8)),
  "convolution": (_conv, (4, 2, 3, 3), (2, 2, 6, 6)),
}
DERIVATIVES = {
  "grad": lambda f: jax.grad(f),
  "vmap of grad": lambda f: jax.vmap(jax.grad(f), in_axes=(None, 0)),
  "jacfwd": lambda f: jax.jacfwd(f),
}
PRODUCTS = ("dot_general", "conv_general_dilated")


@pytest.mark.parametrize("derivative", DERIVATIVES)
@pytest.mark.parametrize("half", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("name", FLOAT32_RESULTS)
def test_a_float32_result_s_derivatives_are_bfloat16_or_float32_products(
  name, half, derivative
):
  fn, w_shape, x_shape = FLOAT32_RESULTS[name]
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.normal(size=w_shape) / np.sqrt(w_shape[-2]), jnp.float32)
  x = jnp.asarray(rng.normal(size=x_shape), jnp.float32)
  if derivative == "vmap of grad":
    x = jnp.stack([x, 2 * x])
  cast = ols.autocast(fn, compute_dtype=half)
  # The forward pass: half operands, a product with a float32 result.
  forward = _dots(cast, w, x[0] if derivative == "vmap of grad" else x, names=PRODUCTS)
  assert not [p for p in forward if "float32" in p[0]], forward
  assert "float32" in [out for _, out in forward], forward
  d = DERIVATIVES[derivative]
  products = _dots(d(cast), w, x, names=PRODUCTS)
  assert len(products) > len(forward), products
  wide = [p for p in products if "float32" in p[0]]
  if half == jnp.bfloat16:
    assert not wide, f"products reading float32 operands: {wide}"
  else:  # float16's in float32: its range would lose an output layer's gradients
    assert wide, products
  # The values: the float32 derivative within the half dtype's error.
  want, got = d(fn)(w, x), d(cast)(w, x)
  assert got.dtype == jnp.float32
  tol = 8 * float(jnp.finfo(half).eps) * float(jnp.max(jnp.abs(want)))
  np.testing.assert_allclose(got, want, atol=tol)


def test_a_remat_policy_still_saves_a_float32_result_product():
  # Differentiated, the product is a dot_general, which dots_saveable saves:
  # the backward pass does not compute it again.
  def f(w, x):
    policy = jax.checkpoint_policies.dots_saveable
    h = jax.checkpoint(lambda x: jax.nn.log_softmax(x @ w), policy=policy)(x)
    return -h[..., 0].mean()

  w, x = jnp.ones((8, 32)), jnp.ones((4, 8))
  grad = jax.grad(ols.autocast(f, compute_dtype=jnp.bfloat16))
  # the forward product and the weight's gradient; no recomputation
  assert len(_dots(grad, w, x)) == 2
  assert not [p for p in _dots(grad, w, x) if "float32" in p[0]]


def test_float16_keeps_an_output_layer_s_small_gradients():
  # Without a loss scale, the softmax's share of the logits' gradient (about
  # 1 / (classes x examples)) is below float16's range: rounded to float16
  # it would vanish (a relative error of 1e-2 here); float16 keeps float32
  # backward products, within float16's rounding of the forward pass.
  rng = np.random.default_rng(0)
  t, d, v = 2048, 64, 4096
  x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(d, v)) / 8, jnp.float32)
  y = jnp.asarray(rng.integers(0, v, t))

  def loss(w, x):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(x @ w), y[:, None], 1))

  want = jax.grad(loss, argnums=(0, 1))(w, x)
  got = jax.grad(ols.autocast(loss, compute_dtype=jnp.float16), argnums=(0, 1))(w, x)
  for a, b in zip(got, want, strict=True):
    assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 2e-3
