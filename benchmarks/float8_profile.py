"""float8 against bfloat16 on a GPU: train-step tokens/s, and where the time goes.

One command, meant for one GPU (H100 class), minutes long, that writes
``--out`` (default ``benchmarks/out/float8_profile.md``):

1. Environment: what the GPU report's first section says (device, versions,
   commit, date).
2. Tokens/s: for each size of ``--sizes`` (default d_model 1024, 2048 and
   4096, 8192 tokens a step each), the GPU report's decoder
   (``gpu_transformer.py``: float32 parameters, plain JAX) trained with
   ``optax.adam`` in bfloat16 (``ols.autocast(loss_fn,
   compute_dtype=jnp.bfloat16)``) and with float8 matmuls (``...,
   matmul="float8"``), the two steps timed together by
   ``_harness.measure_many`` (buffers donated, called in turn, each time
   the smallest of the rounds' medians); tokens/s and their ratio. Then
   each precision's compiled step trains the decoder again from the same
   initial parameters on text (Python's standard library, the main
   example's tokenizer; ``--loss-steps`` batches of fresh windows, the same
   for both, and for float32 as the reference), and the report gives each
   one's float32 loss on held-out windows and float8's difference to
   bfloat16.
3. Time split: for each size and precision, a ``jax.profiler`` trace of
   ``--profile-steps`` steps (Chrome-trace JSON), its kernels matched to
   the compiled step (``_hlo.Program``: by the ``hlo_op`` each kernel
   event names, else by the kernel's name, which XLA takes from its
   fusion's) and their time summed by what they compute: GEMMs, amax
   reductions, casts to or from float8, transposes and copies, other. The
   share of the time that could be matched is reported, and the kernels
   that took the most time in a collapsed listing. Then the compiled float8
   step's passes over memory per float8 matmul (``Program.float8_passes``)
   against the recipe's minimum: per matmul one amax and one cast of each
   forward operand and of the output gradient (3 and 3), and no transposed
   copy.

A size that raises is reported as an error line; the rest of the report is
still made. The report is rewritten after each size, so a run cut short
keeps what it finished. The traces are kept beside the report
(``<out>_traces/``; open one in https://ui.perfetto.dev), each with its
compiled step's HLO text (``*.hlo.txt.gz``), which names its kernels.

``--small`` runs tiny sizes (d_model 32, 48 and 64; a few calls; XLA's
backend optimisation level 0), every code path in well under a minute on a
CPU (what ``tests/test_float8_profile.py`` runs); its numbers measure
nothing, and a CPU has no float8 GEMM (XLA:CPU widens float8 to float32).

Run:  python benchmarks/float8_profile.py [--small] [--out PATH]   (see --help)
"""

from __future__ import annotations

import gc
import gzip
import os
import re
import shlex
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]  # the harness; optax_lossscale, also when not installed

import gpu_transformer as _transformer  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import train_step  # noqa: E402
from _harness import (  # noqa: E402
  SMALL_XLA_FLAGS,
  details,
  error_text,
  measure_many,
  small_defaults,
  small_parser,
  small_xla_flags,
  table,
)
from _hlo import CATEGORIES, GEMM_TARGETS, Program  # noqa: E402
from _trace import kernel_events, profile  # noqa: E402
from _workloads import LR  # noqa: E402
from gpu_transformer import decoder_loss, init_decoder, step_flops  # noqa: E402

import optax_lossscale as ols  # noqa: E402

#: name -> (how the float32 loss is wrapped, in words; the wrapping): the
#: GPU transformer's bfloat16 and float8.
PRECISIONS = {k: _transformer.PRECISIONS[k] for k in ("bfloat16", "float8")}


def float8_precision(min_size):
  """The float8 precision's ``(description, wrap)``: the default recipe, or
  with ``min_size`` (``--min-size``) its matmuls with an M, K or N below it
  kept in bfloat16."""
  if not min_size:
    return _transformer.PRECISIONS["float8"]
  recipe = ols.Float8Matmul(min_size=min_size)
  return (
    "`ols.autocast(loss_fn, compute_dtype=jnp.bfloat16, "
    f"matmul=ols.Float8Matmul(min_size={min_size}))`",
    lambda f: ols.autocast(f, compute_dtype=jnp.bfloat16, matmul=recipe),
  )


