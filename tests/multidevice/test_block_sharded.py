"""MXFP8 and NVFP4 matmuls on 8 devices: Auto and Explicit meshes as one device.

Runs in its own process, with 8 simulated CPU devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/multidevice

Axes: the mesh (``AxisType.Auto``, ``AxisType.Explicit``) x the layout
(data-parallel: the batch sharded; fully sharded: the batch and the
weights' rows; tensor-parallel: the first weight's columns and the second's
rows) x the recipe (MXFP8, NVFP4). The gradients of a two-layer MLP under
``autocast(matmul=recipe)`` must equal one device's (up to the order of
float32 sums), and under explicit sharding keep their parameters' shardings.
"""

import jax
import jax.numpy as jnp
import numpy as np
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

pytestmark = versions.block_formats

# layout: (x, w1, w2) specs
LAYOUTS = {
  "data": (P("data", None), P(), P()),
  "fully sharded": (P("data", None), P("data", None), P("data", None)),
  "tensor": (P(), P(None, "data"), P("data", None)),
}


def loss(params, x, out_sharding=None):
  h = jnp.tanh(x @ params["w1"])
  # tensor-parallel under explicit sharding: the second matmul contracts a
  # sharded axis, so its result's sharding must be given (and is kept)
  return jnp.mean(jnp.matmul(h, params["w2"], out_sharding=out_sharding) ** 2)


def data():
  rng = np.random.default_rng(0)
  params = {
    "w1": jnp.asarray(rng.standard_normal((64, 48)) / 8, jnp.float32),
    "w2": jnp.asarray(rng.standard_normal((48, 32)) / 7, jnp.float32),
  }
  return params, jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
  "mode", ["auto", pytest.param("explicit", marks=versions.explicit_sharding)]
)
def test_sharded_gradients_are_one_devices(mode, layout, recipe):
  params, x = data()
  # every matmul in the recipe (NVFP4's default keeps the output layer)
  recipe = ols.NVFP4Matmul(keep=()) if recipe == "nvfp4" else recipe
  grad = jax.jit(
    jax.grad(ols.autocast(loss, compute_dtype=jnp.bfloat16, matmul=recipe)),
    static_argnums=2,
  )
  one = grad(params, x, None)
  axis = getattr(jax.sharding.AxisType, mode.capitalize())
  mesh = jax.make_mesh((N,), ("data",), axis_types=(axis,))
  sx, s1, s2 = (NamedSharding(mesh, s) for s in LAYOUTS[layout])
  xs = jax.device_put(x, sx)
  ps = {"w1": jax.device_put(params["w1"], s1), "w2": jax.device_put(params["w2"], s2)}
  out = P() if (mode, layout) == ("explicit", "tensor") else None
  with jax.set_mesh(mesh):
    got = grad(ps, xs, out)
  for k in params:
    np.testing.assert_allclose(got[k], one[k], rtol=1e-5, atol=1e-7)
    if mode == "explicit":
      assert got[k].sharding.is_equivalent_to(ps[k].sharding, got[k].ndim), k
