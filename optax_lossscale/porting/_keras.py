"""The Keras/TensorFlow ``LossScaleOptimizer`` surface, built on optax.

For people porting TensorFlow or Keras code: ``LossScaleOptimizer`` with an
inner optimizer given by its Keras name reproduces Keras 3's (or, with
``legacy_keras=True``, tf_keras') numbers step by step, under TensorFlow's
loss-scale rule; with an optax transformation it wraps it in the core's
loss scale. Either way it is an optax ``GradientTransformationExtraArgs``.
"""

from __future__ import annotations

import difflib
import inspect
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_lossscale._base import tree as _tree
from optax_lossscale._loss_scale import config as _config
from optax_lossscale._loss_scale import core as _core
from optax_lossscale._loss_scale import finite as _finite
from optax_lossscale._loss_scale import grad as _grad
from optax_lossscale._loss_scale import overwrite as _overwrite
from optax_lossscale._loss_scale import plan as _plan
from optax_lossscale._loss_scale import search as _search
from optax_lossscale.porting import (
  _ema,
  _keras_config,
  _keras_engine,
  _keras_math,
  _keras_optax,
  _optimizers,
  _tf_step,
)
from optax_lossscale.porting._keras_engine import BaseArgs, KerasOptimizerState

#: Keras' and TensorFlow's default ``dynamic_growth_steps`` and initial scale.
DEFAULT_GROWTH_STEPS = _config.DEFAULT_GROWTH_INTERVAL
DEFAULT_INITIAL_SCALE = _config.DEFAULT_INITIAL_SCALE
#: Keras 3's name of a ``LossScaleOptimizer``.
DEFAULT_NAME = "loss_scale_optimizer"


#: TensorFlow's names of ``LossScaleOptimizer``'s arguments, and what to write.
_TF_ARGUMENTS = {
  "loss_scale": "initial_scale=..., dynamic=False for TensorFlow 2.3's fixed "
  "`loss_scale` (ExperimentalLossScaleOptimizer takes it as it is)",
  "initial_loss_scale": "initial_scale",
  "increment_period": "dynamic_growth_steps",
}


def unexpected_message(
  inner: Any, unexpected: dict[str, Any], owner: str = "LossScaleOptimizer"
) -> str:
  """What to write instead of keywords ``owner`` does not take: for an
  optimizer's hyper-parameters, its config; for TensorFlow's names and
  misspellings of ``LossScaleOptimizer``'s arguments, those arguments."""
  given = ", ".join(f"{k}={v!r}" for k, v in unexpected.items())
  head = f"{owner} got unexpected keyword argument(s) {given}."
  hyper = {k for d in _keras_math.DEFAULTS.values() for k in d}
  hyper |= _optimizers.argument_names()
  hyper -= set(_TF_ARGUMENTS)
  if not set(unexpected) <= hyper:  # TensorFlow's names, or misspellings
    own = _keras_config.constructor_keys(LossScaleOptimizer)
    notes = []
    for k in unexpected:
      if k in _TF_ARGUMENTS:
        notes.append(f"For `{k}` write {_TF_ARGUMENTS[k]}.")
      elif k in hyper:
        notes.append(f"`{k}`, an optimizer's hyper-parameter, goes in its config.")
      else:
        close = difflib.get_close_matches(k, own, n=1)
        notes.append(
          f"`{k}` is no argument of LossScaleOptimizer"
          + (f" (did you mean `{close[0]}`?)" if close else "")
          + f"; its arguments are {', '.join(own)}."
        )
    return f"{head} {' '.join(notes)}"
  if isinstance(inner, str):
    hyper = ", ".join(f"{k!r}: {v!r}" for k, v in unexpected.items())
    return (
      f"{head} An optimizer's own hyper-parameters go in its config, as "
      "Keras takes them on the inner optimizer: write "
      f"LossScaleOptimizer({{'class_name': {inner!r}, 'config': {{{hyper}}}}}, "
      "...)."
    )
  if _keras_config.is_transformation(inner):
    return (
      f"{head} The inner optax transformation carries its own "
      "hyper-parameters (e.g. optax.adam(learning_rate=...))."
    )
  return f"{head} Put an optimizer's hyper-parameters in its config's 'config'."


