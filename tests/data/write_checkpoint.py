"""Writes ``checkpoint_v0_1/``: optimizer states of this release, saved with Orbax.

Kept in the tests' data so that a later release's change of a state's form
is caught (``tests/test_checkpoint_compat.py`` restores these into the
current optimizers). Run once per state form, never over an existing
directory: ``python tests/data/write_checkpoint.py tests/data/checkpoint_v0_1``.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import optax_lossscale as ols

F32, BF16 = jnp.float32, jnp.bfloat16


def optimizers():
  """name -> (transformation, parameters); the test builds the same."""
  bf16 = {
    "w": jnp.linspace(-1, 1, 4096, dtype=F32).astype(BF16).reshape(64, 64),
    "b": jnp.zeros(64, BF16),
  }
  f32 = {"w": jnp.linspace(-1, 1, 64, dtype=F32).reshape(8, 8), "b": jnp.zeros(8)}
  return {
    "dynamic_master_quantized": (
      ols.dynamic_loss_scale(
        ols.master_weights(ols.quantize_state(optax.adam(1e-3))),
        initial_scale=2.0**10,
        track_nonfinite=True,
      ),
      bf16,
    ),
    "static_adamw": (ols.static_loss_scale(optax.adamw(1e-3), 128.0), f32),
    "keras_adam": (ols.porting.LossScaleOptimizer("adam", initial_scale=2.0**10), f32),
  }


def grads(params, step):
  """Step 1's gradients hold a NaN (a skipped step is in the record)."""
  g = jax.tree.map(lambda p: jnp.full(p.shape, 0.5 * (step + 1), p.dtype), params)
  if step == 1:
    g["b"] = g["b"].at[0].set(jnp.nan)
  return g


def trained(tx, params, steps=3):
  state = tx.init(params)
  for t in range(steps):
    updates, state = jax.jit(tx.update)(grads(params, t), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def main(root):
  checkpointer = ocp.StandardCheckpointer()
  for name, (tx, params) in optimizers().items():
    params, state = trained(tx, params)
    checkpointer.save(f"{root}/{name}", {"params": params, "state": state})
    checkpointer.wait_until_finished()
    leaves = jax.tree.leaves({"params": params, "state": state})
    np.savez(
      f"{root}/{name}.npz",
      **{
        str(i): np.frombuffer(np.asarray(x).tobytes(), np.uint8)
        for i, x in enumerate(leaves)
      },
    )
  checkpointer.close()


if __name__ == "__main__":
  main(sys.argv[1])
