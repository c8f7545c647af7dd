"""Where the gradients were not finite: the record read into a host-side report.

:func:`nonfinite_report` turns the :class:`NonFiniteRecord` in the state
(``track_nonfinite=True``) into a :class:`NonFiniteReport`: which
parameters' gradients were NaN or infinite, how often, most frequent first,
and whether the loss itself was.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from optax_lossscale._base import tree as _tree
from optax_lossscale._loss_scale import finite as _finite
from optax_lossscale._loss_scale import search as _search
from optax_lossscale._loss_scale import telemetry as _telemetry

__all__ = [
  "LeafReport",
  "NonFiniteReport",
  "find_record",
  "last_step_text",
  "nonfinite_report",
  "replicated",
  "report_from_record",
]


def replicated(x: Any) -> Any:
  """The one value of ``x``: a scalar, or equal copies (a pmap or vmap state)."""
  x = np.asarray(x)
  if x.ndim and not np.all(x == x.flat[0]):
    raise ValueError(
      f"The state holds {x.size} copies of its counters (one per replica, of "
      "a pmap or vmap) that differ: the replicas decided on their own (pass "
      "axis_name to the loss scale). Check one of them: "
      "jax.tree.map(lambda x: x[i], opt_state)."
    )
  return x.flat[0].item()


def _kind(bits: int) -> str | None:
  """``'NaN'``, ``'inf'``, ``'NaN and inf'`` for the record's bits; ``None`` for 0."""
  names = [n for b, n in ((_finite.NAN, "NaN"), (_finite.INF, "inf")) if bits & b]
  return " and ".join(names) or None


@dataclasses.dataclass(frozen=True)
class LeafReport:
  """One parameter's gradient in a :class:`NonFiniteReport`.

  Attributes:
    path: the parameter's path, ``'Block_3/Dense_0/kernel'``.
    steps: non-finite updates on which its gradient held NaN or an infinity.
    nan_steps: those on which it held a NaN.
    inf_steps: those on which it held an infinity.
    last: what it held on the last non-finite update (``'NaN'``, ``'inf'``,
      ``'NaN and inf'``), ``None`` if it was finite then.
  """

  path: str
  steps: int
  nan_steps: int
  inf_steps: int
  last: str | None


@dataclasses.dataclass(frozen=True)
class NonFiniteReport:
  """Where a run's gradients were not finite; ``str()`` of it is a readable table.

  Attributes:
    steps: updates recorded.
    nonfinite_steps: updates whose gradients were not all finite.
    loss_steps: of those, the ones whose loss was itself NaN or infinite
      (counted only when ``update`` was given the loss as ``value=``).
    last_step: the index (from 0) of the last non-finite update, ``None``
      if there was none.
    last_scale: the loss scale its gradients were computed with.
    last_loss: its loss: ``'finite'``, ``'NaN'``, ``'inf'``, or ``None``
      when ``update`` was not given it.
    leaves: the leaves that were ever not finite, most frequent first (then
      in the parameters' order).
  """

  steps: int
  nonfinite_steps: int
  loss_steps: int
  last_step: int | None
  last_scale: float | None
  last_loss: str | None
  leaves: tuple[LeafReport, ...]

  def format(self, top: int | None = 20) -> str:
    """The report as text, at most ``top`` leaves (``None``: all)."""
    if not self.nonfinite_steps:
      return f"All {self.steps} updates recorded had finite gradients."
    head = f"Non-finite gradients on {self.nonfinite_steps} of {self.steps} updates"
    if self.last_loss is not None:  # the loss was given to update
      head += f"; the loss itself was NaN or inf on {self.loss_steps} of them"
    lines = [head + ".", last_step_text(self), ""]
    shown = self.leaves if top is None else self.leaves[:top]
    width = max([len(leaf.path) for leaf in shown] + [4])
    lines.append(f"{'leaf':<{width}}  steps    NaN    inf  last")
    for leaf in shown:
      lines.append(
        f"{leaf.path:<{width}}  {leaf.steps:>5}  {leaf.nan_steps:>5}  "
        f"{leaf.inf_steps:>5}  {leaf.last or '-'}"
      )
    if len(shown) < len(self.leaves):
      lines.append(f"... and {len(self.leaves) - len(shown)} more leaves.")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.format()


def last_step_text(report: NonFiniteReport) -> str:
  """One or two sentences on the last non-finite update."""
  if report.last_step is None:
    return "No update had non-finite gradients."
  last = [leaf for leaf in report.leaves if leaf.last]
  named = ", ".join(f"{leaf.path} ({leaf.last})" for leaf in last[:8])
  if len(last) > 8:
    named += f" and {len(last) - 8} more"
  text = (
    f"The last non-finite update (number {report.last_step}, loss scale "
    f"{report.last_scale:g}) was not finite in {named or 'no leaf'}"
  )
  if report.last_loss is None:
    return text + " (the loss was not given to update as value=)."
  if report.last_loss == "finite":
    return text + (
      "; its loss was finite: only the gradients were not (an overflow in the "
      "backward pass, which a dynamic loss scale fixes by backing off, unless "
      "it persists at min_scale)."
    )
  return text + (
    f"; its loss itself was {report.last_loss}: the model produced it, "
    "whatever the loss scale."
  )


