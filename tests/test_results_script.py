"""docs/results/regenerate.py: a result file's command, the timings rule, --check.

The real examples are not run here (CI's ``results`` suite runs them): the
result files are made in a temporary directory with commands of one
``python -c`` line each, which the script runs as it runs an example.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from docs_blocks import ROOT

SCRIPT = ROOT / "docs" / "results" / "regenerate.py"


def _module():
  spec = importlib.util.spec_from_file_location("regenerate", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


regenerate = _module()


def _script(*args):
  return subprocess.run(
    [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
  )


def _printing(*lines):
  """A result file's first line: a command that prints ``lines``."""
  return f'$ python -c "print({chr(10).join(lines)!r})"'


@pytest.mark.parametrize(
  "first, words",
  [
    ("$ python examples/train_lm.py", ["python", "examples/train_lm.py"]),
    (
      "$ python examples/train_lm_float8.py --recipe mxfp8 --seed 1",
      ["python", "examples/train_lm_float8.py", "--recipe", "mxfp8", "--seed", "1"],
    ),
    ("$ python -c 'print(1)'", ["python", "-c", "print(1)"]),
  ],
)
def test_the_command_is_the_first_line(first, words):
  assert regenerate.command_of(f"{first}\nrun  loss\n") == words


@pytest.mark.parametrize(
  "text, message",
  [
    ("run  loss\n", "the first line must be '$ COMMAND'"),
    ("$ \n", "must start with 'python'"),
    ("$ rm -rf /\n", "must start with 'python'"),
    ("$python examples/train_lm.py\n", "the first line must be '$ COMMAND'"),
  ],
)
def test_a_file_without_a_python_command_is_refused(text, message):
  with pytest.raises(ValueError, match=message.replace("$", r"\$")):
    regenerate.command_of(text, "x.txt")


TABLE = """\
run        val loss  skipped  ms/step
------------------------------------
float32      2.4086        0    167.6
float8       2.4159        0   1228.1

note: 3.5 ms/step on a GPU 12.0
total time: 98.8 s"""


def test_the_timings_rule_masks_exactly_the_timings():
  masked = regenerate.timings(TABLE).splitlines()
  assert masked == [
    "run        val loss  skipped  ms/step",
    "------------------------------------",
    "float32      2.4086        0 <timing>",
    "float8       2.4159        0 <timing>",
    "",
    "note: 3.5 ms/step on a GPU 12.0",
    "total time: <timing> s",
  ]


@pytest.mark.parametrize(
  "old, new",
  [
    ("167.6", "9.9"),  # a time per step
    ("98.8 s", "1234.5 s"),  # the total time
  ],
)
def test_timings_alone_make_no_difference(old, new):
  assert regenerate.difference("x", TABLE, TABLE.replace(old, new)) == ""


@pytest.mark.parametrize(
  "old, new",
  [
    ("2.4086", "2.4087"),  # a number of the table
    ("        0    167.6", "        1    167.6"),  # the column before the timing
    ("note: 3.5", "note: 3.6"),  # a line after the table
    ("total time: 98.8 s", "total time: 98.8 s!"),  # not a timing line any more
  ],
)
def test_anything_else_is_a_difference(old, new):
  changed = TABLE.replace(old, new)
  assert changed != TABLE
  diff = regenerate.difference("x", TABLE, changed)
  assert diff.startswith("--- x.txt (published)\n+++ x.txt (printed now)\n"), diff


def _written_on(folder, **cpus):
  """Records the CPU each result file in ``folder`` was written on."""
  (folder / regenerate.CPUS_FILE).write_text(json.dumps(cpus))


@pytest.mark.integration
def test_check_passes_on_a_file_that_matches_and_fails_with_a_diff_otherwise(
  tmp_path,
):
  same = _printing("loss 1.5", "total time: 3.0 s")
  (tmp_path / "same.txt").write_text(f"{same}\nloss 1.5\ntotal time: 1.0 s\n")
  stale = _printing("loss 2.5")
  (tmp_path / "stale.txt").write_text(f"{stale}\nloss 1.5\n")
  _written_on(tmp_path, same=regenerate.cpu(), stale=regenerate.cpu())

  ok = _script("--check", "--results", str(tmp_path), "same")
  assert ok.returncode == 0, ok.stdout + ok.stderr
  assert "same: same" in ok.stdout

  bad = _script("--check", "--results", str(tmp_path))
  assert bad.returncode == 1, bad.stdout + bad.stderr
  assert "--- stale.txt (published)\n+++ stale.txt (printed now)\n" in bad.stdout
  assert "\n-loss 1.5\n+loss 2.5\n" in bad.stdout
  assert "failed: stale" in bad.stderr
  assert re.search(r"^===== 1 passed, 1 failed in [0-9.]+s =====$", bad.stdout, re.M)
  # --check writes nothing.
  assert (tmp_path / "stale.txt").read_text() == f"{stale}\nloss 1.5\n"


