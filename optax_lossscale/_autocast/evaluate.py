"""autocast's evaluator: a traced function's jaxpr evaluated under the rules.

Each equation runs as :mod:`~optax_lossscale._autocast.transform` describes: calls,
checkpoints, loops and branches are rewritten inside, custom-derivative
calls keep their rules, and every other primitive casts its real floating
inputs by its list (:func:`_first_order`); matmuls go through
:func:`_matmul`, which also notes each one's decision where a listing
(:func:`~optax_lossscale.list_matmuls`) asks for them.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from optax_lossscale._autocast.rules import (
  AS_WRITTEN,
  AUTOCAST_CALL,
  CUSTOM_CALLS,
  Rules,
  float32_results,
  in_float32,
  is_float,
  moved_inputs,
)
from optax_lossscale._base import jaxpr as _jaxpr
from optax_lossscale._base.jaxpr import ClosedJaxpr, Jaxpr, Literal
from optax_lossscale._lowbit import block_matmul as _block_matmul
from optax_lossscale._lowbit import float8 as _float8

__all__ = ["Walk", "cast", "evaluate", "literal"]

_F32 = jnp.dtype(jnp.float32)


def _follower(var, val) -> bool:
  """A literal, a weakly-typed value or a 0-d scalar: it follows the others."""
  if isinstance(var, Literal):
    return True
  aval = getattr(var, "aval", None)
  return bool(getattr(aval, "weak_type", False)) or getattr(val, "ndim", 1) == 0


def cast(x, dtype):
  return x if x.dtype == dtype else lax.convert_element_type(x, dtype)


def literal(var: Literal):
  """A literal's value as an array of its type.

  A jaxpr's literal holds a Python or NumPy scalar (a constant ``True`` is
  Python's ``bool``, without a dtype); its type is the literal's ``aval``,
  weak type included (a Python number the function returns).
  """
  x = jnp.asarray(var.val)
  if x.dtype != var.aval.dtype:
    x = jnp.asarray(var.val, var.aval.dtype)
  return x


def _match(values, dtypes):
  return [
    cast(x, d) if is_float(x.dtype) else x for x, d in zip(values, dtypes, strict=True)
  ]


@dataclasses.dataclass(frozen=True)
class Walk:
  """What the rewrite of one function carries down its jaxprs, passed to
  every equation (no global state: two rewrites in two threads are
  independent).

  Attributes:
    rules: the lists, the half dtype and the matmul recipe.
    scope: ``(name stack, equation id)`` of the equations being rewritten,
      outermost first: a matmul's module path is their name stacks joined
      (a sub-jaxpr's are relative).
    record: where a listing collects the matmuls' decisions, keyed by their
      scope's equations; ``None`` outside a listing.
    roles: each matmul's kind and structural role in the whole function
      (:func:`~optax_lossscale._autocast.roles.find`), keyed likewise.
  """

  rules: Rules
  scope: tuple[tuple[str, int], ...] = ()
  record: dict | None = None
  roles: dict = dataclasses.field(default_factory=dict)

  @property
  def key(self) -> tuple:
    return tuple(i for _, i in self.scope)

  def inside(self, eqn) -> Walk:
    """This walk inside ``eqn``."""
    entry = (str(eqn.source_info.name_stack), id(eqn))
    return dataclasses.replace(self, scope=(*self.scope, entry))

  @property
  def module_path(self) -> str:
    return "/".join(s for s, _ in self.scope if s)


def evaluate(
  jaxpr: Jaxpr,
  consts: Iterable[Any],
  args: Iterable[Any],
  walk: Walk,
  out_float32: Iterable[bool] | None = None,
  inputs: Iterable[bool] | None = None,
):
  """The rewritten values of ``jaxpr``'s outputs.

  ``out_float32`` says, per output, whether whoever reads it reads it in
  float32 (from the enclosing jaxpr's :func:`float32_results`); the
  function's own outputs are not (they come back in ``fun``'s dtypes).
  ``inputs`` says, per invar, whether it holds the function's inputs moved
  only (:func:`moved_inputs`; default: all do, as a function's arguments).
  """
  if out_float32 is None:
    out_float32 = [False] * len(jaxpr.outvars)
  if inputs is None:
    inputs = [True] * len(jaxpr.invars)
  float32 = float32_results(jaxpr, out_float32, walk.rules)
  moved = moved_inputs(jaxpr, inputs)

  def eval_eqn(eqn, invals):
    invals = [
      literal(v) if isinstance(v, Literal) else jnp.asarray(x)
      for v, x in zip(eqn.invars, invals, strict=True)
    ]
    return _eval_eqn(eqn, invals, walk.inside(eqn), float32, moved)

  return _arrays(jaxpr, _jaxpr.evaluate(jaxpr, consts, args, eval_eqn))


def _arrays(jaxpr: Jaxpr, outs: list) -> list:
  """``jaxpr``'s output values, each an array of its type.

  A constant output is a literal, a closed-over constant or a passed input
  may be a NumPy value: the loops, branches and the function's boundary
  read their dtypes.
  """
  return [
    literal(v) if isinstance(v, Literal) else jnp.asarray(x)
    for v, x in zip(jaxpr.outvars, outs, strict=True)
  ]


def _eval_eqn(eqn, invals, walk: Walk, float32: dict, moved: set):
  name = eqn.primitive.name
  params = eqn.params
  flags = [isinstance(v, Literal) or v in moved for v in eqn.invars]
  body = _jaxpr.call_body(eqn)
  outs_float32 = [in_float32(float32, v) for v in eqn.outvars]
  if body is not None and params.get("name") == AUTOCAST_CALL:
    return _inner_autocast(eqn, body, invals, walk, outs_float32, flags)
  if body is not None:
    return evaluate(*body, invals, walk, outs_float32, flags)
  if name in CUSTOM_CALLS:
    return _custom_call(eqn, invals, walk, outs_float32, flags)
  if name in ("remat", "remat2", "checkpoint"):
    sub, consts = _jaxpr.closed(params["jaxpr"])
    body = jax.checkpoint(
      lambda *a: evaluate(sub, consts, a, walk, outs_float32, flags),
      prevent_cse=params.get("prevent_cse", True),
      policy=params.get("policy"),
    )
    return body(*invals)
  if name == "scan":
    return _scan(eqn, invals, walk, flags)
  if name == "while":
    return _while(eqn, invals, walk, flags)
  if name == "cond":
    return _cond(eqn, invals, walk, flags)
  if _combines(name):
    # A first-order primitive whose jaxpr only combines scalars of its
    # operands' dtypes: run in the dtypes the function wrote.
    return _jaxpr.bind(eqn, _match(invals, [v.aval.dtype for v in eqn.invars]))
  if any(isinstance(p, (Jaxpr, ClosedJaxpr)) for p in params.values()):
    raise NotImplementedError(
      f"autocast does not support the primitive {name!r} (it holds a jaxpr that "
      "autocast cannot rewrite); call it outside the autocast function."
    )
  if walk.rules.kind(name) == "allow":
    return _allow(eqn, invals, walk, all(outs_float32), flags)
  if name == "dot_general":  # a matmul the lists keep as written
    dtypes = dict.fromkeys(jnp.dtype(v.aval.dtype).name for v in eqn.invars)
    _note(eqn, flags, None, "/".join(dtypes), eqn.outvars[0].aval.dtype, walk)
  return _first_order(eqn, invals, walk.rules)


def _inner_autocast(eqn, body, invals, walk: Walk, outs_float32, flags):
  """An autocast function called inside this one: it decided for its own
  matmuls (the innermost decides, as nested autocast regions do in
  PyTorch), so it runs as it rewrote itself; a listing lists its matmuls as
  they run, ``kept`` ``"inner autocast"``."""
  invals = _match(invals, [v.aval.dtype for v in eqn.invars])
  if walk.record is None:
    return _jaxpr.bind(eqn, invals)
  before = set(walk.record)
  as_written = dataclasses.replace(walk, rules=AS_WRITTEN)
  outs = evaluate(*body, invals, as_written, outs_float32, flags)
  for key in set(walk.record) - before:
    walk.record[key]["kept"] = "inner autocast"
  return outs


def _combines(name: str) -> bool:
  """Whether primitive ``name`` holds a jaxpr that combines two scalars of
  its operands' dtype (scatter-add's ``update_jaxpr``, ``lax.reduce``'s and
  ``lax.reduce_window``'s computation), not a body to rewrite."""
  return name.startswith("scatter") or name in ("reduce", "reduce_window")


def _custom_call(eqn, invals, walk: Walk, outs_float32: list[bool], flags):
  """A ``custom_jvp``/``custom_vjp`` call: its primal rewritten, its rule kept.

  The call runs with its inputs in the dtypes the function gave them and
  its body replaced by the rewritten body (cast back to the original output
  dtypes at its end), so differentiation still goes through the user's own
  rule, in the dtypes it was written for. Differentiated, JAX runs that rule
  and not the body: where the rewrite changed a matmul of the body, a
  warning says so (the rule's matmuls run as written under ``jax.grad``).
  """
  key = next(k for k in ("call_jaxpr", "fun_jaxpr", "jaxpr") if k in eqn.params)
  sub, consts = _jaxpr.closed(eqn.params[key])

  def body(*args):
    outs = evaluate(sub, consts, args, walk, outs_float32, flags)
    return _match(outs, [v.aval.dtype for v in sub.outvars])

  avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in sub.invars]
  rewritten = jax.make_jaxpr(body)(*avals)
  if walk.record is None and _matmul_dtypes(sub) != _matmul_dtypes(rewritten.jaxpr):
    kind = "custom_vjp" if "vjp" in eqn.primitive.name else "custom_jvp"
    name = _custom_name(eqn)
    warnings.warn(
      f"autocast rewrote the matmuls of the {kind} function {name}, but a "
      "differentiated call (jax.grad, jax.value_and_grad, a training step) "
      f"runs its own {'fwd and bwd rules' if kind == 'custom_vjp' else 'jvp rule'}"
      ", which autocast does not rewrite: there its matmuls run in the dtypes "
      "it wrote, and its value can differ from an undifferentiated call's. "
      "To run them in the compute dtype, write the rules so (or autocast "
      "them, casting their outputs back to the function's dtypes), then "
      "ignore this warning: warnings.filterwarnings('ignore', "
      "category=ols.CustomRuleWarning).",
      CustomRuleWarning,
      stacklevel=2,
    )
  invals = _match(invals, [v.aval.dtype for v in eqn.invars])
  return _jaxpr.bind(eqn, invals, {key: rewritten})


class CustomRuleWarning(UserWarning):
  """:func:`~optax_lossscale.autocast` rewrote the matmuls of a
  ``custom_vjp``/``custom_jvp`` function's body, whose derivative rules JAX
  runs instead under differentiation, as written (not rewritten)."""


def _custom_name(eqn) -> str:
  """The name of the function a custom call wraps, as JAX recorded it."""
  for key in ("call_jaxpr", "fun_jaxpr"):
    info = getattr(getattr(eqn.params.get(key), "jaxpr", None), "debug_info", None)
    name = getattr(info, "func_name", None) or getattr(info, "func_src_info", None)
    if name:
      return repr(str(name).split(" ")[0])
  return "(unnamed)"


def _matmul_dtypes(jaxpr) -> list:
  """Each ``dot_general``'s operand dtypes, in ``jaxpr`` and the jaxprs it holds."""
  out = []
  for e in jaxpr.eqns:
    if e.primitive.name == "dot_general":
      out.append(tuple(jnp.dtype(v.aval.dtype) for v in e.invars))
    for value in e.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, (Jaxpr, ClosedJaxpr)):
          out += _matmul_dtypes(_jaxpr.closed(sub)[0])
  return out


