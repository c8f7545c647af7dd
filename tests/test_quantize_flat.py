"""quantize_state(layout="flat"): the per-leaf layout's bits, one program for the tree.

Every case trains the same steps with both layouts and compares the
parameters, the codes and scales (the flat buffer is the per-leaf codes one
after another) and the dequantised state, bit for bit; the compiled step's
size grows with the leaf count no faster than bare Adam's. The arithmetic
is the same operation for operation, but XLA compiles it in another
program and may round differently in the last place (as it does for bare
Adam compiled over a tree or over one leaf): these cases are ones where it
does not, with one exception and one setting below.

The steps are compiled with XLA's ``xla_allow_excess_precision`` off: by
default XLA computes a fused chain of bfloat16 operations in float32 and
rounds once, so where the two layouts' programs fuse differently a bfloat16
value may differ in its last place (it does, under global norm clipping:
a fortieth of a bfloat16 parameter's entries, by one unit). And where
float32 arithmetic mixes widths (``inject_hyperparams``' float32 ``b1``
times a bfloat16 gradient), XLA's choice of fused multiply-adds differs by
program: a last-place difference stochastic rounding turns into other codes
(with ``XLA_FLAGS=--xla_cpu_max_isa=AVX``, no FMA, they are the same); the
bfloat16 parameter is left out of that one case.
"""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import versions

import optax_lossscale as ols

pytestmark = pytest.mark.standard_promotion  # optax mixes widths

K = jax.random.split(jax.random.key(1), 6)
PARAMS = {
  "w": jax.random.normal(K[0], (40, 300)),  # whole blocks
  "b": jax.random.normal(K[1], (5,)),  # below min_size: kept
  "v": jax.random.normal(K[2], (5000,)),  # a last block padded
  "m": jax.random.normal(K[3], (70, 70)),  # padded too
  "h": jax.random.normal(K[4], (32, 64)).astype(jnp.bfloat16),  # moments in bfloat16
}


def _grads(params, step):
  return jax.tree.map(
    lambda x: (jnp.sin(x * (step + 1.0)) * 0.01).astype(x.dtype), params
  )


def _masked_decay(p):
  return jax.tree.map(lambda x: x.ndim > 1, p)


OPTIMIZERS = {
  "adam": lambda: optax.adam(1e-3),
  "adamw, a decay mask": lambda: optax.adamw(
    1e-3, weight_decay=0.1, mask=_masked_decay
  ),
  "a schedule": lambda: optax.adam(
    optax.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 10)
  ),
  "lion": lambda: optax.lion(1e-4),
  "sgd, nesterov momentum": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
  "rmsprop": lambda: optax.rmsprop(1e-3, momentum=0.9),
  "global norm clipping, adamw": lambda: optax.chain(
    optax.clip_by_global_norm(0.05), optax.adamw(1e-3)
  ),
  "lamb (a trust ratio a leaf)": lambda: optax.lamb(1e-3),
  "inject_hyperparams(adam)": lambda: optax.inject_hyperparams(optax.adam)(1e-3),
  "adam, then ema_params": lambda: optax.chain(optax.adam(1e-3), ols.ema_params(0.9)),
}


#: jax.jit takes XLA options (jax >= 0.5); older JAX's steps keep excess
#: precision, and its bfloat16 values are not compared.
EXACT = "compiler_options" in inspect.signature(jax.jit).parameters


def _jit(f):
  """``jax.jit(f)``, bfloat16 rounded after each operation (the module's
  docstring) where JAX lets it say so."""
  return (
    jax.jit(f, compiler_options={"xla_allow_excess_precision": False})
    if EXACT
    else jax.jit(f)
  )


def _train(tx, params, steps=3):
  @_jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  state = tx.init(params)
  for t in range(steps):
    params, state = step(params, state, _grads(params, t))
  return params, state


FLAT = (ols.FlatQuantizedState, ols.StochasticFlatQuantizedState)


