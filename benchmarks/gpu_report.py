"""Write one Markdown report of this project on a GPU: tests, benchmarks, a transformer.

One command, meant for one GPU (H100 class), that finishes in under 10
minutes and writes ``--out`` (default ``benchmarks/out/gpu_report.md``):

1. Environment: device kind and count, backend, versions, date, commit.
2. Test suite: ``pytest`` in a subprocess on the default backend (the GPU
   where there is one), with its own time limit; passed, failed, errors and
   skipped counts, wall time and the names of the failures. Its log and its
   JUnit XML are written beside the report.
3. ``bench.py``'s update-step and train-step tables, made by
   ``update_step.py``'s and ``train_step.py``'s functions (peers whose
   package is missing are left out, saying so), and the 8-bit optimizer
   state's update step on the same workload (``quantize_state.py``).
4. The train step of a decoder-only transformer (float32 model, plain JAX)
   in four precisions: float32; bfloat16 (``ols.autocast``); float16
   (``ols.autocast``), whose loss needs ``dynamic_loss_scale``; float8
   matmuls (``ols.autocast(..., matmul="float8")``). Each precision is timed
   with bare ``optax.adam`` and with ``ols.dynamic_loss_scale(optax.adam)``
   (``_harness.measure_many``: buffers donated, the two steps called in turn,
   each time the smallest of the rounds' medians after warm-up), giving the
   step time, tokens/s, the loss scale's overhead, and for float8 the
   tokens/s ratio to bfloat16 and whether XLA emitted cuBLASLt float8 GEMMs;
   for float8, MXFP8 and NVFP4, which matmuls run in the recipe and which in
   bfloat16 (``ols.list_matmuls``: module path, kind, shapes, precision).

A section, or one precision's row, that raises is reported as an error line;
the rest of the report is still made. The tests run first, before this
process puts anything on the GPU, with ``XLA_PYTHON_CLIENT_PREALLOCATE=false``
(tests start processes of their own); the report is rewritten after each
section, so a run cut short keeps what it finished.

``--small`` shrinks every workload (one layer of the transformer, the MLP
alone in the train-step table, 5 calls in one round), runs only
``tests/test_policy.py`` and compiles with XLA's backend optimisation level
0, so that the whole report runs on a CPU in well under a minute (what
``tests/test_gpu_report.py`` runs); its numbers measure nothing.

The test suite's run is ``gpu_tests.py``, the transformer
``gpu_transformer.py``.

Run:  python benchmarks/gpu_report.py [--small] [--out PATH]   (see --help)
"""

from __future__ import annotations

import os
import shlex
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]  # the harness; optax_lossscale, also when not installed

import jax  # noqa: E402
import quantize_state  # noqa: E402
import train_step  # noqa: E402
import update_step  # noqa: E402
from _harness import (  # noqa: E402
  SMALL_XLA_FLAGS,
  details,
  environment,
  environment_lines,
  error_text,
  small_defaults,
  small_parser,
  small_xla_flags,
)
from gpu_tests import run_tests, tests_lines, tests_workers  # noqa: E402
from gpu_transformer import transformer  # noqa: E402

SECTIONS = ("tests", "bench", "transformer")
#: Option values that --small puts in place of the defaults.
SMALL = {
  "tests": "tests/test_policy.py",
  "tests_timeout": 120,
  "bench_calls": 5,
  "bench_rounds": 1,
  "bench_layers": 2,
  "bench_width": 64,
  "layers": 1,
  "d_model": 64,
  "heads": 4,
  "seq": 64,
  "batch": 4,
  "vocab": 256,
  "calls": 5,
  "rounds": 1,
  "warmup": 2,
}


#: train_step.train_cases' sizes under --small (the defaults are the report's).
SMALL_TRAIN_CASES = {
  "mlp_width": 64,
  "mlp_batch": 32,
  "d_model": 32,
  "seq": 16,
  "batch": 4,
}


def _guarded(run):
  """``run()``'s lines, or an error line and the traceback if it raises."""
  try:
    return run()
  except Exception as e:  # noqa: BLE001
    traceback.print_exc()
    return [
      f"**error**: `{error_text(e)}`",
      "",
      *details("traceback", traceback.format_exc()),
    ]


def bench_update_step(args):
  steps, missing = update_step.available_steps()
  _, lines = update_step.headline(
    args.bench_calls,
    args.bench_layers,
    args.bench_width,
    steps=steps,
    rounds=args.bench_rounds,
  )
  head = [
    f"`update_step.headline(calls={args.bench_calls}, n_layers={args.bench_layers}, "
    f"width={args.bench_width}, rounds={args.bench_rounds})`"
    + (" (the report's workload is n_layers=16, width=512)" if args.small else "")
    + "."
  ]
  if missing:
    head.append(f"Left out (package not installed): the rows of {', '.join(missing)}.")
  return [*head, "", *lines]


def bench_quantize_state(args):
  table = quantize_state.update_costs(
    args.bench_calls,
    args.bench_rounds,
    args.bench_layers,
    args.bench_width,
    by_part=False,
  )
  head = (
    f"`quantize_state.update_costs(calls={args.bench_calls}, "
    f"rounds={args.bench_rounds}, n_layers={args.bench_layers}, "
    f"width={args.bench_width}, by_part=False)`."
  )
  return [head, "", *table.splitlines()]


