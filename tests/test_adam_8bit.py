"""adam_8bit: quantize_state(optax.adamw)'s state a block at a time, XLA or Pallas.

The Pallas kernel runs in Pallas' interpreter here (on a GPU, in
``benchmarks/gpu_report.py``'s test run, compiled): its updates and state
must equal the XLA path's bit for bit, and both paths' states must equal
``quantize_state(optax.adamw(...))``'s.
"""

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import versions
from jaxprs import eqns as all_eqns

import optax_lossscale as ols
from optax_lossscale._params import adam_8bit as fused

pytestmark = pytest.mark.standard_promotion  # optax's adam, apply_updates

LR = 1e-3
SHAPES = {
  "mat": (64, 128),  # blocks of whole rows' pairs
  "lead": (3, 4, 512),  # blocks within the trailing axis
  "pad": (5000,),  # the last block zero-padded
  "odd": (33 * 256,),  # an odd number of blocks: a kernel tile of one
  "small": (10,),  # not quantised
}


#: Whether XLA's CPU backend contracts the kernel's and the XLA path's
#: multiply-adds alike. The newest tested one does; jax 0.4's fuses weight
#: decay's ``update + wd * param`` into a fused multiply-add in one program
#: and not the other, two units in the last place apart at most (bit for bit
#: with FMA instructions off, ``--xla_cpu_max_isa=AVX``: measured).
FMA_ALIKE = versions.JAX >= (0, 10) or jax.default_backend() != "cpu"

#: The kernels whose bfloat16 moments run here: on a GPU the Pallas kernel
#: refuses them (test_the_gpu_kernel_refuses_bfloat16_moments_clearly).
HALF_KERNELS = ("xla",) if jax.default_backend() == "gpu" else ("xla", "pallas")


