"""TensorFlow's argument names for the ``LossScale`` objects, and "not given" defaults.

TensorFlow's ``DynamicLossScale`` takes ``initial_loss_scale``,
``increment_period`` and ``multiplier``; this package's takes
``initial_scale``, ``growth_interval`` and the two factors. The defaults
are marked so that a caller who gave a value can be told from one who did
not, whatever the value.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from optax_lossscale._base import validate as _validate

__all__ = ["DefaultFloat", "DefaultInt", "as_given", "given", "resolve_tf_names"]


class DefaultFloat(float):
  """A default value: tells "not given" from the same value given."""


class DefaultInt(int):
  """A default value: tells "not given" from the same value given."""


def given(value: Any) -> bool:
  return type(value) not in (DefaultFloat, DefaultInt)


# TensorFlow's argument names: (TensorFlow's, ours).
_TF_NAMES = (
  ("initial_loss_scale", "initial_scale"),
  ("increment_period", "growth_interval"),
)


def resolve_tf_names(ours: dict[str, Any], tf: dict[str, Any]) -> dict[str, Any]:
  """Our keyword arguments with TensorFlow's merged in; giving both is an error.

  ``ours`` holds only the arguments the caller gave, ``tf`` TensorFlow's
  (``None``: not given); ``multiplier`` stands for both factors, the backoff being
  ``1 / multiplier`` as in TensorFlow.
  """
  out = dict(ours)
  for tf_name, name in _TF_NAMES:
    if tf.get(tf_name) is None:
      continue
    if name in ours:
      raise ValueError(
        f"Give `{name}` or its TensorFlow name `{tf_name}`, not both "
        f"(got {name}={ours[name]!r}, {tf_name}={tf[tf_name]!r})."
      )
    out[name] = tf[tf_name]
  multiplier = tf.get("multiplier")
  if multiplier is not None:
    given = [n for n in ("growth_factor", "backoff_factor") if n in ours]
    if given:
      raise ValueError(
        f"Give `{'`/`'.join(given)}` or TensorFlow's `multiplier`, not both "
        f"(got multiplier={multiplier!r})."
      )
    growth_factor = _validate.as_float("multiplier", multiplier)
    if growth_factor <= 1.0:
      raise ValueError(f"`multiplier` must be > 1, got {multiplier!r}.")
    out["growth_factor"] = growth_factor
    out["backoff_factor"] = 1.0 / growth_factor
  return out


@contextlib.contextmanager
def as_given(tf: dict[str, Any]) -> Iterator[None]:
  """A ValueError raised inside names each argument as the caller spelled it.

  ``tf`` holds TensorFlow's arguments (``None``: not given); one given is
  checked under the name it was translated to (``multiplier`` as
  ``growth_factor``), and the error says TensorFlow's.
  """
  renames = {ours: theirs for theirs, ours in _TF_NAMES if tf.get(theirs) is not None}
  if tf.get("multiplier") is not None:
    renames |= {"growth_factor": "multiplier", "backoff_factor": "multiplier"}
  try:
    yield
  except ValueError as e:
    message = str(e)
    for ours, theirs in renames.items():
      message = message.replace(f"`{ours}`", f"`{theirs}`")
    if message == str(e):
      raise
    raise ValueError(message) from None
