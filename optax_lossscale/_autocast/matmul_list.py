"""list_matmuls: each matmul of a function, and the precision it runs in."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax

from optax_lossscale._autocast import transform as _autocast
from optax_lossscale._autocast.rules import AS_WRITTEN

__all__ = ["Matmul", "format_matmuls", "list_matmuls"]


class Matmul(NamedTuple):
  """One ``dot_general`` of a function, as :func:`list_matmuls` finds it."""

  path: str
  kind: str
  lhs_shape: tuple
  rhs_shape: tuple
  out_shape: tuple
  precision: str
  out_dtype: str
  kept: str | None = None
  quantized_from: tuple[str, str] | None = None


def list_matmuls(fun: Any, /, *args: Any, **kwargs: Any) -> list[Matmul]:
  """Each matmul ``fun(*args, **kwargs)`` computes, and how it runs.

  The answer to "did my model really run in NVFP4?": ``fun`` is traced
  (abstractly, nothing computed, no Variable written) and each
  ``dot_general`` in it, at any depth (calls, ``scan``, ``cond``,
  checkpoints, custom-derivative bodies), is listed once, in the order it
  runs, with the decision autocast's rewrite itself takes for it.

  Args:
    fun: a function made by :func:`~optax_lossscale.autocast` (its
      compute dtype and recipe), a ``functools.partial`` of one, or any
      function (its matmuls as written: a function that calls an autocast
      function, a ``lambda`` say, lists what that function's rewrite
      computes, a recipe's emulation included, so list the autocast function
      itself); not ``jax.grad``, ``jax.vmap`` or ``jax.jit`` of an autocast
      function (a ``ValueError``: list the autocast function itself).
    *args: its positional arguments (arrays, or ``jax.ShapeDtypeStruct``).
    **kwargs: its keyword arguments, likewise.

  Returns:
    A list of ``Matmul`` named tuples: ``path``, the module path
    (the jaxpr's name stack, e.g. ``"Transformer/block_0/Dense_1"``, which a
    recipe's ``exclude`` matches; empty where the model gives none, as Flax
    NNX, Equinox and plain JAX); ``kind``, ``"attention"`` for a batched
    product of two values the function computed from matmuls or from a
    common input, else ``"weight"``;
    ``lhs_shape``, ``rhs_shape`` and ``out_shape``; ``precision``, the
    recipe (``"float8"``, ``"mxfp8"``, ``"nvfp4"``) or the dtype of the
    operands it multiplies (``"bfloat16"``, ``"float32"``...); and
    ``out_dtype``, its result's dtype; ``kept``, why the recipe left it in
    the compute dtype (``"output"``: the output layer, ``"embedding"``: a
    matmul with a table the function gathers from, both found by structure,
    the recipe's ``keep``; ``"exclude <pattern>"`` or ``"exclude"``: the
    recipe's ``exclude``; ``"attention"``: the recipe's ``attention`` is
    off; ``"small"``: an M, K or N below the recipe's ``min_size``;
    ``"inner autocast"``: an autocast function called inside decided
    for it, and it is listed as it runs),
    ``None`` if it runs in the recipe or there is none;
    ``quantized_from``, the dtypes of the two operands the recipe quantises
    (``("float32", "float32")`` for a float32 activation and weight: the
    values themselves, not their copies in the compute dtype; a
    ``"bfloat16"`` operand is a value the function computed in
    ``compute_dtype``), ``None`` if no recipe quantises it.

  Example:
    >>> import jax.numpy as jnp, optax_lossscale as ols
    >>> def f(w1, w2, x):  # a hidden layer, then the output layer
    ...   return (jnp.tanh(x @ w1) @ w2).sum()
    >>> g = ols.autocast(f, compute_dtype=jnp.bfloat16, matmul="nvfp4")
    >>> w1, w2, x = jnp.ones((8, 16)), jnp.ones((16, 4)), jnp.ones((2, 8))
    >>> for m in ols.list_matmuls(g, w1, w2, x):
    ...   print(m.precision, m.kept, m.quantized_from)
    nvfp4 None ('float32', 'float32')
    bfloat16 output None
  """
  while isinstance(fun, functools.partial):  # its arguments go first
    args, kwargs = (*fun.args, *args), {**fun.keywords, **kwargs}
    fun = fun.func
  inner, rules = getattr(fun, "_autocast", (fun, AS_WRITTEN))
  if rules is not AS_WRITTEN and getattr(fun, "__wrapped__", None) is not inner:
    # jax.grad, jax.vmap or jax.jit of an autocast function carry its
    # attributes (functools.wraps), and were listed as the function itself.
    raise ValueError(
      f"list_matmuls({getattr(fun, '__name__', fun)!r}): a transformation "
      "(jax.grad, jax.vmap, jax.jit) of an autocast function; list the "
      "autocast function itself, on the arguments it is called with."
    )
  _, spec, arrays = _autocast.prepare(inner, args, kwargs)
  found: dict = {}
  run = functools.partial(_autocast.rewritten, inner, rules, spec, record=found)
  jax.eval_shape(run, *arrays)
  return [Matmul(**entry) for entry in found.values()]


def format_matmuls(matmuls: list[Matmul]) -> str:
  """:func:`list_matmuls`' answer as a table, one line per matmul."""
  rows = [("path", "kind", "lhs x rhs -> out", "precision", "from", "result", "kept")]
  for m in matmuls:
    shapes = f"{m.lhs_shape} x {m.rhs_shape} -> {m.out_shape}"
    source = " x ".join(m.quantized_from or ())
    rows.append(
      (m.path or "-", m.kind, shapes, m.precision, source, m.out_dtype, m.kept or "")
    )
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return "\n".join(
    "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
  )
