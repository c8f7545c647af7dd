"""An unmodified float32 Flax model in mixed precision: ``enable_mixed_precision``.

The main example's MLP, written for float32 (no dtype arguments), trained on
scikit-learn's 8x8 digits twice: as written, and through
``optax_lossscale.porting.enable_mixed_precision``, which rewrites the loss
function's jaxpr (matmuls in float16, exponentials, logarithms and sums in
float32) and wraps Adam in dynamic loss scaling. Prints both test accuracies
and the fraction of the loss function's FLOPs that run in float16, counted
on the rewritten jaxpr.

Run:  python examples/mixed_precision.py [--steps N]
"""

from __future__ import annotations

import math

import _cli
import jax
import jax.numpy as jnp
import numpy as np
import optax
from train_digits import MLP, load_data

import optax_lossscale as ols


def flops(jaxpr) -> dict[str, float]:
  """FLOPs of a jaxpr by output dtype (matmul/conv: 2 per multiply-add)."""
  out: dict[str, float] = {}
  for e in jaxpr.eqns:
    for p in e.params.values():
      for sub in p if isinstance(p, tuple) else (p,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          for k, v in flops(inner).items():
            out[k] = out.get(k, 0.0) + v
    if not e.outvars or not hasattr(e.outvars[0].aval, "shape"):
      continue
    aval = e.outvars[0].aval
    size = math.prod(aval.shape)
    if e.primitive.name == "dot_general":
      (lhs_contract, _), _ = e.params["dimension_numbers"]
      lhs = e.invars[0].aval.shape
      n = 2.0 * size * math.prod(lhs[d] for d in lhs_contract)
    elif e.primitive.name == "conv_general_dilated":
      rhs = e.invars[1].aval.shape
      n = 2.0 * size * math.prod(rhs) / rhs[e.params["dimension_numbers"].rhs_spec[0]]
    else:
      n = float(size)
    key = aval.dtype.name
    out[key] = out.get(key, 0.0) + n
  return out


def train(loss_fn, tx, params, data, steps, batch):
  x_train, _, y_train, _ = data
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, x, y):
    loss, grads = ols.value_and_grad(loss_fn)(opt_state, params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(0)
  for _ in range(steps):
    idx = rng.integers(0, len(x_train), batch)
    params, opt_state, loss = step(params, opt_state, x_train[idx], y_train[idx])
  return params, opt_state


def parse_args(argv=None):
  parser = _cli.parser(__doc__.splitlines()[0], steps=1000, batch=128)
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)

  data = load_data(0)
  x_train, x_test, y_train, y_test = data
  model = MLP()  # float32 as written: no dtype arguments
  params = model.init(jax.random.key(0), x_train[:1])["params"]

  def loss_fn(params, x, y):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def accuracy(apply, params):
    logits = apply({"params": params}, x_test)
    return float(jnp.mean(jnp.argmax(logits, -1) == y_test))

  f32_params, _ = train(
    loss_fn,
    ols.porting.with_loss_scale(optax.adam(1e-3), ols.porting.NoOpLossScale()),
    params,
    data,
    args.steps,
    args.batch,
  )
  fast_loss, tx = ols.porting.enable_mixed_precision(
    loss_fn, optax.adam(1e-3), compute_dtype=jnp.float16, growth_interval=50
  )
  mp_params, mp_state = train(fast_loss, tx, params, data, args.steps, args.batch)
  fast_apply = ols.autocast(model.apply, compute_dtype=jnp.float16)

  jaxpr = jax.make_jaxpr(jax.grad(fast_loss))(params, x_train[:128], y_train[:128])
  counts = flops(jaxpr.jaxpr)
  half = counts.get("float16", 0.0) / sum(counts.values())
  d = jax.device_get(ols.diagnostics(mp_state))
  print(
    f"float32 as written          test accuracy {accuracy(model.apply, f32_params):.3f}"
  )
  print(
    f"enable_mixed_precision      test accuracy {accuracy(fast_apply, mp_params):.3f}"
    f"  (skipped steps: {int(d['skipped_steps'])}, final scale "
    f"{float(d['loss_scale']):.0f}, after the last step's adjustment)"
  )
  print(f"FLOPs in float16 (forward and backward of the loss): {half:.1%}")


if __name__ == "__main__":
  main()
