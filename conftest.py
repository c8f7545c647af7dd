"""Doctest collection: modules whose examples need what an install may lack.

optax_lossscale/flax.py needs Flax (the `examples` extra); the block-scaled
formats (and list_matmuls' NVFP4 example) need a JAX with float8_e8m0fnu and
float4_e2m1fn; quantize_state's example runs optax's adam under strict dtype
promotion, which older optax releases are not written for.
"""

import importlib.util

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
    "optax_lossscale/_block_scaled.py",
    "optax_lossscale/_matmul_list.py",
  ]
if not _adam_is_strict():
  collect_ignore.append("optax_lossscale/_quantize_state.py")
