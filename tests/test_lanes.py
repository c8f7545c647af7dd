"""An update's per-leaf elementwise code run once on flat arrays: the same values.

``_base/lanes.flat_evaluate`` groups the leaves an optimizer updates alike
and evaluates their elementwise program once on concatenated arrays; what is
not elementwise (a norm, a trust ratio) lane by lane. Each case compares its
outputs with the jitted function's, bit for bit, and the groups it found
with what the optimizer's code says they must be.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optax_lossscale._base import lanes as _lanes
from optax_lossscale._base import tree as _tree

pytestmark = pytest.mark.standard_promotion  # optax mixes widths

K = jax.random.split(jax.random.key(0), 4)
PARAMS = {
  "a": jax.random.normal(K[0], (40, 30)),
  "b": jax.random.normal(K[1], (5,)),
  "c": jax.random.normal(K[2], (300,)),
  "d": jax.random.normal(K[3], (7, 7)).astype(jnp.bfloat16),
}
GRADS = jax.tree.map(lambda x: (x * 0.1 + 0.3).astype(x.dtype), PARAMS)


def _decay_matrices(p):
  return jax.tree.map(lambda x: x.ndim > 1, p)


# name -> (optimizer, the groups' sizes: lanes updated alike)
OPTIMIZERS = {
  "adam": (optax.adam(1e-3), [3, 1]),  # "d" is bfloat16: another program
  "adamw": (optax.adamw(1e-3, weight_decay=0.1), [3, 1]),
  "adamw, a mask": (
    optax.adamw(1e-3, weight_decay=0.1, mask=_decay_matrices),
    [1, 2, 1],
  ),
  "lion": (optax.lion(1e-3), [3, 1]),
  "sgd, nesterov": (optax.sgd(1e-2, momentum=0.9, nesterov=True), [3, 1]),
  "a schedule": (optax.adam(optax.cosine_decay_schedule(1e-3, 100)), [3, 1]),
  "global norm clipping": (
    optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
    [3, 1],
  ),
  "lamb (a trust ratio a leaf)": (optax.lamb(1e-3), [3, 1]),
  "adafactor (factored moments)": (optax.adafactor(1e-3), [3, 1]),
}


def _problem(tx, params=PARAMS, grads=GRADS):
  """The traced update and its inputs' and outputs' lanes and slots."""
  state = tx.update(grads, tx.init(params), params)[1]
  with_paths = jax.tree_util.tree_flatten_with_path(params)[0]
  owners = {path: i for i, (path, _) in enumerate(with_paths)}
  shapes = {i: x.shape for i, (_, x) in enumerate(with_paths)}
  s_paths, s_def = jax.tree_util.tree_flatten_with_path(state)

  def lane(path, x):
    owner = _tree.owner_path(path, owners)
    if owner is not None and x.shape == shapes[owners[owner]]:
      return owners[owner], path[: len(path) - len(owner)]
    return None, path

  s_lanes = [lane(p, x) for p, x in s_paths]
  g, s, p = jax.tree.leaves(grads), [x for _, x in s_paths], jax.tree.leaves(params)

  def fn(*a):
    unflat = jax.tree.unflatten
    u, new = tx.update(
      unflat(jax.tree.structure(grads), a[: len(g)]),
      unflat(s_def, a[len(g) : len(g) + len(s)]),
      unflat(jax.tree.structure(params), a[len(g) + len(s) :]),
    )
    return jax.tree.leaves(u) + s_def.flatten_up_to(new)

  args = g + s + p
  spec = dict(
    in_lanes=[*range(len(g)), *[x for x, _ in s_lanes], *range(len(p))],
    in_slots=[*["g"] * len(g), *[("s", y) for _, y in s_lanes], *["p"] * len(p)],
    out_lanes=[*range(len(g)), *[x for x, _ in s_lanes]],
    out_slots=[*["u"] * len(g), *[("s", y) for _, y in s_lanes]],
    shapes=shapes,
  )
  return fn, args, spec


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_flat_program_computes_the_same_bits(name):
  tx, sizes = OPTIMIZERS[name]
  fn, args, spec = _problem(tx)
  closed = jax.make_jaxpr(fn)(*args)
  want = jax.jit(fn)(*args)
  got = jax.jit(lambda a: _lanes.flat_evaluate(closed, a, align=256, **spec)[0])(args)
  for w, x in zip(want, got, strict=True):
    assert w.dtype == x.dtype and w.shape == x.shape
    np.testing.assert_array_equal(np.asarray(w, np.float32), np.asarray(x, np.float32))
  found = _lanes._Analysis(closed, **{k: spec[k] for k in spec})
  assert sorted(len(g) for g in found.groups) == sorted(sizes)


def test_what_is_not_elementwise_is_evaluated_lane_by_lane():
  # Lamb's trust ratio: each lane's norms are reductions ("x"), and every
  # equation after them reads one lane's own scalar: not one program.
  tx, _ = OPTIMIZERS["lamb (a trust ratio a leaf)"]
  fn, args, spec = _problem(tx)
  found = _lanes._Analysis(jax.make_jaxpr(fn)(*args), **spec)
  assert any(k == ("x", 0) for k in found.kind.values())
  # global norm clipping: the clip's scale is one number for all lanes, so
  # Adam after it is still one program over the float32 lanes
  fn, args, spec = _problem(OPTIMIZERS["global norm clipping"][0])
  found = _lanes._Analysis(jax.make_jaxpr(fn)(*args), **spec)
  assert max(len(g) for g in found.groups) == 3


def test_flat_inputs_and_outputs_and_their_padding():
  # Two lanes, a program of broadcasts, a reshape and a call; the state "m"
  # given and wanted only flat, in an order other than the lanes'.
  shapes = {"x": (3, 5), "y": (4,)}
  m = {"x": jnp.arange(15.0).reshape(3, 5), "y": jnp.arange(4.0) - 9}
  g = {"x": jnp.full((3, 5), 0.5), "y": jnp.full((4,), -2.0)}

  @jax.jit
  def helper(a, b):
    return a * b

  def fn(gx, gy, mx, my, lr):
    def one(gi, mi):
      full = jnp.full(gi.shape, 2.0) * lr
      new = helper(mi, 0.5) + full * jnp.reshape(gi.reshape(-1), gi.shape)
      return jax.nn.relu(new), new + 1.0

    (ux, nx), (uy, ny) = one(gx, mx), one(gy, my)
    return ux, uy, nx, ny

  args = [g["x"], g["y"], m["x"], m["y"], jnp.float32(0.1)]
  closed = jax.make_jaxpr(fn)(*args)
  want = jax.jit(fn)(*args)
  align = 4
  flat_m = jnp.concatenate([m["y"], jnp.pad(m["x"].reshape(-1), (0, 1))])
  outs, flats = _lanes.flat_evaluate(
    closed,
    [g["x"], g["y"], None, None, args[4]],
    in_lanes=["x", "y", "x", "y", None],
    in_slots=["g", "g", "m", "m", "lr"],
    out_lanes=["x", "y", "x", "y"],
    out_slots=["u", "u", "m", "m"],
    shapes=shapes,
    align=align,
    flat_in=[("m", _lanes.Flat(("y", "x"), flat_m))],
    flat_out=[("m", ("y", "x"))],
  )
  np.testing.assert_array_equal(outs[0], want[0])
  np.testing.assert_array_equal(outs[1], want[1])
  assert outs[2] is None and outs[3] is None
  (new_m,) = flats
  assert new_m.lanes == ("y", "x")
  expect = jnp.concatenate([want[3], jnp.pad(want[2].reshape(-1), (0, 1))])
  np.testing.assert_array_equal(new_m.value, expect)  # the padding is 0, not 1
  found = _lanes._Analysis(
    closed,
    ["x", "y", "x", "y", None],
    ["g", "g", "m", "m", "lr"],
    ["x", "y", "x", "y"],
    ["u", "u", "m", "m"],
    shapes,
  )
  assert sorted(len(grp) for grp in found.groups) == [2]  # one program for both


def test_an_input_given_neither_way_is_a_value_error():
  closed = jax.make_jaxpr(lambda x: x * 2.0)(jnp.ones(3))
  with pytest.raises(ValueError, match="no value for input"):
    _lanes.flat_evaluate(closed, [None], ["x"], ["g"], ["x"], ["u"], {"x": (3,)}, 4)


def test_lanes_mixed_by_one_operation_are_evaluated_as_traced():
  shapes = {"x": (4,), "y": (4,)}

  def fn(x, y):
    return x * 2.0 + y, y * 2.0 + x  # each output reads both lanes

  args = [jnp.arange(4.0), jnp.ones(4)]
  closed = jax.make_jaxpr(fn)(*args)
  outs, _ = _lanes.flat_evaluate(
    closed, args, ["x", "y"], ["v", "v"], ["x", "y"], ["v", "v"], shapes, 4
  )
  for w, x in zip(jax.jit(fn)(*args), outs, strict=True):
    np.testing.assert_array_equal(w, x)


def _same_as_traced(fn, args, lanes, shapes):
  closed = jax.make_jaxpr(fn)(*args)
  n_out = len(jax.eval_shape(fn, *args))
  outs, _ = _lanes.flat_evaluate(
    closed, args, lanes, ["v"] * len(args), lanes[:n_out], ["u"] * n_out, shapes, 4
  )
  for w, x in zip(jax.jit(fn)(*args), outs, strict=True):
    np.testing.assert_array_equal(w, x)
  return len(outs)


def _transposing_reshape(a, b):
  def one(v):
    return jax.lax.reshape(v, v.shape, dimensions=(1, 0)) * 2.0 + v

  return one(a), one(b)


def _permuting_broadcast(a, b):
  def one(v):
    return jax.lax.broadcast_in_dim(v, v.shape[::-1], (1, 0)) + v

  return one(a), one(b)


@pytest.mark.parametrize("fn", [_transposing_reshape, _permuting_broadcast])
def test_a_reshape_or_broadcast_that_reorders_is_not_an_identity(fn):
  x, y = jnp.arange(9.0).reshape(3, 3), jnp.arange(16.0).reshape(4, 4) * 2
  try:
    jax.make_jaxpr(fn)(x, y)
  except TypeError as e:  # older JAX: broadcast dimensions strictly increasing
    pytest.skip(str(e))
  assert _same_as_traced(fn, [x, y], ["x", "y"], {"x": (3, 3), "y": (4, 4)}) == 2


def test_zero_dimensional_lanes_are_evaluated_as_traced():
  # select_n of a 0-d lane and a 0-d number: flat, its cases would differ
  def fn(a, b):
    def one(v):
      return jnp.where(v > 0, v * 2.0, 1.0), jax.lax.select(v > 0, v, jnp.float32(3.0))

    return (*one(a), *one(b))

  args = [jnp.float32(0.5), jnp.float32(-2.0)]
  closed = jax.make_jaxpr(fn)(*args)
  lanes = ["x", "y"]
  outs, _ = _lanes.flat_evaluate(
    closed,
    args,
    lanes,
    ["v", "v"],
    ["x", "x", "y", "y"],
    ["u", "w", "u", "w"],
    {"x": (), "y": ()},
    4,
  )
  for w, x in zip(jax.jit(fn)(*args), outs, strict=True):
    np.testing.assert_array_equal(w, x)
