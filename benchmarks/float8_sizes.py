"""float8 against bfloat16 for one matmul of each shape: where float8 pays.

One command for one GPU, a few minutes long, that writes ``--out``
(default ``benchmarks/out/float8_sizes.md``): for each ``M:K:N`` of
``--shapes`` (M tokens, K the contraction, N the outputs), a layer
``y = x @ w`` (float32 ``x`` and ``w``, as a network's float32 parameters
and activations reach it) under ``ols.autocast(..., compute_dtype=bfloat16)``
and under ``matmul="float8"`` (and ``Float8Matmul(power_of_two=True)``,
whose bfloat16 product comes out of the GEMM with its rescale folded in, and
``Float8Matmul(fast_accumulation="all")``, whose gradient products also
accumulate fast: what float32 accumulation costs them),
timed forward and backward together (the
value and both gradients for a float32 cotangent, then ``x`` and ``w``
moved by 1e-6 of their gradients, so that nothing is left out; buffers
donated) by ``_harness.measure_many``: each time is the smallest of the
rounds' medians. The table gives the times, each float8 recipe's speed-up
over bfloat16 and the matmul TFLOP/s (6 M K N per step); then, for each
recipe, the least ``min(M, K, N)`` from which it was faster than bfloat16
at every shape measured with that dimension or more: the value for the
recipes' ``min_size`` (``Float8Matmul(min_size=...)``) on that GPU.

``--small`` runs tiny shapes (a few calls; XLA's backend optimisation
level 0), every code path in seconds on a CPU (what
``tests/test_float8_sizes.py`` runs); its numbers measure nothing.

Run:  python benchmarks/float8_sizes.py [--small] [--out PATH]   (see --help)
"""

from __future__ import annotations

import os
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]  # the harness; optax_lossscale, also when not installed

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _harness import (  # noqa: E402
  error_text,
  measure_many,
  small_defaults,
  small_parser,
  small_xla_flags,
  table,
)

import optax_lossscale as ols  # noqa: E402

#: Dense layers of transformers of d_model 1024 to 8192 (q/k/v, the MLP's
#: two), at 2048 and 8192 tokens, and a few smaller ones.
SHAPES = ",".join(
  f"{m}:{k}:{n}"
  for m in (2048, 8192)
  for k, n in (
    (256, 256),
    (512, 512),
    (1024, 1024),
    (1024, 4096),
    (4096, 1024),
    (2048, 2048),
    (2048, 8192),
    (8192, 2048),
    (4096, 4096),
    (4096, 16384),
    (16384, 4096),
    (8192, 8192),
  )
)
SMALL = {"shapes": "16:32:48,64:16:32,32:64:64", "calls": 3, "rounds": 1, "warmup": 1}
#: The precisions: the autocast that wraps the layer.
PRECISIONS = {
  "bfloat16": lambda f: ols.autocast(f, compute_dtype=jnp.bfloat16),
  "float8": lambda f: ols.autocast(f, compute_dtype=jnp.bfloat16, matmul="float8"),
  "float8 (power of two)": lambda f: ols.autocast(
    f, compute_dtype=jnp.bfloat16, matmul=ols.Float8Matmul(power_of_two=True)
  ),
  "float8 (fast accumulation)": lambda f: ols.autocast(
    f,
    compute_dtype=jnp.bfloat16,
    matmul=ols.Float8Matmul(fast_accumulation="all"),
  ),
}
#: The float8 recipes, each compared with bfloat16.
FLOAT8 = [p for p in PRECISIONS if p != "bfloat16"]


def parse_shapes(text):
  """``--shapes``: ``[(M, K, N), ...]``."""
  shapes = []
  for item in filter(None, text.split(",")):
    parts = item.split(":")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
      raise ValueError(f"a shape is M:K:N in positive integers, got {item!r}")
    shapes.append(tuple(map(int, parts)))
  if not shapes:
    raise ValueError("--shapes names no shape")
  return shapes


def entry(precision, shape, seed=0):
  """``(step, (x, w), dy)`` for :func:`_harness.measure_many`."""
  m, k, n = shape
  layer = PRECISIONS[precision](lambda x, w: x @ w)
  keys = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(keys[0], (m, k), jnp.float32)
  w = jax.random.normal(keys[1], (k, n), jnp.float32) / np.sqrt(k)
  dy = jax.random.normal(keys[2], (m, n), jnp.float32)

  def step(carry, dy):
    x, w = carry
    _, vjp = jax.vjp(layer, x, w)
    dx, dw = vjp(dy)
    return x + 1e-6 * dx, w + 1e-6 * dw

  return step, (x, w), dy


def break_even(results, recipe="float8"):
  """The least ``min(M, K, N)`` from which ``recipe`` was faster than
  bfloat16 at every measured shape with that least dimension or more;
  ``None`` if none."""
  mins = sorted({min(s) for s in results})
  for size in mins:
    if all(r["speed-up"][recipe] > 1 for s, r in results.items() if min(s) >= size):
      return size
  return None


