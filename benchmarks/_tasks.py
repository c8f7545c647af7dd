"""The training tasks the low-precision benchmarks share: two models and their data.

``lm_task``: the main example's byte-level transformer on Python's standard
library (``examples/train_lm.py``); ``mlp_task``: the earlier main example's
MLP on scikit-learn's digits (``examples/train_digits.py``). Both compute in
bfloat16 and evaluate in float32 from the stored parameters. Each returns
``(model, params, batches, loss_fn, evaluate)``; ``evaluate(params)`` gives
``(loss, accuracy)``. ``text_tokens``: that text as tokens of any vocabulary.
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(
  0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import train_digits  # noqa: E402
import train_lm  # noqa: E402

F32 = jnp.dtype(jnp.float32)


@functools.cache
def text_tokens(vocab):
  """Python's standard library (``examples/train_lm.py``'s text and tokenizer)
  as tokens of a vocabulary of ``vocab`` (256: bytes): ``(train, val)``, int32
  arrays of its first 90% and its last 10%."""
  train_text, val_text, *_ = train_lm.load_text(0.1)
  encode = train_lm.make_tokenizer(train_text, vocab)
  return encode(train_text)[0], encode(val_text)[0]


def lm_task(steps, seed, dtype=jnp.bfloat16):
  """The main example's transformer (computing in ``dtype``) and its data."""
  tokens, val = text_tokens(256)
  context = 128
  windows, val_idx = train_lm.sample(
    tokens, val, steps=steps, batch=24, context=context, eval_sequences=64, seed=seed
  )
  batches = [(w,) for w in windows]
  val_tokens = val[val_idx]
  model = train_lm.Transformer(2, 128, 4, context, 256, dtype)
  params = model.init(jax.random.key(seed), batches[0][0][:, :-1])["params"]
  loss_fn = lambda p, t: train_lm.loss_fn(model, p, t)

  @jax.jit
  def evaluate(p):
    logits = model.apply({"params": p}, val_tokens[:, :-1]).astype(F32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, val_tokens[:, 1:])
    return loss.mean(), jnp.mean(jnp.argmax(logits, -1) == val_tokens[:, 1:])

  return model, params, batches, loss_fn, evaluate


def mlp_task(steps, seed):
  """The earlier main example's MLP on the digits (computing in bfloat16)."""
  x_train, x_test, y_train, y_test = train_digits.load_data(seed)
  model = train_digits.MLP(dtype=jnp.bfloat16)
  params = model.init(jax.random.key(seed), x_train[:1])["params"]
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, len(x_train), (steps, 64))
  batches = [(x_train[i], y_train[i]) for i in idx]
  loss_fn = lambda p, x, y: train_digits.loss_fn(model, p, x, y)

  @jax.jit
  def evaluate(p):
    logits = model.apply({"params": p}, x_test).astype(F32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y_test).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == y_test)

  return model, params, batches, loss_fn, evaluate
