"""Per-leaf decisions under a loss scale: each leaf's gradient dtype is its own.

Which gradient leaves reach the inner optimizer in float32 (those a
``master_weights`` keeps masters of), which are overwrite leaves, which are
rounded: decided for each leaf, in every composition. A state's dtypes and
shapes never change between ``init`` and ``update``, and the jitted step is
traced once.
"""

import contextlib
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import versions

import optax_lossscale as ols

# optax's adam, MultiSteps and inject_hyperparams use mixed-width arithmetic.
pytestmark = pytest.mark.standard_promotion

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
DTYPES = {"float16": F16, "bfloat16": BF16, "float32": F32}


def _kind(name, dtype):
  """A factory ``lr -> transformation`` of one kind, for parameters of ``dtype``."""
  momentum = lambda lr: optax.sgd(lr, momentum=0.9)  # noqa: E731
  if name == "plain":
    return momentum
  if name == "master_weights":
    store = "remainder" if dtype == BF16 else "float32"
    return lambda lr: ols.master_weights(optax.adam(lr), store=store)
  if name == "stochastic_rounding":
    return lambda lr: optax.chain(momentum(lr), ols.stochastic_rounding(0))
  if name == "kahan":
    return lambda lr: optax.chain(momentum(lr), ols.kahan_summation())
  raise AssertionError(name)


LABELS = {"a": "x", "b": "plain"}


def _composed(composition, make, lr=0.1):
  """The kind ``make`` on leaf ``a`` (and, where the composition allows, a
  plain SGD-momentum on leaf ``b``), composed as named."""
  plain = optax.sgd(0.1, momentum=0.9)
  if composition == "chain":
    return optax.chain(optax.clip_by_global_norm(10.0), make(lr))
  if composition == "multi_transform":
    return optax.multi_transform({"x": make(lr), "plain": plain}, LABELS)
  if composition == "masked":
    return optax.chain(
      optax.masked(make(lr), {"a": True, "b": False}),
      optax.masked(plain, {"a": False, "b": True}),
    )
  if composition == "MultiSteps inside":
    return optax.MultiSteps(
      optax.multi_transform({"x": make(lr), "plain": plain}, LABELS), 2
    )
  if composition == "inject_hyperparams":
    return optax.multi_transform(
      {"x": optax.inject_hyperparams(make)(lr=lr), "plain": plain}, LABELS
    )
  raise AssertionError(composition)


COMPOSITIONS = [
  "chain",
  "multi_transform",
  "masked",
  pytest.param("MultiSteps inside", marks=versions.multisteps_dtypes),
  pytest.param("inject_hyperparams", marks=versions.inject_dtypes),
]
KINDS = ["plain", "master_weights", "stochastic_rounding", "kahan"]


@contextlib.contextmanager
def _warns_if(expected):
  """``pytest.warns`` of float16 state when ``expected``, else no warning."""
  if expected:
    with pytest.warns(ols.HalfPrecisionStateWarning, match="float16"):
      yield
  else:
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      yield


def _shapes_and_dtypes(tree):
  return jax.tree.map(lambda x: (np.shape(x), jnp.result_type(x)), tree)


