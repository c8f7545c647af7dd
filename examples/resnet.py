"""A small ResNet with BatchNorm in Linen and NNX: float32 vs float16 with a loss scale.

The images are scikit-learn's 8x8 digits upsampled to CIFAR's 32x32x3
(nothing is downloaded). The model is a ResNet of three stages of one basic
block each (3x3 convolutions, BatchNorm, a projection shortcut where the
shape changes), written twice, in Linen and in NNX, as a Flax user writes
it. Each variant trains twice with the same seed and batches: in float32
with a plain optimizer, and in float16 compute (float32 parameters and
statistics) with ``dynamic_loss_scale`` around the same optimizer, through
the same training step:

* Linen: one ``LossScaleTrainState`` subclass with a ``batch_stats`` field,
  with or without a loss scale in its ``tx``;
* NNX: ``nnx_value_and_grad`` and ``nnx_update`` with the BatchNorm
  statistics taken before the step.

At the ``--nan-at`` steps one pixel of the loss-scaled runs' batch is NaN:
the step is skipped and changes nothing, the running statistics included
(the float32 runs, which have no loss scale, get the clean batch).

Run:  python examples/resnet.py [--steps N]
"""

from __future__ import annotations

import functools
import time
from typing import Any

import _cli
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from train_digits import load_data

import optax_lossscale as ols
from optax_lossscale.flax import LossScaleTrainState, nnx_update, nnx_value_and_grad

WIDTHS = (8, 16, 32)


def images(x: np.ndarray) -> np.ndarray:
  """8x8 digits as 32x32 RGB images (each pixel repeated 4x4, grey in 3 channels)."""
  x = x.reshape(-1, 8, 8)
  x = np.kron(x, np.ones((1, 4, 4), np.float32))
  return np.repeat(x[..., None], 3, axis=-1)


def cross_entropy(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), y
  ).mean()


# --- Linen ------------------------------------------------------------------


class LinenBlock(nn.Module):
  width: int
  strides: int
  dtype: Any

  @nn.compact
  def __call__(self, x, train: bool):
    conv = functools.partial(
      nn.Conv, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32
    )
    norm = functools.partial(
      nn.BatchNorm,
      use_running_average=not train,
      momentum=0.9,
      dtype=self.dtype,
      param_dtype=jnp.float32,
    )
    y = nn.relu(norm()(conv(self.width, (3, 3), self.strides)(x)))
    y = norm(scale_init=nn.initializers.zeros)(conv(self.width, (3, 3))(y))
    if x.shape[-1] != self.width or self.strides != 1:
      x = norm()(conv(self.width, (1, 1), self.strides)(x))
    return nn.relu(x + y)


