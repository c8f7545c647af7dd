"""Train a small byte-level transformer on Python's own sources three ways.

1. ``float32``: everything in float32.
2. ``float16``: float32 parameters, float16 compute, no loss scaling.
3. ``float16 + loss scale``: the same, with ``optax_lossscale.dynamic_loss_scale``.

The text is the Python standard library's own top-level ``.py`` files (found
with ``sysconfig``, read in sorted order): nothing is downloaded. The last
``--val-fraction`` of the bytes is held out for validation. The model is a
decoder-only transformer (pre-LayerNorm, GPT-2 initialisation) over the 256
byte values, trained with ``optax.adam``; the loss is the softmax
cross-entropy, computed in float32 from the logits and averaged over every
token of the batch (``--batch`` x ``--context`` tokens).

Each step is trained as trainers that accumulate gradients train it (the
Hugging Face Trainer, Megatron-LM, nanoGPT, whose default is 40
accumulation steps): the step is ``--accumulation`` K micro-batches, each
micro-batch's loss is divided by K before its backward pass, and the K
gradients are summed. To fit a CPU's minutes, the K micro-batches of a step
are one batch, so the sum is K times the one gradient computed (a float32
multiplication, ``optax.scale(K)``, after any unscaling and before Adam):
the backward pass sees exactly a trainer's micro-batch, and Adam the
step's gradient. ``--accumulation 1`` trains on the plain mean.

Why float16 loses gradients here: the gradient of the micro-batch's loss
with respect to one logit is (p - y) / (N K) for N tokens. With N K in the
tens of thousands and most of the 256 byte probabilities p small, most of
these entries, and the activation gradients computed from them, fall below
float16's smallest positive value (2**-24, about 6e-8) and become 0 (the
mean over a global batch under sharded ``jit`` has the same effect: each
device's logit gradients are (p - y) / N_global). Loss scaling multiplies
the loss by S before differentiating, so they stay representable, and
divides the gradients by S (in float32) before Adam sees them.

The script prints a table (training and validation loss, bits per byte, gap
to float32, skipped steps, final scale, fraction of gradient entries that
underflowed), writes it to ``lm_loss_scale.txt`` and writes a PNG with three
panels: the loss over the steps; the fraction of gradient entries that
underflowed, per layer for the float16 run; and the loss scale, skipped
steps marked. The loss-scaled run keeps a record of where its gradients
were not finite (``track_nonfinite=True``); when it skipped steps, the
script prints ``ols.nonfinite_report``: which layers' gradients overflowed,
and whether the loss itself was finite.

Run:  python examples/train_lm.py [--steps N] [--out DIR]   (see --help)
"""

from __future__ import annotations

import argparse
import collections
import glob
import math
import os
import re
import sys
import sysconfig
import textwrap
import time

import _cli
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import optax_lossscale as ols


def _text_files():
  stdlib = sysconfig.get_paths()["stdlib"]
  return sorted(glob.glob(os.path.join(stdlib, "*.py")))


def _read(path: str) -> bytes:
  with open(path, "rb") as f:
    return f.read()


def _split(size: int, val_fraction: float) -> int:
  return int(size * (1 - val_fraction))


def load_text(val_fraction: float):
  """The standard library's top-level ``.py`` files, as bytes: (train, val, files)."""
  files = _text_files()
  data = b"".join(_read(f) for f in files)
  split = _split(len(data), val_fraction)
  return data[:split], data[split:], len(files)


PIECES = re.compile(rb"\w+|\s+|[^\w\s]")  # words, whitespace runs, symbols


