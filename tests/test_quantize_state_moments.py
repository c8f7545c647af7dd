"""quantize_state quantises moments only: a table over optimizers.

For each optimizer, the leaves quantised are exactly those of its moment
fields; every other leaf (a copy of the parameters, a hyper-parameter, a
counter) is what the inner optimizer computes from the dequantised state,
bit for bit, after each update. Then ``select``, and the errors.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols
from optax_lossscale._params import moments

pytestmark = pytest.mark.standard_promotion  # optax's optimizers


def _params():
  rng = np.random.default_rng(0)
  return {
    "w": jnp.asarray(rng.normal(size=(16, 32)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(512,)), jnp.float32),
    "s": jnp.asarray(0.5, jnp.float32),  # a scalar: a hyper-parameter's shape
  }


def _grads(params, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32) * 1e-2, params
  )


def _lookahead_params(p):
  return optax.LookaheadParams(p, jax.tree.map(lambda x: x + 1.0, p))


# name: (the inner optimizer, its moment fields, parameters from _params()).
OPTIMIZERS = {
  "adam": (lambda: optax.adam(1e-2), {"mu", "nu"}, None),
  "sgd momentum": (lambda: optax.sgd(1e-2, momentum=0.9), {"trace"}, None),
  "rmsprop": (lambda: optax.rmsprop(1e-2), {"nu"}, None),
  "adagrad": (lambda: optax.adagrad(1e-2), {"sum_of_squares"}, None),
  "lion": (lambda: optax.lion(1e-3), {"mu"}, None),
  "adafactor (its unfactored v)": (lambda: optax.adafactor(1e-2), {"v"}, None),
  "adam + ema_params": (
    lambda: optax.chain(optax.adam(1e-2), ols.ema_params(0.9)),
    {"mu", "nu"},
    None,
  ),
  "lookahead(adam)": (
    lambda: optax.lookahead(optax.adam(1e-2), 2, 0.5),
    {"mu", "nu"},
    _lookahead_params,
  ),
  "schedule_free_adamw": (
    lambda: optax.contrib.schedule_free_adamw(1e-2),
    {"mu", "nu"},
    None,
  ),
  "prodigy": (lambda: optax.contrib.prodigy(1.0), {"exp_avg", "exp_avg_sq"}, None),
  "inject_hyperparams(adam)": (
    lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2, b1=0.9),
    {"mu", "nu"},
    None,
  ),
}


def _field_names(path):
  return {k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)}


def _leaves(state):
  return jax.tree_util.tree_flatten_with_path(
    state, is_leaf=lambda x: isinstance(x, ols.QuantizedLeaf)
  )[0]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_moments_are_quantised_and_everything_else_is_exact(name):
  make, fields, wrap = OPTIMIZERS[name]
  params = _params()
  if wrap is not None:
    params = wrap(params)
  inner = make()
  tx = ols.quantize_state(inner, min_size=0)
  state = tx.init(params)
  update = jax.jit(tx.update)
  # The inner update on the dequantised state, compiled as quantize_state's
  # update is (its arithmetic fused alike).
  inner_update = jax.jit(lambda g, s, p: inner.update(g, ols.dequantize_state(s), p))
  for seed in range(3):
    grads = _grads(params.fast if wrap else params, seed)
    quantised = [
      (path, x) for path, x in _leaves(state) if isinstance(x, ols.QuantizedLeaf)
    ]
    assert quantised, name
    for path, x in _leaves(state):
      is_moment = bool(_field_names(path) & fields)
      assert isinstance(x, ols.QuantizedLeaf) == is_moment, jax.tree_util.keystr(path)
    # The rest is the inner optimizer's update of the dequantised state.
    want_updates, want = inner_update(grads, state, params)
    updates, state = update(grads, state, params)
    np.testing.assert_array_equal(
      np.concatenate([np.ravel(u) for u in jax.tree.leaves(updates)]),
      np.concatenate([np.ravel(u) for u in jax.tree.leaves(want_updates)]),
    )
    kept = [x for _, x in _leaves(state) if not isinstance(x, ols.QuantizedLeaf)]
    want_kept = [x for (path, x) in _leaves(want) if not (_field_names(path) & fields)]
    assert len(kept) == len(want_kept)
    for got, exp in zip(kept, want_kept, strict=True):
      np.testing.assert_array_equal(got, exp)
    params = optax.apply_updates(params, updates)


def test_hyperparameters_stay_numbers_that_can_be_set():
  params = _params()
  tx = ols.quantize_state(
    optax.inject_hyperparams(optax.adam)(learning_rate=1e-2), min_size=0
  )
  state = tx.init(params)
  assert ols.porting.get_learning_rate(state).dtype == jnp.float32
  state = ols.porting.set_learning_rate(state, 0.0)
  updates, state = jax.jit(tx.update)(_grads(params, 0), state, params)
  assert not any(np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  assert float(ols.porting.get_learning_rate(state)) == 0.0


def test_select_chooses_the_leaves_any_shape():
  params = {"w": jnp.ones((256, 384)), "b": jnp.ones(512)}
  factored = optax.adafactor(1e-2)
  # Adafactor's factored rows and columns: not the parameters' shapes.
  tx = ols.quantize_state(
    factored,
    min_size=16,
    select=lambda path, leaf: bool(_field_names(path) & {"v_row", "v_col"}),
  )
  state = tx.init(params)
  got = {
    jax.tree_util.keystr(p)
    for p, x in _leaves(state.inner_state)
    if isinstance(x, ols.QuantizedLeaf)
  }
  # "b" is not factored: its rows and columns are placeholders of one element.
  assert got == {"[0].v_row['w']", "[0].v_col['w']"}, got
  assert isinstance(state.inner_state[0].v["w"], jax.Array)  # not selected
  updates, state = jax.jit(tx.update)(_grads(params, 0), state, params)
  assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))


def _unknown_state_optimizer():
  """A transformation whose state (a dict) no listed type holds."""

  def init(params):
    return {"velocity": jax.tree.map(jnp.zeros_like, params)}

  def update(updates, state, params=None):
    v = jax.tree.map(lambda v, g: 0.9 * v + g, state["velocity"], updates)
    return jax.tree.map(lambda v: -1e-2 * v, v), {"velocity": v}

  return optax.GradientTransformation(init, update)


def test_a_state_it_does_not_know_is_an_error_naming_the_leaves_or_selected():
  params = _params()
  with pytest.raises(ValueError, match=r"\['velocity'\]\['b'\].*select="):
    ols.quantize_state(_unknown_state_optimizer(), min_size=0).init(params)
  tx = ols.quantize_state(
    _unknown_state_optimizer(),
    min_size=0,
    select=lambda path, leaf: jax.tree_util.keystr(path).startswith("['velocity']"),
  )
  state = tx.init(params)
  assert all(
    isinstance(x, ols.QuantizedLeaf) for x in state.inner_state["velocity"].values()
  )
  jax.jit(tx.update)(_grads(params, 0), state, params)


class _Velocity(NamedTuple):
  v: Any


def _unknown_named_state_optimizer():
  """A transformation whose state is a named tuple of a type not listed."""

  def init(params):
    return _Velocity(jax.tree.map(jnp.zeros_like, params))

  def update(updates, state, params=None):
    v = jax.tree.map(lambda v, g: 0.9 * v + g, state.v, updates)
    return jax.tree.map(lambda v: -1e-2 * v, v), _Velocity(v)

  return optax.GradientTransformation(init, update)


# An unknown state inside a wrapper whose own state is listed is as unknown as
# alone: the error, not a state silently kept in float32.
WRAPPERS = {
  "alone": lambda inner: inner,
  "inject_hyperparams": lambda inner: optax.inject_hyperparams(lambda lr: inner)(
    lr=1e-2
  ),
  "MultiSteps": lambda inner: optax.MultiSteps(inner, 2).gradient_transformation(),
  "lookahead": lambda inner: optax.lookahead(inner, 2, 0.5),
  "chain": lambda inner: optax.chain(optax.clip_by_global_norm(1.0), inner),
}


@pytest.mark.parametrize("state", ["dict", "named tuple"])
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_state_it_does_not_know_inside_a_wrapper_it_knows_is_an_error(wrapper, state):
  make = {
    "dict": _unknown_state_optimizer,
    "named tuple": _unknown_named_state_optimizer,
  }
  inner = WRAPPERS[wrapper](make[state]())
  params = _params()
  if wrapper == "lookahead":
    params = optax.LookaheadParams.init_synced(params)
  with pytest.raises(ValueError, match=r"\['b'\].*select="):
    ols.quantize_state(inner, min_size=0).init(params)
  with pytest.raises(ValueError, match=r"\['b'\].*select="):
    ols.quantize_state(inner, min_size=0, layout="flat").init(params)


@pytest.mark.parametrize(
  "select, match",
  [
    ("mu", "`select` must be None or a function"),
    (lambda path, leaf: jnp.asarray(True), "select must return True or False"),
    (lambda path, leaf: 1, "select must return True or False"),
  ],
  ids=["not callable", "an array", "an int"],
)
def test_a_bad_select_is_refused(select, match):
  with pytest.raises(ValueError, match=match):
    ols.quantize_state(optax.adam(1e-3), select=select).init(_params())


def test_every_listed_state_type_names_its_own_fields():
  # A typo in the table would quantise nothing, silently.
  for cls, (fields, inner) in moments._types().items():
    assert fields <= set(cls._fields), (cls, fields)
    assert inner is None or inner in cls._fields, (cls, inner)
