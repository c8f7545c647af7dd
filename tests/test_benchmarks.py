"""The benchmarks' harness, shared workload and reference steps (no timing asserted)."""

import importlib
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import report_tables
import versions
from xla_costs import check_scratch

import optax_lossscale as ols

pytestmark = pytest.mark.standard_promotion  # optax's adam

_BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks")


def _script(name):
  sys.path.insert(0, _BENCH)
  try:
    return importlib.import_module(name)
  finally:
    sys.path.remove(_BENCH)


@pytest.fixture(scope="module")
def bench():
  """The harness's timing, the shared workload's steps and the train steps."""
  sys.path.insert(0, _BENCH)
  try:
    harness, work, train = (
      importlib.import_module(m) for m in ("_harness", "_workloads", "train_step")
    )
    yield types.SimpleNamespace(
      measure_many=harness.measure_many,
      layers=work.layers,
      grads_like=work.grads_like,
      bare_adam=work.bare_adam,
      bare_adam_and_read=work.bare_adam_and_read,
      ours=work.ours,
      train_cases=train.train_cases,
      train_entries=train.train_entries,
    )
  finally:
    sys.path.remove(_BENCH)


def _small():
  params = {"w": jnp.ones((64, 32)), "b": jnp.zeros((32,))}
  return params, {"w": jnp.full((64, 32), 1e-3), "b": jnp.full((32,), 1e-3)}


def _logging_step(log, tag):
  def step(carry, g):
    jax.debug.callback(lambda: log.append(tag))
    return jax.tree.map(lambda c, x: c + x, carry, g)

  return step, jnp.zeros(3), jnp.ones(3)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_measure_many_interleaves_calls(bench, n):
  log = []
  results = bench.measure_many(
    [_logging_step(log, k) for k in range(n)], calls=4, rounds=2, warmup=1
  )
  assert len(log) == 2 * (1 + 4) * n
  # One call of each step per turn, never one step twice in a row ...
  assert all(a != b for a, b in zip(log, log[1:], strict=False))
  turns = [log[i : i + n] for i in range(0, len(log), n)]
  assert all(sorted(t) == list(range(n)) for t in turns)
  # ... in orders that vary (with 2 steps: alternating), each step following
  # each other one.
  follows = {(a, b) for a, b in zip(log, log[1:], strict=False)}
  assert follows == {(a, b) for a in range(n) for b in range(n) if a != b}
  if n > 2:
    assert len({tuple(t) for t in turns}) > 1
  for r in results:
    assert r["carry"].tolist() == [10.0] * 3  # 2 rounds of 1 + 4 calls


def test_measure_many_runs_rounds_and_carries_donated_state(bench):
  params, grads = _small()
  bare, ours = bench.measure_many(
    [bench.bare_adam(params, grads), bench.ours(params, grads)], calls=2, rounds=3
  )
  for r in (bare, ours):
    assert len(r["round_medians_s"]) == 3
    assert r["median_s"] == min(r["round_medians_s"])
    assert r["bytes"] > 0 and r["temp_bytes"] >= 0
  # 3 rounds of (3 warm-up + 2) calls, each call's output fed to the next.
  p, state = ours["carry"]
  assert int(ols.diagnostics(state)["good_steps"]) == 15
  assert not jnp.array_equal(p["w"], params["w"])
  # The caller's arrays survive donation (measure_many copies them first).
  assert jnp.array_equal(params["w"], jnp.ones((64, 32)))


