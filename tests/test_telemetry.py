"""track_nonfinite: which gradient leaves were not finite, NaN or inf, and the loss.

The record is written inside the step, only in the non-finite branch of a
``lax.cond`` (checked in the compiled HLO); ``nonfinite_report`` names the
leaves by their paths; ``check_skipped_steps`` names them too.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import versions
from xla_costs import reductions

import optax_lossscale as ols
from optax_lossscale._loss_scale import finite as _finite

# Tests that run optax's adam, Flax or the Keras facade are marked
# standard_promotion; the others run under strict promotion (conftest).
standard_promotion = pytest.mark.standard_promotion

NAN, INF = jnp.nan, jnp.inf


def _params():
  return {
    "encoder": {"kernel": jnp.ones((3, 4)), "bias": jnp.zeros(4)},
    "head": [jnp.ones((4, 2)), jnp.zeros(2)],
  }


def _grads(**poison):
  """Gradients of ones, with ``{'encoder/kernel': value}`` entries set."""
  grads = jax.tree.map(jnp.ones_like, _params())
  flat = jax.tree_util.tree_flatten_with_path(grads)[0]
  leaves = []
  for path, g in flat:
    name = "/".join(str(getattr(k, "key", getattr(k, "idx", ""))) for k in path)
    values = poison.get(name.replace("/", "__"), ())
    for i, v in enumerate(np.atleast_1d(values)):
      g = g.reshape(-1).at[i].set(v).reshape(g.shape)
    leaves.append(g)
  return jax.tree.unflatten(jax.tree.structure(grads), leaves)


def _run(tx, steps, params=None):
  """Runs ``tx`` jitted on ``steps`` of ``(grads, value)``; the last state."""
  params = _params() if params is None else params
  state = tx.init(params)
  update = jax.jit(tx.update)
  for grads, value in steps:
    kwargs = {} if value is None else {"value": value}
    _, state = update(grads, state, params, **kwargs)
  return state


@standard_promotion
def test_nan_and_infinity_are_told_apart_and_counted():
  tx = ols.dynamic_loss_scale(optax.adam(1e-3), track_nonfinite=True)
  state = _run(
    tx,
    [
      (_grads(), 1.0),
      (_grads(encoder__kernel=NAN, head__1=INF), 1.0),
      (_grads(), 1.0),
      (_grads(encoder__kernel=[INF, NAN]), 1.0),
    ],
  )
  report = ols.nonfinite_report(state)
  assert (report.steps, report.nonfinite_steps, report.loss_steps) == (4, 2, 0)
  assert report.last_step == 3 and report.last_loss == "finite"
  assert report.last_scale == 2.0**14  # the scale after one backoff
  got = {leaf.path: leaf for leaf in report.leaves}
  assert list(got) == ["encoder/kernel", "head/1"]  # most frequent first
  assert got["encoder/kernel"] == ols.LeafReport(
    "encoder/kernel", 2, 2, 1, "NaN and inf"
  )
  assert got["head/1"] == ols.LeafReport("head/1", 1, 0, 1, None)
  text = str(report)
  assert "Non-finite gradients on 2 of 4 updates" in text
  assert "number 3, loss scale 16384" in text and "encoder/kernel (NaN and inf)" in text
  assert "head/1" in text.split("\n\n")[1]  # in the table


@standard_promotion
def test_the_record_changes_nothing_else_bit_for_bit():
  steps = [
    (_grads(), 1.0),
    (_grads(head__0=NAN), 1.0),
    (_grads(), 1.0),
    (_grads(encoder__bias=INF), NAN),
  ] + [(_grads(), 1.0)] * 3

  def run(track):
    tx = ols.dynamic_loss_scale(
      optax.adam(1e-2), growth_interval=2, track_nonfinite=track
    )
    params, state = _params(), tx.init(_params())
    update = jax.jit(tx.update)
    for grads, value in steps:
      updates, state = update(grads, state, params, value=value)
      params = optax.apply_updates(params, updates)
    return params, state

  params_on, on = run(True)
  params_off, off = run(False)
  chex.assert_trees_all_equal(params_on, params_off)
  chex.assert_trees_all_equal(on._replace(nonfinite=None), off)
  assert off.nonfinite is None and int(on.nonfinite.steps) == len(steps)


def test_a_nan_loss_is_told_apart_from_overflowing_gradients():
  """A model that is NaN by itself vs a float16 overflow the scale fixes."""
  params = {"w": jnp.full(4, 0.5, jnp.float16)}
  tx = ols.dynamic_loss_scale(
    optax.sgd(0.1), initial_scale=2.0**24, max_scale=2.0**24, track_nonfinite=True
  )
  state = tx.init(params)

  def loss_fn(p, x):
    return jnp.sum((p["w"] * x).astype(jnp.float32) ** 2)

  @jax.jit
  def step(state, x):
    loss, grads = ols.value_and_grad(loss_fn)(state, params, x)
    _, state = tx.update(grads, state, params, value=loss)
    return state

  x = jnp.full(4, 100.0, jnp.float16)
  state = step(state, x)  # the float16 gradients overflow at 2**24
  report = ols.nonfinite_report(state)
  assert report.last_loss == "finite" and report.loss_steps == 0
  assert report.leaves[0].path == "w" and report.leaves[0].last == "inf"
  assert "only the gradients were not" in str(report)

  state = step(state, x.at[0].set(jnp.nan))  # the model is NaN by itself
  report = ols.nonfinite_report(state)
  assert report.last_loss == "NaN" and report.loss_steps == 1
  # (the other entries still overflow at 2**23)
  assert report.nonfinite_steps == 2 and report.leaves[0].last == "NaN and inf"
  assert "its loss itself was NaN: the model produced it" in str(report)


def test_without_the_loss_the_report_says_so():
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), track_nonfinite=True)
  state = _run(tx, [(_grads(head__0=NAN), None)])
  report = ols.nonfinite_report(state)
  assert report.last_loss is None and report.loss_steps == 0
  assert "the loss was not given to update as value=" in str(report)
  assert ols.nonfinite_report(_run(tx, [(_grads(), None)])).format() == (
    "All 1 updates recorded had finite gradients."
  )


@standard_promotion
def test_a_nan_in_one_flax_leaf_is_named_by_its_path():
  nn = pytest.importorskip("flax.linen")

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8)(nn.relu(nn.Dense(8)(x)))

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(4):
        x = Block()(x)
      return nn.Dense(1)(x)

  model = Model()
  x = jnp.ones((2, 8))
  variables = model.init(jax.random.key(0), x)
  tx = ols.dynamic_loss_scale(optax.adam(1e-3), track_nonfinite=True)
  state = tx.init(variables)

  @jax.jit
  def step(variables, state):
    loss_fn = lambda v: jnp.mean(model.apply(v, x) ** 2)  # noqa: E731
    loss, grads = ols.value_and_grad(loss_fn)(state, variables)
    kernel = grads["params"]["Block_3"]["Dense_0"]["kernel"]
    grads["params"]["Block_3"]["Dense_0"]["kernel"] = kernel.at[2, 5].set(jnp.nan)
    _, state = tx.update(grads, state, variables, value=loss)
    return state

  state = step(variables, state)
  report = ols.nonfinite_report(state)
  assert [leaf.path for leaf in report.leaves] == ["params/Block_3/Dense_0/kernel"]
  assert report.leaves[0].last == "NaN" and report.last_loss == "finite"
  # Named the same by the parameters given to the report.
  assert ols.nonfinite_report(state, variables) == report
  with pytest.raises(ValueError, match="has 1 leaves but the record was made for 18"):
    ols.nonfinite_report(state, {"w": jnp.ones(1)})


# float16 parameters with float16 optimizer state, on purpose (the warning
# itself: tests/test_half_state.py).
@pytest.mark.filterwarnings("ignore::optax_lossscale.HalfPrecisionStateWarning")
@standard_promotion
def test_the_per_leaf_reductions_run_only_in_the_nonfinite_branch():
  """In the compiled step: no reduction added outside the conditional."""
  params = {f"w{i}": jnp.ones((i + 3, 5)) for i in range(6)}
  params["big"] = jnp.ones((300, 300))
  params["half"] = jnp.ones(64, jnp.float16)

  def compiled(track):
    tx = ols.dynamic_loss_scale(optax.adam(1e-3), track_nonfinite=track)
    update = lambda g, s, p: tx.update(g, s, p, value=jnp.float32(1.0))  # noqa: E731
    return jax.jit(update).lower(params, tx.init(params), params).compile()

  off, on = (reductions(compiled(t).as_text()) for t in (False, True))
  assert off[1] == 0  # no conditional without the record
  assert on[0] == off[0]  # the finite path: the same reductions
  assert on[1] >= 3  # the classification: the big leaf, a stack per class, the loss


def test_check_skipped_steps_names_the_leaves():
  tx = ols.dynamic_loss_scale(
    optax.sgd(0.1), initial_scale=4.0, min_scale=1.0, track_nonfinite=True
  )
  state = _run(tx, [(_grads(encoder__bias=[NAN, INF]), NAN)] * 4)
  with pytest.raises(ols.NonFiniteStepsError) as e:
    ols.check_skipped_steps(state, max_consecutive_skips=4)
  msg = str(e.value)
  assert "at its floor" in msg
  assert "was not finite in encoder/bias (NaN and inf)" in msg
  assert "its loss itself was NaN" in msg
  # Without a record (or from the diagnostics) the message names no leaf.
  plain = ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=4.0)
  with pytest.raises(ols.NonFiniteStepsError) as e:
    ols.check_skipped_steps(
      _run(plain, [(_grads(encoder__bias=NAN), None)] * 4), max_consecutive_skips=4
    )
  assert "encoder" not in str(e.value)


@standard_promotion
def test_the_keras_facade_records_what_its_check_read():
  """A float16 gradient finite as scaled, infinite once divided by the factor."""
  opt = ols.porting.LossScaleOptimizer(
    "sgd",
    initial_scale=1.0,
    min_scale=2.0**-4,
    loss_scale_factor=0.25,
    track_nonfinite=True,
  )
  assert opt.get_config()["track_nonfinite"] is True
  assert ols.porting.LossScaleOptimizer.from_config(opt.get_config()).track_nonfinite
  params = {"a": jnp.ones(2, jnp.float16), "b": jnp.ones(2, jnp.float16)}
  state = opt.init(params)
  update = jax.jit(opt.update)
  finite = {"a": jnp.ones(2, jnp.float16), "b": jnp.full(2, 1e4, jnp.float16)}
  _, state = update(finite, state, params)  # 1e4 / 0.25 = 4e4: finite
  assert ols.nonfinite_report(state).nonfinite_steps == 0
  # 6e4 is finite in float16, 6e4 / 0.25 = 2.4e5 is not: the step is skipped
  # and the record names the leaf that the unscaled check found infinite.
  _, state = update({**finite, "b": jnp.full(2, 6e4, jnp.float16)}, state, params)
  report = ols.nonfinite_report(state)
  assert [(leaf.path, leaf.last) for leaf in report.leaves] == [("b", "inf")]
  assert int(ols.diagnostics(state)["skipped_steps"]) == 1


def test_noop_loss_scale_records_what_it_applies():
  tx = ols.porting.with_loss_scale(
    optax.sgd(0.1), ols.porting.NoOpLossScale(), track_nonfinite=True
  )
  state = _run(tx, [(_grads(), 1.0), (_grads(head__1=NAN), NAN)])
  report = ols.nonfinite_report(state)
  assert report.nonfinite_steps == 1 and report.loss_steps == 1
  assert report.leaves[0].path == "head/1" and report.last_scale == 1.0


def test_flax_float8_overwrite_leaves_are_named_too():
  params = {
    "params": {"Dense_0": {"kernel": jnp.ones((2, 2))}},
    "_overwrite_with_gradient": {"Dense_0": {"input_scale": jnp.ones(1)}},
  }
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), track_nonfinite=True)
  grads = jax.tree.map(jnp.ones_like, params)
  grads["_overwrite_with_gradient"]["Dense_0"]["input_scale"] = jnp.array([jnp.inf])
  state = _run(tx, [(grads, 1.0)], params)
  report = ols.nonfinite_report(state)
  assert [leaf.path for leaf in report.leaves] == [
    "_overwrite_with_gradient/Dense_0/input_scale"
  ]


def test_vmap_with_an_axis_name_records_on_every_member():
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), axis_name="i", track_nonfinite=True)
  params = {"a": jnp.ones(3), "b": jnp.ones(2)}
  state = tx.init(params)
  grads = {"a": jnp.ones((4, 3)).at[2, 1].set(jnp.nan), "b": jnp.ones((4, 2))}
  states = jax.vmap(lambda g: tx.update(g, state, params)[1], axis_name="i")(grads)
  np.testing.assert_array_equal(states.nonfinite.leaf_nan_steps, [[1, 0]] * 4)


def test_classification_of_every_float_dtype():
  leaves = [
    jnp.ones(3),
    jnp.array([NAN, INF, 1.0]),
    jnp.array([1, 2]),
    jnp.zeros((0, 3)),
    jnp.array([-INF], jnp.float16),
    jnp.array([NAN], jnp.bfloat16),
    jnp.full(_finite.KINDS_STACK_MAX_SIZE + 1, -NAN),
    jnp.ones(_finite.KINDS_STACK_MAX_SIZE + 1).at[-1].set(INF),
    jnp.array([1 + 0j, complex(0.0, INF)]),
    jnp.array([NAN], jnp.float8_e4m3fn),
    jnp.array([INF], jnp.float8_e5m2),
    jnp.array(7.0),
  ]
  kinds = jax.jit(_finite.nonfinite_kinds)(leaves)
  np.testing.assert_array_equal(kinds, [0, 3, 0, 0, 2, 1, 1, 2, 2, 1, 2, 0])
  assert kinds.dtype == jnp.uint8
  for x in (jax.random.key(0), jax.random.PRNGKey(0), np.array([1, 2])):
    assert _finite.count_nonfinite(x) == (0, 0)  # a key was fetched, refused


def _special_values(dtype):
  """Entries of ``dtype`` at the edges of each class, made from their bits:
  NaN with only the lowest, only the highest or every fraction bit set,
  either sign; infinities; the largest finite value; the smallest subnormal."""
  info = jnp.finfo(dtype)
  uint = {16: np.uint16, 32: np.uint32}[info.bits]
  exponent = ((1 << info.nexp) - 1) << info.nmant
  sign = 1 << (info.bits - 1)
  fraction = (1 << info.nmant) - 1
  bits = [exponent | 1, exponent | 1 << (info.nmant - 1), exponent | fraction]
  bits += [b | sign for b in bits] + [exponent, exponent | sign]
  bits += [exponent - 1, 1, sign | 1, 0]
  return np.array(bits, uint).view(jnp.dtype(dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("size", [3, _finite.KINDS_STACK_MAX_SIZE + 1])
def test_each_entry_is_classified_by_its_bits(dtype, size):
  """Every special value, alone in a leaf of ones, small (stacked) and large,
  jitted and on the host, against NumPy's isnan and isinf."""
  values = _special_values(dtype)
  leaves = []
  for v in values:
    x = np.ones(size, jnp.dtype(dtype))
    x[size // 2] = v
    leaves.append(jnp.asarray(x))
  wide = values.astype(np.float32)
  want = np.isnan(wide) * _finite.NAN | np.isinf(wide) * _finite.INF
  np.testing.assert_array_equal(jax.jit(_finite.nonfinite_kinds)(leaves), want)
  for x, nan, inf in zip(leaves, np.isnan(wide), np.isinf(wide), strict=True):
    assert _finite.count_nonfinite(x) == (int(nan), int(inf))
    device = jax.jit(_finite.count_nonfinite_device)(x).sum(axis=1)
    np.testing.assert_array_equal(device, [int(nan), int(inf)])
    assert bool(jax.jit(ols.all_finite)(x)) == (not nan and not inf)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("value", [NAN, -INF, 1e300, 2.0])
@pytest.mark.parametrize("size", [3, _finite.KINDS_STACK_MAX_SIZE + 1])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_numpy_leaves_are_classified_as_jax_holds_them(dtype, size, value):
  """A NumPy leaf is classified as the array JAX makes of it, eagerly as
  under jit (float64 is float32 unless x64 is on: 1e300 is an infinity);
  its bits were once read as the wrong words."""
  if dtype != np.float64 and value == 1e300:
    pytest.skip("1e300 is a float64 value")
  x = np.ones(size, dtype)
  x[size // 2] = value
  held = np.asarray(jnp.asarray(x))
  nan, inf = bool(np.isnan(held).any()), bool(np.isinf(held).any())
  want = [0, nan * _finite.NAN | inf * _finite.INF]
  for kinds in (_finite.nonfinite_kinds, jax.jit(_finite.nonfinite_kinds)):
    np.testing.assert_array_equal(kinds([np.ones(2, dtype), x]), want)
  np.testing.assert_array_equal(
    _finite.count_nonfinite_device(x).sum(axis=1), [int(nan), int(inf)]
  )


def test_bad_inputs_are_clear_errors():
  with pytest.raises(ValueError, match="`track_nonfinite` must be a bool"):
    ols.dynamic_loss_scale(optax.sgd(0.1), track_nonfinite=1)
  plain = ols.dynamic_loss_scale(optax.sgd(0.1))
  tracked = ols.dynamic_loss_scale(optax.sgd(0.1), track_nonfinite=True)
  params = _params()
  with pytest.raises(ValueError, match="holds no non-finite record"):
    tracked.update(_grads(), plain.init(params), params)
  with pytest.raises(ValueError, match="build the loss scale with track_nonfinite"):
    ols.nonfinite_report(plain.init(params))
  with pytest.raises(ValueError, match="must be a floating array or number, got int32"):
    tracked.update(_grads(), tracked.init(params), params, value=jnp.int32(1))
  with pytest.raises(ValueError, match="floating array or number, got dict"):
    tracked.update(_grads(), tracked.init(params), params, value={"loss": 1.0})
  state = tracked.init(params)
  with pytest.raises(
    ValueError, match="have 3 leaves but the non-finite record was made for 4"
  ):
    tracked.update({"a": jnp.ones(1), "b": jnp.ones(1), "c": jnp.ones(1)}, state)
  with pytest.raises(ValueError, match="outside jax.jit"):
    jax.jit(lambda s: ols.nonfinite_report(s).steps)(state)
  # A tracking state given to a plain loss scale keeps its record as it is.
  _, kept = plain.update(_grads(head__0=NAN), state, params)
  chex.assert_trees_all_equal(kept.nonfinite, state.nonfinite)


@standard_promotion
def test_the_record_survives_an_orbax_round_trip(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  tx = ols.dynamic_loss_scale(optax.adam(1e-3), track_nonfinite=True)
  state = _run(tx, [(_grads(encoder__kernel=NAN), 1.0), (_grads(), 1.0)])
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", state)
  checkpointer.wait_until_finished()
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, tx.init(_params()))
  restored = checkpointer.restore(tmp_path / "ckpt", target)
  checkpointer.close()
  chex.assert_trees_all_equal(restored, state)
  assert ols.nonfinite_report(restored) == ols.nonfinite_report(state)
  # And it goes on counting.
  _, restored = jax.jit(tx.update)(_grads(encoder__kernel=INF), restored, _params())
  assert ols.nonfinite_report(restored).leaves[0].steps == 2


@standard_promotion
def test_nnx_optimizer_reports_through_its_variables():
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), track_nonfinite=True)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
  grads["bias"] = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads["bias"])
  optimizer.update(model, grads, value=jnp.float32(2.0))
  report = ols.nonfinite_report(optimizer)
  assert [(leaf.path, leaf.last) for leaf in report.leaves] == [("bias", "NaN")]


