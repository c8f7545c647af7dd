"""Runs of TensorFlow's loss-scale optimizers and of the porting package, step by step.

Shared by ``tests/test_tf_differential.py`` and wider sweeps: each ``run_*``
takes a configuration, the initial parameters and a sequence of scaled
gradients, and returns one :class:`Step` per gradient. Needs TensorFlow,
tf_keras and Keras 3 (``KERAS_BACKEND=tensorflow``) besides JAX.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

BASE = (
  "clipnorm",
  "clipvalue",
  "global_clipnorm",
  "weight_decay",
  "use_ema",
  "ema_momentum",
  "ema_overwrite_frequency",
  "gradient_accumulation_steps",
)


@dataclasses.dataclass
class Step:
  scale: float
  counter: int
  iterations: int
  params: list
  ema: list | None = None


@dataclasses.dataclass(frozen=True)
class Config:
  optimizer: str = "sgd"
  hyper: tuple = ()  # the formula's own arguments, (name, value) pairs
  base: tuple = ()  # base optimizer arguments, (name, value) pairs
  initial_scale: float = 2.0**15
  growth_steps: int | None = 2000  # None: a fixed scale (dynamic=False)

  def kwargs(self):
    return dict(self.hyper) | dict(self.base)


_CLASSES = {
  "sgd": "SGD",
  "adam": "Adam",
  "adamw": "AdamW",
  "rmsprop": "RMSprop",
  "adagrad": "Adagrad",
}


def run_keras3(cfg: Config, params0, grads_seq) -> list[Step]:
  """Keras 3's ``LossScaleOptimizer`` (TensorFlow backend), eagerly."""
  import keras
  import tensorflow as tf

  assert keras.backend.backend() == "tensorflow"
  variables = [keras.Variable(np.asarray(p)) for p in params0]
  inner = getattr(keras.optimizers, _CLASSES[cfg.optimizer])(**cfg.kwargs())
  opt = keras.optimizers.LossScaleOptimizer(
    inner, initial_scale=cfg.initial_scale, dynamic_growth_steps=cfg.growth_steps
  )
  opt.build(variables)
  out = []
  for grads in grads_seq:
    opt.apply([tf.constant(g) for g in grads], variables)
    ema = None
    if inner.use_ema:
      ema = [np.asarray(a) for a in inner._model_variables_moving_average]
    out.append(
      Step(
        float(opt.dynamic_scale.numpy()),
        int(opt.step_counter.numpy()),
        int(np.asarray(opt.iterations)),
        [np.asarray(v.numpy()) for v in variables],
        ema,
      )
    )
  return out


def run_tf_keras(cfg: Config, params0, grads_seq) -> list[Step]:
  """tf_keras' ``LossScaleOptimizer``, TensorFlow's way: unscale, then apply."""
  import tensorflow as tf
  import tf_keras

  variables = [tf.Variable(np.asarray(p)) for p in params0]
  cls = getattr(tf_keras.optimizers, _CLASSES[cfg.optimizer])
  inner = cls(**cfg.kwargs())
  opt = tf_keras.mixed_precision.LossScaleOptimizer(
    inner,
    dynamic=cfg.growth_steps is not None,
    initial_scale=cfg.initial_scale,
    dynamic_growth_steps=cfg.growth_steps,
  )
  out = []
  for grads in grads_seq:
    unscaled = opt.get_unscaled_gradients([tf.constant(g) for g in grads])
    opt.apply_gradients(zip(unscaled, variables, strict=True))
    ema = None
    if inner.use_ema:
      ema = [np.asarray(a) for a in inner._model_variables_moving_average]
    out.append(
      Step(
        float(opt.loss_scale.numpy()),
        -1 if opt.dynamic_counter is None else int(opt.dynamic_counter.numpy()),
        int(opt.iterations.numpy()),
        [np.asarray(v.numpy()) for v in variables],
        ema,
      )
    )
  return out


def run_ours(
  cfg: Config, params0, grads_seq, *, legacy: bool, idiom: str
) -> list[Step]:
  """The porting ``LossScaleOptimizer``: ``idiom`` is ``'optax'`` (update on
  the scaled gradients, then ``optax.apply_updates``) or ``'tf'``
  (``get_unscaled_gradients``, then ``apply_gradients``)."""
  import jax
  import jax.numpy as jnp
  import optax

  import optax_lossscale as ols

  opt = ols.porting.LossScaleOptimizer(
    {"class_name": cfg.optimizer, "config": cfg.kwargs()},
    initial_scale=cfg.initial_scale,
    dynamic_growth_steps=cfg.growth_steps,
    dynamic=cfg.growth_steps is not None,
    legacy_keras=legacy,
  )
  params = [jnp.asarray(p) for p in params0]
  state = opt.init(params)

  @jax.jit
  def step(grads, state, params):
    if idiom == "tf":
      return opt.apply_gradients(
        opt.get_unscaled_gradients(grads, state), state, params
      )
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  out = []
  for grads in grads_seq:
    params, state = step([jnp.asarray(g) for g in grads], state, params)
    ema = None
    if opt.use_ema:
      ema = [np.asarray(a) for a in state.inner_state.ema]
    out.append(
      Step(
        float(opt.loss_scale(state)),
        -1 if opt.dynamic_counter(state) is None else int(opt.dynamic_counter(state)),
        int(opt.iterations(state)),
        [np.asarray(p) for p in params],
        ema,
      )
    )
  return out


def gradients(rng, shapes, kinds, magnitude=1000.0):
  """Scaled gradients, one list per step; ``kinds`` names each step:
  ``'ok'``, ``'inf'``, ``'nan'``, ``'huge'`` (1e38 somewhere) or ``'tiny'``
  (everything times 1e-30)."""
  seq = []
  for kind in kinds:
    g = [(rng.normal(size=s) * magnitude).astype(np.float32) for s in shapes]
    if kind in ("inf", "nan", "huge"):
      i = rng.integers(len(shapes))
      g[i] = np.array(g[i])
      g[i].flat[0] = {"inf": np.inf, "nan": np.nan, "huge": 1e38}[kind]
    elif kind == "tiny":
      g = [(x * np.float32(1e-30)).astype(np.float32) for x in g]
    seq.append(g)
  return seq


def first_difference(ours, theirs, *, rtol=1e-6, ema=True):
  """The first step where two runs differ, and how; ``None`` if none.

  Scales, counters and ``iterations`` must be equal; values must agree to
  ``rtol`` of their leaf's largest magnitude (an element that cancels to
  near zero carries the rounding of its operands, which were that large).
  """
  for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
    for what in ("scale", "counter", "iterations"):
      if getattr(a, what) != getattr(b, what):
        return i, f"{what}: {getattr(a, what)} != {getattr(b, what)}"
    pairs = list(zip(a.params, b.params, strict=True))
    if ema and a.ema is not None and b.ema is not None:
      pairs += list(zip(a.ema, b.ema, strict=True))
    for x, y in pairs:
      finite = np.isfinite(y)
      size = np.max(np.abs(y[finite]), initial=0.0)
      if not np.allclose(x, y, rtol=0.0, atol=rtol * size, equal_nan=True):
        err = np.max(np.abs(x - y)) / max(size, 1e-30)
        return i, f"values: max difference {err:.3g} of the leaf's largest"
  return None
