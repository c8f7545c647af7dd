"""MXFP8 and NVFP4 matmuls against a NumPy/ml_dtypes reference of the recipes.

Axes: the recipe (MXFP8; NVFP4 with 1D or 2D weight blocks, with and
without the Hadamard transform) x the ``dot_general`` layout (plain, a
transposed weight, batch axes, two contracting axes, a ragged contraction)
x the three GEMMs (forward, input gradient, weight gradient), each within
float32 accumulation-order tolerance of the reference, whose operands are
quantised by the reference quantisers of ``test_block_scaled`` along each
GEMM's own contraction. Then the recipes in use: ``autocast``, ``jit``,
``scan`` and ``remat``, Flax Linen and NNX, the exclusion of layers by
module path, zeros, non-finite inputs under a loss scale, the jaxpr's
low-precision values, and NVFP4's stochastic rounding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import versions
from jaxprs import eqns as all_eqns
from test_block_scaled import ref_mxfp8, ref_nvfp4

import optax_lossscale as ols
from optax_lossscale._lowbit import block_matmul as _block_matmul

pytestmark = versions.block_formats

RECIPES = {
  "mxfp8": ols.MXFP8Matmul(),
  "nvfp4 1d": ols.NVFP4Matmul(
    stochastic_rounding=False, random_hadamard=False, weight_2d=False
  ),
  "nvfp4 2d": ols.NVFP4Matmul(stochastic_rounding=False, random_hadamard=False),
  "nvfp4 2d hadamard": ols.NVFP4Matmul(stochastic_rounding=False),
}


def _hadamard():
  h = np.array([[1.0]])
  for _ in range(4):
    h = np.block([[h, h], [h, -h]])
  signs = np.random.default_rng(0x5EED).choice([-1.0, 1.0], 16)
  return h * signs / 4.0


def ref_q(x, axis, recipe, tiles_with=None):
  """The reference quantiser along ``axis`` (2-D ``x``), dequantised."""
  x = np.moveaxis(np.asarray(x, np.float32), axis, -1)
  if recipe.fmt == "mxfp8":
    out = ref_mxfp8(x)[0]
  else:
    out = ref_nvfp4(x, tiles=tiles_with is not None)
  return np.moveaxis(out, -1, axis)


def ref_rotate(x):
  """Runs of 16 along axis 0 times the Hadamard matrix (zero-padded)."""
  pad = -x.shape[0] % 16
  xp = np.pad(x, [(0, pad), (0, 0)])
  blocks = xp.reshape(-1, 16, x.shape[1])
  return np.einsum("bjk,jl->blk", blocks, _hadamard()).reshape(-1, x.shape[1])


def reference(x, w, g, recipe):
  """Forward, input gradient, weight gradient of ``x (M, K) @ w (K, N)``."""
  tiles = recipe.fmt == "nvfp4" and recipe.weight_2d
  wq = lambda axis: ref_q(w, axis, recipe, tiles_with=1 - axis if tiles else None)  # noqa: E731
  y = ref_q(x, 1, recipe) @ wq(0)
  dx = ref_q(g, 1, recipe) @ wq(1).T
  xx, gg = np.asarray(x, np.float64), np.asarray(g, np.float64)
  if recipe.fmt == "nvfp4" and recipe.random_hadamard:
    xx, gg = ref_rotate(xx), ref_rotate(gg)
  dw = ref_q(xx, 0, recipe).T @ ref_q(gg, 0, recipe)
  return y, dx, dw


def assert_close(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = np.abs(want).max() + 1e-30
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale * np.sqrt(want.size))


# name: (lhs shape, rhs shape, dimension numbers, to (M, K), (K, N), (M, N) views)
LAYOUTS = {
  "plain": ((8, 48), (48, 24), (((1,), (0,)), ((), ()))),
  "weight transposed": ((8, 48), (24, 48), (((1,), (1,)), ((), ()))),
  "ragged contraction": ((5, 37), (37, 19), (((1,), (0,)), ((), ()))),
  "two free axes": ((2, 4, 48), (48, 24), (((2,), (0,)), ((), ()))),
}


def _views(name, x, w, g):
  """The layout's operands as the 2-D (M, K) and (K, N) the reference takes."""
  if name == "weight transposed":
    return x, w.T, g
  if name == "two free axes":
    return x.reshape(-1, x.shape[-1]), w, g.reshape(-1, g.shape[-1])
  return x, w, g


