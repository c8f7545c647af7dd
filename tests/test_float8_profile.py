"""benchmarks/float8_profile.py: the HLO classifier, the trace split, the CPU proxy.

The classifier (``benchmarks/_hlo.py``) is checked on a hand-written module
whose every kernel is labelled by hand, and on a real float8 train step
compiled here; the trace split on a synthetic GPU-style trace of that step's
kernels (cuBLAS kernel names, kernels known only by name, lines a GPU trace
derives, another program's kernels). The proxy: the passes over memory that
the float8 recipe adds to each matmul, counted in the compiled step, held
at today's counts against the recipe's minimum. The script itself runs
``--small`` end to end (integration).
"""

import gzip
import importlib
import json
import pathlib
import re
import types

import benchmark_modules
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import report_tables
import versions

import optax_lossscale as ols

_DATA = pathlib.Path(__file__).parent / "data"


hlo = benchmark_modules.load("_hlo")
profile = benchmark_modules.load("float8_profile")
trace = benchmark_modules.load("_trace")
gpu_transformer = benchmark_modules.load("gpu_transformer")
train_step = benchmark_modules.load("train_step")

pytestmark = pytest.mark.standard_promotion  # optax's adam

#: The script's train steps are bench.py's, on Flax models; its text is the
#: main example's (which imports Flax).
needs_flax = pytest.mark.skipif(
  importlib.util.find_spec("flax") is None, reason="the script needs Flax"
)


# --------------------------------------------------------------------------
# The classifier, on a module labelled by hand.
# --------------------------------------------------------------------------

#: A module written by hand (in XLA's text format) with a kernel of each kind:
#: an amax, a split amax, a producer that writes its amax too, casts, a
#: transposed float8 copy, cuBLASLt's float8 GEMM, a Triton GEMM fusion, a
#: loop.
HAND_WRITTEN = (_DATA / "float8_kernels.hlo").read_text()

#: Each kernel of HAND_WRITTEN: its category, and whether it is a pass over
#: memory (a scalar kernel and an amax's second stage are not).
HAND_LABELS = {
  "amax.x": ("amax", True),
  "scale.x": ("other", False),  # scalars: the scale from the amax
  "cast.x": ("cast", True),
  "cast.w": ("cast", True),  # quantised and transposed in one kernel
  "transpose.x": ("transpose/copy", True),
  "gemm.f8": ("GEMM", True),
  "partial.y": ("amax", True),  # a split amax's first stage (reduce-window)
  "stage.y": ("amax", False),  # ... and its second, over the partial maxima
  "produced": ("other", True),  # a producer writing its amax too: no pass of its own
  "row.max": ("other", True),  # a max reduction without abs (softmax's)
  "gemm.bf16": ("GEMM", True),  # a Triton GEMM fusion
  "sum": ("other", True),
  "copy.sum": ("transpose/copy", True),
  "next": ("other", False),  # the loop body's, a scalar
  "twice": ("other", True),  # the loop body's
  "lt.c": ("other", False),  # the loop condition's, a scalar
}


def test_hand_written_module_categories():
  program = hlo.Program(HAND_WRITTEN)
  assert program.module == "jit_step"
  assert program.categories() == {k: c for k, (c, _) in HAND_LABELS.items()}


def test_hand_written_module_passes():
  program = hlo.Program(HAND_WRITTEN)
  want = dict.fromkeys(hlo.CATEGORIES, 0)
  for category, is_pass in HAND_LABELS.values():
    want[category] += is_pass
  assert program.passes() == want
  assert program.float8_gemms() == ["gemm.f8"]
  # The float8 GEMM's passes: its amax passes (the split one's first stage
  # counted once), its casts, and the transposed float8 copy it reads; the
  # copy of `sum` is no float8 operand's.
  assert program.float8_passes() == {
    "GEMM": 1,
    "amax": 2,
    "cast": 2,
    "transpose/copy": 1,
  }
  assert program.float8_moves() == {"f8e4m3fn": 1}  # the copy writes float8