@versions.xla_figures
def test_the_unused_check_reference_has_our_bytes(bench):
  """Ours reads what bare Adam plus one finite check reads, and its scalars.

  On the report's workload (8.4M parameters in 64 leaves): small arrays are
  fused differently and do not show the floor.
  """
  params = bench.layers()
  grads = bench.grads_like(params)
  unused, ours = bench.measure_many(
    [make(params, grads) for make in (bench.bare_adam_and_read, bench.ours)],
    calls=1,
    rounds=1,
  )
  (bare,) = bench.measure_many([bench.bare_adam(params, grads)], calls=1, rounds=1)
  grad_bytes = sum(g.nbytes for g in jax.tree.leaves(grads))
  # One more read of the gradients, the check's scratch written and read once,
  # and the reduction's small partial results.
  floor = grad_bytes + 2 * check_scratch(grads)
  assert floor <= unused["bytes"] - bare["bytes"] <= 1.05 * floor
  # Beyond that, only scalars (the loss scale's state, the unscale factor) and
  # their small kernels: a few KB against 33.6 MB of gradients, either way
  # (where the flag is a reduction's output read by the selects, XLA fuses
  # the reference's scalar outputs differently: 320 bytes more than ours).
  assert abs(ours["bytes"] - unused["bytes"]) <= 4096
  flag = unused["carry"][2]
  assert flag.dtype == jnp.bool_ and bool(flag)


@pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated")
def test_train_cases_build(bench):
  pytest.importorskip("flax", reason="the train cases are Flax models")
  cases = bench.train_cases()
  assert len(cases) == 2
  for model, x, y in cases.values():
    params = jax.eval_shape(lambda m=model, x=x: m.init(jax.random.key(0), x))
    assert jax.tree.leaves(params)
    assert x.shape[0] == y.shape[0]


def test_train_entries_time_equivalent_steps(bench):
  pytest.importorskip("flax", reason="the train cases are Flax models")
  """The train-step table compares steps that compute the same training."""
  import flax.linen as nn

  model = nn.Dense(3)  # float32: a power-of-two loss scale is exact
  x = jnp.linspace(-1.0, 1.0, 8 * 5).reshape(8, 5)
  y = jnp.arange(8) % 3
  entries = bench.train_entries(model, x, y)
  assert set(entries) == {"plain", "unused_check", "scaled"}
  params, carries = {}, {}
  for name, (step, carry, batch) in entries.items():
    for _ in range(3):
      carry = jax.jit(step)(carry, batch)
    params[name], carries[name] = carry[0], carry
  assert bool(carries["unused_check"][2])  # the flag the check returns
  init = model.init(jax.random.key(0), x)["params"]
  assert not jnp.array_equal(params["plain"]["kernel"], init["kernel"])
  for plain, read, scaled in zip(
    *(jax.tree.leaves(params[k]) for k in ("plain", "unused_check", "scaled")),
    strict=True,
  ):
    np.testing.assert_allclose(read, plain, rtol=1e-6)
    np.testing.assert_allclose(scaled, plain, rtol=1e-6)


def _quick_report(script, out):
  """Runs ``benchmarks/SCRIPT --quick --out OUT``; the markdown it wrote."""
  import subprocess

  subprocess.run(
    [sys.executable, os.path.join(_BENCH, script), "--quick", "--out", out],
    check=True,
    capture_output=True,
    timeout=600,
  )
  return out.read_text()