#: Each size: d_model:layers:heads:seq:batch (8192 tokens a step; with Adam's
#: float32 state the largest takes about 40 GB).
SIZES = "1024:8:16:1024:8,2048:4:16:2048:4,4096:2:32:2048:4"
SMALL_SIZES = "32:2:2:16:2,48:1:2:16:2,64:1:4:16:2"
#: Option values that --small puts in place of the defaults.
SMALL = {
  "sizes": SMALL_SIZES,
  "vocab": 256,
  "calls": 3,
  "rounds": 1,
  "warmup": 1,
  "profile_steps": 2,
  "loss_steps": 3,
  "eval_batches": 1,
}
#: The recipe's passes over memory per float8 matmul of a train step: an
#: amax and a cast of each forward operand and of the output gradient; the
#: backward's two products reuse the saved float8 operands. No transposed
#: copy: where a GEMM reads an operand along another axis (a Hopper float8
#: GEMM reads both along their contracted axis), the cast can write it so.
MINIMUM = {"amax": 3, "cast": 3, "transpose/copy": 0}

#: Kernels known by their names where no instruction of the step names them:
#: cuBLAS/cuBLASLt (``nvjet``, ``sm90_xmma_gemm``, ``cutlass``), cuDNN.
GEMM_KERNEL = re.compile(r"gemm|xmma|cutlass|nvjet|cublas|cudnn|wgmma|matmul", re.I)
COPY_KERNEL = re.compile(r"memcpy|memset|transpose|copy", re.I)


def parse_sizes(text):
  """``--sizes``: ``[{d_model, layers, heads, seq, batch}, ...]``."""
  keys = ("d_model", "layers", "heads", "seq", "batch")
  sizes = []
  for item in filter(None, text.split(",")):
    parts = item.split(":")
    if len(parts) != len(keys) or not all(p.isdigit() and int(p) > 0 for p in parts):
      raise ValueError(
        f"a size is d_model:layers:heads:seq:batch in positive integers, got {item!r}"
      )
    size = dict(zip(keys, map(int, parts), strict=True))
    if size["d_model"] % size["heads"]:
      raise ValueError(f"d_model must be a multiple of heads, got {item!r}")
    sizes.append(size)
  if not sizes:
    raise ValueError("--sizes names no size")
  return sizes


# --------------------------------------------------------------------------
# The trace's kernel events (``_trace``), matched to the compiled step.
# --------------------------------------------------------------------------


def split_time(events, program, steps):
  """The kernels' time by category: a dict of per-step figures.

  Each kernel event is matched to the step's instruction (``hlo_op``, else
  its name) and counted in that instruction's category; an event that
  matches none goes by its name (cuBLAS and cuDNN kernels are GEMMs,
  memcpy and memset copies), else to ``other``, unattributed.

  Returns:
    ``{"total_ms", "events", "ms": {category: ms}, "matched_ms",
    "by_name_ms", "unattributed_ms", "kernels": [(ms, calls, name,
    category, how), ...] by time}``, times per step.
  """
  cats = program.categories()
  ms = dict.fromkeys(CATEGORIES, 0.0)
  how_ms = {"HLO": 0.0, "name": 0.0, "none": 0.0}
  kernels = {}
  for name, hlo_op, dur_us in events:
    instr = program.kernel(hlo_op, name)
    if instr is not None:
      cat, how = cats[instr], "HLO"
      instr_text = program.instructions[instr]
      if instr_text.opcode == "custom-call" and GEMM_TARGETS.search(instr_text.target):
        cat = "GEMM"
    elif GEMM_KERNEL.search(name):
      cat, how = "GEMM", "name"
    elif COPY_KERNEL.search(name):
      cat, how = "transpose/copy", "name"
    else:
      cat, how = "other", "none"
    t = dur_us / 1e3 / steps
    ms[cat] += t
    how_ms[how] += t
    k = kernels.setdefault((name, cat, how), [0.0, 0])
    k[0] += t
    k[1] += 1
  ranked = sorted(
    ((t, n / steps, name, cat, how) for (name, cat, how), (t, n) in kernels.items()),
    reverse=True,
  )
  return {
    "total_ms": sum(ms.values()),
    "events": len(events),
    "ms": ms,
    "matched_ms": how_ms["HLO"],
    "by_name_ms": how_ms["name"],
    "unattributed_ms": how_ms["none"],
    "kernels": ranked,
  }


# --------------------------------------------------------------------------
# One size.
# --------------------------------------------------------------------------


