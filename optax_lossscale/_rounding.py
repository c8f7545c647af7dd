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

Both round with :func:`round_to` and return, for each bfloat16/float16
parameter, the float32 update of :func:`exact_update`, which
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

from optax_lossscale import _core

__all__ = [
  "KahanSummationState",
  "StochasticRoundingState",
  "exact_update",
  "kahan_summation",
  "round_to",
  "stochastic_rounding",
]

_F32 = jnp.dtype(jnp.float32)

#: The parameter dtypes that the two transformations round to.
HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def is_half(x: Any) -> bool:
  """An array of a dtype in :data:`HALF_DTYPES`."""
  return _core.is_array(x) and x.dtype in HALF_DTYPES


# --------------------------------------------------------------------------
# The rounding, and the update that applies it.
# --------------------------------------------------------------------------


def round_to(x: Any, dtype: Any, uniform: Any = None) -> jax.Array:
  """A float32 array rounded to ``dtype``: to nearest even, or stochastically.

  Without ``uniform``, ``x.astype(dtype)``: round to nearest, ties to even.
  With ``uniform`` (random numbers in [0, 1) of ``x``'s shape, float32 as
  ``jax.random.uniform`` draws them), each entry becomes its upper
  ``dtype`` neighbour ``hi`` where ``uniform < (x - lo) / (hi - lo)`` and
  its lower one ``lo`` otherwise: ``hi`` with probability
  ``(x - lo) / (hi - lo)``, so the expected result is ``x``.

  The neighbours are ``x``'s nearest ``dtype`` value and the next one on the
  other side of ``x`` (``jnp.nextafter`` in ``dtype``), which covers negative
  values, subnormals and the step across zero. The two differences are
  exact in float32 and the spacing ``hi - lo`` is a power of two, so the
  probability is exact, and a multiple of 2**-16 (bfloat16), 2**-13 (normal
  float16) or at least 2**-23 (float16's subnormals), which float32 uniforms
  (multiples of 2**-23) hit exactly: the rounding is unbiased. The one
  exception: between 0 and float16's smallest subnormal 2**-24 the
  probability can be finer than 2**-23 and is rounded up to a multiple of
  it (a bias below 2**-47). Values of ``dtype`` (exactly representable),
  ``±inf``, NaN and values beyond ``dtype``'s largest finite value are
  rounded to nearest, whatever ``uniform`` says: they never move, and
  overflow as round-to-nearest does. Where the backend flushes float32
  subnormals to zero (XLA's CPU backend), a subnormal ``x`` (below 2**-126,
  where bfloat16's subnormals lie) is read as zero, and rounded to nearest;
  no other input is affected (the differences are taken after scaling
  values below 1 by 2**64, so none of them is subnormal).

  Args:
    x: a float32 array.
    dtype: ``jnp.bfloat16`` or ``jnp.float16``.
    uniform: ``None``, or float32 uniform random numbers in [0, 1) of
      ``x``'s shape.

  Returns:
    ``x`` rounded, in ``dtype``.

  Raises:
    ValueError: ``x`` is not float32, ``dtype`` is not bfloat16 or float16,
      or ``uniform`` is not a float32 array of ``x``'s shape.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_lossscale._rounding import round_to
    >>> x = jnp.full(2, 1 + 2.0**-9)  # a quarter of the way from 1 to 1 + 2**-7
    >>> round_to(x, jnp.bfloat16)
    Array([1, 1], dtype=bfloat16)
    >>> round_to(x, jnp.bfloat16, jnp.array([0.2, 0.3]))  # 1 + 2**-7 if u < 1/4
    Array([1.00781, 1], dtype=bfloat16)
  """
  x = jnp.asarray(x)
  if x.dtype != _F32:
    raise ValueError(f"`x` must be a float32 array, got dtype {x.dtype}.")
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    dtype = None
  if dtype not in HALF_DTYPES:
    raise ValueError(f"`dtype` must be bfloat16 or float16, got {dtype!r}.")
  nearest = x.astype(dtype)
  if uniform is None:
    return nearest
  uniform = jnp.asarray(uniform)
  if uniform.dtype != _F32 or uniform.shape != x.shape:
    raise ValueError(
      f"`uniform` must be a float32 array of x's shape {x.shape}, got "
      f"{uniform.dtype}{list(uniform.shape)}."
    )
  near32 = nearest.astype(_F32)
  below = near32 < x  # the nearest value is the lower neighbour
  toward = jnp.where(below, jnp.inf, -jnp.inf).astype(dtype)
  other = jnp.nextafter(nearest, toward)
  lo = jnp.where(below, nearest, other)
  hi = jnp.where(below, other, nearest)
  # To nearest: values of the dtype, inf, NaN, beyond the largest value.
  keep = (near32 == x) | ~(jnp.abs(x) <= float(jnp.finfo(dtype).max))
  # Below 1 the differences are taken 2**64 times larger (exactly), so that
  # none is a float32 subnormal, which some backends flush to zero.
  scale = jnp.where(jnp.abs(x) < 1.0, 2.0**64, 1.0).astype(_F32)
  lo_scaled = lo.astype(_F32) * scale
  spacing = jnp.where(keep, 1.0, hi.astype(_F32) * scale - lo_scaled)
  p_hi = (x * scale - lo_scaled) / spacing
  return jnp.where(keep, nearest, jnp.where(uniform < p_hi, hi, lo))


