"""Flax training states: one path with or without a loss scale; skipped steps keep all.

``LossScaleTrainState`` without a loss scale is Flax's ``TrainState`` (the
same numbers, the same computation); with one, a skipped step keeps the
fields passed to ``apply_gradients`` (``batch_stats``) and ``all_steps``
counts it. ``nnx_update(before=...)`` does the same for NNX BatchNorm
statistics, and ``nnx_value_and_grad`` works without a loss scale;
``nnx_update`` warns about gradients that ``nnx_value_and_grad`` did not
return (those of the unscaled loss make steps the scale times too small).
"""

import warnings
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
from test_classes import as_restored_without_target  # noqa: E402

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


# --- NNX: gradients of the scaled loss, or not ---------------------------------
#
# A loss-scaled optimizer divides its gradients by the scale, so gradients of
# the unscaled loss make an SGD step the scale times too small. nnx_update knows
# the gradients nnx_value_and_grad returned and warns about others;
# optimizer.update (Flax's) cannot tell. Each case's step is checked against
# plain optax SGD on nnx.grad's gradients of the unscaled loss.

_LR = 0.1


def _linear_loss(model, x):
  return jnp.mean((model(x) - Y) ** 2)


def _vg_helper(optimizer, model):
  return nnx_value_and_grad(_linear_loss)(optimizer, model, X)[1]


def _vg_plain(optimizer, model):
  del optimizer
  return nnx.value_and_grad(_linear_loss)(model, X)[1]


def _grad_of_scaled(optimizer, model):
  scale = ols.get_scale(optimizer)
  return nnx.grad(lambda m: _linear_loss(m, X) * scale)(model)


def _vg_helper_mapped(optimizer, model):
  return jax.tree.map(lambda g: g * 1.0, _vg_helper(optimizer, model))


# name: (gradients, whether of the scaled loss, whether nnx_value_and_grad's own)
_SOURCES = {
  "nnx_value_and_grad": (_vg_helper, True, True),
  "nnx.value_and_grad": (_vg_plain, False, False),
  "nnx.grad(loss * scale)": (_grad_of_scaled, True, False),
  "nnx_value_and_grad, tree-mapped": (_vg_helper_mapped, True, False),
}

_ENTRIES = {
  "nnx_update": lambda opt, m, g: nnx_update(opt, m, g),
  "nnx_update(assume_scaled=True)": lambda opt, m, g: nnx_update(
    opt, m, g, assume_scaled=True
  ),
  "optimizer.update": lambda opt, m, g: opt.update(m, g),
}


def _params(model):
  return nnx.as_pure(nnx.state(model, nnx.Param))


def _plain_sgd_step(model, divide_by):
  """The parameters after plain optax SGD on nnx.grad's gradients / ``divide_by``."""
  params = _params(model)
  grads = nnx.as_pure(nnx.grad(_linear_loss)(model, X))
  grads = jax.tree.map(lambda g: g / divide_by, grads)
  tx = optax.sgd(_LR)
  updates, _ = tx.update(grads, tx.init(params), params)
  return optax.apply_updates(params, updates)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
@pytest.mark.parametrize("entry", list(_ENTRIES))
@pytest.mark.parametrize("source", list(_SOURCES))
def test_gradients_of_the_unscaled_loss_are_warned_about_where_they_can_be(
  source, entry, jit
):
  make_grads, of_scaled_loss, own = _SOURCES[source]
  model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(
    model, ols.dynamic_loss_scale(optax.sgd(_LR)), wrt=nnx.Param
  )
  scale = float(ols.get_scale(optimizer))
  assert scale == 2.0**15
  expected = _plain_sgd_step(model, 1.0 if of_scaled_loss else scale)
  before = _params(model)

  def step(model, optimizer):
    _ENTRIES[entry](optimizer, model, make_grads(optimizer, model))

  step = nnx.jit(step) if jit else step
  warns = entry == "nnx_update" and not own
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    step(model, optimizer)
  told = [w for w in caught if "nnx_value_and_grad() did not return" in str(w.message)]
  assert len(told) == int(warns), [str(w.message) for w in caught]
  assert len(caught) == len(told), [str(w.message) for w in caught]
  assert int(ols.diagnostics(optimizer)["skipped_steps"]) == 0
  _same_step(model, before, expected)


