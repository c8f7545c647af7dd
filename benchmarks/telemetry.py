"""What ``track_nonfinite=True`` costs: the update step with the record on and off.

Measures, in one run, with the harness's timing (buffers donated, steps
called in turn, smallest of 3 rounds' medians):

* the update step of ``dynamic_loss_scale(optax.adam)`` on the shared
  workload's 8.4M float32 parameters in 64 leaves, bare Adam, the loss
  scale without and with the record, on finite gradients (and the step
  without the record a second time, for the noise), and with the record
  on gradients holding a NaN (the branch that writes it): XLA's "bytes
  accessed" (which counts the branch as if it ran), its temporary memory,
  the median time and the compile time;
* compile time by number of leaves: equal leaves (8M parameters split in
  1 to 4096) and leaves of distinct sizes (1, 2, ..., n), record off and on.

Run:  python benchmarks/telemetry.py [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import time

import _workloads as w
import jax
import jax.numpy as jnp
import optax
from _harness import TIMING, machine_line, measure_many, write_report

import optax_lossscale as ols


def tracked(track):
  return ols.dynamic_loss_scale(
    optax.adam(w.LR), initial_scale=w.SCALE, track_nonfinite=track
  )


def with_nan(grads):
  """``grads`` with one NaN, in the first layer's ``w1``."""
  first = sorted(grads)[0]
  w1 = grads[first]["w1"].at[0, 0].set(jnp.nan)
  return {**grads, first: {**grads[first], "w1": w1}}


def step_costs(calls, n_layers=16, width=512):
  params = w.layers(n_layers, width)
  grads = w.grads_like(params)
  on_nan = w.ours(params, with_nan(grads), tracked(True))
  entries = {
    "adam": w.bare_adam(params, grads),
    "loss scale, record off": w.ours(params, grads, tracked(False)),
    "loss scale, record on": w.ours(params, grads, tracked(True)),
    # A second instance of the step without the record: its ratio to the
    # first is the noise of the time column.
    "loss scale, record off, again": w.ours(params, grads, tracked(False)),
    # `ours` scales the gradients given: the NaN stays a NaN.
    "record on, every step non-finite": on_nan,
  }
  results = dict(zip(entries, measure_many(list(entries.values()), calls), strict=True))
  n = sum(x.size for x in jax.tree.leaves(params))
  base = results["adam"]
  lines = [
    f"Update step on {n / 1e6:.1f}M float32 parameters in "
    f"{len(jax.tree.leaves(params))} leaves. {TIMING}",
    "",
    "| step | bytes accessed | vs adam | temp memory | time | vs adam | compile |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for name, r in results.items():
    lines.append(
      f"| {name} | {r['bytes'] / 1e6:.1f} MB | {r['bytes'] / base['bytes']:.3f} "
      f"| {r['temp_bytes'] / 1e6:.2f} MB | {r['median_s'] * 1e3:.2f} ms "
      f"| {r['median_s'] / base['median_s']:.3f} | {r['compile_s']:.2f} s |"
    )
  return results, lines


def compile_s(params, track):
  tx = tracked(track)

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  t = time.perf_counter()
  jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), params).compile()
  return time.perf_counter() - t


def compile_times(counts, distinct, total=2**23):
  lines = [
    "Compile time (lower + compile, one run each) of the update step, record "
    "off and on. Equal leaves: 8M float32 parameters split into n leaves; "
    "distinct: n leaves of sizes 1, 2, ..., n.",
    "",
    "| leaves | equal: off | equal: on | distinct: off | distinct: on |",
    "| ---: | ---: | ---: | ---: | ---: |",
  ]
  rows = []
  for n in counts:
    equal = [jnp.ones((total // n,)) for _ in range(n)]
    sizes = (
      {f"p{i:04d}": jnp.ones((i + 1,)) for i in range(n)} if n in distinct else None
    )
    row = {"leaves": n}
    row["equal"] = [compile_s(equal, t) for t in (False, True)]
    row["distinct"] = (
      None if sizes is None else [compile_s(sizes, t) for t in (False, True)]
    )
    rows.append(row)
    d = row["distinct"]
    lines.append(
      f"| {n} | {row['equal'][0]:.2f} s | {row['equal'][1]:.2f} s | "
      + (f"{d[0]:.2f} s | {d[1]:.2f} s |" if d else "- | - |")
    )
    print(f"  {n} leaves done", flush=True)
  return rows, lines


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes, few calls")
  parser.add_argument("--calls", type=int, default=50)
  parser.add_argument(
    "--out", default=os.path.join("benchmarks", "out", "telemetry.md")
  )
  args = parser.parse_args(argv)
  if args.quick:
    _, step_lines = step_costs(calls=3, n_layers=2, width=64)
    _, compile_lines = compile_times([1, 16], distinct=[16], total=2**12)
  else:
    _, step_lines = step_costs(args.calls)
    _, compile_lines = compile_times([1, 64, 1024, 4096], distinct=[256, 1024])
  env = f"Machine: {machine_line()}."
  text = "\n".join(
    [
      env,
      "",
      "Update step:",
      "",
      *step_lines,
      "",
      "Compile time:",
      "",
      *compile_lines,
      "",
    ]
  )
  write_report(text, args.out)


if __name__ == "__main__":
  main()