@standard_promotion
def test_linen_train_state_passes_the_loss_on():
  pytest.importorskip("flax")
  from optax_lossscale.flax import LossScaleTrainState

  tx = ols.dynamic_loss_scale(optax.sgd(0.1), track_nonfinite=True)
  state = LossScaleTrainState.create(apply_fn=None, params=_params(), tx=tx)
  state = state.apply_gradients(grads=_grads(head__1=INF), value=jnp.float32(jnp.nan))
  report = ols.nonfinite_report(state)
  assert report.last_loss == "NaN" and report.leaves[0].path == "head/1"
  assert int(state.step) == 0  # skipped


def test_none_leaves_keep_their_place():
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), track_nonfinite=True)
  params = {"a": jnp.ones(3), "b": jnp.ones(2), "c": None, "d": jnp.ones(1)}
  grads = {"a": None, "b": jnp.ones(2), "c": None, "d": jnp.array([jnp.inf])}
  state = _run(tx, [(grads, None)], params)
  report = ols.nonfinite_report(state)
  assert [(leaf.path, leaf.last) for leaf in report.leaves] == [("d", "inf")]
  assert ols.nonfinite_report(state, params) == report


def test_float8_meta_overwrite_values_are_classified():
  fp8_ops = pytest.importorskip("flax.linen.fp8_ops")
  meta = jax.jit(lambda a: jax.lax.convert_element_type(a, fp8_ops.fp32_max_grad))
  params = {"w": jnp.ones(2), "_overwrite_with_gradient": {"amax": meta(jnp.zeros(3))}}
  grads = {
    "w": jnp.full(2, 4.0),
    "_overwrite_with_gradient": {"amax": meta(jnp.array([1.0, jnp.inf, 3.0]))},
  }
  for loss_scale in (ols.porting.DynamicLossScale(4.0), ols.porting.NoOpLossScale()):
    tx = ols.porting.with_loss_scale(optax.sgd(1.0), loss_scale, track_nonfinite=True)
    report = ols.nonfinite_report(_run(tx, [(grads, None)], params))
    assert [(leaf.path, leaf.last) for leaf in report.leaves] == [
      ("_overwrite_with_gradient/amax", "inf")
    ], loss_scale