@pytest.mark.parametrize(
  ("hlo_op", "name", "want"),
  [
    ("cast.x", "anything", "cast.x"),  # the event's hlo_op wins
    ("", "transpose_x", "transpose.x"),  # the kernel's name, as XLA writes it
    ("command_buffer.3", "gemm_bf16", "gemm.bf16"),  # inside a CUDA graph
    ("", "nvjet_qqtst_128x128_64x4_1x2_h_bz_coopA_TNT", None),
    ("no_such_op", "", None),
    ("%1", "x", None),  # a parameter is no kernel
  ],
)
def test_kernel_lookup(hlo_op, name, want):
  assert hlo.Program(HAND_WRITTEN).kernel(hlo_op, name) == want


def test_a_module_without_entry_is_refused():
  with pytest.raises(ValueError, match="ENTRY"):
    hlo.Program(
      "HloModule m\n\n%f (a: f32[]) -> f32[] {\n  ROOT %a = f32[] parameter(0)\n}\n"
    )


# --------------------------------------------------------------------------
# A real float8 train step, compiled here.
# --------------------------------------------------------------------------


def _decoder(layers=2, d_model=64, heads=4, seq=64, batch=4, vocab=256):
  params = gpu_transformer.init_decoder(
    jax.random.key(0), vocab=vocab, d_model=d_model, layers=layers, seq=seq
  )
  tokens = jnp.asarray(
    np.random.default_rng(0).integers(0, vocab, (batch, seq), np.int32)
  )

  def loss_fn(p, x, y):
    # The report's decoder broadcasts the positions over the batch.
    with jax.numpy_rank_promotion("allow"):
      return gpu_transformer.decoder_loss(p, x, y, heads=heads)

  return loss_fn, params, (tokens, jnp.roll(tokens, -1, axis=1))


def _compiled_step(precision, layers=2):
  loss_fn, params, batch = _decoder(layers)
  wrap = profile.PRECISIONS[precision][1]
  # optax's adam (a module fixture runs outside the test's promotion rule)
  with jax.numpy_dtype_promotion("standard"):
    step, carry, batch = train_step.loss_entries(wrap(loss_fn), params, batch)["plain"]
    return jax.jit(step, donate_argnums=0).lower(carry, batch).compile()


@pytest.fixture(scope="module")
def tasks():
  """The benchmarks' ``_tasks`` (the text), imported as the script imports it
  when it first needs it."""
  return benchmark_modules.load("_tasks")


def _text_args(loss_steps, eval_batches=2):
  return types.SimpleNamespace(
    vocab=256, loss_steps=loss_steps, eval_batches=eval_batches
  )


@needs_flax
def test_text_batches_are_next_token_windows_of_the_text(tasks):
  """The loss's data: ``loss_steps`` batches of training windows and
  ``eval_batches`` of held-out ones, each target the next token of its
  input, the same batches every call (both precisions train on the same),
  the held-out ones from the text's last 10% (the first at its start)."""
  size = {"seq": 16, "batch": 2}
  a = profile.text_batches(size, _text_args(3))
  b = profile.text_batches(size, _text_args(3))
  _, val = tasks.text_tokens(256)
  assert (len(a["train"]), len(a["val"])) == (3, 2)
  for part in ("train", "val"):
    for (x, y), (x_again, y_again) in zip(a[part], b[part], strict=True):
      assert x.shape == y.shape == (2, 16)
      np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
      np.testing.assert_array_equal(x, x_again)
      np.testing.assert_array_equal(y, y_again)
  assert len({np.asarray(x).tobytes() for x, _ in a["train"]}) == 3  # fresh windows
  np.testing.assert_array_equal(a["val"][0][0][0], val[:16])
  np.testing.assert_array_equal(a["val"][0][1][0], val[1:17])


