"""Write the published result files again from their own commands, or check them.

Each result file ``docs/results/NAME.txt`` begins with the line
``$ python examples/SCRIPT.py [ARGS]`` (an example's, or a benchmark's
whose result a guide cites: ``benchmarks/SCRIPT.py``): the command that
made it. This
script runs that command from the repository's root (``python`` being the
interpreter that runs this script) and writes the file again as that line
followed by everything the command printed on its standard output (its
standard error, progress bars, is not part of the file). The plots the
examples page shows are copied too: ``PLOTS`` names, for each, the result
file whose command drew it; the file the command's ``plot: PATH`` line
names is copied over it. A command that exits with an error writes
nothing.

``--jobs N`` runs N commands at a time (each on the same ``CPUS`` CPUs,
so in the same configuration: the numbers they print do not change, their
timings do); the reports come in the order of the names.

``--check`` runs the commands and writes nothing: it prints a unified diff
and exits 1 when a file differs from what its command prints now. One kind
of line is kept out of the comparison by a rule, ``timings``: a number that
measures how fast this machine ran, not what the library computed, stays in
the published file as it was measured but is not compared, on either side:

* a line ``total time: N s``;
* in a table whose header's last column is ``ms/step``, that column's number
  on each row (up to the table's first empty line).

Everything else must be the same text. The examples draw their data from
fixed seeds and compute on a CPU, where XLA gives the same bits from run to
run in one configuration; but its float32 and bfloat16 results change in the
last bits with the size of its thread pool (the CPUs the process may run on)
and with ``XLA_FLAGS``, and float16 without a loss scale, whose small
gradients round to 0 or not, carries such a bit into the table's digits. So
every command runs in one configuration, ``environment``: on ``CPUS`` (2)
CPUs, the first the process may use (``os.sched_setaffinity``; the
development machine has 2), with every ``XLA_*`` and ``JAX_*`` variable of
the caller's environment removed and ``JAX_PLATFORMS=cpu``. A machine with
fewer CPUs, or another CPU whose instructions XLA compiles for differently
(or whose matrix libraries choose other kernels), computes other last bits,
and a training run carries them into its printed digits (the digits MLP's
test losses move in their third decimal). The plots are not compared (they
are drawn from the numbers that are).

So the files record the CPU they were written on, ``CPUS_FILE``
(``cpus.json``: each file's name -> :func:`cpu`, its model name and the
instruction sets XLA compiles for, which writing a file records). On that
CPU ``--check`` compares every character but the timings. On another it
cannot: it compares the text with every number masked (``NUMBER``: the
lines, their words, the tables' columns), says so on a line ``NAME:
written on A, checked on B: numbers not compared``, and the file is
written again on B to compare its numbers there.

Run:  python docs/results/regenerate.py [--jobs N] [NAME ...]
      python docs/results/regenerate.py --check [--jobs N] [NAME ...]
(NAME: a result file's name without ``.txt``; none: every file.)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import difflib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# Plots the examples page includes: file in the results directory -> the
# result file whose command draws it (its ``plot: PATH`` line).
PLOTS = {"lm_loss_scale_seed0.png": "train_lm_seed0"}

# The configuration every command runs in (see the module's docstring).
CPUS = 2

# Each result file's CPU, by name (see the module's docstring).
CPUS_FILE = "cpus.json"

# The instruction sets of x86 and Arm CPUs whose presence changes what XLA
# compiles for a CPU (its vector width, float16 and bfloat16 arithmetic).
ISA = (
  "sse4_2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 "
  "avx512_fp16 avx_vnni amx_tile amx_bf16 asimd sve sve2 bf16 fphp"
).split()

# A number in a result file's text, for the comparison on another CPU.
NUMBER = re.compile(r"(?<!\w)[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?(?!\w)")


def environment() -> dict[str, str]:
  """The caller's environment without ``XLA_*`` and ``JAX_*``, on the CPU."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
  env["JAX_PLATFORMS"] = "cpu"
  return env


