"""The skip and the finite check as built, against the designs rejected.

On the update step's workload (8.4M float32 parameters in 64 leaves), on
finite and non-finite gradients: the skip selecting each new state leaf
where it is made (ours), checking the unscaled gradients (what
``min_scale < 1`` needs), ``select(ok, new_state, old_state)`` after the
update, and a ``lax.cond`` around the inner update; then, inside
``chain(clip_by_global_norm, adam)``, finiteness read off the global norm
against our check. Ratios to bare ``optax.adam``.

Run:  python benchmarks/designs.py [--quick] [--calls 30] [--out PATH]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax
import variants
from _harness import TIMING, machine_line, measure_dropping_carry, table, write_report
from _workloads import LR, SCALE, bare_adam, grads_like, layers, ours, plain
from jax import lax

import optax_lossscale as ols
from optax_lossscale._loss_scale import config as _config
from optax_lossscale._loss_scale import skip as _skip


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


def designs(calls, n_layers=16, width=512, rounds=3):
  """The skip and the finite check, as built and as rejected, vs bare adam."""
  params = layers(n_layers, width)
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
  base, *measured = measure_dropping_carry(
    [bare_adam(params, grads), *(entry for *_, entry in cases)], calls, rounds=rounds
  )
  out, rows = {"bare": base}, []
  for (label, kind, _), r in zip(cases, measured, strict=True):
    out[f"{label}, {kind}"] = r
    rows.append(
      [
        label,
        kind,
        f"{r['bytes'] / base['bytes']:.3f}",
        f"{r['median_s'] / base['median_s']:.3f}",
        f"{r['temp_bytes'] / 1e6:.2f} MB",
      ]
    )
  lines = [
    f"Same workload as the update step; bare optax.adam: {base['bytes'] / 1e6:.1f} "
    f"MB, {base['median_s'] * 1e3:.2f} ms. {TIMING}",
    "",
    *table(
      ["design", "gradients", "bytes ratio", "time ratio", "XLA temp memory"],
      rows,
      "llrrr",
    ),
  ]
  print("  skip designs done", flush=True)

  # Finiteness from the global norm that clip_by_global_norm computes anyway.
  chain = lambda: optax.chain(optax.clip_by_global_norm(1.0), adam())  # noqa: E731
  checks = [
    ("**ours**", ols.dynamic_loss_scale(chain(), initial_scale=SCALE)),
    (
      "finite = isfinite(global norm)",
      norm_check_loss_scale(chain(), initial_scale=SCALE),
    ),
  ]
  b, *measured = measure_dropping_carry(
    [plain(chain(), params, grads), *(ours(params, grads, tx=tx) for _, tx in checks)],
    calls,
    rounds=rounds,
  )
  rows = []
  for (label, _), r in zip(checks, measured, strict=True):
    out[f"chain: {label}"] = r
    rows.append(
      [
        label,
        f"{r['bytes'] / b['bytes']:.3f}",
        f"{r['median_s'] / b['median_s']:.3f}",
      ]
    )
  lines += [
    "",
    "Inside `optax.chain(optax.clip_by_global_norm(1.0), optax.adam)`, which "
    f"computes the global norm anyway (bare: {b['bytes'] / 1e6:.1f} MB, "
    f"{b['median_s'] * 1e3:.2f} ms):",
    "",
    *table(["finite check", "bytes ratio", "time ratio"], rows, "lrr"),
  ]
  return out, lines


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--calls", type=int, default=30, help="timed calls per round")
  p.add_argument(
    "--quick",
    action="store_true",
    help="2 small layers, 3 calls, 1 round (smoke run)",
  )
  p.add_argument("--out", default=None, help="also write the Markdown here")
  args = p.parse_args(argv)
  size = dict(n_layers=2, width=64, rounds=1) if args.quick else {}
  _, lines = designs(3 if args.quick else args.calls, **size)
  md = [f"Machine: {machine_line()}.", "", "### Designs tried", "", *lines]
  write_report("\n".join(md), args.out)


if __name__ == "__main__":
  main()
