"""Train a Flax MLP on scikit-learn's 8x8 digits three ways and compare.

1. ``float32``: everything in float32.
2. ``float16``: float32 parameters, float16 compute, no loss scaling.
3. ``float16 + loss scale``: the same, with ``optax_lossscale.dynamic_loss_scale``.

The data ships inside scikit-learn: nothing is downloaded. The script prints a
table (test accuracy, final loss, skipped steps, final scale, fraction of
gradient entries that underflowed to zero) and writes a PNG plot of the loss
and the loss scale over the steps, skipped steps marked.

Run:  python examples/train_digits.py [--steps N] [--out DIR]
"""

from __future__ import annotations

import os
import time

import _cli
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import optax_lossscale as ols


class MLP(nn.Module):
  """A small MLP whose matmuls run in ``dtype``; parameters stay float32."""

  dtype: jnp.dtype = jnp.float32
  width: int = 256

  @nn.compact
  def __call__(self, x):
    x = x.astype(self.dtype)
    for _ in range(3):
      x = nn.relu(nn.Dense(self.width, dtype=self.dtype, param_dtype=jnp.float32)(x))
    return nn.Dense(10, dtype=self.dtype, param_dtype=jnp.float32)(x)


def load_data(seed: int):
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


def loss_fn(model, params, x, y):
  logits = model.apply({"params": params}, x).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def underflow_fraction(grads, reference):
  """Entries that are exactly 0 where the float32 gradient is not."""
  g = jnp.concatenate([jnp.ravel(a) for a in jax.tree.leaves(grads)])
  r = jnp.concatenate([jnp.ravel(a) for a in jax.tree.leaves(reference)])
  lost = jnp.sum((g == 0) & (r != 0))
  return lost / jnp.maximum(jnp.sum(r != 0), 1)


def make_step(name, model, tx):
  ref_model = MLP(dtype=jnp.float32)
  scaled = name.endswith("loss scale")

  @jax.jit
  def step(params, opt_state, x, y):
    ref_grads = jax.grad(lambda p: loss_fn(ref_model, p, x, y))(params)
    if scaled:
      loss, grads = ols.value_and_grad(lambda p: loss_fn(model, p, x, y))(
        opt_state, params
      )
      scale = ols.get_scale(opt_state)
      applied_grads = ols.unscale(grads, scale)  # what the optimizer applies
    else:
      loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, x, y))(params)
      scale, applied_grads = jnp.float32(1.0), grads
    finite = ols.all_finite(applied_grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    lost = underflow_fraction(applied_grads, ref_grads)
    return params, opt_state, loss, scale, finite, lost

  return step


def run(name, dtype, tx, data, steps, batch, seed):
  x_train, x_test, y_train, y_test = data
  model = MLP(dtype=dtype)
  params = model.init(jax.random.key(seed), x_train[:1])["params"]
  opt_state = tx.init(params)
  step = make_step(name, model, tx)
  rng = np.random.default_rng(seed)
  hist = {"loss": [], "scale": [], "finite": [], "lost": []}
  for _ in tqdm(range(steps), desc=f"{name:>20}", leave=True):
    idx = rng.integers(0, len(x_train), batch)
    params, opt_state, loss, scale, finite, lost = step(
      params, opt_state, x_train[idx], y_train[idx]
    )
    for k, v in zip(hist, (loss, scale, finite, lost), strict=True):
      hist[k].append(v)
  hist = {k: np.asarray(jax.device_get(v), np.float64) for k, v in hist.items()}
  logits = model.apply({"params": params}, x_test).astype(jnp.float32)
  acc = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
  skipped = (
    int(ols.find_loss_scale_state(opt_state).skipped_steps)
    if name.endswith("loss scale")
    else 0
  )
  finite_steps = hist["finite"] > 0
  return dict(
    name=name,
    hist=hist,
    acc=acc,
    final_loss=float(np.mean(hist["loss"][-20:])),
    skipped=skipped,
    scale=float(hist["scale"][-1]) if name.endswith("loss scale") else None,
    lost=float(np.mean(hist["lost"][finite_steps]))
    if finite_steps.any()
    else float("nan"),
    nonfinite=int((~finite_steps).sum()),
  )


def plot(results, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
  for r in results:
    loss = r["hist"]["loss"]
    ax1.plot(np.arange(len(loss)), loss, label=r["name"], lw=1)
  ax1.set_yscale("log")
  ax1.set_ylabel("training loss")
  ax1.legend()
  scaled = [r for r in results if r["scale"] is not None][0]
  scale = scaled["hist"]["scale"]
  skipped = np.flatnonzero(scaled["hist"]["finite"] == 0)
  ax2.plot(np.arange(len(scale)), scale, label="loss scale (step input)")
  ax2.scatter(
    skipped,
    scale[skipped],
    color="red",
    marker="x",
    label=f"skipped steps ({len(skipped)})",
    zorder=3,
  )
  ax2.set_yscale("log", base=2)
  ax2.set_xlabel("step")
  ax2.set_ylabel("loss scale")
  ax2.legend()
  fig.suptitle("8x8 digits MLP: float32 vs float16 vs float16 + loss scaling")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def parse_args(argv=None):
  doc, seed = __doc__.splitlines()[0], "data split and init seed"
  parser = _cli.parser(doc, steps=1000, batch=128, seed=seed)
  parser.add_argument(
    "--lr", type=_cli.positive_float, default=1e-3, help="Adam's learning rate"
  )
  parser.add_argument(
    "--growth-interval",
    type=_cli.int_at_least(1),
    default=50,
    help="finite steps in a row before the loss scale doubles",
  )
  parser.add_argument(
    "--out",
    type=_cli.directory,
    default=_cli.default_out(),
    help="directory for the plot",
  )
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  os.makedirs(args.out, exist_ok=True)

  t0 = time.perf_counter()
  data = load_data(args.seed)
  adam = lambda: optax.adam(args.lr)
  configs = [
    ("float32", jnp.float32, adam()),
    ("float16", jnp.float16, adam()),
    (
      "float16 + loss scale",
      jnp.float16,
      ols.dynamic_loss_scale(adam(), growth_interval=args.growth_interval),
    ),
  ]
  results = [
    run(n, d, tx, data, args.steps, args.batch, args.seed) for n, d, tx in configs
  ]

  header = (
    f"{'run':<22}{'test acc':>9}{'loss':>9}{'skipped':>9}"
    f"{'scale':>10}{'underflow':>11}{'non-finite':>12}"
  )
  print("\n" + header + "\n" + "-" * len(header))
  for r in results:
    scale = "-" if r["scale"] is None else f"{r['scale']:.0f}"
    print(
      f"{r['name']:<22}{r['acc']:>9.3f}{r['final_loss']:>9.4f}"
      f"{r['skipped']:>9d}{scale:>10}{r['lost']:>11.2%}"
      f"{r['nonfinite']:>12d}"
    )
  print(
    "\nloss: mean of the last 20 training steps; underflow: fraction of "
    "gradient entries that are 0 where the float32 gradient at the same "
    "parameters and batch is not (mean over steps with finite gradients);"
    " non-finite: steps whose gradients, unscaled, were not finite (the"
    " loss-scaled run skipped them)."
  )
  path = os.path.join(args.out, "digits_loss_scale.png")
  plot(results, path)
  print(f"plot: {_cli.shown(path)}\ntotal time: {time.perf_counter() - t0:.1f} s")
  return results


if __name__ == "__main__":
  main()
