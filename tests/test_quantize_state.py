"""quantize_state: 8-bit block-quantised optimizer state, and how it composes.

Each update is checked against the inner optimizer run on the dequantised
state (the codes themselves in ``test_quantize_codec.py``); and
the transformation under a loss scale's skipped step, master_weights,
MultiSteps, inject_hyperparams, masked/multi_transform, donation and an
Orbax round trip.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxprs import eqns as all_eqns

import optax_lossscale as ols
from optax_lossscale._base import state_roles as _roles
from optax_lossscale._params import quantize_state as q

pytestmark = pytest.mark.standard_promotion  # optax's adam, apply_updates

SHAPE = (16, 512)  # 8192 elements: quantised at the default min_size


def _params(seed=0, shape=SHAPE):
  rng = np.random.default_rng(seed)
  return {
    "w": jnp.asarray(rng.normal(size=shape), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(7,)), jnp.float32),
  }


def _grads(params, seed=1):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda p: jnp.asarray(rng.normal(size=p.shape) * rng.uniform(1e-4, 1), p.dtype),
    params,
  )


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


# --------------------------------------------------------------------------
# The transformation.
# --------------------------------------------------------------------------


def test_which_leaves_are_quantised_and_the_bytes():
  params = {**_params(), "i": jnp.arange(8192, dtype=jnp.int32)}
  tx = ols.quantize_state(optax.adam(1e-3))
  state = tx.init(params)
  adam = state.inner_state[0]
  assert isinstance(adam.mu["w"], ols.QuantizedLeaf)
  assert isinstance(adam.nu["w"], ols.QuantizedLeaf)
  assert not isinstance(adam.mu["b"], ols.QuantizedLeaf)  # below min_size
  assert adam.count.dtype == jnp.int32
  n = params["w"].size
  w_bytes = sum(x.nbytes for x in jax.tree.leaves((adam.mu["w"], adam.nu["w"])))
  assert w_bytes / n == 2 + 2 * 4 / 256  # two codes and two scales per 256
  small = ols.quantize_state(optax.adam(1e-3), min_size=8193).init(params)
  assert not any(
    isinstance(x, ols.QuantizedLeaf)
    for x in jax.tree.leaves(small, is_leaf=lambda x: isinstance(x, ols.QuantizedLeaf))
  )


def test_an_update_is_the_inner_update_on_the_dequantised_state_quantised():
  params = _params()
  tx = ols.quantize_state(optax.adam(1e-2))
  adam = optax.adam(1e-2)
  state = tx.init(params)
  step = jax.jit(tx.update)
  ref_step = jax.jit(adam.update)
  for seed in range(3):
    g = _grads(params, seed)
    inner = jax.tree.map(
      lambda x: x.dequantize() if isinstance(x, ols.QuantizedLeaf) else x,
      state.inner_state,
      is_leaf=lambda x: isinstance(x, ols.QuantizedLeaf),
    )
    want_u, want_state = ref_step(g, inner, params)
    updates, state = step(g, state, params)
    assert _bits(updates) == _bits(want_u)
    for name in ("mu", "nu"):
      got = getattr(state.inner_state[0], name)["w"]
      want = q.encode(getattr(want_state[0], name)["w"], 256)
      assert _bits(got) == _bits(want)
      np.testing.assert_array_equal(
        getattr(state.inner_state[0], name)["b"], getattr(want_state[0], name)["b"]
      )
    params = optax.apply_updates(params, updates)
  nu = state.inner_state[0].nu["w"]
  assert bool(jnp.all(nu.scales >= 0))  # Adam's second moment: unsigned
  assert bool(jnp.all(state.inner_state[0].mu["w"].scales < 0))  # signed


def test_it_follows_float32_adam_closely():
  params = _params()
  runs = {}
  for name, tx in (
    ("q", ols.quantize_state(optax.adam(1e-2))),
    ("f", optax.adam(1e-2)),
  ):
    p, s = params, tx.init(params)
    step = jax.jit(tx.update)
    for i in range(20):
      u, s = step(_grads(params, i), s, p)
      p = optax.apply_updates(p, u)
    runs[name] = p
  drift = np.abs(np.asarray(runs["q"]["w"] - runs["f"]["w"]))
  moved = np.abs(np.asarray(runs["f"]["w"] - params["w"]))
  assert drift.max() < 0.05 * moved.max()
  np.testing.assert_array_equal(runs["q"]["b"], runs["f"]["b"])  # not quantised


def test_dequantize_state_at_any_depth():
  params = _params()
  tx = ols.dynamic_loss_scale(ols.quantize_state(optax.adam(1e-3)))
  state = tx.init(params)
  _, state = jax.jit(tx.update)(_grads(params), state, params)
  d = ols.dequantize_state(state)
  assert isinstance(d, ols.LossScaleState)
  mu = d.inner_state[0].mu["w"]
  assert mu.dtype == jnp.float32 and mu.shape == SHAPE
  leaf = state.inner_state.inner_state[0].mu["w"]
  np.testing.assert_array_equal(mu, leaf.dequantize())
  direct = ols.dequantize_state(state.inner_state)
  assert _bits(direct) == _bits(d.inner_state)
  with pytest.raises(ValueError, match="holds no quantize_state state"):
    ols.dequantize_state(optax.adam(1e-3).init(params))


def test_a_bfloat16_state_leaf_comes_back_in_bfloat16():
  params = _params()
  tx = ols.quantize_state(optax.adam(1e-3, mu_dtype=jnp.bfloat16))
  state = tx.init(params)
  assert state.inner_state[0].mu["w"].dtype == jnp.bfloat16
  _, state = jax.jit(tx.update)(_grads(params), state, params)
  assert ols.dequantize_state(state)[0].mu["w"].dtype == jnp.float32


def test_a_state_of_another_structure_is_refused_naming_the_leaf():
  tx = ols.quantize_state(optax.adam(1e-3))
  params = _params()
  state = tx.init(params)
  other = _params(shape=(8, 512))
  with pytest.raises(ValueError, match=r"leaf at .*mu.*\['w'\]"):
    tx.update(_grads(other), state, other)
  with pytest.raises(ValueError, match="not a QuantizedState"):
    tx.update(_grads(params), optax.adam(1e-3).init(params), params)
  plain = ols.quantize_state(optax.adam(1e-3), min_size=10**6).init(params)
  with pytest.raises(ValueError, match=r"leaf at .*mu.*\['w'\] is float32\[16, 512\]"):
    tx.update(_grads(params), plain, params)
  for other in ({"block_size": 128}, {"store_sqrt": False}):
    wrong = ols.quantize_state(optax.adam(1e-3), **other).init(params)
    with pytest.raises(ValueError, match=next(iter(other))):
      tx.update(_grads(params), wrong, params)


_EIGHT_BIT = {
  "quantize_state": lambda: ols.quantize_state(optax.adam(1e-3), min_size=0),
  "quantize_state, flat": lambda: ols.quantize_state(
    optax.adam(1e-3), min_size=0, layout="flat"
  ),
  "adam_8bit": lambda: ols.adam_8bit(1e-3, min_size=0),
  "adam_8bit, pallas": lambda: ols.adam_8bit(1e-3, min_size=0, kernel="pallas"),
}
#: States of other transformations whose leaves have Adam's key paths.
_OTHER_STATES = {
  "AdaBelief's (count, mu, nu)": lambda: optax.adabelief(1e-3),
  "AdamW's chain (one more empty state)": lambda: optax.adamw(1e-3),
  "AMSGrad's (count, mu, nu, nu_max)": lambda: optax.amsgrad(1e-3),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("other", _OTHER_STATES)
@pytest.mark.parametrize("name", _EIGHT_BIT)
def test_a_state_made_by_another_transformation_is_refused(name, other, jit):
  """Not run with Adam's rule on another optimizer's moments, nor left to an
  error deep in optax or JAX: the library's message, before anything runs."""
  tx = _EIGHT_BIT[name]()
  layout = {"layout": "flat"} if "flat" in name else {}
  params = {"w": jnp.ones((4, 256))}
  made = ols.quantize_state(_OTHER_STATES[other](), min_size=0, **layout)
  state = made.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  with pytest.raises(ValueError, match="another transformation"):
    update(_grads(params), state, params)