def test_enable_mixed_precision_keeps_the_record_in_bfloat16_too():
  fast, tx = ols.porting.enable_mixed_precision(
    lambda p: jnp.sum(p["w"]),
    optax.sgd(0.1),
    compute_dtype=jnp.bfloat16,
    track_nonfinite=True,
  )
  state = _run(tx, [({"w": jnp.array([jnp.nan, 1.0])}, None)], {"w": jnp.ones(2)})
  assert ols.nonfinite_report(state).leaves[0].path == "w"
  with pytest.raises(ValueError, match=r"\['initial_scale'\] given, but bfloat16"):
    ols.porting.enable_mixed_precision(
      lambda p: p, optax.sgd(0.1), compute_dtype=jnp.bfloat16, initial_scale=2.0
    )


def test_a_report_of_replicas_that_agree_or_not():
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), axis_name="i", track_nonfinite=True)
  params = {"a": jnp.ones(3)}
  state = tx.init(params)
  grads = {"a": jnp.ones((4, 3)).at[2, 1].set(jnp.nan)}
  update = jax.vmap(lambda g: tx.update(g, state, params)[1], axis_name="i")
  report = ols.nonfinite_report(update(grads))
  assert [(leaf.path, leaf.last) for leaf in report.leaves] == [("a", "NaN")]
  alone = ols.dynamic_loss_scale(optax.sgd(0.1), track_nonfinite=True)
  apart = jax.vmap(lambda g: alone.update(g, alone.init(params), params)[1])(grads)
  with pytest.raises(ValueError, match="4 records .* that differ"):
    ols.nonfinite_report(apart)
  # check_skipped_steps reads the replicas the same way.
  with pytest.raises(ols.NonFiniteStepsError, match=r"not finite in a \(NaN\)"):
    ols.check_skipped_steps(update(grads), max_consecutive_skips=1)
  with pytest.raises(ValueError, match="4 copies of its counters .* that differ"):
    ols.check_skipped_steps(apart, max_consecutive_skips=1)


