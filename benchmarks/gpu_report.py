"""Write one Markdown report of this project on a GPU: tests, benchmarks, a transformer.

One command, meant for one GPU (H100 class), that finishes in under 10
minutes and writes ``--out`` (default ``benchmarks/out/gpu_report.md``):

1. Environment: device kind and count, backend, versions, date, commit.
2. Test suite: ``pytest`` in a subprocess on the default backend (the GPU
   where there is one), with its own time limit; passed, failed, errors and
   skipped counts, wall time and the names of the failures. Its log and its
   JUnit XML are written beside the report.
3. ``bench.py``'s update-step and train-step tables, made by ``bench.py``'s
   own functions (peers whose package is missing are left out, saying so).
4. The train step of a decoder-only transformer (float32 model, plain JAX)
   in four precisions: float32; bfloat16 (``ols.autocast``); float16
   (``ols.autocast``), whose loss needs ``dynamic_loss_scale``; float8
   matmuls (``ols.autocast(..., matmul="float8")``). Each precision is timed
   with bare ``optax.adam`` and with ``ols.dynamic_loss_scale(optax.adam)``
   (``bench.measure_many``: buffers donated, the two steps called in turn,
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

Run:  python benchmarks/gpu_report.py [--small] [--out PATH]   (see --help)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]  # bench.py; optax_lossscale, also when not installed

import bench  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import optax_lossscale as ols  # noqa: E402

#: The custom call XLA's GPU backend emits for a float8 GEMM on cuBLASLt.
F8_GEMM = "__cublas$lt$matmul$f8"
BLOCK_GEMM = "__op$block_scaled_dot"  # jax.nn.scaled_matmul's native GEMM
SECTIONS = ("tests", "bench", "transformer")
#: Update steps of bench.py that need a package beyond optax_lossscale's own.
PEER_PACKAGES = {
  bench.jmp_select_tree: "jmp",
  bench.flax_dynamic_scale: "flax",
  bench.keras_loss_scale: "keras",
  bench.keras_adam: "keras",
}
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
#: XLA flags --small adds (compiling dominates the tiny workloads' run time).
SMALL_XLA_FLAGS = "--xla_backend_optimization_level=0"
#: bench.train_cases' sizes under --small (the defaults are bench.py's own).
SMALL_TRAIN_CASES = {
  "mlp_width": 64,
  "mlp_batch": 32,
  "d_model": 32,
  "seq": 16,
  "batch": 4,
}


def _installed(name):
  return importlib.util.find_spec(name) is not None


def _error_text(exc):
  text = str(exc).strip()
  return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _guarded(run):
  """``run()``'s lines, or an error line and the traceback if it raises."""
  try:
    return run()
  except Exception as e:  # noqa: BLE001
    traceback.print_exc()
    return [
      f"**error**: `{_error_text(e)}`",
      "",
      *_details("traceback", traceback.format_exc()),
    ]


def _details(summary, text):
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
# 1. Environment.
# --------------------------------------------------------------------------


def environment():
  """``(facts, backend)``: what ran, as (name, value) rows, and JAX's backend."""
  info = bench.machine()
  devices = jax.devices()
  kinds = sorted({getattr(d, "device_kind", "?") for d in devices})
  backend = jax.default_backend()
  try:
    platform_version = " ".join(str(devices[0].client.platform_version).split())
  except Exception:  # noqa: BLE001
    platform_version = "?"
  dirty = subprocess.run(
    ["git", "status", "--porcelain", "--untracked-files=no"],
    capture_output=True,
    text=True,
    cwd=ROOT,
  ).stdout.strip()
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
    ("commit", info["commit"] + (" + uncommitted changes" if dirty else "")),
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
    lines += ["", *_details("jax.print_environment_info()", text)]
  except Exception as e:  # noqa: BLE001
    lines += ["", f"jax.print_environment_info() failed: `{_error_text(e)}`"]
  return lines


# --------------------------------------------------------------------------
# 2. The test suite, in a subprocess.
# --------------------------------------------------------------------------


