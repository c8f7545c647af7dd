"""Tree utilities under every other module: which leaves are arrays, finding nodes.

Nothing here knows about loss scaling: what counts as an array leaf, the
check that a gradient tree holds only arrays and the one that it matches
the parameters' structure and shapes, a search for the nodes of a
nested state that satisfy a predicate, and the unwrapping of Flax ``nnx``
variables (found by their ``get_value`` method; Flax is never imported).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

__all__ = [
  "array_leaves",
  "check_grads",
  "check_on_host",
  "explicit_spec",
  "find_all",
  "find_unique",
  "graded",
  "held",
  "is_array",
  "is_float_array",
  "is_variable",
  "keystr",
  "owner_path",
  "real_op",
  "rebuilt_as_itself",
  "short",
  "unwrap",
  "unwrap_variables",
  "wide_dtype",
  "widen",
]


def is_array(x: Any) -> bool:
  """A JAX or NumPy array (or scalar); ``None`` and other leaves are not."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def held(x: Any) -> Any:
  """``x`` as JAX holds it: a NumPy array or scalar becomes a JAX array
  (float64 is float32 unless x64 is enabled, where a value beyond float32's
  range becomes an infinity), as ``jax.jit`` makes it of an argument; a
  JAX array is ``x`` itself."""
  return x if isinstance(x, jax.Array) else jnp.asarray(x)


def is_float_array(x: Any) -> bool:
  """A leaf that loss scaling touches: an array of a floating dtype."""
  # float0, integer and bool arrays are not `inexact`.
  return is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def explicit_spec(x: Any) -> tuple | None:
  """The mesh axes ``x`` is sharded over in its type, or ``None``.

  Under JAX's explicit sharding (a mesh with ``AxisType.Explicit`` axes) an
  array's type carries its partition spec, and operations that combine
  arrays of other specs (a concatenation, a reshape across a sharded
  dimension) are type errors. This is that spec as a tuple when it names an
  axis; ``None`` for a replicated array, for automatic sharding, and on JAX
  versions without sharding in types.
  """
  typeof = getattr(jax, "typeof", None)
  if typeof is None or not is_array(x):
    return None
  spec = getattr(getattr(typeof(x), "sharding", None), "spec", None)
  if spec is None or all(s is None for s in spec):
    return None
  return tuple(spec)


def wide_dtype(dtype: Any) -> Any:
  """The dtype to compute on a floating leaf in: float32 for a half-precision
  leaf, the leaf's own dtype otherwise (float64 stays float64, complex
  stays complex). Arithmetic on a leaf is never less precise than the leaf."""
  dtype = jnp.dtype(dtype)
  return jnp.dtype(jnp.float32) if jnp.finfo(dtype).bits < 32 else dtype


def differentiated_as_cast(fun: Callable[..., Any]) -> Callable[..., Any]:
  """``fun(x, *rest)``, a conversion of ``x`` computed on its bits (which
  have no derivative: JAX would give a zero one, silently), differentiated
  as the conversion it is: the tangent of ``x`` cast to the result's dtype,
  as JAX differentiates ``astype`` (rounding is the identity to first
  order). Where ``fun`` returns a tuple, its first element is the
  conversion and the others (integers) carry no tangent; ``rest`` carries
  none either.
  """

  @jax.custom_jvp
  def converted(x, *rest):
    return fun(x, *rest)

  @converted.defjvp
  def _jvp(primals, tangents):
    out = converted(*primals)
    t = tangents[0]
    if not isinstance(out, tuple):
      return out, t.astype(out.dtype)
    zeros = [np.zeros(o.shape, jax.dtypes.float0) for o in out[1:]]
    return out, (t.astype(out[0].dtype), *zeros)

  return converted


def real_op(op: Callable[[Any, Any], Any], x: jax.Array, r: jax.Array) -> jax.Array:
  """``op(x, r)`` for a real scalar ``r`` (a multiply or a divide), part by
  part where ``x`` is complex: JAX would make ``r`` complex (``r + 0j``),
  and ``inf * 0`` in the cross terms would turn an infinite part's partner
  into NaN (``(inf + 0j) * 0.5`` is ``inf + nanj``). ``r`` is cast to the
  dtype of ``x``'s parts."""
  if jnp.iscomplexobj(x):
    r = jnp.asarray(r).astype(jnp.finfo(x.dtype).dtype)
    return lax.complex(op(jnp.real(x), r), op(jnp.imag(x), r))
  return op(x, jnp.asarray(r).astype(x.dtype))


def widen(x: Any) -> jax.Array:
  """``x`` in :func:`wide_dtype`, exactly the values ``x`` holds.

  bfloat16 and float16 are widened on their bits (a shift, and for float16
  a rebias), so no compiler rewrite can put in their place the more precise
  values a half-precision computation in the same program had before it
  rounded (XLA's "excess precision", allowed by default, drops a
  float32-to-half-to-float32 round trip where its fusions fall): the result
  is the leaf's, however the program was fused or partitioned.
  """
  x = jnp.asarray(x)
  if x.dtype in (jnp.bfloat16, jnp.float16):
    return _widen_half(x)
  return x.astype(wide_dtype(x.dtype))


