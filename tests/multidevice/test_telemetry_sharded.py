"""The non-finite record on 8 devices: a NaN on one device is recorded by all.

Runs in its own process, with 8 simulated CPU devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/multidevice

A NaN is put into one device's part of the gradients only (sharded jit,
shard_map with ``axis_name``, pmap with ``axis_name``); every device's copy
of the record must be the same and name that leaf, as a one-device run
does.
"""

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

BAD_DEVICE = 5


def make_mesh():
  return jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def params():
  return {"w1": jnp.ones((2 * N, 3)), "b1": jnp.zeros(3), "w2": jnp.ones((3, N))}


def grads(bad_row, value):
  """Gradients of ones, ``value`` at row ``bad_row`` of ``w1``."""
  g = jax.tree.map(jnp.ones_like, params())
  g["w1"] = g["w1"].at[bad_row, 1].set(value)
  return g


def tx(axis_name=None):
  return ols.dynamic_loss_scale(
    optax.adam(1e-3), axis_name=axis_name, track_nonfinite=True
  )


def copies(x, stacked):
  """Each device's copy of a replicated array (``stacked``: pmap's output)."""
  if stacked:
    return list(np.asarray(x))
  assert x.sharding.is_fully_replicated
  return [np.asarray(s.data) for s in x.addressable_shards]


def check_every_copy(record, reference, stacked=False):
  for field in (
    "steps",
    "nonfinite_steps",
    "last_step",
    "leaf_steps",
    "leaf_nan_steps",
    "leaf_inf_steps",
    "last_leaves",
  ):
    want = np.asarray(getattr(reference, field))
    got = copies(getattr(record, field), stacked)
    assert len(got) == N, field
    for i, x in enumerate(got):
      np.testing.assert_array_equal(x, want, err_msg=f"{field} on device {i}")
  assert record.paths == reference.paths


def reference(value):
  t = tx()
  state = t.init(params())
  _, state = t.update(grads(2 * BAD_DEVICE, value), state, params())
  return state.nonfinite


@pytest.mark.parametrize("value", [jnp.nan, jnp.inf])
def test_sharded_jit(value):
  mesh = make_mesh()
  rows = NamedSharding(mesh, P("data"))
  t = tx()
  p = jax.device_put(params(), {"w1": rows, "b1": None, "w2": None})
  g = jax.device_put(grads(2 * BAD_DEVICE, value), {"w1": rows, "b1": None, "w2": None})
  assert g["w1"].addressable_shards[BAD_DEVICE].data[0, 1] != 1  # only there
  state = jax.jit(t.init)(p)
  _, state = jax.jit(t.update)(g, state, p)
  check_every_copy(state.nonfinite, reference(value))
  report = ols.nonfinite_report(state)
  kind = "NaN" if np.isnan(value) else "inf"
  assert [(leaf.path, leaf.last) for leaf in report.leaves] == [("w1", kind)]


def test_shard_map_with_axis_name():
  mesh = make_mesh()
  t = tx("data")
  shards = {"w1": P("data"), "b1": P(), "w2": P(None, "data")}
  abstract = jax.eval_shape(t.init, params())
  # Adam's moments sharded as the parameters, the counters and record replicated.
  state_specs = jax.tree.map(lambda _: P(), abstract)
  mu = abstract.inner_state[0].mu
  state_specs = state_specs._replace(
    inner_state=(
      state_specs.inner_state[0]._replace(mu=shards, nu=shards),
      state_specs.inner_state[1],
    )
  )
  assert jax.tree.structure(mu) == jax.tree.structure(shards)

  def local(p, s, g):
    mine = lax.axis_index("data") == BAD_DEVICE
    w1 = g["w1"].at[0, 1].set(jnp.where(mine, jnp.nan, g["w1"][0, 1]))
    return t.update({**g, "w1": w1}, s, p)[1]

  step = jax.jit(
    jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(shards, state_specs, shards),
      out_specs=state_specs,
    )
  )
  sh = lambda spec: jax.tree.map(  # noqa: E731
    lambda s: NamedSharding(mesh, s), spec, is_leaf=lambda s: isinstance(s, P)
  )
  p = jax.device_put(params(), sh(shards))
  state = jax.jit(t.init, out_shardings=sh(state_specs))(p)
  state = step(p, state, jax.device_put(grads(0, 1.0), sh(shards)))
  check_every_copy(state.nonfinite, reference(jnp.nan))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pmap itself
def test_pmap_with_axis_name():
  t = tx("data")

  def local(p, s, g):
    mine = lax.axis_index("data") == BAD_DEVICE
    w1 = g["w1"].at[2 * BAD_DEVICE, 1].set(jnp.where(mine, jnp.nan, 1.0))
    return t.update({**g, "w1": w1}, s, p)[1]

  rep = lambda tree: jax.tree.map(lambda x: jnp.stack([x] * N), tree)  # noqa: E731
  state = jax.pmap(local, axis_name="data")(
    rep(params()), rep(t.init(params())), rep(grads(0, 1.0))
  )
  check_every_copy(state.nonfinite, reference(jnp.nan), stacked=True)


def test_a_loss_that_differs_between_devices_is_refused():
  mesh = make_mesh()
  t = tx()  # no axis_name: the gradients must be the same on every device

  def local(p, s, x):
    g = jax.tree.map(jnp.ones_like, p)  # the same everywhere
    return t.update(g, s, p, value=jnp.sum(x))[1]  # a loss per device

  step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P())
  with pytest.raises(ValueError, match="differs between devices along"):
    jax.jit(step)(params(), t.init(params()), jnp.ones(N))


def test_noop_without_axis_name_under_shard_map_says_what_for():
  mesh = make_mesh()
  t = ols.porting.with_loss_scale(
    optax.sgd(0.1), ols.porting.NoOpLossScale(), track_nonfinite=True
  )

  def local(p, s, g):
    return t.update(g, s, p)[1]

  shards = {"w1": P("data"), "b1": P(), "w2": P(None, "data")}
  step = jax.shard_map(local, mesh=mesh, in_specs=(shards, P(), shards), out_specs=P())
  with pytest.raises(ValueError, match="NoOpLossScale skips nothing.*record it"):
    jax.jit(step)(params(), t.init(params()), grads(0, 1.0))


@pytest.mark.parametrize("bad", [None, "b", "c"])
def test_leaves_placed_on_other_devices_are_checked_where_they_lie(bad):
  """A tree whose leaves lie on different devices (one placed by hand) is
  checked by all_finite and check_checkpoint eagerly, one check per set of
  devices: one jitted check of them all was refused, finite or not."""
  devices = jax.devices()
  tree = {
    "a": jax.device_put(jnp.ones(3), devices[0]),
    "b": jax.device_put(jnp.ones(2), devices[1]),
    "c": jax.device_put(jnp.ones((N, 2)), NamedSharding(make_mesh(), P("data"))),
    "host": np.ones(2, np.float32),
  }
  if bad is not None:
    tree[bad] = tree[bad].at[-1].set(jnp.nan)
  assert bool(ols.all_finite(tree)) == (bad is None)
  if bad is None:
    assert ols.check_checkpoint(tree) is tree
  else:
    with pytest.raises(ValueError, match=rf"at \['{bad}'\]: \d+ NaN"):
      ols.check_checkpoint(tree)
