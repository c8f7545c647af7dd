"""bfloat16 parameters: round-to-nearest, stochastic rounding, Kahan, against float32.

Trains two models with Adam, the same seeds and batches, in six
configurations, and measures their update steps:

* ``float32``: float32 parameters and moments (the reference);
* ``bf16 nearest``: bfloat16 parameters, each step's sum rounded to the
  nearest bfloat16 (what ``optax.apply_updates`` does), float32 moments;
* ``bf16 stochastic``: bfloat16 parameters, ``ols.stochastic_rounding``;
* ``bf16 Kahan``: bfloat16 parameters, ``ols.kahan_summation``;
* ``bf16 Kahan, bf16 mu``: the same with Adam's first moment in bfloat16
  (``optax.adam(mu_dtype=jnp.bfloat16)``);
* ``bf16 stochastic, bf16 moments``: both moments in bfloat16 (optax's
  default for bfloat16 parameters: its second moment takes the parameters'
  dtype).

Every configuration computes the forward and backward passes in bfloat16
(the float32 parameters are cast), so only the storage of the parameters
and of the optimizer state differs. The models: the main example's
byte-level transformer on Python's standard library (``examples/train_lm.py``)
and the earlier main example's MLP on scikit-learn's digits
(``examples/train_digits.py``). Reported: final validation loss and accuracy
(computed in float32 from the stored parameters) and their gaps to float32,
per seed and averaged; bytes per parameter (parameters + optimizer state);
the update step's time and XLA "bytes accessed" on the update-step workload
(8.4M parameters). Writes ``--out`` (markdown) and a PNG of the loss curves.

Run:  python benchmarks/bf16_params.py [--quick] [--out PATH]   (see --help)
"""

from __future__ import annotations

import argparse
import os
import time

import _workloads as w
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _harness import machine_line, measure_many, tree_bytes
from _tasks import lm_task, mlp_task

import optax_lossscale as ols

HERE = os.path.dirname(os.path.abspath(__file__))

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)

# name: (parameter dtype, rounding, Adam's mu dtype, Adam's nu dtype)
CONFIGS = {
  "float32": (F32, None, F32, F32),
  "bf16 nearest": (BF16, None, F32, F32),
  "bf16 stochastic": (BF16, "stochastic", F32, F32),
  "bf16 Kahan": (BF16, "kahan", F32, F32),
  "bf16 Kahan, bf16 mu": (BF16, "kahan", BF16, F32),
  "bf16 stochastic, bf16 moments": (BF16, "stochastic", BF16, BF16),
  "bf16 remainder": (BF16, "remainder", F32, F32),
  "bf16 float32 copy": (BF16, "float32", F32, F32),
}


def optimizer(name, lr, seed, params):
  """``(tx, state)`` for a configuration; ``params`` in its parameter dtype.

  Adam's second moment takes the dtype of the parameters it is initialised
  with, so it is initialised with the parameters cast to the wanted dtype;
  the rounding transformation with the parameters themselves.
  """
  _, rounding, mu, nu = CONFIGS[name]
  adam = optax.adam(lr, mu_dtype=mu)
  if rounding in ("remainder", "float32"):  # the moments on the float32 masters
    tx = ols.master_weights(adam, store=rounding)
    return tx, tx.init(params)
  adam_state = adam.init(jax.tree.map(lambda p: p.astype(nu), params))
  if rounding is None:
    return adam, adam_state
  last = (
    ols.stochastic_rounding(jax.random.key(1000 + seed))
    if rounding == "stochastic"
    else ols.kahan_summation()
  )
  return optax.chain(adam, last), (adam_state, last.init(params))


