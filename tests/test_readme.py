"""The README's complete training loop runs as pasted and trains."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quick_start_loop_runs_as_pasted():
  text = README.read_text()
  block = re.search(r"## Quick start.*?```python\n(.*?)```", text, re.S).group(1)
  out = subprocess.run(
    [sys.executable, "-c", block],
    capture_output=True,
    text=True,
    check=True,
    timeout=300,
  ).stdout
  lines = re.findall(r"step (\d+): loss ([\d.]+), scale (\d+), skipped (\d+)", out)
  assert [int(s) for s, *_ in lines] == [0, 100, 200, 299], out
  first, last = float(lines[0][1]), float(lines[-1][1])
  assert last < first / 10, out