def tests_workers(value):
  """``--tests-workers``: a number, or ``auto`` (4 at most, with pytest-xdist)."""
  if value != "auto":
    return int(value)
  return min(4, (os.cpu_count() or 1) // 2) if _installed("xdist") else 0


def run_tests(pytest_args, timeout, log_path, xml_path, workers=0):
  """Runs pytest with a time limit; returns a dict of counts and failures.

  ``workers`` > 1 runs the tests in that many pytest-xdist processes. On
  timeout pytest gets SIGINT (it then writes its summary and the JUnit XML
  of the tests that finished), and 30 s later SIGKILL goes to its process
  group (it and every process the tests started).
  """
  cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", f"--junitxml={xml_path}"]
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


def tests_lines(r, pytest_args, backend, small, log_name, workers):
  what = "the whole suite (pyproject's testpaths: tests/ and the doctests)"
  if pytest_args:
    what = " ".join(pytest_args)
  if small and pytest_args == shlex.split(SMALL["tests"]):
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


# --------------------------------------------------------------------------
# 3. bench.py's tables.
# --------------------------------------------------------------------------


def bench_update_step(args):
  steps = {
    name: make
    for name, make in bench.UPDATE_STEPS.items()
    if _installed(PEER_PACKAGES.get(make, "optax"))
  }
  missing = sorted(
    {
      p
      for m, p in PEER_PACKAGES.items()
      if m in bench.UPDATE_STEPS.values() and not _installed(p)
    }
  )
  _, lines = bench.headline(
    args.bench_calls,
    args.bench_layers,
    args.bench_width,
    steps=steps,
    rounds=args.bench_rounds,
  )
  head = [
    f"`bench.headline(calls={args.bench_calls}, n_layers={args.bench_layers}, "
    f"width={args.bench_width}, rounds={args.bench_rounds})`"
    + (" (bench.py's workload is n_layers=16, width=512)" if args.small else "")
    + "."
  ]
  if missing:
    head.append(f"Left out (package not installed): the rows of {', '.join(missing)}.")
  return [*head, "", *lines]


def bench_train_step(args):
  call = f"`bench.train_steps(calls={args.bench_calls}, rounds={args.bench_rounds})`"
  if not args.small:
    cases = bench.train_cases()
    head = f"{call} on `bench.train_cases()`."
  else:  # the MLP alone: compiling the Flax transformer 4 times takes ~10 s
    cases = dict(list(bench.train_cases(**SMALL_TRAIN_CASES).items())[:1])
    head = (
      f"{call} on the MLP of `bench.train_cases(**{SMALL_TRAIN_CASES})` "
      "(--small: the MLP alone)."
    )
  _, lines = bench.train_steps(args.bench_calls, cases, rounds=args.bench_rounds)
  return [head, "", *lines]


# --------------------------------------------------------------------------
# 4. A decoder-only transformer in four precisions.
# --------------------------------------------------------------------------


def init_decoder(key, *, vocab, d_model, layers, seq):
  """GPT-2-style float32 parameters: embeddings, ``layers`` blocks, a head."""
  d = d_model
  keys = iter(jax.random.split(key, 3 + 4 * layers))

  def normal(shape, std=0.02):
    return std * jax.random.normal(next(keys), shape, jnp.float32)

  def norm():
    return {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))}

  out_std = 0.02 / math.sqrt(2 * layers)
  blocks = [
    {
      "ln1": norm(),
      "qkv": normal((d, 3 * d)),
      "qkv_b": jnp.zeros((3 * d,)),
      "proj": normal((d, d), out_std),
      "proj_b": jnp.zeros((d,)),
      "ln2": norm(),
      "fc1": normal((d, 4 * d)),
      "fc1_b": jnp.zeros((4 * d,)),
      "fc2": normal((4 * d, d), out_std),
      "fc2_b": jnp.zeros((d,)),
    }
    for _ in range(layers)
  ]
  return {
    "embed": normal((vocab, d)),
    "pos": normal((seq, d), 0.01),
    "blocks": blocks,
    "ln_f": norm(),
    "head": normal((d, vocab)),
  }


