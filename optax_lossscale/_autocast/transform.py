"""autocast: run an unmodified float32 function in mixed precision.

The JAX form of TensorFlow's ``enable_mixed_precision_graph_rewrite``: the
function's jaxpr is evaluated primitive by primitive, and each primitive's
floating inputs are cast according to four public lists (TF's names):

* allow: matmuls and convolutions run in the half dtype;
* deny: numerically unsafe primitives (exponentials, logarithms, powers,
  large reductions, divisions: the pieces of softmax and of normalisation
  statistics) run in float32;
* infer: elementwise arithmetic runs in the half dtype when every floating
  input is already half, otherwise in float32;
* clear: data movement passes its input's dtype through.

A primitive in no list runs in float32 (TF treats unlisted ops the same way).
The lists live in ``lists``. A matmul whose result is only ever
read in float32 (its consumers, through the ops that follow their inputs'
dtype, are deny-list ops or conversions to float32: attention's logits
before the softmax) accumulates and returns float32 itself
(``_autocast_rules.float32_results``), so that no half intermediate exists to
overflow.
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from optax_lossscale._autocast import evaluate as _autocast_eval
from optax_lossscale._autocast import nnx_state as _autocast_state
from optax_lossscale._autocast import roles as _autocast_roles
from optax_lossscale._autocast.evaluate import cast
from optax_lossscale._autocast.lists import (
  ALLOW_LIST,
  CLEAR_LIST,
  DENY_LIST,
  INFER_LIST,
)
from optax_lossscale._autocast.rules import AUTOCAST_CALL, Rules, is_float
from optax_lossscale._base import dtypes as _dtypes


def _is_static(x: Any) -> bool:
  """A leaf passed as it is, not traced: anything but a JAX or NumPy array.

  As ``equinox.filter_jit`` splits a model: Python numbers, bools, strings
  and functions are the function's constants (a Flax ``apply(...,
  train=True)``, an Equinox dropout rate that a layer tests in Python), where
  ``jax.jit`` would need ``static_argnums`` for them. A new Python number is
  a new signature: pass a value that changes from call to call as an array.
  A ``jax.ShapeDtypeStruct`` (what :func:`list_matmuls` takes) is traced.
  """
  return not isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def _merge(static: tuple, arrays: Any) -> list:
  """The flat leaves: ``static`` ``(index, value)`` pairs placed among ``arrays``."""
  out = list(arrays)
  for i, x in static:
    out.insert(i, x)
  return out


def autocast(
  fun: Callable[..., Any],
  *,
  compute_dtype: Any = None,
  allow: Iterable[str] = ALLOW_LIST,
  deny: Iterable[str] = DENY_LIST,
  infer: Iterable[str] = INFER_LIST,
  clear: Iterable[str] = CLEAR_LIST,
  matmul: Any = None,
) -> Callable[..., Any]:
  """``fun`` evaluated with per-primitive casting to ``compute_dtype``.

  Returns a function with ``fun``'s signature whose floating outputs have the
  dtypes ``fun`` returns; integer and boolean values are never cast; every
  output (and every NNX Variable written) comes back as from
  ``jax.jit(fun)``: constants of any dtype, Python numbers (arrays, weakly
  typed), ``None`` and inputs returned as they are included. Its
  ``compute_dtype`` attribute is the half dtype it computes in. It
  rewrites ``fun``'s jaxpr, recursing into ``jit``, ``checkpoint``,
  ``scan``, ``while_loop`` and ``cond`` (an autocast function ``fun`` calls
  runs as it rewrote itself: the innermost decides); a ``custom_jvp``/``custom_vjp``
  function keeps its rule (its body is rewritten, its boundary keeps its
  dtypes; differentiated, JAX runs the rule as written, and a
  :class:`~optax_lossscale.CustomRuleWarning` says so where the body's
  matmuls were rewritten). It works under ``jax.jit``, ``jax.grad`` (float32 inputs get
  float32 gradients) and ``jax.vmap``. The user's own numerics are kept:
  only float32 work is cast. A conversion ``fun`` writes keeps its target
  dtype; a matmul whose operands ``fun`` put in a narrower dtype itself
  keeps them and its result type, and a result type ``fun`` set narrower
  than its float32 operands stays; complex, integer and boolean values are
  never rewritten. A matmul whose result every reader computes
  in float32 (the deny list's ``exp``, ``div``, reductions, or a conversion
  to float32, reached through the ops that follow their inputs' dtype; not
  another matmul, a loop or the function's output) reads half inputs and
  accumulates and returns float32 itself: attention's logits before the
  softmax never exist in half, so they cannot overflow. With bfloat16 its
  derivatives are bfloat16 products (the float32 cotangent rounded once);
  float16, whose range would lose small gradients, keeps them float32.
  Every spelling of a square runs by the rule of ``square``. Literals,
  weakly-typed values and 0-d scalars follow the other inputs. Arguments
  that are not JAX or NumPy
  arrays (bools, strings, functions, Python numbers) are static, as
  ``equinox.filter_jit`` keeps them; like ``jax.jit``, the result is traced
  and compiled once per input signature.

  Flax NNX state is kept: every NNX module, ``Rngs`` or ``Variable`` among
  the arguments (or ``fun`` itself being a module or a module's method) is
  traced through its state (``nnx.split``), and the Variables the call
  writes (BatchNorm statistics, ``Rngs`` streams, counters, caches, new
  Variables) are written back into the caller's objects, eagerly and under
  ``nnx.jit``/``nnx.grad``. A Variable ``fun`` writes through a closure, or
  a Python attribute it sets, is a ``ValueError``, not a dropped write.

  With ``matmul="float8"`` (or a :class:`Float8Matmul`), every
  ``dot_general`` with two real floating operands of 16 bits or more
  (float64 too: autocast casts all float32-or-wider work) that the
  recipe does not keep (as below) runs in float8 with current per-tensor
  scaling (forward ``float8_e4m3fn``, output gradient
  ``float8_e5m2``, float32 accumulation, a ``custom_vjp`` per matmul; see
  :class:`Float8Matmul`), its result in ``compute_dtype`` (or the wider
  result type the function asked for). Everything else follows the lists;
  convolutions stay in ``compute_dtype``. A float8 function can be
  differentiated in reverse mode (``grad``, ``vjp``), not forward mode
  (``jvp``). With ``matmul="mxfp8"`` or ``"nvfp4"`` (or an
  :class:`MXFP8Matmul`/:class:`NVFP4Matmul`) every such matmul that the
  recipe does not keep (by structure, its ``keep``: the output layer, an
  embedding's; or by module path, its ``exclude``) runs block-scaled, each
  of its three GEMMs quantising its operands along its own contraction. A
  recipe applies to a weight's matmul however it is written (``@``,
  ``einsum``, ``dot_general``, Flax layers, a ``vmap`` over transformed
  expert weights); attention's (a batched product of two values ``fun``
  computed from matmuls or from a common input) only where the recipe's
  ``attention`` is on. :func:`list_matmuls` says which matmul runs in what,
  and why one was kept.

  Args:
    fun: the function, written for float32.
    compute_dtype: the half dtype (default: :func:`default_half_dtype`);
      not a float8 dtype (use ``matmul``).
    allow, deny, infer, clear: primitive names (see the module lists
      ``ALLOW_LIST`` …); pass modified sets to override. A primitive in no
      list runs in float32.
    matmul: ``None`` (matmuls in ``compute_dtype``), ``"float8"``,
      ``"mxfp8"``, ``"nvfp4"``, or a :class:`Float8Matmul`,
      :class:`MXFP8Matmul` or :class:`NVFP4Matmul`.

  Raises:
    ValueError: a bad ``compute_dtype`` or ``matmul``, or a primitive in two
      lists.
    NotImplementedError: (when called) a higher-order primitive autocast
      cannot rewrite, named in the message.

  Example:
    >>> import jax, jax.numpy as jnp, optax_lossscale as ols
    >>> f = lambda w, x: jnp.sum(jnp.exp(jnp.tanh(x @ w) @ w.T))
    >>> g = ols.autocast(f, compute_dtype=jnp.float16)
    >>> found = ols.list_matmuls(g, jnp.ones((3, 2)), jnp.ones((4, 3)))
    >>> [(m.precision, m.out_dtype) for m in found]
    [('float16', 'float16'), ('float16', 'float32')]

    The first matmul feeds ``tanh`` and another matmul: half. The second is
    read by ``exp`` alone: float32 from its half inputs.
  """
  half = _dtypes.default_half_dtype() if compute_dtype is None else compute_dtype
  rules = Rules(half, allow, deny, infer, clear, matmul)
  # Compiled once per input signature (as jax.jit does), so that calls
  # outside jit neither rewrite nor compile the function again; under an
  # outer jit the call is traced into it.
  cached = jax.jit(_named_call(fun, rules), static_argnums=0)

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    return _call(fun, rules, cached, args, kwargs)

  wrapped.compute_dtype = rules.half
  wrapped.matmul = rules.float8
  wrapped._autocast = (fun, rules)
  return wrapped


def prepare(fun, args, kwargs):
  """``(nodes, spec, arrays)``: the NNX graph nodes of the call (or None),
  what :func:`rewritten` takes static, and the leaves it traces."""
  nodes = _autocast_state.find(fun, (args, kwargs))
  if nodes is None:
    graphdef, tree = None, (args, kwargs)
  else:
    graphdef, state = nodes.split()
    tree = (nodes.tree, state)
  flat, treedef = jax.tree.flatten(tree)
  static = tuple((i, x) for i, x in enumerate(flat) if _is_static(x))
  arrays = [x for x in flat if not _is_static(x)]
  # Each constant's type too, as jax.jit keeps static arguments apart: 1,
  # True and 1.0 are equal, and hash alike, but are other signatures.
  types = tuple(type(x) for _, x in static)
  owner = getattr(nodes, "owner", None)
  return nodes, (static, treedef, graphdef, owner, types), arrays


def _call(fun, rules: Rules, cached, args, kwargs):
  """``fun(*args, **kwargs)`` rewritten, the Variables it wrote carried back."""
  nodes, spec, arrays = prepare(fun, args, kwargs)
  try:
    hash(spec)
  except TypeError:  # an unhashable static leaf: rewritten on every call

    def cached(_, *arrays):
      call = _named_call(fun, rules, spec)
      # traced (under an outer autocast, or jit): a named call it finds
      traced = any(isinstance(x, jax.core.Tracer) for x in arrays)
      return (jax.jit(call) if traced else call)(*arrays)

  try:
    out = cached(spec, *arrays)
  except Exception as e:
    better = _autocast_state.nnx_error(e)
    if better is None:
      raise
    raise better from e
  if nodes is None:
    return out
  out, state_after, graphdef_after = out
  nodes.write_back(graphdef_after.value, state_after)
  return out


def _warn_unmatched(fun, recipe, roles: dict) -> None:
  """A warning for each ``exclude`` pattern that matches no matmul of ``fun``."""
  exclude = getattr(recipe, "exclude", ())
  if callable(exclude) or not exclude or not roles:
    return
  paths = sorted({m.path for m in roles.values()})
  for p in exclude:
    if not any(re.search(p, path) for path in paths):
      warnings.warn(
        f"autocast({getattr(fun, '__name__', fun)!r}): the {recipe.fmt} recipe's "
        f"exclude pattern {p!r} matches none of its matmuls, which run in the "
        f"recipe; their module paths are {paths} (Flax NNX, Equinox and plain JAX "
        "name none). Keep the output layer and embeddings by structure with "
        "keep=('output', 'embedding'), and check with ols.list_matmuls.",
        UserWarning,
        stacklevel=4,
      )


def _named_call(fun, rules: Rules, *spec):
  """:func:`rewritten` of ``fun`` (``spec`` given, or its first argument),
  named ``AUTOCAST_CALL`` so that, jitted, an autocast function that calls
  this one finds it (the innermost decides). A function, not a
  ``functools.partial``, whose name JAX 0.4 does not record."""

  def call(*args):
    return rewritten(fun, rules, *spec, *args)

  call.__name__ = call.__qualname__ = AUTOCAST_CALL
  return call


def rewritten(fun, rules: Rules, spec, *arrays, record: dict | None = None):
  """``fun`` on the array leaves, its jaxpr evaluated by the rules.

  With graph nodes (``spec``'s graph), returns ``(fun's output, their state
  after the call, their graph after it)``. ``record``: where a listing
  collects the matmuls' decisions (:func:`~optax_lossscale.list_matmuls`).
  """
  static, treedef, graphdef, owner, _ = spec

  def flat_fun(*leaves):
    tree = jax.tree.unflatten(treedef, _merge(static, leaves))
    if graphdef is None:
      a, k = tree
      return fun(*a, **k)
    holed, state = tree
    merged = _autocast_state.Nodes.merge(graphdef, state)
    a, k = _autocast_state.Nodes.fill(holed, merged)
    out = _autocast_state.bound(fun, owner, merged)(*a, **k)
    graphdef_after, state_after = sys.modules["flax.nnx"].split(merged)
    return out, state_after, _autocast_state.Static(graphdef_after)

  closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*arrays)
  # The roles decide a recipe's matmuls and a listing's kinds; a run with
  # neither needs no whole-function analysis.
  wanted = rules.float8 is not None or record is not None
  roles = _autocast_roles.find(closed.jaxpr) if wanted else {}
  _warn_unmatched(fun, rules.float8, roles)
  walk = _autocast_eval.Walk(rules, record=record, roles=roles)
  outs = _autocast_eval.evaluate(closed.jaxpr, closed.consts, arrays, walk)
  outs = [
    cast(x, s.dtype) if is_float(x.dtype) and is_float(s.dtype) else x
    for x, s in zip(outs, jax.tree.leaves(out_shape), strict=True)
  ]
  return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
