"""Optimizer state in 8 bits: block-quantised moments around any optax transformation.

:func:`quantize_state` stores each large floating leaf of an optax state
that has a parameter's shape (Adam's two moments, a momentum, an RMS
accumulator) as 8-bit codes with one float32 scale per block of
``block_size`` consecutive elements, the scheme of bitsandbytes' 8-bit
optimizers (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization"):

* the scale of a block is its largest magnitude (its "absmax"), or, where
  its least value has the larger magnitude, that magnitude divided by
  0.993, the signed map's least value (which bitsandbytes does not do: its
  blocks store that value 0.7% short, at every update);
* each element is divided by it (multiplied by its reciprocal, as
  bitsandbytes does) and rounded to the nearest of 256 values of the
  *dynamic quantisation map*, a code of one sign bit, a run of zeros that
  gives a decimal exponent (1 down to 1e-6) and a linear fraction in the
  remaining bits: relative precision where Adam's moments live, across
  seven decades below the block's largest value;
* a block whose elements are all ``>= 0`` (every block of Adam's second
  moment) takes the *unsigned* map (no sign bit: one more fraction bit per
  decade), any other block the signed one; the stored scale is negated for
  a signed block, so that the block's map is read from the sign of its
  scale; by default an unsigned block holds its values' square roots (half
  the decades: Adam's second moment keeps its smallest entries).

:func:`dequantize_state` returns the state in float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_lossscale._base import opt_state as _opt_state
from optax_lossscale._base import state_roles as _roles
from optax_lossscale._base import tree as _tree
from optax_lossscale._base import validate as _validate
from optax_lossscale._base.init_memo import InitMemo
from optax_lossscale._params import moments as _moments
from optax_lossscale._params import quantize_flat as _flat
from optax_lossscale._params.quantize_codec import (
  QuantizedLeaf,
  dynamic_map,
  encode,
  encode_many,
)
from optax_lossscale._params.quantize_codec import layout as _leaf_layout

GroupedLeaf = _flat.GroupedLeaf

__all__ = [
  "FlatQuantizedState",
  "GroupedLeaf",
  "QuantizedLeaf",
  "QuantizedState",
  "StateQuantizer",
  "StochasticFlatQuantizedState",
  "StochasticQuantizedState",
  "dequantize_state",
  "dynamic_map",
  "quantize_state",
]

_BITS = (8,)
#: Every leaf is padded to whole blocks: a larger block would only waste memory.
_MAX_BLOCK = 2**16
_ROUNDINGS = ("nearest", "stochastic")
_LAYOUTS = ("leaf", "flat")


# --------------------------------------------------------------------------
# The transformation.
# --------------------------------------------------------------------------


class QuantizedState(NamedTuple):
  """State of :func:`quantize_state` (``rounding="stochastic"``: a
  :class:`StochasticQuantizedState`).

  Attributes:
    inner_state: the wrapped transformation's state, each quantised leaf a
      :class:`QuantizedLeaf` (the others as the inner transformation made
      them).
  """

  inner_state: Any


class FlatQuantizedState(NamedTuple):
  """State of :func:`quantize_state` with ``layout="flat"``
  (``rounding="stochastic"``: a :class:`StochasticFlatQuantizedState`).

  Attributes:
    inner_state: the wrapped transformation's state, each quantised leaf a
      :class:`GroupedLeaf` (which holds no array: where its values are in
      ``groups``; the others as the inner transformation made them).
    groups: one :class:`QuantizedLeaf` of one dimension a moment field and
      dtype (Adam's ``mu`` of the float32 parameters), its leaves' blocks
      one after another.
  """

  inner_state: Any
  groups: tuple


class StochasticQuantizedState(NamedTuple):
  """State of :func:`quantize_state` with ``rounding="stochastic"``.

  Attributes:
    inner_state: as :class:`QuantizedState`'s.
    rounding_step: the number of updates (int32, wrapping past
      ``2**31 - 1``), which the stochastic rounding's random numbers hash.
  """

  inner_state: Any
  rounding_step: Any


class StochasticFlatQuantizedState(NamedTuple):
  """State of :func:`quantize_state` with ``layout="flat"`` and
  ``rounding="stochastic"``.

  Attributes:
    inner_state, groups: as :class:`FlatQuantizedState`'s.
    rounding_step: as :class:`StochasticQuantizedState`'s.
  """

  inner_state: Any
  groups: tuple
  rounding_step: Any


#: Every type of a quantize_state state; the flat layout's.
_STATES = (
  QuantizedState,
  FlatQuantizedState,
  StochasticQuantizedState,
  StochasticFlatQuantizedState,
)
_FLAT_STATES = (FlatQuantizedState, StochasticFlatQuantizedState)


def state_type(flat: bool, stochastic: bool) -> type:
  """The type of the state :func:`quantize_state` makes with these options."""
  if flat:
    return StochasticFlatQuantizedState if stochastic else FlatQuantizedState
  return StochasticQuantizedState if stochastic else QuantizedState


def made(flat: bool, stochastic: bool, inner_state, groups, step) -> Any:
  """A state of :func:`state_type` (``groups`` for the flat layout, ``step``
  for stochastic rounding; each ignored otherwise)."""
  fields = (
    (inner_state,) + ((groups,) if flat else ()) + ((step,) if stochastic else ())
  )
  return state_type(flat, stochastic)(*fields)


@_tree.rebuilt_as_itself
class StateQuantizer(optax.GradientTransformationExtraArgs):
  """What :func:`quantize_state` returns: an optax transformation (its
  state is a :class:`QuantizedState`).

  Attributes:
    inner: the wrapped transformation.
    bits, block_size, min_size, store_sqrt, rounding, select, layout: as
      given.
  """

  def __new__(cls, init, update, inner, check=None, **options):
    self = super().__new__(cls, init, update)
    self.inner, self.options, self._check = inner, options, check
    for name, value in options.items():
      setattr(self, name, value)
    return self

  def __reduce__(self):  # copy/pickle: rebuilt from what made it
    return (functools.partial(quantize_state, **self.options), (self.inner,))

  def check(self, state: Any, like: Any) -> Any:
    """A ValueError unless ``state`` is what ``init`` makes for parameters
    like ``like`` (its type, structure and quantised leaves' layouts);
    returns ``state`` with tuples where ``init`` made tuples and the state
    holds lists (a serializer's round trip)."""
    return self._check(state, like)


def _is_quantized(x: Any) -> bool:
  return isinstance(x, QuantizedLeaf)


def _is_stored(x: Any) -> bool:
  return isinstance(x, (QuantizedLeaf, GroupedLeaf))


def _dequantized(tree: Any, cast: bool) -> Any:
  """``tree`` with each :class:`QuantizedLeaf` as its values (in its dtype
  if ``cast``, else float32)."""

  def leaf(x):
    if not _is_quantized(x):
      return x
    if not _tree.is_array(x.codes):  # a jax.eval_shape state's
      return jax.ShapeDtypeStruct(x.codes.shape, x.dtype if cast else jnp.float32)
    v = x.dequantize()
    return v.astype(x.dtype) if cast else v

  return jax.tree.map(leaf, tree, is_leaf=_is_quantized)


def quantize_state(
  inner: optax.GradientTransformation,
  *,
  bits: int = 8,
  block_size: int = 256,
  min_size: int = 4096,
  store_sqrt: bool = True,
  rounding: str = "nearest",
  select: Callable[[tuple, Any], bool] | None = None,
  layout: str = "leaf",
) -> StateQuantizer:
  """``inner`` with its moments stored in 8 bits, blockwise.

  A leaf of ``inner``'s state is quantised when it is a moment, a real
  floating array with the shape of one of the parameters and at least
  ``min_size`` elements. A moment is a leaf in a moment field of a state
  type optax or this library defines (Adam's ``mu`` and ``nu``, SGD's
  momentum ``trace``, RMSprop's ``nu``, Lion's, Adafactor's, Prodigy's
  ``exp_avg`` and ``exp_avg_sq``, ...); a copy of the parameters (the
  average :func:`ema_params` keeps, schedule-free's ``z``, Prodigy's
  ``params0``), a hyper-parameter of ``optax.inject_hyperparams``, a
  counter, and any leaf of a state type it does not know are kept as
  ``inner`` made them, whatever their size. ``select`` chooses instead:
  ``select(path, leaf)`` (the leaf's key path in ``inner``'s state, as
  ``jax.tree_util.tree_flatten_with_path`` gives it) is ``True`` for a
  leaf to quantise, of any shape; a leaf that is not a real floating array
  of at least ``min_size`` elements (a counter, a scalar) is kept whatever
  it returns, so ``select=lambda path, leaf: True`` quantises every leaf
  that can be. A quantised leaf is stored as a
  :class:`QuantizedLeaf`: blocks of ``block_size`` consecutive
  elements of the flattened leaf (blocks that do not cross the leaf's
  leading axes where its trailing ones hold whole blocks), one float32
  scale per block (its largest magnitude, or its least value's magnitude
  over 0.993 where that is larger: both ends of the map hold a value as
  it is), 8-bit codes of bitsandbytes' dynamic map (unsigned for
  a block that is all ``>= 0``, signed otherwise), rounded to nearest by
  default.
  With ``store_sqrt`` (the default) a block that is all ``>= 0`` is stored
  as its values' square roots: rounded to nearest, Adam's second moment
  loses its smallest entries to 0 (where the update ``m / (sqrt(0) +
  eps)`` is too large by orders of magnitude); square roots span half as
  many decades, and no entry measured in BENCHMARKS.md became 0 (its
  "8-bit optimizer state" section). ``store_sqrt=False`` is bitsandbytes'
  ``Adam8bit`` storage. ``rounding="stochastic"`` rounds each element
  to one of the two map values around it at random, up with probability
  its distance from the lower one over their gap (its code then is right
  on average); the random numbers hash each element's index, its new value
  and the update's step (the state's ``rounding_step``), so each update
  draws anew and no key is carried. Rounded to nearest, a moment that
  moves by less than half the gap between its codes in a step keeps its
  code (Lion's momentum stalls: use ``"stochastic"`` there). ``update``
  dequantises the state (each leaf in its own dtype), runs
  ``inner.update``, and quantises the new state; a block whose values the
  inner update left as they were keeps its codes and scale bit for bit
  (a step ``optax.apply_if_finite`` skips, ``optax.MultiSteps``'
  micro-steps). A leaf holding NaN or an infinity gets an infinite scale,
  which the checkpoint guard sees. Like rounding, quantising has no
  derivative: the stored state carries none.

  Put it inside the loss scale and inside :func:`master_weights`
  (``dynamic_loss_scale(master_weights(quantize_state(optax.adam(...))))``):
  the master weights are parameters, not moments, and are never quantised;
  a :func:`master_weights` state inside it is refused. Put
  ``optax.MultiSteps`` outside it too (inside, every micro-batch decodes
  and encodes again the moments it does not change: they keep their bits,
  at the cost of the passes).

  Args:
    inner: any optax transformation (a chain included).
    bits: bits per code; 8, the one width offered (4 bits, measured,
      departs from float32 Adam: the low-precision guide).
    block_size: elements per block, a power of two from 2 to 65536.
    min_size: leaves with fewer elements are not quantised (>= 0).
    store_sqrt: store the square roots of a block that is all ``>= 0``.
    rounding: ``"nearest"`` or ``"stochastic"``.
    select: ``None`` (the moments), or a function of a state leaf's key
      path and the leaf (an array, or its ``jax.ShapeDtypeStruct`` where a
      state is checked) returning ``True`` or ``False``.
    layout: ``"leaf"`` (each quantised leaf a :class:`QuantizedLeaf` of its
      own, in its own sharding) or ``"flat"`` (the quantised leaves of one
      moment field and dtype in one buffer, and the inner update run once on
      flat arrays for each group of parameters it updates alike: a step that
      compiles in less than twice float32 Adam's time on hundreds of leaves,
      but runs longer and holds more temporary memory, for it gathers the
      gradients into flat arrays; BENCHMARKS.md, 8-bit optimizer state).
      The same blocks, codes and scales; ``init`` refuses a leaf to
      quantise that is sharded explicitly. A ``custom_jvp`` or
      ``custom_vjp`` function in the inner update is run leaf by leaf, so
      that ``jax.grad`` through the update uses its rule.

  Returns:
    A :class:`StateQuantizer` (an ``optax.GradientTransformationExtraArgs``)
    whose state is a :class:`QuantizedState` (``"flat"``: a
    :class:`FlatQuantizedState`; rounded stochastically, a
    :class:`StochasticQuantizedState` or a
    :class:`StochasticFlatQuantizedState`, which add the step).

  Raises:
    ValueError: a bad ``bits``, ``block_size``, ``min_size``,
      ``store_sqrt``, ``rounding``, ``select`` or ``layout``; ``init``
      where ``inner``'s state holds a :func:`master_weights` state or
      quantised leaves (a :func:`quantize_state` or :func:`adam_8bit`), where
      ``select`` returns something else than ``True`` or ``False``, and
      where nothing would be quantised while leaves of a state it does not
      know have the parameters' shapes, alone or inside a wrapper it
      knows (``inject_hyperparams``, ``lookahead``, ``MultiSteps``; naming
      them: pass ``select``);
      ``update`` with a state made for other parameters or by another
      transformation, or whose codes or scales changed dtype (naming the
      leaf), with a stochastic state of release 0.1 (a
      :class:`QuantizedState`, no ``rounding_step``: the message says how to
      add one), and where the inner update makes a complex value of a
      quantised leaf; with ``layout="flat"``, ``update`` where gradients or
      parameters of quantised leaves are sharded explicitly, or where the
      inner update makes the leaves of one group in several dtypes (a
      bfloat16 gradient beside a float32 one: ``layout="leaf"`` takes
      them).

  Example:
    >>> import jax.numpy as jnp, optax, optax_lossscale as ols
    >>> tx = ols.quantize_state(optax.adam(1e-3), min_size=0)
    >>> params = {"w": jnp.linspace(-1.0, 1.0, 512)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.linspace(1.0, -1.0, 512)}, state, params)
    >>> mu = state.inner_state[0].mu["w"]
    >>> mu.codes.dtype, mu.scales.shape  # one scale per 256 elements
    (dtype('uint8'), (2,))
    >>> float(ols.dequantize_state(state)[0].mu["w"][0])  # 0.1 * 1.0
    0.10000000149011612
  """
  check_layout_args(
    "quantize_state", bits=bits, block_size=block_size, min_size=min_size
  )
  if (
    not isinstance(bits, (int, np.integer))
    or isinstance(bits, bool)
    or bits not in _BITS
  ):
    raise ValueError(f"`bits` must be one of {_BITS}, got {bits!r}.")
  block_size = _validate.as_int("block_size", block_size)
  if block_size < 2 or block_size > _MAX_BLOCK or block_size & (block_size - 1):
    raise ValueError(
      f"`block_size` must be a power of two from 2 to {_MAX_BLOCK}, got {block_size}."
    )
  min_size = _validate.as_int("min_size", min_size)
  if min_size < 0:
    raise ValueError(f"`min_size` must be >= 0, got {min_size}.")
  if not isinstance(store_sqrt, (bool, np.bool_)):
    raise ValueError(f"`store_sqrt` must be True or False, got {store_sqrt!r}.")
  store_sqrt = bool(store_sqrt)
  if not isinstance(rounding, str) or rounding not in _ROUNDINGS:
    raise ValueError(f"`rounding` must be one of {_ROUNDINGS}, got {rounding!r}.")
  stochastic = rounding == "stochastic"
  if not (
    callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))
  ):
    raise ValueError(f"`inner` must be an optax GradientTransformation, got {inner!r}.")
  if select is not None and not callable(select):
    raise ValueError(f"`select` must be None or a function, got {select!r}.")
  if not isinstance(layout, str) or layout not in _LAYOUTS:
    raise ValueError(f"`layout` must be one of {_LAYOUTS}, got {layout!r}.")
  flat = layout == "flat"
  wrapped = optax.with_extra_args_support(inner)
  memo = InitMemo(wrapped.init)

  def chosen(inner_state, shapes) -> list[int]:
    """The indices (in ``jax.tree.leaves`` order) of the leaves to quantise,
    chosen by their paths in the state as ``update`` sees it (without nnx
    variables)."""
    inner_state = _tree.unwrap_variables(inner_state)
    with_paths = jax.tree_util.tree_flatten_with_path(inner_state)[0]
    sized = [
      _floating(x) and np.size(x) >= min_size and np.size(x) > 0 for _, x in with_paths
    ]
    if select is not None:
      return [
        i
        for i, (path, x) in enumerate(with_paths)
        if _selected(select, path, x) and sized[i]
      ]
    marks = _moments.marks(inner_state)
    shaped = [
      sized[i] and tuple(np.shape(x)) in shapes for i, (_, x) in enumerate(with_paths)
    ]
    out = [i for i, m in enumerate(marks) if m and shaped[i]]
    unknown = [
      _tree.keystr(path)
      for i, (path, _) in enumerate(with_paths)
      if marks[i] is None and shaped[i]
    ]
    if not out and unknown:
      raise ValueError(
        "quantize_state: nothing in the inner state is a moment of a state it "
        f"knows, and the leaves at {', '.join(unknown[:4])}"
        f"{' ...' if len(unknown) > 4 else ''} have the parameters' shapes but "
        "belong to a state it does not know (a moment, or a copy of the "
        "parameters?). Name the leaves to quantise: select=lambda path, leaf: ..."
      )
    return out

  def quantized(inner_state, params):
    picked = chosen(inner_state, _shapes(params))
    inner_state = _out_of_variables(inner_state, picked, jnp.asarray)
    leaves, treedef = jax.tree.flatten(inner_state)
    step = jnp.zeros((), jnp.int32) if stochastic else None
    if flat:
      state, coded = _flat.encoded(
        inner_state,
        picked,
        _tree.unwrap_variables(params),
        block_size,
        store_sqrt,
        stochastic,
        step,
      )
      return made(flat, stochastic, state, coded, step)
    for i in picked:
      leaves[i] = encode(leaves[i], block_size, store_sqrt, stochastic, step)
    return made(flat, stochastic, jax.tree.unflatten(treedef, leaves), None, step)

  def expected(params, group_of=None):
    """The state ``init_fn(params)`` makes, abstract, without encoding
    anything: the quantised leaves' layouts follow from their shapes (the
    flat layout's groups from ``group_of``, where given: see ``grouped``)."""
    inner_state = memo.made(params)  # init is not traced again
    picked = chosen(inner_state, _shapes(params))
    inner_state = _out_of_variables(inner_state, picked, lambda x: x)
    leaves, treedef = jax.tree.flatten(inner_state)
    step = jax.ShapeDtypeStruct((), jnp.int32)
    if flat:
      state, groups = _flat.grouped(
        inner_state,
        picked,
        _tree.unwrap_variables(params),
        block_size,
        store_sqrt,
        group_of,
      )
      return made(flat, stochastic, state, tuple(g for _, g in groups), step)
    for i in picked:
      leaves[i] = _leaf_layout(leaves[i], block_size, store_sqrt)
    return made(flat, stochastic, jax.tree.unflatten(treedef, leaves), None, step)

  def init_fn(params):
    inner_state = memo.record(params, wrapped.init(params))
    if _roles.holds_masters(inner_state):
      raise ValueError(
        "quantize_state: the inner state holds a master_weights state, whose "
        "master weights would be quantised. Put quantize_state inside it: "
        "master_weights(quantize_state(optax.adam(...)))."
      )
    if any(map(_is_stored, jax.tree.leaves(inner_state, is_leaf=_is_stored))):
      raise ValueError(
        "quantize_state: the inner state already holds quantised leaves (a "
        "quantize_state or adam_8bit inside it); quantise the state once."
      )
    return quantized(inner_state, params)

  def requantized(template, read, new_state, like, step):
    """``new_state`` quantised where ``template`` (the old state, which the
    inner update read decoded as ``read``) was, its unchanged blocks kept;
    the leaves that belong to one parameter (Adam's ``mu`` and ``nu`` of
    it: their paths end in its path) are encoded together
    (:func:`encode_many`)."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(
      template, is_leaf=_is_quantized
    )
    out = treedef.flatten_up_to(new_state)
    reads = treedef.flatten_up_to(read)
    olds = [(t, x) for (_, t), x in zip(with_paths, reads, strict=True)]
    owners = {p for p, _ in jax.tree_util.tree_flatten_with_path(like)[0]}
    groups: dict = {}
    for i, (path, t) in enumerate(with_paths):
      if _is_quantized(t):
        out[i] = jnp.asarray(out[i])  # an eager update's Python float
        owner = _tree.owner_path(path, owners)
        owner = path if owner is None else owner
        key = (owner, tuple(out[i].shape), _tree.explicit_spec(out[i]))
        groups.setdefault(key, []).append(i)
    for idx in groups.values():
      leaves = encode_many(
        [out[i] for i in idx],
        block_size,
        store_sqrt,
        stochastic,
        step=step,
        olds=[olds[i] for i in idx],
      )
      for i, q in zip(idx, leaves, strict=True):
        out[i] = q
    return jax.tree.unflatten(treedef, out)

  def check(state, like):
    want = state_type(flat, stochastic)
    if stochastic and type(state) is state_type(flat, False):
      raise ValueError(
        f"quantize_state(rounding='stochastic'): the state is a "
        f"{type(state).__name__}, without the step its random numbers hash "
        f"(a state of release 0.1, or one rounded to nearest). Convert it with "
        f"ols.{want.__name__}(*state, rounding_step=jnp.zeros((), jnp.int32))."
      )
    _opt_state.check_state_type("quantize_state", state, want)
    if stochastic:
      _check_rounding_step(state.rounding_step)
    group_of = None
    if flat:  # the groups the state was made with, whatever the gradients' dtypes
      group_of = {
        path: x.group
        for path, x in jax.tree_util.tree_flatten_with_path(
          state.inner_state, is_leaf=_flat.is_grouped
        )[0]
        if _flat.is_grouped(x)
      }
    made_like = expected(like, group_of)
    state = _tree.in_containers(state, made_like)  # a serializer's lists
    _check_layout(made_like, state)
    return state

  def update_fn(updates, state, params=None, **extra_args):
    state = check(state, params if params is not None else updates)
    step = next_step(state.rounding_step) if stochastic else None
    # The inner update runs on arrays (nnx variables taken out), its state
    # given back in the stored one's variables.
    given, updates, params = updates, *map(_tree.unwrap_variables, (updates, params))
    _tree.check_grads(updates, params)
    like = params if params is not None else updates
    stored = _tree.unwrap_variables(state.inner_state)
    if flat:
      new_updates, new_inner, groups = _flat.flat_update(
        wrapped.update,
        updates,
        stored,
        state.groups,
        params,
        extra_args,
        block_size,
        store_sqrt,
        stochastic,
        step,
      )
    else:
      groups, inner_state = None, _dequantized(stored, cast=True)
      new_updates, new_inner = wrapped.update(
        updates, inner_state, params, **extra_args
      )
      new_inner = requantized(stored, inner_state, new_inner, like, step)
    new_inner = as_stored(new_inner, state.inner_state)
    new_state = made(flat, stochastic, new_inner, groups, step)
    return as_given(new_updates, given), new_state

  return StateQuantizer(
    init_fn,
    update_fn,
    inner,
    check,
    bits=bits,
    block_size=block_size,
    min_size=min_size,
    store_sqrt=store_sqrt,
    rounding=rounding,
    select=select,
    layout=layout,
  )


def check_layout_args(owner: str, **values: Any) -> None:
  """A ValueError naming each of ``values`` that is a JAX array, as
  ``optax.inject_hyperparams`` makes every number it is given (or a
  default): they fix the state's layout, so they are named static."""
  arrays = [n for n, v in values.items() if isinstance(v, jax.Array)]
  if arrays:
    names = ", ".join(f"'{n}'" for n in values)
    raise ValueError(
      f"{owner}: {', '.join(f'`{n}`' for n in arrays)} given as an array "
      "(optax.inject_hyperparams makes its numbers arrays): they fix the "
      "state's layout, so they cannot be injected. Name them static: "
      f"optax.inject_hyperparams(..., static_args=({names}))."
    )


def _out_of_variables(inner_state: Any, picked: list, as_array: Callable) -> Any:
  """``inner_state`` with each leaf of ``picked`` (indices in
  ``jax.tree.leaves`` order) ``as_array`` of its value, out of the nnx
  variable holding it (where the parameters ``init`` was given were nnx
  variables, as ``nnx.Optimizer`` gives them): a variable holds an array,
  and ``nnx.Optimizer``'s update would write a QuantizedLeaf's fields into
  it."""
  leaves, treedef = jax.tree.flatten(inner_state, is_leaf=_tree.is_variable)
  if len(leaves) != len(jax.tree.leaves(inner_state)):  # not one array a variable
    leaves, treedef = jax.tree.flatten(inner_state)
  for i in picked:
    leaves[i] = as_array(_tree.unwrap(leaves[i]))
  return jax.tree.unflatten(treedef, leaves)


def as_stored(new_inner: Any, stored: Any) -> Any:
  """``new_inner``, an inner state of arrays and quantised leaves, in the nnx
  variables of ``stored`` (the state it updates; as it is where ``stored``
  holds none)."""
  treedef = jax.tree.structure(stored, is_leaf=_is_stored)
  leaves = jax.tree.leaves(new_inner, is_leaf=_is_stored)
  if not _holds_variables(stored) or treedef.num_leaves != len(leaves):
    return new_inner
  return jax.tree.unflatten(treedef, leaves)


def as_given(new_updates: Any, given: Any) -> Any:
  """``new_updates`` in the nnx variables of the updates ``given`` (as they
  are where ``given`` holds none)."""
  if not _holds_variables(given):
    return new_updates
  return jax.tree.unflatten(jax.tree.structure(given), jax.tree.leaves(new_updates))


def _holds_variables(tree: Any) -> bool:
  return any(map(_tree.is_variable, jax.tree.leaves(tree, is_leaf=_tree.is_variable)))


def _check_rounding_step(step: Any) -> None:
  """A stochastic state's ``rounding_step`` is an integer scalar: a float
  (one a hand-made or converted state holds) would be cast and a vector
  broadcast into other random numbers, silently."""
  dtype = None if isinstance(step, bool) else getattr(step, "dtype", None)
  if dtype is None and isinstance(step, int) and not isinstance(step, bool):
    dtype = np.dtype(np.int32)
  if dtype is None or not jnp.issubdtype(dtype, jnp.integer) or np.ndim(step):
    what = (
      f"{type(step).__name__}" if dtype is None else f"{dtype}{list(np.shape(step))}"
    )
    raise ValueError(
      f"quantize_state(rounding='stochastic'): the state's rounding_step must be "
      f"an integer scalar (an int32 count), got {what}. Give it "
      f"jnp.zeros((), jnp.int32), or the count the state was saved with."
    )


def next_step(step: Any) -> jax.Array:
  """The rounding step after ``step`` (int32, wrapping past ``2**31 - 1``:
  the random numbers need a new step, not an order)."""
  return jnp.asarray(step, jnp.int32) + jnp.int32(1)


def _shapes(params: Any) -> set:
  """The shapes of the parameters (a Python number's is ``()``, as it is
  once ``jax.jit`` has made it an array)."""
  return {tuple(np.shape(p)) for p in jax.tree.leaves(params)}


def _floating(x: Any) -> bool:
  """A real floating array, its abstract value, or a Python float (an array
  once traced: chosen alike eagerly and under jit); complex leaves are kept."""
  if isinstance(x, float):
    return True
  return (_tree.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)) and jnp.issubdtype(
    x.dtype, jnp.floating
  )


