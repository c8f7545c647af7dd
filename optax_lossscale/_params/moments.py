"""Which leaves of an optax state are moments, read from the types of its states.

:func:`quantize_state` stores moments in 8 bits (running averages and sums
of gradients and of their squares, which tolerate a relative error of a
code's width) and nothing else: a copy of the parameters (an average of the
weights, schedule-free's ``z``, Prodigy's first parameters) or a
hyper-parameter held to the 8-bit code's precision changes what the
optimizer computes. The shape of a leaf does not tell them apart; the state
that holds it does. :func:`marks` reads it from the state's type.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import jax

__all__ = ["marks"]

# Each state type: the fields that hold moments (a tree of them, one a
# parameter). A known type's other fields are kept, and searched for the
# states they hold (a wrapper's inner state). Types a version of optax
# lacks are skipped.
_MOMENTS = {
  "optax:ScaleByAdamState": ("mu", "nu"),
  "optax:ScaleByAmsgradState": ("mu", "nu", "nu_max"),
  "optax:ScaleByBeliefState": ("mu", "nu"),
  "optax:ScaleByLionState": ("mu",),
  "optax:ScaleByNovogradState": ("mu", "nu"),
  "optax:ScaleByRStdDevState": ("mu", "nu"),
  "optax._src.transform:ScaleByRStdDevWithCountState": ("mu", "nu"),
  "optax:ScaleByRmsState": ("nu",),
  "optax._src.transform:ScaleByRmsWithCountState": ("nu",),
  "optax:ScaleByRssState": ("sum_of_squares",),
  "optax:ScaleBySM3State": ("mu", "nu"),
  "optax:ScaleByAdaDeltaState": ("e_g", "e_x"),
  "optax:ScaleByAdanState": ("m", "v", "n"),  # not g: the last gradient
  "optax:FactoredState": ("v_row", "v_col", "v"),
  "optax:TraceState": ("trace",),
  "optax:EmaState": ("ema",),  # an average of the updates
  "optax.contrib:DAdaptAdamWState": ("exp_avg", "exp_avg_sq"),
  "optax.contrib:MadgradState": ("grad_sum_sq", "s"),  # not x0
  "optax.contrib:MomoState": ("exp_avg",),
  "optax.contrib:MomoAdamState": ("exp_avg", "exp_avg_sq"),
  "optax.contrib:MuonState": ("mu",),
  "optax.contrib:ProdigyState": ("exp_avg", "exp_avg_sq"),  # not params0
  "optax.contrib:ScaleByAdemamixState": ("m1", "m2", "nu"),
  "optax.contrib:ScaleBySimplifiedAdEMAMixState": ("m", "n"),
  "optax.contrib:SophiaState": ("mu", "nu"),
  # States with no moment: what they hold is kept, their inner states searched.
  "optax:InjectHyperparamsState": (),
  "optax:InjectStatefulHyperparamsState": (),
  "optax:LookaheadState": (),
  "optax:MultiStepsState": (),  # its accumulated gradients are a sum, not an average
  "optax:ScaleByLBFGSState": (),
  "optax:ScaleByRpropState": (),
  "optax._src.transform:ScaleByOptimisticGradientState": (),
  "optax._src.transform:ScaleByDistanceOverGradientsState": (),
  "optax.contrib:COCOBState": (),
  "optax.contrib:DoGState": (),
  "optax.contrib:DoWGState": (),
  "optax.contrib:MechanicState": (),
  "optax.contrib:ScheduleFreeState": (),  # z: the parameters' average
  "optax_lossscale.porting._ema:EmaParamsState": (),  # the weights' average
}

# A wrapper's field holding the state of the transformation it wraps: searched
# as a state of its own (the types of the states in it decide; one of a type
# not listed is unknown, as it would be alone), not kept as the wrapper's.
_INNER = {
  "optax:InjectHyperparamsState": "inner_state",
  "optax:InjectStatefulHyperparamsState": "inner_state",
  "optax:LookaheadState": "fast_state",
  "optax:MultiStepsState": "inner_opt_state",
  "optax.contrib:MechanicState": "base_optimizer_state",
  "optax.contrib:ScheduleFreeState": "base_optimizer_state",
}


@functools.cache
def _types() -> dict[type, tuple[frozenset, str | None]]:
  """The state types of :data:`_MOMENTS` this installation has: their
  moment fields and the field of :data:`_INNER` (or ``None``)."""
  out = {}
  for where, fields in _MOMENTS.items():
    module, name = where.split(":")
    cls = getattr(importlib.import_module(module), name, None)
    if cls is not None:
      out[cls] = (frozenset(fields), _INNER.get(where))
  return out


def marks(state: Any) -> list:
  """For each leaf of ``state`` (in ``jax.tree.leaves`` order): ``True``
  where it is a moment (in a moment field of a state type listed here),
  ``False`` where a listed state holds it otherwise (a parameter copy, a
  hyper-parameter, a counter), ``None`` where no listed state holds it
  (a wrapper's inner state included: an unknown state inside
  ``inject_hyperparams`` is as unknown as alone)."""
  types = _types()
  out: list = []

  def visit(tree: Any, known: bool) -> None:
    for x in jax.tree.leaves(tree, is_leaf=lambda y: type(y) in types):
      if type(x) not in types:
        out.append(False if known else None)
        continue
      moments, inner = types[type(x)]
      for field in x._fields:
        value = getattr(x, field)
        if field in moments:
          out.extend([True] * len(jax.tree.leaves(value)))
        else:
          visit(value, field != inner)

  visit(state, False)
  return out
