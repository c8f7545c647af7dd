"""Loss scaling across processes: jax.distributed on one machine, a NaN in one shard.

Several processes on localhost, each holding its own CPU devices, form one
global mesh with ``jax.distributed.initialize`` and JAX's CPU collectives
(gloo). They train the main example's MLP data-parallel under
``dynamic_loss_scale``: the global batch is sharded over every device of
every process, parameters and optimizer state are replicated. At the
``--nan-at`` steps one process's shard of the batch (only that process's
data) gets a NaN. The run then checks that:

* every process skipped the same steps and held the same scale and counters
  after every step, and the same record of where the gradients were not
  finite (``track_nonfinite=True``: which leaves, NaN or inf), although only
  one process's data held the NaN;
* the parameters equal those of a single-process run of the same global
  batch, to 1e-4 of each leaf's largest entry (the gradients are summed in
  another order);
* a checkpoint written by all processes with Orbax at ``--save-at``,
  restored in a single process, equals the state the processes held there,
  bit for bit.

One command runs it all (the workers, the single-process reference, the
comparison) and exits 1 if any check fails:

  python examples/multi_process.py --processes 2

What it launches, one command per process (start the workers together):

  python examples/multi_process.py --worker 0 --processes 2 --port 12355 --out DIR
  python examples/multi_process.py --worker 1 --processes 2 --port 12355 --out DIR
  python examples/multi_process.py --reference --out DIR
  python examples/multi_process.py --compare --processes 2 --out DIR

On several machines, give each worker the coordinator's address instead of
127.0.0.1 (``--coordinator HOST``) and a shared ``--out`` directory.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

import _cli


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  role = p.add_mutually_exclusive_group()
  role.add_argument(
    "--worker", type=int, metavar="I", help="run as process I of --processes"
  )
  role.add_argument(
    "--reference", action="store_true", help="run the single-process reference"
  )
  role.add_argument(
    "--compare", action="store_true", help="compare the runs written to --out"
  )
  count = _cli.int_at_least(1)
  p.add_argument("--processes", type=count, default=2, help="number of processes")
  p.add_argument(
    "--local-devices", type=count, default=2, help="CPU devices in each process"
  )
  p.add_argument("--coordinator", default="127.0.0.1", help="process 0's address")
  p.add_argument(
    "--port",
    type=_cli.int_in(0, 65535),
    default=0,
    help="coordinator port (0: pick a free one)",
  )
  p.add_argument("--steps", type=count, default=30, help="training steps")
  p.add_argument(
    "--batch",
    type=count,
    default=64,
    help="global batch (a multiple of all devices: processes x local devices)",
  )
  p.add_argument(
    "--nan-at",
    type=_cli.steps_list,
    default="4,5,17",
    help="steps whose batch gets a NaN (comma list, each below --steps)",
  )
  p.add_argument(
    "--bad-process",
    type=_cli.int_at_least(0),
    default=1,
    help="the process whose shard gets it (below --processes)",
  )
  p.add_argument(
    "--growth-interval", type=count, default=4, help="finite steps before growth"
  )
  p.add_argument(
    "--save-at",
    type=count,
    default=20,
    help="step after which to checkpoint (at most --steps)",
  )
  p.add_argument(
    "--out",
    type=_cli.directory,
    default=_cli.default_out("multi_process"),
    help="directory for results and checkpoint (shared by all processes)",
  )
  p.add_argument("--timeout", type=count, default=300, help="seconds per process")
  args = p.parse_args(argv)
  for ok, message in (
    (
      args.worker is None or 0 <= args.worker < args.processes,
      f"--worker ({args.worker}) must be in [0, --processes = {args.processes})",
    ),
    (
      args.bad_process < args.processes,
      f"--bad-process ({args.bad_process}) must be below --processes "
      f"({args.processes})",
    ),
    (
      args.batch % (args.processes * args.local_devices) == 0,
      f"--batch ({args.batch}) must be a multiple of all devices "
      f"({args.processes} processes x {args.local_devices} = "
      f"{args.processes * args.local_devices})",
    ),
    (
      all(s < args.steps for s in args.nan_at),
      f"--nan-at steps {args.nan_at} must be below --steps ({args.steps})",
    ),
    (
      args.save_at <= args.steps,
      f"--save-at ({args.save_at}) must be at most --steps ({args.steps})",
    ),
  ):
    _cli.require(p, ok, message)
  try:
    socket.getaddrinfo(args.coordinator, None)
  except OSError as e:
    p.error(f"--coordinator {args.coordinator!r} is not an address: {e}")
  return args


def check_inputs(args):
  """Exits 2, naming what is missing, unless the files ``args`` reads exist.

  Apart from :func:`parse_args`: the arguments of a command are checked when
  it is written, the files it reads only when it runs, after the steps that
  make them.
  """
  if args.compare:
    needed = [f"process{i}.npz" for i in range(args.processes)] + ["reference.npz"]
    missing = [n for n in needed if not os.path.isfile(os.path.join(args.out, n))]
    _cli.missing(
      missing,
      f"--compare needs the runs' results in --out ({args.out}), missing "
      f"{', '.join(missing)}: run the workers and --reference there first",
    )


args = parse_args(sys.argv[1:]) if __name__ == "__main__" else None
if args is not None and args.worker is not None:
  # Each worker's simulated CPU devices, requested before JAX starts.
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={args.local_devices}"
  )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from train_digits import MLP, load_data, loss_fn  # noqa: E402

import optax_lossscale as ols  # noqa: E402

COUNTERS = ("loss_scale", "good_steps", "skipped_steps", "consecutive_skips")
#: The non-finite record's fields compared: per leaf, and the loss.
RECORD = ("leaf_nan_steps", "leaf_inf_steps", "last_leaves", "loss_steps")


def local(x):
  """This process's copy of a replicated array, as NumPy."""
  return np.asarray(x.addressable_data(0))