@versions.examples
@pytest.mark.integration
def test_bf16_params_report_runs_and_adds_up(tmp_path):
  import re

  text = _quick_report("bf16_params.py", tmp_path / "bf16.md")
  rows = re.findall(
    r"^\| (float32|bf16 [^|]+?) \| ([\d.]+) \| ([+-][\d.]+) \(.*?\) \| ([\d.]+)% \| "
    r"([+-][\d.]+) \(.*?\) \| ([\d.]+) \|$",
    text,
    re.M,
  )
  assert len(rows) == 16, text  # eight configurations, two models
  for name, _, gap, _, points, per_param in rows:
    if name == "float32":
      assert float(gap) == 0 and float(points) == 0 and float(per_param) == 12.0
  # Bytes per parameter follow from the dtypes: bfloat16 parameters (2), the
  # Kahan buffer (2), Adam's two moments (4 or 2 each), the master weights'
  # remainder (2) or float32 copy (4).
  per = {name: float(b) for name, *_, b in rows}
  assert per["bf16 nearest"] == per["bf16 stochastic"] == 10.0
  assert per["bf16 Kahan"] == 12.0 and per["bf16 Kahan, bf16 mu"] == 10.0
  assert per["bf16 stochastic, bf16 moments"] == 6.0
  assert per["bf16 remainder"] == 12.0 and per["bf16 float32 copy"] == 14.0
  ties = r"^\| transformer \| 0 \| (\d+|none) \| [\d.]+ \| [\d.]+ \| [\d,]+ \|$"
  assert re.search(ties, text, re.M), text
  costs = re.findall(
    r"^\| (float32|bf16 [^|]+?) \| ([\d.]+) \| ([\d.]+)x \|", text, re.M
  )
  assert len(costs) == 8 and all(float(ms) > 0 for _, ms, _ in costs), text
  assert (tmp_path / "bf16.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.integration
def test_telemetry_benchmark_runs_and_reports_every_step(tmp_path):
  import re

  text = _quick_report("telemetry.py", tmp_path / "telemetry.md")
  rows = dict(
    re.findall(r"^\| ((?:adam|loss scale|record)[^|]*?) \| ([\d.]+) MB \|", text, re.M)
  )
  assert list(rows) == [
    "adam",
    "loss scale, record off",
    "loss scale, record on",
    "loss scale, record off, again",
    "record on, every step non-finite",
  ], text
  # The same program twice: the same bytes; the record's branch adds some.
  off, on = rows["loss scale, record off"], rows["loss scale, record on"]
  assert off == rows["loss scale, record off, again"]
  assert float(on) > float(off) and on == rows["record on, every step non-finite"]
  assert len(re.findall(r"^\| (1|16) \| [\d.]+ s \| [\d.]+ s \|", text, re.M)) == 2


@pytest.mark.integration
def test_error_paths_benchmark_runs_and_times_each_path():
  import re
  import subprocess

  out = subprocess.run(
    [sys.executable, os.path.join(_BENCH, "error_paths.py"), "--leaves", "5", "12"]
    + ["--repeats", "1"],
    check=True,
    capture_output=True,
    text=True,
    timeout=600,
  ).stdout
  rows = re.findall(r"^\| (\d+) \| [\d.]+ s / [\d.]+ ms \| [\d.]+ s / [\d.]+ ms \| "
                    r"[\d.]+ s \| [\d.]+ s / [\d.]+ ms \|$", out, re.M)  # fmt: skip
  assert rows == ["5", "12"], out


@pytest.mark.integration
def test_gpu_measure_runs_the_steps_it_is_given_and_refuses_others(tmp_path):
  """``gpu_measure.sh --small DIR costs_large``: that step's report, with the
  device's kernels and their time beside each setup, and its log; an
  unknown step is refused before anything runs."""
  import re

  script = os.path.join(_BENCH, "gpu_measure.sh")
  env = {**os.environ, "PYTHON": sys.executable}
  run = lambda *a: subprocess.run(  # noqa: E731
    ["bash", script, "--small", str(tmp_path), *a],
    capture_output=True,
    text=True,
    timeout=600,
    env=env,
  )
  bad = run("costs", "float9")
  assert bad.returncode == 2 and "unknown step: float9" in bad.stderr
  assert not os.listdir(tmp_path)
  done = run("costs_large")
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert sorted(os.listdir(tmp_path)) == [
    "costs_large.log",
    "quantize_state_costs_large.md",
  ]
  with open(tmp_path / "quantize_state_costs_large.md") as f:
    text = f.read()
  adam = r"^\| float32 Adam \|.* \| (\d+) \| ([\d.]+) us \| 1.00x \|$"
  rows = re.findall(adam, text, re.M)
  assert len(rows) == 1 and int(rows[0][0]) > 0 and float(rows[0][1]) > 0, text


@versions.examples
@versions.block_formats
@pytest.mark.integration
def test_block_memory_benchmark_reports_each_matmul():
  import re

  out = subprocess.run(
    [
      sys.executable,
      os.path.join(_BENCH, "block_memory.py"),
      *("--batch", "2", "--context", "16"),
    ],
    check=True,
    capture_output=True,
    text=True,
    timeout=600,
  ).stdout
  rows = re.findall(r"^\| (\w+) \| ([\d.]+) \| ([\d.]+)x \|", out, re.M)
  assert [r[0] for r in rows] == ["bfloat16", "float8", "mxfp8", "nvfp4"], out
  assert float(rows[0][2]) == 1.0 and all(float(r[1]) > 0 for r in rows), out


@versions.examples
@pytest.mark.integration
def test_quantize_source_measures_both_conventions(tmp_path):
  import re

  text = _quick_report("quantize_source.py", tmp_path / "source.md")
  rows = re.findall(r"^\| (\w+) \| ([\w ]+?) \| (.*) \|$", text, re.M)[1:]
  assert [r[:2] for r in rows] == [
    ("float8", "float32 value"),
    ("float8", "bfloat16 copy"),
  ], text
  for _, _, cells in rows:
    errors = [float(c.split(" ± ")[0]) for c in cells.split(" | ")[:6]]
    assert all(0 < e < 1 for e in errors), text  # float8 is neither exact nor useless


@pytest.fixture(scope="module")
def run_all():
  sys.path.insert(0, _BENCH)
  try:
    yield importlib.import_module("run_all")
  finally:
    sys.path.remove(_BENCH)


def test_run_all_fills_each_block_and_keeps_the_text(run_all, tmp_path):
  page = tmp_path / "page.md"
  page.write_text(
    "# Title\n\nprose\n<!-- run_all: header -->\nold header\n<!-- /run_all -->\n"
    "between\n<!-- run_all: leaves -->\n| old | table |\n<!-- /run_all -->\nend\n"
  )
  run_all.fill(page, {"header": "Commit `abc`.", "leaves": "| new |", "x": "unused"})
  assert page.read_text() == (
    "# Title\n\nprose\n<!-- run_all: header -->\nCommit `abc`.\n<!-- /run_all -->\n"
    "between\n<!-- run_all: leaves -->\n| new |\n<!-- /run_all -->\nend\n"
  )


@pytest.mark.parametrize(
  "text",
  ["no blocks at all\n", "<!-- run_all: not_run -->\nx\n<!-- /run_all -->\n"],
  ids=["no blocks", "a key not run"],
)
def test_run_all_refuses_a_page_it_cannot_fill(run_all, tmp_path, text):
  page = tmp_path / "page.md"
  page.write_text(text)
  with pytest.raises(SystemExit):
    run_all.fill(page, {"header": "h"})
  assert page.read_text() == text


def test_run_all_fills_only_the_blocks_of_a_partial_run(run_all, tmp_path):
  page = tmp_path / "page.md"
  text = (
    "<!-- run_all: header -->\nold header\n<!-- /run_all -->\n"
    "<!-- run_all: gpu_report -->\nold\n<!-- /run_all -->\n"
  )
  page.write_text(text)
  run_all.fill(page, {"gpu_report": "new"}, partial=True)
  assert page.read_text() == text.replace("old\n<", "new\n<")
  with pytest.raises(SystemExit):  # a key with no block
    run_all.fill(page, {"leaves": "x"}, partial=True)


_REPORT = """# GPU report

Made by `python benchmarks/gpu_report.py --out r.md`.

## 1. Environment

| | |
| --- | --- |
| device kind | NVIDIA H200 |
| commit | {commit} |

## 2. Test suite

| passed |
| ---: |
| 3 |

## 3. bench.py tables

`update_step.headline(calls=30)`.

| step | time |
| --- | ---: |
| adam | 1 ms |

Section wall time: 4.0 s.

## 4. Transformer

| precision | step |
| --- | ---: |
| float8 | 2 ms |

- float8: `ols.autocast(loss_fn, matmul="float8")`

float8 matmuls of the forward pass (`ols.list_matmuls`): 49 in float8, of 49.

<details><summary>each matmul</summary>

```
a long listing
```
</details>

Total wall time: 9.0 s.
"""


def test_run_all_takes_a_report_made_elsewhere(run_all, tmp_path):
  path = tmp_path / "gpu_report.md"
  path.write_text(_REPORT.format(commit="abc1234"))
  shown, block, failure = run_all.from_report("gpu_report", str(path), False)
  assert failure is None and shown == "python benchmarks/gpu_report.py --out r.md"
  assert block.startswith(
    "Made by `python benchmarks/gpu_report.py --out r.md` at commit `abc1234` on "
    "NVIDIA H200.\n\n### 4. Transformer\n"
  )
  # The tables of section 4 (the benchmarks page holds the transformer; the
  # bench.py tables stay in the report); not the environment, the tests, the
  # listings, the wall times, how a section was called, the recipes' code
  # or the count of each recipe's matmuls.
  assert "| float8 | 2 ms |" in block and "| adam | 1 ms |" not in block
  gone_lines = ("headline(", "- float8:", "matmuls of the forward pass")
  for gone in (
    "| passed |",
    "device kind |",
    "a long listing",
    "wall time",
    *gone_lines,
  ):
    assert gone not in block, gone
  path.write_text(_REPORT.format(commit="abc1234 + uncommitted changes"))
  assert "uncommitted" in run_all.from_report("gpu_report", str(path), False)[2]
  path.write_text(_REPORT.replace("| device kind | NVIDIA H200 |\n", ""))
  assert run_all.from_report("gpu_report", str(path), False)[2]
  # A report cut short before the sections the page holds: refused, not empty.
  path.write_text(_REPORT.format(commit="abc1234").split("## 4.")[0])
  assert "none of sections" in run_all.from_report("gpu_report", str(path), False)[2]


_PROFILE = """# float8 against bfloat16: tokens/s and where the time goes

Made by `python benchmarks/float8_profile.py --out p.md`.

## 1. Environment

| | |
| --- | --- |
| device kind | NVIDIA H200 |
| commit | abc1234 |

## 2. Tokens/s

The GPU report's decoder (float32 parameters) at each size.

Both precisions are trained with `optax.adam(1e-3)`.

- bfloat16: `ols.autocast(loss_fn, compute_dtype=jnp.bfloat16)`

| d_model | float8/bfloat16 |
| ---: | ---: |
| 64 | **1.1** |

## 3. Where the time goes

A `jax.profiler` trace of 3 steps of each precision.

| d_model | precision | GEMM, ms |
| --- | --- | ---: |
| 64 | float8 | 1.0 |

- d_model 64: 13 float8 matmuls in the forward pass; amax passes 29.

<details><summary>kernels</summary>

```
a long listing
```
</details>

Total wall time: 9.0 s.
"""


def test_run_all_takes_the_float8_profile_s_measurements(run_all, tmp_path):
  path = tmp_path / "float8_profile.md"
  path.write_text(_PROFILE)
  shown, block, failure = run_all.from_report("float8_profile", str(path), False)
  assert failure is None and shown == "python benchmarks/float8_profile.py --out p.md"
  assert block.startswith(
    "Made by `python benchmarks/float8_profile.py --out p.md` at commit `abc1234` on "
    "NVIDIA H200.\n\n### 2. Tokens/s\n"
  )
  # Its two tables and the per-size passes; not how it measured (the report
  # says so), the recipes' code, the listings or the environment.
  for kept in ("| 64 | **1.1** |", "| 64 | float8 | 1.0 |", "- d_model 64: 13 float8"):
    assert kept in block, kept
  for gone in (
    "The GPU report's decoder",
    "Both precisions are trained",
    "A `jax.profiler` trace",
    "- bfloat16:",
    "a long listing",
    "device kind",
    "wall time",
  ):
    assert gone not in block, gone


def _git(repo, *args):
  return subprocess.run(
    ["git", *args], cwd=repo, capture_output=True, text=True, check=True
  ).stdout.strip()


@pytest.mark.integration
def test_a_report_of_uncommitted_changes_is_named_by_its_trees_commit(
  run_all, tmp_path, monkeypatch
):
  """A GPU report made on a copy whose history is older than its files: the
  ``tree`` row (``_harness.tree``) names the commit here with those files."""
  harness = importlib.import_module("_harness")
  repo = tmp_path / "repo"
  repo.mkdir()
  _git(repo, "init", "-q")
  for k, v in (("user.name", "t"), ("user.email", "t@t"), ("commit.gpgsign", "false")):
    _git(repo, "config", k, v)
  (repo / "f.py").write_text("a = 1\n")
  _git(repo, "add", "f.py")
  _git(repo, "commit", "-qm", "one")
  old = _git(repo, "rev-parse", "--short", "HEAD")
  (repo / "f.py").write_text("a = 2\n")  # the copy: old history, new files
  (repo / "untracked.txt").write_text("not part of the tree\n")
  monkeypatch.setattr(harness, "ROOT", str(repo))
  copy_tree = harness.tree()
  assert _git(repo, "status", "--porcelain", "--untracked-files=no")  # still dirty
  _git(repo, "commit", "-qam", "two")  # the commit those files are here
  new = _git(repo, "rev-parse", "--short", "HEAD")
  assert (
    copy_tree
    == _git(repo, "rev-parse", "HEAD^{tree}")
    != _git(repo, "rev-parse", f"{old}^{{tree}}")
  )
  monkeypatch.setattr(run_all, "ROOT", str(repo))
  path = tmp_path / "gpu_report.md"
  report = _REPORT.format(commit=f"{old} + uncommitted changes")
  row = f"| commit | {old} + uncommitted changes |\n"
  path.write_text(report.replace(row, row + f"| tree | {copy_tree} |\n"))
  shown, block, failure = run_all.from_report("gpu_report", str(path), False)
  assert failure is None and f"at commit `{new}` on NVIDIA H200" in block
  # A tree no commit has: refused as before.
  path.write_text(report.replace(row, row + f"| tree | {'0' * 40} |\n"))
  assert "uncommitted" in run_all.from_report("gpu_report", str(path), False)[2]


def test_run_all_checks_each_report_names_the_run_commit(run_all):
  text = "Machine: cpu; 2 cores; jax 0.1; commit abc1234+.\n\n| a | b |\n"
  assert run_all.strip_machine(text, "abc1234+") == "| a | b |"
  with pytest.raises(RuntimeError, match="names commit abc1234"):
    run_all.strip_machine(text, "def5678")
  assert list(run_all.QUESTIONS) == [
    "update_step",
    "train_step",
    "leaves",
    "tree",
    "designs",
    "telemetry",
    "error_paths",
    "block_memory",
    "bf16_params",
    "quantize_state",
    "gpu_report",
    "float8_profile",
  ]
  for _, full, quick in run_all.QUESTIONS.values():
    assert os.path.isfile(os.path.join(_BENCH, full[0])) and quick[0] == full[0]


@versions.examples
def test_the_4bit_simulation_holds_what_the_8bit_codec_stores():
  """``quantize_4bit.py`` simulates a width by rounding the moments in
  float32; with the 8-bit maps, blocks of 256 and square roots it must give
  exactly ``quantize_state``'s codec's values, or its 4-bit numbers would
  measure the simulation, not the width."""
  sim = _script("quantize_4bit")
  from optax_lossscale._params import quantize_codec as codec

  rng = np.random.default_rng(0)
  x = rng.normal(size=(16, 512)) * 10.0 ** rng.uniform(-9, 0, (16, 512))
  x[:8] = np.abs(x[:8])  # blocks of the unsigned map (square roots) too
  x = jnp.asarray(x, jnp.float32)
  want = codec.encode(x, 256, sqrt=True).dequantize()
  got = sim.qdq(x, *sim.EIGHT, 256, True)
  np.testing.assert_array_equal(got, want)
  for m in sim.FOUR:
    assert m.shape == (16,) and m[-1] == 1 and np.all(np.diff(m) > 0)


@versions.examples
def test_the_8bit_bytes_by_part_add_up_to_the_state():
  """``quantize_state.py``'s table of bytes by part: each setup's parts are
  its state's bytes, put where they belong (codes and float32 moments as
  moments, scales, remainders as masters, the rest as other)."""
  qs = _script("quantize_state")
  import optax

  import optax_lossscale as ols

  p32 = {"w": jnp.ones((64, 128)), "b": jnp.ones((16,))}
  p16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), p32)
  blocks = 64 * 128 // 256
  small = 2 * 16 * 4 + 4  # the bias's two float32 moments and the count
  cases = [
    (optax.adam(1e-3), p32, dict(masters=0, moments=2 * 8192 * 4, scales=0)),
    (
      ols.quantize_state(optax.adam(1e-3)),
      p32,
      dict(masters=0, moments=2 * 8192, scales=2 * blocks * 4),
    ),
    (
      ols.master_weights(ols.quantize_state(optax.adam(1e-3))),
      p16,
      dict(masters=2 * (8192 + 16), moments=2 * 8192, scales=2 * blocks * 4),
    ),
    (  # the flat layout: the same blocks in one buffer a moment field
      ols.quantize_state(optax.adam(1e-3), layout="flat"),
      p32,
      dict(masters=0, moments=2 * 8192, scales=2 * blocks * 4),
    ),
  ]
  rows = []
  for tx, params, want in cases:
    state = tx.init(params)
    parts = qs._parts(state)
    assert parts == {**want, "other": small}
    assert sum(parts.values()) == sum(x.nbytes for x in jax.tree.leaves(state))
    rows.append(("setup", sum(x.nbytes for x in jax.tree.leaves(params)), parts))
  table = qs.parts_table(rows, 8192 + 16)
  assert table.count("| setup |") == 4  # the header and three rows: flat is 8-bit's
  again = qs.parts_table(rows + rows[1:2], 8192 + 16)  # a repeated storage
  assert again == table
  assert all(name in table for name, _ in qs.PUBLISHED)