def _selected(select: Callable, path: tuple, x: Any) -> bool:
  """``select(path, x)``, which must be ``True`` or ``False``."""
  picked = select(path, x)
  if not isinstance(picked, (bool, np.bool_)):
    raise ValueError(
      f"quantize_state: select must return True or False, got {picked!r} for the "
      f"leaf at {_tree.keystr(path)}."
    )
  return bool(picked)


def _check_layout(expected: Any, state: Any) -> None:
  """``state`` has ``expected``'s structure and shapes, and quantised
  leaves' codes and scales their dtypes, or a ValueError naming the first
  leaf that differs. Not the dtypes of the values: an inner state's leaf
  may change dtype in an update (Adam's ``mu`` of bfloat16 parameters
  becomes float32 with float32 gradients), and ``expected`` is made from
  the gradients' dtypes when ``update`` is given no parameters."""
  got = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_stored)[0]
  want = jax.tree_util.tree_flatten_with_path(expected, is_leaf=_is_stored)[0]
  got_d, want_d = dict(got), dict(want)
  for path in [p for p, _ in want] + [p for p, _ in got]:
    g, w = got_d.get(path), want_d.get(path)
    if _describe(g, dtype=False) != _describe(w, dtype=False):
      raise ValueError(
        f"quantize_state: the state's leaf at {_tree.keystr(path)} is "
        f"{_describe(g)}, where this transformation makes {_describe(w)} for "
        "these parameters: the state was made for other parameters or by "
        "another transformation (or with another block_size or min_size). "
        "Init a fresh state, or pass the parameters it was made for."
      )
  # The same leaves in other nodes: another optimizer's state (AdaBelief's
  # count, mu and nu for Adam's, AdamW's chain for Adam's).
  got_t, want_t = (jax.tree.structure(x, is_leaf=_is_stored) for x in (state, expected))
  if got_t != want_t:
    raise ValueError(
      "quantize_state: the state's structure is not the one this "
      "transformation makes for these parameters: it was made by another "
      "transformation (or for other parameters). Init a fresh state.\n"
      f"  state: {_tree.short(got_t)}\n  made:  {_tree.short(want_t)}"
    )