def train(args, process, processes):
  """The training loop, the same in every worker and in the reference."""
  import orbax.checkpoint as ocp

  n = jax.device_count()
  if args.batch % n:
    raise SystemExit(f"--batch must be a multiple of the {n} devices")
  mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  nan_at = set(args.nan_at)

  x_train, _, y_train, _ = load_data(0)
  model = MLP(dtype=jnp.float32)
  params = model.init(jax.random.key(0), x_train[:1])["params"]
  tx = ols.dynamic_loss_scale(
    optax.adam(1e-3),
    initial_scale=2.0**10,
    growth_interval=args.growth_interval,
    track_nonfinite=True,
  )
  params = jax.device_put(params, replicated)
  opt_state = jax.jit(tx.init, out_shardings=replicated)(params)

  @jax.jit
  def step(params, opt_state, x, y):
    loss, grads = ols.value_and_grad(lambda p: loss_fn(model, p, x, y))(
      opt_state, params
    )
    updates, opt_state = tx.update(grads, opt_state, params, value=loss)
    return optax.apply_updates(params, updates), opt_state, loss

  rows = args.batch // processes  # this process's rows of the global batch
  bad_row = args.bad_process * (args.batch // args.processes)
  rng = np.random.default_rng(0)  # every process draws the same global batch
  history = {k: [] for k in ("loss", "scale_used", *COUNTERS, *RECORD, "agree")}
  for i in range(args.steps):
    idx = rng.integers(0, len(x_train), args.batch)
    x, y = x_train[idx], y_train[idx]
    if i in nan_at:  # a NaN in the rows that --bad-process holds
      x = x.copy()
      x[bad_row, 0] = np.nan
    mine = slice(process * rows, (process + 1) * rows)
    x = jax.make_array_from_process_local_data(sharded, x[mine])
    y = jax.make_array_from_process_local_data(sharded, y[mine])
    history["scale_used"].append(local(opt_state.loss_scale))
    params, opt_state, loss = step(params, opt_state, x, y)
    history["loss"].append(local(loss))
    d = ols.diagnostics(opt_state)
    d.update({k: getattr(opt_state.nonfinite, k) for k in RECORD})
    # What each of this process's devices holds: they must agree.
    per_device = [
      [np.asarray(s.data) for s in d[k].addressable_shards]
      for k in (*COUNTERS, *RECORD)
    ]
    history["agree"].append(
      all(all(np.array_equal(v, vs[0]) for v in vs) for vs in per_device)
    )
    for k, vs in zip((*COUNTERS, *RECORD), per_device, strict=True):
      history[k].append(vs[0])
    if i + 1 == args.save_at and processes > 1:
      checkpointer = ocp.StandardCheckpointer()
      checkpointer.save(os.path.join(args.out, "ckpt"), (params, opt_state), force=True)
      checkpointer.wait_until_finished()
      saved = jax.tree.map(local, (params, opt_state))
  out = {f"history/{k}": np.asarray(v) for k, v in history.items()}
  flat, _ = jax.tree_util.tree_flatten_with_path(jax.tree.map(local, params))
  out.update({f"params{jax.tree_util.keystr(p)}": v for p, v in flat})
  if processes > 1 and args.steps >= args.save_at:
    leaves = jax.tree.leaves(saved)
    out.update({f"saved/{j}": v for j, v in enumerate(leaves)})
  return out, (params, opt_state)


def worker(args):
  os.makedirs(args.out, exist_ok=True)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"{args.coordinator}:{args.port}",
    num_processes=args.processes,
    process_id=args.worker,
  )
  out, _ = train(args, jax.process_index(), jax.process_count())
  np.savez(os.path.join(args.out, f"process{args.worker}.npz"), **out)
  print(
    f"process {args.worker}: {jax.local_device_count()} of {jax.device_count()} "
    "devices, done",
    flush=True,
  )


