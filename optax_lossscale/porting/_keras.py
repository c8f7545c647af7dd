"""The Keras/TensorFlow ``LossScaleOptimizer`` surface, built on optax.

For people porting TensorFlow or Keras code: every knob of
``tf.keras.mixed_precision.LossScaleOptimizer`` (and of the deprecated
``experimental`` class) with the same names and defaults, as an optax
``GradientTransformationExtraArgs`` built from the core transformations.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import optax

from optax_lossscale import (
  _config,
  _core,
  _finite,
  _grad,
  _overwrite,
  _state,
  _transform,
  _tree,
  _validate,
)
from optax_lossscale._low_precision import KahanSummationState, StochasticRoundingState
from optax_lossscale._master import MasterWeights, master_weights
from optax_lossscale.porting import _ema, _loss_scale, _optimizers


def _rounding_stays_last(
  inner: optax.GradientTransformation, after: list[str]
) -> optax.GradientTransformationExtraArgs:
  """``inner``, whose ``init`` refuses a rounding transformation in its
  state: what the facade adds after ``inner`` (``after``: weight decay, the
  EMA) would change the updates after they were rounded."""
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    state = inner.init(params)
    found = _tree.find_all(
      state, lambda x: isinstance(x, (StochasticRoundingState, KahanSummationState))
    )
    if found:
      kind = type(found[0][1]).__name__.removesuffix("State")
      raise ValueError(
        f"LossScaleOptimizer({', '.join(after)}) would act after the inner "
        f"optimizer's rounding ({kind}), which must come last: the decay or "
        "average would be rounded away or break what the rounding keeps. "
        "Pass master_weights(<the inner optimizer without the rounding>) "
        "instead (weight decay and EMA then act on the float32 master "
        "weights, before rounding), or put them in your chain before the "
        "rounding yourself (decoupled decay for Adam: optax.adamw(..., "
        "weight_decay=...)) and leave these arguments out."
      )
    return state

  return optax.GradientTransformationExtraArgs(init_fn, inner.update)


#: Keras' default ``dynamic_growth_steps``.
DEFAULT_GROWTH_STEPS = _config.DEFAULT_GROWTH_INTERVAL


class LossScaleOptimizer(optax.GradientTransformationExtraArgs):
  """Keras' ``LossScaleOptimizer``, as an optax transformation.

  It *is* an ``optax.GradientTransformationExtraArgs`` (``init``/``update``),
  so it drops into any optax, Flax or Orbax code. Its ``update`` takes the
  gradients of the *scaled* loss (:meth:`scale_loss`) and, in this order:
  unscales them by the loss scale and by ``loss_scale_factor``; checks them;
  accumulates them (``gradient_accumulation_steps``);
  clips them (``clipnorm``/``clipvalue``/``global_clipnorm``); runs the inner
  optimizer, plus Keras' decoupled ``weight_decay``; updates the average of
  the weights (``use_ema``); adjusts the scale. Clipping, decay and
  accumulation all see *unscaled* gradients.

  Rounding stays last. An inner optimizer made by :func:`master_weights`
  gets all of that inside it, on the float32 master weights, before they
  are rounded to the parameters' dtype: ``LossScaleOptimizer(
  master_weights(inner), weight_decay=...)`` is ``dynamic_loss_scale(
  master_weights(<inner with decay, EMA, clipping, accumulation>))``. An
  inner optimizer that rounds in a chain (:func:`stochastic_rounding`,
  :func:`kahan_summation`) cannot be reordered: with ``weight_decay`` or
  ``use_ema``, which would act after its rounding, ``init`` raises a
  ``ValueError`` that says how to compose them.

  Since optax transformations are stateless objects, the Keras attributes that
  live in variables are methods that take the optimizer state:
  ``loss_scale(state)``, ``dynamic_counter(state)``,
  ``learning_rate(state)``.

  Args:
    inner_optimizer: an optax transformation, or a Keras-style optimizer name
      (``'sgd'``, ``'adam'``, …) or ``{'class_name': name, 'config':
      {...}}``, built with ``optax.inject_hyperparams`` and Keras' default
      learning rate (0.01 for SGD, else 0.001); the other hyper-parameters
      keep optax's defaults (Adam's ``eps`` is 1e-8 where Keras' is 1e-7:
      pass it in ``config`` to match). Names make ``get_config`` serialisable;
      a transformation appears in it as itself.
    initial_scale: the initial loss scale (the fixed one if not ``dynamic``).
    dynamic_growth_steps: finite steps in a row before the scale doubles.
    dynamic: dynamic loss scaling (default). ``False`` keeps
      ``initial_scale`` fixed and, as TensorFlow's fixed loss scale, applies
      every step even when it is not finite (use :func:`static_loss_scale` for
      a fixed scale that skips).
    weight_decay: Keras' decoupled weight decay, ``p -= p * wd * lr`` each
      step; needs the learning rate (an inner optimizer given by name or
      built with ``optax.inject_hyperparams``).
    clipnorm: clip each gradient to this L2 norm.
    clipvalue: clip each gradient entry to ``[-clipvalue, clipvalue]``.
    global_clipnorm: clip all gradients to this global L2 norm. At most one of
      the three clipping arguments.
    use_ema: keep an exponential moving average of the weights
      (:func:`ema_params`); read it with :meth:`finalize_variable_values`.
    ema_momentum: the EMA momentum, in [0, 1].
    ema_overwrite_frequency: overwrite the weights with their average every
      this many applied steps (``None``: never).
    loss_scale_factor: a fixed extra factor on the loss, divided out of the
      gradients first.
    gradient_accumulation_steps: apply the mean of this many (>= 2) finite
      micro-batch gradients at once (``optax.MultiSteps`` inside the scale);
      Flax's float8 overwrite leaves get the maximum of their new values.
    min_scale: floor of the dynamic scale.
    max_scale: ceiling of the dynamic scale.
    hysteresis: non-finite steps tolerated before backing off.
    axis_name: mapped axis to AND the finite flag over (pmap/shard_map).
    track_nonfinite: record which gradient leaves were not finite, and
      whether the loss was (see :func:`nonfinite_report`); off by default.

  Raises:
    ValueError: any invalid argument; the message names it.

  Example:
    >>> import jax.numpy as jnp, optax_lossscale as ols
    >>> opt = ols.LossScaleOptimizer("sgd", initial_scale=1024.0, clipnorm=1.0)
    >>> params = {"w": jnp.ones(3)}
    >>> state = opt.init(params)
    >>> grads = {"w": jnp.full(3, 1024.0 * 10)}  # gradients of the scaled loss
    >>> updates, state = opt.update(grads, state, params)
    >>> updates["w"]  # unscaled to 10, clipped to norm 1, times -0.01
    Array([-0.0057735, -0.0057735, -0.0057735], dtype=float32)
    >>> float(opt.loss_scale(state)), int(opt.dynamic_counter(state))
    (1024.0, 1)
  """

  def __new__(
    cls,
    inner_optimizer: Any,
    initial_scale: float = _config.DEFAULT_INITIAL_SCALE,
    dynamic_growth_steps: int | None = DEFAULT_GROWTH_STEPS,
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
    min_scale: float = _config.DEFAULT_MIN_SCALE,
    max_scale: float = _config.DEFAULT_MAX_SCALE,
    hysteresis: int = 1,
    axis_name: Any = None,
    track_nonfinite: bool = False,
  ):
    inner, inner_config = _optimizers.inner_spec(inner_optimizer)
    if not isinstance(dynamic, bool):
      raise ValueError(f"`dynamic` must be a bool, got {dynamic!r}.")
    if dynamic:
      if dynamic_growth_steps is None:
        raise ValueError("`dynamic_growth_steps` must be an integer when dynamic.")
      _validate.int_in("dynamic_growth_steps", dynamic_growth_steps, 1)
      scale = _loss_scale.DynamicLossScale(
        initial_scale,
        growth_interval=dynamic_growth_steps,
        min_scale=min_scale,
        max_scale=max_scale,
        hysteresis=hysteresis,
      )
      dynamic_growth_steps = scale.config.growth_interval
    else:
      # Arguments that only a dynamic scale uses must not be silently dropped
      # (TensorFlow raises for dynamic_growth_steps). Their defaults, which
      # get_config reports, are accepted.
      dynamic_only = {
        "dynamic_growth_steps": (dynamic_growth_steps, (None, DEFAULT_GROWTH_STEPS)),
        "min_scale": (min_scale, (_config.DEFAULT_MIN_SCALE,)),
        "max_scale": (max_scale, (_config.DEFAULT_MAX_SCALE,)),
        "hysteresis": (hysteresis, (1,)),
      }
      given = [
        f"{k}={v!r}"
        for k, (v, defaults) in dynamic_only.items()
        if not any(v is d or (not isinstance(v, bool) and v == d) for d in defaults)
      ]
      if given:
        raise ValueError(
          f"{', '.join(given)} given with dynamic=False: only a dynamic loss "
          "scale uses them. Drop them, or pass dynamic=True."
        )
      # TensorFlow's fixed loss scale applies every step.
      scale = _loss_scale.StaticLossScale(initial_scale, skip_nonfinite=False)
      dynamic_growth_steps = None
    initial_scale = scale.config.initial_scale

    if weight_decay is not None:
      weight_decay = _validate.float_in("weight_decay", weight_decay, 0.0, math.inf)
      _validate.as_f32("weight_decay", weight_decay)
    clipnorm = _validate.optional_positive("clipnorm", clipnorm, f32=True)
    clipvalue = _validate.optional_positive("clipvalue", clipvalue, f32=True)
    global_clipnorm = _validate.optional_positive(
      "global_clipnorm", global_clipnorm, f32=True
    )
    if sum(c is not None for c in (clipnorm, clipvalue, global_clipnorm)) > 1:
      raise ValueError(
        "Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set; "
        f"got clipnorm={clipnorm}, clipvalue={clipvalue}, "
        f"global_clipnorm={global_clipnorm}."
      )
    if not isinstance(use_ema, bool):
      raise ValueError(f"`use_ema` must be a bool, got {use_ema!r}.")
    ema_momentum = _validate.float_in("ema_momentum", ema_momentum, 0.0, 1.0)
    ema_overwrite_frequency = _validate.optional_int_at_least(
      "ema_overwrite_frequency", ema_overwrite_frequency, 1
    )
    if loss_scale_factor is not None:
      # Divided out of the gradients: it and its reciprocal must be normal
      # float32 numbers, as a loss scale.
      loss_scale_factor = _validate.check_scale("loss_scale_factor", loss_scale_factor)
    gradient_accumulation_steps = _validate.optional_int_at_least(
      "gradient_accumulation_steps", gradient_accumulation_steps, 2
    )

    # Build the chain, innermost first (the order is the docstring's), inside
    # master_weights if the inner optimizer is one: rounding stays last.
    store = inner.store if isinstance(inner, MasterWeights) else None
    body = inner.inner if store is not None else inner
    after = [
      f"{k}={v!r}"
      for k, v in (("weight_decay", weight_decay), ("use_ema", use_ema))
      if v
    ]
    if after:
      body = _rounding_stays_last(body, after)
    if weight_decay:
      body = _optimizers.decoupled_weight_decay(body, weight_decay)
    if use_ema:
      body = optax.chain(
        body,
        _ema.ema_params(ema_momentum, overwrite_frequency=ema_overwrite_frequency),
      )
    if clipnorm is not None:
      body = optax.chain(_optimizers.clip_each_by_norm(clipnorm), body)
    elif clipvalue is not None:
      body = optax.chain(optax.clip(clipvalue), body)
    elif global_clipnorm is not None:
      body = optax.chain(optax.clip_by_global_norm(global_clipnorm), body)
    if gradient_accumulation_steps is not None:
      body = optax.MultiSteps(
        body, gradient_accumulation_steps
      ).gradient_transformation()
    if store is not None:
      body = master_weights(body, store=store)
    # The factor is divided out with the loss scale, before the finite check,
    # so the check sees what is applied.
    tx = _transform.loss_scale_transformation(
      body,
      scale.config,
      axis_name=axis_name,
      factor=loss_scale_factor,
      track_nonfinite=track_nonfinite,
    )

    self = super().__new__(cls, tx.init, tx.update)
    self._inner = inner
    self._loss_scale_factor = loss_scale_factor
    self._config = {
      "inner_optimizer": inner_config,
      "dynamic": dynamic,
      "initial_scale": initial_scale,
      "dynamic_growth_steps": dynamic_growth_steps,
      "weight_decay": weight_decay,
      "clipnorm": clipnorm,
      "clipvalue": clipvalue,
      "global_clipnorm": global_clipnorm,
      "use_ema": use_ema,
      "ema_momentum": ema_momentum,
      "ema_overwrite_frequency": ema_overwrite_frequency,
      "loss_scale_factor": loss_scale_factor,
      "gradient_accumulation_steps": gradient_accumulation_steps,
      "min_scale": scale.config.min_scale if dynamic else _config.DEFAULT_MIN_SCALE,
      "max_scale": scale.config.max_scale if dynamic else _config.DEFAULT_MAX_SCALE,
      "hysteresis": scale.config.hysteresis,
      "axis_name": axis_name,
      "track_nonfinite": track_nonfinite,
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
    """A new optimizer (fresh state) from :meth:`get_config`'s output."""
    return LossScaleOptimizer.__new__(cls, **config)

  def __getattr__(self, name):
    # Every constructor argument is readable as an attribute (Keras' style).
    config = self.__dict__.get("_config", {})
    if name in config and name != "inner_optimizer":
      return config[name]
    raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

  @property
  def inner_optimizer(self) -> optax.GradientTransformation:
    """The wrapped optax transformation (built, if given by name)."""
    return self._inner

  # -- reading the state ---------------------------------------------------

  def loss_scale(self, state: Any) -> jax.Array:
    """The current float32 loss scale held in ``state``."""
    return _state.get_scale(state)

  def dynamic_counter(self, state: Any) -> jax.Array | None:
    """Finite steps in a row since the scale last changed; ``None`` if fixed."""
    if not self._config["dynamic"]:
      return None
    return _state.counters(state).good_steps

  def learning_rate(self, state: Any) -> jax.Array:
    """The inner optimizer's injected learning rate (see :func:`get_learning_rate`)."""
    return _optimizers.get_learning_rate(state)

  lr = learning_rate

  def set_learning_rate(self, state: Any, learning_rate: Any) -> Any:
    """``state`` with the inner learning rate replaced."""
    return _optimizers.set_learning_rate(state, learning_rate)

  # -- the loss-scaling operations -----------------------------------------

  def scale_loss(self, loss: Any, state: Any) -> jax.Array:
    """``loss * loss_scale * loss_scale_factor``, in at least float32."""
    scaled = _grad.scale_loss(loss, state)
    if self._loss_scale_factor is None:
      return scaled
    return _core.scale_value(scaled, self._loss_scale_factor)

  def get_unscaled_gradients(self, grads: Any, state: Any) -> Any:
    """Gradients of :meth:`scale_loss`'s loss divided back, as ``update`` does.

    Flax's float8 overwrite leaves (new values, not gradients) are returned
    as they are, as ``update`` takes them; with a :func:`master_weights`
    inner optimizer, half-precision gradients come back in float32, as
    ``update`` hands them to it.
    """
    _tree.array_leaves(grads)
    return _core.unscale_tree(
      grads,
      _state.get_scale(state),
      self._loss_scale_factor,
      keep=_overwrite.mask_in(state),
      float32=_state.wants_float32_gradients(state),
    )

  @staticmethod
  def check_finite(grads: Any) -> jax.Array:
    """Whether every floating entry of ``grads`` is finite (a bool scalar)."""
    return _finite.all_finite(grads)

  def finalize_variable_values(self, params: Any, state: Any) -> Any:
    """``params`` with the EMA swapped in if ``use_ema``, else ``params``."""
    if not self._config["use_ema"]:
      return params
    # Flax's float8 overwrite leaves are not averaged: they stay as they are.
    return _overwrite.on_regular_leaves(
      lambda p: _ema.finalize_variable_values(p, state), params, state
    )