def _layer_norm(x, scale, bias):
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def decoder_loss(params, tokens, targets, *, heads):
  """Mean next-token cross-entropy of a pre-LayerNorm decoder, all float32."""
  b, t = tokens.shape
  x = params["embed"][tokens] + params["pos"][:t]
  causal = jnp.tril(jnp.ones((t, t), bool))
  for blk in params["blocks"]:
    h = _layer_norm(x, **blk["ln1"])
    qkv = h @ blk["qkv"] + blk["qkv_b"]
    q, k, v = (a.reshape(b, t, heads, -1) for a in jnp.split(qkv, 3, axis=-1))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (q.shape[-1] ** -0.5)
    s = jnp.where(causal, s, -1e4)  # large, and finite in float16
    w = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, -1)
    x = x + o @ blk["proj"] + blk["proj_b"]
    h = _layer_norm(x, **blk["ln2"])
    x = x + jax.nn.gelu(h @ blk["fc1"] + blk["fc1_b"]) @ blk["fc2"] + blk["fc2_b"]
  logits = _layer_norm(x, **params["ln_f"]) @ params["head"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


#: name -> (how the float32 loss is wrapped, in words; the wrapping).
PRECISIONS = {
  "float32": ("the float32 loss as written", lambda f: f),
  "bfloat16": (
    "`ols.autocast(loss_fn, compute_dtype=jnp.bfloat16)`",
    lambda f: ols.autocast(f, compute_dtype=jnp.bfloat16),
  ),
  "float16": (
    "`ols.autocast(loss_fn, compute_dtype=jnp.float16)`",
    lambda f: ols.autocast(f, compute_dtype=jnp.float16),
  ),
  "float8": (
    '`ols.autocast(loss_fn, compute_dtype=jnp.bfloat16, matmul="float8")`',
    lambda f: ols.autocast(f, compute_dtype=jnp.bfloat16, matmul="float8"),
  ),
  # Block-scaled: native GEMMs where the GPU has them and they agree with the
  # emulation, else emulated (bfloat16 GEMMs); the report counts the native.
  "mxfp8": (
    '`ols.autocast(loss_fn, compute_dtype=jnp.bfloat16, matmul="mxfp8")`',
    lambda f: ols.autocast(f, compute_dtype=jnp.bfloat16, matmul="mxfp8"),
  ),
  "nvfp4": (
    '`ols.autocast(loss_fn, compute_dtype=jnp.bfloat16, matmul="nvfp4")`',
    lambda f: ols.autocast(f, compute_dtype=jnp.bfloat16, matmul="nvfp4"),
  ),
}


def step_flops(*, vocab, d_model, layers, seq, batch):
  """Matmul FLOPs of one train step: 6 N tokens + causal-agnostic attention."""
  n_matmul = layers * 12 * d_model**2 + d_model * vocab
  return 6 * n_matmul * batch * seq + 12 * layers * batch * seq**2 * d_model


def measure_precision(loss_fn, params, batch, args):
  """Times one precision's adam and loss-scaled steps; returns a result dict."""
  entries = bench.loss_entries(loss_fn, params, batch)
  plain, scaled = bench.measure_many(
    [entries["plain"], entries["scaled"]],
    args.calls,
    rounds=args.rounds,
    warmup=args.warmup,
    keep_compiled=True,
  )
  diag = ols.diagnostics(scaled["carry"][1])
  result = {"plain": plain, "scaled": scaled}
  result["skipped"] = int(diag["skipped_steps"])
  result["loss_scale"] = float(diag["loss_scale"])
  for r in (plain, scaled):
    hlo = r.pop("compiled").as_text()
    r["f8_gemms"] = hlo.count(F8_GEMM)
    r["f8_types"] = "f8e4m3" in hlo or "f8e5m2" in hlo
    r["block_gemms"] = hlo.count(BLOCK_GEMM)
    r.pop("carry")
  return result


def matmul_lines(name, wrap, loss_fn, params, batch):
  """Which of the loss's matmuls run in recipe ``name`` (``ols.list_matmuls``):
  a count per precision, and the table of each matmul's module path, kind,
  shapes and precision."""
  try:
    found = ols.list_matmuls(wrap(loss_fn), params, *batch)
  except Exception as e:  # noqa: BLE001
    return ["", f"{name} matmuls: not listed (`{_error_text(e)}`)."]
  counts = {}
  for m in found:
    counts[m.precision] = counts.get(m.precision, 0) + 1
  summary = ", ".join(f"{n} in {p}" for p, n in counts.items())
  return [
    "",
    f"{name} matmuls of the forward pass (`ols.list_matmuls`): {summary}, "
    f"of {len(found)}.",
    "",
    *_details(f"{name}: each matmul", ols.format_matmuls(found)),
  ]


def transformer(args, backend):
  sizes = {
    "vocab": args.vocab,
    "d_model": args.d_model,
    "layers": args.layers,
    "seq": args.seq,
  }
  params = init_decoder(jax.random.key(0), **sizes)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, args.vocab, (args.batch, args.seq), np.int32))
  batch = (tokens, jnp.roll(tokens, -1, axis=1))
  n_params = sum(x.size for x in jax.tree.leaves(params))
  n_tokens = args.batch * args.seq
  flops = step_flops(batch=args.batch, **sizes)

  def loss_fn(p, x, y):
    return decoder_loss(p, x, y, heads=args.heads)

  results = {}
  for name, (_, wrap) in PRECISIONS.items():
    print(f"  {name}", flush=True)
    try:
      results[name] = measure_precision(wrap(loss_fn), params, batch, args)
    except Exception as e:  # noqa: BLE001
      traceback.print_exc()
      results[name] = {"error": _error_text(e), "traceback": traceback.format_exc()}
  total_steps = args.rounds * (args.warmup + args.calls)
  lines = [
    f"Decoder-only transformer, float32 parameters (plain JAX, pre-LayerNorm, "
    f"GELU MLP 4x wide, causal softmax attention): layers {args.layers}, d_model "
    f"{args.d_model}, heads {args.heads}, vocabulary {args.vocab}, sequence "
    f"{args.seq}, batch {args.batch} ({n_tokens} tokens per step); "
    f"{n_params / 1e6:.1f}M parameters; {flops / 1e12:.3g} TFLOP of matmuls per "
    "step (6 x matmul parameters x tokens + 12 x layers x batch x seq^2 x d_model "
    "for attention). The loss is the mean cross-entropy over every token; the "
    "batch is random tokens (timing only).",
    "",
    "Each precision is timed with `optax.adam(1e-3)` (adam) and with "
    "`ols.dynamic_loss_scale(optax.adam(1e-3))` (ours: `ols.value_and_grad`, "
    "update, apply), by `bench.measure_many`: buffers donated, the two steps "
    f"called in turn in a random order, `block_until_ready` after each call; "
    f"each time is the smallest of {args.rounds} rounds' medians of "
    f"{args.calls} calls after {args.warmup} warm-up calls per round. "
    "*overhead* is ours over adam; *rounds spread* is the larger of the two "
    "steps' (slowest round median / fastest - 1), the noise of the row. "
    "*skipped* and *scale* are the loss scale's at the end "
    f"({total_steps} steps from 2^15).",
    "",
    "| precision | adam: step | adam: tokens/s | ours: step | ours: tokens/s "
    "| overhead | rounds spread | ours: TFLOP/s | skipped | scale "
    "| compile (adam, ours) |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for name, r in results.items():
    if "error" in r:
      error = r["error"].replace("|", "\\|")  # a table cell
      lines.append(f"| {name} | error: `{error}` | | | | | | | | | |")
      continue
    p, o = r["plain"], r["scaled"]
    spread = max(max(x["round_medians_s"]) / x["median_s"] - 1 for x in (p, o))
    lines.append(
      f"| {name} | {p['median_s'] * 1e3:.2f} ms | {n_tokens / p['median_s']:.0f} "
      f"| {o['median_s'] * 1e3:.2f} ms | {n_tokens / o['median_s']:.0f} "
      f"| {100 * (o['median_s'] / p['median_s'] - 1):+.1f}% "
      + (f"| {100 * spread:.1f}% " if args.rounds > 1 else "| - ")
      + f"| {flops / o['median_s'] / 1e12:.3g} | {r['skipped']} | {r['loss_scale']:g} "
      f"| {p['compile_s']:.1f} s, {o['compile_s']:.1f} s |"
    )
  lines.append("")
  lines += [f"- {name}: {how}" for name, (how, _) in PRECISIONS.items()]
  lines.append("")
  f8, bf16 = results.get("float8", {}), results.get("bfloat16", {})
  if "error" in f8 or "error" in bf16:
    lines.append("float8/bfloat16 tokens/s: not measured (a row failed).")
  else:
    lines.append(
      "float8/bfloat16 tokens/s: "
      f"adam {bf16['plain']['median_s'] / f8['plain']['median_s']:.3f}, "
      f"ours {bf16['scaled']['median_s'] / f8['scaled']['median_s']:.3f}."
    )
  lines.append("")
  if "error" in f8:
    lines.append("float8 HLO check: not made (the float8 row failed).")
  else:
    lines.append(
      f"float8 HLO check: cuBLASLt float8 GEMM custom calls (`{F8_GEMM}`) in the "
      f"compiled step: adam {f8['plain']['f8_gemms']}, "
      f"ours {f8['scaled']['f8_gemms']}; "
      "float8 types in the HLO: "
      + ("yes" if f8["plain"]["f8_types"] or f8["scaled"]["f8_types"] else "no")
      + "."
    )
  others = {
    n: r["plain"]["f8_gemms"] + r["scaled"]["f8_gemms"]
    for n, r in results.items()
    if n != "float8" and "error" not in r
  }
  if others:
    lines.append(
      "The same count in the other rows' steps (should be 0): "
      + ", ".join(f"{n} {c}" for n, c in others.items())
      + "."
    )
  blocks = {n: results[n] for n in ("mxfp8", "nvfp4") if n in results}
  if blocks:
    lines.append(
      f"Native block-scaled GEMMs (`{BLOCK_GEMM}` custom calls) in the loss-scaled "
      "step (0: emulated with bfloat16 GEMMs): "
      + ", ".join(
        f"{n} " + ("failed" if "error" in r else str(r["scaled"]["block_gemms"]))
        for n, r in blocks.items()
      )
      + "."
    )
  for name in ("float8", "mxfp8", "nvfp4"):
    lines += matmul_lines(name, PRECISIONS[name][1], loss_fn, params, batch)
  if backend == "cpu":
    lines += [
      "",
      "The backend is CPU: XLA's CPU backend has no float8 (nor fast float16) "
      "matmul, so float8 is only emulated here (converted to wider types) and no "
      "cuBLASLt call can appear; these times say nothing about a GPU.",
    ]
  for name, r in results.items():
    if "error" in r:
      lines += ["", *_details(f"{name}: traceback", r["traceback"])]
  return lines


# --------------------------------------------------------------------------
# The report.
# --------------------------------------------------------------------------


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    epilog="With --small, every option left at its default takes its --small "
    "value instead: "
    + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in SMALL.items()),
  )
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
  if args.small:
    for key, value in SMALL.items():
      if getattr(args, key) == parser.get_default(key):
        setattr(args, key, value)
  args.sections = [s for s in args.sections.split(",") if s]
  unknown = set(args.sections) - set(SECTIONS)
  if unknown:
    parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
  return args


def main(argv=None):
  args = parse_args(argv)
  if args.small:  # before JAX starts its backend (and for the tests' process)
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} {SMALL_XLA_FLAGS}".strip()
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
      return tests_lines(r, pytest_args, backend, args.small, log_name, workers)

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
      ],
    )
  if "transformer" in args.sections:
    section(order[3], lambda: transformer(args, backend))
  write()
  print(f"wrote {out} ({time.perf_counter() - t_start:.1f} s)")


if __name__ == "__main__":
  main()