@pytest.mark.integration
def test_regenerating_writes_the_command_line_and_what_it_printed(tmp_path):
  first = _printing("run  loss", "a    2.5")
  (tmp_path / "a.txt").write_text(f"{first}\nrun  loss\na    1.5\n")
  _written_on(tmp_path, b="another CPU")
  result = _script("--results", str(tmp_path), "a.txt")
  assert result.returncode == 0, result.stdout + result.stderr
  assert (tmp_path / "a.txt").read_text() == f"{first}\nrun  loss\na    2.5\n"
  # the file's CPU is recorded, the others' kept
  recorded = json.loads((tmp_path / regenerate.CPUS_FILE).read_text())
  assert recorded == {"a": regenerate.cpu(), "b": "another CPU"}
  check = _script("--check", "--results", str(tmp_path), "a")
  assert check.returncode == 0 and "not compared" not in check.stdout, check.stdout


@pytest.mark.integration
@pytest.mark.parametrize(
  "published, passes",
  [
    ("run  loss\na    1.5", True),  # numbers only: not compared
    ("run  loss\na    -1e-3", True),
    ("run  loss\nb    2.5", False),  # a label
    ("run  gain\na    2.5", False),  # a column
    ("run  loss\na    2.5\na    2.5", False),  # a line
  ],
)
def test_on_another_cpu_everything_but_the_numbers_is_compared(
  published, passes, tmp_path
):
  first = _printing("run  loss", "a    2.5")
  (tmp_path / "a.txt").write_text(f"{first}\n{published}\n")
  _written_on(tmp_path, a="Another CPU; avx2")
  result = _script("--check", "--results", str(tmp_path))
  assert (result.returncode == 0) == passes, result.stdout + result.stderr
  said = f"a: written on Another CPU; avx2, checked on {regenerate.cpu()}: "
  assert said + "numbers not compared" in result.stdout
  # a file whose CPU is not recorded is compared as on another CPU
  (tmp_path / regenerate.CPUS_FILE).unlink()
  result = _script("--check", "--results", str(tmp_path))
  assert (result.returncode == 0) == passes, result.stdout + result.stderr
  assert "a: written on a CPU not recorded, checked on" in result.stdout


@pytest.mark.parametrize(
  "cpuinfo, cpu",
  [
    (
      "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse4_2 avx avx2 "
      "fma f16c\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 7B13\n",
      "AMD EPYC 7B13; sse4_2 avx avx2 fma f16c",
    ),
    (
      "processor\t: 0\nFeatures\t: fp asimd fphp sve\nCPU part\t: 0xd40\n",
      "0xd40; asimd sve fphp",
    ),
  ],
)
def test_the_cpu_is_its_model_and_the_instruction_sets_xla_compiles_for(
  cpuinfo, cpu, tmp_path
):
  (tmp_path / "cpuinfo").write_text(cpuinfo)
  assert regenerate.cpu(str(tmp_path / "cpuinfo")) == cpu
  assert regenerate.cpu(str(tmp_path / "missing")) != ""


def test_the_files_ci_checks_record_their_cpu():
  """CI's results suite compares their numbers on the CPU they were
  written on; every recorded name is a result file."""
  ci = (ROOT / ".ci" / "run").read_text()
  checked = re.search(r"regenerate\.py --check --jobs 2 ([\w ]+)", ci)[1].split()
  recorded = regenerate.recorded_cpus(str(SCRIPT.parent))
  assert "train_lm" in checked and set(checked) <= set(recorded), checked
  assert all((SCRIPT.parent / f"{name}.txt").is_file() for name in recorded)