def operands(layout, seed=0):
  """``x``, ``w`` and an output gradient ``g`` of the layout's shapes."""
  ls, rs, dn = LAYOUTS[layout]
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal(ls), jnp.float32)
  w = jnp.asarray(rng.standard_normal(rs) * 0.1, jnp.float32)
  out = jax.eval_shape(lambda: jax.lax.dot_general(x, w, dn))
  g = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
  return x, w, g


def three_gemms(recipe, layout):
  """``f(x, w, g) = (y, dx, dw)``: the layout's ``dot_general`` in ``recipe``
  and its two gradients."""
  dn = LAYOUTS[layout][2]

  def f(x, w, g):
    y, vjp = jax.vjp(
      lambda x, w: _block_matmul.dot_general(x, w, dn, jnp.float32, recipe), x, w
    )
    return (y, *vjp(g))

  return f


@pytest.mark.sampled
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_three_gemms_are_the_reference_recipes(recipe, layout):
  r = RECIPES[recipe]
  x, w, g = operands(layout)
  y, dx, dw = jax.jit(three_gemms(r, layout))(x, w, g)
  x2, w2, g2 = _views(layout, np.asarray(x), np.asarray(w), np.asarray(g))
  want_y, want_dx, want_dw = reference(x2, w2, g2, r)
  assert_close(np.asarray(y).reshape(want_y.shape), want_y)
  assert_close(np.asarray(dx).reshape(want_dx.shape), want_dx)
  dw = np.asarray(dw)
  assert_close(dw.T if layout == "weight transposed" else dw, want_dw)


def test_batch_axes_are_matmuls_of_their_own():
  r = RECIPES["mxfp8"]
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((3, 8, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((3, 32, 16)), jnp.float32)
  dn = (((2,), (1,)), ((0,), (0,)))
  y = jax.jit(lambda x, w: _block_matmul.dot_general(x, w, dn, jnp.float32, r))(x, w)
  for b in range(3):
    want = reference(np.asarray(x[b]), np.asarray(w[b]), np.zeros((8, 16)), r)[0]
    assert_close(y[b], want)


def test_the_hadamard_transform_cancels_in_exact_arithmetic():
  rng = np.random.default_rng(2)
  x, g = rng.standard_normal((37, 5)), rng.standard_normal((37, 7))
  h = _hadamard()
  np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-12)
  got = _block_matmul._rotate(jnp.asarray(x, jnp.float32), 0)
  np.testing.assert_allclose(got, ref_rotate(x), atol=1e-5)
  np.testing.assert_allclose(ref_rotate(x).T @ ref_rotate(g), x.T @ g, atol=1e-10)


def _mlp_loss(params, x):
  h = jnp.tanh(x @ params["w1"])
  return jnp.mean((h @ params["w2"]) ** 2)


def _mlp(seed=0):
  rng = np.random.default_rng(seed)
  params = {
    "w1": jnp.asarray(rng.standard_normal((64, 48)) / 8, jnp.float32),
    "w2": jnp.asarray(rng.standard_normal((48, 32)) / 7, jnp.float32),
  }
  return params, jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)


@pytest.mark.parametrize("matmul", ["mxfp8", "nvfp4"])
def test_autocast_trains_within_the_recipes_error(matmul):
  params, x = _mlp()
  f = ols.autocast(_mlp_loss, compute_dtype=jnp.bfloat16, matmul=matmul)
  loss, grads = jax.jit(jax.value_and_grad(f))(params, x)
  loss0, grads0 = jax.jit(jax.value_and_grad(_mlp_loss))(params, x)
  tol = 0.1 if matmul == "mxfp8" else 0.35  # 3 mantissa bits, 1 mantissa bit
  assert abs(float(loss) - float(loss0)) <= tol * float(loss0)
  for k in params:
    cos = jnp.vdot(grads[k], grads0[k]) / (
      jnp.linalg.norm(grads[k]) * jnp.linalg.norm(grads0[k])
    )
    assert float(cos) > (0.99 if matmul == "mxfp8" else 0.9), k
  assert f.matmul == _block_matmul.as_block_recipe(matmul)


