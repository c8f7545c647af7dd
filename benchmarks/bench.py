"""Benchmarks of loss scaling: the update step against its peers, and more.

One run measures, side by side, XLA's cost analysis ("bytes accessed" of the
compiled step), the median wall time over ``--calls`` calls after warm-up
(buffers donated, each call's outputs fed to the next; the steps of a table
called in turn, see :func:`measure_many`) and XLA's temporary memory, for:

* headline: the update step (optimizer update + apply) of
  ``dynamic_loss_scale(optax.adam)`` on 8.4M float32 parameters in 64 leaves,
  against bare ``optax.adam`` fed the same unscaled gradients,
  ``optax.apply_if_finite``, jmp's ``DynamicLossScale`` + ``select_tree``,
  Flax's ``DynamicScale`` and Keras 3's ``LossScaleOptimizer`` (JAX backend);
* dtypes: float16 vs float32 parameters and gradients;
* leaves: 1 to 4096 leaves at a fixed total size (compile and step time);
* train steps: forward + backward + update of an MLP and of a small
  transformer, loss-scaled vs not;
* designs: the skip and the finite check as built vs the designs rejected
  (select after the update, ``lax.cond``, checking unscaled gradients,
  finiteness from a global norm), on finite and non-finite gradients;
* finite: the finite check alone, one reduction per leaf vs ours, by leaves.

Run:  python benchmarks/bench.py [--quick] [--out benchmarks/out]
It prints Markdown tables (also written to OUT/tables.md), writes the raw
numbers to OUT/results.json and the leaves sweep to OUT/leaves.png.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

import optax_lossscale as ols  # noqa: E402
from optax_lossscale import _config, _skip  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import variants  # noqa: E402

SCALE = 2.0**10
LR = 1e-3
TIMING = (
  "The steps of a table are called in turn, in a random order each turn (no "
  "step twice in a row); each time is the smallest of 3 rounds' medians."
)


# --------------------------------------------------------------------------
# Measuring one compiled step.
# --------------------------------------------------------------------------


def bytes_accessed(compiled):
  """XLA's cost analysis "bytes accessed" of a compiled program."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["bytes accessed"])


def measure_many(entries, calls, rounds=3, warmup=3, seed=0, keep_compiled=False):
  """Compiles each ``(step, carry, grads)`` (``carry`` donated) and times them.

  The steps are called in turn, one call each, in a new random order every
  turn (seeded), drawn so that no step runs twice in a row (given two steps
  or more). Each call then finds the caches holding another program's data,
  as an update step does in training (the forward and backward passes run
  between two updates); slow drifts of the machine hit every step alike;
  and each step follows each other step about equally often (a step pays
  for the memory writes its predecessor left behind: in a fixed order, the
  step after the heaviest one would always pay the most). A round is
  ``warmup + calls`` such turns; a step's time is the smallest of its
  ``rounds`` round medians (over the last ``calls`` calls): noise on a
  shared machine only ever adds time. ``carry`` is copied first: donation
  deletes the buffers it is given. ``keep_compiled`` keeps each compiled
  program in the result (key ``compiled``), to inspect its HLO.
  """
  out = []
  for step, carry, grads in entries:
    carry = jax.tree.map(jnp.copy, carry)
    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=0).lower(carry, grads).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    out.append(
      {
        "bytes": bytes_accessed(compiled),
        "compile_s": compile_s,
        "temp_bytes": int(getattr(mem, "temp_size_in_bytes", -1)),
        "round_medians_s": [],
        "compiled": compiled,
        "carry": carry,
        "grads": grads,
      }
    )
  rng = np.random.default_rng(seed)
  last = None
  for _ in range(rounds):
    times = [[] for _ in out]
    for i in range(warmup + calls):
      order = rng.permutation(len(out))
      while len(out) > 1 and order[0] == last:
        order = rng.permutation(len(out))
      last = order[-1]
      for k in order:
        r = out[k]
        t = time.perf_counter()
        r["carry"] = r["compiled"](r["carry"], r["grads"])
        jax.block_until_ready(r["carry"])
        if i >= warmup:
          times[k].append(time.perf_counter() - t)
    for r, ts in zip(out, times, strict=True):
      r["round_medians_s"].append(statistics.median(ts))
  for r in out:
    r["median_s"] = min(r["round_medians_s"])
    del r["grads"]
    if not keep_compiled:
      del r["compiled"]
  return out


