"""examples/train_lm.py runs end to end, small, and reports what it measured."""

import math
import re

import pytest
import versions
from test_examples import run_example

ROW = re.compile(
  r"^(float32|float16 \+ loss scale|float16)\s+([\d.]+)\s+"
  r"([\d.]+)\s+([\d.]+)\s+([+-][\d.]+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)$"
)


def percent(text):
  return None if text == "-" else float(text.rstrip("%"))


@versions.examples
@pytest.mark.integration
def test_train_lm_example(tmp_path):
  stdout = run_example(
    "train_lm.py",
    *("--steps", 40, "--layers", 2, "--width", 32, "--heads", 2),
    *("--context", 64, "--batch", 32, "--eval-every", 20, "--measure-every", 4),
    *("--eval-sequences", 16, "--growth-interval", 10, "--out", tmp_path),
  )
  rows = {}
  for line in stdout.splitlines():
    m = ROW.match(line)
    if m:
      train, val, bpb, gap, skipped, scale, lost, logit = m.groups()[1:]
      rows[m.group(1)] = dict(
        train=float(train),
        val=float(val),
        bpb=float(bpb),
        gap=float(gap),
        skipped=int(skipped),
        scale=scale,
        lost=percent(lost),
        logit=percent(logit),
      )
  assert set(rows) == {"float32", "float16", "float16 + loss scale"}, stdout
  for name, r in rows.items():
    # Finite, and below the 5.55 nats of a uniform guess over 256 bytes: the
    # loss as the loss function returns it, not divided by --accumulation.
    for loss in (r["train"], r["val"]):
      assert math.isfinite(loss) and 1 < loss < math.log(256), (name, r)
  assert rows["float32"]["gap"] == 0.0
  # Only the loss-scaled run has a scale (and skips); float32 is the reference.
  assert rows["float32"]["scale"] == rows["float16"]["scale"] == "-"
  assert float(rows["float16 + loss scale"]["scale"]) >= 1.0
  assert rows["float32"]["skipped"] == rows["float16"]["skipped"] == 0
  assert rows["float32"]["lost"] is None and rows["float32"]["logit"] is None
  # float16 loses gradient entries to underflow; loss scaling loses fewer.
  f16, scaled = rows["float16"], rows["float16 + loss scale"]
  assert f16["lost"] > 0, stdout
  assert scaled["lost"] < f16["lost"], stdout
  assert scaled["logit"] <= f16["logit"], stdout
  assert "micro-batch of a 40-step gradient accumulation" in " ".join(stdout.split())
  # The loss-scaled run's non-finite record is printed when it skipped steps.
  skipped = scaled["skipped"]
  printed = "where the gradients were not finite, float16 + loss scale:" in stdout
  assert printed == (skipped > 0), stdout
  if skipped:
    assert f"Non-finite gradients on {skipped} of 40 updates" in stdout, stdout
    assert re.search(
      r"^(embed|pos|block_\d|ln_out|head)/\S+ +\d+ +\d+ +\d+ +(NaN|inf)", stdout, re.M
    ), stdout
  png = tmp_path / "lm_loss_scale.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # The run as text, for the documentation: the command and the same table.
  text = (tmp_path / "lm_loss_scale.txt").read_text()
  assert text.startswith("$ python examples/train_lm.py --steps 40 "), text
  table = [line for line in stdout.splitlines() if ROW.match(line)]
  assert table and all(line in text.splitlines() for line in table), text


F8_ROW = re.compile(
  r"^(float32|bfloat16|float8|mxfp8|nvfp4)\s+([\d.]+)\s+([\d.]+)\s+([+-][\d.]+)\s+([\d.]+)%"
  r"\s+([+-][\d.]+)\s+(\d+)\s+([\d.]+)$"
)


@versions.examples
@pytest.mark.integration
@pytest.mark.parametrize(
  "recipe", ["float8", pytest.param("nvfp4", marks=versions.block_formats)]
)
def test_train_lm_float8_example(tmp_path, recipe):
  stdout = run_example(
    "train_lm_float8.py",
    *("--steps", 40, "--layers", 1, "--width", 32, "--heads", 2, "--recipe", recipe),
    *("--context", 32, "--batch", 16, "--eval-sequences", 8, "--out", tmp_path),
  )
  rows = {}
  for line in stdout.splitlines():
    m = F8_ROW.match(line)
    if m:
      val, _, gap, acc, points, skipped, ms = m.groups()[1:]
      rows[m.group(1)] = dict(
        val=float(val),
        gap=float(gap),
        acc=float(acc),
        points=float(points),
        skipped=int(skipped),
        ms=float(ms),
      )
  assert set(rows) == {"float32", "bfloat16", recipe}, stdout
  for name, r in rows.items():
    assert math.isfinite(r["val"]) and 0 < r["val"] < math.log(256), (name, r)
    assert 0 < r["acc"] <= 100 and r["ms"] > 0, (name, r)
    # The gaps are what the table says they are: against float32's row.
    assert r["gap"] == pytest.approx(r["val"] - rows["float32"]["val"], abs=2e-4)
    assert r["points"] == pytest.approx(r["acc"] - rows["float32"]["acc"], abs=0.02)
  assert f"{recipe} is emulated on a CPU" in stdout
  printed = re.search(rf"{recipe} against bfloat16: ([+-][\d.]+) nats", stdout)
  gap = rows[recipe]["val"] - rows["bfloat16"]["val"]
  assert printed and float(printed.group(1)) == pytest.approx(gap, abs=2e-4), stdout
  for name in ("bfloat16", recipe):  # the record is printed when they skip
    printed = f"where the gradients were not finite, {name}:" in stdout
    assert printed == (rows[name]["skipped"] > 0), stdout
  png = tmp_path / f"lm_{recipe}.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
