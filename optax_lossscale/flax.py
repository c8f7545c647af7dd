"""Flax integration: a Linen ``TrainState`` with loss scaling, and NNX helpers.

Needs Flax (``pip install optax_lossscale[examples]``); the rest of the
package does not import it.

Linen::

  state = LossScaleTrainState.create(
      apply_fn=model.apply, params=params,
      tx=ols.dynamic_loss_scale(optax.adam(1e-3)))
  loss, grads = state.value_and_grad(loss_fn)(state.params, batch)
  state = state.apply_gradients(grads=grads)   # unscale, check, skip or apply

NNX: ``nnx.Optimizer`` takes any optax transformation, so loss scaling is
``nnx.Optimizer(model, ols.dynamic_loss_scale(tx), wrt=nnx.Param)``; the
helpers of the package accept the optimizer itself (``ols.get_scale(opt)``,
``ols.diagnostics(opt)``) and :func:`nnx_value_and_grad` computes the scaled
gradients.

Flax's float8 layers (``flax.linen.fp8_ops``) keep scales and amax histories
in the collection ``_overwrite_with_gradient``, whose "gradients" are their
new values: give ``LossScaleTrainState.create`` the whole variables dict; in
NNX (Linen float8 layers through ``nnx.bridge.ToNNX``) add
:func:`is_overwrite_variable` to the optimizer's ``wrt`` and update with
:func:`nnx_update`.

The loss-scaled optimizer divides what it is given by the scale: gradients
of the unscaled loss (``nnx.value_and_grad``) reach the inner optimizer
the scale times too small (an SGD step 1/32768 of its size at the default
scale), and nothing in their values says so. :func:`nnx_update` warns
when its gradients are not those :func:`nnx_value_and_grad` returned (it
knows them by identity, when tracing: no host sync); ``optimizer.update``
is Flax's own and cannot tell.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.training import train_state

from optax_lossscale._base import opt_state as _opt_state
from optax_lossscale._base import tree as _tree
from optax_lossscale._loss_scale import grad as _grad
from optax_lossscale._loss_scale import overwrite as _overwrite
from optax_lossscale._loss_scale import search as _search
from optax_lossscale._loss_scale import skip as _skip

__all__ = [
  "LossScaleTrainState",
  "is_overwrite_variable",
  "nnx_update",
  "nnx_value_and_grad",
]


class LossScaleTrainState(train_state.TrainState):
  """A Flax ``TrainState`` whose ``tx`` may hold a loss scale.

  With a loss scale in ``tx`` (``dynamic_loss_scale(...)``),
  ``apply_gradients`` takes gradients of the *scaled* loss (see
  :meth:`value_and_grad`): the optimizer unscales them, skips the step if
  they are not finite, and adjusts the scale. A skipped step changes
  nothing: ``params`` and ``opt_state`` stay, and so do the fields passed to
  ``apply_gradients`` as keyword arguments (``batch_stats=``), which keep
  their old values. ``step`` counts applied steps only, as TensorFlow's
  global step (a skipped step leaves it unchanged); :attr:`all_steps`
  counts every step, skipped ones included, for dropout keys and schedules
  that must move on after a skipped step; :attr:`diagnostics` has the
  skipped ones.

  Without a loss scale (``tx`` a plain optax optimizer, for float32 or
  bfloat16 runs of the same code) it is Flax's ``TrainState``:
  :meth:`value_and_grad` is ``jax.value_and_grad``, ``apply_gradients``
  Flax's, ``loss_scale`` is 1 and no step is skipped.
  """

  @classmethod
  def create(cls, *, apply_fn, params, tx, **kwargs):
    """As ``TrainState.create``; ``tx`` holds one loss scale or none.

    ``tx`` is initialised on the whole of ``params``. With Flax's float8
    layers pass the whole variables dict, ``{'params': ...,
    '_overwrite_with_gradient': ...}`` (as Flax's ``TrainState`` expects): the
    loss scale keeps the float8 scales and amax histories from the inner
    optimizer (it holds no state for them), checks them and
    :meth:`apply_gradients` overwrites them.

    Raises:
      ValueError: ``tx`` holds more than one loss scale, or one inside an
        ``optax.MultiSteps`` while ``params`` hold float8 overwrite leaves.
    """
    opt_state = tx.init(params)
    if _loss_scaled(opt_state):
      _search.find_loss_scale_state(opt_state)  # a clear error if several
      _overwrite.find_overwrite_state(opt_state)  # refuses MultiSteps outside
    # An int32 array from the start: the same pytree (and checkpoint) before
    # and after the first step.
    return cls(
      step=jnp.zeros([], jnp.int32),
      apply_fn=apply_fn,
      params=params,
      tx=tx,
      opt_state=opt_state,
      **kwargs,
    )

  @property
  def has_loss_scale(self) -> bool:
    """Whether ``tx`` holds a loss scale (a Python bool, known when tracing)."""
    return _loss_scaled(self.opt_state)

  def apply_gradients(self, *, grads, value=None, **kwargs):
    """Applies gradients of the scaled loss (unless the step is skipped).

    ``grads`` have the tree of ``params``. Leaves of Flax's
    ``_overwrite_with_gradient`` collection are overwritten with their new
    values (:func:`optax_lossscale.apply_overwrites`), the others updated by
    ``tx``. ``value``, the loss, goes to ``tx.update`` as ``value=`` when
    given (a loss scale built with ``track_nonfinite=True`` records whether
    it was finite). Other keyword arguments replace fields, as in Flax,
    except on a skipped step, where every field keeps its old value (Flax's
    ``DynamicScale`` loops take a skipped step's ``batch_stats``, which its
    non-finite forward pass may have made NaN). Without a loss scale in
    ``tx`` this is Flax's ``TrainState.apply_gradients`` (``value`` given
    goes to ``tx.update``).

    Raises:
      ValueError: a field passed as a keyword argument has another tree
        structure, shape or dtype than its old value (a skipped step could
        not keep it).
    """
    extra = {} if value is None else {"value": value}
    if not self.has_loss_scale:
      if not extra:
        return super().apply_gradients(grads=grads, **kwargs)
      # Flax's apply_gradients, with ``value`` bound into ``tx.update``.
      tx = optax.with_extra_args_support(self.tx)
      bound = optax.GradientTransformation(
        tx.init, lambda u, s, p=None: tx.update(u, s, p, **extra)
      )
      plain = super(LossScaleTrainState, self.replace(tx=bound))
      return plain.apply_gradients(grads=grads, **kwargs).replace(tx=self.tx)
    updates, new_opt_state = self.tx.update(grads, self.opt_state, self.params, **extra)
    new_params = _overwrite.apply_overwrites(
      optax.apply_updates(self.params, updates), new_opt_state
    )
    skipped = _search.diagnostics(new_opt_state)["last_step_skipped"]
    step = jnp.where(skipped, self.step, self.step + 1).astype(jnp.int32)
    kept = _kept_on_skip(self, skipped, kwargs)
    return self.replace(step=step, params=new_params, opt_state=new_opt_state, **kept)

  @property
  def all_steps(self) -> jax.Array:
    """Every ``apply_gradients`` call so far: ``step`` plus the skipped steps.

    For what must move on after a skipped step too (a dropout key folded
    with the step number, which would repeat a mask otherwise; a schedule
    counted in batches seen). ``step`` without a loss scale. The skipped
    steps saturate at the int32 maximum, as the loss scale counts them.
    """
    if not self.has_loss_scale:
      return self.step
    skipped = _search.diagnostics(self.opt_state)["skipped_steps"]
    return (self.step + skipped).astype(jnp.int32)

  @property
  def loss_scale(self) -> jax.Array:
    """The current float32 loss scale (1 without a loss scale in ``tx``)."""
    if not self.has_loss_scale:
      return jnp.ones([], jnp.float32)
    return _search.get_scale(self.opt_state)

  @property
  def diagnostics(self) -> dict[str, jax.Array]:
    """:func:`optax_lossscale.diagnostics` of the optimizer state.

    Raises:
      ValueError: ``tx`` holds no loss scale (there is nothing to report).
    """
    return _search.diagnostics(self.opt_state)

  def value_and_grad(
    self, loss_fn: Callable[..., Any], *, has_aux: bool = False
  ) -> Callable[..., Any]:
    """``jax.value_and_grad(loss_fn)`` of the loss scaled by this state's scale.

    Returns ``g(params, *args, **kwargs) -> (loss_fn's output, scaled grads)``;
    pass the grads to :meth:`apply_gradients`. Without a loss scale in ``tx``
    it is ``jax.value_and_grad(loss_fn, has_aux=has_aux)``: nothing is
    multiplied.
    """
    if not self.has_loss_scale:
      return jax.value_and_grad(loss_fn, has_aux=has_aux)
    scaled = _grad.value_and_grad(loss_fn, argnums=0, has_aux=has_aux)
    return lambda *args, **kwargs: scaled(self.opt_state, *args, **kwargs)


def _loss_scaled(opt_state: Any) -> bool:
  """Whether ``opt_state`` holds a loss-scale state (at any depth); a
  ValueError where it is dicts and lists (a checkpoint restored without a
  target, read as "no loss scale", would give unscaled numbers)."""
  if _tree.find_all(opt_state, _search.is_loss_scale_state):
    return True
  hint = _tree.restored_hint(opt_state)
  if hint:
    raise ValueError(f"LossScaleTrainState: opt_state holds no optimizer state.{hint}")
  return False


def _shapes(tree: Any) -> Any:
  """``tree`` with each leaf as its dtype and shape, for messages."""
  return jax.tree.map(lambda a: f"{jnp.result_type(a)}{list(jnp.shape(a))}", tree)


def _kept_on_skip(state: Any, skipped: jax.Array, fields: dict[str, Any]) -> dict:
  """``fields`` (new values of ``state``'s fields), their old values where skipped.

  Fields that are not pytree nodes (``apply_fn``, ``tx``) are static and
  replaced as given.
  """
  nodes = {
    f.name for f in dataclasses.fields(state) if f.metadata.get("pytree_node", True)
  }
  kept = {}
  for name, new in fields.items():
    if name not in nodes:
      kept[name] = new
      continue
    old = getattr(state, name)
    same = jax.tree.structure(new) == jax.tree.structure(old) and all(
      jnp.shape(a) == jnp.shape(b) and jnp.result_type(a) == jnp.result_type(b)
      for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True)
    )
    if not same:
      raise ValueError(
        f"apply_gradients({name}=...): a skipped step keeps {name}'s old value, "
        "so the new one must have its tree structure, shapes and dtypes; got "
        f"{_tree.short(_shapes(new))} for {_tree.short(_shapes(old))}."
      )
    if not isinstance(skipped, jax.core.Tracer) and bool(skipped):
      kept[name] = (
        old  # an eager skipped step: a Python number kept too, as jit keeps it
      )
    else:
      kept[name] = _skip.select_tree(jnp.logical_not(skipped), new, old)
  return kept


# The gradient arrays (or tracers) that nnx_value_and_grad returned for a
# loss scale, by id, held weakly: an entry goes when its array does, and the
# ``is`` check in _came_scaled ignores an id that a new object reuses.
_SCALED_LEAVES: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def _mark_scaled(grads: Any) -> Any:
  """``grads``, its leaves noted as gradients of the scaled loss."""
  for leaf in jax.tree.leaves(grads):
    try:
      _SCALED_LEAVES[id(leaf)] = leaf
    except TypeError:  # not weakly referable: left unmarked
      pass
  return grads


def _came_scaled(grads: Any) -> bool:
  """Whether a leaf of ``grads`` is one that :func:`_mark_scaled` noted."""
  return any(_SCALED_LEAVES.get(id(leaf)) is leaf for leaf in jax.tree.leaves(grads))


def nnx_value_and_grad(
  fun: Callable[..., Any],
  *,
  argnums: int | nnx.DiffState = 0,
  has_aux: bool = False,
) -> Callable[..., Any]:
  """``nnx.value_and_grad`` of ``fun``'s loss scaled by an optimizer's scale.

  Args:
    fun: the loss function of an ``nnx.Module`` (and more arguments).
    argnums: which argument is the module, as in ``nnx.value_and_grad``. An
      integer differentiates with respect to the optimizer's ``wrt``
      variables (``nnx.DiffState(argnums, optimizer.wrt)``), so that the
      gradients are those ``optimizer.update`` takes; an ``nnx.DiffState``
      is used as it is.
    has_aux: whether ``fun`` returns ``(loss, aux)``.

  Returns:
    ``g(optimizer, *args, **kwargs) -> (fun's output, scaled grads)`` where
    ``optimizer`` is the ``nnx.Optimizer`` whose ``tx`` holds the loss scale
    (one whose ``tx`` holds none gives ``nnx.value_and_grad``'s unscaled
    gradients, so that float32 runs use the same code); pass the grads to
    :func:`nnx_update` (or ``optimizer.update(model, grads)``). The
    gradient arrays of a loss-scaled optimizer are noted, by identity, as
    gradients of the scaled loss: :func:`nnx_update` checks that it gets
    them. Arrays made from them (``jax.tree.map`` over the gradients) and
    the outputs of an ``nnx.jit`` that returns them are new arrays, not
    noted: pass ``assume_scaled=True`` to :func:`nnx_update` for those.
  """

  def wrapper(optimizer, *args, **kwargs):
    wrt = getattr(optimizer, "wrt", None)
    diff = argnums
    if isinstance(argnums, int) and wrt is not None:
      diff = nnx.DiffState(argnums, wrt)
    if isinstance(optimizer, nnx.Optimizer) and not _loss_scaled(optimizer.opt_state):
      return nnx.value_and_grad(fun, argnums=diff, has_aux=has_aux)(*args, **kwargs)
    scale = _grad.scale_for(optimizer, "nnx_value_and_grad(fun)")
    scaled = _grad.scaled_loss_fn(fun, scale, has_aux)
    (_, out), grads = nnx.value_and_grad(scaled, argnums=diff, has_aux=True)(
      *args, **kwargs
    )
    return out, _mark_scaled(grads)

  return wrapper


def is_overwrite_variable(path: Any, value: Any) -> bool:
  """An NNX filter: the variables of Flax's ``_overwrite_with_gradient`` collection.

  ``nnx.bridge.ToNNX`` makes a Linen float8 layer's scales and amax
  histories variables of a type of that name. Use it in the optimizer's
  ``wrt``: ``nnx.Optimizer(model, tx, wrt=nnx.Any(nnx.Param,
  is_overwrite_variable))``.
  """
  del path
  return _overwrite.is_overwrite_variable(value)


def nnx_update(
  optimizer: nnx.Optimizer,
  model: nnx.Module,
  grads: Any,
  /,
  *,
  before: nnx.State | None = None,
  assume_scaled: bool = False,
  **kwargs,
):
  """``optimizer.update(model, grads)``; on a skipped step, ``before`` written back.

  ``grads`` are the gradients of the *scaled* loss, which the loss scale
  divides by the scale. Gradients of the unscaled loss (``nnx.value_and_grad``,
  ``nnx.grad``) would reach the inner optimizer the scale times too small
  (an SGD step 1/32768 of its size at the default scale), silently: their
  values cannot tell. So, when
  the optimizer holds a loss scale, gradients that :func:`nnx_value_and_grad`
  did not return are used as given with a ``UserWarning``, at trace time
  (their identity is checked, not their values: nothing is synced under
  ``jax.jit``). Gradients of the scaled loss made otherwise (transformed
  after :func:`nnx_value_and_grad`, or returned by another ``nnx.jit``)
  go in with ``assume_scaled=True``, which silences it.

  A skipped step changes nothing: the loss scale keeps the parameters and
  the optimizer's state, and ``before``, the values of model variables
  taken before the step's forward pass
  (``nnx.as_pure(nnx.state(model, nnx.BatchStat))``), are written back
  into ``model``, so that a non-finite forward pass leaves no NaN running
  statistics behind (Flax's ``DynamicScale`` loops keep them). After an
  applied step the variables keep the values the forward pass wrote. An
  ``Rngs`` stream (``nnx.Dropout``'s) left out of ``before`` keeps the count
  the skipped forward pass advanced, so the next step draws new dropout
  masks; with its count in ``before``
  (``nnx.as_pure(nnx.state(model, nnx.RngCount))``) the next step draws
  the skipped step's masks again.

  ``nnx.Optimizer.update`` adds the loss scale's updates to the variables
  its ``wrt`` selects: zeros for Flax's float8 overwrite variables. This
  then writes their new values into ``model``
  (:func:`optax_lossscale.apply_overwrites`): after an applied optimizer
  step only, so a skipped step keeps the old ones. Without overwrite
  variables and ``before`` it is ``optimizer.update``.

  Args:
    optimizer: an ``nnx.Optimizer``; without a loss scale in its ``tx`` no
      step is skipped and ``before`` is not used.
    model: the module it updates.
    grads: the gradients, from :func:`nnx_value_and_grad`.
    before: an ``nnx.State`` of values of ``model``'s variables taken before
      the step (``nnx.as_pure(nnx.state(model, nnx.BatchStat))``), or
      ``None``.
    assume_scaled: take ``grads`` as gradients of the scaled loss without
      checking that :func:`nnx_value_and_grad` returned them.
    **kwargs: more arguments of ``optimizer.update`` (``value=``).

  Returns:
    The updates, as ``optimizer.update`` returns them.

  Raises:
    ValueError: a path of ``before`` is not a variable of ``model``, or
      ``before`` holds the model's own variables rather than their values
      (they have been written by the step: nothing would be kept); or
      ``grads`` are gradients of a scaled loss from :func:`nnx_value_and_grad`
      and the optimizer holds no loss scale (nothing would divide them).

  Warns:
    UserWarning: the optimizer holds a loss scale and ``grads`` are not
      those :func:`nnx_value_and_grad` returned (unless ``assume_scaled``).
  """
  _check_scaled(optimizer, grads, assume_scaled)
  updates = optimizer.update(model, grads, **kwargs)
  if _overwrite.find_overwrite_state(optimizer) is not None:
    graph = {"graph": optimizer.graph} if hasattr(optimizer, "graph") else {}
    params = nnx.as_pure(nnx.state(model, optimizer.wrt, **graph))
    nnx.update(model, _overwrite.apply_overwrites(params, optimizer))
  if before is not None and _loss_scaled(_opt_state.optimizer_state(optimizer)):
    now = dict(nnx.to_flat_state(nnx.state(model)))
    old = list(nnx.to_flat_state(before))
    missing = [path for path, _ in old if path not in now]
    if missing:
      raise ValueError(
        f"nnx_update(before=...): {missing[:3]} are not variables of the model; "
        "pass nnx.as_pure(nnx.state(model, filter)) taken before the step."
      )
    live = [path for path, value in old if value is now[path]]
    if live:
      raise ValueError(
        f"nnx_update(before=...): {live[:3]} are the model's own variables, "
        "which the step has written: pass a copy of their values taken before "
        "the step, nnx.as_pure(nnx.state(model, nnx.BatchStat))."
      )
    applied = jnp.logical_not(_search.diagnostics(optimizer)["last_step_skipped"])
    kept = [
      (path, _skip.select(applied, _tree.unwrap(now[path]), _tree.unwrap(value)))
      for path, value in old
    ]
    nnx.update(model, nnx.from_flat_state(kept))
  return updates


def _check_scaled(optimizer: Any, grads: Any, assume_scaled: bool) -> None:
  """:func:`nnx_update`'s check that ``grads`` are of the loss ``optimizer`` scales."""
  scaled_optimizer = _loss_scaled(_opt_state.optimizer_state(optimizer))
  came_scaled = _came_scaled(grads)
  if came_scaled and not scaled_optimizer:
    raise ValueError(
      "nnx_update() got the gradients of a scaled loss from nnx_value_and_grad(), "
      "for an optimizer that holds no loss scale: nothing would divide them, and "
      "the step would be the scale times too large. Compute them with this "
      "optimizer: nnx_value_and_grad(fun)(optimizer, model, ...)."
    )
  if (
    scaled_optimizer
    and not came_scaled
    and not assume_scaled
    and jax.tree.leaves(grads)
  ):
    warnings.warn(
      "nnx_update() got gradients that nnx_value_and_grad() did not return, for an "
      "optimizer that holds a loss scale, which divides them by the scale. If they "
      "are gradients of the unscaled loss (nnx.value_and_grad, nnx.grad), the inner "
      "optimizer gets them the scale times too small (an SGD step 1/32768 of its "
      "size at the default scale): write "
      "loss, grads = nnx_value_and_grad(fun)(optimizer, model, ...). Gradients of "
      "the scaled loss made otherwise (transformed after nnx_value_and_grad, or "
      "returned by another nnx.jit): pass assume_scaled=True.",
      UserWarning,
      stacklevel=3,
    )