@pytest.mark.integration
def test_a_failing_command_writes_nothing_and_fails(tmp_path):
  text = "$ python -c \"import sys; print('half'); sys.exit('broken')\"\nold\n"
  (tmp_path / "a.txt").write_text(text)
  for args in ([], ["--check"]):
    result = _script(*args, "--results", str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "exited 1" in result.stderr and "broken" in result.stderr
    assert (tmp_path / "a.txt").read_text() == text


def _meeting(here, other, folder):
  """A result file's first line: a command that marks itself started, waits up
  to a minute for ``other`` to start too, and prints whether it did."""
  code = (
    f"import pathlib, time; d = pathlib.Path('{folder}'); "
    f"(d / '{here}.started').touch(); end = time.time() + 60; "
    f"met = lambda: (d / '{other}.started').exists(); "
    "any(time.sleep(0.05) for _ in iter(lambda: met() or time.time() > end, True)); "
    f"print('{here} met' if met() else '{here} alone')"
  )
  return f'$ python -c "{code}"'


@pytest.mark.integration
def test_jobs_run_commands_at_the_same_time_and_report_in_order(tmp_path):
  # Each command finishes "met" only if the other ran while it waited.
  marks = tmp_path / "marks"
  marks.mkdir()
  for here, other in (("b", "a"), ("a", "b")):
    (tmp_path / f"{here}.txt").write_text(
      f"{_meeting(here, other, marks)}\n{here} met\n"
    )
  result = _script("--check", "--jobs", "2", "--results", str(tmp_path), "b", "a")
  assert result.returncode == 0, result.stdout + result.stderr
  reports = [line for line in result.stdout.splitlines() if ": same" in line]
  assert [r.split(":")[0] for r in reports] == ["b", "a"], result.stdout


@pytest.mark.parametrize("jobs", ["0", "-1"])
def test_jobs_below_one_are_an_argparse_error(jobs, capsys, tmp_path):
  with pytest.raises(SystemExit) as e:
    regenerate.parse_args(["--jobs", jobs, "--results", str(tmp_path)])
  assert e.value.code == 2
  assert f"--jobs must be at least 1, got {jobs}" in capsys.readouterr().err


@pytest.mark.integration
def test_an_unknown_name_is_an_argparse_error(tmp_path):
  (tmp_path / "a.txt").write_text(_printing("x") + "\nx\n")
  result = _script("--check", "--results", str(tmp_path), "b")
  assert result.returncode == 2
  assert "no result file b (known: a)" in result.stderr


def test_every_published_file_names_a_script_of_the_repository():
  """An example, or a benchmark whose result a guide cites."""
  names = sorted(p.stem for p in SCRIPT.parent.glob("*.txt"))
  assert "train_lm_seed0" in names
  for name in names:
    words = regenerate.command_of((SCRIPT.parent / f"{name}.txt").read_text(), name)
    assert words[1].startswith(("examples/", "benchmarks/")), words
    assert (ROOT / words[1]).is_file(), words
  for plot, source in regenerate.PLOTS.items():
    assert (SCRIPT.parent / plot).is_file() and source in names, plot


@pytest.mark.integration
@pytest.mark.skipif(
  not hasattr(os, "sched_getaffinity"), reason="needs CPU affinity (Linux)"
)
def test_commands_run_on_two_cpus_without_the_callers_xla_and_jax_variables(
  tmp_path,
):
  # What the command sees, printed as its result: the CPUs it may use and
  # the variables that would change XLA's numbers.
  probe = (
    "import os; print(len(os.sched_getaffinity(0)), os.environ.get('XLA_FLAGS'), "
    "os.environ.get('JAX_ENABLE_X64'), os.environ['JAX_PLATFORMS'])"
  )
  (tmp_path / "env.txt").write_text(f'$ python -c "{probe}"\n')
  env = dict(os.environ, XLA_FLAGS="--xla_cpu_multi_thread_eigen=false")
  env["JAX_ENABLE_X64"] = "1"
  result = subprocess.run(
    [sys.executable, str(SCRIPT), "--results", str(tmp_path)],
    capture_output=True,
    text=True,
    timeout=120,
    env=env,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  cpus = min(regenerate.CPUS, len(os.sched_getaffinity(0)))
  assert (tmp_path / "env.txt").read_text().splitlines()[1] == f"{cpus} None None cpu"