def cpu(cpuinfo: str = "/proc/cpuinfo") -> str:
  """This machine's CPU as the result files record it: its model name and
  which of ``ISA`` it has (``platform.processor()`` where there is no
  ``cpuinfo``)."""
  try:
    with open(cpuinfo) as f:
      text = f.read()
  except OSError:
    return platform.processor() or platform.machine()
  fields = dict(
    (k.strip(), v.strip())
    for k, _, v in (line.partition(":") for line in text.splitlines())
    if v
  )
  model = fields.get("model name") or fields.get("CPU part") or platform.machine()
  flags = set((fields.get("flags") or fields.get("Features") or "").split())
  return f"{model}; {' '.join(f for f in ISA if f in flags)}"


def numbers_masked(text: str) -> str:
  """``text`` with every number replaced by ``#``."""
  return NUMBER.sub("#", text)


def recorded_cpus(results: str) -> dict[str, str]:
  """The CPU each result file in ``results`` was written on, by name."""
  path = os.path.join(results, CPUS_FILE)
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _pin() -> None:
  """In the command's process: run on the first ``CPUS`` CPUs it may use."""
  if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:CPUS])


TOTAL_TIME = re.compile(r"^total time: [0-9.]+ s$")
MS_PER_STEP = re.compile(r"\s+ms/step$")
LAST_NUMBER = re.compile(r"\s+[0-9.]+$")
MASK = "<timing>"


def command_of(text: str, name: str = "result file") -> list[str]:
  """The command a result file's first line names, as a list of words.

  Args:
    text: the file's text; its first line must be ``$ python ARGS``.
    name: what to call the file in an error.

  Returns:
    The command's words, ``python`` first.

  Raises:
    ValueError: the first line is not ``$ `` and a ``python`` command.
  """
  first = text.split("\n", 1)[0]
  if not first.startswith("$ "):
    raise ValueError(f"{name}: the first line must be '$ COMMAND', got {first!r}")
  words = shlex.split(first[2:])
  if not words or words[0] != "python":
    raise ValueError(f"{name}: the command must start with 'python', got {first!r}")
  return words


def timings(text: str) -> str:
  """``text`` with its machine-dependent timings replaced by ``<timing>``.

  The rule the module's docstring states: the number of each ``total time:
  N s`` line, and the last field of each row of a table whose header ends
  with the column ``ms/step``, up to the table's first empty line.
  """
  out = []
  in_table = False
  for line in text.split("\n"):
    if TOTAL_TIME.match(line):
      line = f"total time: {MASK} s"
    elif in_table and line.strip() == "":
      in_table = False
    elif in_table:
      line = LAST_NUMBER.sub(f" {MASK}", line)
    elif MS_PER_STEP.search(line):
      in_table = True
    out.append(line)
  return "\n".join(out)


def run(words: list[str]) -> tuple[int, str, str]:
  """Runs a result file's command from the repository's root, in
  ``environment()`` on ``CPUS`` CPUs.

  Returns:
    ``(exit status, standard output, standard error)``.
  """
  argv = [sys.executable, *words[1:]]
  result = subprocess.run(
    argv,
    cwd=ROOT,
    env=environment(),
    preexec_fn=_pin,
    capture_output=True,
    text=True,
  )
  return result.returncode, result.stdout, result.stderr


def rendered(first_line: str, stdout: str) -> str:
  """A result file's text: its command line, then what the command printed."""
  return f"{first_line}\n{stdout.rstrip()}\n"


def plot_path(stdout: str) -> str | None:
  """The path of a command's ``plot: PATH`` line (from the repository's root)."""
  for line in stdout.splitlines():
    if line.startswith("plot: "):
      return os.path.join(ROOT, line[len("plot: ") :])
  return None