def _allow(eqn, invals, walk: Walk, read_in_float32: bool, flags: list[bool]):
  """An allow-list primitive (a matmul, a convolution): in the half dtype, a
  recipe, or as the function wrote it.

  Only float32 (or wider) work is cast: a product one of whose operands the
  function put in a narrower dtype itself keeps its operands and result
  type; a result type the function set narrower than its operands
  (``preferred_element_type=bfloat16``) is kept, its float32 operands cast
  to the half dtype. Otherwise the result is half, or float32 where every
  reader reads float32 (attention's logits before the softmax; its
  derivatives products in bfloat16 or float32, :func:`_derivatives_in`). A recipe
  (``matmul=``) runs every ``dot_general`` of real operands of 16 bits or more
  it does not keep, its result in the dtype just chosen: kept by structural
  role or module path (:func:`_block_matmul.kept`), or (where the recipe's
  ``attention`` is off) by being attention's
  (:mod:`~optax_lossscale._autocast.roles`).
  """
  half = walk.rules.half
  original = [jnp.dtype(v.aval.dtype) for v in eqn.invars]
  floating = [d for d in original if is_float(d)]
  matmul = eqn.primitive.name == "dot_general"
  complex_ = any(jnp.issubdtype(d, jnp.complexfloating) for d in original)
  if not floating or complex_ or (matmul and len(floating) < len(original)):
    if matmul:  # listed as written (the listing of a plain function does so)
      dtypes = "/".join(dict.fromkeys(d.name for d in original))
      _note(eqn, flags, None, dtypes, eqn.outvars[0].aval.dtype, walk)
    return _jaxpr.bind(eqn, invals)  # complex, integer, boolean: as written
  pet = eqn.params.get("preferred_element_type")
  sizes = [d.itemsize for d in floating]
  params = {}
  if min(sizes) < 4:  # the function's own narrow operands: as written
    targets = original
    precision = "/".join(dict.fromkeys(d.name for d in floating))
  else:
    targets = [jnp.dtype(half) if is_float(d) else d for d in original]
    precision = jnp.dtype(half).name
    default = pet is None or not is_float(pet) or jnp.dtype(pet).itemsize == max(sizes)
    if default:
      params["preferred_element_type"] = half
      if read_in_float32 and "preferred_element_type" in eqn.params:
        # Every reader converts to float32 anyway: accumulate and return
        # float32, so no half result exists to overflow.
        params["preferred_element_type"] = _F32
  if "preferred_element_type" not in eqn.params:
    params = {}
  given, invals = invals, [cast(x, d) for x, d in zip(invals, targets, strict=True)]
  plain = _jaxpr.bind
  if params.get("preferred_element_type") == _F32 and precision == jnp.dtype(half).name:
    # bfloat16 has float32's range: its backward products lose precision
    # only; float16's would lose an output layer's small gradients.
    wide = jnp.finfo(half).minexp > jnp.finfo(_F32).minexp
    plain = functools.partial(_derivatives_in, dtype=_F32 if wide else jnp.dtype(half))
  if not matmul:
    return plain(eqn, invals, params)
  out_dtype = params.get("preferred_element_type", pet) or eqn.outvars[0].aval.dtype
  dims = eqn.params["dimension_numbers"]
  recipe, why = _recipe(
    walk.rules.float8,
    walk,
    _kind(eqn, flags, walk),
    _float8.device_dims(*invals, dims),
  )
  recipe = recipe if min(sizes) >= 2 else None
  # A recipe quantises the operands as the matmul receives them, not their
  # copies in the compute dtype: a float32 weight or activation from
  # float32 (its scale from its own amax), its gradient float32, accumulated
  # in float32. Measured against quantising the copies: no less accurate
  # (docs/results/quantize_source.txt).
  operands = given if min(sizes) >= 4 else invals
  _note(eqn, flags, recipe, precision, out_dtype, walk, why, operands)
  sharding = eqn.params.get("out_sharding")
  if recipe is None:
    return plain(eqn, invals, params)
  dot = _float8.dot_general
  if not isinstance(recipe, _float8.Float8Matmul):
    dot = _block_matmul.dot_general
  return [dot(*operands, dims, out_dtype, recipe, out_sharding=sharding)]


