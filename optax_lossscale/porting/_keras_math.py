"""Keras' optimizer formulas (``update_step``), operation for operation, in JAX.

Keras 3 (``keras.optimizers``) and tf_keras 2.x (``tf_keras.optimizers``,
what ``tf.keras`` was up to TensorFlow 2.15) write each optimizer's update
as a sequence of float32 operations; this module writes the same sequence,
in the same order, with the same constants: a Python float hyper-parameter
is rounded to float32 where Keras casts it, and an expression of Python
floats (``1 - beta_1``) is computed in Python first, as Keras computes it.
:func:`spec` validates an optimizer's name and configuration into a
hashable :class:`OptimizerSpec`; :func:`init_slots` and :func:`update_leaf`
are its state and its step for one parameter.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from optax_lossscale._base import validate as _validate

__all__ = ["DEFAULTS", "OptimizerSpec", "init_slots", "spec", "update_leaf"]

_F32 = jnp.float32

#: Each optimizer's own hyper-parameters and Keras' defaults (the same in
#: Keras 3 and tf_keras). ``weight_decay`` is the base optimizer's, except
#: for AdamW, whose default is 0.004.
DEFAULTS: dict[str, dict[str, Any]] = {
  "sgd": {"learning_rate": 0.01, "momentum": 0.0, "nesterov": False},
  "adam": {
    "learning_rate": 0.001,
    "beta_1": 0.9,
    "beta_2": 0.999,
    "epsilon": 1e-7,
    "amsgrad": False,
  },
  "adamw": {
    "learning_rate": 0.001,
    "weight_decay": 0.004,
    "beta_1": 0.9,
    "beta_2": 0.999,
    "epsilon": 1e-7,
    "amsgrad": False,
  },
  "rmsprop": {
    "learning_rate": 0.001,
    "rho": 0.9,
    "momentum": 0.0,
    "epsilon": 1e-7,
    "centered": False,
  },
  "adagrad": {
    "learning_rate": 0.001,
    "initial_accumulator_value": 0.1,
    "epsilon": 1e-7,
  },
}
# The formulas that tf_keras writes differently from Keras 3 are written
# here for these (SGD's momentum order, its slot kept at momentum 0).
LEGACY = ("sgd", "adam", "adamw")
_BOOLS = ("nesterov", "amsgrad", "centered")


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  """A validated Keras optimizer: its name and hyper-parameters (static).

  ``learning_rate`` is a Python float or a schedule (a callable of the
  iteration count); ``legacy`` selects tf_keras' formulas.
  """

  name: str
  hyper: tuple[tuple[str, Any], ...]
  legacy: bool = False

  def __getitem__(self, key: str) -> Any:
    return dict(self.hyper)[key]


def spec(name: str, config: Mapping[str, Any], *, legacy: bool) -> OptimizerSpec:
  """The :class:`OptimizerSpec` of a Keras optimizer name and config.

  ``config`` holds the optimizer's own hyper-parameters by their Keras names
  (the base arguments such as ``clipnorm`` are taken out by the caller);
  missing ones get Keras' defaults.

  Raises:
    ValueError: an unknown name or hyper-parameter, or a bad value (named).
  """
  key = name.lower()
  if key not in DEFAULTS:
    raise ValueError(
      f"`inner_optimizer`: no Keras formula for {name!r} here; known: "
      f"{', '.join(sorted(DEFAULTS))}. Pass an optax transformation instead."
    )
  if legacy and key not in LEGACY:
    raise ValueError(
      f"`inner_optimizer`: tf_keras' formula for {name!r} is not written here "
      f"(legacy_keras=True knows {', '.join(LEGACY)}). Pass "
      "legacy_keras=False for Keras 3's."
    )
  unknown = sorted(set(config) - set(DEFAULTS[key]))
  if unknown:
    raise ValueError(
      f"`inner_optimizer` config for {key!r}: unknown argument(s) "
      f"{', '.join(map(repr, unknown))}; Keras' are "
      f"{', '.join(sorted(DEFAULTS[key]))} (and the base arguments)."
    )
  hyper = {**DEFAULTS[key], **config}
  for k, v in hyper.items():
    if k in _BOOLS:
      if not isinstance(v, bool):
        raise ValueError(f"`{k}` must be a bool, got {v!r}.")
    elif k == "learning_rate" and callable(v):
      _check_schedule(v)  # a schedule of the iteration count
    elif k in ("beta_1", "beta_2", "rho") or (key == "sgd" and k == "momentum"):
      # SGD's momentum too: Keras 3 and tf_keras refuse one outside [0, 1]
      hyper[k] = _validate.float_in(k, v, 0.0, 1.0)
    else:
      hyper[k] = _validate.float_in(k, v, 0.0, math.inf)
  if key == "adamw":
    hyper.pop("weight_decay")  # the base optimizer's decay: the caller's
  return OptimizerSpec(key, tuple(sorted(hyper.items())), bool(legacy))


def _check_schedule(schedule: Callable[..., Any]) -> None:
  """A ValueError unless ``schedule`` takes the iteration count (Keras'
  ``LearningRateSchedule`` does; a zero-argument callable, which Keras also
  takes, would fail inside ``init``)."""
  try:
    signature = inspect.signature(schedule)
  except (TypeError, ValueError):  # a builtin without one: taken as it is
    return
  try:
    signature.bind(0)
  except TypeError:
    raise ValueError(
      f"`learning_rate` {schedule!r}: a callable learning rate is a schedule, "
      "called with the iteration count; this one does not take it (a "
      "zero-argument callable: pass its value, or lambda step: ...)."
    ) from None


def _c(x: Any, dtype: Any = _F32) -> jax.Array:
  """A Python number as Keras casts it: rounded to float32 once, then to the
  variable's ``dtype`` (``ops.cast(self.momentum, variable.dtype)``), so
  that a half variable's step stays in its dtype as Keras'."""
  return jnp.asarray(x, _F32).astype(dtype)


def _slot_names(s: OptimizerSpec) -> tuple[str, ...]:
  if s.name == "sgd":
    return ("momentum",) if s.legacy or s["momentum"] != 0 else ()
  if s.name in ("adam", "adamw"):
    return ("m", "v", "v_hat") if s["amsgrad"] else ("m", "v")
  if s.name == "rmsprop":
    names = ["velocity"]
    if s["momentum"] > 0:
      names.append("momentum")
    if s["centered"]:
      names.append("average_gradient")
    return tuple(names)
  return ("accumulator",)


def init_slots(s: OptimizerSpec, params: Any) -> dict[str, Any]:
  """The optimizer's variables for ``params`` (zeros; Adagrad's fill)."""
  fill = s["initial_accumulator_value"] if s.name == "adagrad" else 0.0
  return {
    name: jax.tree.map(lambda p: jnp.full(jnp.shape(p), fill, p.dtype), params)
    for name in _slot_names(s)
  }


def update_leaf(
  s: OptimizerSpec,
  g: jax.Array,
  p: jax.Array,
  slots: dict[str, jax.Array],
  lr: jax.Array,
  iterations: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """One parameter's ``update_step``: ``(new parameter, new slots)``.

  ``lr`` is the float32 learning rate of this step, ``iterations`` Keras'
  ``self.iterations`` before it (Adam's bias correction uses it plus one).
  """
  g = g.astype(p.dtype)
  return _FORMULAS[s.name](s, g, p, dict(slots), lr.astype(p.dtype), iterations)


def _sgd(s, g, p, slots, lr, iterations):
  del iterations
  momentum = _c(s["momentum"], p.dtype)
  if not slots:  # Keras 3 at momentum 0: no slot
    return p - g * lr, slots
  m = slots["momentum"]
  if s.legacy:  # tf_keras: m = -g * lr + m * momentum
    m = -g * lr + m * momentum
    step = -g * lr + m * momentum if s["nesterov"] else m
  else:  # Keras 3: m = m * momentum - g * lr
    m = m * momentum - g * lr
    step = m * momentum - g * lr if s["nesterov"] else m
  return p + step, {"momentum": m}


def _adam(s, g, p, slots, lr, iterations):
  dt = p.dtype
  local_step = (iterations + 1).astype(dt)
  beta_1_power = jnp.power(_c(s["beta_1"], dt), local_step)
  beta_2_power = jnp.power(_c(s["beta_2"], dt), local_step)
  alpha = lr * jnp.sqrt(1 - beta_2_power) / (1 - beta_1_power)
  m = slots["m"] + (g - slots["m"]) * _c(1 - s["beta_1"], dt)
  v = slots["v"] + (jnp.square(g) - slots["v"]) * _c(1 - s["beta_2"], dt)
  new = {"m": m, "v": v}
  if s["amsgrad"]:
    v = new["v_hat"] = jnp.maximum(slots["v_hat"], v)
  return p - (m * alpha) / (jnp.sqrt(v) + _c(s["epsilon"], dt)), new


def _rmsprop(s, g, p, slots, lr, iterations):
  del iterations
  rho, dt = s["rho"], p.dtype
  velocity = _c(rho, dt) * slots["velocity"] + _c(1 - rho, dt) * jnp.square(g)
  new = {"velocity": velocity}
  if s["centered"]:
    average = _c(rho, dt) * slots["average_gradient"] + _c(1 - rho, dt) * g
    new["average_gradient"] = average
    denominator = velocity - jnp.square(average) + _c(s["epsilon"], dt)
  else:
    denominator = velocity + _c(s["epsilon"], dt)
  increment = (lr * g) / jnp.sqrt(denominator)
  if s["momentum"] > 0:
    new["momentum"] = _c(s["momentum"], dt) * slots["momentum"] + increment
    return p - new["momentum"], new
  return p - increment, new


def _adagrad(s, g, p, slots, lr, iterations):
  del iterations
  accumulator = slots["accumulator"] + jnp.square(g)
  step = (lr * g) / jnp.sqrt(accumulator + _c(s["epsilon"], p.dtype))
  return p - step, {"accumulator": accumulator}


_FORMULAS = {
  "sgd": _sgd,
  "adam": _adam,
  "adamw": _adam,
  "rmsprop": _rmsprop,
  "adagrad": _adagrad,
}
