"""The GPU report's transformer: a decoder's train step in six precisions, timed.

A GPT-2-style decoder (float32 parameters, plain JAX) whose loss is wrapped
for each precision (float32; ``ols.autocast`` to bfloat16, float16, float8,
MXFP8 and NVFP4), timed with bare Adam and with ``dynamic_loss_scale(adam)``
by ``_harness.measure_many``; the compiled steps' HLO is searched for
cuBLASLt float8 GEMMs and native block-scaled GEMMs, and
``ols.list_matmuls`` says which matmuls run in each recipe.
"""

from __future__ import annotations

import math
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
import train_step
from _harness import details, error_text, measure_many

import optax_lossscale as ols

#: The custom call XLA's GPU backend emits for a float8 GEMM on cuBLASLt.
F8_GEMM = "__cublas$lt$matmul$f8"
BLOCK_GEMM = "__op$block_scaled_dot"  # jax.nn.scaled_matmul's native GEMM


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
  entries = train_step.loss_entries(loss_fn, params, batch)
  plain, scaled = measure_many(
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
    return ["", f"{name} matmuls: not listed (`{error_text(e)}`)."]
  counts = {}
  for m in found:
    counts[m.precision] = counts.get(m.precision, 0) + 1
  summary = ", ".join(f"{n} in {p}" for p, n in counts.items())
  return [
    "",
    f"{name} matmuls of the forward pass (`ols.list_matmuls`): {summary}, "
    f"of {len(found)}.",
    "",
    *details(f"{name}: each matmul", ols.format_matmuls(found)),
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
      results[name] = {"error": error_text(e), "traceback": traceback.format_exc()}
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
    "update, apply), by `_harness.measure_many`: buffers donated, the two steps "
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
      lines += ["", *details(f"{name}: traceback", r["traceback"])]
  return lines
