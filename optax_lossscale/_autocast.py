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
The lists live in ``_autocast_lists``. A matmul whose result is only ever
read in float32 (its consumers, through the ops that follow their inputs'
dtype, are deny-list ops or conversions to float32: attention's logits
before the softmax) accumulates and returns float32 itself
(``_autocast_rules.float32_results``), so that no half intermediate exists to
overflow.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_lossscale import _block_matmul, _dtypes, _float8, _jaxpr
from optax_lossscale._autocast_lists import (
  ALLOW_LIST,
  CLEAR_LIST,
  DENY_LIST,
  INFER_LIST,
)
from optax_lossscale._autocast_rules import (
  CUSTOM_CALLS,
  Rules,
  float32_results,
  in_float32,
  is_float,
)
from optax_lossscale._jaxpr import ClosedJaxpr, Jaxpr, Literal


def _is_static(x: Any) -> bool:
  """A leaf passed as it is, not traced: a bool, a string, any non-number.

  ``jax.jit`` would need ``static_argnums`` for these (a Flax
  ``apply(..., train=True)``); Python ints, floats and complex numbers are
  traced, weakly typed, as ``jax.jit`` traces them.
  """
  if isinstance(x, bool):
    return True
  return not isinstance(x, (int, float, complex, jax.Array, np.ndarray, np.generic))


def _merge(static: tuple, arrays: Any) -> list:
  """The flat leaves: ``static`` ``(index, value)`` pairs placed among ``arrays``."""
  out = list(arrays)
  for i, x in static:
    out.insert(i, x)
  return out


def _follower(var, val) -> bool:
  """A literal, a weakly-typed value or a 0-d scalar: it follows the others."""
  if isinstance(var, Literal):
    return True
  aval = getattr(var, "aval", None)
  return bool(getattr(aval, "weak_type", False)) or getattr(val, "ndim", 1) == 0


def _cast(x, dtype):
  return x if x.dtype == dtype else lax.convert_element_type(x, dtype)


def _eval(
  jaxpr: Jaxpr,
  consts: Iterable[Any],
  args: Iterable[Any],
  rules: Rules,
  out_float32: Iterable[bool] | None = None,
):
  """The rewritten values of ``jaxpr``'s outputs.

  ``out_float32`` says, per output, whether whoever reads it reads it in
  float32 (from the enclosing jaxpr's :func:`float32_results`); the
  function's own outputs are not (they come back in ``fun``'s dtypes).
  """
  if out_float32 is None:
    out_float32 = [False] * len(jaxpr.outvars)
  float32 = float32_results(jaxpr, out_float32, rules)

  def eval_eqn(eqn, invals):
    return _eval_eqn(eqn, [jnp.asarray(x) for x in invals], rules, float32)

  return _jaxpr.evaluate(jaxpr, consts, args, eval_eqn)


#: The name stacks of the equations being rewritten, outermost first: a
#: matmul's module path is theirs joined (a sub-jaxpr's are relative).
_SCOPE: list[str] = []


def _module_path() -> str:
  return "/".join(s for s in _SCOPE if s)


def _eval_eqn(eqn, invals, rules: Rules, float32: dict):
  _SCOPE.append(str(eqn.source_info.name_stack))
  try:
    return _eval_eqn_in_scope(eqn, invals, rules, float32)
  finally:
    _SCOPE.pop()


