"""Keras' optimizer pieces in optax: names, learning rate, weight decay, clipping.

What the Keras-style ``LossScaleOptimizer`` builds its chain from: an optax
optimizer from a Keras name or config, the learning rate of the one
``optax.inject_hyperparams`` in a state (read and replaced), Keras'
decoupled weight decay and its per-leaf ``clipnorm``.
"""

from __future__ import annotations

import inspect
import math
import typing
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_lossscale._base import opt_state as _opt_state
from optax_lossscale._base import tree as _tree
from optax_lossscale._base import validate as _validate
from optax_lossscale.porting import _keras_config

__all__ = [
  "argument_names",
  "check_rate",
  "clip_each_by_norm",
  "decoupled_weight_decay",
  "get_learning_rate",
  "has_own_weight_decay",
  "inner_spec",
  "set_learning_rate",
]

# optax aliases that a Keras optimizer name maps to, and Keras' default
# learning rates (SGD 0.01, every other optimizer 0.001).
_OPTIMIZERS = {
  "sgd": optax.sgd,
  "adam": optax.adam,
  "adamw": optax.adamw,
  "adamax": optax.adamax,
  "nadam": optax.nadam,
  "rmsprop": optax.rmsprop,
  "adagrad": optax.adagrad,
  "adadelta": optax.adadelta,
  "adafactor": optax.adafactor,
  "lamb": optax.lamb,
  "lion": optax.lion,
}
_DEFAULT_LEARNING_RATE = {"sgd": 0.01}


def inner_spec(inner: Any) -> tuple[optax.GradientTransformation, Any, dict[str, Any]]:
  """(the optax transformation, what ``get_config`` reports for it, the
  Keras base arguments its config held).

  Anything with callable ``init`` and ``update`` is a transformation, as
  for the loss scales (``optax.MultiSteps`` is a class of its own). A name or
  config is read by the one Keras config parser
  (:func:`~optax_lossscale.porting._keras_config.inner_parts`), its own
  arguments in optax's names."""
  if not isinstance(inner, (str, Mapping)) and all(
    callable(getattr(inner, name, None)) for name in ("init", "update")
  ):
    return inner, inner, {}
  class_name, own, base = _keras_config.inner_parts(inner)
  inner = {"class_name": class_name, "config": own}
  name = inner["class_name"].lower()
  if name not in _OPTIMIZERS:
    raise ValueError(
      f"`inner_optimizer`: unknown optimizer {inner['class_name']!r}; known: "
      f"{', '.join(sorted(_OPTIMIZERS))}."
    )
  config = {
    "learning_rate": _DEFAULT_LEARNING_RATE.get(name, 0.001),
    **inner.get("config", {}),
  }
  if has_own_weight_decay(name) and "weight_decay" in base:
    # The config's `weight_decay` is the optax optimizer's own (decoupled,
    # as Keras'), replacing optax's default, not Keras' decay on top of it:
    # the step decays once.
    config["weight_decay"] = base.pop("weight_decay")
  if not callable(config["learning_rate"]):  # a number, or a schedule
    # None made optax step *up* the gradient; a string failed much later.
    _validate.float_in("learning_rate", config["learning_rate"], 0.0, math.inf)
  _check_optax_arguments(name, config)
  try:
    # float32 hyper-parameters whatever the parameters' dtype: in bfloat16,
    # Adam's b2 = 0.999 is 1.0 and its bias correction divides by zero.
    inject = optax.inject_hyperparams(_OPTIMIZERS[name], hyperparam_dtype=jnp.float32)
    tx = inject(**config)
  except TypeError as e:
    raise ValueError(f"`inner_optimizer` config {config!r} for {name!r}: {e}") from None
  return tx, {"class_name": name, "config": config}, base


def _check_optax_arguments(name: str, config: dict[str, Any]) -> None:
  """A ValueError unless ``config`` holds arguments of optax's ``name``, each
  of the kind its default is: a bool where that is a bool, a finite number
  where it is a number or an optional number (sgd's ``momentum``), or a
  schedule of the step, as ``optax.inject_hyperparams`` takes; others
  (dtypes, masks) as given."""
  params = inspect.signature(_OPTIMIZERS[name]).parameters
  unknown = sorted(set(config) - set(params))
  if unknown:
    raise ValueError(
      f"`inner_optimizer` config for optax's {name}: unknown argument(s) "
      f"{', '.join(map(repr, unknown))}; optax's are {', '.join(params)}. "
      "With min_scale, max_scale, hysteresis or track_nonfinite the "
      "optimizer named is optax's, with optax's argument names; Keras' "
      "(beta_1, epsilon) are read by Keras' formulas, without them."
    )
  for k, v in config.items():
    default, kind = params[k].default, str(params[k].annotation)
    number = isinstance(default, (int, float)) or (
      default is None and "float" in kind and "Any" not in kind
    )
    if isinstance(default, bool):
      if not isinstance(v, bool):
        raise ValueError(f"`{k}` of optax's {name} must be a bool, got {v!r}.")
    elif number and not callable(v) and not (v is None and _takes_none(params[k])):
      _validate.as_float(k, v)  # None where optax takes it (adafactor's clipping)


