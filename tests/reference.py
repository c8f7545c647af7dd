"""A pure-Python model of the exact rule (docs/exact_rule.md), from its text.

It shares no code with the library: the property tests drive both with the
same finite/non-finite sequences and compare every counter after every step.
"""

import dataclasses

import numpy as np

f32 = np.float32


@dataclasses.dataclass
class ReferenceDynamicScale:
  initial_scale: float = 2.0**15
  growth_interval: int = 2000
  growth_factor: float = 2.0
  backoff_factor: float = 0.5
  min_scale: float = 1.0
  max_scale: float = 2.0**24
  hysteresis: int = 1

  def __post_init__(self):
    self.loss_scale = f32(self.initial_scale)
    self.good_steps = 0
    self.hysteresis_left = self.hysteresis  # Megatron's tracker: may go < 0.
    self.skipped_steps = 0
    self.consecutive_skips = 0

  def step(self, finite: bool) -> bool:
    """One step; returns whether the gradients are applied."""
    with np.errstate(over="ignore"):  # float32 overflow to inf is clamped
      return self._step(finite)

  def _step(self, finite: bool) -> bool:
    if finite:
      self.good_steps += 1
      if self.good_steps == self.growth_interval:
        self.loss_scale = min(
          self.loss_scale * f32(self.growth_factor), f32(self.max_scale)
        )
        self.good_steps = 0
        self.hysteresis_left = self.hysteresis
      self.consecutive_skips = 0
    else:
      self.good_steps = 0
      self.hysteresis_left -= 1
      if self.hysteresis_left <= 0:
        self.loss_scale = max(
          self.loss_scale * f32(self.backoff_factor), f32(self.min_scale)
        )
      self.skipped_steps += 1
      self.consecutive_skips += 1
    return finite


class MegatronDynamicGradScaler:
  """Megatron-LM's ``DynamicGradScaler.update`` transcribed (no max clamp)."""

  def __init__(
    self,
    initial_scale,
    min_scale,
    growth_factor,
    backoff_factor,
    growth_interval,
    hysteresis,
  ):
    self._scale = f32(initial_scale)
    self.min_scale = f32(min_scale)
    self.growth_factor = f32(growth_factor)
    self.backoff_factor = f32(backoff_factor)
    self.growth_interval = growth_interval
    self.hysteresis = hysteresis
    self._growth_tracker = 0
    self._hysteresis_tracker = self.hysteresis

  @property
  def scale(self):
    return self._scale

  def update(self, found_inf):
    if found_inf:
      self._growth_tracker = 0
      self._hysteresis_tracker -= 1
      if self._hysteresis_tracker <= 0:
        self._scale = max(self._scale * self.backoff_factor, self.min_scale)
    else:
      self._growth_tracker += 1
      if self._growth_tracker == self.growth_interval:
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis
        self._scale = self._scale * self.growth_factor
