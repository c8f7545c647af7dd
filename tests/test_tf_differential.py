"""The porting package against TensorFlow 2.21, tf_keras 2.21 and Keras 3, step by step.

Each configuration runs the same scaled gradients through Keras 3's
``LossScaleOptimizer`` (TensorFlow backend), tf_keras' (TensorFlow's way:
``get_unscaled_gradients`` then ``apply_gradients``) and the porting
``LossScaleOptimizer`` (``legacy_keras=False`` through optax's ``update``,
``legacy_keras=True`` through TensorFlow's idiom), and compares after every
step the loss scale, the growth counter and ``iterations`` exactly, the
parameters and the moving average to 1e-6 of each leaf's largest magnitude
(XLA:CPU fuses multiply-adds, TensorFlow rounds each operation: the last
bits differ, and an element that cancels to near zero keeps its operands'
rounding).

Against tf_keras every step must agree. Against Keras 3 every step agrees
(its scale backs off below 1 as ours does) up to the first step where
Keras 3 does what the porting guide names as its own mistakes: its scale
reaching ``inf`` (the scale is kept when the grown value is not finite), or
its applying a step whose unscaled gradients overflow (it checks the scaled
ones; with a scale below 1 the unscaled ones are checked, and skipped).
The v1 ``LossScale``
objects are compared with ``tf.compat.v1.mixed_precision``'s.

Needs the ``tf`` extra in a virtual environment of its own, run with
``KERAS_BACKEND=tensorflow``; skipped otherwise.
"""

import os

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="needs the `tf` extra (TensorFlow)")
tf_keras = pytest.importorskip("tf_keras", reason="needs the `tf` extra (tf_keras)")
keras = pytest.importorskip("keras", reason="needs Keras 3")
if keras.backend.backend() != "tensorflow":
  pytest.skip(
    "Keras 3 runs another backend here: run with KERAS_BACKEND=tensorflow",
    allow_module_level=True,
  )

import tf_oracle as O  # noqa: E402

import optax_lossscale as ols  # noqa: E402

pytestmark = [
  pytest.mark.filterwarnings("ignore::DeprecationWarning"),
  pytest.mark.filterwarnings("ignore::UserWarning"),
]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SHAPES = [(3,), (2, 4)]
# 40 steps: growths, backoffs, skips in accumulation windows and EMA periods,
# and gradients that overflow (1e38 unscaled by a scale below 1) or are tiny.
KINDS = (
  ["ok"] * 5 + ["inf"] + ["ok"] * 3 + ["nan", "huge"] + ["ok"] * 6
  + ["tiny", "ok", "inf"] + ["ok"] * 8 + ["nan"] + ["ok"] * 11
)  # fmt: skip

