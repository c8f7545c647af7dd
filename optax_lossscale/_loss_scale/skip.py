"""The skip: an inner update applied or skipped on a flag, at the cost of one pass.

:func:`apply_or_skip` is what the loss-scale transformations call. It returns
the inner transformation's updates and new state when the flag is true, and
zero updates with the old state when it is false, with no branch and no host
sync.

The obvious form, :func:`select_after` (``select(ok, new_state, old_state)``
after the update), is correct but costly when buffers are donated: the
updates read the *unselected* new state (Adam's new moments), so XLA
recomputes it in the kernel that writes the updates while the kernel that
writes the selected state overwrites the old state in place, and it copies
the whole old state first (BENCHMARKS.md measures it). Instead,
:func:`apply_or_skip` evaluates the update's jaxpr with each new state leaf
replaced, *where it is computed*, by its select against the old leaf, so
everything downstream, the updates included, reads the selected state. When
the flag is true nothing changes; when false only the updates change, and
they are replaced by zeros. The kernels then have the inner update's own
shape (state updated in place, updates reading it) plus one scalar predicate.

The rewrite follows new state leaves into ``jax.jit``-ed and other plain
calls (a jitted inner update keeps the saving; the call's ``in_shardings``
and ``out_shardings`` become sharding constraints, or under explicit
sharding the types the call gives); non-array arguments (a
line search's ``value_fn``) are closed over as constants, and each state
leaf is selected as :func:`select_leaf` selects it (a Python number the
update returns for a Python number is taken from the new state). If the update
cannot be traced to a jaxpr and evaluated again, the skip falls back to
:func:`select_after` and says so with a :class:`SkipFallbackWarning`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_lossscale._base import jaxpr as _jaxpr
from optax_lossscale._base import tree as _tree

__all__ = [
  "SkipFallbackWarning",
  "StateDtypesChanged",
  "apply_or_skip",
  "dtypes_changed",
  "select",
  "select_after",
  "select_leaf",
  "select_tree",
  "update_on_selected_state",
]


def select(pred: jax.Array, on_true: Any, on_false: Any) -> jax.Array:
  """``lax.select`` of one array, ``on_false`` taken in ``on_true``'s dtype
  and, under explicit sharding, in its sharding (a state made by ``init`` or
  restored with another layout than the update's may differ). Weakly typed
  when both are (a weakly typed state leaf stays so, and a jitted update is
  not traced again for the next step's state)."""
  on_true, on_false = jnp.asarray(on_true), jnp.asarray(on_false)
  if on_false.dtype != on_true.dtype:
    on_false = on_false.astype(on_true.dtype)
  if _tree.explicit_spec(on_true) != _tree.explicit_spec(on_false):
    on_false = jax.sharding.reshard(on_false, jax.typeof(on_true).sharding.spec)
  return lax.select(pred, on_true, on_false)


def select_leaf(pred: jax.Array, new: Any, old: Any) -> Any:
  """One state leaf: ``new`` where ``pred`` else ``old``.

  Selected with ``lax.select`` (no host sync, no branch) when either is an
  array: in ``new``'s dtype, or in ``old``'s when ``new`` is a Python
  number, so that a skipped step keeps ``old`` whichever of the two an
  update made an array. Two leaves that are not arrays (Python numbers,
  strings) are static: ``new`` is taken, as it is where ``old`` is
  neither an array nor a number. float0 arrays are ``new``.
  """
  number = isinstance(old, (bool, int, float, complex))
  if _tree.is_array(new):
    if new.dtype == jax.dtypes.float0 or not (number or _tree.is_array(old)):
      return new  # nothing to select against (a string made an array)
    return select(pred, new, old)
  if _tree.is_array(old) and old.dtype != jax.dtypes.float0:
    return select(pred, jnp.asarray(new, old.dtype), old)
  return new


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
  """``on_true`` where ``pred`` else ``on_false``, leaf by leaf
  (:func:`select_leaf`). Shapes must match."""
  return jax.tree.map(lambda a, b: select_leaf(pred, a, b), on_true, on_false)


class SkipFallbackWarning(UserWarning):
  """The skip could not be placed inside the inner update (see the message)."""


class StateDtypesChanged(Exception):  # noqa: N818 - a signal, caught by the caller
  """The inner update returned a state whose array leaves changed dtype or
  shape, where the caller asked that they be kept (``keep_dtypes``)."""


def dtypes_changed(old_state: Any, new_state: Any) -> bool:
  """Whether an array leaf of ``new_state`` has another dtype or shape than
  ``old_state``'s (abstract values compare alike), or the leaf counts differ."""
  old, new = jax.tree.leaves(old_state), jax.tree.leaves(new_state)
  return len(old) != len(new) or any(
    _tree.is_array(a) and (a.dtype, a.shape) != (jnp.result_type(b), jnp.shape(b))
    for a, b in zip(old, new, strict=True)
  )


def _zeros_where_skipped(should_apply: jax.Array, updates: Any) -> Any:
  zeros = jax.tree.map(lambda u: jnp.zeros_like(u) if _tree.is_array(u) else u, updates)
  return select_tree(should_apply, updates, zeros)


def select_after(
  inner: Any,
  should_apply: jax.Array,
  grads: Any,
  inner_state: Any,
  params: Any,
  extra_args: dict[str, Any],
  keep_dtypes: bool = False,
) -> tuple[Any, Any]:
  """The skip as a select after the inner update (correct, but see above).

  Returns:
    ``(updates, new_state)``: ``inner``'s updates and new state if
    ``should_apply``, else zero updates and ``inner_state``.

  Raises:
    StateDtypesChanged: ``keep_dtypes``, and the new state's dtypes differ.
  """
  updates, new_state = inner.update(grads, inner_state, params, **extra_args)
  if keep_dtypes and dtypes_changed(inner_state, new_state):
    raise StateDtypesChanged
  return (
    _zeros_where_skipped(should_apply, updates),
    select_tree(should_apply, new_state, inner_state),
  )


def apply_or_skip(
  inner: Any,
  should_apply: jax.Array,
  grads: Any,
  inner_state: Any,
  params: Any,
  extra_args: dict[str, Any],
  keep_dtypes: bool = False,
  stacklevel: int = 3,
) -> tuple[Any, Any]:
  """``inner.update`` if ``should_apply``, else zero updates and the old state.

  The same results as :func:`select_after`, computed with the selects placed
  where the new state is made (see the module's docstring). The inner update
  is traced once.

  Args:
    inner: an ``optax.GradientTransformationExtraArgs``.
    should_apply: a scalar boolean array.
    grads, inner_state, params, extra_args: ``inner.update``'s arguments.
    keep_dtypes: the new state must have the old one's dtypes and shapes.
    stacklevel: the fallback warning's, pointing at the caller's caller's
      code by default (the code that called a transformation's update).

  Returns:
    ``(updates, new_state)``.

  Raises:
    ValueError: ``inner`` returned a state of another structure.
    StateDtypesChanged: ``keep_dtypes``, and the new state's dtypes differ
      (known from the trace: nothing is evaluated).
  """
  try:
    updates, new_state = update_on_selected_state(
      inner, should_apply, grads, inner_state, params, extra_args, keep_dtypes
    )
  except _StructureError as e:
    raise ValueError(str(e)) from None
  except StateDtypesChanged:
    raise
  except Exception as e:  # noqa: BLE001 - reported, and retried the plain way
    out = select_after(
      inner, should_apply, grads, inner_state, params, extra_args, keep_dtypes
    )
    warnings.warn(
      "The loss scale could not place its skip inside the inner update "
      f"({type(e).__name__}: {e}); it selects the state after the update "
      "instead. The results are the same, but when buffers are donated XLA "
      "may copy the optimizer state on every step.",
      SkipFallbackWarning,
      stacklevel=stacklevel,
    )
    return out
  return _zeros_where_skipped(should_apply, updates), new_state


class _StructureError(Exception):
  pass


def update_on_selected_state(
  inner: Any,
  should_apply: jax.Array,
  grads: Any,
  inner_state: Any,
  params: Any,
  extra_args: dict[str, Any],
  keep_dtypes: bool = False,
) -> tuple[Any, Any]:
  """``inner.update`` with each new state leaf selected where it is made.

  Returns:
    ``(updates, new_state)`` where ``new_state`` is ``inner``'s new state if
    ``should_apply`` else ``inner_state``, and ``updates`` are ``inner``'s
    updates if ``should_apply`` (garbage otherwise: the caller zeroes them).
  """
  leaves, treedef = jax.tree.flatten((grads, inner_state, params, extra_args))
  traced = [i for i, x in enumerate(leaves) if _tree.is_array(x)]
  returned: list[Any] = []

  def flat_update(*arrays):
    full = list(leaves)
    for i, x in zip(traced, arrays, strict=True):
      full[i] = x
    g, st, p, extra = jax.tree.unflatten(treedef, full)
    updates, new_state = inner.update(g, st, p, **extra)
    returned[:] = jax.tree.leaves(new_state)  # Python numbers stay as they are
    return updates, new_state

  arrays = [leaves[i] for i in traced]
  closed, (updates_shape, state_shape) = jax.make_jaxpr(flat_update, return_shape=True)(
    *arrays
  )
  if jax.tree.structure(state_shape) != jax.tree.structure(inner_state):
    raise _StructureError(
      "The wrapped transformation returned a state of another structure than "
      "the one it was given."
    )
  if keep_dtypes and dtypes_changed(inner_state, state_shape):
    raise StateDtypesChanged
  old_state = jax.tree.leaves(inner_state)
  n_updates = len(jax.tree.leaves(updates_shape))
  state_outvars = closed.jaxpr.outvars[n_updates:]

  # The old value each new state leaf is selected against, keyed by the
  # variable that holds it: the first array leaf's, should several leaves be
  # that variable, and that leaf (its owner) takes the value selected where
  # it is made; the others are selected against their own old values.
  olds: dict[Any, Any] = {}
  owner: dict[Any, int] = {}
  for i, v in enumerate(state_outvars):
    if isinstance(v, _jaxpr.Var) and v not in olds and _tree.is_array(old_state[i]):
      olds[v], owner[v] = old_state[i], i
  outs, selected = _evaluate_selecting(
    closed.jaxpr, closed.consts, arrays, should_apply, olds
  )

  state_flat = []
  for i, (v, x) in enumerate(zip(state_outvars, outs[n_updates:], strict=True)):
    if isinstance(v, _jaxpr.Var) and v in selected and owner[v] == i:
      state_flat.append(x)  # selected where it was made, against its own old value
    else:  # a literal, another leaf's variable (x is new where `should_apply`)
      # or a Python number
      new = x if _tree.is_array(returned[i]) else returned[i]  # as returned
      state_flat.append(select_leaf(should_apply, new, old_state[i]))
  return (
    jax.tree.unflatten(jax.tree.structure(updates_shape), outs[:n_updates]),
    jax.tree.unflatten(jax.tree.structure(state_shape), state_flat),
  )


def _constrain(values: list, shardings: Any, avals: list) -> list:
  """``values`` with the shardings a ``jax.jit`` call gave them (where any).

  Evaluating a call's body in its place must keep what the call asked for:
  ``in_shardings``/``out_shardings`` become sharding constraints. Where the
  mesh's axes are explicit, a constraint only asserts: a value is resharded
  to the type the call's equation gives it (``avals``) where it differs.
  """
  if shardings is None:
    return list(values)
  return [
    _constrain_one(x, s, aval) if isinstance(s, jax.sharding.Sharding) else x
    for x, s, aval in zip(values, shardings, avals, strict=True)
  ]


def _constrain_one(x: Any, sharding: Any, aval: Any) -> Any:
  explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
  mesh = getattr(sharding, "mesh", None)
  if explicit is None or explicit not in getattr(mesh, "axis_types", ()):
    return lax.with_sharding_constraint(x, sharding)
  want = aval.sharding.spec
  return x if jax.typeof(x).sharding.spec == want else jax.sharding.reshard(x, want)


def _evaluate_selecting(
  jaxpr: Any, consts: Any, args: Any, pred: Any, olds: dict[Any, Any]
) -> tuple[list, set[Any]]:
  """Evaluates ``jaxpr``, each variable ``v`` of ``olds``, where it is
  computed, replaced by ``select(pred, v, olds[v])``.

  A call equation (``jax.jit`` and the like) whose outputs are to be
  selected is evaluated by its body, with the selects moved onto the body's
  variables, so that what the body computes from them reads them selected.
  That body is evaluated in a ``jax.jit`` of its own, made once for each
  body and selected outputs (:func:`_selecting_body`): a body called for
  many leaves (one jitted function per leaf shape) is evaluated, traced and
  lowered once, not once per call.

  Returns:
    The outputs, and the variables of ``olds`` that were selected.
  """
  applied: set[Any] = set()

  def eval_eqn(eqn, invals):
    body = _jaxpr.call_body(eqn)
    if (
      body is None
      or not any(v in olds for v in eqn.outvars)
      or any(x is not None for x in eqn.params.get("in_layouts", ()))
      or any(x is not None for x in eqn.params.get("out_layouts", ()))
    ):
      return _jaxpr.bind(eqn, invals)
    sub_jaxpr, _ = body
    made_inside = {v for e in sub_jaxpr.eqns for v in e.outvars}
    positions, sub_olds, moved, claimed = [], [], [], set()
    outvars = zip(eqn.outvars, sub_jaxpr.outvars, strict=True)
    for k, (outer, inner) in enumerate(outvars):
      if (
        outer in olds
        and isinstance(inner, _jaxpr.Var)
        and inner in made_inside
        and inner not in claimed
      ):
        claimed.add(inner)
        positions.append(k)
        sub_olds.append(olds[outer])
        moved.append(outer)
    if not positions:
      return _jaxpr.bind(eqn, invals)
    params = eqn.params
    in_avals = [v.aval for v in eqn.invars]
    invals = _constrain(invals, params.get("in_shardings"), in_avals)
    run = _selecting_body(_jaxpr.call_key(eqn), tuple(positions))
    outs = run(pred, sub_olds, *invals)
    applied.update(moved)
    out_avals = [v.aval for v in eqn.outvars]
    return _constrain(outs, params.get("out_shardings"), out_avals)

  def on_output(v, x):
    if v in olds and v not in applied:
      applied.add(v)
      return select(pred, x, olds[v])
    return x

  outs = _jaxpr.evaluate(jaxpr, consts, args, eval_eqn, on_output)
  return outs, applied


#: ``{(id of a call's body, selected positions): (the body, its jitted
#: evaluation)}``: the body is held so that its id stays its own.
_BODIES: dict[tuple[int, tuple[int, ...]], tuple[Any, Callable[..., list]]] = {}
_MAX_BODIES = 1024


def _selecting_body(body: Any, positions: tuple[int, ...]) -> Callable[..., list]:
  """``run(pred, olds, *args)``: a call's ``body`` (a closed or open jaxpr)
  evaluated on ``args`` with its outputs at ``positions`` selected against
  ``olds`` where they are computed, as one ``jax.jit``: made once for each
  body and positions, so that JAX traces and lowers it once, however many
  calls share the body."""
  key = (id(body), positions)
  hit = _BODIES.get(key)
  if hit is not None and hit[0] is body:
    return hit[1]
  jaxpr, consts = _jaxpr.closed(body)

  @jax.jit
  def run(pred, olds, *args):
    chosen = dict(zip((jaxpr.outvars[k] for k in positions), olds, strict=True))
    return _evaluate_selecting(jaxpr, consts, args, pred, chosen)[0]

  if len(_BODIES) >= _MAX_BODIES:
    _BODIES.clear()
  _BODIES[key] = (body, run)
  return run
