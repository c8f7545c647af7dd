"""master_weights on 8 devices: Auto and Explicit meshes give one device's bits.

Runs in its own process, with 8 simulated CPU devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/multidevice

Axes: the mesh (``AxisType.Auto``, ``AxisType.Explicit``) x the store
(``"remainder"`` on bfloat16 parameters, ``"float32"`` on bfloat16 and
float16 ones), with leaves sharded by rows, by columns, as a vector, and a
float32 leaf replicated. ``dynamic_loss_scale(master_weights(adamw))`` is
trained under ``jax.jit`` on given half-precision gradients (no reduction
across devices), a non-finite step included: the parameters, the master
weights and the whole state must equal an unsharded run's, bit for bit, and
the skipped step must change nothing.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import versions
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_lossscale as ols

N = 8
if jax.device_count() < N:
  pytest.skip(
    f"needs {N} devices: XLA_FLAGS=--xla_force_host_platform_device_count={N}",
    allow_module_level=True,
  )

pytestmark = pytest.mark.standard_promotion  # optax's adamw, apply_updates

STEPS = 4
BAD_STEP = 2
BF16, F16 = jnp.bfloat16, jnp.float16
HALF = {"remainder": (BF16, BF16), "float32": (BF16, F16)}


def specs(store):
  """name: (shape, dtype, sharding)."""
  a, b = HALF[store]
  return {
    "rows": ((4 * N, 24), a, P("data", None)),
    "cols": ((12, 2 * N), b, P(None, "data")),
    "vec": ((5 * N,), a, P("data")),
    "f32": ((7,), jnp.float32, P()),
  }


def init_params(store):
  rng = np.random.default_rng(0)
  return {k: jnp.asarray(rng.normal(size=s[0]), s[1]) for k, s in specs(store).items()}


def grads(store, step):
  """Gradients of the loss scaled by 2**10: some tiny, NaN at BAD_STEP."""
  rng = np.random.default_rng(100 + step)
  out = {}
  for k, (shape, dtype, _) in specs(store).items():
    g = rng.normal(size=shape) * 10.0 ** rng.uniform(-6, 0, shape) * 2.0**10
    if step == BAD_STEP and k == "vec":
      g[N + 1] = np.nan  # on the second device's shard
    out[k] = jnp.asarray(g, dtype)
  return out


@functools.cache
def run(store, mode, replicated_state=False):
  """(params, state, masters) after each step; ``mode``: None, auto, explicit.

  ``replicated_state``: the state is put on every device whole before the
  first step (as a checkpoint restored without its layout would be), while
  the update makes it sharded as the parameters.
  """
  tx = ols.dynamic_loss_scale(
    ols.master_weights(optax.adamw(1e-2, weight_decay=0.1), store=store),
    initial_scale=2.0**10,
  )
  params = init_params(store)
  step_grads = [grads(store, t) for t in range(STEPS)]
  if mode is None:
    return _train(tx, params, step_grads, None)
  axis = getattr(jax.sharding.AxisType, mode.capitalize())
  mesh = jax.make_mesh((N,), ("data",), axis_types=(axis,))
  shardings = {k: NamedSharding(mesh, s[2]) for k, s in specs(store).items()}
  params = jax.device_put(params, shardings)
  step_grads = [jax.device_put(g, shardings) for g in step_grads]
  with jax.set_mesh(mesh):
    return _train(tx, params, step_grads, shardings, replicated_state)


def _train(tx, params, step_grads, shardings, replicated_state=False):
  kwargs = {} if shardings is None else {"out_shardings": (shardings, None)}

  def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1), **kwargs)
  state = jax.jit(tx.init)(params)
  if replicated_state:
    mesh = shardings["f32"].mesh
    state = jax.device_put(state, NamedSharding(mesh, P()))
  history = []
  for g in step_grads:
    params, state = step(params, state, g)
    masters = ols.get_master_weights(state, params)
    # copies: device_get can give views of the buffers the next step donates
    snapshot = jax.device_get((params, state, masters))
    history.append(jax.tree.map(lambda x: np.array(x, copy=True), snapshot))
  if shardings is not None:  # the parameters stayed sharded
    assert not params["rows"].sharding.is_fully_replicated
    assert not params["cols"].sharding.is_fully_replicated
  return history


def assert_bitwise_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()


MODES = ["auto", pytest.param("explicit", marks=versions.explicit_sharding)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("store", ["remainder", "float32"])
def test_sharded_equals_one_device_bit_for_bit(store, mode):
  sharded, one = run(store, mode), run(store, None)
  assert_bitwise_equal(sharded, one)
  start = init_params(store)
  params, state, masters = sharded[-1]
  assert int(state.skipped_steps) == 1
  for k, p in params.items():  # every leaf trained and stayed finite
    assert not np.array_equal(p, start[k]), k
    assert np.isfinite(masters[k]).all(), k
    assert masters[k].dtype == np.float32
    # the parameter is its master rounded to nearest
    np.testing.assert_array_equal(np.asarray(p), masters[k].astype(p.dtype))
  # the skipped step changed nothing: parameters, masters, inner state
  assert_bitwise_equal(sharded[BAD_STEP][0], sharded[BAD_STEP - 1][0])
  assert_bitwise_equal(sharded[BAD_STEP][2], sharded[BAD_STEP - 1][2])
  assert_bitwise_equal(
    sharded[BAD_STEP][1].inner_state, sharded[BAD_STEP - 1][1].inner_state
  )


@pytest.mark.parametrize("mode", MODES)
# the first step cannot reuse the replicated buffers for sharded ones
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_a_state_in_another_layout_is_taken_in_the_updates(mode):
  # Where the step is skipped, the old state is kept: under explicit
  # sharding it must first take the layout the update gives the new one.
  assert_bitwise_equal(
    run("remainder", mode, replicated_state=True), run("remainder", None)
  )
