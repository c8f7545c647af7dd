"""autocast keeps the state a model updates: NNX Variables and Linen collections."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

pytest.importorskip("flax", reason="NNX and Linen state is Flax's")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

from optax_lossscale.flax import nnx_value_and_grad  # noqa: E402

pytestmark = pytest.mark.standard_promotion  # Flax layers


class Count(nnx.Variable):
  pass


class Counted(nnx.Module):
  """A layer that counts its calls, as a step counter or a cache index does."""

  def __init__(self):
    self.linear = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    self.count = Count(jnp.array(0))

  def __call__(self, x):
    self.count[...] += 1
    return self.linear(x)


def _loss(model, x):
  return jnp.mean(model(x) ** 2)


def _eager(f, model, x):
  return f(model, x)


def _nnx_jit(f, model, x):
  return nnx.jit(f)(model, x)


def _nnx_grad(f, model, x):
  return nnx.grad(f)(model, x)


def _nnx_value_and_grad(f, model, x):
  return nnx.value_and_grad(f)(model, x)


def _optimizer(model):
  return nnx.Optimizer(model, ols.dynamic_loss_scale(optax.sgd(0.1)), wrt=nnx.Param)


def _package_helper(f, model, x):
  optimizer = _optimizer(model)
  return nnx_value_and_grad(f)(optimizer, model, x)


def _jit_of_helper(f, model, x):
  optimizer = _optimizer(model)

  @nnx.jit
  def step(model, optimizer, x):
    _, grads = nnx_value_and_grad(f)(optimizer, model, x)
    optimizer.update(model, grads)

  return step(model, optimizer, x)


ENTRY_POINTS = {
  "eager": _eager,
  "nnx.jit": _nnx_jit,
  "nnx.grad": _nnx_grad,
  "nnx.value_and_grad": _nnx_value_and_grad,
  "nnx_value_and_grad": _package_helper,
  "nnx.jit(nnx_value_and_grad)": _jit_of_helper,
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_counter_ends_at_four_as_without_autocast(entry):
  run = ENTRY_POINTS[entry]
  x = jnp.ones((4, 3))
  counts = []
  for f in (_loss, ols.autocast(_loss, compute_dtype=jnp.float16)):
    model = Counted()
    for _ in range(4):
      run(f, model, x)
    counts.append(int(model.count[...]))
  assert counts == [4, 4]


def test_the_module_itself_or_its_method_can_be_autocast():
  model = Counted()
  x = jnp.ones((4, 3))
  ols.autocast(model, compute_dtype=jnp.float16)(x)
  assert int(model.count[...]) == 1
  ols.autocast(model.__call__, compute_dtype=jnp.float16)(x)
  assert int(model.count[...]) == 2


class Net(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(8, 16, rngs=rngs)
    self.norm = nnx.BatchNorm(16, momentum=0.5, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.drop(self.norm(self.linear(x)))


def _net():
  return Net(nnx.Rngs(params=0, dropout=1))


def test_batchnorm_statistics_and_dropout_masks_as_without_autocast():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(32, 8)), jnp.float32) * 3 + 1
  f = lambda model, x: model(x)  # noqa: E731
  plain, cast = _net(), _net()
  fast = ols.autocast(f, compute_dtype=jnp.float16)
  masks = []
  for _ in range(3):
    want, got = f(plain, x), fast(cast, x)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got) != 0, np.asarray(want) != 0)
    masks.append(np.asarray(got) != 0)
  # The Rngs stream advanced as without autocast: each step a new mask.
  assert not np.array_equal(masks[0], masks[1])
  assert int(cast.drop.rngs.count[...]) == 3
  np.testing.assert_array_equal(cast.drop.rngs.count[...], plain.drop.rngs.count[...])
  # The running statistics moved, to the float32 values within float16's
  # precision (11 significant bits; the batch statistics are float32 sums).
  for name in ("mean", "var"):
    got = np.asarray(getattr(cast.norm, name)[...])
    want = np.asarray(getattr(plain.norm, name)[...])
    assert got.dtype == np.float32
    assert np.abs(want).max() > 0.5  # they moved from their initial values
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def test_state_under_nnx_jit_and_grad_matches_the_plain_step():
  x = jnp.asarray(np.random.default_rng(1).normal(size=(16, 8)), jnp.float32)

  def loss(model, x):
    return jnp.mean(model(x) ** 2)

  results = []
  for f in (loss, ols.autocast(loss, compute_dtype=jnp.bfloat16)):
    model = _net()
    step = nnx.jit(lambda m, x, f=f: nnx.grad(f)(m, x))
    for _ in range(2):
      step(model, x)
    results.append((np.asarray(model.norm.mean[...]), int(model.drop.rngs.count[...])))
  (want_mean, want_count), (got_mean, got_count) = results
  assert got_count == want_count == 2
  np.testing.assert_allclose(got_mean, want_mean, rtol=2e-2, atol=2e-2)


class Sower(nnx.Module):
  def __init__(self):
    self.linear = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

  def __call__(self, x):
    y = self.linear(x)
    self.cache = nnx.Cache(y)  # a Variable the call creates
    return y


def test_a_variable_the_call_creates_is_carried_back():
  model = Sower()
  x = jnp.ones((4, 3))
  y = ols.autocast(lambda m, x: m(x), compute_dtype=jnp.float16)(model, x)
  np.testing.assert_array_equal(model.cache[...], y)


class Static(nnx.Module):
  def __init__(self):
    self.linear = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    self.calls = 0

  def __call__(self, x):
    self.calls += 1  # a Python attribute: not a Variable
    return self.linear(x)


def test_what_autocast_cannot_carry_back_is_an_error():
  x = jnp.ones((4, 3))
  with pytest.raises(ValueError, match="structure"):
    ols.autocast(lambda m, x: m(x), compute_dtype=jnp.float16)(Static(), x)
  closed = Counted()
  with pytest.raises(ValueError, match="closure"):
    ols.autocast(lambda x: closed(x), compute_dtype=jnp.float16)(x)
  assert int(closed.count[...]) == 0


def test_shared_variables_stay_shared():
  model = Counted()
  x = jnp.ones((4, 3))

  def twice(a, b, x):
    a(x)
    b(x)
    return a.count[...]

  seen = ols.autocast(twice, compute_dtype=jnp.float16)(model, model, x)
  assert int(seen) == 2 and int(model.count[...]) == 2


def test_linen_mutable_collections_as_without_autocast():
  class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(16)(x)
      return nn.BatchNorm(use_running_average=False, momentum=0.5)(x)

  model = LinenNet()
  x = jnp.asarray(np.random.default_rng(2).normal(size=(32, 8)), jnp.float32) * 3 + 1
  variables = model.init(jax.random.key(0), x)
  f = lambda v, x: model.apply(v, x, mutable=["batch_stats"])  # noqa: E731
  _, want = f(variables, x)
  _, got = ols.autocast(f, compute_dtype=jnp.float16)(variables, x)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.dtype == w.dtype == jnp.float32
    np.testing.assert_allclose(g, w, rtol=2e-3, atol=2e-3 * float(jnp.max(jnp.abs(w))))


def test_a_bare_variable_and_rngs_are_carried_back():
  def f(v, rngs, x):
    v[...] = v[...] + x
    return jax.random.normal(rngs(), (2,))

  fast = ols.autocast(f, compute_dtype=jnp.float16)
  v, rngs = nnx.Variable(jnp.zeros(3)), nnx.Rngs(0)
  plain_v, plain_rngs = nnx.Variable(jnp.zeros(3)), nnx.Rngs(0)
  for _ in range(2):
    got, want = fast(v, rngs, jnp.ones(3)), f(plain_v, plain_rngs, jnp.ones(3))
    np.testing.assert_array_equal(got, want)  # the stream advanced alike
  np.testing.assert_array_equal(v[...], jnp.full(3, 2.0))
  assert int(rngs.default.count[...]) == 2


class Flag(nnx.Variable):
  pass


class Flagged(nnx.Module):
  """A layer that writes a constant into its state, as a first-call flag does."""

  def __init__(self, value):
    self.linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    self.flag = Flag(value)

  def __call__(self, x, make):
    self.flag.set_value(make(x))
    return jnp.sum(self.linear(x) ** 2)


#: What the call writes: constants of every dtype, Python numbers, None, the
#: input passed through.
WRITTEN = {
  "bool array": lambda x: jnp.array(False),
  "Python bool": lambda x: False,
  "Python float": lambda x: 2.5,
  "int32 array": lambda x: jnp.array(7),
  "uint8 array": lambda x: jnp.arange(3, dtype=jnp.uint8),
  "float16 array": lambda x: jnp.array(1.5, jnp.float16),
  "complex64 array": lambda x: jnp.array(1j, jnp.complex64),
  "None": lambda x: None,
  "the input": lambda x: x,
}


@pytest.mark.sampled
@pytest.mark.parametrize("entry", [_eager, _nnx_jit, _nnx_grad, _nnx_value_and_grad])
@pytest.mark.parametrize("written", WRITTEN)
def test_constants_written_into_state_as_without_autocast(written, entry):
  make = WRITTEN[written]
  x = jnp.ones((1, 2))
  f = lambda m, x: m(x, make)  # noqa: E731
  plain, cast = Flagged(make(x)), Flagged(make(x))
  # The plain function under nnx.jit: a written Python number comes back an
  # array there, as under autocast (which traces as nnx.jit does).
  _nnx_jit(lambda m, x: entry(f, m, x), plain, x)
  entry(ols.autocast(f, compute_dtype=jnp.bfloat16), cast, x)
  got, want = cast.flag.get_value(), plain.flag.get_value()
  if want is None:
    assert got is None
    return
  assert (got.dtype, got.weak_type, got.shape) == (
    want.dtype,
    want.weak_type,
    want.shape,
  )
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("outer", [None, "float8"])
def test_an_inner_autocast_of_a_module_writes_its_variables_under_an_outer(outer):
  """The inner autocast decides for the module and carries its writes back
  (BatchNorm's statistics, the dropout stream): under an outer autocast as
  called alone, under nnx.jit."""
  x = jnp.asarray(np.random.default_rng(2).normal(size=(32, 8)), jnp.float32)
  inner = ols.autocast(lambda model, x: model(x), compute_dtype=jnp.bfloat16)
  nested = ols.autocast(
    lambda model, x: inner(model, x) * 2.0, compute_dtype=jnp.bfloat16, matmul=outer
  )
  results = []
  for f in (lambda m, x: inner(m, x) * 2.0, nested):
    model = _net()
    step = nnx.jit(lambda m, x, f=f: f(m, x))
    outs = [np.asarray(step(model, x)) for _ in range(2)]
    results.append(
      (outs, np.asarray(model.norm.mean[...]), int(model.drop.rngs.count[...]))
    )
  (want, want_mean, want_count), (got, got_mean, got_count) = results
  assert got_count == want_count == 2
  assert got_mean.tobytes() == want_mean.tobytes()
  for a, b in zip(got, want, strict=True):
    assert a.tobytes() == b.tobytes()
