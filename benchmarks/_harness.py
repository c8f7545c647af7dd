"""What every benchmark script shares: timing, XLA's costs, tables, the machine.

* Timing: :func:`measure_many` (compiled steps with donated buffers, called
  in turn in a random order, the smallest of the rounds' medians), for
  anything else :func:`timed` (first call, then the median of the next) and
  :func:`median_ms`. A table's noise row is a second compiled instance of
  its baseline, timed with the others: its ratio to the first is the noise.
* XLA's costs of a compiled program: :func:`bytes_accessed` (cost analysis)
  and :func:`memory` (temporary, argument and output bytes).
* Tables: :func:`table` writes one Markdown table, :func:`details` a
  collapsed block; :func:`write_report` prints a report and writes it to a
  file.
* The machine: :func:`machine` (device, CPU, Python, versions, commit) and
  :func:`machine_line`, the one line a report starts with; :func:`installed`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import shutil
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The packages whose versions a report names.
PACKAGES = ("jax", "jaxlib", "optax", "flax", "keras", "jmp")
TIMING = (
  "The steps of a table are called in turn, in a random order each turn (no "
  "step twice in a row); each time is the smallest of 3 rounds' medians."
)


# --------------------------------------------------------------------------
# XLA's costs.
# --------------------------------------------------------------------------


def bytes_accessed(compiled):
  """XLA's cost analysis "bytes accessed" of a compiled program."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["bytes accessed"])


def memory(compiled):
  """XLA's memory analysis of a compiled program: ``{temp, arguments, outputs}``
  in bytes (deterministic for a given XLA and backend)."""
  m = compiled.memory_analysis()
  return dict(
    temp=m.temp_size_in_bytes,
    arguments=m.argument_size_in_bytes,
    outputs=m.output_size_in_bytes,
  )


def tree_bytes(tree):
  """Bytes of a tree's arrays (what it takes to store them), or of the arrays
  a tree of shapes stands for (``jax.eval_shape``'s: nothing computed)."""
  return sum(
    x.size * x.dtype.itemsize
    for x in jax.tree.leaves(tree)
    if hasattr(x, "size") and hasattr(x, "dtype")
  )


# --------------------------------------------------------------------------
# Timing.
# --------------------------------------------------------------------------


def measure_many(entries, calls, rounds=3, warmup=3, seed=0, keep_compiled=False):
  """Compiles each ``(step, carry, grads)`` (``carry`` donated) and times them.

  The steps are called in turn, one call each, in a new random order every
  turn (seeded), drawn so that no step runs twice in a row (given two steps
  or more). Each call then finds the caches holding another program's data,
  as an update step does in training (the forward and backward passes run
  between two updates); slow drifts of the machine hit every step alike;
  and each step follows each other step about equally often (a step pays
  for the memory writes its predecessor left behind: in a fixed order, the
  step after the heaviest one would always pay the most). A round is
  ``warmup + calls`` such turns; a step's time is the smallest of its
  ``rounds`` round medians (over the last ``calls`` calls): noise on a
  shared machine only ever adds time. ``carry`` is copied first: donation
  deletes the buffers it is given. ``keep_compiled`` keeps each compiled
  program in the result (key ``compiled``), to inspect its HLO.

  Returns:
    One dict per entry: ``bytes`` (cost analysis), ``temp_bytes``,
    ``compile_s``, ``round_medians_s``, ``median_s`` and the final ``carry``.
  """
  out = []
  for step, carry, grads in entries:
    carry = jax.tree.map(jnp.copy, carry)
    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=0).lower(carry, grads).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    out.append(
      {
        "bytes": bytes_accessed(compiled),
        "compile_s": compile_s,
        "temp_bytes": int(getattr(mem, "temp_size_in_bytes", -1)),
        "round_medians_s": [],
        "compiled": compiled,
        "carry": carry,
        "grads": grads,
      }
    )
  rng = np.random.default_rng(seed)
  last = None
  for _ in range(rounds):
    times = [[] for _ in out]
    for i in range(warmup + calls):
      order = rng.permutation(len(out))
      while len(out) > 1 and order[0] == last:
        order = rng.permutation(len(out))
      last = order[-1]
      for k in order:
        r = out[k]
        t = time.perf_counter()
        r["carry"] = r["compiled"](r["carry"], r["grads"])
        jax.block_until_ready(r["carry"])
        if i >= warmup:
          times[k].append(time.perf_counter() - t)
    for r, ts in zip(out, times, strict=True):
      r["round_medians_s"].append(statistics.median(ts))
  for r in out:
    r["median_s"] = min(r["round_medians_s"])
    del r["grads"]
    if not keep_compiled:
      del r["compiled"]
  return out


