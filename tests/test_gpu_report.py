"""benchmarks/gpu_report.py --small: every section is written, with numbers in it.

The report runs in a subprocess, on whatever backend this machine has (CI's
CPU); its numbers are parsed and checked against each other, not against
any speed.
"""

import datetime
import importlib.util
import inspect
import math
import os
import re
import sys

import benchmark_modules
import jax
import jax.numpy as jnp
import pytest
import report_tables

import optax_lossscale as ols

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
PRECISIONS = ("float32", "bfloat16", "float16", "float8", "mxfp8", "nvfp4")

pytestmark = [
  pytest.mark.integration,
  pytest.mark.xdist_group("gpu_report"),  # one report, made once
  pytest.mark.skipif(
    importlib.util.find_spec("flax") is None,
    reason="the report's train-step table is bench.py's, on Flax models (the "
    "`test` extra)",
  ),
]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  """``{section title: text}`` of one ``--small`` report, and its path."""
  out = tmp_path_factory.mktemp("gpu_report") / "report.md"
  text = benchmark_modules.run_small("gpu_report.py", out)
  assert text.startswith("# GPU report")
  parts = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
  return {p.splitlines()[0]: p for p in parts}, out


def _section(report, number):
  sections, _ = report
  (title,) = [t for t in sections if t.startswith(f"{number}. ")]
  return sections[title]


_table, _number = report_tables.table, report_tables.number


def _quotient_bounds(a, b, ea, eb):
  """The range of x / y for x, y printed as a, b, rounded by at most ea, eb."""
  return (a - ea) / (b + eb), (a + ea) / (b - eb)


def _within(value, bounds, e):
  """``value`` (printed with absolute rounding ``e``) is in ``bounds``."""
  return bounds[0] - e <= value <= bounds[1] + e


def test_every_section_is_there(report):
  sections, _ = report
  assert [t.split(".")[0] for t in sections] == ["1", "2", "3", "4"]
  for title, text in sections.items():
    assert "**error**" not in text
    if not title.startswith("1. "):  # the environment is not timed
      assert _number(re.search(r"Section wall time: (\S+) s\.", text)[1]) > 0


def test_environment(report):
  rows = dict(_table(_section(report, 1), "| | |"))
  assert int(rows["device count"]) >= 1
  assert rows["backend"].split()[0] == jax.default_backend()
  assert rows["jax"] == jax.__version__
  assert rows["flax"] == importlib.import_module("flax").__version__
  assert rows["optax"] and rows["jaxlib"]
  date = datetime.datetime.strptime(rows["date"], "%Y-%m-%d %H:%M UTC")
  assert abs(datetime.datetime.now() - date) < datetime.timedelta(days=2)


def test_test_suite(report):
  text = _section(report, 2)
  (row,) = _table(text, "| passed |")
  passed, failed, errors, skipped = (int(c) for c in row[:4])
  assert passed >= 1
  assert _number(row[4], "s") > 0
  assert "--small" in text  # says that it ran a subset
  last = re.search(r"pytest's last line: `(.*)`", text)[1]
  assert f"{passed} passed" in last
  if failed or errors:
    assert "Failures and errors:\n" in text
  _, out = report
  assert (out.parent / "report_pytest.log").exists()


def test_bench_tables(report):
  text = _section(report, 3)
  rows = {r[0]: r for r in _table(text, "| update step |")}
  base = rows["optax.adam (no loss scaling)"]
  ours = rows["**optax_lossscale.dynamic_loss_scale(adam)**"]
  for row in (base, ours):
    assert _number(row[1], "MB") > 0 and _number(row[3], "ms") > 0
  assert _number(base[2]) == _number(base[4]) == 1.0
  ratio = _quotient_bounds(_number(ours[3], "ms"), _number(base[3], "ms"), 0.005, 0.005)
  assert _within(_number(ours[4]), ratio, 0.0005)
  (mlp, *_) = _table(text, "| model |")
  assert mlp[0].startswith("MLP")
  times = [_number(c.split(",")[0], "ms") for c in mlp[1:4]]
  assert min(times) > 0
  lo, hi = _quotient_bounds(times[2], times[0], 0.005, 0.005)
  assert _within(_number(mlp[4], "%"), (100 * (lo - 1), 100 * (hi - 1)), 0.05)