def _derivatives_in(eqn, invals, params, *, dtype):
  """A product of half operands with a float32 result whose derivatives are
  products in ``dtype``: ``eqn`` bound with ``params`` (a float32
  ``preferred_element_type``), its tangent (and so, transposed, its
  cotangent) computed from operands in ``dtype`` with the result type
  ``dtype``.

  JAX's own rule multiplies the float32 cotangent by the half operand:
  in float32 (on GPUs two float32 GEMMs a matmul in the backward pass), or,
  for a convolution on older JAX, not at all (it refuses mixed dtypes).
  ``dtype`` half (bfloat16, with float32's range): the cotangent is rounded
  to it once and both backward products run in it with float32
  accumulation, as every other matmul of the compute dtype does. ``dtype``
  float32 (float16, whose range would lose the softmax's share of an output
  layer's gradient, about 1 / (vocabulary x tokens), without a loss scale):
  float32 products, as JAX's rule where it runs. The product is bilinear in
  its two floating operands (matmuls, convolutions), which the tangent uses.
  """
  floats = [i for i, x in enumerate(invals) if is_float(x.dtype)]
  if len(floats) != 2:
    return _jaxpr.bind(eqn, invals, params)
  tangent_params = dict(params, preferred_element_type=dtype)

  @jax.custom_jvp
  def product(*xs):
    return _jaxpr.bind(eqn, list(xs), params)[0]

  def jvp(primals, tangents):
    # The primal a plain product: differentiated, a dot_general to remat
    # policies (``dots_saveable``), as JAX's own rule leaves it.
    out = _jaxpr.bind(eqn, list(primals), params)[0]
    terms = []
    for i in floats:
      if isinstance(tangents[i], SymbolicZero):
        continue
      xs = [cast(x, dtype) if j in floats else x for j, x in enumerate(primals)]
      xs[i] = cast(tangents[i], dtype)
      terms.append(cast(_jaxpr.bind(eqn, xs, tangent_params)[0], out.dtype))
    if not terms:
      return out, jnp.zeros_like(out)
    return out, functools.reduce(jnp.add, terms)

  product.defjvp(jvp, symbolic_zeros=True)
  return [product(*invals)]


