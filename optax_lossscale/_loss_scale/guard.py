"""The guard before a checkpoint: a state holding a non-finite value is refused.

A step that produced NaN and was applied anyway (a model that is NaN by
itself, a float8 layer's stale scale, a run without loss scaling) leaves it
in the parameters or the optimizer state; saved, it poisons every run that
resumes from it. :func:`check_checkpoint` refuses such a state, naming where
the values are, for the price of the finite check's one fused reduction; the
leaves of a failing state are fetched and counted on the host with
``finite``'s own bit tests, so naming them compiles nothing.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from optax_lossscale._base import state_roles as _roles
from optax_lossscale._base import tree as _tree
from optax_lossscale._loss_scale import finite as _finite

__all__ = ["check_checkpoint", "nonfinite_leaves"]

_all_finite = jax.jit(_finite.leaves_finite)


def _floating_leaves(tree: Any, caller: str = "check_checkpoint") -> list:
  """``(path, leaf, array)`` of the leaves holding floating values: each
  floating array (``array`` is the leaf), and each block-quantised state
  leaf (``array`` is its block scales, infinite where a block held NaN or
  an infinity); ``nnx`` variables are read through."""
  out = []
  for path, x in _roles.state_leaves(tree):
    tested = _roles.tested_array(x)
    _tree.check_on_host([x, tested], caller)
    if tested is not None:
      out.append((_tree.keystr(path), x, tested))
  return out


def _counts(x: jax.Array) -> tuple[int, int]:
  """``(NaN entries, infinite entries)`` of ``x``, counted on the host.

  An array that this process cannot fetch whole (sharded across processes)
  is counted where it lies, with the same classification, by one jitted
  reduction of the global array.
  """
  if getattr(x, "is_fully_addressable", True):
    return _finite.count_nonfinite(x)
  nans, infs = jax.device_get(jax.jit(_finite.count_nonfinite_device)(x))
  return int(nans.sum(dtype=np.int64)), int(infs.sum(dtype=np.int64))


def check_checkpoint(tree: Any, *, what: str = "state") -> Any:
  """``tree`` itself if every floating value in it is finite; else a ``ValueError``.

  Meant for the line before a save: ``checkpointer.save(path,
  ols.check_checkpoint(state))``. The check is the loss scale's own finite
  check (:func:`all_finite`: one fused reduction over all leaves, jitted,
  and one boolean back to the host). Only when it fails are the leaves
  fetched and counted on the host, to name each one that holds NaN or an
  infinity, with counts: that compiles nothing, so a tree of 1000 leaves is
  named in well under a second (BENCHMARKS.md). Integer, boolean and
  non-array leaves (a step counter, strings) are not checked; ``nnx``
  variables are read through; a block-quantised state leaf
  (:func:`quantize_state`, :func:`adam_8bit`) is named whole, with the
  number of its blocks that hold NaN or inf (its block scales tell).

  Args:
    tree: what is about to be saved: parameters, an optimizer state, a Flax
      ``TrainState``, a dict of them.
    what: the word for ``tree`` in the error message.

  Returns:
    ``tree``, unchanged.

  Raises:
    ValueError: a floating value is NaN or infinite (the message lists the
      leaves' paths), or the call is inside ``jax.jit``.

  Example:
    >>> import jax.numpy as jnp, optax_lossscale as ols
    >>> state = {"w": jnp.ones(2), "mu": {"w": jnp.array([0.0, jnp.nan])}}
    >>> ols.check_checkpoint(state)
    Traceback (most recent call last):
    ...
    ValueError: Refusing to save the state: non-finite values at ['mu']['w']: 1
    NaN (of 2 entries). ...
  """
  bad = nonfinite_leaves(tree)
  if not bad:
    return tree
  raise ValueError(
    f"Refusing to save the {what}: non-finite values at {'; '.join(bad)}. "
    "Resuming from it would carry them on; save an earlier state, or find "
    "the step that produced them (ols.diagnostics, check_skipped_steps)."
  )


def nonfinite_leaves(tree: Any, caller: str = "check_checkpoint") -> list[str]:
  """``'path: 1 NaN (of 2 entries)'`` for each floating leaf that is not finite.

  The finite check first (one fused reduction, jitted); only when it fails
  are the leaves fetched and counted on the host. Empty when all is finite.

  Raises:
    ValueError: called on traced values (``caller`` names the function).
  """
  leaves = _floating_leaves(tree, caller)
  arrays = [x for _, _, x in leaves]
  if all(bool(_all_finite(group)) for group in _finite.device_groups(arrays)):
    return []
  bad = []
  for path, leaf, x in leaves:
    nans, infs = _counts(x)
    if not (nans or infs):
      continue
    if _roles.is_quantized(leaf):  # which entries is not stored: its blocks
      bad.append(
        f"{path} (quantised {np.dtype(leaf.dtype).name}): {nans + infs} of "
        f"{x.size} blocks hold NaN or inf"
      )
      continue
    kinds = [f"{n} {k}" for n, k in ((nans, "NaN"), (infs, "inf")) if n]
    bad.append(f"{path}: {' and '.join(kinds)} (of {x.size} entries)")
  return bad
