"""Low-precision parameters that keep small updates: stochastic rounding, Kahan sums.

A bfloat16 weight keeps 8 significant bits (float16: 11), so
``optax.apply_updates``, which rounds ``p + u`` to the nearest value of the
parameter's dtype, drops every update smaller than half a unit in the last
place of the weight: a bfloat16 1.0 does not move for any ``|u| <= 2**-9``.
Two transformations keep such updates without a float32 copy of the
parameters; each goes last in an ``optax.chain``:

* :func:`stochastic_rounding` rounds ``p + u`` up or down at random, so that
  the new parameter equals ``p + u`` on average;
* :func:`kahan_summation` rounds to nearest and keeps what the rounding lost
  in a buffer of the parameter's dtype, added back at the next step.

Both round with ``_rounding.round_to`` and return, for each bfloat16/float16
parameter, the float32 update of ``_rounding.exact_update``, which
``optax.apply_updates`` turns into exactly the rounded value (its docstring
says when). Other leaves pass unchanged.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_lossscale._base import opt_state as _opt_state
from optax_lossscale._base import tree as _tree
from optax_lossscale._base.rounding import draw, exact_update, is_half, round_to

__all__ = [
  "KahanSummationState",
  "StochasticRoundingState",
  "kahan_summation",
  "stochastic_rounding",
]

_F32 = jnp.dtype(jnp.float32)

# --------------------------------------------------------------------------
# Leaves of the updates, with the matching leaves of other trees.
# --------------------------------------------------------------------------


def _is_none(x: Any) -> bool:
  return x is None


def zip_leaves(name: str, updates: Any, params: Any, *others: Any) -> tuple:
  """``(treedef, paths, rows)``: each leaf of ``updates`` (``None`` included)
  with its key path and the matching leaves of ``params`` and ``others``.

  Raises:
    ValueError: the parameters' tree does not match the updates', or a
      bfloat16/float16 parameter's update is not an array or has another
      shape.
  """
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(updates, is_leaf=_is_none)
  columns = []
  for i, tree in enumerate((params, *others)):
    try:
      columns.append(treedef.flatten_up_to(tree))
    except (ValueError, TypeError):
      what = "parameters'" if i == 0 else "state's"
      hint = "" if i == 0 else " It was made for other parameters: init it on these."
      raise ValueError(
        f"{name}: the {what} tree does not match the updates'.{hint}\n"
        f"  updates: {_tree.short(treedef)}\n"
        f"  {'params' if i == 0 else 'state'}:  {_tree.short(jax.tree.structure(tree))}"
      ) from None
  paths = [jax.tree_util.keystr(path) or "<root>" for path, _ in with_paths]
  rows = list(zip([u for _, u in with_paths], *columns, strict=True))
  for path, (u, p, *_) in zip(paths, rows, strict=True):
    if is_half(p) and u is not None and not _tree.is_array(u):
      raise ValueError(
        f"{name}: the update at {path} is a {type(u).__name__} ({u!r}), not an "
        "array: it would be added by rounding to nearest, unseen. Make it an "
        "array (jnp.asarray)."
      )
    if is_half(p) and _tree.is_array(u) and u.shape != p.shape:
      raise ValueError(
        f"{name}: the update at {path} has shape {u.shape} but the "
        f"parameter has shape {p.shape}."
      )
  return treedef, paths, rows


def needs_params(name: str, params: Any) -> None:
  if params is None:
    raise ValueError(
      f"{name} needs the parameters: call update(updates, state, params)."
    )


# --------------------------------------------------------------------------
# Stochastic rounding.
# --------------------------------------------------------------------------


class StochasticRoundingState(NamedTuple):
  """State of :func:`stochastic_rounding`.

  Attributes:
    rounding_key: the key of the next update as raw key data (uint32, shape
      ``(2,)`` for the default threefry keys; ``jax.random.key_data``), so
      that checkpointers and ``optax.tree`` utilities see a plain array.
  """

  rounding_key: jax.Array


def _key_data(key: Any) -> tuple[jax.Array, Any]:
  """``(raw key data, PRNG implementation)`` of a typed key, raw key or seed."""
  bad = ValueError(
    "`key` must be one PRNG key (jax.random.key(seed)), a raw uint32 key "
    f"(jax.random.PRNGKey(seed)) or an integer seed, got {key!r}."
  )
  if isinstance(key, (bool, np.bool_)):
    raise bad
  if isinstance(key, (numbers.Integral, np.integer)):
    try:
      typed = jax.random.key(int(key))
    except (OverflowError, TypeError, ValueError):
      raise bad from None
  elif isinstance(key, (jax.Array, np.ndarray)):
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
      typed = key
    elif key.dtype == np.uint32 and key.ndim >= 1:
      try:
        typed = jax.random.wrap_key_data(key)
      except (TypeError, ValueError):
        raise bad from None
    elif key.ndim == 0 and jnp.issubdtype(key.dtype, jnp.integer):
      typed = jax.random.key(key)
    else:
      raise bad
  else:
    raise bad
  if typed.shape != ():
    raise ValueError(f"`key` must be a single key, got a batch of shape {typed.shape}.")
  return jax.random.key_data(typed), jax.random.key_impl(typed)


def stochastic_rounding(key: Any) -> optax.GradientTransformation:
  """Rounds each bfloat16/float16 parameter's new value stochastically.

  Put it last in a chain, where the updates are final:
  ``optax.chain(optax.adamw(lr), ols.stochastic_rounding(jax.random.key(0)))``.
  For each parameter ``p`` of dtype bfloat16 or float16, with update ``u``
  and ``x = float32(p) + float32(u)``, the new parameter is ``x`` rounded
  to ``p``'s dtype, up or down at random so that its expected value is
  ``x`` (:func:`round_to`): an update far below the weight's resolution
  still moves it, on average, by the right amount. The update returned is
  float32, and ``optax.apply_updates`` turns it into exactly the rounded
  value (:func:`exact_update` says when: all but steps that shrink a weight
  by more than 2**15, or 2**12 in float16). Other leaves (float32, float64,
  integers, ``None``) keep their updates as they are.

  The random numbers: each ``update`` splits the state's key into the next
  state's key and this step's key; for each leaf, this step's key folded in
  with the leaf's index in the flattened update tree keys Threefry-2x32
  (JAX's PRNG hash) of each entry's row and column (``_rounding.draw``):
  one random integer per entry, 16 bits for bfloat16, 32 for float16,
  computed where it is used, so that no array of random numbers is stored.
  :func:`round_to` adds it below the bits the dtype keeps and truncates, one
  elementwise pass. The key is in the state, so a run resumed from a
  checkpoint repeats the same rounding, and under a loss scale a skipped
  step keeps it. Under ``jax.jit`` the numbers drawn for an array do not
  depend on its sharding; inside ``shard_map`` or ``pmap`` each device
  would draw the same numbers for its own shard.

  Args:
    key: the first key: a typed key (``jax.random.key``), a raw uint32 key
      (``jax.random.PRNGKey``) or an integer seed.

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`StochasticRoundingState`; its ``update`` needs ``params``.

  Raises:
    ValueError: ``key`` is none of the above, or ``update`` is called
      without ``params`` or with parameters that do not match the updates.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_lossscale as ols
    >>> tx = optax.chain(optax.sgd(1e-3), ols.stochastic_rounding(jax.random.key(0)))
    >>> params = {"w": jnp.ones(10_000, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones(10_000)}, state, params)
    >>> w = (params["w"].astype(jnp.float32) + updates["w"]).astype(jnp.bfloat16)
    >>> sorted(set(w.tolist()))  # w = optax.apply_updates(params, updates)["w"]
    [0.99609375, 1.0]
    >>> round(float(w.astype(jnp.float32).mean()), 3)  # to nearest: 1.0
    0.999
  """
  data, impl = _key_data(key)

  def init_fn(params):
    del params
    return StochasticRoundingState(rounding_key=jnp.array(data, copy=True))

  def update_fn(updates, state, params=None):
    needs_params("stochastic_rounding", params)
    _opt_state.check_state_type("stochastic_rounding", state, StochasticRoundingState)
    key_data = state.rounding_key
    if getattr(key_data, "shape", None) != data.shape or key_data.dtype != data.dtype:
      raise ValueError(
        f"stochastic_rounding: the state's key is {getattr(key_data, 'dtype', None)}"
        f"{list(getattr(key_data, 'shape', []))}, this transformation's key data "
        f"is {data.dtype}{list(data.shape)}: the state was made with a key of "
        "another PRNG implementation. Init it with this transformation."
      )
    treedef, _, rows = zip_leaves("stochastic_rounding", updates, params)
    typed = jax.random.wrap_key_data(state.rounding_key, impl=impl)
    next_key, step_key = jax.random.split(typed)

    def one(i, u, p):
      if not (is_half(p) and _tree.is_float_array(u)):
        return u
      bits = draw(jax.random.fold_in(step_key, i), p.shape, p.dtype)
      new = round_to(_tree.widen(p) + _tree.widen(u).astype(_F32), p.dtype, bits)
      return exact_update(new, p)

    new_updates = [one(i, u, p) for i, (u, p) in enumerate(rows)]
    return (
      jax.tree.unflatten(treedef, new_updates),
      StochasticRoundingState(rounding_key=jax.random.key_data(next_key)),
    )

  return optax.GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------
# Compensated (Kahan) summation.
# --------------------------------------------------------------------------


class KahanSummationState(NamedTuple):
  """State of :func:`kahan_summation`.

  Attributes:
    compensation: the parameters' tree with, for each bfloat16/float16
      parameter, what rounding its new values lost so far (in its dtype;
      zeros at ``init``), and ``None`` for every other leaf.
  """

  compensation: Any

  #: float16 by design: the float16 warnings and suspects leave it out (the
  #: ``HalfByDesign`` protocol of ``_base/state_roles.py``).
  half_by_design = True  # a class attribute, not a field


def kahan_summation() -> optax.GradientTransformation:
  """Rounds each bfloat16/float16 parameter to nearest and keeps what it lost.

  Put it last in a chain, where the updates are final:
  ``optax.chain(optax.adamw(lr), ols.kahan_summation())``. For each
  parameter ``p`` of dtype bfloat16 or float16, with update ``u`` and
  compensation ``c`` (in ``p``'s dtype, zero at first), in float32:
  ``s = p + (u + c)``; the new parameter is ``s`` rounded to nearest in
  ``p``'s dtype, and the new compensation is ``s - new`` (exact in float32)
  in ``p``'s dtype: updates below half a unit in the last place add up in
  ``c`` until they move the weight. ``c`` has ``p``'s precision, ``t``
  significant bits (8 in bfloat16, 11 in float16; in float16 a residual
  below 6.1e-5 is a subnormal, resolution 6e-8), and that is its limit:
  while a weight does not move, ``c`` grows by ``u`` a step rounded to
  ``t`` bits and stops at ``2**(floor(log2 |u|) + t + 1)``, where ``|u|`` is
  below half its unit, so the weight moves only if ``|u|`` is at least
  ``2**-(t + 2)`` of its spacing. In bfloat16 that is ``2**-10`` of the
  spacing: 5000 updates of ``-2e-6`` leave a weight of 1.0 where it is,
  with ``p + c = 0.99902`` where the sum is 0.99. In float16 it is
  float32's own unit at the weight (an update below half of it is lost as
  on a float32 weight). :func:`master_weights` has no such limit. A weight
  that overflows to ``±inf`` keeps a zero compensation. The update returned
  is float32, and ``optax.apply_updates`` turns it into exactly the rounded value
  (:func:`exact_update` says when). Other leaves keep their updates as they
  are and have ``None`` compensation. Under a loss scale a skipped step
  keeps the buffers.

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`KahanSummationState`; its ``update`` needs ``params``.

  Raises:
    ValueError: ``update`` is called without ``params``, with parameters
      that do not match the updates, or with a state made for other
      parameters.

  Example:
    >>> import jax.numpy as jnp, optax, optax_lossscale as ols
    >>> tx = optax.chain(optax.sgd(1.0), ols.kahan_summation())
    >>> params = {"w": jnp.ones(1, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> for _ in range(100):  # w - 1e-4, 100 times; to nearest, w stays 1.0
    ...   updates, state = tx.update({"w": jnp.full(1, 1e-4)}, state, params)
    ...   w = params["w"].astype(jnp.float32) + updates["w"]  # apply_updates
    ...   params = {"w": w.astype(jnp.bfloat16)}
    >>> params["w"], state[1].compensation["w"]  # 0.98828 + 0.00178 = 0.99006
    (Array([0.988281], dtype=bfloat16), Array([0.00177765], dtype=bfloat16))
  """

  def init_fn(params):
    return KahanSummationState(
      compensation=jax.tree.map(
        lambda p: jnp.zeros_like(p) if is_half(p) else None, params
      )
    )

  def update_fn(updates, state, params=None):
    needs_params("kahan_summation", params)
    _opt_state.check_state_type("kahan_summation", state, KahanSummationState)
    treedef, paths, rows = zip_leaves(
      "kahan_summation", updates, params, state.compensation
    )
    new_updates, new_compensation = [], []
    for path, (u, p, c) in zip(paths, rows, strict=True):
      if not is_half(p) and c is None:
        new_updates.append(u)
        new_compensation.append(c)
        continue
      # a compensation kept for a half-precision parameter of this dtype
      # and shape, and for no other (parameters promoted to float32 since)
      if not (_tree.is_array(c) and c.dtype == p.dtype and c.shape == p.shape):
        raise ValueError(
          f"kahan_summation: the state's compensation at {path} is "
          f"{getattr(c, 'dtype', c)}{list(getattr(c, 'shape', []))} for a "
          f"{p.dtype}{list(p.shape)} parameter: the state was made for other "
          "parameters."
        )
      if not _tree.is_float_array(u):
        new_updates.append(u)
        new_compensation.append(c)
        continue
      s = _tree.widen(p) + (_tree.widen(u).astype(_F32) + _tree.widen(c))
      new = round_to(s, p.dtype)  # float32 values of p's dtype
      lost = jnp.where(jnp.isinf(new), 0.0, s - new)
      new_updates.append(exact_update(new, p))
      new_compensation.append(lost.astype(p.dtype))
    return (
      jax.tree.unflatten(treedef, new_updates),
      KahanSummationState(jax.tree.unflatten(treedef, new_compensation)),
    )

  return optax.GradientTransformation(init_fn, update_fn)