@needs_flax
def test_text_loss_trains_the_timed_step_on_the_text(tasks):
  """``text_loss`` trains with the compiled step that was timed (its carry,
  parameters and a fresh Adam state, is the timed step's: a compiled
  program refuses another), and the held-out loss falls from the initial
  parameters'."""
  del tasks  # imported for text_batches
  loss_fn, params, batch = _decoder(layers=1, d_model=32, heads=2, seq=16, batch=2)
  text = profile.text_batches({"seq": 16, "batch": 2}, _text_args(30))
  with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
    step, carry, batch = train_step.loss_entries(loss_fn, params, batch)["plain"]
    compiled = jax.jit(step, donate_argnums=0).lower(carry, batch).compile()
    evaluate = jax.jit(loss_fn)
    before = float(np.mean([evaluate(params, *b) for b in text["val"]]))
    after = profile.text_loss(compiled, jax.tree.map(jnp.copy, params), text, evaluate)
  assert np.log(256) - 0.1 < before < np.log(256) + 0.1
  assert after < before - 0.5


@pytest.fixture(scope="module")
def float8_step():
  compiled = _compiled_step("float8")
  return hlo.Program(compiled.as_text()), compiled.as_text()


def _bodies(text):
  """``{computation name: its text}`` of an HLO module's text."""
  out = {}
  for m in re.finditer(r"^(?:ENTRY )?%([\w.\-]+) \(.*?\n\}\n", text, re.M | re.S):
    out[m.group(1)] = m.group(0)
  return out


def _pick(program, text):
  """One kernel of each category of the step, chosen on the HLO text alone:
  a ``dot`` (GEMM); a fusion reducing an ``abs`` to a scalar (amax); a
  fusion writing float8 (cast); a fusion whose result is a ``transpose`` or
  ``copy`` (transpose/copy); a fusion with neither (other)."""
  bodies = _bodies(text)
  picked = {}
  for instr in program.kernels():
    body = bodies.get(instr.calls[0], "") if instr.calls else ""
    root = re.search(r"ROOT %\S+ = \S+ ([\w\-]+)\(", body)
    if instr.opcode == "dot":
      picked.setdefault("GEMM", instr.name)
    elif instr.shape.startswith("f32[]") and " abs(" in body and " reduce(" in body:
      picked.setdefault("amax", instr.name)
    elif re.search(r"= f8e\w+\[[\d,]+\]\S* convert\(", body):
      picked.setdefault("cast", instr.name)
    elif root and root.group(1) in ("transpose", "copy") and "f8e" not in body:
      picked.setdefault("transpose/copy", instr.name)
    elif (
      instr.opcode == "fusion"
      and hlo.elements(instr.shape) > 1
      and not re.search(r" (dot|reduce|reduce-window|abs|transpose|copy)\(", body)
      and "f8e" not in body
    ):
      picked.setdefault("other", instr.name)
  assert sorted(picked) == sorted(hlo.CATEGORIES), picked
  return picked


@versions.xla_figures  # which kernels a step has: older XLAs fuse otherwise
def test_real_step_kernels_land_in_their_categories(float8_step):
  program, text = float8_step
  cats = program.categories()
  for category, name in _pick(program, text).items():
    assert cats[name] == category, (name, category)


