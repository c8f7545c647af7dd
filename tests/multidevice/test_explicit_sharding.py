"""Auto and explicit sharding, data/fully-sharded/tensor parallel: each as one device.

Runs in its own process, with 8 simulated CPU devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/multidevice

The matrix: a mesh of 4 x 2 devices (``data``, ``model``) whose axes are
``AxisType.Auto`` or ``AxisType.Explicit`` (JAX's sharding in types, where
arrays of other specs cannot be combined); parameters replicated (data
parallel), sharded by rows over ``data`` (fully sharded: gathered before
use) or split over ``model`` (tensor parallel: a column- then a row-split
matmul); the model computing in float16 or bfloat16 with float32
parameters and float32 accumulation. In each cell, six steps of
``dynamic_loss_scale(adam, track_nonfinite=True)`` with a NaN in one
device's rows of the batch at one step must decide exactly as one device
does (scale, counters, the non-finite record) and end with the one-device
parameters (to the last bits of the sharded sums' order); the checkpoint
guard passes the sharded state and names a sharded leaf that holds a NaN;
and float8 autocast runs a tensor-parallel matmul whose ``out_sharding`` is
given.
"""

import contextlib
import functools
import warnings

import jax
import jax.numpy as jnp
import jaxprs
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

pytestmark = [versions.explicit_sharding, pytest.mark.standard_promotion]

STEPS = 6
NAN_STEP = 3
LAYOUTS = {
  "data parallel": {"w1": P(), "w2": P()},
  "fully sharded": {"w1": P("data", None), "w2": P("data", None)},
  "tensor parallel": {"w1": P(None, "model"), "w2": P("model", None)},
}
MODES = ("auto", "explicit")
HALF = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}


def make_mesh(mode):
  kind = (
    jax.sharding.AxisType.Explicit if mode == "explicit" else jax.sharding.AxisType.Auto
  )
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind, kind))


def model(params, x, *, mode, layout, half):
  """A two-layer MLP in ``half``; what explicit sharding needs, where it needs it."""
  w1, w2 = params["w1"], params["w2"]
  if mode == "explicit" and layout == "fully sharded":
    w1, w2 = jax.sharding.reshard(w1, P()), jax.sharding.reshard(w2, P())
  h = jnp.matmul(x.astype(half), w1.astype(half), preferred_element_type=jnp.float32)
  h = jnp.tanh(h.astype(half))
  out_sharding = {}
  if mode == "explicit" and layout == "tensor parallel":  # contracting over `model`
    out_sharding = {"out_sharding": P("data", None)}
  return jnp.matmul(
    h, w2.astype(half), preferred_element_type=jnp.float32, **out_sharding
  )


def data():
  rng = np.random.default_rng(0)
  params = {
    "w1": jnp.asarray(rng.normal(size=(16, 32)) / 4, jnp.float32),
    "w2": jnp.asarray(rng.normal(size=(32, 8)) / 6, jnp.float32),
  }
  xs = [jnp.asarray(rng.normal(size=(32, 16)), jnp.float32) for _ in range(STEPS)]
  xs[NAN_STEP] = xs[NAN_STEP].at[21, 3].set(jnp.nan)  # the 6th device's rows
  y = jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)
  return params, xs, y


@functools.cache
def train(mode, layout, half_name):
  """``(params, state)`` after the steps; ``mode`` ``'one device'`` or a mesh's."""
  half = HALF[half_name]
  params, xs, y = data()
  tx = ols.dynamic_loss_scale(
    optax.adam(1e-2), initial_scale=2.0**10, growth_interval=2, track_nonfinite=True
  )
  mesh = None if mode == "one device" else make_mesh(mode)
  context = jax.set_mesh(mesh) if mode == "explicit" else contextlib.nullcontext()
  with context:
    if mesh is not None:
      sh = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
      params = jax.device_put(params, {k: sh(v) for k, v in LAYOUTS[layout].items()})
      xs = [jax.device_put(x, sh(P("data"))) for x in xs]
      y = jax.device_put(y, sh(P("data")))

    def loss_fn(p, x):
      pred = model(p, x, mode=mode, layout=layout, half=half)
      return jnp.mean((pred - y) ** 2)

    @jax.jit
    def step(p, s, x):
      loss, g = ols.value_and_grad(loss_fn)(s, p, x)
      u, s = tx.update(g, s, p, value=loss)
      return optax.apply_updates(p, u), s

    state = jax.jit(tx.init)(params)
    for x in xs:
      params, state = step(params, state, x)
    if mesh is not None:
      assert ols.check_checkpoint((params, state)) is not None
      sharded = LAYOUTS[layout]["w1"] != P()
      assert params["w1"].sharding.is_fully_replicated != sharded
    return jax.device_get((params, state))


