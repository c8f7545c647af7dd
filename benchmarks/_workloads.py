"""The update-step workload most benchmarks share, and its reference steps.

An 8.4M-parameter float32 tree in 64 leaves (the weights and biases of a
16-layer MLP), gradients like it, and the update steps timed on it: bare
``optax.adam``, the same plus a finite check nothing waits on, and
``dynamic_loss_scale(adam)``. Each step maker returns ``(step, carry,
grads)``, what :func:`_harness.measure_many` takes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import optax_lossscale as ols

SCALE = 2.0**10
LR = 1e-3


def layers(n_layers=16, width=512, dtype=jnp.float32):
  """64 leaves, 8.4M parameters: the weights and biases of a 16-layer MLP."""
  keys = jax.random.split(jax.random.key(0), 2 * n_layers)
  params = {}
  for i in range(n_layers):
    params[f"layer{i:02d}"] = {
      "w1": jax.random.normal(keys[2 * i], (width, width), dtype) / 32,
      "b1": jnp.zeros((width,), dtype),
      "w2": jax.random.normal(keys[2 * i + 1], (width, width), dtype) / 32,
      "b2": jnp.zeros((width,), dtype),
    }
  return params


def grads_like(params, seed=1):
  """Normal gradients of ``params``' shapes and dtypes, times 1e-3."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten(
    [
      jax.random.normal(k, x.shape, x.dtype) * 1e-3
      for k, x in zip(keys, leaves, strict=True)
    ]
  )


def scaled(grads):
  """``grads`` times :data:`SCALE`, in their dtypes."""
  return jax.tree.map(lambda g: (g.astype(jnp.float32) * SCALE).astype(g.dtype), grads)


def plain(tx, params, grads):
  """The update step (update + apply) of any transformation ``tx``."""

  def step(carry, g):
    p, s = carry
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return step, (params, tx.init(params)), grads


def bare_adam(params, grads):
  return plain(optax.adam(LR), params, grads)


def bare_adam_and_read(params, grads, check=ols.all_finite):
  """Bare Adam, plus ``check(grads)`` as an extra output nothing depends on.

  Not loss scaling: the floor of any design that reads the gradients once
  more. Its cost over bare Adam is what that one read costs on the machine.
  """
  step, (p, s), g = bare_adam(params, grads)

  def read_too(carry, g):
    p, s = step(carry[:2], g)
    return p, s, check(g)

  return read_too, (p, s, check(g)), g


def ours(params, grads, tx=None):
  """``dynamic_loss_scale(adam)`` (or ``tx``) fed ``grads`` scaled by SCALE."""
  tx = tx or ols.dynamic_loss_scale(optax.adam(LR), initial_scale=SCALE)
  return plain(tx, params, scaled(grads))