def documented_init(cls: type) -> type:
  """Gives ``cls``, built in ``__new__``, an ``__init__`` that ``help()``
  shows with ``__new__``'s signature and the class docstring (a tuple's
  inherited one reads "Initialize self")."""
  sig = inspect.signature(cls.__new__)
  first, *rest = sig.parameters.values()

  def __init__(self, *args, **kwargs):  # noqa: N807 (the object is made in __new__)
    del self, args, kwargs

  __init__.__signature__ = sig.replace(parameters=[first.replace(name="self"), *rest])
  __init__.__doc__ = cls.__doc__
  __init__.__qualname__ = f"{cls.__qualname__}.__init__"
  __init__.__module__ = cls.__module__
  cls.__init__ = __init__
  return cls


def _with_state(method: str, state: Any, example: str) -> None:
  """A clear error for a call without the optimizer state."""
  if state is None:
    raise ValueError(
      f"{method} needs the optimizer state: the loss scale lives in the "
      f"state that init() and update() return (optax's way), not in the "
      f"optimizer object as in TensorFlow. Write {example}."
    )


class _Scale(NamedTuple):
  """The loss scale's arguments, as ``scale_args`` read them."""

  dynamic: bool
  initial_scale: float
  growth_steps: int | None
  axis_name: Any
  track_nonfinite: Any  # the core's record (checked by the core)


class _Built(NamedTuple):
  """What a construction mode makes of ``LossScaleOptimizer``'s arguments."""

  tx: Any  # the transformation
  keras: Any  # the KerasLossScale of Keras' formulas, else None
  inner: Any  # the formula's spec, or the inner optax transformation
  inner_config: Any  # what get_config reports for the inner optimizer
  config: dict  # the rest of get_config


def _own_config(scale: _Scale, base: dict, legacy_keras: bool) -> dict:
  return {
    "dynamic": scale.dynamic,
    "initial_scale": scale.initial_scale,
    "dynamic_growth_steps": scale.growth_steps if scale.dynamic else None,
    **base,
    "legacy_keras": legacy_keras,
    "axis_name": scale.axis_name,
  }


def _keras_formulas(
  inner: Any, base: dict, legacy_keras: bool, scale: _Scale
) -> _Built:
  """An optimizer given by its Keras name or config: Keras' own formulas
  (tf_keras' with ``legacy_keras``) in Keras' loss-scale step."""
  name, own, from_inner = _keras_config.inner_parts(inner)
  # Keras 3's LossScaleOptimizer turns its inner optimizer's
  # loss_scale_factor off (the gradients would be unscaled twice).
  from_inner.pop("loss_scale_factor", None)
  base = _keras_config.merge_base(base, from_inner)
  if name.lower() == "adamw" and "weight_decay" not in from_inner:
    if base["weight_decay"] is None:
      base["weight_decay"] = _keras_math.DEFAULTS["adamw"]["weight_decay"]
  base = _keras_config.validate_base(base)
  config = _own_config(scale, base, legacy_keras)
  spec = _keras_math.spec(name, own, legacy=legacy_keras)
  if legacy_keras:
    for k in ("gradient_accumulation_steps", "loss_scale_factor"):
      if base[k] is not None:
        raise ValueError(f"`{k}`: tf_keras has none (legacy_keras=True).")
  args = dict(base)
  factor = args.pop("loss_scale_factor")
  tx = _tf_step.KerasLossScale(
    spec,
    BaseArgs(**args),
    scale.initial_scale,
    scale.growth_steps if scale.dynamic else None,
    factor,
    scale.axis_name,
  )
  inner_config = {"class_name": spec.name, "config": dict(spec.hyper)}
  return _Built(tx, tx, spec, inner_config, config)


