"""Reading optimizer configurations: Keras names, Keras 3, tf_keras and TensorFlow 2.3.

:func:`inner_parts` splits an inner optimizer given by name or config into
its Keras formula's hyper-parameters and the base optimizer's arguments
(Keras 3 puts ``clipnorm`` and the others on the inner optimizer);
:func:`lso_kwargs` turns any ``LossScaleOptimizer`` configuration that
TensorFlow or Keras writes (``get_config``) into this package's keyword
arguments.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import jax

from optax_lossscale._base import validate as _validate
from optax_lossscale._loss_scale import config as _config
from optax_lossscale.porting import _keras_math

__all__ = [
  "BASE_DEFAULTS",
  "checked_config",
  "core_config",
  "inner_parts",
  "lso_kwargs",
  "positive_f32",
  "scale_f32",
  "set_inner",
  "validate_base",
]

#: The base optimizer's arguments and their defaults (Keras 3's).
BASE_DEFAULTS: dict[str, Any] = {
  "weight_decay": None,
  "clipnorm": None,
  "clipvalue": None,
  "global_clipnorm": None,
  "use_ema": False,
  "ema_momentum": 0.99,
  "ema_overwrite_frequency": None,
  "loss_scale_factor": None,
  "gradient_accumulation_steps": None,
}
# Keys of a Keras optimizer config that carry nothing here.
_IGNORED = ("name", "jit_compile", "is_legacy_optimizer")


def checked_config(
  owner: str, config: Any, accepted: Any, *, form: str = "", required: Any = ()
) -> dict[str, Any]:
  """``config`` as a new dict, once every key is one ``owner`` reads.

  The one check behind every ``from_config`` of this package: a key the
  constructor does not take would otherwise be dropped (its setting lost)
  or reach the constructor as a bare ``TypeError``.

  Args:
    owner: the class, for the message (``"StaticLossScale"``).
    config: the configuration, a mapping with string keys.
    accepted: the keys ``owner`` reads (for this form of its config).
    form: which form of the config ``accepted`` is, for the message.
    required: the keys it must hold (``owner``'s arguments without a
      default), which would otherwise reach it as a bare ``TypeError``.

  Raises:
    ValueError: ``config`` is not a mapping, holds a key not in
      ``accepted`` (the message names the keys, and those it reads), or
      lacks one of ``required``.
  """
  if not isinstance(config, Mapping):
    what = f"{form} as a dict" if form else "a dict (what get_config returns)"
    raise ValueError(
      f"{owner}.from_config takes {what}, got {type(config).__name__}: {config!r}."
    )
  accepted = set(accepted)
  unknown = [k for k in config if k not in accepted]
  if unknown:
    where = f" in {form}" if form else ""
    raise ValueError(
      f"{owner}.from_config: unknown key(s) {', '.join(map(repr, unknown))}"
      f"{where}; it reads {', '.join(map(repr, sorted(accepted))) or 'none'}. "
      "Nothing is "
      "dropped silently: remove the key, or build the object of the class "
      "that takes it."
    )
  missing = [k for k in required if k not in config]
  if missing:
    where = f" ({form})" if form else ""
    raise ValueError(
      f"{owner}.from_config: the config{where} lacks "
      f"{', '.join(map(repr, missing))}, which {owner} needs."
    )
  return dict(config)


def constructor_keys(cls: type, *, required: bool = False) -> tuple[str, ...]:
  """The keyword arguments ``cls(...)`` takes (its ``__init__``'s or
  ``__new__``'s); with ``required``, those without a default."""
  fn = cls.__new__ if cls.__new__ is not object.__new__ else cls.__init__
  params = list(inspect.signature(fn).parameters.values())[1:]
  kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
  return tuple(
    p.name
    for p in params
    if p.kind in kinds and not (required and p.default is not inspect.Parameter.empty)
  )


def is_transformation(inner: Any) -> bool:
  """Anything with callable ``init`` and ``update`` (``optax.MultiSteps`` too)."""
  return not isinstance(inner, (str, Mapping)) and all(
    callable(getattr(inner, n, None)) for n in ("init", "update")
  )


def inner_parts(inner: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
  """``(name, the formula's config, base arguments)`` of a name or config.

  Accepts ``'adam'``, ``{'class_name': 'Adam', 'config': {...}}`` and what
  Keras 3 and tf_keras serialise (``module`` and ``registered_name`` keys,
  the base arguments, ``name``, ``jit_compile``, ``is_legacy_optimizer``
  and a zero legacy ``decay`` inside ``config``).

  Raises:
    ValueError: any other form, a ``module`` other than Keras' optimizers
      or a ``registered_name`` (a custom optimizer), OptimizerV2's RMSprop
      or Adagrad (a ``.legacy`` module or a ``decay`` key: another
      formula), or a serialised learning-rate schedule.
  """
  if isinstance(inner, str):
    inner = {"class_name": inner, "config": {}}
  if not (
    isinstance(inner, Mapping)
    and set(inner) <= {"class_name", "config", "module", "registered_name"}
    and isinstance(inner.get("class_name"), str)
    and isinstance(inner.get("config", {}), Mapping)
  ):
    raise ValueError(
      "`inner_optimizer` must be an optax GradientTransformation, an optimizer "
      f"name such as 'adam', or {{'class_name': ..., 'config': {{...}}}}; got "
      f"{inner!r}."
    )
  module, registered = inner.get("module"), inner.get("registered_name")
  keras_module = module is None or (
    isinstance(module, str)
    and module.split(".")[:2] in (["keras", "optimizers"], ["tf_keras", "optimizers"])
  )
  if not keras_module or registered not in (None, inner["class_name"]):
    raise ValueError(
      f"`inner_optimizer`: {inner['class_name']!r} from module {module!r} "
      f"(registered as {registered!r}) is not one of Keras' optimizers, whose "
      "module is 'keras.optimizers' and registered name None; a custom "
      "optimizer's formula is not known here: pass an optax transformation."
    )
  optimizer_v2 = (isinstance(module, str) and module.endswith(".legacy")) or (
    "decay" in inner.get("config", {})
  )
  if optimizer_v2 and inner["class_name"].lower() in ("rmsprop", "adagrad"):
    raise ValueError(
      f"`inner_optimizer`: {inner['class_name']!r} is TensorFlow's OptimizerV2 "
      "(tf.keras.optimizers.legacy, or TensorFlow <= 2.10: its config has "
      "`decay`), which adds epsilon to the square root (Adagrad, and RMSprop "
      "at momentum 0) where Keras 3's and tf_keras' formulas add it under "
      "the root; that formula is not written "
      "here. Pass an optax transformation with that formula (optax.rmsprop("
      "..., eps_in_sqrt=False) is OptimizerV2's RMSprop at momentum 0), or "
      "the config of the optimizer that replaced it."
    )
  own, base = {}, {}
  for k, v in inner.get("config", {}).items():
    if k in _IGNORED:
      continue
    if k == "decay":  # tf.keras' OptimizerV2 config (TensorFlow <= 2.10)
      if v:
        raise ValueError(
          f"`inner_optimizer`: the legacy `decay={v!r}` (a learning rate "
          "decaying with the step) is not supported; pass a schedule as "
          "`learning_rate`."
        )
      continue
    if k == "learning_rate" and isinstance(v, Mapping):
      raise ValueError(
        "`inner_optimizer`: a serialised learning-rate schedule "
        f"({v.get('class_name', v)!r}) cannot be read; pass the schedule "
        "itself, a callable of the iteration count, as `learning_rate`."
      )
    if k == "weight_decay" and v is None and inner["class_name"].lower() == "adamw":
      # AdamW's default is its own 0.004, not the base's None
      raise ValueError("AdamW's `weight_decay` must be a float, got None.")
    if k in BASE_DEFAULTS:
      if v != BASE_DEFAULTS[k]:
        base[k] = v
      continue
    own[k] = v
  return inner["class_name"], own, base


def merge_base(given: dict[str, Any], from_inner: dict[str, Any]) -> dict[str, Any]:
  """The base arguments given to ``LossScaleOptimizer`` and its inner optimizer.

  Either place is accepted (TensorFlow's document puts them on the loss-scale
  optimizer, Keras 3 on the inner one); giving one with two values is a
  ``ValueError``.
  """
  out = dict(given)
  for k, v in from_inner.items():
    if k in given and given[k] != BASE_DEFAULTS[k] and given[k] != v:
      raise ValueError(
        f"`{k}` is given both to LossScaleOptimizer ({given[k]!r}) and in the "
        f"inner optimizer's config ({v!r}); give it once."
      )
    out[k] = v
  return out


#: The keys of tf_keras' ``LossScaleOptimizer`` config (``dynamic`` among
#: them, which Keras 3's lacks).
TF_KERAS_KEYS = (
  "inner_optimizer",
  "dynamic",
  "initial_scale",
  "dynamic_growth_steps",
  "name",
)
#: The keys of TensorFlow 2.3's ``LossScaleOptimizer`` config.
TF23_KEYS = ("optimizer", "loss_scale", "name", "legacy_keras")
#: The config keys of TensorFlow's ``LossScale`` classes.
TF_LOSS_SCALE_KEYS = {
  "FixedLossScale": ("loss_scale_value",),
  "DynamicLossScale": ("initial_loss_scale", "increment_period", "multiplier"),
}


def lso_kwargs(
  config: Mapping[str, Any], accepted: Any, required: Any = ()
) -> dict[str, Any]:
  """This package's ``LossScaleOptimizer`` arguments for any ``get_config``.

  Reads this package's own configs, Keras 3's (``name``, ``inner_optimizer``,
  ``initial_scale``, ``dynamic_growth_steps``), tf_keras' (``dynamic`` as
  well) and TensorFlow 2.3's (``optimizer`` and a ``loss_scale`` holding a
  ``FixedLossScale`` or ``DynamicLossScale`` config).

  Args:
    config: the configuration.
    accepted: the keys of ``LossScaleOptimizer``'s own configs (its
      constructor's arguments).
    required: those of them without a default.

  Raises:
    ValueError: a key that no form of the configuration has (the message
      names it), or a ``loss_scale`` of another class or with a multiplier
      other than 2 (as tf_keras refuses them).
  """
  if isinstance(config, Mapping) and "loss_scale" in config:
    from optax_lossscale.porting import _tf_rule

    config = checked_config(
      "LossScaleOptimizer",
      config,
      TF23_KEYS,
      form="TensorFlow 2.3's config (`optimizer` and `loss_scale`)",
      required=("optimizer", "loss_scale"),
    )
    ls = config.pop("loss_scale")
    ls_class = ls.get("class_name") if isinstance(ls, Mapping) else None
    if ls_class in TF_LOSS_SCALE_KEYS:
      ls = checked_config(
        "LossScaleOptimizer",
        ls,
        ("class_name", "config", "module", "registered_name"),
        form="`loss_scale`",
      )
    ls_config = ls.get("config", {}) if isinstance(ls, Mapping) else {}
    if ls_class in TF_LOSS_SCALE_KEYS:
      ls_config = checked_config(
        "LossScaleOptimizer",
        ls_config,
        TF_LOSS_SCALE_KEYS[ls_class],
        form=f"the `loss_scale`'s {ls_class} config",
      )
    if ls_class == "FixedLossScale":
      config["dynamic"] = False
      # checked under TensorFlow's names, which the caller wrote
      config["initial_scale"] = scale_f32(
        "loss_scale_value", _tf_rule.fixed_value(ls_config)
      )
    elif ls_class == "DynamicLossScale":
      multiplier = _validate.float_in(
        "multiplier", ls_config.get("multiplier", 2.0), 0.0, math.inf
      )
      if multiplier != 2.0:
        raise ValueError(
          "Cannot read a LossScaleOptimizer config whose DynamicLossScale "
          f"multiplier is not 2: {ls!r}."
        )
      config["dynamic"] = True
      config["initial_scale"] = scale_f32(
        "initial_loss_scale", ls_config.get("initial_loss_scale", 2.0**15)
      )
      config["dynamic_growth_steps"] = _validate.int_in(
        "increment_period", ls_config.get("increment_period", 2000), 1
      )
    else:
      raise ValueError(
        "A LossScaleOptimizer config whose `loss_scale` is neither a "
        f"FixedLossScale nor a DynamicLossScale cannot be read: {ls!r}."
      )
    config["inner_optimizer"] = config.pop("optimizer")
  else:
    config = checked_config("LossScaleOptimizer", config, accepted, required=required)
    tf_keras = "dynamic" in config and set(config) <= set(TF_KERAS_KEYS)
    if not tf_keras or not isinstance(config.get("inner_optimizer"), (str, Mapping)):
      return config  # Keras 3's, or this package's own (of any release)
  return config if "legacy_keras" in config else _tf_keras_semantics(config)


def _tf_keras_semantics(config: dict[str, Any]) -> dict[str, Any]:
  """``config`` of tf_keras' or TensorFlow 2.3's ``LossScaleOptimizer``
  with ``legacy_keras=True``: theirs count a skipped step in
  ``iterations``, where Keras 3's does not; a ValueError for an inner
  optimizer whose tf_keras formula is not written here."""
  inner = config.get("inner_optimizer")
  if isinstance(inner, (str, Mapping)):
    name, _, _ = inner_parts(inner)
    # a name with no Keras formula at all is refused by its own message
    if name.lower() in _keras_math.DEFAULTS and name.lower() not in _keras_math.LEGACY:
      raise ValueError(
        f"This is tf_keras' or TensorFlow's LossScaleOptimizer config (its "
        f"`dynamic` or `loss_scale` key), read with tf_keras' semantics "
        f"(legacy_keras=True: a skipped step counts in `iterations`), which "
        f"are written for {', '.join(_keras_math.LEGACY)}, not {name!r}. Add "
        "'legacy_keras': False to the config to read it with Keras 3's (a "
        "skipped step then does not count)."
      )
  return {**config, "legacy_keras": True}


def set_inner(state: Any, counters: Any, inner: Any) -> Any:
  new = counters._replace(inner_state=inner)
  return jax.tree.map(
    lambda x: new if x is counters else x, state, is_leaf=lambda x: x is counters
  )


def validate_base(base: dict[str, Any]) -> dict[str, Any]:
  """The base arguments validated (each error names its argument)."""
  out = dict(base)
  if out["weight_decay"] is not None:
    out["weight_decay"] = _validate.float_in(
      "weight_decay", out["weight_decay"], 0.0, math.inf
    )
    _validate.as_f32("weight_decay", out["weight_decay"])
  for k in ("clipnorm", "clipvalue", "global_clipnorm"):
    out[k] = _validate.optional_positive(k, out[k], f32=True)
  clips = [k for k in ("clipnorm", "clipvalue", "global_clipnorm") if out[k]]
  if len(clips) > 1:
    raise ValueError(
      "Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set; "
      f"got {', '.join(f'{k}={out[k]}' for k in clips)}."
    )
  if not isinstance(out["use_ema"], bool):
    raise ValueError(f"`use_ema` must be a bool, got {out['use_ema']!r}.")
  out["ema_momentum"] = _validate.float_in("ema_momentum", out["ema_momentum"], 0, 1)
  out["ema_overwrite_frequency"] = _validate.optional_int_at_least(
    "ema_overwrite_frequency", out["ema_overwrite_frequency"], 1
  )
  if out["loss_scale_factor"] is not None:
    # Divided out of the gradients: it and its reciprocal must be normal
    # float32 numbers, as a loss scale.
    out["loss_scale_factor"] = _validate.check_scale(
      "loss_scale_factor", out["loss_scale_factor"]
    )
  out["gradient_accumulation_steps"] = _validate.optional_int_at_least(
    "gradient_accumulation_steps", out["gradient_accumulation_steps"], 2
  )
  return out


def core_config(dynamic, initial, growth, min_scale, max_scale, hysteresis):
  """The core's configuration for an optax inner optimizer."""
  if not dynamic:
    given = [
      f"{k}={v!r}"
      for k, v in (("min_scale", min_scale), ("max_scale", max_scale))
      + (("hysteresis", hysteresis),)
      if v is not None
    ]
    if given:
      raise ValueError(
        f"{', '.join(given)} given with dynamic=False: only a dynamic loss "
        "scale uses them. Drop them, or pass dynamic=True."
      )
    return _config.static_config(initial, skip_nonfinite=False)
  lo, hi = _validate.SCALE_RANGE
  return _config.dynamic_config(
    initial_scale=initial,
    growth_interval=growth,
    min_scale=min(1.0, max(initial, lo)) if min_scale is None else min_scale,
    max_scale=hi if max_scale is None else max_scale,
    hysteresis=1 if hysteresis is None else hysteresis,
  )


def scale_args(dynamic: bool, initial: Any, growth: Any) -> tuple[float, int | None]:
  """``LossScaleOptimizer``'s ``initial_scale`` and ``dynamic_growth_steps``,
  Keras' defaults filled in for a dynamic scale, checked."""
  if dynamic:
    initial = _config.DEFAULT_INITIAL_SCALE if initial is None else initial
    growth = _config.DEFAULT_GROWTH_INTERVAL if growth is None else growth
    growth = _validate.int_in("dynamic_growth_steps", growth, 1)
  else:
    if initial is None:
      raise ValueError("`initial_scale` must be given when `dynamic` is False.")
    if growth is not None:
      raise ValueError(
        f"`dynamic_growth_steps` must be None when `dynamic` is False, got {growth!r}."
      )
  return scale_f32("initial_scale", initial), growth


def positive_f32(name: str, value: Any) -> float:
  out = _validate.as_f32(name, value)
  if out <= 0:
    raise ValueError(f"`{name}` must be a positive finite number, got {value!r}.")
  return out


def scale_f32(name: str, value: Any) -> float:
  """A loss scale Keras' optimizer takes: positive, in float32, and in
  ``[2**-126, 2**126]`` (:func:`_validate.check_scale`, as the core's):
  above, its reciprocal, which multiplies the gradients, is subnormal and
  flushed to zero on a CPU; below, it overflows."""
  return _validate.check_scale(name, positive_f32(name, value))
