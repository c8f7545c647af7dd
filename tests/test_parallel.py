"""vmap over independent runs, and the mapped-axis checks, on one device.

The eight-device tests are in ``tests/multidevice/`` (their own process).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import versions
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_lossscale as ols

SCALE = 2.0**6


def _params(seed):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w": jax.random.normal(k1, (3, 2)), "b": jax.random.normal(k2, (2,))}


def _grads(params, scale, bad):
  g = jax.tree.map(lambda p: (p * 0.5 + 0.25) * scale, params)
  return {**g, "w": jnp.where(bad, jnp.nan, g["w"])}


def test_vmap_over_independent_runs_matches_each_run():
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=SCALE, growth_interval=2)
  n = 4
  params = jax.vmap(_params)(jnp.arange(n))
  state = jax.vmap(tx.init)(params)
  assert state.loss_scale.shape == (n,)
  # Run r gets a non-finite step at step r: each run decides on its own.
  bad = np.eye(n, 5, dtype=bool)

  @jax.jit
  def step(params, state, bad):
    def one(p, s, b):
      updates, s = tx.update(_grads(p, ols.get_scale(s), b), s, p)
      return optax.apply_updates(p, updates), s

    return jax.vmap(one)(params, state, bad)

  for t in range(5):
    params, state = step(params, state, jnp.asarray(bad[:, t]))

  for r in range(n):
    p, s = _params(r), tx.init(_params(r))
    for t in range(5):
      updates, s = tx.update(_grads(p, ols.get_scale(s), bad[r, t]), s, p)
      p = optax.apply_updates(p, updates)
    chex.assert_trees_all_close(jax.tree.map(lambda x, r=r: x[r], params), p, rtol=1e-6)
    assert float(state.loss_scale[r]) == float(s.loss_scale)
    assert int(state.skipped_steps[r]) == 1
  # The runs disagree on their scales: the decisions were not shared.
  assert len(set(np.asarray(state.loss_scale).tolist())) > 1


def test_vmap_with_axis_name_shares_the_decision():
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=SCALE, axis_name="runs")
  params = jax.vmap(_params)(jnp.arange(3))
  state = jax.vmap(tx.init)(params)
  grads = jax.vmap(_grads, in_axes=(0, None, 0))(
    params, SCALE, jnp.array([0, 1, 0], bool)
  )
  updates, state = jax.vmap(tx.update, axis_name="runs")(grads, state, params)
  assert np.asarray(state.skipped_steps).tolist() == [1, 1, 1]
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))


def _shard_map(f, mesh, in_specs, out_specs):
  mapped = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))

  def call(*args):
    shardings = jax.tree.map(
      lambda s: NamedSharding(mesh, s), in_specs, is_leaf=lambda s: isinstance(s, P)
    )
    args = [jax.device_put(a, s) for a, s in zip(args, shardings, strict=True)]
    return mapped(*args)

  return call


def _loss(p, x):
  return jnp.sum((x @ p["w"] + p["b"][None]) ** 2)


@versions.shard_map
def test_shard_map_sharded_grads_need_axis_name():
  """ZeRO/FSDP inside shard_map: each device holds a shard of the gradients."""
  mesh = jax.make_mesh((1,), ("data",))
  params = _params(0)
  x = jnp.ones((4, 3))
  specs = ({"w": P("data"), "b": P("data")}, P(), P("data"))

  tx = ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=SCALE)

  def step(tx):
    def f(params, state, x):
      full = jax.tree.map(lambda p: jax.lax.all_gather(p, "data", tiled=True), params)
      g = jax.grad(_loss)(full, x)
      shard = jax.tree.map(lambda g, p: g[: p.shape[0]], g, params)  # 1 device
      return tx.update(shard, state, params)

    return f

  f = _shard_map(step(tx), mesh, specs, (specs[0], P()))
  with pytest.raises(ValueError, match="differ between devices.*'data'.*axis_name"):
    f(params, tx.init(params), x)

  # With axis_name the finite flag is reduced: one decision for all devices.
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=SCALE, axis_name="data")
  f = _shard_map(step(tx), mesh, specs, (specs[0], P()))
  updates, state = f(params, tx.init(params), x)
  assert int(state.good_steps) == 1


@versions.shard_map
def test_shard_map_replicated_params_need_no_axis_name():
  """JAX sums the gradients of replicated parameters across devices itself."""
  mesh = jax.make_mesh((1,), ("data",))
  params = _params(0)
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=SCALE)

  def f(params, state, x):
    return tx.update(jax.grad(_loss)(params, x), state, params)

  g = _shard_map(f, mesh, (P(), P(), P("data")), (P(), P()))
  _, state = g(params, tx.init(params), jnp.ones((4, 3)))
  assert int(state.good_steps) == 1


@versions.shard_map
def test_shard_map_axis_name_must_cover_every_varying_axis():
  mesh = jax.make_mesh((1, 1), ("data", "model"))
  tx = ols.dynamic_loss_scale(optax.sgd(0.1), axis_name="data")
  params = {"w": jnp.ones((4, 2))}

  def f(params, state):
    return tx.update(params, state, params)  # grads vary over both axes

  g = _shard_map(f, mesh, (P("data", "model"), P()), (P("data", "model"), P()))
  with pytest.raises(ValueError, match="'model'"):
    g(params, tx.init(params))
