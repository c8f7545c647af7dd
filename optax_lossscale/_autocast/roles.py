"""Each matmul's role in the whole function, found by structure, not by name.

A module path exists in Linen only (Flax NNX, Equinox and plain JAX give
none, a tied output layer is ``Embed_0.attend``), so what a recipe keeps in
the compute dtype by default is found from the jaxpr itself, at any depth
(calls, checkpoints, custom-derivative bodies, ``scan``, ``while``,
``cond``):

* ``kind``: ``"weight"`` or ``"attention"``. A product without batch
  dimensions, or one of whose operands holds a function input moved only
  (a parameter, however it is transposed, reshaped, sliced or cast), is a
  weight's. A batched product of two computed values is attention's when
  both derive from a matmul (queries and keys are projections) or from a
  common input (``x xᵀ``); otherwise one operand is a weight transformed
  without any matmul (weight-normed, scaled: a mixture of experts' stacked
  expert weights) and the product is a weight's.
* ``roles``: ``"output"`` for a weight's matmul whose result reaches the
  function's outputs with no other matmul in between (the output layer of a
  model or a loss); ``"embedding"`` for a weight's matmul with a
  table the function also gathers rows from (a tied output layer,
  ``Embed.attend``); a matmul can have both, or neither.

Each matmul is keyed by the ids of the equations that lead to it, outermost
first, as :class:`~optax_lossscale._autocast.evaluate.Walk` keys it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from optax_lossscale._autocast.rules import MOVES, body, is_float
from optax_lossscale._base import jaxpr as _jaxpr
from optax_lossscale._base.jaxpr import Jaxpr, Literal

__all__ = ["Matmul", "find"]

#: Primitives that read rows of a table: an embedding lookup.
_LOOKUPS = frozenset({"gather", "dynamic_slice"})


@dataclasses.dataclass(frozen=True)
class _Info:
  """What a value derives from: the function's inputs it depends on
  (``sources``, a bit per input), whether a matmul computed it
  (``matmul``), the inputs it holds moved only (``moved``, likewise;
  ``None`` if it was computed), and whether those are rows an embedding
  lookup read (``rows``), not the table itself."""

  sources: int = 0
  matmul: bool = False
  moved: int | None = None
  rows: bool = False

  def __or__(self, other: _Info) -> _Info:
    moved = None
    if self.moved is not None and other.moved is not None:
      moved = self.moved | other.moved
    return _Info(
      self.sources | other.sources,
      self.matmul or other.matmul,
      moved,
      self.rows or other.rows,
    )


_CONSTANT = _Info(moved=0)


@dataclasses.dataclass
class Matmul:
  """One matmul's structure: its ``kind``, ``roles`` and module ``path``."""

  kind: str
  path: str
  operands: tuple
  roles: set = dataclasses.field(default_factory=set)


def find(jaxpr: Jaxpr) -> dict[tuple, Matmul]:
  """Each ``dot_general`` of the function ``jaxpr`` (its invars and constvars
  the function's inputs) with its kind and role, keyed by equation ids."""
  found: dict[tuple, Matmul] = {}
  looked_up: list[int] = [0]  # the inputs an embedding lookup reads
  inputs = [*jaxpr.constvars, *jaxpr.invars]
  infos = {v: _Info(1 << i, False, 1 << i) for i, v in enumerate(inputs)}
  _forward(jaxpr, infos, (), "", found, looked_up)
  _backward(jaxpr, [True] * len(jaxpr.outvars), (), found)
  for m in found.values():
    tables = [o.moved for o in m.operands if o.moved is not None and not o.rows]
    if m.kind == "weight" and any(s & looked_up[0] for s in tables):
      m.roles.add("embedding")
  return found


def _forward(jaxpr, ins, prefix, path, found, looked_up) -> list[_Info]:
  """Each value's :class:`_Info`; ``ins``: the invars' (a list) or, for the
  function itself, every input's (a dict)."""
  env: dict[Any, _Info] = dict(ins) if isinstance(ins, dict) else {}

  def read(v):
    return _CONSTANT if isinstance(v, Literal) else env.get(v, _CONSTANT)

  if not isinstance(ins, dict):
    for v, i in zip(jaxpr.invars, ins, strict=True):
      env[v] = i
  for eqn in jaxpr.eqns:
    key = (*prefix, id(eqn))
    here = "/".join(s for s in (path, str(eqn.source_info.name_stack)) if s)
    invals = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    sub = body(eqn)
    if sub is not None:
      outs = _forward(sub[0], invals, key, here, found, looked_up)
    elif name == "cond":
      branches = [_jaxpr.closed(b)[0] for b in eqn.params["branches"]]
      each = [_forward(b, invals[1:], key, here, found, looked_up) for b in branches]
      outs = [_union(o) for o in zip(*each, strict=True)]
    elif name in ("scan", "while"):
      outs = _loop(eqn, invals, key, here, found, looked_up)
    elif name == "dot_general":
      found[key] = Matmul(_kind(eqn, invals), here, tuple(invals))
      outs = [_Info(_union(invals).sources, True, None)]
    else:
      out = _computed(eqn, invals)
      if name in _LOOKUPS and invals and invals[0].moved is not None:
        looked_up[0] |= invals[0].moved
        out = dataclasses.replace(out, rows=True)
      outs = [out] * len(eqn.outvars)
    for v, o in zip(eqn.outvars, outs, strict=True):
      env[v] = o
  return [read(v) for v in jaxpr.outvars]