def _eval_eqn_in_scope(eqn, invals, rules: Rules, float32: dict):
  name = eqn.primitive.name
  params = eqn.params
  body = _jaxpr.call_body(eqn)
  outs_float32 = [in_float32(float32, v) for v in eqn.outvars]
  if body is not None:
    return _eval(*body, invals, rules, outs_float32)
  if name in CUSTOM_CALLS:
    return _custom_call(eqn, invals, rules, outs_float32)
  if name in ("remat", "remat2", "checkpoint"):
    sub, consts = _jaxpr.closed(params["jaxpr"])
    body = jax.checkpoint(
      lambda *a: _eval(sub, consts, a, rules, outs_float32),
      prevent_cse=params.get("prevent_cse", True),
      policy=params.get("policy"),
    )
    return body(*invals)
  if name == "scan":
    return _scan(eqn, invals, rules)
  if name == "while":
    return _while(eqn, invals, rules)
  if name == "cond":
    return _cond(eqn, invals, rules)
  if any(isinstance(p, (Jaxpr, ClosedJaxpr)) for p in params.values()):
    raise NotImplementedError(
      f"autocast does not support the primitive {name!r} (it holds a jaxpr that "
      "autocast cannot rewrite); call it outside the autocast function."
    )
  return _first_order(eqn, invals, rules, all(outs_float32))


def _custom_call(eqn, invals, rules: Rules, outs_float32: list[bool]):
  """A ``custom_jvp``/``custom_vjp`` call: its primal rewritten, its rule kept.

  The call runs with its inputs in the dtypes the function gave them and
  its body replaced by the rewritten body (cast back to the original output
  dtypes at its end), so differentiation still goes through the user's own
  rule, in the dtypes it was written for.
  """
  key = next(k for k in ("call_jaxpr", "fun_jaxpr", "jaxpr") if k in eqn.params)
  sub, consts = _jaxpr.closed(eqn.params[key])

  def body(*args):
    outs = _eval(sub, consts, args, rules, outs_float32)
    return _match(outs, [v.aval.dtype for v in sub.outvars])

  avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in sub.invars]
  rewritten = jax.make_jaxpr(body)(*avals)
  invals = _match(invals, [v.aval.dtype for v in eqn.invars])
  return _jaxpr.bind(eqn, invals, {key: rewritten})


def _first_order(eqn, invals, rules: Rules, read_in_float32: bool = False):
  name = eqn.primitive.name
  kind = rules.kind(name)
  if name == "mul" and eqn.invars[0] is eqn.invars[1]:
    kind = rules.kind("square")  # x * x is square(x), and x ** 2: one rule
  half = rules.half
  original = [v.aval.dtype for v in eqn.invars]
  floating = [i for i, x in enumerate(invals) if is_float(x.dtype)]
  params = {}

  if name == "convert_element_type":
    # A conversion the function writes keeps its target dtype.
    targets = {}
  elif kind == "allow":
    targets = {i: half for i in floating}
    pet = eqn.params.get("preferred_element_type")
    widest = max((jnp.dtype(original[i]).itemsize for i in floating), default=0)
    # A result type wider than every input is the user's own choice (a float32
    # accumulation of half inputs, as jax.nn.dot_product_attention's logits):
    # kept. Otherwise it is the default, and the result is half too.
    if pet is not None and is_float(pet) and jnp.dtype(pet).itemsize <= widest:
      params["preferred_element_type"] = half
    if read_in_float32 and "preferred_element_type" in eqn.params:
      # Every reader converts to float32 anyway: accumulate and return float32,
      # so no half result exists to overflow (attention's logits).
      f32 = jnp.dtype(jnp.float32)
      if pet is None or not is_float(pet) or jnp.dtype(pet).itemsize < 4:
        params["preferred_element_type"] = f32
      else:
        params.pop("preferred_element_type", None)
    out_dtype = params.get("preferred_element_type", pet) or half
    recipe = rules.float8
    block = recipe is not None and not isinstance(recipe, _float8.Float8Matmul)
    if name == "dot_general" and block and len(floating) == 2:
      if not _block_matmul.excluded(recipe, _module_path()):
        return [
          _block_matmul.dot_general(
            *invals,
            eqn.params["dimension_numbers"],
            out_dtype,
            recipe,
            out_sharding=eqn.params.get("out_sharding"),
          )
        ]
    elif name == "dot_general" and recipe is not None and len(floating) == 2:
      # Both operands as they come (float32 parameters are quantised from
      # float32, not from their half rounding).
      return [
        _float8.dot_general(
          *invals,
          eqn.params["dimension_numbers"],
          out_dtype,
          rules.float8,
          out_sharding=eqn.params.get("out_sharding"),
        )
      ]
  elif kind == "deny":
    targets = {i: original[i] for i in floating if is_float(original[i])}
  else:  # infer and clear: half only if every (non-follower) float input is
    leaders = [i for i in floating if not _follower(eqn.invars[i], invals[i])]
    if kind == "clear" and len(leaders) <= 1 and len(floating) <= 1:
      targets = {}
    else:
      all_half = bool(leaders) and all(invals[i].dtype == half for i in leaders)
      targets = {
        i: (half if all_half else original[i])
        for i in floating
        if is_float(original[i])
      }
  cast: dict[tuple[int, Any], Any] = {}  # one conversion per value and dtype

  def cast_once(x, dtype):
    if (id(x), dtype) not in cast:
      cast[id(x), dtype] = _cast(x, dtype)
    return cast[id(x), dtype]

  invals = [
    cast_once(x, targets[i]) if i in targets else x for i, x in enumerate(invals)
  ]
  return _jaxpr.bind(eqn, invals, params)


