"""Many processes for real: jax.distributed on localhost, a NaN in one shard.

Runs ``examples/multi_process.py``: worker processes with JAX's CPU
collectives, a single-process reference of the same global batch, and the
example's own comparison (same skips, scale and counters in every process
after every step; parameters equal to the reference's; an Orbax checkpoint
written by all processes restored in one, bit for bit).
"""

import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import versions
from test_examples import ROOT, run_example


@versions.examples
@pytest.mark.integration
@pytest.mark.parametrize("processes, local_devices", [(2, 2), (4, 1)])
def test_processes_agree_with_each_other_and_with_one_process(
  tmp_path, processes, local_devices
):
  out = run_example(
    "multi_process.py",
    "--processes", processes, "--local-devices", local_devices,
    "--steps", 24, "--nan-at", "4,5,17", "--bad-process", processes - 1,
    "--save-at", 20, "--out", tmp_path, "--timeout", 240,
  )  # fmt: skip
  checks = re.findall(r"^(ok    |FAILED) (.*)$", out, re.M)
  assert len(checks) == 6 and all(ok == "ok    " for ok, _ in checks), out
  skipped = re.findall(r"^\s+(\d+)\s+\d+\s+yes\b", out, re.M)
  assert skipped == ["4", "5", "17"], out
  assert (tmp_path / "ckpt").is_dir()

  # The comparison can fail: one process holding another scale at one step,
  # or another non-finite record (a leaf it did not see as NaN).
  run = dict(np.load(tmp_path / "process0.npz"))
  run["history/loss_scale"][10] *= 2
  run["history/last_leaves"][5] = 0
  np.savez(tmp_path / "process0.npz", **run)
  with pytest.raises(subprocess.CalledProcessError) as failed:
    run_example(
      "multi_process.py", "--compare", "--processes", processes, "--out", tmp_path
    )
  assert "FAILED every process holds the reference's scale" in failed.value.stdout
  assert "FAILED every process holds the reference's non-finite record" in (
    failed.value.stdout
  )


@versions.examples
@pytest.mark.integration
def test_the_documented_command_works_from_another_directory(tmp_path):
  # `python examples/multi_process.py --processes 2` with its default --out,
  # started outside the repository: the checkpoint path Orbax gets is
  # absolute whatever the working directory. A copy of the examples runs, so
  # its default --out is new (nothing an earlier run left) and in tmp_path.
  copy = tmp_path / "examples"
  copy.mkdir()
  for script in (ROOT / "examples").glob("*.py"):
    shutil.copy(script, copy)
  (tmp_path / "elsewhere").mkdir()
  out = subprocess.run(
    [sys.executable, str(copy / "multi_process.py"), "--processes", "2",
     "--steps", "6", "--nan-at", "2", "--save-at", "4"],
    capture_output=True, text=True, timeout=600, check=True, cwd=tmp_path / "elsewhere",
  ).stdout  # fmt: skip
  checks = re.findall(r"^(ok    |FAILED) (.*)$", out, re.M)
  assert len(checks) == 6 and all(ok == "ok    " for ok, _ in checks), out
  assert (copy / "out" / "multi_process" / "ckpt").is_dir()
  assert not (tmp_path / "elsewhere" / "out").exists()


@versions.examples
@pytest.mark.integration
def test_the_reference_makes_its_output_directory(tmp_path):
  out = tmp_path / "new" / "dir"
  run_example(
    "multi_process.py", "--reference", "--steps", 3, "--save-at", 2, "--nan-at", "",
    "--out", out,
  )  # fmt: skip
  assert (out / "reference.npz").is_file()
