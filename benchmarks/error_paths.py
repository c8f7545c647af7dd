"""What naming the bad leaves costs: the checkpoint guard and the report, large trees.

A tree of N float32 leaves of N distinct sizes (so that no two leaves share
a compiled shape), one NaN in one leaf. Timed: ``check_checkpoint`` on the
finite tree (the happy path: the finite check, compiled once per tree
structure) and on the tree with the NaN (the error path: the same check,
then the leaves fetched and counted on the host), and ``nonfinite_report``
of a 1000-leaf record. Each time is the median of ``--repeats`` calls after
one warm-up call (so compilation is counted in "first call" only).

Run:  python benchmarks/error_paths.py [--leaves 40 1000] [--repeats 5] [--out PATH]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _harness import machine_line, table, timed, write_report

import optax_lossscale as ols


def tree(n: int, seed: int = 0, first: int = 1) -> dict:
  """``n`` float32 leaves of sizes ``first, first + 1, ...``."""
  rng = np.random.default_rng(seed)
  return {
    f"leaf{i:04d}": jnp.asarray(rng.normal(size=(first + i,)), jnp.float32)
    for i in range(n)
  }


def guard_refuses(bad):
  try:
    ols.check_checkpoint(bad)
  except ValueError:
    return
  raise AssertionError("check_checkpoint passed a tree with a NaN")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--leaves", type=int, nargs="+", default=[40, 1000])
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--out", default=None, help="also write the Markdown here")
  args = p.parse_args(argv)
  rows = []
  for n in args.leaves:
    good = tree(n)
    bad = dict(good)
    bad[f"leaf{n // 2:04d}"] = good[f"leaf{n // 2:04d}"].at[0].set(jnp.nan)
    ok = timed(lambda good=good: ols.check_checkpoint(good), args.repeats)
    err = timed(lambda bad=bad: guard_refuses(bad), args.repeats)
    cold = tree(n, first=n + 1)  # shapes the finite check has not compiled
    cold[f"leaf{n // 2:04d}"] = cold[f"leaf{n // 2:04d}"].at[0].set(jnp.nan)
    t = time.perf_counter()
    guard_refuses(cold)
    cold_s = time.perf_counter() - t
    tx = ols.dynamic_loss_scale(optax.sgd(0.1), track_nonfinite=True)
    state = tx.init(good)
    _, state = jax.jit(tx.update)(bad, state, good)
    rep = timed(lambda state=state: ols.nonfinite_report(state), args.repeats)
    rows.append(
      [
        n,
        f"{ok[0]:.3f} s / {ok[1] * 1e3:.1f} ms",
        f"{err[0]:.3f} s / {err[1] * 1e3:.1f} ms",
        f"{cold_s:.3f} s",
        f"{rep[0]:.3f} s / {rep[1] * 1e3:.1f} ms",
      ]
    )
  header = ["leaves", "check_checkpoint, finite: first / next"]
  header += ["one NaN, after the finite tree: first / next"]
  header += ["one NaN, cold (shapes never compiled)", "nonfinite_report: first / next"]
  lines = [
    f"Machine: {machine_line()}.",
    "",
    f"jax {jax.__version__} on {jax.devices()[0].platform}",
    "",
    *table(header, rows, "rrrrr"),
  ]
  write_report("\n".join(lines), args.out)


if __name__ == "__main__":
  main()