def measure(shapes, args):
  results = {}
  for shape in shapes:
    try:
      timed = measure_many(
        [entry(p, shape) for p in PRECISIONS],
        args.calls,
        rounds=args.rounds,
        warmup=args.warmup,
      )
    except Exception as e:  # noqa: BLE001
      results[shape] = {"error": error_text(e)}
      print(f"  {shape}: {results[shape]['error']}", flush=True)
      continue
    times = {p: t["median_s"] for p, t in zip(PRECISIONS, timed, strict=True)}
    b = times["bfloat16"]
    results[shape] = {**times, "speed-up": {p: b / times[p] for p in FLOAT8}}
    print(
      f"  {shape}: " + ", ".join(f"{p} {t * 1e3:.3f} ms" for p, t in times.items()),
      flush=True,
    )
  return results


def report(args, argv, results, t_start):
  from _harness import environment, environment_lines

  env_rows, _ = environment()
  command = " ".join(
    ["python benchmarks/float8_sizes.py", *map(shlex.quote, argv or sys.argv[1:])]
  )
  rows = []
  for (m, k, n), r in results.items():
    if "error" in r:
      error = f"error: `{r['error'].replace('|', '/')}`"
      rows.append([m, k, n, error] + [""] * (2 * len(FLOAT8) + 1))
      continue
    flops = 6 * m * k * n
    rows.append(
      [m, k, n]
      + [f"{r[p] * 1e3:.3f}" for p in PRECISIONS]
      + [f"**{r['speed-up'][p]:.3f}**" for p in FLOAT8]
      + [" / ".join(f"{flops / r[p] / 1e12:.3g}" for p in PRECISIONS)]
    )
  timed = {s: r for s, r in results.items() if "error" not in r}
  least = {p: break_even(timed, p) if timed else None for p in FLOAT8}
  md = [
    "# float8 against bfloat16, one matmul of each shape",
    "",
    f"Made by `{command}`.",
    "",
    "## 1. Environment",
    "",
    *environment_lines(env_rows),
    "",
    "## 2. Forward and backward of one layer",
    "",
    "`y = x @ w` of float32 `x` (M x K) and `w` (K x N) under "
    '`ols.autocast(..., compute_dtype=jnp.bfloat16)`, with `matmul="float8"`, '
    "with `matmul=ols.Float8Matmul(power_of_two=True)` and with "
    '`matmul=ols.Float8Matmul(fast_accumulation="all")` (the gradient products '
    "too accumulate with fewer bits than float32 on a GPU): "
    "the value and both gradients, each time the smallest of "
    f"{args.rounds} rounds' medians of {args.calls} calls. *Speed-up*: "
    "bfloat16's time over the recipe's.",
    "",
    *table(
      ["M", "K", "N"]
      + [f"{p}, ms" for p in PRECISIONS]
      + [f"{p} speed-up" for p in FLOAT8]
      + [f"TFLOP/s: {' / '.join(PRECISIONS)}"],
      rows,
      "r" * (4 + 2 * len(FLOAT8) + 1),
    ),
    "",
    "Least `min(M, K, N)` from which the recipe was faster than bfloat16 at "
    "every shape measured:",
    "",
    *(
      f"- {p}: "
      + (f"**{n}** (`min_size={n}`)." if n else "none: it lost at a largest shape.")
      for p, n in least.items()
    ),
    "",
    f"Total wall time: {time.perf_counter() - t_start:.1f} s.",
  ]
  return "\n".join(md) + "\n"


def parse_args(argv=None):
  parser = small_parser(__doc__.splitlines()[0], SMALL)
  add = parser.add_argument
  add("--out", default=os.path.join(HERE, "out", "float8_sizes.md"), help="report")
  add("--small", action="store_true", help="tiny shapes (CPU, seconds)")
  add("--shapes", default=SHAPES, help="comma-separated M:K:N, one per layer")
  add("--calls", type=int, default=20, help="timed steps per round")
  add("--rounds", type=int, default=3, help="rounds of timing")
  add("--warmup", type=int, default=3, help="warm-up steps per round")
  args = parser.parse_args(argv)
  small_defaults(parser, args, SMALL)
  try:
    args.shape_list = parse_shapes(args.shapes)
  except ValueError as e:
    parser.error(str(e))
  for key in ("calls", "rounds"):
    if getattr(args, key) < 1:
      parser.error(f"--{key} must be at least 1")
  if args.warmup < 0:
    parser.error("--warmup must be at least 0")
  return args


def main(argv=None):
  args = parse_args(argv)
  if args.small:
    small_xla_flags()
  t_start = time.perf_counter()
  results = measure(args.shape_list, args)
  text = report(args, argv, results, t_start)
  out = os.path.abspath(args.out)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    f.write(text)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