@pytest.mark.sampled
@pytest.mark.parametrize("composition", COMPOSITIONS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_state_keeps_its_dtypes_and_the_step_is_traced_once(composition, kind, dtype):
  dtype = DTYPES[dtype]
  params = {"a": jnp.linspace(-1, 1, 4).astype(dtype), "b": jnp.ones(3, dtype)}
  inner = _composed(composition, _kind(kind, dtype))
  tx = ols.dynamic_loss_scale(inner, initial_scale=2.0**8)
  # float16 parameters whose optimizer keeps float16 state say so at init
  # (all but master_weights alone, whose state is float32).
  half_state = dtype == F16 and not (
    kind == "master_weights" and composition == "chain"
  )
  with _warns_if(half_state):
    template = jax.eval_shape(tx.init, params)
    state = tx.init(params)
  traces = []

  @jax.jit
  def step(params, state, grads):
    traces.append(1)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates

  good = {"a": jnp.full(4, 2.0**-4, dtype), "b": jnp.full(3, 2.0**-3, dtype)}
  bad = {**good, "a": good["a"].at[1].set(jnp.inf)}
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no fallback warning in any of these
    for grads in (good, bad, good, good):
      params, state, updates = step(params, state, grads)
      assert jax.tree.structure(state) == jax.tree.structure(template)
      assert _shapes_and_dtypes(state) == _shapes_and_dtypes(template)
      assert params["a"].dtype == dtype and params["b"].dtype == dtype
  assert len(traces) == 1
  assert int(ols.diagnostics(state)["skipped_steps"]) == 1
  if composition == "chain":
    return
  # The plain branch's momentum is in the parameters' dtype, as optax keeps it.
  traces_of_b = [
    x
    for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
    if ".trace['b']" in jax.tree_util.keystr(p)
  ]
  assert traces_of_b and all(x.dtype == dtype for x in traces_of_b)


@pytest.mark.parametrize(
  "composition",
  [
    "multi_transform",
    "masked",
    pytest.param("inject_hyperparams", marks=versions.inject_dtypes),
  ],
)
def test_only_the_master_weights_leaves_get_float32_gradients(composition):
  # 2**-30 is 0 in float16: the master leaf receives it unscaled in float32,
  # the plain leaf receives its gradient in float16 (its state stays float16).
  scale = 2.0**15
  params = {"a": jnp.zeros(4, F16), "b": jnp.ones(3, F16)}
  make = lambda lr: ols.master_weights(optax.sgd(lr), store="float32")  # noqa: E731
  # (inject_hyperparams keeps the rate in the parameters' float16: 0.5 is exact)
  tx = ols.dynamic_loss_scale(_composed(composition, make, 0.5), initial_scale=scale)
  with pytest.warns(ols.HalfPrecisionStateWarning):  # the plain branch's momentum
    state = tx.init(params)
  grads = {"a": jnp.full(4, 2.0**-30 * scale, F16), "b": jnp.full(3, scale, F16)}
  updates, state = jax.jit(tx.update)(grads, state, params)
  master = ols.get_master_weights(state, optax.apply_updates(params, updates))
  np.testing.assert_array_equal(master["a"], np.float32(-0.5 * 2.0**-30))
  assert updates["b"].dtype == F16


def test_a_half_state_before_master_weights_keeps_its_dtypes_and_says_so():
  # optax.trace before master_weights keeps its momentum in the parameters'
  # float16: handing it float32 gradients would make that state float32.
  params = {"a": jnp.ones(4, F16), "b": jnp.ones(3, F16)}
  grads = jax.tree.map(jnp.ones_like, params)
  master = ols.master_weights(optax.sgd(0.1), store="float32")
  tx = ols.dynamic_loss_scale(optax.chain(optax.trace(0.9), master))
  with pytest.warns(ols.HalfPrecisionStateWarning, match="state leaves in float16"):
    template = jax.eval_shape(tx.init, params)
    state = tx.init(params)
  with pytest.warns(ols.HalfPrecisionStateWarning, match="around the whole"):
    _, state = jax.jit(tx.update)(grads, state, params)
  assert _shapes_and_dtypes(state) == _shapes_and_dtypes(template)
  # Around the whole optimizer it sees float32 gradients and says nothing.
  tx = ols.dynamic_loss_scale(
    ols.master_weights(optax.chain(optax.trace(0.9), optax.sgd(0.1)), store="float32")
  )
  template = jax.eval_shape(tx.init, params)
  _, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert _shapes_and_dtypes(state) == _shapes_and_dtypes(template)


def _counting(tx, calls):
  """``tx`` with its ``init`` and ``update`` calls (traces, under jit) counted."""

  def init(params):
    calls["init"] += 1
    return tx.init(params)

  def update(updates, state, params=None, **extra):
    calls["update"] += 1
    return tx.update(updates, state, params, **extra)

  return optax.GradientTransformationExtraArgs(init, update)


# wrapper (of the counted inner optimizer), the parameters' dtype
WRAPPERS = {
  "dynamic_loss_scale": (ols.dynamic_loss_scale, F32),
  "static, no skip": (
    lambda i: ols.static_loss_scale(i, 8.0, skip_nonfinite=False),
    F32,
  ),
  "track_nonfinite": (lambda i: ols.dynamic_loss_scale(i, track_nonfinite=True), F16),
  "master_weights": (lambda i: ols.master_weights(i), BF16),
  "quantize_state": (lambda i: ols.quantize_state(i, min_size=0), F32),
  "quantize_state, flat": (
    lambda i: ols.quantize_state(i, min_size=0, layout="flat"),
    F32,
  ),
  "loss scale(master_weights)": (
    lambda i: ols.dynamic_loss_scale(ols.master_weights(i)),
    BF16,
  ),
  "loss scale(master_weights(quantize_state))": (
    lambda i: ols.dynamic_loss_scale(
      ols.master_weights(ols.quantize_state(i, min_size=0))
    ),
    BF16,
  ),
  "static, no skip(master_weights)": (
    lambda i: ols.static_loss_scale(
      ols.master_weights(i, store="float32"), 8.0, skip_nonfinite=False
    ),
    F16,
  ),
  "LossScaleOptimizer": (lambda i: ols.porting.LossScaleOptimizer(i), F32),
}


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_one_trace_of_the_update_traces_the_inner_update_once_and_init_never(wrapper):
  make, dtype = WRAPPERS[wrapper]
  calls = {"init": 0, "update": 0}
  tx = make(_counting(optax.adam(1e-3), calls))
  params = {"w": jnp.ones((4, 8), dtype), "b": jnp.ones(8, dtype)}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", ols.HalfPrecisionStateWarning)  # float16 Adam
    state = tx.init(params)
  assert calls == {"init": 1, "update": 0}
  calls["init"] = 0
  jax.make_jaxpr(tx.update)(params, state, params)
  assert calls == {"init": 0, "update": 1}
  # A state no init of this transformation made (restored from a checkpoint,
  # say): its first trace traces init once, for the check; later ones never.
  fresh = make(_counting(optax.adam(1e-3), calls))
  calls["update"] = 0
  jax.make_jaxpr(fresh.update)(params, state, params)
  assert calls["update"] == 1 and calls["init"] >= 1
  calls.update(init=0, update=0)
  jax.make_jaxpr(lambda *a: fresh.update(*a))(params, state, params)  # anew
  assert calls == {"init": 0, "update": 1}


def test_a_jitted_body_many_leaves_share_is_evaluated_once_for_the_skip(monkeypatch):
  # The skip re-evaluates the inner update's jaxpr with selects where the new
  # state is made, into the jitted calls that make it; a call made for every
  # leaf of one shape (the 8-bit encoder) shares one body, evaluated once
  # (then traced and lowered once by JAX), so the evaluations of one trace
  # do not grow with the number of leaves
  from optax_lossscale._base import jaxpr as _jaxpr
  from optax_lossscale._loss_scale import skip as _skip

  evaluated = []
  evaluate = _jaxpr.evaluate
  monkeypatch.setattr(
    _jaxpr, "evaluate", lambda j, *a, **k: evaluated.append(1) or evaluate(j, *a, **k)
  )

  def evaluations(n, shape):
    params = {f"w{i}": jnp.ones(shape) for i in range(n)}
    tx = ols.dynamic_loss_scale(ols.quantize_state(optax.adam(1e-3), min_size=0))
    state = jax.eval_shape(tx.init, params)
    # every body new, whatever the tests before traced
    jax.clear_caches()
    _skip._BODIES.clear()
    evaluated.clear()
    jax.make_jaxpr(tx.update)(params, state, params)
    return len(evaluated)

  one, few, many = (evaluations(n, (8, 296)) for n in (1, 2, 8))
  # the update's jaxpr, the encoder's body and two of jnp.where's (optax's
  # count, a kept block's scale: one select each), each once, however many
  # leaves share them
  assert one == few == many == 4


def test_state_made_in_jitted_helpers_is_skipped_exactly():
  # New state made inside the user's own jax.jit helpers (a static argument,
  # a literal argument, an integer counter, a bfloat16 leaf, a scalar and a
  # zero-size parameter), the state buffers donated: a finite step is the
  # inner update's, a non-finite one keeps the state bit for bit, and the
  # skip never falls back
  import functools

  @functools.partial(jax.jit, static_argnums=(2,))
  def ema(old, g, decay):
    return decay * old + (1 - decay) * g

  @jax.jit
  def bump(c, k):
    return c + k

  def init(p):
    zeros = lambda d: jax.tree.map(lambda x: jnp.zeros_like(x, d), p)  # noqa: E731
    return {"m": zeros(None), "h": zeros(jnp.bfloat16), "c": jnp.int32(0)}

  def update(g, s, p=None):
    m = jax.tree.map(lambda o, x: ema(o, x, 0.9), s["m"], g)
    h = jax.tree.map(
      lambda o, x: ema(o.astype(jnp.float32), x, 0.5).astype(jnp.bfloat16), s["h"], g
    )
    return jax.tree.map(lambda x: -0.1 * x, m), {"m": m, "h": h, "c": bump(s["c"], 1)}

  inner = optax.GradientTransformation(init, update)
  params = {"a": jnp.ones((4, 8)), "z": jnp.ones((0, 3)), "s": jnp.float32(3.0)}
  tx = ols.dynamic_loss_scale(inner, initial_scale=16.0)
  grads = jax.tree.map(lambda x: x * 0.5, params)
  # copies: a float32 leaf's np.asarray can be a view of a buffer the next
  # step is donated, and reuses
  as_f32 = lambda t: [np.array(x, np.float32) for x in jax.tree.leaves(t)]  # noqa: E731
  with warnings.catch_warnings():
    warnings.simplefilter("error", ols.SkipFallbackWarning)
    step = jax.jit(tx.update, donate_argnums=(1,))
    scaled = jax.tree.map(lambda g: g * 16.0, grads)
    updates, state = step(scaled, tx.init(params), params)
    want_u, want_s = inner.update(grads, inner.init(params), params)
    for got, want in zip(as_f32(state.inner_state), as_f32(want_s), strict=True):
      np.testing.assert_array_equal(got, want)
    for got, want in zip(as_f32(updates), as_f32(want_u), strict=True):
      np.testing.assert_array_equal(got, want)
    kept = as_f32(state.inner_state)
    bad = jax.tree.map(lambda g: g.at[...].set(jnp.nan) if g.size else g, scaled)
    updates, state = step(bad, state, params)
  for got, want in zip(as_f32(state.inner_state), kept, strict=True):
    np.testing.assert_array_equal(got, want)
  assert all(not x.any() for x in as_f32(updates))


class _OwnMastersState(NamedTuple):
  """A state of this test's own that declares the KeepsFloat32Masters role."""

  master: dict
  keeps_float32_masters = True  # a class attribute, not a field


def test_a_state_declaring_float32_masters_gets_float32_gradients():
  from optax_lossscale._base import state_roles

  seen = []

  def update(updates, state, params=None):
    seen.append(jax.tree.map(lambda g: g.dtype, updates))
    return updates, state

  params = {"a": jnp.ones(2, BF16), "b": jnp.ones(2, BF16)}
  # masters of `a` only: `a`'s gradient arrives in float32, `b`'s in bfloat16
  own = optax.GradientTransformation(
    lambda p: _OwnMastersState({"a": p["a"].astype(F32), "b": None}), update
  )
  tx = ols.dynamic_loss_scale(own, initial_scale=4.0)
  state = tx.init(params)
  assert state_roles.keeps_masters(state.inner_state)
  tx.update({"a": jnp.ones(2, BF16), "b": jnp.ones(2, BF16)}, state, params)
  assert seen == [{"a": F32, "b": BF16}]


# What loss_scale_plan prints is what update does: a table over compositions.
PLANS = {
  "adam": (lambda: optax.adam(1e-3), F32, {"a": "own dtype", "b": "own dtype"}),
  "master_weights, bfloat16": (
    lambda: ols.master_weights(optax.adam(1e-3)),
    BF16,
    {"a": "float32", "b": "float32"},
  ),
  "master_weights on one branch": (
    lambda: optax.multi_transform(
      {"x": ols.master_weights(optax.adam(1e-3)), "plain": optax.sgd(0.1)}, LABELS
    ),
    BF16,
    {"a": "float32", "b": "own dtype"},
  ),
  "master_weights(quantize_state)": (
    lambda: ols.master_weights(ols.quantize_state(optax.adam(1e-3), min_size=0)),
    BF16,
    {"a": "float32", "b": "float32"},
  ),
  "master_weights(quantize_state, flat)": (
    lambda: ols.master_weights(
      ols.quantize_state(optax.adam(1e-3), min_size=0, layout="flat")
    ),
    BF16,
    {"a": "float32", "b": "float32"},
  ),
}


# A half-precision state before master_weights (optax.trace in a chain
# before it) holds a leaf's gradients: that leaf is handed over in its own
# dtype, and the plan says so; a float32 state after it changes nothing.
HALF_FIRST = "own dtype (half-precision state first)"
PLANS.update(
  {
    "trace before master_weights": (
      lambda: optax.chain(optax.trace(0.9), ols.master_weights(optax.adam(1e-3))),
      BF16,
      {"a": HALF_FIRST, "b": HALF_FIRST},
    ),
    "trace before master_weights, float16": (
      lambda: optax.chain(
        optax.trace(0.9), ols.master_weights(optax.adam(1e-3), store="float32")
      ),
      F16,
      {"a": HALF_FIRST, "b": HALF_FIRST},
    ),
    "trace of one leaf before master_weights": (
      lambda: optax.chain(
        optax.masked(optax.trace(0.9), {"a": True, "b": False}),
        ols.master_weights(optax.adam(1e-3)),
      ),
      BF16,
      {"a": HALF_FIRST, "b": "float32"},
    ),
    "a half-precision accumulator after master_weights": (
      lambda: optax.chain(
        ols.master_weights(optax.adam(1e-3)),
        optax.trace(0.9, accumulator_dtype=BF16),
      ),
      BF16,
      {"a": "float32", "b": "float32"},
    ),
    "float32 ema_params after master_weights": (
      lambda: optax.chain(ols.master_weights(optax.adam(1e-3)), ols.ema_params(0.9)),
      BF16,
      {"a": "float32", "b": "float32"},
    ),
  }
)


@pytest.mark.parametrize("case", PLANS)
def test_the_printed_plan_is_what_update_does(case):
  make, dtype, expected = PLANS[case]
  seen = []

  def spy(tx):
    def update(updates, state, params=None, **extra):
      seen.append({k: v.dtype for k, v in updates.items()})
      return tx.update(updates, state, params, **extra)

    return optax.GradientTransformationExtraArgs(tx.init, update)

  params = {"a": jnp.ones(4, dtype), "b": jnp.ones(3, dtype)}
  tx = ols.dynamic_loss_scale(spy(make()), initial_scale=4.0)
  half_first = HALF_FIRST in expected.values()
  with (
    pytest.warns(ols.HalfPrecisionStateWarning, match="in float16 too")
    if half_first and dtype == F16  # the momentum in float16
    else contextlib.nullcontext()
  ):
    state = tx.init(params)
  plan = ols.loss_scale_plan(state, params)
  assert {leaf.path: leaf.handed_over for leaf in plan.leaves} == {
    f"['{k}']": v for k, v in expected.items()
  }
  assert all(leaf.dtype == jnp.dtype(dtype).name for leaf in plan.leaves)
  with (
    pytest.warns(ols.HalfPrecisionStateWarning, match="around the whole")
    if half_first
    else contextlib.nullcontext()
  ):
    tx.update(params, state, params)
  # the inner optimizer received float32 exactly where the plan says so
  assert seen == [{k: F32 if v == "float32" else dtype for k, v in expected.items()}]
  quantised = {leaf.path: leaf.quantized_state for leaf in plan.leaves}
  if "quantize_state" in case:
    assert all(len(q) == 2 for q in quantised.values())  # mu and nu
    assert all("blocks of 256" in d for q in quantised.values() for d in q)
  else:
    assert not any(quantised.values())
  table = str(plan)
  assert table.splitlines()[0].split() == [
    "leaf",
    "dtype",
    "handed",
    "over",
    "quantised",
    "state",
  ]
  assert len(table.splitlines()) == 3


def test_the_plan_names_flax_overwrite_leaves_and_refuses_a_state_without_them():
  params = {
    "params": {"w": jnp.ones(3)},
    "_overwrite_with_gradient": {"amax": jnp.zeros(4)},
  }
  tx = ols.dynamic_loss_scale(optax.adam(1e-3))
  plan = ols.loss_scale_plan(tx.init(params), params)
  how = {leaf.path: leaf.handed_over for leaf in plan.leaves}
  assert how == {
    "['_overwrite_with_gradient']['amax']": "overwritten",
    "['params']['w']": "own dtype",
  }
  state = tx.init({"params": params["params"]})
  with pytest.raises(ValueError, match="made without them"):
    ols.loss_scale_plan(state, params)


def test_the_plan_of_a_state_without_a_loss_scale_is_a_clear_error():
  params = {"w": jnp.ones(3)}
  with pytest.raises(ValueError, match="No loss-scale state"):
    ols.loss_scale_plan(optax.adam(1e-3).init(params), params)


def test_no_op_loss_scale_hands_everything_over_as_it_is_and_says_nothing():
  """It unscales nothing: no leaf reaches the inner optimizer in float32, so
  a half-precision state before master_weights changes nothing there."""
  params = {"w": jnp.ones((4, 4), BF16)}
  inner = optax.chain(optax.trace(0.9), ols.master_weights(optax.adam(1e-3)))
  tx = ols.porting.with_loss_scale(inner, ols.porting.NoOpLossScale())
  state = tx.init(params)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _, new = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), state, params)
  assert new.inner_state[0].trace["w"].dtype == BF16
