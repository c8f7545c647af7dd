"""Where the gradients were not finite: a per-leaf record kept in the loss-scale state.

A loss scale built with ``track_nonfinite=True`` keeps a
:class:`NonFiniteRecord` in its state: for each gradient leaf, on how many
steps it held NaN or an infinity, and what it held on the last such step;
and for the loss (passed to ``update`` as ``value=``) whether it was itself
not finite. :func:`note` writes it inside the step, inside a ``lax.cond`` on
the finite flag the check already computed, so a finite step runs none of
the per-leaf work; :func:`nonfinite_report` reads it on the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_lossscale._base import flax_serialization as _flax_serialization
from optax_lossscale._base import tree as _tree
from optax_lossscale._loss_scale import core as _core
from optax_lossscale._loss_scale import finite as _finite

__all__ = ["NonFiniteRecord", "initial_record", "leaf_paths", "note"]

_I32 = jnp.int32
#: ``last_loss`` when the loss was not given to ``update`` (``value=``).
LOSS_UNKNOWN = -1


@dataclasses.dataclass(frozen=True)
class NonFiniteRecord:
  """Which gradient leaves were not finite, and on which steps.

  A pytree: the arrays are its leaves (they survive ``jax.jit``, Orbax and
  sharding like any state), ``paths`` is static metadata (the parameter
  paths, recorded by ``init``). Bits in the ``last_*`` fields:
  1 = NaN, 2 = infinity, 3 = both.

  Attributes:
    steps: int32, updates seen since ``init``.
    nonfinite_steps: int32, updates whose gradients were not all finite.
    loss_steps: int32, of those, the ones whose loss was itself not finite.
    last_step: int32, the index (from 0) of the last non-finite update; -1
      before the first.
    last_scale: float32, the loss scale that produced its gradients.
    last_loss: int8, its loss's bits (0: finite); -1 when the loss was not
      passed to ``update`` as ``value=``.
    leaf_steps: int32 per leaf, non-finite updates on which it held NaN or
      an infinity.
    leaf_nan_steps: int32 per leaf, those on which it held a NaN.
    leaf_inf_steps: int32 per leaf, those on which it held an infinity.
    last_leaves: uint8 per leaf, its bits on the last non-finite update.
    paths: the leaves' paths in the parameter tree (``'Block_0/Dense_1/kernel'``).
  """

  steps: jax.Array
  nonfinite_steps: jax.Array
  loss_steps: jax.Array
  last_step: jax.Array
  last_scale: jax.Array
  last_loss: jax.Array
  leaf_steps: jax.Array
  leaf_nan_steps: jax.Array
  leaf_inf_steps: jax.Array
  last_leaves: jax.Array
  paths: tuple[str, ...]

  def replace(self, **changes: Any) -> NonFiniteRecord:
    return dataclasses.replace(self, **changes)


#: The record's arrays (its pytree children); ``paths`` is static.
ARRAY_FIELDS = tuple(f.name for f in dataclasses.fields(NonFiniteRecord))[:-1]
jax.tree_util.register_dataclass(
  NonFiniteRecord, data_fields=list(ARRAY_FIELDS), meta_fields=["paths"]
)


# Flax's msgpack and state-dict serialization (to_bytes) saves a record.
_flax_serialization.register(NonFiniteRecord, ARRAY_FIELDS)


def _key_name(key: Any) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _is_leaf(x: Any) -> bool:
  """A parameter tree's leaf for the record: ``None`` (a parameter without
  gradient keeps its place) or a box holding one array (an ``nnx``
  variable, a Linen ``Partitioned``), whose path is the box's own."""
  return x is None or _tree.is_variable(x) or callable(getattr(x, "unbox", None))


def leaf_paths(tree: Any) -> tuple[str, ...]:
  """Each leaf's path in ``tree`` as ``'a/b/0/kernel'``, as Flax prints them."""
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)[0]
  return tuple("/".join(_key_name(k) for k in path) or "<root>" for path, _ in flat)