def _optax_by_keras_name(
  inner: Any, base: dict, legacy_keras: bool, scale: _Scale, core_only: dict
) -> _Built:
  """An optimizer given by its Keras name or config with the core's
  arguments (its clamps, hysteresis, record): optax's optimizer of that
  name, optax's argument names in its config, in the core's loss scale."""
  if legacy_keras:
    given = [f"{k}={v!r}" for k, v in core_only.items() if v is not None]
    raise ValueError(
      f"{', '.join(given)} with legacy_keras=True: the core's clamps, "
      "hysteresis and record run optax's optimizer of that name, not "
      "tf_keras' formulas."
    )
  tx, inner_config, from_inner = _optimizers.inner_spec(inner)
  name = inner_config["class_name"]
  if base.get("weight_decay") is not None and _optimizers.has_own_weight_decay(name):
    raise ValueError(
      f"weight_decay={base['weight_decay']!r} with {name!r} by name and the "
      f"core's arguments: optax's {name} decays the weights itself (its "
      "`weight_decay`, with optax's default); give it in the optimizer's "
      f"config, {{'class_name': {name!r}, 'config': {{'weight_decay': ...}}}}, "
      "so that the step decays once."
    )
  from_inner.pop("loss_scale_factor", None)  # as Keras 3 turns it off
  base = _keras_config.merge_base(base, from_inner)
  return _core_loss_scale(tx, inner_config, base, legacy_keras, scale, core_only)


def _core_loss_scale(
  inner: Any,
  inner_config: Any,
  base: dict,
  legacy_keras: bool,
  scale: _Scale,
  core_only: dict,
) -> _Built:
  """An optax transformation in the core's loss scale, Keras' base
  arguments (clipping, decay, average, accumulation) around it."""
  base = _keras_config.validate_base(base)
  config = _own_config(scale, base, legacy_keras)
  if legacy_keras:
    raise ValueError(
      "`legacy_keras=True` selects tf_keras' formulas: give the inner "
      "optimizer by its Keras name."
    )
  core = _keras_config.core_config(
    scale.dynamic,
    scale.initial_scale,
    scale.growth_steps,
    core_only["min_scale"],
    core_only["max_scale"],
    core_only["hysteresis"],
  )
  tx = _keras_optax.build(
    inner,
    core,
    **base,
    axis_name=scale.axis_name,
    track_nonfinite=scale.track_nonfinite,
  )
  config.update(
    min_scale=core.min_scale if scale.dynamic else None,
    max_scale=core.max_scale if scale.dynamic else None,
    hysteresis=core.hysteresis if scale.dynamic else None,
    track_nonfinite=scale.track_nonfinite,
  )
  return _Built(tx, None, inner, inner_config, config)


