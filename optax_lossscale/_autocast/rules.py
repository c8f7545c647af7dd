"""autocast's rules: its lists checked, and the two analyses of a jaxpr they use.

:class:`Rules` holds the lists (a primitive in none of them is treated as
denied), the half dtype and the matmul recipe; :func:`float32_results` is
the backwards analysis that finds the matmuls whose results are only ever
read in float32 (attention's logits before the softmax), so they can
accumulate and return float32 themselves; :func:`moved_inputs` the forward
one that finds the values holding the function's inputs moved, not
computed, which tells a weight's matmul from attention's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp

from optax_lossscale._autocast import lists as _autocast_lists
from optax_lossscale._base import dtypes as _dtypes
from optax_lossscale._base import jaxpr as _jaxpr
from optax_lossscale._base.jaxpr import ClosedJaxpr, Jaxpr
from optax_lossscale._lowbit import float8 as _float8

__all__ = [
  "CUSTOM_CALLS",
  "MOVES",
  "Rules",
  "body",
  "float32_results",
  "in_float32",
  "is_float",
  "moved_inputs",
]

# Custom-derivative calls: their bodies are rewritten, their rules kept.
CUSTOM_CALLS = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")


def is_float(dtype) -> bool:
  """A real floating dtype: the only values autocast ever casts (never
  complex, integer, boolean or key values)."""
  return jnp.issubdtype(dtype, jnp.floating)


#: Primitives that move or convert values without computing new ones: a
#: weight read through them (a transpose, a reshape, a cast, a slice of a
#: stacked layer) is still the weight.
MOVES = _autocast_lists.LAYOUT_PRIMITIVES | frozenset(
  {"convert_element_type", "reduce_precision", "sharding_constraint", "device_put"}
)


class Rules:
  """The four lists, checked once, the half dtype and the float8 recipe."""

  def __init__(self, half, allow, deny, infer, clear, matmul=None):
    self.half = _dtypes.float_dtype(
      "compute_dtype",
      half,
      allowed=(jnp.float16, jnp.bfloat16),
      float8_hint="A float8 compute dtype would cast every operation to float8: for "
      "float8 matmuls keep a 16-bit compute dtype and pass matmul='float8' (or "
      "an ols.Float8Matmul), e.g. autocast(f, compute_dtype=jnp.bfloat16, "
      "matmul='float8').",
    )
    self.float8 = _float8.as_recipe(matmul)
    self.lists = {}
    for name, prims in (
      ("allow", allow),
      ("deny", deny),
      ("infer", infer),
      ("clear", clear),
    ):
      prims = frozenset(prims)
      if not all(isinstance(p, str) for p in prims):
        raise ValueError(
          f"`{name}` must hold primitive names (strings), got {prims!r}."
        )
      for other, seen in self.lists.items():
        both = prims & seen
        if both:
          raise ValueError(
            f"Primitive(s) {sorted(both)} are in both `{other}` and `{name}`."
          )
      self.lists[name] = prims

  def kind(self, name: str) -> str:
    for kind, prims in self.lists.items():
      if name in prims:
        return kind
    return "deny"


#: The rules of a function that is not an autocast one: every primitive as
#: written (each is denied, and a denied input keeps its dtype).
AS_WRITTEN = Rules(jnp.float16, (), (), (), ())
#: The name of the call an autocast function makes of its rewrite, by which
#: an autocast function that calls it finds it (``_inner_autocast``).
AUTOCAST_CALL = "_optax_lossscale_autocast_call"


def body(eqn) -> tuple[Jaxpr, list[Any]] | None:
  """The body of a call whose invars and outvars are the equation's, or None."""
  found = _jaxpr.call_body(eqn)
  if found is not None:
    return found
  name = eqn.primitive.name
  if name in CUSTOM_CALLS:
    key = next(k for k in ("call_jaxpr", "fun_jaxpr", "jaxpr") if k in eqn.params)
    return _jaxpr.closed(eqn.params[key])
  if name in ("remat", "remat2", "checkpoint"):
    return _jaxpr.closed(eqn.params["jaxpr"])
  return None