@differentiated_as_cast
def _widen_half(x: jax.Array) -> jax.Array:
  if x.dtype == jnp.bfloat16:
    bits = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    return lax.bitcast_convert_type(bits << np.uint32(16), jnp.float32)
  bits = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
  negative = (bits >> np.uint32(15)) == 1
  exponent = (bits >> np.uint32(10)) & np.uint32(0x1F)
  fraction = bits & np.uint32(0x3FF)
  biased = jnp.where(exponent == 0x1F, np.uint32(0xFF), exponent + np.uint32(112))
  magnitude = lax.bitcast_convert_type(
    (biased << np.uint32(23)) | (fraction << np.uint32(13)), jnp.float32
  )
  # a subnormal (or zero) is its fraction times 2**-24, exact in float32
  magnitude = jnp.where(
    exponent == 0, fraction.astype(jnp.float32) * np.float32(2.0**-24), magnitude
  )
  return jnp.where(negative, -magnitude, magnitude)


def keystr(path: Any) -> str:
  """A key path as ``jax.tree_util.keystr`` writes it; ``<root>`` for the root."""
  return jax.tree_util.keystr(tuple(path)) or "<root>"


def owner_path(path: tuple, owners: Any) -> tuple | None:
  """The longest tail of state leaf ``path`` that is in ``owners`` (the
  parameters' key paths, as tuples): the parameter the leaf belongs to
  (Adam's ``mu`` of ``['w']`` is at ``[0].mu['w']``), or ``None``.

  >>> from jax.tree_util import DictKey, GetAttrKey, SequenceKey
  >>> w = (DictKey("w"),)
  >>> owner_path((SequenceKey(0), GetAttrKey("mu"), DictKey("w")), {w}) == w
  True
  """
  path = tuple(path)
  return next((path[k:] for k in range(len(path) + 1) if path[k:] in owners), None)


def short(treedef: Any, limit: int = 300) -> str:
  """A tree structure as text, cut at ``limit`` characters for messages."""
  text = str(treedef)
  return text if len(text) <= limit else text[:limit] + " ..."


def array_leaves(tree: Any, what: str = "gradient") -> list[Any]:
  """The leaves of ``tree``, all of them arrays (``None`` is no leaf).

  Raises:
    ValueError: a leaf is not an array (a Python number, a string, ...),
      naming its path: loss scaling cannot unscale or check it, and passing
      it through would apply it unscaled.
  """
  leaves = jax.tree.leaves(tree)
  if all(is_array(x) for x in leaves):
    return leaves
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not is_array(x):
      raise ValueError(
        f"The {what} leaf at {keystr(path)} is a {type(x).__name__} ({x!r}), "
        "not an array: loss scaling can neither unscale nor check it. Make it "
        "an array (jnp.asarray), or leave it out of the tree (None)."
      )
  raise AssertionError("unreachable")


def check_on_host(leaves: Any, caller: str) -> None:
  """A ValueError naming ``caller``, a host-side reader of values, where one
  of ``leaves`` is traced (inside ``jax.jit``) or abstract (a
  ``jax.ShapeDtypeStruct``, of ``jax.eval_shape``): it has no values."""
  for x in leaves:
    if isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)):
      raise ValueError(
        f"{caller} reads the values on the host: call it outside jax.jit, on "
        "the arrays a step returned, not on traced or abstract ones "
        f"(jax.eval_shape's); got a {type(x).__name__}."
      )


def graded(params: Any) -> Any:
  """The part of ``params`` that gradients are shaped like: the fast weights
  of an ``optax.LookaheadParams`` (``optax.lookahead``'s update takes their
  gradients), else ``params`` itself."""
  if isinstance(params, optax.LookaheadParams):
    return params.fast
  return params


def check_grads(grads: Any, params: Any) -> None:
  """A ValueError unless ``grads`` has ``params``' tree structure and each
  array leaf its parameter's shape (nothing to check where ``params`` is
  ``None``; ``optax.LookaheadParams``: its fast weights, whose gradients
  ``optax.lookahead`` takes). Every transformation that reads gradients
  beside parameters checks them so, at trace time.
  """
  params = graded(params)
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
    if not is_array(g):
      return
    # a Python number is a leaf of shape (), as optax takes it
    if p is None or not jax.tree_util.treedef_is_leaf(jax.tree.structure(p)):
      raise ValueError(
        f"Gradient at {keystr(path)} is one array where the "
        f"parameters have a subtree ({jax.tree.structure(p)}): the gradient "
        "tree must have the parameters' structure."
      )
    if g.shape != np.shape(p):
      raise ValueError(
        f"Gradient at {keystr(path)} has shape {g.shape} but "
        f"the parameter has shape {np.shape(p)}."
      )

  jax.tree_util.tree_map_with_path(check, grads, params, is_leaf=lambda x: x is None)