def find_record(opt_state: Any, required: bool = True) -> Any:
  """The :class:`NonFiniteRecord` in ``opt_state`` (arrays fetched), or ``None``."""
  found = _search.find_loss_scale_state(opt_state)
  record = _tree.unwrap(found.nonfinite)
  if record is None:
    if required:
      raise ValueError(
        "This optimizer state holds no non-finite record: build the loss "
        "scale with track_nonfinite=True (dynamic_loss_scale, "
        "static_loss_scale, with_loss_scale, LossScaleOptimizer)."
      )
    return None
  record = _tree.unwrap_variables(record)
  _tree.check_on_host(jax.tree.leaves(record), "The non-finite report")
  record = jax.device_get(record)
  batch = np.shape(record.steps)
  if batch:  # one record per replica (pmap, vmap): they must agree
    flat = jax.tree.map(
      lambda x: np.reshape(x, (-1, *np.shape(x)[len(batch) :])), record
    )
    first = jax.tree.map(lambda x: x[0], flat)
    if not all(np.all(x == x[:1]) for x in jax.tree.leaves(flat)):
      raise ValueError(
        f"The state holds {int(np.prod(batch))} records (one per replica, of "
        "a pmap or vmap) that differ: the replicas did not combine what they "
        "saw (pass axis_name to the loss scale). Report one of them: "
        "nonfinite_report(jax.tree.map(lambda x: x[i], opt_state))."
      )
    record = first
  return record


def report_from_record(record: Any, params: Any) -> NonFiniteReport:
  paths = record.paths
  if params is not None:
    paths = _telemetry.leaf_paths(_tree.graded(params))
    if len(paths) != len(record.paths):
      raise ValueError(
        f"`params` has {len(paths)} leaves but the record was made for "
        f"{len(record.paths)} ({', '.join(record.paths[:4])}, ...): pass the "
        "parameters the optimizer was initialised with."
      )
  counts = [
    np.asarray(getattr(record, f))
    for f in ("leaf_steps", "leaf_nan_steps", "leaf_inf_steps", "last_leaves")
  ]
  leaves = [
    LeafReport(
      paths[i],
      int(counts[0][i]),
      int(counts[1][i]),
      int(counts[2][i]),
      _kind(int(counts[3][i])),
    )
    for i in range(len(paths))
    if counts[0][i] > 0
  ]
  leaves.sort(key=lambda leaf: -leaf.steps)  # stable: the parameters' order next
  last_step = int(record.last_step)
  loss = int(record.last_loss)
  return NonFiniteReport(
    steps=int(record.steps),
    nonfinite_steps=int(record.nonfinite_steps),
    loss_steps=int(record.loss_steps),
    last_step=None if last_step < 0 else last_step,
    last_scale=None if last_step < 0 else float(record.last_scale),
    last_loss=None if loss < 0 else (_kind(loss) or "finite"),
    leaves=tuple(leaves),
  )


def nonfinite_report(opt_state: Any, params: Any = None) -> NonFiniteReport:
  """Which parameters' gradients were not finite, how often, and the loss.

  Host-side (it fetches the record: call it outside ``jax.jit``, when a
  step was skipped or at the end of a run). The optimizer must have been
  built with ``track_nonfinite=True``; the loss is told apart from the
  gradients when ``update`` is given it as ``value=``.

  Args:
    opt_state: anything :func:`get_scale` accepts (an optax state, a Flax
      ``TrainState`` or ``nnx.Optimizer``).
    params: optional, the parameters, to name the leaves by their paths in
      this tree instead of the ones recorded by ``init`` (same leaves).

  Returns:
    A :class:`NonFiniteReport`; ``print`` it for a table.

  Raises:
    ValueError: the state holds no record, ``params`` has other leaves, or
      the call is inside ``jax.jit``.

  Example:
    >>> import jax.numpy as jnp, optax, optax_lossscale as ols
    >>> tx = ols.dynamic_loss_scale(optax.sgd(0.1), track_nonfinite=True)
    >>> params = {"dense": {"kernel": jnp.ones(2), "bias": jnp.ones(1)}}
    >>> state = tx.init(params)
    >>> grads = {"dense": {"kernel": jnp.array([1.0, jnp.inf]), "bias": jnp.ones(1)}}
    >>> _, state = tx.update(grads, state, params, value=jnp.float32(2.0))
    >>> report = ols.nonfinite_report(state)
    >>> report.leaves[0].path, report.leaves[0].last, report.last_loss
    ('dense/kernel', 'inf', 'finite')
  """
  return report_from_record(find_record(opt_state), params)
