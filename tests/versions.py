"""What a test needs beyond the run-time dependencies, as skip markers.

CI runs the suite twice: with the newest releases and the `test` extra
(nothing skips), and with the oldest versions `pyproject.toml` allows and
no extras, where the tests below skip with these reasons.
"""

import contextlib
import importlib.util

import jax
import optax
import pytest


def _version(module):
  return tuple(int(p) for p in module.__version__.split(".")[:3] if p.isdigit())


def _installed(*names):
  return all(importlib.util.find_spec(n) is not None for n in names)


JAX = _version(jax)

#: The examples need the `examples` extra (Flax, scikit-learn, ...).
examples = pytest.mark.skipif(
  not _installed("flax", "sklearn", "matplotlib", "tqdm", "orbax"),
  reason="the examples need the `examples` extra",
)
#: XLA's deterministic cost figures (bytes, temporary memory, kernel counts)
#: are asserted against the XLA of the newest tested jax.
xla_figures = pytest.mark.skipif(
  JAX < (0, 10),
  reason="XLA's cost figures are asserted for jax >= 0.10's XLA; older XLAs "
  "fuse and allocate differently",
)
#: Explicit sharding (a mesh's `AxisType.Explicit`, specs in the types).
explicit_sharding = pytest.mark.skipif(
  not hasattr(getattr(jax, "sharding", None), "AxisType")
  or not hasattr(jax, "set_mesh"),
  reason="explicit sharding needs jax's AxisType.Explicit and jax.set_mesh",
)
#: Block-scaled formats need float8_e8m0fnu and float4_e2m1fn in jax.numpy.
block_formats = pytest.mark.skipif(
  not (hasattr(jax.numpy, "float8_e8m0fnu") and hasattr(jax.numpy, "float4_e2m1fn")),
  reason="MXFP8/NVFP4 need jax.numpy's float8_e8m0fnu and float4_e2m1fn",
)
#: `jax.shard_map` (with its varying-axes types) is jax >= 0.7's.
shard_map = pytest.mark.skipif(
  not hasattr(jax, "shard_map"), reason="jax.shard_map needs jax >= 0.7"
)


def _multisteps_keeps_dtypes():
  import jax.numpy as jnp

  params = {"b": jnp.ones(2, jnp.bfloat16)}
  tx = optax.MultiSteps(optax.sgd(0.5), 2)
  with jax.numpy_dtype_promotion("standard"):  # optax's own code
    state = tx.init(params)
    _, new = tx.update({"b": jnp.ones(2, jnp.float32)}, state, params)
  return new.acc_grads["b"].dtype == state.acc_grads["b"].dtype


#: Older optax's own MultiSteps changes its accumulator's dtype on update.
multisteps_dtypes = pytest.mark.skipif(
  not _multisteps_keeps_dtypes(),
  reason=f"optax {optax.__version__}'s own MultiSteps changes its accumulator's "
  "dtype between init and update",
)


def _inject_hyperparams_keeps_dtypes():
  import jax.numpy as jnp

  params = {"b": jnp.ones(2, jnp.float16)}
  tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
  with jax.numpy_dtype_promotion("standard"):  # optax's own code
    state = tx.init(params)
    _, new = tx.update({"b": jnp.ones(2, jnp.float32)}, state, params)
  return jax.tree.map(lambda x: x.dtype, new) == jax.tree.map(lambda x: x.dtype, state)


#: Older optax's inject_hyperparams keeps its hyper-parameters in the
#: parameters' dtype at init and in the gradients' at update.
inject_dtypes = pytest.mark.skipif(
  not _inject_hyperparams_keeps_dtypes(),
  reason=f"optax {optax.__version__}'s inject_hyperparams changes its state's "
  "dtypes between init and update",
)


def _adam_refuses_none():
  import jax.numpy as jnp
  import optax

  params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
  adam = optax.adam(1e-3)
  try:
    with jax.numpy_dtype_promotion("standard"):  # optax is not written for strict
      adam.update({"w": jnp.ones(3), "b": None}, adam.init(params), params)
  except Exception:  # noqa: BLE001 - any failure: it refuses
    return True
  return False


#: optax's own Adam fails on a None gradient for a parameter (older optax
#: takes it), so a wrapper must name the leaf.
adam_refuses_none = pytest.mark.skipif(
  not _adam_refuses_none(), reason="this optax's adam takes a None gradient"
)


@contextlib.contextmanager
def x64():
  """float64 on, for the block (JAX's context manager, old or new)."""
  enable = getattr(jax, "enable_x64", None)
  if enable is not None:
    with enable(True):
      yield
  else:  # jax < 0.6
    from jax.experimental import enable_x64

    with enable_x64():
      yield
