"""autocast and enable_mixed_precision: the rewritten jaxpr, values, gradients."""

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import optax_lossscale as ols

pytest.importorskip("flax", reason="the models autocast is tested on are Flax's")
from jaxprs import eqns as _eqns  # noqa: E402
from models import CNN, MLP, Attention, ScanRemat  # noqa: E402

pytestmark = pytest.mark.standard_promotion  # Flax layers
F16 = jnp.dtype(jnp.float16)


MODELS = {
  "mlp": (MLP, (8, 32)),
  "cnn": (CNN, (4, 8, 8, 3)),
  "attention": (Attention, (4, 6, 16)),
  "scan+remat": (ScanRemat, (4, 5, 16)),
}


def _setup(name):
  cls, shape = MODELS[name]
  model = cls()
  x = jnp.asarray(np.random.default_rng(0).normal(size=shape), jnp.float32)
  variables = jax.jit(model.init)(jax.random.key(0), x)

  def loss(params, x):
    logits = model.apply({**variables, "params": params}, x)
    return -jnp.mean(jax.nn.log_softmax(logits)[:, 0])

  return loss, variables["params"], x


@pytest.mark.parametrize("name", MODELS)
def test_values_and_gradients_match_float32(name):
  loss, params, x = _setup(name)
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss))(params, x)
  fast = ols.autocast(loss, compute_dtype=jnp.float16)
  got_loss, got_grads = jax.jit(jax.value_and_grad(fast))(params, x)
  assert got_loss.dtype == jnp.float32
  # float16 has an 11-bit significand: 1e-3 relative on the loss, and the
  # gradients within 2% of the largest gradient entry (a leaf whose exact
  # gradient is 0, such as attention's key bias, is judged on that scale).
  np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-3)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref_grads))
  for got, ref in zip(
    jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads), strict=True
  ):
    assert got.dtype == jnp.float32  # float32 parameters get float32 gradients
    assert float(jnp.max(jnp.abs(got - ref))) <= 0.02 * scale
  # And the rewrite did something: every matmul/convolution in float16.
  jaxpr = jax.make_jaxpr(fast)(params, x).jaxpr
  heavy = [e for e in _eqns(jaxpr) if e.primitive.name in ols.ALLOW_LIST]
  assert heavy and all(
    v.aval.dtype == F16 for e in heavy for v in e.invars if hasattr(v, "aval")
  )


def test_denied_primitives_run_in_float32():
  loss, params, x = _setup("attention")
  jaxpr = jax.make_jaxpr(ols.autocast(loss, compute_dtype=jnp.float16))(params, x)
  denied = [
    e
    for e in _eqns(jaxpr.jaxpr)
    if e.primitive.name in ("exp", "log", "reduce_sum", "div", "rsqrt")
  ]
  assert {e.primitive.name for e in denied} >= {"exp", "log", "reduce_sum"}
  for e in denied:
    for v in e.invars:
      if jnp.issubdtype(v.aval.dtype, jnp.floating):
        assert v.aval.dtype == jnp.float32, e


def test_lists_can_be_overridden():
  f = lambda w, x: jnp.sum(jnp.tanh(x @ w))
  w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
  plain = ols.autocast(f, compute_dtype=jnp.float16)
  moved = ols.autocast(
    f,
    compute_dtype=jnp.float16,
    allow=ols.ALLOW_LIST - {"dot_general"},
    deny=ols.DENY_LIST | {"dot_general"},
  )

  def dot_dtype(g):
    j = jax.make_jaxpr(g)(w, x).jaxpr
    return (
      next(e for e in _eqns(j) if e.primitive.name == "dot_general")
      .invars[0]
      .aval.dtype
    )

  assert dot_dtype(plain) == F16 and dot_dtype(moved) == jnp.float32
  with pytest.raises(ValueError, match="both"):
    ols.autocast(f, deny=ols.DENY_LIST | {"dot_general"})
  with pytest.raises(ValueError, match="compute_dtype"):
    ols.autocast(f, compute_dtype=jnp.float32)
  with pytest.raises(ValueError, match="strings"):
    ols.autocast(f, allow=[jnp.float16])