ADAM_EMA = (("use_ema", True), ("ema_momentum", 0.75))
CONFIGS = {
  "sgd, growth 1": O.Config("sgd", growth_steps=1),
  "sgd, growth 2000": O.Config("sgd", growth_steps=2000),
  "sgd momentum, 2**-10": O.Config(
    "sgd", (("momentum", 0.9),), initial_scale=2.0**-10, growth_steps=3
  ),
  "sgd nesterov, clipnorm": O.Config(
    "sgd",
    (("momentum", 0.5), ("nesterov", True), ("learning_rate", 0.1)),
    (("clipnorm", 0.5),),
    growth_steps=4,
  ),
  "sgd, clipvalue, weight decay": O.Config(
    "sgd", (), (("clipvalue", 0.3), ("weight_decay", 0.1)), growth_steps=5
  ),
  "adam, 2**100, growth 1": O.Config("adam", initial_scale=2.0**100, growth_steps=1),
  "adam, global_clipnorm, EMA": O.Config(
    "adam", (), (("global_clipnorm", 1.0), *ADAM_EMA), growth_steps=2
  ),
  "adam, EMA overwrite, 2**-10": O.Config(
    "adam",
    (("learning_rate", 0.01),),
    (*ADAM_EMA, ("ema_overwrite_frequency", 3)),
    initial_scale=2.0**-10,
    growth_steps=2,
  ),
  # TensorFlow's scale grows past 2**126 at the third step; ours stops there.
  "adam amsgrad, 2**124, growth 1": O.Config(
    "adam", (("amsgrad", True),), initial_scale=2.0**124, growth_steps=1
  ),
  "adamw, weight decay": O.Config("adamw", (("weight_decay", 0.05),), growth_steps=3),
  "rmsprop centered, momentum": O.Config(
    "rmsprop", (("centered", True), ("momentum", 0.5)), growth_steps=3
  ),
  "adagrad": O.Config("adagrad", (("learning_rate", 0.1),), growth_steps=4),
}
# XLA:CPU fuses `a - b * b` into a fused multiply-add: where the square
# overflows float32 (RMSprop centered's velocity - average**2 at a 1e38
# gradient) TensorFlow gets inf - inf = NaN and we get inf, then finite
# weights; measured by test_fused_multiply_add_difference instead.
NO_HUGE = {"rmsprop centered, momentum"}
# Keras 3 only (tf_keras has no accumulation).
ACCUMULATING = {
  "sgd momentum, accumulation 3": O.Config(
    "sgd", (("momentum", 0.9),), (("gradient_accumulation_steps", 3),), growth_steps=2
  ),
  "adam, accumulation 2, EMA overwrite, clip": O.Config(
    "adam",
    (),
    (
      ("gradient_accumulation_steps", 2),
      ("global_clipnorm", 0.5),
      *ADAM_EMA,
      ("ema_overwrite_frequency", 2),
    ),
    initial_scale=2.0**-3,
    growth_steps=1,
  ),
}
LEGACY_OK = ("sgd", "adam", "adamw")


def _data(seed=0, kinds=KINDS):
  rng = np.random.default_rng(seed)
  params0 = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
  return params0, O.gradients(rng, SHAPES, kinds)


def _past_ceiling(theirs, i):
  """Whether TensorFlow's or Keras' scale grew past 2**126 at step ``i``:
  ours stops there (above it the reciprocal the gradients are multiplied by
  is subnormal, and TensorFlow flushes it to zero on a CPU)."""
  return theirs[i].scale > 2.0**126 >= (theirs[i - 1].scale if i else 0.0)


def _named_departure(k3, ours, grads_seq, i):
  """Why Keras 3 left TensorFlow's rule at step ``i`` (a named difference)."""
  before = k3[i - 1].scale if i else None
  step = k3[i]
  if not np.isfinite(step.scale):
    return "Keras 3's scale reached inf"
  if _past_ceiling(k3, i):
    return "Keras 3's scale grew past 2**126"
  scale = before if before is not None else ours[0].scale
  with np.errstate(over="ignore"):  # the overflow is what is looked for
    unscaled = [g / np.float32(scale) for g in grads_seq[i]]
  scaled_ok = all(np.isfinite(g).all() for g in grads_seq[i])
  if scaled_ok and not all(np.isfinite(g).all() for g in unscaled):
    return "Keras 3 applied gradients that overflow when unscaled"
  return None


@pytest.mark.parametrize("name", sorted(CONFIGS) + sorted(ACCUMULATING))
def test_step_by_step(name):
  cfg = CONFIGS.get(name) or ACCUMULATING[name]
  kinds = [k if k != "huge" else "ok" for k in KINDS] if name in NO_HUGE else KINDS
  params0, grads_seq = _data(kinds=kinds)
  ours = O.run_ours(cfg, params0, grads_seq, legacy=False, idiom="optax")
  k3 = O.run_keras3(cfg, params0, grads_seq)

  if name in CONFIGS and cfg.optimizer in LEGACY_OK:
    legacy = O.run_ours(cfg, params0, grads_seq, legacy=True, idiom="tf")
    theirs = O.run_tf_keras(cfg, params0, grads_seq)
    diff = O.first_difference(legacy, theirs)
    end = len(theirs) if diff is None else diff[0]
    assert diff is None or _past_ceiling(theirs, end), f"tf_keras, step {diff}"
    # Keras 3 mode differs from tf_keras only in a backoff below 1.
    below = any(s.scale < 1 for s in theirs) or cfg.initial_scale < 1
    if not below:
      assert [s.scale for s in ours[:end]] == [s.scale for s in theirs[:end]]
      assert [s.counter for s in ours[:end]] == [s.counter for s in theirs[:end]]

  diff = O.first_difference(ours, k3)
  if diff is not None:
    i, what = diff
    reason = _named_departure(k3, ours, grads_seq, i)
    assert reason is not None, f"Keras 3, step {i}: {what}"
    # Up to there, everything agreed.
    assert O.first_difference(ours[:i], k3[:i]) is None