def text_batches(size, args):
  """``{"train": [(x, y), ...], "val": [...]}``: ``args.loss_steps`` batches of
  windows of the standard library's tokens (``_tasks.text_tokens``, random,
  seeded) and ``args.eval_batches`` of held-out windows (evenly spaced), each
  ``size["batch"]`` windows of ``size["seq"]`` inputs and their next tokens."""
  import _tasks  # the examples' text: imports Flax

  train, val = _tasks.text_tokens(args.vocab)
  b = size["batch"]
  windows, val_idx = _tasks.train_lm.sample(
    train,
    val,
    steps=args.loss_steps,
    batch=b,
    context=size["seq"],
    eval_sequences=args.eval_batches * b,
    seed=0,
  )
  held_out = val[val_idx]

  def split(w):
    return jnp.asarray(w[:, :-1]), jnp.asarray(w[:, 1:])

  return {
    "train": [split(w) for w in windows],
    "val": [split(held_out[i : i + b]) for i in range(0, len(held_out), b)],
  }


def text_loss(compiled, params, batches, evaluate):
  """Trains ``params`` (with a fresh ``optax.adam(LR)`` state, the timed
  step's) with ``compiled`` on ``batches["train"]``; the mean of
  ``evaluate`` over ``batches["val"]``."""
  carry = (params, optax.adam(LR).init(params))
  for batch in batches["train"]:
    carry = compiled(carry, batch)
  return float(np.mean([evaluate(carry[0], *batch) for batch in batches["val"]]))


def measure_size(size, args, trace_stem):
  """Times, profiles and counts one size; returns a result dict."""
  d, vocab = size["d_model"], args.vocab

  def init():
    return init_decoder(
      jax.random.key(0), vocab=vocab, d_model=d, layers=size["layers"], seq=size["seq"]
    )

  params = init()
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, vocab, (size["batch"], size["seq"]), np.int32))
  batch = (tokens, jnp.roll(tokens, -1, axis=1))

  def loss_fn(p, x, y):
    return decoder_loss(p, x, y, heads=size["heads"])

  result = {
    "params": sum(x.size for x in jax.tree.leaves(params)),
    "tokens": size["batch"] * size["seq"],
    "flops": step_flops(
      vocab=vocab, **{k: size[k] for k in ("d_model", "layers", "seq", "batch")}
    ),
  }
  matmuls = ols.list_matmuls(PRECISIONS["float8"][1](loss_fn), params, *batch)
  result["float8_matmuls"] = sum(m.precision == "float8" for m in matmuls)
  entries = [
    train_step.loss_entries(wrap(loss_fn), params, batch)["plain"]
    for _, wrap in PRECISIONS.values()
  ]
  del params
  timed = measure_many(
    entries, args.calls, rounds=args.rounds, warmup=args.warmup, keep_compiled=True
  )
  del entries
  evaluate = jax.jit(loss_fn)
  text = text_batches(size, args) if args.loss_steps else None
  for name, r in zip(PRECISIONS, timed, strict=True):
    out = result[name] = {
      "median_s": r["median_s"],
      "spread": max(r["round_medians_s"]) / r["median_s"] - 1,
      "compile_s": r["compile_s"],
    }
    hlo = r["compiled"].as_text()
    program = Program(hlo)
    # Beside the trace: its kernels are named by the fusions of this text.
    os.makedirs(os.path.dirname(trace_stem), exist_ok=True)
    with gzip.open(f"{trace_stem}_{name}.hlo.txt.gz", "wt") as f:
      f.write(hlo)
    out["passes"] = program.passes()
    out["float8_passes"] = program.float8_passes()
    out["float8_moves"] = program.float8_moves()
    out["cublas_f8"] = sum("$f8" in i.target for i in program.instructions.values())
    carry = r.pop("carry")
    try:
      carry, events = profile(
        r["compiled"], carry, batch, args.profile_steps, f"{trace_stem}_{name}.json.gz"
      )
      out["split"] = split_time(
        kernel_events(events, program.module), program, args.profile_steps
      )
    except Exception as e:  # noqa: BLE001
      traceback.print_exc()
      out["split_error"] = error_text(e)
    del carry
    if text is not None:
      out["loss"] = text_loss(r["compiled"], init(), text, evaluate)
    del r["compiled"]
  if text is not None:  # the reference: what rounding to bfloat16 alone moves
    step, carry, _ = train_step.loss_entries(loss_fn, init(), text["train"][0])["plain"]
    compiled = jax.jit(step, donate_argnums=0).lower(carry, text["train"][0]).compile()
    del carry
    result["float32_loss"] = text_loss(compiled, init(), text, evaluate)
  return result


