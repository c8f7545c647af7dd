"""Kernel times from a ``jax.profiler`` trace of a compiled step.

The float8 profile and the 8-bit update's costs both trace a few calls of a
compiled step and read the device's kernels from the trace: one reader here.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import shutil
import tempfile

import jax
from _hlo import Program

#: Lines a GPU trace derives from the kernels (counting them would count twice).
DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "Framework", "Source", "Launch")


def load_trace(path):
  """The ``traceEvents`` of a Chrome-trace JSON file (gzipped or not)."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    return json.load(f)["traceEvents"]


def kernel_events(events, module):
  """The events of the step's kernels: ``[(name, hlo_op, microseconds)]``.

  On a GPU: the complete events on the device's streams (the ``/device:``
  processes, their ``Stream`` lines where they have some; the lines the
  trace derives from them left out), those of another program (another
  ``hlo_module``) left out. Without a device process (XLA:CPU, whose
  thunks are traced on the host): the events that name an ``hlo_op`` of
  ``module``.
  """
  procs, lines = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      procs[e["pid"]] = e.get("args", {}).get("name", "")
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      lines[e["pid"], e.get("tid")] = e.get("args", {}).get("name", "")
  devices = {p for p, n in procs.items() if "/device:" in n and "CPU" not in n}
  streams = {
    (p, t) for (p, t), n in lines.items() if p in devices and n.startswith("Stream")
  }
  out = []
  for e in events:
    if e.get("ph") != "X" or "dur" not in e:
      continue
    args = e.get("args") or {}
    hlo_op = args.get("hlo_op", "")
    hlo_module = args.get("hlo_module", "").split("(")[0]  # "jit_step(12)"
    if devices:
      if e["pid"] not in devices:
        continue
      line = lines.get((e["pid"], e.get("tid")), "")
      if streams and (e["pid"], e.get("tid")) not in streams:
        continue
      if line.startswith(DERIVED_LINES):
        continue
      if hlo_module and hlo_module != module:
        continue
    elif not hlo_op or hlo_module != module or e["name"].startswith("end: "):
      continue
    out.append((e["name"], hlo_op, float(e["dur"])))
  return out


def profile(compiled, carry, batch, steps, trace_path):
  """Traces ``steps`` calls of ``compiled``; ``(carry, events of the trace)``.

  The trace (Chrome-trace JSON, gzipped) is copied to ``trace_path`` (if
  given).
  """
  with tempfile.TemporaryDirectory() as log_dir:
    jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
    try:
      for i in range(steps):
        with jax.profiler.StepTraceAnnotation("train", step_num=i):
          carry = compiled(carry, batch)
          jax.block_until_ready(carry)
    finally:
      jax.profiler.stop_trace()
    found = glob.glob(os.path.join(log_dir, "**", "*trace.json.gz"), recursive=True)
    perfetto = [p for p in found if os.path.basename(p) == "perfetto_trace.json.gz"]
    path = (perfetto or found)[0]
    if trace_path is not None:
      os.makedirs(os.path.dirname(trace_path), exist_ok=True)
      shutil.copyfile(path, trace_path)
    return carry, load_trace(path)


def kernel_time(compiled, carry, args, steps, trace_path=None):
  """Traces ``steps`` calls of ``compiled`` (``carry`` donated, as the step
  takes it): ``(carry, kernels a step, their microseconds a step)``, the
  device's kernels of that program (:func:`kernel_events`)."""
  carry, events = profile(compiled, carry, args, steps, trace_path)
  kernels = kernel_events(events, Program(compiled.as_text()).module)
  return carry, len(kernels) / steps, sum(k[2] for k in kernels) / steps