def _params(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  return {k: jnp.asarray(rng.normal(size=s), dtype) for k, s in SHAPES.items()}


def _grads(params, step):
  rng = np.random.default_rng(10 + step)
  return {
    k: jnp.asarray(
      rng.normal(size=p.shape) * 10.0 ** rng.uniform(-6, 0, p.shape), p.dtype
    )
    for k, p in params.items()
  }


def _train(tx, params, steps=3):
  state = tx.init(params)
  update = jax.jit(tx.update, donate_argnums=1)  # the old state donated
  history = []
  for t in range(steps):
    updates, state = update(_grads(params, t), state, params)
    # copies: device_get can give views of the buffers the next step donates
    snapshot = jax.device_get((updates, state))
    history.append(jax.tree.map(lambda x: np.array(x, copy=True), snapshot))
    params = optax.apply_updates(params, updates)
  return history


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _reference(weight_decay, lr=LR, **options):
  inner = optax.adamw(lr, weight_decay=weight_decay) if weight_decay else optax.adam(lr)
  return ols.quantize_state(inner, **options)


@pytest.mark.sampled
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("store_sqrt", [True, False])
def test_the_kernels_agree_and_store_quantize_states_bits(
  weight_decay, rounding, store_sqrt, monkeypatch
):
  # one program a tile of up to 16 blocks (these leaves are too small for
  # the default's 1024 programs, which would make every tile one block)
  monkeypatch.setattr(fused, "_PROGRAMS", 1)
  options = dict(rounding=rounding, store_sqrt=store_sqrt)
  params = _params()
  ref = _train(_reference(weight_decay, **options), params)
  xla = _train(ols.adam_8bit(LR, weight_decay=weight_decay, **options), params)
  pallas = _train(
    ols.adam_8bit(LR, weight_decay=weight_decay, kernel="pallas", **options), params
  )
  for (u_ref, s_ref), (u_xla, s_xla), (u_pl, s_pl) in zip(
    ref, xla, pallas, strict=True
  ):
    # the kernel is the XLA path, bit for bit: its state always, its updates
    # where the compiler contracts the same multiply-adds (see FMA_ALIKE)
    assert jax.tree.structure((u_pl, s_pl)) == jax.tree.structure((u_xla, s_xla))
    assert _bits(s_pl) == _bits(s_xla)
    if FMA_ALIKE or not weight_decay:
      assert _bits(u_pl) == _bits(u_xla)
    else:
      for a, b in zip(jax.tree.leaves(u_pl), jax.tree.leaves(u_xla), strict=True):
        # the sum ``adam + wd * param`` one unit apart, and the learning
        # rate's product rounds each once more: two units of the result
        a, b = np.asarray(a), np.asarray(b)
        assert np.all(np.abs(a - b) <= 2 * np.spacing(np.maximum(np.abs(a), np.abs(b))))
    # the state is quantize_state's: the same structure, codes and scales
    assert jax.tree.structure(s_xla) == jax.tree.structure(s_ref)
    assert _bits(s_xla) == _bits(s_ref)
    for k in SHAPES:
      quantised = isinstance(s_xla.inner_state[0].mu[k], ols.QuantizedLeaf)
      assert quantised == (k != "small")
    # The updates: XLA rewrites the bias corrections' divisions in each
    # program as it fuses it (a / b / c as a / (b * c), or a * (1 / b)). After
    # the two programs part, each rounds three times (two divisions, the
    # learning rate's product), half a unit in the last place of a value
    # within a factor 2 of the result each: 3 units each side, 6 apart; with
    # weight decay, of the Adam term (at most about the learning rate)
    # before the decay is added.
    for k in SHAPES:
      a, b = np.asarray(u_ref[k]), np.asarray(u_xla[k])
      ulp = np.spacing(np.maximum(np.abs(a), np.float32(LR)))
      assert np.all(np.abs(a - b) <= 6 * ulp), k


def test_a_schedule_and_bfloat16_moments():
  schedule = optax.linear_schedule(1e-2, 1e-3, 5)
  params = _params(jnp.bfloat16)  # Adam's moments in bfloat16, stored as such
  ref = _train(ols.quantize_state(optax.adam(schedule)), params)
  for kernel in HALF_KERNELS:
    got = _train(ols.adam_8bit(schedule, kernel=kernel), params)
    for (u_ref, s_ref), (u, s) in zip(ref, got, strict=True):
      assert s.inner_state[0].mu["mat"].dtype == jnp.bfloat16
      assert _bits(s) == _bits(s_ref)  # the schedule's count included
      for a, b in zip(jax.tree.leaves(u_ref), jax.tree.leaves(u), strict=True):
        # bfloat16 updates: the 6 float32 units above round to at most one
        # of bfloat16's
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        ulp = np.asarray(jnp.spacing(jnp.asarray(np.abs(a), jnp.bfloat16)), np.float32)
        assert np.all(np.abs(a - b) <= ulp)


def test_the_gpu_kernel_refuses_bfloat16_moments_clearly(monkeypatch):
  # Pallas' Triton lowering has no bfloat16 arithmetic (seen on an H200):
  # on a GPU the kernel says so before lowering. A shape of its own, so that
  # no cached trace of the kernel skips the check.
  params = {"w": jnp.ones((9, 1000), jnp.bfloat16)}  # above min_size
  tx = ols.adam_8bit(LR, kernel="pallas")
  state = tx.init(params)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with pytest.raises(ValueError, match="float32 moments only, got bfloat16"):
    tx.update(params, state, params)


def test_under_the_loss_scale_and_master_weights_a_skipped_step_changes_nothing():
  params = _params(jnp.bfloat16)
  make = lambda inner: ols.dynamic_loss_scale(  # noqa: E731
    ols.master_weights(inner), initial_scale=2.0**10
  )
  runs = []
  for inner in (ols.quantize_state(optax.adam(LR)), ols.adam_8bit(LR, kernel="pallas")):
    tx = make(inner)
    state, p = tx.init(params), params
    update = jax.jit(tx.update)
    history = []
    for t in range(3):
      g = jax.tree.map(lambda x: (x * 2.0**10).astype(jnp.bfloat16), _grads(params, t))
      if t == 1:
        g["mat"] = g["mat"].at[0, 0].set(jnp.nan)
      u, state = update(g, state, p)
      p = optax.apply_updates(p, u)
      history.append((p, state))
    runs.append(history)
  ref, got = runs
  assert int(got[-1][1].skipped_steps) == 1
  # the skipped step kept the quantised state as it was
  assert _bits(got[1][1].inner_state) == _bits(got[0][1].inner_state)
  # the moments are quantize_state's (the master weights a few units apart:
  # the updates, above)
  for (_, s_ref), (_, s) in zip(ref, got, strict=True):
    assert _bits(_quantised(s)) == _bits(_quantised(s_ref))
    assert float(ols.get_scale(s)) == float(ols.get_scale(s_ref))


def _quantised(state):
  is_q = lambda x: isinstance(x, ols.QuantizedLeaf)  # noqa: E731
  return [x for x in jax.tree.leaves(state, is_leaf=is_q) if is_q(x)]


def test_a_tile_is_whole_blocks_dividing_the_leaf_and_leaves_enough_programs():
  for rows, block_size, programs, want in [
    (32, 256, 1, 16),
    (20, 256, 1, 4),
    (33, 256, 1, 1),
    (6, 4096, 1, 1),
    (32, 256, 4, 8),  # 16 would leave 2 programs
    (1024, 256, 1024, 1),  # a 512 x 512 leaf: one block a program
    (4096, 256, 1024, 4),
    (2**20, 256, 1024, 16),  # at most _TILE elements
    (3 * 2**12, 256, 1024, 8),  # 16 does not leave 1024
    (48, 256, 1024, 1),  # fewer blocks than programs
  ]:
    tile = fused._tile_rows(rows, block_size, programs)
    assert tile == want and rows % tile == 0
    assert tile * block_size <= max(fused._TILE, block_size)
    assert tile == 1 or rows // tile >= programs


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"learning_rate": "fast"}, "learning_rate"),
    ({"b1": 1.0}, "b1"),
    ({"b1": 1 - 1e-9}, "b1"),  # 1.0 in float32: a zero bias correction
    ({"learning_rate": 1e39}, "learning_rate"),  # inf in float32
    ({"learning_rate": float("nan")}, "learning_rate"),
    ({"learning_rate": True}, "learning_rate"),
    ({"eps": float("inf")}, "eps"),
    ({"b2": -0.1}, "b2"),
    ({"eps": -1e-8}, "eps"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"kernel": "cuda"}, "kernel"),
    ({"block_size": 100}, "block_size"),
    ({"rounding": "up"}, "rounding"),
  ],
)
def test_bad_arguments_are_value_errors(kwargs, match):
  kwargs = {"learning_rate": LR, **kwargs}
  with pytest.raises(ValueError, match=match):
    ols.adam_8bit(**kwargs)


