"""The Keras/TensorFlow ``LossScaleOptimizer`` surface, built on optax.

For people porting TensorFlow or Keras code: ``LossScaleOptimizer`` with an
inner optimizer given by its Keras name reproduces Keras 3's (or, with
``legacy_keras=True``, tf_keras') numbers step by step, under TensorFlow's
loss-scale rule; with an optax transformation it wraps it in the core's
loss scale. Either way it is an optax ``GradientTransformationExtraArgs``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_lossscale._base import tree as _tree
from optax_lossscale._loss_scale import config as _config
from optax_lossscale._loss_scale import core as _core
from optax_lossscale._loss_scale import finite as _finite
from optax_lossscale._loss_scale import grad as _grad
from optax_lossscale._loss_scale import overwrite as _overwrite
from optax_lossscale._loss_scale import state as _state
from optax_lossscale.porting import (
  _ema,
  _keras_config,
  _keras_math,
  _keras_optax,
  _optimizers,
  _tf_step,
)
from optax_lossscale.porting._keras_engine import BaseArgs, KerasOptimizerState

#: Keras' and TensorFlow's default ``dynamic_growth_steps`` and initial scale.
DEFAULT_GROWTH_STEPS = _config.DEFAULT_GROWTH_INTERVAL
DEFAULT_INITIAL_SCALE = _config.DEFAULT_INITIAL_SCALE


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
  in a row *if the product is finite*, and set to ``max(scale / 2, 1)`` on a
  non-finite step, which is skipped; any positive finite initial scale is
  accepted. The unscaled gradients are checked (tf_keras' check; Keras 3
  checks the scaled ones, which differs only below scale 1).

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
      config) in the core's loss scale, not Keras' formulas.
    axis_name: mapped axis to AND the finite flag over (pmap/shard_map).

  Raises:
    ValueError: any invalid argument; the message names it.

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
  ):
    for name, flag in (("dynamic", dynamic), ("legacy_keras", legacy_keras)):
      if not isinstance(flag, bool):
        raise ValueError(f"`{name}` must be a bool, got {flag!r}.")
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
    keras = not _keras_config.is_transformation(inner_optimizer)
    inner_config = inner_optimizer
    if keras and any(v is not None for v in core_only.values()):
      if legacy_keras:
        given = [f"{k}={v!r}" for k, v in core_only.items() if v is not None]
        raise ValueError(
          f"{', '.join(given)} with legacy_keras=True: the core's clamps, "
          "hysteresis and record run optax's optimizer of that name, not "
          "tf_keras' formulas."
        )
      # The core's arguments: optax's optimizer of that name, in the core's
      # loss scale (optax's argument names in its config).
      inner_optimizer, inner_config, from_inner = _optimizers.inner_spec(
        inner_optimizer
      )
      from_inner.pop("loss_scale_factor", None)  # as Keras 3 turns it off
      base = _keras_config.merge_base(base, from_inner)
      keras = False
    if keras:
      name, own, from_inner = _keras_config.inner_parts(inner_optimizer)
      # Keras 3's LossScaleOptimizer turns its inner optimizer's
      # loss_scale_factor off (the gradients would be unscaled twice).
      from_inner.pop("loss_scale_factor", None)
      base = _keras_config.merge_base(base, from_inner)
      if name.lower() == "adamw" and "weight_decay" not in from_inner:
        if base["weight_decay"] is None:
          base["weight_decay"] = _keras_math.DEFAULTS["adamw"]["weight_decay"]
    base = _keras_config.validate_base(base)
    self_config = {
      "dynamic": dynamic,
      "initial_scale": initial_scale,
      "dynamic_growth_steps": dynamic_growth_steps if dynamic else None,
      **base,
      "legacy_keras": legacy_keras,
      "axis_name": axis_name,
    }
    if keras:
      spec = _keras_math.spec(name, own, legacy=legacy_keras)
      if legacy_keras:
        for k in ("gradient_accumulation_steps", "loss_scale_factor"):
          if base[k] is not None:
            raise ValueError(f"`{k}`: tf_keras has none (legacy_keras=True).")
      factor = base.pop("loss_scale_factor")
      tx = _tf_step.KerasLossScale(
        spec,
        BaseArgs(**base),
        initial_scale,
        dynamic_growth_steps if dynamic else None,
        factor,
        axis_name,
      )
      inner_config = {"class_name": spec.name, "config": dict(spec.hyper)}
      self = super().__new__(cls, tx.init, tx.update)
      self._keras = tx
      self._inner = spec
    else:
      if legacy_keras:
        raise ValueError(
          "`legacy_keras=True` selects tf_keras' formulas: give the inner "
          "optimizer by its Keras name."
        )
      config = _keras_config.core_config(
        dynamic, initial_scale, dynamic_growth_steps, min_scale, max_scale, hysteresis
      )
      tx = _keras_optax.build(
        inner_optimizer,
        config,
        **base,
        axis_name=axis_name,
        track_nonfinite=track_nonfinite,
      )
      self_config.update(
        min_scale=config.min_scale if dynamic else None,
        max_scale=config.max_scale if dynamic else None,
        hysteresis=config.hysteresis if dynamic else None,
        track_nonfinite=track_nonfinite,
      )

      self = super().__new__(cls, tx.init, tx.update)
      self._keras = None
      self._inner = inner_optimizer
    self._loss_scale_factor = self_config["loss_scale_factor"]
    self._config = {"inner_optimizer": inner_config, **self_config}
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
    ``FixedLossScale`` or ``DynamicLossScale``).
    """
    return LossScaleOptimizer.__new__(cls, **_keras_config.lso_kwargs(config))

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
    return _state.find_loss_scale_state(state).inner_state

  def loss_scale(self, state: Any) -> jax.Array:
    """The current float32 loss scale held in ``state``."""
    return _state.get_scale(state)

  def dynamic_counter(self, state: Any) -> jax.Array | None:
    """Finite steps in a row since the scale last changed; ``None`` if fixed."""
    if not self._config["dynamic"]:
      return None
    return _state.counters(state).good_steps

  def iterations(self, state: Any) -> jax.Array:
    """Keras' ``optimizer.iterations`` (Keras 3: applied steps, divided by the
    accumulation; tf_keras: every step, skipped ones included)."""
    it = self._keras_state(state, "iterations").iterations
    gas = self._config["gradient_accumulation_steps"]
    return it // gas if gas else it

  def learning_rate(self, state: Any) -> jax.Array:
    """The learning rate of the last step (before any: of the first)."""
    if self._keras is None:
      return _optimizers.get_learning_rate(state)
    return self._keras_state(state, "learning_rate").learning_rate

  lr = learning_rate

  def set_learning_rate(self, state: Any, learning_rate: Any) -> Any:
    """``state`` with the learning rate replaced (a number, not a schedule)."""
    if self._keras is None:
      return _optimizers.set_learning_rate(state, learning_rate)
    if callable(self._keras.spec["learning_rate"]):
      raise ValueError(
        "This optimizer's learning rate is a schedule: it cannot be set."
      )
    counters = _state.find_loss_scale_state(state)
    inner = counters.inner_state._replace(
      learning_rate=jnp.asarray(learning_rate, jnp.float32)
    )
    return _keras_config.set_inner(state, counters, inner)

  # -- the loss-scaling operations -----------------------------------------

  def scale_loss(self, loss: Any, state: Any) -> jax.Array:
    """``loss * loss_scale * loss_scale_factor``, in at least float32."""
    scaled = _grad.scale_loss(loss, state)
    if self._loss_scale_factor is None:
      return scaled
    return _core.scale_value(scaled, self._loss_scale_factor)

  def get_scaled_loss(self, loss: Any, state: Any) -> Any:
    """TensorFlow's name: :meth:`scale_loss`, or for a callable loss a
    callable returning the scaled loss."""
    if callable(loss):
      return lambda *args, **kwargs: self.scale_loss(loss(*args, **kwargs), state)
    return self.scale_loss(loss, state)

  def get_unscaled_gradients(self, grads: Any, state: Any) -> Any:
    """Gradients of :meth:`scale_loss`'s loss divided back, marked unscaled.

    Multiplied by the scale's float32 reciprocal, as TensorFlow does. The
    result is a :class:`UnscaledGradients` (index it as the tree, or read
    ``.tree``): :meth:`apply_gradients` takes it; ``update`` takes it as
    unscaled (by name) or refuses it (optax transformation), never dividing
    twice. Flax's float8 overwrite leaves are returned as they are; with a
    :func:`master_weights` inner optimizer, half-precision gradients come
    back in float32, as ``update`` hands them to it.
    """
    grads, _ = _tf_step.unwrap(grads)
    _tree.array_leaves(grads)
    return _tf_step.UnscaledGradients(
      _core.unscale_tree(
        grads,
        _state.get_scale(state),
        self._loss_scale_factor,
        keep=_overwrite.mask_in(state),
        float32=_state.float32_gradient_leaves(state, grads),
      )
    )

  def apply_gradients(self, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
    """TensorFlow's ``apply_gradients``: unscaled gradients in, new params out.

    Checks ``grads`` (plain or from :meth:`get_unscaled_gradients`), adjusts
    the scale, and applies the step if they are finite.

    Returns:
      ``(new_params, new_state)``.
    """
    if self._keras is None:
      raise ValueError(
        "apply_gradients() takes unscaled gradients, which the core's loss "
        "scale around an optax transformation does not: call update() with "
        "the gradients of scale_loss(), or give the inner optimizer by name."
      )
    tree, _ = _tf_step.unwrap(grads)
    return self._keras.step(_tf_step.UnscaledGradients(tree), state, params)

  @staticmethod
  def check_finite(grads: Any) -> jax.Array:
    """Whether every floating entry of ``grads`` is finite (a bool scalar)."""
    return _finite.all_finite(_tf_step.unwrap(grads)[0])

  def finalize_variable_values(self, params: Any, state: Any) -> Any:
    """``params`` with the EMA swapped in if ``use_ema``, else ``params``."""
    if not self._config["use_ema"]:
      return params
    if self._keras is not None:
      ema = self._keras_state(state, "ema").ema
      return jax.tree.map(lambda p, a: a.astype(p.dtype), params, ema)
    # Flax's float8 overwrite leaves are not averaged: they stay as they are.
    return _overwrite.on_regular_leaves(
      lambda p: _ema.finalize_variable_values(p, state), params, state
    )