def _describe(x: Any, dtype: bool = True) -> str:
  """What ``x`` is, for a message (with ``dtype``) or a comparison."""
  if x is None:
    return "nothing"
  name = lambda d: jnp.dtype(d).name if dtype else ""  # noqa: E731
  if _is_quantized(x):  # its codes' and scales' dtypes are this library's own
    return (
      f"quantised {name(x.dtype)}{list(x.codes.shape)} (codes "
      f"{jnp.dtype(x.codes.dtype).name}, scales {jnp.dtype(x.scales.dtype).name}"
      f"{list(x.scales.shape)}, block_size {x.block_size}, store_sqrt {x.sqrt})"
    )
  if isinstance(x, GroupedLeaf):
    return (
      f"quantised {name(x.dtype)}{list(x.shape)} in group {x.group} from "
      f"{x.start} (block_size {x.block_size}, store_sqrt {x.sqrt})"
    )
  if isinstance(x, (int, float, complex)):  # a Python number: jit makes it an array
    x = jax.ShapeDtypeStruct((), jnp.result_type(x))
  if getattr(x, "dtype", None) is None:
    return type(x).__name__
  return f"{name(x.dtype)}{list(getattr(x, 'shape', ()))}"


def dequantize_state(state: Any) -> Any:
  """The optimizer state with every quantised leaf in float32.

  For inspection and export: a :class:`QuantizedState` becomes the
  inner state it holds, each :class:`QuantizedLeaf` in it a float32 array
  (codes' map values times their block's scale); everything
  else is returned as it is. Works on a state holding them at any depth
  (under a loss scale, in a chain).

  Args:
    state: an optimizer state holding at least one :func:`quantize_state`
      state.

  Returns:
    The state, dequantised.

  Raises:
    ValueError: ``state`` holds no quantised leaf.
  """
  # nnx.Optimizer's state: each array (a quantised leaf's codes and scales
  # too) in a variable
  state = _tree.unwrap_variables(_opt_state.optimizer_state(state))
  is_q = lambda x: isinstance(x, _STATES) or _is_quantized(x)  # noqa: E731
  if not _tree.find_all(state, is_q):
    raise ValueError(
      f"dequantize_state: the state (a {type(state).__name__}) holds no "
      "quantize_state state."
    )

  def node(x):
    if isinstance(x, _FLAT_STATES):
      return _flat.dequantized(x.inner_state, x.groups, cast=False)
    if isinstance(x, _STATES):
      return _dequantized(x.inner_state, cast=False)
    return _dequantized(x, cast=False)

  return jax.tree.map(node, state, is_leaf=is_q)