def test_a_state_it_did_not_make_or_missing_parameters_are_value_errors():
  params = _params()
  grads = _grads(params, 0)
  tx = ols.adam_8bit(LR)
  other = ols.quantize_state(optax.sgd(LR, momentum=0.9)).init(params)
  with pytest.raises(ValueError, match="quantize_state"):
    tx.update(grads, other, params)
  smaller = tx.init({k: v for k, v in params.items() if k != "pad"})
  with pytest.raises(ValueError, match="quantize_state"):
    tx.update(grads, smaller, params)
  decayed = ols.adam_8bit(LR, weight_decay=0.1)
  state = decayed.init(params)
  with pytest.raises(ValueError, match="weight_decay needs the parameters"):
    decayed.update(grads, state)
  # without weight decay the parameters are optional, as for optax.adam
  u, _ = tx.update(grads, tx.init(params))
  assert jax.tree.structure(u) == jax.tree.structure(grads)


def test_copies_rebuild_the_same_transformation():
  tx = ols.adam_8bit(LR, b1=0.8, weight_decay=0.01, kernel="pallas", min_size=1024)
  again = copy.deepcopy(tx)
  assert isinstance(again, ols.Adam8bit)
  assert (again.b1, again.weight_decay, again.kernel, again.min_size) == (
    0.8,
    0.01,
    "pallas",
    1024,
  )
  params = _params()
  assert _bits(_train(again, params, 1)) == _bits(_train(tx, params, 1))


