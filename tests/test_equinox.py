"""value_and_grad over trees with non-array leaves, and Equinox as a client.

``ols.value_and_grad`` differentiates the floating-point array leaves of its
arguments and gives ``None`` for every other leaf (functions, integers,
Python numbers), as ``equinox.filter_value_and_grad`` does; the tests with
Equinox modules (an MLP with activation leaves, autocast, a training loop
under ``eqx.filter_jit`` with a skipped step) skip when Equinox is absent.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxprs import eqns as all_eqns

import optax_lossscale as ols

SCALE = 2.0**10


def _state(params=None):
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=SCALE)
  return tx.init({} if params is None else params)


@pytest.fixture
def eqx():
  return pytest.importorskip("equinox", reason="the Equinox tests need equinox")


def _mlp(eqx, key=0):
  return eqx.nn.MLP(4, 3, 16, 2, activation=jax.nn.gelu, key=jax.random.key(key))


def _loss(model, x):
  return jnp.mean(jax.vmap(model)(x) ** 2)


def _x():
  return jax.random.normal(jax.random.key(1), (8, 4))


# --- any pytree ---------------------------------------------------------------


#: (leaf, whether it is differentiated).
LEAVES = {
  "float32 array": (jnp.float32(1.5), True),
  "float16 array": (jnp.ones(3, jnp.float16), True),
  "numpy float64": (np.ones(2), True),
  "int32 array": (jnp.arange(3), False),
  "bool array": (jnp.array([True, False]), False),
  "Python float": (0.5, False),
  "Python int": (3, False),
  "function": (jnp.tanh, False),
  "string": ("relu", False),
}


@pytest.mark.parametrize("kind", LEAVES)
def test_each_leaf_kind_is_differentiated_or_held_constant(kind):
  leaf, differentiated = LEAVES[kind]
  tree = {"w": jnp.float32(3.0), "other": leaf}

  def f(t):
    extra = jnp.sum(jnp.asarray(t["other"], jnp.float32)) if differentiated else 0.0
    return t["w"] ** 2 + extra

  loss, grads = ols.value_and_grad(f)(_state(), tree)
  assert float(grads["w"]) == 6.0 * SCALE
  if differentiated:
    assert grads["other"].dtype == jnp.asarray(leaf).dtype
    np.testing.assert_array_equal(grads["other"], np.full(np.shape(leaf), SCALE))
  else:
    assert grads["other"] is None
  assert float(loss) == float(f(tree))


def test_a_function_leaf_is_called_not_differentiated_under_jit():
  tree = {"w": jnp.arange(3.0), "act": jax.nn.relu, "n": jnp.int32(2)}
  f = lambda t, x: jnp.sum(t["act"](t["w"] * x) * t["n"].astype(jnp.float32))  # noqa: E731
  grad_fn = ols.value_and_grad(f, argnums=(0, 1))
  loss, (g_tree, g_x) = jax.jit(lambda s, x: grad_fn(s, tree, x))(_state(), 1.0)
  assert float(loss) == 6.0  # 2 * (relu(0) + relu(1) + relu(2))
  assert g_tree["act"] is None and g_tree["n"] is None
  np.testing.assert_array_equal(g_tree["w"], np.array([0.0, 2.0, 2.0]) * SCALE)
  assert float(g_x) == 6.0 * SCALE  # a traced float is an array


@pytest.mark.parametrize("argnums", [2, -3, (0, 5), (), (0, 0), (0, -2), (1, 0, 1)])
def test_argnums_that_name_no_argument_or_one_twice_are_a_value_error(argnums):
  """A position named twice gave its first copy a zero gradient (the second
  overwrote the argument it was taken at); jax.grad refuses it too."""
  with pytest.raises(ValueError, match=r"value_and_grad\(argnums="):
    ols.value_and_grad(lambda a, b: a * b, argnums=argnums)(
      _state(), jnp.float32(1.0), jnp.float32(2.0)
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
  "loss",
  [lambda a: jnp.sum(a).astype(jnp.int32), lambda a: jnp.sum(a) > 0, lambda a: 3],
)
def test_a_loss_that_is_not_floating_is_a_value_error(loss, jit):
  """Its gradient is 0 whatever the function (jax.grad refuses it)."""
  grad_fn = ols.value_and_grad(loss)
  if jit:
    grad_fn = jax.jit(grad_fn)
  with pytest.raises(ValueError, match="must return a floating loss"):
    grad_fn(_state(), jnp.ones(2))


# --- Equinox ------------------------------------------------------------------


def test_an_equinox_mlp_with_activation_leaves_gets_eqx_filter_gradients(eqx):
  model, x = _mlp(eqx), _x()
  assert any(callable(leaf) for leaf in jax.tree.leaves(model))
  loss, grads = ols.value_and_grad(_loss)(_state(), model, x)
  ref_loss, ref = eqx.filter_value_and_grad(_loss)(model, x)
  assert float(loss) == float(ref_loss)
  # The same tree, None where Equinox has None (the activations).
  assert jax.tree.structure(grads) == jax.tree.structure(ref)
  assert grads.activation is None and grads.final_activation is None
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
    np.testing.assert_allclose(g, r * SCALE, rtol=1e-6)


def test_an_equinox_module_with_static_and_integer_fields(eqx):
  class Net(eqx.Module):
    weight: jax.Array
    half: jax.Array
    count: jax.Array
    p: float
    name: str = eqx.field(static=True)

    def __call__(self, x):
      h = (self.weight @ x).astype(jnp.float16) * self.half
      return jnp.sum(h.astype(jnp.float32)) * self.p * self.count.astype(jnp.float32)

  net = Net(
    weight=jnp.ones((2, 3)),
    half=jnp.full(2, 2.0, jnp.float16),
    count=jnp.int32(3),
    p=0.5,
    name="net",
  )
  _, grads = ols.value_and_grad(lambda m: m(jnp.ones(3)))(_state(), net)
  ref = eqx.filter_grad(lambda m: m(jnp.ones(3)))(net)
  assert grads.count is None and grads.p is None and grads.name == "net"
  assert grads.half.dtype == jnp.float16 and grads.weight.dtype == jnp.float32
  np.testing.assert_array_equal(grads.weight, ref.weight * SCALE)
  np.testing.assert_array_equal(grads.half, ref.half * SCALE)


@pytest.mark.standard_promotion  # optax's adam
def test_an_equinox_float16_loop_under_filter_jit_skips_a_nan_step(eqx):
  model, x = _mlp(eqx), _x()
  y = jnp.sin(x[:, :3])
  tx = ols.dynamic_loss_scale(optax.adam(1e-2))
  opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

  def loss_fn(model, x, y):
    half = jax.tree.map(
      lambda a: a.astype(jnp.float16) if eqx.is_inexact_array(a) else a, model
    )
    pred = jax.vmap(half)(x.astype(jnp.float16)).astype(jnp.float32)
    return jnp.mean((pred - y) ** 2)

  @eqx.filter_jit
  def step(model, opt_state, x, y):
    loss, grads = ols.value_and_grad(loss_fn)(opt_state, model, x, y)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, opt_state = tx.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, loss

  losses = []
  for _ in range(30):
    model, opt_state, loss = step(model, opt_state, x, y)
    losses.append(float(loss))
  assert losses[-1] < 0.5 * losses[0], losses
  assert int(ols.diagnostics(opt_state)["skipped_steps"]) == 0
  scale = float(ols.get_scale(opt_state))
  after, opt_state, loss = step(model, opt_state, x.at[0, 0].set(jnp.nan), y)
  assert not np.isfinite(float(loss))
  assert bool(ols.diagnostics(opt_state)["last_step_skipped"])
  assert float(ols.get_scale(opt_state)) == scale / 2
  for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(model), strict=True):
    if eqx.is_array(a):
      np.testing.assert_array_equal(a, b)
    else:
      assert a is b


def test_autocast_on_an_equinox_module(eqx):
  model, x = _mlp(eqx), _x()
  fast = ols.autocast(_loss, compute_dtype=jnp.float16)
  params, static = eqx.partition(model, eqx.is_inexact_array)
  jaxpr = jax.make_jaxpr(lambda p: fast(eqx.combine(p, static), x))(params).jaxpr
  dots = [e for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]
  assert dots and all(v.aval.dtype == jnp.float16 for e in dots for v in e.invars), (
    "the module's matmuls must read float16"
  )
  np.testing.assert_allclose(float(fast(model, x)), float(_loss(model, x)), rtol=1e-2)
  loss, grads = eqx.filter_jit(ols.value_and_grad(fast))(_state(), model, x)
  _, ref = eqx.filter_value_and_grad(_loss)(model, x)
  assert jax.tree.structure(grads) == jax.tree.structure(ref)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(
      g / SCALE, r, rtol=0.05, atol=2e-3 * float(jnp.max(jnp.abs(r)))
    )


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_autocast_on_equinox_attention_keeps_its_python_numbers(eqx, dropout_p):
  # eqx.nn.Dropout tests its rate in Python (`p == 0` skips it); autocast keeps
  # Python numbers as constants, as eqx.filter_jit does, so the rate is not a
  # tracer and inference mode needs no key.
  attention = eqx.nn.MultiheadAttention(
    2, 8, dropout_p=dropout_p, key=jax.random.key(0)
  )
  x = jax.random.normal(jax.random.key(1), (5, 8))
  f = lambda m, x: jnp.sum(m(x, x, x, inference=dropout_p > 0) ** 2)  # noqa: E731
  fast = ols.autocast(f, compute_dtype=jnp.float16)
  np.testing.assert_allclose(
    float(fast(attention, x)), float(f(attention, x)), rtol=1e-2
  )
  loss, grads = eqx.filter_jit(ols.value_and_grad(fast))(_state(), attention, x)
  assert grads.dropout.p is None and grads.query_proj.weight.dtype == jnp.float32
  np.testing.assert_allclose(float(loss), float(f(attention, x)), rtol=1e-2)


def _batchnorm_net(eqx):
  class Net(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __init__(self, key):
      self.linear = eqx.nn.Linear(4, 8, key=key)
      # "ema" keeps a boolean first-call flag in its state, beside the averages.
      self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="ema", momentum=0.5)

    def __call__(self, x, state):
      return self.norm(self.linear(x), state)

  return eqx.nn.make_with_state(Net)(jax.random.key(0))


def _batchnorm_loss(model, state, x):
  batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
  y, state = batched(x, state)
  return jnp.mean(jnp.tanh(y) ** 2), state


@pytest.mark.parametrize("entry", ["call", "filter_jit", "filter_value_and_grad"])
def test_autocast_on_an_equinox_batchnorm_keeps_its_state(eqx, entry):
  # Two steps, the state carried: the flag (True, then False) and the
  # averages as the float32 model's, within bfloat16's precision.
  def step(f):
    if entry == "call":
      return f
    if entry == "filter_jit":
      return eqx.filter_jit(f)
    grad = eqx.filter_value_and_grad(f, has_aux=True)
    return lambda *a: grad(*a)[0]

  x = jax.random.normal(jax.random.key(1), (16, 4)) * 3 + 1
  runs = []
  for f in (_batchnorm_loss, ols.autocast(_batchnorm_loss, compute_dtype=jnp.bfloat16)):
    model, state = _batchnorm_net(eqx)
    losses = []
    for _ in range(2):
      loss, state = step(f)(model, state, x)
      losses.append(float(loss))
    runs.append((losses, state))
  (want_losses, want), (got_losses, got) = runs
  np.testing.assert_allclose(got_losses, want_losses, rtol=2e-2)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  kinds = set()
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.dtype == w.dtype
    kinds.add(jnp.dtype(w.dtype).name)
    if w.dtype == jnp.bool_:
      np.testing.assert_array_equal(g, w)
    else:
      scale = float(jnp.max(jnp.abs(w)))
      np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * scale)
  assert kinds == {"bool", "float32"}  # the flag is among the state's leaves


def test_autocast_keeps_python_numbers_as_constants():
  scaled = ols.autocast(
    lambda x, s, flag: x * s if flag else x, compute_dtype=jnp.float16
  )
  x = jnp.ones(3)
  for s in (2.0, 3, 0.5):  # a new number: a new signature, its own value
    np.testing.assert_array_equal(scaled(x, s, True), np.full(3, s, np.float32))
  np.testing.assert_array_equal(scaled(x, 2.0, False), np.ones(3, np.float32))
  # Arrays (JAX and NumPy, scalars included) are traced, as before.
  jaxpr = jax.make_jaxpr(lambda s: scaled(x, s, True))(jnp.float32(2.0))
  assert len(jaxpr.jaxpr.invars) == 1


@pytest.mark.standard_promotion  # optax's adam
@pytest.mark.parametrize(
  "make",
  [
    lambda: ols.master_weights(optax.adam(1e-2), store="float32"),
    lambda: ols.dynamic_loss_scale(
      ols.master_weights(optax.adam(1e-2), store="float32")
    ),
  ],
  ids=["master_weights", "loss scale of master_weights"],
)
def test_parameters_whose_dtype_changed_are_named_with_both_dtypes(eqx, make, request):
  # float16 parameters that eqx.apply_updates left float32 (its sum is
  # promoted; optax.apply_updates casts back): each changed leaf is named
  # with the dtype the state was made for and the one given now.
  model = eqx.nn.Linear(3, 2, key=jax.random.key(0), dtype=jnp.float16)
  params = eqx.filter(model, eqx.is_inexact_array)
  tx = make()
  with __import__("warnings").catch_warnings():
    __import__("warnings").simplefilter("ignore", ols.HalfPrecisionStateWarning)
    state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, state = tx.update(grads, state, params)
  promoted = eqx.apply_updates(params, updates)
  assert {x.dtype for x in jax.tree.leaves(promoted)} == {jnp.dtype(jnp.float32)}
  with pytest.raises(ValueError) as e:
    tx.update(grads, state, promoted)
  message = str(e.value)
  for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
    shape = list(p.shape)
    at = jax.tree_util.keystr(path)
    if request.node.callspec.id == "master_weights":  # its first leaf
      assert "changed from float16 or bfloat16 to float32" in message, message
      break
    assert f"{at} float16{shape} -> float32{shape}" in message, message
  # cast back, as optax.apply_updates does, the step goes on
  back = jax.tree.map(lambda n, p: n.astype(p.dtype), promoted, params)
  tx.update(grads, state, back)


@pytest.mark.parametrize(
  "argnums, want",
  [(np.int64(1), "one"), ((np.int64(1),), "tuple"), (np.int32(-1), "one")],
  ids=["np.int64", "a tuple of np.int64", "np.int32 negative"],
)
def test_numpy_integer_argnums_are_taken_as_jax_takes_them(argnums, want):
  loss, grad = ols.value_and_grad(lambda a, b: jnp.sum(a * b), argnums=argnums)(
    _state(), jnp.ones(3), jnp.full(3, 2.0)
  )
  expected = np.full(3, 1.0 * SCALE)  # d/db, of the scaled loss
  got = grad if want == "one" else grad[0]
  np.testing.assert_array_equal(np.asarray(got), expected)
  assert float(loss) == 6.0


@pytest.mark.parametrize(
  "out",
  [lambda loss: (loss, 3), lambda loss: [loss, loss], lambda loss: {"loss": loss}],
  ids=["a (loss, aux) tuple", "a list", "a dict"],
)
def test_a_loss_and_aux_without_has_aux_names_has_aux(out):
  """Not an error from deep in jnp.asarray on the tuple."""
  with pytest.raises(ValueError, match="pass has_aux=True"):
    ols.value_and_grad(lambda a: out(jnp.sum(a)))(_state(), jnp.ones(3))
