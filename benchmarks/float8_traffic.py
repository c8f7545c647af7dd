"""float8 against bfloat16 compiled for a GPU, on a CPU: bytes by kind of kernel.

The float8 profile (``float8_profile.py``) needs a GPU; this needs only
JAX's CUDA plugin (``pip install 'jax[cuda12]'``, best in a virtual
environment of its own: without a GPU the plugin prints an error whenever
another script starts JAX). XLA compiles the float8 profile's train step for
the GPU that ``--target`` describes (a ``GpuTargetConfigProto`` in text
form: ``benchmarks/targets/``) without one, through JAX's deviceless
compilation (``jax.experimental.topologies``), and ``_hlo.Program`` reads the
optimised program: its kernels sorted as the profile sorts them (GEMMs,
amax reductions, casts to or from float8, transposes and copies, other),
and the bytes each kind reads and writes (``Program.traffic``). XLA does
not autotune without a GPU: the script asks for cuBLAS GEMMs
(``--xla_gpu_enable_triton_gemm=false``), which the GPU's autotuner chose
for nearly all of the profile's float8 GEMMs.

Writes ``--out`` (default ``benchmarks/out/float8_traffic.md``):

1. Environment: the versions, the commit and the target.
2. Bytes by kind of kernel: for each size of ``--sizes`` (the profile's)
   and each of :data:`VARIANTS`, the kernels and gigabytes of each kind,
   their total, and that total's time at the target's memory bandwidth (a
   floor for the step's kernels that are bound by memory, not a
   prediction of the step's time); the float8 GEMMs; the float8 step's
   transposes and copies by the type they write (``Program.float8_moves``).

With attention's matmuls in float8, the amax and cast columns at the
bandwidth came within 12% of the H200 profile's measured times for those
kernels (BENCHMARKS.md, after the profile), so what a change to the recipe
does to them can be read here before it runs on a GPU. Other kinds, the
transposes among them, do not follow their bytes so.

``--small`` compiles tiny sizes for this machine's own CPU instead (no
plugin needed, seconds; what ``tests/test_float8_traffic.py`` runs): every
code path but the target's; its numbers mean nothing.

Run:  python benchmarks/float8_traffic.py [--small] [--target PATH] [--out PATH]
"""

from __future__ import annotations

import gc
import os
import re
import shlex
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import train_step  # noqa: E402
from _harness import (  # noqa: E402
  details,
  environment,
  environment_lines,
  error_text,
  small_defaults,
  small_parser,
  table,
)
from _hlo import CATEGORIES, Program  # noqa: E402
from _workloads import LR  # noqa: E402
from float8_profile import SIZES, parse_sizes, shape_text  # noqa: E402
from gpu_transformer import decoder_loss, init_decoder  # noqa: E402

import optax_lossscale as ols  # noqa: E402

#: name -> (the wrapping of the float32 loss, in words; the wrapping).
VARIANTS = {
  "bfloat16": (
    "`ols.autocast(loss_fn, compute_dtype=jnp.bfloat16)`",
    lambda f: ols.autocast(f, compute_dtype=jnp.bfloat16),
  ),
  "float8": (
    '`ols.autocast(loss_fn, compute_dtype=jnp.bfloat16, matmul="float8")` '
    "(the default recipe: attention's matmuls in bfloat16)",
    lambda f: ols.autocast(f, compute_dtype=jnp.bfloat16, matmul="float8"),
  ),
  "float8, attention too": (
    "`..., matmul=ols.Float8Matmul(attention=True)`",
    lambda f: ols.autocast(
      f, compute_dtype=jnp.bfloat16, matmul=ols.Float8Matmul(attention=True)
    ),
  ),
}
DEFAULT_TARGET = os.path.join(HERE, "targets", "h200.txtpb")
SMALL = {"sizes": "32:2:2:16:2,64:1:4:16:2", "vocab": 256}


def read_target(path):
  """``(text, {name, bandwidth})`` of a ``GpuTargetConfigProto`` text file:
  its device's name and memory bandwidth in bytes/s."""
  with open(path) as f:
    text = f.read()
  name = re.search(r'device_description_str:\s*"([^"]*)"', text)
  bandwidth = re.search(r"memory_bandwidth:\s*(\d+)", text)
  if not (name and bandwidth):
    raise ValueError(
      f"{path}: a target names its device (device_description_str) and its "
      "memory_bandwidth"
    )
  return text, {"name": name.group(1), "bandwidth": int(bandwidth.group(1))}


