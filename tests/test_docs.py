"""The documentation: every page's code runs, its commands are real, it builds strict.

``tests/docs_blocks.py`` says how a page's code is run. Here: each page
(and the README) as a test; each ``bash`` command checked against what it
names (an example's parser, CI's test command, the docs build that
:func:`test_the_docs_build_with_warnings_as_errors` runs); every public
name in the API reference; the README on one screen.
"""

import importlib
import re
import shlex
import subprocess
import sys

import docs_blocks
import pytest
import versions
from docs_blocks import DOCS, PAGES, ROOT

import optax_lossscale as ols
import optax_lossscale.porting as porting

README = ROOT / "README.md"
CI = (ROOT / ".ci" / "run").read_text()
PYTHON = re.compile(r"^(?:\S*/bin/|\"\$\w+/bin/)?python3?\"?$")


def _name(page):
  return str(page.relative_to(ROOT))


CODE_PAGES = [p for p in PAGES if docs_blocks.blocks(p, "python")]


def test_the_pages_were_found():
  names = {_name(p) for p in CODE_PAGES}
  assert {"README.md", "docs/getting_started.md", "docs/guides/optax.md"} <= names


@versions.examples
@pytest.mark.integration
@pytest.mark.parametrize("page", CODE_PAGES, ids=_name)
def test_the_code_of_the_page_runs_as_pasted(page):
  result = docs_blocks.run_page(page)
  assert result.returncode == 0, (result.stdout[-6000:], result.stderr[-6000:])


# --------------------------------------------------------------------------
# Commands.
# --------------------------------------------------------------------------


def _commands():
  """``(page:line, one command)`` of every bash block, split at ``&&``."""
  out = []
  for page in PAGES:
    for line, code in docs_blocks.blocks(page, "bash"):
      for i, text in enumerate(code.splitlines()):
        for command in text.split("&&"):
          if command.strip() and not command.strip().startswith("#"):
            out.append((f"{_name(page)}:{line + i}", command.strip()))
  return out


COMMANDS = _commands()


def _words(command):
  words = shlex.split(command.rstrip("&").strip())
  env = {}
  while words and re.match(r"^[A-Z_]+=", words[0]):
    key, value = words.pop(0).split("=", 1)
    env[key] = value
  return env, words


def _extras():
  text = (ROOT / "pyproject.toml").read_text()
  section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
  return set(re.findall(r"^(\w+) = \[", section, re.M))


def _ci_suites():
  """CI's test commands (``suite NAME COMMAND...`` lines of ``.ci/run``) as a
  user types them: ``env K=V`` written ``K=V``, no ``timeout N``, the virtual
  environment's python as it is."""
  out = []
  for line in CI.splitlines():
    words = line.split()
    if words[:1] != ["suite"]:
      continue
    words = words[2:]
    if words[:1] == ["env"]:
      words = words[1:]
    if words[:1] == ["timeout"]:
      words = words[2:]
    out.append(" ".join(words))
  return out


def _ci_commands():
  """CI's test commands, with its virtual environment's path written as ``python``."""
  return [re.sub(r'"\$\w+/bin/(\w+)"', r"\1", c) for c in _ci_suites()]


def _normal(command):
  """The command with any ``DIR/bin/`` prefix of a program dropped."""
  env, words = _words(command)
  words = [re.sub(r"^\S*/bin/", "", w) for w in words]
  return " ".join([f"{k}={v}" for k, v in env.items()] + words)


def _check(command):
  """Raises AssertionError unless ``command`` is one the project can vouch for."""
  env, words = _words(command)
  program = words[0]
  if program == "python3" and words[1:3] == ["-m", "venv"]:
    return
  if program.endswith("/pip"):
    assert words[1:3] == ["install", "-e"], command
    extras = re.fullmatch(r"\.\[([\w,]+)\]", words[3])
    assert extras and set(extras.group(1).split(",")) <= _extras(), command
    return
  if program.endswith("/ruff"):
    assert words[1] in ("check", "format"), command
    return
  if program.startswith("benchmarks/"):
    assert (ROOT / program).is_file(), command
    return
  assert PYTHON.match(program) or program.endswith("/python"), command
  if words[1:3] == ["-m", "pytest"] or words[1:3] == ["-m", "sphinx"]:
    known = {_normal(c) for c in _ci_commands()} | {
      _normal(c) for c in _docs_build_commands()
    }
    # the everyday suite: CI's run of every case, sampled
    known |= {k[: -len(" --cases all")] for k in known if k.endswith(" --cases all")}
    assert _normal(command) in known, f"{command!r} is not what CI runs: {known}"
    return
  script = words[1]
  assert (ROOT / script).is_file(), command
  if script.startswith("examples/"):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
      module = importlib.import_module(script[len("examples/") : -len(".py")])
      module.parse_args(words[2:])  # exits 2 on a bad argument
    finally:
      sys.path.remove(str(ROOT / "examples"))


def _docs_build_commands():
  return [c for _, c in COMMANDS if re.search(r"python -m sphinx .*-b html", c)]