def make_tokenizer(train: bytes, vocab: int):
  """Tokens 0-255 are bytes; 256.. the most frequent multi-byte pieces of ``train``.

  Text is cut into words, runs of whitespace and single symbols; a piece in the
  vocabulary is one token, any other piece is spelled out byte by byte. With
  ``vocab == 256`` the model is byte-level.
  """
  counts = collections.Counter(p for p in PIECES.findall(train) if len(p) > 1)
  words = sorted(counts, key=lambda p: (-counts[p], p))[: vocab - 256]
  ids = {w: 256 + i for i, w in enumerate(words)}

  def encode(data: bytes):
    """(token ids, bytes per token) as int32 arrays."""
    if vocab == 256:
      tokens = np.frombuffer(data, np.uint8).astype(np.int32)
      return tokens, np.ones_like(tokens)
    tokens, sizes = [], []
    for p in PIECES.findall(data):
      i = ids.get(p)
      if i is None:
        tokens.extend(p)
        sizes.extend([1] * len(p))
      else:
        tokens.append(i)
        sizes.append(len(p))
    return np.array(tokens, np.int32), np.array(sizes, np.int32)

  return encode


def sample(train, val, *, steps, batch, context, eval_sequences, seed):
  """Training batches (random windows) and held-out windows (evenly spaced).

  Returns ``(batches, val_idx)``: ``steps`` arrays of ``batch`` windows of
  ``context + 1`` tokens of ``train`` (seeded), and the indices into ``val``
  of ``eval_sequences`` such windows.
  """
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, len(train) - context - 1, (steps, batch))
  batches = [train[s[:, None] + np.arange(context + 1)] for s in starts]
  val_starts = np.linspace(0, len(val) - context - 1, eval_sequences)
  val_idx = val_starts.astype(int)[:, None] + np.arange(context + 1)
  return batches, val_idx


def dense(features, dtype, **kw):
  init = nn.initializers.normal(0.02)  # GPT-2's initialisation
  return nn.Dense(
    features, dtype=dtype, param_dtype=jnp.float32, kernel_init=init, **kw
  )


class Block(nn.Module):
  """Pre-LayerNorm causal self-attention and MLP, computing in ``dtype``."""

  width: int
  heads: int
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    b, t, _ = x.shape
    d = self.width // self.heads
    ln = lambda: nn.LayerNorm(dtype=self.dtype, param_dtype=jnp.float32)
    qkv = dense(3 * self.width, self.dtype, use_bias=False)(ln()(x))
    q, k, v = jnp.split(qkv.reshape(b, t, 3 * self.heads, d), 3, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d).astype(self.dtype)
    causal = jnp.tril(jnp.ones((t, t), bool))
    # The softmax in float32, as mixed-precision recipes keep it.
    scores = jnp.where(causal, scores.astype(jnp.float32), -1e9)
    attn = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, self.width)
    x = x + dense(self.width, self.dtype)(out)
    h = nn.gelu(dense(4 * self.width, self.dtype)(ln()(x)))
    return x + dense(self.width, self.dtype)(h)


class Transformer(nn.Module):
  """A decoder-only byte-level transformer; parameters stay float32."""

  layers: int
  width: int
  heads: int
  context: int
  vocab: int
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, tokens):
    emb = lambda n, name: nn.Embed(
      n,
      self.width,
      dtype=self.dtype,
      param_dtype=jnp.float32,
      embedding_init=nn.initializers.normal(0.02),
      name=name,
    )
    x = emb(self.vocab, "embed")(tokens) + emb(self.context, "pos")(
      jnp.arange(tokens.shape[1])
    )
    for i in range(self.layers):
      x = Block(self.width, self.heads, self.dtype, name=f"block_{i}")(x)
    x = nn.LayerNorm(dtype=self.dtype, param_dtype=jnp.float32, name="ln_out")(x)
    return dense(self.vocab, self.dtype, name="head")(x)


