"""Half-precision values are taken at their own precision, under jit as eagerly.

XLA may compute a bfloat16 or float16 value in float32 and drop the
rounding to half precision where a float32 use follows it in the same
program ("excess precision", on by default), so ``x.astype(float32)`` of a
half-precision update or gradient made in the same jitted step can read a
value the array never held. Every place the package widens a half leaf
(``_tree.widen``: the unscale, the rounding transformations,
``master_weights``) reads the leaf's bits instead.

Axes: the entry point (``stochastic_rounding``, ``kahan_summation``,
``master_weights`` both stores, ``ema_params``' average of the parameters
the step makes, ``dynamic_loss_scale`` unscaling into the
leaf's dtype and into float32) x the half dtype (bfloat16, float16), the
half values made in the step itself (an SGD step or a gradient multiplied
in half precision): the jitted step equals the eager one, bit for bit.

What XLA's compiled arithmetic does besides: it fuses a multiply and the add
after it into one instruction that rounds once (an FMA) wherever the CPU has
one for the dtype: float32 on every x86 CPU with FMA, float16 only on a CPU
with float16 arithmetic (AVX512-FP16), bfloat16 nowhere. TensorFlow rounds
the product first, so the porting package's float16 steps on such a CPU come
out a unit of float16 apart from TensorFlow's (``docs/guides/porting.md``).
"""

import os
import pathlib
import platform
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import optax_lossscale as ols
from optax_lossscale._base import tree as _tree

pytestmark = pytest.mark.standard_promotion  # optax's sgd on half updates


def _data(dtype, n=2048):
  rng = np.random.default_rng(0)
  p = jnp.asarray(rng.standard_normal(n), dtype)
  g = jnp.asarray(rng.standard_normal(n), dtype)
  return {"w": p}, {"w": g}


def _rounding(make):
  tx = optax.chain(optax.sgd(0.37), make())  # sgd's update: half * 0.37, in half

  def step(p, g):
    updates, _ = tx.update(g, tx.init(p), p)
    return optax.apply_updates(p, updates)

  return step


def _master(store):
  tx = ols.master_weights(optax.sgd(1.0), store=store)

  def step(p, g):
    g = jax.tree.map(lambda x: x * jnp.asarray(0.37, x.dtype), g)  # in half
    updates, _ = tx.update(g, tx.init(p), p)
    return optax.apply_updates(p, updates)

  return step


def _loss_scale(inner):
  tx = ols.dynamic_loss_scale(inner, initial_scale=3.0)

  def step(p, g):
    g = jax.tree.map(lambda x: x * jnp.asarray(0.37, x.dtype), g)  # in half
    updates, _ = tx.update(g, tx.init(p), p)
    return updates

  return step


def _ema():
  tx = optax.chain(optax.sgd(0.37), ols.ema_params(0.9))  # sgd's update in half

  def step(p, g):
    updates, state = tx.update(g, tx.init(p), p)
    return updates, ols.get_ema_params(state)

  return step


STEPS = {
  "stochastic_rounding": lambda dtype: _rounding(lambda: ols.stochastic_rounding(0)),
  "kahan_summation": lambda dtype: _rounding(ols.kahan_summation),
  "master_weights remainder": lambda dtype: _master("remainder"),
  "master_weights float32": lambda dtype: _master("float32"),
  "ema_params": lambda dtype: _ema(),
  "dynamic_loss_scale": lambda dtype: _loss_scale(optax.sgd(1.0)),
  "dynamic_loss_scale(master_weights)": lambda dtype: _loss_scale(
    ols.master_weights(
      optax.sgd(1.0), store="remainder" if dtype == jnp.bfloat16 else "float32"
    )
  ),
}


@pytest.mark.sampled
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", STEPS)
def test_jit_equals_eager_bit_for_bit(name, dtype):
  if name == "master_weights remainder" and dtype == jnp.float16:
    pytest.skip("refused: a float16 is not a float32's high half")
  step = STEPS[name](dtype)
  p, g = _data(dtype)
  eager, jitted = step(p, g), jax.jit(step)(p, g)
  for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), name
  if name == "ema_params":  # the first average: the parameters the update makes
    updates, ema = jitted
    new = np.asarray(optax.apply_updates(p, updates)["w"], np.float32)
    assert np.asarray(ema["w"]).tobytes() == new.tobytes()


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_widen_is_numpys_cast_for_every_bit_pattern(dtype):
  x = np.arange(2**16, dtype=np.uint16).view(dtype)
  want = x.astype(np.float32)
  for widen in (_tree.widen, jax.jit(_tree.widen)):
    got = np.asarray(widen(jnp.asarray(x)))
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


def _float16_arithmetic():
  """Whether XLA:CPU computes float16 natively here: an x86 CPU with
  AVX512-FP16, XLA not capped below AVX-512 (``--xla_cpu_max_isa``)."""
  cpuinfo = pathlib.Path("/proc/cpuinfo")
  if platform.machine() not in ("x86_64", "AMD64") or not cpuinfo.exists():
    pytest.skip("reads the x86 CPU's instruction sets from /proc/cpuinfo")
  flags = re.search(r"^flags\s*:(.*)$", cpuinfo.read_text(), re.M).group(1).split()
  cap = re.search(r"--xla_cpu_max_isa=(\w+)", os.environ.get("XLA_FLAGS", ""))
  capped = cap is not None and cap.group(1).upper() in ("SSE4_2", "AVX", "AVX2")
  return "avx512_fp16" in flags and not capped


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_xla_rounds_a_multiply_add_once_where_the_cpu_has_an_fma_for_it(dtype):
  if jax.default_backend() != "cpu":
    pytest.skip("XLA:CPU's code")
  fused_here = _float16_arithmetic() if dtype == np.float16 else dtype == np.float32
  rng = np.random.default_rng(0)
  a, b, c = (rng.standard_normal(4096).astype(dtype) for _ in range(3))
  wide = [x.astype(np.float64) for x in (a, b, c)]  # exact for these magnitudes
  once = (wide[0] * wide[1] + wide[2]).astype(dtype)
  twice = (a * b).astype(dtype) + c  # numpy: each operation rounded
  assert np.count_nonzero(once != twice) > 100  # the two roundings differ here
  got = np.asarray(jax.jit(lambda a, b, c: a * b + c)(a, b, c))
  assert got.tobytes() == (once if fused_here else twice).tobytes()
