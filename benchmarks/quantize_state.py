"""8-bit optimizer state: quantize_state(adam) against float32 Adam, measured.

Three sections:

* ``costs``: the update step (optimizer update + apply) on ``bench.py``'s
  8.4M-parameter workload (64 float32 leaves): optimizer-state bytes per
  parameter, XLA's cost-analysis "bytes accessed", XLA's temporary memory
  and the median time, for ``optax.adam`` and ``quantize_state(optax.adam)``,
  and for bfloat16 parameters under ``master_weights(store="remainder")``
  around each, and on a GPU ``adam_8bit``'s Pallas kernel (its update, and
  its ``apply_gradients``); then each setup's bytes a parameter by part (parameters,
  masters, moments, block scales, the rest) beside the figures
  bitsandbytes and torchao publish for their 8-bit optimizers;
* ``train``: the main example's transformer and the digits MLP
  (``_tasks.py``, as in ``bf16_params.py``: the same data, batches and
  models, computing in bfloat16), three seeds, final validation loss of float32 Adam, of
  float32 parameters + 8-bit Adam (square roots of the second moment, the
  default; stored as is; stochastic rounding of the codes), and of bfloat16 parameters +
  ``master_weights(store="remainder")`` + 8-bit Adam, with the bytes per
  parameter of each (parameters, masters, moments, scales);
* ``nu``: how the second moment's storage changes Adam's step: from the
  float32 transformer run's final second moment (seed 0), the relative
  error of ``1 / (sqrt(nu) + eps)`` when ``nu`` is stored as is and when
  its square root is stored (both with the unsigned dynamic map, blocks of
  256), and the fraction of nonzero entries that become 0.

Run:  python benchmarks/quantize_state.py [--quick] [--sections costs,train,nu]
It prints Markdown tables and writes them to ``--out``.
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
from _harness import measure_many, tree_bytes
from _trace import kernel_time

import optax_lossscale as ols

HERE = os.path.dirname(os.path.abspath(__file__))

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)

# name: (parameter dtype, optimizer from the learning rate)
CONFIGS = {
  "float32 Adam": (F32, optax.adam),
  "float32 params + 8-bit Adam": (F32, lambda lr: ols.quantize_state(optax.adam(lr))),
  "float32 params + 8-bit Adam, nu stored as is": (
    F32,
    lambda lr: ols.quantize_state(optax.adam(lr), store_sqrt=False),
  ),
  "float32 params + 8-bit Adam, stochastic rounding": (
    F32,
    lambda lr: ols.quantize_state(optax.adam(lr), rounding="stochastic"),
  ),
  "bf16 params + remainder + 8-bit Adam": (
    BF16,
    lambda lr: ols.master_weights(ols.quantize_state(optax.adam(lr))),
  ),
}
COST_CONFIGS = {
  **CONFIGS,
  "bf16 params + remainder + float32 Adam": (
    BF16,
    lambda lr: ols.master_weights(optax.adam(lr)),
  ),
  "float32 params + adam_8bit (XLA)": (F32, lambda lr: ols.adam_8bit(lr)),
  "float32 params + 8-bit Adam, flat": (
    F32,
    lambda lr: ols.quantize_state(optax.adam(lr), layout="flat"),
  ),
  "bf16 params + remainder + 8-bit Adam, flat": (
    BF16,
    lambda lr: ols.master_weights(ols.quantize_state(optax.adam(lr), layout="flat")),
  ),
}
#: XLA counts a fused slice as reading its whole operand: the flat layout's
#: leaves are slices of one buffer, so its "bytes accessed" measures nothing.
_SLICED = ", flat"
#: The Pallas kernel's setups, measured on a GPU (elsewhere Pallas'
#: interpreter runs it: not a measurement).
PALLAS_CONFIGS = dict.fromkeys(
  (
    "float32 params + adam_8bit (Pallas kernel)",
    "float32 params + adam_8bit (Pallas kernel), apply_gradients",
  ),
  (F32, lambda lr: ols.adam_8bit(lr, kernel="pallas")),
)
#: Setups whose step is ``tx.apply_gradients`` (the kernel writes the
#: parameters) rather than ``tx.update`` and ``optax.apply_updates``.
APPLIED = {name for name in PALLAS_CONFIGS if name.endswith("apply_gradients")}
if jax.default_backend() == "gpu":
  COST_CONFIGS.update(PALLAS_CONFIGS)


def train(name, params, batches, loss_fn, evaluate, lr, configs=CONFIGS):
  """One configuration's run: final validation loss/accuracy, bytes/param."""
  dtype, make = configs[name]
  params = jax.tree.map(lambda p: p.astype(dtype), params)
  tx = make(lr)
  state = tx.init(params)
  n = sum(p.size for p in jax.tree.leaves(params))

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  for batch in batches:
    params, state, _ = step(params, state, batch)
  loss, acc = evaluate(jax.tree.map(lambda p: p.astype(F32), params))
  return dict(
    loss=float(loss),
    acc=float(acc),
    params=tree_bytes(params) / n,
    state=tree_bytes(state) / n,
    final=(params, state),
  )