def measure_dropping_carry(entries, calls, **kwargs):
  """:func:`measure_many` without the final carries (the tables' usual need)."""
  results = measure_many(entries, calls, **kwargs)
  for r in results:
    r.pop("carry")
  return results


def timed(fn, repeats):
  """``(first call, median of the next ``repeats`` calls)`` in seconds."""
  t = time.perf_counter()
  fn()
  first = time.perf_counter() - t
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return first, statistics.median(times)


def median_ms(fn, args_cycle, calls=60, warmup=8):
  """Median milliseconds of ``fn(*args)``, the arguments taken in rotation."""
  times = []
  for i in range(warmup + calls):
    args = args_cycle[i % len(args_cycle)]
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    if i >= warmup:
      times.append(time.perf_counter() - t)
  return statistics.median(times) * 1e3


def compiled(fn, *args, donate_argnums=()):
  """``(seconds to lower and compile jax.jit(fn) for args, the compiled
  program)`` (one run)."""
  t = time.perf_counter()
  program = jax.jit(fn, donate_argnums=donate_argnums).lower(*args).compile()
  return time.perf_counter() - t, program


def compile_s(fn, *args, donate_argnums=()):
  """Seconds to lower and compile ``jax.jit(fn)`` for ``args`` (one run)."""
  return compiled(fn, *args, donate_argnums=donate_argnums)[0]


def ratio(a, b):
  return a / b


# --------------------------------------------------------------------------
# Tables and reports.
# --------------------------------------------------------------------------


def table(header, rows, align=None):
  """A Markdown table's lines: ``header`` cells, ``rows`` of cells.

  ``align`` has one letter per column, ``l`` (left, the default) or ``r``.
  """
  align = align or "l" * len(header)
  assert len(align) == len(header), (align, header)
  return [
    "| " + " | ".join(header) + " |",
    "| " + " | ".join("---:" if a == "r" else "---" for a in align) + " |",
    *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
  ]


def write_report(text, out):
  """Prints ``text`` and writes it to ``out`` (its folder made); None: print only."""
  print("\n" + text, flush=True)
  if out:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
      f.write(text.rstrip("\n") + "\n")
    print(f"wrote {out}")


def error_text(exc):
  """``Type: first line of the message`` of an exception, for a report line."""
  text = str(exc).strip()
  return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def details(summary, text):
  """The lines of a collapsed Markdown block showing ``text`` as code."""
  return [
    "<details><summary>" + summary + "</summary>",
    "",
    "```",
    text.rstrip(),
    "```",
    "",
    "</details>",
  ]


# --------------------------------------------------------------------------
# A --small run: the same report on tiny workloads (a CPU, the tests).
# --------------------------------------------------------------------------

#: XLA flags --small adds (compiling dominates the tiny workloads' run time).
SMALL_XLA_FLAGS = "--xla_backend_optimization_level=0"


def small_parser(description, small):
  """An argument parser whose help says what ``--small`` sets (``small``:
  ``{option: value}``); add ``--small`` and the options, then call
  :func:`small_defaults`."""
  return argparse.ArgumentParser(
    description=description,
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    epilog="With --small, every option left at its default takes its --small "
    "value instead: "
    + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in small.items()),
  )


def small_defaults(parser, args, small):
  """With ``args.small``, each option of ``small`` left at its default takes
  its ``small`` value."""
  if args.small:
    for key, value in small.items():
      if getattr(args, key) == parser.get_default(key):
        setattr(args, key, value)


def small_xla_flags():
  """Adds :data:`SMALL_XLA_FLAGS` to ``XLA_FLAGS`` (before JAX starts its
  backend, and for the processes it starts)."""
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} {SMALL_XLA_FLAGS}".strip()


# --------------------------------------------------------------------------
# The machine.
# --------------------------------------------------------------------------


def installed(name):
  """Whether the package ``name`` can be imported."""
  return importlib.util.find_spec(name) is not None


def _version(module):
  try:
    return __import__(module).__version__
  except Exception:  # noqa: BLE001
    try:
      from importlib.metadata import version

      return version(module)
    except Exception:  # noqa: BLE001
      return "?"


