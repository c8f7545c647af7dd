"""Data-parallel loss scaling over 8 (simulated) devices with sharded jit.

The main example's MLP (float16 compute, float32 parameters) on scikit-learn's
8x8 digits, the batch sharded over a mesh of 8 devices and the parameters
and optimizer state replicated. At the ``--nan-at`` steps one device's shard
of the batch gets a NaN: the finite check is a reduction over the global
gradients, so every device skips that step and backs off its scale
identically. Each step prints the scale every device holds and whether it
skipped; the run ends with a check that all devices always agreed.

Run:  python examples/data_parallel.py [--steps N] [--devices 8]
"""

from __future__ import annotations

import argparse
import os
import sys

import _cli


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  count = _cli.int_at_least(1)
  parser.add_argument("--steps", type=count, default=60, help="training steps")
  parser.add_argument(
    "--batch", type=count, default=128, help="global batch (a multiple of --devices)"
  )
  parser.add_argument(
    "--devices", type=count, default=8, help="simulated CPU devices in the mesh"
  )
  parser.add_argument(
    "--nan-at",
    type=_cli.steps_list,
    default="10,11,40",
    help="steps whose batch gets a NaN (comma list, each below --steps)",
  )
  parser.add_argument(
    "--bad-device",
    type=_cli.int_at_least(0),
    default=3,
    help="the device whose shard gets the NaN (below --devices)",
  )
  parser.add_argument(
    "--growth-interval",
    type=count,
    default=8,
    help="finite steps in a row before the loss scale doubles",
  )
  args = parser.parse_args(argv)
  _cli.require(
    parser,
    args.batch % args.devices == 0,
    f"--batch ({args.batch}) must be a multiple of --devices ({args.devices})",
  )
  _cli.require(
    parser,
    args.bad_device < args.devices,
    f"--bad-device ({args.bad_device}) must be below --devices ({args.devices})",
  )
  _cli.require(
    parser,
    all(s < args.steps for s in args.nan_at),
    f"--nan-at steps {args.nan_at} must be below --steps ({args.steps})",
  )
  return args


args = parse_args(sys.argv[1:]) if __name__ == "__main__" else None
# Simulated CPU devices must be requested before JAX starts.
if args is not None and "--xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={args.devices}"
  )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from train_digits import MLP, load_data, loss_fn  # noqa: E402

import optax_lossscale as ols  # noqa: E402


def main(args):
  n = args.devices
  if jax.device_count() < n:
    raise SystemExit(f"need {n} devices, have {jax.device_count()}")
  nan_at = set(args.nan_at)
  mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  replicated = NamedSharding(mesh, P())
  sharded = NamedSharding(mesh, P("data"))

  x_train, x_test, y_train, y_test = load_data(0)
  model = MLP(dtype=jnp.float16)
  params = model.init(jax.random.key(0), x_train[:1])["params"]
  tx = ols.dynamic_loss_scale(optax.adam(1e-3), growth_interval=args.growth_interval)
  params = jax.device_put(params, replicated)
  opt_state = jax.jit(tx.init, out_shardings=replicated)(params)

  @jax.jit
  def step(params, opt_state, x, y):
    loss, grads = ols.value_and_grad(lambda p: loss_fn(model, p, x, y))(
      opt_state, params
    )
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def on_each_device(x):
    return [np.asarray(s.data).item() for s in x.addressable_shards]

  rng = np.random.default_rng(0)
  rows = args.batch // n
  print(f"{n} devices, global batch {args.batch} ({rows} rows per device)")
  print("scale: the loss scale the step's gradients were computed with")
  print(f"{'step':>5} {'loss':>8} {'scale (all devices)':>20} {'skipped':>8}")
  disagreements = 0
  for i in range(args.steps):
    idx = rng.integers(0, len(x_train), args.batch)
    x, y = x_train[idx], y_train[idx]
    if i in nan_at:  # a NaN in the rows that --bad-device holds
      x = x.copy()
      x[args.bad_device * rows, 0] = np.nan
    x, y = jax.device_put(x, sharded), jax.device_put(y, sharded)
    scales = on_each_device(opt_state.loss_scale)  # what this step computes with
    params, opt_state, loss = step(params, opt_state, x, y)
    skipped = on_each_device(opt_state.consecutive_skips > 0)
    agree = len(set(scales)) == 1 and len(set(skipped)) == 1
    disagreements += not agree
    note = f"  <- NaN on device {args.bad_device}" if i in nan_at else ""
    print(
      f"{i:>5} {float(loss):>8.4f} {scales[0]:>20.0f} "
      f"{'yes' if skipped[0] else 'no':>8}{'' if agree else '  DISAGREE'}{note}"
    )

  logits = model.apply({"params": params}, x_test).astype(jnp.float32)
  acc = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
  d = jax.device_get(ols.diagnostics(opt_state))
  print(
    f"skipped {int(d['skipped_steps'])} of {args.steps} steps; final scale "
    f"{float(d['loss_scale']):.0f} (after the last step's adjustment); test "
    f"accuracy {acc:.3f}; steps where the devices disagreed: {disagreements}"
  )
  return disagreements


if __name__ == "__main__":
  raise SystemExit(1 if main(args) else 0)
