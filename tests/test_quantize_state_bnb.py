"""quantize_state against bitsandbytes: its quantisation's codes and Adam8bit's steps.

Needs bitsandbytes and torch (the ``bnb`` extra, in an environment of its
own); skipped without them. bitsandbytes has two blockwise quantisation
kernels on the CPU: its C kernel, which does not round every small value to
the nearest code (elements below about 1e-3 of their block's largest may be
one code off), and its portable PyTorch kernel (``torch.bucketize`` on the
midpoints of the map), which rounds to nearest as its CUDA kernel does. The
comparisons are with the portable kernel, reached through PyTorch's
dispatcher (``CompositeExplicitAutograd``), and with our map passed in as
the code (bitsandbytes builds its map in float32 with ``torch.linspace``,
whose values depend on the CPU's vector width: up to two units in the last
place from ours).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch", reason="the bnb extra: torch")
bnb = pytest.importorskip("bitsandbytes", reason="the bnb extra: bitsandbytes")

import optax_lossscale as ols  # noqa: E402
from optax_lossscale._params import quantize_state as q  # noqa: E402

pytestmark = pytest.mark.standard_promotion  # optax's adam

PORTABLE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def portable_quantize(x, code, blocksize=256):
  """bitsandbytes' portable ``quantize_blockwise``: (codes, absmax)."""
  op = torch.ops.bitsandbytes.quantize_blockwise.default
  codes, absmax = op.redispatch(PORTABLE, x, code, blocksize)
  return codes.numpy(), absmax.numpy()


def at_rounded_midpoint(scaled, code):
  """Where ``scaled`` equals a float32 midpoint of ``code`` rounded above the
  exact one: bitsandbytes rounds those down, we up (the exact midpoint lies
  below them)."""
  c = code.astype(np.float64)
  mid = (c[:-1] + c[1:]) / 2
  mid32 = ((code[:-1] + code[1:]) / np.float32(2)).astype(np.float32)
  up = mid32[mid32.astype(np.float64) > mid]
  return np.isin(scaled, up)


def departs(blocks):
  """The blocks whose scale is not bitsandbytes' largest magnitude: those
  whose least value, divided by 0.993 (the signed map's least value, so
  that it is stored as itself), exceeds their largest. bitsandbytes scales
  them by their largest magnitude, and stores their least value 0.7%
  short."""
  scale = np.float32(1) / -q.dynamic_map(True)[0]
  return (blocks.min(axis=1) < 0) & (-blocks.min(axis=1) * scale > blocks.max(axis=1))


def our_scales(blocks):
  """Each block's scale, as the guide states it: its largest magnitude, or
  for a block that :func:`departs`, its least value divided by 0.993."""
  scale = np.float32(1) / -q.dynamic_map(True)[0]
  return np.maximum(np.abs(blocks).max(axis=1), -blocks.min(axis=1) * scale)


def nearest(scaled, code):
  """Nearest code index in float64, ties to the lower index."""
  d = np.abs(scaled[:, None].astype(np.float64) - code[None, :].astype(np.float64))
  return np.argmin(d, axis=1)


def assert_codes(ours, theirs, x, code):
  """``ours`` (codes and scales of ``x``) are bitsandbytes' (``theirs``)
  in the blocks that do not depart (but at a rounded midpoint, below), and
  in those that do, each value's nearest code under our scale."""
  codes, absmax = theirs
  blocks = x.reshape(-1, 256)
  out = departs(blocks)
  got_abs = np.abs(np.asarray(ours.scales)).reshape(-1)
  np.testing.assert_array_equal(got_abs[~out], absmax[~out])
  np.testing.assert_array_equal(got_abs[out], our_scales(blocks)[out])
  got = np.asarray(ours.codes).reshape(-1, 256)
  scaled = np.clip(blocks * (np.float32(1) / absmax[:, None]), -1, 1)
  ties = at_rounded_midpoint(scaled, code)
  kept = ~out[:, None] & ~ties
  np.testing.assert_array_equal(got[kept], codes.reshape(-1, 256)[kept])
  assert ties.sum() <= 2  # a tie is rare: counted, not hidden
  mine = np.clip(blocks[out] * (np.float32(1) / got_abs[out][:, None]), -1, 1)
  np.testing.assert_array_equal(got[out].reshape(-1), nearest(mine.reshape(-1), code))
  return out


