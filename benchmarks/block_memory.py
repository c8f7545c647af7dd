"""What block-scaled matmuls cost in memory: a train step's XLA temporary memory.

The main example's transformer (``examples/train_lm.py``'s ``Transformer``,
the sizes of ``train_lm_float8.py``'s defaults) compiled as one jitted train
step (``dynamic_loss_scale(adam)``, buffers donated) under
``autocast(compute_dtype=bfloat16)`` with ``matmul`` None (bfloat16),
``"float8"``, ``"mxfp8"`` and ``"nvfp4"``. Reported from XLA's memory
analysis of the compiled step (deterministic for a given XLA and backend):
the temporary bytes, the arguments and outputs, and the ratio of the
temporaries to bfloat16's. The block-scaled backward pass saves the
operands as they came and quantises them again, so it keeps no extra
copies across the step; its temporaries are the quantised and dequantised
operands of the GEMM being computed.

Run:  python benchmarks/block_memory.py [--batch 32] [--context 128] [--out PATH]
"""

from __future__ import annotations

import argparse

import _tasks  # noqa: F401  (puts examples/ on the path)
import jax
import jax.numpy as jnp
import optax
import train_lm
from _harness import machine_line, memory, table, write_report

import optax_lossscale as ols

MATMULS = {"bfloat16": None, "float8": "float8", "mxfp8": "mxfp8", "nvfp4": "nvfp4"}


def step_memory(matmul, batch, context, layers=2, width=128, heads=4):
  """XLA's memory analysis of the compiled train step, in bytes."""
  model = train_lm.Transformer(layers, width, heads, context, 256)
  tokens = jnp.zeros((batch, context + 1), jnp.int32)
  params = jax.eval_shape(
    lambda: model.init(jax.random.key(0), tokens[:, :-1])["params"]
  )
  loss = ols.autocast(
    lambda p, t: train_lm.loss_fn(model, p, t),
    compute_dtype=jnp.bfloat16,
    matmul=matmul,
  )
  tx = ols.dynamic_loss_scale(optax.adam(1e-3))
  state = jax.eval_shape(tx.init, params)

  def step(params, state, tokens):
    value, grads = ols.value_and_grad(loss)(state, params, tokens)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, tokens).compile()
  return memory(compiled)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--context", type=int, default=128)
  p.add_argument("--out", default=None, help="also write the Markdown here")
  args = p.parse_args(argv)
  rows = {name: step_memory(m, args.batch, args.context) for name, m in MATMULS.items()}
  ref = rows["bfloat16"]["temp"]
  header = ["matmuls", "temporary (MB)", "vs bfloat16", "arguments (MB)"]
  lines = [
    f"Machine: {machine_line()}.",
    "",
    f"Train step of the transformer (batch {args.batch}, context {args.context}), "
    f"XLA's memory analysis on {jax.devices()[0].platform}, jax {jax.__version__}:",
    "",
    *table(
      [*header, "outputs (MB)"],
      [
        [
          name,
          f"{r['temp'] / 1e6:.2f}",
          f"{r['temp'] / ref:.2f}x",
          f"{r['arguments'] / 1e6:.2f}",
          f"{r['outputs'] / 1e6:.2f}",
        ]
        for name, r in rows.items()
      ],
      "lrrrr",
    ),
  ]
  write_report("\n".join(lines), args.out)
  return rows


if __name__ == "__main__":
  main()
