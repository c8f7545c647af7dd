"""The loss scale's tables in one run: update step, dtypes, leaves, train step, designs.

Runs, in one process, the sections of the scripts that answer one question
each, and writes their tables together:

* headline, dtypes: ``update_step.py`` (the update step against its peers;
  float16 vs float32);
* leaves, distinct, finite: ``leaves.py`` (compile and step time by number
  of leaves; leaves of distinct sizes; the finite check alone);
* train: ``train_step.py`` (forward + backward + update of an MLP and of a
  small transformer);
* designs: ``designs.py`` (the skip and the finite check as built vs the
  designs rejected).

Each row: XLA's cost analysis ("bytes accessed" of the compiled step), the
median wall time over ``--calls`` calls after warm-up (buffers donated, each
call's outputs fed to the next; the steps of a table called in turn, see
``_harness.measure_many``) and XLA's temporary memory.

Run:  python benchmarks/bench.py [--quick] [--out benchmarks/out]
It prints Markdown tables (also written to OUT/tables.md), writes the raw
numbers to OUT/results.json and the leaves sweep to OUT/leaves.png.
"""

from __future__ import annotations

import argparse
import json
import os

import designs
import leaves
import train_step
import update_step
from _harness import machine

SECTIONS = "headline,dtypes,leaves,distinct,train,designs,finite"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=30)
  parser.add_argument("--quick", action="store_true", help="fewer leaves in the sweep")
  parser.add_argument("--sections", default=SECTIONS, help="comma-separated")
  parser.add_argument(
    "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
  )
  args = parser.parse_args(argv)
  if args.calls < 30:
    print(f"note: --calls {args.calls} is below the 30 the report uses")
  os.makedirs(args.out, exist_ok=True)
  sections = args.sections.split(",")
  info = machine()
  md = [
    f"Machine: {info['device']} ({info['cpu']}); Python {info['python']}; "
    + ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    + f"; commit {info['commit']}; each time: the steps of a table called in "
    "turn, one call each, in a random order each turn; the smallest of 3 "
    f"rounds' medians of {args.calls} calls per step, after 3 warm-up calls "
    "per step and round.",
    "",
  ]
  results = {"machine": info}
  by_leaves = leaves.sections(args.calls, args.quick, args.out)
  titled_sections = {
    "headline": ("Update step", lambda: update_step.headline(args.calls)),
    "dtypes": ("float16 vs float32", lambda: update_step.dtypes(args.calls)),
    "leaves": by_leaves["leaves"],
    "distinct": by_leaves["distinct"],
    "train": ("Full train step", lambda: train_step.train_steps(args.calls)),
    "designs": ("Designs tried", lambda: designs.designs(args.calls)),
    "finite": by_leaves["finite"],
  }
  for key, (title, run) in titled_sections.items():
    if key in sections:
      print(key, flush=True)
      results[key], lines = run()
      md += [f"### {title}", "", *lines, ""]
  text = "\n".join(md)
  print("\n" + text)
  with open(os.path.join(args.out, "tables.md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
  main()
