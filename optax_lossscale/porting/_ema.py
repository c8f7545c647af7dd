"""An exponential moving average of the parameters, as an optax transformation.

Optax averages *updates* (``optax.ema``), not parameters. Keras' ``use_ema``
keeps an average of the model weights after every step and can overwrite the
weights with it; :func:`ema_params` is that, with the average in its state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_lossscale._base import opt_state as _opt_state
from optax_lossscale._base import tree as _tree
from optax_lossscale._base import validate as _validate
from optax_lossscale.porting import _keras_engine
from optax_lossscale.porting._keras_engine import KerasOptimizerState


class EmaParamsState(NamedTuple):
  """State of :func:`ema_params`.

  Attributes:
    count: int32, steps averaged so far (saturating).
    ema: the average of the parameters after each step, in at least float32.
  """

  count: jax.Array
  ema: optax.Params


def _ema_dtype(x: jax.Array) -> Any:
  # An average of half-precision weights with momentum 0.99 cannot move in
  # half precision (the increments are below its resolution): keep float32.
  return jnp.float32 if jnp.finfo(x.dtype).bits < 32 else x.dtype


def ema_params(
  momentum: float = 0.99,
  *,
  overwrite_frequency: int | None = None,
) -> optax.GradientTransformation:
  """Keeps an exponential moving average of the parameters (Keras' ``use_ema``).

  Put it last in a chain: it sees the final updates, computes the new
  parameters ``optax.apply_updates(params, updates)`` (on the values the
  updates and new parameters hold, as eagerly: not the more precise ones
  XLA may keep for half-precision values inside a jitted step) and
  averages them:
  ``ema = m * ema + (1 - m) * new_params``, where ``m = momentum`` except on
  the first step (``m = 0``: the average starts at the first new parameters),
  as Keras does. Under a loss scale a skipped step leaves the state untouched.

  Read the average with :func:`get_ema_params`, or swap it in with
  :func:`finalize_variable_values` (Keras' name).

  Args:
    momentum: the averaging momentum, in [0, 1].
    overwrite_frequency: if set, every ``overwrite_frequency``-th step the
      updates are replaced so that the new parameters are the average (up to
      one rounding of ``params + (ema - params)``), as Keras'
      ``ema_overwrite_frequency``.

  Returns:
    An ``optax.GradientTransformation``; its ``update`` needs ``params``.

  Raises:
    ValueError: a bad argument (named), or ``update`` called without params.

  Example:
    >>> import jax.numpy as jnp, optax, optax_lossscale as ols
    >>> tx = optax.chain(optax.sgd(1.0), ols.ema_params(0.5))
    >>> params = {"w": jnp.array([4.0])}
    >>> state = tx.init(params)
    >>> for _ in range(2):
    ...   updates, state = tx.update({"w": jnp.array([1.0])}, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params["w"], ols.get_ema_params(state)["w"]  # 3, 2 -> ema 3, 2.5
    (Array([2.], dtype=float32), Array([2.5], dtype=float32))
  """
  momentum = _validate.float_in("momentum", momentum, 0.0, 1.0)
  overwrite_frequency = _validate.optional_int_at_least(
    "overwrite_frequency", overwrite_frequency, 1
  )

  def init_fn(params):
    # A copy, never the parameters' own buffer, of every array (an integer
    # one included): a donated step would donate it twice.
    # A Python float parameter is averaged as the array apply_updates makes it.
    ema = jax.tree.map(
      lambda p: (
        jnp.array(p, _ema_dtype(jnp.asarray(p)), copy=True)
        if _tree.is_float_array(p) or isinstance(p, float)
        else jnp.array(p, copy=True)
        if isinstance(p, jax.Array)
        else p
      ),
      params,
    )
    return EmaParamsState(count=jnp.zeros([], jnp.int32), ema=ema)

  def update_fn(updates, state, params=None):
    _opt_state.check_state_type("ema_params", state, EmaParamsState)
    if params is None:
      raise ValueError("ema_params needs the parameters: call update(..., params).")
    new_params = jax.tree.map(
      _widened, optax.apply_updates(params, jax.tree.map(_own_values, updates))
    )
    m = jnp.where(state.count == 0, 0.0, momentum).astype(jnp.float32)

    def average(avg, p):
      if not _tree.is_float_array(p):
        return avg
      dt = avg.dtype
      return m.astype(dt) * avg + (1 - m).astype(dt) * p.astype(dt)

    ema = jax.tree.map(average, state.ema, new_params)
    if overwrite_frequency is not None:
      overwrite = (state.count + 1) % overwrite_frequency == 0

      def to_average(u, avg, p):
        if not (_tree.is_float_array(u) and _tree.is_float_array(p)):
          return u
        jump = (avg.astype(p.dtype) - p).astype(u.dtype)
        return jnp.where(overwrite, jump, u)

      updates = jax.tree.map(to_average, updates, ema, params)
    return updates, EmaParamsState(count=optax.safe_increment(state.count), ema=ema)

  return optax.GradientTransformation(init_fn, update_fn)


def _own_values(x: Any) -> Any:
  """``x``, a half-precision array read on its bits (:func:`_tree.widen`):
  XLA may otherwise put in its place the more precise float32 value it
  computed it in ("excess precision"), and the average would start one
  rounding away from the parameters ``apply_updates`` makes."""
  return _tree.widen(x).astype(x.dtype) if _tree.is_float_array(x) else x


def _widened(x: Any) -> Any:
  """A new parameter in float32 or wider, exactly as it holds (see
  :func:`_own_values`)."""
  return _tree.widen(x) if _tree.is_float_array(x) else x


def _is_ema_state(x: Any) -> bool:
  """A state that keeps an average of the weights: :func:`ema_params`'s, or
  the Keras optimizer's of ``LossScaleOptimizer(name, use_ema=True)``."""
  if isinstance(x, EmaParamsState):
    return True
  return isinstance(x, KerasOptimizerState) and x.ema is not None


def get_ema_params(opt_state: Any) -> optax.Params:
  """The averaged parameters: the one average of the weights in ``opt_state``.

  The average is that of an :func:`ema_params` (also inside the porting
  ``LossScaleOptimizer`` of an optax transformation with ``use_ema=True``),
  or of the Keras optimizer of ``LossScaleOptimizer(name, use_ema=True)``
  (Keras' ``_model_variables_moving_average``: zeros before Keras 3's first
  applied step, the initial weights for tf_keras). :func:`ema_params`'
  leaves are in at least float32, Keras' in the weights' dtypes;
  :func:`finalize_variable_values` casts them to the parameters' dtypes.
  ``opt_state`` may also be a Flax ``TrainState`` or ``nnx.Optimizer``.

  Raises:
    ValueError: no average in ``opt_state``, or several.
  """
  state = _tree.find_unique(
    _opt_state.optimizer_state(opt_state),
    _is_ema_state,
    "ema_params state",
  )
  return _tree.unwrap_variables(state.ema)


def finalize_variable_values(params: optax.Params, opt_state: Any) -> optax.Params:
  """``params`` with the moving average swapped in (Keras' name for it).

  Args:
    params: the current parameters (their tree and dtypes are kept).
    opt_state: a state holding one :func:`ema_params` state.

  Returns:
    The averaged parameters, cast to the dtypes of ``params``; leaves that are
    not floating arrays, and leaves the average does not cover (masked, as
    Flax's float8 overwrite leaves are), are taken from ``params``.
  """
  ema = get_ema_params(opt_state)

  def swap(p, avg):
    return p if isinstance(avg, optax.MaskedNode) else _keras_engine.swapped_in(p, avg)

  return jax.tree.map(swap, params, ema)