def _gpu_trace(module, kernels):
  """A Chrome trace as a GPU's looks: a host process, and a device process
  with a kernel stream and a line derived from it; ``kernels`` are
  ``(name, hlo_op, hlo_module, microseconds)`` on the stream."""
  events = [
    {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
    {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
    {
      "ph": "M",
      "pid": 7,
      "tid": 3,
      "name": "thread_name",
      "args": {"name": "Stream #13(Compute)"},
    },
    {"ph": "M", "pid": 7, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}},
  ]
  ts = 0.0
  for name, hlo_op, hlo_module, dur in kernels:
    args = {"correlation_id": "1"}
    if hlo_op:
      args["hlo_op"] = hlo_op
    if hlo_module:
      args["hlo_module"] = hlo_module
    for pid, tid in ((7, 3), (7, 9), (1, 5)):  # the stream, the derived line, the host
      events.append(
        {
          "ph": "X",
          "pid": pid,
          "tid": tid,
          "ts": ts,
          "dur": dur,
          "name": name,
          "args": args,
        }
      )
    ts += dur
  return {"displayTimeUnit": "ns", "traceEvents": events}


@versions.xla_figures  # built from the step's kernels, as above
def test_gpu_trace_split(float8_step, tmp_path):
  program, text = float8_step
  picked = _pick(program, text)
  module = program.module
  steps = 2
  # Durations in powers of two: every sum of them is distinct.
  kernels = [
    # by hlo_op, the kernel named otherwise (a Triton or cuBLAS kernel)
    ("triton_softmax_kernel", picked["other"], module, 1.0),
    (
      "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x64_cublas",
      picked["GEMM"],
      module,
      2.0,
    ),
    # by name only: inside a CUDA graph (hlo_op of the command buffer)
    (hlo.kernel_name(picked["amax"]), "command_buffer.1", module, 4.0),
    (hlo.kernel_name(picked["cast"]), "", module + "(3)", 8.0),  # with its id
    (hlo.kernel_name(picked["transpose/copy"]), "", "", 16.0),
    # known by its name alone
    ("nvjet_qqtst_128x128_64x4_1x2_h_bz_coopA_TNT", "", module, 32.0),
    ("cutlass3x_sm90_tensorop_gemm_e4m3_e4m3_f32_bf16_bf16", "", module, 64.0),
    ("MemcpyDtoD", "", "", 128.0),
    ("unknown_kernel_of_a_library", "", module, 256.0),
    # another program's: left out
    (hlo.kernel_name(picked["GEMM"]), picked["GEMM"], "jit_other", 512.0),
  ]
  path = tmp_path / "trace.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump(_gpu_trace(module, kernels), f)
  events = trace.kernel_events(trace.load_trace(str(path)), module)
  assert len(events) == len(kernels) - 1  # one of each, on the stream alone
  split = profile.split_time(events, program, steps)
  ms = {c: t * steps * 1e3 for c, t in split["ms"].items()}  # back to microseconds
  assert ms == pytest.approx(
    {
      "GEMM": 2.0 + 32.0 + 64.0,
      "amax": 4.0,
      "cast": 8.0,
      "transpose/copy": 16.0 + 128.0,
      "other": 1.0 + 256.0,
    }
  )
  total = sum(d for *_, d in kernels[:-1])
  assert split["total_ms"] * steps * 1e3 == pytest.approx(total)
  assert split["matched_ms"] * steps * 1e3 == pytest.approx(1 + 2 + 4 + 8 + 16)
  assert split["by_name_ms"] * steps * 1e3 == pytest.approx(32 + 64 + 128)
  assert split["unattributed_ms"] * steps * 1e3 == pytest.approx(256)
  assert split["events"] == len(kernels) - 1
  assert [k[2] for k in split["kernels"][:2]] == [
    "unknown_kernel_of_a_library",
    "MemcpyDtoD",
  ]


def test_cpu_trace_events(float8_step):
  """Without a device process (XLA:CPU): the events naming an instruction of
  the module, without the thunk executor's ``end:`` markers."""
  program, _ = float8_step
  some = list(program.categories())[:3]
  events = [
    {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
    {"ph": "X", "pid": 1, "tid": 2, "ts": 0, "dur": 5, "name": "PjitFunction(plain)"},
  ]
  for name in some:
    for shown in (name, f"end: {name}"):
      events.append(
        {
          "ph": "X",
          "pid": 1,
          "tid": 2,
          "ts": 1,
          "dur": 3,
          "name": shown,
          "args": {"hlo_op": name, "hlo_module": program.module},
        }
      )
  events.append(
    {
      "ph": "X",
      "pid": 1,
      "tid": 2,
      "ts": 9,
      "dur": 3,
      "name": "x",
      "args": {"hlo_op": "x", "hlo_module": "jit_other"},
    }
  )
  assert trace.kernel_events(events, program.module) == [(n, n, 3.0) for n in some]
  empty = profile.split_time([], program, 3)
  assert empty["total_ms"] == 0 and empty["events"] == 0 and empty["kernels"] == []


@pytest.mark.parametrize(
  ("text", "message"),
  [
    ("1024:8:16:1024", "d_model:layers:heads:seq:batch"),
    ("1024:8:0:1024:8", "positive integers"),
    ("1024:8:-16:1024:8", "positive integers"),
    ("1000:8:16:1024:8", "multiple of heads"),
    ("", "no size"),
  ],
)
def test_bad_sizes_are_refused(text, message):
  with pytest.raises(ValueError, match=message):
    profile.parse_sizes(text)


def test_sizes():
  sizes = profile.parse_sizes(profile.SIZES)
  assert [s["d_model"] for s in sizes] == [1024, 2048, 4096]
  assert {s["seq"] * s["batch"] for s in sizes} == {8192}


def test_min_size_keeps_the_float8_precisions_small_matmuls_in_bfloat16():
  """``--min-size N``: the float8 precision is ``Float8Matmul(min_size=N)``,
  its report line says so, and its matmuls with a dimension below N are
  listed as kept "small"; 0 is the default recipe; a negative one is
  refused."""
  assert profile.parse_args(["--small"]).min_size == 0
  assert profile.float8_precision(0) == profile.PRECISIONS["float8"]
  how, wrap = profile.float8_precision(64)
  assert "Float8Matmul(min_size=64)" in how

  def loss(w, v, x):
    return jnp.sum((x @ w) @ v)

  w, v, x = jnp.ones((128, 256)), jnp.ones((256, 32)), jnp.ones((96, 128))
  kept = [m.kept for m in ols.list_matmuls(wrap(loss), w, v, x)]
  assert kept == [None, "small"]
  with pytest.raises(SystemExit):
    profile.parse_args(["--min-size", "-1"])


# --------------------------------------------------------------------------
# The proxy: passes over memory per float8 matmul, in the compiled step.
# --------------------------------------------------------------------------


def _dense_programs():
  """A float8 dense layer's value and gradients (of both operands)."""

  def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w))

  w, x = jnp.ones((256, 512)), jnp.ones((128, 256))
  out = {}
  for name, (_, wrap) in profile.PRECISIONS.items():
    fn = jax.value_and_grad(wrap(loss), argnums=(0, 1))
    out[name] = hlo.Program(jax.jit(fn).lower(w, x).compile().as_text())
  return out


