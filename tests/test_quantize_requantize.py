"""quantize_state encoding again: what an update leaves stays, what moves draws anew.

* An inner transformation that leaves its state as it was (a step
  ``optax.apply_if_finite`` skips, ``optax.MultiSteps``' micro-steps) leaves
  the quantised state bit for bit: its codes and scales, in every dtype,
  rounding and layout. Encoding such a block again would move a float32
  block's scale by a unit in the last place each time (where its least
  value is its largest magnitude), and, rounding stochastically, a
  half-precision block's codes at random (its scale is its rounded extreme).
* Stochastic rounding draws new random numbers at each update (they hash
  the state's step count): a moment that moves by less than its codes' gap
  a step, in a block whose scale another element holds fixed, keeps moving
  as float32 does. Random numbers of the element's index and value alone
  would be the same at every step for the same value, and such a moment
  would stand still wherever its first draw kept its code.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

pytestmark = pytest.mark.standard_promotion  # optax's adam

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

#: Inner transformations whose update can leave their state as it was, and
#: the gradients of a step where it does: (transformation, grads -> skipped
#: step's grads, steps to run before).
IDLE = {
  "apply_if_finite, a skipped step": (
    lambda: optax.apply_if_finite(optax.adam(1e-3), 1000),
    lambda g: jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), g),
    2,
  ),
  "MultiSteps, a micro-step": (
    lambda: optax.MultiSteps(optax.adam(1e-3), 1000),
    lambda g: g,
    0,
  ),
}


def _grads(dtype, seed=0):
  k = jax.random.split(jax.random.key(seed), 2)
  return {
    "w": jax.random.normal(k[0], (64, 256)).astype(dtype),
    # a last block padded; the least value the largest magnitude in some
    "v": (jax.random.normal(k[1], (3000,)) - 0.5).astype(dtype),
  }


def _stored(state):
  """The quantised leaves' codes and scales (the flat layout's groups), as bytes."""
  is_q = lambda x: isinstance(x, ols.QuantizedLeaf)  # noqa: E731
  stored = [x for x in jax.tree.leaves(state, is_leaf=is_q) if is_q(x)]
  return [np.asarray(a).tobytes() for q in stored for a in (q.codes, q.scales)]


@pytest.mark.sampled
@pytest.mark.parametrize("layout", ["leaf", "flat"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner", IDLE)
def test_an_update_that_leaves_the_inner_state_leaves_the_quantised_state(
  inner, dtype, rounding, layout
):
  make, idle_grads, warm = IDLE[inner]
  dtype = DTYPES[dtype]
  tx = ols.quantize_state(make(), rounding=rounding, layout=layout, min_size=256)
  params = jax.tree.map(jnp.zeros_like, _grads(dtype))
  update = jax.jit(tx.update)
  state = tx.init(params)
  for t in range(warm):  # moments of both signs
    state = update(_grads(dtype, t), state, params)[1]
  if not warm:  # MultiSteps: its moments made by a real step, then micro-steps
    state = _with_moments(tx, state, params, dtype)
  before = _stored(state)
  assert len(before) == (4 if layout == "flat" else 8)
  assert all(np.frombuffer(b, np.uint8).any() for b in before)  # moments, not zeros
  for t in range(8):
    state = update(idle_grads(_grads(dtype, 10 + t)), state, params)[1]
  assert _stored(state) == before


def _with_moments(tx, state, params, dtype):
  """``state`` (MultiSteps' at its first micro-step) with Adam's moments of a
  real step: the inner state of a one-step MultiSteps, quantised alike."""
  one = ols.quantize_state(
    optax.MultiSteps(optax.adam(1e-3), 1),
    rounding=tx.rounding,
    layout=tx.layout,
    min_size=tx.min_size,
  )
  stepped = one.update(_grads(dtype), one.init(params), params)[1]
  inner = stepped.inner_state._replace(
    mini_step=state.inner_state.mini_step,
    gradient_step=state.inner_state.gradient_step,
  )
  return stepped._replace(inner_state=inner)


#: The decay a step of the moments below: 1 - 2**-7, exact in float32, so
#: that a moment of 1 with a gradient of 1 stays exactly 1.
DECAY = 1 - 2.0**-7

#: Moments that decay by ``DECAY`` a step once their gradient stops, and
#: the gradient that keeps a moment of 1 at 1.
DECAYING = {
  "lion": (lambda: optax.lion(1e-4, b2=DECAY), 1.0),
  "sgd, momentum": (lambda: optax.sgd(1e-4, momentum=DECAY), 1 - DECAY),
  "adam": (lambda: optax.adam(1e-4, b1=DECAY, b2=1 - 2.0**-10), 1.0),
}

N = 4096
HEAD = np.arange(N) % 256 == 0  # one element a block: its moment stays 1


def _preset(inner):
  """``inner`` whose moments start at 1 at the blocks' heads, 0.5 elsewhere."""

  def init(params):
    preset = jnp.where(HEAD, 1.0, 0.5)
    return jax.tree.map(
      lambda x: preset if np.shape(x) == (N,) else x, inner.init(params)
    )

  return optax.GradientTransformation(init, inner.update)


def _decayed(init_tx, tx, steps, head_grad=1.0):
  """The mean of the moment's ratio to its start after ``steps`` steps of a
  gradient of ``head_grad`` at the heads (each block's scale stays 1) and 0
  elsewhere, and the fraction of entries that did not move."""
  params = {"w": jnp.zeros(N)}
  g = {"w": jnp.where(HEAD, head_grad, 0.0)}

  @jax.jit
  def run(state):
    return jax.lax.fori_loop(0, steps, lambda _, s: tx.update(g, s, params)[1], state)

  def moment(state):
    return np.asarray(
      next(
        x for x in jax.tree.leaves(ols.dequantize_state(state)) if np.shape(x) == (N,)
      )
    )[~HEAD]

  state = init_tx.init(params)
  before, after = moment(state), moment(run(state))
  return float(np.mean(after / before)), float(np.mean(after == before))


@pytest.mark.parametrize("layout", ["leaf", "flat"])
@pytest.mark.parametrize("name", DECAYING)
def test_stochastic_rounding_draws_anew_each_step(name, layout):
  make, head_grad = DECAYING[name]
  tx = ols.quantize_state(_preset(make()), rounding="stochastic", layout=layout)
  ratio, unchanged = _decayed(tx, tx, 60, head_grad)
  assert unchanged < 0.01
  assert ratio == pytest.approx(DECAY**60, rel=0.05)


def test_adam_8bits_stochastic_rounding_draws_anew_each_step():
  tx = ols.adam_8bit(1e-4, b1=DECAY, b2=1 - 2.0**-10, rounding="stochastic")
  # its state is quantize_state(optax.adam)'s: one made with the preset moments
  init_tx = ols.quantize_state(_preset(DECAYING["adam"][0]()), rounding="stochastic")
  ratio, unchanged = _decayed(init_tx, tx, 60)
  assert unchanged < 0.01
  assert ratio == pytest.approx(DECAY**60, rel=0.05)


STATES = {
  ("leaf", "nearest"): ols.QuantizedState,
  ("flat", "nearest"): ols.FlatQuantizedState,
  ("leaf", "stochastic"): ols.StochasticQuantizedState,
  ("flat", "stochastic"): ols.StochasticFlatQuantizedState,
}


@pytest.mark.parametrize("layout", ["leaf", "flat"])
def test_stochastic_rounding_keeps_a_step_of_its_own(layout):
  params = {"w": jnp.zeros((64, 256))}
  g = {"w": jnp.ones((64, 256))}
  nearest = ols.quantize_state(optax.adam(1e-3), layout=layout)
  state = nearest.init(params)
  assert type(state) is STATES[layout, "nearest"]  # release 0.1's form
  stochastic = ols.quantize_state(
    optax.adam(1e-3), rounding="stochastic", layout=layout
  )
  state = stochastic.init(params)
  assert type(state) is STATES[layout, "stochastic"]
  assert state.rounding_step.dtype == jnp.int32 and int(state.rounding_step) == 0
  for _ in range(3):
    state = jax.jit(stochastic.update)(g, state, params)[1]
  assert int(state.rounding_step) == 3
  # optax reads the step of the optimizer, not the rounding's
  assert int(optax.tree_utils.tree_get(state, "count")) == 3
  # it wraps: the random numbers need a new step, not an order
  state = state._replace(rounding_step=jnp.int32(2**31 - 1))
  state = stochastic.update(g, state, params)[1]
  assert int(state.rounding_step) == -(2**31)
  # a map to None (Orbax, equinox's partition) keeps the structure
  nones = jax.tree.map(lambda x: None, state)
  assert jax.tree.structure(jax.tree.map(lambda x, _: x, state, nones)) == (
    jax.tree.structure(state)
  )
  # a state without the step (release 0.1's, or a nearest one's) is refused,
  # naming the conversion, which works
  old = STATES[layout, "nearest"](*state[:-1])
  with pytest.raises(ValueError, match=r"without the step.*rounding_step=jnp.zeros"):
    stochastic.update(g, old, params)
  converted = STATES[layout, "stochastic"](*old, rounding_step=jnp.zeros((), jnp.int32))
  stochastic.update(g, converted, params)
  # and a nearest transformation refuses a stochastic state
  with pytest.raises(ValueError):
    nearest.update(g, state, params)


NOT_STEPS = {
  "a float32 array": jnp.float32(3.0),
  "a Python float": 3.0,
  "a bool": True,
  "a boolean array": jnp.array(True),
  "a vector": jnp.zeros(2, jnp.int32),
  "None": None,
}


@pytest.mark.parametrize("what", NOT_STEPS)
@pytest.mark.parametrize(
  "make",
  [
    lambda: ols.quantize_state(optax.adam(1e-3), rounding="stochastic"),
    lambda: ols.quantize_state(optax.adam(1e-3), rounding="stochastic", layout="flat"),
    lambda: ols.adam_8bit(1e-3, rounding="stochastic"),
  ],
  ids=["leaf", "flat", "adam_8bit"],
)
def test_a_step_that_is_not_an_integer_scalar_is_refused(make, what):
  """A float step would be cast (3.7 hashed as 3) and a vector broadcast
  into other random numbers: the state is refused, eagerly and under jit."""
  params = {"w": jnp.zeros((64, 256))}
  g = {"w": jnp.ones((64, 256))}
  tx = make()
  state = tx.init(params)
  bad = state._replace(rounding_step=NOT_STEPS[what])
  with pytest.raises(ValueError, match="rounding_step must be an integer scalar"):
    tx.update(g, bad, params)
  if what != "None":
    with pytest.raises(ValueError, match="rounding_step must be an integer scalar"):
      jax.jit(tx.update)(g, bad, params)
  # integer scalars of any width are steps (a restored int64, a Python int)
  for step in (5, np.int64(5), jnp.uint32(5)):
    new = tx.update(g, state._replace(rounding_step=step), params)[1]
    assert new.rounding_step.dtype == jnp.int32 and int(new.rounding_step) == 6


def test_a_skipped_step_keeps_the_step_count():
  params = {"w": jnp.zeros((64, 256))}
  tx = ols.dynamic_loss_scale(
    ols.quantize_state(optax.adam(1e-3), rounding="stochastic")
  )
  state = tx.init(params)
  state = tx.update({"w": jnp.ones((64, 256))}, state, params)[1]
  nan = {"w": jnp.full((64, 256), jnp.nan)}
  skipped = tx.update(nan, state, params)[1]
  assert [np.asarray(x).tobytes() for x in jax.tree.leaves(skipped.inner_state)] == [
    np.asarray(x).tobytes() for x in jax.tree.leaves(state.inner_state)
  ]