@pytest.mark.parametrize("bits", [8, 4])
def test_the_maps_are_bitsandbytes_within_two_units_in_the_last_place(bits):
  # 8 bits: quantize_state's maps; 4: what benchmarks/quantize_4bit.py
  # simulates (bitsandbytes pads a narrower map with zeros to 256 entries).
  for signed in (True, False):
    ours = q.dynamic_map(signed, bits=bits)
    theirs = bnb.functional.create_dynamic_map(
      signed=signed, max_exponent_bits=bits - 1, total_bits=bits
    ).numpy()
    theirs = np.sort(
      np.r_[np.unique(theirs), np.zeros(2**bits - len(np.unique(theirs)))]
    )
    assert ours.shape == theirs.shape == (2**bits,)
    ulps = np.abs(ours - theirs) / np.spacing(np.abs(theirs).astype(np.float32))
    assert ulps.max() <= 2


@pytest.mark.parametrize("signed", [True, False])
def test_codes_and_scales_equal_quantize_blockwise(signed):
  rng = np.random.default_rng(0)
  n = 256 * 64
  # values spanning seven decades below each block's largest, as moments do
  x = rng.normal(size=n) * 10.0 ** rng.uniform(-7, 0, n)
  x = (x if signed else np.abs(x)).astype(np.float32)
  leaf = q.encode(jnp.asarray(x), 256, sqrt=False)
  code = q.dynamic_map(signed)
  codes, absmax = portable_quantize(torch.from_numpy(x), torch.from_numpy(code))
  assert bool(jnp.all((leaf.scales < 0) == signed))
  out = assert_codes(leaf, (codes, absmax), x, code)
  # about half of the signed blocks have their largest magnitude below 0
  assert (0.25 < out.mean() < 0.75) if signed else not out.any()
  # the C kernel is the one that differs (small values one code off)
  c_codes, _ = bnb.functional.quantize_blockwise(
    torch.from_numpy(x), code=torch.from_numpy(code), blocksize=256
  )
  assert (c_codes.numpy() != codes).sum() > 0


@pytest.mark.parametrize("store_sqrt", [False, True])
def test_one_update_equals_quantize_blockwise_of_adams_new_moments(store_sqrt):
  """``store_sqrt=False``: the moments' codes; ``True``: the second
  moment's are those of its square root."""
  rng = np.random.default_rng(1)
  shape = (32, 256)
  params = {"w": jnp.asarray(rng.normal(size=shape), jnp.float32)}
  g = {"w": jnp.asarray(rng.normal(size=shape) * 1e-2, jnp.float32)}
  tx = ols.quantize_state(optax.adam(1e-3), store_sqrt=store_sqrt)
  state = tx.init(params)
  _, state = tx.update(g, state, params)
  _, state = tx.update(g, state, params)
  _, ref = optax.adam(1e-3).update(
    g, ols.dequantize_state(tx.update(g, tx.init(params), params)[1]), params
  )
  for name, signed in (("mu", True), ("nu", False)):
    got = getattr(state.inner_state[0], name)["w"]
    want = np.array(getattr(ref[0], name)["w"])
    if store_sqrt and not signed:
      want = np.sqrt(want)
    code = q.dynamic_map(signed)
    theirs = portable_quantize(torch.from_numpy(want), torch.from_numpy(code))
    out = assert_codes(got, theirs, want, code)
    assert out.any() if signed else not out.any()


def _nearest_cpu_kernel(monkeypatch):
  """Adam8bit's CPU step with the portable (round-to-nearest) quantisation."""
  cpu_ops = pytest.importorskip("bitsandbytes.backends.cpu.ops")

  def quantize(a, code, absmax_out, out_uint8, blocksize):
    codes, absmax = torch.ops.bitsandbytes.quantize_blockwise.default.redispatch(
      PORTABLE, a, code, blocksize
    )
    out_uint8.copy_(codes)
    absmax_out.copy_(absmax)

  monkeypatch.setattr(cpu_ops, "_quant_blockwise_fp32_direct", quantize)