def layers(n_layers=16, width=512, dtype=jnp.float32):
  """64 leaves, 8.4M parameters: the weights and biases of a 16-layer MLP."""
  keys = jax.random.split(jax.random.key(0), 2 * n_layers)
  params = {}
  for i in range(n_layers):
    params[f"layer{i:02d}"] = {
      "w1": jax.random.normal(keys[2 * i], (width, width), dtype) / 32,
      "b1": jnp.zeros((width,), dtype),
      "w2": jax.random.normal(keys[2 * i + 1], (width, width), dtype) / 32,
      "b2": jnp.zeros((width,), dtype),
    }
  return params


def grads_like(params, seed=1):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten(
    [
      jax.random.normal(k, x.shape, x.dtype) * 1e-3
      for k, x in zip(keys, leaves, strict=True)
    ]
  )


def scaled(grads):
  return jax.tree.map(lambda g: (g.astype(jnp.float32) * SCALE).astype(g.dtype), grads)


# --------------------------------------------------------------------------
# The update step of each library. Each returns (step, carry, grads).
# --------------------------------------------------------------------------


def bare_adam(params, grads):
  tx = optax.adam(LR)

  def step(carry, g):
    p, s = carry
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return step, (params, tx.init(params)), grads


def bare_adam_and_read(params, grads, check=ols.all_finite):
  """Bare Adam, plus ``check(grads)`` as an extra output nothing depends on.

  Not loss scaling: the floor of any design that reads the gradients once
  more. Its cost over bare Adam is what that one read costs on the machine.
  """
  step, (p, s), g = bare_adam(params, grads)

  def read_too(carry, g):
    p, s = step(carry[:2], g)
    return p, s, check(g)

  return read_too, (p, s, check(g)), g


def ours(params, grads, tx=None):
  tx = tx or ols.dynamic_loss_scale(optax.adam(LR), initial_scale=SCALE)

  def step(carry, g):
    p, s = carry
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return step, (params, tx.init(params)), scaled(grads)


def apply_if_finite(params, grads):
  # apply_if_finite has no scale: unscale by hand with a scale carried along.
  tx = optax.apply_if_finite(optax.adam(LR), max_consecutive_errors=10)

  def step(carry, g):
    p, s, scale = carry
    g = jax.tree.map(lambda x: x / scale.astype(x.dtype), g)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, scale

  return step, (params, tx.init(params), jnp.float32(SCALE)), scaled(grads)


def jmp_select_tree(params, grads):
  import jmp

  tx = optax.adam(LR)

  # jmp's pytree loses its static fields through jit: carry its raw arrays.
  def step(carry, g):
    p, s, loss_scale, counter = carry
    ls = jmp.DynamicLossScale(loss_scale=loss_scale, counter=counter, period=2000)
    g = ls.unscale(g)
    finite = jmp.all_finite(g)
    ls = ls.adjust(finite)
    u, new_s = tx.update(g, s, p)
    new_p = optax.apply_updates(p, u)
    p, s = jmp.select_tree(finite, (new_p, new_s), (p, s))
    return p, s, ls.loss_scale, ls.counter

  carry = (params, tx.init(params), jnp.float32(SCALE), jnp.int32(0))
  return step, carry, scaled(grads)


def flax_dynamic_scale(params, grads):
  from flax.training.dynamic_scale import DynamicScale

  tx = optax.adam(LR)

  # DynamicScale computes the gradients itself: differentiate a function whose
  # gradient is the given (unscaled) gradients, so that it sees `scale * g`.
  @jax.custom_vjp
  def inject(p, g):
    return jnp.zeros([], jnp.float32)

  inject.defvjp(
    lambda p, g: (inject(p, g), g),
    lambda g, ct: (
      jax.tree.map(lambda x: (ct * x).astype(x.dtype), g),
      None,
    ),
  )

  def step(carry, g):
    p, s, scale, fin_steps = carry
    ds = DynamicScale(growth_interval=2000, scale=scale, fin_steps=fin_steps)
    ds, finite, _, g = ds.value_and_grad(inject)(p, g)
    u, new_s = tx.update(g, s, p)
    new_p = optax.apply_updates(p, u)
    keep = functools.partial(jnp.where, finite)
    p, s = jax.tree.map(keep, new_p, p), jax.tree.map(keep, new_s, s)
    return p, s, ds.scale, ds.fin_steps

  carry = (params, tx.init(params), jnp.float32(SCALE), jnp.int32(0))
  return step, carry, grads


