"""Probes of the finite check behind BENCHMARKS.md's explanations of the tables.

Not part of the report's tables; each probe prints what it measured:

* read: the finite check alone on the update step's gradients, not in
  cache (8 gradient trees in rotation), chunked in several ways and written
  with other formulas (the former ``x - x``, boolean, max, ``x * 0``).
* mlp: XLA's bytes for the MLP train step of ``train_step.py`` with the finite
  check written in several ways, against no check: whether any of them
  reads the transposed weight gradients in place.
* f16: the finite check alone on float16 and bfloat16 gradients of the
  update step's workload, as we write it and as a test of the exponent bits
  of each pair of 16-bit entries read as one 32-bit word (no float16
  arithmetic), with XLA's bytes for each.
* jitted: XLA's bytes and temporary memory (deterministic, no timing) of
  the update step when the inner update is itself ``jax.jit``-ed, once and
  twice, against bare Adam and against the skip selecting after the update:
  whether the skip's rewrite still avoids the copy of the state.
* kernels, faults: what the machine reads and what page faults cost, in
  ``machine_probes.py`` (run from here too).
* compile: the finite check alone on the gradients of the tree section's
  149-leaf transformer, compiled with 2 to 64 leaves per reduction and as
  one concatenation (XLA's bytes for each), against Adam's update step on
  that tree: what the check adds to the loss scale's compile time.
* trace: seconds to trace and to lower the update step on that tree's
  bfloat16 parameters, for Adam, ``master_weights(adam)``, the loss scale
  over it, and the loss scale over ``master_weights`` over flat 8-bit
  Adam: the part of the compile time spent in Python, before XLA.
* rounds: seconds to compile the update step on that tree (the loss scale
  over Adam on float32 parameters, and over ``master_weights(adam)`` on
  bfloat16 ones) and the rounds XLA's simplification pipeline ran (read
  from a ``jax.profiler`` trace of the compile), with the finite check as
  written and with every leaf raveled before it is combined (the former
  check): what a chain of reshapes costs.

* split: CPU seconds (all threads) to trace, lower and compile the loss
  scale's update step on that tree, with the finite check as written and
  replaced by a read of one entry (what the check costs in the step), and
  one reduction compiled alone on 32-bit words (how the check tested bits),
  on exponent bytes (how it tests them) and on float32 values: where the
  loss scale's compile time goes.

Run:  python benchmarks/probes.py [read] [mlp] [f16] [kernels] [faults] [jitted]
[compile] [trace] [rounds] [split] (no argument: all ten).
"""

from __future__ import annotations

import functools
import gzip
import json
import pathlib
import sys
import tempfile
import time

import _workloads as w
import jax
import jax.numpy as jnp
import numpy as np
import optax
import train_step
import variants
from _harness import bytes_accessed, median_ms
from jax import lax
from leaves import _with_unused_check, per_leaf_check

import optax_lossscale as ols
from optax_lossscale._loss_scale import config as _config
from optax_lossscale._loss_scale import finite as _finite
from optax_lossscale._loss_scale import skip as _skip


def _with_chunk(size):
  return functools.partial(ols.all_finite, chunk=size)


def grouped(f, combine, reduce):
  """A check that maps each leaf by ``f``, combines up to 32 leaves of one
  size elementwise and reduces each group: ours with another formula."""

  def check(tree):
    groups = {}
    for x in jax.tree.leaves(tree):
      z = f(jnp.ravel(x))
      groups.setdefault(z.size, []).append(z)
    parts = []
    for zs in groups.values():
      for i in range(0, len(zs), 32):
        total = zs[i]
        for z in zs[i + 1 : i + 32]:
          total = combine(total, z)
        parts.append(reduce(total))
    return jnp.stack(parts)

  return check


def _bits(x):
  return lax.bitcast_convert_type(x, jnp.int32) & np.int32(0x7FFFFFFF)


def _exponent_bytes(x):
  """float32 ``x``'s exponent fields, as the check reduces them."""
  bits = lax.bitcast_convert_type(x, jnp.uint32) & np.uint32(0x7F800000)
  return (bits >> np.uint32(23)).astype(jnp.uint8)


def _two_stage_sum(total):
  rows = 64 if total.size % 64 == 0 else 1
  return jnp.sum(jnp.sum(total.reshape(rows, -1), axis=1))


