"""Generic optimizer-state helpers: the state of a train state, readable errors.

What every wrapper transformation of the package (the loss scale, the
parameter tools) needs of the states it is given, whatever they hold: the
optax state inside a Flax train state, the type check of a state, the
structure check against what the inner ``init`` makes (read from an
:class:`~optax_lossscale._base.init_memo.InitMemo`), and the error that
names a ``None`` gradient where an inner optimizer failed on one.
"""

from __future__ import annotations

from typing import Any

import jax

from optax_lossscale._base import tree as _tree
from optax_lossscale._base.init_memo import InitMemo, signature

__all__ = [
  "blame_none_gradients",
  "check_inner_state",
  "changed_leaves",
  "check_state_type",
  "none_gradients",
  "optimizer_state",
]


def optimizer_state(obj: Any) -> Any:
  """The optax state held by ``obj``: itself, or its ``opt_state`` attribute.

  Flax's ``TrainState`` and ``nnx.Optimizer`` keep the optax state in an
  ``opt_state`` attribute; the helpers of this package accept them directly.
  """
  if isinstance(obj, (tuple, list, dict)):  # a state (a loss scale's too)
    return obj
  inner = getattr(obj, "opt_state", None)
  return obj if inner is None else inner


def check_state_type(name: str, state: Any, cls: type) -> None:
  """A readable error for a state another transformation made."""
  if not isinstance(state, cls):
    raise ValueError(
      f"{name}: the state is a {type(state).__name__}, not a {cls.__name__}: it "
      f"was made by another transformation. Init it with this {name}."
      f"{_tree.restored_hint(state)}"
    )


def check_inner_state(
  owner: str, memo: InitMemo, inner_state: Any, grads: Any, params: Any
) -> Any:
  """A readable error, at trace time, for a state made by another optimizer.

  ``inner_state`` must have the structure and the array shapes the inner
  ``init`` gives for ``params`` (``grads`` where there are no ``params``),
  as ``memo`` remembers it (``init`` is traced only for parameters no
  ``init`` was seen for). A ``ValueError`` that ``init`` raises on these
  parameters is raised (it names what is wrong with them); an ``init`` that
  needs what cannot be given here is not checked.

  Returns:
    ``inner_state``, with tuples where ``init`` made tuples and the state
    holds lists (a serializer's round trip: :func:`_tree.in_containers`).
  """
  like = params if params is not None else grads
  try:
    made = memo.made(like)
  except ValueError:
    if params is None:
      return inner_state
    raise
  except Exception:  # noqa: BLE001 - init needs what we cannot give: no check
    return inner_state
  inner_state = _tree.in_containers(inner_state, made)
  expected, got = jax.tree.structure(made), jax.tree.structure(inner_state)
  if got == expected:
    what = "parameters" if params is not None else "gradients"
    _check_shapes(owner, inner_state, made, what)
    return inner_state
  nones = [
    _tree.keystr(path)
    for path, g in jax.tree_util.tree_flatten_with_path(
      grads, is_leaf=lambda x: x is None
    )[0]
    if g is None
  ]
  if params is None and nones:
    raise ValueError(
      f"The gradients hold None at {', '.join(nones[:4])}, and the optimizer "
      "state does not fit them: the inner optimizer needs a gradient for "
      "every parameter. Give zeros there, or pass params to update (it then "
      "names the parameter)."
    )
  changed = changed_leaves(memo, like, got)
  if changed:
    raise ValueError(
      f"The parameters given to {owner}'s update are not those its state "
      f"was made for: {'; '.join(changed[:4])}"
      f"{' ...' if len(changed) > 4 else ''}. A dtype that changed between "
      "steps is most often an update applied without casting back: "
      "optax.apply_updates casts each sum to its parameter's dtype, "
      "Equinox's eqx.apply_updates keeps the promoted dtype (master_weights' "
      "updates of half-precision parameters are float32). Cast the "
      "parameters back to their dtypes after applying the updates, or init "
      "a fresh state for the new parameters."
    )
  which = (
    "parameters"
    if params is not None
    else "gradients (or these gradients are not of the parameters' structure)"
  )
  raise ValueError(
    f"The state's inner_state was not made by {owner}'s inner "
    f"optimizer for these {which} (a state saved with another optimizer, "
    "or made for parameters of another structure or dtype?). Restore it "
    "into the optimizer that made it, pass the parameters it was made for, "
    "or init a fresh state with this one.\n"
    f"  state holds:    {_tree.short(got)}\n"
    f"  inner.init has: {_tree.short(expected)}"
  )


