"""Doctest collection: optax_lossscale/flax.py needs Flax (the `examples` extra)."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("flax") else ["optax_lossscale/flax.py"]