# The check with another reduction or other exact float32 formulas: each
# returns True when finite.
_FORMULAS = [
  (
    "sum(x - x) (the check before it tested bits; folded away by fast-math)",
    grouped(lambda x: x - x, jnp.add, jnp.sum),
    lambda r: jnp.isfinite(jnp.sum(r)),
  ),
  (
    "two-stage reduction",
    grouped(lambda x: x - x, jnp.add, _two_stage_sum),
    lambda r: jnp.isfinite(jnp.sum(r)),
  ),
  (
    "max of the bits without sign < inf's (integer)",
    grouped(_bits, jnp.maximum, jnp.max),
    lambda r: jnp.max(r) < np.int32(0x7F800000),
  ),
  (
    "any(~isfinite(x)) (boolean)",
    grouped(lambda x: ~jnp.isfinite(x), jnp.logical_or, jnp.any),
    lambda r: ~jnp.any(r),
  ),
  (
    "max(abs(x)) (NaN handling depends on flags)",
    grouped(jnp.abs, jnp.maximum, jnp.max),
    lambda r: jnp.isfinite(jnp.max(r)),
  ),
  (
    "sum(x * 0)",
    grouped(lambda x: x * 0, jnp.add, jnp.sum),
    lambda r: jnp.isfinite(jnp.sum(r)),
  ),
]


def probe_read():
  params = w.layers()
  trees = [(w.scaled(w.grads_like(params, seed=s)),) for s in range(8)]
  print("finite check alone, 33.6 MB of gradients not in cache:")
  for name, check in [
    ("32 leaves per reduction (ours)", _with_chunk(32)),
    ("16 leaves per reduction", _with_chunk(16)),
    ("8 leaves per reduction", _with_chunk(8)),
    ("2 leaves per reduction", _with_chunk(2)),
    *[
      (name, lambda t, g=group, d=decide: d(g(t))) for name, group, decide in _FORMULAS
    ],
  ]:
    compiled = jax.jit(check).lower(*trees[0]).compile()
    bad = jax.tree.map(lambda x: x.at[(3,) * x.ndim].set(-jnp.inf), trees[0][0])
    assert bool(compiled(*trees[0])) and not bool(compiled(bad)), name
    print(f"  {name}: {median_ms(compiled, trees):.3f} ms")


def _fold(a, b):
  return a + (b - b)


def _sum_of_transpose(tree):
  leaves = [x.T if x.ndim == 2 else x for x in jax.tree.leaves(tree)]
  return jnp.isfinite(sum(jnp.sum(x - x) for x in leaves))


def _custom_reducer(tree):
  parts = []
  for x in jax.tree.leaves(tree):
    r = lax.reduce(x, np.zeros((), x.dtype), _fold, tuple(range(x.ndim)))
    parts.append(r - r)
  return jnp.isfinite(sum(parts))


def _zeros_matvec(tree):
  parts = []
  for x in jax.tree.leaves(tree):
    if x.ndim == 2:
      zeros = lax.optimization_barrier(jnp.zeros((x.shape[1],), x.dtype))
      parts.append(jnp.sum(x @ zeros))
    else:
      parts.append(jnp.sum(x - x))
  return jnp.isfinite(sum(parts))


def probe_mlp():
  model, x, y = train_step.train_cases()["MLP 784-1024-1024-1024-10, batch 256"]
  params = model.init(jax.random.key(0), jnp.asarray(x))["params"]
  grad_mb = sum(p.nbytes for p in jax.tree.leaves(params)) / 1e6
  print(f"MLP train step, {grad_mb:.1f} MB of gradients; bytes accessed:")
  for name, check in [
    ("no check", None),
    ("ours (all_finite)", ols.all_finite),
    ("one reduction per leaf", per_leaf_check),
    ("sum of the transpose", _sum_of_transpose),
    ("custom reducer a + (b - b)", _custom_reducer),
    ("matrix-vector product with zeros", _zeros_matvec),
  ]:
    entries = train_step.train_entries(model, x, y, check=check or ols.all_finite)
    step, carry, batch = entries["plain" if check is None else "unused_check"]
    compiled = jax.jit(step).lower(carry, batch).compile()
    print(f"  {name}: {bytes_accessed(compiled) / 1e6:.1f} MB")