def _recipe(recipe, walk: Walk, kind: str, dims: tuple[int, int, int]):
  """``(the recipe a matmul runs in, why not)``: ``(None, reason)`` keeps it
  in the dtypes just chosen, the reason :func:`_block_matmul.kept`'s (given
  the matmul's ``(M, K, N)``, ``dims``) or ``"attention"``; ``(None, None)``
  without a recipe."""
  if recipe is None:
    return None, None
  if kind == "attention" and not recipe.attention:
    return None, "attention"
  found = walk.roles.get(walk.key)
  roles = found.roles if found else ()
  why = _block_matmul.kept(recipe, walk.module_path, roles, dims)
  return (None, why) if why is not None else (recipe, None)


def _kind(eqn, flags: list[bool], walk: Walk) -> str:
  """``"attention"`` or ``"weight"``, by the function's structure
  (:mod:`~optax_lossscale._autocast.roles`); without it, a batched product
  of two values the function computed (not inputs) is attention's."""
  found = walk.roles.get(walk.key)
  if found is not None:
    return found.kind
  batched = bool(eqn.params["dimension_numbers"][1][0])
  return "attention" if batched and not any(flags) else "weight"


def _note(
  eqn, flags, recipe, precision: str, out_dtype, walk: Walk, why=None, operands=()
) -> None:
  """A listing's record of this matmul (once per equation, however often
  its body is traced)."""
  found = walk.record
  if found is None:
    return
  found.setdefault(
    tuple(i for _, i in walk.scope),
    {
      "path": walk.module_path,
      "kind": _kind(eqn, flags, walk),
      "lhs_shape": tuple(eqn.invars[0].aval.shape),
      "rhs_shape": tuple(eqn.invars[1].aval.shape),
      "out_shape": tuple(eqn.outvars[0].aval.shape),
      "precision": precision if recipe is None else recipe.fmt,
      "out_dtype": jnp.dtype(out_dtype).name,
      "kept": why,
      "quantized_from": None
      if recipe is None
      else tuple(jnp.dtype(x.dtype).name for x in operands),
    },
  )


