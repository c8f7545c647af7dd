"""Strict numerics for every test, and the line between the two suites.

Silent dtype upcasts are bugs here: strict dtype and rank promotion. A test
that starts a process (an example, a docs page, a benchmark script, a
second JAX) belongs to the integration suite (``-m integration``); the
everyday suite (``-m "not integration"``) stays in-process, and a test
there that starts one fails, saying so.

A test marked ``sampled`` runs a table of cases (its parameters' product);
the everyday run takes a sample of it, each value of each parameter at
least once; ``--cases rest`` runs only the cases the sample leaves out,
``--cases all`` every case of every test (as CI runs them).

Runs share one persistent compilation cache, ``.jax_cache/`` in the
checkout (ignored by git), among their pytest-xdist workers and the
processes they start, and keep it between runs: a program many tests
compile (the same emulated GEMM, the same optimizer step) is compiled once,
and a run after a change compiles again only the programs the change made
different (JAX keys an entry by the program, the compiler's options and
flags and the JAX version; docs/development.md has the times). Before a
run, the entries written longest ago go until it holds at most
:data:`CACHE_MAX_BYTES`. An entry a killed run left half written is
compiled again wherever it is met (JAX warns; ``pyproject.toml`` lets that
warning pass); deleting ``.jax_cache/`` drops it. A
``JAX_COMPILATION_CACHE_DIR`` of your own is used instead (an empty one: a
run that compiles everything).
"""

import contextlib
import os
import platform
import subprocess

os.environ.setdefault("KERAS_BACKEND", "jax")
# Python runs `uname -p` once, the first time anything asks for the
# processor (importing Keras does), and keeps the answer: asked here, before
# any test, so that a test importing Keras first in its process does not
# start that process inside the test.
platform.processor()

import jax  # noqa: E402

# tests/data holds the checkpoints of test_checkpoint_compat.py and the
# script that wrote them (run by hand; it needs Orbax): no test, no doctest.
collect_ignore = ["data"]
# tests/multidevice needs 8 (simulated) devices, which must be requested
# before JAX starts: it runs in its own process (see the test command in README.md).
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  collect_ignore.append("multidevice")

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402

_CACHE = "JAX_COMPILATION_CACHE_DIR"
_MIN_SECONDS = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
#: The size the compilation cache in the checkout is cut to before a run
#: (a whole run writes about 35 MB).
CACHE_MAX_BYTES = 1 << 30


def prune(path: str, max_bytes: int) -> None:
  """Removes the files of ``path`` written longest ago until the rest hold at
  most ``max_bytes`` (JAX's own bound needs the ``filelock`` package)."""
  if not os.path.isdir(path):
    return
  entries = sorted(
    (e.stat().st_mtime, e.stat().st_size, e.path)
    for e in os.scandir(path)
    if e.is_file()
  )
  total = sum(size for _, size, _ in entries)
  for _, size, file in entries:
    if total <= max_bytes:
      break
    with contextlib.suppress(FileNotFoundError):
      os.remove(file)
    total -= size


def pytest_addoption(parser):
  parser.addoption(
    "--cases",
    choices=("sample", "rest", "all"),
    default="sample",
    help="`sample` (the default): of a test marked `sampled`, a sample of its "
    "cases with each value of each parameter; `rest`: only the cases the sample "
    "leaves out; `all`: every case of every test",
  )


def pytest_configure(config):
  config.addinivalue_line(
    "markers",
    "sampled: a table of cases, the product of the test's parameters: the "
    "everyday run takes a sample with each value of each parameter (--cases).",
  )
  config.addinivalue_line(
    "markers",
    "standard_promotion: the test runs third-party code (optax's adam, "
    "Keras, Flax) that is not written for strict dtype promotion; our own "
    "code is still checked under strict promotion by every other test.",
  )
  # The compilation cache: named by the first process (pytest-xdist's
  # controller, which starts its workers after this), inherited through the
  # environment by the workers and every process a test starts.
  if _CACHE not in os.environ and not hasattr(config, "workerinput"):
    os.environ[_CACHE] = str(config.rootpath / ".jax_cache")
    os.environ.setdefault(_MIN_SECONDS, "0.1")
    prune(os.environ[_CACHE], CACHE_MAX_BYTES)
  if _CACHE in os.environ:
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE])
  if _MIN_SECONDS in os.environ:
    jax.config.update(
      "jax_persistent_cache_min_compile_time_secs", float(os.environ[_MIN_SECONDS])
    )


def sample(cases):
  """The cases (tuples of parameter indices) to keep: greedily, the case with
  the most values not yet kept (the first in order of several), until every
  value of every parameter is kept. A product of n values by n keeps its
  diagonal, n cases."""
  cases = list(cases)
  wanted = {(axis, i) for case in cases for axis, i in enumerate(case)}
  kept = []
  while wanted:
    best = max(cases, key=lambda c: len(wanted & set(enumerate(c))))
    kept.append(best)
    wanted -= set(enumerate(best))
  return kept


def pytest_collection_modifyitems(config, items):
  cases = config.getoption("cases")
  tables, values = {}, {}
  for item in items:
    if item.get_closest_marker("sampled") and item.get_closest_marker("integration"):
      raise pytest.UsageError(f"{item.nodeid}: the integration suite is not sampled")
    if item.get_closest_marker("sampled") and hasattr(item, "callspec"):
      key = (item.path, item.originalname)
      params = sorted(item.callspec.params.items())
      # each value by its place among the parameter's values (the same object)
      case = tuple(
        values.setdefault((key, name), {}).setdefault(id(v), len(values[key, name]))
        for name, v in params
      )
      tables.setdefault(key, {})[case] = item
  if cases == "all":
    return
  left = set()  # what the sample leaves out
  for table in tables.values():
    kept = {id(table[c]) for c in sample(table)}
    left |= {id(item) for item in table.values() if id(item) not in kept}
  out = [item for item in items if (id(item) in left) == (cases == "sample")]
  if out:
    config.hook.pytest_deselected(items=out)
    gone = {id(item) for item in out}
    items[:] = [item for item in items if id(item) not in gone]


class ProcessOutsideIntegration(AssertionError):
  """A test outside the integration suite started a process."""


@contextlib.contextmanager
def _no_processes(nodeid):
  start = subprocess.Popen._execute_child

  def refuse(self, args, *rest, **kwargs):
    raise ProcessOutsideIntegration(
      f"{nodeid} starts a process ({str(args)[:200]}): a test that does belongs to the "
      "integration suite; mark it @pytest.mark.integration"
    )

  subprocess.Popen._execute_child = refuse
  try:
    yield
  finally:
    subprocess.Popen._execute_child = start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """Setup, call and teardown of a test outside the integration suite run
  with process starts refused (module fixtures included)."""
  if item.get_closest_marker("integration"):
    return (yield)
  with _no_processes(item.nodeid):
    return (yield)


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
  marked = request.node.get_closest_marker("standard_promotion")
  with jax.numpy_dtype_promotion("standard" if marked else "strict"):
    yield
