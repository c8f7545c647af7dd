"""A recipe keeps the output layer and embeddings by structure, in every framework.

Module paths exist in Linen only (Flax NNX, Equinox and plain JAX give none;
a tied output layer is ``Embed_0.attend``), so NVFP4's default keeps the
output layer and the embeddings by the jaxpr's structure (its ``keep``).
Each model is checked against an independent reference: its hidden layers
alone in NVFP4, then its output layer alone in plain bfloat16, give the
NVFP4 model's output bit for bit; the all-bfloat16 model and the one with
nothing kept give other numbers (the hidden layers were quantised, the
output layer was not).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import versions

import optax_lossscale as ols

pytestmark = [versions.block_formats, pytest.mark.standard_promotion]

V, D, B, T = 48, 64, 2, 8
IDS = jnp.arange(B * T, dtype=jnp.int32).reshape(B, T) * 7 % V
BF16 = jnp.bfloat16
NOTHING_KEPT = ols.NVFP4Matmul(keep=())
#: name -> (the recipe keeping the output layer, the same keeping nothing):
#: NVFP4's default keeps it; float8 and MXFP8 keep it when asked.
KEEPING = {
  "nvfp4": (ols.NVFP4Matmul(), NOTHING_KEPT),
  "float8": (ols.Float8Matmul(keep=("output",)), ols.Float8Matmul()),
  "mxfp8": (ols.MXFP8Matmul(keep=("output",)), ols.MXFP8Matmul()),
}


def _table(seed, shape, scale=1.0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


# --- the models: (args, hidden(*args) -> h, head(*args, h) -> logits) ----------


def _plain(tied):
  params = {
    "embed": _table(0, (V, D)),
    "body": _table(1, (D, D), D**-0.5),
    "head": _table(2, (D, V), D**-0.5),
  }

  def hidden(p, ids):
    return jnp.tanh(p["embed"][ids] @ p["body"])

  def head(p, ids, h):
    return h @ (p["embed"].T if tied else p["head"])

  return (params, IDS), hidden, head


def _linen(tied):
  nn = pytest.importorskip("flax.linen")

  class LM(nn.Module):
    def setup(self):
      self.embed = nn.Embed(V, D)
      self.body = nn.Dense(D)
      self.out = nn.Dense(V)

    def hidden(self, ids):
      return jnp.tanh(self.body(self.embed(ids)))

    def head(self, h):
      return self.embed.attend(h) if tied else self.out(h)

    def __call__(self, ids):
      return self.head(self.hidden(ids))

  model = LM()
  variables = model.init(jax.random.key(0), IDS)

  def hidden(v, ids):
    return model.apply(v, ids, method="hidden")

  def head(v, ids, h):
    return model.apply(v, h, method="head")

  return (variables, IDS), hidden, head


def _nnx(tied):
  nnx = pytest.importorskip("flax.nnx")

  class LM(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(V, D, rngs=rngs)
      self.body = nnx.Linear(D, D, rngs=rngs)
      self.lm_head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    def hidden(self, ids):
      return jnp.tanh(self.body(self.embed(ids)))

    def head(self, h):
      return self.embed.attend(h) if tied else self.lm_head(h)

  return (
    (LM(nnx.Rngs(0)), IDS),
    lambda m, ids: m.hidden(ids),
    lambda m, ids, h: m.head(h),
  )


def _equinox(tied):
  eqx = pytest.importorskip("equinox")
  k = jax.random.split(jax.random.key(0), 3)
  model = {
    "embed": eqx.nn.Embedding(V, D, key=k[0]),
    "body": eqx.nn.Linear(D, D, key=k[1]),
    "head": eqx.nn.Linear(D, V, key=k[2]),
  }
  per_token = lambda f: jax.vmap(jax.vmap(f))  # noqa: E731

  def hidden(m, ids):
    return per_token(lambda i: jnp.tanh(m["body"](m["embed"](i))))(ids)

  def head(m, ids, h):
    if tied:
      return per_token(lambda h: m["embed"].weight @ h)(h)
    return per_token(m["head"])(h)

  return (model, IDS), hidden, head


MODELS = {
  "plain JAX": lambda: _plain(False),
  "plain JAX, tied": lambda: _plain(True),
  "Linen": lambda: _linen(False),
  "Linen, tied (Embed.attend)": lambda: _linen(True),
  "NNX lm_head": lambda: _nnx(False),
  "NNX embed.attend": lambda: _nnx(True),
  "Equinox": lambda: _equinox(False),
  "Equinox, tied": lambda: _equinox(True),
}


def _full(hidden, head):
  return lambda *a: head(*a, hidden(*a))


@pytest.mark.parametrize("recipe", KEEPING)
@pytest.mark.parametrize("name", MODELS)
def test_the_output_layer_is_kept_and_the_rest_quantised(name, recipe):
  args, hidden, head = MODELS[name]()
  keeping, nothing_kept = KEEPING[recipe]
  full = _full(hidden, head)
  fast = ols.autocast(full, compute_dtype=BF16, matmul=keeping)
  found = ols.list_matmuls(fast, *args)
  assert [(m.kind, m.precision, m.kept) for m in found] == [
    ("weight", recipe, None),
    ("weight", "bfloat16", "output"),
  ], ols.format_matmuls(found)
  # The reference: the hidden layers alone in the recipe, the output layer
  # alone in plain bfloat16.
  h = ols.autocast(hidden, compute_dtype=BF16, matmul=nothing_kept)(*args)
  want = ols.autocast(head, compute_dtype=BF16)(*args, h)
  got = fast(*args)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # Not the bfloat16 model (the hidden layer was quantised), nor the one
  # with nothing kept (the output layer was not).
  half = ols.autocast(full, compute_dtype=BF16)(*args)
  every = ols.autocast(full, compute_dtype=BF16, matmul=nothing_kept)(*args)
  err = lambda y: float(jnp.abs(y - want).max() / jnp.abs(want).max())  # noqa: E731
  assert err(half) > 1e-3 and err(every) > 1e-3, (err(half), err(every))


#: name -> a recipe with ``keep``.
WITH_KEEP = {
  "nvfp4": ols.NVFP4Matmul,
  "float8": ols.Float8Matmul,
  "mxfp8": ols.MXFP8Matmul,
}


@pytest.mark.parametrize("recipe", WITH_KEEP)
@pytest.mark.parametrize("name", [n for n in MODELS if "tied" in n or "attend" in n])
def test_a_tied_output_layer_is_an_embeddings_matmul(name, recipe):
  # Kept by "embedding" alone too: it reads the table the model gathers from.
  args, hidden, head = MODELS[name]()
  matmul = WITH_KEEP[recipe](keep=("embedding",))
  found = ols.list_matmuls(
    ols.autocast(_full(hidden, head), compute_dtype=BF16, matmul=matmul), *args
  )
  assert [(m.precision, m.kept) for m in found] == [
    (recipe, None),
    ("bfloat16", "embedding"),
  ]


def test_an_untied_output_layer_is_not_an_embeddings_matmul():
  args, hidden, head = _plain(False)
  recipe = ols.NVFP4Matmul(keep=("embedding",))
  found = ols.list_matmuls(
    ols.autocast(_full(hidden, head), compute_dtype=BF16, matmul=recipe), *args
  )
  assert [(m.precision, m.kept) for m in found] == [("nvfp4", None)] * 2


# --- a mixture of experts whose expert weights are transformed ------------------

E, N = 4, 8
EXPERTS = _table(3, (E, D, D), D**-0.5)
X = _table(4, (N, D))


def _weight_normed(w):
  return w / jnp.linalg.norm(w, axis=1, keepdims=True)


TRANSFORMS = {
  "as they are": lambda w, s: w,
  "scaled": lambda w, s: w * s[:, None, None],
  "weight-normed": lambda w, s: _weight_normed(w) * s[:, None, None],
}


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_vmapped_experts_with_transformed_weights_are_weights_matmuls(transform):
  scale = jnp.linspace(0.5, 2.0, E, dtype=jnp.float32)

  def vmapped(w, s, x):
    w = TRANSFORMS[transform](w, s)
    return jax.vmap(lambda w: x @ w)(w)

  def looped(w, s, x):  # each expert its own (unbatched) matmul
    w = TRANSFORMS[transform](w, s)
    return jnp.stack([x @ w[e] for e in range(E)])

  # MXFP8 without attention: an expert's matmul classed as attention would
  # stay bfloat16. Its scales are per block, so the vmapped and the looped
  # experts quantise the same blocks.
  recipe = ols.MXFP8Matmul(attention=False)
  fast = ols.autocast(vmapped, compute_dtype=BF16, matmul=recipe)
  (found,) = ols.list_matmuls(fast, EXPERTS, scale, X)
  assert (found.kind, found.precision) == ("weight", "mxfp8")
  want = ols.autocast(looped, compute_dtype=BF16, matmul=recipe)(EXPERTS, scale, X)
  # (The looped products are stacked in float32, the vmapped one is bfloat16.)
  want = want.astype(BF16).astype(jnp.float32)
  np.testing.assert_array_equal(np.asarray(fast(EXPERTS, scale, X)), np.asarray(want))
  half = ols.autocast(looped, compute_dtype=BF16)(EXPERTS, scale, X)
  assert not np.array_equal(np.asarray(half), np.asarray(want))


def test_attention_is_still_attention():
  # Queries and keys both derive from a matmul, or from a common input.
  wq, wk = _table(5, (D, D), D**-0.5), _table(6, (D, D), D**-0.5)
  x = _table(7, (B, T, D))

  def projected(wq, wk, x):
    return jnp.einsum("bqd,bkd->bqk", x @ wq, x @ wk)

  def unprojected(x):
    y = jnp.tanh(x)
    return jnp.einsum("bqd,bkd->bqk", y, 2 * y)

  for f, args in ((projected, (wq, wk, x)), (unprojected, (x,))):
    found = ols.list_matmuls(ols.autocast(f, compute_dtype=BF16, matmul="nvfp4"), *args)
    assert found[-1].kind == "attention" and found[-1].kept == "attention"


# --- exclusion by name: a pattern that matches nothing is a warning -------------


def test_an_exclude_pattern_that_matches_nothing_warns():
  args, hidden, head = _nnx(False)
  recipe = ols.NVFP4Matmul(exclude=(r"lm_head$",), keep=())
  fast = ols.autocast(_full(hidden, head), compute_dtype=BF16, matmul=recipe)
  with pytest.warns(UserWarning, match=r"exclude pattern 'lm_head\$' matches none"):
    found = ols.list_matmuls(fast, *args)
  assert [m.precision for m in found] == ["nvfp4"] * 2  # what the warning says


@pytest.mark.parametrize("recipe", WITH_KEEP)
def test_an_exclude_pattern_that_matches_is_kept_by_name(recipe):
  args, hidden, head = _linen(False)
  matmul = WITH_KEEP[recipe](exclude=(r"body$",), keep=())
  fast = ols.autocast(_full(hidden, head), compute_dtype=BF16, matmul=matmul)
  found = ols.list_matmuls(fast, *args)  # no warning (warnings are errors here)
  assert [(m.path, m.precision, m.kept) for m in found] == [
    ("LM.hidden/body", "bfloat16", r"exclude body$"),
    ("LM.head/out", recipe, None),
  ]


@pytest.mark.parametrize(
  "keep, message",
  [
    ("output", "must be a tuple of roles"),
    (None, "must be a tuple of roles"),
    (("output", "head"), "are not roles"),
  ],
)
@pytest.mark.parametrize("recipe", WITH_KEEP)
def test_keep_is_checked(recipe, keep, message):
  with pytest.raises(ValueError, match=message):
    WITH_KEEP[recipe](keep=keep)


# --- the roles at any depth -------------------------------------------------------

WS = jnp.stack([_table(8 + i, (D, D), D**-0.5) for i in range(3)])
HEAD = _table(11, (D, V), D**-0.5)
H = _table(12, (N, D))


def _scanned_stack(ws, head, h):
  h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, ws)
  return jnp.sum(jax.nn.log_softmax(h @ head))


def _head_in_jit(ws, head, h):
  h = jnp.tanh(h @ ws[0])
  return jax.jit(lambda h: jnp.sum(jax.checkpoint(lambda h: h @ head)(h) ** 2))(h)


def _head_in_cond(ws, head, h):
  h = jnp.tanh(h @ ws[0])
  return jax.lax.cond(h[0, 0] > 0, lambda h: h @ head, lambda h: -(h @ head), h)


def _head_in_a_loop(ws, head, h):  # the last step's product reaches the output
  return jax.lax.fori_loop(0, 2, lambda i, h: jnp.tanh(h @ ws[i]), h)


DEPTHS = {
  "scanned layers, then the head": (_scanned_stack, [None, "output"]),
  "the head inside jit and checkpoint": (_head_in_jit, [None, "output"]),
  "the head inside cond": (_head_in_cond, [None, "output", "output"]),
  "the loop's product is the output": (_head_in_a_loop, ["output"]),
}


@pytest.mark.parametrize("name", DEPTHS)
def test_the_output_layer_is_found_at_any_depth(name):
  f, kept = DEPTHS[name]
  fast = ols.autocast(f, compute_dtype=BF16, matmul="nvfp4")
  found = ols.list_matmuls(fast, WS, HEAD, H)
  assert [m.kept for m in found] == kept, ols.format_matmuls(found)
  assert [m.precision for m in found] == [
    "nvfp4" if k is None else "bfloat16" for k in kept
  ]


def test_attention_is_batched_attention_only():
  """An unbatched ``q @ k.T`` (one example, one head) is a weight's matmul,
  as the exclusion page says: autocast the batched function to keep
  attention out of a recipe."""

  def attn(x, wq, wk, wv):
    q, k, v = x @ wq, x @ wk, x @ wv
    return jnp.tanh(jax.nn.softmax(q @ k.T / 5, -1) @ v)

  x, w = jnp.ones((4, 6, 32)), jnp.ones((32, 32))
  recipe = dict(compute_dtype=jnp.bfloat16, matmul="float8")
  one = ols.list_matmuls(ols.autocast(attn, **recipe), x[0], w, w, w)
  assert [m.kept for m in one] == [None] * 5
  batched = jax.vmap(attn, (0, None, None, None))
  kept = [m.kept for m in ols.list_matmuls(ols.autocast(batched, **recipe), x, w, w, w)]
  assert kept.count("attention") == 2 and kept.count(None) == 3