@standard_promotion
def test_flax_serialization_and_partitioned_boxes():
  nn = pytest.importorskip("flax.linen")
  from flax import serialization

  import optax_lossscale.flax  # noqa: F401 - registers the record

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      init = nn.with_partitioning(nn.initializers.ones, (None, "model"))
      return nn.Dense(2, kernel_init=init)(x)

  params = Model().init(jax.random.key(0), jnp.ones((1, 3)))["params"]
  tx = ols.dynamic_loss_scale(optax.adam(1e-3), track_nonfinite=True)
  grads = jax.tree.map(jnp.ones_like, params)
  grads["Dense_0"]["kernel"] = grads["Dense_0"]["kernel"].replace_boxed(
    jnp.full((3, 2), jnp.nan)
  )
  state = _run(tx, [(grads, 1.0)], params)
  report = ols.nonfinite_report(state)
  assert [leaf.path for leaf in report.leaves] == ["Dense_0/kernel"]  # not .../value
  restored = serialization.from_bytes(tx.init(params), serialization.to_bytes(state))
  chex.assert_trees_all_equal(restored, state)
  assert ols.nonfinite_report(restored) == report


@pytest.mark.integration
def test_float64_leaves_are_classified_with_x64_on():
  import os
  import subprocess
  import sys

  code = (
    "import jax.numpy as jnp\n"
    "from optax_lossscale._loss_scale import finite as _finite\n"
    "x = jnp.ones(5000, jnp.float64).at[3].set(-jnp.inf)\n"
    "k = _finite.nonfinite_kinds([jnp.array([1.0, jnp.nan]), x, jnp.ones(2)])\n"
    "assert x.dtype == jnp.float64\n"
    "print(k.tolist())\n"
  )
  env = {**os.environ, "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu"}
  out = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
  )
  assert out.stdout.strip() == "[1, 2, 0]"