def loss_fn(model, params, tokens):
  """Mean next-byte cross-entropy over every token, in float32."""
  logits = model.apply({"params": params}, tokens[:, :-1]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def loss_and_logit_underflow(model, params, tokens, scale):
  """The loss, and the share of its logit gradients (times ``scale``) lost in float16.

  The gradient of ``loss * scale`` with respect to the float32 logits is
  ``scale * (softmax(logits) - one_hot(target)) / N`` (N tokens); the float16
  backward pass starts from it cast to float16, where entries below 2**-25
  become 0.
  """
  logits = model.apply({"params": params}, tokens[:, :-1]).astype(jnp.float32)
  targets = tokens[:, 1:]
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
  g = jax.nn.softmax(logits) - jax.nn.one_hot(targets, logits.shape[-1])
  g = jax.lax.stop_gradient(g * (scale / targets.size))
  lost = jnp.mean((g.astype(jnp.float16) == 0) & (g != 0))
  return loss, lost


def layer_groups(params):
  """Plot/table names of the parameter groups, from the input to the output."""
  blocks = sorted(
    (k for k in params if k.startswith("block_")), key=lambda k: int(k[6:])
  )
  groups = {"embeddings": ["embed", "pos"]}
  groups.update({f"block {int(k[6:]) + 1}": [k] for k in blocks})
  groups["output layer"] = ["ln_out", "head"]
  return groups


def make_underflow(groups):
  """Per group: the fraction of entries that are 0 where the reference is not."""

  @jax.jit
  def underflow(grads, reference):
    lost, total = [], []
    for keys in groups.values():
      g = jnp.concatenate(
        [jnp.ravel(a) for k in keys for a in jax.tree.leaves(grads[k])]
      )
      r = jnp.concatenate(
        [jnp.ravel(a) for k in keys for a in jax.tree.leaves(reference[k])]
      )
      lost.append(jnp.sum((g == 0) & (r != 0)))
      total.append(jnp.sum(r != 0))
    lost, total = jnp.stack(lost), jnp.stack(total)
    per_group = lost / jnp.maximum(total, 1)
    return jnp.append(per_group, lost.sum() / jnp.maximum(total.sum(), 1))

  return underflow


def make_step(model, tx, scaled, accumulation):
  """One optimizer step: the gradients of one micro-batch of an accumulation.

  A trainer that accumulates K micro-batches divides each micro-batch's loss
  by K before its backward pass and sums the K gradients. Here the K
  micro-batches of a step are one batch, so the sum is K times the one
  gradient computed: ``tx`` multiplies by K (in float32, after any unscaling)
  before Adam. The backward pass sees exactly a trainer's micro-batch.
  """
  k = accumulation

  @jax.jit
  def step(params, opt_state, tokens):
    scale = ols.get_scale(opt_state) if scaled else jnp.float32(1.0)

    def micro(p):  # the micro-batch's loss / K; the loss itself as aux
      loss, logit_lost = loss_and_logit_underflow(model, p, tokens, scale / k)
      return loss / k, (loss, logit_lost)

    if scaled:  # gradients of (loss / K) * scale, the scale this step starts with
      (_, (loss, logit_lost)), grads = ols.value_and_grad(micro, has_aux=True)(
        opt_state, params
      )
      grads_applied = ols.unscale(grads, scale)  # what reaches Adam (/ K), if finite
      # The loss too, so that the non-finite record tells it from the gradients.
      updates, opt_state = tx.update(grads, opt_state, params, value=loss)
      skipped = ols.diagnostics(opt_state)["last_step_skipped"]
    else:
      (_, (loss, logit_lost)), grads = jax.value_and_grad(micro, has_aux=True)(params)
      grads_applied = grads
      updates, opt_state = tx.update(grads, opt_state, params)
      skipped = jnp.array(False)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss, scale, skipped, logit_lost, grads_applied

  return step


def run(name, dtype, tx, cfg, batches, groups, shared, progress):
  model = Transformer(cfg.layers, cfg.width, cfg.heads, cfg.context, cfg.vocab, dtype)
  params = model.init(jax.random.key(cfg.seed), batches[0][:, :-1])["params"]
  opt_state = tx.init(params)
  scaled = name.endswith("loss scale")
  step = make_step(model, tx, scaled, cfg.accumulation)
  hist = {"loss": [], "scale": [], "skipped": [], "logit_lost": []}
  lost_steps, lost = [], []
  val_steps, val = [], []
  for i, tokens in enumerate(batches):
    if i % cfg.eval_every == 0:
      val_steps.append(i)
      val.append(shared["val_loss"](params))
    old_params = params
    params, opt_state, loss, scale, skipped, logit_lost, grads = step(
      params, opt_state, tokens
    )
    if dtype != jnp.float32 and i % cfg.measure_every == 0:
      lost_steps.append(i)
      lost.append(shared["underflow"](grads, shared["ref_grad"](old_params, tokens)))
    for k, v in zip(hist, (loss, scale, skipped, logit_lost), strict=True):
      hist[k].append(v)
    progress.update(1)
  val_steps.append(len(batches))
  val.append(shared["val_loss"](params))
  hist = {k: np.asarray(jax.device_get(v), np.float64) for k, v in hist.items()}
  hist["val_steps"], hist["val"] = np.array(val_steps), np.array(jax.device_get(val))
  hist["lost_steps"] = np.array(lost_steps)
  hist["lost"] = np.array(jax.device_get(lost)).reshape(
    len(lost_steps), len(groups) + 1
  )
  # Underflow is only meaningful on steps whose gradients were applied.
  applied = hist["skipped"][hist["lost_steps"]] == 0 if lost_steps else []
  return dict(
    name=name,
    hist=hist,
    val=float(hist["val"][-1]),
    train=float(np.mean(hist["loss"][-cfg.eval_every :])),
    skipped=int(hist["skipped"].sum()),
    scale=float(ols.get_scale(opt_state)) if scaled else None,
    lost=float(np.mean(hist["lost"][applied, -1])) if lost_steps else None,
    lost_per_layer=np.mean(hist["lost"][applied, :-1], axis=0) if lost_steps else None,
    logit_lost=float(np.mean(hist["logit_lost"][hist["skipped"] == 0]))
    if dtype != jnp.float32
    else None,
    report=ols.nonfinite_report(opt_state) if scaled else None,
  )


def smooth(y, n):
  n = max(1, min(n, len(y)))
  c = np.cumsum(np.insert(y, 0, 0.0))
  out = np.empty_like(y)
  out[n - 1 :] = (c[n:] - c[:-n]) / n
  out[: n - 1] = c[1:n] / np.arange(1, n)
  return out


def plot(results, groups, cfg, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  colors = {"float32": "C0", "float16": "C3", "float16 + loss scale": "C2"}
  fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 11), sharex=True)
  for r in results:
    h, c = r["hist"], colors[r["name"]]
    steps = np.arange(1, len(h["loss"]) + 1)
    ax1.plot(steps, h["loss"], color=c, lw=0.5, alpha=0.25)
    ax1.plot(
      steps, smooth(h["loss"], 20), color=c, lw=1.5, label=f"{r['name']}: training"
    )
    ax1.plot(
      h["val_steps"],
      h["val"],
      "o--",
      color=c,
      ms=4,
      lw=1,
      label=f"{r['name']}: validation ({r['val']:.3f} at the end)",
    )
  ax1.set_ylabel("loss (nats per byte, not divided)")
  lo = min(
    min(r["hist"]["val"].min(), smooth(r["hist"]["loss"], 20).min()) for r in results
  )
  ax1.set_ylim(lo - 0.05, lo + 1.5)
  ax1.set_title("Loss (training: 20-step running mean; validation: held-out bytes)")
  ax1.legend(fontsize=8)

  names = list(groups)
  cmap = plt.get_cmap("Reds")
  for r in results:
    h = r["hist"]
    if not len(h["lost_steps"]):
      continue
    x = h["lost_steps"] + 1
    if r["name"] == "float16":
      for j, g in enumerate(names):
        shade = cmap(0.3 + 0.6 * j / max(1, len(names) - 1))
        ax2.plot(x, 100 * h["lost"][:, j], color=shade, lw=1, label=f"float16, {g}")
    ax2.plot(
      x,
      100 * h["lost"][:, -1],
      color=colors[r["name"]],
      lw=2.5,
      label=f"{r['name']}, all parameters",
    )
    steps = np.arange(1, len(h["logit_lost"]) + 1)
    ax2.plot(
      steps,
      100 * smooth(h["logit_lost"], 20),
      color=colors[r["name"]],
      lw=1.5,
      ls="--",
      label=f"{r['name']}, logit gradients (20-step mean)",
    )
  ax2.set_ylabel("gradient entries lost (%)")
  ax2.set_title(
    "Gradient entries that underflowed to 0 in float16 where float32's are not 0"
  )
  ax2.legend(fontsize=7, ncol=2)

  s = [r for r in results if r["scale"] is not None][0]
  scale = s["hist"]["scale"]
  steps = np.arange(1, len(scale) + 1)
  skipped = np.flatnonzero(s["hist"]["skipped"] > 0)
  ax3.step(steps, scale, where="post", color=colors[s["name"]], label="loss scale")
  ax3.scatter(
    skipped + 1,
    scale[skipped],
    color="black",
    marker="x",
    zorder=3,
    label=f"skipped step: gradients overflowed to inf/NaN ({len(skipped)})",
  )
  ax3.set_yscale("log", base=2)
  ax3.set_ylabel("loss scale")
  ax3.set_xlabel("training step")
  ax3.set_title(
    "Loss scale the step's gradients were computed with (float16 + loss scale)"
  )
  ax3.legend(fontsize=8)
  fig.suptitle(
    f"Byte-level transformer on Python's standard library ({cfg.layers} layers, "
    f"width {cfg.width})\n{cfg.batch}x{cfg.context} tokens per micro-batch, its "
    f"loss / {cfg.accumulation} ({cfg.accumulation}-step gradient accumulation)"
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def parser(description: str, *, steps: int, batch: int) -> argparse.ArgumentParser:
  """The options of the language-model examples: model, text, seed, output."""
  p = argparse.ArgumentParser(
    description=description,
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  count = _cli.int_at_least(1)
  p.add_argument("--steps", type=count, default=steps, help="training steps per run")
  p.add_argument("--layers", type=count, default=2, help="transformer blocks")
  p.add_argument(
    "--width",
    type=count,
    default=128,
    help="model width (embedding size), a multiple of --heads",
  )
  p.add_argument("--heads", type=count, default=4, help="attention heads per block")
  p.add_argument("--context", type=count, default=128, help="bytes per sequence")
  p.add_argument(
    "--batch",
    type=count,
    default=batch,
    help="sequences per batch; the loss is the mean over batch x context tokens",
  )
  p.add_argument(
    "--lr", type=_cli.positive_float, default=1e-3, help="Adam's learning rate"
  )
  p.add_argument(
    "--eval-sequences",
    type=count,
    default=64,
    help="held-out sequences of --context bytes for validation",
  )
  p.add_argument(
    "--val-fraction",
    type=_cli.fraction,
    default=0.1,
    help="fraction of the text (its end) held out for validation",
  )
  p.add_argument(
    "--seed",
    type=_cli.int_at_least(0),
    default=0,
    help="initialisation and batch order (same for all runs)",
  )
  p.add_argument(
    "--out",
    type=_cli.directory,
    default=_cli.default_out(),
    help="directory for the plot (and train_lm.py's results file)",
  )
  return p


def check(p: argparse.ArgumentParser, cfg: argparse.Namespace) -> argparse.Namespace:
  """``cfg``, once the options that depend on each other agree (else exit 2)."""
  _cli.require(
    p,
    cfg.width % cfg.heads == 0,
    f"--width ({cfg.width}) must be a multiple of --heads ({cfg.heads}): each "
    "head gets width / heads features",
  )
  size = sum(os.path.getsize(f) for f in _text_files())
  split = _split(size, cfg.val_fraction)
  for part, n in (("training", split), ("held-out", size - split)):
    _cli.require(
      p,
      cfg.context + 1 < n,
      f"--context ({cfg.context}) must be shorter than the {part} text "
      f"({n:,} bytes with --val-fraction {cfg.val_fraction}): each sequence "
      "is a window of context + 1 bytes",
    )
  return cfg


def parse_args(argv=None):
  p = parser(__doc__.splitlines()[0], steps=150, batch=24)
  p.add_argument(
    "--vocab",
    type=_cli.int_in(256, 1 << 16),
    default=256,
    help="vocabulary size, from 256 to 65536: 256 byte tokens plus the VOCAB-256 "
    "most frequent words and whitespace runs of the training text (256: bytes "
    "only)",
  )
  p.add_argument(
    "--accumulation",
    type=_cli.int_at_least(1),
    default=40,
    help="micro-batches per optimizer step, as a trainer accumulates them: each "
    "micro-batch's loss is divided by this before its backward pass and the "
    "gradients are summed (the step's micro-batches are one batch, so the sum "
    "is this times one micro-batch's gradient); 1: no accumulation",
  )
  p.add_argument(
    "--initial-scale",
    type=_cli.positive_float,
    default=2.0**15,
    help="loss scale at step 1 (a power of two up to 2**24)",
  )
  p.add_argument(
    "--growth-interval",
    type=_cli.int_at_least(1),
    default=100,
    help="steps without overflow after which the loss scale doubles",
  )
  p.add_argument(
    "--measure-every",
    type=_cli.int_at_least(1),
    default=20,
    help="measure the underflow every this many steps (costs a float32 backward pass)",
  )
  p.add_argument(
    "--eval-every",
    type=_cli.int_at_least(1),
    default=50,
    help="validation loss every this many steps",
  )
  cfg = check(p, p.parse_args(argv))
  _cli.require(
    p,
    1.0 <= cfg.initial_scale <= 2.0**24,
    f"--initial-scale ({cfg.initial_scale:g}) must lie in [1, 2**24], the loss "
    "scale's default bounds",
  )
  return cfg


def table(results, groups, cfg, tokens_per_byte):
  """The run's results as lines of text: the table, what it means, per layer."""
  ref = results[0]["val"]
  header = (
    f"{'run':<22}{'train loss':>11}{'val loss':>9}{'bits/byte':>10}{'gap':>8}"
    f"{'skipped':>8}{'scale':>8}{'underflow':>10}{'logit grads':>12}"
  )
  lines = [header, "-" * len(header)]
  for r in results:
    scale = "-" if r["scale"] is None else f"{r['scale']:.0f}"
    lost = "-" if r["lost"] is None else f"{r['lost']:.2%}"
    logit = "-" if r["logit_lost"] is None else f"{r['logit_lost']:.2%}"
    lines.append(
      f"{r['name']:<22}{r['train']:>11.4f}{r['val']:>9.4f}"
      f"{r['val'] * tokens_per_byte / math.log(2):>10.3f}"
      f"{r['val'] - ref:>+8.4f}{r['skipped']:>8d}{scale:>8}{lost:>10}{logit:>12}"
    )
  lines += [
    "",
    *textwrap.wrap(
      f"Each step is one micro-batch of a {cfg.accumulation}-step gradient "
      f"accumulation ({cfg.batch} x {cfg.context} tokens; its loss divided by "
      f"{cfg.accumulation} before the backward pass; the sum of the step's "
      f"{cfg.accumulation} equal micro-batch gradients to Adam). train loss: the "
      f"mean cross-entropy (nats per byte) of the last {cfg.eval_every} steps' "
      "batches, as the loss function returns it (not divided); val loss: the same "
      f"on {cfg.eval_sequences} held-out sequences, computed in float32 after "
      f"{cfg.steps} steps; gap: val loss minus float32's. logit grads: fraction of "
      "the output logits' gradient entries (those of the micro-batch's loss, times "
      "the scale) that are 0 in float16 where they are not in float32; underflow: "
      "fraction of all parameters' gradient entries that are 0 where float32's, "
      "at the same parameters and batch, are not (every "
      f"{cfg.measure_every} steps, steps that were not skipped). scale: the loss "
      "scale after the last step.",
      width=88,
    ),
  ]
  for r in results[1:]:
    per_layer = ", ".join(
      f"{g} {x:.2%}" for g, x in zip(groups, r["lost_per_layer"], strict=True)
    )
    lines.append(f"underflow per layer, {r['name']}: {per_layer}")
  for r in results:
    if r["report"] is not None and r["skipped"]:
      lines += [
        "",
        f"where the gradients were not finite, {r['name']}:",
        str(r["report"]),
      ]
  return lines


def main(argv=None):
  cfg = parse_args(argv)
  os.makedirs(cfg.out, exist_ok=True)
  t0 = time.perf_counter()
  train_text, val_text, n_files = load_text(cfg.val_fraction)
  encode = make_tokenizer(train_text, cfg.vocab)
  train, _ = encode(train_text)
  val, val_sizes = encode(val_text)
  if min(len(train), len(val)) <= cfg.context + 1:  # words make fewer tokens
    raise SystemExit(
      f"train_lm.py: error: --context ({cfg.context}) must be shorter than the "
      f"texts in tokens ({len(train):,} for training, {len(val):,} held out)"
    )
  print(
    f"text: the standard library's {n_files} top-level files: "
    f"{len(train_text):,} bytes "
    f"({len(train):,} tokens) for training, {len(val_text):,} bytes held out"
  )
  batches, val_idx = sample(
    train,
    val,
    steps=cfg.steps,
    batch=cfg.batch,
    context=cfg.context,
    eval_sequences=cfg.eval_sequences,
    seed=cfg.seed,
  )
  val_tokens = val[val_idx]
  # Bits per byte = nats per token * tokens / bytes / ln 2.
  tokens_per_byte = val_idx[:, 1:].size / val_sizes[val_idx[:, 1:]].sum()

  ref_model = Transformer(
    cfg.layers, cfg.width, cfg.heads, cfg.context, cfg.vocab, jnp.float32
  )
  shape_params = ref_model.init(jax.random.key(0), batches[0][:, :-1])["params"]
  groups = layer_groups(shape_params)
  shared = dict(
    # Validation loss of the trained float32 parameters, computed in float32.
    val_loss=jax.jit(lambda p: loss_fn(ref_model, p, val_tokens)),
    # float32's gradient of one micro-batch (loss / K), for the underflow.
    ref_grad=jax.jit(
      jax.grad(lambda p, t: loss_fn(ref_model, p, t) / cfg.accumulation)
    ),
    underflow=make_underflow(groups),
  )

  # The sum of the step's K equal micro-batch gradients (K times one), then Adam.
  adam = lambda: optax.chain(optax.scale(cfg.accumulation), optax.adam(cfg.lr))
  configs = [
    ("float32", jnp.float32, adam()),
    ("float16", jnp.float16, adam()),
    (
      "float16 + loss scale",
      jnp.float16,
      ols.dynamic_loss_scale(
        adam(),
        initial_scale=cfg.initial_scale,
        growth_interval=cfg.growth_interval,
        track_nonfinite=True,  # which layers overflowed: printed at the end
      ),
    ),
  ]
  with tqdm(total=3 * cfg.steps, desc="3 runs", unit="step") as progress:
    results = []
    for name, dtype, tx in configs:
      progress.set_description(f"{name:>20}")
      results.append(run(name, dtype, tx, cfg, batches, groups, shared, progress))

  lines = table(results, groups, cfg, tokens_per_byte)
  print("\n" + "\n".join(lines))
  path = os.path.join(cfg.out, "lm_loss_scale.png")
  plot(results, groups, cfg, path)
  took = f"total time: {time.perf_counter() - t0:.1f} s"
  print(f"plot: {_cli.shown(path)}\n{took}")
  # The run as text (the documentation shows these files).
  command = " ".join(["python examples/train_lm.py", *(argv or sys.argv[1:])])
  with open(os.path.join(cfg.out, "lm_loss_scale.txt"), "w") as f:
    f.write("\n".join([f"$ {command}", *lines, took]) + "\n")
  return results


if __name__ == "__main__":
  main()