def test_the_8bit_costs_measure_the_pallas_kernel_both_ways():
  """``quantize_state.py``'s GPU setups (Pallas' interpreter here, tiny):
  each a row of numbers against float32 Adam, the kernel's
  ``apply_gradients`` as its step where named so."""
  import re

  qs = _script("quantize_state")
  configs = {"float32 Adam": qs.COST_CONFIGS["float32 Adam"], **qs.PALLAS_CONFIGS}
  assert qs.APPLIED and qs.APPLIED < set(qs.PALLAS_CONFIGS)
  table = qs.update_costs(
    1, rounds=1, n_layers=1, width=64, by_part=False, configs=configs
  )
  for name in configs:
    row = re.search(rf"^\| {re.escape(name)} \| (.*)$", table, re.M)
    assert row, table
    cells = row.group(1).split(" | ")
    assert len(cells) == 9 and cells[1].endswith("MB"), row.group(0)


@versions.examples
def test_bf16_params_bytes_per_parameter_follow_from_the_dtypes():
  """Each configuration's bytes per parameter (what ``bf16_params.py``'s
  tables report), from its optimizer's state shapes: nothing compiled. The
  script's own run (the integration suite) prints the same."""
  import re

  bf16 = _script("bf16_params")
  from _harness import tree_bytes

  params32 = {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32)}
  params32["b"] = jax.ShapeDtypeStruct((32,), jnp.float32)
  n = 64 * 32 + 32
  per = {}
  for name, (dtype, *_) in bf16.CONFIGS.items():
    params = jax.tree.map(lambda p, d=dtype: jax.ShapeDtypeStruct(p.shape, d), params32)
    state = jax.eval_shape(
      lambda p, name=name: bf16.optimizer(name, 1e-3, 0, p)[1], params
    )
    per[name] = (tree_bytes(params) + tree_bytes(state)) / n
  # bfloat16 parameters (2), the Kahan buffer (2), Adam's two moments (4 or
  # 2 each), the master weights' remainder (2) or float32 copy (4); Adam's
  # step count and a stochastic rounding's key are a few bytes in all.
  want = {
    "float32": 12.0,
    "bf16 nearest": 10.0,
    "bf16 stochastic": 10.0,
    "bf16 Kahan": 12.0,
    "bf16 Kahan, bf16 mu": 10.0,
    "bf16 stochastic, bf16 moments": 6.0,
    "bf16 remainder": 12.0,
    "bf16 float32 copy": 14.0,
  }
  assert set(per) == set(want)
  for name, got in per.items():
    assert round(got, 1) == want[name] and got - want[name] < 32 / n, (name, got)

  # The table: a row per configuration, each seed's gap to float32 and
  # their mean, in the format the integration test reads.
  def run(loss, acc, name):
    return dict(loss=loss, acc=acc, bytes_per_param=per[name])

  results = {
    name: [run(2.0 + i / 8, 0.5 - i / 100, name), run(2.5 + i / 4, 0.6, name)]
    for i, name in enumerate(bf16.CONFIGS)
  }
  text = bf16.table(results)
  rows = re.findall(
    r"^\| (float32|bf16 [^|]+?) \| ([\d.]+) \| ([+-][\d.]+) \((.*?)\) \| ([\d.]+)% \| "
    r"([+-][\d.]+) \((.*?)\) \| ([\d.]+) \|$",
    text,
    re.M,
  )
  assert [r[0] for r in rows] == list(bf16.CONFIGS), text
  for i, (name, loss, gap, gaps, acc, points, each, b) in enumerate(rows):
    assert float(loss) == pytest.approx((2.0 + i / 8 + 2.5 + i / 4) / 2, abs=1e-4)
    assert [float(g) for g in gaps.split(", ")] == pytest.approx(
      [i / 8, i / 4], abs=1e-4
    )
    assert float(gap) == pytest.approx(3 * i / 16, abs=1e-4)
    assert float(acc) == pytest.approx(100 * (0.55 - i / 200), abs=1e-2)
    assert [float(p) for p in each.split(", ")] == pytest.approx([-i, 0.0], abs=1e-2)
    assert float(points) == pytest.approx(-i / 2, abs=1e-2)
    assert float(b) == round(per[name], 1)