@versions.xla_figures
def test_float8_dense_layer_passes():
  """One matmul: at the minimum in amax passes, casts and transposes (one
  amax and one cast of each forward operand and of the output gradient; the
  weight's gradient, ``x . g``, comes out in the weight's layout: written
  ``g . x`` it was computed transposed, then transposed and copied back, 2
  passes). bfloat16's has those 2 (its product's float32 result is read by
  tanh only: its gradient products run in bfloat16, whose result XLA:CPU
  rounds after the dot, so the transpose does not fold into it)."""
  programs = _dense_programs()
  f8 = programs["float8"].float8_passes()
  n = 1
  assert f8["GEMM"] == 3 * n  # the forward product and the two gradients'
  assert f8["amax"] == profile.MINIMUM["amax"] * n
  assert f8["cast"] == profile.MINIMUM["cast"] * n
  assert f8["transpose/copy"] == profile.MINIMUM["transpose/copy"] * n == 0
  assert programs["float8"].float8_moves() == {}
  assert programs["bfloat16"].passes()["transpose/copy"] == 2
  assert programs["bfloat16"].float8_passes() == dict.fromkeys(
    ("GEMM", "amax", "cast", "transpose/copy"), 0
  )


@versions.xla_figures
def test_float8_train_step_passes(float8_step):
  """The decoder's float8 train step (2 layers: 9 float8 matmuls, the four
  weights' of each layer and the output layer's, each with a forward
  product and two gradient products; attention's two products run in
  bfloat16) on XLA:CPU, held at today's counts. The minimum is 3 amax
  passes and 3 casts per matmul (27 each) and no transposed copy. Today:
  amax at the minimum; 9 casts more (the output gradient of each matmul is
  quantised twice, once in each layout its two gradient products read); 3
  transposed copies: in each layer, attention's output as its heads are
  put back side by side (the model's own transpose, here read by the
  output projection's amax and cast), and a kernel of the backward pass
  that writes the embedding's gradient through a copy and reads float8
  GEMMs' float32 gradients directly. Copies of donated parameters are the
  donation's, not counted."""
  program, _ = float8_step
  loss_fn, params, batch = _decoder()
  wrapped = profile.PRECISIONS["float8"][1](loss_fn)
  matmuls = ols.list_matmuls(wrapped, params, *batch)
  n = sum(m.precision == "float8" for m in matmuls)
  assert n == 4 * 2 + 1  # attention's products run in bfloat16
  assert program.float8_passes() == {
    "GEMM": 3 * n,
    "amax": profile.MINIMUM["amax"] * n,
    "cast": profile.MINIMUM["cast"] * n + n,
    "transpose/copy": 3,
  }
  assert program.float8_moves() == {"f32": 3}  # none of float8 values


