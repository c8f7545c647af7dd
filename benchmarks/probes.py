"""Probes behind BENCHMARKS.md's explanations of what the tables show.

Not part of the report's tables; each probe prints what it measured:

* read: the finite check alone on the update step's gradients, not in
  cache (8 gradient trees in rotation), chunked in several ways and written
  with other formulas (the former ``x - x``, boolean, max, ``x * 0``).
* mlp: XLA's bytes for the MLP train step of ``bench.py`` with the finite
  check written in several ways, against no check: whether any of them
  reads the transposed weight gradients in place.
* f16: the finite check alone on float16 and bfloat16 gradients of the
  update step's workload, as we write it and as a test of the exponent bits
  of each pair of 16-bit entries read as one 32-bit word (no float16
  arithmetic), with XLA's bytes for each.
* kernels: how fast XLA's CPU reductions read, against what the machine
  can read: a 256 MiB float32 array (larger than the cache) reduced by XLA in
  several ways (a plain sum or max, a sum of squares, ours ``sum(x - x)``,
  ``sum(x * 0)``) and scaled in place, and reduced by NumPy on one thread
  and on two. Then the same in a new process pinned to one core: which
  kernels use more than one. Last, bare Adam's update step with plain sums
  of the gradients (one per leaf, the fastest read, or one per 32 leaves;
  neither an exact check) or our finite check as an output nothing waits
  on, timed as ``bench.py`` times its tables, next to ours: what the
  fastest extra read costs in the step.
* faults: page faults and system time per call of the train steps of
  ``bench.py`` (unscaled and loss-scaled) and of the update steps of its
  headline table, each called back to back; the train steps once more after
  the update steps have run (and freed their temporary memory). Then the
  same in a new process where glibc's malloc keeps freed memory (one arena,
  no mmap, no trimming), so that XLA's per-call temporary buffers are reused
  instead of mapped and faulted in afresh. Not the report's method: glibc's
  ``posix_memalign`` can then leave holes it never reuses, and a process that
  allocates large aligned blocks in a loop may grow without bound.

* jitted: XLA's bytes and temporary memory (deterministic, no timing) of
  the update step when the inner update is itself ``jax.jit``-ed, once and
  twice, against bare Adam and against the skip selecting after the update:
  whether the skip's rewrite still avoids the copy of the state.

Run:  python benchmarks/probes.py [read] [mlp] [f16] [kernels] [faults] [jitted]
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import bench
import jax
import jax.numpy as jnp
import numpy as np
import optax
import variants
from jax import lax

import optax_lossscale as ols
from optax_lossscale import _config, _skip


def _median_ms(fn, args_cycle, calls=60, warmup=8):
  times = []
  for i in range(warmup + calls):
    args = args_cycle[i % len(args_cycle)]
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    if i >= warmup:
      times.append(time.perf_counter() - t)
  return statistics.median(times) * 1e3


def _with_chunk(size):
  return functools.partial(ols.all_finite, chunk=size)


def _grouped(f, combine, reduce):
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


def _two_stage_sum(total):
  rows = 64 if total.size % 64 == 0 else 1
  return jnp.sum(jnp.sum(total.reshape(rows, -1), axis=1))


# The check with another reduction or other exact float32 formulas: each
# returns True when finite.
_FORMULAS = [
  (
    "sum(x - x) (the check before it tested bits; folded away by fast-math)",
    _grouped(lambda x: x - x, jnp.add, jnp.sum),
    lambda r: jnp.isfinite(jnp.sum(r)),
  ),
  (
    "two-stage reduction",
    _grouped(lambda x: x - x, jnp.add, _two_stage_sum),
    lambda r: jnp.isfinite(jnp.sum(r)),
  ),
  (
    "max of the bits without sign < inf's (integer)",
    _grouped(_bits, jnp.maximum, jnp.max),
    lambda r: jnp.max(r) < np.int32(0x7F800000),
  ),
  (
    "any(~isfinite(x)) (boolean)",
    _grouped(lambda x: ~jnp.isfinite(x), jnp.logical_or, jnp.any),
    lambda r: ~jnp.any(r),
  ),
  (
    "max(abs(x)) (NaN handling depends on flags)",
    _grouped(jnp.abs, jnp.maximum, jnp.max),
    lambda r: jnp.isfinite(jnp.max(r)),
  ),
  (
    "sum(x * 0)",
    _grouped(lambda x: x * 0, jnp.add, jnp.sum),
    lambda r: jnp.isfinite(jnp.sum(r)),
  ),
]


def probe_read():
  params = bench.layers()
  trees = [(bench.scaled(bench.grads_like(params, seed=s)),) for s in range(8)]
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
    print(f"  {name}: {_median_ms(compiled, trees):.3f} ms")


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
  model, x, y = bench.train_cases()["MLP 784-1024-1024-1024-10, batch 256"]
  params = model.init(jax.random.key(0), jnp.asarray(x))["params"]
  grad_mb = sum(p.nbytes for p in jax.tree.leaves(params)) / 1e6
  print(f"MLP train step, {grad_mb:.1f} MB of gradients; bytes accessed:")
  for name, check in [
    ("no check", None),
    ("ours (all_finite)", ols.all_finite),
    ("one reduction per leaf", bench.per_leaf_check),
    ("sum of the transpose", _sum_of_transpose),
    ("custom reducer a + (b - b)", _custom_reducer),
    ("matrix-vector product with zeros", _zeros_matvec),
  ]:
    entries = bench.train_entries(model, x, y, check=check or ols.all_finite)
    step, carry, batch = entries["plain" if check is None else "unused_check"]
    compiled = jax.jit(step).lower(carry, batch).compile()
    print(f"  {name}: {bench.bytes_accessed(compiled) / 1e6:.1f} MB")


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
    params = bench.layers(dtype=dtype)
    trees = [(bench.scaled(bench.grads_like(params, seed=s)),) for s in range(8)]
    mb = sum(x.nbytes for x in jax.tree.leaves(trees[0])) / 1e6
    print(f"finite check alone, {mb:.1f} MB of {jnp.dtype(dtype).name} gradients:")
    for name, check in [
      ("ours (all_finite)", ols.all_finite),
      ("exponent bits of 16-bit pairs", _pair_bits_check),
    ]:
      compiled = jax.jit(check).lower(*trees[0]).compile()
      bad = jax.tree.map(lambda x: x.at[(3,) * x.ndim].set(jnp.inf), trees[0][0])
      assert bool(compiled(*trees[0])) and not bool(compiled(bad))
      ms = [_median_ms(compiled, trees) for _ in range(3)]
      print(
        f"  {name}: {', '.join(f'{m:.2f}' for m in ms)} ms (3 runs), "
        f"{bench.bytes_accessed(compiled) / 1e6:.1f} MB"
      )


_KERNELS = {
  "sum(x)": lambda x: jnp.sum(x),
  "max(x)": lambda x: jnp.max(x),
  "sum(x * x)": lambda x: jnp.sum(x * x),
  "sum(x - x) (ours)": lambda x: jnp.sum(x - x),
  "sum(x * 0)": lambda x: jnp.sum(x * 0),
}


def _plain_sums(tree):
  return jnp.stack([jnp.sum(x) for x in jax.tree.leaves(tree)])


def probe_kernels(one_core=False):
  if one_core:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
  cores = len(os.sched_getaffinity(0))
  n = 64 * 2**20
  x = jnp.asarray(np.random.default_rng(0).normal(size=n).astype(np.float32))
  mb = x.nbytes / 1e6

  def report(name, fn, args=(), passes=1):
    ms = _median_ms(fn, [args], calls=30, warmup=3)
    print(f"  {name}: {ms:.2f} ms, {passes * mb / ms:.1f} GB/s", flush=True)

  print(f"{mb:.0f} MB float32, {cores} core(s); median of 30 calls, GB/s moved:")
  for name, f in _KERNELS.items():
    report(f"XLA {name}", jax.jit(f), (x,))
  scale = jax.jit(lambda x: x * 1.0001, donate_argnums=0)
  y = [jnp.copy(x)]

  def in_place():
    y[0] = scale(y[0])
    return y[0]

  report("XLA in-place x * c", in_place, passes=2)
  host = np.asarray(x)
  report("NumPy max(x), 1 thread", host.max)
  if cores > 1:
    halves = np.array_split(host, 2)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      report(
        "NumPy max(x), 2 threads on halves", lambda: list(pool.map(np.max, halves))
      )
  if one_core:
    return
  if cores > 1:
    subprocess.run([sys.executable, __file__, "kernels-one-core"], check=True)
  # The same reads in the update step, with nothing waiting on them, timed
  # as bench.py times its tables: is the fastest read under the target?
  params = bench.layers()
  grads = bench.grads_like(params)
  steps = {
    "optax.adam": bench.bare_adam,
    "optax.adam again": bench.bare_adam,
    "optax.adam + unused plain sum(x) per leaf (not exact)": functools.partial(
      bench.bare_adam_and_read, check=_plain_sums
    ),
    "optax.adam + unused sum(x) per 32 leaves (not exact)": functools.partial(
      bench.bare_adam_and_read, check=_grouped(lambda x: x, jnp.add, jnp.sum)
    ),
    "optax.adam + unused finite check (ours)": bench.bare_adam_and_read,
    "dynamic_loss_scale(adam)": bench.ours,
  }
  measured = bench.measure_many(
    [make(params, grads) for make in steps.values()], calls=30
  )
  print("update step, 8.4M float32 parameters in 64 leaves (bench.py's way):")
  for name, r in zip(steps, measured, strict=True):
    print(
      f"  {name}: {r['median_s'] * 1e3:.2f} ms, "
      f"{bench.ratio(r['median_s'], measured[0]['median_s']):.3f}x"
    )


def _per_call(name, step, carry, args, calls=20):
  compiled = jax.jit(step, donate_argnums=0).lower(carry, args).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  carry = jax.tree.map(jnp.copy, carry)
  for _ in range(3):
    carry = jax.block_until_ready(compiled(carry, args))
  before, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
  for _ in range(calls):
    carry = jax.block_until_ready(compiled(carry, args))
  seconds, after = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
  print(
    f"  {name}: {temp / 1e6:.1f} MB temporary; per call "
    f"{seconds / calls * 1e3:.1f} ms, "
    f"{(after.ru_minflt - before.ru_minflt) / calls:.0f} page faults, "
    f"{(after.ru_stime - before.ru_stime) / calls * 1e3:.1f} ms system time",
    flush=True,
  )


def _train_faults():
  for name, (model, x, y) in bench.train_cases().items():
    for kind, entry in bench.train_entries(model, x, y).items():
      if kind != "unused_check":
        _per_call(f"{name}, {kind}", *entry)


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def _keep_freed_memory():
  """One arena, no mmap, no trimming; before JAX runs anything."""
  libc = ctypes.CDLL(None)
  done = [
    libc.mallopt(_M_ARENA_MAX, 1),
    libc.mallopt(_M_MMAP_MAX, 0),
    libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1),
  ]
  assert all(done), done


def probe_faults(kept=False):
  if kept:
    _keep_freed_memory()
  how = "malloc keeping freed memory" if kept else "glibc's malloc as it is"
  print(f"{how}; train steps, first in the process:")
  _train_faults()
  print("update steps:")
  params = bench.layers()
  grads = bench.grads_like(params)
  for name, make in bench.UPDATE_STEPS.items():
    if "again" not in name:
      _per_call(name, *make(params, grads))
  print("train steps, after the update steps:")
  _train_faults()
  if not kept and platform.libc_ver()[0] == "glibc":
    subprocess.run([sys.executable, __file__, "faults-kept"], check=True)


def probe_jitted():
  params = bench.layers()
  grads = bench.grads_like(params)
  adam = optax.adam(bench.LR)
  once = optax.GradientTransformation(adam.init, jax.jit(adam.update))
  twice = optax.GradientTransformation(adam.init, jax.jit(jax.jit(adam.update)))
  config = _config.dynamic_config(bench.SCALE)

  def after(inner):
    return variants.variant(inner, config, skip=_skip.select_after)

  rows = [
    ("bare adam", bench.bare_adam(params, grads)),
    ("ours, adam", bench.ours(params, grads)),
    ("ours, jitted adam", bench.ours(params, grads, ols.dynamic_loss_scale(once))),
    (
      "ours, twice-jitted adam",
      bench.ours(params, grads, ols.dynamic_loss_scale(twice)),
    ),
    ("select after the update, adam", bench.ours(params, grads, after(adam))),
    ("select after the update, jitted adam", bench.ours(params, grads, after(once))),
  ]
  print("update step, 8.4M float32 parameters in 64 leaves, buffers donated:")
  for name, (step, carry, g) in rows:
    compiled = jax.jit(step, donate_argnums=0).lower(carry, g).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    print(
      f"  {name}: {bench.bytes_accessed(compiled) / 1e6:.1f} MB accessed, "
      f"{temp / 1e6:.2f} MB temporary"
    )


def main(argv):
  if argv == ["faults-kept"]:
    probe_faults(kept=True)
    return
  if argv == ["kernels-one-core"]:
    probe_kernels(one_core=True)
    return
  which = argv or ["read", "mlp", "f16", "kernels", "faults", "jitted"]
  if "read" in which:
    probe_read()
  if "mlp" in which:
    probe_mlp()
  if "f16" in which:
    probe_f16()
  if "kernels" in which:
    probe_kernels()
  if "faults" in which:
    probe_faults()
  if "jitted" in which:
    probe_jitted()


if __name__ == "__main__":
  main(sys.argv[1:])