CELLS = [(m, lay, h) for m in MODES for lay in LAYOUTS for h in HALF]


@pytest.mark.parametrize("mode, layout, half", CELLS)
def test_the_loss_scale_decides_as_one_device(mode, layout, half):
  params, state = train(mode, layout, half)
  ref_params, ref_state = train("one device", "data parallel", half)
  # The loss scale's own values: exactly one device's.
  for field in ("loss_scale", "good_steps", "skipped_steps", "consecutive_skips"):
    assert getattr(state, field) == getattr(ref_state, field), field
  assert int(state.skipped_steps) == 1
  record, ref = state.nonfinite, ref_state.nonfinite
  for field in ("steps", "nonfinite_steps", "loss_steps", "last_step", "last_scale"):
    assert getattr(record, field) == getattr(ref, field), field
  np.testing.assert_array_equal(record.leaf_nan_steps, ref.leaf_nan_steps)
  np.testing.assert_array_equal(record.last_leaves, ref.last_leaves)
  # The parameters: one device's, but for the order of the sharded sums
  # (float32 accumulation, then a gradient in float16 or bfloat16: its last
  # bit, which Adam's normalisation carries into the step). A decision taken
  # otherwise would move them by the learning rate, 1e-2.
  rtol = 1e-4 if half == "float16" else 4e-3
  for k in params:
    np.testing.assert_allclose(params[k], ref_params[k], rtol=rtol, atol=rtol * 0.1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("out_spec", [P(), P("data")], ids=["replicated", "sharded"])
def test_a_jitted_inner_update_with_out_shardings_keeps_its_skip(mode, out_spec):
  """The skip evaluates a jit's body in its place, its outputs as the jit
  gives them: a constraint under auto axes, the call's types under explicit
  ones (where a constraint only asserts), with no fallback to the select
  after the update."""
  mesh = make_mesh(mode)
  sgd = optax.sgd(1e-2, momentum=0.9)
  core = jax.jit(sgd.update, out_shardings=NamedSharding(mesh, out_spec))
  inner = optax.GradientTransformation(sgd.init, lambda g, s, p=None: core(g, s, p))
  tx = ols.dynamic_loss_scale(inner, initial_scale=4.0)
  context = jax.set_mesh(mesh) if mode == "explicit" else contextlib.nullcontext()
  with context, warnings.catch_warnings():
    warnings.simplefilter("error", ols.SkipFallbackWarning)
    rows = NamedSharding(mesh, P("data"))
    params = {"w": jax.device_put(jnp.arange(8.0 * 4), rows)}
    g = np.linspace(0.1, 0.8, 8 * 4, dtype=np.float32) * 4
    grads = {"w": jax.device_put(g, rows)}
    nan = {"w": jax.device_put(np.where(np.arange(g.size) == 3, np.nan, g), rows)}
    state = jax.jit(tx.init)(params)
    plain_u, plain_s = jax.jit(inner.update)(
      jax.tree.map(lambda g: g / 4.0, grads), state.inner_state, params
    )
    for bad in (False, True):
      u, new = jax.jit(tx.update)(nan if bad else grads, state, params)
      want = (
        (jax.tree.map(jnp.zeros_like, plain_u), state.inner_state)
        if bad
        else (
          plain_u,
          plain_s,
        )
      )
      np.testing.assert_array_equal(u["w"], want[0]["w"])
      np.testing.assert_array_equal(
        new.inner_state[0].trace["w"], want[1][0].trace["w"]
      )
      if not bad:  # the same types and shardings as the inner update's own
        for x, y in zip(
          jax.tree.leaves((u, new.inner_state)), jax.tree.leaves(want), strict=True
        ):
          assert jax.typeof(x) == jax.typeof(y)
          assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (
            x.sharding,
            y.sharding,
          )


@pytest.mark.parametrize("mode", MODES)
def test_the_guard_names_a_sharded_leaf(mode):
  mesh = make_mesh(mode)
  context = jax.set_mesh(mesh) if mode == "explicit" else contextlib.nullcontext()
  with context:
    w = jnp.ones((16, 8)).at[13, 2].set(jnp.nan)
    tree = {
      "w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))),
      "b": jax.device_put(jnp.ones(8), NamedSharding(mesh, P())),
    }
    with pytest.raises(ValueError, match=r"\['w'\]: 1 NaN \(of 128 entries\)"):
      ols.check_checkpoint(tree)
    assert bool(ols.all_finite({"b": tree["b"]}))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", ["float16", "float8"])
def test_autocast_of_a_tensor_parallel_matmul(mode, recipe):
  mesh = make_mesh(mode)
  context = jax.set_mesh(mesh) if mode == "explicit" else contextlib.nullcontext()
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(32, 8)) / 6, jnp.float32)

  def f(x, w):
    kw = {"out_sharding": P("data", None)} if mode == "explicit" else {}
    return jnp.sum(jnp.tanh(jnp.matmul(x, w, **kw)) ** 2)

  matmul = "float8" if recipe == "float8" else None
  fast = ols.autocast(
    f, compute_dtype=jnp.bfloat16 if matmul else jnp.float16, matmul=matmul
  )
  want = jax.value_and_grad(f, argnums=(0, 1))(x, w)
  with context:
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    ws = jax.device_put(w, NamedSharding(mesh, P("model", None)))
    got = jax.jit(jax.value_and_grad(fast, argnums=(0, 1)))(xs, ws)
  got = jax.device_get(got)
  # Within the format's resolution of float32's (float8: 3 mantissa bits).
  tol = 0.15 if matmul else 2e-2
  np.testing.assert_allclose(got[0], want[0], rtol=tol)
  for g, r in zip(got[1], want[1], strict=True):
    np.testing.assert_allclose(g, r, atol=tol * float(np.max(np.abs(r))))