# --------------------------------------------------------------------------
# What the record reads: complex leaves, lookahead, frozen subtrees, a scale
# out of range, abstract states.
# --------------------------------------------------------------------------

#: A complex gradient's (real parts, imaginary parts).
COMPLEX_GRADIENTS = {
  "finite": ([1.0, -2.0], [0.0, 0.5]),
  "inf in the real part": ([INF, 1.0], [0.0, 0.0]),
  "inf in the imaginary part": ([1.0, 1.0], [-INF, 0.0]),
  "NaN in one part": ([NAN, 1.0], [0.0, 0.0]),
  "NaN and inf in one entry": ([NAN, 1.0], [INF, 0.0]),
  "NaN and inf in two entries": ([NAN, 1.0], [0.0, INF]),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
@pytest.mark.parametrize("case", COMPLEX_GRADIENTS)
def test_a_complex_gradient_is_recorded_and_counted_as_numpy_sees_it(case, dtype, jit):
  """The record and the checkpoint guard say what NumPy's ``isnan`` and
  ``isinf`` say of the gradient as ``update`` received it (the record reads
  it unscaled: a complex product with the scale's reciprocal once made NaN
  of an infinite part's ``0`` partner)."""
  real, imag = (np.asarray(p) for p in COMPLEX_GRADIENTS[case])
  g = np.empty(2, dtype)
  g.real, g.imag = real * 8, imag * 8
  nans, infs = np.count_nonzero(np.isnan(g)), np.count_nonzero(np.isinf(g))
  with versions.x64():
    params = {"w": jnp.zeros(2, dtype)}
    tx = ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=8.0, track_nonfinite=True)
    update = jax.jit(tx.update) if jit else tx.update
    _, state = update({"w": jnp.asarray(g)}, tx.init(params), params)
    report = ols.nonfinite_report(state)
    if not (nans or infs):
      assert report.nonfinite_steps == 0 and not report.leaves
      assert ols.check_checkpoint({"w": jnp.asarray(g)}) is not None
      return
    kinds = [name for name, n in (("NaN", nans), ("inf", infs)) if n]
    assert report.leaves[0].last == " and ".join(kinds), case
    counts = " and ".join(
      f"{n} {name}" for name, n in (("NaN", nans), ("inf", infs)) if n
    )
    with pytest.raises(ValueError, match=rf"\['w'\]: {counts} \(of 2 entries\)"):
      ols.check_checkpoint({"w": jnp.asarray(g)})