@documented_init
@_tree.rebuilt_as_itself
class LossScaleOptimizer(optax.GradientTransformationExtraArgs):
  """Keras' ``LossScaleOptimizer`` as an optax transformation.

  **An inner optimizer given by name** (``'sgd'``, ``'adam'``, ``'adamw'``,
  ``'rmsprop'``, ``'adagrad'``, or a Keras config ``{'class_name': ...,
  'config': {...}}``, as Keras 3 and tf_keras serialise it) runs Keras'
  own formulas, defaults and base optimizer (clipping, weight decay,
  accumulation, the EMA, ``iterations``), as Keras 3's ``LossScaleOptimizer``
  does (tf_keras 2.x's with ``legacy_keras=True``), under TensorFlow's rule:
  the scale is multiplied by 2 after ``dynamic_growth_steps`` finite steps
  in a row *if the product is at most 2**126* (Keras': if finite), and
  halved on a non-finite step,
  which is skipped, with no floor, as Keras 3 (tf_keras' ``max(scale / 2,
  1)`` with ``legacy_keras=True``; a floor of one's choosing with
  ``min_scale``); an initial scale in ``[2**-126, 2**126]`` is accepted. The
  unscaled gradients are checked (tf_keras' check; Keras 3 checks the
  scaled ones, which differs only below scale 1).

  **An optax transformation** is wrapped in the core's loss scale, its rule
  clamped to ``[min_scale, max_scale]`` (default ``[min(1, initial_scale),
  2**126]``), with the base arguments as optax pieces around it.

  Its ``update`` takes the gradients of :meth:`scale_loss`'s loss (optax's
  way). TensorFlow's way works too: :meth:`get_scaled_loss`,
  :meth:`get_unscaled_gradients` (its result is marked, so ``update`` does
  not divide it again), then :meth:`apply_gradients` on unscaled gradients.
  Keras' variables are read from the state: :meth:`loss_scale`,
  :meth:`dynamic_counter`, :meth:`iterations`, :meth:`learning_rate`.

  Args:
    inner_optimizer: a Keras name or config, or an optax transformation.
    initial_scale: the initial scale (default ``2**15``); the fixed scale
      when not ``dynamic``, where it is required, as in TensorFlow.
    dynamic_growth_steps: finite steps in a row before the scale doubles
      (default 2000); must be ``None`` when not ``dynamic``.
    dynamic: dynamic loss scaling (default). ``False`` keeps the scale fixed
      and applies every step, finite or not, as TensorFlow does.
    weight_decay: Keras' decoupled weight decay. It and the other base
      optimizer arguments (``clipnorm``, ``clipvalue``, ``global_clipnorm``,
      ``use_ema``, ``ema_momentum``, ``ema_overwrite_frequency``,
      ``loss_scale_factor``, ``gradient_accumulation_steps``) are accepted
      here (TensorFlow's place) or in the inner optimizer's config (Keras
      3's): the same numbers either way.
    legacy_keras: tf_keras' formulas and base optimizer (``iterations``
      advanced by a skipped step, the EMA started from the initial weights);
      with a Keras name only.
    min_scale: the core's floor, for an optax transformation. It,
      ``max_scale``, ``hysteresis`` and ``track_nonfinite`` (the core's
      ceiling, hysteresis and non-finite record) given with a Keras name
      build optax's optimizer of that name (optax's argument names in its
      config; a ``weight_decay`` there is the optax optimizer's own where
      it has one: adamw, lamb, lion) in the core's loss scale, not Keras'
      formulas.
    axis_name: mapped axis to AND the finite flag over (pmap/shard_map).
    name: Keras 3's optimizer name, kept in :meth:`get_config` (default
      ``"loss_scale_optimizer"``, Keras 3's).

  Raises:
    ValueError: any invalid argument; the message names it. An optimizer's
      own hyper-parameters (``learning_rate=``, ``beta_1=``) are not
      arguments of ``LossScaleOptimizer``, as in Keras: the message says to
      write ``LossScaleOptimizer({"class_name": "adam", "config":
      {"learning_rate": ...}})``.

  Example:
    >>> import jax.numpy as jnp, optax_lossscale as ols
    >>> opt = ols.porting.LossScaleOptimizer("sgd", initial_scale=1024.0, clipnorm=1.0)
    >>> params = {"w": jnp.ones(3)}
    >>> state = opt.init(params)
    >>> grads = {"w": jnp.full(3, 1024.0 * 10)}  # gradients of the scaled loss
    >>> updates, state = opt.update(grads, state, params)
    >>> updates["w"]  # unscaled to 10, clipped to norm 1, times -0.01, from 1
    Array([-0.00577348, -0.00577348, -0.00577348], dtype=float32)
    >>> float(opt.loss_scale(state)), int(opt.dynamic_counter(state))
    (1024.0, 1)
  """

  def __new__(
    cls,
    inner_optimizer: Any,
    initial_scale: float | None = None,
    dynamic_growth_steps: int | None = None,
    *,
    dynamic: bool = True,
    weight_decay: float | None = None,
    clipnorm: float | None = None,
    clipvalue: float | None = None,
    global_clipnorm: float | None = None,
    use_ema: bool = False,
    ema_momentum: float = 0.99,
    ema_overwrite_frequency: int | None = None,
    loss_scale_factor: float | None = None,
    gradient_accumulation_steps: int | None = None,
    legacy_keras: bool = False,
    min_scale: float | None = None,
    max_scale: float | None = None,
    hysteresis: int | None = None,
    axis_name: Any = None,
    track_nonfinite: bool = False,
    name: str | None = None,
    **unexpected: Any,
  ):
    if unexpected:
      raise ValueError(unexpected_message(inner_optimizer, unexpected))
    for arg, flag in (("dynamic", dynamic), ("legacy_keras", legacy_keras)):
      if not isinstance(flag, bool):
        raise ValueError(f"`{arg}` must be a bool, got {flag!r}.")
    if name is None:
      name = DEFAULT_NAME
    if not isinstance(name, str):
      raise ValueError(f"`name` must be a string, got {name!r}.")
    initial_scale, dynamic_growth_steps = _keras_config.scale_args(
      dynamic, initial_scale, dynamic_growth_steps
    )

    base = {
      "weight_decay": weight_decay,
      "clipnorm": clipnorm,
      "clipvalue": clipvalue,
      "global_clipnorm": global_clipnorm,
      "use_ema": use_ema,
      "ema_momentum": ema_momentum,
      "ema_overwrite_frequency": ema_overwrite_frequency,
      "loss_scale_factor": loss_scale_factor,
      "gradient_accumulation_steps": gradient_accumulation_steps,
    }
    core_only = {
      "min_scale": min_scale,
      "max_scale": max_scale,
      "hysteresis": hysteresis,
      "track_nonfinite": track_nonfinite or None,
    }
    scale = _Scale(
      dynamic, initial_scale, dynamic_growth_steps, axis_name, track_nonfinite
    )
    if _keras_config.is_transformation(inner_optimizer):
      built = _core_loss_scale(
        inner_optimizer, inner_optimizer, base, legacy_keras, scale, core_only
      )
    elif any(v is not None for v in core_only.values()):
      built = _optax_by_keras_name(
        inner_optimizer, base, legacy_keras, scale, core_only
      )
    else:
      built = _keras_formulas(inner_optimizer, base, legacy_keras, scale)
    self = super().__new__(cls, built.tx.init, built.tx.update)
    self._keras = built.keras
    self._inner = built.inner
    self._loss_scale_factor = built.config["loss_scale_factor"]
    self._config = {
      "name": name,
      "inner_optimizer": built.inner_config,
      **built.config,
    }
    return self

  def __repr__(self):
    return f"{type(self).__name__}({self._config!r})"

  def __reduce__(self):
    # copy/deepcopy (and pickle, when the inner optimizer is given by name)
    # rebuild from the configuration, not from the (init, update) pair.
    return (type(self).from_config, (self.get_config(),))

  # -- configuration -------------------------------------------------------

  def get_config(self) -> dict[str, Any]:
    """The constructor arguments; :meth:`from_config` builds an equal optimizer."""
    return dict(self._config)

  @classmethod
  def from_config(cls, config: Mapping[str, Any]) -> LossScaleOptimizer:
    """A new optimizer (fresh state) from a configuration.

    Reads :meth:`get_config`'s output and the configurations Keras 3,
    tf_keras and TensorFlow 2.3 write (``loss_scale`` holding a
    ``FixedLossScale`` or ``DynamicLossScale``); tf_keras' and TensorFlow
    2.3's (a ``dynamic`` or ``loss_scale`` key, no ``legacy_keras``) with
    tf_keras' semantics, ``legacy_keras=True``, as the optimizer that wrote
    them counts a skipped step.

    Raises:
      ValueError: a key that is none of the constructor's arguments (nor,
        in TensorFlow 2.3's form, ``optimizer``, ``loss_scale``, ``name``
        and ``legacy_keras``), as Keras 3 refuses it: nothing is dropped
        silently; a tf_keras or TensorFlow 2.3 config of an optimizer whose
        tf_keras formula is not written here (the message says to add
        ``"legacy_keras": False``).
    """
    accepted = _keras_config.constructor_keys(LossScaleOptimizer)
    required = _keras_config.constructor_keys(LossScaleOptimizer, required=True)
    kwargs = _keras_config.lso_kwargs(config, accepted, required)
    return LossScaleOptimizer.__new__(cls, **kwargs)

  def __getattr__(self, name):
    # Every constructor argument is readable as an attribute (Keras' style).
    config = self.__dict__.get("_config", {})
    if name in config and name != "inner_optimizer":
      return config[name]
    raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

  @property
  def inner_optimizer(self) -> Any:
    """The optax transformation, or the Keras optimizer's spec (by name)."""
    return self._inner

  # -- reading the state ---------------------------------------------------

  def _keras_state(self, state: Any, what: str) -> KerasOptimizerState:
    if self._keras is None:
      raise ValueError(
        f"`{what}` is kept by a Keras optimizer given by name (e.g. 'adam'); "
        "this LossScaleOptimizer wraps an optax transformation."
      )
    return _search.find_loss_scale_state(state).inner_state

  def loss_scale(self, state: Any) -> jax.Array:
    """The current float32 loss scale held in ``state``."""
    return _search.get_scale(state)

  def dynamic_counter(self, state: Any) -> jax.Array | None:
    """Finite steps in a row since the scale last changed; ``None`` if fixed."""
    if not self._config["dynamic"]:
      return None
    return _search.counters(state).good_steps

  def iterations(self, state: Any) -> jax.Array:
    """Keras' ``optimizer.iterations`` (Keras 3: applied steps, divided by the
    accumulation; tf_keras: every step, skipped ones included)."""
    it = self._keras_state(state, "iterations").iterations
    gas = self._config["gradient_accumulation_steps"]
    return it // gas if gas else it

  def learning_rate(self, state: Any) -> jax.Array:
    """The learning rate the next step uses, as Keras'
    ``optimizer.learning_rate``: a schedule's value at ``iterations``, or
    the rate the state holds (an optax inner optimizer: its injected rate,
    that of the last step)."""
    if self._keras is None:
      return _optimizers.get_learning_rate(state)
    inner = self._keras_state(state, "learning_rate")
    return _keras_engine.learning_rate(self._keras.spec, inner)

  lr = learning_rate

  def set_learning_rate(self, state: Any, learning_rate: Any) -> Any:
    """``state`` with the learning rate replaced (a number, not a schedule)."""
    if self._keras is None:
      return _optimizers.set_learning_rate(state, learning_rate)
    _optimizers.check_rate(learning_rate)
    if callable(self._keras.spec["learning_rate"]):
      raise ValueError(
        "This optimizer's learning rate is a schedule: it cannot be set."
      )
    counters = _search.find_loss_scale_state(state)
    inner = counters.inner_state._replace(
      learning_rate=jnp.asarray(learning_rate, jnp.float32)
    )
    return _keras_config.set_inner(state, counters, inner)

  # -- the loss-scaling operations -----------------------------------------

  def scale_loss(self, loss: Any, state: Any = None) -> jax.Array:
    """``loss * loss_scale * loss_scale_factor``, in at least float32.

    Raises:
      ValueError: ``state`` is not given (the message says what to write).
    """
    _with_state("scale_loss", state, "opt.scale_loss(loss, state)")
    scaled = _grad.scale_loss(loss, state)
    if self._loss_scale_factor is None:
      return scaled
    return _core.scale_value(scaled, self._loss_scale_factor)

  def get_scaled_loss(self, loss: Any, state: Any = None) -> Any:
    """TensorFlow's name: :meth:`scale_loss`, or for a callable loss a
    callable returning the scaled loss (as TensorFlow returns one).

    Raises:
      ValueError: ``state`` is not given (the message says what to write).
    """
    _with_state("get_scaled_loss", state, "opt.get_scaled_loss(loss, state)")
    if callable(loss):
      return lambda *args, **kwargs: self.scale_loss(loss(*args, **kwargs), state)
    return self.scale_loss(loss, state)

  def get_unscaled_gradients(self, grads: Any, state: Any = None) -> Any:
    """Gradients of :meth:`scale_loss`'s loss divided back, marked unscaled.

    Multiplied by the scale's float32 reciprocal, as TensorFlow does
    (Keras 3's formulas, ``legacy_keras=False``: divided, as Keras 3's
    ``ops.divide``, a half gradient kept in float32). The
    result is a :class:`UnscaledGradients` (index it as the tree, or read
    ``.tree``): :meth:`apply_gradients` takes it; ``update`` takes it as
    unscaled (by name) or refuses it (optax transformation), never dividing
    twice. Flax's float8 overwrite leaves are returned as they are; with a
    :func:`master_weights` inner optimizer, half-precision gradients come
    back in float32, as ``update`` hands them to it.

    Raises:
      ValueError: ``state`` is not given (the message says what to write).
    """
    _with_state(
      "get_unscaled_gradients", state, "opt.get_unscaled_gradients(grads, state)"
    )
    grads, _ = _tf_step.unwrap(grads)
    _tree.array_leaves(grads)
    if self._keras is not None:  # Keras' formulas: as their update unscales
      return _tf_step.UnscaledGradients(
        self._keras.unscale(grads, _search.get_scale(state))
      )
    return _tf_step.UnscaledGradients(
      _core.unscale_tree(
        grads,
        _search.get_scale(state),
        self._loss_scale_factor,
        keep=_overwrite.mask_in(state),
        float32=_plan.float32_gradient_leaves(state, grads),
      )
    )

  def apply_gradients(self, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
    """TensorFlow's ``apply_gradients``: unscaled gradients in, new params out.

    Checks ``grads`` (plain or from :meth:`get_unscaled_gradients`), adjusts
    the scale, and applies the step if they are finite.

    Gradients that :meth:`get_unscaled_gradients` did not return (its
    :class:`UnscaledGradients` mark) are applied as given, with a
    ``UserWarning``: if they are the gradients of the scaled loss, the step
    is the loss scale times too large. tf_keras applies them too, with the
    same warning (TensorFlow's idiom allows unscaling by hand); gradients
    unscaled by other means go in as ``UnscaledGradients(grads)``, which
    silences it.

    Returns:
      ``(new_params, new_state)``.
    """
    if self._keras is None:
      raise ValueError(
        "apply_gradients() takes unscaled gradients, which the core's loss "
        "scale around an optax transformation does not: call update() with "
        "the gradients of scale_loss(), or give the inner optimizer by name."
      )
    tree, marked = _tf_step.unwrap(grads)
    if not marked:
      warnings.warn(
        "apply_gradients() got gradients that get_unscaled_gradients() did "
        "not return: they are applied as given. If they are the gradients "
        "of the scaled loss, the step is the loss scale times too large; "
        "write grads = opt.get_unscaled_gradients(grads, state) first (or "
        "pass them to update(), which unscales). Gradients unscaled by other "
        "means: pass ols.porting.UnscaledGradients(grads).",
        UserWarning,
        stacklevel=2,
      )
    return self._keras.step(_tf_step.UnscaledGradients(tree), state, params)

  @staticmethod
  def check_finite(grads: Any) -> jax.Array:
    """Whether every floating entry of ``grads`` is finite (a bool scalar)."""
    return _finite.all_finite(_tf_step.unwrap(grads)[0])

  def finalize_variable_values(self, params: Any, state: Any) -> Any:
    """``params`` with the EMA swapped in if ``use_ema``, else ``params``
    (leaves that are not floating arrays, which are not averaged, as they are)."""
    if not self._config["use_ema"]:
      return params
    if self._keras is not None:
      ema = self._keras_state(state, "ema").ema
      return jax.tree.map(_keras_engine.swapped_in, params, ema)
    # Flax's float8 overwrite leaves are not averaged: they stay as they are.
    return _overwrite.on_regular_leaves(
      lambda p: _ema.finalize_variable_values(p, state), params, state
    )
