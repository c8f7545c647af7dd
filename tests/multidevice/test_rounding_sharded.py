"""Stochastic rounding and Kahan summation on 8 devices: the sharding changes no bit.

Runs in its own process, with 8 simulated CPU devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/multidevice

Parameters sharded over 8 devices (rows, columns, a vector; a float32 leaf
replicated) are trained with ``dynamic_loss_scale(chain(adam, rounding))``
on given gradients (no reduction across devices, so nothing but the
rounding could differ), a non-finite step included, under ``jax.jit``: the
parameters and the whole state must equal an unsharded run's, bit for bit,
with ``jax_threefry_partitionable`` on and off. Which random numbers are
drawn depends on that flag (JAX >= 0.5 turns it on by default: it changes
the keys ``jax.random.split`` and ``fold_in`` make), not on the sharding.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import versions
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_lossscale as ols

N = 8
if jax.device_count() < N:
  pytest.skip(
    f"needs {N} devices: XLA_FLAGS=--xla_force_host_platform_device_count={N}",
    allow_module_level=True,
  )

pytestmark = [
  pytest.mark.standard_promotion,  # optax's adam, apply_updates
  # float16 leaves rounded by stochastic rounding or Kahan summation keep
  # Adam's state in float16 on purpose: the loss scale's warning is expected.
  pytest.mark.filterwarnings("ignore::optax_lossscale.HalfPrecisionStateWarning"),
]

STEPS = 4
BAD_STEP = 2
# name: (shape, dtype, sharding, rounding)
SPECS = {
  "rows": ((4 * N, 24), jnp.bfloat16, P("data", None), "stochastic"),
  "cols": ((12, 2 * N), jnp.bfloat16, P(None, "data"), "kahan"),
  "vec": ((5 * N,), jnp.float16, P("data"), "stochastic"),
  "half": ((3 * N,), jnp.float16, P("data"), "kahan"),
  "f32": ((7,), jnp.float32, P(), "stochastic"),
}


def init_params():
  rng = np.random.default_rng(0)
  return {k: jnp.asarray(rng.normal(size=s[0]), s[1]) for k, s in SPECS.items()}


def grads(step):
  """Gradients of the scaled loss: small against the weights, NaN at BAD_STEP."""
  rng = np.random.default_rng(100 + step)
  out = {}
  for k, (shape, dtype, _, _) in SPECS.items():
    g = rng.normal(size=shape) * 10.0 ** rng.uniform(-3, 1, shape)
    if step == BAD_STEP and k == "vec":
      g[N + 1] = np.nan  # on the second device's shard
    out[k] = jnp.asarray(g, dtype)
  return out


def make_tx(inner=None):
  """Stochastic rounding on some leaves, Kahan summation on the others."""
  rounding = {
    "stochastic": ols.stochastic_rounding(jax.random.key(3)),
    "kahan": ols.kahan_summation(),
  }
  # eps=1e-8 would be 0 in float16 moments
  inner = inner or optax.adam(1e-3, eps=1e-3)
  inner = {k: optax.chain(inner, r) for k, r in rounding.items()}
  labels = {k: spec[3] for k, spec in SPECS.items()}
  return ols.dynamic_loss_scale(
    optax.multi_transform(inner, labels), initial_scale=2.0**4
  )


@functools.cache
def run(sharded, partitionable, explicit=False):
  with jax.threefry_partitionable(partitionable):
    if not explicit:
      return _run(sharded)
    mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):  # jit traces with the specs in the types
      return _run(sharded, mesh, float32_sgd=True)


def _run(sharded, explicit_mesh=None, float32_sgd=False):
  if not float32_sgd:
    tx = make_tx()
    step_grads = [grads(t) for t in range(STEPS)]
  else:
    # float32 gradients and SGD: no arithmetic in half precision but the
    # rounding's. XLA may compute half-precision arithmetic (Adam's moments
    # kept in bfloat16) in float32 and round it only where it chooses to
    # ("excess precision", on by default), which differs between programs
    # partitioned otherwise; the rounding works on integer bits, which no
    # such rewrite touches.
    tx = make_tx(optax.sgd(1e-3))
    step_grads = [
      jax.tree.map(lambda g: g.astype(jnp.float32), grads(t)) for t in range(STEPS)
    ]
  params = init_params()
  kwargs = {}
  if sharded:
    mesh = explicit_mesh or Mesh(np.array(jax.devices()[:N]), ("data",))
    shardings = {k: NamedSharding(mesh, spec[2]) for k, spec in SPECS.items()}
    params = jax.device_put(params, shardings)
    step_grads = [jax.device_put(g, shardings) for g in step_grads]
    kwargs = {"out_shardings": (shardings, None)}

  @jax.jit
  def init(params):
    return tx.init(params)

  def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, **kwargs)
  state = init(params)
  for g in step_grads:
    params, state = step(params, state, g)
  if sharded:  # the parameters stayed sharded
    assert not params["rows"].sharding.is_fully_replicated
    assert not params["cols"].sharding.is_fully_replicated
  assert int(state.skipped_steps) == 1
  return jax.device_get((params, state))


def assert_bitwise_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("partitionable", [True, False])
def test_sharded_equals_unsharded_bit_for_bit(partitionable):
  sharded = run(True, partitionable)
  assert_bitwise_equal(sharded, run(False, partitionable))
  start = init_params()
  for k, p in sharded[0].items():  # every leaf trained, and stayed finite
    assert not np.array_equal(p, start[k]), k
    assert np.isfinite(np.asarray(p, np.float32)).all(), k


def test_the_random_numbers_depend_on_threefry_partitionable():
  on, off = (run(True, flag)[0] for flag in (True, False))
  assert not np.array_equal(on["rows"], off["rows"])  # stochastic rounding
  assert np.array_equal(on["cols"], off["cols"])  # Kahan summation


@versions.explicit_sharding
def test_explicit_sharding_equals_unsharded_bit_for_bit():
  # With JAX's explicit sharding the specs are in the arrays' types: the
  # rounding (its random numbers included) gives one device's bits.
  sharded = run(True, True, explicit=True)
  with jax.threefry_partitionable(True):
    one = _run(False, float32_sgd=True)
  assert_bitwise_equal(sharded, one)