_EXPONENT_BITS = {jnp.dtype(jnp.float16): 0x7C00, jnp.dtype(jnp.bfloat16): 0x7F80}


def _pair_bits_check(tree):
  """Non-finite iff some 16-bit half of a 32-bit word has all exponent bits.

  Exact, but only for leaves of an even size (enough here).
  """
  parts = []
  for x in jax.tree.leaves(tree):
    e = _EXPONENT_BITS[x.dtype]
    w = lax.bitcast_convert_type(x.reshape(-1, 2), jnp.uint32)
    w = w & np.uint32(e | e << 16)
    bad = ((w & np.uint32(0xFFFF)) == e) | ((w >> 16) == e)
    parts.append(jnp.sum(bad.astype(jnp.float32)))
  return sum(parts) == 0


def probe_f16():
  for dtype in (jnp.float16, jnp.bfloat16):
    params = w.layers(dtype=dtype)
    trees = [(w.scaled(w.grads_like(params, seed=s)),) for s in range(8)]
    mb = sum(x.nbytes for x in jax.tree.leaves(trees[0])) / 1e6
    print(f"finite check alone, {mb:.1f} MB of {jnp.dtype(dtype).name} gradients:")
    for name, check in [
      ("ours (all_finite)", ols.all_finite),
      ("exponent bits of 16-bit pairs", _pair_bits_check),
    ]:
      compiled = jax.jit(check).lower(*trees[0]).compile()
      bad = jax.tree.map(lambda x: x.at[(3,) * x.ndim].set(jnp.inf), trees[0][0])
      assert bool(compiled(*trees[0])) and not bool(compiled(bad))
      ms = [median_ms(compiled, trees) for _ in range(3)]
      print(
        f"  {name}: {', '.join(f'{m:.2f}' for m in ms)} ms (3 runs), "
        f"{bytes_accessed(compiled) / 1e6:.1f} MB"
      )


def probe_jitted():
  params = w.layers()
  grads = w.grads_like(params)
  adam = optax.adam(w.LR)
  once = optax.GradientTransformation(adam.init, jax.jit(adam.update))
  twice = optax.GradientTransformation(adam.init, jax.jit(jax.jit(adam.update)))
  config = _config.dynamic_config(w.SCALE)

  def after(inner):
    return variants.variant(inner, config, skip=_skip.select_after)

  rows = [
    ("bare adam", w.bare_adam(params, grads)),
    ("ours, adam", w.ours(params, grads)),
    ("ours, jitted adam", w.ours(params, grads, ols.dynamic_loss_scale(once))),
    (
      "ours, twice-jitted adam",
      w.ours(params, grads, ols.dynamic_loss_scale(twice)),
    ),
    ("select after the update, adam", w.ours(params, grads, after(adam))),
    ("select after the update, jitted adam", w.ours(params, grads, after(once))),
  ]
  print("update step, 8.4M float32 parameters in 64 leaves, buffers donated:")
  for name, (step, carry, g) in rows:
    compiled = jax.jit(step, donate_argnums=0).lower(carry, g).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    print(
      f"  {name}: {bytes_accessed(compiled) / 1e6:.1f} MB accessed, "
      f"{temp / 1e6:.2f} MB temporary"
    )


def _compile_s(f, args, tag):
  """Seconds to lower and compile ``f``, and the executable; ``tag``, a
  constant it also returns, makes each round's program new to JAX's caches."""
  start = time.perf_counter()
  compiled = jax.jit(lambda *a: (f(*a), np.int32(tag))).lower(*args).compile()
  return time.perf_counter() - start, compiled


def _concatenated_check(tree):
  x = jnp.concatenate([jnp.ravel(g) for g in jax.tree.leaves(tree)])
  return jnp.max(_bits(x)) < np.int32(0x7F800000)


