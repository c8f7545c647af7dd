"""quantize_state's flat layout: a moment field in one buffer, updated as one program.

With ``quantize_state(..., layout="flat")`` the quantised leaves of one
moment field and dtype (Adam's ``mu`` of every float32 parameter) are
stored as one :class:`~.quantize_codec.QuantizedLeaf` of one dimension,
each leaf's blocks after the previous leaf's (a leaf's last block padded
with zeros, as the per-leaf layout pads it: the blocks, codes and scales
are the same), and the inner state holds a :class:`GroupedLeaf`, which
says where, in the leaf's place. ``update`` decodes each buffer once, runs
the inner update with each group of parameters that it updates alike
element by element (:mod:`optax_lossscale._base.lanes`) as one program on
flat arrays, and encodes each buffer once: the step's code no longer grows
with the number of leaves (BENCHMARKS.md, 8-bit state).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._base import flax_serialization as _flax_serialization
from optax_lossscale._base import lanes as _lanes
from optax_lossscale._base import tree as _tree
from optax_lossscale._params import quantize_codec as _codec

__all__ = [
  "GroupedLeaf",
  "check_unsharded",
  "dequantized",
  "encode_groups",
  "encoded",
  "flat_update",
  "grouped",
  "is_grouped",
]

_F32 = jnp.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class GroupedLeaf:
  """A quantised state leaf stored in a buffer of its group (the flat layout).

  Attributes:
    group: the index of its buffer in ``FlatQuantizedState.groups``.
    start: the buffer index of its first element (a multiple of
      ``block_size``).
    shape: its shape.
    dtype: the dtype the inner transformation made it in.
    block_size: elements per block.
    sqrt: whether an all ``>= 0`` block holds its values' square roots.
  """

  group: int
  start: int
  shape: tuple
  dtype: Any
  block_size: int
  sqrt: bool

  #: the ``StoredInGroup`` protocol of ``_base/state_roles.py``
  stored_in_group = True  # a class attribute, not a field


jax.tree_util.register_dataclass(
  GroupedLeaf,
  data_fields=[],
  meta_fields=["group", "start", "shape", "dtype", "block_size", "sqrt"],
)
# Flax's serialization saves none of it (its values are in the group's buffer).
_flax_serialization.register(GroupedLeaf, ())


def is_grouped(x: Any) -> bool:
  """Whether ``x`` is a :class:`GroupedLeaf`."""
  return isinstance(x, GroupedLeaf)


def _lane(path: tuple, x: Any, owners: dict, shapes: list) -> tuple[Any, tuple]:
  """``(lane, slot)`` of the state leaf at ``path``: the parameter it
  belongs to (its index) where it has that parameter's shape, and its
  path less the parameter's (Adam's ``mu`` of ``['w']``: ``[0].mu``); else
  no lane and its whole path."""
  owner = _tree.owner_path(path, owners)
  if owner is not None and tuple(getattr(x, "shape", ())) == shapes[owners[owner]]:
    return owners[owner], ("state", path[: len(path) - len(owner)])
  return None, ("state", path)


def _owners(like: Any) -> tuple[dict, list]:
  with_paths = jax.tree_util.tree_flatten_with_path(like)[0]
  owners = {tuple(p): i for i, (p, _) in enumerate(with_paths)}
  return owners, [tuple(np.shape(x)) for _, x in with_paths]


def grouped(
  inner_state: Any,
  chosen: list[int],
  like: Any,
  block_size: int,
  sqrt: bool,
  group_of: dict | None = None,
) -> tuple[Any, list[tuple[list[int], Any]]]:
  """The flat layout of ``inner_state`` (arrays or abstract values) whose
  leaves ``chosen`` (indices in ``jax.tree.leaves`` order) are quantised.

  The leaves of one moment field are grouped by dtype, or, with
  ``group_of`` (a state's groups by path: what a check compares with), by
  the group the state keeps them in: the dtypes an ``init`` grouped by are
  those of its parameters, which an ``update`` given only gradients does
  not know.

  Returns:
    ``(state, groups)``: ``inner_state`` with a :class:`GroupedLeaf` in
    place of each chosen leaf, and for each group the indices of its
    leaves (in order) and its abstract :class:`~.quantize_codec.QuantizedLeaf`.
  """
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(inner_state)
  owners, shapes = _owners(like)
  group_of = {} if group_of is None else group_of
  members: dict = {}
  for i in chosen:
    path, x = with_paths[i]
    _, slot = _lane(path, x, owners, shapes)
    members.setdefault((slot, group_of.get(path, jnp.dtype(x.dtype))), []).append(i)
  leaves = [x for _, x in with_paths]
  groups = []
  for g, idx in enumerate(members.values()):
    dtype = jnp.dtype(leaves[idx[0]].dtype)
    start = 0
    for i in idx:
      x = leaves[i]
      leaves[i] = GroupedLeaf(g, start, tuple(x.shape), dtype, block_size, sqrt)
      start += _lanes.padded(x.size, block_size)
    groups.append(
      (idx, _codec.layout(jax.ShapeDtypeStruct((start,), dtype), block_size, sqrt))
    )
  return jax.tree.unflatten(treedef, leaves), groups


def check_unsharded(leaves: list) -> None:
  """A ValueError where a leaf to quantise is sharded explicitly (its
  group's buffer would gather it onto each device)."""
  for x in leaves:
    if _tree.explicit_spec(x) is not None:
      raise ValueError(
        "quantize_state: layout='flat' stores a moment field's leaves in one "
        "buffer, which cannot keep a leaf's explicit sharding (a leaf is "
        f"sharded as {_tree.explicit_spec(x)}); use layout='leaf'."
      )


def encoded(
  inner_state: Any,
  chosen: list[int],
  like: Any,
  block_size: int,
  sqrt: bool,
  stochastic: bool,
  step: Any = None,
) -> tuple[Any, tuple]:
  """``inner_state`` in the flat layout (:func:`grouped`), its chosen leaves
  encoded (at ``step``): ``(state with GroupedLeaf s, the groups'
  QuantizedLeaf s)``."""
  leaves = jax.tree.leaves(inner_state)
  check_unsharded([leaves[i] for i in chosen])
  state, groups = grouped(inner_state, chosen, like, block_size, sqrt)
  slots = jax.tree.leaves(state, is_leaf=is_grouped)
  values = [
    jnp.concatenate([_lanes.flattened(leaves[i].astype(_F32), block_size) for i in idx])
    for idx, _ in groups
  ]
  members = [[slots[i] for i in idx] for idx, _ in groups]
  dtypes = [g.dtype for _, g in groups]
  return state, encode_groups(
    values, members, dtypes, block_size, sqrt, stochastic, step
  )


def encode_groups(
  values: list,
  group_leaves: list,
  dtypes: list,
  block_size: int,
  sqrt: bool,
  stochastic: bool,
  step: Any = None,
  olds: list | None = None,
) -> tuple:
  """The :class:`QuantizedLeaf` of each group's flat values (padding zero),
  made in its dtype of ``dtypes``; groups of one length are encoded
  together (one reduction reads them).
  ``group_leaves``: each group's :class:`GroupedLeaf` s, whose ``start``
  makes the stochastic rounding's random numbers (at ``step``) those of
  the per-leaf layout. ``olds``: each group's old QuantizedLeaf and the
  values the inner update read from it, whose unchanged blocks are kept."""
  out = [None] * len(values)
  by_size: dict = {}
  for g, v in enumerate(values):
    by_size.setdefault(v.shape, []).append(g)
  for idx in by_size.values():
    firsts = None
    if stochastic:
      firsts = [_block_firsts(group_leaves[g], values[g].size, block_size) for g in idx]
    coded = _codec.encode_many(
      [values[g] for g in idx],
      block_size,
      sqrt,
      stochastic,
      firsts=firsts,
      step=step,
      olds=None if olds is None else [olds[g] for g in idx],
    )
    for g, q in zip(idx, coded, strict=True):
      out[g] = dataclasses.replace(q, dtype=jnp.dtype(dtypes[g]))
  return tuple(out)


def _block_firsts(leaves: list, size: int, block_size: int) -> np.ndarray:
  """For each block of a group's buffer, minus its leaf's ``start``: what
  turns a buffer index into the index in the leaf (``uint32`` arithmetic)."""
  first = np.zeros(size // block_size, np.int64)
  for leaf in leaves:
    first[leaf.start // block_size :] = -leaf.start
  return first.astype(np.uint32)[:, None]


def _decoded(q: Any) -> Any:
  return q.dequantize().astype(q.dtype)


def dequantized(inner_state: Any, groups: tuple, cast: bool) -> Any:
  """``inner_state`` with each :class:`GroupedLeaf` its values (float32, or
  its dtype with ``cast``), read from its group's buffer (whose leading
  axes, a stack of states, it keeps)."""
  abstract = any(not _tree.is_array(q.codes) for q in groups)  # eval_shape's
  flat = [None if abstract else q.dequantize() for q in groups]

  def leaf(x):
    if not is_grouped(x):
      return x
    if abstract:
      lead = groups[x.group].codes.shape[:-1]
      return jax.ShapeDtypeStruct((*lead, *x.shape), x.dtype if cast else _F32)
    buffer = flat[x.group]
    v = buffer[..., x.start : x.start + math.prod(x.shape)]
    v = v.reshape(*buffer.shape[:-1], *x.shape)
    return v.astype(x.dtype) if cast else v

  return jax.tree.map(leaf, inner_state, is_leaf=is_grouped)


def flat_update(
  update: Any,
  updates: Any,
  inner_state: Any,
  groups: tuple,
  params: Any,
  extra_args: dict,
  block_size: int,
  sqrt: bool,
  stochastic: bool,
  step: Any = None,
) -> tuple[Any, Any, tuple]:
  """``update(updates, state, params, **extra_args)`` on the flat layout:
  ``(new updates, new inner state with its GroupedLeaf s, new groups)``,
  each group's unchanged blocks kept, the others encoded at ``step``."""
  like = params if params is not None else updates
  owners, shapes = _owners(like)
  # an eager update's Python numbers as the arrays a jitted one traces
  u_leaves, u_def = jax.tree.flatten(jax.tree.map(jnp.asarray, updates))
  p_leaves, p_def = (
    jax.tree.flatten(jax.tree.map(jnp.asarray, params))
    if params is not None
    else ([], None)
  )
  s_paths, s_def = jax.tree_util.tree_flatten_with_path(inner_state, is_leaf=is_grouped)
  s_leaves = [x for _, x in s_paths]
  lane_shapes = dict(enumerate(shapes))
  s_lanes, s_slots = [], []
  for i, (path, x) in enumerate(s_paths):
    lane, slot = _lane(path, x, owners, shapes)
    if is_grouped(x) and lane is None:
      lane = ("leaf", i)  # a lane of its own: its group is read and written whole
      lane_shapes[lane] = x.shape
    s_lanes.append(lane)
    s_slots.append(slot)
  members: list[list[int]] = [[] for _ in groups]
  for i, x in enumerate(s_leaves):
    if is_grouped(x):
      members[x.group].append(i)
  # Only the parameters with quantised state are lanes: the others' code,
  # traced as it is, compiles once per shape (a layer norm's), where slicing
  # them out of flat arrays would compile once per leaf.
  stored = {s_lanes[i] for idx in members for i in idx}
  s_lanes = [lane if lane in stored else None for lane in s_lanes]
  read = [_decoded(q) for q in groups]  # what the inner update reads
  flat_in = [
    (s_slots[idx[0]], _lanes.Flat(tuple(s_lanes[i] for i in idx), x))
    for idx, x in zip(members, read, strict=True)
  ]
  abstract = [
    jax.ShapeDtypeStruct(x.shape, x.dtype) if is_grouped(x) else x for x in s_leaves
  ]
  n_u, n_s = len(u_leaves), len(s_leaves)

  made: list = []  # the tree of the updates the inner update returns

  def traced(*leaves):
    u = jax.tree.unflatten(u_def, leaves[:n_u])
    s = jax.tree.unflatten(s_def, leaves[n_u : n_u + n_s])
    p = jax.tree.unflatten(p_def, leaves[n_u + n_s :]) if p_def is not None else None
    new_u, new_s = update(u, s, p, **extra_args)
    paths, treedef = jax.tree_util.tree_flatten_with_path(new_u)
    made.append(([path for path, _ in paths], treedef))  # not the tracers
    return jax.tree.leaves(new_u), s_def.flatten_up_to(new_s)

  closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(
    *u_leaves, *abstract, *p_leaves
  )
  (new_u_paths, new_u_def), n_new_u = made[-1], len(out_shape[0])

  def lanes_of(paths):  # a parameter's lane, where it has quantised state
    return [lane if (lane := owners.get(tuple(p))) in stored else None for p in paths]

  def of_shape(lanes, leaves):  # a value of another shape is not its lane's
    return [
      lane if lane is not None and jnp.shape(x) == lane_shapes[lane] else None
      for lane, x in zip(lanes, leaves, strict=True)
    ]

  u_lanes = of_shape(
    lanes_of(p for p, _ in jax.tree_util.tree_flatten_with_path(updates)[0]), u_leaves
  )
  p_lanes = of_shape(
    [lane if lane in stored else None for lane in range(len(p_leaves))], p_leaves
  )
  check_unsharded(
    [
      x
      for x, lane in zip([*u_leaves, *p_leaves], [*u_lanes, *p_lanes], strict=True)
      if lane is not None
    ]
  )
  outs, flats = _lanes.flat_evaluate(
    closed,
    [*u_leaves, *[None if is_grouped(x) else x for x in s_leaves], *p_leaves],
    in_lanes=[*u_lanes, *s_lanes, *p_lanes],
    in_slots=[*[("updates",)] * n_u, *s_slots, *[("params",)] * len(p_leaves)],
    out_lanes=[*lanes_of(new_u_paths), *s_lanes],
    out_slots=[*[("new updates",)] * n_new_u, *[("new",) + s for s in s_slots]],
    shapes=lane_shapes,
    align=block_size,
    flat_in=flat_in,
    flat_out=[
      (("new",) + s_slots[idx[0]], tuple(s_lanes[i] for i in idx)) for idx in members
    ],
  )
  new_u = jax.tree.unflatten(new_u_def, outs[:n_new_u])
  new_leaves = list(outs[n_new_u:])
  new_groups_dtype = []
  for idx in members:
    for i in idx:  # what the per-leaf layout refuses, with its message
      _codec.check_real(out_shape[1][i].dtype, out_shape[1][i].shape)
    dtypes = {jnp.dtype(out_shape[1][i].dtype) for i in idx}
    if len(dtypes) != 1:
      raise ValueError(
        "quantize_state: the inner update made the leaves of one quantised "
        f"group in several dtypes ({sorted(d.name for d in dtypes)}); use "
        "layout='leaf'."
      )
    dtype = dtypes.pop()
    new_groups_dtype.append(dtype)
    for i in idx:
      x = s_leaves[i]
      new_leaves[i] = dataclasses.replace(x, dtype=dtype)
  group_leaves = [[new_leaves[i] for i in idx] for idx in members]
  coded = encode_groups(
    [f.value.astype(_F32) for f in flats],
    group_leaves,
    new_groups_dtype,
    block_size,
    sqrt,
    stochastic,
    step,
    list(zip(groups, read, strict=True)),
  )
  return new_u, jax.tree.unflatten(s_def, new_leaves), coded
