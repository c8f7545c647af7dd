"""Train the main example's transformer with float8 matmuls, against bfloat16, float32.

Three runs of the byte-level transformer of ``train_lm.py`` (same text,
initialisation and batches):

1. ``float32``: the model as written, ``optax.adam``.
2. ``bfloat16``: ``ols.autocast(loss, compute_dtype=jnp.bfloat16)``.
3. ``--recipe`` (default ``float8``): ``ols.autocast(loss,
   compute_dtype=jnp.bfloat16, matmul=recipe)``, everything else as in run
   2. ``float8``: the weights' matmuls (the projections, the MLP, the
   output layer) in float8 with a scale per tensor; ``mxfp8``: the same
   block-scaled, blocks of 32; ``nvfp4``: 4-bit elements in blocks of 16,
   the output layer kept in bfloat16 too. Every recipe keeps attention's
   einsums (scores and values) in bfloat16 by default.

The model is not modified: autocast rewrites the float32 function. Runs 2
and 3 use ``ols.dynamic_loss_scale(optax.adam(...), track_nonfinite=True)``:
a step whose gradients are not finite is skipped. The script prints a table
(validation loss, next-byte accuracy and their gaps to float32, skipped
steps, time per step), and, for a run that skipped steps, which parameters'
gradients were not finite and whether the loss was; it writes a PNG of the
loss curves. On a CPU, XLA emulates float8
(the operands are converted to float32 before each product): the numbers
are float8's, the time per step is not a GPU's.

Run:  python examples/train_lm_float8.py [--recipe float8|mxfp8|nvfp4] [--steps N]
      [--out DIR]   (see --help)
"""

from __future__ import annotations

import math
import os
import time

import _cli
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm
from train_lm import (
  Transformer,
  check,
  load_text,
  loss_fn,
  make_tokenizer,
  parser,
  sample,
)

import optax_lossscale as ols

RECIPES = ("float8", "mxfp8", "nvfp4")


def runs(recipe):
  """name: autocast's arguments (``None``: the float32 model as written)."""
  return {
    "float32": None,
    "bfloat16": dict(compute_dtype=jnp.bfloat16),
    recipe: dict(compute_dtype=jnp.bfloat16, matmul=recipe),
  }


def accuracy(model, params, tokens):
  """The fraction of next bytes predicted exactly (argmax), in float32."""
  logits = model.apply({"params": params}, tokens[:, :-1])
  return jnp.mean(jnp.argmax(logits, -1) == tokens[:, 1:])


def run(name, cfg, model, batches, val_tokens, progress):
  params = model.init(jax.random.key(cfg.seed), batches[0][:, :-1])["params"]
  loss = lambda p, t: loss_fn(model, p, t)
  kwargs = runs(cfg.recipe)[name]
  if kwargs is None:
    tx, grad_fn = optax.adam(cfg.lr), None
  else:
    tx = ols.dynamic_loss_scale(optax.adam(cfg.lr), track_nonfinite=True)
    grad_fn = ols.value_and_grad(ols.autocast(loss, **kwargs))

  @jax.jit
  def step(params, opt_state, tokens):
    if grad_fn is None:
      value, grads = jax.value_and_grad(loss)(params, tokens)
    else:
      value, grads = grad_fn(opt_state, params, tokens)
    # The loss goes to a loss-scaled update too: its record tells a loss that
    # is itself not finite from gradients that overflowed.
    extra = {} if grad_fn is None else {"value": value}
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    return optax.apply_updates(params, updates), opt_state, value

  # Validation in float32 on the trained float32 parameters, for every run.
  evaluate = jax.jit(lambda p: (loss(p, val_tokens), accuracy(model, p, val_tokens)))
  opt_state = tx.init(params)
  losses, times = [], []
  for tokens in batches:
    start = time.perf_counter()
    params, opt_state, value = step(params, opt_state, tokens)
    value.block_until_ready()
    times.append(time.perf_counter() - start)
    losses.append(value)
    progress.update(1)
  val_loss, val_acc = (float(v) for v in evaluate(params))
  skipped = 0 if kwargs is None else int(ols.diagnostics(opt_state)["skipped_steps"])
  return dict(
    name=name,
    loss=np.asarray(jax.device_get(losses), np.float64),
    val=val_loss,
    acc=val_acc,
    skipped=skipped,
    report=None if kwargs is None else ols.nonfinite_report(opt_state),
    step_ms=1e3 * float(np.median(times[1:])),  # the first step compiles
  )