def probe_compile(rounds=3):
  from gpu_transformer import init_decoder

  params = init_decoder(jax.random.key(0), vocab=256, d_model=128, layers=12, seq=64)
  grads = jax.tree.map(lambda p: p * 1e-3, params)
  gradient_bytes = sum(g.nbytes for g in jax.tree.leaves(grads))
  adam = optax.adam(w.LR)

  def step(p, s, g):
    u, s = adam.update(g, s, p)
    return optax.apply_updates(p, u), s

  rows = [("adam's update step", step, (params, adam.init(params), grads))]
  rows += [
    (f"the check alone, {n} leaves per reduction", _with_chunk(n), (grads,))
    for n in (2, 8, 32, 64)
  ]
  rows += [("the check alone, one concatenation", _concatenated_check, (grads,))]
  print(
    f"compile time (lower + compile, {rounds} rounds, each a new program), "
    f"{len(jax.tree.leaves(grads))} leaves:"
  )
  for i, (name, f, args) in enumerate(rows):
    times = []
    for r in range(rounds):
      seconds, compiled = _compile_s(f, args, tag=i * rounds + r)
      times.append(seconds)
    print(
      f"  {name}: {', '.join(f'{t:.2f}' for t in times)} s, "
      f"{bytes_accessed(compiled) / gradient_bytes:.2f}x the gradients' bytes"
    )


def probe_trace(rounds=3):
  from gpu_transformer import init_decoder

  params = init_decoder(jax.random.key(0), vocab=256, d_model=128, layers=12, seq=64)
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  grads = jax.tree.map(lambda p: p * 1e-3, params)
  flat = lambda: ols.quantize_state(optax.adam(w.LR), layout="flat")  # noqa: E731
  rows = {
    "adam": lambda: optax.adam(w.LR),
    "master_weights(adam)": lambda: ols.master_weights(optax.adam(w.LR)),
    "dynamic_loss_scale(master_weights(adam))": lambda: ols.dynamic_loss_scale(
      ols.master_weights(optax.adam(w.LR))
    ),
    "all three, flat": lambda: ols.dynamic_loss_scale(ols.master_weights(flat())),
  }
  print(
    f"trace / lower seconds ({rounds} rounds, each a new program), "
    f"{len(jax.tree.leaves(params))} bfloat16 leaves:"
  )
  for name, make in rows.items():
    cells = []
    for _ in range(rounds):
      tx = make()
      state = tx.init(params)

      def step(p, s, g, tx=tx):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

      start = time.perf_counter()
      traced = jax.jit(step).trace(params, state, grads)
      middle = time.perf_counter()
      traced.lower()
      cells.append(f"{middle - start:.2f} / {time.perf_counter() - middle:.2f}")
    print(f"  {name}: {', '.join(cells)} s")


def _simplifier_rounds(compile_fn):
  """``(seconds, rounds)``: ``compile_fn()`` timed, and the rounds of XLA's
  simplification pipeline it ran, counted in a profiler trace of it."""
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      start = time.perf_counter()
      compile_fn()
      seconds = time.perf_counter() - start
    (path,) = pathlib.Path(d).rglob("*.trace.json.gz")
    events = json.loads(gzip.open(path).read())["traceEvents"]
  rounds = sum(1 for e in events if e.get("name", "").startswith("simplification ("))
  return seconds, rounds


def _raveled_combined(parts, dtype):
  """The former check: every leaf raveled before the chunk is combined."""
  return _combined([jnp.ravel(p) for p in parts], dtype)


_combined = _finite._combined


def probe_rounds(rounds=3):
  from gpu_transformer import init_decoder

  p32 = init_decoder(jax.random.key(0), vocab=256, d_model=128, layers=12, seq=64)
  rows = {
    "dynamic_loss_scale(adam)": (jnp.float32, ols.dynamic_loss_scale),
    "dynamic_loss_scale(master_weights(adam)), bfloat16": (
      jnp.bfloat16,
      lambda tx: ols.dynamic_loss_scale(ols.master_weights(tx)),
    ),
  }
  print(
    f"compile seconds and simplifier rounds ({rounds} rounds, each a new "
    f"program), {len(jax.tree.leaves(p32))} leaves:"
  )
  for name, (dtype, wrap) in rows.items():
    params = jax.tree.map(lambda p, d=dtype: p.astype(d), p32)
    grads = jax.tree.map(lambda p: p * 1e-3, params)
    for check, combined in (("as written", _combined), ("raveled", _raveled_combined)):
      cells = []
      _finite._combined = combined
      try:
        for r in range(rounds):
          tx = wrap(optax.adam(w.LR))
          state = tx.init(params)

          def step(p, s, g, tx=tx, tag=r):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, np.int32(tag)

          lowered = jax.jit(step).lower(params, state, grads)
          seconds, n = _simplifier_rounds(lowered.compile)
          cells.append(f"{seconds:.2f} s / {n}")
      finally:
        _finite._combined = _combined
      print(f"  {name}, check {check}: {', '.join(cells)}")