def _match(values, dtypes):
  return [
    _cast(x, d) if is_float(x.dtype) else x for x, d in zip(values, dtypes, strict=True)
  ]


def _scan(eqn, invals, rules):
  p = eqn.params
  sub, consts = _jaxpr.closed(p["jaxpr"])
  nc, ncarry = p["num_consts"], p["num_carry"]
  cvals, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
  carry_dtypes = [x.dtype for x in init]

  def body(carry, x):
    outs = _eval(sub, consts, [*cvals, *carry, *x], rules)
    return tuple(_match(outs[:ncarry], carry_dtypes)), tuple(outs[ncarry:])

  carry, ys = lax.scan(
    body,
    tuple(init),
    tuple(xs),
    length=p["length"],
    reverse=p["reverse"],
    unroll=p["unroll"],
  )
  return [*carry, *ys]


def _while(eqn, invals, rules):
  p = eqn.params
  cj, cconsts = _jaxpr.closed(p["cond_jaxpr"])
  bj, bconsts = _jaxpr.closed(p["body_jaxpr"])
  nc, nb = p["cond_nconsts"], p["body_nconsts"]
  cvals, bvals, init = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
  dtypes = [x.dtype for x in init]

  def cond_fun(carry):
    return _eval(cj, cconsts, [*cvals, *carry], rules)[0]

  def body_fun(carry):
    return tuple(_match(_eval(bj, bconsts, [*bvals, *carry], rules), dtypes))

  return list(lax.while_loop(cond_fun, body_fun, tuple(init)))