_SHAPED = {
  # 1010 entries in 1000's 4 blocks of 256: nothing in the layout differs
  "longer, the same blocks": {"w": jnp.ones(1010), "m": jnp.ones((1000, 1))},
  "the same size, another shape": {"w": jnp.ones(1000), "m": jnp.ones(1000)},
}


@pytest.mark.parametrize("shaped", _SHAPED)
@pytest.mark.parametrize("name", _EIGHT_BIT)
def test_a_gradient_of_another_shape_than_its_parameter_is_refused(name, shaped):
  # with the parameters given, each gradient is checked against its
  # parameter (update and apply_gradients); without them, the state's layout
  tx = _EIGHT_BIT[name]()
  params = {"w": jnp.ones(1000), "m": jnp.ones((1000, 1))}
  state, grads = tx.init(params), _SHAPED[shaped]
  calls = [tx.update] + ([tx.apply_gradients] if name.startswith("adam_8bit") else [])
  for call in calls:
    with pytest.raises(ValueError, match=r"Gradient at \['[wm]'\] has shape"):
      call(grads, state, params)
    with pytest.raises(ValueError, match=r"Gradient at \['[wm]'\] has shape"):
      jax.jit(call)(grads, state, params)
  with pytest.raises(ValueError, match=r"leaf at .*mu.*\['[wm]'\] is quantised"):
    tx.update(grads, state)


