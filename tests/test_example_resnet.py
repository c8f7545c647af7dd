"""The ResNet example runs; its skipped steps keep the BatchNorm statistics finite."""

import re

import pytest
import versions
from test_examples import run_example

pytestmark = versions.examples

ROW = re.compile(
  r"^((?:Linen|NNX) (?:float32|float16 \+ loss scale))\s+([\d.]+)\s+([\d.]+)\s+"
  r"(\d+)\s+(\S+)\s+(yes|NO)\s+([\d.]+)$",
  re.M,
)


@pytest.mark.integration
def test_resnet_example_linen_and_nnx_with_a_nan_step():
  out = run_example("resnet.py", "--steps", 12, "--batch", 16, "--nan-at", "4,9")
  rows = {m.group(1): m.groups()[1:] for m in ROW.finditer(out)}
  assert set(rows) == {
    f"{api} {run}"
    for api in ("Linen", "NNX")
    for run in ("float32", "float16 + loss scale")
  }, out
  for name, (acc, loss, skipped, scale, finite, _) in rows.items():
    assert 0.0 <= float(acc) <= 1.0 and float(loss) > 0.0, (name, out)
    # The NaN steps were skipped, and left the running statistics finite.
    assert finite == "yes", (name, out)
    if name.endswith("loss scale"):
      # Halved once per skip from 2**15 (12 steps: too few to grow).
      assert int(skipped) >= 2 and float(scale) == 2.0 ** (15 - int(skipped))
    else:
      assert int(skipped) == 0 and scale == "-", (name, out)