def _codes_by_leaf(state):
  """Each quantised leaf's codes and scales, flattened, by its path."""
  out = {}
  if isinstance(state, FLAT):
    for path, x in jax.tree_util.tree_flatten_with_path(
      state.inner_state, is_leaf=lambda x: isinstance(x, ols.GroupedLeaf)
    )[0]:
      if isinstance(x, ols.GroupedLeaf):
        q = state.groups[x.group]
        size = int(np.prod(x.shape))
        blocks = -(-size // x.block_size)
        first = x.start // x.block_size
        out[path] = (
          np.asarray(q.codes[x.start : x.start + size]),
          np.asarray(q.scales[first : first + blocks]),
        )
    return out
  for path, x in jax.tree_util.tree_flatten_with_path(
    state.inner_state, is_leaf=lambda x: isinstance(x, ols.QuantizedLeaf)
  )[0]:
    if isinstance(x, ols.QuantizedLeaf):
      out[path] = (np.asarray(x.codes).reshape(-1), np.asarray(x.scales).reshape(-1))
  return out


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _same(a, b, bfloat16=EXACT):
  """``a`` and ``b`` bit for bit; the number of leaves compared."""
  compared = 0
  for (path, x), y in zip(
    jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True
  ):
    if bfloat16 or "'h'" not in jax.tree_util.keystr(path):  # 'h': bfloat16
      assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), jax.tree_util.keystr(
        path
      )
      compared += 1
  return compared


@pytest.mark.sampled
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_flat_layout_stores_and_computes_the_per_leaf_layouts_bits(name, rounding):
  results = {}
  for layout in ("leaf", "flat"):
    tx = ols.quantize_state(
      OPTIMIZERS[name](), min_size=256, rounding=rounding, layout=layout
    )
    results[layout] = _train(tx, PARAMS)
  (p_leaf, s_leaf), (p_flat, s_flat) = results["leaf"], results["flat"]
  assert isinstance(s_flat, FLAT)
  fma = (name, rounding) == ("inject_hyperparams(adam)", "stochastic")
  bfloat16 = EXACT and not fma  # the module's docstring
  _same(p_leaf, p_flat, bfloat16)
  leaf_codes, flat_codes = _codes_by_leaf(s_leaf), _codes_by_leaf(s_flat)
  assert leaf_codes.keys() == flat_codes.keys() and leaf_codes
  for path, (codes, scales) in leaf_codes.items():
    if not bfloat16 and "'h'" in jax.tree_util.keystr(path):
      continue
    np.testing.assert_array_equal(flat_codes[path][0], codes, err_msg=str(path))
    np.testing.assert_array_equal(flat_codes[path][1], scales, err_msg=str(path))
  _same(ols.dequantize_state(s_leaf), ols.dequantize_state(s_flat), bfloat16)


def test_a_moment_field_and_dtype_is_one_buffer():
  tx = ols.quantize_state(optax.adam(1e-3), min_size=256, layout="flat")
  state = tx.init(PARAMS)
  adam = state.inner_state[0]
  assert isinstance(adam.mu["w"], ols.GroupedLeaf) and not jax.tree.leaves(adam.mu["w"])
  assert adam.mu["b"].shape == (5,)  # below min_size: an array as adam made it
  # mu and nu of the float32 parameters, and of the bfloat16 one
  assert len(state.groups) == 4
  f32 = state.groups[adam.mu["w"].group]
  # each leaf padded to whole blocks: 12000 to 12032, 5000 and 4900 to 5120
  assert f32.codes.shape == (12032 + 5120 + 5120,) and f32.scales.shape == (87,)
  assert [adam.mu[k].start for k in ("m", "v", "w")] == [0, 5120, 10240]
  assert state.groups[adam.mu["h"].group].dtype == jnp.bfloat16
  assert str(adam.nu["v"].dtype) == "float32" and adam.nu["v"].shape == (5000,)


def test_the_tree_s_code_grows_no_faster_than_adams():
  """What XLA compiles grows with the leaf count no faster than bare Adam's;
  the per-leaf layout's, a codec a leaf, grows ten times faster."""

  def tree(blocks):
    one = {"w1": (64, 128), "b1": (128,), "w2": (128, 64), "ln": (64,), "odd": (65, 70)}
    return {
      f"block{i}": {k: jnp.ones(s) for k, s in one.items()} for i in range(blocks)
    }

  def lines(tx, blocks):
    params = tree(blocks)

    def step(p, s, g):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    compiled = jax.jit(step).lower(params, tx.init(params), params).compile()
    return len(compiled.as_text().splitlines())

  def growth(tx):  # lines a block of 3 quantised and 2 kept leaves adds
    return (lines(tx, 6) - lines(tx, 2)) / 4

  adam = growth(optax.adam(1e-3))
  flat = growth(ols.quantize_state(optax.adam(1e-3), layout="flat"))
  leaf = growth(ols.quantize_state(optax.adam(1e-3)))
  if versions.JAX >= (0, 10):  # XLA's own counts: asserted for the newest XLA
    assert flat <= adam, (flat, adam)
    assert leaf > 5 * adam, (leaf, adam)