def reference(args):
  os.makedirs(args.out, exist_ok=True)
  import orbax.checkpoint as ocp

  out, fresh = train(args, 0, 1)
  # The workers' checkpoint, restored in this one process.
  path = os.path.join(args.out, "ckpt")
  if os.path.exists(path):
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh)
    restored = ocp.StandardCheckpointer().restore(path, target)
    leaves = jax.tree.leaves(jax.device_get(restored))
    out.update({f"restored/{j}": np.asarray(v) for j, v in enumerate(leaves)})
  np.savez(os.path.join(args.out, "reference.npz"), **out)


def compare(args):
  """Prints the checks; returns the number that failed."""
  runs = [
    np.load(os.path.join(args.out, f"process{i}.npz")) for i in range(args.processes)
  ]
  ref = np.load(os.path.join(args.out, "reference.npz"))
  nan_at = sorted(args.nan_at)
  hist = lambda run, k: run[f"history/{k}"]  # noqa: E731
  skipped = np.diff(hist(ref, "skipped_steps"), prepend=0) > 0
  print("scale: the loss scale the step's gradients were computed with (the same")
  print("in every process and in the reference, as checked below)")
  print(f"{'step':>5} {'scale':>12} {'skipped':>8}")
  for i in range(len(skipped)):
    note = f"  <- NaN in process {args.bad_process}'s shard" if i in nan_at else ""
    scale = hist(ref, "scale_used")[i]
    print(f"{i:>5} {scale:>12.0f} {'yes' if skipped[i] else 'no':>8}{note}")
  checks = {
    "every device of every process agreed at every step": all(
      hist(r, "agree").all() for r in runs
    ),
    "every process holds the reference's scale and counters after every step": all(
      np.array_equal(hist(r, k), hist(ref, k))
      for r in runs
      for k in ("scale_used", *COUNTERS)
    ),
    "the steps skipped are exactly the NaN steps": list(np.flatnonzero(skipped))
    == nan_at,
    # The NaN input reached the loss and the kernels' gradients (not the
    # biases': relu's gradient at NaN is 0) on those steps, and only then.
    "every process holds the reference's non-finite record after every step": all(
      np.array_equal(hist(r, k), hist(ref, k)) for r in runs for k in RECORD
    )
    and int(hist(ref, "leaf_nan_steps")[-1].max()) == len(nan_at)
    and int(hist(ref, "loss_steps")[-1]) == len(nan_at),
    # The gradients are summed in another order over 4 devices than on one,
    # and Adam turns float32 rounding differences of near-zero gradients into
    # steps of the learning rate's size: compared to each leaf's largest entry.
    "parameters equal the single-process run's (to 1e-4 of each leaf's largest)": all(
      np.max(np.abs(r[k] - ref[k])) <= 1e-4 * np.max(np.abs(ref[k]))
      for r in runs
      for k in ref.files
      if k.startswith("params")
    ),
  }
  restored = sorted(k for k in ref.files if k.startswith("restored/"))
  saved = sorted(k for k in runs[0].files if k.startswith("saved/"))
  checks["the checkpoint restored in one process is bit-identical"] = (
    bool(restored)
    and len(restored) == len(saved)
    and all(
      np.array_equal(ref[a], runs[0][b]) for a, b in zip(restored, saved, strict=True)
    )
  )
  for name, ok in checks.items():
    print(f"{'ok    ' if ok else 'FAILED'} {name}")
  return sum(not ok for ok in checks.values())


def launch(args):
  """Starts the workers and the reference, waits, and compares."""
  os.makedirs(args.out, exist_ok=True)
  port = args.port
  if not port:
    with socket.socket() as s:
      s.bind((args.coordinator, 0))
      port = s.getsockname()[1]
  common = [
    "--processes", args.processes, "--local-devices", args.local_devices,
    "--steps", args.steps, "--batch", args.batch,
    "--nan-at", ",".join(map(str, args.nan_at)),
    "--bad-process", args.bad_process, "--growth-interval", args.growth_interval,
    "--save-at", args.save_at, "--out", args.out,
  ]  # fmt: skip
  me = [sys.executable, os.path.abspath(__file__)]
  workers = [
    subprocess.Popen([*me, "--worker", str(i), "--port", str(port), *map(str, common)])
    for i in range(args.processes)
  ]
  try:
    codes = [w.wait(timeout=args.timeout) for w in workers]
  finally:
    for w in workers:
      w.kill()
  if any(codes):
    raise SystemExit(f"a worker failed (exit codes {codes})")
  subprocess.run(
    [*me, "--reference", *map(str, common)], check=True, timeout=args.timeout
  )
  return compare(args)


if __name__ == "__main__":
  check_inputs(args)
  if args.worker is not None:
    worker(args)
  elif args.reference:
    reference(args)
  elif args.compare:
    raise SystemExit(1 if compare(args) else 0)
  else:
    raise SystemExit(1 if launch(args) else 0)
