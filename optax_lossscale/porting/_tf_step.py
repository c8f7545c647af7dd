"""A Keras optimizer under TensorFlow's loss scale: one step, as TensorFlow takes it.

:class:`KerasLossScale` is what ``LossScaleOptimizer`` builds for an inner
optimizer given by its Keras name: its ``update`` takes the gradients of
the scaled loss (optax's convention), its ``apply_gradients`` unscaled ones
(TensorFlow's); both check the unscaled gradients, adjust the scale by
TensorFlow's rule (the core's ``adjust`` under
:func:`._tf_rule.keras_config`) and run the Keras step
(:mod:`._keras_engine`) when they are finite. :class:`UnscaledGradients`
marks what ``get_unscaled_gradients`` returns, so that ``update`` never
divides it a second time.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from optax_lossscale._base import opt_state as _opt_state
from optax_lossscale._base import rounding as _rounding
from optax_lossscale._base import tree as _tree
from optax_lossscale._loss_scale import core as _core
from optax_lossscale._loss_scale import finite as _finite
from optax_lossscale._loss_scale import skip as _skip
from optax_lossscale._loss_scale.core import LossScaleState
from optax_lossscale.porting import _keras_engine, _tf_rule
from optax_lossscale.porting._keras_engine import BaseArgs
from optax_lossscale.porting._keras_math import OptimizerSpec

__all__ = ["KerasLossScale", "UnscaledGradients"]

_F32 = jnp.float32


@jax.tree_util.register_pytree_node_class
class UnscaledGradients:
  """Gradients already divided by the loss scale (``get_unscaled_gradients``).

  A pytree whose one child is the gradient tree; indexing, iteration and
  ``len`` reach into it, and :attr:`tree` is the tree itself. The porting
  ``LossScaleOptimizer.update`` takes it as unscaled (no second division),
  and ``apply_gradients`` takes it or the plain tree.
  """

  __slots__ = ("tree",)

  def __init__(self, tree: Any):
    self.tree = tree

  def tree_flatten(self):
    return (self.tree,), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    del aux
    return cls(children[0])

  def __getitem__(self, key):
    return self.tree[key]

  def __iter__(self):
    return iter(self.tree)

  def __len__(self):
    return len(self.tree)

  def __repr__(self):
    return f"UnscaledGradients({self.tree!r})"


def unwrap(grads: Any) -> tuple[Any, bool]:
  """``(the tree, whether it was marked unscaled)``."""
  if isinstance(grads, UnscaledGradients):
    return grads.tree, True
  return grads, False


def _divide(g: jax.Array, by: Any) -> jax.Array:
  """Keras 3's ``ops.divide(g, scale)``: in at least float32, and kept so
  (a half gradient divided by the float32 scale is float32)."""
  return _tree.real_op(jnp.divide, _tree.widen(g), jnp.asarray(by, jnp.float32))


def _difference(new: Any, p: Any) -> Any:
  if _rounding.is_half(p):
    return _rounding.exact_update(new, p)
  return new - p


def _as_variable(g: Any, p: Any) -> Any:
  """Gradient ``g`` in its variable ``p``'s dtype, where both are floating."""
  if _tree.is_float_array(g) and _tree.is_float_array(p):
    return g.astype(p.dtype)
  return g