def test_master_weights_inside_it_is_refused():
  tx = ols.quantize_state(ols.master_weights(optax.adam(1e-3)))
  with pytest.raises(ValueError, match="inside it"):
    tx.init(jax.tree.map(lambda p: p.astype(jnp.bfloat16), _params()))


@pytest.mark.parametrize(
  "inner",
  [
    lambda: ols.quantize_state(optax.adam(1e-3)),
    lambda: ols.quantize_state(optax.adam(1e-3), layout="flat"),
    lambda: ols.adam_8bit(1e-3),
    lambda: optax.chain(optax.clip(1.0), ols.quantize_state(optax.sgd(0.1, 0.9))),
  ],
  ids=["quantize_state", "quantize_state, flat", "adam_8bit", "in a chain"],
)
@pytest.mark.parametrize("layout", ["leaf", "flat"])
def test_a_quantised_state_inside_it_is_refused(inner, layout):
  """init refuses it: its update failed, with a message that named the
  wrong cause or with an AttributeError."""
  tx = ols.quantize_state(inner(), min_size=0, layout=layout)
  with pytest.raises(ValueError, match="already holds quantised leaves"):
    tx.init(_params())


# --------------------------------------------------------------------------
# Composition.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_a_skipped_step_leaves_the_quantised_state_bit_for_bit(rounding):
  params = _params()
  tx = ols.dynamic_loss_scale(ols.quantize_state(optax.adam(1e-3), rounding=rounding))
  state = tx.init(params)
  step = jax.jit(lambda s, g: tx.update(g, s, params))
  _, state = step(state, _grads(params))
  before = _bits(state.inner_state)
  bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), _grads(params, 2))
  updates, after = step(state, bad)
  assert int(after.skipped_steps) == 1
  assert _bits(after.inner_state) == before
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))


def test_under_master_weights_a_bfloat16_model_keeps_exact_masters():
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), _params())
  tx = ols.master_weights(ols.quantize_state(optax.adam(1e-3)))
  state = tx.init(params)
  mw = state
  assert isinstance(mw, ols.MasterWeightsState)
  assert mw.master["w"].dtype == jnp.int16  # the remainder, never quantised
  mu = mw.inner_state.inner_state[0].mu["w"]
  assert isinstance(mu, ols.QuantizedLeaf) and mu.dtype == jnp.float32

  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  # the masters are a float32 run of quantize_state(adam), bit for bit
  ref = ols.quantize_state(optax.adam(1e-3))
  rp = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  rs = ref.init(rp)

  @jax.jit
  def ref_step(p, s, g):
    g = jax.tree.map(lambda x: x.astype(jnp.float32), g)  # as master_weights
    u, s = ref.update(g, s, p)
    return optax.apply_updates(p, u), s

  for i in range(5):
    g = _grads(params, i)
    params, state = step(params, state, g)
    rp, rs = ref_step(rp, rs, g)
  assert _bits(ols.get_master_weights(state, params)) == _bits(rp)
  assert _bits(state.inner_state) == _bits(rs)
  scaled = ols.dynamic_loss_scale(tx)  # the loss scale finds the masters in it
  assert _roles.holds_masters(scaled.init(params))


