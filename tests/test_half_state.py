"""float16 parameters told the truth: float16 optimizer state is named.

A loss scale over float16 parameters whose optimizer keeps float16 state
(Adam's moments, a momentum) warns when it is built (``init``), pointing to
``master_weights(..., store="float32")``; and ``check_skipped_steps``
without ``params=`` does not blame the model for parameters the
optimizer's own updates broke.
"""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
import versions

import optax_lossscale as ols

# optax's adam uses mixed-width arithmetic.
pytestmark = pytest.mark.standard_promotion

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32


# (name, inner optimizer factory, parameter dtype, whether init warns)
def _ids(cases):
  return [c.values[0] if hasattr(c, "values") else c[0] for c in cases]


CASES = [
  ("adam float16", lambda: optax.adam(1e-3), F16, True),
  ("sgd momentum float16", lambda: optax.sgd(0.1, momentum=0.9), F16, True),
  (
    "adam then stochastic rounding",
    lambda: optax.chain(optax.adam(1e-3), ols.stochastic_rounding(0)),
    F16,
    True,
  ),
  (
    "a plain branch beside master_weights",
    lambda: optax.multi_transform(
      {
        "m": ols.master_weights(optax.adam(1e-3), store="float32"),
        "p": optax.sgd(0.1, momentum=0.9),
      },
      {"a": "m", "b": "p"},
    ),
    F16,
    True,
  ),
  pytest.param(
    "MultiSteps accumulating in float16",
    lambda: optax.MultiSteps(optax.sgd(0.1), 2, accumulator_dtype=F16),
    F16,
    True,
    marks=versions.multisteps_dtypes,
  ),
  (
    "master_weights float32",
    lambda: ols.master_weights(optax.adam(1e-3), store="float32"),
    F16,
    False,
  ),
  ("sgd without state", lambda: optax.sgd(0.1), F16, False),
  (
    "kahan (float16 by design)",
    lambda: optax.chain(optax.sgd(0.1), ols.kahan_summation()),
    F16,
    False,
  ),
  ("adam bfloat16", lambda: optax.adam(1e-3), BF16, False),
  ("adam float32", lambda: optax.adam(1e-3), F32, False),
]


@pytest.mark.parametrize("name, make, dtype, warns", CASES, ids=_ids(CASES))
@pytest.mark.parametrize("entry", ["dynamic", "static", "jit init"])
def test_float16_state_for_float16_parameters_warns_at_init(
  name, make, dtype, warns, entry
):
  params = {"a": jnp.ones(3, dtype), "b": jnp.ones(2, dtype)}
  if entry == "static":
    tx = ols.static_loss_scale(make(), 2.0**10)
  else:
    tx = ols.dynamic_loss_scale(make())
  init = jax.jit(tx.init) if entry == "jit init" else tx.init
  if warns:
    with pytest.warns(ols.HalfPrecisionStateWarning, match=r"store='float32'"):
      init(params)
  else:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      state = init(params)
    assert [w.category for w in caught] == []  # no warning of any kind
    assert float(ols.get_scale(state)) > 0  # and a state was made


def _broken_run(track_nonfinite):
  """Adam in float16 on float16 parameters: eps=1e-8 and (1 - b2) g**2 are 0
  in float16, the first update divides by zero, the parameters go -inf and
  every later gradient is not finite: the scale falls to its floor."""
  params = {"w": jnp.ones(4, F16)}
  with pytest.warns(ols.HalfPrecisionStateWarning):
    tx = ols.dynamic_loss_scale(
      optax.adam(1e-3), initial_scale=2.0**4, track_nonfinite=track_nonfinite
    )
    state = tx.init(params)
  loss_fn = lambda p: 0.5e-4 * jnp.sum(p["w"].astype(F32) ** 2)  # noqa: E731

  @jax.jit
  def step(params, state):
    _, grads = ols.value_and_grad(loss_fn)(state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(12):
    params, state = step(params, state)
  return params, state


@pytest.mark.parametrize("track_nonfinite", [False, True])
def test_without_params_the_model_is_not_blamed_for_what_an_update_broke(
  track_nonfinite,
):
  params, state = _broken_run(track_nonfinite)
  assert not bool(jnp.all(jnp.isfinite(params["w"])))  # the update broke them
  assert float(ols.get_scale(state)) == 1.0
  with pytest.raises(ols.NonFiniteStepsError) as e:
    ols.check_skipped_steps(state, max_consecutive_skips=8)
  message = str(e.value)
  assert "still not finite: the model produces" not in message  # the old blame
  assert "an applied update made the parameters NaN or inf" in message
  assert "pass params= to tell which" in message
  assert "The optimizer keeps float16 state (at .inner_state[0].mu['w']" in message
  assert "master_weights(optax.adam(...), store='float32')" in message
  # Given the parameters, the optimizer is blamed outright.
  with pytest.raises(
    ols.NonFiniteStepsError, match="Look at the optimizer, not the model"
  ):
    ols.check_skipped_steps(state, max_consecutive_skips=8, params=params)


def test_a_run_that_never_applied_an_update_still_blames_the_model():
  # The record shows every step skipped: nothing the optimizer did.
  params = {"w": jnp.ones(3)}
  tx = ols.dynamic_loss_scale(optax.adam(1e-3), initial_scale=2.0, track_nonfinite=True)
  state = tx.init(params)
  for _ in range(4):
    _, state = tx.update({"w": jnp.full(3, jnp.nan)}, state, params)
  with pytest.raises(
    ols.NonFiniteStepsError, match="still not finite: the model produces NaN"
  ):
    ols.check_skipped_steps(state, max_consecutive_skips=3)
