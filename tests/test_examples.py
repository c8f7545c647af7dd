"""The examples run end to end, from an empty directory, and report results."""

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import versions

ROOT = Path(__file__).resolve().parents[1]
pytestmark = versions.examples


def run_example(name, *args):
  """Runs examples/NAME with ARGS in a new process; its stdout (it must exit 0).

  The process starts in an empty directory outside the repository: every
  example must work from any working directory.
  """
  with tempfile.TemporaryDirectory() as elsewhere:
    return subprocess.run(
      [sys.executable, str(ROOT / "examples" / name), *map(str, args)],
      capture_output=True,
      text=True,
      timeout=600,
      check=True,
      cwd=elsewhere,
    ).stdout


@pytest.mark.integration
def test_train_digits_example(tmp_path):
  stdout = run_example(
    "train_digits.py", "--steps", 150, "--growth-interval", 20, "--out", tmp_path
  )
  rows = {}
  for line in stdout.splitlines():
    m = re.match(
      r"^(float32|float16 \+ loss scale|float16)\s+([\d.]+)\s+"
      r"([\d.]+)\s+(\d+)\s+(\S+)\s+([\d.]+)%\s+(\d+)$",
      line,
    )
    if m:
      rows[m.group(1)] = m.groups()[1:]
  assert set(rows) == {"float32", "float16", "float16 + loss scale"}, stdout
  for name, (acc, loss, *_) in rows.items():
    assert float(acc) > 0.8, (name, acc)  # 10 classes: chance is 0.1
    assert float(loss) < 1.0, (name, loss)
  # Only the loss-scaled run has a scale; 2**15 grew every 20 finite steps.
  assert rows["float32"][3] == "-" and rows["float16"][3] == "-"
  assert float(rows["float16 + loss scale"][3]) >= 2.0**15
  png = tmp_path / "digits_loss_scale.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
def test_train_digits_8bit_example():
  stdout = run_example("train_digits_8bit.py", "--steps", 150)
  rows = {}
  for line in stdout.splitlines():
    m = re.match(
      r"^(float32 Adam|8-bit Adam|bf16 \+ masters \+ 8-bit)\s+([\d.]+)\s+([\d.]+)\s+"
      r"([\d.]+)\s+([+-][\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$",
      line,
    )
    if m:
      rows[m.group(1)] = [float(v) for v in m.groups()[1:]]
  assert set(rows) == {"float32 Adam", "8-bit Adam", "bf16 + masters + 8-bit"}, stdout
  for name, (acc, test_loss, _, gap, params, state, total) in rows.items():
    assert acc > 0.8, (name, acc)  # 10 classes: chance is 0.1
    assert abs(gap - (test_loss - rows["float32 Adam"][1])) < 2e-4, name
    assert abs(params + state - total) <= 0.011, name
  # the bytes: 4 + 8 against 4 + about 2 and 2 + 2 + about 2
  assert rows["float32 Adam"][4:] == [4.0, 8.0, 12.0]
  assert rows["8-bit Adam"][4] == 4.0 and 2.0 < rows["8-bit Adam"][5] < 2.5
  assert rows["bf16 + masters + 8-bit"][4] == 2.0
  assert rows["bf16 + masters + 8-bit"][6] == rows["8-bit Adam"][6]


@pytest.mark.integration
def test_data_parallel_example():
  # Exits 1 if the devices ever disagreed.
  out = run_example("data_parallel.py", "--steps", 30, "--nan-at", "5,6,20")
  assert out.startswith("8 devices"), out
  steps = {}
  for line in out.splitlines():
    m = re.match(r"^\s*(\d+)\s+(\S+)\s+(\d+)\s+(yes|no)\b", line)
    if m:
      steps[int(m.group(1))] = (float(m.group(3)), m.group(4) == "yes")
  assert sorted(steps) == list(range(30))
  assert [s for s, (_, skipped) in steps.items() if skipped] == [5, 6, 20]
  # The scale a step's gradients were computed with: halved by each skip.
  assert steps[6][0] == steps[5][0] / 2 and steps[7][0] == steps[5][0] / 4
  assert "steps where the devices disagreed: 0" in out


@pytest.mark.integration
def test_mixed_precision_example():
  out = run_example("mixed_precision.py", "--steps", 400)
  acc = {
    m.group(1): float(m.group(2))
    for m in re.finditer(
      r"^(float32 as written|enable_mixed_precision)\s+test accuracy ([\d.]+)",
      out,
      re.M,
    )
  }
  assert set(acc) == {"float32 as written", "enable_mixed_precision"}, out
  assert acc["float32 as written"] > 0.9
  assert abs(acc["enable_mixed_precision"] - acc["float32 as written"]) <= 0.01 + 1e-9
  half = float(re.search(r"FLOPs in float16 .*: ([\d.]+)%", out).group(1))
  assert half > 90.0, out
