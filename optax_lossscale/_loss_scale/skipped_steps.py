"""Skipped steps in a row, checked on the host: the error names the likely cause.

:func:`check_skipped_steps` raises once a run keeps skipping; with a
:class:`NonFiniteRecord` in the state (``track_nonfinite=True``) its message
names the leaves (read by :mod:`.report`).
"""

from __future__ import annotations

from typing import Any

import jax

from optax_lossscale._base import state_roles as _roles
from optax_lossscale._base import tree as _tree
from optax_lossscale._base import validate as _validate
from optax_lossscale._loss_scale import config as _config
from optax_lossscale._loss_scale import finite as _finite
from optax_lossscale._loss_scale import guard as _guard
from optax_lossscale._loss_scale import half_state as _half_state
from optax_lossscale._loss_scale import report as _report
from optax_lossscale._loss_scale import search as _search

__all__ = ["NonFiniteStepsError", "check_skipped_steps"]


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
    min_scale: the floor the loss scale was built with (for the message), a
      finite number >= 0.
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
  min_scale = _validate.float_in("min_scale", min_scale, 0.0, float("inf"))
  d = opt_state_or_diagnostics
  given_state = not (isinstance(d, dict) and "consecutive_skips" in d)
  if given_state:
    d = _search.diagnostics(d)
  values = (d["consecutive_skips"], d["loss_scale"], d["skipped_steps"])
  _tree.check_on_host(values, "check_skipped_steps")
  consecutive, scale, total = (_report.replicated(v) for v in jax.device_get(values))
  if consecutive < limit:
    return
  # The record (when kept) is fetched only now, for the message.
  record = (
    _report.find_record(opt_state_or_diagnostics, required=False)
    if given_state
    else None
  )
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
      f"The loss scale is {scale:g}, above min_scale={min_scale:g}. A "
      "dynamic scale is still backing off: the gradients overflow at every "
      "scale tried so far, and if this persists down to min_scale, the model "
      "itself produces NaN or inf. A fixed scale (static_loss_scale) never "
      "backs off: the gradients are not finite at this scale, which is too "
      "large for them or the model produces NaN or inf (pass min_scale= the "
      "fixed scale for the causes at a floor)."
    )
  bad_params = (
    [] if params is None else _guard.nonfinite_leaves(params, "check_skipped_steps")
  )
  if bad_params:
    cause = _blame_parameters(
      bad_params,
      record,
      given_state and _roles.holds_masters(opt_state_or_diagnostics),
    )
  where = (
    ""
    if record is None
    else " " + _report.last_step_text(_report.report_from_record(record, None))
  )
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
  inner = _search.find_loss_scale_state(opt_state).inner_state
  tested = [(p, _roles.tested_array(x)) for p, x in _roles.state_leaves(inner)]
  broken = [
    jax.tree_util.keystr(path)
    for path, x in tested
    if x is not None and sum(_finite.count_nonfinite(x))
  ]
  half = _half_state.half_leaves(inner)
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
