"""Loss scaling on 8 devices: sharded jit (DP, FSDP), shard_map, pmap.

Runs in its own process, with 8 simulated CPU devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/multidevice

(``tests/conftest.py`` leaves this folder out of runs without that flag.)
Every mode trains 50 steps with non-finite values injected on one device at
chosen steps, and must match a single-device run of the same global batch:
the same skipped steps and scales on every device, parameters equal to
float32 tolerance.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_lossscale as ols

N = 8
if jax.device_count() < N:
  pytest.skip(
    f"needs {N} devices: XLA_FLAGS=--xla_force_host_platform_device_count={N}",
    allow_module_level=True,
  )

pytestmark = pytest.mark.standard_promotion  # optax's adam

STEPS = 50
BAD_STEPS = frozenset({3, 4, 17, 30, 31, 32, 44})
BAD_DEVICE = 5
BATCH, D_IN, D_HID, D_OUT = 64, 16, 32, 8
# Non-finite steps back the scale off, 4 finite steps in a row grow it: both
# happen many times in 50 steps.
make_tx = functools.partial(
  ols.dynamic_loss_scale, initial_scale=2.0**10, growth_interval=4
)
INNER = lambda: optax.adam(1e-2)  # noqa: E731


def make_mesh():
  # Auto axes: sharding propagation decides the collectives (GSPMD), as in
  # most training code; shard_map makes them manual where it is used.
  return jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def init_params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
    "w1": jax.random.normal(k1, (D_IN, D_HID)) / 4,
    "b1": jnp.zeros((D_HID,)),
    "w2": jax.random.normal(k2, (D_HID, D_OUT)) / 6,
    "b2": jnp.zeros((D_OUT,)),
  }


def batch(step):
  rng = np.random.default_rng(step)
  x = rng.normal(size=(BATCH, D_IN)).astype(np.float32)
  y = np.sin(x[:, :D_OUT]).astype(np.float32)
  return x, y


def poisoned_batch(step):
  """A NaN in the rows that BAD_DEVICE holds of the batch, at the bad steps."""
  x, y = batch(step)
  if step in BAD_STEPS:
    x = x.copy()
    x[BAD_DEVICE * (BATCH // N), 0] = np.nan
  return x, y


def sq_err_sum(params, x, y):
  h = jnp.tanh(x @ params["w1"] + params["b1"][None])
  return jnp.sum((h @ params["w2"] + params["b2"][None] - y) ** 2)


def loss_fn(params, x, y):
  return sq_err_sum(params, x, y) / (BATCH * D_OUT)


def poison_grads(grads, bad):
  """A NaN in row BAD_DEVICE * 2 of w1: the rows that BAD_DEVICE shards."""
  row = BAD_DEVICE * (D_IN // N)
  w1 = grads["w1"].at[row, 0].set(jnp.where(bad, jnp.nan, grads["w1"][row, 0]))
  return {**grads, "w1": w1}


# --------------------------------------------------------------------------
# The single-device reference.
# --------------------------------------------------------------------------


@functools.cache
def reference(injection):
  """(scales, skipped, final params) of one device on the global batch."""
  tx = make_tx(INNER())
  params = init_params()
  state = tx.init(params)

  @jax.jit
  def step(params, state, x, y, bad):
    _, grads = ols.value_and_grad(loss_fn)(state, params, x, y)
    if injection == "grads":
      grads = poison_grads(grads, bad)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  scales, skipped = [], []
  for t in range(STEPS):
    x, y = poisoned_batch(t) if injection == "batch" else batch(t)
    params, state = step(params, state, x, y, t in BAD_STEPS)
    scales.append(float(state.loss_scale))
    skipped.append(bool(state.consecutive_skips > 0))
  assert [t for t in range(STEPS) if skipped[t]] == sorted(BAD_STEPS)
  return scales, skipped, jax.device_get(params)


def per_device(x):
  """The value each device holds of a replicated scalar (one per device)."""
  if x.ndim == 1:  # pmap: stacked
    return [v.item() for v in np.asarray(x)]
  return [np.asarray(s.data).item() for s in x.addressable_shards]


def check_run(trace, final_params, injection):
  ref_scales, ref_skipped, ref_params = reference(injection)
  for t, (scales, skips) in enumerate(trace):
    assert len(scales) == N and len(set(scales)) == 1, (t, scales)  # all agree
    assert len(set(skips)) == 1, (t, skips)
    assert scales[0] == ref_scales[t], t
    assert skips[0] == ref_skipped[t], t
  # float32 tolerance: the global batch is reduced in another order.
  for k in ref_params:
    np.testing.assert_allclose(
      np.asarray(final_params[k]), ref_params[k], rtol=1e-5, atol=1e-6, err_msg=k
    )


def record(state):
  return (per_device(state.loss_scale), per_device(state.consecutive_skips > 0))


# --------------------------------------------------------------------------
# jit with NamedSharding.
# --------------------------------------------------------------------------


def _state_shardings(mesh, state_shapes, shard_params):
  def one(x):
    if shard_params and x.ndim >= 1 and x.shape[0] % N == 0:
      return NamedSharding(mesh, P("data"))
    return NamedSharding(mesh, P())  # the loss scale's scalars: replicated

  return jax.tree.map(one, state_shapes)


@pytest.mark.parametrize("mode", ["data parallel", "fully sharded"])
def test_jit_named_sharding(mode):
  mesh = make_mesh()
  shard = mode == "fully sharded"
  tx = make_tx(INNER())
  params = init_params()
  param_sh = _state_shardings(mesh, params, shard)
  state_sh = _state_shardings(mesh, jax.eval_shape(tx.init, params), shard)
  batch_sh = NamedSharding(mesh, P("data"))
  params = jax.device_put(params, param_sh)
  state = jax.jit(tx.init, out_shardings=state_sh)(params)

  @functools.partial(
    jax.jit,
    in_shardings=(param_sh, state_sh, batch_sh, batch_sh),
    out_shardings=(param_sh, state_sh),
    donate_argnums=(0, 1),
  )
  def step(params, state, x, y):
    _, grads = ols.value_and_grad(loss_fn)(state, params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  trace = []
  for t in range(STEPS):
    x, y = poisoned_batch(t)
    params, state = step(params, state, x, y)
    trace.append(record(state))
  assert state.loss_scale.sharding.is_fully_replicated
  mu_w1 = state.inner_state[0].mu["w1"]
  assert mu_w1.sharding.is_fully_replicated is (not shard)
  assert params["w1"].sharding.is_fully_replicated is (not shard)
  check_run(trace, jax.device_get(params), "batch")


# --------------------------------------------------------------------------
# shard_map: parameters, gradients and Adam's moments sharded (ZeRO-3 style).
# --------------------------------------------------------------------------


def test_shard_map_fully_sharded_with_axis_name():
  mesh = make_mesh()
  tx = make_tx(INNER(), axis_name="data")
  params = init_params()
  shards = jax.tree.map(lambda _: P("data"), params)
  state_specs = jax.tree.map(
    lambda x: P("data") if x.ndim >= 1 else P(), jax.eval_shape(tx.init, params)
  )

  def local_step(params, state, x, y, bad):
    def local_loss(shard):
      full = jax.tree.map(lambda p: lax.all_gather(p, "data", tiled=True), shard)
      return sq_err_sum(full, x, y) / (BATCH * D_OUT)

    scale = ols.get_scale(state)
    # Each device gets the gradient of its own parameter shard, summed over
    # the devices' batches (the transpose of all_gather is a reduce-scatter).
    grads = jax.grad(lambda s: local_loss(s) * scale)(params)
    # A NaN in BAD_DEVICE's gradient shard only: the others would not see it
    # without the finite flag being reduced over `axis_name`.
    mine = lax.axis_index("data") == BAD_DEVICE
    w1 = grads["w1"].at[0, 0].set(jnp.where(bad & mine, jnp.nan, grads["w1"][0, 0]))
    updates, state = tx.update({**grads, "w1": w1}, state, params)
    return optax.apply_updates(params, updates), state

  sh = lambda spec: jax.tree.map(  # noqa: E731
    lambda s: NamedSharding(mesh, s), spec, is_leaf=lambda s: isinstance(s, P)
  )
  step = jax.jit(
    jax.shard_map(
      local_step,
      mesh=mesh,
      in_specs=(shards, state_specs, P("data"), P("data"), P()),
      out_specs=(shards, state_specs),
    ),
    donate_argnums=(0, 1),
  )
  params = jax.device_put(params, sh(shards))
  state = jax.jit(tx.init, out_shardings=sh(state_specs))(params)
  trace = []
  for t in range(STEPS):
    x, y = (jax.device_put(a, sh(P("data"))) for a in batch(t))
    params, state = step(params, state, x, y, jnp.asarray(t in BAD_STEPS))
    trace.append(record(state))
  check_run(trace, jax.device_get(params), "grads")


# --------------------------------------------------------------------------
# pmap: replicated parameters, gradients averaged with pmean.
# --------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pmap itself
def test_pmap_with_axis_name():
  tx = make_tx(INNER(), axis_name="data")
  params = init_params()
  state = tx.init(params)

  def local_step(params, state, x, y, bad):
    _, grads = ols.value_and_grad(loss_fn)(state, params, x, y)
    grads = lax.psum(grads, "data")  # loss_fn divides by the global batch
    # After the psum every device holds the same gradients; the NaN is added
    # on BAD_DEVICE only (as an overflow in a device-local computation).
    mine = lax.axis_index("data") == BAD_DEVICE
    updates, state = tx.update(poison_grads(grads, bad & mine), state, params)
    return optax.apply_updates(params, updates), state

  step = jax.pmap(local_step, axis_name="data", in_axes=(0, 0, 0, 0, None))
  rep = lambda tree: jax.tree.map(lambda x: jnp.stack([x] * N), tree)  # noqa: E731
  params, state = rep(params), rep(state)
  trace = []
  for t in range(STEPS):
    x, y = (a.reshape(N, BATCH // N, -1) for a in batch(t))
    params, state = step(params, state, x, y, t in BAD_STEPS)
    trace.append(record(state))
  for k, v in params.items():  # the replicas never diverged
    np.testing.assert_array_equal(np.asarray(v)[0], np.asarray(v)[-1], err_msg=k)
  check_run(trace, jax.tree.map(lambda v: np.asarray(v)[0], params), "grads")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_pmap_without_axis_name_lets_replicas_disagree():
  """What the documentation says happens: each replica decides on its own gradients."""
  tx = make_tx(INNER())
  params = init_params()

  def local_step(params, state, bad):
    grads = jax.tree.map(jnp.ones_like, params)
    mine = lax.axis_index("data") == BAD_DEVICE
    _, state = tx.update(poison_grads(grads, bad & mine), state, params)
    return state

  rep = lambda tree: jax.tree.map(lambda x: jnp.stack([x] * N), tree)  # noqa: E731
  state = jax.pmap(local_step, axis_name="data", in_axes=(0, 0, None))(
    rep(params), rep(tx.init(params)), True
  )
  skipped = np.asarray(state.skipped_steps).tolist()
  assert skipped == [int(i == BAD_DEVICE) for i in range(N)]


def test_a_jitted_inner_update_keeps_its_out_shardings():
  """The skip evaluates a jit's body in its place, keeping what it asked for."""
  mesh = make_mesh()
  replicated = NamedSharding(mesh, P())
  sharded = NamedSharding(mesh, P("data"))
  adam = optax.adam(1e-2)
  params = {"w": jnp.ones(8 * N)}
  state = adam.init(params)
  shardings = (
    jax.tree.map(lambda _: replicated, params),
    jax.tree.map(lambda x: sharded if x.ndim else replicated, state),
  )
  inner = optax.GradientTransformation(
    adam.init, jax.jit(adam.update, out_shardings=shardings)
  )
  tx = make_tx(inner)
  ls_state = tx.init(params)
  grads = {"w": jnp.arange(8.0 * N)}
  for update in (tx.update, jax.jit(tx.update)):
    _, new = update(grads, ls_state, params)
    mu = new.inner_state[0].mu["w"]
    assert mu.sharding.is_equivalent_to(sharded, mu.ndim), mu.sharding