def test_multisteps_outside_it_leaves_the_state_alone_between_updates():
  params = _params()
  tx = optax.MultiSteps(ols.quantize_state(optax.adam(1e-3)), every_k_schedule=2)
  state = tx.init(params)
  step = jax.jit(lambda s, g: tx.update(g, s, params))
  before = _bits(state.inner_opt_state)
  _, state = step(state, _grads(params, 0))
  assert _bits(state.inner_opt_state) == before  # a mini-step
  _, state = step(state, _grads(params, 1))
  assert _bits(state.inner_opt_state) != before
  assert isinstance(state.inner_opt_state.inner_state[0].mu["w"], ols.QuantizedLeaf)


def test_inject_hyperparams_inside_it():
  params = _params()
  tx = ols.quantize_state(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3))
  state = tx.init(params)
  hp = state.inner_state.hyperparams
  hp["learning_rate"] = jnp.asarray(0.0)
  updates, state = jax.jit(tx.update)(_grads(params), state, params)
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  assert isinstance(state.inner_state.inner_state[0].mu["w"], ols.QuantizedLeaf)


def test_masked_and_multi_transform():
  params = _params()
  masked = ols.quantize_state(optax.masked(optax.adam(1e-3), {"w": True, "b": False}))
  state = masked.init(params)
  updates, state = jax.jit(masked.update)(_grads(params), state, params)
  assert isinstance(state.inner_state.inner_state[0].mu["w"], ols.QuantizedLeaf)
  np.testing.assert_array_equal(updates["b"], _grads(params)["b"])  # passed
  multi = optax.multi_transform(
    {"q": ols.quantize_state(optax.adam(1e-3)), "s": optax.sgd(1e-3)},
    {"w": "q", "b": "s"},
  )
  state = multi.init(params)
  updates, state = jax.jit(multi.update)(_grads(params), state, params)
  inner = state.inner_states["q"].inner_state.inner_state[0]
  assert isinstance(inner.mu["w"], ols.QuantizedLeaf)
  np.testing.assert_array_equal(updates["b"], -1e-3 * _grads(params)["b"])


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_a_donated_jitted_step_matches_an_undonated_one(rounding):
  p0 = _params()
  tx = ols.dynamic_loss_scale(ols.quantize_state(optax.adam(1e-3), rounding=rounding))

  def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  donated = jax.jit(step, donate_argnums=(0, 1))
  plain = jax.jit(step)
  a = jax.tree.map(jnp.copy, (p0, tx.init(p0)))
  b = (p0, tx.init(p0))
  for i in range(3):
    g = _grads(p0, i)
    a, b = donated(*a, g), plain(*b, g)
  assert _bits(a) == _bits(b)


def _compiled_step(tx, params):
  state = tx.init(params)

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile()


@pytest.mark.parametrize("store_sqrt", [True, False])
def test_each_parameters_moments_are_reduced_together_once(store_sqrt):
  # The encoder finds a block's least and largest values in one reduction
  # (the sign test and the scale), and a parameter's moments (Adam's mu and
  # nu, both computed from its gradient) share it: the compiled update reads
  # the gradient once for their scales. One reduction per parameter, none
  # for float32 Adam (XLA's optimised program, a deterministic proxy of the
  # bytes it reads). Leaves of one shape but of different parameters are
  # not merged.
  from xla_costs import reductions

  params = {f"w{i}": jnp.ones((64, 128)) for i in range(3)}
  count = lambda tx: reductions(_compiled_step(tx, params).as_text())  # noqa: E731
  assert count(optax.adam(1e-3)) == (0, 0)
  tx = ols.quantize_state(optax.adam(1e-3), min_size=0, store_sqrt=store_sqrt)
  assert count(tx) == (len(params), 0)


