"""Host-side reports: skipped steps in a row, and where the gradients were not finite.

:func:`check_skipped_steps` raises once a run keeps skipping; with a
:class:`NonFiniteRecord` in the state (``track_nonfinite=True``) its message
names the leaves. :func:`nonfinite_report` turns the record into a
:class:`NonFiniteReport`: which parameters' gradients were NaN or infinite,
how often, most frequent first, and whether the loss itself was.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from optax_lossscale._base import tree as _tree
from optax_lossscale._base import validate as _validate
from optax_lossscale._loss_scale import config as _config
from optax_lossscale._loss_scale import finite as _finite
from optax_lossscale._loss_scale import guard as _guard
from optax_lossscale._loss_scale import state as _state
from optax_lossscale._loss_scale import telemetry as _telemetry

__all__ = [
  "LeafReport",
  "NonFiniteReport",
  "NonFiniteStepsError",
  "check_skipped_steps",
  "nonfinite_report",
]


class NonFiniteStepsError(FloatingPointError):
  """Too many skipped steps in a row: see the message for the likely cause."""


def check_skipped_steps(
  opt_state_or_diagnostics: Any,
  *,
  max_consecutive_skips: int = 32,
  min_scale: float = _config.DEFAULT_MIN_SCALE,
  params: Any = None,
) -> None:
  """Host-side: raises once ``max_consecutive_skips`` steps in a row were skipped.

  Call it outside ``jax.jit`` every few steps (it fetches three scalars, a
  host sync): the counters live in the state, so nothing is missed between
  calls. A few skips in a row are normal (the scale backing off after an
  overflow, about ``log2(scale / min_scale)`` of them at most); a run that
  keeps skipping once the scale has reached ``min_scale`` produces NaN or
  ``inf`` by itself, whatever the scale, and no loss scale can fix it.

  Args:
    opt_state_or_diagnostics: anything :func:`get_scale` accepts, or the
      dict :func:`diagnostics` returned (fetched or not).
    max_consecutive_skips: the limit, >= 1.
    min_scale: the floor the loss scale was built with (for the message).
    params: optional, the parameters: when they hold NaN or inf, an update
      that was applied (its gradients finite) made them so, and the message
      says that the optimizer's update was not finite (Adam's moments in
      float16, say), not that the model is; read only when raising. Without
      them the message blames the model only when the state's non-finite
      record shows that no update was ever applied; otherwise it names both
      causes, and what the optimizer state shows (NaN or inf in it, float16
      state).

  Raises:
    NonFiniteStepsError: the limit was reached; the message says whether the
      scale is at its floor (the model produces NaN/inf) or still backing off
      and, given a state with a non-finite record (``track_nonfinite=True``),
      which leaves were not finite on the last skipped step and whether the
      loss itself was.
    ValueError: a bad argument, or called on traced values inside ``jit``.
  """
  limit = _validate.as_int("max_consecutive_skips", max_consecutive_skips)
  if limit < 1:
    raise ValueError(f"`max_consecutive_skips` must be >= 1, got {limit}.")
  d = opt_state_or_diagnostics
  given_state = not (isinstance(d, dict) and "consecutive_skips" in d)
  if given_state:
    d = _state.diagnostics(d)
  values = (d["consecutive_skips"], d["loss_scale"], d["skipped_steps"])
  if any(isinstance(v, jax.core.Tracer) for v in values):
    raise ValueError(
      "check_skipped_steps is a host-side check: call it outside jax.jit, on "
      "the state (or diagnostics) the step returned."
    )
  consecutive, scale, total = (_replicated(v) for v in jax.device_get(values))
  if consecutive < limit:
    return
  # The record (when kept) is fetched only now, for the message.
  record = _record(opt_state_or_diagnostics, required=False) if given_state else None
  never_applied = record is not None and int(record.nonfinite_steps) == int(
    record.steps
  )
  if scale <= min_scale and never_applied:
    cause = (
      f"The loss scale is at its floor ({scale:g} <= min_scale={min_scale:g}) "
      "and the gradients are still not finite: the model produces NaN or inf "
      "at every scale (a NaN input or label, log(0), a division by zero, a "
      "learning rate that made the parameters diverge), not a float16 "
      "overflow that a smaller scale would fix."
    )
  elif scale <= min_scale:
    # Updates were applied (or no record says otherwise): they may have
    # broken the parameters, which then make every gradient NaN. Without
    # the parameters, the optimizer state is the evidence.
    cause = (
      f"The loss scale is at its floor ({scale:g} <= min_scale={min_scale:g}) "
      "and the gradients are still not finite, not a float16 overflow that a "
      "smaller scale would fix. Either the model produces NaN or inf at "
      "every scale (a NaN input or label, log(0), a division by zero), or an "
      "applied update made the parameters NaN or inf (a learning rate that "
      "diverges, optimizer state in float16); pass params= to tell which."
      + (_optimizer_suspects(opt_state_or_diagnostics) if given_state else "")
    )
  else:
    cause = (
      f"The loss scale is {scale:g} and still backing off: the gradients "
      "overflow at every scale tried so far. If this persists down to "
      "min_scale, the model itself produces NaN or inf."
    )
  bad_params = (
    [] if params is None else _guard.nonfinite_leaves(params, "check_skipped_steps")
  )
  if bad_params:
    cause = _blame_parameters(
      bad_params,
      record,
      given_state and _state.wants_float32_gradients(opt_state_or_diagnostics),
    )
  where = "" if record is None else " " + _last_step_text(_report(record, None))
  raise NonFiniteStepsError(
    f"{consecutive} steps in a row were skipped for non-finite gradients "
    f"({total} skipped in total; limit max_consecutive_skips={limit}). {cause}"
    f"{where}"
  )


def _optimizer_suspects(opt_state: Any) -> str:
  """What the optimizer state shows against the optimizer (host-side), or "".

  Leaves of the loss scale's ``inner_state`` that hold NaN or inf (an
  applied update broke the state, and most likely the parameters it
  updates), or that are float16 (state that under- and overflows; a
  ``kahan_summation`` compensation is float16 by design and not counted).
  """
  inner = _tree.unwrap_variables(_state.find_loss_scale_state(opt_state).inner_state)
  inner = _state.without_half_by_design(inner)
  broken, half = [], []
  for path, x in jax.tree_util.tree_flatten_with_path(inner)[0]:
    if not _tree.is_float_array(x):
      continue
    if sum(_finite.count_nonfinite(x)):
      broken.append(jax.tree_util.keystr(path))
    if x.dtype == np.float16:
      half.append(jax.tree_util.keystr(path))
  text = ""
  if broken:
    text += (
      f" The optimizer state itself is NaN or inf (at .inner_state{broken[0]}"
      f"{', ...' if len(broken) > 1 else ''}): an applied update broke it, and "
      "most likely the parameters it updates. Look at the optimizer, not "
      "the model."
    )
  if half:
    text += (
      f" The optimizer keeps float16 state (at .inner_state{half[0]}"
      f"{', ...' if len(half) > 1 else ''}), which under- and overflows: keep "
      "it in float32 with dynamic_loss_scale(master_weights(optax.adam(...), "
      "store='float32'))."
    )
  return text


def _blame_parameters(bad: list[str], record: Any, has_master: bool) -> str:
  """Why the parameters are not finite, as far as the state tells.

  A step is applied only when its gradients are finite. With a record that
  saw every step skipped, no update was ever applied: the parameters were
  not finite to begin with. Otherwise an applied update made them so (or
  they were so from the start), and the optimizer is the suspect.
  """
  held = f"The parameters hold NaN or inf ({'; '.join(bad[:4])})"
  if record is not None and int(record.nonfinite_steps) == int(record.steps):
    return (
      f"{held}, and no update was ever applied (all {int(record.steps)} steps "
      "were skipped): they were not finite to begin with. Check the "
      "initialisation, or the checkpoint they were restored from."
    )
  advice = (
    "a learning rate that diverges, or a rule that divides by a state that can be 0"
    if has_master
    else "a state in float16 (Adam's second moment underflows to 0 and its "
    "eps=1e-8 is 0 in float16, so the update divides by zero; g**2 overflows "
    "above 256) or a learning rate that diverges. Keep the optimizer in "
    "float32: dynamic_loss_scale(master_weights(optax.adam(...), "
    "store='float32'))"
  )
  return (
    f"{held}. A step is applied only when its gradients are finite, so unless "
    "they were not finite to begin with (the initialisation, a checkpoint), an "
    "applied update made them so: the loss was finite but the optimizer's "
    f"update was not. Look at the optimizer, not the model: {advice}."
  )


def _replicated(x: Any) -> Any:
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
    lines = [head + ".", _last_step_text(self), ""]
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


def _last_step_text(report: NonFiniteReport) -> str:
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


def _record(opt_state: Any, required: bool = True) -> Any:
  """The :class:`NonFiniteRecord` in ``opt_state`` (arrays fetched), or ``None``."""
  found = _state.find_loss_scale_state(opt_state)
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
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(record)):
    raise ValueError(
      "The non-finite report is read on the host: call it outside jax.jit, "
      "on the state the step returned."
    )
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


def _report(record: Any, params: Any) -> NonFiniteReport:
  paths = record.paths
  if params is not None:
    paths = _telemetry.leaf_paths(params)
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
  return _report(_record(opt_state), params)