def test_transformer_table(report):
  text = _section(report, 4)
  tokens = int(re.search(r"\((\d+) tokens per step\)", text)[1])
  rows = {r[0]: r for r in _table(text, "| precision |")}
  assert tuple(rows) == PRECISIONS
  float8_api = "matmul" in inspect.signature(ols.autocast).parameters
  for name, row in rows.items():
    block = hasattr(jnp, "float8_e8m0fnu") and hasattr(jnp, "float4_e2m1fn")
    if (name == "float8" and not float8_api) or (
      name in ("mxfp8", "nvfp4") and not block
    ):
      assert row[1].startswith("error:")  # reported, and the rest still made
      continue
    adam_ms, ours_ms = _number(row[1], "ms"), _number(row[3], "ms")
    for ms, per_s in ((adam_ms, row[2]), (ours_ms, row[4])):
      assert ms > 0
      assert _within(_number(per_s), _quotient_bounds(1e3 * tokens, ms, 0, 0.005), 0.5)
    lo, hi = _quotient_bounds(ours_ms, adam_ms, 0.005, 0.005)
    assert _within(_number(row[5], "%"), (100 * (lo - 1), 100 * (hi - 1)), 0.05)
    steps = int(re.search(r"\((\d+) steps from 2\^15\)", text)[1])
    assert 0 <= int(row[8]) <= steps  # skipped steps
    assert math.log2(_number(row[9])).is_integer()  # the scale: a power of 2
  if not float8_api:
    return
  ratios = re.search(r"float8/bfloat16 tokens/s: adam (\S+), ours (\S+)\.", text)
  f8, bf16 = rows["float8"], rows["bfloat16"]
  for i, col in ((1, 2), (2, 4)):
    expected = _number(f8[col]) / _number(bf16[col])
    assert _number(ratios[i]) == pytest.approx(expected, rel=0.01)
  hlo = re.search(
    r"float8 HLO check: cuBLASLt float8 GEMM custom calls \(`__cublas\$lt\$matmul"
    r"\$f8`\) in the compiled step: adam (\d+), ours (\d+); float8 types in the "
    r"HLO: (yes|no)\.",
    text,
  )
  assert hlo, "no float8 HLO line"
  assert hlo[3] == "yes"  # the float8 row computes in float8
  if jax.default_backend() == "cpu":
    assert int(hlo[1]) == int(hlo[2]) == 0
    assert "float8 is only emulated here" in text


def test_native_block_gemm_count(report):
  text = _section(report, 4)
  if not (hasattr(jnp, "float8_e8m0fnu") and hasattr(jnp, "float4_e2m1fn")):
    assert "mxfp8 failed, nvfp4 failed." in text
    return
  line = re.search(
    r"Native block-scaled GEMMs \(`__op\$block_scaled_dot` custom calls\) in the "
    r"loss-scaled step \(0: emulated with bfloat16 GEMMs\): mxfp8 (\d+), nvfp4 (\d+)\.",
    text,
  )
  assert line, "no native block-scaled GEMM line"
  if jax.default_backend() == "cpu":  # no native GEMM: every one emulated
    assert int(line[1]) == int(line[2]) == 0


def test_matmuls_per_recipe(report):
  text = _section(report, 4)
  layers = int(re.search(r"layers (\d+), d_model", text)[1])
  if not (hasattr(jnp, "float8_e8m0fnu") and hasattr(jnp, "float4_e2m1fn")):
    pytest.skip("this JAX has no block-scaled formats")
  # Per layer: the qkv, output, fc1 and fc2 weights and attention's two
  # batched products (every recipe keeps those by default); and the output
  # layer (plain JAX, no module path: NVFP4 keeps it by structure).
  want = {
    "float8": {"float8": 4 * layers + 1, "bfloat16": 2 * layers},
    "mxfp8": {"mxfp8": 4 * layers + 1, "bfloat16": 2 * layers},
    "nvfp4": {"nvfp4": 4 * layers, "bfloat16": 2 * layers + 1},
  }
  for name, counts in want.items():
    line = re.search(
      rf"{name} matmuls of the forward pass \(`ols.list_matmuls`\): (.*), of (\d+)\.",
      text,
    )
    assert line, f"no matmul line for {name}"
    got = {p: int(n) for n, p in re.findall(r"(\d+) in (\w+)", line[1])}
    assert got == counts and int(line[2]) == sum(counts.values())
    assert f"<summary>{name}: each matmul</summary>" in text


def test_a_run_that_counts_nothing_is_reported(tmp_path):
  """pytest stopping before any test (here an unknown plugin) is reported as
  such, with the exit status and the log, not a crash of the report."""
  sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
  try:
    import gpu_tests
  finally:
    sys.path.pop(0)
  r = gpu_tests.run_tests(
    ["-p", "no_such_plugin_anywhere", "tests/test_policy.py"],
    120,
    str(tmp_path / "log"),
    str(tmp_path / "junit.xml"),
  )
  assert r["returncode"] != 0
  assert (r["passed"], r["failed"], r["errors"]) == (0, 0, 0)
  text = "\n".join(
    gpu_tests.tests_lines(r, ["tests/test_policy.py"], "cpu", False, "log", 0)
  )
  assert "wrote no JUnit XML" in text
  assert f"| {r['returncode']} |" in text