def _cond(eqn, invals, rules):
  index, ops = invals[0], invals[1:]
  branches = [_jaxpr.closed(b) for b in eqn.params["branches"]]
  shapes = [
    jax.eval_shape(lambda *o, b=b: _eval(b[0], b[1], o, rules), *ops) for b in branches
  ]
  # Each output in the widest dtype any branch gives it.
  dtypes = [
    max((s[i].dtype for s in shapes), key=lambda d: jnp.dtype(d).itemsize)
    for i in range(len(shapes[0]))
  ]
  fns = [
    lambda *o, b=b: tuple(_match(_eval(b[0], b[1], o, rules), dtypes)) for b in branches
  ]
  return list(lax.switch(index, fns, *ops))


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
  dtypes ``fun`` returns; integer and boolean values are never cast; its
  ``compute_dtype`` attribute is the half dtype it computes in. It
  rewrites ``fun``'s jaxpr, recursing into ``jit``, ``checkpoint``,
  ``scan``, ``while_loop`` and ``cond``; a ``custom_jvp``/``custom_vjp``
  function keeps its rule (its body is rewritten, its boundary keeps its
  dtypes). It works under ``jax.jit``, ``jax.grad`` (float32 inputs get
  float32 gradients) and ``jax.vmap``. The user's own numerics are kept: a
  conversion ``fun`` writes keeps its target dtype, and a matmul result type
  wider than its inputs stays. A matmul whose result every reader computes
  in float32 (the deny list's ``exp``, ``div``, reductions, or a conversion
  to float32, reached through the ops that follow their inputs' dtype; not
  another matmul, a loop or the function's output) reads half inputs and
  accumulates and returns float32 itself: attention's logits before the
  softmax never exist in half, so they cannot overflow. Every spelling of a
  square runs by the rule of ``square``. Literals, weakly-typed values and
  0-d scalars follow the other inputs. Arguments that are not numbers or
  arrays (bools, strings) are static; like ``jax.jit``, the result is traced
  and compiled once per input signature.

  With ``matmul="float8"`` (or a :class:`Float8Matmul`), every
  ``dot_general`` with two floating operands runs in float8 with current
  per-tensor scaling (forward ``float8_e4m3fn``, output gradient
  ``float8_e5m2``, float32 accumulation, a ``custom_vjp`` per matmul; see
  :class:`Float8Matmul`), its result in ``compute_dtype`` (or the wider
  result type the function asked for). Everything else follows the lists;
  convolutions stay in ``compute_dtype``. A float8 function can be
  differentiated in reverse mode (``grad``, ``vjp``), not forward mode
  (``jvp``). With ``matmul="mxfp8"`` or ``"nvfp4"`` (or an
  :class:`MXFP8Matmul`/:class:`NVFP4Matmul`) every such matmul that the
  recipe does not exclude (by module path) runs block-scaled, each of its
  three GEMMs quantising its operands along its own contraction.

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
    >>> jaxpr = jax.make_jaxpr(g)(jnp.ones((3, 2)), jnp.ones((4, 3)))
    >>> body = jaxpr.eqns[0].params["jaxpr"]  # the rewritten function, jitted
    >>> [(e.primitive.name, e.outvars[0].aval.dtype.name) for e in body.eqns
    ...  if e.primitive.name in ("dot_general", "exp")]
    [('dot_general', 'float16'), ('dot_general', 'float32'), ('exp', 'float32')]

    The first matmul feeds ``tanh`` and another matmul: half. The second is
    read by ``exp`` alone: float32 from its half inputs.
  """
  half = _dtypes.default_half_dtype() if compute_dtype is None else compute_dtype
  rules = Rules(half, allow, deny, infer, clear, matmul)

  def rewritten(static, treedef, *arrays):
    """``fun`` on the array leaves, its jaxpr evaluated by the rules."""

    def flat_fun(*leaves):
      a, k = jax.tree.unflatten(treedef, _merge(static, leaves))
      return fun(*a, **k)

    closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*arrays)
    outs = _eval(closed.jaxpr, closed.consts, arrays, rules)
    outs = [
      _cast(x, s.dtype) if is_float(x.dtype) and is_float(s.dtype) else x
      for x, s in zip(outs, jax.tree.leaves(out_shape), strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  # Compiled once per input signature (as jax.jit does), so that calls
  # outside jit neither rewrite nor compile the function again; under an
  # outer jit the call is traced into it.
  cached = jax.jit(rewritten, static_argnums=(0, 1))

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    flat, treedef = jax.tree.flatten((args, kwargs))
    static = tuple((i, x) for i, x in enumerate(flat) if _is_static(x))
    arrays = [x for x in flat if not _is_static(x)]
    try:
      hash(static)
    except TypeError:  # an unhashable static leaf: rewritten on every call
      return rewritten(static, treedef, *arrays)
    return cached(static, treedef, *arrays)

  wrapped.compute_dtype = rules.half
  wrapped.matmul = rules.float8
  return wrapped