def _takes_none(param: inspect.Parameter) -> bool:
  """Whether ``param``'s annotation admits None: ``Optional[float]`` (older
  optax) or a union naming ``NoneType`` (newer), or a None default."""
  kind = param.annotation
  return (
    param.default is None
    or kind is None
    or type(None) in typing.get_args(kind)
    or (isinstance(kind, str) and ("None" in kind or "Optional" in kind))
  )


def argument_names() -> frozenset:
  """The arguments of the optax optimizers a Keras name maps to."""
  return frozenset(
    k for fn in _OPTIMIZERS.values() for k in inspect.signature(fn).parameters
  )


def has_own_weight_decay(name: str) -> bool:
  """Whether optax's optimizer of Keras name ``name`` decays the weights
  itself (``weight_decay``: adamw, lamb, lion)."""
  fn = _OPTIMIZERS.get(name.lower())
  return fn is not None and "weight_decay" in inspect.signature(fn).parameters


def _is_inject_state(x: Any) -> bool:
  return isinstance(
    x, (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
  ) and isinstance(x.hyperparams, Mapping)


def _learning_rate_node(state: Any) -> Any:
  try:
    return _tree.find_unique(
      state,
      lambda x: _is_inject_state(x) and "learning_rate" in x.hyperparams,
      "optax.inject_hyperparams state with a learning_rate",
    )
  except ValueError as e:
    raise ValueError(
      f"{e} Build the inner optimizer with optax.inject_hyperparams(...) (or "
      "pass it by name, e.g. 'adam') to read or change its learning rate."
    ) from None


def get_learning_rate(opt_state: Any) -> jax.Array:
  """The learning rate of the one ``optax.inject_hyperparams`` in ``opt_state``.

  After a step it is the rate that step used (schedules included).
  """
  state = _opt_state.optimizer_state(opt_state)
  return _tree.unwrap(_learning_rate_node(state).hyperparams["learning_rate"])


def set_learning_rate(opt_state: Any, learning_rate: Any) -> Any:
  """``opt_state`` with the injected learning rate replaced (jit-friendly).

  A rate that ``inject_hyperparams`` computes from a schedule is recomputed
  on the next step; set rates given as numbers.
  """
  check_rate(learning_rate)
  node = _learning_rate_node(opt_state)
  old = node.hyperparams["learning_rate"]
  new_node = node._replace(
    hyperparams={
      **node.hyperparams,
      "learning_rate": jnp.asarray(learning_rate, jnp.result_type(old)),
    }
  )
  return jax.tree.map(
    lambda x: new_node if x is node else x,
    opt_state,
    is_leaf=lambda x: x is node,
  )


def check_rate(learning_rate: Any) -> None:
  """A ValueError unless ``learning_rate`` is one real number (a Python
  number or a 0-d array, traced or not): a vector would become a rate per
  element, a callable (a schedule) cannot replace a number in the state."""
  if not _validate.is_real_scalar(learning_rate):
    shape = getattr(learning_rate, "shape", None)
    kind = "a schedule" if callable(learning_rate) else type(learning_rate).__name__
    raise ValueError(
      "set_learning_rate takes one real number (a scalar), got "
      f"{kind}{'' if shape is None else list(shape)}: a schedule is given "
      "when the optimizer is made, not set in its state."
    )


def decoupled_weight_decay(
  inner: optax.GradientTransformation, weight_decay: float
) -> optax.GradientTransformationExtraArgs:
  """Keras' weight decay: ``p -= p * weight_decay * learning_rate`` each step.

  The learning rate is the one the inner optimizer used this step, read from
  its ``inject_hyperparams`` state; the decay uses the parameters before the
  step, as Keras does.
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    state = inner.init(params)
    _learning_rate_node(state)  # a clear error now, not at the first step
    return state

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError("`weight_decay` needs the parameters: call update(..., params).")
    updates, state = inner.update(updates, state, params, **extra_args)
    lr = _learning_rate_node(state).hyperparams["learning_rate"]

    def decay(u, p):
      if not (_tree.is_float_array(u) and _tree.is_float_array(p)):
        return u
      step = p * jnp.asarray(weight_decay, p.dtype) * lr.astype(p.dtype)
      return u - step.astype(u.dtype)

    return jax.tree.map(decay, updates, params), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def clip_each_by_norm(max_norm: float) -> optax.GradientTransformation:
  """Keras' ``clipnorm``: each gradient leaf clipped to L2 norm ``max_norm``."""

  def clip(updates, params=None):
    del params

    def one(g):
      if not _tree.is_float_array(g):
        return g
      # Keras' formula: g * max_norm / max(norm, max_norm), in float32 at
      # least (a float64 gradient in float64).
      wide = g.astype(_tree.wide_dtype(g.dtype))
      norm = jnp.sqrt(jnp.sum(jnp.square(jnp.abs(wide))))  # complex: |g|
      return (wide * max_norm / jnp.maximum(norm, max_norm)).astype(g.dtype)

    return jax.tree.map(one, updates)

  return optax.stateless(clip)