def train(name, params, batches, loss_fn, evaluate, lr, seed):
  """Trains one configuration; returns the losses, the final metrics, bytes."""
  params = jax.tree.map(lambda p: p.astype(CONFIGS[name][0]), params)
  tx, state = optimizer(name, lr, seed, params)
  n = sum(p.size for p in jax.tree.leaves(params))
  per_param = (tree_bytes(params) + tree_bytes(state)) / n

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    return params, state, loss, ties(params, state)

  losses, tie_counts = [], []
  for batch in batches:
    params, state, loss, t = step(params, state, batch)
    losses.append(loss)
    tie_counts.append(t)
  # Every dtype kept: the parameters are what is stored (and evaluated).
  assert all(p.dtype == CONFIGS[name][0] for p in jax.tree.leaves(params))
  metrics = evaluate(jax.tree.map(lambda p: p.astype(F32), params))
  return dict(
    losses=np.asarray(jax.device_get(losses), np.float64),
    loss=float(metrics[0]),
    acc=float(metrics[1]),
    bytes_per_param=per_param,
    final=(params, state),
    ties=np.asarray(jax.device_get(tie_counts)),
    n_params=n,
  )


def ties(params, state):
  """``[ties, ties rounded otherwise than to even]`` after a step.

  For ``master_weights(store="remainder")``: masters whose low 16 bits are
  exactly 0x8000 (their remainder is -0x8000: rounded away from zero), and
  of those the ones whose bfloat16 parameter is odd (to nearest even would
  have rounded the other way). Zeros for other states.
  """
  if not isinstance(state, ols.MasterWeightsState):
    return jnp.zeros(2, jnp.int32)
  pairs = [
    (r, p)
    for r, p in zip(jax.tree.leaves(state.master), jax.tree.leaves(params), strict=True)
    if r.dtype == jnp.int16
  ]
  tie = [r == -0x8000 for r, _ in pairs]
  odd = [jax.lax.bitcast_convert_type(p, jnp.uint16) & 1 == 1 for _, p in pairs]
  return jnp.stack(
    [
      sum(jnp.sum(t, dtype=jnp.int32) for t in tie),
      sum(jnp.sum(t & o, dtype=jnp.int32) for t, o in zip(tie, odd, strict=True)),
    ]
  )


def second_moment_in(dtype, nu, grads, b2=0.999):
  """What Adam's second-moment update loses when its state is in ``dtype``.

  From float32 ``nu`` and ``grads`` (a trained float32 run's), one update
  ``b2 * nu + (1 - b2) * g**2`` computed in ``dtype`` against float32.
  Returns the fractions of entries whose increment ``(1 - b2) g**2`` is not
  0 in float32 but underflows to 0 in ``dtype``, whose update leaves ``nu``
  unchanged in ``dtype`` although the float32 one changes it (the increment
  is below half a unit of ``nu``: it stagnates), and the median relative
  error of the updated ``nu``.
  """
  nu = jnp.concatenate([x.ravel() for x in jax.tree.leaves(nu)])
  g = jnp.concatenate([x.ravel() for x in jax.tree.leaves(grads)]).astype(F32)
  inc32 = (1 - b2) * g * g
  new32 = b2 * nu + inc32
  lo_nu, lo_g = nu.astype(dtype), g.astype(dtype)
  inc = jnp.asarray(1 - b2, dtype) * lo_g * lo_g
  new = jnp.asarray(b2, dtype) * lo_nu + inc
  underflow = jnp.mean((inc == 0) & (inc32 != 0))
  stagnant = jnp.mean((new == lo_nu) & (new32 != nu))
  rel = jnp.abs(new.astype(F32) - new32) / jnp.where(new32 > 0, new32, 1)
  return float(underflow), float(stagnant), float(jnp.median(rel))


def compare(task, steps, seeds, lr):
  """``{config: [result per seed]}`` for one task, the second-moment losses,
  and per seed the first training step whose loss differs between the two
  master-weight stores (``None``: none differs)."""
  out = {name: [] for name in CONFIGS}
  moments, stores = {}, []
  for seed in seeds:
    _, params, batches, loss_fn, evaluate = task(steps, seed)
    for name in CONFIGS:
      t = time.perf_counter()
      r = train(name, params, batches, loss_fn, evaluate, lr, seed)
      r["seconds"] = time.perf_counter() - t
      final_params, final_state = r.pop("final")
      if name == "float32" and seed == 0:
        grads = jax.grad(loss_fn)(final_params, *batches[-1])
        nu = final_state[0].nu
        moments = {d: second_moment_in(d, nu, grads) for d in (BF16, jnp.float16)}
      out[name].append(r)
      print(
        f"  seed {seed} {name:<30} loss {r['loss']:.4f} acc {r['acc']:.4f} "
        f"({r['seconds']:.0f} s)",
        flush=True,
      )
    a, b = out["bf16 remainder"][-1], out["bf16 float32 copy"][-1]
    differs = np.flatnonzero(a["losses"] != b["losses"])
    stores.append(
      dict(
        first=int(differs[0]) + 1 if differs.size else None,
        ties=a["ties"][:, 0].mean(),
        other=a["ties"][:, 1].mean(),
        n=a["n_params"],
      )
    )
  return out, moments, stores