def test_under_the_loss_scale_and_master_weights_in_a_scan():
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)

  def make(layout):
    return ols.dynamic_loss_scale(
      ols.master_weights(
        ols.quantize_state(optax.adam(1e-3), min_size=256, layout=layout)
      ),
      initial_scale=2.0**10,
    )

  grads = [_grads(params, t) for t in range(4)]
  grads[2] = jax.tree.map(lambda g: g.at[0].set(jnp.inf), grads[2])  # skipped
  stacked = jax.tree.map(lambda *g: jnp.stack(g), *grads)
  out = {}
  for layout in ("leaf", "flat"):
    tx = make(layout)

    def steps(p, s, gs, tx=tx):
      def one(carry, g):
        p, s = carry
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), s

      return jax.lax.scan(one, (p, s), gs)

    out[layout] = _jit(steps)(params, tx.init(params), stacked)
  (p_leaf, s_leaf), states_leaf = out["leaf"]
  (p_flat, s_flat), states_flat = out["flat"]
  _same(p_leaf, p_flat)
  _same(ols.dequantize_state(s_leaf), ols.dequantize_state(s_flat))
  # the non-finite step changed nothing but the loss scale's counters
  after = [
    jax.tree.map(lambda x, i=i: x[i], states_flat.inner_state) for i in (1, 2, 3)
  ]
  assert _bits(after[0]) == _bits(after[1])
  assert _bits(after[2]) != _bits(after[1])  # a finite step's does


def test_a_nan_moment_is_an_infinite_scale_the_checkpoint_guard_names():
  tx = ols.quantize_state(optax.adam(1e-3), min_size=256, layout="flat")
  state = tx.init(PARAMS)
  grads = jax.tree.map(jnp.zeros_like, PARAMS)
  grads["v"] = grads["v"].at[3].set(jnp.nan)
  _, state = jax.jit(tx.update)(grads, state, PARAMS)
  with pytest.raises(ValueError, match=r"groups\[\d\].*1 of \d+ blocks"):
    ols.check_checkpoint(state)


def test_the_plan_lists_the_grouped_moments():
  tx = ols.dynamic_loss_scale(
    ols.quantize_state(optax.adam(1e-3), min_size=256, layout="flat")
  )
  plan = ols.loss_scale_plan(tx.init(PARAMS), PARAMS)
  quantised = {leaf.path: leaf.quantized_state for leaf in plan.leaves}
  assert len(quantised["['w']"]) == 2 and not quantised["['b']"]
  assert all("blocks of 256" in d for d in quantised["['w']"])


def test_states_of_the_other_layout_or_other_parameters_are_value_errors():
  flat = ols.quantize_state(optax.adam(1e-3), min_size=256, layout="flat")
  leaf = ols.quantize_state(optax.adam(1e-3), min_size=256)
  with pytest.raises(ValueError, match="FlatQuantizedState"):
    flat.update(PARAMS, leaf.init(PARAMS), PARAMS)
  with pytest.raises(ValueError, match="QuantizedState"):
    leaf.update(PARAMS, flat.init(PARAMS), PARAMS)
  other = dict(PARAMS, w=jnp.ones((40, 301)))
  with pytest.raises(ValueError, match=r"\['w'\]"):
    flat.update(other, flat.init(PARAMS), other)


@pytest.mark.parametrize("layout", ["rows", "", None, 1])
def test_a_bad_layout_is_a_value_error(layout):
  with pytest.raises(ValueError, match="layout"):
    ols.quantize_state(optax.adam(1e-3), layout=layout)


@pytest.mark.parametrize(
  "params",
  [
    {"t": jnp.float32(0.5), "w": jnp.linspace(-1.0, 1.0, 64).reshape(8, 8)},
    jnp.float32(0.5),
  ],
  ids=["a scalar beside a matrix", "a bare scalar"],
)
@pytest.mark.parametrize("inner", ["adagrad", "adam"])
def test_scalar_parameters_quantised_as_the_per_leaf_layout_does(params, inner):
  # min_size=0 quantises a scalar's moments too; a bare scalar's path owns
  # every state leaf of its shape (Adam's count among them)
  make = {"adagrad": lambda: optax.adagrad(1e-2), "adam": lambda: optax.adam(1e-2)}[
    inner
  ]
  results = []
  for layout in ("leaf", "flat"):
    tx = ols.quantize_state(make(), min_size=0, block_size=64, layout=layout)
    results.append(_train(tx, params))
  assert _same(results[0][0], results[1][0]) == len(jax.tree.leaves(params))
  assert _same(ols.dequantize_state(results[0][1]), ols.dequantize_state(results[1][1]))


