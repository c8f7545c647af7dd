"""The code blocks of the documentation pages and the README, and how each is run.

A page's ``python`` blocks run in order in one namespace, in a new process
started in an empty directory, as a user pastes the page into the
interactive interpreter (line by line, as ``code.InteractiveConsole`` reads
them: a blank line ends a statement, so a class or function has none
inside): imports included, nothing set up by the tests. A page whose code needs
something the process cannot make itself says so in the page, and names the
environment in a MyST comment line (rendered nowhere) of the form::

  % test-env: NAME=VALUE ...

``{port}`` in a value becomes a free local port. A line
``print(...)  # text`` must print ``text``: the comment after a ``print``
is what the page says it prints, and the runner compares the two. A
``text`` block right after the MyST comment ``% output`` is what the python
block before it prints, and must appear in that block's output as written.
``bash`` blocks hold
commands: each is checked by :func:`check_command` (the example's arguments
parse, the test command is CI's, the docs command is the one the build test
runs), and the examples they start are run by the example tests.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: The README, the pages, and BENCHMARKS.md (which the benchmarks page includes).
PAGES = sorted(
  [
    ROOT / "README.md",
    ROOT / "BENCHMARKS.md",
    *(p for p in DOCS.rglob("*.md") if "_build" not in p.parts),
  ]
)
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
OUTPUT = re.compile(r"^% output[ \t]*\n```text\n(.*?)^```[ \t]*$", re.M | re.S)
ENV = re.compile(r"^% test-env: (.*)$", re.M)

#: ``print(args)  # expected``: a print whose output the page states.
PRINT = re.compile(r"^(\s*)print\((.*)\)[ \t]+#[ \t](.*)$")

_RUNNER = r"""
import code, io, json, sys

def __expect__(where, expected, *args, **kwargs):
  out = io.StringIO()
  print(*args, **kwargs, file=out)
  got = out.getvalue().rstrip("\n")
  print(got)
  if got != expected:
    raise AssertionError(f"{where}: printed {got!r}, the page says {expected!r}")

class Console(code.InteractiveConsole):
  failed = False

  def showtraceback(self, *args, **kwargs):
    self.failed = True
    super().showtraceback(*args, **kwargs)

  def showsyntaxerror(self, *args, **kwargs):
    self.failed = True
    super().showsyntaxerror(*args, **kwargs)

page, blocks = sys.argv[1], json.load(open(sys.argv[2]))
console = Console({"__name__": "__main__", "__expect__": __expect__}, filename=page)
stdout = sys.stdout
for line, code_text, output in blocks:
  print(f"--- {page}:{line}", flush=True)
  sys.stdout = captured = io.StringIO()
  # Line by line, as the interactive interpreter reads a paste, then the
  # empty line that ends an open statement.
  more = False
  for text in code_text.split("\n"):
    more = console.push(text)
    if console.failed:
      break
  if more and not console.failed:
    console.push("")
  sys.stdout = stdout
  print(captured.getvalue(), end="", flush=True)
  if console.failed:
    sys.exit(f"the block at {page}:{line} failed (line {line} + {text!r})")
  if output is not None and output not in captured.getvalue():
    sys.exit(f"the block at {page}:{line} did not print the page's output:\n{output}")
"""


def checked(page: str, line: int, code: str) -> str:
  """``code`` with each ``print(...)  # expected`` made to compare its output.

  Raises:
    ValueError: a ``print`` over several lines ends in a comment: what it
      prints cannot be checked (write it on one line).
  """
  out = []
  depth = 0  # open brackets of a print that spans lines
  for i, text in enumerate(code.split("\n")):
    where = f"{page}:{line + i}"
    m = PRINT.match(text)
    if m:
      indent, args, expected = m.groups()
      text = f"{indent}__expect__({where!r}, {expected.rstrip()!r}, {args})"
    elif depth or text.lstrip().startswith("print("):
      bare = text.split("#", 1)[0]
      depth += bare.count("(") + bare.count("[") - bare.count(")") - bare.count("]")
      if depth <= 0 and "#" in text:
        raise ValueError(f"{where}: a print over several lines ends in a comment")
      depth = max(depth, 0)
    out.append(text)
  return "\n".join(out)


def blocks(page: Path, language: str) -> list[tuple[int, str]]:
  """``(first line, code)`` of each fenced ``language`` block of ``page``."""
  text = page.read_text()
  return [
    (text.count("\n", 0, m.start(2)) + 1, m.group(2))
    for m in FENCE.finditer(text)
    if m.group(1) == language
  ]


def outputs(page: Path) -> dict[int, str]:
  """For each ``% output`` block, the line of the python block it belongs to."""
  text = page.read_text()
  code = blocks(page, "python")
  found = {}
  for m in OUTPUT.finditer(text):
    line = text.count("\n", 0, m.start()) + 1
    before = [first for first, _ in code if first < line]
    if not before:
      raise ValueError(f"{page}:{line}: an output block before any python block")
    found[before[-1]] = m.group(1)
  return found


def page_env(page: Path) -> dict[str, str]:
  """The environment a page names in ``% test-env:`` lines."""
  env = {}
  for line in ENV.findall(page.read_text()):
    for item in shlex.split(line):
      name, value = item.split("=", 1)
      if "{port}" in value:
        with socket.socket() as s:
          s.bind(("127.0.0.1", 0))
          value = value.replace("{port}", str(s.getsockname()[1]))
      env[name] = value
  return env


def run_page(page: Path, timeout: int = 900) -> subprocess.CompletedProcess:
  """Runs the page's python blocks in order, in a new process; the result."""
  name = str(page.relative_to(ROOT))
  with tempfile.TemporaryDirectory() as tmp:
    spec = Path(tmp) / "blocks.json"
    shown = outputs(page)
    code = [
      (line, checked(name, line, c), shown.get(line))
      for line, c in blocks(page, "python")
    ]
    spec.write_text(json.dumps(code))
    work = Path(tmp) / "work"
    work.mkdir()
    env = {**os.environ, **page_env(page)}
    return subprocess.run(
      [sys.executable, "-c", _RUNNER, name, str(spec)],
      capture_output=True,
      text=True,
      timeout=timeout,
      cwd=work,
      env=env,
    )


if __name__ == "__main__":  # python tests/docs_blocks.py docs/guides/optax.md ...
  for arg in sys.argv[1:]:
    result = run_page(Path(arg).resolve())
    print(result.stdout[-4000:], result.stderr[-4000:], sep="\n")
    print(f"{arg}: exit {result.returncode}")