@pytest.mark.parametrize(
  "name", ["adam, global_clipnorm, EMA", "sgd, clipvalue, weight decay"]
)
def test_a_skipped_first_step(name):
  """Before any applied step: Keras 3's average is zeros, tf_keras' the weights."""
  cfg = CONFIGS[name]
  if not cfg.kwargs().get("use_ema"):
    cfg = O.Config(cfg.optimizer, cfg.hyper, (*cfg.base, *ADAM_EMA), 2.0**4, 1)
  params0, grads_seq = _data(2, kinds=["nan", "inf"] + KINDS[:10])
  ours = O.run_ours(cfg, params0, grads_seq, legacy=False, idiom="optax")
  assert O.first_difference(ours, O.run_keras3(cfg, params0, grads_seq)) is None
  legacy = O.run_ours(cfg, params0, grads_seq, legacy=True, idiom="tf")
  assert O.first_difference(legacy, O.run_tf_keras(cfg, params0, grads_seq)) is None


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_fixed_scale_applies_every_step_as_tf_keras(momentum):
  """dynamic=False applies inf and NaN steps; tf_keras' SGD keeps a momentum
  slot at momentum 0, where 0 * inf turns an applied inf into NaN: the same
  NaN here."""
  cfg = O.Config("sgd", (("momentum", momentum),), initial_scale=8.0, growth_steps=None)
  params0, grads_seq = _data(4, kinds=["ok", "ok", "inf", "ok", "nan", "ok"])
  ours = O.run_ours(cfg, params0, grads_seq, legacy=True, idiom="tf")
  theirs = O.run_tf_keras(cfg, params0, grads_seq)
  assert O.first_difference(ours, theirs) is None
  assert [s.iterations for s in ours] == [1, 2, 3, 4, 5, 6]
  # The step after the applied inf: 0 * inf in the slot makes it NaN at
  # momentum 0 (an infinite weight otherwise).
  after = [np.isnan(p).any() for p in ours[3].params]
  assert any(after) == (momentum == 0.0)