def _union(infos) -> _Info:
  out = _CONSTANT
  for i in infos:
    out = out | i
  return out


def _computed(eqn, invals) -> _Info:
  """An equation's result: moved if it only moves its floating operands
  (an index it reads, a slice's start, does not make it computed)."""
  info = _union(invals)
  floats = [
    i for v, i in zip(eqn.invars, invals, strict=True) if is_float(v.aval.dtype)
  ]
  if (
    eqn.primitive.name in MOVES and floats and all(i.moved is not None for i in floats)
  ):
    return dataclasses.replace(info, moved=_union(floats).moved)
  return dataclasses.replace(info, moved=None)


def _loop(eqn, invals, key, path, found, looked_up) -> list[_Info]:
  """A ``scan`` or ``while``: its carry's sources to a fixed point."""
  p = eqn.params
  if eqn.primitive.name == "scan":
    sub = _jaxpr.closed(p["jaxpr"])[0]
    nc, ncarry = _jaxpr.scan_counts(p)
    consts, carry, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
    carry = [dataclasses.replace(c, moved=None) for c in carry]
    for _ in range(len(carry) + 2):
      outs = _forward(sub, [*consts, *carry, *xs], key, path, found, looked_up)
      new = [c | o for c, o in zip(carry, outs[:ncarry], strict=True)]
      new = [dataclasses.replace(c, moved=None) for c in new]
      if new == carry:
        break
      carry = new
    return [*carry, *[dataclasses.replace(o, moved=None) for o in outs[ncarry:]]]
  cond = _jaxpr.closed(p["cond_jaxpr"])[0]
  sub = _jaxpr.closed(p["body_jaxpr"])[0]
  nc, nb = p["cond_nconsts"], p["body_nconsts"]
  cconsts, bconsts = invals[:nc], invals[nc : nc + nb]
  carry = [dataclasses.replace(c, moved=None) for c in invals[nc + nb :]]
  for _ in range(len(carry) + 2):
    _forward(cond, [*cconsts, *carry], key, path, found, looked_up)
    outs = _forward(sub, [*bconsts, *carry], key, path, found, looked_up)
    new = [
      dataclasses.replace(c | o, moved=None) for c, o in zip(carry, outs, strict=True)
    ]
    if new == carry:
      break
    carry = new
  return carry


def _kind(eqn, invals) -> str:
  if not eqn.params["dimension_numbers"][1][0]:
    return "weight"
  if any(i.moved is not None for i in invals):
    return "weight"
  lhs, rhs = invals
  if (lhs.matmul and rhs.matmul) or (lhs.sources & rhs.sources):
    return "attention"
  return "weight"  # a weight transformed without a matmul, by activations


def _backward(jaxpr, reached_outs, prefix, found) -> list[bool]:
  """Marks the ``"output"`` matmuls; returns which invars reach an output."""
  reached: set = set()

  def mark(v, yes):
    if yes and not isinstance(v, Literal):
      reached.add(v)

  for v, r in zip(jaxpr.outvars, reached_outs, strict=True):
    mark(v, r)
  for eqn in reversed(jaxpr.eqns):
    key = (*prefix, id(eqn))
    outs = [v in reached for v in eqn.outvars]
    name = eqn.primitive.name
    sub = body(eqn)
    if sub is not None:
      ins = _backward(sub[0], outs, key, found)
    elif name == "cond":
      branches = [_jaxpr.closed(b)[0] for b in eqn.params["branches"]]
      each = [_backward(b, outs, key, found) for b in branches]
      ins = [False, *map(any, zip(*each, strict=True))]
    elif name in ("scan", "while"):
      ins = _loop_backward(eqn, outs, key, found)
    elif name == "dot_general":
      if any(outs) and key in found and found[key].kind == "weight":
        found[key].roles.add("output")
      ins = [False] * len(eqn.invars)
    else:
      ins = [any(outs)] * len(eqn.invars)
    for v, r in zip(eqn.invars, ins, strict=True):
      mark(v, r)
  return [v in reached for v in jaxpr.invars]


def _loop_backward(eqn, outs, key, found) -> list[bool]:
  p = eqn.params
  if eqn.primitive.name == "scan":
    sub = _jaxpr.closed(p["jaxpr"])[0]
    nc, ncarry = _jaxpr.scan_counts(p)
    carry, ys = list(outs[:ncarry]), list(outs[ncarry:])
    for _ in range(ncarry + 2):  # a carry read by the next step reaches too
      ins = _backward(sub, [*carry, *ys], key, found)
      new = [c or i for c, i in zip(carry, ins[nc : nc + ncarry], strict=True)]
      if new == carry:
        break
      carry = new
    return [*ins[:nc], *carry, *ins[nc + ncarry :]]
  cond = _jaxpr.closed(p["cond_jaxpr"])[0]
  sub = _jaxpr.closed(p["body_jaxpr"])[0]
  nc, nb = p["cond_nconsts"], p["body_nconsts"]
  carry = list(outs)
  for _ in range(len(carry) + 2):
    ins = _backward(sub, carry, key, found)
    new = [c or i for c, i in zip(carry, ins[nb:], strict=True)]
    if new == carry:
      break
    carry = new
  cins = _backward(cond, [False], key, found)
  return [*cins[:nc], *ins[:nb], *carry]