class LinenResNet(nn.Module):
  """A three-stage ResNet computing in ``dtype``; parameters stay float32."""

  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = x.astype(self.dtype)
    x = nn.Conv(
      WIDTHS[0], (3, 3), use_bias=False, dtype=self.dtype, param_dtype=jnp.float32
    )(x)
    x = nn.relu(
      nn.BatchNorm(
        use_running_average=not train,
        momentum=0.9,
        dtype=self.dtype,
        param_dtype=jnp.float32,
      )(x)
    )
    for i, width in enumerate(WIDTHS):
      x = LinenBlock(width, 1 if i == 0 else 2, self.dtype)(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(10, dtype=self.dtype, param_dtype=jnp.float32)(x)


class TrainState(LossScaleTrainState):
  """Flax's ImageNet example's TrainState, on the loss-scaled one."""

  batch_stats: Any


def linen_run(dtype, tx, seed, x0):
  model = LinenResNet(dtype=dtype)
  variables = model.init(jax.random.key(seed), x0, train=False)
  state = TrainState.create(
    apply_fn=model.apply,
    params=variables["params"],
    tx=tx,
    batch_stats=variables["batch_stats"],
  )

  @jax.jit
  def train_step(state, x, y):
    def loss_fn(params):
      logits, updates = state.apply_fn(
        {"params": params, "batch_stats": state.batch_stats},
        x,
        train=True,
        mutable=["batch_stats"],
      )
      return cross_entropy(logits, y), updates

    (loss, updates), grads = state.value_and_grad(loss_fn, has_aux=True)(state.params)
    # On a skipped step the batch statistics keep their old values too.
    state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
    return state, loss

  @jax.jit
  def predict(state, x):
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    return jnp.argmax(state.apply_fn(variables, x, train=False), -1)

  def step(state, x, y):
    return train_step(state, x, y)

  def finish(state):
    return state, state.batch_stats, functools.partial(predict, state)

  return state, step, finish


# --- NNX --------------------------------------------------------------------


class NNXBlock(nnx.Module):
  def __init__(self, cin, width, strides, dtype, rngs):
    conv = functools.partial(
      nnx.Conv, use_bias=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs
    )
    norm = functools.partial(
      nnx.BatchNorm, momentum=0.9, dtype=dtype, param_dtype=jnp.float32, rngs=rngs
    )
    self.conv1 = conv(cin, width, (3, 3), strides=strides)
    self.norm1 = norm(width)
    self.conv2 = conv(width, width, (3, 3))
    self.norm2 = norm(width, scale_init=nnx.initializers.zeros)
    projected = cin != width or strides != 1
    self.project = (
      nnx.Sequential(conv(cin, width, (1, 1), strides=strides), norm(width))
      if projected
      else None
    )

  def __call__(self, x):
    y = nnx.relu(self.norm1(self.conv1(x)))
    y = self.norm2(self.conv2(y))
    if self.project is not None:
      x = self.project(x)
    return nnx.relu(x + y)


class NNXResNet(nnx.Module):
  """The Linen ResNet, in NNX."""

  def __init__(self, dtype, rngs):
    self.dtype = dtype
    self.stem = nnx.Conv(
      3,
      WIDTHS[0],
      (3, 3),
      use_bias=False,
      dtype=dtype,
      param_dtype=jnp.float32,
      rngs=rngs,
    )
    self.norm = nnx.BatchNorm(
      WIDTHS[0], momentum=0.9, dtype=dtype, param_dtype=jnp.float32, rngs=rngs
    )
    cins = (WIDTHS[0],) + WIDTHS[:-1]
    self.blocks = nnx.List(
      [
        NNXBlock(cin, w, 1 if i == 0 else 2, dtype, rngs)
        for i, (cin, w) in enumerate(zip(cins, WIDTHS, strict=True))
      ]
    )
    self.head = nnx.Linear(
      WIDTHS[-1], 10, dtype=dtype, param_dtype=jnp.float32, rngs=rngs
    )

  def __call__(self, x):
    x = nnx.relu(self.norm(self.stem(x.astype(self.dtype))))
    for block in self.blocks:
      x = block(x)
    return self.head(jnp.mean(x, axis=(1, 2)))


def nnx_loss(model, x, y):
  return cross_entropy(model(x), y)


@nnx.jit
def nnx_train_step(model, optimizer, x, y):
  # The statistics before the step: a skipped step writes them back.
  before = nnx.as_pure(nnx.state(model, nnx.BatchStat))
  loss, grads = nnx_value_and_grad(nnx_loss)(optimizer, model, x, y)
  nnx_update(optimizer, model, grads, before=before)
  return loss


@nnx.jit
def nnx_predict(model, x):
  return jnp.argmax(model(x), -1)


def nnx_run(dtype, tx, seed, x0):
  del x0
  model = NNXResNet(dtype, nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  def step(state, x, y):
    return state, nnx_train_step(model, optimizer, x, y)

  def finish(state):
    model.eval()
    stats = nnx.as_pure(nnx.state(model, nnx.BatchStat))
    return optimizer, stats, functools.partial(nnx_predict, model)

  return None, step, finish


# --- the runs -----------------------------------------------------------------


def train(name, make, dtype, tx, data, args):
  x_train, x_test, y_train, y_test = data
  state, step, finish = make(dtype, tx, args.seed, x_train[:1])
  scaled = name.endswith("loss scale")
  rng = np.random.default_rng(args.seed)
  losses = []
  t0 = time.perf_counter()
  for i in range(args.steps):
    if i == 1:
      jax.block_until_ready(losses[0])
      t0 = time.perf_counter()  # the first step compiles
    idx = rng.integers(0, len(x_train), args.batch)
    x = x_train[idx]
    if scaled and i in args.nan_at:
      x = x.copy()
      x[0, 0, 0, 0] = np.nan
    state, loss = step(state, x, y_train[idx])
    losses.append(loss)
  losses = np.asarray(jax.device_get(losses), np.float64)
  per_step = (time.perf_counter() - t0) / max(args.steps - 1, 1)
  holder, stats, predict = finish(state)
  acc = float(np.mean(np.asarray(predict(x_test)) == y_test))
  finite = all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(stats))
  diag = jax.device_get(ols.diagnostics(holder)) if scaled else None
  return dict(
    name=name,
    acc=acc,
    loss=float(np.nanmean(losses[-20:])),
    skipped=int(diag["skipped_steps"]) if scaled else 0,
    scale=float(diag["loss_scale"]) if scaled else None,
    finite=finite,
    ms=1e3 * per_step,
  )


def parse_args(argv=None):
  doc = __doc__.splitlines()[0]
  parser = _cli.parser(doc, steps=200, batch=32, seed="data split and init seed")
  parser.add_argument(
    "--lr", type=_cli.positive_float, default=2e-3, help="Adam's learning rate"
  )
  parser.add_argument(
    "--nan-at",
    type=_cli.steps_list,
    default=[50],
    help="steps whose batch gets a NaN pixel in the loss-scaled runs",
  )
  args = parser.parse_args(argv)
  late = [s for s in args.nan_at if s >= args.steps]
  _cli.require(
    parser, not late, f"--nan-at steps {late} must be below --steps ({args.steps})"
  )
  return args


def main(argv=None):
  args = parse_args(argv)
  t0 = time.perf_counter()
  x_train, x_test, y_train, y_test = load_data(args.seed)
  data = (images(x_train), images(x_test), y_train, y_test)
  adam = lambda: optax.adam(args.lr)  # noqa: E731
  runs = []
  for api, make in (("Linen", linen_run), ("NNX", nnx_run)):
    runs.append(train(f"{api} float32", make, jnp.float32, adam(), data, args))
    runs.append(
      train(
        f"{api} float16 + loss scale",
        make,
        jnp.float16,
        ols.dynamic_loss_scale(adam(), growth_interval=100),
        data,
        args,
      )
    )
  header = (
    f"{'run':<27}{'test acc':>9}{'loss':>9}{'skipped':>9}{'scale':>8}"
    f"{'stats finite':>14}{'ms/step':>9}"
  )
  print(
    f"{args.steps} steps of {args.batch} images, 32x32x3; NaN pixel at {args.nan_at}"
  )
  print("\n" + header + "\n" + "-" * len(header))
  for r in runs:
    scale = "-" if r["scale"] is None else f"{r['scale']:.0f}"
    print(
      f"{r['name']:<27}{r['acc']:>9.3f}{r['loss']:>9.4f}{r['skipped']:>9d}"
      f"{scale:>8}{'yes' if r['finite'] else 'NO':>14}{r['ms']:>9.1f}"
    )
  print(
    "\nloss: mean of the last 20 training steps (skipped ones left out); "
    "skipped: steps the loss scale skipped (the NaN-pixel steps and any whose "
    "float16 gradients overflowed); "
    "scale: after the last step's adjustment; stats finite: the BatchNorm "
    "running statistics after training; ms/step: after the first (compiling) step."
  )
  print(f"total time: {time.perf_counter() - t0:.1f} s")
  bad = [r["name"] for r in runs if not r["finite"]]
  if bad:
    print(f"non-finite running statistics: {bad}")
    raise SystemExit(1)
  return runs


if __name__ == "__main__":
  main()