def plot(results, cfg, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 5))
  n = 20
  for r, c in zip(results, ("C0", "C1", "C2"), strict=True):
    y = np.convolve(r["loss"], np.ones(n) / n, mode="valid")
    ax.plot(
      np.arange(n, len(r["loss"]) + 1),
      y,
      color=c,
      lw=1.5,
      label=(f"{r['name']}: validation loss {r['val']:.3f}, accuracy {r['acc']:.1%}"),
    )
  ax.set_xlabel("training step")
  ax.set_ylabel(f"training loss (nats per byte, {n}-step running mean)")
  ax.set_title(
    f"{cfg.recipe} matmuls vs bfloat16 vs float32: byte-level transformer, "
    f"{cfg.layers} layers, width {cfg.width}"
  )
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def parse_args(argv=None):
  p = parser(__doc__.splitlines()[0], steps=150, batch=32)
  p.add_argument(
    "--recipe",
    choices=RECIPES,
    default="float8",
    help="the third run's matmuls: float8 with a scale per tensor, or "
    "block-scaled MXFP8 or NVFP4",
  )
  return check(p, p.parse_args(argv))


def main(argv=None):
  cfg = parse_args(argv)
  os.makedirs(cfg.out, exist_ok=True)
  t0 = time.perf_counter()
  train_text, val_text, n_files = load_text(cfg.val_fraction)
  encode = make_tokenizer(train_text, 256)
  train, _ = encode(train_text)
  val, _ = encode(val_text)
  print(
    f"text: the standard library's {n_files} top-level files, "
    f"{len(train):,} bytes for training"
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
  model = Transformer(cfg.layers, cfg.width, cfg.heads, cfg.context, 256)

  results = []
  with tqdm(total=3 * cfg.steps, unit="step") as progress:
    for name in runs(cfg.recipe):
      progress.set_description(f"{name:>8}")
      results.append(run(name, cfg, model, batches, val_tokens, progress))

  ref = results[0]
  header = (
    f"{'run':<10}{'val loss':>9}{'bits/byte':>10}{'gap':>8}{'accuracy':>10}"
    f"{'gap (points)':>14}{'skipped':>9}{'ms/step':>9}"
  )
  print("\n" + header + "\n" + "-" * len(header))
  for r in results:
    print(
      f"{r['name']:<10}{r['val']:>9.4f}{r['val'] / math.log(2):>10.3f}"
      f"{r['val'] - ref['val']:>+8.4f}{r['acc']:>10.2%}"
      f"{100 * (r['acc'] - ref['acc']):>+14.2f}{r['skipped']:>9d}{r['step_ms']:>9.1f}"
    )
  print(
    f"\nval loss and accuracy: next-byte cross-entropy (nats) and exact-prediction "
    f"rate on {cfg.eval_sequences} held-out sequences after {cfg.steps} steps, "
    f"computed in float32. ms/step: median train-step time on {jax.devices()[0]}"
    + (
      f" ({cfg.recipe} is emulated on a CPU)."
      if jax.default_backend() == "cpu"
      else "."
    )
  )
  last = results[-1]
  print(
    f"{cfg.recipe} against bfloat16: {last['val'] - results[1]['val']:+.4f} "
    "nats/byte of validation loss."
  )
  for r in results:
    if r["skipped"]:
      print(f"\nwhere the gradients were not finite, {r['name']}:\n{r['report']}")
  path = os.path.join(cfg.out, f"lm_{cfg.recipe}.png")
  plot(results, cfg, path)
  print(f"plot: {_cli.shown(path)}\ntotal time: {time.perf_counter() - t0:.1f} s")
  return results


if __name__ == "__main__":
  main()