def _one_entry_check(leaves, chunk=None, bad=None):
  """A stand-in for the finite check that reads one entry: the loss scale's
  step without the check's compile time (not a check)."""
  del chunk
  x = jnp.ravel(leaves[0])[0]
  flag = x == x
  return flag if bad is None else flag & ~bad


def _cpu_compile_s(make, params, grads, tag):
  """CPU seconds (all threads) to trace and lower, and to compile, the
  update step of ``make()``; ``tag`` makes the program new to JAX's caches."""
  tx = make()
  state = tx.init(params)

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, np.int32(tag)

  start = time.process_time()
  lowered = jax.jit(step, donate_argnums=(0, 1)).trace(params, state, grads).lower()
  middle = time.process_time()
  lowered.compile()
  return middle - start, time.process_time() - middle


def probe_split(rounds=3):
  """Where the loss scale's compile time goes: the 149-leaf step's CPU
  seconds (in Python, tracing and lowering, and in XLA), with the finite
  check as written and replaced by a read of one entry, and one
  reduction's, on integer and on float words."""
  from gpu_transformer import init_decoder

  params = init_decoder(jax.random.key(0), vocab=256, d_model=128, layers=12, seq=64)
  grads = jax.tree.map(lambda p: p * 1e-3, params)
  rows = {
    "adam": lambda: optax.adam(w.LR),
    "adam + an unused finite check": lambda: _with_unused_check(optax.adam(w.LR)),
    "dynamic_loss_scale(adam)": lambda: ols.dynamic_loss_scale(optax.adam(w.LR)),
    "dynamic_loss_scale(adam), one entry checked": lambda: ols.dynamic_loss_scale(
      optax.adam(w.LR)
    ),
  }
  seconds = {name: [] for name in rows}
  for r in range(rounds):
    for i, (name, make) in enumerate(rows.items()):
      saved = _finite.leaves_finite
      if name.endswith("one entry checked"):
        _finite.leaves_finite = _one_entry_check
      try:
        seconds[name].append(_cpu_compile_s(make, params, grads, r * len(rows) + i))
      finally:
        _finite.leaves_finite = saved
  base = min(sum(t) for t in seconds["adam"])
  print(
    f"CPU seconds to trace, lower and compile the update step ({rounds} "
    f"rounds, each a new program; the least total, its ratio to adam's, "
    f"and that round's trace + lower / compile), "
    f"{len(jax.tree.leaves(params))} leaves:"
  )
  for name, times in seconds.items():
    python, xla = min(times, key=sum)
    total = python + xla
    print(f"  {name}: {total:.2f} s ({total / base:.2f}): {python:.2f} / {xla:.2f}")
  x = jnp.ones((128, 384))
  words = {
    "int32 bits (the former check)": lambda x: jnp.max(_bits(x)),
    "uint8 exponent bytes (the check)": lambda x: jnp.max(_exponent_bytes(x)),
    "float32 values": jnp.max,
  }
  print("one reduction of a float32 [128, 384] compiled alone (CPU seconds, least):")
  for name, f in words.items():
    times = []
    for r in range(rounds):
      start = time.process_time()
      jax.jit(lambda x, f=f, r=r: (f(x), np.int32(r))).lower(x).compile()
      times.append(time.process_time() - start)
    print(f"  {name}: {min(times):.3f} s")


def main(argv):
  which = argv or [
    "read",
    "mlp",
    "f16",
    "kernels",
    "faults",
    "jitted",
    "compile",
    "trace",
    "rounds",
    "split",
  ]
  if "read" in which:
    probe_read()
  if "mlp" in which:
    probe_mlp()
  if "f16" in which:
    probe_f16()
  if "kernels" in which or "faults" in which:
    import machine_probes

    machine_probes.main([k for k in ("kernels", "faults") if k in which])
  if "jitted" in which:
    probe_jitted()
  if "compile" in which:
    probe_compile()
  if "trace" in which:
    probe_trace()
  if "rounds" in which:
    probe_rounds()
  if "split" in which:
    probe_split()


if __name__ == "__main__":
  main(sys.argv[1:])
