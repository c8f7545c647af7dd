"""The benchmark scripts, imported or run by the tests that check them."""

import importlib
import os
import subprocess
import sys

BENCH = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks"
)


def load(name):
  """A benchmarks module, imported with ``sys.path`` as it was kept after
  (the scripts put the repository's root first, where its ``conftest.py``
  would then shadow the tests' own for later imports)."""
  saved = list(sys.path)
  sys.path.insert(0, BENCH)
  try:
    return importlib.import_module(name)
  finally:
    sys.path[:] = saved


def run_small(script, out):
  """Runs ``benchmarks/<script> --small --out <out>`` from the repository's
  root; the report's text (the script's output tails if it fails)."""
  proc = subprocess.run(
    [sys.executable, os.path.join(BENCH, script), "--small", "--out", str(out)],
    capture_output=True,
    text=True,
    cwd=os.path.join(BENCH, os.pardir),
    timeout=600,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(out) as f:
    return f.read()