def _keras_step(params, grads, loss_scaled):
  import keras

  leaves = jax.tree.leaves(params)
  variables = [keras.Variable(np.asarray(x)) for x in leaves]
  opt = keras.optimizers.Adam(learning_rate=LR)
  if loss_scaled:
    opt = keras.optimizers.LossScaleOptimizer(opt, initial_scale=SCALE)
  opt.build(variables)

  def step(carry, g):
    opt_vars, train_vars = carry
    train_vars, opt_vars = opt.stateless_apply(opt_vars, g, train_vars)
    return opt_vars, train_vars

  carry = ([v.value for v in opt.variables], [v.value for v in variables])
  g = jax.tree.leaves(scaled(grads) if loss_scaled else grads)
  return step, carry, g


def keras_loss_scale(params, grads):
  return _keras_step(params, grads, True)


def keras_adam(params, grads):
  return _keras_step(params, grads, False)


UPDATE_STEPS = {
  "optax.adam (no loss scaling)": bare_adam,
  "optax.adam again: a second compiled instance (the noise)": bare_adam,
  "optax.adam + an unused finite check (nothing waits on it)": bare_adam_and_read,
  "**optax_lossscale.dynamic_loss_scale(adam)**": ours,
  "optax.apply_if_finite(adam)": apply_if_finite,
  "jmp.DynamicLossScale + select_tree": jmp_select_tree,
  "flax DynamicScale + jnp.where": flax_dynamic_scale,
  "Keras 3 LossScaleOptimizer(Adam)": keras_loss_scale,
  "Keras 3 Adam (no loss scaling)": keras_adam,
}


# --------------------------------------------------------------------------
# Sections.
# --------------------------------------------------------------------------


def ratio(a, b):
  return a / b


def headline(calls, n_layers=16, width=512, steps=None, rounds=3):
  """The update-step table; ``steps`` (default ``UPDATE_STEPS``) names the rows.

  The first step is the baseline of the ratios.
  """
  steps = UPDATE_STEPS if steps is None else steps
  params = layers(n_layers, width)
  grads = grads_like(params)
  n = sum(x.size for x in jax.tree.leaves(params))
  measured = measure_many(
    [make(params, grads) for make in steps.values()], calls, rounds=rounds
  )
  rows = []
  for name, r in zip(steps, measured, strict=True):
    r.pop("carry")
    rows.append((name, r))
    print(f"  {name}: {r['median_s'] * 1e3:.2f} ms", flush=True)
  base = rows[0][1]
  lines = [
    f"Update step (update + apply, buffers donated), {n / 1e6:.1f}M float32 "
    f"parameters in {len(jax.tree.leaves(params))} leaves; ratios to bare "
    f"optax.adam fed the same unscaled gradients. {TIMING}",
    "",
    "| update step | bytes accessed | ratio | median time | ratio | XLA temp memory |",
    "| --- | ---: | ---: | ---: | ---: | ---: |",
  ]
  for name, r in rows:
    lines.append(
      f"| {name} | {r['bytes'] / 1e6:.1f} MB | {ratio(r['bytes'], base['bytes']):.3f} "
      f"| {r['median_s'] * 1e3:.2f} ms | {ratio(r['median_s'], base['median_s']):.3f} "
      f"| {r['temp_bytes'] / 1e6:.2f} MB |"
    )
  k = dict(rows).get("Keras 3 LossScaleOptimizer(Adam)")
  keras_base = dict(rows).get("Keras 3 Adam (no loss scaling)")
  if k and keras_base:
    lines += [
      "",
      f"Keras' loss scaling over Keras' own Adam: bytes "
      f"{ratio(k['bytes'], keras_base['bytes']):.3f}, time "
      f"{ratio(k['median_s'], keras_base['median_s']):.3f}.",
    ]
  return dict(rows), lines


