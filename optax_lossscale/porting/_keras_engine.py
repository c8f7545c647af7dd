"""Keras' base optimizer step: clipping, weight decay, accumulation, the EMA.

What ``keras.optimizers.Optimizer.apply`` (Keras 3) and
``tf_keras.optimizers.Optimizer.apply_gradients`` (tf_keras 2.x) do around
an optimizer's own formula (:mod:`._keras_math`), in their order and with
their constants, on a :class:`KerasOptimizerState`:

* Keras 3: with ``gradient_accumulation_steps`` the gradients are summed
  and, every that many calls, their mean is clipped and applied (weight
  decay first, then the formula); ``iterations`` is the count of calls
  divided by the accumulation (Adam's step, the EMA's first step and its
  overwrite use it; a learning-rate schedule gets the count of calls); the
  EMA is updated on every call, starting at the first new weights.
* tf_keras: no accumulation; the EMA starts from the initial weights and
  every step, skipped ones included, counts in ``iterations``.

Before its first step Keras 3's average is zeros (what
``finalize_variable_values`` would then swap in), tf_keras' the initial
weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_lossscale._base import tree as _tree
from optax_lossscale.porting import _keras_math
from optax_lossscale.porting._keras_math import OptimizerSpec

__all__ = [
  "BaseArgs",
  "KerasOptimizerState",
  "init",
  "learning_rate",
  "skipped",
  "step",
]

_F32 = jnp.float32
_I32 = jnp.int32


class KerasOptimizerState(NamedTuple):
  """State of a Keras optimizer inside the porting ``LossScaleOptimizer``.

  Attributes:
    iterations: int32, Keras' ``_iterations``: the calls that reached the
      optimizer (Keras 3: applied micro-steps; tf_keras: every step, skipped
      ones included).
    learning_rate: float32, the learning rate (a schedule's last value).
    slots: the optimizer's variables, ``{name: tree like the parameters}``.
    accumulators: the summed gradients of the window, or ``None``.
    ema: the moving average of the weights, or ``None``.
  """

  iterations: jax.Array
  learning_rate: jax.Array
  slots: dict[str, Any]
  accumulators: Any = None
  ema: Any = None


@dataclasses.dataclass(frozen=True)
class BaseArgs:
  """The base optimizer's arguments (validated by the caller)."""

  weight_decay: float | None = None
  clipnorm: float | None = None
  clipvalue: float | None = None
  global_clipnorm: float | None = None
  use_ema: bool = False
  ema_momentum: float = 0.99
  ema_overwrite_frequency: int | None = None
  gradient_accumulation_steps: int | None = None


def _c(x: Any) -> jax.Array:
  return jnp.asarray(x, _F32)


def _learning_rate(spec: OptimizerSpec, iterations: jax.Array, held=None) -> jax.Array:
  """A schedule's value at ``iterations``, else the rate the state holds
  (Keras' variable, which ``set_learning_rate`` replaces)."""
  lr = spec["learning_rate"]
  if callable(lr):
    return _c(lr(iterations))
  return _c(lr if held is None else held)  # a restored Python number too


def learning_rate(spec: OptimizerSpec, state: KerasOptimizerState) -> jax.Array:
  """The rate the next step uses (Keras' ``optimizer.learning_rate``)."""
  return _learning_rate(spec, state.iterations, state.learning_rate)


def init(spec: OptimizerSpec, base: BaseArgs, params: Any) -> KerasOptimizerState:
  """A fresh state (the EMA: zeros for Keras 3, ``params`` for tf_keras).
  Every parameter is a real array (a Keras variable), or a ValueError names it."""
  _tree.array_leaves(params, "parameter")
  check_real(params, "parameter")
  copy = lambda p: jnp.array(p, copy=True)  # noqa: E731
  zeros = lambda p: jnp.zeros(jnp.shape(p), p.dtype)  # noqa: E731
  it = jnp.zeros([], _I32)
  return KerasOptimizerState(
    iterations=it,
    learning_rate=_learning_rate(spec, it),
    slots=_keras_math.init_slots(spec, params),
    accumulators=(
      jax.tree.map(zeros, params) if base.gradient_accumulation_steps else None
    ),
    # Keras 3's average starts at zeros (the first step overwrites it with
    # the new weights); tf_keras' at the initial weights.
    ema=jax.tree.map(copy if spec.legacy else zeros, params) if base.use_ema else None,
  )


def _clip(spec: OptimizerSpec, base: BaseArgs, grads: list) -> list:
  if base.clipnorm:  # tf.clip_by_norm, which Keras 3 calls on TensorFlow

    def one(g):
      c = _c(base.clipnorm).astype(g.dtype)
      l2sum = jnp.sum(g * g)
      pred = l2sum > 0
      l2norm = jnp.where(pred, jnp.sqrt(jnp.where(pred, l2sum, 1.0)), l2sum)
      return (g * c) / jnp.maximum(l2norm, c)

    return [one(g) for g in grads]
  if base.global_clipnorm:
    c = base.global_clipnorm
    if spec.legacy:  # tf.clip_by_global_norm: sqrt(2 * sum of l2_loss)
      halves = jnp.stack([jnp.sum(g * g) / 2 for g in grads])
      norm = jnp.sqrt(jnp.sum(halves) * 2)
      inv_c = _c(1.0) / _c(c)
    else:  # keras.src.optimizers.base_optimizer.clip_by_global_norm
      norm = jnp.sqrt(jnp.sum(jnp.stack([jnp.sum(jnp.square(g)) for g in grads])))
      inv_c = _c(1.0 / c)
    scale = _c(c) * jnp.minimum(1.0 / norm, inv_c)
    scale = scale + (norm - norm)  # NaN when the norm is not finite
    return [g * scale for g in grads]
  if base.clipvalue:
    v = _c(base.clipvalue)
    return [jnp.clip(g, -v.astype(g.dtype), v.astype(g.dtype)) for g in grads]
  return grads


def _update(spec, base, grads, params, slots, lr, iterations):
  """Clip, decay, the formula: every leaf's new value and slots."""
  floats = [_tree.is_float_array(p) for p in params]
  clipped = _clip(spec, base, [g for g, f in zip(grads, floats, strict=True) if f])
  grads = [clipped.pop(0) if f else g for g, f in zip(grads, floats, strict=True)]
  if base.weight_decay is not None:  # variable.assign_sub(variable * wd * lr)
    wd = _c(base.weight_decay)
    params = [
      p - p * wd.astype(p.dtype) * lr.astype(p.dtype) if f else p
      for p, f in zip(params, floats, strict=True)
    ]
  new_params, new_slots = [], {k: [] for k in slots}
  for i, (g, p) in enumerate(zip(grads, params, strict=True)):
    leaf_slots = {k: v[i] for k, v in slots.items()}
    if _tree.is_float_array(p):  # other leaves are not Keras variables
      p, leaf_slots = _keras_math.update_leaf(spec, g, p, leaf_slots, lr, iterations)
    new_params.append(p)
    for k, v in leaf_slots.items():
      new_slots[k].append(v)
  return new_params, new_slots


def _wider(g: Any, p: Any) -> Any:
  """The dtype Keras 3's unscaled gradient ``g`` has for variable ``p``."""
  if not (_tree.is_float_array(g) and _tree.is_float_array(p)):
    return p.dtype if _tree.is_float_array(p) else jnp.asarray(g).dtype
  return jnp.promote_types(g.dtype, p.dtype)


def _keras3_average(a: jax.Array, p: jax.Array, iters: Any, momentum: float) -> Any:
  """Keras 3's moving average: ``m = cast(iterations != 0, dtype) *
  ema_momentum`` and ``1 - m``, both in the variable's dtype (their sum is
  1 there, as in Keras)."""
  m = (iters != 0).astype(a.dtype) * jnp.asarray(momentum, a.dtype)
  return m * a + (1 - m) * p


def step(
  spec: OptimizerSpec,
  base: BaseArgs,
  grads: Any,
  state: KerasOptimizerState,
  params: Any,
) -> tuple[Any, KerasOptimizerState]:
  """An applied step on unscaled ``grads``: ``(new params, new state)``."""
  leaves, treedef = jax.tree.flatten(params)
  g = treedef.flatten_up_to(grads)
  # tf_keras' gradients are in the variables' dtypes; Keras 3's stay as
  # unscaled (float32 for half variables) until the formula casts them.
  g = [
    jnp.asarray(x).astype(
      (p.dtype if _tree.is_float_array(p) else jnp.asarray(x).dtype)
      if spec.legacy
      else _wider(x, p)
    )
    for x, p in zip(g, leaves, strict=True)
  ]
  slots = {k: treedef.flatten_up_to(v) for k, v in state.slots.items()}
  it = jnp.asarray(state.iterations, _I32)  # a restored Python number too
  gas = base.gradient_accumulation_steps
  lr = _learning_rate(spec, it, state.learning_rate)
  iters = it // gas if gas else it  # Keras' self.iterations
  acc = None
  if gas:
    acc = treedef.flatten_up_to(state.accumulators)
    is_update = (it + 1) % gas == 0
    mean = [
      (x + a) / _c(gas) if _tree.is_float_array(a) else x
      for x, a in zip(g, acc, strict=True)
    ]
    new_p, new_slots = _update(spec, base, mean, leaves, slots, lr, iters)
    new_p = [jnp.where(is_update, n, p) for n, p in zip(new_p, leaves, strict=True)]
    new_slots = {
      k: [jnp.where(is_update, n, o) for n, o in zip(v, slots[k], strict=True)]
      for k, v in new_slots.items()
    }
    acc = [  # assigned to the accumulator: in its (the variable's) dtype
      jnp.where(is_update, jnp.zeros_like(a), (x + a).astype(a.dtype))
      for x, a in zip(g, acc, strict=True)
    ]
  else:
    new_p, new_slots = _update(spec, base, g, leaves, slots, lr, iters)
  ema = None
  if base.use_ema:
    ema = treedef.flatten_up_to(state.ema)
    if spec.legacy:  # ema_momentum * average + (1 - ema_momentum) * var
      m, one_minus = _c(base.ema_momentum), _c(1 - base.ema_momentum)
      ema = [
        m.astype(a.dtype) * a + one_minus.astype(a.dtype) * p
        if _tree.is_float_array(p)
        else a
        for a, p in zip(ema, new_p, strict=True)
      ]
    else:  # cast(iterations != 0, dtype) * ema_momentum, 1 - it: in the dtype
      ema = [
        _keras3_average(a, p, iters, base.ema_momentum)
        if _tree.is_float_array(p)
        else a
        for a, p in zip(ema, new_p, strict=True)
      ]
    if base.ema_overwrite_frequency:
      overwrite = (iters + 1) % base.ema_overwrite_frequency == 0
      new_p = [
        jnp.where(overwrite, swapped_in(p, a), p)
        for a, p in zip(ema, new_p, strict=True)
      ]
    ema = treedef.unflatten(ema)
  new_state = KerasOptimizerState(
    iterations=(it + 1).astype(_I32),
    learning_rate=lr,
    slots={k: treedef.unflatten(v) for k, v in new_slots.items()},
    accumulators=None if acc is None else treedef.unflatten(acc),
    ema=ema,
  )
  return treedef.unflatten(new_p), new_state


def check_real(tree: Any, what: str) -> None:
  """A ValueError naming the first complex leaf of ``tree``: Keras' formulas
  square a gradient where a complex one needs ``|g|**2``, and TensorFlow
  and Keras refuse complex variables."""
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if jnp.iscomplexobj(x):
      raise ValueError(
        f"The {what} at {_tree.keystr(path)} is complex ({jnp.result_type(x)}): "
        "Keras' formulas, which an optimizer given by name runs, are written "
        "for real variables (TensorFlow and Keras refuse complex ones). Pass an "
        "optax transformation, such as optax.adam(...), which takes complex "
        "parameters."
      )


def swapped_in(p: Any, average: jax.Array) -> Any:
  """The average in ``p``'s place, in its dtype; ``p`` where it is not a
  floating array (a counter or a step: never averaged)."""
  return average.astype(p.dtype) if _tree.is_float_array(p) else p


def skipped(spec: OptimizerSpec, state: KerasOptimizerState) -> KerasOptimizerState:
  """The state after a skipped step: tf_keras counts it in ``iterations``."""
  if not spec.legacy:
    return state
  return state._replace(iterations=jnp.asarray(state.iterations, _I32) + 1)
