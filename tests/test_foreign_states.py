"""States and parameters a low-precision transformation was not made for.

Axes: the entry point (``master_weights`` both stores, alone and under
``dynamic_loss_scale``; ``get_master_weights``; ``stochastic_rounding``;
``kahan_summation``) x what it is handed that does not fit (parameters of
another dtype or shape than the state was made for, a state made by
another transformation or another inner optimizer, a key of another PRNG
implementation, a ``None`` gradient for an array parameter). The answer is
a ``ValueError`` that names the transformation and what to do, and the
arguments are left as they were: never a number read from bits of another
dtype, never an error about another party's internals.

And ``check_skipped_steps`` blames what the state shows: parameters that
were never updated were not finite to begin with; a user already on
``master_weights`` is not told to use it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import versions

import optax_lossscale as ols

pytestmark = pytest.mark.standard_promotion  # optax's adam on half parameters

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def _params(dtype, n=3):
  return {"w": jnp.ones(n, dtype)}


def _mw(store, inner=None):
  return ols.master_weights(inner or optax.adam(1e-3), store=store)


def _scaled(store, inner=None):
  return ols.dynamic_loss_scale(_mw(store, inner), initial_scale=4.0)


# (made with: transformation, its parameters), (updated with: transformation,
# parameters), what the message says.
UPDATES = {
  "remainder state, float16 parameters": (
    (_mw, "remainder", BF16),
    (_mw, "remainder", F16),
    "Use store='float32'",
  ),
  "remainder state, float16 parameters, under a loss scale": (
    (_scaled, "remainder", BF16),
    (_scaled, "remainder", F16),
    "Use store='float32'",
  ),
  "float32 copy, float32 parameters": (
    (_mw, "float32", BF16),
    (_mw, "float32", F32),
    "made for other parameters",
  ),
  "float32 copy, float32 parameters, under a loss scale": (
    (_scaled, "float32", BF16),
    (_scaled, "float32", F32),
    "not made by this loss scale's inner optimizer for these parameters",
  ),
  "remainder state, a float32 copy's update": (
    (_mw, "remainder", BF16),
    (_mw, "float32", BF16),
    "made for other parameters",
  ),
}


@pytest.mark.parametrize("case", UPDATES)
def test_master_weights_refuses_parameters_its_state_was_not_made_for(case):
  (make, store, dtype), (make2, store2, dtype2), message = UPDATES[case]
  state = make(store).init(_params(dtype))
  params = _params(dtype2)
  before = jax.tree.map(np.asarray, (state, params))
  with pytest.raises(ValueError, match=message):
    make2(store2).update(jax.tree.map(jnp.zeros_like, params), state, params)
  after = jax.tree.map(np.asarray, (state, params))
  jax.tree.map(np.testing.assert_array_equal, before, after)


GET = {
  "a float32 parameter for a float32 copy": ("float32", BF16, _params(F32)),
  "a float16 parameter for a remainder": ("remainder", BF16, _params(F16)),
  "another shape": ("remainder", BF16, _params(BF16, 4)),
  "a float16 parameter for a bfloat16's copy": ("float32", BF16, _params(F16, 4)),
  "another tree": ("remainder", BF16, {"v": jnp.ones(3, BF16)}),
}


@pytest.mark.parametrize("case", GET)
def test_get_master_weights_refuses_parameters_that_do_not_fit(case):
  store, dtype, params = GET[case]
  state = _mw(store).init({"w": jnp.array([1.0, 2.0, 3.0], dtype)})
  with pytest.raises(ValueError, match="get_master_weights: .*(params|parameters)"):
    ols.get_master_weights(state, params)


# (the dtype kahan_summation's state was made for, the parameters' dtype):
# a compensation kept for bfloat16 parameters was silently dropped once they
# were float32 (promoted by an apply_updates that does not cast back).
KAHAN_DTYPES = {
  "bfloat16 state, float32 parameters": (BF16, F32),
  "bfloat16 state, float16 parameters": (BF16, F16),
  "float32 state, bfloat16 parameters": (F32, BF16),
}


@pytest.mark.parametrize("case", KAHAN_DTYPES)
def test_kahan_summation_refuses_parameters_its_state_was_not_made_for(case):
  made, used = KAHAN_DTYPES[case]
  tx = ols.kahan_summation()
  state, params = tx.init(_params(made)), _params(used)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3, F32), params)
  with pytest.raises(ValueError, match="kahan_summation: .*made for other parameters"):
    tx.update(grads, state, params)
  with pytest.raises(ValueError, match="made for other parameters"):
    jax.jit(tx.update)(grads, state, params)


def _sr_rbg():
  return ols.stochastic_rounding(jax.random.key(0, impl="rbg"))


# transformation, a state it did not make, the message
FOREIGN = {
  "master_weights, adam's own state": (
    _mw("remainder"),
    lambda p: optax.adam(1e-3).init(p),
    "master_weights: the state is a tuple, not a MasterWeightsState",
  ),
  "master_weights(sgd momentum), master_weights(adam)'s state": (
    _mw("remainder", optax.sgd(0.1, momentum=0.9)),
    lambda p: _mw("remainder").init(p),
    "not made by master_weights's inner optimizer",
  ),
  "stochastic_rounding, kahan's state": (
    ols.stochastic_rounding(0),
    lambda p: ols.kahan_summation().init(p),
    "stochastic_rounding: the state is a KahanSummationState",
  ),
  "kahan_summation, stochastic rounding's state": (
    ols.kahan_summation(),
    lambda p: ols.stochastic_rounding(0).init(p),
    "kahan_summation: the state is a StochasticRoundingState",
  ),
  "stochastic_rounding(rbg key), a threefry key's state": (
    _sr_rbg(),
    lambda p: ols.stochastic_rounding(0).init(p),
    "key of another PRNG implementation",
  ),
  "kahan_summation, a state made for other parameters": (
    ols.kahan_summation(),
    lambda p: ols.kahan_summation().init({"v": p["w"]}),
    "kahan_summation: the state's tree does not match",
  ),
  "master_weights, a state made for other parameters": (
    _mw("remainder"),
    lambda p: _mw("remainder").init({"w": p["w"], "v": p["w"]}),
    "master_weights: the state's tree does not match",
  ),
}


@pytest.mark.parametrize("case", FOREIGN)
def test_a_state_another_transformation_made_is_named(case):
  tx, foreign, message = FOREIGN[case]
  params = _params(BF16)
  with pytest.raises(ValueError, match=message):
    tx.update(jax.tree.map(jnp.zeros_like, params), foreign(params), params)


@versions.adam_refuses_none
@pytest.mark.parametrize(
  "tx", [_mw("remainder"), _scaled("remainder")], ids=["alone", "loss scale"]
)
def test_a_none_gradient_is_named_by_master_weights(tx):
  params = {"w": jnp.ones(3, BF16), "b": jnp.ones(2, BF16)}
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"gradient at \['b'\] is None"):
    tx.update({"w": jnp.ones(3, BF16), "b": None}, state, params)


def _skipping_run(tx, params, steps=5):
  """Steps whose gradients are NaN (the parameters' NaN reaches them)."""
  state = tx.init(params)
  f = lambda p: jnp.sum(p["w"].astype(F32) ** 2)  # noqa: E731
  for _ in range(steps):
    loss, grads = ols.value_and_grad(f)(state, params)
    updates, state = tx.update(grads, state, params, value=loss)
    params = optax.apply_updates(params, updates)
  return state, params


def test_parameters_never_updated_were_not_finite_to_begin_with():
  tx = ols.dynamic_loss_scale(_mw("remainder"), track_nonfinite=True, initial_scale=4.0)
  state, params = _skipping_run(tx, {"w": jnp.array([1.0, jnp.nan], BF16)})
  with pytest.raises(ols.NonFiniteStepsError) as e:
    ols.check_skipped_steps(state, max_consecutive_skips=3, params=params)
  message = str(e.value)
  assert "no update was ever applied (all 5 steps were skipped)" in message
  assert "not finite to begin with" in message
  assert "update was not" not in message and "master_weights(" not in message


def test_a_user_on_master_weights_is_not_told_to_use_it():
  # One applied step, then parameters that are not finite (set here, as a
  # diverging update would leave them): the optimizer is the suspect, and
  # the advice is not the recipe already in use.
  tx = ols.dynamic_loss_scale(_mw("remainder"), track_nonfinite=True, initial_scale=4.0)
  params = {"w": jnp.ones(2, BF16)}
  state = tx.init(params)
  _, state = tx.update({"w": jnp.ones(2, BF16)}, state, params)
  params = {"w": jnp.array([1.0, jnp.nan], BF16)}
  state, params = _skipping_run(tx._replace(init=lambda p: state), params)
  with pytest.raises(ols.NonFiniteStepsError) as e:
    ols.check_skipped_steps(state, max_consecutive_skips=3, params=params)
  message = str(e.value)
  assert "the loss was finite but the optimizer's update was not" in message
  assert "master_weights(" not in message and "learning rate" in message
