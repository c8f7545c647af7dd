"""The layout of block scaling: an axis cut into blocks, or two axes into tiles.

A block is ``block`` consecutive elements along one axis (zero-padded to a
whole number of blocks); a tile is a ``block`` x ``block`` square over two
axes. Each layout has its inverse, which cuts the padding back off.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["blocks", "tiles", "unblocks", "untiles"]


def blocks(x: jax.Array, axis: int, block: int) -> jax.Array:
  """``x`` with ``axis`` last, zero-padded to whole blocks, as (..., n, block)."""
  x = jnp.moveaxis(x, axis, -1)
  pad = -x.shape[-1] % block
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def tiles(x: jax.Array, axis: int, other: int, block: int) -> jax.Array:
  """``x`` as (..., n_axis, n_other, block, block) tiles over two axes."""
  x = jnp.moveaxis(x, (other, axis), (-2, -1))
  pads = [-x.shape[-2] % block, -x.shape[-1] % block]
  if any(pads):
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, p) for p in pads])
  *lead, r, c = x.shape
  x = x.reshape(*lead, r // block, block, c // block, block)
  # (..., n_other, block_other, n_axis, block_axis) -> (..., n_axis, n_other, b_o, b_a)
  return jnp.moveaxis(x, (-4, -2), (-3, -4))


def unblocks(b: jax.Array, axis: int, length: int | None = None) -> jax.Array:
  """The inverse of :func:`blocks`, cut back to ``length`` (or padded)."""
  x = b.reshape(*b.shape[:-2], b.shape[-2] * b.shape[-1])
  if length is not None:
    x = x[..., :length]
  return jnp.moveaxis(x, -1, axis)


def untiles(t: jax.Array, axis: int, other: int, shape: tuple | None = None):
  """The inverse of :func:`tiles`, cut back to ``shape`` (or padded)."""
  t = jnp.moveaxis(t, (-3, -4), (-4, -2))
  *lead, no, bo, na, ba = t.shape
  x = t.reshape(*lead, no * bo, na * ba)
  if shape is not None:
    x = x[..., : shape[other], : shape[axis]]
  return jnp.moveaxis(x, (-2, -1), (other, axis))