def difference(name: str, published: str, now: str, numbers: bool = True) -> str:
  """A unified diff of a result file against what its command prints now,
  the timings rule applied to both (and every number masked, without
  ``numbers``); empty when they agree."""
  mask = timings if numbers else lambda t: numbers_masked(timings(t))
  return "".join(
    difflib.unified_diff(
      mask(published).splitlines(keepends=True),
      mask(now).splitlines(keepends=True),
      fromfile=f"{name}.txt (published)",
      tofile=f"{name}.txt (printed now)",
    )
  )


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  p.add_argument(
    "names", nargs="*", metavar="NAME", help="result files (no .txt); none: all"
  )
  p.add_argument(
    "--check",
    action="store_true",
    help="write nothing; exit 1 with a diff where a file differs",
  )
  p.add_argument(
    "--results",
    default=HERE,
    help="the directory of the result files",
  )
  p.add_argument(
    "--jobs",
    type=int,
    default=1,
    help="how many commands run at a time",
  )
  args = p.parse_args(argv)
  if args.jobs < 1:
    p.error(f"--jobs must be at least 1, got {args.jobs}")
  known = sorted(
    f[: -len(".txt")] for f in os.listdir(args.results) if f.endswith(".txt")
  )
  names = [n[: -len(".txt")] if n.endswith(".txt") else n for n in args.names]
  unknown = [n for n in names if n not in known]
  if unknown:
    p.error(f"no result file {', '.join(unknown)} (known: {', '.join(known)})")
  args.names = names or known
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  if hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) < CPUS:
    print(
      f"warning: fewer than {CPUS} CPUs: the last digits may differ",
      file=sys.stderr,
    )
  failed = []
  start = time.perf_counter()
  here, written_on = cpu(), recorded_cpus(args.results)

  def attempt(name):
    """The published text, the command's first line and how it ran (or why not)."""
    path = os.path.join(args.results, f"{name}.txt")
    with open(path) as f:
      published = f.read()
    try:
      words = command_of(published, path)
    except ValueError as e:
      return published, None, e
    t0 = time.perf_counter()
    ran = run(words)
    return published, published.split("\n", 1)[0], (*ran, time.perf_counter() - t0)

  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    # map's results come in the names' order, each as soon as it and those
    # before it are done.
    outcomes = pool.map(attempt, args.names)
    for name, (published, first_line, ran) in zip(args.names, outcomes, strict=True):
      if first_line is None:
        print(f"error: {ran}", file=sys.stderr)
        failed.append(name)
        continue
      print(f"{name}: {first_line}", flush=True)
      status, stdout, stderr, took = ran
      if status != 0:
        exited = f"{name}: the command exited {status} after {took:.0f} s:"
        print(exited, file=sys.stderr)
        print(stderr[-4000:], file=sys.stderr)
        failed.append(name)
        continue
      now = rendered(first_line, stdout)
      if args.check:
        there = written_on.get(name, "a CPU not recorded")
        if there != here:
          print(f"{name}: written on {there}, checked on {here}: numbers not compared")
        diff = difference(name, published, now, numbers=there == here)
        print(f"{name}: {'differs' if diff else 'same'} ({took:.0f} s)", flush=True)
        if diff:
          print(diff, end="", flush=True)
          failed.append(name)
        continue
      path = os.path.join(args.results, f"{name}.txt")
      with open(path, "w") as f:
        f.write(now)
      print(f"{name}: written ({took:.0f} s)", flush=True)
      written_on = {**recorded_cpus(args.results), name: here}
      with open(os.path.join(args.results, CPUS_FILE), "w") as f:
        json.dump(dict(sorted(written_on.items())), f, indent=1)
        f.write("\n")
      for plot, source in PLOTS.items():
        if source == name:
          drawn = plot_path(stdout)
          if drawn is None or not os.path.isfile(drawn):
            print(f"{name}: no plot for {plot} (plot line: {drawn})", file=sys.stderr)
            failed.append(name)
            continue
          shutil.copyfile(drawn, os.path.join(args.results, plot))
          print(f"{name}: {plot} copied from {os.path.relpath(drawn, ROOT)}")
  # One closing line, in pytest's form (CI's summary of the suite reads it).
  counts = [f"{len(args.names) - len(failed)} passed"]
  counts += [f"{len(failed)} failed"] if failed else []
  took = time.perf_counter() - start
  print(f"===== {', '.join(counts)} in {took:.1f}s =====", flush=True)
  if failed:
    print(f"failed: {' '.join(failed)}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