# --------------------------------------------------------------------------
# axis_name: an extra axis is harmless; an axis that is not there is a clear
# error wherever the step runs.
# --------------------------------------------------------------------------


def _shard_mapped_scale(axis_name, inf):
  """The scale after one shard_map step on a 2 x 4 mesh whose gradients vary
  over "data" only (an infinity on one shard if ``inf``)."""
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  params = {"w": jnp.ones((8, 16))}
  grads = {"w": jnp.ones((8, 16)).at[0, 0].set(jnp.inf if inf else 1.0)}
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=8.0, axis_name=axis_name)
  spec = {"w": P("data")}
  step = jax.jit(
    jax.shard_map(
      lambda g, s, p: tx.update(g, s, p)[1].loss_scale,
      mesh=mesh,
      in_specs=(spec, P(), spec),
      out_specs=P(),
    )
  )
  sh = {"w": NamedSharding(mesh, P("data"))}
  return float(
    step(jax.device_put(grads, sh), tx.init(params), jax.device_put(params, sh))
  )


@pytest.mark.skipif(not hasattr(jax, "shard_map"), reason="jax.shard_map")
@pytest.mark.parametrize("inf", [False, True], ids=["finite", "inf on one shard"])
@pytest.mark.parametrize("axis_name", ["data", ("data", "model"), ("model", "data")])
def test_naming_an_axis_the_gradients_do_not_vary_over_changes_nothing(axis_name, inf):
  assert _shard_mapped_scale(axis_name, inf) == (4.0 if inf else 8.0)


@pytest.mark.skipif(not hasattr(jax, "shard_map"), reason="jax.shard_map")
@pytest.mark.parametrize(
  "where",
  ["shard_map, no such mesh axis", "jit, no mapped axis", "vmap without axis_name"],
)
def test_an_axis_name_that_names_no_mapped_axis_is_a_clear_error(where):
  params = {"w": jnp.ones((8, 16))}
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), axis_name="batch")
  with pytest.raises(ValueError, match="axis_name='batch' names no axis"):
    if where.startswith("shard_map"):
      _shard_mapped_scale("batch", False)
    elif where.startswith("jit"):
      jax.jit(tx.update)(params, tx.init(params), params)
    else:
      stacked = jax.tree.map(lambda x: jnp.stack([x, x]), params)
      jax.vmap(lambda g, p: tx.update(g, tx.init(p), p)[0])(stacked, stacked)