def _lookahead_params():
  return optax.LookaheadParams.init_synced({"v": jnp.ones(2), "w": jnp.ones(3)})


@standard_promotion
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_lookahead_is_recorded_by_its_fast_weights(jit):
  """``optax.lookahead`` takes the fast weights' gradients: the record is
  made for them, and names them, with or without ``params=``."""
  params = _lookahead_params()
  tx = ols.dynamic_loss_scale(
    optax.lookahead(optax.sgd(0.1), 2, 0.5), track_nonfinite=True
  )
  state = tx.init(params)
  assert state.nonfinite.paths == ("v", "w")
  update = jax.jit(tx.update) if jit else tx.update
  grads = {"v": jnp.ones(2), "w": jnp.array([1.0, NAN, 1.0])}
  _, state = update(grads, state, params)
  _, state = update(jax.tree.map(jnp.ones_like, grads), state, params)
  report = ols.nonfinite_report(state)
  assert (report.steps, report.nonfinite_steps) == (2, 1)
  assert [(leaf.path, leaf.last) for leaf in report.leaves] == [("w", "NaN")]
  assert ols.nonfinite_report(state, params) == report
  assert ols.nonfinite_report(state, params.fast) == report


#: Gradients with None for whole subtrees of the parameters (frozen parts).
FROZEN = {
  "first subtree": (
    {"a": None, "b": jnp.array([NAN, 1.0]), "c": {"z": jnp.ones(2)}},
    "b",
  ),
  "middle leaf and last subtree": (
    {"a": {"x": jnp.array([INF, 1.0]), "y": jnp.ones(2)}, "b": None, "c": None},
    "a/x",
  ),
  "all but one": ({"a": None, "b": None, "c": {"z": jnp.array([1.0, NAN])}}, "c/z"),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", FROZEN)
def test_a_frozen_subtree_keeps_its_entries_uncounted(case, jit):
  params = {
    "a": {"x": jnp.ones(2), "y": jnp.ones(2)},
    "b": jnp.ones(2),
    "c": {"z": jnp.ones(2)},
  }
  grads, bad = FROZEN[case]
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), track_nonfinite=True)
  state = tx.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  updates, state = update(grads, state, params)
  report = ols.nonfinite_report(state)
  assert (report.steps, report.nonfinite_steps) == (1, 1)
  assert [leaf.path for leaf in report.leaves] == [bad]
  record = state.nonfinite
  assert record.paths == ("a/x", "a/y", "b", "c/z")
  assert int(np.sum(record.leaf_steps)) == 1
  # Without the parameters, gradients of another number of leaves (None
  # counting one) cannot be placed: a clear error.
  if len(jax.tree.leaves(grads, is_leaf=lambda x: x is None)) != 4:
    with pytest.raises(ValueError, match="non-finite record was made for 4"):
      tx.update(grads, tx.init(params))
  else:
    _, alone = tx.update(grads, tx.init(params))
    assert ols.nonfinite_report(alone) == report


