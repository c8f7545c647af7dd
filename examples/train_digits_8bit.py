"""Train the digits MLP with Adam's moments in 8 bits, against float32 Adam.

1. ``float32 Adam``: float32 parameters, Adam's two moments in float32.
2. ``8-bit Adam``: the same parameters, the moments stored by
   ``optax_lossscale.quantize_state``: 8-bit codes, a float32 scale per
   block of 256.
3. ``bf16 + masters + 8-bit``: bfloat16 parameters, exact float32 masters
   kept as ``master_weights``' remainders, and 8-bit moments.

The MLP, its data (scikit-learn's 8x8 digits: nothing is downloaded) and its
batches are those of ``train_digits.py``. The script prints a table (test
accuracy and loss, the last steps' training loss, and the bytes a parameter
of the parameters and of the optimizer's state, which are exact: every leaf
of both, counted), and each run's test loss minus float32 Adam's.

Run:  python examples/train_digits_8bit.py [--steps N] [--lr LR]
"""

from __future__ import annotations

import time

import _cli
import jax
import jax.numpy as jnp
import numpy as np
import optax
from train_digits import MLP, load_data, loss_fn

import optax_lossscale as ols


def nbytes(tree) -> int:
  """Bytes of every array in ``tree`` (codes, scales, counters included)."""
  return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def run(name, dtype, tx, data, steps, batch, seed):
  """Train one setup; its test accuracy and loss, training loss and bytes."""
  x_train, x_test, y_train, y_test = data
  model = MLP(dtype=jnp.float32)  # float32 compute; parameters in `dtype`
  params = model.init(jax.random.key(seed), x_train[:1])["params"]
  params = jax.tree.map(lambda p: p.astype(dtype), params)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, x, y))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(seed)
  losses = []
  for _ in range(steps):
    idx = rng.integers(0, len(x_train), batch)
    params, opt_state, loss = step(params, opt_state, x_train[idx], y_train[idx])
    losses.append(loss)
  logits = model.apply({"params": params}, x_test).astype(jnp.float32)
  n = sum(p.size for p in jax.tree.leaves(params))
  return dict(
    name=name,
    acc=float(jnp.mean(jnp.argmax(logits, -1) == y_test)),
    test_loss=float(
      optax.softmax_cross_entropy_with_integer_labels(logits, y_test).mean()
    ),
    train_loss=float(np.mean(jax.device_get(losses[-20:]))),
    param_bytes=nbytes(params) / n,
    state_bytes=nbytes(opt_state) / n,
  )


def parse_args(argv=None):
  doc, seed = __doc__.splitlines()[0], "data split and init seed"
  parser = _cli.parser(doc, steps=1000, batch=128, seed=seed)
  parser.add_argument(
    "--lr", type=_cli.positive_float, default=1e-3, help="Adam's learning rate"
  )
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  t0 = time.perf_counter()
  data = load_data(args.seed)
  adam = lambda: optax.adam(args.lr)
  configs = [
    ("float32 Adam", jnp.float32, adam()),
    ("8-bit Adam", jnp.float32, ols.quantize_state(adam())),
    (
      "bf16 + masters + 8-bit",
      jnp.bfloat16,
      ols.master_weights(ols.quantize_state(adam()), store="remainder"),
    ),
  ]
  results = [
    run(n, d, tx, data, args.steps, args.batch, args.seed) for n, d, tx in configs
  ]

  header = (
    f"{'run':<24}{'test acc':>9}{'test loss':>10}{'train loss':>11}"
    f"{'gap':>8}{'params B':>9}{'state B':>8}{'total B':>8}"
  )
  print("\n" + header + "\n" + "-" * len(header))
  for r in results:
    print(
      f"{r['name']:<24}{r['acc']:>9.3f}{r['test_loss']:>10.4f}"
      f"{r['train_loss']:>11.4f}{r['test_loss'] - results[0]['test_loss']:>+8.4f}"
      f"{r['param_bytes']:>9.2f}{r['state_bytes']:>8.2f}"
      f"{r['param_bytes'] + r['state_bytes']:>8.2f}"
    )
  print(
    "\ntest loss: cross-entropy on the held-out digits; train loss: mean of the "
    "last 20 steps; B: bytes a parameter (the state's: Adam's moments, their "
    "scales, the masters' remainders, the small leaves kept in float32 and the "
    "step count); gap: test loss minus float32 Adam's."
  )
  print(f"total time: {time.perf_counter() - t0:.1f} s")
  return results


if __name__ == "__main__":
  main()
