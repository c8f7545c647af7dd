"""Loss scaling as optax gradient transformations, and helpers to use them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_lossscale import _core, _jaxpr


class LossScaleState(NamedTuple):
  """State of :func:`dynamic_loss_scale` and :func:`static_loss_scale`.

  The field names are distinctive so that ``optax.tree.get(opt_state,
  'loss_scale')`` finds the scale anywhere in a nested optax state.

  Attributes:
    loss_scale: float32 scalar, the scale the next gradients are computed with.
    good_steps: int32, finite steps in a row since the scale last changed
      (Keras' ``dynamic_counter``).
    hysteresis_left: int32, non-finite steps left before the scale backs off.
    skipped_steps: int32, total skipped steps (saturating).
    consecutive_skips: int32, skipped steps in a row (0 after an applied step).
    inner_state: the state of the wrapped transformation.
  """

  loss_scale: jax.Array
  good_steps: jax.Array
  hysteresis_left: jax.Array
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  inner_state: optax.OptState


def _counters_of(state: LossScaleState) -> _core.Counters:
  return _core.Counters(*state[: len(_core.Counters._fields)])


def _check_grads_match(grads: Any, params: Any) -> None:
  """A readable error, at trace time, when ``grads`` do not fit ``params``."""
  if params is None:
    return
  try:
    jax.tree.map(lambda g, p: None, grads, params, is_leaf=lambda x: x is None)
  except (ValueError, TypeError):
    raise ValueError(
      "The gradient tree does not match the parameter tree.\n"
      f"  grads:  {jax.tree.structure(grads)}\n"
      f"  params: {jax.tree.structure(params)}"
    ) from None

  def check(path, g, p):
    if _core.is_array(g) and _core.is_array(p) and g.shape != p.shape:
      raise ValueError(
        f"Gradient at {jax.tree_util.keystr(path)} has shape {g.shape} but "
        f"the parameter has shape {p.shape}."
      )

  jax.tree_util.tree_map_with_path(check, grads, params, is_leaf=lambda x: x is None)


def _update_on_selected_state(
  inner: optax.GradientTransformationExtraArgs,
  should_apply: jax.Array,
  grads: Any,
  inner_state: Any,
  params: Any,
  extra_args: dict[str, Any],
) -> tuple[Any, Any]:
  """``inner.update``, skipped unless ``should_apply``, at the cost of one pass.

  Returns ``(updates, new_state)`` where ``new_state`` is ``inner``'s new
  state if ``should_apply`` else ``inner_state``, and ``updates`` are
  ``inner``'s updates if ``should_apply`` (garbage otherwise: the caller
  zeroes them).

  The obvious ``select(ok, new_state, old_state)`` after the update is
  correct but costly when buffers are donated: the updates read the
  *unselected* new state (Adam's new moments), so the compiler recomputes it
  from the old state in the kernel that writes the updates, while the kernel
  that writes the selected state overwrites the old state in place; XLA then
  copies the whole old state first (measured in BENCHMARKS.md: 1.6x the
  bytes of plain Adam). Here the update's jaxpr is evaluated with each new
  state leaf replaced, *where it is computed*, by its select against the old
  leaf, so that everything downstream, the updates included, reads the
  selected state: when ``should_apply`` this changes nothing, and when not,
  only the updates change, which the caller discards. Then the kernels have
  plain Adam's shape (state updated in place, parameters reading it) plus
  one scalar predicate.
  """
  leaves, treedef = jax.tree.flatten((grads, inner_state, params, extra_args))
  n_grads = len(jax.tree.leaves(grads))
  n_state = len(jax.tree.leaves(inner_state))
  if not all(_core.is_array(x) for x in leaves):
    # Static extra arguments (e.g. a linesearch's value_fn): select after.
    updates, new_state = inner.update(grads, inner_state, params, **extra_args)
    return updates, _core.select_tree(should_apply, new_state, inner_state)

  def flat_update(*flat):
    g, st, p, extra = jax.tree.unflatten(treedef, flat)
    return inner.update(g, st, p, **extra)

  closed, (updates_shape, state_shape) = jax.make_jaxpr(flat_update, return_shape=True)(
    *leaves
  )
  jaxpr = closed.jaxpr
  old_state = leaves[n_grads : n_grads + n_state]
  n_updates = len(jax.tree.leaves(updates_shape))
  state_outvars = jaxpr.outvars[n_updates:]
  if jax.tree.structure(state_shape) != jax.tree.structure(inner_state):
    raise ValueError(
      "The wrapped transformation returned a state of another structure than "
      "the one it was given."
    )

  # Each equation output that is a new state leaf, with the leaf's index (the
  # first one, should two leaves be the same value).
  first_leaf: dict[Any, int] = {}
  for i, var in enumerate(state_outvars):
    if isinstance(var, _jaxpr.Var) and var not in first_leaf:
      first_leaf[var] = i

  unselected: dict[Any, Any] = {}

  def select_new_state(v, x):
    if v in first_leaf:  # a new state leaf: selected where it is made
      unselected[v] = x
      return _core.select(should_apply, x, old_state[first_leaf[v]])
    return x

  outs = _jaxpr.evaluate(jaxpr, closed.consts, leaves, on_output=select_new_state)
  updates_flat = outs[:n_updates]
  state_flat = []
  for i, (v, x) in enumerate(zip(state_outvars, outs[n_updates:], strict=True)):
    made_here = isinstance(v, _jaxpr.Var) and v in unselected
    if made_here and first_leaf[v] == i:
      state_flat.append(x)  # already selected
    else:  # passed through, a literal, or a repeated value
      raw = unselected[v] if made_here else x
      state_flat.append(_core.select(should_apply, raw, old_state[i]))
  return (
    jax.tree.unflatten(jax.tree.structure(updates_shape), updates_flat),
    jax.tree.unflatten(jax.tree.structure(state_shape), state_flat),
  )


def with_loss_scale(
  inner: optax.GradientTransformation,
  loss_scale: _core.LossScale,
  *,
  axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with the loss scale ``loss_scale`` (any kind).

  :func:`dynamic_loss_scale` and :func:`static_loss_scale` are this function
  with a :class:`DynamicLossScale` or :class:`StaticLossScale`; pass a
  :class:`NoOpLossScale` to keep one code path for float32/bfloat16 runs.

  ``update(grads, state, params)`` takes gradients of the *scaled* loss and:

  1. unscales them with the state's current scale, in float32;
  2. checks that every floating entry is finite (ANDed over ``axis_name``);
  3. feeds the unscaled gradients to ``inner``; on a skipped step the updates
     are zeros of the same dtypes and the inner state is returned unchanged
     (a schedule's step count does not advance);
  4. adjusts the scale and counters.

  The skip is a ``lax.select``, not a ``lax.cond``: no branch and no host
  sync, so it fuses with the inner update.

  Args:
    inner: the transformation to wrap (``optax.chain(...)`` included).
    loss_scale: a :class:`LossScale`; only its configuration is used, every
      ``init`` starts from fresh counters.
    axis_name: the mapped axis (``pmap``/``shard_map``) to AND the finite flag
      over, so that every replica takes the same decision.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaleState`.
  """
  if not (
    callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))
  ):
    raise ValueError(f"`inner` must be an optax GradientTransformation, got {inner!r}.")
  if not isinstance(loss_scale, _core.LossScale):
    raise ValueError(
      "`loss_scale` must be a DynamicLossScale, StaticLossScale or "
      f"NoOpLossScale, got {loss_scale!r}."
    )
  inner = optax.with_extra_args_support(inner)
  config = loss_scale.config

  def init_fn(params):
    return LossScaleState(
      *_core.initial_counters(config), inner_state=inner.init(params)
    )

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, LossScaleState):
      raise ValueError(
        "The loss-scaled optimizer expects the LossScaleState made by its "
        f"own init(); got a state of type {type(state).__name__}. Was this "
        "state produced by another optimizer?"
      )
    _check_grads_match(updates, params)
    scale = loss_scale.replace(_counters_of(state))
    grads, new_scale, should_apply = scale.unscale_and_update(
      updates, axis_name=axis_name
    )
    if config.skip_nonfinite:
      new_updates, new_inner = _update_on_selected_state(
        inner, should_apply, grads, state.inner_state, params, extra_args
      )
      zeros = jax.tree.map(
        lambda u: jnp.zeros_like(u) if _core.is_array(u) else u, new_updates
      )
      new_updates = _core.select_tree(should_apply, new_updates, zeros)
    else:
      new_updates, new_inner = inner.update(
        grads, state.inner_state, params, **extra_args
      )
    return new_updates, LossScaleState(*new_scale.counters, inner_state=new_inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def dynamic_loss_scale(
  inner: optax.GradientTransformation,
  *,
  initial_scale: float = 2.0**15,
  growth_interval: int = 2000,
  growth_factor: float = 2.0,
  backoff_factor: float = 0.5,
  min_scale: float = _core.DEFAULT_MIN_SCALE,
  max_scale: float = _core.DEFAULT_MAX_SCALE,
  hysteresis: int = 1,
  axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Dynamic loss scaling around any optax transformation.

  The scale doubles after ``growth_interval`` finite steps in a row and halves
  on a non-finite step, which is skipped (DESIGN.md §3). With
  ``hysteresis=1`` this is exactly Keras 3 ``LossScaleOptimizer`` and
  ``torch.amp.GradScaler``; with ``hysteresis > 1``, Megatron-LM's
  ``DynamicGradScaler``. The scale is clamped to ``[min_scale, max_scale]``.

  Args:
    inner: the transformation to wrap.
    initial_scale: the starting scale.
    growth_interval: finite steps in a row before the scale grows.
    growth_factor: growth multiplier, > 1.
    backoff_factor: backoff multiplier, in (0, 1).
    min_scale: floor of the scale (positive, normal float32).
    max_scale: ceiling of the scale (finite).
    hysteresis: non-finite steps tolerated before backing off.
    axis_name: mapped axis to AND the finite flag over (pmap/shard_map).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; its ``update`` takes
    gradients of the scaled loss (see :func:`value_and_grad`).

  Raises:
    ValueError: an invalid hyper-parameter (the message names it).

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=8.0)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
    >>> loss, grads = ols.value_and_grad(loss_fn)(state, params)
    >>> grads["w"]  # gradients of 8 * loss
    Array([16., 16.], dtype=float32)
    >>> updates, state = jax.jit(tx.update)(grads, state, params)
    >>> updates["w"]  # sgd on the unscaled gradients
    Array([-0.2, -0.2], dtype=float32)

  References:
    Micikevicius et al., 2018, "Mixed Precision Training",
    https://arxiv.org/abs/1710.03740
  """
  return with_loss_scale(
    inner,
    _core.DynamicLossScale(
      initial_scale,
      growth_interval=growth_interval,
      growth_factor=growth_factor,
      backoff_factor=backoff_factor,
      min_scale=min_scale,
      max_scale=max_scale,
      hysteresis=hysteresis,
    ),
    axis_name=axis_name,
  )


def static_loss_scale(
  inner: optax.GradientTransformation,
  scale: float,
  *,
  skip_nonfinite: bool = True,
  axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """A fixed loss scale around any optax transformation.

  Gradients are unscaled and checked on the same path as
  :func:`dynamic_loss_scale`; the scale never changes.

  Args:
    inner: the transformation to wrap.
    scale: the fixed loss scale (positive, finite).
    skip_nonfinite: skip non-finite steps (default). ``False`` applies every
      step, as TF's ``FixedLossScale`` does.
    axis_name: mapped axis to AND the finite flag over (pmap/shard_map).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaleState`.
  """
  return with_loss_scale(
    inner,
    _core.StaticLossScale(scale, skip_nonfinite=skip_nonfinite),
    axis_name=axis_name,
  )


# --------------------------------------------------------------------------
# Finding the scale in a nested optax state.
# --------------------------------------------------------------------------


def _is_scale_node(x: Any) -> bool:
  return isinstance(x, (LossScaleState, _core.LossScale))


def _optimizer_state(obj: Any) -> Any:
  """The optax state held by ``obj``: itself, or its ``opt_state`` attribute.

  Flax's ``TrainState`` and ``nnx.Optimizer`` keep the optax state in an
  ``opt_state`` attribute; the helpers below accept them directly.
  """
  if _is_scale_node(obj) or isinstance(obj, (tuple, list, dict)):
    return obj
  inner = getattr(obj, "opt_state", None)
  return obj if inner is None else inner


def find_unique(tree: Any, predicate: Callable[[Any], bool], what: str) -> Any:
  """The one node of ``tree`` (searched depth-first) for which ``predicate``.

  Args:
    tree: any pytree (an optax state, nested ``chain``/``MultiSteps``/...).
    predicate: says whether a node is the one looked for; matching nodes are
      not searched further.
    what: a description of the node, for the error messages.

  Raises:
    ValueError: there is no such node, or more than one (with their paths).
  """
  if predicate(tree):
    return tree
  found = [
    (path, node)
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=predicate)[0]
    if predicate(node)
  ]
  if not found:
    raise ValueError(
      f"No {what} in this optimizer state (of type {type(tree).__name__})."
    )
  if len(found) > 1:
    paths = ", ".join(jax.tree_util.keystr(p) or "<root>" for p, _ in found)
    raise ValueError(
      f"Found {len(found)} {what}s in this optimizer state (at {paths}); "
      "expected exactly one."
    )
  return found[0][1]


def find_loss_scale_state(opt_state: Any) -> LossScaleState | _core.LossScale:
  """The one :class:`LossScaleState` (or :class:`LossScale`) in ``opt_state``.

  Searches nested optax states (``chain``, ``MultiSteps``,
  ``inject_hyperparams``, ``masked``, …) and plain containers. Flax's
  ``TrainState`` and ``nnx.Optimizer`` are accepted too (their
  ``opt_state`` is searched); under NNX the fields are ``nnx`` variables.

  Raises:
    ValueError: when there is none, or more than one.
  """
  try:
    return find_unique(_optimizer_state(opt_state), _is_scale_node, "loss-scale state")
  except ValueError as e:
    raise ValueError(
      f"{e} Build the optimizer with optax_lossscale.dynamic_loss_scale(...) "
      "or static_loss_scale(...), and wrap it in one loss scale only."
    ) from None


def _is_variable(x: Any) -> bool:
  """An ``nnx.Variable`` (anything but an array with a ``get_value`` method)."""
  return not _core.is_array(x) and callable(getattr(x, "get_value", None))


def _array(x: Any) -> Any:
  """``x``, or the array an ``nnx`` variable holds."""
  return x.get_value() if _is_variable(x) else x


def unwrap_variables(tree: Any) -> Any:
  """``tree`` with ``nnx`` variables replaced by the arrays they hold."""
  return jax.tree.map(_array, tree, is_leaf=_is_variable)


def _counters(opt_state: Any) -> _core.Counters:
  found = find_loss_scale_state(opt_state)
  fields = found.counters if isinstance(found, _core.LossScale) else _counters_of(found)
  return _core.Counters(*(_array(x) for x in fields))


def get_scale(opt_state: Any) -> jax.Array:
  """The current float32 loss scale, wherever it sits in ``opt_state``.

  Args:
    opt_state: an optimizer state holding exactly one :class:`LossScaleState`
      (at any depth), a :class:`LossScale` object, or an object with an
      ``opt_state`` attribute (Flax ``TrainState``, ``nnx.Optimizer``).

  Returns:
    A float32 scalar array (traced under ``jax.jit``).

  Raises:
    ValueError: no loss-scale state, or more than one.
  """
  return _counters(opt_state).loss_scale


def scale_loss(loss: Any, opt_state: Any) -> jax.Array:
  """``loss * get_scale(opt_state)``, computed in at least float32."""
  return _core.scale_value(loss, get_scale(opt_state))


def value_and_grad(
  fun: Callable[..., Any],
  argnums: int | Sequence[int] = 0,
  has_aux: bool = False,
) -> Callable[..., Any]:
  """``jax.value_and_grad`` of the scaled loss, returning the unscaled loss.

  Args:
    fun: the loss function; returns a scalar (or ``(loss, aux)`` with
      ``has_aux=True``).
    argnums: which positional arguments of ``fun`` to differentiate.
    has_aux: whether ``fun`` returns ``(loss, aux)``.

  Returns:
    A function ``g(opt_state, *args, **kwargs)`` returning ``(value, grads)``
    as ``jax.value_and_grad`` would, where ``value`` is ``fun``'s own output
    (the loss unscaled, in its own dtype, with ``aux``) and ``grads`` are the
    gradients of ``loss * scale``: feed them to the loss-scaled optimizer's
    ``update``, which unscales them. ``opt_state`` is any state that
    :func:`get_scale` accepts.
  """

  def wrapper(opt_state, *args, **kwargs):
    scaled = scaled_loss_fn(fun, get_scale(opt_state), has_aux)
    (_, out), grads = jax.value_and_grad(scaled, argnums, has_aux=True)(*args, **kwargs)
    return out, grads

  return wrapper


def scaled_loss_fn(
  fun: Callable[..., Any], scale: jax.Array, has_aux: bool
) -> Callable[..., Any]:
  """``fun`` returning ``(loss * scale, fun's own output)``, for ``has_aux`` grads.

  The one place where a loss function is scaled: :func:`value_and_grad` and
  the Flax helpers differentiate its first output.
  """

  def scaled(*args, **kwargs):
    out = fun(*args, **kwargs)
    loss = out[0] if has_aux else out
    return _core.scale_value(loss, scale), out

  return scaled


# --------------------------------------------------------------------------
# Diagnostics.
# --------------------------------------------------------------------------


def diagnostics(opt_state: Any) -> dict[str, jax.Array]:
  """The loss-scale counters as device arrays, for logging (jit-friendly).

  Args:
    opt_state: anything :func:`get_scale` accepts.

  Returns:
    A dict of scalar arrays: ``loss_scale`` (float32), ``good_steps``,
    ``hysteresis_left``, ``skipped_steps`` (total), ``consecutive_skips``
    (int32) and ``last_step_skipped`` (bool). Inside ``jax.jit`` these are
    traced values: return them from the step and fetch them when you log, no
    host sync in the step.

  Example:
    >>> import jax.numpy as jnp, optax, optax_lossscale as ols
    >>> tx = ols.dynamic_loss_scale(optax.sgd(0.1), initial_scale=8.0)
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> _, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state)
    >>> d = ols.diagnostics(state)
    >>> float(d["loss_scale"]), int(d["skipped_steps"]), bool(d["last_step_skipped"])
    (4.0, 1, True)
  """
  c = _counters(opt_state)
  return {
    **c._asdict(),
    "last_step_skipped": c.consecutive_skips > 0,
  }


class NonFiniteStepsError(FloatingPointError):
  """Too many skipped steps in a row: see the message for the likely cause."""


def check_skipped_steps(
  opt_state_or_diagnostics: Any,
  *,
  max_consecutive_skips: int = 32,
  min_scale: float = _core.DEFAULT_MIN_SCALE,
) -> None:
  """Host-side: raises once ``max_consecutive_skips`` steps in a row were skipped.

  Call it outside ``jax.jit`` every few steps (it fetches three scalars, a
  host sync): the counters live in the state, so nothing is missed between
  calls. A few skips in a row are normal (the scale backing off after an
  overflow, about ``log2(scale / min_scale)`` of them at most); a run that
  keeps skipping once the scale has reached ``min_scale`` produces NaN or
  ``inf`` by itself, whatever the scale, and no loss scale can fix it.

  Args:
    opt_state_or_diagnostics: anything :func:`get_scale` accepts, or the
      dict :func:`diagnostics` returned (fetched or not).
    max_consecutive_skips: the limit, >= 1.
    min_scale: the floor the loss scale was built with (for the message).

  Raises:
    NonFiniteStepsError: the limit was reached; the message says whether the
      scale is at its floor (the model produces NaN/inf) or still backing off.
    ValueError: a bad argument, or called on traced values inside ``jit``.
  """
  limit = _core._as_int("max_consecutive_skips", max_consecutive_skips)
  if limit < 1:
    raise ValueError(f"`max_consecutive_skips` must be >= 1, got {limit}.")
  d = opt_state_or_diagnostics
  if not (isinstance(d, dict) and "consecutive_skips" in d):
    d = diagnostics(d)
  values = (d["consecutive_skips"], d["loss_scale"], d["skipped_steps"])
  if any(isinstance(v, jax.core.Tracer) for v in values):
    raise ValueError(
      "check_skipped_steps is a host-side check: call it outside jax.jit, on "
      "the state (or diagnostics) the step returned."
    )
  consecutive, scale, total = (np.asarray(v).item() for v in jax.device_get(values))
  if consecutive < limit:
    return
  if scale <= min_scale:
    cause = (
      f"The loss scale is at its floor ({scale:g} <= min_scale={min_scale:g}) "
      "and the gradients are still not finite: the model produces NaN or inf "
      "at every scale (a NaN input or label, log(0), a division by zero, a "
      "learning rate that made the parameters diverge), not a float16 "
      "overflow that a smaller scale would fix."
    )
  else:
    cause = (
      f"The loss scale is {scale:g} and still backing off: the gradients "
      "overflow at every scale tried so far. If this persists down to "
      "min_scale, the model itself produces NaN or inf."
    )
  raise NonFiniteStepsError(
    f"{consecutive} steps in a row were skipped for non-finite gradients "
    f"({total} skipped in total; limit max_consecutive_skips={limit}). {cause}"
  )