def test_control_flow_custom_rules_and_integers():
  @jax.custom_jvp
  def softplus(x):
    return jnp.logaddexp(x, 0.0)

  softplus.defjvp(lambda p, t: (softplus(p[0]), t[0] * jax.nn.sigmoid(p[0])))

  def f(w, x, n):
    h = softplus(x @ w)
    h = lax.scan(lambda c, r: (c + r, c * 2.0), jnp.zeros(h.shape[1]), h)[0]
    h = lax.while_loop(lambda s: s[0] < n, lambda s: (s[0] + 1, s[1] * 0.5), (0, h))[1]
    h = lax.cond(h.sum() > 0, lambda v: v * 2.0, lambda v: -v, h)
    return h, jnp.argmax(h), n + 1

  w = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5)), jnp.float32)
  x = jnp.asarray(np.random.default_rng(2).normal(size=(4, 3)), jnp.float32)
  n = jnp.int32(3)
  ref = f(w, x, n)
  got = jax.jit(ols.autocast(f, compute_dtype=jnp.float16))(w, x, n)
  assert [a.dtype for a in got] == [a.dtype for a in ref]  # outputs cast back
  np.testing.assert_allclose(got[0], ref[0], rtol=1e-2)
  assert int(got[2]) == 4

  # Gradients through the custom_jvp, the scan and the cond (JAX itself does
  # not differentiate a while_loop in reverse mode).
  def g(w):
    h = softplus(x @ w)
    h = lax.scan(lambda c, r: (c + r, c * 2.0), jnp.zeros(h.shape[1]), h)[0]
    return lax.cond(h.sum() > 0, lambda v: v * 2.0, lambda v: -v, h).sum()

  gw = jax.grad(ols.autocast(g, compute_dtype=jnp.float16))(w)
  np.testing.assert_allclose(gw, jax.grad(g)(w), rtol=2e-2, atol=1e-3)


def test_vmap_over_the_rewritten_function():
  f = lambda w, x: jnp.tanh(x @ w).sum()
  w = jnp.ones((3, 2)) / 3
  xs = jnp.asarray(np.random.default_rng(3).normal(size=(5, 4, 3)), jnp.float32)
  fast = ols.autocast(f, compute_dtype=jnp.float16)
  batched = jax.vmap(fast, in_axes=(None, 0))(w, xs)
  one_by_one = jnp.stack([fast(w, x) for x in xs])
  np.testing.assert_allclose(batched, one_by_one, rtol=1e-6)
  np.testing.assert_allclose(batched, jax.vmap(f, in_axes=(None, 0))(w, xs), rtol=1e-2)


def test_unsupported_primitive_is_named():
  mesh = jax.make_mesh((1,), ("d",))

  def f(x):
    return jax.shard_map(lambda y: y * 2, mesh=mesh, in_specs=P(), out_specs=P())(x)

  with pytest.raises(NotImplementedError, match="shard_map"):
    ols.autocast(f, compute_dtype=jnp.float16)(jnp.ones(3))


def test_enable_mixed_precision():
  loss, params, x = _setup("mlp")
  fast, tx = ols.porting.enable_mixed_precision(
    loss, optax.adam(1e-3), compute_dtype=jnp.float16, growth_interval=10
  )
  state = tx.init(params)
  assert float(ols.get_scale(state)) == 2.0**15
  lv, grads = ols.value_and_grad(fast)(state, params, x)
  updates, state = tx.update(grads, state, params)
  assert int(state.good_steps) == 1
  fast, tx = ols.porting.enable_mixed_precision(
    loss, optax.adam(1e-3), compute_dtype=jnp.bfloat16
  )
  assert float(ols.get_scale(tx.init(params))) == 1.0  # NoOpLossScale
  with pytest.raises(ValueError, match="does not need loss scaling"):
    ols.porting.enable_mixed_precision(
      loss, optax.adam(1e-3), compute_dtype=jnp.bfloat16, growth_interval=10
    )


@pytest.mark.parametrize("compute_dtype", [None, jnp.float16, jnp.bfloat16])
def test_enable_mixed_precision_says_what_it_chose(caplog, compute_dtype):
  loss, params, _ = _setup("mlp")
  with caplog.at_level("INFO", logger="optax_lossscale"):
    fast, tx = ols.porting.enable_mixed_precision(
      loss, optax.sgd(0.1), compute_dtype=compute_dtype
    )
  # Without compute_dtype, the backend's: bfloat16 on the CPU.
  expected = ols.default_half_dtype() if compute_dtype is None else compute_dtype
  assert fast.compute_dtype == expected
  float16 = expected == jnp.float16
  how = f"the {jax.default_backend()} default" if compute_dtype is None else "given"
  scaling = "dynamic loss scaling" if float16 else "no loss scaling"
  assert [r.getMessage() for r in caplog.records] == [
    f"enable_mixed_precision: compute dtype {jnp.dtype(expected).name} ({how}), "
    f"{scaling}."
  ]
  assert float(ols.get_scale(tx.init(params))) == (2.0**15 if float16 else 1.0)


