"""The GPU report's test suite: pytest in a subprocess, with a time limit, counted.

``run_tests`` runs it (on timeout SIGINT, then SIGKILL to its process group)
and counts passed, failed, errors and skipped from its JUnit XML (or from
pytest's last line when the run was cut short); ``tests_lines`` writes them
as the report's section.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

from _harness import ROOT, installed


def tests_workers(value):
  """``--tests-workers``: a number, or ``auto`` (4 at most, with pytest-xdist)."""
  if value != "auto":
    return int(value)
  return min(4, (os.cpu_count() or 1) // 2) if installed("xdist") else 0


def run_tests(pytest_args, timeout, log_path, xml_path, workers=0):
  """Runs pytest with a time limit; returns a dict of counts and failures.

  ``workers`` > 1 runs the tests in that many pytest-xdist processes. On
  timeout pytest gets SIGINT (it then writes its summary and the JUnit XML
  of the tests that finished), and 30 s later SIGKILL goes to its process
  group (it and every process the tests started).
  """
  # pytest-benchmark (in some GPU images) warns under xdist, and the suite's
  # filterwarnings=error turns that warning into an internal error.
  cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:benchmark"]
  cmd += [f"--junitxml={xml_path}"]
  if workers > 1:
    cmd += ["-n", str(workers)]
  cmd += pytest_args
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
  if os.path.exists(xml_path):
    os.remove(xml_path)
  t0 = time.perf_counter()
  timed_out = False
  with open(log_path, "w") as log:
    proc = subprocess.Popen(
      cmd,
      cwd=ROOT,
      env=env,
      stdout=log,
      stderr=subprocess.STDOUT,
      start_new_session=True,
    )
    try:
      rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
      timed_out = True
      proc.send_signal(signal.SIGINT)
      try:
        proc.wait(30)
      except subprocess.TimeoutExpired:
        pass
      try:  # the group's leader is this process's own child, not yet reaped
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      rc = proc.wait()
  wall = time.perf_counter() - t0
  with open(log_path) as f:
    log_lines = [line.rstrip() for line in f if line.strip()]
  result = {
    "command": " ".join(shlex.quote(c) for c in ["python", *cmd[1:]]),
    "returncode": rc,
    "timed_out": timed_out,
    "wall_s": wall,
    "summary": log_lines[-1] if log_lines else "(no output)",
    "failures": [],
    "source": "nowhere: pytest wrote no JUnit XML and no counts (see its log)",
  }
  counts = dict.fromkeys(("passed", "failed", "errors", "skipped"), 0)
  if os.path.exists(xml_path):
    for case in ET.parse(xml_path).getroot().iter("testcase"):
      name = f"{case.get('classname', '')}::{case.get('name', '')}"
      kinds = {child.tag for child in case}
      if "failure" in kinds or "error" in kinds:
        tag = "failure" if "failure" in kinds else "error"
        counts["failed" if tag == "failure" else "errors"] += 1
        message = (case.find(tag).get("message") or "").strip().splitlines()
        result["failures"].append((name, message[0][:200] if message else ""))
      elif "skipped" in kinds:
        counts["skipped"] += 1
      else:
        counts["passed"] += 1
    result["source"] = "JUnit XML"
  summary = _summary_counts(result["summary"])
  if summary and (timed_out or not os.path.exists(xml_path)):
    # Interrupted, the XML also lists the test cut short; pytest's line does not.
    counts = dict.fromkeys(counts, 0)
    for n, word in summary:
      counts["errors" if word.startswith("error") else word] += n
    result["source"] = "pytest's last line (the run was cut short)"
  result.update(counts)
  return result


def _summary_counts(line):
  return [
    (int(n), w) for n, w in re.findall(r"(\d+) (passed|failed|skipped|errors?)", line)
  ]


def tests_lines(r, pytest_args, backend, subset, log_name, workers):
  """The report's lines on a test run ``r``; ``subset``: the --small subset."""
  what = "the whole suite (pyproject's testpaths: tests/ and the doctests)"
  if pytest_args:
    what = " ".join(pytest_args)
  if subset:
    what += (
      " — a subset, because of --small (the full suite takes ~5 min on a 2-core CPU)"
    )
  status = f"{r['returncode']}"
  if r["timed_out"]:
    status += " (timed out: interrupted, counts are of the tests that finished)"
  lines = [
    f"Ran: {what}, on the {backend} backend, as `{r['command']}` in a subprocess "
    "with `XLA_PYTHON_CLIENT_PREALLOCATE=false`"
    + (f" ({workers} pytest-xdist processes)." if workers > 1 else ".")
    + " `tests/multidevice` (8 simulated "
    "CPU devices) is not collected, as in any run without its XLA_FLAGS. Counts "
    f"from {r['source']}; full log: `{log_name}`.",
    "",
    "| passed | failed | errors | skipped | wall time | exit status |",
    "| ---: | ---: | ---: | ---: | ---: | --- |",
    f"| {r['passed']} | {r['failed']} | {r['errors']} | {r['skipped']} "
    f"| {r['wall_s']:.1f} s | {status} |",
    "",
    f"pytest's last line: `{r['summary']}`",
    "",
  ]
  if r["failures"]:
    lines.append("Failures and errors:")
    lines.append("")
    lines += [f"- `{name}`: {msg}" for name, msg in r["failures"]]
  else:
    lines.append("Failures and errors: none.")
  return lines
