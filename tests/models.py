"""Small Flax models the autocast tests rewrite.

Imported by the test modules, which skip without Flax before importing it.
"""

import jax.numpy as jnp
import pytest

nn = pytest.importorskip("flax.linen", reason="the models are Flax's")


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(2):
      x = nn.relu(nn.Dense(64)(x))
    return nn.Dense(10)(x)


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(8, (3, 3))(x))
    x = nn.BatchNorm(use_running_average=True)(x)
    return nn.Dense(10)(x.reshape(x.shape[0], -1))


class Attention(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = x + nn.MultiHeadDotProductAttention(num_heads=2)(nn.LayerNorm()(x))
    return nn.Dense(10)(nn.LayerNorm()(x).mean(1))


class Cell(nn.Module):
  @nn.compact
  def __call__(self, c, x):
    c = nn.tanh(nn.Dense(16)(c) + x)
    return c, c


class ScanRemat(nn.Module):
  @nn.compact
  def __call__(self, x):
    scan = nn.scan(
      nn.remat(Cell),
      variable_broadcast="params",
      split_rngs={"params": False},
      in_axes=1,
      out_axes=1,
    )
    _, ys = scan()(jnp.zeros((x.shape[0], 16)), x)
    return nn.Dense(10)(ys.mean(1))
