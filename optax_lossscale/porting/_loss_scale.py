"""TensorFlow's ``LossScale`` objects, as a thin facade over the core functions.

:class:`DynamicLossScale`, :class:`StaticLossScale` and :class:`NoOpLossScale`
are immutable pytrees: their one child is a :class:`LossScaleState` (its
counters are device arrays; the same state the transformations keep, so
``get_scale`` and ``diagnostics`` find it by the same search), their
:class:`LossScaleConfig` is static metadata (never a leaf, so ``jax.jit`` can
neither trace nor drop it). Calling one gives the current scale;
``update(grads)`` gives the next object and whether to apply the step, as
TensorFlow's ``LossScale.update`` does. TensorFlow's argument names
(``initial_loss_scale``, ``increment_period``, ``multiplier``) are accepted
here, and only here. ``with_loss_scale`` wraps an optax transformation in
the loss scale a ``LossScale`` object configures.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from optax_lossscale._base import tree as _tree
from optax_lossscale._loss_scale import config as _config
from optax_lossscale._loss_scale import core as _core
from optax_lossscale._loss_scale import finite as _finite
from optax_lossscale._loss_scale.config import LossScaleConfig
from optax_lossscale._loss_scale.core import LossScaleState
from optax_lossscale.porting import _keras_config, _tf_names, _tf_rule

__all__ = [
  "DynamicLossScale",
  "LossScale",
  "NoOpLossScale",
  "StaticLossScale",
]


class LossScale:
  """Base class: a loss scale as an immutable pytree (TensorFlow's ``LossScale``).

  Its pytree child is a :class:`LossScaleState` (``inner_state`` and
  ``nonfinite`` are ``None``), whose counters are the leaves, readable as
  attributes (``ls.loss_scale``, ``ls.good_steps``, …); :attr:`config` is
  static metadata, kept intact through ``jax.jit``, ``jax.tree.map`` and
  flatten/unflatten.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> ls = ols.porting.DynamicLossScale(initial_scale=2.0**10, growth_interval=2)
    >>> float(ls())
    1024.0
    >>> grads = {"w": jnp.array([2048.0, 4096.0])}
    >>> ls.unscale(grads)["w"]
    Array([2., 4.], dtype=float32)
    >>> ls, ok = ls.update({"w": jnp.array([jnp.inf])})
    >>> bool(ok), float(ls())
    (False, 512.0)
  """

  __slots__ = ("_state", "_config")

  def __init__(self, config: LossScaleConfig):
    self._config = config
    self._state = _core.initial_state(config)

  def replace(self, counters: Any) -> LossScale:
    """The same loss scale (same config) with other counters.

    Args:
      counters: a :class:`LossScaleState` (its ``inner_state`` and
        ``nonfinite`` are dropped), or the five counters in the order of its
        fields (the pytree's leaves).
    """
    if isinstance(counters, LossScaleState):
      counters = [getattr(counters, f) for f in _core.COUNTER_FIELDS]
    counters = tuple(counters)
    if len(counters) != len(_core.COUNTER_FIELDS):
      raise ValueError(
        f"A loss scale has {len(_core.COUNTER_FIELDS)} counters "
        f"({', '.join(_core.COUNTER_FIELDS)}), got {len(counters)}."
      )
    return self.tree_unflatten(self._config, (LossScaleState(*counters),))

  # -- pytree: one child, the state ------------------------------------------

  def tree_flatten_with_keys(self):
    return [(jax.tree_util.GetAttrKey("counters"), self._state)], self._config

  def tree_flatten(self):
    return (self._state,), self._config

  @classmethod
  def tree_unflatten(cls, config, children):
    children = tuple(children)
    if len(children) == len(_core.COUNTER_FIELDS):  # an earlier layout: the
      children = (LossScaleState(*children),)  # five counters as its children
    if len(children) != 1:
      raise ValueError(
        f"A loss scale's pytree has one child (its LossScaleState) or its "
        f"{len(_core.COUNTER_FIELDS)} counters; got {len(children)} children."
      )
    (state,) = children
    obj = object.__new__(cls)
    obj._config = config
    obj._state = state
    return obj

  # -- read access ---------------------------------------------------------

  @property
  def config(self) -> LossScaleConfig:
    """The static hyper-parameters."""
    return self._config

  @property
  def counters(self) -> LossScaleState:
    """The state (``inner_state`` is ``None``: a loss scale wraps nothing)."""
    return self._state

  def get_config(self) -> dict[str, Any]:
    """The constructor arguments (Python numbers): ``from_config`` inverts it."""
    raise NotImplementedError

  @classmethod
  def from_config(cls, config: dict[str, Any]) -> LossScale:
    """A fresh loss scale (initial counters) from :meth:`get_config`'s output.

    Raises:
      ValueError: a key that is not one of the constructor's arguments (as
        TensorFlow's ``cls(**config)`` refuses it), or an invalid value.
    """
    accepted = _keras_config.constructor_keys(cls)
    required = _keras_config.constructor_keys(cls, required=True)
    return cls(
      **_keras_config.checked_config(cls.__name__, config, accepted, required=required)
    )

  def __call__(self) -> jax.Array:
    """The current loss scale, a float32 scalar."""
    return self._state.loss_scale

  def __repr__(self):
    name = type(self).__name__
    return f"{name}(scale={self._state.loss_scale!r}, config={self._config})"

  # -- the operations ------------------------------------------------------

  def scale_loss(self, loss: Any) -> Any:
    """The loss multiplied by the current scale, in at least float32.

    A callable loss (TensorFlow's ``get_scaled_loss`` takes one) gives a
    callable that returns its scaled value.
    """
    if callable(loss):
      return lambda *args, **kwargs: self.scale_loss(loss(*args, **kwargs))
    if self._config.noop:
      return jnp.asarray(loss)
    return _core.scale_value(loss, self._state.loss_scale)

  def unscale(self, grads: Any) -> Any:
    """Gradients of the scaled loss divided by the current scale."""
    if self._config.noop:
      return grads
    return _core.unscale(grads, self._state.loss_scale)

  def adjust(self, finite: jax.Array) -> tuple[LossScale, jax.Array]:
    """The next loss scale given whether this step's gradients were finite.

    The core's rule under this object's configuration: TensorFlow's bounds
    for a :class:`DynamicLossScale` made without the core's clamps (a
    :class:`_tf_rule.TFRuleConfig`), the core's clamps otherwise.
    """
    state, should_apply = _core.adjust(self._state, finite, self._config)
    return self.replace(state), should_apply

  def update(self, grads: Any, *, axis_name: Any = None) -> tuple[LossScale, jax.Array]:
    """Checks already-unscaled ``grads`` and adjusts the scale.

    Args:
      grads: the unscaled gradients; ``None`` leaves are ignored, a leaf that
        is not an array is a ``ValueError`` naming it.
      axis_name: if set, the finite flag is ANDed across this mapped axis, so
        every replica takes the same decision.

    Returns:
      ``(new_loss_scale, should_apply_gradients)``: a new object of the same
      type and a scalar boolean array.
    """
    _tree.array_leaves(grads)
    if self._config.noop:
      return self, jnp.array(True)
    finite = _finite.leaves_finite(jax.tree.leaves(grads))
    return self.adjust(_core.reduce_flag(finite, axis_name))

  def unscale_and_update(
    self, scaled_grads: Any, *, axis_name: Any = None
  ) -> tuple[Any, LossScale, jax.Array]:
    """:meth:`unscale`, then :meth:`update`: what an optimizer step needs.

    Returns ``(unscaled_grads, new_loss_scale, should_apply)``, computed by
    the core's ``unscale_tree`` and ``check`` as the optax transformations
    compute them.
    """
    _tree.array_leaves(scaled_grads)
    if self._config.noop:
      return scaled_grads, self, jnp.array(True)
    grads = _core.unscale_tree(scaled_grads, self._state.loss_scale)
    finite = _core.check(
      scaled_grads,
      grads,
      self._config,
      axis_name,
      loss_scale=self._state.loss_scale,
    )
    new, should_apply = self.adjust(finite)
    return grads, new, should_apply


# The counters, read-only, as attributes (ls.loss_scale, ls.good_steps, ...).
for _name in _core.COUNTER_FIELDS:
  setattr(
    LossScale,
    _name,
    property(operator.attrgetter(f"_state.{_name}"), doc=f"The state's ``{_name}``."),
  )
del _name


@jax.tree_util.register_pytree_with_keys_class
class DynamicLossScale(LossScale):
  """Dynamic loss scaling: TensorFlow's ``DynamicLossScale``, or the core's rule.

  Given TensorFlow's argument names (``initial_loss_scale``,
  ``increment_period``, ``multiplier``, as TensorFlow's own ``from_config``
  passes them) and none of ``backoff_factor``, ``min_scale``, ``max_scale``
  and ``hysteresis``, it is ``tf.compat.v1.mixed_precision.DynamicLossScale``:
  TensorFlow's rule (the scale grows while the grown value is at most
  ``2**126``, where TensorFlow's grows while finite, and backs off to no
  less than 1; a positive float32 initial scale up to ``2**126``),
  and ``get_config`` gives TensorFlow's dict. Otherwise it is the core's
  rule, clamped to ``[min_scale, max_scale]`` (default ``[1, 2**24]``).

  Args:
    initial_scale: the starting scale (default ``2**15``).
    growth_interval: after this many finite steps in a row the scale is
      multiplied by ``growth_factor`` (default 2000).
    growth_factor: growth multiplier, > 1 (default 2).
    backoff_factor: backoff multiplier on a non-finite step, in (0, 1)
      (default 0.5).
    min_scale: the scale never goes below this (positive, normal float32;
      default 1).
    max_scale: the scale never goes above this (finite; default ``2**24``).
    hysteresis: non-finite steps tolerated before backing off (Megatron-LM);
      the count refills when the scale grows. 1 backs off on every one.
    initial_loss_scale: TensorFlow's name for ``initial_scale``.
    increment_period: TensorFlow's name for ``growth_interval``.
    multiplier: TensorFlow's growth factor; the backoff factor is then
      ``1 / multiplier``, as in TensorFlow.

  Raises:
    ValueError: an invalid value, or a TensorFlow name given together with
      its counterpart, whatever the values (the message names both).

  Example:
    >>> import optax_lossscale as ols
    >>> DynamicLossScale = ols.porting.DynamicLossScale
    >>> tf_style = DynamicLossScale(initial_loss_scale=2048, increment_period=500)
    >>> tf_style.get_config()
    {'initial_loss_scale': 2048.0, 'increment_period': 500, 'multiplier': 2.0}
    >>> ols.porting.DynamicLossScale(2048, growth_interval=500).config.max_scale
    16777216.0
  """

  __slots__ = ()

  def __init__(
    self,
    initial_scale: float = _tf_names.DefaultFloat(_config.DEFAULT_INITIAL_SCALE),
    *,
    growth_interval: int = _tf_names.DefaultInt(_config.DEFAULT_GROWTH_INTERVAL),
    growth_factor: float = _tf_names.DefaultFloat(_config.DEFAULT_GROWTH_FACTOR),
    backoff_factor: float = _tf_names.DefaultFloat(_config.DEFAULT_BACKOFF_FACTOR),
    min_scale: float | None = None,
    max_scale: float | None = None,
    hysteresis: int | None = None,
    initial_loss_scale: float | None = None,
    increment_period: int | None = None,
    multiplier: float | None = None,
  ):
    ours = {
      "initial_scale": initial_scale,
      "growth_interval": growth_interval,
      "growth_factor": growth_factor,
      "backoff_factor": backoff_factor,
    }
    tf = {
      "initial_loss_scale": initial_loss_scale,
      "increment_period": increment_period,
      "multiplier": multiplier,
    }
    given = {k: v for k, v in ours.items() if _tf_names.given(v)}
    defaults = {
      k: type(v).__base__(v) for k, v in ours.items() if not _tf_names.given(v)
    }
    kwargs = {**defaults, **_tf_names.resolve_tf_names(given, tf)}
    with _tf_names.as_given(tf):  # (resolve_tf_names names both spellings)
      clamps = {
        "min_scale": min_scale,
        "max_scale": max_scale,
        "hysteresis": hysteresis,
      }
      tf_style = any(v is not None for v in tf.values())
      ours_only = "backoff_factor" in given or any(
        v is not None for v in clamps.values()
      )
      if ours_only or not tf_style:
        config = _config.dynamic_config(
          **{k: v for k, v in clamps.items() if v is not None}, **kwargs
        )
      else:
        config = _tf_rule.config(kwargs)
    super().__init__(config)

  # TensorFlow's attribute names.
  @property
  def initial_loss_scale(self) -> float:
    return self._config.initial_scale

  @property
  def increment_period(self) -> int:
    return self._config.growth_interval

  @property
  def multiplier(self) -> float:
    return self._config.growth_factor

  def get_config(self) -> dict[str, Any]:
    """TensorFlow's keys when it follows TensorFlow's rule, else ours."""
    c = self._config
    if isinstance(c, _tf_rule.TFRuleConfig):
      return {
        "initial_loss_scale": c.initial_scale,
        "increment_period": c.growth_interval,
        "multiplier": c.growth_factor,
      }
    return {
      "initial_scale": c.initial_scale,
      "growth_interval": c.growth_interval,
      "growth_factor": c.growth_factor,
      "backoff_factor": c.backoff_factor,
      "min_scale": c.min_scale,
      "max_scale": c.max_scale,
      "hysteresis": c.hysteresis,
    }


@jax.tree_util.register_pytree_with_keys_class
class StaticLossScale(LossScale):
  """A fixed loss scale (TensorFlow's ``FixedLossScale``).

  Args:
    scale: the fixed scale: a float32 number in ``[2**-126, float32 max]``
      (TensorFlow's ``FixedLossScale`` takes any from 1 to float32's
      largest). Above ``2**126`` the reciprocal is a subnormal number,
      which XLA (as TensorFlow) flushes to zero: :meth:`unscale` then gives
      zeros, as TensorFlow's unscaling does.
    skip_nonfinite: skip steps whose gradients are not finite (default). With
      ``False`` every step is applied, exactly as TensorFlow's
      ``FixedLossScale``.

  Raises:
    ValueError: a scale outside that range or not a real number, or a
      ``skip_nonfinite`` that is not a bool.
  """

  __slots__ = ()

  def __init__(self, scale: float, *, skip_nonfinite: bool = True):
    super().__init__(_tf_rule.fixed_config(scale, skip_nonfinite))

  def get_config(self) -> dict[str, Any]:
    """TensorFlow's ``FixedLossScale`` config when it applies every step."""
    if not self._config.skip_nonfinite:
      return {"loss_scale_value": self._config.initial_scale}
    return {"scale": self._config.initial_scale, "skip_nonfinite": True}

  @classmethod
  def from_config(cls, config: dict[str, Any]) -> StaticLossScale:
    """Reads :meth:`get_config`'s output and TensorFlow's ``FixedLossScale``'s.

    Raises:
      ValueError: a key of neither form: ``{"loss_scale_value": x}``
        (TensorFlow's, every step applied) or the constructor's ``scale``
        and ``skip_nonfinite``; the forms are not mixed.
    """
    if isinstance(config, Mapping) and "loss_scale_value" in config:
      config = _keras_config.checked_config(
        cls.__name__,
        config,
        _keras_config.TF_LOSS_SCALE_KEYS["FixedLossScale"],
        form="TensorFlow's FixedLossScale config (every step applied)",
      )
      return cls(config["loss_scale_value"], skip_nonfinite=False)
    return super().from_config(config)


@jax.tree_util.register_pytree_with_keys_class
class NoOpLossScale(LossScale):
  """Scale 1, nothing unscaled, nothing checked, every step applied.

  For float32 or bfloat16 training through the same code path.
  """

  __slots__ = ()

  def __init__(self):
    super().__init__(_config.NOOP_CONFIG)

  def get_config(self) -> dict[str, Any]:
    return {}
