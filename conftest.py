"""Doctest collection: modules whose examples need what an install may lack.

optax_lossscale/flax.py needs Flax (the `examples` extra); the block-scaled
formats need a JAX with float8_e8m0fnu and float4_e2m1fn.
"""

import importlib.util

import jax.numpy as jnp

collect_ignore = [] if importlib.util.find_spec("flax") else ["optax_lossscale/flax.py"]
if not (hasattr(jnp, "float8_e8m0fnu") and hasattr(jnp, "float4_e2m1fn")):
  collect_ignore.append("optax_lossscale/_block_scaled.py")