def _accumulate_closed_over(grad, p, xs):
  def body(g, x):
    return jax.tree.map(jnp.add, g, grad(p, x)), None

  return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, p), xs)[0]


def _accumulate_in_carry(grad, p, xs):
  def body(carry, x):
    p, g = carry
    return (p, jax.tree.map(jnp.add, g, grad(p, x))), None

  return jax.lax.scan(body, (p, jax.tree.map(jnp.zeros_like, p)), xs)[0][1]


def _accumulate_fori(grad, p, xs):
  def body(i, g):
    return jax.tree.map(jnp.add, g, grad(p, xs[i]))

  return jax.lax.fori_loop(0, xs.shape[0], body, jax.tree.map(jnp.zeros_like, p))


@versions.xla_figures
@pytest.mark.parametrize(
  "accumulate", [_accumulate_closed_over, _accumulate_in_carry, _accumulate_fori]
)
def test_float8_weights_are_quantised_once_a_step_under_gradient_accumulation(
  accumulate,
):
  """Gradients accumulated over micro-batches in one loop (a ``lax.scan``
  closing over the parameters or carrying them, a ``fori_loop``): the
  weights do not change inside it, and XLA hoists their amax and their
  cast out of the loop, so each weight is quantised once a step, not once
  a micro-batch. What the loop repeats is the rest of the recipe: the
  amax and cast of the input, of the hidden activation and of each
  matmul's output gradient (4 of each), and the 5 float8 GEMMs (the
  input's gradient is not taken)."""

  def loss(p, x):
    h = jnp.tanh(x @ p["w1"])
    return jnp.mean((h @ p["w2"]) ** 2)

  grad = jax.grad(ols.autocast(loss, compute_dtype=jnp.bfloat16, matmul="float8"))
  p = {"w1": jnp.ones((256, 512)), "w2": jnp.ones((512, 128))}
  xs = jnp.ones((4, 64, 256))
  program = hlo.Program(
    jax.jit(lambda p, xs: accumulate(grad, p, xs)).lower(p, xs).compile().as_text()
  )
  categories, looped = program.categories(), program.in_loops()

  def count(category, in_loop):
    return sum(
      c == category and (name in looped) == in_loop for name, c in categories.items()
    )

  assert {c: (count(c, True), count(c, False)) for c in ("amax", "cast", "GEMM")} == {
    "amax": (4, 2),
    "cast": (4, 2),
    "GEMM": (5, 0),
  }


def test_in_loops_names_the_kernels_of_loop_bodies():
  program = hlo.Program(HAND_WRITTEN)
  looped = program.in_loops()
  assert looped == {n for n in HAND_LABELS if n in ("next", "twice", "lt.c")}