def _low_precision_uses(jaxpr):
  """(producers, consumers) primitive names of float8/float4 values, all depths."""
  low = {"float8_e4m3fn", "float8_e8m0fnu", "float4_e2m1fn"}

  def is_low(v):
    dtype = getattr(getattr(v, "aval", None), "dtype", None)
    return dtype is not None and dtype.name in low

  eqns = list(all_eqns(jaxpr))
  made = {e.primitive.name for e in eqns if any(map(is_low, e.outvars))}
  read = {e.primitive.name for e in eqns if any(map(is_low, e.invars))}
  return made, read


@pytest.mark.parametrize("matmul", ["mxfp8", "nvfp4"])
def test_low_precision_values_are_only_converted_and_moved(matmul):
  params, x = _mlp()
  f = ols.autocast(_mlp_loss, compute_dtype=jnp.bfloat16, matmul=matmul)
  made, read = _low_precision_uses(jax.make_jaxpr(jax.grad(f))(params, x).jaxpr)
  assert made and read
  # conversions, and layout ops that move values without computing on them
  moves = {
    "convert_element_type",
    "bitcast_convert_type",
    "reshape",
    "transpose",
    "squeeze",
    "broadcast_in_dim",
    "slice",
    "pad",
    "custom_jvp_call",  # the quantiser's boundary: its body is walked too
    "optimization_barrier",  # before each widening (_lowbit.exact)
  }
  assert made <= moves and read <= moves, (made, read)
  assert "convert_element_type" in read  # the dequantisation to float32


@pytest.mark.parametrize("matmul", ["mxfp8", "nvfp4"])
def test_zeros_give_zeros(matmul):
  params, x = _mlp()
  zeros = jax.tree.map(jnp.zeros_like, params)
  f = ols.autocast(_mlp_loss, compute_dtype=jnp.bfloat16, matmul=matmul)
  loss, grads = jax.jit(jax.value_and_grad(f))(zeros, jnp.zeros_like(x))
  assert float(loss) == 0.0
  for g in jax.tree.leaves(grads):
    assert np.all(np.asarray(g) == 0)


@pytest.mark.parametrize("matmul", ["mxfp8", "nvfp4"])
def test_a_non_finite_input_reaches_the_gradients_and_the_step_is_skipped(matmul):
  params, x = _mlp()
  x = x.at[3, 5].set(jnp.inf)
  f = ols.autocast(_mlp_loss, compute_dtype=jnp.bfloat16, matmul=matmul)
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), track_nonfinite=True)
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    loss, grads = ols.value_and_grad(f)(state, params, x)
    updates, state = tx.update(grads, state, params, value=loss)
    return optax.apply_updates(params, updates), state

  new, state = step(params, state)
  assert int(ols.diagnostics(state)["skipped_steps"]) == 1
  jax.tree.map(np.testing.assert_array_equal, new, params)


# The loop's matmul is the function's output layer, which NVFP4 keeps by default.
@pytest.mark.parametrize(
  "matmul", ["mxfp8", pytest.param(ols.NVFP4Matmul(keep=()), id="nvfp4")]
)
def test_scan_and_remat_quantise_each_step(matmul):
  # remat recomputes the same quantised forward: equal bits; scan runs the
  # recipe in its body (its low-precision values are there), and follows
  # the unrolled loop to the recipe's error (autocast itself rounds a
  # loop's carry and an unrolled chain at different places).
  params, x = _mlp()
  ws = jnp.stack([params["w2"][:32, :32]] * 3)
  bf16 = jnp.bfloat16

  def unrolled(ws, h):
    for i in range(3):
      h = jnp.tanh(h @ ws[i])
    return jnp.sum(h**2)

  def scanned(ws, h, remat=False):
    body = lambda h, w: (jnp.tanh(h @ w), None)  # noqa: E731
    h = jax.lax.scan(jax.checkpoint(body) if remat else body, h, ws)[0]
    return jnp.sum(h**2)

  h = x[:, :32]
  cast = lambda f: ols.autocast(f, compute_dtype=bf16, matmul=matmul)  # noqa: E731
  plain = jax.jit(jax.grad(cast(scanned)))(ws, h)
  remat = jax.jit(jax.grad(cast(lambda ws, h: scanned(ws, h, True))))(ws, h)
  np.testing.assert_array_equal(plain, remat)
  made, _ = _low_precision_uses(jax.make_jaxpr(jax.grad(cast(scanned)))(ws, h).jaxpr)
  assert made
  exact = jax.jit(jax.grad(unrolled))(ws, h)
  loop = jax.jit(jax.grad(cast(unrolled)))(ws, h)
  err = lambda g: float(jnp.abs(g - exact).max() / jnp.abs(exact).max())  # noqa: E731
  assert err(plain) <= 2 * err(loop) + 0.02, (err(plain), err(loop))