def bench_train_step(args):
  call = (
    f"`train_step.train_steps(calls={args.bench_calls}, rounds={args.bench_rounds})`"
  )
  if not args.small:
    cases = train_step.train_cases()
    head = f"{call} on `train_step.train_cases()`."
  else:  # the MLP alone: compiling the Flax transformer 4 times takes ~10 s
    cases = dict(list(train_step.train_cases(**SMALL_TRAIN_CASES).items())[:1])
    head = (
      f"{call} on the MLP of `train_step.train_cases(**{SMALL_TRAIN_CASES})` "
      "(--small: the MLP alone)."
    )
  _, lines = train_step.train_steps(args.bench_calls, cases, rounds=args.bench_rounds)
  return [head, "", *lines]


def parse_args(argv=None):
  parser = small_parser(__doc__.splitlines()[0], SMALL)
  add = parser.add_argument
  add(
    "--out",
    default=os.path.join(HERE, "out", "gpu_report.md"),
    help="the Markdown report; the pytest log and JUnit XML go beside it",
  )
  add(
    "--small",
    action="store_true",
    help="tiny workloads and a test subset (CPU, < 1 min)",
  )
  add(
    "--sections",
    default=",".join(SECTIONS),
    help="comma-separated, of " + ", ".join(SECTIONS),
  )
  add("--tests", default="", help="pytest arguments (empty: the whole suite)")
  add(
    "--tests-timeout",
    type=float,
    default=270,
    help="seconds before pytest is interrupted",
  )
  add(
    "--tests-workers",
    default="auto",
    help="pytest-xdist processes for the tests (0: none); auto: min(4, CPU cores "
    "/ 2) where pytest-xdist is installed, else none",
  )
  add(
    "--bench-calls", type=int, default=30, help="calls per round in bench.py's tables"
  )
  add("--bench-rounds", type=int, default=3, help="rounds in bench.py's tables")
  add(
    "--bench-layers",
    type=int,
    default=16,
    help="MLP layers of the update-step workload (4 leaves each)",
  )
  add(
    "--bench-width",
    type=int,
    default=512,
    help="width of the update-step workload's layers",
  )
  add("--layers", type=int, default=8, help="transformer blocks")
  add("--d-model", type=int, default=1024, help="transformer width")
  add("--heads", type=int, default=16, help="attention heads")
  add("--seq", type=int, default=1024, help="sequence length")
  add("--batch", type=int, default=8, help="sequences per step")
  add("--vocab", type=int, default=32768, help="vocabulary size")
  add("--calls", type=int, default=20, help="timed transformer steps per round")
  add("--rounds", type=int, default=3, help="rounds of transformer timing")
  add("--warmup", type=int, default=3, help="warm-up transformer steps per round")
  args = parser.parse_args(argv)
  small_defaults(parser, args, SMALL)
  args.sections = [s for s in args.sections.split(",") if s]
  unknown = set(args.sections) - set(SECTIONS)
  if unknown:
    parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
  return args


def main(argv=None):
  args = parse_args(argv)
  if args.small:  # before JAX starts its backend (and for the tests' process)
    small_xla_flags()
  out = os.path.abspath(args.out)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  stem = os.path.splitext(out)[0]
  log_path, xml_path = stem + "_pytest.log", stem + "_pytest.xml"
  t_start = time.perf_counter()
  parts = {}  # section title -> lines, in report order
  order = [
    "## 1. Environment",
    "## 2. Test suite",
    "## 3. bench.py tables",
    "## 4. Decoder-only transformer train step",
  ]

  def write():
    md = [
      "# GPU report"
      + (" (--small: tiny workloads, numbers mean nothing)" if args.small else ""),
      "",
      "Made by `python benchmarks/gpu_report.py "
      + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
      + "`"
      + (f", XLA compiling with `{SMALL_XLA_FLAGS}` (--small)." if args.small else "."),
      "",
    ]
    for title in order:
      if title in parts:
        md += [title, "", *parts[title], ""]
    md.append(f"Total wall time: {time.perf_counter() - t_start:.1f} s.")
    with open(out, "w") as f:
      f.write("\n".join(md) + "\n")

  def section(title, run):
    print(title.lstrip("# "), flush=True)
    t0 = time.perf_counter()
    lines = _guarded(run)
    parts[title] = [*lines, "", f"Section wall time: {time.perf_counter() - t0:.1f} s."]
    write()

  # The tests first: this process has then put nothing on the GPU yet.
  if "tests" in args.sections:
    pytest_args = shlex.split(args.tests)

    def tests():
      workers = tests_workers(args.tests_workers)
      r = run_tests(pytest_args, args.tests_timeout, log_path, xml_path, workers)
      backend = jax.default_backend()  # after the tests: it takes the GPU
      log_name = os.path.basename(log_path)
      subset = args.small and pytest_args == shlex.split(SMALL["tests"])
      return tests_lines(r, pytest_args, backend, subset, log_name, workers)

    section(order[1], tests)
  env_rows, backend = environment()
  parts[order[0]] = environment_lines(env_rows)
  write()
  if "bench" in args.sections:
    section(
      order[2],
      lambda: [
        "### Update step",
        "",
        *_guarded(lambda: bench_update_step(args)),
        "",
        "### Train step",
        "",
        *_guarded(lambda: bench_train_step(args)),
        "",
        "### 8-bit optimizer state",
        "",
        *_guarded(lambda: bench_quantize_state(args)),
      ],
    )
  if "transformer" in args.sections:
    section(order[3], lambda: transformer(args, backend))
  write()
  print(f"wrote {out} ({time.perf_counter() - t_start:.1f} s)")


if __name__ == "__main__":
  main()
