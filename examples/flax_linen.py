"""Loss scaling with Flax Linen's TrainState: ``LossScaleTrainState``.

Trains the main example's MLP (float16 compute, float32 parameters) on
scikit-learn's 8x8 digits with ``optax_lossscale.flax.LossScaleTrainState`` and
the Keras-style ``LossScaleOptimizer`` (Adam, global gradient clipping and an
EMA of the weights), logging the loss-scale diagnostics and checking for runs
of skipped steps on the host every ``--log-every`` steps.

Run:  python examples/flax_linen.py [--steps N]
"""

from __future__ import annotations

import _cli
import jax
import jax.numpy as jnp
import numpy as np
from train_digits import MLP, load_data, loss_fn

import optax_lossscale as ols
from optax_lossscale.flax import LossScaleTrainState


def parse_args(argv=None):
  doc = __doc__.splitlines()[0]
  seed = "data split and init seed"
  parser = _cli.parser(doc, steps=600, batch=128, log_every=100, seed=seed)
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)

  x_train, x_test, y_train, y_test = load_data(args.seed)
  model = MLP(dtype=jnp.float16)
  params = model.init(jax.random.key(args.seed), x_train[:1])["params"]
  tx = ols.porting.LossScaleOptimizer(
    "adam", dynamic_growth_steps=50, global_clipnorm=1.0, use_ema=True
  )
  state = LossScaleTrainState.create(apply_fn=model.apply, params=params, tx=tx)

  @jax.jit
  def train_step(state, x, y):
    scale = state.loss_scale  # the scale this step's gradients are computed with
    loss, grads = state.value_and_grad(lambda p: loss_fn(model, p, x, y))(state.params)
    state = state.apply_gradients(grads=grads)
    return state, loss, scale, state.diagnostics

  print("scale: the loss scale the step's gradients were computed with")
  rng = np.random.default_rng(args.seed)
  for i in range(args.steps):
    idx = rng.integers(0, len(x_train), args.batch)
    state, loss, scale, diag = train_step(state, x_train[idx], y_train[idx])
    if (i + 1) % args.log_every == 0:
      ols.check_skipped_steps(diag)  # raises if the run is stuck on NaN
      print(
        f"step {i + 1:5d}  loss {float(loss):.4f}  "
        f"scale {float(scale):>9.0f}  "
        f"skipped {int(diag['skipped_steps'])}"
      )

  def accuracy(params):
    logits = model.apply({"params": params}, x_test).astype(jnp.float32)
    return float(jnp.mean(jnp.argmax(logits, -1) == y_test))

  ema = tx.finalize_variable_values(state.params, state.opt_state)
  d = jax.device_get(state.diagnostics)
  print(
    f"applied steps {int(state.step)}  skipped {int(d['skipped_steps'])}  "
    f"final scale {float(d['loss_scale']):.0f} (after the last step's adjustment)"
  )
  print(
    f"test accuracy {accuracy(state.params):.3f}  with EMA weights {accuracy(ema):.3f}"
  )


if __name__ == "__main__":
  main()