def dtypes(calls):
  lines = [
    "| parameters and gradients | bare adam | dynamic_loss_scale(adam) "
    "| bytes ratio | time ratio |",
    "| --- | ---: | ---: | ---: | ---: |",
  ]
  out = {}
  for dtype in (jnp.float32, jnp.float16):
    params = layers(dtype=dtype)
    grads = grads_like(params)
    b, o = measure_many(
      [bare_adam(params, grads), ours(params, grads)], calls, rounds=3
    )
    name = jnp.dtype(dtype).name
    out[name] = {"bare": b, "ours": o}
    lines.append(
      f"| {name} | {b['median_s'] * 1e3:.2f} ms, {b['bytes'] / 1e6:.1f} MB "
      f"| {o['median_s'] * 1e3:.2f} ms, {o['bytes'] / 1e6:.1f} MB "
      f"| {o['bytes'] / b['bytes']:.3f} | {o['median_s'] / b['median_s']:.3f} |"
    )
    print(f"  {name} done", flush=True)
  for v in out.values():
    for r in v.values():
      r.pop("carry")
  return out, lines


def leaves_sweep(calls, counts, total=2**23):
  results = []
  lines = [
    f"{total / 2**20:.0f}M float32 parameters split into equal leaves. "
    '"adam again" is a second compiled instance of bare Adam, timed with the '
    f"others: its ratio to the first is the noise of that row. {TIMING}",
    "",
    "| leaves | compile: adam | compile: ours | step: adam | step: ours | step ratio "
    "| step: adam again | ratio |",
    "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for count in counts:
    n = total // count
    keys = jax.random.split(jax.random.key(0), count)
    params = [jax.random.normal(k, (n,)) for k in keys]
    grads = [p * 1e-3 for p in params]
    b, o, b2 = measure_many(
      [bare_adam(params, grads), ours(params, grads), bare_adam(params, grads)],
      calls,
      rounds=3,
    )
    for r in (b, o, b2):
      r.pop("carry")
    results.append({"leaves": count, "bare": b, "ours": o, "bare_again": b2})
    lines.append(
      f"| {count} | {b['compile_s']:.2f} s | {o['compile_s']:.2f} s "
      f"| {b['median_s'] * 1e3:.2f} ms | {o['median_s'] * 1e3:.2f} ms "
      f"| {o['median_s'] / b['median_s']:.3f} | {b2['median_s'] * 1e3:.2f} ms "
      f"| {b2['median_s'] / b['median_s']:.3f} |"
    )
    print(f"  {count} leaves done", flush=True)
  return results, lines


def distinct_shapes(counts):
  """Compile time of the update step on leaves of distinct sizes (1 .. n)."""
  optimizers = {
    "adam": lambda: optax.adam(LR),
    "ours": lambda: ols.dynamic_loss_scale(optax.adam(LR)),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(LR), 10),
  }
  results, lines = (
    [],
    [
      "Compile time (lower + compile, one run each) of the update step with "
      "buffers donated, on n float32 leaves of sizes 1, 2, ..., n.",
      "",
      "| distinct sizes | adam | ours | ratio | `apply_if_finite(adam)` | ratio |",
      "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ],
  )
  for n in counts:
    params = {f"p{i:04d}": jnp.ones((i + 1,)) for i in range(n)}
    row = {"leaves": n}
    for name, make in optimizers.items():
      tx = make()

      def step(p, s, g, tx=tx):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

      t = time.perf_counter()
      jax.jit(step, donate_argnums=(0, 1)).lower(
        params, tx.init(params), params
      ).compile()
      row[name] = time.perf_counter() - t
      print(f"  {n} distinct sizes, {name}: {row[name]:.1f} s", flush=True)
    results.append(row)
    lines.append(
      f"| {n} | {row['adam']:.1f} s | {row['ours']:.1f} s | "
      f"{row['ours'] / row['adam']:.2f} | {row['apply_if_finite']:.1f} s | "
      f"{row['apply_if_finite'] / row['adam']:.2f} |"
    )
  return results, lines


def plot_sweep(results, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  x = [r["leaves"] for r in results]
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
  for key, label in (("bare", "optax.adam"), ("ours", "dynamic_loss_scale(adam)")):
    a1.plot(x, [r[key]["compile_s"] for r in results], "o-", label=label)
    a2.plot(x, [r[key]["median_s"] * 1e3 for r in results], "o-", label=label)
  for a, title in ((a1, "compile time (s)"), (a2, "step time (ms)")):
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("leaves (same total size)")
    a.set_title(title)
    a.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


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


def loss_entries(loss_fn, params, batch, check=ols.all_finite):
  """:func:`train_entries` for any ``loss_fn(params, *batch)`` and ``params``."""
  plain_tx = optax.adam(LR)
  scaled_tx = ols.dynamic_loss_scale(optax.adam(LR))

  def plain_and_grads(carry, batch):
    p, s = carry[:2]
    _, g = jax.value_and_grad(loss_fn)(p, *batch)
    u, s = plain_tx.update(g, s, p)
    return (optax.apply_updates(p, u), s), g

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
  lines = [
    "| model | no loss scaling | + an unused finite check "
    "| dynamic_loss_scale | overhead | unused check's overhead "
    "| no loss scaling again | difference |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  out = {}
  for name, (model, x, y) in cases.items():
    e = train_entries(model, x, y)
    # A second compiled instance of the unscaled step: the row's noise.
    plain_again = train_entries(model, x, y)["plain"]
    b, again, f, o = measure_many(
      [e["plain"], plain_again, e["unused_check"], e["scaled"]], calls, rounds=rounds
    )
    for r in (b, again, f, o):
      r.pop("carry")
    out[name] = {"plain": b, "plain_again": again, "unused_check": f, "scaled": o}

    def overhead(r, b=b):
      return f"{100 * (r['median_s'] / b['median_s'] - 1):+.1f}%"

    lines.append(
      f"| {name} | {b['median_s'] * 1e3:.2f} ms, {b['bytes'] / 1e6:.1f} MB "
      f"| {f['median_s'] * 1e3:.2f} ms, {f['bytes'] / 1e6:.1f} MB "
      f"| {o['median_s'] * 1e3:.2f} ms, {o['bytes'] / 1e6:.1f} MB "
      f"| {overhead(o)} | {overhead(f)} "
      f"| {again['median_s'] * 1e3:.2f} ms | {overhead(again)} |"
    )
    print(f"  {name} done", flush=True)
  lines += [
    "",
    f"{TIMING} Bytes are XLA's cost analysis of the whole step. \"No loss "
    'scaling again" is a second compiled instance of the unscaled step, timed '
    "with the others: its difference to the first is the noise of that row.",
  ]
  return out, lines


# --------------------------------------------------------------------------
# Loss scales with another finite check or skip than ours (rejected designs).
# --------------------------------------------------------------------------


def _variant(inner, check, skip, **kwargs):
  """``dynamic_loss_scale(inner)`` with ``check`` and ``skip`` swapped in."""
  return variants.variant(
    inner, _config.dynamic_config(**kwargs), check=check, skip=skip
  )


def _norm_check(scaled_grads, loss_scale, config):
  """Finiteness read off the global norm of the unscaled gradients."""
  del config
  grads = ols.unscale(scaled_grads, loss_scale)
  return grads, jnp.isfinite(optax.tree.norm(grads))


def _cond_skip(inner, ok, grads, inner_state, params, extra_args):
  shapes = jax.eval_shape(inner.update, grads, inner_state, params, **extra_args)[0]

  def apply(grads, inner_state, params):
    return inner.update(grads, inner_state, params, **extra_args)

  def skip(grads, inner_state, params):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), inner_state

  return lax.cond(ok, apply, skip, grads, inner_state, params)


def select_after_loss_scale(inner, **kwargs):
  """The skip as ``select(ok, new_state, old_state)`` after the update."""
  return _variant(inner, variants.unscale_and_check, _skip.select_after, **kwargs)


def cond_dynamic_loss_scale(inner, **kwargs):
  """The skip as a ``lax.cond`` around the inner update."""
  return _variant(inner, variants.unscale_and_check, _cond_skip, **kwargs)


def norm_check_loss_scale(inner, **kwargs):
  """Finiteness from the global norm, our skip."""
  return _variant(inner, _norm_check, _skip.apply_or_skip, **kwargs)


def designs(calls):
  """The skip and the finite check, as built and as rejected, vs bare adam."""
  params = layers()
  grads = grads_like(params)
  bad = dict(grads)
  bad["layer00"] = {**grads["layer00"], "b1": grads["layer00"]["b1"].at[0].set(jnp.nan)}
  adam = lambda: optax.adam(LR)  # noqa: E731
  candidates = [
    ("**ours**: select each new state leaf where it is made", lambda: None),
    (
      "check the unscaled gradients (what `min_scale < 1` needs)",
      lambda: ols.dynamic_loss_scale(adam(), initial_scale=SCALE, min_scale=0.5),
    ),
    (
      "`select(ok, new_state, old_state)` after the update",
      lambda: select_after_loss_scale(adam(), initial_scale=SCALE),
    ),
    (
      "`lax.cond` around the inner update",
      lambda: cond_dynamic_loss_scale(adam(), initial_scale=SCALE),
    ),
  ]
  cases = []
  for label, tx_fn in candidates:
    kinds = (("finite", grads), ("non-finite", bad))
    if "unscaled" in label:
      kinds = kinds[:1]
    cases += [(label, kind, ours(params, g, tx=tx_fn())) for kind, g in kinds]
  base, *measured = measure_many(
    [bare_adam(params, grads), *(entry for *_, entry in cases)], calls
  )
  base.pop("carry")
  lines = [
    f"Same workload as the update step; bare optax.adam: {base['bytes'] / 1e6:.1f} "
    f"MB, {base['median_s'] * 1e3:.2f} ms. {TIMING}",
    "",
    "| design | gradients | bytes ratio | time ratio | XLA temp memory |",
    "| --- | --- | ---: | ---: | ---: |",
  ]
  out = {"bare": base}
  for (label, kind, _), r in zip(cases, measured, strict=True):
    r.pop("carry")
    out[f"{label}, {kind}"] = r
    lines.append(
      f"| {label} | {kind} | {r['bytes'] / base['bytes']:.3f} "
      f"| {r['median_s'] / base['median_s']:.3f} | {r['temp_bytes'] / 1e6:.2f} MB |"
    )
  print("  skip designs done", flush=True)

  # Finiteness from the global norm that clip_by_global_norm computes anyway.
  chain = lambda: optax.chain(optax.clip_by_global_norm(1.0), adam())  # noqa: E731
  rows = [
    ("**ours**", ols.dynamic_loss_scale(chain(), initial_scale=SCALE)),
    (
      "finite = isfinite(global norm)",
      norm_check_loss_scale(chain(), initial_scale=SCALE),
    ),
  ]
  b, *measured = measure_many(
    [_plain(chain(), params, grads), *(ours(params, grads, tx=tx) for _, tx in rows)],
    calls,
  )
  b.pop("carry")
  lines += [
    "",
    "Inside `optax.chain(optax.clip_by_global_norm(1.0), optax.adam)`, which "
    f"computes the global norm anyway (bare: {b['bytes'] / 1e6:.1f} MB, "
    f"{b['median_s'] * 1e3:.2f} ms):",
    "",
    "| finite check | bytes ratio | time ratio |",
    "| --- | ---: | ---: |",
  ]
  for (label, _), r in zip(rows, measured, strict=True):
    r.pop("carry")
    out[f"chain: {label}"] = r
    lines.append(
      f"| {label} | {r['bytes'] / b['bytes']:.3f} "
      f"| {r['median_s'] / b['median_s']:.3f} |"
    )
  return out, lines


def _plain(tx, params, grads):
  def step(carry, g):
    p, s = carry
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return step, (params, tx.init(params)), grads


def per_leaf_check(tree):
  """The finite check as one reduction per leaf (what we do not do)."""
  return jnp.isfinite(sum(jnp.sum(x - x) for x in jax.tree.leaves(tree)))


def finite_checks(calls, counts, total=2**23):
  """``all_finite`` alone: one reduction per leaf vs ours, by number of leaves."""

  lines = [
    f"The finite check alone on {total / 2**20:.0f}M float32 entries in equal "
    f"leaves; each time is the median of {calls} calls (one round).",
    "",
    "| leaves | per-leaf reductions: compile | step | ours: compile | step |",
    "| ---: | ---: | ---: | ---: | ---: |",
  ]
  out = []
  for count in counts:
    tree = [jnp.full((total // count,), 1.0) for _ in range(count)]
    row = {"leaves": count}
    for key, fn in (("per_leaf", per_leaf_check), ("ours", ols.all_finite)):
      t0 = time.perf_counter()
      compiled = jax.jit(fn).lower(tree).compile()
      row[key + "_compile_s"] = time.perf_counter() - t0
      jax.block_until_ready(compiled(tree))
      times = []
      for _ in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(compiled(tree))
        times.append(time.perf_counter() - t)
      row[key + "_s"] = statistics.median(times)
    out.append(row)
    lines.append(
      f"| {count} | {row['per_leaf_compile_s']:.2f} s "
      f"| {row['per_leaf_s'] * 1e3:.2f} ms "
      f"| {row['ours_compile_s']:.2f} s | {row['ours_s'] * 1e3:.2f} ms |"
    )
    print(f"  {count} leaves done", flush=True)
  return out, lines


def machine():
  cpu = "unknown CPU"
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  dev = jax.devices()[0]
  versions = {}
  for mod in ("jax", "jaxlib", "optax", "flax", "keras", "jmp"):
    try:
      versions[mod] = __import__(mod).__version__
    except Exception:  # noqa: BLE001
      try:
        from importlib.metadata import version

        versions[mod] = version(mod)
      except Exception:  # noqa: BLE001
        versions[mod] = "?"
  try:
    rev = subprocess.run(
      ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
  except OSError:
    rev = "?"
  return {
    "device": f"{dev.platform}: {getattr(dev, 'device_kind', '?')}",
    "cpu": f"{cpu}, {os.cpu_count()} cores",
    "python": platform.python_version(),
    "versions": versions,
    "commit": rev,
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=30)
  parser.add_argument("--quick", action="store_true", help="fewer leaves in the sweep")
  parser.add_argument(
    "--sections",
    default="headline,dtypes,leaves,distinct,train,designs,finite",
    help="comma-separated",
  )
  parser.add_argument(
    "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
  )
  args = parser.parse_args(argv)
  if args.calls < 30:
    print(f"note: --calls {args.calls} is below the 30 the report uses")
  os.makedirs(args.out, exist_ok=True)
  sections = args.sections.split(",")
  info = machine()
  md = [
    f"Machine: {info['device']} ({info['cpu']}); Python {info['python']}; "
    + ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    + f"; commit {info['commit']}; each time: the steps of a table called in "
    "turn, one call each, in a random order each turn; the smallest of 3 "
    f"rounds' medians of {args.calls} calls per step, after 3 warm-up calls "
    "per step and round.",
    "",
  ]
  results = {"machine": info}
  more = [] if args.quick else [4096]

  def leaves():
    sweep, lines = leaves_sweep(args.calls, [1, 4, 16, 64, 256, 1024, *more])
    plot_sweep(sweep, os.path.join(args.out, "leaves.png"))
    return sweep, lines

  titled_sections = {
    "headline": ("Update step", lambda: headline(args.calls)),
    "dtypes": ("float16 vs float32", lambda: dtypes(args.calls)),
    "leaves": ("Number of leaves", leaves),
    "distinct": (
      "Leaves of distinct sizes",
      lambda: distinct_shapes([10, 100] if args.quick else [10, 100, 500]),
    ),
    "train": ("Full train step", lambda: train_steps(args.calls)),
    "designs": ("Designs tried", lambda: designs(args.calls)),
    "finite": (
      "The finite check alone",
      lambda: finite_checks(args.calls, [64, 1024, *more]),
    ),
  }
  for key, (title, run) in titled_sections.items():
    if key in sections:
      print(key, flush=True)
      results[key], lines = run()
      md += [f"### {title}", "", *lines, ""]
  text = "\n".join(md)
  print("\n" + text)
  with open(os.path.join(args.out, "tables.md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
  main()
