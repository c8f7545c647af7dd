"""Porting from TensorFlow and Keras: their loss-scale surface, built on the core.

Everything here is written with the core's pieces (``dynamic_loss_scale``,
the state and its search, ``autocast``) and nothing in the core imports it:

* TensorFlow's ``LossScale`` objects (:class:`DynamicLossScale`,
  :class:`StaticLossScale`, :class:`NoOpLossScale`) and
  :func:`with_loss_scale`, which wraps an optax transformation in the loss
  scale one configures;
* Keras' :class:`LossScaleOptimizer` with every knob of
  ``tf.keras.mixed_precision.LossScaleOptimizer``, Keras' optimizer
  formulas and TensorFlow's loss-scale rule (Keras 3's or tf_keras'
  numbers, step by step), TensorFlow's ``get_scaled_loss`` /
  ``get_unscaled_gradients`` (:class:`UnscaledGradients`) /
  ``apply_gradients`` idiom, and TensorFlow's deprecated
  :class:`ExperimentalLossScaleOptimizer` constructor;
* Keras' optimizer pieces: :func:`get_learning_rate`,
  :func:`set_learning_rate`, and the moving average of the weights
  (:func:`ema_params`, :func:`get_ema_params`,
  :func:`finalize_variable_values`);
* TensorFlow's ``enable_mixed_precision_graph_rewrite`` as
  :func:`enable_mixed_precision`.

The general helpers (the parameter average, the learning-rate getters) are
exported by ``optax_lossscale`` too; the TensorFlow/Keras names are spelled
here (``optax_lossscale.LossScaleOptimizer`` still resolves, with a
``DeprecationWarning``, for one release).
"""

from optax_lossscale.porting._ema import EmaParamsState as EmaParamsState
from optax_lossscale.porting._ema import ema_params as ema_params
from optax_lossscale.porting._ema import (
  finalize_variable_values as finalize_variable_values,
)
from optax_lossscale.porting._ema import get_ema_params as get_ema_params
from optax_lossscale.porting._experimental import (
  ExperimentalLossScaleOptimizer as ExperimentalLossScaleOptimizer,
)
from optax_lossscale.porting._keras import LossScaleOptimizer as LossScaleOptimizer
from optax_lossscale.porting._loss_scale import DynamicLossScale as DynamicLossScale
from optax_lossscale.porting._loss_scale import LossScale as LossScale
from optax_lossscale.porting._loss_scale import NoOpLossScale as NoOpLossScale
from optax_lossscale.porting._loss_scale import StaticLossScale as StaticLossScale
from optax_lossscale.porting._mixed_precision import (
  enable_mixed_precision as enable_mixed_precision,
)
from optax_lossscale.porting._optimizers import get_learning_rate as get_learning_rate
from optax_lossscale.porting._optimizers import set_learning_rate as set_learning_rate
from optax_lossscale.porting._tf_step import UnscaledGradients as UnscaledGradients
from optax_lossscale.porting._with_loss_scale import (
  with_loss_scale as with_loss_scale,
)

__all__ = (
  "DynamicLossScale",
  "EmaParamsState",
  "ExperimentalLossScaleOptimizer",
  "LossScale",
  "LossScaleOptimizer",
  "NoOpLossScale",
  "StaticLossScale",
  "UnscaledGradients",
  "ema_params",
  "enable_mixed_precision",
  "finalize_variable_values",
  "get_ema_params",
  "get_learning_rate",
  "set_learning_rate",
  "with_loss_scale",
)