HALF_CONFIGS = {
  "sgd momentum, fixed 128": O.Config(
    "sgd", (("momentum", 0.9), ("learning_rate", 100.0)), initial_scale=128.0,
    growth_steps=None,
  ),
  "sgd nesterov, fixed 128": O.Config(
    "sgd", (("momentum", 0.5), ("nesterov", True), ("learning_rate", 100.0)),
    initial_scale=128.0, growth_steps=None,
  ),
  "sgd momentum, dynamic": O.Config(
    "sgd", (("momentum", 0.9), ("learning_rate", 100.0)), initial_scale=128.0,
    growth_steps=2,
  ),
  "adam, fixed 128": O.Config(
    "adam", (("learning_rate", 0.1),), initial_scale=128.0, growth_steps=None
  ),
  "sgd momentum, clipvalue, EMA, fixed 128": O.Config(
    "sgd", (("momentum", 0.5),),
    (("clipvalue", 3.0), ("use_ema", True), ("ema_momentum", 0.75)),
    initial_scale=128.0, growth_steps=None,
  ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(HALF_CONFIGS))
def test_float16_variables_as_tf_keras(name):
  """float16 variables: Keras casts every constant to the variable's dtype,
  so the step, the slots and the average stay float16 and overflow where
  TensorFlow's do (a float32 momentum once turned the slot float32, and an
  overflow TensorFlow gives as inf into NaN)."""
  cfg = HALF_CONFIGS[name]
  kinds = ["ok", "ok", "ok", "inf", "ok", "huge", "ok", "ok", "nan", "ok"]
  rng = np.random.default_rng(7)
  params0 = [rng.normal(size=s).astype(np.float16) for s in SHAPES]
  with np.errstate(over="ignore"):  # 'huge' (1e38) is inf in float16
    grads_seq = [
      [g.astype(np.float16) for g in step]
      for step in O.gradients(rng, SHAPES, kinds, magnitude=3e3)
    ]
  ours = O.run_ours(cfg, params0, grads_seq, legacy=True, idiom="tf")
  theirs = O.run_tf_keras(cfg, params0, grads_seq)
  assert O.first_difference(ours, theirs) is None
  for step in ours:
    assert [p.dtype for p in step.params] == [np.float16] * len(SHAPES)
  if cfg.growth_steps is None and cfg.optimizer == "sgd" and not cfg.base:
    # The overflow is there to be matched: TensorFlow's weights reach inf.
    assert any(np.isinf(p).any() for p in theirs[-1].params)


def test_fused_multiply_add_difference():
  """The one difference of arithmetic: Keras 3 NaN, ours finite, at the 1e38 step."""
  cfg = CONFIGS["rmsprop centered, momentum"]
  params0, grads_seq = _data()
  ours = O.run_ours(cfg, params0, grads_seq, legacy=False, idiom="optax")
  k3 = O.run_keras3(cfg, params0, grads_seq)
  i, _ = O.first_difference(ours, k3)
  assert KINDS[i] == "huge"
  assert O.first_difference(ours[:i], k3[:i]) is None
  assert np.isnan(k3[i].params[0]).any() and np.isfinite(ours[i].params[0]).all()


def test_tensorflows_idiom_gives_tensorflows_numbers_in_keras3_mode():
  """get_unscaled_gradients + apply_gradients == update + apply_updates."""
  cfg = CONFIGS["adam, global_clipnorm, EMA"]
  params0, grads_seq = _data(1)
  a = O.run_ours(cfg, params0, grads_seq, legacy=False, idiom="tf")
  b = O.run_ours(cfg, params0, grads_seq, legacy=False, idiom="optax")
  assert O.first_difference(a, b) is None
  assert O.first_difference(a, O.run_keras3(cfg, params0, grads_seq)) is None


# --------------------------------------------------------------------------
# The v1 LossScale objects: tf.compat.v1.mixed_precision.
# --------------------------------------------------------------------------

V1_DYNAMIC = [
  {"initial_loss_scale": 2.0**15},  # TensorFlow's defaults otherwise
  {"initial_loss_scale": 2.0**-10, "increment_period": 1},
  {"initial_loss_scale": 2.0**100, "increment_period": 1, "multiplier": 2.0},
  {"initial_loss_scale": 1000.0, "increment_period": 2, "multiplier": 3.0},
  {"initial_loss_scale": 5.0, "increment_period": 3, "multiplier": 1.5},
  {"initial_loss_scale": 2.0**124, "increment_period": 1},  # TensorFlow's passes 2**126
]


@pytest.mark.parametrize("kwargs", V1_DYNAMIC, ids=str)
def test_v1_dynamic_loss_scale(kwargs):
  v1 = tf.compat.v1.mixed_precision
  theirs = v1.DynamicLossScale(**kwargs)
  ours = ols.porting.DynamicLossScale(**kwargs)
  assert float(ours()) == float(theirs())
  rng = np.random.default_rng(3)
  pattern = rng.random(120) < 0.8
  for step, finite in enumerate(pattern):
    g = [np.float32(1.0), np.array([2.0, np.inf if not finite else 3.0], np.float32)]
    _, their_apply = theirs.update([tf.constant(x) for x in g])
    ours, our_apply = ours.update([np.asarray(x) for x in g])
    assert bool(our_apply) == bool(their_apply), step
    if float(theirs()) > 2.0**126:  # TensorFlow's grew past where ours stops
      assert float(ours()) == 2.0**126, step
      break
    assert float(ours()) == float(theirs()), step
    assert int(ours.good_steps) == int(theirs._num_good_steps.numpy()), step
  # Configs both ways.
  assert (
    ols.porting.DynamicLossScale.from_config(theirs.get_config()).config == ours.config
  )
  again = v1.DynamicLossScale.from_config(ours.get_config())
  assert again.get_config() == theirs.get_config()


def test_keras3_scale_below_1():
  """From 2**-10, growth 1, one finite step then three overflows: Keras 3's
  scale halves below 1 and ours with it, step by step; tf_keras' (and ours
  with legacy_keras) backs off to no less than 1."""
  kinds = (["ok"] + ["inf"] * 3) * 5
  cfg = O.Config("sgd", initial_scale=2.0**-10, growth_steps=1)
  params0, grads_seq = _data(5, kinds=kinds)
  ours = O.run_ours(cfg, params0, grads_seq, legacy=False, idiom="optax")
  k3 = O.run_keras3(cfg, params0, grads_seq)
  assert O.first_difference(ours, k3) is None
  assert min(s.scale for s in k3) < 1
  tfk = O.run_tf_keras(cfg, params0, grads_seq)
  legacy = O.run_ours(cfg, params0, grads_seq, legacy=True, idiom="tf")
  assert O.first_difference(legacy, tfk) is None
  assert min(s.scale for s in tfk[1:]) >= 1


def test_v1_fixed_loss_scale_below_1():
  """TensorFlow refuses a fixed scale below 1; StaticLossScale takes it."""
  with pytest.raises(ValueError, match="at least 1"):
    tf.compat.v1.mixed_precision.FixedLossScale(2.0**-10)
  ls = ols.porting.StaticLossScale.from_config({"loss_scale_value": 2.0**-10})
  assert float(ls()) == 2.0**-10


@pytest.mark.parametrize("value", [2.0**127, float(np.finfo(np.float32).max)])
def test_v1_fixed_loss_scale_above_2_126(value):
  """TensorFlow takes a fixed scale up to float32's largest, and on a CPU
  multiplies the gradients by zero (its reciprocal, subnormal, flushed);
  StaticLossScale refuses it, naming the ceiling."""
  theirs = tf.compat.v1.mixed_precision.FixedLossScale(value)
  reciprocal = tf.constant(1.0) / theirs()
  assert float(tf.constant(1e3) * reciprocal) == 0.0
  with pytest.raises(ValueError, match="2\\*\\*126"):
    ols.porting.StaticLossScale.from_config(theirs.get_config())


@pytest.mark.parametrize("value", [1.0, 123.0, 2.0**100, 2.0**126])
def test_v1_fixed_loss_scale(value):
  v1 = tf.compat.v1.mixed_precision
  theirs = v1.FixedLossScale(value)
  ours = ols.porting.StaticLossScale.from_config(theirs.get_config())
  assert float(ours()) == float(theirs())
  for g in ([np.float32(np.inf)], [np.float32(1.0)]):
    _, their_apply = theirs.update([tf.constant(x) for x in g])
    ours, our_apply = ours.update([np.asarray(x) for x in g])
    assert bool(our_apply) == bool(their_apply) is True
    assert float(ours()) == float(theirs())
  again = v1.FixedLossScale.from_config(ours.get_config())
  assert again.get_config() == theirs.get_config()


# --------------------------------------------------------------------------
# Configurations that TensorFlow and Keras write.
# --------------------------------------------------------------------------


def test_from_config_reads_tensorflows_configs():
  sgd = tf_keras.optimizers.SGD(learning_rate=0.5, momentum=0.25)
  lso = tf_keras.mixed_precision.LossScaleOptimizer(
    sgd, initial_scale=64.0, dynamic_growth_steps=7
  )
  opt = ols.porting.LossScaleOptimizer.from_config(lso.get_config())
  assert (opt.initial_scale, opt.dynamic_growth_steps) == (64.0, 7)
  assert dict(opt.inner_optimizer.hyper)["momentum"] == 0.25

  k3 = keras.optimizers.LossScaleOptimizer(
    keras.optimizers.Adam(learning_rate=0.01, clipnorm=0.5), initial_scale=8.0
  )
  opt = ols.porting.LossScaleOptimizer.from_config(k3.get_config())
  assert (opt.initial_scale, opt.clipnorm) == (8.0, 0.5)

  fixed = tf_keras.mixed_precision.LossScaleOptimizer(
    tf_keras.optimizers.SGD(), dynamic=False, initial_scale=123
  )
  opt = ols.porting.LossScaleOptimizer.from_config(fixed.get_config())
  assert (opt.dynamic, opt.initial_scale, opt.dynamic_growth_steps) == (
    False,
    123,
    None,
  )

  # TensorFlow 2.3's form: `optimizer` and a `loss_scale` object's config.
  for loss_scale, expected in (
    ({"class_name": "FixedLossScale", "config": {"loss_scale_value": 12.0}}, False),
    (
      {
        "class_name": "DynamicLossScale",
        "config": {"initial_loss_scale": 4.0, "increment_period": 9, "multiplier": 2.0},
      },
      True,
    ),
  ):
    config = {
      "optimizer": {
        "class_name": "SGD",
        "config": {"learning_rate": 0.1, "decay": 0.0},
      },
      "loss_scale": loss_scale,
    }
    assert ols.porting.LossScaleOptimizer.from_config(config).dynamic is expected
  bad = {"class_name": "DynamicLossScale", "config": {"multiplier": 4.0}}
  with pytest.raises(ValueError, match="multiplier"):
    ols.porting.LossScaleOptimizer.from_config({"optimizer": "sgd", "loss_scale": bad})


@pytest.mark.parametrize(
  "make",
  [
    lambda: tf_keras.optimizers.Adam(0.1),
    lambda: tf_keras.optimizers.SGD(0.1, momentum=0.5),
    lambda: tf_keras.optimizers.legacy.Adam(0.1),
  ],
  ids=["Adam", "SGD", "legacy Adam"],
)
def test_a_tf_keras_config_read_back_steps_as_tf_keras(make):
  """tf_keras counts a skipped step in ``iterations`` (Adam's bias
  correction runs ahead): the optimizer read from its config does too."""
  import jax.numpy as jnp
  import optax

  p0 = np.array([1.0, -2.0], np.float32)
  grads_seq = [np.array([np.inf, 1.0], np.float32)] + [
    np.array([0.5, -0.25], np.float32)
  ] * 2
  var = tf.Variable(p0)
  theirs = tf_keras.mixed_precision.LossScaleOptimizer(make(), initial_scale=4.0)
  opt = ols.porting.LossScaleOptimizer.from_config(theirs.get_config())
  params = jnp.asarray(p0)
  state = opt.init(params)
  for g in grads_seq:
    scaled = [tf.constant(g * float(theirs.loss_scale))]
    theirs.apply_gradients(
      zip(theirs.get_unscaled_gradients(scaled), [var], strict=True)
    )
    updates, state = opt.update(jnp.asarray(g) * opt.loss_scale(state), state, params)
    params = optax.apply_updates(params, updates)
  assert int(opt.iterations(state)) == int(theirs.iterations.numpy()) == 3
  # to 1e-6 of the leaf's largest magnitude, as every run here (tf_oracle)
  size = np.abs(var.numpy()).max()
  np.testing.assert_allclose(np.asarray(params), var.numpy(), rtol=0, atol=1e-6 * size)


@pytest.mark.parametrize("name", ["RMSprop", "Adagrad"])
def test_optimizer_v2_configs_with_another_formula_are_refused(name):
  """OptimizerV2's RMSprop (at momentum 0) and Adagrad add epsilon to the
  square root: their configs are refused, not run with Keras 3's formula."""
  legacy = getattr(tf_keras.optimizers.legacy, name)(0.1)
  lso = tf_keras.mixed_precision.LossScaleOptimizer(legacy, initial_scale=4.0)
  with pytest.raises(ValueError, match="OptimizerV2"):
    ols.porting.LossScaleOptimizer.from_config(lso.get_config())