def test_custom_vjp_body_is_rewritten():
  @jax.custom_vjp
  def scaled_tanh(x):
    return jnp.tanh(x) * 3.0

  scaled_tanh.defvjp(
    lambda x: (scaled_tanh(x), x), lambda x, g: (g * 3.0 * (1 - jnp.tanh(x) ** 2),)
  )

  def f(w, x):
    return jnp.sum(scaled_tanh(x @ w))

  w = jnp.asarray(np.random.default_rng(4).normal(size=(3, 2)), jnp.float32)
  x = jnp.asarray(np.random.default_rng(5).normal(size=(4, 3)), jnp.float32)
  fast = ols.autocast(f, compute_dtype=jnp.float16)
  jaxpr = jax.make_jaxpr(fast)(w, x).jaxpr
  dots = [e for e in _eqns(jaxpr) if e.primitive.name == "dot_general"]
  assert dots and dots[0].invars[0].aval.dtype == F16
  np.testing.assert_allclose(fast(w, x), f(w, x), rtol=1e-2)
  np.testing.assert_allclose(
    jax.grad(fast)(w, x), jax.grad(f)(w, x), rtol=2e-2, atol=1e-3
  )


# --- the user's own numerics are kept ----------------------------------------


def test_an_explicit_wider_result_type_is_kept():
  a = jnp.full((4, 256), 64.0, jnp.float16)
  b = jnp.full((256, 4), 64.0, jnp.float16)
  f = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)
  got = ols.autocast(f, compute_dtype=jnp.float16)(a, b)
  assert got.dtype == jnp.float32 and float(got[0, 0]) == 64.0 * 64.0 * 256
  # jax.nn.dot_product_attention's logits: float32 on purpose, still float32.
  q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
  g = ols.autocast(
    lambda q: jax.nn.dot_product_attention(q, q, q), compute_dtype=jnp.bfloat16
  )
  dots = [
    e for e in _eqns(jax.make_jaxpr(g)(q).jaxpr) if e.primitive.name == "dot_general"
  ]
  assert dots[0].outvars[0].aval.dtype == jnp.float32


def _straight_through(x):
  @jax.custom_vjp
  def ste(x):
    return jnp.round(x)

  ste.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (g,))
  return jnp.sum(ste(x * 2.0))


@pytest.mark.parametrize(
  "name, f, x",
  [
    ("straight-through custom_vjp", _straight_through, jnp.array([0.3, 1.7])),
    ("relu's custom_jvp at 0", lambda x: jnp.sum(jax.nn.relu(x)), jnp.zeros(3)),
    ("pinv's custom_jvp", lambda x: jnp.sum(jnp.linalg.pinv(x)), jnp.eye(2)),
  ],
)
def test_custom_derivative_rules_are_kept(name, f, x):
  expected = jax.grad(f)(x)
  fast = ols.autocast(f, compute_dtype=jnp.float16)
  # pinv's body holds matmuls: rewritten there, its rule's kept as written
  rewrites = "pinv" in name
  with (
    pytest.warns(ols.CustomRuleWarning, match="custom_jvp function '_pinv'")
    if rewrites
    else contextlib.nullcontext()
  ):
    np.testing.assert_allclose(jax.grad(fast)(x), expected, err_msg=name)
  with warnings.catch_warnings():  # the same rewrite, cached: warned above
    warnings.simplefilter("ignore", ols.CustomRuleWarning)
    np.testing.assert_allclose(jax.jit(jax.grad(fast))(x), expected, err_msg=name)


def _dense_vjp(x, w):
  @jax.custom_vjp
  def dense(x, w):
    return x @ w

  dense.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))
  return jnp.sum(jnp.tanh(dense(x, w)))


def _dense_jvp(x, w):
  @jax.custom_jvp
  def dense(x, w):
    return x @ w

  dense.defjvp(lambda p, t: (p[0] @ p[1], t[0] @ p[1] + p[0] @ t[1]))
  return jnp.sum(jnp.tanh(dense(x, w)))


def _elementwise_vjp(x, w):
  return _straight_through(x @ w)


