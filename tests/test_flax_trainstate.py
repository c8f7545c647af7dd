"""Flax training states: one path with or without a loss scale; skipped steps keep all.

``LossScaleTrainState`` without a loss scale is Flax's ``TrainState`` (the
same numbers, the same computation); with one, a skipped step keeps the
fields passed to ``apply_gradients`` (``batch_stats``) and ``all_steps``
counts it. ``nnx_update(before=...)`` does the same for NNX BatchNorm
statistics, and ``nnx_value_and_grad`` works without a loss scale.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("flax", reason="the Flax tests need flax")
pytestmark = pytest.mark.standard_promotion  # Flax's own code

import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from flax.training import train_state  # noqa: E402

import optax_lossscale as ols  # noqa: E402
from optax_lossscale.flax import (  # noqa: E402
  LossScaleTrainState,
  nnx_update,
  nnx_value_and_grad,
)


class Net(nn.Module):
  @nn.compact
  def __call__(self, x, train=True):
    x = nn.Dense(8)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
    return nn.Dense(1)(nn.relu(x))


class State(LossScaleTrainState):
  batch_stats: Any


class PlainState(train_state.TrainState):
  batch_stats: Any


MODEL = Net()
X = jax.random.normal(jax.random.key(1), (16, 4))
Y = jnp.sum(X, axis=1, keepdims=True)
NAN_X = X.at[3, 2].set(jnp.nan)


def _create(cls, tx):
  v = MODEL.init(jax.random.key(0), X[:2], train=False)
  return cls.create(
    apply_fn=MODEL.apply, params=v["params"], tx=tx, batch_stats=v["batch_stats"]
  )


def _loss_fn(state, x):
  def loss_fn(params):
    out, upd = state.apply_fn(
      {"params": params, "batch_stats": state.batch_stats},
      x,
      mutable=["batch_stats"],
    )
    return jnp.mean((out - Y) ** 2), upd

  return loss_fn


@jax.jit
def _step(state, x):
  (loss, upd), grads = state.value_and_grad(_loss_fn(state, x), has_aux=True)(
    state.params
  )
  return state.apply_gradients(grads=grads, batch_stats=upd["batch_stats"]), loss


@jax.jit
def _plain_step(state, x):
  (loss, upd), grads = jax.value_and_grad(_loss_fn(state, x), has_aux=True)(
    state.params
  )
  return state.apply_gradients(grads=grads, batch_stats=upd["batch_stats"]), loss


def _equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


def test_without_a_loss_scale_it_is_flax_trainstate():
  state = _create(State, optax.adam(1e-2))
  plain = _create(PlainState, optax.adam(1e-2))
  assert not state.has_loss_scale
  for _ in range(3):
    state, loss = _step(state, X)
    plain, plain_loss = _plain_step(plain, X)
    assert float(loss) == float(plain_loss)
  _equal(
    (state.params, state.batch_stats, state.opt_state),
    (plain.params, plain.batch_stats, plain.opt_state),
  )
  assert int(state.step) == int(plain.step) == 3 == int(state.all_steps)
  assert float(state.loss_scale) == 1.0
  # Float32 runs pay nothing: the same computation as Flax's own TrainState.
  prims = lambda f, s: [e.primitive.name for e in jax.make_jaxpr(f)(s, X).eqns]  # noqa: E731
  assert prims(_step, state) == prims(_plain_step, plain)
  with pytest.raises(ValueError, match="loss-scale state"):
    state.diagnostics  # noqa: B018


def test_without_a_loss_scale_value_goes_to_the_optimizer():
  seen = []

  def update(updates, state, params=None, *, value=None, **extra):
    del params, extra
    seen.append(value)
    return updates, state

  tx = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
  state = _create(State, tx)
  state.apply_gradients(grads=state.params, value=jnp.float32(2.5))
  assert len(seen) == 1 and float(seen[0]) == 2.5


def test_a_skipped_step_keeps_batch_stats_and_counts_in_all_steps():
  state = _create(State, ols.dynamic_loss_scale(optax.adam(1e-2)))
  state, _ = _step(state, X)
  before = state
  state, loss = _step(state, NAN_X)
  assert not np.isfinite(float(loss))
  assert bool(state.diagnostics["last_step_skipped"])
  # Flax's DynamicScale loops would take the NaN statistics here.
  _, upd = _loss_fn(before, NAN_X)(before.params)
  assert not np.all(np.isfinite(jax.tree.leaves(upd)[0]))
  _equal((state.params, state.batch_stats), (before.params, before.batch_stats))
  assert int(state.step) == 1 and int(state.all_steps) == 2
  after, _ = _step(state, X)  # an applied step takes the new statistics
  new = jax.jit(lambda s: _loss_fn(s, X)(s.params)[1]["batch_stats"])(state)
  for a, b, old in zip(
    *map(jax.tree.leaves, (after.batch_stats, new, state.batch_stats)), strict=True
  ):
    np.testing.assert_allclose(a, b, rtol=1e-6)
    assert np.max(np.abs(a - old)) > 1e-3
  assert int(after.step) == 2 and int(after.all_steps) == 3


def test_a_field_of_another_structure_is_refused_by_name():
  state = _create(State, ols.dynamic_loss_scale(optax.sgd(0.1)))
  grads = jax.tree.map(jnp.zeros_like, state.params)
  with pytest.raises(ValueError, match=r"apply_gradients\(batch_stats=\.\.\.\)"):
    state.apply_gradients(grads=grads, batch_stats={"other": jnp.ones(2)})
  stats = jax.tree.map(lambda a: a.astype(jnp.float16), state.batch_stats)
  with pytest.raises(ValueError, match="float16"):
    state.apply_gradients(grads=grads, batch_stats=stats)
  # A static field is replaced as given.
  f = lambda *a, **k: None  # noqa: E731
  assert state.apply_gradients(grads=grads, apply_fn=f).apply_fn is f


# --- NNX ----------------------------------------------------------------------


class NNXNet(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(4, 8, rngs=rngs)
    self.norm = nnx.BatchNorm(8, momentum=0.5, rngs=rngs)
    self.out = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.norm(self.dense(x))))


def _nnx_loss(model, x):
  return jnp.mean((model(x) - Y) ** 2)


@nnx.jit
def _nnx_step(model, optimizer, x):
  before = nnx.as_pure(nnx.state(model, nnx.BatchStat))
  loss, grads = nnx_value_and_grad(_nnx_loss)(optimizer, model, x)
  nnx_update(optimizer, model, grads, before=before)
  return loss


def _stats(model):
  return nnx.as_pure(nnx.state(model, nnx.BatchStat))


def test_nnx_update_keeps_batch_stats_on_a_skipped_step():
  model = NNXNet(nnx.Rngs(0))
  optimizer = nnx.Optimizer(
    model, ols.dynamic_loss_scale(optax.adam(1e-2)), wrt=nnx.Param
  )
  _nnx_step(model, optimizer, X)
  stats, params = _stats(model), nnx.as_pure(nnx.state(model, nnx.Param))
  assert not np.isfinite(float(_nnx_step(model, optimizer, NAN_X)))
  assert bool(ols.diagnostics(optimizer)["last_step_skipped"])
  _equal(_stats(model), stats)
  _equal(nnx.as_pure(nnx.state(model, nnx.Param)), params)
  _nnx_step(model, optimizer, X)  # applied: the statistics move
  assert not bool(ols.diagnostics(optimizer)["last_step_skipped"])
  moved = [
    not np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(_stats(model)), jax.tree.leaves(stats), strict=True)
  ]
  assert all(moved)


def test_nnx_update_refuses_a_before_it_cannot_keep():
  model = NNXNet(nnx.Rngs(0))
  optimizer = nnx.Optimizer(
    model, ols.dynamic_loss_scale(optax.sgd(0.1)), wrt=nnx.Param
  )
  _, grads = nnx_value_and_grad(_nnx_loss)(optimizer, model, X)
  live = nnx.state(model, nnx.BatchStat)
  with pytest.raises(ValueError, match="model's own variables"):
    nnx_update(optimizer, model, grads, before=live)
  other = nnx.from_flat_state([(("elsewhere", "mean"), jnp.zeros(8))])
  with pytest.raises(ValueError, match="are not variables of the model"):
    nnx_update(optimizer, model, grads, before=other)


def test_nnx_value_and_grad_without_a_loss_scale_is_nnx_value_and_grad():
  model = NNXNet(nnx.Rngs(0))
  twin = NNXNet(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  loss, grads = nnx_value_and_grad(_nnx_loss)(optimizer, model, X)
  ref_loss, ref = nnx.value_and_grad(_nnx_loss)(twin, X)
  assert float(loss) == float(ref_loss)
  _equal(grads, ref)
  nnx_update(optimizer, model, grads, before=_stats(twin))  # nothing to skip
  _equal(_stats(model), _stats(twin))
