"""The 8-bit update step compiled for a GPU, on a CPU: its kernels and bytes.

``quantize_state.py --sections costs`` times the update step (update and
apply) on a GPU; this compiles the same setups on the same workload
(``bench.py``'s 8.4M parameters in 64 float32 leaves, ``COST_CONFIGS`` and
``PALLAS_CONFIGS`` of ``quantize_state.py``, buffers donated) for the GPU
that ``--target`` describes, without one (``float8_traffic.py``'s deviceless
compilation), and reads each optimised program (``_hlo.Program``): its
kernels, the copies among them, and the bytes they read and write
(``Program.traffic``: each kernel's operands and results, whole) against
float32 Adam's. The flat layout's setups are left out: its leaves are
slices of one buffer, and a kernel that reads a slice counts all of it.

``adam_8bit`` lowers its Pallas kernel through Triton where JAX's default
backend is a GPU, and otherwise runs Pallas' interpreter; the default
backend is the CPU here, so the script has ``adam_8bit`` see a GPU while it
traces the Pallas setups.

``--small`` compiles a tiny workload for this machine's own CPU instead
(the kernel interpreted; what ``tests/test_update_traffic.py`` runs):
every code path but the target's; its numbers mean nothing.

Run:  python benchmarks/update_traffic.py [--small] [--target PATH] [--out PATH]
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import float8_traffic  # noqa: E402
import jax  # noqa: E402
from _harness import details, error_text, small_defaults, small_parser, table  # noqa: E402
from _hlo import Program  # noqa: E402
from _workloads import grads_like, layers  # noqa: E402

SMALL = {"layers": 1, "width": 64}


def _setups_module():
  """quantize_state.py, imported once :func:`float8_traffic.deviceless` has
  run: it asks for JAX's backend as it is imported (from this folder,
  which an importer of this module may have taken off ``sys.path``)."""
  if HERE not in sys.path:
    sys.path.append(HERE)  # last: nothing an importer has is shadowed
  import quantize_state

  return quantize_state


def setups() -> dict:
  """``{name: (dtype, make)}``: quantize_state.py's setups, but flat ones."""
  qs = _setups_module()
  configs = {**qs.COST_CONFIGS, **qs.PALLAS_CONFIGS}
  return {k: v for k, v in configs.items() if not k.endswith(qs._SLICED)}


@contextlib.contextmanager
def seeing_a_gpu(pallas: bool):
  """With ``pallas``, ``adam_8bit`` picks its GPU kernel (Triton) while the
  step is traced; otherwise nothing changes."""
  from optax_lossscale._params import adam_8bit

  if not pallas:
    yield
    return
  real = jax.default_backend
  adam_8bit.jax.default_backend = lambda: "gpu"
  try:
    yield
  finally:
    adam_8bit.jax.default_backend = real


def measure(name, dtype, make, params32, sharding, on_target):
  """One setup's compiled step: kernels, copies and bytes."""
  qs = _setups_module()
  step, params, state = qs.setup(name, dtype, make, params32)
  grads = grads_like(params32)

  def placed(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  args = jax.tree.map(placed, ((params, state), grads))
  with seeing_a_gpu(on_target and name in qs.PALLAS_CONFIGS):
    compiled = jax.jit(step, donate_argnums=0).lower(*args).compile()
  program = Program(compiled.as_text())
  kernels = program.categories()
  copies = sum(program.instructions[k].opcode == "copy" for k in kernels)
  return {"kernels": len(kernels), "copies": copies, "bytes": program.traffic()}


def report(args, argv, env_lines, n, leaves, results, t_start):
  small = " (--small: tiny, compiled for this CPU, numbers mean nothing)"
  shown = " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
  bandwidth = args.target["bandwidth"] if args.target else 1e12
  ref = results.get("float32 Adam", {}).get("bytes")
  rows = []
  for name in setups():
    r = results.get(name, {"error": "not run"})
    if "error" in r:
      rows.append([name, r["error"], "", "", "", ""])
      continue
    total = sum(r["bytes"].values())
    rows.append(
      [
        name,
        str(r["kernels"]),
        str(r["copies"]),
        f"{total / 1e6:.1f}",
        f"{total / sum(ref.values()):.2f}x" if ref else "",
        f"{total / bandwidth * 1e6:.1f}",
      ]
    )
  header = ["setup", "kernels", "copies", "MB", "vs float32 Adam", "at bandwidth, us"]
  md = [
    "# The 8-bit update step compiled for a GPU: kernels and bytes"
    + (small if args.small else ""),
    "",
    f"Made by `python benchmarks/update_traffic.py {shown}`.".replace(" `.", "`."),
    "",
    "## 1. Environment",
    "",
    *env_lines,
    "",
    "## 2. Kernels and bytes",
    "",
    f"The update step (update and apply, buffers donated) on {n:,} float32 "
    f"parameters in {leaves} leaves, compiled by XLA for "
    + (f"the {args.target['name']}" if args.target else "this CPU")
    + " and read from its optimised HLO (`_hlo.Program`). *MB*: what its "
    "kernels read and write (each kernel's operands and results, whole). "
    "*at bandwidth*: those bytes at "
    + (
      f"{bandwidth / 1e12:.2f} TB/s, the target's memory bandwidth"
      if args.target
      else "1 TB/s"
    )
    + ": a floor for a step bound by memory. *apply_gradients*: the step is "
    "`tx.apply_gradients`, whose kernel writes the parameters.",
    "",
    *table(header, rows, "lrrrrr"),
  ]
  for name, r in results.items():
    if "traceback" in r:
      md += ["", *details(name, r["traceback"])]
  md += ["", f"Total wall time: {time.perf_counter() - t_start:.1f} s."]
  return "\n".join(md) + "\n"


def parse_args(argv=None):
  parser = small_parser(__doc__.splitlines()[0], SMALL)
  add = parser.add_argument
  add("--out", default=os.path.join(HERE, "out", "update_traffic.md"), help="report")
  float8_traffic.add_target(parser)
  add("--layers", type=int, default=16, help="the workload's layers")
  add("--width", type=int, default=512, help="the layers' width")
  args = parser.parse_args(argv)
  float8_traffic.resolve_target(parser, args)
  small_defaults(parser, args, SMALL)
  if args.layers < 1 or args.width < 1:
    parser.error("--layers and --width must be at least 1")
  return args


def main(argv=None):
  args = parse_args(argv)
  float8_traffic.deviceless()
  t_start = time.perf_counter()
  env_lines, sharding = float8_traffic.compile_target(args, "update_traffic.py")
  params32 = layers(args.layers, args.width)
  n, leaves = (
    sum(p.size for p in jax.tree.leaves(params32)),
    len(jax.tree.leaves(params32)),
  )
  out = os.path.abspath(args.out)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  results = {}
  for name, (dtype, make) in setups().items():
    t0 = time.perf_counter()
    try:
      results[name] = measure(name, dtype, make, params32, sharding, bool(args.target))
    except Exception as e:  # noqa: BLE001
      traceback.print_exc()
      results[name] = {"error": error_text(e), "traceback": traceback.format_exc()}
    print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
  text = report(args, argv, env_lines, n, leaves, results, t_start)
  with open(out, "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  main()
