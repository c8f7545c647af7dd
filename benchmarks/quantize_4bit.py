"""What a 4-bit optimizer state would do to training: simulated, against 8 bits.

``quantize_state`` offers 8-bit codes only. This script measures whether a
4-bit width would be worth offering, without building it: Adam's moments
are rounded, after every update, to what a block-quantised state of each
width would hold (quantised and dequantised in float32, so the step sees
exactly the stored values), and the digits MLP and the main example's
transformer (``_tasks.py``) train with them, three seeds each. The
setups:

* float32 Adam;
* 8 bits simulated: ``quantize_state``'s own codec (dynamic maps, blocks of
  256, square roots of the second moment). It checks the simulation: one
  rounding gives the codec's values bit for bit
  (``tests/test_benchmarks.py``); over a run, XLA compiles the two
  programs differently, their last bits part and the losses differ as
  another seed's would;
* 4 bits, dynamic maps: bitsandbytes' dynamic map with 4 bits
  (``create_dynamic_map(signed, max_exponent_bits=3, total_bits=4)``,
  16 values), blocks of 128, square roots of the second moment;
* 4 bits, torchao's maps: the 4-bit dynamic map for the first moment and a
  linear map without zero (1/16, 2/16, ..., 1) for the second, blocks of
  128 (the storage of torchao's ``AdamW4bit``, without its rank-1
  normalisation).

The tables' bytes are those each setup would store (codes and a float32
scale per block; the MLP's small leaves aside), not the simulation's.

Run:  python benchmarks/quantize_4bit.py [--quick] [--models mlp,lm]
It prints Markdown tables and writes them to ``--out``.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _tasks import lm_task, mlp_task
from quantize_state import F32, compare, train_table

from optax_lossscale._params import quantize_codec as _codec

HERE = os.path.dirname(os.path.abspath(__file__))


def qdq(x, values_signed, values_unsigned, block, sqrt):
  """``x`` rounded to what a block-quantised leaf holds: blocks of ``block``,
  each scaled by its largest magnitude (a signed block, where it is larger,
  by its least value's magnitude over the magnitude of the signed map's
  least value, as the codec does) and rounded to the nearest value of its
  map (signed where the block has a value below 0)."""
  flat = x.reshape(-1)
  pad = -flat.size % block
  b = jnp.pad(flat, (0, pad)).reshape(-1, block)
  signed = jnp.min(b, axis=1, keepdims=True) < 0
  y = b if not sqrt else jnp.where(signed, b, jnp.sqrt(jnp.maximum(b, 0)))
  end = np.float32(1) / np.float32(-values_signed[0])
  least = -jnp.min(y, axis=1, keepdims=True) * end
  absmax = jnp.maximum(jnp.max(y, axis=1, keepdims=True), jnp.where(signed, least, 0))
  s = y / jnp.where(absmax > 0, absmax, 1.0)

  def nearest(values):  # as the codec rounds: up where s >= the threshold
    up = jnp.asarray(_codec.thresholds(values)[:-1])
    return jnp.asarray(values)[jnp.searchsorted(up, s, side="right")]

  v = jnp.where(signed, nearest(values_signed), nearest(values_unsigned)) * absmax
  if sqrt:
    v = jnp.where(signed, v, v * v)
  return v.reshape(-1)[: flat.size].reshape(x.shape)


def simulated(inner, values_signed, values_unsigned, block, sqrt, min_size=4096):
  """``inner`` whose large state leaves are rounded by :func:`qdq` after each
  update (the next update reads exactly what a quantised state would hold)."""

  def init(params):
    return inner.init(params)

  def update(updates, state, params=None):
    shapes = {tuple(p.shape) for p in jax.tree.leaves(params)}
    updates, state = inner.update(updates, state, params)
    rounded = lambda x: (  # noqa: E731
      qdq(x, values_signed, values_unsigned, block, sqrt)
      if hasattr(x, "shape") and tuple(x.shape) in shapes and x.size >= min_size
      else x
    )
    return updates, jax.tree.map(rounded, state)

  return optax.GradientTransformation(init, update)


def _two_maps(inner_lr, m_map, nu_map, block, sqrt):
  """Adam whose first moment (signed blocks) uses ``m_map`` and second
  (unsigned blocks) ``nu_map``."""
  return simulated(optax.adam(inner_lr), m_map, nu_map, block, sqrt)


EIGHT = (_codec.dynamic_map(True), _codec.dynamic_map(False))
FOUR = (_codec.dynamic_map(True, bits=4), _codec.dynamic_map(False, bits=4))
LINEAR = (np.arange(1, 17) / 16).astype(np.float32)

#: Adam's state in bytes a parameter as each setup would store it: two
#: moments of codes and one float32 scale per block.
STATE_BYTES = {
  "float32 Adam": 8.0,
  "8 bits simulated (blocks of 256, sqrt(nu))": 2 * (1 + 4 / 256),
  "4 bits, dynamic maps (blocks of 128, sqrt(nu))": 2 * (0.5 + 4 / 128),
  "4 bits, torchao's maps (blocks of 128, nu linear without 0)": 2 * (0.5 + 4 / 128),
}

CONFIGS = {
  "float32 Adam": (F32, optax.adam),
  "8 bits simulated (blocks of 256, sqrt(nu))": (
    F32,
    lambda lr: _two_maps(lr, *EIGHT, 256, True),
  ),
  "4 bits, dynamic maps (blocks of 128, sqrt(nu))": (
    F32,
    lambda lr: _two_maps(lr, *FOUR, 128, True),
  ),
  "4 bits, torchao's maps (blocks of 128, nu linear without 0)": (
    F32,
    lambda lr: _two_maps(lr, FOUR[0], LINEAR, 128, False),
  ),
}


def main(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  p.add_argument("--lm-steps", type=int, default=300, help="transformer steps per run")
  p.add_argument("--mlp-steps", type=int, default=1000, help="MLP steps per run")
  p.add_argument("--seeds", type=int, default=3, help="seeds per configuration")
  p.add_argument("--lm-lr", type=float, default=1e-3, help="transformer learning rate")
  p.add_argument("--mlp-lr", type=float, default=3e-4, help="MLP learning rate")
  p.add_argument("--models", default="mlp,lm", help="comma-separated")
  p.add_argument("--quick", action="store_true", help="a few steps of each")
  p.add_argument(
    "--out", default=os.path.join(HERE, "out", "quantize_4bit.md"), help="report"
  )
  args = p.parse_args(argv)
  if args.quick:
    args.lm_steps, args.mlp_steps, args.seeds = 5, 20, 1
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  parts = []
  tasks = {
    "mlp": ("MLP", mlp_task, args.mlp_steps, args.mlp_lr, "test set of the digits"),
    "lm": ("Transformer", lm_task, args.lm_steps, args.lm_lr, "nats per byte"),
  }
  for key in args.models.split(","):
    title, task, steps, lr, unit = tasks[key]
    print(f"{title}:", flush=True)
    results = compare(task, steps, range(args.seeds), lr, CONFIGS)
    parts += [
      f"{title} ({steps} steps, learning rate {lr}, seeds 0-{args.seeds - 1}; "
      f"validation loss, {unit}):",
      train_table(results, state_bytes=STATE_BYTES),
    ]
    print("\n\n".join(parts[-2:]), flush=True)
  with open(args.out, "w") as f:
    f.write("\n\n".join(parts) + "\n")


if __name__ == "__main__":
  main()