def test_updates_of_another_tree_than_the_gradients():
  # lookahead takes the fast parameters' gradients and returns updates of
  # both the fast and the slow parameters
  params = optax.LookaheadParams.init_synced({k: PARAMS[k] for k in ("w", "v")})
  grads = _grads(params.fast, 0)
  out = []
  for layout in ("leaf", "flat"):
    tx = ols.quantize_state(
      optax.lookahead(optax.adam(1e-3), 2, 0.5), min_size=256, layout=layout
    )
    out.append(_jit(tx.update)(grads, tx.init(params), params))
  assert isinstance(out[1][0], optax.LookaheadParams)
  _same(out[0][0], out[1][0])
  _same(ols.dequantize_state(out[0][1]), ols.dequantize_state(out[1][1]))


def _scale_by_long_constants(steps=1200):
  """Gradients times a number made by ``steps`` operations on the state's
  scalar (one chain of shared numbers), then by a constant made by
  ``steps`` operations on a broadcast number (one chain of broadcasts)."""

  def update(updates, state, params=None):
    k = state * 0.0 + 0.5
    for _ in range(steps):
      k = k * 1.0

    def scaled(g):
      c = jnp.full_like(g, 0.5)
      for _ in range(steps):
        c = c * 1.0
      return g * k * c

    return jax.tree.map(scaled, updates), state

  return optax.GradientTransformation(lambda params: jnp.zeros([]), update)


def test_a_python_number_among_the_parameters_and_a_long_program():
  # a Python number and a zero-size leaf beside a quantised one
  params = {"w": PARAMS["w"], "k": 2.0, "z": jnp.zeros((0, 3))}
  grads = {"w": PARAMS["w"], "k": 1.0, "z": jnp.zeros((0, 3))}
  # deeper than Python's recursion limit, and read whole by a reduction (the
  # global norm, computed from each leaf's own values)
  long = optax.chain(
    *[optax.scale(1.0)] * 1200, optax.clip_by_global_norm(1.0), optax.adam(1e-3)
  )
  long_constants = optax.chain(_scale_by_long_constants(), optax.adam(1e-3))
  for inner in (optax.adam(1e-3), long, long_constants):
    results = []
    for layout in ("leaf", "flat"):
      tx = ols.quantize_state(inner, min_size=256, layout=layout)
      results.append(_jit(tx.update)(grads, tx.init(params), params))
    assert _same(results[0][0], results[1][0]) == 3  # w, k and z


def test_no_parameters_and_gradients_of_another_dtype():
  # update(params=None) with float32 gradients of the bfloat16 parameter:
  # Adam's mu of it becomes float32 in the first step (both layouts), and its
  # group, chosen at init by its parameter's dtype, stays its own
  grads = [
    jax.tree.map(lambda x: x.astype(jnp.float32), _grads(PARAMS, t)) for t in range(3)
  ]
  results = []
  for layout in ("leaf", "flat"):
    tx = ols.quantize_state(optax.adam(1e-3), min_size=256, layout=layout)
    update, state = _jit(lambda g, s, tx=tx: tx.update(g, s)), tx.init(PARAMS)
    for g in grads:
      updates, state = update(g, state)
    results.append((updates, state))
  (u_leaf, s_leaf), (u_flat, s_flat) = results
  assert len(s_flat.groups) == len(tx.init(PARAMS).groups)
  stored = lambda x: isinstance(x, (ols.QuantizedLeaf, ols.GroupedLeaf))  # noqa: E731
  dtypes = [
    jax.tree.map(lambda x: x.dtype, s.inner_state, is_leaf=stored)
    for s in (s_leaf, s_flat)
  ]
  assert dtypes[0] == dtypes[1] and dtypes[0][0].mu["h"] == jnp.float32
  _same(u_leaf, u_flat)
  _same(ols.dequantize_state(s_leaf), ols.dequantize_state(s_flat))
  with pytest.raises(ValueError, match=r"\['w'\]"):  # still a check of the shapes
    other = dict(grads[0], w=jnp.ones((40, 301)))
    update(other, s_flat)


@jax.custom_vjp
def _straight_through_round(x):  # rounds; its derivative is 1
  return jnp.round(x)


_straight_through_round.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (g,))


def _elementwise(f):
  return optax.GradientTransformation(
    lambda p: optax.EmptyState(), lambda u, s, p=None: (jax.tree.map(f, u), s)
  )


