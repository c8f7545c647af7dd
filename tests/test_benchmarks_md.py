"""BENCHMARKS.md is one run of ``benchmarks/run_all.py`` at one commit.

Every table of the page lies in a ``run_all`` block (so ``run_all.py --write``
regenerates them all), every block names the header's commit, every block's
key is a question of ``run_all.py`` (each question once), and the page stays
short enough to read.
"""

import importlib
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
PAGE = os.path.join(ROOT, "BENCHMARKS.md")
MAX_LINES = 400


@pytest.fixture(scope="module")
def run_all():
  bench = os.path.join(ROOT, "benchmarks")
  sys.path.insert(0, bench)
  try:
    yield importlib.import_module("run_all")
  finally:
    sys.path.remove(bench)


@pytest.fixture(scope="module")
def text():
  with open(PAGE) as f:
    return f.read()


def test_the_page_is_at_most_400_lines(text):
  assert len(text.splitlines()) <= MAX_LINES


def test_every_key_is_a_question_once(run_all, text):
  keys = [m.group(2) for m in run_all.BLOCK.finditer(text)]
  assert keys[0] == "header", keys
  assert sorted(keys) == sorted(["header", *run_all.QUESTIONS]), keys
  # No marker left unmatched outside the blocks the pattern found.
  outside = run_all.BLOCK.sub("", text)
  assert "<!-- run_all" not in outside and "<!-- /run_all" not in outside


def test_every_table_is_in_a_block(run_all, text):
  """A table row (a line that starts with ``|``) anywhere outside a block
  would be a number ``--write`` does not regenerate."""
  outside = run_all.BLOCK.sub("", text)
  rows = [line for line in outside.splitlines() if line.lstrip().startswith("|")]
  assert not rows, rows


@pytest.mark.integration
def test_every_block_is_from_the_header_commit(run_all, text):
  blocks = {m.group(2): m.group(3) for m in run_all.BLOCK.finditer(text)}
  header = blocks.pop("header")
  full = re.match(r"Commit `([0-9a-f]{40})`, ", header)
  assert full, header
  assert "uncommitted" not in header and "--quick" not in header, header
  made = re.search(r"; made by `python benchmarks/run_all\.py ([^`]*)`", header)
  assert made and made.group(1).endswith("--write BENCHMARKS.md"), header
  for key, body in blocks.items():
    first = body.splitlines()[0]
    short = re.search(r" at commit `([0-9a-f]{7,40})`", first)
    assert short, (key, first)
    assert "**failed**" not in body, key
    if key in run_all.GPU_ONLY and not first.startswith("Not run"):
      # Made on a GPU, elsewhere: it names its device and a commit of this
      # history (checked where the clone has the history).
      assert re.search(r"` on (NVIDIA|AMD) .+\.$", first), first
      git = ["git", "-C", ROOT]
      shallow = subprocess.run(
        [*git, "rev-parse", "--is-shallow-repository"], capture_output=True, text=True
      )
      if shallow.returncode == 0 and shallow.stdout.strip() == "false":
        known = subprocess.run(
          [*git, "merge-base", "--is-ancestor", short.group(1), "HEAD"],
          capture_output=True,
        )
        assert known.returncode == 0, (key, first)
      continue
    assert full.group(1).startswith(short.group(1)), (key, first)