def _first_order(eqn, invals, rules: Rules):
  name = eqn.primitive.name
  kind = rules.kind(name)
  if name == "mul" and eqn.invars[0] is eqn.invars[1]:
    kind = rules.kind("square")  # x * x is square(x), and x ** 2: one rule
  half = rules.half
  original = [v.aval.dtype for v in eqn.invars]
  floating = [i for i, d in enumerate(original) if is_float(d)]
  if not floating or name == "convert_element_type":
    # No real floating input (complex, integer, boolean, keys): as written.
    # A conversion the function writes keeps its target dtype.
    return _jaxpr.bind(eqn, invals)
  if kind == "allow":
    targets = {i: half for i in floating if jnp.dtype(original[i]).itemsize >= 4}
  elif kind == "deny":
    targets = {i: original[i] for i in floating}
  else:  # infer and clear: half only if every (non-follower) float input is
    leaders = [i for i in floating if not _follower(eqn.invars[i], invals[i])]
    if kind == "clear" and len(leaders) <= 1 and len(floating) <= 1:
      targets = {}
    else:
      all_half = bool(leaders) and all(invals[i].dtype == half for i in leaders)
      targets = {i: (half if all_half else original[i]) for i in floating}
  done: dict[tuple[int, Any], Any] = {}  # one conversion per value and dtype

  def cast_once(x, dtype):
    if (id(x), dtype) not in done:
      done[id(x), dtype] = cast(x, dtype)
    return done[id(x), dtype]

  invals = [
    cast_once(x, targets[i]) if i in targets else x for i, x in enumerate(invals)
  ]
  return _jaxpr.bind(eqn, invals)


