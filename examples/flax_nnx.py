"""Loss scaling with Flax NNX: ``nnx.Optimizer`` around ``dynamic_loss_scale``.

An NNX MLP (float16 compute, float32 parameters) on scikit-learn's 8x8
digits. ``nnx.Optimizer`` accepts any optax transformation, so loss scaling is
one wrapper; ``optax_lossscale.flax.nnx_value_and_grad`` computes the
gradients of the scaled loss, ``nnx_update`` applies them (warning about
gradients that are not of the scaled loss), and the package's helpers read
the scale and the counters from the optimizer itself.

Run:  python examples/flax_nnx.py [--steps N]
"""

from __future__ import annotations

import _cli
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from train_digits import load_data

import optax_lossscale as ols
from optax_lossscale.flax import nnx_update, nnx_value_and_grad


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, width: int = 256, dtype=jnp.float16):
    dims = [64, width, width, width, 10]
    self.layers = nnx.List(
      [
        nnx.Linear(a, b, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        for a, b in zip(dims[:-1], dims[1:], strict=True)
      ]
    )
    self.dtype = dtype

  def __call__(self, x):
    x = x.astype(self.dtype)
    for layer in self.layers[:-1]:
      x = nnx.relu(layer(x))
    return self.layers[-1](x)


def loss_fn(model, x, y):
  logits = model(x).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@nnx.jit
def train_step(model, optimizer, x, y):
  loss, grads = nnx_value_and_grad(loss_fn)(optimizer, model, x, y)
  nnx_update(optimizer, model, grads)  # unscale, check, skip or apply, adjust
  return loss, ols.diagnostics(optimizer)


def parse_args(argv=None):
  doc = __doc__.splitlines()[0]
  seed = "data split and init seed"
  parser = _cli.parser(doc, steps=600, batch=128, log_every=100, seed=seed)
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)

  x_train, x_test, y_train, y_test = load_data(args.seed)
  model = MLP(nnx.Rngs(args.seed))
  tx = ols.dynamic_loss_scale(optax.adam(1e-3), growth_interval=50)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  print("scale: the loss scale the step's gradients were computed with")
  rng = np.random.default_rng(args.seed)
  for i in range(args.steps):
    idx = rng.integers(0, len(x_train), args.batch)
    scale = ols.get_scale(optimizer)  # the scale this step computes with
    loss, diag = train_step(model, optimizer, x_train[idx], y_train[idx])
    if (i + 1) % args.log_every == 0:
      ols.check_skipped_steps(diag)
      print(
        f"step {i + 1:5d}  loss {float(loss):.4f}  "
        f"scale {float(scale):>9.0f}  "
        f"skipped {int(diag['skipped_steps'])}"
      )

  logits = model(x_test).astype(jnp.float32)
  acc = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
  # nnx.Optimizer.step counts every update call, skipped ones included.
  print(
    f"update calls {int(optimizer.step[...])}  skipped {int(diag['skipped_steps'])}  "
    f"final scale {float(ols.get_scale(optimizer)):.0f} (after the last step's "
    "adjustment)"
  )
  print(f"test accuracy {acc:.3f}")


if __name__ == "__main__":
  main()