# --------------------------------------------------------------------------
# The script, end to end.
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_report(tmp_path_factory):
  out = tmp_path_factory.mktemp("float8_profile") / "report.md"
  return benchmark_modules.run_small("float8_profile.py", out), out


_table, _number = report_tables.table, report_tables.number


@needs_flax
@pytest.mark.integration
def test_small_report_tokens(small_report):
  text, _ = small_report
  assert text.startswith("# float8 against bfloat16")
  assert "error" not in text
  sizes = profile.parse_sizes(profile.SMALL_SIZES)
  rows = _table(text, "| d_model |")
  assert [int(r[0]) for r in rows] == [s["d_model"] for s in sizes]
  env = dict(_table(text, "| | |"))
  assert env["backend"].split()[0] == jax.default_backend()
  for row, size in zip(rows, sizes, strict=True):
    tokens = size["seq"] * size["batch"]
    assert f"sequence {size['seq']} x batch {size['batch']} ({tokens} tokens" in text
    b_ms, f_ms = _number(row[2], "ms"), _number(row[4], "ms")
    for ms, per_s in ((b_ms, row[3]), (f_ms, row[5])):
      assert ms > 0
      assert _number(per_s) == pytest.approx(1e3 * tokens / ms, rel=0.01, abs=1)
    assert _number(row[6]) == pytest.approx(b_ms / f_ms, rel=0.01)
    losses = re.fullmatch(r"(\S+), (\S+), (\S+) \((\S+)\)", row[9])
    assert losses, row[9]
    assert float(losses[4]) == pytest.approx(
      float(losses[3]) - float(losses[2]), abs=2e-4
    )
    # trained for 3 steps from ln(256) nats: each has learnt, all alike
    f32, b16, f8 = (float(losses[i]) for i in (1, 2, 3))
    assert all(x < np.log(256) - 0.1 for x in (f32, b16, f8)), row[9]
    assert abs(b16 - f32) < 0.05 and abs(f8 - f32) < 0.05, row[9]


@needs_flax
@pytest.mark.integration
def test_small_report_split(small_report):
  text, out = small_report
  sizes = [s["d_model"] for s in profile.parse_sizes(profile.SMALL_SIZES)]
  rows = _table(text, "| d_model | precision |")
  assert [(int(r[0]), r[1]) for r in rows] == [
    (d, p) for d in sizes for p in profile.PRECISIONS
  ]
  for row in rows:
    total = _number(row[3])
    parts = [re.fullmatch(r"(\S+) \((\d+)%\)", c) for c in row[4:9]]
    assert all(parts), row
    assert sum(float(p[1]) for p in parts) == pytest.approx(total, abs=0.003)
    assert total > 0
    if jax.default_backend() == "cpu":  # every XLA:CPU thunk names its instruction
      assert row[9] == "100% + 0%"
    amax, cast = float(parts[1][1]), float(parts[2][1])
    if row[1] == "bfloat16":
      assert amax == cast == 0  # no float8 in the step
    else:
      assert amax > 0 and cast > 0
  for d in sizes:
    line = re.search(
      rf"- d_model {d}: (\d+) float8 matmuls in the forward pass, (\d+) float8 "
      r"GEMMs in the step \((\d+) cuBLASLt `__cublas\$lt\$matmul\$f8`\); amax passes "
      r"(\d+) \(minimum (\d+)\), casts (\d+) \(minimum (\d+)\)",
      text,
    )
    assert line, f"no passes line for d_model {d}"
    n = int(line[1])
    assert int(line[2]) == 3 * n
    assert int(line[5]) == int(line[7]) == 3 * n
    for name in profile.PRECISIONS:
      path = out.parent / "report_traces" / f"d{d}_{name}.json.gz"
      assert trace.load_trace(str(path))
      assert f"<summary>d_model {d}, {name}: the kernels" in text