#: Loss scales whose state can hold a scale below their range (restored).
RESTORED = {
  "dynamic_loss_scale": lambda: ols.dynamic_loss_scale(
    optax.sgd(0.1), track_nonfinite=True
  ),
  "static_loss_scale": lambda: ols.static_loss_scale(
    optax.sgd(0.1), 4.0, track_nonfinite=True
  ),
  "LossScaleOptimizer": lambda: ols.porting.LossScaleOptimizer(
    optax.sgd(0.1), track_nonfinite=True
  ),
}


@standard_promotion
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("grad", [1.0, 1e37], ids=["finite unscaled", "overflows"])
@pytest.mark.parametrize("make", RESTORED)
def test_a_step_skipped_for_a_scale_out_of_range_is_not_a_nonfinite_one(
  make, grad, jit
):
  """A state restored with a scale below 1 under a configuration whose scales
  are not: the step is skipped (unscaling could overflow unseen), but only
  gradients that are not finite once unscaled count as non-finite."""
  params = {"w": jnp.ones(2)}
  tx = RESTORED[make]()
  state = tx.init(params)
  state = state._replace(loss_scale=jnp.float32(2.0**-8))
  update = jax.jit(tx.update) if jit else tx.update
  updates, state = update({"w": jnp.full(2, grad, jnp.float32)}, state, params)
  np.testing.assert_array_equal(updates["w"], 0.0)  # skipped either way
  report = ols.nonfinite_report(state)
  assert report.steps == 1
  if grad == 1.0:
    assert report.nonfinite_steps == 0 and not report.leaves
  else:  # 1e37 * 2**8 is inf in float32
    assert report.nonfinite_steps == 1
    assert [(leaf.path, leaf.last) for leaf in report.leaves] == [("w", "inf")]


