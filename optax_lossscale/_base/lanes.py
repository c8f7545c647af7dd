"""An update's per-leaf elementwise code, found in its jaxpr and run once, flat.

An optimizer such as Adam computes each parameter's new state and update
from that parameter's own gradient and state, element by element, with the
same operations for every parameter. Traced over a tree of ``n`` leaves,
that is ``n`` copies of one elementwise program, which XLA compiles copy by
copy (their shapes differ). :func:`flat_evaluate` reads the traced
function's jaxpr, gives each array a *lane* (the parameter it belongs to),
groups the lanes whose elementwise equations are the same program, and
evaluates each group's program once, on its lanes concatenated into one
flat array (each lane's segment zero-padded to a multiple of ``align``):
element for element the values the lanes' own equations compute. What a
lane computes otherwise (a reduction: a norm, a trust ratio) is evaluated
lane by lane as traced, from the lane's slice of the flat values; what
belongs to no lane (a step counter, a schedule) once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._base import jaxpr as _jaxpr

__all__ = ["ELEMENTWISE", "Flat", "flat_evaluate", "flattened", "padded"]

#: Elementwise primitives: each output element is a function of the inputs'
#: elements at its own index (operands of one shape, or 0-d).
ELEMENTWISE = frozenset(
  """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp conj
  convert_element_type copy copy_p cos cosh div eq erf erf_inv erfc exp exp2
  expm1 floor ge gt imag integer_pow is_finite le lgamma log log1p logistic lt
  max min mul ne neg nextafter not or pow real reduce_precision rem round
  rsqrt select_n sign sin sinh sqrt square sub tan tanh xor""".split()
)
#: Primitives that leave a lane's elements in their row-major order.
_SAME_ORDER = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim"})
#: Where a call-like equation holds its body.
_BODY_KEYS = ("jaxpr", "call_jaxpr")


@dataclasses.dataclass(frozen=True)
class Flat:
  """Lanes as one flat array: lane ``lanes[k]``'s elements in row-major
  order, each lane's segment padded with zeros to a multiple of the
  ``align`` of :func:`flat_evaluate` (:func:`padded`), in order."""

  lanes: tuple
  value: Any


def padded(n: int, align: int) -> int:
  """``n`` rounded up to a multiple of ``align``."""
  return -(-n // align) * align


# --------------------------------------------------------------------------
# The equations, call bodies inlined; each value named by (call, var).
# --------------------------------------------------------------------------


@dataclasses.dataclass
class _Eqn:
  eqn: Any  # the jaxpr equation: its primitive and params
  ins: list  # value names, or _Lit
  outs: list  # value names (None for a dropped output)


@dataclasses.dataclass(frozen=True)
class _Lit:
  val: Any


def _body(eqn: Any) -> tuple | None:
  """The body of a call that computes what its body computes, to be
  inlined; ``None`` for any other equation. A ``custom_jvp``/``custom_vjp``
  call is kept whole (evaluated leaf by leaf): inlined, its body would
  lose the derivative rule ``jax.grad`` through the update must use."""
  if eqn.primitive.name in _jaxpr.CALLS:
    for key in _BODY_KEYS:
      body = eqn.params.get(key)
      if isinstance(body, (_jaxpr.ClosedJaxpr, _jaxpr.Jaxpr)):
        return _jaxpr.closed(body)
  return None


def _inline(jaxpr: Any, consts: list, ins: list, out: list, consts_out: list) -> list:
  """Appends ``jaxpr``'s equations to ``out``, its calls' bodies inlined
  (``ins`` name its inputs; its constants go to ``consts_out`` as ``(name,
  value)``); returns the names of its outputs."""
  ctx = object()  # names values apart from another inlining of the same body
  env: dict = {}
  for v, c in zip(jaxpr.constvars, consts, strict=True):
    env[v] = (ctx, v)
    consts_out.append((env[v], c))
  env.update(zip(jaxpr.invars, ins, strict=True))

  def read(v):
    return _Lit(v.val) if isinstance(v, _jaxpr.Literal) else env[v]

  for eqn in jaxpr.eqns:
    args = [read(v) for v in eqn.invars]
    body = _body(eqn)
    if body is not None:
      outs = _inline(*body, args, out, consts_out)
    else:
      outs = [None if isinstance(v, _jaxpr.DropVar) else (ctx, v) for v in eqn.outvars]
      out.append(_Eqn(eqn, args, outs))
    for v, k in zip(eqn.outvars, outs, strict=True):
      if not isinstance(v, _jaxpr.DropVar):
        env[v] = k
  return [read(v) for v in jaxpr.outvars]


# --------------------------------------------------------------------------
# What each value is.
# --------------------------------------------------------------------------
# "s": of no lane, 0-d.  "b": of no lane, made from "s" values by broadcasts
# and elementwise operations (one number at every index).  "o": of no lane,
# anything else.  ("l", lane): an elementwise function of one lane's inputs
# and "s" and "b" values.  ("x", lane or None): computed from lanes otherwise.


class _Analysis:
  """Each value's kind; each lane's elementwise program; the groups."""

  def __init__(self, closed_jaxpr, in_lanes, in_slots, out_lanes, out_slots, shapes):
    jaxpr, consts = _jaxpr.closed(closed_jaxpr)
    self.eqns: list[_Eqn] = []
    self.consts: list = []
    self.in_keys = [("in", i) for i in range(len(jaxpr.invars))]
    self.out_keys = _inline(jaxpr, consts, self.in_keys, self.eqns, self.consts)
    self.shapes = shapes
    self.aval: dict = dict(
      zip(self.in_keys, (v.aval for v in jaxpr.invars), strict=True)
    )
    for k, c in self.consts:
      self.aval[k] = jax.ShapeDtypeStruct(np.shape(c), jnp.result_type(c))
    self.made_by: dict = {}
    for e in self.eqns:
      for k, v in zip(e.outs, e.eqn.outvars, strict=True):
        if k is not None:
          self.aval[k], self.made_by[k] = v.aval, e
    self.kind: dict = {}
    self.local: dict = {}  # an ("l", lane) value -> its index in its lane's program
    self.prog: dict = {}  # lane -> signatures of its inputs, then of its equations
    self.bsig: dict = {}  # a "b" value -> how it is made (its number)
    # How a value is made, numbered: equal numbers for equal ways, and a
    # chain's description one number deep, however long the chain.
    self.numbers: dict = {}
    self.aliases: set = set()  # lane values that reorder nothing: a reshape's
    self.number: dict = {}  # an "s" value made by an equation -> how (numbered)
    for k, c in self.consts:
      self.kind[k] = "s" if np.ndim(c) == 0 else "o"
    for k, lane, slot in zip(self.in_keys, in_lanes, in_slots, strict=True):
      if lane is None:
        self.kind[k] = "s" if self.aval[k].shape == () else "o"
      else:
        self._add(k, lane, ("in", slot, str(self.aval[k].dtype)))
    for e in self.eqns:
      self._classify(e)
    outs: dict = {}
    for k, lane, slot in zip(self.out_keys, out_lanes, out_slots, strict=True):
      if lane is not None and self.kind_of(k) == ("l", lane):
        outs.setdefault(lane, []).append((slot, self.local[k]))
    by_program: dict = {}
    for lane, p in self.prog.items():
      by_program.setdefault((tuple(p), tuple(outs.get(lane, ()))), []).append(lane)
    self.groups = list(by_program.values())
    self.of_local = {  # the value each program entry makes
      (kk[1], self.local[k]): k
      for k, kk in self.kind.items()
      if isinstance(kk, tuple) and kk[0] == "l" and k not in self.aliases
    }

  def kind_of(self, k: Any) -> Any:
    if isinstance(k, _Lit):
      return "s" if np.ndim(k.val) == 0 else "o"
    return self.kind[k]

  def _add(self, k: Any, lane: Any, signature: tuple) -> None:
    self.kind[k] = ("l", lane)
    program = self.prog.setdefault(lane, [])
    self.local[k] = len(program)
    program.append(signature)

  def desc(self, k: Any) -> tuple:
    """How a program reads ``k``: the same description for the same value."""
    if isinstance(k, _Lit):
      return ("lit", _value_key(k.val))
    kind = self.kind[k]
    if kind == "s":
      return ("s", self.number.get(k, k))
    if kind == "b":
      return ("b", self.bsig[k])
    return ("l", self.local[k])

  def _classify(self, e: _Eqn) -> None:
    name = e.eqn.primitive.name
    kinds = [self.kind_of(k) for k in e.ins]
    outs = [k for k in e.outs if k is not None]
    lanes = {kk[1] for kk in kinds if isinstance(kk, tuple)}
    if not lanes:
      if all(kk == "s" for kk in kinds) and all(self.aval[k].shape == () for k in outs):
        new = "s"
        # the same operation on the same numbers: the same number (a
        # learning rate converted once a leaf is one value to the programs)
        made = (name, _params(e.eqn), tuple(self.desc(k) for k in e.ins))
        for n, k in enumerate(e.outs):
          if k is not None:
            self.number[k] = self._numbered((*made, n))
      elif len(outs) == 1 and (
        (name == "broadcast_in_dim" and kinds == ["s"])
        or (name in ELEMENTWISE and all(kk in ("s", "b") for kk in kinds))
      ):
        new = "b"
        self.bsig[outs[0]] = self._numbered(
          (
            name,
            () if name == "broadcast_in_dim" else _params(e.eqn),
            tuple(self.desc(k) for k in e.ins),
            str(self.aval[outs[0]].dtype),
          )
        )
      else:
        new = "o"
      for k in outs:
        self.kind[k] = new
      return
    lane = next(iter(lanes)) if len(lanes) == 1 else None
    shape = self.shapes.get(lane) if lane is not None else None
    # A 0-d lane's operations mix it with 0-d numbers as with its equals:
    # flat, those would not broadcast alike (select_n's cases), so it is
    # evaluated as traced.
    operands_ok = (
      lane is not None
      and shape != ()
      and all(kk in ("s", "b") or kk == ("l", lane) for kk in kinds)
    )
    if operands_ok and len(outs) == 1:
      out_shape = self.aval[outs[0]].shape
      if name in ELEMENTWISE and out_shape == shape:
        if all(self._shape(k) in ((), shape) for k in e.ins):
          self._add(outs[0], lane, self._signature(e, name, _params(e.eqn)))
          return
      if (
        name in _SAME_ORDER
        and kinds == [("l", lane)]
        and math.prod(out_shape) == math.prod(self._shape(e.ins[0]))
        and _keeps_order(e.eqn)
      ):
        # the same flat values: another name for its operand's
        self.kind[outs[0]], self.local[outs[0]] = ("l", lane), self.local[e.ins[0]]
        self.aliases.add(outs[0])
        return
    for k in outs:
      self.kind[k] = ("x", lane)

  def _numbered(self, made: tuple) -> int:
    return self.numbers.setdefault(made, len(self.numbers))

  def _signature(self, e: _Eqn, name: str, params: tuple) -> tuple:
    outs = [k for k in e.outs if k is not None]
    return (
      name,
      params,
      tuple(self.desc(k) for k in e.ins),
      str(self.aval[outs[0]].dtype),
    )

  def _shape(self, k: Any) -> tuple:
    return tuple(np.shape(k.val)) if isinstance(k, _Lit) else tuple(self.aval[k].shape)


def _keeps_order(eqn: Any) -> bool:
  """Whether a :data:`_SAME_ORDER` equation (its operand and result of one
  size) leaves the elements in their row-major order: not a reshape that
  transposes first (``dimensions``), nor a broadcast that permutes axes."""
  params = eqn.params
  if eqn.primitive.name == "reshape":
    return params.get("dimensions") is None
  if eqn.primitive.name == "broadcast_in_dim":
    dims = tuple(params["broadcast_dimensions"])
    return dims == tuple(sorted(dims))
  return True


def _params(eqn: Any) -> tuple:
  return tuple(sorted((k, _value_key(v)) for k, v in eqn.params.items()))


def _value_key(v: Any) -> Any:
  """``v`` as a key two values share only when they are equal: an array by
  its dtype, shape and bytes (its ``repr`` rounds the digits), a tuple or
  list item by item, anything else by its ``repr``."""
  if isinstance(v, (np.ndarray, np.generic, jax.Array, int, float, complex, bool)):
    a = np.asarray(v)
    return ("array", str(np.result_type(v)), a.shape, a.tobytes())
  if isinstance(v, (tuple, list)):
    return (type(v).__name__, tuple(_value_key(x) for x in v))
  return repr(v)


# --------------------------------------------------------------------------
# Flat arrays.
# --------------------------------------------------------------------------


def _starts(lanes: Sequence, sizes: dict, align: int) -> dict:
  out, start = {}, 0
  for lane in lanes:
    out[lane] = start
    start += padded(sizes[lane], align)
  return out


def flattened(x: Any, align: int) -> Any:
  """``x`` flattened, zero-padded to a multiple of ``align``: its segment."""
  x = x.reshape(-1)
  pad = padded(x.size, align) - x.size
  return jnp.pad(x, (0, pad)) if pad else x


def _concat(pieces: list) -> Any:
  return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)


def _zero_padding(x: Any, lanes: Sequence, sizes: dict, align: int) -> Any:
  """``x`` (a flat array of ``lanes``) with its padding set to 0."""
  counts = []
  for lane in lanes:
    n = sizes[lane]
    counts += [align] * (n // align) + ([n % align] if n % align else [])
  if all(c == align for c in counts):
    return x
  valid = (
    jax.lax.broadcasted_iota(jnp.int32, (len(counts), align), 1)
    < np.asarray(counts, np.int32)[:, None]
  )
  return jnp.where(valid, x.reshape(len(counts), align), 0).reshape(-1)


# --------------------------------------------------------------------------
# Evaluation.
# --------------------------------------------------------------------------


def flat_evaluate(
  closed_jaxpr: Any,
  args: Sequence[Any],
  in_lanes: Sequence[Hashable | None],
  in_slots: Sequence[Hashable],
  out_lanes: Sequence[Hashable | None],
  out_slots: Sequence[Hashable],
  shapes: dict,
  align: int,
  flat_in: Sequence[tuple[Hashable, Flat]] = (),
  flat_out: Sequence[tuple[Hashable, Sequence]] = (),
) -> tuple[list, list[Flat]]:
  """The outputs of ``closed_jaxpr`` for ``args``, each group of lanes'
  elementwise program evaluated once on flat arrays (the module's docstring).

  Args:
    closed_jaxpr: the traced function.
    args: a value for each input, or ``None`` for one given only in
      ``flat_in``.
    in_lanes: each input's lane (an array of the lane's shape), or ``None``.
    in_slots: each input's role, the same for the corresponding input of
      every lane (the gradient, Adam's ``mu``): lanes are grouped only
      where their inputs and outputs play the same roles.
    out_lanes, out_slots: the same for each output.
    shapes: each lane's shape.
    align: each lane's segment of a flat array is padded to a multiple of it.
    flat_in: ``(slot, Flat)`` pairs: that slot's inputs for the Flat's
      lanes, as one flat array.
    flat_out: ``(slot, lanes)`` pairs: that slot's outputs for those lanes,
      wanted as one flat array (their entries in the outputs are then
      ``None``).

  Returns:
    ``(outputs, flats)``: the outputs' values, and a ``Flat`` for each of
    ``flat_out``, its padding zero.

  Raises:
    ValueError: an input is neither in ``args`` nor in ``flat_in``.
  """
  a = _Analysis(closed_jaxpr, in_lanes, in_slots, out_lanes, out_slots, shapes)
  sizes = {lane: math.prod(s) for lane, s in shapes.items()}
  # Each group's lanes in the order of the flat arrays given or wanted, so
  # that those are read and written whole.
  order: dict = {}
  for lanes in [f.lanes for _, f in flat_in] + [lanes for _, lanes in flat_out]:
    for lane in lanes:
      order.setdefault(lane, len(order))
  position = {lane: i for i, lane in enumerate(a.prog)}
  members = [
    tuple(sorted(g, key=lambda lane: (order.get(lane, len(order)), position[lane])))
    for g in a.groups
  ]
  group_of = {lane: g for g, lanes in enumerate(members) for lane in lanes}
  index_in = {lane: i for lanes in members for i, lane in enumerate(lanes)}
  starts = [_starts(lanes, sizes, align) for lanes in members]
  given: dict = {}  # (slot, lane) -> (source, index in it)
  for slot, f in flat_in:
    source = (tuple(f.lanes), lambda f=f: f.value)
    for i, lane in enumerate(f.lanes):
      given[(slot, lane)] = (source, i)
  env: dict = dict(a.consts)
  env.update((k, x) for k, x in zip(a.in_keys, args, strict=True) if x is not None)
  flat_env: dict = {}
  b_env: dict = {}

  def read(k: Any, own: bool = False) -> Any:
    """``k``'s value; a lane's value computed flat is its segment, or with
    ``own`` (for what is not elementwise: a reduction) computed from the
    lane's own values, as traced (so that XLA fuses it as it would)."""
    if isinstance(k, _Lit):
      return k.val
    if k not in env and own and k in a.made_by:
      own_values(k)
    if k not in env:
      lane = a.kind[k][1]
      g = group_of[lane]
      flat, start = flat_value(g, a.local[k]), starts[g][lane]
      env[k] = flat[start : start + sizes[lane]].reshape(a.aval[k].shape)
    return env[k]

  def own_values(k: Any) -> None:
    # The equations that make k, from the lane's own values, deepest first:
    # a stack, not recursion as deep as the chain that feeds a reduction.
    stack = [k]
    while stack:
      top = stack[-1]
      e = a.made_by.get(top)
      if top in env or e is None:  # made, or an input (read as a segment)
        stack.pop()
        continue
      missing = [i for i in e.ins if not isinstance(i, _Lit) and i not in env]
      missing = [i for i in missing if i in a.made_by]
      if missing:
        stack.extend(missing)
        continue
      stack.pop()
      values = _jaxpr.bind(e.eqn, [read(i) for i in e.ins])
      for out, x in zip(e.outs, values, strict=True):
        if out is not None:
          env.setdefault(out, x)

  def flat_b(k: Any, n: int) -> Any:
    """A broadcast of scalars ``k`` at flat length ``n``, made from its
    scalars (a stack, not recursion as deep as its chain)."""
    shared = lambda i: isinstance(i, _Lit) or a.kind[i] == "s"  # noqa: E731
    if shared(k):
      return read(k)
    stack = [k]
    while stack:
      top = stack[-1]
      e = a.made_by[top]
      if (top, n) in b_env:
        stack.pop()
      elif e.eqn.primitive.name == "broadcast_in_dim":
        b_env[(top, n)] = jax.lax.broadcast_in_dim(read(e.ins[0]), (n,), ())
        stack.pop()
      elif missing := [i for i in e.ins if not shared(i) and (i, n) not in b_env]:
        stack.extend(missing)
      else:
        stack.pop()
        b_env[(top, n)] = _jaxpr.bind(e.eqn, [flat_b(i, n) for i in e.ins])[0]
    return b_env[(k, n)]

  def flat_value(g: int, i: int) -> Any:
    # The program's entries before i first, in order: what entry i reads
    # is then there (no recursion as deep as the program is long).
    for j in range(i):
      if (g, j) not in flat_env:
        flat_value(g, j)
    if (g, i) not in flat_env:
      lanes = members[g]
      k = a.of_local[(lanes[0], i)]
      entry = a.prog[lanes[0]][i]
      if entry[0] == "in":

        def read_input(lane: Any) -> Any:
          key = a.of_local[(lane, i)]
          if key not in env:
            raise ValueError(
              f"flat_evaluate: no value for input {key[1]} (lane {lane})."
            )
          return env[key]

        value = gathered(lanes, lambda lane: given.get((entry[1], lane)), read_input)
        flat_env[(g, i)] = value.astype(a.aval[k].dtype)
      else:
        n = starts[g][lanes[-1]] + padded(sizes[lanes[-1]], align)
        e = a.made_by[k]
        ins = []
        for x in e.ins:
          kind = a.kind_of(x)
          if isinstance(kind, tuple):
            ins.append(flat_value(g, a.local[x]))
          elif kind == "b":
            ins.append(flat_b(x, n))
          else:
            ins.append(read(x))
        flat_env[(g, i)] = _jaxpr.bind(e.eqn, ins)[0]
    return flat_env[(g, i)]

  def gathered(lanes: Sequence, locate: Callable, read_lane: Callable) -> Any:
    """A flat array of ``lanes``: runs of them that lie in order in one
    source (``locate(lane)``: ``(source, index)`` or ``None``; a source is
    ``(its lanes, a function giving its flat value)``) read from it whole,
    the rest lane by lane (``read_lane``)."""
    pieces, i = [], 0
    while i < len(lanes):
      found = locate(lanes[i])
      if found is None:
        pieces.append(flattened(read_lane(lanes[i]), align))
        i += 1
        continue
      (source_lanes, value), first = found
      n = 1
      while i + n < len(lanes) and first + n < len(source_lanes):
        nxt = locate(lanes[i + n])
        if nxt is None or nxt[0] is not found[0] or nxt[1] != first + n:
          break
        n += 1
      at = _starts(source_lanes, sizes, align)
      last = source_lanes[first + n - 1]
      whole = value()
      start, end = at[source_lanes[first]], at[last] + padded(sizes[last], align)
      pieces.append(whole if (start, end) == (0, whole.shape[0]) else whole[start:end])
      i += n
    return _concat(pieces)

  for e in a.eqns:
    outs = [k for k in e.outs if k is not None]
    if outs and all(isinstance(a.kind[k], tuple) and a.kind[k][0] == "l" for k in outs):
      continue  # computed flat, where something reads it
    values = _jaxpr.bind(e.eqn, [read(k, own=True) for k in e.ins])
    for k, x in zip(e.outs, values, strict=True):
      if k is not None:
        env[k] = x

  wanted = {(slot, lane) for slot, lanes in flat_out for lane in lanes}
  results = [
    None if (slot, lane) in wanted else read(k)
    for k, lane, slot in zip(a.out_keys, out_lanes, out_slots, strict=True)
  ]
  flats = []
  for slot, lanes in flat_out:
    key = {
      lane: k
      for k, lane, s in zip(a.out_keys, out_lanes, out_slots, strict=True)
      if s == slot and lane is not None
    }
    sources: dict = {}

    def locate(lane: Any, key=key, sources=sources) -> Any:
      k = key[lane]
      if a.kind_of(k) != ("l", lane):
        return None
      g, i = group_of[lane], a.local[k]
      if (g, i) not in sources:
        sources[(g, i)] = (members[g], lambda g=g, i=i: flat_value(g, i))
      return sources[(g, i)], index_in[lane]

    value = gathered(tuple(lanes), locate, lambda lane, key=key: read(key[lane]))
    flats.append(Flat(tuple(lanes), _zero_padding(value, lanes, sizes, align)))
  return results, flats