def _check_shapes(owner: str, state: Any, made: Any, what: str) -> None:
  """A readable error where ``state`` holds an array of another shape than
  the inner ``init`` makes for these ``what`` (``made``): gradients of
  another shape than the parameters, or a state made for other ones."""
  leaves = jax.tree.leaves(state)
  wrong = [
    i
    for i, (s, m) in enumerate(zip(leaves, jax.tree.leaves(made), strict=True))
    if hasattr(s, "shape") and hasattr(m, "shape") and tuple(s.shape) != tuple(m.shape)
  ]
  if not wrong:
    return
  paths = [_tree.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  found = "; ".join(
    f"{paths[i]} is {list(leaves[i].shape)}, "
    f"init makes {list(jax.tree.leaves(made)[i].shape)}"
    for i in wrong[:4]
  )
  raise ValueError(
    f"{owner}: the optimizer state does not fit these {what}: {found}"
    f"{' ...' if len(wrong) > 4 else ''}. Its inner_state was made for "
    f"{what} of other shapes: pass gradients of the parameters' shapes, the "
    "parameters it was made for, or init a fresh state for these."
  )


def changed_leaves(memo: InitMemo, like: Any, structure: Any) -> list[str]:
  """How ``like`` differs from the parameters an ``init`` of ``memo`` made a
  state of tree ``structure`` for, leaf by leaf: ``"['w'] float16[2, 3] ->
  float32[2, 3]"``. Empty when no ``init`` this process ran made such a
  state for parameters of ``like``'s tree (a restored state: nothing known
  to compare with)."""
  treedef, now = signature(like)
  paths = [
    _tree.keystr(path)
    for path, _ in jax.tree_util.tree_flatten_with_path(
      jax.tree.unflatten(treedef, [0] * treedef.num_leaves)
    )[0]
  ]
  for old_def, before in memo.seen_for(structure):
    if old_def != treedef:
      continue
    changed = [
      f"{path} {_describe(b)} -> {_describe(n)}"
      for path, b, n in zip(paths, before, now, strict=True)
      if b != n
    ]
    if changed:
      return changed
  return []


def _describe(leaf: tuple) -> str:
  """A leaf of a :func:`signature`, as a message writes it."""
  if len(leaf) == 1:
    return leaf[0].__name__
  shape, dtype, spec = leaf
  where = "" if spec is None else f" sharded {spec}"
  return f"{jax.numpy.dtype(dtype).name}{list(shape)}{where}"


def none_gradients(grads: Any, params: Any) -> list[str]:
  """Paths where ``grads`` hold ``None`` for a parameter or a subtree of
  parameters (any ``None`` without ``params``)."""
  is_none = lambda x: x is None  # noqa: E731
  nones = [
    tuple(path)
    for path, g in jax.tree_util.tree_flatten_with_path(grads, is_leaf=is_none)[0]
    if g is None
  ]
  if params is not None:
    present = [
      tuple(path)
      for path, p in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_none)[0]
      if p is not None
    ]
    nones = [n for n in nones if any(p[: len(n)] == n for p in present)]
  return [_tree.keystr(path) for path in nones]


def blame_none_gradients(grads: Any, params: Any, error: Exception) -> None:
  """Re-raises the inner optimizer's ``error`` naming ``None`` gradients, if any.

  optax's ``sgd`` leaves a ``None`` gradient's parameter alone; Adam and most
  stateful optimizers cannot take one, and fail with a message about their
  own state. When the gradients hold ``None`` for a parameter, that is the
  likely cause, and the message says so first.
  """
  nones = none_gradients(grads, params)
  if nones:
    raise ValueError(
      f"The gradient at {', '.join(nones[:4])} is None where there is a "
      "parameter, and the wrapped optimizer failed on it: it needs a gradient "
      "for every parameter. Give zeros (jnp.zeros_like), or keep the parameter "
      f"out of the optimizer (optax.masked, optax.set_to_zero). Its error: {error}"
    ) from None