# --------------------------------------------------------------------------
# The report.
# --------------------------------------------------------------------------


def shape_text(size):
  return (
    f"d_model {size['d_model']}, {size['layers']} layers, {size['heads']} heads, "
    f"sequence {size['seq']} x batch {size['batch']}"
  )


def tokens_lines(sizes, results, args):
  rows = []
  for size in sizes:
    key = size["d_model"]
    r = results.get(key)
    if r is None:
      continue
    if "error" in r:
      rows.append([key, f"error: `{r['error'].replace('|', '/')}`", *[""] * 9])
      continue
    b, f = r["bfloat16"], r["float8"]
    n = r["tokens"]
    tflops = [r["flops"] / x["median_s"] / 1e12 for x in (b, f)]
    rows.append(
      [
        key,
        f"{r['params'] / 1e6:.3g}M",
        f"{b['median_s'] * 1e3:.2f} ms",
        f"{n / b['median_s']:.0f}",
        f"{f['median_s'] * 1e3:.2f} ms",
        f"{n / f['median_s']:.0f}",
        f"**{b['median_s'] / f['median_s']:.3f}**",
        f"{tflops[0]:.3g}, {tflops[1]:.3g}",
        f"{max(b['spread'], f['spread']):.1%}" if args.rounds > 1 else "-",
        f"{r['float32_loss']:.4f}, {b['loss']:.4f}, {f['loss']:.4f} "
        f"({f['loss'] - b['loss']:+.4f})"
        if "loss" in b
        else "-",
        f"{b['compile_s']:.1f} s, {f['compile_s']:.1f} s",
      ]
    )
  return table(
    [
      "d_model",
      "parameters",
      "bfloat16: step",
      "bfloat16: tokens/s",
      "float8: step",
      "float8: tokens/s",
      "float8/bfloat16",
      "TFLOP/s: bfloat16, float8",
      "rounds spread",
      "loss: float32, bfloat16, float8 (float8 - bfloat16)",
      "compile: bfloat16, float8",
    ],
    rows,
    "rlrrrrrrrrr",
  )


def split_lines(sizes, results):
  rows, listings = [], []
  for size in sizes:
    key = size["d_model"]
    r = results.get(key)
    if r is None or "error" in r:
      continue
    for name in PRECISIONS:
      out = r[name]
      if "split_error" in out:
        rows.append([key, name, f"error: `{out['split_error']}`", *[""] * 7])
        continue
      s = out["split"]
      if not s["events"]:
        rows.append([key, name, "no kernel of the step in the trace", *[""] * 7])
        continue
      total = s["total_ms"]
      cells = [
        f"{s['ms'][c]:.3f} ({100 * s['ms'][c] / total:.0f}%)" for c in CATEGORIES
      ]
      rows.append(
        [
          key,
          name,
          f"{out['median_s'] * 1e3:.2f}",
          f"{total:.3f}",
          *cells,
          f"{s['matched_ms'] / total:.0%} + {s['by_name_ms'] / total:.0%}",
        ]
      )
      top = [
        f"{t:9.3f} ms {calls:6.1f}x  {cat:<14} {how:<4}  {kname[:110]}"
        for t, calls, kname, cat, how in s["kernels"][:25]
      ]
      listings += details(
        f"d_model {key}, {name}: the kernels that took the most time (per step)",
        "\n".join(top),
      ) + [""]
  lines = table(
    [
      "d_model",
      "precision",
      "step (timed), ms",
      "kernels, ms",
      *(f"{c}, ms" for c in CATEGORIES),
      "matched: HLO + name",
    ],
    rows,
    "llrrrrrrrl",
  )
  return lines, listings