def test_nvfp4s_stochastic_rounding_follows_the_gradient_and_is_reproducible():
  params, x = _mlp()
  r = ols.NVFP4Matmul()
  g = jax.jit(jax.grad(ols.autocast(_mlp_loss, compute_dtype=jnp.bfloat16, matmul=r)))
  a, b = g(params, x), g(params, x)
  jax.tree.map(np.testing.assert_array_equal, a, b)  # reproducible
  c = g(params, x * 1.001)  # another gradient: other random numbers
  off = jax.jit(
    jax.grad(
      ols.autocast(
        _mlp_loss,
        compute_dtype=jnp.bfloat16,
        matmul=ols.NVFP4Matmul(stochastic_rounding=False),
      )
    )
  )(params, x)
  assert not np.array_equal(a["w1"], off["w1"])
  assert not np.array_equal(a["w1"], c["w1"])
  other_seed = jax.jit(
    jax.grad(
      ols.autocast(
        _mlp_loss, compute_dtype=jnp.bfloat16, matmul=ols.NVFP4Matmul(seed=1)
      )
    )
  )(params, x)
  assert not np.array_equal(a["w1"], other_seed["w1"])


@pytest.mark.parametrize(
  "seed, alike",
  [(2**40, 0), (2**32 + 1, 1), (-1, 2**32 - 1), (2**63 - 1, 2**32 - 1)],
  ids=["2**40", "2**32 + 1", "-1", "2**63 - 1"],
)
def test_every_bit_of_the_seed_counts_with_x64_on_or_off(seed, alike):
  """A seed and one with the same low 32 bits draw other numbers (without
  x64, jax.random.key(2**40) keeps only the low bits: key(0)'s), and each
  seed draws the same ones with x64 on or off."""
  params, x = _mlp()

  def grads(seed):
    loss = ols.autocast(
      _mlp_loss, compute_dtype=jnp.bfloat16, matmul=ols.NVFP4Matmul(seed=seed)
    )
    return np.asarray(jax.jit(jax.grad(loss))(params, x)["w1"])

  got = grads(seed)
  assert not np.array_equal(got, grads(alike))
  with versions.x64():
    np.testing.assert_array_equal(grads(seed), got)


def test_layers_are_excluded_by_module_path():
  flax = pytest.importorskip("flax")
  del flax
  import flax.linen as nn

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = jnp.tanh(nn.Dense(32, name="body")(x))
      return nn.Dense(8, name="head")(x)

  model = Net()
  x = jnp.ones((4, 16))
  params = model.init(jax.random.key(0), x)
  seen = []

  def exclude(path):
    seen.append(path)
    return path.endswith("head")

  f = ols.autocast(
    lambda p: model.apply(p, x).sum(),
    compute_dtype=jnp.bfloat16,
    matmul=ols.MXFP8Matmul(exclude=exclude),
  )
  jax.grad(f)(params)
  assert any(p.endswith("Net/body") for p in seen), seen
  assert any(p.endswith("Net/head") for p in seen), seen
  # the default NVFP4 recipe keeps the output layer and embeddings by
  # structure (`keep`), whatever their names
  nv = ols.NVFP4Matmul()
  assert nv.keep == ("output", "embedding") and nv.exclude == ()
  assert not _block_matmul.excluded(nv, "Transformer/head")
  assert _block_matmul.kept(nv, "-", {"output"}) == "output"
  assert _block_matmul.kept(nv, "", {"embedding"}) == "embedding"
  assert _block_matmul.kept(ols.NVFP4Matmul(keep=()), "", {"output"}) is None
  # an einsum is a weight's matmul like any other (attention's are kept by
  # structure, the recipe's `attention`, not by name)
  assert not _block_matmul.excluded(nv, "Transformer/block_0/btd,df->btf")
  defaults = (nv, ols.MXFP8Matmul(), ols.Float8Matmul())
  assert not any(r.attention for r in defaults)
  # an excluded matmul runs in the compute dtype: the head's output is exact
  made, _ = _low_precision_uses(jax.make_jaxpr(f)(params).jaxpr)
  assert made  # the body's matmul is quantised


