"""float32 master weights for bfloat16/float16 parameters: a 16-bit remainder or a copy.

:func:`master_weights` wraps any optax transformation so that it sees, as
its parameters, the float32 master weights of the half-precision parameters
the model holds, and float32 gradients; its state lives in float32. The
master weight is kept in the state as what the parameter lacks:

* ``store="remainder"`` (bfloat16 only): the low 16 bits of the float32
  master, as an int16, relative to the parameter (the master rounded to
  nearest): parameter and remainder are the master, bit for bit
  (``_rounding.split_remainder``): 2 bytes per parameter;
* ``store="float32"``: the whole float32 master: 4 bytes per parameter, for
  float16 (whose 10 fraction bits are not a float32's high half) or
  bfloat16.

Under ``dynamic_loss_scale(master_weights(...))`` the loss scale hands it
the gradients unscaled in float32 (its state says so: it is a
``KeepsFloat32Masters`` state), so the small gradients the scale
rescued never pass through float16 again.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_lossscale._base import opt_state as _opt_state
from optax_lossscale._base import rounding as _rounding
from optax_lossscale._base import tree as _tree
from optax_lossscale._base import validate as _validate
from optax_lossscale._base.init_memo import InitMemo
from optax_lossscale._params.low_precision import needs_params, zip_leaves

__all__ = [
  "MasterWeights",
  "MasterWeightsState",
  "get_master_weights",
  "master_weights",
]

_F32 = jnp.dtype(jnp.float32)
_STORES = ("remainder", "float32")


class MasterWeightsState(NamedTuple):
  """State of :func:`master_weights`.

  Attributes:
    master: the parameters' tree with, for each bfloat16/float16 parameter,
      what its float32 master weight keeps beyond it: an int16 remainder
      (``store="remainder"``) or the float32 master itself
      (``store="float32"``); ``None`` for every other leaf.
    inner_state: the wrapped transformation's state, made on the float32
      master weights.
  """

  master: Any
  inner_state: Any

  #: A loss scale whose inner state holds this state (at any depth) hands
  #: the gradients on unscaled in float32, not cast back to the parameters'
  #: dtype (the ``KeepsFloat32Masters`` protocol of ``_base/state_roles.py``).
  keeps_float32_masters = True  # a class attribute, not a field


@_tree.rebuilt_as_itself
class MasterWeights(optax.GradientTransformationExtraArgs):
  """What :func:`master_weights` returns: an optax transformation.

  Attributes:
    inner: the wrapped transformation.
    store: ``"remainder"`` or ``"float32"``.
  """

  def __new__(cls, init, update, inner, store):
    self = super().__new__(cls, init, update)
    self.inner = inner
    self.store = store
    return self

  def __reduce__(self):  # copy/pickle: rebuilt from what made it
    return (functools.partial(master_weights, store=self.store), (self.inner,))


def _kept_dtype(path: str, p: Any, store: str, refuse: bool = True) -> Any:
  """What the state keeps for parameter ``p``: ``None``, int16 or float32
  (``None`` too for a float16 parameter and ``"remainder"`` if not ``refuse``).

  Raises:
    ValueError: a float16 parameter with ``store="remainder"`` and ``refuse``.
  """
  if not _rounding.is_half(p):
    return None
  if store == "float32":
    return _F32
  if p.dtype != _rounding.BF16:
    if not refuse:
      return None
    raise ValueError(
      f"master_weights(store='remainder') keeps the low 16 bits of a float32, "
      f"which make a float32 with a bfloat16 only; the parameter at "
      f"{path} is {p.dtype}. Use store='float32' (a float32 "
      "copy) for float16 parameters."
    )
  return jnp.dtype(jnp.int16)


def _check_kept(where: str, path: str, p: Any, kept: Any, store: str) -> None:
  """``kept`` is what ``store`` keeps for parameter ``p``, or a ValueError
  (for a float16 parameter and ``"remainder"``, :func:`master_weights`'
  refusal where it is the transformation's)."""
  want = _kept_dtype(path, p, store, refuse=where == "master_weights")
  got = getattr(kept, "dtype", None)
  if want is None and got is not None and getattr(p, "shape", None) == kept.shape:
    was = "bfloat16" if got == jnp.int16 else "float16 or bfloat16"
    raise ValueError(
      f"{where}: the parameter at {path} is {p.dtype}, where the state keeps "
      f"a master weight of a {was} parameter: its dtype changed from {was} to "
      f"{p.dtype} since the state was made, or the state was made for other "
      "parameters. An update applied without casting back changes the dtype "
      "(eqx.apply_updates keeps the float32 of a half-precision parameter plus "
      "its float32 update; optax.apply_updates casts back): cast the "
      "parameters back to their dtypes after applying the updates, or init "
      "the state on these."
    )
  if got != want or (want is not None and kept.shape != p.shape):
    kind = "" if p is None else f"{getattr(p, 'dtype', type(p).__name__)}"
    shape = list(getattr(p, "shape", []))
    raise ValueError(
      f"{where}: the state holds {got}{list(getattr(kept, 'shape', []))} at "
      f"{path} for a {kind}{shape} parameter: it was made for "
      "other parameters (or with another store). Pass the parameters it was "
      "made for, or init it on these."
    )


def _master_of(p: Any, kept: Any) -> Any:
  """The float32 master weight of parameter ``p``: ``kept`` itself (a copy),
  ``p`` joined with ``kept`` (an int16 remainder), or ``p`` (not half)."""
  if not _rounding.is_half(p):
    return p
  if kept.dtype == jnp.int16:
    return _rounding.join_remainder(p, kept)
  return kept


# A leaf's work is one jax.jit, which JAX traces once for each shape and
# dtype, not once for each leaf: the trace of a tree of hundreds of leaves
# takes half the time (BENCHMARKS.md, investigation log: trace).
@jax.jit
def _masters(
  p: jax.Array, kept: jax.Array, u: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """A half-precision leaf's float32 master weight and float32 gradient."""
  return _master_of(p, kept), _tree.widen(u).astype(_F32)


@functools.partial(jax.jit, static_argnames="store")
def _landed(
  u: jax.Array, p: jax.Array, m: jax.Array, store: str
) -> tuple[jax.Array, jax.Array]:
  """``(update, kept)`` of a half-precision leaf: ``inner``'s update ``u``
  applied to its master ``m`` in float32, rounded to ``p``'s dtype to
  nearest, the update ``optax.apply_updates`` turns into exactly that, and
  what the state keeps beyond it."""
  m_new = m + _tree.widen(u).astype(_F32)  # apply_updates on the master
  if store == "float32":
    return _rounding.exact_update(_rounding.round_to(m_new, p.dtype), p), m_new
  rounded, remainder = _rounding.split_remainder(m_new)
  update = _rounding.exact_update(rounded, p)
  # What apply_updates will make of it: where it cannot be the rounded
  # value, the master weight becomes the parameter it makes.
  applied = (p.astype(_F32) + update).astype(p.dtype)
  landed = jax.lax.bitcast_convert_type(applied, jnp.uint16) == (
    jax.lax.bitcast_convert_type(rounded, jnp.uint16)
  )
  return update, jnp.where(landed, remainder, jnp.int16(0))


def master_weights(
  inner: optax.GradientTransformation, *, store: str = "remainder"
) -> MasterWeights:
  """``inner`` on float32 master weights of bfloat16/float16 parameters.

  For each bfloat16 or float16 parameter ``p`` the state keeps what the
  float32 master weight ``m`` has beyond ``p``. ``update(grads, state,
  params)``:

  1. rebuilds ``m`` from ``p`` and the state;
  2. runs ``inner`` with ``m`` as its parameters and the gradients in
     float32 (its state was made on the masters: Adam's moments, a
     schedule's count, all float32), so weight decay and every other rule
     that reads the parameters reads the exact weights;
  3. applies ``inner``'s update to ``m`` in float32, as
     ``optax.apply_updates`` would for a float32 parameter: ``m' = m + u``;
  4. rounds ``m'`` to ``p``'s dtype to nearest (ties away from zero with
     ``"remainder"``: only where the low 16 bits are exactly ``0x8000`` does
     that differ from ties to even), keeps what the rounding left in the
     state, and returns the float32 update that ``optax.apply_updates``
     turns into exactly the rounded value (``_rounding.exact_update``).

  Parameters of other dtypes (float32, float64) are ``inner``'s as they are;
  integer and ``None`` leaves pass. A step that ``optax.apply_updates``
  cannot land exactly on the rounded value (one that shrinks a weight's
  magnitude more than 2**15-fold without making it zero:
  ``exact_update``'s one exception) leaves, with ``"remainder"``, the master
  weight at the value the parameter takes (it moves by less than that
  weight's own resolution), so that parameter and state always make the
  master; with ``"float32"`` the copy keeps the exact master and the
  parameter is one unit of its dtype from it until the next step. A
  parameter that overflows to ``±inf`` stays there with a zero update (no
  update takes it back); the ``"float32"`` copy keeps the exact master, the
  ``"remainder"`` master becomes ``±inf``. The ``"float32"`` copy is the
  master: a change made to the parameters between steps is undone at the
  next step.

  Put it directly inside the loss scale, around the whole optimizer:
  ``dynamic_loss_scale(master_weights(optax.adamw(...)))``. The loss scale
  then unscales the gradients into float32 for it (float16 gradients cast
  back to float16 after unscaling would lose again the small entries the
  scale rescued, and Adam's ``(1 - b2) g**2`` underflows in float16).

  Args:
    inner: any optax transformation (a chain included).
    store: ``"remainder"`` (bfloat16 parameters: the low 16 bits of each
      master, 2 bytes a parameter, the master exact) or ``"float32"`` (a
      float32 copy, 4 bytes a parameter; float16 or bfloat16).

  Returns:
    A :class:`MasterWeights` (an ``optax.GradientTransformationExtraArgs``)
    whose state is a :class:`MasterWeightsState`; its ``update`` needs
    ``params``.

  Raises:
    ValueError: ``store`` is neither; ``init`` with float16 parameters and
      ``"remainder"`` (a float16 is not a float32's high half: use
      ``store="float32"``); ``update`` without ``params``, or with
      parameters or gradients that do not match the state.

  Example:
    >>> import jax.numpy as jnp, optax, optax_lossscale as ols
    >>> tx = ols.master_weights(optax.sgd(1.0))
    >>> params = {"w": jnp.ones(1, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> for _ in range(100):  # w - 1e-4, 100 times; to nearest, w stays 1.0
    ...   updates, state = tx.update({"w": jnp.full(1, 1e-4)}, state, params)
    ...   w = params["w"].astype(jnp.float32) + updates["w"]  # apply_updates
    ...   params = {"w": w.astype(jnp.bfloat16)}
    >>> float(ols.get_master_weights(state, params)["w"][0])  # float32's own sum
    0.9899983406066895
    >>> params["w"]  # the master rounded to nearest
    Array([0.988281], dtype=bfloat16)
  """
  store = _validate.choice("store", store, _STORES)
  if not (
    callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))
  ):
    raise ValueError(f"`inner` must be an optax GradientTransformation, got {inner!r}.")
  wrapped = optax.with_extra_args_support(inner)
  memo = InitMemo(wrapped.init)

  def init_fn(params):
    def kept(path, p):
      want = _kept_dtype(_tree.keystr(path), p, store)
      if want is None:
        return None
      if store == "float32":
        return jnp.array(p, _F32, copy=True)
      return jnp.zeros_like(p, jnp.int16)  # in p's sharding

    master = jax.tree_util.tree_map_with_path(kept, params)
    masters = jax.tree.map(
      lambda p: p.astype(_F32) if _rounding.is_half(p) else p, params
    )
    inner_state = memo.record(masters, wrapped.init(masters))
    return MasterWeightsState(master=master, inner_state=inner_state)

  def update_fn(updates, state, params=None, **extra_args):
    needs_params("master_weights", params)
    _opt_state.check_state_type("master_weights", state, MasterWeightsState)
    treedef, paths, rows = zip_leaves("master_weights", updates, params, state.master)
    for path, (_, p, kept) in zip(paths, rows, strict=True):
      _check_kept("master_weights", path, p, kept, store)
    half = [_rounding.is_half(p) and _tree.is_float_array(u) for u, p, _ in rows]
    both = [
      _masters(p, kept, u) if h else (_master_of(p, kept), u)
      for h, (u, p, kept) in zip(half, rows, strict=True)
    ]
    masters, grads = [m for m, _ in both], [g for _, g in both]
    grads, masters_tree = (jax.tree.unflatten(treedef, x) for x in (grads, masters))
    inner_state = _opt_state.check_inner_state(
      "master_weights", memo, state.inner_state, grads, masters_tree
    )
    try:
      inner_updates, inner_state = wrapped.update(
        grads, inner_state, masters_tree, **extra_args
      )
    except (ValueError, TypeError) as e:
      _opt_state.blame_none_gradients(grads, masters_tree, e)
      raise
    new_updates, new_master = [], []
    flat_updates = treedef.flatten_up_to(inner_updates)
    for u, (_, p, kept), m in zip(flat_updates, rows, masters, strict=True):
      if _rounding.is_half(p) and _tree.is_float_array(u):
        u, kept = _landed(u, p, m, store)
      new_updates.append(u)
      new_master.append(kept)
    return (
      jax.tree.unflatten(treedef, new_updates),
      MasterWeightsState(jax.tree.unflatten(treedef, new_master), inner_state),
    )

  return MasterWeights(init_fn, update_fn, inner, store)


