"""CI fails when a suite fails: every suite runs, and the exit status says so.

``.ci/run`` runs its suites through ``.ci/suites.sh``. Here that library runs
under ``.ci/run``'s own shell options with suites that fail in the ways a
real one does (pytest's exit 1, a timeout's 124, a crash by signal), and
``.ci/run`` itself is read: every test command goes through ``suite``, no
``&&``/``||`` list can swallow a status, and ``finish`` decides the exit.
"""

import re
import shutil
import subprocess

import pytest
from docs_blocks import ROOT

RUN = ROOT / ".ci" / "run"
SUITES = ROOT / ".ci" / "suites.sh"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")


def _code_lines():
  return [
    line.strip()
    for line in RUN.read_text().splitlines()
    if line.strip() and not line.strip().startswith("#")
  ]


def _shell_options():
  (line,) = [x for x in _code_lines() if x.startswith("set ")]
  return line


def _run(body, tmp_path):
  script = f"{_shell_options()}\nsource {SUITES}\n{body}\n"
  return subprocess.run(
    [BASH, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=60
  )


def _pytest_like(summary, status):
  return f"bash -c 'echo \"===== {summary} in 0.10s =====\"; exit {status}'"


FAILURES = {
  "pytest failed": _pytest_like("1 failed, 5 passed", 1),
  "no tests ran": _pytest_like("no tests ran", 5),
  "timed out": "timeout 0.2 sleep 5",
  "killed": "bash -c 'kill -9 $$'",
  "command missing": "no-such-command-anywhere",
}


@pytest.mark.integration
@pytest.mark.parametrize("how", FAILURES)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_failing_suite_fails_the_run_and_the_others_still_run(tmp_path, how, where):
  good = [_pytest_like(f"{i} passed", 0) for i in (3, 4)]
  at = ["first", "middle", "last"].index(where)
  commands = [*good[:at], FAILURES[how], *good[at:]]
  body = "\n".join(f"suite s{i} {c}" for i, c in enumerate(commands)) + "\nfinish"
  result = _run(body, tmp_path)
  assert result.returncode != 0, result.stdout
  bad = commands.index(FAILURES[how])
  summaries = result.stdout.split("=== summaries\n", 1)[1].splitlines()
  assert len([s for s in summaries if re.match(r"s\d: ", s)]) == 3, summaries
  assert "3 passed in" in result.stdout and "4 passed in" in result.stdout
  assert f"failed: s{bad}" in result.stdout


@pytest.mark.integration
def test_passing_suites_pass_and_print_their_summaries(tmp_path):
  body = f"suite one {_pytest_like('3 passed, 1 skipped', 0)}\n"
  body += f"suite two {_pytest_like('7 passed', 0)}\nfinish"
  result = _run(body, tmp_path)
  assert result.returncode == 0, result.stdout + result.stderr
  tail = result.stdout.split("=== summaries\n", 1)[1].splitlines()
  # Each suite's closing line, its status and its wall time; then the run's.
  wall = r"\d+:[0-5]\d wall"
  assert len(tail) == 3, tail
  assert re.fullmatch(
    rf"one: ===== 3 passed, 1 skipped in 0.10s ===== \(exit 0, {wall}\)", tail[0]
  )
  assert re.fullmatch(
    rf"two: ===== 7 passed in 0.10s ===== \(exit 0, {wall}\)", tail[1]
  )
  assert re.fullmatch(rf"total: {wall}", tail[2])


@pytest.mark.integration
def test_each_suite_reports_its_own_wall_time(tmp_path):
  body = "suite quick true\nsuite slow sleep 2\nfinish"
  result = _run(body, tmp_path)
  assert result.returncode == 0, result.stdout + result.stderr
  tail = result.stdout.split("=== summaries\n", 1)[1].splitlines()
  # Bash counts whole seconds: a command may straddle one tick.
  assert re.fullmatch(r"quick: no pytest summary \(exit 0, 0:0[01] wall\)", tail[0])
  assert re.fullmatch(r"slow: no pytest summary \(exit 0, 0:0[23] wall\)", tail[1])
  assert re.fullmatch(r"total: 0:0[23] wall", tail[2])
  assert "=== suite slow: exit 0, 0:0" in result.stdout


@pytest.mark.integration
def test_no_suite_at_all_fails(tmp_path):
  assert _run("finish", tmp_path).returncode != 0


def test_every_test_command_of_ci_is_a_suite_and_finish_decides():
  lines = _code_lines()
  runners = [x for x in lines if re.search(r"-m pytest\b|\btimeout\b", x)]
  assert runners and all(x.startswith("suite ") for x in runners), runners
  # A status inside an && or || list does not stop a `set -e` script: the
  # failing command would only skip the next one.
  assert not [x for x in lines if "&&" in x or "||" in x]
  assert "errexit" in _shell_options() or "-e" in _shell_options().split()[1]
  assert lines.index("source .ci/suites.sh") < lines.index(runners[0])
  assert lines[-1] == "finish"
  names = [x.split()[1] for x in lines if x.startswith("suite ")]
  assert len(names) == len(set(names)) >= 3, names