@pytest.mark.parametrize(
  "f",
  [jax.nn.relu, lambda g: _straight_through_round(g * 10.0) / 10.0],
  ids=["custom_jvp (relu)", "custom_vjp (straight-through rounding)"],
)
def test_a_custom_derivative_in_the_update_is_kept(f):
  """jax.grad through the update uses a custom_jvp/custom_vjp rule as the
  per-leaf layout and bare optax do (at 0, relu's is 0; the straight-
  through one is 1 where the rounding's own is 0)."""
  params = {"w": jnp.ones((16, 32))}
  grads = {"w": jnp.zeros((16, 32)).at[:, :8].set(0.3)}
  inner = optax.chain(_elementwise(f), optax.sgd(1.0, momentum=0.9))
  derivatives = []
  for layout in ("leaf", "flat"):
    tx = ols.quantize_state(inner, layout=layout, min_size=0)
    state = tx.init(params)
    loss = lambda g, tx=tx, state=state: jnp.sum(tx.update(g, state, params)[0]["w"])  # noqa: E731
    derivatives.append(jax.grad(loss)(grads)["w"])
  plain = lambda g: jnp.sum(inner.update(g, inner.init(params), params)[0]["w"])  # noqa: E731
  np.testing.assert_array_equal(derivatives[0], derivatives[1])
  np.testing.assert_array_equal(derivatives[1], jax.grad(plain)(grads)["w"])


def test_constants_that_print_alike_are_not_one_program():
  """Two leaves whose programs differ only in a constant that numpy prints
  alike (to 8 digits) are run each with its own."""
  factors = {"a": 1.23456e-4, "b": 1.23457e-4}
  scaled = optax.GradientTransformation(
    lambda p: optax.EmptyState(),
    lambda u, s, p=None: (jax.tree.map(lambda g, k: g * k, u, factors), s),
  )
  inner = optax.chain(optax.sgd(1.0, momentum=0.9), scaled)
  params = {"a": jnp.ones(512), "b": jnp.ones(512)}
  results = []
  for layout in ("leaf", "flat"):
    tx = ols.quantize_state(inner, layout=layout, min_size=0)
    results.append(jax.jit(tx.update)(params, tx.init(params), params)[0])
  _same(results[0], results[1])
  assert float(results[1]["b"][0]) == -np.float32(1.23457e-4)


BAD_GRADIENTS = {
  "complex": (lambda g: g.astype(jnp.complex64), "real floating"),
  "a Python number": (lambda g: 0.5, None),  # taken: broadcast, as optax does
}


@pytest.mark.parametrize("case", BAD_GRADIENTS)
def test_gradients_either_layout_refuses_or_takes_alike(case):
  make, error = BAD_GRADIENTS[case]
  params = {"w": jnp.linspace(-1.0, 1.0, 256), "b": jnp.ones(8)}
  grads = dict(params, w=make(params["w"]))
  results = []
  for layout in ("leaf", "flat"):
    tx = ols.quantize_state(optax.adam(1e-3), layout=layout, min_size=0)
    state = tx.init(params)
    if error:
      with pytest.raises(ValueError, match=error):
        tx.update(grads, state, params)
      continue
    u, s = tx.update(grads, state, params)
    results.append((u, ols.dequantize_state(s)))
  if results:
    _same(results[0], results[1])


@pytest.mark.parametrize("layout", ["leaf", "flat"])
@pytest.mark.parametrize("part", ["codes", "scales"])
def test_codes_or_scales_of_another_dtype_are_refused(layout, part):
  params = {"w": jnp.linspace(-1.0, 1.0, 600).reshape(20, 30)}
  tx = ols.quantize_state(optax.adam(1e-3), layout=layout, min_size=0)
  state = tx.init(params)
  stored = lambda x: isinstance(x, ols.QuantizedLeaf)  # noqa: E731
  other = {"codes": jnp.int8, "scales": jnp.float16}[part]
  state = jax.tree.map(
    lambda x: (
      dataclasses.replace(x, **{part: getattr(x, part).astype(other)})
      if stored(x)
      else x
    ),
    state,
    is_leaf=stored,
  )
  with pytest.raises(ValueError, match=f"{part} {jnp.dtype(other).name}"):
    tx.update(params, state, params)


def test_the_flat_update_leaks_no_tracer():
  params = {"w": jnp.linspace(-1.0, 1.0, 512)}
  tx = ols.quantize_state(optax.adam(1e-3), layout="flat", min_size=0)
  state = tx.init(params)
  with jax.checking_leaks():
    jax.jit(tx.update)(params, state, params)