def passes_lines(sizes, results):
  lines = []
  for size in sizes:
    r = results.get(size["d_model"])
    if r is None or "error" in r:
      continue
    p, b = r["float8"]["float8_passes"], r["bfloat16"]["passes"]
    n = r["float8_matmuls"]
    by_type = r["float8"]["float8_moves"]
    moves = (
      "; by the type they write: " + ", ".join(f"{t} {k}" for t, k in by_type.items())
      if by_type
      else ""
    )
    lines.append(
      f"- d_model {size['d_model']}: {n} float8 matmuls in the forward pass, "
      f"{p['GEMM']} float8 GEMMs in the step ({r['float8']['cublas_f8']} "
      f"cuBLASLt `__cublas$lt$matmul$f8`); amax passes {p['amax']} "
      f"(minimum {MINIMUM['amax'] * n}), casts {p['cast']} "
      f"(minimum {MINIMUM['cast'] * n}), transposes and copies of float8 "
      f"matmuls' operands or products {p['transpose/copy']} (minimum 0{moves}); "
      f"transposes and copies in the whole step: float8 "
      f"{r['float8']['passes']['transpose/copy']}, bfloat16 {b['transpose/copy']}."
    )
  return lines


def report(args, argv, env_lines, sizes, results, t_start, backend):
  small = " (--small: tiny sizes, numbers mean nothing)" if args.small else ""
  shown = " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
  md = [
    f"# float8 against bfloat16: tokens/s and where the time goes{small}",
    "",
    f"Made by `python benchmarks/float8_profile.py {shown}`".rstrip()
    + (f", XLA compiling with `{SMALL_XLA_FLAGS}` (--small)." if args.small else "."),
    "",
    "## 1. Environment",
    "",
    *env_lines,
    "",
    "## 2. Tokens/s",
    "",
    "The GPU report's decoder (float32 parameters, plain JAX, pre-LayerNorm, "
    f"GELU MLP 4x wide, causal softmax attention; vocabulary {args.vocab}) at "
    "each size: "
    + "; ".join(
      f"{shape_text(s)} ({s['batch'] * s['seq']} tokens a step)" for s in sizes
    )
    + ". The loss is the mean cross-entropy over every token; the timed batch "
    "is random tokens, the same every step.",
    "",
    "Both precisions are trained with `optax.adam(1e-3)` (buffers donated) and "
    "timed together by `_harness.measure_many`: the two steps called in turn, "
    f"in a random order; each time is the smallest of {args.rounds} rounds' "
    f"medians of {args.calls} calls after {args.warmup} warm-up calls. "
    "*rounds spread*: the larger of the two steps' (slowest round median / "
    "fastest - 1). *TFLOP/s*: the step's matmul FLOPs (the GPU report's count: "
    "6 x matmul parameters x tokens + attention's) per second. *loss*: each "
    "precision's compiled step trains the decoder again from the same initial "
    f"parameters for {args.loss_steps} steps on text (Python's standard "
    f"library in `examples/train_lm.py`'s tokens of a vocabulary of "
    f"{args.vocab}; fresh random windows each step, the same for both), then "
    f"the float32 loss on {args.eval_batches} batches of held-out windows; "
    "float32 is the same training without autocast: the bfloat16 run's "
    "distance to it is what rounding alone moves the loss"
    + ("." if args.loss_steps else " (`--loss-steps 0`: not measured)."),
    "",
    *[f"- {name}: {how}" for name, (how, _) in PRECISIONS.items()],
    "",
    *tokens_lines(sizes, results, args),
  ]
  for size in sizes:
    r = results.get(size["d_model"], {})
    if "error" in r:
      md += ["", *details(f"d_model {size['d_model']}: traceback", r["traceback"])]
  split, listings = split_lines(sizes, results)
  md += [
    "",
    "## 3. Where the time goes",
    "",
    f"A `jax.profiler` trace of {args.profile_steps} steps of each precision "
    "(after the timing); each kernel's time is summed by what its instruction "
    "in the compiled step computes (`benchmarks/_hlo.py`): *GEMM* (dots, "
    "cuBLAS/cuBLASLt/cuDNN calls, GEMM fusions), *amax* (a kernel that only "
    "reduces magnitudes by max), *cast* (converts to or from float8, with the "
    "scaling fused into them), *transpose/copy*, *other*; a kernel that does "
    "several counts by the first. *kernels, ms*: the kernels' summed time per "
    "step (the device's busy time where they do not overlap); *matched*: the "
    "share of it matched to an instruction of the step (by the trace's "
    "`hlo_op`, else the kernel's name), and the share known by the kernel's "
    "name alone (cuBLAS and cuDNN GEMMs, memcpy); the rest is *other*.",
    "",
    *split,
    "",
    "The compiled float8 step's passes over memory (`_hlo.Program."
    "float8_passes`) against the recipe's minimum per float8 matmul: an amax "
    "and a cast of each forward operand and of the output gradient, and no "
    "transposed copy (a cast can write the layout a GEMM reads; a Hopper "
    "float8 GEMM reads both operands along their contracted axis, so without "
    "that a matmul needs 3: the weight's forward, the input's and the output "
    "gradient's for the weight gradient). A transpose that writes a float8 "
    "type moves a cast's output into the layout its GEMM reads (XLA's GEMM "
    "rewriter adds one where the operand's layout has the contracted axis "
    "outermost); one that writes a wider type moves an operand before its "
    "cast, or a product:",
    "",
    *passes_lines(sizes, results),
  ]
  if listings:
    md += ["", *listings]
  if backend == "cpu":
    md += [
      "",
      "The backend is CPU: XLA's CPU backend has no float8 GEMM, so float8 is "
      "emulated (converted to float32) and these times say nothing about a GPU. "
      "Its trace holds the thunks XLA:CPU runs, named by their instructions.",
    ]
  md += ["", f"Total wall time: {time.perf_counter() - t_start:.1f} s."]
  return "\n".join(md) + "\n"


