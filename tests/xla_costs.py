"""What XLA's deterministic cost figures should show, for the proxy tests."""

import jax

from optax_lossscale._core import FINITE_CHECK_CHUNK


def check_scratch(grads):
  """Bytes the finite check writes: one leaf's bits per chunk of leaves.

  XLA's CPU backend writes out the input of an integer reduction before it
  reduces it, so the elementwise maximum of each chunk's exponent bits (the
  size of one of its leaves) is written once and read once.
  """
  groups = {}
  for g in jax.tree.leaves(grads):
    groups.setdefault((g.size, g.dtype), []).append(g.nbytes)
  chunk = FINITE_CHECK_CHUNK
  return sum(-(-len(n) // chunk) * n[0] for n in groups.values())
