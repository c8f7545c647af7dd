"""States saved by an earlier release restore into today's optimizers.

``tests/data/checkpoint_v0_1`` holds Orbax checkpoints written by the 0.1
release's code (``tests/data/write_checkpoint.py``: a loss scale around
master weights around 8-bit Adam with its non-finite record, a static scale
around AdamW, the Keras-style ``LossScaleOptimizer``; three steps, one of
them skipped) and each state's bytes. Each restores, bit for bit, into the
state ``init`` makes today, and trains on. A change of a state's form must
keep this passing, or make the restore fail with an error that names the
function converting an old state.
"""

import pathlib
import sys

import jax
import numpy as np
import optax
import pytest

import optax_lossscale as ols

ocp = pytest.importorskip("orbax.checkpoint")
DATA = pathlib.Path(__file__).parent / "data"
sys.path.insert(0, str(DATA))
import write_checkpoint  # noqa: E402

pytestmark = pytest.mark.standard_promotion  # optax's adam

OPTIMIZERS = write_checkpoint.optimizers()


def _bytes(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_checkpoint_of_release_0_1_restores_bit_for_bit_and_trains_on(name):
  tx, params = OPTIMIZERS[name]
  target = jax.tree.map(
    ocp.utils.to_shape_dtype_struct, {"params": params, "state": tx.init(params)}
  )
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(DATA / "checkpoint_v0_1" / name, target)
  assert jax.tree.structure(restored) == jax.tree.structure(target)
  saved = np.load(DATA / "checkpoint_v0_1" / f"{name}.npz")
  assert _bytes(restored) == [saved[str(i)].tobytes() for i in range(len(saved))]
  # the record of the skipped step came through
  assert int(ols.diagnostics(restored["state"])["skipped_steps"]) == 1
  params, state = restored["params"], restored["state"]
  grads = write_checkpoint.grads(params, 3)
  updates, state = jax.jit(tx.update)(grads, state, params)
  assert jax.tree.structure(state) == jax.tree.structure(restored["state"])
  new = optax.apply_updates(params, updates)
  assert all(
    bool(np.isfinite(np.asarray(x, np.float32)).all()) for x in jax.tree.leaves(new)
  )
  assert int(ols.diagnostics(state)["skipped_steps"]) == 1