@pytest.mark.parametrize("matmul", [None, "float8"])
@pytest.mark.parametrize(
  "name, f, rewrites",
  [
    ("custom_vjp", _dense_vjp, True),
    ("custom_jvp", _dense_jvp, True),
    ("no matmul inside", _elementwise_vjp, False),
  ],
)
def test_a_custom_rule_whose_body_matmuls_are_rewritten_says_so(
  name, f, rewrites, matmul
):
  """Differentiated, JAX runs the rule as written (float32 here): the value
  under grad is the float32 function's, and a CustomRuleWarning says so
  wherever the body's matmuls were rewritten; a listing never warns."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
  fast = ols.autocast(f, compute_dtype=jnp.bfloat16, matmul=matmul)
  warns = (
    pytest.warns(ols.CustomRuleWarning, match=f"{name} function 'dense'")
    if rewrites
    else contextlib.nullcontext()
  )
  with warns:
    value, _ = jax.value_and_grad(fast, argnums=1)(x, w)
  if rewrites:  # the rule's forward, as written
    np.testing.assert_allclose(value, f(x, w), rtol=1e-6)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    ols.list_matmuls(fast, x, w)


@pytest.mark.parametrize(
  "spelling",
  [
    lambda h: jnp.square(h),
    lambda h: h**2,
    lambda h: h * h,
    lambda h: jnp.power(h, 2),
    lambda h: lax.integer_pow(h, 2),
    lambda h: lax.square(h),
  ],
)
def test_every_spelling_of_a_square_runs_in_float32(spelling):
  """An RMSNorm of activations near 300: their squares overflow float16."""

  def rms_norm(w, x):
    h = x @ w
    return h * lax.rsqrt(jnp.mean(spelling(h), axis=-1, keepdims=True) + 1e-6)

  w = jnp.full((4, 8), 10.0, jnp.float32)
  x = jnp.full((2, 4), 7.5, jnp.float32)  # h = 300, in float16 after the matmul
  fast = ols.autocast(rms_norm, compute_dtype=jnp.float16)
  np.testing.assert_allclose(fast(w, x), rms_norm(w, x), rtol=1e-2)
  squares = [
    e.outvars[0].aval.dtype
    for e in _eqns(jax.make_jaxpr(fast)(w, x).jaxpr)
    if e.primitive.name in ("square", "integer_pow", "pow")
    or (e.primitive.name == "mul" and e.invars[0] is e.invars[1])
  ]
  assert squares == [jnp.float32], squares


def test_non_array_arguments_are_static_arrays_are_traced():
  seen = []

  def f(x, scale, *, train, mode):
    seen.append((train, mode))
    y = x * scale
    return jnp.tanh(y) if (train and mode == "tanh") else y

  fast = ols.autocast(f, compute_dtype=jnp.float16)
  x = jnp.ones(3)
  np.testing.assert_allclose(
    fast(x, 0.5, train=True, mode="tanh"), f(x, 0.5, train=True, mode="tanh"), rtol=1e-3
  )
  np.testing.assert_allclose(fast(x, 2.0, train=False, mode="tanh"), 2.0 * x)
  out = jax.jit(lambda x: fast(x, 0.5, train=True, mode="id"))(x)
  np.testing.assert_allclose(out, 0.5 * x)
  # A Python number is a constant, as eqx.filter_jit keeps it (an Equinox
  # layer tests its dropout rate in Python): a new one is a new trace, with
  # its own value. An array is traced: a new value is no new trace.
  n = len(seen)
  np.testing.assert_allclose(fast(x, 0.25, train=False, mode="tanh"), 0.25 * x)
  assert len(seen) == n + 1
  fast(jnp.full(3, 2.0), np.float32(0.25), train=False, mode="tanh")
  n = len(seen)
  fast(jnp.full(3, 5.0), np.float32(0.75), train=False, mode="tanh")
  assert len(seen) == n


@pytest.mark.parametrize(
  "first, then",
  [
    (1, True),
    (True, 1),
    (1, 1.0),
    (0, False),
    (0.0, 0),
  ],
)
def test_constants_that_compare_equal_but_differ_in_type_are_other_signatures(
  first, then
):
  """As jax.jit keeps static arguments apart: 1, True and 1.0 hash alike."""

  def f(x, c):
    return jnp.sum(x @ x) * (10.0 if isinstance(c, bool) else float(c) + 1.0)

  fast = ols.autocast(f, compute_dtype=jnp.bfloat16)
  x = jnp.ones((4, 4))
  for c in (first, then):
    np.testing.assert_allclose(fast(x, c), f(x, c), rtol=1e-2, err_msg=repr(c))


@pytest.mark.parametrize("matmul", [None, "float8"])
def test_list_matmuls_takes_shape_dtype_structs_as_it_takes_arrays(matmul):
  def f(x, w, train=True):
    return jnp.tanh(x @ w) if train else x @ w

  fast = ols.autocast(f, compute_dtype=jnp.bfloat16, matmul=matmul)
  x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
  abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, w)]
  assert ols.list_matmuls(fast, *abstract) == ols.list_matmuls(fast, x, w)
  assert ols.list_matmuls(f, *abstract) == ols.list_matmuls(f, x, w)
  assert len(ols.list_matmuls(fast, *abstract, train=False)) == 1


@pytest.mark.parametrize("matmul", [None, "float8", "mxfp8"])
def test_list_matmuls_lists_a_partial_of_an_autocast_function_as_the_function(matmul):
  import functools

  def f(w, x, scale=1.0):
    return jnp.sum(jnp.tanh(x @ w) * scale)

  fast = ols.autocast(f, compute_dtype=jnp.bfloat16, matmul=matmul)
  w, x = jnp.ones((16, 8)), jnp.ones((4, 16))
  want = ols.list_matmuls(fast, w, x, scale=2.0)
  assert ols.list_matmuls(functools.partial(fast, w), x, scale=2.0) == want
  bound = functools.partial(functools.partial(fast, scale=2.0), w)
  assert ols.list_matmuls(bound, x) == want
  assert want[0].precision == (matmul or "bfloat16")


def test_calls_outside_jit_are_rewritten_once_per_signature():
  traces = []

  def f(x):
    traces.append(x.shape)
    return lax.scan(lambda c, r: (c + jnp.tanh(r), c), jnp.zeros(x.shape[1]), x)[0]

  fast = ols.autocast(f, compute_dtype=jnp.float16)
  for _ in range(5):
    fast(jnp.ones((3, 4)))
  assert traces == [(3, 4)]
  fast(jnp.ones((2, 4)))  # another signature: one more trace
  assert traces == [(3, 4), (2, 4)]


def test_two_autocast_traces_in_threads_keep_their_own_module_paths(monkeypatch):
  import threading

  from optax_lossscale._autocast import evaluate as walk

  w = jnp.ones((8, 8))

  def named(scope):
    def f(x):
      with jax.named_scope(scope):
        return jnp.tanh(x @ w) @ w

    return ols.autocast(f, compute_dtype=jnp.bfloat16)

  # Each thread waits, at its first matmul, until the other is at its own:
  # both walks are then inside their scopes at once.
  barrier = threading.Barrier(2, timeout=30)
  waited = threading.local()
  note = walk._note

  def meeting(*args, **kwargs):
    if not getattr(waited, "done", False):
      waited.done = True
      barrier.wait()
    return note(*args, **kwargs)

  monkeypatch.setattr(walk, "_note", meeting)
  found = {}

  def listing(scope):
    found[scope] = {m.path for m in ols.list_matmuls(named(scope), jnp.ones((2, 8)))}

  threads = [
    threading.Thread(target=listing, args=(s,)) for s in ("encoder", "decoder")
  ]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert found == {"encoder": {"encoder"}, "decoder": {"decoder"}}


def test_nested_conds_are_rewritten_once_a_branch(monkeypatch):
  from optax_lossscale._autocast import evaluate as walk

  def nested(depth):
    """A cond whose first branch holds a cond whose first branch ..."""
    if depth == 0:
      return lambda x: jnp.sin(x) @ jnp.eye(4)
    inner = nested(depth - 1)
    return lambda x: lax.cond(x.sum() > 0, inner, jnp.cos, x)

  calls = []
  evaluate = walk.evaluate
  monkeypatch.setattr(
    walk, "evaluate", lambda *a, **k: calls.append(1) or evaluate(*a, **k)
  )
  counts = []
  for depth in (2, 6):
    calls.clear()
    g = ols.autocast(nested(depth), compute_dtype=jnp.bfloat16)
    jax.make_jaxpr(g)(jnp.ones(4))
    counts.append(len(calls))
  # the function's jaxpr, and two branches a cond: linear in the depth (each
  # branch traced twice would double the count at every level)
  assert counts == [1 + 2 * 2, 1 + 2 * 6]