def test_flax_nnx_model_runs():
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Linear(48, 16, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  x = jnp.ones((4, 48))

  def loss(state):
    return jnp.sum(nnx.merge(graphdef, state)(x) ** 2)

  g = jax.jit(jax.grad(ols.autocast(loss, compute_dtype=jnp.bfloat16, matmul="nvfp4")))(
    state
  )
  g0 = jax.jit(jax.grad(loss))(state)
  leaves, leaves0 = jax.tree.leaves(g), jax.tree.leaves(g0)
  assert all(np.isfinite(np.asarray(a)).all() for a in leaves)
  k = next(i for i, a in enumerate(leaves0) if a.ndim == 2)
  cos = jnp.vdot(leaves[k], leaves0[k]) / (
    jnp.linalg.norm(leaves[k]) * jnp.linalg.norm(leaves0[k])
  )
  assert float(cos) > 0.9


def test_recipes_check_their_arguments():
  with pytest.raises(ValueError, match="`matmul` must be None, 'float8', 'mxfp8'"):
    ols.autocast(jnp.sum, matmul="fp4")
  with pytest.raises(ValueError, match="`weight_2d` must be a bool"):
    ols.NVFP4Matmul(weight_2d=1)
  with pytest.raises(ValueError, match="`seed` must be an int"):
    ols.NVFP4Matmul(seed=1.5)
  for seed in (2**63, 2**70, -(2**63) - 1):  # jax.random.key overflowed in grad
    with pytest.raises(ValueError, match="`seed` must fit in 64 bits"):
      ols.NVFP4Matmul(seed=seed)
  ols.NVFP4Matmul(seed=2**63 - 1)
  with pytest.raises(ValueError, match="`exclude` must be a tuple of regular"):
    ols.MXFP8Matmul(exclude="head")


@pytest.mark.parametrize("matmul", ["mxfp8", "nvfp4"])
def test_forward_mode_is_refused_by_name(matmul):
  params, x = _mlp()
  f = ols.autocast(_mlp_loss, compute_dtype=jnp.bfloat16, matmul=matmul)
  with pytest.raises(NotImplementedError, match="not in forward mode"):
    jax.hessian(f)(params, x)


@pytest.mark.parametrize("matmul", ["mxfp8", "nvfp4"])
def test_an_empty_batch_gives_empty_results(matmul):
  params, x = _mlp()
  f = ols.autocast(
    lambda p, x: jnp.tanh(x @ p["w1"]), compute_dtype=jnp.bfloat16, matmul=matmul
  )
  empty = x[:0]
  assert f(params, empty).shape == (0, 48)
  g = jax.grad(lambda p, x: jnp.sum(f(p, x)))(params, empty)
  assert np.all(np.asarray(g["w1"]) == 0)


def test_a_non_finite_entry_poisons_its_block_or_nvfp4s_tensor():
  # MXFP8's scales are per block; NVFP4's scale per tensor makes the whole
  # operand NaN (still NaN, never a finite number in its place).
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32).at[0, 0].set(jnp.inf)
  w = jnp.asarray(rng.standard_normal((64, 8)), jnp.float32)
  # (A lone matmul is the function's output layer: NVFP4 without `keep`.)
  for matmul in (ols.MXFP8Matmul(), ols.NVFP4Matmul(keep=())):
    y = ols.autocast(lambda x, w: x @ w, compute_dtype=jnp.bfloat16, matmul=matmul)(
      x, w
    )
    y = np.asarray(y, np.float32)
    assert np.isnan(y[0]).all(), matmul
    assert np.isnan(y[1:]).all() == (matmul.fmt == "nvfp4"), matmul
    if matmul.fmt == "mxfp8":
      assert np.isfinite(y[1:]).all()


@pytest.mark.parametrize("recipe", [ols.Float8Matmul, ols.MXFP8Matmul, ols.NVFP4Matmul])
def test_exclude_is_checked(recipe):
  for bad in (None, 3, "head"):
    with pytest.raises(ValueError, match="`exclude` must be a tuple of regular"):
      recipe(exclude=bad)
  with pytest.raises(ValueError, match="is not a regular expression"):
    recipe(exclude=("(",))
  assert recipe(exclude=["head$"]).exclude == ("head$",)