def exact_update(new: jax.Array, param: jax.Array) -> jax.Array:
  """The float32 update that ``optax.apply_updates`` turns into exactly ``new``.

  ``apply_updates`` computes ``(param + update).astype(param.dtype)`` in
  float32. With ``update = float32(new) - float32(param)``: when that
  difference is exact in float32, ``param + update`` is ``new`` exactly (no
  rounding at all), and it is exact when one of them is zero or their
  magnitudes are within a factor of 2**15 (bfloat16) or 2**12 (float16):
  both are multiples of ``2**(e - t)``, with ``e`` the smaller one's exponent
  and ``t`` the dtype's fraction bits (7, 10), and their difference is below
  ``2**(E + 2)``, with ``E`` the larger one's exponent, so it is an integer
  of at most ``E - e + t + 2 <= 24`` bits times a power of two. When the
  difference is rounded but ``|new| >= |param|`` (a weight that grows, by
  any factor), ``param + update`` is within four float32 units of ``new``
  and rounds back to it. So the only steps that can come out a unit off (or
  zero) are those that shrink a weight's magnitude by more than 2**15
  (bfloat16) or 2**12 (float16) without making it zero, and a sign change of
  a bfloat16 weight beyond 1.7e38 (the difference overflows float32). Where
  the backend flushes float32 subnormals to zero (XLA's CPU backend), add
  bfloat16 weights below 2**-118, whose differences can be subnormal. A zero
  comes back as ``+0.0`` where ``new`` is ``-0.0`` (IEEE addition), and a
  parameter that is ``±inf`` and stays so gets a zero update (``inf - inf``
  would be NaN).

  Args:
    new: the rounded new parameter, in ``param``'s dtype.
    param: the current parameter.

  Returns:
    The float32 update.
  """
  new32, param32 = new.astype(_F32), param.astype(_F32)
  return jnp.where(new32 == param32, 0.0, new32 - param32)


# --------------------------------------------------------------------------
# Leaves of the updates, with the matching leaves of other trees.
# --------------------------------------------------------------------------


def _is_none(x: Any) -> bool:
  return x is None


def _zip_leaves(name: str, updates: Any, params: Any, *others: Any) -> tuple:
  """``(treedef, paths, rows)``: each leaf of ``updates`` (``None`` included)
  with its key path and the matching leaves of ``params`` and ``others``.

  Raises:
    ValueError: the parameters' tree does not match the updates', or a
      bfloat16/float16 parameter's update is not an array or has another
      shape.
  """
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(updates, is_leaf=_is_none)
  try:
    columns = [treedef.flatten_up_to(t) for t in (params, *others)]
  except (ValueError, TypeError):
    raise ValueError(
      f"{name}: the parameters' tree does not match the updates'.\n"
      f"  updates: {treedef}\n"
      f"  params:  {jax.tree.structure(params)}"
    ) from None
  paths = [jax.tree_util.keystr(path) or "<root>" for path, _ in with_paths]
  rows = list(zip([u for _, u in with_paths], *columns, strict=True))
  for path, (u, p, *_) in zip(paths, rows, strict=True):
    if is_half(p) and u is not None and not _core.is_array(u):
      raise ValueError(
        f"{name}: the update at {path} is a {type(u).__name__} ({u!r}), not an "
        "array: it would be added by rounding to nearest, unseen. Make it an "
        "array (jnp.asarray)."
      )
    if is_half(p) and _core.is_array(u) and u.shape != p.shape:
      raise ValueError(
        f"{name}: the update at {path} has shape {u.shape} but the "
        f"parameter has shape {p.shape}."
      )
  return treedef, paths, rows


