"""benchmarks/update_traffic.py: the 8-bit update step's kernels and bytes.

Compiling for a GPU without one needs JAX's CUDA plugin, which the tests
do not install (BENCHMARKS.md has that run): here the script runs
``--small`` end to end (integration), and the switch that has
``adam_8bit`` lower its GPU kernel while a step is traced is checked to
undo itself.
"""

import benchmark_modules
import jax
import pytest
import report_tables

pytestmark = pytest.mark.standard_promotion  # optax's adam

traffic = benchmark_modules.load("update_traffic")


def test_seeing_a_gpu_is_undone_after_the_trace_even_on_an_error():
  from optax_lossscale._params import adam_8bit

  backend = jax.default_backend()
  with traffic.seeing_a_gpu(False):
    assert adam_8bit.jax.default_backend() == backend
  with pytest.raises(RuntimeError, match="inside"):
    with traffic.seeing_a_gpu(True):
      assert adam_8bit.jax.default_backend() == "gpu"
      raise RuntimeError("inside")
  assert adam_8bit.jax.default_backend() == backend == jax.default_backend()


def test_the_setups_are_quantize_states_but_the_flat_ones():
  qs = benchmark_modules.load("quantize_state")
  names = list(traffic.setups())
  assert names[0] == "float32 Adam"
  assert set(qs.PALLAS_CONFIGS) < set(names)
  assert not [n for n in names if n.endswith(qs._SLICED)]
  assert len(names) == len(qs.PALLAS_CONFIGS) + sum(
    not n.endswith(qs._SLICED) for n in qs.COST_CONFIGS
  )


@pytest.mark.integration
def test_small_report(tmp_path):
  text = benchmark_modules.run_small("update_traffic.py", tmp_path / "report.md")
  assert text.startswith("# The 8-bit update step compiled for a GPU")
  rows = report_tables.table(text, "| setup |")
  assert [r[0] for r in rows] == list(traffic.setups())
  for row in rows:
    kernels, copies, megabytes = (report_tables.number(c) for c in row[1:4])
    assert kernels > 0 and 0 <= copies <= kernels and megabytes > 0, row
  assert rows[0][4] == "1.00x"
  assert "Traceback" not in text