def commit(short=True):
  """The checkout's commit, ``+`` where tracked files have uncommitted changes."""
  try:
    rev = subprocess.run(
      ["git", "rev-parse", "--short" if short else "--verify", "HEAD"],
      capture_output=True,
      text=True,
      cwd=ROOT,
    ).stdout.strip()
    dirty = subprocess.run(
      ["git", "status", "--porcelain", "--untracked-files=no"],
      capture_output=True,
      text=True,
      cwd=ROOT,
    ).stdout.strip()
  except OSError:
    return "?"
  return (rev or "?") + ("+" if dirty else "")


def tree():
  """The git tree id of the checkout's tracked files as they are now.

  Equal to ``git rev-parse COMMIT^{tree}`` of the commit whose files these
  are, whether or not the checkout's own ``HEAD`` is that commit: a copy of
  a working tree whose history is older still names its files exactly.
  Built in a temporary index; ``"?"`` without git.
  """
  import tempfile

  with tempfile.TemporaryDirectory() as tmp:
    env = {**os.environ, "GIT_INDEX_FILE": os.path.join(tmp, "index")}
    try:
      for args in (["read-tree", "HEAD"], ["add", "-u"]):
        subprocess.run(
          ["git", *args], cwd=ROOT, env=env, capture_output=True, check=True
        )
      out = subprocess.run(
        ["git", "write-tree"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
      )
    except (OSError, subprocess.CalledProcessError):
      return "?"
  return out.stdout.strip() or "?"


def machine():
  """``{device, cpu, python, versions, commit}`` of this run."""
  cpu = "unknown CPU"
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  dev = jax.devices()[0]
  return {
    "device": f"{dev.platform}: {getattr(dev, 'device_kind', '?')}",
    "cpu": f"{cpu}, {os.cpu_count()} cores",
    "python": platform.python_version(),
    "versions": {m: _version(m) for m in PACKAGES},
    "commit": commit(),
  }


def machine_line(info=None):
  """``device; CPU; Python; versions; commit`` in one line (no final period)."""
  info = info or machine()
  return (
    f"{info['device']}; {info['cpu']}; Python {info['python']}; "
    + ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    + f"; commit {info['commit']}"
  )


if __name__ == "__main__":  # the machine, as JSON (what run_all.py reads)
  import json

  print(json.dumps(machine()))


def environment():
  """``(facts, backend)``: what ran, as (name, value) rows, and JAX's backend."""
  info = machine()
  devices = jax.devices()
  kinds = sorted({getattr(d, "device_kind", "?") for d in devices})
  backend = jax.default_backend()
  try:
    platform_version = " ".join(str(devices[0].client.platform_version).split())
  except Exception:  # noqa: BLE001
    platform_version = "?"
  dirty = info["commit"].endswith("+")  # git_commit's mark of uncommitted changes
  rows = [
    ("device kind", ", ".join(kinds)),
    ("device count", str(len(devices))),
    ("backend", f"{backend} ({platform_version})"),
  ]
  if shutil.which("nvidia-smi"):
    smi = subprocess.run(
      [
        "nvidia-smi",
        "--query-gpu=name,driver_version,memory.total",
        "--format=csv,noheader",
      ],
      capture_output=True,
      text=True,
    ).stdout.strip()
    rows.append(("nvidia-smi", "; ".join(smi.splitlines()) or "?"))
  rows += [(name, v) for name, v in info["versions"].items()]
  rows += [
    ("python", info["python"]),
    ("host CPU", info["cpu"]),
    (
      "commit",
      info["commit"].rstrip("+") + (" + uncommitted changes" if dirty else ""),
    ),
    ("tree", tree()),
    (
      "jax_default_matmul_precision",
      jax.config.jax_default_matmul_precision or "unset (XLA's default)",
    ),
    (
      "date",
      datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    ),
  ]
  return rows, backend


def environment_lines(rows):
  lines = ["| | |", "| --- | --- |"]
  lines += [f"| {name} | {value} |" for name, value in rows]
  try:
    text = jax.print_environment_info(return_string=True)
    lines += ["", *details("jax.print_environment_info()", text)]
  except Exception as e:  # noqa: BLE001
    lines += ["", f"jax.print_environment_info() failed: `{error_text(e)}`"]
  return lines