@pytest.mark.integration
def test_the_tree_compile_section_reports_its_floor_and_what_xla_compiled(tmp_path):
  """``leaves.py --sections tree``: compile-time ratios with the unused
  check (the skip's floor) beside the loss scale, and the lines of HLO XLA
  compiled, in which the per-leaf 8-bit step is the largest and the flat
  layout's a small fraction of it; nothing XLA printed."""
  out = tmp_path / "leaves.md"
  script = os.path.join(_BENCH, "leaves.py")
  command = [sys.executable, script, "--quick", "--sections", "tree", "--out", out]
  subprocess.run(command, check=True, capture_output=True, timeout=600)
  text = out.read_text()
  assert "Lines XLA printed while compiling: 0." in text
  names = ["adam", "unused check", "loss scale", "apply_if_finite", "8-bit"]
  names += ["all three", "8-bit, flat", "loss scale + 8-bit, flat", "all three, flat"]
  header = "| leaves | " + " | ".join(names) + " |"
  first = text.index(header)
  seconds = report_tables.table(text[first:], header)
  lines = report_tables.table(text[text.index(header, first + 1) :], header)
  assert len(seconds) == len(lines) == 1  # --quick: one tree
  assert report_tables.number(seconds[0][1], "s") > 0
  assert all(report_tables.number(c) > 0 for c in seconds[0][2:])
  hlo = dict(zip(names, lines[0][1:], strict=True))
  assert int(hlo["adam"]) > 100
  ratio = {n: report_tables.number(hlo[n]) for n in names[1:]}
  assert 1 <= ratio["unused check"] <= ratio["loss scale"] < ratio["8-bit"]
  assert ratio["8-bit"] < ratio["all three"]
  assert ratio["8-bit, flat"] < ratio["8-bit"] / 2
  assert ratio["all three, flat"] < ratio["all three"]
  # under the loss scale: more than the 8-bit step, less than with masters
  assert ratio["8-bit, flat"] < ratio["loss scale + 8-bit, flat"]
  assert ratio["loss scale + 8-bit, flat"] < ratio["all three, flat"]


@versions.xla_figures
def test_xla_counts_a_fused_slice_as_reading_its_whole_operand():
  """Why ``quantize_state.py`` does not print the flat layout's bytes
  accessed: each of 100 slices of one array, fused with an add, counts as a
  read of the whole array (100x what is read). Where this fails, XLA counts
  slices by what they read, and the flat rows can show their bytes again."""
  x = jnp.ones(100_000)

  def slices(x):
    y = x * 2.0 + 1.0
    return [y[i * 1000 : (i + 1) * 1000] + 1.0 for i in range(100)]

  cost = jax.jit(slices).lower(x).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  assert cost["bytes accessed"] >= 100 * x.nbytes
