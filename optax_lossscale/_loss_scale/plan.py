"""The per-leaf plan of a loss-scaled update, read from the state's structure.

What a loss scale does with each gradient leaf is decided by the optimizer
state it is given, from its structure alone (no value is read, nothing is
traced): a Flax float8 overwrite leaf (a new value, never unscaled, kept
from the inner optimizer), a leaf handed over unscaled in float32 (a
``master_weights`` state keeps a float32 master of it), or a leaf handed
over in its own dtype; and which optimizer-state leaves of each parameter
are stored block-quantised. :func:`loss_scale_plan` makes the plan; the
loss scale's ``update`` reads the same plan, so what a user prints is what
the step does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from optax_lossscale._base import opt_state as _opt_state
from optax_lossscale._base import state_roles as _roles
from optax_lossscale._base import tree as _tree
from optax_lossscale._loss_scale import half_state as _half_state
from optax_lossscale._loss_scale import overwrite as _overwrite
from optax_lossscale._loss_scale import search as _search

__all__ = [
  "LeafPlan",
  "LossScalePlan",
  "float32_gradient_leaves",
  "loss_scale_plan",
  "plan_of",
]

#: How a gradient leaf reaches the inner optimizer.
FLOAT32, OWN_DTYPE, OVERWRITTEN = "float32", "own dtype", "overwritten"
#: A leaf with a float32 master whose gradients a half-precision state before
#: ``master_weights`` in a chain also holds: handed over in its own dtype.
HALF_STATE_FIRST = "own dtype (half-precision state first)"


@dataclasses.dataclass(frozen=True)
class LeafPlan:
  """What a loss scale does with one gradient leaf.

  Attributes:
    path: the leaf's key path, as ``jax.tree_util.keystr`` writes it.
    dtype: the gradient's dtype, as ``update`` receives it.
    handed_over: ``"float32"`` (unscaled in float32: a float32 master of the
      parameter is kept), ``"own dtype"`` (unscaled in its dtype),
      ``"own dtype (half-precision state first)"`` (a float32 master is kept,
      but a transformation before ``master_weights`` holds this leaf's
      gradients in half precision, ``optax.trace`` in a chain before it, say:
      unscaled in its dtype, so that state keeps its dtype; ``update`` warns)
      or ``"overwritten"`` (a Flax float8 scale or amax history: the new
      value, never unscaled and never seen by the inner optimizer).
    quantized_state: the optimizer-state leaves of this parameter stored
      block-quantised, each as ``"<path> (<dtype>, blocks of <n>)"``, the
      path in the loss scale's ``inner_state``.
  """

  path: str
  dtype: str
  handed_over: str
  quantized_state: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class LossScalePlan:
  """A loss scale's plan for one gradient tree: one :class:`LeafPlan` a leaf.

  ``print(plan)`` shows it as a table. ``float32`` and ``overwrite`` are the
  trees of bools the update uses (``None`` where no leaf is marked).
  """

  leaves: tuple[LeafPlan, ...]
  float32: Any = dataclasses.field(repr=False, compare=False)
  overwrite: Any = dataclasses.field(repr=False, compare=False)

  def __str__(self) -> str:
    rows = [("leaf", "dtype", "handed over", "quantised state")]
    rows += [
      (x.path, x.dtype, x.handed_over, ", ".join(x.quantized_state) or "-")
      for x in self.leaves
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
      "  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3]
      for r in rows
    ).rstrip()


def plan_of(inner_state: Any, grads: Any) -> LossScalePlan:
  """The plan for ``grads`` under a loss scale whose inner state is
  ``inner_state`` (what ``update`` calls; see :func:`loss_scale_plan`).

  Raises:
    ValueError: ``grads`` hold Flax overwrite leaves the state was made
      without.
  """
  overwrite = _overwrite.state_mask(inner_state, grads)
  regular = inner_state if overwrite is None else inner_state.inner_state
  kept, held_back = _kept_masters(regular, grads)
  float32 = _float32_marks(grads, kept, held_back)
  flat, treedef = jax.tree_util.tree_flatten_with_path(grads)
  marks_32 = _marks(float32, treedef)
  marks_ow = _marks(overwrite, treedef)
  quantized = _quantized_by_owner(regular, [p for p, _ in flat])
  leaves = []
  for (path, g), f32, ow in zip(flat, marks_32, marks_ow, strict=True):
    key = _tree.keystr(path)
    how = OVERWRITTEN if ow else FLOAT32 if f32 else OWN_DTYPE
    if how == OWN_DTYPE and key in held_back:
      how = HALF_STATE_FIRST
    dtype = str(g.dtype) if hasattr(g, "dtype") else type(g).__name__
    leaves.append(LeafPlan(key, dtype, how, tuple(quantized.get(key, ()))))
  return LossScalePlan(tuple(leaves), float32, overwrite)


def loss_scale_plan(opt_state: Any, grads: Any) -> LossScalePlan:
  """What the loss scale in ``opt_state`` does with each leaf of ``grads``.

  Read from the state's structure (nothing is computed or traced): which
  leaves reach the inner optimizer unscaled in float32 (``master_weights``
  keeps a float32 master of them), which in their own dtype, which are Flax
  float8 overwrite leaves, and which optimizer-state leaves of each
  parameter are stored block-quantised. The loss scale's ``update`` reads
  the same plan.

  Args:
    opt_state: an optimizer state holding one loss-scale state (or a Flax
      train state, or an ``nnx.Optimizer``).
    grads: a gradient tree (the parameters do as well: only the structure
      and dtypes are read); ``nnx`` variables are read through, as
      ``nnx.Optimizer`` hands their arrays to ``update``.

  Returns:
    A :class:`LossScalePlan`; ``print`` it for a table.

  Raises:
    ValueError: a leaf of ``grads`` is not an array (a Python number), as
      ``update`` refuses it: the plan is made for what ``update`` takes only.

  Example:
    >>> import jax.numpy as jnp, optax, optax_lossscale as ols
    >>> params = {"w": jnp.ones((2, 3), jnp.bfloat16), "b": jnp.ones(3)}
    >>> tx = ols.dynamic_loss_scale(ols.master_weights(optax.adam(1e-3)))
    >>> print(ols.loss_scale_plan(tx.init(params), params))
    leaf    dtype     handed over  quantised state
    ['b']   float32   own dtype    -
    ['w']   bfloat16  float32      -
  """
  inner_state = _search.find_loss_scale_state(
    _opt_state.optimizer_state(opt_state)
  ).inner_state
  # nnx gradients (an nnx.State of variables) reach update as their arrays
  grads = _tree.unwrap_variables(grads)
  _tree.array_leaves(grads)  # update's check: it takes no other leaves
  return plan_of(_tree.unwrap_variables(inner_state), grads)


def float32_gradient_leaves(opt_state: Any, grads: Any) -> Any | None:
  """Which leaves of ``grads`` an inner state keeps float32 masters for.

  A :class:`~optax_lossscale._base.state_roles.KeepsFloat32Masters` state
  (``master_weights``') holds, in its ``master`` field, a tree like the
  parameters it was made for, with an array at each half-precision leaf it
  keeps a float32 master of (``optax.MaskedNode`` or ``None`` elsewhere:
  ``chain``, ``masked``, ``multi_transform``, ``MultiSteps`` and
  ``inject_hyperparams`` keep the parameters' key paths). A leaf of
  ``grads`` is marked when its key path is one of those and it is a
  half-precision array, unless a half-precision state leaf of that
  parameter comes before that state in a chain (a transformation before
  ``master_weights`` holding its gradients in half precision: float32
  gradients would change that state's dtype): that leaf, and no other,
  reaches the inner optimizer in float32. A fact of the state's structure,
  known when tracing.

  Returns:
    A tree of bools like ``grads``, or ``None`` when no leaf is marked.
  """
  return _float32_marks(grads, *_kept_masters(opt_state, grads))


def _float32_marks(grads: Any, kept: set[str], held_back: set[str]) -> Any | None:
  """:func:`float32_gradient_leaves`' marks, of :func:`_kept_masters`' sets."""
  if not kept:
    return None
  flat, treedef = jax.tree_util.tree_flatten_with_path(grads)
  marks = [
    _tree.keystr(path) in kept and _is_half(g) and _tree.keystr(path) not in held_back
    for path, g in flat
  ]
  return jax.tree.unflatten(treedef, marks) if any(marks) else None


def _is_half(x: Any) -> bool:
  """A float16/bfloat16 array (or a quantised state leaf of that dtype)."""
  dtype = getattr(x, "dtype", None)
  return (
    dtype is not None
    and jnp.issubdtype(dtype, jnp.floating)
    and jnp.finfo(dtype).bits < 32
  )


def _kept_masters(opt_state: Any, grads: Any) -> tuple[set[str], set[str]]:
  """``(the key paths a KeepsFloat32Masters state keeps a master of, those
  of them whose parameter also owns a half-precision state leaf that comes
  before such a state in a chain)``: the second are handed over in their
  own dtype. Before: where the two paths part, both are entries of one
  tuple (a chain's states), the half leaf's the earlier; a state after
  ``master_weights``, or beside it in a named field, never sees the
  gradients the loss scale hands over (a wrapper's field that does, should
  it change dtype, makes the update fall back to each leaf's own dtype)."""
  found = _tree.find_all(opt_state, _roles.keeps_masters)
  kept: set[str] = set()
  for _, node in found:
    flat = jax.tree_util.tree_flatten_with_path(node.master, is_leaf=_tree.is_variable)[
      0
    ]
    kept.update(
      _tree.keystr(path) for path, x in flat if _tree.is_array(_tree.unwrap(x))
    )
  if not kept:
    return kept, set()
  owners = {
    tuple(path): _tree.keystr(path)
    for path, _ in jax.tree_util.tree_flatten_with_path(grads)[0]
  }
  stored = lambda x: _roles.is_quantized(x) or _roles.is_in_group(x)  # noqa: E731
  if not any(_is_half(x) for x in jax.tree.leaves(opt_state, is_leaf=stored)):
    return kept, set()  # the common case, found without walking paths
  masters = [tuple(path) for path, _ in found]
  held_back = set()
  for path, x in _roles.state_leaves(_half_state.without_half_by_design(opt_state)):
    if not _is_half(x):
      continue
    path = tuple(path)
    if not any(_before(path, m) for m in masters):
      continue
    owner = owners.get(_tree.owner_path(path, owners))
    if owner in kept:
      held_back.add(owner)
  return kept, held_back


def _before(path: tuple, master: tuple) -> bool:
  """Whether state leaf ``path`` comes before the state at ``master`` in a
  chain: where the two paths part, both are entries of one tuple (a
  ``SequenceKey``), ``path``'s the earlier."""
  for a, b in zip(path, master, strict=False):
    if a != b:
      seq = jax.tree_util.SequenceKey
      return isinstance(a, seq) and isinstance(b, seq) and a.idx < b.idx
  return False  # inside the master's state, or the master inside it


def _marks(tree: Any, treedef: Any) -> list[bool]:
  """``tree``'s bools, one a leaf of ``treedef`` (all false for ``None``)."""
  if tree is None:
    return [False] * treedef.num_leaves
  return [bool(m) for m in treedef.flatten_up_to(tree)]


def _quantized_by_owner(inner_state: Any, param_paths: list) -> dict[str, list[str]]:
  """Each parameter path's block-quantised state leaves: a quantised leaf
  belongs to the parameter whose path ends its own path (Adam's ``mu`` of
  ``['w']`` is at ``[0].mu['w']``)."""
  owners = {tuple(p): _tree.keystr(p) for p in param_paths}
  out: dict[str, list[str]] = {}
  for path, x in _roles.state_leaves(inner_state):
    if not (_roles.is_quantized(x) or _roles.is_in_group(x)):
      continue
    owner = owners.get(_tree.owner_path(path, owners))
    if owner is not None:
      desc = f"{_tree.keystr(path)} ({jnp.dtype(x.dtype)}, blocks of {x.block_size})"
      out.setdefault(owner, []).append(desc)
  return out
