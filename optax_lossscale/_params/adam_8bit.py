"""Adam with 8-bit moments in one pass: each block decoded, updated, encoded at once.

:func:`adam_8bit` is ``quantize_state(optax.adamw(...))`` (or of
``optax.adam`` without weight decay) computed a leaf at a time: Adam
updates each element from its own gradient, parameter and moments, so a
block of a leaf can be decoded, updated and encoded in one step, reading
the gradient, the codes and the scales once (and the parameter, where
AdamW's decay needs it) and writing the update, the codes and the scales
once; :meth:`Adam8bit.apply_gradients` writes the new parameter instead of
the update. ``kernel="xla"`` writes that step
with XLA's operations on the whole leaf; ``kernel="pallas"`` runs the same
step as one Pallas kernel a tile of blocks (on a GPU; elsewhere Pallas'
interpreter runs it, for tests). Both give :func:`quantize_state`'s bits:
the same decoder, the same optax update and the same encoder on the same
values.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_lossscale._base import tree as _tree
from optax_lossscale._base import validate as _validate
from optax_lossscale._params import quantize_codec as _codec
from optax_lossscale._params.quantize_state import (
  QuantizedLeaf,
  as_given,
  as_stored,
  check_layout_args,
  encode_many,
  made,
  next_step,
  quantize_state,
)

__all__ = ["Adam8bit", "adam_8bit"]

_KERNELS = ("xla", "pallas")
_F32 = jnp.dtype(jnp.float32)
#: Elements a Pallas program handles (its tile: whole blocks, at most this many).
_TILE = 4096
#: Programs a Pallas kernel is launched with at least, where a leaf has the
#: blocks: a GPU runs each program on one multiprocessor, and tiles of 4096
#: on the 8-bit workload's leaves (64 programs, an H200 has 132
#: multiprocessors) left most of it idle (BENCHMARKS.md, 8-bit state).
_PROGRAMS = 1024


@_tree.rebuilt_as_itself
class Adam8bit(optax.GradientTransformationExtraArgs):
  """What :func:`adam_8bit` returns: an optax transformation, with
  :meth:`apply_gradients` beside ``update`` (the step applied).

  Attributes:
    quantized: the :func:`quantize_state` transformation whose state and
      bits it has.
    kernel: as given.
  """

  def __new__(cls, init, update, quantized, apply_gradients, **options):
    self = super().__new__(cls, init, update)
    self.quantized, self.options = quantized, options
    self._apply_gradients = apply_gradients
    for name, value in options.items():
      setattr(self, name, value)
    return self

  def apply_gradients(self, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
    """One step applied: ``(new_params, new_state)``.

    ``updates, new_state = self.update(grads, state, params)`` and
    ``optax.apply_updates(params, updates)`` in one: the state bit for bit,
    the parameters but for the updates' few units in the last place (XLA
    fuses each program's divisions its own way). Each quantised leaf's
    step writes its parameter where it writes its codes and scales: with
    ``kernel="pallas"`` the kernel reads the gradient, the parameter, the
    codes and the scales once and writes the parameter, the codes and the
    scales in place, where ``update`` writes the update for
    ``apply_updates`` to read back (BENCHMARKS.md, 8-bit state). The XLA
    path is ``update`` and ``optax.apply_updates`` as they are (XLA fuses
    the addition into its step).

    Args:
      grads: the gradients, as ``update`` takes them.
      state: this transformation's state.
      params: the parameters (arrays, or nnx variables: the new ones come
        back in them).

    Returns:
      The new parameters, in ``params``' dtypes, and the new state.

    Raises:
      ValueError: ``params`` is ``None``, and what ``update`` raises.
    """
    return self._apply_gradients(grads, state, params)

  def __reduce__(self):  # copy/pickle: rebuilt from what made it
    return (functools.partial(adam_8bit, **self.options), ())


def adam_8bit(
  learning_rate: Any,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps_root: float = 0.0,
  weight_decay: float | None = None,
  *,
  block_size: int = 256,
  min_size: int = 4096,
  store_sqrt: bool = True,
  rounding: str = "nearest",
  kernel: str = "xla",
) -> Adam8bit:
  """Adam (AdamW with ``weight_decay``) with 8-bit moments, a block at a time.

  Under ``jax.jit``, the state and the stored codes are those of
  ``quantize_state(optax.adamw(learning_rate, b1, b2, eps, eps_root,
  weight_decay=weight_decay), block_size=..., min_size=..., store_sqrt=...,
  rounding=...)`` (``optax.adam`` where ``weight_decay`` is 0), bit for
  bit, and the updates agree to a few units in the last place (XLA fuses
  the bias corrections differently in each program): a state of one is a
  state of the other (:func:`dequantize_state`, checkpoints and the loss
  scale read it alike). Run op by op, outside ``jax.jit``, bfloat16
  moments may round differently: the block step is always one compiled
  program, whose bfloat16 arithmetic XLA may carry in float32. What
  differs is how a quantised leaf is computed: its gradient, codes and
  scales (and with weight decay its parameter) are read once, and each
  block is decoded, updated by optax's Adam and encoded in one step (Adam
  is elementwise: a block's update needs nothing from another block),
  where :func:`quantize_state`, which wraps any transformation, decodes
  the whole state, runs it and encodes the result.

  ``kernel="pallas"`` runs that step as a Pallas kernel, one program a tile
  of whole blocks, on a GPU through Pallas' Triton lowering (float32
  moments only: bfloat16 ones are a ``ValueError`` there); on another
  backend Pallas' interpreter runs it (slowly: for tests). A leaf sharded
  explicitly (JAX's explicit sharding) is computed as
  :func:`quantize_state` computes it, and a
  custom kernel is not partitioned by XLA's automatic sharding: use
  ``kernel="pallas"`` on one device or inside ``shard_map``.
  :meth:`Adam8bit.apply_gradients` takes the step and applies it, so that
  the kernel writes the parameters in place. Measured in BENCHMARKS.md
  ("8-bit state").

  Args:
    learning_rate: a float, or a schedule (a function of the step count).
    b1, b2, eps, eps_root: Adam's, as ``optax.adam`` takes them.
    weight_decay: AdamW's decoupled weight decay (>= 0; with it ``update``
      needs the parameters); ``None`` (the default) or 0 is Adam. A JAX
      array, as ``optax.inject_hyperparams`` gives one it is passed, is
      AdamW's whatever its value (its state is ``optax.adamw``'s). Under
      ``optax.inject_hyperparams`` every one of these may be injected (and
      traced), ``block_size`` and ``min_size`` not: name them in its
      ``static_args``.
    block_size, min_size, store_sqrt, rounding: as :func:`quantize_state`
      takes them.
    kernel: ``"xla"`` or ``"pallas"``.

  Returns:
    An :class:`Adam8bit` (an ``optax.GradientTransformationExtraArgs``)
    whose state is :func:`quantize_state`'s (a :class:`QuantizedState`, or
    rounded stochastically a :class:`StochasticQuantizedState`).

  Raises:
    ValueError: a bad hyper-parameter or ``kernel`` (and what
      :func:`quantize_state` raises); ``update`` with a state
      made for other parameters or by another transformation, or without
      parameters where ``weight_decay`` is not 0.

  Example:
    >>> import jax.numpy as jnp, optax, optax_lossscale as ols
    >>> tx = ols.adam_8bit(1e-3, min_size=0)
    >>> params = {"w": jnp.linspace(-1.0, 1.0, 512)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.linspace(1.0, -1.0, 512)}, state, params)
    >>> float(ols.dequantize_state(state)[0].mu["w"][0])  # 0.1 * 1.0
    0.10000000149011612
  """
  # As float32 computes with them: b1 = 1 - 1e-9 is 1.0 there (a zero bias
  # correction), 1e39 is inf. A traced value (optax.inject_hyperparams'
  # under jit) is taken as optax's Adam takes it, unchecked.
  if not callable(learning_rate) and not _traced(learning_rate):
    _validate.as_f32("learning_rate", learning_rate)  # a number kept as given (float64)
    if not isinstance(learning_rate, jax.Array):
      learning_rate = _validate.as_float("learning_rate", learning_rate)
  weight_decay = 0.0 if weight_decay is None else weight_decay
  for name, given in (("b1", b1), ("b2", b2)):
    if not _traced(given) and not 0.0 <= _validate.as_f32(name, given) < 1.0:
      raise ValueError(
        f"`{name}` must be in [0, 1) in float32, got {given!r}.{_cast_hint(given)}"
      )
  for name, value in (
    ("eps", eps),
    ("eps_root", eps_root),
    ("weight_decay", weight_decay),
  ):
    if not _traced(value) and not _validate.as_f32(name, value) >= 0.0:
      raise ValueError(f"`{name}` must be >= 0, got {value}.{_cast_hint(value)}")
  if not isinstance(kernel, str) or kernel not in _KERNELS:
    raise ValueError(f"`kernel` must be one of {_KERNELS}, got {kernel!r}.")
  check_layout_args("adam_8bit", block_size=block_size, min_size=min_size)
  options = dict(learning_rate=learning_rate)
  for name, value in (
    ("b1", b1),
    ("b2", b2),
    ("eps", eps),
    ("eps_root", eps_root),
    ("weight_decay", weight_decay),
  ):
    options[name] = value if isinstance(value, jax.Array) else float(value)
  # JAX arrays (optax.inject_hyperparams' hyper-parameters, concrete or
  # traced) reach each leaf's program and kernel as operands; the numbers
  # are constants of it.
  operands = {k: v for k, v in options.items() if isinstance(v, jax.Array)}
  # AdamW's state where it decays, or where its decay is a JAX array, as
  # optax.inject_hyperparams gives it (concrete to init, traced to update):
  # the state's structure cannot follow a traced value.
  decays = "weight_decay" in operands or options["weight_decay"] != 0.0
  adam_step = _AdamStep(
    tuple(
      (k, _ByIdentity(v) if callable(v) else v)
      for k, v in options.items()
      if k not in operands
    ),
    decays,
  )
  inner = adam_step.inner(**operands)
  quantized = quantize_state(
    inner,
    block_size=block_size,
    min_size=min_size,
    store_sqrt=store_sqrt,
    rounding=rounding,
  )
  block_size, store_sqrt = quantized.block_size, quantized.store_sqrt
  stochastic = quantized.rounding == "stochastic"

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    return run(updates, state, params, apply=False)

  def apply_gradients(grads, state, params):
    if params is None:
      raise ValueError(
        "adam_8bit: apply_gradients(grads, state, params) needs the parameters."
      )
    return run(grads, state, params, apply=True)

  def run(updates, state, params, apply):
    """The update (``apply``: the new parameters) and the new state."""
    state = quantized.check(state, params if params is not None else updates)
    if decays and params is None:
      raise ValueError(
        "adam_8bit: weight_decay needs the parameters: tx.update(grads, state, "
        "params) (an array weight_decay, as optax.inject_hyperparams gives one "
        "it is passed, is AdamW's whatever its value)."
      )
    # on arrays (nnx variables taken out), as quantize_state's update
    given = params if apply else updates
    updates, params = map(_tree.unwrap_variables, (updates, params))
    _tree.check_grads(updates, params)
    inner_state = _tree.unwrap_variables(state.inner_state)
    count = next_step(state.rounding_step) if stochastic else None
    adam = inner_state[0]
    treedef = jax.tree.structure(updates)
    grads = treedef.flatten_up_to(updates)
    ps = treedef.flatten_up_to(params) if params is not None else [None] * len(grads)
    mus, nus = treedef.flatten_up_to(adam.mu), treedef.flatten_up_to(adam.nu)
    counts = (adam._replace(mu=None, nu=None), *inner_state[1:])
    scalars, scalar_def = jax.tree.flatten((counts, operands))
    step = functools.partial(adam_step, scalar_def)
    fused = [
      i
      for i, m in enumerate(mus)
      if isinstance(m, QuantizedLeaf) and _tree.explicit_spec(grads[i]) is None
    ]
    # Every other leaf: decoded, updated by optax together, encoded again
    # (a quantised one sharded explicitly: as quantize_state computes it).
    rest = sorted(set(range(len(grads))) - set(fused))
    # The Pallas kernel writes the new parameters itself (in place).
    in_kernel = apply and kernel == "pallas"
    decode = lambda x: (
      x.dequantize().astype(x.dtype) if isinstance(x, QuantizedLeaf) else x
    )  # noqa: E731
    out_u, out_m, out_v = list(grads), list(mus), list(nus)
    read_m, read_v = [decode(mus[i]) for i in rest], [decode(nus[i]) for i in rest]
    u, m, v, new_scalars = step(
      scalars,
      [grads[i] for i in rest],
      [ps[i] for i in rest] if params is not None else None,
      read_m,
      read_v,
    )
    for n, i in enumerate(rest):
      out_u[i], out_m[i], out_v[i] = u[n], m[n], v[n]
      if apply:
        out_u[i] = optax.apply_updates(ps[i], u[n])
      if isinstance(mus[i], QuantizedLeaf):
        out_m[i], out_v[i] = encode_many(
          [m[n], v[n]],
          block_size,
          store_sqrt,
          stochastic,
          step=count,
          olds=[(mus[i], read_m[n]), (nus[i], read_v[n])],
        )
    leaf_step = functools.partial(
      _fused_leaf,
      scalars,
      count,
      step=adam_step,  # hashed by its constants: _fused_leaf's cache holds
      scalar_def=scalar_def,
      block_size=block_size,
      sqrt=store_sqrt,
      stochastic=stochastic,
      kernel=kernel,
      programs=_PROGRAMS,
      apply=in_kernel,
    )
    # Adam reads no parameter (AdamW's decay and the kernel's applying do):
    # the step is not given one.
    reads = ps if decays or in_kernel else [None] * len(ps)
    for i in fused:
      out_u[i], out_m[i], out_v[i] = leaf_step(grads[i], reads[i], mus[i], nus[i])
      if apply and not in_kernel:  # XLA fuses the addition into the step
        out_u[i] = optax.apply_updates(ps[i], out_u[i])
    head, *tail = jax.tree.unflatten(jax.tree.structure(counts), new_scalars)
    head = head._replace(
      mu=jax.tree.unflatten(treedef, out_m), nu=jax.tree.unflatten(treedef, out_v)
    )
    new_inner = as_stored((head, *tail), state.inner_state)
    new_state = made(False, stochastic, new_inner, None, count)
    return as_given(jax.tree.unflatten(treedef, out_u), given), new_state

  return Adam8bit(
    quantized.init,
    update_fn,
    quantized,
    apply_gradients,
    **options,
    block_size=block_size,
    min_size=quantized.min_size,
    store_sqrt=store_sqrt,
    rounding=quantized.rounding,
    kernel=kernel,
  )


def _traced(x: Any) -> bool:
  return isinstance(x, jax.core.Tracer)


def _cast_hint(value: Any) -> str:
  """Where a hyper-parameter is an array narrower than float32: how it got so."""
  if isinstance(value, jax.Array) and jnp.dtype(value.dtype).itemsize < 4:
    return (
      " optax.inject_hyperparams casts hyper-parameters to the parameters' "
      "dtype: pass it hyperparam_dtype=jnp.float32."
    )
  return ""


class _ByIdentity:
  """``value`` (a schedule) equal to itself only: a schedule need not be
  hashable (a dataclass, an Equinox module holding arrays)."""

  def __init__(self, value: Any):
    self.value = value

  def __eq__(self, other: Any) -> bool:
    return isinstance(other, _ByIdentity) and other.value is self.value

  def __hash__(self) -> int:
    return id(self.value)


@dataclasses.dataclass(frozen=True)
class _AdamStep:
  """optax's Adam (AdamW where it ``decays``) on one leaf, tile or list of
  leaves, its constant hyper-parameters ``static``: equal, and hashed
  alike, however often ``adam_8bit`` is built (``optax.inject_hyperparams``
  builds it at every update), so each leaf shape's program is compiled
  once."""

  static: tuple
  decays: bool

  def inner(self, **given: Any) -> optax.GradientTransformation:
    """The transformation, ``given`` the hyper-parameters that are arrays."""
    hyper = {**dict(self.static), **given}
    lr = hyper.pop("learning_rate")
    lr = lr.value if isinstance(lr, _ByIdentity) else lr
    if self.decays:
      return optax.adamw(lr, **hyper)
    del hyper["weight_decay"]
    return optax.adam(lr, **hyper)

  def __call__(self, scalar_def, scalars, g, p, m, v):
    """The update, the new moments and the new counts; ``scalars`` (the
    state's counts, then the array hyper-parameters) flattened by
    ``scalar_def``."""
    (head, *rest), given = jax.tree.unflatten(scalar_def, scalars)
    u, new = self.inner(**given).update(g, (head._replace(mu=m, nu=v), *rest), p)
    new_head = new[0]
    skeleton = (new_head._replace(mu=None, nu=None), *new[1:])
    return u, new_head.mu, new_head.nu, jax.tree.leaves(skeleton)


def _tile_rows(rows: int, block_size: int, programs: int = _PROGRAMS) -> int:
  """Blocks a Pallas program handles: the largest power of two up to
  ``_TILE // block_size`` that divides ``rows`` and leaves at least
  ``programs`` programs (1 where none does)."""
  t = max(1, _TILE // block_size)
  while t > 1 and (rows % t or rows // t < programs):
    t //= 2
  return t


# One program a leaf shape, traced once and called for each leaf of that
# shape (a transformer's layers share a few): trace and compile time grow
# with the shapes, less with the leaves.
@functools.partial(
  jax.jit,
  static_argnames=(
    "step",
    "scalar_def",
    "block_size",
    "sqrt",
    "stochastic",
    "kernel",
    "programs",
    "apply",
  ),
)
def _fused_leaf(
  scalars,
  count,
  g,
  p,
  mq,
  vq,
  *,
  step,
  scalar_def,
  block_size,
  sqrt,
  stochastic,
  kernel,
  programs,
  apply,
):
  """One quantised leaf's update and new codes and scales, each block
  decoded, updated by ``step(scalar_def, ...)`` and encoded (stochastically:
  at step ``count``) in one pass, its unchanged blocks kept; a Pallas kernel
  has at least ``programs`` programs where the leaf has the blocks. With
  ``apply``, the new parameter ``p`` instead of the update (optax's
  ``apply_updates`` on each block; the kernel writes it in place)."""
  step = functools.partial(step, scalar_def)
  shape, size = tuple(g.shape), math.prod(g.shape)
  blocks = [_codec.blocks(g, block_size)] + (
    [_codec.blocks(p, block_size)] if p is not None else []
  )
  blocks += [_codec.blocks(mq.codes, block_size), mq.scales]
  blocks += [_codec.blocks(vq.codes, block_size), vq.scales]
  padded = blocks[0].size != size  # only a leaf blocked whole: (blocks, block_size)
  with_p = p is not None
  tile = lambda dtype: jax.ShapeDtypeStruct((1, block_size), dtype)  # noqa: E731
  _, m_new, v_new, _ = jax.eval_shape(  # the new moments' dtypes
    step,
    scalars,
    tile(g.dtype),
    tile(p.dtype) if with_p else None,
    tile(mq.dtype),
    tile(vq.dtype),
  )

  def body(scalars, *arrays, first_row, tiled=False):
    """The step on blocks (a leaf's, or a kernel's tile of them, ``tiled``,
    whose first block is ``first_row``); ``scalars`` end in the step count
    where the rounding is stochastic."""
    count = scalars[-1] if stochastic else None
    scalars = scalars[:-1] if stochastic else scalars
    g, p = arrays[0], (arrays[1] if with_p else None)
    mc, ms, vc, vs = arrays[1 + with_p :]
    m = _codec.decode_blocks(mc.astype(jnp.int32), ms, sqrt).astype(mq.dtype)
    v = _codec.decode_blocks(vc.astype(jnp.int32), vs, sqrt).astype(vq.dtype)
    u, m_new, v_new, _ = step(scalars, g, p, m, v)
    if apply:
      u = optax.apply_updates(p, u)

    def f32(x):
      x = jax.lax.stop_gradient(x).astype(_F32)
      if padded:  # the padding of the last block: 0
        row = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0) + first_row
        col = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
        x = jnp.where(row * block_size + col < size, x, 0.0)
      return x

    moments = [f32(m_new), f32(v_new)]
    out = [u]
    extremes = _codec.block_extremes(
      moments, one_pass=not tiled, reads=[f32(m), f32(v)]
    )
    for x, (lo, hi, changed), (c, s) in zip(
      moments, extremes, ((mc, ms), (vc, vs)), strict=True
    ):
      codes, scales = _codec.code_blocks(
        x, lo, hi, sqrt, stochastic, first_row * block_size, count
      )
      codes, scales = _codec.kept_blocks(changed, codes, scales, c, s)
      out += [codes.astype(jnp.uint8), scales]
    return out

  if kernel == "pallas" and jax.default_backend() == "gpu":
    narrow = sorted({jnp.dtype(x.dtype).name for x in (m_new, v_new)} - {"float32"})
    if narrow:  # Triton's lowering refuses their arithmetic deep inside
      raise ValueError(
        f"adam_8bit(kernel='pallas') on a GPU keeps float32 moments only, got "
        f"{', '.join(narrow)} (Pallas' Triton lowering has no arithmetic on "
        "them); use kernel='xla'."
      )
  scalars = [*scalars, count] if stochastic else scalars
  if kernel == "xla":
    u, mc, ms, vc, vs = body(scalars, *blocks, first_row=0)
  else:  # the kernel's arrays: blocks as rows, scales as a vector
    *arrays, mc, ms, vc, vs = blocks
    rows = [x.reshape(-1, block_size) for x in (*arrays, mc)] + [ms.reshape(-1)]
    rows += [vc.reshape(-1, block_size), vs.reshape(-1)]
    u, mc, ms, vc, vs = _pallas(
      body, scalars, rows, _tile_rows(rows[0].shape[0], block_size, programs), apply
    )
  leaf = lambda c, s, like, new: QuantizedLeaf(  # noqa: E731
    _codec.unblocked(c, shape, block_size),
    s.reshape(like.scales.shape),
    jnp.dtype(new.dtype),
    block_size,
    sqrt,
  )
  return (
    _codec.unblocked(u, shape, block_size),
    leaf(mc, ms, mq, m_new),
    leaf(vc, vs, vq, v_new),
  )


def _pallas(body, scalars, rows, tile, apply):
  """``body`` as a Pallas kernel over tiles of ``tile`` blocks: its outputs.

  The codes and scales (the last four rows, the last four outputs) are
  written in place, and with ``apply`` the parameter (the second row, the
  first output): a program reads its tile before writing it, and tiles do
  not overlap. Without that XLA writes them to new buffers and copies each
  into the state's donated one (BENCHMARKS.md, 8-bit state).
  """
  from jax.experimental import pallas as pl

  n_rows, block_size = rows[0].shape
  scalars = [jnp.asarray(s).reshape(1) for s in scalars]
  abstract = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in rows]
  out_shape = jax.eval_shape(
    lambda s, *r: body([x[0] for x in s], *r, first_row=0, tiled=True),
    scalars,
    *abstract,
  )
  spec = lambda x: (  # noqa: E731
    pl.BlockSpec((tile, block_size), lambda i: (i, 0))
    if x.ndim == 2
    else pl.BlockSpec((tile,), lambda i: (i,))
  )
  n_in = len(scalars)

  def kernel(*refs):
    ins, outs = refs[: n_in + len(rows)], refs[n_in + len(rows) :]
    first_row = pl.program_id(0) * tile
    values = body(
      [r[0] for r in ins[:n_in]],
      *[r[...] for r in ins[n_in:]],
      first_row=first_row,
      tiled=True,
    )
    for ref, value in zip(outs, values, strict=True):
      ref[...] = value

  return pl.pallas_call(
    kernel,
    out_shape=out_shape,
    grid=(n_rows // tile,),
    in_specs=[pl.BlockSpec((1,), lambda i: (0,)) for _ in scalars]
    + [spec(r) for r in rows],
    out_specs=[spec(o) for o in out_shape],
    input_output_aliases={
      **({n_in + 1: 0} if apply else {}),
      **{n_in + len(rows) - 4 + k: len(out_shape) - 4 + k for k in range(4)},
    },
    interpret=jax.default_backend() != "gpu",
    **_triton(),
  )(*scalars, *rows)


def _triton() -> dict:
  """``pallas_call``'s options that pick its Triton lowering on a GPU, where
  newer JAX picks Mosaic GPU (whose copies need warpgroup-sized rows)."""
  try:
    from jax.experimental.pallas import triton as pltriton
  except ImportError:  # a JAX without GPU lowering: interpreted anyway
    return {}
  params = getattr(pltriton, "CompilerParams", None) or pltriton.TritonCompilerParams
  return {"compiler_params": params()}
