"""The benchmark scripts' modules, imported by the tests that check them."""

import importlib
import os
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
