"""Property tests: the library against the pure-Python model of the exact rule."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import MegatronDynamicGradScaler, ReferenceDynamicScale

import optax_lossscale as ols

SETTINGS = settings(
  max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def configs(draw):
  lo = draw(st.sampled_from([2.0**-126, 2.0**-10, 0.5, 1.0, 3.0]))
  hi = draw(st.sampled_from([2.0**12, 2.0**20, 2.0**100, 2.0**126]))
  return dict(
    initial_scale=draw(st.sampled_from([lo, 1.0, 7.0, 2.0**10, hi])),
    growth_interval=draw(st.integers(1, 6)),
    growth_factor=draw(st.sampled_from([2.0, 1.5, 3.0, 1.0001, 10.0])),
    backoff_factor=draw(st.sampled_from([0.5, 0.25, 0.9, 0.1, 1e-3])),
    min_scale=lo,
    max_scale=hi,
    hysteresis=draw(st.integers(1, 4)),
  )


def _valid(cfg):
  return cfg["min_scale"] <= cfg["initial_scale"] <= cfg["max_scale"]


finite_sequences = st.lists(st.booleans(), min_size=1, max_size=80)


def _assert_same(ours, ref, step):
  assert np.float32(ours.loss_scale) == ref.loss_scale, step
  assert int(ours.good_steps) == ref.good_steps, step
  assert int(ours.hysteresis_left) == max(ref.hysteresis_left, 0), step
  assert int(ours.skipped_steps) == ref.skipped_steps, step
  assert int(ours.consecutive_skips) == ref.consecutive_skips, step


@SETTINGS
@given(cfg=configs(), pattern=finite_sequences)
def test_core_matches_reference(cfg, pattern):
  if not _valid(cfg):
    return
  ours = ols.porting.DynamicLossScale(**cfg)
  ref = ReferenceDynamicScale(**cfg)
  adjust = jax.jit(lambda ls, f: ls.adjust(f))
  for step, finite in enumerate(pattern):
    ours, applied = adjust(ours, jnp.asarray(finite))
    assert bool(applied) == ref.step(finite), step
    _assert_same(ours, ref, step)
    scale = float(ours.loss_scale)
    assert np.isfinite(scale) and scale >= float(np.finfo(np.float32).tiny)


@SETTINGS
@given(cfg=configs(), pattern=finite_sequences)
def test_hysteresis_follows_megatron(cfg, pattern):
  # Megatron has no ceiling: keep the scale far from ours.
  cfg = dict(
    cfg,
    max_scale=2.0**126,
    min_scale=2.0**-126,
    initial_scale=1.0,
    growth_factor=2.0,
    backoff_factor=0.5,
  )
  ours = ols.porting.DynamicLossScale(**cfg)
  meg = MegatronDynamicGradScaler(
    cfg["initial_scale"],
    cfg["min_scale"],
    cfg["growth_factor"],
    cfg["backoff_factor"],
    cfg["growth_interval"],
    cfg["hysteresis"],
  )
  adjust = jax.jit(lambda ls, f: ls.adjust(f)[0])
  for finite in pattern:
    ours = adjust(ours, jnp.asarray(finite))
    meg.update(found_inf=not finite)
    assert np.float32(ours.loss_scale) == meg.scale


bad_values = st.sampled_from([np.inf, -np.inf, np.nan])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
  cfg=configs(),
  steps=st.lists(
    st.tuples(st.booleans(), bad_values, st.integers(0, 2)), min_size=1, max_size=40
  ),
  dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]),
)
def test_transformation_matches_reference(cfg, steps, dtype):
  """Whole optimizer: sgd on unscaled grads when finite, nothing otherwise."""
  if not _valid(cfg):
    return
  lr = 0.5
  params = {
    "a": jnp.zeros((3,), jnp.float32),
    "b": jnp.zeros((2, 2), dtype),
    "c": [jnp.zeros((), jnp.float32)],
  }
  tx = ols.dynamic_loss_scale(optax.sgd(lr), **cfg)
  state = tx.init(params)
  ref = ReferenceDynamicScale(**cfg)
  update = jax.jit(tx.update)
  expected = params
  p = params
  for step, (finite, bad, where) in enumerate(steps):
    scale = np.float32(ols.get_scale(state))
    # Gradient entries that are exact multiples of the scale (0.25 * scale is
    # exact in every dtype when it does not overflow).
    grads = jax.tree.map(
      lambda x, s=scale: (jnp.full(x.shape, 0.25, jnp.float32) * s).astype(x.dtype),
      params,
    )
    leaf_finite = all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    if not finite:
      leaf = ["a", "b", "c"][where]
      if leaf == "c":
        grads["c"] = [jnp.asarray(bad, jnp.float32)]
      else:
        grads[leaf] = grads[leaf].at[(0,) * grads[leaf].ndim].set(bad)
    truly_finite = finite and leaf_finite
    updates, state = update(grads, state, p)
    p = optax.apply_updates(p, updates)
    applied = ref.step(truly_finite)
    if applied:  # sgd by hand, on gradients unscaled by hand
      expected = jax.tree.map(
        lambda e, g, s=scale: (
          e + (g.astype(jnp.float32) * (np.float32(1) / s)).astype(g.dtype) * -lr
        ),
        expected,
        grads,
      )
    _assert_same(state, ref, step)
    if not applied:
      for u in jax.tree.leaves(updates):
        assert not np.any(np.asarray(u, np.float64)), step
  for got, want in zip(jax.tree.leaves(p), jax.tree.leaves(expected), strict=True):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(
      np.asarray(got, np.float64), np.asarray(want, np.float64)
    )
