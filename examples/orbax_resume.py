"""Checkpoint a loss-scaled run with Orbax, restore it in a new process, go on.

The whole training state (parameters, the Adam moments, the schedule's step
count, the loss scale and its counters) is one pytree of arrays, so Orbax
saves and restores it exactly. Run it twice:

  python examples/orbax_resume.py --steps 60 --save-at 30 --ckpt /tmp/ckpt \\
      --final /tmp/uninterrupted.npz
  python examples/orbax_resume.py --steps 60 --resume /tmp/ckpt/30 \\
      --final /tmp/resumed.npz

The first run trains 60 steps and saves at step 30; the second, a new
process, restores step 30 and trains to 60. Both write their final state;
they are bit-identical (``tests/test_flax_orbax.py`` checks it). ``--nan-at``
puts a NaN into the batch of the given steps, so that steps are skipped and
the scale backs off on both sides of the checkpoint.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from train_digits import MLP, load_data, loss_fn

import optax_lossscale as ols
from optax_lossscale.flax import LossScaleTrainState


def batch(data, step, size):
  """The batch of a step depends on the step only: a resumed run sees the same."""
  x_train, _, y_train, _ = data
  idx = np.random.default_rng(step).integers(0, len(x_train), size)
  return x_train[idx], y_train[idx]


def flat(tree):
  """{path: array} of every leaf, for comparing two runs."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--save-at", type=int, default=None)
  parser.add_argument("--ckpt", default=None, help="directory for checkpoints")
  parser.add_argument("--resume", default=None, help="checkpoint to restore")
  parser.add_argument("--final", default=None, help=".npz for the final state")
  parser.add_argument("--nan-at", default="10,31,32")
  parser.add_argument("--batch", type=int, default=64)
  args = parser.parse_args(argv)
  nan_at = {int(s) for s in args.nan_at.split(",") if s}

  data = load_data(0)
  model = MLP(dtype=jnp.float16)
  params = model.init(jax.random.key(0), data[0][:1])["params"]
  tx = ols.dynamic_loss_scale(
    optax.adam(optax.cosine_decay_schedule(1e-3, args.steps)), growth_interval=8
  )
  state = LossScaleTrainState.create(apply_fn=model.apply, params=params, tx=tx)
  checkpointer = ocp.StandardCheckpointer()

  start = 0
  if args.resume:
    # The fresh state is the target: it gives the tree structure and dtypes.
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    state = checkpointer.restore(os.path.abspath(args.resume), target)
    start = int(os.path.basename(os.path.normpath(args.resume)))
    print(f"restored step {start}: scale {float(state.loss_scale):.0f}")

  @jax.jit
  def train_step(state, x, y):
    loss, grads = state.value_and_grad(lambda p: loss_fn(model, p, x, y))(state.params)
    return state.apply_gradients(grads=grads), loss

  for i in range(start, args.steps):
    if args.save_at is not None and i == args.save_at:
      path = os.path.join(os.path.abspath(args.ckpt), str(i))
      checkpointer.save(path, state)
      checkpointer.wait_until_finished()
      print(f"saved step {i}: {path}")
    x, y = batch(data, i, args.batch)
    if i in nan_at:
      x = x.copy()
      x[0, 0] = np.nan
    state, loss = train_step(state, x, y)

  d = jax.device_get(state.diagnostics)
  print(
    f"step {args.steps}: applied {int(state.step)}  skipped "
    f"{int(d['skipped_steps'])}  scale {float(d['loss_scale']):.0f}  "
    f"loss {float(loss):.4f}"
  )
  if args.final:
    np.savez(args.final, **flat(state))
  checkpointer.close()


if __name__ == "__main__":
  main()
