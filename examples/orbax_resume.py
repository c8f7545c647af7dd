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
the scale backs off on both sides of the checkpoint. A checkpoint that
already exists is an error before any training, unless ``--overwrite``.

Or let it run both halves and compare them itself (exit 1 if they differ):

  python examples/orbax_resume.py --compare
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import _cli
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


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--steps", type=_cli.int_at_least(1), default=60, help="train up to this step"
  )
  parser.add_argument(
    "--save-at",
    type=_cli.int_at_least(0),
    default=None,
    help="save a checkpoint before this step (below --steps; needs --ckpt)",
  )
  parser.add_argument(
    "--ckpt",
    type=_cli.directory,
    default=None,
    help="directory for checkpoints (one per saved step)",
  )
  parser.add_argument(
    "--overwrite", action="store_true", help="replace a checkpoint that exists"
  )
  parser.add_argument(
    "--resume",
    type=_cli.directory,
    default=None,
    help="checkpoint to restore (CKPT/STEP, STEP below --steps) and go on from",
  )
  parser.add_argument(
    "--final", default=None, help=".npz file for the final state (every leaf)"
  )
  parser.add_argument(
    "--nan-at",
    type=_cli.steps_list,
    default="10,31,32",
    help="steps whose batch gets a NaN (comma list)",
  )
  parser.add_argument(
    "--batch", type=_cli.int_at_least(1), default=64, help="batch size"
  )
  parser.add_argument(
    "--compare",
    action="store_true",
    help="run both halves (saving at --save-at, default steps/2) in new "
    "processes and say whether they end bit-identical",
  )
  args = parser.parse_args(argv)
  _cli.require(
    parser,
    args.save_at is None or args.save_at < args.steps,
    f"--save-at ({args.save_at}) must be below --steps ({args.steps})",
  )
  _cli.require(
    parser,
    all(s < args.steps for s in args.nan_at),
    f"--nan-at steps {args.nan_at} must be below --steps ({args.steps})",
  )
  _cli.require(
    parser,
    args.save_at is None or args.compare or args.ckpt is not None,
    "--save-at needs --ckpt, the directory for checkpoints",
  )
  if args.resume is not None:
    step = os.path.basename(os.path.normpath(args.resume))
    _cli.require(
      parser,
      step.isdigit() and int(step) < args.steps,
      f"--resume ({args.resume}) must be a checkpoint directory CKPT/STEP, "
      f"STEP below --steps ({args.steps})",
    )
  return args


def check_inputs(args):
  """Exits 2 unless the checkpoint ``--resume`` names exists (checked when the
  command runs, after the run that saves it; :func:`parse_args` checks only
  the arguments)."""
  if args.resume is not None:
    _cli.missing(
      [] if os.path.isdir(args.resume) else [args.resume],
      f"--resume ({args.resume}) must be an existing checkpoint directory",
    )


def compare(args):
  """Both halves in new processes; returns whether they ended bit-identical."""
  save_at = args.save_at if args.save_at is not None else args.steps // 2
  me = [sys.executable, os.path.abspath(__file__)]
  common = [
    "--steps",
    str(args.steps),
    "--nan-at",
    ",".join(map(str, args.nan_at)),
    "--batch",
    str(args.batch),
  ]
  with tempfile.TemporaryDirectory() as tmp:
    ckpt = args.ckpt or os.path.join(tmp, "ckpt")
    a, b = os.path.join(tmp, "uninterrupted.npz"), os.path.join(tmp, "resumed.npz")
    first = ["--save-at", str(save_at), "--ckpt", ckpt, "--final", a]
    if args.overwrite:
      first.append("--overwrite")
    subprocess.run([*me, *common, *first], check=True)
    resume = os.path.join(ckpt, str(save_at))
    subprocess.run([*me, *common, "--resume", resume, "--final", b], check=True)
    fa, fb = np.load(a), np.load(b)
    differ = [
      k
      for k in fa.files
      if k not in fb.files
      or fa[k].dtype != fb[k].dtype
      or not np.array_equal(fa[k], fb[k])
    ]
    differ += [k for k in fb.files if k not in fa.files]
  if differ:
    print(f"bit-identical: no ({len(differ)} leaves differ: {', '.join(differ[:5])})")
  else:
    print(f"bit-identical: yes (all {len(fa.files)} leaves of the final state)")
  return not differ


def main(argv=None):
  args = parse_args(argv)
  check_inputs(args)
  if args.compare:
    raise SystemExit(0 if compare(args) else 1)
  nan_at = set(args.nan_at)
  path = None
  if args.save_at is not None:
    path = os.path.join(args.ckpt, str(args.save_at))
    if os.path.exists(path) and not args.overwrite:
      raise SystemExit(
        f"checkpoint {path} already exists: pass --overwrite to replace it, or "
        "another --ckpt"
      )
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
    state = checkpointer.restore(args.resume, target)
    start = int(os.path.basename(os.path.normpath(args.resume)))
    print(f"restored step {start}: scale {float(state.loss_scale):.0f}")

  @jax.jit
  def train_step(state, x, y):
    loss, grads = state.value_and_grad(lambda p: loss_fn(model, p, x, y))(state.params)
    return state.apply_gradients(grads=grads), loss

  for i in range(start, args.steps):
    if path is not None and i == args.save_at:
      # Refuses (naming the leaves) a state that holds NaN or inf.
      checkpointer.save(path, ols.check_checkpoint(state), force=args.overwrite)
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
    f"{int(d['skipped_steps'])}  scale {float(d['loss_scale']):.0f} (after the "
    f"last step's adjustment)  loss {float(loss):.4f}"
  )
  if args.final:
    np.savez(args.final, **flat(state))
  checkpointer.close()


if __name__ == "__main__":
  main()