#: Host-side readers of a state, each ``state -> None``.
HOST_READERS = {
  "nonfinite_report": ols.nonfinite_report,
  "check_skipped_steps": ols.check_skipped_steps,
  "check_checkpoint": ols.check_checkpoint,
  "check_skipped_steps of diagnostics": lambda s: ols.check_skipped_steps(
    ols.diagnostics(s)
  ),
}


@pytest.mark.parametrize("reader", HOST_READERS)
def test_an_abstract_state_is_refused_by_every_host_side_reader(reader):
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), track_nonfinite=True)
  abstract = jax.eval_shape(tx.init, _params())
  with pytest.raises(ValueError, match="abstract ones.*ShapeDtypeStruct"):
    HOST_READERS[reader](abstract)
  with pytest.raises(ValueError, match="outside jax.jit"):
    jax.jit(lambda s: HOST_READERS[reader](s) or 0)(tx.init(_params()))


@pytest.mark.parametrize(
  "min_scale", [None, "1", np.nan, np.inf, -1.0, True, jnp.ones(2)]
)
def test_check_skipped_steps_refuses_a_bad_min_scale(min_scale):
  tx = ols.dynamic_loss_scale(optax.sgd(0.1))
  state = tx.init(_params())
  with pytest.raises(ValueError, match="`min_scale`"):
    ols.check_skipped_steps(state, min_scale=min_scale)
