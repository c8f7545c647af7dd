"""The finite check and the non-finite record hold under every XLA CPU fast-math flag.

Fast-math lets XLA assume no NaN or infinity exists: it folds ``x - x`` to 0
(the formulation this check once used) and may fold ``isnan`` to false. The
check tests exponent bits as integers instead; each flag set runs in a new
process, since XLA reads its flags when it starts.
"""

import json
import os
import subprocess
import sys

import pytest
import versions

SCRIPT = r"""
import json
import jax, jax.numpy as jnp, ml_dtypes, numpy as np, optax
import optax_lossscale as ols

out = {}
x = jnp.array([8.0, jnp.nan, jnp.inf])
# Control: the flag is in force when the old formulation is folded away.
out["x - x folded"] = bool(jnp.isfinite(jnp.sum(jax.jit(lambda x: x - x)(x))))
check = jax.jit(ols.all_finite)
verdicts = []
for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
  info = jnp.finfo(dtype)
  finite = [info.max, -info.max, info.tiny, info.smallest_subnormal, 0.0, -0.0]
  verdicts.append(bool(check(jnp.array(finite, dtype))))
  for bad in (jnp.nan, jnp.inf, -jnp.inf):
    verdicts.append(not bool(check([jnp.ones(3, dtype), jnp.array([1, bad], dtype)])))
verdicts.append(not bool(check(jnp.array([1 + 1j, complex(0, float("inf"))]))))
e4m3 = jnp.asarray(np.array([448.0, -448.0], ml_dtypes.float8_e4m3fn))
verdicts.append(bool(check(e4m3)))  # all-ones exponent, finite in this format
verdicts.append(not bool(check(e4m3.at[0].set(jnp.nan))))
# More small leaves than XLA fuses into one concatenation, one of them bad.
for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
  for bad in (jnp.nan, jnp.inf):
    leaves = [jnp.ones(i + 1, dtype) for i in range(12)]
    verdicts.append(not bool(check([*leaves, jnp.array([1, bad], dtype)])))
out["all_finite right every time"] = verdicts

# The non-finite record tells NaN from inf, in small (stacked) and large leaves.
kinds = {}
for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
  for size in (3, 5000):
    cases = (("nan", [jnp.nan]), ("inf", [-jnp.inf]), ("both", [jnp.nan, jnp.inf]))
    for name, bad in cases:
      g = np.ones(size, np.float32)
      g[: len(bad)] = bad
      kinds[f"{jnp.dtype(dtype).name}/{size}/{name}"] = jnp.asarray(g, dtype)
    kinds[f"{jnp.dtype(dtype).name}/{size}/finite"] = jnp.ones(size, dtype)
tx = ols.dynamic_loss_scale(optax.sgd(1.0), track_nonfinite=True)
record_state = tx.init(kinds)
_, record_state = jax.jit(tx.update)(kinds, record_state, kinds)
told = {leaf.path: leaf.last for leaf in ols.nonfinite_report(record_state).leaves}
out["record"] = {k: told.get(k) for k in kinds}
tx = ols.dynamic_loss_scale(optax.sgd(1.0), initial_scale=8.0)
state = tx.init({"w": jnp.ones(3)})
updates, state = jax.jit(tx.update)({"w": x}, state, {"w": jnp.ones(3)})
out["skipped"] = int(state.consecutive_skips)
out["updates"] = [float(u) for u in updates["w"]]

# Steps whose bad gradients a float computation in the same program made:
# the check reads the unscaled gradients (scales below 1 allowed), or
# gradients the backward pass computes (an overflow), leaves small and large.
applied = {}
for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
  for size in (3, 5000):
    for name, min_scale in (("unscaled", 2.0**-4), ("scaled", 1.0)):
      tx = ols.dynamic_loss_scale(
        optax.sgd(1.0), initial_scale=8.0, min_scale=min_scale
      )
      w = jnp.ones(size, dtype)
      for bad in (jnp.nan, jnp.inf):
        g = jnp.asarray(np.where(np.arange(size) == 1, bad, 1.0), dtype)
        u, s = jax.jit(tx.update)({"w": g}, tx.init({"w": w}), {"w": w})
        applied[f"{name}/{jnp.dtype(dtype).name}/{size}/{bad}"] = (
          int(s.consecutive_skips), bool(jnp.all(u["w"] == 0)))

      @jax.jit
      def train(w, x, state, tx=tx):
        g = jax.grad(lambda w: jnp.sum((w * x) ** 2).astype(jnp.float32))(w)
        u, state = tx.update(g, state, w)
        return u, state

      big = jnp.full(size, jnp.finfo(dtype).max, dtype)  # (w * x) ** 2 overflows
      u, s = train(w, big, tx.init(w))
      applied[f"backward/{name}/{jnp.dtype(dtype).name}/{size}"] = (
        int(s.consecutive_skips), bool(jnp.all(u == 0)))
out["applied"] = {k: v for k, v in applied.items() if v != (1, True)}
print(json.dumps(out))
"""

FLAGS = [
  "--xla_cpu_enable_fast_math=true",
  "--xla_cpu_fast_math_honor_nans=false",
  "--xla_cpu_fast_math_honor_infs=false",
  "--xla_cpu_fast_math_honor_division=false",
  "--xla_cpu_fast_math_honor_functions=false",
  "--xla_cpu_enable_fast_min_max=true",
  "--xla_cpu_enable_fast_math=true --xla_cpu_fast_math_honor_nans=false "
  "--xla_cpu_fast_math_honor_infs=false --xla_cpu_enable_fast_min_max=true",
]


@pytest.mark.integration
@pytest.mark.parametrize("flags", FLAGS)
def test_nonfinite_gradients_are_caught_under_fast_math(flags):
  # XLA's CPU flags: on the CPU backend, also on a machine with a GPU.
  env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run(
    [sys.executable, "-c", SCRIPT],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    check=True,
  )
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  if flags.startswith("--xla_cpu_enable_fast_math=true") and versions.JAX >= (0, 10):
    assert out["x - x folded"]  # the flag is in force (older XLAs fold less)
  assert all(out["all_finite right every time"]), out
  want = {"nan": "NaN", "inf": "inf", "both": "NaN and inf", "finite": None}
  assert out["record"] == {k: want[k.split("/")[-1]] for k in out["record"]}, out
  assert out["skipped"] == 1 and out["updates"] == [0.0, 0.0, 0.0], out
  assert out["applied"] == {}, out["applied"]  # every bad step skipped
