"""The update step of dynamic_loss_scale(adam) against its peers, and by dtype.

* headline: the update step (optimizer update + apply) of
  ``dynamic_loss_scale(optax.adam)`` on 8.4M float32 parameters in 64 leaves,
  against bare ``optax.adam`` fed the same unscaled gradients (twice: the
  second compiled instance is the noise row), bare Adam plus a finite check
  nothing waits on, ``optax.apply_if_finite``, jmp's ``DynamicLossScale`` +
  ``select_tree``, Flax's ``DynamicScale`` and Keras 3's
  ``LossScaleOptimizer`` (JAX backend); a peer whose package is missing is
  left out, saying so;
* dtypes: float16 vs float32 parameters and gradients.

Each row: XLA's cost analysis ("bytes accessed"), the time (see
``_harness.measure_many``) and XLA's temporary memory.

Run:  python benchmarks/update_step.py [--quick] [--sections headline,dtypes]
"""

from __future__ import annotations

import argparse
import functools
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _harness import (  # noqa: E402
  TIMING,
  installed,
  machine_line,
  measure_dropping_carry,
  ratio,
  table,
  write_report,
)
from _workloads import (  # noqa: E402
  LR,
  SCALE,
  bare_adam,
  bare_adam_and_read,
  grads_like,
  layers,
  ours,
  scaled,
)


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
#: Update steps that need a package beyond optax_lossscale's own.
PEER_PACKAGES = {
  jmp_select_tree: "jmp",
  flax_dynamic_scale: "flax",
  keras_loss_scale: "keras",
  keras_adam: "keras",
}


def available_steps():
  """``(UPDATE_STEPS whose packages are installed, the missing packages)``."""
  steps = {
    name: make
    for name, make in UPDATE_STEPS.items()
    if installed(PEER_PACKAGES.get(make, "optax"))
  }
  missing = sorted({p for p in PEER_PACKAGES.values() if not installed(p)})
  return steps, missing


def headline(calls, n_layers=16, width=512, steps=None, rounds=3):
  """The update-step table; ``steps`` (default ``UPDATE_STEPS``) names the rows.

  The first step is the baseline of the ratios. Returns ``(results, lines)``.
  """
  steps = UPDATE_STEPS if steps is None else steps
  params = layers(n_layers, width)
  grads = grads_like(params)
  n = sum(x.size for x in jax.tree.leaves(params))
  measured = measure_dropping_carry(
    [make(params, grads) for make in steps.values()], calls, rounds=rounds
  )
  rows = dict(zip(steps, measured, strict=True))
  for name, r in rows.items():
    print(f"  {name}: {r['median_s'] * 1e3:.2f} ms", flush=True)
  base = measured[0]
  lines = [
    f"Update step (update + apply, buffers donated), {n / 1e6:.1f}M float32 "
    f"parameters in {len(jax.tree.leaves(params))} leaves; ratios to bare "
    f"optax.adam fed the same unscaled gradients. {TIMING}",
    "",
    *table(
      ["update step", "bytes accessed", "ratio", "median time", "ratio"]
      + ["XLA temp memory"],
      [
        [
          name,
          f"{r['bytes'] / 1e6:.1f} MB",
          f"{ratio(r['bytes'], base['bytes']):.3f}",
          f"{r['median_s'] * 1e3:.2f} ms",
          f"{ratio(r['median_s'], base['median_s']):.3f}",
          f"{r['temp_bytes'] / 1e6:.2f} MB",
        ]
        for name, r in rows.items()
      ],
      "lrrrrr",
    ),
  ]
  k = rows.get("Keras 3 LossScaleOptimizer(Adam)")
  keras_base = rows.get("Keras 3 Adam (no loss scaling)")
  if k and keras_base:
    lines += [
      "",
      f"Keras' loss scaling over Keras' own Adam: bytes "
      f"{ratio(k['bytes'], keras_base['bytes']):.3f}, time "
      f"{ratio(k['median_s'], keras_base['median_s']):.3f}.",
    ]
  return rows, lines


def dtypes(calls, n_layers=16, width=512, rounds=3):
  """Bare Adam and ours on float32 and on float16 parameters and gradients."""
  rows, out = [], {}
  for dtype in (jnp.float32, jnp.float16):
    params = layers(n_layers, width, dtype=dtype)
    grads = grads_like(params)
    b, o = measure_dropping_carry(
      [bare_adam(params, grads), ours(params, grads)], calls, rounds=rounds
    )
    name = jnp.dtype(dtype).name
    out[name] = {"bare": b, "ours": o}
    rows.append(
      [
        name,
        f"{b['median_s'] * 1e3:.2f} ms, {b['bytes'] / 1e6:.1f} MB",
        f"{o['median_s'] * 1e3:.2f} ms, {o['bytes'] / 1e6:.1f} MB",
        f"{o['bytes'] / b['bytes']:.3f}",
        f"{o['median_s'] / b['median_s']:.3f}",
      ]
    )
    print(f"  {name} done", flush=True)
  header = ["parameters and gradients", "bare adam", "dynamic_loss_scale(adam)"]
  return out, table([*header, "bytes ratio", "time ratio"], rows, "lrrrr")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--calls", type=int, default=30, help="timed calls per round")
  p.add_argument(
    "--quick",
    action="store_true",
    help="2 small layers, 3 calls, 1 round (smoke run)",
  )
  p.add_argument("--sections", default="headline,dtypes", help="comma-separated")
  p.add_argument("--out", default=None, help="also write the Markdown here")
  args = p.parse_args(argv)
  size = dict(n_layers=2, width=64, rounds=1) if args.quick else {}
  calls = 3 if args.quick else args.calls
  steps, missing = available_steps()
  md = [f"Machine: {machine_line()}.", ""]
  if "headline" in args.sections.split(","):
    _, lines = headline(calls, steps=steps, **size)
    md += ["### Update step", "", *lines, ""]
    if missing:
      md += [f"Left out (package not installed): {', '.join(missing)}.", ""]
  if "dtypes" in args.sections.split(","):
    _, lines = dtypes(calls, **size)
    md += ["### float16 vs float32", "", *lines, ""]
  write_report("\n".join(md), args.out)


if __name__ == "__main__":
  main()