@pytest.mark.skipif(
  jax.default_backend() != "cpu",
  reason="XLA:CPU's fusion: a GPU backend stores the new moments between its "
  "loops (BENCHMARKS.md's GPU report)",
)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_the_step_reads_less_than_float32_adams(rounding):
  # The decoded moments are never written out in float32: the decoder is
  # arithmetic that XLA fuses into each consumer (a table lookup is a gather,
  # which XLA computes once and stores). XLA's cost analysis on the CPU:
  # bytes accessed below float32 Adam's step, and temporary memory below
  # one float32 moment (what remains is the donated codes' copies).
  params = {f"w{i}": jnp.ones((256, 512)) for i in range(2)}
  n = sum(p.size for p in params.values())

  def costs(tx):
    compiled = _compiled_step(tx, params)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return cost["bytes accessed"], compiled.memory_analysis().temp_size_in_bytes

  ref, _ = costs(optax.adam(1e-3))
  got, temp = costs(ols.quantize_state(optax.adam(1e-3), rounding=rounding))
  assert got < ref
  assert temp < 4 * n


def _round_trip_continues(tx, p0, restore):
  """Two steps of ``tx``, saved and restored by ``restore(run, fresh)``
  (``fresh``: a new ``(params, state)`` of the same shapes): the restored
  run is the saved one bit for bit, and two more steps keep it so."""

  @jax.jit
  def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  def grads(i):
    return jax.tree.map(lambda x, p: x.astype(p.dtype), _grads(p0, i), p0)

  run = (p0, tx.init(p0))
  for i in range(2):
    run = step(*run, grads(i))
  restored = restore(run, (p0, tx.init(p0)))
  assert jax.tree.structure(restored) == jax.tree.structure(run)
  assert _bits(restored) == _bits(run)
  for i in range(2):
    run, restored = step(*run, grads(5 + i)), step(*restored, grads(5 + i))
  assert _bits(restored) == _bits(run)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("layout", ["leaf", "flat"])
def test_an_orbax_round_trip_continues_bit_for_bit(tmp_path, layout, rounding):
  ocp = pytest.importorskip("orbax.checkpoint")
  tx = ols.dynamic_loss_scale(
    ols.quantize_state(optax.adam(1e-3), layout=layout, rounding=rounding)
  )

  def restore(run, fresh):
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", run)
    checkpointer.wait_until_finished()
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh)
    restored = checkpointer.restore(tmp_path / "ckpt", target)
    checkpointer.close()
    return restored

  _round_trip_continues(tx, _params(), restore)


FLAX_SERIALIZED = {
  "quantize_state": lambda layout, rounding: ols.quantize_state(
    optax.adam(1e-3), layout=layout, rounding=rounding
  ),
  "adam_8bit": lambda layout, rounding: ols.adam_8bit(1e-3, rounding=rounding),
  "all three, with the record": lambda layout, rounding: ols.dynamic_loss_scale(
    ols.master_weights(
      ols.quantize_state(optax.adam(1e-3), layout=layout, rounding=rounding)
    ),
    track_nonfinite=True,
  ),
}


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("layout", ["leaf", "flat"])
@pytest.mark.parametrize("name", FLAX_SERIALIZED)
def test_a_flax_serialization_round_trip_continues_bit_for_bit(name, layout, rounding):
  """flax.serialization (to_bytes, what a TrainState's checkpoint uses)
  saves a quantised moment's codes and scales (and nothing of a flat
  layout's leaf, whose values are in its group), its metadata taken from
  the restore target."""
  serialization = pytest.importorskip("flax.serialization")
  if name == "adam_8bit" and layout == "flat":
    pytest.skip("adam_8bit has one layout")
  p0 = _params()
  if name.startswith("all three"):
    p0 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p0)

  def restore(run, fresh):
    return serialization.from_bytes(fresh, serialization.to_bytes(run))

  _round_trip_continues(FLAX_SERIALIZED[name](layout, rounding), p0, restore)


def test_the_checkpoint_guard_names_a_non_finite_block():
  params = _params()
  tx = ols.quantize_state(optax.adam(1e-3))  # no loss scale: NaN reaches the state
  state = tx.init(params)
  g = _grads(params)
  g["w"] = g["w"].at[3, 300].set(jnp.nan)
  _, state = tx.update(g, state, params)
  # named whole, by its blocks (its scales cannot tell NaN from inf)
  with pytest.raises(
    ValueError, match=r"mu\['w'\] \(quantised float32\): 1 of 32 blocks hold NaN or inf"
  ):
    ols.check_checkpoint(state)
  # the block holding the NaN, no other
  scales = np.asarray(state.inner_state[0].mu["w"].scales)
  assert np.isinf(scales).sum() == 1 and np.isinf(scales[3, 1])