def test_zero_size_scalar_and_nonfinite_leaves_as_quantize_state_has_them():
  # min_size=0: every leaf with elements is quantised, the scalar included;
  # a zero-size leaf is kept; a NaN and an infinity make an infinite scale
  params = {
    "w": jnp.ones((4, 300)),
    "scalar": jnp.asarray(2.0),
    "empty": jnp.zeros((0, 3)),
  }
  grads = {
    "w": jnp.full((4, 300), 0.5).at[1, 7].set(jnp.nan).at[3, 0].set(jnp.inf),
    "scalar": jnp.asarray(0.25),
    "empty": jnp.zeros((0, 3)),
  }
  ref = ols.quantize_state(optax.adam(LR), min_size=0)
  for kernel in ("xla", "pallas"):
    tx = ols.adam_8bit(LR, min_size=0, kernel=kernel)
    s_ref, s = ref.init(params), tx.init(params)
    _, s_ref = jax.jit(ref.update)(grads, s_ref, params)
    _, s = jax.jit(tx.update)(grads, s, params)
    assert _bits(s) == _bits(s_ref)
    mu = s.inner_state[0].mu
    assert isinstance(mu["scalar"], ols.QuantizedLeaf)
    assert not isinstance(mu["empty"], ols.QuantizedLeaf)
    assert np.isinf(np.asarray(mu["w"].scales)).any()


def test_one_trace_a_leaf_shape_however_often_it_is_called(monkeypatch):
  # the block step is one jitted program a transformation and leaf shape:
  # eager updates and retraces of the step reuse it
  from optax_lossscale._params import quantize_codec as codec

  jax.clear_caches()  # the programs are shared with other tests' (equal steps)
  params = {"a": jnp.ones((64, 128)), "b": jnp.ones((64, 128)) * 2}
  tx = ols.adam_8bit(LR)
  state = tx.init(params)
  traced = []
  code_blocks = codec.code_blocks
  monkeypatch.setattr(
    codec, "code_blocks", lambda *a, **k: traced.append(1) or code_blocks(*a, **k)
  )
  for _ in range(3):
    _, state = tx.update(params, state, params)
  jax.jit(tx.update).lower(params, state, params)
  assert len(traced) == 2  # mu's and nu's encoder, once


def test_one_reduction_finds_both_moments_block_extremes():
  # XLA's path reads each leaf's recomputed moments once for their blocks'
  # extremes (one variadic reduction a leaf, as quantize_state's encoder),
  # not once for each minimum and maximum
  params = {"a": jnp.ones((64, 128)), "b": jnp.ones((32, 256)), "c": jnp.ones(10)}
  tx = ols.adam_8bit(LR)
  state = tx.init(params)
  jaxpr = jax.make_jaxpr(tx.update)(params, state, params)
  names = [e.primitive.name for e in all_eqns(jaxpr.jaxpr)]
  assert names.count("reduce") == 2  # the two quantised leaves
  assert "reduce_min" not in names and "reduce_max" not in names


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_the_kernel_writes_codes_and_scales_in_place_and_the_callers_state_survives(
  weight_decay, rounding
):
  # Each quantised leaf's kernel aliases its codes and scales (inputs) to
  # its new ones (outputs), so that XLA writes the state's donated buffers
  # instead of new ones and a copy of each; a state not donated is kept.
  params = _params()
  tx = ols.adam_8bit(LR, weight_decay=weight_decay, kernel="pallas", rounding=rounding)
  state = tx.init(params)
  grads = _grads(params, 0)
  jaxpr = jax.make_jaxpr(tx.update)(grads, state, params).jaxpr
  calls = [e for e in all_eqns(jaxpr) if e.primitive.name == "pallas_call"]
  assert len(calls) == len(SHAPES) - 1  # one a quantised leaf
  for e in calls:
    aliases = dict(e.params["input_output_aliases"])
    outs = [v.aval for v in e.outvars]
    # the outputs: update, then mu's codes and scales, nu's codes and scales
    assert sorted(aliases.values()) == [1, 2, 3, 4]
    for i, o in aliases.items():
      assert e.invars[i].aval.shape == outs[o].shape
      assert e.invars[i].aval.dtype == outs[o].dtype
    assert [outs[o].dtype for o in (1, 3)] == [jnp.uint8, jnp.uint8]
  before = _bits(state)
  once = jax.jit(tx.update)(grads, state, params)  # not donated
  assert _bits(state) == before
  assert _bits(jax.jit(tx.update)(grads, state, params)) == _bits(once)