def _leaves(grads: Any) -> list[Any]:
  """``grads``' leaves, ``None`` included: one per entry of the record."""
  return jax.tree.leaves(grads, is_leaf=lambda x: x is None)


def initial_record(params: Any) -> NonFiniteRecord:
  """A fresh record for gradients shaped like ``params`` (one entry per
  leaf; of an ``optax.LookaheadParams``, the fast weights', as
  ``optax.lookahead`` takes their gradients)."""
  paths = leaf_paths(_tree.graded(params))
  zeros = np.zeros(len(paths))
  return _in_dtypes(
    NonFiniteRecord(
      steps=0,
      nonfinite_steps=0,
      loss_steps=0,
      last_step=-1,
      last_scale=0.0,
      last_loss=LOSS_UNKNOWN,
      leaf_steps=zeros,
      leaf_nan_steps=zeros,
      leaf_inf_steps=zeros,
      last_leaves=zeros,
      paths=paths,
    )
  )


#: Each count's dtype.
_DTYPES = {
  **dict.fromkeys(("steps", "nonfinite_steps", "loss_steps", "last_step"), _I32),
  "last_scale": jnp.float32,
  "last_loss": jnp.int8,
  **dict.fromkeys(("leaf_steps", "leaf_nan_steps", "leaf_inf_steps"), _I32),
  "last_leaves": jnp.uint8,
}


def _in_dtypes(record: NonFiniteRecord) -> NonFiniteRecord:
  """``record`` with each count an array of its dtype: a new record's
  numbers, or a restored one's Python numbers and weakly typed scalars
  (which the update's branches would give back in other dtypes)."""
  return record.replace(
    **{k: jnp.asarray(getattr(record, k), d) for k, d in _DTYPES.items()}
  )


def _increment(count: jax.Array, where: Any = True) -> jax.Array:
  """``count + 1`` where ``where``, saturating at the int32 maximum."""
  top = jnp.iinfo(count.dtype).max
  return jnp.where(jnp.logical_and(where, count < top), count + 1, count)


def _any_device(kinds: jax.Array, axis_name: Any) -> jax.Array:
  """``kinds`` OR-ed over ``axis_name``: what any device saw, on every device."""
  if axis_name is None:
    return kinds
  bits = jnp.stack([kinds & _finite.NAN, kinds & _finite.INF]).astype(_I32)
  bits = _core.psum_over(bits, axis_name) > 0
  nan = jnp.where(bits[0], np.uint8(_finite.NAN), np.uint8(0))
  return nan | jnp.where(bits[1], np.uint8(_finite.INF), np.uint8(0))


def _checked_loss(value: Any, axis_name: Any) -> jax.Array:
  """``value`` as a floating array, the same on every device that decides."""
  given = value
  try:
    value = jnp.asarray(value)
  except TypeError:
    value = None
  if value is None or not jnp.issubdtype(value.dtype, jnp.inexact):
    got = type(given).__name__ if value is None else value.dtype
    raise ValueError(
      "`value` (the loss given to update) must be a floating array or "
      f"number, got {got}."
    )
  named = set(axis_name) if isinstance(axis_name, (tuple, list)) else {axis_name}
  varying = _core.varying_axes(value) - named
  if varying:
    raise ValueError(
      "`value` (the loss given to update) differs between devices along the "
      f"shard_map mesh axis/axes {', '.join(map(repr, sorted(varying, key=str)))}: "
      "give the mean loss (lax.pmean), or name the axes in axis_name."
    )
  return value


def _spans(grads: Any, params: Any, entries: int) -> list[int] | None:
  """How many of the record's ``entries`` each leaf of ``grads`` (``None``
  included) stands for, where ``grads`` hold ``None`` for a whole subtree
  of ``params`` (a frozen part of the model: each of its leaves keeps its
  entry, never counted); ``None`` where that does not account for them."""
  if params is None:
    return None
  try:
    spans = jax.tree.map(
      lambda g, p: len(leaf_paths(p)) if g is None else 1,
      grads,
      _tree.graded(params),
      is_leaf=lambda x: x is None,
    )
  except (ValueError, TypeError):
    return None
  spans = jax.tree.leaves(spans)
  return spans if sum(spans) == entries else None