def test_an_update_encodes_each_quantised_leaf_once(monkeypatch):
  """The state's expected layout follows from shapes (``codec.layout``):
  tracing ``update`` encodes the new moments, nothing more (it once ran
  ``init`` abstractly, encoding every leaf twice)."""
  params = {"w": jnp.zeros((64, 256)), "v": jnp.zeros((32, 256)), "b": jnp.zeros(7)}
  tx = ols.quantize_state(optax.adam(1e-3))
  state = tx.init(params)
  encoded = []

  def counting(xs, *args, **kwargs):
    encoded.extend(x.shape for x in xs)
    return encode_many(xs, *args, **kwargs)

  encode_many = q.encode_many
  monkeypatch.setattr(q, "encode_many", counting)
  monkeypatch.setattr(q, "encode", lambda *a: pytest.fail("init's encoder in update"))
  jax.make_jaxpr(tx.update)(params, state, params)
  assert sorted(encoded) == [(32, 256), (32, 256), (64, 256), (64, 256)]


def _equations(tx, n, distinct):
  """Equations, at every depth, of one trace of ``tx.update`` on ``n`` leaves
  of 2048 entries, blocks along their rows (or of n distinct sizes, none a
  whole number of blocks a row: blocks across rows)."""
  params = {
    f"w{i}": jnp.ones((8, 288 + 64 * i) if distinct else (8, 256)) for i in range(n)
  }
  state = jax.eval_shape(tx.init, params)  # abstract: nothing is compiled
  jaxpr = jax.make_jaxpr(tx.update)(params, state, params).jaxpr
  return sum(1 for _ in all_eqns(jaxpr))


@pytest.mark.parametrize("distinct", [False, True], ids=["one size", "distinct sizes"])
def test_the_equations_a_quantised_leaf_adds_do_not_grow_with_the_leaf_count(distinct):
  """A deterministic proxy of the compile time on large trees: each quantised
  leaf adds the same number of equations to the update's trace, whatever the
  number of leaves (nothing is traced once per pair of leaves, nor the whole
  state again per leaf), and the loss scale and master weights around it
  add per leaf what they add around bare Adam. The codec is still traced
  once per leaf, and its equations make the number (831 a leaf of one
  size, Adam's 15; 38 of them keep the blocks an update leaves as they
  were)."""
  qs = lambda: ols.quantize_state(optax.adam(1e-3), min_size=0)  # noqa: E731
  setups = {
    "adam": optax.adam(1e-3),
    "quantised": qs(),
    "loss scale": ols.dynamic_loss_scale(optax.adam(1e-3)),
    "all three": ols.dynamic_loss_scale(ols.master_weights(qs())),
  }
  per_leaf = {}
  for name, tx in setups.items():
    counts = [_equations(tx, n, distinct) for n in (4, 8, 16)]
    steps = [(counts[1] - counts[0]) / 4, (counts[2] - counts[1]) / 8]
    assert abs(steps[1] - steps[0]) <= 1, (name, counts)  # a constant a leaf
    per_leaf[name] = steps[0]
  assert per_leaf["quantised"] <= 850, per_leaf
  wrappers = per_leaf["all three"] - per_leaf["quantised"]
  assert wrappers <= per_leaf["loss scale"] - per_leaf["adam"] + 2, per_leaf


@pytest.mark.parametrize("layout", ["leaf", "flat"])
def test_a_stack_of_states_dequantizes_state_by_state(layout):
  # jax.vmap-ed (or scanned) states stack their leaves: a leaf of 50 (its
  # block padded) and one of whole blocks, decoded leaf by leaf
  params = {"b": jnp.linspace(-1.0, 1.0, 200).reshape(4, 50), "w": jnp.ones((4, 8, 16))}
  tx = ols.quantize_state(optax.adam(1e-3), min_size=0, block_size=64, layout=layout)
  grads = jax.tree.map(lambda x: jnp.sin(x * 3.0) * 0.01, params)
  _, state = jax.vmap(tx.update)(grads, jax.vmap(tx.init)(params), params)
  stacked = ols.dequantize_state(state)
  one_by_one = jax.vmap(ols.dequantize_state)(state)
  assert _bits(stacked) == _bits(one_by_one)
  assert float(jnp.abs(stacked[0].mu["b"]).max()) > 0
