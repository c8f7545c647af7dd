"""What a recipe quantises: a float32 operand itself, or its compute-dtype copy.

Under ``autocast(compute_dtype=bfloat16, matmul=recipe)`` a matmul whose
operands are float32 (the parameters, and the activations autocast keeps in
float32) can be quantised from the float32 values themselves, each scale
from that value's amax, or from their bfloat16 copies (float32 -> bfloat16
-> float8, the gradient coming back through the bfloat16 cast). The package
does the first; this script measures both, on the main example's
transformer (``examples/train_lm.py``, ``train_lm_float8.py``'s sizes, its
text and batches), for float8, MXFP8 and NVFP4, against float32:

* the gradient: ``|g - g32| / |g32|`` over all parameters (the global
  norm), and the worst leaf's;
* the loss: ``|L - L32|``;
* at the initial parameters and after ``--steps`` float32 Adam steps,
  each averaged over ``--batches`` batches, then over ``--seeds``
  initialisations (each its own batches: one initialisation's quantised
  weights are one draw of their rounding, which all its batches share);
* the train step's temporary memory (XLA's memory analysis,
  ``block_memory.py``'s step).

The second convention is the first with each float32 operand of a recipe's
matmul cast to the compute dtype before the recipe sees it (what autocast
did before it quantised float32 values themselves).

Run:  python benchmarks/quantize_source.py [--steps 100] [--seeds 8] [--batches 2]
      [--recipes float8,mxfp8,nvfp4] [--out PATH] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib

import _tasks  # (it puts examples/ on the path)
import block_memory
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _harness import machine_line, table, write_report

import optax_lossscale as ols
from optax_lossscale._lowbit import block_matmul as _block_matmul
from optax_lossscale._lowbit import float8 as _float8

RECIPES = ("float8", "mxfp8", "nvfp4")
CONVENTIONS = ("float32 value", "bfloat16 copy")


@contextlib.contextmanager
def bfloat16_copies():
  """Recipes see each float32 operand's bfloat16 copy (the other convention)."""
  saved = {m: m.dot_general for m in (_float8, _block_matmul)}

  def copying(dot):
    def dot_general(lhs, rhs, *args, **kwargs):
      cast = lambda x: x.astype(jnp.bfloat16) if x.dtype.itemsize >= 4 else x  # noqa: E731
      return dot(cast(lhs), cast(rhs), *args, **kwargs)

    return dot_general

  try:
    for module, dot in saved.items():
      module.dot_general = copying(dot)
    yield
  finally:
    for module, dot in saved.items():
      module.dot_general = dot


def task(batches, steps, seed=0):
  """The float32 transformer, its initial parameters, ``steps`` batches to
  train on and ``batches`` more (``_tasks.lm_task``'s text and sizes)."""
  _, params, windows, loss, _ = _tasks.lm_task(steps + batches, seed, jnp.float32)
  windows = [w for (w,) in windows]
  return loss, params, windows[:steps], windows[steps:]


def train_float32(loss, params, batches):
  """``params`` after one float32 Adam step per batch."""
  tx = optax.adam(1e-3)

  @jax.jit
  def step(p, s, t):
    grads = jax.grad(loss)(p, t)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  state = tx.init(params)
  for t in batches:
    params, state = step(params, state, t)
  return params


def errors(grad, params, batches, reference):
  """(gradient error, worst leaf's, loss error), each averaged over ``batches``."""
  out = []
  for t, (l32, g32) in zip(batches, reference, strict=True):
    value, g = grad(params, t)
    leaves = [
      (np.linalg.norm(np.asarray(a, np.float64) - b), np.linalg.norm(b))
      for a, b in zip(jax.tree.leaves(g), g32, strict=True)
    ]
    total = np.sqrt(sum(d * d for d, _ in leaves)) / np.sqrt(
      sum(n * n for _, n in leaves)
    )
    worst = max(d / n for d, n in leaves if n > 0)
    out.append((total, worst, abs(float(value) - l32)))
  return np.mean(out, axis=0)


def cases(seeds, batches, steps):
  """Per seed and point (initial, trained): parameters, batches, float32's
  losses and gradients."""
  out = []
  for seed in range(seeds):
    loss, params, train, held = task(batches, steps, seed)
    grad32 = jax.jit(jax.value_and_grad(loss))
    for point, at in (
      ("initial", params),
      ("trained", train_float32(loss, params, train)),
    ):
      reference = []
      for t in held:
        value, g = grad32(at, t)
        reference.append(
          (float(value), [np.asarray(x, np.float64) for x in jax.tree.leaves(g)])
        )
      out.append((point, at, held, reference))
  return loss, out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=100, help="float32 Adam steps first")
  p.add_argument("--seeds", type=int, default=8, help="initialisations (and texts)")
  p.add_argument("--batches", type=int, default=2, help="batches per seed")
  p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated")
  p.add_argument(
    "--quick", action="store_true", help="2 steps, 2 seeds, 1 batch, float8 only"
  )
  p.add_argument("--out", default=None, help="also write the Markdown here")
  args = p.parse_args(argv)
  if args.quick:
    args.steps, args.seeds, args.batches, args.recipes = 2, 2, 1, "float8"
  loss, found = cases(args.seeds, args.batches, args.steps)
  batch = 4 if args.quick else 32
  rows = []
  for recipe in args.recipes.split(","):
    if recipe not in RECIPES:
      p.error(f"--recipes: {recipe!r} is not one of {', '.join(RECIPES)}")
    for convention in CONVENTIONS:
      scope = (
        bfloat16_copies() if convention == "bfloat16 copy" else contextlib.nullcontext()
      )
      with scope:
        fast = ols.autocast(loss, compute_dtype=jnp.bfloat16, matmul=recipe)
        grad = jax.jit(jax.value_and_grad(fast))
        row = [recipe, convention]
        for point in ("initial", "trained"):
          per_seed = np.asarray(
            [errors(grad, at, held, ref) for p_, at, held, ref in found if p_ == point]
          )
          mean = per_seed.mean(axis=0)
          se = per_seed.std(axis=0, ddof=1) / np.sqrt(len(per_seed))
          row += [
            f"{mean[0]:.4f} ± {se[0]:.4f}",
            f"{mean[1]:.4f} ± {se[1]:.4f}",
            f"{mean[2]:.5f} ± {se[2]:.5f}",
          ]
        temp = block_memory.step_memory(recipe, batch, 128)["temp"]
        rows.append([*row, f"{temp / 1e6:.2f}"])
  header = ["recipe", "quantised from"]
  for at in ("initial", f"after {args.steps} steps"):
    header += [f"gradient error, {at}", "worst leaf", "loss error"]
  header.append(f"train step temporary (MB), batch {batch}")
  lines = [
    f"Machine: {machine_line()}.",
    "",
    "Against float32, on the main example's transformer (its text, batches of 24 "
    f"sequences of 128 bytes): {args.seeds} initialisations, each with its own "
    f"batches and float32 Adam steps; each error is the mean over the "
    f"initialisations (each over {args.batches} batches) ± its standard error; "
    f"temporary memory: XLA's memory analysis on {jax.devices()[0].platform}:",
    "",
    *table(header, rows, "ll" + "r" * (len(header) - 2)),
  ]
  write_report("\n".join(lines), args.out)
  return rows


if __name__ == "__main__":
  main()