def parse_args(argv=None):
  parser = small_parser(__doc__.splitlines()[0], SMALL)
  add = parser.add_argument
  add(
    "--out",
    default=os.path.join(HERE, "out", "float8_profile.md"),
    help="the Markdown report; the traces go to <out without .md>_traces/",
  )
  add("--small", action="store_true", help="tiny sizes (CPU, < 1 min)")
  add(
    "--sizes",
    default=SIZES,
    help="comma-separated d_model:layers:heads:seq:batch, one per size",
  )
  add("--vocab", type=int, default=32768, help="vocabulary size")
  add("--calls", type=int, default=10, help="timed steps per round")
  add("--rounds", type=int, default=2, help="rounds of timing")
  add("--warmup", type=int, default=2, help="warm-up steps per round")
  add("--profile-steps", type=int, default=3, help="steps in each trace")
  add(
    "--loss-steps",
    type=int,
    default=100,
    help="steps of training on text before the loss is taken (0: none)",
  )
  add("--eval-batches", type=int, default=4, help="held-out batches of the loss")
  add(
    "--min-size",
    type=int,
    default=0,
    help="float8: Float8Matmul(min_size=N), bfloat16 below it (0: the default)",
  )
  args = parser.parse_args(argv)
  small_defaults(parser, args, SMALL)
  try:
    args.size_list = parse_sizes(args.sizes)
  except ValueError as e:
    parser.error(str(e))
  for key in ("calls", "rounds", "profile_steps", "eval_batches"):
    if getattr(args, key) < 1:
      parser.error(f"--{key.replace('_', '-')} must be at least 1")
  for key in ("warmup", "loss_steps", "min_size"):
    if getattr(args, key) < 0:
      parser.error(f"--{key.replace('_', '-')} must be at least 0")
  if args.vocab < 256:
    parser.error("--vocab must be at least 256 (the text's bytes are tokens)")
  return args


def main(argv=None):
  args = parse_args(argv)
  PRECISIONS["float8"] = float8_precision(args.min_size)
  # Before JAX starts its backend. The largest size holds its parameters and
  # Adam's state twice while it times (each step's own, donated, and the
  # originals) and about 30 GB of temporaries: more than JAX's default 75%
  # of an 80 GB GPU.
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
  if args.small:
    small_xla_flags()
  from _harness import environment, environment_lines

  out = os.path.abspath(args.out)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  trace_dir = os.path.splitext(out)[0] + "_traces"
  t_start = time.perf_counter()
  env_rows, backend = environment()
  env_lines = environment_lines(env_rows)
  results = {}

  def write():
    text = report(args, argv, env_lines, args.size_list, results, t_start, backend)
    with open(out, "w") as f:
      f.write(text)

  write()
  for size in args.size_list:
    print(f"d_model {size['d_model']}: {shape_text(size)}", flush=True)
    t0 = time.perf_counter()
    try:
      results[size["d_model"]] = measure_size(
        size, args, os.path.join(trace_dir, f"d{size['d_model']}")
      )
    except Exception as e:  # noqa: BLE001
      traceback.print_exc()
      results[size["d_model"]] = {
        "error": error_text(e),
        "traceback": traceback.format_exc(),
      }
    gc.collect()
    print(f"  {time.perf_counter() - t0:.1f} s", flush=True)
    write()
  print(f"wrote {out} ({time.perf_counter() - t_start:.1f} s)")


if __name__ == "__main__":
  main()