def target_sharding(text):
  """A one-device sharding on the GPU that target config ``text`` describes,
  created without one (deviceless compilation)."""
  from jax.experimental import topologies

  topology = topologies.get_topology_desc(
    platform="cuda", target_config=text, topology="1x1x1"
  )
  mesh = topologies.make_mesh(topology, (1,), ("x",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def compile_step(size, vocab, wrap, sharding):
  """The float8 profile's train step for ``size`` (``wrap`` of the decoder's
  loss, ``optax.adam``, buffers donated), compiled from abstract values
  placed by ``sharding`` (``None``: this machine's default device)."""

  def init():
    return init_decoder(
      jax.random.key(0),
      vocab=vocab,
      d_model=size["d_model"],
      layers=size["layers"],
      seq=size["seq"],
    )

  def loss_fn(p, x, y):
    return decoder_loss(p, x, y, heads=size["heads"])

  step = train_step.adam_step(wrap(loss_fn))
  params = jax.eval_shape(init)
  carry = jax.eval_shape(lambda p: (p, optax.adam(LR).init(p)), params)
  tokens = jax.ShapeDtypeStruct((size["batch"], size["seq"]), jnp.int32)

  def placed(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  args = jax.tree.map(placed, (carry, (tokens, tokens)))
  return jax.jit(step, donate_argnums=0).lower(*args).compile()


def measure(program):
  """What the report says of one compiled step."""
  counts = dict.fromkeys(CATEGORIES, 0)
  for cat in program.categories().values():
    counts[cat] += 1
  return {
    "kernels": counts,
    "bytes": program.traffic(),
    "float8_gemms": len(program.float8_gemms()),
    "cublas_f8": sum("$f8" in i.target for i in program.instructions.values()),
    "moves": program.float8_moves(),
  }


def size_lines(size, results, bandwidth, unit):
  """The table of one size; bytes in ``unit`` (``(name, bytes)``)."""
  base = results.get("bfloat16", {}).get("bytes")
  rows = []
  for name in VARIANTS:
    r = results.get(name)
    if r is None or "error" in r:
      rows.append([name, (r or {}).get("error", "not run")] + [""] * 8)
      continue
    total = sum(r["bytes"].values())
    rows.append(
      [
        name,
        *(
          f"{r['bytes'][c] / unit[1]:.2f} ({r['kernels'][c]})"
          for c in ("GEMM", "amax", "cast", "transpose/copy", "other")
        ),
        f"{total / unit[1]:.2f}",
        f"{total / bandwidth * 1e3:.2f}",
        f"{total / sum(base.values()):.3f}" if base else "",
        f"{r['float8_gemms']} ({r['cublas_f8']})",
      ]
    )
  header = [
    "step",
    "GEMM",
    "amax",
    "cast",
    "transpose/copy",
    "other",
    f"total, {unit[0]}",
    "at bandwidth, ms",
    "total / bfloat16",
    "float8 GEMMs (cuBLASLt)",
  ]
  lines = [f"{shape_text(size)}.", ""]
  lines += table(header, rows, "l" + "r" * 9)
  moves = [
    f"{name}: "
    + (", ".join(f"{n} {t}" for t, n in sorted(r["moves"].items())) or "none")
    for name, r in results.items()
    if "moves" in r and name != "bfloat16"
  ]
  if moves:
    lines += [
      "",
      "Transposes and copies of float8 matmuls' operands or products, "
      "by the type they write: " + "; ".join(moves) + ".",
    ]
  return lines


def report(args, argv, env_lines, target, sizes, results, t_start):
  small = (
    " (--small: tiny sizes for this CPU, numbers mean nothing)" if args.small else ""
  )
  shown = " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
  md = [
    f"# float8 against bfloat16, compiled for a GPU: bytes by kind of kernel{small}",
    "",
    f"Made by `python benchmarks/float8_traffic.py {shown}`.".replace(" `.", "`."),
    "",
    "## 1. Environment",
    "",
    *env_lines,
    "",
    "## 2. Bytes by kind of kernel",
    "",
    f"The float8 profile's train step (its decoder, vocabulary {args.vocab}, "
    "`optax.adam`, buffers donated) compiled by XLA for "
    + (f"the {target['name']}" if target else "this CPU")
    + " and read from its optimised HLO (`_hlo.Program`). Each cell: the "
    + ("megabytes" if args.small else "gigabytes")
    + " the kernels of a kind read and write (each kernel's operands "
    "and results, whole), and how many kernels, sorted as the profile sorts "
    "them. *at bandwidth*: the total at "
    + (
      f"{target['bandwidth'] / 1e12:.2f} TB/s, the target's memory bandwidth"
      if target
      else "1 TB/s"
    )
    + ": a floor for kernels bound by memory, not the step's time (GEMMs are "
    "bound by arithmetic). *float8 GEMMs*: GEMM kernels with float8 operands "
    "(of them cuBLASLt's `__cublas$lt$matmul$f8`).",
    "",
    *[f"- {name}: {how}" for name, (how, _) in VARIANTS.items()],
  ]
  bandwidth = target["bandwidth"] if target else 1e12
  for size in sizes:
    unit = ("MB", 1e6) if args.small else ("GB", 1e9)
    md += ["", *size_lines(size, results.get(size["d_model"], {}), bandwidth, unit)]
    for name, r in results.get(size["d_model"], {}).items():
      if "traceback" in r:
        md += ["", *details(f"d_model {size['d_model']}, {name}", r["traceback"])]
  md += ["", f"Total wall time: {time.perf_counter() - t_start:.1f} s."]
  return "\n".join(md) + "\n"


def add_target(parser):
  """``--small`` (tiny, compiled for this CPU) and ``--target``."""
  add = parser.add_argument
  add("--small", action="store_true", help="tiny sizes compiled for this CPU")
  add("--target", default=DEFAULT_TARGET, help="a GpuTargetConfigProto text file")


def resolve_target(parser, args):
  """``args.target_path``, ``args.target_text`` and ``args.target``
  (:func:`read_target`'s; all ``None`` with ``--small``), or the parser's
  error: ``--small`` with a ``--target``, a target it cannot read."""
  if args.small and args.target != DEFAULT_TARGET:
    parser.error("--small compiles for this CPU: it takes no --target")
  try:
    args.target_path = None if args.small else os.path.abspath(args.target)
    args.target_text, args.target = (
      (None, None) if args.small else read_target(args.target_path)
    )
  except (ValueError, OSError) as e:
    parser.error(str(e))


def parse_args(argv=None):
  parser = small_parser(__doc__.splitlines()[0], SMALL)
  add = parser.add_argument
  add("--out", default=os.path.join(HERE, "out", "float8_traffic.md"), help="report")
  add_target(parser)
  add("--sizes", default=SIZES, help="comma-separated d_model:layers:heads:seq:batch")
  add("--vocab", type=int, default=32768, help="vocabulary size")
  args = parser.parse_args(argv)
  if args.vocab < 1:
    parser.error("--vocab must be at least 1")
  resolve_target(parser, args)
  small_defaults(parser, args, SMALL)
  try:
    args.size_list = parse_sizes(args.sizes)
  except ValueError as e:
    parser.error(str(e))
  return args


def deviceless():
  """Before JAX starts a backend: nothing runs on a device, so the CPU is
  JAX's backend (the CUDA plugin, if installed, then compiles for the target
  without looking for a GPU), and GEMMs go to cuBLAS, which the GPU's
  autotuner chose for nearly all of the profile's float8 GEMMs (without a
  GPU XLA does not autotune, and would pick Triton's)."""
  jax.config.update("jax_platforms", "cpu")
  os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_gpu_enable_triton_gemm=false"]
  ).strip()


def cuda_plugin_version():
  """The installed JAX CUDA plugin's package and version, or ``"none"``."""
  from importlib import metadata

  for name in ("jax-cuda13-plugin", "jax-cuda12-plugin"):
    try:
      return f"{name} {metadata.version(name)}"
    except metadata.PackageNotFoundError:
      continue
  return "none"


def compile_target(args, script):
  """``(environment lines, sharding)`` of a report compiled for
  ``args.target`` (``{name, bandwidth}`` from :func:`read_target`, with
  ``args.target_path`` and ``args.target_text``; ``None``: this CPU, and a
  ``None`` sharding). Call :func:`deviceless` first. Exits saying what is
  missing where the CUDA plugin cannot compile for it."""
  rows, _ = environment()
  if args.target:
    rows = [
      r for r in rows if r[0] not in ("device kind", "device count", "nvidia-smi")
    ]
    rows.insert(0, ("device kind", f"{args.target['name']} (compiled for, not run on)"))
    rows.insert(1, ("target config", os.path.relpath(args.target_path, HERE)))
    rows.insert(2, ("JAX CUDA plugin", cuda_plugin_version()))
  try:
    sharding = target_sharding(args.target_text) if args.target else None
  except Exception as e:  # noqa: BLE001
    raise SystemExit(
      f"{script}: cannot compile for {args.target['name']}: "
      f"{error_text(e)}. It needs JAX's CUDA plugin: pip install -e '.[cuda]'."
    ) from e
  return environment_lines(rows), sharding


def main(argv=None):
  args = parse_args(argv)
  deviceless()
  t_start = time.perf_counter()
  env_lines, sharding = compile_target(args, "float8_traffic.py")
  out = os.path.abspath(args.out)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  results = {}

  def write():
    text = report(args, argv, env_lines, args.target, args.size_list, results, t_start)
    with open(out, "w") as f:
      f.write(text)

  for size in args.size_list:
    print(f"d_model {size['d_model']}: {shape_text(size)}", flush=True)
    per = results[size["d_model"]] = {}
    for name, (_, wrap) in VARIANTS.items():
      t0 = time.perf_counter()
      try:
        compiled = compile_step(size, args.vocab, wrap, sharding)
        per[name] = measure(Program(compiled.as_text()))
        del compiled
      except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        per[name] = {"error": error_text(e), "traceback": traceback.format_exc()}
      gc.collect()
      print(f"  {name}: {time.perf_counter() - t0:.1f} s", flush=True)
      write()
  write()
  print(f"wrote {out} ({time.perf_counter() - t_start:.1f} s)")


if __name__ == "__main__":
  main()
