"""A whole train step, loss-scaled or not: forward, backward and update.

The train step (``jax.value_and_grad``, Adam's update, apply; buffers
donated) of a float16 MLP and of a small float16 transformer (Flax models,
float32 parameters), without loss scaling, with a finite check of the
gradients that nothing waits on, and with ``dynamic_loss_scale(adam)``
(``ols.value_and_grad``); a second compiled instance of the unscaled step
is the noise row. Each time by ``_harness.measure_many``; bytes are XLA's
cost analysis of the whole step.

Run:  python benchmarks/train_step.py [--quick] [--calls 30] [--out PATH]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _harness import TIMING, machine_line, measure_dropping_carry, table, write_report
from _workloads import LR

import optax_lossscale as ols

#: train_cases' sizes under --quick.
QUICK_CASES = {"mlp_width": 64, "mlp_batch": 32, "d_model": 32, "seq": 16, "batch": 4}


def train_cases(mlp_width=1024, mlp_batch=256, d_model=256, seq=64, batch=16):
  """The train-step workloads: ``{name: (flax model, inputs, labels)}``.

  The defaults are the report's sizes; the transformer's MLP is 4 x
  ``d_model`` wide.
  """
  import flax.linen as nn

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = x.astype(jnp.float16)
      for _ in range(3):
        x = nn.relu(nn.Dense(mlp_width, dtype=jnp.float16, param_dtype=jnp.float32)(x))
      return nn.Dense(10, dtype=jnp.float16, param_dtype=jnp.float32)(x)

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      kw = {"dtype": jnp.float16, "param_dtype": jnp.float32}
      h = nn.LayerNorm(**kw)(x)
      x = x + nn.SelfAttention(num_heads=4, **kw)(h)
      h = nn.LayerNorm(**kw)(x)
      h = nn.Dense(4 * d_model, **kw)(h)
      return x + nn.Dense(d_model, **kw)(nn.gelu(h))

  class Transformer(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      kw = {"dtype": jnp.float16, "param_dtype": jnp.float32}
      x = nn.Embed(512, d_model, **kw)(tokens)
      for _ in range(2):
        x = Block()(x)
      return nn.Dense(512, **kw)(nn.LayerNorm(**kw)(x))

  rng = np.random.default_rng(0)
  w = mlp_width
  cases = {
    f"MLP 784-{w}-{w}-{w}-10, batch {mlp_batch}": (
      MLP(),
      rng.normal(size=(mlp_batch, 784)).astype(np.float32),
      rng.integers(0, 10, mlp_batch).astype(np.int32),
    ),
    f"transformer 2x(d={d_model}, 4 heads), seq {seq}, batch {batch}": (
      Transformer(),
      rng.integers(0, 512, (batch, seq)).astype(np.int32),
      rng.integers(0, 512, (batch, seq)).astype(np.int32),
    ),
  }
  return cases


def train_entries(model, x, y, check=ols.all_finite):
  """``measure_many`` entries of one model's train step: ``{name: entry}``.

  ``plain``: no loss scaling; ``unused_check``: the same plus ``check`` of
  the gradients, which nothing waits on; ``scaled``:
  ``dynamic_loss_scale(adam)``.
  """
  params = model.init(jax.random.key(0), x)["params"]

  def loss_fn(p, x, y):
    logits = model.apply({"params": p}, x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  return loss_entries(loss_fn, params, (jnp.asarray(x), jnp.asarray(y)), check)


def _adam_and_grads(loss_fn, tx):
  def plain_and_grads(carry, batch):
    p, s = carry[:2]
    _, g = jax.value_and_grad(loss_fn)(p, *batch)
    u, s = tx.update(g, s, p)
    return (optax.apply_updates(p, u), s), g

  return plain_and_grads


def adam_step(loss_fn):
  """The plain step of :func:`loss_entries`: ``step((params, adam state),
  batch) -> (params, adam state)``, ``optax.adam(LR)``."""
  plain_and_grads = _adam_and_grads(loss_fn, optax.adam(LR))
  return lambda carry, batch: plain_and_grads(carry, batch)[0]


def loss_entries(loss_fn, params, batch, check=ols.all_finite):
  """:func:`train_entries` for any ``loss_fn(params, *batch)`` and ``params``."""
  plain_tx = optax.adam(LR)
  scaled_tx = ols.dynamic_loss_scale(optax.adam(LR))
  plain_and_grads = _adam_and_grads(loss_fn, plain_tx)

  def plain(carry, batch):
    return plain_and_grads(carry, batch)[0]

  def plain_and_read(carry, batch):
    (p, s), g = plain_and_grads(carry, batch)
    return p, s, check(g)

  def scaled_step(carry, batch):
    p, s = carry
    _, g = ols.value_and_grad(loss_fn)(s, p, *batch)
    u, s = scaled_tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  carry = (params, plain_tx.init(params))
  read = jax.eval_shape(plain_and_read, carry, batch)[2]
  return {
    "plain": (plain, carry, batch),
    "unused_check": (
      plain_and_read,
      (*carry, jax.tree.map(lambda r: jnp.zeros(r.shape, r.dtype), read)),
      batch,
    ),
    "scaled": (scaled_step, (params, scaled_tx.init(params)), batch),
  }


def train_steps(calls, cases=None, rounds=3):
  """The train-step table of ``cases`` (default :func:`train_cases`)."""
  cases = train_cases() if cases is None else cases
  rows, out = [], {}
  for name, (model, x, y) in cases.items():
    e = train_entries(model, x, y)
    # A second compiled instance of the unscaled step: the row's noise.
    plain_again = train_entries(model, x, y)["plain"]
    b, again, f, o = measure_dropping_carry(
      [e["plain"], plain_again, e["unused_check"], e["scaled"]], calls, rounds=rounds
    )
    out[name] = {"plain": b, "plain_again": again, "unused_check": f, "scaled": o}

    def overhead(r, b=b):
      return f"{100 * (r['median_s'] / b['median_s'] - 1):+.1f}%"

    def cell(r):
      return f"{r['median_s'] * 1e3:.2f} ms, {r['bytes'] / 1e6:.1f} MB"

    rows.append(
      [name, cell(b), cell(f), cell(o), overhead(o), overhead(f)]
      + [f"{again['median_s'] * 1e3:.2f} ms", overhead(again)]
    )
    print(f"  {name} done", flush=True)
  header = ["model", "no loss scaling", "+ an unused finite check"]
  header += ["dynamic_loss_scale", "overhead", "unused check's overhead"]
  header += ["no loss scaling again", "difference"]
  lines = [
    *table(header, rows, "lrrrrrrr"),
    "",
    f"{TIMING} Bytes are XLA's cost analysis of the whole step. \"No loss "
    'scaling again" is a second compiled instance of the unscaled step, timed '
    "with the others: its difference to the first is the noise of that row.",
  ]
  return out, lines


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--calls", type=int, default=30, help="timed calls per round")
  p.add_argument(
    "--quick", action="store_true", help="tiny models, 3 calls, 1 round (a smoke run)"
  )
  p.add_argument("--out", default=None, help="also write the Markdown here")
  args = p.parse_args(argv)
  if args.quick:
    _, lines = train_steps(3, train_cases(**QUICK_CASES), rounds=1)
  else:
    _, lines = train_steps(args.calls)
  md = [f"Machine: {machine_line()}.", "", "### Full train step", "", *lines]
  write_report("\n".join(md), args.out)


if __name__ == "__main__":
  main()