def float32_results(jaxpr: Jaxpr, out_float32: Iterable[bool], rules: Rules) -> dict:
  """For each variable of ``jaxpr``: is every reader of its value in float32?

  A variable is read in float32 when each of its uses is a deny-list (or
  unlisted) primitive, a conversion to float32 or wider, an infer or clear
  primitive whose own results are read in float32 (they follow their
  inputs' dtype), the input of a call whose body reads it so, or an output
  of ``jaxpr`` marked in ``out_float32``. A use by an allow-list primitive
  (another matmul: it reads half) or by a loop or branch (not analysed)
  is not. Computed backwards, uses before definitions.
  """
  verdicts: dict[Any, list[bool]] = {}

  def note(v, verdict):
    if isinstance(v, _jaxpr.Var):
      verdicts.setdefault(v, []).append(verdict)

  def read_in_float32(v):
    return all(verdicts.get(v, [True]))

  for v, wanted in zip(jaxpr.outvars, out_float32, strict=True):
    note(v, wanted)
  for eqn in reversed(jaxpr.eqns):
    name = eqn.primitive.name
    kind = rules.kind(name)
    found = body(eqn)
    if found is not None:
      inner = float32_results(
        found[0], [read_in_float32(v) for v in eqn.outvars], rules
      )
      for v, b in zip(eqn.invars, found[0].invars, strict=True):
        note(v, in_float32(inner, b))
      continue
    if name == "convert_element_type":
      target = jnp.dtype(eqn.params["new_dtype"])
      verdict = is_float(target) and target.itemsize >= 4
    elif any(isinstance(p, (Jaxpr, ClosedJaxpr)) for p in eqn.params.values()):
      verdict = False  # scan, while, cond: not analysed
    elif kind == "allow":
      verdict = False
    elif kind in ("infer", "clear"):
      verdict = all(read_in_float32(v) for v in eqn.outvars)
    else:  # deny, or unlisted: float32
      verdict = True
    for v in eqn.invars:
      note(v, verdict)
  return {v: all(vs) for v, vs in verdicts.items()}


def moved_inputs(jaxpr: Jaxpr, inputs: Iterable[bool]) -> set:
  """The variables of ``jaxpr`` that hold inputs moved, not computed.

  ``inputs`` says, per invar, whether it holds one of the function's inputs
  (its arguments and constants: parameters, data) moved only. A variable
  does when it is a constant, a literal, such an invar, or the result of a
  :data:`MOVES` primitive whose floating operands all do (through calls,
  custom-derivative calls, checkpoints and ``cond`` branches; a ``scan``'s
  constants and sliced inputs keep their verdicts, its carry and a
  ``while`` loop's do not). A matmul of two variables that do not, with
  batch dimensions, multiplies activations by activations (attention's);
  any other is a weight's.
  """
  moved = set(jaxpr.constvars)
  moved.update(v for v, m in zip(jaxpr.invars, inputs, strict=True) if m)

  def holds(v) -> bool:
    return isinstance(v, _jaxpr.Literal) or v in moved

  def held(v, found: set) -> bool:  # a sub-jaxpr's output: maybe a literal
    return isinstance(v, _jaxpr.Literal) or v in found

  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    found = body(eqn)
    outs = [False] * len(eqn.outvars)
    if found is not None:
      inner = moved_inputs(found[0], [holds(v) for v in eqn.invars])
      outs = [held(v, inner) for v in found[0].outvars]
    elif name == "cond":
      ins = [holds(v) for v in eqn.invars[1:]]
      branches = [_jaxpr.closed(b)[0] for b in eqn.params["branches"]]
      sets = [moved_inputs(b, ins) for b in branches]
      outs = [
        all(held(b.outvars[i], m) for b, m in zip(branches, sets, strict=True))
        for i in range(len(eqn.outvars))
      ]
    elif name == "scan":
      sub = _jaxpr.closed(eqn.params["jaxpr"])[0]
      nc, ncarry = _jaxpr.scan_counts(eqn.params)
      ins = [holds(v) for v in eqn.invars]
      ins[nc : nc + ncarry] = [False] * ncarry
      inner = moved_inputs(sub, ins)
      outs = [False] * ncarry + [held(v, inner) for v in sub.outvars[ncarry:]]
    elif name in MOVES:
      floats = [v for v in eqn.invars if is_float(v.aval.dtype)]
      outs = [bool(floats) and all(holds(v) for v in floats)] * len(eqn.outvars)
    moved.update(v for v, m in zip(eqn.outvars, outs, strict=True) if m)
  return moved


def in_float32(results: dict, v) -> bool:
  """Whether ``v`` is read in float32 (a variable nobody reads: yes)."""
  return results.get(v, True)
