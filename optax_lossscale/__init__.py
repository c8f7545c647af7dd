"""Loss scaling and mixed precision for JAX, as optax transformations.

The public API is what this module exports. Each private module has one job,
named in its first docstring line; the names in its ``__all__`` are the
package-internal API the other modules use. The TensorFlow/Keras porting
surface lives in the subpackage :mod:`optax_lossscale.porting`, above the
core (which never imports it), and its names are spelled there
(``optax_lossscale.porting.LossScaleOptimizer``); the general helpers it
holds (the parameter average, the learning-rate getters) are exported here
too. The TensorFlow/Keras names that were once exported here still resolve,
with a ``DeprecationWarning`` naming the new spelling, for one release.
"""

import warnings as _warnings

from optax_lossscale import porting as porting
from optax_lossscale._autocast.evaluate import CustomRuleWarning as CustomRuleWarning
from optax_lossscale._autocast.lists import ALLOW_LIST as ALLOW_LIST
from optax_lossscale._autocast.lists import CLEAR_LIST as CLEAR_LIST
from optax_lossscale._autocast.lists import DENY_LIST as DENY_LIST
from optax_lossscale._autocast.lists import INFER_LIST as INFER_LIST
from optax_lossscale._autocast.matmul_list import (
  format_matmuls as format_matmuls,
)
from optax_lossscale._autocast.matmul_list import list_matmuls as list_matmuls
from optax_lossscale._autocast.policy import Policy as Policy
from optax_lossscale._autocast.policy import (
  default_half_dtype as default_half_dtype,
)
from optax_lossscale._autocast.policy import get_policy as get_policy
from optax_lossscale._autocast.transform import autocast as autocast
from optax_lossscale._loss_scale.config import DEFAULT_MAX_SCALE as DEFAULT_MAX_SCALE
from optax_lossscale._loss_scale.config import DEFAULT_MIN_SCALE as DEFAULT_MIN_SCALE
from optax_lossscale._loss_scale.config import LossScaleConfig as LossScaleConfig
from optax_lossscale._loss_scale.core import LossScaleState as LossScaleState
from optax_lossscale._loss_scale.core import unscale as unscale
from optax_lossscale._loss_scale.finite import all_finite as all_finite
from optax_lossscale._loss_scale.grad import scale_loss as scale_loss
from optax_lossscale._loss_scale.grad import value_and_grad as value_and_grad
from optax_lossscale._loss_scale.guard import check_checkpoint as check_checkpoint
from optax_lossscale._loss_scale.half_state import (
  HalfPrecisionStateWarning as HalfPrecisionStateWarning,
)
from optax_lossscale._loss_scale.overwrite import apply_overwrites as apply_overwrites
from optax_lossscale._loss_scale.plan import LeafPlan as LeafPlan
from optax_lossscale._loss_scale.plan import LossScalePlan as LossScalePlan
from optax_lossscale._loss_scale.plan import loss_scale_plan as loss_scale_plan
from optax_lossscale._loss_scale.report import LeafReport as LeafReport
from optax_lossscale._loss_scale.report import NonFiniteReport as NonFiniteReport
from optax_lossscale._loss_scale.report import nonfinite_report as nonfinite_report
from optax_lossscale._loss_scale.search import diagnostics as diagnostics
from optax_lossscale._loss_scale.search import (
  find_loss_scale_state as find_loss_scale_state,
)
from optax_lossscale._loss_scale.search import get_scale as get_scale
from optax_lossscale._loss_scale.skip import SkipFallbackWarning as SkipFallbackWarning
from optax_lossscale._loss_scale.skipped_steps import (
  NonFiniteStepsError as NonFiniteStepsError,
)
from optax_lossscale._loss_scale.skipped_steps import (
  check_skipped_steps as check_skipped_steps,
)
from optax_lossscale._loss_scale.telemetry import NonFiniteRecord as NonFiniteRecord
from optax_lossscale._loss_scale.transform import (
  dynamic_loss_scale as dynamic_loss_scale,
)
from optax_lossscale._loss_scale.transform import static_loss_scale as static_loss_scale
from optax_lossscale._lowbit.block_matmul import MXFP8Matmul as MXFP8Matmul
from optax_lossscale._lowbit.block_matmul import NVFP4Matmul as NVFP4Matmul
from optax_lossscale._lowbit.block_scaled import BlockQuantized as BlockQuantized
from optax_lossscale._lowbit.block_scaled import block_quantize as block_quantize
from optax_lossscale._lowbit.float8 import Float8Matmul as Float8Matmul
from optax_lossscale._params.adam_8bit import Adam8bit as Adam8bit
from optax_lossscale._params.adam_8bit import adam_8bit as adam_8bit
from optax_lossscale._params.low_precision import (
  KahanSummationState as KahanSummationState,
)
from optax_lossscale._params.low_precision import (
  StochasticRoundingState as StochasticRoundingState,
)
from optax_lossscale._params.low_precision import kahan_summation as kahan_summation
from optax_lossscale._params.low_precision import (
  stochastic_rounding as stochastic_rounding,
)
from optax_lossscale._params.master import MasterWeights as MasterWeights
from optax_lossscale._params.master import MasterWeightsState as MasterWeightsState
from optax_lossscale._params.master import get_master_weights as get_master_weights
from optax_lossscale._params.master import master_weights as master_weights
from optax_lossscale._params.quantize_state import (
  FlatQuantizedState as FlatQuantizedState,
)
from optax_lossscale._params.quantize_state import GroupedLeaf as GroupedLeaf
from optax_lossscale._params.quantize_state import QuantizedLeaf as QuantizedLeaf
from optax_lossscale._params.quantize_state import QuantizedState as QuantizedState
from optax_lossscale._params.quantize_state import StateQuantizer as StateQuantizer
from optax_lossscale._params.quantize_state import (
  StochasticFlatQuantizedState as StochasticFlatQuantizedState,
)
from optax_lossscale._params.quantize_state import (
  StochasticQuantizedState as StochasticQuantizedState,
)
from optax_lossscale._params.quantize_state import dequantize_state as dequantize_state
from optax_lossscale._params.quantize_state import quantize_state as quantize_state
from optax_lossscale.porting import EmaParamsState as EmaParamsState
from optax_lossscale.porting import ema_params as ema_params
from optax_lossscale.porting import get_ema_params as get_ema_params
from optax_lossscale.porting import get_learning_rate as get_learning_rate
from optax_lossscale.porting import set_learning_rate as set_learning_rate