def test_fifty_steps_follow_adam8bit(monkeypatch):
  """The parameters of a 50-step run stay within the bound derived below of
  bitsandbytes' Adam8bit fed the same gradients.

  Both runs dequantise, take the same Adam step in float32 and quantise to
  the nearest code of the same maps; they differ only by float32 rounding
  in the step (a few units in the last place: PyTorch and XLA order the
  operations differently), which can move a stored moment across a
  midpoint: one code apart. One code is at most 1/64 of the block's
  largest value for the first moment (the signed map's widest gap, near
  1) and 1/128 for the second. Each step moves a weight by at most about
  lr (Adam's |m_hat / sqrt(v_hat)| stays near 1 for gradients that keep
  their sign and size, as these do), so a one-code difference changes a
  step by a fraction of lr, and 50 steps differ by at most 50 * lr / 4 per
  weight; against the 50 * lr the weights move, 1/4 of it.
  """
  _nearest_cpu_kernel(monkeypatch)
  rng = np.random.default_rng(2)
  shape, lr, steps = (64, 256), 1e-3, 50
  p0 = rng.normal(size=shape).astype(np.float32)
  base = rng.normal(size=shape).astype(np.float32)
  grads = [
    (base * (1 + 0.1 * rng.normal(size=shape))).astype(np.float32) for _ in range(steps)
  ]
  w = torch.nn.Parameter(torch.from_numpy(p0.copy()))
  opt = bnb.optim.Adam8bit([w], lr=lr, betas=(0.9, 0.999), eps=1e-8)
  opt.name2qmap["dynamic"] = torch.from_numpy(q.dynamic_map(True))
  opt.name2qmap["udynamic"] = torch.from_numpy(q.dynamic_map(False))
  adam = optax.adam(lr, b1=0.9, b2=0.999, eps=1e-8)
  tx = ols.quantize_state(adam, store_sqrt=False)  # Adam8bit's storage
  params = {"w": jnp.asarray(p0)}
  state = tx.init(params)

  @jax.jit
  def step(params, state, g):
    u, state = tx.update(g, state, params)
    return optax.apply_updates(params, u), state

  departed = np.zeros(shape[0] * shape[1] // 256, bool)  # at any step
  for g in grads:
    w.grad = torch.from_numpy(g)
    opt.step()
    params, state = step(params, state, {"w": jnp.asarray(g)})
    mu_now = np.asarray(ols.dequantize_state(state)[0].mu["w"]).reshape(-1, 256)
    departed = departs(mu_now) | departed
  theirs = w.detach().numpy()
  ours = np.asarray(params["w"])
  moved = np.abs(theirs - p0)
  assert np.median(moved) > 0.5 * steps * lr  # both trained
  # Each block (a row) follows from its own gradients. Those whose scale was
  # bitsandbytes' at every step stay within the bound; in the others
  # bitsandbytes stores the least first moment 0.7% short at each step, and
  # ours keeps it (against float32 Adam's; the median over those blocks: the
  # least element may change within a block).
  ours_mu = np.asarray(ols.dequantize_state(state)[0].mu["w"]).reshape(-1, 256)
  same = ~departed
  assert 0 < same.sum() < same.size
  diff = np.abs(ours - theirs)
  assert diff[same].max() <= steps * lr / 4
  exact = jnp.asarray(p0)
  exact_state = adam.init(exact)
  for g in grads:
    u, exact_state = adam.update(jnp.asarray(g), exact_state, exact)
    exact = exact + u
  exact_mu = np.asarray(exact_state[0].mu).reshape(-1, 256)[~same]
  least = np.argmin(exact_mu, axis=1)
  s = opt.state[w]
  theirs_mu = q.dynamic_map(True)[s["state1"].numpy().reshape(-1, 256)]
  theirs_mu = theirs_mu * s["absmax1"].numpy()[:, None]
  rows = np.arange(least.size)
  ours_least = ours_mu[~same][rows, least] / exact_mu[rows, least]
  theirs_least = theirs_mu[~same][rows, least] / exact_mu[rows, least]
  assert np.median(np.abs(ours_least - 1)) < 1e-3, ours_least
  assert np.median(theirs_least) < 0.97, theirs_least
  # and the moments agree code for code but for a few, in the blocks that kept
  # bitsandbytes' scale
  mu, nu = state.inner_state[0].mu["w"], state.inner_state[0].nu["w"]
  kept = lambda c: np.asarray(c).reshape(-1, 256)[same]  # noqa: E731
  for ours_codes, theirs_codes in ((mu.codes, s["state1"]), (nu.codes, s["state2"])):
    assert (kept(ours_codes) != kept(theirs_codes.numpy())).mean() < 1e-3
  np.testing.assert_allclose(
    np.abs(np.asarray(mu.scales)).reshape(-1)[same],
    s["absmax1"].numpy()[same],
    rtol=1e-3,
  )