@pytest.mark.parametrize("mode", MODES)
def test_a_float8_dot_tiny_on_each_device_is_multiplied_in_float32(mode):
  """(128 + 8) * 8 >= float8.SMALL_DOT, but each device's (32 + 8) * 8 is not.

  Under explicit sharding the type says each device's part, so that part's
  float8 operands are widened to float32 (behind the barrier that keeps the
  rounding); under automatic sharding the global shape decides.
  """
  from optax_lossscale._lowbit import float8 as _float8

  mesh = make_mesh(mode)
  context = jax.set_mesh(mesh) if mode == "explicit" else contextlib.nullcontext()
  x = jnp.ones((128, 8), jnp.float32)
  w = jnp.ones((8, 8), jnp.float32)
  dn = (((1,), (0,)), ((), ()))
  assert not _float8.small(x.shape, w.shape, dn)
  assert _float8.small((32, 8), w.shape, dn)
  f = ols.autocast(lambda x, w: x @ w, compute_dtype=jnp.bfloat16, matmul="float8")
  with context:
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    ws = jax.device_put(w, NamedSharding(mesh, P()))
    if mode == "explicit":
      assert _float8._device_shape(xs) == (32, 8)
      assert _float8._device_shape(ws) == (8, 8)
      both = jax.device_put(x, NamedSharding(mesh, P(("data", "model"), None)))
      assert _float8._device_shape(both) == (16, 8)
    jaxpr = jax.make_jaxpr(f)(xs, ws).jaxpr
    got = jax.jit(f)(xs, ws)
  dots = [e for e in jaxprs.eqns(jaxpr) if e.primitive.name == "dot_general"]
  assert len(dots) == 1
  widened = {v.aval.dtype for v in dots[0].invars} == {jnp.dtype(jnp.float32)}
  assert widened == (mode == "explicit"), dots[0]
  np.testing.assert_array_equal(jax.device_get(got), np.full((128, 8), 8.0))