def update_costs(calls, rounds, **workload):
  """The update step of each configuration on the update-step workload
  (``workload``: ``_workloads.layers``' sizes, for a smoke run)."""
  params32 = w.layers(**workload)
  grads = w.grads_like(jax.tree.map(lambda p: p.astype(BF16), params32))
  entries = []
  for name in CONFIGS:
    params = jax.tree.map(lambda p, n=name: p.astype(CONFIGS[n][0]), params32)
    tx, state = optimizer(name, 1e-3, 0, params)

    def step(carry, g, tx=tx):
      p, s = carry
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    entries.append((step, (params, state), grads))
  results = measure_many(entries, calls, rounds=rounds)
  return dict(zip(CONFIGS, results, strict=True))


def table(results, ref="float32"):
  """Markdown: per configuration, mean over seeds and each seed's gap."""
  base = results[ref]
  rows = [
    "| parameters | val loss | gap to float32 (per seed) | accuracy | gap, points "
    "(per seed) | bytes/param |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for name, rs in results.items():
    gaps = [r["loss"] - b["loss"] for r, b in zip(rs, base, strict=True)]
    points = [100 * (r["acc"] - b["acc"]) for r, b in zip(rs, base, strict=True)]
    rows.append(
      f"| {name} | {np.mean([r['loss'] for r in rs]):.4f} | "
      f"{np.mean(gaps):+.4f} ({', '.join(f'{g:+.4f}' for g in gaps)}) | "
      f"{100 * np.mean([r['acc'] for r in rs]):.2f}% | "
      f"{np.mean(points):+.2f} ({', '.join(f'{p:+.2f}' for p in points)}) | "
      f"{rs[0]['bytes_per_param']:.1f} |"
    )
  return "\n".join(rows)


def plot(lm, mlp, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(13, 5))
  for ax, (title, results, n) in zip(
    axes,
    (("byte-level transformer (seed 0)", lm, 20), ("digits MLP (seed 0)", mlp, 50)),
    strict=True,
  ):
    n = max(1, min(n, len(next(iter(results.values()))[0]["losses"])))
    for i, (name, rs) in enumerate(results.items()):
      y = np.convolve(rs[0]["losses"], np.ones(n) / n, mode="valid")
      ax.plot(
        np.arange(n, len(rs[0]["losses"]) + 1),
        y,
        color=f"C{i}",
        lw=1.2,
        label=f"{name}: val {rs[0]['loss']:.3f}",
      )
    ax.set_title(title)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"training loss ({n}-step running mean)")
    ax.legend(fontsize=8)
  axes[1].set_yscale("log")
  fig.suptitle("Adam with bfloat16 parameters: rounding to nearest, stochastic, Kahan")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  p.add_argument("--lm-steps", type=int, default=300, help="transformer steps per run")
  p.add_argument("--mlp-steps", type=int, default=2000, help="MLP steps per run")
  p.add_argument("--seeds", type=int, default=2, help="seeds per configuration")
  p.add_argument("--lm-lr", type=float, default=1e-3, help="transformer learning rate")
  p.add_argument("--mlp-lr", type=float, default=3e-4, help="MLP learning rate")
  p.add_argument("--calls", type=int, default=20, help="timed update steps a round")
  p.add_argument(
    "--quick", action="store_true", help="a few steps of everything (a smoke run)"
  )
  p.add_argument(
    "--sections",
    default="train,costs",
    help="comma-separated: train (the two models), costs (the update step)",
  )
  p.add_argument(
    "--out",
    default=os.path.join(HERE, "out", "bf16_params.md"),
    help="markdown report (the PNG is written beside it)",
  )
  args = p.parse_args(argv)
  if args.quick:
    args.lm_steps, args.mlp_steps, args.seeds, args.calls = 5, 20, 1, 2
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  seeds = range(args.seeds)
  sections = args.sections.split(",")
  parts = []
  if "train" in sections:
    print("transformer:", flush=True)
    lm, lm_moments, lm_stores = compare(lm_task, args.lm_steps, seeds, args.lm_lr)
    print("MLP:", flush=True)
    mlp, mlp_moments, mlp_stores = compare(mlp_task, args.mlp_steps, seeds, args.mlp_lr)
    store_rows = [
      "| model | seed | first step whose loss differs | ties per step | of "
      "them rounded otherwise than to even | parameters |",
      "| --- | --- | --- | --- | --- | --- |",
    ] + [
      f"| {model} | {seed} | {d['first'] or 'none'} | {d['ties']:.1f} | "
      f"{d['other']:.1f} | {d['n']:,} |"
      for model, st in (("transformer", lm_stores), ("MLP", mlp_stores))
      for seed, d in enumerate(st)
    ]
    moment_rows = [
      "| model | state dtype | increment underflows | nu stagnates | median "
      "relative error |",
      "| --- | --- | --- | --- | --- |",
    ] + [
      f"| {model} | {jnp.dtype(d).name} | {u:.2%} | {st:.2%} | {e:.2e} |"
      for model, m in (("transformer", lm_moments), ("MLP", mlp_moments))
      for d, (u, st, e) in m.items()
    ]
    png = os.path.splitext(args.out)[0] + ".png"
    plot(lm, mlp, png)
    parts += [
      f"Transformer ({args.lm_steps} steps, learning rate {args.lm_lr}, seeds "
      f"0-{args.seeds - 1}; validation: 64 held-out sequences):",
      table(lm),
      f"MLP ({args.mlp_steps} steps, learning rate {args.mlp_lr}, seeds "
      f"0-{args.seeds - 1}; test set of the digits):",
      table(mlp),
      "Adam's second moment (b2 = 0.999) in a low-precision dtype: one update "
      "from the trained float32 run's state and last gradients (seed 0):",
      "\n".join(moment_rows),
      "The two stores of master_weights, bf16 remainder against bf16 float32 "
      "copy: the same float32 masters, whose parameters differ only where a "
      "master's low 16 bits are a tie, 0x8000 (the remainder rounds it away "
      "from zero, the copy to even); from the first tie rounded otherwise "
      "than to even the runs part. Ties counted after each step of the "
      "remainder run, mean over the steps:",
      "\n".join(store_rows),
      f"Loss curves: {os.path.basename(png)}.",
    ]
  if "costs" in sections:
    small = {"n_layers": 2, "width": 64} if args.quick else {}
    costs = update_costs(args.calls, 1 if args.quick else 3, **small)
    ref, nearest = costs["float32"], costs["bf16 nearest"]
    parts += [
      "Update step (Adam + the rounding, the update-step workload: "
      + ("2 layers of 64 (--quick)" if args.quick else "8.4M parameters in 64 leaves")
      + ", gradients in bfloat16; smallest of the rounds' medians):",
      "\n".join(
        [
          "| parameters | update step (ms) | time vs float32 | bytes accessed (MB) | "
          "bytes vs float32 | bytes vs bf16 nearest |",
          "| --- | --- | --- | --- | --- | --- |",
        ]
        + [
          f"| {name} | {1e3 * c['median_s']:.2f} | "
          f"{c['median_s'] / ref['median_s']:.2f}x | {c['bytes'] / 1e6:.1f} | "
          f"{c['bytes'] / ref['bytes']:.2f}x | {c['bytes'] / nearest['bytes']:.2f}x |"
          for name, c in costs.items()
        ]
      ),
    ]
  parts.append(f"Machine: {machine_line()}.")
  report = "\n\n".join(parts)
  with open(args.out, "w") as f:
    f.write(report + "\n")
  print("\n" + report + f"\n\nwrote {args.out}")


if __name__ == "__main__":
  main()
