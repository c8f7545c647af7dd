"""quantize_state on 8 devices: Auto and Explicit meshes give one device's bits.

Runs in its own process, with 8 simulated CPU devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/multidevice

``dynamic_loss_scale(quantize_state(adam))`` is trained under ``jax.jit``
with donated buffers on given gradients, a non-finite step included, with
leaves sharded by rows, by columns (each device's columns whole blocks, and
a block spanning two devices' columns), as a vector, and a small float32
leaf replicated (not quantised). The parameters and the whole state (codes,
scales) must equal an unsharded run's bit for bit; the codes keep the
parameters' sharding; the skipped step changes nothing.
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

pytestmark = pytest.mark.standard_promotion  # optax's adam, apply_updates

STEPS = 4
BAD_STEP = 2
SPECS = {  # name: (shape, sharding)
  "rows": ((4 * N, 512), P("data", None)),
  "cols": ((16, 256 * N), P(None, "data")),
  "straddle": ((64, 128 * N), P(None, "data")),  # a block spans two devices
  "vec": ((512 * N,), P("data")),
  "small": ((7,), P()),
}


def init_params():
  rng = np.random.default_rng(0)
  return {
    k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, (s, _) in SPECS.items()
  }


def grads(step):
  rng = np.random.default_rng(100 + step)
  out = {}
  for k, (shape, _) in SPECS.items():
    g = rng.normal(size=shape) * 10.0 ** rng.uniform(-6, 0, shape) * 2.0**10
    if step == BAD_STEP and k == "vec":
      g[512 + 1] = np.nan  # on the second device's shard
    out[k] = jnp.asarray(g, jnp.float32)
  return out


@functools.cache
def run(mode, store_sqrt=False, loss_scale=True, rounding="nearest", fused=False):
  make = (
    ols.adam_8bit
    if fused
    else lambda lr, **kw: ols.quantize_state(optax.adam(lr), **kw)
  )
  tx = make(1e-2, min_size=1024, store_sqrt=store_sqrt, rounding=rounding)
  if loss_scale:
    tx = ols.dynamic_loss_scale(tx, initial_scale=2.0**10)
  params = init_params()
  step_grads = [grads(t) for t in range(STEPS)]
  if mode is None:
    return _train(tx, params, step_grads, None)
  axis = getattr(jax.sharding.AxisType, mode.capitalize())
  mesh = jax.make_mesh((N,), ("data",), axis_types=(axis,))
  shardings = {k: NamedSharding(mesh, s) for k, (_, s) in SPECS.items()}
  params = jax.device_put(params, shardings)
  step_grads = [jax.device_put(g, shardings) for g in step_grads]
  with jax.set_mesh(mesh):
    return _train(tx, params, step_grads, shardings)


def _train(tx, params, step_grads, shardings):
  kwargs = {} if shardings is None else {"out_shardings": (shardings, None)}

  def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1), **kwargs)
  state = jax.jit(tx.init)(params)
  history = []
  for g in step_grads:
    params, state = step(params, state, g)
    if shardings is not None:
      adam = state.inner_state if isinstance(state, ols.LossScaleState) else state
      adam = adam.inner_state[0]
      for k in ("rows", "cols", "straddle", "vec"):
        for moment in (adam.mu[k], adam.nu[k]):
          assert isinstance(moment, ols.QuantizedLeaf)
          # the codes lie as the parameter does: each device its own blocks
          ndim = len(SPECS[k][0])
          assert moment.codes.sharding.is_equivalent_to(params[k].sharding, ndim)
    # copies: device_get can give views of the buffers the next step donates
    snapshot = jax.device_get((params, state))
    history.append(jax.tree.map(lambda x: np.array(x, copy=True), snapshot))
  return history


def assert_bitwise_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()


MODES = ["auto", pytest.param("explicit", marks=versions.explicit_sharding)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("store_sqrt", [False, True])
def test_sharded_equals_one_device_bit_for_bit(mode, store_sqrt):
  sharded, one = run(mode, store_sqrt), run(None, store_sqrt)
  assert_bitwise_equal(sharded, one)
  start = init_params()
  params, state = sharded[-1]
  assert int(state.skipped_steps) == 1
  for k, p in params.items():  # every leaf trained and stayed finite
    assert not np.array_equal(p, start[k]), k
    assert np.isfinite(p).all(), k
  # the skipped step changed nothing: parameters, the quantised state
  before, after = sharded[BAD_STEP - 1], sharded[BAD_STEP]
  assert_bitwise_equal(after[0], before[0])
  assert_bitwise_equal(after[1].inner_state, before[1].inner_state)


@pytest.mark.parametrize("mode", MODES)
def test_square_roots_without_a_loss_scale_equal_one_device(mode):
  sharded = run(mode, store_sqrt=True, loss_scale=False)
  one = run(None, store_sqrt=True, loss_scale=False)
  # the step before the NaN gradients (which make NaN parameters)
  assert_bitwise_equal(sharded[:BAD_STEP], one[:BAD_STEP])


@pytest.mark.parametrize("mode", MODES)
def test_stochastic_rounding_sharded_equals_one_device(mode):
  # Each element's random number hashes its index in the whole leaf and its
  # value: the same on any sharding.
  sharded = run(mode, rounding="stochastic")
  assert_bitwise_equal(sharded, run(None, rounding="stochastic"))
  nearest = run(None)
  is_q = lambda x: isinstance(x, ols.QuantizedLeaf)  # noqa: E731
  codes = lambda h: [
    x.codes for x in jax.tree.leaves(h[-1][1], is_leaf=is_q) if is_q(x)
  ]  # noqa: E731
  pairs = zip(codes(sharded), codes(nearest), strict=True)
  assert any(not np.array_equal(a, b) for a, b in pairs)


@pytest.mark.parametrize("mode", MODES)
def test_adam_8bit_sharded_keeps_one_devices_state(mode):
  # Its blocks are cut by the shards as quantize_state's are (each leaf's
  # blocks computed in place, or as quantize_state computes an explicitly
  # sharded one): every step's state is quantize_state's on one device, bit
  # for bit. The parameters: XLA rounds the bias corrections' divisions as
  # it rewrites each program (test_adam_8bit.py), each update within 6
  # units in its last place of the other's; Adam's updates do not read the
  # parameters, so they part by at most that and a rounding of the sum a step.
  sharded, one = run(mode, fused=True), run(None)
  assert_bitwise_equal([s for _, s in sharded], [s for _, s in one])
  start = init_params()
  for k in start:
    gap = np.zeros(start[k].shape, np.float32)
    before = np.asarray(start[k])
    for (p, _), (q, _) in zip(sharded, one, strict=True):
      p, q = np.asarray(p[k]), np.asarray(q[k])
      update = np.abs(q - before)
      gap = gap + 6 * np.spacing(update) + np.spacing(np.abs(q))
      finite = np.isfinite(q)
      assert np.all(np.abs(p - q)[finite] <= gap[finite]), k
      assert np.array_equal(np.isfinite(p), finite), k
      before = q


def _flat_history(params, step_grads):
  tx = ols.dynamic_loss_scale(
    ols.quantize_state(optax.adam(1e-2), min_size=1024, layout="flat"),
    initial_scale=2.0**10,
  )

  @jax.jit
  def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  state = jax.jit(tx.init)(params)
  history = []
  for g in step_grads:
    params, state = step(params, state, g)
    history.append(jax.device_get((params, state)))
  return history


def test_the_flat_layout_under_automatic_sharding_keeps_one_devices_state():
  # The flat layout's buffers are not sharded as the parameters are (the
  # guide says so), but its state is one device's, bit for bit. The
  # parameters differ by a rounding a step at most (of the parameter, or of
  # the update, which is below ten times the learning rate, 0.1): the
  # partitioned program fuses the update's last multiply with the addition
  # to the parameters (an FMA) where one device's does not, in a few entries.
  mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  shardings = {k: NamedSharding(mesh, s) for k, (_, s) in SPECS.items()}
  step_grads = [grads(t) for t in range(STEPS)]
  one = _flat_history(init_params(), step_grads)
  sharded = _flat_history(
    jax.device_put(init_params(), shardings),
    [jax.device_put(g, shardings) for g in step_grads],
  )
  assert_bitwise_equal([s for _, s in sharded], [s for _, s in one])
  for t, ((p_sharded, _), (p_one, _)) in enumerate(zip(sharded, one, strict=True)):
    for k in p_one:
      np.testing.assert_allclose(
        p_sharded[k],
        p_one[k],
        rtol=(t + 1) * np.finfo(np.float32).eps,
        atol=(t + 1) * np.spacing(np.float32(0.1)),
      )
  assert int(one[-1][1].skipped_steps) == 1


@versions.explicit_sharding
def test_the_flat_layout_refuses_explicitly_sharded_leaves():
  mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  shardings = {k: NamedSharding(mesh, s) for k, (_, s) in SPECS.items()}
  params = jax.device_put(init_params(), shardings)
  tx = ols.quantize_state(optax.adam(1e-2), min_size=1024, layout="flat")
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="layout='leaf'"):
    tx.init(params)
  # and update, where the state was made on unsharded parameters
  state = tx.init(init_params())
  for sharded in ("gradients", "params"):
    grads = params if sharded == "gradients" else init_params()
    given = params if sharded == "params" else init_params()
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="layout='leaf'"):
      jax.jit(tx.update)(grads, state, given)


#: How a state may be placed when restored or put back on the devices.
PLACEMENTS = {
  "as FSDP places it": lambda a: (
    P("data") if np.ndim(a) and np.shape(a)[0] % N == 0 else P()
  ),
  "replicated": lambda a: P(),
  "codes by rows, scales replicated": lambda a: (
    P("data") if np.shape(a) == (64, 1024) else P()
  ),
}
#: The 8-bit updates, each a factory.
EIGHT_BIT = {
  "quantize_state": lambda: ols.quantize_state(optax.adam(1e-2), min_size=1024),
  "adam_8bit": lambda: ols.adam_8bit(1e-2, min_size=1024),
  "adam_8bit, pallas": lambda: ols.adam_8bit(1e-2, min_size=1024, kernel="pallas"),
  "dynamic_loss_scale(quantize_state)": lambda: ols.dynamic_loss_scale(
    ols.quantize_state(optax.adam(1e-2), min_size=1024), initial_scale=1.0
  ),
}


@versions.explicit_sharding
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("name", EIGHT_BIT)
def test_a_state_placed_otherwise_than_init_places_it_updates_as_one_device(
  name, placement
):
  """Under an explicit mesh a restored (or device_put) state whose codes and
  scales are sharded otherwise than its update computes them: the update
  runs (it raised a select of two shardings) and keeps one device's bits."""
  mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(64, 1024)))}
  g = jax.tree.map(lambda p: p * 0.1, params)
  tx = EIGHT_BIT[name]()
  want = jax.jit(tx.update)(g, tx.init(params), params)
  rule = PLACEMENTS[placement]
  with jax.set_mesh(mesh):
    sharded = jax.device_put(params, NamedSharding(mesh, P("data")))
    saved = jax.device_get(jax.jit(tx.init)(sharded))  # a checkpoint's arrays
    state = jax.tree.map(
      lambda a: jax.device_put(a, NamedSharding(mesh, rule(a))), saved
    )
    got = jax.jit(tx.update)(
      jax.device_put(g, NamedSharding(mesh, P("data"))), state, sharded
    )
  assert_bitwise_equal(jax.device_get(got), jax.device_get(want))
