"""Probes of the machine behind BENCHMARKS.md: how fast it reads, what faults cost.

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
  ``train_step.py`` (unscaled and loss-scaled) and of the update steps of
  ``update_step.py``, each called back to back; the train steps once more
  after the update steps have run (and freed their temporary memory). Then
  the same in a new process where glibc's malloc keeps freed memory (one
  arena, no mmap, no trimming), so that XLA's per-call temporary buffers are
  reused instead of mapped and faulted in afresh. Not the report's method:
  glibc's ``posix_memalign`` can then leave holes it never reuses, and a
  process that allocates large aligned blocks in a loop may grow without
  bound.

Run:  python benchmarks/machine_probes.py [kernels] [faults]   (no argument:
both; ``probes.py kernels`` and ``probes.py faults`` run them too)
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import os
import platform
import resource
import subprocess
import sys
import time

import _workloads as w
import jax
import jax.numpy as jnp
import numpy as np
import train_step
import update_step
from _harness import measure_many, median_ms, ratio
from probes import grouped

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
    ms = median_ms(fn, [args], calls=30, warmup=3)
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
  params = w.layers()
  grads = w.grads_like(params)
  steps = {
    "optax.adam": w.bare_adam,
    "optax.adam again": w.bare_adam,
    "optax.adam + unused plain sum(x) per leaf (not exact)": functools.partial(
      w.bare_adam_and_read, check=_plain_sums
    ),
    "optax.adam + unused sum(x) per 32 leaves (not exact)": functools.partial(
      w.bare_adam_and_read, check=grouped(lambda x: x, jnp.add, jnp.sum)
    ),
    "optax.adam + unused finite check (ours)": w.bare_adam_and_read,
    "dynamic_loss_scale(adam)": w.ours,
  }
  measured = measure_many([make(params, grads) for make in steps.values()], calls=30)
  print("update step, 8.4M float32 parameters in 64 leaves (bench.py's way):")
  for name, r in zip(steps, measured, strict=True):
    print(
      f"  {name}: {r['median_s'] * 1e3:.2f} ms, "
      f"{ratio(r['median_s'], measured[0]['median_s']):.3f}x"
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
  for name, (model, x, y) in train_step.train_cases().items():
    for kind, entry in train_step.train_entries(model, x, y).items():
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
  params = w.layers()
  grads = w.grads_like(params)
  for name, make in update_step.UPDATE_STEPS.items():
    if "again" not in name:
      _per_call(name, *make(params, grads))
  print("train steps, after the update steps:")
  _train_faults()
  if not kept and platform.libc_ver()[0] == "glibc":
    subprocess.run([sys.executable, __file__, "faults-kept"], check=True)


def main(argv):
  if argv == ["faults-kept"]:
    probe_faults(kept=True)
    return
  if argv == ["kernels-one-core"]:
    probe_kernels(one_core=True)
    return
  which = argv or ["kernels", "faults"]
  if "kernels" in which:
    probe_kernels()
  if "faults" in which:
    probe_faults()


if __name__ == "__main__":
  main(sys.argv[1:])