def find_all(tree: Any, predicate: Callable[[Any], bool]) -> list[tuple[Any, Any]]:
  """Every node of ``tree`` for which ``predicate``, at any depth.

  Matching nodes are searched too, so a node nested inside another matching
  node is found as well.

  Returns:
    ``(key path, node)`` pairs, depth-first.
  """
  found: list[tuple[Any, Any]] = []

  def visit(node, prefix):
    is_match = lambda x: x is not node and predicate(x)  # noqa: E731
    for path, x in jax.tree_util.tree_flatten_with_path(node, is_leaf=is_match)[0]:
      if is_match(x):
        found.append((prefix + path, x))
        visit(x, prefix + path)

  if predicate(tree):
    found.append(((), tree))
  visit(tree, ())
  return found


def find_unique(tree: Any, predicate: Callable[[Any], bool], what: str) -> Any:
  """The one node of ``tree`` (at any depth) for which ``predicate``.

  Args:
    tree: any pytree (an optax state, nested ``chain``/``MultiSteps``/...).
    predicate: says whether a node is the one looked for.
    what: a description of the node, for the error messages.

  Raises:
    ValueError: there is no such node, or more than one (with their paths),
      one inside the other included.
  """
  found = find_all(tree, predicate)
  if not found:
    raise ValueError(
      f"No {what} in this optimizer state (of type {type(tree).__name__})."
      f"{restored_hint(tree)}"
    )
  if len(found) > 1:
    paths = ", ".join(keystr(p) for p, _ in found)
    raise ValueError(
      f"Found {len(found)} {what}s in this optimizer state (at {paths}); "
      "expected exactly one."
    )
  return found[0][1]


def is_variable(x: Any) -> bool:
  """An ``nnx.Variable`` (anything but an array with a ``get_value`` method)."""
  return not is_array(x) and callable(getattr(x, "get_value", None))


def unwrap(x: Any) -> Any:
  """``x``, or the array an ``nnx`` variable holds."""
  return x.get_value() if is_variable(x) else x


def unwrap_variables(tree: Any) -> Any:
  """``tree`` with ``nnx`` variables replaced by the arrays they hold."""
  return jax.tree.map(unwrap, tree, is_leaf=is_variable)


def rebuilt_as_itself(cls: type) -> type:
  """Registers ``cls``, a subclass of optax's transformation tuple whose
  constructor takes more than ``init`` and ``update``, as a pytree node.

  A tree operation (``jax.tree.map``, Equinox's ``filter_jit``) rebuilds a
  named tuple by calling its class with the children, which such a
  constructor refuses. Registered, it is rebuilt from the children with
  the original's attributes (the wrapped transformation, the options); the
  original, a tuple of two functions, is the hashable auxiliary data.
  """

  def unflatten(original, children):
    new = tuple.__new__(type(original), children)
    new.__dict__.update(original.__dict__)
    return new

  jax.tree_util.register_pytree_node(cls, lambda t: (tuple(t), t), unflatten)
  return cls


def in_containers(tree: Any, made: Any) -> Any:
  """``tree`` with a tuple wherever ``made`` (the state ``init`` makes) has
  a tuple and ``tree`` a list of its length: a state whose tuples a
  serializer's round trip made lists, given back as ``init`` made it.
  Every other node is kept as it is.

  >>> in_containers({"a": [1, [2, 3]]}, {"a": (0, (0, 0))})
  {'a': (1, (2, 3))}
  """
  if type(made) is tuple and isinstance(tree, list) and len(tree) == len(made):
    return tuple(in_containers(t, m) for t, m in zip(tree, made, strict=True))
  kids, treedef = _children(tree)
  made_kids, made_def = _children(made)
  if kids is None or made_kids is None or len(kids) != len(made_kids):
    return tree
  if treedef.node_data() != made_def.node_data():
    return tree  # another node: left for the caller's check to name
  return treedef.unflatten(
    [in_containers(t, m) for t, m in zip(kids, made_kids, strict=True)]
  )


def _children(tree: Any) -> tuple[list | None, Any]:
  """``tree``'s children and its one-level structure; ``None`` for a leaf."""
  kids, treedef = jax.tree.flatten(tree, is_leaf=lambda x: x is not tree)
  if treedef.num_nodes == 1:  # a leaf (or a node without children)
    return None, treedef
  return kids, treedef


def restored_hint(state: Any) -> str:
  """What to do where a state is a plain dict or list holding no NamedTuple:
  most often a checkpoint restored without a target (Orbax gives NamedTuples
  back as dicts, tuples as lists); otherwise nothing."""
  named = lambda x: isinstance(x, tuple) and hasattr(x, "_fields")  # noqa: E731
  nodes = jax.tree.leaves(state, is_leaf=named)
  if not isinstance(state, (dict, list)) or not nodes or any(map(named, nodes)):
    return ""
  return (
    f" A {type(state).__name__} where a state belongs is most often a "
    "checkpoint restored without a target: restore against the state init "
    "makes, jax.tree.map(ocp.utils.to_shape_dtype_struct, tx.init(params)) "
    "with Orbax, or pass it as the target of Flax's from_state_dict."
  )