class KerasLossScale:
  """TensorFlow's loss scale around a Keras optimizer: ``init``, ``update``, ``step``.

  Args:
    spec: the Keras optimizer.
    base: its base arguments.
    initial_scale: the initial (or fixed) scale, a float32 in [2**-126, 2**126].
    growth_steps: ``dynamic_growth_steps``, or ``None`` for a fixed scale
      (every step applied, as TensorFlow's fixed scale).
    factor: ``loss_scale_factor``, divided out after the scale, or ``None``.
    axis_name: the mapped axis to AND the finite flag over.
  """

  def __init__(self, spec, base, initial_scale, growth_steps, factor, axis_name):
    self.spec: OptimizerSpec = spec
    self.base: BaseArgs = base
    self.initial_scale = initial_scale
    self.growth_steps = growth_steps
    self.factor = factor
    self.axis_name = axis_name
    self.config = _tf_rule.keras_config(initial_scale, growth_steps, legacy=spec.legacy)

  def init(self, params: Any) -> LossScaleState:
    inner = _keras_engine.init(self.spec, self.base, params)
    return _core.initial_state(self.config, inner)

  def unscale(self, grads: Any, scale: jax.Array) -> Any:
    """Keras 3 divides by the scale; tf_keras multiplies by its reciprocal.

    Keras 3's ``ops.divide`` promotes a half gradient by the float32 scale:
    the gradient stays float32 through clipping and accumulation, and the
    formula casts it to the variable's dtype (as Keras' ``update_step``).
    tf_keras casts the reciprocal to the gradient's dtype: it stays there.
    """
    _tree.array_leaves(grads)
    if self.spec.legacy:
      out = _core.unscale_tree(grads, scale)
    else:
      out = jax.tree.map(
        lambda g: _divide(g, scale) if _tree.is_float_array(g) else g, grads
      )
    if self.factor is not None:
      out = jax.tree.map(
        lambda g: _divide(g, self.factor) if _tree.is_float_array(g) else g, out
      )
    return out

  def step(
    self, grads: Any, state: LossScaleState, params: Any
  ) -> tuple[Any, LossScaleState]:
    """``(new params, new state)`` for ``grads``, scaled or marked unscaled."""
    if not isinstance(state, LossScaleState) or not isinstance(
      state.inner_state, _keras_engine.KerasOptimizerState
    ):
      raise ValueError(
        "This LossScaleOptimizer expects the state made by its own init(); got "
        f"{type(state).__name__}.{_tree.restored_hint(state)}"
      )
    if params is None:
      raise ValueError("A Keras optimizer needs the parameters: pass `params`.")
    tree, unscaled = unwrap(grads)
    if not unscaled:
      tree = self.unscale(tree, state.loss_scale)
    _tree.array_leaves(tree)
    _tree.check_grads(tree, params)  # the parameters' tree, each leaf its shape
    nones = _opt_state.none_gradients(tree, params)
    if nones:  # Keras skips such a variable with a warning; its formula needs one
      raise ValueError(
        f"The gradient at {', '.join(nones[:4])} is None: Keras' formulas need "
        "a gradient for every parameter. Give zeros (jnp.zeros_like)."
      )
    _keras_engine.check_real(tree, "gradient")
    # The unscaled gradients decide, as tf_keras checks them: with a scale
    # below 1, what overflows when unscaled is not applied (Keras 3 checks
    # the scaled ones and applies the overflow).
    # In the variables' dtypes, as the formula casts them: a Keras 3
    # gradient kept in float32 that a float16 variable cannot hold is not
    # applied, as before it was kept (tf_keras' check).
    checked = jax.tree.map(_as_variable, tree, params)
    finite = _core.reduce_flag(
      _finite.leaves_finite(jax.tree.leaves(checked)), self.axis_name
    )
    new_state, apply = _core.adjust(state, finite, self.config)
    inner = state.inner_state
    new_params, new_inner = _keras_engine.step(
      self.spec, self.base, tree, inner, params
    )
    kept = _keras_engine.skipped(self.spec, inner)
    new_params = _skip.select_tree(apply, new_params, params)
    new_inner = _skip.select_tree(apply, new_inner, kept)
    return new_params, new_state._replace(inner_state=new_inner)

  def update(self, grads, state, params=None, **extra_args):
    """optax's ``update``: the updates ``new_params - params``, which
    ``optax.apply_updates`` turns into exactly ``new_params`` (for a half
    parameter, the float32 difference of :func:`_rounding.exact_update`:
    one rounded in the parameter's dtype may not land there)."""
    del extra_args
    new_params, new_state = self.step(grads, state, params)
    updates = jax.tree.map(_difference, new_params, params)
    return updates, new_state
