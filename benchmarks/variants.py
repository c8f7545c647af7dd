"""Loss scales built with another finite check or skip than the package's.

The rejected designs that ``bench.py`` measures and the tests compare with
(the skip as a select after the update, as a ``lax.cond``; finiteness from
the global norm) are assembled here from the core's pieces, so that the
package's own builder carries no hook for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

from optax_lossscale._loss_scale import core as _core
from optax_lossscale._loss_scale import skip as _skip


def unscale_and_check(scaled_grads, loss_scale, config, axis_name=None):
  """The package's unscale and check: ``(unscaled grads, finite)``."""
  grads = _core.unscale_tree(scaled_grads, loss_scale)
  return grads, _core.check(scaled_grads, grads, config, axis_name)


def variant(
  inner: optax.GradientTransformation,
  config: Any,
  *,
  check: Callable[..., tuple[Any, jax.Array]] = unscale_and_check,
  skip: Callable[..., tuple[Any, Any]] = _skip.apply_or_skip,
) -> optax.GradientTransformationExtraArgs:
  """A loss scale around ``inner`` whose finite check and skip are given.

  ``check(scaled_grads, loss_scale, config) -> (unscaled grads, finite)``
  and ``skip(inner, should_apply, grads, inner_state, params, extra_args)
  -> (updates, new inner state)``; the scale's rule is the core's
  ``adjust``. No overwrite leaves, record or validation: for measuring.
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return _core.initial_state(config, inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    grads, finite = check(updates, state.loss_scale, config)
    new_state, should_apply = _core.adjust(state, finite, config)
    new_updates, new_inner = skip(
      inner, should_apply, grads, state.inner_state, params, extra_args
    )
    return new_updates, new_state._replace(inner_state=new_inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