def _close_params(got, want, updates, bound=6):
  """``got`` is ``want`` (``params + updates``) but for the updates' few
  units in the last place (each program rewrites Adam's divisions as it
  fuses them: the test above) and the sum's one rounding."""
  for a, b, u in zip(*map(jax.tree.leaves, (got, want, updates)), strict=True):
    a, b, u = (np.asarray(x, np.float32) for x in (a, b, u))
    ulp = np.spacing(np.maximum(np.abs(u), np.float32(LR)))
    assert np.all(np.abs(a - b) <= bound * ulp + np.spacing(np.abs(b)))


@pytest.mark.sampled
@pytest.mark.parametrize("kernel", ["xla", "pallas"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_apply_gradients_is_update_then_apply_updates(
  kernel, weight_decay, rounding, dtype
):
  # three steps, the old state and parameters donated: the state bit for
  # bit the update's, the parameters optax's apply_updates of its updates
  if dtype == "bfloat16" and kernel not in HALF_KERNELS:
    pytest.skip("the GPU's Pallas kernel refuses bfloat16 moments")
  params = _params(jnp.dtype(dtype))
  tx = ols.adam_8bit(LR, weight_decay=weight_decay, rounding=rounding, kernel=kernel)
  update = jax.jit(tx.update)
  apply = jax.jit(tx.apply_gradients, donate_argnums=(1, 2))
  state = tx.init(params)
  ref_params, ref_state = params, state
  params = jax.tree.map(jnp.copy, params)  # donated below
  for t in range(3):
    grads = _grads(params, t)
    u, ref_state = update(grads, ref_state, ref_params)
    want = optax.apply_updates(ref_params, u)
    params, state = apply(grads, state, params)
    assert jax.tree.structure(params) == jax.tree.structure(want)
    assert all(
      a.dtype == b.dtype
      for a, b in zip(*map(jax.tree.leaves, (params, want)), strict=True)
    )
    assert _bits(state) == _bits(ref_state)
    _close_params(params, want, u, bound=6 if dtype == "float32" else 0)
    ref_params = params  # each step from the same parameters


def test_apply_gradients_writes_the_parameters_in_place_and_needs_them():
  params = _params()
  tx = ols.adam_8bit(LR, kernel="pallas")
  state, grads = tx.init(params), _grads(params, 0)
  jaxpr = jax.make_jaxpr(tx.apply_gradients)(grads, state, params).jaxpr
  calls = [e for e in all_eqns(jaxpr) if e.primitive.name == "pallas_call"]
  assert len(calls) == len(SHAPES) - 1
  for e in calls:
    aliases = dict(e.params["input_output_aliases"])
    assert sorted(aliases.values()) == [0, 1, 2, 3, 4]
    (param,) = [i for i, o in aliases.items() if o == 0]
    assert e.invars[param].aval.dtype == e.outvars[0].aval.dtype == jnp.float32
  before = _bits((params, state))
  new = jax.jit(tx.apply_gradients)(grads, state, params)  # nothing donated
  assert _bits((params, state)) == before
  assert _bits(jax.jit(tx.apply_gradients)(grads, state, params)) == _bits(new)
  for kernel in ("xla", "pallas"):
    tx = ols.adam_8bit(LR, kernel=kernel)
    with pytest.raises(ValueError, match="apply_gradients.*needs the parameters"):
      tx.apply_gradients(grads, tx.init(params), None)


def test_the_xla_paths_apply_gradients_is_update_then_apply_updates_compiled():
  # the same program: no copy of a parameter where the two calls have none
  # (written in block shape and reshaped, the parameter was copied into
  # its donated buffer)
  import re

  params = {"w": jnp.ones((1024, 1024)), "pad": jnp.ones(5000)}
  tx = ols.adam_8bit(LR)
  state = tx.init(params)

  def update_then_apply(g, s, p):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  copies = []
  for f in (update_then_apply, tx.apply_gradients):
    hlo = jax.jit(f, donate_argnums=(1, 2)).lower(params, state, params).compile()
    copies.append(re.findall(r"= f32\[(?:1024,1024|5000)\]\S* copy\(", hlo.as_text()))
  assert copies[1] == copies[0] == []


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_apply_gradients_on_python_scalar_float64_zero_size_and_nonfinite_leaves(
  kernel,
):
  # as update then optax.apply_updates: a Python number and a NumPy float64
  # parameter come back float32 arrays, a zero-size one as it is, a NaN and
  # an infinity in a gradient reach their parameters
  params = {
    "s": 2.0,
    "f": np.linspace(-1.0, 1.0, 300),
    "e": jnp.zeros((0, 3)),
    "w": jnp.ones((4, 300)),
  }
  grads = {
    "s": 0.5,
    "f": np.full(300, 0.5),
    "e": jnp.zeros((0, 3)),
    "w": jnp.full((4, 300), 0.5).at[1, 7].set(jnp.nan).at[3, 0].set(jnp.inf),
  }
  tx = ols.adam_8bit(LR, min_size=0, kernel=kernel)
  state = tx.init(params)
  new, new_state = tx.apply_gradients(grads, state, params)
  updates, same_state = tx.update(grads, state, params)
  want = optax.apply_updates(params, updates)
  assert _bits(new_state) == _bits(same_state)
  assert jax.tree.structure(new) == jax.tree.structure(want)
  for k in params:
    a, b = np.asarray(new[k]), np.asarray(want[k])
    assert a.shape == b.shape and a.dtype == b.dtype == np.float32, k
    np.testing.assert_array_equal(a, b)
  assert np.isnan(new["w"][1, 7]) and not np.isfinite(new["w"][3, 0])


@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
@pytest.mark.parametrize("learning_rate", [0.01, 1e-3 / 3])
def test_a_constant_learning_rate_is_kept_as_given_for_float64(
  learning_rate, weight_decay
):
  """Refused where float32 cannot hold it, but kept as given: float64
  parameters (x64 on) are stepped with the float64 rate, as optax's adam
  steps them (a float32 copy of 0.01 moved every update 2e-8 apart)."""
  make = optax.adamw if weight_decay else optax.adam
  with versions.x64():
    params = {"w": jnp.asarray(np.linspace(-1.0, 1.0, 512), jnp.float64)}
    grads = {"w": jnp.asarray(np.linspace(1.0, -1.0, 512), jnp.float64)}
    tx = ols.adam_8bit(learning_rate, weight_decay=weight_decay, min_size=0)
    assert tx.learning_rate == learning_rate
    kw = {"weight_decay": weight_decay} if weight_decay else {}
    ref = ols.quantize_state(make(learning_rate, **kw), min_size=0)
    got, _ = tx.update(grads, tx.init(params), params)
    want, _ = ref.update(grads, ref.init(params), params)
    assert got["w"].dtype == jnp.float64
    np.testing.assert_allclose(got["w"], want["w"], rtol=4 * 2.0**-52, atol=0)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_injected_hyper_parameters_are_taken_traced(kernel, weight_decay, monkeypatch):
  """Under ``optax.inject_hyperparams`` the learning rate (and b1, b2, eps,
  the decay) are traced in a jitted update: taken as optax's Adam takes
  them (each leaf's program and the kernel get them as operands), so
  ``set_learning_rate`` works; the state is that of
  ``quantize_state(inject_hyperparams(optax.adamw))``, bit for bit, each
  step (they were a ValueError, one name at a time)."""
  monkeypatch.setattr(fused, "_PROGRAMS", 1)
  params = _params()
  inject = optax.inject_hyperparams
  tx = inject(ols.adam_8bit, static_args=("block_size", "min_size"))(
    learning_rate=LR, b2=0.99, weight_decay=weight_decay, kernel=kernel
  )
  ref = ols.quantize_state(
    inject(optax.adamw)(learning_rate=LR, b2=0.99, weight_decay=weight_decay)
  )
  states = [ols.set_learning_rate(t.init(params), 5e-4) for t in (tx, ref)]
  for t in range(3):
    (u, s), (u_ref, s_ref) = (
      jax.jit(t_.update)(_grads(params, t), s_, params)
      for t_, s_ in zip((tx, ref), states, strict=True)
    )
    states = [s, s_ref]
    assert _bits(s.inner_state) == _bits(s_ref.inner_state.inner_state)
    for k in SHAPES:  # as test_the_kernels_agree_and_store_quantize_states_bits
      a, b = np.asarray(u_ref[k]), np.asarray(u[k])
      ulp = np.spacing(np.maximum(np.abs(a), np.float32(5e-4)))
      assert np.all(np.abs(a - b) <= 6 * ulp), k
    assert float(ols.get_learning_rate(s)) == np.float32(5e-4)
    params = optax.apply_updates(params, u)


def test_injected_layout_arguments_are_refused_by_name():
  tx = optax.inject_hyperparams(ols.adam_8bit)(learning_rate=LR)
  params = _params()
  with pytest.raises(ValueError, match="`block_size`, `min_size` given as an array"):
    jax.jit(tx.update)(_grads(params, 0), tx.init(params), params)


def test_injected_and_rebuilt_every_update_it_traces_a_leaf_shape_once(monkeypatch):
  """optax.inject_hyperparams builds adam_8bit anew at every update: eagerly
  each leaf shape's program was traced and compiled again at every step
  (its hyper-parameters baked in), about a second a step."""
  from optax_lossscale._params import quantize_codec as codec

  jax.clear_caches()  # the programs are shared with other tests' (equal steps)
  params = {"a": jnp.ones((64, 128)), "b": jnp.ones((64, 128)) * 2}
  tx = optax.inject_hyperparams(ols.adam_8bit, static_args=("block_size", "min_size"))(
    learning_rate=LR
  )
  state = tx.init(params)
  traced = []
  code_blocks = codec.code_blocks
  monkeypatch.setattr(
    codec, "code_blocks", lambda *a, **k: traced.append(1) or code_blocks(*a, **k)
  )
  for rate in (1e-3, 5e-4, 2e-4):  # a new rate each step: an operand
    state = ols.set_learning_rate(state, rate)
    _, state = tx.update(params, state, params)
  assert len(traced) == 2  # mu's and nu's encoder, once


def test_under_inject_hyperparams_its_default_is_adam_without_parameters():
  """Its default weight_decay (None) is not injected: Adam's state, whose
  update needs no parameters, that of quantize_state(inject(optax.adam))."""
  params = _params()
  tx = optax.inject_hyperparams(ols.adam_8bit, static_args=("block_size", "min_size"))(
    learning_rate=LR
  )
  ref = ols.quantize_state(optax.inject_hyperparams(optax.adam)(learning_rate=LR))
  states = [t.init(params) for t in (tx, ref)]
  assert jax.tree.structure(states[0].inner_state.inner_state) == jax.tree.structure(
    states[1].inner_state.inner_state
  )
  grads = _grads(params, 0)
  (_, s), (_, s_ref) = (
    jax.jit(t.update)(grads, st) for t, st in zip((tx, ref), states, strict=True)
  )
  assert _bits(s.inner_state) == _bits(s_ref.inner_state.inner_state)


def test_a_half_precision_hyper_parameter_names_hyperparam_dtype():
  params = {"w": jnp.ones((64, 128), jnp.bfloat16)}
  tx = optax.inject_hyperparams(ols.adam_8bit, static_args=("block_size", "min_size"))(
    learning_rate=LR
  )
  with pytest.raises(ValueError, match="hyperparam_dtype=jnp.float32"):
    tx.init(params)


@dataclasses.dataclass
class _Warmup:
  """A schedule that is a dataclass: equal by value, unhashable."""

  steps: int = 10

  def __call__(self, count):
    return LR * jnp.minimum(1.0, (count + 1) / self.steps)


@pytest.mark.parametrize(
  "schedule",
  [lambda c: LR / (1.0 + c), optax.linear_schedule(LR, 0.0, 100), _Warmup()],
  ids=["a function", "optax's", "an unhashable dataclass"],
)
def test_any_schedule_steps_as_quantize_state_does(schedule):
  """Each leaf's program is keyed by its constants, a schedule by identity
  (a dataclass schedule could not be hashed): the state is quantize_state's
  bit for bit under jit, and eagerly the step runs too."""
  params = _params()
  txs = (ols.adam_8bit(schedule), _reference(0.0, lr=schedule))
  states = [tx.init(params) for tx in txs]
  for t in range(2):
    grads = _grads(params, t)
    outs = [
      jax.jit(tx.update)(grads, s, params) for tx, s in zip(txs, states, strict=True)
    ]
    eager = txs[0].update(grads, states[0], params)
    states = [s for _, s in outs]
    assert _bits(states[0]) == _bits(states[1])
    np.testing.assert_allclose(
      eager[0]["lead"], outs[0][0]["lead"], rtol=1e-5, atol=1e-9
    )