def _is_state(x: Any) -> bool:
  return isinstance(x, MasterWeightsState)


def get_master_weights(opt_state: Any, params: Any) -> Any:
  """The float32 master weights of ``params``, from the one :func:`master_weights`.

  For evaluation at full precision, export, or a float32 checkpoint.

  Args:
    opt_state: a state holding one :class:`MasterWeightsState` (at any
      depth; a Flax ``TrainState`` or ``nnx.Optimizer`` too).
    params: the parameters it was made for, as ``optax.apply_updates`` left
      them.

  Returns:
    ``params``' tree with float32 master weights in place of the
    bfloat16/float16 parameters; other leaves as they are.

  Raises:
    ValueError: no :func:`master_weights` state in ``opt_state``, or
      several, or ``params`` that do not fit it.
  """
  state = _tree.find_unique(
    _opt_state.optimizer_state(opt_state), _is_state, "master_weights state"
  )
  master = _tree.unwrap_variables(state.master)
  params = _tree.unwrap_variables(params)
  # A master_weights under optax.masked or multi_transform holds MaskedNode
  # for the leaves of the other branches: those are returned as they are.
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(
    master, is_leaf=lambda x: x is None or isinstance(x, optax.MaskedNode)
  )
  try:
    flat_params = treedef.flatten_up_to(params)
  except (ValueError, TypeError):
    raise ValueError(
      "get_master_weights: `params` do not fit the master_weights state; pass "
      "the parameters it was made for."
    ) from None
  for (path, kept), p in zip(with_paths, flat_params, strict=True):
    if isinstance(kept, optax.MaskedNode):
      continue
    # the store each leaf was made with, read from what it keeps
    store = "remainder" if getattr(kept, "dtype", None) == jnp.int16 else "float32"
    _check_kept("get_master_weights", _tree.keystr(path), p, kept, store)
  return jax.tree.unflatten(
    treedef,
    [
      p if isinstance(k, optax.MaskedNode) else _master_of(p, k)
      for p, (_, k) in zip(flat_params, with_paths, strict=True)
    ],
  )