def _needs_params(name: str, params: Any) -> None:
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
  state's key and this step's key, and draws ``jax.random.uniform`` for each
  leaf from this step's key folded in with the leaf's index in the
  flattened update tree. The key is in the state, so a run resumed from a
  checkpoint repeats the same rounding, and under a loss scale a skipped
  step keeps it. Under ``jax.jit`` the numbers drawn for an array do not
  depend on its sharding (JAX's ``jax_threefry_partitionable`` decides
  which numbers they are); inside ``shard_map`` or ``pmap`` each device
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
    _needs_params("stochastic_rounding", params)
    treedef, _, rows = _zip_leaves("stochastic_rounding", updates, params)
    typed = jax.random.wrap_key_data(state.rounding_key, impl=impl)
    next_key, step_key = jax.random.split(typed)

    def one(i, u, p):
      if not (is_half(p) and _core.is_float_array(u)):
        return u
      uniform = jax.random.uniform(jax.random.fold_in(step_key, i), p.shape, _F32)
      new = round_to(p.astype(_F32) + u.astype(_F32), p.dtype, uniform)
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


def kahan_summation() -> optax.GradientTransformation:
  """Rounds each bfloat16/float16 parameter to nearest and keeps what it lost.

  Put it last in a chain, where the updates are final:
  ``optax.chain(optax.adamw(lr), ols.kahan_summation())``. For each
  parameter ``p`` of dtype bfloat16 or float16, with update ``u`` and
  compensation ``c`` (in ``p``'s dtype, zero at first), in float32:
  ``s = p + (u + c)``; the new parameter is ``s`` rounded to nearest in
  ``p``'s dtype, and the new compensation is ``s - new`` (exact in float32)
  in ``p``'s dtype: updates below half a unit in the last place add up in
  ``c`` until they move the weight. ``p + c`` tracks the float32 sum of the
  updates to the precision of ``c``, which is ``p``'s dtype: 8 significant
  bits of the residual in bfloat16; in float16 a residual below its smallest
  normal number 6.1e-5 (every residual of a weight below 0.125) is a
  subnormal, with an absolute resolution of 6e-8. A weight that overflows
  to ``±inf`` keeps a zero compensation. The update returned is float32,
  and ``optax.apply_updates`` turns it into exactly the rounded value
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
    _needs_params("kahan_summation", params)
    treedef, paths, rows = _zip_leaves(
      "kahan_summation", updates, params, state.compensation
    )
    new_updates, new_compensation = [], []
    for path, (u, p, c) in zip(paths, rows, strict=True):
      if not is_half(p):
        new_updates.append(u)
        new_compensation.append(c)
        continue
      if not (_core.is_array(c) and c.dtype == p.dtype and c.shape == p.shape):
        raise ValueError(
          f"kahan_summation: the state's compensation at {path} is "
          f"{getattr(c, 'dtype', c)}{list(getattr(c, 'shape', []))} for a "
          f"{p.dtype}{list(p.shape)} parameter: the state was made for other "
          "parameters."
        )
      if not _core.is_float_array(u):
        new_updates.append(u)
        new_compensation.append(c)
        continue
      s = p.astype(_F32) + (u.astype(_F32) + c.astype(_F32))
      new = round_to(s, p.dtype)
      lost = jnp.where(jnp.isinf(new), 0.0, s - new.astype(_F32))
      new_updates.append(exact_update(new, p))
      new_compensation.append(lost.astype(p.dtype))
    return (
      jax.tree.unflatten(treedef, new_updates),
      KahanSummationState(jax.tree.unflatten(treedef, new_compensation)),
    )

  return optax.GradientTransformation(init_fn, update_fn)
