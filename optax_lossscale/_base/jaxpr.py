"""Evaluating a jaxpr equation by equation, with hooks: the one interpreter.

The skip (``_loss_scale.skip``) and ``autocast`` both re-evaluate a traced function's
jaxpr and change what some equations compute; this module is the loop they
share, and the one place that knows how a call primitive holds its body.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

try:
  from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal, Var
except ImportError:  # older JAX
  from jax.core import ClosedJaxpr, DropVar, Jaxpr, Literal, Var

__all__ = [
  "CALLS",
  "ClosedJaxpr",
  "DropVar",
  "Jaxpr",
  "Literal",
  "Var",
  "bind",
  "call_body",
  "call_key",
  "closed",
  "evaluate",
  "scan_counts",
]

#: Primitives that call a jaxpr as it is (``jax.jit`` inside a function is
#: ``jit``, ``pjit`` in older JAX): evaluating the body in their place
#: computes the same values.
CALLS = ("jit", "pjit", "closed_call", "core_call")


def closed(j: Any) -> tuple[Jaxpr, list[Any]]:
  """``(jaxpr, consts)`` of a closed or open jaxpr."""
  if isinstance(j, ClosedJaxpr):
    return j.jaxpr, list(j.consts)
  return j, []


def call_body(eqn: Any) -> tuple[Jaxpr, list[Any]] | None:
  """``(jaxpr, consts)`` of the body of a :data:`CALLS` equation, else ``None``."""
  if eqn.primitive.name not in CALLS:
    return None
  return closed(call_key(eqn))


def call_key(eqn: Any) -> Any:
  """The body object of a :data:`CALLS` equation (its ``jaxpr`` or
  ``call_jaxpr`` parameter, as JAX holds it: one object for every call of a
  ``jax.jit`` function with the same argument types)."""
  return eqn.params[next(k for k in ("jaxpr", "call_jaxpr") if k in eqn.params)]


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
  """``(constants, carry)``: how many of a ``scan`` equation's inputs are each.

  The inputs are the constants, the carry, then the scanned arrays. JAX
  before 0.11 states the counts (``num_consts``, ``num_carry``); later JAX
  states the three groups as a flat tree, ``ft_in``.
  """
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(carry)


def bind(eqn: Any, invals: Sequence[Any], params: dict[str, Any] | None = None) -> list:
  """Binds ``eqn``'s primitive to ``invals``, with ``params`` replacing its own.

  The replaced params go through the primitive's own preparation, so a call
  primitive's body (``call_jaxpr``) can be replaced too.
  """
  all_params = eqn.params if params is None else {**eqn.params, **params}
  bind_params = eqn.primitive.get_bind_params(all_params)
  subfuns: list[Any] = []
  if isinstance(bind_params, tuple):  # JAX < 0.7: (subfuns, params)
    subfuns, bind_params = bind_params
  context = getattr(getattr(eqn, "ctx", None), "manager", contextlib.nullcontext())
  with context:
    out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
  return list(out) if eqn.primitive.multiple_results else [out]


def evaluate(
  jaxpr: Jaxpr,
  consts: Iterable[Any],
  args: Iterable[Any],
  eval_eqn: Callable[[Any, list], list] = bind,
  on_output: Callable[[Any, Any], Any] | None = None,
) -> list:
  """The values of ``jaxpr``'s outputs for ``args``.

  Args:
    jaxpr: an open jaxpr.
    consts: the values of its constvars.
    args: the values of its invars.
    eval_eqn: ``(eqn, input values) -> output values``; default: bind the
      primitive as it is.
    on_output: ``(var, value) -> value`` applied to each equation output
      before anything reads it.
  """
  env: dict[Any, Any] = {}

  def read(v):
    return v.val if isinstance(v, Literal) else env[v]

  for v, x in zip(jaxpr.constvars, consts, strict=True):
    env[v] = x
  for v, x in zip(jaxpr.invars, args, strict=True):
    env[v] = x
  for eqn in jaxpr.eqns:
    outs = eval_eqn(eqn, [read(v) for v in eqn.invars])
    for v, x in zip(eqn.outvars, outs, strict=True):
      if isinstance(v, DropVar):
        continue
      env[v] = on_output(v, x) if on_output is not None else x
  return [read(v) for v in jaxpr.outvars]