def _scan(eqn, invals, walk, flags):
  p = eqn.params
  sub, consts = _jaxpr.closed(p["jaxpr"])
  nc, ncarry = _jaxpr.scan_counts(p)
  cvals, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
  carry_dtypes = [x.dtype for x in init]
  inputs = [*flags[:nc], *[False] * ncarry, *flags[nc + ncarry :]]

  def body(carry, x):
    outs = evaluate(sub, consts, [*cvals, *carry, *x], walk, None, inputs)
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


def _while(eqn, invals, walk, flags):
  p = eqn.params
  cj, cconsts = _jaxpr.closed(p["cond_jaxpr"])
  bj, bconsts = _jaxpr.closed(p["body_jaxpr"])
  nc, nb = p["cond_nconsts"], p["body_nconsts"]
  cvals, bvals, init = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
  dtypes = [x.dtype for x in init]
  n = len(init)

  cflags = [*flags[:nc], *[False] * n]
  bflags = [*flags[nc : nc + nb], *[False] * n]

  def cond_fun(carry):
    return evaluate(cj, cconsts, [*cvals, *carry], walk, None, cflags)[0]

  def body_fun(carry):
    outs = evaluate(bj, bconsts, [*bvals, *carry], walk, None, bflags)
    return tuple(_match(outs, dtypes))

  return list(lax.while_loop(cond_fun, body_fun, tuple(init)))


def _cond(eqn, invals, walk, flags):
  """A ``cond``/``switch``: each branch rewritten once (its jaxpr traced
  once, so nested branches cost a trace each, not two per level), then the
  rewritten branches bound under ``lax.switch``, each output in the widest
  dtype any branch gives it."""
  index, ops = invals[0], invals[1:]
  flags = flags[1:]
  rewritten = [
    jax.make_jaxpr(lambda *o, b=b: evaluate(b[0], b[1], o, walk, None, flags))(*ops)
    for b in map(_jaxpr.closed, eqn.params["branches"])
  ]
  dtypes = [
    max((r.out_avals[i].dtype for r in rewritten), key=lambda d: jnp.dtype(d).itemsize)
    for i in range(len(rewritten[0].out_avals))
  ]

  def bound(r, *o):
    outs = _arrays(r.jaxpr, _jaxpr.evaluate(r.jaxpr, r.consts, o, _jaxpr.bind))
    return tuple(_match(outs, dtypes))

  fns = [lambda *o, r=r: bound(r, *o) for r in rewritten]
  return list(lax.switch(index, fns, *ops))