@versions.examples  # an example's parser is imported with the example
@pytest.mark.parametrize("where, command", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_documented_command_is_real(where, command):
  try:
    _check(command)
  except SystemExit as e:
    pytest.fail(f"{where}: {command!r} exits {e.code}")


def test_the_readme_gives_ci_test_command_and_ci_keeps_the_users_venv():
  # CI's suite with the newest releases: the README's command, word for word
  # but for the virtual environment's directory.
  readme = {_normal(c) for w, c in COMMANDS if w.startswith("README.md")}
  newest = [c for c in _ci_suites() if '"$venv/bin/python" -m pytest' in c]
  assert len(newest) == 3, newest  # every unit test, integration, multi-device
  for command in newest:
    assert _normal(re.sub(r'"\$venv/bin/python"', "python", command)) in readme, command
  code = [line for line in CI.splitlines() if not line.startswith("#")]
  assert ".venv" not in "\n".join(code).replace(".ci/venv", "")


def test_the_docs_build_with_warnings_as_errors_commands_agree():
  commands = {_normal(c) for c in _docs_build_commands()}
  assert len(commands) == 1, commands


@versions.examples
@pytest.mark.integration
def test_the_docs_build_with_warnings_as_errors(tmp_path):
  pytest.importorskip("sphinx", reason="needs the docs extra: pip install -e '.[docs]'")
  pytest.importorskip("myst_parser", reason="needs the docs extra")
  _, words = _words(_docs_build_commands()[0])
  assert words[-2:] == ["docs", "docs/_build/html"]
  args = [sys.executable, *words[1:-2], str(DOCS), str(tmp_path / "html")]
  result = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert result.returncode == 0, result.stderr[-6000:]
  assert "WARNING" not in result.stderr, result.stderr[-6000:]
  api = (tmp_path / "html" / "api.html").read_text()
  # Rendered by autodoc: one signature per documented name, no reST left raw.
  assert api.count('class="sig sig-object py"') >= len(_documented()), api[:2000]
  for raw in (".. py:", ":param ", ".. rubric::", "```{"):
    assert raw not in api, raw
  assert (tmp_path / "html" / "_modules").is_dir()  # the [source] links
  # The content column uses the page (docs/_static/layout.css), every page.
  for page in ("index.html", "guides/float8.html", "api.html"):
    assert "_static/layout.css" in (tmp_path / "html" / page).read_text(), page


# --------------------------------------------------------------------------
# The API reference and the README.
# --------------------------------------------------------------------------


def _documented():
  text = (DOCS / "api.md").read_text()
  return set(re.findall(r"^\.\. auto\w+:: ([\w.]+)", text, re.M))


def test_every_public_name_is_in_the_api_reference():
  documented = _documented()
  missing = []
  for name in ols.__all__:
    where = "porting" if name in porting.__all__ else None
    full = f"optax_lossscale.{where}.{name}" if where else f"optax_lossscale.{name}"
    if full not in documented:
      missing.append(full)
  flax = pytest.importorskip("optax_lossscale.flax")
  missing += [
    f"optax_lossscale.flax.{n}"
    for n in flax.__all__
    if f"optax_lossscale.flax.{n}" not in documented
  ]
  assert not missing, missing


def test_the_readme_is_one_screen_and_links_into_the_docs():
  text = README.read_text()
  assert len(text.splitlines()) <= 200
  links = re.findall(r"\]\(((?:docs|examples|benchmarks)/[^)#]+)", text)
  assert links, "the README links into the docs"
  for link in links:
    assert (ROOT / link).exists(), link


# --------------------------------------------------------------------------
# Markdown that renders other than it reads.
# --------------------------------------------------------------------------

_LIST_MARKER = re.compile(r"^( *)([*+-]|\d+[.)]) +")


def _list_markers_made_by_wrapping(text: str) -> list[int]:
  """The lines of Markdown ``text`` that start a list inside running text:
  a list marker (``* ``, ``- ``, ``+ ``, ``1. ``) opening a line of a
  paragraph or of a list item's text whose line before does not end with
  ``:`` (or is not the item's first line), or inside an open code span.
  Markdown starts a list there (a nested one in an item): what a wrapped
  formula like ``m = momentum * m`` does when ``* m`` begins a line. A new
  item of the same list is not one."""
  found, fence, para, item = [], False, [], None  # item: marker, text indents
  for n, line in enumerate(text.splitlines(), 1):
    if line.lstrip().startswith(("```", "~~~")):
      fence, para = not fence, []
      continue
    if fence:
      continue
    if not line.strip():
      para = []
      continue
    indent = len(line) - len(line.lstrip(" "))
    marker = _LIST_MARKER.match(line)
    if item and not para and indent < item[1] and not marker:
      item = None  # a paragraph after the list
    if not marker:
      para.append(line)
      continue
    sibling = item is not None and indent < item[1]
    if para and not sibling:
      inside_code = "".join(para).count("`") % 2 == 1
      nested = item is not None and len(para) == 1  # right under its item
      if inside_code or not (nested or para[-1].rstrip().endswith(":")):
        found.append(n)
    item, para = (indent, marker.end()), [line]
  return found


def test_the_marker_check_finds_a_wrapped_formula_and_passes_lists():
  wrapped = "* **SGD**: its momentum is `m = momentum\n  * m - lr * g`, then\n"
  assert _list_markers_made_by_wrapping(wrapped) == [2]
  prose = "The rule is\n- lr * g for each leaf.\n"
  assert _list_markers_made_by_wrapping(prose) == [2]
  lists = "Steps:\n* one\n  more of one\n* two\n  * nested:\n\n1. three\n"
  assert _list_markers_made_by_wrapping(lists) == []
  fenced = "```python\nx = 1\n* 2\n```\n"
  assert _list_markers_made_by_wrapping(fenced) == []


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_no_list_is_started_by_a_wrapped_line(page):
  assert _list_markers_made_by_wrapping(page.read_text()) == [], (
    "a line of running text starts with a list marker (rewrap the paragraph)"
  )
