"""Doctest collection: modules whose examples need what an install may lack.

optax_lossscale/flax.py needs Flax (the `examples` extra); the block-scaled
formats (and list_matmuls' NVFP4 example) need a JAX with float8_e8m0fnu and
float4_e2m1fn; quantize_state's and adam_8bit's examples run optax's adam under
strict dtype promotion, which optax releases may not be written for.
"""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import optax


def _adam_is_strict() -> bool:
  params = {"w": jnp.ones(2)}
  tx = optax.adam(1e-3)
  try:
    with jax.numpy_dtype_promotion("strict"):
      tx.update(params, tx.init(params), params)
  except Exception:  # noqa: BLE001 -- any failure: the example cannot run
    return False
  return True


collect_ignore = [] if importlib.util.find_spec("flax") else ["optax_lossscale/flax.py"]
if not (hasattr(jnp, "float8_e8m0fnu") and hasattr(jnp, "float4_e2m1fn")):
  collect_ignore += [
    "optax_lossscale/_lowbit/block_scaled.py",
    "optax_lossscale/_autocast/matmul_list.py",
  ]
if not _adam_is_strict():
  collect_ignore += [
    "optax_lossscale/_params/quantize_state.py",
    "optax_lossscale/_params/adam_8bit.py",
  ]

# A path that names no file would leave its doctests collected where they
# cannot run (a module moved, this list not).
_HERE = pathlib.Path(__file__).parent
_missing = [p for p in collect_ignore if not (_HERE / p).is_file()]
assert not _missing, f"conftest.py ignores files that do not exist: {_missing}"