def _same_step(model, before, expected):
  """The step ``model`` took from ``before`` is the one to ``expected`` (non-zero)."""
  got = jax.tree.map(jnp.subtract, _params(model), before)
  want = jax.tree.map(jnp.subtract, expected, before)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert float(jnp.max(jnp.abs(w))) > 0
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=0)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_gradients_from_another_nnx_jit_need_assume_scaled(jit):
  model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(
    model, ols.dynamic_loss_scale(optax.sgd(_LR)), wrt=nnx.Param
  )
  expected = _plain_sgd_step(model, 1.0)
  grads = nnx.jit(_vg_helper)(optimizer, model)  # new arrays: not noted
  update = nnx.jit(nnx_update, static_argnames="assume_scaled") if jit else nnx_update
  with pytest.warns(UserWarning, match="assume_scaled=True"):
    update(optimizer, model, grads)
  model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(
    model, ols.dynamic_loss_scale(optax.sgd(_LR)), wrt=nnx.Param
  )
  before = _params(model)
  grads = nnx.jit(_vg_helper)(optimizer, model)
  update(optimizer, model, grads, assume_scaled=True)  # no warning: an error here
  _same_step(model, before, expected)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_scaled_gradients_for_an_optimizer_without_a_loss_scale_are_refused(jit):
  model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
  scaled = nnx.Optimizer(model, ols.dynamic_loss_scale(optax.sgd(_LR)), wrt=nnx.Param)
  plain = nnx.Optimizer(model, optax.sgd(_LR), wrt=nnx.Param)
  before = _params(model)

  def step(model, scaled, plain):
    nnx_update(plain, model, _vg_helper(scaled, model))

  step = nnx.jit(step) if jit else step
  with pytest.raises(ValueError, match="holds no loss scale"):
    step(model, scaled, plain)
  _equal(_params(model), before)


class _Drop(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(4, 8, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.out = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(self.drop(nnx.relu(self.dense(x))))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
@pytest.mark.parametrize("replay", [False, True], ids=["rngs-move-on", "rngs-kept"])
def test_a_skipped_step_keeps_the_dropout_count_only_when_before_holds_it(replay, jit):
  model = _Drop(nnx.Rngs(0, dropout=1))
  optimizer = nnx.Optimizer(
    model, ols.dynamic_loss_scale(optax.adam(1e-2)), wrt=nnx.Param
  )

  def step(model, optimizer, x):
    before = nnx.as_pure(nnx.state(model, nnx.RngCount)) if replay else None
    _, grads = nnx_value_and_grad(_nnx_loss)(optimizer, model, x)
    nnx_update(optimizer, model, grads, before=before)

  step = nnx.jit(step) if jit else step
  count = lambda: int(model.drop.rngs.count[...])  # noqa: E731
  step(model, optimizer, X)
  assert count() == 1  # one forward pass, one mask
  step(model, optimizer, NAN_X)
  assert int(ols.diagnostics(optimizer)["skipped_steps"]) == 1
  assert count() == (1 if replay else 2)


@pytest.mark.parametrize(
  "read",
  [
    lambda s: s.loss_scale,
    lambda s: s.has_loss_scale,
    lambda s: s.all_steps,
    lambda s: s.value_and_grad(lambda p: 0.0),
  ],
  ids=["loss_scale", "has_loss_scale", "all_steps", "value_and_grad"],
)
def test_an_opt_state_restored_without_a_target_is_refused_not_read_as_unscaled(read):
  """It was read as "no loss scale": a scale of 1, unscaled gradients."""
  state = _create(State, ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=1024.0))
  restored = state.replace(opt_state=as_restored_without_target(state.opt_state))
  with pytest.raises(ValueError, match="restored without a target"):
    read(restored)


class Epoch(LossScaleTrainState):
  epoch: Any = None


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_a_python_number_field_keeps_its_value_on_a_skipped_step(jitted):
  state = Epoch.create(
    apply_fn=None,
    params={"w": jnp.ones(3)},
    tx=ols.dynamic_loss_scale(optax.sgd(0.1)),
    epoch=0,
  )
  step = lambda s, g: s.apply_gradients(grads=g, epoch=1)  # noqa: E731
  step = jax.jit(step) if jitted else step
  skipped = step(state, {"w": jnp.full(3, jnp.nan)})
  applied = step(state, {"w": jnp.ones(3)})
  assert int(skipped.epoch) == 0 and int(applied.epoch) == 1