__version__ = "0.1.0"

__all__ = (
  "MXFP8Matmul",
  "NVFP4Matmul",
  "BlockQuantized",
  "block_quantize",
  "ALLOW_LIST",
  "CLEAR_LIST",
  "DENY_LIST",
  "INFER_LIST",
  "DEFAULT_MAX_SCALE",
  "DEFAULT_MIN_SCALE",
  "Float8Matmul",
  "EmaParamsState",
  "KahanSummationState",
  "LossScaleConfig",
  "LeafReport",
  "LossScaleState",
  "MasterWeights",
  "MasterWeightsState",
  "FlatQuantizedState",
  "GroupedLeaf",
  "QuantizedLeaf",
  "QuantizedState",
  "StateQuantizer",
  "StochasticFlatQuantizedState",
  "StochasticQuantizedState",
  "NonFiniteRecord",
  "NonFiniteReport",
  "NonFiniteStepsError",
  "Policy",
  "SkipFallbackWarning",
  "HalfPrecisionStateWarning",
  "CustomRuleWarning",
  "Adam8bit",
  "StochasticRoundingState",
  "adam_8bit",
  "all_finite",
  "apply_overwrites",
  "autocast",
  "check_checkpoint",
  "check_skipped_steps",
  "default_half_dtype",
  "dequantize_state",
  "diagnostics",
  "loss_scale_plan",
  "LossScalePlan",
  "LeafPlan",
  "dynamic_loss_scale",
  "ema_params",
  "format_matmuls",
  "find_loss_scale_state",
  "get_ema_params",
  "get_learning_rate",
  "get_master_weights",
  "get_policy",
  "get_scale",
  "kahan_summation",
  "list_matmuls",
  "master_weights",
  "nonfinite_report",
  "quantize_state",
  "scale_loss",
  "set_learning_rate",
  "static_loss_scale",
  "stochastic_rounding",
  "unscale",
  "value_and_grad",
)


#: The TensorFlow/Keras names once exported here, now spelled
#: ``optax_lossscale.porting.<name>`` only: the porting package's names that
#: are not the general helpers exported above.
_MOVED_TO_PORTING = frozenset(porting.__all__) - frozenset(__all__)


#: Public names that changed, for one release: the old spelling warns.
_RENAMED = {"QuantizeState": "StateQuantizer"}


def __getattr__(name: str):
  if name in _RENAMED:
    _warnings.warn(
      f"optax_lossscale.{name} is now optax_lossscale.{_RENAMED[name]} (the "
      "transformation; its state is QuantizedState), and this spelling goes "
      "in the next release.",
      DeprecationWarning,
      stacklevel=2,
    )
    return globals()[_RENAMED[name]]
  if name in _MOVED_TO_PORTING:
    _warnings.warn(
      f"optax_lossscale.{name} is now optax_lossscale.porting.{name}: the "
      "TensorFlow/Keras names live in the porting package, and this spelling "
      "goes in the next release.",
      DeprecationWarning,
      stacklevel=2,
    )
    return getattr(porting, name)
  raise AttributeError(f"module 'optax_lossscale' has no attribute {name!r}")