def compare(task, steps, seeds, lr, configs=CONFIGS):
  out = {name: [] for name in configs}
  for seed in seeds:
    _, params, batches, loss_fn, evaluate = task(steps, seed)
    for name in configs:
      t = time.perf_counter()
      r = train(name, params, batches, loss_fn, evaluate, lr, configs)
      out[name].append(r)
      print(
        f"  seed {seed} {name:<40} loss {r['loss']:.4f} acc {r['acc']:.4f} "
        f"({time.perf_counter() - t:.0f} s)",
        flush=True,
      )
  return out


def train_table(results, ref="float32 Adam", state_bytes=None):
  """The runs' table; ``state_bytes``: the last column's state bytes/param by
  setup, in place of the measured ones (for a simulated state)."""
  base = results[ref]
  rows = [
    "| setup | val loss (mean) | gap to float32 Adam, per seed | spread of "
    "float32 Adam's seeds | accuracy | bytes/param: params + state |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  spread = np.ptp([r["loss"] for r in base])
  for name, rs in results.items():
    if state_bytes is not None:
      rs = [dict(r, state=state_bytes[name]) for r in rs]
    gaps = [r["loss"] - b["loss"] for r, b in zip(rs, base, strict=True)]
    rows.append(
      f"| {name} | {np.mean([r['loss'] for r in rs]):.4f} | "
      f"{', '.join(f'{g:+.4f}' for g in gaps)} (mean {np.mean(gaps):+.4f}) | "
      f"{spread:.4f} | {100 * np.mean([r['acc'] for r in rs]):.2f}% | "
      f"{rs[0]['params']:.2f} + {rs[0]['state']:.2f} = "
      f"{rs[0]['params'] + rs[0]['state']:.2f} |"
    )
  return "\n".join(rows)


# Published figures beside ours (bytes a parameter), with where they come
# from: bitsandbytes' documentation of its 8-bit optimizers, and torchao's
# README (torchao/optim) for a full-bfloat16 fine-tune of Llama-2-7B
# (6.74B parameters) on an A100, peak memory allocated.
PUBLISHED = [
  (
    "bitsandbytes `Adam8bit`",
    "its documentation: optimizer state in 75% less memory than 32-bit Adam's "
    "(2 bytes a parameter of 8), float32 scales per block",
  ),
  (
    "bitsandbytes and torchao 8-bit AdamW, Llama-2-7B, full bfloat16",
    "torchao's README: peak memory 39.3 and 39.1 GB against PyTorch's fused "
    "AdamW's 51.6 GB (bfloat16 moments): 1.82 and 1.85 bytes a parameter less "
    "(GB as 10**9 bytes; torchao's `AdamW4bit`: 33.2 GB, 2.73 less)",
  ),
]


def _parts(state) -> dict:
  """Bytes of ``state`` by part: masters (``master_weights``' remainders),
  moments (8-bit codes, or Adam's float32 ``mu`` and ``nu``), block scales,
  and the rest (counts, leaves too small to quantise)."""
  parts = dict.fromkeys(("masters", "moments", "scales", "other"), 0)
  flat = jax.tree_util.tree_flatten_with_path(
    state, is_leaf=lambda x: isinstance(x, ols.QuantizedLeaf)
  )[0]
  for path, leaf in flat:
    names = [getattr(k, "name", None) for k in path]
    if isinstance(leaf, ols.QuantizedLeaf):
      parts["moments"] += leaf.codes.nbytes
      parts["scales"] += leaf.scales.nbytes
    elif "master" in names:
      parts["masters"] += leaf.nbytes
    elif ("mu" in names or "nu" in names) and leaf.size >= 4096:
      parts["moments"] += leaf.nbytes
    else:
      parts["other"] += leaf.nbytes
  return parts


def parts_table(rows, n) -> str:
  """Bytes a parameter of each setup by part (a setup whose row reads as one
  before it is left out), then the published figures."""
  lines = [
    "Bytes a parameter, by part (the same workload; exact):",
    "",
    "| setup | parameters | masters | moments | block scales | other | total |",
    "| --- | --- | --- | --- | --- | --- | --- |",
  ]
  seen = set()
  for name, params, parts in rows:
    cells = [params] + [parts[k] for k in ("masters", "moments", "scales", "other")]
    shown = " | ".join(f"{c / n:.2f}" for c in cells) + f" | {sum(cells) / n:.2f}"
    if shown in seen:
      continue  # stored as a setup above is (another rounding: its step, say)
    seen.add(shown)
    lines.append(f"| {name} | {shown} |")
  lines += ["", "Published figures of the 8-bit optimizers users come from:", ""]
  lines += ["| optimizer | figure |", "| --- | --- |"]
  lines += [f"| {name} | {figure} |" for name, figure in PUBLISHED]
  return "\n".join(lines)


#: Calls of each update step traced for its kernels' time.
KERNEL_STEPS = 5


def setup(name, dtype, make, params32):
  """``(step, params, state)`` of setup ``name`` (a ``COST_CONFIGS`` or
  ``PALLAS_CONFIGS`` entry's ``dtype`` and ``make``) on ``params32``:
  ``step((params, state), grads)`` is its update step, update and apply
  (``tx.apply_gradients`` for :data:`APPLIED`)."""
  params = jax.tree.map(lambda p: p.astype(dtype), params32)
  tx = make(w.LR)

  def step(carry, g):
    p, s = carry
    if name in APPLIED:
      return tx.apply_gradients(g, s, p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return step, params, tx.init(params)


def update_costs(
  calls, rounds, n_layers=16, width=512, by_part=True, configs=COST_CONFIGS
):
  """The update step of each of ``configs`` (the first the reference) on
  bench.py's workload (by default its 8.4M parameters), and with
  ``by_part`` each setup's bytes by part."""
  params32 = w.layers(n_layers, width)
  n = sum(p.size for p in jax.tree.leaves(params32))
  grads = w.grads_like(params32)
  entries, bytes_, parts, errors = [], [], [], {}
  for name, (dtype, make) in configs.items():
    step, params, state = setup(name, dtype, make, params32)
    bytes_.append((tree_bytes(params) / n, tree_bytes(state) / n))
    parts.append((name, tree_bytes(params), _parts(state)))

    if "Pallas" in name:  # a kernel the GPU may refuse: a row saying so
      try:
        jax.jit(step).lower((params, state), grads).compile()
      except Exception as e:  # noqa: BLE001
        errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        print(f"{name}: {errors[name]}", flush=True)
        continue
    entries.append((step, (params, state), grads))
  measured = measure_many(entries, calls, rounds=rounds, keep_compiled=True)
  for r in measured:  # the device's own time: the kernels of a traced call
    _, r["kernels"], r["kernel_us"] = kernel_time(
      r.pop("compiled"), r.pop("carry"), grads, KERNEL_STEPS
    )
  results = iter(measured)
  rows = [
    f"Update step on {n:,} parameters in {len(jax.tree.leaves(params32))} leaves:",
    "",
    "| setup | params + state, bytes/param | bytes accessed | vs float32 Adam "
    "| temporary memory | time | vs float32 Adam | kernels | kernel time "
    "| vs float32 Adam |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  ref = None
  for name, (pb, sb) in zip(configs, bytes_, strict=True):
    if name in errors:
      rows.append(f"| {name} | {pb:.2f} + {sb:.2f} = {pb + sb:.2f} | {errors[name]} |")
      continue
    r = next(results)
    ref = ref or r
    accessed = (
      "not counted | -"
      if name.endswith(_SLICED)
      else f"{r['bytes'] / 1e6:.1f} MB | {r['bytes'] / ref['bytes']:.2f}x"
    )
    rows.append(
      f"| {name} | {pb:.2f} + {sb:.2f} = {pb + sb:.2f} | {accessed} | "
      f"{r['temp_bytes'] / 1e6:.1f} MB | {r['median_s'] * 1e3:.2f} ms | "
      f"{r['median_s'] / ref['median_s']:.2f}x | {r['kernels']:.0f} | "
      f"{r['kernel_us']:.1f} us | {r['kernel_us'] / ref['kernel_us']:.2f}x |"
    )
  rows += [
    "",
    '"flat": `layout="flat"`. Not counted: XLA counts a fused slice of an array '
    "as reading all of it, and each of the flat layout's leaves is a slice of "
    "one buffer. *apply_gradients*: the step is `tx.apply_gradients(grads, "
    "state, params)`, whose kernel writes the parameters, where the others "
    "are `tx.update` and `optax.apply_updates`. "
    "*time*: a call's, from the host (dispatch included); "
    f"*kernels*, *kernel time*: the device's kernels of one call and their summed "
    f"time, from a `jax.profiler` trace of {KERNEL_STEPS} calls (`_trace.py`).",
  ]
  return "\n".join(rows) + ("\n\n" + parts_table(parts, n) if by_part else "")


def _roundtrip(x, root):
  """``x`` (>= 0) through one quantisation, stored as is or as its root."""
  from optax_lossscale._params import quantize_state as q

  return q.encode(x, 256, sqrt=root).dequantize()


def nu_storage(steps, lr, eps=1e-8):
  """Adam's step factor 1/(sqrt(nu)+eps) after quantising nu two ways."""
  from _tasks import lm_task  # the models are Flax's: ``costs`` runs without it

  _, params, batches, loss_fn, evaluate = lm_task(steps, 0)
  r = train("float32 Adam", params, batches, loss_fn, evaluate, lr)
  nu = [x for x in jax.tree.leaves(r["final"][1][0].nu) if x.size >= 4096]
  rows = [
    "| nu stored as | median rel. error of 1/(sqrt(nu)+eps) | 99th percentile "
    "| max | nonzero entries made 0 |",
    "| --- | --- | --- | --- | --- |",
  ]
  for root in (False, True):
    errs, zeros, nonzero = [], 0, 0
    for x in nu:
      v = _roundtrip(x, root)
      f, g = 1 / (jnp.sqrt(x) + eps), 1 / (jnp.sqrt(v) + eps)
      errs.append(np.asarray(jnp.abs(g - f) / f).ravel())
      zeros += int(jnp.sum((v == 0) & (x > 0)))
      nonzero += int(jnp.sum(x > 0))
    e = np.concatenate(errs)
    rows.append(
      f"| {'sqrt(nu)' if root else 'nu'} | {np.median(e):.2e} | "
      f"{np.percentile(e, 99):.2e} | {e.max():.2e} | {zeros / nonzero:.2e} |"
    )
  return (
    f"Adam's second moment of the float32 transformer run ({steps} steps, seed "
    f"0; {sum(x.size for x in nu):,} entries in leaves of >= 4096):\n\n"
    + "\n".join(rows)
  )


def main(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  p.add_argument("--lm-steps", type=int, default=300, help="transformer steps per run")
  p.add_argument("--mlp-steps", type=int, default=2000, help="MLP steps per run")
  p.add_argument("--seeds", type=int, default=3, help="seeds per configuration")
  p.add_argument("--lm-lr", type=float, default=1e-3, help="transformer learning rate")
  p.add_argument("--mlp-lr", type=float, default=3e-4, help="MLP learning rate")
  p.add_argument("--calls", type=int, default=20, help="timed update steps a round")
  p.add_argument("--layers", type=int, default=16, help="costs: the workload's layers")
  p.add_argument("--width", type=int, default=512, help="costs: the layers' width")
  p.add_argument("--quick", action="store_true", help="a few steps of everything")
  p.add_argument("--sections", default="costs,train,nu", help="comma-separated")
  p.add_argument("--models", default="mlp,lm", help="train: comma-separated")
  p.add_argument(
    "--out",
    default=os.path.join(HERE, "out", "quantize_state.md"),
    help="markdown report",
  )
  args = p.parse_args(argv)
  if args.quick:
    args.lm_steps, args.mlp_steps, args.seeds, args.calls = 5, 20, 1, 2
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  sections = args.sections.split(",")
  parts = []
  if "costs" in sections:
    parts.append(
      update_costs(
        args.calls,
        rounds=1 if args.quick else 3,
        n_layers=args.layers,
        width=args.width,
      )
    )
    print(parts[-1], flush=True)
  if "train" in sections:
    from _tasks import lm_task, mlp_task  # Flax's models, as in nu_storage

    seeds = range(args.seeds)
    models = args.models.split(",")
    if "mlp" in models:
      print("MLP:", flush=True)
      mlp = compare(mlp_task, args.mlp_steps, seeds, args.mlp_lr)
      parts += [
        f"MLP ({args.mlp_steps} steps, learning rate {args.mlp_lr}, seeds "
        f"0-{args.seeds - 1}; test set of the digits):",
        train_table(mlp),
      ]
      print("\n\n".join(parts[-2:]), flush=True)
    if "lm" in models:
      print("transformer:", flush=True)
      lm = compare(lm_task, args.lm_steps, seeds, args.lm_lr)
      parts += [
        f"Transformer ({args.lm_steps} steps, learning rate {args.lm_lr}, seeds "
        f"0-{args.seeds - 1}; validation loss in nats per byte):",
        train_table(lm),
      ]
      print("\n\n".join(parts[-2:]), flush=True)
  if "nu" in sections:
    parts.append(nu_storage(args.lm_steps, args.lm_lr))
    print(parts[-1], flush=True)
  with open(args.out, "w") as f:
    f.write("\n\n".join(parts) + "\n")


if __name__ == "__main__":
  main()