def note(
  record: NonFiniteRecord,
  finite: jax.Array,
  grads: Any,
  checked: Callable[[Any], Any],
  value: Any,
  loss_scale: jax.Array,
  axis_name: Any = None,
  params: Any = None,
) -> NonFiniteRecord:
  """``record`` after one update whose gradients were finite or not.

  On a non-finite update (``finite`` false) each leaf of
  ``checked(grads)`` is classified (:func:`_finite.nonfinite_kinds`) and
  counted, and so is ``value``, the loss, unless it is ``None``. That work
  sits in the non-finite branch of a ``lax.cond``: a finite update only
  counts itself. An update skipped with every leaf of ``checked(grads)``
  finite (a state's scale below the configuration's range: see
  ``_core.check``) is not a non-finite one, and only counts itself too.

  Args:
    record: the record so far.
    finite: the step's finite flag, already the same on every device.
    grads: the gradients as ``update`` received them.
    checked: what the finite check read, as a function of ``grads`` (the
      unscaled gradients); called inside the branch, so nothing it computes
      runs on finite steps.
    value: the loss, or ``None``.
    loss_scale: the scale the gradients were computed with.
    axis_name: the mapped axis the gradients are split over: what any device
      saw is recorded on all.
    params: the parameters given to ``update``, or ``None``: where the
      gradients hold ``None`` for a whole subtree of them, each of its leaves
      keeps its entry (never counted).

  Raises:
    ValueError: the gradients have another number of leaves than the
      parameters the record was made for, or the loss is not floating.
  """
  n = len(_leaves(grads))
  spans = None if n == len(record.paths) else _spans(grads, params, len(record.paths))
  if n != len(record.paths) and spans is None:
    raise ValueError(
      f"The gradients have {n} leaves but the non-finite record was made for "
      f"{len(record.paths)} (the parameters given to init): pass gradients "
      "shaped like those parameters."
    )
  record = _in_dtypes(record)  # both branches give it back in these
  if value is not None:
    value = _checked_loss(value, axis_name)

  def nonfinite(r):
    leaves = _leaves(checked(grads))
    extra = [] if value is None else [value]
    kinds = _any_device(_finite.nonfinite_kinds(leaves + extra), axis_name)
    leaf, loss = kinds[: len(leaves)], kinds[len(leaves) :]
    if spans is not None:  # a None subtree's leaves: never counted
      leaf = jnp.repeat(leaf, np.asarray(spans), total_repeat_length=len(record.paths))
    if value is None:
      loss_bits = jnp.full([], LOSS_UNKNOWN, jnp.int8)
    else:
      loss_bits = loss[0].astype(jnp.int8)
    new = r.replace(
      nonfinite_steps=_increment(r.nonfinite_steps),
      loss_steps=_increment(r.loss_steps, loss_bits > 0),
      last_step=r.steps,
      last_scale=jnp.asarray(loss_scale, jnp.float32),
      last_loss=loss_bits,
      leaf_steps=_increment(r.leaf_steps, leaf != 0),
      leaf_nan_steps=_increment(r.leaf_nan_steps, (leaf & _finite.NAN) != 0),
      leaf_inf_steps=_increment(r.leaf_inf_steps, (leaf & _finite.INF) != 0),
      last_leaves=leaf,
    )
    # The flag is also false for finite gradients computed with a scale
    # below this configuration's range (``_core.check``): that step is
    # skipped, but its gradients were finite, and it is not counted.
    seen = jnp.any(leaf != 0)
    return jax.tree.map(lambda a, b: jnp.where(seen, a, b), new, r)

  record = lax.cond(finite, lambda r: r, nonfinite, record)
  return record.replace(steps=_increment(record.steps))
