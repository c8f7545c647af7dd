"""How the number of leaves moves the update step's compile and step time.

* leaves: 8M float32 parameters split into 1 to 4096 equal leaves, compile
  and step time of bare ``optax.adam`` and ``dynamic_loss_scale(adam)``
  (and bare Adam again: the noise row); plotted to ``leaves.png``;
* distinct: compile time on n leaves of distinct sizes 1, 2, ..., n (no two
  leaves share a compiled shape), adam, ours and ``apply_if_finite(adam)``;
* finite: the finite check alone, one reduction per leaf against ours;
* tree: compile time of the update step on a GPT-2-shaped tree (d=128) of
  2, 12 and 24 blocks (29, 149 and 293 leaves): adam, adam with an unused
  finite check (what compiling one more read of the gradients costs: the
  floor of an exact skip), ``dynamic_loss_scale``,
  optax's ``apply_if_finite`` (for comparison), ``quantize_state`` and
  ``dynamic_loss_scale(master_weights(quantize_state))`` on bfloat16
  parameters, both also with ``layout="flat"``, alone and inside
  ``lax.scan``, as ratios to adam, with the lines XLA printed while
  compiling.

Run:  python benchmarks/leaves.py [--quick] [--sections leaves,distinct,finite,tree]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import optax
from _harness import (
  TIMING,
  compile_s,
  compiled,
  machine_line,
  measure_dropping_carry,
  table,
  write_report,
)
from _workloads import LR, bare_adam, ours

import optax_lossscale as ols


def leaves_sweep(calls, counts, total=2**23, rounds=3):
  results, rows = [], []
  for count in counts:
    n = total // count
    keys = jax.random.split(jax.random.key(0), count)
    params = [jax.random.normal(k, (n,)) for k in keys]
    grads = [p * 1e-3 for p in params]
    b, o, b2 = measure_dropping_carry(
      [bare_adam(params, grads), ours(params, grads), bare_adam(params, grads)],
      calls,
      rounds=rounds,
    )
    results.append({"leaves": count, "bare": b, "ours": o, "bare_again": b2})
    rows.append(
      [
        count,
        f"{b['compile_s']:.2f} s",
        f"{o['compile_s']:.2f} s",
        f"{b['median_s'] * 1e3:.2f} ms",
        f"{o['median_s'] * 1e3:.2f} ms",
        f"{o['median_s'] / b['median_s']:.3f}",
        f"{b2['median_s'] * 1e3:.2f} ms",
        f"{b2['median_s'] / b['median_s']:.3f}",
      ]
    )
    print(f"  {count} leaves done", flush=True)
  header = ["leaves", "compile: adam", "compile: ours", "step: adam", "step: ours"]
  header += ["step ratio", "step: adam again", "ratio"]
  lines = [
    f"{total / 2**20:.0f}M float32 parameters split into equal leaves. "
    '"adam again" is a second compiled instance of bare Adam, timed with the '
    f"others: its ratio to the first is the noise of that row. {TIMING}",
    "",
    *table(header, rows, "r" * 8),
  ]
  return results, lines


def distinct_shapes(counts):
  """Compile time of the update step on leaves of distinct sizes (1 .. n)."""
  optimizers = {
    "adam": lambda: optax.adam(LR),
    "ours": lambda: ols.dynamic_loss_scale(optax.adam(LR)),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(LR), 10),
  }
  results, rows = [], []
  for n in counts:
    params = {f"p{i:04d}": jnp.ones((i + 1,)) for i in range(n)}
    row = {"leaves": n}
    for name, make in optimizers.items():
      tx = make()

      def step(p, s, g, tx=tx):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

      row[name] = compile_s(
        step, params, tx.init(params), params, donate_argnums=(0, 1)
      )
      print(f"  {n} distinct sizes, {name}: {row[name]:.1f} s", flush=True)
    results.append(row)
    rows.append(
      [
        n,
        f"{row['adam']:.1f} s",
        f"{row['ours']:.1f} s",
        f"{row['ours'] / row['adam']:.2f}",
        f"{row['apply_if_finite']:.1f} s",
        f"{row['apply_if_finite'] / row['adam']:.2f}",
      ]
    )
  header = ["distinct sizes", "adam", "ours", "ratio", "`apply_if_finite(adam)`"]
  lines = [
    "Compile time (lower + compile, one run each) of the update step with "
    "buffers donated, on n float32 leaves of sizes 1, 2, ..., n.",
    "",
    *table([*header, "ratio"], rows, "r" * 6),
  ]
  return results, lines


def plot_sweep(results, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  x = [r["leaves"] for r in results]
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
  for key, label in (("bare", "optax.adam"), ("ours", "dynamic_loss_scale(adam)")):
    a1.plot(x, [r[key]["compile_s"] for r in results], "o-", label=label)
    a2.plot(x, [r[key]["median_s"] * 1e3 for r in results], "o-", label=label)
  for a, title in ((a1, "compile time (s)"), (a2, "step time (ms)")):
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("leaves (same total size)")
    a.set_title(title)
    a.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def per_leaf_check(tree):
  """The finite check as one reduction per leaf (what we do not do)."""
  return jnp.isfinite(sum(jnp.sum(x - x) for x in jax.tree.leaves(tree)))


def finite_checks(calls, counts, total=2**23):
  """``all_finite`` alone: one reduction per leaf vs ours, by number of leaves."""
  out, rows = [], []
  for count in counts:
    tree = [jnp.full((total // count,), 1.0) for _ in range(count)]
    row = {"leaves": count}
    for key, fn in (("per_leaf", per_leaf_check), ("ours", ols.all_finite)):
      t0 = time.perf_counter()
      compiled = jax.jit(fn).lower(tree).compile()
      row[key + "_compile_s"] = time.perf_counter() - t0
      jax.block_until_ready(compiled(tree))
      times = []
      for _ in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(compiled(tree))
        times.append(time.perf_counter() - t)
      row[key + "_s"] = statistics.median(times)
    out.append(row)
    rows.append(
      [
        count,
        f"{row['per_leaf_compile_s']:.2f} s",
        f"{row['per_leaf_s'] * 1e3:.2f} ms",
        f"{row['ours_compile_s']:.2f} s",
        f"{row['ours_s'] * 1e3:.2f} ms",
      ]
    )
    print(f"  {count} leaves done", flush=True)
  header = ["leaves", "per-leaf reductions: compile", "step", "ours: compile", "step"]
  lines = [
    f"The finite check alone on {total / 2**20:.0f}M float32 entries in equal "
    f"leaves; each time is the median of {calls} calls (one round).",
    "",
    *table(header, rows, "r" * 5),
  ]
  return out, lines


@contextlib.contextmanager
def xla_lines(out):
  """Appends to ``out`` the lines written to file descriptor 2 (where XLA
  prints) inside the block."""
  with tempfile.TemporaryFile("w+") as f:
    saved = os.dup(2)
    os.dup2(f.fileno(), 2)
    try:
      yield
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      f.seek(0)
      out.extend(line for line in f.read().splitlines() if line.strip())


def _with_unused_check(inner):
  """``inner``, its state also holding ``ols.all_finite`` of the gradients,
  which nothing reads: the finite check compiled beside the update."""

  def init_fn(params):
    return inner.init(params), jnp.array(True)

  def update_fn(updates, state, params=None):
    new_updates, new_state = inner.update(updates, state[0], params)
    return new_updates, (new_state, ols.all_finite(updates))

  return optax.GradientTransformation(init_fn, update_fn)


def decoder_trees(block_counts, scan_steps=4, scans=(False, True)):
  """Compile time of the update step on GPT-2-shaped trees, per optimizer."""
  from gpu_transformer import init_decoder

  optimizers = {
    "adam": (jnp.float32, lambda: optax.adam(LR)),
    "adam + an unused finite check": (
      jnp.float32,
      lambda: _with_unused_check(optax.adam(LR)),
    ),
    "dynamic_loss_scale(adam)": (
      jnp.float32,
      lambda: ols.dynamic_loss_scale(optax.adam(LR)),
    ),
    "optax.apply_if_finite(adam)": (
      jnp.float32,
      lambda: optax.apply_if_finite(optax.adam(LR), 10),
    ),
    "quantize_state(adam)": (jnp.float32, lambda: ols.quantize_state(optax.adam(LR))),
    "dls(master_weights(quantize_state(adam))), bf16": (
      jnp.bfloat16,
      lambda: ols.dynamic_loss_scale(
        ols.master_weights(ols.quantize_state(optax.adam(LR)))
      ),
    ),
    "quantize_state(adam, layout='flat')": (
      jnp.float32,
      lambda: ols.quantize_state(optax.adam(LR), layout="flat"),
    ),
    "dls(quantize_state(adam, layout='flat'))": (
      jnp.float32,
      lambda: ols.dynamic_loss_scale(ols.quantize_state(optax.adam(LR), layout="flat")),
    ),
    "dls(master_weights(quantize_state(adam, layout='flat'))), bf16": (
      jnp.bfloat16,
      lambda: ols.dynamic_loss_scale(
        ols.master_weights(ols.quantize_state(optax.adam(LR), layout="flat"))
      ),
    ),
  }
  results, rows, size_rows, printed = [], [], [], []
  for blocks in block_counts:
    p32 = init_decoder(jax.random.key(0), vocab=256, d_model=128, layers=blocks, seq=64)
    leaves = len(jax.tree.leaves(p32))
    cells = [leaves]
    for scanned in scans:
      row = {"leaves": leaves, "scan": scanned}
      for name, (dtype, make) in optimizers.items():
        params = jax.tree.map(lambda p, d=dtype: p.astype(d), p32)
        grads = jax.tree.map(lambda p: p * 1e-3, params)
        tx = make()

        def step(p, s, g, tx=tx):
          u, s = tx.update(g, s, p)
          return optax.apply_updates(p, u), s

        def steps(p, s, gs, step=step):
          return jax.lax.scan(lambda c, g: (step(*c, g), None), (p, s), gs)[0]

        state = tx.init(params)
        lines = []
        with xla_lines(lines):
          if scanned:
            stacked = jax.tree.map(lambda g: jnp.stack([g] * scan_steps), grads)
            row[name] = compile_s(steps, params, state, stacked)
          else:
            row[name], program = compiled(step, params, state, grads)
            # what XLA compiled, whose size its compile time grows with
            row[f"{name} HLO lines"] = len(program.as_text().splitlines())
        printed += [f"{leaves} leaves, {name}: {line}" for line in lines]
        print(
          f"  {leaves} leaves, scan {scanned}, {name}: {row[name]:.1f} s", flush=True
        )
      results.append(row)
      base = row["adam"]
      cells += [
        f"{base:.1f} s",
        *[f"{row[n] / base:.2f}" for n in list(optimizers)[1:]],
      ]
    rows.append(cells)
    unscanned = next((r for r in results[-len(scans) :] if not r["scan"]), None)
    if unscanned is None:
      continue
    lines_of = {n: unscanned[f"{n} HLO lines"] for n in optimizers}
    size_rows.append(
      [
        leaves,
        lines_of["adam"],
        *[f"{lines_of[n] / lines_of['adam']:.2f}" for n in list(optimizers)[1:]],
      ]
    )
  names = [
    "adam",
    "unused check",
    "loss scale",
    "apply_if_finite",
    "8-bit",
    "all three",
    "8-bit, flat",
    "loss scale + 8-bit, flat",
    "all three, flat",
  ]
  header = ["leaves"] + [
    f"{n}{' in scan' if scanned else ''}" for scanned in scans for n in names
  ]
  lines = [
    "Compile time (trace, lower and compile, one run each) of the update "
    "step on a GPT-2-shaped tree (d_model 128, vocabulary 256): adam's, and "
    "as ratios to it adam with an unused `ols.all_finite` of the gradients "
    "in its state (unused check: compiling one more read of the gradients, "
    "the floor of any exact skip), `dynamic_loss_scale(adam)` (loss scale), optax's "
    "`apply_if_finite(adam, 10)` (its skip of non-finite steps, for "
    "comparison), `quantize_state(adam)` (8-bit) and "
    "`dynamic_loss_scale(master_weights(quantize_state(adam)))` on bfloat16 "
    "parameters (all three), and both with `quantize_state(..., "
    'layout="flat")` (flat), the flat one also under the loss scale on float32 '
    "parameters (loss scale + 8-bit: all three but the master weights); in scan: "
    f"{scan_steps} steps in one `lax.scan`. Lines XLA printed while "
    f"compiling: {len(printed)}."
    + (
      " The second table is what XLA compiled (not in scan): lines of the "
      "compiled step's optimised HLO text, adam's and as ratios to it. Compile "
      "time grows with them: XLA compiles each fused kernel on its own, so work "
      "repeated for each leaf (an 8-bit leaf's decoder and encoder) is compiled "
      "once per leaf; the flat layout's codec is compiled once per moment "
      "field."
      if size_rows
      else ""
    ),
    "",
    *table(header, rows, "r" * len(header)),
    *[f"    {line}" for line in printed[:5]],
  ]
  if size_rows:
    lines += ["", *table(["leaves", *names], size_rows, "r" * (len(names) + 1))]
  return results, lines


def sections(calls, quick, out_dir):
  """``{key: (title, run)}`` of this question's sections, as ``bench.py`` runs
  them (``--quick``: fewer leaves); ``run()`` returns ``(results, lines)``."""
  more = [] if quick else [4096]

  def sweep():
    results, lines = leaves_sweep(calls, [1, 4, 16, 64, 256, 1024, *more])
    plot_sweep(results, os.path.join(out_dir, "leaves.png"))
    return results, lines

  return {
    "leaves": ("Number of leaves", sweep),
    "distinct": (
      "Leaves of distinct sizes",
      lambda: distinct_shapes([10, 100] if quick else [10, 100, 500]),
    ),
    "finite": (
      "The finite check alone",
      lambda: finite_checks(calls, [64, 1024, *more]),
    ),
    "tree": (
      "A transformer's tree: compile time",
      lambda: decoder_trees([1] if quick else [2, 12, 24]),
    ),
  }


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--calls", type=int, default=30, help="timed calls per round")
  p.add_argument(
    "--quick", action="store_true", help="few small leaves, 3 calls (a smoke run)"
  )
  p.add_argument(
    "--sections", default="leaves,distinct,finite,tree", help="comma-separated"
  )
  p.add_argument(
    "--out", default=None, help="also write the Markdown here (and the PNG)"
  )
  args = p.parse_args(argv)
  out_dir = os.path.dirname(os.path.abspath(args.out or "benchmarks/out/x"))
  os.makedirs(out_dir, exist_ok=True)
  if args.quick:  # a smoke run of each section: 2^16 parameters, few leaves
    total = 2**16
    runs = {
      "leaves": ("Number of leaves", lambda: leaves_sweep(3, [1, 16], total, rounds=1)),
      "distinct": ("Leaves of distinct sizes", lambda: distinct_shapes([10])),
      "finite": ("The finite check alone", lambda: finite_checks(3, [16], total)),
      "tree": (
        "A transformer's tree: compile time",
        lambda: decoder_trees([1], 2, (False,)),
      ),
    }
  else:
    runs = sections(args.calls, False, out_dir)
  md = [f"Machine: {machine_line()}.", ""]
  for key, (title, run) in runs.items():
    if key in args.sections.split(","):
      print(key, flush=True)
      _, lines = run()
      md += [f"### {title}", "", *lines, ""]
  write_report("\n".join(md), args.out)


if __name__ == "__main__":
  main()
